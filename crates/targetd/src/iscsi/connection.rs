//! One iSCSI connection in full feature phase (RFC 7143 sections 4 and 11): commands in CmdSN
//! order into the SCSI core, R2Ts and Data-Out, Data-In with phase collapse, NOP, text, logout,
//! task management and Reject.
//!
//! Two futures share the connection's state: the reader takes PDUs off the socket (payloads
//! straight into arena buffers) and the worker runs what the core and the backend hand back and
//! writes the output with vectored writes. Neither holds the state across an await.

use std::cell::RefCell;
use std::collections::{HashMap, VecDeque};
use std::rc::Rc;
use std::sync::Arc;
use std::time::{Duration, Instant};

use backend::Buffer;
use bytes::Bytes;
use iscsi_pdu::negotiation::{Negotiator, OperationalParams};
use iscsi_pdu::{
    AsyncEvent, AsyncMessage, Bhs, DataInStatus, DataOut, LogoutReason, LogoutRequest,
    LogoutResponse, LogoutResponseCode, Lun, NopIn, NopOut, Pdu, ReadyToTransfer, Reject,
    RejectReason, ScsiCommand, ScsiResponse, ScsiStatus, SerialNumber, TaskManagementFunction,
    TaskManagementRequest, TaskManagementResponse, TmfResponse as IscsiTmfResponse, RESERVED_TAG,
};
use scsi_core::transport::{Accounting, Completion, NewTask, Request as TaskRequest, TaskTable};
use scsi_core::{
    Action, Asc, DataIn, Op, Residual, SenseKey, TaskAttribute, TaskId, TmfFunction, TmfResponse,
};
use tokio::net::TcpStream;
use tokio::sync::mpsc;

use super::login::{self, Outcome, Peer};
use super::session::{Control, Delivery, Queued, Request, Session};
use super::text::TextExchange;
use super::wire::{Incoming, Outgoing, Payload, ReadError, Reader, Writer};
use crate::reactor::{Inbox, Io};
use crate::server::Shared;
use crate::target::{next_id, Route, Routed, Target, MAX_IO};

/// How long a login may take.
const LOGIN_TIMEOUT: Duration = Duration::from_secs(30);
/// How long a closing connection waits for its tasks' backend operations.
const DRAIN_TIMEOUT: Duration = Duration::from_secs(30);
/// Seconds the Asynchronous Message gives the initiator to log out.
pub const LOGOUT_GRACE: u16 = 5;

/// Serves a new TCP connection: login, then a discovery or normal session.
pub async fn serve(stream: TcpStream, io: Rc<Io>, shared: Arc<Shared>) {
    let (Ok(addr), Ok(local)) = (stream.peer_addr(), stream.local_addr()) else {
        return;
    };
    let _ = stream.set_nodelay(true);
    let id = next_id();
    let control = Arc::new(Control::default());
    shared.register(id, control.clone());
    let peer = Peer {
        id,
        addr,
        local,
        reactor: io.index,
        control: control.clone(),
    };
    let (rd, wr) = stream.into_split();
    let mut reader = Reader::new(rd);
    let mut writer = Writer::new(wr);
    let outcome = tokio::select! {
        o = tokio::time::timeout(LOGIN_TIMEOUT, login::run(&mut reader, &mut writer, &shared, &peer)) => o.ok().flatten(),
        _ = wait_for(&control, Request::Close) => None,
    };
    match outcome {
        None => {}
        Some(Outcome::Discovery {
            negotiator,
            initiator,
            stat_sn,
            exp_cmd_sn,
        }) => {
            super::discovery::serve(
                reader, writer, negotiator, &initiator, stat_sn, exp_cmd_sn, &shared, &peer,
            )
            .await
        }
        Some(Outcome::Normal {
            session,
            negotiator,
            stat_sn,
        }) => {
            full_feature(
                reader, writer, session, negotiator, stat_sn, io, &shared, &peer,
            )
            .await
        }
    }
    shared.unregister(id);
}

/// Resolves once `control` asks for `at_least`.
pub async fn wait_for(control: &Control, at_least: Request) {
    loop {
        let notified = control.notify.notified();
        if control.get() >= at_least {
            return;
        }
        notified.await;
    }
}

/// iSCSI's own state of a task: R2T and DataSN bookkeeping (RFC 7143 sections 11.7-11.8).
/// The rest (buffer, lengths, the core's handle, accounting) is the task layer's.
#[derive(Debug)]
struct IscsiTask {
    /// The next offset to solicit: the initiator may send up to here without an R2T.
    next_r2t: u32,
    outstanding_r2t: u16,
    r2t_sn: u32,
    /// The next DataSN of the unsolicited Data-Out sequence.
    unsolicited_data_sn: u32,
}

/// A connection's tasks by Initiator Task Tag.
type Tasks = TaskTable<IscsiTask, Buffer>;

/// Who asked for a task management function.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Tmf {
    /// The connection itself (aborting a failed task, or its tasks at close): no response.
    Internal,
    /// The initiator: a Task Management Function Response.
    Initiator,
    /// The initiator's TARGET COLD RESET: the response, then every connection closes.
    ColdReset,
}

