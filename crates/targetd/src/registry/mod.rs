//! The daemon's registry of targets, sessions and connections: what every reactor, the
//! listeners and the admin interface share, and the login policy over it. It depends on the
//! config, the targets and the sessions only; the connections, the reactors, the server and the
//! admin interface depend on it (there is no import cycle back).

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use std::os::fd::OwnedFd;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError, RwLock, RwLockReadGuard};
use std::time::{Duration, Instant};

use iscsi_pdu::chap::{ChapCredentials, ENTROPY_LEN};
use iscsi_pdu::negotiation::{AuthMethod, NegotiationError, Settings};
use iscsi_pdu::target_node::{Completed, LoginPolicy, SessionError};
use iscsi_pdu::text::TextParams;
use iscsi_pdu::{Isid, LoginStatus, SerialNumber};

pub mod channels;
pub mod counters;
pub mod succession;

pub use channels::SrpChannelInfo;
pub use counters::{ArenaGauge, ConnectionSlot, Counters};

use crate::config::{self, Config};
use crate::control::{Control, Request};
use crate::iscsi::session::{ConnectionInfo, Session, Sessions};
use crate::lock;
use crate::nvme::NvmeSubsystem;
use crate::target::{Target, TargetEnv};

/// The daemon's registry: the running config, the targets, the sessions and the live
/// connections, shared by every reactor, the listeners and the admin interface. It answers a
/// login's questions ([`Registry::admission`]) and applies reloads ([`Registry::apply`]).
pub struct Registry {
    /// What every target shares, fixed at start: a target a reload adds gets it too (a
    /// changed `server.state_dir` or `[cluster]` waits for a restart).
    pub target_env: TargetEnv,
    /// What targetctl made live since the config file last matched the running config (a
    /// load, a save, a reload): "target IQN" and "IQN LUN N". A reload would lose these.
    pub unsaved: Mutex<std::collections::BTreeSet<String>>,
    /// `[server]` as the daemon started with it: what listens and runs now, whatever a reload
    /// changed in the file.
    pub started_server: crate::config::Server,
    config: RwLock<Config>,
    /// The file the config came from (SIGHUP reads it again).
    pub config_path: PathBuf,
    /// The file's contents as targetd last read or wrote them ([`file_fingerprint`]), so that
    /// a save can tell the administrator that it overwrites edits made since.
    pub config_seen: Mutex<Option<u64>>,
    targets: RwLock<Vec<Arc<Target>>>,
    /// The NVM subsystems exported.
    subsystems: RwLock<Vec<Arc<NvmeSubsystem>>>,
    /// The discovery subsystem of the NVMe/TCP portals.
    pub nvme_discovery: Arc<NvmeSubsystem>,
    /// The NVMe/TCP listeners' addresses, and the discovery listeners'.
    pub nvme_portals: Mutex<(Vec<SocketAddr>, Vec<SocketAddr>)>,
    /// Normal sessions.
    pub sessions: Sessions,
    /// When the daemon started.
    pub started: Instant,
    stopping: AtomicBool,
    controls: Mutex<HashMap<u64, Arc<Control>>>,
    /// NVMe/TCP connections bound to a queue, by connection id: what a handover parks.
    nvme_queues: Mutex<HashMap<u64, NvmeQueue>>,
    /// Connections accepted and not yet closed (`server.max_connections`).
    open: Arc<AtomicUsize>,
    /// What the connections, ports and reactors counted.
    pub counters: Counters,
    /// The I/O engine the reactors run, as they reported it.
    pub engine: Mutex<String>,
    refusals: Mutex<(Option<Instant>, u64)>,
    /// The listeners' addresses.
    pub portals: Mutex<Vec<SocketAddr>>,
    /// The iSCSI listeners as they run, once the server runs: what a reload or `targetctl
    /// portal add/remove` changes.
    listeners: Mutex<Option<Listeners>>,
    /// Authentication failures by source address, which slow its next logins.
    pub auth: Mutex<crate::iscsi::throttle::AuthThrottle>,
    /// SRP channels logged in, by their daemon-wide id.
    pub(crate) srp_channels: Mutex<std::collections::BTreeMap<u64, SrpChannelInfo>>,
    /// What an upgrade needs of this process ([`crate::upgrade`]).
    pub succession: succession::Succession,
}

/// A hash of the file at `path` as it is now (none when it cannot be read): what changed on
/// disk is told apart from what targetd last read or wrote.
pub fn file_fingerprint(path: &std::path::Path) -> Option<u64> {
    use std::hash::{Hash, Hasher};
    let bytes = std::fs::read(path).ok()?;
    let mut h = std::collections::hash_map::DefaultHasher::new();
    bytes.hash(&mut h);
    Some(h.finish())
}

/// Whether `config` has the target ("target IQN") or LUN ("IQN LUN N") `what` names.
fn holds(config: &Config, what: &str) -> bool {
    let target = |name: &str| {
        config
            .targets
            .iter()
            .find(|t| t.name.eq_ignore_ascii_case(name))
    };
    if let Some(name) = what.strip_prefix("target ") {
        return target(name).is_some();
    }
    if let Some(rest) = what.strip_prefix("subsystem ") {
        let (nqn, nsid) = match rest.rsplit_once(" namespace ") {
            Some((nqn, nsid)) => (nqn, Some(nsid)),
            None => (rest, None),
        };
        let Some(sub) = config.subsystems.iter().find(|s| s.nqn == nqn) else {
            return false;
        };
        return nsid.is_none_or(|n| {
            sub.namespaces
                .iter()
                .any(|ns| n.parse::<u32>().is_ok_and(|n| ns.nsid == n))
        });
    }
    match what.rsplit_once(" LUN ") {
        Some((name, lun)) => target(name).is_some_and(|t| {
            t.luns
                .iter()
                .any(|l| lun.parse::<u16>().is_ok_and(|n| l.lun == n))
        }),
        None => true,
    }
}

