//! iSER portals (RFC 7145): iSCSI over an RDMA reliable connection, the I/O shell around
//! iscsi-pdu's sans-IO login and [`IserConnection`] machines on one reactor.
//!
//! A portal takes connect requests on its fabric (rdma_cm's, or the software fabric's),
//! accepts each with the iSER CM reply and the receives its command window needs, then runs
//! the login (its PDUs in Sends, negotiated with `RDMAExtensions=Yes`) through the same
//! [`Admission`](crate::registry::Admission) as a TCP connection, and full feature phase
//! through the same session, SCSI core and routing (`iscsi::connection::SessionStep`). What the machine asks is
//! posted on the queue pair in order: Sends of control PDUs (encoded into IU buffers), RDMA
//! WRITE of a read's data from the arena slots the backend filled, RDMA READ of a write's
//! solicited data into the slots the backend then writes from. Nothing is registered per I/O.
//!
//! All connections of a portal run in one task on one reactor, as an SRP port's channels do:
//! the verbs belong to it. The portal wakes on the fabric, backend completions, routed core
//! events, its control, an arena grant, and a coarse tick while connections live (their
//! timers, and the per-connection closes asked through the session registry).

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::rc::Rc;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use backend::Buffer;
use bytes::BytesMut;
use iscsi_pdu::iser::{
    self, CmReply, DataOutRead, IserConnection, IserHeader, IserPlan, RemoteBuffer, Work,
    ISER_HEADERS_LEN,
};
use iscsi_pdu::negotiation::{DigestAlgorithm, NegotiationError, Settings};
use iscsi_pdu::pdu::LoginStatus;
use iscsi_pdu::target_node::{
    Close, Completed, Core, Event, Login, LoginPolicy, NoBuffer, Payload, Step as LoginStep,
};
use iscsi_pdu::{Pdu, SerialNumber};
use rdma::verbs::{MessageBuffers, PortBuffer, RemoteRegion, Verbs, WorkOp};
use scsi_core::{BackendError, TaskId};
use tokio::sync::mpsc;

use crate::carrier::{Carried, Carrier, Want};
use crate::control::{Control, Request};
use crate::fabric::{Fabric, FabricBuffer, Qp, MESSAGE_LEN, NO_ADDRESS};
use crate::iscsi::connection::{Link, Scope, SessionStep};
use crate::iscsi::login::Outcome;
use crate::port::{Post, SendQueue};
use crate::reactor::Io;
use crate::registry::{AdmissionState, ConnectionSlot, Peer, Registry};
use crate::target::Routed;
use crate::unit::{next_id, CachedUnit};

/// The most data a Send to the target may carry (TargetRecvDataSegmentLength): what an IU
/// buffer holds behind the iSER header, the BHS and the most AHS a PDU may have, rounded
/// down to 512 (8192; Linux's initiator asks for 8192). So no message within the limit,
/// whatever its CDB's length, is longer than the receive it lands in.
pub const RECV_DATA_SEGMENT_LENGTH: u32 =
    ((MESSAGE_LEN - ISER_HEADERS_LEN - iscsi_pdu::iser::MAX_AHS_LEN) as u32) & !511;
const _: () = assert!(iscsi_pdu::iser::receive_len(RECV_DATA_SEGMENT_LENGTH) <= MESSAGE_LEN);
const _: () = assert!(RECV_DATA_SEGMENT_LENGTH == 8192);

/// Receives posted beyond the command window: NOP-Outs, task management and a logout may come
/// as immediate PDUs outside it.
const SPARE_RECEIVES: u32 = 8;

/// The largest command window (MaxCmdSN - ExpCmdSN + 1) a session over iSER gets
/// (`iscsi.cmdsn_window` when that is smaller). Each command's response is a Send that needs a
/// receive the initiator posted, and initiators post a fixed number: Linux's ib_iser and
/// libiscsi 512, libiscsi reposting them in batches of 128 (so 384 may be all that is
/// posted); a Send that finds none fails the connection (receiver not ready). Linux's iSER
/// sessions queue 128 commands by default (`node.session.cmds_max`), LIO grants 64.
pub const ISER_CMDSN_WINDOW: u32 = 128;

/// The command window of an iSER session: `iscsi.cmdsn_window`, at most
/// [`ISER_CMDSN_WINDOW`].
pub fn window(registry: &Registry) -> u32 {
    registry.window().min(ISER_CMDSN_WINDOW)
}

