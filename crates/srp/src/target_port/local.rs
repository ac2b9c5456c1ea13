//! An SRP target's device and channels in one place, for an embedder whose I/O runs every
//! channel from one thread (or under one lock), as `examples/fabric_target.rs` does on the
//! software fabric and the test rig does deterministically.
//!
//! [`LocalCore`] is scsi-core's [`Router`] with a queue per channel: each channel's
//! [`Channel`] is handed the [`Core`] that [`LocalCore::channel`] gives, and
//! what the device asks for lands in that channel's queue. [`VecBuffers`] is the
//! [`Buffers`] of a shell whose verbs carry plain vectors (the software fabric's). A daemon
//! that runs channels on several threads shares its router behind a lock and writes its own
//! [`Core`] and [`Buffers`] (targetd does, over registered arena slots).
//!
//! [`LocalPolicy`] is the [`LoginPolicy`] of such a target: one target port that anyone may
//! log in to, nexuses in the device.
//!
//! Channels are named by an index the embedder chooses, unique among live channels.

use std::collections::VecDeque;

use scsi_core::transport::{CoreEvent, Router, Sink, TaskBuffer};
use scsi_core::{
    Action, BackendError, Command, Device, DeviceError, NexusId, Output, TaskId, TmfFunction,
};

use super::channel::{Core, TaskCore};
use super::driver::Buffers;
use super::login::LoginPolicy;
use super::Channel;
use crate::iu::{LoginRejectReason, SrpLoginReq, TargetLogoutReason};
use rdma::verbs::Verbs;

/// Each channel's actions, by channel index.
#[derive(Debug, Default)]
struct Queues(Vec<VecDeque<Action>>);

impl Queues {
    fn queue(&mut self, ch: usize) -> &mut VecDeque<Action> {
        if self.0.len() <= ch {
            self.0.resize_with(ch + 1, VecDeque::new);
        }
        &mut self.0[ch]
    }
}

impl Sink<usize> for Queues {
    fn push(&mut self, ch: &usize, event: CoreEvent) {
        // A channel keeps no table of tags the device must confirm: only actions matter.
        if let CoreEvent::Action(a) = event {
            self.queue(*ch).push_back(a);
        }
    }
}

/// A target's device, the routes of its tasks to channels, and each channel's queue.
#[derive(Debug)]
pub struct LocalCore {
    router: Router<usize>,
    queues: Queues,
}

impl LocalCore {
    /// The core of `device`, with no channel yet.
    pub fn new(device: Device) -> LocalCore {
        LocalCore {
            router: Router::new(device),
            queues: Queues::default(),
        }
    }

    /// The device, to look at.
    pub fn device(&self) -> &Device {
        self.router.device()
    }

    /// Unit `lun` now has `blocks` blocks (an administrator's resize): the nexuses' unit
    /// attentions go to the channels that announce them.
    pub fn resize_unit(&mut self, lun: u16, blocks: u64) -> Result<(), DeviceError> {
        self.router.resize_unit(lun, blocks, &mut self.queues)
    }

    /// Routes what the device has pending to the channels.
    pub fn drain(&mut self) {
        self.router.drain(&mut self.queues);
    }

    /// Channel `ch` of `nexus`'s view of the core: the [`Core`] its machine is handed.
    pub fn channel(&mut self, ch: usize, nexus: NexusId) -> ChannelCore<'_> {
        ChannelCore {
            core: self,
            ch,
            nexus,
        }
    }

    /// Whether the device has asked something of channel `ch` that its machine has not taken
    /// ([`super::Channel::handle_core`] takes it).
    pub fn has_work(&self, ch: usize) -> bool {
        self.queues.0.get(ch).is_some_and(|q| !q.is_empty())
    }

    /// Has the unit attentions of `nexus` announced on channel `ch` (SRP_AER_REQ), or no
    /// longer (`None`).
    pub fn announce_to(&mut self, nexus: NexusId, ch: Option<usize>) -> Result<(), DeviceError> {
        self.router.announce_to(nexus, ch)
    }

    /// Logs channel `ch` out because a SINGLE CHANNEL login replaces it (SRP_T_LOGOUT,
    /// MULTI-CHANNEL ACTION): what a [`LocalPolicy`]'s `terminate` does.
    pub fn log_out_replaced<B: TaskBuffer>(&mut self, ch: usize, channel: &mut Channel<B>) {
        let mut core = self.channel(ch, channel.nexus());
        channel.terminate(TargetLogoutReason::MultiChannelAction, true, &mut core);
    }

    /// Closes `nexus` (its last channel has gone): its tasks are aborted, each abort routed to
    /// the channel that had the task.
    pub fn close_nexus(&mut self, nexus: NexusId) -> Result<(), DeviceError> {
        self.router.close_nexus(nexus, &mut self.queues)
    }
}

/// A channel among an embedder's, as [`LocalPolicy`] finds it: its machine.
pub trait LocalChannel {
    /// The machine's buffers.
    type Buffer: TaskBuffer;
    /// The channel's machine.
    fn machine(&mut self) -> &mut Channel<Self::Buffer>;
}

