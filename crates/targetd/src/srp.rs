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

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::ops::DerefMut;
use std::rc::Rc;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Instant;

use crate::target::CoreStep;
use ::rdma::verbs::{MessageBuffers, PortBuffer, Verbs};
use backend::{Buffer, Share};
use scsi_core::{Action, BackendError, Command, DeviceError, NexusId, TaskId, TransportId};
use srp::iu::{IuError, LoginRejectReason, SrpLoginRej, SrpLoginReq, TargetLogoutReason};
use srp::target_port::channel::SPARE_RECEIVES;
use srp::target_port::{
    Accepted, Buffers, Channel, Core, Driver, Event, ItNexusKey, Left, LoginPolicy, Logins,
    PortSettings,
};
use tokio::sync::mpsc;

use crate::carrier::{Carried, Carrier, Want};
use crate::fabric::{Fabric, FabricBuffer, Qp, MESSAGE_LEN};
use crate::lock;
use crate::reactor::Io;
use crate::registry::{ConnectionSlot, Registry, SrpChannelInfo};
use crate::target::{Outbox, Route, Routed, Target, SRP_RELATIVE_PORT};
use crate::unit::{next_id, CachedUnit, UnitCache};

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

/// The SRP_LOGIN_REQ a connect request carries as its private data: in the layout Linux's
/// ib_srp and ib_srpt use over rdma_cm (`rdma_cm`), or as a whole IU (the software switch).
fn login_request(private: &[u8], rdma_cm: bool) -> Result<SrpLoginReq, IuError> {
    if rdma_cm {
        return SrpLoginReq::decode_rdma_cm(private);
    }
    match srp::Iu::decode(private)? {
        srp::Iu::LoginReq(r) => Ok(r),
        other => Err(IuError::InvalidField {
            iu: other.iu_type(),
            tag: 0,
            field: "IU TYPE",
            reason: "a connect request carries an SRP_LOGIN_REQ",
        }),
    }
}

/// Channels one SRP port on a device serves at once: its message slots are sized for them
/// (each channel holds a receive per credit, and as many sends in flight at most).
#[cfg(feature = "rdma")]
pub const CHANNELS: u32 = 16;

/// Opens the RDMA device that serves `addr` for an SRP port offering `settings`, with
/// message slots and queue depths for [`CHANNELS`] channels at its request limit. Call on the
/// reactor whose arena it is (the watchers are its runtime's).
#[cfg(feature = "rdma")]
pub fn rdma_port(
    addr: SocketAddr,
    arena: &backend::Arena,
    settings: &PortSettings,
) -> Result<crate::fabric::device::RdmaPort, ::rdma::ibverbs::RdmaError> {
    let per_channel = 2 * (settings.request_limit + SPARE_RECEIVES) + 8;
    let depth = ::rdma::ibverbs::QueueDepth {
        // A response per credit, and RDMA transfers of one request per descriptor.
        send: 4096,
        recv: settings.request_limit + SPARE_RECEIVES,
    };
    crate::fabric::device::RdmaPort::open(addr, arena, CHANNELS * per_channel, depth)
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
    V: Verbs<Buffer = FabricBuffer<I>> + MessageBuffers<Message = I>,
    I: DerefMut<Target = [u8]>,
{
    fn iu(&mut self, verbs: &mut V, iu: &[u8]) -> Option<FabricBuffer<I>> {
        let mut b = verbs.message_buffer()?;
        let n = iu.len();
        if n > b.len() {
            verbs.recycle_message(b);
            return None;
        }
        b[..n].copy_from_slice(iu);
        Some(PortBuffer::Message(b))
    }

    fn data(&mut self, buffer: Buffer) -> FabricBuffer<I> {
        PortBuffer::Data(buffer)
    }

    fn task(&mut self, buffer: FabricBuffer<I>) -> Option<Buffer> {
        match buffer {
            PortBuffer::Data(b) => Some(b),
            PortBuffer::Message(_) => None,
        }
    }

    fn immediate(&mut self, len: usize) -> Option<Buffer> {
        let b = self.share.try_alloc(len).ok().flatten()?;
        self.immediate.fetch_add(1, Ordering::Relaxed);
        Some(b)
    }

    fn payload(&mut self, verbs: &mut V, bytes: Vec<u8>) -> Option<FabricBuffer<I>> {
        if bytes.len() <= MESSAGE_LEN {
            return self.iu(verbs, &bytes);
        }
        let mut b = self.share.try_alloc(bytes.len()).ok()??;
        b[..bytes.len()].copy_from_slice(&bytes);
        Some(PortBuffer::Data(b))
    }

    fn table(&mut self, _: &mut V, len: usize) -> Option<FabricBuffer<I>> {
        Some(PortBuffer::Data(self.share.try_alloc(len).ok()??))
    }

    fn recycle(&mut self, verbs: &mut V, buffer: FabricBuffer<I>) {
        if let PortBuffer::Message(b) = buffer {
            verbs.recycle_message(b);
        }
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
        self.core(|core, _, route, out| core.router().submit(cmd, route, out))
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
    /// The target's units as this channel last found them.
    units: UnitCache<u16>,
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
                &mut self.units,
            ),
        )
    }
}

