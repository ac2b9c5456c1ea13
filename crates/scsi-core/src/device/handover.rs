//! A logical unit's state beyond its I_T nexuses and its medium, as an upgrade hands it to
//! the next process: its reservations (those a keeper shares only to tell what the sessions
//! missed: the keeper keeps them), the
//! mode page values MODE SELECT changed, whether START STOP UNIT stopped it and which I_T
//! nexuses prevent medium removal. Without it, a session handed over would find its
//! persistent reservation gone in the new process, and another initiator's writes allowed.

use super::{Device, DeviceError};
use crate::nexus::ItNexus;
use crate::pr::{decode_nexus, encode_nexus, ReservationEffects, Reservations};

/// What a unit holds that is neither an I_T nexus's nor on its medium.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UnitState {
    /// Its reservations. Those a keeper shares with other gateways are the keeper's (the
    /// next process reads them there): these say what the sessions handed over have heard
    /// of; `None` from a process that did not send them.
    pub reservations: Option<Reservations>,
    /// The Caching mode page's WCE as it stands.
    pub write_cache: bool,
    /// The Control mode page's D_SENSE.
    pub d_sense: bool,
    /// The Control mode page's SWP.
    pub swp: bool,
    /// START STOP UNIT stopped it.
    pub stopped: bool,
    /// The I_T nexuses that prevent medium removal.
    pub prevent: Vec<ItNexus>,
}

impl UnitState {
    /// The state as text: one line per value, then the reservations' own text
    /// ([`Reservations::encode`]) after a line that says it follows.
    pub fn encode(&self) -> Vec<u8> {
        let flag = |b: bool| u8::from(b);
        let mut t = format!(
            "wce {}\nd_sense {}\nswp {}\nstopped {}\n",
            flag(self.write_cache),
            flag(self.d_sense),
            flag(self.swp),
            flag(self.stopped)
        );
        for n in &self.prevent {
            t.push_str(&format!("prevent {}\n", encode_nexus(n)));
        }
        let mut b = t.into_bytes();
        if let Some(r) = &self.reservations {
            b.extend_from_slice(b"reservations\n");
            b.extend_from_slice(&r.encode());
        }
        b
    }

    /// Parses what [`UnitState::encode`] wrote; `None` when anything does not hold (an unknown
    /// line, a value out of place, a flag missing or given twice, damaged reservations).
    pub fn decode(bytes: &[u8]) -> Option<UnitState> {
        let text = std::str::from_utf8(bytes).ok()?;
        // The values' lines, up to the line that says the reservations follow.
        let mut head = text;
        let mut reservations = None;
        let mut at = 0;
        for line in text.split_inclusive('\n') {
            if line == "reservations\n" {
                head = &text[..at];
                reservations = Some(&text[at + line.len()..]);
                break;
            }
            at += line.len();
        }
        let mut flags: [Option<bool>; 4] = [None; 4];
        let mut prevent = Vec::new();
        for line in head.lines() {
            let w: Vec<&str> = line.split_whitespace().collect();
            let i = match *w.first()? {
                "wce" => 0,
                "d_sense" => 1,
                "swp" => 2,
                "stopped" => 3,
                "prevent" => {
                    prevent.push(decode_nexus(&w[1..])?);
                    if w.len() != 5 {
                        return None;
                    }
                    continue;
                }
                _ => return None,
            };
            let v = match w[1..] {
                ["0"] => false,
                ["1"] => true,
                _ => return None,
            };
            if flags[i].replace(v).is_some() {
                return None;
            }
        }
        let reservations = match reservations {
            Some(r) => Some(Reservations::decode(r.as_bytes())?),
            None => None,
        };
        Some(UnitState {
            reservations,
            write_cache: flags[0]?,
            d_sense: flags[1]?,
            swp: flags[2]?,
            stopped: flags[3]?,
            prevent,
        })
    }
}

impl Device {
    /// Every unit's state for a handover, by LUN index, with its serial number (which the
    /// next process checks it has the same unit under).
    pub fn unit_states(&self) -> Vec<(u16, String, UnitState)> {
        self.lus
            .iter()
            .enumerate()
            .filter_map(|(i, lu)| {
                let lu = lu.as_ref()?;
                let state = UnitState {
                    reservations: Some(lu.reservations.clone()),
                    write_cache: lu.unit.geometry.write_cache,
                    d_sense: lu.d_sense,
                    swp: lu.swp,
                    stopped: lu.stopped,
                    prevent: lu.prevent.clone(),
                };
                Some((i as u16, lu.unit.identity.serial.clone(), state))
            })
            .collect()
    }

