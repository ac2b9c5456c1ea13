//! The verbs an RDMA transport's shell runs on (SRP, iSER, and NVMe/RDMA to come): memory
//! regions, reliable-connected queue pairs, sends, receives, RDMA READ and WRITE, and their
//! completions. Two implementations: the software
//! [`fabric`](crate::fabric) in the process (everywhere; what tests, fuzzing and the paper's
//! experiment drive) and, with the feature `rdma`, real devices through libibverbs and
//! librdmacm (the module `rdma`).
//!
//! Ownership follows the hardware: a buffer given to a work request belongs to the verbs until
//! that request completes, and comes back in its [`Completion`] (the device may be reading or
//! writing it until then, so no Rust reference to it may exist). Every post completes, also
//! when it fails (a full queue, a queue pair in the error state, a bad remote key): the shell
//! has exactly one place, its completion loop, where buffers come back and failures are seen.
//!
//! Memory that the *peer* reaches (an initiator's data buffers, which its commands name as
//! [`RemoteRegion`]s: SRP's memory descriptors, iSER's STag and address, NVMe's keyed SGLs)
//! is different: it stays where it is while registered, and the program touches it only between
//! the commands that expose it. It is allocated by the verbs ([`PeerMemory::alloc`]) and lives as
//! long as they do, so a registration never outlives its memory.

use std::fmt::Debug;
use std::hash::Hash;
use std::ops::DerefMut;

/// What a memory region lets the peer do (local access is always granted).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Access {
    /// RDMA READ by the peer (a write's data-out).
    pub remote_read: bool,
    /// RDMA WRITE by the peer (a read's data-in).
    pub remote_write: bool,
}

impl Access {
    /// Both.
    pub const REMOTE: Access = Access {
        remote_read: true,
        remote_write: true,
    };
}

/// A registered memory region.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MemoryRegion {
    /// The key the local side's work requests name it by (L_Key).
    pub lkey: u32,
    /// The key the peer names it by in RDMA (R_Key), what a memory descriptor carries.
    pub rkey: u32,
    /// Its first virtual address.
    pub addr: u64,
    /// Its length.
    pub len: u32,
}

impl MemoryRegion {
    /// `len` bytes at `offset` into the region, as the peer names them.
    pub fn remote(&self, offset: u32, len: u32) -> RemoteRegion {
        RemoteRegion {
            addr: self.addr + u64::from(offset),
            rkey: self.rkey,
            len,
        }
    }
}

/// Bytes of the peer's registered memory, as a command names them for an RDMA READ or WRITE:
/// what every RDMA transport's data descriptors come down to (SRP's memory descriptor,
/// iSER's STag with a virtual address, an NVMe keyed SGL data block). Each transport decodes
/// its own wire form and hands the verbs these.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct RemoteRegion {
    /// The first byte's virtual address in the peer's region.
    pub addr: u64,
    /// The region's remote key (R_Key, iSER's STag, NVMe's key).
    pub rkey: u32,
    /// Bytes.
    pub len: u32,
}

/// Why a work request failed. After any of these but [`VerbsError::QueueFull`] the queue pair
/// is in the error state, and the requests still queued on it complete with
/// [`VerbsError::Flushed`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum VerbsError {
    /// The queue pair is in the error state (or its peer is gone).
    #[error("the queue pair is in the error state")]
    QpError,
    /// The queue pair went to the error state before this request ran.
    #[error("flushed: the queue pair went to the error state")]
    Flushed,
    /// More requests than the queue holds.
    #[error("the work queue is full")]
    QueueFull,
    /// A send found no receive posted at the peer (receiver not ready, retries exhausted).
    #[error("receiver not ready: no receive posted")]
    ReceiverNotReady,
    /// A message longer than the receive buffer posted for it.
    #[error("message of {len} bytes for a receive of {posted}")]
    LengthError {
        /// Bytes sent.
        len: usize,
        /// Bytes the receive holds.
        posted: usize,
    },
    /// A key names no region, or the range is outside it.
    #[error("remote access error: key {key:#x}, address {va:#x}, {len} bytes")]
    RemoteAccess {
        /// The key.
        key: u32,
        /// The address.
        va: u64,
        /// Bytes.
        len: u32,
    },
    /// The region does not allow the operation.
    #[error("remote operation not allowed by the region of key {0:#x}")]
    RemoteOperation(u32),
    /// The verbs could not register or allocate memory.
    #[error("memory registration failed")]
    Registration,
    /// Any other failure the device reported (its work completion status or errno).
    #[error("the device reported status {0}")]
    Device(u32),
}

/// What a work request did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WorkOp {
    /// A receive (a message arrived, or it was flushed).
    Recv,
    /// A send.
    Send,
    /// RDMA WRITE of the buffer into the peer's memory.
    RdmaWrite,
    /// RDMA READ of the peer's memory into the buffer.
    RdmaRead,
}

/// A finished work request, with the buffer it was given.
#[derive(Debug, PartialEq, Eq)]
pub struct Completion<B> {
    /// The id it was posted with.
    pub wr_id: u64,
    /// What it was.
    pub op: WorkOp,
    /// Its buffer, the verbs' no longer.
    pub buffer: B,
    /// Bytes received (a receive) or moved.
    pub len: usize,
    /// Its outcome.
    pub result: Result<(), VerbsError>,
}

/// Memory the peer reaches: allocated by the verbs, registered and deregistered. An
/// initiator's data buffers live here; a target needs none of it (its buffers are its own
/// arena, registered once when its verbs are opened).
pub trait PeerMemory {
    /// Memory the peer may reach once registered.
    type Memory;

