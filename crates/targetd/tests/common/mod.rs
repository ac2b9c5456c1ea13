//! targetd in-process for tests: a config in a temporary directory, portal on a free port,
//! the daemon on its own thread, stopped (drained) on drop.

#![allow(dead_code)]

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use initiator_bench::{IscsiUrl, LoginOptions, Session};
use targetd::{Config, Registry, Server};

#[cfg(feature = "rbd")]
pub mod ceph;
pub mod guest;
pub mod iser;
pub mod nvme_rdma;
pub mod program;
pub mod raw;
pub mod srp_client;

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

/// The key and reason `Server::start` refuses the config `text` with (`@SOCKET@` replaced).
pub fn refused(text: &str) -> (String, String) {
    let dir = tempfile::tempdir().unwrap();
    let text = text.replace(
        "@SOCKET@",
        &dir.path().join("admin.sock").display().to_string(),
    );
    let path = dir.path().join("config.toml");
    std::fs::write(&path, &text).unwrap();
    let config = Config::parse(&path, &text).unwrap();
    match Server::start(config, path) {
        Ok(_) => panic!("started with {text}"),
        Err(e) => (e.key, e.reason),
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

/// The switch node and service targetd's SRP port has in tests.
pub const SRP_TARGET_NODE: rdma::fabric::NodeId = rdma::fabric::NodeId(0);
/// The switch node of tests' SRP initiators.
pub const SRP_INITIATOR_NODE: rdma::fabric::NodeId = rdma::fabric::NodeId(1);
/// The SRP service name.
pub const SRP_SERVICE: &str = "srp0";

/// targetd with one memory target, also serving SRP on a new switch.
pub fn srp_daemon() -> (Arc<rdma::switch::Switch>, Daemon) {
    srp_daemon_with(&memory_target(TARGET, ""))
}

/// targetd with `targets` (`[[targets]]` tables), also serving SRP on a new switch.
pub fn srp_daemon_with(targets: &str) -> (Arc<rdma::switch::Switch>, Daemon) {
    let switch = rdma::switch::Switch::new();
    let d = Daemon::start_with(&config("", targets), |server| {
        server
            .serve_srp_fabric(&switch, SRP_TARGET_NODE, SRP_SERVICE)
            .expect("listening");
    });
    (switch, d)
}

/// An SRP channel of session `s` to the test target over `switch`, logged in, its data memory
/// made as initiator-bench's runner wants it for `w` and `o`.
pub fn srp_channel(
    switch: &Arc<rdma::switch::Switch>,
    s: usize,
    w: &initiator_bench::workload::Workload,
    o: &initiator_bench::srp::RdmaOptions,
) -> (
    rdma::switch::Endpoint<Vec<u8>>,
    srp::initiator::channel::InitiatorChannel<rdma::switch::Endpoint<Vec<u8>>>,
) {
    use rdma::switch::Reply;
    let mut private = Vec::new();
    initiator_bench::srp::login_request(s, targetd::srp::port_id(TARGET), 8192)
        .encode(&mut private);
    let id = switch
        .connect(SRP_INITIATOR_NODE, SRP_SERVICE, &private)
        .expect("the daemon listens");
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    let reply = loop {
        if let Some(r) = switch.reply(id) {
            break r;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "no answer to the login"
        );
        std::thread::sleep(Duration::from_millis(1));
    };
    let Reply::Accepted { qp, private } = reply else {
        panic!("refused");
    };
    let Ok(srp::Iu::LoginRsp(rsp)) = srp::Iu::decode(&private) else {
        panic!("not an SRP_LOGIN_RSP");
    };
    let mut verbs = switch.endpoint(SRP_INITIATOR_NODE);
    let place = initiator_bench::srp::place_len(w, o);
    let ch = srp::initiator::channel::InitiatorChannel::new(
        &mut verbs,
        qp,
        &rsp,
        o.registration,
        w.qd.max(1),
        place,
    )
    .expect("the channel's memory");
    (verbs, ch)
}

/// PERSISTENT RESERVE OUT with a basic parameter list.
pub fn pr_out(
    lun: iscsi_pdu::Lun,
    action: u8,
    kind: u8,
    key: u64,
    new_key: u64,
    aptpl: bool,
) -> initiator_bench::scsi::Command {
    let mut c = [0u8; 16];
    c[0] = 0x5f;
    c[1] = action;
    c[2] = kind;
    c[5..9].copy_from_slice(&24u32.to_be_bytes());
    let mut p = vec![0u8; 24];
    p[0..8].copy_from_slice(&key.to_be_bytes());
    p[8..16].copy_from_slice(&new_key.to_be_bytes());
    p[20] = u8::from(aptpl);
    initiator_bench::scsi::Command::write(lun, c, bytes::Bytes::from(p))
}

/// PERSISTENT RESERVE IN of `action` (0 READ KEYS, 1 READ RESERVATION): the data.
pub async fn pr_in(s: &Session, action: u8) -> bytes::Bytes {
    let mut c = [0u8; 16];
    c[0] = 0x5e;
    c[1] = action;
    c[7..9].copy_from_slice(&512u16.to_be_bytes());
    let r = s
        .execute_good(initiator_bench::scsi::Command::read(s.lun(), c, 512))
        .await;
    r.expect("PERSISTENT RESERVE IN").data
}

/// The registered keys (READ KEYS), sorted.
pub async fn keys(s: &Session) -> Vec<u64> {
    let d = pr_in(s, 0).await;
    let len = u32::from_be_bytes(d[4..8].try_into().unwrap()) as usize;
    let mut k: Vec<u64> = d[8..8 + len]
        .chunks(8)
        .map(|c| u64::from_be_bytes(c.try_into().unwrap()))
        .collect();
    k.sort_unstable();
    k
}
