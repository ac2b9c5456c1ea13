//! targetd run as a program (its binary) for the tests of an upgrade and of a restart that
//! keep sessions: its own process, config and file LUN in a directory of its own; workers
//! that load a session; and a stand-in for systemd's service manager (its notification
//! socket and file descriptor store) to restart it under.

use std::os::fd::{AsFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use initiator_bench::{LoginOptions, Session};

use super::{pattern, TARGET};

/// Workers loading a disk: `stop` ends them, `done` counts their rounds.
#[allow(clippy::type_complexity)]
pub type Load = (
    Arc<AtomicBool>,
    Arc<AtomicU64>,
    Vec<tokio::task::JoinHandle<()>>,
);

/// A disk the workers write to and read back from, 512-byte blocks.
pub trait Disk: Send + Sync + 'static {
    /// Writes `data` at `lba`; panics on an error.
    fn put(&self, lba: u64, data: Bytes) -> impl std::future::Future<Output = ()> + Send;
    /// Reads `blocks` at `lba`; panics on an error.
    fn get(&self, lba: u64, blocks: u32) -> impl std::future::Future<Output = Bytes> + Send;
}

impl Disk for Session {
    async fn put(&self, lba: u64, data: Bytes) {
        self.write(lba, data, 512).await.expect("write");
    }
    async fn get(&self, lba: u64, blocks: u32) -> Bytes {
        self.read(lba, blocks, 512).await.expect("read")
    }
}

impl Disk for initiator_bench::nvme::NvmeController {
    async fn put(&self, lba: u64, data: Bytes) {
        self.write(lba, data).await.expect("write");
    }
    async fn get(&self, lba: u64, blocks: u32) -> Bytes {
        self.read(lba, blocks).await.expect("read")
    }
}

/// `n` workers on `d`, each writing 8 KiB into its own `span` blocks from `base` on and
/// reading it back at once, until stopped.
pub fn load_on<D: Disk>(d: &Arc<D>, n: u64, span: u64, base: u64) -> Load {
    let stop = Arc::new(AtomicBool::new(false));
    let done = Arc::new(AtomicU64::new(0));
    let workers = (0..n)
        .map(|w| {
            let (d, stop, done) = (d.clone(), stop.clone(), done.clone());
            tokio::spawn(async move {
                let mut k = 0u64;
                while !stop.load(Relaxed) {
                    let lba = base + w * span + (k % 8) * 16;
                    let data = pattern(8192, (w * 1000 + k) as usize);
                    d.put(lba, data.clone()).await;
                    let back = d.get(lba, 16).await;
                    assert!(back == data, "worker {w} round {k}: other data read back");
                    done.fetch_add(1, Relaxed);
                    k += 1;
                }
            })
        })
        .collect();
    (stop, done, workers)
}

/// Eight workers on `s`, each writing 8 KiB into its own 128 blocks and reading it back at
/// once, until `stop`; `done` counts their rounds.
pub fn load(s: &Arc<Session>) -> Load {
    load_at(s, 0)
}

/// As [`load`], the workers' blocks from `base` on.
pub fn load_at(s: &Arc<Session>, base: u64) -> Load {
    load_on(s, 8, 128, base)
}

/// As [`load`], on an NVMe/TCP controller's namespace: four workers, each in its own 256
/// blocks.
pub fn load_nvme(c: &Arc<initiator_bench::nvme::NvmeController>) -> Load {
    load_on(c, 4, 256, 0)
}

/// Asserts that `load`'s workers go on: more rounds within half a second.
pub async fn goes_on(load: &Load, what: &str) {
    let before = load.1.load(Relaxed);
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(load.1.load(Relaxed) > before, "{what}: the I/O stopped");
}

/// Stops `load`'s workers and waits for them; panics when one failed.
pub async fn finish(load: Load) {
    load.0.store(true, Relaxed);
    for w in load.2 {
        w.await.expect("a worker failed");
    }
}

/// A session with header and data digests and an MC/S session of two connections, each
/// loaded (the MC/S session's workers above block 4096), the first holding a registration
/// of key 0xb2: what the tests of an upgrade and of a restart carry across.
pub struct TwoSessions {
    pub digests: Arc<Session>,
    pub mcs: Arc<Session>,
    tsihs: [u16; 2],
    loads: [Load; 2],
}

