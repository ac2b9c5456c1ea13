//! The task set: attribute ordering, atomic overlapping writes, and task management with tasks
//! at every stage (dormant, waiting for data-out, waiting for a range, in the backend).

mod common;

use common::*;
use scsi_core::testing::Harness;
use scsi_core::{Op, Status, TaskAttribute, TmfFunction, TmfResponse};

fn read(h: &mut Harness, n: scsi_core::NexusId, attr: TaskAttribute, lba: u32) -> u64 {
    let t = h.submit(n, 0, &cdb10(0x28, 0, lba, 1), attr, &[], 512);
    h.run();
    t
}

fn held_lbas(h: &Harness) -> Vec<u64> {
    h.held
        .iter()
        .map(|(_, _, op)| match *op {
            Op::Read { lba, .. } | Op::Write { lba, .. } => lba,
            _ => u64::MAX,
        })
        .collect()
}

#[test]
fn ordered_and_head_of_queue() {
    for delegate in [false, true] {
        let mut h = harness_with(delegate);
        let n = h.login("iqn.x:a", 1);
        h.hold_backend = true;
        let s1 = read(&mut h, n, TaskAttribute::Simple, 1);
        let o = read(&mut h, n, TaskAttribute::Ordered, 2);
        let s2 = read(&mut h, n, TaskAttribute::Simple, 3);
        // The ORDERED task waits for S1; S2 waits for the ORDERED one.
        assert_eq!(held_lbas(&h), [1]);
        let hoq = read(&mut h, n, TaskAttribute::HeadOfQueue, 4);
        assert_eq!(held_lbas(&h), [1, 4], "HEAD OF QUEUE goes at once");
        // S1 ends: the ORDERED task goes (the HoQ task is newer than it); S2 waits for both
        // older blockers.
        assert!(h.release());
        assert_eq!(held_lbas(&h), [4, 2]);
        assert!(h.release());
        assert_eq!(held_lbas(&h), [2]);
        assert!(h.release());
        assert_eq!(held_lbas(&h), [3]);
        assert!(h.release());
        for t in [s1, o, s2, hoq] {
            assert!(h.outcomes[&t].is_good());
        }
        // ACA without an ACA condition.
        h.hold_backend = false;
        let aca = read(&mut h, n, TaskAttribute::Aca, 0);
        check(&h.outcomes[&aca], 5, 0x49, 0);
    }
}

#[test]
fn overlapping_writes_are_serialized_in_arrival_order() {
    for delegate in [false, true] {
        let mut h = harness_with(delegate);
        let n = h.login("iqn.x:a", 1);
        h.hold_backend = true;
        let w = |h: &mut Harness, lba: u32, blocks: u16, seed: u8| {
            let t = h.submit(
                n,
                0,
                &cdb10(0x2a, 0, lba, blocks),
                TaskAttribute::Simple,
                &pattern(blocks.into(), seed),
                u32::from(blocks) * 512,
            );
            h.run();
            t
        };
        w(&mut h, 0, 8, 1);
        w(&mut h, 4, 8, 2); // overlaps the first
        w(&mut h, 100, 1, 3); // independent
        w(&mut h, 10, 1, 4); // overlaps only the waiting second: waits behind it
        let mut caw = cdb16(0x89, 0, 6, 0);
        caw[13] = 1;
        let c = h.submit(
            n,
            0,
            &caw,
            TaskAttribute::Simple,
            &[vec![0; 512], pattern(1, 5)].concat(),
            1024,
        );
        h.run();
        assert_eq!(held_lbas(&h), [0, 100]);
        // Reads are not held back by writers.
        read(&mut h, n, TaskAttribute::Simple, 5);
        assert_eq!(held_lbas(&h), [0, 100, 5]);
        assert!(h.release());
        assert_eq!(held_lbas(&h), [100, 5, 4]);
        while h.release() {}
        h.hold_backend = false;
        // Arrival order: the second write (at 4..12) then the one at 10; COMPARE AND WRITE at 6
        // then compares against the second write's data and miscompares.
        let r = h.command(n, 0, &cdb10(0x28, 0, 0, 12), &[], 12 * 512);
        assert_eq!(&r.data[..4 * 512], &pattern(4, 1)[..]);
        assert_eq!(&r.data[4 * 512..10 * 512], &pattern(8, 2)[..6 * 512]);
        assert_eq!(&r.data[10 * 512..11 * 512], &pattern(1, 4)[..]);
        check(&h.outcomes[&c], 0x0e, 0x1d, 0);
    }
}

