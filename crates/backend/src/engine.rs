//! The per-reactor I/O engine: one io_uring with the reactor's arena registered as a fixed
//! buffer and its backing files registered as fixed files, or, where io_uring cannot be set up
//! or the config asks, a thread pool with the same interface.
//!
//! Operations are queued as SQEs and submitted together by [`Engine::submit_pending`], once per
//! reactor tick. Completions (from the ring or the pool) are signalled on one eventfd, which
//! tokio watches with `AsyncFd`: on readiness, [`Engine::clear_event`], then poll every
//! backend. Each logical unit has a queue-depth limit; beyond it, operations wait in order.
//!
//! Writes through the page cache are tried on the ring with `RWF_NOWAIT` first. A file system
//! that takes them without blocking (XFS) completes them inline in the submitting system
//! call; one that cannot (ext4 has no non-blocking buffered writes) refuses them at once instead
//! of io_uring handing each to its worker thread, which here cost more than the engine's own
//! threads (whole writes serialised per file behind one io-wq worker, and a wake-up of it per
//! write). A refused write goes to the engine's writer thread. XFS refuses too until a write
//! that may block has brought the file's timestamps up to date, and then takes them (one is
//! refused again when the timestamp's granularity has passed); ext4 refuses every one. So a
//! unit whose [`NOWAIT_PROBES`] writes tried after one of its writes completed on the writer
//! were all refused, none taken, sends its writes to the writer directly from then on.
//! One writer per engine, not the helper pool: a file system that refuses them serialises a
//! file's buffered writes on its inode lock anyway, and two threads contending for it cost
//! 1.3x the IOPS here (docs/performance.md).

use std::cell::RefCell;
use std::collections::VecDeque;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::rc::Rc;
use std::sync::Arc;

use io_uring::{opcode, types, IoUring, Probe};
use scsi_core::{Backend, BackendError, Op, Output, WriteSamePlan};
use slab::Slab;

use crate::arena::{Arena, Buffer};
use crate::file::{errno_to_error, FileHandle};
use crate::pool::{Done, Job, Pool};

/// Which engine to run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum EngineChoice {
    /// io_uring when it can be set up, else threads (logged once with the reason).
    #[default]
    Auto,
    /// io_uring or an error.
    Uring,
    /// The thread pool.
    Threads,
}

/// Engine settings.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EngineConfig {
    /// Which engine.
    pub engine: EngineChoice,
    /// Submission queue entries of the ring.
    pub ring_entries: u32,
    /// Worker threads: the whole engine for `Threads`, helpers for composite ops on io_uring.
    pub threads: usize,
    /// Register the arena and files with the ring (READ_FIXED/WRITE_FIXED, fixed files).
    pub register: bool,
    /// Operations in flight per logical unit; more wait in order.
    pub queue_depth: u32,
}

impl Default for EngineConfig {
    fn default() -> Self {
        EngineConfig {
            engine: EngineChoice::Auto,
            ring_entries: 256,
            threads: 4,
            register: true,
            queue_depth: 128,
        }
    }
}

/// The engine actually running.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EngineKind {
    /// io_uring.
    Uring,
    /// The thread pool.
    Threads,
}

/// Which io_uring opcodes the kernel has; those missing run on the helper threads.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct UringSupport {
    /// IORING_OP_READ / WRITE.
    pub read_write: bool,
    /// IORING_OP_READ_FIXED / WRITE_FIXED.
    pub fixed: bool,
    /// IORING_OP_FSYNC.
    pub fsync: bool,
    /// IORING_OP_FALLOCATE.
    pub fallocate: bool,
}

/// Fixed-file table size: logical units beyond it use plain descriptors.
const FILE_TABLE: u32 = 256;
/// Largest single SQE transfer.
const MAX_SQE_BYTES: usize = 1 << 30;

/// Buffered writes a unit tries with `RWF_NOWAIT` before, none taken, it stops trying.
pub const NOWAIT_PROBES: u8 = 16;

