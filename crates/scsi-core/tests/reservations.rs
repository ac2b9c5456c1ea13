//! Persistent reservations with two and three nexuses: ownership and access for every type,
//! every service action, and persistence.

mod common;

use common::*;
use scsi_core::pr::{MemoryStore, PrState, PrStore};
use scsi_core::testing::{Harness, Outcome};
use scsi_core::{Device, NexusId, Status, TaskAttribute, TransportId};

fn prout(h: &mut Harness, n: NexusId, sa: u8, ty: u8, key: u64, sa_key: u64, flags: u8) -> Outcome {
    let mut p = vec![0u8; 24];
    p[..8].copy_from_slice(&key.to_be_bytes());
    p[8..16].copy_from_slice(&sa_key.to_be_bytes());
    p[20] = flags;
    prout_raw(h, n, sa, ty, &p)
}

fn prout_raw(h: &mut Harness, n: NexusId, sa: u8, ty: u8, p: &[u8]) -> Outcome {
    h.command(n, 0, &prout_cdb(sa, ty, p.len()), p, 0)
}

fn prout_cdb(sa: u8, ty: u8, len: usize) -> [u8; 10] {
    let mut c = [0u8; 10];
    c[0] = 0x5f;
    c[1] = sa;
    c[2] = ty;
    c[5..9].copy_from_slice(&(len as u32).to_be_bytes());
    c
}

fn prin(h: &mut Harness, n: NexusId, sa: u8) -> Vec<u8> {
    let o = h.command(n, 0, &[0x5e, sa, 0, 0, 0, 0, 0, 4, 0, 0], &[], 1024);
    good(&o);
    o.data
}

fn conflict(o: &Outcome) -> bool {
    o.status == Some(Status::ReservationConflict)
}

fn can_read(h: &mut Harness, n: NexusId) -> bool {
    !conflict(&h.command(n, 0, &cdb10(0x28, 0, 0, 1), &[], 512))
}

fn can_write(h: &mut Harness, n: NexusId) -> bool {
    !conflict(&h.command(n, 0, &cdb10(0x2a, 0, 0, 1), &pattern(1, 0), 512))
}

#[test]
fn access_matrix_for_every_type() {
    // (type, registered non-holder read, write; unregistered read, write)
    let table = [
        (1, true, false, true, false),
        (3, false, false, false, false),
        (5, true, true, true, false),
        (6, true, true, false, false),
        (7, true, true, true, false),
        (8, true, true, false, false),
    ];
    for (ty, b_read, b_write, c_read, c_write) in table {
        let mut h = harness();
        let a = h.login("iqn.x:a", 1);
        let b = h.login("iqn.x:b", 2);
        let c = h.login("iqn.x:c", 3);
        good(&prout(&mut h, a, 0, 0, 0, 0xa, 0));
        good(&prout(&mut h, b, 0, 0, 0, 0xb, 0));
        good(&prout(&mut h, a, 1, ty, 0xa, 0, 0));
        assert!(
            can_read(&mut h, a) && can_write(&mut h, a),
            "type {ty}: holder"
        );
        assert_eq!(can_read(&mut h, b), b_read, "type {ty}: registrant read");
        assert_eq!(can_write(&mut h, b), b_write, "type {ty}: registrant write");
        assert_eq!(can_read(&mut h, c), c_read, "type {ty}: other read");
        assert_eq!(can_write(&mut h, c), c_write, "type {ty}: other write");
        // INQUIRY, TUR, READ CAPACITY and PR IN never conflict.
        good(&h.command(c, 0, &[0x12, 0, 0, 0, 36, 0], &[], 36));
        good(&h.command(c, 0, &[0; 6], &[], 0));
        prin(&mut h, c, 1);
        // READ RESERVATION: the key is the holder's, or 0 for all-registrants types.
        let r = prin(&mut h, c, 1);
        assert_eq!(&r[4..8], &[0, 0, 0, 16]);
        let key = if ty >= 7 { 0 } else { 0xa };
        assert_eq!(&r[8..16], &u64::to_be_bytes(key));
        assert_eq!(r[21], ty);
        // Releasing with the wrong type is an error; with the right one it works.
        let other = if ty == 1 { 3 } else { 1 };
        let wrong = prout(&mut h, a, 2, other, 0xa, 0, 0);
        check(&wrong, 5, 0x26, 0x04);
        good(&prout(&mut h, a, 2, ty, 0xa, 0, 0));
        assert!(can_write(&mut h, c));
        // Registrants only and all registrants types tell the others it was released.
        let ua = h.command(b, 0, &[0; 6], &[], 0);
        if matches!(ty, 5..=8) {
            check(&ua, 6, 0x2a, 0x04);
        } else {
            good(&ua);
        }
    }
}

