//! The daemon: state shared by every reactor, the listeners, and the life cycle (start,
//! reload, drain on SIGTERM).

use std::collections::HashMap;
use std::future::Future;
use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError, RwLock, RwLockReadGuard};
use std::time::{Duration, Instant};

use backend::{ArenaConfig, EngineChoice};
use iscsi_pdu::negotiation::Settings;
use iscsi_pdu::text::TextParams;

use crate::config::{self, Config};
use crate::iscsi::connection::LOGOUT_GRACE;
use crate::iscsi::session::{Control, Request, Sessions};
use crate::reactor;
use crate::target::{Target, PORTAL_GROUP};

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// What every reactor, the listeners and the admin interface share.
pub struct Shared {
    config: RwLock<Config>,
    /// The file the config came from (SIGHUP reads it again).
    pub config_path: PathBuf,
    targets: RwLock<Vec<Arc<Target>>>,
    /// Normal sessions.
    pub sessions: Sessions,
    /// When the daemon started.
    pub started: Instant,
    stopping: AtomicBool,
    controls: Mutex<HashMap<u64, Arc<Control>>>,
    /// The I/O engine the reactors run, as they reported it.
    pub engine: Mutex<String>,
    refusals: Mutex<(Option<Instant>, u64)>,
    /// The listeners' addresses.
    pub portals: Mutex<Vec<SocketAddr>>,
}

