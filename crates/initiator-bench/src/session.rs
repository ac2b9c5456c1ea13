//! Sessions in full feature phase: one reader and one writer task per connection, a session-wide
//! table of tasks by Initiator Task Tag, the CmdSN window the target grants, immediate and
//! unsolicited data, R2T-solicited Data-Out, Data-In reassembly, NOP, task management, logout,
//! several connections per session, and logging in again after a lost connection.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use bytes::{Bytes, BytesMut};
use iscsi_pdu::negotiation::{ConnectionParams, SessionParams};
use iscsi_pdu::text::{TextParams, TextReassembler};
use iscsi_pdu::{
    DataIn, DataOut, Deframer, Digests, Isid, LogoutReason, LogoutRequest, Lun, NopOut, Pdu,
    Residual, ScsiCommand, ScsiResponse, ScsiStatus, SerialNumber, TaskManagementFunction,
    TaskManagementRequest, TextRequest, TmfResponse, RESERVED_TAG,
};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::TcpStream;
use tokio::sync::{mpsc, oneshot, watch, Notify};

use crate::error::{Error, Result};
use crate::login::{random_isid, LoginExchange, LoginOptions, LoginOutcome};
use crate::scsi::{cdb, parse_capacity16, Command, Response};
use crate::url::IscsiUrl;

/// What a task resolves to.
#[derive(Debug)]
enum Reply {
    Scsi(Response),
    Nop,
    Tmf(TmfResponse),
    Logout,
    Text(Bytes),
}

#[derive(Debug)]
enum TaskKind {
    Scsi {
        /// Where Data-In lands; `edtl` bytes.
        read: BytesMut,
        read_len: u32,
        received: u32,
        next_data_sn: u32,
        /// The data of a write, sliced for each Data-Out.
        write: Bytes,
        next_r2t_sn: u32,
    },
    Nop,
    Tmf,
    Logout,
    Text {
        text: TextReassembler,
    },
}

#[derive(Debug)]
struct Task {
    kind: TaskKind,
    /// The connection the task is allegiant to.
    conn: usize,
    reply: oneshot::Sender<Result<Reply>>,
}

#[derive(Debug)]
struct State {
    cmd_sn: SerialNumber,
    exp_cmd_sn: SerialNumber,
    max_cmd_sn: SerialNumber,
    next_itt: u32,
    tasks: HashMap<u32, Task>,
}

/// One connection of a session, as the senders see it.
#[derive(Debug)]
struct Conn {
    tx: mpsc::UnboundedSender<Bytes>,
    exp_stat_sn: AtomicU32,
    params: ConnectionParams,
    digests: Digests,
    alive: AtomicBool,
}

/// One login of a session: its connections and task table.
#[derive(Debug)]
struct Inner {
    params: SessionParams,
    tsih: u16,
    state: Mutex<State>,
    window: Notify,
    conns: Vec<Arc<Conn>>,
    next_conn: AtomicUsize,
    dead: AtomicBool,
    /// Set when the login is shut down, to wake readers blocked on a silent target.
    closed: watch::Sender<bool>,
}

/// Session statistics since login.
#[derive(Debug, Clone, Copy, Default)]
pub struct SessionInfo {
    /// TSIH the target assigned.
    pub tsih: u16,
    /// Connections in the session.
    pub connections: usize,
}

/// An iSCSI session to one target. Cheap to share (`Arc<Session>`); commands may run from many
/// tasks at once.
#[derive(Debug)]
pub struct Session {
    url: IscsiUrl,
    opts: LoginOptions,
    isid: Isid,
    inner: Mutex<Option<Arc<Inner>>>,
    relogin: tokio::sync::Mutex<()>,
}

/// A command in flight: its Initiator Task Tag, for task management, and its outcome.
#[derive(Debug)]
pub struct PendingCommand {
    /// The Initiator Task Tag.
    pub itt: u32,
    rx: Option<oneshot::Receiver<Result<Reply>>>,
    timeout: std::time::Duration,
    inner: Arc<Inner>,
}

/// A command abandoned before it completed (timed out, or its future dropped) leaves the task
/// table; a late response for it is then ignored.
impl Drop for PendingCommand {
    fn drop(&mut self) {
        self.inner
            .state
            .lock()
            .expect("state")
            .tasks
            .remove(&self.itt);
    }
}

impl PendingCommand {
    /// Waits for the command to complete.
    pub async fn wait(mut self) -> Result<Response> {
        let rx = self.rx.take().expect("waited once");
        match tokio::time::timeout(self.timeout, rx).await {
            Err(_) => Err(Error::Timeout),
            Ok(Err(_)) => Err(Error::ConnectionLost("session closed".into())),
            Ok(Ok(Err(e))) => Err(e),
            Ok(Ok(Ok(Reply::Scsi(r)))) => Ok(r),
            Ok(Ok(Ok(other))) => Err(Error::Protocol(format!("unexpected reply {other:?}"))),
        }
    }
}