#[test]
fn registration_rules() {
    for delegate in [false, true] {
        let mut h = harness_with(delegate);
        let a = h.login("iqn.x:a", 1);
        let b = h.login("iqn.x:b", 2);
        // Unregistered with a non-zero key: conflict.
        assert!(conflict(&prout(&mut h, a, 0, 0, 5, 0xa, 0)));
        good(&prout(&mut h, a, 0, 0, 0, 0xa, 0));
        // Registered: the key must match.
        assert!(conflict(&prout(&mut h, a, 0, 0, 0xb, 0xc, 0)));
        good(&prout(&mut h, a, 0, 0, 0xa, 0xaa, 0));
        // REGISTER AND IGNORE EXISTING KEY.
        good(&prout(&mut h, a, 6, 0, 0x1234, 0xa, 0));
        good(&prout(&mut h, b, 6, 0, 0, 0xb, 0));
        let keys = prin(&mut h, a, 0);
        assert_eq!(
            &keys[..4],
            &4u32.to_be_bytes(),
            "PRGENERATION counts registrations"
        );
        assert_eq!(&keys[4..8], &[0, 0, 0, 16]);
        assert_eq!(&keys[8..16], &0xau64.to_be_bytes());
        assert_eq!(&keys[16..24], &0xbu64.to_be_bytes());
        // Reserve needs a registration and the right key.
        let c = h.login("iqn.x:c", 3);
        assert!(conflict(&prout(&mut h, c, 1, 1, 0, 0, 0)));
        assert!(conflict(&prout(&mut h, a, 1, 1, 0xb, 0, 0)));
        check(&prout(&mut h, a, 1, 2, 0xa, 0, 0), 5, 0x24, 0);
        good(&prout(&mut h, a, 1, 1, 0xa, 0, 0));
        good(&prout(&mut h, a, 1, 1, 0xa, 0, 0));
        assert!(conflict(&prout(&mut h, b, 1, 1, 0xb, 0, 0)));
        assert!(conflict(&prout(&mut h, a, 1, 3, 0xa, 0, 0)));
        // SPC-2 RESERVE conflicts with registrations.
        assert!(conflict(&h.command(b, 0, &[0x16, 0, 0, 0, 0, 0], &[], 0)));
        // Unregistering the holder releases a Write Exclusive reservation.
        good(&prout(&mut h, a, 0, 0, 0xa, 0, 0));
        assert_eq!(&prin(&mut h, b, 1)[4..8], &[0, 0, 0, 0]);
        // The parameter list must be 24 bytes.
        let o = prout_raw(&mut h, b, 0, 0, &[0; 20]);
        check(&o, 5, 0x1a, 0);
        // APTPL without a store is refused.
        check(&prout(&mut h, b, 0, 0, 0xb, 0xb, 0x01), 5, 0x26, 0);
        let caps = prin(&mut h, a, 2);
        assert_eq!(&caps[..2], &[0, 8]);
        assert_eq!(caps[2] & 0x01, 0, "no PTPL_C without a store");
        assert_eq!(&caps[4..6], &[0xea, 0x01]);
    }
}

