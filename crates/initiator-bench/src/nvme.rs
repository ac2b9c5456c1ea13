//! An NVMe/TCP host: a controller reached over TCP, as Linux's `nvme connect -t tcp` makes
//! one. The protocol is crates/nvme's host machine ([`HostQueue`]); this module is its I/O
//! shell: a task per queue (the admin queue and one I/O queue) owns the socket, sends each
//! command with a free CID, answers R2Ts with the write's data and hands back the completion
//! and a read's data. The admin queue sends Keep Alive at half the keep alive timeout.
//!
//! Connecting does what a host must before I/O: ICReq, Connect on the admin queue (a dynamic
//! controller), CC.EN and CSTS.RDY, Identify Controller (MDTS, the in-capsule data size),
//! Number of Queues, Identify Namespace, then Connect on the I/O queue.

use std::collections::{HashMap, VecDeque};
use std::io::IoSlice;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use cmdtrace::Stage;

use bytes::{Bytes, BytesMut};
use nvme::fabrics::{
    property, Connect, ConnectData, PropertyAccess, CC_EN, CNTLID_DYNAMIC, CSTS_RDY,
};
use nvme::identify::cns;
use nvme::opcode::{AdminOpcode, FabricsType, NvmOpcode};
use nvme::sqe::{Sgl, Sqe};
use nvme::tcp::{Digests, HostEvent, HostQueue, HostSettings, Transmit};
use nvme::{Cqe, Status};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::sync::{mpsc, oneshot};

/// NVMe/TCP's port.
pub const DEFAULT_PORT: u16 = 4420;
/// Room reserved in the receive buffer before each read, at least (as the iSCSI reader).
const READ_RESERVE: usize = 64 * 1024;
/// The size of a receive buffer.
const RECEIVE_BUFFER: usize = 1024 * 1024;
/// Receive buffers a queue keeps for reuse.
const SPARE_BUFFERS: usize = 8;

/// Why an NVMe/TCP operation failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum NvmeError {
    /// The URL is malformed.
    #[error("bad NVMe/TCP URL {url:?}: {reason}")]
    Url {
        /// The URL.
        url: String,
        /// What is wrong with it.
        reason: &'static str,
    },
    /// The connection could not be made, or broke; the queue is gone.
    #[error("connection: {0}")]
    Connection(String),
    /// The controller ended a command with this status.
    #[error("NVMe status {status} (command {opcode:#04x})")]
    Status {
        /// The command's opcode.
        opcode: u8,
        /// How it ended.
        status: Status,
    },
    /// The controller answered what the host cannot use.
    #[error("protocol: {0}")]
    Protocol(String),
}

/// The ANA state namespace `nsid`'s group has in ANA log page `page`, if it lists it.
pub fn ana_state_in(page: &[u8], nsid: u32) -> Option<u8> {
    let groups = u16::from_le_bytes([*page.get(8)?, *page.get(9)?]);
    let mut at = 16usize;
    for _ in 0..groups {
        let n = u32::from_le_bytes(page.get(at + 4..at + 8)?.try_into().ok()?) as usize;
        let state = *page.get(at + 16)?;
        let nsids = page.get(at + 32..at + 32 + 4 * n)?;
        if nsids
            .chunks(4)
            .any(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]) == nsid)
        {
            return Some(state);
        }
        at += 32 + 4 * n;
    }
    None
}

/// `nvme://HOST[:PORT]/SUBNQN/NSID`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NvmeUrl {
    /// `host:port`.
    pub portal: String,
    /// The subsystem's NQN.
    pub nqn: String,
    /// The namespace.
    pub nsid: u32,
}

impl NvmeUrl {
    /// Parses `nvme://HOST[:PORT]/SUBNQN/NSID` (an IPv6 host in brackets).
    pub fn parse(url: &str) -> Result<NvmeUrl, NvmeError> {
        let bad = |reason| NvmeError::Url {
            url: url.into(),
            reason,
        };
        let rest = url
            .strip_prefix("nvme://")
            .ok_or_else(|| bad("does not start with nvme://"))?;
        let (host, path) = rest.split_once('/').ok_or_else(|| bad("no /SUBNQN/NSID"))?;
        let (nqn, nsid) = path
            .rsplit_once('/')
            .ok_or_else(|| bad("no /NSID after the NQN"))?;
        let nsid: u32 = nsid.parse().map_err(|_| bad("the NSID is not a number"))?;
        if nsid == 0 || nsid == u32::MAX {
            return Err(bad("the NSID must be 1 to FFFFFFFEh"));
        }
        nvme::fabrics::check_nqn(nqn).map_err(|_| bad("the subsystem is not an NQN"))?;
        if host.is_empty() {
            return Err(bad("no host"));
        }
        let portal = crate::portal::portal(host, DEFAULT_PORT).map_err(bad)?;
        Ok(NvmeUrl {
            portal,
            nqn: nqn.into(),
            nsid,
        })
    }
}

/// How the host connects.
#[derive(Debug, Clone)]
pub struct NvmeOptions {
    /// The host's NQN.
    pub hostnqn: String,
    /// The host identifier (16 bytes).
    pub hostid: [u8; 16],
    /// Ask for header and data digests.
    pub digests: Digests,
    /// Entries of the I/O queue (commands outstanding: one less).
    pub queue_entries: u16,
    /// The keep alive timeout asked for in Connect.
    pub kato: Duration,
    /// Disable SQ flow control on the I/O queue (Linux's `--disable-sqflow`): a read that
    /// succeeds then ends with its data (C2HData with SUCCESS), no response capsule.
    pub disable_sqflow: bool,
}