/// Work requests one connection has on its send queue at most (Sends, RDMA WRITEs and READs,
/// one work request each); more wait in its queue.
const SEND_DEPTH: usize = 512;

/// Connections one RDMA portal serves at once: its IU buffers are sized for them.
pub const CONNECTIONS: u32 = 16;

/// IU buffers (for all connections) and each queue pair's depths of an RDMA portal whose
/// sessions have a command window of `window`: a receive per command and spare, and sends
/// in flight.
#[cfg(feature = "rdma")]
pub fn rdma_sizes(window: u32) -> (u32, rdma::ibverbs::QueueDepth) {
    let recv = window + SPARE_RECEIVES;
    let depth = rdma::ibverbs::QueueDepth {
        send: SEND_DEPTH as u32,
        recv,
    };
    (CONNECTIONS * (recv + 64), depth)
}

/// How often the portal looks at its connections' timers and controls when nothing else
/// wakes it.
const TICK: Duration = Duration::from_millis(100);

/// How long a connection whose logout (or refused login) has been answered waits for the
/// initiator to disconnect before the target does. The initiator closes first, as over TCP;
/// a target that disconnects at once races an initiator that is already letting the
/// connection go (libiscsi 1.19 then takes the disconnection for its next connection's).
const LINGER: Duration = Duration::from_secs(2);

/// How long a connection's login may take ([`Request::Close`] otherwise), as
/// `server.login_timeout` bounds a TCP login.
fn login_timeout(registry: &Registry) -> Duration {
    Duration::from_secs(registry.config().server.login_timeout)
}

/// The login's questions answered by the daemon's [`Admission`](crate::registry::Admission),
/// with what iSER changes in the settings offered: RDMAExtensions, no digests (the RDMA
/// transport checks every byte), segments that fit the receive buffers, and InitialR2T=Yes
/// (unsolicited data only as immediate data: the rest is read by RDMA READ, which costs the
/// initiator nothing, rather than sent in Data-Out Sends).
struct Admit<'a>(crate::registry::Admission<'a>);

fn for_iser(mut s: Settings) -> Settings {
    s.header_digest = vec![DigestAlgorithm::None];
    s.data_digest = vec![DigestAlgorithm::None];
    s.max_recv_data_segment_length = s.max_recv_data_segment_length.min(RECV_DATA_SEGMENT_LENGTH);
    s.operational.rdma_extensions = true;
    s.operational.initial_r2t = true;
    s
}

impl LoginPolicy for Admit<'_> {
    fn normal(
        &mut self,
        initiator: &str,
        target: &str,
        tsih: u16,
    ) -> Result<Settings, LoginStatus> {
        self.0.normal(initiator, target, tsih).map(for_iser)
    }

    fn discovery(&mut self, initiator: &str) -> Result<Settings, LoginStatus> {
        self.0.discovery(initiator).map(for_iser)
    }

    fn refused(&mut self, initiator: &str, target: Option<&str>, error: &NegotiationError) {
        self.0.refused(initiator, target, error)
    }

    fn window(&self, tsih: u16, cmd_sn: SerialNumber) -> (SerialNumber, SerialNumber) {
        self.0.window(tsih, cmd_sn)
    }

    fn complete(
        &mut self,
        login: &Completed,
    ) -> Result<(u16, SerialNumber, SerialNumber), LoginStatus> {
        self.0.complete(login)
    }

    fn entropy(&mut self) -> Result<[u8; iscsi_pdu::chap::ENTROPY_LEN], LoginStatus> {
        self.0.entropy()
    }
}

/// A connection in its login phase.
struct LoginPhase {
    login: Login,
    state: AdmissionState,
    deadline: Instant,
}

/// A connection in full feature phase.
struct Full {
    machine: IserConnection<Buffer>,
    link: Link,
    scope: Scope,
    rx: mpsc::UnboundedReceiver<Routed>,
}

enum Phase {
    Login(Box<LoginPhase>),
    Full(Box<Full>),
}

/// What the carrier hands a connection: only one in full feature phase has tasks.
impl<Q, I> Carried for Conn<Q, I> {
    fn account(&mut self, done: &scsi_core::transport::Accounting) {
        if let Phase::Full(f) = &mut self.phase {
            if let Some(target) = f.scope.target() {
                target.account(&mut f.link.units, done);
            }
        }
    }

