//! One iSCSI connection in full feature phase: the I/O shell around iscsi-pdu's sans-IO
//! [`Connection`](iscsi_pdu::target_node::Connection), which makes every protocol decision (CmdSN
//! order, R2Ts, Data-In, NOP, text, logout, task management, Reject). This file moves bytes
//! between the socket and the machine, allocates arena buffers, submits backend operations to
//! the reactor's engine, routes the SCSI core's actions, keeps the machine's timer and counts.
//!
//! Two futures share the connection's state: the reader takes PDUs off the socket (payloads
//! straight into arena buffers, where the machine's [`Plan`] says) and the worker runs what the
//! core and the backend hand back and writes the output with vectored writes. Neither holds the
//! state across an await.

use std::cell::RefCell;
use std::net::SocketAddr;
use std::os::fd::AsFd;
use std::rc::Rc;
use std::sync::Arc;
use std::time::{Duration, Instant};

use backend::{Buffer, Share};
use iscsi_pdu::negotiation::SessionType;
use iscsi_pdu::target_node::{
    self, Close, CommandOrder, NoBuffer, OrderedCommand, Plan, Settings, Transmit,
};
use iscsi_pdu::text::TextParams;
use iscsi_pdu::SerialNumber;
use scsi_core::{BackendError, Output, TaskId, TmfFunction};
use tokio::net::TcpStream;
use tokio::sync::mpsc;

use super::login::{self, Outcome};
use super::session::Session;
use super::wire::{Incoming, ReadError, Reader, SendStalled, Writer};
use crate::carrier::{self, granted, Carried, Carrier, Waiting};
use crate::config::MAX_IO;
use crate::control::{Control, Park, Parked, ParkedState, Request};
use crate::reactor::Io;
use crate::registry::{Peer, Registry};
use crate::target::{Core, CoreStep, Outbox, Route, Routed, Target};
use crate::unit::{next_id, CachedUnit, UnitCache};
use iscsi_pdu::target_node::Core as _;

/// How long a closing connection waits for its tasks' backend operations.
const DRAIN_TIMEOUT: Duration = Duration::from_secs(30);
/// Seconds the Asynchronous Message gives the initiator to log out.
pub use iscsi_pdu::target_node::LOGOUT_GRACE;

/// Serves a new TCP connection: login, then a discovery or normal session.
pub async fn serve(stream: TcpStream, io: Rc<Io>, registry: Arc<Registry>) {
    let (Ok(addr), Ok(local)) = (stream.peer_addr(), stream.local_addr()) else {
        return;
    };
    let _ = stream.set_nodelay(true);
    let id = next_id();
    let control = Arc::new(Control::default());
    registry.register(id, control.clone());
    let peer = Peer {
        id,
        addr,
        local,
        reactor: io.index,
        control: control.clone(),
        iser: false,
        max_window: u32::MAX,
    };
    let (rd, wr) = stream.into_split();
    let mut reader = Reader::new(rd);
    let stall = Duration::from_secs(registry.config().server.send_timeout);
    let mut writer = Writer::new(wr, stall);
    // A login that does not finish in `server.login_timeout` is dropped: it holds a place among
    // `server.max_connections` until then.
    let login_timeout = Duration::from_secs(registry.config().server.login_timeout);
    let outcome = tokio::select! {
        o = tokio::time::timeout(login_timeout, login::run(&mut reader, &mut writer, &registry, &peer)) => o.ok().flatten(),
        _ = wait_for(&control, Request::Close) => None,
    };
    if let Some(outcome) = outcome {
        full_feature(reader, writer, outcome, io, &registry, &peer).await;
    }
    registry.unregister(id);
}

