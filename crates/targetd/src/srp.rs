//! SRP target ports: the I/O shell around srp's sans-IO channel machines, on a reactor.
//!
//! A port listens for connect requests (rdma_cm's, or a software fabric's), decides each
//! login (srp's [`Logins`] with this port's policy: the target named by the request's
//! target port identifier, the target's access rules), and runs every channel it accepts:
//! receives go into the channel machine, which the port answers by posting sends and RDMA
//! transfers, running backend operations on the reactor's engine ([`Io::submit`], as iSCSI
//! connections do) and handing the target's SCSI core what the machine asks through
//! `CoreStep`, the same core, lock and routing iSCSI sessions use. Data moves between the reactor's
//! arena slots and the initiator's memory: RDMA WRITE from the slot a READ filled, RDMA READ
//! into the slot a WRITE then writes from. Nothing is registered per I/O.
//!
//! All channels of a port run in one task on one reactor: the verbs (a device context, or a
//! fabric endpoint) belong to it. IU buffers are small vectors per channel, made at login
//! and reused; data buffers are arena slots.

use std::collections::{BTreeMap, HashMap};
use std::net::SocketAddr;
use std::ops::DerefMut;
use std::rc::Rc;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Instant;

use crate::target::CoreStep;
use backend::{Buffer, Share};
use scsi_core::{Action, BackendError, Command, DeviceError, NexusId, TaskId, TransportId};
use srp::fabric::NodeId;
use srp::iu::{IuError, LoginRejectReason, SrpLoginRej, SrpLoginReq, TargetLogoutReason};
use srp::switch::{ConnectRequest, Endpoint, Switch, SwitchError};
use srp::target_port::channel::SPARE_RECEIVES;
use srp::target_port::{
    Accepted, Buffers, Channel, Core, Driver, Event, ItNexusKey, Left, LoginPolicy, Logins,
    PortSettings,
};
use srp::verbs::{IuBuffers, PortBuffer, Verbs};
use tokio::sync::mpsc;

#[cfg(feature = "rdma")]
pub mod rdma;

use crate::control::Control;
use crate::port::{Waits, Want};
use crate::reactor::{Inbox, Io};
use crate::registry::{lock, ConnectionSlot, Registry, SrpChannelInfo};
use crate::target::{next_id, Lun, Outbox, Route, Routed, Target};

/// The relative target port identifier of every target's SRP port (its iSCSI port is 1).
pub const RELATIVE_PORT: u16 = 2;

/// The SRP target port identifier of the target `name`: what an initiator names in its
/// SRP_LOGIN_REQ to reach it ([`srp::target_port::port_id_for`]); `targetctl targets` shows it.
pub fn port_id(name: &str) -> [u8; 16] {
    srp::target_port::port_id_for(name)
}

/// The hexadecimal form of a port identifier, as `targetctl` shows it and a target's
/// `initiators` list names an SRP initiator port.
pub fn hex(id: &[u8; 16]) -> String {
    id.iter().map(|b| format!("{b:02x}")).collect()
}

/// A queue pair of a fabric.
pub type Qp<F> = <<F as Fabric>::Verbs as Verbs>::Qp;

/// A buffer a port gives its verbs: one of the fabric's IU buffers, or a task's data in a
/// slot run of the reactor's arena.
pub type SrpBuffer<I> = PortBuffer<I, Buffer>;

