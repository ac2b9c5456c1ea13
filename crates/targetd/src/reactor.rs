//! A reactor: one thread running a current-thread tokio runtime with its own io_uring engine and
//! buffer arena (docs/architecture.md, "Threads"). Connections handed to it stay on it for life.
//! Per command, the I/O path takes its target's SCSI core lock once (a plain READ or WRITE),
//! reads the target's unit table twice under its `RwLock` (to find the unit, and to count the
//! command on it) and adds to relaxed atomic counters (the unit's, the arena gauge); it takes
//! no other lock, and the arena, the engine and the connections are the reactor's alone.

use std::cell::{Cell, RefCell};
use std::collections::hash_map::Entry;
use std::collections::VecDeque;
use std::future::Future;
use std::pin::Pin;
use std::rc::Rc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::sync::Weak;
use std::time::{Duration, Instant};

use backend::{AnyBackend, Arena, ArenaConfig, Buffer, Engine, EngineChoice, EngineConfig, Faulty};
use scsi_core::{Backend, BackendError, Op, Output, TaskId};
use tokio::sync::{mpsc, Notify};

use crate::registry::counters::ArenaGauge;
use crate::unit::{CachedUnit, Lun};

/// A backend operation's result, on its way back to the connection that asked.
#[derive(Debug)]
pub struct Done {
    /// The task.
    pub task: TaskId,
    /// Its outcome.
    pub result: Result<Output, BackendError>,
    /// The task's buffer, back from the backend.
    pub buffer: Buffer,
}

/// A connection's mailbox on its reactor: backend completions, and a wake-up.
#[derive(Debug, Default)]
pub struct Inbox {
    /// Completed operations.
    pub done: RefCell<VecDeque<Done>>,
    /// Signalled when something arrived.
    pub notify: Notify,
}

struct OpenLun {
    lun: Weak<Lun>,
    backend: Faulty<AnyBackend>,
    in_flight: usize,
}

struct InFlight {
    inbox: Rc<Inbox>,
    task: TaskId,
}

/// The per-reactor I/O state connections share.
pub struct Io {
    /// The reactor's index.
    pub index: usize,
    /// Its engine.
    pub engine: Engine,
    /// Its buffer arena.
    pub arena: Arena,
    /// Turns the machines' instants into trace time (`cmdtrace`).
    pub clock: cmdtrace::Clock,
    luns: RefCell<scsi_core::transport::TagMap<u64, OpenLun>>,
    in_flight: RefCell<slab_lite::Slab<InFlight>>,
    kick: Notify,
    kicked: Cell<bool>,
    /// Busy polling, when on (`server.busy_poll`).
    spin: Option<Spin>,
}

/// The reactor's busy polling: after its connections last did something, it keeps polling its
/// sockets and rings for `window` instead of sleeping, so that the next request is found
/// without the thread being woken (which costs a cross-CPU interrupt, several times a
/// loopback round trip in a virtual machine).
struct Spin {
    window: Duration,
    /// Counts what the connections did: the spinner goes on while it moves.
    activity: Cell<u64>,
    /// The spinner sleeps: the next activity wakes it.
    parked: Cell<bool>,
    wake: Notify,
}

/// A tiny slab (reused indexes), so the hot path allocates nothing once warm.
mod slab_lite {
    /// Values under reusable keys.
    pub struct Slab<T> {
        entries: Vec<Option<T>>,
        free: Vec<usize>,
    }

    impl<T> Slab<T> {
        pub fn new() -> Self {
            Slab {
                entries: Vec::with_capacity(256),
                free: Vec::with_capacity(256),
            }
        }

        pub fn insert(&mut self, v: T) -> usize {
            match self.free.pop() {
                Some(i) => {
                    self.entries[i] = Some(v);
                    i
                }
                None => {
                    self.entries.push(Some(v));
                    self.entries.len() - 1
                }
            }
        }

        pub fn remove(&mut self, i: usize) -> Option<T> {
            let v = self.entries.get_mut(i)?.take();
            if v.is_some() {
                self.free.push(i);
            }
            v
        }
    }
}

