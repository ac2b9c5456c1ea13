//! The buffer arena: one mapping per reactor, cut into slots, registered once with the
//! reactor's ring (and, with RDMA, once as a memory region), so no I/O pays for registration.
//!
//! A [`Buffer`] is a run of adjacent slots and the unique owner of them; dropping it returns
//! the slots. Because a run is contiguous, every buffer is one slice: one SQE reads a whole
//! command, and Data-In is sent from one slice. When slots run out, [`Arena::alloc`] waits in
//! arrival order (backpressure) instead of failing or allocating; the head of the queue is
//! served first, so a large request is never starved by small ones behind it.
//!
//! A [`Share`] bounds what one user (a connection) holds of the arena, so one that stops
//! giving buffers back (an initiator that stops reading Data-In) cannot take the slots that
//! everyone else on the reactor needs: its requests beyond the share wait in the share, not
//! in the arena's queue, so they hold no place there either.

use std::cell::{Cell, RefCell};
use std::collections::VecDeque;
use std::future::Future;
use std::pin::Pin;
use std::ptr::NonNull;
use std::rc::Rc;
use std::task::{Context, Poll, Waker};

/// The largest arena: io_uring registers at most 1 GiB per buffer, and the arena is registered
/// as one buffer (index 0).
pub const MAX_ARENA_BYTES: usize = 1 << 30;

const PAGE: usize = 4096;
const HUGE_PAGE: usize = 2 << 20;

/// How the arena is laid out.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ArenaConfig {
    /// Bytes per slot, a multiple of 4096.
    pub slot_size: usize,
    /// Number of slots.
    pub slots: usize,
    /// Try explicit huge pages (MAP_HUGETLB) first, then transparent huge pages.
    pub huge_pages: bool,
}

impl Default for ArenaConfig {
    /// 512 slots of 128 KiB: 64 MiB per reactor.
    fn default() -> Self {
        ArenaConfig {
            slot_size: 128 << 10,
            slots: 512,
            huge_pages: true,
        }
    }
}

/// What backs the arena's pages.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HugePages {
    /// MAP_HUGETLB: reserved 2 MiB pages.
    Explicit,
    /// Plain pages advised MADV_HUGEPAGE; the kernel may back them with huge pages.
    Transparent,
    /// Plain 4 KiB pages.
    None,
}

/// Why an arena or a buffer could not be had.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[non_exhaustive]
pub enum ArenaError {
    /// The layout is invalid.
    #[error("arena: {0}")]
    Config(&'static str),
    /// mmap failed.
    #[error("arena: mmap of {bytes} bytes failed: errno {errno}")]
    Map {
        /// Bytes asked for.
        bytes: usize,
        /// The errno.
        errno: i32,
    },
    /// A request larger than the whole arena can never be served.
    #[error("buffer of {len} bytes exceeds the arena ({max} bytes)")]
    TooLarge {
        /// Bytes asked for.
        len: usize,
        /// The arena's size.
        max: usize,
    },
}

/// One reactor's buffer arena. Cloning shares it.
#[derive(Clone)]
pub struct Arena(Rc<Inner>);

struct Inner {
    base: NonNull<u8>,
    len: usize,
    map_len: usize,
    slot_size: usize,
    slots: usize,
    huge: HugePages,
    /// One bit per slot, set when free.
    free: RefCell<Vec<u64>>,
    free_slots: Cell<usize>,
    waiters: RefCell<VecDeque<Waiter>>,
    next_ticket: Cell<u64>,
}

struct Waiter {
    ticket: u64,
    waker: Waker,
}

impl std::fmt::Debug for Arena {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Arena")
            .field("len", &self.0.len)
            .field("slot_size", &self.0.slot_size)
            .field("free_slots", &self.0.free_slots.get())
            .field("huge_pages", &self.0.huge)
            .finish()
    }
}

