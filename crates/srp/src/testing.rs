//! A rig that runs SRP target channels against simple initiators over the software
//! [`Fabric`], with memory logical units, deterministically: what the tests, the fuzz target
//! and the experiments drive. The target's side is the real [`Channel`] and login code; the
//! rig is its shell (receives, RDMA, backend operations, buffers), as targetd's is on real
//! hardware. The initiator's side is small: it builds SRP_CMDs over its registered memory,
//! counts credits and records responses.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use scsi_core::{
    BackendError, Device, Geometry, Identity, Limits, LogicalUnit, MemoryBackend, NexusId, Op,
    Output, Residual, TargetPort, TaskId,
};

pub use crate::initiator::Registration;
use crate::initiator::{DataMemory, ExposeError};
use crate::iu::{
    BufferFormats, DataBufferDescriptor, Iu, MultiChannelAction, SrpAerRsp, SrpCmd, SrpCredRsp,
    SrpILogout, SrpLoginRej, SrpLoginReq, SrpLoginRsp, SrpTskMgmt, TargetLogoutReason,
    TaskAttribute, TaskManagementFunction,
};
use crate::target_port::channel::SPARE_RECEIVES;
use crate::target_port::{
    Channel, ChannelCore, Driver, Event, ItNexusKey, Left, LocalChannel, LocalCore, LocalPolicy,
    Logins, PortSettings, VecBuffers,
};
pub use rdma::fabric::PAPER_004_COSTS;
use rdma::fabric::{Access, Fabric, MemoryId, NodeId, Port, QpId};
use rdma::verbs::{Completion, Verbs, WorkOp};

/// The target's node.
pub const TARGET: NodeId = NodeId(0);
/// The initiators' node.
pub const INITIATOR: NodeId = NodeId(1);
/// The rig's target port identifier.
pub const TARGET_PORT: [u8; 16] = *b"srp-target-port0";

/// Runs a backend operation on unit `lun`'s memory (a unit that is gone fails it).
fn execute(
    backends: &mut HashMap<u16, MemoryBackend>,
    lun: u16,
    op: &Op,
    buffer: &mut [u8],
) -> Result<Output, BackendError> {
    match backends.get_mut(&lun) {
        Some(b) => b.execute(op, buffer),
        None => Err(BackendError::Internal),
    }
}

/// A command as a rig's initiator sends it.
#[derive(Debug, Clone, Default)]
pub struct Cmd {
    /// Its tag.
    pub tag: u64,
    /// The 8-byte LUN field.
    pub lun: u64,
    /// The CDB.
    pub cdb: Vec<u8>,
    /// Data-out to send.
    pub data_out: Option<Vec<u8>>,
    /// Bytes of data-in expected.
    pub data_in: u32,
    /// Regions the data buffer is cut into (each registered apart, as discrete pages are):
    /// 1 is a direct descriptor, more an indirect one.
    pub regions: usize,
    /// Put only the first descriptor in the IU: the target fetches the table.
    pub partial: bool,
    /// Task attribute.
    pub attribute: TaskAttribute,
}

/// One block I/O of [`Rig::closed_loop`]: a READ, or a WRITE of `data`.
#[derive(Debug, Clone, Default)]
pub struct BlockIo {
    /// First block.
    pub lba: u64,
    /// Blocks.
    pub blocks: u32,
    /// The data of a WRITE; none for a READ.
    pub data: Option<Vec<u8>>,
    /// The caller's own mark, handed back with the I/O when it ends.
    pub cookie: u64,
}

/// What a rig's initiator received for a request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Response {
    /// STATUS.
    pub status: u8,
    /// Sense data.
    pub sense: Vec<u8>,
    /// Response data (task management).
    pub response_data: Vec<u8>,
    /// Data-in residual.
    pub data_in_residual: Residual,
    /// Data-out residual.
    pub data_out_residual: Residual,
    /// The data-in that reached the initiator's regions.
    pub data: Vec<u8>,
    /// The credit it gave back.
    pub req_lim_delta: u32,
}

