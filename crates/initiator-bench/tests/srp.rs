//! `initiator-bench run --transport srp fabric`: workloads through the real SRP target on the
//! software fabric, each registration strategy, data verified.

use std::time::Duration;

use initiator_bench::srp::{run_fabric, LinkModel, RdmaOptions};
use initiator_bench::workload::{Rw, Split, Workload};
use srp::initiator::Registration;

fn workload(rw: Rw, bs: u32, qd: usize, sessions: usize, ios: u64) -> Workload {
    Workload {
        rw,
        bs,
        qd,
        sessions,
        ios: Some(ios),
        time: Duration::from_secs(60),
        size: Some(8 << 20),
        verify: true,
        ..Workload::default()
    }
}

#[test]
fn mixed_io_verifies_with_every_registration_strategy() {
    for registration in Registration::ALL {
        let o = RdmaOptions {
            registration,
            regions: 32,
            link: LinkModel::Paper004,
            immediate_data: true,
        };
        let r = run_fabric(&workload(Rw::Randrw, 128 * 1024, 16, 2, 400), &o).unwrap();
        assert_eq!(r.ios, 400, "{registration:?}");
        assert_eq!(r.errors, 0, "{registration:?}");
        assert!(
            r.verified_blocks > 0,
            "{registration:?}: something was read back"
        );
        assert_eq!(r.verify_errors, 0, "{registration:?}");
        assert_eq!(
            r.target_registrations, 0,
            "the target registers nothing per I/O"
        );
        assert!(r.bytes_per_sec > 0.0 && r.latency_us.mean > 0.0);
        match registration {
            Registration::PerCommand => assert_eq!(r.initiator_registrations_per_io, 33.0),
            Registration::Pool => assert_eq!(r.initiator_registrations_per_io, 0.0),
            // Misses only while the cache fills: at most the places two channels use.
            Registration::Cache => assert!(r.initiator_registrations_per_io < 33.0 * 0.5),
        }
    }
}

#[test]
fn the_pool_moves_discrete_regions_near_contiguous_speed() {
    let run = |registration, regions| {
        let o = RdmaOptions {
            registration,
            regions,
            link: LinkModel::Paper004,
            immediate_data: true,
        };
        run_fabric(&workload(Rw::Read, 128 * 1024, 1, 1, 64), &o)
            .unwrap()
            .bytes_per_sec
    };
    let contiguous = run(Registration::Pool, 1);
    assert!(run(Registration::Pool, 32) >= 0.9 * contiguous);
    assert!(run(Registration::PerCommand, 32) < 0.6 * contiguous);
}

#[test]
fn large_sequential_writes_and_a_free_link() {
    let o = RdmaOptions {
        registration: Registration::Pool,
        regions: 4,
        link: LinkModel::Free,
        immediate_data: true,
    };
    let r = run_fabric(&workload(Rw::Write, 1 << 20, 4, 1, 16), &o).unwrap();
    assert_eq!((r.ios, r.errors, r.verify_errors), (16, 0, 0));
    assert_eq!(
        r.verified_blocks,
        8 * 2048,
        "the read-back pass checks all written"
    );
    assert_eq!(r.fabric_seconds, 0.0, "a free link charges nothing");
}

#[test]
fn bad_workloads_are_refused_with_the_reason() {
    let o = RdmaOptions {
        registration: Registration::Pool,
        regions: 1,
        link: LinkModel::Free,
        immediate_data: true,
    };
    let e = run_fabric(&workload(Rw::Read, 1000, 1, 1, 1), &o).unwrap_err();
    assert!(e.contains("--bs"), "{e}");
    let mut w = workload(Rw::Read, 4096, 1, 1, 1);
    w.split = Split::Linux;
    assert!(run_fabric(&w, &o).unwrap_err().contains("--split"));
}
