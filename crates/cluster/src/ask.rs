//! A change to a shared unit's reservations in the words of the protocol that asks it, and
//! the answer in that protocol's words.
//!
//! SCSI and NVMe keep one reservation engine (scsi-core's [`Reservations`]): NVMe took its
//! reservations from SPC-3, and crates/nvme decides its commands on the same state
//! ([`nvme::reservation::apply`]). What differs is how a command is read and how a refusal
//! is said (sense data or an NVMe status), so a gateway decides either kind with the same
//! read, compare-and-swap, notify and fence, and hands each refusal back in its own words.

use nvme::reservation::ReservationCommand;
use nvme::status::Status;
use scsi_core::pr::{PrError, ReservationEffects, ReservationRequest, Reservations};
use scsi_core::{BackendError, ItNexus, Sense};

/// NOT READY, LOGICAL UNIT IS IN PROCESS OF BECOMING READY: the cluster did not answer, the
/// initiator retries.
pub fn unavailable() -> PrError {
    PrError::Sense(Sense::from(BackendError::Unavailable))
}

/// What a host asks of a shared unit's reservations.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Ask {
    /// PERSISTENT RESERVE OUT, RESERVE, RELEASE, an I_T nexus loss or a reset.
    Scsi(ReservationRequest),
    /// Reservation Register, Acquire or Release (never Report, which reads the state a
    /// gateway has applied) with its 16 bytes of data (CRKEY, then NRKEY or PRKEY; a
    /// Release has 8).
    Nvme {
        /// The command.
        command: ReservationCommand,
        /// Its data.
        data: [u8; 16],
    },
}

impl From<ReservationRequest> for Ask {
    fn from(r: ReservationRequest) -> Ask {
        Ask::Scsi(r)
    }
}

/// Why a change was not made: the command's status in its protocol's words.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    /// The cluster did not answer (or this gateway is fenced, or the unit is not shared
    /// here): the host retries, here or through another gateway.
    Unavailable,
    /// RESERVATION CONFLICT or CHECK CONDITION.
    Scsi(PrError),
    /// An NVMe status.
    Nvme(Status),
}

impl Refusal {
    /// The refusal as a SCSI command ends: NOT READY when unavailable
    /// ([`unavailable`]).
    pub fn scsi(self) -> PrError {
        match self {
            Refusal::Scsi(e) => e,
            Refusal::Unavailable | Refusal::Nvme(_) => unavailable(),
        }
    }

    /// The refusal as an NVMe command ends: Namespace Not Ready (which the host retries)
    /// when unavailable.
    pub fn nvme(self) -> Status {
        match self {
            Refusal::Nvme(s) => s,
            Refusal::Scsi(PrError::Conflict) => Status::RESERVATION_CONFLICT,
            Refusal::Unavailable | Refusal::Scsi(PrError::Sense(_)) => Status::NAMESPACE_NOT_READY,
        }
    }
}

impl Ask {
    /// Decides the ask of `who` on `state`: the new state is `state`, the effects are
    /// returned; refused, `state` is unchanged. An NVMe host may keep its registration
    /// through a power loss: the cluster's object outlives every gateway.
    pub fn apply(
        &self,
        state: &mut Reservations,
        who: &ItNexus,
    ) -> Result<ReservationEffects, Refusal> {
        match self {
            Ask::Scsi(request) => state.apply(who, request).map_err(Refusal::Scsi),
            Ask::Nvme { command, data } => {
                if state.spc2.is_some() {
                    // An SPC-2 reservation holds the whole unit: nobody else changes it.
                    return Err(Refusal::Nvme(Status::RESERVATION_CONFLICT));
                }
                nvme::reservation::apply(&mut state.persistent, who, command, data, true)
                    .map_err(Refusal::Nvme)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use nvme::opcode::NvmOpcode;
    use nvme::sqe::Sqe;

    fn command(opcode: NvmOpcode, cdw10: u32) -> ReservationCommand {
        let mut s = Sqe::new(opcode.code(), 1);
        s.set_cdw(10, cdw10);
        nvme::reservation::decode(&s).unwrap()
    }

    fn keys(a: u64, b: u64) -> [u8; 16] {
        let mut d = [0; 16];
        d[..8].copy_from_slice(&a.to_le_bytes());
        d[8..].copy_from_slice(&b.to_le_bytes());
        d
    }

    #[test]
    fn an_nvme_ask_decides_on_the_shared_state_and_refuses_in_nvme_words() {
        let (a, b) = (
            nvme::reservation::host([1; 16]),
            nvme::reservation::host([2; 16]),
        );
        let mut st = Reservations::default();
        let register = |key| Ask::Nvme {
            command: command(NvmOpcode::ReservationRegister, 0),
            data: keys(0, key),
        };
        register(7).apply(&mut st, &a).unwrap();
        register(8).apply(&mut st, &b).unwrap();
        // Write Exclusive by a.
        let acquire = Ask::Nvme {
            command: command(NvmOpcode::ReservationAcquire, 1 << 8),
            data: keys(7, 0),
        };
        acquire.apply(&mut st, &a).unwrap();
        let before = st.clone();
        assert_eq!(
            acquire.apply(&mut st, &b),
            Err(Refusal::Nvme(Status::RESERVATION_CONFLICT))
        );
        assert_eq!(st, before, "a refusal changes nothing");
        // Preempt and Abort by b names a.
        let fx = Ask::Nvme {
            command: command(NvmOpcode::ReservationAcquire, 2 | 1 << 8),
            data: keys(8, 7),
        }
        .apply(&mut st, &b)
        .unwrap();
        assert_eq!(fx.abort, vec![a]);
        assert!(st.persistent.is_holder(&b));
        // PTPL is kept by the cluster.
        let ptpl = Ask::Nvme {
            command: command(NvmOpcode::ReservationRegister, 3 << 30),
            data: keys(0, 8),
        };
        ptpl.apply(&mut st, &b).unwrap();
        assert!(st.persistent.aptpl);
    }

    #[test]
    fn refusals_say_unavailable_in_each_protocols_words() {
        assert_eq!(Refusal::Unavailable.nvme(), Status::NAMESPACE_NOT_READY);
        assert_eq!(Refusal::Unavailable.scsi(), unavailable());
        assert_eq!(
            Refusal::Scsi(PrError::Conflict).nvme(),
            Status::RESERVATION_CONFLICT
        );
    }
}