impl Response {
    /// Sense key, ASC and ASCQ (fixed format).
    pub fn sense_code(&self) -> Option<(u8, u8, u8)> {
        (self.sense.len() >= 14).then(|| (self.sense[2] & 0x0f, self.sense[12], self.sense[13]))
    }
}

/// A rig's initiator on one channel.
#[derive(Debug)]
pub struct InitiatorSide {
    qp: QpId,
    /// Credits left: requests it may still send.
    pub credit: i64,
    /// Responses by tag.
    pub responses: HashMap<u64, Response>,
    /// The target logged the channel out, and why.
    pub logged_out: Option<TargetLogoutReason>,
    /// SRP_CRED_REQs received.
    pub credit_requests: u32,
    /// SRP_AER_REQs received (each answered with SRP_AER_RSP): the LUN and the sense data.
    pub events: Vec<(u64, Vec<u8>)>,
    /// Each command with a data buffer, by tag: where the buffer is, and whether it is a
    /// read's (gathered into the response).
    commands: HashMap<u64, Placed>,
    /// Task management functions sent, by tag: the function, its task tag and its LUN (what
    /// the answer ends on the initiator's side).
    tmfs: HashMap<u64, (TaskManagementFunction, u64, u64)>,
    /// Where a write's data goes in its SRP_CMD, when the login asked for immediate data and
    /// the target granted it; and the largest IU it may send.
    immediate: Option<(usize, usize)>,
}

/// One channel of the rig.
#[derive(Debug)]
pub struct RigChannel {
    /// The target's channel machine.
    pub channel: Channel<Vec<u8>>,
    /// The initiator facing it.
    pub initiator: InitiatorSide,
    key: ItNexusKey,
    nexus: NexusId,
    /// The target's queue pair, driven as targetd drives its channels.
    driver: Driver<QpId>,
    /// Buffers back from their completions, for reuse.
    buffers: VecBuffers,
    /// The channel has left the table (its queue pair disconnected).
    pub gone: bool,
}

impl LocalChannel for RigChannel {
    type Buffer = Vec<u8>;

    fn machine(&mut self) -> &mut Channel<Vec<u8>> {
        &mut self.channel
    }
}

impl RigChannel {
    /// Hands a completion of the target's queue pair to its channel; a queue pair that must
    /// not go on is disconnected.
    fn complete(
        &mut self,
        now: Instant,
        wc: Completion<Vec<u8>>,
        via: &mut ChannelCore<'_>,
        verbs: &mut Port<'_>,
    ) {
        let done = self
            .driver
            .complete(now, wc, &mut self.channel, via, verbs, &mut self.buffers);
        if done.is_err() {
            verbs.disconnect(self.driver.qp());
        }
    }
}

/// The key of a command whose data went in its SRP_CMD (keys of placed buffers start at 1).
const IMMEDIATE: u64 = 0;

/// Where a rig's command keeps its buffer: the strategy's memory, its key there, whether
/// data-in comes back into it, and its LUN.
#[derive(Debug, Clone, Copy)]
struct Placed {
    registration: Registration,
    key: u64,
    read: bool,
    lun: u64,
}

/// Buffer places in each channel's initiator memory (one per strategy): commands in flight
/// with data, as many as the port's default request limit.
pub const ARENA_SLOTS: usize = 128;
/// Bytes of each place by default ([`Rig::place_len`]): twice a command's data (its regions
/// lie apart) and its table.
pub const ARENA_SLOT: usize = 512 * 1024;

/// Why a rig's initiator did not send.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SendError {
    /// No credit left.
    NoCredit,
    /// The channel is gone.
    Gone,
    /// The initiator's memory could not hold or expose the buffer.
    Buffer(ExposeError),
}