/// Serves a connection of a session another process handed over ([`super::handover::adopt`])
/// from where that process left it: its socket, its machine's state and the bytes it had
/// read ahead. No login runs; the initiator sees the next answer, StatSN in sequence.
pub async fn resume(
    stream: std::net::TcpStream,
    io: Rc<Io>,
    registry: Arc<Registry>,
    peer: Peer,
    outcome: Outcome,
    unread: Vec<u8>,
) {
    let stream = match stream
        .set_nonblocking(true)
        .and_then(|()| TcpStream::from_std(stream))
    {
        Ok(s) => s,
        Err(e) => {
            tracing::warn!(peer = %peer.addr, "an adopted connection's socket: {e}");
            registry.unregister(peer.id);
            return;
        }
    };
    let _ = stream.set_nodelay(true);
    let (rd, wr) = stream.into_split();
    let reader = Reader::resume(rd, &unread);
    let stall = Duration::from_secs(registry.config().server.send_timeout);
    let writer = Writer::new(wr, stall);
    full_feature(reader, writer, outcome, io, &registry, &peer).await;
    registry.unregister(peer.id);
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

/// What a connection's link reaches.
pub(crate) enum Scope {
    /// A normal session: its CmdSN order and its target's SCSI core.
    Session(Arc<Session>),
    /// A discovery session: a CmdSN window of its own and no SCSI core (the machine rejects
    /// every request that would need one).
    Discovery {
        order: RefCell<CommandOrder<()>>,
        initiator: String,
    },
}

impl Scope {
    pub(crate) fn session(&self) -> Option<&Arc<Session>> {
        match self {
            Scope::Session(session) => Some(session),
            Scope::Discovery { .. } => None,
        }
    }

    pub(crate) fn target(&self) -> Option<&Arc<Target>> {
        self.session().map(|s| &s.target)
    }

    /// ExpCmdSN and MaxCmdSN to advertise now.
    pub(crate) fn window(&self) -> (SerialNumber, SerialNumber) {
        match self {
            Scope::Session(session) => session.window(),
            Scope::Discovery { order, .. } => order.borrow().window(),
        }
    }
}

/// This connection's end of its session: its route for the core's actions, and what the core
/// has handed back (for it, not yet taken by the machine; for other connections, not yet sent).
pub(crate) struct Link {
    pub(crate) id: u64,
    pub(crate) peer: SocketAddr,
    pub(crate) portal: SocketAddr,
    pub(crate) registry: Arc<Registry>,
    pub(crate) route: Route,
    pub(crate) out: Outbox,
    /// The target's units as this connection last found them.
    pub(crate) units: UnitCache<u16>,
}

/// The session and the target as one step of the connection reaches them (a PDU read, a turn
/// of the worker): the daemon's side of the machine's [`Core`](iscsi_pdu::target_node::Core). The
/// target's core is the [`CoreStep`] SRP's channels take too (its lock at most once per step);
/// around it, what iSCSI adds: the session's CmdSN order and its other connections, and
/// discovery.
pub(crate) struct SessionStep<'a> {
    /// The target's core for this step.
    pub(crate) core: CoreStep<'a>,
    pub(crate) scope: &'a Scope,
    /// The connection's id.
    pub(crate) id: u64,
    peer: SocketAddr,
    portal: SocketAddr,
    pub(crate) registry: &'a Registry,
}

impl<'a> SessionStep<'a> {
    pub(crate) fn new(link: &'a mut Link, scope: &'a Scope) -> SessionStep<'a> {
        let Link {
            id,
            peer,
            portal,
            registry,
            route,
            out,
            units,
        } = link;
        let target = scope.session().map(|s| (&*s.target, s.nexus));
        SessionStep {
            core: CoreStep::new(target, route, out, units),
            scope,
            id: *id,
            peer: *peer,
            portal: *portal,
            registry,
        }
    }

    /// The SCSI core's call `f` for the session (see [`CoreStep::core`]).
    pub(crate) fn session_core<R>(
        &mut self,
        f: impl FnOnce(&Session, &mut Core, &Route, &mut Outbox) -> R,
    ) -> Option<R> {
        let scope: &'a Scope = self.scope;
        let session = scope.session()?;
        self.core
            .core(|core, _, route, out| f(session, core, route, out))
    }

    /// Lets the core's lock go (see [`CoreStep::release`]).
    pub(crate) fn release(&mut self) {
        self.core.release();
    }
}

impl iscsi_pdu::target_node::Core for SessionStep<'_> {
    fn poll_core(&mut self) -> Option<Routed> {
        self.core.out.local.pop_front()
    }

    fn window(&self) -> (SerialNumber, SerialNumber) {
        self.scope.window()
    }

    fn deliver(&mut self, cmd: OrderedCommand, immediate: bool) -> bool {
        self.session_core(|session, core, route, out| {
            session.deliver(core, cmd, immediate, route, out)
        })
        .unwrap_or(false)
    }

    fn take_cmd_sn(&mut self, cmd_sn: SerialNumber) -> bool {
        if let Scope::Discovery { order, .. } = self.scope {
            let mut order = order.borrow_mut();
            let taken = order.admit(cmd_sn, None);
            while order.next_ready().is_some() {}
            return taken;
        }
        self.session_core(|session, core, _, out| session.take_cmd_sn(core, cmd_sn, out))
            .unwrap_or(false)
    }

    fn send_targets(&mut self, value: &str) -> TextParams {
        self.release();
        let (initiator, own) = match self.scope {
            Scope::Session(session) => (&session.initiator, Some(session.target.name.as_str())),
            Scope::Discovery { initiator, .. } => (initiator, None),
        };
        self.registry
            .send_targets(initiator, self.peer.ip(), self.portal, value, own)
    }

    fn close_connection(&mut self, cid: u16) -> bool {
        self.release();
        let Some(session) = self.scope.session() else {
            return false;
        };
        let conns = self.registry.sessions.connections(session);
        let Some(c) = conns.iter().find(|c| c.cid == cid) else {
            return false;
        };
        c.control.request(Request::Close);
        true
    }

    fn cancel_queued(&mut self) {
        let me = self.id;
        self.session_core(|session, core, _, _| core.cancel_queued(session.nexus, me));
    }

    fn close_session(&mut self) -> Option<u64> {
        self.release();
        let session = self.scope.session()?;
        for c in self.registry.sessions.connections(session) {
            if c.id != self.id {
                c.control.request(Request::Close);
            }
        }
        // An SPC-2 reservation kept with other gateways goes before the logout is answered
        // (an I_T NEXUS RESET, which the keeper carries to every gateway).
        self.session_core(|session, core, route, out| {
            if !core.device().holds_shared_reservation(session.nexus) {
                return None;
            }
            core.router()
                .task_management(session.nexus, 0, TmfFunction::ItNexusReset, route, out)
                .ok()
        })
        .flatten()
    }

    fn reset_target(&mut self) {
        self.release();
        let Some(session) = self.scope.session() else {
            return;
        };
        for s in self.registry.sessions.all() {
            if Arc::ptr_eq(&s.target, &session.target) && !Arc::ptr_eq(&s, session) {
                self.registry.sessions.close(&s);
            }
        }
        self.close_session();
    }
}

