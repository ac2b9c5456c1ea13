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
        stdout.contains("warning: target iqn.2026-11.io.example:cli: chap.secret"),
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

/// `--check` finds what the start would refuse on this host, without opening a unit for I/O:
/// a LUN file in a directory that does not exist, a missing file with no size, a file larger
/// than its size, a file the service's user may not open, a state directory and an admin
/// socket with nowhere to be made. Every problem is listed, not only the first, and the
/// start refuses the same config.
#[test]
fn check_finds_what_the_start_would_refuse() {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    std::fs::set_permissions(d, std::fs::Permissions::from_mode(0o755)).unwrap();
    std::fs::write(d.join("large.img"), vec![0u8; 2 << 20]).unwrap();
    std::fs::write(d.join("private.img"), vec![0u8; 1 << 20]).unwrap();
    std::fs::set_permissions(
        d.join("private.img"),
        std::fs::Permissions::from_mode(0o600),
    )
    .unwrap();
    let lun = |n: u32, path: &str, size: &str| {
        format!("[[targets.luns]]\nlun = {n}\nbackend = \"file\"\npath = \"{path}\"\n{size}\n")
    };
    let text = format!(
        "[server]\nportals = [\"127.0.0.1:{}\"]\nadmin_socket = \"no-run/targetd.sock\"\n\
         state_dir = \"no-lib/state\"\n\n[[targets]]\nname = \"iqn.2026-11.io.example:check\"\n{}{}{}{}",
        free_port(),
        lun(0, "no-images/disk.img", "size = \"1MiB\""),
        lun(1, "new.img", ""),
        lun(2, "large.img", "size = \"1MiB\""),
        lun(5, "private.img", ""),
    );
    let path = d.join("config.toml");
    std::fs::write(&path, text).unwrap();
    // The service's user: root may open anything, so as root the check runs as nobody.
    let as_service = |program: &str| {
        let mut c = if running_as_root() {
            let mut c = Command::new("setpriv");
            c.args(["--reuid=65534", "--regid=65534", "--clear-groups", program]);
            c
        } else {
            std::fs::set_permissions(
                d.join("private.img"),
                std::fs::Permissions::from_mode(0o000),
            )
            .unwrap();
            Command::new(program)
        };
        c.current_dir(d);
        c
    };
    let out = as_service(env!("CARGO_BIN_EXE_targetd"))
        .arg("--check")
        .arg(&path)
        .output()
        .expect("setpriv (util-linux) runs the check as another user");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    let t = "iqn.2026-11.io.example:check";
    let problems = [
        format!(
            "{t} LUN 0: path: {}/no-images: no such directory",
            d.display()
        ),
        format!(
            "{t} LUN 1: size: {}/new.img: does not exist and no size",
            d.display()
        ),
        format!(
            "{t} LUN 2: size: {}/large.img: size 1048576 does not fit",
            d.display()
        ),
        format!(
            "{t} LUN 5: path: {}/private.img: Permission denied",
            d.display()
        ),
        format!(
            "server.state_dir: {}/no-lib: no such directory",
            d.display()
        ),
        format!(
            "server.admin_socket: {}/no-run: no such directory",
            d.display()
        ),
    ];
    for expected in &problems {
        assert!(stderr.contains(expected), "{expected:?} not in:\n{stderr}");
    }
    assert!(!d.join("new.img").exists(), "--check created a file");
    assert_eq!(
        std::fs::metadata(d.join("large.img")).unwrap().len(),
        2 << 20
    );

    // The start refuses it too, at the first problem it meets.
    let out = as_service(env!("CARGO_BIN_EXE_targetd"))
        .arg(&path)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    let keys = [
        "server.state_dir",
        "server.admin_socket",
        "LUN 0: path",
        "LUN 1: size",
    ];
    assert!(keys.iter().any(|k| stderr.contains(k)), "{stderr}");
}

