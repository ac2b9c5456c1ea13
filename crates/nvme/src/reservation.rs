//! Reservations (NVM Express Base Specification 2.0, section 8.19): Reservation Register,
//! Acquire, Release and Report, decided by the same engine as SCSI persistent reservations
//! (scsi-core's [`PrState`]), whose semantics NVMe took from SPC-3.
//!
//! A registrant is a host, named by its Host Identifier (every controller of one host shares
//! its registration, so the engine's registrations cover every port); the reservation
//! types are SCSI's six under other numbers ([`scsi_type`]); PTPL is the engine's APTPL. What
//! NVMe does differently is decided here before the engine is asked: Register of a host
//! already registered succeeds only with the key it has, Unregister and Replace need a
//! registration, a key of zero is not a key, a Release of another type is Invalid Field, and
//! Ignore Existing Key is refused on Acquire and Release (reserved since NVMe 1.3).

use scsi_core::nexus::{ItNexus, TransportId};
use scsi_core::pr::{kind, PrError, PrState, ReservationEffects};
use scsi_core::sense::Asc;

use crate::opcode::NvmOpcode;
use crate::sqe::Sqe;
use crate::status::Status;

/// The SCSI reservation TYPE of NVMe's RTYPE (1 to 6).
pub fn scsi_type(rtype: u8) -> Option<u8> {
    Some(match rtype {
        1 => kind::WRITE_EXCLUSIVE,
        2 => kind::EXCLUSIVE_ACCESS,
        3 => kind::WRITE_EXCLUSIVE_REGISTRANTS_ONLY,
        4 => kind::EXCLUSIVE_ACCESS_REGISTRANTS_ONLY,
        5 => kind::WRITE_EXCLUSIVE_ALL_REGISTRANTS,
        6 => kind::EXCLUSIVE_ACCESS_ALL_REGISTRANTS,
        _ => return None,
    })
}

/// NVMe's RTYPE of a SCSI reservation TYPE (0 for none).
pub fn rtype(scsi: u8) -> u8 {
    (1..=6).find(|&r| scsi_type(r) == Some(scsi)).unwrap_or(0)
}

/// The host with Host Identifier `hostid`, as the engine names a registrant.
pub fn host(hostid: [u8; 16]) -> ItNexus {
    ItNexus {
        initiator: TransportId::nvme_host(hostid),
        relative_port: 0,
    }
}

/// The Host Identifier of a registrant [`host`] named.
fn hostid(n: &ItNexus) -> [u8; 16] {
    let mut id = [0u8; 16];
    for (i, b) in id.iter_mut().enumerate() {
        *b = n
            .initiator
            .name
            .get(2 * i..2 * i + 2)
            .and_then(|h| u8::from_str_radix(h, 16).ok())
            .unwrap_or(0);
    }
    id
}

/// Reservation Register's action (RREGA).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RegisterAction {
    /// Register a key (000b).
    Register,
    /// Unregister (001b).
    Unregister,
    /// Replace the key (010b).
    Replace,
}

/// Reservation Acquire's action (RACQA).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AcquireAction {
    /// Acquire (000b).
    Acquire,
    /// Preempt (001b).
    Preempt,
    /// Preempt and Abort (010b).
    PreemptAndAbort,
}

/// A reservation command, decoded.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReservationCommand {
    /// Reservation Register: CRKEY and NRKEY in the data.
    Register {
        /// RREGA.
        action: RegisterAction,
        /// IEKEY: CRKEY is not checked.
        ignore_key: bool,
        /// CPTPL: persist through power loss set (`Some(true)`), cleared, or unchanged.
        ptpl: Option<bool>,
    },
    /// Reservation Acquire: CRKEY and PRKEY in the data.
    Acquire {
        /// RACQA.
        action: AcquireAction,
        /// RTYPE.
        rtype: u8,
    },
    /// Reservation Release: CRKEY in the data.
    Release {
        /// RRELA 001b: clear every registration and the reservation.
        clear: bool,
        /// RTYPE.
        rtype: u8,
    },
    /// Reservation Report: `len` bytes of the Reservation Status data structure.
    Report {
        /// NUMD + 1 dwords, in bytes.
        len: u32,
        /// EDS: the extended data structure (128-bit Host Identifiers).
        extended: bool,
    },
}

