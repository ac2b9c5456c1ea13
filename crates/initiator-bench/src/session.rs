//! Sessions in full feature phase: the I/O shell around `iscsi_pdu`'s sans-IO initiator
//! [`Session`](machine::Session), which keeps the task table, the CmdSN window, Data-Out for
//! immediate, unsolicited and solicited data, Data-In reassembly, NOP, task management, text and
//! logout. This file keeps one reader and one writer task per connection, the timeouts, the
//! waiters of each task, several connections per session, and logging in again after a lost
//! connection.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use bytes::{Bytes, BytesMut};
use iscsi_pdu::initiator::{self as machine, Reply, StartError};
use iscsi_pdu::negotiation::SessionParams;
use iscsi_pdu::text::TextParams;
use iscsi_pdu::{
    Deframer, Digests, Isid, Lun, Pdu, ScsiStatus, SerialNumber, TaskManagementFunction,
    TmfResponse,
};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::TcpStream;
use tokio::sync::{mpsc, oneshot, watch, Semaphore};

use crate::error::{Error, Result};
use crate::login::{random_isid, Established, LoginExchange, LoginOptions};
use crate::scsi::{cdb, parse_capacity16, BlockLimits, Command, Response};
use crate::url::IscsiUrl;

/// The machine and the waiters of its tasks, under one lock.
#[derive(Debug)]
struct State {
    machine: machine::Session,
    replies: HashMap<u32, oneshot::Sender<Result<Reply>>>,
    /// The MaxCmdSN up to which the window's permits were given out.
    window_granted: SerialNumber,
    /// Each command's stages, while tracing (`initiator-bench run --trace`).
    trace: Option<Tracing>,
}

/// A login's trace: its session's key, the records, and the commands whose first data came.
#[derive(Debug)]
struct Tracing {
    session: u64,
    records: Vec<cmdtrace::Record>,
    /// Records that found the trace full.
    dropped: u64,
    first_data: std::collections::HashSet<u32>,
}

/// Records a login keeps at most (32 bytes each).
const TRACE_RECORDS: usize = 1 << 21;

impl State {
    /// Notes that command `itt` reached `stage` at `at_ns`, while tracing.
    fn trace(&mut self, stage: cmdtrace::Stage, itt: u32, at_ns: u64, arg: u32) {
        self.trace_sn(stage, itt, 0, at_ns, arg);
    }

    /// [`State::trace`] with the command's CmdSN.
    fn trace_sn(&mut self, stage: cmdtrace::Stage, itt: u32, cmd_sn: u32, at_ns: u64, arg: u32) {
        if let Some(t) = &mut self.trace {
            if t.records.len() < TRACE_RECORDS {
                t.records.push(cmdtrace::Record {
                    at_ns,
                    session: t.session,
                    itt,
                    cmd_sn,
                    stage,
                    lane: 0,
                    arg,
                });
            } else {
                t.dropped += 1;
            }
        }
    }
}

/// One login of a session: its machine and the channels to its connections' writers.
#[derive(Debug)]
struct Inner {
    state: Mutex<State>,
    /// Whether `state.trace` is on: checked without the lock before reading the clock.
    tracing: AtomicBool,
    /// Room in the CmdSN window, a permit per CmdSN: a command takes one (and keeps it: its
    /// CmdSN is used) before it starts. The semaphore is fair, so commands waiting for the
    /// window start in the order they came, and one that has just finished does not pass
    /// them (a latency tool's p99 must not be one command starved by the others).
    window: Semaphore,
    writers: Vec<mpsc::UnboundedSender<Bytes>>,
    dead: AtomicBool,
    /// Set when the login is shut down, to wake readers blocked on a silent target.
    closed: watch::Sender<bool>,
    /// The target asked to log out every connection (AsyncEvent 1): no command starts on this
    /// login any more; the machine logs out once the commands in flight end.
    logout_requested: AtomicBool,
    /// The machine's next timeout may have moved earlier (a logout the target wants within
    /// its Parameter3): the timer task looks again.
    rearm: tokio::sync::Notify,
    /// `host:port`, for the log.
    portal: String,
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
    /// Commands sent again because the target turned them away ([`turned_away`]).
    resent: AtomicU64,
}

