//! A target as the daemon serves it: one SCSI device (scsi-core) shared by every session that
//! logs in to it, the logical units behind it, and who may log in.
//!
//! The device is transport-agnostic and runs under one lock per target; a call on it is a short
//! state transition. Each session's CmdSN order lives under the same lock, so handing a command
//! to the core in order is one acquisition, and a connection takes the lock at most once per
//! step (see `iscsi::connection`). What the core asks for (data-out, backend operations,
//! completions) is routed to the connection that owns the task: queued locally when that is the
//! caller, sent over the owner's channel when it lives on another reactor (multiple connections
//! per session).
//!
//! Plain reads and writes are delegated to their connection, which finishes them without the
//! core; their retirement goes through a lock-free queue (`Retirements`) that whoever takes
//! the lock next applies. So a READ or WRITE takes the lock once, when it arrives. Retiring
//! matters at once only when something waits for a task to end (a dormant ORDERED task, an
//! overlapping write, a task management function): the holder says so in
//! `Target::awaiting` before it lets the lock go, and a connection that queues a retirement
//! and sees it takes the lock to apply the queue.

use std::collections::VecDeque;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError, RwLock};

use iscsi_pdu::target_node::{Sink, TargetCore};
use scsi_core::pr::FileStore;
use scsi_core::transport::TaskCore;
use scsi_core::{BackendError, Device, NexusId, Output, TargetPort, TaskId, TmfFunction};
use tokio::sync::mpsc::UnboundedSender;

use crate::cluster::{Cluster, SharedTarget};
use crate::config;
use crate::store::UnitStore;
use crate::unit::{next_id, CachedUnit, Lun, LunStats, UnitCache, UnitMap};

/// The target portal group tag of every portal of a gateway on its own (one group, implicit
/// ALUA active/optimized); in a cluster each gateway has its own (`cluster.port_group`).
pub const PORTAL_GROUP: u16 = 1;

/// The relative target port identifier (and port group) of a lone gateway's SRP ports (its
/// iSCSI port is [`PORTAL_GROUP`]); in a cluster, see [`Target::srp_port`].
pub const SRP_RELATIVE_PORT: u16 = 2;

/// What every target of the daemon shares, fixed when it starts.
#[derive(Debug, Clone)]
pub struct TargetEnv {
    /// Where reservations made with APTPL are kept (`server.state_dir`).
    pub state_dir: Option<PathBuf>,
    /// This daemon's target portal group tag, also its portals' relative target port
    /// identifier.
    pub port_group: u16,
    /// The cluster of gateways this one belongs to, which keeps the shared units'
    /// reservations.
    pub cluster: Option<Arc<dyn Cluster>>,
}

impl TargetEnv {
    /// The environment of a daemon started with `config` (joining its `[cluster]`). Errors
    /// name the key.
    pub fn start(config: &config::Config) -> Result<TargetEnv, (String, String)> {
        let cluster = crate::cluster::start(config)?;
        Ok(TargetEnv {
            state_dir: config.server.state_dir.clone(),
            port_group: config
                .cluster
                .as_ref()
                .map_or(PORTAL_GROUP, |c| c.port_group),
            cluster,
        })
    }

    /// Where a target or subsystem made now keeps the reservations that persist through a
    /// power loss (APTPL, PTPL): `server.state_dir`, created if missing; `None` without
    /// one. Errors name the key.
    pub fn reservation_store(
        &self,
    ) -> Result<Option<Box<dyn scsi_core::pr::PrStore>>, (String, String)> {
        let Some(dir) = self.state_dir.as_deref() else {
            return Ok(None);
        };
        let store = FileStore::new(dir).map_err(|e| {
            (
                "server.state_dir".to_string(),
                format!("{}: {e}", dir.display()),
            )
        })?;
        Ok(Some(Box::new(store)))
    }

    /// A lone gateway's environment with APTPL state in `state_dir`.
    pub fn alone(state_dir: Option<PathBuf>) -> TargetEnv {
        TargetEnv {
            state_dir,
            port_group: PORTAL_GROUP,
            cluster: None,
        }
    }
}

/// What the core sends to a task's connection: the connection machine's [`CoreEvent`](iscsi_pdu::target_node::CoreEvent).
pub use iscsi_pdu::target_node::CoreEvent as Routed;

/// Where a task's actions go. The core keeps a clone for every task it runs, so the channel
/// is behind one `Arc`: a clone and a drop are one atomic operation each, where cloning the
/// sender itself takes two (its count of senders and its channel's) and dropping it two more.
#[derive(Debug, Clone)]
pub struct Route {
    /// The connection's id (unique for the life of the daemon).
    pub conn: u64,
    /// Its channel.
    pub tx: Arc<UnboundedSender<Routed>>,
}

impl Route {
    /// The route to connection `conn` over `tx`.
    pub fn new(conn: u64, tx: UnboundedSender<Routed>) -> Route {
        Route {
            conn,
            tx: Arc::new(tx),
        }
    }
}

impl iscsi_pdu::target_node::Route for Route {
    fn connection(&self) -> u64 {
        self.conn
    }
}

/// The SCSI device of a target, the routes of its tasks and the CmdSN order of its sessions:
/// iscsi-pdu's sans-IO core, its events carried over the connections' channels.
pub type Core = TargetCore<Route>;

