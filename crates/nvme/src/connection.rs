//! The controller's end of one NVMe-oF connection (one queue) with its commands carried out:
//! the transport's queue machine ([`Transport`]: NVMe/TCP's `ControllerQueue`, NVMe/RDMA's
//! `RdmaQueue`) joined to the subsystem ([`Subsystem`]) and to
//! the events every transport of this project hands its shell (scsi-core's
//! [`transport::Event`](scsi_core::transport::Event)): a buffer wanted, a block operation to
//! run on a namespace's storage, a command finished. A shell that carries SCSI transports'
//! events carries these the same way; what is NVMe's is here.
//!
//! A command's life: its capsule comes; Connect binds the connection to a queue of a
//! controller; an admin command is answered by the subsystem at once; an I/O command asks
//! for a buffer (its data, at most MDTS), then for a write the data in the capsule is copied
//! in or asked of the transport (an R2T over TCP, an RDMA READ over RDMA), then its block
//! operation runs, then a read's data goes out from the buffer itself (one C2HData over TCP,
//! with SUCCESS and no response capsule when the host disabled SQ flow control; an RDMA
//! WRITE over RDMA) and the completion follows. The subsystem is borrowed only
//! while commands arrive ([`ControllerConnection::handle`]): several connections (the queues
//! of one controller, and other controllers) share it behind the shell's lock, and a block
//! operation's end needs no lock.

use std::collections::{HashMap, VecDeque};
use std::hash::BuildHasherDefault;
use std::ops::DerefMut;
use std::time::Instant;

use bytes::Bytes;
use cmdtrace::{Points, Stage};
use scsi_core::transport::{Accounting, Event};
use scsi_core::{BackendError, Op, Output, TaskId};

use crate::controller::{Answer, Queue, Subsystem};
use crate::cqe::Cqe;
use crate::fabrics::{ConnectData, InvalidParameter};
use crate::nvm::{self, IoCommand, Transfer};
use crate::opcode::AdminOpcode;
use crate::opcode::NvmOpcode;
use crate::sqe::{Fuse, Sqe};
use crate::status::Status;
use crate::transport::{Arrival, CidHasher, CommandCapsule, Payload, Transport, WriteData};

/// What an I/O command does once its buffer (and data) are in.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Work {
    /// One block operation.
    Op(Op),
    /// Deallocations: the `ranges` are read from the data once it is in, then run in turn.
    Deallocate {
        ranges: u16,
        ops: Vec<Op>,
        next: usize,
    },
    /// A command the subsystem carries out once its data is in ([`Answer::Fetch`]).
    Fetch(Box<Sqe>),
    /// The first of a fused pair: its data goes into the second's operation.
    Fused,
}

/// Where an I/O command is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    /// Waiting for its buffer.
    Buffer,
    /// Waiting for the data an R2T asked for.
    Data,
    /// Its block operation runs.
    Backend,
    /// The first of a fused pair, its data in: it waits for the second's, and then rides
    /// on the second's block operation (Compare and Write).
    Fused,
}

/// An I/O command in flight.
#[derive(Debug)]
struct Command<B> {
    nsid: u32,
    /// The namespace's, when the command came (Dataset Management's ranges are checked
    /// against it).
    geometry: nvm::NamespaceGeometry,
    task: TaskId,
    arrived: Instant,
    work: Work,
    transfer: Transfer,
    /// Bytes of buffer it needs.
    len: usize,
    phase: Phase,
    buffer: Option<B>,
    /// In-capsule data, copied into the buffer once it comes.
    capsule: Bytes,
    /// Data bytes in so far.
    received: u32,
    /// Some data came with a bad digest: the command ends with Transient Transport Error
    /// once all of it is in.
    damaged: bool,
    /// A Preempt and Abort aborted it: it starts nothing more, and ends with Command Aborted
    /// due to Preempt and Abort.
    aborted: bool,
    /// Where its data goes in its buffer (the Write of a fused Compare and Write: after the
    /// Compare's blocks).
    data_at: usize,
    /// The other command of a fused pair, by CID.
    partner: Option<u16>,
}

impl<B> Command<B> {
    /// A command arrived at `arrived`, waiting for its buffer ([`ControllerConnection::admit`]
    /// gives it its task).
    fn new(
        arrived: Instant,
        nsid: u32,
        geometry: nvm::NamespaceGeometry,
        work: Work,
        transfer: Transfer,
        len: usize,
        capsule: Bytes,
    ) -> Command<B> {
        Command {
            nsid,
            geometry,
            task: TaskId::from_bits(0),
            arrived,
            work,
            transfer,
            len,
            phase: Phase::Buffer,
            buffer: None,
            capsule,
            received: 0,
            damaged: false,
            aborted: false,
            data_at: 0,
            partner: None,
        }
    }
}

