//! Several gateways as one target (`[cluster]`, feature `rbd`): the reservations of every RBD
//! unit live in one RADOS object per image, so a reservation taken through one gateway binds
//! the initiators of every gateway.
//!
//! The device server of each gateway shares the unit's reservations
//! ([`scsi_core::Device::share_reservations`]): a PERSISTENT RESERVE OUT, RESERVE or RELEASE
//! waits while the [`Keeper`] decides it on this gateway's reservations thread:
//!
//! 1. read the object and its version;
//! 2. apply the request with [`Reservations::apply`] (the same code a lone device server
//!    runs), which may refuse it (RESERVATION CONFLICT, sense) without writing anything;
//! 3. write the new state only if the object is still at the version read (compare-and-swap;
//!    of two gateways racing, one wins, the other reads again and decides again);
//! 4. apply it on this gateway, then notify every gateway watching the object: each applies
//!    the new state, establishes the unit attentions and aborts the tasks of the nexuses it
//!    carries, and acknowledges; the notify returns when all have, or after
//!    `cluster.notify_timeout` (the silent gateways are logged by their RADOS client id);
//! 5. end the command.
//!
//! So the command that changed the reservations ends only after every live gateway enforces
//! the change. A state is applied only when its version is newer than the one a gateway
//! holds, so a change heard twice (its own notify) or late changes nothing.
//!
//! APTPL is natural: the object outlives every gateway. Without APTPL the state is cleared when
//! a gateway opens the unit and no gateway watches the object (all of them restarted), as a
//! power loss clears a lone target's.
//!
//! Which gateways are alive comes from RADOS too: each gateway lists itself (name, port group,
//! portals) in the object `<cluster>.gateways` and watches it; a notify on it is answered by
//! every live gateway with its name, and one that does not answer within
//! [`MEMBERSHIP_TIMEOUT`] is down. Every gateway asks every [`MEMBERSHIP_INTERVAL`] and
//! derives the same implicit ALUA states for every unit: the live gateway with the lowest port
//! group is active/optimized, the other live ones active/non-optimized, the rest unavailable.
//! A change reaches initiators as ASYMMETRIC ACCESS STATE CHANGED; SendTargets on any gateway
//! lists every gateway's portals with their port groups.

use std::sync::atomic::Ordering::Relaxed;
use std::sync::mpsc;
use std::sync::{Arc, Mutex, PoisonError, Weak};
use std::time::Duration;

use backend::rbd::rados::{CasError, Notification, Pool, Watch};
use backend::rbd::{Cluster, ImageSpec};
use scsi_core::pr::{PrError, ReservationEffects, Reservations};
use scsi_core::spc::tpg::{AccessState, PortGroup};
use scsi_core::{BackendError, ReservationChange, Sense};

use crate::config;
use crate::target::Target;

/// The largest reservation state read back: registrations of thousands of initiators.
const MAX_STATE: usize = 1 << 20;

/// How often a change is decided again after losing a compare-and-swap race before the
/// command ends with NOT READY (the initiator retries it).
const MAX_RACES: usize = 64;

/// How often a gateway asks who is alive.
pub const MEMBERSHIP_INTERVAL: Duration = Duration::from_secs(2);

/// How long a gateway has to answer "who is alive" before it counts as down.
pub const MEMBERSHIP_TIMEOUT: Duration = Duration::from_secs(2);

/// The longest a fenced gateway waits between two tries to rejoin.
pub const REJOIN_MAX_DELAY: Duration = Duration::from_secs(30);

/// One gateway as the cluster's gateways object lists it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Member {
    /// `cluster.gateway`.
    pub gateway: String,
    /// `cluster.port_group`.
    pub port_group: u16,
    /// Its iSCSI portals.
    pub portals: Vec<std::net::SocketAddr>,
    /// Its RADOS client instance id (how notify outcomes name it).
    pub instance: u64,
    /// The addresses of its RADOS clients (the cluster session and the images'): what
    /// fencing blocklists.
    pub addresses: Vec<String>,
    /// It stopped as planned (SIGTERM) and said so: down, but never fenced for it.
    pub left: bool,
}

impl Member {
    fn line(&self) -> String {
        let portals: Vec<String> = self.portals.iter().map(|p| p.to_string()).collect();
        let portals = if portals.is_empty() {
            "-".to_string()
        } else {
            portals.join(",")
        };
        let addresses = if self.addresses.is_empty() {
            "-".to_string()
        } else {
            self.addresses.join(",")
        };
        format!(
            "gateway {} {} {portals} {} {addresses}{}\n",
            self.gateway,
            self.port_group,
            self.instance,
            if self.left { " left" } else { "" }
        )
    }

    fn parse(line: &str) -> Option<Member> {
        let w: Vec<&str> = line.split_whitespace().collect();
        if w.first() != Some(&"gateway") {
            return None;
        }
        Some(Member {
            gateway: w.get(1)?.to_string(),
            port_group: w.get(2)?.parse().ok()?,
            portals: w
                .get(3)?
                .split(',')
                .filter_map(|a| a.parse().ok())
                .collect(),
            instance: w.get(4)?.parse().ok()?,
            addresses: w
                .get(5)?
                .split(',')
                .filter(|a| *a != "-")
                .map(str::to_string)
                .collect(),
            left: w.get(6) == Some(&"left"),
        })
    }
}

