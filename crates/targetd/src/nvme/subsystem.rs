//! An NVM subsystem as the daemon runs it: its configuration, the subsystem machine of
//! crates/nvme behind a lock (the queues of its controllers reach it from every reactor), and
//! its namespaces as units (what a LUN is made of: a store, its geometry, its counters).

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, RwLock, Weak};

use md5::{Digest, Md5};
use nvme::ana::AnaState;
use nvme::controller::{Namespace, SharedReservation, Subsystem, SubsystemConfig};
use nvme::nvm::NamespaceGeometry;
use scsi_core::spc::tpg::PortGroup;

use crate::cluster::{Cluster, Following, SharedTarget};
use crate::config;
use crate::lock;
use crate::store::UnitStore;
use crate::target::TargetEnv;
use crate::unit::{next_id, CachedUnit, Lun, LunStats, UnitCache, UnitMap};

/// The largest transfer of one command: 2^MDTS pages of 4 KiB, 1 MiB (Linux's host splits
/// larger requests).
pub const MDTS: u8 = 8;

/// Controller IDs each gateway of a cluster gives its controllers: a range of its own.
pub const CNTLIDS_PER_GATEWAY: u16 = 1024;
/// The largest port group whose range fits in NVMe's controller IDs (1 to FFEFh).
pub const MAX_NVME_PORT_GROUP: u16 = 63;

/// The controller IDs a subsystem's controllers take on the gateway of port group
/// `port_group` (`None`: alone, every one): port group p takes (p - 1) x 1024 + 1 to
/// p x 1024, so that a host connected to several gateways of a subsystem never sees one
/// CNTLID twice (Linux's host refuses such a path). `None` past [`MAX_NVME_PORT_GROUP`].
pub fn controller_ids(port_group: Option<u16>) -> Option<(u16, u16)> {
    let Some(p) = port_group else {
        return Some(nvme::controller::ALL_CNTLIDS);
    };
    if !(1..=MAX_NVME_PORT_GROUP).contains(&p) {
        return None;
    }
    let first = (p - 1) * CNTLIDS_PER_GATEWAY + 1;
    Some((first, first + CNTLIDS_PER_GATEWAY - 1))
}

/// An NVM subsystem the daemon exports.
pub struct NvmeSubsystem {
    /// Unique for the daemon's life.
    pub id: u64,
    /// SUBNQN.
    pub nqn: String,
    /// As configured (its `namespaces` list is not kept current; see
    /// [`NvmeSubsystem::namespaces`]).
    pub config: RwLock<config::Subsystem>,
    machine: Mutex<Subsystem>,
    namespaces: UnitMap<u32>,
    /// Removed from the daemon (`targetctl subsystem remove`, a reload): its connections
    /// close at their next wake.
    removed: std::sync::atomic::AtomicBool,
    /// Itself, for storage that calls back (an RBD image resized by another client).
    this: std::sync::Weak<NvmeSubsystem>,
    /// Held while a namespace's size changes, so a resize here and one seen through the
    /// image's watch do not interleave.
    resizing: Mutex<()>,
    /// The cluster of gateways this daemon belongs to, and this gateway's port group: its
    /// namespaces on RBD images are exported by the other gateways too
    /// ([`NvmeSubsystem::open_namespace`]).
    cluster: Option<(Arc<dyn Cluster>, u16)>,
    /// The shared namespaces whose reservations and port groups this gateway follows, by
    /// NSID: dropping one stops following it.
    following: Mutex<BTreeMap<u32, Following>>,
    /// Each shared namespace's port groups as the cluster gave them last.
    port_groups: Mutex<BTreeMap<u32, Vec<PortGroup>>>,
    /// Moves on when something may wait in the machine for the controllers' connections
    /// (asynchronous events for admin queues, a Preempt and Abort's aborts and completion for
    /// I/O queues), which watch it: a change made while one was busy is seen at its next wait.
    pub events: tokio::sync::watch::Sender<u64>,
}

impl std::fmt::Debug for NvmeSubsystem {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NvmeSubsystem")
            .field("nqn", &self.nqn)
            .finish()
    }
}

fn lock_read<T>(l: &RwLock<T>) -> std::sync::RwLockReadGuard<'_, T> {
    l.read().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// 16 bytes naming `what` of the unit `key`, the same at every start: MD5 over both.