    /// `len` zeroed bytes for [`PeerMemory::register`], living as long as the verbs.
    fn alloc(&mut self, len: usize) -> Result<Self::Memory, VerbsError>;
    /// Copies `out.len()` bytes of `m` from `offset` into `out` (a read's data-in, once its
    /// command has ended). Copies, not borrows: the memory may live behind a lock (a fabric
    /// shared between threads). A range outside `m` is the caller's bug: it panics.
    fn read(&self, m: &Self::Memory, offset: usize, out: &mut [u8]);
    /// Copies `data` into `m` at `offset` (a write's data-out, before its command exposes
    /// it). A range outside `m` panics.
    fn write(&mut self, m: &Self::Memory, offset: usize, data: &[u8]);
    /// Registers `len` bytes of `m` from `offset` for `access`.
    fn register(
        &mut self,
        m: &Self::Memory,
        offset: usize,
        len: usize,
        access: Access,
    ) -> Result<MemoryRegion, VerbsError>;
    /// Deregisters a region: its keys no longer grant anything.
    fn deregister(&mut self, region: MemoryRegion);
}

/// The queue-pair verbs of one side of a fabric: what a target or initiator shell of an RDMA
/// transport needs to move its messages and data, and no more. See the module's documentation for who owns what.
pub trait Verbs {
    /// A connected queue pair.
    type Qp: Copy + Eq + Hash + Debug;
    /// Registered local memory a work request reads or fills: IU buffers, the target's arena
    /// slots.
    type Buffer: DerefMut<Target = [u8]>;

    /// Posts a receive into `buffer` (its whole length).
    fn post_recv(&mut self, qp: Self::Qp, wr_id: u64, buffer: Self::Buffer);
    /// Sends the first `len` bytes of `buffer` to the peer's next posted receive.
    fn post_send(&mut self, qp: Self::Qp, wr_id: u64, buffer: Self::Buffer, len: usize);
    /// Writes `buffer[at..at + len]` into the peer's memory `remote`, in order (one RDMA
    /// WRITE per descriptor; one completion for all).
    fn post_rdma_write(
        &mut self,
        qp: Self::Qp,
        wr_id: u64,
        buffer: Self::Buffer,
        at: usize,
        len: usize,
        remote: &[RemoteRegion],
    );
    /// Reads `len` bytes of the peer's memory `remote`, in order, into `buffer[at..]` (one
    /// RDMA READ per descriptor; one completion for all). `at` lets a transport that
    /// solicits data in bursts (iSER) read each into its place in one task buffer.
    fn post_rdma_read(
        &mut self,
        qp: Self::Qp,
        wr_id: u64,
        buffer: Self::Buffer,
        at: usize,
        len: usize,
        remote: &[RemoteRegion],
    );
    /// The next finished work request of `qp`.
    fn poll(&mut self, qp: Self::Qp) -> Option<Completion<Self::Buffer>>;
    /// Whether `qp` is in the error state (its peer gone, or a request failed).
    fn is_error(&self, qp: Self::Qp) -> bool;
    /// Moves `qp` to the error state and tells the peer: the requests still queued complete
    /// with [`VerbsError::Flushed`].
    fn disconnect(&mut self, qp: Self::Qp);
}

/// Verbs that hand out message buffers (for sends and receives: SRP's IUs, iSER's messages,
/// NVMe/RDMA's capsules) of their own registered memory: a real device's slot pool, or plain
/// vectors on a software fabric.
pub trait MessageBuffers {
    /// A message buffer.
    type Message: DerefMut<Target = [u8]>;
    /// A free message buffer of [`MESSAGE_BUFFER_LEN`] bytes or more; `None` when none is
    /// left.
    fn message_buffer(&mut self) -> Option<Self::Message>;
    /// A message buffer back from its work request, for reuse.
    fn recycle_message(&mut self, message: Self::Message) {
        drop(message);
    }
}

/// The length of the message buffers of a software fabric's verbs and of targetd's RDMA
/// ports: more than any message a target sends, the largest SRP IU a port may be configured
/// to take (8276 by default: SRP's `DEFAULT_MAX_IT_IU_LEN`), and every iSER message within
/// 8 KiB of data: the iSER header and BHS (76), the most AHS a PDU may carry (1020: the
/// largest CDB's comes to 252) and 8 KiB of immediate data.
pub const MESSAGE_BUFFER_LEN: usize = 76 + 1020 + 8192;

/// A buffer of a target port: a message buffer of the verbs' own, or a task's data in memory
/// registered for the port (a slot run of a reactor's arena).
#[derive(Debug)]
pub enum PortBuffer<I, D> {
    /// A message: a receive, a send, small parameter data.
    Message(I),
    /// A task's data.
    Data(D),
}

impl<I: DerefMut<Target = [u8]>, D: DerefMut<Target = [u8]>> std::ops::Deref for PortBuffer<I, D> {
    type Target = [u8];

    fn deref(&self) -> &[u8] {
        match self {
            PortBuffer::Message(b) => b,
            PortBuffer::Data(b) => b,
        }
    }
}

impl<I: DerefMut<Target = [u8]>, D: DerefMut<Target = [u8]>> DerefMut for PortBuffer<I, D> {
    fn deref_mut(&mut self) -> &mut [u8] {
        match self {
            PortBuffer::Message(b) => b,
            PortBuffer::Data(b) => b,
        }
    }
}
