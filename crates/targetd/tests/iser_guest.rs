//! targetd's iSER portal on real verbs: a Linux guest under QEMU (scripts/rdma-guest.sh:
//! Debian's kernel, soft-RoCE on its virtio interface) runs targetd with `iser_portals` on
//! the rxe device beside a TCP portal on the same address, then Linux's own iSER initiator
//! (open-iscsi's iscsid and iscsiadm with the kernel's ib_iser: discovery over TCP, login
//! over iSER, verified writes and reads through the disk it makes, logout), with libiscsi's
//! tools over their own iSER transport (`iser://` URLs; Debian's libiscsi links libibverbs
//! and librdmacm) before it (`iscsi-inq`) and after it (`iscsi-inq`, `iscsi-readcapacity16`
//! and a test of `iscsi-test-cu`): a libiscsi client once could not connect after Linux's
//! initiator had been used (not seen since; both orders are checked). (Debian's `iscsi-ls` takes only
//! `iscsi://` URLs; tests/iser.rs logs in a discovery session over iSER.) Then this test binary
//! again, as initiator-bench's iSER initiator (`run --transport iser`): verified random reads
//! and writes of 4 KiB (immediate data), 64 KiB and 1 MiB, under each way of registering.
//!
//! libiscsi's conformance suite runs over iSER only when `TARGETD_ISER_TESTS` names the tests
//! (`ALL`, a family or a suite), a process per suite, and then must have no failed test and no
//! suite that ended early. It is not run by default: Debian 12's libiscsi 1.19 crashes (a
//! segmentation fault in libiscsi.so, or "Conn disconnected event" at the set-up login) when
//! one process opens a second iSER context while its first lives, which iscsi-test-cu does
//! for every suite; libiscsi 1.20.0 built from source runs it with failures and crashes of its
//! own iSER side (docs/rdma.md lists them). The suite's URL is given once: twice, its
//! multipath probe crashes the same way.
//!
//! Needs what scripts/rdma-guest.sh needs (qemu-system-x86_64, Debian's archive for the
//! kernel, iproute2's `rdma`, the rxe provider), libiscsi-bin and open-iscsi; without them it
//! says which is missing and skips, and fails under `CI`.
#![cfg(feature = "rdma")]

mod common;

use std::path::PathBuf;
use std::time::Instant;

use common::{guest, TARGET};

/// Set in the guest: the test binary runs initiator-bench's iSER initiator there.
const GUEST: &str = "TARGETD_ISER_GUEST";

/// Which of libiscsi's tests run in the guest, if any: what `TARGETD_ISER_TESTS` names.
fn families() -> Option<String> {
    std::env::var("TARGETD_ISER_TESTS").ok()
}

#[test]
fn iser_over_soft_roce_with_libiscsi_in_a_linux_guest() {
    if std::env::var_os(GUEST).is_some() {
        return; // The guest runs only its side.
    }
    let me = std::env::current_exe().expect("this test's path");
    let Some(mut exes) = guest::tools(
        &["iscsi-inq", "iscsi-readcapacity16", "iscsi-test-cu"],
        "libiscsi's tools are missing (Debian package libiscsi-bin)",
    ) else {
        return;
    };
    let Some(open_iscsi) = guest::tools(
        &["iscsid", "iscsiadm"],
        "open-iscsi's iscsid and iscsiadm are missing (Debian package open-iscsi)",
    ) else {
        return;
    };
    exes.extend(open_iscsi);
    exes.insert(0, env!("CARGO_BIN_EXE_targetd").to_string());
    exes.push(me.display().to_string());
    let text = GUEST_SCRIPT
        .replace("@ME@", &me.file_name().unwrap().to_string_lossy())
        .replace("@TARGET@", TARGET)
        .replace("@TESTS@", families().as_deref().unwrap_or(""))
        .replace(
            "@LOG@",
            &std::env::var("TARGETD_ISER_LOG").unwrap_or_else(|_| "info".into()),
        );
    let started = Instant::now();
    let timeout = std::env::var("RDMA_GUEST_TIMEOUT").unwrap_or_else(|_| "2400".into());
    let Some(run) = guest::run(
        "iser-guest.sh",
        &text,
        &exes,
        &[("RDMA_GUEST_TIMEOUT", timeout)],
    ) else {
        return;
    };
    let (console, errors) = (&run.console, &run.errors);
    let report = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("iser-guest.txt");
    std::fs::write(&report, console.as_bytes()).expect("the report");
    assert!(
        run.status.success(),
        "the guest failed ({:?}): {errors}\nsee {}",
        run.status.code(),
        report.display()
    );
    for line in [
        "linux iser: logged in",
        "linux iser: its address known",
        "linux iser: 8 MiB written in 4 KiB writes and read back",
        "linux iser: 8 MiB written in 1 MiB writes and read back",
        "iser: iscsi-inq answered before Linux's initiator",
        "linux iser: logged out",
        "iser: iscsi-inq answered",
        "iser: iscsi-readcapacity16 answered",
        "iser: iscsi-test-cu SCSI.Inquiry.Standard passed after Linux's initiator",
        "initiator-bench iser: 4096-byte I/Os verified",
        "initiator-bench iser: 65536-byte I/Os verified",
        "initiator-bench iser: 1048576-byte I/Os verified",
    ] {
        assert!(
            console.contains(line),
            "{line:?} missing: see {}",
            report.display()
        );
    }
    println!(
        "Linux's iSER initiator and libiscsi's tools served over soft-RoCE in {:.0} s",
        started.elapsed().as_secs_f64()
    );
    let Some(tests) = families() else { return };
    assert!(
        console.contains("iser: conformance done"),
        "the suite did not finish: see {}",
        report.display()
    );
    let (passed, failed, skipped) = score(console);
    // A suite whose process died (a signal: status 128 and up) ended early, whatever the
    // verdicts before: CUnit prints its summary only when every test has run.
    let crashed: Vec<&str> = console
        .lines()
        .filter_map(|l| l.strip_prefix("iser: suite "))
        .filter_map(|l| l.split_once(" ended with status "))
        .filter(|(_, status)| status.trim().parse::<u32>().map_or(true, |s| s >= 128))
        .map(|(suite, _)| suite)
        .collect();
    println!(
        "libiscsi over iSER ({tests}): passed {passed}, failed {failed}, skipped {skipped}, \
         suites that crashed {crashed:?}"
    );
    assert!(passed > 0, "nothing passed: see {}", report.display());
    assert_eq!(failed, 0, "see {}", report.display());
    assert!(
        crashed.is_empty(),
        "suites ended early (the initiator died): {crashed:?}; see {}",
        report.display()
    );
}

