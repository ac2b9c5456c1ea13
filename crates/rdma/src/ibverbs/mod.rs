//! Real RDMA devices through libibverbs and librdmacm (`rdma-sys`), behind the feature
//! `ibverbs`: the one module of the crate with `unsafe` code.
//!
//! [`RdmaVerbs`] owns everything it creates on one device and tears it down in order (queue
//! pairs, completion queues, connection ids, memory regions, memory, the completion channel,
//! the protection domain): a protection domain; one memory region over a pool of fixed-size
//! [`Slot`]s registered once at start (message buffers), and any [`RegisteredMemory`] (a
//! reactor's buffer arena, where a target's data moves) registered once with
//! [`RdmaVerbs::register_arena`]; memory
//! the peer may reach ([`PeerMemory::alloc`], [`PeerMemory::register`]); one completion queue per queue
//! pair, all on one completion channel whose descriptor a reactor watches
//! ([`RdmaVerbs::completion_fd`], then [`RdmaVerbs::ack_events`]). Queue pairs are RC,
//! set up through rdma_cm: [`Listener`] on the target (its connect requests accepted or
//! rejected with the transport's private data: SRP's login response or rejection, iSER's
//! and NVMe/RDMA's connection parameters), [`RdmaVerbs::connect`]
//! on an initiator.
//!
//! Why this is sound: a buffer ([`Registered`]: a slot, an arena buffer) given to a work
//! request is held in that queue pair's
//! in-flight table until the request's completion, so no Rust reference to bytes the device
//! may be writing exists, and its memory (kept alive by the pool's reference count) outlives
//! the request; memory from [`PeerMemory::alloc`] lives as long as the verbs, past every
//! registration of it and every queue pair; a work request chain is posted only when the send
//! queue has room for all of it, so a post never fails half-way with a buffer the device may
//! still read. The bytes of registered memory the *peer* writes (an initiator's data-in) can
//! change under a reader between commands only if the peer breaks the protocol; they are
//! plain bytes, so that yields wrong data, never undefined behaviour in this process.
#![allow(unsafe_code)]

use std::alloc::{alloc_zeroed, dealloc, Layout};
use std::cell::RefCell;
use std::collections::VecDeque;
use std::ffi::CStr;
use std::io;
use std::net::SocketAddr;
use std::ops::{Deref, DerefMut};
use std::os::fd::{BorrowedFd, RawFd};
use std::ptr;
use std::rc::Rc;

use rdma_sys::*;

use crate::verbs::{
    Access, Completion, MemoryRegion, MessageBuffers, PeerMemory, PortBuffer, RemoteRegion, Verbs,
    VerbsError, WorkOp,
};

mod cm;
mod device;
mod memory;
mod qp;

use cm::next_event;
pub use cm::{ConnectRequest, Connection, Listener};
use qp::destroy_qp;

/// Why the device could not be used.
#[derive(Debug, thiserror::Error)]
pub enum RdmaError {
    /// No RDMA device (or none of the name asked for).
    #[error("no RDMA device found{0}")]
    NoDevice(String),
    /// A verbs or rdma_cm call failed.
    #[error("{call} failed: {source}")]
    Os {
        /// The call.
        call: &'static str,
        /// errno.
        source: io::Error,
    },
    /// A connect request came through another device than this one's.
    #[error("the connection request arrived on another RDMA device")]
    OtherDevice,
    /// The peer refused the connection; its private data (an SRP_LOGIN_REJ) is kept.
    #[error("the connection was rejected")]
    Rejected(Vec<u8>),
    /// Connection setup ended in an unexpected rdma_cm event.
    #[error("connection setup ended in rdma_cm event {0}")]
    Unexpected(u32),
}

fn os(call: &'static str) -> RdmaError {
    RdmaError::Os {
        call,
        source: io::Error::last_os_error(),
    }
}

/// The names of the RDMA devices of this machine (empty when it has none, or no kernel
/// support for them).
pub fn devices() -> Result<Vec<String>, RdmaError> {
    let mut n = 0;
    // Safety: ibv_get_device_list writes the count into `n` and returns an array of `n`
    // device pointers (or NULL), which is freed below and not used after.
    let list = unsafe { ibv_get_device_list(&mut n) };
    if list.is_null() {
        let e = io::Error::last_os_error();
        return match e.raw_os_error() {
            Some(libc::ENOSYS) | Some(libc::ENODEV) | Some(libc::ENOENT) => Ok(Vec::new()),
            _ => Err(RdmaError::Os {
                call: "ibv_get_device_list",
                source: e,
            }),
        };
    }
    let mut names = Vec::new();
    for i in 0..n.max(0) as usize {
        // Safety: `i` is below the count the list was returned with; each entry is a valid
        // device whose name is a NUL-terminated string owned by the list.
        let name = unsafe { CStr::from_ptr(ibv_get_device_name(*list.add(i))) };
        names.push(name.to_string_lossy().into_owned());
    }
    // Safety: the list came from ibv_get_device_list and is freed once.
    unsafe { ibv_free_device_list(list) };
    Ok(names)
}