/// An admin socket path taken by something that is not a socket is refused by the check and
/// by the start alike, and never removed.
#[test]
fn an_admin_socket_path_that_is_a_file_is_refused_and_kept() {
    let dir = tempfile::tempdir().unwrap();
    let path = config(dir.path(), "twelve-bytes");
    std::fs::write(dir.path().join("admin.sock"), "not a socket").unwrap();
    for args in [&["--check"][..], &[][..]] {
        let out = Command::new(env!("CARGO_BIN_EXE_targetd"))
            .args(args)
            .arg(&path)
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{args:?}: {stderr}");
        assert!(
            stderr.contains("server.admin_socket") && stderr.contains("exists and is not a socket"),
            "{args:?}: {stderr}"
        );
    }
    let kept = std::fs::read_to_string(dir.path().join("admin.sock")).unwrap();
    assert_eq!(kept, "not a socket");
}

/// Whether this test runs as root (whose opens the permission bits do not stop), from the
/// owner of a file it makes.
fn running_as_root() -> bool {
    use std::os::unix::fs::MetadataExt;
    let f = tempfile::NamedTempFile::new().unwrap();
    f.as_file().metadata().unwrap().uid() == 0
}

/// targetd and targetctl have their man pages and completions (initiator-bench's are tested
/// in its crate), and every page a page names exists
/// (`targetctl man DIR` writes one per subcommand, which targetctl.1 refers to).
#[test]
fn man_pages_and_completions_are_complete() {
    let dir = tempfile::tempdir().unwrap();
    let run = |program: &str, args: &[&str]| {
        let out = Command::new(program).args(args).output().unwrap();
        assert!(out.status.success(), "{program} {args:?}: {out:?}");
        String::from_utf8(out.stdout).unwrap()
    };
    let d = dir.path().to_str().unwrap();
    run(env!("CARGO_BIN_EXE_targetctl"), &["man", d]);
    let targetd = run(env!("CARGO_BIN_EXE_targetd"), &["--man"]);
    assert!(targetd.contains(".TH targetd 1"), "{targetd}");
    std::fs::write(dir.path().join("targetd.1"), targetd).unwrap();
    let mut pages = 0;
    for entry in std::fs::read_dir(dir.path()).unwrap() {
        let page = std::fs::read_to_string(entry.unwrap().path()).unwrap();
        pages += 1;
        // References look like `targetctl\-lun(1)`.
        for word in page.split_whitespace() {
            if let Some(name) = word.strip_suffix("(1)") {
                let file = format!("{}.1", name.replace("\\-", "-"));
                assert!(
                    dir.path().join(&file).exists(),
                    "{file} is named but missing"
                );
            }
        }
    }
    assert!(pages > 30, "{pages} pages");
    for (program, function) in [
        (env!("CARGO_BIN_EXE_targetd"), "_targetd()"),
        (env!("CARGO_BIN_EXE_targetctl"), "_targetctl()"),
    ] {
        let args: &[&str] = if program.ends_with("targetd") {
            &["--completions", "bash"]
        } else {
            &["completions", "bash"]
        };
        let script = run(program, args);
        assert!(script.contains(function), "{program}: {script}");
    }
    // `lun add --backend <TAB>` offers the backends, not file names.
    let script = run(env!("CARGO_BIN_EXE_targetctl"), &["completions", "bash"]);
    assert!(script.contains("file memory null rbd"), "{script}");
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
        .map(Running)
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
        text.contains("WARN") && text.contains("target iqn.2026-11.io.example:cli: chap.secret"),
        "{text}"
    );
    let json = first_log_line(&["--log-format", "json"]);
    let v: serde_json::Value = serde_json::from_str(&json).expect(&json);
    assert_eq!(v["level"], "WARN", "{json}");
    assert_eq!(
        v["fields"]["key"], "target iqn.2026-11.io.example:cli: chap.secret",
        "{json}"
    );
}