    fn unit(&mut self, lun: u16) -> Option<CachedUnit<'_>> {
        let Phase::Full(f) = &mut self.phase else {
            return None;
        };
        f.scope.target()?.cached_lun(&mut f.link.units, lun)
    }

    fn backend_done(
        &mut self,
        now: Instant,
        task: TaskId,
        buffer: Buffer,
        result: Result<scsi_core::Output, BackendError>,
    ) {
        if let Phase::Full(f) = &mut self.phase {
            let mut nexus = SessionStep::new(&mut f.link, &f.scope);
            f.machine
                .connection_mut()
                .handle_backend_done(now, task, buffer, result, &mut nexus);
        }
    }

    fn buffer(&mut self, now: Instant, tag: u64, buffer: Option<Buffer>) {
        if let Phase::Full(f) = &mut self.phase {
            let mut nexus = SessionStep::new(&mut f.link, &f.scope);
            f.machine
                .connection_mut()
                .handle_buffer(now, tag, buffer, &mut nexus);
        }
    }
}

/// One connection of a portal.
struct Conn<Q, I> {
    qp: Q,
    peer: Peer,
    phase: Phase,
    /// The work the machine asked for, posted or waiting for an IU buffer or room on the
    /// send queue.
    sends: SendQueue<Work<Buffer>>,
    /// A received message whose write waits for its data buffer.
    held: Option<I>,
    /// Messages received behind the held one, in order (each with its length): handled once
    /// it has its buffer. The queue pair's other completions go on meanwhile: an RDMA READ
    /// that ends is what lets an earlier write finish and give its buffer back.
    deferred: VecDeque<(I, usize)>,
    /// RDMA READs in flight, by work request id.
    reads: HashMap<u64, DataOutRead>,
    /// Everything queued is to be sent, then the connection closes (a logout, a refused
    /// login).
    flush_then_close: bool,
    /// Flushed: the initiator closes the connection now, or the target does at this time.
    linger_until: Option<Instant>,
    /// The queue pair is gone (or is being taken down): the connection's tasks end, then it
    /// goes.
    lost: bool,
    /// Disconnected, and its session told.
    torn_down: bool,
    _slot: ConnectionSlot,
}

/// A portal: its fabric and its connections.
struct Portal<F: Fabric> {
    fabric: F,
    registry: Arc<Registry>,
    portal: String,
    conns: BTreeMap<u64, Conn<Qp<F>, F::Message>>,
    /// Carries out its connections' events on the reactor; the buffers they wait for (a
    /// write's data buffer for its held message, or a backend operation's) come from the
    /// portal's share of the reactor's arena.
    carrier: Carrier,
    logging_out: bool,
    /// Reused for encoding Sends.
    scratch: BytesMut,
    /// Reused for a connection's events of one turn, so a turn allocates nothing once warm.
    events: Vec<Event<Buffer>>,
    next_wr: u64,
}

/// Serves iSER on `fabric` until the daemon stops: the task a reactor runs for an iSER portal.
pub async fn serve<F: Fabric>(fabric: F, io: Rc<Io>, registry: Arc<Registry>) {
    let portal = fabric.portal_of("iser");
    let mut p = Portal {
        portal: portal.clone(),
        fabric,
        carrier: crate::port::shared_carrier(io),
        registry: registry.clone(),
        conns: BTreeMap::new(),
        logging_out: false,
        scratch: BytesMut::with_capacity(MESSAGE_LEN),
        events: Vec::with_capacity(256),
        next_wr: 1,
    };
    crate::port::run(&mut p, &registry, "iSER portal", &portal).await;
}

impl<F: Fabric> crate::port::Port for Portal<F> {
    fn accept(&mut self) -> bool {
        self.accept_all()
    }

    fn backend_completions(&mut self) -> bool {
        Portal::backend_completions(self)
    }

    fn ids(&self, ids: &mut Vec<u64>) {
        ids.extend(self.conns.keys().copied());
    }

    fn step(&mut self, id: u64) -> bool {
        Portal::step(self, id)
    }

    /// Ready when the fabric has news or another connection routed events to one of these.
    fn poll_wake(&mut self, cx: &mut Context<'_>) -> Poll<()> {
        let mut any = self.fabric.poll_ready(cx).is_ready();
        for c in self.conns.values_mut() {
            if let Phase::Full(f) = &mut c.phase {
                any |= crate::port::take_routed(&mut f.rx, &mut f.link.out, cx);
            }
        }
        if any {
            Poll::Ready(())
        } else {
            Poll::Pending
        }
    }

    fn carrier(&mut self) -> &mut Carrier {
        &mut self.carrier
    }

