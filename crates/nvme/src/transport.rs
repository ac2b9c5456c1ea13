//! What a controller's connection needs of the transport that carries its queue: the
//! seam between [`ControllerConnection`](crate::connection::ControllerConnection), which
//! carries out commands whatever moves them, and a transport's queue machine, which moves
//! capsules and data its own way. NVMe/TCP's [`ControllerQueue`](crate::tcp::ControllerQueue)
//! frames PDUs on a byte stream: a write's data comes in H2CData answering an R2T and is
//! copied where the command wants it. NVMe/RDMA's
//! [`RdmaQueue`](crate::rdma::RdmaQueue) moves a command's data by RDMA READ and WRITE of
//! the host's memory its keyed SGL names: the buffer itself is lent to the transport and comes
//! back filled.

use std::hash::Hasher;
use std::ops::Deref;

use bytes::Bytes;

use crate::cqe::Cqe;
use crate::sqe::Sqe;

/// A command capsule, with its in-capsule data (empty when none), as any transport hands it
/// up.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CommandCapsule {
    /// The SQE.
    pub sqe: Sqe,
    /// In-capsule data.
    pub data: Bytes,
    /// False when the data digest did not match: the command ends with Transient Transport
    /// Error.
    pub data_digest_ok: bool,
}

/// Data of a write that arrives to be copied in (NVMe/TCP's H2CData answering an R2T):
/// `data` is the command's bytes at `offset`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WriteData {
    /// The command's CID.
    pub cid: u16,
    /// Offset in the command's data.
    pub offset: u32,
    /// The data.
    pub data: Bytes,
    /// The last of what was asked.
    pub last: bool,
    /// False when the data digest did not match.
    pub data_digest_ok: bool,
}

/// What arrived on a queue, for the connection.
#[derive(Debug)]
pub enum Arrival<B> {
    /// A command capsule.
    Command(CommandCapsule),
    /// Data of a write copied in as it comes ([`Transport::request_data`] kept no buffer).
    Data(WriteData),
    /// The buffer [`Transport::request_data`] took, back with all the data asked for in
    /// place (`placed` false when the transport could not move it).
    Placed {
        /// The command's CID.
        cid: u16,
        /// The command's buffer.
        buffer: B,
        /// Whether the data is in.
        placed: bool,
    },
    /// Something of the transport's own the connection has nothing to do with (NVMe/TCP's
    /// ICReq or TermReq).
    Other,
}

/// A queue's transport, as the controller's connection drives it.
pub trait Transport<B> {
    /// Why a request of the transport was refused (the command then ends with an error).
    type Error: std::fmt::Debug;
    /// Whether a read's data may carry its command's success, no response capsule following,
    /// when the host disabled SQ flow control (NVMe/TCP's C2HData SUCCESS flag).
    const DATA_CARRIES_SUCCESS: bool;

    /// The next arrival.
    fn poll_arrival(&mut self) -> Option<Arrival<B>>;
    /// The command capsule that arrives next, when the next arrival is one.
    fn peek_command(&self) -> Option<(&Sqe, &[u8])>;
    /// Whether anything waits to be taken.
    fn has_arrival(&self) -> bool;
    /// Asks for `len` bytes of command `cid`'s data, to go into `buffer[at..at + len]`. The
    /// transport gives the buffer back (`Ok(Some)`) when the data will come in
    /// [`Arrival::Data`] to be copied in, or keeps it (`Ok(None)`) and hands it back in
    /// [`Arrival::Placed`] with the data in place.
    fn request_data(
        &mut self,
        cid: u16,
        len: u32,
        buffer: B,
        at: usize,
    ) -> Result<Option<B>, Self::Error>;
    /// Sends command `cid`'s data to the host (all of it); `success` when the command ends
    /// with it ([`Transport::DATA_CARRIES_SUCCESS`]).
    fn send_data(&mut self, cid: u16, data: Payload<B>, success: bool) -> Result<(), Self::Error>;
    /// Ends command `cid` with `cqe` (a response capsule).
    fn complete(&mut self, cqe: Cqe) -> Result<(), Self::Error>;
    /// Whether the queue is over (the connection closes).
    fn is_over(&self) -> bool;
}

/// Data to send to the host: bytes of its own, or the first `len` bytes of a buffer the
/// shell lent (a read's data where the backend put it, sent without a copy and given back
/// when the send is done: in a C2HData over TCP, by RDMA WRITE over RDMA).
pub enum Payload<B> {
    /// Bytes of its own (a log page, an error's header).
    Bytes(Bytes),
    /// The first `len` bytes of `buffer`.
    Buffer {
        /// The buffer.
        buffer: B,
        /// Bytes of it to send.
        len: usize,
    },
}

impl<B: Deref<Target = [u8]>> Deref for Payload<B> {
    type Target = [u8];

    fn deref(&self) -> &[u8] {
        match self {
            Payload::Bytes(b) => b,
            Payload::Buffer { buffer, len } => &buffer[..*len],
        }
    }
}

impl<B> From<Bytes> for Payload<B> {
    fn from(b: Bytes) -> Self {
        Payload::Bytes(b)
    }
}

impl<B> std::fmt::Debug for Payload<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Payload::Bytes(b) => write!(f, "Bytes({} bytes)", b.len()),
            Payload::Buffer { len, .. } => write!(f, "Buffer({len} bytes)"),
        }
    }
}

/// Hashes a CID as itself: the host picks CIDs, and a table of at most a queue's entries
/// needs no defence against collisions a keyed hash would give (the CIDs in flight are
/// distinct, and at most MQES + 1 of them).
#[derive(Debug, Default)]
pub(crate) struct CidHasher(u64);

impl Hasher for CidHasher {
    fn finish(&self) -> u64 {
        // Spread the 16 bits over the word: hashbrown takes its control bits from the top.
        self.0.wrapping_mul(0x9e37_79b9_7f4a_7c15)
    }

    fn write(&mut self, bytes: &[u8]) {
        for b in bytes {
            self.0 = self.0 << 8 | u64::from(*b);
        }
    }

    fn write_u16(&mut self, n: u16) {
        self.0 = u64::from(n);
    }
}
