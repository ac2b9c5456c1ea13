//! An NVMe/TCP controller's state as one target process hands it to the next, so that an
//! upgrade keeps the controller and its queues: what the host's Connect and its admin commands
//! set on the controller (its properties, features, keep alive, the Asynchronous Event
//! Requests it holds and the notices waiting for them, the reservation notifications not yet
//! read), and for each queue its binding, its SQ head and what its ICReq settled, with the
//! bytes its reader had taken off the socket but not yet made into PDUs. The sockets go
//! beside it. A controller is handed over only when quiescent: no command in flight on any of
//! its queues but the Asynchronous Event Requests it holds, nothing queued to send, no R2T
//! outstanding ([`crate::tcp::ControllerConnection::handover`]).
//!
//! The namespaces' reservations are the subsystem's, not a controller's: they go apart
//! ([`NamespaceState`], [`crate::controller::Subsystem::namespace_states`]).
//!
//! The encoding is scsi-core's sealed envelope ([`scsi_core::sealed`]: magic `NVHO`, a
//! version, a bounded length and a CRC32C), and every field is checked against what a
//! Connect and ICReq could have set: a state that does not hold is refused, naming the
//! field, and the old process serves on. What a subsystem holds at most (Asynchronous Event
//! Requests, reservation notifications) it checks as it takes the state in
//! ([`crate::controller::Subsystem::adopt_controller`]).

use std::net::IpAddr;

use scsi_core::sealed::{put_blob, Reader, Seal, SealError};

use crate::tcp::pdu::Digests;

/// The first bytes of an encoded controller.
pub const MAGIC: [u8; 4] = *b"NVHO";

/// The encoding this build writes and reads.
pub const VERSION: u16 = 1;

/// The longest body a reader accepts.
pub const MAX_BODY: u32 = 64 << 20;

/// The most unread bytes one queue may carry (the commands the host sent ahead).
pub const MAX_UNREAD: usize = 16 << 20;

/// The longest NQN (NVMe: 223 bytes).
const MAX_NQN: usize = 223;

/// The most queues one controller has: the admin queue and 65535 I/O queues.
const MAX_QUEUES: usize = 65_536;

/// The envelope of a controller's state.
const SEAL: Seal = Seal {
    magic: MAGIC,
    version: VERSION,
    max_body: MAX_BODY,
};

/// Why a handed-over controller was refused.
pub type HandoverError = SealError;

/// Why a connection cannot be handed over yet: what is still under way on it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum Busy {
    /// Connect has not bound it to a queue, or ICReq has not come.
    #[error("not connected")]
    NotConnected,
    /// The connection is over, or its deframer failed.
    #[error("over")]
    Over,
    /// I/O commands are in flight.
    #[error("{0} commands in flight")]
    InFlight(usize),
    /// Block operations run (or their ends were not handed back).
    #[error("{0} block operations running")]
    InBackend(usize),
    /// Its controller failed: it is closing.
    #[error("its controller failed")]
    Dropped,
    /// A Preempt and Abort waits for its commands.
    #[error("a Preempt and Abort waits for it")]
    Draining,
    /// The first command of a fused pair waits for the second.
    #[error("half a fused pair")]
    Fused,
    /// Events wait for the shell, or the transport's events for the connection.
    #[error("{0} events not taken")]
    Events(usize),
    /// R2Ts are not answered in full.
    #[error("{0} R2Ts outstanding")]
    R2ts(usize),
    /// PDUs wait to be sent.
    #[error("{0} PDUs not sent")]
    Transmits(usize),
}