fn derived(what: &str, key: &str) -> [u8; 16] {
    let mut h = Md5::new();
    h.update(what.as_bytes());
    h.update([0]);
    h.update(key.as_bytes());
    h.finalize().into()
}

impl NvmeSubsystem {
    /// Opens the namespaces of `config` (creating missing files); `Err((nsid, reason))` for
    /// the first that cannot be. Reservations that persist through power loss are kept in
    /// `store` (`server.state_dir`); without one, hosts cannot ask for that. In `env`'s
    /// cluster, namespaces on RBD images are shared with the other gateways.
    pub fn new(
        config: &config::Subsystem,
        nvme: &config::Nvme,
        store: Option<Box<dyn scsi_core::pr::PrStore>>,
        env: &TargetEnv,
    ) -> Result<Arc<NvmeSubsystem>, (u32, String)> {
        let serial = config.serial.clone().unwrap_or_else(|| {
            let d = derived("serial", &config.nqn);
            d.iter().take(10).map(|b| format!("{b:02x}")).collect()
        });
        let mut machine = Subsystem::new(SubsystemConfig {
            nqn: config.nqn.clone(),
            serial,
            model: config.model.clone().unwrap_or_else(|| "targetd".into()),
            firmware: env!("CARGO_PKG_VERSION").chars().take(8).collect(),
            hosts: config.hosts.clone(),
            max_io_queues: nvme.max_io_queues,
            max_queue_entries: nvme.queue_entries,
            max_in_capsule_data: nvme.in_capsule_data_size,
            mdts: MDTS,
            // The config refuses port groups without a range of their own.
            cntlids: controller_ids(env.cluster.as_ref().map(|_| env.port_group))
                .unwrap_or(nvme::controller::ALL_CNTLIDS),
        });
        if let Some(store) = store {
            machine.set_reservation_store(store);
        }
        let s = Arc::new_cyclic(|this| NvmeSubsystem {
            id: next_id(),
            nqn: config.nqn.clone(),
            config: RwLock::new(config.clone()),
            machine: Mutex::new(machine),
            namespaces: UnitMap::default(),
            removed: Default::default(),
            this: this.clone(),
            resizing: Mutex::new(()),
            cluster: env.cluster.clone().map(|c| (c, env.port_group)),
            following: Mutex::default(),
            port_groups: Mutex::default(),
            events: tokio::sync::watch::Sender::new(0),
        });
        for ns in &config.namespaces {
            s.add_namespace(ns).map_err(|e| (ns.nsid, e))?;
        }
        Ok(s)
    }

    /// The discovery subsystem: its controllers tell hosts which subsystems they may reach
    /// and where ([`NvmeSubsystem::set_discovery_log`]).
    pub fn discovery(nvme: &config::Nvme) -> Arc<NvmeSubsystem> {
        let machine = Subsystem::discovery(SubsystemConfig {
            nqn: nvme::fabrics::DISCOVERY_NQN.into(),
            serial: "discovery".into(),
            model: "targetd discovery".into(),
            firmware: env!("CARGO_PKG_VERSION").chars().take(8).collect(),
            hosts: Vec::new(),
            max_io_queues: 0,
            max_queue_entries: 32,
            max_in_capsule_data: nvme.in_capsule_data_size,
            mdts: MDTS,
            cntlids: nvme::controller::ALL_CNTLIDS,
        });
        Arc::new_cyclic(|this| NvmeSubsystem {
            id: next_id(),
            nqn: nvme::fabrics::DISCOVERY_NQN.into(),
            config: RwLock::new(config::Subsystem {
                nqn: nvme::fabrics::DISCOVERY_NQN.into(),
                serial: None,
                model: None,
                hosts: Vec::new(),
                namespaces: Vec::new(),
            }),
            machine: Mutex::new(machine),
            namespaces: UnitMap::default(),
            removed: Default::default(),
            this: this.clone(),
            resizing: Mutex::new(()),
            cluster: None,
            following: Mutex::default(),
            port_groups: Mutex::default(),
            events: tokio::sync::watch::Sender::new(0),
        })
    }