impl ReservationCommand {
    /// Bytes of data the command brings from the host (0 for Report).
    pub fn data_len(&self) -> usize {
        match self {
            ReservationCommand::Register { .. } | ReservationCommand::Acquire { .. } => 16,
            ReservationCommand::Release { .. } => 8,
            ReservationCommand::Report { .. } => 0,
        }
    }
}

/// Whether `opcode` is a reservation command.
pub fn is_reservation(opcode: u8) -> bool {
    [
        NvmOpcode::ReservationRegister,
        NvmOpcode::ReservationReport,
        NvmOpcode::ReservationAcquire,
        NvmOpcode::ReservationRelease,
    ]
    .iter()
    .any(|o| o.code() == opcode)
}

/// Decodes reservation command `sqe`.
pub fn decode(sqe: &Sqe) -> Result<ReservationCommand, Status> {
    let c10 = sqe.cdw(10);
    let action = c10 & 7;
    let ignore_key = c10 & 1 << 3 != 0;
    let rtype = (c10 >> 8) as u8;
    match NvmOpcode::from_code(sqe.opcode()) {
        Some(NvmOpcode::ReservationRegister) => Ok(ReservationCommand::Register {
            action: match action {
                0 => RegisterAction::Register,
                1 => RegisterAction::Unregister,
                2 => RegisterAction::Replace,
                _ => return Err(Status::INVALID_FIELD),
            },
            ignore_key,
            ptpl: match c10 >> 30 {
                0 => None,
                2 => Some(false),
                3 => Some(true),
                _ => return Err(Status::INVALID_FIELD),
            },
        }),
        Some(NvmOpcode::ReservationAcquire) if !ignore_key => Ok(ReservationCommand::Acquire {
            action: match action {
                0 => AcquireAction::Acquire,
                1 => AcquireAction::Preempt,
                2 => AcquireAction::PreemptAndAbort,
                _ => return Err(Status::INVALID_FIELD),
            },
            rtype,
        }),
        Some(NvmOpcode::ReservationRelease) if !ignore_key && action <= 1 => {
            Ok(ReservationCommand::Release {
                clear: action == 1,
                rtype,
            })
        }
        Some(NvmOpcode::ReservationReport) => Ok(ReservationCommand::Report {
            len: c10.saturating_add(1).saturating_mul(4),
            extended: sqe.cdw(11) & 1 != 0,
        }),
        _ => Err(Status::INVALID_FIELD),
    }
}

fn le64(data: &[u8], at: usize) -> u64 {
    data.get(at..at + 8)
        .and_then(|b| b.try_into().ok())
        .map_or(0, u64::from_le_bytes)
}

fn status(e: PrError) -> Status {
    match e {
        PrError::Conflict => Status::RESERVATION_CONFLICT,
        // A type that is not the reservation's, a key of zero to preempt with: the fields.
        PrError::Sense(_) => Status::INVALID_FIELD,
    }
}