/// Where a unit's writes through the page cache go.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BufferedWrites {
    /// Not known yet: tried on the ring without blocking, none taken so far.
    Probe {
        /// Refusals counted so far.
        refused: u8,
        /// One of the unit's writes completed on the writer, so the file's timestamps are up
        /// to date: a refusal from now on is the file system's way, and counts.
        counting: bool,
    },
    /// The file system took one without blocking: tried on the ring first, each refused one
    /// on the engine's writer thread.
    Ring,
    /// The file system refused every probe: on the engine's writer thread.
    Threads,
}

/// One reactor's engine. Cloning shares it; it is not Send (one per reactor thread).
#[derive(Clone)]
pub struct Engine(Rc<RefCell<Inner>>);

struct Uring {
    ring: IoUring,
    arena: Option<Arena>,
    fixed_files: bool,
    free_files: Vec<u32>,
    support: UringSupport,
    queued: usize,
    in_flight: usize,
}

struct Lu {
    file: Arc<FileHandle>,
    fixed: Option<u32>,
    queue_depth: u32,
    in_flight: u32,
    waiting: VecDeque<usize>,
    completions: VecDeque<(u64, Result<Output, BackendError>, Buffer)>,
    closed: bool,
    buffered_writes: BufferedWrites,
}

/// A request's write through the page cache (neither FUA nor O_DSYNC), if it is one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum PageCacheWrite {
    /// Not such a write.
    No,
    /// On the ring with `RWF_NOWAIT` (`-EAGAIN`: "not without blocking"); `probe` when a
    /// refusal counts towards sending the unit's writes to the writer.
    Ring { probe: bool },
    /// On the writer thread.
    Writer,
}

struct Request {
    lu: usize,
    token: u64,
    op: Op,
    buf: Buffer,
    /// Bytes moved so far by a read or write (short transfers are resubmitted).
    done: usize,
    /// What is left of it as a write through the page cache (set by `ring_entry`).
    page_cache: PageCacheWrite,
}

// Field order is drop order: the pool and the writer join (finishing their jobs) and the ring
// drains before the buffers in `requests` are freed, and all before the eventfd closes.
struct Inner {
    pool: Pool,
    /// The thread for writes through the page cache that the ring refused, started at the
    /// first one.
    writer: Option<Pool>,
    uring: Option<Uring>,
    requests: Slab<Request>,
    lus: Slab<Lu>,
    reaped: Vec<Done>,
    cqes: Vec<(u64, i32)>,
    config: EngineConfig,
    fallback: Option<String>,
    eventfd: OwnedFd,
}

/// Writes 1 to an eventfd.
pub(crate) fn signal(fd: RawFd) {
    let one: u64 = 1;
    // Safety: writes 8 bytes from a live u64 to a descriptor the engine keeps open for as long
    // as any worker runs.
    unsafe {
        libc::write(fd, (&one as *const u64).cast(), 8);
    }
}

