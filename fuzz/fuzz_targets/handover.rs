//! A session handover (crates/iscsi-pdu's `handover`) from arbitrary bytes never panics, and
//! whatever is accepted is exactly what its own encoding gives back: as the bytes come (the
//! header and checksum refuse nearly all) and as a body signed like a writer's, against which
//! only the field checks stand. A unit's state (scsi-core's `UnitState`, which travels
//! beside the sessions) from the same bytes never panics either, and what it accepts goes
//! through its own encoding unchanged.
#![no_main]

use iscsi_pdu::crc32c;
use iscsi_pdu::handover::{SessionState, MAGIC, VERSION};
use libfuzzer_sys::fuzz_target;

fn accepted_as_encoded(bytes: &[u8]) {
    if let Ok(state) = SessionState::decode(bytes) {
        assert_eq!(state.encode(), bytes, "{state:?}");
    }
}

fuzz_target!(|input: &[u8]| {
    if let Some(unit) = scsi_core::UnitState::decode(input) {
        assert_eq!(scsi_core::UnitState::decode(&unit.encode()), Some(unit));
    }
    accepted_as_encoded(input);
    let mut signed = MAGIC.to_vec();
    signed.extend_from_slice(&VERSION.to_le_bytes());
    signed.extend_from_slice(&[0, 0]);
    signed.extend_from_slice(&(input.len() as u32).to_le_bytes());
    signed.extend_from_slice(input);
    signed.extend_from_slice(&crc32c(input).to_le_bytes());
    accepted_as_encoded(&signed);
});