/// The controller's end of one connection, with its commands carried out; `B` the shell's
/// buffers (the reactor's arena), `Q` the transport's queue machine.
#[derive(Debug)]
pub struct ControllerConnection<B, Q> {
    queue: Q,
    /// The queue Connect bound it to.
    bound: Option<Queue>,
    /// The SQ head pointer each completion reports: one past the last command taken.
    sqhd: u16,
    commands: HashMap<u16, Command<B>, BuildHasherDefault<CidHasher>>,
    /// Tells a stale backend completion from the current command of a reused CID.
    generation: u32,
    events: VecDeque<Event<B>>,
    /// Block operations running.
    in_backend: usize,
    /// The controller failed (keep alive expired): the connection closes.
    dropped: bool,
    /// Preempt and Abort commands (ID, NSID) whose aborted commands here still run.
    draining: Vec<(u64, u32)>,
    /// The first command of a fused pair, waiting for the second (the next command).
    fused_first: Option<(Sqe, Bytes)>,
    /// Each command's stages, while tracing ([`ControllerConnection::trace_points`]); the
    /// CID stands where iSCSI's ITT does.
    trace: Points,
    /// The `now` of the step in progress, for the trace points of a step.
    now: Option<Instant>,
    /// The local address the host reached (the shell's socket), for the discovery log.
    local_address: Option<std::net::IpAddr>,
    /// Set in each task's index beside its CID ([`ControllerConnection::set_task_space`]).
    task_space: u32,
}

impl<B: DerefMut<Target = [u8]>, Q: Transport<B>> ControllerConnection<B, Q> {
    /// A connection on transport queue `queue`.
    pub fn on(queue: Q) -> ControllerConnection<B, Q> {
        ControllerConnection {
            queue,
            bound: None,
            sqhd: 0,
            commands: HashMap::with_capacity_and_hasher(256, BuildHasherDefault::default()),
            generation: 0,
            events: VecDeque::with_capacity(64),
            in_backend: 0,
            dropped: false,
            draining: Vec::new(),
            fused_first: None,
            trace: Points::default(),
            now: None,
            local_address: None,
            task_space: 0,
        }
    }

    /// A connection on transport queue `queue` already bound to `bound` (a handed-over
    /// queue, [`crate::handover`]), the next completion reporting SQ head `sqhd`.
    pub fn bound_on(queue: Q, bound: Queue, sqhd: u16) -> ControllerConnection<B, Q> {
        let mut c = ControllerConnection::on(queue);
        c.bound = Some(bound);
        c.sqhd = sqhd;
        c
    }

    /// The queue it is bound to and its SQ head, once nothing is under way on it (no
    /// command in flight, no block operation, no event for the shell, no half pair, no
    /// Preempt and Abort waiting for it): what a handover carries of it.
    pub fn quiescent(&self) -> Result<(Queue, u16), crate::handover::Busy> {
        use crate::handover::Busy;
        let bound = self.bound.ok_or(Busy::NotConnected)?;
        if self.dropped {
            return Err(Busy::Dropped);
        }
        if !self.commands.is_empty() {
            return Err(Busy::InFlight(self.commands.len()));
        }
        if self.in_backend > 0 {
            return Err(Busy::InBackend(self.in_backend));
        }
        if !self.events.is_empty() {
            return Err(Busy::Events(self.events.len()));
        }
        if self.fused_first.is_some() {
            return Err(Busy::Fused);
        }
        if !self.draining.is_empty() {
            return Err(Busy::Draining);
        }
        Ok((bound, self.sqhd))
    }

    /// Tasks of this connection carry `space` beside their CID: connections whose backend
    /// operations end in one shared inbox (an RDMA port's) each take a space no other live
    /// one has, so no two of them hand out the same task.
    pub fn set_task_space(&mut self, space: u16) {
        self.task_space = u32::from(space) << 16;
    }

    /// The local address of the connection (the shell's socket): a discovery log entry for
    /// a port that listens on every address names this one.
    pub fn set_local_address(&mut self, address: std::net::IpAddr) {
        self.local_address = Some(address);
    }

    /// The commands' trace points (off until the shell turns them on): arrival, buffer wait,
    /// R2T, data in, block operation submitted and ended, response queued; a Keep Alive on
    /// the admin queue is the ping that dates the host's clock against ours.
    pub fn trace_points(&mut self) -> &mut Points {
        &mut self.trace
    }

    /// Notes that command `cid` reached `stage`, while tracing.
    fn trace(&mut self, stage: Stage, cid: u16, arg: u32) {
        if let Some(at) = self.now.filter(|_| self.trace.is_on()) {
            self.trace.push(at, stage, u32::from(cid), 0, arg);
        }
    }

    /// The queue the connection serves, once connected.
    pub fn bound(&self) -> Option<Queue> {
        self.bound
    }

    /// The transport's queue machine.
    pub fn transport(&self) -> &Q {
        &self.queue
    }