impl Engine {
    /// Sets up the engine `config` asks for; with `Auto`, falls back to threads (and logs why,
    /// once) when io_uring cannot be set up.
    pub fn new(config: EngineConfig) -> io::Result<Engine> {
        // Safety: eventfd takes integer flags and returns a new descriptor or -1.
        let fd = unsafe { libc::eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC) };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // Safety: fd is a fresh descriptor that nothing else owns.
        let eventfd = unsafe { OwnedFd::from_raw_fd(fd) };
        let (uring, fallback) = match config.engine {
            EngineChoice::Threads => (None, None),
            EngineChoice::Uring => (Some(Uring::new(&config, fd)?), None),
            EngineChoice::Auto => match Uring::new(&config, fd) {
                Ok(u) => (Some(u), None),
                Err(e) => {
                    let reason = format!("io_uring unavailable ({e}); using the thread pool");
                    // Every reactor falls back for the same reason: say it once per process.
                    static LOGGED: std::sync::atomic::AtomicBool =
                        std::sync::atomic::AtomicBool::new(false);
                    if !LOGGED.swap(true, std::sync::atomic::Ordering::Relaxed) {
                        tracing::warn!("{reason}");
                    }
                    (None, Some(reason))
                }
            },
        };
        let threads = if uring.is_some() {
            config.threads.clamp(1, 2)
        } else {
            config.threads
        };
        let pool = Pool::new(threads, fd, "backend-io")?;
        Ok(Engine(Rc::new(RefCell::new(Inner {
            pool,
            writer: None,
            uring,
            requests: Slab::with_capacity(1024),
            lus: Slab::new(),
            reaped: Vec::with_capacity(64),
            cqes: Vec::with_capacity(256),
            config,
            fallback,
            eventfd,
        }))))
    }

    /// The engine running.
    pub fn kind(&self) -> EngineKind {
        match self.0.borrow().uring {
            Some(_) => EngineKind::Uring,
            None => EngineKind::Threads,
        }
    }

    /// Why `Auto` fell back to threads, if it did.
    pub fn fallback_reason(&self) -> Option<String> {
        self.0.borrow().fallback.clone()
    }

    /// The opcodes the kernel's io_uring has (None on the thread pool).
    pub fn uring_support(&self) -> Option<UringSupport> {
        self.0.borrow().uring.as_ref().map(|u| u.support)
    }

    /// Whether reads and writes into `arena` buffers go through READ_FIXED/WRITE_FIXED.
    pub fn fixed_buffers(&self) -> bool {
        self.0
            .borrow()
            .uring
            .as_ref()
            .is_some_and(|u| u.arena.is_some())
    }

    /// Registers `arena` with the ring once, so its buffers are used with READ_FIXED and
    /// WRITE_FIXED. Without registration (config, thread pool, or the kernel refusing, e.g.
    /// RLIMIT_MEMLOCK) I/O still works, with plain reads and writes.
    pub fn register_arena(&self, arena: &Arena) -> io::Result<()> {
        let mut inner = self.0.borrow_mut();
        let register = inner.config.register;
        let Some(u) = inner.uring.as_mut() else {
            return Ok(());
        };
        if !register || !u.support.fixed {
            return Ok(());
        }
        if u.arena.is_some() {
            u.ring.submitter().unregister_buffers()?;
            u.arena = None;
        }
        let iov = libc::iovec {
            iov_base: arena.base().cast(),
            iov_len: arena.len(),
        };
        // Safety: the iovec covers the arena's mapping, which stays mapped while `u.arena`
        // holds a reference to it, that is, until it is unregistered or the ring is dropped.
        unsafe { u.ring.submitter().register_buffers(&[iov]) }?;
        u.arena = Some(arena.clone());
        Ok(())
    }

    /// Adds a file to the engine: the logical unit's backend.
    pub fn open(&self, file: FileHandle) -> FileBackend {
        let file = Arc::new(file);
        let mut inner = self.0.borrow_mut();
        let queue_depth = inner.config.queue_depth.max(1);
        let mut fixed = None;
        if let Some(u) = inner.uring.as_mut().filter(|u| u.fixed_files) {
            if let Some(slot) = u.free_files.pop() {
                match u
                    .ring
                    .submitter()
                    .register_files_update(slot, &[file.raw_fd()])
                {
                    Ok(_) => fixed = Some(slot),
                    Err(_) => u.free_files.push(slot),
                }
            }
        }
        let lu = inner.lus.insert(Lu {
            file: file.clone(),
            fixed,
            queue_depth,
            in_flight: 0,
            waiting: VecDeque::with_capacity(queue_depth as usize),
            completions: VecDeque::with_capacity(queue_depth as usize),
            closed: false,
            buffered_writes: BufferedWrites::Probe {
                refused: 0,
                counting: false,
            },
        });
        FileBackend {
            engine: self.clone(),
            lu,
            file,
        }
    }

    /// The descriptor completions are signalled on: register it with tokio's `AsyncFd`.
    pub fn event_fd(&self) -> RawFd {
        self.0.borrow().eventfd.as_raw_fd()
    }

    /// Resets the eventfd; call on readiness, before polling the backends.
    pub fn clear_event(&self) {
        let mut n: u64 = 0;
        // Safety: reads 8 bytes into a live u64 from a non-blocking eventfd.
        unsafe {
            libc::read(self.event_fd(), (&mut n as *mut u64).cast(), 8);
        }
    }

    /// Submits every queued SQE with one system call: call once per reactor tick.
    pub fn submit_pending(&self) -> io::Result<()> {
        let mut inner = self.0.borrow_mut();
        if let Some(u) = inner.uring.as_mut() {
            u.flush()?;
        }
        Ok(())
    }

    /// Operations started and not yet reaped.
    pub fn in_flight(&self) -> usize {
        let inner = self.0.borrow();
        inner.lus.iter().map(|(_, lu)| lu.in_flight as usize).sum()
    }

    /// Blocks until a completion is ready to poll: for tests, benches and simple drivers
    /// without an event loop. Returns false at once when nothing is in flight or ready.
    pub fn wait(&self) -> io::Result<bool> {
        self.submit_pending()?;
        self.reap();
        if self
            .0
            .borrow()
            .lus
            .iter()
            .any(|(_, l)| !l.completions.is_empty())
        {
            return Ok(true);
        }
        if self.in_flight() == 0 {
            return Ok(false);
        }
        let mut pfd = libc::pollfd {
            fd: self.event_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        // Safety: one pollfd, alive for the call.
        let r = unsafe { libc::poll(&mut pfd, 1, -1) };
        if r < 0 {
            let e = io::Error::last_os_error();
            if e.kind() != io::ErrorKind::Interrupted {
                return Err(e);
            }
        }
        self.clear_event();
        Ok(true)
    }

    fn submit(&self, lu: usize, token: u64, op: Op, buf: Buffer) {
        let mut inner = self.0.borrow_mut();
        let inner = &mut *inner;
        let l = &mut inner.lus[lu];
        if (buf.len() as u64) < op.buffer_len(l.file.block_size()) {
            l.completions
                .push_back((token, Err(BackendError::Internal), buf));
            return;
        }
        let id = inner.requests.insert(Request {
            lu,
            token,
            op,
            buf,
            done: 0,
            page_cache: PageCacheWrite::No,
        });
        if l.in_flight >= l.queue_depth || !l.waiting.is_empty() {
            l.waiting.push_back(id);
            return;
        }
        l.in_flight += 1;
        inner.issue(id);
    }

    /// Moves every finished operation to its logical unit's completion queue.
    fn reap(&self) {
        let mut inner = self.0.borrow_mut();
        inner.reap();
    }

    fn pop(&self, lu: usize) -> Option<(u64, Result<Output, BackendError>, Buffer)> {
        let mut inner = self.0.borrow_mut();
        inner.reap();
        inner.lus[lu].completions.pop_front()
    }

    fn close(&self, lu: usize) {
        let mut inner = self.0.borrow_mut();
        let l = &mut inner.lus[lu];
        l.closed = true;
        l.completions.clear();
        if l.in_flight == 0 {
            inner.retire_lu(lu);
        }
    }
}

