//! An NVM subsystem and its controllers, as a machine independent of the transport: Connect
//! on an admin queue makes a controller (the dynamic controller model), Connect on an I/O
//! queue joins it; each command on a connected queue is answered with a completion, data
//! and a completion, an I/O command for the shell to carry out on a namespace's storage
//! (decoded by [`crate::nvm`]), or nothing yet (an Asynchronous Event Request, held). Keep
//! alive is enforced on `now`: a controller whose host has not sent Keep Alive within its
//! KATO fails, and the shell closes its connections.
//!
//! What is here: Connect (subsystem and host NQN checks, queue IDs and sizes, KATO), Property
//! Get and Set (enable, reset, shutdown), Identify (CNS 00h, 01h, 02h, 03h), Get Log Page
//! (error, SMART, firmware slot, changed namespaces, commands supported and effects, ANA),
//! Set and Get Features (number of queues, asynchronous event configuration, keep alive timer,
//! volatile write cache, host identifier), Keep Alive, Asynchronous Event Requests (held,
//! and answered with a Namespace Attribute Changed notice when a namespace is added, resized
//! or removed: [`Subsystem::poll_async_events`]), Abort (answers that it did not abort),
//! Disconnect; the NVM commands [`crate::nvm`] decodes, each checked against the
//! namespace's reservation; and the reservation commands ([`crate::reservation`]) with their
//! notices (the Reservation Notification log page and its asynchronous event), the
//! Reservation Notification Mask and Reservation Persistence features, persistence through
//! power loss in a [`PrStore`], and Preempt and Abort, which completes only once the
//! preempted hosts' commands on the namespace have ended
//! ([`Subsystem::poll_abort`], [`Subsystem::aborted`]).

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::net::IpAddr;
use std::time::{Duration, Instant};

use bytes::Bytes;

use crate::ana::{self, AnaGroups, AnaState};
use crate::cqe::Cqe;
use crate::fabrics::{
    CcChange, Connect, ConnectData, InvalidParameter, Properties, PropertyAccess,
    CATTR_SQ_FLOW_CONTROL_DISABLE, CNTLID_DYNAMIC,
};
use crate::identify::{self, cns, ControllerIdentity, NamespaceIdentity};
use crate::log_page::{self, lid, LogRequest};
use crate::nvm::{self, IoCommand, NamespaceGeometry};
use crate::opcode::{AdminOpcode, FabricsType, NvmOpcode};
use crate::reservation::{self, ReservationCommand};
use crate::sqe::{SglKind, Sqe};
use crate::status::Status;
use scsi_core::nexus::ItNexus;
use scsi_core::pr::{PrState, PrStore, ReservationEffects};
use scsi_core::spc::opcodes::Access;

/// NVMe 1.4: the version the controller reports (ANA, reservations over fabrics).
pub const VERSION: u32 = 0x0001_0400;

/// What a subsystem is, as its administrator configures it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SubsystemConfig {
    /// SUBNQN.
    pub nqn: String,
    /// The serial number (SN), up to 20 characters.
    pub serial: String,
    /// The model (MN), up to 40 characters.
    pub model: String,
    /// The firmware revision (FR), up to 8 characters.
    pub firmware: String,
    /// Host NQNs allowed; empty: any host.
    pub hosts: Vec<String>,
    /// I/O queues a controller may have.
    pub max_io_queues: u16,
    /// Entries a queue may have (MQES + 1).
    pub max_queue_entries: u16,
    /// In-capsule data an I/O command may carry (IOCCSZ less the SQE).
    pub max_in_capsule_data: u32,
    /// MDTS: the largest transfer, 2^MDTS 4 KiB pages.
    pub mdts: u8,
    /// The controller IDs its controllers take, first and last (within 1 to FFEFh). Where
    /// several gateways export one subsystem each needs its own range: a host refuses a
    /// second controller of a subsystem with a CNTLID it has already.
    pub cntlids: (u16, u16),
}

/// Every controller ID a controller may take: 1 to FFEFh (the values above are reserved).
pub const ALL_CNTLIDS: (u16, u16) = (1, 0xffef);

/// A namespace of the subsystem.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Namespace {
    /// NSID.
    pub nsid: u32,
    /// Block size, size, write protection.
    pub geometry: NamespaceGeometry,
    /// NGUID, stable across restarts.
    pub nguid: [u8; 16],
    /// UUID, stable across restarts.
    pub uuid: [u8; 16],
    /// Thin provisioned: deallocated blocks read as zeros.
    pub thin: bool,
    /// A volatile write cache (Flush makes writes durable).
    pub write_cache: bool,
    /// Blocks a fused Compare and Write may cover, carried out atomically by the storage
    /// (NACWU); 0: the storage cannot, and fused commands are refused on this namespace.
    pub compare_and_write: u16,
    /// Its ANA group (ANAGRPID, 1 to [`ana::MAX_GROUP_ID`]): namespaces whose paths are
    /// alike on every gateway share one ([`ana::DEFAULT_GROUP`] alone).
    pub ana_group: u32,
    /// Whether it takes reservation commands (RESCAP).
    pub reservations: bool,
    /// Its reservations are kept by a cluster of gateways that export it together, which
    /// decides each change: a Register, Acquire or Release waits for the shell to have the
    /// cluster decide it ([`Subsystem::poll_shared_reservation`]), and every gateway applies
    /// the outcome ([`Subsystem::apply_shared_reservations`]).
    pub shared_reservations: bool,
}

/// A reservation change on a namespace whose reservations a cluster of gateways keeps
/// ([`Namespace::shared_reservations`]), for the shell to have decided; it answers with
/// [`Subsystem::shared_reservation_done`] and the same `id`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SharedReservation {
    /// The subsystem's name for it.
    pub id: u64,
    /// The namespace.
    pub nsid: u32,
    /// The host, as reservations name it ([`reservation::host`]).
    pub host: ItNexus,
    /// Register, Acquire or Release.
    pub command: ReservationCommand,
    /// Its data: CRKEY, then NRKEY or PRKEY (zeros past what the command carries).
    pub data: [u8; 16],
}

/// A shared reservation change under way: the command that waits for it.
#[derive(Debug)]
struct Asked {
    id: u64,
    nsid: u32,
    cntlid: u16,
    qid: u16,
    cid: u16,
    preempt_and_abort: bool,
}

/// A connected queue: the controller it belongs to, its ID and size.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Queue {
    /// CNTLID.
    pub cntlid: u16,
    /// QID: 0 the admin queue.
    pub qid: u16,
    /// Entries (SQSIZE + 1).
    pub size: u32,
    /// The host disabled SQ flow control: a read may end with C2HData's SUCCESS flag.
    pub sq_flow_control_disabled: bool,
}

/// How a command is answered.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Answer {
    /// With this completion.
    Complete(Cqe),
    /// With `data` to the host, then the completion.
    Data {
        /// The data.
        data: Bytes,
        /// The completion.
        cqe: Cqe,
    },
    /// With an I/O command on namespace `nsid`, for the shell's storage; the completion
    /// follows its end.
    Io {
        /// The namespace.
        nsid: u32,
        /// What to do.
        command: IoCommand,
    },
    /// Not yet: an Asynchronous Event Request, answered when an event happens; a Preempt
    /// and Abort, answered once the commands it aborts have ended
    /// ([`Subsystem::poll_completion`]).
    Held,
    /// The command's data (`len` bytes, not in the capsule) is needed first: the shell's
    /// connection fetches it (R2T) and hands it to [`Subsystem::fetched`].
    Fetch {
        /// Bytes.
        len: u32,
    },
}

/// The features a host sets (Set Features) and reads back.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Features {
    /// Asynchronous Event Configuration.
    aec: u32,
    /// Volatile Write Cache enabled.
    vwc: bool,
    /// I/O queues granted (Number of Queues), once asked.
    io_queues: Option<u16>,
}

/// One controller of the subsystem.
#[derive(Debug)]
struct Controller {
    hostnqn: String,
    hostid: [u8; 16],
    properties: Properties,
    features: Features,
    /// The keep alive timeout, and when the host last showed it is alive.
    kato: Option<Duration>,
    alive_at: Instant,
    /// I/O queues connected.
    io_queues: BTreeSet<u16>,
    /// Asynchronous Event Requests held: their CIDs.
    aers: Vec<u16>,
    /// Notices to send (a completion's DW0 each), waiting for an Asynchronous Event Request.
    notices: Vec<u32>,
    /// Namespaces whose attributes changed since the host last read the Changed Namespace
    /// List; a notice of the kind waits until it does (the specification masks it).
    changed: BTreeSet<u32>,
    namespace_notice_masked: bool,
    /// A Discovery Log Page Change notice went and the host has not read the log since.
    discovery_notice_masked: bool,
    /// The address the host reached this controller at (its admin queue's connection): what
    /// the discovery log says for a port listening on every address.
    reached: Option<IpAddr>,
    /// Keep alive expired: it takes no more commands.
    failed: bool,
    /// Its host, as reservations name it (by Host Identifier).
    host: ItNexus,
    /// Reservation notifications not yet read: count, type, NSID.
    reservation_log: VecDeque<(u64, u8, u32)>,
    /// The count of the last reservation notification (lost ones count too).
    reservation_count: u64,
    /// A Reservation Log Page Available notice went and the host has not read the log since.
    reservation_notice_masked: bool,
    /// An ANA Change notice went and the host has not read the ANA log since.
    ana_notice_masked: bool,
    /// Reservation Notification Mask, by NSID (bits 1 to 3: types not to report).
    reservation_masks: BTreeMap<u32, u32>,
    /// Completions of held I/O commands ready to go: queue ID and completion.
    completions: Vec<(u16, Cqe)>,
}

/// Reservation notifications a controller keeps unread at most (its log's Number of Available
/// Log Pages is a byte); older ones are lost, and the count says so.
pub const MAX_RESERVATION_NOTICES: usize = 255;
/// Reservation Notification Mask bits a host may set: registration preempted, reservation
/// released, reservation preempted.
const RESERVATION_MASK_BITS: u32 = 0b1110;

/// A namespace attached, with its reservations.
#[derive(Debug)]
struct Attached {
    ns: Namespace,
    reservations: PrState,
    /// The version of the shared reservations applied last (0: none yet).
    shared_version: u64,
}

/// A Preempt and Abort waiting for the preempted hosts' commands on its namespace to end.
#[derive(Debug)]
struct Drain {
    id: u64,
    nsid: u32,
    /// The preempting commands it answers once it ends: controller, queue and CID each
    /// (none for a change another gateway made, until its command's decision comes here).
    answers: Vec<(u16, u16, u16)>,
    /// Queues (CNTLID, QID) not yet told to abort.
    waiting: BTreeSet<(u16, u16)>,
    /// Queues told, whose commands have not all ended.
    told: BTreeSet<(u16, u16)>,
}

/// Where reservations that persist through power loss are kept.
struct Store(Box<dyn PrStore>);

impl std::fmt::Debug for Store {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Store")
    }
}

/// The key a namespace's reservations are kept under: its NGUID, which follows its storage.
fn store_key(ns: &Namespace) -> String {
    let hex: String = ns.nguid.iter().map(|b| format!("{b:02x}")).collect();
    format!("nvme-{hex}")
}

