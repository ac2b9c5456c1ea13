//! The login and text negotiation engine (RFC 7143 sections 6 and 13), sans-IO and usable by
//! both roles: the target answers offers and proposes only what the RFC defaults would violate;
//! the initiator proposes its settings and checks the answers.
//!
//! One [`Negotiator`] serves one connection's login, then its full feature phase text
//! exchanges. Feed it each reassembled request or response with [`Negotiator::receive`]; send what
//! it returns. The login state machine (PDU sequencing, T/C bits, TSIH) stays with the caller and
//! asks [`Negotiator::may_transit`] before it sets the T bit.

use crate::chap::{ChapCredentials, ChapError, ChapInitiator, ChapTarget, ENTROPY_LEN};
use crate::names::valid_iscsi_name;
use crate::pdu::LoginStatus;
use crate::text::{boolean, parse_boolean, parse_number, TextError, TextParams};
use crate::types::Stage;

/// Which side of the login this engine plays.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    /// Proposes, checks answers.
    Initiator,
    /// Answers offers.
    Target,
}

/// SessionType.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum SessionType {
    /// A discovery session: only SendTargets in full feature phase.
    Discovery,
    /// A normal session.
    #[default]
    Normal,
}

impl SessionType {
    fn as_str(self) -> &'static str {
        match self {
            SessionType::Discovery => "Discovery",
            SessionType::Normal => "Normal",
        }
    }
}

/// A digest algorithm for HeaderDigest / DataDigest.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DigestAlgorithm {
    /// No digest.
    None,
    /// CRC32C.
    Crc32c,
}

impl DigestAlgorithm {
    /// The key value.
    pub fn as_str(self) -> &'static str {
        match self {
            DigestAlgorithm::None => "None",
            DigestAlgorithm::Crc32c => "CRC32C",
        }
    }
}

/// An AuthMethod this crate implements.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AuthMethod {
    /// No authentication.
    None,
    /// CHAP with MD5.
    Chap,
}

impl AuthMethod {
    /// The key value.
    pub fn as_str(self) -> &'static str {
        match self {
            AuthMethod::None => "None",
            AuthMethod::Chap => "CHAP",
        }
    }
}

/// A TaskReporting value (RFC 7143 section 13.23).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum TaskReporting {
    /// RFC3720 semantics (the default).
    #[default]
    Rfc3720,
    /// ResponseFence.
    ResponseFence,
    /// FastAbort.
    FastAbort,
}

impl TaskReporting {
    /// The key value.
    pub fn as_str(self) -> &'static str {
        match self {
            TaskReporting::Rfc3720 => "RFC3720",
            TaskReporting::ResponseFence => "ResponseFence",
            TaskReporting::FastAbort => "FastAbort",
        }
    }

    fn parse(s: &str) -> Option<Self> {
        [
            TaskReporting::Rfc3720,
            TaskReporting::ResponseFence,
            TaskReporting::FastAbort,
        ]
        .into_iter()
        .find(|t| t.as_str() == s)
    }
}

/// The declarations that name a session's ends (RFC 7143 sections 13.4 to 13.9 and 13.21): in
/// [`Settings`] what one side declares, in [`SessionParams`] what both sides declared.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Declarations {
    /// SessionType (the initiator's).
    pub session_type: SessionType,
    /// InitiatorName.
    pub initiator_name: Option<String>,
    /// InitiatorAlias.
    pub initiator_alias: Option<String>,
    /// TargetName (the initiator names the target it wants; normal sessions only).
    pub target_name: Option<String>,
    /// TargetAlias.
    pub target_alias: Option<String>,
    /// TargetPortalGroupTag (the target's, declared in normal sessions).
    pub target_portal_group_tag: Option<u16>,
}

/// Authentication settings. For a target, `peer` are the initiator's credentials to verify and
/// `local` the target's own for mutual CHAP; for an initiator, `local` are its credentials and
/// `peer` what the target must prove.
#[derive(Debug, Clone, Default)]
pub struct AuthSettings {
    /// AuthMethod values in preference order; empty means `[None]`.
    pub methods: Vec<AuthMethod>,
    /// This side's CHAP credentials.
    pub local: Option<ChapCredentials>,
    /// The peer's CHAP credentials.
    pub peer: Option<ChapCredentials>,
    /// Target only: refuse initiators that do not ask for mutual CHAP.
    pub require_mutual: bool,
}

/// The numeric and boolean operational keys (RFC 7143 section 13), one field each, holding the
/// RFC defaults until set. [`Settings`] hold what a side offers; [`SessionParams`] what was agreed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OperationalParams {
    /// MaxConnections.
    pub max_connections: u16,
    /// InitialR2T.
    pub initial_r2t: bool,
    /// ImmediateData.
    pub immediate_data: bool,
    /// MaxBurstLength.
    pub max_burst_length: u32,
    /// FirstBurstLength.
    pub first_burst_length: u32,
    /// DefaultTime2Wait.
    pub default_time2wait: u16,
    /// DefaultTime2Retain.
    pub default_time2retain: u16,
    /// MaxOutstandingR2T.
    pub max_outstanding_r2t: u16,
    /// DataPDUInOrder.
    pub data_pdu_in_order: bool,
    /// DataSequenceInOrder.
    pub data_sequence_in_order: bool,
    /// ErrorRecoveryLevel.
    pub error_recovery_level: u8,
    /// iSCSIProtocolLevel.
    pub iscsi_protocol_level: u8,
    /// RDMAExtensions (RFC 7145 section 6.3): the session runs over iSER, its data moved by
    /// RDMA. In a side's [`Settings`]: whether this connection can (an iSER connection); a
    /// TCP connection answers No.
    pub rdma_extensions: bool,
}

impl Default for OperationalParams {
    /// The RFC defaults.
    fn default() -> Self {
        OperationalParams {
            max_connections: 1,
            initial_r2t: true,
            immediate_data: true,
            max_burst_length: 262_144,
            first_burst_length: 65_536,
            default_time2wait: 2,
            default_time2retain: 20,
            max_outstanding_r2t: 1,
            data_pdu_in_order: true,
            data_sequence_in_order: true,
            error_recovery_level: 0,
            iscsi_protocol_level: 1,
            rdma_extensions: false,
        }
    }
}

