//! NVMe/RDMA portals (NVM Express RDMA Transport Specification 1.0b): the I/O shell around
//! crates/nvme's controller connection over its RDMA queue machine
//! ([`nvme::rdma::ControllerConnection`]), on a [`Fabric`] (rdma_cm's, or the software
//! fabric's), all of a portal's queues in one task on one reactor as an SRP port's channels
//! and an iSER portal's connections run.
//!
//! A host's connect request carries the queue's terms (QID, HSQSIZE, HRQSIZE); the portal
//! checks them ([`QueueTerms::negotiate`]), posts a receive for every command the host may
//! have outstanding, and accepts with its receive queue size, or rejects naming the field.
//! Each receive is a command capsule for the machine; what the machine asks is posted on
//! the queue pair in order: RDMA READ of a write's data from the host memory its keyed SGL
//! names straight into the arena slots the backend then writes from, RDMA WRITE of a read's
//! data from the slots the backend filled, the response capsule in a SEND behind it. Nothing
//! is registered per I/O. The subsystem a Connect names, the admin commands, keep alive,
//! asynchronous events and reservations are the same code as NVMe/TCP's
//! ([`super::queue::take_arrivals`], the subsystem machine).
//!
//! NVMe has no logout: when the daemon stops, or the admin interface closes a queue, its
//! queue pair is disconnected and the host reconnects (Linux: `ctrl_loss_tmo`).

use std::collections::{BTreeMap, HashMap};
use std::net::SocketAddr;
use std::rc::Rc;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use backend::Buffer;
use nvme::rdma::{
    CmReject, CmRequest, ControllerConnection, Keyed, QueueLimits, QueueTerms, RdmaQueue, Work,
};
use rdma::verbs::{MessageBuffers, PortBuffer, RemoteRegion, Verbs, WorkOp};
use scsi_core::transport::Accounting;
use scsi_core::{BackendError, Output, TaskId};
use tokio::sync::watch;

use super::queue::Link;
use super::NvmeSubsystem;
use crate::carrier::{Carried, Carrier, Want};
use crate::control::{Control, Request};
use crate::fabric::{Fabric, FabricBuffer, Qp, NO_ADDRESS, NVME_MAX_IN_CAPSULE_DATA};
use crate::port::{Post, SendQueue};
use crate::reactor::Io;
use crate::registry::{ConnectionSlot, Registry};
use crate::unit::{next_id, CachedUnit, UnitCache};

/// The most entries an I/O queue over RDMA takes (`nvme.queue_entries` when smaller): each is
/// a receive buffer posted for the queue's life. Linux's host asks 128.
pub const MAX_IO_ENTRIES: u16 = 128;

/// The admin queue's entries: Linux's host asks 32 (NVME_AQ_DEPTH).
pub const ADMIN_ENTRIES: u16 = 32;

/// Work requests one queue has on its send queue at most (SENDs, RDMA WRITEs and READs);
/// more wait in its queue.
const SEND_DEPTH: usize = 512;

/// Queues one portal serves at once (a host has an admin queue and one I/O queue per CPU):
/// its message buffers are sized for them.
pub const QUEUES: u32 = 32;

/// How often the portal looks at its queues' timers (keep alive), asynchronous events and
/// controls when nothing else wakes it.
const TICK: Duration = Duration::from_millis(50);

/// How long a queue whose queue pair is gone waits for its commands' block operations before
/// its buffers go anyway.
const DRAIN_TIMEOUT: Duration = Duration::from_secs(30);

/// Message buffers (for all queues) and each queue pair's depths of an NVMe/RDMA portal.
#[cfg(feature = "rdma")]
pub fn rdma_sizes(registry: &Registry) -> (u32, rdma::ibverbs::QueueDepth) {
    let recv = u32::from(io_entries(registry).max(ADMIN_ENTRIES));
    let depth = rdma::ibverbs::QueueDepth {
        send: SEND_DEPTH as u32,
        recv,
    };
    (QUEUES * (recv + 64), depth)
}

/// The entries an I/O queue over RDMA may have.
fn io_entries(registry: &Registry) -> u16 {
    registry.config().nvme.queue_entries.min(MAX_IO_ENTRIES)
}