/// The rig.
#[derive(Debug)]
pub struct Rig {
    /// The fabric.
    pub fabric: Fabric,
    /// The port's logins (its settings and its channels by I_T nexus).
    pub logins: Logins<usize>,
    /// The channels, by index (gone ones stay).
    pub channels: Vec<RigChannel>,
    core: LocalCore,
    backends: HashMap<u16, MemoryBackend>,
    /// Hold backend operations instead of running them (released by [`Rig::release`]).
    pub hold_backend: bool,
    held: Vec<(usize, TaskId, u16, Op, Vec<u8>)>,
    /// Hold the target's RDMA READ completions (data-out, descriptor tables) instead of
    /// handing them in, as a slow fabric would (released by [`Rig::release_reads`]).
    pub hold_reads: bool,
    held_reads: Vec<(usize, Completion<Vec<u8>>)>,
    /// The most bytes the target's allocator can ever give one wanted buffer: a larger
    /// [`Event::BufferWanted`] is answered with none, as an arena too small for it is.
    pub max_buffer: Option<usize>,
    now: Instant,
    /// Commands the target finished (its accounting events).
    pub completed: u64,
    /// How the initiators register their buffers (a change applies to the next command).
    pub registration: Registration,
    /// The initiators' data memory of each strategy, made at its first use.
    memories: HashMap<(usize, Registration), DataMemory<MemoryId>>,
    /// Bytes of each buffer place of an initiator memory made from now on (a command's data
    /// may be up to about half of it).
    pub place_len: usize,
    /// Keys of commands in the data memories, unique across channels.
    next_key: u64,
    /// Tags of [`Rig::closed_loop`]'s commands.
    next_tag: u64,
}

impl Rig {
    /// A target with memory units of (LUN index, block size, blocks), delegating plain READs
    /// and WRITEs as targetd does; the target's buffer arena registered once.
    pub fn new(units: &[(u16, u32, u64)]) -> Rig {
        let name = "iqn.2026-11.io.example:srp";
        let mut device = Device::new(name, vec![TargetPort::srp(name, TARGET_PORT, 1)]);
        device.set_delegation(true);
        let mut backends = HashMap::new();
        for &(lun, block_size, blocks) in units {
            let unit = LogicalUnit {
                identity: Identity::new(
                    "RIG",
                    "srp-memory",
                    "0001",
                    format!("srp-{lun}").as_bytes(),
                ),
                geometry: Geometry {
                    block_size,
                    blocks,
                    thin: true,
                    write_cache: true,
                    read_only: false,
                },
                limits: Limits::default(),
            };
            device.add_lu(lun, unit).expect("distinct LUNs");
            backends.insert(lun, MemoryBackend::new(block_size, blocks));
        }
        let mut fabric = Fabric::new();
        let arena = fabric.alloc(TARGET, 1 << 20);
        fabric.register(arena, 0, 1 << 20, Access::default());
        Rig {
            fabric,
            logins: Logins::new(PortSettings {
                target_port_id: TARGET_PORT,
                ..PortSettings::default()
            }),
            channels: Vec::new(),
            core: LocalCore::new(device),
            backends,
            hold_backend: false,
            held: Vec::new(),
            hold_reads: false,
            held_reads: Vec::new(),
            max_buffer: None,
            now: Instant::now(),
            completed: 0,
            registration: Registration::PerCommand,
            memories: HashMap::new(),
            place_len: ARENA_SLOT,
            next_key: 0,
            next_tag: 1 << 40,
        }
    }

    /// A login request from initiator port `port` as Linux's ib_srp builds one.
    pub fn login_request(port: [u8; 16], action: MultiChannelAction) -> SrpLoginReq {
        SrpLoginReq {
            tag: 1,
            req_it_iu_len: 48 + 20 + 32 * 16,
            req_buf_fmt: BufferFormats::BOTH,
            multi_channel: action,
            initiator_port_id: port,
            target_port_id: TARGET_PORT,
            ..SrpLoginReq::default()
        }
    }

