//! A session's state as one target process hands it to the next, so that an upgrade keeps the
//! session: what login negotiated, the CmdSN window, the unit attentions its I_T nexus has
//! pending, and for each connection its StatSN, its digests and segment lengths, and the bytes its reader had taken off the socket but not yet
//! made into PDUs. The connection's socket itself goes beside it (SCM_RIGHTS); what went on
//! in it before is not here, because a connection is handed over only when quiescent: no task
//! in flight, nothing queued to send, no exchange half done
//! ([`Connection::handover`](crate::target_node::Connection::handover)).
//!
//! The encoding is versioned and checked, since the process that reads it may be another
//! build than the one that wrote it, and a state accepted wrongly would answer an initiator
//! with the wrong sequence numbers: a header (magic, [`VERSION`], body length, bounded by
//! [`MAX_BODY`] before anything is allocated for it), the body, then the body's CRC32C. A
//! reader refuses another version, a bad checksum, a field out of its range and trailing
//! bytes, each with a [`HandoverError`] that says which; then the old process keeps serving.

use crate::negotiation::{
    AuthMethod, ConnectionParams, Declarations, OperationalParams, SessionParams, SessionType,
    TaskReporting,
};
use crate::{Isid, SerialNumber};
use scsi_core::sealed::{Reader, Seal, SealError};
use scsi_core::Asc;

/// The first bytes of an encoded handover.
pub const MAGIC: [u8; 4] = *b"iSHO";

/// The encoding this build writes and reads.
pub const VERSION: u16 = 1;

/// Bytes of the header: magic, version, two reserved bytes, the body's length.
pub const HEADER_LEN: usize = scsi_core::sealed::HEADER_LEN;

/// The longest body a reader accepts, checked before it allocates for one.
pub const MAX_BODY: u32 = 64 << 20;

/// The most unread bytes one connection may carry (several PDUs the initiator sent ahead).
pub const MAX_UNREAD: usize = 16 << 20;

/// The longest name or alias carried (iSCSI names are at most 223 bytes).
const MAX_TEXT: usize = 4096;

/// The largest MaxRecvDataSegmentLength, MaxBurstLength and FirstBurstLength.
const MAX_SEGMENT: u32 = (1 << 24) - 1;

/// Why an encoded handover was refused: the envelope's or a field's reason
/// ([`scsi_core::sealed`]).
pub type HandoverError = SealError;

/// The envelope of an iSCSI session's state.
const SEAL: Seal = Seal {
    magic: MAGIC,
    version: VERSION,
    max_body: MAX_BODY,
};

/// A quiescent session as handed over: the one this process keeps for the initiator port
/// (ISID, names) and target.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SessionState {
    /// TSIH (never 0).
    pub tsih: u16,
    /// ISID.
    pub isid: Isid,
    /// What the leading login negotiated (the names are in `params.declared`).
    pub params: SessionParams,
    /// ExpCmdSN: the next command the session takes.
    pub exp_cmd_sn: SerialNumber,
    /// The CmdSN window's width: MaxCmdSN is ExpCmdSN plus this, less one.
    pub cmd_window: u32,
    /// The unit attentions pending for its I_T nexus (LUN index, ASC and ASCQ), oldest first
    /// ([`scsi_core::Device::pending_unit_attentions`]).
    pub unit_attentions: Vec<(u16, Asc)>,
    /// Its connections, at least one, at most MaxConnections, each CID once.
    pub connections: Vec<ConnectionState>,
}

/// A quiescent connection as handed over.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConnectionState {
    /// CID.
    pub cid: u16,
    /// Digests and segment lengths as negotiated (and renegotiated by text).
    pub params: ConnectionParams,
    /// The next StatSN.
    pub stat_sn: SerialNumber,
    /// The next Target Transfer Tag.
    pub next_ttt: u32,
    /// The target asked the initiator to log out (an Async Message): not asked again.
    pub logout_asked: bool,
    /// Bytes read off the socket and not yet made into PDUs: the next PDUs start here.
    pub unread: Vec<u8>,
}

impl SessionState {
    /// The encoded state: header, body, CRC32C of the body.
    pub fn encode(&self) -> Vec<u8> {
        let mut body = Vec::with_capacity(256);
        self.put(&mut body);
        SEAL.seal(&body)
    }