#[test]
fn admin_changes_are_logged_with_who_asked() {
    use std::os::unix::fs::MetadataExt;
    let dir = tempfile::tempdir().unwrap();
    let path = config(dir.path(), "twelve-bytes");
    let uid = std::fs::metadata(dir.path()).unwrap().uid();
    let mut child = start_json(&path);
    let ctl = |args: &[&str]| {
        Command::new(env!("CARGO_BIN_EXE_targetctl"))
            .arg("--socket")
            .arg(dir.path().join("admin.sock"))
            .args(args)
            .output()
            .unwrap()
    };
    // --json after the subcommand too; the engine in words.
    let status = ctl(&["status", "--json"]);
    let status: serde_json::Value = serde_json::from_slice(&status.stdout).unwrap();
    let engine = status["engine"].as_str().unwrap_or_default();
    assert!(
        engine.starts_with("io_uring") || engine.starts_with("threads"),
        "{status}"
    );
    let luns = ctl(&["luns"]);
    assert!(luns.status.success(), "a read: not logged");
    // Aligned tables with headers: each column starts where its header does.
    let luns = String::from_utf8_lossy(&luns.stdout).into_owned();
    let lines: Vec<&str> = luns.lines().collect();
    assert_eq!(lines.len(), 2, "{luns}");
    assert!(lines[0].starts_with("TARGET"), "{luns}");
    let at = lines[0].find("BACKEND").expect("a BACKEND column");
    assert_eq!(&lines[1][at..at + 4], "file", "{luns}");
    let at = lines[0].find("SIZE").expect("a SIZE column");
    assert!(lines[1][at..].starts_with("1 MiB"), "{luns}");
    let targets = ctl(&["targets"]);
    let targets = String::from_utf8_lossy(&targets.stdout).into_owned();
    let lines: Vec<&str> = targets.lines().collect();
    assert_eq!(lines.len(), 2, "{targets}");
    let at = lines[0].find("SESSIONS").expect("a SESSIONS column");
    assert!(lines[1][at..].starts_with('0'), "{targets}");
    assert!(
        lines[1].starts_with("iqn.2026-11.io.example:cli"),
        "{targets}"
    );
    // The tree: the target, its portal, who may log in, its LUN and backing; no secret.
    let tree = ctl(&["tree"]);
    let tree = String::from_utf8_lossy(&tree.stdout).into_owned();
    let disk = dir.path().join("disk.img");
    for line in [
        "iqn.2026-11.io.example:cli\n".to_string(),
        "├── access: any initiator\n".to_string(),
        "├── CHAP: user u\n".to_string(),
        format!(
            "    └── 0: file {}, 1 MiB, 512-byte blocks\n",
            disk.display()
        ),
    ] {
        assert!(tree.contains(&line), "{line:?} in {tree}");
    }
    assert!(
        tree.contains("(iSCSI)") && !tree.contains("twelve-bytes"),
        "{tree}"
    );
    // An empty list says what there is none of.
    let sessions = ctl(&["sessions"]);
    assert_eq!(String::from_utf8_lossy(&sessions.stdout), "no sessions\n");
    let grown = ctl(&["lun", "resize", "iqn.2026-11.io.example:cli", "0", "2MiB"]);
    assert!(
        grown.status.success(),
        "{}",
        String::from_utf8_lossy(&grown.stderr)
    );
    let refused = ctl(&["lun", "resize", "iqn.2026-11.io.example:cli", "0", "1MiB"]);
    assert!(!refused.status.success());
    // With --json a change is a list of what changed, an error an object naming it.
    let changed = ctl(&[
        "--json",
        "lun",
        "resize",
        "iqn.2026-11.io.example:cli",
        "0",
        "4MiB",
    ]);
    let changed: serde_json::Value = serde_json::from_slice(&changed.stdout).unwrap();
    assert!(
        changed.as_array().is_some_and(|c| !c.is_empty()),
        "{changed}"
    );
    let error = ctl(&[
        "--json",
        "lun",
        "resize",
        "iqn.2026-11.io.example:cli",
        "0",
        "1MiB",
    ]);
    assert!(!error.status.success());
    let error: serde_json::Value = serde_json::from_slice(&error.stdout).unwrap();
    assert!(
        error["error"]
            .as_str()
            .is_some_and(|e| e.contains("--force")),
        "{error}"
    );
    // A new CHAP secret is logged as a change, never shown.
    let secret = dir.path().join("secret");
    std::fs::write(&secret, "a-new-secret-of-22-bytes\n").unwrap();
    let chap = ctl(&[
        "target",
        "set",
        "iqn.2026-11.io.example:cli",
        "--chap-user",
        "u2",
        "--chap-secret-file",
        secret.to_str().unwrap(),
    ]);
    assert!(
        chap.status.success(),
        "{}",
        String::from_utf8_lossy(&chap.stderr)
    );
    let logs = json_logs(&mut child, |m| m.starts_with("admin change"));
    // Two resizes and two refusals, --json or not, and the CHAP change.
    assert_eq!(logs.len(), 5, "{logs:#?}");
    for v in &logs {
        assert_eq!(v["fields"]["uid"], uid, "{v}");
        // The request as JSON (what targetctl sent), not Rust's Debug text.
        let request: serde_json::Value =
            serde_json::from_str(v["fields"]["request"].as_str().unwrap()).expect("JSON");
        assert!(
            ["lun-resize", "target-set"].contains(&request["command"].as_str().unwrap()),
            "{v}"
        );
    }
    let chap_log = logs[4].to_string();
    assert!(!chap_log.contains("a-new-secret"), "{chap_log}");
    assert!(chap_log.contains("<redacted>"), "{chap_log}");
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

/// A daemon started by a test, killed when the test ends however it ends (a failed assertion
/// must not leave it running and holding its ports).
struct Running(std::process::Child);

impl std::ops::Deref for Running {
    type Target = std::process::Child;

    fn deref(&self) -> &std::process::Child {
        &self.0
    }
}

impl std::ops::DerefMut for Running {
    fn deref_mut(&mut self) -> &mut std::process::Child {
        &mut self.0
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// targetd on `path`, logging JSON at info to a pipe, once it listens (it says so on stdout).
fn start_json(path: &std::path::Path) -> Running {
    let mut child = Command::new(env!("CARGO_BIN_EXE_targetd"))
        .args(["--log-format", "json"])
        .arg(path)
        .env("RUST_LOG", "info")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map(Running)
        .unwrap();
    let mut out = BufReader::new(child.stdout.take().unwrap()).lines();
    for line in out.by_ref() {
        if line.unwrap().contains("admin socket") {
            break;
        }
    }
    // Keep reading, so its later lines never meet a closed pipe.
    std::thread::spawn(move || out.for_each(drop));
    child
}

/// Stops `child` (started with `--log-format json` and stderr piped) and returns its log
/// lines whose message `wanted` picks.
fn json_logs(
    child: &mut std::process::Child,
    wanted: impl Fn(&str) -> bool,
) -> Vec<serde_json::Value> {
    let _ = child.kill();
    let _ = child.wait();
    BufReader::new(child.stderr.take().unwrap())
        .lines()
        .map_while(Result::ok)
        .filter_map(|l| serde_json::from_str(&l).ok())
        .filter(|v: &serde_json::Value| v["fields"]["message"].as_str().is_some_and(&wanted))
        .collect()
}

/// The next datagram on `socket`, within 20 s (a signal that interrupts the wait, as one
/// reaching this process while the test signals the daemon may, is waited through).
fn next_notification(socket: &std::os::unix::net::UnixDatagram) -> String {
    let mut buf = [0u8; 512];
    loop {
        match socket.recv(&mut buf) {
            Ok(n) => return String::from_utf8_lossy(&buf[..n]).into_owned(),
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => panic!("a notification within 20 s: {e}"),
        }
    }
}

#[test]
fn the_service_manager_hears_ready_reloading_and_stopping() {
    let dir = tempfile::tempdir().unwrap();
    let path = config(dir.path(), "0123456789ab");
    let sock = dir.path().join("notify.sock");
    let manager = std::os::unix::net::UnixDatagram::bind(&sock).unwrap();
    manager
        .set_read_timeout(Some(std::time::Duration::from_secs(20)))
        .unwrap();
    let mut child = Command::new(env!("CARGO_BIN_EXE_targetd"))
        .arg(&path)
        .env("NOTIFY_SOCKET", &sock)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .map(Running)
        .unwrap();
    assert_eq!(next_notification(&manager), "READY=1");
    // It listens by the time it says so.
    let stdout = BufReader::new(child.stdout.take().unwrap());
    let listening = stdout
        .lines()
        .map_while(Result::ok)
        .find(|l| l.starts_with("targetd: listening on"));
    assert!(listening.is_some());
    let kill = |sig: &str| {
        assert!(Command::new("kill")
            .args([sig, &child.id().to_string()])
            .status()
            .unwrap()
            .success())
    };
    kill("-HUP");
    let reloading = next_notification(&manager);
    assert!(
        reloading.starts_with("RELOADING=1\nMONOTONIC_USEC="),
        "{reloading:?}"
    );
    assert_eq!(next_notification(&manager), "READY=1");
    kill("-TERM");
    assert_eq!(next_notification(&manager), "STOPPING=1");
    assert!(child.wait().unwrap().success());
}

#[test]
fn the_unit_file_runs_what_targetd_offers() {
    let unit = std::fs::read_to_string(
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../packaging/targetd.service"),
    )
    .unwrap();
    for line in [
        "Type=notify",
        "ExecStartPre=/usr/local/bin/targetd --check /etc/targetd/config.toml",
        "ExecStart=/usr/local/bin/targetd /etc/targetd/config.toml",
        "ExecReload=/usr/local/bin/targetctl --socket /run/targetd/targetd.sock config reload",
        "RuntimeDirectory=targetd",
        "StateDirectory=targetd",
        "LimitMEMLOCK=infinity",
    ] {
        assert!(unit.lines().any(|l| l == line), "the unit lacks {line}");
    }
    // The packaging config puts the socket and the disks where the unit makes room for them,
    // and the socket where targetctl looks by default.
    let packaged = targetd::Config::load(
        &std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../packaging/config.toml"),
    )
    .unwrap();
    assert_eq!(
        packaged.server.admin_socket,
        std::path::Path::new("/run/targetd/targetd.sock")
    );
    assert_eq!(
        packaged.server.state_dir.as_deref(),
        Some(std::path::Path::new("/var/lib/targetd/state"))
    );
    let path = packaged.targets[0].luns[0].path.as_deref().unwrap();
    assert!(path.starts_with("/var/lib/targetd/"), "{}", path.display());
    // `systemctl restart` keeps sessions: the store holds every connection the config lets
    // in, the listeners and the state.
    assert!(packaged.server.restart_keeps_sessions);
    let store: usize = unit
        .lines()
        .find_map(|l| l.strip_prefix("FileDescriptorStoreMax="))
        .expect("the unit gives targetd a file descriptor store")
        .parse()
        .unwrap();
    let needed = packaged.server.max_connections + packaged.server.portals.len() + 2;
    assert!(
        store >= needed,
        "FileDescriptorStoreMax={store}, {needed} needed"
    );
    // The repository's config passes the unit's check.
    let out = Command::new(env!("CARGO_BIN_EXE_targetd"))
        .arg("--check")
        .arg(std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../config.toml"))
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn engine_auto_serves_without_registered_buffers_when_locked_memory_is_short() {
    // An unprivileged user with 64 KiB of locked memory: io_uring refuses the arena.
    let root = std::process::Command::new("id")
        .arg("-u")
        .output()
        .is_ok_and(|o| o.stdout == b"0\n");
    let setpriv = std::process::Command::new("setpriv")
        .arg("--version")
        .output()
        .is_ok();
    if !root || !setpriv {
        let why = "needs root and setpriv (util-linux) to run targetd as nobody";
        assert!(std::env::var_os("CI").is_none(), "{why}");
        eprintln!("skipping: {why}");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let port = free_port();
    let d = dir.path().display();
    let text = format!(
        "[server]\nportals = [\"127.0.0.1:{port}\"]\nadmin_socket = \"{d}/admin.sock\"\n\
         reactors = 1\n\n[[targets]]\nname = \"iqn.2026-11.io.example:cli\"\n\n\
         [[targets.luns]]\nlun = 0\nbackend = \"memory\"\nsize = \"1MiB\"\n"
    );
    let path = dir.path().join("config.toml");
    std::fs::write(&path, text).unwrap();
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o777)).unwrap();
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).unwrap();
    let mut child = Command::new("setpriv")
        .args(["--reuid=65534", "--regid=65534", "--clear-groups", "--"])
        .args(["sh", "-c", "ulimit -l 64 && exec \"$0\" \"$1\""])
        .arg(env!("CARGO_BIN_EXE_targetd"))
        .arg(&path)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map(Running)
        .unwrap();
    let stdout = BufReader::new(child.stdout.take().unwrap());
    let listening = stdout
        .lines()
        .map_while(Result::ok)
        .find(|l| l.starts_with("targetd: listening on"));
    let _ = child.kill();
    let _ = child.wait();
    let mut stderr = String::new();
    std::io::Read::read_to_string(&mut child.stderr.take().unwrap(), &mut stderr).unwrap();
    assert!(listening.is_some(), "targetd did not start: {stderr}");
    assert!(
        stderr.contains("RLIMIT_MEMLOCK") && stderr.contains("without registered buffers"),
        "{stderr}"
    );
}

#[test]
fn targetctl_names_itself_and_writes_its_completions_and_man_page_without_a_daemon() {
    let ctl = |args: &[&str]| {
        let out = Command::new(env!("CARGO_BIN_EXE_targetctl"))
            .args(["--socket", "/nonexistent/targetd.sock"])
            .args(args)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8(out.stdout).unwrap()
    };
    assert!(ctl(&["--version"]).starts_with("targetctl "));
    let bash = ctl(&["completions", "bash"]);
    assert!(
        bash.contains("_targetctl()") && bash.contains("resize"),
        "{bash}"
    );
    let zsh = ctl(&["completions", "zsh"]);
    assert!(zsh.starts_with("#compdef targetctl"), "{zsh}");
    let dir = tempfile::tempdir().unwrap();
    ctl(&["man", dir.path().to_str().unwrap()]);
    let man = std::fs::read_to_string(dir.path().join("targetctl.1")).unwrap();
    assert!(man.contains(".TH targetctl"), "{man}");
    assert!(man.contains("Administers a running targetd"), "{man}");
}

/// A failed CHAP login is logged naming the target, the initiator and the CHAP user it gave
/// (never a secret), so an administrator can tell a mistyped secret from a stranger.
#[test]
fn a_failed_chap_login_names_the_target_the_initiator_and_the_user() {
    let dir = tempfile::tempdir().unwrap();
    let path = config(dir.path(), "twelve-bytes");
    let text = std::fs::read_to_string(&path).unwrap();
    let port = text
        .split("127.0.0.1:")
        .nth(1)
        .and_then(|r| r.split('"').next())
        .unwrap()
        .to_string();
    let mut child = start_json(&path);
    let url = initiator_bench::IscsiUrl::parse(&format!(
        "iscsi://127.0.0.1:{port}/iqn.2026-11.io.example:cli/0"
    ))
    .unwrap();
    let mut o = initiator_bench::LoginOptions {
        timeout: std::time::Duration::from_secs(10),
        ..Default::default()
    };
    o.initiator_name = "iqn.2026-11.io.example:mallory-host".into();
    o.settings.auth.methods = vec![iscsi_pdu::negotiation::AuthMethod::Chap];
    o.chap = Some(iscsi_pdu::chap::ChapCredentials::new("mallory", b"not-the-secret", 1).unwrap());
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let refused = rt.block_on(initiator_bench::Session::connect(&url, o));
    assert!(refused.is_err());
    let logs = json_logs(&mut child, |m| m.contains("authentication failure"));
    assert_eq!(logs.len(), 1, "{logs:#?}");
    let f = &logs[0]["fields"];
    assert_eq!(f["target"], "iqn.2026-11.io.example:cli", "{f}");
    assert_eq!(f["initiator"], "iqn.2026-11.io.example:mallory-host", "{f}");
    assert_eq!(f["chap_user"], "mallory", "{f}");
    assert_eq!(f["transport"], "TCP", "{f}");
    assert!(!logs[0].to_string().contains("not-the-secret"));
}