impl iscsi_pdu::target_node::TaskCore for SessionStep<'_> {
    fn data_out(&mut self, task: TaskId, data: &[u8]) {
        self.core.data_out(task, data);
    }

    fn backend_done(&mut self, task: TaskId, result: Result<Output, BackendError>) {
        self.core.backend_done(task, result);
    }

    fn retire(&mut self, task: TaskId) {
        self.core.retire(task);
    }

    fn task_management(&mut self, lun: u64, function: TmfFunction) -> Option<u64> {
        self.core.task_management(lun, function)
    }

    fn block_size(&mut self, lun: u16) -> Option<u32> {
        self.core.block_size(lun)
    }
}

/// The state the reader and the worker share: the machine, its link to the session, and the
/// reactor's arena and engine.
struct Conn {
    machine: target_node::Connection<Buffer>,
    link: Link,
    scope: Scope,
    /// Carries out the machine's events on the reactor. Its buffers come from what this
    /// connection may hold of the reactor's arena ([`CONNECTION_SHARE`]); backend operations
    /// wait for them in arrival order, the head's allocation a future of the worker, which
    /// the arena wakes.
    carrier: Carrier,
    /// The reader has stopped at a PDU boundary for a park ([`Park::Park`]) and waits: the
    /// worker parks the connection once its tasks are over.
    reader_parked: bool,
}

/// The part of its reactor's arena one connection's buffers may hold: half. Without a bound,
/// an initiator that stops reading Data-In (its READs' buffers go back only once sent), or
/// one that sends WRITEs and never their data, would hold every slot and stall every other
/// connection on the reactor. Half still fits the largest command (`target_node::MAX_IO`), and a
/// command larger than the share is served when the connection holds nothing else.
///
/// Backend operations wait for their buffers in the worker. A write's data buffer is taken
/// by the reader, which waits for it only when nothing the connection holds waits for
/// data-out ([`target_node::Connection::may_wait_for_buffer`]); otherwise the data that would
/// free the space may be behind the command in the stream, and waiting would stop the
/// connection (and every other connection waiting for the same arena) for good. Then the
/// command is answered TASK SET FULL, and the initiator sends it again later.
pub const CONNECTION_SHARE: usize = 2;

/// One step of a connection: the machine and its [`SessionStep`] nexus, with the reactor's engine
/// and arena. Made from a borrowed [`Conn`] and dropped before any await, so the core's lock
/// is never held across one.
struct Turn<'a> {
    machine: &'a mut target_node::Connection<Buffer>,
    nexus: SessionStep<'a>,
    carrier: &'a mut Carrier,
}

impl Conn {
    fn turn(&mut self) -> Turn<'_> {
        let Conn {
            machine,
            link,
            scope,
            carrier,
            ..
        } = self;
        Turn {
            machine,
            nexus: SessionStep::new(link, scope),
            carrier,
        }
    }
}

/// The machine and its nexus for one step, as the carrier reaches them.
struct Machine<'t, 'a> {
    machine: &'t mut target_node::Connection<Buffer>,
    nexus: &'t mut SessionStep<'a>,
}

impl Carried for Machine<'_, '_> {
    fn account(&mut self, done: &scsi_core::transport::Accounting) {
        if let Some(target) = self.nexus.scope.target() {
            target.tally(self.nexus.core.units, done);
        }
    }

    fn unit(&mut self, lun: u16) -> Option<CachedUnit<'_>> {
        let target = self.nexus.scope.target()?;
        target.cached_lun(self.nexus.core.units, lun)
    }

    fn backend_done(
        &mut self,
        now: Instant,
        task: TaskId,
        buffer: Buffer,
        result: Result<scsi_core::Output, BackendError>,
    ) {
        self.machine
            .handle_backend_done(now, task, buffer, result, self.nexus);
    }

    fn buffer(&mut self, now: Instant, tag: u64, buffer: Option<Buffer>) {
        self.machine.handle_buffer(now, tag, buffer, self.nexus);
    }
}

/// A connection entering full feature phase: its machine, its link to the session (and the
/// core's events routed to it), what it reaches, and the parameters its login negotiated.
pub(crate) struct Entered<B> {
    pub(crate) machine: target_node::Connection<B>,
    pub(crate) link: Link,
    pub(crate) scope: Scope,
    pub(crate) rx: mpsc::UnboundedReceiver<Routed>,
    pub(crate) params: iscsi_pdu::negotiation::ConnectionParams,
}