impl Io {
    /// A connection or port did something (a PDU came, a turn moved): with busy polling on,
    /// the reactor keeps polling for a while.
    pub fn active(&self) {
        if let Some(s) = &self.spin {
            s.activity.set(s.activity.get().wrapping_add(1));
            if s.parked.replace(false) {
                s.wake.notify_one();
            }
        }
    }

    /// Runs `op` on `unit` with `buffer`; the result goes to `inbox`.
    pub fn submit(
        &self,
        unit: CachedUnit<'_>,
        op: Op,
        buffer: Buffer,
        inbox: &Rc<Inbox>,
        task: TaskId,
    ) {
        let mut luns = self.luns.borrow_mut();
        if let Entry::Vacant(v) = luns.entry(unit.id) {
            // The one count taken on the unit: to open its backend on this reactor.
            let opened = match unit.unit.upgrade() {
                Some(lun) => self
                    .open(&lun)
                    .map_err(|e| format!("LUN {}: {e}", lun.config.lun)),
                None => Err("the unit is gone".to_string()),
            };
            match opened {
                Ok(backend) => {
                    v.insert(OpenLun {
                        lun: unit.unit.clone(),
                        backend,
                        in_flight: 0,
                    });
                }
                Err(e) => {
                    tracing::error!("cannot open the backend: {e}");
                    inbox.done.borrow_mut().push_back(Done {
                        task,
                        result: Err(BackendError::Internal),
                        buffer,
                    });
                    inbox.notify.notify_one();
                    return;
                }
            }
        }
        let open = luns.get_mut(&unit.id).expect("inserted above");
        let token = self.in_flight.borrow_mut().insert(InFlight {
            inbox: inbox.clone(),
            task,
        });
        open.in_flight += 1;
        open.backend.submit(token as u64, op, buffer);
        self.kick();
    }

    fn open(&self, lun: &Lun) -> Result<Faulty<AnyBackend>, String> {
        let backend = lun
            .storage
            .backend(&self.engine, lun.block_size, lun.blocks)?;
        Ok(Faulty::new(backend, lun.faults.clone()))
    }

    /// Asks the reactor's I/O task to submit and collect: once per tick, however many ops.
    fn kick(&self) {
        if !self.kicked.replace(true) {
            self.kick.notify_one();
        }
    }

    /// Submits what is queued and hands every completion to its connection.
    fn poll(&self) {
        self.kicked.set(false);
        if let Err(e) = self.engine.submit_pending() {
            tracing::error!("io_uring submit: {e}");
        }
        let mut luns = self.luns.borrow_mut();
        for open in luns.values_mut() {
            while let Some((token, result, buffer)) = open.backend.poll_completion() {
                open.in_flight -= 1;
                let Some(f) = self.in_flight.borrow_mut().remove(token as usize) else {
                    continue;
                };
                f.inbox.done.borrow_mut().push_back(Done {
                    task: f.task,
                    result,
                    buffer,
                });
                f.inbox.notify.notify_one();
            }
        }
    }

    /// Closes backends of units that are gone (removed or replaced) once idle.
    fn prune(&self) {
        self.luns
            .borrow_mut()
            .retain(|_, o| o.in_flight > 0 || o.lun.strong_count() > 0);
    }

    /// Reports the arena's state for the metrics.
    fn report(&self, gauge: &ArenaGauge) {
        let free = self.arena.free_slots() * self.arena.slot_size();
        gauge
            .bytes
            .store(self.arena.len() as u64, Ordering::Relaxed);
        gauge.free.store(free as u64, Ordering::Relaxed);
        gauge
            .waiting
            .store(self.arena.waiting() as u64, Ordering::Relaxed);
    }
}

/// Work that runs on a reactor for its life, given the reactor's I/O state: an iSCSI
/// connection, or an RDMA port whose queue pairs' buffers are that reactor's. The reactor
/// knows no transport: the server hands it each connection as such a task.
pub type Task = Box<dyn FnOnce(Rc<Io>) -> Pin<Box<dyn Future<Output = ()>>> + Send>;

