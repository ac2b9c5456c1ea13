//! `targetctl upgrade`, the running process's half: it starts the new binary (its `--check`
//! first), hands it every listening socket, parks every iSCSI/TCP session
//! ([`crate::iscsi::handover::park_sessions`]), hands them over with the units' states, and
//! lets go of them only once the successor says it took them all in. Until then nothing is
//! lost: a successor that fails to start, crashes, refuses the state or takes too long is
//! killed, and this process serves every session on where it stopped, accepting again.
//!
//! The handshake over a UNIX socket the successor connects to (its path on the successor's
//! command line, `targetd --take-over PATH CONFIG`; the successor's half is
//! [`crate::takeover`]), every message a frame of [`crate::handover`]:
//!
//! 1. this process: the listening sockets (`send_listeners`);
//! 2. the successor, once started on them: [`Step::Ready`];
//! 3. this process holds its accept loops, parks, and sends the units and sessions;
//! 4. the successor: [`Step::Adopted`] (taken in, nothing read yet) or [`Step::Refused`];
//! 5. this process: [`Step::Released`]; the successor says [`Step::Serving`] before it reads
//!    from them; this process lets go of them and stops, leaving the admin socket's file and
//!    the listeners to the successor. The successor's end without `Serving` (a crash), or
//!    anything else, and the sessions serve on here.

use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::handover::{
    receive_step, send_handover, send_listeners, send_step, FrameError, ReceiveError, Step,
};
use crate::iscsi::handover::{park_sessions, ParkError};
use crate::registry::Registry;
use crate::Config;

/// How an upgrade runs.
#[derive(Debug, Clone)]
pub struct UpgradeOptions {
    /// The new binary; the one this process runs when `None`.
    pub binary: Option<PathBuf>,
    /// Also when units whose data lives in this process (memory LUNs) would come up empty in
    /// the successor, or what targetctl made live and nobody saved would be lost.
    pub force: bool,
    /// How long the successor may take to start (its check, its units, its reactors).
    pub start_within: Duration,
    /// How long the sessions may take to park (their commands in flight to finish).
    pub park_within: Duration,
}

impl Default for UpgradeOptions {
    fn default() -> UpgradeOptions {
        UpgradeOptions {
            binary: None,
            force: false,
            start_within: Duration::from_secs(60),
            park_within: Duration::from_secs(10),
        }
    }
}

/// What an upgrade did.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Upgraded {
    /// The successor's process id.
    pub pid: u32,
    /// Its binary.
    pub binary: PathBuf,
    /// iSCSI sessions it serves now, on the same connections.
    pub sessions: usize,
    /// NVMe/TCP controllers it serves now, on the same connections.
    pub controllers: usize,
    /// How long the sessions took to park, in milliseconds.
    pub parked_ms: f64,
    /// How long the initiators got no answer: from the park's start to the successor
    /// serving, in milliseconds.
    pub paused_ms: f64,
    /// WRITEs whose initiators still owed their data at the park's deadline: aborted (TASK
    /// ABORTED), for the initiators to send again.
    pub aborted_writes: u64,
}