/// A quiescent controller as handed over, with its queues.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ControllerState {
    /// The subsystem it belongs to (SUBNQN).
    pub subnqn: String,
    /// CNTLID.
    pub cntlid: u16,
    /// Its host's NQN.
    pub hostnqn: String,
    /// Its host's identifier (Host Identifier: what reservations name it by).
    pub hostid: [u8; 16],
    /// CAP, VS, CC and CSTS as they stand.
    pub cap: u64,
    /// VS.
    pub vs: u32,
    /// CC.
    pub cc: u32,
    /// CSTS.
    pub csts: u32,
    /// Asynchronous Event Configuration.
    pub aec: u32,
    /// Volatile Write Cache enabled.
    pub vwc: bool,
    /// I/O queues granted (Number of Queues), once asked.
    pub io_queues_granted: Option<u16>,
    /// KATO in milliseconds; 0: no keep alive.
    pub kato_ms: u32,
    /// The CIDs of the Asynchronous Event Requests it holds (on the admin queue).
    pub aers: Vec<u16>,
    /// Notices waiting for an Asynchronous Event Request (a completion's DW0 each).
    pub notices: Vec<u32>,
    /// Namespaces changed since the host last read the Changed Namespace List.
    pub changed: Vec<u32>,
    /// A Namespace Attribute Changed notice went and the log was not read since.
    pub namespace_notice_masked: bool,
    /// A Discovery Log Page Change notice went and the log was not read since.
    pub discovery_notice_masked: bool,
    /// A Reservation Log Page Available notice went and the log was not read since.
    pub reservation_notice_masked: bool,
    /// An ANA Change notice went and the ANA log was not read since.
    pub ana_notice_masked: bool,
    /// The address the host reached the controller at.
    pub reached: Option<IpAddr>,
    /// Reservation notifications not yet read: count, type, NSID.
    pub reservation_log: Vec<(u64, u8, u32)>,
    /// The count of the last reservation notification.
    pub reservation_count: u64,
    /// Reservation Notification Mask by NSID.
    pub reservation_masks: Vec<(u32, u32)>,
    /// Its queues, the admin queue first, each QID once.
    pub queues: Vec<QueueState>,
}

/// A quiescent NVMe/TCP queue as handed over.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct QueueState {
    /// QID: 0 the admin queue.
    pub qid: u16,
    /// Entries (SQSIZE + 1).
    pub size: u32,
    /// The host disabled SQ flow control.
    pub sq_flow_control_disabled: bool,
    /// The SQ head pointer the next completion reports.
    pub sqhd: u16,
    /// CPDA the controller asked in ICResp.
    pub cpda: u8,
    /// MAXH2CDATA the controller gave in ICResp.
    pub maxh2cdata: u32,
    /// The most in-capsule data a command capsule may carry.
    pub max_in_capsule_data: u32,
    /// The digests in force.
    pub digests: Digests,
    /// HPDA the host asked in ICReq.
    pub hpda: u8,
    /// R2Ts outstanding per command.
    pub max_r2t: u32,
    /// The next R2T transfer tag.
    pub next_ttag: u16,
    /// Bytes read off the socket and not yet made into PDUs: the next PDUs start here.
    pub unread: Vec<u8>,
}

/// A namespace's reservations as handed over: the namespace by NSID and NGUID (the successor
/// checks it serves the same storage there) and scsi-core's encoding of its state.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NamespaceState {
    /// NSID.
    pub nsid: u32,
    /// NGUID.
    pub nguid: [u8; 16],
    /// `scsi_core::pr::PrState::encode`.
    pub reservations: Vec<u8>,
}

