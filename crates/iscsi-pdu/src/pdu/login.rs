//! Login Request and Login Response (RFC 7143 sections 11.12 and 11.13).

use bytes::Bytes;

use super::{no_ahs, Body, Pdu};
use crate::bhs::{Fields, Opcode, View};
use crate::error::{DecodeError, PduError};
use crate::serial::SerialNumber;
use crate::types::{Isid, Stage};

fn stage_flags(transit: bool, cont: bool, csg: Stage, nsg: Stage) -> u8 {
    u8::from(transit) << 7 | u8::from(cont) << 6 | csg.bits() << 2 | nsg.bits()
}

fn check_transit_continue(flags: u8) -> Result<(), PduError> {
    if flags & 0xc0 == 0xc0 {
        return Err(PduError::InvalidField {
            field: "T and C bits",
            reason: "both set",
        });
    }
    Ok(())
}

fn isid_tsih(f: View<'_>) -> (Isid, u16) {
    (Isid(f.bytes(8)), u16::from_be_bytes(f.bytes(14)))
}

fn put_isid_tsih(f: &mut Fields, isid: Isid, tsih: u16) {
    f.lun[..6].copy_from_slice(&isid.0);
    f.lun[6..].copy_from_slice(&tsih.to_be_bytes());
}

/// Login Request. The I bit is always set on the wire.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LoginRequest {
    /// T bit: the initiator is ready to move to `next_stage`.
    pub transit: bool,
    /// C bit: the text continues in the next PDU.
    pub continue_bit: bool,
    /// CSG.
    pub current_stage: Stage,
    /// NSG (meaningful with the T bit).
    pub next_stage: Stage,
    /// Version-max.
    pub version_max: u8,
    /// Version-min.
    pub version_min: u8,
    /// ISID.
    pub isid: Isid,
    /// TSIH: 0 for a new session, the session's for a new connection of it.
    pub tsih: u16,
    /// Initiator Task Tag.
    pub initiator_task_tag: u32,
    /// CID.
    pub cid: u16,
    /// CmdSN.
    pub cmd_sn: SerialNumber,
    /// ExpStatSN.
    pub exp_stat_sn: SerialNumber,
    /// Text key=value pairs.
    pub data: Bytes,
}

impl Default for LoginRequest {
    fn default() -> Self {
        LoginRequest {
            transit: false,
            continue_bit: false,
            current_stage: Stage::SecurityNegotiation,
            next_stage: Stage::SecurityNegotiation,
            version_max: 0,
            version_min: 0,
            isid: Isid::default(),
            tsih: 0,
            initiator_task_tag: 0,
            cid: 0,
            cmd_sn: SerialNumber(0),
            exp_stat_sn: SerialNumber(0),
            data: Bytes::new(),
        }
    }
}

impl Body for LoginRequest {
    const OPCODE: Opcode = Opcode::LoginRequest;

    #[inline(always)]
    fn decode(f: View<'_>, ahs: Option<Bytes>, data: Bytes) -> Result<Pdu, DecodeError> {
        no_ahs(&ahs)?;
        let flags = f.b(1);
        check_transit_continue(flags)?;
        let (isid, tsih) = isid_tsih(f);
        Ok(Pdu::LoginRequest(LoginRequest {
            transit: flags & 0x80 != 0,
            continue_bit: flags & 0x40 != 0,
            current_stage: Stage::from_bits(flags >> 2),
            next_stage: Stage::from_bits(flags),
            version_max: f.b(2),
            version_min: f.b(3),
            isid,
            tsih,
            initiator_task_tag: f.w(0),
            cid: f.half(1, true),
            cmd_sn: SerialNumber(f.w(2)),
            exp_stat_sn: SerialNumber(f.w(3)),
            data,
        }))
    }

    fn encode(&self, f: &mut Fields) {
        f.b[1] = stage_flags(
            self.transit,
            self.continue_bit,
            self.current_stage,
            self.next_stage,
        );
        f.b[2] = self.version_max;
        f.b[3] = self.version_min;
        put_isid_tsih(f, self.isid, self.tsih);
        f.w[0] = self.initiator_task_tag;
        f.w[1] = u32::from(self.cid) << 16;
        f.w[2] = self.cmd_sn.0;
        f.w[3] = self.exp_stat_sn.0;
    }

    fn immediate(&self) -> bool {
        true
    }

    fn data(&self) -> &Bytes {
        &self.data
    }
}

/// Status-Class of a Login Response (RFC 7143 section 11.13.5).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum LoginStatusClass {
    /// 0: the login proceeds.
    Success,
    /// 1: the target moved; TargetAddress says where.
    Redirection,
    /// 2: the initiator erred; retrying the same login will not help.
    InitiatorError,
    /// 3: the target could not serve the login now.
    TargetError,
    /// Any other class.
    Other(u8),
}