impl Shared {
    /// The running config.
    pub fn config(&self) -> RwLockReadGuard<'_, Config> {
        self.config.read().unwrap_or_else(PoisonError::into_inner)
    }

    /// What the target offers in login negotiation.
    pub fn settings(&self) -> Settings {
        self.config().settings()
    }

    /// The CmdSN window of new sessions.
    pub fn window(&self) -> u32 {
        self.config().iscsi.cmdsn_window
    }

    /// Whether the daemon is shutting down.
    pub fn stopping(&self) -> bool {
        self.stopping.load(Ordering::SeqCst)
    }

    /// A target by name (iSCSI names compare without case).
    pub fn target(&self, name: &str) -> Option<Arc<Target>> {
        self.targets()
            .into_iter()
            .find(|t| t.name.eq_ignore_ascii_case(name))
    }

    /// Every target.
    pub fn targets(&self) -> Vec<Arc<Target>> {
        self.targets
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// Records a live connection's control.
    pub fn register(&self, id: u64, control: Arc<Control>) {
        lock(&self.controls).insert(id, control);
    }

    /// Forgets a connection.
    pub fn unregister(&self, id: u64) {
        lock(&self.controls).remove(&id);
    }

    /// Connections alive now.
    pub fn connection_count(&self) -> usize {
        lock(&self.controls).len()
    }

    fn request_all(&self, r: Request) {
        for c in lock(&self.controls).values() {
            c.request(r);
        }
    }

    /// Logs a refused login, at most once a second (a scanner must not flood the log).
    pub fn refused(&self, peer: SocketAddr, initiator: &str, target: &str, reason: &str) {
        let mut r = lock(&self.refusals);
        let now = Instant::now();
        if r.0
            .is_some_and(|t| now.duration_since(t) < Duration::from_secs(1))
        {
            r.1 += 1;
            return;
        }
        let suppressed = std::mem::take(&mut r.1);
        r.0 = Some(now);
        tracing::warn!(%peer, initiator, target, suppressed, "login refused: {reason}");
    }

    /// The SendTargets answer for `value` (RFC 7143 section 12.3 and appendix C): `All`, a
    /// target name, or empty for the session's own target; only targets `initiator` may reach.
    pub fn send_targets(
        &self,
        initiator: &str,
        peer: IpAddr,
        local: SocketAddr,
        value: &str,
        session_target: Option<&str>,
    ) -> TextParams {
        let mut out = TextParams::new();
        let wanted = |name: &str| match value {
            "All" => session_target.is_none_or(|s| s.eq_ignore_ascii_case(name)),
            "" => session_target.is_some_and(|s| s.eq_ignore_ascii_case(name)),
            v => v.eq_ignore_ascii_case(name),
        };
        let portals = lock(&self.portals).clone();
        for t in self.targets() {
            if !wanted(&t.name) || !t.admits(initiator, peer) {
                continue;
            }
            out.push("TargetName", t.name.clone());
            for p in &portals {
                // A wildcard listener is reported by the address this connection reached.
                let ip = if p.ip().is_unspecified() {
                    local.ip()
                } else {
                    p.ip()
                };
                let addr = SocketAddr::new(ip, p.port());
                out.push("TargetAddress", format!("{addr},{PORTAL_GROUP}"));
            }
        }
        out
    }

    /// Applies a changed config while running: targets and LUNs added, removed or changed,
    /// access rules and negotiation settings for new logins. Returns what changed.
    pub fn apply(&self, new: Config) -> Result<Vec<String>, String> {
        new.validate().map_err(|(k, r)| format!("{k}: {r}"))?;
        let old = self.config().clone();
        let mut changes = Vec::new();
        for key in [
            ("server.portals", old.server.portals != new.server.portals),
            (
                "server.reactors",
                old.server.reactors != new.server.reactors,
            ),
            ("server.engine", old.server.engine != new.server.engine),
            (
                "server.admin_socket",
                old.server.admin_socket != new.server.admin_socket,
            ),
            (
                "server.metrics_listen",
                old.server.metrics_listen != new.server.metrics_listen,
            ),
        ] {
            if key.1 {
                changes.push(format!("{}: takes effect at the next start", key.0));
            }
        }
        let mut targets = self.targets();
        // Removed targets: their sessions end.
        targets.retain(|t| {
            let keep = new
                .targets
                .iter()
                .any(|n| n.name.eq_ignore_ascii_case(&t.name));
            if !keep {
                for s in self.sessions.all() {
                    if Arc::ptr_eq(&s.target, t) {
                        s.close();
                    }
                }
                changes.push(format!("target {} removed", t.name));
            }
            keep
        });
        for nt in &new.targets {
            let Some(t) = targets
                .iter()
                .find(|t| t.name.eq_ignore_ascii_case(&nt.name))
            else {
                let t = Target::new(nt).map_err(|(k, r)| format!("target {} {k}: {r}", nt.name))?;
                targets.push(Arc::new(t));
                changes.push(format!("target {} added", nt.name));
                continue;
            };
            let ot = t
                .config
                .read()
                .unwrap_or_else(PoisonError::into_inner)
                .clone();
            for ol in &ot.luns {
                if !nt.luns.iter().any(|l| l.lun == ol.lun) {
                    t.remove_lun(ol.lun)?;
                    changes.push(format!("{} LUN {} removed", nt.name, ol.lun));
                }
            }
            for nl in &nt.luns {
                match ot.luns.iter().find(|l| l.lun == nl.lun) {
                    None => {
                        t.add_lun(nl, Arc::default())?;
                        changes.push(format!("{} LUN {} added", nt.name, nl.lun));
                    }
                    Some(ol) if ol == nl => {}
                    Some(ol) if only_size_differs(ol, nl) => {
                        let bytes = nl.size.map_or(0, |s| s.0);
                        t.resize_lun(nl.lun, bytes)?;
                        changes.push(format!(
                            "{} LUN {} resized to {bytes} bytes",
                            nt.name, nl.lun
                        ));
                    }
                    Some(_) => {
                        let stats = t.lun(nl.lun).map(|l| l.stats.clone()).unwrap_or_default();
                        t.remove_lun(nl.lun)?;
                        t.add_lun(nl, stats)?;
                        changes.push(format!("{} LUN {} replaced", nt.name, nl.lun));
                    }
                }
            }
            let rules_changed = ot.initiators != nt.initiators
                || ot.networks != nt.networks
                || ot.chap != nt.chap
                || ot.mutual_chap != nt.mutual_chap;
            if rules_changed {
                changes.push(format!("{} access rules changed (for new logins)", nt.name));
            }
            *t.config.write().unwrap_or_else(PoisonError::into_inner) = nt.clone();
        }
        if old.iscsi != new.iscsi {
            changes.push("iscsi settings changed (for new logins)".into());
        }
        *self.targets.write().unwrap_or_else(PoisonError::into_inner) = targets;
        *self.config.write().unwrap_or_else(PoisonError::into_inner) = new;
        Ok(changes)
    }
}