/// Retires a delegated task ([`Router::retire`](scsi_core::transport::Router::retire)); a refusal is a connection's bug, logged.
pub fn retire(core: &mut Core, task: TaskId, out: &mut Outbox) {
    if let Err(e) = core.router().retire(task, out) {
        tracing::error!("retiring a task: {e}");
    }
}

/// Where the core's actions go from the calls of one connection (`me`): its own into `local`,
/// other connections' (multiple connections per session on other reactors) as
/// `(route, event)` values into `remote`, which the caller sends once it has let the core's
/// lock go ([`Outbox::send_remote`]): the core routes, it does not send.
#[derive(Debug)]
pub struct Outbox {
    /// The calling connection.
    pub me: u64,
    /// Its own events.
    pub local: VecDeque<Routed>,
    /// Other connections' events.
    pub remote: Vec<(Route, Routed)>,
    /// Changes to shared reservations, for the target's keeper once the lock is let go.
    pub changes: Vec<scsi_core::ReservationChange>,
    /// SET TARGET PORT GROUPS on shared units, for the same keeper.
    pub port_groups: Vec<scsi_core::PortGroupsChange>,
}

impl Outbox {
    /// An outbox that sends everything over the owners' channels, for a caller that is no
    /// connection (a retirement, a reload that removes a unit); empty, it holds no memory.
    pub fn detached() -> Outbox {
        Outbox {
            me: 0,
            local: VecDeque::new(),
            remote: Vec::new(),
            changes: Vec::new(),
            port_groups: Vec::new(),
        }
    }

    /// An empty outbox for connection `me`, with room for a few hundred events.
    pub fn new(me: u64) -> Outbox {
        Outbox {
            me,
            local: VecDeque::with_capacity(256),
            remote: Vec::new(),
            changes: Vec::new(),
            port_groups: Vec::new(),
        }
    }

    /// Sends the other connections' events over their channels.
    pub fn send_remote(&mut self) {
        for (route, event) in self.remote.drain(..) {
            // A closed channel is a connection that has ended; its tasks end with it.
            let _ = route.tx.send(event);
        }
    }
}

impl Sink<Route> for Outbox {
    fn push(&mut self, route: &Route, event: Routed) {
        if route.conn == self.me {
            self.local.push_back(event);
        } else {
            self.remote.push((route.clone(), event));
        }
    }

    fn unrouted(&mut self, action: scsi_core::Action) {
        tracing::warn!(?action, "an action for a task without a connection");
    }

    fn reservation_change(
        &mut self,
        change: scsi_core::ReservationChange,
    ) -> Option<scsi_core::ReservationChange> {
        // Handed to the keeper once the lock is let go (`Target::unlock_core`).
        self.changes.push(change);
        None
    }

    fn port_groups_change(
        &mut self,
        change: scsi_core::PortGroupsChange,
    ) -> Option<scsi_core::PortGroupsChange> {
        self.port_groups.push(change);
        None
    }
}

/// A target's SCSI core as one step of a connection or channel reaches it (a PDU or IU read,
/// a turn of its worker): the transport machines' [`TaskCore`]. The core's lock is taken at most
/// once per step, when the machine first needs the core, and let go when the step ends; then
/// what the core routed to other connections is sent. So a command's ordering, submission and
/// immediate data cost one acquisition, and a turn that finishes several tasks takes it once
/// for all of them. iSCSI's connections (with their session around it) and SRP's channels
/// both step through it.
pub(crate) struct CoreStep<'a> {
    /// The target and the I_T nexus, `None` for a discovery session (no core).
    target: Option<(&'a Target, NexusId)>,
    route: &'a Route,
    /// Where the core's answers go: this connection's, and others' until the step ends.
    pub(crate) out: &'a mut Outbox,
    /// The connection's cache of the target's units.
    pub(crate) units: &'a mut UnitCache<u16>,
    /// The core's lock, once this step has taken it.
    guard: Option<MutexGuard<'a, Core>>,
}

impl<'a> CoreStep<'a> {
    /// A step of the connection with `route` on `target`'s core for `nexus`.
    pub(crate) fn new(
        target: Option<(&'a Target, NexusId)>,
        route: &'a Route,
        out: &'a mut Outbox,
        units: &'a mut UnitCache<u16>,
    ) -> CoreStep<'a> {
        CoreStep {
            target,
            route,
            out,
            units,
            guard: None,
        }
    }

    /// The core's call `f` for the nexus, the lock taken if this step does not hold it yet,
    /// and what the core hands back drained into the outbox; `None` without a core.
    pub(crate) fn core<R>(
        &mut self,
        f: impl FnOnce(&mut Core, NexusId, &Route, &mut Outbox) -> R,
    ) -> Option<R> {
        let (target, nexus) = self.target?;
        let core = match &mut self.guard {
            Some(core) => core,
            None => self.guard.insert(target.lock_core(self.out)),
        };
        Some(f(core, nexus, self.route, self.out))
    }

    /// Adds the commands the step counted to their units' counters ([`UnitCache::flush`]) and
    /// lets the core's lock go ([`Target::unlock_core`]: what the core routed to other
    /// connections is sent, and its reservation changes reach the keeper); done before taking
    /// locks that are taken before it elsewhere (the session registry's), and when the step
    /// ends, before anything it made is sent.
    pub(crate) fn release(&mut self) {
        self.units.flush();
        match (self.guard.take(), self.target) {
            (Some(core), Some((target, _))) => target.unlock_core(core, self.out),
            _ => self.out.send_remote(),
        }
    }
}