/// Starts the machine of a connection (`peer`) whose login ended with `outcome`, on its
/// session or as a discovery session, with the server's timers: the same for a TCP
/// connection and an iSER one.
pub(crate) fn enter<B: scsi_core::transport::TaskBuffer>(
    outcome: Outcome,
    registry: &Arc<Registry>,
    peer: &Peer,
    now: Instant,
) -> Entered<B> {
    let mut adopted = None;
    let (scope, negotiator, stat_sn) = match outcome {
        Outcome::Normal {
            session,
            negotiator,
            stat_sn,
        } => (Scope::Session(session), negotiator, stat_sn),
        Outcome::Adopted {
            session,
            negotiator,
            state,
        } => {
            let stat_sn = state.stat_sn;
            adopted = Some(state);
            (Scope::Session(session), negotiator, stat_sn)
        }
        Outcome::Discovery {
            negotiator,
            initiator,
            stat_sn,
            exp_cmd_sn,
        } => {
            let window = registry.window_for(peer);
            let order = RefCell::new(CommandOrder::new(exp_cmd_sn, window));
            (Scope::Discovery { order, initiator }, negotiator, stat_sn)
        }
    };
    let params = *negotiator.connection();
    let (cid, session_type, op) = match &scope {
        Scope::Session(session) => {
            let conns = registry.sessions.connections(session);
            let cid = conns.iter().find(|x| x.id == peer.id).map_or(0, |x| x.cid);
            (cid, SessionType::Normal, session.params.operational)
        }
        Scope::Discovery { .. } => {
            let op = negotiator.session().operational;
            (0, SessionType::Discovery, op)
        }
    };
    let settings = {
        let c = registry.config();
        let s = &c.server;
        Settings {
            cid,
            session_type,
            max_io: MAX_IO,
            nop_interval: Duration::from_secs(s.nop_interval),
            nop_timeout: Duration::from_secs(s.nop_timeout),
            data_out_timeout: Duration::from_secs(s.data_out_timeout),
        }
    };
    let machine = match &adopted {
        Some(state) => target_node::Connection::resume(now, settings, negotiator, op, state),
        None => target_node::Connection::new(now, settings, negotiator, op, stat_sn),
    };
    let (tx, rx) = mpsc::unbounded_channel();
    let link = Link {
        id: peer.id,
        peer: peer.addr,
        portal: peer.local,
        registry: registry.clone(),
        route: Route::new(peer.id, tx),
        out: Outbox::new(peer.id),
        units: UnitCache::default(),
    };
    Entered {
        machine,
        link,
        scope,
        rx,
        params,
    }
}

/// Full feature phase: a normal or a discovery session on this connection until it closes.
async fn full_feature(
    mut reader: Reader,
    mut writer: Writer,
    outcome: Outcome,
    io: Rc<Io>,
    registry: &Arc<Registry>,
    peer: &Peer,
) {
    let adopted = matches!(outcome, Outcome::Adopted { .. });
    let Entered {
        machine,
        link,
        scope,
        rx,
        params: c,
    } = enter(outcome, registry, peer, Instant::now());
    let digests = iscsi_pdu::Digests {
        header: c.header_digest,
        data: c.data_digest,
    };
    reader.set_digests(digests);
    reader.set_max_recv(c.max_recv_data_segment_length);
    writer.digests = digests;
    writer.max_send = c.max_send_data_segment_length;
    let share = Share::new(&io.arena, io.arena.len() / CONNECTION_SHARE);
    let conn = Rc::new(RefCell::new(Conn {
        machine,
        link,
        scope,
        carrier: Carrier::single(io, share),
        reader_parked: false,
    }));
    if adopted {
        // The old process held the window back while it parked the session.
        announce_window(&conn);
    }
    let mut rx = rx;
    loop {
        tokio::select! {
            r = read_loop(&conn, &mut reader, &peer.control) => {
                if let Err(e) = r {
                    tracing::debug!(peer = %peer.addr, "connection ends: {e}");
                }
            }
            r = work_loop(&conn, &mut rx, &mut writer, &peer.control) => {
                match r {
                    Ok(Worked::Parked) => {
                        // The reader waits at a PDU boundary (it parked first), so dropping
                        // its future loses nothing.
                        match park(&conn, &reader, peer).await {
                            Park::Release => {
                                release(&conn, reader, writer);
                                tracing::info!(peer = %peer.addr, "connection handed over");
                                return;
                            }
                            _ => {
                                announce_window(&conn);
                                continue;
                            }
                        }
                    }
                    Err(e) if SendStalled::is(&e) => {
                        registry.counters.send_timeouts.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                        tracing::info!(peer = %peer.addr, "connection dropped: {e}");
                    }
                    Err(e) => tracing::debug!(peer = %peer.addr, "connection ends: {e}"),
                    Ok(Worked::Closed) => {}
                }
                let _ = writer.shutdown().await;
            }
        }
        break;
    }
    drop(reader);
    drop(writer);
    teardown(&conn, &mut rx).await;
}

/// Tells the initiator the window (a NOP-In that asks for no answer): after a park, which
/// held it back, or once adopted.
fn announce_window(conn: &Rc<RefCell<Conn>>) {
    let mut c = conn.borrow_mut();
    let mut t = c.turn();
    t.machine.announce_window(&mut t.nexus);
    t.nexus.release();
    drop(t);
    // The worker sends it at its next wake, which this is: the initiator may have nothing
    // in flight to wake it otherwise.
    c.carrier.inbox().notify.notify_one();
}