    /// A discovery subsystem's log from now on: each of `subsystems` at each of `portals`
    /// (the NVMe/TCP listeners' addresses, each a port of its own) and of `rdma_portals`
    /// (NVMe/RDMA's), for the hosts each admits; and the discovery service itself at each of
    /// `discovery_portals`.
    pub fn set_discovery_log(
        &self,
        subsystems: &[Arc<NvmeSubsystem>],
        portals: &[std::net::SocketAddr],
        rdma_portals: &[std::net::SocketAddr],
        discovery_portals: &[std::net::SocketAddr],
    ) {
        use nvme::controller::DiscoveryRecord;
        use nvme::log_page::{self as lp, DiscoveryEntry};
        // Each listening address a port of its own: TCP's, then RDMA's, then discovery's.
        let trtype = |i: usize| match i.checked_sub(portals.len()) {
            Some(r) if r < rdma_portals.len() => lp::TRTYPE_RDMA,
            _ => lp::TRTYPE_TCP,
        };
        let entry = |i: usize, at: &std::net::SocketAddr, subtype: u8, nqn: &str| DiscoveryEntry {
            trtype: trtype(i),
            adrfam: if at.is_ipv4() {
                lp::ADRFAM_IPV4
            } else {
                lp::ADRFAM_IPV6
            },
            subtype,
            portid: (i + 1) as u16,
            trsvcid: at.port().to_string(),
            subnqn: nqn.into(),
            traddr: at.ip().to_string(),
        };
        let mut records = Vec::new();
        for s in subsystems {
            let hosts = lock_read(&s.config).hosts.clone();
            for (i, at) in portals.iter().chain(rdma_portals).enumerate() {
                records.push(DiscoveryRecord {
                    entry: entry(i, at, lp::SUBTYPE_NVM, &s.nqn),
                    hosts: hosts.clone(),
                });
            }
        }
        for (i, at) in discovery_portals.iter().enumerate() {
            records.push(DiscoveryRecord {
                entry: entry(
                    portals.len() + rdma_portals.len() + i,
                    at,
                    lp::SUBTYPE_CURRENT_DISCOVERY,
                    &self.nqn,
                ),
                hosts: Vec::new(),
            });
        }
        self.with_machine(|m| m.set_discovery_log(records));
        self.events.send_modify(|n| *n += 1);
    }

    /// `f` with the subsystem machine, under its lock. When the machine has something for
    /// other connections (asynchronous events, aborts of a Preempt and Abort, a held
    /// completion), they are woken ([`NvmeSubsystem::events`]); reservation changes on
    /// shared namespaces go to the cluster, outside the lock.
    pub fn with_machine<T>(&self, f: impl FnOnce(&mut Subsystem) -> T) -> T {
        let mut m = lock(&self.machine);
        let out = f(&mut m);
        let wake = m.take_wakeup();
        // No allocation while there is none (every I/O passes here).
        let asks: Vec<SharedReservation> =
            std::iter::from_fn(|| m.poll_shared_reservation()).collect();
        drop(m);
        if wake {
            self.events.send_modify(|n| *n += 1);
        }
        for ask in asks {
            self.submit_shared(ask);
        }
        out
    }

    /// Has the cluster decide reservation change `ask` on a shared namespace.
    fn submit_shared(&self, ask: SharedReservation) {
        let nsid = u16::try_from(ask.nsid).ok();
        match (&self.cluster, nsid) {
            (Some((cluster, _)), Some(nsid)) => {
                let me: Weak<dyn SharedTarget> = self.this.clone();
                let request = cluster::ask::Ask::Nvme {
                    command: ask.command,
                    data: ask.data,
                };
                cluster.submit_nvme(me, nsid, ask.id, ask.host, request);
            }
            _ => self.with_machine(|m| {
                m.shared_reservation_done(ask.id, Err(nvme::Status::NAMESPACE_NOT_READY))
            }),
        }
    }

    /// Namespace `nsid`'s unit.
    pub fn namespace(&self, nsid: u32) -> Option<Arc<Lun>> {
        self.namespaces.get(nsid)
    }

    /// The namespaces, by NSID.
    pub fn namespaces(&self) -> Vec<(u32, Arc<Lun>)> {
        self.namespaces.list()
    }

    /// Opens namespace `ns` and attaches it: the controllers connected hear of it (a
    /// Namespace Attribute Changed notice where their hosts asked for them).
    pub fn add_namespace(&self, ns: &config::Namespace) -> Result<(), String> {
        let opened = self.open_namespace(ns)?;
        self.attach_namespace(opened)
    }

