//! The cluster of gateways a targetd belongs to (`[cluster]`), as the rest of the daemon
//! reaches it: [`Cluster`], what the server, the registry, the admin socket and the metrics
//! ask of it and what a target hands it; and [`SharedTarget`], what it asks of a target. The
//! one implementation keeps the cluster's state in RADOS (`keeper`, feature `rbd`), and is
//! registered in [`start`] and nowhere else; the decisions are storage-target-cluster's
//! sans-IO machine.

use std::borrow::Cow;
use std::net::SocketAddr;
use std::sync::{Arc, Weak};

use scsi_core::pr::{PrError, ReservationEffects, Reservations};
use scsi_core::spc::tpg::PortGroup;
use scsi_core::{PortGroupsChange, ReservationChange, Sense, TaskId};

use crate::config;
use crate::store::UnitStore;

pub use cluster::gateway::Counters;
pub use cluster::member::srp_relative_port;
pub use cluster::{Membership, PathPolicy};

#[cfg(feature = "rbd")]
pub mod keeper;

/// One gateway as the cluster's gateways object lists it.
pub type Member = cluster::Member;

/// A unit whose shared state this gateway follows: dropping the last handle stops following.
pub type Following = Arc<dyn std::fmt::Debug + Send + Sync>;

/// The path policy a unit's config sets.
pub fn policy_of(lun: &config::Lun) -> PathPolicy {
    PathPolicy {
        preferred: lun.preferred_gateway.clone(),
        standby: lun.standby,
    }
}

/// This gateway's membership in a cluster of gateways.
pub trait Cluster: Send + Sync + std::fmt::Debug {
    /// This gateway's name (`cluster.gateway`).
    fn gateway(&self) -> &str;

    /// Lists this gateway (with its iSCSI `portals`) and starts answering "who is alive";
    /// returns once it knows who else is (or after a few seconds). Errors name the key.
    fn join(&self, portals: &[SocketAddr]) -> Result<(), (String, String)>;

    /// Joins as an upgrade's successor while its predecessor still is this gateway: as
    /// [`Cluster::join`], but the gateway's line stays the predecessor's until
    /// [`Cluster::take_place`].
    fn join_as_successor(&self, portals: &[SocketAddr]) -> Result<(), (String, String)>;

    /// The predecessor has parked: this process becomes the gateway (its line, its answers),
    /// every shared unit's reservations read again.
    fn take_place(&self) -> Result<(), String>;

    /// An upgrade failed after the successor may have taken this gateway's place: this
    /// process lists itself again, every shared unit's reservations read again.
    fn list_again(&self);

    /// A planned stop: this gateway leaves without being fenced.
    fn leave(&self);

    /// This start serves sessions kept through the service manager's store (called before
    /// any unit is shared): the shared reservations they hold are not cleared where no
    /// gateway watches them.
    fn keep_sessions(&self);

    /// This gateway's iSCSI portals are now `portals`.
    fn set_portals(&self, portals: &[SocketAddr]);

    /// This gateway's NVMe/TCP portals are now `tcp` and its NVMe/RDMA portals `rdma`: the
    /// other gateways' discovery logs list them.
    fn set_nvme_portals(&self, tcp: &[SocketAddr], rdma: &[SocketAddr]);

    /// This gateway serves SRP ports from now on: its port group has its SRP port
    /// ([`srp_relative_port`]) too, here at once and on the other gateways within a round.
    fn serve_srp(&self);

    /// The gateways listed and which of them answered last.
    fn membership(&self) -> Membership;

    /// What this gateway's keeper did (`targetd_cluster_*` metrics).
    fn counters(&self) -> Counters;

    /// Whether this gateway has lost its cluster session and serves no shared unit.
    fn is_fenced(&self) -> bool;

    /// The cluster as `targetctl cluster` shows it.
    fn view(&self) -> serde_json::Value;

    /// Takes gateway `name`, gone for good, out of the cluster.
    fn forget(&self, name: &str) -> Result<String, String>;