/// A parked connection another process serves now: it leaves its session here without a
/// word to the initiator and without closing the session's I_T nexus (whose end would reach
/// the other gateways of a cluster as an I_T nexus reset), and its socket is let go without
/// a shutdown. This process's core keeps the nexus until it exits.
fn release(conn: &Rc<RefCell<Conn>>, reader: Reader, writer: Writer) {
    writer.release();
    drop(reader);
    let c = conn.borrow();
    if let Some(session) = c.scope.session() {
        c.link.registry.sessions.leave(session, c.link.id);
    }
}

/// A quiescent connection ([`Worked::Parked`]): reports its state and a duplicate of its
/// socket to the handover, then waits for its word: [`Park::Release`] (another process
/// serves it now: it ends without a word to the initiator or its session) or
/// [`Park::Serve`] (the handover is withdrawn or failed: it serves on where it stopped).
/// Nothing is read or sent meanwhile; the initiator's PDUs wait in the socket.
async fn park(conn: &Rc<RefCell<Conn>>, reader: &Reader, peer: &Peer) -> Park {
    let control = &peer.control;
    let parked = {
        let c = conn.borrow();
        let tsih = c.scope.session().map(|s| s.tsih);
        let state = c.machine.handover().ok();
        let unread = reader.unread();
        let socket = reader.socket().as_fd().try_clone_to_owned();
        match (tsih, state, unread, socket) {
            (Some(tsih), Some(mut state), Some(unread), Ok(socket)) => {
                state.unread = unread.to_vec();
                Some(Parked {
                    id: peer.id,
                    state: ParkedState::Iscsi { tsih, state },
                    socket,
                })
            }
            (.., Err(e)) => {
                tracing::warn!(peer = %peer.addr, "parking: duplicating the socket: {e}");
                None
            }
            _ => None,
        }
    };
    conn.borrow_mut().reader_parked = false;
    let turns = control.park_turns();
    if !parked.is_some_and(|p| control.report(p)) {
        return Park::Serve;
    }
    loop {
        let notified = control.notify.notified();
        match control.parking() {
            // Told to read on and asked to park again since: read on, then report anew.
            Park::Park if control.park_turns() != turns => return Park::Serve,
            Park::Park => notified.await,
            p => return p,
        }
    }
}

/// The connection is gone: end its tasks. The last connection of a session closes the I_T
/// nexus; otherwise its own tasks are aborted. Backend operations in flight are waited for.
async fn teardown(conn: &Rc<RefCell<Conn>>, rx: &mut mpsc::UnboundedReceiver<Routed>) {
    {
        let mut c = conn.borrow_mut();
        let mut t = c.turn();
        // No queued command of this connection reaches the core from now on; what reached it
        // before has been reported on the channel (releases report under the core's lock), so
        // once the channel is drained every task not in the core never will be.
        t.nexus.cancel_queued();
        while let Ok(ev) = rx.try_recv() {
            t.nexus.core.out.local.push_back(ev);
        }
        t.pump(Instant::now());
        let Some(session) = t.nexus.scope.session() else {
            t.machine.close(true, &mut t.nexus);
            return;
        };
        // The registry's lock is taken before the core's elsewhere (a session is made).
        t.nexus.release();
        let last = t.nexus.registry.sessions.leave(session, t.nexus.id);
        t.machine.close(last, &mut t.nexus);
        if last {
            t.nexus
                .session_core(|session, core, _, out| core.close_session(session.nexus, out));
            tracing::info!(tsih = session.tsih, initiator = %session.initiator, "session ends");
        }
    }
    let deadline = tokio::time::Instant::now() + DRAIN_TIMEOUT;
    let (inbox, share) = {
        let c = conn.borrow();
        (c.carrier.inbox().clone(), c.carrier.waits.share().clone())
    };
    let mut waiting = None;
    loop {
        {
            let mut c = conn.borrow_mut();
            let mut t = c.turn();
            let now = Instant::now();
            t.absorb(now);
            t.pump(now);
            while t.machine.poll_transmit().is_some() {}
            if t.machine.is_idle() && t.nexus.core.out.local.is_empty() {
                return;
            }
            drop(t);
            c.wait_for_buffer(&share, &mut waiting);
        }
        tokio::select! {
            _ = inbox.notify.notified() => {}
            Some(ev) = rx.recv() => conn.borrow_mut().link.out.local.push_back(ev),
            (tag, b) = granted(&mut waiting) => conn.borrow_mut().turn().granted(tag, b),
            _ = tokio::time::sleep_until(deadline) => {
                tracing::warn!("a closed connection's tasks did not finish in {DRAIN_TIMEOUT:?}");
                return;
            }
        }
    }
}