/// Why an upgrade did not happen; this process serves on as before.
#[derive(Debug, thiserror::Error)]
pub enum UpgradeError {
    /// Another upgrade is under way.
    #[error("an upgrade is under way already")]
    Busy,
    /// This process was not started as targetd, and no binary was named.
    #[error("no binary to upgrade to: name it (targetctl upgrade --binary PATH)")]
    NoBinary,
    /// The upgrade would lose something, or cannot be done here.
    #[error("{0}")]
    Refused(String),
    /// The new binary refused the config (`--check`).
    #[error("{binary} --check refused the config: {output}")]
    Check {
        /// The binary.
        binary: String,
        /// What it said.
        output: String,
    },
    /// The new binary could not be run, or the handover socket made.
    #[error("{0}")]
    Io(#[from] std::io::Error),
    /// The successor exited before it served.
    #[error("the new targetd exited ({0}) before it served")]
    Exited(String),
    /// The successor did not get as far as `stage` in time.
    #[error("the new targetd took too long ({0})")]
    Timeout(&'static str),
    /// The sessions did not park.
    #[error("the sessions did not park: {0}")]
    Park(#[from] ParkError),
    /// The handshake broke (the successor crashed or sent what is not a step).
    #[error("the handover broke: {0}")]
    Handover(#[from] ReceiveError),
    /// The successor refused.
    #[error("the new targetd refused: {0}")]
    SuccessorRefused(String),
    /// The successor said what it should not have said then.
    #[error("the new targetd answered {0:?} out of turn")]
    OutOfTurn(Step),
}

impl From<FrameError> for UpgradeError {
    fn from(e: FrameError) -> UpgradeError {
        UpgradeError::Handover(ReceiveError::Frame(e))
    }
}

/// Marks the upgrade over however it ends; unless it succeeded, this process accepts again.
struct Running<'r> {
    registry: &'r Registry,
    succeeded: bool,
}

impl Drop for Running<'_> {
    fn drop(&mut self) {
        if !self.succeeded {
            self.registry.succession.hold_accepting(false);
        }
        self.registry.succession.end();
    }
}

/// Upgrades this process to `options.binary`: see the module's documentation. On success the
/// successor serves every iSCSI/TCP session and listens on every portal; the caller answers
/// whoever asked, then [`crate::registry::succession::Succession::succeed`] stops this
/// process. On failure the successor is killed and everything serves on here.
pub async fn upgrade(
    registry: &Registry,
    options: UpgradeOptions,
) -> Result<Upgraded, UpgradeError> {
    if !registry.succession.begin() {
        return Err(UpgradeError::Busy);
    }
    let mut running = Running {
        registry,
        succeeded: false,
    };
    refusals(registry, options.force)?;
    let (binary, args) = match (options.binary.clone(), registry.succession.executable()) {
        (Some(b), Some((_, args))) => (b, args),
        (Some(b), None) => (b, Vec::new()),
        (None, Some((b, args))) => (b, args),
        (None, None) => return Err(UpgradeError::NoBinary),
    };
    let config = registry.config_path.clone();
    let deadline = Instant::now() + options.start_within;
    check(&binary, &config, options.start_within).await?;
    let path = socket_path(registry);
    let listener = Link::bind(&path)?;
    let mut child = tokio::process::Command::new(&binary)
        .args(&args)
        .arg("--take-over")
        .arg(&path)
        .arg(&config)
        .stdin(Stdio::null())
        .spawn()?;
    let pid = child.id().unwrap_or(0);
    tracing::info!(pid, binary = %binary.display(), "upgrade: the new targetd started");
    let result = hand_over(registry, &listener, &mut child, deadline, &options).await;
    drop(listener);
    match result {
        Ok(Moved {
            sessions,
            controllers,
            parked,
            paused,
            aborted,
        }) => {
            // The successor accepts from here; this process stops.
            running.succeeded = true;
            tracing::info!(
                pid,
                sessions,
                controllers,
                aborted,
                "upgrade: the new targetd serves (parked in {parked:?}, initiators paused \
                 {paused:?})"
            );
            // Its main process now, for a service manager that watches it.
            crate::notify::notify(&format!("MAINPID={pid}\nREADY=1"));
            Ok(Upgraded {
                pid,
                binary,
                sessions,
                controllers,
                parked_ms: parked.as_secs_f64() * 1e3,
                paused_ms: paused.as_secs_f64() * 1e3,
                aborted_writes: aborted,
            })
        }
        Err(e) => {
            tracing::error!(pid, "upgrade failed, serving on: {e}");
            let _ = child.start_kill();
            // The successor may have taken this gateway's place in the cluster already.
            if let Some(cluster) = registry.target_env.cluster.clone() {
                let _ = tokio::task::spawn_blocking(move || cluster.list_again()).await;
            }
            // Reaped in the background: a successor killed mid-start may take a moment.
            tokio::spawn(async move {
                let _ = child.wait().await;
            });
            Err(e)
        }
    }
}

/// What an upgrade refuses to do unless forced: lose data or changes. (A gateway of a
/// cluster is upgraded too: its successor takes its place at the handover.)
fn refusals(registry: &Registry, force: bool) -> Result<(), UpgradeError> {
    match Loss::of(registry) {
        None => Ok(()),
        Some(_) if force => Ok(()),
        Some(loss) => Err(UpgradeError::Refused(format!("{loss}; or --force"))),
    }
}

/// What a process that takes this one's sessions over (an upgrade's successor, the next
/// start after a restart through the service manager's store) would lose or get wrong.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Loss {
    /// Memory units keep their data in this process: the next one starts them empty, under
    /// sessions that wrote to them.
    Memory(Vec<String>),
    /// What targetctl made live and nobody saved: the next process reads the file.
    Unsaved(Vec<String>),
    /// The config file does not load (the next process would not start).
    Config(String),
}

impl Loss {
    /// The first loss a takeover from `registry` would bring, if any.
    pub fn of(registry: &Registry) -> Option<Loss> {
        let running = registry.config();
        let memory: Vec<String> = running
            .targets
            .iter()
            .flat_map(|t| {
                t.luns
                    .iter()
                    .filter(|l| l.backend == "memory")
                    .map(move |l| format!("{} LUN {}", t.name, l.lun))
            })
            .chain(running.subsystems.iter().flat_map(|s| {
                s.namespaces
                    .iter()
                    .filter(|n| n.unit.backend == "memory")
                    .map(move |n| format!("{} namespace {}", s.nqn, n.nsid))
            }))
            .collect();
        drop(running);
        if !memory.is_empty() {
            return Some(Loss::Memory(memory));
        }
        let file = match Config::load(&registry.config_path) {
            Ok(f) => f,
            Err(e) => return Some(Loss::Config(e.to_string())),
        };
        let lost = registry.unsaved_missing_from(&file);
        (!lost.is_empty()).then_some(Loss::Unsaved(lost))
    }
}

impl std::fmt::Display for Loss {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Loss::Memory(units) => write!(
                f,
                "memory units keep their data in this process, and the next one would start \
                 them empty: {}",
                units.join(", ")
            ),
            Loss::Unsaved(what) => write!(
                f,
                "the next targetd reads the config file, which lacks what targetctl made live \
                 since the last save: {}; save it first (targetctl config save)",
                what.join(", ")
            ),
            Loss::Config(e) => write!(f, "the next targetd reads the config: {e}"),
        }
    }
}

