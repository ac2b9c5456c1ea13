//! One target connection in full feature phase (RFC 7143 sections 4 and 11), as a state machine
//! without I/O: SCSI commands into the session's CmdSN order, R2Ts and Data-Out, Data-In with
//! phase collapse, NOP-In pings on the caller's clock, text, logout, task management and Reject.
//!
//! # Driving it
//!
//! The caller reads PDUs header first (the [`Deframer`](crate::Deframer)'s `next_header` mode)
//! and hands each in; the connection answers with a [`Plan`] for the payload:
//!
//! 1. a whole PDU goes to [`Connection::handle_pdu`], a header whose payload is still on the wire
//!    to [`Connection::handle_header`], a PDU the deframer rejected to
//!    [`Connection::handle_reject`];
//! 2. [`Plan::Allocate`]: a write command wants its data buffer; the caller allocates it
//!    and calls [`Connection::handle_allocated`], which gives the next plan. Waiting for it
//!    is the connection's backpressure, but only while [`Connection::may_wait_for_buffer`]:
//!    otherwise what would free the space may be data behind the command in the stream, so
//!    the caller answers [`NoBuffer::Busy`] when none is free now (TASK SET FULL);
//! 3. [`Plan::Receive`]: the payload goes into `buffer[at..at + len]`; the caller reads it there
//!    and hands the buffer back with [`Connection::handle_payload`] (or
//!    [`Connection::handle_payload_error`] on a data digest mismatch);
//! 4. [`Plan::Discard`]: the payload is skipped; [`Plan::Next`]: read the next header.
//!
//! What the SCSI core decides comes back through [`Core::poll_core`] (or
//! [`Connection::handle_core`]); backend completions through
//! [`Connection::handle_backend_done`]; buffers for backend operations through
//! [`Connection::handle_buffer`]; time through [`Connection::handle_timeout`].
//!
//! After each input the caller drains, in this order: [`Connection::poll_event`] (backend
//! operations, buffers wanted, accounting; it takes in the core's events on the way),
//! [`Connection::poll_transmit`] (the output, in StatSN order), then
//! [`Connection::poll_timeout`] and [`Connection::closing`].
//!
//! The session and the SCSI core behind it are reached through the [`Core`] trait: the daemon
//! implements it over its shared state, a test over one in-process device.

use std::collections::VecDeque;
use std::ops::{Deref, Range};
use std::time::{Duration, Instant};

use cmdtrace::{Points, Stage};

use bytes::{BufMut, Bytes, BytesMut};
use scsi_core::transport::{Carrier, Completion, NewTask, TaskBuffer, TaskEntry, TaskTable};
pub use scsi_core::transport::{Event, TaskCore};
use scsi_core::{
    Asc, BackendError, Command, DataIn as CoreDataIn, NexusId, Output, Residual as CoreResidual,
    SenseKey, Status as CoreStatus, TaskAttribute as CoreAttribute, TaskId, TmfFunction,
    TmfResponse,
};

use super::text::TextExchange;
use crate::handover::ConnectionState;
use crate::negotiation::{Negotiator, OperationalParams, SessionParams, SessionType};
use crate::text::TextParams;
use crate::{
    data_digest, padding, AsyncEvent, AsyncMessage, Bhs, DataIn, DataInStatus, DataOut, Digests,
    LogoutReason, LogoutRequest, LogoutResponse, LogoutResponseCode, Lun, NopIn, NopOut, Pdu,
    ReadyToTransfer, Reject, RejectReason, Residual, ScsiCommand, ScsiResponse, ScsiStatus,
    SerialNumber, TaskAttribute, TaskManagementFunction, TaskManagementRequest,
    TaskManagementResponse, TmfResponse as IscsiTmfResponse, RESERVED_TAG,
};

/// Seconds the Asynchronous Message that asks for a logout gives the initiator.
pub const LOGOUT_GRACE: u16 = 5;

/// A SCSI command ready for the session's CmdSN order and then the SCSI core.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OrderedCommand {
    /// CmdSN.
    pub cmd_sn: SerialNumber,
    /// The 8-byte LUN field.
    pub lun: u64,
    /// The CDB (16 bytes; shorter CDBs are zero-padded).
    pub cdb: [u8; 16],
    /// Task attribute.
    pub attribute: CoreAttribute,
    /// Initiator Task Tag.
    pub itt: u32,
    /// Expected data-in length.
    pub data_in_len: u32,
    /// Expected data-out length.
    pub data_out_len: u32,
}

/// What the SCSI core hands back to the connection that owns a task (scsi-core's, shared by
/// every transport).
pub use scsi_core::transport::CoreEvent;

impl OrderedCommand {
    /// The command as the SCSI core takes it, for the I_T nexus `nexus`.
    pub fn command(&self, nexus: NexusId) -> Command<'_> {
        Command {
            nexus,
            lun: self.lun,
            cdb: &self.cdb,
            attribute: self.attribute,
            tag: u64::from(self.itt),
            data_in_len: self.data_in_len,
            data_out_len: self.data_out_len,
        }
    }
}

/// The session and the SCSI core as one connection reaches them: the calls every transport
/// makes for its tasks ([`TaskCore`]) and iSCSI's own. Calls into the core report what
/// follows for this connection as [`CoreEvent`]s, which [`Core::poll_core`] hands back (to
/// [`Connection::poll_event`]) once the call has returned.
pub trait Core: TaskCore {
    /// The next event the SCSI core reported for this connection.
    fn poll_core(&mut self) -> Option<CoreEvent>;
    /// ExpCmdSN and MaxCmdSN to advertise now.
    fn window(&self) -> (SerialNumber, SerialNumber);
    /// Hands `cmd` to the core in CmdSN order (at once when `immediate`). False when it is
    /// outside the window: the connection forgets it (RFC 7143 drops it silently).
    fn deliver(&mut self, cmd: OrderedCommand, immediate: bool) -> bool;
    /// Takes `cmd_sn` for a request handled on arrival; false when outside the window.
    fn take_cmd_sn(&mut self, cmd_sn: SerialNumber) -> bool;
    /// The answer to `SendTargets=value` for this initiator on this portal.
    fn send_targets(&mut self, value: &str) -> TextParams;
    /// Closes the session's connection `cid` (a logout naming another connection); false when
    /// there is none.
    fn close_connection(&mut self, cid: u16) -> bool;
    /// Drops this connection's commands still waiting for their CmdSN turn (it has closed);
    /// their numbers stay taken.
    fn cancel_queued(&mut self);
    /// Closes the session's other connections (a logout of the session). `Some(reference)`:
    /// the session's I_T nexus first gives up what it holds beyond this target (an SPC-2
    /// reservation shared with other gateways) through a task management function, and the
    /// logout is answered once [`Action::TaskManagementDone`](scsi_core::Action::TaskManagementDone) names that reference, so that
    /// what the initiator does next through another gateway finds it released.
    fn close_session(&mut self) -> Option<u64>;
    /// Closes every other session of the target and this session's other connections (TARGET
    /// COLD RESET, RFC 7143 section 11.5.1).
    fn reset_target(&mut self);
}

/// Where a Data-In sequence's bytes are.
#[derive(Debug)]
pub enum Payload<B> {
    /// A task's buffer the backend read into.
    Buffer(B),
    /// Parameter data the SCSI core built.
    Bytes(Bytes),
}

impl<B: Deref<Target = [u8]>> Payload<B> {
    /// Its bytes.
    pub fn as_slice(&self) -> &[u8] {
        match self {
            Payload::Buffer(b) => b,
            Payload::Bytes(b) => b,
        }
    }
}

/// One unit of output, in StatSN order.
#[derive(Debug)]
#[must_use = "a transmit is output the initiator waits for"]
pub enum Transmit<B> {
    /// A PDU with its data segment inline.
    Pdu(Pdu),
    /// A command's read data, to be cut into Data-In PDUs of at most `max_segment` bytes
    /// (the initiator's MaxRecvDataSegmentLength) with DataSN from 0, the last carrying the
    /// status when `status` is given (phase collapse). ExpCmdSN and MaxCmdSN are stamped when it
    /// is encoded.
    DataIn {
        /// Initiator Task Tag.
        itt: u32,
        /// LUN.
        lun: Lun,
        /// The data.
        payload: Payload<B>,
        /// Bytes of `payload` to send.
        len: u32,
        /// Status for the last PDU.
        status: Option<DataInStatus>,
    },
}