/// The state the reader and the worker share.
struct Conn {
    id: u64,
    cid: u16,
    peer: std::net::SocketAddr,
    portal: std::net::SocketAddr,
    session: Arc<Session>,
    target: Arc<Target>,
    shared: Arc<Shared>,
    io: Rc<Io>,
    inbox: Rc<Inbox>,
    route: Route,
    op: OperationalParams,
    max_send: u32,
    stat_sn: SerialNumber,
    tasks: Tasks,
    /// Tasks whose backend operation waits for arena slots, in arrival order: (ITT, bytes).
    /// The head's allocation is a future of the worker; the arena wakes it.
    buffer_wait: VecDeque<(u32, usize)>,
    local: VecDeque<Routed>,
    out: Vec<Outgoing>,
    next_ttt: u32,
    /// Outstanding R2Ts by TTT: (ITT, next DataSN).
    r2ts: HashMap<u32, (u32, u32)>,
    /// Task management requests in the core: (reference, ITT); ITT `RESERVED_TAG` for the
    /// connection's own aborts.
    tmfs: Vec<(u64, u32, Tmf)>,
    negotiator: Negotiator,
    text: TextExchange,
    /// Close once the output is flushed (logout).
    close_after_flush: bool,
    /// A target NOP-In awaiting its NOP-Out: (TTT, sent).
    ping: Option<(u32, Instant)>,
    last_rx: Instant,
    logout_asked: bool,
    nop_interval: Duration,
    nop_timeout: Duration,
}

#[allow(clippy::too_many_arguments)]
async fn full_feature(
    mut reader: Reader,
    mut writer: Writer,
    session: Arc<Session>,
    negotiator: Negotiator,
    stat_sn: SerialNumber,
    io: Rc<Io>,
    shared: &Arc<Shared>,
    peer: &Peer,
) {
    let c = *negotiator.connection();
    let digests = iscsi_pdu::Digests {
        header: c.header_digest,
        data: c.data_digest,
    };
    reader.set_digests(digests);
    reader.set_max_recv(c.max_recv_data_segment_length);
    writer.digests = digests;
    writer.max_send = c.max_send_data_segment_length;
    let cid = session
        .connection_list()
        .iter()
        .find(|x| x.id == peer.id)
        .map_or(0, |x| x.cid);
    let (tx, rx) = mpsc::unbounded_channel();
    let inbox = Rc::new(Inbox::default());
    let (nop_interval, nop_timeout) = {
        let c = shared.config();
        (c.server.nop_interval, c.server.nop_timeout)
    };
    let conn = Rc::new(RefCell::new(Conn {
        id: peer.id,
        cid,
        peer: peer.addr,
        portal: peer.local,
        target: session.target.clone(),
        op: session.params.operational,
        session: session.clone(),
        shared: shared.clone(),
        io,
        inbox: inbox.clone(),
        route: Route { conn: peer.id, tx },
        max_send: c.max_send_data_segment_length,
        stat_sn,
        tasks: Tasks::new(),
        buffer_wait: VecDeque::with_capacity(64),
        local: VecDeque::with_capacity(256),
        out: Vec::with_capacity(256),
        next_ttt: 1,
        r2ts: HashMap::with_capacity(256),
        tmfs: Vec::new(),
        negotiator,
        text: TextExchange::default(),
        close_after_flush: false,
        ping: None,
        last_rx: Instant::now(),
        logout_asked: false,
        nop_interval: Duration::from_secs(nop_interval),
        nop_timeout: Duration::from_secs(nop_timeout),
    }));
    let mut rx = rx;
    tokio::select! {
        r = read_loop(&conn, &mut reader) => {
            if let Err(e) = r {
                tracing::debug!(peer = %peer.addr, "connection ends: {e}");
            }
        }
        r = work_loop(&conn, &mut rx, &mut writer, &peer.control) => {
            if let Err(e) = r {
                tracing::debug!(peer = %peer.addr, "connection ends: {e}");
            }
            let _ = writer.shutdown().await;
        }
    }
    drop(reader);
    drop(writer);
    teardown(&conn, &mut rx).await;
}