    /// Logs a channel in: the request goes through its codec and the port's checks; accepted,
    /// the queue pairs are connected and receives posted on both sides.
    pub fn login(&mut self, req: &SrpLoginReq) -> Result<(usize, SrpLoginRsp), SrpLoginRej> {
        let mut b = Vec::new();
        req.encode(&mut b);
        let Ok(Iu::LoginReq(req)) = Iu::decode(&b) else {
            panic!("a login request decodes");
        };
        let mut policy = LocalPolicy {
            core: &mut self.core,
            target_port_id: TARGET_PORT,
            channels: &mut self.channels,
        };
        let accepted = self.logins.login(&req, &mut policy).map_err(|r| r.reject)?;
        let (params, key, nexus) = (accepted.params, accepted.key, accepted.nexus);
        let ch = self.channels.len();
        self.logins.connected(&accepted, ch);
        // Unit attentions go to the nexus's newest channel.
        let _ = self.core.announce_to(nexus, Some(ch));
        let (qp, iqp) = self.fabric.connect(TARGET, INITIATOR);
        let mut target = self.fabric.port(TARGET);
        for _ in 0..params.request_limit + SPARE_RECEIVES {
            target.post_recv(qp, 0, vec![0; params.max_it_iu_len as usize]);
        }
        let mut initiator = self.fabric.port(INITIATOR);
        for _ in 0..params.request_limit + 4 {
            initiator.post_recv(iqp, 0, vec![0; params.max_ti_iu_len as usize]);
        }
        let mut b = Vec::new();
        accepted.response.encode(&mut b);
        let Ok(Iu::LoginRsp(rsp)) = Iu::decode(&b) else {
            panic!("a login response decodes");
        };
        self.channels.push(RigChannel {
            channel: Channel::new(nexus, params),
            initiator: InitiatorSide {
                qp: iqp,
                credit: i64::from(rsp.req_lim_delta),
                responses: HashMap::new(),
                logged_out: None,
                credit_requests: 0,
                events: Vec::new(),
                commands: HashMap::new(),
                tmfs: HashMap::new(),
                immediate: (req.immediate_data && rsp.immediate_data)
                    .then_some((usize::from(req.imm_data_offset), rsp.max_it_iu_len as usize)),
            },
            key,
            nexus,
            driver: Driver::new(qp),
            buffers: VecBuffers::default(),
            gone: false,
        });
        self.run();
        Ok((ch, rsp))
    }

    /// Sends a command on channel `ch` (taking a credit); its data buffer is `regions`
    /// regions of the initiator's memory, each registered apart.
    pub fn send(&mut self, ch: usize, cmd: &Cmd) -> Result<(), SendError> {
        let side = &self.channels[ch];
        if side.gone {
            return Err(SendError::Gone);
        }
        if side.initiator.credit <= 0 {
            return Err(SendError::NoCredit);
        }
        let len = cmd.data_out.as_ref().map_or(cmd.data_in as usize, Vec::len);
        let base = SrpCmd {
            sol_not: 0,
            tag: cmd.tag,
            lun: cmd.lun,
            task_attribute: cmd.attribute,
            cdb: &cmd.cdb,
            ..SrpCmd::default()
        };
        if let (Some(data), Some((offset, max))) = (&cmd.data_out, side.initiator.immediate) {
            let mut b = Vec::new();
            if cmd.regions <= 1
                && !cmd.partial
                && crate::initiator::encode_immediate_write(&base, data, offset, max, &mut b)
            {
                // The data goes in the SRP_CMD: no buffer of the initiator's memory.
                let placed = Placed {
                    registration: self.registration,
                    key: IMMEDIATE,
                    read: false,
                    lun: cmd.lun,
                };
                if let Some(old) = self.channels[ch].initiator.commands.insert(cmd.tag, placed) {
                    self.free(ch, old);
                }
                self.channels[ch].initiator.credit -= 1;
                self.send_raw(ch, &b);
                return Ok(());
            }
        }
        let registration = self.registration;
        let memory = match self.memories.entry((ch, registration)) {
            std::collections::hash_map::Entry::Occupied(o) => o.into_mut(),
            std::collections::hash_map::Entry::Vacant(v) => {
                let mut port = self.fabric.port(INITIATOR);
                v.insert(
                    DataMemory::new(&mut port, registration, ARENA_SLOTS, self.place_len)
                        .expect("the fabric allocates"),
                )
            }
        };
        self.next_key += 1;
        let key = self.next_key;
        let exposed = memory
            .expose(
                &mut self.fabric.port(INITIATOR),
                key,
                len,
                cmd.regions,
                cmd.partial,
                cmd.data_out.as_deref(),
            )
            .map_err(SendError::Buffer)?;
        let descriptor = exposed.descriptor();
        let (data_out, data_in) = if cmd.data_out.is_some() {
            (descriptor, DataBufferDescriptor::None)
        } else {
            (DataBufferDescriptor::None, descriptor)
        };
        let c = SrpCmd {
            data_out,
            data_in,
            ..base
        };
        let mut b = Vec::new();
        c.encode(&mut b);
        let placed = Placed {
            registration,
            key,
            read: cmd.data_out.is_none(),
            lun: cmd.lun,
        };
        // An initiator that reuses a tag in flight forgets the first command's buffer.
        if let Some(old) = self.channels[ch].initiator.commands.insert(cmd.tag, placed) {
            self.free(ch, old);
        }
        self.channels[ch].initiator.credit -= 1;
        self.send_raw(ch, &b);
        Ok(())
    }