impl Default for NvmeOptions {
    fn default() -> Self {
        NvmeOptions {
            hostnqn: "nqn.2014-08.org.nvmexpress:uuid:8e1b3c9a-0000-4000-8000-696e69746961".into(),
            hostid: *b"initiator-bench!",
            digests: Digests::default(),
            queue_entries: 128,
            kato: Duration::from_secs(10),
            disable_sqflow: false,
        }
    }
}

/// A command for a queue's task: the SQE (its CID set by the task), the data that goes with
/// it (a write's), and where the completion goes.
struct Request {
    sqe: Sqe,
    data: Bytes,
    reply: oneshot::Sender<Result<(Cqe, Bytes), NvmeError>>,
    /// A Keep Alive that dates the clocks (traced as a NOP is for iSCSI).
    ping: bool,
}

/// A command in flight on a queue.
struct InFlight {
    data: Bytes,
    /// Read data came damaged or out of order: the command fails when it ends.
    damaged: bool,
    /// The data read so far.
    read: ReadData,
    /// Traced as a clock-dating ping.
    ping: bool,
    /// Its first data came (traced).
    first_data: bool,
    reply: oneshot::Sender<Result<(Cqe, Bytes), NvmeError>>,
}

impl InFlight {
    /// [`InFlight::end`], with its status's arrival and its completion traced (a ping's
    /// answer, for a ping).
    fn end_traced(self, cqe: Cqe, trace: &QueueTrace) {
        if !trace.is_on() {
            return self.end(cqe);
        }
        let (cid, ping) = (cqe.cid, self.ping);
        let stage = if ping {
            Stage::NopAnswered
        } else {
            Stage::StatusReceived
        };
        trace.record(stage, cid, cmdtrace::now_ns(), 0);
        self.end(cqe);
        if !ping {
            trace.record(Stage::Completed, cid, cmdtrace::now_ns(), 0);
        }
    }

    /// Tells the command's sender it ended with `cqe`.
    fn end(self, cqe: Cqe) {
        let r = if self.damaged {
            Err(NvmeError::Protocol(format!(
                "command {}: read data came damaged (data digest) or out of order",
                cqe.cid
            )))
        } else {
            Ok((cqe, self.read.into_bytes()))
        };
        let _ = self.reply.send(r);
    }
}

/// A read's data as it comes: one C2HData's bytes kept as they are (the usual case, no
/// copy), or several joined.
#[derive(Debug)]
enum ReadData {
    Empty,
    One(Bytes),
    Joined(BytesMut),
}

impl ReadData {
    /// Bytes so far: the offset the next piece must have.
    fn len(&self) -> usize {
        match self {
            ReadData::Empty => 0,
            ReadData::One(b) => b.len(),
            ReadData::Joined(b) => b.len(),
        }
    }

    fn push(&mut self, data: Bytes) {
        *self = match std::mem::replace(self, ReadData::Empty) {
            ReadData::Empty => ReadData::One(data),
            ReadData::One(first) => {
                let mut joined = BytesMut::with_capacity(first.len() + data.len());
                joined.extend_from_slice(&first);
                joined.extend_from_slice(&data);
                ReadData::Joined(joined)
            }
            ReadData::Joined(mut joined) => {
                joined.extend_from_slice(&data);
                ReadData::Joined(joined)
            }
        };
    }

    fn into_bytes(self) -> Bytes {
        match self {
            ReadData::Empty => Bytes::new(),
            ReadData::One(b) => b,
            ReadData::Joined(b) => b.freeze(),
        }
    }
}

/// Receive buffers to reuse. Reads' data are handed out as slices of the buffer they came in
/// (no copy), so a consumed buffer cannot be grown in place while any is alive: it is set
/// aside and taken again once every slice of it has been dropped. Without this, every
/// buffer is fresh memory from the allocator, and a 128 KiB read costs more in page faults
/// than in copies.
#[derive(Debug, Default)]
struct SpareBuffers {
    spares: VecDeque<BytesMut>,
}

impl SpareBuffers {
    /// Makes room for at least `want` more bytes in `buf`.
    fn make_room(&mut self, buf: &mut BytesMut, want: usize) {
        if buf.capacity() - buf.len() >= want || buf.try_reclaim(want) {
            return;
        }
        // A spare no slice shares any more gets all its room back; the part of a PDU
        // already in moves over with it.
        let need = buf.len() + want;
        let reusable = self.spares.iter_mut().position(|b| b.try_reclaim(need));
        let mut next = match reusable {
            Some(i) => self.spares.remove(i).expect("found"),
            None => BytesMut::with_capacity(need.max(RECEIVE_BUFFER)),
        };
        next.extend_from_slice(buf);
        let mut old = std::mem::replace(buf, next);
        old.clear();
        if self.spares.len() == SPARE_BUFFERS {
            self.spares.pop_front();
        }
        self.spares.push_back(old);
    }
}