/// The connection is gone: end its tasks. The last connection of a session closes the I_T
/// nexus; otherwise its own tasks are aborted. Backend operations in flight are waited for.
async fn teardown(conn: &Rc<RefCell<Conn>>, rx: &mut mpsc::UnboundedReceiver<Routed>) {
    {
        let mut c = conn.borrow_mut();
        let c = &mut *c;
        let session = c.session.clone();
        let last = c.shared.sessions.leave(&session, c.id);
        let mut core = c.target.core();
        if last {
            let _ = core.device.close_nexus(session.nexus);
            core.drain(c.id, &mut c.local);
            tracing::info!(tsih = session.tsih, initiator = %session.initiator, "session ends");
        } else {
            for (itt, lun) in c.tasks.in_core() {
                let f = TmfFunction::AbortTask(itt);
                if let Ok(r) = core.task_management(session.nexus, lun, f, &c.route, &mut c.local) {
                    c.tmfs.push((r, RESERVED_TAG, Tmf::Internal));
                }
            }
        }
    }
    let deadline = tokio::time::Instant::now() + DRAIN_TIMEOUT;
    let (inbox, io) = {
        let c = conn.borrow();
        (c.inbox.clone(), c.io.clone())
    };
    let mut waiting = None;
    loop {
        {
            let mut c = conn.borrow_mut();
            c.absorb();
            c.pump();
            c.out.clear();
            if c.tasks.idle() && c.local.is_empty() {
                return;
            }
            c.wait_for_buffer(&io, &mut waiting);
        }
        tokio::select! {
            _ = inbox.notify.notified() => {}
            Some(ev) = rx.recv() => conn.borrow_mut().local.push_back(ev),
            (itt, b) = granted(&mut waiting) => conn.borrow_mut().granted(itt, b),
            _ = tokio::time::sleep_until(deadline) => {
                tracing::warn!("a closed connection's tasks did not finish in {DRAIN_TIMEOUT:?}");
                return;
            }
        }
    }
}

/// Takes PDUs off the socket until it closes or breaks.
async fn read_loop(conn: &Rc<RefCell<Conn>>, reader: &mut Reader) -> Result<(), ReadError> {
    loop {
        let incoming = reader.next().await;
        let inbox = {
            let mut c = conn.borrow_mut();
            c.last_rx = Instant::now();
            c.inbox.clone()
        };
        match incoming {
            Ok(Incoming::Whole(Pdu::ScsiCommand(cmd))) => {
                let buffer = command_buffer(conn, &cmd).await;
                conn.borrow_mut().command(cmd, buffer, 0);
            }
            Ok(Incoming::Whole(pdu)) => conn.borrow_mut().pdu(pdu),
            Ok(Incoming::Payload {
                pdu: Pdu::ScsiCommand(cmd),
                len,
                header,
            }) => {
                let refusal = conn.borrow().immediate_refusal(&cmd, len);
                if let Some(reason) = refusal {
                    reader.discard();
                    conn.borrow_mut().reject(reason, &header);
                } else if cmd.expected_data_transfer_length > MAX_IO {
                    // Too large to buffer: the data is dropped and the command refused in
                    // order with CHECK CONDITION.
                    reader.discard();
                    conn.borrow_mut().command(cmd, None, len);
                } else {
                    let mut buffer = command_buffer(conn, &cmd).await;
                    let read = match buffer.as_mut() {
                        Some(b) => Some(reader.payload(&mut b[..len as usize]).await),
                        None => None,
                    };
                    match read {
                        Some(Ok(())) => conn.borrow_mut().command(cmd, buffer, len),
                        // The command is discarded and its CmdSN not taken: the initiator
                        // plugs the gap (RFC 7143 section 7.8).
                        Some(Err(ReadError::Reject { reason, header })) => {
                            conn.borrow_mut().reject(reason, &header)
                        }
                        Some(Err(e)) => return Err(e),
                        // No buffer for it: the data is dropped and the command refused in
                        // order.
                        None => {
                            reader.discard();
                            conn.borrow_mut().command(cmd, None, len);
                        }
                    }
                }
            }
            Ok(Incoming::Payload {
                pdu: Pdu::DataOut(d),
                len,
                header,
            }) => {
                let taken = conn.borrow_mut().data_out_buffer(&d, len, &header);
                match taken {
                    Some(mut buffer) => {
                        let at = d.buffer_offset as usize;
                        let r = reader.payload(&mut buffer[at..at + len as usize]).await;
                        match r {
                            Ok(()) => conn.borrow_mut().data_out(&d, len, Some(buffer)),
                            Err(ReadError::Reject { reason, header }) => conn
                                .borrow_mut()
                                .data_digest_error(&d, buffer, reason, &header),
                            Err(e) => return Err(e),
                        }
                    }
                    None => reader.discard(),
                }
            }
            Ok(Incoming::Payload { header, .. }) => {
                reader.discard();
                conn.borrow_mut()
                    .reject(RejectReason::ProtocolError, &header);
            }
            Err(ReadError::Reject { reason, header }) => conn.borrow_mut().reject(reason, &header),
            Err(e) => return Err(e),
        }
        conn.borrow_mut().pump();
        inbox.notify.notify_one();
        let closing = conn.borrow().close_after_flush;
        if closing {
            // Nothing more is read after a logout; the worker closes once it has answered.
            std::future::pending::<()>().await;
        }
    }
}

/// The arena buffer a write command's data lands in (none for reads: they get theirs when the
/// backend runs). Waits while the arena is short: that is the connection's backpressure.
async fn command_buffer(conn: &Rc<RefCell<Conn>>, cmd: &ScsiCommand) -> Option<Buffer> {
    if !cmd.write || cmd.expected_data_transfer_length == 0 {
        return None;
    }
    let len = cmd.expected_data_transfer_length;
    if len > MAX_IO {
        return None;
    }
    let io = conn.borrow().io.clone();
    let b = io.arena.alloc(len as usize).await;
    b.ok()
}