/// How long a command the target turned away waits before it is sent again.
const RESEND_AFTER: std::time::Duration = std::time::Duration::from_millis(1);

/// Whether `status` asks the initiator to send the command again later: BUSY, or TASK SET
/// FULL (SAM-5 5.3.1; targetd's answer to a write its connection has no buffer space for).
/// A SCSI layer sends such a command again (Linux requeues it); so does this one, after
/// [`RESEND_AFTER`], until the command timeout has passed since the first answer.
fn turned_away(status: ScsiStatus) -> bool {
    matches!(status, ScsiStatus::BUSY | ScsiStatus::TASK_SET_FULL)
}

/// A command in flight: its Initiator Task Tag, for task management, and its outcome.
#[derive(Debug)]
pub struct PendingCommand {
    /// The Initiator Task Tag.
    pub itt: u32,
    rx: Option<oneshot::Receiver<Result<Reply>>>,
    inner: Arc<Inner>,
}

/// A command abandoned before it completed (timed out, or its future dropped) leaves the task
/// table; a late response for it is then ignored.
impl Drop for PendingCommand {
    fn drop(&mut self) {
        let mut st = self.inner.state();
        st.machine.forget(self.itt);
        st.replies.remove(&self.itt);
    }
}

impl PendingCommand {
    /// Waits for the command to complete.
    pub async fn wait(mut self) -> Result<Response> {
        let rx = self.rx.take().expect("waited once");
        // The machine ends it at its deadline (`Timers::task`, the session's timeout).
        match rx.await {
            Err(_) => Err(Error::ConnectionLost("session closed".into())),
            Ok(Err(e)) => Err(e),
            Ok(Ok(Reply::Scsi(r))) => Ok(Response::from(r)),
            Ok(Ok(other)) => Err(Error::Protocol(format!("unexpected reply {other:?}"))),
        }
    }
}

