//! One RDMA channel of an SRP target port in its logged-in state (SRP-2 sections 5 and 6), as a
//! sans-IO state machine on scsi-core's task layer.
//!
//! The shell (targetd's reactor, or the software fabric in tests) hands in each IU the channel
//! received, the buffers it allocated, the RDMA transfers and backend operations that ended;
//! the channel hands back what to transmit ([`Channel::poll_transmit`]: IUs to send, RDMA
//! WRITEs of data-in, RDMA READs of data-out and of descriptor tables, in the order they must
//! be posted on the queue pair) and what to run ([`Channel::poll_event`]: backend operations,
//! buffers wanted, accounting). It owns no queue pair, buffer pool or clock.
//!
//! The SCSI work is scsi-core's: each command goes into a [`TaskTable`] keyed by the SRP tag,
//! with the initiator's memory descriptors as the transport's per-task state ([`SrpTask`]), and
//! the table turns the core's actions into requests. What SRP adds is how data moves (the
//! target's own RDMA, no R2T), credits (REQUEST LIMIT DELTA) and its IUs.
//!
//! ## Credits
//!
//! The login gives the initiator `request_limit` credits: it may have that many SRP_CMD and
//! SRP_TSK_MGMT requests outstanding, and the shell keeps that many receives posted for them
//! (plus [`SPARE_RECEIVES`] for the initiator's answers to the target's own requests). Every
//! SRP_RSP gives back the credits of every request that has ended since the last one went out;
//! a request that ends without a response (an aborted command) gives its credit back in the
//! next response, or in an SRP_CRED_REQ when no response is due. A request beyond the limit is
//! answered BUSY and holds no credit.

use std::collections::VecDeque;
use std::time::Instant;

use cmdtrace::{Points, Stage};
use rdma::verbs::RemoteRegion;
use scsi_core::transport::{
    Carrier, Completion, NewTask, TagError, TaskBuffer, TaskEntry, TaskTable,
};
pub use scsi_core::transport::{Event, TaskCore};
use scsi_core::{
    Action, Asc, BackendError, Command, DataIn, DeviceError, NexusId, Output, Residual, Sense,
    SenseBytes, SenseKey, Status, TaskId, TmfFunction, TmfResponse,
};

use crate::iu::{
    BufferFormats, DataBufferDescriptor, Descriptors, Iu, IuError, IuType, MemoryDescriptor,
    ResponseCode, SrpAerReq, SrpCmd, SrpCredReq, SrpRsp, SrpTLogout, SrpTskMgmt,
    TargetLogoutReason, DATA_IN_FORMAT, DATA_OUT_FORMAT, DESCRIPTOR_LEN,
};

/// Receives the shell posts beyond the request limit: for SRP_CRED_RSP and SRP_AER_RSP, which
/// use no credit.
pub const SPARE_RECEIVES: u32 = 2;

/// What a login settled for a channel.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ChannelParams {
    /// The largest IU the initiator may send (the size of each receive buffer).
    pub max_it_iu_len: u32,
    /// The largest IU the target sends.
    pub max_ti_iu_len: u32,
    /// Requests the initiator may have outstanding (its first credit).
    pub request_limit: u32,
    /// Descriptor formats the initiator may use.
    pub formats: BufferFormats,
    /// The most memory descriptors one command's table may hold, fetched or not: a table is
    /// read into memory only when it is within this bound.
    pub max_descriptors: u32,
    /// Where immediate data starts in an SRP_CMD, when the login granted it (SRP-2).
    pub imm_data_offset: Option<u16>,
}