    /// Decodes and checks an encoded state, which must be all of `bytes`.
    pub fn decode(bytes: &[u8]) -> Result<SessionState, HandoverError> {
        let mut r = Reader::new(SEAL.open(bytes)?);
        let state = SessionState::get(&mut r)?;
        r.end()?;
        state.check()?;
        Ok(state)
    }

    fn put(&self, w: &mut Vec<u8>) {
        w.extend_from_slice(&self.tsih.to_le_bytes());
        w.extend_from_slice(&self.isid.0);
        put_params(w, &self.params);
        w.extend_from_slice(&self.exp_cmd_sn.0.to_le_bytes());
        w.extend_from_slice(&self.cmd_window.to_le_bytes());
        w.extend_from_slice(&(self.unit_attentions.len() as u32).to_le_bytes());
        for (lun, asc) in &self.unit_attentions {
            w.extend_from_slice(&lun.to_le_bytes());
            w.extend_from_slice(&[asc.0, asc.1]);
        }
        w.extend_from_slice(&(self.connections.len() as u16).to_le_bytes());
        for c in &self.connections {
            w.extend_from_slice(&c.cid.to_le_bytes());
            put_bool(w, c.params.header_digest);
            put_bool(w, c.params.data_digest);
            w.extend_from_slice(&c.params.max_recv_data_segment_length.to_le_bytes());
            w.extend_from_slice(&c.params.max_send_data_segment_length.to_le_bytes());
            w.extend_from_slice(&c.stat_sn.0.to_le_bytes());
            w.extend_from_slice(&c.next_ttt.to_le_bytes());
            put_bool(w, c.logout_asked);
            w.extend_from_slice(&(c.unread.len() as u32).to_le_bytes());
            w.extend_from_slice(&c.unread);
        }
    }

    fn get(r: &mut Reader<'_>) -> Result<SessionState, HandoverError> {
        let tsih = r.u16()?;
        let isid = Isid(r.array()?);
        let params = get_params(r)?;
        let exp_cmd_sn = SerialNumber(r.u32()?);
        let cmd_window = r.u32()?;
        let attentions = r.u32()? as usize;
        if attentions.saturating_mul(4) > r.rest().len() {
            return Err(HandoverError::Truncated);
        }
        let mut unit_attentions = Vec::with_capacity(attentions);
        for _ in 0..attentions {
            let lun = r.u16()?;
            let [asc, ascq] = r.array()?;
            unit_attentions.push((lun, Asc(asc, ascq)));
        }
        let count = r.u16()?;
        // Each connection takes at least 25 bytes: the count is checked against what is left
        // before anything is reserved for it.
        if usize::from(count) * 25 > r.rest().len() {
            return Err(HandoverError::Truncated);
        }
        let mut connections = Vec::with_capacity(count.into());
        for _ in 0..count {
            let cid = r.u16()?;
            let params = ConnectionParams {
                header_digest: r.bool("header_digest")?,
                data_digest: r.bool("data_digest")?,
                max_recv_data_segment_length: r.u32()?,
                max_send_data_segment_length: r.u32()?,
            };
            let stat_sn = SerialNumber(r.u32()?);
            let next_ttt = r.u32()?;
            let logout_asked = r.bool("logout_asked")?;
            let n = r.u32()? as usize;
            if n > MAX_UNREAD {
                return Err(HandoverError::Invalid("unread"));
            }
            let unread = r.bytes(n)?.to_vec();
            connections.push(ConnectionState {
                cid,
                params,
                stat_sn,
                next_ttt,
                logout_asked,
                unread,
            });
        }
        Ok(SessionState {
            tsih,
            isid,
            params,
            exp_cmd_sn,
            cmd_window,
            unit_attentions,
            connections,
        })
    }