/// Dropping a session without logging out closes its connections.
impl Drop for Session {
    fn drop(&mut self) {
        if let Some(inner) = self.current() {
            inner.shutdown("session dropped");
        }
    }
}

impl Session {
    /// Logs in to the target and LUN of `url` (with as many connections as `opts.connections`).
    pub async fn connect(url: &IscsiUrl, opts: LoginOptions) -> Result<Session> {
        let mut opts = opts;
        if let (Some(user), Some(secret), None) = (&url.user, &url.secret, &opts.chap) {
            opts.chap = Some(
                iscsi_pdu::chap::ChapCredentials::new(user.clone(), secret.as_bytes().to_vec(), 1)
                    .map_err(|e| Error::Negotiation(e.into()))?,
            );
        }
        if url.target.is_none() {
            return Err(Error::Url {
                url: url.to_string(),
                reason: "no target name",
            });
        }
        let session = Session {
            url: url.clone(),
            opts,
            isid: random_isid(),
            inner: Mutex::new(None),
            relogin: tokio::sync::Mutex::new(()),
        };
        session.login().await?;
        Ok(session)
    }

    /// The URL's LUN.
    pub fn lun(&self) -> Lun {
        Lun::from_index(self.url.lun)
    }

    /// The negotiated session parameters.
    pub fn params(&self) -> Option<SessionParams> {
        self.current().map(|i| i.params.clone())
    }

    /// The command window the target grants now: (ExpCmdSN, MaxCmdSN); MaxCmdSN - ExpCmdSN + 1
    /// commands may be outstanding.
    pub fn command_window(&self) -> Option<(SerialNumber, SerialNumber)> {
        self.current().map(|i| {
            let st = i.state.lock().expect("state");
            (st.exp_cmd_sn, st.max_cmd_sn)
        })
    }

    /// The digests in force on the first connection.
    pub fn digests(&self) -> Option<Digests> {
        self.current().map(|i| i.conns[0].digests)
    }

    /// TSIH and connection count.
    pub fn info(&self) -> SessionInfo {
        self.current()
            .map_or_else(SessionInfo::default, |i| SessionInfo {
                tsih: i.tsih,
                connections: i.conns.len(),
            })
    }

    fn current(&self) -> Option<Arc<Inner>> {
        self.inner.lock().expect("session lock").clone()
    }

    /// The live login, logging in again (same ISID, so the target reinstates the session) if the
    /// last one was lost.
    async fn live(&self) -> Result<Arc<Inner>> {
        if let Some(i) = self.current().filter(|i| !i.dead.load(Ordering::Acquire)) {
            return Ok(i);
        }
        let _guard = self.relogin.lock().await;
        if let Some(i) = self.current().filter(|i| !i.dead.load(Ordering::Acquire)) {
            return Ok(i);
        }
        self.login().await
    }

    /// Logs in again now, replacing the current login.
    pub async fn reconnect(&self) -> Result<()> {
        let _guard = self.relogin.lock().await;
        if let Some(old) = self.current() {
            old.shutdown("reconnecting");
        }
        self.login().await.map(|_| ())
    }

    async fn login(&self) -> Result<Arc<Inner>> {
        let target = self.url.target.as_deref();
        let (stream, lead, deframer) = login_connection(
            &self.url.portal,
            &self.opts,
            target,
            self.isid,
            0,
            0,
            SerialNumber(0),
        )
        .await?;
        let granted = usize::from(
            lead.session
                .operational
                .max_connections
                .min(self.opts.connections.max(1)),
        );
        let mut conns = vec![(stream, deframer, lead.clone())];
        for cid in 1..granted {
            let (s, o, d) = login_connection(
                &self.url.portal,
                &self.opts,
                target,
                self.isid,
                lead.tsih,
                cid as u16,
                lead.exp_cmd_sn,
            )
            .await?;
            conns.push((s, d, o));
        }
        let inner = start_inner(&lead, conns)?;
        *self.inner.lock().expect("session lock") = Some(inner.clone());
        Ok(inner)
    }

    /// Starts a command; await [`PendingCommand::wait`] for its outcome.
    pub async fn start(&self, cmd: Command) -> Result<PendingCommand> {
        let inner = self.live().await?;
        let (itt, rx) = inner.send_command(cmd).await?;
        Ok(PendingCommand {
            itt,
            rx: Some(rx),
            timeout: self.opts.timeout,
            inner,
        })
    }

    /// Executes a command and returns its response (whatever its status).
    pub async fn execute(&self, cmd: Command) -> Result<Response> {
        self.start(cmd).await?.wait().await
    }

    /// Executes a command until it completes without a UNIT ATTENTION (a few tries: a new
    /// nexus reports power-on, a changed LU reports what changed), and requires GOOD status.
    pub async fn execute_good(&self, cmd: Command) -> Result<Response> {
        const UNIT_ATTENTION: u8 = 0x06;
        let mut tries = 0;
        loop {
            match self.execute(cmd.clone()).await?.good() {
                Err(Error::Scsi { sense: Some(s), .. }) if s.key == UNIT_ATTENTION && tries < 4 => {
                    tries += 1
                }
                other => return other,
            }
        }
    }