/// Carries out reservation command `cmd` (not Report) from host `me` with its `data` on
/// `state`: the effects (notices, hosts whose commands to abort, a state to save), or the
/// status that refuses it, `state` unchanged. `ptpl_capable`: the state can be kept across
/// a power loss (setting PTPL is refused otherwise).
pub fn apply(
    state: &mut PrState,
    me: &ItNexus,
    cmd: &ReservationCommand,
    data: &[u8],
    ptpl_capable: bool,
) -> Result<ReservationEffects, Status> {
    if data.len() < cmd.data_len() {
        return Err(Status::DATA_SGL_LENGTH_INVALID);
    }
    let crkey = le64(data, 0);
    let other = le64(data, 8);
    let mut next = state.clone();
    let registered = next.registrations.iter().any(|r| r.nexus == *me);
    let fx = match *cmd {
        ReservationCommand::Register {
            action,
            ignore_key,
            ptpl,
        } => {
            if ptpl == Some(true) && !ptpl_capable {
                return Err(Status::INVALID_FIELD);
            }
            let key = (!ignore_key).then_some(crkey);
            match action {
                RegisterAction::Register if other == 0 => return Err(Status::INVALID_FIELD),
                RegisterAction::Register if registered => {
                    let mine = next.registrations.iter().find(|r| r.nexus == *me);
                    if mine.is_some_and(|r| r.key != other) {
                        return Err(Status::RESERVATION_CONFLICT);
                    }
                    if let Some(p) = ptpl {
                        next.aptpl = p;
                    }
                    Ok(ReservationEffects {
                        save: ptpl.is_some(),
                        ..ReservationEffects::default()
                    })
                }
                RegisterAction::Register => next.register(me, None, other, true, ptpl),
                _ if !registered => return Err(Status::RESERVATION_CONFLICT),
                RegisterAction::Unregister => next.register(me, key, 0, true, ptpl),
                RegisterAction::Replace if other == 0 => return Err(Status::INVALID_FIELD),
                RegisterAction::Replace => next.register(me, key, other, true, ptpl),
            }
            .map_err(status)?
        }
        ReservationCommand::Acquire { action, rtype } => {
            let ty = scsi_type(rtype).ok_or(Status::INVALID_FIELD)?;
            // The holder of a reservation (not an all-registrants one) that preempts changes
            // its type, whatever PRKEY says (as Linux's nvmet does; nvme-cli's PRKEY is 0 by
            // default): to the engine, it preempts its own key.
            let own = next
                .reservation
                .as_ref()
                .filter(|r| {
                    next.is_holder(me) && !matches!(crate::reservation::rtype(r.kind), 5 | 6)
                })
                .map(|_| crkey);
            let victim = own.unwrap_or(other);
            match action {
                AcquireAction::Acquire => next.reserve(me, crkey, ty),
                AcquireAction::Preempt => next.preempt(me, crkey, victim, ty, false),
                AcquireAction::PreemptAndAbort => next.preempt(me, crkey, victim, ty, true),
            }
            .map_err(status)?
        }
        ReservationCommand::Release { clear: true, .. } => next.clear(me, crkey).map_err(status)?,
        ReservationCommand::Release { rtype, .. } => next
            .release(me, crkey, scsi_type(rtype).unwrap_or(0))
            .map_err(status)?,
        ReservationCommand::Report { .. } => return Err(Status::INVALID_OPCODE),
    };
    *state = next;
    Ok(fx)
}

/// Reservation Notification log page types.
pub mod notice {
    /// Registration Preempted.
    pub const REGISTRATION_PREEMPTED: u8 = 1;
    /// Reservation Released.
    pub const RESERVATION_RELEASED: u8 = 2;
    /// Reservation Preempted.
    pub const RESERVATION_PREEMPTED: u8 = 3;
}

/// What each host hears of a change's `effects`: a Reservation Notification of a type for
/// each, in order, each host once per type.
pub fn notices(effects: &ReservationEffects) -> Vec<(&ItNexus, u8)> {
    let mut out: Vec<(&ItNexus, u8)> = Vec::new();
    for (n, asc) in &effects.unit_attentions {
        let kind = match *asc {
            Asc::REGISTRATIONS_PREEMPTED => notice::REGISTRATION_PREEMPTED,
            Asc::RESERVATIONS_RELEASED => notice::RESERVATION_RELEASED,
            Asc::RESERVATIONS_PREEMPTED => notice::RESERVATION_PREEMPTED,
            _ => continue,
        };
        if !out.iter().any(|(m, k)| *m == n && *k == kind) {
            out.push((n, kind));
        }
    }
    out
}