impl<B: Deref<Target = [u8]>> Transmit<B> {
    /// The Data-In PDUs a [`Transmit::DataIn`] goes out as, each with the range of the payload
    /// its data segment carries: segments of at most `max_segment` bytes (at least 512), DataSN
    /// from 0, the status in the last. Nothing for a [`Transmit::Pdu`].
    pub fn data_in_pdus(
        &self,
        max_segment: u32,
        exp_cmd_sn: SerialNumber,
        max_cmd_sn: SerialNumber,
    ) -> impl Iterator<Item = (Pdu, Range<usize>)> + '_ {
        let (itt, lun, len, status, count) = match self {
            Transmit::DataIn {
                itt,
                lun,
                len,
                status,
                ..
            } => (*itt, *lun, *len, *status, data_in_count(*len, max_segment)),
            Transmit::Pdu(_) => (0, Lun::ZERO, 0, None, 0),
        };
        let (len, count) = (len as usize, count as usize);
        let max = max_segment.max(512) as usize;
        (0..count).map(move |n| {
            let start = n * max;
            let end = (start + max).min(len);
            let last = n + 1 == count;
            let pdu = Pdu::DataIn(DataIn {
                final_bit: last,
                status: if last { status } else { None },
                lun,
                initiator_task_tag: itt,
                target_transfer_tag: RESERVED_TAG,
                exp_cmd_sn,
                max_cmd_sn,
                data_sn: n as u32,
                buffer_offset: start as u32,
                ..DataIn::default()
            });
            (pdu, start..end)
        })
    }

    /// Appends the whole unit to `dst` as it goes on the wire (headers, data, padding,
    /// digests). A daemon sends headers and payload slices apart instead, without the copy.
    pub fn encode(
        &self,
        digests: Digests,
        max_segment: u32,
        exp_cmd_sn: SerialNumber,
        max_cmd_sn: SerialNumber,
        dst: &mut BytesMut,
    ) {
        match self {
            Transmit::Pdu(pdu) => pdu.encode(digests, dst),
            Transmit::DataIn { payload, .. } => {
                for (pdu, range) in self.data_in_pdus(max_segment, exp_cmd_sn, max_cmd_sn) {
                    let data = &payload.as_slice()[range];
                    pdu.encode_header(data.len() as u32, digests.header, dst);
                    dst.extend_from_slice(data);
                    dst.extend_from_slice(padding(data.len()));
                    if digests.data && !data.is_empty() {
                        dst.put_u32_le(data_digest([data]));
                    }
                }
            }
        }
    }
}

/// What to do with the payload of the PDU just handed in.
#[derive(Debug)]
#[must_use = "a plan says where the payload goes; ignored, the stream is misread"]
pub enum Plan<B> {
    /// There is none (or it came inline): read the next header.
    Next,
    /// Skip it.
    Discard,
    /// A write command needs a data buffer of this many bytes first: allocate one and hand
    /// it to [`Connection::handle_allocated`]. Wait while the allocator is short only if
    /// [`Connection::may_wait_for_buffer`]; else answer [`NoBuffer::Busy`].
    Allocate(u32),
    /// Read it into `buffer[at..at + len]`, then return the buffer with
    /// [`Connection::handle_payload`] or [`Connection::handle_payload_error`].
    Receive {
        /// The task's buffer, lent while the payload is read.
        buffer: B,
        /// Where the payload starts in it.
        at: usize,
        /// The payload's length.
        len: usize,
    },
}

/// Why the caller has no buffer for a [`Plan::Allocate`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NoBuffer {
    /// More than the allocator can ever give: CHECK CONDITION, ILLEGAL REQUEST, INVALID FIELD
    /// IN CDB.
    TooLarge,
    /// None free now, and waiting could wait for data behind the command
    /// ([`Connection::may_wait_for_buffer`] is false): TASK SET FULL, which an initiator
    /// answers by sending the command again later (SAM-5 5.3.1).
    Busy,
}

/// What keeps a connection from being handed over ([`Connection::handover`]) now.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum Busy {
    /// Tasks (or their R2Ts or task management functions) are not over.
    #[error("tasks in flight")]
    Tasks,
    /// A payload is being read into a buffer.
    #[error("a payload half read")]
    Receiving,
    /// A text exchange is half done.
    #[error("a text exchange in pieces")]
    Text,
    /// Output or events wait for the shell.
    #[error("output not yet taken")]
    Output,
    /// A NOP-In ping waits for its answer.
    #[error("a ping unanswered")]
    Ping,
    /// The connection is closing.
    #[error("closing")]
    Closing,
}

/// Why the connection is to close.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Close {
    /// A logout was answered, or a TARGET COLD RESET: send what is queued, then close.
    AfterFlush,
    /// The initiator did not answer a NOP-In ping in time: close at once.
    NoPingAnswer,
    /// The initiator owed data-out and sent none for the data-out timeout: close at once.
    DataOutTimeout,
}

/// A connection's fixed settings.
#[derive(Debug, Clone, Copy)]
pub struct Settings {
    /// Its CID.
    pub cid: u16,
    /// A discovery session takes only text (SendTargets), NOP-Out and Logout (RFC 7143 section
    /// 4.3); anything else is rejected.
    pub session_type: SessionType,
    /// The largest data transfer of one command, in bytes; larger ones end with CHECK
    /// CONDITION, INVALID FIELD IN CDB.
    pub max_io: u32,
    /// Ping an initiator silent this long with a NOP-In; zero: never.
    pub nop_interval: Duration,
    /// Close when a ping is not answered in this long.
    pub nop_timeout: Duration,
    /// Close when the initiator owes data-out (an R2T, unsolicited data, or the command an
    /// earlier CmdSN names, while a later one holds its buffer) and has sent none, nor a
    /// write that got a buffer, for this long: at ErrorRecoveryLevel 0 nothing can be asked
    /// for again, and the buffers it holds are its connection's share of the arena. Zero:
    /// never.
    pub data_out_timeout: Duration,
}

/// iSCSI's own state of a task: R2T and DataSN bookkeeping (RFC 7143 sections 11.7-11.8).
/// The rest (buffer, lengths, the core's handle, accounting) is the task layer's.
#[derive(Debug)]
pub struct IscsiTask {
    /// The next offset to solicit: the initiator may send up to here without an R2T.
    next_r2t: u32,
    outstanding_r2t: u16,
    r2t_sn: u32,
    /// The next DataSN of the unsolicited Data-Out sequence.
    unsolicited_data_sn: u32,
}

/// Who asked for a task management function.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Tmf {
    /// The connection itself (aborting a failed task, or its tasks at close): no response.
    Internal,
    /// The initiator: a Task Management Function Response.
    Initiator,
    /// The initiator's TARGET COLD RESET: the response, then every connection closes.
    ColdReset,
    /// A logout of the session waiting for its nexus to let go: then the Logout Response.
    Logout,
    /// A handover's park ran out of time while the task waited for its data-out: the task
    /// ends with TASK ABORTED status ([`Connection::abort_awaiting_data_out`]).
    Park,
}

/// A payload being read into a task's buffer.
#[derive(Debug)]
enum Receiving {
    /// A write command waiting for its buffer, with this much immediate data on the wire.
    Buffer(ScsiCommand, u32),
    /// A command's immediate data.
    Command(ScsiCommand, u32),
    /// A Data-Out's data.
    DataOut(DataOut, u32),
}

/// One target connection in full feature phase. `B` is the task buffer type (the daemon's
/// registered arena slots; `Vec<u8>` in tests).
#[derive(Debug)]
pub struct Connection<B> {
    settings: Settings,
    op: OperationalParams,
    negotiator: Negotiator,
    /// The initiator's MaxRecvDataSegmentLength.
    max_send: u32,
    stat_sn: SerialNumber,
    tasks: TaskTable<IscsiTask, B>,
    next_ttt: u32,
    /// Outstanding R2Ts by TTT: (ITT, next DataSN).
    r2ts: scsi_core::transport::TagMap<u32, (u32, u32)>,
    /// Task management functions in the core: (reference, ITT, who asked).
    tmfs: Vec<(u64, u32, Tmf)>,
    text: TextExchange,
    receiving: Option<Receiving>,
    transmits: VecDeque<Transmit<B>>,
    events: VecDeque<Event<B>>,
    closing: Option<Close>,
    /// A NOP-In ping awaiting its NOP-Out: (TTT, sent).
    ping: Option<(u32, Instant)>,
    last_rx: Instant,
    /// When data-out last arrived or a write got its buffer, or the data-out timeout last
    /// found nothing owed: what the initiator owes began no earlier.
    data_out_seen: Instant,
    logout_asked: bool,
    /// The `now` of the last call in, which the trace points deep inside a call stamp.
    now: Instant,
    /// Trace points not yet taken ([`Connection::trace_points`]).
    trace: Points,
}