    /// READ of `blocks` blocks of `block_size` bytes at `lba`.
    pub async fn read(&self, lba: u64, blocks: u32, block_size: u32) -> Result<Bytes> {
        let cmd = Command::read(self.lun(), cdb::read(lba, blocks), blocks * block_size);
        Ok(self.execute_good(cmd).await?.data)
    }

    /// WRITE of `data` at `lba`.
    pub async fn write(&self, lba: u64, data: Bytes, block_size: u32) -> Result<()> {
        let blocks = (data.len() / block_size as usize) as u32;
        self.execute_good(Command::write(self.lun(), cdb::write(lba, blocks), data))
            .await?;
        Ok(())
    }

    /// (blocks, block size) from READ CAPACITY (16).
    pub async fn capacity(&self) -> Result<(u64, u32)> {
        let r = self
            .execute_good(Command::read(self.lun(), cdb::read_capacity16(), 32))
            .await?;
        parse_capacity16(&r.data).ok_or_else(|| Error::Command("short READ CAPACITY data".into()))
    }

    /// A NOP-Out ping, answered by a NOP-In.
    pub async fn nop(&self) -> Result<()> {
        let inner = self.live().await?;
        let rx = inner.send_immediate(TaskKind::Nop, |itt, cmd_sn, exp| {
            Pdu::NopOut(NopOut {
                immediate: true,
                initiator_task_tag: itt,
                target_transfer_tag: RESERVED_TAG,
                cmd_sn,
                exp_stat_sn: exp,
                data: Bytes::new(),
                ..Default::default()
            })
        })?;
        match wait(rx, self.opts.timeout).await? {
            Reply::Nop => Ok(()),
            other => Err(Error::Protocol(format!("NOP answered with {other:?}"))),
        }
    }

    /// A task management function on this session's LUN; `referenced` is the ITT of the task
    /// for ABORT TASK and QUERY TASK.
    pub async fn task_management(
        &self,
        function: TaskManagementFunction,
        referenced: Option<u32>,
    ) -> Result<TmfResponse> {
        let inner = self.live().await?;
        let lun = self.lun();
        let rx = inner.send_immediate(TaskKind::Tmf, |itt, cmd_sn, exp| {
            Pdu::TaskManagementRequest(TaskManagementRequest {
                immediate: true,
                function,
                lun,
                initiator_task_tag: itt,
                referenced_task_tag: referenced.unwrap_or(RESERVED_TAG),
                cmd_sn,
                exp_stat_sn: exp,
                ref_cmd_sn: cmd_sn,
                exp_data_sn: 0,
            })
        })?;
        let response = match wait(rx, self.opts.timeout).await? {
            Reply::Tmf(r) => r,
            other => return Err(Error::Protocol(format!("TMF answered with {other:?}"))),
        };
        if function == TaskManagementFunction::AbortTask
            && response == TmfResponse::FunctionComplete
        {
            if let Some(task) =
                referenced.and_then(|t| inner.state.lock().expect("state").tasks.remove(&t))
            {
                let _ = task.reply.send(Err(Error::Aborted));
            }
        }
        Ok(response)
    }

    /// Logs out (closes the session) and drops the connections.
    pub async fn logout(&self) -> Result<()> {
        let Some(inner) = self.current() else {
            return Ok(());
        };
        let rx = inner.send_immediate(TaskKind::Logout, |itt, cmd_sn, exp| {
            Pdu::LogoutRequest(LogoutRequest {
                immediate: true,
                reason: LogoutReason::CloseSession,
                initiator_task_tag: itt,
                cid: 0,
                cmd_sn,
                exp_stat_sn: exp,
            })
        })?;
        let r = wait(rx, self.opts.timeout).await;
        inner.shutdown("logged out");
        *self.inner.lock().expect("session lock") = None;
        r.map(|_| ())
    }
}

async fn wait(rx: oneshot::Receiver<Result<Reply>>, timeout: std::time::Duration) -> Result<Reply> {
    match tokio::time::timeout(timeout, rx).await {
        Err(_) => Err(Error::Timeout),
        Ok(Err(_)) => Err(Error::ConnectionLost("session closed".into())),
        Ok(Ok(r)) => r,
    }
}

/// Connects and logs in one connection (`tsih` 0 for a new session).
async fn login_connection(
    portal: &str,
    opts: &LoginOptions,
    target: Option<&str>,
    isid: Isid,
    tsih: u16,
    cid: u16,
    cmd_sn: SerialNumber,
) -> Result<(TcpStream, LoginOutcome, Deframer)> {
    let mut stream = tokio::time::timeout(opts.timeout, TcpStream::connect(portal))
        .await
        .map_err(|_| Error::Timeout)??;
    let mut deframer = Deframer::new();
    let outcome = LoginExchange {
        stream: &mut stream,
        deframer: &mut deframer,
        isid,
        tsih,
        cid,
        cmd_sn,
    }
    .run(opts, target)
    .await?;
    Ok((stream, outcome, deframer))
}