impl OperationalParams {
    /// The value of a numeric key; `None` for any other key.
    pub fn number(&self, key: &str) -> Option<u64> {
        Some(match key {
            "MaxConnections" => self.max_connections.into(),
            "MaxBurstLength" => self.max_burst_length.into(),
            "FirstBurstLength" => self.first_burst_length.into(),
            "DefaultTime2Wait" => self.default_time2wait.into(),
            "DefaultTime2Retain" => self.default_time2retain.into(),
            "MaxOutstandingR2T" => self.max_outstanding_r2t.into(),
            "ErrorRecoveryLevel" => self.error_recovery_level.into(),
            "iSCSIProtocolLevel" => self.iscsi_protocol_level.into(),
            _ => return None,
        })
    }

    /// The value of a boolean key; `None` for any other key.
    pub fn boolean(&self, key: &str) -> Option<bool> {
        Some(match key {
            "InitialR2T" => self.initial_r2t,
            "ImmediateData" => self.immediate_data,
            "DataPDUInOrder" => self.data_pdu_in_order,
            "DataSequenceInOrder" => self.data_sequence_in_order,
            "RDMAExtensions" => self.rdma_extensions,
            _ => return None,
        })
    }

    /// Stores a numeric key's value, already checked against the key's range. FirstBurstLength
    /// never exceeds MaxBurstLength (RFC 7143 section 13.14).
    fn set_number(&mut self, key: &str, n: u64) {
        // The key tables bound every range below its field's width.
        match key {
            "MaxConnections" => self.max_connections = n as u16,
            "MaxBurstLength" => self.max_burst_length = n as u32,
            "FirstBurstLength" => self.first_burst_length = n as u32,
            "DefaultTime2Wait" => self.default_time2wait = n as u16,
            "DefaultTime2Retain" => self.default_time2retain = n as u16,
            "MaxOutstandingR2T" => self.max_outstanding_r2t = n as u16,
            "ErrorRecoveryLevel" => self.error_recovery_level = n as u8,
            "iSCSIProtocolLevel" => self.iscsi_protocol_level = n as u8,
            _ => {}
        }
        self.first_burst_length = self.first_burst_length.min(self.max_burst_length);
    }

    /// Stores a boolean key's value.
    fn set_boolean(&mut self, key: &str, v: bool) {
        match key {
            "InitialR2T" => self.initial_r2t = v,
            "ImmediateData" => self.immediate_data = v,
            "DataPDUInOrder" => self.data_pdu_in_order = v,
            "DataSequenceInOrder" => self.data_sequence_in_order = v,
            "RDMAExtensions" => self.rdma_extensions = v,
            _ => {}
        }
    }
}

/// What one side supports and prefers. For a target these bound what it accepts; for an initiator
/// they are what it proposes.
#[derive(Debug, Clone)]
pub struct Settings {
    /// HeaderDigest values, in preference order.
    pub header_digest: Vec<DigestAlgorithm>,
    /// DataDigest values, in preference order.
    pub data_digest: Vec<DigestAlgorithm>,
    /// MaxRecvDataSegmentLength this side declares.
    pub max_recv_data_segment_length: u32,
    /// The numeric and boolean keys.
    pub operational: OperationalParams,
    /// TaskReporting values supported, in preference order.
    pub task_reporting: Vec<TaskReporting>,
    /// Authentication.
    pub auth: AuthSettings,
    /// What this side declares about itself (and, for an initiator, the target it wants).
    pub declarations: Declarations,
}

impl Default for Settings {
    /// The RFC defaults, with both digests supported (None preferred) and iSCSIProtocolLevel 1.
    fn default() -> Self {
        Settings {
            header_digest: vec![DigestAlgorithm::None, DigestAlgorithm::Crc32c],
            data_digest: vec![DigestAlgorithm::None, DigestAlgorithm::Crc32c],
            max_recv_data_segment_length: 8192,
            operational: OperationalParams::default(),
            task_reporting: vec![TaskReporting::Rfc3720],
            auth: AuthSettings::default(),
            declarations: Declarations::default(),
        }
    }
}

/// A setting outside what the RFC allows, naming the key.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{key}: {reason}")]
pub struct SettingsError {
    /// The key, in the RFC's words.
    pub key: &'static str,
    /// Why it is refused.
    pub reason: String,
}

impl Settings {
    /// Checks every value against the RFC's range for its key.
    pub fn validate(&self) -> Result<(), SettingsError> {
        let err = |key, reason: String| Err(SettingsError { key, reason });
        // iSER's lengths follow MaxRecvDataSegmentLength's setting, checked below.
        for def in KEYS.iter().filter(|d| !is_iser_key(d.name)) {
            if let Kind::Min(lo, hi) | Kind::Max(lo, hi) = def.kind {
                let v = self.operational.number(def.name).unwrap_or(0);
                if v < lo || v > hi {
                    return err(def.name, format!("{v} is outside {lo}..={hi}"));
                }
            }
        }
        let mrdsl = u64::from(self.max_recv_data_segment_length);
        if !(512..=MAX_SEGMENT).contains(&mrdsl) {
            return err(
                "MaxRecvDataSegmentLength",
                format!("{mrdsl} is outside 512..={MAX_SEGMENT}"),
            );
        }
        let op = &self.operational;
        if op.first_burst_length > op.max_burst_length {
            return err(
                "FirstBurstLength",
                format!(
                    "{} exceeds MaxBurstLength {}",
                    op.first_burst_length, op.max_burst_length
                ),
            );
        }
        if self.header_digest.is_empty() || self.data_digest.is_empty() {
            return err("HeaderDigest", "at least one digest value is needed".into());
        }
        if self.auth.methods.contains(&AuthMethod::Chap)
            && self.auth.local.is_none()
            && self.auth.peer.is_none()
        {
            return err("AuthMethod", "CHAP needs credentials".into());
        }
        for (key, name) in [
            ("InitiatorName", &self.declarations.initiator_name),
            ("TargetName", &self.declarations.target_name),
        ] {
            if let Some(n) = name {
                if !valid_iscsi_name(n) {
                    return err(key, format!("{n:?} is not an iqn., eui. or naa. name"));
                }
            }
        }
        Ok(())
    }