    fn granted(&mut self, w: Want, buffer: Option<Buffer>) {
        Portal::granted(self, w, buffer)
    }

    fn log_out_all(&mut self) {
        self.logging_out = true;
        Portal::log_out_all(self)
    }

    fn is_empty(&self) -> bool {
        self.conns.is_empty()
    }

    fn close_all(&mut self) {
        Portal::close_all(self)
    }

    /// Connections keep timers (NOP-In pings, the data-out and login timeouts) and may be
    /// asked to close through the session registry.
    fn tick(&self) -> Option<Duration> {
        Some(TICK)
    }
}

impl<F: Fabric> Portal<F> {
    /// Accepts the connect requests that have come: each gets its receives and the iSER CM
    /// reply; the login decides the rest.
    fn accept_all(&mut self) -> bool {
        let mut any = false;
        while let Some(request) = self.fabric.next_request() {
            any = true;
            if self.logging_out || self.registry.stopping() {
                self.fabric.reject(request, &[]);
                continue;
            }
            let (addr, local) = self
                .fabric
                .addresses(&request)
                .unwrap_or((NO_ADDRESS, NO_ADDRESS));
            let Some(slot) = self.registry.open_connection() else {
                tracing::info!(portal = %self.portal, "iSER connection refused: server.max_connections connections are open");
                self.fabric.reject(request, &[]);
                continue;
            };
            let count = window(&self.registry) + SPARE_RECEIVES;
            let receives: Option<Vec<_>> = (0..count)
                .map(|_| {
                    self.fabric
                        .verbs()
                        .message_buffer()
                        .map(PortBuffer::Message)
                })
                .collect();
            let Some(receives) = receives else {
                tracing::warn!(portal = %self.portal, "iSER connection refused: no IU buffers left for its receives");
                self.fabric.reject(request, &[]);
                continue;
            };
            let qp = match self
                .fabric
                .accept(request, receives, &CmReply::default().encode())
            {
                Ok(qp) => qp,
                Err(e) => {
                    tracing::warn!(portal = %self.portal, "iSER accept: {e}");
                    continue;
                }
            };
            let id = next_id();
            let control = Arc::new(Control::default());
            self.registry.register(id, control.clone());
            let peer = Peer {
                id,
                addr,
                local,
                reactor: self.carrier.io().index,
                control,
                iser: true,
                max_window: ISER_CMDSN_WINDOW,
            };
            tracing::debug!(portal = %self.portal, id, "iSER connection accepted");
            self.registry
                .counters
                .iser_connections
                .fetch_add(1, Ordering::Relaxed);
            self.conns.insert(
                id,
                Conn {
                    qp,
                    peer,
                    phase: Phase::Login(Box::new(LoginPhase {
                        login: Login::new(),
                        state: AdmissionState::default(),
                        deadline: Instant::now() + login_timeout(&self.registry),
                    })),
                    sends: SendQueue::new(SEND_DEPTH),
                    held: None,
                    deferred: VecDeque::new(),
                    reads: HashMap::new(),
                    flush_then_close: false,
                    linger_until: None,
                    lost: false,
                    torn_down: false,
                    _slot: slot,
                },
            );
        }
        any
    }

    /// Hands finished backend operations to their connections.
    fn backend_completions(&mut self) -> bool {
        self.carrier.deliver_all(&mut self.conns)
    }

    /// One connection's completions, core events, timers, requests and work; its end once it
    /// is over.
    fn step(&mut self, id: u64) -> bool {
        let now = Instant::now();
        let mut progress = self.completions(id, now);
        progress |= self.machine_step(id, now);
        progress |= self.post_work(id);
        progress | self.end_if_over(id)
    }

