//! The daemon's life cycle: start (open the units, bind the portals, spawn the reactors),
//! serve, and drain on SIGTERM. What the parts share is the [`Registry`].

use std::future::Future;
use std::net::SocketAddr;
use std::os::fd::OwnedFd;
use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use backend::{ArenaConfig, EngineChoice};

use crate::config::Config;
use crate::control::Request;
use crate::handover::{ListenerKind, ListeningSocket};
use crate::iscsi::connection::LOGOUT_GRACE;
use crate::lock;
use crate::reactor;
use crate::registry::{Registry, StartAccepting};
use crate::target::{Target, TargetEnv};

/// How a starting gateway of a cluster of gateways (`[cluster]`) enters it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ClusterEntry {
    /// At once: it lists itself and answers "who is alive".
    Now,
    /// At once, with sessions kept through the service manager's store: the shared
    /// reservations they hold stay where no other gateway serves them.
    KeepingSessions,
    /// As an upgrade's successor: its predecessor stays the gateway until it has parked its
    /// sessions ([`Server::take_cluster_place`]).
    AtHandover,
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

/// The error about `targets[t].luns[l]`: a reason about one of the LUN's keys starts with it
/// ("pool: ..."), and the error names that key.
fn lun_error(t: usize, l: usize, reason: String) -> StartError {
    unit_error(&format!("targets[{t}].luns[{l}]"), reason)
}

/// The error about the unit (LUN or namespace) at `key`, naming the unit's key the reason
/// starts with.
fn unit_error(key: &str, reason: String) -> StartError {
    match reason
        .split_once(": ")
        .filter(|(f, _)| crate::config::LUN_KEYS.contains(f))
    {
        Some((f, why)) => StartError {
            key: format!("{key}.{f}"),
            reason: why.into(),
        },
        None => StartError {
            key: key.to_string(),
            reason,
        },
    }
}

/// What a check of a config before a start found (`targetd --check`).
#[derive(Debug, Default)]
pub struct Check {
    /// What the start would refuse.
    pub errors: Vec<StartError>,
    /// What it would not refuse but the administrator should know.
    pub warnings: Vec<StartError>,
}

/// A started daemon: listening, reactors running.
pub struct Server {
    registry: Arc<Registry>,
    listeners: Vec<std::net::TcpListener>,
    /// Each NVMe/TCP listener with what it serves and its configured address.
    nvme_listeners: Vec<(ListenerKind, String, std::net::TcpListener)>,
    admin: Option<(std::os::unix::net::UnixListener, PathBuf)>,
    /// The metrics endpoint's listener and its configured address.
    metrics: Option<(String, std::net::TcpListener)>,
    reactors: Vec<reactor::Handle>,
    threads: Vec<std::thread::JoinHandle<()>>,
}