    fn local_list(&self, key: &str) -> Vec<&'static str> {
        match key {
            "HeaderDigest" => self.header_digest.iter().map(|d| d.as_str()).collect(),
            "DataDigest" => self.data_digest.iter().map(|d| d.as_str()).collect(),
            "TaskReporting" => self.task_reporting.iter().map(|t| t.as_str()).collect(),
            "AuthMethod" if self.auth.methods.is_empty() => vec!["None"],
            "AuthMethod" => self.auth.methods.iter().map(|m| m.as_str()).collect(),
            _ => Vec::new(),
        }
    }
}

/// The largest MaxRecvDataSegmentLength, MaxBurstLength and FirstBurstLength: 2^24 - 1.
const MAX_SEGMENT: u64 = (1 << 24) - 1;

/// The session-wide outcome of negotiation (RFC defaults until negotiated).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SessionParams {
    /// What both sides declared.
    pub declared: Declarations,
    /// The numeric and boolean keys.
    pub operational: OperationalParams,
    /// TaskReporting.
    pub task_reporting: TaskReporting,
    /// The AuthMethod agreed, if the security stage ran.
    pub auth_method: Option<AuthMethod>,
}

impl Default for SessionParams {
    fn default() -> Self {
        SessionParams {
            declared: Declarations::default(),
            operational: OperationalParams::default(),
            task_reporting: TaskReporting::Rfc3720,
            auth_method: None,
        }
    }
}

/// The per-connection outcome of negotiation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ConnectionParams {
    /// HeaderDigest=CRC32C.
    pub header_digest: bool,
    /// DataDigest=CRC32C.
    pub data_digest: bool,
    /// The MaxRecvDataSegmentLength this side declared: the longest segment it accepts.
    pub max_recv_data_segment_length: u32,
    /// The peer's MaxRecvDataSegmentLength: the longest segment this side may send.
    pub max_send_data_segment_length: u32,
}

impl Default for ConnectionParams {
    fn default() -> Self {
        ConnectionParams {
            header_digest: false,
            data_digest: false,
            max_recv_data_segment_length: 8192,
            max_send_data_segment_length: 8192,
        }
    }
}