/// One queue of a portal.
struct Conn<Q> {
    qp: Q,
    /// The host's address (rdma_cm's), or none on the software fabric.
    peer: SocketAddr,
    machine: ControllerConnection<Buffer>,
    /// The subsystem its Connect named.
    subsystem: Option<Arc<NvmeSubsystem>>,
    /// Tells of asynchronous events and Preempt and Abort's waits in the subsystem.
    events: Option<watch::Receiver<u64>>,
    /// The subsystem said something may wait for this queue.
    poked: bool,
    /// The subsystem's namespaces as this queue last found them.
    units: UnitCache<u32>,
    /// The work the machine asked for, posted or waiting for a message buffer or room on the
    /// send queue.
    sends: SendQueue<Work<Buffer>>,
    /// RDMA READs of command data in flight: the command's CID, by work request id.
    reads: HashMap<u64, u16>,
    /// The RDMA READ of a Connect's data in flight, by work request id.
    fetching: Option<u64>,
    /// The queue pair is gone (or is being taken down): the queue's commands end, then it
    /// goes.
    lost: bool,
    /// Disconnected, and its controller told.
    torn_down: Option<Instant>,
    control: Arc<Control>,
    /// The task space it holds among the portal's queues.
    space: u16,
    _slot: ConnectionSlot,
}

impl<Q> Conn<Q> {
    fn link(&mut self) -> Link<'_, RdmaQueue<Buffer>> {
        Link {
            machine: &mut self.machine,
            subsystem: self.subsystem.as_deref(),
            units: &mut self.units,
        }
    }
}

/// What the carrier hands a queue: its machine and subsystem, as an NVMe/TCP connection's.
impl<Q> Carried for Conn<Q> {
    fn account(&mut self, done: &Accounting) {
        self.link().account(done);
    }

    fn unit(&mut self, lun: u16) -> Option<CachedUnit<'_>> {
        self.subsystem
            .as_deref()?
            .cached_namespace(&mut self.units, u32::from(lun))
    }

    fn backend_done(
        &mut self,
        now: Instant,
        task: TaskId,
        buffer: Buffer,
        result: Result<Output, BackendError>,
    ) {
        self.link().backend_done(now, task, buffer, result);
    }

    fn buffer(&mut self, now: Instant, tag: u64, buffer: Option<Buffer>) {
        self.link().buffer(now, tag, buffer);
    }
}

/// A portal: its fabric and its queues.
struct Portal<F: Fabric> {
    fabric: F,
    registry: Arc<Registry>,
    portal: String,
    conns: BTreeMap<u64, Conn<Qp<F>>>,
    /// Carries out its queues' events on the reactor; the buffers they wait for come from
    /// the portal's share of the reactor's arena.
    carrier: Carrier,
    logging_out: bool,
    next_wr: u64,
}

/// Serves NVMe/RDMA on `fabric` until the daemon stops: the task a reactor runs for a portal.
pub async fn serve<F: Fabric>(fabric: F, io: Rc<Io>, registry: Arc<Registry>) {
    let portal = fabric.portal_of("nvme-rdma");
    let mut p = Portal {
        portal: portal.clone(),
        fabric,
        carrier: crate::port::shared_carrier(io),
        registry: registry.clone(),
        conns: BTreeMap::new(),
        logging_out: false,
        next_wr: 1,
    };
    crate::port::run(&mut p, &registry, "NVMe/RDMA portal", &portal).await;
}

impl<F: Fabric> crate::port::Port for Portal<F> {
    fn accept(&mut self) -> bool {
        self.accept_all()
    }

    fn backend_completions(&mut self) -> bool {
        self.carrier.deliver_all(&mut self.conns)
    }

    fn ids(&self, ids: &mut Vec<u64>) {
        ids.extend(self.conns.keys().copied());
    }

    fn step(&mut self, id: u64) -> bool {
        let now = Instant::now();
        let mut progress = self.completions(id);
        progress |= self.machine_step(id, now);
        progress |= self.post_work(id);
        progress | self.end_if_over(id, now)
    }

    fn poll_wake(&mut self, cx: &mut Context<'_>) -> Poll<()> {
        self.fabric.poll_ready(cx)
    }

    fn carrier(&mut self) -> &mut Carrier {
        &mut self.carrier
    }

    fn granted(&mut self, w: Want, buffer: Option<Buffer>) {
        if let Some(c) = self.conns.get_mut(&w.conn) {
            c.machine.handle_buffer(Instant::now(), w.tag, buffer);
        }
    }

    /// NVMe has no logout: every queue is disconnected, and its host reconnects.
    fn log_out_all(&mut self) {
        self.logging_out = true;
        for c in self.conns.values_mut() {
            c.lost = true;
        }
    }

    fn is_empty(&self) -> bool {
        self.conns.is_empty()
    }