/// Takes PDUs off the socket until it closes or breaks, putting each payload where the
/// machine's plan says.
async fn read_loop(
    conn: &Rc<RefCell<Conn>>,
    reader: &mut Reader,
    control: &Control,
) -> Result<(), ReadError> {
    let (inbox, share) = {
        let c = conn.borrow();
        (c.carrier.inbox().clone(), c.carrier.waits.share().clone())
    };
    loop {
        let stop = control.parking() == Park::Park
            && (may_stop_reading(conn)
                || (!conn.borrow().machine.awaits_initiator() && {
                    // The session's order waits for a command: read only those that fill a
                    // gap, not a new one (which would open another gap behind it on another
                    // connection, and the connections would never all stop).
                    let next = tokio::select! {
                        biased;
                        r = reader.peek_cmd_sn() => r?,
                        _ = control.reader.notified() => continue,
                    };
                    next.is_some_and(|sn| highest_taken(conn).is_some_and(|h| sn.gt(h)))
                }));
        if stop {
            // Stopped between two PDUs: the worker parks the connection once its tasks are
            // over, which drops this future here; or it wakes it to read on.
            conn.borrow_mut().reader_parked = true;
            inbox.notify.notify_one();
            control.reader.notified().await;
            conn.borrow_mut().reader_parked = false;
            continue;
        }
        // The header's read is cancel-safe: a wake to park (or a spurious one) loses nothing.
        let incoming = tokio::select! {
            biased;
            r = reader.next() => r,
            _ = control.reader.notified() => continue,
        };
        let (mut plan, mut closing) = step(conn, Some(reader.arrived()), |t, now| {
            let mut plan = t.take(now, incoming)?;
            // The other PDUs the same socket read brought, in the same step: a queue depth's
            // burst of commands takes the core's lock once, not once per command. Bounded, so
            // that the lock is let go for other connections of the target now and then; a
            // PDU whose data is still to be read, a park, a closing or tracing (whose stages
            // read the clock per step) ends the batch.
            for _ in 1..READ_BATCH {
                if !matches!(plan, Plan::Next)
                    || t.machine.closing().is_some()
                    || control.parking() != Park::Serve
                    || t.machine.trace_points().is_on()
                {
                    break;
                }
                let Some(incoming) = reader.try_next() else {
                    break;
                };
                t.pump(now);
                plan = t.take(now, incoming)?;
            }
            Ok(plan)
        })?;
        loop {
            match plan {
                Plan::Next => break,
                Plan::Discard => {
                    reader.discard();
                    break;
                }
                Plan::Allocate(len) => {
                    let buffer = write_buffer(conn, &share, len as usize).await;
                    (plan, closing) = step(conn, None, |t, now| {
                        let nexus = &mut t.nexus;
                        Ok(t.machine.handle_allocated(now, buffer, nexus))
                    })?;
                }
                Plan::Receive {
                    mut buffer,
                    at,
                    len,
                } => {
                    let r = reader.payload(&mut buffer[at..at + len]).await;
                    (plan, closing) = step(conn, None, |t, now| {
                        let nexus = &mut t.nexus;
                        match r {
                            Ok(()) => t.machine.handle_payload(now, buffer, nexus),
                            Err(ReadError::Reject { reason, header }) => t
                                .machine
                                .handle_payload_error(buffer, reason, &header, nexus),
                            Err(e) => return Err(e),
                        }
                        Ok(Plan::Next)
                    })?;
                }
            }
        }
        inbox.notify.notify_one();
        if closing {
            // Nothing more is read after a logout; the worker closes once it has answered.
            std::future::pending::<()>().await;
        }
    }
}

/// Whether the reader may stop for a park now: nothing begun waits for the initiator (the
/// connection's data-out, a ping's answer, a text exchange) and its session holds no
/// command waiting for an earlier CmdSN (which another connection of the session, or this
/// one, has still to bring). A discovery session is not parked: it is closed instead.
fn may_stop_reading(conn: &Rc<RefCell<Conn>>) -> bool {
    let mut c = conn.borrow_mut();
    if c.machine.awaits_initiator() || c.scope.session().is_none() {
        return false;
    }
    let mut t = c.turn();
    let queued = t
        .nexus
        .session_core(|session, core, _, _| core.queued(session.nexus))
        .unwrap_or(0);
    t.nexus.release();
    queued == 0
}

/// The highest CmdSN the connection's session has taken
/// ([`iscsi_pdu::target_node::CommandOrder::highest_taken`]).
fn highest_taken(conn: &Rc<RefCell<Conn>>) -> Option<SerialNumber> {
    let mut c = conn.borrow_mut();
    let mut t = c.turn();
    let highest = t
        .nexus
        .session_core(|session, core, _, _| core.highest_taken(session.nexus))
        .flatten();
    t.nexus.release();
    highest
}

/// A write's data buffer from the connection's share: at once when there is room; else by
/// waiting (the connection's backpressure) when the machine may wait, which holds nothing
/// that waits for data behind this command; else [`NoBuffer::Busy`] (TASK SET FULL).
async fn write_buffer(
    conn: &Rc<RefCell<Conn>>,
    share: &Share,
    len: usize,
) -> Result<Buffer, NoBuffer> {
    match share.try_alloc(len) {
        Ok(Some(b)) => return Ok(b),
        Ok(None) => {}
        Err(_) => return Err(NoBuffer::TooLarge),
    }
    {
        let c = conn.borrow();
        if !c.machine.may_wait_for_buffer() {
            let registry = &c.link.registry;
            registry
                .counters
                .task_set_full
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            return Err(NoBuffer::Busy);
        }
    }
    share.alloc(len).await.map_err(|_| NoBuffer::TooLarge)
}

/// The most PDUs one step of the reader takes from what one socket read brought
/// ([`read_loop`]).
const READ_BATCH: usize = 64;