/// The Reservation Status data structure of `state` (extended: 64-byte header and entries
/// with the 128-bit Host Identifier), one registered controller entry per registrant host
/// with `cntlid` the CNTLID of a controller of it (FFFFh for none connected); `ptpl`: PTPLS.
pub fn report(
    state: &PrState,
    extended: bool,
    ptpl: bool,
    cntlid: impl Fn(&ItNexus) -> Option<u16>,
) -> Vec<u8> {
    let (head, entry) = if extended { (64, 64) } else { (24, 24) };
    let mut d = vec![0u8; head + entry * state.registrations.len()];
    d[0..4].copy_from_slice(&state.generation.to_le_bytes());
    d[4] = state.reservation.as_ref().map_or(0, |r| rtype(r.kind));
    let n = state.registrations.len().min(usize::from(u16::MAX)) as u16;
    d[5..7].copy_from_slice(&n.to_le_bytes());
    d[9] = u8::from(ptpl);
    for (i, r) in state.registrations.iter().enumerate() {
        let e = &mut d[head + i * entry..head + (i + 1) * entry];
        let id = cntlid(&r.nexus).unwrap_or(0xffff);
        e[0..2].copy_from_slice(&id.to_le_bytes());
        e[2] = u8::from(state.is_holder(&r.nexus));
        let host = hostid(&r.nexus);
        if extended {
            e[8..16].copy_from_slice(&r.key.to_le_bytes());
            e[16..32].copy_from_slice(&host);
        } else {
            e[8..16].copy_from_slice(&host[..8]);
            e[16..24].copy_from_slice(&r.key.to_le_bytes());
        }
    }
    d
}

/// One Reservation Notification log page: its count, type ([`notice`]; 0 empty), the
/// pages still available after it, and the namespace.
pub fn notification_page(count: u64, kind: u8, available: u8, nsid: u32) -> [u8; 64] {
    let mut p = [0u8; 64];
    p[0..8].copy_from_slice(&count.to_le_bytes());
    p[8] = kind;
    p[9] = available;
    p[12..16].copy_from_slice(&nsid.to_le_bytes());
    p
}

#[cfg(test)]
mod tests {
    use super::*;

    fn register(action: u32, iekey: bool, cptpl: u32) -> ReservationCommand {
        let mut s = Sqe::new(NvmOpcode::ReservationRegister.code(), 1);
        s.set_cdw(10, action | u32::from(iekey) << 3 | cptpl << 30);
        decode(&s).unwrap()
    }

    fn acquire(action: u32, rtype: u32) -> ReservationCommand {
        let mut s = Sqe::new(NvmOpcode::ReservationAcquire.code(), 1);
        s.set_cdw(10, action | rtype << 8);
        decode(&s).unwrap()
    }

    fn release(clear: bool, rtype: u32) -> ReservationCommand {
        let mut s = Sqe::new(NvmOpcode::ReservationRelease.code(), 1);
        s.set_cdw(10, u32::from(clear) | rtype << 8);
        decode(&s).unwrap()
    }

    fn keys(a: u64, b: u64) -> Vec<u8> {
        [a.to_le_bytes(), b.to_le_bytes()].concat()
    }

    #[test]
    fn types_map_both_ways() {
        for r in 1..=6 {
            assert_eq!(rtype(scsi_type(r).unwrap()), r);
        }
        assert_eq!(scsi_type(0), None);
        assert_eq!(scsi_type(7), None);
    }

    #[test]
    fn register_acquire_and_the_access_it_gives() {
        use scsi_core::spc::opcodes::Access;
        let (a, b) = (host([1; 16]), host([2; 16]));
        let mut st = PrState::default();
        apply(&mut st, &a, &register(0, false, 0), &keys(0, 0xa), false).unwrap();
        // Register again with another key: conflict; with the same: success, no change.
        assert_eq!(
            apply(&mut st, &a, &register(0, false, 0), &keys(0, 0xb), false),
            Err(Status::RESERVATION_CONFLICT)
        );
        let gen = st.generation;
        apply(&mut st, &a, &register(0, false, 0), &keys(0, 0xa), false).unwrap();
        assert_eq!(st.generation, gen);
        // A key of zero is no key.
        assert_eq!(
            apply(&mut st, &b, &register(0, false, 0), &keys(0, 0), false),
            Err(Status::INVALID_FIELD)
        );
        // Acquire needs the registration's key.
        assert_eq!(
            apply(&mut st, &a, &acquire(0, 1), &keys(0xb, 0), false),
            Err(Status::RESERVATION_CONFLICT)
        );
        apply(&mut st, &a, &acquire(0, 1), &keys(0xa, 0), false).unwrap();
        assert!(st.allows(&b, Access::Read));
        assert!(!st.allows(&b, Access::Write));
        assert!(st.allows(&a, Access::Write));
        // Releasing another type is Invalid Field; the right one releases.
        assert_eq!(
            apply(&mut st, &a, &release(false, 2), &keys(0xa, 0), false),
            Err(Status::INVALID_FIELD)
        );
        apply(&mut st, &a, &release(false, 1), &keys(0xa, 0), false).unwrap();
        assert!(st.reservation.is_none());
    }