    /// The transport's queue machine, for what the transport takes itself (received
    /// capsules, RDMA completions).
    pub fn transport_mut(&mut self) -> &mut Q {
        &mut self.queue
    }

    /// Whether the connection is over: close it once the transmits are sent.
    pub fn is_over(&self) -> bool {
        self.dropped || self.queue.is_over()
    }

    /// I/O commands in flight.
    pub fn in_flight(&self) -> usize {
        self.commands.len()
    }

    /// Block operations running, whose ends the shell still owes.
    pub fn in_backend(&self) -> usize {
        self.in_backend
    }

    /// Takes the commands and data received, answering what the subsystem answers, and
    /// sends the asynchronous events waiting for this controller's admin queue.
    pub fn handle(&mut self, now: Instant, subsystem: &mut Subsystem) {
        self.now = Some(now);
        while let Some(a) = self.queue.poll_arrival() {
            match a {
                Arrival::Command(CommandCapsule {
                    sqe,
                    data,
                    data_digest_ok,
                }) => self.command(now, subsystem, sqe, data, data_digest_ok),
                Arrival::Data(WriteData {
                    cid,
                    offset,
                    data,
                    last,
                    data_digest_ok,
                }) => self.data(now, subsystem, cid, offset, &data, last, data_digest_ok),
                Arrival::Placed {
                    cid,
                    buffer,
                    placed,
                } => self.placed(now, subsystem, cid, buffer, placed),
                Arrival::Other => {}
            }
        }
        let Some(q) = self.bound else {
            return;
        };
        if q.qid == 0 {
            while let Some(cqe) = subsystem.poll_async_event(q.cntlid) {
                self.complete(cqe);
            }
            return;
        }
        while let Some(cqe) = subsystem.poll_completion(&q) {
            self.complete(cqe);
        }
        while let Some((id, nsid)) = subsystem.poll_abort(&q) {
            self.abort_namespace(now, nsid);
            self.draining.push((id, nsid));
        }
        let commands = &self.commands;
        self.draining.retain(|&(id, nsid)| {
            let running = commands
                .values()
                .any(|c| c.nsid == nsid && c.aborted && c.phase == Phase::Backend);
            if !running {
                subsystem.aborted(&q, id);
            }
            running
        });
    }

    /// Whether [`ControllerConnection::handle`] has something to tell the subsystem even when
    /// nothing came: the commands a Preempt and Abort aborted here have ended.
    pub fn wants_subsystem(&self) -> bool {
        !self.draining.is_empty()
    }

    /// Aborts this connection's commands on namespace `nsid` for a Preempt and Abort: those
    /// waiting for a buffer end now; those whose data an R2T asked for end once it is in
    /// (the host sends what it was asked); those whose block operation runs end with it.
    fn abort_namespace(&mut self, now: Instant, nsid: u32) {
        let mut now_ended = Vec::new();
        for (cid, c) in self.commands.iter_mut().filter(|(_, c)| c.nsid == nsid) {
            if matches!(c.work, Work::Fetch(_)) {
                continue;
            }
            c.aborted = true;
            if c.phase == Phase::Buffer {
                now_ended.push(*cid);
            }
        }
        for cid in now_ended {
            self.finish(now, cid, Status::ABORTED_PREEMPT);
        }
    }

    /// The subsystem NQN of the Connect waiting to be handled, while the connection has no
    /// queue yet: the shell finds that subsystem and hands it to
    /// [`ControllerConnection::handle`] (or refuses with
    /// [`ControllerConnection::refuse_next`] when it has none of that name). `None` once
    /// connected, or while no Connect waits.
    pub fn connect_nqn(&self) -> Option<String> {
        if self.bound.is_some() {
            return None;
        }
        let (sqe, data) = self.queue.peek_command()?;
        if sqe.opcode() != AdminOpcode::Fabrics.code() {
            return None;
        }
        ConnectData::parse(data).ok().map(|d| d.subnqn)
    }

    /// Whether something the host sent waits to be handled.
    pub fn has_pending(&self) -> bool {
        self.queue.has_arrival()
    }

    /// Takes what waits first without a subsystem (see [`ControllerConnection::connect_nqn`]):
    /// a Connect ends with Connect Invalid Parameters naming SUBNQN (no subsystem has that
    /// name), any other command with Command Sequence Error (nothing comes before Connect).
    pub fn refuse_next(&mut self) {
        if let Some(Arrival::Command(CommandCapsule { sqe, data, .. })) = self.queue.poll_arrival()
        {
            let connect =
                sqe.opcode() == AdminOpcode::Fabrics.code() && ConnectData::parse(&data).is_ok();
            if !connect {
                return self.complete(Cqe::new(sqe.cid(), Status::COMMAND_SEQUENCE_ERROR));
            }
            let (status, dw0) = InvalidParameter {
                in_data: true,
                offset: 256,
            }
            .completion();
            self.complete(Cqe {
                dw0,
                ..Cqe::new(sqe.cid(), status)
            });
        }
    }