/// Why negotiation failed. [`NegotiationError::login_status`] gives the Login Response status.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum NegotiationError {
    /// The text itself is malformed.
    #[error("malformed text: {0}")]
    Text(#[from] TextError),
    /// A key was sent where the RFC does not allow it (wrong stage or wrong sender).
    #[error("{key} not allowed: {reason}")]
    KeyNotAllowed {
        /// The key.
        key: String,
        /// Why.
        reason: &'static str,
    },
    /// A key was negotiated a second time in one login or text exchange.
    #[error("{0} negotiated twice")]
    KeyRenegotiated(String),
    /// A declared value is malformed.
    #[error("invalid value {value:?} for {key}")]
    InvalidValue {
        /// The key.
        key: String,
        /// The value.
        value: String,
    },
    /// An answer to this side's proposal breaks the key's result function.
    #[error("answer {value:?} to our {key} proposal is not allowed")]
    InvalidAnswer {
        /// The key.
        key: String,
        /// The answer.
        value: String,
    },
    /// The peer would not agree to a value this side needs (the RFC default does not do).
    #[error("no acceptable value for {0}")]
    NoAgreement(String),
    /// The peer's SessionType is not one this side serves.
    #[error("session type {0:?} not supported")]
    SessionTypeNotSupported(String),
    /// A key this side needs was never declared (InitiatorName, TargetName of a normal session).
    #[error("{0} missing")]
    MissingParameter(&'static str),
    /// Authentication failed or was skipped where it is required.
    /// (Its text includes the CHAP error's, so it is not also given as a source: a chain
    /// printed whole would say it twice.)
    #[error("authentication failed: {0}")]
    Authentication(ChapError),
    /// No AuthMethod in common, or the login skipped the security stage this side requires.
    #[error("authentication required")]
    AuthenticationRequired,
}

impl From<ChapError> for NegotiationError {
    fn from(e: ChapError) -> NegotiationError {
        NegotiationError::Authentication(e)
    }
}

impl NegotiationError {
    /// The Login Response status for this error.
    pub fn login_status(&self) -> LoginStatus {
        match self {
            NegotiationError::Authentication(_) | NegotiationError::AuthenticationRequired => {
                LoginStatus::AUTHENTICATION_FAILURE
            }
            NegotiationError::MissingParameter(_) => LoginStatus::MISSING_PARAMETER,
            NegotiationError::SessionTypeNotSupported(_) => LoginStatus::SESSION_TYPE_NOT_SUPPORTED,
            _ => LoginStatus::INITIATOR_ERROR,
        }
    }
}

/// The result function of a key (RFC 7143 section 6.2).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    /// Boolean, result is OR.
    Or,
    /// Boolean, result is AND.
    And,
    /// Number in a range, result is the minimum.
    Min(u64, u64),
    /// Number in a range, result is the maximum.
    Max(u64, u64),
    /// List of values, result is the first the acceptor supports.
    List,
    /// Declared, not negotiated.
    Declarative,
    /// Obsolete (markers): answered with a fixed value.
    Obsolete(&'static str),
}

/// Where a key may be used (RFC 7143 section 13's "Use").
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Usage {
    /// Login only, every connection.
    Io,
    /// Login of the leading connection only.
    Lo,
    /// Login and full feature phase.
    All,
    /// Full feature phase only.
    Ffpo,
    /// Security stage only.
    Security,
}

#[derive(Debug, Clone, Copy)]
struct KeyDef {
    name: &'static str,
    kind: Kind,
    usage: Usage,
    from_initiator: bool,
    from_target: bool,
    /// Answered `Irrelevant` in discovery sessions.
    discovery_irrelevant: bool,
}

const fn key(name: &'static str, kind: Kind, usage: Usage, i: bool, t: bool, d: bool) -> KeyDef {
    KeyDef {
        name,
        kind,
        usage,
        from_initiator: i,
        from_target: t,
        discovery_irrelevant: d,
    }
}

const N16: u64 = 65_535;

/// Every key of RFC 7143 section 13 (and iSCSIProtocolLevel of RFC 7144).
static KEYS: &[KeyDef] = &[
    key("HeaderDigest", Kind::List, Usage::Io, true, true, false),
    key("DataDigest", Kind::List, Usage::Io, true, true, false),
    key(
        "MaxConnections",
        Kind::Min(1, N16),
        Usage::Lo,
        true,
        true,
        true,
    ),
    key(
        "SendTargets",
        Kind::Declarative,
        Usage::Ffpo,
        true,
        false,
        false,
    ),
    key(
        "TargetName",
        Kind::Declarative,
        Usage::Io,
        true,
        true,
        false,
    ),
    key(
        "InitiatorName",
        Kind::Declarative,
        Usage::Io,
        true,
        false,
        false,
    ),
    key(
        "TargetAlias",
        Kind::Declarative,
        Usage::All,
        false,
        true,
        false,
    ),
    key(
        "InitiatorAlias",
        Kind::Declarative,
        Usage::All,
        true,
        false,
        false,
    ),
    key(
        "TargetAddress",
        Kind::Declarative,
        Usage::All,
        false,
        true,
        false,
    ),
    key(
        "TargetPortalGroupTag",
        Kind::Declarative,
        Usage::Io,
        false,
        true,
        false,
    ),
    key("InitialR2T", Kind::Or, Usage::Lo, true, true, true),
    key("ImmediateData", Kind::And, Usage::Lo, true, true, true),
    key(
        "MaxRecvDataSegmentLength",
        Kind::Declarative,
        Usage::All,
        true,
        true,
        false,
    ),
    key(
        "MaxBurstLength",
        Kind::Min(512, MAX_SEGMENT),
        Usage::Lo,
        true,
        true,
        true,
    ),
    key(
        "FirstBurstLength",
        Kind::Min(512, MAX_SEGMENT),
        Usage::Lo,
        true,
        true,
        true,
    ),
    key(
        "DefaultTime2Wait",
        Kind::Max(0, 3600),
        Usage::Lo,
        true,
        true,
        false,
    ),
    key(
        "DefaultTime2Retain",
        Kind::Min(0, 3600),
        Usage::Lo,
        true,
        true,
        false,
    ),
    key(
        "MaxOutstandingR2T",
        Kind::Min(1, N16),
        Usage::Lo,
        true,
        true,
        true,
    ),
    key("DataPDUInOrder", Kind::Or, Usage::Lo, true, true, true),
    key("DataSequenceInOrder", Kind::Or, Usage::Lo, true, true, true),
    key(
        "ErrorRecoveryLevel",
        Kind::Min(0, 2),
        Usage::Lo,
        true,
        true,
        false,
    ),
    key(
        "SessionType",
        Kind::Declarative,
        Usage::Lo,
        true,
        false,
        false,
    ),
    key("AuthMethod", Kind::List, Usage::Security, true, true, false),
    key("TaskReporting", Kind::List, Usage::Lo, true, true, false),
    key(
        "iSCSIProtocolLevel",
        Kind::Min(0, 31),
        Usage::Lo,
        true,
        true,
        false,
    ),
    // iSER's keys (RFC 7145 section 6). Under RDMAExtensions=Yes the two RecvDataSegmentLength
    // keys stand for MaxRecvDataSegmentLength, one per direction.
    key("RDMAExtensions", Kind::And, Usage::Lo, true, true, true),
    key(
        "TargetRecvDataSegmentLength",
        Kind::Min(512, MAX_SEGMENT),
        Usage::Io,
        true,
        true,
        true,
    ),
    key(
        "InitiatorRecvDataSegmentLength",
        Kind::Min(512, MAX_SEGMENT),
        Usage::Io,
        true,
        true,
        true,
    ),
    key(
        "MaxOutstandingUnexpectedPDUs",
        Kind::Declarative,
        Usage::Lo,
        true,
        true,
        true,
    ),
    // Markers were removed by RFC 7143; old initiators still offer them.
    key(
        "IFMarker",
        Kind::Obsolete("No"),
        Usage::Io,
        true,
        true,
        false,
    ),
    key(
        "OFMarker",
        Kind::Obsolete("No"),
        Usage::Io,
        true,
        true,
        false,
    ),
    key(
        "IFMarkInt",
        Kind::Obsolete("Irrelevant"),
        Usage::Io,
        true,
        true,
        false,
    ),
    key(
        "OFMarkInt",
        Kind::Obsolete("Irrelevant"),
        Usage::Io,
        true,
        true,
        false,
    ),
];

fn lookup(name: &str) -> Option<&'static KeyDef> {
    KEYS.iter().find(|k| k.name == name)
}

/// The RFC default of a list-valued key (the others are in [`OperationalParams::default`]).
fn default_list_value(key: &str) -> &'static str {
    match key {
        "TaskReporting" => "RFC3720",
        // HeaderDigest, DataDigest, AuthMethod.
        _ => "None",
    }
}

/// iSER's keys besides RDMAExtensions: irrelevant unless RDMAExtensions=Yes.
fn is_iser_key(key: &str) -> bool {
    matches!(
        key,
        "TargetRecvDataSegmentLength"
            | "InitiatorRecvDataSegmentLength"
            | "MaxOutstandingUnexpectedPDUs"
    )
}

/// The default of TargetRecvDataSegmentLength and InitiatorRecvDataSegmentLength (RFC 7145
/// section 6.4).
const ISER_RECV_DATA_SEGMENT_LENGTH: u64 = 8192;

/// Keys whose values the CHAP state machines consume.
fn is_chap_key(key: &str) -> bool {
    matches!(key, "CHAP_A" | "CHAP_I" | "CHAP_C" | "CHAP_N" | "CHAP_R")
}

#[derive(Debug)]
enum Auth {
    /// AuthMethod not yet agreed.
    Pending,
    /// CHAP in progress, target side.
    ChapTarget(Box<ChapTarget>),
    /// CHAP in progress, initiator side.
    ChapInitiator(Box<ChapInitiator>),
    /// Authentication finished (or None agreed).
    Done,
}