    #[test]
    fn unregister_and_replace_need_a_registration_and_its_key_unless_ignored() {
        let a = host([1; 16]);
        let mut st = PrState::default();
        for action in [1, 2] {
            assert_eq!(
                apply(&mut st, &a, &register(action, true, 0), &keys(0, 5), false),
                Err(Status::RESERVATION_CONFLICT)
            );
        }
        apply(&mut st, &a, &register(0, false, 0), &keys(0, 5), false).unwrap();
        assert_eq!(
            apply(&mut st, &a, &register(2, false, 0), &keys(4, 6), false),
            Err(Status::RESERVATION_CONFLICT)
        );
        apply(&mut st, &a, &register(2, true, 0), &keys(4, 6), false).unwrap();
        assert_eq!(st.registrations[0].key, 6);
        apply(&mut st, &a, &register(1, false, 0), &keys(6, 0), false).unwrap();
        assert!(st.registrations.is_empty());
    }

    #[test]
    fn preempt_and_abort_names_the_preempted_host_and_tells_it() {
        let (a, b) = (host([1; 16]), host([2; 16]));
        let mut st = PrState::default();
        apply(&mut st, &a, &register(0, false, 0), &keys(0, 0xa), false).unwrap();
        apply(&mut st, &b, &register(0, false, 0), &keys(0, 0xb), false).unwrap();
        apply(&mut st, &a, &acquire(0, 2), &keys(0xa, 0), false).unwrap();
        let fx = apply(&mut st, &b, &acquire(2, 1), &keys(0xb, 0xa), false).unwrap();
        assert_eq!(fx.abort, vec![a.clone()]);
        assert_eq!(notices(&fx), vec![(&a, notice::REGISTRATION_PREEMPTED)]);
        assert_eq!(st.registrations.len(), 1);
        assert_eq!(st.reservation.as_ref().map(|r| rtype(r.kind)), Some(1));
        let r = report(&st, true, false, |_| Some(7));
        assert_eq!(r.len(), 128);
        assert_eq!((r[4], r[5], r[64], r[66]), (1, 1, 7, 1));
        assert_eq!(&r[72..80], &0xbu64.to_le_bytes());
        assert_eq!(&r[80..96], &[2; 16]);
    }

    /// The holder preempting with PRKEY 0 (nvme-cli's default) changes the type, as Linux's
    /// nvmet and blktests expect.
    #[test]
    fn the_holder_preempts_its_own_reservation_to_change_its_type() {
        let a = host([1; 16]);
        let mut st = PrState::default();
        apply(&mut st, &a, &register(0, false, 0), &keys(0, 4), false).unwrap();
        apply(&mut st, &a, &acquire(0, 1), &keys(4, 0), false).unwrap();
        apply(&mut st, &a, &acquire(1, 2), &keys(4, 0), false).unwrap();
        assert_eq!(st.reservation.as_ref().map(|r| rtype(r.kind)), Some(2));
        assert_eq!(st.registrations.len(), 1);
    }

    #[test]
    fn ptpl_is_refused_without_a_store_and_kept_with_one() {
        let a = host([1; 16]);
        let mut st = PrState::default();
        assert_eq!(
            apply(&mut st, &a, &register(0, false, 3), &keys(0, 1), false),
            Err(Status::INVALID_FIELD)
        );
        let fx = apply(&mut st, &a, &register(0, false, 3), &keys(0, 1), true).unwrap();
        assert!(fx.save && st.aptpl);
        // Acquire and Release refuse IEKEY; CPTPL 01b is reserved.
        let mut s = Sqe::new(NvmOpcode::ReservationAcquire.code(), 1);
        s.set_cdw(10, 1 << 3 | 1 << 8);
        assert_eq!(decode(&s), Err(Status::INVALID_FIELD));
        let mut s = Sqe::new(NvmOpcode::ReservationRegister.code(), 1);
        s.set_cdw(10, 1 << 30);
        assert_eq!(decode(&s), Err(Status::INVALID_FIELD));
    }
}
