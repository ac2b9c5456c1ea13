//! A target's SCSI core as its iSCSI connections share it: scsi-core's [`Router`] (the device
//! and the route of every task back to the connection that carries it out) and the CmdSN
//! order of each session (RFC 7143 section 4.2.2.1, which holds across all of a session's
//! connections).
//!
//! A session with several connections (MC/S) hands the device commands that arrived on any of
//! them, in CmdSN order; what the device then asks for must reach the connection the task
//! came on. [`TargetCore`] orders, the router routes, without locks or I/O: the caller passes
//! a [`Sink`] that takes `(route, event)` values, and decides how they travel.

use scsi_core::transport::Router;
use scsi_core::{Device, NexusId, TransportId};

pub use scsi_core::transport::{CoreEvent, Sink};

use super::connection::OrderedCommand;
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

/// A session's CmdSN order: its commands wait with the route of the connection they came on.
type SessionOrder<R> = CommandOrder<(OrderedCommand, R)>;

/// The SCSI device of a target, the routes of its tasks ([`Router`]: everything but CmdSN
/// order goes through [`TargetCore::router`]) and the CmdSN order of its sessions.
#[derive(Debug)]
pub struct TargetCore<R> {
    router: Router<R>,
    /// Each session's CmdSN window and the commands waiting for their turn, by its I_T
    /// nexus's index.
    orders: Vec<Option<(NexusId, SessionOrder<R>)>>,
}

impl<R: Route> TargetCore<R> {
    /// The core of `device`, with no session yet.
    pub fn new(device: Device) -> TargetCore<R> {
        TargetCore {
            router: Router::new(device),
            orders: Vec::new(),
        }
    }

    /// The router: every call on the device but a command's submission, which CmdSN order
    /// makes (see [`TargetCore::deliver`]).
    pub fn router(&mut self) -> &mut Router<R> {
        &mut self.router
    }

    /// The device, to look at.
    pub fn device(&self) -> &Device {
        self.router.device()
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
        let nexus = self.router.open_nexus(initiator, relative_port);
        self.order_from(nexus, cmd_sn, window);
        nexus
    }

    /// Starts the CmdSN order of the session of `nexus` at `cmd_sn`.
    fn order_from(&mut self, nexus: NexusId, cmd_sn: SerialNumber, window: u32) {
        let i = nexus.index();
        if self.orders.len() <= i {
            self.orders.resize_with(i + 1, || None);
        }
        self.orders[i] = Some((nexus, CommandOrder::new(cmd_sn, window)));
    }

    /// Opens a session handed over from another process ([`crate::handover`]): its nexus
    /// with the unit attentions pending there (not POWER ON, RESET), its CmdSN order going on
    /// from ExpCmdSN `exp_cmd_sn` with the same window.
    pub fn adopt_session(
        &mut self,
        initiator: TransportId,
        relative_port: u16,
        exp_cmd_sn: SerialNumber,
        window: u32,
        unit_attentions: Vec<(u16, scsi_core::Asc)>,
    ) -> NexusId {
        let nexus = self
            .router
            .adopt_nexus(initiator, relative_port, unit_attentions);
        self.order_from(nexus, exp_cmd_sn, window);
        nexus
    }

    /// Closes a session's nexus (its tasks are aborted) and forgets its order.
    pub fn close_session(&mut self, nexus: NexusId, out: &mut impl Sink<R>) {
        if self.order(nexus).is_some() {
            self.orders[nexus.index()] = None;
        }
        if let Err(e) = self.router.close_nexus(nexus, out) {
            tracing::error!("closing a nexus: {e}");
        }
    }

    /// ExpCmdSN and MaxCmdSN of the session `nexus`.
    pub fn window(&self, nexus: NexusId) -> Option<(SerialNumber, SerialNumber)> {
        self.order_of(nexus).map(CommandOrder::window)
    }

    /// How many requests of the session `nexus` wait for an earlier CmdSN.
    pub fn queued(&self, nexus: NexusId) -> usize {
        self.order_of(nexus).map_or(0, CommandOrder::waiting)
    }

    /// The highest CmdSN the session `nexus` has taken ([`CommandOrder::highest_taken`]).
    pub fn highest_taken(&self, nexus: NexusId) -> Option<SerialNumber> {
        self.order_of(nexus).map(CommandOrder::highest_taken)
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
        // In turn with nothing waiting: straight to the device, neither queued nor its route
        // cloned (nothing waits, so nothing is released after it).
        if order.take_next(cmd.cmd_sn) {
            self.submit_ordered(nexus, &cmd, route, out);
            return true;
        }
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
        if let Err(e) = self.router.submit(cmd.command(nexus), route, out) {
            tracing::error!("the SCSI core refused a command: {e}");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use scsi_core::{Action, Geometry, Identity, Limits, LogicalUnit, TargetPort, TaskAttribute};

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