/// Status-Class and Status-Detail of a Login Response.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct LoginStatus(pub u16);

impl LoginStatus {
    /// 0x0000 Success.
    pub const SUCCESS: LoginStatus = LoginStatus(0x0000);
    /// 0x0101 Target moved temporarily.
    pub const TARGET_MOVED_TEMPORARILY: LoginStatus = LoginStatus(0x0101);
    /// 0x0102 Target moved permanently.
    pub const TARGET_MOVED_PERMANENTLY: LoginStatus = LoginStatus(0x0102);
    /// 0x0200 Initiator error (miscellaneous).
    pub const INITIATOR_ERROR: LoginStatus = LoginStatus(0x0200);
    /// 0x0201 Authentication failure.
    pub const AUTHENTICATION_FAILURE: LoginStatus = LoginStatus(0x0201);
    /// 0x0202 Authorization failure.
    pub const AUTHORIZATION_FAILURE: LoginStatus = LoginStatus(0x0202);
    /// 0x0203 Not found.
    pub const NOT_FOUND: LoginStatus = LoginStatus(0x0203);
    /// 0x0204 Target removed.
    pub const TARGET_REMOVED: LoginStatus = LoginStatus(0x0204);
    /// 0x0205 Unsupported version.
    pub const UNSUPPORTED_VERSION: LoginStatus = LoginStatus(0x0205);
    /// 0x0206 Too many connections.
    pub const TOO_MANY_CONNECTIONS: LoginStatus = LoginStatus(0x0206);
    /// 0x0207 Missing parameter.
    pub const MISSING_PARAMETER: LoginStatus = LoginStatus(0x0207);
    /// 0x0208 Can't include in session.
    pub const CANT_INCLUDE_IN_SESSION: LoginStatus = LoginStatus(0x0208);
    /// 0x0209 Session type not supported.
    pub const SESSION_TYPE_NOT_SUPPORTED: LoginStatus = LoginStatus(0x0209);
    /// 0x020a Session does not exist.
    pub const SESSION_DOES_NOT_EXIST: LoginStatus = LoginStatus(0x020a);
    /// 0x020b Invalid request during login.
    pub const INVALID_DURING_LOGIN: LoginStatus = LoginStatus(0x020b);
    /// 0x0300 Target error (miscellaneous).
    pub const TARGET_ERROR: LoginStatus = LoginStatus(0x0300);
    /// 0x0301 Service unavailable.
    pub const SERVICE_UNAVAILABLE: LoginStatus = LoginStatus(0x0301);
    /// 0x0302 Out of resources.
    pub const OUT_OF_RESOURCES: LoginStatus = LoginStatus(0x0302);

    /// Status-Class.
    pub fn class(self) -> LoginStatusClass {
        match (self.0 >> 8) as u8 {
            0 => LoginStatusClass::Success,
            1 => LoginStatusClass::Redirection,
            2 => LoginStatusClass::InitiatorError,
            3 => LoginStatusClass::TargetError,
            c => LoginStatusClass::Other(c),
        }
    }

    /// Status-Detail.
    pub fn detail(self) -> u8 {
        self.0 as u8
    }

    /// Every status RFC 7143 section 11.13.5 names, success first.
    pub const ALL: [LoginStatus; 19] = [
        LoginStatus::SUCCESS,
        LoginStatus::TARGET_MOVED_TEMPORARILY,
        LoginStatus::TARGET_MOVED_PERMANENTLY,
        LoginStatus::INITIATOR_ERROR,
        LoginStatus::AUTHENTICATION_FAILURE,
        LoginStatus::AUTHORIZATION_FAILURE,
        LoginStatus::NOT_FOUND,
        LoginStatus::TARGET_REMOVED,
        LoginStatus::UNSUPPORTED_VERSION,
        LoginStatus::TOO_MANY_CONNECTIONS,
        LoginStatus::MISSING_PARAMETER,
        LoginStatus::CANT_INCLUDE_IN_SESSION,
        LoginStatus::SESSION_TYPE_NOT_SUPPORTED,
        LoginStatus::SESSION_DOES_NOT_EXIST,
        LoginStatus::INVALID_DURING_LOGIN,
        LoginStatus::TARGET_ERROR,
        LoginStatus::SERVICE_UNAVAILABLE,
        LoginStatus::OUT_OF_RESOURCES,
        LoginStatus(0xffff),
    ];