impl Arena {
    /// Maps and cuts an arena.
    pub fn new(config: ArenaConfig) -> Result<Arena, ArenaError> {
        if config.slot_size == 0 || config.slot_size % PAGE != 0 {
            return Err(ArenaError::Config(
                "slot size must be a non-zero multiple of 4096",
            ));
        }
        if config.slots == 0 || config.slots > u32::MAX as usize {
            return Err(ArenaError::Config("slot count must be at least 1"));
        }
        let len = config
            .slot_size
            .checked_mul(config.slots)
            .filter(|&l| l <= MAX_ARENA_BYTES)
            .ok_or(ArenaError::Config(
                "slot size x slots must be at most 1 GiB",
            ))?;
        let (base, map_len, huge) = map(len, config.huge_pages)?;
        let words = config.slots.div_ceil(64);
        let mut free = vec![u64::MAX; words];
        if config.slots % 64 != 0 {
            free[words - 1] = (1u64 << (config.slots % 64)) - 1;
        }
        Ok(Arena(Rc::new(Inner {
            base,
            len,
            map_len,
            slot_size: config.slot_size,
            slots: config.slots,
            huge,
            free: RefCell::new(free),
            free_slots: Cell::new(config.slots),
            waiters: RefCell::new(VecDeque::new()),
            next_ticket: Cell::new(0),
        })))
    }

    /// Start of the mapping, for registering it with a ring or as an RDMA memory region.
    pub fn base(&self) -> *mut u8 {
        self.0.base.as_ptr()
    }

    /// Bytes of the arena usable for slots.
    pub fn len(&self) -> usize {
        self.0.len
    }

    /// Never: an arena has at least one slot.
    pub fn is_empty(&self) -> bool {
        false
    }

    /// Bytes per slot.
    pub fn slot_size(&self) -> usize {
        self.0.slot_size
    }

    /// Free slots now.
    pub fn free_slots(&self) -> usize {
        self.0.free_slots.get()
    }

    /// Requests waiting for slots.
    pub fn waiting(&self) -> usize {
        self.0.waiters.borrow().len()
    }

    /// What backs the pages.
    pub fn huge_pages(&self) -> HugePages {
        self.0.huge
    }

    /// Whether `ptr..ptr+len` lies in this arena (a buffer from it).
    pub fn contains(&self, ptr: *const u8, len: usize) -> bool {
        let base = self.base() as usize;
        let p = ptr as usize;
        p >= base && p + len <= base + self.0.len
    }

    /// Whether `other` is this same arena.
    pub fn same(&self, other: &Arena) -> bool {
        Rc::ptr_eq(&self.0, &other.0)
    }

    fn slots_for(&self, len: usize) -> Result<usize, ArenaError> {
        if len > self.0.len {
            return Err(ArenaError::TooLarge {
                len,
                max: self.0.len,
            });
        }
        Ok(len.div_ceil(self.0.slot_size))
    }

    /// A buffer of `len` bytes now, or `Ok(None)` when it would have to wait (no room, or
    /// earlier requests are already waiting).
    pub fn try_alloc(&self, len: usize) -> Result<Option<Buffer>, ArenaError> {
        let count = self.slots_for(len)?;
        // An empty buffer takes no slot, so it jumps no queue.
        if count > 0 && !self.0.waiters.borrow().is_empty() {
            return Ok(None);
        }
        Ok(self.take(count, len))
    }

    /// A buffer of `len` bytes, waiting in arrival order while slots are short.
    pub fn alloc(&self, len: usize) -> Alloc<'_> {
        Alloc {
            arena: self,
            len,
            ticket: None,
        }
    }

    /// Takes the first run of `count` free slots.
    fn take(&self, count: usize, len: usize) -> Option<Buffer> {
        if count == 0 {
            return Some(Buffer {
                arena: self.clone(),
                first: 0,
                count: 0,
                len: 0,
                share: None,
            });
        }
        if self.0.free_slots.get() < count {
            return None;
        }
        let mut free = self.0.free.borrow_mut();
        let first = find_run(&free, self.0.slots, count)?;
        for s in first..first + count {
            free[s / 64] &= !(1u64 << (s % 64));
        }
        self.0.free_slots.set(self.0.free_slots.get() - count);
        Some(Buffer {
            arena: self.clone(),
            first: first as u32,
            count: count as u32,
            len,
            share: None,
        })
    }

    fn give_back(&self, first: usize, count: usize) {
        {
            let mut free = self.0.free.borrow_mut();
            for s in first..first + count {
                free[s / 64] |= 1u64 << (s % 64);
            }
        }
        self.0.free_slots.set(self.0.free_slots.get() + count);
        self.wake_head();
    }

    fn wake_head(&self) {
        if let Some(w) = self.0.waiters.borrow().front() {
            w.waker.wake_by_ref();
        }
    }
}

