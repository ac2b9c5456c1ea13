//! The device as the connections of a target share it: every task's and every task
//! management function's route back to the connection (iSCSI) or channel (SRP) that carries
//! it out, and where each nexus that asked for them has its unit attentions announced.
//!
//! A nexus may have several connections (iSCSI MC/S, SRP MULTI CHANNEL), and what the device
//! asks for later (data-out, a backend operation, the end of a task, the answer to a task
//! management function) must reach the one the command came on. [`Router`] keeps those
//! routes, without locks or I/O: each call takes a [`Sink`] of `(route, event)` values, and the
//! caller decides how they travel (targetd queues its own connection's and sends the rest to
//! other reactors once it has let the core's lock go; the test rigs queue them per connection).
//! What is one transport's own stays in that transport: iSCSI's CmdSN order wraps a router
//! (`iscsi_pdu::target_node::TargetCore`); SRP needs none.

use crate::device::{Device, DeviceError, PortGroupsChange, ReservationChange};
use crate::lu::{LogicalUnit, TargetPort};
use crate::nexus::TransportId;
use crate::pr::{PrError, ReservationEffects, Reservations};
use crate::spc::tpg::PortGroup;
use crate::task::{Action, Command, TaskId, TmfFunction};
use crate::{BackendError, NexusId, Output, Sense};

/// What the device hands back to the connection that owns a task.
#[derive(Debug)]
#[must_use = "a core event is the connection's work: its task waits for it"]
pub enum CoreEvent {
    /// The command with this tag entered the device as `task`.
    Submitted {
        /// The transport's tag, widened (iSCSI's Initiator Task Tag, SRP's tag).
        tag: u64,
        /// The device's handle.
        task: TaskId,
    },
    /// Something for the connection to do.
    Action(Action),
}

/// Takes the router's events, each addressed to the route of its task.
pub trait Sink<R> {
    /// `event` is for the connection `route`.
    fn push(&mut self, route: &R, event: CoreEvent);

    /// `action` is for a task with no route: its connection went before the device answered.
    /// Nothing can carry it out; the default drops it (targetd logs it).
    fn unrouted(&mut self, action: Action) {
        let _ = action;
    }

    /// `change` to a unit's shared reservations ([`Device::share_reservations`]) is for their
    /// keeper, which decides it and then calls [`Router::apply_reservations`] on every
    /// device server of the unit and [`Router::reservation_done`] (or
    /// [`Router::task_management_change_done`]) on this one. A sink that reaches no keeper
    /// hands it back (`Some`, the default), and the router refuses it
    /// ([`Router::refuse_reservation_change`]).
    fn reservation_change(&mut self, change: ReservationChange) -> Option<ReservationChange> {
        Some(change)
    }

    /// SET TARGET PORT GROUPS on a unit whose port groups a keeper decides
    /// ([`Router::share_port_groups`]) is for that keeper, which calls
    /// [`Router::set_port_groups`] on every device server of the unit and
    /// [`Router::port_groups_change_done`] on this one. A sink that reaches no keeper hands it
    /// back (`Some`, the default), and the command ends with NOT READY.
    fn port_groups_change(&mut self, change: PortGroupsChange) -> Option<PortGroupsChange> {
        Some(change)
    }
}

/// A target's device and the routes of its tasks, task management functions and unit
/// attention announcements.
///
/// The router owns the device: every call that can change it (a command, data-out, a backend
/// completion, an administrator's unit or port group change, a keeper's decision) is a router
/// method that hands what follows to a [`Sink`], so nothing the device raises is left for a
/// later caller to find. [`Router::device`] is the device to look at.
#[derive(Debug)]
pub struct Router<R> {
    device: Device,
    routes: Vec<Option<R>>,
    tmfs: Vec<(u64, R)>,
    /// Where each nexus that reports asynchronous events has them sent.
    announcements: Vec<(NexusId, R)>,
    next_reference: u64,
}

impl<R: Clone> Router<R> {
    /// The router of `device`, with no task yet.
    pub fn new(device: Device) -> Router<R> {
        Router {
            device,
            routes: Vec::new(),
            tmfs: Vec::new(),
            announcements: Vec::new(),
            next_reference: 0,
        }
    }