/// The gateways the cluster lists and which of them answered last.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Membership {
    /// Every gateway that ever joined, by port group.
    pub members: Vec<Member>,
    /// The names of those that answered.
    pub live: Vec<String>,
}

/// How a unit wants its paths: which gateway is optimized, and what the others are.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PathPolicy<'a> {
    /// `preferred_gateway`: optimized while it is live.
    pub preferred: Option<&'a str>,
    /// `standby`: the other live gateways are standby, not active/non-optimized.
    pub standby: bool,
}

impl<'a> PathPolicy<'a> {
    /// The policy a unit's config sets.
    pub fn of(lun: &'a config::Lun) -> PathPolicy<'a> {
        PathPolicy {
            preferred: lun.preferred_gateway.as_deref(),
            standby: lun.standby,
        }
    }
}

impl Membership {
    /// The ALUA port groups of a shared unit with `policy`: its preferred gateway, when live,
    /// is active/optimized, or else the live gateway with the lowest port group; the other
    /// live ones are active/non-optimized (standby with `policy.standby`); the rest
    /// unavailable. The same on every gateway that sees the same membership.
    pub fn port_groups(&self, policy: PathPolicy<'_>) -> Vec<PortGroup> {
        let live = |m: &&Member| self.live.contains(&m.gateway);
        let optimized = self
            .members
            .iter()
            .filter(live)
            .find(|m| Some(m.gateway.as_str()) == policy.preferred)
            .or_else(|| {
                self.members
                    .iter()
                    .filter(live)
                    .min_by_key(|m| m.port_group)
            })
            .map(|m| m.port_group);
        let others = if policy.standby {
            AccessState::Standby
        } else {
            AccessState::ActiveNonOptimized
        };
        self.members
            .iter()
            .map(|m| {
                let state = if !self.live.contains(&m.gateway) {
                    AccessState::Unavailable
                } else if Some(m.port_group) == optimized {
                    AccessState::ActiveOptimized
                } else {
                    others
                };
                PortGroup {
                    id: m.port_group,
                    state,
                    preferred: state == AccessState::ActiveOptimized,
                    ports: vec![m.port_group],
                }
            })
            .collect()
    }
}

/// A change to decide, from a target's device server.
struct Job {
    target: Weak<Target>,
    change: ReservationChange,
}

/// This gateway's membership in a cluster of gateways: the pool of shared objects and the
/// thread that decides changes to reservations.
pub struct Keeper {
    config: config::Cluster,
    /// The shared objects' pool, on this gateway's connection to the cluster (a new one
    /// after each rejoin).
    pool: std::sync::RwLock<Arc<Pool>>,
    /// Counts this gateway's connections to the cluster: a watch of an earlier one that ends
    /// late says nothing about the current one.
    generation: std::sync::atomic::AtomicU64,
    jobs: Mutex<mpsc::Sender<Job>>,
    /// The membership as last seen.
    membership: Mutex<Membership>,
    /// The shared units, to tell of ALUA changes.
    units: Mutex<Vec<(Weak<Target>, u16)>>,
    /// This gateway's watch on the gateways object, once it has joined.
    joined: Mutex<Option<Watch>>,
    /// Wakes the membership thread early (a gateway joined).
    wake: (Mutex<bool>, std::sync::Condvar),
    /// This gateway lost its cluster session (its watch ended: blocklisted, or cut off for
    /// longer than its timeout): it serves its shared units no more until it has rejoined.
    fenced: std::sync::atomic::AtomicBool,
    /// Rejoins tried since the last fence (the delay between them grows).
    rejoin_attempts: std::sync::atomic::AtomicU32,
    /// This gateway's line in the gateways object, once it has joined.
    me: Mutex<Option<Member>>,
    /// The RADOS instances of the gateways this one has fenced (each once).
    fenced_instances: Mutex<Vec<u64>>,
    /// This gateway is stopping and has left (or is leaving) the cluster: it neither asks who
    /// is alive nor rejoins any more.
    leaving: std::sync::atomic::AtomicBool,
    /// What the keeper did, for the metrics.
    pub counters: Counters,
}

/// What a gateway's keeper did since it started (`targetd_cluster_*` metrics).
#[derive(Debug, Default)]
pub struct Counters {
    /// Changes to reservations decided here (written, refused, or changing nothing).
    pub changes: std::sync::atomic::AtomicU64,
    /// Compare-and-swap races lost (decided again).
    pub races: std::sync::atomic::AtomicU64,
    /// Gateways fenced by this one.
    pub fenced: std::sync::atomic::AtomicU64,
    /// Times this gateway lost its own cluster session (it was fenced).
    pub lost_sessions: std::sync::atomic::AtomicU64,
    /// Times it rejoined after that.
    pub rejoins: std::sync::atomic::AtomicU64,
    /// Changes some gateway did not acknowledge in time.
    pub unacknowledged: std::sync::atomic::AtomicU64,
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
    _watch: Watch,
}

impl Keeper {
    /// Connects to the cluster `c` names and starts the reservations thread. Errors name the
    /// `[cluster]` key they are about.
    pub fn start(c: &config::Cluster) -> Result<Arc<Keeper>, (String, String)> {
        let pool = Keeper::connect(c)?;
        let (tx, rx) = mpsc::channel::<Job>();
        let keeper = Arc::new(Keeper {
            config: c.clone(),
            pool: std::sync::RwLock::new(pool),
            generation: std::sync::atomic::AtomicU64::new(0),
            jobs: Mutex::new(tx),
            membership: Mutex::default(),
            units: Mutex::default(),
            joined: Mutex::new(None),
            wake: (Mutex::new(false), std::sync::Condvar::new()),
            fenced: std::sync::atomic::AtomicBool::new(false),
            rejoin_attempts: std::sync::atomic::AtomicU32::new(0),
            me: Mutex::new(None),
            fenced_instances: Mutex::default(),
            leaving: std::sync::atomic::AtomicBool::new(false),
            counters: Counters::default(),
        });
        let weak = Arc::downgrade(&keeper);
        std::thread::Builder::new()
            .name("reservations".into())
            .spawn(move || {
                while let Ok(job) = rx.recv() {
                    let Some(keeper) = weak.upgrade() else { return };
                    keeper.decide(job);
                }
            })
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
        format!("{}.gateways", self.config.name)
    }