/// The listener's handle on a reactor.
#[derive(Clone)]
pub struct Handle {
    /// Its index.
    pub index: usize,
    tx: mpsc::UnboundedSender<Task>,
    /// Connections it serves now.
    pub connections: Arc<AtomicUsize>,
    /// Its I/O engine, as the log and `targetctl status` say it.
    pub engine: String,
}

impl std::fmt::Debug for Handle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Handle")
            .field("index", &self.index)
            .field("engine", &self.engine)
            .finish()
    }
}

impl Handle {
    /// Runs `task` on it, counted among its connections while it runs.
    pub fn spawn(&self, task: Task) -> bool {
        self.tx.send(task).is_ok()
    }
}

/// How reactors are built.
#[derive(Debug, Clone)]
pub struct Settings {
    /// The engine wanted.
    pub engine: EngineChoice,
    /// The arena per reactor.
    pub arena: ArenaConfig,
    /// How long a reactor keeps polling after its connections last did something; zero:
    /// it sleeps as soon as nothing is ready.
    pub busy_poll: Duration,
}

static THREAD_HOOK: std::sync::OnceLock<fn()> = std::sync::OnceLock::new();

/// Runs `hook` first thing on every reactor thread started after this call: a test's counting
/// allocator uses it to mark the threads whose allocations it counts.
pub fn on_reactor_thread(hook: fn()) {
    let _ = THREAD_HOOK.set(hook);
}

/// Starts reactor `index` on its own thread, reporting its arena to `gauge` every second.
/// Returns once its engine and arena exist, or with the reason they could not be made.
pub fn spawn(
    index: usize,
    settings: Settings,
    gauge: Arc<ArenaGauge>,
) -> std::io::Result<(Handle, std::thread::JoinHandle<()>)> {
    let (tx, rx) = mpsc::unbounded_channel();
    let connections = Arc::new(AtomicUsize::new(0));
    let count = connections.clone();
    let (ready_tx, ready_rx) = std::sync::mpsc::channel();
    let thread = std::thread::Builder::new()
        .name(format!("reactor-{index}"))
        .spawn(move || {
            if let Some(hook) = THREAD_HOOK.get() {
                hook();
            }
            let rt = match tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
            {
                Ok(rt) => rt,
                Err(e) => {
                    let _ = ready_tx.send(Err(e));
                    return;
                }
            };
            let local = tokio::task::LocalSet::new();
            local.block_on(&rt, async move {
                let io = match build_io(index, &settings) {
                    Ok(io) => Rc::new(io),
                    Err(e) => {
                        let _ = ready_tx.send(Err(e));
                        return;
                    }
                };
                // What runs, in words: io_uring with or without the registered arena (the
                // MEMLOCK fallback), or the thread pool and why.
                let engine = match (io.engine.kind(), io.engine.fallback_reason()) {
                    (_, Some(why)) => format!("threads ({why})"),
                    (backend::EngineKind::Uring, None) if io.engine.fixed_buffers() => {
                        "io_uring, registered buffers".to_string()
                    }
                    (backend::EngineKind::Uring, None) => {
                        "io_uring without registered buffers (locked memory short, or no \
                         fixed buffers in this kernel: the log says which)"
                            .to_string()
                    }
                    (backend::EngineKind::Threads, None) => "threads".to_string(),
                };
                let _ = ready_tx.send(Ok(engine));
                run(io, rx, count, gauge).await;
            });
        })?;
    match ready_rx.recv() {
        Ok(Ok(engine)) => {
            tracing::debug!(reactor = index, engine, "reactor up");
            Ok((
                Handle {
                    index,
                    tx,
                    connections,
                    engine,
                },
                thread,
            ))
        }
        Ok(Err(e)) => Err(e),
        Err(_) => Err(std::io::Error::other("the reactor thread ended")),
    }
}

/// ENOMEM: what io_uring's buffer registration fails with past RLIMIT_MEMLOCK.
const ENOMEM: i32 = 12;

