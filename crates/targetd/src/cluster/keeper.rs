//! Several gateways as one target (`[cluster]`, feature `rbd`): the reservations of every RBD
//! unit live in one RADOS object per image, so a reservation taken through one gateway binds
//! the initiators of every gateway.
//!
//! What a gateway decides is storage-target-cluster's sans-IO machine
//! ([`cluster::Gateway`]): membership and liveness from notify outcomes, the ALUA states that
//! follow, each change to shared reservations decided by compare-and-swap over
//! [`Reservations::apply`] and told to every gateway, whom to fence, and when to rejoin. This
//! module is its shell on RADOS: two threads carry out its requests, one per lane
//! ([`cluster::Lane`]: the changes, one after the other; "who is alive", fencing and
//! rejoining), since a notify waits up to its timeout; librados' callbacks hand it the
//! notifications and lost watches; and its events reach the targets (states applied, port
//! groups, commands ended).
//!
//! A PERSISTENT RESERVE OUT, RESERVE or RELEASE on a shared unit waits while the machine
//! decides it: read the object and its version; apply the request (which may refuse it:
//! RESERVATION CONFLICT, sense); write the new state only if the object is still at the
//! version read (of two gateways racing, one wins, the other reads again and decides again);
//! apply it here, then notify every gateway watching the object: each applies the new state,
//! establishes the unit attentions and aborts the tasks of the nexuses it carries, and
//! acknowledges; those that do not within `cluster.notify_timeout` are fenced (blocklisted,
//! their image locks broken) before the command ends. So the command that changed the
//! reservations ends only after every live gateway enforces the change or can write nothing.
//! A state is applied only when its version is newer than the one a gateway holds, so a
//! change heard twice (its own notify) or late changes nothing.
//!
//! APTPL is natural: the object outlives every gateway. Without APTPL the state is cleared when
//! a gateway opens the unit and no gateway watches the object (all of them restarted), as a
//! power loss clears a lone target's.
//!
//! Which gateways are alive comes from RADOS too: each gateway lists itself (name, port group,
//! portals) in the object `<cluster>.gateways` and watches it; a notify on it is answered by
//! every live gateway with its name, and one that does not answer within
//! `cluster.membership_timeout` (1 s) is down (and fenced). Every gateway asks every
//! `cluster.membership_interval` (0.5 s) and derives the same implicit ALUA states for every unit: the live
//! gateway with the lowest port group (or the unit's preferred one) is active/optimized, the
//! other live ones active/non-optimized (or standby), the rest unavailable. A change reaches
//! initiators as ASYMMETRIC ACCESS STATE CHANGED; SendTargets on any gateway lists every
//! gateway's portals with their port groups.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError, Weak};
use std::time::{Duration, Instant};

use backend::rbd::rados::{CasError, Notification, Pool, Watch};
use backend::rbd::{Cluster, ImageSpec};
use cluster::ask::Refusal;
use cluster::definition::{Comparison, Decision, Record, MAX_RECORD};
use cluster::gateway::{ChangeId, Counters, Event, Outcome, Request, Settings, UnitId, MAX_OBJECT};
use cluster::{store, Gateway, Lane, Watched};
use scsi_core::pr::Reservations;
use scsi_core::{PortGroupsChange, ReservationChange, TaskId};

use super::{policy_of, Following, Member, Membership, SharedTarget};
use crate::config;
use crate::store::UnitStore;
use cluster::member::Preference;

/// How many tries a compare-and-swap edit of an object makes before it gives up.
const MAX_RACES: usize = cluster::gateway::MAX_RACES;

/// The longest a fenced gateway waits between two tries to rejoin.
pub const REJOIN_MAX_DELAY: Duration = Duration::from_secs(30);

/// A shared unit: its target and LUN.
type SharedLun = (Weak<dyn SharedTarget>, u16);

/// How often each gateway compares its shared targets' definitions with the cluster's
/// records (and records its own after an edit).
pub const DEFINITION_INTERVAL: Duration = Duration::from_secs(10);

/// One shared target's comparison with the cluster's record, and its last outcome for
/// `targetctl cluster`.
#[derive(Default)]
struct TargetComparison {
    comparison: Comparison,
    last: Option<Decision>,
}

/// What the machine and its lanes share, under one lock.
struct State {
    machine: Gateway,
    /// Each lane's requests, in order: its thread takes the head.
    lanes: [VecDeque<Request>; 2],
    /// Acknowledgements to send (by whoever pumps next).
    acks: Vec<(u64, Vec<u8>)>,
}

/// A notification heard and not yet acknowledged: its object, itself, and the pool it came
/// through (an older connection's, after a rejoin).
type Heard = (String, Notification, Arc<Pool>);

/// A change the machine decides: the command or task management function that waits.
struct Waiting {
    target: Weak<dyn SharedTarget>,
    task: Option<TaskId>,
    tmf: Option<u64>,
    /// A SET TARGET PORT GROUPS, not a change to reservations.
    port_groups: bool,
    /// An NVMe reservation change: the subsystem's name for it.
    nvme: Option<u64>,
}

/// This gateway's membership in a cluster of gateways: the machine, the pool of shared
/// objects, and the threads that carry out the machine's requests.
pub struct Keeper {
    config: config::Cluster,
    settings: Settings,
    /// The shared objects' pool, on this gateway's connection to the cluster (a new one
    /// after each rejoin).
    pool: std::sync::RwLock<Arc<Pool>>,
    state: Mutex<State>,
    /// Wakes the lane threads: a request queued, an event to hand out, time to look.
    wake: Condvar,
    /// Someone hands out the machine's events now; `pump_again`: look once more after.
    pumping: AtomicBool,
    pump_again: AtomicBool,
    /// The shared units, by the machine's unit id: (target, LUN).
    units: Mutex<HashMap<UnitId, SharedLun>>,
    next_id: AtomicU64,
    /// Changes the machine decides.
    changes: Mutex<HashMap<ChangeId, Waiting>>,
    /// Notifications heard and not yet acknowledged, by token: (object, notification, the
    /// pool it came through).
    notifications: Mutex<HashMap<u64, Heard>>,
    /// This gateway's watch on the gateways object, once it has joined.
    joined: Mutex<Option<Watch>>,
    /// This gateway's line in the gateways object, once it has joined.
    me: Mutex<Option<Member>>,
    /// Each shared target's comparison with the cluster's record of it, by target name
    /// ([`Keeper::compare_targets`]).
    targets: Mutex<HashMap<String, TargetComparison>>,
    /// Compare the targets at the next look rather than at the next interval (a unit was
    /// shared, a record write lost a race).
    compare_soon: AtomicBool,
    /// The daemon stops: the lane threads end.
    stopping: AtomicBool,
    /// An upgrade's successor that has not taken its predecessor's place yet
    /// ([`Keeper::join_as_successor`]): its line is not written.
    standby: AtomicBool,
    /// This start serves sessions kept through the service manager's store: the shared
    /// reservations they hold stay even where no gateway watches them ([`Keeper::load`]).
    keeps_sessions: AtomicBool,
    this: Weak<Keeper>,
}

impl std::fmt::Debug for Keeper {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Keeper")
            .field("cluster", &self.config.name)
            .field("gateway", &self.config.gateway)
            .finish()
    }
}