/// What a port runs on: queue-pair verbs over [`SrpBuffer`]s, and connection management as
/// rdma_cm does it (connect requests carrying an SRP_LOGIN_REQ, answered with an
/// SRP_LOGIN_RSP or SRP_LOGIN_REJ as private data).
pub trait Fabric {
    /// An IU buffer: registered memory of the fabric's own, [`IU_LEN`] bytes.
    type Iu: DerefMut<Target = [u8]>;
    /// Its queue-pair verbs, which hand out its IU buffers.
    type Verbs: Verbs<Buffer = SrpBuffer<Self::Iu>> + IuBuffers<Iu = Self::Iu>;
    /// A connect request.
    type Request;
    /// The verbs.
    fn verbs(&mut self) -> &mut Self::Verbs;
    /// Ready when something may have changed: a completion, a connect request, a
    /// disconnection.
    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<()>;
    /// The next connect request.
    fn next_request(&mut self) -> Option<Self::Request>;
    /// The login request it carries.
    fn login(&self, request: &Self::Request) -> Result<SrpLoginReq, IuError>;
    /// Accepts it: a queue pair with `receives` posted, answered with `private`.
    fn accept(
        &mut self,
        request: Self::Request,
        receives: Vec<SrpBuffer<Self::Iu>>,
        private: &[u8],
    ) -> Result<Qp<Self>, String>;
    /// Refuses it with `private`.
    fn reject(&mut self, request: Self::Request, private: &[u8]);
    /// A channel's queue pair is done with (disconnected, its completions taken): its
    /// resources go.
    fn release(&mut self, qp: Qp<Self>) {
        let _ = qp;
    }
    /// The portal, as the admin interface names it.
    fn portal(&self) -> String;
    /// The IP address and port it listens on, when the fabric has IP addressing (rdma_cm):
    /// what names its own terms in the config (`server.srp_ports`).
    fn address(&self) -> Option<SocketAddr> {
        None
    }
    /// The initiator's address and the one it reached, when the fabric has IP addressing
    /// (rdma_cm does; the software fabric does not): what network ACLs and the session list
    /// see.
    fn addresses(&self, request: &Self::Request) -> Option<(SocketAddr, SocketAddr)> {
        let _ = request;
        None
    }
}

/// Where a port's channels get their buffers: IUs from the fabric's verbs, data and long
/// parameter data from the port's share of the reactor's arena.
struct Slots<'a> {
    share: &'a Share,
    /// Counts the buffers given for immediate data.
    immediate: &'a std::sync::atomic::AtomicU64,
}

impl<V, I> Buffers<V, Buffer> for Slots<'_>
where
    V: Verbs<Buffer = SrpBuffer<I>> + IuBuffers<Iu = I>,
    I: DerefMut<Target = [u8]>,
{
    fn iu(&mut self, verbs: &mut V, iu: &[u8]) -> Option<SrpBuffer<I>> {
        let mut b = verbs.iu_buffer()?;
        let n = iu.len();
        if n > b.len() {
            verbs.recycle_iu(b);
            return None;
        }
        b[..n].copy_from_slice(iu);
        Some(PortBuffer::Iu(b))
    }

    fn data(&mut self, buffer: Buffer) -> SrpBuffer<I> {
        PortBuffer::Data(buffer)
    }

    fn task(&mut self, buffer: SrpBuffer<I>) -> Option<Buffer> {
        match buffer {
            PortBuffer::Data(b) => Some(b),
            PortBuffer::Iu(_) => None,
        }
    }

    fn immediate(&mut self, len: usize) -> Option<Buffer> {
        let b = self.share.try_alloc(len).ok().flatten()?;
        self.immediate.fetch_add(1, Ordering::Relaxed);
        Some(b)
    }

    fn payload(&mut self, verbs: &mut V, bytes: Vec<u8>) -> Option<SrpBuffer<I>> {
        if bytes.len() <= IU_LEN {
            return self.iu(verbs, &bytes);
        }
        let mut b = self.share.try_alloc(bytes.len()).ok()??;
        b[..bytes.len()].copy_from_slice(&bytes);
        Some(PortBuffer::Data(b))
    }

    fn table(&mut self, _: &mut V, len: usize) -> Option<SrpBuffer<I>> {
        Some(PortBuffer::Data(self.share.try_alloc(len).ok()??))
    }

    fn recycle(&mut self, verbs: &mut V, buffer: SrpBuffer<I>) {
        if let PortBuffer::Iu(b) = buffer {
            verbs.recycle_iu(b);
        }
    }
}

