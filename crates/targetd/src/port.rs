//! What an RDMA port's task does whatever its protocol (SRP's ports, iSER's portals): all its
//! connections in one task on one reactor, turned until nothing moves, woken by the fabric,
//! backend completions, routed core events, its control or an arena grant; asked to log its
//! connections out when the daemon stops, then closed.

use std::future::poll_fn;
use std::rc::Rc;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use backend::{Buffer, Share};

use crate::carrier::{Carrier, Want};
use crate::control::{Control, Request};
use crate::fabric::Fabric;
use crate::reactor::Io;
use crate::registry::Registry;
use crate::target::{Outbox, Routed};
use crate::unit::next_id;

/// A port's protocol side, driven by [`serve`].
pub trait Port {
    /// Takes the connect requests that have come; whether there were any.
    fn accept(&mut self) -> bool;
    /// Hands finished backend operations to their connections; whether there were any.
    fn backend_completions(&mut self) -> bool;
    /// The connections' ids, into `ids`.
    fn ids(&self, ids: &mut Vec<u64>);
    /// One connection's turn; whether anything moved.
    fn step(&mut self, id: u64) -> bool;
    /// Ready when the fabric has news or routed events reached a connection.
    fn poll_wake(&mut self, cx: &mut Context<'_>) -> Poll<()>;
    /// What carries out its connections' events: its inbox of backend completions, and the
    /// buffers waited for.
    fn carrier(&mut self) -> &mut Carrier;
    /// Gives a connection the buffer it waited for (`None`: none can ever be had).
    fn granted(&mut self, w: Want, buffer: Option<Buffer>);
    /// Asks every connection to log out (the daemon is stopping); from now on no login is
    /// taken.
    fn log_out_all(&mut self);
    /// Whether no connection is left.
    fn is_empty(&self) -> bool;
    /// Disconnects what is left.
    fn close_all(&mut self);
    /// How often to look at the connections' timers when nothing wakes the port; `None`:
    /// they keep none.
    fn tick(&self) -> Option<Duration> {
        None
    }
}

/// Starts a port on `reactor` whose fabric `open` makes there, served by `run` (SRP's
/// [`crate::srp::serve`], or iSER's [`crate::iser::serve`]) until the daemon stops. Returns once the port
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

/// The carrier of a port's connections on `io`: their buffers from half the reactor's arena,
/// as an iSCSI connection's share, the rest staying for the reactor's other connections.
pub fn shared_carrier(io: Rc<Io>) -> Carrier {
    let share = Share::new(&io.arena, io.arena.len() / 2);
    Carrier::shared(io, share)
}

/// Serves `p` as one of the daemon's ports until the daemon stops: registered under a
/// control of its own, through which the stop asks it to log its connections out and close.
/// `what` and `portal` name it in the log ("iSER portal", "iser:192.0.2.10:3260").
pub async fn run(p: &mut impl Port, registry: &Registry, what: &str, portal: &str) {
    let id = next_id();
    let control = Arc::new(Control::default());
    registry.register(id, control.clone());
    tracing::info!(portal, reactor = p.carrier().io().index, "{what} listening");
    serve(p, &control).await;
    registry.unregister(id);
    tracing::info!(portal, "{what} stopped");
}

/// What became of one piece of work [`SendQueue::post`] offered.
#[derive(Debug)]
pub enum Post<W> {
    /// Posted: it takes a place on the send queue until its completion.
    Sent,
    /// Given up (it could never go; its buffers went back).
    Dropped,
    /// It waits (no message buffer yet): it goes first next time.
    Wait(W),
}

/// A connection's work for its queue pair's send queue (SENDs, RDMA READs and WRITEs), posted
/// in order as far as the send queue's depth allows: what each RDMA port's connection keeps.
#[derive(Debug)]
pub struct SendQueue<W> {
    pending: std::collections::VecDeque<W>,
    in_flight: usize,
    depth: usize,
}

impl<W> SendQueue<W> {
    /// A send queue of `depth` work requests.
    pub fn new(depth: usize) -> SendQueue<W> {
        SendQueue {
            pending: std::collections::VecDeque::new(),
            in_flight: 0,
            depth,
        }
    }