    /// Lists this gateway (with its iSCSI `portals`) in the cluster, answers "who is alive"
    /// from now on, and starts asking it every [`MEMBERSHIP_INTERVAL`] (and, once fenced,
    /// rejoining).
    pub fn join(
        self: &Arc<Self>,
        portals: &[std::net::SocketAddr],
    ) -> Result<(), (String, String)> {
        let fail = |e: String| ("cluster".to_string(), e);
        *self.me.lock().unwrap_or_else(PoisonError::into_inner) = Some(Member {
            gateway: self.config.gateway.clone(),
            port_group: self.config.port_group,
            portals: portals.to_vec(),
            instance: 0,
            addresses: Vec::new(),
            left: false,
        });
        self.enter()?;
        self.refresh();
        let weak = Arc::downgrade(self);
        std::thread::Builder::new()
            .name("membership".into())
            .spawn(move || loop {
                let Some(k) = weak.upgrade() else { return };
                if k.leaving.load(std::sync::atomic::Ordering::SeqCst) {
                    return;
                }
                if k.is_fenced() {
                    k.sleep(k.rejoin_delay());
                    k.rejoin();
                } else {
                    k.sleep(MEMBERSHIP_INTERVAL);
                    k.refresh();
                }
            })
            .map_err(|e| fail(format!("a thread: {e}")))?;
        Ok(())
    }

    /// Writes this gateway's line (with the current connection's instance and addresses)
    /// in the gateways object and watches it: from now on this gateway answers "who is
    /// alive", and the others hear at once that it joined.
    fn enter(self: &Arc<Self>) -> Result<(), (String, String)> {
        let fail = |e: String| ("cluster".to_string(), e);
        let oid = self.gateways_object();
        let pool = self.pool();
        let me = {
            let mut guard = self.me.lock().unwrap_or_else(PoisonError::into_inner);
            let me = guard.as_mut().ok_or_else(|| fail("not joined".into()))?;
            me.instance = pool.cluster().instance_id();
            me.addresses = self.addresses().map_err(|e| fail(e.to_string()))?;
            me.clone()
        };
        self.publish(&me)?;
        let name = oid.clone();
        let gateway = self.config.gateway.clone();
        let weak = Arc::downgrade(self);
        let answering = pool.clone();
        let on_notify = move |n: Notification| {
            if n.payload == b"joined" || n.payload == b"left" {
                if let Some(k) = weak.upgrade() {
                    k.wake();
                }
            }
            let _ = answering.ack(&name, &n, gateway.as_bytes());
        };
        let watch = self
            .watch(&oid, on_notify)
            .map_err(|e| fail(rados_text(e)))?;
        let old = self
            .joined
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .replace(watch);
        drop(old);
        // The others look again now rather than at their next round.
        let _ = pool.notify(&oid, b"joined", MEMBERSHIP_TIMEOUT);
        Ok(())
    }

    /// This gateway's iSCSI portals are now `portals` (a portal added or removed while
    /// running): listed again, so SendTargets through the other gateways names them.
    pub fn set_portals(&self, portals: &[std::net::SocketAddr]) {
        let me = {
            let mut guard = self.me.lock().unwrap_or_else(PoisonError::into_inner);
            let Some(me) = guard.as_mut() else { return };
            me.portals = portals.to_vec();
            me.clone()
        };
        if let Err((_, e)) = self.publish(&me) {
            tracing::warn!("listing this gateway's portals: {e}");
        }
    }

