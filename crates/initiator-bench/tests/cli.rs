//! The `initiator-bench` command as a script uses it: a run whose I/Os failed exits non-zero
//! (unless `--max-errors` tolerates them), its log names the first failures' sense by name and its
//! report counts them all by kind, without colour escapes off a terminal; a
//! portal that cannot be reached is named in the error.

mod common;

use common::{Config, ScriptedTarget};

/// Runs the command on a blocking thread, so the scripted target's tasks keep running; a
/// command that has not ended after a minute is killed and fails the test (it once spun).
async fn bench(args: Vec<String>) -> std::process::Output {
    tokio::task::spawn_blocking(move || {
        let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_initiator-bench"))
            .args(&args)
            .env("RUST_LOG", "warn")
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
        while child.try_wait().unwrap().is_none() {
            if std::time::Instant::now() > deadline {
                let _ = child.kill();
                panic!("initiator-bench {args:?} did not end within a minute");
            }
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        child.wait_with_output().unwrap()
    })
    .await
    .unwrap()
}

fn run_args(url: &str, extra: &[&str]) -> Vec<String> {
    [
        "run", url, "--rw", "randread", "--bs", "4k", "--qd", "2", "--ios", "20",
    ]
    .iter()
    .chain(extra)
    .map(|s| s.to_string())
    .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failed_ios_fail_the_run_and_their_sense_is_named() {
    let t = ScriptedTarget::start(Config {
        fail_reads: true,
        ..Config::default()
    })
    .await;
    let out = bench(run_args(&t.url(), &[])).await;
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("I/Os failed"), "{stderr}");
    assert!(
        stderr.contains("MEDIUM ERROR / UNRECOVERED READ ERROR (11h/00h)"),
        "{stderr}"
    );
    assert!(
        stderr.contains(&t.addr.to_string()),
        "the portal is named: {stderr}"
    );
    // Off a terminal the log has no colour escapes; the report counts the failures by kind.
    assert!(
        !stderr.contains('\x1b'),
        "colour escapes in a pipe: {stderr:?}"
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        stdout.contains("I/Os failed with: SCSI status") && stdout.contains("MEDIUM ERROR"),
        "{stdout}"
    );
    // An I/O size that is not whole blocks is refused before anything is sent.
    let mut args = run_args(&t.url(), &[]);
    let at = args.iter().position(|a| a == "4k").unwrap();
    args[at] = "1000".into();
    let out = bench(args).await;
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        stderr.contains("--bs 1000: not a whole number of 512-byte blocks"),
        "{stderr}"
    );
    // Tolerated failures leave the exit status alone.
    let out = bench(run_args(&t.url(), &["--max-errors", "1000"])).await;
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // A healthy target: exit 0.
    let healthy = ScriptedTarget::start(Config::default()).await;
    let out = bench(run_args(&healthy.url(), &[])).await;
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreachable_portal_is_named() {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let url = format!("iscsi://127.0.0.1:{port}/iqn.2026-11.io.example:none/0");
    let out = bench(run_args(&url, &[])).await;
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        stderr.contains(&format!("cannot connect to 127.0.0.1:{port}")),
        "{stderr}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn trace_report_refuses_files_of_the_wrong_side() {
    use cmdtrace::{Side, TraceFile};
    let dir = tempfile::tempdir().unwrap();
    let write = |name: &str, side: Side| {
        let path = dir.path().join(name);
        let file = TraceFile {
            side,
            offset_ns: 0,
            dropped: 0,
            records: Vec::new(),
        };
        file.write_to(&mut std::fs::File::create(&path).unwrap())
            .unwrap();
        path.display().to_string()
    };
    let (t, i) = (
        write("t.trace", Side::Target),
        write("i.trace", Side::Initiator),
    );
    let out = dir.path().join("out").display().to_string();
    let report = |a: &str, b: &str| {
        bench(
            ["trace", "report", a, b, "--out", &out]
                .iter()
                .map(|s| s.to_string())
                .collect(),
        )
    };
    let swapped = report(&i, &t).await;
    let stderr = String::from_utf8_lossy(&swapped.stderr);
    assert!(!swapped.status.success());
    assert!(stderr.contains("written by an initiator"), "{stderr}");
    let twice = report(&t, &t).await;
    assert!(!twice.status.success());
    assert!(
        String::from_utf8_lossy(&twice.stderr).contains("written by a target"),
        "{}",
        String::from_utf8_lossy(&twice.stderr)
    );
    // The right order: a report of nothing, which ends (its plot once spun forever on no
    // data).
    let right = report(&t, &i).await;
    let stderr = String::from_utf8_lossy(&right.stderr);
    assert!(right.status.success(), "{stderr}");
    assert!(
        String::from_utf8_lossy(&right.stdout).contains("no command arrived"),
        "{}",
        String::from_utf8_lossy(&right.stdout)
    );
    // A plot it could not draw leaves no file behind.
    for name in ["in-flight.svg", "in-flight.png"] {
        let file = dir.path().join("out").join(name);
        let drawn = stderr
            .lines()
            .any(|l| l.contains("wrote") && l.contains("in-flight"))
            || String::from_utf8_lossy(&right.stdout).contains("in-flight.png");
        assert!(
            drawn || !file.exists(),
            "{} left after: {stderr}",
            file.display()
        );
    }
}

#[test]
fn sense_reads_as_names() {
    let s = initiator_bench::Sense {
        key: 5,
        asc: 0x25,
        ascq: 0,
    };
    assert_eq!(
        s.to_string(),
        "ILLEGAL REQUEST / LOGICAL UNIT NOT SUPPORTED (25h/00h)"
    );
    let odd = initiator_bench::Sense {
        key: 2,
        asc: 0x7f,
        ascq: 0x12,
    };
    assert_eq!(odd.to_string(), "NOT READY / ASC 7Fh, ASCQ 12h");
}

/// `man DIR` writes a page per subcommand, and every page a page names exists;
/// `completions SHELL` prints a script.
#[test]
fn man_pages_and_completions_are_complete() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let run = |args: &[&str]| {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_initiator-bench"))
            .args(args)
            .output()
            .unwrap();
        assert!(out.status.success(), "{args:?}: {out:?}");
        String::from_utf8(out.stdout).unwrap()
    };
    run(&["man", dir.to_str().unwrap()]);
    let mut pages = 0;
    for entry in std::fs::read_dir(dir).unwrap() {
        let page = std::fs::read_to_string(entry.unwrap().path()).unwrap();
        pages += 1;
        for word in page.split_whitespace() {
            if let Some(name) = word.strip_suffix("(1)") {
                let file = format!("{}.1", name.replace("\\-", "-"));
                assert!(dir.join(&file).exists(), "{file} is named but missing");
            }
        }
    }
    assert!(pages >= 10, "{pages} pages");
    let script = run(&["completions", "bash"]);
    assert!(
        script.contains("complete -F _initiator__bench") && script.contains("initiator-bench"),
        "{script}"
    );
}

