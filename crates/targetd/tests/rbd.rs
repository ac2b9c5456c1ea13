//! targetd as a Ceph gateway: LUNs on RBD images of a real cluster (feature `rbd`).
//!
//! - libiscsi's ALL family on an RBD LUN: none failed, as many passed as on a file LUN.
//! - Data lives in Ceph: what one targetd writes another reads (both on the image at once),
//!   it survives the daemons, and QEMU's own rbd driver (librbd directly) and its iSCSI driver
//!   (through targetd) read the same bytes.
//! - A resize made with the `rbd` CLI reaches a logged-in initiator as CAPACITY DATA HAS
//!   CHANGED, with the new capacity, and a connected NVMe/TCP host as a Namespace Attribute
//!   Changed notice, with the new size.
//! - An OSD that stops answering (SIGSTOP) fails writes with a retryable NOT READY within
//!   `ceph_timeout`, the connection stays, I/O resumes when it answers again, nothing
//!   acknowledged is lost and every buffer comes back.
//! - Bad cluster settings and an absent cluster are refused at start, naming the key, in
//!   bounded time.
//! - SRP (the software fabric) reaches an RBD LUN as iSCSI does.
//!
//! The cluster is the one `CEPH_CONF`, `CEPH_KEYRING`, `CEPH_CLIENT` and `CEPH_POOL` name
//! (`scripts/ceph-dev-cluster.sh start DIR` writes them to DIR/env; `.ci/run` starts one).
//! Without them these tests print why and pass; under `CI` they fail.
#![cfg(feature = "rbd")]
// The tests take turns with a std mutex held for each test's whole life, across its runtime's
// awaits: a turn is between tests, not between tasks.
#![allow(clippy::await_holding_lock)]

mod common;

use std::process::Command as Process;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::ceph::{ceph, turn, unique, Ceph, CephExt};
use common::{config, opts, pattern, Daemon, TARGET};
use initiator_bench::scsi::{cdb, Command};
use initiator_bench::Session;
use iscsi_pdu::ScsiStatus;

async fn sense_of(s: &Session, cmd: Command) -> (ScsiStatus, Option<(u8, u8, u8)>) {
    let r = s.execute(cmd).await.expect("a response");
    let sense = r
        .sense
        .as_ref()
        .and_then(|b| initiator_bench::Sense::parse(b));
    (r.status, sense.map(|s| (s.key, s.asc, s.ascq)))
}