impl Inner {
    fn pick_conn(&self) -> Option<usize> {
        let n = self.conns.len();
        (0..n)
            .map(|k| (self.next_conn.fetch_add(1, Ordering::Relaxed) + k) % n)
            .find(|&i| self.conns[i].alive.load(Ordering::Acquire))
    }

    /// Assigns a CmdSN within the window and queues the command's PDUs, in CmdSN order.
    async fn send_command(&self, cmd: Command) -> Result<(u32, oneshot::Receiver<Result<Reply>>)> {
        let (tx, rx) = oneshot::channel();
        loop {
            let notified = self.window.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            {
                if self.dead.load(Ordering::Acquire) {
                    return Err(Error::ConnectionLost("session lost".into()));
                }
                let mut st = self.state.lock().expect("state");
                if st.cmd_sn.le(st.max_cmd_sn) {
                    let ci = self
                        .pick_conn()
                        .ok_or_else(|| Error::ConnectionLost("no live connection".into()))?;
                    let conn = &self.conns[ci];
                    let itt = next_itt(&mut st);
                    let cmd_sn = st.cmd_sn;
                    st.cmd_sn = cmd_sn.next();
                    let frames = self.command_frames(conn, &cmd, itt, cmd_sn);
                    let read = if cmd.data_in_len > 0 {
                        BytesMut::zeroed(cmd.data_in_len as usize)
                    } else {
                        BytesMut::new()
                    };
                    st.tasks.insert(
                        itt,
                        Task {
                            kind: TaskKind::Scsi {
                                read,
                                read_len: cmd.data_in_len,
                                received: 0,
                                next_data_sn: 0,
                                write: cmd.data_out.clone(),
                                next_r2t_sn: 0,
                            },
                            conn: ci,
                            reply: tx,
                        },
                    );
                    for f in frames {
                        if conn.tx.send(f).is_err() {
                            break;
                        }
                    }
                    return Ok((itt, rx));
                }
            }
            notified.await;
        }
    }

    /// The SCSI Command PDU with its immediate data, and the unsolicited Data-Out PDUs.
    fn command_frames(
        &self,
        conn: &Conn,
        cmd: &Command,
        itt: u32,
        cmd_sn: SerialNumber,
    ) -> Vec<Bytes> {
        let op = &self.params.operational;
        let len = cmd.data_out.len() as u32;
        let mrdsl = conn.params.max_send_data_segment_length;
        let first_burst = if op.initial_r2t && !op.immediate_data {
            0
        } else {
            op.first_burst_length.min(len)
        };
        let immediate = if op.immediate_data {
            first_burst.min(mrdsl)
        } else {
            0
        };
        let unsolicited_end = if op.initial_r2t {
            immediate
        } else {
            first_burst
        };
        let exp_stat_sn = SerialNumber(conn.exp_stat_sn.load(Ordering::Acquire));
        let mut frames = Vec::with_capacity(1);
        let command = Pdu::ScsiCommand(ScsiCommand {
            immediate: false,
            final_bit: unsolicited_end == immediate,
            read: cmd.data_in_len > 0,
            write: len > 0,
            task_attribute: cmd.attribute,
            lun: cmd.lun,
            initiator_task_tag: itt,
            expected_data_transfer_length: if len > 0 { len } else { cmd.data_in_len },
            cmd_sn,
            exp_stat_sn,
            cdb: cmd.cdb,
            extended_cdb: None,
            bidirectional_read_length: (len > 0 && cmd.data_in_len > 0).then_some(cmd.data_in_len),
            data: cmd.data_out.slice(..immediate as usize),
        });
        frames.push(encode(&command, conn.digests));
        data_out_frames(
            &mut frames,
            conn,
            cmd.lun,
            itt,
            RESERVED_TAG,
            &cmd.data_out,
            immediate,
            unsolicited_end,
        );
        frames
    }

    /// Queues an immediate PDU (NOP-Out, TMF, Logout, Text) that does not advance CmdSN.
    fn send_immediate(
        &self,
        kind: TaskKind,
        build: impl FnOnce(u32, SerialNumber, SerialNumber) -> Pdu,
    ) -> Result<oneshot::Receiver<Result<Reply>>> {
        let (tx, rx) = oneshot::channel();
        let mut st = self.state.lock().expect("state");
        let ci = self
            .pick_conn()
            .ok_or_else(|| Error::ConnectionLost("no live connection".into()))?;
        let conn = &self.conns[ci];
        let itt = next_itt(&mut st);
        let pdu = build(
            itt,
            st.cmd_sn,
            SerialNumber(conn.exp_stat_sn.load(Ordering::Acquire)),
        );
        st.tasks.insert(
            itt,
            Task {
                kind,
                conn: ci,
                reply: tx,
            },
        );
        conn.tx
            .send(encode(&pdu, conn.digests))
            .map_err(|_| Error::ConnectionLost("connection closed".into()))?;
        Ok(rx)
    }