/// One connection's negotiation state.
#[derive(Debug)]
pub struct Negotiator {
    role: Role,
    settings: Settings,
    leading: bool,
    entropy: [u8; ENTROPY_LEN],
    session: SessionParams,
    connection: ConnectionParams,
    /// Keys settled in the current login or text exchange.
    settled: Vec<&'static str>,
    /// This side's proposals awaiting an answer, with the value proposed.
    pending: Vec<(&'static str, String)>,
    /// Declarations and proposals already sent.
    sent: Vec<&'static str>,
    auth: Auth,
}

impl Negotiator {
    /// A negotiator for a leading connection (a new session) or, with `leading = false`, for a
    /// connection joining an existing session. `entropy` seeds CHAP identifiers and challenges:
    /// give fresh random bytes for every login.
    pub fn new(role: Role, settings: Settings, leading: bool, entropy: [u8; ENTROPY_LEN]) -> Self {
        let connection = ConnectionParams {
            max_recv_data_segment_length: 8192,
            ..ConnectionParams::default()
        };
        let session = SessionParams {
            declared: Declarations {
                session_type: settings.declarations.session_type,
                ..Declarations::default()
            },
            ..SessionParams::default()
        };
        Negotiator {
            role,
            settings,
            leading,
            entropy,
            session,
            connection,
            settled: Vec::new(),
            pending: Vec::new(),
            sent: Vec::new(),
            auth: Auth::Pending,
        }
    }

    /// A negotiator for a connection whose login ended in another process, which handed
    /// the connection over ([`crate::handover`]): `session` and `connection` are what was
    /// agreed there; only text exchanges are left to it, so authentication is done.
    pub fn established(
        role: Role,
        settings: Settings,
        session: SessionParams,
        connection: ConnectionParams,
    ) -> Self {
        Negotiator {
            role,
            settings,
            leading: false,
            entropy: [0; ENTROPY_LEN],
            session,
            connection,
            settled: Vec::new(),
            pending: Vec::new(),
            sent: Vec::new(),
            auth: Auth::Done,
        }
    }

    /// The session parameters agreed so far.
    pub fn session(&self) -> &SessionParams {
        &self.session
    }

    /// The connection parameters agreed so far.
    pub fn connection(&self) -> &ConnectionParams {
        &self.connection
    }

    /// Whether this side still waits for answers to its proposals or for CHAP to finish.
    pub fn is_waiting(&self) -> bool {
        !self.pending.is_empty()
            || matches!(self.auth, Auth::ChapTarget(_) | Auth::ChapInitiator(_))
    }

    /// Whether the connection runs iSER: what the leading login agreed on RDMAExtensions; for
    /// a connection joining a session, what the transport is (the key is the session's).
    fn rdma(&self) -> bool {
        if self.leading {
            self.session.operational.rdma_extensions
        } else {
            self.settings.operational.rdma_extensions
        }
    }

    /// Whether the settings ask for iSER in a normal session: the iSER keys are offered.
    fn wants_rdma(&self) -> bool {
        self.settings.operational.rdma_extensions
            && self.session.declared.session_type == SessionType::Normal
    }

    /// Whether authentication is required by this side's settings.
    fn auth_required(&self) -> bool {
        !self.settings.local_list("AuthMethod").contains(&"None")
    }

    /// Whether authentication has completed (or was not needed and None was agreed or defaulted).
    pub fn authenticated(&self) -> bool {
        match self.auth {
            Auth::Done => true,
            Auth::Pending => !self.auth_required(),
            _ => false,
        }
    }

    /// Whether the login may move from `from` to `to` now: `Ok(false)` while answers or CHAP
    /// steps are outstanding, an error if it would leave (or skip) a security stage this side
    /// requires before authentication completed.
    pub fn may_transit(&self, from: Stage, to: Stage) -> Result<bool, NegotiationError> {
        let leaves_security =
            from != Stage::SecurityNegotiation || to != Stage::SecurityNegotiation;
        if leaves_security && self.auth_required() && !matches!(self.auth, Auth::Done) {
            if matches!(self.auth, Auth::ChapTarget(_) | Auth::ChapInitiator(_)) {
                return Ok(false);
            }
            return Err(NegotiationError::AuthenticationRequired);
        }
        // An iSER connection carries a normal session only with RDMAExtensions=Yes: its data
        // can move no other way (RFC 7145 section 5.1).
        if to == Stage::FullFeaturePhase
            && self.role == Role::Target
            && self.leading
            && self.wants_rdma()
            && !self.session.operational.rdma_extensions
            && !self.is_waiting()
        {
            return Err(NegotiationError::MissingParameter("RDMAExtensions"));
        }
        Ok(!self.is_waiting())
    }

    /// Starts a new full feature phase text exchange: keys may be negotiated again.
    pub fn begin_text_exchange(&mut self) {
        self.settled.clear();
    }

    /// Checks the declarations a target needs from the first login request: InitiatorName, and
    /// TargetName for a normal session.
    pub fn require_initiator_declarations(&self) -> Result<(), NegotiationError> {
        if self.session.declared.initiator_name.is_none() {
            return Err(NegotiationError::MissingParameter("InitiatorName"));
        }
        if self.session.declared.session_type == SessionType::Normal
            && self.session.declared.target_name.is_none()
        {
            return Err(NegotiationError::MissingParameter("TargetName"));
        }
        Ok(())
    }

    /// What this side sends in its next PDU of `stage` without being asked: an initiator's
    /// declarations and proposals, a target's declarations and the proposals the RFC defaults
    /// would otherwise violate. Each key goes out once.
    pub fn offers(&mut self, stage: Stage) -> TextParams {
        let mut out = TextParams::new();
        self.add_offers(stage, &mut out);
        out
    }