    /// Opens the storage of namespace `ns` (creating a missing file), not yet attached.
    ///
    /// In a cluster of gateways a namespace on an RBD image is exported by every gateway:
    /// it is written through (librbd's cache would keep a write on this gateway until a
    /// flush), it is an ANA group of its own (ANAGRPID = NSID) whose state follows which
    /// gateways are alive, and its reservations are the cluster's, decided and fenced as a
    /// shared LUN's are ([`NvmeSubsystem::attach_namespace`]).
    pub fn open_namespace(&self, ns: &config::Namespace) -> Result<(Namespace, Arc<Lun>), String> {
        let shared = self.is_shared(&ns.unit);
        let config = if shared && ns.unit.write_cache {
            std::borrow::Cow::Owned(config::Lun {
                write_cache: false,
                ..ns.unit.clone()
            })
        } else {
            std::borrow::Cow::Borrowed(&ns.unit)
        };
        let unit = self.open_unit(ns.nsid, &config, Arc::new(LunStats::default()))?;
        let key = unit.storage.identity_key().unwrap_or_else(|| {
            let path = ns.unit.path.as_ref().map(|p| p.display().to_string());
            format!("{}/{}/{}", self.nqn, ns.nsid, path.unwrap_or_default())
        });
        let mut uuid = derived("uuid", &key);
        // A name-based UUID (RFC 4122 version 3: MD5).
        uuid[6] = uuid[6] & 0x0f | 0x30;
        uuid[8] = uuid[8] & 0x3f | 0x80;
        let namespace = Namespace {
            nsid: ns.nsid,
            geometry: NamespaceGeometry {
                block_size: unit.block_size,
                blocks: unit.blocks,
                read_only: ns.unit.read_only,
            },
            nguid: derived("nguid", &key),
            uuid,
            thin: ns.unit.thin && ns.unit.backend != "null",
            write_cache: config.write_cache,
            compare_and_write: unit.storage.atomic_compare_and_write(unit.block_size),
            ana_group: if shared {
                ns.nsid
            } else {
                nvme::ana::DEFAULT_GROUP
            },
            reservations: true,
            shared_reservations: shared,
        };
        Ok((namespace, Arc::new(unit)))
    }

    /// Opens namespace `nsid`'s storage as `config` says, watching its size (an RBD image
    /// resized by another client: the namespace takes its new size).
    fn open_unit(
        &self,
        nsid: u32,
        config: &config::Lun,
        stats: Arc<LunStats>,
    ) -> Result<Lun, String> {
        let unit = Lun::open(config, stats)?;
        let this = self.this.clone();
        unit.storage.watch_size(Arc::new(move |bytes| {
            if let Some(s) = this.upgrade() {
                s.capacity_changed(nsid, bytes);
            }
        }))?;
        Ok(unit)
    }

    /// Attaches a namespace [`NvmeSubsystem::open_namespace`] opened; the controllers hear of
    /// it. A shared one enters in ANA state change (its I/O is retried) with no
    /// reservations, takes the cluster's reservations, then follows them and its port
    /// groups, which give its ANA state; when it cannot be shared (the cluster unreachable,
    /// or another gateway exports the image otherwise) it is detached again and the error
    /// says why.
    pub fn attach_namespace(&self, (namespace, unit): (Namespace, Arc<Lun>)) -> Result<(), String> {
        let (nsid, shared) = (namespace.nsid, namespace.shared_reservations);
        self.namespaces.insert(nsid, unit.clone());
        self.with_machine(|m| {
            m.add_namespace(namespace);
            if shared {
                m.set_ana_state(nsid, AnaState::Change);
            }
        });
        if shared {
            if let Err(e) = self.share(nsid, &unit) {
                self.namespaces.remove(nsid);
                self.with_machine(|m| m.remove_namespace(nsid));
                return Err(e);
            }
        }
        Ok(())
    }

    /// Namespace `nsid`'s shared reservations are `state` at `version`, read after changes
    /// its hosts may have missed (they hear the net outcome).
    fn catch_up(&self, nsid: u32, version: u64, state: scsi_core::pr::Reservations) {
        let applied =
            self.with_machine(|m| m.catch_up_shared_reservations(nsid, version, state.persistent));
        if !applied {
            tracing::debug!(subsystem = %self.nqn, nsid, version, "the reservations were current already");
        }
    }