/// The length of every IU buffer: the largest IU an initiator may send (srp's
/// [`PortSettings`] default), which is also more than any IU the target sends.
pub const IU_LEN: usize = srp::verbs::IU_BUFFER_LEN;

/// A port on the software fabric: a [`Switch`] endpoint listening on a service name.
#[derive(Debug)]
pub struct FabricPort {
    endpoint: Endpoint<SrpBuffer<Vec<u8>>>,
    service: String,
}

impl FabricPort {
    /// The port of node `node` of `switch`, listening on `service`.
    pub fn listen(
        switch: &Arc<Switch>,
        node: NodeId,
        service: &str,
    ) -> Result<FabricPort, SwitchError> {
        switch.listen(node, service)?;
        Ok(FabricPort {
            endpoint: switch.endpoint(node),
            service: service.to_string(),
        })
    }
}

impl Drop for FabricPort {
    fn drop(&mut self) {
        self.endpoint.switch().unlisten(&self.service);
    }
}

impl Fabric for FabricPort {
    type Iu = Vec<u8>;
    type Verbs = Endpoint<SrpBuffer<Vec<u8>>>;
    type Request = ConnectRequest;

    fn verbs(&mut self) -> &mut Self::Verbs {
        &mut self.endpoint
    }

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<()> {
        self.endpoint.poll_ready(cx)
    }

    fn next_request(&mut self) -> Option<ConnectRequest> {
        self.endpoint.next_request(&self.service)
    }

    fn login(&self, request: &ConnectRequest) -> Result<SrpLoginReq, IuError> {
        match srp::Iu::decode(&request.private)? {
            srp::Iu::LoginReq(r) => Ok(r),
            other => Err(IuError::InvalidField {
                iu: other.iu_type(),
                tag: 0,
                field: "IU TYPE",
                reason: "a connect request carries an SRP_LOGIN_REQ",
            }),
        }
    }

    fn accept(
        &mut self,
        request: ConnectRequest,
        receives: Vec<SrpBuffer<Vec<u8>>>,
        private: &[u8],
    ) -> Result<Qp<Self>, String> {
        Ok(self.endpoint.accept(request, receives, private))
    }

    fn reject(&mut self, request: ConnectRequest, private: &[u8]) {
        self.endpoint.reject(request, private);
    }

    fn portal(&self) -> String {
        format!("fabric:{}", self.service)
    }
}

/// The core as a channel reaches it: the step every transport takes, with SRP's own calls.
impl Core for CoreStep<'_> {
    fn poll_core(&mut self) -> Option<Action> {
        loop {
            match self.out.local.pop_front()? {
                Routed::Action(a) => return Some(a),
                // The channel has the task from `submit`'s answer.
                Routed::Submitted { .. } => {}
            }
        }
    }

    fn submit(&mut self, cmd: Command<'_>) -> Result<TaskId, DeviceError> {
        self.core(|core, _, route, out| core.submit(cmd, route, out))
            .unwrap_or(Err(DeviceError::UnknownNexus))
    }
}

/// One logged-in channel.
struct Chan<Q> {
    driver: Driver<Q>,
    key: ItNexusKey,
    /// Its session in traces: its initiator port identifier, folded.
    trace_session: u64,
    target: Arc<Target>,
    nexus: NexusId,
    machine: Channel<Buffer>,
    route: Route,
    rx: mpsc::UnboundedReceiver<Routed>,
    out: Outbox,
    unit: Option<Arc<Lun>>,
    /// The channel is over (logged out or disconnected) and waits for its tasks to end.
    lost: bool,
    _slot: ConnectionSlot,
}

impl<Q> Chan<Q> {
    /// The core as this channel reaches it for one step.
    fn step(&mut self) -> (&mut Channel<Buffer>, CoreStep<'_>) {
        let (machine, _, step) = self.parts();
        (machine, step)
    }

    /// The machine, the driver of its queue pair, and the core as the channel reaches it.
    fn parts(&mut self) -> (&mut Channel<Buffer>, &mut Driver<Q>, CoreStep<'_>) {
        (
            &mut self.machine,
            &mut self.driver,
            CoreStep::new(
                Some((&self.target, self.nexus)),
                &self.route,
                &mut self.out,
                &mut self.unit,
            ),
        )
    }
}

