//! A target's SCSI core as its iSCSI connections share it: the device, the CmdSN order of each
//! session (RFC 7143 section 4.2.2.1, which holds across all of a session's connections) and
//! the route of every task back to the connection that carries it out.
//!
//! A session with several connections (MC/S) hands the device commands that arrived on any of
//! them, in CmdSN order; what the device then asks for (data-out, backend operations, the end
//! of a task, the answer to a task management function) must reach the connection the task
//! came on. [`TargetCore`] does both, without locks or I/O: the caller passes a [`Sink`] that
//! takes `(route, event)` values, and decides how they travel (targetd queues the caller's own
//! and sends the rest over channels to other reactors once it has let the core's lock go; the
//! test rig queues them per connection).

use scsi_core::{Action, Command, Device, DeviceError, NexusId, TaskId, TmfFunction, TransportId};

use super::connection::{CoreEvent, OrderedCommand};
use super::order::CommandOrder;
use crate::SerialNumber;

/// Where a task's events go: a connection, as the caller names it.
pub trait Route: Clone {
    /// The connection, unique among the target's live connections.
    fn connection(&self) -> u64;
}

impl Route for u64 {
    fn connection(&self) -> u64 {
        *self
    }
}

/// Takes the core's events, each addressed to the route of its task.
pub trait Sink<R> {
    /// `event` is for the connection `route`.
    fn push(&mut self, route: &R, event: CoreEvent);
}

/// A session's CmdSN order: its commands wait with the route of the connection they came on.
type SessionOrder<R> = CommandOrder<(OrderedCommand, R)>;

/// The SCSI device of a target, the routes of its tasks and the CmdSN order of its sessions.
#[derive(Debug)]
pub struct TargetCore<R> {
    /// The device.
    pub device: Device,
    routes: Vec<Option<R>>,
    tmfs: Vec<(u64, R)>,
    /// Where each nexus that reports asynchronous events has them sent (SRP: one of its
    /// channels).
    announcements: Vec<(NexusId, R)>,
    next_reference: u64,
    /// Each session's CmdSN window and the commands waiting for their turn, by its I_T
    /// nexus's index.
    orders: Vec<Option<(NexusId, SessionOrder<R>)>>,
}

impl<R: Route> TargetCore<R> {
    /// The core of `device`, with no session yet.
    pub fn new(device: Device) -> TargetCore<R> {
        TargetCore {
            device,
            routes: Vec::new(),
            tmfs: Vec::new(),
            announcements: Vec::new(),
            next_reference: 0,
            orders: Vec::new(),
        }
    }