    /// Marks the login dead and fails every task.
    fn shutdown(&self, why: &str) {
        self.dead.store(true, Ordering::Release);
        self.closed.send_replace(true);
        for c in &self.conns {
            c.alive.store(false, Ordering::Release);
        }
        let tasks: Vec<Task> = self
            .state
            .lock()
            .expect("state")
            .tasks
            .drain()
            .map(|(_, t)| t)
            .collect();
        for t in tasks {
            let _ = t.reply.send(Err(Error::ConnectionLost(why.into())));
        }
        self.window.notify_waiters();
    }

    /// A connection ended: fail its tasks; the login dies with its last connection.
    fn connection_lost(&self, idx: usize, why: String) {
        self.conns[idx].alive.store(false, Ordering::Release);
        if self.conns.iter().all(|c| !c.alive.load(Ordering::Acquire)) {
            self.shutdown(&why);
            return;
        }
        let mut st = self.state.lock().expect("state");
        let lost: Vec<u32> = st
            .tasks
            .iter()
            .filter(|(_, t)| t.conn == idx)
            .map(|(k, _)| *k)
            .collect();
        for itt in lost {
            if let Some(t) = st.tasks.remove(&itt) {
                let _ = t.reply.send(Err(Error::ConnectionLost(why.clone())));
            }
        }
    }

    /// ExpCmdSN and MaxCmdSN from a target PDU (RFC 7143 section 4.2.2.1): ignored when
    /// MaxCmdSN < ExpCmdSN - 1, and only ever moved forward.
    fn update_window(&self, exp: SerialNumber, max: SerialNumber) {
        if max.lt(SerialNumber(exp.0.wrapping_sub(1))) {
            return;
        }
        let mut st = self.state.lock().expect("state");
        let mut moved = false;
        if exp.gt(st.exp_cmd_sn) {
            st.exp_cmd_sn = exp;
            moved = true;
        }
        if max.gt(st.max_cmd_sn) {
            st.max_cmd_sn = max;
            moved = true;
        }
        drop(st);
        if moved {
            self.window.notify_waiters();
        }
    }
}

fn next_itt(st: &mut State) -> u32 {
    loop {
        let itt = st.next_itt;
        st.next_itt = st.next_itt.wrapping_add(1);
        if itt != RESERVED_TAG && !st.tasks.contains_key(&itt) {
            return itt;
        }
    }
}

fn encode(pdu: &Pdu, digests: Digests) -> Bytes {
    let mut b = BytesMut::with_capacity(48 + 8 + pdu.data().len() + 4);
    pdu.encode(digests, &mut b);
    b.freeze()
}

/// Data-Out PDUs for bytes `from..to` of `data`, one sequence (DataSN from 0, F on the last),
/// each at most the target's MaxRecvDataSegmentLength.
#[allow(clippy::too_many_arguments)]
fn data_out_frames(
    frames: &mut Vec<Bytes>,
    conn: &Conn,
    lun: Lun,
    itt: u32,
    ttt: u32,
    data: &Bytes,
    from: u32,
    to: u32,
) {
    let max = conn.params.max_send_data_segment_length.max(512);
    let mut offset = from;
    let mut data_sn = 0;
    let exp_stat_sn = SerialNumber(conn.exp_stat_sn.load(Ordering::Acquire));
    while offset < to {
        let n = max.min(to - offset);
        let pdu = Pdu::DataOut(DataOut {
            final_bit: offset + n == to,
            lun,
            initiator_task_tag: itt,
            target_transfer_tag: ttt,
            exp_stat_sn,
            data_sn,
            buffer_offset: offset,
            data: data.slice(offset as usize..(offset + n) as usize),
        });
        frames.push(encode(&pdu, conn.digests));
        offset += n;
        data_sn += 1;
    }
}

/// Writes queued frames, coalescing what is ready into one write.
async fn writer(mut w: OwnedWriteHalf, mut rx: mpsc::UnboundedReceiver<Bytes>) {
    let mut staging = BytesMut::with_capacity(256 * 1024);
    while let Some(first) = rx.recv().await {
        staging.extend_from_slice(&first);
        while staging.len() < 1 << 20 {
            match rx.try_recv() {
                Ok(more) => staging.extend_from_slice(&more),
                Err(_) => break,
            }
        }
        if w.write_all(&staging).await.is_err() {
            return;
        }
        staging.clear();
    }
    let _ = w.shutdown().await;
}