/// A step ends when it is dropped: the lock it took is let go as every holder lets it go.
impl Drop for CoreStep<'_> {
    fn drop(&mut self) {
        self.release();
    }
}

impl TaskCore for CoreStep<'_> {
    fn data_out(&mut self, task: TaskId, data: &[u8]) {
        self.core(|core, _, _, out| {
            if let Err(e) = core.router().data_out(task, data, out) {
                tracing::warn!("data-out refused by the core: {e}");
            }
        });
    }

    fn backend_done(&mut self, task: TaskId, result: Result<Output, BackendError>) {
        self.core(|core, _, _, out| {
            if let Err(e) = core.router().backend_done(task, result, out) {
                tracing::warn!("a backend completion refused by the core: {e}");
            }
        });
    }

    fn retire(&mut self, task: TaskId) {
        match (&mut self.guard, self.target) {
            (Some(core), _) => retire(core, task, self.out),
            // No lock taken for it: queued for the next holder (see `Target::retire`).
            (None, Some((target, _))) => target.retire(task),
            (None, None) => {}
        }
    }

    fn task_management(&mut self, lun: u64, function: TmfFunction) -> Option<u64> {
        self.core(|core, nexus, route, out| {
            core.router()
                .task_management(nexus, lun, function, route, out)
                .map_err(|e| tracing::error!("task management refused by the core: {e}"))
                .ok()
        })
        .flatten()
    }

    fn block_size(&mut self, lun: u16) -> Option<u32> {
        let (target, _) = self.target?;
        self.units.block_size(&target.luns, lun)
    }
}

/// How many ended delegated tasks a target queues for retirement before a connection takes the
/// lock to retire its own (each holder of the lock empties the queue).
const RETIREMENTS: usize = 4096;

/// A bounded lock-free queue of task handles (Vyukov's bounded queue, in safe atomics): any
/// connection pushes; only the holder of the core's lock pops, so pops never race each other.
struct Retirements {
    slots: Box<[RetireSlot]>,
    mask: u64,
    /// The next position to push to (claimed by compare-and-swap).
    tail: AtomicU64,
    /// The next position to pop from (changed only under the core's lock).
    head: AtomicU64,
}

/// A slot: `seq` is its position plus one once a task is in it, the position a lap later once
/// it is free again.
struct RetireSlot {
    seq: AtomicU64,
    task: AtomicU64,
}

impl Retirements {
    fn new(capacity: usize) -> Retirements {
        let capacity = capacity.next_power_of_two();
        Retirements {
            slots: (0..capacity as u64)
                .map(|i| RetireSlot {
                    seq: AtomicU64::new(i),
                    task: AtomicU64::new(0),
                })
                .collect(),
            mask: capacity as u64 - 1,
            tail: AtomicU64::new(0),
            head: AtomicU64::new(0),
        }
    }

    /// Queues `task`; false when the queue is full.
    fn push(&self, task: TaskId) -> bool {
        let mut pos = self.tail.load(Ordering::Relaxed);
        loop {
            let slot = &self.slots[(pos & self.mask) as usize];
            let seq = slot.seq.load(Ordering::Acquire);
            match seq.wrapping_sub(pos) as i64 {
                0 => match self.tail.compare_exchange_weak(
                    pos,
                    pos + 1,
                    Ordering::Relaxed,
                    Ordering::Relaxed,
                ) {
                    Ok(_) => {
                        slot.task.store(task.to_bits(), Ordering::Relaxed);
                        slot.seq.store(pos + 1, Ordering::SeqCst);
                        return true;
                    }
                    Err(now) => pos = now,
                },
                d if d < 0 => return false,
                _ => pos = self.tail.load(Ordering::Relaxed),
            }
        }
    }

    /// The oldest queued task, if its push has finished. Only the holder of the core's lock
    /// calls this.
    fn pop(&self) -> Option<TaskId> {
        let pos = self.head.load(Ordering::Relaxed);
        let slot = &self.slots[(pos & self.mask) as usize];
        if slot.seq.load(Ordering::SeqCst) != pos + 1 {
            return None;
        }
        let task = TaskId::from_bits(slot.task.load(Ordering::Relaxed));
        slot.seq.store(pos + self.mask + 1, Ordering::Release);
        self.head.store(pos + 1, Ordering::Relaxed);
        Some(task)
    }
}

/// "port group 1 active/optimized, port group 2 standby": for the log line of a change.
pub fn port_group_states(groups: &[scsi_core::spc::tpg::PortGroup]) -> String {
    groups
        .iter()
        .map(|g| format!("port group {} {}", g.id, g.state.name()))
        .collect::<Vec<_>>()
        .join(", ")
}

/// A target: name, access rules, logical units and its SCSI device.
pub struct Target {
    /// Unique for the daemon's life.
    pub id: u64,
    /// The iSCSI name.
    pub name: String,
    /// Access rules and CHAP (the `luns` list here is not kept current; see [`Target::luns`]).
    pub config: RwLock<config::Target>,
    /// The logical units by LUN index.
    pub luns: UnitMap<u16>,
    core: Mutex<Core>,
    /// How often `core` was locked: the figure the lock-per-command goal is checked by.
    acquisitions: AtomicU64,
    /// Delegated tasks that have ended, for the next holder of `core` to retire.
    retired: Retirements,
    /// Whether the last holder of `core` left something waiting for a retirement: a
    /// connection that queues one then takes the lock to apply the queue.
    awaiting: AtomicBool,
    /// Itself, for storage that calls back (an RBD image resized by another client) and for
    /// the cluster.
    this: std::sync::Weak<Target>,
    /// The target portal group tag of this gateway's portals.
    pub port_group: u16,
    /// The cluster of gateways that shares its units, if any.
    cluster: Option<Arc<dyn Cluster>>,
    /// Held while a unit's size changes, so a resize here and one seen through the image's
    /// watch do not interleave.
    resizing: Mutex<()>,
}

