//! The controller's end of one NVMe/RDMA queue, as a machine under the controller's
//! connection ([`ControllerConnection`](crate::connection::ControllerConnection), which
//! carries out the commands): it takes each command capsule a RECV brought and hands back
//! the work the shell posts on the queue pair, in order (NVM Express RDMA Transport
//! Specification 1.0b, section 3):
//!
//! - a capsule is the 64-byte SQE and, when its SGL says so, in-capsule data after it; a
//!   Keyed SGL Data Block names the host's registered memory a command's data moves in or
//!   out of. The connection sees a Transport SGL Data Block of that length in its place (data
//!   the transport moves), as over TCP, and this queue keeps the key and address;
//! - a write's data is read from the host by RDMA READ straight into the command's buffer
//!   ([`Work::Read`]), which comes back with [`RdmaQueue::handle_read`];
//! - a read's data goes into the host's memory by RDMA WRITE from the buffer the block
//!   operation filled ([`Work::Write`]), and the response capsule (the CQE alone) follows in
//!   a SEND on the same queue pair ([`Work::Respond`]), which the queue pair's ordering lets
//!   the host see only after the data;
//! - a Connect's data, which Linux's host gives by keyed SGL on the admin queue, is read
//!   before the command goes up ([`Work::FetchConnectData`]): the connection takes Connect
//!   with its data in the capsule, as NVMe/TCP always brings it.
//!
//! Descriptors RDMA does not carry (a Transport SGL Data Block, SGL segments) reach the
//! connection as a descriptor type it refuses (SGL Descriptor Type Invalid). A capsule
//! shorter than an SQE, or one arriving while a Connect's data is being read (a host waits
//! for Connect's response before it sends more), is a protocol error: the shell disconnects.

use std::collections::hash_map::Entry;
use std::collections::{HashMap, VecDeque};
use std::hash::BuildHasherDefault;

use bytes::{Bytes, BytesMut};

use crate::cqe::Cqe;
use crate::fabrics::CONNECT_DATA_LEN;
use crate::opcode::{AdminOpcode, FabricsType};
use crate::sqe::{Sgl, SglKind, Sqe};
use crate::transport::{Arrival, CidHasher, CommandCapsule, Payload, Transport};

/// Bytes the in-capsule data store grows by at once.
const CAPSULE_POOL: usize = 64 * 1024;

/// Bytes of the host's registered memory, as a Keyed SGL Data Block names them: what an
/// RDMA READ or WRITE of the shell's verbs reaches.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Keyed {
    /// The first byte's address in the host's region.
    pub address: u64,
    /// The region's remote key.
    pub key: u32,
    /// Bytes.
    pub length: u32,
}

/// What the queue asks of the shell, in order: post each on the queue pair in the order
/// given.
#[derive(Debug)]
#[must_use = "work is what the queue pair must carry out, in order"]
pub enum Work<B> {
    /// Send this response capsule ([`Cqe::to_bytes`]) in a SEND.
    Respond(Cqe),
    /// Write `payload` (all of it) into the host's memory `remote`: a command's data to the
    /// host. Its response follows.
    Write {
        /// The command's CID.
        cid: u16,
        /// The data.
        payload: Payload<B>,
        /// Where.
        remote: Keyed,
    },
    /// Read `len` bytes of the host's memory `remote` into `buffer[at..at + len]` (a command's
    /// data from the host); hand the buffer back with [`RdmaQueue::handle_read`].
    Read {
        /// The command's CID.
        cid: u16,
        /// The command's buffer, lent to the read.
        buffer: B,
        /// Where in it the data goes.
        at: usize,
        /// Bytes.
        len: u32,
        /// Where from.
        remote: Keyed,
    },
    /// Read the `len` bytes of Connect command `cid`'s data from `remote` into a message
    /// buffer of the shell's, and hand them over with [`RdmaQueue::handle_connect_data`].
    FetchConnectData {
        /// The Connect's CID.
        cid: u16,
        /// Bytes.
        len: u32,
        /// Where from.
        remote: Keyed,
    },
}