/// Passed, failed and skipped tests of `iscsi-test-cu -v` output (libiscsi prints a skipped
/// test as passed, with a `[SKIPPED]` message before the verdict).
fn score(output: &str) -> (usize, usize, usize) {
    let (mut passed, mut failed, mut skipped) = (0, 0, 0);
    let mut in_test = false;
    let mut seen_skip = false;
    for line in output.lines() {
        let rest = match line.strip_prefix("  Test: ") {
            Some(rest) => {
                in_test = true;
                seen_skip = false;
                rest
            }
            None => line,
        };
        if !in_test {
            continue;
        }
        seen_skip |= rest.contains("[SKIPPED]");
        let verdict = rest
            .split(|c: char| !c.is_ascii_alphanumeric() && c != '[' && c != ']')
            .find(|w| *w == "passed" || *w == "FAILED");
        match verdict {
            Some("FAILED") => failed += 1,
            Some(_) if seen_skip => skipped += 1,
            Some(_) => passed += 1,
            None => continue,
        }
        in_test = false;
    }
    (passed, failed, skipped)
}

/// In the guest: targetd with a TCP portal and an iSER portal on rxe0's address, then
/// libiscsi's tools over iSER. The suite gets the URL once: given twice (for its multipath
/// tests) Debian's iscsi-test-cu crashes in its multipath probe over iSER, whatever the
/// target.
const GUEST_SCRIPT: &str = r#"
cat > /tmp/targetd.toml <<CONFIG
[server]
portals = ["$RDMA_ADDR:3260"]
iser_portals = ["$RDMA_ADDR:3260"]
admin_socket = "/tmp/targetd.sock"
reactors = 1
metrics_listen = "127.0.0.1:9100"
nop_interval = 0
log = "@LOG@"

[[targets]]
name = "@TARGET@"