/// A unit whose shared reservations this gateway follows; dropping it stops following.
#[derive(Debug)]
pub struct SharedUnit {
    /// The object the reservations are in.
    pub oid: String,
    keeper: Weak<Keeper>,
    id: UnitId,
    _watch: Watch,
}

impl Drop for SharedUnit {
    fn drop(&mut self) {
        if let Some(k) = self.keeper.upgrade() {
            k.state().machine.remove_unit(self.id);
            crate::lock(&k.units).remove(&self.id);
        }
    }
}

impl Keeper {
    /// Connects to the cluster `c` names and starts the lanes' threads. Errors name the
    /// `[cluster]` key they are about.
    pub fn start(c: &config::Cluster) -> Result<Arc<Keeper>, (String, String)> {
        let pool = Keeper::connect(c)?;
        let mut settings = Settings::new(
            &c.name,
            &c.gateway,
            c.port_group,
            Duration::from_secs(c.notify_timeout),
        );
        settings.membership_interval = c.membership_interval;
        settings.membership_timeout = c.membership_timeout;
        settings.rejoin_max_delay = REJOIN_MAX_DELAY;
        let keeper = Arc::new_cyclic(|this| Keeper {
            this: this.clone(),
            config: c.clone(),
            state: Mutex::new(State {
                machine: Gateway::new(settings.clone()),
                lanes: [VecDeque::new(), VecDeque::new()],
                acks: Vec::new(),
            }),
            settings,
            pool: std::sync::RwLock::new(pool),
            wake: Condvar::new(),
            pumping: AtomicBool::new(false),
            pump_again: AtomicBool::new(false),
            units: Mutex::default(),
            next_id: AtomicU64::new(1),
            changes: Mutex::default(),
            notifications: Mutex::default(),
            joined: Mutex::new(None),
            me: Mutex::new(None),
            targets: Mutex::default(),
            compare_soon: AtomicBool::new(true),
            stopping: AtomicBool::new(false),
            standby: AtomicBool::new(false),
            keeps_sessions: AtomicBool::new(false),
        });
        for lane in [Lane::Changes, Lane::Membership] {
            let weak = Arc::downgrade(&keeper);
            let name = match lane {
                Lane::Changes => "reservations",
                Lane::Membership => "membership",
            };
            std::thread::Builder::new()
                .name(name.into())
                .spawn(move || Keeper::lane(weak, lane))
                .map_err(|e| ("cluster".to_string(), format!("a thread: {e}")))?;
        }
        let weak = Arc::downgrade(&keeper);
        std::thread::Builder::new()
            .name("definitions".into())
            .spawn(move || Keeper::compare_targets_every(weak))
            .map_err(|e| ("cluster".to_string(), format!("a thread: {e}")))?;
        tracing::info!(
            cluster = %c.name,
            gateway = %c.gateway,
            port_group = c.port_group,
            pool = %c.pool,
            "joined the cluster of gateways"
        );
        Ok(keeper)
    }

    /// A new connection to the cluster `c` names, and its pool of shared objects.
    fn connect(c: &config::Cluster) -> Result<Arc<Pool>, (String, String)> {
        let named = |e: backend::rbd::RbdError| (format!("cluster.{}", e.key()), e.to_string());
        let reach = crate::rbd::reach(&c.ceph_conf, &c.client, &c.keyring, c.ceph_timeout, false);
        let cluster = Cluster::shared(&reach).map_err(named)?;
        Pool::open(cluster, &c.pool, c.namespace.as_deref().unwrap_or_default()).map_err(named)
    }