/// A descriptor (a duplicate of it, owned) watched by the current tokio runtime for
/// readability: the engine's completion signal, or any other event channel a reactor waits on
/// (an RDMA device's completion and connection channels, an rdma_cm listener).
#[cfg(feature = "tokio")]
#[derive(Debug)]
pub struct Readiness(tokio::io::unix::AsyncFd<OwnedFd>);

#[cfg(feature = "tokio")]
impl Readiness {
    /// Watches `fd` in the current tokio runtime; the watch holds a duplicate, so it
    /// outlives nothing it names.
    pub fn new(fd: std::os::fd::BorrowedFd<'_>) -> io::Result<Readiness> {
        let owned = fd.try_clone_to_owned()?;
        // Safety: the OwnedFd is moved into the AsyncFd, stays open and names the same
        // descriptor until the AsyncFd is dropped.
        let fd = unsafe {
            tokio::io::unix::AsyncFd::register_with_interest(owned, tokio::io::Interest::READABLE)
        }
        .map_err(|e| e.into_parts().1)?;
        Ok(Readiness(fd))
    }

    /// Waits until the descriptor is readable, and clears that (the caller takes every event
    /// there is).
    pub async fn readable(&self) -> io::Result<()> {
        let mut guard = self.0.readable().await?;
        guard.clear_ready();
        Ok(())
    }