impl Server {
    /// What [`start`](Self::start) would refuse of `config` that can be found without opening
    /// a unit for I/O, binding a portal or reaching a Ceph cluster: every file LUN's file (or
    /// the directory it would be created in) and whether this process may read and write it,
    /// the state directory and the admin socket's directory. It finds every such problem,
    /// not only the first; nothing is created or changed.
    pub fn check(config: &Config) -> Check {
        let mut check = Check::default();
        let fail = |key: &str, reason: String| StartError {
            key: key.into(),
            reason,
        };
        for (t, target) in config.targets.iter().enumerate() {
            for (l, lun) in target.luns.iter().enumerate() {
                if let Err(reason) = crate::store::check(lun) {
                    check.errors.push(lun_error(t, l, reason));
                }
            }
        }
        for (i, sub) in config.subsystems.iter().enumerate() {
            for (n, ns) in sub.namespaces.iter().enumerate() {
                if let Err(reason) = crate::store::check(&ns.unit) {
                    let key = format!("subsystems[{i}].namespaces[{n}]");
                    check.errors.push(unit_error(&key, reason));
                }
            }
        }
        let mut directory = |key: &str, dir: &std::path::Path, what: &str| {
            let dir = if dir.as_os_str().is_empty() {
                std::path::Path::new(".")
            } else {
                dir
            };
            if !dir.is_dir() {
                check.errors.push(fail(
                    key,
                    format!(
                        "{}: no such directory {what} (create it first)",
                        dir.display()
                    ),
                ));
            } else if let Err(e) = backend::file::may_create_in(dir) {
                check
                    .errors
                    .push(fail(key, format!("{}: {e} {what}", dir.display())));
            }
        };
        if let Some(state) = &config.server.state_dir {
            // Made at start as itself, never its parents.
            if state.exists() {
                directory("server.state_dir", state, "to keep reservations in");
            } else if let Some(parent) = state.parent() {
                directory(
                    "server.state_dir",
                    parent,
                    &format!("to make {} in", state.display()),
                );
            }
        }
        let socket = &config.server.admin_socket;
        if !socket.as_os_str().is_empty() {
            if let Some(parent) = socket.parent() {
                directory("server.admin_socket", parent, "to make the admin socket in");
            }
            match crate::admin::existing_socket(socket) {
                Err(reason) => check.errors.push(fail("server.admin_socket", reason)),
                Ok(Some(true)) => check.warnings.push(fail(
                    "server.admin_socket",
                    format!(
                        "{} is in use by a running targetd: a second one would not start",
                        socket.display()
                    ),
                )),
                Ok(_) => {}
            }
        }
        check
    }

    /// Opens every logical unit, binds every portal and the admin socket, starts the reactors.
    pub fn start(config: Config, config_path: PathBuf) -> Result<Server, StartError> {
        Server::start_inheriting(config, config_path, Vec::new(), ClusterEntry::Now)
    }