/// `compare` measures each target's own process when given two (two builds of a target
/// compared with this client fixed): every round reports a target CPU per I/O for A and
/// for B; a third process is refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn compare_measures_the_cpu_of_a_process_per_target() {
    let (a, b) = (
        ScriptedTarget::start(Config::default()).await,
        ScriptedTarget::start(Config::default()).await,
    );
    // Both scripted targets run in this test's process.
    let pid = std::process::id().to_string();
    let args = |pids: usize| -> Vec<String> {
        let mut v: Vec<String> = [
            "compare",
            &a.url(),
            &b.url(),
            "--rounds",
            "2",
            "--rw",
            "randread",
            "--bs",
            "4k",
            "--qd",
            "2",
            "--ios",
            "200",
            "--json",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        for _ in 0..pids {
            v.extend(["--target-pid".to_string(), pid.clone()]);
        }
        v
    };
    let out = bench(args(2)).await;
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let report: serde_json::Value = serde_json::from_str(&stdout).expect("one JSON object");
    let rounds = report["rounds"].as_array().expect("rounds");
    assert_eq!(rounds.len(), 2);
    for r in rounds {
        let cpu = &r["target CPU us/IO"];
        for side in ["a", "b"] {
            let us = cpu[side].as_f64().unwrap_or(f64::NAN);
            assert!(us.is_finite() && us >= 0.0, "{side}: {r}");
        }
    }
    let out = bench(args(3)).await;
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("--target-pid: at most two"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// `ping` reports the round trips of as many NOP-Outs as asked.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ping_reports_nop_out_round_trips() {
    let t = ScriptedTarget::start(Config::default()).await;
    let out = bench(vec!["ping".into(), t.url(), "--count".into(), "50".into()]).await;
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        stdout.starts_with("50 NOP-Out round trips to ") && stdout.contains(" p50 "),
        "{stdout}"
    );
}