    /// Whether every field is within its range: what a login could have agreed.
    fn check(&self) -> Result<(), HandoverError> {
        let bad = |field| Err(HandoverError::Invalid(field));
        if self.tsih == 0 {
            return bad("tsih");
        }
        let d = &self.params.declared;
        let named = |n: &Option<String>| n.as_ref().is_some_and(|n| !n.is_empty());
        if !named(&d.initiator_name) {
            return bad("initiator_name");
        }
        if d.session_type == SessionType::Normal && !named(&d.target_name) {
            return bad("target_name");
        }
        let o = &self.params.operational;
        let segment = |n: u32| (512..=MAX_SEGMENT).contains(&n);
        if o.max_connections == 0 || usize::from(o.max_connections) < self.connections.len() {
            return bad("max_connections");
        }
        if !segment(o.max_burst_length) {
            return bad("max_burst_length");
        }
        if !segment(o.first_burst_length) || o.first_burst_length > o.max_burst_length {
            return bad("first_burst_length");
        }
        if o.default_time2wait > 3600 {
            return bad("default_time2wait");
        }
        if o.default_time2retain > 3600 {
            return bad("default_time2retain");
        }
        if o.max_outstanding_r2t == 0 {
            return bad("max_outstanding_r2t");
        }
        if o.error_recovery_level > 2 {
            return bad("error_recovery_level");
        }
        if !(1..=31).contains(&o.iscsi_protocol_level) {
            return bad("iscsi_protocol_level");
        }
        // Serial arithmetic orders two numbers only less than 2^31 apart.
        if self.cmd_window == 0 || self.cmd_window >= 1 << 31 {
            return bad("cmd_window");
        }
        // A LUN index is at most 16383 (SAM's flat space addressing).
        if self.unit_attentions.iter().any(|(lun, _)| *lun > 16383) {
            return bad("unit_attentions");
        }
        if self.connections.is_empty() {
            return bad("connections");
        }
        for (i, c) in self.connections.iter().enumerate() {
            if self.connections[..i].iter().any(|o| o.cid == c.cid) {
                return bad("cid");
            }
            if !segment(c.params.max_recv_data_segment_length) {
                return bad("max_recv_data_segment_length");
            }
            if !segment(c.params.max_send_data_segment_length) {
                return bad("max_send_data_segment_length");
            }
            if c.next_ttt == 0 || c.next_ttt > 0x7fff_ffff {
                return bad("next_ttt");
            }
            if c.unread.len() > MAX_UNREAD {
                return bad("unread");
            }
        }
        Ok(())
    }
}

/// The body's length from a handover's header, after checking its magic, version and bound:
/// what a shell reads next off the socket the state comes over.
pub fn body_len(header: &[u8; HEADER_LEN]) -> Result<usize, HandoverError> {
    SEAL.body_len(header)
}

fn put_bool(w: &mut Vec<u8>, b: bool) {
    w.push(u8::from(b));
}

fn put_text(w: &mut Vec<u8>, s: &Option<String>) {
    match s {
        None => w.push(0),
        Some(s) if s.len() > MAX_TEXT => {
            // No login agrees on such a name: written so that a reader refuses it.
            w.push(1);
            w.extend_from_slice(&(MAX_TEXT as u16 + 1).to_le_bytes());
        }
        Some(s) => {
            w.push(1);
            w.extend_from_slice(&(s.len() as u16).to_le_bytes());
            w.extend_from_slice(s.as_bytes());
        }
    }
}

fn put_params(w: &mut Vec<u8>, p: &SessionParams) {
    let d = &p.declared;
    w.push(match d.session_type {
        SessionType::Discovery => 0,
        SessionType::Normal => 1,
    });
    put_text(w, &d.initiator_name);
    put_text(w, &d.initiator_alias);
    put_text(w, &d.target_name);
    put_text(w, &d.target_alias);
    match d.target_portal_group_tag {
        None => w.push(0),
        Some(t) => {
            w.push(1);
            w.extend_from_slice(&t.to_le_bytes());
        }
    }
    let o = &p.operational;
    w.extend_from_slice(&o.max_connections.to_le_bytes());
    put_bool(w, o.initial_r2t);
    put_bool(w, o.immediate_data);
    w.extend_from_slice(&o.max_burst_length.to_le_bytes());
    w.extend_from_slice(&o.first_burst_length.to_le_bytes());
    w.extend_from_slice(&o.default_time2wait.to_le_bytes());
    w.extend_from_slice(&o.default_time2retain.to_le_bytes());
    w.extend_from_slice(&o.max_outstanding_r2t.to_le_bytes());
    put_bool(w, o.data_pdu_in_order);
    put_bool(w, o.data_sequence_in_order);
    w.push(o.error_recovery_level);
    w.push(o.iscsi_protocol_level);
    put_bool(w, o.rdma_extensions);
    w.push(match p.task_reporting {
        TaskReporting::Rfc3720 => 0,
        TaskReporting::ResponseFence => 1,
        TaskReporting::FastAbort => 2,
    });
    w.push(match p.auth_method {
        None => 0,
        Some(AuthMethod::None) => 1,
        Some(AuthMethod::Chap) => 2,
    });
}