/// One step of the reader: `f` on the machine and, unless it leaves a payload to read, what
/// the core and the machine then ask for, all under at most one acquisition of the core's lock,
/// at one reading of the clock. Returns the plan and whether the connection is closing.
///
/// `arrived`, for a PDU's header, is when the socket read that completed it returned
/// ([`Reader::arrived`]): the step's time unless commands are traced, so that the PDUs one
/// read brought (a queue depth's burst) cost one reading of the clock, not one each. Traced,
/// each step reads the clock, and the stages keep their own times.
///
/// Backend completions are left to the worker: taking them here as well saved no acquisition
/// at queue depth 32 (1.03 per command either way) and split the worker's response batches.
fn step(
    conn: &Rc<RefCell<Conn>>,
    arrived: Option<Instant>,
    f: impl FnOnce(&mut Turn<'_>, Instant) -> Result<Plan<Buffer>, ReadError>,
) -> Result<(Plan<Buffer>, bool), ReadError> {
    let mut c = conn.borrow_mut();
    let mut t = c.turn();
    // Tracing switched on since the last step covers this step's PDU from its arrival.
    t.trace();
    let now = match arrived {
        Some(at) if !t.machine.trace_points().is_on() => at,
        _ => Instant::now(),
    };
    let plan = f(&mut t, now)?;
    if matches!(plan, Plan::Next | Plan::Discard) {
        t.pump(now);
    }
    Ok((plan, t.machine.closing().is_some()))
}

/// Far enough ahead to mean "no timer".
const NEVER: Duration = Duration::from_secs(86400 * 365);

/// How the worker ended, when the socket did not fail.
enum Worked {
    /// The connection is to close.
    Closed,
    /// Parked for a handover: the reader stopped between two PDUs and every task is over.
    Parked,
}

/// Runs what the core and the backend hand back, keeps the machine's timer, and writes the
/// output.
async fn work_loop(
    conn: &Rc<RefCell<Conn>>,
    rx: &mut mpsc::UnboundedReceiver<Routed>,
    writer: &mut Writer,
    control: &Arc<Control>,
) -> std::io::Result<Worked> {
    let (inbox, share) = {
        let c = conn.borrow();
        (c.carrier.inbox().clone(), c.carrier.waits.share().clone())
    };
    let discovery = conn.borrow().scope.session().is_none();
    let mut batch: Vec<Transmit<Buffer>> = Vec::with_capacity(256);
    let timer = tokio::time::sleep(NEVER);
    tokio::pin!(timer);
    let mut waiting = None;
    loop {
        let due = {
            let c = conn.borrow();
            c.wait_for_buffer(&share, &mut waiting);
            c.machine.poll_timeout()
        };
        // The deadline moves with every PDU received; re-arming the timer each time would cost
        // a timer-wheel update per I/O. It is moved only earlier (or re-armed once it fired):
        // a wake-up before the machine's deadline finds nothing due and re-arms.
        if let Some(at) = due.map(tokio::time::Instant::from) {
            if timer.is_elapsed() || at < timer.deadline() {
                timer.as_mut().reset(at);
            }
        }
        tokio::select! {
            biased;
            _ = inbox.notify.notified() => {}
            Some(ev) = rx.recv() => conn.borrow_mut().link.out.local.push_back(ev),
            _ = control.notify.notified() => {}
            _ = &mut timer, if due.is_some() => {
                let mut c = conn.borrow_mut();
                let mut t = c.turn();
                t.machine.handle_timeout(Instant::now(), &mut t.nexus);
            }
            (tag, b) = granted(&mut waiting) => conn.borrow_mut().turn().granted(tag, b),
        }
        let close = {
            let mut c = conn.borrow_mut();
            let mut t = c.turn();
            while let Ok(ev) = rx.try_recv() {
                t.nexus.core.out.local.push_back(ev);
            }
            let now = Instant::now();
            t.absorb(now);
            t.pump(now);
            let mut request = control.get();
            if discovery && request == Request::Logout {
                // A discovery session is simply closed when the daemon stops.
                request = Request::Close;
            }
            if request == Request::Logout {
                t.machine.ask_logout(&mut t.nexus);
            }
            if control.is_overdue() {
                // The park's deadline passed: writes still owed data-out end TASK ABORTED
                // (their initiators send them again), and the reader may stop.
                let aborted = t.machine.abort_awaiting_data_out(&mut t.nexus);
                if aborted > 0 {
                    tracing::warn!(
                        aborted,
                        "the park's deadline passed: writes still owed data-out aborted"
                    );
                    t.nexus
                        .registry
                        .counters
                        .park_aborts
                        .fetch_add(aborted as u64, std::sync::atomic::Ordering::Relaxed);
                    t.pump(now);
                    control.reader.notify_one();
                }
            }
            match t.machine.closing() {
                Some(Close::NoPingAnswer) => {
                    return Err(std::io::Error::new(
                        std::io::ErrorKind::TimedOut,
                        "NOP-In ping not answered",
                    ))
                }
                Some(Close::DataOutTimeout) => {
                    let registry = &t.nexus.registry;
                    registry
                        .counters
                        .data_out_timeouts
                        .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    return Err(std::io::Error::new(
                        std::io::ErrorKind::TimedOut,
                        "data-out owed and not sent for server.data_out_timeout",
                    ));
                }
                Some(Close::AfterFlush) => true,
                None => request == Request::Close,
            }
        };
        {
            let mut c = conn.borrow_mut();
            while let Some(t) = c.machine.poll_transmit() {
                batch.push(t);
            }
            writer.max_send = c.machine.max_send_data_segment_length();
        }
        if !batch.is_empty() {
            let (exp, max) = {
                let c = conn.borrow();
                // Answers going out: with busy polling on, the reactor keeps polling for the
                // next request (once per batch, not per PDU).
                c.carrier.io().active();
                c.scope.window()
            };
            writer.send(&batch, exp, max).await?;
            if cmdtrace::enabled() {
                sent(&conn.borrow(), &batch);
            }
            batch.clear();
        }
        if close {
            return Ok(Worked::Closed);
        }
        if control.parking() == Park::Park && conn.borrow().reader_parked {
            let c = conn.borrow();
            if c.machine.awaits_initiator() {
                // A ping went out while parked: its answer must be read.
                control.reader.notify_one();
            } else if c.machine.handover().is_ok() && c.link.out.local.is_empty() && rx.is_empty() {
                return Ok(Worked::Parked);
            }
        }
    }
}

/// Records the Data-In and the status a batch written to the socket carried (while tracing).
fn sent(c: &Conn, batch: &[Transmit<Buffer>]) {
    let Some(session) = c.scope.session() else {
        return;
    };
    let key = cmdtrace::Record::session_of(session.isid.0, session.tsih);
    // The machine's points go through the reactor's clock: so do these, or a point read from
    // another clock could sort before the points it follows.
    let at_ns = c.carrier.io().clock.ns(Instant::now());
    let record = |stage, itt, arg| {
        cmdtrace::record(cmdtrace::Record {
            at_ns,
            session: key,
            itt,
            cmd_sn: 0,
            stage,
            lane: c.carrier.io().index as u8,
            arg,
        })
    };
    for t in batch {
        match t {
            Transmit::DataIn {
                itt, len, status, ..
            } => {
                record(cmdtrace::Stage::DataInSent, *itt, *len);
                if status.is_some() {
                    record(cmdtrace::Stage::StatusSent, *itt, 0);
                }
            }
            Transmit::Pdu(iscsi_pdu::Pdu::ScsiResponse(r)) => {
                record(cmdtrace::Stage::StatusSent, r.initiator_task_tag, 0)
            }
            Transmit::Pdu(_) => {}
        }
    }
}

impl Conn {
    /// Starts waiting for the oldest queued buffer, unless a wait is on already.
    fn wait_for_buffer<'a>(&self, share: &'a Share, waiting: &mut Waiting<'a>) {
        self.carrier.waits.start_waiting(share, waiting);
    }
}

