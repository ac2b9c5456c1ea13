//! One NVMe/TCP connection on a reactor: the I/O shell around crates/nvme's
//! [`ControllerConnection`], which makes every protocol decision (ICReq, Connect, the admin
//! commands through the subsystem machine, R2Ts, digests, what each I/O command needs). This
//! file moves bytes between the socket and the machine, finds the subsystem a Connect names,
//! hands the machine's events to the carrier (buffers from the reactor's arena, block
//! operations on the reactor's engine, counts on the namespace), keeps the keep alive timer
//! and sends the machine's PDUs with vectored writes, a read's data straight from its buffer.
//!
//! One future serves the connection: it waits for bytes, a backend completion, a buffer, the
//! keep alive deadline, an asynchronous event or the daemon's request to close, then lets
//! the machine do all it can and writes what it queued.

use std::io::IoSlice;
use std::net::SocketAddr;
use std::rc::Rc;
use std::sync::Arc;
use std::time::{Duration, Instant};

use backend::{Buffer, Share};
use nvme::tcp::{ControllerConnection, QueueSettings, Transmit};
use tokio::io::AsyncReadExt;
use tokio::net::TcpStream;

use super::queue::Link;
use super::NvmeSubsystem;
use crate::carrier::{self, granted, Carrier};
use crate::control::{Control, Park, Request};
use crate::iscsi::connection::{wait_for, CONNECTION_SHARE};
use crate::iscsi::wire::write_all_vectored;
use crate::reactor::Io;
use crate::registry::Registry;
use crate::unit::{next_id, UnitCache};

/// How long a closing connection waits for its commands' block operations.
const DRAIN_TIMEOUT: Duration = Duration::from_secs(30);
/// Room made in the receive buffer before each read, at least.
const READ_RESERVE: usize = 64 * 1024;
/// Slices one `writev` carries.
const IOV_MAX: usize = 64;
/// Far enough ahead to mean "no timer".
const NEVER: Duration = Duration::from_secs(86400 * 365);

/// What the connection offers every host, from `[nvme]`.
pub fn settings(nvme: &crate::config::Nvme) -> QueueSettings {
    QueueSettings {
        digests: nvme::tcp::Digests {
            header: nvme.header_digest,
            data: nvme.data_digest,
        },
        cpda: 0,
        maxh2cdata: nvme.max_h2c_data,
        max_in_capsule_data: nvme.in_capsule_data_size.max(8192),
        max_r2t: 1,
    }
}

/// Serves a new NVMe/TCP connection until the host or the daemon ends it.
pub async fn serve(stream: TcpStream, io: Rc<Io>, registry: Arc<Registry>) {
    let machine = ControllerConnection::new(settings(&registry.config().nvme));
    serve_machine(stream, io, registry, machine, None).await;
}

/// Serves a connection another process handed over (an upgrade's successor,
/// [`super::handover`]): `machine` resumed from its state and bound to its queue of
/// `subsystem`'s controller, which took the controller in.
pub async fn resume(
    stream: TcpStream,
    io: Rc<Io>,
    registry: Arc<Registry>,
    machine: ControllerConnection<Buffer>,
    subsystem: Arc<NvmeSubsystem>,
) {
    serve_machine(stream, io, registry, machine, Some(subsystem)).await;
}

async fn serve_machine(
    stream: TcpStream,
    io: Rc<Io>,
    registry: Arc<Registry>,
    mut machine: ControllerConnection<Buffer>,
    subsystem: Option<Arc<NvmeSubsystem>>,
) {
    let Ok(peer) = stream.peer_addr() else {
        return;
    };
    let _ = stream.set_nodelay(true);
    let id = next_id();
    let control = Arc::new(Control::default());
    registry.register(id, control.clone());
    let share = Share::new(&io.arena, io.arena.len() / CONNECTION_SHARE);
    if let Ok(local) = stream.local_addr() {
        machine.set_local_address(local.ip());
    }
    let mut conn = Conn {
        machine,
        carrier: Carrier::single(io, share),
        subsystem,
        poked: false,
        units: UnitCache::default(),
    };
    let ended = run(&mut conn, stream, &registry, &control, peer, id).await;
    finish(&mut conn, ended, &registry, id, peer).await;
}