    /// Handles one reassembled request (target) or response (initiator) of `stage` and returns
    /// the keys to send back: answers, CHAP steps, and this side's own offers.
    ///
    /// SendTargets is left to the caller, which knows the targets.
    pub fn receive(
        &mut self,
        stage: Stage,
        text: &TextParams,
    ) -> Result<TextParams, NegotiationError> {
        if self.role == Role::Target
            && stage != Stage::SecurityNegotiation
            && self.auth_required()
            && !matches!(self.auth, Auth::Done)
        {
            return Err(NegotiationError::AuthenticationRequired);
        }
        let mut out = TextParams::new();
        // SessionType first, since it decides which keys are relevant; FirstBurstLength last, so
        // it can be bounded by MaxBurstLength's outcome.
        // RDMAExtensions first too: it decides what the RecvDataSegmentLength keys mean.
        let rank = |k: &str| match k {
            "SessionType" | "RDMAExtensions" => 0,
            "FirstBurstLength" => 2,
            _ => 1,
        };
        let ordered = (0..3).flat_map(|r| text.iter().filter(move |(k, _)| rank(k) == r));
        let chap = text.iter().any(|(k, _)| is_chap_key(k));
        for (key, value) in ordered {
            if is_chap_key(key) {
                continue;
            }
            if let Some(i) = self.pending.iter().position(|(k, _)| *k == key) {
                let (name, proposed) = self.pending.remove(i);
                self.settled.push(name);
                self.check_answer(name, &proposed, value)?;
                continue;
            }
            self.offer_received(stage, key, value, &mut out)?;
        }
        let step = match &self.auth {
            Auth::ChapTarget(_) => chap,
            Auth::ChapInitiator(i) => chap || !i.started(),
            Auth::Pending | Auth::Done => chap,
        };
        if step {
            if stage != Stage::SecurityNegotiation {
                return Err(NegotiationError::KeyNotAllowed {
                    key: "CHAP_A".into(),
                    reason: "CHAP keys belong to the security stage",
                });
            }
            self.chap_step(text, &mut out)?;
        }
        self.add_offers(stage, &mut out);
        Ok(out)
    }

    /// Handles a key the peer offered or declared.
    fn offer_received(
        &mut self,
        stage: Stage,
        key: &str,
        value: &str,
        out: &mut TextParams,
    ) -> Result<(), NegotiationError> {
        let Some(def) = lookup(key) else {
            // X- and X# extension keys and anything unknown.
            out.push(key, "NotUnderstood");
            return Ok(());
        };
        if def.name == "SendTargets"
            && stage == Stage::FullFeaturePhase
            && self.role == Role::Target
        {
            return Ok(());
        }
        let allowed_sender = match self.role {
            Role::Target => def.from_initiator,
            Role::Initiator => def.from_target,
        };
        if !allowed_sender {
            return Err(NegotiationError::KeyNotAllowed {
                key: key.into(),
                reason: "not sent by this role",
            });
        }
        let login = stage != Stage::FullFeaturePhase;
        match def.usage {
            Usage::Security if stage != Stage::SecurityNegotiation => {
                return Err(NegotiationError::KeyNotAllowed {
                    key: key.into(),
                    reason: "security stage only",
                });
            }
            Usage::Ffpo if login => {
                return Err(NegotiationError::KeyNotAllowed {
                    key: key.into(),
                    reason: "full feature phase only",
                });
            }
            Usage::Io | Usage::Lo if !login => {
                out.push(key, "Reject");
                return Ok(());
            }
            _ => {}
        }
        if self.settled.contains(&def.name) {
            return Err(NegotiationError::KeyRenegotiated(key.into()));
        }
        self.settled.push(def.name);
        let irrelevant = (def.usage == Usage::Lo && !self.leading && def.kind != Kind::Declarative)
            || (def.discovery_irrelevant
                && self.session.declared.session_type == SessionType::Discovery)
            || (is_iser_key(def.name) && !self.rdma());
        if irrelevant {
            out.push(key, "Irrelevant");
            return Ok(());
        }
        let r = match def.kind {
            Kind::Declarative => self.declared(def.name, value),
            Kind::Obsolete(answer) => {
                out.push(key, answer);
                Ok(())
            }
            _ => self.accept(def, value).map(|answer| out.push(key, answer)),
        };
        match r {
            // In full feature phase a value out of the key's range is answered, not fatal: the
            // key keeps its value and the session goes on (RFC 7143 section 6.2).
            Err(NegotiationError::InvalidValue { .. }) if !login => {
                out.push(key, "Reject");
                Ok(())
            }
            r => r,
        }
    }

    /// Answers an offer as the acceptor and applies the result.
    fn accept(&mut self, def: &KeyDef, offered: &str) -> Result<String, NegotiationError> {
        let reject = || Ok("Reject".to_string());
        let result = match def.kind {
            Kind::Or | Kind::And => {
                let Some(theirs) = parse_boolean(offered) else {
                    return reject();
                };
                let ours = self.settings.operational.boolean(def.name).unwrap_or(false);
                boolean(if def.kind == Kind::Or {
                    theirs || ours
                } else {
                    theirs && ours
                })
                .to_string()
            }
            Kind::Min(lo, hi) | Kind::Max(lo, hi) => {
                let Some(theirs) = parse_number(offered).filter(|n| (lo..=hi).contains(n)) else {
                    return reject();
                };
                let mut ours = self.local_number(def.name);
                if def.name == "FirstBurstLength" {
                    ours = ours.min(u64::from(self.session.operational.max_burst_length));
                }
                let v = if matches!(def.kind, Kind::Min(..)) {
                    theirs.min(ours)
                } else {
                    theirs.max(ours)
                };
                v.to_string()
            }
            Kind::List => {
                let ours = self.settings.local_list(def.name);
                match offered.split(',').find(|v| ours.contains(v)) {
                    Some(v) => v.to_string(),
                    None if def.name == "AuthMethod" => {
                        return Err(NegotiationError::AuthenticationRequired)
                    }
                    None => return reject(),
                }
            }
            Kind::Declarative | Kind::Obsolete(_) => unreachable!("not negotiated"),
        };
        self.apply(def.name, &result)?;
        Ok(result)
    }