impl Turn<'_> {
    /// Hands the machine a PDU (or its header) the reader took off the socket, or the Reject
    /// its header earned; what it plans for the rest of that PDU.
    fn take(
        &mut self,
        now: Instant,
        incoming: Result<Incoming, ReadError>,
    ) -> Result<Plan<Buffer>, ReadError> {
        Ok(match incoming {
            Ok(Incoming::Whole(pdu)) => self.machine.handle_pdu(now, pdu, &mut self.nexus),
            Ok(Incoming::Payload { pdu, len, header }) => {
                self.machine
                    .handle_header(now, pdu, &header, len, &mut self.nexus)
            }
            Err(ReadError::Reject { reason, header }) => {
                self.machine
                    .handle_reject(now, reason, &header, &mut self.nexus);
                Plan::Next
            }
            Err(e) => return Err(e),
        })
    }

    /// Moves backend completions into the machine (and through it the core), at `now`.
    fn absorb(&mut self, now: Instant) {
        let mut m = Machine {
            machine: self.machine,
            nexus: &mut self.nexus,
        };
        self.carrier
            .completions(|_, done| carrier::deliver(&mut m, now, done));
    }

    /// Hands the core's events to the machine and carries out what it asks, until neither
    /// has anything left.
    fn pump(&mut self, now: Instant) {
        while let Some(ev) = self.machine.poll_event(now, &mut self.nexus) {
            let mut m = Machine {
                machine: self.machine,
                nexus: &mut self.nexus,
            };
            self.carrier.carry(now, 0, &mut m, ev);
        }
        self.trace();
    }

    /// Moves the machine's trace points into the reactor's trace ring while tracing is on
    /// (`targetctl trace start`), and turns the machine's tracing on or off with it.
    fn trace(&mut self) {
        // A discovery session has no commands to trace.
        let Some(session) = self.nexus.scope.session() else {
            return;
        };
        let key = cmdtrace::Record::session_of(session.isid.0, session.tsih);
        crate::trace::record_points(self.machine.trace_points(), key, self.carrier.io());
    }

    /// The arena has granted (or refused) the buffer the first waiting request asked for.
    fn granted(&mut self, tag: u64, r: Result<Buffer, backend::ArenaError>) {
        if self.carrier.waits.front().is_some_and(|w| w.tag == tag) {
            self.carrier.waits.pop();
        }
        let buffer = r
            .map_err(|e| tracing::error!("buffer for task {tag:#x}: {e}"))
            .ok();
        self.machine
            .handle_buffer(Instant::now(), tag, buffer, &mut self.nexus);
    }
}