fn attribute(a: TaskAttribute) -> CoreAttribute {
    match a {
        TaskAttribute::Ordered => CoreAttribute::Ordered,
        TaskAttribute::HeadOfQueue => CoreAttribute::HeadOfQueue,
        TaskAttribute::Aca => CoreAttribute::Aca,
        _ => CoreAttribute::Simple,
    }
}

/// How many Data-In PDUs carry `len` bytes in segments of at most `max_segment` (at least 512):
/// at least one, for the status.
fn data_in_count(len: u32, max_segment: u32) -> u32 {
    len.div_ceil(max_segment.max(512)).max(1)
}

/// Hands out a Target Transfer Tag: never the reserved tag, never the top bit (kept clear for
/// the text exchange's continuation tag range).
fn next_ttt(counter: &mut u32) -> u32 {
    let ttt = *counter;
    *counter = counter.wrapping_add(1).max(1) & 0x7fff_ffff;
    ttt
}

fn residual(r: CoreResidual) -> Residual {
    match r {
        CoreResidual::None => Residual::None,
        CoreResidual::Overflow(n) => Residual::Overflow(n),
        CoreResidual::Underflow(n) => Residual::Underflow(n),
    }
}

impl<B: TaskBuffer> Connection<B> {
    /// A connection whose login has just ended: `negotiator` holds what was negotiated (and
    /// renegotiates in text exchanges), `op` the session's operational parameters, `stat_sn`
    /// the next StatSN.
    pub fn new(
        now: Instant,
        settings: Settings,
        negotiator: Negotiator,
        op: OperationalParams,
        stat_sn: SerialNumber,
    ) -> Connection<B> {
        let max_send = negotiator.connection().max_send_data_segment_length;
        Connection {
            settings,
            op,
            negotiator,
            max_send,
            stat_sn,
            tasks: TaskTable::new(),
            next_ttt: 1,
            r2ts: scsi_core::transport::tag_map(256),
            tmfs: Vec::new(),
            text: TextExchange::default(),
            receiving: None,
            transmits: VecDeque::with_capacity(256),
            events: VecDeque::with_capacity(256),
            closing: None,
            ping: None,
            last_rx: now,
            data_out_seen: now,
            logout_asked: false,
            now,
            trace: Points::default(),
        }
    }

    /// A connection handed over by another process ([`crate::handover`]) where `state` left
    /// it: its StatSN, Target Transfer Tags and logout request go on from there. `negotiator`
    /// is [`Negotiator::established`] with what was agreed, `op` the session's operational
    /// parameters, `settings.cid` the state's CID. The bytes the old reader had not made
    /// into PDUs (`state.unread`) are the shell's to feed first.
    pub fn resume(
        now: Instant,
        settings: Settings,
        negotiator: Negotiator,
        op: OperationalParams,
        state: &ConnectionState,
    ) -> Connection<B> {
        let mut c = Connection::new(now, settings, negotiator, op, state.stat_sn);
        c.next_ttt = state.next_ttt;
        c.logout_asked = state.logout_asked;
        c
    }

    /// The connection's state for another process to resume it ([`Connection::resume`]),
    /// when it is quiescent: no task (nor backend operation, R2T or task management
    /// function) left, no text exchange half done, nothing waiting to be read into a buffer
    /// or sent, no ping unanswered, not closing. Else [`Busy`] says what is left; the shell
    /// stops reading new PDUs and lets that end first. `unread` is left empty for the shell,
    /// which holds the bytes read ahead.
    pub fn handover(&self) -> Result<ConnectionState, Busy> {
        let busy = if !self.tasks.is_empty() || !self.r2ts.is_empty() || !self.tmfs.is_empty() {
            Some(Busy::Tasks)
        } else if self.receiving.is_some() {
            Some(Busy::Receiving)
        } else if !self.text.is_idle() {
            Some(Busy::Text)
        } else if !self.transmits.is_empty() || !self.events.is_empty() {
            Some(Busy::Output)
        } else if self.ping.is_some() {
            Some(Busy::Ping)
        } else if self.closing.is_some() {
            Some(Busy::Closing)
        } else {
            None
        };
        if let Some(b) = busy {
            return Err(b);
        }
        Ok(ConnectionState {
            cid: self.settings.cid,
            params: *self.negotiator.connection(),
            stat_sn: self.stat_sn,
            next_ttt: self.next_ttt,
            logout_asked: self.logout_asked,
            unread: Vec::new(),
        })
    }

    /// Tells the initiator the command window as it is now (ExpCmdSN, MaxCmdSN) with a NOP-In
    /// that asks for no answer: ITT and TTT 0xffffffff, StatSN not advanced (RFC 7143 section
    /// 11.19). After a handover held MaxCmdSN back (the window closes as commands are taken),
    /// an initiator with nothing in flight would otherwise wait for an answer that never
    /// comes to learn that it may send again.
    pub fn announce_window(&mut self, nexus: &mut impl Core) {
        let (exp, max) = nexus.window();
        self.transmit(Pdu::NopIn(NopIn {
            lun: Lun::ZERO,
            initiator_task_tag: RESERVED_TAG,
            target_transfer_tag: RESERVED_TAG,
            stat_sn: self.stat_sn,
            exp_cmd_sn: exp,
            max_cmd_sn: max,
            data: Bytes::new(),
        }));
    }

    /// Whether something begun waits for the initiator's next PDUs: a task's data-out
    /// (solicited or not), a payload half read, a text exchange's next request, the answer
    /// to a ping. A shell quiescing the connection for a [`Connection::handover`] stops
    /// reading only when this is false: a task that cannot finish without more input would
    /// keep it busy for good.
    pub fn awaits_initiator(&self) -> bool {
        self.tasks.awaits_data_out()
            || !self.r2ts.is_empty()
            || self.receiving.is_some()
            || !self.text.is_idle()
            || self.ping.is_some()
    }

    /// What the session's login (and text exchanges since) agreed, as this connection knows
    /// it: with [`Connection::handover`], the session's part of a handover.
    pub fn session_params(&self) -> &SessionParams {
        self.negotiator.session()
    }

    /// Its trace points (each command's stages, `cmdtrace`): off until set on; the shell
    /// takes them after each step.
    pub fn trace_points(&mut self) -> &mut Points {
        &mut self.trace
    }

    /// Notes that command `itt` reached `stage` (when tracing).
    #[inline]
    fn trace(&mut self, stage: Stage, itt: u32, cmd_sn: u32, arg: u32) {
        self.trace.push(self.now, stage, itt, cmd_sn, arg);
    }