    /// Starts as [`start`](Self::start) does, but listens on the sockets of `inherited` (an
    /// upgrade's predecessor's, [`crate::upgrade`]) where one has the kind and configured
    /// address of a socket it would bind: the predecessor still holds them, so binding would
    /// fail, and a connection waiting in their backlog is not refused. Those not named by
    /// this config are closed. A gateway of a cluster enters it as `entry` says.
    pub fn start_inheriting(
        config: Config,
        config_path: PathBuf,
        inherited: Vec<ListeningSocket>,
        entry: ClusterEntry,
    ) -> Result<Server, StartError> {
        let mut inherited = Inherited(inherited);
        let fail = |key: String, reason: String| StartError { key, reason };
        let env = TargetEnv::start(&config).map_err(|(k, r)| fail(k, r))?;
        if let (Some(cluster), ClusterEntry::KeepingSessions) = (&env.cluster, entry) {
            cluster.keep_sessions();
        }
        let mut targets = Vec::new();
        for (i, t) in config.targets.iter().enumerate() {
            let target = Target::new(t, &env).map_err(|(k, r)| {
                if k.starts_with("server.") {
                    return fail(k, r);
                }
                let l = t
                    .luns
                    .iter()
                    .position(|l| format!("lun {}", l.lun) == k)
                    .unwrap_or(0);
                lun_error(i, l, r)
            })?;
            targets.push(target);
        }
        let mut subsystems = Vec::new();
        for (i, sub) in config.subsystems.iter().enumerate() {
            let store = env.reservation_store().map_err(|(k, r)| fail(k, r))?;
            let s = crate::nvme::NvmeSubsystem::new(sub, &config.nvme, store, &env).map_err(
                |(nsid, r)| {
                    let n = sub
                        .namespaces
                        .iter()
                        .position(|n| n.nsid == nsid)
                        .unwrap_or(0);
                    unit_error(&format!("subsystems[{i}].namespaces[{n}]"), r)
                },
            )?;
            subsystems.push(s);
        }
        let mut nvme_listeners = Vec::new();
        let nvme_portal_keys = config
            .server
            .nvme_portals
            .iter()
            .map(|p| ("nvme_portals", p));
        let discovery_keys = config
            .server
            .nvme_discovery_portals
            .iter()
            .map(|p| ("nvme_discovery_portals", p));
        let mut counts = std::collections::HashMap::new();
        for (list, p) in nvme_portal_keys.chain(discovery_keys) {
            let i = counts.entry(list).or_insert(0usize);
            let key = format!("server.{list}[{i}]");
            *i += 1;
            let kind = match list {
                "nvme_portals" => ListenerKind::NvmeTcp,
                _ => ListenerKind::NvmeDiscovery,
            };
            let l = inherited
                .listen(kind, p)
                .map_err(|e| fail(key.clone(), format!("{p}: {e}")))?;
            nvme_listeners.push((kind, p.clone(), l));
        }
        let mut listeners = Vec::new();
        let mut portals = Vec::new();
        for (i, p) in config.server.portals.iter().enumerate() {
            let l = inherited
                .listen(ListenerKind::Iscsi, p)
                .map_err(|e| fail(format!("server.portals[{i}]"), format!("{p}: {e}")))?;
            portals.push(
                l.local_addr()
                    .map_err(|e| fail(format!("server.portals[{i}]"), e.to_string()))?,
            );
            listeners.push(l);
        }
        let metrics = match &config.server.metrics_listen {
            Some(m) => Some((
                m.clone(),
                inherited
                    .listen(ListenerKind::Metrics, m)
                    .map_err(|e| fail("server.metrics_listen".into(), format!("{m}: {e}")))?,
            )),
            None => None,
        };
        let admin_path = &config.server.admin_socket;
        let admin = match inherited.take(ListenerKind::Admin, &admin_path.display().to_string()) {
            Some(socket) => {
                let l = std::os::unix::net::UnixListener::from(socket);
                l.set_nonblocking(true)
                    .map_err(|e| fail("server.admin_socket".into(), e.to_string()))?;
                Some((l, admin_path.clone()))
            }
            None => crate::admin::bind(admin_path)
                .map_err(|reason| fail("server.admin_socket".into(), reason))?,
        };
        for unused in &inherited.0 {
            tracing::info!(
                "the predecessor's {:?} listener on {} is not in this config: closed",
                unused.kind,
                unused.address
            );
        }
        drop(inherited);
        let engine = match config.server.engine.as_str() {
            "uring" => EngineChoice::Uring,
            "threads" => EngineChoice::Threads,
            _ => EngineChoice::Auto,
        };
        let count = match config.server.reactors {
            0 => std::thread::available_parallelism().map_or(1, |n| n.get()),
            n => n,
        };
        #[cfg(feature = "rdma")]
        let rdma_portals = config.server.rdma_portals.clone();
        #[cfg(feature = "rdma")]
        let iser_portals = config.server.iser_portals.clone();
        if let Some(cluster) = &env.cluster {
            match entry {
                ClusterEntry::Now | ClusterEntry::KeepingSessions => cluster.join(&portals),
                ClusterEntry::AtHandover => cluster.join_as_successor(&portals),
            }
            .map_err(|(k, r)| fail(k, r))?;
            if !config.server.rdma_portals.is_empty() {
                cluster.serve_srp();
            }
        }
        let nvme_count = config.server.nvme_portals.len();
        let registry = Arc::new(Registry::new(
            config,
            config_path,
            targets,
            subsystems,
            portals,
            env,
        ));
        {
            let bound: Vec<SocketAddr> = nvme_listeners
                .iter()
                .filter_map(|(_, _, l)| l.local_addr().ok())
                .collect();
            let (io, discovery) = bound.split_at(nvme_count.min(bound.len()));
            *lock(&registry.nvme_portals) = (io.to_vec(), discovery.to_vec());
            if let Some(cluster) = &registry.target_env.cluster {
                cluster.set_nvme_portals(io, &registry.nvme_rdma_portals());
            }
            registry.update_discovery();
        }
        follow_other_gateways_portals(&registry);
        let settings = reactor::Settings {
            engine,
            arena: ArenaConfig::default(),
            busy_poll: registry.config().server.busy_poll,
        };
        if !settings.busy_poll.is_zero() {
            tracing::info!(
                "reactors keep polling for {} after their connections' last request \
                 (server.busy_poll): a core each while busy",
                units::format_duration(settings.busy_poll)
            );
        }
        let mut reactors = Vec::new();
        let mut threads = Vec::new();
        for i in 0..count {
            let gauge = Arc::new(crate::registry::counters::ArenaGauge::default());
            lock(&registry.counters.arenas).push(gauge.clone());
            let (h, t) = reactor::spawn(i, settings.clone(), gauge)
                .map_err(|e| fail("server.engine".into(), format!("reactor {i}: {e}")))?;
            if i == 0 {
                // What `targetctl status` says runs, busy polling included.
                *lock(&registry.engine) = match settings.busy_poll {
                    d if d.is_zero() => h.engine.clone(),
                    d => format!("{}, busy polling {}", h.engine, units::format_duration(d)),
                };
            }
            reactors.push(h);
            threads.push(t);
        }
        #[cfg(feature = "rdma")]
        for (i, p) in rdma_portals.iter().enumerate() {
            let key = format!("server.rdma_portals[{i}]");
            let addr: SocketAddr = p
                .parse()
                .map_err(|_| fail(key.clone(), format!("{p:?} is not an address:port")))?;
            // Portals spread over the reactors; each port's channels stay on its reactor.
            let reactor = &reactors[i % reactors.len()];
            let settings = crate::srp::port_settings(&registry.config().server, Some(addr));
            crate::srp::start_port(reactor, registry.clone(), move |io| {
                crate::srp::rdma_port(addr, &io.arena, &settings).map_err(|e| e.to_string())
            })
            .map_err(|r| fail(key, format!("{p}: {r}")))?;
        }
        #[cfg(feature = "rdma")]
        for (i, p) in iser_portals.iter().enumerate() {
            let key = format!("server.iser_portals[{i}]");
            let addr: SocketAddr = p
                .parse()
                .map_err(|_| fail(key.clone(), format!("{p:?} is not an address:port")))?;
            let reactor = &reactors[(i + rdma_portals.len()) % reactors.len()];
            let (slots, depth) = crate::iser::rdma_sizes(crate::iser::window(&registry));
            let open = move |io: &crate::reactor::Io| {
                crate::fabric::device::RdmaPort::open(addr, &io.arena, slots, depth)
                    .map_err(|e| e.to_string())
            };
            crate::port::start_on(reactor, registry.clone(), open, crate::iser::serve)
                .map_err(|r| fail(key, format!("{p}: {r}")))?;
        }
        #[cfg(feature = "rdma")]
        for (i, p) in registry
            .config()
            .server
            .nvme_rdma_portals
            .iter()
            .enumerate()
        {
            let key = format!("server.nvme_rdma_portals[{i}]");
            let addr: SocketAddr = p
                .parse()
                .map_err(|_| fail(key.clone(), format!("{p:?} is not an address:port")))?;
            let reactor = &reactors[(i + rdma_portals.len() + iser_portals.len()) % reactors.len()];
            let (slots, depth) = crate::nvme::rdma::rdma_sizes(&registry);
            let open = move |io: &crate::reactor::Io| {
                crate::fabric::device::RdmaPort::open(addr, &io.arena, slots, depth)
                    .map_err(|e| e.to_string())
            };
            crate::port::start_on(reactor, registry.clone(), open, crate::nvme::rdma::serve)
                .map_err(|r| fail(key, format!("{p}: {r}")))?;
        }
        Ok(Server {
            registry,
            listeners,
            nvme_listeners,
            admin,
            metrics,
            reactors,
            threads,
        })
    }