/// A port: its fabric, its channels and what they wait for.
struct Port<F: Fabric> {
    fabric: F,
    io: Rc<Io>,
    registry: Arc<Registry>,
    portal: String,
    /// Its logins: what it offers (`server.srp_*`, read when it started) and its channels by
    /// I_T nexus.
    logins: Logins<u64>,
    channels: BTreeMap<u64, Chan<Qp<F>>>,
    /// The channel of each backend operation in flight, by its task.
    owners: HashMap<TaskId, u64>,
    inbox: Rc<Inbox>,
    /// The buffers channels wait for, from the port's share of the reactor's arena.
    waits: Waits,
    /// Asked to log every channel out (the daemon is stopping).
    logging_out: bool,
    /// Reused list of a channel's events, so a turn allocates nothing once warm.
    events: Vec<Event<Buffer>>,
}

/// What the SRP port at `address` offers at login, as `server` configures it: its own
/// `srp_ports` terms over the server's `srp_*` keys (the server's alone for a port without
/// an address, the software fabric's).
pub fn port_settings(server: &crate::config::Server, address: Option<SocketAddr>) -> PortSettings {
    let terms = server.srp_terms(address);
    PortSettings {
        max_it_iu_len: terms.max_iu_len.min(IU_LEN as u32),
        request_limit: terms.request_limit,
        immediate_data: terms.immediate_data,
        ..PortSettings::default()
    }
}

/// Starts an SRP port on `reactor`: `open` makes its fabric there (the reactor's arena and
/// runtime are what it registers and watches), then it serves until the daemon stops. Returns
/// once the port listens, or with the reason `open` gave.
pub fn start_port<F: Fabric + 'static>(
    reactor: &crate::reactor::Handle,
    registry: Arc<Registry>,
    open: impl FnOnce(&Io) -> Result<F, String> + Send + 'static,
) -> Result<(), String> {
    start_on(reactor, registry, open, serve)
}

/// Starts a port on `reactor` whose fabric `open` makes there, served by `run` (SRP's
/// [`serve`], or iSER's [`crate::iser::serve`]) until the daemon stops. Returns once the port
/// listens, or with the reason `open` gave.
pub fn start_on<F: Fabric + 'static, Fut: std::future::Future<Output = ()> + 'static>(
    reactor: &crate::reactor::Handle,
    registry: Arc<Registry>,
    open: impl FnOnce(&Io) -> Result<F, String> + Send + 'static,
    run: fn(F, Rc<Io>, Arc<Registry>) -> Fut,
) -> Result<(), String> {
    let (tx, rx) = std::sync::mpsc::channel();
    let spawned = reactor.spawn(Box::new(move |io| {
        Box::pin(async move {
            match open(&io) {
                Ok(port) => {
                    let _ = tx.send(Ok(()));
                    run(port, io, registry).await;
                }
                Err(e) => {
                    let _ = tx.send(Err(e));
                }
            }
        })
    }));
    if !spawned {
        return Err(format!("reactor {} is gone", reactor.index));
    }
    rx.recv()
        .map_err(|_| format!("reactor {} ended", reactor.index))?
}

/// Serves SRP on `fabric` until the daemon stops: the task a reactor runs for an SRP portal.
pub async fn serve<F: Fabric>(fabric: F, io: Rc<Io>, registry: Arc<Registry>) {
    let id = next_id();
    let control = Arc::new(Control::default());
    registry.register(id, control.clone());
    // Half the arena, as an iSCSI connection's share: the rest stays for the other
    // connections of the reactor.
    let share = Share::new(&io.arena, io.arena.len() / 2);
    let settings = port_settings(&registry.config().server, fabric.address());
    let mut port = Port {
        logins: Logins::new(settings),
        portal: fabric.portal(),
        fabric,
        io,
        registry: registry.clone(),
        channels: BTreeMap::new(),
        owners: HashMap::new(),
        inbox: Rc::new(Inbox::default()),
        waits: Waits::new(share),
        logging_out: false,
        events: Vec::with_capacity(256),
    };
    tracing::info!(portal = %port.portal, reactor = port.io.index, "SRP port listening");
    crate::port::serve(&mut port, &control).await;
    registry.unregister(id);
    tracing::info!(portal = %port.portal, "SRP port stopped");
}