    /// Time passed: keep alive is checked; a connection of a controller that failed (or is
    /// gone) is over.
    pub fn handle_timeout(&mut self, now: Instant, subsystem: &mut Subsystem) {
        self.now = Some(now);
        subsystem.handle_timeout(now);
        if let Some(q) = self.bound {
            if !subsystem.is_live(q.cntlid) {
                self.dropped = true;
            }
        }
    }

    /// The buffer command `tag` asked for ([`Event::BufferWanted`]); `None` when none can
    /// ever be had.
    pub fn handle_buffer(&mut self, now: Instant, tag: u64, buffer: Option<B>) {
        self.now = Some(now);
        let cid = tag as u16;
        let Some(c) = self.commands.get_mut(&cid) else {
            return;
        };
        if c.phase != Phase::Buffer {
            return;
        }
        // None, or shorter than asked (a shell that answered another request of this CID):
        // the command cannot run.
        let Some(mut buffer) = buffer.filter(|b| b.len() >= c.len) else {
            return self.finish(now, cid, Status::INTERNAL_ERROR);
        };
        match c.transfer {
            Transfer::FromHost {
                len,
                in_capsule: true,
            } => {
                let at = c.data_at.min(buffer.len());
                let n = (len as usize).min(c.capsule.len()).min(buffer.len() - at);
                buffer[at..at + n].copy_from_slice(&c.capsule[..n]);
                c.capsule = Bytes::new();
                c.buffer = Some(buffer);
                self.run(now, cid);
            }
            Transfer::FromHost { len, .. } => {
                c.phase = Phase::Data;
                let at = c.data_at;
                match self.queue.request_data(cid, len, buffer, at) {
                    Ok(kept) => {
                        if let Some(c) = self.commands.get_mut(&cid) {
                            c.buffer = kept;
                        }
                    }
                    Err(_) => return self.finish(now, cid, Status::INTERNAL_ERROR),
                }
                self.trace(Stage::R2tSent, cid, len);
            }
            Transfer::None | Transfer::ToHost { .. } => {
                c.buffer = Some(buffer);
                self.run(now, cid);
            }
        }
    }

    /// The end of the block operation of `task`, with its buffer.
    pub fn handle_backend_done(
        &mut self,
        now: Instant,
        task: TaskId,
        buffer: B,
        result: Result<Output, BackendError>,
    ) {
        self.now = Some(now);
        let cid = task.to_bits() as u16;
        if !self
            .commands
            .get(&cid)
            .is_some_and(|c| c.task == task && c.phase == Phase::Backend)
        {
            return;
        }
        self.trace(Stage::BackendDone, cid, 0);
        let Some(c) = self.commands.get_mut(&cid) else {
            return;
        };
        self.in_backend -= 1;
        c.buffer = Some(buffer);
        if c.aborted {
            return self.finish(now, cid, Status::ABORTED_PREEMPT);
        }
        if let Some(first) = c.partner {
            // A fused Compare and Write: the Compare ends with the comparison, the Write
            // with the write, which a miscompare or an error kept from happening.
            let (compare, write) = match result {
                Ok(_) => (Status::SUCCESS, Status::SUCCESS),
                Err(BackendError::Miscompare { .. }) => {
                    (Status::COMPARE_FAILURE, Status::ABORTED_FAILED_FUSED)
                }
                Err(e) => (Status::of_backend(e), Status::ABORTED_FAILED_FUSED),
            };
            if let Some(f) = self.commands.get_mut(&first) {
                f.partner = None;
            }
            self.finish(now, first, compare);
            if let Some(c) = self.commands.get_mut(&cid) {
                c.partner = None;
            }
            return self.finish(now, cid, write);
        }
        if let Err(e) = result {
            return self.finish(now, cid, Status::of_backend(e));
        }
        if let Work::Deallocate { ops, next, .. } = &mut c.work {
            *next += 1;
            // A closed connection starts nothing more: its shell waits only for what runs.
            if *next < ops.len() && !self.dropped {
                return self.run(now, cid);
            }
        }
        if let Transfer::ToHost { len } = c.transfer {
            let quiet =
                Q::DATA_CARRIES_SUCCESS && self.bound.is_some_and(|q| q.sq_flow_control_disabled);
            let Some(buffer) = c.buffer.take() else {
                return self.finish(now, cid, Status::INTERNAL_ERROR);
            };
            let data = Payload::Buffer {
                buffer,
                len: len as usize,
            };
            if self.queue.send_data(cid, data, quiet).is_err() {
                return self.finish(now, cid, Status::INTERNAL_ERROR);
            }
            if quiet {
                self.trace(Stage::Responded, cid, len);
                return self.retire(now, cid, false);
            }
        }
        self.finish(now, cid, Status::SUCCESS)
    }