/// Asynchronous Event Requests a controller holds at most (AERL + 1).
pub const MAX_AERS: usize = 4;
/// Asynchronous Event Configuration bit 8: Namespace Attribute Notices.
pub const AEC_NAMESPACE_ATTRIBUTE: u32 = 1 << 8;
/// Asynchronous Event Configuration bit 11: Asymmetric Namespace Access Change Notices.
pub const AEC_ANA_CHANGE: u32 = 1 << 11;
/// Keep alive granularity: 100 ms (KAS 1).
pub const KEEP_ALIVE_GRANULARITY: Duration = Duration::from_millis(100);

/// An NVM subsystem and its controllers.
#[derive(Debug)]
pub struct Subsystem {
    config: SubsystemConfig,
    namespaces: BTreeMap<u32, Attached>,
    controllers: BTreeMap<u16, Controller>,
    next_cntlid: u16,
    store: Option<Store>,
    drains: Vec<Drain>,
    next_drain: u64,
    /// Something happened that other connections must see (notices, aborts, completions).
    wake: bool,
    /// A discovery subsystem's log: what it tells hosts (`None`: an NVM subsystem).
    discovery: Option<Discovery>,
    /// The ANA groups' states as these controllers report them.
    ana: AnaGroups,
    /// Shared reservation changes for the shell to have decided.
    asks: VecDeque<SharedReservation>,
    /// Those under way, with the commands that wait.
    asked: Vec<Asked>,
    next_ask: u64,
    /// What shared reservations went through between the process before and this one's
    /// reading of them, by NSID ([`Subsystem::adopt_namespace_state`]): told to each
    /// controller of a host it names as the controller is adopted.
    handed_notices: Vec<(u32, ReservationEffects)>,
}

/// An entry of a discovery subsystem's log and the hosts that see it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DiscoveryRecord {
    /// Where the subsystem is.
    pub entry: log_page::DiscoveryEntry,
    /// Host NQNs it admits; empty: every host.
    pub hosts: Vec<String>,
}

/// A discovery subsystem's log.
#[derive(Debug, Clone, Default)]
struct Discovery {
    /// GENCTR: moves on with every change.
    genctr: u64,
    records: Vec<DiscoveryRecord>,
}

/// Asynchronous Event Configuration bit 31: Discovery Log Page Change Notices.
pub const AEC_DISCOVERY_LOG: u32 = 1 << 31;

impl Subsystem {
    /// A subsystem with no namespace and no controller.
    pub fn new(config: SubsystemConfig) -> Subsystem {
        Subsystem {
            next_cntlid: config.cntlids.0.clamp(ALL_CNTLIDS.0, ALL_CNTLIDS.1),
            config,
            namespaces: BTreeMap::new(),
            controllers: BTreeMap::new(),
            store: None,
            drains: Vec::new(),
            next_drain: 0,
            wake: false,
            discovery: None,
            ana: AnaGroups::default(),
            asks: VecDeque::new(),
            asked: Vec::new(),
            next_ask: 0,
            handed_notices: Vec::new(),
        }
    }

    /// Sets ANA group `group`'s state as these controllers report it (the shell derives it
    /// from which gateways are alive and the namespaces' path policy). A change moves the
    /// ANA log page's change count on and queues an ANA Change notice for each controller
    /// whose host asked for them (Asynchronous Event Configuration bit 11) and has read the
    /// log since the last one; I/O commands to the group's namespaces end with the status
    /// the state names while it makes them unreachable.
    pub fn set_ana_state(&mut self, group: u32, state: AnaState) {
        if !self.ana.set(group, state) {
            return;
        }
        self.wake = true;
        for c in self.controllers.values_mut().filter(|c| !c.failed) {
            if c.features.aec & AEC_ANA_CHANGE != 0 && !c.ana_notice_masked {
                c.ana_notice_masked = true;
                // Notice (type 2), Asymmetric Namespace Access Change (info 03h), log 0Ch.
                c.notices
                    .push(0x2 | 0x03 << 8 | u32::from(crate::log_page::lid::ANA) << 16);
            }
        }
    }

    /// ANA group `group`'s state as these controllers report it.
    pub fn ana_state(&self, group: u32) -> AnaState {
        self.ana.state(group)
    }

    /// Keeps reservations that persist through power loss (PTPL) in `store`, and loads what
    /// it holds for the namespaces attached from now on. Without a store, PTPL is refused.
    pub fn set_reservation_store(&mut self, store: Box<dyn PrStore>) {
        self.store = Some(Store(store));
    }

    /// Whether something happened since the last call that other connections of the
    /// subsystem must see: asynchronous events, aborts to carry out, held completions ready.
    /// The shell wakes them.
    pub fn take_wakeup(&mut self) -> bool {
        std::mem::take(&mut self.wake)
    }

    /// Namespace `nsid`'s reservations.
    pub fn reservations(&self, nsid: u32) -> Option<&PrState> {
        self.namespaces.get(&nsid).map(|a| &a.reservations)
    }

    /// A discovery subsystem (its NQN the well-known discovery NQN, any host admitted): its
    /// controllers answer Identify and the discovery log page (LID 70h), which lists for
    /// each host the subsystems it may reach ([`Subsystem::set_discovery_log`]).
    pub fn discovery(config: SubsystemConfig) -> Subsystem {
        Subsystem {
            discovery: Some(Discovery::default()),
            ..Subsystem::new(SubsystemConfig {
                nqn: crate::fabrics::DISCOVERY_NQN.into(),
                hosts: Vec::new(),
                ..config
            })
        }
    }

    /// Whether this is a discovery subsystem.
    pub fn is_discovery(&self) -> bool {
        self.discovery.is_some()
    }

    /// What a discovery subsystem's log lists from now on. When it changed, GENCTR moves on
    /// and every controller whose host asked for Discovery Log Page Change notices gets one
    /// (until it reads the log again).
    pub fn set_discovery_log(&mut self, records: Vec<DiscoveryRecord>) {
        let Some(d) = &mut self.discovery else {
            return;
        };
        if d.records == records {
            return;
        }
        d.records = records;
        d.genctr = d.genctr.wrapping_add(1);
        for c in self.controllers.values_mut().filter(|c| !c.failed) {
            if c.features.aec & AEC_DISCOVERY_LOG != 0 && !c.discovery_notice_masked {
                c.discovery_notice_masked = true;
                // Notice (type 2), Discovery Log Page Change (info F0h), log page 70h.
                c.notices
                    .push(0x2 | 0xf0 << 8 | u32::from(lid::DISCOVERY) << 16);
            }
        }
    }

    /// Its configuration.
    pub fn config(&self) -> &SubsystemConfig {
        &self.config
    }

    /// Adds (or replaces: a resize) a namespace. Every controller hears of it: a Namespace
    /// Attribute Changed notice (when its host enabled them) and the Changed Namespace List.
    ///
    /// A namespace replaced keeps its reservations; one new takes those its store kept.
    pub fn add_namespace(&mut self, ns: Namespace) {
        let nsid = ns.nsid;
        match self.namespaces.get_mut(&nsid) {
            Some(a) => a.ns = ns,
            None => {
                let reservations = self
                    .store
                    .as_ref()
                    .and_then(|s| s.0.load(&store_key(&ns)))
                    .and_then(|b| PrState::decode(&b))
                    .unwrap_or_default();
                let reservations = if ns.shared_reservations {
                    // The cluster's, applied once the shell has read them.
                    PrState::default()
                } else {
                    reservations
                };
                self.namespaces.insert(
                    nsid,
                    Attached {
                        ns,
                        reservations,
                        shared_version: 0,
                    },
                );
            }
        }
        self.namespace_changed(nsid);
    }

    /// Removes a namespace; every controller hears of it as of an addition.
    pub fn remove_namespace(&mut self, nsid: u32) -> Option<Namespace> {
        let a = self.namespaces.remove(&nsid)?;
        self.namespace_changed(nsid);
        Some(a.ns)
    }

    /// Records that namespace `nsid` changed for every controller, and queues the notice for
    /// those whose host asked for them (Asynchronous Event Configuration bit 8) and have not
    /// been told since they last read the list.
    fn namespace_changed(&mut self, nsid: u32) {
        self.wake = true;
        for c in self.controllers.values_mut().filter(|c| !c.failed) {
            c.changed.insert(nsid);
            if c.features.aec & AEC_NAMESPACE_ATTRIBUTE != 0 && !c.namespace_notice_masked {
                c.namespace_notice_masked = true;
                // Notice (type 2), Namespace Attribute Changed (info 0), log page 04h.
                c.notices
                    .push(0x2 | u32::from(crate::log_page::lid::CHANGED_NAMESPACES) << 16);
            }
        }
    }

    /// The asynchronous events ready to go: each an Asynchronous Event Request of controller
    /// CNTLID answered with a notice, for the shell to send on that controller's admin queue.
    pub fn poll_async_events(&mut self) -> Vec<(u16, Cqe)> {
        let mut out = Vec::new();
        for (id, c) in self.controllers.iter_mut() {
            while !c.notices.is_empty() && !c.aers.is_empty() {
                let dw0 = c.notices.remove(0);
                let cid = c.aers.remove(0);
                out.push((
                    *id,
                    Cqe {
                        dw0,
                        ..Cqe::new(cid, Status::SUCCESS)
                    },
                ));
            }
        }
        out
    }

    /// The next asynchronous event of controller `cntlid` ready to go: one of its held
    /// Asynchronous Event Requests answered with a notice, for its admin queue.
    pub fn poll_async_event(&mut self, cntlid: u16) -> Option<Cqe> {
        let c = self.controllers.get_mut(&cntlid)?;
        if c.notices.is_empty() || c.aers.is_empty() {
            return None;
        }
        let dw0 = c.notices.remove(0);
        let cid = c.aers.remove(0);
        Some(Cqe {
            dw0,
            ..Cqe::new(cid, Status::SUCCESS)
        })
    }

    /// Tells controller `cntlid` the address its host reached it at (the local address of
    /// its admin queue's connection): a discovery log entry for a port listening on every
    /// address (0.0.0.0, ::) names this one instead, which the host can connect to.
    pub fn set_reached_address(&mut self, cntlid: u16, address: IpAddr) {
        if let Some(c) = self.controllers.get_mut(&cntlid) {
            c.reached = Some(address);
        }
    }

    /// Whether controller `cntlid` is there and its keep alive has not expired.
    pub fn is_live(&self, cntlid: u16) -> bool {
        self.controllers.get(&cntlid).is_some_and(|c| !c.failed)
    }

    /// Namespace `nsid`.
    pub fn namespace(&self, nsid: u32) -> Option<&Namespace> {
        self.namespaces.get(&nsid).map(|a| &a.ns)
    }

    /// The controllers, by CNTLID: the host NQN of each.
    pub fn controllers(&self) -> impl Iterator<Item = (u16, &str)> {
        self.controllers
            .iter()
            .map(|(id, c)| (*id, c.hostnqn.as_str()))
    }

    /// The I/O queues controller `cntlid` has connected (its admin queue, 0, always is),
    /// in order; empty when there is no such controller.
    pub fn io_queues(&self, cntlid: u16) -> Vec<u16> {
        self.controllers
            .get(&cntlid)
            .map(|c| c.io_queues.iter().copied().collect())
            .unwrap_or_default()
    }