impl<F: Fabric> crate::port::Port for Port<F> {
    fn accept(&mut self) -> bool {
        self.logins()
    }

    fn backend_completions(&mut self) -> bool {
        Port::backend_completions(self)
    }

    fn ids(&self, ids: &mut Vec<u64>) {
        ids.extend(self.channels.keys().copied());
    }

    fn step(&mut self, id: u64) -> bool {
        Port::step(self, id)
    }

    /// Ready when the fabric has news or another connection routed events to a channel
    /// (moved into the channel's outbox).
    fn poll_wake(&mut self, cx: &mut Context<'_>) -> Poll<()> {
        let mut any = self.fabric.poll_ready(cx).is_ready();
        for c in self.channels.values_mut() {
            any |= crate::port::take_routed(&mut c.rx, &mut c.out, cx);
        }
        if any {
            Poll::Ready(())
        } else {
            Poll::Pending
        }
    }

    fn inbox(&self) -> Rc<Inbox> {
        self.inbox.clone()
    }

    fn waits(&mut self) -> &mut Waits {
        &mut self.waits
    }

    fn granted(&mut self, w: Want, buffer: Option<Buffer>) {
        Port::granted(self, w, buffer)
    }

    fn log_out_all(&mut self) {
        self.logging_out = true;
        Port::log_out_all(self)
    }

    fn is_empty(&self) -> bool {
        self.channels.is_empty()
    }

    fn close_all(&mut self) {
        Port::close_all(self)
    }
}

/// What an SRP login asks of targetd beyond SRP's terms: the target its target port
/// identifier names (while the daemon is not stopping), whether the target admits the
/// initiator port, a connection slot (`server.max_connections`), the target's core for its
/// I_T nexus, and the port's channels for those a SINGLE CHANNEL login replaces.
struct PortPolicy<'a, Q> {
    registry: &'a Registry,
    stopping: bool,
    channels: &'a mut BTreeMap<u64, Chan<Q>>,
}

impl<Q> LoginPolicy<u64> for PortPolicy<'_, Q> {
    type Target = (Arc<Target>, ConnectionSlot);

    fn target(
        &mut self,
        req: &SrpLoginReq,
    ) -> Result<Self::Target, (LoginRejectReason, &'static str)> {
        let unable = |why| (LoginRejectReason::UnableToEstablishChannel, why);
        if self.stopping {
            return Err(unable("the daemon is stopping"));
        }
        let target = self
            .registry
            .targets()
            .into_iter()
            .find(|t| port_id(&t.name) == req.target_port_id)
            .ok_or(unable("no target has that target port identifier"))?;
        admits(&target, &req.initiator_port_id).map_err(unable)?;
        let slot = self.registry.open_connection().ok_or((
            LoginRejectReason::InsufficientResources,
            "server.max_connections connections are open",
        ))?;
        Ok((target, slot))
    }

    fn open_nexus(&mut self, (target, _): &Self::Target, req: &SrpLoginReq) -> NexusId {
        open_nexus(target, req)
    }

    fn close_nexus(&mut self, (target, _): &Self::Target, nexus: NexusId) {
        let mut out = Outbox::detached();
        target.core().close_session(nexus, &mut out);
    }

    fn terminate(&mut self, channel: u64) {
        if let Some(c) = self.channels.get_mut(&channel) {
            let (machine, mut step) = c.step();
            machine.terminate(TargetLogoutReason::MultiChannelAction, true, &mut step);
        }
    }
}