    /// The pool of shared objects on the current connection.
    fn pool(&self) -> Arc<Pool> {
        self.pool
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    fn gateways_object(&self) -> String {
        self.settings.gateways_object()
    }

    fn state(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    // ---- The shell around the machine ----

    /// Moves the machine's requests to their lanes (acknowledgements to be sent) and wakes
    /// the lanes.
    fn route(&self, s: &mut State) {
        while let Some(r) = s.machine.poll_request() {
            match r {
                Request::Ack { token, reply } => s.acks.push((token, reply)),
                Request::Read { lane, .. }
                | Request::Replace { lane, .. }
                | Request::Notify { lane, .. }
                | Request::Fence { lane, .. } => s.lanes[lane_index(lane)].push_back(r),
                Request::Reconnect { .. } => s.lanes[lane_index(Lane::Membership)].push_back(r),
            }
        }
        self.wake.notify_all();
    }

    /// Gives the machine an input (`f`), then routes its requests and hands out its events.
    /// Not from under a target's core lock: events call into the targets.
    fn input(&self, f: impl FnOnce(&mut Gateway, Instant)) {
        {
            let mut s = self.state();
            f(&mut s.machine, Instant::now());
            self.route(&mut s);
        }
        self.pump();
    }

    /// Sends the acknowledgements due and hands out the machine's events, in order, one
    /// caller at a time (a caller that finds another at it asks it to look once more).
    fn pump(&self) {
        loop {
            if self.pumping.swap(true, Ordering::AcqRel) {
                self.pump_again.store(true, Ordering::Release);
                return;
            }
            loop {
                let (event, acks) = {
                    let mut s = self.state();
                    (s.machine.poll_event(), std::mem::take(&mut s.acks))
                };
                for (token, reply) in acks {
                    self.ack(token, &reply);
                }
                match event {
                    Some(e) => self.event(e),
                    None => break,
                }
            }
            self.pumping.store(false, Ordering::Release);
            if !self.pump_again.swap(false, Ordering::AcqRel) {
                return;
            }
        }
    }

    /// A lane's thread: carries out its requests one at a time, and looks at the machine's
    /// timers and events whenever it wakes.
    fn lane(weak: Weak<Keeper>, lane: Lane) {
        loop {
            let Some(k) = weak.upgrade() else { return };
            if k.stopping.load(Ordering::Acquire) {
                return;
            }
            let request = k.next(lane);
            match request.map(|r| k.carry(r)) {
                Some(Some(outcome)) => k.input(|m, now| m.handle_outcome(now, lane, outcome)),
                _ => k.pump(),
            }
            // Not held while asleep: a keeper dropped (the daemon stops) ends the thread.
            drop(k);
        }
    }

    /// The next request of `lane`, after the machine's timers that are due; `None` when there
    /// is none (after waiting for one at most until the next timer), or when events wait to
    /// be handed out.
    fn next(&self, lane: Lane) -> Option<Request> {
        let mut s = self.state();
        let now = Instant::now();
        if s.machine.poll_timeout().is_some_and(|t| t <= now) {
            s.machine.handle_timeout(now);
            self.route(&mut s);
        }
        if let Some(r) = s.lanes[lane_index(lane)].pop_front() {
            return Some(r);
        }
        if s.machine.has_events() || !s.acks.is_empty() {
            return None;
        }
        let wait = s
            .machine
            .poll_timeout()
            .map_or(self.settings.membership_interval, |t| {
                t.saturating_duration_since(now)
            })
            .clamp(Duration::from_millis(1), self.settings.membership_interval);
        let (mut s, _) = self
            .wake
            .wait_timeout(s, wait)
            .unwrap_or_else(PoisonError::into_inner);
        s.lanes[lane_index(lane)].pop_front()
    }

    /// Carries out one request on RADOS; its outcome, for all but an acknowledgement.
    fn carry(self: &Arc<Self>, r: Request) -> Option<Outcome> {
        let pool = self.pool();
        Some(match r {
            Request::Read { oid, .. } => Outcome::Read(pool.read(&oid, MAX_OBJECT).map(|v| {
                v.map(|v| store::Versioned {
                    data: v.data,
                    version: v.version,
                })
            })),
            Request::Replace {
                oid,
                expected,
                data,
                ..
            } => Outcome::Replaced(pool.replace(&oid, expected, &data).map_err(|e| match e {
                CasError::Conflict => store::CasError::Conflict,
                CasError::Rados(e) => store::CasError::Failed(e),
            })),
            Request::Notify {
                oid,
                payload,
                timeout,
                ..
            } => Outcome::Notified(pool.notify(&oid, &payload, timeout).map(|o| {
                store::NotifyOutcome {
                    acked: o.acked,
                    timed_out: o.timed_out,
                }
            })),
            Request::Fence { member, .. } => Outcome::Fenced(self.fence(&member)),
            Request::Reconnect { .. } => Outcome::Reconnected(self.reconnect()),
            Request::Ack { token, reply } => {
                self.ack(token, &reply);
                return None;
            }
        })
    }

    /// Acknowledges notification `token`.
    fn ack(&self, token: u64, reply: &[u8]) {
        let Some((oid, n, pool)) = crate::lock(&self.notifications).remove(&token) else {
            return;
        };
        if let Err(e) = pool.ack(&oid, &n, reply) {
            tracing::warn!(object = %oid, "acknowledging a notification: {}", rados_text(e));
        }
    }

    /// Carries out one of the machine's events.
    fn event(&self, e: Event) {
        match e {
            Event::PortGroups { unit, groups } => {
                if let Some((t, lun)) = self.unit(unit) {
                    t.set_port_groups(lun, groups);
                }
            }
            Event::Apply {
                unit,
                version,
                state,
                effects,
            } => {
                if let Some((t, lun)) = self.unit(unit) {
                    t.apply_shared_reservations(lun, version, state, &effects);
                }
            }
            Event::Decided { change, result } => {
                let Some(w) = crate::lock(&self.changes).remove(&change) else {
                    return;
                };
                if let Some(t) = w.target.upgrade() {
                    match w.task {
                        Some(task) if w.port_groups => t.port_groups_change_done(
                            task,
                            result.map_err(|e| match e.scsi() {
                                scsi_core::pr::PrError::Sense(s) => s,
                                scsi_core::pr::PrError::Conflict => {
                                    scsi_core::BackendError::Unavailable.into()
                                }
                            }),
                        ),
                        Some(task) => t.reservation_done(task, result.map_err(Refusal::scsi)),
                        None => {}
                    }
                    if let Some(id) = w.nvme {
                        t.nvme_reservation_done(id, result.map_err(Refusal::nvme));
                    }
                    if let Some(reference) = w.tmf {
                        t.task_management_change_done(reference);
                    }
                }
            }
            Event::AwaitAborts { unit, token } => self.await_aborts(unit, token),
            Event::Fenced | Event::Rejoined | Event::MembershipChanged(_) => {}
        }
    }

    /// The target and LUN of unit `id`, while both live.
    fn unit(&self, id: UnitId) -> Option<(Arc<dyn SharedTarget>, u16)> {
        let (t, lun) = crate::lock(&self.units).get(&id).cloned()?;
        Some((t.upgrade()?, lun))
    }

    /// PREEMPT AND ABORT: tells the machine once the tasks it aborted on `unit` here have
    /// ended, so that no write of a preempted initiator reaches the image after the command
    /// completed. Not on librados' thread, which must go on delivering notifies; the machine
    /// acknowledges anyway after `notify_timeout` (and the notifier then fences this gateway).
    fn await_aborts(&self, unit: UnitId, token: u64) {
        let Some((t, lun)) = self.unit(unit) else {
            return self.input(|m, now| m.handle_aborts_ended(now, token));
        };
        let Some(keeper) = self.this() else { return };
        let patience = Duration::from_secs(self.config.notify_timeout);
        let waited = std::thread::Builder::new()
            .name("preempt-drain".into())
            .spawn(move || {
                let deadline = Instant::now() + patience;
                while t.aborted_tasks_in_flight(lun) > 0 && Instant::now() < deadline {
                    std::thread::sleep(Duration::from_millis(1));
                }
                keeper.input(|m, now| m.handle_aborts_ended(now, token));
            });
        if let Err(e) = waited {
            tracing::warn!("a thread to wait for aborted tasks: {e}");
        }
    }

    /// This keeper, shared (from `&self`).
    fn this(&self) -> Option<Arc<Keeper>> {
        self.this.upgrade()
    }

    /// Lists this gateway (with its iSCSI `portals`) in the cluster, answers "who is alive"
    /// from now on, and starts asking it every `cluster.membership_interval` (and, once fenced,
    /// rejoining).
    pub fn join(
        self: &Arc<Self>,
        portals: &[std::net::SocketAddr],
    ) -> Result<(), (String, String)> {
        self.join_with(portals, false)
    }

    /// Joins as an upgrade's successor, while the process it succeeds is still this gateway:
    /// the units are shared and followed and "who is alive" is asked as [`Keeper::join`]
    /// does, but this gateway's line (the predecessor's) is not rewritten and this process
    /// does not answer for it until [`Keeper::take_place`], once the predecessor has parked.
    /// Until then a gateway that fences this one blocklists the predecessor, the process that
    /// serves; and what a change told this process in vain is read again at the handover.
    pub fn join_as_successor(
        self: &Arc<Self>,
        portals: &[std::net::SocketAddr],
    ) -> Result<(), (String, String)> {
        self.join_with(portals, true)
    }

    fn join_with(
        self: &Arc<Self>,
        portals: &[std::net::SocketAddr],
        successor: bool,
    ) -> Result<(), (String, String)> {
        *crate::lock(&self.me) = Some(Member {
            gateway: self.config.gateway.clone(),
            port_group: self.config.port_group,
            portals: portals.to_vec(),
            instance: 0,
            addresses: Vec::new(),
            left: false,
            srp: false,
            nvme_portals: Vec::new(),
            nvme_rdma_portals: Vec::new(),
        });
        if successor {
            self.standby.store(true, Ordering::Release);
            let me = self.identify().map_err(|e| ("cluster".to_string(), e))?;
            self.state().machine.relisted(me);
        } else {
            self.enter(false)?;
        }
        let me = crate::lock(&self.me).clone();
        if let Some(me) = me {
            self.input(|m, now| m.joined(now, me));
        }
        // The first answer to "who is alive" sets every unit's port groups before the
        // portals take logins.
        let deadline =
            Instant::now() + self.settings.membership_timeout * 2 + Duration::from_secs(1);
        while Instant::now() < deadline {
            let s = self.state();
            if !s.machine.membership().members.is_empty() || s.machine.is_fenced() {
                break;
            }
            drop(s);
            std::thread::sleep(Duration::from_millis(5));
        }
        Ok(())
    }

    /// This gateway's line with the current connection's instance and addresses.
    fn identify(&self) -> Result<Member, String> {
        let instance = self.pool().cluster().instance_id();
        let addresses = self.addresses().map_err(|e| e.to_string())?;
        let mut guard = self.me.lock().unwrap_or_else(PoisonError::into_inner);
        let me = guard.as_mut().ok_or("not joined")?;
        me.instance = instance;
        me.addresses = addresses;
        Ok(me.clone())
    }

    /// Writes this gateway's line (with the current connection's instance and addresses)
    /// in the gateways object and watches it: from now on this gateway answers "who is
    /// alive", and the others hear at once that it joined. `succeeding`: the line replaces
    /// the predecessor's of an upgrade, whose initiators' choices of this gateway go on.
    fn enter(self: &Arc<Self>, succeeding: bool) -> Result<(), (String, String)> {
        let fail = |e: String| ("cluster".to_string(), e);
        let oid = self.gateways_object();
        let me = self.identify().map_err(fail)?;
        if self.standby.load(Ordering::Acquire) {
            // A successor rejoining before it took its predecessor's place: still not the
            // gateway.
            self.state().machine.relisted(me);
            return Ok(());
        }
        self.publish(&me, succeeding)?;
        let watch = self
            .watch(&oid, Watched::Gateways)
            .map_err(|e| fail(rados_text(e)))?;
        let old = self
            .joined
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .replace(watch);
        drop(old);
        // The others look again now rather than at their next round.
        let _ = self
            .pool()
            .notify(&oid, b"joined", self.settings.membership_timeout);
        self.state().machine.relisted(me.clone());
        Ok(())
    }

    /// An upgrade's successor takes its predecessor's place, once the predecessor has
    /// parked its sessions and before this process serves them: its line (this process's
    /// instance and addresses) replaces the predecessor's, so fencing this gateway from now
    /// on blocklists this process; it answers "who is alive"; and every shared unit's
    /// reservations are read again, in case a change was told to this process while it
    /// could not be fenced for not applying it.
    pub fn take_place(self: &Arc<Self>) -> Result<(), String> {
        self.standby.store(false, Ordering::Release);
        self.enter(true).map_err(|(_, e)| e)?;
        self.catch_up()?;
        tracing::info!(
            gateway = %self.config.gateway,
            instance = self.pool().cluster().instance_id(),
            "took the predecessor's place in the cluster"
        );
        Ok(())
    }

    /// An upgrade failed after its successor may have taken this gateway's place: this
    /// process lists itself again before it serves on, and reads every shared unit's
    /// reservations again (a change told to it meanwhile could not fence it).
    pub fn list_again(self: &Arc<Self>) {
        // A successor that listed itself is fenced first (it was killed; blocklisted, its
        // watches end at once rather than hold every notify up to their timeout).
        let listed = self.pool().read(&self.gateways_object(), MAX_OBJECT);
        let instance = self.pool().cluster().instance_id();
        let successor = listed.ok().flatten().and_then(|v| {
            Member::parse_all(&v.data)
                .into_iter()
                .find(|m| m.gateway == self.config.gateway && m.instance != instance)
        });
        if let Some(successor) = successor {
            match self.fence(&successor) {
                Ok(()) => tracing::info!(
                    addresses = ?successor.addresses,
                    "fenced the failed successor that had taken this gateway's place"
                ),
                Err(e) => tracing::warn!("fencing the failed successor: {e}"),
            }
        }
        if let Err((_, e)) = self.enter(false) {
            tracing::warn!("listing this gateway again after the upgrade failed: {e}");
        }
        if let Err(e) = self.catch_up() {
            tracing::warn!("reading the shared reservations again: {e}");
        }
    }

    /// Reads every shared unit's reservations and applies those newer than the unit's, with
    /// the unit attentions of what the nexuses here missed.
    fn catch_up(&self) -> Result<(), String> {
        for (target, lun) in self.shared_units() {
            let Some(t) = target.upgrade() else { continue };
            let Some(storage) = t.storage(lun) else {
                continue;
            };
            let Some(image) = crate::rbd::image_of(&*storage) else {
                continue;
            };
            let oid = self.object(image.spec());
            let Some(read) = self.pool().read(&oid, MAX_OBJECT).map_err(rados_text)? else {
                continue;
            };
            let state = Reservations::decode(&read.data)
                .ok_or_else(|| format!("the reservations in object {oid} are damaged"))?;
            t.catch_up_shared_reservations(lun, read.version, state);
        }
        Ok(())
    }

    /// This gateway's iSCSI portals are now `portals` (a portal added or removed while
    /// running): listed again, so SendTargets through the other gateways names them.
    pub fn set_portals(&self, portals: &[std::net::SocketAddr]) {
        self.relist(|me| me.portals = portals.to_vec());
    }

    /// Lists this gateway's NVMe/TCP portals in its line of the gateways object.
    pub fn set_nvme_portals(&self, tcp: &[std::net::SocketAddr], rdma: &[std::net::SocketAddr]) {
        self.relist(|me| {
            me.nvme_portals = tcp.to_vec();
            me.nvme_rdma_portals = rdma.to_vec();
        });
    }

    /// Changes this gateway's line of the gateways object with `change` and publishes it.
    fn relist(&self, change: impl FnOnce(&mut Member)) {
        let me = {
            let mut guard = self.me.lock().unwrap_or_else(PoisonError::into_inner);
            let Some(me) = guard.as_mut() else { return };
            change(me);
            me.clone()
        };
        if let Err((_, e)) = self.publish(&me, false) {
            tracing::warn!("listing this gateway's portals: {e}");
        }
        self.state().machine.relisted(me.clone());
    }

    /// Fences gateway `m` (it did not acknowledge a change, or a membership question):
    /// blocklisted, it can change nothing any more, and its own watches end, which stops it
    /// serving; then its image locks are broken.
    fn fence(&self, m: &Member) -> Result<(), String> {
        let pool = self.pool();
        let cluster = pool.cluster();
        let refused: Vec<String> = m
            .addresses
            .iter()
            .filter_map(|a| {
                cluster
                    .blocklist(a, Duration::from_secs(3600))
                    .err()
                    .map(|e| format!("{a}: {e}"))
            })
            .collect();
        if !refused.is_empty() {
            return Err(refused.join("; "));
        }
        self.break_locks_of(m);
        Ok(())
    }

    /// A fenced gateway comes back: a new connection (a new RADOS client, which the
    /// blocklist of the old one does not cover), every shared unit's image opened again on
    /// it and its reservations reloaded (the nexuses here hear what they missed), this
    /// gateway listed again. Only then does it count as live and serve its units.
    fn reconnect(self: &Arc<Self>) -> Result<(), String> {
        // The old connections are the blocklisted clients: every image and object is opened
        // anew on a new one.
        Cluster::forget_shared();
        let pool = Keeper::connect(&self.config).map_err(|(_, e)| format!("connecting: {e}"))?;
        *self.pool.write().unwrap_or_else(PoisonError::into_inner) = pool;
        for (target, lun) in self.shared_units() {
            let Some(t) = target.upgrade() else { continue };
            t.reopen_shared_lun(lun)
                .map_err(|e| format!("target {} LUN {lun}: {e}", t.name()))?;
        }
        self.enter(false)
            .map_err(|(_, e)| format!("listing this gateway: {e}"))?;
        tracing::info!(
            gateway = %self.config.gateway,
            instance = self.pool().cluster().instance_id(),
            "reconnected to the cluster"
        );
        Ok(())
    }

    /// Whether this gateway has been fenced.
    pub fn is_fenced(&self) -> bool {
        self.state().machine.is_fenced()
    }

    /// Breaks the exclusive locks a fenced gateway held on the shared units' images, so this
    /// gateway's next write takes them at once rather than after librbd gives up waiting for
    /// the old owner (30 s).
    fn break_locks_of(&self, m: &Member) {
        let theirs = |o: &String| m.addresses.contains(o);
        let units = self.shared_units();
        for (target, lun) in units {
            let image = target.upgrade().and_then(|t| t.storage(lun));
            let Some(image) = image.as_deref().and_then(crate::rbd::image_of) else {
                continue;
            };
            let owners = match image.lock_owners() {
                Ok(o) => o,
                Err(e) => {
                    tracing::warn!(image = %image.spec(), "{e}");
                    continue;
                }
            };
            for o in owners.iter().filter(|o| theirs(o)) {
                match image.break_lock(o) {
                    Ok(()) => {
                        tracing::info!(image = %image.spec(), owner = %o, "broke a fenced gateway's lock")
                    }
                    Err(e) => tracing::warn!(image = %image.spec(), owner = %o, "{e}"),
                }
            }
            if !owners.is_empty() && !owners.iter().any(theirs) {
                tracing::debug!(image = %image.spec(), ?owners, fenced = ?m.addresses, "the lock is not the fenced gateway's");
            }
        }
    }

    /// Writes (or rewrites) this gateway's line in the gateways object; with `succeeding`,
    /// the initiators' choices of the process it replaces go on for it. Nothing while this
    /// process is an upgrade's successor that has not taken its predecessor's place.
    fn publish(&self, me: &Member, succeeding: bool) -> Result<(), (String, String)> {
        if self.standby.load(Ordering::Acquire) {
            return Ok(());
        }
        self.edit_members(|members, preferences| {
            if let Some(other) = members
                .iter()
                .find(|m| m.port_group == me.port_group && m.gateway != me.gateway)
            {
                return Err((
                    "cluster.port_group".into(),
                    format!(
                        "{} is gateway {:?}'s already: each gateway needs its own",
                        me.port_group, other.gateway
                    ),
                ));
            }
            if let Some(predecessor) = members.iter().find(|m| m.gateway == me.gateway) {
                if succeeding {
                    Preference::carry_over(preferences, predecessor, me.instance);
                }
            }
            members.retain(|m| m.gateway != me.gateway);
            members.push(me.clone());
            Ok(())
        })
    }

    /// Changes the gateways object's members and initiators' choices by `edit` (which may
    /// refuse, changing nothing): read, edit, and written back only if nobody wrote it
    /// meanwhile (compare-and-swap), again after a lost race.
    fn edit_members(
        &self,
        edit: impl Fn(&mut Vec<Member>, &mut Vec<Preference>) -> Result<(), (String, String)>,
    ) -> Result<(), (String, String)> {
        let fail = |e: String| ("cluster".to_string(), e);
        let oid = self.gateways_object();
        for _ in 0..MAX_RACES {
            let read = self
                .pool()
                .read(&oid, MAX_OBJECT)
                .map_err(|e| fail(rados_text(e)))?;
            let (text, version) = match &read {
                Some(v) => (
                    String::from_utf8_lossy(&v.data).into_owned(),
                    Some(v.version),
                ),
                None => (String::new(), None),
            };
            let mut members: Vec<Member> = text.lines().filter_map(Member::parse).collect();
            let mut preferences = Preference::parse_all(text.as_bytes());
            edit(&mut members, &mut preferences)?;
            let data = Member::rewrite(&mut members, &preferences);
            match self.pool().replace(&oid, version, &data) {
                Ok(_) => return Ok(()),
                Err(CasError::Conflict) => continue,
                Err(CasError::Rados(e)) => return Err(fail(rados_text(e))),
            }
        }
        Err(fail(format!("{oid} kept changing")))
    }

    /// A planned stop (SIGTERM, `systemctl stop`), once this gateway's initiators have logged
    /// out and its writes are flushed: it marks its line in the gateways object as left,
    /// stops answering "who is alive" and tells the others, who log that it left and give its
    /// port group the unavailable state at once, without fencing it (no blocklist entry, no
    /// lock broken, nothing counted as fenced). Its line stays, so its port group is still
    /// reported (unavailable) until it starts again or `targetctl cluster forget` takes it
    /// out. A gateway that cannot reach the cluster to leave is fenced by the others as a
    /// failed one would be.
    pub fn leave(&self) {
        self.state().machine.leave();
        let gateway = self.config.gateway.clone();
        if let Err((_, e)) = self.edit_members(|members, _| {
            for m in members.iter_mut().filter(|m| m.gateway == gateway) {
                m.left = true;
            }
            Ok(())
        }) {
            tracing::warn!(%gateway, "leaving the cluster: {e}; the other gateways will fence this one");
            return;
        }
        // No more answers to "who is alive": the others see it gone, not silent.
        drop(
            self.joined
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .take(),
        );
        let _ = self.pool().notify(
            &self.gateways_object(),
            b"left",
            self.settings.membership_timeout,
        );
        tracing::info!(%gateway, "left the cluster of gateways");
    }

    /// Takes gateway `name`, gone for good, out of the gateways object, so its port group is
    /// no longer reported (unavailable) for every unit. Refused for this gateway and for a
    /// gateway that is alive.
    pub fn forget(&self, name: &str) -> Result<String, String> {
        if name == self.config.gateway {
            return Err(format!("{name} is this gateway: stop it to make it leave"));
        }
        // Who answered the last round (at most `membership_interval` ago).
        if self.membership().live.iter().any(|g| g == name) {
            return Err(format!(
                "gateway {name} is alive (it answers who is alive): stop it, and it leaves by itself"
            ));
        }
        let known = std::sync::atomic::AtomicBool::new(false);
        self.edit_members(|members, _| {
            let before = members.len();
            members.retain(|m| m.gateway != name);
            known.store(members.len() != before, Ordering::Relaxed);
            Ok(())
        })
        .map_err(|(_, e)| e)?;
        if !known.load(Ordering::Relaxed) {
            return Err(format!("no gateway {name} in the cluster"));
        }
        // Everyone (this gateway too) looks again now.
        let _ = self.pool().notify(
            &self.gateways_object(),
            b"left",
            self.settings.membership_timeout,
        );
        tracing::warn!(gateway = %name, "forgot a gateway that is gone");
        Ok(format!("gateway {name} forgotten"))
    }

    /// The addresses of every RADOS client of this process: the cluster session's and the
    /// images' (each configuration of a connection is a client of its own).
    fn addresses(&self) -> Result<Vec<String>, backend::rbd::RbdError> {
        let mut all = vec![self.pool().cluster().address()?];
        for c in Cluster::open() {
            let a = c.address()?;
            if !all.contains(&a) {
                all.push(a);
            }
        }
        Ok(all)
    }

    /// Lists this gateway's clients again when a unit opened a new one.
    fn republish(&self) {
        let Ok(addresses) = self.addresses() else {
            return;
        };
        let me = {
            let mut guard = crate::lock(&self.me);
            let Some(me) = guard.as_mut() else { return };
            if me.addresses == addresses {
                return;
            }
            me.addresses = addresses;
            me.clone()
        };
        if let Err((_, e)) = self.publish(&me, false) {
            tracing::warn!("listing this gateway's RADOS clients: {e}");
        }
        self.state().machine.relisted(me);
    }

    /// Watches `oid` for this gateway: its notifications go to the machine as `watched`;
    /// losing the watch (blocklisted, or cut off for longer than `ceph_timeout`) fences this
    /// gateway.
    fn watch(self: &Arc<Self>, oid: &str, watched: Watched) -> Result<Watch, i32> {
        let pool = self.pool();
        let generation = self.state().machine.generation();
        let (on_notify, on_error) = {
            let (weak, name, pool) = (Arc::downgrade(self), oid.to_string(), pool.clone());
            let on_notify = move |n: Notification| {
                let Some(k) = weak.upgrade() else { return };
                let token = k.next_id.fetch_add(1, Ordering::Relaxed);
                let payload = n.payload.clone();
                crate::lock(&k.notifications).insert(token, (name.clone(), n, pool.clone()));
                k.input(|m, now| m.handle_notification(now, watched, token, &payload));
            };
            let weak = Arc::downgrade(self);
            let on_error = move |e: i32| {
                if let Some(k) = weak.upgrade() {
                    k.input(|m, now| m.handle_watch_lost(now, generation, e));
                }
            };
            (on_notify, on_error)
        };
        let timeout = Duration::from_secs(
            self.config
                .ceph_timeout
                .unwrap_or(config::DEFAULT_CEPH_TIMEOUT),
        );
        pool.watch(oid, timeout, on_notify, on_error)
    }

    /// The object holding the cluster's record of target `name`'s definition.
    fn target_object(&self, name: &str) -> String {
        format!("{}.target.{name}", self.config.name)
    }

    /// The definitions thread: compares the shared targets every [`DEFINITION_INTERVAL`],
    /// or soon after a unit was shared.
    fn compare_targets_every(weak: Weak<Keeper>) {
        let mut last = Instant::now();
        loop {
            std::thread::sleep(Duration::from_millis(100));
            let Some(k) = weak.upgrade() else { return };
            if k.stopping.load(Ordering::Acquire) {
                return;
            }
            if k.compare_soon.swap(false, Ordering::AcqRel) || last.elapsed() >= DEFINITION_INTERVAL
            {
                last = Instant::now();
                if !k.compare_targets() {
                    k.compare_soon.store(true, Ordering::Release);
                }
            }
        }
    }

    /// Compares each shared target as this gateway exports it with the cluster's record of
    /// it (`<cluster>.target.<name>`), records this gateway's after an edit here (or where
    /// there is none, or its writer is gone), and warns where they differ
    /// ([`cluster::definition`]). Not before this gateway has joined and heard who is alive
    /// (whose record stands depends on it), nor while fenced (it writes nothing then):
    /// returns whether it compared.
    fn compare_targets(&self) -> bool {
        let joined = crate::lock(&self.joined).is_some();
        if !joined || self.is_fenced() || self.membership().live.is_empty() {
            return false;
        }
        let mut shared: Vec<Arc<dyn SharedTarget>> = Vec::new();
        for (target, _) in self.shared_units() {
            if let Some(t) = target.upgrade() {
                if !shared.iter().any(|s| s.name() == t.name()) {
                    shared.push(t);
                }
            }
        }
        let live = self.membership().live;
        let me = self.config.gateway.clone();
        crate::lock(&self.targets).retain(|name, _| shared.iter().any(|t| t.name() == name));
        for t in shared {
            let name = t.name().to_string();
            let mine = t.definition();
            let oid = self.target_object(&name);
            let read = match self.pool().read(&oid, MAX_RECORD) {
                Ok(read) => read,
                Err(e) => {
                    tracing::warn!(target = %name, "reading the cluster's record of the target: {}", rados_text(e));
                    continue;
                }
            };
            let record = read.as_ref().and_then(|v| Record::decode(&v.data));
            let mut targets = crate::lock(&self.targets);
            let entry = targets.entry(name.clone()).or_default();
            let decision = entry
                .comparison
                .decide(&me, &mine, record.as_ref(), |g| live.iter().any(|l| l == g));
            if let Decision::Record {
                replaced_from,
                replaced,
            } = &decision
            {
                let bytes = Record {
                    written_by: me.clone(),
                    definition: mine.clone(),
                }
                .encode();
                match self
                    .pool()
                    .replace(&oid, read.as_ref().map(|v| v.version), &bytes)
                {
                    Ok(_) => {
                        entry.comparison.recorded(&mine);
                        match replaced_from {
                            Some(from) if !replaced.is_empty() => tracing::warn!(
                                target = %name,
                                replaced = %from,
                                differences = %join(replaced),
                                "this gateway's definition of the target is now the cluster's; gateways that \
                                 still export it otherwise warn until given the same"
                            ),
                            _ => {
                                tracing::info!(target = %name, "this gateway's definition of the target is the cluster's")
                            }
                        }
                    }
                    Err(CasError::Conflict) => {
                        self.compare_soon.store(true, Ordering::Release);
                        continue;
                    }
                    Err(CasError::Rados(e)) => {
                        tracing::warn!(target = %name, "recording the target's definition: {}", rados_text(e));
                        continue;
                    }
                }
            } else if entry.comparison.is_news(&decision) {
                match &decision {
                    Decision::Differs {
                        written_by,
                        differences,
                    } => tracing::warn!(
                        target = %name,
                        recorded_by = %written_by,
                        differences = %join(differences),
                        "this gateway exports the target otherwise than the cluster's other gateways: \
                         initiators may be refused, or asked other credentials, through one path \
                         and not another"
                    ),
                    _ => {
                        tracing::info!(target = %name, "this gateway exports the target as the cluster's other gateways do again")
                    }
                }
            }
            entry.last = Some(decision);
        }
        true
    }

    /// The shared units, as (target, LUN).
    fn shared_units(&self) -> Vec<SharedLun> {
        crate::lock(&self.units).values().cloned().collect()
    }

    /// What `targetctl cluster` shows: this gateway, every member with its port group,
    /// portals and liveness, and each shared unit's access state per port group with its
    /// reservation holder.
    pub fn view(&self) -> serde_json::Value {
        use serde_json::json;
        let m = self.membership();
        let members: Vec<serde_json::Value> = m
            .members
            .iter()
            .map(|g| {
                json!({
                    "gateway": g.gateway,
                    "port_group": g.port_group,
                    "portals": g.portals.iter().map(|p| p.to_string()).collect::<Vec<_>>(),
                    "live": m.live.contains(&g.gateway),
                    "left": g.left,
                    "this": g.gateway == self.config.gateway,
                })
            })
            .collect();
        let gateway_of = |group: u16| {
            m.members
                .iter()
                .find(|g| g.port_group == group)
                .map(|g| g.gateway.clone())
        };
        let mut units = Vec::new();
        for (target, lun) in self.shared_units() {
            let Some(t) = target.upgrade() else { continue };
            let Some(groups) = t.port_groups(lun) else {
                continue;
            };
            let groups: Vec<serde_json::Value> = groups
                .iter()
                .map(|g| {
                    json!({
                        "port_group": g.id,
                        "gateway": gateway_of(g.id),
                        "state": g.state.name(),
                    })
                })
                .collect();
            let image = t
                .storage(lun)
                .as_deref()
                .and_then(crate::rbd::image_of)
                .cloned();
            // An initiator's choice of the optimized gateway (SET TARGET PORT GROUPS), while
            // it holds.
            let chosen = image.as_ref().and_then(|i| {
                m.policy_for(&self.object(i.spec()), &Default::default())
                    .preferred
            });
            let image = image.map(|i| i.spec().to_string()).unwrap_or_default();
            let holder = t.reservation_holder(lun);
            units.push(json!({
                "target": t.name(),
                "lun": lun,
                "image": image,
                "groups": groups,
                "chosen_by_initiator": chosen,
                "reservation_holder": holder.as_ref().map(|h| h.0.clone()),
                "reservation_type": holder.and_then(|h| h.1),
            }));
        }
        units.sort_by_key(|u| (u["target"].to_string(), u["lun"].as_u64()));
        let mut targets: Vec<serde_json::Value> = crate::lock(&self.targets)
            .iter()
            .filter_map(|(name, t)| {
                let (definition, recorded_by, differences) = match t.last.as_ref()? {
                    Decision::Same => ("same", None, Vec::new()),
                    Decision::Record { .. } => ("same", Some(&self.config.gateway), Vec::new()),
                    Decision::Differs {
                        written_by,
                        differences,
                    } => (
                        "differs",
                        Some(written_by),
                        differences.iter().map(ToString::to_string).collect(),
                    ),
                };
                Some(json!({
                    "target": name,
                    "definition": definition,
                    "recorded_by": recorded_by,
                    "differences": differences,
                }))
            })
            .collect();
        targets.sort_by_key(|t| t["target"].to_string());
        json!({
            "cluster": self.config.name,
            "gateway": self.config.gateway,
            "port_group": self.config.port_group,
            "fenced": self.is_fenced(),
            "members": members,
            "units": units,
            "targets": targets,
            "fenced_by_this_gateway": self.counters().fenced,
        })
    }

    /// The membership as last seen.
    pub fn membership(&self) -> Membership {
        self.state().machine.membership().clone()
    }

    /// What the machine did (`targetd_cluster_*` metrics).
    pub fn counters(&self) -> Counters {
        self.state().machine.counters()
    }

    /// This gateway's `[cluster]`.
    pub fn config(&self) -> &config::Cluster {
        &self.config
    }

    /// The object holding the reservations of units on `image`.
    pub fn object(&self, image: &ImageSpec) -> String {
        self.settings.reservations_object(&image.to_string())
    }

    /// Checks that this gateway exports `image` as the other gateways do: as the same unit
    /// (`label`: the same LUN of the same target, or the same namespace of the same
    /// subsystem; never a LUN on one gateway and a namespace on another, whose hosts could not
    /// see each other's reservations), with the same block size and the same path policy
    /// (`preferred_gateway`, `standby`). The first gateway to export it records that
    /// in `<cluster>.unit.<image>`; one that differs is refused, naming both, while any
    /// gateway serves the image (when none does, the new definition replaces the old).
    /// Errors start with the config key they are about.
    pub fn check_unit(
        &self,
        image: &ImageSpec,
        label: &str,
        unit: &config::Lun,
    ) -> Result<(), String> {
        let oid = format!("{}.unit.{image}", self.config.name);
        let mut mine = format!("{label}block_size {}\n", unit.block_size);
        // The paths' states are computed by every gateway alike: from the same policy.
        if let Some(g) = &unit.preferred_gateway {
            mine += &format!("preferred_gateway {g}\n");
        }
        if unit.standby {
            mine += "standby true\n";
        }
        let describe = |text: &str| text.trim().replace('\n', ", ");
        for _ in 0..MAX_RACES {
            let read = self
                .pool()
                .read(&oid, MAX_OBJECT)
                .map_err(|e| format!("image: {}", rados_text(e)))?;
            let version = match &read {
                Some(v) if v.data == mine.as_bytes() => return Ok(()),
                Some(v) => {
                    let theirs = String::from_utf8_lossy(&v.data).into_owned();
                    if !self.nobody_watches(&self.object(image))? {
                        return Err(format!(
                            "image: the cluster's gateways export {image} as {}; this one \
                             as {}: every gateway needs the same definition",
                            describe(&theirs),
                            describe(&mine)
                        ));
                    }
                    Some(v.version)
                }
                None => None,
            };
            match self.pool().replace(&oid, version, mine.as_bytes()) {
                Ok(_) => return Ok(()),
                Err(CasError::Conflict) => continue,
                Err(CasError::Rados(e)) => return Err(format!("image: {}", rados_text(e))),
            }
        }
        Err(format!("image: {oid} kept changing while it was read"))
    }

    /// The shared state of `oid` and its version, created empty when absent. When no gateway
    /// watches it (all restarted) and APTPL is off, it is cleared first, as a power loss
    /// clears a lone target's; but not by a start that serves sessions kept through the
    /// service manager's store, whose nexuses, and so their reservations, live on.
    pub fn load(&self, oid: &str) -> Result<(Reservations, u64), String> {
        for _ in 0..MAX_RACES {
            let read = self.pool().read(oid, MAX_OBJECT).map_err(rados_text)?;
            let Some(v) = read else {
                match self
                    .pool()
                    .replace(oid, None, &Reservations::default().encode())
                {
                    Ok(_) | Err(CasError::Conflict) => continue,
                    Err(CasError::Rados(e)) => return Err(rados_text(e)),
                }
            };
            let state = Reservations::decode(&v.data)
                .ok_or_else(|| format!("the reservations in object {oid} are damaged"))?;
            if state != Reservations::default()
                && !state.persistent.aptpl
                && !self.keeps_sessions.load(Ordering::Acquire)
                && self.nobody_watches(oid)?
            {
                match self
                    .pool()
                    .replace(oid, Some(v.version), &Reservations::default().encode())
                {
                    Ok(version) => {
                        tracing::info!(
                            object = oid,
                            "reservations without APTPL cleared: no gateway served them"
                        );
                        return Ok((Reservations::default(), version));
                    }
                    Err(CasError::Conflict) => continue,
                    Err(CasError::Rados(e)) => return Err(rados_text(e)),
                }
            }
            return Ok((state, v.version));
        }
        Err(format!("object {oid} kept changing while it was read"))
    }

    /// Whether no gateway watches `oid`: a notify nobody receives.
    fn nobody_watches(&self, oid: &str) -> Result<bool, String> {
        let o = self
            .pool()
            .notify(oid, &[], Duration::from_secs(1))
            .map_err(rados_text)?;
        Ok(o.acked.is_empty() && o.timed_out.is_empty())
    }

    /// Follows `oid` for `unit` of `target`: every change another gateway makes is applied
    /// to this gateway's device server before it is acknowledged.
    fn follow(
        self: &Arc<Self>,
        target: Weak<dyn SharedTarget>,
        unit: &config::Lun,
        oid: &str,
    ) -> Result<SharedUnit, String> {
        let (lun, policy) = (unit.lun, policy_of(unit));
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let watch = self.watch(oid, Watched::Unit(id)).map_err(rados_text)?;
        self.republish();
        {
            let mut units = crate::lock(&self.units);
            units.retain(|_, (t, l)| t.strong_count() > 0 && !(t.ptr_eq(&target) && *l == lun));
            units.insert(id, (target, lun));
        }
        self.input(|m, _| m.add_unit(id, oid.to_string(), policy));
        Ok(SharedUnit {
            oid: oid.to_string(),
            keeper: Arc::downgrade(self),
            id,
            _watch: watch,
        })
    }

    /// Queues a change for the machine; it hands out nothing here (the changes lane does).
    fn queue_change(&self, target: Weak<dyn SharedTarget>, change: ReservationChange) {
        let (id, unit) = self.waiting(
            change.lun,
            Waiting {
                target,
                task: change.task,
                tmf: change.tmf,
                port_groups: false,
                nvme: None,
            },
        );
        let mut s = self.state();
        s.machine
            .submit(Instant::now(), id, unit, change.nexus, change.request);
        self.route(&mut s);
    }

    /// Records `waiting` (a change to unit `lun` of its target) under a new change id: the
    /// id, and the machine's id of the unit.
    fn waiting(&self, lun: u16, waiting: Waiting) -> (ChangeId, UnitId) {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let unit = self.unit_id(&waiting.target, lun);
        crate::lock(&self.changes).insert(id, waiting);
        (id, unit)
    }

    /// The machine's unit id of `target`'s unit `lun` ([`UnitId::MAX`], which the machine
    /// knows not, when it is not shared here).
    fn unit_id(&self, target: &Weak<dyn SharedTarget>, lun: u16) -> UnitId {
        crate::lock(&self.units)
            .iter()
            .find(|(_, (t, l))| t.ptr_eq(target) && *l == lun)
            .map(|(id, _)| *id)
            .unwrap_or(UnitId::MAX)
    }

    fn queue_port_groups(&self, target: Weak<dyn SharedTarget>, change: PortGroupsChange) {
        let (id, unit) = self.waiting(
            change.lun,
            Waiting {
                target,
                task: Some(change.task),
                tmf: None,
                port_groups: true,
                nvme: None,
            },
        );
        // Often decided at once (asked what is, or what cannot be): handed out now.
        self.input(|m, now| m.submit_port_groups(now, id, unit, &change.requests));
    }
}

impl super::Cluster for Keeper {
    fn gateway(&self) -> &str {
        &self.config.gateway
    }

    fn join(&self, portals: &[std::net::SocketAddr]) -> Result<(), (String, String)> {
        let me = self
            .this
            .upgrade()
            .ok_or(("cluster".to_string(), "stopping".to_string()))?;
        Keeper::join(&me, portals)
    }

    fn join_as_successor(&self, portals: &[std::net::SocketAddr]) -> Result<(), (String, String)> {
        let me = self
            .this
            .upgrade()
            .ok_or(("cluster".to_string(), "stopping".to_string()))?;
        Keeper::join_as_successor(&me, portals)
    }

    fn take_place(&self) -> Result<(), String> {
        Keeper::take_place(&self.this().ok_or("the cluster's keeper stops")?)
    }

    fn list_again(&self) {
        if let Some(me) = self.this() {
            Keeper::list_again(&me);
        }
    }

    fn leave(&self) {
        Keeper::leave(self);
    }

    fn keep_sessions(&self) {
        self.keeps_sessions.store(true, Ordering::Release);
    }

    fn set_portals(&self, portals: &[std::net::SocketAddr]) {
        Keeper::set_portals(self, portals);
    }

    fn set_nvme_portals(&self, tcp: &[std::net::SocketAddr], rdma: &[std::net::SocketAddr]) {
        Keeper::set_nvme_portals(self, tcp, rdma);
    }

    fn serve_srp(&self) {
        let me = {
            let mut guard = crate::lock(&self.me);
            let Some(me) = guard.as_mut() else { return };
            if me.srp {
                return;
            }
            me.srp = true;
            me.clone()
        };
        // This gateway's own groups list the port at once; the others when they read the
        // gateways object next (within a round).
        self.state().machine.relisted(me.clone());
        if let Err((_, e)) = self.publish(&me, false) {
            tracing::warn!("listing this gateway's SRP port: {e}");
        }
        self.input(|m, _| m.refresh_port_groups());
    }

    fn membership(&self) -> Membership {
        Keeper::membership(self)
    }

    fn counters(&self) -> Counters {
        Keeper::counters(self)
    }

    fn is_fenced(&self) -> bool {
        Keeper::is_fenced(self)
    }

    fn view(&self) -> serde_json::Value {
        Keeper::view(self)
    }

    fn forget(&self, name: &str) -> Result<String, String> {
        Keeper::forget(self, name)
    }

    fn unit_config<'a>(
        &self,
        target: &str,
        config: &'a config::Lun,
    ) -> std::borrow::Cow<'a, config::Lun> {
        if config.backend != "rbd" || !config.write_cache {
            return std::borrow::Cow::Borrowed(config);
        }
        // A write acknowledged through one gateway must read back through every other:
        // librbd's cache would keep it on this gateway until a flush.
        tracing::info!(
            target,
            lun = config.lun,
            "served by a cluster of gateways: without librbd's write cache (write-through)"
        );
        std::borrow::Cow::Owned(config::Lun {
            write_cache: false,
            ..config.clone()
        })
    }