/// The SCSI core as one channel reaches it: the calls every transport makes for its tasks
/// ([`TaskCore`]) and SRP's own. Calls report what follows for this channel's tasks as
/// actions, which [`Core::poll_core`] hands back once the call has returned.
pub trait Core: TaskCore {
    /// The next action the core reported for this channel.
    fn poll_core(&mut self) -> Option<Action>;
    /// Submits a command of this channel's I_T nexus.
    fn submit(&mut self, cmd: Command<'_>) -> Result<TaskId, DeviceError>;
}

/// The transport's state of one command: the initiator's memory descriptors.
#[derive(Debug, Default)]
pub struct SrpTask {
    /// SCSOLNT/UCSOLNT of the command, for its response.
    sol_not: u8,
    /// Where data-out comes from.
    data_out: Vec<RemoteRegion>,
    /// Where data-in goes.
    data_in: Vec<RemoteRegion>,
    /// A command waiting for its descriptor table (its CDB and attribute, until submitted).
    waiting: Option<Waiting>,
    /// The RDMA READ (data-out or descriptor table) in flight for it: a completion that
    /// names another belongs to a command that ended, whose tag may be in use again.
    transfer: Option<u64>,
}

/// A command whose descriptor table is being fetched.
#[derive(Debug)]
struct Waiting {
    cdb: Vec<u8>,
    attribute: scsi_core::TaskAttribute,
    /// The table is data-in's (else data-out's).
    data_in: bool,
    table: MemoryDescriptor,
}

/// The bytes of data-in an RDMA WRITE carries.
#[derive(Debug)]
pub enum Payload<B> {
    /// A task's buffer the backend read into.
    Buffer(B),
    /// Parameter data the SCSI core built (INQUIRY, MODE SENSE, ...): the shell copies it into
    /// registered memory.
    Bytes(Vec<u8>),
}

impl<B: std::ops::Deref<Target = [u8]>> Payload<B> {
    /// The bytes.
    pub fn as_slice(&self) -> &[u8] {
        match self {
            Payload::Buffer(b) => b,
            Payload::Bytes(v) => v,
        }
    }
}

/// What to post on the queue pair, in this order (RC queue pairs keep it: an SRP_RSP sent
/// after an RDMA WRITE reaches the initiator after the data).
#[derive(Debug)]
#[must_use = "a transmit is what the queue pair must post; the initiator waits for it"]
pub enum Transmit<B> {
    /// Send the IU written into the buffer given to [`Channel::poll_transmit`].
    Send {
        /// Its length.
        len: usize,
        /// Ask for a solicited event at the initiator (SOLNT).
        solicited: bool,
    },
    /// RDMA WRITE the first `len` bytes of `payload` into `regions`, filling each in turn.
    /// The shell keeps the payload until the write's completion, then drops it, and gives
    /// `regions` back with [`Channel::recycle`] once posted.
    RdmaWrite {
        /// The command's tag.
        tag: u64,
        /// The data.
        payload: Payload<B>,
        /// Bytes to write.
        len: u32,
        /// The initiator's regions, in order; together at least `len` bytes.
        regions: Vec<RemoteRegion>,
    },
    /// RDMA READ `len` bytes from `regions` (filling the buffer in order from offset 0) into
    /// `buffer`, then [`Channel::handle_data_out`]. The shell gives `regions` back with
    /// [`Channel::recycle`] once posted.
    RdmaRead {
        /// The command's tag.
        tag: u64,
        /// Names this transfer to [`Channel::handle_data_out`].
        transfer: u64,
        /// Where the data lands.
        buffer: B,
        /// Bytes to read.
        len: u32,
        /// The initiator's regions; together at least `len` bytes.
        regions: Vec<RemoteRegion>,
    },
    /// RDMA READ a command's descriptor table (`table.len` bytes, checked against
    /// [`ChannelParams::max_descriptors`]), then [`Channel::handle_table`].
    ReadTable {
        /// The command's tag.
        tag: u64,
        /// Names this transfer to [`Channel::handle_table`].
        transfer: u64,
        /// Where the table is.
        table: RemoteRegion,
    },
}

/// Why the channel ends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Close {
    /// The initiator sent SRP_I_LOGOUT.
    InitiatorLogout,
    /// The target sent SRP_T_LOGOUT with this reason: disconnect once it is out.
    TargetLogout(TargetLogoutReason),
}

/// An IU waiting to be sent, encoded when the shell polls so that its credit is current.
#[derive(Debug)]
enum Out<B> {
    /// An SRP_RSP.
    Rsp(Rsp),
    /// An SRP_CRED_REQ carrying whatever credit is owed then.
    CredReq,
    /// An SRP_AER_REQ reporting a unit attention of a logical unit.
    AerReq {
        /// The 8-byte LUN.
        lun: u64,
        /// The sense data.
        sense: SenseBytes,
    },
    /// An SRP_T_LOGOUT.
    TLogout(TargetLogoutReason),
    /// A transfer.
    Transfer(Transmit<B>),
}

/// An SRP_RSP's content.
#[derive(Debug)]
struct Rsp {
    tag: u64,
    sol_not: u8,
    status: Status,
    data_in_residual: Residual,
    data_out_residual: Residual,
    response: Option<[u8; 4]>,
    sense: Option<SenseBytes>,
}

impl Rsp {
    fn status(tag: u64, sol_not: u8, status: Status) -> Rsp {
        Rsp {
            tag,
            sol_not,
            status,
            data_in_residual: Residual::None,
            data_out_residual: Residual::None,
            response: None,
            sense: None,
        }
    }
}

/// A task management function this channel asked of the core.
#[derive(Debug, Clone, Copy)]
struct PendingTmf {
    reference: u64,
    /// The SRP_TSK_MGMT's tag and SOLNT; `None` for the channel's own aborts as it closes.
    request: Option<(u64, u8)>,
}

/// The channel's SRP_AER_REQ, one at a time.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum AerOut {
    /// Queued, not yet encoded.
    Queued,
    /// Sent with this tag, waiting for its SRP_AER_RSP.
    Sent(u64),
}

/// One RDMA channel.
#[derive(Debug)]
pub struct Channel<B> {
    nexus: NexusId,
    params: ChannelParams,
    tasks: TaskTable<SrpTask, B>,
    out: VecDeque<Out<B>>,
    events: VecDeque<Event<B>>,
    tmfs: Vec<PendingTmf>,
    /// Requests holding a credit (commands and task management functions not yet answered).
    outstanding: u32,
    /// Credit to give back with the next SRP_RSP or SRP_CRED_REQ.
    owed: u32,
    /// Responses queued and not yet encoded: they will carry the owed credit.
    queued_responses: usize,
    /// SRP_CRED_REQs sent and not yet answered, by tag.
    credit_requests: Vec<u64>,
    /// An SRP_CRED_REQ is queued.
    credit_queued: bool,
    /// Unit attentions waiting to go as SRP_AER_REQ, oldest first (at most
    /// [`PENDING_EVENTS`]: the unit attentions stay pending in the core anyway).
    events_pending: VecDeque<(u64, SenseBytes)>,
    /// The SRP_AER_REQ queued or sent and not yet answered.
    event_out: Option<AerOut>,
    next_target_tag: u64,
    next_transfer: u64,
    closing: Option<Close>,
    closed: bool,
    /// The `now` of the last call in, which trace points deep inside a call stamp.
    now: Option<Instant>,
    /// Each command's stages, while tracing ([`Channel::trace_points`]).
    trace: Points,
    /// Descriptor lists to reuse, so steady state allocates none.
    lists: Vec<Vec<RemoteRegion>>,
}