/// Finds the first run of `count` free slots (bits set) among `slots`.
fn find_run(free: &[u64], slots: usize, count: usize) -> Option<usize> {
    if count == 1 {
        return free
            .iter()
            .position(|&w| w != 0)
            .map(|i| i * 64 + free[i].trailing_zeros() as usize);
    }
    let mut start = 0;
    let mut run = 0;
    let mut s = 0;
    while s < slots {
        let word = free[s / 64] >> (s % 64);
        if s % 64 == 0 && word == 0 {
            run = 0;
            s += 64;
            start = s;
            continue;
        }
        if word & 1 == 1 {
            run += 1;
            if run == count {
                return Some(start);
            }
        } else {
            run = 0;
            start = s + 1;
        }
        s += 1;
    }
    None
}

impl Drop for Inner {
    fn drop(&mut self) {
        // Safety: base/map_len are exactly what mmap returned in `map`, and no buffer is left
        // (each holds a reference to this Inner), so nothing points into the mapping.
        unsafe {
            libc::munmap(self.base.as_ptr().cast(), self.map_len);
        }
    }
}

fn map(len: usize, huge: bool) -> Result<(NonNull<u8>, usize, HugePages), ArenaError> {
    let prot = libc::PROT_READ | libc::PROT_WRITE;
    let flags = libc::MAP_PRIVATE | libc::MAP_ANONYMOUS;
    if huge {
        let huge_len = len.div_ceil(HUGE_PAGE) * HUGE_PAGE;
        // Safety: an anonymous mapping at no fixed address; the kernel checks every argument.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                huge_len,
                prot,
                flags | libc::MAP_HUGETLB | libc::MAP_POPULATE,
                -1,
                0,
            )
        };
        if p != libc::MAP_FAILED {
            if let Some(base) = NonNull::new(p.cast()) {
                return Ok((base, huge_len, HugePages::Explicit));
            }
        }
    }
    // Safety: as above, without huge pages.
    let p = unsafe { libc::mmap(std::ptr::null_mut(), len, prot, flags, -1, 0) };
    if p == libc::MAP_FAILED {
        return Err(ArenaError::Map {
            bytes: len,
            errno: std::io::Error::last_os_error().raw_os_error().unwrap_or(0),
        });
    }
    let base = NonNull::new(p.cast()).ok_or(ArenaError::Map {
        bytes: len,
        errno: 0,
    })?;
    let mut backing = HugePages::None;
    if huge && len >= HUGE_PAGE {
        // Safety: advice on the mapping just made; it changes no memory contents.
        if unsafe { libc::madvise(p, len, libc::MADV_HUGEPAGE) } == 0 {
            backing = HugePages::Transparent;
        }
    }
    Ok((base, len, backing))
}

/// A future for [`Arena::alloc`]: resolves to a buffer once slots are free and every earlier
/// waiter has been served. Dropping it gives up its place.
pub struct Alloc<'a> {
    arena: &'a Arena,
    len: usize,
    ticket: Option<u64>,
}

impl Future for Alloc<'_> {
    type Output = Result<Buffer, ArenaError>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let arena = self.arena;
        let count = match arena.slots_for(self.len) {
            Ok(c) => c,
            Err(e) => return Poll::Ready(Err(e)),
        };
        let inner = &arena.0;
        match self.ticket {
            None => {
                if inner.waiters.borrow().is_empty() {
                    if let Some(b) = arena.take(count, self.len) {
                        return Poll::Ready(Ok(b));
                    }
                }
                let ticket = inner.next_ticket.get();
                inner.next_ticket.set(ticket + 1);
                inner.waiters.borrow_mut().push_back(Waiter {
                    ticket,
                    waker: cx.waker().clone(),
                });
                self.ticket = Some(ticket);
                Poll::Pending
            }
            Some(ticket) => {
                let head = inner.waiters.borrow().front().map(|w| w.ticket) == Some(ticket);
                if head {
                    if let Some(b) = arena.take(count, self.len) {
                        inner.waiters.borrow_mut().pop_front();
                        self.ticket = None;
                        // The next waiter may fit in what is left.
                        arena.wake_head();
                        return Poll::Ready(Ok(b));
                    }
                }
                let mut waiters = inner.waiters.borrow_mut();
                if let Some(w) = waiters.iter_mut().find(|w| w.ticket == ticket) {
                    if !w.waker.will_wake(cx.waker()) {
                        w.waker = cx.waker().clone();
                    }
                }
                Poll::Pending
            }
        }
    }
}