/// Page-aligned zeroed memory.
#[derive(Debug)]
struct Allocation {
    ptr: *mut u8,
    layout: Layout,
}

impl Allocation {
    fn new(len: usize) -> Result<Allocation, VerbsError> {
        let layout =
            Layout::from_size_align(len.max(1), 4096).map_err(|_| VerbsError::Registration)?;
        // Safety: the layout's size is not zero.
        let ptr = unsafe { alloc_zeroed(layout) };
        if ptr.is_null() {
            return Err(VerbsError::Registration);
        }
        Ok(Allocation { ptr, layout })
    }

    fn len(&self) -> usize {
        self.layout.size()
    }
}

impl Drop for Allocation {
    fn drop(&mut self) {
        // Safety: `ptr` came from alloc_zeroed with this layout and is freed once.
        unsafe { dealloc(self.ptr, self.layout) }
    }
}

/// The slots' memory and its one registration.
#[derive(Debug)]
struct Pool {
    memory: Allocation,
    mr: *mut ibv_mr,
    slot_len: usize,
    free: RefCell<Vec<u32>>,
}

impl Drop for Pool {
    fn drop(&mut self) {
        // Safety: the region was registered over `memory` (freed after this, as a field) and
        // is deregistered once; no work request holds a slot (each holds the pool alive).
        unsafe { ibv_dereg_mr(self.mr) };
    }
}

/// A fixed-size buffer in the registered pool: what work requests read and fill. Dropped, it
/// goes back to the pool.
#[derive(Debug)]
pub struct Slot {
    pool: Rc<Pool>,
    index: u32,
    len: usize,
}

impl Slot {
    fn addr(&self) -> u64 {
        self.pool.memory.ptr as u64 + u64::from(self.index) * self.pool.slot_len as u64
    }
}

impl Deref for Slot {
    type Target = [u8];

    fn deref(&self) -> &[u8] {
        // Safety: the slot's `slot_len` bytes at its index lie within the pool's allocation,
        // which the `Rc` keeps alive; the free list hands each index to one slot at a time,
        // and while a work request owns the slot nothing else can reach it.
        unsafe { std::slice::from_raw_parts(self.addr() as *const u8, self.len) }
    }
}

impl DerefMut for Slot {
    fn deref_mut(&mut self) -> &mut [u8] {
        // Safety: as for `deref`; `&mut self` makes this the only reference.
        unsafe { std::slice::from_raw_parts_mut(self.addr() as *mut u8, self.len) }
    }
}

impl Slot {
    /// Bytes the slot can hold.
    pub fn capacity(&self) -> usize {
        self.pool.slot_len
    }

    /// Sets its usable length, at most [`Slot::capacity`].
    pub fn set_len(&mut self, len: usize) {
        self.len = len.min(self.pool.slot_len);
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        self.pool.free.borrow_mut().push(self.index);
    }
}

/// A buffer a work request may name: bytes that stay where they are, and stay allocated,
/// for as long as the value lives and is not changed through `&mut` (the verbs hold it,
/// untouched, until the request's completion). Where they lie decides their local key: the
/// verbs post a buffer only if it is inside memory registered with them (their slot pool, or
/// an arena registered with [`RdmaVerbs::register_arena`]); any other completes with
/// [`VerbsError::Registration`].
///
/// # Safety
///
/// Implementors guarantee that `deref` and `deref_mut` return the same bytes each time while
/// the value is not mutated through its own methods, and that nothing else (no other handle,
/// no interior mutability) frees, moves or resizes them while the value lives.
pub unsafe trait Registered: DerefMut<Target = [u8]> {}

// Safety: a slot's bytes are a fixed range of the pool's allocation, which it keeps alive.
unsafe impl Registered for Slot {}

// Safety: a vector's heap bytes move or go only through its own methods (its owner's).
unsafe impl Registered for Vec<u8> {}

/// Memory registered with the device once and for all, whose [`Registered`] buffers are
/// then posted without a registration each (a reactor's buffer arena: storage-target-backend
/// implements it for its `Arena`, and `Registered` for its `Buffer`, with its feature `rdma`).
/// The verbs keep a clone while the memory region exists.
///
/// # Safety
///
/// Implementors guarantee that `size` bytes from `base` stay mapped, readable and writable,
/// at the same address, as long as any clone lives, and that `same` is true only of clones
/// of one memory.
pub unsafe trait RegisteredMemory: Clone + 'static {
    /// Its first byte.
    fn base(&self) -> *mut u8;
    /// Its size in bytes.
    fn size(&self) -> usize;
    /// Whether `other` is this same memory (a clone of it).
    fn same(&self, other: &Self) -> bool;
}