/// The head of a connection's buffer queue: its ITT and its place in the arena's FIFO. It
/// lives across the worker's loop iterations so the place is kept.
type Waiting<'a> = Option<(u32, backend::Alloc<'a>)>;

/// Resolves when the arena grants the waiting buffer (never, when none waits).
async fn granted(waiting: &mut Waiting<'_>) -> (u32, Result<Buffer, backend::ArenaError>) {
    let Some((itt, alloc)) = waiting else {
        return std::future::pending().await;
    };
    let b = alloc.await;
    let itt = *itt;
    *waiting = None;
    (itt, b)
}

/// Runs what the core and the backend hand back, and writes the output.
async fn work_loop(
    conn: &Rc<RefCell<Conn>>,
    rx: &mut mpsc::UnboundedReceiver<Routed>,
    writer: &mut Writer,
    control: &Arc<Control>,
) -> std::io::Result<()> {
    let (inbox, io) = {
        let c = conn.borrow();
        (c.inbox.clone(), c.io.clone())
    };
    let session = conn.borrow().session.clone();
    let mut batch: Vec<Outgoing> = Vec::with_capacity(256);
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut waiting = None;
    loop {
        conn.borrow_mut().wait_for_buffer(&io, &mut waiting);
        tokio::select! {
            biased;
            _ = inbox.notify.notified() => {}
            Some(ev) = rx.recv() => conn.borrow_mut().local.push_back(ev),
            _ = control.notify.notified() => {}
            _ = tick.tick() => {
                if conn.borrow_mut().timers() {
                    return Err(std::io::Error::new(std::io::ErrorKind::TimedOut, "NOP-In ping not answered"));
                }
            }
            (itt, b) = granted(&mut waiting) => conn.borrow_mut().granted(itt, b),
        }
        let close = {
            let mut c = conn.borrow_mut();
            while let Ok(ev) = rx.try_recv() {
                c.local.push_back(ev);
            }
            c.absorb();
            c.pump();
            let request = control.get();
            if request == Request::Logout && !c.logout_asked {
                c.ask_logout();
            }
            std::mem::swap(&mut c.out, &mut batch);
            c.close_after_flush || request == Request::Close
        };
        if !batch.is_empty() {
            let (exp, max) = session.window();
            let max_send = conn.borrow().max_send;
            writer.max_send = max_send;
            writer.send(&batch, exp, max).await?;
            batch.clear();
        }
        if close {
            return Ok(());
        }
    }
}

fn attribute(a: iscsi_pdu::TaskAttribute) -> TaskAttribute {
    match a {
        iscsi_pdu::TaskAttribute::Ordered => TaskAttribute::Ordered,
        iscsi_pdu::TaskAttribute::HeadOfQueue => TaskAttribute::HeadOfQueue,
        iscsi_pdu::TaskAttribute::Aca => TaskAttribute::Aca,
        _ => TaskAttribute::Simple,
    }
}

fn residual(r: Residual) -> iscsi_pdu::Residual {
    match r {
        Residual::None => iscsi_pdu::Residual::None,
        Residual::Overflow(n) => iscsi_pdu::Residual::Overflow(n),
        Residual::Underflow(n) => iscsi_pdu::Residual::Underflow(n),
    }
}

impl Conn {
    fn next_stat_sn(&mut self) -> SerialNumber {
        let s = self.stat_sn;
        self.stat_sn = s.next();
        s
    }

    fn window(&self) -> (SerialNumber, SerialNumber) {
        self.session.window()
    }

    fn reject(&mut self, reason: RejectReason, header: &Bhs) {
        tracing::debug!(?reason, ?header, "Reject");
        let mut r = Reject::of(reason, header);
        r.stat_sn = self.next_stat_sn();
        (r.exp_cmd_sn, r.max_cmd_sn) = self.window();
        self.out.push(Outgoing::Pdu(Pdu::Reject(r)));
    }

    fn reject_pdu(&mut self, reason: RejectReason, pdu: &Pdu) {
        let header = pdu.bhs();
        self.reject(reason, &header);
    }