/// How a connection's loop ended.
enum Ended {
    /// The host, the daemon or an error closed it.
    Closed,
    /// Another process serves it now (an upgrade's handover): it ends here without a word
    /// and without leaving its controller.
    Released,
}

/// Ends a connection as its loop ended: closed, it leaves its controller once its block
/// operations ended; released, it just goes.
async fn finish(
    conn: &mut Conn,
    ended: std::io::Result<Ended>,
    registry: &Registry,
    id: u64,
    peer: SocketAddr,
) {
    match &ended {
        Ok(Ended::Closed) => tracing::debug!(%peer, "NVMe/TCP connection closed"),
        Ok(Ended::Released) => tracing::debug!(%peer, "NVMe/TCP connection handed over"),
        Err(e) => tracing::info!(%peer, "NVMe/TCP connection ends: {e}"),
    }
    if !matches!(ended, Ok(Ended::Released)) {
        conn.close().await;
    }
    registry.unregister(id);
}

/// A connection's state.
struct Conn {
    machine: ControllerConnection<Buffer>,
    carrier: Carrier,
    /// The subsystem its Connect named.
    subsystem: Option<Arc<NvmeSubsystem>>,
    /// The subsystem said something may wait for this connection.
    poked: bool,
    /// The subsystem's namespaces as this connection last found them.
    units: UnitCache<u32>,
}

impl Conn {
    /// Lets the machine do all it can now: find the subsystem a Connect names, take what
    /// came, carry out the block operations that ended and the events it hands out.
    fn pump(&mut self, registry: &Registry, peer: SocketAddr) {
        let now = Instant::now();
        let Conn {
            machine,
            carrier,
            subsystem,
            poked,
            units,
        } = self;
        super::queue::take_arrivals(machine, subsystem, poked, registry, peer, now);
        let mut link = Link {
            machine,
            subsystem: subsystem.as_deref(),
            units,
        };
        // Until nothing moves: an operation a backend ends at once (memory, null) is answered
        // in this pass, its data in the same write as the rest of the burst.
        loop {
            let done = carrier.completions(|_, done| carrier::deliver(&mut link, now, done));
            if done && link.machine.wants_subsystem() {
                // The last command a Preempt and Abort waits for may have just ended: say so
                // now, not at the next wake.
                if let Some(s) = link.subsystem {
                    s.with_machine(|m| link.machine.handle(now, m));
                }
            }
            let mut carried = false;
            while let Some(e) = link.machine.poll_event() {
                carrier.carry(now, 0, &mut link, e);
                carried = true;
            }
            if !done && !carried {
                break;
            }
        }
    }

    /// The trace session of its queue (`cmdtrace`), once connected: subsystem, controller
    /// and queue, as the host names it too.
    fn trace_session(&self) -> Option<u64> {
        let (s, q) = (self.subsystem.as_ref()?, self.machine.bound()?);
        Some(cmdtrace::Record::session_of_queue(&s.nqn, q.cntlid, q.qid))
    }

    /// The connection is over: the block operations still running end (within
    /// [`DRAIN_TIMEOUT`]) before their buffers go, and then its queue leaves its controller.
    async fn close(&mut self) {
        if let Some(s) = &self.subsystem {
            s.with_machine(|m| self.machine.close(m));
        }
        self.drain().await;
        if let Some(s) = &self.subsystem {
            s.with_machine(|m| self.machine.abandon(m));
        }
    }

    /// Waits (within [`DRAIN_TIMEOUT`]) for the block operations still running.
    async fn drain(&mut self) {
        let deadline = tokio::time::Instant::now() + DRAIN_TIMEOUT;
        let inbox = self.carrier.inbox().clone();
        while self.machine.in_backend() > 0 {
            let Conn {
                machine,
                carrier,
                subsystem,
                units,
                ..
            } = self;
            let mut link = Link {
                machine,
                subsystem: subsystem.as_deref(),
                units,
            };
            let now = Instant::now();
            carrier.completions(|_, done| carrier::deliver(&mut link, now, done));
            while link.machine.poll_event().is_some() {}
            while link.machine.poll_transmit().is_some() {}
            if link.machine.in_backend() == 0 {
                return;
            }
            tokio::select! {
                _ = inbox.notify.notified() => {}
                _ = tokio::time::sleep_until(deadline) => {
                    tracing::warn!(
                        "a closed NVMe/TCP connection's commands did not finish in {DRAIN_TIMEOUT:?}"
                    );
                    return;
                }
            }
        }
    }
}

