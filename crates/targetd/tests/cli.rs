//! targetd's command line as a host runs it: `--check` validates a config and exits without
//! opening or binding anything; log lines carry no colour escapes when stderr is not a
//! terminal (a journal, a file), and `--log-format json` writes one JSON object a line.

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