/// One queue: a task owning its connection, reached through a channel.
#[derive(Debug, Clone)]
struct QueueHandle {
    tx: mpsc::UnboundedSender<Request>,
    /// In-capsule data a command may carry on this queue.
    in_capsule: u32,
    /// The queue's command trace, shared with its task.
    trace: Arc<QueueTrace>,
}

/// A queue's command trace (`run --trace`): the stages of each command by CID, recorded by
/// the queue's task while on.
#[derive(Debug, Default)]
struct QueueTrace {
    on: AtomicBool,
    state: Mutex<Option<Tracing>>,
}

/// A trace in progress.
#[derive(Debug)]
struct Tracing {
    /// The queue's trace session (`cmdtrace::Record::session_of_queue`).
    session: u64,
    records: Vec<cmdtrace::Record>,
    /// Records that found the trace full.
    dropped: u64,
}

/// Records a queue keeps at most (32 bytes each).
const TRACE_RECORDS: usize = 1 << 21;

impl QueueTrace {
    fn is_on(&self) -> bool {
        self.on.load(Ordering::Relaxed)
    }

    fn start(&self, session: u64) {
        *self.state.lock().expect("trace lock") = Some(Tracing {
            session,
            records: Vec::with_capacity(1 << 16),
            dropped: 0,
        });
        self.on.store(true, Ordering::Relaxed);
    }

    fn take(&self) -> (Vec<cmdtrace::Record>, u64) {
        self.on.store(false, Ordering::Relaxed);
        self.state
            .lock()
            .expect("trace lock")
            .take()
            .map_or((Vec::new(), 0), |t| (t.records, t.dropped))
    }

