//! Real RDMA devices through libibverbs and librdmacm (`rdma-sys`), behind the feature `rdma`:
//! the one module of the crate with `unsafe` code.
//!
//! [`RdmaVerbs`] owns everything it creates on one device and tears it down in order (queue
//! pairs, completion queues, connection ids, memory regions, memory, the completion channel,
//! the protection domain): a protection domain; one memory region over a pool of fixed-size
//! [`Slot`]s registered once at start (IU buffers), and any [`backend::Arena`] registered once
//! with [`RdmaVerbs::register_arena`] (a reactor's, where a target's data moves); memory
//! the peer may reach ([`PeerMemory::alloc`], [`PeerMemory::register`]); one completion queue per queue
//! pair, all on one completion channel whose descriptor a reactor watches
//! ([`RdmaVerbs::completion_fd`], then [`RdmaVerbs::ack_events`]). Queue pairs are RC,
//! set up through rdma_cm: [`Listener`] on the target (its connect requests accepted or
//! rejected with SRP's login response or rejection as private data), [`RdmaVerbs::connect`]
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
use std::os::fd::RawFd;
use std::ptr;
use std::rc::Rc;

use rdma_sys::*;
use scsi_core::transport::TaskBuffer;

use crate::iu::MemoryDescriptor;
use crate::verbs::{
    Access, Completion, IuBuffers, MemoryRegion, PeerMemory, PortBuffer, Verbs, VerbsError, WorkOp,
};

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

impl TaskBuffer for Slot {
    fn capacity(&self) -> usize {
        self.pool.slot_len
    }

