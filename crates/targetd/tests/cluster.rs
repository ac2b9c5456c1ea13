//! Several gateways as one target on a real Ceph cluster (feature `rbd`): two targetd
//! daemons with the same `[cluster]`, each its own port group, export one RBD image.
//!
//! - A reservation taken through gateway A binds the initiators of gateway B at the very next
//!   command, and both gateways report the same keys, generation and holder.
//! - PREEMPT through B reaches A's initiator as REGISTRATIONS PREEMPTED.
//! - An SPC-2 RESERVE through A conflicts on B until A's session ends.
//! - A race: initiators on both gateways REGISTER, RESERVE and PREEMPT at once; one holder,
//!   and both gateways agree on the state.
//! - Restarts: without APTPL the state is gone once every gateway restarted; with APTPL it
//!   stays.
//! - libiscsi's reservation and multipath tests with the two initiators on different gateways.
//! - ALUA: both gateways report the same port groups, SendTargets lists both, failover when
//!   one stops or is killed (no acknowledged write lost), fencing of a silent gateway.
//! - COMPARE AND WRITE from both gateways on one block: one winner each round.
//! - A gateway that exports an image otherwise than the others is refused, naming both; one
//!   whose whole target differs (access rules, CHAP) warns, and the last edited is recorded.
//! - Upgrades: a gateway upgraded under a reservation keeps its session, its reservation and
//!   its place (the others fence nobody, and its successor follows their changes); one whose
//!   successor dies after taking its place is listed again and serves on. A restart through
//!   the service manager's store keeps the sessions' reservations, and tells them what
//!   another gateway changed meanwhile.
//! - Linux's own initiator (iscsi_tcp, scsi_dh_alua, dm-multipath) in a QEMU guest, through a
//!   standby gateway: the disk has its size on both paths, and writes go on when the
//!   optimized gateway is killed.
//!
//! The cluster is the one the RBD tests use (tests/common/ceph.rs).
#![cfg(feature = "rbd")]
// The tests take turns with a std mutex held for each test's whole life, across its runtime's
// awaits: a turn is between tests, not between tasks.
#![allow(clippy::await_holding_lock)]

mod common;

use std::process::Command as Process;

use bytes::Bytes;
use common::ceph::{ceph, turn, unique, Ceph, CephExt};
use common::{config, opts, pattern, Daemon, TARGET};
use initiator_bench::scsi::{cdb, Command};
use initiator_bench::{LoginOptions, Session};
use iscsi_pdu::ScsiStatus;
use targetd::admin::{handle, AdminRequest};

/// Gateway `port_group` of cluster `name` exporting `image`.
fn gateway(ceph: &Ceph, name: &str, port_group: u16, image: &str) -> Daemon {
    Daemon::start(&gateway_config(ceph, name, port_group, image))
}

/// The config of gateway `port_group` of cluster `name` exporting `image` as LUN 0.
fn gateway_config(ceph: &Ceph, name: &str, port_group: u16, image: &str) -> String {
    let keyring = ceph.keyring_key();
    let cluster = format!(
        "[cluster]\nname = \"{name}\"\ngateway = \"gw{port_group}\"\nport_group = {port_group}\n\
         pool = \"{}\"\nceph_conf = \"{}\"\nclient = \"{}\"\n{keyring}",
        ceph.pool,
        ceph.conf.display(),
        ceph.client
    );
    config("", &ceph.target(image, "64MiB", "")) + &cluster
}

/// The same with `extra` keys in the LUN's table.
fn gateway_config_with(
    ceph: &Ceph,
    name: &str,
    port_group: u16,
    image: &str,
    extra: &str,
) -> String {
    gateway_config(ceph, name, port_group, image).replacen(
        &format!("image = \"{image}\"\n"),
        &format!("image = \"{image}\"\n{extra}"),
        1,
    )
}

fn as_initiator(name: &str) -> LoginOptions {
    LoginOptions {
        initiator_name: format!("iqn.2026-11.io.example:{name}"),
        ..opts()
    }
}

fn prout_cdb(action: u8, kind: u8) -> [u8; 16] {
    let mut c = [0u8; 16];
    c[0] = 0x5f;
    c[1] = action;
    c[2] = kind;
    c[5..9].copy_from_slice(&24u32.to_be_bytes());
    c
}

fn params(key: u64, sa_key: u64, aptpl: bool) -> Bytes {
    let mut p = vec![0u8; 24];
    p[..8].copy_from_slice(&key.to_be_bytes());
    p[8..16].copy_from_slice(&sa_key.to_be_bytes());
    p[20] = u8::from(aptpl);
    Bytes::from(p)
}

/// PERSISTENT RESERVE OUT: its status.
async fn prout(s: &Session, action: u8, kind: u8, key: u64, sa_key: u64) -> ScsiStatus {
    prout_aptpl(s, action, kind, key, sa_key, false).await
}

async fn prout_aptpl(
    s: &Session,
    action: u8,
    kind: u8,
    key: u64,
    sa_key: u64,
    aptpl: bool,
) -> ScsiStatus {
    let cmd = Command::write(s.lun(), prout_cdb(action, kind), params(key, sa_key, aptpl));
    s.execute(cmd).await.expect("a response").status
}

/// PERSISTENT RESERVE IN with `action`: the parameter data.
async fn prin(s: &Session, action: u8) -> Bytes {
    let mut c = [0u8; 16];
    c[0] = 0x5e;
    c[1] = action;
    c[7..9].copy_from_slice(&1024u16.to_be_bytes());
    let r = s
        .execute_good(Command::read(s.lun(), c, 1024))
        .await
        .expect("PERSISTENT RESERVE IN");
    r.data
}

/// Registered keys (READ KEYS) with the generation.
async fn keys(s: &Session) -> (u32, Vec<u64>) {
    let d = prin(s, 0).await;
    let generation = u32::from_be_bytes(d[0..4].try_into().unwrap());
    let len = u32::from_be_bytes(d[4..8].try_into().unwrap()) as usize;
    let keys = d[8..8 + len]
        .chunks(8)
        .map(|k| u64::from_be_bytes(k.try_into().unwrap()))
        .collect();
    (generation, keys)
}

async fn write_status(s: &Session, lba: u64) -> ScsiStatus {
    let cmd = Command::write(s.lun(), cdb::write(lba, 1), pattern(512, lba as usize));
    s.execute(cmd).await.expect("a response").status
}

async fn read_status(s: &Session) -> ScsiStatus {
    let cmd = Command::read(s.lun(), cdb::read(0, 1), 512);
    s.execute(cmd).await.expect("a response").status
}