    fn close_all(&mut self) {
        let ids: Vec<u64> = self.conns.keys().copied().collect();
        for id in ids {
            if let Some(c) = self.conns.get_mut(&id) {
                c.lost = true;
            }
            self.end_if_over(id, Instant::now());
            if let Some(mut c) = self.conns.remove(&id) {
                if let Some(s) = c.subsystem.clone() {
                    s.with_machine(|m| c.machine.abandon(m));
                }
                self.fabric.release(c.qp);
                self.registry.unregister(id);
            }
        }
    }

    /// Queues keep timers (keep alive on the admin queue), wait for the subsystem's
    /// asynchronous events, and may be asked to close through the admin interface.
    fn tick(&self) -> Option<Duration> {
        Some(TICK)
    }
}

impl<F: Fabric> Portal<F> {
    /// The queue limits the portal's subsystems give over RDMA.
    fn limits(&self) -> QueueLimits {
        QueueLimits {
            admin_entries: ADMIN_ENTRIES,
            io_entries: io_entries(&self.registry),
            max_qid: self.registry.config().nvme.max_io_queues,
        }
    }

    /// A task space no live queue of the portal holds.
    fn free_space(&self) -> Option<u16> {
        let taken: std::collections::BTreeSet<u16> = self.conns.values().map(|c| c.space).collect();
        (1..=u16::MAX).find(|s| !taken.contains(s))
    }

    /// Accepts the connect requests that have come: each queue's terms checked, its receives
    /// posted; Connect decides the rest.
    fn accept_all(&mut self) -> bool {
        let mut any = false;
        while let Some(request) = self.fabric.next_request() {
            any = true;
            let refuse = |p: &mut Self, request, status, why: &str| {
                tracing::info!(portal = %p.portal, "NVMe/RDMA queue refused: {why}");
                p.fabric.reject(request, &CmReject::new(status).encode());
            };
            if self.logging_out || self.registry.stopping() {
                refuse(
                    self,
                    request,
                    nvme::rdma::RejectStatus::NoResources,
                    "the daemon is stopping",
                );
                continue;
            }
            let terms = CmRequest::decode(self.fabric.private(&request))
                .and_then(|r| QueueTerms::negotiate(&r, &self.limits()));
            let terms = match terms {
                Ok(t) => t,
                Err(status) => {
                    let why = format!("its terms: {status:?}");
                    refuse(self, request, status, &why);
                    continue;
                }
            };
            let Some(space) = self.free_space() else {
                refuse(
                    self,
                    request,
                    nvme::rdma::RejectStatus::NoResources,
                    "no task space left",
                );
                continue;
            };
            let Some(slot) = self.registry.open_connection() else {
                refuse(
                    self,
                    request,
                    nvme::rdma::RejectStatus::NoResources,
                    "server.max_connections connections are open",
                );
                continue;
            };
            let (peer, local) = self
                .fabric
                .addresses(&request)
                .unwrap_or((NO_ADDRESS, NO_ADDRESS));
            let receives: Option<Vec<_>> = (0..terms.entries)
                .map(|_| {
                    self.fabric
                        .verbs()
                        .message_buffer()
                        .map(PortBuffer::Message)
                })
                .collect();
            let Some(receives) = receives else {
                refuse(
                    self,
                    request,
                    nvme::rdma::RejectStatus::NoResources,
                    "no message buffers left for its receives",
                );
                continue;
            };
            let qp = match self
                .fabric
                .accept(request, receives, &terms.accept().encode())
            {
                Ok(qp) => qp,
                Err(e) => {
                    tracing::warn!(portal = %self.portal, "NVMe/RDMA accept: {e}");
                    continue;
                }
            };
            let id = next_id();
            let control = Arc::new(Control::default());
            self.registry.register(id, control.clone());
            let in_capsule = self
                .registry
                .config()
                .nvme
                .in_capsule_data_size
                .min(NVME_MAX_IN_CAPSULE_DATA);
            let mut machine = ControllerConnection::on(RdmaQueue::new(in_capsule));
            machine.set_task_space(space);
            if local != NO_ADDRESS {
                machine.set_local_address(local.ip());
            }
            tracing::debug!(portal = %self.portal, id, qid = terms.qid, entries = terms.entries, "NVMe/RDMA queue accepted");
            self.conns.insert(
                id,
                Conn {
                    qp,
                    peer,
                    machine,
                    subsystem: None,
                    events: None,
                    poked: false,
                    units: UnitCache::default(),
                    sends: SendQueue::new(SEND_DEPTH),
                    reads: HashMap::new(),
                    fetching: None,
                    lost: false,
                    torn_down: None,
                    control,
                    space,
                    _slot: slot,
                },
            );
        }
        any
    }