    /// The most data one transfer may have (MDTS).
    pub fn max_transfer(&self) -> u32 {
        4096u32.saturating_mul(1 << self.config.mdts.min(20))
    }

    /// Connect on a connection that has no queue yet, with Connect's `data`: the queue, and
    /// the completion to send (DW0 the CNTLID); or the completion that refuses it.
    pub fn connect(&mut self, now: Instant, sqe: &Sqe, data: &[u8]) -> Result<(Queue, Cqe), Cqe> {
        let cid = sqe.cid();
        let refuse = |status: Status, dw0: u32| Cqe {
            dw0,
            ..Cqe::new(cid, status)
        };
        let invalid = |p: InvalidParameter| {
            let (s, dw0) = p.completion();
            refuse(s, dw0)
        };
        if sqe.opcode() != AdminOpcode::Fabrics.code()
            || sqe.fctype() != FabricsType::Connect.code()
        {
            return Err(refuse(Status::COMMAND_SEQUENCE_ERROR, 0));
        }
        let c = Connect::from_sqe(sqe);
        if c.recfmt != 0 {
            return Err(refuse(Status::CONNECT_INCOMPATIBLE_FORMAT, 0));
        }
        let d = ConnectData::parse(data).map_err(invalid)?;
        let in_command = |offset| InvalidParameter {
            in_data: false,
            offset,
        };
        let in_data = |offset| InvalidParameter {
            in_data: true,
            offset,
        };
        if d.subnqn != self.config.nqn {
            return Err(invalid(in_data(256)));
        }
        if !self.config.hosts.is_empty() && !self.config.hosts.contains(&d.hostnqn) {
            return Err(refuse(Status::CONNECT_INVALID_HOST, 0));
        }
        let size = u32::from(c.sqsize) + 1;
        let max = u32::from(self.config.max_queue_entries.max(32));
        let min = if c.qid == 0 { 32 } else { 2 };
        if size < min || size > max {
            return Err(invalid(in_command(44)));
        }
        let queue = |cntlid| Queue {
            cntlid,
            qid: c.qid,
            size,
            sq_flow_control_disabled: c.cattr & CATTR_SQ_FLOW_CONTROL_DISABLE != 0,
        };
        if c.qid == 0 {
            if d.cntlid != CNTLID_DYNAMIC {
                return Err(invalid(in_data(16)));
            }
            let Some(cntlid) = self.free_cntlid() else {
                return Err(refuse(Status::CONNECT_CONTROLLER_BUSY, 0));
            };
            self.controllers.insert(
                cntlid,
                Controller {
                    hostnqn: d.hostnqn,
                    hostid: d.hostid,
                    properties: Properties::new(self.config.max_queue_entries, VERSION, 30),
                    features: Features {
                        aec: 0,
                        vwc: true,
                        io_queues: None,
                    },
                    kato: (c.kato > 0).then(|| Duration::from_millis(u64::from(c.kato))),
                    alive_at: now,
                    io_queues: BTreeSet::new(),
                    aers: Vec::new(),
                    notices: Vec::new(),
                    changed: BTreeSet::new(),
                    namespace_notice_masked: false,
                    discovery_notice_masked: false,
                    reached: None,
                    failed: false,
                    host: reservation::host(d.hostid),
                    reservation_log: VecDeque::new(),
                    reservation_count: 0,
                    reservation_notice_masked: false,
                    ana_notice_masked: false,
                    reservation_masks: BTreeMap::new(),
                    completions: Vec::new(),
                },
            );
            let q = queue(cntlid);
            return Ok((
                q,
                Cqe {
                    dw0: u32::from(cntlid),
                    ..Cqe::new(cid, Status::SUCCESS)
                },
            ));
        }
        if self.discovery.is_some() {
            // A discovery controller has its admin queue only.
            return Err(invalid(in_command(42)));
        }
        let max_io = self.config.max_io_queues;
        let Some(ctrl) = self.controllers.get_mut(&d.cntlid) else {
            return Err(invalid(in_data(16)));
        };
        if ctrl.hostnqn != d.hostnqn || ctrl.failed {
            return Err(invalid(in_data(16)));
        }
        if !ctrl.properties.is_ready() {
            return Err(refuse(Status::COMMAND_SEQUENCE_ERROR, 0));
        }
        let granted = ctrl.features.io_queues.unwrap_or(max_io);
        if c.qid > granted || !ctrl.io_queues.insert(c.qid) {
            return Err(invalid(in_command(42)));
        }
        Ok((
            queue(d.cntlid),
            Cqe {
                dw0: u32::from(d.cntlid),
                ..Cqe::new(cid, Status::SUCCESS)
            },
        ))
    }

    fn free_cntlid(&mut self) -> Option<u16> {
        let first = self.config.cntlids.0.max(ALL_CNTLIDS.0);
        let last = self.config.cntlids.1.min(ALL_CNTLIDS.1);
        for _ in first..=last {
            let id = self.next_cntlid.clamp(first, last);
            self.next_cntlid = if id >= last { first } else { id + 1 };
            if !self.controllers.contains_key(&id) {
                return Some(id);
            }
        }
        None
    }

    /// The connection of `queue` ended: an I/O queue leaves its controller; the admin queue
    /// takes the controller with it.
    ///
    /// A Preempt and Abort waiting for the queue's commands waits no more (what its
    /// connection still runs is the shell's to wait for before it lets the connection go);
    /// one the queue itself sent is forgotten, there being no one to answer.
    pub fn disconnect(&mut self, queue: &Queue) {
        let gone =
            |cntlid: u16, qid: u16| cntlid == queue.cntlid && (queue.qid == 0 || qid == queue.qid);
        for d in &mut self.drains {
            d.answers.retain(|&(c, q, _)| !gone(c, q));
            d.waiting.retain(|&(c, q)| !gone(c, q));
            d.told.retain(|&(c, q)| !gone(c, q));
        }
        self.finish_drains();
        if queue.qid == 0 {
            self.controllers.remove(&queue.cntlid);
        } else if let Some(c) = self.controllers.get_mut(&queue.cntlid) {
            c.io_queues.remove(&queue.qid);
            // Not for a queue of that ID connected later.
            c.completions.retain(|(q, _)| *q != queue.qid);
        }
    }

    /// The next namespace whose commands connection `queue` must abort, as a Preempt and
    /// Abort of its host's registration asks: the Preempt and Abort's ID and the NSID. The
    /// connection ends its commands on the namespace that have not started (Command Aborted
    /// due to Preempt and Abort), and calls [`Subsystem::aborted`] once those that have
    /// started have ended.
    pub fn poll_abort(&mut self, queue: &Queue) -> Option<(u64, u32)> {
        let key = (queue.cntlid, queue.qid);
        let d = self.drains.iter_mut().find(|d| d.waiting.contains(&key))?;
        d.waiting.remove(&key);
        d.told.insert(key);
        Some((d.id, d.nsid))
    }

    /// Connection `queue`'s commands that Preempt and Abort `id` aborted have all ended.
    pub fn aborted(&mut self, queue: &Queue, id: u64) {
        let key = (queue.cntlid, queue.qid);
        if let Some(d) = self.drains.iter_mut().find(|d| d.id == id) {
            d.told.remove(&key);
        }
        self.finish_drains();
    }

    /// Completes the Preempt and Abort commands nothing holds any more.
    fn finish_drains(&mut self) {
        while let Some(i) = self
            .drains
            .iter()
            .position(|d| d.waiting.is_empty() && d.told.is_empty())
        {
            let d = self.drains.swap_remove(i);
            for (cntlid, qid, cid) in d.answers {
                self.answer(cntlid, qid, Cqe::new(cid, Status::SUCCESS));
            }
        }
    }

    /// Queues completion `cqe` of a held command of controller `cntlid`'s queue `qid`
    /// ([`Subsystem::poll_completion`]).
    fn answer(&mut self, cntlid: u16, qid: u16, cqe: Cqe) {
        if let Some(c) = self.controllers.get_mut(&cntlid) {
            if qid == 0 || c.io_queues.contains(&qid) {
                c.completions.push((qid, cqe));
                self.wake = true;
            }
        }
    }

    /// The next reservation change on a shared namespace for the shell to have the cluster
    /// decide; its command is held until [`Subsystem::shared_reservation_done`].
    pub fn poll_shared_reservation(&mut self) -> Option<SharedReservation> {
        self.asks.pop_front()
    }

    /// The cluster decided shared reservation change `id`: its command ends with `result`
    /// (the new state has been applied here already, [`Subsystem::apply_shared_reservations`]).
    /// A Preempt and Abort that succeeded ends once the commands it aborted here have.
    pub fn shared_reservation_done(&mut self, id: u64, result: Result<(), Status>) {
        let Some(i) = self.asked.iter().position(|a| a.id == id) else {
            return;
        };
        let a = self.asked.swap_remove(i);
        if a.preempt_and_abort && result.is_ok() {
            let draining = self
                .drains
                .iter_mut()
                .rev()
                .find(|d| d.nsid == a.nsid && !(d.waiting.is_empty() && d.told.is_empty()));
            if let Some(d) = draining {
                d.answers.push((a.cntlid, a.qid, a.cid));
                return;
            }
        }
        let status = result.err().unwrap_or(Status::SUCCESS);
        self.answer(a.cntlid, a.qid, Cqe::new(a.cid, status));
    }

    /// Namespace `nsid`'s shared reservations are `state` at `version` (a change decided
    /// through this gateway or another, or the state read when it was attached), with
    /// `effects` to carry out here: notices to this gateway's controllers of the hosts they
    /// name, and the commands of preempted hosts aborted. An older or equal version changes
    /// nothing: `false`.
    pub fn apply_shared_reservations(
        &mut self,
        nsid: u32,
        version: u64,
        state: PrState,
        effects: &ReservationEffects,
    ) -> bool {
        let Some(a) = self.namespaces.get_mut(&nsid) else {
            return false;
        };
        if !a.ns.shared_reservations || a.shared_version >= version {
            return false;
        }
        a.shared_version = version;
        a.reservations = state;
        self.tell(nsid, effects);
        self.abort_preempted(nsid, effects, None);
        true
    }

    /// Namespace `nsid`'s shared reservations are `state` at `version`, read from the cluster
    /// after changes this gateway may have missed (it was cut off, or attaches the namespace
    /// anew): applied as [`Subsystem::apply_shared_reservations`] applies a change, with the
    /// notices of the net outcome against the state its hosts last heard
    /// ([`ReservationEffects::missed`]).
    pub fn catch_up_shared_reservations(
        &mut self,
        nsid: u32,
        version: u64,
        state: PrState,
    ) -> bool {
        let Some(a) = self.namespaces.get(&nsid) else {
            return false;
        };
        let missed = ReservationEffects::missed(&a.reservations, &state);
        self.apply_shared_reservations(nsid, version, state, &missed)
    }

    /// How many queues still run commands on namespace `nsid` that a Preempt and Abort
    /// aborted: a cluster acknowledges another gateway's Preempt and Abort once none do.
    pub fn aborted_in_flight(&self, nsid: u32) -> usize {
        self.drains
            .iter()
            .filter(|d| d.nsid == nsid)
            .map(|d| d.waiting.len() + d.told.len())
            .sum()
    }

