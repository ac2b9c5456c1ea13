//! One carrier of the transport machines' events on a reactor, for every transport: iSCSI over
//! TCP, iSER and SRP (and the NVMe transports to come).
//!
//! Each transport's sans-IO machine speaks scsi-core's task layer and hands out
//! [`transport::Event`](scsi_core::transport::Event)s: run a backend operation on a unit, find
//! a buffer of the reactor's arena, count a finished command. What a reactor does with each is
//! the same whatever the transport, so it is written here once: [`Carrier::carry`] runs the
//! operation on the reactor's engine (or tells the machine its unit is gone), queues the
//! buffer request behind earlier ones ([`Waits`]) and adds the command to its unit's counters;
//! [`Carrier::completions`] brings the engine's results back to the machine that asked. A
//! shell says only how to reach its machine ([`Carried`]).

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::rc::Rc;
use std::time::Instant;

use backend::{Buffer, Share};
use scsi_core::transport::{Accounting, Event};
use scsi_core::{BackendError, Output, TaskId};

use crate::reactor::{Done, Inbox, Io};
use crate::unit::CachedUnit;

/// A connection or channel as the carrier reaches it: its machine's task-layer inputs (each
/// taken with whatever core step the machine needs), its units, and where a finished command
/// is counted. Nothing here is SCSI's: a transport with a controller of its own implements it
/// as well.
pub trait Carried {
    /// Counts a finished command on its unit (nothing for a discovery session).
    fn account(&mut self, done: &Accounting);
    /// The unit a backend operation for LUN index `lun` runs on
    /// (the target's `unit_for` with the connection's cache); `None` when it is gone.
    fn unit(&mut self, lun: u16) -> Option<CachedUnit<'_>>;
    /// Hands the machine the result of its backend operation for `task`.
    fn backend_done(
        &mut self,
        now: Instant,
        task: TaskId,
        buffer: Buffer,
        result: Result<Output, BackendError>,
    );
    /// Hands the machine the buffer it asked for under `tag` (`None`: none can ever be had).
    fn buffer(&mut self, now: Instant, tag: u64, buffer: Option<Buffer>);
}

/// A buffer a connection waits for.
#[derive(Debug, Clone, Copy)]
pub struct Want {
    /// The connection (or channel).
    pub conn: u64,
    /// The task's tag.
    pub tag: u64,
    /// Bytes.
    pub len: usize,
    /// For a write's data-out (the shell's own: iSER holds the message behind it); else for
    /// a backend operation, which the carrier hands to [`Carried::buffer`].
    pub data_out: bool,
}

/// Buffers the connections of a carrier wait for, in the order asked: a later one waits
/// behind an earlier one, so a large request is not starved by small ones.
#[derive(Debug)]
pub struct Waits {
    share: Share,
    queue: VecDeque<Want>,
}

impl Waits {
    /// The waits of connections whose buffers come from `share`.
    pub fn new(share: Share) -> Waits {
        Waits {
            share,
            queue: VecDeque::with_capacity(64),
        }
    }

    /// The share the buffers come from.
    pub fn share(&self) -> &Share {
        &self.share
    }

    /// A buffer for `w` now if the share has room and nothing waits before it (`Some`: to
    /// grant at once, `None` inside when it can never be had), else `None`: it waits its turn.
    pub fn want(&mut self, w: Want) -> Option<Option<Buffer>> {
        if self.queue.is_empty() {
            match self.share.try_alloc(w.len) {
                Ok(Some(b)) => return Some(Some(b)),
                Ok(None) => {}
                Err(e) => {
                    tracing::error!("a buffer of {} bytes for task {:#x}: {e}", w.len, w.tag);
                    return Some(None);
                }
            }
        }
        self.queue.push_back(w);
        None
    }

    /// The first request waiting, whose allocation the shell awaits.
    pub fn front(&self) -> Option<Want> {
        self.queue.front().copied()
    }

    /// The first request has its buffer (or never will): the next one is first now.
    pub fn pop(&mut self) -> Option<Want> {
        self.queue.pop_front()
    }
}

/// The head of a connection's buffer queue: its tag and its place in the arena's FIFO. It
/// lives across a shell's loop iterations so the place is kept.
pub type Waiting<'a> = Option<(u64, backend::ShareAlloc<'a>)>;