    /// Shares namespace `nsid` on `unit` with the cluster's other gateways: checks that they
    /// export its image alike, takes the reservations the cluster keeps (what its hosts
    /// missed since the state here was read, they hear), then follows them.
    fn share(&self, nsid: u32, unit: &Lun) -> Result<(), String> {
        let Some((cluster, _)) = &self.cluster else {
            return Ok(());
        };
        let me: Weak<dyn SharedTarget> = self.this.clone();
        let mut adopt = |version, state| {
            self.catch_up(nsid, version, state);
            Ok(())
        };
        let followed = cluster.share(me, &unit.config, &*unit.storage, &mut adopt)?;
        if let Some(f) = followed {
            lock(&self.following).insert(nsid, f);
        }
        Ok(())
    }

    /// Opens shared namespace `nsid` again on the process's connection to the cluster (after
    /// this gateway rejoined), with the reservations the cluster keeps now.
    fn reopen_namespace(&self, nsid: u32) -> Result<(), String> {
        let _resizing = lock(&self.resizing);
        let old = self.namespace(nsid).ok_or(format!("no namespace {nsid}"))?;
        let unit = Arc::new(self.open_unit(nsid, &old.config, old.stats.clone())?);
        lock(&self.following).remove(&nsid);
        self.namespaces.insert(nsid, unit.clone());
        self.share(nsid, &unit)
    }

    /// Detaches namespace `nsid`; its commands in flight end on the store they started on.
    pub fn remove_namespace(&self, nsid: u32) -> Result<(), String> {
        let gone = self.namespaces.remove(nsid);
        if gone.is_none() {
            return Err(format!("no namespace {nsid}"));
        }
        lock(&self.following).remove(&nsid);
        lock(&self.port_groups).remove(&nsid);
        self.with_machine(|m| m.remove_namespace(nsid));
        Ok(())
    }

    /// Resizes namespace `nsid`'s storage to `bytes` (a smaller size cuts off its last
    /// blocks: the caller asks for `--force` first); its commands in flight end on the store
    /// they started on, and the controllers hear of the new size (a Namespace Attribute
    /// Changed notice; Linux's host rereads Identify Namespace). Reservations stay.
    pub fn resize_namespace(&self, nsid: u32, bytes: u64) -> Result<(), String> {
        let _resizing = self
            .resizing
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let old = self.namespace(nsid).ok_or(format!("no namespace {nsid}"))?;
        let (storage, blocks) = old.resize_storage(bytes)?;
        self.replace_resized(nsid, &old, storage, blocks);
        Ok(())
    }

    /// The storage of namespace `nsid` says its size is now `bytes` (an RBD image resized by
    /// another client, or through another gateway): the namespace takes that size and the
    /// controllers hear of it. Nothing happens when it has that size already.
    pub fn capacity_changed(&self, nsid: u32, bytes: u64) {
        let _resizing = self
            .resizing
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let Some(old) = self.namespace(nsid) else {
            return;
        };
        let blocks = bytes / u64::from(old.block_size);
        if blocks == old.blocks {
            return;
        }
        tracing::info!(
            subsystem = %self.nqn,
            nsid,
            from = old.blocks,
            to = blocks,
            "the namespace's storage was resized elsewhere"
        );
        // The same store, which someone else resized.
        self.replace_resized(nsid, &old, old.storage.clone(), blocks);
    }

    /// Puts a unit of `blocks` blocks on `storage` in `old`'s place as namespace `nsid`
    /// (counters kept), and tells the controllers (a Namespace Attribute Changed notice;
    /// Linux's host rereads Identify Namespace). Reservations stay.
    fn replace_resized(&self, nsid: u32, old: &Lun, storage: Arc<dyn UnitStore>, blocks: u64) {
        self.namespaces
            .insert(nsid, Arc::new(old.resized(storage, blocks)));
        self.with_machine(|m| {
            if let Some(mut ns) = m.namespace(nsid).cloned() {
                ns.geometry.blocks = blocks;
                m.add_namespace(ns);
            }
        });
    }