impl ControllerState {
    /// The encoded state: scsi-core's sealed envelope around the fields.
    pub fn encode(&self) -> Vec<u8> {
        let mut w = Vec::with_capacity(512);
        put_blob(&mut w, self.subnqn.as_bytes());
        w.extend_from_slice(&self.cntlid.to_le_bytes());
        put_blob(&mut w, self.hostnqn.as_bytes());
        w.extend_from_slice(&self.hostid);
        w.extend_from_slice(&self.cap.to_le_bytes());
        for v in [self.vs, self.cc, self.csts, self.aec] {
            w.extend_from_slice(&v.to_le_bytes());
        }
        w.push(u8::from(self.vwc));
        match self.io_queues_granted {
            None => w.push(0),
            Some(n) => {
                w.push(1);
                w.extend_from_slice(&n.to_le_bytes());
            }
        }
        w.extend_from_slice(&self.kato_ms.to_le_bytes());
        w.extend_from_slice(&(self.aers.len() as u32).to_le_bytes());
        for cid in &self.aers {
            w.extend_from_slice(&cid.to_le_bytes());
        }
        for list in [&self.notices, &self.changed] {
            w.extend_from_slice(&(list.len() as u32).to_le_bytes());
            for v in list {
                w.extend_from_slice(&v.to_le_bytes());
            }
        }
        for flag in [
            self.namespace_notice_masked,
            self.discovery_notice_masked,
            self.reservation_notice_masked,
            self.ana_notice_masked,
        ] {
            w.push(u8::from(flag));
        }
        match self.reached {
            None => w.push(0),
            Some(IpAddr::V4(a)) => {
                w.push(4);
                w.extend_from_slice(&a.octets());
            }
            Some(IpAddr::V6(a)) => {
                w.push(6);
                w.extend_from_slice(&a.octets());
            }
        }
        w.extend_from_slice(&(self.reservation_log.len() as u32).to_le_bytes());
        for (count, kind, nsid) in &self.reservation_log {
            w.extend_from_slice(&count.to_le_bytes());
            w.push(*kind);
            w.extend_from_slice(&nsid.to_le_bytes());
        }
        w.extend_from_slice(&self.reservation_count.to_le_bytes());
        w.extend_from_slice(&(self.reservation_masks.len() as u32).to_le_bytes());
        for (nsid, mask) in &self.reservation_masks {
            w.extend_from_slice(&nsid.to_le_bytes());
            w.extend_from_slice(&mask.to_le_bytes());
        }
        w.extend_from_slice(&(self.queues.len() as u32).to_le_bytes());
        for q in &self.queues {
            q.put(&mut w);
        }
        SEAL.seal(&w)
    }

    /// Decodes and checks an encoded state, which must be all of `bytes`.
    pub fn decode(bytes: &[u8]) -> Result<ControllerState, HandoverError> {
        let mut r = Reader::new(SEAL.open(bytes)?);
        let subnqn = text(&mut r, "subnqn")?;
        let cntlid = r.u16()?;
        let hostnqn = text(&mut r, "hostnqn")?;
        let hostid = r.array()?;
        let cap = r.u64()?;
        let (vs, cc, csts, aec) = (r.u32()?, r.u32()?, r.u32()?, r.u32()?);
        let vwc = r.bool("vwc")?;
        let io_queues_granted = match r.u8()? {
            0 => None,
            1 => Some(r.u16()?),
            _ => return Err(HandoverError::Invalid("io_queues_granted")),
        };
        let kato_ms = r.u32()?;
        let n = r.count(2)?;
        let aers = (0..n).map(|_| r.u16()).collect::<Result<Vec<_>, _>>()?;
        let n = r.count(4)?;
        let notices = (0..n).map(|_| r.u32()).collect::<Result<Vec<_>, _>>()?;
        let n = r.count(4)?;
        let changed = (0..n).map(|_| r.u32()).collect::<Result<Vec<_>, _>>()?;
        let namespace_notice_masked = r.bool("namespace_notice_masked")?;
        let discovery_notice_masked = r.bool("discovery_notice_masked")?;
        let reservation_notice_masked = r.bool("reservation_notice_masked")?;
        let ana_notice_masked = r.bool("ana_notice_masked")?;
        let reached = match r.u8()? {
            0 => None,
            4 => Some(IpAddr::from(r.array::<4>()?)),
            6 => Some(IpAddr::from(r.array::<16>()?)),
            _ => return Err(HandoverError::Invalid("reached")),
        };
        let n = r.count(13)?;
        let mut reservation_log = Vec::with_capacity(n);
        for _ in 0..n {
            reservation_log.push((r.u64()?, r.u8()?, r.u32()?));
        }
        let reservation_count = r.u64()?;
        let n = r.count(8)?;
        let mut reservation_masks = Vec::with_capacity(n);
        for _ in 0..n {
            reservation_masks.push((r.u32()?, r.u32()?));
        }
        let n = r.count(QueueState::MIN_LEN)?;
        let mut queues = Vec::with_capacity(n);
        for _ in 0..n {
            queues.push(QueueState::get(&mut r)?);
        }
        r.end()?;
        let state = ControllerState {
            subnqn,
            cntlid,
            hostnqn,
            hostid,
            cap,
            vs,
            cc,
            csts,
            aec,
            vwc,
            io_queues_granted,
            kato_ms,
            aers,
            notices,
            changed,
            namespace_notice_masked,
            discovery_notice_masked,
            reservation_notice_masked,
            ana_notice_masked,
            reached,
            reservation_log,
            reservation_count,
            reservation_masks,
            queues,
        };
        state.check()?;
        Ok(state)
    }