impl Drop for Alloc<'_> {
    fn drop(&mut self) {
        if let Some(ticket) = self.ticket {
            let inner = &self.arena.0;
            let was_head = {
                let mut waiters = inner.waiters.borrow_mut();
                let i = waiters.iter().position(|w| w.ticket == ticket);
                if let Some(i) = i {
                    waiters.remove(i);
                }
                i == Some(0)
            };
            if was_head {
                self.arena.wake_head();
            }
        }
    }
}

/// A run of adjacent slots, owned: one contiguous slice of `len` bytes. Dropping it frees the
/// slots and wakes the first waiter.
pub struct Buffer {
    arena: Arena,
    first: u32,
    count: u32,
    len: usize,
    /// The share its slots count against, if any.
    share: Option<Rc<ShareInner>>,
}

impl std::fmt::Debug for Buffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Buffer")
            .field("first_slot", &self.first)
            .field("slots", &self.count)
            .field("len", &self.len)
            .finish()
    }
}

impl Buffer {
    /// The arena this buffer belongs to.
    pub fn arena(&self) -> &Arena {
        &self.arena
    }

    /// First slot index: how state machines name a buffer without a pointer.
    pub fn first_slot(&self) -> u32 {
        self.first
    }

    /// Number of slots held.
    pub fn slots(&self) -> u32 {
        self.count
    }

    /// Bytes its slots hold (at least its length).
    pub fn capacity(&self) -> usize {
        self.count as usize * self.arena.0.slot_size
    }

    /// Changes the usable length within the slots held.
    ///
    /// # Panics
    /// When `len` exceeds [`Buffer::capacity`].
    pub fn set_len(&mut self, len: usize) {
        assert!(len <= self.capacity(), "buffer length beyond its slots");
        self.len = len;
    }

    fn start(&self) -> *mut u8 {
        // Safety: first * slot_size is within the mapping for a non-empty buffer, and equals 0
        // for an empty one.
        unsafe {
            self.arena
                .base()
                .add(self.first as usize * self.arena.0.slot_size)
        }
    }
}

impl std::ops::Deref for Buffer {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        // Safety: the slots [first, first+count) belong to this handle alone (taken from the
        // free map, returned only in Drop), len <= count * slot_size, and the mapping lives as
        // long as the arena reference this buffer holds.
        unsafe { std::slice::from_raw_parts(self.start(), self.len) }
    }
}

impl std::ops::DerefMut for Buffer {
    fn deref_mut(&mut self) -> &mut [u8] {
        // Safety: as in deref; &mut self makes this the only live view.
        unsafe { std::slice::from_raw_parts_mut(self.start(), self.len) }
    }
}

/// The task layer of scsi-core holds a task's data in a buffer of this arena.
impl scsi_core::transport::TaskBuffer for Buffer {
    fn capacity(&self) -> usize {
        Buffer::capacity(self)
    }

    fn set_len(&mut self, len: usize) {
        Buffer::set_len(self, len);
    }
}

impl Drop for Buffer {
    fn drop(&mut self) {
        if self.count > 0 {
            self.arena
                .give_back(self.first as usize, self.count as usize);
        }
        if let Some(share) = self.share.take() {
            share.release(self.count as usize);
        }
    }
}

/// A bounded part of an arena for one user: the slots its buffers hold together never exceed
/// the share's limit, except that a single request larger than the limit is served when the
/// user holds nothing (so any request the arena could serve is served). Requests beyond the
/// share wait for the user's own buffers to come back, before they queue in the arena.
/// Cloning shares it.
#[derive(Clone)]
pub struct Share(Rc<ShareInner>);

struct ShareInner {
    arena: Arena,
    /// The most slots held at once.
    limit: usize,
    /// Slots held by buffers, or reserved by an allocation queued in the arena.
    held: Cell<usize>,
    /// Allocations waiting for the share to have room.
    waiters: RefCell<Vec<Waker>>,
}