    /// The next completion of a held I/O command of connection `queue` (a Preempt and Abort
    /// whose aborted commands have ended).
    pub fn poll_completion(&mut self, queue: &Queue) -> Option<Cqe> {
        let c = self.controllers.get_mut(&queue.cntlid)?;
        let i = c.completions.iter().position(|(q, _)| *q == queue.qid)?;
        Some(c.completions.remove(i).1)
    }

    /// When [`Subsystem::handle_timeout`] is due: the earliest keep alive deadline.
    pub fn poll_timeout(&self) -> Option<Instant> {
        self.controllers
            .values()
            .filter(|c| !c.failed)
            .filter_map(|c| c.kato.map(|k| c.alive_at + k + KEEP_ALIVE_GRANULARITY))
            .min()
    }

    /// Time passed: the controllers whose keep alive timer expired fail (CSTS.CFS); their
    /// CNTLIDs, whose connections the shell closes.
    pub fn handle_timeout(&mut self, now: Instant) -> Vec<u16> {
        let mut expired = Vec::new();
        for (id, c) in self.controllers.iter_mut() {
            let late = c
                .kato
                .is_some_and(|k| now >= c.alive_at + k + KEEP_ALIVE_GRANULARITY);
            if late && !c.failed {
                c.failed = true;
                c.properties.csts |= crate::fabrics::CSTS_CFS;
                expired.push(*id);
            }
        }
        expired
    }

    /// A command (not Connect) on `queue`, with its in-capsule `data`.
    pub fn command(&mut self, now: Instant, queue: &Queue, sqe: &Sqe, data: &[u8]) -> Answer {
        let cid = sqe.cid();
        let done = |status| Answer::Complete(Cqe::new(cid, status));
        let Some(ctrl) = self.controllers.get(&queue.cntlid) else {
            return done(Status::COMMAND_SEQUENCE_ERROR);
        };
        if ctrl.failed {
            return done(Status::KEEP_ALIVE_EXPIRED);
        }
        if sqe.opcode() == AdminOpcode::Fabrics.code() {
            return self.fabrics(queue, sqe);
        }
        if !ctrl.properties.is_ready() {
            return done(Status::COMMAND_SEQUENCE_ERROR);
        }
        if queue.qid != 0 {
            // A namespace its ANA group makes unreachable through this controller: the
            // host retries on another path.
            if let Some(refusal) = self
                .namespaces
                .get(&sqe.nsid())
                .and_then(|a| self.ana.state(a.ns.ana_group).refusal())
            {
                return done(refusal);
            }
            if reservation::is_reservation(sqe.opcode()) {
                return self.reservation_command(queue, sqe, data);
            }
            return self.io(queue, sqe);
        }
        match AdminOpcode::from_code(sqe.opcode()) {
            Some(AdminOpcode::Identify) => self.identify(queue, sqe),
            Some(AdminOpcode::GetLogPage) => self.get_log_page(queue, sqe),
            Some(AdminOpcode::SetFeatures) => self.set_features(now, queue, sqe),
            Some(AdminOpcode::GetFeatures) => self.get_features(queue, sqe),
            Some(AdminOpcode::KeepAlive) => {
                if let Some(c) = self.controllers.get_mut(&queue.cntlid) {
                    c.alive_at = now;
                }
                done(Status::SUCCESS)
            }
            Some(AdminOpcode::AsyncEventRequest) => {
                let Some(c) = self.controllers.get_mut(&queue.cntlid) else {
                    return done(Status::COMMAND_SEQUENCE_ERROR);
                };
                if c.aers.len() >= MAX_AERS {
                    return done(Status::AER_LIMIT_EXCEEDED);
                }
                c.aers.push(cid);
                Answer::Held
            }
            // Abort: DW0 bit 0 set says the command was not aborted, which the specification
            // allows; the host waits for it or resets.
            Some(AdminOpcode::Abort) => Answer::Complete(Cqe {
                dw0: 1,
                ..Cqe::new(cid, Status::SUCCESS)
            }),
            _ => {
                let _ = data;
                done(Status::INVALID_OPCODE)
            }
        }
    }

    /// Asynchronous Event Requests held by controller `cntlid`, taken out: the shell answers
    /// them when an event happens, or ends them when the controller goes.
    pub fn take_async_event_requests(&mut self, cntlid: u16) -> Vec<u16> {
        self.controllers
            .get_mut(&cntlid)
            .map(|c| std::mem::take(&mut c.aers))
            .unwrap_or_default()
    }

    fn fabrics(&mut self, queue: &Queue, sqe: &Sqe) -> Answer {
        let cid = sqe.cid();
        let done = |status| Answer::Complete(Cqe::new(cid, status));
        match FabricsType::from_code(sqe.fctype()) {
            Some(FabricsType::PropertyGet) if queue.qid == 0 => {
                let Some(c) = self.controllers.get(&queue.cntlid) else {
                    return done(Status::COMMAND_SEQUENCE_ERROR);
                };
                match c.properties.get(&PropertyAccess::from_sqe(sqe)) {
                    Ok(v) => Answer::Complete(Cqe {
                        dw0: v as u32,
                        dw1: (v >> 32) as u32,
                        ..Cqe::new(cid, Status::SUCCESS)
                    }),
                    Err(s) => done(s),
                }
            }
            Some(FabricsType::PropertySet) if queue.qid == 0 => {
                let Some(c) = self.controllers.get_mut(&queue.cntlid) else {
                    return done(Status::COMMAND_SEQUENCE_ERROR);
                };
                match c.properties.set(&PropertyAccess::from_sqe(sqe)) {
                    Ok(CcChange::Reset) => {
                        // A controller reset: its I/O queues are gone (their connections are
                        // the shell's to close), its held requests with them.
                        c.io_queues.clear();
                        c.aers.clear();
                        c.features.io_queues = None;
                        done(Status::SUCCESS)
                    }
                    Ok(_) => done(Status::SUCCESS),
                    Err(s) => done(s),
                }
            }
            // Disconnect on an I/O queue: the shell closes it after the completion.
            Some(FabricsType::Disconnect) if queue.qid != 0 => done(Status::SUCCESS),
            Some(FabricsType::Connect) => done(Status::COMMAND_SEQUENCE_ERROR),
            _ => done(Status::INVALID_OPCODE),
        }
    }

    /// A reservation command's data, fetched by the connection after [`Answer::Fetch`]: the
    /// command is carried out with it.
    pub fn fetched(&mut self, queue: &Queue, sqe: &Sqe, data: &[u8]) -> Answer {
        let cid = sqe.cid();
        if !self.is_live(queue.cntlid) {
            return Answer::Complete(Cqe::new(cid, Status::COMMAND_SEQUENCE_ERROR));
        }
        match reservation::decode(sqe) {
            Ok(cmd) => self.reserve(queue, sqe, &cmd, data),
            Err(s) => Answer::Complete(Cqe::new(cid, s)),
        }
    }

    /// Reservation Register, Acquire, Release or Report with its in-capsule `data`.
    fn reservation_command(&mut self, queue: &Queue, sqe: &Sqe, data: &[u8]) -> Answer {
        let cid = sqe.cid();
        let done = |status| Answer::Complete(Cqe::new(cid, status));
        let cmd = match reservation::decode(sqe) {
            Ok(c) => c,
            Err(s) => return done(s),
        };
        let Some(a) = self.namespaces.get(&sqe.nsid()) else {
            return done(Status::INVALID_NAMESPACE);
        };
        if !a.ns.reservations {
            // As Linux's nvmet answers for a namespace without reservations.
            return done(Status::INVALID_OPCODE);
        }
        if let ReservationCommand::Report { len, extended } = cmd {
            if !extended {
                // Hosts on a fabric have 128-bit Host Identifiers only.
                return done(Status::HOST_ID_INCONSISTENT);
            }
            if len > self.max_transfer() {
                return done(Status::INVALID_FIELD);
            }
            let controllers = &self.controllers;
            let page = reservation::report(&a.reservations, true, a.reservations.aptpl, |n| {
                controllers
                    .iter()
                    .find(|(_, c)| c.host == *n && !c.failed)
                    .map(|(id, _)| *id)
            });
            return self.reply(sqe, &page);
        }
        let want = cmd.data_len() as u32;
        match sqe.sgl().kind() {
            SglKind::InCapsule { offset: 0, length } if length >= want => {
                if data.len() < want as usize {
                    return done(Status::DATA_SGL_LENGTH_INVALID);
                }
                self.reserve(queue, sqe, &cmd, data)
            }
            SglKind::InCapsule { offset: 0, .. } | SglKind::Transport { .. }
                if sqe.sgl().length() < want =>
            {
                done(Status::DATA_SGL_LENGTH_INVALID)
            }
            SglKind::Transport { length } if length <= 4096 => Answer::Fetch { len: length },
            SglKind::Transport { .. } => done(Status::DATA_SGL_LENGTH_INVALID),
            SglKind::InCapsule { .. } => done(Status::SGL_OFFSET_INVALID),
            _ => done(Status::SGL_DESCRIPTOR_TYPE_INVALID),
        }
    }

    /// Carries out reservation command `cmd` with its data: the new state saved first when
    /// it persists through power loss (a save that fails changes nothing), then the notices,
    /// then, for a Preempt and Abort that preempted hosts with queues, the wait for their
    /// commands.
    fn reserve(
        &mut self,
        queue: &Queue,
        sqe: &Sqe,
        cmd: &ReservationCommand,
        data: &[u8],
    ) -> Answer {
        let cid = sqe.cid();
        let nsid = sqe.nsid();
        let done = |status| Answer::Complete(Cqe::new(cid, status));
        let Some(me) = self.controllers.get(&queue.cntlid).map(|c| c.host.clone()) else {
            return done(Status::COMMAND_SEQUENCE_ERROR);
        };
        let capable = self.store.is_some();
        let Some(a) = self.namespaces.get_mut(&nsid) else {
            return done(Status::INVALID_NAMESPACE);
        };
        if a.ns.shared_reservations {
            if data.len() < cmd.data_len() {
                return done(Status::DATA_SGL_LENGTH_INVALID);
            }
            let mut copied = [0u8; 16];
            let n = cmd.data_len().min(16);
            copied[..n].copy_from_slice(&data[..n]);
            self.next_ask += 1;
            let id = self.next_ask;
            self.asks.push_back(SharedReservation {
                id,
                nsid,
                host: me,
                command: *cmd,
                data: copied,
            });
            self.asked.push(Asked {
                id,
                nsid,
                cntlid: queue.cntlid,
                qid: queue.qid,
                cid,
                preempt_and_abort: matches!(
                    cmd,
                    ReservationCommand::Acquire {
                        action: reservation::AcquireAction::PreemptAndAbort,
                        ..
                    }
                ),
            });
            self.wake = true;
            return Answer::Held;
        }
        let mut next = a.reservations.clone();
        let fx = match reservation::apply(&mut next, &me, cmd, data, capable) {
            Ok(fx) => fx,
            Err(s) => return done(s),
        };
        if fx.save && (a.reservations.aptpl || next.aptpl) {
            if let Some(store) = self.store.as_mut() {
                let state = next.aptpl.then(|| next.encode());
                if store.0.save(&store_key(&a.ns), state.as_deref()).is_err() {
                    return done(Status::INTERNAL_ERROR);
                }
            }
        }
        a.reservations = next;
        self.tell(nsid, &fx);
        if self.abort_preempted(nsid, &fx, Some((queue.cntlid, queue.qid, cid))) {
            return Answer::Held;
        }
        done(Status::SUCCESS)
    }