    /// The device, to look at (its units, reservations, port groups, tasks).
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// Takes in unit `lun`'s state from the process before (an upgrade's handover), before
    /// the sessions that reach it ([`Device::adopt_unit_state`]).
    pub fn adopt_unit_state(
        &mut self,
        lun: u16,
        state: crate::UnitState,
    ) -> Result<(), crate::DeviceError> {
        self.device.adopt_unit_state(lun, state)
    }

    /// The handover's nexuses are all adopted ([`Device::end_handover`]).
    pub fn end_handover(&mut self) {
        self.device.end_handover();
    }

    /// Adds a target port (a transport's first login through it); false when the device has
    /// it already. See [`Device::add_port`].
    pub fn add_port(&mut self, port: TargetPort) -> bool {
        self.device.add_port(port)
    }

    /// Opens the I_T nexus of `initiator` through the target port `relative_port`.
    pub fn open_nexus(&mut self, initiator: TransportId, relative_port: u16) -> NexusId {
        self.device.open_nexus(initiator, relative_port)
    }

    /// Opens a nexus handed over from another process with its pending unit attentions
    /// ([`Device::adopt_nexus`]).
    pub fn adopt_nexus(
        &mut self,
        initiator: TransportId,
        relative_port: u16,
        unit_attentions: Vec<(u16, crate::Asc)>,
    ) -> NexusId {
        self.device
            .adopt_nexus(initiator, relative_port, unit_attentions)
    }

    /// Adds logical unit `index` (an administrator's `lun add`); the nexuses hear REPORTED
    /// LUNS DATA HAS CHANGED.
    pub fn add_unit(
        &mut self,
        index: u16,
        unit: LogicalUnit,
        out: &mut impl Sink<R>,
    ) -> Result<(), DeviceError> {
        let added = self.device.add_lu(index, unit);
        self.drain(out);
        added
    }

    /// Removes logical unit `index`; its tasks are aborted, each abort routed to its
    /// connection.
    pub fn remove_unit(&mut self, index: u16, out: &mut impl Sink<R>) -> Result<(), DeviceError> {
        let removed = self.device.remove_lu(index);
        self.drain(out);
        removed
    }

    /// Unit `index` now has `blocks` blocks; the nexuses hear CAPACITY DATA HAS CHANGED.
    pub fn resize_unit(
        &mut self,
        index: u16,
        blocks: u64,
        out: &mut impl Sink<R>,
    ) -> Result<(), DeviceError> {
        let resized = self.device.resize_lu(index, blocks);
        self.drain(out);
        resized
    }

    /// Unit `lun`'s target port groups are now `groups`; returns whether an access state
    /// changed (the nexuses then hear ASYMMETRIC ACCESS STATE CHANGED).
    pub fn set_port_groups(
        &mut self,
        lun: u16,
        groups: Vec<PortGroup>,
        out: &mut impl Sink<R>,
    ) -> Result<bool, DeviceError> {
        let changed = self.device.set_port_groups(lun, groups);
        self.drain(out);
        changed
    }

    /// Keeps unit `lun`'s reservations with a keeper ([`Device::share_reservations`]): its
    /// changes reach the sink's [`Sink::reservation_change`].
    pub fn share_reservations(&mut self, lun: u16) -> Result<(), DeviceError> {
        self.device.share_reservations(lun)
    }

    /// Has a keeper decide unit `lun`'s port groups ([`Device::share_port_groups`]): SET
    /// TARGET PORT GROUPS reaches the sink's [`Sink::port_groups_change`].
    pub fn share_port_groups(&mut self, lun: u16) -> Result<(), DeviceError> {
        self.device.share_port_groups(lun)
    }

    /// The keeper decided SET TARGET PORT GROUPS task `task`
    /// ([`Device::port_groups_change_done`]); its end is routed. An error is a task aborted
    /// meanwhile (its end is routed already) or one that never asked.
    pub fn port_groups_change_done(
        &mut self,
        task: TaskId,
        result: Result<(), Sense>,
        out: &mut impl Sink<R>,
    ) -> Result<(), DeviceError> {
        let r = self.device.port_groups_change_done(task, result);
        self.drain(out);
        r
    }