    /// Takes the queue pair's completions: received messages into the login or the machine
    /// (in order: behind a write that waits for its data buffer, they wait too), finished
    /// sends and writes let go, finished reads handed back.
    fn completions(&mut self, id: u64, now: Instant) -> bool {
        let mut progress = false;
        loop {
            let qp = match self.conns.get(&id) {
                Some(c) => c.qp,
                None => return progress,
            };
            let Some(wc) = self.fabric.verbs().poll(qp) else {
                return progress;
            };
            progress = true;
            let failed = wc.result.is_err();
            let c = self.conns.get_mut(&id).expect("present");
            if wc.op != WorkOp::Recv {
                c.sends.completed();
            }
            if failed && !c.lost {
                tracing::debug!(portal = %self.portal, id, op = ?wc.op, "iSER work request failed: {:?}", wc.result);
                c.lost = true;
            }
            let lost = c.lost;
            let waiting = c.held.is_some() || !c.deferred.is_empty();
            match (wc.op, wc.buffer) {
                (WorkOp::Recv, PortBuffer::Message(b)) if !lost && waiting => {
                    let c = self.conns.get_mut(&id).expect("present");
                    c.deferred.push_back((b, wc.len));
                }
                (WorkOp::Recv, PortBuffer::Message(b)) if !lost => self.message(id, b, wc.len, now),
                (WorkOp::RdmaRead, buffer) => {
                    // Handed back also when it failed: the task gets its buffer again and ends.
                    let c = self.conns.get_mut(&id).expect("present");
                    let read = c.reads.remove(&wc.wr_id);
                    if let (Some(read), PortBuffer::Data(b), Phase::Full(f)) =
                        (read, buffer, &mut c.phase)
                    {
                        let mut nexus = SessionStep::new(&mut f.link, &f.scope);
                        f.machine
                            .handle_rdma_read(now, read, b, !failed, &mut nexus);
                    }
                }
                (_, PortBuffer::Message(b)) => self.fabric.verbs().recycle_message(b),
                (_, PortBuffer::Data(_)) => {}
            }
        }
    }

    /// A received message of `len` bytes in `b`.
    fn message(&mut self, id: u64, b: F::Message, len: usize, now: Instant) {
        let len = len.min(b.len());
        tracing::trace!(
            portal = %self.portal,
            id,
            len,
            head = ?&b[..len.min(iscsi_pdu::iser::ISER_HEADERS_LEN)],
            "iSER message received"
        );
        let login = matches!(self.conns.get(&id).map(|c| &c.phase), Some(Phase::Login(_)));
        if login {
            self.login_message(id, &b[..len], now);
            self.repost(id, b);
            return;
        }
        let Some(c) = self.conns.get_mut(&id) else {
            return;
        };
        let Phase::Full(f) = &mut c.phase else {
            return;
        };
        let mut nexus = SessionStep::new(&mut f.link, &f.scope);
        let plan = f.machine.handle_message(now, &b[..len], &mut nexus);
        drop(nexus);
        match plan {
            Ok(plan) => self.follow(id, b, plan, now),
            Err(e) => {
                tracing::info!(portal = %self.portal, id, "iSER connection dropped: {e}");
                c.lost = true;
                self.fabric.verbs().recycle_message(b);
            }
        }
    }

    /// Carries out a message's plan: its receive buffer is posted again once its data is
    /// copied, or held while its write waits for a buffer.
    fn follow(&mut self, id: u64, b: F::Message, mut plan: IserPlan<Buffer>, now: Instant) {
        loop {
            let Some(c) = self.conns.get_mut(&id) else {
                return;
            };
            let Phase::Full(f) = &mut c.phase else {
                return;
            };
            match plan {
                IserPlan::Next => break,
                IserPlan::Copy {
                    mut buffer,
                    at,
                    from,
                    len,
                } => {
                    buffer[at..at + len].copy_from_slice(&b[from..from + len]);
                    let mut nexus = SessionStep::new(&mut f.link, &f.scope);
                    f.machine.handle_payload(now, buffer, &mut nexus);
                    break;
                }
                IserPlan::Allocate(len) => {
                    let got = match self.carrier.waits.share().try_alloc(len as usize) {
                        Ok(Some(buffer)) => Ok(buffer),
                        Err(_) => Err(NoBuffer::TooLarge),
                        Ok(None) if f.machine.connection().may_wait_for_buffer() => {
                            c.held = Some(b);
                            let w = Want {
                                conn: id,
                                tag: 0,
                                len: len as usize,
                                data_out: true,
                            };
                            // It waits behind any earlier wait (a buffer it got now could
                            // not be, or `Waits::want` would have had it).
                            if let Some(b) = self.carrier.waits.want(w) {
                                self.granted(w, b);
                            }
                            return;
                        }
                        Ok(None) => {
                            self.registry
                                .counters
                                .task_set_full
                                .fetch_add(1, Ordering::Relaxed);
                            Err(NoBuffer::Busy)
                        }
                    };
                    let mut nexus = SessionStep::new(&mut f.link, &f.scope);
                    plan = f.machine.handle_allocated(now, got, &mut nexus);
                }
            }
        }
        self.repost(id, b);
    }