impl std::fmt::Debug for Target {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Target").field("name", &self.name).finish()
    }
}

impl Target {
    /// A target with the logical units of `config`, opened now; reservations made with APTPL
    /// are kept in `env.state_dir` (`server.state_dir`), and those saved there are loaded; in
    /// a cluster, RBD units' reservations are the cluster's.
    pub fn new(config: &config::Target, env: &TargetEnv) -> Result<Arc<Target>, (String, String)> {
        let port = TargetPort::iscsi(&config.name, env.port_group);
        let mut device = Device::new(&config.name, vec![port]);
        device.set_delegation(true);
        if let Some(store) = env.reservation_store()? {
            device.set_reservation_store(store);
        }
        let target = Arc::new_cyclic(|this| Target {
            id: next_id(),
            name: config.name.clone(),
            config: RwLock::new(config.clone()),
            luns: UnitMap::default(),
            core: Mutex::new(Core::new(device)),
            acquisitions: AtomicU64::new(0),
            retired: Retirements::new(RETIREMENTS),
            awaiting: AtomicBool::new(false),
            this: this.clone(),
            resizing: Mutex::new(()),
            port_group: env.port_group,
            cluster: env.cluster.clone(),
        });
        for lun in &config.luns {
            target
                .add_lun(lun, Arc::default())
                .map_err(|reason| (format!("lun {}", lun.lun), reason))?;
        }
        Ok(target)
    }

    /// Runs `f` on the SCSI core under its lock, as a caller that is no connection (an
    /// administrator's change, a keeper's decision, a login): what the core routes goes to
    /// the connections, and its reservation changes to the cluster, once the lock is let go
    /// (as every holder lets it go: see `Target::unlock_core`).
    pub fn with_core<T>(&self, f: impl FnOnce(&mut Core, &mut Outbox) -> T) -> T {
        let mut out = Outbox::detached();
        let mut core = self.lock_core(&mut out);
        let r = f(&mut core, &mut out);
        self.unlock_core(core, &mut out);
        r
    }