/// How many descriptor lists a channel keeps for reuse.
const KEPT_LISTS: usize = 512;

/// Unit attentions a channel keeps waiting to report by SRP_AER_REQ; beyond, the oldest is
/// dropped (the initiator still hears of it: CHECK CONDITION on its next command).
pub const PENDING_EVENTS: usize = 16;

/// The next number of a counter of target-assigned identifiers (tags, transfers).
fn take_next(counter: &mut u64) -> u64 {
    let n = *counter;
    *counter = n.wrapping_add(1);
    n
}

impl<B: TaskBuffer> Channel<B> {
    /// A channel of the I_T nexus `nexus`, logged in with `params`.
    pub fn new(nexus: NexusId, params: ChannelParams) -> Channel<B> {
        Channel {
            nexus,
            params,
            tasks: TaskTable::new(),
            out: VecDeque::with_capacity(256),
            events: VecDeque::with_capacity(256),
            tmfs: Vec::new(),
            outstanding: 0,
            owed: 0,
            queued_responses: 0,
            credit_requests: Vec::new(),
            credit_queued: false,
            events_pending: VecDeque::new(),
            event_out: None,
            next_target_tag: 1,
            next_transfer: 1,
            closing: None,
            closed: false,
            lists: Vec::new(),
            now: None,
            trace: Points::default(),
        }
    }

    /// The channel's I_T nexus.
    pub fn nexus(&self) -> NexusId {
        self.nexus
    }

    /// What the login settled.
    pub fn params(&self) -> &ChannelParams {
        &self.params
    }

    /// Commands held (waiting, in the core, or moving data).
    pub fn task_count(&self) -> usize {
        self.tasks.len()
    }

    /// Requests holding a credit.
    pub fn outstanding(&self) -> u32 {
        self.outstanding
    }

    /// Whether nothing is left in the core, so a closed channel can be dropped.
    pub fn is_idle(&self) -> bool {
        self.tasks.is_empty() && self.tmfs.is_empty()
    }

    /// Whether the channel is ending, and why.
    pub fn closing(&self) -> Option<Close> {
        self.closing
    }

    /// The next thing to post. An IU is written into `buf` (cleared first), which must then be
    /// sent as it is; transfers come with what they move.
    pub fn poll_transmit(&mut self, buf: &mut Vec<u8>) -> Option<Transmit<B>> {
        loop {
            let out = self.out.pop_front()?;
            buf.clear();
            match out {
                Out::Rsp(r) => {
                    self.queued_responses -= 1;
                    let delta = std::mem::take(&mut self.owed);
                    let response = r.response.unwrap_or_default();
                    SrpRsp {
                        sol_not: r.sol_not,
                        req_lim_delta: delta,
                        tag: r.tag,
                        status: r.status as u8,
                        data_out_residual: r.data_out_residual,
                        data_in_residual: r.data_in_residual,
                        response_data: if r.response.is_some() { &response } else { &[] },
                        sense: r.sense.as_ref().map_or(&[], |s| s.as_slice()),
                    }
                    .encode(buf);
                    return Some(Transmit::Send {
                        len: buf.len(),
                        solicited: true,
                    });
                }
                Out::CredReq => {
                    self.credit_queued = false;
                    if self.owed == 0 {
                        self.next_event();
                        continue;
                    }
                    let tag = self.target_tag();
                    self.credit_requests.push(tag);
                    SrpCredReq {
                        sol_not: 1,
                        req_lim_delta: std::mem::take(&mut self.owed),
                        tag,
                    }
                    .encode(buf);
                    return Some(Transmit::Send {
                        len: buf.len(),
                        solicited: true,
                    });
                }
                Out::AerReq { lun, sense } => {
                    let tag = self.target_tag();
                    self.event_out = Some(AerOut::Sent(tag));
                    // No credit rides on it: an initiator that takes the event lightly
                    // (Linux's ib_srp logs it) must not lose credit with it.
                    SrpAerReq {
                        sol_not: 1,
                        req_lim_delta: 0,
                        tag,
                        lun,
                        sense: sense.as_slice(),
                    }
                    .encode(buf);
                    return Some(Transmit::Send {
                        len: buf.len(),
                        solicited: true,
                    });
                }
                Out::TLogout(reason) => {
                    let tag = self.target_tag();
                    SrpTLogout {
                        sol_not: 1,
                        reason,
                        tag,
                    }
                    .encode(buf);
                    return Some(Transmit::Send {
                        len: buf.len(),
                        solicited: true,
                    });
                }
                Out::Transfer(t) => return Some(t),
            }
        }
    }