impl Registry {
    /// A registry of `targets` (already opened) under `config`, serving on `portals`.
    pub fn new(
        config: Config,
        config_path: PathBuf,
        targets: Vec<Arc<Target>>,
        subsystems: Vec<Arc<NvmeSubsystem>>,
        portals: Vec<SocketAddr>,
        target_env: TargetEnv,
    ) -> Registry {
        let sessions = Sessions::default();
        sessions.set_limit(config.server.max_sessions);
        let nvme_discovery = NvmeSubsystem::discovery(&config.nvme);
        Registry {
            target_env,
            unsaved: Mutex::default(),
            started_server: config.server.clone(),
            config: RwLock::new(config),
            config_seen: Mutex::new(file_fingerprint(&config_path)),
            config_path,
            targets: RwLock::new(targets),
            subsystems: RwLock::new(subsystems),
            nvme_discovery,
            nvme_portals: Mutex::default(),
            sessions,
            open: Arc::default(),
            counters: Counters::default(),
            started: Instant::now(),
            stopping: AtomicBool::new(false),
            controls: Mutex::new(HashMap::new()),
            nvme_queues: Mutex::default(),
            engine: Mutex::new(String::new()),
            refusals: Mutex::new((None, 0)),
            portals: Mutex::new(portals),
            listeners: Mutex::new(None),
            auth: Mutex::default(),
            srp_channels: Mutex::default(),
            succession: Default::default(),
        }
    }

    /// The NVM subsystem named `nqn` (or the discovery subsystem).
    pub fn subsystem(&self, nqn: &str) -> Option<Arc<NvmeSubsystem>> {
        if nqn == self.nvme_discovery.nqn {
            return Some(self.nvme_discovery.clone());
        }
        self.subsystems
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .iter()
            .find(|s| s.nqn == nqn)
            .cloned()
    }

    /// Tells the discovery subsystem what there is now: every subsystem at every NVMe/TCP and
    /// NVMe/RDMA portal of this gateway and, in a cluster, at the other live gateways' NVMe/TCP
    /// portals (after a start,
    /// a subsystem added or removed, a gateway come or gone).
    pub fn update_discovery(&self) {
        let (mut portals, discovery) = lock(&self.nvme_portals).clone();
        let mut rdma = self.nvme_rdma_portals();
        let (tcp_there, rdma_there) = self.other_gateways_nvme_portals();
        portals.extend(tcp_there);
        rdma.extend(rdma_there);
        self.nvme_discovery
            .set_discovery_log(&self.subsystems(), &portals, &rdma, &discovery);
    }

    /// This gateway's NVMe/RDMA portals (`server.nvme_rdma_portals`, a restart key).
    pub fn nvme_rdma_portals(&self) -> Vec<SocketAddr> {
        self.config()
            .server
            .nvme_rdma_portals
            .iter()
            .filter_map(|p| p.parse().ok())
            .collect()
    }

    /// The NVMe/TCP and NVMe/RDMA portals of the cluster's other live gateways (none alone).
    pub fn other_gateways_nvme_portals(&self) -> (Vec<SocketAddr>, Vec<SocketAddr>) {
        let Some(c) = &self.target_env.cluster else {
            return (Vec::new(), Vec::new());
        };
        let m = c.membership();
        let others: Vec<_> = m
            .members
            .iter()
            .filter(|g| g.gateway != c.gateway() && m.live.contains(&g.gateway))
            .collect();
        let tcp = others.iter().flat_map(|g| g.nvme_portals.iter().copied());
        let rdma = others
            .iter()
            .flat_map(|g| g.nvme_rdma_portals.iter().copied());
        (tcp.collect(), rdma.collect())
    }