    /// Whether it was readable since the last call that said so (its readiness is then
    /// cleared: the caller takes every event there is); registers `cx` for the next.
    pub fn poll_readable(&self, cx: &mut std::task::Context<'_>) -> io::Result<bool> {
        match self.0.poll_read_ready(cx) {
            std::task::Poll::Ready(Ok(mut guard)) => {
                guard.clear_ready();
                Ok(true)
            }
            std::task::Poll::Ready(Err(e)) => Err(e),
            std::task::Poll::Pending => Ok(false),
        }
    }
}

/// The engine's completion signal as a tokio readiness source (one per reactor runtime).
#[cfg(feature = "tokio")]
pub struct Completions {
    fd: Readiness,
    engine: Engine,
}

#[cfg(feature = "tokio")]
impl Completions {
    /// Waits until a completion was signalled and resets the signal; then poll the backends.
    pub async fn ready(&self) -> io::Result<()> {
        self.fd.readable().await?;
        self.engine.clear_event();
        Ok(())
    }
}

#[cfg(feature = "tokio")]
impl Engine {
    /// Registers the completion eventfd with the current tokio runtime.
    pub fn completions(&self) -> io::Result<Completions> {
        // Safety: the engine holds its eventfd open while it lives, which the borrow does not
        // outlive (Readiness keeps a duplicate).
        let fd = unsafe { std::os::fd::BorrowedFd::borrow_raw(self.event_fd()) };
        Ok(Completions {
            fd: Readiness::new(fd)?,
            engine: self.clone(),
        })
    }
}

impl Uring {
    fn new(config: &EngineConfig, eventfd: RawFd) -> io::Result<Uring> {
        let ring = IoUring::new(config.ring_entries.max(8))?;
        let mut probe = Probe::new();
        ring.submitter().register_probe(&mut probe)?;
        let support = UringSupport {
            read_write: probe.is_supported(opcode::Read::CODE)
                && probe.is_supported(opcode::Write::CODE),
            fixed: probe.is_supported(opcode::ReadFixed::CODE)
                && probe.is_supported(opcode::WriteFixed::CODE),
            fsync: probe.is_supported(opcode::Fsync::CODE),
            fallocate: probe.is_supported(opcode::Fallocate::CODE),
        };
        if !support.read_write && !support.fixed {
            return Err(io::Error::other(
                "the kernel's io_uring cannot read or write",
            ));
        }
        ring.submitter().register_eventfd(eventfd)?;
        let mut fixed_files = false;
        if config.register && ring.submitter().register_files_sparse(FILE_TABLE).is_ok() {
            fixed_files = true;
        }
        Ok(Uring {
            ring,
            arena: None,
            fixed_files,
            free_files: if fixed_files {
                (0..FILE_TABLE).rev().collect()
            } else {
                Vec::new()
            },
            support,
            queued: 0,
            in_flight: 0,
        })
    }

    fn flush(&mut self) -> io::Result<()> {
        if self.queued > 0 {
            loop {
                match self.ring.submit() {
                    Ok(_) => break,
                    Err(e) if e.raw_os_error() == Some(libc::EINTR) => continue,
                    Err(e) if e.raw_os_error() == Some(libc::EBUSY) => {
                        // The completion queue is full: take completions first, then retry.
                        return Ok(());
                    }
                    Err(e) => return Err(e),
                }
            }
            self.queued = 0;
        }
        Ok(())
    }

    fn push(&mut self, sqe: io_uring::squeue::Entry) {
        loop {
            // Safety: every buffer an SQE points at is owned by a Request in the engine's
            // table until that SQE's completion is reaped (see Inner::issue).
            if unsafe { self.ring.submission().push(&sqe) }.is_ok() {
                break;
            }
            let _ = self.ring.submit();
            self.queued = 0;
        }
        self.queued += 1;
        self.in_flight += 1;
    }
}