    /// Queues the Reservation Notifications `fx` names for the controllers of their hosts
    /// (those whose Reservation Notification Mask lets them through).
    fn tell(&mut self, nsid: u32, fx: &ReservationEffects) {
        for (host, kind) in reservation::notices(fx) {
            for c in self
                .controllers
                .values_mut()
                .filter(|c| c.host == *host && !c.failed)
            {
                self.wake |= notify(c, nsid, kind);
            }
        }
    }

    /// Aborts the commands on namespace `nsid` of the hosts `fx` preempted with abort, on
    /// every queue of theirs here, and answers `answer` (the preempting command, when it came
    /// here) once they have ended: whether any queue has to end commands first.
    fn abort_preempted(
        &mut self,
        nsid: u32,
        fx: &ReservationEffects,
        answer: Option<(u16, u16, u16)>,
    ) -> bool {
        if fx.abort.is_empty() {
            return false;
        }
        let mut waiting = BTreeSet::new();
        for (id, c) in &self.controllers {
            if fx.abort.contains(&c.host) {
                waiting.extend(c.io_queues.iter().map(|q| (*id, *q)));
            }
        }
        if waiting.is_empty() {
            return false;
        }
        self.next_drain += 1;
        self.drains.push(Drain {
            id: self.next_drain,
            nsid,
            answers: answer.into_iter().collect(),
            waiting,
            told: BTreeSet::new(),
        });
        self.wake = true;
        true
    }

    fn io(&self, queue: &Queue, sqe: &Sqe) -> Answer {
        let nsid = sqe.nsid();
        // Flush to every namespace (NSID FFFFFFFFh), as VWC says it may.
        if sqe.opcode() == NvmOpcode::Flush.code() && nsid == u32::MAX {
            let first = self.namespaces.keys().next().copied();
            let host = self.controllers.get(&queue.cntlid).map(|c| &c.host);
            let conflict = self.namespaces.values().any(|a| {
                a.reservations.reservation.is_some()
                    && !host.is_some_and(|h| a.reservations.allows(h, Access::Write))
            });
            if conflict {
                return Answer::Complete(Cqe::new(sqe.cid(), Status::RESERVATION_CONFLICT));
            }
            return match first {
                Some(nsid) => Answer::Io {
                    nsid,
                    command: IoCommand::Op {
                        op: scsi_core::Op::Flush { lba: 0, blocks: 0 },
                        transfer: nvm::Transfer::None,
                    },
                },
                None => Answer::Complete(Cqe::new(sqe.cid(), Status::SUCCESS)),
            };
        }
        let a = self.namespaces.get(&nsid);
        let geometry = a.map(|a| a.ns.geometry);
        match nvm::decode(sqe, geometry.as_ref(), self.max_transfer()) {
            Ok(IoCommand::Nothing) => Answer::Complete(Cqe::new(sqe.cid(), Status::SUCCESS)),
            Ok(command) => {
                if let Some(a) = a.filter(|a| a.reservations.reservation.is_some()) {
                    let host = self.controllers.get(&queue.cntlid).map(|c| &c.host);
                    if !host.is_some_and(|h| a.reservations.allows(h, access(sqe.opcode()))) {
                        return Answer::Complete(Cqe::new(sqe.cid(), Status::RESERVATION_CONFLICT));
                    }
                }
                Answer::Io { nsid, command }
            }
            Err(s) => Answer::Complete(Cqe::new(sqe.cid(), s)),
        }
    }

    /// Sends `data` as the command's answer, when its SGL asks for exactly what the host
    /// reads (the data cut or padded to the SGL's length, as drives do).
    /// Answers `sqe` with `data`, cut or padded with zeros to the length its SGL asks (at
    /// most the largest transfer: nothing is allocated for a larger length).
    fn reply(&self, sqe: &Sqe, data: &[u8]) -> Answer {
        let cid = sqe.cid();
        let len = match sqe.sgl().kind() {
            crate::sqe::SglKind::Transport { length } => length,
            _ => return Answer::Complete(Cqe::new(cid, Status::SGL_DESCRIPTOR_TYPE_INVALID)),
        };
        if len > self.max_transfer() {
            return Answer::Complete(Cqe::new(cid, Status::DATA_SGL_LENGTH_INVALID));
        }
        let mut out = vec![0u8; len as usize];
        let n = data.len().min(out.len());
        out[..n].copy_from_slice(&data[..n]);
        Answer::Data {
            data: Bytes::from(out),
            cqe: Cqe::new(cid, Status::SUCCESS),
        }
    }

    fn identity(&self, cntlid: u16) -> ControllerIdentity {
        let discovery = self.discovery.is_some();
        let id = ControllerIdentity {
            serial: self.config.serial.clone(),
            model: self.config.model.clone(),
            firmware: self.config.firmware.clone(),
            cntlid,
            version: VERSION,
            controller_type: if discovery { 2 } else { 1 },
            mdts: self.config.mdts,
            multipath: true,
            namespaces: self
                .namespaces
                .keys()
                .next_back()
                .copied()
                .unwrap_or(0)
                .max(1024),
            max_commands: self.config.max_queue_entries,
            aerl: (MAX_AERS - 1) as u8,
            elpe: 0,
            kas: 1,
            volatile_write_cache: self.namespaces.values().any(|a| a.ns.write_cache),
            oncs: identify::ONCS_COMPARE
                | identify::ONCS_DATASET_MANAGEMENT
                | identify::ONCS_WRITE_ZEROES
                | identify::ONCS_VERIFY
                | identify::ONCS_RESERVATIONS,
            // FUSES: fused Compare and Write, where a namespace's storage does it atomically
            // (NACWU); ACWU the least of them, 0's based.
            compare_and_write: self.namespaces.values().any(|a| a.ns.compare_and_write > 0),
            acwu: self
                .namespaces
                .values()
                .map(|a| a.ns.compare_and_write)
                .filter(|&n| n > 0)
                .min()
                .map_or(0, |n| n - 1),
            oaes: identify::OAES_NAMESPACE_ATTRIBUTE | identify::OAES_ANA_CHANGE,
            anatt: ana::TRANSITION_TIME,
            // ANACAP: optimized, non-optimized and inaccessible reported; ANAGRPID does not
            // change while a namespace is attached.
            anacap: 0x0b | 1 << 7,
            anagrpmax: ana::MAX_GROUP_ID,
            nanagrpid: ana::MAX_GROUPS,
            subnqn: self.config.nqn.clone(),
            ioccsz: (64 + self.config.max_in_capsule_data) / 16,
            iorcsz: 1,
            msdbd: 1,
        };
        if !discovery {
            return id;
        }
        // A discovery controller: no namespaces, no I/O commands, no ANA; it tells of
        // changes to its log.
        ControllerIdentity {
            multipath: false,
            namespaces: 0,
            volatile_write_cache: false,
            oncs: 0,
            oaes: AEC_DISCOVERY_LOG,
            anatt: 0,
            anacap: 0,
            anagrpmax: 0,
            nanagrpid: 0,
            ..id
        }
    }

    fn identify(&self, queue: &Queue, sqe: &Sqe) -> Answer {
        let cid = sqe.cid();
        let nsid = sqe.nsid();
        let ns = self.namespaces.get(&nsid).map(|a| &a.ns);
        let rescap = if self.store.is_some() {
            identify::RESCAP_ALL
        } else {
            identify::RESCAP_ALL & !identify::RESCAP_PTPL
        };
        let data = match sqe.cdw(10) as u8 {
            cns::CONTROLLER => identify::controller(&self.identity(queue.cntlid)),
            cns::NAMESPACE => match ns {
                Some(n) => identify::namespace(&NamespaceIdentity {
                    blocks: n.geometry.blocks,
                    used: n.geometry.blocks,
                    block_size: n.geometry.block_size,
                    thin: n.thin,
                    shared: true,
                    rescap: if n.reservations { rescap } else { 0 },
                    anagrpid: n.ana_group,
                    write_protected: n.geometry.read_only,
                    nguid: n.nguid,
                    nacwu: n.compare_and_write.saturating_sub(1),
                }),
                // An NSID that is valid but not active: zeros; FFFFFFFFh or 0: invalid.
                None if nsid != 0 && nsid != u32::MAX => Box::new([0; identify::IDENTIFY_LEN]),
                None => return Answer::Complete(Cqe::new(cid, Status::INVALID_NAMESPACE)),
            },
            cns::ACTIVE_NAMESPACES => {
                if nsid >= 0xffff_fffe {
                    return Answer::Complete(Cqe::new(cid, Status::INVALID_NAMESPACE));
                }
                identify::active_namespaces(self.namespaces.keys().copied(), nsid)
            }
            cns::NAMESPACE_DESCRIPTORS => match ns {
                Some(n) => identify::namespace_descriptors(&n.nguid, &n.uuid),
                None => return Answer::Complete(Cqe::new(cid, Status::INVALID_NAMESPACE)),
            },
            _ => return Answer::Complete(Cqe::new(cid, Status::INVALID_FIELD)),
        };
        self.reply(sqe, &data[..])
    }