    /// A command's buffer place is free again (and its per-command registrations undone).
    fn free(&mut self, ch: usize, placed: Placed) {
        if placed.key == IMMEDIATE {
            return;
        }
        if let Some(m) = self.memories.get_mut(&(ch, placed.registration)) {
            m.release(&mut self.fabric.port(INITIATOR), placed.key);
        }
    }

    /// Sends bytes as an IU on channel `ch`, whatever they are (no credit is counted).
    pub fn send_raw(&mut self, ch: usize, iu: &[u8]) {
        let qp = self.channels[ch].initiator.qp;
        self.fabric
            .port(INITIATOR)
            .post_send(qp, 0, iu.to_vec(), iu.len());
    }

    /// Sends a task management function (taking a credit).
    pub fn task_management(
        &mut self,
        ch: usize,
        tag: u64,
        lun: u64,
        function: TaskManagementFunction,
        task_tag: u64,
    ) {
        let t = SrpTskMgmt {
            sol_not: 0,
            tag,
            lun,
            function,
            task_tag,
        };
        let mut b = Vec::new();
        t.encode(&mut b);
        let side = &mut self.channels[ch].initiator;
        side.credit -= 1;
        side.tmfs.insert(tag, (function, task_tag, lun));
        self.send_raw(ch, &b);
    }

    /// Logs channel `ch` out from the initiator's side.
    pub fn logout(&mut self, ch: usize) {
        let mut b = Vec::new();
        SrpILogout { tag: 99 }.encode(&mut b);
        self.send_raw(ch, &b);
    }

    /// Runs held backend operations.
    pub fn release(&mut self) {
        for (ch, task, lun, op, mut buffer) in std::mem::take(&mut self.held) {
            let r = execute(&mut self.backends, lun, &op, &mut buffer);
            let c = &mut self.channels[ch];
            let mut via = self.core.channel(ch, c.nexus);
            c.channel
                .handle_backend_done(self.now, task, buffer, r, &mut via);
        }
        self.run();
    }

    /// Hands the held RDMA READ completions in, oldest first.
    pub fn release_reads(&mut self) {
        for (ch, wc) in std::mem::take(&mut self.held_reads) {
            let c = &mut self.channels[ch];
            let mut via = self.core.channel(ch, c.nexus);
            c.complete(self.now, wc, &mut via, &mut self.fabric.port(TARGET));
        }
        self.run();
    }

    /// The response to `tag` on channel `ch`, if it came.
    pub fn response(&self, ch: usize, tag: u64) -> Option<&Response> {
        self.channels[ch].initiator.responses.get(&tag)
    }

    /// Takes the response to `tag` on channel `ch` out of the rig, if it came.
    pub fn take_response(&mut self, ch: usize, tag: u64) -> Option<Response> {
        self.channels[ch].initiator.responses.remove(&tag)
    }