/// Serves the connection until it ends; `Err` when the socket broke.
async fn run(
    conn: &mut Conn,
    stream: TcpStream,
    registry: &Registry,
    control: &Arc<Control>,
    peer: SocketAddr,
    id: u64,
) -> std::io::Result<Ended> {
    let (mut rd, mut wr) = stream.into_split();
    let mut entered = false;
    let stall = Duration::from_secs(registry.config().server.send_timeout);
    let inbox = conn.carrier.inbox().clone();
    let share = conn.carrier.waits.share().clone();
    let mut batch: Vec<Transmit<Buffer>> = Vec::with_capacity(256);
    let mut events: Option<tokio::sync::watch::Receiver<u64>> = None;
    let timer = tokio::time::sleep(NEVER);
    tokio::pin!(timer);
    let mut waiting = None;
    loop {
        if conn.subsystem.as_ref().is_some_and(|s| s.is_removed()) {
            tracing::info!(%peer, "NVMe/TCP connection ends: its subsystem was removed");
            return Ok(Ended::Closed);
        }
        conn.pump(registry, peer);
        // Tracing on, or just turned off (its points then go off too).
        let trace = (cmdtrace::enabled() || conn.machine.trace_points().is_on())
            .then(|| conn.trace_session())
            .flatten();
        if let Some(key) = trace {
            crate::trace::record_points(conn.machine.trace_points(), key, conn.carrier.io());
        }
        while let Some(t) = conn.machine.poll_transmit() {
            batch.push(t);
        }
        if !batch.is_empty() {
            send(&mut wr, &batch, stall).await?;
            if let Some(key) = trace.filter(|_| cmdtrace::enabled()) {
                sent(key, conn.carrier.io(), &batch);
            }
            batch.clear();
        }
        if conn.machine.is_over() {
            return Ok(Ended::Closed);
        }
        if control.get() >= Request::Logout {
            // NVMe/TCP has no logout to ask for: the host reconnects (ctrl_loss_tmo).
            return Ok(Ended::Closed);
        }
        if !entered {
            if let (Some(queue), Some(subsystem)) = (conn.machine.bound(), &conn.subsystem) {
                entered = true;
                registry.nvme_queue_bound(
                    id,
                    crate::registry::NvmeQueue {
                        subsystem: subsystem.clone(),
                        queue,
                        control: control.clone(),
                    },
                );
            }
        }
        let parking = control.parking() == Park::Park;
        if parking {
            if let Ok(state) = conn.machine.handover() {
                match park(control, id, &rd, state).await {
                    Park::Release => {
                        // Without shutting the sending direction down (which dropping the
                        // write half would do, ending the connection for the other
                        // process too): only the descriptor is closed, with the read half.
                        wr.forget();
                        return Ok(Ended::Released);
                    }
                    // Serves on where it stopped. What the host sent meanwhile (its Keep
                    // Alive too) is read before the keep alive timer is looked at: the
                    // select below is biased, the read before the timer.
                    _ => continue,
                }
            }
        }
        let admin = conn.machine.bound().is_some_and(|q| q.qid == 0);
        if conn.machine.bound().is_some() && events.is_none() {
            if let Some(s) = &conn.subsystem {
                events = Some(s.events.subscribe());
            }
        }
        // Keep alive is kept on the admin queue's connection: when it expires, the controller
        // fails, and its I/O queues end with its next command (Keep Alive Timeout Expired)
        // or when the host, which resets the whole controller, closes them.
        let due = conn
            .subsystem
            .as_ref()
            .filter(|_| admin)
            .and_then(|s| s.with_machine(|m| m.poll_timeout()));
        if let Some(at) = due.map(tokio::time::Instant::from) {
            if timer.is_elapsed() || at < timer.deadline() {
                timer.as_mut().reset(at);
            }
        }
        conn.carrier.waits.start_waiting(&share, &mut waiting);
        tokio::select! {
            biased;
            _ = inbox.notify.notified() => {}
            // While parking only the data its R2Ts asked for is read: new commands wait in
            // the socket, for whichever process serves next.
            r = {
                // Straight into the deframer's buffer: a write's data is copied once more,
                // into its arena buffer, and no other time.
                conn.machine.reserve_for_read(READ_RESERVE);
                rd.read_buf(conn.machine.receive_buffer())
            }, if !parking || conn.machine.queue().r2ts_outstanding() > 0 => match r? {
                0 => return Ok(Ended::Closed),
                _ => {
                    conn.carrier.io().active();
                    conn.machine.received()
                }
            },
            (tag, b) = granted(&mut waiting) => {
                if conn.carrier.waits.front().is_some_and(|w| w.tag == tag) {
                    conn.carrier.waits.pop();
                }
                let b = b.map_err(|e| tracing::error!("buffer for command {tag:#x}: {e}")).ok();
                conn.machine.handle_buffer(Instant::now(), tag, b);
            }
            // Not while parking: the host's Keep Alive waits in the socket meanwhile.
            _ = &mut timer, if due.is_some() && !parking => {
                if let Some(s) = &conn.subsystem {
                    s.with_machine(|m| conn.machine.handle_timeout(Instant::now(), m));
                }
                if conn.machine.is_over() {
                    tracing::info!(%peer, "NVMe/TCP keep alive expired: the controller fails");
                }
            }
            r = async {
                match events.as_mut() {
                    Some(rx) => rx.changed().await,
                    None => std::future::pending().await,
                }
            }, if events.is_some() => {
                conn.poked = true;
                if r.is_err() {
                    events = None;
                }
            }
            _ = wait_for(control, Request::Logout) => {}
            _ = control.reader.notified() => {}
        }
    }
}