fn only_size_differs(a: &config::Lun, b: &config::Lun) -> bool {
    let mut a = a.clone();
    a.size = b.size;
    &a == b
}

/// Why the daemon could not start: the config key at fault and the reason.
#[derive(Debug, thiserror::Error)]
#[error("{key}: {reason}")]
pub struct StartError {
    /// The key (e.g. `server.portals[0]`).
    pub key: String,
    /// Why.
    pub reason: String,
}

/// A started daemon: listening, reactors running.
pub struct Server {
    shared: Arc<Shared>,
    listeners: Vec<std::net::TcpListener>,
    admin: Option<(std::os::unix::net::UnixListener, PathBuf)>,
    metrics: Option<std::net::TcpListener>,
    reactors: Vec<reactor::Handle>,
    threads: Vec<std::thread::JoinHandle<()>>,
}

impl Server {
    /// Opens every logical unit, binds every portal and the admin socket, starts the reactors.
    pub fn start(config: Config, config_path: PathBuf) -> Result<Server, StartError> {
        let fail = |key: String, reason: String| StartError { key, reason };
        let mut targets = Vec::new();
        for (i, t) in config.targets.iter().enumerate() {
            let target = Target::new(t).map_err(|(k, r)| {
                let l = t
                    .luns
                    .iter()
                    .position(|l| format!("lun {}", l.lun) == k)
                    .unwrap_or(0);
                fail(format!("targets[{i}].luns[{l}]"), r)
            })?;
            targets.push(Arc::new(target));
        }
        let mut listeners = Vec::new();
        let mut portals = Vec::new();
        for (i, p) in config.server.portals.iter().enumerate() {
            let l = std::net::TcpListener::bind(p)
                .map_err(|e| fail(format!("server.portals[{i}]"), format!("{p}: {e}")))?;
            l.set_nonblocking(true)
                .map_err(|e| fail(format!("server.portals[{i}]"), e.to_string()))?;
            portals.push(
                l.local_addr()
                    .map_err(|e| fail(format!("server.portals[{i}]"), e.to_string()))?,
            );
            listeners.push(l);
        }
        let metrics = match &config.server.metrics_listen {
            Some(m) => {
                let l = std::net::TcpListener::bind(m)
                    .map_err(|e| fail("server.metrics_listen".into(), format!("{m}: {e}")))?;
                l.set_nonblocking(true)
                    .map_err(|e| fail("server.metrics_listen".into(), e.to_string()))?;
                Some(l)
            }
            None => None,
        };
        let admin = crate::admin::bind(&config.server.admin_socket)
            .map_err(|reason| fail("server.admin_socket".into(), reason))?;
        let engine = match config.server.engine.as_str() {
            "uring" => EngineChoice::Uring,
            "threads" => EngineChoice::Threads,
            _ => EngineChoice::Auto,
        };
        let count = match config.server.reactors {
            0 => std::thread::available_parallelism().map_or(1, |n| n.get()),
            n => n,
        };
        let shared = Arc::new(Shared {
            config: RwLock::new(config),
            config_path,
            targets: RwLock::new(targets),
            sessions: Sessions::default(),
            started: Instant::now(),
            stopping: AtomicBool::new(false),
            controls: Mutex::new(HashMap::new()),
            engine: Mutex::new(String::new()),
            refusals: Mutex::new((None, 0)),
            portals: Mutex::new(portals),
        });
        let settings = reactor::Settings {
            engine,
            arena: ArenaConfig::default(),
        };
        let mut reactors = Vec::new();
        let mut threads = Vec::new();
        for i in 0..count {
            let (h, t) = reactor::spawn(i, settings.clone(), shared.clone())
                .map_err(|e| fail("server.engine".into(), format!("reactor {i}: {e}")))?;
            if i == 0 {
                *lock(&shared.engine) = h.engine.clone();
            }
            reactors.push(h);
            threads.push(t);
        }
        Ok(Server {
            shared,
            listeners,
            admin,
            metrics,
            reactors,
            threads,
        })
    }