    /// Runs a closed loop of block I/O on channels `chs`: each keeps up to `qd` commands in
    /// flight (fewer when its credit runs out), taking the next I/O of a channel from `next`
    /// until it says none is left, and hands each finished I/O to `done` with its response and
    /// its latency on the fabric's clock (from the send, before the initiator registers the
    /// command's buffer, to the end of the run step that answered it). READ(16) and WRITE(16) of `io.blocks` blocks of `block_size` bytes, the
    /// buffer cut into `regions` regions. Returns the I/Os sent. A channel that is gone ends
    /// its loop; one whose command is refused (the I/O dropped) too, and the first refusal is
    /// returned once what is in flight has ended.
    pub fn closed_loop(
        &mut self,
        chs: &[usize],
        qd: usize,
        block_size: u32,
        regions: usize,
        mut next: impl FnMut(usize) -> Option<BlockIo>,
        mut done: impl FnMut(usize, BlockIo, Response, Duration),
    ) -> Result<u64, SendError> {
        let mut in_flight: Vec<Vec<(u64, BlockIo, Duration)>> = vec![Vec::new(); chs.len()];
        let mut open = vec![true; chs.len()];
        let mut sent = 0;
        let mut refused = None;
        let end = |sent, refused: Option<SendError>| refused.map_or(Ok(sent), Err);
        loop {
            for (i, &ch) in chs.iter().enumerate() {
                while open[i] && in_flight[i].len() < qd && self.channels[ch].initiator.credit > 0 {
                    let Some(io) = next(ch) else {
                        open[i] = false;
                        break;
                    };
                    self.next_tag += 1;
                    let tag = self.next_tag;
                    let len = io.blocks as usize * block_size as usize;
                    let mut cdb = vec![if io.data.is_some() { 0x8a } else { 0x88 }, 0];
                    cdb.extend_from_slice(&io.lba.to_be_bytes());
                    cdb.extend_from_slice(&io.blocks.to_be_bytes());
                    cdb.extend_from_slice(&[0, 0]);
                    let cmd = Cmd {
                        tag,
                        cdb,
                        data_out: io.data.clone(),
                        data_in: if io.data.is_some() { 0 } else { len as u32 },
                        regions,
                        ..Cmd::default()
                    };
                    // The command's time starts before the initiator registers its buffer.
                    let start = self.fabric.elapsed;
                    if let Err(e) = self.send(ch, &cmd) {
                        refused.get_or_insert(e);
                        open[i] = false;
                        break;
                    }
                    sent += 1;
                    in_flight[i].push((tag, io, start));
                }
            }
            if in_flight.iter().all(Vec::is_empty) {
                return end(sent, refused);
            }
            self.run();
            let now = self.fabric.elapsed;
            let mut moved = false;
            for (i, &ch) in chs.iter().enumerate() {
                let mut k = 0;
                while k < in_flight[i].len() {
                    match self.take_response(ch, in_flight[i][k].0) {
                        Some(r) => {
                            let (_, io, start) = in_flight[i].swap_remove(k);
                            done(ch, io, r, now - start);
                            moved = true;
                        }
                        None => k += 1,
                    }
                }
                if self.channels[ch].gone {
                    in_flight[i].clear();
                    open[i] = false;
                }
            }
            if !moved && !self.hold_backend && !self.hold_reads {
                // Nothing answered and nothing is held: what is in flight never will be.
                return end(sent, refused);
            }
        }
    }

    /// The I_T nexuses with a channel.
    pub fn nexuses(&self) -> usize {
        self.logins.nexuses()
    }

    /// Changes the capacity of LUN index `lun` to `blocks`, as an administrator would: every
    /// nexus gets a unit attention, reported at once by SRP_AER_REQ.
    pub fn resize(&mut self, lun: u16, blocks: u64) {
        self.core.resize_unit(lun, blocks).expect("the unit exists");
        self.run();
    }

    /// Tasks the device holds.
    pub fn device_tasks(&self) -> usize {
        self.core.device().task_count()
    }

    /// Runs everything until nothing moves.
    pub fn run(&mut self) {
        loop {
            let mut progress = false;
            for ch in 0..self.channels.len() {
                progress |= self.step_target(ch);
                progress |= self.step_initiator(ch);
            }
            if !progress {
                break;
            }
        }
    }