    /// Counts a finished command on its namespace in a connection's tally
    /// ([`UnitCache::tally`]); the queue's [`Link`](super::queue::Link) adds it to the
    /// namespace's counters when it is dropped, before what it made is sent.
    pub fn tally(&self, cache: &mut UnitCache<u32>, a: &scsi_core::transport::Accounting) {
        if let Ok(nsid) = u32::try_from(a.lun) {
            cache.tally(&self.namespaces, nsid, a);
        }
    }

    /// Namespace `nsid`'s unit for a backend operation, through a connection's cache.
    pub fn cached_namespace<'c>(
        &self,
        cache: &'c mut UnitCache<u32>,
        nsid: u32,
    ) -> Option<CachedUnit<'c>> {
        cache.unit(&self.namespaces, nsid)
    }

    /// Whether a namespace on `unit` is exported by the other gateways of the cluster too.
    fn is_shared(&self, unit: &config::Lun) -> bool {
        self.cluster.is_some() && unit.backend == "rbd"
    }

    /// Sets ANA group `group`'s state as this gateway's controllers report it; the hosts
    /// that asked hear of a change.
    pub fn set_ana_state(&self, group: u32, state: nvme::ana::AnaState) {
        self.with_machine(|m| m.set_ana_state(group, state));
    }

    /// Takes it out of service: its connections close at their next wake (this wakes
    /// them), and a Connect to it is refused from now on (the registry no longer lists it).
    pub fn remove(&self) {
        self.removed
            .store(true, std::sync::atomic::Ordering::Release);
        self.events.send_modify(|n| *n += 1);
    }

    /// Whether it was removed ([`NvmeSubsystem::remove`]).
    pub fn is_removed(&self) -> bool {
        self.removed.load(std::sync::atomic::Ordering::Acquire)
    }

    /// The controllers connected: CNTLID and host NQN.
    pub fn controllers(&self) -> Vec<(u16, String)> {
        self.with_machine(|m| m.controllers().map(|(id, h)| (id, h.to_string())).collect())
    }

    /// The controllers connected, each with the I/O queues it has connected (QIDs).
    pub fn controllers_and_queues(&self) -> Vec<(u16, String, Vec<u16>)> {
        self.with_machine(|m| {
            m.controllers()
                .map(|(id, h)| (id, h.to_string(), m.io_queues(id)))
                .collect()
        })
    }
}

/// The cluster reaches a subsystem's shared namespaces as a target's units: a unit is a
/// namespace, its LUN the NSID (at most [`config::MAX_NSID`], within a LUN's range).
impl SharedTarget for NvmeSubsystem {
    fn name(&self) -> &str {
        &self.nqn
    }

    fn unit_label(&self, lun: u16) -> String {
        format!("subsystem {}\nnsid {lun}\n", self.nqn)
    }

    /// The hosts it admits and each namespace's storage: what a host must find alike
    /// through every gateway.
    fn definition(&self) -> cluster::definition::Definition {
        let mut d = cluster::definition::Definition::new();
        d.insert(
            "hosts".into(),
            crate::target::listed(lock_read(&self.config).hosts.clone()),
        );
        let gateway = self.cluster.as_ref().map_or("", |(c, _)| c.gateway());
        for (nsid, unit) in self.namespaces() {
            d.insert(format!("namespace.{nsid}"), unit.definition(gateway));
        }
        d
    }

    fn storage(&self, lun: u16) -> Option<Arc<dyn UnitStore>> {
        Some(self.namespace(u32::from(lun))?.storage.clone())
    }

    fn apply_shared_reservations(
        &self,
        lun: u16,
        version: u64,
        state: scsi_core::pr::Reservations,
        effects: &scsi_core::pr::ReservationEffects,
    ) {
        let nsid = u32::from(lun);
        let applied = self.with_machine(|m| {
            m.apply_shared_reservations(nsid, version, state.persistent, effects)
        });
        if !applied {
            tracing::debug!(subsystem = %self.nqn, nsid, version, "a reservation change heard late or twice");
        }
    }

    fn catch_up_shared_reservations(
        &self,
        lun: u16,
        version: u64,
        state: scsi_core::pr::Reservations,
    ) {
        self.catch_up(u32::from(lun), version, state)
    }