    /// The NVM subsystems exported.
    pub fn subsystems(&self) -> Vec<Arc<NvmeSubsystem>> {
        self.subsystems
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// The SRP channels logged in now, by their daemon-wide id.
    pub fn srp_channels(&self) -> std::collections::BTreeMap<u64, SrpChannelInfo> {
        lock(&self.srp_channels).clone()
    }

    /// From now on logins are refused with SERVICE_UNAVAILABLE.
    pub fn stop(&self) {
        self.stopping.store(true, Ordering::SeqCst);
        // No more connections; and the reactors' handles go, so that they end.
        if let Some(l) = lock(&self.listeners).take() {
            for (_, _, task, _) in l.accepting {
                task.abort();
            }
        }
    }

    /// Starts serving: the accept loops of the portals (`listening`: each one's config text
    /// and listener), each started by `start`. From now on portals change while running.
    pub fn listen(&self, start: StartAccepting, listening: Vec<(String, std::net::TcpListener)>) {
        let mut l = Listeners {
            start,
            accepting: Vec::new(),
        };
        for (text, listener) in listening {
            if let Err(e) = l.accept_on(text, listener) {
                tracing::error!("listener: {e}");
            }
        }
        *lock(&self.listeners) = Some(l);
    }

    /// The config text of the portal listening on `address` (as `targetctl portal remove`
    /// may name it by the address it bound, say after port 0).
    pub fn portal_text(&self, address: &str) -> Option<String> {
        let l = lock(&self.listeners);
        l.as_ref()?
            .accepting
            .iter()
            .find(|(text, bound, _, _)| text == address || bound.to_string() == address)
            .map(|(text, _, _, _)| text.clone())
    }

    /// Duplicates of every socket this process listens on, for an upgrade's successor: the
    /// iSCSI portals' as they run now (what a reload or `targetctl portal` changed included),
    /// and the others the server keeps ([`succession::Succession::keep`]).
    pub fn listening_sockets(&self) -> std::io::Result<Vec<crate::handover::ListeningSocket>> {
        let mut all = Vec::new();
        if let Some(l) = lock(&self.listeners).as_ref() {
            for (text, _, _, socket) in &l.accepting {
                all.push(crate::handover::ListeningSocket {
                    kind: crate::handover::ListenerKind::Iscsi,
                    address: text.clone(),
                    socket: socket.try_clone()?,
                });
            }
        }
        all.extend(self.succession.sockets()?);
        Ok(all)
    }

    /// Makes the listeners those `portals` names: listens on each one not listened on yet
    /// (one more for each repetition: `host:0` twice is two portals), and stops listening on
    /// those it no longer names (their connections stay). A portal of port 0 is written back
    /// into `portals` as the address it bound, so that the config names what listens (and a
    /// save keeps it). Returns what changed; an address that cannot be bound changes nothing.
    fn change_portals(&self, portals: &mut [String]) -> Result<Vec<String>, String> {
        let mut guard = lock(&self.listeners);
        let Some(l) = guard.as_mut() else {
            return Ok(vec!["server.portals: takes effect at the next start".into()]);
        };
        let count = |list: &[String], t: &str| list.iter().filter(|p| *p == t).count();
        // Bind what is new first: a failure leaves everything as it was.
        let mut bound = Vec::new();
        for (i, text) in portals.iter().enumerate() {
            let have = l.accepting.iter().filter(|(t, _, _, _)| t == text).count();
            if count(&portals[..=i], text) <= have {
                continue;
            }
            let listener = std::net::TcpListener::bind(text.as_str())
                .and_then(|s| s.set_nonblocking(true).map(|()| s))
                .map_err(|e| format!("server.portals: {text}: {e}"))?;
            bound.push((i, listener));
        }
        let mut changes = Vec::new();
        for (i, listener) in bound {
            let at = listener
                .local_addr()
                .map_err(|e| format!("server.portals: {}: {e}", portals[i]))?;
            if portals[i]
                .parse::<SocketAddr>()
                .is_ok_and(|a| a.port() == 0)
            {
                portals[i] = at.to_string();
            }
            l.accept_on(portals[i].clone(), listener)?;
            changes.push(format!("server.portals: listening on {at}"));
        }
        // Then stop what is no longer named, the latest first.
        let mut k = l.accepting.len();
        while k > 0 {
            k -= 1;
            let text = l.accepting[k].0.clone();
            let have = l.accepting.iter().filter(|(t, _, _, _)| *t == text).count();
            if have > count(portals, &text) {
                let (_, at, task, _) = l.accepting.remove(k);
                task.abort();
                changes.push(format!("server.portals: no longer listening on {at}"));
            }
        }
        let now: Vec<SocketAddr> = l.accepting.iter().map(|(_, at, _, _)| *at).collect();
        drop(guard);
        *lock(&self.portals) = now.clone();
        if let Some(c) = &self.target_env.cluster {
            c.set_portals(&now);
        }
        Ok(changes)
    }

    /// The running config.
    pub fn config(&self) -> RwLockReadGuard<'_, Config> {
        self.config.read().unwrap_or_else(PoisonError::into_inner)
    }

    /// What the target offers in login negotiation.
    pub fn settings(&self) -> Settings {
        self.config().settings()
    }

    /// Counts a login's last answer: its Login Response status, over iSER or TCP.
    pub fn count_login(&self, iser: bool, status: iscsi_pdu::pdu::LoginStatus) {
        self.counters.logins[usize::from(iser)][status.index()].fetch_add(1, Ordering::Relaxed);
    }

    /// The CmdSN window of new sessions.
    pub fn window(&self) -> u32 {
        self.config().iscsi.cmdsn_window
    }

    /// The command window of a session on `peer`'s connection: `iscsi.cmdsn_window`, at
    /// most what its transport can carry ([`Peer::max_window`]).
    pub fn window_for(&self, peer: &Peer) -> u32 {
        self.window().min(peer.max_window)
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
        lock(&self.nvme_queues).remove(&id);
    }

    /// Records that NVMe/TCP connection `id` serves a queue (Connect bound it).
    pub fn nvme_queue_bound(&self, id: u64, queue: NvmeQueue) {
        lock(&self.nvme_queues).insert(id, queue);
    }

    /// The NVMe/TCP connections bound to a queue, with their ids.
    pub fn nvme_queues(&self) -> Vec<(u64, NvmeQueue)> {
        lock(&self.nvme_queues)
            .iter()
            .map(|(id, q)| (*id, q.clone()))
            .collect()
    }

    /// A place for one more connection, `None` when `server.max_connections` are open: the
    /// listener closes the socket at once. The place is given back when the slot is dropped,
    /// as the connection ends.
    pub fn open_connection(&self) -> Option<ConnectionSlot> {
        let max = self.config().server.max_connections;
        let slot = ConnectionSlot::take(&self.open, max);
        if slot.is_none() {
            self.counters
                .connections_refused
                .fetch_add(1, Ordering::Relaxed);
        }
        slot
    }