fn get_params(r: &mut Reader<'_>) -> Result<SessionParams, HandoverError> {
    let session_type = match r.u8()? {
        0 => SessionType::Discovery,
        1 => SessionType::Normal,
        _ => return Err(HandoverError::Invalid("session_type")),
    };
    let declared = Declarations {
        session_type,
        initiator_name: get_text(r, "initiator_name")?,
        initiator_alias: get_text(r, "initiator_alias")?,
        target_name: get_text(r, "target_name")?,
        target_alias: get_text(r, "target_alias")?,
        target_portal_group_tag: match r.u8()? {
            0 => None,
            1 => Some(r.u16()?),
            _ => return Err(HandoverError::Invalid("target_portal_group_tag")),
        },
    };
    let operational = OperationalParams {
        max_connections: r.u16()?,
        initial_r2t: r.bool("initial_r2t")?,
        immediate_data: r.bool("immediate_data")?,
        max_burst_length: r.u32()?,
        first_burst_length: r.u32()?,
        default_time2wait: r.u16()?,
        default_time2retain: r.u16()?,
        max_outstanding_r2t: r.u16()?,
        data_pdu_in_order: r.bool("data_pdu_in_order")?,
        data_sequence_in_order: r.bool("data_sequence_in_order")?,
        error_recovery_level: r.u8()?,
        iscsi_protocol_level: r.u8()?,
        rdma_extensions: r.bool("rdma_extensions")?,
    };
    let task_reporting = match r.u8()? {
        0 => TaskReporting::Rfc3720,
        1 => TaskReporting::ResponseFence,
        2 => TaskReporting::FastAbort,
        _ => return Err(HandoverError::Invalid("task_reporting")),
    };
    let auth_method = match r.u8()? {
        0 => None,
        1 => Some(AuthMethod::None),
        2 => Some(AuthMethod::Chap),
        _ => return Err(HandoverError::Invalid("auth_method")),
    };
    Ok(SessionParams {
        declared,
        operational,
        task_reporting,
        auth_method,
    })
}