    /// Takes the core's lock and retires the queued delegated tasks, what that causes going
    /// to `out`. Every holder lets it go with [`Target::unlock_core`]; the guard's own drop
    /// only unlocks.
    pub(crate) fn lock_core(&self, out: &mut Outbox) -> MutexGuard<'_, Core> {
        let mut core = self.core.lock().unwrap_or_else(PoisonError::into_inner);
        // Counted under the lock, so only its holder writes: a load and a store, not a locked
        // read-modify-write (the lock orders one holder's store before the next one's load).
        let n = self.acquisitions.load(Ordering::Relaxed);
        self.acquisitions.store(n + 1, Ordering::Relaxed);
        self.retire_queued(&mut core, out);
        core
    }

    /// Lets the core's lock go: records whether anything waits for a retirement (retiring
    /// what was queued meanwhile while something does), unlocks, then sends what the core
    /// routed to other connections and hands the reservation changes in `out` to the keeper.
    pub(crate) fn unlock_core(&self, mut core: MutexGuard<'_, Core>, out: &mut Outbox) {
        loop {
            let waiting = core.device().awaits_retirement();
            // Sequentially consistent with a connection's push and its load of the flag (see
            // `Target::retire`): a retirement queued after the look below sees the flag.
            self.awaiting.store(waiting, Ordering::SeqCst);
            if !waiting || !self.retire_queued(&mut core, out) {
                break;
            }
        }
        drop(core);
        out.send_remote();
        if !out.changes.is_empty() {
            self.hand_over_reservation_changes(std::mem::take(&mut out.changes));
        }
        if !out.port_groups.is_empty() {
            self.hand_over_port_groups_changes(std::mem::take(&mut out.port_groups));
        }
    }

    /// Retires the queued delegated tasks; whether there were any.
    fn retire_queued(&self, core: &mut Core, out: &mut Outbox) -> bool {
        let mut any = false;
        while let Some(task) = self.retired.pop() {
            retire(core, task, out);
            any = true;
        }
        any
    }

    /// Counts a finished task on its unit, through a connection's cache of the units.
    pub fn account(&self, cache: &mut UnitCache<u16>, a: &scsi_core::transport::Accounting) {
        if let Some(index) = scsi_core::lun_index(a.lun) {
            cache.account(&self.luns, index, a);
        }
    }

    /// Counts a finished task on its unit in a connection's tally ([`UnitCache::tally`]),
    /// which its step adds to the unit's counters when it ends.
    pub fn tally(&self, cache: &mut UnitCache<u16>, a: &scsi_core::transport::Accounting) {
        if let Some(index) = scsi_core::lun_index(a.lun) {
            cache.tally(&self.luns, index, a);
        }
    }

    /// Unit `index` for a backend operation, through a connection's cache; `None` when it
    /// is gone (removed while the task ran), which the machine hears as a backend error.
    pub fn cached_lun<'c>(
        &self,
        cache: &'c mut UnitCache<u16>,
        index: u16,
    ) -> Option<CachedUnit<'c>> {
        cache.unit(&self.luns, index)
    }

    /// A delegated task has ended at its connection, which does not hold the core's lock:
    /// queued for the next holder, who retires it; at once when something waits for it.
    pub fn retire(&self, task: TaskId) {
        if !self.retired.push(task) {
            // Full: retire it now (the acquisition empties the queue as well).
            self.with_core(|core, out| retire(core, task, out));
            return;
        }
        // Sequentially consistent with the holder's store of `awaiting` and its look at the
        // queue after it: either it sees this task queued, or this sees its flag.
        if self.awaiting.load(Ordering::SeqCst) {
            // Taking the lock retires the queue.
            self.with_core(|_, _| ());
        }
    }

    /// How many times the SCSI core's lock has been taken since the target was made.
    pub fn core_acquisitions(&self) -> u64 {
        self.acquisitions.load(Ordering::Relaxed)
    }

    /// A logical unit by LUN index.
    pub fn lun(&self, index: u16) -> Option<Arc<Lun>> {
        self.luns.get(index)
    }

    /// Every logical unit, by LUN.
    pub fn lun_list(&self) -> Vec<Arc<Lun>> {
        self.luns.list().into_iter().map(|(_, u)| u).collect()
    }

    /// The target as this gateway exports it, for the cluster's comparison of whole targets
    /// ([`cluster::definition`]): its access rules, its CHAP (the user and a digest of the
    /// secret, never the secret), and each unit (an RBD image with its block size and
    /// whether it is read-only, or this gateway's own storage).
    pub fn definition(&self) -> cluster::definition::Definition {
        let mut d = cluster::definition::Definition::new();
        {
            let c = self.config.read().unwrap_or_else(PoisonError::into_inner);
            d.insert("initiators".into(), listed(c.initiators.clone()));
            d.insert("networks".into(), listed(c.networks.clone()));
            d.insert(
                "srp_initiators".into(),
                listed(c.srp_initiators.iter().map(|i| i.to_lowercase()).collect()),
            );
            let chap = |chap: &Option<config::Chap>| match chap {
                None => "none".to_string(),
                Some(c) => format!(
                    "user {} secret-digest {}",
                    c.username,
                    secret_digest(&self.name, &c.username, &c.secret)
                ),
            };
            d.insert("chap".into(), chap(&c.chap));
            d.insert("mutual_chap".into(), chap(&c.mutual_chap));
        }
        let gateway = self.cluster.as_ref().map(|c| c.gateway()).unwrap_or("");
        for lun in self.lun_list() {
            d.insert(format!("lun.{}", lun.config.lun), lun.definition(gateway));
        }
        d
    }

    /// Opens and adds a logical unit; in a cluster, one on shared storage enters the device
    /// with the shared reservations it has now, then follows them.
    pub fn add_lun(&self, config: &config::Lun, stats: Arc<LunStats>) -> Result<(), String> {
        let config = match &self.cluster {
            Some(cluster) => cluster.unit_config(&self.name, config),
            None => std::borrow::Cow::Borrowed(config),
        };
        let mut lun = Lun::open(&config, stats)?;
        lun.storage.watch_size(self.capacity_of(config.lun))?;
        let unit = lun.logical_unit(&self.name, self.cluster.as_ref().map(|c| c.gateway()));
        let mut adopted = None;
        if let Some(cluster) = &self.cluster {
            let mut adopt = |version, state| {
                let unit = adopted.insert(unit.clone());
                self.with_core(|core, out| {
                    let router = core.router();
                    router.add_unit(config.lun, unit.clone(), out)?;
                    router.share_reservations(config.lun)?;
                    // The cluster decides its port groups, and initiators may choose (SET
                    // TARGET PORT GROUPS).
                    router.share_port_groups(config.lun)?;
                    // A unit just shared has applied no version: the state read always lands.
                    let _fresh = router.apply_reservations(
                        config.lun,
                        version,
                        state,
                        &Default::default(),
                        out,
                    );
                    Ok(())
                })
                .map_err(|e: scsi_core::DeviceError| e.to_string())
            };
            match cluster.share(self.this.clone(), &config, &*lun.storage, &mut adopt) {
                Ok(following) => lun.shared = following,
                Err(e) => {
                    if adopted.is_some() {
                        let _ = self.remove_lun(config.lun);
                    }
                    return Err(e);
                }
            }
        }
        if adopted.is_none() {
            self.with_core(|core, out| core.router().add_unit(config.lun, unit, out))
                .map_err(|e| e.to_string())?;
        }
        self.luns.insert(config.lun, Arc::new(lun));
        Ok(())
    }

    /// Removes a logical unit; its tasks are aborted.
    pub fn remove_lun(&self, index: u16) -> Result<(), String> {
        self.with_core(|core, out| core.router().remove_unit(index, out))
            .map_err(|e| e.to_string())?;
        self.luns.remove(index);
        Ok(())
    }

    /// Changes a unit's size (a file grows or shrinks); initiators get CAPACITY DATA HAS
    /// CHANGED.
    pub fn resize_lun(&self, index: u16, bytes: u64) -> Result<(), String> {
        let _resizing = self.resizing.lock().unwrap_or_else(PoisonError::into_inner);
        let old = self.lun(index).ok_or(format!("no LUN {index}"))?;
        let (storage, blocks) = old.resize_storage(bytes)?;
        self.replace_resized(&old, storage, blocks)
    }

    /// Puts a unit of `blocks` blocks on `storage` in `old`'s place (counters and faults
    /// kept), and tells the device: initiators get CAPACITY DATA HAS CHANGED.
    fn replace_resized(
        &self,
        old: &Lun,
        storage: Arc<dyn UnitStore>,
        blocks: u64,
    ) -> Result<(), String> {
        let index = old.config.lun;
        let lun = old.resized(storage, blocks);
        self.luns.insert(index, Arc::new(lun));
        self.with_core(|core, out| core.router().resize_unit(index, blocks, out))
            .map_err(|e| e.to_string())
    }

    /// What an image's resize watch calls with the new size of unit `lun`: this target's
    /// [`Target::capacity_changed`], while the target lives.
    fn capacity_of(&self, lun: u16) -> Arc<dyn Fn(u64) + Send + Sync> {
        let target = self.this.clone();
        Arc::new(move |bytes| {
            if let Some(t) = target.upgrade() {
                t.capacity_changed(lun, bytes);
            }
        })
    }

    /// The storage of unit `index` says its size is now `bytes` (an RBD image resized by
    /// another client): the unit takes that size, and initiators get CAPACITY DATA HAS
    /// CHANGED. Nothing happens when the unit has that size already.
    pub fn capacity_changed(&self, index: u16, bytes: u64) {
        let _resizing = self.resizing.lock().unwrap_or_else(PoisonError::into_inner);
        let Some(old) = self.lun(index) else { return };
        let blocks = bytes / u64::from(old.block_size);
        if blocks == old.blocks {
            return;
        }
        tracing::info!(
            target = %self.name,
            lun = index,
            from = old.blocks,
            to = blocks,
            "the unit's storage was resized elsewhere"
        );
        // The same store, which someone else resized.
        if let Err(e) = self.replace_resized(&old, old.storage.clone(), blocks) {
            tracing::warn!(target = %self.name, lun = index, "cannot resize: {e}");
        }
    }

    /// Opens shared unit `index` again on the process's current connection to the cluster
    /// and reloads its reservations: this gateway was fenced (its old connection is
    /// blocklisted and does nothing more) and rejoins. Counters, faults and the unit's
    /// identity stay; a size changed meanwhile reaches initiators as CAPACITY DATA HAS
    /// CHANGED, and what the reservations went through as the unit attentions of
    /// [`ReservationEffects::missed`](scsi_core::pr::ReservationEffects::missed).
    pub fn reopen_shared_lun(&self, index: u16) -> Result<(), String> {
        let _resizing = self.resizing.lock().unwrap_or_else(PoisonError::into_inner);
        let old = self.lun(index).ok_or(format!("no LUN {index}"))?;
        let (Some(cluster), Some(_)) = (&self.cluster, &old.shared) else {
            return Err("not a shared unit".into());
        };
        let mut lun = Lun::open(&old.config, old.stats.clone())?;
        lun.faults = old.faults.clone();
        lun.storage.watch_size(self.capacity_of(index))?;
        let blocks = lun.blocks;
        let mut adopt = |version, state| {
            let applied = self.with_core(|core, out| {
                let router = core.router();
                if blocks != old.blocks {
                    router.resize_unit(index, blocks, out)?;
                }
                Ok(router.catch_up_reservations(index, version, state, out))
            });
            if !applied.map_err(|e: scsi_core::DeviceError| e.to_string())? {
                tracing::debug!(target = %self.name, lun = index, version, "the reservations were current already");
            }
            Ok(())
        };
        lun.shared = cluster.share(self.this.clone(), &old.config, &*lun.storage, &mut adopt)?;
        if lun.shared.is_none() {
            return Err("its storage is no longer shared".into());
        }
        self.luns.insert(index, Arc::new(lun));
        Ok(())
    }

    /// Hands the changes to shared reservations the core made to their keeper; without one
    /// (no cluster: cannot happen, only a cluster shares a unit) the core refuses them.
    fn hand_over_reservation_changes(&self, changes: Vec<scsi_core::ReservationChange>) {
        if let Some(cluster) = &self.cluster {
            for change in changes {
                cluster.submit(self.this.clone(), change);
            }
            return;
        }
        self.with_core(|core, out| {
            for change in changes {
                core.router().refuse_reservation_change(change, out);
            }
        });
    }

    /// Hands SET TARGET PORT GROUPS on shared units to the cluster, which decides which
    /// gateway is optimized; without one (cannot happen: only a cluster shares port groups)
    /// the command ends NOT READY.
    fn hand_over_port_groups_changes(&self, changes: Vec<scsi_core::PortGroupsChange>) {
        for change in changes {
            match &self.cluster {
                Some(cluster) => cluster.submit_port_groups(self.this.clone(), change),
                None => self.port_groups_change_done(
                    change.task,
                    Err(scsi_core::BackendError::Unavailable.into()),
                ),
            }
        }
    }

    /// The cluster decided SET TARGET PORT GROUPS task `task` (and gave the unit its new
    /// groups when it succeeded).
    pub fn port_groups_change_done(&self, task: TaskId, result: Result<(), scsi_core::Sense>) {
        let done =
            self.with_core(|core, out| core.router().port_groups_change_done(task, result, out));
        if let Err(e) = done {
            tracing::debug!("a SET TARGET PORT GROUPS command: {e}");
        }
    }

    /// The keeper of unit `lun`'s shared reservations says they are `state` at `version`.
    pub fn apply_shared_reservations(
        &self,
        lun: u16,
        version: u64,
        state: scsi_core::pr::Reservations,
        effects: &scsi_core::pr::ReservationEffects,
    ) {
        let applied = self.with_core(|core, out| {
            core.router()
                .apply_reservations(lun, version, state, effects, out)
        });
        if !applied {
            // A notify heard twice, or after a newer state was read: nothing to do.
            tracing::debug!(target = %self.name, lun, version, "a reservation change heard late or twice");
        }
    }

    /// How many tasks on unit `lun` were aborted and have not ended yet (their I/O is under
    /// way).
    pub fn aborted_tasks_in_flight(&self, lun: u16) -> usize {
        self.with_core(|core, _| core.device().aborted_tasks_in_flight(lun))
    }

    /// The keeper has decided the change of reservation task `task`.
    pub fn reservation_done(&self, task: TaskId, result: Result<(), scsi_core::pr::PrError>) {
        let done = self.with_core(|core, out| core.router().reservation_done(task, result, out));
        if let Err(e) = done {
            // The task's connection is gone and aborted it: nothing waits for the answer.
            tracing::debug!("a reservation change's command: {e}");
        }
    }

    /// Unit `lun`'s target port groups and their access states are now `groups` (the
    /// cluster's gateways changed): initiators hear ASYMMETRIC ACCESS STATE CHANGED.
    pub fn set_port_groups(&self, lun: u16, groups: Vec<scsi_core::spc::tpg::PortGroup>) {
        let states = port_group_states(&groups);
        let changed = self.with_core(|core, out| core.router().set_port_groups(lun, groups, out));
        if let Ok(true) = changed {
            tracing::info!(target = %self.name, lun, %states, "asymmetric access states changed");
        }
    }

    /// Unit `lun`'s target port groups and their access states now.
    pub fn port_groups(&self, lun: u16) -> Option<Vec<scsi_core::spc::tpg::PortGroup>> {
        self.with_core(|core, _| core.device().port_groups(lun))
    }

    /// The I_T nexus holding unit `lun`'s persistent reservation (its initiator port's
    /// name) and the reservation's TYPE, or the SPC-2 reservation's holder with no type.
    pub fn reservation_holder(&self, lun: u16) -> Option<(String, Option<u8>)> {
        self.with_core(|core, _| {
            let (r, _) = core.device().reservations(lun)?;
            if let Some(held) = &r.persistent.reservation {
                return Some((held.holder.initiator.name.clone(), Some(held.kind)));
            }
            r.spc2.as_ref().map(|n| (n.initiator.name.clone(), None))
        })
    }

    /// The keeper has carried out the change task management function `reference` waits for.
    pub fn task_management_change_done(&self, reference: u64) {
        self.with_core(|core, out| core.router().task_management_change_done(reference, out));
    }

    /// The relative target port identifier and the target port group of this target's SRP
    /// port: alone, port 2 in a group of its own (its iSCSI port is 1); in a cluster, this
    /// gateway's SRP port ([`crate::cluster::srp_relative_port`]) in this gateway's group,
    /// so that the cluster's access states hold for SRP as for iSCSI. `None` in a cluster
    /// whose port group leaves no room for one (above 32767; the config refuses it).
    pub fn srp_port(&self) -> Option<(u16, u16)> {
        match &self.cluster {
            None => Some((SRP_RELATIVE_PORT, SRP_RELATIVE_PORT)),
            Some(_) => {
                crate::cluster::srp_relative_port(self.port_group).map(|p| (p, self.port_group))
            }
        }
    }

    /// Whether `initiator` connecting from `addr` may log in.
    pub fn admits(&self, initiator: &str, addr: std::net::IpAddr) -> bool {
        let c = self.config.read().unwrap_or_else(PoisonError::into_inner);
        let name_ok = c.initiators.is_empty()
            || c.initiators
                .iter()
                .any(|i| i.eq_ignore_ascii_case(initiator));
        let net_ok = c.networks.is_empty()
            || c.networks
                .iter()
                .filter_map(|n| config::Network::parse(n).ok())
                .any(|n| n.contains(addr));
        name_ok && net_ok
    }
}