impl<F: Fabric> Port<F> {
    /// Decides the logins that have come.
    fn logins(&mut self) -> bool {
        let mut any = false;
        while let Some(request) = self.fabric.next_request() {
            any = true;
            let req = match self.fabric.login(&request) {
                Ok(r) => r,
                Err(e) => {
                    tracing::debug!(error = %e, "SRP connect request without a login request");
                    let rej = SrpLoginRej {
                        reason: LoginRejectReason::UnableToEstablishChannel,
                        tag: 0,
                        sup_buf_fmt: PortSettings::default().formats,
                    };
                    self.refuse(request, &rej, "not an SRP_LOGIN_REQ");
                    continue;
                }
            };
            self.login(request, &req);
        }
        any
    }

    fn refuse(&mut self, request: F::Request, rej: &SrpLoginRej, why: &str) {
        self.registry
            .srp_logins_rejected
            .fetch_add(1, Ordering::Relaxed);
        tracing::info!(portal = %self.portal, reason = ?rej.reason, "SRP login refused: {why}");
        let mut b = Vec::new();
        rej.encode(&mut b);
        self.fabric.reject(request, &b);
    }

    /// Accepts `req`, or refuses it with the reason.
    fn login(&mut self, request: F::Request, req: &SrpLoginReq) {
        let mut policy = PortPolicy {
            registry: &self.registry,
            stopping: self.logging_out,
            channels: &mut self.channels,
        };
        let accepted = match self.logins.login(req, &mut policy) {
            Ok(accepted) => accepted,
            Err(refusal) => return self.refuse(request, &refusal.reject, refusal.why),
        };
        let params = accepted.params;
        let receives: Option<Vec<_>> = (0..params.request_limit + SPARE_RECEIVES)
            .map(|_| self.fabric.verbs().iu_buffer().map(PortBuffer::Iu))
            .collect();
        let Some(receives) = receives else {
            self.logins.failed(accepted, &mut policy);
            let full = LoginRejectReason::InsufficientResources;
            let r = self.logins.settings().reject(req, full);
            self.refuse(request, &r, "no IU buffers left for its receives");
            return;
        };
        let mut b = Vec::new();
        accepted.response.encode(&mut b);
        let qp = match self.fabric.accept(request, receives, &b) {
            Ok(qp) => qp,
            Err(e) => {
                tracing::warn!(portal = %self.portal, "SRP accept: {e}");
                self.logins.failed(accepted, &mut policy);
                return;
            }
        };
        let id = next_id();
        self.logins.connected(&accepted, id);
        let Accepted {
            target: (target, slot),
            key,
            nexus,
            ..
        } = accepted;
        let (tx, rx) = mpsc::unbounded_channel();
        lock(&self.registry.srp_channels).insert(
            id,
            SrpChannelInfo {
                target: target.name.clone(),
                initiator_port_id: req.initiator_port_id,
                target_port_id: req.target_port_id,
                portal: self.portal.clone(),
                reactor: self.io.index,
                request_limit: params.request_limit,
                iu_lengths: (params.max_it_iu_len, params.max_ti_iu_len),
                nexus,
            },
        );
        tracing::info!(
            portal = %self.portal,
            initiator = %hex(&req.initiator_port_id),
            target = %target.name,
            "SRP channel logged in"
        );
        let route = Route { conn: id, tx };
        // The nexus's unit attentions are reported at once (SRP_AER_REQ) on its newest
        // channel.
        if let Err(e) = target.core().announce_to(nexus, Some(route.clone())) {
            tracing::warn!(portal = %self.portal, "SRP asynchronous events: {e}");
        }
        self.channels.insert(
            id,
            Chan {
                driver: Driver::new(qp),
                key,
                trace_session: cmdtrace::Record::session_of_port(req.initiator_port_id),
                target,
                nexus,
                machine: Channel::new(nexus, params),
                route,
                rx,
                out: Outbox::new(id),
                unit: None,
                lost: false,
                _slot: slot,
            },
        );
    }