// Safety: either variant is, and a value never changes variant behind `&`.
unsafe impl<I: Registered, D: Registered> Registered for PortBuffer<I, D> {}

/// A queue pair of an [`RdmaVerbs`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct QpHandle(usize);

/// Depths of a queue pair's work queues.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QueueDepth {
    /// Send queue: sends, RDMA READs and WRITEs (one per descriptor).
    pub send: u32,
    /// Receive queue.
    pub recv: u32,
}

#[derive(Debug)]
struct InFlight<B> {
    wr_id: u64,
    op: WorkOp,
    buffer: B,
    len: usize,
    /// Send queue entries it took.
    entries: u32,
}

/// Work request id of the chained requests that are not signalled.
const UNSIGNALLED: u64 = u64::MAX;

#[derive(Debug)]
struct Qp<B> {
    id: *mut rdma_cm_id,
    cq: *mut ibv_cq,
    depth: QueueDepth,
    send_used: u32,
    recv_used: u32,
    in_flight: Vec<Option<InFlight<B>>>,
    free_ids: Vec<usize>,
    /// Requests that ended without reaching the device (failed, or nothing to move), handed
    /// out by `poll` first.
    immediate: VecDeque<Completion<B>>,
    error: bool,
}

/// The verbs of one RDMA device (see the module's documentation), posting buffers of type
/// `B` (slots of its own pool by default).
pub struct RdmaVerbs<B = Slot> {
    devices: *mut *mut ibv_context,
    context: *mut ibv_context,
    pd: *mut ibv_pd,
    comp: *mut ibv_comp_channel,
    /// rdma_cm events of the connections (established, disconnected).
    cm: *mut rdma_event_channel,
    /// `None` only while dropping.
    pool: Option<Rc<Pool>>,
    memory: Vec<Allocation>,
    regions: Vec<(u32, *mut ibv_mr)>,
    /// Memory registered for local access once ([`RegisteredMemory`]), each with its region;
    /// kept alive by the clone.
    arenas: Vec<(Box<dyn std::any::Any>, *mut ibv_mr)>,
    /// Where local buffers may lie: (first address, end, local key) of the pool and arenas.
    local: Vec<(u64, u64, u32)>,
    qps: Vec<Option<Qp<B>>>,
    max_qp_wr: u32,
    max_rd_atom: u8,
    sges: Vec<ibv_sge>,
    wrs: Vec<ibv_send_wr>,
}

impl<B: Registered> std::fmt::Debug for RdmaVerbs<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RdmaVerbs")
            .field("device", &self.name())
            .field("queue_pairs", &self.qps.iter().flatten().count())
            .field("regions", &self.regions.len())
            .finish()
    }
}

fn access_flags(access: Access) -> i32 {
    let mut f = ibv_access_flags::IBV_ACCESS_LOCAL_WRITE;
    if access.remote_read {
        f |= ibv_access_flags::IBV_ACCESS_REMOTE_READ;
    }
    if access.remote_write {
        f |= ibv_access_flags::IBV_ACCESS_REMOTE_WRITE;
    }
    f.0 as i32
}

fn set_nonblocking(fd: RawFd) -> Result<(), RdmaError> {
    // Safety: fcntl on a descriptor this module owns, with integer arguments.
    let flags = unsafe { libc::fcntl(fd, libc::F_GETFL) };
    // Safety: as above.
    if flags < 0 || unsafe { libc::fcntl(fd, libc::F_SETFL, flags | libc::O_NONBLOCK) } < 0 {
        return Err(os("fcntl(O_NONBLOCK)"));
    }
    Ok(())
}

fn wc_error(status: ibv_wc_status::Type) -> VerbsError {
    match status {
        ibv_wc_status::IBV_WC_WR_FLUSH_ERR => VerbsError::Flushed,
        ibv_wc_status::IBV_WC_RNR_RETRY_EXC_ERR => VerbsError::ReceiverNotReady,
        ibv_wc_status::IBV_WC_LOC_LEN_ERR => VerbsError::LengthError { len: 0, posted: 0 },
        ibv_wc_status::IBV_WC_REM_ACCESS_ERR => VerbsError::RemoteAccess {
            key: 0,
            va: 0,
            len: 0,
        },
        ibv_wc_status::IBV_WC_REM_INV_REQ_ERR => VerbsError::RemoteOperation(0),
        s => VerbsError::Device(s),
    }
}

/// An rdma_cm event, copied out and acknowledged.
struct CmEvent {
    kind: rdma_cm_event_type::Type,
    id: *mut rdma_cm_id,
    private: Vec<u8>,
    /// The peer's conn_param: RDMA READs it can answer at once, and those it issues.
    responder_resources: u8,
    initiator_depth: u8,
}