    /// The next thing for the shell to do.
    pub fn poll_event(&mut self) -> Option<Event<B>> {
        self.events.pop_front()
    }

    /// Its trace points (each command's stages, `cmdtrace`): off until set on; the shell
    /// takes them after each step.
    pub fn trace_points(&mut self) -> &mut Points {
        &mut self.trace
    }

    /// Notes that command `tag` reached `stage` (when tracing).
    #[inline]
    fn trace(&mut self, stage: Stage, tag: u64, arg: u32) {
        if let Some(at) = self.now {
            self.trace.push(at, stage, tag as u32, 0, arg);
        }
    }

    /// The channel as it carries out its task table's requests (scsi-core's [`Carrier`]).
    fn carry(&mut self) -> Carry<'_, B> {
        Carry(self)
    }

    /// Gives back a descriptor list a transfer carried.
    pub fn recycle(&mut self, mut regions: Vec<RemoteRegion>) {
        // A list that never held anything (its task's was taken for a transfer) is no use
        // again: keeping it would hand out an empty list that allocates when filled.
        if regions.capacity() > 0 && self.lists.len() < KEPT_LISTS {
            regions.clear();
            self.lists.push(regions);
        }
    }

    /// An IU arrived on the channel. The shell may post its receive buffer again once this
    /// returns: nothing of it is kept. `allocate` gives a task buffer of a length now, if
    /// there is room without waiting: a write's immediate data is copied into it (without
    /// room, the command ends with BUSY, and the initiator sends it again).
    pub fn handle_iu(
        &mut self,
        now: Instant,
        iu: &[u8],
        core: &mut impl Core,
        allocate: &mut impl FnMut(usize) -> Option<B>,
    ) {
        self.now = Some(now);
        if self.closing.is_some() {
            return;
        }
        if iu.len() > self.params.max_it_iu_len as usize {
            self.log_out(TargetLogoutReason::InvalidIuLength, core);
            return;
        }
        match Iu::decode(iu) {
            Ok(Iu::Cmd(c)) => self.command(now, &c, iu, core, allocate),
            Ok(Iu::TskMgmt(t)) => self.task_management(&t, core),
            Ok(Iu::ILogout(_)) => {
                self.closing = Some(Close::InitiatorLogout);
                self.close(false, core);
            }
            Ok(Iu::CredRsp(r)) => match self.credit_requests.iter().position(|t| *t == r.tag) {
                Some(i) => {
                    self.credit_requests.swap_remove(i);
                    self.next_event();
                }
                None => self.log_out(TargetLogoutReason::UnexpectedResponse, core),
            },
            Ok(Iu::AerRsp(r)) if self.event_out == Some(AerOut::Sent(r.tag)) => {
                self.event_out = None;
                self.next_event();
            }
            Ok(Iu::AerRsp(_)) => self.log_out(TargetLogoutReason::UnexpectedResponse, core),
            Ok(_) => self.log_out(TargetLogoutReason::InvalidIuType, core),
            Err(e) => self.malformed(iu, e, core),
        }
        self.pump(now, core);
    }

    /// The buffer task `tag` waited for ([`Event::BufferWanted`]), or `None` when the
    /// allocator can never give it. For a command's data-out the data is read into it by RDMA
    /// READ (with none, the command ends with ABORTED COMMAND, INSUFFICIENT RESOURCES); for a
    /// backend operation the operation runs (with none, it fails as if the backend had).
    pub fn handle_buffer(
        &mut self,
        now: Instant,
        tag: u64,
        buffer: Option<B>,
        core: &mut impl Core,
    ) {
        self.now = Some(now);
        let parked = self.tasks.get(tag).is_some_and(|t| t.is_parked());
        match buffer {
            Some(buffer) if !parked => self.read_data_out(tag, buffer),
            None if !parked => self.carry().fail(tag, Asc::INSUFFICIENT_RESOURCES, core),
            buffer => self.carry().grant_buffer(tag, buffer, now, core),
        }
        self.pump(now, core);
    }

    /// Reads a command's data-out into `buffer` by RDMA READ.
    fn read_data_out(&mut self, tag: u64, mut buffer: B) {
        let Some(t) = self.tasks.get_mut(tag) else {
            return; // Ended meanwhile (aborted): the buffer goes back.
        };
        let Some(len) = t.wanted else {
            return;
        };
        if self.closing.is_some() {
            return;
        }
        buffer.set_len(len as usize);
        let regions = std::mem::take(&mut t.transport.data_out);
        let transfer = take_next(&mut self.next_transfer);
        t.transport.transfer = Some(transfer);
        self.out.push_back(Out::Transfer(Transmit::RdmaRead {
            tag,
            transfer,
            buffer,
            len,
            regions,
        }));
    }

    /// The RDMA READ `transfer` of a command's data-out has ended: `buffer` holds it, or the
    /// transfer failed.
    pub fn handle_data_out(
        &mut self,
        now: Instant,
        tag: u64,
        transfer: u64,
        buffer: B,
        ok: bool,
        core: &mut impl Core,
    ) {
        self.now = Some(now);
        let Some(t) = self.tasks.get_mut(tag) else {
            return;
        };
        if t.transport.transfer != Some(transfer) {
            return; // A command that ended had it: the buffer goes back.
        }
        t.transport.transfer = None;
        let len = t.wanted.unwrap_or(0);
        self.tasks.put_buffer(tag, buffer);
        if !ok {
            self.carry().fail(tag, Asc::DATA_PHASE_ERROR, core);
        } else {
            self.tasks.data_received(tag, len);
            self.carry().deliver_data(tag, core);
        }
        self.pump(now, core);
    }

    /// The descriptor table of RDMA READ `transfer` has been read (`None`: it failed).
    pub fn handle_table(
        &mut self,
        now: Instant,
        tag: u64,
        transfer: u64,
        table: Option<&[u8]>,
        core: &mut impl Core,
    ) {
        self.now = Some(now);
        let Some(t) = self.tasks.get_mut(tag) else {
            return;
        };
        if t.transport.transfer != Some(transfer) {
            return;
        }
        t.transport.transfer = None;
        let Some(w) = t.transport.waiting.take() else {
            return;
        };
        let list = table
            .filter(|b| b.len() == w.table.len as usize)
            .and_then(Descriptors::new);
        let valid = match list {
            Some(list) => {
                let (expected, into) = if w.data_in {
                    (t.data_in_len, &mut t.transport.data_in)
                } else {
                    (t.data_out_len, &mut t.transport.data_out)
                };
                into.clear();
                into.extend(list.iter().map(RemoteRegion::from));
                Some(list.total_len() >= u64::from(expected))
            }
            None => None,
        };
        match valid {
            Some(true) => self.submit(now, tag, &w.cdb, w.attribute, core),
            Some(false) => self.refuse(
                now,
                tag,
                SenseKey::IllegalRequest,
                Asc::INVALID_FIELD_IN_COMMAND_INFORMATION_UNIT,
            ),
            None => self.refuse(now, tag, SenseKey::AbortedCommand, Asc::DATA_PHASE_ERROR),
        }
        self.pump(now, core);
    }

    /// A backend operation has returned with its buffer.
    pub fn handle_backend_done(
        &mut self,
        now: Instant,
        task: TaskId,
        buffer: B,
        result: Result<Output, BackendError>,
        core: &mut impl Core,
    ) {
        self.now = Some(now);
        self.carry().backend_done(task, buffer, result, now, core);
        self.pump(now, core);
    }

    /// Takes what the core reported for this channel (after calls made on its behalf
    /// elsewhere, say another channel's task management).
    pub fn handle_core(&mut self, now: Instant, core: &mut impl Core) {
        self.now = Some(now);
        self.pump(now, core);
    }

    /// The channel is gone (disconnected, or logged out). Commands not yet in the core are
    /// dropped; when the nexus goes on (`nexus_ends` false: other channels remain), the core
    /// aborts the rest; otherwise the caller closes the nexus, which ends them. Either way the
    /// caller goes on handing in core actions and backend completions, dropping the output,
    /// until [`Channel::is_idle`].
    pub fn close(&mut self, nexus_ends: bool, core: &mut impl Core) {
        if self.closed {
            return;
        }
        self.closed = true;
        let waiting: Vec<u64> = self.tasks.not_in_core().collect();
        for tag in waiting {
            if let Some(e) = self.tasks.remove(tag) {
                self.recycle_task(e.transport);
            }
        }
        if nexus_ends {
            return;
        }
        let tasks: Vec<(u64, u64)> = self.tasks.in_core().collect();
        for (tag, lun) in tasks {
            if let Some(reference) = core.task_management(lun, TmfFunction::AbortTask(tag)) {
                self.tmfs.push(PendingTmf {
                    reference,
                    request: None,
                });
            }
        }
    }

    fn target_tag(&mut self) -> u64 {
        take_next(&mut self.next_target_tag)
    }

    /// Ends the channel from the target's side: SRP_T_LOGOUT, then the shell disconnects
    /// once it is out. `nexus_ends` as for [`Channel::close`] (a later login's SINGLE CHANNEL
    /// action replaces the whole nexus).
    pub fn terminate(
        &mut self,
        reason: TargetLogoutReason,
        nexus_ends: bool,
        core: &mut impl Core,
    ) {
        if self.closing.is_some() {
            return;
        }
        tracing::debug!(?reason, "SRP channel logged out by the target");
        self.closing = Some(Close::TargetLogout(reason));
        self.out.push_back(Out::TLogout(reason));
        self.close(nexus_ends, core);
    }

    fn log_out(&mut self, reason: TargetLogoutReason, core: &mut impl Core) {
        self.terminate(reason, false, core);
    }

    /// An IU that did not decode: answered when it is a request whose tag could be read,
    /// else the channel is logged out.
    fn malformed(&mut self, iu: &[u8], e: IuError, core: &mut impl Core) {
        tracing::debug!(error = %e, "malformed SRP IU");
        match e {
            IuError::InvalidField {
                iu: IuType::Cmd | IuType::TskMgmt,
                tag,
                field,
                ..
            } => {
                let format = match field {
                    DATA_OUT_FORMAT => Some(TargetLogoutReason::UnsupportedDataOutFormat),
                    DATA_IN_FORMAT => Some(TargetLogoutReason::UnsupportedDataInFormat),
                    _ => None,
                };
                if let Some(reason) = format {
                    self.log_out(reason, core);
                    return;
                }
                let sol_not = iu.get(1).copied().unwrap_or(0);
                if self.take_credit(tag, sol_not) {
                    self.respond_check(
                        tag,
                        sol_not,
                        SenseKey::IllegalRequest,
                        Asc::INVALID_FIELD_IN_COMMAND_INFORMATION_UNIT,
                    );
                }
            }
            IuError::UnknownType(_) | IuError::InvalidField { .. } => {
                self.log_out(TargetLogoutReason::InvalidIuType, core)
            }
            IuError::Empty | IuError::Truncated { .. } => {
                self.log_out(TargetLogoutReason::InvalidIuLength, core)
            }
        }
    }

    /// Takes a credit for a request; beyond the limit the request is answered BUSY at once
    /// and false returned.
    fn take_credit(&mut self, tag: u64, sol_not: u8) -> bool {
        if self.outstanding >= self.params.request_limit {
            tracing::debug!(tag, "SRP request beyond the request limit");
            self.queue_rsp(Rsp::status(tag, sol_not, Status::Busy));
            return false;
        }
        self.outstanding += 1;
        true
    }

    /// A request holding a credit has ended: its credit is owed back.
    fn release_credit(&mut self) {
        self.outstanding = self.outstanding.saturating_sub(1);
        self.owed += 1;
    }

    fn queue_rsp(&mut self, r: Rsp) {
        self.queued_responses += 1;
        self.out.push_back(Out::Rsp(r));
    }

    /// Answers a request that holds a credit with CHECK CONDITION and gives the credit back.
    fn respond_check(&mut self, tag: u64, sol_not: u8, key: SenseKey, asc: Asc) {
        self.release_credit();
        self.queue_rsp(Rsp {
            sense: Some(Sense::new(key, asc).fixed()),
            ..Rsp::status(tag, sol_not, Status::CheckCondition)
        });
    }

    fn list(&mut self) -> Vec<RemoteRegion> {
        self.lists.pop().unwrap_or_default()
    }

    fn recycle_task(&mut self, t: SrpTask) {
        self.recycle(t.data_out);
        self.recycle(t.data_in);
    }

    fn command(
        &mut self,
        now: Instant,
        c: &SrpCmd<'_>,
        iu: &[u8],
        core: &mut impl Core,
        allocate: &mut impl FnMut(usize) -> Option<B>,
    ) {
        if !self.take_credit(c.tag, c.sol_not) {
            return;
        }
        let len = c.data_in.expected_len().max(c.data_out.expected_len());
        self.trace(Stage::Received, c.tag, len);
        for (d, reason) in [
            (&c.data_out, TargetLogoutReason::UnsupportedDataOutFormat),
            (&c.data_in, TargetLogoutReason::UnsupportedDataInFormat),
        ] {
            let allowed = match d {
                DataBufferDescriptor::None => true,
                DataBufferDescriptor::Direct(_) => {
                    self.params.formats.contains(BufferFormats::DIRECT)
                }
                DataBufferDescriptor::Indirect { .. } => {
                    self.params.formats.contains(BufferFormats::INDIRECT)
                }
                // Only when the login granted it.
                DataBufferDescriptor::Immediate { .. } => self.params.imm_data_offset.is_some(),
            };
            if !allowed {
                self.release_credit();
                self.log_out(reason, core);
                return;
            }
        }
        let mut task = SrpTask {
            sol_not: c.sol_not,
            data_out: self.list(),
            data_in: self.list(),
            waiting: None,
            transfer: None,
        };
        let mut fetch = None;
        let mut valid = true;
        for (d, into, data_in) in [
            (&c.data_out, &mut task.data_out, false),
            (&c.data_in, &mut task.data_in, true),
        ] {
            match d {
                DataBufferDescriptor::Direct(m) => into.push((*m).into()),
                DataBufferDescriptor::Indirect {
                    table,
                    total_len,
                    partial,
                } => {
                    let count = table.len as usize / DESCRIPTOR_LEN;
                    if count > self.params.max_descriptors as usize {
                        valid = false;
                    } else if d.is_complete() {
                        into.extend(partial.iter().map(RemoteRegion::from));
                        valid &= partial.total_len() >= u64::from(*total_len);
                    } else if fetch.is_some() {
                        // Two partial tables in one command: not supported.
                        valid = false;
                    } else {
                        fetch = Some((data_in, *table));
                    }
                }
                DataBufferDescriptor::None | DataBufferDescriptor::Immediate { .. } => {}
            }
        }
        // Immediate data: the whole data-out is here, copied into a task buffer now (the
        // receive buffer goes back when this returns).
        let mut buffer = None;
        let mut received = 0;
        if let DataBufferDescriptor::Immediate { len } = c.data_out {
            let offset = usize::from(self.params.imm_data_offset.unwrap_or(0));
            match c.immediate_data(iu, offset) {
                None => valid = false,
                Some(data) if valid => match allocate(data.len()) {
                    Some(mut b) => {
                        b.set_len(data.len());
                        b.copy_from_slice(data);
                        buffer = Some(b);
                        received = len;
                    }
                    None => {
                        // No room without waiting, and the IU cannot wait: BUSY, which the
                        // initiator retries.
                        self.recycle_task(task);
                        self.release_credit();
                        self.queue_rsp(Rsp::status(c.tag, c.sol_not, Status::Busy));
                        return;
                    }
                },
                Some(_) => {}
            }
        }
        let data_out_len = c.data_out.expected_len();
        let data_in_len = c.data_in.expected_len();
        if !valid {
            self.recycle_task(task);
            self.respond_check(
                c.tag,
                c.sol_not,
                SenseKey::IllegalRequest,
                Asc::INVALID_FIELD_IN_COMMAND_INFORMATION_UNIT,
            );
            return;
        }
        let attribute = c.task_attribute.into();
        if let Some((data_in, table)) = fetch {
            task.transfer = Some(take_next(&mut self.next_transfer));
            task.waiting = Some(Waiting {
                cdb: c.cdb.to_vec(),
                attribute,
                data_in,
                table,
            });
        }
        let transfer = task.transfer;
        let new = NewTask {
            lun: c.lun,
            data_out_len,
            data_in_len,
            buffer,
            received,
            transport: task,
        };
        if let Err(TagError::InUse(tag)) = self.tasks.insert(c.tag, new, now) {
            // The task with this tag goes on; the new command is refused.
            self.respond_check(
                tag,
                c.sol_not,
                SenseKey::AbortedCommand,
                Asc::OVERLAPPED_COMMANDS_ATTEMPTED,
            );
            return;
        }
        if let (Some((_, table)), Some(transfer)) = (fetch, transfer) {
            self.out.push_back(Out::Transfer(Transmit::ReadTable {
                tag: c.tag,
                transfer,
                table: table.into(),
            }));
            return;
        }
        self.submit(now, c.tag, c.cdb, attribute, core);
    }

    /// Hands a command in the table to the core.
    fn submit(
        &mut self,
        now: Instant,
        tag: u64,
        cdb: &[u8],
        attribute: scsi_core::TaskAttribute,
        core: &mut impl Core,
    ) {
        let Some(t) = self.tasks.get(tag) else {
            return;
        };
        let cmd = Command {
            nexus: self.nexus,
            lun: t.lun,
            cdb,
            attribute,
            tag,
            data_in_len: t.data_in_len,
            data_out_len: t.data_out_len,
        };
        match core.submit(cmd) {
            Ok(task) => {
                self.tasks.submitted(tag, task);
                self.trace(Stage::Dispatched, tag, 0);
            }
            Err(e) => {
                tracing::warn!("the SCSI core refused an SRP command: {e}");
                self.refuse(
                    now,
                    tag,
                    SenseKey::AbortedCommand,
                    Asc::INTERNAL_TARGET_FAILURE,
                );
            }
        }
    }

    /// Ends a command the core does not hold with CHECK CONDITION.
    fn refuse(&mut self, now: Instant, tag: u64, key: SenseKey, asc: Asc) {
        if let Some(c) = self.tasks.refuse(tag, key, asc, now) {
            self.respond(c);
        }
    }

    fn task_management(&mut self, t: &SrpTskMgmt, core: &mut impl Core) {
        if !self.take_credit(t.tag, t.sol_not) {
            return;
        }
        let Some(f) = t.function.to_core(t.task_tag) else {
            self.tmf_reply(t.tag, t.sol_not, ResponseCode::NotSupported, [0; 3]);
            return;
        };
        match core.task_management(t.lun, f) {
            Some(reference) => self.tmfs.push(PendingTmf {
                reference,
                request: Some((t.tag, t.sol_not)),
            }),
            None => self.tmf_reply(t.tag, t.sol_not, ResponseCode::Failed, [0; 3]),
        }
    }

    fn tmf_done(&mut self, reference: u64, response: TmfResponse) {
        let Some(i) = self.tmfs.iter().position(|p| p.reference == reference) else {
            return;
        };
        let p = self.tmfs.swap_remove(i);
        let Some((tag, sol_not)) = p.request else {
            return;
        };
        let (code, info) = match response {
            TmfResponse::Complete => (ResponseCode::Complete, [0; 3]),
            TmfResponse::Succeeded(info) => (ResponseCode::Succeeded, info.unwrap_or_default()),
            // SAM-5: aborting a task that is not in the task set completes the function.
            TmfResponse::TaskNotFound => (ResponseCode::Complete, [0; 3]),
            TmfResponse::IncorrectLun => (ResponseCode::IncorrectLun, [0; 3]),
            TmfResponse::Rejected => (ResponseCode::NotSupported, [0; 3]),
        };
        self.tmf_reply(tag, sol_not, code, info);
    }

    /// Answers a task management function (its credit given back): response data with the
    /// code, and a query's additional response information in bytes 0..3.
    fn tmf_reply(&mut self, tag: u64, sol_not: u8, code: ResponseCode, info: [u8; 3]) {
        self.release_credit();
        if self.closed {
            return;
        }
        let mut response = code.response_data();
        response[..3].copy_from_slice(&info);
        self.queue_rsp(Rsp {
            response: Some(response),
            ..Rsp::status(tag, sol_not, Status::Good)
        });
    }

    /// Takes every action the core reported for this channel, then gives back owed credit
    /// when no response is due to carry it.
    fn pump(&mut self, now: Instant, core: &mut impl Core) {
        while let Some(a) = core.poll_core() {
            self.carry().action(a, now, core);
        }
        let answering = self.queued_responses > 0 || self.tmfs.iter().any(|t| t.request.is_some());
        if self.owed > 0
            && !answering
            && !self.credit_queued
            && self.event_out.is_none()
            && self.tasks.is_empty()
            && !self.closed
        {
            self.credit_queued = true;
            self.out.push_back(Out::CredReq);
        }
    }

    /// A unit attention to report by SRP_AER_REQ (SRP-2 6.12), one at a time.
    fn unit_attention(&mut self, lun: u64, sense: SenseBytes) {
        if self.closing.is_some() || self.closed {
            return;
        }
        if self.events_pending.len() == PENDING_EVENTS {
            self.events_pending.pop_front();
        }
        self.events_pending.push_back((lun, sense));
        self.next_event();
    }

    /// Queues the next SRP_AER_REQ when no request of the target's is outstanding: the
    /// initiator keeps one receive spare for them (Linux's ib_srp: SRP_RSP_SQ_SIZE), so a
    /// second at once could find none.
    fn next_event(&mut self) {
        if self.event_out.is_some()
            || self.credit_queued
            || !self.credit_requests.is_empty()
            || self.closing.is_some()
            || self.closed
        {
            return;
        }
        if let Some((lun, sense)) = self.events_pending.pop_front() {
            self.event_out = Some(AerOut::Queued);
            self.out.push_back(Out::AerReq { lun, sense });
        }
    }

    fn respond(&mut self, mut c: Completion<SrpTask, B>) {
        self.release_credit();
        let data_in = std::mem::take(&mut c.transport.data_in);
        let data_out = std::mem::take(&mut c.transport.data_out);
        let reads = !data_in.is_empty();
        self.recycle(data_out);
        if self.closed {
            self.recycle(data_in);
            return;
        }
        let payload = match c.data_in {
            DataIn::Buffer { len } if len > 0 => c.buffer.take().map(|b| (Payload::Buffer(b), len)),
            DataIn::Parameter(v) if !v.is_empty() => {
                let len = v.len() as u32;
                Some((Payload::Bytes(v), len))
            }
            _ => None,
        };
        match payload {
            Some((payload, len)) => self.out.push_back(Out::Transfer(Transmit::RdmaWrite {
                tag: c.tag,
                payload,
                len,
                regions: data_in,
            })),
            None => self.recycle(data_in),
        }
        let (data_in_residual, data_out_residual) = if reads {
            (c.residual, Residual::None)
        } else {
            (Residual::None, c.residual)
        };
        self.queue_rsp(Rsp {
            data_in_residual,
            data_out_residual,
            sense: c.sense,
            ..Rsp::status(c.tag, c.transport.sol_not, c.status)
        });
    }
}