impl<Q> Carried for Chan<Q> {
    fn account(&mut self, done: &scsi_core::transport::Accounting) {
        self.target.account(&mut self.units, done);
    }

    fn unit(&mut self, lun: u16) -> Option<CachedUnit<'_>> {
        self.target.cached_lun(&mut self.units, lun)
    }

    fn backend_done(
        &mut self,
        now: Instant,
        task: TaskId,
        buffer: Buffer,
        result: Result<scsi_core::Output, BackendError>,
    ) {
        let (machine, mut step) = self.step();
        machine.handle_backend_done(now, task, buffer, result, &mut step);
    }

    fn buffer(&mut self, now: Instant, tag: u64, buffer: Option<Buffer>) {
        let (machine, mut step) = self.step();
        machine.handle_buffer(now, tag, buffer, &mut step);
    }
}

/// A port: its fabric, its channels and what they wait for.
struct Port<F: Fabric> {
    fabric: F,
    registry: Arc<Registry>,
    portal: String,
    /// Its logins: what it offers (`server.srp_*`, read when it started) and its channels by
    /// I_T nexus.
    logins: Logins<u64>,
    channels: BTreeMap<u64, Chan<Qp<F>>>,
    /// Carries out its channels' events on the reactor; the buffers they wait for come
    /// from the port's share of the reactor's arena.
    carrier: Carrier,
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
        max_it_iu_len: terms.max_iu_len.min(MESSAGE_LEN as u32),
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
    crate::port::start_on(reactor, registry, open, serve)
}

/// Serves SRP on `fabric` until the daemon stops: the task a reactor runs for an SRP portal.
pub async fn serve<F: Fabric>(fabric: F, io: Rc<Io>, registry: Arc<Registry>) {
    let settings = port_settings(&registry.config().server, fabric.address());
    let portal = fabric.portal();
    let mut port = Port {
        logins: Logins::new(settings),
        portal: portal.clone(),
        fabric,
        carrier: crate::port::shared_carrier(io),
        registry: registry.clone(),
        channels: BTreeMap::new(),
        logging_out: false,
        events: Vec::with_capacity(256),
    };
    crate::port::run(&mut port, &registry, "SRP port", &portal).await;
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

    fn carrier(&mut self) -> &mut Carrier {
        &mut self.carrier
    }

    fn granted(&mut self, w: Want, buffer: Option<Buffer>) {
        if let Some(c) = self.channels.get_mut(&w.conn) {
            c.buffer(Instant::now(), w.tag, buffer);
        }
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
        target.srp_port().ok_or(unable(
            "this gateway's port group leaves no SRP relative port identifier (above 32767)",
        ))?;
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
        target.with_core(|core, out| core.close_session(nexus, out));
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
            let req = match login_request(self.fabric.private(&request), F::RDMA_CM) {
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
            .counters
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
            .map(|_| {
                self.fabric
                    .verbs()
                    .message_buffer()
                    .map(PortBuffer::Message)
            })
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
                reactor: self.carrier.io().index,
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
        let route = Route::new(id, tx);
        // The nexus's unit attentions are reported at once (SRP_AER_REQ) on its newest
        // channel.
        let announced =
            target.with_core(|core, _| core.router().announce_to(nexus, Some(route.clone())));
        if let Err(e) = announced {
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
                units: UnitCache::default(),
                lost: false,
                _slot: slot,
            },
        );
    }

    /// Hands finished backend operations to their channels.
    fn backend_completions(&mut self) -> bool {
        self.carrier.deliver_all(&mut self.channels)
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
            share: self.carrier.waits.share(),
            immediate: &self.registry.counters.srp_immediate_writes,
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
        crate::trace::record_points(c.machine.trace_points(), c.trace_session, self.carrier.io());
        for e in events.drain(..) {
            self.event(now, id, e);
        }
        self.events = events;
        progress | self.end_if_over(id)
    }

    /// Carries out what a channel asked.
    fn event(&mut self, now: Instant, id: u64, e: Event<Buffer>) {
        if let Some(c) = self.channels.get_mut(&id) {
            self.carrier.carry(now, id, c, e);
        }
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
            if let PortBuffer::Message(b) = wc.buffer {
                verbs.recycle_message(b);
            }
        }
        self.fabric.release(qp);
        lock(&self.registry.srp_channels).remove(&id);
        match self.logins.leave(c.key, &id) {
            Left::Ended(nexus) => {
                c.target
                    .with_core(|core, out| core.close_session(nexus, out));
            }
            Left::Stays => {
                // The nexus's asynchronous events go on another of its channels.
                let next = self.logins.channels(&c.key).first().copied();
                let route = next
                    .and_then(|n| self.channels.get(&n))
                    .map(|n| n.route.clone());
                let _ = c
                    .target
                    .with_core(|core, _| core.router().announce_to(c.nexus, route));
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
                c.target
                    .with_core(|core, out| core.close_session(nexus, out));
            }
        }
    }
}