    fn set_len(&mut self, len: usize) {
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

// Safety: a buffer's bytes are a fixed run of slots of its arena's mapping, which the buffer
// keeps alive (the arena is reference counted) and hands to no one else while it lives.
unsafe impl Registered for backend::Buffer {}

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
    /// Arenas registered for local access, each with its region; kept alive by the clone.
    arenas: Vec<(backend::Arena, *mut ibv_mr)>,
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

impl<B: Registered> RdmaVerbs<B> {
    /// Opens `device` (the first rdma_cm knows when `None`) with a pool of `slots` buffers of
    /// `slot_len` bytes, registered once.
    pub fn open(
        device: Option<&str>,
        slots: u32,
        slot_len: usize,
    ) -> Result<RdmaVerbs<B>, RdmaError> {
        let mut n = 0;
        // Safety: rdma_get_devices returns rdma_cm's array of `n` open device contexts (or
        // NULL); it is kept until `drop` frees it with rdma_free_devices.
        let devices = unsafe { rdma_get_devices(&mut n) };
        if devices.is_null() || n <= 0 {
            if !devices.is_null() {
                // Safety: freed once, not used after.
                unsafe { rdma_free_devices(devices) };
            }
            return Err(RdmaError::NoDevice(String::new()));
        }
        let mut context = ptr::null_mut();
        for i in 0..n as usize {
            // Safety: `i` is below the count; each context and its device are valid while
            // the array is held, and the name is a NUL-terminated string of the device.
            let (c, name) = unsafe {
                let c = *devices.add(i);
                (c, CStr::from_ptr(ibv_get_device_name((*c).device)))
            };
            if device.is_none_or(|d| name.to_bytes() == d.as_bytes()) {
                context = c;
                break;
            }
        }
        let fail = |e: RdmaError| {
            // Safety: the array came from rdma_get_devices and is freed once.
            unsafe { rdma_free_devices(devices) };
            e
        };
        if context.is_null() {
            return Err(fail(RdmaError::NoDevice(format!(
                " named {}",
                device.unwrap_or_default()
            ))));
        }
        // Safety: a zeroed attribute struct for ibv_query_device to fill; the context is
        // valid (see above).
        let mut attr: ibv_device_attr = unsafe { std::mem::zeroed() };
        // Safety: as above.
        if unsafe { ibv_query_device(context, &mut attr) } != 0 {
            return Err(fail(os("ibv_query_device")));
        }
        // Safety: the context is valid; the domain is deallocated in `drop`.
        let pd = unsafe { ibv_alloc_pd(context) };
        if pd.is_null() {
            return Err(fail(os("ibv_alloc_pd")));
        }
        // Safety: the context is valid; the channel is destroyed in `drop`.
        let comp = unsafe { ibv_create_comp_channel(context) };
        if comp.is_null() {
            let e = os("ibv_create_comp_channel");
            // Safety: the domain is unused and deallocated once.
            unsafe { ibv_dealloc_pd(pd) };
            return Err(fail(e));
        }
        let len = slots as usize * slot_len;
        let built = Allocation::new(len)
            .map_err(|_| RdmaError::Os {
                call: "alloc",
                source: io::Error::from(io::ErrorKind::OutOfMemory),
            })
            .and_then(|memory| {
                // Safety: the region covers exactly the allocation, which the pool owns and
                // frees only after deregistering it (Pool's drop).
                let mr = unsafe {
                    ibv_reg_mr(
                        pd,
                        memory.ptr.cast(),
                        memory.len(),
                        access_flags(Access::default()),
                    )
                };
                if mr.is_null() {
                    return Err(os("ibv_reg_mr"));
                }
                Ok(Pool {
                    memory,
                    mr,
                    slot_len,
                    free: RefCell::new((0..slots).rev().collect()),
                })
            });
        let pool = match built {
            Ok(p) => p,
            Err(e) => {
                // Safety: both are unused and released once.
                unsafe {
                    ibv_destroy_comp_channel(comp);
                    ibv_dealloc_pd(pd);
                }
                return Err(fail(e));
            }
        };
        // Safety: creates rdma_cm's channel for this device's connections, destroyed in
        // `drop` after their ids.
        let cm = unsafe { rdma_create_event_channel() };
        // Safety: the pool's region is valid while the pool is.
        let pool_lkey = unsafe { (*pool.mr).lkey };
        let pool_start = pool.memory.ptr as u64;
        let pool_end = pool_start + pool.memory.len() as u64;
        let verbs = RdmaVerbs {
            devices,
            context,
            pd,
            comp,
            cm,
            pool: Some(Rc::new(pool)),
            memory: Vec::new(),
            regions: Vec::new(),
            arenas: Vec::new(),
            local: vec![(pool_start, pool_end, pool_lkey)],
            qps: Vec::new(),
            max_qp_wr: attr.max_qp_wr.max(1) as u32,
            max_rd_atom: attr.max_qp_rd_atom.clamp(1, 255) as u8,
            sges: Vec::new(),
            wrs: Vec::new(),
        };
        if cm.is_null() {
            return Err(os("rdma_create_event_channel"));
        }
        // Safety: both channels are valid; their descriptors are theirs.
        unsafe {
            set_nonblocking((*comp).fd)?;
            set_nonblocking((*cm).fd)?;
        }
        Ok(verbs)
    }

    /// rdma_cm's descriptor for this device's connections: readable when
    /// [`RdmaVerbs::poll_connection`] has something.
    pub fn connection_fd(&self) -> RawFd {
        // Safety: the channel is valid while `self` is.
        unsafe { (*self.cm).fd }
    }

    /// The next change of a connection's state. A disconnected queue pair is in the error
    /// state: its requests complete, flushed; then [`RdmaVerbs::destroy`] it.
    pub fn poll_connection(&mut self) -> Option<(QpHandle, Connection)> {
        loop {
            let event = next_event(self.cm)?;
            // Safety: an id's context is its queue pair's number plus one (set when it was
            // made); ids of this channel live until their queue pair is destroyed.
            let context = unsafe { (*event.id).context } as usize;
            let kind = event.kind;
            let Some(qp) = context.checked_sub(1).map(QpHandle) else {
                continue;
            };
            let state = match kind {
                rdma_cm_event_type::RDMA_CM_EVENT_ESTABLISHED => Connection::Established,
                rdma_cm_event_type::RDMA_CM_EVENT_DISCONNECTED
                | rdma_cm_event_type::RDMA_CM_EVENT_DEVICE_REMOVAL => {
                    if let Some(q) = self.qp(qp) {
                        q.error = true;
                    }
                    Connection::Disconnected
                }
                _ => continue,
            };
            return Some((qp, state));
        }
    }

    /// The device's name.
    pub fn name(&self) -> String {
        // Safety: the context is valid while `self` is; the name is NUL-terminated.
        unsafe { CStr::from_ptr(ibv_get_device_name((*self.context).device)) }
            .to_string_lossy()
            .into_owned()
    }

    /// A free buffer of the pool (its full length), if one is left.
    pub fn slot(&self) -> Option<Slot> {
        let pool = self.pool.as_ref()?;
        let index = pool.free.borrow_mut().pop()?;
        Some(Slot {
            pool: Rc::clone(pool),
            index,
            len: pool.slot_len,
        })
    }

    /// The completion channel's descriptor: readable when a queue pair has completions
    /// (then [`RdmaVerbs::ack_events`] and poll each queue pair).
    pub fn completion_fd(&self) -> RawFd {
        // Safety: the channel is valid while `self` is.
        unsafe { (*self.comp).fd }
    }

    /// Takes the completion channel's events, acknowledges them and asks for the next: the
    /// queue pairs that have completions to poll are added to `ready` (the caller's, reused).
    pub fn ack_events(&mut self, ready: &mut Vec<QpHandle>) {
        loop {
            let mut cq = ptr::null_mut();
            let mut context = ptr::null_mut();
            // Safety: the channel is valid and non-blocking; on success `cq` is one of ours.
            if unsafe { ibv_get_cq_event(self.comp, &mut cq, &mut context) } != 0 {
                break;
            }
            // Safety: the event came from `cq`, acknowledged once, then the queue is armed
            // again for the next completion.
            unsafe {
                ibv_ack_cq_events(cq, 1);
                ibv_req_notify_cq(cq, 0);
            }
            // The queue's context is its queue pair's number plus one (set when it was made).
            let qp = (context as usize).checked_sub(1).map(QpHandle);
            if let Some(qp) = qp.filter(|&qp| self.qps.get(qp.0).is_some_and(Option::is_some)) {
                ready.push(qp);
            }
        }
    }

    /// Moves connection id `id` onto this device's rdma_cm channel, so that its events come
    /// to [`RdmaVerbs::poll_connection`].
    fn adopt(&self, id: *mut rdma_cm_id) -> Result<(), RdmaError> {
        // Safety: `id` and the channel are valid; the id's old channel sees no more events
        // of it.
        if unsafe { rdma_migrate_id(id, self.cm) } != 0 {
            return Err(os("rdma_migrate_id"));
        }
        Ok(())
    }

    /// Makes the queue pair of connection id `id`.
    fn create_qp(&mut self, id: *mut rdma_cm_id, depth: QueueDepth) -> Result<QpHandle, RdmaError> {
        let depth = QueueDepth {
            send: depth.send.clamp(1, self.max_qp_wr),
            recv: depth.recv.clamp(1, self.max_qp_wr),
        };
        let handle = QpHandle(self.qps.len());
        // Safety: the context and completion channel are valid; the queue is destroyed in
        // `drop` (or below on failure), after its queue pair. Its context is a number, never
        // dereferenced.
        let cq = unsafe {
            ibv_create_cq(
                self.context,
                (depth.send + depth.recv) as i32,
                (handle.0 + 1) as *mut libc::c_void,
                self.comp,
                0,
            )
        };
        if cq.is_null() {
            return Err(os("ibv_create_cq"));
        }
        // Safety: a zeroed init attribute, filled in below.
        let mut init: ibv_qp_init_attr = unsafe { std::mem::zeroed() };
        init.send_cq = cq;
        init.recv_cq = cq;
        init.cap = ibv_qp_cap {
            max_send_wr: depth.send,
            max_recv_wr: depth.recv,
            max_send_sge: 1,
            max_recv_sge: 1,
            max_inline_data: 0,
        };
        init.qp_type = ibv_qp_type::IBV_QPT_RC;
        init.sq_sig_all = 0;
        // Safety: `id` is a connection id of this device (checked by the callers), the domain
        // and queue are valid; the queue pair is destroyed in `drop` before the queue.
        let r = unsafe {
            ibv_req_notify_cq(cq, 0);
            rdma_create_qp(id, self.pd, &mut init)
        };
        if r != 0 {
            let e = os("rdma_create_qp");
            // Safety: the queue is unused and destroyed once.
            unsafe { ibv_destroy_cq(cq) };
            return Err(e);
        }
        // Safety: the id is valid; its context names the queue pair for the event loop.
        unsafe { (*id).context = (handle.0 + 1) as *mut libc::c_void };
        self.qps.push(Some(Qp {
            id,
            cq,
            depth,
            send_used: 0,
            recv_used: 0,
            in_flight: Vec::new(),
            free_ids: Vec::new(),
            immediate: VecDeque::new(),
            error: false,
        }));
        Ok(handle)
    }

    fn conn_param(&self, private: &[u8]) -> rdma_conn_param {
        rdma_conn_param {
            private_data: private.as_ptr().cast(),
            private_data_len: private.len().min(255) as u8,
            responder_resources: self.max_rd_atom,
            initiator_depth: self.max_rd_atom,
            flow_control: 1,
            retry_count: 7,
            rnr_retry_count: 7,
            srq: 0,
            qp_num: 0,
        }
    }

    /// Accepts a connect request with `private` as the reply's private data (an
    /// SRP_LOGIN_RSP): the new queue pair, with `receives` posted on it before the initiator
    /// hears it may send (work request id 0).
    pub fn accept(
        &mut self,
        request: ConnectRequest,
        depth: QueueDepth,
        receives: impl IntoIterator<Item = B>,
        private: &[u8],
    ) -> Result<QpHandle, RdmaError> {
        // Safety: the request's id is valid until it is destroyed (by `request`'s drop, or
        // by ours once the queue pair is made).
        if unsafe { (*request.id).verbs } != self.context {
            return Err(RdmaError::OtherDevice);
        }
        let (request_responder, request_depth) =
            (request.responder_resources, request.initiator_depth);
        let id = request.take();
        let qp = match self.adopt(id).and_then(|()| self.create_qp(id, depth)) {
            Ok(qp) => qp,
            Err(e) => {
                // Safety: the id is ours, rejected and destroyed once.
                unsafe {
                    rdma_reject(id, ptr::null(), 0);
                    rdma_destroy_id(id);
                }
                return Err(e);
            }
        };
        for b in receives {
            self.post_recv(qp, 0, b);
        }
        let mut param = self.conn_param(private);
        // No more than the request offered, nor than the device can (conn_param's): Linux's
        // ib_srp offers 4 responder resources and an initiator depth of 0, which the event
        // gives as this side's initiator depth 4 and responder resources 0; a real HCA may
        // refuse an accept beyond what was offered. (Read the other way round, the target's
        // initiator depth was 0 and its RDMA READs of data-out never went out: seen with
        // ib_srp in the soft-RoCE guest.)
        param.initiator_depth = param.initiator_depth.min(request_depth);
        param.responder_resources = param.responder_resources.min(request_responder);
        // Safety: the id has its queue pair; `param` points at `private`, alive for the call.
        if unsafe { rdma_accept(id, &mut param) } != 0 {
            let e = os("rdma_accept");
            self.destroy(qp);
            return Err(e);
        }
        Ok(qp)
    }

    /// Connects to an SRP target at `addr` with `private` (an SRP_LOGIN_REQ in rdma_cm's
    /// layout) and waits until it is set up: the queue pair and the target's private data
    /// (its SRP_LOGIN_RSP).
    pub fn connect(
        &mut self,
        addr: SocketAddr,
        depth: QueueDepth,
        private: &[u8],
    ) -> Result<(QpHandle, Vec<u8>), RdmaError> {
        // Safety: creates an event channel, destroyed with the queue pair or below.
        let channel = unsafe { rdma_create_event_channel() };
        if channel.is_null() {
            return Err(os("rdma_create_event_channel"));
        }
        let mut id = ptr::null_mut();
        // Safety: `channel` is valid; the id is destroyed with the queue pair or below.
        if unsafe {
            rdma_create_id(
                channel,
                &mut id,
                ptr::null_mut(),
                rdma_port_space::RDMA_PS_TCP,
            )
        } != 0
        {
            let e = os("rdma_create_id");
            // Safety: unused, destroyed once.
            unsafe { rdma_destroy_event_channel(channel) };
            return Err(e);
        }
        let cleanup = |e: RdmaError| {
            // Safety: the id and channel are ours, destroyed once, in order.
            unsafe {
                rdma_destroy_id(id);
                rdma_destroy_event_channel(channel);
            }
            e
        };
        let mut sa = SockAddr::from(addr);
        // Safety: `sa` is a valid socket address of its family for the call.
        if unsafe { rdma_resolve_addr(id, ptr::null_mut(), sa.as_mut_ptr(), 2000) } != 0 {
            return Err(cleanup(os("rdma_resolve_addr")));
        }
        if let Err(e) = wait_event(channel, rdma_cm_event_type::RDMA_CM_EVENT_ADDR_RESOLVED) {
            return Err(cleanup(e));
        }
        // Safety: the id's address is resolved.
        if unsafe { rdma_resolve_route(id, 2000) } != 0 {
            return Err(cleanup(os("rdma_resolve_route")));
        }
        if let Err(e) = wait_event(channel, rdma_cm_event_type::RDMA_CM_EVENT_ROUTE_RESOLVED) {
            return Err(cleanup(e));
        }
        // Safety: a resolved id names its device.
        if unsafe { (*id).verbs } != self.context {
            return Err(cleanup(RdmaError::OtherDevice));
        }
        let qp = match self.create_qp(id, depth) {
            Ok(qp) => qp,
            Err(e) => return Err(cleanup(e)),
        };
        let mut param = self.conn_param(private);
        // Safety: the id has a route and its queue pair; `param` points at `private` for the
        // call.
        if unsafe { rdma_connect(id, &mut param) } != 0 {
            let e = os("rdma_connect");
            self.destroy(qp);
            // Safety: no id is on the channel any more.
            unsafe { rdma_destroy_event_channel(channel) };
            return Err(e);
        }
        let reply = wait_event(channel, rdma_cm_event_type::RDMA_CM_EVENT_ESTABLISHED);
        // The id moves to this device's channel; the connect channel is then empty.
        let moved = self.adopt(id).is_ok();
        // Safety: no id is on the channel any more; destroyed once.
        unsafe { rdma_destroy_event_channel(channel) };
        match reply {
            Ok(reply) if moved => Ok((qp, reply)),
            Ok(_) => {
                self.destroy(qp);
                Err(os("rdma_migrate_id"))
            }
            Err(e) => {
                self.destroy(qp);
                Err(e)
            }
        }
    }

    /// Tears a queue pair down (its in-flight buffers come back to the pool).
    pub fn destroy(&mut self, qp: QpHandle) {
        if let Some(q) = self.qps.get_mut(qp.0).and_then(Option::take) {
            destroy_qp(q);
        }
    }

    /// Registers `arena` for local access, once: its buffers may then be posted (a target's
    /// data moves from and into them with no registration per I/O). The verbs keep the arena
    /// mapped while the region exists.
    pub fn register_arena(&mut self, arena: &backend::Arena) -> Result<(), RdmaError> {
        if self.arenas.iter().any(|(a, _)| a.same(arena)) {
            return Ok(());
        }
        // Safety: the range is the arena's whole mapping, which the clone kept below keeps
        // mapped until the region is deregistered (in `drop`, before the domain goes).
        let mr = unsafe {
            ibv_reg_mr(
                self.pd,
                arena.base().cast(),
                arena.len(),
                access_flags(Access::default()),
            )
        };
        if mr.is_null() {
            return Err(os("ibv_reg_mr"));
        }
        // Safety: a registered region's key.
        let lkey = unsafe { (*mr).lkey };
        let start = arena.base() as u64;
        self.local.push((start, start + arena.len() as u64, lkey));
        self.arenas.push((arena.clone(), mr));
        Ok(())
    }

    /// The local key of `len` bytes at `addr`, if they lie in memory registered here.
    fn local_key(&self, addr: u64, len: usize) -> Option<u32> {
        let end = addr.checked_add(len as u64)?;
        self.local
            .iter()
            .find(|&&(start, stop, _)| start <= addr && end <= stop)
            .map(|&(_, _, lkey)| lkey)
    }

    fn qp(&mut self, qp: QpHandle) -> Option<&mut Qp<B>> {
        self.qps.get_mut(qp.0).and_then(Option::as_mut)
    }

    /// Posts one chain: a receive (`op` Recv), a send, or one RDMA READ/WRITE per remote
    /// descriptor over `buffer[start..start + len]`. Only the last is signalled.
    #[allow(clippy::too_many_arguments)]
    fn post(
        &mut self,
        qp: QpHandle,
        wr_id: u64,
        op: WorkOp,
        buffer: B,
        start: usize,
        len: usize,
        remote: &[MemoryDescriptor],
    ) {
        let base = buffer.as_ptr() as u64;
        let lkey = self.local_key(base, buffer.len());
        let addr = base + start.min(buffer.len()) as u64;
        let failed = |e: VerbsError, buffer: B| Completion {
            wr_id,
            op,
            buffer,
            len: 0,
            result: Err(e),
        };
        let Some(q) = self.qps.get_mut(qp.0).and_then(Option::as_mut) else {
            return; // Destroyed: the buffer goes back to the pool.
        };
        if q.error {
            q.immediate.push_back(failed(VerbsError::Flushed, buffer));
            return;
        }
        let Some(lkey) = lkey else {
            q.immediate
                .push_back(failed(VerbsError::Registration, buffer));
            return;
        };
        if start.saturating_add(len) > buffer.len() {
            let e = VerbsError::LengthError {
                len: start.saturating_add(len),
                posted: buffer.len(),
            };
            q.immediate.push_back(failed(e, buffer));
            return;
        }
        self.sges.clear();
        self.wrs.clear();
        let opcode = match op {
            WorkOp::RdmaWrite => ibv_wr_opcode::IBV_WR_RDMA_WRITE,
            WorkOp::RdmaRead => ibv_wr_opcode::IBV_WR_RDMA_READ,
            _ => ibv_wr_opcode::IBV_WR_SEND,
        };
        let mut at = 0usize;
        if matches!(op, WorkOp::RdmaWrite | WorkOp::RdmaRead) {
            for d in remote {
                if at >= len {
                    break;
                }
                let n = (len - at).min(d.len as usize);
                self.sges.push(ibv_sge {
                    addr: addr + at as u64,
                    length: n as u32,
                    lkey,
                });
                // Safety: a zeroed work request, filled in below.
                let mut wr: ibv_send_wr = unsafe { std::mem::zeroed() };
                wr.opcode = opcode;
                wr.wr = wr_t {
                    rdma: rdma_t {
                        remote_addr: d.va,
                        rkey: d.key,
                    },
                };
                self.wrs.push(wr);
                at += n;
            }
        } else {
            self.sges.push(ibv_sge {
                addr,
                length: len as u32,
                lkey,
            });
            // Safety: a zeroed work request, filled in below.
            let mut wr: ibv_send_wr = unsafe { std::mem::zeroed() };
            wr.opcode = opcode;
            self.wrs.push(wr);
            at = len;
        }
        let entries = self.wrs.len() as u32;
        let recv = op == WorkOp::Recv;
        let room = if recv {
            q.recv_used < q.depth.recv
        } else {
            q.send_used + entries <= q.depth.send
        };
        if entries == 0 {
            // Nothing to move (no bytes), or no descriptor to move them to.
            let result = if len == 0 {
                Ok(())
            } else {
                Err(VerbsError::LengthError { len, posted: 0 })
            };
            q.immediate.push_back(Completion {
                wr_id,
                op,
                buffer,
                len: 0,
                result,
            });
            return;
        }
        if !room {
            q.immediate.push_back(failed(VerbsError::QueueFull, buffer));
            return;
        }
        let slot = match q.free_ids.pop() {
            Some(i) => i,
            None => {
                q.in_flight.push(None);
                q.in_flight.len() - 1
            }
        };
        // The result, and whether the request that failed (if one did) was the first, so that
        // nothing of the chain reached the device.
        let (r, nothing_posted) = if recv {
            let mut wr = ibv_recv_wr {
                wr_id: slot as u64,
                next: ptr::null_mut(),
                sg_list: self.sges.as_mut_ptr(),
                num_sge: 1,
            };
            let mut bad = ptr::null_mut();
            // Safety: the queue pair is valid; the request names one scatter entry inside
            // the slot, which stays in the in-flight table until the completion.
            let r = unsafe { ibv_post_recv((*q.id).qp, &mut wr, &mut bad) };
            (r, true)
        } else {
            let last = self.wrs.len() - 1;
            let sges = self.sges.as_mut_ptr();
            let wrs = self.wrs.as_mut_ptr();
            for (i, wr) in self.wrs.iter_mut().enumerate() {
                // Safety: `i` indexes both vectors, which are not resized while the chain
                // is linked and posted.
                wr.sg_list = unsafe { sges.add(i) };
                wr.num_sge = 1;
                if i < last {
                    wr.wr_id = UNSIGNALLED;
                    // Safety: as above.
                    wr.next = unsafe { wrs.add(i + 1) };
                } else {
                    wr.wr_id = slot as u64;
                    wr.send_flags = ibv_send_flags::IBV_SEND_SIGNALED.0;
                    wr.next = ptr::null_mut();
                }
            }
            let mut bad = ptr::null_mut();
            // Safety: the queue pair is valid and has room for the whole chain (checked
            // above), whose scatter entries lie inside the slot held in flight until the
            // last request's completion.
            let r = unsafe { ibv_post_send((*q.id).qp, wrs, &mut bad) };
            (r, bad == wrs)
        };
        if r != 0 {
            q.free_ids.push(slot);
            if nothing_posted {
                let e = if r == libc::ENOMEM {
                    VerbsError::QueueFull
                } else {
                    VerbsError::Device(r as u32)
                };
                q.immediate.push_back(failed(e, buffer));
            } else {
                // Part of the chain may be on the device: the buffer must outlive it, so
                // it is not returned, and the queue pair is broken.
                std::mem::forget(buffer);
                q.error = true;
                // Safety: the id is valid.
                unsafe { rdma_disconnect(q.id) };
            }
            return;
        }
        if recv {
            q.recv_used += 1;
        } else {
            q.send_used += entries;
        }
        q.in_flight[slot] = Some(InFlight {
            wr_id,
            op,
            buffer,
            len: at,
            entries: if recv { 0 } else { entries },
        });
    }
}

/// Tears a queue pair down: after rdma_destroy_qp the device touches none of its buffers,
/// which are then dropped with it.
fn destroy_qp<B>(q: Qp<B>) {
    // Safety: the queue pair is destroyed before its completion queue and id, each once.
    unsafe {
        rdma_disconnect(q.id);
        rdma_destroy_qp(q.id);
        ibv_destroy_cq(q.cq);
        rdma_destroy_id(q.id);
    }
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

impl<B: Registered> IuBuffers for RdmaVerbs<B> {
    type Iu = Slot;

    fn iu_buffer(&mut self) -> Option<Slot> {
        self.slot()
    }
}

impl<B: Registered> PeerMemory for RdmaVerbs<B> {
    type Memory = usize;

    fn alloc(&mut self, len: usize) -> Result<usize, VerbsError> {
        self.memory.push(Allocation::new(len)?);
        Ok(self.memory.len() - 1)
    }

    fn read(&self, m: &usize, offset: usize, out: &mut [u8]) {
        let a = &self.memory[*m];
        // Safety: the allocation lives as long as `self`; see the module's documentation
        // for bytes the peer may write.
        let bytes = unsafe { std::slice::from_raw_parts(a.ptr, a.len()) };
        out.copy_from_slice(&bytes[offset..offset + out.len()]);
    }

    fn write(&mut self, m: &usize, offset: usize, data: &[u8]) {
        let a = &self.memory[*m];
        // Safety: as for `read`; `&mut self` makes this the only reference from here.
        let bytes = unsafe { std::slice::from_raw_parts_mut(a.ptr, a.len()) };
        bytes[offset..offset + data.len()].copy_from_slice(data);
    }

    fn register(
        &mut self,
        m: &usize,
        offset: usize,
        len: usize,
        access: Access,
    ) -> Result<MemoryRegion, VerbsError> {
        let a = self.memory.get(*m).ok_or(VerbsError::Registration)?;
        if offset.checked_add(len).is_none_or(|end| end > a.len()) {
            return Err(VerbsError::Registration);
        }
        // Safety: the range lies inside an allocation that outlives the region (both are
        // released in `drop`, the region first).
        let mr =
            unsafe { ibv_reg_mr(self.pd, a.ptr.add(offset).cast(), len, access_flags(access)) };
        if mr.is_null() {
            return Err(VerbsError::Registration);
        }
        // Safety: a registered region's keys.
        let (lkey, rkey) = unsafe { ((*mr).lkey, (*mr).rkey) };
        self.regions.push((rkey, mr));
        Ok(MemoryRegion {
            lkey,
            rkey,
            addr: a.ptr as u64 + offset as u64,
            len: len as u32,
        })
    }

    fn deregister(&mut self, region: MemoryRegion) {
        if let Some(i) = self.regions.iter().position(|(k, _)| *k == region.rkey) {
            let (_, mr) = self.regions.swap_remove(i);
            // Safety: registered here and deregistered once.
            unsafe { ibv_dereg_mr(mr) };
        }
    }
}

impl<B: Registered> Verbs for RdmaVerbs<B> {
    type Qp = QpHandle;
    type Buffer = B;

    fn post_recv(&mut self, qp: QpHandle, wr_id: u64, buffer: B) {
        let len = buffer.len();
        self.post(qp, wr_id, WorkOp::Recv, buffer, 0, len, &[]);
    }

    fn post_send(&mut self, qp: QpHandle, wr_id: u64, buffer: B, len: usize) {
        self.post(qp, wr_id, WorkOp::Send, buffer, 0, len, &[]);
    }

    fn post_rdma_write(
        &mut self,
        qp: QpHandle,
        wr_id: u64,
        buffer: B,
        at: usize,
        len: usize,
        remote: &[MemoryDescriptor],
    ) {
        self.post(qp, wr_id, WorkOp::RdmaWrite, buffer, at, len, remote);
    }

    fn post_rdma_read(
        &mut self,
        qp: QpHandle,
        wr_id: u64,
        buffer: B,
        at: usize,
        len: usize,
        remote: &[MemoryDescriptor],
    ) {
        self.post(qp, wr_id, WorkOp::RdmaRead, buffer, at, len, remote);
    }

    fn poll(&mut self, qp: QpHandle) -> Option<Completion<B>> {
        let q = self.qp(qp)?;
        if let Some(c) = q.immediate.pop_front() {
            return Some(c);
        }
        loop {
            // Safety: a zeroed completion for ibv_poll_cq to fill.
            let mut wc: ibv_wc = unsafe { std::mem::zeroed() };
            // Safety: the queue is valid; at most one entry is written into `wc`.
            if unsafe { ibv_poll_cq(q.cq, 1, &mut wc) } <= 0 {
                return None;
            }
            let ok = wc.status == ibv_wc_status::IBV_WC_SUCCESS;
            if !ok {
                q.error = true;
            }
            if wc.wr_id == UNSIGNALLED {
                continue; // A failed member of a chain; its last request reports the chain.
            }
            let Some(f) = q
                .in_flight
                .get_mut(wc.wr_id as usize)
                .and_then(Option::take)
            else {
                continue;
            };
            q.free_ids.push(wc.wr_id as usize);
            if f.op == WorkOp::Recv {
                q.recv_used -= 1;
            } else {
                q.send_used -= f.entries;
            }
            return Some(Completion {
                wr_id: f.wr_id,
                op: f.op,
                len: if f.op == WorkOp::Recv {
                    wc.byte_len as usize
                } else {
                    f.len
                },
                buffer: f.buffer,
                result: if ok { Ok(()) } else { Err(wc_error(wc.status)) },
            });
        }
    }

    fn is_error(&self, qp: QpHandle) -> bool {
        self.qps
            .get(qp.0)
            .and_then(Option::as_ref)
            .is_none_or(|q| q.error)
    }

    fn disconnect(&mut self, qp: QpHandle) {
        if let Some(q) = self.qp(qp) {
            q.error = true;
            // Safety: the id is valid; rdma_disconnect moves the queue pair to the error
            // state, so its requests complete (flushed) and give their buffers back.
            unsafe { rdma_disconnect(q.id) };
        }
    }
}

impl<B> Drop for RdmaVerbs<B> {
    fn drop(&mut self) {
        for i in 0..self.qps.len() {
            if let Some(q) = self.qps[i].take() {
                destroy_qp(q);
            }
        }
        for (_, mr) in self.arenas.drain(..) {
            // Safety: registered here over an arena this clone keeps mapped, deregistered
            // once, after every queue pair that could use it.
            unsafe { ibv_dereg_mr(mr) };
        }
        for (_, mr) in self.regions.drain(..) {
            // Safety: each region was registered here and is deregistered once, before
            // its memory (dropped after this body) is freed.
            unsafe { ibv_dereg_mr(mr) };
        }
        // Safety: no queue or id uses the channels any more, each destroyed once.
        unsafe {
            ibv_destroy_comp_channel(self.comp);
            if !self.cm.is_null() {
                rdma_destroy_event_channel(self.cm);
            }
        }
        // The pool's region goes when its last slot does: a slot kept past the verbs keeps
        // the domain busy (ibv_dealloc_pd then fails, and leaks it, harmlessly).
        self.pool = None;
        // Safety: the domain is deallocated after every region of it, then rdma_cm's device
        // array, each once.
        unsafe {
            ibv_dealloc_pd(self.pd);
            rdma_free_devices(self.devices);
        }
    }
}

/// A descriptor of the verbs or a listener (a copy of it, owned), watched by the current
/// tokio runtime: readable when its channel has events.
#[derive(Debug)]
pub struct Watch(tokio::io::unix::AsyncFd<std::os::fd::OwnedFd>);

impl Watch {
    /// Watches `fd` (a channel's descriptor of these verbs or a listener) in the current tokio
    /// runtime; the watch holds a duplicate, so it outlives nothing it names.
    pub fn new(fd: RawFd) -> io::Result<Watch> {
        use std::os::fd::FromRawFd;
        // Safety: dup of a descriptor the caller's verbs or listener hold open gives a new
        // one nobody else owns.
        let dup = unsafe { libc::dup(fd) };
        if dup < 0 {
            return Err(io::Error::last_os_error());
        }
        // Safety: `dup` is fresh and owned only here.
        let owned = unsafe { std::os::fd::OwnedFd::from_raw_fd(dup) };
        // Safety: the OwnedFd moves into the AsyncFd, stays open and names the same
        // descriptor until the AsyncFd is dropped.
        let fd = unsafe {
            tokio::io::unix::AsyncFd::register_with_interest(owned, tokio::io::Interest::READABLE)
        }
        .map_err(|e| e.into_parts().1)?;
        Ok(Watch(fd))
    }

    /// Whether it was readable since the last call that said so (its readiness is then
    /// cleared: the caller takes every event there is); registers `cx` for the next.
    pub fn poll_readable(&self, cx: &mut std::task::Context<'_>) -> bool {
        match self.0.poll_read_ready(cx) {
            std::task::Poll::Ready(Ok(mut guard)) => {
                guard.clear_ready();
                true
            }
            std::task::Poll::Ready(Err(e)) => {
                tracing::error!("watching an RDMA channel: {e}");
                false
            }
            std::task::Poll::Pending => false,
        }
    }
}

/// A connection's change of state.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Connection {
    /// Set up: the peer may send.
    Established,
    /// The peer (or the fabric) ended it.
    Disconnected,
}

/// A socket address as the C calls take it.
struct SockAddr(libc::sockaddr_storage);

impl From<SocketAddr> for SockAddr {
    fn from(addr: SocketAddr) -> SockAddr {
        // Safety: an all-zero sockaddr_storage is valid; the family's struct is written into
        // its start, which is large and aligned enough for either.
        let mut st: libc::sockaddr_storage = unsafe { std::mem::zeroed() };
        match addr {
            SocketAddr::V4(a) => {
                let sin = libc::sockaddr_in {
                    sin_family: libc::AF_INET as libc::sa_family_t,
                    sin_port: a.port().to_be(),
                    sin_addr: libc::in_addr {
                        s_addr: u32::from_ne_bytes(a.ip().octets()),
                    },
                    sin_zero: [0; 8],
                };
                // Safety: see above.
                unsafe { ptr::write((&mut st as *mut libc::sockaddr_storage).cast(), sin) };
            }
            SocketAddr::V6(a) => {
                let sin6 = libc::sockaddr_in6 {
                    sin6_family: libc::AF_INET6 as libc::sa_family_t,
                    sin6_port: a.port().to_be(),
                    sin6_flowinfo: a.flowinfo(),
                    sin6_addr: libc::in6_addr {
                        s6_addr: a.ip().octets(),
                    },
                    sin6_scope_id: a.scope_id(),
                };
                // Safety: see above.
                unsafe { ptr::write((&mut st as *mut libc::sockaddr_storage).cast(), sin6) };
            }
        }
        SockAddr(st)
    }
}

impl SockAddr {
    fn as_mut_ptr(&mut self) -> *mut libc::sockaddr {
        (&mut self.0 as *mut libc::sockaddr_storage).cast()
    }

    /// The address a C sockaddr names, if it is IPv4 or IPv6.
    fn read(sa: &libc::sockaddr_storage) -> Option<SocketAddr> {
        let p = (sa as *const libc::sockaddr_storage).cast::<u8>();
        match i32::from(sa.ss_family) {
            libc::AF_INET => {
                // Safety: the family says a sockaddr_in starts the storage, which is large and
                // aligned enough for it.
                let sin = unsafe { ptr::read(p.cast::<libc::sockaddr_in>()) };
                let ip = std::net::Ipv4Addr::from(sin.sin_addr.s_addr.to_ne_bytes());
                Some(SocketAddr::from((ip, u16::from_be(sin.sin_port))))
            }
            libc::AF_INET6 => {
                // Safety: as above, a sockaddr_in6.
                let sin6 = unsafe { ptr::read(p.cast::<libc::sockaddr_in6>()) };
                let ip = std::net::Ipv6Addr::from(sin6.sin6_addr.s6_addr);
                Some(SocketAddr::V6(std::net::SocketAddrV6::new(
                    ip,
                    u16::from_be(sin6.sin6_port),
                    sin6.sin6_flowinfo,
                    sin6.sin6_scope_id,
                )))
            }
            _ => None,
        }
    }
}

/// The peer's and this side's addresses of a connection id (its route's destination and
/// source), as rdma_cm resolved them.
fn route_addresses(id: *mut rdma_cm_id) -> (Option<SocketAddr>, Option<SocketAddr>) {
    if id.is_null() {
        return (None, None);
    }
    // Safety: a live id from an event; its route's addresses are plain sockaddr storage that
    // rdma_cm filled in for a connect request (an all-zero one has no family: `None`).
    unsafe {
        let addr = &(*id).route.addr;
        (
            SockAddr::read(&addr.dst_addr_union.dst_storage),
            SockAddr::read(&addr.src_addr_union.src_storage),
        )
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

/// The next event of `channel` (`None`: none yet on a non-blocking channel, or it failed).
fn next_event(channel: *mut rdma_event_channel) -> Option<CmEvent> {
    let mut event = ptr::null_mut();
    // Safety: the channel is valid.
    if unsafe { rdma_get_cm_event(channel, &mut event) } != 0 {
        return None;
    }
    // Safety: the event is valid until acknowledged, after its kind, id and private data are
    // copied out.
    unsafe {
        let conn = &(*event).param.conn;
        let private = if conn.private_data.is_null() {
            Vec::new()
        } else {
            std::slice::from_raw_parts(
                conn.private_data.cast::<u8>(),
                conn.private_data_len as usize,
            )
            .to_vec()
        };
        let copied = CmEvent {
            kind: (*event).event,
            id: (*event).id,
            private,
            responder_resources: conn.responder_resources,
            initiator_depth: conn.initiator_depth,
        };
        rdma_ack_cm_event(event);
        Some(copied)
    }
}

/// Waits on a blocking rdma_cm channel for `expected`: the event's private data.
fn wait_event(
    channel: *mut rdma_event_channel,
    expected: rdma_cm_event_type::Type,
) -> Result<Vec<u8>, RdmaError> {
    let event = next_event(channel).ok_or_else(|| os("rdma_get_cm_event"))?;
    let (kind, private) = (event.kind, event.private);
    match kind {
        k if k == expected => Ok(private),
        rdma_cm_event_type::RDMA_CM_EVENT_REJECTED => Err(RdmaError::Rejected(private)),
        k => Err(RdmaError::Unexpected(k)),
    }
}

/// An SRP target's rdma_cm listener.
#[derive(Debug)]
pub struct Listener {
    channel: *mut rdma_event_channel,
    id: *mut rdma_cm_id,
}

impl Listener {
    /// Listens on `addr` (an address of an RDMA device, or the wildcard).
    pub fn bind(addr: SocketAddr, backlog: i32) -> Result<Listener, RdmaError> {
        // Safety: creates a channel, destroyed in `drop` (or below).
        let channel = unsafe { rdma_create_event_channel() };
        if channel.is_null() {
            return Err(os("rdma_create_event_channel"));
        }
        let mut listener = Listener {
            channel,
            id: ptr::null_mut(),
        };
        // Safety: the channel is valid; the id is destroyed in `drop`.
        if unsafe {
            rdma_create_id(
                channel,
                &mut listener.id,
                ptr::null_mut(),
                rdma_port_space::RDMA_PS_TCP,
            )
        } != 0
        {
            return Err(os("rdma_create_id"));
        }
        let mut sa = SockAddr::from(addr);
        // Safety: the id is valid and `sa` a socket address of its family.
        if unsafe { rdma_bind_addr(listener.id, sa.as_mut_ptr()) } != 0 {
            return Err(os("rdma_bind_addr"));
        }
        // Safety: the id is bound.
        if unsafe { rdma_listen(listener.id, backlog) } != 0 {
            return Err(os("rdma_listen"));
        }
        // Safety: the channel is valid.
        set_nonblocking(unsafe { (*channel).fd })?;
        Ok(listener)
    }

    /// The descriptor to watch: readable when [`Listener::accept`] may have a request.
    pub fn fd(&self) -> RawFd {
        // Safety: the channel is valid while `self` is.
        unsafe { (*self.channel).fd }
    }

    /// The next connect request, if one has come (its private data is an SRP_LOGIN_REQ).
    pub fn accept(&mut self) -> Option<ConnectRequest> {
        loop {
            let e = next_event(self.channel)?;
            if e.kind == rdma_cm_event_type::RDMA_CM_EVENT_CONNECT_REQUEST {
                let (peer, local) = route_addresses(e.id);
                return Some(ConnectRequest {
                    id: e.id,
                    private: e.private,
                    responder_resources: e.responder_resources,
                    initiator_depth: e.initiator_depth,
                    peer,
                    local,
                });
            }
        }
    }
}

impl Drop for Listener {
    fn drop(&mut self) {
        // Safety: the listening id (requests taken from it are ids of their own, moved to
        // a device's channel when accepted, destroyed when rejected) and then its channel,
        // each once.
        unsafe {
            if !self.id.is_null() {
                rdma_destroy_id(self.id);
            }
            rdma_destroy_event_channel(self.channel);
        }
    }
}

/// A connect request: accept it with [`RdmaVerbs::accept`], or reject it; dropped, it is
/// rejected with no private data.
#[derive(Debug)]
pub struct ConnectRequest {
    id: *mut rdma_cm_id,
    /// The initiator's private data: its SRP_LOGIN_REQ.
    pub private: Vec<u8>,
    /// RDMA READs this side may have to answer at once: the initiator's initiator depth (the
    /// connection manager gives the request's values from the accepting side's view).
    pub responder_resources: u8,
    /// RDMA READs this side may have outstanding toward the initiator: its responder
    /// resources.
    pub initiator_depth: u8,
    /// The initiator's address (the IP address of its RDMA device's interface), when rdma_cm
    /// knows it.
    pub peer: Option<SocketAddr>,
    /// The address the request came to.
    pub local: Option<SocketAddr>,
}

impl ConnectRequest {
    fn take(mut self) -> *mut rdma_cm_id {
        std::mem::replace(&mut self.id, ptr::null_mut())
    }

    /// Refuses the connection with `private` (an SRP_LOGIN_REJ) as the reply.
    pub fn reject(mut self, private: &[u8]) {
        let id = std::mem::replace(&mut self.id, ptr::null_mut());
        // Safety: the id is the request's, rejected and destroyed once; `private` is alive
        // for the call.
        unsafe {
            rdma_reject(id, private.as_ptr().cast(), private.len().min(255) as u8);
            rdma_destroy_id(id);
        }
    }
}

impl Drop for ConnectRequest {
    fn drop(&mut self) {
        if !self.id.is_null() {
            // Safety: as in `reject`.
            unsafe {
                rdma_reject(self.id, ptr::null(), 0);
                rdma_destroy_id(self.id);
            }
        }
    }
}
