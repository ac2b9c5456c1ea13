//! Paper 004's claims on the software fabric, its costs set from the paper's measurements:
//! memory registration stays off the target's I/O path, and with a pre-registered pool (or a
//! warm registration cache) 32 discrete 4 KiB regions per 128 KiB command move within 10% of
//! one contiguous region, while registering each region per command (the paper's slow path)
//! costs more than the transfer. The figures are of the fabric's virtual clock, so they are
//! the same on every machine; docs/experiments.md has the table.

use srp::testing::{paper004, Registration};

#[test]
fn pool_and_cache_keep_32_discrete_regions_near_contiguous_speed() {
    let contiguous = paper004(Registration::Pool, 1, 64);
    let discrete = paper004(Registration::Pool, 32, 64);
    let cached = paper004(Registration::Cache, 32, 64);
    let slow = paper004(Registration::PerCommand, 32, 64);
    for r in [&contiguous, &discrete, &cached, &slow] {
        assert_eq!(r.target_registrations, 0, "{r:?}");
    }
    assert_eq!(discrete.initiator_registrations_per_command, 0.0);
    assert_eq!(cached.initiator_registrations_per_command, 0.0, "warm");
    assert_eq!(
        slow.initiator_registrations_per_command, 33.0,
        "32 regions and the table"
    );
    let total = |r: &srp::testing::Paper004| r.read_mb_s + r.write_mb_s;
    assert!(
        total(&discrete) >= 0.9 * total(&contiguous),
        "{discrete:?} {contiguous:?}"
    );
    assert!(total(&cached) >= 0.9 * total(&contiguous), "{cached:?}");
    assert!(total(&slow) < 0.6 * total(&contiguous), "{slow:?}");
}