    /// The keeper says unit `lun`'s shared reservations are `state` at `version`
    /// ([`Device::apply_reservations`]); the unit attentions and aborts that follow are
    /// routed. Returns whether it was applied (false: not newer than the last).
    pub fn apply_reservations(
        &mut self,
        lun: u16,
        version: u64,
        state: Reservations,
        effects: &ReservationEffects,
        out: &mut impl Sink<R>,
    ) -> bool {
        let applied = self.device.apply_reservations(lun, version, state, effects);
        self.drain(out);
        applied
    }

    /// The keeper says unit `lun`'s shared reservations are `state` at `version`, which this
    /// server may have missed changes before ([`Device::catch_up_reservations`]); the unit
    /// attentions and aborts that follow are routed.
    pub fn catch_up_reservations(
        &mut self,
        lun: u16,
        version: u64,
        state: Reservations,
        out: &mut impl Sink<R>,
    ) -> bool {
        let applied = self.device.catch_up_reservations(lun, version, state);
        self.drain(out);
        applied
    }

    /// The keeper has decided the change of reservation task `task`
    /// ([`Device::reservation_done`]); the task's end is routed.
    pub fn reservation_done(
        &mut self,
        task: TaskId,
        result: Result<(), PrError>,
        out: &mut impl Sink<R>,
    ) -> Result<(), DeviceError> {
        let done = self.device.reservation_done(task, result);
        self.drain(out);
        done
    }

    /// The keeper has carried out (or given up on) the change task management function
    /// `reference` waits for ([`Device::task_management_change_done`]).
    pub fn task_management_change_done(&mut self, reference: u64, out: &mut impl Sink<R>) {
        self.device.task_management_change_done(reference);
        self.drain(out);
    }

    /// Has the unit attentions of `nexus` reported to `route` as they are established
    /// ([`Action::UnitAttention`], which SRP sends as SRP_AER_REQ), or no longer (`None`).
    pub fn announce_to(&mut self, nexus: NexusId, route: Option<R>) -> Result<(), DeviceError> {
        self.device.report_unit_attentions(nexus, route.is_some())?;
        self.announcements.retain(|(n, _)| *n != nexus);
        if let Some(route) = route {
            self.announcements.push((nexus, route));
        }
        Ok(())
    }

    /// Closes `nexus` (its tasks are aborted, each abort routed to its connection) and
    /// forgets where it announced.
    pub fn close_nexus(
        &mut self,
        nexus: NexusId,
        out: &mut impl Sink<R>,
    ) -> Result<(), DeviceError> {
        self.announcements.retain(|(n, _)| *n != nexus);
        let closed = self.device.close_nexus(nexus);
        self.drain(out);
        closed
    }

    /// Submits `cmd` for the connection `route`; what follows goes to `out`, starting with
    /// [`CoreEvent::Submitted`].
    pub fn submit(
        &mut self,
        cmd: Command<'_>,
        route: &R,
        out: &mut impl Sink<R>,
    ) -> Result<TaskId, DeviceError> {
        let task = self.device.submit(cmd)?;
        let i = task.index();
        if self.routes.len() <= i {
            self.routes.resize(i + 1, None);
        }
        self.routes[i] = Some(route.clone());
        out.push(route, CoreEvent::Submitted { tag: cmd.tag, task });
        self.drain(out);
        Ok(task)
    }

    /// Starts a task management function of `nexus` for the connection `route`; its answer
    /// comes back there as [`Action::TaskManagementDone`] with the returned reference.
    pub fn task_management(
        &mut self,
        nexus: NexusId,
        lun: u64,
        function: TmfFunction,
        route: &R,
        out: &mut impl Sink<R>,
    ) -> Result<u64, DeviceError> {
        self.next_reference += 1;
        let reference = self.next_reference;
        self.tmfs.push((reference, route.clone()));
        if let Err(e) = self.device.task_management(nexus, lun, function, reference) {
            self.tmfs.pop();
            return Err(e);
        }
        self.drain(out);
        Ok(reference)
    }

    /// All the data-out the device asked of `task` has arrived. What follows is routed even
    /// when the device refuses it.
    pub fn data_out(
        &mut self,
        task: TaskId,
        data: &[u8],
        out: &mut impl Sink<R>,
    ) -> Result<(), DeviceError> {
        let taken = self.device.data_out(task, data);
        self.drain(out);
        taken
    }

