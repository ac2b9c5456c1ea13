//! targetd in-process for tests: a config in a temporary directory, portal on a free port,
//! the daemon on its own thread, stopped (drained) on drop.

#![allow(dead_code)]

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use initiator_bench::{IscsiUrl, LoginOptions, Session};
use targetd::{Config, Registry, Server};

pub mod raw;

pub const TARGET: &str = "iqn.2026-11.io.example:test";

/// A running daemon.
pub struct Daemon {
    pub addr: SocketAddr,
    pub registry: Arc<Registry>,
    pub dir: tempfile::TempDir,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

/// `[server]` and `[iscsi]` for tests, then `targets` (TOML for `[[targets]]` tables).
pub fn config(iscsi: &str, targets: &str) -> String {
    format!(
        "[server]\nportals = [\"127.0.0.1:0\"]\nadmin_socket = \"@SOCKET@\"\nreactors = 2\n\
         nop_interval = 0\n\n[iscsi]\n{iscsi}\n\n{targets}\n"
    )
}

/// One target with a 64 MiB memory LUN 0.
pub fn memory_target(name: &str, extra: &str) -> String {
    format!(
        "[[targets]]\nname = \"{name}\"\n{extra}\n[[targets.luns]]\nlun = 0\nbackend = \"memory\"\nsize = \"64MiB\"\n"
    )
}

impl Daemon {
    /// Starts targetd on `text` (with `@DIR@` and `@SOCKET@` replaced by the temporary
    /// directory and an admin socket in it).
    pub fn start(text: &str) -> Daemon {
        Daemon::start_with(text, |_| {})
    }

    /// As [`Daemon::start`], with `prepare` run on the server before it serves.
    pub fn start_with(text: &str, prepare: impl FnOnce(&Server)) -> Daemon {
        let dir = tempfile::tempdir().unwrap();
        let text = text
            .replace(
                "@SOCKET@",
                &dir.path().join("admin.sock").display().to_string(),
            )
            .replace("@DIR@", &dir.path().display().to_string());
        let path = dir.path().join("config.toml");
        std::fs::write(&path, &text).unwrap();
        let config = Config::parse(&path, &text).unwrap();
        let server = Server::start(config, path).unwrap();
        prepare(&server);
        let addr = server.portals()[0];
        let registry = server.registry();
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        let thread = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            rt.block_on(server.run(async {
                let _ = rx.await;
            }));
        });
        Daemon {
            addr,
            registry,
            dir,
            stop: Some(tx),
            thread: Some(thread),
        }
    }

    pub fn url(&self, target: &str, lun: u16) -> IscsiUrl {
        IscsiUrl::parse(&format!("iscsi://{}/{target}/{lun}", self.addr)).unwrap()
    }

    pub fn socket(&self) -> PathBuf {
        self.dir.path().join("admin.sock")
    }

    pub async fn session(&self, o: LoginOptions) -> Session {
        Session::connect(&self.url(TARGET, 0), o)
            .await
            .expect("login")
    }

    /// Stops the daemon and waits for it to drain.
    pub fn stop(mut self) {
        self.shutdown();
    }

    fn shutdown(&mut self) {
        if let Some(tx) = self.stop.take() {
            let _ = tx.send(());
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        self.shutdown();
    }
}

pub fn opts() -> LoginOptions {
    LoginOptions {
        timeout: Duration::from_secs(10),
        ..LoginOptions::default()
    }
}

pub fn pattern(len: usize, seed: usize) -> bytes::Bytes {
    bytes::Bytes::from(
        (0..len)
            .map(|i| (i * 31 + seed * 7 + i / 512) as u8)
            .collect::<Vec<u8>>(),
    )
}

/// Whether an outside tool can run; when it cannot, the test prints why and skips, unless CI
/// is set, where it fails.
pub fn tool(name: &str) -> bool {
    let found = std::process::Command::new("sh")
        .arg("-c")
        .arg(format!("command -v {name}"))
        .output()
        .is_ok_and(|o| o.status.success());
    if !found {
        if std::env::var_os("CI").is_some() {
            panic!("{name} is missing (CI is set: install libiscsi-bin)");
        }
        eprintln!("skipped: {name} is not installed (Debian package libiscsi-bin)");
    }
    found
}