    /// The next event for the shell.
    pub fn poll_event(&mut self) -> Option<Event<B>> {
        self.events.pop_front()
    }

    /// The connection is gone: the commands waiting for a buffer or data are dropped, and
    /// its queue leaves its controller (the admin queue takes the controller with it) once no
    /// block operation of it runs. Those still running end in
    /// [`ControllerConnection::handle_backend_done`] as usual; the shell waits for them
    /// ([`ControllerConnection::in_backend`]) before it frees what they use, and then calls
    /// this again (or [`ControllerConnection::abandon`] when it waits no longer). So a
    /// Preempt and Abort that waits for this queue's commands is answered only after its last
    /// write has ended, even when the connection closed first.
    pub fn close(&mut self, subsystem: &mut Subsystem) {
        self.commands.retain(|_, c| c.phase == Phase::Backend);
        self.fused_first = None;
        self.dropped = true;
        if self.in_backend == 0 {
            self.abandon(subsystem);
        }
    }

    /// The queue leaves its controller now, whatever still runs (the shell gave up waiting).
    pub fn abandon(&mut self, subsystem: &mut Subsystem) {
        if let Some(q) = self.bound.take() {
            subsystem.disconnect(&q);
        }
        self.dropped = true;
    }

    /// A command capsule.
    fn command(
        &mut self,
        now: Instant,
        subsystem: &mut Subsystem,
        sqe: Sqe,
        data: Bytes,
        data_digest_ok: bool,
    ) {
        let cid = sqe.cid();
        if let Some(q) = self.bound {
            self.sqhd = ((u32::from(self.sqhd) + 1) % q.size.max(1)) as u16;
        }
        if !data_digest_ok {
            return self.complete(Cqe::new(cid, Status::TRANSIENT_TRANSPORT_ERROR));
        }
        let Some(bound) = self.bound else {
            match subsystem.connect(now, &sqe, &data) {
                Ok((q, cqe)) => {
                    if let Some(a) = self.local_address.filter(|_| q.qid == 0) {
                        subsystem.set_reached_address(q.cntlid, a);
                    }
                    self.bound = Some(q);
                    self.sqhd = 1 % q.size.max(1) as u16;
                    self.complete(cqe);
                }
                Err(cqe) => self.complete(cqe),
            }
            return;
        };
        let stage = if bound.qid == 0 && sqe.opcode() == AdminOpcode::KeepAlive.code() {
            Stage::NopReceived
        } else {
            Stage::Received
        };
        self.trace(stage, cid, sqe.sgl().length());
        if self.commands.contains_key(&cid) {
            return self.complete(Cqe::new(cid, Status::COMMAND_ID_CONFLICT));
        }
        // A fused pair is two commands one after the other: the first waits for the second;
        // anything else in between leaves it without its partner.
        match sqe.fuse() {
            Fuse::Normal => {}
            Fuse::Reserved => return self.complete(Cqe::new(cid, Status::INVALID_FIELD)),
            Fuse::First => {
                self.missing_fused();
                if bound.qid == 0 {
                    return self.complete(Cqe::new(cid, Status::INVALID_FIELD));
                }
                self.fused_first = Some((sqe, data));
                return;
            }
            Fuse::Second => {
                let Some((first, first_data)) = self.fused_first.take() else {
                    return self.complete(Cqe::new(cid, Status::ABORTED_MISSING_FUSED));
                };
                return self.fused(now, subsystem, &bound, (first, first_data), (sqe, data));
            }
        }
        self.missing_fused();
        match subsystem.command(now, &bound, &sqe, &data) {
            Answer::Fetch { len } => {
                let geometry = nvm::NamespaceGeometry {
                    block_size: 512,
                    blocks: 0,
                    read_only: true,
                };
                let transfer = Transfer::FromHost {
                    len,
                    in_capsule: false,
                };
                let work = Work::Fetch(Box::new(sqe));
                let c = Command::new(
                    now,
                    sqe.nsid(),
                    geometry,
                    work,
                    transfer,
                    len as usize,
                    Bytes::new(),
                );
                self.admit(cid, c);
            }
            answer @ (Answer::Complete(_) | Answer::Data { .. } | Answer::Held) => {
                self.answer(cid, answer)
            }
            Answer::Io { nsid, command } => {
                let Some(ns) = subsystem.namespace(nsid) else {
                    return self.complete(Cqe::new(cid, Status::INVALID_NAMESPACE));
                };
                let geometry = ns.geometry;
                let bs = geometry.block_size;
                let (work, transfer, len) = match command {
                    IoCommand::Op { op, transfer } => {
                        let len = op.buffer_len(bs) as usize;
                        (Work::Op(op), transfer, len)
                    }
                    IoCommand::Deallocate { ranges, transfer } => {
                        let len = match transfer {
                            Transfer::FromHost { len, .. } => len as usize,
                            _ => 0,
                        };
                        let work = Work::Deallocate {
                            ranges,
                            ops: Vec::new(),
                            next: 0,
                        };
                        (work, transfer, len.max(usize::from(ranges) * 16))
                    }
                    IoCommand::Nothing => {
                        return self.complete(Cqe::new(cid, Status::SUCCESS));
                    }
                };
                // In-capsule data must be as long as its SGL says: a shorter capsule would
                // leave the rest of the buffer, another command's bytes, to be written.
                if let Transfer::FromHost {
                    len: want,
                    in_capsule: true,
                } = transfer
                {
                    if data.len() != want as usize {
                        return self.complete(Cqe::new(cid, Status::DATA_SGL_LENGTH_INVALID));
                    }
                }
                let c = Command::new(now, nsid, geometry, work, transfer, len, data);
                self.admit(cid, c);
            }
        }
    }