    /// Unit `lun`'s serial number (which a handover checks the next process has the same
    /// unit under).
    pub fn unit_serial(&self, lun: u16) -> Option<&str> {
        self.lu(lun).map(|lu| lu.unit.identity.serial.as_str())
    }

    /// Takes in unit `lun`'s state from the process before (a handover): it replaces what
    /// this one has (an APTPL state loaded at the start is older than the handed-over one).
    /// Reservations a keeper shares are left to it: what they went through since the
    /// process before took its state (another gateway's PREEMPT while the sessions moved)
    /// reaches the sessions' nexuses as unit attentions when they are adopted.
    pub fn adopt_unit_state(&mut self, lun: u16, state: UnitState) -> Result<(), DeviceError> {
        let lu = self.lu_mut(lun).ok_or(DeviceError::Lun(lun))?;
        lu.unit.geometry.write_cache = state.write_cache;
        lu.d_sense = state.d_sense;
        lu.swp = state.swp;
        lu.stopped = state.stopped;
        lu.prevent = state.prevent;
        let Some(heard) = state.reservations else {
            return Ok(());
        };
        if lu.shared.is_none() {
            lu.reservations = heard;
            return Ok(());
        }
        let missed = ReservationEffects::missed(&heard.persistent, &lu.reservations.persistent);
        self.hand_unit_attentions(lun, missed);
        Ok(())
    }

    /// The handover is over, every nexus it brought adopted: the unit attentions kept for
    /// nexuses it did not bring go. They are a shared unit's registrants that reach it through
    /// another gateway, or sessions the handover refused; a nexus that logs in here later
    /// starts with POWER ON, RESET, which says all they would.
    pub fn end_handover(&mut self) {
        self.handed_unit_attentions = Vec::new();
    }

    /// Keeps the unit attentions of what the nexuses of shared unit `lun` missed while they
    /// moved, for each to hear once adopted (those of an earlier handover of the unit go).
    fn hand_unit_attentions(&mut self, lun: u16, missed: ReservationEffects) {
        self.handed_unit_attentions.retain(|(_, l, _)| *l != lun);
        self.handed_unit_attentions.extend(
            missed
                .unit_attentions
                .into_iter()
                .map(|(nexus, asc)| (nexus, lun, asc)),
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::nexus::TransportId;
    use proptest::prelude::*;

    fn nexus(name: &str, port: u16) -> ItNexus {
        ItNexus {
            initiator: TransportId::iscsi(name, [0x80, 0, 0, 0, 0, 1]),
            relative_port: port,
        }
    }

    proptest! {
        /// Every state goes through its text unchanged; arbitrary bytes never panic.
        #[test]
        fn unit_states_round_trip(
            flags in any::<[bool; 4]>(),
            prevent in proptest::collection::vec(("[a-z0-9.:-]{1,40}", 1u16..4), 0..3),
            reserved in any::<bool>(),
            junk in proptest::collection::vec(any::<u8>(), 0..200),
        ) {
            let mut reservations = Reservations::default();
            if reserved {
                reservations.spc2 = Some(nexus("iqn.2026-12.io.example:i", 1));
            }
            let state = UnitState {
                reservations: Some(reservations),
                write_cache: flags[0],
                d_sense: flags[1],
                swp: flags[2],
                stopped: flags[3],
                prevent: prevent.iter().map(|(n, p)| nexus(n, *p)).collect(),
            };
            prop_assert_eq!(UnitState::decode(&state.encode()), Some(state.clone()));
            let shared = UnitState { reservations: None, ..state };
            prop_assert_eq!(UnitState::decode(&shared.encode()), Some(shared));
            let _ = UnitState::decode(&junk);
        }
    }

    #[test]
    fn damaged_states_are_refused() {
        for bad in [
            "wce 1\nd_sense 0\nswp 0\n",
            "wce 1\nd_sense 0\nswp 0\nstopped 0\nwce 0\n",
            "wce 2\nd_sense 0\nswp 0\nstopped 0\n",
            "wce 1\nd_sense 0\nswp 0\nstopped 0\nmystery 1\n",
            "wce 1\nd_sense 0\nswp 0\nstopped 0\nprevent 1 1\n",
        ] {
            assert_eq!(UnitState::decode(bad.as_bytes()), None, "{bad:?}");
        }
    }
}