/// Opens the I_T nexus of `req`'s initiator port on the target's SRP port
/// ([`Target::srp_port`], added to its device at the first SRP login).
fn open_nexus(target: &Target, req: &SrpLoginReq) -> NexusId {
    // A target without one was refused by the policy's target check.
    let lone = (SRP_RELATIVE_PORT, SRP_RELATIVE_PORT);
    let (relative, group) = target.srp_port().unwrap_or(lone);
    let mut port = scsi_core::TargetPort::srp(&target.name, req.target_port_id, relative);
    port.port_group = group;
    target.with_core(|core, _| {
        let router = core.router();
        router.add_port(port);
        router.open_nexus(TransportId::srp(req.initiator_port_id), relative)
    })
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_ports_own_terms_reach_its_login_settings() {
        let text = "[server]\nportals = [\"127.0.0.1:3260\"]\nsrp_request_limit = 100\n";
        let mut c = crate::config::Config::parse(std::path::Path::new("config.toml"), text)
            .expect("a good config");
        // As the config of a port at that address (which a build without RDMA refuses to
        // name among its portals) sets them.
        let terms = crate::config::SrpPortTerms {
            max_iu_len: Some(4196),
            request_limit: None,
            immediate_data: Some(false),
        };
        c.server.srp_ports.insert("10.0.0.1:5555".into(), terms);
        let at = |a: &str| Some(a.parse::<SocketAddr>().expect("an address"));
        let s = port_settings(&c.server, at("10.0.0.1:5555"));
        assert_eq!(
            (s.max_it_iu_len, s.request_limit, s.immediate_data),
            (4196, 100, false)
        );
        // Another port, and the software fabric (no address), have the server's terms.
        for other in [at("10.0.0.2:5555"), None] {
            let s = port_settings(&c.server, other);
            assert_eq!(
                (s.max_it_iu_len, s.request_limit, s.immediate_data),
                (8276, 100, true)
            );
        }
    }

    #[test]
    fn a_login_request_is_read_in_the_fabrics_form() {
        let req = SrpLoginReq {
            tag: 7,
            ..SrpLoginReq::default()
        };
        let mut whole = Vec::new();
        req.encode(&mut whole);
        assert_eq!(login_request(&whole, false).map(|r| r.tag), Ok(7));
        let mut cm = Vec::new();
        req.encode_rdma_cm(&mut cm);
        assert_eq!(login_request(&cm, true).map(|r| r.tag), Ok(7));
        // Anything else is refused, not taken for a login.
        assert!(login_request(&whole[..10], false).is_err());
        assert!(login_request(&cm[..10], true).is_err());
    }
}