    /// Takes command `c` in as `cid`: it gets its task and asks for its buffer.
    fn admit(&mut self, cid: u16, mut c: Command<B>) {
        self.generation = self.generation.wrapping_add(1);
        c.task = TaskId::from_bits(
            u64::from(self.generation) << 32 | u64::from(self.task_space | u32::from(cid)),
        );
        self.events.push_back(Event::BufferWanted {
            tag: u64::from(cid),
            len: c.len,
        });
        let len = c.len as u32;
        self.commands.insert(cid, c);
        self.trace(Stage::BufferWait, cid, len);
    }

    /// Sends what the subsystem answered command `cid` with (not an I/O command).
    fn answer(&mut self, cid: u16, answer: Answer) {
        match answer {
            Answer::Complete(cqe) => self.complete(cqe),
            Answer::Data { data, cqe } => {
                if self.queue.send_data(cid, data.into(), false).is_err() {
                    return self.complete(Cqe::new(cid, Status::INTERNAL_ERROR));
                }
                self.complete(cqe);
            }
            Answer::Held => {}
            // Neither comes for a command the subsystem carries out itself.
            Answer::Fetch { .. } | Answer::Io { .. } => {
                self.complete(Cqe::new(cid, Status::INTERNAL_ERROR))
            }
        }
    }

    /// Data of a write, answering an R2T.
    #[allow(clippy::too_many_arguments)]
    fn data(
        &mut self,
        now: Instant,
        subsystem: &mut Subsystem,
        cid: u16,
        offset: u32,
        data: &[u8],
        last: bool,
        digest_ok: bool,
    ) {
        let Some(c) = self.commands.get_mut(&cid) else {
            return;
        };
        if c.phase != Phase::Data {
            return;
        }
        let at = c.data_at + offset as usize;
        // The queue checked the range against the R2T, which asked for the command's data.
        if let Some(dst) = c
            .buffer
            .as_mut()
            .and_then(|b| b.get_mut(at..at + data.len()))
        {
            dst.copy_from_slice(data);
        }
        c.received = c.received.saturating_add(data.len() as u32);
        c.damaged |= !digest_ok;
        if last {
            self.data_in(now, subsystem, cid);
        }
    }

    /// Command `cid`'s buffer back from the transport, its data in place unless `placed` is
    /// false.
    fn placed(
        &mut self,
        now: Instant,
        subsystem: &mut Subsystem,
        cid: u16,
        buffer: B,
        placed: bool,
    ) {
        let Some(c) = self.commands.get_mut(&cid) else {
            return;
        };
        if c.phase != Phase::Data || c.buffer.is_some() {
            return;
        }
        c.buffer = Some(buffer);
        c.damaged |= !placed;
        self.data_in(now, subsystem, cid);
    }

    /// All of command `cid`'s data is in: it runs (or ends, damaged or aborted).
    fn data_in(&mut self, now: Instant, subsystem: &mut Subsystem, cid: u16) {
        self.trace(Stage::DataOutDone, cid, 0);
        let Some(c) = self.commands.get_mut(&cid) else {
            return;
        };
        if c.damaged {
            return self.finish(now, cid, Status::TRANSIENT_TRANSPORT_ERROR);
        }
        if c.aborted {
            return self.finish(now, cid, Status::ABORTED_PREEMPT);
        }
        if let Work::Fetch(_) = c.work {
            return self.fetched(cid, subsystem);
        }
        self.run(now, cid);
    }

    /// Hands command `cid`'s data, now in, to the subsystem, which carries it out.
    fn fetched(&mut self, cid: u16, subsystem: &mut Subsystem) {
        let (Some(c), Some(q)) = (self.commands.remove(&cid), self.bound) else {
            return;
        };
        let Work::Fetch(sqe) = &c.work else {
            return;
        };
        let data = c
            .buffer
            .as_deref()
            .map_or(&[][..], |b| &b[..c.len.min(b.len())]);
        let answer = subsystem.fetched(&q, sqe, data);
        self.answer(cid, answer);
    }