/// Runs `binary --check config`: the new binary must accept the config before it starts.
async fn check(binary: &Path, config: &Path, within: Duration) -> Result<(), UpgradeError> {
    let run = tokio::process::Command::new(binary)
        .arg("--check")
        .arg(config)
        .stdin(Stdio::null())
        .kill_on_drop(true)
        .output();
    let out = tokio::time::timeout(within, run)
        .await
        .map_err(|_| UpgradeError::Timeout("checking the config"))?
        .map_err(|e| std::io::Error::new(e.kind(), format!("{}: {e}", binary.display())))?;
    if out.status.success() {
        return Ok(());
    }
    let mut output = String::from_utf8_lossy(&out.stderr).trim().to_string();
    if output.is_empty() {
        output = String::from_utf8_lossy(&out.stdout).trim().to_string();
    }
    if output.is_empty() {
        output = out.status.to_string();
    }
    Err(UpgradeError::Check {
        binary: binary.display().to_string(),
        output,
    })
}

/// Where the handover socket is made: beside the admin socket (a directory only the service's
/// user reaches), else in the temporary directory; named after this process.
fn socket_path(registry: &Registry) -> PathBuf {
    let admin = registry.started_server.admin_socket.clone();
    let dir = admin
        .parent()
        .filter(|d| !admin.as_os_str().is_empty() && !d.as_os_str().is_empty())
        .map(Path::to_path_buf)
        .unwrap_or_else(std::env::temp_dir);
    dir.join(format!("targetd-upgrade-{}.sock", std::process::id()))
}

/// The handover socket's listener; its file is removed when it is dropped.
struct Link {
    listener: tokio::net::UnixListener,
    path: PathBuf,
}

impl Link {
    fn bind(path: &Path) -> Result<Link, UpgradeError> {
        let _ = std::fs::remove_file(path);
        let listener = tokio::net::UnixListener::bind(path)
            .map_err(|e| std::io::Error::new(e.kind(), format!("{}: {e}", path.display())))?;
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600))?;
        Ok(Link {
            listener,
            path: path.to_path_buf(),
        })
    }
}