    /// The connection as it carries out its task table's requests (scsi-core's [`Carrier`]).
    fn carry(&mut self) -> Carry<'_, B> {
        Carry(self)
    }

    /// Its CID.
    pub fn cid(&self) -> u16 {
        self.settings.cid
    }

    /// The initiator's MaxRecvDataSegmentLength now (a text exchange may change it).
    pub fn max_send_data_segment_length(&self) -> u32 {
        self.max_send
    }

    /// The MaxRecvDataSegmentLength this side declared (TargetRecvDataSegmentLength under
    /// iSER): the longest data segment the initiator may send.
    pub fn max_recv_data_segment_length(&self) -> u32 {
        self.negotiator.connection().max_recv_data_segment_length
    }

    /// The session's operational parameters.
    pub fn operational(&self) -> &OperationalParams {
        &self.op
    }

    /// Whether a task with this Initiator Task Tag is in the table.
    pub fn has_task(&self, itt: u32) -> bool {
        self.tasks.contains(u64::from(itt))
    }

    /// The next StatSN.
    pub fn stat_sn(&self) -> SerialNumber {
        self.stat_sn
    }

    /// Tasks in the table.
    pub fn task_count(&self) -> usize {
        self.tasks.len()
    }

    /// Whether no task is left (nor waits for its backend operation).
    pub fn is_idle(&self) -> bool {
        self.tasks.idle()
    }

    /// Why the connection is to close, once it is.
    pub fn closing(&self) -> Option<Close> {
        self.closing
    }

    /// The next unit of output.
    pub fn poll_transmit(&mut self) -> Option<Transmit<B>> {
        self.transmits.pop_front()
    }

    /// The next request for the caller, handling what the core reported on the way (its
    /// events are taken from [`Core::poll_core`] whenever no request is left).
    pub fn poll_event(&mut self, now: Instant, nexus: &mut impl Core) -> Option<Event<B>> {
        self.now = now;
        loop {
            if let Some(ev) = self.events.pop_front() {
                return Some(ev);
            }
            let core = nexus.poll_core()?;
            self.handle_core(now, core, nexus);
        }
    }

    /// When [`Connection::handle_timeout`] is next due.
    pub fn poll_timeout(&self) -> Option<Instant> {
        let ping = self.pings().then(|| match self.ping {
            Some((_, sent)) => sent + self.settings.nop_timeout,
            None => self.last_rx + self.settings.nop_interval,
        });
        let data_out = self
            .checks_data_out()
            .then(|| self.data_out_seen + self.settings.data_out_timeout);
        match (ping, data_out) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }

    /// Time has passed: give up on an initiator that owes data-out and has sent none for the
    /// data-out timeout; ping one silent for the NOP interval, give up on one that does not
    /// answer a ping within the NOP timeout.
    pub fn handle_timeout(&mut self, now: Instant, nexus: &mut impl Core) {
        self.now = now;
        let since = now.saturating_duration_since(self.data_out_seen);
        if self.checks_data_out() && since >= self.settings.data_out_timeout {
            // The pass over the tasks is paid once per timeout, not per PDU.
            if self.owes_data_out() {
                let after = self.settings.data_out_timeout;
                self.give_up(Close::DataOutTimeout, "data-out owed and none sent", after);
                return;
            }
            self.data_out_seen = now;
        }
        if !self.pings() {
            return;
        }
        if let Some((_, sent)) = self.ping {
            let after = self.settings.nop_timeout;
            if now.saturating_duration_since(sent) >= after {
                self.give_up(Close::NoPingAnswer, "no answer to NOP-In", after);
            }
            return;
        }
        if now.saturating_duration_since(self.last_rx) >= self.settings.nop_interval {
            let ttt = next_ttt(&mut self.next_ttt);
            let (exp, max) = nexus.window();
            self.ping = Some((ttt, now));
            // A ping takes no StatSN (RFC 7143 section 11.19.2).
            self.transmit(Pdu::NopIn(NopIn {
                lun: Lun::ZERO,
                initiator_task_tag: RESERVED_TAG,
                target_transfer_tag: ttt,
                stat_sn: self.stat_sn,
                exp_cmd_sn: exp,
                max_cmd_sn: max,
                data: Bytes::new(),
            }));
        }
    }

    /// A whole PDU: any PDU with its data segment. A SCSI Command's immediate data and a
    /// Data-Out's data inline are taken as payloads that followed their headers would be (a
    /// write first asks for its buffer, [`Plan::Allocate`]) and copied into the task's
    /// buffer: a deframer in whole-PDU mode loses nothing, though
    /// [`Connection::handle_header`] places the data without the copy.
    pub fn handle_pdu(&mut self, now: Instant, pdu: Pdu, nexus: &mut impl Core) -> Plan<B> {
        self.now = now;
        self.last_rx = now;
        if self.discovery()
            && !matches!(
                pdu,
                Pdu::NopOut(_) | Pdu::TextRequest(_) | Pdu::LogoutRequest(_)
            )
        {
            self.reject_pdu(RejectReason::ProtocolError, &pdu, nexus);
            return Plan::Next;
        }
        match pdu {
            Pdu::ScsiCommand(cmd) if !cmd.data.is_empty() => {
                // A whole command with its immediate data inline (a deframer in whole-PDU
                // mode): the checks of a header whose payload follows; the data is then
                // copied into the task's buffer when it is allocated, never dropped.
                let len = cmd.data.len() as u32;
                if let Some(reason) = self.immediate_refusal(&cmd, len) {
                    self.reject_pdu(reason, &Pdu::ScsiCommand(cmd), nexus);
                    return Plan::Next;
                }
                return match self.scsi_command(now, cmd, len, nexus) {
                    // Nothing of it is on the wire to skip.
                    Plan::Discard => Plan::Next,
                    plan => plan,
                };
            }
            Pdu::ScsiCommand(cmd) => return self.scsi_command(now, cmd, 0, nexus),
            Pdu::DataOut(d) if !d.data.is_empty() => {
                // Its data inline: copied into the task's buffer as a placed payload would be.
                let len = d.data.len() as u32;
                match self.take_data_out_buffer(&d, len) {
                    Ok(Some(mut buffer)) => {
                        let at = d.buffer_offset as usize;
                        buffer[at..at + len as usize].copy_from_slice(&d.data);
                        self.data_out(&d, len, Some(buffer), nexus);
                    }
                    // No task (or its buffer is out): skipped, as a header's payload would be.
                    Ok(None) => {}
                    Err(()) => {
                        self.reject_pdu(RejectReason::ProtocolError, &Pdu::DataOut(d), nexus)
                    }
                }
            }
            Pdu::DataOut(d) => self.data_out(&d, 0, None, nexus),
            Pdu::NopOut(n) => self.nop_out(n, nexus),
            Pdu::TaskManagementRequest(t) => self.task_management(t, nexus),
            Pdu::TextRequest(t) => {
                if !self.take_cmd_sn(t.immediate, t.cmd_sn, nexus) {
                    return Plan::Next;
                }
                let max_send = self.max_send;
                let r = self.text.request(&t, &mut self.negotiator, max_send, |v| {
                    nexus.send_targets(v)
                });
                match r {
                    Ok(mut r) => {
                        r.stat_sn = self.next_stat_sn();
                        (r.exp_cmd_sn, r.max_cmd_sn) = nexus.window();
                        self.max_send = self.negotiator.connection().max_send_data_segment_length;
                        self.transmit(Pdu::TextResponse(r));
                    }
                    Err(reason) => self.reject_pdu(reason, &Pdu::TextRequest(t), nexus),
                }
            }
            Pdu::LogoutRequest(l) => self.logout(l, nexus),
            Pdu::SnackRequest(_) => self.reject_pdu(RejectReason::SnackReject, &pdu, nexus),
            Pdu::LoginRequest(_) => self.reject_pdu(RejectReason::ProtocolError, &pdu, nexus),
            other => self.reject_pdu(RejectReason::CommandNotSupported, &other, nexus),
        }
        Plan::Next
    }

    /// A PDU's header whose `len` bytes of payload are still on the wire (a SCSI Command's
    /// immediate data or a Data-Out's data; `pdu` has an empty data segment). `header` is the
    /// header as received, for a Reject.
    pub fn handle_header(
        &mut self,
        now: Instant,
        pdu: Pdu,
        header: &Bhs,
        len: u32,
        nexus: &mut impl Core,
    ) -> Plan<B> {
        self.now = now;
        self.last_rx = now;
        if self.discovery() {
            // SCSI commands and Data-Out have no place in a discovery session.
            self.reject(RejectReason::ProtocolError, header, nexus);
            return Plan::Discard;
        }
        match pdu {
            Pdu::ScsiCommand(cmd) => {
                if let Some(reason) = self.immediate_refusal(&cmd, len) {
                    self.reject(reason, header, nexus);
                    return Plan::Discard;
                }
                self.scsi_command(now, cmd, len, nexus)
            }
            Pdu::DataOut(d) => match self.data_out_buffer(&d, len, header, nexus) {
                Some(buffer) => {
                    let at = d.buffer_offset as usize;
                    self.receiving = Some(Receiving::DataOut(d, len));
                    Plan::Receive {
                        buffer,
                        at,
                        len: len as usize,
                    }
                }
                None => Plan::Discard,
            },
            _ => {
                self.reject(RejectReason::ProtocolError, header, nexus);
                Plan::Discard
            }
        }
    }

    /// A PDU the deframer found malformed (or whose data digest failed) but could skip: it is
    /// rejected and the connection goes on (a command rejected so does not take its CmdSN:
    /// the initiator plugs the gap, RFC 7143 section 7.8).
    pub fn handle_reject(
        &mut self,
        now: Instant,
        reason: RejectReason,
        header: &Bhs,
        nexus: &mut impl Core,
    ) {
        self.now = now;
        self.last_rx = now;
        self.reject(reason, header, nexus);
    }

    /// The buffer asked for with [`Plan::Allocate`], or why there is none: the command then
    /// ends in its CmdSN turn, with CHECK CONDITION ([`NoBuffer::TooLarge`]) or TASK SET FULL
    /// ([`NoBuffer::Busy`]), and its immediate data is skipped.
    pub fn handle_allocated(
        &mut self,
        now: Instant,
        buffer: Result<B, NoBuffer>,
        nexus: &mut impl Core,
    ) -> Plan<B> {
        self.now = now;
        let Some(Receiving::Buffer(cmd, len)) = self.receiving.take() else {
            return Plan::Next;
        };
        if buffer.is_ok() {
            // What the initiator owes for this write starts now.
            self.data_out_seen = now;
        }
        // A whole command's immediate data came inline (`handle_pdu`): copied, not read.
        let inline = !cmd.data.is_empty();
        match buffer {
            Ok(mut buffer) if len > 0 && inline => {
                let n = len as usize;
                buffer[..n].copy_from_slice(&cmd.data[..n]);
                self.command(now, cmd, Ok(Some(buffer)), len, nexus);
                Plan::Next
            }
            Ok(buffer) if len > 0 => {
                self.receiving = Some(Receiving::Command(cmd, len));
                Plan::Receive {
                    buffer,
                    at: 0,
                    len: len as usize,
                }
            }
            Ok(buffer) => {
                self.command(now, cmd, Ok(Some(buffer)), 0, nexus);
                Plan::Next
            }
            Err(why) => {
                self.command(now, cmd, Err(why), len, nexus);
                if len > 0 && !inline {
                    Plan::Discard
                } else {
                    Plan::Next
                }
            }
        }
    }

    /// Whether the caller may wait for an allocator that is short to answer a
    /// [`Plan::Allocate`]: only while no task of this connection holds a buffer for data-out
    /// still to come ([`TaskTable::awaits_data_out`]). Such data comes after the command in
    /// the stream, so a reader waiting for the space it holds would wait forever (with every
    /// other connection that waits for the same allocator). Costs a pass over the tasks: ask
    /// only once an allocation without waiting has failed.
    pub fn may_wait_for_buffer(&self) -> bool {
        !self.tasks.awaits_data_out()
    }

    /// The payload of [`Plan::Receive`] is in `buffer`, padding and digest checked.
    pub fn handle_payload(&mut self, now: Instant, buffer: B, nexus: &mut impl Core) {
        self.now = now;
        self.data_out_seen = now;
        match self.receiving.take() {
            Some(Receiving::Command(cmd, len)) => {
                self.command(now, cmd, Ok(Some(buffer)), len, nexus)
            }
            Some(Receiving::DataOut(d, len)) => self.data_out(&d, len, Some(buffer), nexus),
            _ => {}
        }
    }

    /// For a transport that places solicited data-out itself (iSER reads an R2T's burst
    /// with RDMA READ): the buffer of the task the Data-Out `d` (answering one of this
    /// connection's R2Ts, `len` bytes) goes into, lent until
    /// [`Connection::handle_placed_data_out`]. `None` when the R2T is void (its task ended),
    /// the range is outside the task's data, or the buffer is lent already: one placement per
    /// task at a time.
    pub fn lend_data_out_buffer(&mut self, d: &DataOut, len: u32) -> Option<B> {
        let itt = d.initiator_task_tag;
        if self.r2ts.get(&d.target_transfer_tag).map(|r| r.0) != Some(itt) {
            return None;
        }
        self.take_data_out_buffer(d, len).ok().flatten()
    }

    /// The data-out lent for with [`Connection::lend_data_out_buffer`] is in `buffer`
    /// (`placed`), or could not be moved (the transport failed): the task then ends with
    /// ABORTED COMMAND. A buffer whose R2T went void meanwhile (its task aborted) is dropped.
    pub fn handle_placed_data_out(
        &mut self,
        now: Instant,
        d: DataOut,
        len: u32,
        buffer: B,
        placed: bool,
        nexus: &mut impl Core,
    ) {
        self.now = now;
        self.last_rx = now;
        self.data_out_seen = now;
        let itt = d.initiator_task_tag;
        if self.r2ts.get(&d.target_transfer_tag).map(|r| r.0) != Some(itt) {
            return;
        }
        if !placed {
            self.r2ts.remove(&d.target_transfer_tag);
            self.tasks.put_buffer(u64::from(itt), buffer);
            self.carry()
                .fail(u64::from(itt), Asc::DATA_PHASE_ERROR, nexus);
            return;
        }
        self.data_out(&d, len, Some(buffer), nexus);
    }

    /// The payload of [`Plan::Receive`] failed its data digest. At ErrorRecoveryLevel 0 it
    /// cannot be asked for again: the PDU is rejected; a command is dropped without taking its
    /// CmdSN, a Data-Out's task ends with PROTOCOL SERVICE CRC ERROR (RFC 7143 section 7.8).
    pub fn handle_payload_error(
        &mut self,
        buffer: B,
        reason: RejectReason,
        header: &Bhs,
        nexus: &mut impl Core,
    ) {
        self.reject(reason, header, nexus);
        if let Some(Receiving::DataOut(d, _)) = self.receiving.take() {
            let itt = d.initiator_task_tag;
            self.tasks.put_buffer(u64::from(itt), buffer);
            self.carry().fail(u64::from(itt), Asc(0x47, 0x05), nexus);
        }
    }

    /// What the SCSI core decided for one of this connection's tasks.
    pub fn handle_core(&mut self, now: Instant, event: CoreEvent, nexus: &mut impl Core) {
        self.now = now;
        match event {
            CoreEvent::Submitted { tag, task } => {
                self.tasks.submitted(tag, task);
                self.trace(Stage::Dispatched, tag as u32, 0, 0);
            }
            CoreEvent::Action(a) => self.carry().action(a, now, nexus),
        }
    }

    /// A backend operation of `task` has ended at `now`; its buffer comes back to the task.
    /// A delegated task ends here, without the core.
    pub fn handle_backend_done(
        &mut self,
        now: Instant,
        task: TaskId,
        buffer: B,
        result: Result<Output, BackendError>,
        nexus: &mut impl Core,
    ) {
        self.now = now;
        self.carry().backend_done(task, buffer, result, now, nexus);
    }

    /// The buffer of an [`Event::BufferWanted`], or `None` when the allocator cannot ever give
    /// it: the task ends with an error.
    pub fn handle_buffer(
        &mut self,
        now: Instant,
        tag: u64,
        buffer: Option<B>,
        nexus: &mut impl Core,
    ) {
        self.now = now;
        self.carry().grant_buffer(tag, buffer, now, nexus);
    }

    /// The daemon is stopping: ask the initiator to log out (Asynchronous Message, event 1),
    /// once.
    pub fn ask_logout(&mut self, nexus: &mut impl Core) {
        if self.logout_asked {
            return;
        }
        self.logout_asked = true;
        let (exp, max) = nexus.window();
        let m = AsyncMessage {
            lun: Lun::ZERO,
            stat_sn: self.next_stat_sn(),
            exp_cmd_sn: exp,
            max_cmd_sn: max,
            event: AsyncEvent::LogoutRequested,
            vcode: 0,
            parameter1: 0,
            parameter2: 0,
            parameter3: LOGOUT_GRACE,
            data: Bytes::new(),
        };
        self.transmit(Pdu::AsyncMessage(m));
    }

    /// The connection is gone. Its commands still waiting for their CmdSN turn leave the
    /// session's order (their numbers stay taken) and the table. When the session goes on, the
    /// core aborts the rest (they end without a response); when `session_ends`, the caller
    /// closes the I_T nexus instead, which ends them. Either way the caller goes on handing in
    /// core events and backend completions, dropping the output, until
    /// [`Connection::is_idle`]; then the table is empty.
    ///
    /// Hand in the core events already reported first: a command the core has taken must be
    /// known to be in it.
    pub fn close(&mut self, session_ends: bool, nexus: &mut impl Core) {
        self.receiving = None;
        nexus.cancel_queued();
        let queued: Vec<u64> = self.tasks.not_in_core().collect();
        for tag in queued {
            self.tasks.remove(tag);
        }
        if session_ends {
            return;
        }
        let tasks: Vec<(u64, u64)> = self.tasks.in_core().collect();
        for (itt, lun) in tasks {
            if let Some(r) = nexus.task_management(lun, TmfFunction::AbortTask(itt)) {
                self.tmfs.push((r, RESERVED_TAG, Tmf::Internal));
            }
        }
    }

    /// A handover's park ran out of time while tasks still wait for data-out that the
    /// initiator has not sent: each is aborted as ABORT TASK would abort it, and ends with
    /// TASK ABORTED status, which initiators retry (Linux's SCSI midlayer does at once), as
    /// after another initiator's CLEAR TASK SET with TAS set. Then nothing of the connection
    /// waits for the initiator, and it can stop reading between two PDUs; Data-Out still on
    /// its way for those tasks is discarded, here or by the process the connection moves
    /// to, as for any task that has ended. Tasks whose operation runs in the backend, and
    /// commands waiting for their CmdSN turn, are left: the one ends when its operation does,
    /// the other is the session's order. Returns how many tasks it aborted.
    pub fn abort_awaiting_data_out(&mut self, nexus: &mut impl Core) -> usize {
        let waiting: Vec<(u64, u64)> = self
            .tasks
            .iter()
            .filter(|(tag, t)| {
                t.task().is_some()
                    && t.awaits_data_out()
                    && !self
                        .tmfs
                        .iter()
                        .any(|&(_, itt, kind)| kind == Tmf::Park && u64::from(itt) == *tag)
            })
            .map(|(tag, t)| (tag, t.lun))
            .collect();
        let mut aborted = 0;
        for (itt, lun) in waiting {
            if let Some(r) = nexus.task_management(lun, TmfFunction::AbortTask(itt)) {
                self.tmfs.push((r, itt as u32, Tmf::Park));
                aborted += 1;
            }
        }
        aborted
    }

    /// Drops the connection: `what` happened for `after`.
    fn give_up(&mut self, why: Close, what: &str, after: Duration) {
        let cid = self.settings.cid;
        tracing::warn!(cid, "{what} in {after:?}: dropping the connection");
        self.closing = Some(why);
    }

    /// Whether the data-out timeout applies: set, in a normal session, not once closing.
    fn checks_data_out(&self) -> bool {
        !self.settings.data_out_timeout.is_zero() && self.closing.is_none() && !self.discovery()
    }

    /// Whether the initiator owes data-out that buffers of this connection wait for: a
    /// payload half read, an R2T not answered in full, unsolicited data not all in, or a
    /// command holding its buffer while it waits for an earlier CmdSN (whose command the
    /// initiator owes). A task waiting in the core (behind an ORDERED command, say) owes
    /// nothing: the target, not the initiator, holds it up.
    fn owes_data_out(&self) -> bool {
        // A command waiting for its buffer waits for the target, not the initiator.
        let half_read = matches!(
            self.receiving,
            Some(Receiving::Command(..) | Receiving::DataOut(..))
        );
        if half_read || !self.r2ts.is_empty() {
            return true;
        }
        let unsolicited = if self.op.initial_r2t {
            0
        } else {
            self.op.first_burst_length
        };
        self.tasks.iter().any(|(_, t)| {
            t.buffer().is_some()
                && (t.task().is_none() || t.received < unsolicited.min(t.data_out_len))
        })
    }

    /// Whether the initiator is pinged when idle: not with a zero NOP interval, not once
    /// closing, and never in a discovery session (short-lived by nature).
    fn pings(&self) -> bool {
        !self.settings.nop_interval.is_zero() && self.closing.is_none() && !self.discovery()
    }

    fn discovery(&self) -> bool {
        self.settings.session_type == SessionType::Discovery
    }

    fn next_stat_sn(&mut self) -> SerialNumber {
        let s = self.stat_sn;
        self.stat_sn = s.next();
        s
    }

    fn transmit(&mut self, pdu: Pdu) {
        self.transmits.push_back(Transmit::Pdu(pdu));
    }

    fn reject(&mut self, reason: RejectReason, header: &Bhs, nexus: &mut impl Core) {
        tracing::debug!(?reason, ?header, "Reject");
        let mut r = Reject::of(reason, header);
        r.stat_sn = self.next_stat_sn();
        (r.exp_cmd_sn, r.max_cmd_sn) = nexus.window();
        self.transmit(Pdu::Reject(r));
    }

    fn reject_pdu(&mut self, reason: RejectReason, pdu: &Pdu, nexus: &mut impl Core) {
        let header = pdu.bhs();
        self.reject(reason, &header, nexus);
    }

    /// Takes the CmdSN of a non-SCSI request; false when it is outside the window.
    fn take_cmd_sn(
        &mut self,
        immediate: bool,
        cmd_sn: SerialNumber,
        nexus: &mut impl Core,
    ) -> bool {
        immediate || nexus.take_cmd_sn(cmd_sn)
    }

    /// Why a SCSI Command's immediate data cannot be taken, if it cannot.
    fn immediate_refusal(&self, cmd: &ScsiCommand, len: u32) -> Option<RejectReason> {
        let bad = !self.op.immediate_data
            || !cmd.write
            || len > cmd.expected_data_transfer_length
            || len > self.op.first_burst_length;
        if bad {
            tracing::debug!(
                immediate_data = self.op.immediate_data,
                write = cmd.write,
                len,
                edtl = cmd.expected_data_transfer_length,
                first_burst = self.op.first_burst_length,
                "immediate data refused"
            );
        }
        bad.then_some(RejectReason::ProtocolError)
    }

    /// A SCSI Command with `len` bytes of immediate data on the wire: a write within the
    /// size limit first gets its buffer; anything else goes in at once.
    fn scsi_command(
        &mut self,
        now: Instant,
        cmd: ScsiCommand,
        len: u32,
        nexus: &mut impl Core,
    ) -> Plan<B> {
        let edtl = cmd.expected_data_transfer_length;
        self.trace(Stage::Received, cmd.initiator_task_tag, cmd.cmd_sn.0, edtl);
        if cmd.write && edtl > 0 && edtl <= self.settings.max_io {
            self.receiving = Some(Receiving::Buffer(cmd, len));
            return Plan::Allocate(edtl);
        }
        self.command(now, cmd, Ok(None), len, nexus);
        if len > 0 {
            Plan::Discard
        } else {
            Plan::Next
        }
    }

    /// A SCSI Command, with its buffer and `immediate` bytes of immediate data in it, or why
    /// a write has no buffer.
    fn command(
        &mut self,
        now: Instant,
        cmd: ScsiCommand,
        buffer: Result<Option<B>, NoBuffer>,
        immediate: u32,
        nexus: &mut impl Core,
    ) {
        let busy = matches!(buffer, Err(NoBuffer::Busy));
        let buffer = buffer.ok().flatten();
        let itt = cmd.initiator_task_tag;
        let edtl = cmd.expected_data_transfer_length;
        let write = cmd.write;
        let unsolicited_end = if !write {
            0
        } else if self.op.initial_r2t {
            immediate
        } else {
            self.op.first_burst_length.min(edtl).max(immediate)
        };
        let data_in_len = match (cmd.read, write) {
            (true, false) => edtl,
            (true, true) => cmd.bidirectional_read_length.unwrap_or(0),
            _ => 0,
        };
        let data_out_len = if write { edtl } else { 0 };
        let too_big =
            !busy && (edtl > self.settings.max_io || (write && edtl > 0 && buffer.is_none()));
        let new = NewTask {
            lun: cmd.lun.as_u64(),
            data_out_len,
            data_in_len,
            buffer,
            received: immediate,
            transport: IscsiTask {
                next_r2t: unsolicited_end,
                outstanding_r2t: 0,
                r2t_sn: 0,
                unsolicited_data_sn: 0,
            },
        };
        let inserted = if itt == RESERVED_TAG {
            Err(RejectReason::InvalidPduField)
        } else {
            let r = self.tasks.insert(u64::from(itt), new, now);
            r.map_err(|_| RejectReason::TaskInProgress)
        };
        if let Err(reason) = inserted {
            self.reject_pdu(reason, &Pdu::ScsiCommand(cmd), nexus);
            return;
        }
        if too_big || busy {
            // More than one command may move: refuse it in order, as the core would.
            if self.take_cmd_sn(cmd.immediate, cmd.cmd_sn, nexus) {
                let (key, asc) = (SenseKey::IllegalRequest, Asc::INVALID_FIELD_IN_CDB);
                let tag = u64::from(itt);
                let refused = if busy {
                    self.tasks.turn_away(tag, CoreStatus::TaskSetFull, now)
                } else {
                    self.tasks.refuse(tag, key, asc, now)
                };
                if let Some(c) = refused {
                    self.carry().finish(c, nexus);
                }
            } else {
                self.tasks.remove(u64::from(itt));
            }
            return;
        }
        self.trace(Stage::Delivered, itt, 0, immediate);
        let q = OrderedCommand {
            cmd_sn: cmd.cmd_sn,
            lun: cmd.lun.as_u64(),
            cdb: cmd.cdb,
            attribute: attribute(cmd.task_attribute),
            itt,
            data_in_len,
            data_out_len,
        };
        if !nexus.deliver(q, cmd.immediate) {
            tracing::debug!(cmd_sn = %cmd.cmd_sn, "a command outside the window is dropped");
            self.tasks.remove(u64::from(itt));
        }
    }

    /// Where a Data-Out's payload goes: the task's buffer, taken out while the payload is read.
    fn data_out_buffer(
        &mut self,
        d: &DataOut,
        len: u32,
        header: &Bhs,
        nexus: &mut impl Core,
    ) -> Option<B> {
        match self.take_data_out_buffer(d, len) {
            Ok(b) => b,
            Err(()) => {
                self.reject(RejectReason::ProtocolError, header, nexus);
                None
            }
        }
    }

    /// The task's buffer for `len` bytes of data-out at `d`'s offset, taken out of the table;
    /// `Err` when the range runs past the task's data-out, `Ok(None)` when there is no task
    /// or no buffer to hold it.
    fn take_data_out_buffer(&mut self, d: &DataOut, len: u32) -> Result<Option<B>, ()> {
        let tag = u64::from(d.initiator_task_tag);
        let Some(t) = self.tasks.get(tag) else {
            return Ok(None);
        };
        let end = u64::from(d.buffer_offset) + u64::from(len);
        if end > u64::from(t.data_out_len) {
            return Err(());
        }
        let Some(b) = self.tasks.take_buffer(tag) else {
            return Ok(None);
        };
        if end as usize > b.len() {
            self.tasks.put_buffer(tag, b);
            return Ok(None);
        }
        Ok(Some(b))
    }

    /// A Data-Out has arrived: its payload (if any) is in `buffer`, which goes back to the task.
    fn data_out(&mut self, d: &DataOut, len: u32, buffer: Option<B>, nexus: &mut impl Core) {
        let itt = d.initiator_task_tag;
        let tag = u64::from(itt);
        if !self.tasks.contains(tag) {
            return;
        }
        if let Some(b) = buffer {
            self.tasks.put_buffer(tag, b);
        }
        if !self.in_sequence(d) {
            // At ErrorRecoveryLevel 0 a lost or repeated Data-Out cannot be asked for again.
            let header = Pdu::DataOut(d.clone()).bhs();
            self.reject(RejectReason::ProtocolError, &header, nexus);
            self.carry()
                .fail(u64::from(itt), Asc::DATA_PHASE_ERROR, nexus);
            return;
        }
        self.tasks.data_received(tag, len);
        if d.target_transfer_tag != RESERVED_TAG && d.final_bit {
            if let Some(t) = self.tasks.get_mut(tag) {
                t.transport.outstanding_r2t = t.transport.outstanding_r2t.saturating_sub(1);
            }
            self.solicit(itt, nexus);
        }
        self.carry().deliver_data(u64::from(itt), nexus);
    }

    /// Whether a Data-Out carries the DataSN its sequence expects (RFC 7143 section 11.7.5):
    /// numbered from 0 in the unsolicited sequence and in each R2T's.
    fn in_sequence(&mut self, d: &DataOut) -> bool {
        let itt = d.initiator_task_tag;
        if d.target_transfer_tag == RESERVED_TAG {
            let Some(t) = self.tasks.get_mut(u64::from(itt)) else {
                return false;
            };
            let sn = &mut t.transport.unsolicited_data_sn;
            let ok = d.data_sn == *sn;
            *sn = sn.wrapping_add(1);
            return ok;
        }
        let Some(r) = self.r2ts.get_mut(&d.target_transfer_tag) else {
            return false;
        };
        let ok = r.0 == itt && d.data_sn == r.1;
        r.1 = r.1.wrapping_add(1);
        if d.final_bit {
            self.r2ts.remove(&d.target_transfer_tag);
        }
        ok
    }

    /// Sends R2Ts for what the core wants beyond the unsolicited data, up to
    /// MaxOutstandingR2T at a time, each at most MaxBurstLength.
    fn solicit(&mut self, itt: u32, nexus: &mut impl Core) {
        let (exp, max) = nexus.window();
        let stat_sn = self.stat_sn;
        let Some(t) = self.tasks.get_mut(u64::from(itt)) else {
            return;
        };
        let Some(wanted) = t.wanted else {
            return;
        };
        let lun = Lun(t.lun.to_be_bytes());
        let s = &mut t.transport;
        while s.outstanding_r2t < self.op.max_outstanding_r2t && s.next_r2t < wanted {
            let n = (wanted - s.next_r2t).min(self.op.max_burst_length);
            self.trace.push(self.now, Stage::R2tSent, itt, 0, n);
            let ttt = next_ttt(&mut self.next_ttt);
            self.r2ts.insert(ttt, (itt, 0));
            self.transmits
                .push_back(Transmit::Pdu(Pdu::ReadyToTransfer(ReadyToTransfer {
                    lun,
                    initiator_task_tag: itt,
                    target_transfer_tag: ttt,
                    stat_sn,
                    exp_cmd_sn: exp,
                    max_cmd_sn: max,
                    r2t_sn: s.r2t_sn,
                    buffer_offset: s.next_r2t,
                    desired_data_transfer_length: n,
                })));
            s.r2t_sn += 1;
            s.next_r2t += n;
            s.outstanding_r2t += 1;
        }
    }

    /// Queues a finished task's Data-In and status.
    fn respond(&mut self, c: Completion<IscsiTask, B>, nexus: &mut impl Core) {
        let itt = c.tag as u32;
        self.ended(itt, &c.transport);
        let status = ScsiStatus(c.status as u8);
        let residual = residual(c.residual);
        let payload = match c.data_in {
            CoreDataIn::None => None,
            CoreDataIn::Buffer { len } => c.buffer.map(|b| (Payload::Buffer(b), len)),
            CoreDataIn::Parameter(v) => {
                let len = v.len() as u32;
                Some((Payload::Bytes(Bytes::from(v)), len))
            }
        }
        .filter(|(_, len)| *len > 0);
        let collapse =
            c.sense.is_none() && matches!(status, ScsiStatus::GOOD | ScsiStatus::CONDITION_MET);
        let mut data_pdus = 0;
        if let Some((payload, len)) = payload {
            data_pdus = data_in_count(len, self.max_send);
            let st = collapse.then(|| DataInStatus {
                status,
                stat_sn: self.next_stat_sn(),
                residual,
            });
            self.transmits.push_back(Transmit::DataIn {
                itt,
                lun: Lun(c.lun.to_be_bytes()),
                payload,
                len,
                status: st,
            });
            if collapse {
                return;
            }
        }
        let r = ScsiResponse {
            residual,
            status,
            initiator_task_tag: itt,
            exp_data_sn: data_pdus,
            data: c
                .sense
                .map(|s| ScsiResponse::sense_segment(s.as_slice()))
                .unwrap_or_default(),
            ..ScsiResponse::default()
        };
        self.send_scsi_response(r, nexus);
    }

    /// Sends SCSI Response `r` with the next StatSN and the session's command window.
    fn send_scsi_response(&mut self, mut r: ScsiResponse, nexus: &mut impl Core) {
        (r.exp_cmd_sn, r.max_cmd_sn) = nexus.window();
        r.stat_sn = self.next_stat_sn();
        self.transmit(Pdu::ScsiResponse(r));
    }

    /// A task has ended: its R2Ts are void.
    fn ended(&mut self, itt: u32, t: &IscsiTask) {
        if t.outstanding_r2t > 0 {
            self.r2ts.retain(|_, r| r.0 != itt);
        }
    }

    fn nop_out(&mut self, n: NopOut, nexus: &mut impl Core) {
        if n.initiator_task_tag == RESERVED_TAG {
            // An answer to our ping (or a NOP-Out that wants none).
            if self
                .ping
                .is_some_and(|(ttt, _)| ttt == n.target_transfer_tag)
            {
                self.ping = None;
            }
            return;
        }
        if !self.take_cmd_sn(n.immediate, n.cmd_sn, nexus) {
            return;
        }
        if n.target_transfer_tag != RESERVED_TAG {
            self.reject_pdu(RejectReason::ProtocolError, &Pdu::NopOut(n), nexus);
            return;
        }
        self.trace(Stage::NopReceived, n.initiator_task_tag, n.cmd_sn.0, 0);
        let (exp, max) = nexus.window();
        let mut data = n.data;
        data.truncate(self.max_send as usize);
        let r = NopIn {
            lun: n.lun,
            initiator_task_tag: n.initiator_task_tag,
            target_transfer_tag: RESERVED_TAG,
            stat_sn: self.next_stat_sn(),
            exp_cmd_sn: exp,
            max_cmd_sn: max,
            data,
        };
        self.transmit(Pdu::NopIn(r));
    }

    fn task_management(&mut self, t: TaskManagementRequest, nexus: &mut impl Core) {
        if !self.take_cmd_sn(t.immediate, t.cmd_sn, nexus) {
            return;
        }
        let itt = t.initiator_task_tag;
        let f = match t.function {
            TaskManagementFunction::AbortTask => {
                TmfFunction::AbortTask(u64::from(t.referenced_task_tag))
            }
            TaskManagementFunction::AbortTaskSet => TmfFunction::AbortTaskSet,
            TaskManagementFunction::ClearAca => TmfFunction::ClearAca,
            TaskManagementFunction::ClearTaskSet => TmfFunction::ClearTaskSet,
            TaskManagementFunction::LogicalUnitReset => TmfFunction::LogicalUnitReset,
            TaskManagementFunction::TargetWarmReset | TaskManagementFunction::TargetColdReset => {
                TmfFunction::TargetWarmReset
            }
            TaskManagementFunction::QueryTask => {
                TmfFunction::QueryTask(u64::from(t.referenced_task_tag))
            }
            TaskManagementFunction::QueryTaskSet => TmfFunction::QueryTaskSet,
            TaskManagementFunction::Other(11) => TmfFunction::QueryAsynchronousEvent,
            TaskManagementFunction::Other(12) => TmfFunction::ItNexusReset,
            TaskManagementFunction::TaskReassign => {
                self.tmf_reply(
                    itt,
                    IscsiTmfResponse::ReassignmentNotSupported,
                    [0; 3],
                    nexus,
                );
                return;
            }
            _ => {
                self.tmf_reply(itt, IscsiTmfResponse::NotSupported, [0; 3], nexus);
                return;
            }
        };
        match nexus.task_management(t.lun.as_u64(), f) {
            Some(reference) => {
                let kind = if t.function == TaskManagementFunction::TargetColdReset {
                    Tmf::ColdReset
                } else {
                    Tmf::Initiator
                };
                self.tmfs.push((reference, itt, kind));
            }
            None => self.tmf_reply(itt, IscsiTmfResponse::FunctionRejected, [0; 3], nexus),
        }
    }

    fn tmf_done(&mut self, reference: u64, response: TmfResponse, nexus: &mut impl Core) {
        let Some(i) = self.tmfs.iter().position(|(r, _, _)| *r == reference) else {
            return;
        };
        let (_, itt, kind) = self.tmfs.swap_remove(i);
        if kind == Tmf::Internal {
            return;
        }
        if kind == Tmf::Park {
            // A task that ended before the abort reached it has had its own status.
            if response != TmfResponse::Complete {
                return;
            }
            // The task is gone (its R2Ts with it): its status says it was aborted.
            let r = ScsiResponse {
                status: ScsiStatus::TASK_ABORTED,
                initiator_task_tag: itt,
                ..ScsiResponse::default()
            };
            self.send_scsi_response(r, nexus);
            return;
        }
        if kind == Tmf::Logout {
            self.closing = Some(Close::AfterFlush);
            self.logout_reply(itt, LogoutResponseCode::ClosedSuccessfully, nexus);
            return;
        }
        let (code, info) = match response {
            TmfResponse::Complete => (IscsiTmfResponse::FunctionComplete, [0; 3]),
            TmfResponse::Succeeded(info) => (
                IscsiTmfResponse::FunctionSucceeded,
                info.unwrap_or_default(),
            ),
            TmfResponse::TaskNotFound => (IscsiTmfResponse::TaskDoesNotExist, [0; 3]),
            TmfResponse::IncorrectLun => (IscsiTmfResponse::LunDoesNotExist, [0; 3]),
            TmfResponse::Rejected => (IscsiTmfResponse::FunctionRejected, [0; 3]),
        };
        self.tmf_reply(itt, code, info, nexus);
        if kind == Tmf::ColdReset {
            // A cold reset also drops every connection to the target (RFC 7143 section
            // 11.5.1), this one once the response is out.
            nexus.reset_target();
            self.closing = Some(Close::AfterFlush);
        }
    }

    fn tmf_reply(
        &mut self,
        itt: u32,
        response: IscsiTmfResponse,
        info: [u8; 3],
        nexus: &mut impl Core,
    ) {
        let (exp, max) = nexus.window();
        let r = TaskManagementResponse {
            response,
            initiator_task_tag: itt,
            stat_sn: self.next_stat_sn(),
            exp_cmd_sn: exp,
            max_cmd_sn: max,
            additional_response_information: info,
        };
        self.transmit(Pdu::TaskManagementResponse(r));
    }

    fn logout(&mut self, l: LogoutRequest, nexus: &mut impl Core) {
        if !self.take_cmd_sn(l.immediate, l.cmd_sn, nexus) {
            return;
        }
        let code = match l.reason {
            // A discovery session has one connection: any logout ends it.
            _ if self.discovery() => {
                self.closing = Some(Close::AfterFlush);
                LogoutResponseCode::ClosedSuccessfully
            }
            LogoutReason::CloseSession => {
                if let Some(reference) = nexus.close_session() {
                    self.tmfs
                        .push((reference, l.initiator_task_tag, Tmf::Logout));
                    return;
                }
                self.closing = Some(Close::AfterFlush);
                LogoutResponseCode::ClosedSuccessfully
            }
            LogoutReason::CloseConnection if l.cid == self.settings.cid => {
                self.closing = Some(Close::AfterFlush);
                LogoutResponseCode::ClosedSuccessfully
            }
            LogoutReason::CloseConnection => {
                if nexus.close_connection(l.cid) {
                    LogoutResponseCode::ClosedSuccessfully
                } else {
                    LogoutResponseCode::CidNotFound
                }
            }
            _ => LogoutResponseCode::RecoveryNotSupported,
        };
        self.logout_reply(l.initiator_task_tag, code, nexus);
    }

    fn logout_reply(&mut self, itt: u32, code: LogoutResponseCode, nexus: &mut impl Core) {
        let (exp, max) = nexus.window();
        let r = LogoutResponse {
            response: code,
            initiator_task_tag: itt,
            stat_sn: self.next_stat_sn(),
            exp_cmd_sn: exp,
            max_cmd_sn: max,
            time2wait: 0,
            time2retain: 0,
        };
        self.transmit(Pdu::LogoutResponse(r));
    }
}