impl TwoSessions {
    pub async fn start(p: &Program) -> TwoSessions {
        use iscsi_pdu::negotiation::DigestAlgorithm;
        let mut o = super::opts();
        o.settings.header_digest = vec![DigestAlgorithm::Crc32c];
        o.settings.data_digest = vec![DigestAlgorithm::Crc32c];
        let digests = Arc::new(p.session(o).await);
        let mut o = super::opts();
        o.initiator_name = "iqn.2026-11.io.example:mcs".into();
        o.connections = 2;
        o.settings.operational.max_connections = 2;
        let mcs = Arc::new(p.session(o).await);
        assert_eq!(mcs.info().connections, 2);
        let tsihs = [digests.info().tsih, mcs.info().tsih];
        // The unit attention of a new nexus, taken before the reservation.
        let _ = digests.capacity().await;
        let _ = mcs.capacity().await;
        let cmd = super::pr_out(digests.lun(), 0x00, 0, 0, 0xb2, false);
        let status = digests.execute(cmd).await.unwrap().status;
        assert_eq!(status, iscsi_pdu::ScsiStatus::GOOD);
        let loads = [load(&digests), load_at(&mcs, 4096)];
        TwoSessions {
            digests,
            mcs,
            tsihs,
            loads,
        }
    }

    /// Asserts that both sessions' workers go on.
    pub async fn go_on(&self, what: &str) {
        goes_on(&self.loads[0], &format!("{what}: the session with digests")).await;
        goes_on(&self.loads[1], &format!("{what}: the MC/S session")).await;
    }

    /// Stops the workers, and checks that no I/O failed, the TSIHs are the same and the
    /// registration holds.
    pub async fn finish(self) {
        let [a, b] = self.loads;
        finish(a).await;
        finish(b).await;
        assert_eq!([self.digests.info().tsih, self.mcs.info().tsih], self.tsihs);
        assert_eq!(super::keys(&self.digests).await, [0xb2]);
    }
}

/// The `[server]` lines (and the subsystem after them) of a Program with an NVMe/TCP portal
/// and subsystem `nqn` with a 64 MiB file namespace.
pub fn nvme_server(nqn: &str) -> String {
    format!(
        "nvme_portals = [\"127.0.0.1:0\"]\n\n[[subsystems]]\nnqn = \"{nqn}\"\n\n\
         [[subsystems.namespaces]]\nnsid = 1\nbackend = \"file\"\npath = \"ns.img\"\n\
         size = \"64MiB\"\n"
    )
}

/// targetd run as a program (its binary), as an upgrade needs: its own process, its config
/// and a file LUN in a directory of its own, its stdout read for the portal it listens on.
/// Its log level is `TEST_TARGETD_LOG` (as `RUST_LOG`; `info` when unset).
pub struct Program {
    pub child: std::process::Child,
    pub addr: std::net::SocketAddr,
    /// Its first NVMe/TCP portal, when it has one.
    pub nvme: Option<std::net::SocketAddr>,
    pub socket: std::path::PathBuf,
    pub dir: tempfile::TempDir,
}

impl Program {
    pub fn start() -> Program {
        Program::start_with("", None)
    }

    /// A controller of its subsystem `nqn` (namespace 1) through its NVMe/TCP portal, with
    /// header and data digests.
    pub async fn nvme_controller(&self, nqn: &str) -> initiator_bench::nvme::NvmeController {
        use initiator_bench::nvme::{NvmeController, NvmeOptions, NvmeUrl};
        let url = NvmeUrl::parse(&format!("nvme://{}/{nqn}/1", self.nvme.unwrap())).unwrap();
        let o = NvmeOptions {
            digests: nvme::tcp::Digests {
                header: true,
                data: true,
            },
            ..NvmeOptions::default()
        };
        NvmeController::connect(&url, &o).await.expect("connect")
    }

    /// Starts targetd with `server` (lines) added to its `[server]` table, under `manager`
    /// when one is given (its `NOTIFY_SOCKET`, and what its store holds passed).
    pub fn start_with(server: &str, manager: Option<&Manager>) -> Program {
        let dir = tempfile::tempdir().unwrap();
        let socket = dir.path().join("admin.sock");
        let text = format!(
            "[server]\nportals = [\"127.0.0.1:0\"]\nadmin_socket = \"{}\"\nreactors = 2\n\
             nop_interval = 0\n{server}\n\n[[targets]]\nname = \"{TARGET}\"\n\n\
             [[targets.luns]]\nlun = 0\nbackend = \"file\"\npath = \"disk.img\"\n\
             size = \"64MiB\"\n",
            socket.display()
        );
        std::fs::write(dir.path().join("config.toml"), text).unwrap();
        Program::spawned(dir, socket, manager)
    }