/// A channel carrying out its task table's requests: the part every transport shares is
/// scsi-core's ([`Carrier`]'s provided methods), this is SRP's. A private view, so that the
/// hooks are not the channel's API.
struct Carry<'a, B>(&'a mut Channel<B>);

impl<B: TaskBuffer, C: Core> Carrier<B, C> for Carry<'_, B> {
    type Task = SrpTask;

    fn tasks(&mut self) -> &mut TaskTable<SrpTask, B> {
        &mut self.0.tasks
    }

    fn event(&mut self, event: Event<B>) {
        self.0.events.push_back(event);
    }

    fn tracing(&self) -> bool {
        self.0.trace.is_on()
    }

    fn trace(&mut self, stage: Stage, tag: u64, arg: u32) {
        self.0.trace(stage, tag, arg);
    }

    /// The target moves data-out itself: a buffer for it, then RDMA READ
    /// ([`Channel::handle_buffer`]).
    fn fetch_data_out(&mut self, tag: u64, len: u32, received: u32, _core: &mut C) {
        if received < len {
            self.0.trace(Stage::BufferWait, tag, len);
            self.0.events.push_back(Event::BufferWanted {
                tag,
                len: len as usize,
            });
        }
    }

    /// Data-in by RDMA WRITE, then the SRP_RSP.
    fn respond(&mut self, completion: Completion<SrpTask, B>, _core: &mut C) {
        self.0.respond(completion);
    }

    /// Its credit is owed (given back with the next response or an SRP_CRED_REQ), its
    /// descriptor lists kept for the next command.
    fn forget(&mut self, _tag: u64, entry: &mut TaskEntry<SrpTask, B>) {
        self.0.release_credit();
        let t = std::mem::take(&mut entry.transport);
        self.0.recycle_task(t);
    }

    fn tmf_done(&mut self, reference: u64, response: TmfResponse, _core: &mut C) {
        self.0.tmf_done(reference, response);
    }

    fn aborting(&mut self, reference: u64) {
        self.0.tmfs.push(PendingTmf {
            reference,
            request: None,
        });
    }

    /// Reported by SRP_AER_REQ.
    fn unit_attention(&mut self, lun: u64, sense: SenseBytes) {
        self.0.unit_attention(lun, sense);
    }
}