    fn repost(&mut self, id: u64, b: F::Message) {
        let Some(c) = self.conns.get(&id) else {
            self.fabric.verbs().recycle_message(b);
            return;
        };
        let qp = c.qp;
        self.fabric.verbs().post_recv(qp, 0, PortBuffer::Message(b));
    }

    /// A Login Request: the login machine answers; on success full feature phase starts.
    fn login_message(&mut self, id: u64, msg: &[u8], now: Instant) {
        let registry = self.registry.clone();
        let Some(c) = self.conns.get_mut(&id) else {
            return;
        };
        let Phase::Login(lp) = &mut c.phase else {
            return;
        };
        let req = match iser::decode(msg, iscsi_pdu::LOGIN_MAX_RECV_DATA_SEGMENT_LENGTH) {
            Ok(iser::Message::Control(_, iser::Received::Pdu(Pdu::LoginRequest(r)))) => r,
            other => {
                tracing::debug!(portal = %self.portal, id, "not a login request during login: {other:?}");
                c.lost = true;
                return;
            }
        };
        let state = std::mem::take(&mut lp.state);
        let mut policy = Admit(registry.admission_from(&c.peer, state));
        let step = lp.login.handle_request(&req, &mut policy);
        let (response, done) = match step {
            LoginStep::Continue(r) => (r, None),
            LoginStep::Done(r, done) => {
                registry.count_login(true, r.status);
                (r, Some(done))
            }
            LoginStep::Refused(r) => {
                registry.login_refused(&c.peer, &lp.login, &req, r.status);
                c.flush_then_close = true;
                (r, None)
            }
        };
        let session = done.as_ref().and_then(|_| policy.0.take_session());
        lp.state = policy.0.into_state();
        c.sends.push(Work::Send(Pdu::LoginResponse(response)));
        if let Some(done) = done {
            self.full_feature(id, *done, session, now);
        }
    }

    /// The login has ended: the connection's iSER machine starts on its session, as a TCP
    /// connection's does.
    fn full_feature(
        &mut self,
        id: u64,
        done: Completed,
        session: Option<Arc<crate::iscsi::session::Session>>,
        now: Instant,
    ) {
        let c = self.conns.get_mut(&id).expect("present");
        let outcome = Outcome::of(done, session);
        let e = crate::iscsi::connection::enter(outcome, &self.registry, &c.peer, now);
        tracing::info!(portal = %self.portal, id, discovery = e.scope.session().is_none(), "iSER connection in full feature phase");
        c.phase = Phase::Full(Box::new(Full {
            // RDMA READs at once per connection: what a queue pair answers by default.
            machine: IserConnection::new(e.machine, 16),
            link: e.link,
            scope: e.scope,
            rx: e.rx,
        }));
    }

    /// Core events, timers and the machine's requests of one connection.
    fn machine_step(&mut self, id: u64, now: Instant) -> bool {
        let Some(c) = self.conns.get_mut(&id) else {
            return false;
        };
        let mut progress = false;
        match &mut c.phase {
            Phase::Login(lp) => {
                if now >= lp.deadline && !c.lost {
                    tracing::info!(portal = %self.portal, id, "iSER login not finished in server.login_timeout");
                    c.lost = true;
                    progress = true;
                }
                if c.peer.control.get() >= Request::Close {
                    c.lost = true;
                }
                return progress;
            }
            Phase::Full(f) => {
                let mut nexus = SessionStep::new(&mut f.link, &f.scope);
                let m = f.machine.connection_mut();
                if !c.lost && m.poll_timeout().is_some_and(|t| t <= now) {
                    m.handle_timeout(now, &mut nexus);
                    progress = true;
                }
                match c.peer.control.get() {
                    _ if c.lost => {}
                    Request::Logout if nexus.scope.session().is_some() => m.ask_logout(&mut nexus),
                    Request::Logout | Request::Close => c.lost = true,
                    Request::Run => {}
                }
                let mut events = std::mem::take(&mut self.events);
                while let Some(ev) = m.poll_event(now, &mut nexus) {
                    events.push(ev);
                }
                match m.closing() {
                    Some(Close::AfterFlush) => c.flush_then_close = true,
                    Some(Close::NoPingAnswer | Close::DataOutTimeout) => c.lost = true,
                    None => {}
                }
                drop(nexus);
                for ev in events.drain(..) {
                    progress = true;
                    self.event(now, id, ev);
                }
                self.events = events;
            }
        }
        progress
    }

    /// Carries out what a connection's machine asked.
    fn event(&mut self, now: Instant, id: u64, e: Event<Buffer>) {
        if let Some(c) = self.conns.get_mut(&id) {
            self.carrier.carry(now, id, c, e);
        }
    }