    fn get_log_page(&mut self, queue: &Queue, sqe: &Sqe) -> Answer {
        let cid = sqe.cid();
        let r = LogRequest::from_sqe(sqe);
        let page: Vec<u8> = match r.lid {
            lid::ERROR => vec![0; 64],
            lid::SMART => log_page::smart(0, 0, 0, 0).to_vec(),
            lid::FIRMWARE_SLOT => log_page::firmware_slot(&self.config.firmware).to_vec(),
            lid::CHANGED_NAMESPACES => {
                let Some(c) = self.controllers.get_mut(&queue.cntlid) else {
                    return Answer::Complete(Cqe::new(cid, Status::COMMAND_SEQUENCE_ERROR));
                };
                let list: Vec<u32> = c.changed.iter().copied().collect();
                if !r.retain {
                    // Read: the list starts again, and the next change is told again.
                    c.changed.clear();
                    c.namespace_notice_masked = false;
                }
                log_page::changed_namespaces(&list).to_vec()
            }
            lid::COMMANDS_EFFECTS => {
                let admin = [
                    AdminOpcode::GetLogPage,
                    AdminOpcode::Identify,
                    AdminOpcode::Abort,
                    AdminOpcode::SetFeatures,
                    AdminOpcode::GetFeatures,
                    AdminOpcode::AsyncEventRequest,
                    AdminOpcode::KeepAlive,
                ]
                .map(AdminOpcode::code);
                let io = [
                    (NvmOpcode::Flush, false),
                    (NvmOpcode::Write, true),
                    (NvmOpcode::Read, false),
                    (NvmOpcode::Compare, false),
                    (NvmOpcode::WriteZeroes, true),
                    (NvmOpcode::DatasetManagement, true),
                    (NvmOpcode::Verify, false),
                    (NvmOpcode::ReservationRegister, false),
                    (NvmOpcode::ReservationReport, false),
                    (NvmOpcode::ReservationAcquire, false),
                    (NvmOpcode::ReservationRelease, false),
                ]
                .map(|(o, c)| (o.code(), c));
                log_page::commands_effects(&admin, &io).to_vec()
            }
            lid::DISCOVERY if self.discovery.is_some() => {
                let Some(c) = self.controllers.get_mut(&queue.cntlid) else {
                    return Answer::Complete(Cqe::new(cid, Status::COMMAND_SEQUENCE_ERROR));
                };
                if !r.retain {
                    c.discovery_notice_masked = false;
                }
                let host = c.hostnqn.as_str();
                let d = self.discovery.as_ref().expect("checked");
                // A wildcard listener is named by the address this host reached (the
                // iSCSI SendTargets answer does the same).
                let reached = |e: &log_page::DiscoveryEntry| {
                    let wildcard = e.traddr.parse::<IpAddr>().is_ok_and(|a| a.is_unspecified());
                    match c.reached.filter(|_| wildcard) {
                        Some(a) => log_page::DiscoveryEntry {
                            traddr: a.to_string(),
                            adrfam: if a.is_ipv4() {
                                log_page::ADRFAM_IPV4
                            } else {
                                log_page::ADRFAM_IPV6
                            },
                            ..e.clone()
                        },
                        None => e.clone(),
                    }
                };
                let seen: Vec<log_page::DiscoveryEntry> = d
                    .records
                    .iter()
                    .filter(|r| r.hosts.is_empty() || r.hosts.iter().any(|h| h == host))
                    .map(|r| reached(&r.entry))
                    .collect();
                let seen: Vec<&log_page::DiscoveryEntry> = seen.iter().collect();
                log_page::discovery(d.genctr, &seen)
            }
            _ if self.discovery.is_some() => {
                return Answer::Complete(Cqe::new(cid, Status::INVALID_LOG_PAGE))
            }
            lid::RESERVATION_NOTIFICATION => {
                let Some(c) = self.controllers.get_mut(&queue.cntlid) else {
                    return Answer::Complete(Cqe::new(cid, Status::COMMAND_SEQUENCE_ERROR));
                };
                // Each read takes the oldest notification (an empty page when none waits).
                let page = match c.reservation_log.pop_front() {
                    Some((count, kind, nsid)) => {
                        let left = c.reservation_log.len().min(255) as u8;
                        reservation::notification_page(count, kind, left, nsid)
                    }
                    None => reservation::notification_page(0, 0, 0, 0),
                };
                if !r.retain {
                    c.reservation_notice_masked = false;
                }
                page.to_vec()
            }
            lid::ANA => {
                if !r.retain {
                    if let Some(c) = self.controllers.get_mut(&queue.cntlid) {
                        c.ana_notice_masked = false;
                    }
                }
                let attached = self
                    .namespaces
                    .values()
                    .map(|a| (a.ns.nsid, a.ns.ana_group));
                self.ana.log_page(attached, r.lsp & 1 != 0)
            }
            _ => return Answer::Complete(Cqe::new(cid, Status::INVALID_LOG_PAGE)),
        };
        match r.cut(&page, self.max_transfer()) {
            Some(data) => self.reply(sqe, &data),
            None => Answer::Complete(Cqe::new(cid, Status::INVALID_FIELD)),
        }
    }

    fn set_features(&mut self, now: Instant, queue: &Queue, sqe: &Sqe) -> Answer {
        let cid = sqe.cid();
        let done = |status, dw0| {
            Answer::Complete(Cqe {
                dw0,
                ..Cqe::new(cid, status)
            })
        };
        if sqe.cdw(10) & 1 << 31 != 0 {
            return done(Status::FEATURE_NOT_SAVEABLE, 0);
        }
        let max_io = self.config.max_io_queues;
        let Some(c) = self.controllers.get_mut(&queue.cntlid) else {
            return done(Status::COMMAND_SEQUENCE_ERROR, 0);
        };
        let value = sqe.cdw(11);
        match sqe.cdw(10) as u8 {
            feature::NUMBER_OF_QUEUES => {
                let (sq, cq) = (value & 0xffff, value >> 16);
                if sq == 0xffff || cq == 0xffff {
                    return done(Status::INVALID_FIELD, 0);
                }
                if c.features.io_queues.is_some() {
                    // Only once after a reset.
                    return done(Status::COMMAND_SEQUENCE_ERROR, 0);
                }
                let granted = ((sq.min(cq) + 1) as u16).min(max_io);
                if granted == 0 {
                    // No I/O queue to grant (a discovery controller).
                    return done(Status::INVALID_FIELD, 0);
                }
                c.features.io_queues = Some(granted);
                let g = u32::from(granted - 1);
                done(Status::SUCCESS, g | g << 16)
            }
            feature::ASYNC_EVENT_CONFIGURATION => {
                c.features.aec = value;
                done(Status::SUCCESS, 0)
            }
            feature::KEEP_ALIVE_TIMER => {
                c.kato = (value > 0).then(|| Duration::from_millis(u64::from(value)));
                c.alive_at = now;
                done(Status::SUCCESS, 0)
            }
            feature::VOLATILE_WRITE_CACHE => {
                c.features.vwc = value & 1 != 0;
                done(Status::SUCCESS, 0)
            }
            // The host identifier comes with Connect on a fabric.
            feature::HOST_IDENTIFIER => done(Status::COMMAND_SEQUENCE_ERROR, 0),
            feature::RESERVATION_NOTIFICATION_MASK => {
                if value & !RESERVATION_MASK_BITS != 0 {
                    return done(Status::INVALID_FIELD, 0);
                }
                let nsid = sqe.nsid();
                if nsid == u32::MAX {
                    for n in self.namespaces.keys() {
                        c.reservation_masks.insert(*n, value);
                    }
                } else if self.namespaces.contains_key(&nsid) {
                    c.reservation_masks.insert(nsid, value);
                } else {
                    return done(Status::INVALID_NAMESPACE, 0);
                }
                done(Status::SUCCESS, value)
            }
            feature::RESERVATION_PERSISTENCE => {
                let ptpl = value & 1 != 0;
                let nsid = sqe.nsid();
                let Some(store) = self.store.as_mut() else {
                    return done(Status::INVALID_FIELD, 0);
                };
                let nsids: Vec<u32> = if nsid == u32::MAX {
                    self.namespaces.keys().copied().collect()
                } else if self.namespaces.contains_key(&nsid) {
                    vec![nsid]
                } else {
                    return done(Status::INVALID_NAMESPACE, 0);
                };
                for n in nsids {
                    let Some(a) = self.namespaces.get_mut(&n) else {
                        continue;
                    };
                    let state = ptpl.then(|| {
                        let mut s = a.reservations.clone();
                        s.aptpl = true;
                        s.encode()
                    });
                    if store.0.save(&store_key(&a.ns), state.as_deref()).is_err() {
                        return done(Status::INTERNAL_ERROR, 0);
                    }
                    a.reservations.aptpl = ptpl;
                }
                done(Status::SUCCESS, 0)
            }
            _ => done(Status::INVALID_FIELD, 0),
        }
    }

    fn get_features(&self, queue: &Queue, sqe: &Sqe) -> Answer {
        let cid = sqe.cid();
        let done = |status, dw0| {
            Answer::Complete(Cqe {
                dw0,
                ..Cqe::new(cid, status)
            })
        };
        let Some(c) = self.controllers.get(&queue.cntlid) else {
            return done(Status::COMMAND_SEQUENCE_ERROR, 0);
        };
        // SEL: current (000b), default (001b), saved (010b): the same here; supported
        // capabilities (011b): changeable, not saveable.
        let sel = (sqe.cdw(10) >> 8) & 7;
        let fid = sqe.cdw(10) as u8;
        let known = matches!(
            fid,
            feature::NUMBER_OF_QUEUES
                | feature::ASYNC_EVENT_CONFIGURATION
                | feature::KEEP_ALIVE_TIMER
                | feature::VOLATILE_WRITE_CACHE
                | feature::HOST_IDENTIFIER
                | feature::RESERVATION_NOTIFICATION_MASK
                | feature::RESERVATION_PERSISTENCE
        );
        if !known || sel > 3 {
            return done(Status::INVALID_FIELD, 0);
        }
        if sel == 3 {
            return done(Status::SUCCESS, 1 << 2);
        }
        match fid {
            feature::NUMBER_OF_QUEUES => {
                let g = u32::from(
                    c.features
                        .io_queues
                        .unwrap_or(self.config.max_io_queues)
                        .max(1)
                        - 1,
                );
                done(Status::SUCCESS, g | g << 16)
            }
            feature::ASYNC_EVENT_CONFIGURATION => done(Status::SUCCESS, c.features.aec),
            feature::KEEP_ALIVE_TIMER => done(
                Status::SUCCESS,
                c.kato
                    .map_or(0, |k| k.as_millis().min(u128::from(u32::MAX)) as u32),
            ),
            feature::VOLATILE_WRITE_CACHE => done(Status::SUCCESS, u32::from(c.features.vwc)),
            feature::RESERVATION_NOTIFICATION_MASK | feature::RESERVATION_PERSISTENCE => {
                let Some(a) = self.namespaces.get(&sqe.nsid()) else {
                    return done(Status::INVALID_NAMESPACE, 0);
                };
                let v = if fid == feature::RESERVATION_PERSISTENCE {
                    u32::from(a.reservations.aptpl)
                } else {
                    c.reservation_masks.get(&sqe.nsid()).copied().unwrap_or(0)
                };
                done(Status::SUCCESS, v)
            }
            // 128-bit host identifier (EXHID) only.
            _ => {
                if sqe.cdw(11) & 1 == 0 {
                    return done(Status::INVALID_FIELD, 0);
                }
                self.reply(sqe, &c.hostid)
            }
        }
    }
}

/// Why a handed-over controller or namespace state was not taken in.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AdoptError {
    /// The state is for another subsystem.
    #[error("the state is for subsystem {0}")]
    Subsystem(String),
    /// A controller of that CNTLID is live here.
    #[error("controller {0} is live here")]
    Taken(u16),
    /// The CNTLID is outside the range this subsystem hands out.
    #[error("controller {0} is outside this subsystem's CNTLIDs")]
    Cntlid(u16),
    /// This subsystem does not admit the host, or is a discovery subsystem.
    #[error("host {0} is not admitted here")]
    Host(String),
    /// A queue this subsystem would not have granted (too many, too large).
    #[error("queue {qid}: {reason}")]
    Queue {
        /// The queue.
        qid: u16,
        /// Why.
        reason: &'static str,
    },
    /// More of something than a controller here holds.
    #[error("more {0} than a controller here holds")]
    Limit(&'static str),
    /// No namespace of that NSID and NGUID here.
    #[error("no namespace {0} with that NGUID here")]
    Namespace(u32),
    /// The reservations' encoding does not decode.
    #[error("namespace {0}: the reservations do not decode")]
    Reservations(u32),
}