/// `blocks` cut into runs of at most `max` (at least 1): (offset, length) pairs.
fn pieces(blocks: u32, max: u32) -> impl Iterator<Item = (u64, u32)> {
    let max = max.max(1);
    (0..blocks.div_ceil(max)).map(move |i| {
        let at = i * max;
        (u64::from(at), max.min(blocks - at))
    })
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
    /// A session to `url` that has not logged in yet.
    fn unconnected(url: &IscsiUrl, opts: LoginOptions, isid: Isid) -> Session {
        Session {
            url: url.clone(),
            opts,
            isid,
            inner: Mutex::new(None),
            relogin: tokio::sync::Mutex::new(()),
            resent: AtomicU64::new(0),
        }
    }

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
        let isid = opts.isid.unwrap_or_else(random_isid);
        let session = Session::unconnected(url, opts, isid);
        session.login().await?;
        Ok(session)
    }

    /// Whether the target asked this login to log out (AsyncEvent 1, as a gateway that is
    /// going down does): its commands in flight still end, new ones wait for the next login.
    pub fn logout_requested(&self) -> bool {
        self.current().is_some_and(|i| {
            i.logout_requested.load(Ordering::Acquire) && !i.dead.load(Ordering::Acquire)
        })
    }

    /// The URL it logs in with (target, portal, LUN).
    pub fn url(&self) -> &IscsiUrl {
        &self.url
    }

    /// The URL's LUN, in the PDU's encoding.
    pub fn lun(&self) -> Lun {
        Lun::from_index(self.url.lun)
    }

    /// The negotiated session parameters.
    pub fn params(&self) -> Option<SessionParams> {
        self.current().map(|i| i.state().machine.params().clone())
    }

    /// The command window the target grants now: (ExpCmdSN, MaxCmdSN); MaxCmdSN - ExpCmdSN + 1
    /// commands may be outstanding.
    pub fn command_window(&self) -> Option<(SerialNumber, SerialNumber)> {
        self.current().map(|i| i.state().machine.window())
    }

    /// The digests in force on the first connection.
    pub fn digests(&self) -> Option<Digests> {
        self.current().map(|i| i.state().machine.digests(0))
    }

    /// TSIH and connection count.
    pub fn info(&self) -> SessionInfo {
        self.current()
            .map_or_else(SessionInfo::default, |i| SessionInfo {
                tsih: i.state().machine.tsih(),
                connections: i.writers.len(),
            })
    }

    fn current(&self) -> Option<Arc<Inner>> {
        self.inner.lock().expect("session lock").clone()
    }

    /// The live login, logging in again (same ISID, so the target reinstates the session) if the
    /// last one was lost.
    async fn live(&self) -> Result<Arc<Inner>> {
        if let Some(i) = self.current().filter(|i| !i.dead.load(Ordering::Acquire)) {
            if !i.logout_requested.load(Ordering::Acquire) {
                return Ok(i);
            }
            // The target asked to log out: wait for the machine's Logout to end this login
            // (its commands in flight end first), then log in again, as open-iscsi does.
            let mut closed = i.closed.subscribe();
            let ended = tokio::time::timeout(self.opts.timeout, closed.wait_for(|c| *c)).await;
            if ended.is_err() {
                i.shutdown("the requested logout did not end in time");
            }
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
        let inner = start_inner(&self.url.portal, &lead, conns, self.opts.timeout)?;
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
            inner,
        })
    }

    /// Executes a command and returns its response (whatever its status, but a command the
    /// target turned away with BUSY or TASK SET FULL is sent again, as a SCSI layer does).
    pub async fn execute(&self, cmd: Command) -> Result<Response> {
        let pending = self.start(cmd.clone()).await?;
        self.complete(pending, cmd).await
    }

    /// Waits for `pending`, the command `cmd`, sending it again while the target turns it away.
    async fn complete(&self, pending: PendingCommand, cmd: Command) -> Result<Response> {
        let mut r = pending.wait().await?;
        let until = tokio::time::Instant::now() + self.opts.timeout;
        while turned_away(r.status) && tokio::time::Instant::now() < until {
            self.resent.fetch_add(1, Ordering::Relaxed);
            tokio::time::sleep(RESEND_AFTER).await;
            r = self.start(cmd.clone()).await?.wait().await?;
        }
        Ok(r)
    }

    /// Starts tracing each command's stages on this session's current login (submitted,
    /// waiting for the CmdSN window, sent, first data, status, completed).
    pub fn start_trace(&self) {
        let Some(inner) = self.current() else {
            return;
        };
        let mut st = inner.state();
        let session = cmdtrace::Record::session_of(self.isid.0, st.machine.tsih());
        st.trace = Some(Tracing {
            session,
            records: Vec::with_capacity(1 << 16),
            dropped: 0,
            first_data: std::collections::HashSet::new(),
        });
        inner.tracing.store(true, Ordering::Relaxed);
    }

    /// Stops tracing and hands over the records, and how many found the trace full.
    pub fn take_trace(&self) -> (Vec<cmdtrace::Record>, u64) {
        let Some(inner) = self.current() else {
            return (Vec::new(), 0);
        };
        inner.tracing.store(false, Ordering::Relaxed);
        let mut st = inner.state();
        st.trace
            .take()
            .map(|t| (t.records, t.dropped))
            .unwrap_or_default()
    }

    /// Commands sent again because the target answered BUSY or TASK SET FULL.
    pub fn resent(&self) -> u64 {
        self.resent.load(Ordering::Relaxed)
    }

    /// Executes a command until it completes without a UNIT ATTENTION (a few tries: a new
    /// nexus reports power-on, a changed LU reports what changed), whatever its status then.
    pub async fn execute_past_unit_attentions(&self, cmd: Command) -> Result<Response> {
        const UNIT_ATTENTION: u8 = 0x06;
        let mut tries = 0;
        loop {
            let r = self.execute(cmd.clone()).await?;
            let sense = r.sense.as_deref().and_then(crate::scsi::Sense::parse);
            if sense.is_some_and(|s| s.key == UNIT_ATTENTION) && tries < 4 {
                tries += 1;
                continue;
            }
            return Ok(r);
        }
    }

    /// [`Session::execute_past_unit_attentions`], requiring GOOD status.
    pub async fn execute_good(&self, cmd: Command) -> Result<Response> {
        self.execute_past_unit_attentions(cmd).await?.good()
    }

    /// READ of `blocks` blocks of `block_size` bytes at `lba`.
    pub async fn read(&self, lba: u64, blocks: u32, block_size: u32) -> Result<Bytes> {
        let cmd = Command::read(self.lun(), cdb::read(lba, blocks), blocks * block_size);
        Ok(self.execute_good(cmd).await?.data)
    }

    /// READ of `blocks` blocks at `lba` as commands of at most `max_blocks` blocks, all in
    /// flight together (as a block layer splits a request it may not send whole); the data
    /// comes back joined.
    pub async fn read_split(
        &self,
        lba: u64,
        blocks: u32,
        block_size: u32,
        max_blocks: u32,
    ) -> Result<Bytes> {
        if max_blocks == 0 || blocks <= max_blocks {
            return self.read(lba, blocks, block_size).await;
        }
        let mut pending = Vec::new();
        for (at, n) in pieces(blocks, max_blocks) {
            let cmd = Command::read(self.lun(), cdb::read(lba + at, n), n * block_size);
            pending.push((self.start(cmd.clone()).await?, cmd));
        }
        let mut data = BytesMut::with_capacity((blocks * block_size) as usize);
        for (p, cmd) in pending {
            data.extend_from_slice(&self.complete(p, cmd).await?.good()?.data);
        }
        Ok(data.freeze())
    }

    /// WRITE of `data` at `lba` as commands of at most `max_blocks` blocks, all in flight
    /// together.
    pub async fn write_split(
        &self,
        lba: u64,
        data: Bytes,
        block_size: u32,
        max_blocks: u32,
    ) -> Result<()> {
        let blocks = (data.len() / block_size as usize) as u32;
        if max_blocks == 0 || blocks <= max_blocks {
            return self.write(lba, data, block_size).await;
        }
        let mut pending = Vec::new();
        for (at, n) in pieces(blocks, max_blocks) {
            let from = (at * u64::from(block_size)) as usize;
            let piece = data.slice(from..from + (n * block_size) as usize);
            let cmd = Command::write(self.lun(), cdb::write(lba + at, n), piece);
            pending.push((self.start(cmd.clone()).await?, cmd));
        }
        for (p, cmd) in pending {
            self.complete(p, cmd).await?.good()?;
        }
        Ok(())
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

    /// The unit's Block Limits page (VPD B0h).
    pub async fn block_limits(&self) -> Result<BlockLimits> {
        let cmd = Command::read(self.lun(), cdb::inquiry_vpd(0xb0, 64), 64);
        let r = self.execute_good(cmd).await?;
        BlockLimits::parse(&r.data).ok_or_else(|| Error::Command("short Block Limits page".into()))
    }

    /// A NOP-Out ping, answered by a NOP-In.
    pub async fn nop(&self) -> Result<()> {
        let inner = self.live().await?;
        let mut itt = 0;
        let rx = inner.start(|m| {
            let r = m.start_nop(Instant::now());
            if let Ok(i) = r {
                itt = i;
            }
            r
        })?;
        if inner.tracing.load(Ordering::Relaxed) {
            // Sent when queued to the writer (inside `start`); dated just after.
            inner
                .state()
                .trace(cmdtrace::Stage::NopSent, itt, cmdtrace::now_ns(), 0);
        }
        let reply = wait(rx).await?;
        if inner.tracing.load(Ordering::Relaxed) {
            inner
                .state()
                .trace(cmdtrace::Stage::NopAnswered, itt, cmdtrace::now_ns(), 0);
        }
        match reply {
            Reply::Nop => Ok(()),
            other => Err(Error::Protocol(format!("NOP answered with {other:?}"))),
        }
    }

    /// A task management function on this session's LUN; `referenced` is the ITT of the task
    /// for ABORT TASK and QUERY TASK (an aborted task's waiter gets [`Error::Aborted`]).
    pub async fn task_management(
        &self,
        function: TaskManagementFunction,
        referenced: Option<u32>,
    ) -> Result<TmfResponse> {
        let inner = self.live().await?;
        let lun = self.lun();
        let rx =
            inner.start(|m| m.start_task_management(Instant::now(), function, lun, referenced))?;
        match wait(rx).await? {
            Reply::Tmf(r) => Ok(r),
            other => Err(Error::Protocol(format!("TMF answered with {other:?}"))),
        }
    }

    /// Logs out (closes the session) and drops the connections.
    pub async fn logout(&self) -> Result<()> {
        let Some(inner) = self.current() else {
            return Ok(());
        };
        let rx = inner.start(|m| m.start_logout(Instant::now()))?;
        let r = wait(rx).await;
        inner.shutdown("logged out");
        *self.inner.lock().expect("session lock") = None;
        r.map(|_| ())
    }
}