impl Waits {
    /// Starts waiting for the oldest queued buffer, unless a wait is on already.
    pub fn start_waiting<'a>(&self, share: &'a Share, waiting: &mut Waiting<'a>) {
        if waiting.is_none() {
            if let Some(w) = self.front() {
                *waiting = Some((w.tag, share.alloc(w.len)));
            }
        }
    }
}

/// Resolves when the arena grants the waiting buffer (never, when none waits).
pub async fn granted(waiting: &mut Waiting<'_>) -> (u64, Result<Buffer, backend::ArenaError>) {
    let Some((tag, alloc)) = waiting else {
        return std::future::pending().await;
    };
    let b = alloc.await;
    let tag = *tag;
    *waiting = None;
    (tag, b)
}

/// Carries out transport events on a reactor for one connection (an iSCSI connection's task)
/// or for the connections of one port (an RDMA port's task), which then share the inbox of
/// backend completions.
pub struct Carrier {
    io: Rc<Io>,
    inbox: Rc<Inbox>,
    /// The connection of each backend operation in flight, when several share the inbox.
    owners: Option<HashMap<TaskId, u64>>,
    /// The buffers waited for.
    pub waits: Waits,
}

impl std::fmt::Debug for Carrier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Carrier")
            .field("reactor", &self.io.index)
            .field("shared", &self.owners.is_some())
            .field("waits", &self.waits)
            .finish()
    }
}

impl Carrier {
    /// The carrier of one connection on `io`, its buffers from `share`.
    pub fn single(io: Rc<Io>, share: Share) -> Carrier {
        Carrier {
            io,
            inbox: Rc::new(Inbox::default()),
            owners: None,
            waits: Waits::new(share),
        }
    }

    /// The carrier of a port's connections on `io`, their buffers from `share`.
    pub fn shared(io: Rc<Io>, share: Share) -> Carrier {
        Carrier {
            io,
            inbox: Rc::new(Inbox::default()),
            owners: Some(HashMap::with_capacity(256)),
            waits: Waits::new(share),
        }
    }

    /// Where backend operations complete: the shell waits on its `notify`.
    pub fn inbox(&self) -> &Rc<Inbox> {
        &self.inbox
    }

    /// The reactor.
    pub fn io(&self) -> &Rc<Io> {
        &self.io
    }

    /// Carries out `e`, an event of connection `id`'s machine (`conn`), at `now`: the clock
    /// its turn read once, not again for each event.
    pub fn carry(&mut self, now: Instant, id: u64, conn: &mut impl Carried, e: Event<Buffer>) {
        match e {
            Event::Backend {
                task,
                lun,
                op,
                buffer,
            } => match conn.unit(lun) {
                Some(unit) => {
                    if let Some(owners) = &mut self.owners {
                        owners.insert(task, id);
                    }
                    self.io.submit(unit, op, buffer, &self.inbox, task);
                }
                None => {
                    let gone = Err(BackendError::Internal);
                    conn.backend_done(now, task, buffer, gone);
                }
            },
            Event::BufferWanted { tag, len } => {
                let w = Want {
                    conn: id,
                    tag,
                    len,
                    data_out: false,
                };
                if let Some(buffer) = self.waits.want(w) {
                    conn.buffer(now, tag, buffer);
                }
            }
            Event::Completed(a) => conn.account(&a),
        }
    }

    /// Hands each finished backend operation to its connection among `conns` (a port's, by
    /// id); whether there were any.
    pub fn deliver_all<C: Carried>(&mut self, conns: &mut BTreeMap<u64, C>) -> bool {
        let now = Instant::now();
        self.completions(|id, done| {
            if let Some(c) = conns.get_mut(&id) {
                deliver(c, now, done);
            }
        })
    }

    /// Hands each finished backend operation to `deliver` with the connection that asked
    /// (`0` for a single connection's carrier); whether there were any.
    pub fn completions(&mut self, mut deliver: impl FnMut(u64, Done)) -> bool {
        let mut any = false;
        loop {
            let Some(done) = self.inbox.done.borrow_mut().pop_front() else {
                break;
            };
            any = true;
            match &mut self.owners {
                None => deliver(0, done),
                Some(owners) => {
                    if let Some(id) = owners.remove(&done.task) {
                        deliver(id, done);
                    }
                }
            }
        }
        any
    }
}

/// Hands a finished backend operation to the machine that asked.
pub fn deliver(conn: &mut impl Carried, now: Instant, done: Done) {
    conn.backend_done(now, done.task, done.buffer, done.result);
}