fn build_io(index: usize, settings: &Settings) -> std::io::Result<Io> {
    let engine = Engine::new(EngineConfig {
        engine: settings.engine,
        threads: 2,
        ..EngineConfig::default()
    })?;
    let arena = Arena::new(settings.arena).map_err(std::io::Error::other)?;
    if let Err(e) = engine.register_arena(&arena) {
        let short = e.raw_os_error() == Some(ENOMEM);
        let why = if short {
            format!(
                "registering the {} MiB buffer arena with io_uring: {e}: RLIMIT_MEMLOCK is \
                 too low (raise it: systemd LimitMEMLOCK=, ulimit -l; as root it does not apply)",
                arena.len() >> 20
            )
        } else {
            format!("registering the buffer arena with io_uring: {e}")
        };
        if settings.engine != EngineChoice::Auto {
            return Err(std::io::Error::new(e.kind(), why));
        }
        // engine = "auto": io_uring still runs, with plain reads and writes into the arena
        // instead of READ_FIXED/WRITE_FIXED. Every reactor meets the same limit: said once.
        static SAID: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
        if !SAID.swap(true, std::sync::atomic::Ordering::Relaxed) {
            tracing::warn!("{why}; serving without registered buffers");
        }
    }
    Ok(Io {
        index,
        engine,
        arena,
        clock: cmdtrace::Clock::new(),
        luns: RefCell::new(scsi_core::transport::tag_map(16)),
        in_flight: RefCell::new(slab_lite::Slab::new()),
        kick: Notify::new(),
        kicked: Cell::new(false),
        spin: (!settings.busy_poll.is_zero()).then(|| Spin {
            window: settings.busy_poll,
            activity: Cell::new(0),
            parked: Cell::new(true),
            wake: Notify::new(),
        }),
    })
}

async fn run(
    io: Rc<Io>,
    mut rx: mpsc::UnboundedReceiver<Task>,
    count: Arc<AtomicUsize>,
    gauge: Arc<ArenaGauge>,
) {
    let completions = match io.engine.completions() {
        Ok(c) => c,
        Err(e) => {
            tracing::error!("reactor {}: completion eventfd: {e}", io.index);
            return;
        }
    };
    io.report(&gauge);
    let pump = {
        let io = io.clone();
        async move {
            let mut prune = tokio::time::interval(Duration::from_secs(1));
            loop {
                tokio::select! {
                    _ = io.kick.notified() => {}
                    r = completions.ready() => {
                        if let Err(e) = r {
                            tracing::error!("completion eventfd: {e}");
                            tokio::time::sleep(Duration::from_millis(1)).await;
                        }
                    }
                    _ = prune.tick() => {
                        io.prune();
                        io.report(&gauge);
                    }
                }
                io.poll();
            }
        }
    };
    tokio::task::spawn_local(pump);
    if io.spin.is_some() {
        tokio::task::spawn_local(spin(io.clone()));
    }
    while let Some(task) = rx.recv().await {
        let io = io.clone();
        let count = count.clone();
        count.fetch_add(1, Ordering::Relaxed);
        tokio::task::spawn_local(async move {
            task(io).await;
            count.fetch_sub(1, Ordering::Relaxed);
        });
    }
    // The listener is gone: let the connections finish (the server bounds how long).
    while count.load(Ordering::Relaxed) > 0 {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Keeps the reactor polling while its connections are busy: each yield lets the runtime look
/// at its sockets (without waiting) and run what became ready, then comes back here; once
/// nothing happened for the window, the spinner sleeps until the next activity.
async fn spin(io: Rc<Io>) {
    let Some(s) = &io.spin else { return };
    loop {
        s.parked.set(true);
        s.wake.notified().await;
        let mut seen = s.activity.get();
        let mut until = Instant::now() + s.window;
        loop {
            tokio::task::yield_now().await;
            let now = Instant::now();
            let activity = s.activity.get();
            if activity != seen {
                seen = activity;
                until = now + s.window;
            } else if now >= until {
                break;
            }
        }
    }
}
