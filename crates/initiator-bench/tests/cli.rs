//! The `initiator-bench` command as a script uses it: a run whose I/Os failed exits non-zero
//! (unless `--max-errors` tolerates them) and its log names each failure's sense by name; a
//! portal that cannot be reached is named in the error.

mod common;

use common::{Config, ScriptedTarget};

/// Runs the command on a blocking thread, so the scripted target's tasks keep running.
async fn bench(args: Vec<String>) -> std::process::Output {
    tokio::task::spawn_blocking(move || {
        std::process::Command::new(env!("CARGO_BIN_EXE_initiator-bench"))
            .args(args)
            .env("RUST_LOG", "warn")
            .output()
            .unwrap()
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