/// A quiescent queue: reports its state and a duplicate of its socket to the handover, then
/// waits for its word: [`Park::Release`] (another process serves it now) or [`Park::Serve`]
/// (the handover was withdrawn: it serves on where it stopped). Nothing is read or sent
/// meanwhile; the host's PDUs wait in the socket.
async fn park(
    control: &Control,
    id: u64,
    rd: &tokio::net::tcp::OwnedReadHalf,
    state: nvme::handover::QueueState,
) -> Park {
    use std::os::fd::AsFd;
    let socket = match rd.as_ref().as_fd().try_clone_to_owned() {
        Ok(s) => s,
        Err(e) => {
            tracing::warn!("parking an NVMe/TCP queue: duplicating the socket: {e}");
            // Not reported: the park fails at its deadline and everything serves on.
            return wait_unparked(control).await;
        }
    };
    let parked = crate::control::Parked {
        id,
        state: crate::control::ParkedState::NvmeTcp(state),
        socket,
    };
    if !control.report(parked) {
        return Park::Serve;
    }
    wait_unparked(control).await
}

/// Waits until the park request is no longer `Park`.
async fn wait_unparked(control: &Control) -> Park {
    loop {
        let notified = control.reader.notified();
        match control.parking() {
            Park::Park => notified.await,
            other => return other,
        }
    }
}

/// Records the read data and the completions a batch written to the socket carried (while
/// tracing), on the reactor's clock as the machine's points are.
fn sent(session: u64, io: &Io, batch: &[Transmit<Buffer>]) {
    let at_ns = io.clock.ns(Instant::now());
    for (stage, cid, arg) in batch.iter().flat_map(|t| t.sent_stages()).flatten() {
        cmdtrace::record(cmdtrace::Record {
            at_ns,
            session,
            itt: u32::from(cid),
            cmd_sn: 0,
            stage,
            lane: io.index as u8,
            arg,
        });
    }
}

/// Sends `batch` in order with as few system calls as the slices allow: each PDU's header,
/// its data (a read's straight from its buffer) and its data digest.
async fn send(
    wr: &mut tokio::net::tcp::OwnedWriteHalf,
    batch: &[Transmit<Buffer>],
    stall: Duration,
) -> std::io::Result<()> {
    let mut slices = batch.iter().flat_map(Transmit::slices);
    loop {
        let mut iov = [IoSlice::new(&[]); IOV_MAX];
        let mut n = 0;
        for s in slices.by_ref() {
            iov[n] = IoSlice::new(s);
            n += 1;
            if n == IOV_MAX {
                break;
            }
        }
        if n == 0 {
            return Ok(());
        }
        write_all_vectored(wr, &mut iov[..n], stall).await?;
    }
}