    /// This gateway's watch (of connection `generation`) ended with `errno`: it was
    /// blocklisted by another gateway that could not reach it, or the OSDs lost it for longer
    /// than its timeout. Either way the others may have changed the reservations without it:
    /// its shared units turn unavailable (initiators move to another path) and it serves them
    /// no more until it has rejoined ([`Keeper::rejoin`]) on a new connection with the state
    /// reloaded.
    fn lost_session(&self, generation: u64, errno: i32) {
        if generation != self.generation.load(std::sync::atomic::Ordering::SeqCst) {
            // A watch of a connection given up already.
            return;
        }
        if self.fenced.swap(true, std::sync::atomic::Ordering::SeqCst) {
            return;
        }
        self.counters.lost_sessions.fetch_add(1, Relaxed);
        self.rejoin_attempts.store(0, Relaxed);
        tracing::error!(
            gateway = %self.config.gateway,
            "lost the cluster session ({}): this gateway is fenced and serves no shared unit \
             until it has rejoined",
            rados_text(errno)
        );
        let mut m = self.membership();
        m.live.retain(|g| *g != self.config.gateway);
        if !m.members.iter().any(|g| g.gateway == self.config.gateway) {
            m.members.push(Member {
                gateway: self.config.gateway.clone(),
                port_group: self.config.port_group,
                portals: Vec::new(),
                instance: 0,
                addresses: Vec::new(),
                left: false,
            });
        }
        self.apply_groups(&m);
    }

    /// How long a fenced gateway waits before it tries to rejoin: [`MEMBERSHIP_INTERVAL`]
    /// first (the gateway that fenced it has broken its locks by then), doubling after each
    /// failed try up to [`REJOIN_MAX_DELAY`].
    fn rejoin_delay(&self) -> Duration {
        let tries = self.rejoin_attempts.load(Relaxed).min(8);
        (MEMBERSHIP_INTERVAL * 2u32.pow(tries)).min(REJOIN_MAX_DELAY)
    }

    /// A fenced gateway comes back: a new connection (a new RADOS client, which the
    /// blocklist of the old one does not cover), every shared unit's image opened again on
    /// it and its reservations reloaded (the nexuses here hear what they missed), this
    /// gateway listed again. Only then does it count as live and serve its units. On an
    /// error it stays fenced and tries again later.
    fn rejoin(self: &Arc<Self>) {
        if !self.is_fenced() {
            return;
        }
        self.rejoin_attempts.fetch_add(1, Relaxed);
        let failed = |what: &str, e: &str| {
            tracing::warn!(
                gateway = %self.config.gateway,
                retry_in = ?self.rejoin_delay(),
                "rejoining the cluster: {what}: {e}"
            );
        };
        // The old connections are the blocklisted clients: every image and object is opened
        // anew on a new one.
        Cluster::forget_shared();
        let pool = match Keeper::connect(&self.config) {
            Ok(p) => p,
            Err((_, e)) => return failed("connecting", &e),
        };
        self.generation
            .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        *self.pool.write().unwrap_or_else(PoisonError::into_inner) = pool;
        for (target, lun) in self.shared_units() {
            let Some(t) = target.upgrade() else { continue };
            if let Err(e) = t.reopen_shared_lun(lun) {
                return failed(&format!("target {} LUN {lun}", t.name), &e);
            }
        }
        if let Err((_, e)) = self.enter() {
            return failed("listing this gateway", &e);
        }
        self.fenced
            .store(false, std::sync::atomic::Ordering::SeqCst);
        self.counters.rejoins.fetch_add(1, Relaxed);
        tracing::info!(
            gateway = %self.config.gateway,
            instance = self.pool().cluster().instance_id(),
            "rejoined the cluster: serving the shared units again"
        );
        // Whatever was seen before the fence is stale: the states are given anew.
        *self
            .membership
            .lock()
            .unwrap_or_else(PoisonError::into_inner) = Membership::default();
        self.refresh();
    }

    /// Whether this gateway has been fenced.
    pub fn is_fenced(&self) -> bool {
        self.fenced.load(std::sync::atomic::Ordering::SeqCst)
    }

    /// Fences the gateways whose RADOS clients are `silent` (they did not acknowledge a
    /// change, or a membership question): blocklisted, they can change nothing any more, and
    /// their own watches end, which stops them serving. Returns the names fenced now.
    fn fence(&self, silent: &[(u64, u64)]) -> Vec<String> {
        let members = self.read_members().unwrap_or_default();
        let pool = self.pool();
        let cluster = pool.cluster();
        let mut fenced = Vec::new();
        let mut done = self
            .fenced_instances
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        let silent: Vec<&Member> = members
            .iter()
            .filter(|m| {
                m.gateway != self.config.gateway
                    && !m.left
                    && silent.iter().any(|(gid, _)| *gid == m.instance)
                    && !done.contains(&m.instance)
            })
            .collect();
        for m in silent {
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
            if refused.is_empty() {
                tracing::error!(
                    gateway = %m.gateway,
                    addresses = ?m.addresses,
                    "fenced a gateway that did not answer"
                );
                self.break_locks_of(m);
                self.counters.fenced.fetch_add(1, Relaxed);
                done.push(m.instance);
                fenced.push(m.gateway.clone());
            } else {
                tracing::error!(gateway = %m.gateway, ?refused, "cannot fence");
            }
        }
        fenced
    }

