//! What the shell of every NVMe transport shares around a queue's machine: the subsystem a
//! Connect names found and the machine run with its lock ([`take_arrivals`]), and the machine
//! as the carrier reaches it ([`Link`]).

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Instant;

use backend::Buffer;
use nvme::connection::ControllerConnection;
use nvme::transport::Transport;
use scsi_core::transport::Accounting;
use scsi_core::{BackendError, Output, TaskId};

use crate::carrier::Carried;
use crate::registry::Registry;
use crate::unit::{CachedUnit, UnitCache};

use super::NvmeSubsystem;

/// Lets a connection's machine take what came, whatever its transport: the subsystem a
/// waiting Connect names is found first (a Connect naming none, or a command before any
/// Connect, is refused), then the machine runs with the subsystem's lock when it needs it:
/// something came, it is an admin queue (whose asynchronous events wait in the subsystem),
/// the subsystem said something waits for it (`poked`: a Preempt and Abort's), or the
/// machine has news for the subsystem.
pub fn take_arrivals<Q: Transport<Buffer>>(
    machine: &mut ControllerConnection<Buffer, Q>,
    subsystem: &mut Option<Arc<NvmeSubsystem>>,
    poked: &mut bool,
    registry: &Registry,
    peer: SocketAddr,
    now: Instant,
) {
    while subsystem.is_none() && machine.has_pending() {
        let Some(nqn) = machine.connect_nqn() else {
            machine.refuse_next();
            continue;
        };
        match registry.subsystem(&nqn) {
            Some(s) => *subsystem = Some(s),
            None => {
                registry.refused(peer, "-", &nqn, "no NVM subsystem has this NQN");
                machine.refuse_next();
            }
        }
    }
    let admin = machine.bound().is_some_and(|q| q.qid == 0);
    let wanted = admin || std::mem::take(poked) || machine.wants_subsystem();
    if let Some(s) = subsystem
        .as_deref()
        .filter(|_| wanted || machine.has_pending())
    {
        s.with_machine(|m| machine.handle(now, m));
    }
}

/// The machine and its subsystem as the carrier reaches them.
pub struct Link<'a, Q> {
    /// The queue's machine.
    pub machine: &'a mut ControllerConnection<Buffer, Q>,
    /// The subsystem its Connect named, once it did.
    pub subsystem: Option<&'a NvmeSubsystem>,
    /// The subsystem's namespaces as the queue last found them.
    pub units: &'a mut UnitCache<u32>,
}

/// The commands counted through the link reach their namespaces' counters when it goes: an
/// NVMe/TCP connection's link lives for one pass of its machine (a burst of commands), an
/// NVMe/RDMA queue's for one call.
impl<Q> Drop for Link<'_, Q> {
    fn drop(&mut self) {
        self.units.flush();
    }
}

impl<Q: Transport<Buffer>> Carried for Link<'_, Q> {
    fn account(&mut self, done: &Accounting) {
        if let Some(s) = self.subsystem {
            s.tally(self.units, done);
        }
    }

    fn unit(&mut self, lun: u16) -> Option<CachedUnit<'_>> {
        self.subsystem?.cached_namespace(self.units, u32::from(lun))
    }

    fn backend_done(
        &mut self,
        now: Instant,
        task: TaskId,
        buffer: Buffer,
        result: Result<Output, BackendError>,
    ) {
        self.machine.handle_backend_done(now, task, buffer, result);
    }

    fn buffer(&mut self, now: Instant, tag: u64, buffer: Option<Buffer>) {
        self.machine.handle_buffer(now, tag, buffer);
    }
}