    /// The address the metrics endpoint listens on (`server.metrics_listen`), if any.
    pub fn metrics_addr(&self) -> Option<SocketAddr> {
        self.metrics.as_ref().and_then(|(_, m)| m.local_addr().ok())
    }

    /// The addresses the portals listen on.
    pub fn portals(&self) -> Vec<SocketAddr> {
        lock(&self.registry.portals).clone()
    }

    /// The addresses the NVMe/TCP portals listen on (`server.nvme_portals`).
    pub fn nvme_portals(&self) -> Vec<SocketAddr> {
        lock(&self.registry.nvme_portals).0.clone()
    }

    /// The addresses the NVMe/TCP discovery portals listen on
    /// (`server.nvme_discovery_portals`).
    pub fn nvme_discovery_portals(&self) -> Vec<SocketAddr> {
        lock(&self.registry.nvme_portals).1.clone()
    }

    /// Serves SRP on the software fabric `switch` as its node `node`, listening on `service`:
    /// RDMA in the process, for an embedding's or a test's initiator on the same switch. The
    /// port runs on the least loaded reactor, from now until the daemon stops.
    pub fn serve_srp_fabric(
        &self,
        switch: &Arc<rdma::switch::Switch>,
        node: rdma::fabric::NodeId,
        service: &str,
    ) -> Result<(), StartError> {
        self.serve_fabric(switch, node, service, "SRP", crate::srp::serve)?;
        if let Some(cluster) = &self.registry.target_env.cluster {
            // Its port group now has this gateway's SRP port too.
            cluster.serve_srp();
        }
        Ok(())
    }