    fn step_target(&mut self, ch: usize) -> bool {
        let mut progress = false;
        let now = self.now;
        let c = &mut self.channels[ch];
        let mut via = self.core.channel(ch, c.nexus);
        let mut verbs = self.fabric.port(TARGET);
        let qp = c.driver.qp();
        while let Some(wc) = verbs.poll(qp) {
            progress = true;
            if wc.op == WorkOp::RdmaRead && self.hold_reads {
                self.held_reads.push((ch, wc));
                continue;
            }
            c.complete(now, wc, &mut via, &mut verbs);
        }
        if via.core().has_work(ch) {
            progress = true;
            c.channel.handle_core(now, &mut via);
        }
        match c
            .driver
            .transmit(now, &mut c.channel, &mut via, &mut verbs, &mut c.buffers)
        {
            Ok(any) => progress |= any,
            Err(_) => verbs.disconnect(qp),
        }
        while let Some(e) = c.channel.poll_event() {
            progress = true;
            match e {
                Event::Backend {
                    task,
                    lun,
                    op,
                    mut buffer,
                } => {
                    if self.hold_backend {
                        self.held.push((ch, task, lun, op, buffer));
                        continue;
                    }
                    let r = execute(&mut self.backends, lun, &op, &mut buffer);
                    c.channel
                        .handle_backend_done(now, task, buffer, r, &mut via);
                }
                Event::BufferWanted { tag, len } => {
                    let fits = len <= self.max_buffer.unwrap_or(usize::MAX);
                    let buffer = fits.then(|| vec![0; len]);
                    c.channel.handle_buffer(now, tag, buffer, &mut via)
                }
                Event::Completed(_) => self.completed += 1,
            }
        }
        // A channel that is over leaves once the core is done with it.
        let lost = verbs.is_error(qp);
        if !c.gone && (c.channel.closing().is_some() || lost) {
            if lost {
                c.channel.close(false, &mut via);
            }
            if c.channel.is_idle() {
                c.gone = true;
                progress = true;
                if !lost {
                    verbs.disconnect(qp);
                }
                if let Left::Ended(nexus) = self.logins.leave(c.key, &ch) {
                    let _ = via.core().close_nexus(nexus);
                }
            }
        }
        progress
    }

    fn step_initiator(&mut self, ch: usize) -> bool {
        let mut progress = false;
        let mut ended = Vec::new();
        let c = &mut self.channels[ch];
        let side = &mut c.initiator;
        while let Some(wc) = self.fabric.port(INITIATOR).poll(side.qp) {
            progress = true;
            if wc.op != WorkOp::Recv || wc.result.is_err() {
                continue;
            }
            let iu = &wc.buffer[..wc.len];
            match Iu::decode(iu) {
                Ok(Iu::Rsp(r)) => {
                    side.credit += i64::from(r.req_lim_delta);
                    let mut data = Vec::new();
                    if let Some(placed) = side.commands.remove(&r.tag) {
                        if placed.read {
                            if let Some(m) = self.memories.get(&(ch, placed.registration)) {
                                let port = self.fabric.port(INITIATOR);
                                m.read_data(&port, placed.key, &mut data);
                            }
                        }
                        ended.push(placed);
                    }
                    // The answer to a task management function ends the tasks it aborted.
                    if let Some((function, task_tag, lun)) = side.tmfs.remove(&r.tag) {
                        let aborted = |t: &u64, p: &Placed| match function {
                            TaskManagementFunction::AbortTask => *t == task_tag,
                            TaskManagementFunction::AbortTaskSet
                            | TaskManagementFunction::ClearTaskSet
                            | TaskManagementFunction::LogicalUnitReset => p.lun == lun,
                            _ => false,
                        };
                        side.commands.retain(|t, p| {
                            let gone = aborted(t, p);
                            if gone {
                                ended.push(*p);
                            }
                            !gone
                        });
                    }
                    side.responses.insert(
                        r.tag,
                        Response {
                            status: r.status,
                            sense: r.sense.to_vec(),
                            response_data: r.response_data.to_vec(),
                            data_in_residual: r.data_in_residual,
                            data_out_residual: r.data_out_residual,
                            data,
                            req_lim_delta: r.req_lim_delta,
                        },
                    );
                }
                Ok(Iu::CredReq(r)) => {
                    side.credit += i64::from(r.req_lim_delta);
                    side.credit_requests += 1;
                    let mut b = Vec::new();
                    SrpCredRsp { tag: r.tag }.encode(&mut b);
                    let len = b.len();
                    self.fabric.port(INITIATOR).post_send(side.qp, 0, b, len);
                }
                Ok(Iu::AerReq(r)) => {
                    side.credit += i64::from(r.req_lim_delta);
                    side.events.push((r.lun, r.sense.to_vec()));
                    let mut b = Vec::new();
                    SrpAerRsp { tag: r.tag }.encode(&mut b);
                    let len = b.len();
                    self.fabric.port(INITIATOR).post_send(side.qp, 0, b, len);
                }
                Ok(Iu::TLogout(t)) => side.logged_out = Some(t.reason),
                other => panic!("the target sent {other:?}"),
            }
            self.fabric.port(INITIATOR).post_recv(side.qp, 0, wc.buffer);
        }
        // A channel that is gone ends every command still on it.
        if c.gone {
            ended.extend(side.commands.drain().map(|(_, p)| p));
        }
        for placed in ended {
            self.free(ch, placed);
        }
        progress
    }
}