#[test]
fn preempt_clear_and_preempt_and_abort() {
    for delegate in [false, true] {
        let mut h = harness_with(delegate);
        let a = h.login("iqn.x:a", 1);
        let b = h.login("iqn.x:b", 2);
        let c = h.login("iqn.x:c", 3);
        good(&prout(&mut h, a, 0, 0, 0, 0xa, 0));
        good(&prout(&mut h, b, 0, 0, 0, 0xb, 0));
        good(&prout(&mut h, c, 0, 0, 0, 0xc, 0));
        good(&prout(&mut h, a, 1, 3, 0xa, 0, 0));
        // PREEMPT of a key nobody has: conflict; of key 0 without all-registrants: error.
        assert!(conflict(&prout(&mut h, b, 4, 3, 0xb, 0x99, 0)));
        check(&prout(&mut h, b, 4, 3, 0xb, 0, 0), 5, 0x26, 0);
        // B preempts the holder: it holds the reservation and A is unregistered.
        good(&prout(&mut h, b, 4, 1, 0xb, 0xa, 0));
        check(&h.command(a, 0, &[0; 6], &[], 0), 6, 0x2a, 0x05);
        // The remaining registrant hears that the reservation changed.
        check(&h.command(c, 0, &[0; 6], &[], 0), 6, 0x2a, 0x04);
        let r = prin(&mut h, c, 1);
        assert_eq!((&r[8..16], r[21]), (&0xbu64.to_be_bytes()[..], 1));
        assert!(!can_write(&mut h, a));
        // PREEMPT AND ABORT: C's in-flight command on the unit is aborted.
        h.hold_backend = true;
        let tag = h.submit(c, 0, &cdb10(0x28, 0, 0, 1), TaskAttribute::Simple, &[], 512);
        h.run();
        assert_eq!(h.held.len(), 1, "{:?}", h.outcomes.get(&tag));
        h.hold_backend = false;
        // It completes only once the aborted read has ended: its I/O could still be under
        // way, and a preempted write must not reach the medium after PREEMPT AND ABORT.
        let mut p = vec![0u8; 24];
        p[..8].copy_from_slice(&0xbu64.to_be_bytes());
        p[8..16].copy_from_slice(&0xcu64.to_be_bytes());
        let preempt = h.submit(b, 0, &prout_cdb(5, 1, 24), TaskAttribute::Simple, &p, 0);
        h.run();
        assert!(
            !h.outcomes.contains_key(&preempt),
            "PREEMPT AND ABORT ended before the task it aborted"
        );
        while h.release() {}
        h.run();
        good(
            &h.outcomes
                .remove(&preempt)
                .expect("PREEMPT AND ABORT ended"),
        );
        assert_eq!(h.outcomes.remove(&tag).unwrap().status, None, "aborted");
        check(&h.command(c, 0, &[0; 6], &[], 0), 6, 0x2a, 0x05);
        // READ FULL STATUS: only B, holding.
        let full = prin(&mut h, b, 3);
        assert_eq!(
            &full[4..8],
            &56u32.to_be_bytes(),
            "one descriptor, 24 + TransportID 32"
        );
        assert_eq!(&full[8..16], &0xbu64.to_be_bytes());
        assert_eq!(full[20], 0x01, "R_HOLDER");
        assert_eq!(full[21], 1);
        let (tid, _) = TransportId::parse(&full[32..], 32).unwrap();
        assert_eq!(tid, TransportId::iscsi("iqn.x:b", [0x80, 0, 0, 0, 0, 2]));
        // CLEAR removes everything and tells the other registrants.
        good(&prout(&mut h, a, 0, 0, 0, 0xa, 0));
        good(&prout(&mut h, b, 3, 0, 0xb, 0, 0));
        check(&h.command(a, 0, &[0; 6], &[], 0), 6, 0x2a, 0x03);
        assert_eq!(&prin(&mut h, a, 0)[4..8], &[0, 0, 0, 0]);
    }
}

#[test]
fn all_registrants_preempt_with_zero_key() {
    for delegate in [false, true] {
        let mut h = harness_with(delegate);
        let a = h.login("iqn.x:a", 1);
        let b = h.login("iqn.x:b", 2);
        good(&prout(&mut h, a, 0, 0, 0, 0xa, 0));
        good(&prout(&mut h, b, 0, 0, 0, 0xb, 0));
        good(&prout(&mut h, a, 1, 8, 0xa, 0, 0));
        // Unregistering one registrant keeps an all-registrants reservation.
        good(&prout(&mut h, a, 0, 0, 0xa, 0, 0));
        assert_eq!(prin(&mut h, b, 1)[21], 8);
        good(&prout(&mut h, a, 0, 0, 0, 0xa, 0));
        good(&prout(&mut h, b, 4, 3, 0xb, 0, 0));
        let r = prin(&mut h, b, 1);
        assert_eq!((&r[8..16], r[21]), (&0xbu64.to_be_bytes()[..], 3));
        assert_eq!(&prin(&mut h, b, 0)[4..8], &[0, 0, 0, 8]);
    }
}