/// The sense key, ASC and ASCQ of a TEST UNIT READY.
async fn tur_sense(s: &Session) -> Option<(u8, u8, u8)> {
    let r = s
        .execute(Command::new(s.lun(), cdb::test_unit_ready()))
        .await
        .expect("a response");
    r.sense
        .as_deref()
        .and_then(initiator_bench::Sense::parse)
        .map(|x| (x.key, x.asc, x.ascq))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reservation_through_one_gateway_binds_the_other() {
    let Some(ceph) = ceph() else { return };
    let _turn = turn();
    let (image, a, b, one, two) = two_gateways(&ceph, "pr").await;

    assert_eq!(prout(&one, 0, 0, 0, 0xa).await, ScsiStatus::GOOD);
    assert_eq!(prout(&two, 0, 0, 0, 0xb).await, ScsiStatus::GOOD);
    assert_eq!(keys(&one).await, (2, vec![0xa, 0xb]));
    assert_eq!(keys(&two).await, (2, vec![0xa, 0xb]));
    // WRITE EXCLUSIVE through A: B's next write conflicts, its reads run.
    assert_eq!(prout(&one, 1, 1, 0xa, 0).await, ScsiStatus::GOOD);
    assert_eq!(
        write_status(&two, 8).await,
        ScsiStatus::RESERVATION_CONFLICT
    );
    assert_eq!(read_status(&two).await, ScsiStatus::GOOD);
    assert_eq!(write_status(&one, 8).await, ScsiStatus::GOOD);
    let (ra, rb) = (prin(&one, 1).await, prin(&two, 1).await);
    assert_eq!(ra, rb, "READ RESERVATION differs between the gateways");
    assert_eq!(&rb[8..16], &0xau64.to_be_bytes());
    assert_eq!(rb[21], 1, "WRITE EXCLUSIVE");
    // READ FULL STATUS names the holder's port: gateway A's (relative port 1).
    let full = prin(&two, 3).await;
    assert_eq!(&full[8..16], &0xau64.to_be_bytes());
    assert_eq!(u16::from_be_bytes([full[26], full[27]]), 1);
    // B reserving over it conflicts; B preempts it instead.
    assert_eq!(
        prout(&two, 1, 3, 0xb, 0).await,
        ScsiStatus::RESERVATION_CONFLICT
    );
    assert_eq!(prout(&two, 4, 3, 0xb, 0xa).await, ScsiStatus::GOOD);
    // A hears it at its next command, on its own gateway, and is now locked out.
    assert_eq!(tur_sense(&one).await, Some((6, 0x2a, 0x05)));
    assert_eq!(read_status(&one).await, ScsiStatus::RESERVATION_CONFLICT);
    assert_eq!(keys(&one).await.1, vec![0xb]);
    let decided = |d: &Daemon, gw: &str| {
        let m = targetd::metrics::text(&d.registry);
        let key = format!("targetd_cluster_reservation_changes_total{{gateway=\"{gw}\"}} ");
        m.lines()
            .find_map(|l| l.strip_prefix(&key).and_then(|v| v.parse::<u64>().ok()))
            .unwrap_or_else(|| panic!("no {key} in\n{m}"))
    };
    assert_eq!((decided(&a, "gw1"), decided(&b, "gw2")), (2, 3));
    // B lets go: everyone may write.
    assert_eq!(prout(&two, 2, 3, 0xb, 0).await, ScsiStatus::GOOD);
    assert_eq!(prout(&two, 0, 0, 0xb, 0).await, ScsiStatus::GOOD);
    assert_eq!(write_status(&one, 9).await, ScsiStatus::GOOD);

    // SPC-2 RESERVE through A holds on B until A's session ends.
    let reserve6 = {
        let mut c = [0u8; 16];
        c[0] = 0x16;
        c
    };
    one.execute_good(Command::new(one.lun(), reserve6))
        .await
        .expect("RESERVE(6)");
    assert_eq!(read_status(&two).await, ScsiStatus::RESERVATION_CONFLICT);
    drop(one);
    let mut freed = false;
    for _ in 0..50 {
        if read_status(&two).await == ScsiStatus::GOOD {
            freed = true;
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    assert!(freed, "A's SPC-2 reservation outlived its session");
    drop(two);
    a.stop();
    b.stop();
    ceph.remove_image(&image);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn racing_gateways_agree_on_one_holder() {
    let Some(ceph) = ceph() else { return };
    let _turn = turn();
    let image = unique("race");
    let name = unique("gws");
    let a = gateway(&ceph, &name, 1, &image);
    let b = gateway(&ceph, &name, 2, &image);
    let mut sessions = Vec::new();
    for i in 0..8u64 {
        let d = if i % 2 == 0 { &a } else { &b };
        let s = d.session(as_initiator(&format!("racer{i}"))).await;
        while tur_sense(&s).await.is_some() {}
        sessions.push(s);
    }
    // Everyone registers and tries to reserve at once, then everyone preempts everyone.
    let mut runs = Vec::new();
    for (i, s) in sessions.into_iter().enumerate() {
        runs.push(tokio::spawn(async move {
            let key = 0x100 + i as u64;
            assert_eq!(prout(&s, 0, 0, 0, key).await, ScsiStatus::GOOD);
            let reserved = prout(&s, 1, 3, key, 0).await;
            assert!(
                matches!(
                    reserved,
                    ScsiStatus::GOOD | ScsiStatus::RESERVATION_CONFLICT
                ),
                "RESERVE: {reserved:?}"
            );
            let victim = 0x100 + ((i as u64 + 1) % 8);
            // Preempted already (our key gone) is a conflict; anything else is GOOD.
            let _ = prout(&s, 4, 3, key, victim).await;
            s
        }));
    }
    let mut sessions = Vec::new();
    for r in runs {
        sessions.push(r.await.expect("a racer"));
    }
    // Every gateway reports the same state: the same keys and generation, one holder.
    let mut seen = Vec::new();
    for s in &sessions {
        seen.push((keys(s).await, prin(s, 1).await));
    }
    for w in seen.windows(2) {
        assert_eq!(w[0], w[1], "two sessions see different reservations");
    }
    let ((generation, keys), reservation) = &seen[0];
    assert!(*generation >= 8, "generation {generation}");
    let holder = u64::from_be_bytes(reservation[8..16].try_into().unwrap());
    if u32::from_be_bytes(reservation[4..8].try_into().unwrap()) == 16 {
        assert!(
            keys.contains(&holder),
            "the holder {holder:#x} is registered"
        );
    }
    drop(sessions);
    a.stop();
    b.stop();
    ceph.remove_image(&image);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_aptpl_reservations_end_when_every_gateway_restarts() {
    let Some(ceph) = ceph() else { return };
    let _turn = turn();
    let image = unique("aptpl");
    let name = unique("gws");
    let a = gateway(&ceph, &name, 1, &image);
    let b = gateway(&ceph, &name, 2, &image);
    let s = a.session(as_initiator("one")).await;
    while tur_sense(&s).await.is_some() {}
    assert_eq!(prout(&s, 0, 0, 0, 0xa).await, ScsiStatus::GOOD);
    assert_eq!(prout(&s, 1, 1, 0xa, 0).await, ScsiStatus::GOOD);
    drop(s);
    // A restarts while B runs: the state stays.
    a.stop();
    let a = gateway(&ceph, &name, 1, &image);
    let s = a.session(as_initiator("one")).await;
    while tur_sense(&s).await.is_some() {}
    assert_eq!(keys(&s).await.1, vec![0xa]);
    // Now with APTPL (REGISTER AND IGNORE EXISTING KEY: this session is a new I_T nexus,
    // with its own ISID), then both restart: it stays.
    assert_eq!(prout_aptpl(&s, 6, 0, 0, 0xa, true).await, ScsiStatus::GOOD);
    drop(s);
    a.stop();
    b.stop();
    let a = gateway(&ceph, &name, 1, &image);
    let s = a.session(as_initiator("one")).await;
    while tur_sense(&s).await.is_some() {}
    assert_eq!(keys(&s).await.1, vec![0xa, 0xa], "APTPL state lost");
    // Without APTPL, every gateway restarts: it is gone.
    assert_eq!(prout_aptpl(&s, 6, 0, 0, 0xa, false).await, ScsiStatus::GOOD);
    drop(s);
    a.stop();
    let a = gateway(&ceph, &name, 1, &image);
    let s = a.session(as_initiator("one")).await;
    while tur_sense(&s).await.is_some() {}
    assert_eq!(keys(&s).await, (0, vec![]), "state without APTPL survived");
    drop(s);
    a.stop();
    ceph.remove_image(&image);
}

#[test]
fn libiscsi_reservation_tests_across_gateways() {
    let Some(ceph) = ceph() else { return };
    if !common::tool("iscsi-test-cu") {
        return;
    }
    let _turn = turn();
    let image = unique("libiscsi-pr");
    let name = unique("gws");
    let a = gateway(&ceph, &name, 1, &image);
    let b = gateway(&ceph, &name, 2, &image);
    let url_a = format!("iscsi://{}/{TARGET}/0", a.addr);
    let url_b = format!("iscsi://{}/{TARGET}/0", b.addr);
    let mut report = String::new();
    let mut failures = 0;
    for family in [
        "SCSI.PrinReadKeys",
        "SCSI.PrinServiceactionRange",
        "SCSI.PrinReportCapabilities",
        "SCSI.ProutRegister",
        "SCSI.ProutReserve",
        "SCSI.ProutClear",
        "SCSI.ProutPreempt",
        // Reserve6.Logout reserves through gateway B the moment gateway A answered the
        // first initiator's logout: A answers once B knows the reservation is gone.
        "SCSI.Reserve6",
        "SCSI.MultipathIO",
    ] {
        let run = Process::new("iscsi-test-cu")
            .args(["-d", "-v", &format!("--test={family}"), &url_a, &url_b])
            .output()
            .unwrap();
        let mut output = String::from_utf8_lossy(&run.stdout).into_owned();
        output.push_str(&String::from_utf8_lossy(&run.stderr));
        let line = output
            .lines()
            .find(|l| l.trim_start().starts_with("tests"))
            .unwrap_or_else(|| panic!("no CUnit summary for {family}:\n{output}"));
        let n: Vec<u64> = line
            .split_whitespace()
            .filter_map(|w| w.parse().ok())
            .collect();
        let skipped = output.matches("[SKIPPED]").count() as u64;
        println!(
            "{family} across gateways: passed {}, failed {}, skipped {skipped}",
            n[2] - skipped,
            n[3]
        );
        assert!(n[2] > skipped, "{family}: nothing ran\n{output}");
        failures += n[3];
        report += &output;
    }
    let path = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join("iscsi-test-cu-cluster.txt");
    std::fs::write(&path, &report).unwrap();
    assert_eq!(failures, 0, "see {}", path.display());
    a.stop();
    b.stop();
    ceph.remove_image(&image);
}

/// REPORT TARGET PORT GROUPS: (group, state code, preferred) of each descriptor.
async fn port_groups(s: &Session) -> Vec<(u16, u8, bool)> {
    initiator_bench::multipath::port_groups(s)
        .await
        .expect("REPORT TARGET PORT GROUPS")
}

/// Waits up to `secs` for `s` to report `want`, clearing unit attentions on the way.
async fn await_groups(s: &Session, want: &[(u16, u8, bool)], secs: u64) -> bool {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(secs);
    while std::time::Instant::now() < deadline {
        while tur_sense(s).await.is_some_and(|k| k.0 == 6) {}
        if port_groups(s).await == want {
            return true;
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    false
}

/// Gateways 1 and 2 of a fresh cluster in this process on a fresh image, with a session of
/// initiator "one" through A and of "two" through B, their power-on unit attentions cleared.
async fn two_gateways(ceph: &Ceph, prefix: &str) -> (String, Daemon, Daemon, Session, Session) {
    let image = unique(prefix);
    let name = unique("gws");
    let a = gateway(ceph, &name, 1, &image);
    let b = gateway(ceph, &name, 2, &image);
    let one = a.session(as_initiator("one")).await;
    let two = b.session(as_initiator("two")).await;
    while tur_sense(&one).await.is_some() {}
    while tur_sense(&two).await.is_some() {}
    (image, a, b, one, two)
}

/// Asserts that `s` reports `want` within `secs`.
async fn expect_groups(s: &Session, want: &[(u16, u8, bool)], secs: u64) {
    if !await_groups(s, want, secs).await {
        panic!("port groups {:?}, not {want:?}", port_groups(s).await);
    }
}

/// Gateways 1 and 2 of a fresh cluster as processes on a fresh image, with a session through
/// each (initiators `who`), once both report A optimized and B not.
async fn two_processes(
    ceph: &Ceph,
    prefix: &str,
    who: [&str; 2],
) -> (String, Process_, Process_, Session, Session) {
    let image = unique(prefix);
    let name = unique("gws");
    let a = Process_::start(ceph, &name, 1, &image);
    let b = Process_::start(ceph, &name, 2, &image);
    let via_a = a.session(who[0]).await;
    let via_b = b.session(who[1]).await;
    let both = [(1, 0x0, true), (2, 0x1, false)];
    expect_groups(&via_a, &both, 20).await;
    expect_groups(&via_b, &both, 20).await;
    (image, a, b, via_a, via_b)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gateways_report_one_set_of_port_groups_and_fail_over_when_one_stops() {
    let Some(ceph) = ceph() else { return };
    let _turn = turn();
    let image = unique("alua");
    let name = unique("gws");
    let a = gateway(&ceph, &name, 1, &image);
    let b = gateway(&ceph, &name, 2, &image);
    let one = a.session(as_initiator("one")).await;
    let two = b.session(as_initiator("two")).await;
    // A (the lowest group) is active/optimized and preferred, B active/non-optimized: the
    // same answer from both gateways.
    let both = [(1, 0x0, true), (2, 0x1, false)];
    expect_groups(&one, &both, 10).await;
    expect_groups(&two, &both, 10).await;
    // The metrics say who is alive, and what the keeper did.
    let metrics = targetd::metrics::text(&b.registry);
    for line in [
        "targetd_cluster_gateways{gateway=\"gw2\"} 2",
        "targetd_cluster_gateways_live{gateway=\"gw2\"} 2",
        "targetd_cluster_fenced{gateway=\"gw2\"} 0",
    ] {
        assert!(metrics.lines().any(|l| l == line), "{line} in\n{metrics}");
    }
    // SendTargets on either gateway lists both gateways' portals with their groups.
    for d in [&a, &b] {
        let found = initiator_bench::discover(&d.url(TARGET, 0), &opts())
            .await
            .expect("discovery");
        let mut addresses = found[0].addresses.clone();
        addresses.sort();
        let mut want = [format!("{},1", a.addr), format!("{},2", b.addr)];
        want.sort();
        assert_eq!(addresses, want, "SendTargets through {}", d.addr);
    }
    // A stops: B takes over as active/optimized, A's group is unavailable, and B's
    // initiator hears of it.
    drop(one);
    let stopped = std::time::Instant::now();
    a.stop();
    let after = [(1, 0x3, false), (2, 0x0, true)];
    let mut heard = false;
    let deadline = stopped + std::time::Duration::from_secs(15);
    while std::time::Instant::now() < deadline {
        if tur_sense(&two).await == Some((6, 0x2a, 0x06)) {
            heard = true;
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    println!(
        "gateway B became active/optimized {:.1} s after A stopped",
        stopped.elapsed().as_secs_f64()
    );
    assert!(heard, "no ASYMMETRIC ACCESS STATE CHANGED on B");
    expect_groups(&two, &after, 5).await;
    let w = two
        .execute(Command::write(two.lun(), cdb::write(3, 1), pattern(512, 3)))
        .await
        .expect("a response");
    assert_eq!(
        w.status,
        ScsiStatus::GOOD,
        "{:?}",
        w.sense.as_deref().and_then(initiator_bench::Sense::parse)
    );
    // A planned stop is no failure: A left, and B fenced nobody.
    let metrics = targetd::metrics::text(&b.registry);
    for line in [
        "targetd_cluster_fenced_gateways_total{gateway=\"gw2\"} 0",
        "targetd_cluster_unit_access_state{target=\"iqn.2026-11.io.example:test\",lun=\"0\",port_group=\"1\",gateway=\"gw1\",state=\"unavailable\"} 1",
        "targetd_cluster_unit_access_state{target=\"iqn.2026-11.io.example:test\",lun=\"0\",port_group=\"2\",gateway=\"gw2\",state=\"active/optimized\"} 1",
    ] {
        assert!(metrics.lines().any(|l| l == line), "{line} in\n{metrics}");
    }
    let view = handle(&b.registry, AdminRequest::Cluster).unwrap();
    let gw1 = &view["members"][0];
    assert_eq!(
        (
            gw1["gateway"].as_str(),
            gw1["live"].as_bool(),
            gw1["left"].as_bool()
        ),
        (Some("gw1"), Some(false), Some(true)),
        "{view}"
    );
    assert_eq!(
        view["units"][0]["groups"][1]["state"], "active/optimized",
        "{view}"
    );
    // Forgotten, its group is no longer reported; B, alive, cannot be forgotten.
    let e = handle(
        &b.registry,
        AdminRequest::ClusterForget {
            gateway: "gw2".into(),
        },
    )
    .unwrap_err();
    assert!(e.contains("this gateway"), "{e}");
    handle(
        &b.registry,
        AdminRequest::ClusterForget {
            gateway: "gw1".into(),
        },
    )
    .unwrap();
    expect_groups(&two, &[(2, 0x0, true)], 5).await;
    // A comes back: it is optimized again, B non-optimized.
    let a = gateway(&ceph, &name, 1, &image);
    expect_groups(&two, &both, 10).await;
    let e = handle(
        &b.registry,
        AdminRequest::ClusterForget {
            gateway: "gw1".into(),
        },
    )
    .unwrap_err();
    assert!(e.contains("alive"), "{e}");
    drop(two);
    a.stop();
    b.stop();
    ceph.remove_image(&image);
}

/// The config of gateway `port_group` of cluster `name` as a process of its own: one reactor,
/// its admin socket at `socket`, `server_keys` in `[server]`, LUN 0 on `image` with
/// `lun_keys`.
fn process_config(
    ceph: &Ceph,
    name: &str,
    port_group: u16,
    image: &str,
    lun_keys: &str,
    server_keys: &str,
    socket: &std::path::Path,
) -> String {
    let keyring = ceph.keyring_key();
    format!(
        "[server]\nportals = [\"127.0.0.1:0\"]\nadmin_socket = \"{}\"\nreactors = 1\n\
         nop_interval = 0\n{server_keys}\n\n{}\n[cluster]\nname = \"{name}\"\n\
         gateway = \"gw{port_group}\"\nport_group = {port_group}\npool = \"{}\"\n\
         ceph_conf = \"{}\"\nclient = \"{}\"\n{keyring}",
        socket.display(),
        ceph.target(image, "64MiB", lun_keys),
        ceph.pool,
        ceph.conf.display(),
        ceph.client
    )
}

/// A gateway as a process of its own (its own RADOS client, which fencing blocklists).
struct Process_ {
    child: std::process::Child,
    /// `cluster.name`.
    cluster: String,
    addr: std::net::SocketAddr,
    /// Its NVMe/TCP portal, when it has one.
    nvme: Option<std::net::SocketAddr>,
    _dir: tempfile::TempDir,
}

impl Process_ {
    fn start(ceph: &Ceph, name: &str, port_group: u16, image: &str) -> Process_ {
        Process_::start_with(ceph, name, port_group, image, "")
    }

    /// A gateway whose LUN has the keys `lun_keys` too (`standby = true`).
    fn start_with(
        ceph: &Ceph,
        name: &str,
        port_group: u16,
        image: &str,
        lun_keys: &str,
    ) -> Process_ {
        Process_::start_in(ceph, name, port_group, image, lun_keys, &[])
    }

    /// The same with the environment variables `env` (which an upgrade's successor inherits).
    fn start_in(
        ceph: &Ceph,
        name: &str,
        port_group: u16,
        image: &str,
        lun_keys: &str,
        env: &[(&str, &str)],
    ) -> Process_ {
        let dir = tempfile::tempdir().unwrap();
        let socket = dir.path().join("admin.sock");
        let text = process_config(ceph, name, port_group, image, lun_keys, "", &socket);
        Process_::spawn_with(name, dir, &text, env)
    }

    /// targetd on `text` (its admin socket in `dir`) as a gateway of cluster `name`, once it
    /// listens.
    fn spawn(name: &str, dir: tempfile::TempDir, text: &str) -> Process_ {
        Process_::spawn_with(name, dir, text, &[])
    }

    /// The same with the environment variables `env` (which an upgrade's successor inherits).
    fn spawn_with(
        name: &str,
        dir: tempfile::TempDir,
        text: &str,
        env: &[(&str, &str)],
    ) -> Process_ {
        let path = dir.path().join("config.toml");
        std::fs::write(&path, text).unwrap();
        let mut child = Process::new(env!("CARGO_BIN_EXE_targetd"))
            .envs(env.iter().copied())
            .arg(&path)
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::inherit())
            .spawn()
            .expect("targetd");
        let stdout = child.stdout.take().unwrap();
        let mut lines = std::io::BufRead::lines(std::io::BufReader::new(stdout));
        let (mut addr, mut nvme) = (None, None);
        loop {
            let line = lines
                .next()
                .expect("targetd ended before it listened")
                .unwrap();
            if let Some(a) = line.strip_prefix("targetd: listening on ") {
                addr = addr.or(a.trim().parse().ok());
            }
            if let Some(a) = line.strip_prefix("targetd: NVMe/TCP on ") {
                nvme = nvme.or(a.trim().parse().ok());
            }
            if line.starts_with("targetd: engine") {
                break;
            }
        }
        // Keep draining its output so it never blocks on a full pipe.
        std::thread::spawn(move || for _ in lines {});
        Process_ {
            child,
            cluster: name.to_string(),
            addr: addr.expect("an iSCSI portal"),
            nvme,
            _dir: dir,
        }
    }

    async fn session(&self, who: &str) -> Session {
        let url =
            initiator_bench::IscsiUrl::parse(&format!("iscsi://{}/{TARGET}/0", self.addr)).unwrap();
        Session::connect(&url, as_initiator(who))
            .await
            .expect("login")
    }

    /// What asks the gateway whose admin socket is `path` for its cluster view
    /// (`targetctl cluster`).
    fn viewer(path: std::path::PathBuf) -> impl Fn() -> serde_json::Value {
        move || {
            use std::io::{BufRead, Write};
            let mut s = std::os::unix::net::UnixStream::connect(&path).expect("the admin socket");
            let mut line = serde_json::to_vec(&AdminRequest::Cluster).unwrap();
            line.push(b'\n');
            s.write_all(&line).unwrap();
            let mut answer = String::new();
            std::io::BufReader::new(&s).read_line(&mut answer).unwrap();
            let a: serde_json::Value = serde_json::from_str(&answer).expect("json");
            a["result"].clone()
        }
    }

    /// Asks the gateway to upgrade (to the binary it runs): the admin socket's answer.
    async fn upgrade(&self) -> serde_json::Value {
        let path = self._dir.path().join("admin.sock");
        tokio::task::spawn_blocking(move || {
            use std::io::{BufRead, Write};
            let mut s = std::os::unix::net::UnixStream::connect(&path).expect("the admin socket");
            let request = AdminRequest::Upgrade {
                binary: None,
                force: false,
                start_timeout_seconds: None,
                park_timeout_seconds: None,
            };
            let mut line = serde_json::to_vec(&request).unwrap();
            line.push(b'\n');
            s.write_all(&line).unwrap();
            let mut answer = String::new();
            std::io::BufReader::new(&s).read_line(&mut answer).unwrap();
            serde_json::from_str(&answer).expect("json")
        })
        .await
        .unwrap()
    }

    fn signal(&self, sig: &str) {
        let ok = Process::new("kill")
            .args([sig, &self.child.id().to_string()])
            .status()
            .unwrap()
            .success();
        assert!(ok, "kill {sig}");
    }
}

impl Drop for Process_ {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Process `pid` killed with SIGKILL.
fn kill(pid: u32) {
    let _ = Process::new("kill")
        .args(["-KILL", &pid.to_string()])
        .status();
}

/// Prints what [`until_gone`] measured.
fn print_gone(what: &str, watcher: std::thread::JoinHandle<Option<std::time::Duration>>) {
    match watcher.join().unwrap() {
        Some(d) => println!(
            "{what}: B had fenced A and counted it gone {:.2} s after the kill",
            d.as_secs_f64()
        ),
        None => println!("{what}: B did not count A gone within 60 s of the kill"),
    }
}

/// How long after the first instant `killed` sends the gateway with admin socket `socket`
/// counted gw1 gone (it fenced it first); `None` after 60 s.
fn until_gone(
    socket: std::path::PathBuf,
    killed: std::sync::mpsc::Receiver<std::time::Instant>,
) -> std::thread::JoinHandle<Option<std::time::Duration>> {
    std::thread::spawn(move || {
        let killed = killed
            .recv_timeout(std::time::Duration::from_secs(900))
            .ok()?;
        let viewer = Process_::viewer(socket);
        loop {
            let view = viewer();
            let gone = view["members"]
                .as_array()
                .into_iter()
                .flatten()
                .any(|g| g["gateway"] == "gw1" && g["live"] == false);
            if gone {
                return Some(killed.elapsed());
            }
            if killed.elapsed() > std::time::Duration::from_secs(60) {
                return None;
            }
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silent_gateway_is_fenced_before_a_change_completes_serves_no_more_then_rejoins() {
    let Some(ceph) = ceph() else { return };
    let _turn = turn();
    let (image, a, b, one, two) = two_processes(&ceph, "fence", ["one", "two"]).await;
    assert_eq!(write_status(&one, 1).await, ScsiStatus::GOOD);

    // A stops answering (alive, but silent: what a partition looks like to B).
    a.signal("-STOP");
    let asked = std::time::Instant::now();
    assert_eq!(prout(&two, 0, 0, 0, 0xb).await, ScsiStatus::GOOD);
    println!(
        "a registration through B with A silent took {:.1} s (A was fenced first)",
        asked.elapsed().as_secs_f64()
    );
    // B serves on as the optimized path.
    let after = [(1, 0x3, false), (2, 0x0, true)];
    expect_groups(&two, &after, 20).await;
    // The image's exclusive lock was A's: B's first write takes it over.
    let mut wrote = false;
    for _ in 0..12 {
        let cmd = Command::write(two.lun(), cdb::write(2, 1), pattern(512, 2));
        match two.execute(cmd).await {
            Ok(r) if r.status == ScsiStatus::GOOD => {
                wrote = true;
                break;
            }
            other => println!("a write through B: {other:?}"),
        }
    }
    println!(
        "B wrote {:.1} s after A went silent",
        asked.elapsed().as_secs_f64()
    );
    assert!(wrote, "B could not write");
    // A wakes up fenced: it completes no media access any more.
    a.signal("-CONT");
    let mut refused = None;
    for _ in 0..100 {
        let r = one
            .execute(Command::read(one.lun(), cdb::read(0, 1), 512))
            .await;
        match r {
            Ok(r) if r.status == ScsiStatus::GOOD => {}
            Ok(r) => {
                let sense = r.sense.as_deref().and_then(initiator_bench::Sense::parse);
                if sense.as_ref().is_some_and(|s| s.key == 2) {
                    refused = sense;
                    break;
                }
            }
            Err(_) => {
                refused = None;
                break;
            }
        }
        tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    }
    let refused = refused.expect("the fenced gateway kept completing reads");
    println!("the fenced gateway answers {refused}");
    assert_eq!(keys(&two).await.1, vec![0xb]);

    // A rejoins by itself on a new RADOS client: it reloads the reservations it missed and
    // serves again, the optimized path once more, with what B wrote.
    let both = [(1, 0x0, true), (2, 0x1, false)];
    expect_groups(&one, &both, 60).await;
    expect_groups(&two, &both, 20).await;
    println!(
        "A serves again {:.1} s after it went silent",
        asked.elapsed().as_secs_f64()
    );
    assert_eq!(keys(&one).await.1, vec![0xb], "A reloaded B's registration");
    let mut read = None;
    for _ in 0..20 {
        let r = one
            .execute(Command::read(one.lun(), cdb::read(2, 1), 512))
            .await
            .expect("a read through A");
        if r.status == ScsiStatus::GOOD {
            read = Some(r.data);
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    }
    assert_eq!(
        read.expect("A completes reads again").as_ref(),
        pattern(512, 2).as_ref(),
        "A reads what B wrote while A was fenced"
    );
    // A's writes reach B too (the image's lock moves back to A, then to B).
    let mut wrote = false;
    for _ in 0..20 {
        let cmd = Command::write(one.lun(), cdb::write(3, 1), pattern(512, 3));
        if let Ok(r) = one.execute(cmd).await {
            if r.status == ScsiStatus::GOOD {
                wrote = true;
                break;
            }
        }
        tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    }
    assert!(wrote, "A completes writes again");
    let r = two
        .execute(Command::read(two.lun(), cdb::read(3, 1), 512))
        .await
        .expect("a read through B");
    assert_eq!(r.data.as_ref(), pattern(512, 3).as_ref());
    drop((one, two));
    drop(a);
    drop(b);
    ceph.remove_image(&image);
}

/// The RADOS client addresses gateway `gateway` of `cluster` lists for itself.
fn addresses_of(ceph: &Ceph, cluster: &str, gateway: &str) -> Vec<String> {
    listed(ceph, cluster, gateway)[5]
        .split(',')
        .map(str::to_string)
        .collect()
}

/// The RADOS client instance gateway `gateway` of `cluster` lists for itself.
fn instance_of(ceph: &Ceph, cluster: &str, gateway: &str) -> u64 {
    listed(ceph, cluster, gateway)[4].parse().unwrap()
}

/// The words of gateway `gateway`'s line in the gateways object of `cluster`.
fn listed(ceph: &Ceph, cluster: &str, gateway: &str) -> Vec<String> {
    let object = format!("{cluster}.gateways");
    let out = ceph.tool("rados", &["-p", &ceph.pool, "get", &object, "-"]);
    assert!(out.status.success(), "rados get {object}: {out:?}");
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    let line = text
        .lines()
        .find(|l| l.split_whitespace().nth(1) == Some(gateway))
        .unwrap_or_else(|| panic!("{gateway} not in {object}: {text}"));
    line.split_whitespace().map(str::to_string).collect()
}

/// Process `pid` (an upgrade's successor, not this test's child) stopped when dropped: SIGTERM
/// (it leaves the cluster and closes its images), SIGKILL if it is still there after 20 s.
struct Successor(u32);

impl Drop for Successor {
    fn drop(&mut self) {
        let signal = |sig: &str| {
            Process::new("kill")
                .args([sig, &self.0.to_string()])
                .stderr(std::process::Stdio::null())
                .status()
                .is_ok_and(|s| s.success())
        };
        signal("-TERM");
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
        while signal("-0") && std::time::Instant::now() < deadline {
            std::thread::sleep(std::time::Duration::from_millis(50));
        }
        kill(self.0);
    }
}

/// Gateway `gw1`'s members entry in the cluster view `view`.
fn member_view(view: &serde_json::Value, gateway: &str) -> serde_json::Value {
    view["members"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|m| m["gateway"] == gateway)
        .cloned()
        .unwrap_or_else(|| panic!("no {gateway} in {view}"))
}

/// A PREEMPT through B of the registration of `one` (on A) reaches `one` as REGISTRATIONS
/// PREEMPTED and locks it out: the process serving A follows B's changes.
async fn preempted_through_b(one: &Session, two: &Session) {
    assert_eq!(prout(two, 4, 1, 0xb, 0xa).await, ScsiStatus::GOOD);
    let mut heard = Vec::new();
    while let Some(sense) = tur_sense(one).await {
        heard.push(sense);
    }
    assert!(
        heard.contains(&(6, 0x2a, 0x05)),
        "REGISTRATIONS PREEMPTED on A's session: {heard:?}"
    );
    assert_eq!(write_status(one, 3).await, ScsiStatus::RESERVATION_CONFLICT);
    assert_eq!(keys(one).await.1, vec![0xb]);
}

/// One initiator on gateway A of two registers and reserves (WRITE EXCLUSIVE), one on B
/// registers and is locked out of writes.
async fn reserved_through_a(one: &Session, two: &Session) {
    assert_eq!(prout(one, 0, 0, 0, 0xa).await, ScsiStatus::GOOD);
    assert_eq!(prout(one, 1, 1, 0xa, 0).await, ScsiStatus::GOOD);
    assert_eq!(prout(two, 0, 0, 0, 0xb).await, ScsiStatus::GOOD);
    while tur_sense(two).await.is_some() {}
    assert_eq!(write_status(two, 1).await, ScsiStatus::RESERVATION_CONFLICT);
    assert_eq!(write_status(one, 1).await, ScsiStatus::GOOD);
}

/// Gateway A of two upgraded while its initiator holds a WRITE EXCLUSIVE reservation and B's
/// is registered, A's successor started with `env`: A (the old or the new process, as the
/// upgrade went) serves on in the cluster: its session writes on its connection, B's still
/// conflicts, B counts A live and has fenced nobody, both report the same port groups, and A
/// follows B's changes. The admin socket's answer, A's RADOS instance before and after, and
/// the successor's pid when it served (killed by then).
async fn upgrade_a_under_a_reservation(
    ceph: &Ceph,
    prefix: &str,
    env: &[(&str, &str)],
) -> (serde_json::Value, u64, u64, Option<u32>) {
    let image = unique(prefix);
    let name = unique("gws");
    let a = Process_::start_in(ceph, &name, 1, &image, "", env);
    let b = Process_::start(ceph, &name, 2, &image);
    let one = a.session("one").await;
    let two = b.session("two").await;
    let both = [(1, 0x0, true), (2, 0x1, false)];
    expect_groups(&one, &both, 20).await;
    expect_groups(&two, &both, 20).await;
    reserved_through_a(&one, &two).await;
    let before = instance_of(ceph, &name, "gw1");
    let view_b = Process_::viewer(b._dir.path().join("admin.sock"));
    let fenced_before = view_b()["fenced_by_this_gateway"].as_u64();

    let answer = a.upgrade().await;
    let successor = answer["result"]["pid"]
        .as_u64()
        .map(|pid| Successor(pid as u32));
    let after = instance_of(ceph, &name, "gw1");
    assert_eq!(write_status(&one, 2).await, ScsiStatus::GOOD);
    assert_eq!(
        write_status(&two, 1).await,
        ScsiStatus::RESERVATION_CONFLICT
    );
    // Some rounds of "who is alive".
    tokio::time::sleep(std::time::Duration::from_secs(2)).await;
    let view = view_b();
    assert_eq!(member_view(&view, "gw1")["live"], true, "{view}");
    assert_eq!(
        view["fenced_by_this_gateway"].as_u64(),
        fenced_before,
        "{view}"
    );
    expect_groups(&one, &both, 5).await;
    expect_groups(&two, &both, 5).await;
    preempted_through_b(&one, &two).await;
    drop((one, two));
    let pid = successor.as_ref().map(|s| s.0);
    drop(successor);
    drop(a);
    drop(b);
    ceph.remove_image(&image);
    (answer, before, after, pid)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upgraded_gateway_keeps_its_sessions_reservations_and_place_in_the_cluster() {
    let Some(ceph) = ceph() else { return };
    let _turn = turn();
    let (answer, before, after, successor) =
        upgrade_a_under_a_reservation(&ceph, "upgrade", &[]).await;
    assert_eq!(answer["ok"], true, "{answer}");
    assert!(successor.is_some(), "{answer}");
    assert_eq!(answer["result"]["sessions"], 1, "{answer}");
    println!(
        "upgraded gateway A: initiators paused {} ms",
        answer["result"]["paused_ms"]
    );
    // A's line is the successor's: fencing A blocklists the process that serves.
    assert_ne!(after, before, "the successor lists its own client");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_successor_that_dies_after_taking_a_gateways_place_leaves_the_old_process_listed_and_serving(
) {
    let Some(ceph) = ceph() else { return };
    let _turn = turn();
    // A's successor aborts once it has taken A's place and taken the sessions in.
    let fault = [(targetd::takeover::FAULT_VARIABLE, "crash-after-adopted")];
    let (answer, before, after, _) =
        upgrade_a_under_a_reservation(&ceph, "upgrade-crash", &fault).await;
    assert_eq!(answer["ok"], false, "{answer}");
    println!("the upgrade failed as injected: {}", answer["error"]);
    // The old process listed itself again: fencing A blocklists it.
    assert_eq!(after, before, "the old process lists its own client again");
}

/// SIGTERM to `p` (a stop under its service manager), and its end.
fn stop_program(p: &mut common::program::Program) {
    let _ = Process::new("kill")
        .args(["-TERM", &p.child.id().to_string()])
        .status();
    let status = p.child.wait().unwrap();
    assert!(status.success(), "{status}: {}", p.log());
}

/// An NVMe host of gateway A holding a Write Exclusive reservation across A's upgrade: its
/// controller goes on in the new process on its connection and writes, B's host still
/// conflicts, and a preempt through B reaches it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upgraded_gateways_nvme_host_goes_on_with_its_reservation() {
    use nvme::opcode::NvmOpcode;
    use nvme::Status;
    let Some(ceph) = ceph() else { return };
    let _turn = turn();
    let image = unique("upgrade-nvme");
    let name = unique("gws");
    let a = nvme_process(&ceph, &name, 1, &image, "", 0);
    let b = nvme_process(&ceph, &name, 2, &image, "", 0);
    let h1 = nvme_host(a.nvme.expect("A's NVMe/TCP portal"), 1).await;
    let h2 = nvme_host(b.nvme.expect("B's NVMe/TCP portal"), 2).await;
    expect_ana(&h1, 0x01, 20, "A").await;
    expect_ana(&h2, 0x02, 20, "B").await;
    nvme_hold_write_exclusive((&h1, 0xa), (&h2, 0xb)).await;
    let acquire = NvmOpcode::ReservationAcquire;
    let conflicts = |e: initiator_bench::nvme::NvmeError| matches!(e, initiator_bench::nvme::NvmeError::Status { status, .. } if status == Status::RESERVATION_CONFLICT);
    assert!(conflicts(h2.write(8, pattern(4096, 1)).await.unwrap_err()));

    let answer = a.upgrade().await;
    assert_eq!(answer["ok"], true, "{answer}");
    let successor = Successor(answer["result"]["pid"].as_u64().unwrap() as u32);
    assert_eq!(answer["result"]["controllers"], 1, "{answer}");
    let data = pattern(4096, 2);
    h1.write(16, data.clone())
        .await
        .expect("the holder writes through the new process");
    assert_eq!(h1.read(16, 8).await.unwrap(), data);
    assert!(conflicts(h2.write(8, pattern(4096, 3)).await.unwrap_err()));
    expect_ana(&h1, 0x01, 5, "A after the upgrade").await;
    // Host 2 preempts host 1 through B: the new process applies it.
    assert_eq!(
        nvme_reservation(&h2, acquire, 1 | 1 << 8, 0xb, 0xa).await,
        Status::SUCCESS
    );
    assert!(conflicts(h1.write(16, pattern(4096, 4)).await.unwrap_err()));
    h2.write(16, pattern(4096, 5))
        .await
        .expect("the new holder writes");
    drop((h1, h2));
    drop(successor);
    drop(a);
    drop(b);
    ceph.remove_image(&image);
}

/// `systemctl restart` of a gateway that keeps its sessions through the service manager's
/// store: alone in its cluster, its initiator's reservation (without APTPL) stays; with a
/// second gateway, a PREEMPT made there while the first is down reaches the kept session as
/// REGISTRATIONS PREEMPTED, and its writes conflict.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gateway_restarted_through_the_store_keeps_its_sessions_and_their_reservations() {
    let Some(ceph) = ceph() else { return };
    let _turn = turn();
    let image = unique("store");
    let name = unique("gws");
    let manager = common::program::Manager::new();
    let config = |socket: &std::path::Path| {
        let keep = "restart_keeps_sessions = true";
        process_config(&ceph, &name, 1, &image, "", keep, socket)
    };
    let mut a = common::program::Program::start_config(config, Some(&manager));
    let url = initiator_bench::IscsiUrl::parse(&format!("iscsi://{}/{TARGET}/0", a.addr)).unwrap();
    let one = Session::connect(&url, as_initiator("one"))
        .await
        .expect("login");
    while tur_sense(&one).await.is_some() {}
    assert_eq!(prout(&one, 0, 0, 0, 0xa).await, ScsiStatus::GOOD);
    assert_eq!(prout(&one, 1, 1, 0xa, 0).await, ScsiStatus::GOOD);

    // Alone: no gateway watches the reservations while it restarts, and they stay.
    tokio::task::block_in_place(|| {
        stop_program(&mut a);
        a.start_again(Some(&manager));
    });
    assert!(
        a.log().contains("restart: serving the sessions"),
        "{}",
        a.log()
    );
    assert_eq!(write_status(&one, 1).await, ScsiStatus::GOOD);
    assert_eq!(keys(&one).await.1, vec![0xa]);
    let holder = prin(&one, 1).await;
    assert_eq!(&holder[8..16], &0xau64.to_be_bytes(), "the holder stays");

    // With B: B's initiator is locked out; B preempts while A is down.
    let b = Process_::start(&ceph, &name, 2, &image);
    let two = b.session("two").await;
    while tur_sense(&two).await.is_some() {}
    assert_eq!(prout(&two, 0, 0, 0, 0xb).await, ScsiStatus::GOOD);
    assert_eq!(
        write_status(&two, 1).await,
        ScsiStatus::RESERVATION_CONFLICT
    );
    tokio::task::block_in_place(|| stop_program(&mut a));
    // (B's initiator hears that A left as a unit attention first.)
    let mut status = ScsiStatus::CHECK_CONDITION;
    for _ in 0..10 {
        status = prout(&two, 4, 1, 0xb, 0xa).await;
        if status != ScsiStatus::CHECK_CONDITION {
            break;
        }
    }
    assert_eq!(status, ScsiStatus::GOOD);
    tokio::task::block_in_place(|| a.start_again(Some(&manager)));
    let mut heard = Vec::new();
    while let Some(sense) = tur_sense(&one).await {
        heard.push(sense);
    }
    assert!(
        heard.contains(&(6, 0x2a, 0x05)),
        "REGISTRATIONS PREEMPTED on the kept session: {heard:?}"
    );
    assert_eq!(
        write_status(&one, 2).await,
        ScsiStatus::RESERVATION_CONFLICT
    );
    // A is back in the cluster: both gateways live.
    let both = [(1, 0x0, true), (2, 0x1, false)];
    expect_groups(&two, &both, 20).await;
    assert_eq!(write_status(&two, 2).await, ScsiStatus::GOOD);
    drop((one, two));
    drop(b);
    tokio::task::block_in_place(|| stop_program(&mut a));
    drop(a);
    ceph.remove_image(&image);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_blocklisted_gateway_stops_serving_and_rejoins_with_what_it_missed() {
    let Some(ceph) = ceph() else { return };
    let _turn = turn();
    let (image, a, b, one, two) = two_processes(&ceph, "blocklist", ["one", "two"]).await;
    assert_eq!(write_status(&one, 1).await, ScsiStatus::GOOD);
    // The operator (or another tool) fences A: `ceph osd blocklist add` of its clients.
    let old = addresses_of(&ceph, &a.cluster, "gw1");
    for address in &old {
        let out = ceph.tool("ceph", &["osd", "blocklist", "add", address, "600"]);
        assert!(out.status.success(), "blocklist {address}: {out:?}");
    }
    let fenced = std::time::Instant::now();
    // A's watch ends: A turns its own group unavailable and completes no media access.
    let unavailable = [(1, 0x3, false), (2, 0x0, true)];
    assert!(
        await_groups(&one, &unavailable, 30).await,
        "A did not report itself unavailable"
    );
    // B sees A unavailable too (within a round: 0.5 s), and its initiator has had the unit
    // attention of that change.
    expect_groups(&two, &unavailable, 30).await;
    // While A is out, B registers and reserves (WRITE EXCLUSIVE).
    assert_eq!(prout(&two, 0, 0, 0, 0xb).await, ScsiStatus::GOOD);
    assert_eq!(prout(&two, 1, 1, 0xb, 0).await, ScsiStatus::GOOD);
    // A rejoins on a new client, serves again and enforces what it missed.
    let both = [(1, 0x0, true), (2, 0x1, false)];
    expect_groups(&one, &both, 60).await;
    println!(
        "A serves again {:.1} s after the blocklist",
        fenced.elapsed().as_secs_f64()
    );
    let new = addresses_of(&ceph, &a.cluster, "gw1");
    assert!(
        new.iter().all(|n| !old.contains(n)),
        "A lists new clients: {old:?} then {new:?}"
    );
    assert_eq!(keys(&one).await.1, vec![0xb]);
    let mut status = ScsiStatus::GOOD;
    for _ in 0..20 {
        status = write_status(&one, 2).await;
        if status == ScsiStatus::RESERVATION_CONFLICT {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    }
    assert_eq!(
        status,
        ScsiStatus::RESERVATION_CONFLICT,
        "A enforces B's reservation"
    );
    assert_eq!(read_status(&one).await, ScsiStatus::GOOD);
    drop((one, two));
    drop(a);
    drop(b);
    ceph.remove_image(&image);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_units_preferred_gateway_is_optimized_and_the_others_standby() {
    let Some(ceph) = ceph() else { return };
    let _turn = turn();
    let image = unique("policy");
    let name = unique("gws");
    let policy = "preferred_gateway = \"gw2\"\nstandby = true\n";
    let a = Daemon::start(&gateway_config_with(&ceph, &name, 1, &image, policy));
    let b = Daemon::start(&gateway_config_with(&ceph, &name, 2, &image, policy));
    let one = a.session(as_initiator("one")).await;
    let two = b.session(as_initiator("two")).await;
    // B, preferred, is optimized though A's group is lower; A is standby.
    let states = [(1, 0x2, false), (2, 0x0, true)];
    expect_groups(&one, &states, 10).await;
    expect_groups(&two, &states, 10).await;
    // A standby path refuses media access: NOT READY, TARGET PORT IN STANDBY STATE.
    let r = one
        .execute(Command::read(one.lun(), cdb::read(0, 1), 512))
        .await
        .expect("a response");
    let sense = r.sense.as_deref().and_then(initiator_bench::Sense::parse);
    assert_eq!(
        sense.map(|s| (s.key, s.asc, s.ascq)),
        Some((2, 0x04, 0x0b)),
        "{sense:?}"
    );
    // What an initiator's scan asks is answered there (SPC-4's standby list, and READ
    // CAPACITY as Linux's target answers it): the disk's size, its mode pages.
    let (blocks, block_size) = one.capacity().await.expect("READ CAPACITY through standby");
    assert_eq!((blocks, block_size), ((64 << 20) / 512, 512));
    let mut mode_sense = [0u8; 16];
    mode_sense[..6].copy_from_slice(&[0x1a, 0, 0x3f, 0, 255, 0]);
    let r = one
        .execute(Command::read(one.lun(), mode_sense, 255))
        .await
        .expect("a response");
    assert_eq!(r.status, ScsiStatus::GOOD, "MODE SENSE through standby");
    assert_eq!(write_status(&two, 1).await, ScsiStatus::GOOD);
    // A gateway with another policy for the image is refused, naming both.
    let (key, reason) = common::refused(&gateway_config(&ceph, &name, 3, &image));
    assert_eq!(key, "targets[0].luns[0].image", "{reason}");
    assert!(reason.contains("preferred_gateway gw2"), "{reason}");
    // B stops: A, the only live gateway, becomes optimized and serves.
    drop(two);
    b.stop();
    expect_groups(&one, &[(1, 0x0, true), (2, 0x3, false)], 15).await;
    assert_eq!(read_status(&one).await, ScsiStatus::GOOD);
    drop(one);
    a.stop();
    ceph.remove_image(&image);
}

#[test]
fn a_gateway_that_exports_an_image_otherwise_is_refused_naming_both() {
    let Some(ceph) = ceph() else { return };
    let _turn = turn();
    let image = unique("defs");
    let name = unique("gws");
    let a = gateway(&ceph, &name, 1, &image);
    // B exports the image as LUN 1: refused while A serves it.
    let text = gateway_config(&ceph, &name, 2, &image).replace("lun = 0", "lun = 1");
    let (key, reason) = common::refused(&text);
    assert_eq!(key, "targets[0].luns[0].image", "{reason}");
    assert!(
        reason.contains("lun 0") && reason.contains("lun 1"),
        "{reason}"
    );
    // The same port group as A's: refused, naming A.
    let (key, reason) = common::refused(
        &gateway_config(&ceph, &name, 1, &image)
            .replace("gateway = \"gw1\"", "gateway = \"other\""),
    );
    assert_eq!(key, "cluster.port_group", "{reason}");
    assert!(reason.contains("gw1"), "{reason}");
    // B exports it as an NVMe namespace: refused too (NVMe hosts and SCSI initiators could
    // not see each other's reservations), naming both.
    let other = unique("defs-lun");
    let (key, reason) = common::refused(
        &(gateway_config(&ceph, &name, 2, &other).replacen(
            "[server]\n",
            "[server]\nnvme_portals = [\"127.0.0.1:0\"]\n",
            1,
        ) + &nvme_subsystem_toml(&ceph, &image, "")),
    );
    assert_eq!(key, "subsystems[0].namespaces[0].image", "{reason}");
    assert!(
        reason.contains(&format!("target {TARGET}, lun 0"))
            && reason.contains(&format!("subsystem {NVME_NQN}, nsid 1")),
        "{reason}"
    );
    // Once no gateway serves it, a new definition replaces the old.
    a.stop();
    let b = Daemon::start(&text);
    b.stop();
    for image in [&image, &other] {
        ceph.remove_image(image);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_gateways_initiator_continues_on_the_other_and_loses_no_acknowledged_write() {
    let Some(ceph) = ceph() else { return };
    let _turn = turn();
    // One initiator, a session (path) through each gateway.
    let (image, a, b, via_a, via_b) =
        two_processes(&ceph, "failover", ["multipath", "multipath"]).await;
    // Verified writes through the optimized path, A, which is killed after the 20th.
    let mut acknowledged = Vec::new();
    let mut path = &via_a;
    let mut killed_at = None;
    let mut resumed_after = None;
    let mut lba = 0u64;
    while lba < 40 {
        let data = pattern(4096, lba as usize + 100);
        let cmd = Command::write(path.lun(), cdb::write(lba * 8, 8), data.clone());
        match path.execute(cmd).await {
            Ok(r) if r.status == ScsiStatus::GOOD => {
                acknowledged.push((lba, data));
                if let (Some(at), None) = (killed_at, resumed_after) {
                    resumed_after = Some(std::time::Instant::now() - at);
                }
                if lba == 20 && killed_at.is_none() {
                    a.signal("-KILL");
                    killed_at = Some(std::time::Instant::now());
                }
                lba += 1;
            }
            // The path failed (connection lost, timed out, or NOT READY): the multipath
            // layer's move, to the other path, retrying the same write.
            other => {
                if std::ptr::eq(path, &via_a) {
                    path = &via_b;
                } else if let Some(at) = killed_at {
                    assert!(
                        at.elapsed().as_secs() < 60,
                        "B did not take over: {other:?}"
                    );
                    tokio::time::sleep(std::time::Duration::from_millis(100)).await;
                }
            }
        }
    }
    let resumed = resumed_after.expect("writes resumed after the kill");
    println!(
        "writes resumed through gateway B {:.1} s after gateway A was killed",
        resumed.as_secs_f64()
    );
    // Every acknowledged write reads back through B.
    for (lba, data) in &acknowledged {
        let back = via_b.read(lba * 8, 8, 512).await.expect("read through B");
        assert_eq!(&back, data, "block {lba} lost");
    }
    // B is the optimized path now.
    let after = [(1, 0x3, false), (2, 0x0, true)];
    expect_groups(&via_b, &after, 20).await;
    drop(via_a);
    drop(via_b);
    drop(a);
    drop(b);
    ceph.remove_image(&image);
}

/// COMPARE AND WRITE of one block at `lba`: `expect` compared, `new` written.
fn compare_and_write(s: &Session, lba: u64, expect: &[u8], new: &[u8]) -> Command {
    let mut c = [0u8; 16];
    c[0] = 0x89;
    c[2..10].copy_from_slice(&lba.to_be_bytes());
    c[13] = 1;
    let mut data = expect.to_vec();
    data.extend_from_slice(new);
    Command::write(s.lun(), c, Bytes::from(data))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn compare_and_write_from_two_gateways_on_one_block_has_one_winner_each_round() {
    let Some(ceph) = ceph() else { return };
    let _turn = turn();
    let (image, a, b, one, two) = two_gateways(&ceph, "caw").await;
    let block = |round: u8, who: u8| vec![round.wrapping_mul(2).wrapping_add(who); 512];
    let mut current = vec![0u8; 512];
    for round in 1..=50u8 {
        // Both expect the current block and race to replace it with their own.
        let (ra, rb) = tokio::join!(
            one.execute(compare_and_write(&one, 7, &current, &block(round, 0))),
            two.execute(compare_and_write(&two, 7, &current, &block(round, 1))),
        );
        let (ra, rb) = (ra.expect("a response"), rb.expect("a response"));
        let won = [ra.status == ScsiStatus::GOOD, rb.status == ScsiStatus::GOOD];
        assert_eq!(
            won.iter().filter(|w| **w).count(),
            1,
            "round {round}: {:?} / {:?}",
            ra.status,
            rb.status
        );
        // The loser miscompared; the block is the winner's.
        let loser = if won[0] { &rb } else { &ra };
        let sense = loser
            .sense
            .as_deref()
            .and_then(initiator_bench::Sense::parse);
        assert_eq!(sense.map(|s| (s.key, s.asc)), Some((0x0e, 0x1d)));
        current = block(round, u8::from(won[1]));
        let back = two.read(7, 1, 512).await.expect("read");
        assert_eq!(&back[..], &current[..], "round {round}");
    }
    drop((one, two));
    a.stop();
    b.stop();
    ceph.remove_image(&image);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn initiator_bench_multipath_rides_through_a_killed_gateway_with_verified_writes() {
    let Some(ceph) = ceph() else { return };
    let _turn = turn();
    let (image, a, b, via_a, via_b) =
        two_processes(&ceph, "multipath", ["probe-a", "probe-b"]).await;
    drop((via_a, via_b));
    let url = |p: &Process_| {
        initiator_bench::IscsiUrl::parse(&format!("iscsi://{}/{TARGET}/0", p.addr)).unwrap()
    };
    let urls = [url(&a), url(&b)];
    let w = failover_workload();
    let run = tokio::spawn(async move {
        initiator_bench::workload::run_multipath(
            &urls,
            &as_initiator("multipath"),
            &w,
            Default::default(),
        )
        .await
    });
    tokio::time::sleep(std::time::Duration::from_secs(3)).await;
    a.signal("-KILL");
    let report = run.await.expect("the run").expect("a report");
    judge_failover("multipath run", &report);
    drop(a);
    drop(b);
    ceph.remove_image(&image);
}

/// The workload of the initiator-bench multipath runs across a killed gateway: random
/// writes and reads for 12 s, 4 in flight, every block read back at the end.
fn failover_workload() -> initiator_bench::workload::Workload {
    initiator_bench::workload::Workload {
        rw: initiator_bench::workload::Rw::Randrw,
        bs: 4096,
        qd: 4,
        time: std::time::Duration::from_secs(12),
        size: Some(8 << 20),
        verify: true,
        ..Default::default()
    }
}

/// A multipath run across a killed gateway, judged: every I/O succeeded on some path, no
/// acknowledged write was lost, it left the killed gateway; its figures printed. A read goes
/// through B at once; a write waits until B holds the image's lock (A fenced, its lock
/// broken): the longest I/O is the failover as the application sees it.
fn judge_failover(what: &str, report: &initiator_bench::workload::Report) {
    println!(
        "{what}: {} I/Os, {} failed, {} failovers, first success on B after {:.1} s, \
         longest I/O {:.1} s, {} blocks verified, {} wrong",
        report.ios,
        report.errors,
        report.failovers,
        report.longest_failover_seconds.unwrap_or_default(),
        report.latency_us.max / 1e6,
        report.verified_blocks,
        report.verify_errors
    );
    assert_eq!(report.errors, 0, "every I/O succeeded on some path");
    assert_eq!(report.verify_errors, 0, "an acknowledged write was lost");
    assert!(report.verified_blocks > 0);
    assert!(report.failovers >= 1, "it never left gateway A");
}

/// initiator-bench's NVMe/TCP multipath (`run --transport nvme-tcp --multipath`) on the two
/// gateways of a namespace, A preferred: its I/O goes to A (ANA optimized), and when A is
/// killed mid-run every I/O still succeeds on B and every block reads back as written.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn initiator_bench_nvme_multipath_rides_through_a_killed_gateway_with_verified_writes() {
    use initiator_bench::nvme::{NvmeController, NvmeOptions, NvmeUrl};
    let Some(ceph) = ceph() else { return };
    let _turn = turn();
    let image = unique("nvme-bench-mp");
    let name = unique("gws");
    let prefer_a = "preferred_gateway = \"gw1\"\n";
    let a = nvme_process(&ceph, &name, 1, &image, prefer_a, 0);
    let b = nvme_process(&ceph, &name, 2, &image, prefer_a, 0);
    let url =
        |p: &Process_| NvmeUrl::parse(&format!("nvme://{}/{NVME_NQN}/1", p.nvme.unwrap())).unwrap();
    let urls = [url(&a), url(&b)];
    for (u, want) in urls.iter().zip([0x01, 0x02]) {
        let c = NvmeController::connect(u, &NvmeOptions::default())
            .await
            .expect("a probe");
        expect_ana(&c, want, 20, "before the run").await;
    }
    let w = failover_workload();
    let run = tokio::spawn(async move {
        initiator_bench::workload::run_nvme_multipath(
            &urls,
            &NvmeOptions::default(),
            &w,
            Default::default(),
        )
        .await
    });
    tokio::time::sleep(std::time::Duration::from_secs(3)).await;
    a.signal("-KILL");
    let report = run.await.expect("the run").expect("a report");
    judge_failover("nvme multipath run", &report);
    assert!(
        report.per_session_ios.iter().sum::<u64>() > 0,
        "no I/O through the paths"
    );
    drop(a);
    drop(b);
    ceph.remove_image(&image);
}

/// Linux as a multipath host (iscsi_tcp, scsi_dh_alua, dm-multipath with the alua hardware
/// handler and queue_if_no_path), in the guest of scripts/rdma-guest.sh, logged in to both
/// gateways of a unit with `standby = true`: through the standby gateway the disk has its
/// size (a standby port processes READ CAPACITY: Linux once sized it 0 blocks there, and its
/// failover then failed every write), and 16 MiB of direct writes through the multipath
/// device go on while the optimized gateway is killed, and read back. The longest write is
/// printed: the stall as the application saw it. Needs a Ceph cluster, what the guest needs
/// and open-iscsi and dmsetup; says which is missing and skips (fails under `CI`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn linux_multipath_fails_over_to_a_standby_gateway() {
    let Some(ceph) = ceph() else { return };
    let Some(tools) = common::guest::tools(
        &["iscsid", "iscsiadm", "dmsetup"],
        "open-iscsi's iscsid and iscsiadm or dmsetup are missing (Debian packages open-iscsi, \
         dmsetup)",
    ) else {
        return;
    };
    let _turn = turn();
    let image = unique("linux-mp");
    let name = unique("gws");
    let a = Process_::start_with(&ceph, &name, 1, &image, "standby = true");
    let b = Process_::start_with(&ceph, &name, 2, &image, "standby = true");
    // A (the lowest group) is active/optimized, B standby, as both report.
    let via_b = b.session("probe").await;
    expect_groups(&via_b, &[(1, 0x0, true), (2, 0x2, false)], 20).await;
    via_b.logout().await.ok();
    drop(via_b);
    // The guest asks the host to kill A by connecting here (10.0.2.2 is the host's
    // 127.0.0.1 to it).
    let pid = a.child.id();
    let (kill_port, killed_rx) = common::guest::on_requests(vec![Box::new(move || kill(pid))]);
    // The target's share of the failover: from the kill until B has fenced A (blocklisted,
    // its image lock broken) and counts it gone, as B's cluster view says.
    let watcher = until_gone(b._dir.path().join("admin.sock"), killed_rx);
    // What the hosts' replacement_timeout is (5 s, as docs/ha.md has multipath hosts set it;
    // TARGETD_TEST_REPLACEMENT_TIMEOUT to try another).
    let replacement =
        std::env::var("TARGETD_TEST_REPLACEMENT_TIMEOUT").unwrap_or_else(|_| "5".into());
    let script = LINUX_MULTIPATH
        .replace("@REPLACEMENT@", &replacement)
        .replace("@TARGET@", TARGET)
        .replace("@PORT_A@", &a.addr.port().to_string())
        .replace("@PORT_B@", &b.addr.port().to_string())
        .replace("@KILL@", &kill_port.to_string());
    let timeout = std::env::var("RDMA_GUEST_TIMEOUT").unwrap_or_else(|_| "900".into());
    let console = tokio::task::spawn_blocking(move || {
        common::guest::run_checked(
            "linux-multipath",
            &script,
            &tools,
            &[("RDMA_GUEST_TIMEOUT", timeout)],
            &[
                "linux multipath: both paths have 131072 sectors",
                "linux multipath: the path through B is standby",
                "linux multipath: 16 MiB written across the failover and read back",
            ],
        )
    })
    .await
    .unwrap();
    let Some(console) = console else { return };
    if let Some(l) = console
        .lines()
        .find(|l| l.contains("the longest write took"))
    {
        println!("{l} (replacement_timeout {replacement} s)");
    }
    print_gone("linux multipath", watcher);
    drop(a);
    drop(b);
    ceph.remove_image(&image);
}

/// In the guest: open-iscsi logs in to gateway A, then B (so A's disk is sda); dm-multipath
/// puts them in two path groups with the alua handler; 256 direct 64 KiB writes go through
/// it, the host kills A after the 64th, and everything is read back.
const LINUX_MULTIPATH: &str = r#"
# What dm-multipath hosts set: a lost path is given up after a few seconds, not open-iscsi's 120.
start_iscsid iqn.2026-11.io.example:linux-multipath 'node.session.timeo.replacement_timeout = @REPLACEMENT@\n'
disks() { ls -d /sys/block/sd* 2>/dev/null | wc -l; }
login() {
  /bin/iscsiadm -m node -o new -T @TARGET@ -p 10.0.2.2:$1 > /dev/null || fail "linux multipath: node $1"
  /bin/iscsiadm -m node -T @TARGET@ -p 10.0.2.2:$1 --login || fail "linux multipath: login to $1 failed"
  for i in $(seq 1 200); do [ "$(disks)" -ge $2 ] && return 0; sleep 0.1; done
  fail "linux multipath: no disk after the login to $1"
}
login @PORT_A@ 1
login @PORT_B@ 2
sleep 1
a=$(cat /sys/block/sda/size); b=$(cat /sys/block/sdb/size)
echo "linux multipath: sda (A) $a sectors, $(cat /sys/block/sda/device/access_state 2>/dev/null); sdb (B) $b sectors, $(cat /sys/block/sdb/device/access_state 2>/dev/null)"
echo "linux multipath: handlers $(cat /sys/block/sda/device/dh_state) $(cat /sys/block/sdb/device/dh_state)"
[ "$a" = 131072 ] && [ "$b" = 131072 ] && echo "linux multipath: both paths have 131072 sectors"
[ "$(cat /sys/block/sdb/device/access_state)" = standby ] && echo "linux multipath: the path through B is standby"
ma=$(cat /sys/block/sda/dev); mb=$(cat /sys/block/sdb/dev)
/bin/dmsetup create mp --table "0 $a multipath 1 queue_if_no_path 1 alua 2 1 round-robin 0 1 1 $ma 1000 round-robin 0 1 1 $mb 1000" || fail "linux multipath: dmsetup create"
/bin/dmsetup mknodes
/bin/dmsetup table mp
dd if=/dev/urandom of=/tmp/data bs=65536 count=256 2>/dev/null
# A write queued with no usable path would wait for ever (queue_if_no_path), out of reach of
# signals: a watchdog turns queueing off after 60 s, so that it fails instead.
watchdog() {
  sleep 60
  echo "linux multipath: a write waited 60 s: $(/bin/dmsetup status mp); sdb $(cat /sys/block/sdb/size) sectors"
  /bin/dmsetup message mp 0 fail_if_no_path
}
longest=0
i=0
while [ $i -lt 256 ]; do
  t0=$(cut -d' ' -f1 /proc/uptime)
  watchdog & dog=$!
  dd if=/tmp/data of=/dev/mapper/mp bs=65536 skip=$i seek=$i count=1 oflag=direct 2>/dev/null || fail "linux multipath: write $i failed"
  kill $dog 2>/dev/null
  t1=$(cut -d' ' -f1 /proc/uptime)
  took=$(echo "$t0 $t1" | awk '{ printf "%.2f", $2 - $1 }')
  longest=$(echo "$longest $took" | awk '{ print ($2 > $1) ? $2 : $1 }')
  if [ $i -eq 64 ]; then
    wget -qO- http://10.0.2.2:@KILL@/ || fail "linux multipath: the host did not kill A"
    echo "linux multipath: A killed after write $i"
  fi
  i=$((i + 1))
done
echo "linux multipath: the longest write took $longest s"
/bin/dmsetup status mp
echo "linux multipath: sdb now $(cat /sys/block/sdb/device/access_state)"
watchdog & dog=$!
dd if=/dev/mapper/mp of=/tmp/back bs=65536 count=256 iflag=direct 2>/dev/null || fail "linux multipath: the read back failed"
kill $dog 2>/dev/null
cmp /tmp/data /tmp/back && echo "linux multipath: 16 MiB written across the failover and read back" || fail "linux multipath: data differ"
/bin/dmsetup remove mp
"#;

/// The relative target port identifier and the target port group an INQUIRY VPD page 83h
/// names (designator types 4 and 5).
fn port_designators(page: &[u8]) -> (Option<u16>, Option<u16>) {
    let (mut relative, mut group) = (None, None);
    let end = (4 + usize::from(u16::from_be_bytes([page[2], page[3]]))).min(page.len());
    let mut at = 4;
    while at + 4 <= end {
        let len = usize::from(page[at + 3]);
        let data = &page[(at + 4).min(end)..(at + 4 + len).min(end)];
        if data.len() >= 4 {
            let value = Some(u16::from_be_bytes([data[2], data[3]]));
            match page[at + 1] & 0x0f {
                4 => relative = value,
                5 => group = value,
                _ => {}
            }
        }
        at += 4 + len;
    }
    (relative, group)
}

/// REPORT TARGET PORT GROUPS' data: (group, access state, its ports' relative identifiers).
fn groups_and_ports(data: &[u8]) -> Vec<(u16, u8, Vec<u16>)> {
    let end =
        (4 + u32::from_be_bytes([data[0], data[1], data[2], data[3]]) as usize).min(data.len());
    let mut out = Vec::new();
    let mut at = 4;
    while at + 8 <= end {
        let ports = usize::from(data[at + 7]);
        let state = data[at] & 0x0f;
        let id = u16::from_be_bytes([data[at + 2], data[at + 3]]);
        let list = (0..ports)
            .filter_map(|i| {
                let p = at + 8 + 4 * i;
                (p + 4 <= end).then(|| u16::from_be_bytes([data[p + 2], data[p + 3]]))
            })
            .collect();
        out.push((id, state, list));
        at += 8 + 4 * ports;
    }
    out
}

/// SRP ports in a cluster (here on the software fabric, served by two gateways in this
/// process): each gateway's SRP port has a relative port identifier of its own (32768 + its
/// port group) in its own port group, so the cluster's access states hold for SRP paths as
/// for iSCSI ones: with `standby = true`, reads go through A's SRP port and B's answers NOT
/// READY (target port in standby state), and REPORT TARGET PORT GROUPS through either lists
/// both gateways' ports in their groups. (A lone target's SRP port was relative port 2 on
/// every gateway: gateway 2's iSCSI port, in gateway 2's group.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn srp_ports_of_a_cluster_have_their_own_relative_ports_and_access_states() {
    let Some(ceph) = ceph() else { return };
    let _turn = turn();
    let image = unique("srp");
    let name = unique("gws");
    let switch = rdma::switch::Switch::new();
    let fabric = |node, service: &'static str| {
        let switch = switch.clone();
        move |server: &targetd::server::Server| {
            server
                .serve_srp_fabric(&switch, rdma::fabric::NodeId(node), service)
                .expect("the service is free")
        }
    };
    let standby = "standby = true\n";
    let a = Daemon::start_with(
        &gateway_config_with(&ceph, &name, 1, &image, standby),
        fabric(0, "srp-a"),
    );
    let b = Daemon::start_with(
        &gateway_config_with(&ceph, &name, 2, &image, standby),
        fabric(1, "srp-b"),
    );
    let sw = switch.clone();
    tokio::task::spawn_blocking(move || {
        use common::srp_client::SrpClient;
        let mut via_a = SrpClient::login(
            &sw,
            rdma::fabric::NodeId(2),
            "srp-a",
            TARGET,
            *b"srp-cluster-in-A",
        );
        let mut via_b = SrpClient::login(
            &sw,
            rdma::fabric::NodeId(3),
            "srp-b",
            TARGET,
            *b"srp-cluster-in-B",
        );
        let vpd83 = [0x12, 0x01, 0x83, 0x00, 0xff, 0x00];
        let page_a = via_a.past_attentions(0, &vpd83, None, 255);
        let page_b = via_b.past_attentions(0, &vpd83, None, 255);
        assert_eq!(port_designators(&page_a.data), (Some(0x8001), Some(1)));
        assert_eq!(port_designators(&page_b.data), (Some(0x8002), Some(2)));
        // Both gateways list both SRP ports once each has read the other's line.
        let rtpg = [0xa3, 0x0a, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0];
        let want = vec![(1, 0x0, vec![1, 0x8001]), (2, 0x2, vec![2, 0x8002])];
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
        for via in [&mut via_a, &mut via_b] {
            loop {
                let r = via.past_attentions(0, &rtpg, None, 256);
                if r.status == 0 && groups_and_ports(&r.data) == want {
                    break;
                }
                assert!(
                    std::time::Instant::now() < deadline,
                    "port groups {:?}, not {want:?}",
                    groups_and_ports(&r.data)
                );
                std::thread::sleep(std::time::Duration::from_millis(100));
            }
        }
        // A's SRP port is active/optimized: a write and a read go through.
        let block = pattern(512, 7);
        let write = [0x2a, 0, 0, 0, 0, 5, 0, 0, 1, 0];
        assert_eq!(via_a.past_attentions(0, &write, Some(&block), 0).status, 0);
        let read = [0x28, 0, 0, 0, 0, 5, 0, 0, 1, 0];
        let r = via_a.past_attentions(0, &read, None, 512);
        assert_eq!((r.status, r.data), (0, block.to_vec()));
        // B's is standby: NOT READY, LOGICAL UNIT NOT ACCESSIBLE, TARGET PORT IN STANDBY.
        let r = via_b.past_attentions(0, &read, None, 512);
        assert_eq!(r.status, 2, "a read through the standby gateway's SRP port");
        assert_eq!(
            (r.sense_key(), r.sense.get(12), r.sense.get(13)),
            (Some(2), Some(&4), Some(&0x0b))
        );
    })
    .await
    .unwrap();
    drop(a);
    drop(b);
    ceph.remove_image(&image);
}

/// The first entry of `d`'s `targetctl cluster` targets once `done` holds for it, within
/// `secs`.
fn await_target_view(
    d: &Daemon,
    secs: u64,
    done: impl Fn(&serde_json::Value) -> bool,
) -> serde_json::Value {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(secs);
    loop {
        let view = handle(&d.registry, AdminRequest::Cluster).unwrap();
        let t = view["targets"][0].clone();
        if done(&t) {
            return t;
        }
        assert!(std::time::Instant::now() < deadline, "{view}");
        std::thread::sleep(std::time::Duration::from_millis(200));
    }
}

/// Whole targets compared across gateways (issue: ACLs, CHAP, target settings): B starts with
/// other access rules than A's and warns, naming the key and A, without replacing A's record
/// (a stale config brought back is not the newest); given the same rules it is quiet again;
/// an edit through B's admin socket (CHAP) makes B's the cluster's record, and A then warns,
/// naming B, with the secret never shown.
#[test]
fn gateways_compare_whole_targets_and_the_last_edited_is_recorded() {
    let Some(ceph) = ceph() else { return };
    let _turn = turn();
    let image = unique("whole");
    let name = unique("gws");
    let a = gateway(&ceph, &name, 1, &image);
    let other_rules = gateway_config(&ceph, &name, 2, &image).replacen(
        &format!("name = \"{TARGET}\"\n"),
        &format!("name = \"{TARGET}\"\ninitiators = [\"iqn.2026-11.io.example:only\"]\n"),
        1,
    );
    let b = Daemon::start(&other_rules);
    let at_b = await_target_view(&b, 10, |t| t["definition"] == "differs");
    assert_eq!(at_b["recorded_by"], "gw1", "{at_b}");
    let differences = at_b["differences"].to_string();
    assert!(
        differences.contains("initiators: here iqn.2026-11.io.example:only, recorded any"),
        "{at_b}"
    );
    let at_a = await_target_view(&a, 10, |t| t["definition"] == "same");
    assert_eq!(at_a["recorded_by"], "gw1", "{at_a}");
    let metrics = targetd::metrics::text(&b.registry);
    let line = format!("targetd_cluster_target_definition_differs{{target=\"{TARGET}\"}} 1");
    assert!(metrics.lines().any(|l| l == line), "{line} in\n{metrics}");

    // B given A's rules: the same again.
    let set = |d: &Daemon, initiators: Option<Vec<String>>, chap: Option<targetd::config::Chap>| {
        handle(
            &d.registry,
            AdminRequest::TargetSet {
                name: TARGET.into(),
                initiators,
                networks: None,
                srp_initiators: None,
                chap,
                mutual_chap: None,
                no_chap: false,
                no_mutual_chap: false,
            },
        )
        .unwrap();
    };
    set(&b, Some(vec![]), None);
    await_target_view(&b, 15, |t| t["definition"] == "same");

    // CHAP set through B: B's definition is recorded, and A warns of it.
    let secret = "a-secret-of-16ch";
    set(
        &b,
        None,
        Some(targetd::config::Chap {
            username: "user1".into(),
            secret: secret.into(),
        }),
    );
    let at_b = await_target_view(&b, 15, |t| t["recorded_by"] == "gw2");
    assert_eq!(at_b["definition"], "same", "{at_b}");
    let at_a = await_target_view(&a, 25, |t| t["definition"] == "differs");
    assert_eq!(at_a["recorded_by"], "gw2", "{at_a}");
    let differences = at_a["differences"].to_string();
    assert!(
        differences.contains("chap: here none, recorded user user1 secret-digest "),
        "{at_a}"
    );
    assert!(!differences.contains(secret), "{at_a}");
    b.stop();
    a.stop();
    ceph.remove_image(&image);
}

/// SET TARGET PORT GROUPS asking `(state, group)` for each descriptor: the response's status
/// and sense key.
async fn set_target_port_groups(s: &Session, ds: &[(u8, u16)]) -> (ScsiStatus, Option<u8>) {
    let mut list = vec![0u8; 4];
    for &(state, group) in ds {
        list.extend_from_slice(&[state, 0]);
        list.extend_from_slice(&group.to_be_bytes());
    }
    let mut c = [0u8; 16];
    c[0] = 0xa4;
    c[1] = 0x0a;
    c[6..10].copy_from_slice(&(list.len() as u32).to_be_bytes());
    loop {
        let r = s
            .execute(Command::write(s.lun(), c, Bytes::from(list.clone())))
            .await
            .expect("a response");
        let key = r
            .sense
            .as_deref()
            .and_then(initiator_bench::Sense::parse)
            .map(|x| x.key);
        // A unit attention (the states changed) first: the command again.
        if key != Some(6) {
            return (r.status, key);
        }
    }
}

/// Explicit ALUA across gateways (SET TARGET PORT GROUPS), the gateways as processes (each
/// its own RADOS client): INQUIRY says implicit and explicit; an initiator asking B for its
/// group to be active/optimized gets it on both gateways; a group that is nobody's is refused;
/// the choice ends with B (killed, then started again), when A's precedence is back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_initiators_set_target_port_groups_moves_the_optimized_gateway_everywhere() {
    let Some(ceph) = ceph() else { return };
    let _turn = turn();
    let (image, a, b, one, two) = two_processes(&ceph, "stpg", ["one", "two"]).await;
    let before = [(1, 0x0, true), (2, 0x1, false)];
    let inquiry = two
        .execute_good(Command::read(two.lun(), cdb::inquiry(96), 96))
        .await
        .expect("INQUIRY");
    assert_eq!(
        inquiry.data[5] & 0x30,
        0x30,
        "TPGS 11b: implicit and explicit"
    );

    // A group that is no gateway's: ILLEGAL REQUEST, nothing changes.
    assert_eq!(
        set_target_port_groups(&two, &[(0, 9)]).await,
        (ScsiStatus::CHECK_CONDITION, Some(5))
    );
    // B's own group, through B (as Linux's scsi_dh_alua asks).
    assert_eq!(
        set_target_port_groups(&two, &[(0, 2)]).await,
        (ScsiStatus::GOOD, None)
    );
    let chosen = [(1, 0x1, false), (2, 0x0, true)];
    expect_groups(&two, &chosen, 1).await;
    expect_groups(&one, &chosen, 3).await;
    // `targetctl cluster` through A names the choice.
    let view = Process_::viewer(a._dir.path().join("admin.sock"))();
    assert_eq!(view["units"][0]["chosen_by_initiator"], "gw2", "{view}");

    // B killed: A is optimized; B started again: its choice went with it.
    drop(two);
    drop(b);
    expect_groups(&one, &[(1, 0x0, true), (2, 0x3, false)], 10).await;
    let b = Process_::start(&ceph, &a.cluster, 2, &image);
    expect_groups(&one, &before, 20).await;
    let two = b.session("two").await;
    expect_groups(&two, &before, 20).await;
    drop((one, two, a, b));
    ceph.remove_image(&image);
}

/// Gateway `port_group` of cluster `name` exporting `lun_image` as LUN 0 and `ns_image` as
/// namespace 1 of an NVM subsystem (`extra` keys in the namespace's table), and its NVMe/TCP
/// portal.
fn nvme_gateway(
    ceph: &Ceph,
    name: &str,
    port_group: u16,
    (lun_image, ns_image): (&str, &str),
    extra: &str,
) -> (Daemon, std::net::SocketAddr) {
    let text = gateway_config(ceph, name, port_group, lun_image).replacen(
        "[server]\n",
        "[server]\nnvme_portals = [\"127.0.0.1:0\"]\n",
        1,
    ) + &nvme_subsystem_toml(ceph, ns_image, extra);
    let portal = std::sync::Mutex::new(None);
    let d = Daemon::start_with(&text, |s| {
        *portal.lock().unwrap() = Some(s.nvme_portals()[0])
    });
    let portal = portal.into_inner().unwrap().expect("an NVMe/TCP portal");
    (d, portal)
}

const NVME_NQN: &str = "nqn.2026-11.io.example:gateways";

/// An NVM subsystem with namespace 1 on `image` (`extra` keys in its table).
fn nvme_subsystem_toml(ceph: &Ceph, image: &str, extra: &str) -> String {
    format!(
        "\n[[subsystems]]\nnqn = \"{NVME_NQN}\"\n\n[[subsystems.namespaces]]\nnsid = 1\n\
         backend = \"rbd\"\npool = \"{}\"\nimage = \"{image}\"\nsize = \"64MiB\"\n\
         ceph_conf = \"{}\"\nclient = \"{}\"\n{}{extra}\n",
        ceph.pool,
        ceph.conf.display(),
        ceph.client,
        ceph.keyring_key()
    )
}

/// Waits up to `secs` for namespace 1's ANA state through `c` to be `want`.
async fn expect_ana(c: &initiator_bench::nvme::NvmeController, want: u8, secs: u64, what: &str) {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(secs);
    loop {
        let now = c.ana_state().await.ok().flatten();
        if now == Some(want) {
            return;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "{what}: ANA state {now:?}, not {want:#x}"
        );
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
}

/// Waits up to 20 s for discovery through `at` to name the subsystem at exactly `want`
/// (`address:port`, sorted or not).
async fn expect_discovered(at: std::net::SocketAddr, want: &[String]) {
    let mut want = want.to_vec();
    want.sort();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    loop {
        let found = initiator_bench::nvme::discover(&at.to_string(), &Default::default())
            .await
            .expect("discovery");
        let mut listed: Vec<String> = found
            .iter()
            .filter(|e| e.subtype == 2 && e.nqn == NVME_NQN)
            .map(|e| format!("{}:{}", e.address, e.port))
            .collect();
        listed.sort();
        if listed == want {
            return;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "discovery through {at}: {listed:?}, not {want:?}"
        );
        tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    }
}

/// NVMe/TCP across gateways: a namespace on one RBD image that both gateways of a cluster
/// export is an ANA group of its own. Its preferred gateway reports it optimized and the
/// other non-optimized, each through its own controllers; discovery through either names both
/// gateways' portals; what one writes the other reads (written through); when the preferred
/// gateway stops, the other reports the namespace optimized and discovery names it alone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nvme_namespaces_follow_the_gateways_as_ana_groups() {
    use initiator_bench::nvme::{NvmeController, NvmeOptions, NvmeUrl};
    let Some(ceph) = ceph() else { return };
    let _turn = turn();
    let (lun_image, ns_image) = (unique("nvme-lun"), unique("nvme-ns"));
    let name = unique("gws");
    let images = (lun_image.as_str(), ns_image.as_str());
    let prefer_a = "preferred_gateway = \"gw1\"\n";
    let (a, at_a) = nvme_gateway(&ceph, &name, 1, images, prefer_a);
    let (b, at_b) = nvme_gateway(&ceph, &name, 2, images, prefer_a);
    let url = |at| NvmeUrl::parse(&format!("nvme://{at}/{NVME_NQN}/1")).unwrap();
    let via_a = NvmeController::connect(&url(at_a), &NvmeOptions::default())
        .await
        .expect("through A");
    let via_b = NvmeController::connect(&url(at_b), &NvmeOptions::default())
        .await
        .expect("through B");
    expect_ana(&via_a, 0x01, 20, "A, preferred").await;
    expect_ana(&via_b, 0x02, 20, "B").await;
    // Discovery through either gateway names both gateways' portals.
    let both = [at_a, at_b].map(|p| p.to_string()).to_vec();
    expect_discovered(at_a, &both).await;
    expect_discovered(at_b, &both).await;
    // One image: written through A, read through B.
    let data = pattern(4096, 11);
    via_a.write(64, data.clone()).await.unwrap();
    assert_eq!(via_b.read(64, 8).await.unwrap(), data);
    // A stops: B's controllers report the namespace optimized.
    drop(via_a);
    let stopped = std::time::Instant::now();
    a.stop();
    expect_ana(&via_b, 0x01, 30, "B after A stopped").await;
    expect_discovered(at_b, &[at_b.to_string()]).await;
    eprintln!(
        "B reports the namespace optimized {:.1} s after A stopped",
        stopped.elapsed().as_secs_f64()
    );
    assert_eq!(via_b.read(64, 8).await.unwrap(), data);
    drop(via_b);
    b.stop();
    for image in [&lun_image, &ns_image] {
        ceph.remove_image(image);
    }
}

/// A gateway killed with SIGKILL: the other gateway reports the namespace optimized once the
/// membership counts the killed one gone (fenced first), and what was written through the
/// killed gateway reads back through the other.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_gateways_nvme_namespace_becomes_optimized_on_the_other() {
    use initiator_bench::nvme::{NvmeController, NvmeOptions, NvmeUrl};
    let Some(ceph) = ceph() else { return };
    let _turn = turn();
    let image = unique("nvme-kill");
    let name = unique("gws");
    let prefer_a = "preferred_gateway = \"gw1\"\n";
    let gateway = |port_group| nvme_process(&ceph, &name, port_group, &image, prefer_a, 0);
    let (a, b) = (gateway(1), gateway(2));
    let url = |p: &Process_| {
        NvmeUrl::parse(&format!(
            "nvme://{}/{NVME_NQN}/1",
            p.nvme.expect("an NVMe/TCP portal")
        ))
        .unwrap()
    };
    let via_a = NvmeController::connect(&url(&a), &NvmeOptions::default())
        .await
        .expect("through A");
    let via_b = NvmeController::connect(&url(&b), &NvmeOptions::default())
        .await
        .expect("through B");
    expect_ana(&via_a, 0x01, 20, "A, preferred").await;
    expect_ana(&via_b, 0x02, 20, "B").await;
    let data = pattern(4096, 12);
    via_a.write(128, data.clone()).await.unwrap();
    let killed = std::time::Instant::now();
    a.signal("-KILL");
    expect_ana(&via_b, 0x01, 60, "B after A was killed").await;
    eprintln!(
        "B reports the namespace optimized {:.1} s after A was killed",
        killed.elapsed().as_secs_f64()
    );
    assert_eq!(
        via_b.read(128, 8).await.unwrap(),
        data,
        "acknowledged through A"
    );
    drop((via_a, via_b));
    drop((a, b));
    ceph.remove_image(&image);
}

/// Gateway `port_group` of cluster `name` as a process of its own, exporting `image` as
/// namespace 1 (`extra` keys in its table) on an NVMe/TCP portal at 127.0.0.1:`nvme_port`
/// (0: any).
fn nvme_process(
    ceph: &Ceph,
    name: &str,
    port_group: u16,
    image: &str,
    extra: &str,
    nvme_port: u16,
) -> Process_ {
    let dir = tempfile::tempdir().unwrap();
    let text = format!(
        "[server]\nportals = [\"127.0.0.1:0\"]\nnvme_portals = [\"127.0.0.1:{nvme_port}\"]\n\
         admin_socket = \"{}\"\nreactors = 1\n\n[cluster]\nname = \"{name}\"\n\
         gateway = \"gw{port_group}\"\nport_group = {port_group}\npool = \"{}\"\n\
         ceph_conf = \"{}\"\nclient = \"{}\"\n{}",
        dir.path().join("admin.sock").display(),
        ceph.pool,
        ceph.conf.display(),
        ceph.client,
        ceph.keyring_key()
    ) + &nvme_subsystem_toml(ceph, image, extra);
    Process_::spawn(name, dir, &text)
}

/// NVMe host `n` (Host Identifier sixteen times `n`) connected to namespace 1 through `at`.
async fn nvme_host(at: std::net::SocketAddr, n: u8) -> initiator_bench::nvme::NvmeController {
    use initiator_bench::nvme::{NvmeController, NvmeOptions, NvmeUrl};
    let url = NvmeUrl::parse(&format!("nvme://{at}/{NVME_NQN}/1")).unwrap();
    let o = NvmeOptions {
        hostnqn: format!(
            "nqn.2014-08.org.nvmexpress:uuid:00000000-0000-4000-8000-0000000000{n:02x}"
        ),
        hostid: [n; 16],
        queue_entries: 8,
        ..NvmeOptions::default()
    };
    NvmeController::connect(&url, &o)
        .await
        .unwrap_or_else(|e| panic!("host {n} through {at}: {e}"))
}

/// Reservation command `op` on namespace 1 with CDW10 `cdw10` and the keys `first` (CRKEY)
/// and `second` (NRKEY or PRKEY): its status.
async fn nvme_reservation(
    c: &initiator_bench::nvme::NvmeController,
    op: nvme::opcode::NvmOpcode,
    cdw10: u32,
    first: u64,
    second: u64,
) -> nvme::Status {
    let mut sqe = nvme::sqe::Sqe::new(op.code(), 0);
    sqe.set_nsid(1);
    sqe.set_cdw(10, cdw10);
    let mut data = first.to_le_bytes().to_vec();
    if op != nvme::opcode::NvmOpcode::ReservationRelease {
        data.extend_from_slice(&second.to_le_bytes());
    }
    match c.io(sqe, Bytes::from(data), 0).await {
        Ok(_) => nvme::Status::SUCCESS,
        Err(initiator_bench::nvme::NvmeError::Status { status, .. }) => status,
        Err(e) => panic!("{op:?}: {e}"),
    }
}

/// `holder` registers its key and holds Write Exclusive on namespace 1; `other` registers
/// its key.
async fn nvme_hold_write_exclusive(
    (holder, key): (&initiator_bench::nvme::NvmeController, u64),
    (other, other_key): (&initiator_bench::nvme::NvmeController, u64),
) {
    use nvme::opcode::NvmOpcode::{ReservationAcquire, ReservationRegister};
    use nvme::Status;
    assert_eq!(
        nvme_reservation(holder, ReservationRegister, 0, 0, key).await,
        Status::SUCCESS
    );
    assert_eq!(
        nvme_reservation(other, ReservationRegister, 0, 0, other_key).await,
        Status::SUCCESS
    );
    assert_eq!(
        nvme_reservation(holder, ReservationAcquire, 1 << 8, key, 0).await,
        Status::SUCCESS
    );
}

/// Namespace 1's reservation status through `c` without the CNTLIDs (each gateway names its
/// own controllers): generation, type, and each registrant's holder flag, key and Host
/// Identifier, sorted.
async fn nvme_report(c: &initiator_bench::nvme::NvmeController) -> (u32, u8, Vec<(u8, u64, u8)>) {
    let mut sqe = nvme::sqe::Sqe::new(nvme::opcode::NvmOpcode::ReservationReport.code(), 0);
    sqe.set_nsid(1);
    sqe.set_cdw(10, 4096 / 4 - 1);
    sqe.set_cdw(11, 1);
    let (_, page) = c
        .io(sqe, Bytes::new(), 4096)
        .await
        .expect("Reservation Report");
    let generation = u32::from_le_bytes(page[0..4].try_into().unwrap());
    let n = usize::from(u16::from_le_bytes([page[5], page[6]]));
    let mut regs: Vec<(u8, u64, u8)> = (0..n)
        .map(|i| {
            let e = &page[64 + 64 * i..128 + 64 * i];
            (
                e[2],
                u64::from_le_bytes(e[8..16].try_into().unwrap()),
                e[16],
            )
        })
        .collect();
    regs.sort();
    (generation, page[4], regs)
}

/// NVMe reservations across gateways, kept in RADOS as a shared LUN's are: host 1 registers
/// through A, host 2 through B and acquires Write Exclusive there; at once a third host's
/// write through A conflicts, and so does host 1's; both gateways report one state. Host 1
/// then preempts host 2 with abort through A: host 2's writes through B conflict from the
/// moment the command completed, and B's controller tells host 2 (Reservation Notification
/// log page: registration preempted). Last, eight hosts on the two gateways register and
/// acquire at once: one holds the reservation, every one is registered, and both gateways
/// say so alike.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nvme_reservations_are_one_state_across_gateways() {
    use nvme::opcode::{AdminOpcode, NvmOpcode};
    use nvme::Status;
    let Some(ceph) = ceph() else { return };
    let _turn = turn();
    let (lun_image, ns_image) = (unique("nvme-pr-lun"), unique("nvme-pr"));
    let name = unique("gws");
    let images = (lun_image.as_str(), ns_image.as_str());
    let (a, at_a) = nvme_gateway(&ceph, &name, 1, images, "");
    let (b, at_b) = nvme_gateway(&ceph, &name, 2, images, "");
    let (h1, h2, h3) = (
        nvme_host(at_a, 1).await,
        nvme_host(at_b, 2).await,
        nvme_host(at_a, 3).await,
    );
    // Both paths usable (A optimized, B non-optimized) before anything is asked.
    expect_ana(&h1, 0x01, 20, "A").await;
    expect_ana(&h2, 0x02, 20, "B").await;
    let (register, acquire, release) = (
        NvmOpcode::ReservationRegister,
        NvmOpcode::ReservationAcquire,
        NvmOpcode::ReservationRelease,
    );
    assert_eq!(
        nvme_reservation(&h1, register, 0, 0, 0xa).await,
        Status::SUCCESS
    );
    assert_eq!(
        nvme_reservation(&h2, register, 0, 0, 0xb).await,
        Status::SUCCESS
    );
    // Write Exclusive (RTYPE 1) through B.
    assert_eq!(
        nvme_reservation(&h2, acquire, 1 << 8, 0xb, 0).await,
        Status::SUCCESS
    );
    let data = pattern(4096, 21);
    for (who, host) in [("host 3", &h3), ("host 1", &h1)] {
        let e = host.write(256, data.clone()).await.unwrap_err();
        assert!(
            matches!(e, initiator_bench::nvme::NvmeError::Status { status, .. } if status == Status::RESERVATION_CONFLICT),
            "{who} through A: {e}"
        );
    }
    h2.write(256, data.clone())
        .await
        .expect("the holder writes through B");
    assert_eq!(h3.read(256, 8).await.unwrap(), data, "reads pass");
    let (through_a, through_b) = (nvme_report(&h1).await, nvme_report(&h2).await);
    assert_eq!(through_a, through_b, "the gateways disagree");
    assert_eq!(through_a.1, 1, "Write Exclusive");
    assert_eq!(through_a.2, vec![(0, 0xa, 1), (1, 0xb, 2)]);
    // Acquiring what another holds conflicts, through either gateway.
    assert_eq!(
        nvme_reservation(&h1, acquire, 1 << 8, 0xa, 0).await,
        Status::RESERVATION_CONFLICT
    );

    // Host 1 preempts host 2 and aborts its commands, through A.
    assert_eq!(
        nvme_reservation(&h1, acquire, 2 | 1 << 8, 0xa, 0xb).await,
        Status::SUCCESS
    );
    let e = h2.write(256, pattern(4096, 22)).await.unwrap_err();
    assert!(
        matches!(e, initiator_bench::nvme::NvmeError::Status { status, .. } if status == Status::RESERVATION_CONFLICT),
        "host 2 through B after the preempt: {e}"
    );
    assert_eq!(
        h3.read(256, 8).await.unwrap(),
        data,
        "host 2's write never landed"
    );
    let mut log = nvme::sqe::Sqe::new(AdminOpcode::GetLogPage.code(), 0);
    log.set_cdw(10, 0x80 | 15 << 16);
    let (_, page) = h2
        .admin(log, Bytes::new(), 64)
        .await
        .expect("the notification log");
    assert_eq!(
        (page[8], page[12]),
        (1, 1),
        "registration preempted, namespace 1"
    );
    let (through_a, through_b) = (nvme_report(&h1).await, nvme_report(&h2).await);
    assert_eq!(
        through_a, through_b,
        "the gateways disagree after the preempt"
    );
    assert_eq!(through_a.2, vec![(1, 0xa, 1)]);

    // Clear, then eight hosts on the two gateways register and acquire at once.
    assert_eq!(
        nvme_reservation(&h1, release, 1, 0xa, 0).await,
        Status::SUCCESS
    );
    let mut hosts = Vec::new();
    for n in 10..18u8 {
        let at = if n % 2 == 0 { at_a } else { at_b };
        hosts.push(std::sync::Arc::new(nvme_host(at, n).await));
    }
    let racing: Vec<_> = hosts
        .iter()
        .zip(10..18u8)
        .map(|(h, n)| {
            let h = h.clone();
            tokio::spawn(async move {
                let key = u64::from(n);
                let registered = nvme_reservation(&h, register, 0, 0, key).await;
                (
                    registered,
                    nvme_reservation(&h, acquire, 1 << 8, key, 0).await,
                )
            })
        })
        .collect();
    let mut outcomes = Vec::new();
    for r in racing {
        outcomes.push(r.await.expect("a racing host"));
    }
    assert!(
        outcomes.iter().all(|(r, _)| *r == Status::SUCCESS),
        "{outcomes:?}"
    );
    let won = outcomes
        .iter()
        .filter(|(_, a)| *a == Status::SUCCESS)
        .count();
    assert_eq!(won, 1, "one acquire wins: {outcomes:?}");
    assert!(outcomes
        .iter()
        .all(|(_, a)| *a == Status::SUCCESS || *a == Status::RESERVATION_CONFLICT));
    let (through_a, through_b) = (nvme_report(&hosts[0]).await, nvme_report(&hosts[1]).await);
    assert_eq!(through_a, through_b, "the gateways disagree after the race");
    assert_eq!(through_a.2.len(), 8);
    assert_eq!(
        through_a.2.iter().filter(|r| r.0 == 1).count(),
        1,
        "one holder"
    );
    drop((h1, h2, h3, hosts));
    a.stop();
    b.stop();
    for image in [&lun_image, &ns_image] {
        ceph.remove_image(image);
    }
}

/// Linux's native NVMe multipath (nvme_core with multipath, nvme_tcp) in the guest of
/// scripts/rdma-guest.sh, one host connected to both gateways of a namespace on one RBD image
/// (A preferred): one multipath head with two paths, A optimized and B non-optimized as the
/// host's ANA states say; 16 MiB of direct writes through the head go on while A is killed
/// with SIGKILL, and read back; B becomes optimized; A started again (same portal) is
/// reconnected by the host and optimized again, the data still there; then fio's verified
/// random writes run while A is killed a second time, with no error. The longest write is
/// printed: the stall as the application saw it. Needs a Ceph cluster, what the guest needs
/// and nvme-cli and fio; says which is missing and skips (fails under `CI`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn linux_nvme_multipath_fails_over_between_gateways() {
    use initiator_bench::nvme::{NvmeController, NvmeOptions, NvmeUrl};
    let Some(ceph) = ceph() else { return };
    let Some(tools) = common::guest::tools(
        &["nvme", "fio"],
        "nvme-cli or fio is missing (Debian packages nvme-cli, fio)",
    ) else {
        return;
    };
    let _turn = turn();
    let image = unique("nvme-mp");
    let name = unique("gws");
    let prefer_a = "preferred_gateway = \"gw1\"\n";
    let a = nvme_process(&ceph, &name, 1, &image, prefer_a, 0);
    let b = nvme_process(&ceph, &name, 2, &image, prefer_a, 0);
    let (port_a, port_b) = (a.nvme.unwrap().port(), b.nvme.unwrap().port());
    // Settled before the guest comes: A optimized, B non-optimized.
    for (p, want) in [(&a, 0x01), (&b, 0x02)] {
        let url = NvmeUrl::parse(&format!("nvme://{}/{NVME_NQN}/1", p.nvme.unwrap())).unwrap();
        let c = NvmeController::connect(&url, &NvmeOptions::default())
            .await
            .expect("a probe");
        expect_ana(&c, want, 20, "before the guest").await;
    }
    // The guest asks the host to kill A, to start it again on its portal, and to kill it
    // again, by connecting here (10.0.2.2 is the host's 127.0.0.1 to it).
    let a_now = std::sync::Arc::new(std::sync::Mutex::new(Some(a)));
    let restart = {
        let (slot, ceph, name, image) = (a_now.clone(), ceph.clone(), name.clone(), image.clone());
        move || {
            let again = nvme_process(&ceph, &name, 1, &image, prefer_a, port_a);
            *slot.lock().unwrap() = Some(again);
        }
    };
    let kill_a = |slot: std::sync::Arc<std::sync::Mutex<Option<Process_>>>| {
        move || {
            if let Some(p) = slot.lock().unwrap().as_ref() {
                kill(p.child.id());
            }
        }
    };
    let (control, killed) = common::guest::on_requests(vec![
        Box::new(kill_a(a_now.clone())),
        Box::new(restart),
        Box::new(kill_a(a_now.clone())),
    ]);
    let watcher = until_gone(b._dir.path().join("admin.sock"), killed);
    let script = LINUX_NVME_MULTIPATH
        .replace("@NQN@", NVME_NQN)
        .replace("@PORT_A@", &port_a.to_string())
        .replace("@PORT_B@", &port_b.to_string())
        .replace("@CONTROL@", &control.to_string());
    let timeout = std::env::var("RDMA_GUEST_TIMEOUT").unwrap_or_else(|_| "900".into());
    let console = tokio::task::spawn_blocking(move || {
        common::guest::run_checked(
            "linux-nvme-multipath",
            &script,
            &tools,
            &[("RDMA_GUEST_TIMEOUT", timeout)],
            &[
                "nvme multipath: one head, two paths, A optimized and B non-optimized",
                "nvme multipath: 16 MiB written across the failover and read back",
                "nvme multipath: B optimized after A was killed",
                "nvme multipath: A started again, reconnected and optimized, the data there",
                "nvme multipath: fio verified random writes across a second kill",
            ],
        )
    })
    .await
    .unwrap();
    let Some(console) = console else { return };
    for l in console.lines().filter(|l| {
        [
            "the longest write took",
            "optimized after",
            "reconnected and optimized",
            "fio verified",
        ]
        .iter()
        .any(|w| l.contains(w))
    }) {
        println!("{l}");
    }
    print_gone("nvme multipath", watcher);
    drop(a_now.lock().unwrap().take());
    drop(b);
    ceph.remove_image(&image);
}

/// In the guest: `nvme connect` to gateway A, then B, with one host NQN and Host Identifier
/// (one multipath head, /dev/nvme0n1, its paths nvme0c0n1 through A and nvme0c1n1 through
/// B); 256 direct 64 KiB writes through the head, the host kills A after the 64th; all read
/// back; B optimized; A started again and reconnected (1 s reconnect delay); fio's verified
/// writes while A is killed again.
const LINUX_NVME_MULTIPATH: &str = r#"
HOSTID=4c696e75-7800-4000-8000-6d756c746970
HOSTNQN=nqn.2014-08.org.nvmexpress:uuid:$HOSTID
connect() {
  nvme connect -t tcp -a 10.0.2.2 -s $1 -n @NQN@ --hostnqn=$HOSTNQN --hostid=$HOSTID \
    --reconnect-delay=1 --ctrl-loss-tmo=120 > /dev/null || fail "nvme multipath: connect to $1 failed"
}
# state C: the ANA state of namespace 1 through controller nvmeC, as the host has it.
state() {
  for f in /sys/block/nvme0c$1n1/ana_state /sys/class/nvme/nvme$1/nvme0c$1n1/ana_state; do
    [ -e "$f" ] && { cat "$f"; return; }
  done
}
# live C: whether controller nvmeC is connected (the ANA state of a path reconnecting is the
# last one it had).
live() { [ "$(cat /sys/class/nvme/nvme$1/state 2>/dev/null)" = live ]; }
# wait_state C STATE SECONDS: waits for the path through nvmeC to be live in STATE; whether
# it came.
wait_state() {
  for i in $(seq 1 $(($3 * 10))); do live $1 && [ "$(state $1)" = "$2" ] && return 0; sleep 0.1; done
  return 1
}
uptime_now() { cut -d' ' -f1 /proc/uptime; }
since() { echo "$1 $(uptime_now)" | awk '{ printf "%.1f", $2 - $1 }'; }
connect @PORT_A@
connect @PORT_B@
for i in $(seq 1 200); do [ -e /dev/nvme0n1 ] && [ -n "$(state 0)" ] && [ -n "$(state 1)" ] && break; sleep 0.1; done
wait_state 0 optimized 10; wait_state 1 non-optimized 10
nvme list-subsys /dev/nvme0n1
echo "nvme multipath: A $(state 0), B $(state 1)"
[ "$(state 0)" = optimized ] && [ "$(state 1)" = non-optimized ] && [ -e /dev/nvme0n1 ] \
  && echo "nvme multipath: one head, two paths, A optimized and B non-optimized"
dd if=/dev/urandom of=/tmp/data bs=65536 count=256 2>/dev/null
longest=0
i=0
while [ $i -lt 256 ]; do
  t0=$(cut -d' ' -f1 /proc/uptime)
  dd if=/tmp/data of=/dev/nvme0n1 bs=65536 skip=$i seek=$i count=1 oflag=direct 2>/dev/null || fail "nvme multipath: write $i failed"
  t1=$(cut -d' ' -f1 /proc/uptime)
  took=$(echo "$t0 $t1" | awk '{ printf "%.2f", $2 - $1 }')
  longest=$(echo "$longest $took" | awk '{ print ($2 > $1) ? $2 : $1 }')
  if [ $i -eq 64 ]; then
    wget -qO- http://10.0.2.2:@CONTROL@/ > /dev/null || fail "nvme multipath: the host did not kill A"
    killed=$(uptime_now)
    echo "nvme multipath: A killed after write $i"
    # When the host sees B optimized, while the writes go on.
    ( wait_state 1 optimized 30 && echo "$(since $killed)" > /tmp/b-optimized ) &
    poller=$!
  fi
  i=$((i + 1))
done
echo "nvme multipath: the longest write took $longest s"
dd if=/dev/nvme0n1 of=/tmp/back bs=65536 count=256 iflag=direct 2>/dev/null || fail "nvme multipath: the read back failed"
cmp /tmp/data /tmp/back && echo "nvme multipath: 16 MiB written across the failover and read back" || fail "nvme multipath: data differ"
wait $poller
[ -s /tmp/b-optimized ] || fail "nvme multipath: B is $(state 1) 30 s after A was killed"
echo "nvme multipath: B optimized after A was killed ($(cat /tmp/b-optimized) s after the kill, as the host saw it)"
nvme list-subsys /dev/nvme0n1
wget -qO- http://10.0.2.2:@CONTROL@/ > /dev/null || fail "nvme multipath: the host did not start A again"
started=$(uptime_now)
wait_state 0 optimized 60 || fail "nvme multipath: A is $(cat /sys/class/nvme/nvme0/state) $(state 0) 60 s after it started again"
wait_state 1 non-optimized 30 || fail "nvme multipath: B is $(state 1) with A back"
echo "nvme multipath: A reconnected and optimized $(since $started) s after it started again"
nvme list-subsys /dev/nvme0n1
dd if=/dev/nvme0n1 of=/tmp/back bs=65536 count=256 iflag=direct 2>/dev/null || fail "nvme multipath: the read through A failed"
cmp /tmp/data /tmp/back && echo "nvme multipath: A started again, reconnected and optimized, the data there"
fio --name=mp --filename=/dev/nvme0n1 --rw=randwrite --bs=4k --iodepth=8 --ioengine=libaio \
  --direct=1 --size=32m --verify=crc32c --do_verify=1 --verify_fatal=1 --thread \
  --output=/tmp/fio.txt > /dev/null 2>&1 &
fio=$!
sleep 1
wget -qO- http://10.0.2.2:@CONTROL@/ > /dev/null || fail "nvme multipath: the host did not kill A again"
echo "nvme multipath: A killed again while fio ran"
wait $fio
status=$?
grep -q "err= 0" /tmp/fio.txt && [ "$status" = 0 ] || { cat /tmp/fio.txt; fail "nvme multipath: fio failed"; }
echo "nvme multipath: fio verified random writes across a second kill ($(grep -o "IOPS=[0-9.k]*" /tmp/fio.txt | head -1))"
nvme disconnect-all > /dev/null
"#;

/// One NVMe/TCP queue of a host driven by hand (crates/nvme's host machine on a blocking
/// socket): what holds a write's data back after the controller asked for it with an R2T.
struct RawNvmeQueue {
    socket: std::net::TcpStream,
    host: nvme::tcp::HostQueue,
    next_cid: u16,
}

impl RawNvmeQueue {
    /// A queue to `at`, initialized (ICReq, ICResp).
    fn open(at: std::net::SocketAddr) -> RawNvmeQueue {
        let socket = std::net::TcpStream::connect(at).expect("the portal");
        socket
            .set_read_timeout(Some(std::time::Duration::from_secs(30)))
            .unwrap();
        let mut q = RawNvmeQueue {
            socket,
            host: nvme::tcp::HostQueue::new(nvme::tcp::HostSettings::default()),
            next_cid: 1,
        };
        q.flush();
        match q.event() {
            nvme::tcp::HostEvent::Initialized(_) => q,
            other => panic!("not an ICResp: {other:?}"),
        }
    }

    fn flush(&mut self) {
        use std::io::Write;
        while let Some(t) = self.host.poll_transmit() {
            for s in t.slices() {
                self.socket.write_all(s).unwrap();
            }
        }
    }

    /// The next event, reading what it takes.
    fn event(&mut self) -> nvme::tcp::HostEvent {
        use std::io::Read;
        loop {
            if let Some(e) = self.host.poll_event() {
                return e;
            }
            let mut b = [0u8; 65536];
            let n = self.socket.read(&mut b).expect("the controller answers");
            assert!(n > 0, "the controller closed the connection");
            self.host.receive(&b[..n]);
        }
    }

    /// Sends `sqe` (its CID set here) with in-capsule `data`: its CID.
    fn send(&mut self, mut sqe: nvme::sqe::Sqe, data: Bytes) -> u16 {
        let cid = self.next_cid;
        self.next_cid += 1;
        sqe.set_cid(cid);
        self.host.send_command(&sqe, data).unwrap();
        self.flush();
        cid
    }

    /// Runs `sqe` to its completion.
    fn run(&mut self, sqe: nvme::sqe::Sqe, data: Bytes) -> nvme::Cqe {
        let cid = self.send(sqe, data);
        match self.event() {
            nvme::tcp::HostEvent::Response(c) if c.cid == cid => c,
            other => panic!("not the response to {cid}: {other:?}"),
        }
    }
}

/// A controller of host `n` (as `nvme_host` names it) through `at` with one I/O queue, set up
/// by hand: its admin queue (kept: its controller lives while it does) and its I/O queue.
fn raw_nvme_controller(at: std::net::SocketAddr, n: u8) -> (RawNvmeQueue, RawNvmeQueue) {
    use nvme::fabrics::CNTLID_DYNAMIC;
    use nvme::opcode::AdminOpcode;
    let hostnqn =
        format!("nqn.2014-08.org.nvmexpress:uuid:00000000-0000-4000-8000-0000000000{n:02x}");
    let connect = |q: &mut RawNvmeQueue, qid: u16, cntlid: u16| {
        let sqe = nvme::testing::connect_sqe(0, qid, 31, if qid == 0 { 30_000 } else { 0 }, 0);
        let data = nvme::testing::connect_data([n; 16], cntlid, NVME_NQN, &hostnqn);
        let c = q.run(sqe, Bytes::from(data));
        assert!(c.status.is_success(), "Connect {qid}: {c:?}");
        c.dw0 as u16
    };
    let mut admin = RawNvmeQueue::open(at);
    let cntlid = connect(&mut admin, 0, CNTLID_DYNAMIC);
    assert!(admin
        .run(nvme::testing::enable_sqe(0), Bytes::new())
        .status
        .is_success());
    let mut queues = nvme::sqe::Sqe::new(AdminOpcode::SetFeatures.code(), 0);
    queues.set_cdw(10, 0x07);
    assert!(admin.run(queues, Bytes::new()).status.is_success());
    let mut io = RawNvmeQueue::open(at);
    connect(&mut io, 1, cntlid);
    (admin, io)
}

/// A write held on gateway A (its R2T unanswered) while another host preempts its writer with
/// abort through gateway B: the preempt completes, the held write then ends with Command
/// Aborted due to Preempt and Abort when its data comes, and none of it ever reaches the image.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_nvme_write_held_on_one_gateway_never_lands_after_a_preempt_and_abort_on_the_other() {
    use nvme::opcode::NvmOpcode;
    use nvme::Status;
    let Some(ceph) = ceph() else { return };
    let _turn = turn();
    let (lun_image, ns_image) = (unique("nvme-held-lun"), unique("nvme-held"));
    let name = unique("gws");
    let images = (lun_image.as_str(), ns_image.as_str());
    let (a, at_a) = nvme_gateway(&ceph, &name, 1, images, "");
    let (b, at_b) = nvme_gateway(&ceph, &name, 2, images, "");
    // Host 2 registers and holds Write Exclusive through B; host 4 registers through B.
    let (h2, h4) = (nvme_host(at_b, 2).await, nvme_host(at_b, 4).await);
    nvme_hold_write_exclusive((&h2, 0xb), (&h4, 0xd)).await;
    let acquire = NvmOpcode::ReservationAcquire;
    let before = pattern(65536, 31);
    h2.write(1024, before.clone())
        .await
        .expect("the holder writes");
    // Host 2's own controller on A: a 64 KiB write (beyond the capsule: an R2T asks for its
    // data), held with its data unsent.
    let (_admin, mut io) = tokio::task::spawn_blocking(move || raw_nvme_controller(at_a, 2))
        .await
        .unwrap();
    let mut write = nvme::sqe::Sqe::new(NvmOpcode::Write.code(), 0);
    write.set_nsid(1);
    write.set_qword(10, 1024);
    write.set_cdw(12, 127);
    write.set_sgl(nvme::sqe::Sgl::transport(65536));
    let (mut io, cid, r2t) = tokio::task::spawn_blocking(move || {
        let cid = io.send(write, Bytes::new());
        match io.event() {
            nvme::tcp::HostEvent::R2T(r) if r.cccid == cid => (io, cid, r),
            other => panic!("not an R2T: {other:?}"),
        }
    })
    .await
    .unwrap();
    // Host 4 preempts host 2 with abort (RACQA 2, Write Exclusive) through B, the write held.
    let started = std::time::Instant::now();
    assert_eq!(
        nvme_reservation(&h4, acquire, 2 | 1 << 8, 0xd, 0xb).await,
        Status::SUCCESS
    );
    println!(
        "the preempt and abort through B completed in {:.0} ms with host 2's write held on A",
        started.elapsed().as_secs_f64() * 1000.0
    );
    // Now the held data goes: the command ends aborted, and nothing of it lands.
    let held = pattern(65536, 32);
    let cqe = tokio::task::spawn_blocking(move || {
        io.host.send_data(&r2t, held).unwrap();
        io.flush();
        match io.event() {
            nvme::tcp::HostEvent::Response(c) if c.cid == cid => (io, c),
            other => panic!("not the write's response: {other:?}"),
        }
    })
    .await
    .unwrap();
    let (mut io, cqe) = cqe;
    assert_eq!(cqe.status, Status::ABORTED_PREEMPT, "{cqe:?}");
    for wait in [0, 1000] {
        tokio::time::sleep(std::time::Duration::from_millis(wait)).await;
        assert_eq!(
            h4.read(1024, 128).await.unwrap(),
            before,
            "the held write landed ({wait} ms after its end)"
        );
    }
    // Host 2, preempted, conflicts on A from now on.
    let mut again = nvme::sqe::Sqe::new(NvmOpcode::Write.code(), 0);
    again.set_nsid(1);
    again.set_qword(10, 1024);
    again.set_cdw(12, 7);
    again.set_sgl(nvme::sqe::Sgl::in_capsule(0, 4096));
    let status = tokio::task::spawn_blocking(move || io.run(again, pattern(4096, 33)).status)
        .await
        .unwrap();
    assert_eq!(status, Status::RESERVATION_CONFLICT);
    drop((h2, h4));
    a.stop();
    b.stop();
    ceph.remove_image(&ns_image);
    ceph.remove_image(&lun_image);
}