    /// Breaks the exclusive locks a fenced gateway held on the shared units' images, so this
    /// gateway's next write takes them at once rather than after librbd gives up waiting for
    /// the old owner (30 s).
    fn break_locks_of(&self, m: &Member) {
        let theirs = |o: &String| m.addresses.contains(o);
        let units = self.shared_units();
        for (target, lun) in units {
            let Some(unit) = target.upgrade().and_then(|t| t.lun(lun)) else {
                continue;
            };
            let crate::target::Storage::Rbd(image) = &unit.storage else {
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

    fn read_members(&self) -> Result<Vec<Member>, i32> {
        Ok(
            match self.pool().read(&self.gateways_object(), MAX_STATE)? {
                Some(v) => String::from_utf8_lossy(&v.data)
                    .lines()
                    .filter_map(Member::parse)
                    .collect(),
                None => Vec::new(),
            },
        )
    }

    /// Gives every shared unit its port groups under membership `m`.
    fn apply_groups(&self, m: &Membership) {
        let units = self.shared_units();
        for (target, lun) in units {
            if let Some(t) = target.upgrade() {
                self.give_groups(&t, lun, m);
            }
        }
    }

    /// Gives unit `lun` of `t` its port groups under membership `m`.
    fn give_groups(&self, t: &Target, lun: u16, m: &Membership) {
        let Some(unit) = t.lun(lun) else { return };
        t.set_port_groups(lun, self.groups_of(m, PathPolicy::of(&unit.config)));
    }

    /// Writes (or rewrites) this gateway's line in the gateways object.
    fn publish(&self, me: &Member) -> Result<(), (String, String)> {
        self.edit_members(|members| {
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
            members.retain(|m| m.gateway != me.gateway);
            members.push(me.clone());
            Ok(())
        })
    }

    /// Changes the gateways object by `edit` (which may refuse, changing nothing): read, edit,
    /// and written back only if nobody wrote it meanwhile (compare-and-swap), again after a
    /// lost race.
    fn edit_members(
        &self,
        edit: impl Fn(&mut Vec<Member>) -> Result<(), (String, String)>,
    ) -> Result<(), (String, String)> {
        let fail = |e: String| ("cluster".to_string(), e);
        let oid = self.gateways_object();
        for _ in 0..MAX_RACES {
            let read = self
                .pool()
                .read(&oid, MAX_STATE)
                .map_err(|e| fail(rados_text(e)))?;
            let (text, version) = match &read {
                Some(v) => (
                    String::from_utf8_lossy(&v.data).into_owned(),
                    Some(v.version),
                ),
                None => (String::new(), None),
            };
            let mut members: Vec<Member> = text.lines().filter_map(Member::parse).collect();
            edit(&mut members)?;
            members.sort_by_key(|m| m.port_group);
            let text: String = members.iter().map(Member::line).collect();
            match self.pool().replace(&oid, version, text.as_bytes()) {
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
        self.leaving
            .store(true, std::sync::atomic::Ordering::SeqCst);
        let gateway = self.config.gateway.clone();
        if let Err((_, e)) = self.edit_members(|members| {
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
        let _ = self
            .pool()
            .notify(&self.gateways_object(), b"left", MEMBERSHIP_TIMEOUT);
        tracing::info!(%gateway, "left the cluster of gateways");
    }

    /// Takes gateway `name`, gone for good, out of the gateways object, so its port group is
    /// no longer reported (unavailable) for every unit. Refused for this gateway and for a
    /// gateway that is alive.
    pub fn forget(&self, name: &str) -> Result<String, String> {
        if name == self.config.gateway {
            return Err(format!("{name} is this gateway: stop it to make it leave"));
        }
        self.refresh();
        if self.membership().live.iter().any(|g| g == name) {
            return Err(format!(
                "gateway {name} is alive (it answers who is alive): stop it, and it leaves by itself"
            ));
        }
        let known = std::sync::atomic::AtomicBool::new(false);
        self.edit_members(|members| {
            let before = members.len();
            members.retain(|m| m.gateway != name);
            known.store(members.len() != before, Relaxed);
            Ok(())
        })
        .map_err(|(_, e)| e)?;
        if !known.load(Relaxed) {
            return Err(format!("no gateway {name} in the cluster"));
        }
        let _ = self
            .pool()
            .notify(&self.gateways_object(), b"left", MEMBERSHIP_TIMEOUT);
        self.refresh();
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
            let mut guard = self.me.lock().unwrap_or_else(PoisonError::into_inner);
            let Some(me) = guard.as_mut() else { return };
            if me.addresses == addresses {
                return;
            }
            me.addresses = addresses;
            me.clone()
        };
        if let Err((_, e)) = self.publish(&me) {
            tracing::warn!("listing this gateway's RADOS clients: {e}");
        }
    }

    /// Watches `oid` for this gateway: `on_notify` gets its notifications; losing the watch
    /// (blocklisted, or cut off for longer than `ceph_timeout`) fences this gateway.
    fn watch(
        self: &Arc<Self>,
        oid: &str,
        on_notify: impl Fn(Notification) + Send + Sync + 'static,
    ) -> Result<Watch, i32> {
        let weak = Arc::downgrade(self);
        let generation = self.generation.load(std::sync::atomic::Ordering::SeqCst);
        let on_error = move |e: i32| {
            if let Some(k) = weak.upgrade() {
                k.lost_session(generation, e);
            }
        };
        let timeout = Duration::from_secs(
            self.config
                .ceph_timeout
                .unwrap_or(config::DEFAULT_CEPH_TIMEOUT),
        );
        self.pool().watch(oid, timeout, on_notify, on_error)
    }

    /// The shared units, as (target, LUN).
    fn shared_units(&self) -> Vec<(Weak<Target>, u16)> {
        self.units
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// The port groups of a unit with `policy` under `m`, this gateway's own unavailable
    /// once fenced.
    fn groups_of(&self, m: &Membership, policy: PathPolicy<'_>) -> Vec<PortGroup> {
        let mut groups = m.port_groups(policy);
        if self.is_fenced() {
            for g in groups.iter_mut().filter(|g| g.id == self.config.port_group) {
                g.state = AccessState::Unavailable;
                g.preferred = false;
            }
        }
        groups
    }

    fn wake(&self) {
        *self.wake.0.lock().unwrap_or_else(PoisonError::into_inner) = true;
        self.wake.1.notify_all();
    }

    fn sleep(&self, d: Duration) {
        let woken = self.wake.0.lock().unwrap_or_else(PoisonError::into_inner);
        let (mut woken, _) = self
            .wake
            .1
            .wait_timeout_while(woken, d, |w| !*w)
            .unwrap_or_else(PoisonError::into_inner);
        *woken = false;
    }

    /// Asks who is alive and, when the answer changed, gives every shared unit its new ALUA
    /// states.
    pub fn refresh(&self) {
        if self.is_fenced() || self.leaving.load(std::sync::atomic::Ordering::SeqCst) {
            return;
        }
        let oid = self.gateways_object();
        let members = match self.read_members() {
            Ok(m) => m,
            Err(e) => {
                tracing::warn!(object = %oid, "reading the cluster's gateways: {}", rados_text(e));
                return;
            }
        };
        let live = match self.pool().notify(&oid, b"who", MEMBERSHIP_TIMEOUT) {
            Ok(o) => {
                let mut live: Vec<String> = o
                    .acked
                    .iter()
                    .map(|(_, _, reply)| String::from_utf8_lossy(reply).into_owned())
                    .collect();
                live.sort();
                live.dedup();
                // A gateway whose watch is there but which does not answer is alive to
                // the OSDs and silent to us (stopped, cut off, killed with its watch not yet
                // timed out): it could still write with what it last knew. Fenced now, its
                // image locks broken, the others take over its initiators' I/O at once.
                if !o.timed_out.is_empty() {
                    let fenced = self.fence(&o.timed_out);
                    if !fenced.is_empty() {
                        tracing::warn!(?fenced, "gateways did not answer who is alive");
                    }
                }
                live
            }
            Err(e) => {
                tracing::warn!(object = %oid, "asking who is alive: {}", rados_text(e));
                return;
            }
        };
        let now = Membership { members, live };
        let mut seen = self
            .membership
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if *seen == now {
            return;
        }
        for m in &now.members {
            let was = seen.members.iter().find(|o| o.gateway == m.gateway);
            if m.left && !was.is_some_and(|o| o.left) {
                tracing::info!(gateway = %m.gateway, "a gateway left the cluster (a planned stop)");
            }
        }
        for gone in seen
            .members
            .iter()
            .filter(|m| !now.members.iter().any(|n| n.gateway == m.gateway))
        {
            tracing::info!(gateway = %gone.gateway, "a gateway was forgotten by the cluster");
        }
        tracing::info!(
            live = ?now.live,
            gateways = now.members.len(),
            "the cluster's gateways changed"
        );
        *seen = now.clone();
        drop(seen);
        self.apply_groups(&now);
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
            let Some(unit) = t.lun(lun) else { continue };
            let groups: Vec<serde_json::Value> = t
                .port_groups(lun)
                .unwrap_or_default()
                .iter()
                .map(|g| {
                    json!({
                        "port_group": g.id,
                        "gateway": gateway_of(g.id),
                        "state": g.state.name(),
                    })
                })
                .collect();
            let image = match &unit.storage {
                crate::target::Storage::Rbd(image) => image.spec().to_string(),
                _ => String::new(),
            };
            let holder = t.reservation_holder(lun);
            units.push(json!({
                "target": t.name,
                "lun": lun,
                "image": image,
                "groups": groups,
                "reservation_holder": holder.as_ref().map(|h| h.0.clone()),
                "reservation_type": holder.and_then(|h| h.1),
            }));
        }
        json!({
            "cluster": self.config.name,
            "gateway": self.config.gateway,
            "port_group": self.config.port_group,
            "fenced": self.is_fenced(),
            "members": members,
            "units": units,
            "fenced_by_this_gateway": self.counters.fenced.load(Relaxed),
        })
    }

    /// The membership as last seen.
    pub fn membership(&self) -> Membership {
        self.membership
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// This gateway's `[cluster]`.
    pub fn config(&self) -> &config::Cluster {
        &self.config
    }

    /// The object holding the reservations of units on `image`.
    pub fn object(&self, image: &ImageSpec) -> String {
        format!("{}.reservations.{image}", self.config.name)
    }

    /// Checks that this gateway exports `image` as the other gateways do: as the same LUN of
    /// `target`, with the same block size and the same path policy (`preferred_gateway`,
    /// `standby`). The first gateway to export it records that
    /// in `<cluster>.unit.<image>`; one that differs is refused, naming both, while any
    /// gateway serves the image (when none does, the new definition replaces the old).
    /// Errors start with the config key they are about.
    pub fn check_unit(
        &self,
        image: &ImageSpec,
        target: &str,
        unit: &config::Lun,
    ) -> Result<(), String> {
        let oid = format!("{}.unit.{image}", self.config.name);
        let mut mine = format!(
            "target {target}\nlun {}\nblock_size {}\n",
            unit.lun, unit.block_size
        );
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
                .read(&oid, MAX_STATE)
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
    /// watches it (all restarted) and APTPL is off, it is cleared first.
    pub fn load(&self, oid: &str) -> Result<(Reservations, u64), String> {
        for _ in 0..MAX_RACES {
            let read = self.pool().read(oid, MAX_STATE).map_err(rados_text)?;
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
    pub fn follow(
        self: &Arc<Self>,
        target: Weak<Target>,
        unit: &config::Lun,
        oid: &str,
    ) -> Result<SharedUnit, String> {
        let (lun, policy) = (unit.lun, PathPolicy::of(unit));
        let pool = self.pool();
        let name = oid.to_string();
        let unit = target.clone();
        let patience = Duration::from_secs(self.config.notify_timeout);
        let on_notify = move |n: Notification| {
            let ack = {
                let (pool, name) = (pool.clone(), name.clone());
                move |n: Notification| {
                    if let Err(e) = pool.ack(&name, &n, &[]) {
                        tracing::warn!(object = %name, "acknowledging a change: {}", rados_text(e));
                    }
                }
            };
            let mut aborted = false;
            if let Some((version, state, effects)) = decode_change(&n.payload) {
                if let Some(t) = unit.upgrade() {
                    t.apply_shared_reservations(lun, version, state, &effects);
                    aborted = !effects.abort.is_empty();
                }
            }
            if !aborted {
                return ack(n);
            }
            // PREEMPT AND ABORT: acknowledged once the tasks it aborted here have ended, so
            // that no write of a preempted initiator reaches the image after the command
            // completed. Not on librados' thread, which must go on delivering notifies. A
            // task that outlasts the notifier's patience gets this gateway fenced.
            let unit = unit.clone();
            let waited = std::thread::Builder::new()
                .name("preempt-drain".into())
                .spawn(move || {
                    let deadline = std::time::Instant::now() + patience;
                    while unit
                        .upgrade()
                        .is_some_and(|t| t.aborted_tasks_in_flight(lun) > 0)
                        && std::time::Instant::now() < deadline
                    {
                        std::thread::sleep(Duration::from_millis(1));
                    }
                    ack(n);
                });
            if let Err(e) = waited {
                tracing::warn!("a thread to wait for aborted tasks: {e}");
            }
        };
        let watch = self.watch(oid, on_notify).map_err(rados_text)?;
        self.republish();
        let mut units = self.units.lock().unwrap_or_else(PoisonError::into_inner);
        units.retain(|(t, l)| t.strong_count() > 0 && !(t.ptr_eq(&target) && *l == lun));
        units.push((target.clone(), lun));
        drop(units);
        let membership = self.membership();
        if let (false, Some(t)) = (membership.members.is_empty(), target.upgrade()) {
            t.set_port_groups(lun, self.groups_of(&membership, policy));
        }
        Ok(SharedUnit {
            oid: oid.to_string(),
            _watch: watch,
        })
    }

    /// Queues a change for the reservations thread.
    pub fn submit(&self, target: Weak<Target>, change: ReservationChange) {
        let job = Job { target, change };
        if let Err(mpsc::SendError(job)) = self
            .jobs
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .send(job)
        {
            // The thread has ended (the daemon stops): what waits ends unanswered by it.
            if let Some(t) = job.target.upgrade() {
                if let Some(task) = job.change.task {
                    t.reservation_done(task, Err(unavailable()));
                }
                if let Some(reference) = job.change.tmf {
                    t.task_management_change_done(reference);
                }
            }
        }
    }

    /// Decides one change and ends its command.
    fn decide(&self, job: Job) {
        let Some(target) = job.target.upgrade() else {
            return;
        };
        let c = &job.change;
        let oid = target
            .lun(c.lun)
            .and_then(|l| l.shared.as_ref().map(|s| s.oid.clone()));
        let result = match oid {
            Some(oid) => self.change(&target, &oid, c),
            None => Err(unavailable()),
        };
        if let Some(task) = c.task {
            target.reservation_done(task, result);
        }
        if let Some(reference) = c.tmf {
            target.task_management_change_done(reference);
        }
    }

    fn change(&self, target: &Target, oid: &str, c: &ReservationChange) -> Result<(), PrError> {
        self.counters.changes.fetch_add(1, Relaxed);
        for _ in 0..MAX_RACES {
            let read = self.pool().read(oid, MAX_STATE).map_err(|e| {
                tracing::warn!(object = oid, "reading the reservations: {}", rados_text(e));
                unavailable()
            })?;
            let (state, version) = match read {
                Some(v) => match Reservations::decode(&v.data) {
                    Some(s) => (s, Some(v.version)),
                    None => {
                        tracing::error!(object = oid, "the shared reservations are damaged");
                        return Err(unavailable());
                    }
                },
                None => (Reservations::default(), None),
            };
            let mut next = state.clone();
            let effects = next.apply(&c.nexus, &c.request)?;
            // A reset changes nothing shared when no SPC-2 reservation is held, but the other
            // gateways must reset too: it is written (a new version) all the same.
            if next == state && !effects.reset {
                return Ok(());
            }
            let version = match self.pool().replace(oid, version, &next.encode()) {
                Ok(v) => v,
                Err(CasError::Conflict) => {
                    self.counters.races.fetch_add(1, Relaxed);
                    continue;
                }
                Err(CasError::Rados(e)) => {
                    tracing::warn!(object = oid, "writing the reservations: {}", rados_text(e));
                    return Err(unavailable());
                }
            };
            let payload = encode_change(version, &next, &effects);
            // This gateway made the change: a reset has been carried out here already.
            let here = ReservationEffects {
                reset: false,
                ..effects
            };
            target.apply_shared_reservations(c.lun, version, next, &here);
            let timeout = Duration::from_secs(self.config.notify_timeout);
            match self.pool().notify(oid, &payload, timeout) {
                Ok(o) if o.timed_out.is_empty() => {}
                Ok(o) => {
                    self.counters.unacknowledged.fetch_add(1, Relaxed);
                    // The command ends only once those that did not apply the change can
                    // enforce nothing any more.
                    let fenced = self.fence(&o.timed_out);
                    tracing::warn!(
                        object = oid,
                        silent = ?o.timed_out.iter().map(|(gid, _)| format!("client.{gid}")).collect::<Vec<_>>(),
                        ?fenced,
                        "gateways did not apply a change to the reservations in time"
                    );
                }
                Err(e) => tracing::warn!(
                    object = oid,
                    "telling the other gateways of a change: {}",
                    rados_text(e)
                ),
            }
            return Ok(());
        }
        tracing::warn!(
            object = oid,
            "lost {MAX_RACES} races to change the reservations"
        );
        Err(unavailable())
    }
}

/// NOT READY, LOGICAL UNIT IS IN PROCESS OF BECOMING READY: the cluster did not answer, the
/// initiator retries.
fn unavailable() -> PrError {
    PrError::Sense(Sense::from(BackendError::Unavailable))
}

fn rados_text(e: i32) -> String {
    std::io::Error::from_raw_os_error(-e).to_string()
}

/// A change as gateways tell each other: le64 version, le32 length and the state, then the
/// effects.
fn encode_change(version: u64, state: &Reservations, effects: &ReservationEffects) -> Vec<u8> {
    let s = state.encode();
    let mut b = Vec::with_capacity(12 + s.len());
    b.extend_from_slice(&version.to_le_bytes());
    b.extend_from_slice(&(s.len() as u32).to_le_bytes());
    b.extend_from_slice(&s);
    b.extend_from_slice(&effects.encode());
    b
}

fn decode_change(b: &[u8]) -> Option<(u64, Reservations, ReservationEffects)> {
    let version = u64::from_le_bytes(b.get(..8)?.try_into().ok()?);
    let len = u32::from_le_bytes(b.get(8..12)?.try_into().ok()?) as usize;
    let state = Reservations::decode(b.get(12..12usize.checked_add(len)?)?)?;
    let effects = ReservationEffects::decode(&b[12 + len..])?;
    Some((version, state, effects))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_change_survives_its_encoding_and_damage_is_refused() {
        let state = Reservations::default();
        let effects = ReservationEffects::default();
        let b = encode_change(7, &state, &effects);
        assert_eq!(decode_change(&b), Some((7, state, effects)));
        assert_eq!(decode_change(&b[..10]), None);
        let mut long = b.clone();
        long[8..12].copy_from_slice(&u32::MAX.to_le_bytes());
        assert_eq!(decode_change(&long), None);
        assert_eq!(decode_change(&[]), None);
    }
}