    /// Starts targetd on the config `config(admin socket)` (its admin socket in the
    /// program's directory), under `manager` when one is given.
    pub fn start_config(
        config: impl FnOnce(&Path) -> String,
        manager: Option<&Manager>,
    ) -> Program {
        let dir = tempfile::tempdir().unwrap();
        let socket = dir.path().join("admin.sock");
        std::fs::write(dir.path().join("config.toml"), config(&socket)).unwrap();
        Program::spawned(dir, socket, manager)
    }

    fn spawned(
        dir: tempfile::TempDir,
        socket: std::path::PathBuf,
        manager: Option<&Manager>,
    ) -> Program {
        let (child, addr, nvme) = spawn(dir.path(), manager);
        Program {
            child,
            addr,
            nvme,
            socket,
            dir,
        }
    }

    /// Starts targetd again on the same config (the previous one has ended), under
    /// `manager` as [`start_with`](Self::start_with) does: `systemctl restart`'s start.
    pub fn start_again(&mut self, manager: Option<&Manager>) {
        let (child, addr, nvme) = spawn(self.dir.path(), manager);
        self.child = child;
        self.addr = addr;
        self.nvme = nvme;
    }

    /// What targetd logged so far (its stderr, in `targetd.log` of its directory).
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("targetd.log")).unwrap_or_default()
    }

    pub async fn session(&self, o: LoginOptions) -> Session {
        let url = format!("iscsi://{}/{TARGET}/0", self.addr);
        Session::connect(&initiator_bench::IscsiUrl::parse(&url).unwrap(), o)
            .await
            .expect("login")
    }

    /// `targetctl upgrade ARGS`: its JSON answer, or what it said on failure.
    pub async fn upgrade(&self, args: &[&str]) -> Result<serde_json::Value, String> {
        let mut c = std::process::Command::new(env!("CARGO_BIN_EXE_targetctl"));
        c.arg("--socket")
            .arg(&self.socket)
            .args(["--json", "upgrade"]);
        c.args(args);
        let out = tokio::task::spawn_blocking(move || c.output().unwrap())
            .await
            .unwrap();
        match out.status.success() {
            true => Ok(serde_json::from_slice(&out.stdout).expect("JSON")),
            // With --json the error is a JSON object on stdout.
            false => Err(format!(
                "{}{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            )),
        }
    }

    /// `targetctl status`, from whichever process serves the admin socket.
    pub fn status(&self) -> serde_json::Value {
        self.targetctl("status")
    }

    /// `targetctl sessions`.
    pub fn sessions(&self) -> serde_json::Value {
        self.targetctl("sessions")
    }

    /// `targetctl --json COMMAND`'s answer.
    pub fn targetctl(&self, command: &str) -> serde_json::Value {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_targetctl"))
            .arg("--socket")
            .arg(&self.socket)
            .args(["--json", command])
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        serde_json::from_slice(&out.stdout).unwrap()
    }

    /// A script standing in for a new binary: `--check` runs the real one; the start runs
    /// `start` (a shell command line; `$@` are targetd's arguments).
    pub fn binary(&self, name: &str, start: &str) -> String {
        use std::os::unix::fs::PermissionsExt;
        let path = self.dir.path().join(name);
        let real = env!("CARGO_BIN_EXE_targetd");
        let script =
            format!("#!/bin/sh\nif [ \"$1\" = --check ]; then exec {real} \"$@\"; fi\n{start}\n");
        std::fs::write(&path, script).unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).unwrap();
        path.display().to_string()
    }
}

