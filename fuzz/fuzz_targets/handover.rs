//! A handed-over state from arbitrary bytes never panics, and whatever is accepted is exactly
//! what its own encoding gives back: an iSCSI session (crates/iscsi-pdu's `handover`) and an
//! NVMe/TCP controller with its queues (crates/nvme's `handover`), each as the bytes come (the
//! envelope's header and checksum refuse nearly all) and as a body sealed like a writer's,
//! against which only the field checks stand. A unit's state (scsi-core's `UnitState`, which
//! travels beside the sessions) from the same bytes never panics either, and what it accepts
//! goes through its own encoding unchanged.
#![no_main]

use iscsi_pdu::handover::SessionState;
use libfuzzer_sys::fuzz_target;
use nvme::handover::ControllerState;
use scsi_core::sealed::Seal;

fn session(bytes: &[u8]) {
    if let Ok(state) = SessionState::decode(bytes) {
        assert_eq!(state.encode(), bytes, "{state:?}");
    }
}

fn controller(bytes: &[u8]) {
    if let Ok(state) = ControllerState::decode(bytes) {
        assert_eq!(state.encode(), bytes, "{state:?}");
    }
}

fuzz_target!(|input: &[u8]| {
    if let Some(unit) = scsi_core::UnitState::decode(input) {
        assert_eq!(scsi_core::UnitState::decode(&unit.encode()), Some(unit));
    }
    session(input);
    controller(input);
    let iscsi = Seal {
        magic: iscsi_pdu::handover::MAGIC,
        version: iscsi_pdu::handover::VERSION,
        max_body: iscsi_pdu::handover::MAX_BODY,
    };
    session(&iscsi.seal(input));
    let nvme = Seal {
        magic: nvme::handover::MAGIC,
        version: nvme::handover::VERSION,
        max_body: nvme::handover::MAX_BODY,
    };
    controller(&nvme.seal(input));
});