    /// Queues `w` behind what waits.
    pub fn push(&mut self, w: W) {
        self.pending.push_back(w);
    }

    /// A posted work request has completed (or was flushed).
    pub fn completed(&mut self) {
        self.in_flight = self.in_flight.saturating_sub(1);
    }

    /// Work requests posted and not completed.
    pub fn in_flight(&self) -> usize {
        self.in_flight
    }

    /// Nothing waits and nothing is posted.
    pub fn is_idle(&self) -> bool {
        self.pending.is_empty() && self.in_flight == 0
    }

    /// Drops what waits (its buffers go back).
    pub fn clear(&mut self) {
        self.pending.clear();
    }

    /// Offers the waiting work to `post` in order, each with the next work request id of
    /// `next_wr`, while the send queue has room and until a piece must wait; with `lost`
    /// (the queue pair is gone) the work is dropped instead. Whether any was posted.
    pub fn post(
        &mut self,
        lost: bool,
        next_wr: &mut u64,
        mut post: impl FnMut(W, u64) -> Post<W>,
    ) -> bool {
        let mut progress = false;
        while self.in_flight < self.depth {
            let Some(w) = self.pending.pop_front() else {
                break;
            };
            if lost {
                continue;
            }
            let wr = *next_wr;
            *next_wr += 1;
            match post(w, wr) {
                Post::Sent => {
                    self.in_flight += 1;
                    progress = true;
                }
                Post::Dropped => {}
                Post::Wait(w) => {
                    self.pending.push_front(w);
                    break;
                }
            }
        }
        progress
    }
}

/// Moves the core events other connections routed to a connection into its outbox; whether
/// there were any (the port has something to do).
pub fn take_routed(
    rx: &mut tokio::sync::mpsc::UnboundedReceiver<Routed>,
    out: &mut Outbox,
    cx: &mut Context<'_>,
) -> bool {
    let mut any = false;
    while let Poll::Ready(Some(ev)) = rx.poll_recv(cx) {
        out.local.push_back(ev);
        any = true;
    }
    any
}

/// Does everything there is to do until nothing moves: connect requests, backend
/// completions, every connection's turn. `ids` is reused so a turn allocates nothing.
pub fn turn(p: &mut impl Port, ids: &mut Vec<u64>) {
    loop {
        let mut progress = p.accept();
        progress |= p.backend_completions();
        ids.clear();
        p.ids(ids);
        for &id in ids.iter() {
            progress |= p.step(id);
        }
        if !progress {
            break;
        }
        p.carrier().io().active();
    }
}

/// Serves `p` until the daemon stops: turns it whenever something may have changed, logs its
/// connections out when `control` asks, and closes what is left when the drain is over (or
/// once every connection has gone after the logout).
pub async fn serve(p: &mut impl Port, control: &Control) {
    let mut ids = Vec::with_capacity(64);
    let mut logging_out = false;
    loop {
        turn(p, &mut ids);
        match control.get() {
            Request::Run => {}
            Request::Logout if !logging_out => {
                logging_out = true;
                p.log_out_all();
                continue;
            }
            Request::Logout => {}
            Request::Close => {
                // Told at least why, before the queue pairs go.
                if !logging_out {
                    p.log_out_all();
                    turn(p, &mut ids);
                }
                break;
            }
        }
        if logging_out && p.is_empty() {
            break;
        }
        let inbox = p.carrier().inbox().clone();
        let want = p.carrier().waits.front();
        let share = p.carrier().waits.share().clone();
        let tick = p.tick().filter(|_| !p.is_empty());
        let granted = tokio::select! {
            _ = poll_fn(|cx| p.poll_wake(cx)) => None,
            _ = inbox.notify.notified() => None,
            _ = control.notify.notified() => None,
            _ = tokio::time::sleep(tick.unwrap_or_default()), if tick.is_some() => None,
            r = async { share.alloc(want.map_or(0, |w| w.len)).await }, if want.is_some() => {
                Some(r.ok())
            }
        };
        if let (Some(buffer), Some(w)) = (granted, want) {
            p.carrier().waits.pop();
            p.granted(w, buffer);
        }
    }
    p.close_all();
}