    /// Serves iSER on the software fabric `switch` as its node `node`, listening on
    /// `service`: iSCSI over RDMA in the process, for an embedding's or a test's initiator on
    /// the same switch. The portal runs on the least loaded reactor until the daemon stops.
    pub fn serve_iser_fabric(
        &self,
        switch: &Arc<rdma::switch::Switch>,
        node: rdma::fabric::NodeId,
        service: &str,
    ) -> Result<(), StartError> {
        self.serve_fabric(switch, node, service, "iSER", crate::iser::serve)
    }

    /// Serves NVMe/RDMA on the software fabric `switch` as its node `node`, listening on
    /// `service`: the subsystems of `[[subsystems]]` over RDMA in the process, for an
    /// embedding's or a test's host on the same switch. The portal runs on the least loaded
    /// reactor until the daemon stops.
    pub fn serve_nvme_rdma_fabric(
        &self,
        switch: &Arc<rdma::switch::Switch>,
        node: rdma::fabric::NodeId,
        service: &str,
    ) -> Result<(), StartError> {
        self.serve_fabric(switch, node, service, "NVMe/RDMA", crate::nvme::rdma::serve)
    }

    /// A port of `protocol` served by `run` on the software fabric.
    fn serve_fabric<Fut: Future<Output = ()> + 'static>(
        &self,
        switch: &Arc<rdma::switch::Switch>,
        node: rdma::fabric::NodeId,
        service: &str,
        protocol: &str,
        run: fn(crate::fabric::FabricPort, std::rc::Rc<crate::reactor::Io>, Arc<Registry>) -> Fut,
    ) -> Result<(), StartError> {
        let reactor = self.least_loaded()?;
        let (switch, name) = (switch.clone(), service.to_string());
        let open = move |_: &crate::reactor::Io| {
            crate::fabric::FabricPort::listen(&switch, node, &name).map_err(|e| e.to_string())
        };
        crate::port::start_on(reactor, self.registry.clone(), open, run).map_err(|reason| {
            StartError {
                key: format!("{protocol} fabric service {service:?}"),
                reason,
            }
        })
    }

    /// The reactor serving the fewest connections.
    fn least_loaded(&self) -> Result<&crate::reactor::Handle, StartError> {
        self.reactors
            .iter()
            .min_by_key(|r| r.connections.load(Ordering::Relaxed))
            .ok_or_else(|| StartError {
                key: "server.reactors".into(),
                reason: "no reactor runs".into(),
            })
    }

    /// Takes in sessions another process parked and handed over (an upgrade's successor,
    /// [`crate::iscsi::handover`]), every one or none: the units' states first (their
    /// reservations and mode pages), then each session put on these reactors under its
    /// TSIH, to be served from where it stopped once the old process let go of it
    /// ([`Adopted::serve`](crate::iscsi::handover::Adopted::serve)). Or why none was taken
    /// in (nothing is then served here, and the old process serves on).
    pub fn adopt_sessions(
        &self,
        handover: crate::handover::Handover,
    ) -> Result<crate::iscsi::handover::Adopted, crate::iscsi::handover::AdoptError> {
        crate::iscsi::handover::adopt(&self.registry, &self.reactors, handover)
    }

    /// Every part of a handover has been through [`Server::adopt_sessions`]: the unit
    /// attentions the units' states kept for nexuses that did not come go
    /// ([`crate::iscsi::handover::end_handover`]).
    pub fn end_handover(&self) {
        crate::iscsi::handover::end_handover(&self.registry);
    }

    /// An upgrade's successor, its predecessor parked: this process becomes the cluster's
    /// gateway ([`crate::cluster::Cluster::take_place`]); nothing to do outside a cluster.
    pub fn take_cluster_place(&self) -> Result<(), String> {
        match &self.registry.target_env.cluster {
            Some(cluster) => cluster.take_place(),
            None => Ok(()),
        }
    }

    /// The registry every part shares (for embedding and tests).
    pub fn registry(&self) -> Arc<Registry> {
        self.registry.clone()
    }

    /// Serves until `stop` resolves, then drains: no new connections, initiators asked to log
    /// out, in-flight commands finished within a bound, backends flushed. Call from a tokio
    /// runtime; the reactors run on their own threads.
    pub async fn run(self, stop: impl Future<Output = ()>) {
        let Server {
            registry,
            listeners,
            nvme_listeners,
            admin,
            metrics,
            reactors,
            threads,
        } = self;
        let mut tasks = tokio::task::JoinSet::new();
        let texts = registry.started_server.portals.clone();
        registry.listen(
            start_accepting(&registry, reactors.clone()),
            texts.into_iter().zip(listeners).collect(),
        );
        // Duplicates of what listens besides the iSCSI portals (the registry keeps theirs),
        // for an upgrade's successor.
        let keep = |kind, address: String, socket: std::io::Result<OwnedFd>| match socket {
            Ok(s) => registry.succession.keep(kind, address, s),
            Err(e) => tracing::warn!("{address}: no duplicate for an upgrade: {e}"),
        };
        for (kind, address, l) in &nvme_listeners {
            keep(*kind, address.clone(), l.try_clone().map(OwnedFd::from));
        }
        if let Some((address, l)) = &metrics {
            keep(
                ListenerKind::Metrics,
                address.clone(),
                l.try_clone().map(OwnedFd::from),
            );
        }
        if let Some((l, path)) = &admin {
            let address = path.display().to_string();
            keep(
                ListenerKind::Admin,
                address,
                l.try_clone().map(OwnedFd::from),
            );
        }
        let mut nvme_accepting = Vec::new();
        for (_, _, l) in nvme_listeners {
            match tokio::net::TcpListener::from_std(l) {
                Ok(l) => nvme_accepting.push(tokio::spawn(accept(
                    l,
                    reactors.clone(),
                    registry.clone(),
                    Protocol::NvmeTcp,
                ))),
                Err(e) => tracing::error!("NVMe/TCP listener: {e}"),
            }
        }
        let admin_path = admin.as_ref().map(|(_, p)| p.clone());
        if let Some((l, _)) = admin {
            match tokio::net::UnixListener::from_std(l) {
                Ok(l) => {
                    let tracer = crate::trace::Tracer::new(reactors.clone());
                    tasks.spawn(crate::admin::serve(l, registry.clone(), tracer));
                }
                Err(e) => tracing::error!("admin socket: {e}"),
            }
        }
        if let Some((_, m)) = metrics {
            match tokio::net::TcpListener::from_std(m) {
                Ok(l) => {
                    tasks.spawn(crate::metrics::serve(l, registry.clone()));
                }
                Err(e) => tracing::error!("metrics listener: {e}"),
            }
        }
        tokio::select! {
            () = stop => {}
            () = registry.succession.succeeded_wait() => {}
        }
        if !registry.succession.succeeded() && registry.config().server.restart_keeps_sessions {
            match crate::fdstore::store_sessions(&registry).await {
                Ok(s) => tracing::info!(
                    sessions = s.sessions,
                    descriptors = s.descriptors,
                    "stopping: the sessions wait in the service manager's store for the next \
                     start (parked in {:?})",
                    s.parked
                ),
                Err(e) => {
                    tracing::warn!("stopping: the sessions are not kept for the next start: {e}")
                }
            }
        }
        tracing::info!("stopping: asking initiators to log out");
        registry.stop();
        tasks.abort_all();
        for a in &nvme_accepting {
            a.abort();
        }
        registry.request_all(Request::Logout);
        let grace = Instant::now() + Duration::from_secs(u64::from(LOGOUT_GRACE) + 1);
        let sessions = |r: &Registry| r.sessions.all().len() + r.srp_channels().len();
        while sessions(&registry) > 0 && Instant::now() < grace {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        registry.request_all(Request::Close);
        let bound = Instant::now() + Duration::from_secs(30);
        while registry.connection_count() > 0 && Instant::now() < bound {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        drop(reactors);
        let _ = tokio::task::spawn_blocking(move || {
            for t in threads {
                let _ = t.join();
            }
        })
        .await;
        flush(&registry);
        if registry.succession.succeeded() {
            // The successor serves on the admin socket's file and listens on the portals.
            tracing::info!("stopped: the upgraded targetd serves");
            return;
        }
        // A planned stop: the other gateways hear it left rather than fence it as failed.
        if let Some(cluster) = &registry.target_env.cluster {
            cluster.leave();
        }
        if let Some(p) = admin_path {
            let _ = std::fs::remove_file(p);
        }
        tracing::info!("stopped");
    }
}

/// Makes every file-backed unit's writes durable before exit, and every RBD unit's writes
/// still in librbd's cache.
fn flush(registry: &Registry) {
    for t in registry.targets() {
        for lun in t.lun_list() {
            if let Err(e) = lun.storage.flush() {
                tracing::error!(target = %t.name, lun = lun.config.lun, "flush: {e}");
            }
        }
    }
    for s in registry.subsystems() {
        for (nsid, unit) in s.namespaces() {
            if let Err(e) = unit.storage.flush() {
                tracing::error!(subsystem = %s.nqn, nsid, "flush: {e}");
            }
        }
    }
}

/// How often a gateway of a cluster looks whether the other live gateways' NVMe/TCP portals
/// changed (the membership itself moves on every `membership_interval`).
const PORTALS_PERIOD: Duration = Duration::from_millis(200);

/// In a cluster, a thread that keeps the discovery log naming the live gateways' NVMe/TCP
/// portals, until the daemon stops. (The shared namespaces' ANA states follow the cluster's
/// port groups as a shared LUN's do: [`crate::cluster::SharedTarget::set_port_groups`].)
fn follow_other_gateways_portals(registry: &Arc<Registry>) {
    if registry.target_env.cluster.is_none() {
        return;
    }
    let registry = Arc::downgrade(registry);
    let mut listed = (Vec::new(), Vec::new());
    let spawned = std::thread::Builder::new()
        .name("nvme-portals".into())
        .spawn(move || loop {
            let Some(r) = registry.upgrade().filter(|r| !r.stopping()) else {
                return;
            };
            let others = r.other_gateways_nvme_portals();
            if others != listed {
                r.update_discovery();
                listed = others;
            }
            drop(r);
            std::thread::sleep(PORTALS_PERIOD);
        });
    if let Err(e) = spawned {
        tracing::error!("no thread to follow the other gateways' NVMe/TCP portals: {e}");
    }
}

/// How the registry starts a portal's accept loop on the runtime this is called in (now, and
/// for the portals a reload or `targetctl portal add` adds), handing connections to
/// `reactors`.
fn start_accepting(registry: &Arc<Registry>, reactors: Vec<reactor::Handle>) -> StartAccepting {
    let runtime = tokio::runtime::Handle::current();
    let registry = Arc::downgrade(registry);
    Box::new(move |listener| {
        let listener = {
            let _runtime = runtime.enter();
            tokio::net::TcpListener::from_std(listener).map_err(|e| e.to_string())?
        };
        let registry = registry.upgrade().ok_or("the daemon is stopping")?;
        let task = runtime.spawn(accept(
            listener,
            reactors.clone(),
            registry,
            Protocol::Iscsi,
        ));
        Ok(task.abort_handle())
    })
}

/// What a TCP listener serves.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Protocol {
    /// iSCSI (`server.portals`).
    Iscsi,
    /// NVMe/TCP (`server.nvme_portals`).
    NvmeTcp,
}