/// The cluster reaches a target's shared units through this.
/// A digest of a CHAP secret for comparing it across gateways: MD5 over the target, the user
/// and the secret. It tells no more of the secret than one CHAP exchange on the wire (an MD5
/// over the secret and a challenge) already does.
/// A list as a definition gives it: sorted, each item once, space-separated; `any` when
/// empty (no restriction).
pub fn listed(mut items: Vec<String>) -> String {
    items.sort_unstable();
    items.dedup();
    if items.is_empty() {
        "any".to_string()
    } else {
        items.join(" ")
    }
}

fn secret_digest(target: &str, user: &str, secret: &str) -> String {
    use md5::{Digest as _, Md5};
    let mut h = Md5::new();
    for part in [target, user, secret] {
        h.update(part.as_bytes());
        h.update([0]);
    }
    h.finalize().iter().map(|b| format!("{b:02x}")).collect()
}

impl SharedTarget for Target {
    fn name(&self) -> &str {
        &self.name
    }

    fn unit_label(&self, lun: u16) -> String {
        format!("target {}\nlun {lun}\n", self.name)
    }

    fn definition(&self) -> cluster::definition::Definition {
        Target::definition(self)
    }

    fn storage(&self, lun: u16) -> Option<Arc<dyn UnitStore>> {
        Some(self.lun(lun)?.storage.clone())
    }