/// One row of paper 004's experiment on the fabric.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Paper004 {
    /// How the initiator registered.
    pub registration: Registration,
    /// Regions per command (32 discrete 4 KiB regions, or 1 contiguous).
    pub regions: usize,
    /// READ throughput, MB/s (10^6 bytes per second of the fabric's virtual clock).
    pub read_mb_s: f64,
    /// WRITE throughput, MB/s.
    pub write_mb_s: f64,
    /// Virtual time per command, microseconds (reads and writes together).
    pub per_command_us: f64,
    /// Registrations the initiator made per measured command.
    pub initiator_registrations_per_command: f64,
    /// Registrations the target made while measuring (its arena is registered at start).
    pub target_registrations: u64,
}

/// Runs paper 004's experiment for one strategy and layout: 128 KiB READs and WRITEs, one at
/// a time, as `regions` regions, after a warm-up of [`ARENA_SLOTS`] commands each (so a cache
/// is warm), on the fabric charged [`PAPER_004_COSTS`]; then `commands` of each measured.
/// Deterministic: the fabric's virtual clock, not this machine's.
pub fn paper004(registration: Registration, regions: usize, commands: u64) -> Paper004 {
    const LEN: usize = 128 * 1024;
    let mut rig = Rig::new(&[(0, 4096, 4096)]);
    rig.registration = registration;
    let (ch, _) = rig
        .login(&Rig::login_request(
            *b"paper-004-initia",
            MultiChannelAction::SingleChannel,
        ))
        .expect("the rig's own login is accepted");
    rig.fabric.costs = PAPER_004_COSTS;
    let data = vec![0x5a; LEN];
    let mut ok = 0;
    let mut phase = |rig: &mut Rig, write: bool, count: u64| {
        let start = rig.fabric.elapsed;
        let mut lba = 0u64;
        let mut left = count;
        rig.closed_loop(
            &[ch],
            1,
            4096,
            regions,
            |_| {
                left = left.checked_sub(1)?;
                lba = (lba + 32) % 4096;
                Some(BlockIo {
                    lba,
                    blocks: 32,
                    data: write.then(|| data.clone()),
                    cookie: 0,
                })
            },
            |_, _, r, _| ok += u64::from(r.status == 0),
        )
        .expect("the rig's initiator memory holds a 128 KiB command");
        rig.fabric.elapsed - start
    };
    // The first command of the nexus hears of the power on; then warm up.
    phase(&mut rig, false, 1);
    phase(&mut rig, true, ARENA_SLOTS as u64);
    phase(&mut rig, false, ARENA_SLOTS as u64);
    let before = rig.fabric.counters;
    let read = phase(&mut rig, false, commands);
    let write = phase(&mut rig, true, commands);
    let after = rig.fabric.counters;
    assert!(ok >= 2 * commands, "every measured command succeeds");
    let mb_s = |d: Duration| (commands as f64 * LEN as f64) / d.as_secs_f64() / 1e6;
    Paper004 {
        registration,
        regions,
        read_mb_s: mb_s(read),
        write_mb_s: mb_s(write),
        per_command_us: (read + write).as_secs_f64() * 1e6 / (2 * commands) as f64,
        initiator_registrations_per_command: (after.registrations[1] - before.registrations[1])
            as f64
            / (2 * commands) as f64,
        target_registrations: after.registrations[0] - before.registrations[0],
    }
}