    /// Checks the peer's answer to this side's proposal and applies it.
    fn check_answer(
        &mut self,
        key: &'static str,
        proposed: &str,
        answer: &str,
    ) -> Result<(), NegotiationError> {
        let def = lookup(key).expect("only known keys are proposed");
        let invalid = || NegotiationError::InvalidAnswer {
            key: key.into(),
            value: answer.into(),
        };
        if def.kind == Kind::Declarative {
            // A declaration needs no answer; a peer that echoes one is tolerated.
            return Ok(());
        }
        if matches!(answer, "Reject" | "Irrelevant" | "NotUnderstood") {
            // The key keeps its default, which must do for this side.
            if key == "AuthMethod" {
                return Err(NegotiationError::AuthenticationRequired);
            }
            if answer != "Irrelevant" && !self.default_acceptable(def) {
                return Err(NegotiationError::NoAgreement(key.into()));
            }
            return Ok(());
        }
        let ok = match def.kind {
            Kind::Or | Kind::And => {
                let (Some(p), Some(a)) = (parse_boolean(proposed), parse_boolean(answer)) else {
                    return Err(invalid());
                };
                // OR: a proposed Yes stays Yes. AND: a proposed No stays No.
                if def.kind == Kind::Or {
                    !p || a
                } else {
                    p || !a
                }
            }
            Kind::Min(lo, hi) | Kind::Max(lo, hi) => {
                let (Some(p), Some(a)) = (parse_number(proposed), parse_number(answer)) else {
                    return Err(invalid());
                };
                (lo..=hi).contains(&a)
                    && if matches!(def.kind, Kind::Min(..)) {
                        a <= p
                    } else {
                        a >= p
                    }
            }
            Kind::List => proposed.split(',').any(|v| v == answer),
            Kind::Declarative | Kind::Obsolete(_) => true,
        };
        if !ok {
            return Err(invalid());
        }
        self.apply(key, answer)
    }

    /// Whether the RFC default of `def` is within this side's settings.
    fn default_acceptable(&self, def: &KeyDef) -> bool {
        let (rfc, ours) = (OperationalParams::default(), &self.settings.operational);
        let number = |p: &OperationalParams| p.number(def.name).unwrap_or(0);
        match def.kind {
            // OR keys default to Yes, which every side can do.
            Kind::Or => true,
            Kind::And => {
                ours.boolean(def.name).unwrap_or(false) || rfc.boolean(def.name) == Some(false)
            }
            Kind::Min(..) if is_iser_key(def.name) => {
                ISER_RECV_DATA_SEGMENT_LENGTH <= self.local_number(def.name)
            }
            Kind::Min(..) => number(&rfc) <= number(ours),
            Kind::Max(..) => number(&rfc) >= number(ours),
            Kind::List => self
                .settings
                .local_list(def.name)
                .contains(&default_list_value(def.name)),
            Kind::Declarative | Kind::Obsolete(_) => true,
        }
    }

    /// Records a value the peer declared.
    fn declared(&mut self, key: &'static str, value: &str) -> Result<(), NegotiationError> {
        let invalid = || NegotiationError::InvalidValue {
            key: key.into(),
            value: value.into(),
        };
        match key {
            // Under iSER the RecvDataSegmentLength keys say it.
            "MaxRecvDataSegmentLength" if self.rdma() => {}
            "MaxOutstandingUnexpectedPDUs" => {
                // 0 (no limit) or 2 and more (RFC 7145 section 6.5). Nothing here sends
                // unexpected PDUs beyond a NOP-In ping and an Asynchronous Message.
                parse_number(value)
                    .filter(|&n| n == 0 || (2..=u64::from(u32::MAX)).contains(&n))
                    .ok_or_else(invalid)?;
            }
            "MaxRecvDataSegmentLength" => {
                let n = parse_number(value)
                    .filter(|n| (512..=MAX_SEGMENT).contains(n))
                    .ok_or_else(invalid)?;
                self.connection.max_send_data_segment_length = n as u32;
            }
            "InitiatorName" | "TargetName" => {
                if !valid_iscsi_name(value) {
                    return Err(invalid());
                }
                let name = Some(value.to_ascii_lowercase());
                if key == "InitiatorName" {
                    self.session.declared.initiator_name = name;
                } else {
                    self.session.declared.target_name = name;
                }
            }
            "InitiatorAlias" => self.session.declared.initiator_alias = Some(value.into()),
            "TargetAlias" => self.session.declared.target_alias = Some(value.into()),
            "TargetAddress" => {}
            "TargetPortalGroupTag" => {
                let n = parse_number(value)
                    .filter(|&n| n <= N16)
                    .ok_or_else(invalid)?;
                self.session.declared.target_portal_group_tag = Some(n as u16);
            }
            "SessionType" => {
                self.session.declared.session_type = match value {
                    "Discovery" => SessionType::Discovery,
                    "Normal" => SessionType::Normal,
                    other => return Err(NegotiationError::SessionTypeNotSupported(other.into())),
                };
            }
            _ => {}
        }
        Ok(())
    }

    /// Stores an agreed value.
    fn apply(&mut self, key: &str, value: &str) -> Result<(), NegotiationError> {
        let invalid = || NegotiationError::InvalidValue {
            key: key.into(),
            value: value.into(),
        };
        let op = &mut self.session.operational;
        if op.number(key).is_some() {
            op.set_number(key, parse_number(value).ok_or_else(invalid)?);
        } else if op.boolean(key).is_some() {
            op.set_boolean(key, parse_boolean(value).ok_or_else(invalid)?);
        } else {
            match key {
                "HeaderDigest" => self.connection.header_digest = value == "CRC32C",
                "DataDigest" => self.connection.data_digest = value == "CRC32C",
                "TaskReporting" => {
                    self.session.task_reporting = TaskReporting::parse(value).ok_or_else(invalid)?
                }
                "AuthMethod" => self.auth_agreed(value)?,
                "TargetRecvDataSegmentLength" | "InitiatorRecvDataSegmentLength" => {
                    let n = parse_number(value).ok_or_else(invalid)? as u32;
                    let c = &mut self.connection;
                    // What the target receives is what the initiator sends, and back.
                    let receives =
                        (key == "TargetRecvDataSegmentLength") == (self.role == Role::Target);
                    if receives {
                        c.max_recv_data_segment_length = n;
                    } else {
                        c.max_send_data_segment_length = n;
                    }
                }
                _ => {}
            }
        }
        Ok(())
    }