/// The transfer still to do for a read or write: (file offset, buffer range, writing, fua).
fn transfer(op: &Op, bs: u32, done: usize) -> Option<(u64, usize, usize, bool, bool)> {
    let bs64 = u64::from(bs);
    match *op {
        Op::Read {
            lba,
            blocks,
            offset,
            ..
        } => Some((
            lba * bs64,
            offset as usize,
            blocks as usize * bs as usize,
            false,
            false,
        )),
        Op::Write {
            lba,
            blocks,
            offset,
            fua,
        } => Some((
            lba * bs64,
            offset as usize,
            blocks as usize * bs as usize,
            true,
            fua,
        )),
        _ => None,
    }
    .map(|(at, off, total, w, fua)| (at + done as u64, off + done, total - done, w, fua))
}

impl Inner {
    /// Starts (or continues) request `id`: on the ring when the kernel can do it there, else on
    /// the helper threads.
    fn issue(&mut self, id: usize) {
        let req = &mut self.requests[id];
        let lu = &self.lus[req.lu];
        let bs = lu.file.block_size();
        if let Some(u) = self.uring.as_mut() {
            if let Some(sqe) = ring_entry(u, lu, req, bs) {
                u.push(sqe.user_data(id as u64));
                return;
            }
        }
        self.on_threads(id);
    }

    /// Runs request `id` whole on the engine's threads (a write begun on the ring is written
    /// again from its start: the same bytes from the same buffer): a write through the page
    /// cache on the writer, anything else on the helper pool.
    fn on_threads(&mut self, id: usize) {
        let req = &mut self.requests[id];
        let lu = &self.lus[req.lu];
        let len = req.buf.len();
        let pool = if req.page_cache != PageCacheWrite::No {
            req.page_cache = PageCacheWrite::Writer;
            if self.writer.is_none() {
                match Pool::new(1, self.eventfd.as_raw_fd(), "backend-write") {
                    Ok(w) => self.writer = Some(w),
                    Err(e) => tracing::warn!("cannot start the engine's writer thread: {e}"),
                }
            }
            self.writer.as_ref().unwrap_or(&self.pool)
        } else {
            &self.pool
        };
        pool.push(Job {
            request: id,
            file: lu.file.clone(),
            op: req.op,
            ptr: req.buf.as_mut_ptr(),
            len,
        });
    }

    fn reap(&mut self) {
        if let Some(u) = self.uring.as_mut() {
            if u.in_flight > 0 {
                self.cqes
                    .extend(u.ring.completion().map(|c| (c.user_data(), c.result())));
                u.in_flight -= self.cqes.len();
                let mut cqes = std::mem::take(&mut self.cqes);
                for &(id, res) in &cqes {
                    self.ring_done(id as usize, res);
                }
                cqes.clear();
                self.cqes = cqes;
                // Completions made room: resubmit anything a full queue held back.
                let _ = self.uring.as_mut().map(Uring::flush);
            }
        }
        let mut reaped = std::mem::take(&mut self.reaped);
        self.pool.take_done(&mut reaped);
        if let Some(w) = &self.writer {
            w.take_done(&mut reaped);
        }
        for (id, result) in reaped.drain(..) {
            self.finish(id, result);
        }
        self.reaped = reaped;
    }