impl ShareInner {
    /// Reserves `count` slots if the share has room for them.
    fn reserve(&self, count: usize) -> bool {
        let held = self.held.get();
        if count > 0 && held > 0 && held + count > self.limit {
            return false;
        }
        self.held.set(held + count);
        true
    }

    fn release(&self, count: usize) {
        self.held.set(self.held.get() - count);
        for w in self.waiters.borrow_mut().drain(..) {
            w.wake();
        }
    }
}

impl std::fmt::Debug for Share {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Share")
            .field("limit", &self.limit())
            .field("held", &self.held())
            .finish()
    }
}

impl Share {
    /// A share of `arena` of at most `limit` bytes (rounded up to whole slots, at least one).
    pub fn new(arena: &Arena, limit: usize) -> Share {
        let slots = limit.div_ceil(arena.0.slot_size).max(1);
        Share(Rc::new(ShareInner {
            arena: arena.clone(),
            limit: slots,
            held: Cell::new(0),
            waiters: RefCell::new(Vec::new()),
        }))
    }

    /// The most bytes its buffers hold at once.
    pub fn limit(&self) -> usize {
        self.0.limit * self.0.arena.0.slot_size
    }

    /// Bytes its buffers hold now (whole slots), with what queued allocations reserved.
    pub fn held(&self) -> usize {
        self.0.held.get() * self.0.arena.0.slot_size
    }

    /// A buffer of `len` bytes now, or `Ok(None)` when it would have to wait: the share is
    /// full, an allocation of this share waits already, or the arena would make it wait.
    pub fn try_alloc(&self, len: usize) -> Result<Option<Buffer>, ArenaError> {
        let inner = &self.0;
        let count = inner.arena.slots_for(len)?;
        if count > 0 && !inner.waiters.borrow().is_empty() || !inner.reserve(count) {
            return Ok(None);
        }
        match inner.arena.try_alloc(len) {
            Ok(Some(mut b)) => {
                b.share = Some(inner.clone());
                Ok(Some(b))
            }
            other => {
                inner.release(count);
                other
            }
        }
    }

    /// A buffer of `len` bytes: waits for room in the share, then in the arena's queue.
    pub fn alloc(&self, len: usize) -> ShareAlloc<'_> {
        ShareAlloc {
            share: self,
            len,
            reserved: 0,
            alloc: None,
        }
    }
}

/// A future for [`Share::alloc`]. Dropping it gives up its reservation and its place.
pub struct ShareAlloc<'a> {
    share: &'a Share,
    len: usize,
    /// Slots reserved in the share while queued in the arena.
    reserved: usize,
    alloc: Option<Alloc<'a>>,
}

impl Future for ShareAlloc<'_> {
    type Output = Result<Buffer, ArenaError>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let inner = &self.share.0;
        if self.alloc.is_none() {
            let count = match inner.arena.slots_for(self.len) {
                Ok(c) => c,
                Err(e) => return Poll::Ready(Err(e)),
            };
            if !inner.reserve(count) {
                let mut waiters = inner.waiters.borrow_mut();
                if !waiters.iter().any(|w| w.will_wake(cx.waker())) {
                    waiters.push(cx.waker().clone());
                }
                return Poll::Pending;
            }
            self.reserved = count;
            let arena = &self.share.0.arena;
            self.alloc = Some(arena.alloc(self.len));
        }
        let alloc = self.alloc.as_mut().expect("set above");
        let r = std::task::ready!(Pin::new(alloc).poll(cx));
        self.alloc = None;
        let count = std::mem::take(&mut self.reserved);
        Poll::Ready(match r {
            Ok(mut b) => {
                b.share = Some(self.share.0.clone());
                Ok(b)
            }
            Err(e) => {
                self.share.0.release(count);
                Err(e)
            }
        })
    }
}

impl Drop for ShareAlloc<'_> {
    fn drop(&mut self) {
        // The arena's place is given up by the inner allocation's own drop.
        self.alloc = None;
        if self.reserved > 0 {
            self.share.0.release(self.reserved);
        }
    }
}