    /// Takes the queue pair's completions: capsules into the machine (their receives posted
    /// again at once), finished reads handed back, finished sends and writes let go.
    fn completions(&mut self, id: u64) -> bool {
        let mut progress = false;
        loop {
            let Some(c) = self.conns.get_mut(&id) else {
                return progress;
            };
            let qp = c.qp;
            let Some(wc) = self.fabric.verbs().poll(qp) else {
                return progress;
            };
            progress = true;
            let ok = wc.result.is_ok();
            if wc.op != WorkOp::Recv {
                c.sends.completed();
            }
            if !ok && !c.lost {
                tracing::debug!(portal = %self.portal, id, op = ?wc.op, "NVMe/RDMA work request failed: {:?}", wc.result);
                c.lost = true;
            }
            match (wc.op, wc.buffer) {
                (WorkOp::Recv, PortBuffer::Message(b)) => {
                    if !c.lost {
                        let len = wc.len.min(b.len());
                        if let Err(e) = c.machine.transport_mut().handle_capsule(&b[..len]) {
                            tracing::info!(portal = %self.portal, id, "NVMe/RDMA queue dropped: {e}");
                            c.lost = true;
                        }
                    }
                    if c.lost {
                        self.fabric.verbs().recycle_message(b);
                    } else {
                        self.fabric.verbs().post_recv(qp, 0, PortBuffer::Message(b));
                    }
                }
                (WorkOp::RdmaRead, buffer) if c.fetching == Some(wc.wr_id) => {
                    c.fetching = None;
                    let data = ok.then(|| &buffer[..wc.len.min(buffer.len())]);
                    c.machine.transport_mut().handle_connect_data(data);
                    if let PortBuffer::Message(b) = buffer {
                        self.fabric.verbs().recycle_message(b);
                    }
                }
                (WorkOp::RdmaRead, buffer) => {
                    // Handed back also when it failed: the command gets its buffer and ends.
                    let cid = c.reads.remove(&wc.wr_id);
                    match (cid, buffer) {
                        (Some(cid), PortBuffer::Data(b)) => {
                            c.machine.transport_mut().handle_read(cid, b, ok)
                        }
                        (_, PortBuffer::Message(b)) => self.fabric.verbs().recycle_message(b),
                        (None, PortBuffer::Data(_)) => {}
                    }
                }
                (_, PortBuffer::Message(b)) => self.fabric.verbs().recycle_message(b),
                (_, PortBuffer::Data(_)) => {}
            }
        }
    }

    /// The machine takes what came (with the subsystem's lock when it needs it), its timers
    /// and control requests, and its events go to the carrier.
    fn machine_step(&mut self, id: u64, now: Instant) -> bool {
        let registry = self.registry.clone();
        let Some(c) = self.conns.get_mut(&id) else {
            return false;
        };
        if c.lost {
            return false;
        }
        if c.subsystem.as_ref().is_some_and(|s| s.is_removed()) {
            tracing::info!(portal = %self.portal, id, "NVMe/RDMA queue ends: its subsystem was removed");
            c.lost = true;
            return true;
        }
        if c.control.get() >= Request::Logout {
            c.lost = true;
            return true;
        }
        if let Some(rx) = &mut c.events {
            if rx.has_changed().unwrap_or(false) {
                rx.mark_unchanged();
                c.poked = true;
            }
        }
        let Conn {
            machine,
            subsystem,
            poked,
            ..
        } = c;
        super::queue::take_arrivals(machine, subsystem, poked, &registry, c.peer, now);
        if c.machine.bound().is_some() && c.events.is_none() {
            if let Some(s) = &c.subsystem {
                c.events = Some(s.events.subscribe());
            }
        }
        // Keep alive is kept on the admin queue.
        if c.machine.bound().is_some_and(|q| q.qid == 0) {
            if let Some(s) = &c.subsystem {
                let due = s.with_machine(|m| m.poll_timeout());
                if due.is_some_and(|t| t <= now) {
                    s.with_machine(|m| c.machine.handle_timeout(now, m));
                    if c.machine.is_over() {
                        tracing::info!(portal = %self.portal, id, "NVMe/RDMA keep alive expired: the controller fails");
                    }
                }
            }
        }
        let mut progress = false;
        while let Some(e) = c.machine.poll_event() {
            progress = true;
            self.carrier.carry(now, id, &mut c.link(), e);
        }
        progress
    }