/// A connection carrying out its task table's requests: the part every transport shares is
/// scsi-core's ([`Carrier`]'s provided methods), this is iSCSI's. A private view, so that the
/// hooks are not the connection's API.
struct Carry<'a, B>(&'a mut Connection<B>);

impl<B: TaskBuffer, C: Core> Carrier<B, C> for Carry<'_, B> {
    type Task = IscsiTask;

    fn tasks(&mut self) -> &mut TaskTable<IscsiTask, B> {
        &mut self.0.tasks
    }

    fn event(&mut self, event: Event<B>) {
        self.0.events.push_back(event);
    }

    fn tracing(&self) -> bool {
        self.0.trace.is_on()
    }

    fn trace(&mut self, stage: Stage, tag: u64, arg: u32) {
        self.0.trace(stage, tag as u32, 0, arg);
    }

    /// R2Ts for what has not come unsolicited.
    fn fetch_data_out(&mut self, tag: u64, _len: u32, _received: u32, core: &mut C) {
        self.0.solicit(tag as u32, core);
    }

    /// Data-In (with the status collapsed into the last PDU when there is no sense), or a
    /// SCSI Response.
    fn respond(&mut self, completion: Completion<IscsiTask, B>, core: &mut C) {
        self.0.respond(completion, core);
    }

    /// Its R2Ts are void.
    fn forget(&mut self, tag: u64, entry: &mut TaskEntry<IscsiTask, B>) {
        self.0.ended(tag as u32, &entry.transport);
    }

    fn tmf_done(&mut self, reference: u64, response: TmfResponse, core: &mut C) {
        self.0.tmf_done(reference, response, core);
    }

    fn aborting(&mut self, reference: u64) {
        self.0.tmfs.push((reference, RESERVED_TAG, Tmf::Internal));
    }

    // iSCSI sessions do not ask for asynchronous unit attentions (TargetCore's announce_to):
    // they hear of them on their next command, so the default ignores them.
}