    /// Notes that command `cid` reached `stage` at `at_ns`, while on.
    fn record(&self, stage: Stage, cid: u16, at_ns: u64, arg: u32) {
        if !self.is_on() {
            return;
        }
        if let Some(t) = self.state.lock().expect("trace lock").as_mut() {
            if t.records.len() < TRACE_RECORDS {
                t.records.push(cmdtrace::Record {
                    at_ns,
                    session: t.session,
                    itt: u32::from(cid),
                    cmd_sn: 0,
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

impl QueueHandle {
    /// Opens a connection to `portal` and exchanges ICReq and ICResp.
    async fn open(portal: &str, digests: Digests, entries: u16) -> Result<QueueHandle, NvmeError> {
        let stream = TcpStream::connect(portal)
            .await
            .map_err(|e| NvmeError::Connection(format!("{portal}: {e}")))?;
        let _ = stream.set_nodelay(true);
        let host = HostQueue::new(HostSettings {
            digests,
            ..HostSettings::default()
        });
        let (tx, rx) = mpsc::unbounded_channel();
        let (ready_tx, ready_rx) = oneshot::channel();
        let trace = Arc::new(QueueTrace::default());
        tokio::spawn(queue_task(
            stream,
            host,
            rx,
            entries.max(2) - 1,
            ready_tx,
            trace.clone(),
        ));
        ready_rx
            .await
            .map_err(|_| NvmeError::Connection("closed before ICResp".into()))??;
        Ok(QueueHandle {
            tx,
            in_capsule: 8192,
            trace,
        })
    }

    /// Sends `sqe` with `data` (in the capsule when it fits, else on the controller's R2T);
    /// the completion and the data read (`read_len` bytes asked).
    async fn command(
        &self,
        mut sqe: Sqe,
        data: Bytes,
        read_len: usize,
    ) -> Result<(Cqe, Bytes), NvmeError> {
        if !data.is_empty() {
            let len = data.len() as u32;
            sqe.set_sgl(if len <= self.in_capsule {
                Sgl::in_capsule(0, len)
            } else {
                Sgl::transport(len)
            });
        } else if read_len > 0 {
            sqe.set_sgl(Sgl::transport(read_len as u32));
        }
        let opcode = sqe.opcode();
        let (reply, rx) = oneshot::channel();
        let traced = self.trace.is_on();
        self.tx
            .send(Request {
                sqe,
                data,
                reply,
                // Keep Alive goes only to the admin queue.
                ping: traced && opcode == AdminOpcode::KeepAlive.code(),
            })
            .map_err(|_| NvmeError::Connection("the queue is closed".into()))?;
        let (cqe, bytes) = rx
            .await
            .map_err(|_| NvmeError::Connection("the queue closed".into()))??;
        if !cqe.status.is_success() {
            return Err(NvmeError::Status {
                opcode,
                status: cqe.status,
            });
        }
        Ok((cqe, bytes))
    }
}

/// Fails every command in flight and waiting with `e`.
fn fail_all(flight: &mut HashMap<u16, InFlight>, waiting: &mut VecDeque<Request>, e: &NvmeError) {
    for (_, f) in flight.drain() {
        let _ = f.reply.send(Err(e.clone()));
    }
    for r in waiting.drain(..) {
        let _ = r.reply.send(Err(e.clone()));
    }
}

/// Writes every PDU the host machine queued.
async fn flush(
    wr: &mut tokio::net::tcp::OwnedWriteHalf,
    host: &mut HostQueue,
) -> std::io::Result<()> {
    let mut batch: Vec<Transmit> = Vec::new();
    while let Some(t) = host.poll_transmit() {
        batch.push(t);
    }
    if batch.is_empty() {
        return Ok(());
    }
    // Header, its zeros (padding to PDO), data, data digest.
    let mut slices: Vec<IoSlice<'_>> = Vec::with_capacity(batch.len() * 4);
    for t in &batch {
        slices.extend(t.slices().map(IoSlice::new));
    }
    let mut iov = &mut slices[..];
    while !iov.is_empty() {
        let n = wr.write_vectored(iov).await?;
        if n == 0 {
            return Err(std::io::ErrorKind::WriteZero.into());
        }
        IoSlice::advance_slices(&mut iov, n);
    }
    Ok(())
}

/// Runs one queue: commands from `rx` go out with free CIDs (at most `depth` at once),
/// completions and data come back to their senders.
async fn queue_task(
    stream: TcpStream,
    mut host: HostQueue,
    mut rx: mpsc::UnboundedReceiver<Request>,
    depth: u16,
    ready: oneshot::Sender<Result<(), NvmeError>>,
    trace: Arc<QueueTrace>,
) {
    let (mut rd, mut wr) = stream.into_split();
    let mut ready = Some(ready);
    let mut free: Vec<u16> = (0..depth).rev().collect();
    let mut flight: HashMap<u16, InFlight> = HashMap::new();
    let mut waiting: VecDeque<Request> = VecDeque::new();
    let mut open = true;
    let mut spares = SpareBuffers::default();
    // Commands written by the next flush, while tracing (and whether each is a ping).
    let mut unsent: Vec<(u16, bool)> = Vec::new();
    loop {
        // Send what waits, as CIDs allow.
        while host.terms().is_some() && !free.is_empty() {
            let Some(mut r) = waiting.pop_front() else {
                break;
            };
            let cid = free.pop().expect("checked");
            r.sqe.set_cid(cid);
            let in_capsule = matches!(r.sqe.sgl().kind(), nvme::sqe::SglKind::InCapsule { .. });
            let capsule = if in_capsule {
                r.data.clone()
            } else {
                Bytes::new()
            };
            if let Err(e) = host.send_command(&r.sqe, capsule) {
                free.push(cid);
                let _ = r.reply.send(Err(NvmeError::Connection(e.to_string())));
                continue;
            }
            if trace.is_on() {
                // Submitted once it has its CID: a command's records run from one
                // submission of its CID to the next, and a request that waited for a free
                // CID must not begin before the last command of that CID ended.
                if !r.ping {
                    let len = r.sqe.sgl().length();
                    trace.record(Stage::Submitted, cid, cmdtrace::now_ns(), len);
                }
                unsent.push((cid, r.ping));
            }
            flight.insert(
                cid,
                InFlight {
                    data: r.data,
                    damaged: false,
                    read: ReadData::Empty,
                    ping: r.ping,
                    first_data: false,
                    reply: r.reply,
                },
            );
        }
        // Sent when handed to the socket: on loopback the target may read it before the
        // write returns.
        let sending = if unsent.is_empty() {
            0
        } else {
            cmdtrace::now_ns()
        };
        if let Err(e) = flush(&mut wr, &mut host).await {
            let e = NvmeError::Connection(e.to_string());
            fail_all(&mut flight, &mut waiting, &e);
            return;
        }
        if !unsent.is_empty() {
            let now = sending;
            for (cid, ping) in unsent.drain(..) {
                let stage = if ping { Stage::NopSent } else { Stage::Sent };
                trace.record(stage, cid, now, 0);
            }
        }
        if host.is_over() {
            let e = NvmeError::Connection("the controller ended the connection".into());
            fail_all(&mut flight, &mut waiting, &e);
            if let Some(r) = ready.take() {
                let _ = r.send(Err(e));
            }
            return;
        }
        if !open && flight.is_empty() && waiting.is_empty() {
            return;
        }
        tokio::select! {
            r = rx.recv(), if open => match r {
                Some(r) => {
                    // Everything already asked goes out in the next write, not one write
                    // per command (Linux's host batches the same way with MSG_MORE).
                    waiting.push_back(r);
                    while let Ok(r) = rx.try_recv() {
                        waiting.push_back(r);
                    }
                }
                None => open = false,
            },
            n = {
                // Straight into the deframer's buffer (one copy: the kernel's), reserved
                // for at least the next PDU; a read's data is handed out from it as it is.
                let want = host.needed().max(READ_RESERVE);
                let b = host.receive_buffer();
                spares.make_room(b, want);
                rd.read_buf(b)
            } => {
                if matches!(n, Ok(0) | Err(_)) {
                    let e = NvmeError::Connection("the controller closed the connection".into());
                    fail_all(&mut flight, &mut waiting, &e);
                    if let Some(r) = ready.take() {
                        let _ = r.send(Err(e));
                    }
                    return;
                }
                host.received();
                while let Some(ev) = host.poll_event() {
                    match ev {
                        HostEvent::Initialized(_) => {
                            if let Some(r) = ready.take() {
                                let _ = r.send(Ok(()));
                            }
                        }
                        HostEvent::Response(cqe) => {
                            if let Some(f) = flight.remove(&cqe.cid) {
                                free.push(cqe.cid);
                                f.end_traced(cqe, &trace);
                            }
                        }
                        HostEvent::Data { cid, offset, data, success, data_digest_ok, .. } => {
                            let Some(f) = flight.get_mut(&cid) else { continue };
                            if !f.first_data && trace.is_on() {
                                f.first_data = true;
                                trace.record(Stage::FirstData, cid, cmdtrace::now_ns(), 0);
                            }
                            if !data_digest_ok || offset as usize != f.read.len() {
                                f.damaged = true;
                            } else {
                                f.read.push(data);
                            }
                            if success {
                                let f = flight.remove(&cid).expect("present");
                                free.push(cid);
                                f.end_traced(Cqe::new(cid, Status::SUCCESS), &trace);
                            }
                        }
                        HostEvent::R2T(r2t) => {
                            let Some(f) = flight.get(&r2t.cccid) else { continue };
                            let (at, len) = (r2t.r2to as usize, r2t.r2tl as usize);
                            let piece = f.data.get(at..at + len).map(|_| f.data.slice(at..at + len));
                            match piece {
                                Some(p) => {
                                    let _ = host.send_data(&r2t, p);
                                }
                                None => host.terminate(
                                    nvme::tcp::FatalError::DataOutOfRange,
                                    0,
                                    &[],
                                ),
                            }
                        }
                        HostEvent::Terminated(t) => {
                            let e = NvmeError::Protocol(format!("C2HTermReq: {:?}", t.fes));
                            fail_all(&mut flight, &mut waiting, &e);
                        }
                        HostEvent::Failed { fes, .. } => {
                            let e = NvmeError::Protocol(format!("the controller broke the protocol: {fes:?}"));
                            fail_all(&mut flight, &mut waiting, &e);
                        }
                    }
                }
            }
        }
    }
}

/// What Identify Namespace says of a namespace.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NamespaceInfo {
    /// NSZE: its size in blocks.
    pub blocks: u64,
    /// The block size of its current format.
    pub block_size: u32,
    /// NGUID: the same through every controller (every path) that reaches it.
    pub nguid: [u8; 16],
    /// ANAGRPID: its ANA group (0: the controller reports none).
    pub ana_group: u32,
}

/// ANA state (ANAS) optimized.
pub const ANA_OPTIMIZED: u8 = 0x01;
/// ANA state non-optimized.
pub const ANA_NON_OPTIMIZED: u8 = 0x02;

/// A controller of an NVM subsystem, connected: its admin queue and one I/O queue.
#[derive(Debug)]
pub struct NvmeController {
    admin: QueueHandle,
    io: QueueHandle,
    /// `host:port` of the controller.
    pub portal: String,
    /// The controller's ID.
    pub cntlid: u16,
    /// The namespace of the URL.
    pub nsid: u32,
    /// What it is.
    pub namespace: NamespaceInfo,
    /// The largest transfer of one command, bytes.
    pub max_transfer: u32,
    /// The subsystem's NQN.
    nqn: String,
    keep_alive: tokio::task::JoinHandle<()>,
}

impl Drop for NvmeController {
    fn drop(&mut self) {
        self.keep_alive.abort();
    }
}

/// What Identify Namespace data `ns` says of namespace `nsid`, or why it cannot take I/O.
pub(crate) fn namespace_info(ns: &[u8], nsid: u32) -> Result<NamespaceInfo, NvmeError> {
    if ns.len() < 4096 {
        return Err(NvmeError::Protocol("short Identify Namespace data".into()));
    }
    let blocks = u64::from_le_bytes(ns[0..8].try_into().expect("8 bytes"));
    let format = usize::from(ns[26] & 0x0f);
    let lbads = ns[128 + 4 * format + 2];
    if blocks == 0 || !(9..=16).contains(&lbads) {
        return Err(NvmeError::Protocol(format!(
            "namespace {nsid} is not active (NSZE {blocks}, LBADS {lbads})"
        )));
    }
    Ok(NamespaceInfo {
        blocks,
        block_size: 1 << lbads,
        nguid: ns[104..120].try_into().expect("16 bytes"),
        ana_group: u32::from_le_bytes(ns[92..96].try_into().expect("4 bytes")),
    })
}

/// `sqe` of a Connect to queue `qid` of `url`'s subsystem, and its data.
pub(crate) fn connect_command(
    url: &NvmeUrl,
    o: &NvmeOptions,
    qid: u16,
    cntlid: u16,
    sqsize: u16,
) -> (Sqe, Bytes) {
    let mut sqe = Sqe::new(AdminOpcode::Fabrics.code(), 0);
    sqe.set_fctype(FabricsType::Connect.code());
    Connect {
        recfmt: 0,
        qid,
        sqsize,
        cattr: if o.disable_sqflow && qid != 0 {
            nvme::fabrics::CATTR_SQ_FLOW_CONTROL_DISABLE
        } else {
            0
        },
        kato: if qid == 0 {
            o.kato.as_millis().min(u128::from(u32::MAX)) as u32
        } else {
            0
        },
    }
    .to_sqe(&mut sqe);
    let data = ConnectData {
        hostid: o.hostid,
        cntlid,
        subnqn: url.nqn.clone(),
        hostnqn: o.hostnqn.clone(),
    }
    .to_bytes();
    (sqe, Bytes::copy_from_slice(&data[..]))
}

pub(crate) fn property(offset: u32, value: Option<u32>) -> Sqe {
    property_sized(offset, value, false)
}

fn property_sized(offset: u32, value: Option<u32>, eight_bytes: bool) -> Sqe {
    let fctype = if value.is_some() {
        FabricsType::PropertySet
    } else {
        FabricsType::PropertyGet
    };
    let mut sqe = Sqe::new(AdminOpcode::Fabrics.code(), 0);
    sqe.set_fctype(fctype.code());
    PropertyAccess {
        eight_bytes,
        offset,
        value: u64::from(value.unwrap_or(0)),
    }
    .to_sqe(&mut sqe);
    sqe
}

/// Opens the admin queue of a controller of `url`'s subsystem and enables it (Connect,
/// CC.EN, CSTS.RDY): the queue, the CNTLID and CAP.MQES.
async fn enable_admin_queue(
    url: &NvmeUrl,
    o: &NvmeOptions,
) -> Result<(QueueHandle, u16, u16), NvmeError> {
    let admin = QueueHandle::open(&url.portal, o.digests, 32).await?;
    let (sqe, data) = connect_command(url, o, 0, CNTLID_DYNAMIC, 31);
    let (cqe, _) = admin.command(sqe, data, 0).await?;
    let cntlid = cqe.dw0 as u16;
    let (cap, _) = admin
        .command(property_sized(property::CAP, None, true), Bytes::new(), 0)
        .await?;
    let mqes = (cap.dw0 & 0xffff) as u16;
    admin
        .command(
            property(property::CC, Some(CC_EN | 6 << 16 | 4 << 20)),
            Bytes::new(),
            0,
        )
        .await?;
    for _ in 0..100 {
        let (cqe, _) = admin
            .command(property(property::CSTS, None), Bytes::new(), 0)
            .await?;
        if cqe.dw0 & CSTS_RDY != 0 {
            return Ok((admin, cntlid, mqes));
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    Err(NvmeError::Protocol("CSTS.RDY never set".into()))
}

/// A subsystem a discovery controller names.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Discovered {
    /// SUBTYPE: 2 an NVM subsystem, 3 the discovery subsystem itself, 1 a referral.
    pub subtype: u8,
    /// SUBNQN.
    pub nqn: String,
    /// TRADDR.
    pub address: String,
    /// TRSVCID.
    pub port: String,
    /// PORTID.
    pub port_id: u16,
}

/// Asks the discovery controller at `portal` (`host:port`; 8009 is discovery's port) for
/// the subsystems this host may reach: the discovery log page, read whole.
pub async fn discover(portal: &str, o: &NvmeOptions) -> Result<Vec<Discovered>, NvmeError> {
    let url = NvmeUrl {
        portal: portal.into(),
        nqn: nvme::fabrics::DISCOVERY_NQN.into(),
        nsid: 1,
    };
    let o = NvmeOptions {
        kato: Duration::ZERO,
        ..o.clone()
    };
    let (admin, _, _) = enable_admin_queue(&url, &o).await?;
    let log = |len: usize| {
        let mut sqe = Sqe::new(AdminOpcode::GetLogPage.code(), 0);
        let numd = (len / 4 - 1) as u32;
        sqe.set_cdw(
            10,
            u32::from(nvme::log_page::lid::DISCOVERY) | (numd & 0xffff) << 16,
        );
        sqe.set_cdw(11, numd >> 16);
        sqe
    };
    let (_, head) = admin.command(log(1024), Bytes::new(), 1024).await?;
    let records = u64::from_le_bytes(head[8..16].try_into().expect("8 bytes")).min(1024) as usize;
    let len = 1024 * (records + 1);
    let (_, page) = admin.command(log(len), Bytes::new(), len).await?;
    let text = |b: &[u8]| {
        String::from_utf8_lossy(b)
            .trim_end_matches(['\0', ' '])
            .to_string()
    };
    Ok(page
        .chunks_exact(1024)
        .skip(1)
        .take(records)
        .map(|r| Discovered {
            subtype: r[2],
            port_id: u16::from_le_bytes([r[4], r[5]]),
            port: text(&r[32..64]),
            nqn: text(&r[256..512]),
            address: text(&r[512..768]),
        })
        .collect())
}

impl NvmeController {
    /// Connects to the subsystem and namespace of `url` as a host does before I/O.
    pub async fn connect(url: &NvmeUrl, o: &NvmeOptions) -> Result<NvmeController, NvmeError> {
        let (admin, cntlid, mqes) = enable_admin_queue(url, o).await?;
        let entries = o.queue_entries.min(mqes.saturating_add(1)).max(2);
        let identify = |cns: u8, nsid: u32| {
            let mut sqe = Sqe::new(AdminOpcode::Identify.code(), 0);
            sqe.set_nsid(nsid);
            sqe.set_cdw(10, u32::from(cns));
            sqe
        };
        let (_, id) = admin
            .command(identify(cns::CONTROLLER, 0), Bytes::new(), 4096)
            .await?;
        if id.len() < 4096 {
            return Err(NvmeError::Protocol("short Identify Controller data".into()));
        }
        let mdts = id[77];
        let max_transfer = if mdts == 0 {
            1 << 20
        } else {
            4096u32.saturating_mul(1 << mdts.min(20))
        };
        let ioccsz = u32::from_le_bytes([id[1792], id[1793], id[1794], id[1795]]);
        let mut queues = Sqe::new(AdminOpcode::SetFeatures.code(), 0);
        queues.set_cdw(10, 0x07);
        queues.set_cdw(11, 0);
        admin.command(queues, Bytes::new(), 0).await?;
        let (_, ns) = admin
            .command(identify(cns::NAMESPACE, url.nsid), Bytes::new(), 4096)
            .await?;
        let namespace = namespace_info(&ns, url.nsid)?;
        let mut io = QueueHandle::open(&url.portal, o.digests, entries).await?;
        io.in_capsule = (ioccsz * 16).saturating_sub(64);
        let sqsize = entries - 1;
        let (sqe, data) = connect_command(url, o, 1, cntlid, sqsize);
        let connect = QueueHandle {
            in_capsule: 8192,
            ..io.clone()
        };
        connect.command(sqe, data, 0).await?;
        let ka = admin.clone();
        let period = (o.kato / 2).max(Duration::from_millis(100));
        let keep_alive = tokio::spawn(async move {
            loop {
                tokio::time::sleep(period).await;
                let sqe = Sqe::new(AdminOpcode::KeepAlive.code(), 0);
                if ka.command(sqe, Bytes::new(), 0).await.is_err() {
                    return;
                }
            }
        });
        Ok(NvmeController {
            admin,
            io,
            portal: url.portal.clone(),
            cntlid,
            nsid: url.nsid,
            namespace,
            max_transfer,
            nqn: url.nqn.clone(),
            keep_alive,
        })
    }

    fn io_command(&self, opcode: NvmOpcode, lba: u64, blocks: u32) -> Sqe {
        let mut sqe = Sqe::new(opcode.code(), 0);
        sqe.set_nsid(self.nsid);
        sqe.set_qword(10, lba);
        sqe.set_cdw(12, blocks.saturating_sub(1) & 0xffff);
        sqe
    }

    /// Starts recording each command's stages on both queues (`run --trace`): submitted,
    /// sent, first data, completion, handed back; Keep Alives sent with [`Self::ping`] date
    /// the clocks, as NOPs do for iSCSI.
    pub fn start_trace(&self) {
        let session = |qid| cmdtrace::Record::session_of_queue(&self.nqn, self.cntlid, qid);
        self.admin.trace.start(session(0));
        self.io.trace.start(session(1));
    }

    /// Stops tracing and hands over both queues' records, and how many found the trace full.
    pub fn take_trace(&self) -> (Vec<cmdtrace::Record>, u64) {
        let (mut records, mut dropped) = self.admin.trace.take();
        let (io, io_dropped) = self.io.trace.take();
        records.extend(io);
        dropped += io_dropped;
        (records, dropped)
    }

    /// A Keep Alive on the admin queue, answered: a round trip (traced as a clock-dating
    /// ping while tracing).
    pub async fn ping(&self) -> Result<(), NvmeError> {
        let sqe = Sqe::new(AdminOpcode::KeepAlive.code(), 0);
        self.admin.command(sqe, Bytes::new(), 0).await.map(|_| ())
    }

    /// Reads `blocks` blocks at `lba`.
    pub async fn read(&self, lba: u64, blocks: u32) -> Result<Bytes, NvmeError> {
        let len = blocks as usize * self.namespace.block_size as usize;
        let sqe = self.io_command(NvmOpcode::Read, lba, blocks);
        let (_, data) = self.io.command(sqe, Bytes::new(), len).await?;
        if data.len() != len {
            return Err(NvmeError::Protocol(format!(
                "a read of {len} bytes brought {}",
                data.len()
            )));
        }
        Ok(data)
    }

    /// Read of `blocks` blocks at `lba`, in commands of at most `max_blocks`.
    pub async fn read_split(
        &self,
        lba: u64,
        blocks: u32,
        max_blocks: u32,
    ) -> Result<Bytes, NvmeError> {
        if blocks <= max_blocks {
            return self.read(lba, blocks).await;
        }
        let bs = self.namespace.block_size as usize;
        let mut out = bytes::BytesMut::with_capacity(blocks as usize * bs);
        let mut at = 0;
        while at < blocks {
            let n = max_blocks.max(1).min(blocks - at);
            out.extend_from_slice(&self.read(lba + u64::from(at), n).await?);
            at += n;
        }
        Ok(out.freeze())
    }

    /// Write of `data` at `lba`, in commands of at most `max_blocks`.
    pub async fn write_split(
        &self,
        lba: u64,
        data: Bytes,
        max_blocks: u32,
    ) -> Result<(), NvmeError> {
        let bs = self.namespace.block_size as usize;
        let chunk = max_blocks.max(1) as usize * bs;
        let mut at = 0;
        while at < data.len() {
            let end = (at + chunk).min(data.len());
            self.write(lba + (at / bs) as u64, data.slice(at..end))
                .await?;
            at = end;
        }
        Ok(())
    }

    /// The ANA state (ANAS) of the namespace's group as this controller reports it, from the
    /// ANA log page; `None` when the page does not list the namespace.
    pub async fn ana_state(&self) -> Result<Option<u8>, NvmeError> {
        let mut log = Sqe::new(AdminOpcode::GetLogPage.code(), 0);
        log.set_cdw(10, 0x0c | (4096 / 4 - 1) << 16);
        let (_, page) = self.admin(log, Bytes::new(), 4096).await?;
        Ok(ana_state_in(&page, self.nsid))
    }

    /// Writes `data` (whole blocks) at `lba`.
    pub async fn write(&self, lba: u64, data: Bytes) -> Result<(), NvmeError> {
        let blocks = (data.len() / self.namespace.block_size as usize) as u32;
        let sqe = self.io_command(NvmOpcode::Write, lba, blocks);
        self.io.command(sqe, data, 0).await.map(|_| ())
    }

    /// Flush.
    pub async fn flush(&self) -> Result<(), NvmeError> {
        let mut sqe = Sqe::new(NvmOpcode::Flush.code(), 0);
        sqe.set_nsid(self.nsid);
        self.io.command(sqe, Bytes::new(), 0).await.map(|_| ())
    }

    /// Write Zeroes over `blocks` blocks at `lba` (`deallocate`: DEAC, they may be
    /// deallocated).
    pub async fn write_zeroes(
        &self,
        lba: u64,
        blocks: u32,
        deallocate: bool,
    ) -> Result<(), NvmeError> {
        let mut sqe = self.io_command(NvmOpcode::WriteZeroes, lba, blocks);
        if deallocate {
            sqe.set_cdw(12, sqe.cdw(12) | 1 << 25);
        }
        self.io.command(sqe, Bytes::new(), 0).await.map(|_| ())
    }

    /// Dataset Management deallocating each (first block, blocks) of `ranges` (at most 256),
    /// with room for 256 ranges in the data, as Linux's host sends it.
    pub async fn deallocate(&self, ranges: &[(u64, u32)]) -> Result<(), NvmeError> {
        let ranges = &ranges[..ranges.len().min(256)];
        let mut data = BytesMut::zeroed(4096);
        for (r, (lba, blocks)) in data.chunks_exact_mut(16).zip(ranges) {
            r[4..8].copy_from_slice(&blocks.to_le_bytes());
            r[8..16].copy_from_slice(&lba.to_le_bytes());
        }
        let mut sqe = Sqe::new(NvmOpcode::DatasetManagement.code(), 0);
        sqe.set_nsid(self.nsid);
        sqe.set_cdw(10, (ranges.len() as u32).saturating_sub(1));
        sqe.set_cdw(11, 1 << 2);
        self.io.command(sqe, data.freeze(), 0).await.map(|_| ())
    }

    /// An admin command as given (its CID is the queue's), with `data` to send or
    /// `read_len` bytes to read: the completion and the data.
    pub async fn admin(
        &self,
        sqe: Sqe,
        data: Bytes,
        read_len: usize,
    ) -> Result<(Cqe, Bytes), NvmeError> {
        self.admin.command(sqe, data, read_len).await
    }

    /// An I/O command as given, as [`NvmeController::admin`].
    pub async fn io(
        &self,
        sqe: Sqe,
        data: Bytes,
        read_len: usize,
    ) -> Result<(Cqe, Bytes), NvmeError> {
        self.io.command(sqe, data, read_len).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_nvme_url_names_its_portal_and_its_port_is_checked() {
        let u = NvmeUrl::parse("nvme://[::1]/nqn.2026-11.io.example:x/1").unwrap();
        assert_eq!(u.portal, format!("[::1]:{DEFAULT_PORT}"));
        let e = NvmeUrl::parse("nvme://host:99999/nqn.2026-11.io.example:x/1");
        assert!(e.is_err(), "{e:?}");
    }

    #[test]
    fn read_data_keeps_one_piece_and_joins_several_in_order() {
        let mut one = ReadData::Empty;
        assert_eq!(one.len(), 0);
        let piece = Bytes::from_static(b"abcd");
        one.push(piece.clone());
        let kept = one.into_bytes();
        assert_eq!(
            kept.as_ptr(),
            piece.as_ptr(),
            "one C2HData's bytes are not copied"
        );
        let mut several = ReadData::Empty;
        for p in [&b"ab"[..], b"cd", b"ef"] {
            several.push(Bytes::copy_from_slice(p));
        }
        assert_eq!(several.len(), 6);
        assert_eq!(&several.into_bytes()[..], b"abcdef");
    }

    #[test]
    fn receive_buffers_are_reused_once_their_slices_are_dropped() {
        let mut spares = SpareBuffers::default();
        let mut buf = BytesMut::new();
        spares.make_room(&mut buf, 1000);
        let first = buf.as_ptr();
        // Filled up, all of it handed out but 3 bytes (part of the next PDU).
        buf.resize(buf.capacity(), 7);
        let held = buf.split_to(buf.len() - 3).freeze();
        buf.copy_from_slice(&[1, 2, 3]);
        // No room, and the slice still shares the buffer: another one, the part of a PDU
        // already in moving with it.
        spares.make_room(&mut buf, 1000);
        assert_ne!(buf.as_ptr(), first);
        assert_eq!(&buf[..], &[1, 2, 3]);
        assert!(buf.capacity() >= 1003);
        drop(held);
        buf.resize(buf.capacity(), 7);
        let _held = buf.split().freeze();
        // The first one, its slices gone, is taken again.
        spares.make_room(&mut buf, 1000);
        assert_eq!(buf.as_ptr(), first, "the first buffer is reused");
        assert!(buf.is_empty() && buf.capacity() >= 1000);
    }
}