    fn ring_done(&mut self, id: usize, res: i32) {
        let req = &mut self.requests[id];
        let bs = self.lus[req.lu].file.block_size();
        let lba_at = |done: usize| match req.op {
            Op::Read { lba, .. } | Op::Write { lba, .. } => lba + (done / bs as usize) as u64,
            Op::Unmap { lba, .. } | Op::WriteSame { lba, .. } => lba,
            _ => 0,
        };
        let writing = !matches!(req.op, Op::Read { .. });
        if let PageCacheWrite::Ring { probe } = req.page_cache {
            let lu = &mut self.lus[req.lu];
            if res == -libc::EAGAIN || res == -libc::EOPNOTSUPP {
                if let BufferedWrites::Probe { refused, .. } = &mut lu.buffered_writes {
                    *refused += u8::from(probe);
                    if *refused >= NOWAIT_PROBES {
                        lu.buffered_writes = BufferedWrites::Threads;
                        tracing::debug!(
                            path = %lu.file.path().display(),
                            "writes through the page cache go to the engine's writer thread: \
                             the file system does not take them without blocking"
                        );
                    }
                }
                return self.on_threads(id);
            }
            if res >= 0 {
                lu.buffered_writes = BufferedWrites::Ring;
            }
        }
        if res < 0 {
            let e = errno_to_error(-res, writing, lba_at(req.done));
            return self.finish(id, Err(e));
        }
        if let Some((_, _, remaining, _, _)) = transfer(&req.op, bs, req.done) {
            let n = res as usize;
            if n < remaining {
                if n == 0 {
                    let lba = lba_at(req.done);
                    let e = if writing {
                        BackendError::Write { lba }
                    } else {
                        BackendError::Read { lba }
                    };
                    return self.finish(id, Err(e));
                }
                req.done += n;
                return self.issue(id);
            }
        }
        self.finish(id, Ok(Output::Done))
    }

    fn finish(&mut self, id: usize, result: Result<Output, BackendError>) {
        let req = self.requests.remove(id);
        let lu = req.lu;
        let l = &mut self.lus[lu];
        l.in_flight -= 1;
        if let (PageCacheWrite::Writer, Ok(_), BufferedWrites::Probe { counting, .. }) =
            (req.page_cache, &result, &mut l.buffered_writes)
        {
            *counting = true;
        }
        if l.closed {
            drop(req);
            if l.in_flight == 0 {
                self.retire_lu(lu);
            }
            return;
        }
        l.completions.push_back((req.token, result, req.buf));
        loop {
            let l = &mut self.lus[lu];
            if l.in_flight >= l.queue_depth {
                break;
            }
            let Some(next) = l.waiting.pop_front() else {
                break;
            };
            l.in_flight += 1;
            self.issue(next);
        }
    }

    /// Forgets a closed unit once nothing of it is in flight: its waiting requests are dropped
    /// and its fixed-file slot freed.
    fn retire_lu(&mut self, lu: usize) {
        while let Some(id) = self.lus[lu].waiting.pop_front() {
            self.requests.remove(id);
        }
        let l = self.lus.remove(lu);
        if let (Some(slot), Some(u)) = (l.fixed, self.uring.as_mut()) {
            if u.ring
                .submitter()
                .register_files_update(slot, &[-1])
                .is_ok()
            {
                u.free_files.push(slot);
            }
        }
    }
}

/// Builds `$e` with `$f` bound to the fixed-file slot when there is one, else the descriptor
/// (the two are different types in io-uring's API).
macro_rules! on_file {
    ($slot:expr, $fd:expr, |$f:ident| $e:expr) => {
        match $slot {
            Some(slot) => {
                let $f = types::Fixed(slot);
                $e
            }
            None => {
                let $f = types::Fd($fd);
                $e
            }
        }
    };
}