#[test]
fn spec_i_pt_all_tg_pt_and_register_and_move() {
    for delegate in [false, true] {
        let mut h = harness_with(delegate);
        let a = h.login("iqn.x:a", 1);
        let b_port = TransportId::iscsi("iqn.x:b", [0x80, 0, 0, 0, 0, 2]);
        let mut p = vec![0u8; 24];
        p[8..16].copy_from_slice(&0xau64.to_be_bytes());
        p[20] = 0x08 | 0x04; // SPEC_I_PT, ALL_TG_PT
        let mut tid = Vec::new();
        b_port.encode(&mut tid);
        p.extend_from_slice(&(tid.len() as u32).to_be_bytes());
        p.extend_from_slice(&tid);
        good(&prout_raw(&mut h, a, 0, 0, &p));
        // A and B, each through every port: B is registered without logging in.
        let full = prin(&mut h, a, 3);
        let keys = prin(&mut h, a, 0);
        assert_eq!(&keys[4..8], &[0, 0, 0, 16]);
        assert_eq!(full[20] & 0x02, 0x02, "ALL_TG_PT");
        let b = h.login("iqn.x:b", 2);
        good(&prout(&mut h, b, 1, 1, 0xa, 0, 0));
        // REGISTER AND MOVE to a new nexus C.
        let c_port = TransportId::iscsi("iqn.x:c", [0x80, 0, 0, 0, 0, 3]);
        let mut mv = vec![0u8; 24];
        mv[..8].copy_from_slice(&0xau64.to_be_bytes());
        mv[8..16].copy_from_slice(&0xcu64.to_be_bytes());
        mv[17] = 0x02; // UNREG
        mv[18..20].copy_from_slice(&1u16.to_be_bytes());
        let mut tid = Vec::new();
        c_port.encode(&mut tid);
        mv[20..24].copy_from_slice(&(tid.len() as u32).to_be_bytes());
        mv.extend_from_slice(&tid);
        good(&prout_raw(&mut h, b, 7, 1, &mv));
        let c = h.login("iqn.x:c", 3);
        assert!(can_write(&mut h, c));
        assert!(!can_write(&mut h, b));
        let r = prin(&mut h, c, 1);
        assert_eq!(&r[8..16], &0xcu64.to_be_bytes());
    }
}

#[test]
fn aptpl_survives_a_restart_and_store_round_trips() {
    // A store that outlives the device.
    let mut h = harness();
    let shared = std::sync::Arc::new(std::sync::Mutex::new(MemoryStore::default()));
    struct Shared(std::sync::Arc<std::sync::Mutex<MemoryStore>>);
    impl PrStore for Shared {
        fn load(&self, unit: &str) -> Option<Vec<u8>> {
            self.0.lock().unwrap().load(unit)
        }
        fn save(&mut self, unit: &str, state: Option<&[u8]>) -> std::io::Result<()> {
            self.0.lock().unwrap().save(unit, state)
        }
    }
    h.device
        .set_reservation_store(Box::new(Shared(shared.clone())));
    let a = h.login("iqn.x:a", 1);
    good(&prout(&mut h, a, 0, 0, 0, 0xa, 0x01));
    good(&prout(&mut h, a, 1, 3, 0xa, 0, 0));
    drop(h);
    // "Restart": a new device with the same units and store.
    let mut h = Harness::new(Device::new("iqn.2026-11.io.example:t", ports()));
    h.add_lu(0, unit(true, b"lu0"));
    h.device
        .set_reservation_store(Box::new(Shared(shared.clone())));
    let b = h.login("iqn.x:b", 2);
    assert!(
        !can_read(&mut h, b),
        "the Exclusive Access reservation is back"
    );
    let r = prin(&mut h, b, 1);
    assert_eq!(&r[8..16], &0xau64.to_be_bytes());
    // Unregistering with APTPL 0 forgets the saved state.
    let a = h.login("iqn.x:a", 1);
    good(&prout(&mut h, a, 0, 0, 0xa, 0, 0));
    assert!(shared.lock().unwrap().0.is_empty());
}

#[test]
fn file_store_is_atomic_and_round_trips() {
    let dir = std::env::temp_dir().join(format!("scsi-core-pr-{}", std::process::id()));
    let mut s = scsi_core::pr::FileStore::new(&dir).unwrap();
    s.save("abc/def", Some(b"generation 1\n")).unwrap();
    assert_eq!(s.load("abc/def").unwrap(), b"generation 1\n");
    s.save("abc/def", Some(b"generation 2\n")).unwrap();
    assert_eq!(s.load("abc/def").unwrap(), b"generation 2\n");
    assert!(std::fs::read_dir(&dir).unwrap().all(|e| !e
        .unwrap()
        .file_name()
        .to_string_lossy()
        .ends_with(".tmp")));
    s.save("abc/def", None).unwrap();
    assert!(s.load("abc/def").is_none());
    s.save("abc/def", None).unwrap();
    std::fs::remove_dir_all(&dir).unwrap();
    assert!(PrState::decode(b"bogus line").is_none());
}