#[test]
fn abort_task_at_every_stage() {
    for delegate in [false, true] {
        let mut h = harness_with(delegate);
        let n = h.login("iqn.x:a", 1);
        h.hold_backend = true;
        h.hold_data_out = true;
        // In the backend: the abort waits for the operation.
        let in_backend = read(&mut h, n, TaskAttribute::Simple, 0);
        // Dormant behind an ORDERED task.
        let ordered = read(&mut h, n, TaskAttribute::Ordered, 1);
        let dormant = read(&mut h, n, TaskAttribute::Simple, 2);
        h.task_management(n, 0, TmfFunction::AbortTask(dormant), 1);
        assert_eq!(h.tmf[&1], TmfResponse::Complete);
        assert_eq!(h.outcomes[&dormant].status, None);
        h.task_management(n, 0, TmfFunction::AbortTask(in_backend), 2);
        assert!(!h.tmf.contains_key(&2), "waits for the backend");
        assert!(h.release());
        assert_eq!(h.tmf[&2], TmfResponse::Complete);
        assert_eq!(
            h.outcomes[&in_backend].status, None,
            "no status for an aborted task"
        );
        assert!(h.release());
        assert!(h.outcomes[&ordered].is_good());
        // Waiting for data-out.
        let w = h.submit(
            n,
            0,
            &cdb10(0x2a, 0, 0, 1),
            TaskAttribute::Simple,
            &pattern(1, 1),
            512,
        );
        h.run();
        assert_eq!(h.held_data_out.len(), 1);
        h.task_management(n, 0, TmfFunction::QueryTask(w), 3);
        assert_eq!(h.tmf[&3], TmfResponse::Succeeded(None));
        h.task_management(n, 0, TmfFunction::AbortTask(w), 4);
        assert_eq!(h.outcomes[&w].status, None);
        h.task_management(n, 0, TmfFunction::QueryTask(w), 5);
        assert_eq!(h.tmf[&5], TmfResponse::Complete);
        h.task_management(n, 0, TmfFunction::AbortTask(w), 6);
        assert_eq!(h.tmf[&6], TmfResponse::TaskNotFound);
        h.task_management(n, 9, TmfFunction::AbortTaskSet, 7);
        assert_eq!(h.tmf[&7], TmfResponse::IncorrectLun);
    }
}

#[test]
fn task_set_functions_and_resets() {
    for delegate in [false, true] {
        let mut h = harness_with(delegate);
        let a = h.login("iqn.x:a", 1);
        let b = h.login("iqn.x:b", 2);
        h.hold_backend = true;
        let a1 = read(&mut h, a, TaskAttribute::Simple, 0);
        let b1 = read(&mut h, b, TaskAttribute::Simple, 1);
        h.task_management(b, 0, TmfFunction::QueryTaskSet, 1);
        assert_eq!(h.tmf[&1], TmfResponse::Succeeded(None));
        // ABORT TASK SET: only the caller's tasks.
        h.task_management(a, 0, TmfFunction::AbortTaskSet, 2);
        while h.release() {}
        assert_eq!(h.tmf[&2], TmfResponse::Complete);
        assert_eq!(h.outcomes[&a1].status, None);
        assert!(h.outcomes[&b1].is_good());
        // CLEAR TASK SET: everyone's, and the other nexus is told.
        let a2 = read(&mut h, a, TaskAttribute::Simple, 0);
        let b2 = read(&mut h, b, TaskAttribute::Simple, 1);
        h.task_management(a, 0, TmfFunction::ClearTaskSet, 3);
        while h.release() {}
        assert_eq!(h.outcomes[&a2].status, None);
        assert_eq!(h.outcomes[&b2].status, None);
        h.hold_backend = false;
        check(&h.command(b, 0, &[0; 6], &[], 0), 6, 0x2f, 0);
        good(&h.command(a, 0, &[0; 6], &[], 0));
        // QUERY ASYNCHRONOUS EVENT sees a pending unit attention.
        h.task_management(a, 0, TmfFunction::LogicalUnitReset, 4);
        assert_eq!(h.tmf[&4], TmfResponse::Complete);
        h.task_management(b, 0, TmfFunction::QueryAsynchronousEvent, 5);
        assert_eq!(h.tmf[&5], TmfResponse::Succeeded(Some([6, 0x29, 0x03])));
        check(&h.command(b, 0, &[0; 6], &[], 0), 6, 0x29, 0x03);
        h.task_management(b, 0, TmfFunction::QueryAsynchronousEvent, 6);
        assert_eq!(h.tmf[&6], TmfResponse::Complete);
        // TARGET WARM RESET reaches every unit.
        h.task_management(a, 0, TmfFunction::TargetWarmReset, 7);
        check(&h.command(a, 1, &[0; 6], &[], 0), 6, 0x29, 0x03);
        h.task_management(a, 0, TmfFunction::ClearAca, 8);
        assert_eq!(h.tmf[&8], TmfResponse::Complete);
    }
}

#[test]
fn closing_a_nexus_aborts_its_tasks_but_not_others() {
    for delegate in [false, true] {
        let mut h = harness_with(delegate);
        let a = h.login("iqn.x:a", 1);
        let b = h.login("iqn.x:b", 2);
        h.hold_backend = true;
        let a1 = read(&mut h, a, TaskAttribute::Simple, 0);
        let b1 = read(&mut h, b, TaskAttribute::Simple, 1);
        h.device.close_nexus(a).unwrap();
        assert!(h.device.close_nexus(a).is_err(), "stale handle");
        while h.release() {}
        assert_eq!(h.outcomes[&a1].status, None);
        assert_eq!(h.outcomes[&b1].status, Some(Status::Good));
        assert_eq!(h.device.task_count(), 0);
    }
}

#[test]
fn dormant_tasks_that_complete_at_once_are_started_once() {
    // Found by the scsi_device fuzz target: an ORDERED task ends, enabling two SIMPLE tasks
    // that complete without the backend; the first one's end enabled the second from within.
    let mut h = harness();
    let n = h.login("iqn.x:a", 1);
    h.hold_backend = true;
    let o = read(&mut h, n, TaskAttribute::Ordered, 1);
    let turs: Vec<u64> = (0..3)
        .map(|_| {
            let t = h.submit(n, 0, &[0; 6], TaskAttribute::Simple, &[], 0);
            h.run();
            t
        })
        .collect();
    assert_eq!(held_lbas(&h), [1]);
    assert!(h.release());
    assert!(h.outcomes[&o].is_good());
    for t in turs {
        assert!(h.outcomes[&t].is_good(), "TEST UNIT READY {t}");
    }
    assert_eq!(h.device.task_count(), 0);
}