impl Subsystem {
    /// Controller `cntlid`'s state for a handover, its queues left for their connections to
    /// fill in ([`crate::tcp::ControllerConnection::handover`]); `None` when there is no such
    /// controller, it failed, or it has completions waiting to go (not quiescent).
    pub fn controller_state(&self, cntlid: u16) -> Option<crate::handover::ControllerState> {
        let c = self.controllers.get(&cntlid)?;
        if c.failed || !c.completions.is_empty() {
            return None;
        }
        Some(crate::handover::ControllerState {
            subnqn: self.config.nqn.clone(),
            cntlid,
            hostnqn: c.hostnqn.clone(),
            hostid: c.hostid,
            cap: c.properties.cap,
            vs: c.properties.vs,
            cc: c.properties.cc,
            csts: c.properties.csts,
            aec: c.features.aec,
            vwc: c.features.vwc,
            io_queues_granted: c.features.io_queues,
            kato_ms: c
                .kato
                .map_or(0, |k| k.as_millis().min(u128::from(u32::MAX)) as u32),
            aers: c.aers.clone(),
            notices: c.notices.clone(),
            changed: c.changed.iter().copied().collect(),
            namespace_notice_masked: c.namespace_notice_masked,
            discovery_notice_masked: c.discovery_notice_masked,
            reservation_notice_masked: c.reservation_notice_masked,
            ana_notice_masked: c.ana_notice_masked,
            reached: c.reached,
            reservation_log: c.reservation_log.iter().copied().collect(),
            reservation_count: c.reservation_count,
            reservation_masks: c.reservation_masks.iter().map(|(k, v)| (*k, *v)).collect(),
            queues: Vec::new(),
        })
    }

    /// Takes in a controller another process handed over, under its CNTLID, with the I/O
    /// queues its state names connected; its keep alive starts anew at `now`. The queues to
    /// bind its connections to, in the order of `state.queues`. Refused, changing nothing,
    /// when the state is another subsystem's, its CNTLID is live here, its host is not
    /// admitted, or a queue is one this subsystem would not have granted.
    pub fn adopt_controller(
        &mut self,
        now: Instant,
        state: &crate::handover::ControllerState,
    ) -> Result<Vec<Queue>, AdoptError> {
        if state.subnqn != self.config.nqn {
            return Err(AdoptError::Subsystem(state.subnqn.clone()));
        }
        if self.controllers.contains_key(&state.cntlid) {
            return Err(AdoptError::Taken(state.cntlid));
        }
        // Another gateway's range (a cluster's gateways hand out CNTLIDs apart).
        let (first, last) = self.config.cntlids;
        if state.cntlid < first.max(ALL_CNTLIDS.0) || state.cntlid > last.min(ALL_CNTLIDS.1) {
            return Err(AdoptError::Cntlid(state.cntlid));
        }
        if !self.config.hosts.is_empty() && !self.config.hosts.contains(&state.hostnqn) {
            return Err(AdoptError::Host(state.hostnqn.clone()));
        }
        if state.aers.len() > MAX_AERS {
            return Err(AdoptError::Limit("Asynchronous Event Requests"));
        }
        if state.reservation_log.len() > MAX_RESERVATION_NOTICES {
            return Err(AdoptError::Limit("reservation notifications"));
        }
        let max = u32::from(self.config.max_queue_entries.max(32));
        let granted = state.io_queues_granted.unwrap_or(self.config.max_io_queues);
        let mut queues = Vec::with_capacity(state.queues.len());
        for q in &state.queues {
            let refuse = |reason| AdoptError::Queue { qid: q.qid, reason };
            if q.size > max {
                return Err(refuse("more entries than this subsystem grants"));
            }
            if q.qid > 0 && (self.discovery.is_some() || q.qid > granted) {
                return Err(refuse("an I/O queue this subsystem does not grant"));
            }
            queues.push(Queue {
                cntlid: state.cntlid,
                qid: q.qid,
                size: q.size,
                sq_flow_control_disabled: q.sq_flow_control_disabled,
            });
        }
        self.controllers.insert(
            state.cntlid,
            Controller {
                hostnqn: state.hostnqn.clone(),
                hostid: state.hostid,
                properties: Properties {
                    cap: state.cap,
                    vs: state.vs,
                    cc: state.cc,
                    csts: state.csts,
                },
                features: Features {
                    aec: state.aec,
                    vwc: state.vwc,
                    io_queues: state.io_queues_granted,
                },
                kato: (state.kato_ms > 0).then(|| Duration::from_millis(u64::from(state.kato_ms))),
                alive_at: now,
                io_queues: queues.iter().map(|q| q.qid).filter(|&q| q > 0).collect(),
                aers: state.aers.clone(),
                notices: state.notices.clone(),
                changed: state.changed.iter().copied().collect(),
                namespace_notice_masked: state.namespace_notice_masked,
                discovery_notice_masked: state.discovery_notice_masked,
                reached: state.reached,
                failed: false,
                host: reservation::host(state.hostid),
                reservation_log: state.reservation_log.iter().copied().collect(),
                reservation_count: state.reservation_count,
                reservation_notice_masked: state.reservation_notice_masked,
                ana_notice_masked: state.ana_notice_masked,
                reservation_masks: state.reservation_masks.iter().copied().collect(),
                completions: Vec::new(),
            },
        );
        // What its host missed on shared namespaces while it moved.
        if let Some(c) = self.controllers.get_mut(&state.cntlid) {
            let host = c.host.clone();
            for (nsid, fx) in &self.handed_notices {
                for (_, kind) in reservation::notices(fx)
                    .into_iter()
                    .filter(|(h, _)| **h == host)
                {
                    self.wake |= notify(c, *nsid, kind);
                }
            }
        }
        Ok(queues)
    }

    /// Every namespace's reservations for a handover (those a cluster shares as this
    /// process's hosts last heard them: the next process reads them from the cluster).
    pub fn namespace_states(&self) -> Vec<crate::handover::NamespaceState> {
        self.namespaces
            .values()
            .map(|a| crate::handover::NamespaceState {
                nsid: a.ns.nsid,
                nguid: a.ns.nguid,
                reservations: a.reservations.encode(),
            })
            .collect()
    }

    /// Takes in a namespace's reservations another process handed over: the namespace of
    /// that NSID must be here with the same NGUID (the same storage). Those a cluster shares
    /// stay as read from it; what they went through since the hosts last heard (another
    /// gateway's preempt while the controllers moved) is told to each controller adopted
    /// after this.
    pub fn adopt_namespace_state(
        &mut self,
        state: &crate::handover::NamespaceState,
    ) -> Result<(), AdoptError> {
        let a = self
            .namespaces
            .get_mut(&state.nsid)
            .filter(|a| a.ns.nguid == state.nguid)
            .ok_or(AdoptError::Namespace(state.nsid))?;
        let handed =
            PrState::decode(&state.reservations).ok_or(AdoptError::Reservations(state.nsid))?;
        if !a.ns.shared_reservations {
            a.reservations = handed;
            return Ok(());
        }
        let missed = ReservationEffects::missed(&handed, &a.reservations);
        self.handed_notices.retain(|(nsid, _)| *nsid != state.nsid);
        self.handed_notices.push((state.nsid, missed));
        Ok(())
    }
}

/// Logs reservation notice `kind` on namespace `nsid` for controller `c` unless its mask
/// hides it, with an Asynchronous Event once per log read: whether it was logged.
fn notify(c: &mut Controller, nsid: u32, kind: u8) -> bool {
    let mask = c.reservation_masks.get(&nsid).copied().unwrap_or(0);
    if mask & 1 << kind != 0 {
        return false;
    }
    c.reservation_count = c.reservation_count.wrapping_add(1).max(1);
    if c.reservation_log.len() >= MAX_RESERVATION_NOTICES {
        c.reservation_log.pop_front();
    }
    c.reservation_log
        .push_back((c.reservation_count, kind, nsid));
    if !c.reservation_notice_masked {
        c.reservation_notice_masked = true;
        // I/O command specific status (type 6), Reservation Log Page Available (info 0), log
        // page 80h.
        c.notices
            .push(0x6 | u32::from(log_page::lid::RESERVATION_NOTIFICATION) << 16);
    }
    true
}

/// Feature identifiers.
pub mod feature {
    /// Volatile Write Cache.
    pub const VOLATILE_WRITE_CACHE: u8 = 0x06;
    /// Number of Queues.
    pub const NUMBER_OF_QUEUES: u8 = 0x07;
    /// Asynchronous Event Configuration.
    pub const ASYNC_EVENT_CONFIGURATION: u8 = 0x0b;
    /// Keep Alive Timer.
    pub const KEEP_ALIVE_TIMER: u8 = 0x0f;
    /// Host Identifier.
    pub const HOST_IDENTIFIER: u8 = 0x81;
    /// Reservation Notification Mask (per namespace).
    pub const RESERVATION_NOTIFICATION_MASK: u8 = 0x82;
    /// Reservation Persistence: PTPL (per namespace).
    pub const RESERVATION_PERSISTENCE: u8 = 0x83;
}