/// Accepts connections and hands each to the least loaded reactor; beyond
/// `server.max_connections` open, closes them at once.
async fn accept(
    listener: tokio::net::TcpListener,
    reactors: Vec<reactor::Handle>,
    registry: Arc<Registry>,
    protocol: Protocol,
) {
    let mut hold = registry.succession.accept_hold();
    loop {
        // Held while an upgrade parks the sessions: connections wait in the backlog for
        // whichever process serves next.
        if hold.wait_for(|held| !held).await.is_err() {
            return;
        }
        let accepted = tokio::select! {
            biased;
            _ = hold.changed() => continue,
            accepted = listener.accept() => accepted,
        };
        let (stream, peer) = match accepted {
            Ok(s) => s,
            Err(e) => {
                tracing::warn!("accept: {e}");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let Some(slot) = registry.open_connection() else {
            let why = "server.max_connections connections are open: closed";
            registry.refused(peer, "-", "-", why);
            continue;
        };
        let Some(r) = reactors
            .iter()
            .min_by_key(|r| r.connections.load(Ordering::Relaxed))
        else {
            return;
        };
        let stream = match stream.into_std() {
            Ok(s) => s,
            Err(e) => {
                tracing::warn!("accept: {e}");
                continue;
            }
        };
        tracing::debug!(%peer, reactor = r.index, "connection");
        let registry = registry.clone();
        let connection: reactor::Task = Box::new(move |io| {
            Box::pin(async move {
                match tokio::net::TcpStream::from_std(stream) {
                    Ok(s) if protocol == Protocol::Iscsi => {
                        crate::iscsi::connection::serve(s, io, registry).await
                    }
                    Ok(s) => crate::nvme::tcp::serve(s, io, registry).await,
                    Err(e) => tracing::warn!("cannot adopt a connection: {e}"),
                }
                // Its place among the daemon's connections, given back when it ends.
                drop(slot);
            })
        });
        if !r.spawn(connection) {
            tracing::error!("reactor {} is gone", r.index);
        }
    }
}

/// The listening sockets a predecessor handed over, taken as the start binds.
struct Inherited(Vec<ListeningSocket>);

impl Inherited {
    /// The socket of `kind` configured as `address`, if one came (the first, for an address
    /// named twice).
    fn take(&mut self, kind: ListenerKind, address: &str) -> Option<OwnedFd> {
        let i = self
            .0
            .iter()
            .position(|l| l.kind == kind && l.address == address)?;
        Some(self.0.remove(i).socket)
    }

    /// A non-blocking TCP listener on `address`: the inherited one, or bound now.
    fn listen(
        &mut self,
        kind: ListenerKind,
        address: &str,
    ) -> std::io::Result<std::net::TcpListener> {
        let l = match self.take(kind, address) {
            Some(socket) => std::net::TcpListener::from(socket),
            None => std::net::TcpListener::bind(address)?,
        };
        l.set_nonblocking(true)?;
        Ok(l)
    }
}