    /// A backend operation of `task` has ended. What follows is routed even when the device
    /// refuses it.
    pub fn backend_done(
        &mut self,
        task: TaskId,
        result: Result<Output, BackendError>,
        out: &mut impl Sink<R>,
    ) -> Result<(), DeviceError> {
        let taken = self.device.backend_done(task, result);
        self.drain(out);
        taken
    }

    /// A delegated task has ended at its connection ([`Device::retire`]). An error is a
    /// connection retiring a task twice, or one that was never delegated.
    pub fn retire(&mut self, task: TaskId, out: &mut impl Sink<R>) -> Result<(), DeviceError> {
        self.device.retire(task)?;
        if let Some(r) = self.routes.get_mut(task.index()) {
            *r = None;
        }
        self.drain(out);
        Ok(())
    }

    /// Hands every pending action of the device to `out`, addressed to the connection of its
    /// task (a task's route is forgotten when it completes or is aborted), and every change to
    /// shared reservations to the sink's keeper.
    pub fn drain(&mut self, out: &mut impl Sink<R>) {
        loop {
            if self.device.has_reservation_changes() {
                self.hand_over_reservation_changes(out);
            }
            if self.device.has_port_groups_changes() {
                while let Some(change) = self.device.poll_port_groups_change() {
                    if let Some(refused) = out.port_groups_change(change) {
                        // No keeper: NOT READY, which the initiator retries (an error is a
                        // task aborted meanwhile, whose end is routed already).
                        let unavailable = Sense::from(BackendError::Unavailable);
                        let _ = self
                            .device
                            .port_groups_change_done(refused.task, Err(unavailable));
                    }
                }
            }
            let Some(action) = self.device.poll() else {
                break;
            };
            let routed = match &action {
                Action::DataOut { task, .. }
                | Action::Backend { task, .. }
                | Action::Delegated { task, .. } => {
                    match self.routes.get(task.index()).and_then(Option::as_ref) {
                        Some(route) => {
                            out.push(route, CoreEvent::Action(action));
                            continue;
                        }
                        None => None,
                    }
                }
                Action::Complete { task, .. } | Action::Aborted { task, .. } => {
                    self.routes.get_mut(task.index()).and_then(Option::take)
                }
                Action::TaskManagementDone { reference, .. } => {
                    let at = self.tmfs.iter().position(|(r, _)| r == reference);
                    at.map(|i| self.tmfs.swap_remove(i).1)
                }
                Action::UnitAttention { nexus, .. } => {
                    // Only nexuses that asked get these; one whose connection just went has
                    // its unit attention reported on its next command instead.
                    if let Some((_, route)) = self.announcements.iter().find(|(n, _)| n == nexus) {
                        out.push(route, CoreEvent::Action(action));
                    }
                    continue;
                }
            };
            match routed {
                Some(route) => out.push(&route, CoreEvent::Action(action)),
                None => out.unrouted(action),
            }
        }
    }

    /// Hands the device's changes to shared reservations to the sink's keeper; one the sink
    /// hands back (no keeper) is refused.
    fn hand_over_reservation_changes(&mut self, out: &mut impl Sink<R>) {
        while let Some(change) = self.device.poll_reservation_change() {
            if let Some(change) = out.reservation_change(change) {
                self.refuse(change);
            }
        }
    }

    /// Refuses `change` to shared reservations, which no keeper can decide: its command ends
    /// with NOT READY (LOGICAL UNIT IS IN PROCESS OF BECOMING READY, which initiators retry),
    /// and a task management function that waits for it goes on without it.
    pub fn refuse_reservation_change(&mut self, change: ReservationChange, out: &mut impl Sink<R>) {
        self.refuse(change);
        self.drain(out);
    }

    fn refuse(&mut self, change: ReservationChange) {
        if let Some(reference) = change.tmf {
            self.device.task_management_change_done(reference);
        }
        if let Some(task) = change.task {
            let unavailable = Sense::from(BackendError::Unavailable);
            // An error is a task aborted meanwhile: its end is routed already.
            let _ = self
                .device
                .reservation_done(task, Err(PrError::Sense(unavailable)));
        }
    }
}