    /// Runs command `cid`'s (next) block operation, its buffer and data in.
    fn run(&mut self, now: Instant, cid: u16) {
        let Some(c) = self.commands.get_mut(&cid) else {
            return;
        };
        if let Some(p) = c.partner {
            // A fused pair starts once both commands' data is in: the first's is copied in
            // front of the second's, and the second's operation runs.
            c.phase = Phase::Fused;
            let first_second = if matches!(c.work, Work::Fused) {
                (cid, p)
            } else {
                (p, cid)
            };
            let ready = |x: Option<&Command<B>>| x.is_some_and(|x| x.phase == Phase::Fused);
            if !(ready(self.commands.get(&first_second.0))
                && ready(self.commands.get(&first_second.1)))
            {
                return;
            }
            let (f, w) = first_second;
            let Some(fb) = self.commands.get_mut(&f).and_then(|x| x.buffer.take()) else {
                return self.finish(now, f, Status::INTERNAL_ERROR);
            };
            let Some(c) = self.commands.get_mut(&w) else {
                return;
            };
            let n = c.data_at;
            if let Some(wb) = c.buffer.as_mut() {
                wb[..n].copy_from_slice(&fb[..n]);
            }
            drop(fb);
            c.phase = Phase::Data;
            return self.start(now, w);
        }
        self.start(now, cid);
    }

    /// Hands command `cid`'s (next) block operation to the shell.
    fn start(&mut self, now: Instant, cid: u16) {
        let Some(c) = self.commands.get_mut(&cid) else {
            return;
        };
        let op = match &mut c.work {
            Work::Op(op) => *op,
            Work::Fused => return self.finish(now, cid, Status::INTERNAL_ERROR),
            Work::Fetch(_) => return self.finish(now, cid, Status::INTERNAL_ERROR),
            Work::Deallocate { ranges, ops, next } => {
                if *next == 0 && ops.is_empty() {
                    let len = (usize::from(*ranges) * 16).min(c.len);
                    let data = c.buffer.as_deref().map(|b| &b[..len.min(b.len())]);
                    match nvm::dsm_ranges(data.unwrap_or_default(), &c.geometry) {
                        Ok(found) => *ops = found,
                        Err(s) => return self.finish(now, cid, s),
                    }
                    if ops.is_empty() {
                        return self.finish(now, cid, Status::SUCCESS);
                    }
                }
                ops[*next]
            }
        };
        let Some(buffer) = c.buffer.take() else {
            return self.finish(now, cid, Status::INTERNAL_ERROR);
        };
        c.phase = Phase::Backend;
        self.in_backend += 1;
        let len = buffer.len() as u32;
        self.events.push_back(Event::Backend {
            task: c.task,
            lun: c.nsid as u16,
            op,
            buffer,
        });
        self.trace(Stage::BackendSubmit, cid, len);
    }

    /// Ends I/O command `cid` with `status`; the other of a fused pair, which cannot run
    /// without it, ends with Command Aborted due to Failed Fused Command.
    fn finish(&mut self, now: Instant, cid: u16, status: Status) {
        let Some(c) = self.commands.get_mut(&cid) else {
            // Ended already (the other of a fused pair both were ending).
            return;
        };
        let partner = c.partner.take();
        self.complete(Cqe::new(cid, status));
        self.retire(now, cid, !status.is_success());
        if let Some(p) = partner {
            if let Some(c) = self.commands.get_mut(&p) {
                c.partner = None;
                if c.phase == Phase::Backend {
                    // It runs (it cannot be recalled): it ends with its operation.
                    c.aborted = true;
                    return;
                }
            }
            self.finish(now, p, Status::ABORTED_FAILED_FUSED);
        }
    }

    /// A fused first command waiting for its second gets none: it ends with Command Aborted
    /// due to Missing Fused Command.
    fn missing_fused(&mut self) {
        if let Some((first, _)) = self.fused_first.take() {
            self.complete(Cqe::new(first.cid(), Status::ABORTED_MISSING_FUSED));
        }
    }