impl Drop for Link {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

/// What a handover moved.
struct Moved {
    /// iSCSI sessions.
    sessions: usize,
    /// NVMe/TCP controllers.
    controllers: usize,
    /// How long they took to park.
    parked: Duration,
    /// How long the initiators were paused.
    paused: Duration,
    /// WRITEs aborted at the park's deadline, still owed data-out.
    aborted: u64,
}

/// Steps 1 to 5 with the started `child`: what was handed over.
async fn hand_over(
    registry: &Registry,
    link: &Link,
    child: &mut tokio::process::Child,
    deadline: Instant,
    options: &UpgradeOptions,
) -> Result<Moved, UpgradeError> {
    let left = || deadline.saturating_duration_since(Instant::now());
    let me = rustix::process::geteuid().as_raw();
    let stream = loop {
        let stream = tokio::select! {
            accepted = link.listener.accept() => accepted?.0,
            status = child.wait() => return Err(UpgradeError::Exited(exit_text(status))),
            () = tokio::time::sleep(left()) => return Err(UpgradeError::Timeout("connecting")),
        };
        // The listening sockets go only to a process of this user (the socket's directory
        // should let no other in; the temporary directory would).
        match stream.peer_cred() {
            Ok(c) if c.uid() == me => break stream,
            Ok(c) => tracing::warn!(
                uid = c.uid(),
                "upgrade: a process of another user connected: closed"
            ),
            Err(e) => tracing::warn!("upgrade: a connection without credentials: {e}"),
        }
    };
    let stream = Arc::new(stream.into_std()?);
    stream.set_nonblocking(false)?;
    let listening = registry.listening_sockets()?;
    blocking(&stream, left(), move |s| {
        send_listeners(s, &listening).map_err(Into::into)
    })
    .await?;
    match blocking(&stream, left(), |s| Ok(receive_step(s)?)).await {
        Ok(Step::Ready) => {}
        Ok(Step::Refused(why)) => return Err(UpgradeError::SuccessorRefused(why)),
        Ok(other) => return Err(UpgradeError::OutOfTurn(other)),
        Err(e) => return Err(timed_out(e, "starting")),
    }
    // From here on new connections wait in the backlog, for whichever process serves next.
    registry.succession.hold_accepting(true);
    let paused = Instant::now();
    let mut parked = park_sessions(registry, options.park_within).await?;
    let parked_in = paused.elapsed();
    let handover = crate::handover::Handover {
        units: std::mem::take(&mut parked.units),
        sessions: std::mem::take(&mut parked.sessions),
        namespaces: std::mem::take(&mut parked.namespaces),
        controllers: std::mem::take(&mut parked.controllers),
    };
    let (sessions, controllers) = (handover.sessions.len(), handover.controllers.len());
    let count = sessions + controllers;
    let within = options.start_within;
    blocking(&stream, within, move |s| {
        send_handover(s, &handover).map_err(Into::into)
    })
    .await?;
    match blocking(&stream, within, |s| Ok(receive_step(s)?)).await {
        Ok(Step::Adopted(n)) if n as usize == count => {}
        Ok(Step::Refused(why)) => return Err(UpgradeError::SuccessorRefused(why)),
        Ok(other) => return Err(UpgradeError::OutOfTurn(other)),
        Err(e) => return Err(timed_out(e, "taking the sessions in")),
    }
    // From here the successor may serve them. It says so before it reads from them; what it
    // sent before it died arrives before its end: its end without `Serving` first means it
    // read nothing, and the sessions serve on here.
    blocking(&stream, within, |s| Ok(send_step(s, &Step::Released)?)).await?;
    let answer = match blocking(&stream, within, |s| Ok(receive_step(s)?)).await {
        Err(e) if is_timeout(&e) => {
            // No word in time: once it is dead, whatever it said before is in the socket.
            let _ = child.start_kill();
            let _ = child.wait().await;
            blocking(&stream, within, |s| Ok(receive_step(s)?)).await
        }
        other => other,
    };
    match answer {
        Ok(Step::Serving) => {}
        Ok(other) => return Err(UpgradeError::OutOfTurn(other)),
        Err(e) => return Err(e),
    }
    // The successor serves them: each connection here ends without a word.
    let aborted = parked.aborted;
    parked.release();
    Ok(Moved {
        sessions,
        controllers,
        parked: parked_in,
        paused: paused.elapsed(),
        aborted,
    })
}

/// Runs a blocking step of the handshake on a thread of its own, `within` at most for each
/// read or write.
async fn blocking<T: Send + 'static>(
    stream: &Arc<UnixStream>,
    within: Duration,
    f: impl FnOnce(&UnixStream) -> Result<T, UpgradeError> + Send + 'static,
) -> Result<T, UpgradeError> {
    let stream = stream.clone();
    let within = within.max(Duration::from_millis(1));
    tokio::task::spawn_blocking(move || {
        stream.set_read_timeout(Some(within))?;
        stream.set_write_timeout(Some(within))?;
        f(&stream)
    })
    .await
    .map_err(|e| UpgradeError::Io(std::io::Error::other(e.to_string())))?
}

/// A read that ran out of time is the successor's delay at `stage`.
fn timed_out(e: UpgradeError, stage: &'static str) -> UpgradeError {
    if is_timeout(&e) {
        return UpgradeError::Timeout(stage);
    }
    e
}

/// Whether `e` is a read or write of the handshake that ran out of time.
fn is_timeout(e: &UpgradeError) -> bool {
    matches!(
        e,
        UpgradeError::Handover(ReceiveError::Frame(FrameError::Io(io)))
            if matches!(
                io.kind(),
                std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
            )
    )
}

fn exit_text(status: std::io::Result<std::process::ExitStatus>) -> String {
    match status {
        Ok(s) => s.to_string(),
        Err(e) => e.to_string(),
    }
}