    fn apply_shared_reservations(
        &self,
        lun: u16,
        version: u64,
        state: scsi_core::pr::Reservations,
        effects: &scsi_core::pr::ReservationEffects,
    ) {
        Target::apply_shared_reservations(self, lun, version, state, effects)
    }

    fn catch_up_shared_reservations(
        &self,
        lun: u16,
        version: u64,
        state: scsi_core::pr::Reservations,
    ) {
        let applied = self.with_core(|core, out| {
            core.router()
                .catch_up_reservations(lun, version, state, out)
        });
        if !applied {
            tracing::debug!(target = %self.name, lun, version, "the reservations were current already");
        }
    }

    fn set_port_groups(&self, lun: u16, groups: Vec<scsi_core::spc::tpg::PortGroup>) {
        Target::set_port_groups(self, lun, groups)
    }

    fn port_groups(&self, lun: u16) -> Option<Vec<scsi_core::spc::tpg::PortGroup>> {
        Target::port_groups(self, lun)
    }

    fn reservation_holder(&self, lun: u16) -> Option<(String, Option<u8>)> {
        Target::reservation_holder(self, lun)
    }

    fn reservation_done(&self, task: TaskId, result: Result<(), scsi_core::pr::PrError>) {
        Target::reservation_done(self, task, result)
    }