    /// A fused pair, Compare then Write of the same blocks: carried out as one Compare and
    /// Write on the storage (atomic there: the namespace says up to how many blocks), the
    /// Write's buffer holding both commands' data. Any other pair, or one the namespace cannot
    /// do, is refused: Invalid Field for the first, Command Aborted due to Failed Fused
    /// Command for the second.
    fn fused(
        &mut self,
        now: Instant,
        subsystem: &mut Subsystem,
        bound: &Queue,
        (first, first_data): (Sqe, Bytes),
        (second, data): (Sqe, Bytes),
    ) {
        let (fcid, cid) = (first.cid(), second.cid());
        let refuse = |me: &mut Self, a: Status, b: Status| {
            me.complete(Cqe::new(fcid, a));
            me.complete(Cqe::new(cid, b));
        };
        if fcid == cid {
            return refuse(
                self,
                Status::ABORTED_MISSING_FUSED,
                Status::COMMAND_ID_CONFLICT,
            );
        }
        let same = first.opcode() == NvmOpcode::Compare.code()
            && second.opcode() == NvmOpcode::Write.code()
            && first.nsid() == second.nsid()
            && first.qword(10) == second.qword(10)
            && first.cdw(12) & 0xffff == second.cdw(12) & 0xffff;
        let unit = subsystem
            .namespace(first.nsid())
            .map_or(0, |n| n.compare_and_write);
        let blocks = (first.cdw(12) & 0xffff) + 1;
        if !same || blocks > u32::from(unit) {
            return refuse(self, Status::INVALID_FIELD, Status::ABORTED_FAILED_FUSED);
        }
        // Each checked as the subsystem checks any command (namespace, range, reservation).
        let a = subsystem.command(now, bound, &first, &first_data);
        let b = subsystem.command(now, bound, &second, &data);
        let (
            Answer::Io {
                nsid,
                command:
                    IoCommand::Op {
                        op: Op::Compare { lba, .. },
                        transfer: compare_transfer,
                    },
            },
            Answer::Io {
                command:
                    IoCommand::Op {
                        op: Op::Write { fua, .. },
                        transfer,
                    },
                ..
            },
        ) = (&a, &b)
        else {
            let status = |x: &Answer| match x {
                Answer::Complete(c) => c.status,
                _ => Status::INVALID_FIELD,
            };
            let (sa, sb) = (status(&a), status(&b));
            return match (a, b) {
                (Answer::Complete(_), _) => refuse(self, sa, Status::ABORTED_FAILED_FUSED),
                _ => refuse(self, Status::ABORTED_FAILED_FUSED, sb),
            };
        };
        let Some(ns) = subsystem.namespace(*nsid) else {
            return refuse(
                self,
                Status::INVALID_NAMESPACE,
                Status::ABORTED_FAILED_FUSED,
            );
        };
        let geometry = ns.geometry;
        let n = (blocks * geometry.block_size) as usize;
        // In-capsule data must be as long as its SGL says (as for any write).
        for (t, capsule) in [(compare_transfer, &first_data), (transfer, &data)] {
            if let Transfer::FromHost {
                len: want,
                in_capsule: true,
            } = t
            {
                if capsule.len() != *want as usize {
                    return refuse(
                        self,
                        Status::DATA_SGL_LENGTH_INVALID,
                        Status::ABORTED_FAILED_FUSED,
                    );
                }
            }
        }
        for (c, t, len, at, work, capsule, partner) in [
            (fcid, *compare_transfer, n, 0, None, first_data, cid),
            (
                cid,
                *transfer,
                2 * n,
                n,
                Some(Op::CompareAndWrite {
                    lba: *lba,
                    blocks,
                    fua: *fua,
                }),
                data,
                fcid,
            ),
        ] {
            // The first rides on the second's operation.
            let work = work.map_or(Work::Fused, Work::Op);
            let command = Command {
                data_at: at,
                partner: Some(partner),
                ..Command::new(now, *nsid, geometry, work, t, len, capsule)
            };
            self.admit(c, command);
        }
    }

    /// Forgets I/O command `cid` (its completion sent) and counts it.
    fn retire(&mut self, now: Instant, cid: u16, error: bool) {
        let Some(c) = self.commands.remove(&cid) else {
            return;
        };
        let moved = |t| match (t, &c.work) {
            (true, Work::Op(Op::Read { .. })) => c.len as u64,
            (false, Work::Op(Op::Write { .. })) => c.len as u64,
            (false, Work::Op(Op::CompareAndWrite { .. })) => c.len as u64 / 2,
            _ => 0,
        };
        self.events.push_back(Event::Completed(Accounting {
            lun: u64::from(c.nsid),
            read_bytes: if error { 0 } else { moved(true) },
            write_bytes: if error { 0 } else { moved(false) },
            latency: now.saturating_duration_since(c.arrived),
            error,
        }));
    }

    /// Sends `cqe`, with this queue's SQ head pointer and ID.
    fn complete(&mut self, cqe: Cqe) {
        if self.trace.is_on() {
            // A read's data went out just before its completion.
            let data = self
                .commands
                .get(&cqe.cid)
                .filter(|_| cqe.status.is_success())
                .map_or(0, |c| match c.transfer {
                    Transfer::ToHost { len } => len,
                    _ => 0,
                });
            self.trace(Stage::Responded, cqe.cid, data);
        }
        let cqe = Cqe {
            sqhd: self.sqhd,
            sqid: self.bound.map_or(0, |q| q.qid),
            ..cqe
        };
        let _ = self.queue.complete(cqe);
    }
}