/// The access class of I/O command `opcode` under a reservation: the read command group
/// (Read, Compare, Verify) or the write command group (Write, Write Zeroes, Dataset
/// Management, Flush).
fn access(opcode: u8) -> Access {
    match NvmOpcode::from_code(opcode) {
        Some(NvmOpcode::Read | NvmOpcode::Compare | NvmOpcode::Verify) => Access::Read,
        _ => Access::Write,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sqe::Sgl;
    use crate::testing;

    const HOST: &str = "nqn.2014-08.org.nvmexpress:uuid:0d3f-host";
    const NQN: &str = "nqn.2026-11.io.example:sub";

    fn subsystem(hosts: Vec<String>) -> Subsystem {
        let hosts: Vec<&str> = hosts.iter().map(String::as_str).collect();
        let mut s = Subsystem::new(SubsystemConfig {
            serial: "0123456789".into(),
            ..testing::subsystem_config(NQN, &hosts)
        });
        s.add_namespace(testing::namespace(1, 512, 2048));
        s
    }

    fn connect_sqe(qid: u16, sqsize: u16, kato: u32) -> Sqe {
        testing::connect_sqe(1, qid, sqsize, kato, 0)
    }

    fn connect_data(cntlid: u16, host: &str, sub: &str) -> Vec<u8> {
        testing::connect_data([7; 16], cntlid, sub, host)
    }

    fn cmd(opcode: u8, cid: u16) -> Sqe {
        let mut s = Sqe::new(opcode, cid);
        s.set_sgl(Sgl::transport(4096));
        s
    }

    fn complete(a: Answer) -> Cqe {
        match a {
            Answer::Complete(c) => c,
            other => panic!("{other:?}"),
        }
    }

    /// What Linux's host does after connecting the admin queue: read CAP, enable the
    /// controller, identify it and its namespaces, ask for I/O queues, connect one.
    fn enabled(s: &mut Subsystem, now: Instant) -> Queue {
        let (admin, cqe) = s
            .connect(
                now,
                &connect_sqe(0, 31, 5000),
                &connect_data(CNTLID_DYNAMIC, HOST, NQN),
            )
            .expect("the admin queue");
        assert_eq!(cqe.dw0, u32::from(admin.cntlid));
        assert!(
            complete(s.command(now, &admin, &testing::enable_sqe(2), &[]))
                .status
                .is_success()
        );
        admin
    }

    #[test]
    fn connect_enable_identify_and_an_io_queue() {
        let now = Instant::now();
        let mut s = subsystem(vec![]);
        // Before enabling, only fabrics commands.
        let (admin, _) = s
            .connect(
                now,
                &connect_sqe(0, 31, 0),
                &connect_data(CNTLID_DYNAMIC, HOST, NQN),
            )
            .unwrap();
        let mut idc = cmd(AdminOpcode::Identify.code(), 3);
        idc.set_cdw(10, u32::from(cns::CONTROLLER));
        assert_eq!(
            complete(s.command(now, &admin, &idc, &[])).status,
            Status::COMMAND_SEQUENCE_ERROR
        );
        let admin = enabled(&mut s, now);
        let Answer::Data { data, cqe } = s.command(now, &admin, &idc, &[]) else {
            panic!("identify");
        };
        assert!(cqe.status.is_success());
        assert_eq!(u16::from_le_bytes([data[78], data[79]]), admin.cntlid);
        assert_eq!(&data[768..768 + NQN.len()], NQN.as_bytes());
        let mut idn = cmd(AdminOpcode::Identify.code(), 4);
        idn.set_cdw(10, u32::from(cns::NAMESPACE));
        idn.set_nsid(1);
        let Answer::Data { data, .. } = s.command(now, &admin, &idn, &[]) else {
            panic!("identify namespace");
        };
        assert_eq!(u64::from_le_bytes(data[..8].try_into().unwrap()), 2048);
        idn.set_nsid(0);
        assert_eq!(
            complete(s.command(now, &admin, &idn, &[])).status,
            Status::INVALID_NAMESPACE
        );
        // Two I/O queues asked, two granted; queue 3 is refused, queue 1 connects.
        let mut nq = cmd(AdminOpcode::SetFeatures.code(), 5);
        nq.set_cdw(10, u32::from(feature::NUMBER_OF_QUEUES));
        nq.set_cdw(11, 1 | 1 << 16);
        assert_eq!(complete(s.command(now, &admin, &nq, &[])).dw0, 1 | 1 << 16);
        let e = s
            .connect(
                now,
                &connect_sqe(3, 127, 0),
                &connect_data(admin.cntlid, HOST, NQN),
            )
            .unwrap_err();
        assert_eq!((e.status, e.dw0), (Status::CONNECT_INVALID_PARAMETERS, 42));
        let (io, _) = s
            .connect(
                now,
                &connect_sqe(1, 127, 0),
                &connect_data(admin.cntlid, HOST, NQN),
            )
            .unwrap();
        assert_eq!((io.qid, io.size), (1, 128));
        // The same queue twice; another host's claim on the controller.
        assert!(s
            .connect(
                now,
                &connect_sqe(1, 127, 0),
                &connect_data(admin.cntlid, HOST, NQN)
            )
            .is_err());
        assert!(s
            .connect(
                now,
                &connect_sqe(2, 127, 0),
                &connect_data(admin.cntlid, "nqn.2026-11.other:h", NQN)
            )
            .is_err());
        // A read through it becomes an I/O command.
        let mut read = Sqe::new(NvmOpcode::Read.code(), 9);
        read.set_nsid(1);
        read.set_cdw(12, 7);
        read.set_sgl(Sgl::transport(4096));
        assert!(matches!(
            s.command(now, &io, &read, &[]),
            Answer::Io {
                nsid: 1,
                command: IoCommand::Op { .. }
            }
        ));
        // The admin queue goes: the controller with it.
        s.disconnect(&admin);
        assert_eq!(
            complete(s.command(now, &io, &read, &[])).status,
            Status::COMMAND_SEQUENCE_ERROR
        );
    }

    /// A gateway's controllers take IDs from its range only, in turn, and a full range is
    /// Controller Busy.
    #[test]
    fn controller_ids_come_from_the_subsystems_range() {
        let now = Instant::now();
        let mut s = Subsystem::new(SubsystemConfig {
            cntlids: (1025, 1026),
            ..testing::subsystem_config(NQN, &[])
        });
        let admin = |s: &mut Subsystem| {
            s.connect(
                now,
                &connect_sqe(0, 31, 0),
                &connect_data(CNTLID_DYNAMIC, HOST, NQN),
            )
        };
        let first = admin(&mut s).expect("the first").0;
        let second = admin(&mut s).expect("the second").0;
        assert_eq!((first.cntlid, second.cntlid), (1025, 1026));
        let busy = admin(&mut s).expect_err("the range is full");
        assert_eq!(busy.status, Status::CONNECT_CONTROLLER_BUSY);
        s.disconnect(&first);
        assert_eq!(admin(&mut s).expect("a free ID again").0.cntlid, 1025);
    }

    #[test]
    fn connect_refusals() {
        let now = Instant::now();
        let mut s = subsystem(vec![HOST.into()]);
        let e = s
            .connect(
                now,
                &connect_sqe(0, 31, 0),
                &connect_data(CNTLID_DYNAMIC, "nqn.2026-11.x:y", NQN),
            )
            .unwrap_err();
        assert_eq!(e.status, Status::CONNECT_INVALID_HOST);
        let e = s
            .connect(
                now,
                &connect_sqe(0, 31, 0),
                &connect_data(CNTLID_DYNAMIC, HOST, "nqn.2026-11.x:other"),
            )
            .unwrap_err();
        assert_eq!(
            (e.status, e.dw0),
            (Status::CONNECT_INVALID_PARAMETERS, 0x1_0100)
        );
        // An admin queue of 8 entries (at least 32); an I/O queue before the controller is
        // enabled.
        assert!(s
            .connect(
                now,
                &connect_sqe(0, 7, 0),
                &connect_data(CNTLID_DYNAMIC, HOST, NQN)
            )
            .is_err());
        let (admin, _) = s
            .connect(
                now,
                &connect_sqe(0, 31, 0),
                &connect_data(CNTLID_DYNAMIC, HOST, NQN),
            )
            .unwrap();
        let e = s
            .connect(
                now,
                &connect_sqe(1, 31, 0),
                &connect_data(admin.cntlid, HOST, NQN),
            )
            .unwrap_err();
        assert_eq!(e.status, Status::COMMAND_SEQUENCE_ERROR);
    }

    /// KATO enforced on `now`: Keep Alive within it keeps the controller; silence past it
    /// fails it, and it takes no more commands.
    #[test]
    fn keep_alive_is_enforced() {
        let t0 = Instant::now();
        let mut s = subsystem(vec![]);
        let admin = enabled(&mut s, t0);
        let kato = Duration::from_millis(5000);
        assert_eq!(s.poll_timeout(), Some(t0 + kato + KEEP_ALIVE_GRANULARITY));
        let ka = Sqe::new(AdminOpcode::KeepAlive.code(), 8);
        let t1 = t0 + Duration::from_secs(4);
        assert!(s.handle_timeout(t1).is_empty());
        assert!(complete(s.command(t1, &admin, &ka, &[]))
            .status
            .is_success());
        assert!(s.handle_timeout(t0 + Duration::from_secs(6)).is_empty());
        let late = t1 + kato + KEEP_ALIVE_GRANULARITY;
        assert_eq!(s.handle_timeout(late), vec![admin.cntlid]);
        assert_eq!(
            complete(s.command(late, &admin, &ka, &[])).status,
            Status::KEEP_ALIVE_EXPIRED
        );
        assert_eq!(s.poll_timeout(), None);
    }

    #[test]
    fn features_logs_and_events() {
        let now = Instant::now();
        let mut s = subsystem(vec![]);
        let admin = enabled(&mut s, now);
        let mut get = Sqe::new(AdminOpcode::GetFeatures.code(), 1);
        get.set_cdw(10, u32::from(feature::KEEP_ALIVE_TIMER));
        assert_eq!(complete(s.command(now, &admin, &get, &[])).dw0, 5000);
        get.set_cdw(10, 0x42);
        assert_eq!(
            complete(s.command(now, &admin, &get, &[])).status,
            Status::INVALID_FIELD
        );
        let mut set = Sqe::new(AdminOpcode::SetFeatures.code(), 2);
        set.set_cdw(10, u32::from(feature::ASYNC_EVENT_CONFIGURATION) | 1 << 31);
        assert_eq!(
            complete(s.command(now, &admin, &set, &[])).status,
            Status::FEATURE_NOT_SAVEABLE
        );
        // The ANA log: one group, optimized, namespace 1.
        let mut log = cmd(AdminOpcode::GetLogPage.code(), 3);
        log.set_cdw(10, u32::from(lid::ANA) | (56 / 4 - 1) << 16);
        log.set_sgl(Sgl::transport(56));
        let Answer::Data { data, .. } = s.command(now, &admin, &log, &[]) else {
            panic!("the ANA log");
        };
        assert_eq!((data[8], data[32], data[48]), (1, 1, 1));
        log.set_cdw(10, 0x33);
        assert_eq!(
            complete(s.command(now, &admin, &log, &[])).status,
            Status::INVALID_LOG_PAGE
        );
        // Asynchronous Event Requests are held, up to the limit.
        for cid in 10..10 + MAX_AERS as u16 {
            let aer = Sqe::new(AdminOpcode::AsyncEventRequest.code(), cid);
            assert_eq!(s.command(now, &admin, &aer, &[]), Answer::Held);
        }
        let aer = Sqe::new(AdminOpcode::AsyncEventRequest.code(), 99);
        assert_eq!(
            complete(s.command(now, &admin, &aer, &[])).status,
            Status::AER_LIMIT_EXCEEDED
        );
        assert_eq!(
            s.take_async_event_requests(admin.cntlid),
            vec![10, 11, 12, 13]
        );

        // Namespace notices: enabled, one AER held; a namespace added is told once until the
        // host reads the Changed Namespace List, which names it.
        let mut aec = Sqe::new(AdminOpcode::SetFeatures.code(), 30);
        aec.set_cdw(10, u32::from(feature::ASYNC_EVENT_CONFIGURATION));
        aec.set_cdw(11, AEC_NAMESPACE_ATTRIBUTE);
        assert!(complete(s.command(now, &admin, &aec, &[]))
            .status
            .is_success());
        let aer = Sqe::new(AdminOpcode::AsyncEventRequest.code(), 31);
        assert_eq!(s.command(now, &admin, &aer, &[]), Answer::Held);
        let mut ns2 = s.namespace(1).unwrap().clone();
        ns2.nsid = 2;
        s.add_namespace(ns2.clone());
        ns2.nsid = 3;
        s.add_namespace(ns2);
        let events = s.poll_async_events();
        assert_eq!(events.len(), 1, "one notice until the list is read");
        let (cntlid, cqe) = events[0];
        assert_eq!((cntlid, cqe.cid, cqe.dw0), (admin.cntlid, 31, 0x04_0002));
        let mut changed = cmd(AdminOpcode::GetLogPage.code(), 32);
        changed.set_cdw(10, u32::from(lid::CHANGED_NAMESPACES) | 1023 << 16);
        let Answer::Data { data, .. } = s.command(now, &admin, &changed, &[]) else {
            panic!("the changed namespace list");
        };
        assert_eq!(&data[..12], &[2, 0, 0, 0, 3, 0, 0, 0, 0, 0, 0, 0]);
        // Read: empty now, and the next change is told again.
        let Answer::Data { data, .. } = s.command(now, &admin, &changed, &[]) else {
            panic!("the changed namespace list");
        };
        assert!(data[..4].iter().all(|&b| b == 0));
        assert_eq!(s.command(now, &admin, &aer, &[]), Answer::Held);
        s.remove_namespace(3);
        assert_eq!(s.poll_async_events().len(), 1);
        let unknown = Sqe::new(0x55, 5);
        assert_eq!(
            complete(s.command(now, &admin, &unknown, &[])).status,
            Status::INVALID_OPCODE
        );
    }
}