    /// Whether every field is within what a Connect and the admin commands could have set.
    fn check(&self) -> Result<(), HandoverError> {
        let bad = |field| Err(HandoverError::Invalid(field));
        let nqn = |s: &str| !s.is_empty() && s.len() <= MAX_NQN;
        if !nqn(&self.subnqn) {
            return bad("subnqn");
        }
        if !nqn(&self.hostnqn) {
            return bad("hostnqn");
        }
        // CNTLID 0 and FFF0h up are not a controller's (FFFFh is Connect's "any").
        if self.cntlid == 0 || self.cntlid >= 0xfff0 {
            return bad("cntlid");
        }
        if self.queues.is_empty() || self.queues[0].qid != 0 || self.queues.len() > MAX_QUEUES {
            return bad("queues");
        }
        for (i, q) in self.queues.iter().enumerate() {
            if self.queues[..i].iter().any(|o| o.qid == q.qid) {
                return bad("qid");
            }
            if i > 0 && q.qid == 0 {
                return bad("qid");
            }
            q.check()?;
        }
        Ok(())
    }
}

impl QueueState {
    /// The bytes one queue takes encoded with no unread bytes.
    const MIN_LEN: usize = 31;

    fn put(&self, w: &mut Vec<u8>) {
        w.extend_from_slice(&self.qid.to_le_bytes());
        w.extend_from_slice(&self.size.to_le_bytes());
        w.push(u8::from(self.sq_flow_control_disabled));
        w.extend_from_slice(&self.sqhd.to_le_bytes());
        w.push(self.cpda);
        w.extend_from_slice(&self.maxh2cdata.to_le_bytes());
        w.extend_from_slice(&self.max_in_capsule_data.to_le_bytes());
        w.push(u8::from(self.digests.header));
        w.push(u8::from(self.digests.data));
        w.push(self.hpda);
        w.extend_from_slice(&self.max_r2t.to_le_bytes());
        w.extend_from_slice(&self.next_ttag.to_le_bytes());
        put_blob(w, &self.unread);
    }

    fn get(r: &mut Reader<'_>) -> Result<QueueState, HandoverError> {
        Ok(QueueState {
            qid: r.u16()?,
            size: r.u32()?,
            sq_flow_control_disabled: r.bool("sq_flow_control_disabled")?,
            sqhd: r.u16()?,
            cpda: r.u8()?,
            maxh2cdata: r.u32()?,
            max_in_capsule_data: r.u32()?,
            digests: Digests {
                header: r.bool("header_digest")?,
                data: r.bool("data_digest")?,
            },
            hpda: r.u8()?,
            max_r2t: r.u32()?,
            next_ttag: r.u16()?,
            unread: r.blob(MAX_UNREAD, "unread")?.to_vec(),
        })
    }

    /// Whether every field is within what Connect and ICReq could have set.
    fn check(&self) -> Result<(), HandoverError> {
        let bad = |field| Err(HandoverError::Invalid(field));
        // A queue has 2 (the admin queue 32) to 65536 entries.
        let min = if self.qid == 0 { 32 } else { 2 };
        if self.size < min || self.size > 65_536 {
            return bad("size");
        }
        if u32::from(self.sqhd) >= self.size {
            return bad("sqhd");
        }
        if self.cpda > crate::tcp::pdu::MAX_PDA || self.hpda > crate::tcp::pdu::MAX_PDA {
            return bad("pda");
        }
        if self.maxh2cdata < crate::tcp::pdu::MIN_MAXH2CDATA {
            return bad("maxh2cdata");
        }
        if self.max_r2t == 0 {
            return bad("max_r2t");
        }
        Ok(())
    }
}