    /// Its name in lower snake case ("authentication_failure"), for logs and metric labels;
    /// "other" for a status the RFC does not name.
    pub fn name(self) -> &'static str {
        match self {
            LoginStatus::SUCCESS => "success",
            LoginStatus::TARGET_MOVED_TEMPORARILY => "target_moved_temporarily",
            LoginStatus::TARGET_MOVED_PERMANENTLY => "target_moved_permanently",
            LoginStatus::INITIATOR_ERROR => "initiator_error",
            LoginStatus::AUTHENTICATION_FAILURE => "authentication_failure",
            LoginStatus::AUTHORIZATION_FAILURE => "authorization_failure",
            LoginStatus::NOT_FOUND => "not_found",
            LoginStatus::TARGET_REMOVED => "target_removed",
            LoginStatus::UNSUPPORTED_VERSION => "unsupported_version",
            LoginStatus::TOO_MANY_CONNECTIONS => "too_many_connections",
            LoginStatus::MISSING_PARAMETER => "missing_parameter",
            LoginStatus::CANT_INCLUDE_IN_SESSION => "cant_include_in_session",
            LoginStatus::SESSION_TYPE_NOT_SUPPORTED => "session_type_not_supported",
            LoginStatus::SESSION_DOES_NOT_EXIST => "session_does_not_exist",
            LoginStatus::INVALID_DURING_LOGIN => "invalid_during_login",
            LoginStatus::TARGET_ERROR => "target_error",
            LoginStatus::SERVICE_UNAVAILABLE => "service_unavailable",
            LoginStatus::OUT_OF_RESOURCES => "out_of_resources",
            _ => "other",
        }
    }

    /// Its place in [`LoginStatus::ALL`] (the last, "other", for a status the RFC does not
    /// name).
    pub fn index(self) -> usize {
        LoginStatus::ALL[..18]
            .iter()
            .position(|&s| s == self)
            .unwrap_or(18)
    }
}

impl core::fmt::Debug for LoginStatus {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        write!(f, "LoginStatus({:#06x})", self.0)
    }
}

/// Login Response.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LoginResponse {
    /// T bit: the target agrees to move to `next_stage`.
    pub transit: bool,
    /// C bit: the text continues in the next PDU.
    pub continue_bit: bool,
    /// CSG.
    pub current_stage: Stage,
    /// NSG.
    pub next_stage: Stage,
    /// Version-max.
    pub version_max: u8,
    /// Version-active.
    pub version_active: u8,
    /// ISID, echoed.
    pub isid: Isid,
    /// TSIH: the session's, set in the final response of a leading login.
    pub tsih: u16,
    /// Initiator Task Tag, echoed.
    pub initiator_task_tag: u32,
    /// StatSN.
    pub stat_sn: SerialNumber,
    /// ExpCmdSN.
    pub exp_cmd_sn: SerialNumber,
    /// MaxCmdSN.
    pub max_cmd_sn: SerialNumber,
    /// Status-Class and Status-Detail.
    pub status: LoginStatus,
    /// Text key=value pairs.
    pub data: Bytes,
}

impl Default for LoginResponse {
    fn default() -> Self {
        LoginResponse {
            transit: false,
            continue_bit: false,
            current_stage: Stage::SecurityNegotiation,
            next_stage: Stage::SecurityNegotiation,
            version_max: 0,
            version_active: 0,
            isid: Isid::default(),
            tsih: 0,
            initiator_task_tag: 0,
            stat_sn: SerialNumber(0),
            exp_cmd_sn: SerialNumber(0),
            max_cmd_sn: SerialNumber(0),
            status: LoginStatus::SUCCESS,
            data: Bytes::new(),
        }
    }
}

impl Body for LoginResponse {
    const OPCODE: Opcode = Opcode::LoginResponse;

    #[inline(always)]
    fn decode(f: View<'_>, ahs: Option<Bytes>, data: Bytes) -> Result<Pdu, DecodeError> {
        no_ahs(&ahs)?;
        let flags = f.b(1);
        check_transit_continue(flags)?;
        let (isid, tsih) = isid_tsih(f);
        Ok(Pdu::LoginResponse(LoginResponse {
            transit: flags & 0x80 != 0,
            continue_bit: flags & 0x40 != 0,
            current_stage: Stage::from_bits(flags >> 2),
            next_stage: Stage::from_bits(flags),
            version_max: f.b(2),
            version_active: f.b(3),
            isid,
            tsih,
            initiator_task_tag: f.w(0),
            stat_sn: SerialNumber(f.w(2)),
            exp_cmd_sn: SerialNumber(f.w(3)),
            max_cmd_sn: SerialNumber(f.w(4)),
            status: LoginStatus(f.half(5, true)),
            data,
        }))
    }

    fn encode(&self, f: &mut Fields) {
        f.b[1] = stage_flags(
            self.transit,
            self.continue_bit,
            self.current_stage,
            self.next_stage,
        );
        f.b[2] = self.version_max;
        f.b[3] = self.version_active;
        put_isid_tsih(f, self.isid, self.tsih);
        f.w[0] = self.initiator_task_tag;
        f.w[2] = self.stat_sn.0;
        f.w[3] = self.exp_cmd_sn.0;
        f.w[4] = self.max_cmd_sn.0;
        f.w[5] = u32::from(self.status.0) << 16;
    }

    fn data(&self) -> &Bytes {
        &self.data
    }
}