    /// Hands finished backend operations to their channels.
    fn backend_completions(&mut self) -> bool {
        let mut any = false;
        loop {
            let Some(done) = self.inbox.done.borrow_mut().pop_front() else {
                break;
            };
            any = true;
            let owner = self.owners.remove(&done.task);
            let Some(c) = owner.and_then(|id| self.channels.get_mut(&id)) else {
                continue;
            };
            let (machine, mut step) = c.step();
            machine.handle_backend_done(
                Instant::now(),
                done.task,
                done.buffer,
                done.result,
                &mut step,
            );
        }
        any
    }

    /// One channel's completions, core actions, transmissions and events; its end once it is
    /// over and idle.
    fn step(&mut self, id: u64) -> bool {
        let now = Instant::now();
        let Some(c) = self.channels.get_mut(&id) else {
            return false;
        };
        let mut progress = false;
        let mut broken = None;
        let mut slots = Slots {
            share: self.waits.share(),
            immediate: &self.registry.srp_immediate_writes,
        };
        let verbs = self.fabric.verbs();
        let (machine, driver, mut step) = c.parts();
        let qp = driver.qp();
        while let Some(wc) = verbs.poll(qp) {
            progress = true;
            if let Err(e) = driver.complete(now, wc, machine, &mut step, verbs, &mut slots) {
                broken = Some(e);
            }
        }
        if !step.out.local.is_empty() {
            progress = true;
            machine.handle_core(now, &mut step);
        }
        match driver.transmit(now, machine, &mut step, verbs, &mut slots) {
            Ok(any) => progress |= any,
            Err(e) => broken = Some(e),
        }
        drop(step);
        if let Some(why) = broken {
            tracing::warn!(portal = %self.portal, "SRP channel disconnected: {why}");
            verbs.disconnect(qp);
        }
        let mut events = std::mem::take(&mut self.events);
        while let Some(e) = c.machine.poll_event() {
            progress = true;
            events.push(e);
        }
        crate::trace::record_points(c.machine.trace_points(), c.trace_session, &self.io);
        for e in events.drain(..) {
            self.event(id, e);
        }
        self.events = events;
        progress | self.end_if_over(id)
    }

    /// Carries out what a channel asked.
    fn event(&mut self, id: u64, e: Event<Buffer>) {
        let Some(c) = self.channels.get_mut(&id) else {
            return;
        };
        match e {
            Event::Backend {
                task,
                lun,
                op,
                buffer,
            } => match crate::target::unit_for(&mut c.unit, Some(&c.target), lun) {
                Some(unit) => {
                    self.owners.insert(task, id);
                    self.io.submit(&unit, op, buffer, &self.inbox, task);
                }
                None => {
                    let (machine, mut step) = c.step();
                    let gone = Err(BackendError::Internal);
                    machine.handle_backend_done(Instant::now(), task, buffer, gone, &mut step);
                }
            },
            // A buffer for a backend operation or for a command's data-out: the channel
            // knows which.
            Event::BufferWanted { tag, len } => self.want(Want {
                conn: id,
                tag,
                len,
                data_out: false,
            }),
            Event::Completed(a) => c.target.account(&a),
        }
    }

    /// A buffer now if the arena has room and nobody waits before, else in turn.
    fn want(&mut self, w: Want) {
        if let Some(b) = self.waits.want(w) {
            self.granted(w, b);
        }
    }

    /// Gives a channel the buffer it waited for (`None`: none can ever be had).
    fn granted(&mut self, w: Want, buffer: Option<Buffer>) {
        let Some(c) = self.channels.get_mut(&w.conn) else {
            return;
        };
        let now = Instant::now();
        let (machine, mut step) = c.step();
        machine.handle_buffer(now, w.tag, buffer, &mut step);
    }