    /// Connections alive now.
    pub fn connection_count(&self) -> usize {
        lock(&self.controls).len()
    }

    /// Asks every live connection for `r`.
    pub fn request_all(&self, r: Request) {
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
        // This gateway's portals, then (in a cluster) every other gateway's with its group.
        let mut portals: Vec<(SocketAddr, u16)> = Vec::new();
        for t in self.targets() {
            if !wanted(&t.name) || !t.admits(initiator, peer) {
                continue;
            }
            if portals.is_empty() {
                portals = lock(&self.portals)
                    .iter()
                    .map(|&p| (p, t.port_group))
                    .chain(self.other_gateways_portals())
                    .collect();
            }
            out.push("TargetName", t.name.clone());
            for &(p, group) in &portals {
                // A wildcard listener is reported by the address this connection reached.
                let ip = if p.ip().is_unspecified() {
                    local.ip()
                } else {
                    p.ip()
                };
                let addr = SocketAddr::new(ip, p.port());
                out.push("TargetAddress", format!("{addr},{group}"));
            }
        }
        out
    }

    /// The portals of the cluster's other live gateways, with their port groups (none alone).
    fn other_gateways_portals(&self) -> Vec<(SocketAddr, u16)> {
        if let Some(c) = &self.target_env.cluster {
            let m = c.membership();
            return m
                .members
                .iter()
                .filter(|g| g.gateway != c.gateway() && m.live.contains(&g.gateway))
                .flat_map(|g| g.portals.iter().map(move |&p| (p, g.port_group)))
                .collect();
        }
        Vec::new()
    }

    /// Reads the config file again and applies it. Refused, listing them, when it would
    /// remove targets or LUNs made live with targetctl since the file last held the running
    /// config, unless `force`.
    pub fn reload(&self, force: bool) -> Result<Vec<String>, String> {
        let seen = file_fingerprint(&self.config_path);
        let new = Config::load(&self.config_path).map_err(|e| e.to_string())?;
        let lost = self.unsaved_missing_from(&new);
        if !lost.is_empty() && !force {
            return Err(format!(
                "the file would remove what targetctl made live since the last save: {}; save \
                 it first (targetctl config save) or reload with --force",
                lost.join(", ")
            ));
        }
        let changes = self.apply(new, force)?;
        lock(&self.unsaved).clear();
        *lock(&self.config_seen) = seen;
        Ok(changes)
    }

    /// What targetctl made live since the last save that `config` does not have ("target
    /// IQN", "IQN LUN N"): what serving `config` instead of the running one would lose.
    pub fn unsaved_missing_from(&self, config: &Config) -> Vec<String> {
        lock(&self.unsaved)
            .iter()
            .filter(|what| !holds(config, what))
            .cloned()
            .collect()
    }

    /// The sessions (iSCSI) and channels (SRP) logged in to `target` now.
    pub fn nexus_count(&self, target: &Target) -> usize {
        let iscsi = self
            .sessions
            .all()
            .iter()
            .filter(|s| std::ptr::eq(Arc::as_ptr(&s.target), target))
            .count();
        let srp = lock(&self.srp_channels)
            .values()
            .filter(|c| c.target.eq_ignore_ascii_case(&target.name))
            .count();
        iscsi + srp
    }

    /// What applying `new` would destroy or break that only `force` allows: a unit made
    /// smaller than it is now (its last blocks cut off its file or image), a target removed
    /// while initiators are logged in to it, a unit removed while initiators use it. Empty
    /// when `new` harms nothing.
    fn needs_force(&self, new: &Config) -> Vec<String> {
        let mut refusals = Vec::new();
        for t in self.targets() {
            let sessions = self.nexus_count(&t);
            // "removing ... would end 2 sessions": only while initiators are logged in.
            let busy = |refusals: &mut Vec<String>, what: String| {
                if sessions > 0 {
                    refusals.push(format!("{what} {}", plural(sessions, "session")));
                }
            };
            let Some(nt) = new
                .targets
                .iter()
                .find(|n| n.name.eq_ignore_ascii_case(&t.name))
            else {
                busy(
                    &mut refusals,
                    format!("removing target {} would end", t.name),
                );
                continue;
            };
            let ot = t
                .config
                .read()
                .unwrap_or_else(PoisonError::into_inner)
                .clone();
            for unit in t.lun_list() {
                let lun = unit.config.lun;
                let Some(nl) = nt.luns.iter().find(|l| l.lun == lun) else {
                    busy(
                        &mut refusals,
                        format!("removing {} LUN {lun} would take it from", t.name),
                    );
                    continue;
                };
                if ot.luns.iter().any(|ol| ol == nl) {
                    // Unchanged: left as it is (an image grown elsewhere keeps its size).
                    continue;
                }
                let now = unit.blocks * u64::from(unit.block_size);
                if let Some(size) = nl.size.map(|s| s.0).filter(|&s| s < now) {
                    let cut = (now - size).div_ceil(u64::from(unit.block_size));
                    refusals.push(format!(
                        "{} LUN {lun} is {} ({now} bytes): making it {} ({size} bytes) would \
                         cut off its last {}",
                        t.name,
                        units::format_size(now),
                        units::format_size(size),
                        plural(cut as usize, "block")
                    ));
                }
            }
        }
        refusals
    }