    /// Handles the messages that came behind a held one, in order, until one is held again.
    fn resume(&mut self, id: u64, now: Instant) {
        loop {
            let Some(c) = self.conns.get_mut(&id) else {
                return;
            };
            if c.held.is_some() || c.lost {
                return;
            }
            let Some((b, len)) = c.deferred.pop_front() else {
                return;
            };
            self.message(id, b, len, now);
        }
    }

    /// Gives a connection the buffer it waited for (`None`: none can ever be had).
    fn granted(&mut self, w: Want, buffer: Option<Buffer>) {
        let now = Instant::now();
        let Some(c) = self.conns.get_mut(&w.conn) else {
            return;
        };
        let Phase::Full(f) = &mut c.phase else {
            return;
        };
        if w.data_out {
            let Some(b) = c.held.take() else { return };
            let got = buffer.ok_or(NoBuffer::TooLarge);
            let mut nexus = SessionStep::new(&mut f.link, &f.scope);
            let plan = f.machine.handle_allocated(now, got, &mut nexus);
            drop(nexus);
            self.follow(w.conn, b, plan, now);
            self.resume(w.conn, now);
            return;
        }
        c.buffer(now, w.tag, buffer);
    }

    /// Posts what a connection's machine asked, in order, as far as IU buffers and the send
    /// queue allow.
    fn post_work(&mut self, id: u64) -> bool {
        let Some(c) = self.conns.get_mut(&id) else {
            return false;
        };
        if let Phase::Full(f) = &mut c.phase {
            let mut nexus = SessionStep::new(&mut f.link, &f.scope);
            while let Some(w) = f.machine.poll_work(&mut nexus) {
                c.sends.push(w);
            }
        }
        let (qp, verbs, share) = (c.qp, self.fabric.verbs(), self.carrier.waits.share());
        let (reads, scratch, counters) = (&mut c.reads, &mut self.scratch, &self.registry.counters);
        let portal = &self.portal;
        c.sends.post(c.lost, &mut self.next_wr, |w, wr| {
            match w {
                Work::Send(pdu) => {
                    scratch.clear();
                    iser::encode(&pdu, &IserHeader::default(), scratch);
                    let Some(mut b) = verbs.message_buffer() else {
                        return Post::Wait(Work::Send(pdu));
                    };
                    let n = scratch.len();
                    if n > b.len() {
                        tracing::error!(%portal, id, "a PDU of {n} bytes is longer than an IU buffer: dropped");
                        verbs.recycle_message(b);
                        return Post::Dropped;
                    }
                    b[..n].copy_from_slice(scratch);
                    tracing::trace!(%portal, id, len = n, pdu = ?pdu.opcode(), "iSER send");
                    verbs.post_send(qp, wr, PortBuffer::Message(b), n);
                }
                Work::HelloReply(r) => {
                    let Some(mut b) = verbs.message_buffer() else {
                        return Post::Wait(Work::HelloReply(r));
                    };
                    let bytes = r.encode();
                    b[..bytes.len()].copy_from_slice(&bytes);
                    verbs.post_send(qp, wr, PortBuffer::Message(b), bytes.len());
                }
                Work::RdmaWrite {
                    itt,
                    payload,
                    len,
                    remote,
                } => {
                    let buffer: FabricBuffer<F::Message> = match payload {
                        Payload::Buffer(b) => PortBuffer::Data(b),
                        Payload::Bytes(bytes) => {
                            let Some(b) = crate::fabric::registered::<F>(verbs, share, &bytes)
                            else {
                                return Post::Wait(Work::RdmaWrite {
                                    itt,
                                    payload: Payload::Bytes(bytes),
                                    len,
                                    remote,
                                });
                            };
                            b
                        }
                    };
                    verbs.post_rdma_write(qp, wr, buffer, 0, len as usize, &[region(remote, len)]);
                    counters.iser_rdma_writes.fetch_add(1, Ordering::Relaxed);
                }
                Work::RdmaRead {
                    read,
                    buffer,
                    at,
                    len,
                    remote,
                } => {
                    reads.insert(wr, read);
                    let d = region(remote, len as u32);
                    verbs.post_rdma_read(qp, wr, PortBuffer::Data(buffer), at, len, &[d]);
                    counters.iser_rdma_reads.fetch_add(1, Ordering::Relaxed);
                }
            }
            Post::Sent
        })
    }