    /// Ends a channel that is over once its tasks have: it leaves the table, its nexus
    /// closes with its last channel.
    fn end_if_over(&mut self, id: u64) -> bool {
        let Some(c) = self.channels.get_mut(&id) else {
            return false;
        };
        let qp = c.driver.qp();
        let disconnected = self.fabric.verbs().is_error(qp);
        if c.machine.closing().is_none() && !disconnected && !c.lost {
            return false;
        }
        if disconnected && !c.lost {
            // Its commands still in the core are aborted (the nexus may go on with other
            // channels; if not, it closes once this channel is idle and has left).
            c.lost = true;
            let (machine, mut step) = c.step();
            machine.close(false, &mut step);
        }
        if !c.machine.is_idle() {
            return false;
        }
        let Some(c) = self.channels.remove(&id) else {
            return false;
        };
        let verbs = self.fabric.verbs();
        if !disconnected {
            verbs.disconnect(qp);
        }
        // What the disconnection flushed comes back before the queue pair goes.
        while let Some(wc) = verbs.poll(qp) {
            if let PortBuffer::Iu(b) = wc.buffer {
                verbs.recycle_iu(b);
            }
        }
        self.fabric.release(qp);
        lock(&self.registry.srp_channels).remove(&id);
        match self.logins.leave(c.key, &id) {
            Left::Ended(nexus) => {
                let mut out = Outbox::detached();
                c.target.core().close_session(nexus, &mut out);
            }
            Left::Stays => {
                // The nexus's asynchronous events go on another of its channels.
                let next = self.logins.channels(&c.key).first().copied();
                let route = next
                    .and_then(|n| self.channels.get(&n))
                    .map(|n| n.route.clone());
                let _ = c.target.core().announce_to(c.nexus, route);
            }
            Left::Unknown => {}
        }
        tracing::info!(portal = %self.portal, target = %c.target.name, "SRP channel ended");
        true
    }

    /// Logs channel `id` out (the daemon is stopping).
    fn log_out(&mut self, id: u64) {
        if let Some(c) = self.channels.get_mut(&id) {
            let (machine, mut step) = c.step();
            machine.terminate(TargetLogoutReason::NoReason, false, &mut step);
        }
    }

    fn log_out_all(&mut self) {
        let ids: Vec<u64> = self.channels.keys().copied().collect();
        for id in ids {
            self.log_out(id);
        }
    }

    /// Disconnects what is left (the daemon's drain is over).
    fn close_all(&mut self) {
        for (id, c) in std::mem::take(&mut self.channels) {
            self.fabric.verbs().disconnect(c.driver.qp());
            self.fabric.release(c.driver.qp());
            lock(&self.registry.srp_channels).remove(&id);
            if let Left::Ended(nexus) = self.logins.leave(c.key, &id) {
                let mut out = Outbox::detached();
                c.target.core().close_session(nexus, &mut out);
            }
        }
    }
}

/// Opens the I_T nexus of `req`'s initiator port on the target's SRP port (added to its
/// device at the first SRP login).
fn open_nexus(target: &Target, req: &SrpLoginReq) -> NexusId {
    let mut core = target.core();
    let port = scsi_core::TargetPort::srp(&target.name, req.target_port_id, RELATIVE_PORT);
    core.device.add_port(port);
    core.device
        .open_nexus(TransportId::srp(req.initiator_port_id), RELATIVE_PORT)
}

/// Whether the target admits an SRP initiator port: a target with CHAP admits none (SRP has
/// no authentication); one with `srp_initiators` the ports it names; one with only an
/// iSCSI `initiators` list none; one with neither, any.
fn admits(target: &Target, initiator: &[u8; 16]) -> Result<(), &'static str> {
    let config = target
        .config
        .read()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    if config.chap.is_some() {
        return Err("the target requires CHAP, which SRP cannot do");
    }
    let me = hex(initiator);
    if !config.srp_initiators.is_empty() {
        if !config
            .srp_initiators
            .iter()
            .any(|i| i.eq_ignore_ascii_case(&me))
        {
            return Err("the target's srp_initiators do not name the initiator port");
        }
    } else if !config.initiators.is_empty() {
        return Err("the target admits only the iSCSI initiators it names");
    }
    Ok(())
}