impl Drop for Program {
    /// A test that failed leaves no targetd behind: the one serving the admin socket now (a
    /// successor, maybe) and the first.
    fn drop(&mut self) {
        let serving = std::process::Command::new(env!("CARGO_BIN_EXE_targetctl"))
            .arg("--socket")
            .arg(&self.socket)
            .args(["--json", "status"])
            .output()
            .ok()
            .and_then(|o| serde_json::from_slice::<serde_json::Value>(&o.stdout).ok())
            .and_then(|s| s["pid"].as_u64());
        if let Some(pid) = serving {
            terminate(pid);
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Whether process `pid` runs (not ended, not a zombie waiting to be reaped).
pub fn running(pid: u64) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|s| {
        s.rsplit_once(") ")
            .is_some_and(|(_, rest)| !rest.starts_with('Z'))
    })
}

/// Stops the targetd process `pid` (SIGTERM: a drain) and waits for it to end.
pub fn terminate(pid: u64) {
    let _ = std::process::Command::new("kill")
        .args(["-TERM", &pid.to_string()])
        .status();
    let until = std::time::Instant::now() + Duration::from_secs(30);
    while running(pid) && std::time::Instant::now() < until {
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Starts targetd on `dir`'s config.toml (under `manager`: its notification socket, and
/// what its store holds passed as systemd passes it), its stderr appended to `targetd.log`
/// there; returns it, the portal it says it listens on and its first NVMe/TCP portal.
fn spawn(
    dir: &Path,
    manager: Option<&Manager>,
) -> (
    std::process::Child,
    std::net::SocketAddr,
    Option<std::net::SocketAddr>,
) {
    use std::io::BufRead;
    let log = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(dir.join("targetd.log"))
        .unwrap();
    let binary = env!("CARGO_BIN_EXE_targetd");
    let mut passed = Vec::new();
    let mut command = match manager {
        Some(m) => {
            let (c, fds) = m.command(binary);
            passed = fds;
            c
        }
        None => std::process::Command::new(binary),
    };
    let mut child = command
        .arg(dir.join("config.toml"))
        .current_dir(dir)
        .env(
            "RUST_LOG",
            std::env::var("TEST_TARGETD_LOG").unwrap_or("info".into()),
        )
        .stdout(std::process::Stdio::piped())
        .stderr(log)
        .spawn()
        .unwrap();
    // The child has its copies.
    drop(passed);
    let mut lines = std::io::BufReader::new(child.stdout.take().unwrap()).lines();
    let (mut addr, mut nvme) = (None, None);
    // Its last line of the start says the engine.
    loop {
        let line = match lines.next() {
            Some(line) => line.unwrap(),
            None => panic!(
                "targetd ended before it listened: {}",
                std::fs::read_to_string(dir.join("targetd.log")).unwrap_or_default()
            ),
        };
        if let Some(a) = line.strip_prefix("targetd: listening on ") {
            addr = addr.or(Some(a.parse().unwrap()));
        }
        if let Some(a) = line.strip_prefix("targetd: NVMe/TCP on ") {
            nvme = nvme.or(Some(a.parse().unwrap()));
        }
        if line.starts_with("targetd: engine ") {
            break;
        }
    }
    let addr = addr.expect("targetd said where it listens");
    // The rest (its successors' too: they inherit the pipe) is read and dropped.
    std::thread::spawn(move || lines.for_each(drop));
    (child, addr, nvme)
}

/// A stand-in for systemd's service manager as targetd meets it: the datagram socket
/// `NOTIFY_SOCKET` names, read on a thread of its own, which keeps what `FDSTORE=1` puts in
/// its store under each `FDNAME=`, takes out what `FDSTOREREMOVE=1` names, answers
/// `BARRIER=1` by closing the pipe it came with, and keeps every other line said; and the
/// start that passes the store to the next process (`LISTEN_FDS`, `LISTEN_FDNAMES`,
/// `LISTEN_PID`, the descriptors from 3 on), as sd_listen_fds(3) says.
pub struct Manager {
    pub path: PathBuf,
    state: Arc<Mutex<Kept>>,
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
    /// The store's size told to the service (`$FDSTORE`), when set.
    size: Option<usize>,
    _dir: tempfile::TempDir,
}

#[derive(Default)]
struct Kept {
    store: Vec<(String, OwnedFd)>,
    said: Vec<String>,
}

impl Manager {
    /// A manager whose store's size the service is told (`$FDSTORE`, as systemd 254 and
    /// later say it).
    pub fn with_store_size(size: usize) -> Manager {
        let mut m = Manager::new();
        m.size = Some(size);
        m
    }

    pub fn new() -> Manager {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("notify.sock");
        let socket = std::os::unix::net::UnixDatagram::bind(&path).unwrap();
        socket
            .set_read_timeout(Some(Duration::from_millis(50)))
            .unwrap();
        let state = Arc::new(Mutex::new(Kept::default()));
        let stop = Arc::new(AtomicBool::new(false));
        let thread = {
            let (state, stop) = (state.clone(), stop.clone());
            std::thread::spawn(move || {
                while !stop.load(Relaxed) {
                    if let Some((text, fds)) = receive(&socket) {
                        handle(&mut state.lock().unwrap(), &text, fds);
                    }
                }
            })
        };
        Manager {
            path,
            state,
            stop,
            thread: Some(thread),
            size: None,
            _dir: dir,
        }
    }

    /// The names in the store, in the order they went in.
    pub fn names(&self) -> Vec<String> {
        let kept = self.state.lock().unwrap();
        kept.store.iter().map(|(n, _)| n.clone()).collect()
    }

    /// Every line said besides the store's and the barrier's (`READY=1`, `STOPPING=1`).
    pub fn said(&self) -> Vec<String> {
        self.state.lock().unwrap().said.clone()
    }

    /// Puts `fd` in the store under `name` in place of what is there under it.
    pub fn replace(&self, name: &str, fd: OwnedFd) {
        let mut kept = self.state.lock().unwrap();
        kept.store.retain(|(n, _)| n != name);
        kept.store.push((name.to_string(), fd));
    }

    /// Empties the store, closing what it holds: what systemd does when the service stops
    /// and no start follows.
    pub fn empty(&self) {
        self.state.lock().unwrap().store.clear();
    }

    /// The command that starts `binary` with the store passed, and the descriptors it
    /// passes (close them once it started). A shell moves them to 3 on, sets `LISTEN_PID`
    /// to its own process id, which `exec` keeps, and runs `binary`.
    fn command(&self, binary: &str) -> (std::process::Command, Vec<OwnedFd>) {
        use rustix::io::{fcntl_dupfd_cloexec, fcntl_setfd, FdFlags};
        let kept = self.state.lock().unwrap();
        let mut passed = Vec::new();
        let mut moves = String::new();
        let mut closes = String::new();
        for (i, (_, fd)) in kept.store.iter().enumerate() {
            // Above any number the targets 3.. take, and inherited (no close-on-exec).
            let high = fcntl_dupfd_cloexec(fd, 200).unwrap();
            fcntl_setfd(&high, FdFlags::empty()).unwrap();
            let n = std::os::fd::AsRawFd::as_raw_fd(&high);
            moves.push_str(&format!(" {}<&{n}", 3 + i));
            closes.push_str(&format!(" {n}<&-"));
            passed.push(high);
        }
        let names: Vec<&str> = kept.store.iter().map(|(n, _)| n.as_str()).collect();
        let script = match names.is_empty() {
            true => "exec \"$0\" \"$@\"".to_string(),
            false => format!(
                "exec{moves}; exec{closes}; LISTEN_PID=$$ LISTEN_FDS={} LISTEN_FDNAMES={} exec \"$0\" \"$@\"",
                names.len(),
                names.join(":")
            ),
        };
        let mut c = std::process::Command::new("bash");
        c.arg("-c")
            .arg(script)
            .arg(binary)
            .env("NOTIFY_SOCKET", &self.path);
        if let Some(size) = self.size {
            c.env("FDSTORE", size.to_string());
        }
        (c, passed)
    }
}

impl Drop for Manager {
    fn drop(&mut self) {
        self.stop.store(true, Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// One datagram and the descriptors that came with it; `None` when none came in time.
fn receive(socket: &std::os::unix::net::UnixDatagram) -> Option<(String, Vec<OwnedFd>)> {
    use rustix::net::{recvmsg, RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags};
    let mut buf = vec![0u8; 4096];
    let mut space = vec![std::mem::MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(253))];
    let mut control = RecvAncillaryBuffer::new(&mut space);
    let mut iov = [std::io::IoSliceMut::new(&mut buf)];
    let got = recvmsg(
        socket.as_fd(),
        &mut iov,
        &mut control,
        RecvFlags::CMSG_CLOEXEC,
    )
    .ok()?;
    let mut fds = Vec::new();
    for m in control.drain() {
        if let RecvAncillaryMessage::ScmRights(r) = m {
            fds.extend(r);
        }
    }
    Some((String::from_utf8_lossy(&buf[..got.bytes]).into_owned(), fds))
}

/// What systemd does with one notification.
fn handle(kept: &mut Kept, text: &str, fds: Vec<OwnedFd>) {
    let lines: Vec<&str> = text.lines().collect();
    let name = lines
        .iter()
        .find_map(|l| l.strip_prefix("FDNAME="))
        .unwrap_or("stored")
        .to_string();
    if lines.contains(&"FDSTORE=1") {
        kept.store
            .extend(fds.into_iter().map(|fd| (name.clone(), fd)));
    } else if lines.contains(&"FDSTOREREMOVE=1") {
        kept.store.retain(|(n, _)| *n != name);
    } else if lines.contains(&"BARRIER=1") {
        // Everything before it was read: closing the pipe says so.
        drop(fds);
    } else {
        kept.said.extend(lines.iter().map(|l| l.to_string()));
    }
}