    /// The subsystems and their namespaces made as `new` says. A subsystem added is opened
    /// with its namespaces and exported (the discovery log lists it at once); one removed
    /// leaves the discovery log, its connections close and its namespaces are flushed (while
    /// controllers are connected, only with `force`: their hosts lose it). In the subsystems
    /// that stay, namespaces added are opened and attached, those removed detached (while
    /// controllers are connected, only with `force`), and hosts hear of both through
    /// Namespace Attribute Changed notices. Everything else about a subsystem that stays (its
    /// hosts, serial, model; a namespace's keys other than its size) takes effect at the next
    /// start, and `new` keeps what runs now for it, so the running config says what runs.
    /// Nothing changes when a subsystem or a namespace cannot be opened.
    fn change_subsystems(
        &self,
        old: &Config,
        new: &mut Config,
        force: bool,
    ) -> Result<Vec<String>, String> {
        let mut changes = Vec::new();
        let mut adds = Vec::new();
        let mut removes = Vec::new();
        let mut resizes = Vec::new();
        let mut added = Vec::new();
        for sub in &mut new.subsystems {
            let (Some(running), Some(was)) = (
                self.subsystems().into_iter().find(|s| s.nqn == sub.nqn),
                old.subsystems.iter().find(|s| s.nqn == sub.nqn),
            ) else {
                added.push(sub.clone());
                continue;
            };
            let mut kept = Vec::new();
            for ns in &sub.namespaces {
                match was.namespaces.iter().find(|n| n.nsid == ns.nsid) {
                    None => adds.push((running.clone(), ns.clone())),
                    Some(before) if before != ns && only_size_differs(&before.unit, &ns.unit) => {
                        // A size given and not the namespace's: resized live. No size keeps
                        // the one the storage has.
                        let unit = running.namespace(ns.nsid);
                        let now = unit.as_ref().map(|u| u.blocks * u64::from(u.block_size));
                        if let (Some(now), Some(bytes)) = (now, ns.unit.size.map(|s| s.0)) {
                            if bytes < now && !force {
                                let bs = unit.as_ref().map_or(512, |u| u64::from(u.block_size));
                                return Err(format!(
                                    "subsystem {} namespace {} is {} ({now} bytes): making it {} \
                                     ({bytes} bytes) would cut off its last {}; add --force to do it",
                                    sub.nqn,
                                    ns.nsid,
                                    units::format_size(now),
                                    units::format_size(bytes),
                                    plural((now - bytes).div_ceil(bs) as usize, "block")
                                ));
                            }
                            if bytes != now {
                                resizes.push((running.clone(), ns.nsid, bytes));
                            }
                        }
                    }
                    Some(before) if before != ns => {
                        changes.push(format!(
                            "subsystem {} namespace {}: takes effect at the next start",
                            sub.nqn, ns.nsid
                        ));
                        kept.push(before.clone());
                        continue;
                    }
                    Some(_) => {}
                }
                kept.push(ns.clone());
            }
            for ns in &was.namespaces {
                if sub.namespaces.iter().all(|n| n.nsid != ns.nsid) {
                    let connected = running.controllers().len();
                    if connected > 0 && !force {
                        return Err(format!(
                            "subsystem {} namespace {}: {connected} controllers are connected and \
                             would lose it; add --force to do it",
                            sub.nqn, ns.nsid
                        ));
                    }
                    removes.push((running.clone(), ns.nsid));
                }
            }
            let mut rest = sub.clone();
            rest.namespaces = Vec::new();
            let mut was_rest = was.clone();
            was_rest.namespaces = Vec::new();
            if rest != was_rest {
                changes.push(format!(
                    "subsystem {}: takes effect at the next start",
                    sub.nqn
                ));
                let namespaces = std::mem::take(&mut sub.namespaces);
                *sub = was.clone();
                sub.namespaces = namespaces;
            }
            sub.namespaces = kept;
        }
        let mut removed = Vec::new();
        for was in &old.subsystems {
            if new.subsystems.iter().all(|s| s.nqn != was.nqn) {
                let Some(running) = self.subsystems().into_iter().find(|s| s.nqn == was.nqn) else {
                    continue;
                };
                let connected = running.controllers().len();
                if connected > 0 && !force {
                    return Err(format!(
                        "subsystem {}: {} connected would lose it; add --force to do it",
                        was.nqn,
                        plural(connected, "controller")
                    ));
                }
                removed.push(running);
            }
        }
        // Open every new subsystem and namespace before exporting or attaching any.
        let mut made = Vec::new();
        for sub in &added {
            let store = self
                .target_env
                .reservation_store()
                .map_err(|(k, e)| format!("{k}: {e}"))?;
            made.push(
                NvmeSubsystem::new(sub, &old.nvme, store, &self.target_env)
                    .map_err(|(nsid, e)| format!("subsystem {} namespace {nsid}: {e}", sub.nqn))?,
            );
        }
        let mut opened = Vec::new();
        for (s, ns) in adds {
            let unit = s
                .open_namespace(&ns)
                .map_err(|e| format!("subsystem {} namespace {}: {e}", s.nqn, ns.nsid))?;
            opened.push((s, unit));
        }
        for (s, unit) in opened {
            let nsid = unit.0.nsid;
            // A shared namespace can still be refused here: by the cluster.
            s.attach_namespace(unit)
                .map_err(|e| format!("subsystem {} namespace {nsid}: {e}", s.nqn))?;
            changes.push(format!("subsystem {} namespace {nsid} added", s.nqn));
        }
        for (s, nsid) in removes {
            s.remove_namespace(nsid)?;
            changes.push(format!("subsystem {} namespace {nsid} removed", s.nqn));
        }
        for (s, nsid, bytes) in resizes {
            s.resize_namespace(nsid, bytes)
                .map_err(|e| format!("subsystem {} namespace {nsid}: {e}", s.nqn))?;
            changes.push(format!(
                "subsystem {} namespace {nsid} resized to {} ({bytes} bytes)",
                s.nqn,
                units::format_size(bytes)
            ));
        }
        if made.is_empty() && removed.is_empty() {
            return Ok(changes);
        }
        {
            let mut list = self
                .subsystems
                .write()
                .unwrap_or_else(PoisonError::into_inner);
            list.retain(|s| removed.iter().all(|r| !Arc::ptr_eq(r, s)));
            for s in &made {
                changes.push(format!(
                    "subsystem {} added ({})",
                    s.nqn,
                    plural(s.namespaces().len(), "namespace")
                ));
                list.push(s.clone());
            }
        }
        for s in removed {
            // Its connections see it gone at their next wake, which this is, and close.
            s.remove();
            for (nsid, unit) in s.namespaces() {
                if let Err(e) = unit.storage.flush() {
                    tracing::error!(subsystem = %s.nqn, nsid, "flush: {e}");
                }
            }
            changes.push(format!("subsystem {} removed", s.nqn));
        }
        self.update_discovery();
        Ok(changes)
    }