/// The SQE for a request, when the ring can run it.
fn ring_entry(u: &Uring, lu: &Lu, req: &mut Request, bs: u32) -> Option<io_uring::squeue::Entry> {
    req.page_cache = PageCacheWrite::No;
    if let Some((at, off, remaining, writing, fua)) = transfer(&req.op, bs, req.done) {
        let len = remaining.min(MAX_SQE_BYTES) as u32;
        let ptr = req.buf[off..].as_mut_ptr();
        let (fd, primary) = lu.file.fd_for(ptr, at, len as usize);
        let fixed_buf = u.arena.as_ref().is_some_and(|a| a.same(req.buf.arena()));
        if (fixed_buf && !u.support.fixed) || (!fixed_buf && !u.support.read_write) {
            return None;
        }
        let mut rw_flags = if fua && !lu.file.write_through() {
            libc::RWF_DSYNC
        } else {
            0
        };
        // Through the page cache, not synchronous (a synchronous write blocks anyway): tried
        // without blocking, or straight to the writer once the unit is known to refuse.
        if writing && !fua && !lu.file.write_through() && lu.file.buffered(primary) {
            if lu.buffered_writes == BufferedWrites::Threads {
                req.page_cache = PageCacheWrite::Writer;
                return None;
            }
            req.page_cache = PageCacheWrite::Ring {
                probe: matches!(
                    lu.buffered_writes,
                    BufferedWrites::Probe { counting: true, .. }
                ),
            };
            rw_flags |= libc::RWF_NOWAIT;
        }
        // The O_DIRECT descriptor is the registered one; the buffered one never is.
        let slot = lu.fixed.filter(|_| primary);
        return Some(on_file!(slot, fd, |f| match (writing, fixed_buf) {
            (false, true) => opcode::ReadFixed::new(f, ptr, len, 0).offset(at).build(),
            (false, false) => opcode::Read::new(f, ptr, len).offset(at).build(),
            (true, true) => opcode::WriteFixed::new(f, ptr, len, 0)
                .offset(at)
                .rw_flags(rw_flags)
                .build(),
            (true, false) => opcode::Write::new(f, ptr, len)
                .offset(at)
                .rw_flags(rw_flags)
                .build(),
        }));
    }
    let bsz = u64::from(bs);
    let fd = lu.file.raw_fd();
    let punch = |lba: u64, blocks: u64| {
        on_file!(lu.fixed, fd, |f| opcode::Fallocate::new(f, blocks * bsz)
            .offset(lba * bsz)
            .mode(libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE)
            .build())
    };
    match req.op {
        Op::Flush { .. } if u.support.fsync => Some(on_file!(lu.fixed, fd, |f| {
            opcode::Fsync::new(f)
                .flags(types::FsyncFlags::DATASYNC)
                .build()
        })),
        Op::Unmap { lba, blocks } if u.support.fallocate => Some(punch(lba, blocks)),
        Op::WriteSame { lba, blocks, .. }
            if u.support.fallocate
                && req.op.write_same_plan(&req.buf, bs as usize)
                    == Some(WriteSamePlan::Deallocate) =>
        {
            Some(punch(lba, blocks))
        }
        _ => None,
    }
}

impl Drop for Inner {
    /// Waits for the kernel to finish with every buffer before they are freed.
    fn drop(&mut self) {
        if let Some(u) = self.uring.as_mut() {
            while u.in_flight > 0 {
                if u.ring.submit_and_wait(1).is_err() {
                    break;
                }
                let n = u.ring.completion().count();
                u.in_flight -= n;
            }
        }
    }
}

/// A logical unit on a file or block device, driven by its reactor's [`Engine`].
pub struct FileBackend {
    engine: Engine,
    lu: usize,
    file: Arc<FileHandle>,
}

impl std::fmt::Debug for FileBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FileBackend")
            .field("path", &self.file.path())
            .field("blocks", &self.file.blocks())
            .finish()
    }
}

impl FileBackend {
    /// The open file.
    pub fn file(&self) -> &FileHandle {
        &self.file
    }

    /// The engine driving it.
    pub fn engine(&self) -> &Engine {
        &self.engine
    }

    /// Where this unit's writes through the page cache go on this engine (learnt from its
    /// first writes; see the module's documentation).
    pub fn buffered_writes(&self) -> BufferedWrites {
        self.engine.0.borrow().lus[self.lu].buffered_writes
    }

    /// Changes this unit's queue-depth limit.
    pub fn set_queue_depth(&self, depth: u32) {
        self.engine.0.borrow_mut().lus[self.lu].queue_depth = depth.max(1);
    }
}

impl Backend for FileBackend {
    type Buffer = Buffer;

    fn submit(&mut self, token: u64, op: Op, buf: Buffer) {
        self.engine.submit(self.lu, token, op, buf);
    }

    fn poll_completion(&mut self) -> Option<(u64, Result<Output, BackendError>, Buffer)> {
        self.engine.pop(self.lu)
    }
}

impl Drop for FileBackend {
    fn drop(&mut self) {
        self.engine.close(self.lu);
    }
}
