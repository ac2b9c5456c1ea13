//! A change to a unit's reservations as gateways tell each other in a notify: le64 version,
//! le32 length and the state, then the effects.

use scsi_core::pr::{ReservationEffects, Reservations};

/// The notify payload of the state at `version` and the `effects` of the change.
pub fn encode(version: u64, state: &Reservations, effects: &ReservationEffects) -> Vec<u8> {
    let s = state.encode();
    let mut b = Vec::with_capacity(12 + s.len());
    b.extend_from_slice(&version.to_le_bytes());
    b.extend_from_slice(&(s.len() as u32).to_le_bytes());
    b.extend_from_slice(&s);
    b.extend_from_slice(&effects.encode());
    b
}

/// What [`encode`] made; `None` for anything else (a damaged or foreign payload).
pub fn decode(b: &[u8]) -> Option<(u64, Reservations, ReservationEffects)> {
    let version = u64::from_le_bytes(b.get(..8)?.try_into().ok()?);
    let len = u32::from_le_bytes(b.get(8..12)?.try_into().ok()?) as usize;
    let state = Reservations::decode(b.get(12..12usize.checked_add(len)?)?)?;
    let effects = ReservationEffects::decode(&b[12 + len..])?;
    Some((version, state, effects))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_change_survives_its_encoding_and_damage_is_refused() {
        let state = Reservations::default();
        let effects = ReservationEffects::default();
        let b = encode(7, &state, &effects);
        assert_eq!(decode(&b), Some((7, state, effects)));
        assert_eq!(decode(&b[..10]), None);
        let mut long = b.clone();
        long[8..12].copy_from_slice(&u32::MAX.to_le_bytes());
        assert_eq!(decode(&long), None);
        assert_eq!(decode(&[]), None);
    }
}