    /// The config a unit of `config` is served with in the cluster (an RBD unit without
    /// librbd's write cache: a write acknowledged through one gateway must read back through
    /// every other).
    fn unit_config<'a>(&self, target: &str, config: &'a config::Lun) -> Cow<'a, config::Lun>;

    /// Shares unit `config` of `target` on `storage` with the cluster's other gateways, when
    /// its storage is shared (an RBD image; `Ok(None)` for any other, `adopt` not called):
    /// checks that every gateway exports it alike, reads its shared reservations and hands
    /// them to `adopt` (version, state; the target puts the unit in its device with them),
    /// then follows them (every change another gateway makes is applied through
    /// [`SharedTarget`]); what changed between the read and the watch is applied once
    /// more. An error after `adopt` leaves the unit to the caller to take out.
    fn share(
        &self,
        target: Weak<dyn SharedTarget>,
        config: &config::Lun,
        storage: &dyn UnitStore,
        adopt: &mut dyn FnMut(u64, Reservations) -> Result<(), String>,
    ) -> Result<Option<Following>, String>;

    /// `change` to a shared unit's reservations, for the cluster to decide; its end reaches
    /// `target` through [`SharedTarget::reservation_done`] (or
    /// [`SharedTarget::task_management_change_done`]).
    fn submit(&self, target: Weak<dyn SharedTarget>, change: ReservationChange);

    /// NVMe reservation change `ask` (Register, Acquire or Release of `host` on namespace
    /// `nsid` of subsystem `target`), for the cluster to decide on the same state and with
    /// the same fencing as a SCSI change; its end reaches `target` through
    /// [`SharedTarget::nvme_reservation_done`] with `id`.
    fn submit_nvme(
        &self,
        target: Weak<dyn SharedTarget>,
        nsid: u16,
        id: u64,
        host: scsi_core::ItNexus,
        ask: cluster::ask::Ask,
    );

    /// SET TARGET PORT GROUPS on a shared unit of `target`, for the cluster to decide (the
    /// group asked active/optimized becomes the unit's preferred gateway on every gateway
    /// while it runs); its end reaches `target` through
    /// [`SharedTarget::port_groups_change_done`].
    fn submit_port_groups(&self, target: Weak<dyn SharedTarget>, change: PortGroupsChange);
}

/// Joins the cluster `config` names (`[cluster]`), if any. The one place a kind of cluster
/// is chosen.
pub fn start(config: &config::Config) -> Result<Option<Arc<dyn Cluster>>, (String, String)> {
    let Some(c) = &config.cluster else {
        return Ok(None);
    };
    #[cfg(feature = "rbd")]
    {
        let keeper: Arc<dyn Cluster> = keeper::Keeper::start(c)?;
        Ok(Some(keeper))
    }
    #[cfg(not(feature = "rbd"))]
    {
        let _ = c;
        Err((
            "cluster".into(),
            "this targetd was built without the feature rbd, which keeps a cluster's state in \
             RADOS"
                .into(),
        ))
    }
}

/// What the cluster needs of a target whose units it shares. The daemon's targets implement
/// it, and so do its NVM subsystems (a unit is a namespace, its LUN the NSID); the cluster
/// reaches them through this alone (it knows nothing else of a target).
pub trait SharedTarget: Send + Sync {
    /// The target's name.
    fn name(&self) -> &str;
    /// Unit `lun` as the cluster records which unit each image is, to refuse a gateway that
    /// exports the image as another (`target T\nlun N\n`, or `subsystem S\nnsid N\n`).
    fn unit_label(&self, lun: u16) -> String;
    /// The target as this gateway exports it now, to compare with the other gateways'.
    fn definition(&self) -> cluster::definition::Definition;
    /// The storage of unit `lun`.
    fn storage(&self, lun: u16) -> Option<Arc<dyn UnitStore>>;
    /// Unit `lun`'s shared reservations are `state` at `version`, with `effects` to carry out
    /// here.
    fn apply_shared_reservations(
        &self,
        lun: u16,
        version: u64,
        state: Reservations,
        effects: &ReservationEffects,
    );
    /// Unit `lun`'s shared reservations are `state` at `version`, read after changes this
    /// gateway may have missed: applied with the unit attentions (or notices) of the net
    /// outcome against what the nexuses here last heard.
    fn catch_up_shared_reservations(&self, lun: u16, version: u64, state: Reservations);
    /// Unit `lun`'s port groups are now `groups`.
    fn set_port_groups(&self, lun: u16, groups: Vec<PortGroup>);
    /// Unit `lun`'s port groups now.
    fn port_groups(&self, lun: u16) -> Option<Vec<PortGroup>>;
    /// Who holds unit `lun`'s reservation (initiator port name, persistent TYPE).
    fn reservation_holder(&self, lun: u16) -> Option<(String, Option<u8>)>;
    /// The change of reservation task `task` is decided.
    fn reservation_done(&self, task: TaskId, result: Result<(), PrError>);
    /// The NVMe reservation change `id` is decided (a subsystem's; a target has none).
    fn nvme_reservation_done(&self, id: u64, result: Result<(), nvme::Status>);
    /// The change task management function `reference` waits for is carried out.
    fn task_management_change_done(&self, reference: u64);
    /// SET TARGET PORT GROUPS task `task` is decided.
    fn port_groups_change_done(&self, task: TaskId, result: Result<(), Sense>);
    /// How many aborted tasks of unit `lun` still run.
    fn aborted_tasks_in_flight(&self, lun: u16) -> usize;
    /// Opens unit `lun` again on the process's current connection to the cluster, its
    /// shared state reloaded (after a rejoin).
    fn reopen_shared_lun(&self, lun: u16) -> Result<(), String>;
}