    /// Posts what a queue's machine asked, in order, as far as message buffers and the send
    /// queue allow.
    fn post_work(&mut self, id: u64) -> bool {
        let Some(c) = self.conns.get_mut(&id) else {
            return false;
        };
        while let Some(w) = c.machine.transport_mut().poll_work() {
            c.sends.push(w);
        }
        let (qp, verbs, share) = (c.qp, self.fabric.verbs(), self.carrier.waits.share());
        let (reads, fetching) = (&mut c.reads, &mut c.fetching);
        c.sends.post(c.lost, &mut self.next_wr, |w, wr| {
            match w {
                Work::Respond(cqe) => {
                    let Some(mut b) = verbs.message_buffer() else {
                        return Post::Wait(Work::Respond(cqe));
                    };
                    let bytes = cqe.to_bytes();
                    b[..bytes.len()].copy_from_slice(&bytes);
                    verbs.post_send(qp, wr, PortBuffer::Message(b), bytes.len());
                }
                Work::Write {
                    cid,
                    payload,
                    remote,
                } => {
                    let len = remote.length as usize;
                    let buffer: FabricBuffer<F::Message> = match payload {
                        nvme::transport::Payload::Buffer { buffer, .. } => PortBuffer::Data(buffer),
                        nvme::transport::Payload::Bytes(bytes) => {
                            let Some(b) = crate::fabric::registered::<F>(verbs, share, &bytes)
                            else {
                                return Post::Wait(Work::Write {
                                    cid,
                                    payload: nvme::transport::Payload::Bytes(bytes),
                                    remote,
                                });
                            };
                            b
                        }
                    };
                    verbs.post_rdma_write(qp, wr, buffer, 0, len, &[region(remote)]);
                }
                Work::Read {
                    cid,
                    buffer,
                    at,
                    len,
                    remote,
                } => {
                    reads.insert(wr, cid);
                    let d = region(remote);
                    verbs.post_rdma_read(qp, wr, PortBuffer::Data(buffer), at, len as usize, &[d]);
                }
                Work::FetchConnectData { cid, len, remote } => {
                    let Some(b) = verbs.message_buffer() else {
                        return Post::Wait(Work::FetchConnectData { cid, len, remote });
                    };
                    *fetching = Some(wr);
                    let d = region(remote);
                    verbs.post_rdma_read(qp, wr, PortBuffer::Message(b), 0, len as usize, &[d]);
                }
            }
            Post::Sent
        })
    }

    /// Ends a queue once it is over: a lost queue pair, a failed controller, the daemon or
    /// the admin interface closing it. It is disconnected and leaves its controller once its
    /// block operations have ended (within [`DRAIN_TIMEOUT`]) and the verbs have given back
    /// every buffer.
    fn end_if_over(&mut self, id: u64, now: Instant) -> bool {
        let Some(c) = self.conns.get_mut(&id) else {
            return false;
        };
        let qp = c.qp;
        let broken = self.fabric.verbs().is_error(qp);
        let over = c.machine.is_over() && c.sends.is_idle();
        if !(c.lost || broken || over) {
            return false;
        }
        c.lost = true;
        let mut progress = false;
        let since = match c.torn_down {
            Some(t) => t,
            None => {
                progress = true;
                c.torn_down = Some(now);
                if !broken {
                    self.fabric.verbs().disconnect(qp);
                }
                if let Some(s) = c.subsystem.clone() {
                    s.with_machine(|m| c.machine.close(m));
                }
                c.sends.clear();
                now
            }
        };
        let drained = c.machine.in_backend() == 0;
        if !drained && now.duration_since(since) < DRAIN_TIMEOUT {
            return progress;
        }
        if !drained {
            tracing::warn!(portal = %self.portal, id, "a closed NVMe/RDMA queue's commands did not finish in {DRAIN_TIMEOUT:?}");
        }
        if c.sends.in_flight() > 0 && now.duration_since(since) < DRAIN_TIMEOUT {
            // Flushed work requests come back through the completions.
            return progress;
        }
        let Some(mut c) = self.conns.remove(&id) else {
            return progress;
        };
        if let Some(s) = c.subsystem.clone() {
            s.with_machine(|m| c.machine.abandon(m));
        }
        let verbs = self.fabric.verbs();
        while let Some(wc) = verbs.poll(qp) {
            if let PortBuffer::Message(b) = wc.buffer {
                verbs.recycle_message(b);
            }
        }
        self.fabric.release(qp);
        self.registry.unregister(id);
        tracing::debug!(portal = %self.portal, id, "NVMe/RDMA queue ended");
        true
    }
}

/// The host memory a keyed SGL named, as the verbs name it.
fn region(k: Keyed) -> RemoteRegion {
    RemoteRegion {
        addr: k.address,
        rkey: k.key,
        len: k.length,
    }
}