[[targets.luns]]
lun = 0
backend = "memory"
size = "128MiB"
CONFIG
start_targetd /tmp/targetd.toml
url=iser://$RDMA_ADDR:3260/@TARGET@/0
# libiscsi's iSER client before Linux's iSER initiator, and again after it (below): every
# order works.
/bin/iscsi-inq $url > /tmp/inq 2>&1 || { cat /tmp/inq /tmp/targetd.log; exit 1; }
grep -q "Peripheral" /tmp/inq && echo "iser: iscsi-inq answered before Linux's initiator"
# Linux's iSER initiator: discovery over TCP, the node bound to the iser interface.
start_iscsid iqn.2026-11.io.example:linux-iser 'node.session.timeo.replacement_timeout = 20\n'
/bin/iscsiadm -m discovery -t st -p $RDMA_ADDR:3260 -I iser || fail "linux iser: discovery failed"
/bin/iscsiadm -m node -T @TARGET@ -p $RDMA_ADDR:3260 -I iser --login || fail "linux iser: login failed"
find_disk "linux iser"
grep -q "initiator=iqn.2026-11.io.example:linux-iser.* peer=$RDMA_ADDR:" /tmp/targetd.log && echo "linux iser: its address known"
check_disk "linux iser"
sync
/bin/iscsiadm -m node -T @TARGET@ -p $RDMA_ADDR:3260 -I iser --logout && echo "linux iser: logged out"
/bin/iscsi-inq $url > /tmp/inq 2>&1 || { cat /tmp/inq /tmp/targetd.log; exit 1; }
cat /tmp/inq
grep -q "Peripheral" /tmp/inq && echo "iser: iscsi-inq answered"
/bin/iscsi-readcapacity16 $url > /tmp/cap 2>&1 || { cat /tmp/cap /tmp/targetd.log; exit 1; }
cat /tmp/cap
grep -q "Total size:134217728" /tmp/cap && echo "iser: iscsi-readcapacity16 answered"
# A test of libiscsi's suite (two iSER connections of one process, one after the other).
/bin/iscsi-test-cu -d --test=SCSI.Inquiry.Standard $url > /tmp/cu 2>&1 || { cat /tmp/cu; tail -n 40 /tmp/targetd.log; exit 1; }
grep -q "Tests completed with return value: 0" /tmp/cu && echo "iser: iscsi-test-cu SCSI.Inquiry.Standard passed after Linux's initiator"
# initiator-bench's iSER initiator: this test binary's guest side.
TARGETD_ISER_GUEST=1 /bin/@ME@ --exact initiator_bench_over_iser_in_the_guest --nocapture --test-threads 1 || fail "initiator-bench iser: the run failed"
if [ -n "@TESTS@" ]; then
  # A process per suite, so that a crash of the initiator ends one suite, not the run.
  if [ "@TESTS@" = ALL ]; then
    suites=$(/bin/iscsi-test-cu --list | grep -E '^ALL\.[A-Za-z0-9]+$')
  else
    suites="@TESTS@"
  fi
  for s in $suites; do
    /bin/iscsi-test-cu -d -v --test=$s $url 2>&1
    echo "iser: suite $s ended with status $?"
  done
  echo "iser: conformance done"
fi
kill $daemon
sleep 1
tail -n ${LOG_LINES:-40} /tmp/targetd.log
dmesg | tail -n 20
"#;

/// In the guest (`TARGETD_ISER_GUEST`): initiator-bench's iSER runner against the targetd the
/// script started, over rxe0: verified random reads and writes, every block written read back.
#[test]
fn initiator_bench_over_iser_in_the_guest() {
    use initiator_bench::iser::{run_channels, IserChannel, RECEIVES};
    use initiator_bench::rdma::{place_len, RdmaOptions};
    use initiator_bench::srp::LinkModel;
    use initiator_bench::workload::{Rw, Workload};
    use iscsi_pdu::iser::CmRequest;
    use rdma::ibverbs::{QueueDepth, RdmaVerbs};
    use srp::initiator::Registration;
    if std::env::var_os(GUEST).is_none() {
        return; // Only in the guest.
    }
    let addr = guest::rdma_addr();
    let portal = std::net::SocketAddr::new(addr, 3260);
    // As initiator-bench's `run --transport iser` does (its run_rdma, behind its own feature
    // rdma): a connection with the iSER CM request, the login, the run, the logout.
    let mut verbs: RdmaVerbs =
        RdmaVerbs::open(None, 1024, rdma::verbs::MESSAGE_BUFFER_LEN).expect("rxe0 opens");
    let private = CmRequest {
        zbva_not_supported: true,
        send_with_invalidate_not_supported: true,
    }
    .encode();
    for (bs, ios, registration) in [
        (4096, 400, Registration::Pool),
        (65536, 200, Registration::Cache),
        (1 << 20, 40, Registration::PerCommand),
    ] {
        let w = Workload {
            rw: Rw::Randrw,
            bs,
            qd: 8,
            ios: Some(ios),
            size: Some(16 << 20),
            verify: true,
            ..Workload::default()
        };
        let o = RdmaOptions {
            registration,
            regions: 1,
            link: LinkModel::Free,
            immediate_data: true,
        };
        let depth = QueueDepth {
            send: 1024,
            recv: RECEIVES as u32 + 16,
        };
        let (qp, _) = verbs.connect(portal, depth, &private).expect("connected");
        let ch = IserChannel::login(&mut verbs, qp, TARGET, 1, &o, 8, place_len(&w, &o))
            .expect("logged in");
        let mut channels = [ch];
        let r = run_channels(&mut verbs, &mut channels, 0, &w, &o).expect("the run");
        channels[0].logout(&mut verbs).expect("logged out");
        assert_eq!((r.ios, r.errors, r.verify_errors), (ios, 0, 0), "{bs}");
        assert!(r.verified_blocks > 0, "reads were checked");
        println!(
            "initiator-bench iser: {bs}-byte I/Os verified ({ios} random, {} blocks read back, \
             {:.0} IOPS, registration {})",
            r.verified_blocks,
            r.iops,
            registration.name()
        );
    }
}

#[test]
fn the_score_reads_cunit_verdicts() {
    let out = "Suite: SCSI.Read10\n  Test: Simple ...passed\n  Test: Beyond ...\n[SKIPPED] no\npassed\n  Test: Bad ...\n  foo FAILED\n";
    assert_eq!(score(out), (1, 1, 1));
}