    /// Starts the authentication the AuthMethod result calls for.
    fn auth_agreed(&mut self, method: &str) -> Result<(), NegotiationError> {
        let a = &self.settings.auth;
        self.auth = match method {
            "None" => {
                self.session.auth_method = Some(AuthMethod::None);
                Auth::Done
            }
            "CHAP" => {
                self.session.auth_method = Some(AuthMethod::Chap);
                match self.role {
                    Role::Target => {
                        let peer = a
                            .peer
                            .clone()
                            .ok_or(NegotiationError::AuthenticationRequired)?;
                        let t = ChapTarget::new(peer, a.local.clone(), self.entropy)?
                            .require_mutual(a.require_mutual);
                        Auth::ChapTarget(Box::new(t))
                    }
                    Role::Initiator => {
                        let local = a
                            .local
                            .clone()
                            .ok_or(NegotiationError::AuthenticationRequired)?;
                        Auth::ChapInitiator(Box::new(ChapInitiator::new(
                            local,
                            a.peer.clone(),
                            self.entropy,
                        )?))
                    }
                }
            }
            _ => return Err(NegotiationError::AuthenticationRequired),
        };
        Ok(())
    }

    /// Runs one CHAP step on the CHAP keys of `text`.
    fn chap_step(
        &mut self,
        text: &TextParams,
        out: &mut TextParams,
    ) -> Result<(), NegotiationError> {
        let done = match &mut self.auth {
            Auth::ChapTarget(t) => {
                t.receive(text, out)?;
                t.is_done()
            }
            Auth::ChapInitiator(i) => {
                if !i.started() {
                    // The AuthMethod=CHAP answer just arrived: offer the algorithm.
                    i.start(out);
                    false
                } else {
                    i.receive(text, out)?;
                    i.is_done()
                }
            }
            _ => {
                return Err(NegotiationError::KeyNotAllowed {
                    key: "CHAP_A".into(),
                    reason: "CHAP was not agreed",
                })
            }
        };
        if done {
            self.auth = Auth::Done;
        }
        Ok(())
    }

    fn propose(&mut self, key: &'static str, value: String, out: &mut TextParams) {
        self.sent.push(key);
        self.pending.push((key, value.clone()));
        out.push(key, value);
    }

    fn declare(&mut self, key: &'static str, value: String, out: &mut TextParams) {
        self.sent.push(key);
        out.push(key, value);
    }

    fn add_offers(&mut self, stage: Stage, out: &mut TextParams) {
        if stage == Stage::FullFeaturePhase {
            return;
        }
        let normal = self.session.declared.session_type == SessionType::Normal;
        let st = self.settings.clone();
        // Declarations go out once whatever the peer declared; a proposal only for a key that
        // neither side has settled yet.
        let undeclared = |n: &Negotiator, k: &str| !n.sent.contains(&k);
        let unsent = |n: &Negotiator, k: &str| !n.sent.contains(&k) && !n.settled.contains(&k);
        let d = &st.declarations;
        match self.role {
            Role::Initiator => {
                let decl = [
                    ("InitiatorName", d.initiator_name.clone()),
                    ("InitiatorAlias", d.initiator_alias.clone()),
                    ("SessionType", Some(d.session_type.as_str().to_string())),
                    ("TargetName", d.target_name.clone().filter(|_| normal)),
                ];
                for (k, v) in decl {
                    if let Some(v) = v.filter(|_| undeclared(self, k)) {
                        self.declare(k, v, out);
                    }
                }
                if stage == Stage::SecurityNegotiation {
                    if unsent(self, "AuthMethod") {
                        self.propose("AuthMethod", st.local_list("AuthMethod").join(","), out);
                    }
                    return;
                }
            }
            Role::Target => {
                let decl = [
                    (
                        "TargetPortalGroupTag",
                        d.target_portal_group_tag.map(|t| t.to_string()),
                    ),
                    ("TargetAlias", d.target_alias.clone()),
                ];
                for (k, v) in decl {
                    if let Some(v) = v.filter(|_| normal && undeclared(self, k)) {
                        self.declare(k, v, out);
                    }
                }
                if stage != Stage::LoginOperationalNegotiation {
                    return;
                }
            }
        }
        // The operational stage: both sides declare what they receive, then propose. An
        // initiator proposes every negotiated key; a target only those whose RFC default would
        // break its settings (it answers the rest).
        // Under iSER (a normal session) the RecvDataSegmentLength keys take its place.
        if undeclared(self, "MaxRecvDataSegmentLength") && !self.wants_rdma() {
            self.connection.max_recv_data_segment_length = st.max_recv_data_segment_length;
            self.declare(
                "MaxRecvDataSegmentLength",
                st.max_recv_data_segment_length.to_string(),
                out,
            );
        }
        for def in KEYS {
            let negotiated = matches!(
                def.kind,
                Kind::Or | Kind::And | Kind::Min(..) | Kind::Max(..) | Kind::List
            );
            if !negotiated || def.usage == Usage::Security || !unsent(self, def.name) {
                continue;
            }
            if def.usage == Usage::Lo && !self.leading || def.discovery_irrelevant && !normal {
                continue;
            }
            let iser = def.name == "RDMAExtensions" || is_iser_key(def.name);
            if iser && !self.wants_rdma() {
                continue;
            }
            // A target on an iSER connection asks for RDMAExtensions=Yes if the initiator has
            // not: the session cannot run without it.
            let needed = iser && def.name == "RDMAExtensions";
            if self.role == Role::Target && self.default_acceptable(def) && !needed {
                continue;
            }
            let value = self.local_value(def);
            self.propose(def.name, value, out);
        }
    }

    /// This side's value for a numeric key: the RecvDataSegmentLength keys of iSER are bounded
    /// by what it receives (MaxRecvDataSegmentLength's setting), as is what it sends.
    fn local_number(&self, key: &str) -> u64 {
        match key {
            "TargetRecvDataSegmentLength" | "InitiatorRecvDataSegmentLength" => {
                u64::from(self.settings.max_recv_data_segment_length)
            }
            _ => self.settings.operational.number(key).unwrap_or(0),
        }
    }

    /// This side's value for a negotiated key, in wire form.
    fn local_value(&self, def: &KeyDef) -> String {
        match def.kind {
            Kind::Or | Kind::And => {
                boolean(self.settings.operational.boolean(def.name).unwrap_or(false)).to_string()
            }
            Kind::Min(..) | Kind::Max(..) => self.local_number(def.name).to_string(),
            _ => self.settings.local_list(def.name).join(","),
        }
    }
}

#[cfg(test)]
mod tests;