/// An NQN behind its u32 length, UTF-8, at most 223 bytes.
fn text(r: &mut Reader<'_>, field: &'static str) -> Result<String, HandoverError> {
    let b = r.blob(MAX_NQN, field)?;
    std::str::from_utf8(b)
        .map(str::to_string)
        .map_err(|_| HandoverError::Invalid(field))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    pub(crate) fn queue(qid: u16) -> QueueState {
        QueueState {
            qid,
            size: 128,
            sq_flow_control_disabled: qid > 0,
            sqhd: 17,
            cpda: 0,
            maxh2cdata: 131_072,
            max_in_capsule_data: 8192,
            digests: Digests {
                header: true,
                data: false,
            },
            hpda: 0,
            max_r2t: 1,
            next_ttag: 9,
            unread: vec![4, 0, 0x48],
        }
    }

    fn one() -> ControllerState {
        ControllerState {
            subnqn: "nqn.2026-12.io.example:sub".into(),
            cntlid: 1,
            hostnqn: "nqn.2014-08.org.nvmexpress:uuid:host".into(),
            hostid: [7; 16],
            cap: 0x20_1e01_007f,
            vs: 0x0001_0400,
            cc: 0x46_0001,
            csts: 1,
            aec: 0x900,
            vwc: true,
            io_queues_granted: Some(2),
            kato_ms: 5000,
            aers: vec![18, 19],
            notices: vec![0x0002_0002],
            changed: vec![1],
            namespace_notice_masked: true,
            discovery_notice_masked: false,
            reservation_notice_masked: false,
            ana_notice_masked: true,
            reached: Some("10.0.2.15".parse().unwrap()),
            reservation_log: vec![(3, 1, 1)],
            reservation_count: 3,
            reservation_masks: vec![(1, 2)],
            queues: vec![queue(0), queue(1), queue(2)],
        }
    }

    #[test]
    fn a_controller_decodes_to_itself_and_every_change_is_refused() {
        let s = one();
        let bytes = s.encode();
        assert_eq!(ControllerState::decode(&bytes), Ok(s));
        for cut in 0..bytes.len() {
            assert!(ControllerState::decode(&bytes[..cut]).is_err(), "cut {cut}");
        }
        for i in 0..bytes.len() {
            let mut b = bytes.clone();
            b[i] ^= 0x21;
            assert!(ControllerState::decode(&b).is_err(), "byte {i}");
        }
    }

    #[test]
    fn a_state_out_of_range_is_refused_naming_the_field() {
        let refused = |change: fn(&mut ControllerState), field| {
            let mut s = one();
            change(&mut s);
            assert_eq!(
                ControllerState::decode(&s.encode()),
                Err(HandoverError::Invalid(field))
            );
        };
        refused(|s| s.cntlid = 0, "cntlid");
        refused(|s| s.cntlid = 0xffff, "cntlid");
        refused(|s| s.hostnqn.clear(), "hostnqn");
        refused(|s| s.queues.remove(0).qid = 0, "queues");
        refused(|s| s.queues[2].qid = 1, "qid");
        refused(|s| s.queues[0].size = 31, "size");
        refused(|s| s.queues[1].sqhd = 128, "sqhd");
        refused(|s| s.queues[1].maxh2cdata = 512, "maxh2cdata");
        refused(|s| s.queues[1].max_r2t = 0, "max_r2t");
        refused(|s| s.queues[1].hpda = 32, "pda");
    }

    proptest! {
        #[test]
        fn any_valid_controller_round_trips(
            cntlid in 1u16..0xfff0,
            aers in proptest::collection::vec(any::<u16>(), 0..=8),
            notices in proptest::collection::vec(any::<u32>(), 0..8),
            unread in proptest::collection::vec(any::<u8>(), 0..64),
            queues in 1usize..6,
            kato_ms in any::<u32>(),
            reached in proptest::option::of(any::<[u8; 16]>()),
        ) {
            let mut s = one();
            s.cntlid = cntlid;
            s.aers = aers;
            s.notices = notices;
            s.kato_ms = kato_ms;
            s.reached = reached.map(IpAddr::from);
            s.queues = (0..queues as u16).map(queue).collect();
            s.queues[0].unread = unread;
            prop_assert_eq!(ControllerState::decode(&s.encode()), Ok(s));
        }

        #[test]
        fn any_bytes_decode_or_are_refused(bytes in proptest::collection::vec(any::<u8>(), 0..256)) {
            let _ = ControllerState::decode(&bytes);
            let mut sealed = SEAL.seal(&bytes);
            let _ = ControllerState::decode(&sealed);
            sealed.truncate(sealed.len() / 2);
            let _ = ControllerState::decode(&sealed);
        }
    }
}