/// Reads and dispatches PDUs until the connection ends.
async fn reader(inner: Arc<Inner>, idx: usize, mut r: OwnedReadHalf, mut deframer: Deframer) {
    let mut closed = inner.closed.subscribe();
    let why = loop {
        let pdu = match deframer.next_pdu() {
            Ok(Some(pdu)) => pdu,
            Ok(None) => {
                let want = deframer.needed().max(64 * 1024);
                deframer.buffer_mut().reserve(want);
                tokio::select! {
                    read = r.read_buf(deframer.buffer_mut()) => match read {
                        Ok(0) => break "target closed the connection".to_string(),
                        Ok(_) => continue,
                        Err(e) => break format!("read: {e}"),
                    },
                    _ = closed.wait_for(|c| *c) => break "session closed".to_string(),
                }
            }
            Err(e) if e.is_fatal() => break format!("target sent a bad PDU: {e}"),
            Err(e) => {
                tracing::warn!("target sent a malformed PDU: {e}");
                continue;
            }
        };
        if inner.dead.load(Ordering::Acquire) {
            break "session closed".to_string();
        }
        if let Err(why) = dispatch(&inner, idx, pdu) {
            break why;
        }
    };
    inner.connection_lost(idx, why);
}

/// Handles one PDU from the target. An `Err` closes the connection.
fn dispatch(inner: &Inner, idx: usize, pdu: Pdu) -> Result<(), String> {
    let conn = &inner.conns[idx];
    let advance = |stat_sn: SerialNumber| {
        conn.exp_stat_sn
            .fetch_max(stat_sn.next().0, Ordering::AcqRel)
    };
    match pdu {
        Pdu::DataIn(d) => {
            inner.update_window(d.exp_cmd_sn, d.max_cmd_sn);
            if let Some(s) = &d.status {
                advance(s.stat_sn);
            }
            data_in(inner, d);
        }
        Pdu::ScsiResponse(r) => {
            inner.update_window(r.exp_cmd_sn, r.max_cmd_sn);
            advance(r.stat_sn);
            scsi_response(inner, r);
        }
        Pdu::ReadyToTransfer(r2t) => {
            inner.update_window(r2t.exp_cmd_sn, r2t.max_cmd_sn);
            ready_to_transfer(inner, conn, r2t);
        }
        Pdu::NopIn(n) => {
            inner.update_window(n.exp_cmd_sn, n.max_cmd_sn);
            if n.initiator_task_tag != RESERVED_TAG {
                advance(n.stat_sn);
                complete(inner, n.initiator_task_tag, Ok(Reply::Nop));
            }
            if n.target_transfer_tag != RESERVED_TAG {
                // The target pings: answer with the same TTT and LUN.
                let cmd_sn = inner.state.lock().expect("state").cmd_sn;
                let pong = Pdu::NopOut(NopOut {
                    immediate: true,
                    lun: n.lun,
                    initiator_task_tag: RESERVED_TAG,
                    target_transfer_tag: n.target_transfer_tag,
                    cmd_sn,
                    exp_stat_sn: SerialNumber(conn.exp_stat_sn.load(Ordering::Acquire)),
                    data: n.data,
                });
                let _ = conn.tx.send(encode(&pong, conn.digests));
            }
        }
        Pdu::TaskManagementResponse(t) => {
            inner.update_window(t.exp_cmd_sn, t.max_cmd_sn);
            advance(t.stat_sn);
            complete(inner, t.initiator_task_tag, Ok(Reply::Tmf(t.response)));
        }
        Pdu::LogoutResponse(l) => {
            advance(l.stat_sn);
            complete(inner, l.initiator_task_tag, Ok(Reply::Logout));
            return Err("logged out".into());
        }
        Pdu::TextResponse(t) => {
            inner.update_window(t.exp_cmd_sn, t.max_cmd_sn);
            advance(t.stat_sn);
            text_response(inner, conn, t);
        }
        Pdu::Reject(r) => {
            inner.update_window(r.exp_cmd_sn, r.max_cmd_sn);
            if let Some(h) = r.rejected_header() {
                complete(
                    inner,
                    h.initiator_task_tag(),
                    Err(Error::Rejected(r.reason)),
                );
            }
        }
        Pdu::AsyncMessage(a) => {
            inner.update_window(a.exp_cmd_sn, a.max_cmd_sn);
            tracing::info!("asynchronous message from the target: {:?}", a.event);
            if matches!(
                a.event,
                iscsi_pdu::AsyncEvent::ConnectionDropped | iscsi_pdu::AsyncEvent::SessionDropped
            ) {
                return Err(format!("target dropping the connection ({:?})", a.event));
            }
        }
        other => {
            return Err(format!(
                "target sent an initiator PDU: {:?}",
                other.opcode()
            ))
        }
    }
    Ok(())
}

fn complete(inner: &Inner, itt: u32, reply: Result<Reply>) {
    let task = inner.state.lock().expect("state").tasks.remove(&itt);
    if let Some(t) = task {
        let _ = t.reply.send(reply);
    }
}