#[test]
fn libiscsi_all_on_an_rbd_lun() {
    let Some(ceph) = ceph() else { return };
    if !common::tool("iscsi-test-cu") {
        return;
    }
    let _turn = turn();
    let image = unique("libiscsi");
    let d = Daemon::start(&config("", &ceph.target(&image, "1GiB", "")));
    let url = format!("iscsi://{}/{TARGET}/0", d.addr);
    let run = Process::new("iscsi-test-cu")
        .args(["-d", "-v", "--test=ALL", &url, &url])
        .output()
        .unwrap();
    let mut output = String::from_utf8_lossy(&run.stdout).into_owned();
    output.push_str(&String::from_utf8_lossy(&run.stderr));
    let report = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join("iscsi-test-cu-rbd.txt");
    std::fs::write(&report, &output).unwrap();
    // CUnit's own summary: "tests  N  N  passed  failed  inactive".
    let line = output
        .lines()
        .find(|l| l.trim_start().starts_with("tests"))
        .unwrap_or_else(|| panic!("no CUnit summary (see {})", report.display()));
    let n: Vec<u64> = line
        .split_whitespace()
        .filter_map(|w| w.parse().ok())
        .collect();
    let skipped = output.matches("[SKIPPED]").count() as u64;
    let (passed, failed) = (n[2] - skipped, n[3]);
    println!(
        "libiscsi ALL on RBD: passed {passed}, failed {failed}, skipped {skipped} ({})",
        report.display()
    );
    assert_eq!(failed, 0, "see {}", report.display());
    assert!(
        passed >= 200,
        "only {passed} passed (see {})",
        report.display()
    );
    d.stop();
    ceph.remove_image(&image);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn data_lives_in_ceph_and_two_gateways_share_it() {
    let Some(ceph) = ceph() else { return };
    let _turn = turn();
    let image = unique("shared");
    let table = ceph.target(&image, "16MiB", "");
    let a = Daemon::start(&config("", &table));
    let b = Daemon::start(&config("", &table));
    let sa = a.session(opts()).await;
    let sb = b.session(opts()).await;
    assert_eq!(sa.capacity().await.unwrap(), ((16 << 20) / 512, 512));

    // Through A, then read through B; through B, then read through A.
    let one = pattern(1 << 20, 1);
    sa.write_split(0, one.clone(), 512, 256).await.unwrap();
    sa.execute_good(Command::new(sa.lun(), cdb::synchronize_cache()))
        .await
        .unwrap();
    assert_eq!(sb.read(0, 2048, 512).await.unwrap(), one);
    let two = pattern(512 << 10, 2);
    sb.write(4096, two.clone(), 512).await.unwrap();
    sb.execute_good(Command::new(sb.lun(), cdb::synchronize_cache()))
        .await
        .unwrap();
    assert_eq!(sa.read(4096, 1024, 512).await.unwrap(), two);
    drop((sa, sb));
    a.stop();
    b.stop();

    // A new daemon finds it all in the image.
    let c = Daemon::start(&config("", &table));
    let sc = c.session(opts()).await;
    assert_eq!(sc.read(0, 2048, 512).await.unwrap(), one);
    assert_eq!(sc.read(4096, 1024, 512).await.unwrap(), two);

    // QEMU: librbd directly and the iSCSI driver through targetd read the same bytes; what
    // QEMU writes through librbd targetd reads.
    if common::tool("qemu-img") {
        let dir = tempfile::tempdir().unwrap();
        let via_rbd = dir.path().join("rbd.raw");
        let via_iscsi = dir.path().join("iscsi.raw");
        let url = format!("iscsi://{}/{TARGET}/0", c.addr);
        for (src, out) in [(ceph.qemu_rbd(&image), &via_rbd), (url, &via_iscsi)] {
            let o = Process::new("qemu-img")
                .args(["convert", "-f", "raw", "-O", "raw", &src])
                .arg(out)
                .output()
                .unwrap();
            assert!(
                o.status.success(),
                "qemu-img convert {src}: {} (QEMU's rbd and iSCSI drivers are in the Debian \
                 package qemu-block-extra)",
                String::from_utf8_lossy(&o.stderr)
            );
        }
        let rbd_bytes = std::fs::read(&via_rbd).unwrap();
        assert_eq!(rbd_bytes.len(), 16 << 20);
        assert_eq!(&rbd_bytes[..1 << 20], &one[..]);
        assert_eq!(&rbd_bytes[4096 * 512..4096 * 512 + (512 << 10)], &two[..]);
        assert!(
            rbd_bytes == std::fs::read(&via_iscsi).unwrap(),
            "QEMU read other bytes through targetd than through librbd"
        );
        let three = pattern(1 << 20, 3);
        let src = dir.path().join("three.raw");
        let mut whole = rbd_bytes.clone();
        whole[8 << 20..9 << 20].copy_from_slice(&three);
        std::fs::write(&src, &whole).unwrap();
        let o = Process::new("qemu-img")
            .args(["convert", "-n", "-f", "raw", "-O", "raw"])
            .arg(&src)
            .arg(ceph.qemu_rbd(&image))
            .output()
            .unwrap();
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        assert_eq!(sc.read((8 << 20) / 512, 2048, 512).await.unwrap(), three);
    }
    drop(sc);
    c.stop();
    ceph.remove_image(&image);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_resize_made_with_the_rbd_cli_reaches_the_initiator() {
    let Some(ceph) = ceph() else { return };
    let _turn = turn();
    let image = unique("resize");
    let d = Daemon::start(&config("", &ceph.target(&image, "16MiB", "")));
    let s = d.session(opts()).await;
    assert_eq!(s.capacity().await.unwrap().0, (16 << 20) / 512);
    let o = ceph.rbd(&["resize", "--size", "48M", &format!("{}/{image}", ceph.pool)]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    // The watch fires on a librbd thread; the unit attention follows within moments.
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let (status, sense) = sense_of(&s, Command::new(s.lun(), cdb::test_unit_ready())).await;
        if status == ScsiStatus::CHECK_CONDITION {
            assert_eq!(sense, Some((6, 0x2a, 0x09)), "CAPACITY DATA HAS CHANGED");
            break;
        }
        assert!(
            Instant::now() < deadline,
            "no unit attention after the resize"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(s.capacity().await.unwrap().0, (48 << 20) / 512);
    // The new blocks are there to use.
    let tail = pattern(4096, 9);
    s.write((48 << 20) / 512 - 8, tail.clone(), 512)
        .await
        .unwrap();
    assert_eq!(s.read((48 << 20) / 512 - 8, 8, 512).await.unwrap(), tail);
    drop(s);
    d.stop();
    ceph.remove_image(&image);
}

#[test]
fn srp_reaches_an_rbd_lun_too() {
    use initiator_bench::srp::{run_channels, LinkModel, RdmaOptions};
    use initiator_bench::workload::{Rw, Workload};
    let Some(ceph) = ceph() else { return };
    let _turn = turn();
    let image = unique("srp");
    let (switch, d) = common::srp_daemon_with(&ceph.target(&image, "16MiB", ""));
    let o = RdmaOptions {
        registration: srp::initiator::Registration::Pool,
        regions: 1,
        link: LinkModel::Free,
        immediate_data: true,
    };
    // Random writes and reads, then every block written read back and checked.
    let w = Workload {
        rw: Rw::Randrw,
        bs: 32 << 10,
        qd: 16,
        ios: Some(1024),
        size: Some(16 << 20),
        verify: true,
        ..Workload::default()
    };
    let (mut verbs, ch) = common::srp_channel(&switch, 0, &w, &o);
    let mut channels = [ch];
    let r = run_channels(&mut verbs, &mut channels, 0, &w, &o).unwrap();
    assert_eq!((r.errors, r.verify_errors), (0, 0));
    assert!(r.ios >= 1024, "{} I/Os", r.ios);
    d.stop();
    ceph.remove_image(&image);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rbd_luns_are_added_live_and_refusals_name_the_key() {
    use targetd::admin::{handle, AdminRequest};
    let Some(ceph) = ceph() else { return };
    let _turn = turn();
    let first = unique("live0");
    let d = Daemon::start(&config("", &ceph.target(&first, "16MiB", "")));
    let lun = |text: &str| -> targetd::config::Lun {
        let table = ceph.target("x", "8MiB", text);
        let luns = table
            .split("[[targets.luns]]\n")
            .nth(1)
            .unwrap()
            .to_string();
        toml::from_str(&luns).unwrap()
    };
    let add = |mut l: targetd::config::Lun, image: &str| {
        l.lun = 1;
        l.image = Some(image.into());
        handle(
            &d.registry,
            AdminRequest::LunAdd {
                target: TARGET.into(),
                lun: l,
            },
        )
    };
    // A missing pool and a missing image without size: refused, naming the key.
    let mut bad = lun("");
    bad.pool = Some("no-such-pool".into());
    let e = add(bad, "y").unwrap_err();
    assert!(e.starts_with("pool: ") && e.contains("no-such-pool"), "{e}");
    let mut unsized_ = lun("");
    unsized_.size = None;
    let e = add(unsized_, &unique("nosize")).unwrap_err();
    assert!(
        e.starts_with("size: ") && e.contains("does not exist"),
        "{e}"
    );
    // The same image as LUN 0: refused.
    let e = add(lun(""), &first).unwrap_err();
    assert!(e.contains("backs another LUN"), "{e}");
    // A new image, created at its size and served at once; luns shows it.
    let second = unique("live1");
    add(lun(""), &second).unwrap();
    let url = initiator_bench::IscsiUrl::parse(&format!("iscsi://{}/{TARGET}/1", d.addr)).unwrap();
    let s = Session::connect(&url, opts()).await.unwrap();
    assert_eq!(s.capacity().await.unwrap().0, (8 << 20) / 512);
    // Block Limits: the object (4 MiB, 8192 blocks) as the granularities, one sector of
    // COMPARE AND WRITE (librbd's, atomic at the OSD).
    let mut inquiry = [0u8; 16];
    inquiry[..5].copy_from_slice(&[0x12, 0x01, 0xb0, 0x00, 0xff]);
    let page = s
        .execute_good(Command::read(s.lun(), inquiry, 255))
        .await
        .unwrap()
        .data;
    assert_eq!(page[1], 0xb0);
    assert_eq!(page[5], 1, "MAXIMUM COMPARE AND WRITE LENGTH");
    assert_eq!(
        u16::from_be_bytes([page[6], page[7]]),
        8192,
        "OPTIMAL TRANSFER LENGTH GRANULARITY"
    );
    assert_eq!(
        u32::from_be_bytes(page[28..32].try_into().unwrap()),
        8192,
        "OPTIMAL UNMAP GRANULARITY"
    );
    let data = pattern(64 << 10, 4);
    s.write(0, data.clone(), 512).await.unwrap();
    assert_eq!(s.read(0, 128, 512).await.unwrap(), data);
    let luns = handle(&d.registry, AdminRequest::Luns { target: None }).unwrap();
    let row = luns
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["lun"] == 1)
        .unwrap()
        .clone();
    assert_eq!(row["rbd"]["image"], second.as_str());
    assert_eq!(row["rbd"]["pool"], ceph.pool.as_str());
    assert!(row["rbd"]["completed"].as_u64().unwrap() >= 2, "{row}");
    // lun resize resizes the image.
    handle(
        &d.registry,
        AdminRequest::LunResize {
            target: TARGET.into(),
            lun: 1,
            size: "12MiB".into(),
            force: false,
        },
    )
    .unwrap();
    let info = ceph.rbd(&[
        "info",
        "--format",
        "json",
        &format!("{}/{second}", ceph.pool),
    ]);
    let info: serde_json::Value = serde_json::from_slice(&info.stdout).unwrap();
    assert_eq!(info["size"], 12 << 20);
    drop(s);
    d.stop();
    for image in [first, second] {
        ceph.remove_image(&image);
    }
}

/// Sends SIGCONT to a stopped process when dropped, so a failed test leaves no frozen OSD.
struct Stopped(u32);

impl Stopped {
    fn stop(pid: u32) -> Stopped {
        assert!(Process::new("kill")
            .args(["-STOP", &pid.to_string()])
            .status()
            .unwrap()
            .success());
        Stopped(pid)
    }
}

impl Drop for Stopped {
    fn drop(&mut self) {
        let _ = Process::new("kill")
            .args(["-CONT", &self.0.to_string()])
            .status();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_osd_that_stops_answering_fails_commands_retryably_and_io_resumes() {
    let Some(ceph) = ceph() else { return };
    let _turn = turn();
    let Some(pid) = ceph.osd_pid(0) else {
        assert!(
            std::env::var_os("CI").is_none(),
            "no pid file for osd.0 beside {} (a cluster from scripts/ceph-dev-cluster.sh)",
            ceph.conf.display()
        );
        eprintln!("skipping: the OSD's pid is unknown (not a scripts/ceph-dev-cluster.sh cluster)");
        return;
    };
    let image = unique("trouble");
    let d = Daemon::start(&config(
        "",
        &ceph.target(&image, "16MiB", "ceph_timeout = 3\nwrite_cache = false\n"),
    ));
    let s = Arc::new(d.session(opts()).await);
    // Every block written and acknowledged.
    for i in 0..16u64 {
        s.write(i * 128, pattern(64 << 10, i as usize), 512)
            .await
            .unwrap();
    }

    let stopped = Stopped::stop(pid);
    let started = Instant::now();
    let mut pending = Vec::new();
    for i in 0..4u64 {
        let cmd = Command::write(
            s.lun(),
            cdb::write(i * 128, 128),
            pattern(64 << 10, 100 + i as usize),
        );
        pending.push(s.start(cmd).await.unwrap());
    }
    for p in pending {
        let r = p.wait().await.expect("an answer, not a hang");
        assert_eq!(r.status, ScsiStatus::CHECK_CONDITION);
        let sense = initiator_bench::Sense::parse(r.sense.as_ref().unwrap()).unwrap();
        assert_eq!(
            (sense.key, sense.asc, sense.ascq),
            (2, 0x04, 0x01),
            "NOT READY, LOGICAL UNIT IS IN PROCESS OF BECOMING READY"
        );
    }
    let waited = started.elapsed();
    assert!(
        waited >= Duration::from_secs(2) && waited < Duration::from_secs(20),
        "failed after {waited:?} with ceph_timeout = 3"
    );
    let unavailable: u64 = {
        let t = &d.registry.targets()[0];
        let lun = t.lun(0).unwrap();
        let image = targetd::rbd::image_of(&*lun.storage).expect("an RBD unit");
        image.stats().unavailable.load(Ordering::Relaxed)
    };
    assert!(unavailable >= 4, "{unavailable} counted");

    // The OSD answers again: the same session goes on; the failed writes are written again.
    drop(stopped);
    for i in 0..4u64 {
        s.write(i * 128, pattern(64 << 10, 200 + i as usize), 512)
            .await
            .unwrap();
    }
    for i in 0..16u64 {
        let seed = if i < 4 { 200 + i as usize } else { i as usize };
        assert_eq!(
            s.read(i * 128, 128, 512).await.unwrap(),
            pattern(64 << 10, seed),
            "block run {i}"
        );
    }
    drop(s);
    // Every buffer came back to its arena.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    for g in d.registry.counters.arenas.lock().unwrap().iter() {
        assert_eq!(
            g.free.load(Ordering::Relaxed),
            g.bytes.load(Ordering::Relaxed),
            "buffers still held"
        );
    }
    d.stop();
    ceph.remove_image(&image);
}

/// Server::start on `targets`; the error's key and reason.
fn refused(targets: &str) -> (String, String) {
    common::refused(&config("", targets))
}

#[test]
fn cluster_trouble_at_start_is_refused_naming_the_key() {
    let Some(ceph) = ceph() else { return };
    let _turn = turn();
    // No image and no size to create it.
    let t = ceph
        .target(&unique("absent"), "1MiB", "")
        .replace("size = \"1MiB\"\n", "");
    let (key, reason) = refused(&t);
    assert_eq!(key, "targets[0].luns[0].size", "{reason}");
    assert!(reason.contains("does not exist"), "{reason}");
    // No such pool.
    let t = ceph.target(&unique("nopool"), "1MiB", "").replace(
        &format!("pool = \"{}\"", ceph.pool),
        "pool = \"no-such-pool\"",
    );
    let (key, reason) = refused(&t);
    assert_eq!(key, "targets[0].luns[0].pool", "{reason}");
    // A key the monitors do not know.
    let dir = tempfile::tempdir().unwrap();
    let keyring = dir.path().join("wrong.keyring");
    std::fs::write(
        &keyring,
        format!(
            "[client.{}]\n\tkey = AQBSdFtnAAAAABAAa0Vh2UHs2SUkX0YbUG7ukw==\n",
            ceph.client
        ),
    )
    .unwrap();
    let mut wrong = Ceph {
        keyring: Some(keyring.clone()),
        conf: ceph.conf.clone(),
        client: ceph.client.clone(),
        pool: ceph.pool.clone(),
    };
    let (key, reason) = refused(&wrong.target(&unique("key"), "1MiB", "ceph_timeout = 5\n"));
    assert_eq!(key, "targets[0].luns[0].client", "{reason}");
    // No monitor where the ceph.conf says: refused within about the timeout, not forever.
    let conf = dir.path().join("nowhere.conf");
    std::fs::write(&conf, "[global]\nmon host = v2:127.0.0.1:1\n").unwrap();
    wrong.conf = conf;
    let start = Instant::now();
    let (key, reason) = refused(&wrong.target(&unique("nowhere"), "1MiB", "ceph_timeout = 2\n"));
    assert_eq!(key, "targets[0].luns[0].ceph_conf", "{reason}");
    assert!(
        start.elapsed() < Duration::from_secs(30),
        "{:?}",
        start.elapsed()
    );
}

/// A namespace on an RBD image follows a resize made with the `rbd` CLI as a LUN does: the
/// controllers connected read the namespace in the Changed Namespace List, Identify
/// Namespace gives the new size, and the new blocks are there to use.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_resize_made_with_the_rbd_cli_reaches_the_nvme_host() {
    use initiator_bench::nvme::{NvmeController, NvmeOptions, NvmeUrl};
    let Some(ceph) = ceph() else { return };
    let _turn = turn();
    let image = unique("nvme-resize");
    const NQN: &str = "nqn.2026-11.io.example:rbd";
    let text = format!(
        "[server]\nportals = [\"127.0.0.1:0\"]\nnvme_portals = [\"127.0.0.1:0\"]\n\
         admin_socket = \"@SOCKET@\"\nreactors = 1\n\n\
         [[subsystems]]\nnqn = \"{NQN}\"\n\n\
         [[subsystems.namespaces]]\nnsid = 1\nbackend = \"rbd\"\npool = \"{}\"\n\
         image = \"{image}\"\nsize = \"16MiB\"\nceph_conf = \"{}\"\nclient = \"{}\"\n{}",
        ceph.pool,
        ceph.conf.display(),
        ceph.client,
        ceph.keyring_key()
    );
    let portal = std::sync::Mutex::new(None);
    let d = Daemon::start_with(&text, |s| {
        *portal.lock().unwrap() = Some(s.nvme_portals()[0])
    });
    let portal = portal.into_inner().unwrap().expect("an NVMe/TCP portal");
    let url = NvmeUrl::parse(&format!("nvme://{portal}/{NQN}/1")).unwrap();
    let c = NvmeController::connect(&url, &NvmeOptions::default())
        .await
        .expect("connect");
    assert_eq!(c.namespace.blocks, (16 << 20) / 512);
    let o = ceph.rbd(&["resize", "--size", "48M", &format!("{}/{image}", ceph.pool)]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    // The watch fires on a librbd thread; the notice follows within moments.
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let mut log = nvme::sqe::Sqe::new(nvme::opcode::AdminOpcode::GetLogPage.code(), 0);
        log.set_cdw(10, 0x04 | 1023 << 16);
        let (_, list) = c.admin(log, bytes::Bytes::new(), 4096).await.unwrap();
        if list[..4] == [1, 0, 0, 0] {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "no Changed Namespace List after the resize"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let mut id = nvme::sqe::Sqe::new(nvme::opcode::AdminOpcode::Identify.code(), 0);
    id.set_nsid(1);
    let (_, ns) = c.admin(id, bytes::Bytes::new(), 4096).await.unwrap();
    assert_eq!(
        u64::from_le_bytes(ns[..8].try_into().unwrap()),
        (48 << 20) / 512
    );
    let tail = pattern(4096, 5);
    c.write((48 << 20) / 512 - 8, tail.clone()).await.unwrap();
    assert_eq!(c.read((48 << 20) / 512 - 8, 8).await.unwrap(), tail);
    drop(c);
    d.stop();
    ceph.remove_image(&image);
}
