//! The soft-RoCE guest of scripts/rdma-guest.sh for tests: checks what it needs, runs a script
//! there with the given programs, and says why it skips (a failure under `CI`).

use std::path::PathBuf;
use std::process::Command;

/// What a guest run printed, and whether it ended well.
pub struct Run {
    /// Everything the guest printed (its console).
    pub console: String,
    /// What scripts/rdma-guest.sh said on its own behalf.
    pub errors: String,
    /// Its exit status.
    pub status: std::process::ExitStatus,
}

/// Says why a guest test skips; under `CI`, fails instead.
pub fn skip(why: &str) {
    assert!(std::env::var_os("CI").is_none(), "CI is set, and {why}");
    eprintln!("skipped: {why}");
}

/// In the guest: the address of its rxe device (`RDMA_ADDR`, which scripts/rdma-guest.sh sets).
pub fn rdma_addr() -> std::net::IpAddr {
    std::env::var("RDMA_ADDR")
        .expect("RDMA_ADDR")
        .parse()
        .expect("an address")
}

/// Where a tool is on the PATH (or in /usr/sbin, which a non-root PATH may lack).
pub fn which(tool: &str) -> Option<String> {
    Command::new("sh")
        .arg("-c")
        .arg(format!("command -v {tool}"))
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .or_else(|| Some(format!("/usr/sbin/{tool}")).filter(|p| std::path::Path::new(p).exists()))
}

/// Runs `script` (written to `name` beside the guest's cache) in the guest with the programs
/// `exes` and the environment `env`; `None` when the guest cannot run here (skipped, the
/// reason said).
pub fn run(name: &str, script: &str, exes: &[String], env: &[(&str, String)]) -> Option<Run> {
    if Command::new("qemu-system-x86_64")
        .arg("--version")
        .output()
        .is_err()
    {
        skip("qemu-system-x86_64 is missing (Debian package qemu-system-x86)");
        return None;
    }
    let repo = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..");
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("rdma-guest");
    std::fs::create_dir_all(&dir).expect("the guest's directory");
    let path = dir.with_file_name(name);
    std::fs::write(&path, script).expect("the guest's script");
    let out = Command::new("bash")
        .arg(repo.join("scripts/rdma-guest.sh"))
        .arg("run")
        .arg(&dir)
        .arg(&path)
        .args(exes)
        .envs(env.iter().map(|(k, v)| (*k, v.as_str())))
        .output()
        .expect("bash");
    let run = Run {
        console: String::from_utf8_lossy(&out.stdout).into_owned(),
        errors: String::from_utf8_lossy(&out.stderr).into_owned(),
        status: out.status,
    };
    if run.status.code() == Some(4) {
        skip(run.errors.trim());
        return None;
    }
    Some(run)
}

/// [`run`], its console kept as `name` with `.txt` beside the tests' files, and checked: the
/// guest ended well and printed every one of `lines`. The console, or `None` when the guest
/// cannot run here (skipped, the reason said).
pub fn run_checked(
    name: &str,
    script: &str,
    exes: &[String],
    env: &[(&str, String)],
    lines: &[&str],
) -> Option<String> {
    let run = run(&format!("{name}.sh"), script, exes, env)?;
    let report = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!("{name}.txt"));
    std::fs::write(&report, run.console.as_bytes()).expect("the report");
    assert!(
        run.status.success(),
        "the guest failed ({:?}): {}\nsee {}",
        run.status.code(),
        run.errors,
        report.display()
    );
    for line in lines {
        assert!(
            run.console.contains(line),
            "{line:?} missing: see {}",
            report.display()
        );
    }
    Some(run.console)
}

/// Where each of `tools` is ([`which`]); when one is missing, says `why` ([`skip`]) and gives
/// `None`.
pub fn tools(tools: &[&str], why: &str) -> Option<Vec<String>> {
    let found: Option<Vec<String>> = tools.iter().map(|t| which(t)).collect();
    if found.is_none() {
        skip(why);
    }
    found
}

/// A port on the host's 127.0.0.1 where each HTTP request (a guest's `wget`, through
/// 10.0.2.2) carries out the next of `actions`, then answers; each action's end is sent on the
/// receiver.
pub fn on_requests(
    actions: Vec<Box<dyn FnOnce() + Send>>,
) -> (u16, std::sync::mpsc::Receiver<std::time::Instant>) {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let (done_tx, done_rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for action in actions {
            let Ok((mut c, _)) = listener.accept() else {
                return;
            };
            use std::io::{BufRead, Write};
            // The request read to its end first: a socket closed with bytes unread sends a
            // reset, which wget reports as a failure after the answer.
            let mut request = std::io::BufReader::new(c.try_clone().expect("the socket"));
            let mut line = String::new();
            while request.read_line(&mut line).is_ok_and(|n| n > 0) && line.trim() != "" {
                line.clear();
            }
            action();
            let _ = done_tx.send(std::time::Instant::now());
            let _ = c.write_all(b"HTTP/1.0 200 OK\r\n\r\ndone\n");
            let _ = c.shutdown(std::net::Shutdown::Write);
        }
    });
    (port, done_rx)
}