/// Places Data-In payload, checking DataSN order and bounds; a bad PDU fails its command only.
fn data_in(inner: &Inner, d: DataIn) {
    let mut st = inner.state.lock().expect("state");
    let Some(task) = st.tasks.get_mut(&d.initiator_task_tag) else {
        return; // Already failed or aborted.
    };
    let failure = match &mut task.kind {
        TaskKind::Scsi {
            read,
            read_len,
            received,
            next_data_sn,
            ..
        } => {
            let end = u64::from(d.buffer_offset) + d.data.len() as u64;
            if d.data_sn != *next_data_sn {
                Some(format!(
                    "Data-In DataSN {} where {} was due",
                    d.data_sn, next_data_sn
                ))
            } else if end > u64::from(*read_len) {
                Some(format!(
                    "Data-In for bytes {}..{end} of a {read_len}-byte buffer",
                    d.buffer_offset
                ))
            } else {
                read[d.buffer_offset as usize..end as usize].copy_from_slice(&d.data);
                *received += d.data.len() as u32;
                *next_data_sn += 1;
                None
            }
        }
        _ => Some("Data-In for a task that is not a SCSI command".into()),
    };
    if let Some(why) = failure {
        let t = st.tasks.remove(&d.initiator_task_tag).expect("present");
        let _ = t.reply.send(Err(Error::Command(why)));
        return;
    }
    if let Some(s) = d.status {
        let t = st.tasks.remove(&d.initiator_task_tag).expect("present");
        drop(st);
        finish_scsi(t, s.status, None, s.residual);
    }
}

fn scsi_response(inner: &Inner, r: ScsiResponse) {
    let task = inner
        .state
        .lock()
        .expect("state")
        .tasks
        .remove(&r.initiator_task_tag);
    let Some(task) = task else { return };
    if r.response != iscsi_pdu::ScsiResponseCode::CommandCompleted {
        let _ = task.reply.send(Err(Error::Command(format!(
            "target failure ({:?})",
            r.response
        ))));
        return;
    }
    let sense = r.sense();
    finish_scsi(task, r.status, sense, r.residual);
}

fn finish_scsi(task: Task, status: ScsiStatus, sense: Option<Bytes>, residual: Residual) {
    let TaskKind::Scsi {
        read,
        read_len,
        received,
        ..
    } = task.kind
    else {
        let _ = task.reply.send(Err(Error::Protocol(
            "SCSI status for a non-SCSI task".into(),
        )));
        return;
    };
    // What the residual says came, and never more than did come.
    let len = match residual {
        Residual::Underflow(n) => read_len.saturating_sub(n),
        _ => read_len,
    }
    .min(received);
    let mut data = read;
    data.truncate(len as usize);
    let _ = task.reply.send(Ok(Reply::Scsi(Response {
        status,
        sense,
        data: data.freeze(),
        residual,
    })));
}

/// Answers an R2T with Data-Out PDUs from the command's data.
fn ready_to_transfer(inner: &Inner, conn: &Conn, r2t: iscsi_pdu::ReadyToTransfer) {
    let mut st = inner.state.lock().expect("state");
    let Some(task) = st.tasks.get_mut(&r2t.initiator_task_tag) else {
        return;
    };
    let checked = match &mut task.kind {
        TaskKind::Scsi {
            write, next_r2t_sn, ..
        } => {
            let end = u64::from(r2t.buffer_offset) + u64::from(r2t.desired_data_transfer_length);
            if r2t.r2t_sn != *next_r2t_sn {
                Err(format!(
                    "R2TSN {} where {} was due",
                    r2t.r2t_sn, next_r2t_sn
                ))
            } else if end > write.len() as u64 {
                Err(format!(
                    "R2T for bytes {}..{end} of a {}-byte write",
                    r2t.buffer_offset,
                    write.len()
                ))
            } else {
                *next_r2t_sn += 1;
                Ok(write.clone())
            }
        }
        _ => Err("R2T for a task that is not a SCSI command".into()),
    };
    match checked {
        Ok(data) => {
            drop(st);
            let mut frames = Vec::new();
            let from = r2t.buffer_offset;
            data_out_frames(
                &mut frames,
                conn,
                r2t.lun,
                r2t.initiator_task_tag,
                r2t.target_transfer_tag,
                &data,
                from,
                from + r2t.desired_data_transfer_length,
            );
            for f in frames {
                let _ = conn.tx.send(f);
            }
        }
        Err(why) => {
            let t = st.tasks.remove(&r2t.initiator_task_tag).expect("present");
            let _ = t.reply.send(Err(Error::Command(why)));
        }
    }
}