    fn task_management_change_done(&self, reference: u64) {
        Target::task_management_change_done(self, reference)
    }

    fn nvme_reservation_done(&self, id: u64, _: Result<(), nvme::Status>) {
        // A target submits SCSI changes only.
        tracing::debug!(target = %self.name, id, "an NVMe reservation change's end");
    }

    fn port_groups_change_done(&self, task: TaskId, result: Result<(), scsi_core::Sense>) {
        Target::port_groups_change_done(self, task, result)
    }

    fn aborted_tasks_in_flight(&self, lun: u16) -> usize {
        Target::aborted_tasks_in_flight(self, lun)
    }

    fn reopen_shared_lun(&self, lun: u16) -> Result<(), String> {
        Target::reopen_shared_lun(self, lun)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn retirements_hand_every_task_over_once_in_push_order_per_pusher() {
        let q = Arc::new(Retirements::new(64));
        let popper = Arc::new(Mutex::new(Vec::new()));
        let threads: Vec<_> = (0..4u64)
            .map(|t| {
                let (q, popper) = (q.clone(), popper.clone());
                std::thread::spawn(move || {
                    for i in 0..20_000u64 {
                        let task = TaskId::from_bits(t << 32 | i);
                        // Full: pop under the "lock", as a connection takes the core's.
                        while !q.push(task) {
                            let mut got = popper.lock().unwrap();
                            while let Some(x) = q.pop() {
                                got.push(x);
                            }
                        }
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        let mut got = popper.lock().unwrap();
        while let Some(x) = q.pop() {
            got.push(x);
        }
        assert_eq!(got.len(), 80_000);
        // Each pusher's tasks come out in its order, none twice.
        let mut next = [0u64; 4];
        for x in got.iter() {
            let b = x.to_bits();
            let (t, i) = ((b >> 32) as usize, b & 0xffff_ffff);
            assert_eq!(i, next[t], "pusher {t}");
            next[t] += 1;
        }
        assert!(q.pop().is_none());
    }

    /// A gateway's own storage (memory, a file) under a target that several gateways of a
    /// cluster export is another disk on each: its identity names the gateway, so an
    /// initiator's multipath never takes the two for one disk. A lone target's is as before.
    #[test]
    fn a_gateways_own_storage_has_an_identity_of_its_own() {
        let text =
            "[server]\nportals = [\"127.0.0.1:0\"]\n[[targets]]\nname = \"iqn.2026-11.test:t\"\n\
                    [[targets.luns]]\nlun = 1\nbackend = \"memory\"\nsize = \"1MiB\"\n";
        let config =
            config::Config::parse(std::path::Path::new("/tmp/x.toml"), text).expect("a config");
        let lun = Lun::open(&config.targets[0].luns[0], Arc::default()).expect("a memory unit");
        let naa = |gateway| lun.logical_unit("iqn.2026-11.test:t", gateway).identity.naa;
        assert_ne!(naa(Some("gw1")), naa(Some("gw2")));
        assert_eq!(naa(Some("gw1")), naa(Some("gw1")), "stable");
        assert_eq!(
            naa(None),
            scsi_core::lu::Identity::new("TARGETD", "", "", b"iqn.2026-11.test:t/1/").naa,
            "a lone target's identity is unchanged"
        );
    }

    #[test]
    fn a_full_retirement_queue_refuses() {
        let q = Retirements::new(4);
        for i in 0..4 {
            assert!(q.push(TaskId::from_bits(i)));
        }
        assert!(!q.push(TaskId::from_bits(9)));
        assert_eq!(q.pop(), Some(TaskId::from_bits(0)));
        assert!(q.push(TaskId::from_bits(9)));
        let rest: Vec<u64> = std::iter::from_fn(|| q.pop())
            .map(TaskId::to_bits)
            .collect();
        assert_eq!(rest, [1, 2, 3, 9]);
    }
}