    /// Ends a connection once it is over: a flushed logout or refusal, a lost queue pair, a
    /// timeout. It is disconnected and its session told at once (the last connection of a
    /// session closes its I_T nexus, else its tasks are aborted); it goes once its tasks have
    /// ended and the verbs have given back every buffer.
    fn end_if_over(&mut self, id: u64) -> bool {
        let Some(c) = self.conns.get_mut(&id) else {
            return false;
        };
        let qp = c.qp;
        let broken = self.fabric.verbs().is_error(qp);
        let flushed = c.flush_then_close && c.sends.is_idle();
        let now = Instant::now();
        let lingered = match (flushed, c.linger_until) {
            (false, _) => false,
            (true, None) => {
                c.linger_until = Some(now + LINGER);
                false
            }
            (true, Some(t)) => now >= t,
        };
        if !(c.lost || broken || lingered) {
            return false;
        }
        c.lost = true;
        let mut progress = false;
        if !c.torn_down {
            c.torn_down = true;
            progress = true;
            if !broken {
                self.fabric.verbs().disconnect(qp);
            }
            if let Phase::Full(f) = &mut c.phase {
                teardown(f, id, &self.registry);
            }
            if let Some(b) = c.held.take() {
                self.fabric.verbs().recycle_message(b);
            }
            for (b, _) in c.deferred.drain(..) {
                self.fabric.verbs().recycle_message(b);
            }
        }
        if let Phase::Full(f) = &c.phase {
            if !f.machine.connection().is_idle() || !f.link.out.local.is_empty() {
                return progress;
            }
        }
        if c.sends.in_flight() > 0 {
            // Flushed work requests come back through the completions.
            return progress;
        }
        let Some(c) = self.conns.remove(&id) else {
            return progress;
        };
        let verbs = self.fabric.verbs();
        while let Some(wc) = verbs.poll(qp) {
            if let PortBuffer::Message(b) = wc.buffer {
                verbs.recycle_message(b);
            }
        }
        self.fabric.release(qp);
        self.registry.unregister(id);
        self.registry
            .counters
            .iser_connections
            .fetch_sub(1, Ordering::Relaxed);
        drop(c);
        tracing::debug!(portal = %self.portal, id, "iSER connection ended");
        true
    }

    /// Asks every connection in full feature phase to log out (the daemon is stopping).
    fn log_out_all(&mut self) {
        for c in self.conns.values_mut() {
            match &mut c.phase {
                Phase::Full(f) if f.scope.session().is_some() => {
                    let mut nexus = SessionStep::new(&mut f.link, &f.scope);
                    f.machine.connection_mut().ask_logout(&mut nexus);
                }
                _ => c.lost = true,
            }
        }
    }

    /// Disconnects what is left (the daemon's drain is over).
    fn close_all(&mut self) {
        let ids: Vec<u64> = self.conns.keys().copied().collect();
        for id in ids {
            if let Some(c) = self.conns.get_mut(&id) {
                c.lost = true;
            }
            self.end_if_over(id);
            if let Some(c) = self.conns.remove(&id) {
                self.fabric.release(c.qp);
                self.registry.unregister(id);
                self.registry
                    .counters
                    .iser_connections
                    .fetch_sub(1, Ordering::Relaxed);
            }
        }
    }
}

/// A connection is gone: no queued command of it reaches the core from now on, and its
/// session hears of it (as a TCP connection's teardown).
fn teardown(f: &mut Full, id: u64, registry: &Registry) {
    let mut nexus = SessionStep::new(&mut f.link, &f.scope);
    nexus.cancel_queued();
    while let Ok(ev) = f.rx.try_recv() {
        nexus.core.out.local.push_back(ev);
    }
    let Some(session) = nexus.scope.session().cloned() else {
        f.machine.connection_mut().close(true, &mut nexus);
        return;
    };
    // The registry's lock is taken before the core's elsewhere (a session is made).
    nexus.release();
    let last = registry.sessions.leave(&session, id);
    f.machine.connection_mut().close(last, &mut nexus);
    if last {
        nexus.session_core(|session, core, _, out| core.close_session(session.nexus, out));
        tracing::info!(tsih = session.tsih, initiator = %session.initiator, "session ends");
    }
}

/// `len` bytes of the initiator's buffer (its STag and address) as the verbs name them.
fn region(remote: RemoteBuffer, len: u32) -> RemoteRegion {
    RemoteRegion {
        addr: remote.va,
        rkey: remote.stag,
        len,
    }
}