    /// Takes the CmdSN of a non-SCSI request; false when it is outside the window.
    fn take_cmd_sn(&mut self, immediate: bool, cmd_sn: SerialNumber) -> bool {
        immediate || self.session.take_cmd_sn(cmd_sn, self.id, &mut self.local)
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

    /// A SCSI Command, with its buffer and `immediate` bytes of immediate data in it.
    fn command(&mut self, cmd: ScsiCommand, buffer: Option<Buffer>, immediate: u32) {
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
        let too_big = edtl > MAX_IO || (write && edtl > 0 && buffer.is_none());
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
            let r = self.tasks.insert(u64::from(itt), new, Instant::now());
            r.map_err(|_| RejectReason::TaskInProgress)
        };
        if let Err(reason) = inserted {
            self.reject_pdu(reason, &Pdu::ScsiCommand(cmd));
            return;
        }
        if too_big {
            // More than one command may move: refuse it in order, as the core would.
            if self.take_cmd_sn(cmd.immediate, cmd.cmd_sn) {
                let (key, asc) = (SenseKey::IllegalRequest, Asc::INVALID_FIELD_IN_CDB);
                let now = Instant::now();
                if let Some(c) = self.tasks.refuse(u64::from(itt), key, asc, now) {
                    self.finish(c);
                }
            } else {
                self.tasks.remove(u64::from(itt));
            }
            return;
        }
        let q = Queued {
            cmd_sn: cmd.cmd_sn,
            lun: cmd.lun.as_u64(),
            cdb: cmd.cdb,
            attribute: attribute(cmd.task_attribute),
            itt,
            data_in_len,
            data_out_len,
        };
        if self
            .session
            .deliver(q, cmd.immediate, &self.route, &mut self.local)
            == Delivery::OutsideWindow
        {
            tracing::debug!(cmd_sn = %cmd.cmd_sn, "a command outside the window is dropped");
            self.tasks.remove(u64::from(itt));
        }
    }

    /// Where a Data-Out's payload goes: the task's buffer, taken out while the payload is read.
    fn data_out_buffer(&mut self, d: &DataOut, len: u32, header: &Bhs) -> Option<Buffer> {
        let tag = u64::from(d.initiator_task_tag);
        let t = self.tasks.get(tag)?;
        let end = u64::from(d.buffer_offset) + u64::from(len);
        if end > u64::from(t.data_out_len) {
            self.reject(RejectReason::ProtocolError, header);
            return None;
        }
        let b = self.tasks.take_buffer(tag)?;
        if end as usize > b.len() {
            self.tasks.put_buffer(tag, b);
            return None;
        }
        Some(b)
    }

    /// A Data-Out has arrived: its payload (if any) is in `buffer`, which goes back to the task.
    fn data_out(&mut self, d: &DataOut, len: u32, buffer: Option<Buffer>) {
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
            self.reject(RejectReason::ProtocolError, &header);
            self.fail_task(itt, Asc(0x4b, 0x00));
            return;
        }
        self.tasks.data_received(tag, len);
        if d.target_transfer_tag != RESERVED_TAG && d.final_bit {
            if let Some(t) = self.tasks.get_mut(tag) {
                t.transport.outstanding_r2t = t.transport.outstanding_r2t.saturating_sub(1);
            }
            self.solicit(itt);
        }
        self.deliver_data(itt);
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

    /// A Data-Out failed its data digest. At ErrorRecoveryLevel 0 the data cannot be asked for
    /// again: Reject it and end the task with PROTOCOL SERVICE CRC ERROR (RFC 7143 section 7.8).
    fn data_digest_error(
        &mut self,
        d: &DataOut,
        buffer: Buffer,
        reason: RejectReason,
        header: &Bhs,
    ) {
        self.reject(reason, header);
        let itt = d.initiator_task_tag;
        self.tasks.put_buffer(u64::from(itt), buffer);
        self.fail_task(itt, Asc(0x47, 0x05));
    }

    /// Fails a task: the core aborts it and it ends with ABORTED COMMAND and `asc`.
    fn fail_task(&mut self, itt: u32, asc: Asc) {
        let Some((_, lun)) = self.tasks.fail(u64::from(itt), asc) else {
            return;
        };
        let f = TmfFunction::AbortTask(u64::from(itt));
        let r = self.target.core().task_management(
            self.session.nexus,
            lun,
            f,
            &self.route,
            &mut self.local,
        );
        if let Ok(r) = r {
            self.tmfs.push((r, RESERVED_TAG, Tmf::Internal));
        }
    }