    fn share(
        &self,
        target: Weak<dyn SharedTarget>,
        config: &config::Lun,
        storage: &dyn UnitStore,
        adopt: &mut dyn FnMut(u64, Reservations) -> Result<(), String>,
    ) -> Result<Option<Following>, String> {
        let Some(image) = crate::rbd::image_of(storage) else {
            return Ok(None);
        };
        let me = self.this.upgrade().ok_or("the cluster's keeper stops")?;
        let label = target
            .upgrade()
            .ok_or("the target is gone")?
            .unit_label(config.lun);
        self.check_unit(image.spec(), &label, config)?;
        let oid = self.object(image.spec());
        let (first, version) = self.load(&oid)?;
        adopt(version, first.clone())?;
        let followed = me
            .follow(target.clone(), config, &oid)
            .and_then(|f| self.load(&oid).map(|now| (f, now)))
            .map_err(|e| format!("cluster: {e}"))?;
        let (followed, (state, now)) = followed;
        // The target is shared now: compare it with the cluster's record without waiting.
        self.compare_soon.store(true, Ordering::Release);
        if let (true, Some(t)) = (now > version, target.upgrade()) {
            // Changed between the read and the watch: the nexuses here hear what they missed.
            t.catch_up_shared_reservations(config.lun, now, state);
        }
        Ok(Some(Arc::new(followed)))
    }