/// Why a capsule ends the queue (the shell disconnects).
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum CapsuleError {
    /// A capsule shorter than an SQE.
    #[error("a capsule of {0} bytes, shorter than an SQE")]
    Short(usize),
    /// In-capsule data beyond what the queue takes.
    #[error("{len} bytes of in-capsule data, more than the {most} the queue takes")]
    TooMuchData {
        /// Bytes that came.
        len: usize,
        /// The most the queue takes.
        most: u32,
    },
    /// A capsule while a Connect's data was being read.
    #[error("a capsule came before the Connect in progress was answered")]
    BeforeConnect,
}

/// Why a request of the connection was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum RdmaQueueError {
    /// The command named no host memory (no Keyed SGL Data Block).
    #[error("command {0} named no host memory")]
    NoKeyedSgl(u16),
    /// More data than the command's keyed SGL names.
    #[error("{len} bytes for command {cid}, whose keyed SGL names {keyed}")]
    TooLong {
        /// The command.
        cid: u16,
        /// Bytes asked to move.
        len: u32,
        /// Bytes the SGL names.
        keyed: u32,
    },
}

/// The controller's end of one NVMe/RDMA queue; `B` the shell's data buffers.
#[derive(Debug)]
pub struct RdmaQueue<B> {
    /// The most in-capsule data a capsule may carry (the queue's command capsule size less
    /// the SQE).
    max_in_capsule_data: u32,
    /// The host memory of each command in flight that named some, by CID.
    keyed: HashMap<u16, Keyed, BuildHasherDefault<CidHasher>>,
    arrivals: VecDeque<Arrival<B>>,
    work: VecDeque<Work<B>>,
    /// The Connect whose data is being read.
    connecting: Option<Sqe>,
    /// Commands that came with the CID of one in flight: the connection refuses each (Command
    /// ID Conflict), and that response must leave the first command's memory alone.
    conflicts: Vec<u16>,
    /// Where in-capsule data is kept until its command copies it into its buffer: one
    /// allocation reused once the data handed out has been let go, so a capsule costs no
    /// allocation in steady state.
    capsules: BytesMut,
}

impl<B> RdmaQueue<B> {
    /// A queue just connected, taking at most `max_in_capsule_data` bytes of data in a capsule.
    pub fn new(max_in_capsule_data: u32) -> RdmaQueue<B> {
        RdmaQueue {
            max_in_capsule_data,
            keyed: HashMap::with_capacity_and_hasher(256, BuildHasherDefault::default()),
            arrivals: VecDeque::with_capacity(64),
            work: VecDeque::with_capacity(256),
            connecting: None,
            conflicts: Vec::new(),
            capsules: BytesMut::new(),
        }
    }

    /// A capsule a RECV brought (its bytes: the receive buffer may be posted again once this
    /// returns). An error ends the queue.
    pub fn handle_capsule(&mut self, capsule: &[u8]) -> Result<(), CapsuleError> {
        if self.connecting.is_some() {
            return Err(CapsuleError::BeforeConnect);
        }
        let Some(mut sqe) = capsule.get(..Sqe::LEN).and_then(Sqe::parse) else {
            return Err(CapsuleError::Short(capsule.len()));
        };
        let data = &capsule[Sqe::LEN..];
        if data.len() > self.max_in_capsule_data as usize {
            return Err(CapsuleError::TooMuchData {
                len: data.len(),
                most: self.max_in_capsule_data,
            });
        }
        let cid = sqe.cid();
        match sqe.sgl().kind() {
            SglKind::Keyed {
                address,
                length,
                key,
                ..
            } => {
                let remote = Keyed {
                    address,
                    key,
                    length,
                };
                let connect = sqe.opcode() == AdminOpcode::Fabrics.code()
                    && sqe.fctype() == FabricsType::Connect.code();
                if connect && length as usize == CONNECT_DATA_LEN {
                    self.work.push_back(Work::FetchConnectData {
                        cid,
                        len: length,
                        remote,
                    });
                    self.connecting = Some(sqe);
                    return Ok(());
                }
                match self.keyed.entry(cid) {
                    Entry::Occupied(_) => self.conflicts.push(cid),
                    Entry::Vacant(v) => {
                        v.insert(remote);
                    }
                }
                sqe.set_sgl(Sgl::transport(length));
            }
            kind => {
                if self.keyed.contains_key(&cid) {
                    self.conflicts.push(cid);
                }
                // RDMA moves data only by keyed SGLs and in capsules.
                if let SglKind::Transport { .. } = kind {
                    sqe.set_sgl(Sgl::from_bytes([0xff; Sgl::LEN]));
                }
            }
        }
        let data = if data.is_empty() {
            Bytes::new()
        } else {
            self.capsules.reserve(CAPSULE_POOL.max(data.len()));
            self.capsules.extend_from_slice(data);
            self.capsules.split().freeze()
        };
        self.arrivals.push_back(Arrival::Command(CommandCapsule {
            sqe,
            data,
            data_digest_ok: true,
        }));
        Ok(())
    }