    /// Sends R2Ts for what the core wants beyond the unsolicited data, up to
    /// MaxOutstandingR2T at a time, each at most MaxBurstLength.
    fn solicit(&mut self, itt: u32) {
        let (exp, max) = self.window();
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
            let ttt = self.next_ttt;
            self.next_ttt = self.next_ttt.wrapping_add(1).max(1) & 0x7fff_ffff;
            self.r2ts.insert(ttt, (itt, 0));
            self.out
                .push(Outgoing::Pdu(Pdu::ReadyToTransfer(ReadyToTransfer {
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

    /// Hands the data-out to the core once all it asked for is in.
    fn deliver_data(&mut self, itt: u32) {
        let Some((task, data)) = self.tasks.data_complete(u64::from(itt)) else {
            return;
        };
        let mut core = self.target.core();
        let _ = core.device.data_out(task, data);
        core.drain(self.id, &mut self.local);
    }

    /// Moves backend completions into the core.
    fn absorb(&mut self) {
        let inbox = self.inbox.clone();
        loop {
            let Some(done) = inbox.done.borrow_mut().pop_front() else {
                break;
            };
            self.tasks.backend_returned(done.task, done.buffer);
            let mut core = self.target.core();
            if let Err(e) = core.device.backend_done(done.task, done.result) {
                tracing::error!("backend completion refused by the core: {e}");
            }
            core.drain(self.id, &mut self.local);
        }
    }

    /// Runs the core's actions for this connection until none are left.
    fn pump(&mut self) {
        while let Some(ev) = self.local.pop_front() {
            match ev {
                Routed::Submitted { tag, task } => self.tasks.submitted(tag, task),
                Routed::Action(a) => self.action(a),
            }
        }
    }

    /// Carries out what the task layer makes of the core's action.
    fn action(&mut self, a: Action) {
        let target = &self.target;
        let mut unit = None;
        let request = self.tasks.action(a, Instant::now(), |lun| {
            let u = target.lun(lun)?;
            let bs = u.block_size;
            unit = Some(u);
            Some(bs)
        });
        let Some(request) = request else {
            return;
        };
        match request {
            TaskRequest::DataOut { tag, .. } => {
                self.solicit(tag as u32);
                self.deliver_data(tag as u32);
            }
            TaskRequest::Backend {
                task,
                lun,
                op,
                buffer,
                ..
            } => self.run_backend(task, lun, op, buffer, unit),
            TaskRequest::BufferWanted { tag, len } => self.want_buffer(tag as u32, len),
            TaskRequest::Complete(c) => self.finish(c),
            TaskRequest::Ended { tag, entry } => self.ended(tag as u32, &entry.transport),
            TaskRequest::UnitGone { task, .. } => self.backend_failed(task),
            TaskRequest::TaskManagementDone {
                reference,
                response,
                ..
            } => self.tmf_done(reference, response),
        }
    }

    fn tmf_done(&mut self, reference: u64, response: TmfResponse) {
        let Some(i) = self.tmfs.iter().position(|(r, _, _)| *r == reference) else {
            return;
        };
        let (_, itt, kind) = self.tmfs.swap_remove(i);
        match kind {
            Tmf::Internal => {}
            Tmf::Initiator => self.tmf_response(itt, response),
            Tmf::ColdReset => {
                self.tmf_response(itt, response);
                // A cold reset also drops every connection to the target (RFC 7143
                // section 11.5.1), this one once the response is out.
                for s in self.shared.sessions.all() {
                    if Arc::ptr_eq(&s.target, &self.target) && !Arc::ptr_eq(&s, &self.session) {
                        s.close();
                    }
                }
                for c in self.session.connection_list() {
                    if c.id != self.id {
                        c.control.request(Request::Close);
                    }
                }
                self.close_after_flush = true;
            }
        }
    }

    /// A task has ended: its R2Ts are void.
    fn ended(&mut self, itt: u32, t: &IscsiTask) {
        if t.outstanding_r2t > 0 {
            self.r2ts.retain(|_, r| r.0 != itt);
        }
    }

    /// The backend cannot run the task's operation: the core ends it with an error.
    fn backend_failed(&mut self, task: TaskId) {
        let mut core = self.target.core();
        let _ = core
            .device
            .backend_done(task, Err(scsi_core::BackendError::Internal));
        core.drain(self.id, &mut self.local);
    }

    /// Runs a backend operation on the reactor's engine.
    fn run_backend(
        &mut self,
        task: TaskId,
        lun: u16,
        op: Op,
        buffer: Buffer,
        unit: Option<Arc<crate::target::Lun>>,
    ) {
        match unit.or_else(|| self.target.lun(lun)) {
            Some(unit) => self.io.submit(&unit, op, buffer, &self.inbox, task),
            None => {
                self.tasks.backend_returned(task, buffer);
                self.backend_failed(task);
            }
        }
    }

    /// A backend operation needs `len` bytes of arena: now if the arena has them and no
    /// earlier request waits, else in arrival order when buffers come back.
    fn want_buffer(&mut self, itt: u32, len: usize) {
        if self.buffer_wait.is_empty() {
            match self.io.arena.try_alloc(len) {
                Ok(Some(b)) => return self.grant(itt, b),
                Ok(None) => {}
                Err(e) => return self.buffer_refused(itt, e),
            }
        }
        self.buffer_wait.push_back((itt, len));
    }

    /// Starts waiting for the oldest queued buffer, unless a wait is on already.
    fn wait_for_buffer<'a>(&self, io: &'a Io, waiting: &mut Waiting<'a>) {
        if waiting.is_none() {
            if let Some(&(itt, len)) = self.buffer_wait.front() {
                *waiting = Some((itt, io.arena.alloc(len)));
            }
        }
    }

    /// The arena has granted (or refused) the oldest queued buffer.
    fn granted(&mut self, itt: u32, r: Result<Buffer, backend::ArenaError>) {
        self.buffer_wait.pop_front();
        match r {
            Ok(b) => self.grant(itt, b),
            Err(e) => self.buffer_refused(itt, e),
        }
    }

    fn grant(&mut self, itt: u32, buffer: Buffer) {
        if let Some(TaskRequest::Backend {
            task,
            lun,
            op,
            buffer,
            ..
        }) = self.tasks.grant_buffer(u64::from(itt), buffer)
        {
            self.run_backend(task, lun, op, buffer, None);
        }
    }

    fn buffer_refused(&mut self, itt: u32, e: backend::ArenaError) {
        tracing::error!("buffer for task {itt:#x}: {e}");
        if let Some(task) = self.tasks.buffer_refused(u64::from(itt)) {
            self.backend_failed(task);
        }
    }

    /// The task has ended: Data-In (with the status collapsed into the last PDU when there is
    /// no sense), or a SCSI Response.
    fn finish(&mut self, c: Completion<IscsiTask, Buffer>) {
        let itt = c.tag as u32;
        self.ended(itt, &c.transport);
        self.account(&c.accounting);
        let status = ScsiStatus(c.status as u8);
        let residual = residual(c.residual);
        let payload = match c.data_in {
            DataIn::None => None,
            DataIn::Buffer { len } => c.buffer.map(|b| (Payload::Buffer(b), len)),
            DataIn::Parameter(v) => {
                let len = v.len() as u32;
                Some((Payload::Bytes(Bytes::from(v)), len))
            }
        }
        .filter(|(_, len)| *len > 0);
        let collapse =
            c.sense.is_none() && matches!(status, ScsiStatus::GOOD | ScsiStatus::CONDITION_MET);
        let mut data_pdus = 0;
        if let Some((payload, len)) = payload {
            data_pdus = len.div_ceil(self.max_send.max(512));
            let st = collapse.then(|| DataInStatus {
                status,
                stat_sn: self.next_stat_sn(),
                residual,
            });
            self.out.push(Outgoing::DataIn {
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
        let (exp, max) = self.window();
        let r = ScsiResponse {
            residual,
            status,
            initiator_task_tag: itt,
            stat_sn: self.next_stat_sn(),
            exp_cmd_sn: exp,
            max_cmd_sn: max,
            exp_data_sn: data_pdus,
            data: c
                .sense
                .map(|s| ScsiResponse::sense_segment(s.as_slice()))
                .unwrap_or_default(),
            ..ScsiResponse::default()
        };
        self.out.push(Outgoing::Pdu(Pdu::ScsiResponse(r)));
    }

    /// Adds a finished task to its unit's counters.
    fn account(&self, a: &Accounting) {
        let Some(lun) = scsi_core::lun_index(a.lun).and_then(|i| self.target.lun(i)) else {
            return;
        };
        let s = &lun.stats;
        let ns = a.latency.as_nanos() as u64;
        use std::sync::atomic::Ordering::Relaxed;
        if a.error {
            s.errors.fetch_add(1, Relaxed);
        }
        if a.read_bytes > 0 {
            s.read_commands.fetch_add(1, Relaxed);
            s.read_bytes.fetch_add(a.read_bytes, Relaxed);
            s.read_latency_ns.fetch_add(ns, Relaxed);
        } else if a.write_bytes > 0 {
            s.write_commands.fetch_add(1, Relaxed);
            s.write_bytes.fetch_add(a.write_bytes, Relaxed);
            s.write_latency_ns.fetch_add(ns, Relaxed);
        } else {
            s.other_commands.fetch_add(1, Relaxed);
        }
    }

    /// Every PDU but SCSI Command and Data-Out.
    fn pdu(&mut self, pdu: Pdu) {
        match pdu {
            Pdu::NopOut(n) => self.nop_out(n),
            Pdu::TaskManagementRequest(t) => self.task_management(t),
            Pdu::TextRequest(t) => {
                if !self.take_cmd_sn(t.immediate, t.cmd_sn) {
                    return;
                }
                let shared = &self.shared;
                let initiator = &self.session.initiator;
                let own = &self.target.name;
                let (peer, local) = (self.peer.ip(), self.portal);
                let r = self
                    .text
                    .request(&t, &mut self.negotiator, self.max_send, |value| {
                        shared.send_targets(initiator, peer, local, value, Some(own))
                    });
                match r {
                    Ok(mut r) => {
                        r.stat_sn = self.next_stat_sn();
                        (r.exp_cmd_sn, r.max_cmd_sn) = self.window();
                        self.max_send = self.negotiator.connection().max_send_data_segment_length;
                        self.out.push(Outgoing::Pdu(Pdu::TextResponse(r)));
                    }
                    Err(reason) => self.reject_pdu(reason, &Pdu::TextRequest(t)),
                }
            }
            Pdu::LogoutRequest(l) => self.logout(l),
            Pdu::SnackRequest(_) => self.reject_pdu(RejectReason::SnackReject, &pdu),
            // A Data-Out without data (with data it comes as a payload).
            Pdu::DataOut(d) => self.data_out(&d, 0, None),
            Pdu::LoginRequest(_) => self.reject_pdu(RejectReason::ProtocolError, &pdu),
            other => self.reject_pdu(RejectReason::CommandNotSupported, &other),
        }
    }

    fn nop_out(&mut self, n: NopOut) {
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
        if !self.take_cmd_sn(n.immediate, n.cmd_sn) {
            return;
        }
        if n.target_transfer_tag != RESERVED_TAG {
            self.reject_pdu(RejectReason::ProtocolError, &Pdu::NopOut(n));
            return;
        }
        let (exp, max) = self.window();
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
        self.out.push(Outgoing::Pdu(Pdu::NopIn(r)));
    }

    fn task_management(&mut self, t: TaskManagementRequest) {
        if !self.take_cmd_sn(t.immediate, t.cmd_sn) {
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
                self.tmf_reply(itt, IscsiTmfResponse::ReassignmentNotSupported, [0; 3]);
                return;
            }
            _ => {
                self.tmf_reply(itt, IscsiTmfResponse::NotSupported, [0; 3]);
                return;
            }
        };
        let r = self.target.core().task_management(
            self.session.nexus,
            t.lun.as_u64(),
            f,
            &self.route,
            &mut self.local,
        );
        match r {
            Ok(reference) => {
                let kind = if t.function == TaskManagementFunction::TargetColdReset {
                    Tmf::ColdReset
                } else {
                    Tmf::Initiator
                };
                self.tmfs.push((reference, itt, kind));
            }
            Err(e) => {
                tracing::error!("task management refused by the core: {e}");
                self.tmf_reply(itt, IscsiTmfResponse::FunctionRejected, [0; 3]);
            }
        }
    }

    fn tmf_response(&mut self, itt: u32, response: TmfResponse) {
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
        self.tmf_reply(itt, code, info);
    }

    fn tmf_reply(&mut self, itt: u32, response: IscsiTmfResponse, info: [u8; 3]) {
        let (exp, max) = self.window();
        let r = TaskManagementResponse {
            response,
            initiator_task_tag: itt,
            stat_sn: self.next_stat_sn(),
            exp_cmd_sn: exp,
            max_cmd_sn: max,
            additional_response_information: info,
        };
        self.out.push(Outgoing::Pdu(Pdu::TaskManagementResponse(r)));
    }

    fn logout(&mut self, l: LogoutRequest) {
        if !self.take_cmd_sn(l.immediate, l.cmd_sn) {
            return;
        }
        let code = match l.reason {
            LogoutReason::CloseSession => {
                self.close_after_flush = true;
                for c in self.session.connection_list() {
                    if c.id != self.id {
                        c.control.request(Request::Close);
                    }
                }
                LogoutResponseCode::ClosedSuccessfully
            }
            LogoutReason::CloseConnection if l.cid == self.cid => {
                self.close_after_flush = true;
                LogoutResponseCode::ClosedSuccessfully
            }
            LogoutReason::CloseConnection => {
                match self
                    .session
                    .connection_list()
                    .iter()
                    .find(|c| c.cid == l.cid)
                {
                    Some(c) => {
                        c.control.request(Request::Close);
                        LogoutResponseCode::ClosedSuccessfully
                    }
                    None => LogoutResponseCode::CidNotFound,
                }
            }
            _ => LogoutResponseCode::RecoveryNotSupported,
        };
        let (exp, max) = self.window();
        let r = LogoutResponse {
            response: code,
            initiator_task_tag: l.initiator_task_tag,
            stat_sn: self.next_stat_sn(),
            exp_cmd_sn: exp,
            max_cmd_sn: max,
            time2wait: 0,
            time2retain: 0,
        };
        self.out.push(Outgoing::Pdu(Pdu::LogoutResponse(r)));
    }

    /// The daemon is stopping: ask the initiator to log out (Asynchronous Message, event 1).
    fn ask_logout(&mut self) {
        self.logout_asked = true;
        let (exp, max) = self.window();
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
        self.out.push(Outgoing::Pdu(Pdu::AsyncMessage(m)));
    }

    /// Once a second: ping an idle initiator, give up on one that does not answer. Returns
    /// true when the connection is to be dropped.
    fn timers(&mut self) -> bool {
        if self.nop_interval.is_zero() {
            return false;
        }
        if let Some((_, sent)) = self.ping {
            if sent.elapsed() >= self.nop_timeout {
                tracing::warn!(
                    initiator = %self.session.initiator,
                    "no answer to NOP-In in {:?}: dropping the connection",
                    self.nop_timeout
                );
                return true;
            }
            return false;
        }
        if self.last_rx.elapsed() >= self.nop_interval {
            let ttt = self.next_ttt;
            self.next_ttt = self.next_ttt.wrapping_add(1).max(1) & 0x7fff_ffff;
            let (exp, max) = self.window();
            self.ping = Some((ttt, Instant::now()));
            self.out.push(Outgoing::Pdu(Pdu::NopIn(NopIn {
                lun: Lun::ZERO,
                initiator_task_tag: RESERVED_TAG,
                target_transfer_tag: ttt,
                stat_sn: self.stat_sn,
                exp_cmd_sn: exp,
                max_cmd_sn: max,
                data: Bytes::new(),
            })));
        }
        false
    }
}