/// The outcome of a request; the machine ends it at its deadline (`Timers::task`).
async fn wait(rx: oneshot::Receiver<Result<Reply>>) -> Result<Reply> {
    match rx.await {
        Err(_) => Err(Error::ConnectionLost("session closed".into())),
        Ok(r) => r,
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
) -> Result<(TcpStream, Established, Deframer)> {
    let mut stream = tokio::time::timeout(opts.timeout, TcpStream::connect(portal))
        .await
        .map_err(|_| Error::Connect {
            portal: portal.to_string(),
            error: std::io::ErrorKind::TimedOut.into(),
        })?
        .map_err(|error| Error::Connect {
            portal: portal.to_string(),
            error,
        })?;
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
    fn state(&self) -> MutexGuard<'_, State> {
        self.state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Runs `f` on the machine, then hands out what it produced: PDUs to the connections'
    /// writers, outcomes to the tasks' waiters, a wake-up to senders waiting for the window.
    fn with<R>(&self, f: impl FnOnce(&mut machine::Session) -> R) -> R {
        let mut st = self.state();
        let r = f(&mut st.machine);
        self.flush(&mut st);
        r
    }

    fn flush(&self, st: &mut State) {
        for (ci, tx) in self.writers.iter().enumerate() {
            let digests = st.machine.digests(ci);
            while let Some(pdu) = st.machine.poll_transmit(ci) {
                let _ = tx.send(encode(&pdu, digests));
            }
        }
        let mut opened = false;
        while let Some(ev) = st.machine.poll_event() {
            match ev {
                machine::Event::Done { itt, result } => {
                    if st.trace.is_some() {
                        st.trace(cmdtrace::Stage::Completed, itt, cmdtrace::now_ns(), 0);
                    }
                    if let Some(reply) = st.replies.remove(&itt) {
                        let _ = reply.send(result.map_err(Error::from));
                    }
                }
                machine::Event::WindowOpened => opened = true,
                machine::Event::LogoutRequested { conn, within } => {
                    tracing::info!(
                        portal = %self.portal,
                        conn,
                        "the target asks to log out within {within:?}: no new command on it"
                    );
                    if st.machine.logout_requested() {
                        self.logout_requested.store(true, Ordering::Release);
                    }
                    self.rearm.notify_one();
                }
            }
        }
        if opened {
            // Permits for each CmdSN the window has grown by.
            let (_, max) = st.machine.window();
            if max.gt(st.window_granted) {
                self.window
                    .add_permits(max.0.wrapping_sub(st.window_granted.0) as usize);
                st.window_granted = max;
            }
        }
    }

    /// A PDU from connection `idx` into the machine (its data and status noted, while
    /// tracing).
    fn received(&self, idx: usize, pdu: Pdu) -> std::result::Result<(), machine::ConnectionError> {
        let mut st = self.state();
        if st.trace.is_some() {
            use cmdtrace::Stage;
            let now = cmdtrace::now_ns();
            let (itt, data, status) = match &pdu {
                Pdu::DataIn(d) => (d.initiator_task_tag, true, d.status.is_some()),
                Pdu::ScsiResponse(r) => (r.initiator_task_tag, false, true),
                _ => (0, false, false),
            };
            let first = data && st.trace.as_mut().is_some_and(|t| t.first_data.insert(itt));
            if first {
                st.trace(Stage::FirstData, itt, now, 0);
            }
            if status {
                if let Some(t) = st.trace.as_mut() {
                    t.first_data.remove(&itt);
                }
                st.trace(Stage::StatusReceived, itt, now, 0);
            }
        }
        let r = st.machine.handle_pdu(Instant::now(), idx, pdu);
        self.flush(&mut st);
        r
    }

    /// Starts a request that does not wait for the window (NOP-Out, TMF, Logout, Text).
    fn start(
        &self,
        f: impl FnOnce(&mut machine::Session) -> Result<u32, StartError>,
    ) -> Result<oneshot::Receiver<Result<Reply>>> {
        let (tx, rx) = oneshot::channel();
        let mut st = self.state();
        let itt = f(&mut st.machine).map_err(start_error)?;
        st.replies.insert(itt, tx);
        self.flush(&mut st);
        Ok(rx)
    }

    /// Starts a SCSI command once the CmdSN window has room for it.
    async fn send_command(&self, cmd: Command) -> Result<(u32, oneshot::Receiver<Result<Reply>>)> {
        let traced = self.tracing.load(Ordering::Relaxed);
        let submitted = if traced { cmdtrace::now_ns() } else { 0 };
        let mut waited = None;
        loop {
            let permit = match self.window.try_acquire() {
                Ok(permit) => permit,
                Err(_) => {
                    if traced && waited.is_none() {
                        waited = Some(cmdtrace::now_ns());
                    }
                    // Closed when the login ends.
                    self.window
                        .acquire()
                        .await
                        .map_err(|_| Error::ConnectionLost("session lost".into()))?
                }
            };
            if self.dead.load(Ordering::Acquire) {
                return Err(Error::ConnectionLost("session lost".into()));
            }
            let mut st = self.state();
            let cmd_sn = st.machine.next_cmd_sn().0;
            match st.machine.start_command(Instant::now(), &cmd) {
                Ok(itt) => {
                    // Its CmdSN is taken: the permit stays used until the window grows.
                    permit.forget();
                    if traced {
                        use cmdtrace::Stage;
                        let len = cmd.data_in_len.max(cmd.data_out.len() as u32);
                        st.trace_sn(Stage::Submitted, itt, cmd_sn, submitted, len);
                        if let Some(w) = waited {
                            st.trace(Stage::WindowWait, itt, w, 0);
                        }
                        st.trace(Stage::Sent, itt, cmdtrace::now_ns(), 0);
                    }
                    let (tx, rx) = oneshot::channel();
                    st.replies.insert(itt, tx);
                    self.flush(&mut st);
                    return Ok((itt, rx));
                }
                // The permits count the window, so this is a window that shrank (a target
                // that moved MaxCmdSN back, which the machine ignores): the permit was one too
                // many; wait for the next.
                Err(StartError::WindowClosed) => permit.forget(),
                Err(e) => return Err(start_error(e)),
            }
        }
    }

    /// Marks the login dead and fails every task.
    fn shutdown(&self, why: &str) {
        self.dead.store(true, Ordering::Release);
        self.closed.send_replace(true);
        self.with(|m| m.shutdown(why));
        // Every command waiting for the window finds the login dead.
        self.window.close();
    }

    /// A connection ended: its tasks fail; the login dies with its last connection.
    fn connection_lost(&self, idx: usize, why: &str) {
        if !self.with(|m| {
            m.connection_lost(idx, why);
            m.is_alive()
        }) {
            self.shutdown(why);
        }
    }
}

fn start_error(e: StartError) -> Error {
    match e {
        StartError::NoConnection => Error::ConnectionLost("no live connection".into()),
        StartError::WindowClosed => Error::ConnectionLost("the command window is closed".into()),
        StartError::LogoutRequested => Error::LogoutRequested,
    }
}

fn encode(pdu: &Pdu, digests: Digests) -> Bytes {
    let mut b = BytesMut::with_capacity(48 + 8 + pdu.data().len() + 4);
    pdu.encode(digests, &mut b);
    b.freeze()
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
        if let Err(why) = inner.received(idx, pdu) {
            break why.0;
        }
    };
    inner.connection_lost(idx, &why);
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
    let session = Session::unconnected(url, opts.clone(), Isid::default());
    let inner = start_inner(
        &url.portal,
        &outcome,
        vec![(stream, deframer, outcome.clone())],
        opts.timeout,
    )?;
    *session.inner.lock().expect("session lock") = Some(inner.clone());
    let mut request = TextParams::new();
    request.push("SendTargets", "All");
    let data = request.encode();
    let rx = inner.start(|m| m.start_text(Instant::now(), data))?;
    let text = match wait(rx).await? {
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

/// Builds a login's machine and starts the reader and writer of each connection; the session
/// parameters and the CmdSN window come from the leading connection's login.
fn start_inner(
    portal: &str,
    lead: &Established,
    streams: Vec<(TcpStream, Deframer, Established)>,
    timeout: Duration,
) -> Result<Arc<Inner>> {
    let mut machine = machine::Session::new(
        lead.session.clone(),
        lead.tsih,
        lead.exp_cmd_sn,
        lead.max_cmd_sn,
    );
    machine.set_timers(machine::Timers {
        task: Some(timeout),
        ..machine::Timers::default()
    });
    let mut writers = Vec::new();
    let mut halves = Vec::new();
    for (stream, mut deframer, outcome) in streams {
        stream.set_nodelay(true)?;
        let (r, w) = stream.into_split();
        let (tx, rx) = mpsc::unbounded_channel();
        let params = outcome.connection;
        let ci = machine.add_connection(params, outcome.exp_stat_sn);
        deframer.set_digests(machine.digests(ci));
        deframer.set_max_recv_data_segment_length(params.max_recv_data_segment_length);
        writers.push(tx);
        halves.push((r, w, rx, deframer));
    }
    // A permit per CmdSN the login's window grants: ExpCmdSN to MaxCmdSN.
    let (exp, max) = (lead.exp_cmd_sn, lead.max_cmd_sn);
    let room = if exp.le(max) {
        max.0.wrapping_sub(exp.0) as usize + 1
    } else {
        0
    };
    let inner = Arc::new(Inner {
        state: Mutex::new(State {
            machine,
            replies: HashMap::new(),
            window_granted: lead.max_cmd_sn,
            trace: None,
        }),
        tracing: AtomicBool::new(false),
        window: Semaphore::new(room),
        writers,
        dead: AtomicBool::new(false),
        closed: watch::channel(false).0,
        logout_requested: AtomicBool::new(false),
        rearm: tokio::sync::Notify::new(),
        portal: portal.to_string(),
    });
    for (idx, (r, w, rx, deframer)) in halves.into_iter().enumerate() {
        tokio::spawn(writer(w, rx));
        tokio::spawn(reader(inner.clone(), idx, r, deframer));
    }
    tokio::spawn(timers(inner.clone(), timeout));
    Ok(inner)
}

/// Runs the machine's timers on the runtime's clock until the login ends: tasks past their
/// deadline end with [`Error::Timeout`]. With nothing due, nothing can fall due sooner than
/// `timeout` from now (a task started now), so the task sleeps that long at most.
async fn timers(inner: Arc<Inner>, timeout: Duration) {
    let mut closed = inner.closed.subscribe();
    loop {
        let due = inner.state().machine.poll_timeout();
        let wake = due.map_or_else(
            || tokio::time::Instant::now() + timeout,
            tokio::time::Instant::from_std,
        );
        tokio::select! {
            _ = tokio::time::sleep_until(wake) => {}
            _ = inner.rearm.notified() => {}
            _ = closed.wait_for(|c| *c) => return,
        }
        inner.with(|m| m.handle_timeout(Instant::now()));
    }
}