    fn submit(&self, target: Weak<dyn SharedTarget>, change: ReservationChange) {
        self.queue_change(target, change);
    }

    fn submit_nvme(
        &self,
        target: Weak<dyn SharedTarget>,
        nsid: u16,
        id: u64,
        host: scsi_core::ItNexus,
        ask: cluster::ask::Ask,
    ) {
        let (change, unit) = self.waiting(
            nsid,
            Waiting {
                target,
                task: None,
                tmf: None,
                port_groups: false,
                nvme: Some(id),
            },
        );
        let mut s = self.state();
        s.machine.submit(Instant::now(), change, unit, host, ask);
        self.route(&mut s);
    }

    fn submit_port_groups(&self, target: Weak<dyn SharedTarget>, change: PortGroupsChange) {
        self.queue_port_groups(target, change);
    }
}

impl Drop for Keeper {
    fn drop(&mut self) {
        self.stopping.store(true, Ordering::Release);
        self.wake.notify_all();
    }
}

fn lane_index(lane: Lane) -> usize {
    match lane {
        Lane::Changes => 0,
        Lane::Membership => 1,
    }
}

/// Differences as one log field.
fn join(differences: &[cluster::definition::Difference]) -> String {
    differences
        .iter()
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join("; ")
}

fn rados_text(e: i32) -> String {
    std::io::Error::from_raw_os_error(-e).to_string()
}
