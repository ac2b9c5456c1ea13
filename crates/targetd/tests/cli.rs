//! targetd's command line as a host runs it: `--check` validates a config and exits without
//! opening or binding anything; log lines carry no colour escapes when stderr is not a
//! terminal (a journal, a file), and `--log-format json` writes one JSON object a line; every
//! admin change is logged with what changed and the uid that asked.

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

fn config(dir: &std::path::Path, chap_secret: &str) -> std::path::PathBuf {
    let port = free_port();
    let d = dir.display();
    let text = format!(
        "[server]\nportals = [\"127.0.0.1:{port}\"]\nadmin_socket = \"{d}/admin.sock\"\n\n\
         [[targets]]\nname = \"iqn.2026-11.io.example:cli\"\n\
         chap = {{ username = \"u\", secret = \"{chap_secret}\" }}\n\n\
         [[targets.luns]]\nlun = 0\nbackend = \"file\"\npath = \"{d}/disk.img\"\nsize = \"1MiB\"\n"
    );
    let path = dir.join("config.toml");
    std::fs::write(&path, text).unwrap();
    path
}

#[test]
fn check_validates_and_opens_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let good = config(dir.path(), "a-secret-of-twenty-bytes");
    let out = Command::new(env!("CARGO_BIN_EXE_targetd"))
        .args(["--check"])
        .arg(&good)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}");
    assert!(stdout.contains("good"), "{stdout}");
    assert!(
        stdout.contains("warning: targets[0].chap.secret"),
        "a secret over 16 bytes is allowed, with a warning: {stdout}"
    );
    assert!(
        !dir.path().join("disk.img").exists(),
        "--check created the LUN's file"
    );
    assert!(!dir.path().join("admin.sock").exists());

    let bad = config(dir.path(), "short");
    let out = Command::new(env!("CARGO_BIN_EXE_targetd"))
        .args(["--check"])
        .arg(&bad)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("targets[0].chap.secret"), "{stderr}");
}

/// Starts targetd with `args`, stderr piped, and returns its first log line (the warning about
/// the long CHAP secret, logged at start).
fn first_log_line(args: &[&str]) -> String {
    let dir = tempfile::tempdir().unwrap();
    let path = config(dir.path(), "a-secret-of-twenty-bytes");
    let mut child = Command::new(env!("CARGO_BIN_EXE_targetd"))
        .args(args)
        .arg(&path)
        .env("RUST_LOG", "info")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stderr.take().unwrap()).lines();
    let line = lines.next().expect("a log line").unwrap();
    let _ = child.kill();
    let _ = child.wait();
    line
}

#[test]
fn logs_are_plain_text_off_a_terminal_or_json_when_asked() {
    let text = first_log_line(&[]);
    assert!(!text.contains('\u{1b}'), "escape codes in {text:?}");
    assert!(
        text.contains("WARN") && text.contains("targets[0].chap.secret"),
        "{text}"
    );
    let json = first_log_line(&["--log-format", "json"]);
    let v: serde_json::Value = serde_json::from_str(&json).expect(&json);
    assert_eq!(v["level"], "WARN", "{json}");
    assert_eq!(v["fields"]["key"], "targets[0].chap.secret", "{json}");
}

#[test]
fn admin_changes_are_logged_with_who_asked() {
    use std::os::unix::fs::MetadataExt;
    let dir = tempfile::tempdir().unwrap();
    let path = config(dir.path(), "twelve-bytes");
    let uid = std::fs::metadata(dir.path()).unwrap().uid();
    let mut child = Command::new(env!("CARGO_BIN_EXE_targetd"))
        .args(["--log-format", "json"])
        .arg(&path)
        .env("RUST_LOG", "info")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // Listening once it says so on stdout.
    let mut out = BufReader::new(child.stdout.take().unwrap()).lines();
    for line in out.by_ref() {
        if line.unwrap().contains("admin socket") {
            break;
        }
    }
    let ctl = |args: &[&str]| {
        Command::new(env!("CARGO_BIN_EXE_targetctl"))
            .arg("--socket")
            .arg(dir.path().join("admin.sock"))
            .args(args)
            .output()
            .unwrap()
    };
    assert!(ctl(&["luns"]).status.success(), "a read: not logged");
    let grown = ctl(&["lun", "resize", "iqn.2026-11.io.example:cli", "0", "2MiB"]);
    assert!(
        grown.status.success(),
        "{}",
        String::from_utf8_lossy(&grown.stderr)
    );
    let refused = ctl(&["lun", "resize", "iqn.2026-11.io.example:cli", "0", "1MiB"]);
    assert!(!refused.status.success());
    let _ = child.kill();
    let _ = child.wait();
    let logs: Vec<serde_json::Value> = BufReader::new(child.stderr.take().unwrap())
        .lines()
        .map_while(Result::ok)
        .filter_map(|l| serde_json::from_str(&l).ok())
        .filter(|v: &serde_json::Value| {
            v["fields"]["message"]
                .as_str()
                .is_some_and(|m| m.starts_with("admin change"))
        })
        .collect();
    assert_eq!(logs.len(), 2, "{logs:#?}");
    for v in &logs {
        assert_eq!(v["fields"]["uid"], uid, "{v}");
        assert!(
            v["fields"]["request"]
                .as_str()
                .unwrap()
                .contains("LunResize"),
            "{v}"
        );
    }
    assert!(
        logs[0]["fields"]["changes"]
            .as_str()
            .unwrap()
            .contains("resized"),
        "{}",
        logs[0]
    );
    assert_eq!(logs[1]["level"], "WARN");
    assert!(
        logs[1]["fields"]["message"]
            .as_str()
            .unwrap()
            .contains("--force"),
        "{}",
        logs[1]
    );
}