// Safety: an arena's mapping of `size` bytes from `base` stays mapped, at the same address,
// while any clone lives (the clones share one reference-counted mapping, unmapped when the
// last goes); `same` compares that shared mapping.
#[cfg(feature = "rdma")]
unsafe impl rdma::ibverbs::RegisteredMemory for Arena {
    fn base(&self) -> *mut u8 {
        Arena::base(self)
    }

    fn size(&self) -> usize {
        Arena::len(self)
    }

    fn same(&self, other: &Arena) -> bool {
        Arena::same(self, other)
    }
}

// Safety: a buffer's bytes are a fixed run of slots of its arena's mapping, which the buffer
// keeps alive (the arena is reference counted) and hands to no one else while it lives.
#[cfg(feature = "rdma")]
unsafe impl rdma::ibverbs::Registered for Buffer {}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use std::task::Wake;

    struct Flag(std::sync::atomic::AtomicBool);
    impl Wake for Flag {
        fn wake(self: Arc<Self>) {
            self.0.store(true, std::sync::atomic::Ordering::SeqCst);
        }
    }

    fn small(slots: usize) -> Arena {
        Arena::new(ArenaConfig {
            slot_size: 4096,
            slots,
            huge_pages: false,
        })
        .unwrap()
    }

    #[test]
    fn runs_are_contiguous_and_freed_on_drop() {
        let a = small(70);
        let b1 = a.try_alloc(4096).unwrap().unwrap();
        let b2 = a.try_alloc(3 * 4096 - 5).unwrap().unwrap();
        assert_eq!((b1.first_slot(), b2.first_slot(), b2.slots()), (0, 1, 3));
        assert_eq!(b2.len(), 3 * 4096 - 5);
        drop(b1);
        // Slot 0 is free but a 2-slot run must come after b2.
        let b3 = a.try_alloc(8192).unwrap().unwrap();
        assert_eq!(b3.first_slot(), 4);
        let big = a.try_alloc(65 * 4096).unwrap();
        assert!(big.is_none(), "65 adjacent slots are not free");
        drop(b2);
        drop(b3);
        let all = a.try_alloc(70 * 4096).unwrap().unwrap();
        assert_eq!(all.slots(), 70);
        assert_eq!(a.free_slots(), 0);
        assert!(matches!(
            a.try_alloc(71 * 4096),
            Err(ArenaError::TooLarge { .. })
        ));
        let empty = a.try_alloc(0).unwrap().unwrap();
        assert!(empty.is_empty());
    }

    #[test]
    fn buffers_do_not_alias() {
        let a = small(8);
        let mut x = a.try_alloc(4096).unwrap().unwrap();
        let mut y = a.try_alloc(4096).unwrap().unwrap();
        x.fill(1);
        y.fill(2);
        assert!(x.iter().all(|&b| b == 1) && y.iter().all(|&b| b == 2));
        assert!(a.contains(x.as_ptr(), x.len()));
    }

    #[test]
    fn waiters_are_served_in_order() {
        let a = small(4);
        let hold = a.try_alloc(4 * 4096).unwrap().unwrap();
        let flag = Arc::new(Flag(false.into()));
        let waker = Waker::from(flag.clone());
        let mut cx = Context::from_waker(&waker);
        let mut first = Box::pin(a.alloc(3 * 4096));
        let mut second = Box::pin(a.alloc(4096));
        assert!(first.as_mut().poll(&mut cx).is_pending());
        assert!(second.as_mut().poll(&mut cx).is_pending());
        assert_eq!(a.waiting(), 2);
        // A newcomer may not jump the queue.
        assert!(a.try_alloc(4096).unwrap().is_none());
        drop(hold);
        assert!(flag.0.load(std::sync::atomic::Ordering::SeqCst));
        // The second cannot overtake the first even though it would fit.
        assert!(second.as_mut().poll(&mut cx).is_pending());
        let Poll::Ready(Ok(f)) = first.as_mut().poll(&mut cx) else {
            panic!("head waiter not served")
        };
        let Poll::Ready(Ok(s)) = second.as_mut().poll(&mut cx) else {
            panic!("second waiter not served after the first")
        };
        assert_eq!((f.slots(), s.slots()), (3, 1));
        assert_eq!(a.waiting(), 0);
    }

    #[test]
    fn a_share_bounds_what_one_user_holds_and_waits_outside_the_arena_queue() {
        let a = small(8);
        let stalled = Share::new(&a, 3 * 4096);
        let other = Share::new(&a, 3 * 4096);
        assert_eq!(stalled.limit(), 3 * 4096);
        let x = stalled.try_alloc(2 * 4096).unwrap().unwrap();
        let y = stalled.try_alloc(4096).unwrap().unwrap();
        assert_eq!(stalled.held(), 3 * 4096);
        // Full: refused now, and a waiting allocation holds no place in the arena's queue.
        assert!(stalled.try_alloc(4096).unwrap().is_none());
        let flag = Arc::new(Flag(false.into()));
        let waker = Waker::from(flag.clone());
        let mut cx = Context::from_waker(&waker);
        let mut waiting = Box::pin(stalled.alloc(4096));
        assert!(waiting.as_mut().poll(&mut cx).is_pending());
        assert_eq!(a.waiting(), 0);
        let z = other.try_alloc(3 * 4096).unwrap().unwrap();
        assert_eq!(
            a.free_slots(),
            2,
            "the arena has room the stalled user may not take"
        );
        // One of its own buffers back: the waiting allocation is woken and served.
        drop(y);
        assert!(flag.0.load(std::sync::atomic::Ordering::SeqCst));
        let Poll::Ready(Ok(w)) = waiting.as_mut().poll(&mut cx) else {
            panic!("not served after a buffer of the share came back")
        };
        assert_eq!(stalled.held(), 3 * 4096);
        drop((x, w, z));
        assert_eq!((stalled.held(), other.held(), a.free_slots()), (0, 0, 8));
    }

    #[test]
    fn a_request_beyond_the_share_is_served_when_the_user_holds_nothing() {
        let a = small(8);
        let s = Share::new(&a, 4096);
        let big = s.try_alloc(5 * 4096).unwrap().unwrap();
        assert_eq!(s.held(), 5 * 4096);
        assert!(s.try_alloc(4096).unwrap().is_none());
        drop(big);
        assert!(s.try_alloc(4096).unwrap().is_some());
        assert!(matches!(
            s.try_alloc(9 * 4096),
            Err(ArenaError::TooLarge { .. })
        ));
    }

    #[test]
    fn a_cancelled_share_allocation_gives_its_reservation_back() {
        let a = small(4);
        let s = Share::new(&a, 4 * 4096);
        let hold = a.try_alloc(4 * 4096).unwrap().unwrap();
        let flag = Arc::new(Flag(false.into()));
        let waker = Waker::from(flag.clone());
        let mut cx = Context::from_waker(&waker);
        let mut queued = Box::pin(s.alloc(2 * 4096));
        // Room in the share, none in the arena: reserved, and queued in the arena.
        assert!(queued.as_mut().poll(&mut cx).is_pending());
        assert_eq!((s.held(), a.waiting()), (2 * 4096, 1));
        drop(queued);
        assert_eq!((s.held(), a.waiting()), (0, 0));
        drop(hold);
        assert_eq!(s.try_alloc(4 * 4096).unwrap().unwrap().slots(), 4);
    }

    #[test]
    fn a_cancelled_head_passes_its_turn_on() {
        let a = small(2);
        let hold = a.try_alloc(2 * 4096).unwrap().unwrap();
        let flag = Arc::new(Flag(false.into()));
        let waker = Waker::from(flag.clone());
        let mut cx = Context::from_waker(&waker);
        let mut first = Box::pin(a.alloc(2 * 4096));
        let mut second = Box::pin(a.alloc(4096));
        assert!(first.as_mut().poll(&mut cx).is_pending());
        assert!(second.as_mut().poll(&mut cx).is_pending());
        drop(first);
        drop(hold);
        assert!(matches!(second.as_mut().poll(&mut cx), Poll::Ready(Ok(_))));
    }

    #[test]
    fn find_run_crosses_words() {
        let mut free = vec![0u64, 0];
        free[0] = 1 << 63;
        free[1] = 0b11;
        assert_eq!(find_run(&free, 128, 3), Some(63));
        assert_eq!(find_run(&free, 128, 4), None);
        assert_eq!(find_run(&free, 128, 1), Some(63));
    }
}