    /// The namespace's ANA state follows this gateway's port group's access state.
    fn set_port_groups(&self, lun: u16, groups: Vec<PortGroup>) {
        let Some((_, port_group)) = &self.cluster else {
            return;
        };
        let nsid = u32::from(lun);
        let mine = groups.iter().find(|g| g.id == *port_group).map(|g| g.state);
        let state = ana_state(mine);
        lock(&self.port_groups).insert(nsid, groups);
        let before = self.with_machine(|m| {
            let before = m.ana_state(nsid);
            m.set_ana_state(nsid, state);
            before
        });
        if before != state {
            tracing::info!(subsystem = %self.nqn, nsid, ?state, "ANA state changed");
        }
    }

    fn port_groups(&self, lun: u16) -> Option<Vec<PortGroup>> {
        lock(&self.port_groups).get(&u32::from(lun)).cloned()
    }

    /// The holder's Host Identifier and the SCSI TYPE of its reservation.
    fn reservation_holder(&self, lun: u16) -> Option<(String, Option<u8>)> {
        self.with_machine(|m| {
            let r = m.reservations(u32::from(lun))?.reservation.as_ref()?;
            Some((r.holder.initiator.name.clone(), Some(r.kind)))
        })
    }

    fn reservation_done(&self, task: scsi_core::TaskId, _: Result<(), scsi_core::pr::PrError>) {
        // A subsystem submits NVMe changes only.
        tracing::debug!(subsystem = %self.nqn, ?task, "a SCSI reservation change's end");
    }

    fn nvme_reservation_done(&self, id: u64, result: Result<(), nvme::Status>) {
        self.with_machine(|m| m.shared_reservation_done(id, result));
    }

    fn task_management_change_done(&self, _: u64) {}

    fn port_groups_change_done(&self, _: scsi_core::TaskId, _: Result<(), scsi_core::Sense>) {}

    fn aborted_tasks_in_flight(&self, lun: u16) -> usize {
        self.with_machine(|m| m.aborted_in_flight(u32::from(lun)))
    }

    fn reopen_shared_lun(&self, lun: u16) -> Result<(), String> {
        self.reopen_namespace(u32::from(lun))
    }
}

/// The ANA state of a namespace whose port group here has ALUA state `state` (none: this
/// gateway is not in the membership yet): optimized and non-optimized as ALUA says them;
/// standby, unavailable and offline are inaccessible (a host sends nothing here while
/// another path is optimized); transitioning is change. A fenced gateway's own group comes
/// from the cluster unavailable: inaccessible.
pub fn ana_state(state: Option<scsi_core::spc::tpg::AccessState>) -> AnaState {
    use scsi_core::spc::tpg::AccessState;
    match state {
        Some(AccessState::ActiveOptimized) => AnaState::Optimized,
        Some(AccessState::ActiveNonOptimized) => AnaState::NonOptimized,
        Some(AccessState::Transitioning) => AnaState::Change,
        Some(AccessState::Standby | AccessState::Unavailable | AccessState::Offline) | None => {
            AnaState::Inaccessible
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use scsi_core::spc::tpg::AccessState;

    #[test]
    fn each_gateway_has_controller_ids_of_its_own() {
        assert_eq!(controller_ids(None), Some((1, 0xffef)));
        assert_eq!(controller_ids(Some(1)), Some((1, 1024)));
        assert_eq!(controller_ids(Some(2)), Some((1025, 2048)));
        let last = controller_ids(Some(MAX_NVME_PORT_GROUP)).unwrap();
        assert!(last.1 <= 0xffef, "{last:?}");
        assert_eq!(controller_ids(Some(MAX_NVME_PORT_GROUP + 1)), None);
        assert_eq!(controller_ids(Some(0)), None);
    }

    #[test]
    fn alua_states_map_onto_ana_states() {
        assert_eq!(
            ana_state(Some(AccessState::ActiveOptimized)),
            AnaState::Optimized
        );
        assert_eq!(
            ana_state(Some(AccessState::ActiveNonOptimized)),
            AnaState::NonOptimized
        );
        assert_eq!(
            ana_state(Some(AccessState::Standby)),
            AnaState::Inaccessible
        );
        assert_eq!(
            ana_state(Some(AccessState::Unavailable)),
            AnaState::Inaccessible
        );
        assert_eq!(
            ana_state(Some(AccessState::Transitioning)),
            AnaState::Change
        );
        assert_eq!(ana_state(None), AnaState::Inaccessible);
    }
}