    /// Applies a changed config while running (validated first): targets and LUNs added,
    /// removed or changed, access rules and negotiation settings for new logins. Returns what
    /// changed. Without `force` it refuses, changing nothing, what `needs_force`
    /// lists: a unit shrunk (whatever the old config said: its size now, grown live or by
    /// another gateway, counts), a busy target or unit removed.
    pub fn apply(&self, mut new: Config, force: bool) -> Result<Vec<String>, String> {
        new.validate()
            .map_err(|(k, r)| format!("{}: {r}", new.describe_key(&k)))?;
        if !force {
            let refusals = self.needs_force(&new);
            if !refusals.is_empty() {
                return Err(format!("{}; add --force to do it", refusals.join("; ")));
            }
        }
        for (key, reason) in new.warnings() {
            tracing::warn!(key = %key, "{reason}");
        }
        let old = self.config().clone();
        let mut changes = Vec::new();
        if old.server.portals != new.server.portals {
            changes.extend(self.change_portals(&mut new.server.portals)?);
        }
        for (key, _, _) in old.server.restart_only_differences(&new.server) {
            changes.push(format!("server.{key}: takes effect at the next start"));
        }
        if old.cluster != new.cluster {
            // The keeper, the port group and every unit's shared reservations come with it.
            changes.push("cluster: takes effect at the next start".into());
        }
        changes.extend(self.change_subsystems(&old, &mut new, force)?);
        if old.nvme != new.nvme {
            changes.push("nvme: takes effect at the next start".into());
        }
        self.sessions.set_limit(new.server.max_sessions);
        let mut targets = self.targets();
        // Removed targets: their sessions end.
        targets.retain(|t| {
            let keep = new
                .targets
                .iter()
                .any(|n| n.name.eq_ignore_ascii_case(&t.name));
            if !keep {
                let ended = self.nexus_count(t);
                for s in self.sessions.all() {
                    if Arc::ptr_eq(&s.target, t) {
                        self.sessions.close(&s);
                    }
                }
                changes.push(match ended {
                    0 => format!("target {} removed", t.name),
                    n => format!("target {} removed, ending {}", t.name, plural(n, "session")),
                });
            }
            keep
        });
        for nt in &new.targets {
            let Some(t) = targets
                .iter()
                .find(|t| t.name.eq_ignore_ascii_case(&nt.name))
            else {
                let t = Target::new(nt, &self.target_env)
                    .map_err(|(k, r)| format!("target {} {k}: {r}", nt.name))?;
                targets.push(t);
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
                    changes.push(match self.nexus_count(t) {
                        0 => format!("{} LUN {} removed", nt.name, ol.lun),
                        n => format!(
                            "{} LUN {} removed from {} using it",
                            nt.name,
                            ol.lun,
                            plural(n, "session")
                        ),
                    });
                }
            }
            for nl in &nt.luns {
                match ot.luns.iter().find(|l| l.lun == nl.lun) {
                    None => {
                        t.add_lun(nl, Arc::default())?;
                        changes.push(format!("{} LUN {} added", nt.name, nl.lun));
                    }
                    Some(ol) if ol == nl => {}
                    Some(ol) => {
                        // A size given and not the unit's: resized in place first (a file
                        // opened again refuses a size below its own). No size keeps the one
                        // the storage has.
                        let now = t.lun(nl.lun).map(|l| l.blocks * u64::from(l.block_size));
                        if let Some(bytes) = nl.size.map(|s| s.0).filter(|&b| Some(b) != now) {
                            t.resize_lun(nl.lun, bytes)?;
                            changes.push(format!(
                                "{} LUN {} resized to {} ({bytes} bytes)",
                                nt.name,
                                nl.lun,
                                units::format_size(bytes)
                            ));
                        }
                        if !only_size_differs(ol, nl) {
                            let stats = t.lun(nl.lun).map(|l| l.stats.clone()).unwrap_or_default();
                            t.remove_lun(nl.lun)?;
                            t.add_lun(nl, stats)?;
                            changes.push(format!("{} LUN {} replaced", nt.name, nl.lun));
                        }
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

/// "1 session", "3 sessions".
fn plural(n: usize, what: &str) -> String {
    if n == 1 {
        format!("1 {what}")
    } else {
        format!("{n} {what}s")
    }
}

fn only_size_differs(a: &config::Lun, b: &config::Lun) -> bool {
    let mut a = a.clone();
    a.size = b.size;
    &a == b
}

/// Who is connecting.
pub struct Peer {
    /// Daemon-wide connection id.
    pub id: u64,
    /// Remote address.
    pub addr: SocketAddr,
    /// The portal reached.
    pub local: SocketAddr,
    /// The reactor serving it.
    pub reactor: usize,
    /// Its control.
    pub control: Arc<Control>,
    /// It runs over RDMA (an iSER portal), not TCP.
    pub iser: bool,
    /// The largest command window its transport can carry (over iSER, what the initiator's
    /// posted receives allow); `u32::MAX` when only `iscsi.cmdsn_window` bounds it.
    pub max_window: u32,
}

/// Fresh random bytes for CHAP identifiers and challenges, from the OS's CSPRNG
/// (getrandom(2)). Without them the login fails with TARGET ERROR: a challenge anyone could
/// predict would let a recorded answer be replayed.
fn entropy() -> Result<[u8; ENTROPY_LEN], LoginStatus> {
    let mut e = [0u8; ENTROPY_LEN];
    getrandom::fill(&mut e).map_err(|err| {
        tracing::error!("no random bytes from the OS for a login's CHAP challenge: {err}");
        LoginStatus::TARGET_ERROR
    })?;
    Ok(e)
}

impl Registry {
    /// A login was refused with `status` after request `req`: counted, and an authentication
    /// failure slows the source's next logins and is logged with what names it, the target,
    /// the initiator and the CHAP user the initiator gave (never the secret), so an
    /// administrator can tell a mistyped secret from a stranger.
    pub fn login_refused(
        &self,
        peer: &Peer,
        login: &iscsi_pdu::target_node::login::Login,
        req: &iscsi_pdu::LoginRequest,
        status: LoginStatus,
    ) {
        self.count_login(peer.iser, status);
        let transport = if peer.iser { "iSER" } else { "TCP" };
        if status != LoginStatus::AUTHENTICATION_FAILURE {
            tracing::info!(
                peer = %peer.addr,
                transport,
                target = login.target().unwrap_or("(discovery)"),
                initiator = login.initiator(),
                status = status.name(),
                "login refused"
            );
            return;
        }
        lock(&self.auth).failed(peer.addr.ip(), Instant::now());
        let chap_user = TextParams::parse(&req.data)
            .ok()
            .and_then(|p| p.get("CHAP_N").map(str::to_string));
        tracing::warn!(
            peer = %peer.addr,
            transport,
            target = login.target().unwrap_or("(discovery)"),
            initiator = login.initiator(),
            chap_user = chap_user.as_deref().unwrap_or("(none given)"),
            "login refused: authentication failure (CHAP)"
        );
    }

    /// The registry as one connection's login sees it: its [`LoginPolicy`].
    pub fn admission<'a>(&'a self, peer: &'a Peer) -> Admission<'a> {
        Admission {
            registry: self,
            peer,
            target: None,
            session: None,
        }
    }
}

/// The daemon's answers to a login's questions, for one connection: which targets exist, who
/// may reach them, with which CHAP credentials, and the session the login creates or joins.
pub struct Admission<'a> {
    registry: &'a Registry,
    peer: &'a Peer,
    target: Option<Arc<Target>>,
    session: Option<Arc<Session>>,
}

impl Admission<'_> {
    /// The session the login created or joined (none for discovery), once it is complete.
    pub fn take_session(&mut self) -> Option<Arc<Session>> {
        self.session.take()
    }

    /// What it has learnt so far, to go on with in the login's next request
    /// ([`Registry::admission_from`]).
    pub fn into_state(self) -> AdmissionState {
        AdmissionState {
            target: self.target,
            session: self.session,
        }
    }
}

/// What an [`Admission`] has learnt between two requests of one login (the target a normal
/// login named, the session it made): for a shell that takes a login's requests one at a time
/// as they arrive (iSER's), rather than in one loop as a TCP connection does.
#[derive(Default)]
pub struct AdmissionState {
    target: Option<Arc<Target>>,
    session: Option<Arc<Session>>,
}

impl Registry {
    /// The admission of a login that has already had `state` from earlier requests.
    pub fn admission_from<'a>(&'a self, peer: &'a Peer, state: AdmissionState) -> Admission<'a> {
        Admission {
            registry: self,
            peer,
            target: state.target,
            session: state.session,
        }
    }
}

impl LoginPolicy for Admission<'_> {
    fn normal(&mut self, initiator: &str, name: &str, tsih: u16) -> Result<Settings, LoginStatus> {
        let registry = self.registry;
        if registry.stopping() {
            return Err(LoginStatus::SERVICE_UNAVAILABLE);
        }
        let Some(target) = registry.target(name) else {
            registry.refused(self.peer.addr, initiator, name, "no such target");
            return Err(LoginStatus::NOT_FOUND);
        };
        if !target.admits(initiator, self.peer.addr.ip()) {
            let why = "initiator or network not allowed";
            registry.refused(self.peer.addr, initiator, name, why);
            return Err(LoginStatus::AUTHORIZATION_FAILURE);
        }
        if tsih != 0 && registry.sessions.get(tsih).is_none() {
            return Err(LoginStatus::SESSION_DOES_NOT_EXIST);
        }
        let mut settings = registry.settings();
        settings.declarations.target_portal_group_tag = Some(target.port_group);
        let c = target
            .config
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        require_chap(&mut settings, c.chap.as_ref(), c.mutual_chap.as_ref());
        drop(c);
        self.target = Some(target);
        Ok(settings)
    }

    fn discovery(&mut self, _initiator: &str) -> Result<Settings, LoginStatus> {
        if self.registry.stopping() {
            return Err(LoginStatus::SERVICE_UNAVAILABLE);
        }
        let mut settings = self.registry.settings();
        let c = self.registry.config();
        let i = &c.iscsi;
        let (chap, mutual) = (i.discovery_chap.as_ref(), i.discovery_mutual_chap.as_ref());
        require_chap(&mut settings, chap, mutual);
        Ok(settings)
    }

    fn refused(&mut self, initiator: &str, target: Option<&str>, e: &NegotiationError) {
        let target = target.unwrap_or("discovery");
        self.registry
            .refused(self.peer.addr, initiator, target, &e.to_string());
    }

    fn window(&self, tsih: u16, cmd_sn: SerialNumber) -> (SerialNumber, SerialNumber) {
        match (tsih != 0)
            .then(|| self.registry.sessions.get(tsih))
            .flatten()
        {
            Some(s) => s.window(),
            None => (cmd_sn, cmd_sn + (self.registry.window_for(self.peer) - 1)),
        }
    }

    fn complete(
        &mut self,
        login: &Completed,
    ) -> Result<(u16, SerialNumber, SerialNumber), LoginStatus> {
        let (registry, peer) = (self.registry, self.peer);
        let cmd = login.cmd_sn;
        let Some(target) = self.target.clone() else {
            // Discovery sessions are never joined; any non-zero TSIH outside the normal range.
            let tsih = 0x8000 | (peer.id & 0x7fff) as u16;
            return Ok((tsih, cmd, cmd + (registry.window_for(peer) - 1)));
        };
        let c = *login.negotiator.connection();
        let info = ConnectionInfo {
            cid: login.cid,
            id: peer.id,
            peer: peer.addr,
            local: peer.local,
            reactor: peer.reactor,
            digests: (c.header_digest, c.data_digest),
            iser: peer.iser,
            segment_lengths: (
                c.max_recv_data_segment_length,
                c.max_send_data_segment_length,
            ),
            control: peer.control.clone(),
        };
        let (initiator, s) = (&login.initiator, &registry.sessions);
        let session = if login.tsih == 0 {
            let params = login.negotiator.session().clone();
            let window = registry.window_for(peer);
            s.create(login.isid, initiator, target, params, window, cmd, info)
        } else {
            s.join(login.tsih, login.isid, initiator, &target.name, info)
        }
        .map_err(SessionError::status)?;
        let (exp, max) = session.window();
        tracing::info!(
            tsih = session.tsih,
            initiator = %session.initiator,
            isid = %Isid(login.isid.0),
            target = %session.target.name,
            peer = %peer.addr,
            cid = login.cid,
            "login"
        );
        let tsih = session.tsih;
        self.session = Some(session);
        Ok((tsih, exp, max))
    }

    fn entropy(&mut self) -> Result<[u8; ENTROPY_LEN], LoginStatus> {
        entropy()
    }
}

/// Makes CHAP the only AuthMethod when `chap` is configured: the initiator proves `chap`, and
/// the target proves `mutual` when the initiator asks.
fn require_chap(
    settings: &mut Settings,
    chap: Option<&crate::config::Chap>,
    mutual: Option<&crate::config::Chap>,
) {
    let Some(chap) = chap else { return };
    let creds =
        |c: &crate::config::Chap| ChapCredentials::new(&c.username, c.secret.as_bytes(), 1).ok();
    settings.auth.methods = vec![AuthMethod::Chap];
    settings.auth.peer = creds(chap);
    settings.auth.local = mutual.and_then(creds);
}

/// Starts the accept loop of a portal's listener on the daemon's runtime, handing its
/// connections to the reactors: the server's ([`crate::server`]), given to the registry when it
/// starts serving so that a reload or `targetctl portal add` starts one the same way.
pub type StartAccepting =
    Box<dyn Fn(std::net::TcpListener) -> Result<tokio::task::AbortHandle, String> + Send>;

/// The iSCSI listeners of a running server.
struct Listeners {
    start: StartAccepting,
    /// Each portal's config text, the address it listens on, its accept loop, and a
    /// duplicate of its socket for an upgrade's successor.
    accepting: Vec<(String, SocketAddr, tokio::task::AbortHandle, OwnedFd)>,
}

impl Listeners {
    /// Runs the accept loop of `listener` (the portal `text`); returns its address.
    fn accept_on(
        &mut self,
        text: String,
        listener: std::net::TcpListener,
    ) -> Result<SocketAddr, String> {
        let at = listener
            .local_addr()
            .map_err(|e| format!("server.portals: {text}: {e}"))?;
        let kept = OwnedFd::from(
            listener
                .try_clone()
                .map_err(|e| format!("server.portals: {text}: {e}"))?,
        );
        let task = (self.start)(listener).map_err(|e| format!("server.portals: {text}: {e}"))?;
        self.accepting.push((text, at, task, kept));
        Ok(at)
    }
}

/// An NVMe/TCP connection bound to a queue, as a handover finds it.
#[derive(Clone)]
pub struct NvmeQueue {
    /// Its subsystem.
    pub subsystem: Arc<NvmeSubsystem>,
    /// The queue: controller, QID, size.
    pub queue: nvme::controller::Queue,
    /// Its control (park, serve, release).
    pub control: Arc<Control>,
}
