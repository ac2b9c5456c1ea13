//! targetd's iSER portal on real verbs: a Linux guest under QEMU (scripts/rdma-guest.sh:
//! Debian's kernel, soft-RoCE on its virtio interface) runs targetd with `iser_portals` on
//! the rxe device beside a TCP portal on the same address, and libiscsi's tools over their
//! own iSER transport (`iser://` URLs; Debian's libiscsi links libibverbs and librdmacm):
//! `iscsi-inq` and `iscsi-readcapacity16`, then libiscsi's conformance suite, which must have
//! no failed test. (Debian's `iscsi-ls` takes only `iscsi://` URLs; tests/iser.rs logs in a
//! discovery session over iSER.)
//!
//! Needs what scripts/rdma-guest.sh needs (qemu-system-x86_64, Debian's archive for the
//! kernel, iproute2's `rdma`, the rxe provider) and libiscsi-bin; without them it says which
//! is missing and skips, and fails under `CI`.
#![cfg(feature = "rdma")]

mod common;

use std::path::PathBuf;
use std::process::Command;
use std::time::Instant;

use common::TARGET;

/// Which of libiscsi's tests run in the guest: the whole suite (`ALL`) unless
/// `TARGETD_ISER_TESTS` names a family (the guest runs under TCG: about 10x slower than the
/// host).
fn families() -> String {
    std::env::var("TARGETD_ISER_TESTS").unwrap_or_else(|_| "ALL".into())
}

#[test]
fn iser_over_soft_roce_with_libiscsi_in_a_linux_guest() {
    let ci = std::env::var_os("CI").is_some();
    let skip = |why: &str| {
        assert!(!ci, "CI is set, and {why}");
        eprintln!("skipped: {why}");
    };
    if Command::new("qemu-system-x86_64")
        .arg("--version")
        .output()
        .is_err()
    {
        return skip("qemu-system-x86_64 is missing (Debian package qemu-system-x86)");
    }
    let which = |tool: &str| {
        Command::new("sh")
            .arg("-c")
            .arg(format!("command -v {tool}"))
            .output()
            .ok()
            .filter(|o| o.status.success())
            .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
    };
    let tools: Option<Vec<String>> = ["iscsi-inq", "iscsi-readcapacity16", "iscsi-test-cu"]
        .iter()
        .map(|t| which(t))
        .collect();
    let Some(tools) = tools else {
        return skip("libiscsi's tools are missing (Debian package libiscsi-bin)");
    };
    let repo = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..");
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("rdma-guest");
    let script = dir.with_file_name("iser-guest.sh");
    std::fs::create_dir_all(&dir).expect("the guest's directory");
    let text = GUEST_SCRIPT
        .replace("@TARGET@", TARGET)
        .replace("@TESTS@", &families())
        .replace(
            "@LOG@",
            &std::env::var("TARGETD_ISER_LOG").unwrap_or_else(|_| "info".into()),
        );
    std::fs::write(&script, text).expect("the guest's script");
    let started = Instant::now();
    let mut run = Command::new("bash");
    run.arg(repo.join("scripts/rdma-guest.sh"))
        .arg("run")
        .arg(&dir)
        .arg(&script)
        .arg(env!("CARGO_BIN_EXE_targetd"))
        .args(&tools)
        .env(
            "RDMA_GUEST_TIMEOUT",
            std::env::var("RDMA_GUEST_TIMEOUT").unwrap_or_else(|_| "2400".into()),
        );
    let out = run.output().expect("bash");
    let console = String::from_utf8_lossy(&out.stdout);
    let errors = String::from_utf8_lossy(&out.stderr);
    let report = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("iser-guest.txt");
    std::fs::write(&report, console.as_bytes()).expect("the report");
    if out.status.code() == Some(4) {
        return skip(errors.trim());
    }
    assert!(
        out.status.success(),
        "the guest failed ({:?}): {errors}\nsee {}",
        out.status.code(),
        report.display()
    );
    for line in [
        "iser: iscsi-inq answered",
        "iser: iscsi-readcapacity16 answered",
        "iser: conformance done",
    ] {
        assert!(
            console.contains(line),
            "{line:?} missing: see {}",
            report.display()
        );
    }
    let (passed, failed, skipped) = score(&console);
    println!(
        "libiscsi over iSER in the guest ({}): passed {passed}, failed {failed}, skipped {skipped} \
         in {:.0} s",
        families(),
        started.elapsed().as_secs_f64()
    );
    assert!(passed > 0, "nothing passed: see {}", report.display());
    assert_eq!(failed, 0, "see {}", report.display());
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
/bin/targetd /tmp/targetd.toml > /tmp/targetd.log 2>&1 &
daemon=$!
for i in $(seq 1 100); do wget -qO /dev/null http://127.0.0.1:9100/metrics && break; sleep 0.1; done
url=iser://$RDMA_ADDR:3260/@TARGET@/0
/bin/iscsi-inq $url > /tmp/inq 2>&1 || { cat /tmp/inq /tmp/targetd.log; exit 1; }
cat /tmp/inq
grep -q "Peripheral" /tmp/inq && echo "iser: iscsi-inq answered"
/bin/iscsi-readcapacity16 $url > /tmp/cap 2>&1 || { cat /tmp/cap /tmp/targetd.log; exit 1; }
cat /tmp/cap
grep -q "Total size:134217728" /tmp/cap && echo "iser: iscsi-readcapacity16 answered"
/bin/iscsi-test-cu -d -v --test=@TESTS@ $url 2>&1
echo "iser: conformance done"
kill $daemon
sleep 1
tail -n ${LOG_LINES:-40} /tmp/targetd.log
dmesg | tail -n 20
"#;

#[test]
fn the_score_reads_cunit_verdicts() {
    let out = "Suite: SCSI.Read10\n  Test: Simple ...passed\n  Test: Beyond ...\n[SKIPPED] no\npassed\n  Test: Bad ...\n  foo FAILED\n";
    assert_eq!(score(out), (1, 1, 1));
}