fn text_response(inner: &Inner, conn: &Conn, t: iscsi_pdu::TextResponse) {
    let mut st = inner.state.lock().expect("state");
    let Some(task) = st.tasks.get_mut(&t.initiator_task_tag) else {
        return;
    };
    let TaskKind::Text { text } = &mut task.kind else {
        return;
    };
    match text.push(&t.data, t.continue_bit || !t.final_bit) {
        Err(e) => {
            let task = st.tasks.remove(&t.initiator_task_tag).expect("present");
            let _ = task
                .reply
                .send(Err(Error::Command(format!("text response: {e}"))));
        }
        Ok(Some(all)) => {
            let task = st.tasks.remove(&t.initiator_task_tag).expect("present");
            let _ = task.reply.send(Ok(Reply::Text(all)));
        }
        Ok(None) => {
            // Ask for the rest: an empty Text Request with the target's TTT.
            let next = Pdu::TextRequest(TextRequest {
                immediate: true,
                final_bit: true,
                continue_bit: false,
                lun: t.lun,
                initiator_task_tag: t.initiator_task_tag,
                target_transfer_tag: t.target_transfer_tag,
                cmd_sn: st.cmd_sn,
                exp_stat_sn: SerialNumber(conn.exp_stat_sn.load(Ordering::Acquire)),
                data: Bytes::new(),
            });
            let _ = conn.tx.send(encode(&next, conn.digests));
        }
    }
}

/// A target found by discovery, with its portals (`address:port,tpgt`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DiscoveredTarget {
    /// TargetName.
    pub name: String,
    /// TargetAddress values.
    pub addresses: Vec<String>,
}

/// Discovery: a discovery session to the URL's portal and `SendTargets=All`.
pub async fn discover(url: &IscsiUrl, opts: &LoginOptions) -> Result<Vec<DiscoveredTarget>> {
    let (stream, outcome, deframer) = login_connection(
        &url.portal,
        opts,
        None,
        random_isid(),
        0,
        0,
        SerialNumber(0),
    )
    .await?;
    let session = Session {
        url: url.clone(),
        opts: opts.clone(),
        isid: Isid::default(),
        inner: Mutex::new(None),
        relogin: tokio::sync::Mutex::new(()),
    };
    let inner = start_inner(&outcome, vec![(stream, deframer, outcome.clone())])?;
    *session.inner.lock().expect("session lock") = Some(inner.clone());
    let mut request = TextParams::new();
    request.push("SendTargets", "All");
    let data = request.encode();
    let rx = inner.send_immediate(
        TaskKind::Text {
            text: TextReassembler::default(),
        },
        |itt, cmd_sn, exp| {
            Pdu::TextRequest(TextRequest {
                immediate: true,
                final_bit: true,
                continue_bit: false,
                lun: Lun::ZERO,
                initiator_task_tag: itt,
                target_transfer_tag: RESERVED_TAG,
                cmd_sn,
                exp_stat_sn: exp,
                data,
            })
        },
    )?;
    let text = match wait(rx, opts.timeout).await? {
        Reply::Text(t) => t,
        other => {
            return Err(Error::Protocol(format!(
                "SendTargets answered with {other:?}"
            )))
        }
    };
    let _ = session.logout().await;
    let params = TextParams::parse_send_targets(&text)
        .map_err(|e| Error::Protocol(format!("SendTargets: {e}")))?;
    let mut targets: Vec<DiscoveredTarget> = Vec::new();
    for (k, v) in params.iter() {
        match (k, targets.last_mut()) {
            ("TargetName", _) => targets.push(DiscoveredTarget {
                name: v.into(),
                addresses: Vec::new(),
            }),
            ("TargetAddress", Some(t)) => t.addresses.push(v.into()),
            _ => {}
        }
    }
    Ok(targets)
}

/// Builds a login's task table and starts the reader and writer of each connection; the session
/// parameters and the CmdSN window come from the leading connection's login.
fn start_inner(
    lead: &LoginOutcome,
    streams: Vec<(TcpStream, Deframer, LoginOutcome)>,
) -> Result<Arc<Inner>> {
    let mut conns = Vec::new();
    let mut halves = Vec::new();
    for (stream, mut deframer, outcome) in streams {
        stream.set_nodelay(true)?;
        let (r, w) = stream.into_split();
        let (tx, rx) = mpsc::unbounded_channel();
        let params = outcome.connection;
        let digests = Digests {
            header: params.header_digest,
            data: params.data_digest,
        };
        deframer.set_digests(digests);
        deframer.set_max_recv_data_segment_length(params.max_recv_data_segment_length);
        conns.push(Arc::new(Conn {
            tx,
            exp_stat_sn: AtomicU32::new(outcome.exp_stat_sn.0),
            params,
            digests,
            alive: AtomicBool::new(true),
        }));
        halves.push((r, w, rx, deframer));
    }
    let inner = Arc::new(Inner {
        params: lead.session.clone(),
        tsih: lead.tsih,
        state: Mutex::new(State {
            cmd_sn: lead.exp_cmd_sn,
            exp_cmd_sn: lead.exp_cmd_sn,
            max_cmd_sn: lead.max_cmd_sn,
            next_itt: 1,
            tasks: HashMap::new(),
        }),
        window: Notify::new(),
        conns,
        next_conn: AtomicUsize::new(0),
        dead: AtomicBool::new(false),
        closed: watch::channel(false).0,
    });
    for (idx, (r, w, rx, deframer)) in halves.into_iter().enumerate() {
        tokio::spawn(writer(w, rx));
        tokio::spawn(reader(inner.clone(), idx, r, deframer));
    }
    Ok(inner)
}