    /// The addresses the portals listen on.
    pub fn portals(&self) -> Vec<SocketAddr> {
        lock(&self.shared.portals).clone()
    }

    /// The shared state (for embedding and tests).
    pub fn shared(&self) -> Arc<Shared> {
        self.shared.clone()
    }

    /// Serves until `stop` resolves, then drains: no new connections, initiators asked to log
    /// out, in-flight commands finished within a bound, backends flushed. Call from a tokio
    /// runtime; the reactors run on their own threads.
    pub async fn run(self, stop: impl Future<Output = ()>) {
        let Server {
            shared,
            listeners,
            admin,
            metrics,
            reactors,
            threads,
        } = self;
        let mut tasks = tokio::task::JoinSet::new();
        for l in listeners {
            let reactors = reactors.clone();
            match tokio::net::TcpListener::from_std(l) {
                Ok(l) => {
                    tasks.spawn(accept(l, reactors));
                }
                Err(e) => tracing::error!("listener: {e}"),
            }
        }
        let admin_path = admin.as_ref().map(|(_, p)| p.clone());
        if let Some((l, _)) = admin {
            match tokio::net::UnixListener::from_std(l) {
                Ok(l) => {
                    tasks.spawn(crate::admin::serve(l, shared.clone()));
                }
                Err(e) => tracing::error!("admin socket: {e}"),
            }
        }
        if let Some(m) = metrics {
            match tokio::net::TcpListener::from_std(m) {
                Ok(l) => {
                    tasks.spawn(crate::admin::serve_metrics(l, shared.clone()));
                }
                Err(e) => tracing::error!("metrics listener: {e}"),
            }
        }
        stop.await;
        tracing::info!("stopping: asking initiators to log out");
        shared.stopping.store(true, Ordering::SeqCst);
        tasks.abort_all();
        shared.request_all(Request::Logout);
        let grace = Instant::now() + Duration::from_secs(u64::from(LOGOUT_GRACE) + 1);
        while !shared.sessions.all().is_empty() && Instant::now() < grace {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        shared.request_all(Request::Close);
        let bound = Instant::now() + Duration::from_secs(30);
        while shared.connection_count() > 0 && Instant::now() < bound {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        drop(reactors);
        let _ = tokio::task::spawn_blocking(move || {
            for t in threads {
                let _ = t.join();
            }
        })
        .await;
        flush(&shared);
        if let Some(p) = admin_path {
            let _ = std::fs::remove_file(p);
        }
        tracing::info!("stopped");
    }
}

/// Makes every file-backed unit's writes durable before exit.
fn flush(shared: &Shared) {
    for t in shared.targets() {
        for lun in t.lun_list() {
            if let crate::target::Storage::File(fc) = &lun.storage {
                let r = std::fs::OpenOptions::new()
                    .read(true)
                    .open(&fc.path)
                    .and_then(|f| f.sync_data());
                if let Err(e) = r {
                    tracing::error!(path = %fc.path.display(), "flush: {e}");
                }
            }
        }
    }
}

/// Accepts connections and hands each to the least loaded reactor.
async fn accept(listener: tokio::net::TcpListener, reactors: Vec<reactor::Handle>) {
    loop {
        let (stream, peer) = match listener.accept().await {
            Ok(s) => s,
            Err(e) => {
                tracing::warn!("accept: {e}");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let Some(r) = reactors
            .iter()
            .min_by_key(|r| r.connections.load(Ordering::Relaxed))
        else {
            return;
        };
        match stream.into_std() {
            Ok(s) => {
                tracing::debug!(%peer, reactor = r.index, "connection");
                if !r.assign(s) {
                    tracing::error!("reactor {} is gone", r.index);
                }
            }
            Err(e) => tracing::warn!("accept: {e}"),
        }
    }
}