/// A name or alias: absent (0), or present (1) behind its u16 length, at most `MAX_TEXT`
/// bytes of UTF-8; anything else is `field` out of range.
fn get_text(r: &mut Reader<'_>, field: &'static str) -> Result<Option<String>, HandoverError> {
    match r.u8()? {
        0 => Ok(None),
        1 => {
            let n = usize::from(r.u16()?);
            if n > MAX_TEXT {
                return Err(HandoverError::Invalid(field));
            }
            let s = std::str::from_utf8(r.bytes(n)?).map_err(|_| HandoverError::Invalid(field))?;
            Ok(Some(s.to_string()))
        }
        _ => Err(HandoverError::Invalid(field)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn text() -> impl Strategy<Value = Option<String>> {
        proptest::option::of("[a-z0-9.:-]{1,40}")
    }

    fn session() -> impl Strategy<Value = SessionState> {
        let declared = (
            any::<bool>(),
            text(),
            text(),
            text(),
            text(),
            any::<Option<u16>>(),
        )
            .prop_map(|(normal, alias, talias, name, tname, tpgt)| Declarations {
                session_type: if normal {
                    SessionType::Normal
                } else {
                    SessionType::Discovery
                },
                initiator_name: Some(name.unwrap_or_else(|| "iqn.2026-12.test:i".into())),
                initiator_alias: alias,
                target_name: if normal {
                    Some(tname.unwrap_or_else(|| "iqn.2026-12.test:t".into()))
                } else {
                    tname
                },
                target_alias: talias,
                target_portal_group_tag: tpgt,
            });
        let operational = (
            (1u16..=8, any::<bool>(), any::<bool>(), 512u32..=MAX_SEGMENT),
            (0u16..=3600, 0u16..=3600, 1u16..=u16::MAX),
            (any::<[bool; 3]>(), 0u8..=2, 1u8..=31, any::<u32>()),
        )
            .prop_map(
                |((mc, ir2t, imm, mbl), (t2w, t2r, r2t), (b, erl, lvl, f))| OperationalParams {
                    max_connections: mc,
                    initial_r2t: ir2t,
                    immediate_data: imm,
                    max_burst_length: mbl,
                    first_burst_length: 512 + f % (mbl - 511),
                    default_time2wait: t2w,
                    default_time2retain: t2r,
                    max_outstanding_r2t: r2t,
                    data_pdu_in_order: b[0],
                    data_sequence_in_order: b[1],
                    error_recovery_level: erl,
                    iscsi_protocol_level: lvl,
                    rdma_extensions: b[2],
                },
            );
        let connection = (
            any::<[bool; 3]>(),
            512u32..=MAX_SEGMENT,
            512u32..=MAX_SEGMENT,
            any::<u32>(),
            1u32..=0x7fff_ffff,
            proptest::collection::vec(any::<u8>(), 0..300),
        )
            .prop_map(|(b, recv, send, stat_sn, ttt, unread)| ConnectionState {
                cid: 0,
                params: ConnectionParams {
                    header_digest: b[0],
                    data_digest: b[1],
                    max_recv_data_segment_length: recv,
                    max_send_data_segment_length: send,
                },
                stat_sn: SerialNumber(stat_sn),
                next_ttt: ttt,
                logout_asked: b[2],
                unread,
            });
        (
            1u16..,
            any::<[u8; 6]>(),
            declared,
            operational,
            0u8..3,
            0u8..3,
            (any::<u32>(), 1u32..(1 << 31)),
            proptest::collection::vec((0u16..16384, any::<[u8; 2]>()), 0..5),
            proptest::collection::vec(connection, 1..4),
        )
            .prop_map(
                |(
                    tsih,
                    isid,
                    declared,
                    mut operational,
                    tr,
                    auth,
                    (exp, window),
                    uas,
                    mut conns,
                )| {
                    operational.max_connections =
                        operational.max_connections.max(conns.len() as u16);
                    for (i, c) in conns.iter_mut().enumerate() {
                        c.cid = i as u16 * 7;
                    }
                    SessionState {
                        tsih,
                        isid: Isid(isid),
                        params: SessionParams {
                            declared,
                            operational,
                            task_reporting: [
                                TaskReporting::Rfc3720,
                                TaskReporting::ResponseFence,
                                TaskReporting::FastAbort,
                            ][usize::from(tr)],
                            auth_method: [None, Some(AuthMethod::None), Some(AuthMethod::Chap)]
                                [usize::from(auth)],
                        },
                        exp_cmd_sn: SerialNumber(exp),
                        cmd_window: window,
                        unit_attentions: uas
                            .into_iter()
                            .map(|(lun, [a, q])| (lun, Asc(a, q)))
                            .collect(),
                        connections: conns,
                    }
                },
            )
    }

    proptest! {
        #[test]
        fn every_state_comes_back_as_it_went(s in session()) {
            let bytes = s.encode();
            prop_assert_eq!(SessionState::decode(&bytes), Ok(s));
        }

        #[test]
        fn a_changed_byte_is_never_accepted(s in session(), at in any::<prop::sample::Index>(), x in 1u8..) {
            let mut bytes = s.encode();
            let i = at.index(bytes.len());
            bytes[i] ^= x;
            prop_assert!(SessionState::decode(&bytes).is_err(), "byte {} changed", i);
        }

        #[test]
        fn a_cut_state_is_never_accepted(s in session(), at in any::<prop::sample::Index>()) {
            let bytes = s.encode();
            let cut = at.index(bytes.len());
            prop_assert!(SessionState::decode(&bytes[..cut]).is_err());
            let mut longer = bytes.clone();
            longer.push(0);
            prop_assert_eq!(SessionState::decode(&longer), Err(HandoverError::Trailing(1)));
        }

        #[test]
        fn any_bytes_decode_without_panic(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
            let _ = SessionState::decode(&bytes);
        }
    }

    fn one() -> SessionState {
        SessionState {
            tsih: 5,
            isid: Isid([0x40, 0, 1, 2, 3, 4]),
            params: SessionParams {
                declared: Declarations {
                    session_type: SessionType::Normal,
                    initiator_name: Some("iqn.2026-12.test:i".into()),
                    target_name: Some("iqn.2026-12.test:t".into()),
                    ..Declarations::default()
                },
                ..SessionParams::default()
            },
            exp_cmd_sn: SerialNumber(77),
            cmd_window: 128,
            unit_attentions: vec![(1, Asc::POWER_ON_RESET)],
            connections: vec![ConnectionState {
                cid: 1,
                params: ConnectionParams::default(),
                stat_sn: SerialNumber(9),
                next_ttt: 3,
                logout_asked: false,
                unread: vec![1, 2, 3],
            }],
        }
    }

    /// Re-signs a body changed by `change` (as a writer of another build might have made
    /// it): the checksum passes, the field checks must not.
    fn resigned(s: &SessionState, change: impl FnOnce(&mut Vec<u8>)) -> Vec<u8> {
        let mut body = Vec::new();
        s.put(&mut body);
        change(&mut body);
        SEAL.seal(&body)
    }

    #[test]
    fn another_version_or_a_huge_body_is_refused_before_reading_it() {
        let mut bytes = one().encode();
        bytes[4] = 2;
        assert_eq!(
            SessionState::decode(&bytes),
            Err(HandoverError::Version {
                found: 2,
                supported: VERSION
            })
        );
        let mut header = [0u8; HEADER_LEN];
        header[..4].copy_from_slice(&MAGIC);
        header[4..6].copy_from_slice(&VERSION.to_le_bytes());
        header[8..].copy_from_slice(&u32::MAX.to_le_bytes());
        assert_eq!(body_len(&header), Err(HandoverError::TooLong(u32::MAX)));
        header[0] = b'x';
        assert_eq!(body_len(&header), Err(HandoverError::NotHandover));
    }

    #[test]
    fn a_signed_state_out_of_range_is_refused_naming_the_field() {
        let s = one();
        assert_eq!(SessionState::decode(&resigned(&s, |_| {})), Ok(s.clone()));
        let zero_tsih = resigned(&s, |b| b[..2].copy_from_slice(&[0, 0]));
        assert_eq!(
            SessionState::decode(&zero_tsih),
            Err(HandoverError::Invalid("tsih"))
        );
        let mut window0 = s.clone();
        window0.cmd_window = 0;
        assert_eq!(
            SessionState::decode(&resigned(&window0, |_| {})),
            Err(HandoverError::Invalid("cmd_window"))
        );
        let mut two = s.clone();
        two.params.operational.max_connections = 2;
        two.connections.push(two.connections[0].clone());
        assert_eq!(
            SessionState::decode(&resigned(&two, |_| {})),
            Err(HandoverError::Invalid("cid"))
        );
        let mut far = s.clone();
        far.unit_attentions.push((16384, Asc::POWER_ON_RESET));
        assert_eq!(
            SessionState::decode(&resigned(&far, |_| {})),
            Err(HandoverError::Invalid("unit_attentions"))
        );
        let mut small = s.clone();
        small.connections[0].params.max_send_data_segment_length = 100;
        assert_eq!(
            SessionState::decode(&resigned(&small, |_| {})),
            Err(HandoverError::Invalid("max_send_data_segment_length"))
        );
        // A connection count larger than the bytes left reserves nothing.
        let many = resigned(&s, |b| {
            // The count, then one connection: CID, digests, two lengths, StatSN, TTT, the
            // logout flag, and 3 unread bytes with their length.
            let at = b.len() - (2 + 2 + 1 + 1 + 4 + 4 + 4 + 4 + 1 + 4 + 3);
            b[at..at + 2].copy_from_slice(&u16::MAX.to_le_bytes());
        });
        assert_eq!(SessionState::decode(&many), Err(HandoverError::Truncated));
    }
}