/// The [`LoginPolicy`] of a target on a [`LocalCore`]: one target port, which anyone may log in
/// to; each new I_T nexus opened in the device (relative port 1), a replaced one closed, and
/// the channels a SINGLE CHANNEL login replaces logged out
/// ([`LocalCore::log_out_replaced`]). `channels` are the embedder's, indexed by the channel
/// numbers the machine is told ([`super::Logins::connected`]).
#[derive(Debug)]
pub struct LocalPolicy<'a, C> {
    /// The core.
    pub core: &'a mut LocalCore,
    /// The target port's identifier: a login naming another is refused.
    pub target_port_id: [u8; 16],
    /// The channels, by number.
    pub channels: &'a mut [C],
}

impl<C: LocalChannel> LoginPolicy<usize> for LocalPolicy<'_, C> {
    type Target = ();

    fn target(&mut self, req: &SrpLoginReq) -> Result<(), (LoginRejectReason, &'static str)> {
        if req.target_port_id != self.target_port_id {
            let why = "no target has that target port identifier";
            return Err((LoginRejectReason::UnableToEstablishChannel, why));
        }
        Ok(())
    }

    fn open_nexus(&mut self, _: &(), req: &SrpLoginReq) -> NexusId {
        let initiator = scsi_core::TransportId::srp(req.initiator_port_id);
        self.core.router.open_nexus(initiator, 1)
    }

    fn close_nexus(&mut self, _: &(), nexus: NexusId) {
        // Stale only if closed already.
        let _ = self.core.close_nexus(nexus);
    }

    fn terminate(&mut self, ch: usize) {
        if let Some(c) = self.channels.get_mut(ch) {
            self.core.log_out_replaced(ch, c.machine());
        }
    }
}

/// The core as one channel reaches it ([`LocalCore::channel`]).
#[derive(Debug)]
pub struct ChannelCore<'a> {
    core: &'a mut LocalCore,
    ch: usize,
    nexus: NexusId,
}

impl ChannelCore<'_> {
    /// The core behind the view.
    pub fn core(&mut self) -> &mut LocalCore {
        self.core
    }
}

impl Core for ChannelCore<'_> {
    fn poll_core(&mut self) -> Option<Action> {
        self.core.queues.queue(self.ch).pop_front()
    }

    fn submit(&mut self, cmd: Command<'_>) -> Result<TaskId, DeviceError> {
        let c = &mut *self.core;
        c.router.submit(cmd, &self.ch, &mut c.queues)
    }
}

impl TaskCore for ChannelCore<'_> {
    fn data_out(&mut self, task: TaskId, data: &[u8]) {
        // A refusal is a task that ended meanwhile (aborted): nothing is owed for it.
        let c = &mut *self.core;
        let _ = c.router.data_out(task, data, &mut c.queues);
    }

    fn backend_done(&mut self, task: TaskId, result: Result<Output, BackendError>) {
        let c = &mut *self.core;
        let _ = c.router.backend_done(task, result, &mut c.queues);
    }

    fn retire(&mut self, task: TaskId) {
        let c = &mut *self.core;
        let _ = c.router.retire(task, &mut c.queues);
    }

    fn task_management(&mut self, lun: u64, function: TmfFunction) -> Option<u64> {
        let c = &mut *self.core;
        let route = &self.ch;
        let started = c
            .router
            .task_management(self.nexus, lun, function, route, &mut c.queues);
        started.ok()
    }

    fn block_size(&mut self, lun: u16) -> Option<u32> {
        let unit = self.core.router.device().logical_unit(lun);
        unit.map(|u| u.geometry.block_size)
    }
}

/// Vectors kept for reuse per channel.
const KEPT_BUFFERS: usize = 256;

/// The [`Buffers`] of a shell whose verbs carry `Vec<u8>` and whose tasks' buffers are
/// vectors too: IUs are copied into reused vectors, everything else passes as it is.
#[derive(Debug, Default)]
pub struct VecBuffers(Vec<Vec<u8>>);

impl<V: Verbs<Buffer = Vec<u8>>> Buffers<V, Vec<u8>> for VecBuffers {
    fn iu(&mut self, _: &mut V, iu: &[u8]) -> Option<Vec<u8>> {
        let mut b = self.0.pop().unwrap_or_default();
        b.clear();
        b.extend_from_slice(iu);
        Some(b)
    }

    fn data(&mut self, buffer: Vec<u8>) -> Vec<u8> {
        buffer
    }

    fn immediate(&mut self, len: usize) -> Option<Vec<u8>> {
        Some(vec![0; len])
    }

    fn task(&mut self, buffer: Vec<u8>) -> Option<Vec<u8>> {
        Some(buffer)
    }

    fn payload(&mut self, _: &mut V, bytes: Vec<u8>) -> Option<Vec<u8>> {
        Some(bytes)
    }

    fn table(&mut self, _: &mut V, len: usize) -> Option<Vec<u8>> {
        Some(vec![0; len])
    }

    fn recycle(&mut self, _: &mut V, buffer: Vec<u8>) {
        if self.0.len() < KEPT_BUFFERS {
            self.0.push(buffer);
        }
    }
}