    /// Opens the I_T nexus of a new session whose first expected CmdSN is `cmd_sn`, admitting
    /// `window` commands ahead, through the target port `relative_port` (the target portal
    /// group the session logged in to).
    pub fn open_session(
        &mut self,
        initiator: TransportId,
        relative_port: u16,
        cmd_sn: SerialNumber,
        window: u32,
    ) -> NexusId {
        let nexus = self.device.open_nexus(initiator, relative_port);
        let i = nexus.index();
        if self.orders.len() <= i {
            self.orders.resize_with(i + 1, || None);
        }
        self.orders[i] = Some((nexus, CommandOrder::new(cmd_sn, window)));
        nexus
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

    /// Closes a session's nexus (its tasks are aborted) and forgets its order.
    pub fn close_session(&mut self, nexus: NexusId, out: &mut impl Sink<R>) {
        if self.order(nexus).is_some() {
            self.orders[nexus.index()] = None;
        }
        self.announcements.retain(|(n, _)| *n != nexus);
        if let Err(e) = self.device.close_nexus(nexus) {
            tracing::error!("closing a nexus: {e}");
        }
        self.drain(out);
    }

    /// ExpCmdSN and MaxCmdSN of the session `nexus`.
    pub fn window(&self, nexus: NexusId) -> Option<(SerialNumber, SerialNumber)> {
        self.order_of(nexus).map(CommandOrder::window)
    }

    /// How many requests of the session `nexus` wait for an earlier CmdSN.
    pub fn queued(&self, nexus: NexusId) -> usize {
        self.order_of(nexus).map_or(0, CommandOrder::waiting)
    }

    fn order_of(&self, nexus: NexusId) -> Option<&SessionOrder<R>> {
        match self.orders.get(nexus.index()) {
            Some(Some((n, order))) if *n == nexus => Some(order),
            _ => None,
        }
    }

    fn order(&mut self, nexus: NexusId) -> Option<&mut SessionOrder<R>> {
        match self.orders.get_mut(nexus.index()) {
            Some(Some((n, order))) if *n == nexus => Some(order),
            _ => None,
        }
    }

    /// Hands a SCSI command of the session `nexus` to the device in CmdSN order: an immediate
    /// command at once, others when every earlier CmdSN has arrived (on any connection). False
    /// when `cmd` is outside the window (RFC 7143 section 4.2.2.1 has it dropped).
    pub fn deliver(
        &mut self,
        nexus: NexusId,
        cmd: OrderedCommand,
        immediate: bool,
        route: &R,
        out: &mut impl Sink<R>,
    ) -> bool {
        if immediate {
            self.submit_ordered(nexus, &cmd, route, out);
            return true;
        }
        let Some(order) = self.order(nexus) else {
            return false;
        };
        if !order.admit(cmd.cmd_sn, Some((cmd, route.clone()))) {
            return false;
        }
        self.release(nexus, out);
        true
    }

    /// Takes a CmdSN of the session `nexus` for a request handled on arrival (NOP-Out, Text,
    /// Logout, task management). Returns whether it was inside the window.
    pub fn take_cmd_sn(
        &mut self,
        nexus: NexusId,
        cmd_sn: SerialNumber,
        out: &mut impl Sink<R>,
    ) -> bool {
        let Some(order) = self.order(nexus) else {
            return false;
        };
        if !order.admit(cmd_sn, None) {
            return false;
        }
        self.release(nexus, out);
        true
    }

    /// Drops the commands of connection `conn` (closed) still waiting for their CmdSN turn:
    /// they would reach the device with no connection to carry them out. Their numbers stay
    /// taken.
    pub fn cancel_queued(&mut self, nexus: NexusId, conn: u64) {
        if let Some(order) = self.order(nexus) {
            order.cancel(|(_, route)| route.connection() == conn);
        }
    }

    /// Submits queued commands while the next expected CmdSN is among them.
    fn release(&mut self, nexus: NexusId, out: &mut impl Sink<R>) {
        while let Some((cmd, route)) = self.order(nexus).and_then(CommandOrder::next_ready) {
            self.submit_ordered(nexus, &cmd, &route, out);
        }
    }

    fn submit_ordered(
        &mut self,
        nexus: NexusId,
        cmd: &OrderedCommand,
        route: &R,
        out: &mut impl Sink<R>,
    ) {
        if let Err(e) = self.submit(cmd.command(nexus), route, out) {
            tracing::error!("the SCSI core refused a command: {e}");
        }
    }

    /// Submits `cmd` for the connection `route`; what follows goes to `out`.
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

    /// Starts a task management function; its answer comes back as
    /// [`Action::TaskManagementDone`] with the returned reference.
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

    /// All the data-out the device asked of `task` has arrived.
    pub fn data_out(&mut self, task: TaskId, data: &[u8], out: &mut impl Sink<R>) {
        if let Err(e) = self.device.data_out(task, data) {
            tracing::warn!("data-out refused by the core: {e}");
        }
        self.drain(out);
    }

    /// A backend operation of `task` has ended.
    pub fn backend_done(
        &mut self,
        task: TaskId,
        result: Result<scsi_core::Output, scsi_core::BackendError>,
        out: &mut impl Sink<R>,
    ) {
        if let Err(e) = self.device.backend_done(task, result) {
            tracing::warn!("a backend completion refused by the core: {e}");
        }
        self.drain(out);
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

    /// Hands every pending action to `out`, addressed to the connection of its task.
    pub fn drain(&mut self, out: &mut impl Sink<R>) {
        while let Some(action) = self.device.poll() {
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
                    // Only nexuses that asked get these; one whose channel just went has
                    // its unit attention reported on its next command instead.
                    if let Some((_, route)) = self.announcements.iter().find(|(n, _)| n == nexus) {
                        out.push(route, CoreEvent::Action(action));
                    }
                    continue;
                }
                _ => None,
            };
            match routed {
                Some(route) => out.push(&route, CoreEvent::Action(action)),
                None => tracing::warn!(?action, "an action for a task without a connection"),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use scsi_core::{Geometry, Identity, Limits, LogicalUnit, TargetPort, TaskAttribute};

    #[derive(Default)]
    struct Queues(Vec<(u64, CoreEvent)>);

    impl Sink<u64> for Queues {
        fn push(&mut self, route: &u64, event: CoreEvent) {
            self.0.push((*route, event));
        }
    }

    fn core() -> TargetCore<u64> {
        let port = TargetPort::iscsi("iqn.2026-11.io.example:t", 1);
        let mut device = Device::new("iqn.2026-11.io.example:t", vec![port]);
        let unit = LogicalUnit {
            identity: Identity::new("T", "memory", "0001", b"t-lu0"),
            geometry: Geometry {
                block_size: 512,
                blocks: 64,
                thin: true,
                write_cache: true,
                read_only: false,
            },
            limits: Limits::default(),
        };
        device.add_lu(0, unit).expect("LUN 0 is free");
        TargetCore::new(device)
    }

    fn tur(itt: u32, cmd_sn: u32) -> OrderedCommand {
        OrderedCommand {
            cmd_sn: SerialNumber(cmd_sn),
            lun: 0,
            cdb: [0; 16],
            attribute: TaskAttribute::Simple,
            itt,
            data_in_len: 0,
            data_out_len: 0,
        }
    }

    #[test]
    fn commands_of_two_connections_run_in_cmd_sn_order_and_answer_where_they_came_from() {
        let mut c = core();
        let nexus = c.open_session(
            TransportId::iscsi("iqn.2026-11.io.example:i", [0x80, 0, 0, 0, 0, 1]),
            1,
            SerialNumber(10),
            8,
        );
        let mut out = Queues::default();
        // CmdSN 11 on connection 2 waits for 10, which comes on connection 1.
        assert!(c.deliver(nexus, tur(2, 11), false, &2, &mut out));
        assert!(out.0.is_empty(), "CmdSN 11 waits for 10");
        assert!(c.deliver(nexus, tur(1, 10), false, &1, &mut out));
        let submitted: Vec<(u64, u64)> = out
            .0
            .iter()
            .filter_map(|(r, e)| match e {
                CoreEvent::Submitted { tag, .. } => Some((*r, *tag)),
                CoreEvent::Action(_) => None,
            })
            .collect();
        assert_eq!(
            submitted,
            [(1, 1), (2, 2)],
            "in CmdSN order, each to its own"
        );
        for (route, e) in &out.0 {
            if let CoreEvent::Action(Action::Complete { tag, .. }) = e {
                assert_eq!(*route, *tag, "a task ends at the connection it came on");
            }
        }
        assert_eq!(c.window(nexus), Some((SerialNumber(12), SerialNumber(19))));
        // Outside the window, or a CmdSN taken twice: dropped.
        assert!(!c.deliver(nexus, tur(3, 30), false, &1, &mut out));
        assert!(!c.deliver(nexus, tur(3, 9), false, &1, &mut out));
    }

    #[test]
    fn a_closed_connections_queued_commands_never_reach_the_device() {
        let mut c = core();
        let id = TransportId::iscsi("iqn.2026-11.io.example:i", [0x80, 0, 0, 0, 0, 1]);
        let nexus = c.open_session(id, 1, SerialNumber(1), 8);
        let mut out = Queues::default();
        assert!(c.deliver(nexus, tur(7, 3), false, &2, &mut out));
        c.cancel_queued(nexus, 2);
        assert!(c.take_cmd_sn(nexus, SerialNumber(1), &mut out));
        assert!(c.deliver(nexus, tur(8, 2), false, &1, &mut out));
        let tags: Vec<u64> = out
            .0
            .iter()
            .filter_map(|(_, e)| match e {
                CoreEvent::Submitted { tag, .. } => Some(*tag),
                CoreEvent::Action(_) => None,
            })
            .collect();
        assert_eq!(tags, [8], "the cancelled command's number stays taken");
        assert_eq!(c.window(nexus).map(|w| w.0), Some(SerialNumber(4)));
        c.close_session(nexus, &mut out);
        assert_eq!(c.window(nexus), None);
    }
}