    /// The data a [`Work::FetchConnectData`] read (`None` when the read failed: the Connect
    /// ends with Transient Transport Error).
    pub fn handle_connect_data(&mut self, data: Option<&[u8]>) {
        let Some(mut sqe) = self.connecting.take() else {
            return;
        };
        let data = data.map(|d| &d[..d.len().min(CONNECT_DATA_LEN)]);
        sqe.set_sgl(Sgl::in_capsule(0, data.map_or(0, |d| d.len() as u32)));
        self.arrivals.push_back(Arrival::Command(CommandCapsule {
            sqe,
            data: data.map_or_else(Bytes::new, Bytes::copy_from_slice),
            data_digest_ok: data.is_some(),
        }));
    }

    /// The buffer of a [`Work::Read`] back; `placed` false when the read failed (the queue
    /// pair is then in the error state).
    pub fn handle_read(&mut self, cid: u16, buffer: B, placed: bool) {
        self.arrivals.push_back(Arrival::Placed {
            cid,
            buffer,
            placed,
        });
    }

    /// The next work request, in the order they must be posted.
    pub fn poll_work(&mut self) -> Option<Work<B>> {
        self.work.pop_front()
    }

    /// Commands in flight that named host memory.
    pub fn keyed_in_flight(&self) -> usize {
        self.keyed.len()
    }

    /// The host memory of command `cid`, checked to hold `len` bytes.
    fn remote(&self, cid: u16, len: u32) -> Result<Keyed, RdmaQueueError> {
        let k = *self
            .keyed
            .get(&cid)
            .ok_or(RdmaQueueError::NoKeyedSgl(cid))?;
        if len > k.length {
            return Err(RdmaQueueError::TooLong {
                cid,
                len,
                keyed: k.length,
            });
        }
        Ok(Keyed { length: len, ..k })
    }
}

/// NVMe/RDMA under a controller's connection: a write's data comes by RDMA READ into the
/// command's buffer, lent to the read; a read's goes by RDMA WRITE, always followed by its
/// response capsule.
impl<B: std::ops::Deref<Target = [u8]>> Transport<B> for RdmaQueue<B> {
    type Error = RdmaQueueError;
    const DATA_CARRIES_SUCCESS: bool = false;

    fn poll_arrival(&mut self) -> Option<Arrival<B>> {
        self.arrivals.pop_front()
    }

    fn peek_command(&self) -> Option<(&Sqe, &[u8])> {
        match self.arrivals.front()? {
            Arrival::Command(c) => Some((&c.sqe, &c.data)),
            _ => None,
        }
    }

    fn has_arrival(&self) -> bool {
        !self.arrivals.is_empty()
    }

    fn request_data(
        &mut self,
        cid: u16,
        len: u32,
        buffer: B,
        at: usize,
    ) -> Result<Option<B>, RdmaQueueError> {
        let remote = self.remote(cid, len)?;
        self.work.push_back(Work::Read {
            cid,
            buffer,
            at,
            len,
            remote,
        });
        Ok(None)
    }

    fn send_data(
        &mut self,
        cid: u16,
        data: Payload<B>,
        _success: bool,
    ) -> Result<(), RdmaQueueError> {
        let len = u32::try_from(data.len()).unwrap_or(u32::MAX);
        let remote = self.remote(cid, len)?;
        self.work.push_back(Work::Write {
            cid,
            payload: data,
            remote,
        });
        Ok(())
    }

    fn complete(&mut self, cqe: Cqe) -> Result<(), RdmaQueueError> {
        match self.conflicts.iter().position(|&c| c == cqe.cid) {
            Some(i) => {
                self.conflicts.swap_remove(i);
            }
            None => {
                self.keyed.remove(&cqe.cid);
            }
        }
        self.work.push_back(Work::Respond(cqe));
        Ok(())
    }

    fn is_over(&self) -> bool {
        false
    }
}
