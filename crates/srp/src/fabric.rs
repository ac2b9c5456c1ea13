//! A software RDMA fabric in one process: memory regions with keys, bounds and access rights;
//! reliable-connected queue pairs with receive queues, in-order delivery, completions and the
//! errors real hardware gives (a send with no receive posted, a bad key, an access the region
//! does not allow, each puts the queue pair in the error state); RDMA READ and WRITE as copies.
//!
//! No machine here has an RDMA device, so this is what the SRP tests and the paper's
//! experiment run on. It counts what costs on real hardware (registrations, registered bytes,
//! transfers) and can charge each an injected cost to a virtual clock
//! ([`Fabric::elapsed`]), so an experiment measures the cost model deterministically instead
//! of sleeping on a noisy machine.
//!
//! Memory belongs to the fabric ([`Fabric::alloc`]) and is reached through it
//! ([`Fabric::memory`], [`Fabric::memory_mut`]): a virtual address is the memory's number in
//! the high 32 bits and the offset in the low 32, so a descriptor names real bytes and a lie
//! about one is caught, not followed.

use std::collections::{HashMap, VecDeque};
use std::time::Duration;

use crate::iu::MemoryDescriptor;

/// A side of the fabric (a host): remote access is checked against the region's node.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct NodeId(pub u32);

/// A piece of memory allocated from the fabric.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct MemoryId(u32);

/// A queue pair.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct QpId(usize);

/// What a memory region lets the peer do.
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
    /// The key (L_Key and R_Key are one here).
    pub key: u32,
    /// Its first virtual address.
    pub addr: u64,
    /// Its length.
    pub len: u32,
}

impl MemoryRegion {
    /// A descriptor of `len` bytes at `offset` into the region.
    pub fn descriptor(&self, offset: u32, len: u32) -> MemoryDescriptor {
        MemoryDescriptor {
            va: self.addr + u64::from(offset),
            key: self.key,
            len,
        }
    }
}

/// Injected costs, charged to [`Fabric::elapsed`].
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct Costs {
    /// Each registration.
    pub per_registration: Duration,
    /// Each registered byte, in nanoseconds (pinning and translating pages).
    pub per_registered_byte_ns: f64,
    /// Each RDMA READ or WRITE (one work request).
    pub per_transfer: Duration,
    /// Each byte moved, in nanoseconds (the link's speed).
    pub per_byte_ns: f64,
    /// Each send.
    pub per_send: Duration,
}

/// What the fabric has done.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Counters {
    /// Memory registrations, by node index (0 and 1; others summed into 1).
    pub registrations: [u64; 2],
    /// Bytes registered.
    pub registered_bytes: u64,
    /// RDMA READs and WRITEs.
    pub transfers: u64,
    /// Bytes they moved.
    pub transferred_bytes: u64,
    /// Sends.
    pub sends: u64,
}

/// Why a work request failed (the queue pair is then in the error state).
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum VerbsError {
    /// The queue pair is in the error state (or its peer is gone).
    #[error("the queue pair is in the error state")]
    QpError,
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
}

/// A completed work request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum WorkCompletion {
    /// A message arrived in a posted receive.
    Recv(Vec<u8>),
    /// A send, RDMA READ or WRITE finished (`wr_id` as posted), or failed.
    Done {
        /// The work request's id.
        wr_id: u64,
        /// Its result.
        result: Result<(), VerbsError>,
    },
}

#[derive(Debug)]
struct Region {
    node: NodeId,
    memory: MemoryId,
    offset: usize,
    len: usize,
    access: Access,
}

#[derive(Debug)]
struct Qp {
    node: NodeId,
    peer: Option<usize>,
    error: bool,
    /// Lengths of the receives posted.
    receives: VecDeque<usize>,
    completions: VecDeque<WorkCompletion>,
}

/// The fabric: memory, regions, queue pairs, counters and the virtual clock of costs.
#[derive(Debug, Default)]
pub struct Fabric {
    memory: Vec<(NodeId, Vec<u8>)>,
    regions: HashMap<u32, Region>,
    next_key: u32,
    qps: Vec<Qp>,
    /// Injected costs.
    pub costs: Costs,
    /// What has been done.
    pub counters: Counters,
    /// The sum of the injected costs so far.
    pub elapsed: Duration,
}

fn ns(x: f64) -> Duration {
    Duration::from_nanos(x.max(0.0) as u64)
}

impl Fabric {
    /// An empty fabric with no costs.
    pub fn new() -> Fabric {
        Fabric {
            next_key: 0x100,
            ..Fabric::default()
        }
    }

    /// `len` zeroed bytes of memory on `node`.
    pub fn alloc(&mut self, node: NodeId, len: usize) -> MemoryId {
        self.memory.push((node, vec![0; len]));
        MemoryId(self.memory.len() as u32 - 1)
    }

    /// The bytes of `m`.
    pub fn memory(&self, m: MemoryId) -> &[u8] {
        &self.memory[m.0 as usize].1
    }

    /// The bytes of `m`, to fill or change.
    pub fn memory_mut(&mut self, m: MemoryId) -> &mut [u8] {
        &mut self.memory[m.0 as usize].1
    }

    /// The virtual address of byte `offset` of `m`.
    pub fn address(m: MemoryId, offset: usize) -> u64 {
        u64::from(m.0) << 32 | offset as u64
    }

    /// Registers `len` bytes of `m` from `offset` for `access` (charged its cost).
    pub fn register(
        &mut self,
        m: MemoryId,
        offset: usize,
        len: usize,
        access: Access,
    ) -> MemoryRegion {
        let (node, bytes) = &self.memory[m.0 as usize];
        assert!(offset + len <= bytes.len(), "a region within its memory");
        let key = self.next_key;
        self.next_key = self.next_key.wrapping_add(1).max(0x100);
        self.regions.insert(
            key,
            Region {
                node: *node,
                memory: m,
                offset,
                len,
                access,
            },
        );
        let i = (node.0 as usize).min(1);
        self.counters.registrations[i] += 1;
        self.counters.registered_bytes += len as u64;
        self.elapsed +=
            self.costs.per_registration + ns(self.costs.per_registered_byte_ns * len as f64);
        MemoryRegion {
            key,
            addr: Self::address(m, offset),
            len: len as u32,
        }
    }

    /// Deregisters a region: its key no longer grants anything.
    pub fn deregister(&mut self, key: u32) {
        self.regions.remove(&key);
    }

    /// Registered regions.
    pub fn regions(&self) -> usize {
        self.regions.len()
    }

    /// A connected pair of queue pairs, one on each node.
    pub fn connect(&mut self, a: NodeId, b: NodeId) -> (QpId, QpId) {
        let (ia, ib) = (self.qps.len(), self.qps.len() + 1);
        for (node, peer) in [(a, ib), (b, ia)] {
            self.qps.push(Qp {
                node,
                peer: Some(peer),
                error: false,
                receives: VecDeque::new(),
                completions: VecDeque::new(),
            });
        }
        (QpId(ia), QpId(ib))
    }

    /// Disconnects a queue pair: both it and its peer go to the error state.
    pub fn disconnect(&mut self, qp: QpId) {
        if let Some(peer) = self.qps[qp.0].peer.take() {
            self.qps[peer].peer = None;
            self.qps[peer].error = true;
        }
        self.qps[qp.0].error = true;
    }

    /// Whether the queue pair is in the error state.
    pub fn is_error(&self, qp: QpId) -> bool {
        self.qps[qp.0].error
    }

    /// Posts a receive of `len` bytes.
    pub fn post_recv(&mut self, qp: QpId, len: usize) {
        self.qps[qp.0].receives.push_back(len);
    }

    /// Receives posted and not yet consumed.
    pub fn receives(&self, qp: QpId) -> usize {
        self.qps[qp.0].receives.len()
    }

    /// The next completion of `qp`.
    pub fn poll(&mut self, qp: QpId) -> Option<WorkCompletion> {
        self.qps[qp.0].completions.pop_front()
    }

    /// Completes `wr_id` with `e` and puts the queue pair (and its peer) in the error state.
    fn fail(&mut self, qp: QpId, wr_id: u64, e: VerbsError) -> VerbsError {
        self.qps[qp.0].completions.push_back(WorkCompletion::Done {
            wr_id,
            result: Err(e),
        });
        self.disconnect(qp);
        e
    }

    fn ready(&self, qp: QpId) -> Result<usize, VerbsError> {
        let q = &self.qps[qp.0];
        match q.peer {
            Some(p) if !q.error => Ok(p),
            _ => Err(VerbsError::QpError),
        }
    }

    /// Sends `message` to the peer's next posted receive.
    pub fn post_send(&mut self, qp: QpId, wr_id: u64, message: &[u8]) -> Result<(), VerbsError> {
        let peer = match self.ready(qp) {
            Ok(p) => p,
            Err(e) => return Err(self.fail(qp, wr_id, e)),
        };
        let Some(posted) = self.qps[peer].receives.pop_front() else {
            return Err(self.fail(qp, wr_id, VerbsError::ReceiverNotReady));
        };
        if message.len() > posted {
            let e = VerbsError::LengthError {
                len: message.len(),
                posted,
            };
            return Err(self.fail(qp, wr_id, e));
        }
        self.counters.sends += 1;
        self.elapsed += self.costs.per_send + ns(self.costs.per_byte_ns * message.len() as f64);
        self.qps[peer]
            .completions
            .push_back(WorkCompletion::Recv(message.to_vec()));
        self.qps[qp.0].completions.push_back(WorkCompletion::Done {
            wr_id,
            result: Ok(()),
        });
        Ok(())
    }

    /// The bytes `d` names in memory of the peer of `qp`, if it grants `write` or read access.
    fn remote(
        &self,
        qp: QpId,
        d: &MemoryDescriptor,
        write: bool,
    ) -> Result<(usize, usize), VerbsError> {
        let peer = self.ready(qp)?;
        let bad = VerbsError::RemoteAccess {
            key: d.key,
            va: d.va,
            len: d.len,
        };
        let r = self.regions.get(&d.key).ok_or(bad)?;
        if r.node != self.qps[peer].node {
            return Err(bad);
        }
        let allowed = if write {
            r.access.remote_write
        } else {
            r.access.remote_read
        };
        if !allowed {
            return Err(VerbsError::RemoteOperation(d.key));
        }
        let base = Self::address(r.memory, r.offset);
        let start = d.va.checked_sub(base).ok_or(bad)?;
        let end = start.checked_add(u64::from(d.len)).ok_or(bad)?;
        if end > r.len as u64 {
            return Err(bad);
        }
        Ok((r.memory.0 as usize, r.offset + start as usize))
    }

    fn charge_transfer(&mut self, len: usize) {
        self.counters.transfers += 1;
        self.counters.transferred_bytes += len as u64;
        self.elapsed += self.costs.per_transfer + ns(self.costs.per_byte_ns * len as f64);
    }

    /// Checks an RDMA operation of `len` bytes on the peer's region `remote` and charges it:
    /// where the bytes are, or the failure that put the queue pair in the error state.
    fn transfer(
        &mut self,
        qp: QpId,
        wr_id: u64,
        len: usize,
        remote: MemoryDescriptor,
        write: bool,
    ) -> Result<(usize, usize), VerbsError> {
        let d = MemoryDescriptor {
            len: len as u32,
            ..remote
        };
        let checked = match self.remote(qp, &d, write) {
            Ok(_) if len > remote.len as usize => Err(VerbsError::RemoteAccess {
                key: d.key,
                va: d.va,
                len: d.len,
            }),
            other => other,
        };
        match checked {
            Ok(at) => {
                self.charge_transfer(len);
                self.qps[qp.0].completions.push_back(WorkCompletion::Done {
                    wr_id,
                    result: Ok(()),
                });
                Ok(at)
            }
            Err(e) => Err(self.fail(qp, wr_id, e)),
        }
    }

    /// RDMA WRITE of `local` into the peer's region `remote` (at most `remote.len` bytes:
    /// `local.len()` must not exceed it).
    pub fn post_rdma_write(
        &mut self,
        qp: QpId,
        wr_id: u64,
        local: &[u8],
        remote: MemoryDescriptor,
    ) -> Result<(), VerbsError> {
        let (m, at) = self.transfer(qp, wr_id, local.len(), remote, true)?;
        self.memory[m].1[at..at + local.len()].copy_from_slice(local);
        Ok(())
    }

    /// RDMA READ of the peer's region `remote` into `local` (`local.len()` bytes of it).
    pub fn post_rdma_read(
        &mut self,
        qp: QpId,
        wr_id: u64,
        local: &mut [u8],
        remote: MemoryDescriptor,
    ) -> Result<(), VerbsError> {
        let (m, at) = self.transfer(qp, wr_id, local.len(), remote, false)?;
        local.copy_from_slice(&self.memory[m].1[at..at + local.len()]);
        Ok(())
    }

    /// Scatters `local` over `regions` in order with one RDMA WRITE per region (what an SRP
    /// target does for a read's data-in). Stops at the first error.
    pub fn write_scatter(
        &mut self,
        qp: QpId,
        wr_id: u64,
        mut local: &[u8],
        regions: &[MemoryDescriptor],
    ) -> Result<(), VerbsError> {
        for r in regions {
            if local.is_empty() {
                break;
            }
            let n = local.len().min(r.len as usize);
            self.post_rdma_write(qp, wr_id, &local[..n], *r)?;
            local = &local[n..];
        }
        Ok(())
    }

    /// Gathers `local.len()` bytes from `regions` in order with one RDMA READ per region (a
    /// write's data-out). Stops at the first error.
    pub fn read_gather(
        &mut self,
        qp: QpId,
        wr_id: u64,
        mut local: &mut [u8],
        regions: &[MemoryDescriptor],
    ) -> Result<(), VerbsError> {
        for r in regions {
            if local.is_empty() {
                break;
            }
            let n = local.len().min(r.len as usize);
            let (now, rest) = local.split_at_mut(n);
            self.post_rdma_read(qp, wr_id, now, *r)?;
            local = rest;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const T: NodeId = NodeId(0);
    const I: NodeId = NodeId(1);

    #[test]
    fn sends_need_a_posted_receive_of_the_length() {
        let mut f = Fabric::new();
        let (t, i) = f.connect(T, I);
        f.post_recv(i, 16);
        f.post_send(t, 1, b"hello").expect("a receive is posted");
        assert_eq!(f.poll(i), Some(WorkCompletion::Recv(b"hello".to_vec())));
        assert_eq!(
            f.poll(t),
            Some(WorkCompletion::Done {
                wr_id: 1,
                result: Ok(())
            })
        );
        assert_eq!(
            f.post_send(t, 2, b"again"),
            Err(VerbsError::ReceiverNotReady)
        );
        assert!(f.is_error(t) && f.is_error(i));
        let (t, i) = f.connect(T, I);
        f.post_recv(i, 4);
        assert!(matches!(
            f.post_send(t, 3, b"hello"),
            Err(VerbsError::LengthError { .. })
        ));
    }

    #[test]
    fn rdma_checks_keys_bounds_nodes_and_access() {
        let mut f = Fabric::new();
        f.costs.per_registration = Duration::from_micros(8);
        let (t, i) = f.connect(T, I);
        let m = f.alloc(I, 8192);
        let r = f.register(m, 4096, 4096, Access::REMOTE);
        assert_eq!(f.elapsed, Duration::from_micros(8));
        f.post_rdma_write(t, 1, &[7; 100], r.descriptor(10, 100))
            .expect("inside the region");
        assert_eq!(&f.memory(m)[4106..4206], &[7; 100][..]);
        let mut back = [0u8; 100];
        f.post_rdma_read(t, 2, &mut back, r.descriptor(10, 100))
            .expect("readable");
        assert_eq!(back, [7; 100]);
        // Beyond the region, though inside the memory.
        assert!(matches!(
            f.post_rdma_write(t, 3, &[1; 100], r.descriptor(4090, 100)),
            Err(VerbsError::RemoteAccess { .. })
        ));
        let (t, i2) = f.connect(T, I);
        let ro = f.register(
            m,
            0,
            4096,
            Access {
                remote_read: true,
                remote_write: false,
            },
        );
        assert_eq!(
            f.post_rdma_write(t, 4, &[1; 8], ro.descriptor(0, 8)),
            Err(VerbsError::RemoteOperation(ro.key))
        );
        // A region of the target's own node is not the peer's.
        let (t, _) = f.connect(T, I);
        let own = f.alloc(T, 64);
        let own = f.register(own, 0, 64, Access::REMOTE);
        assert!(f
            .post_rdma_write(t, 5, &[1; 8], own.descriptor(0, 8))
            .is_err());
        // A deregistered key grants nothing.
        let (t, _) = f.connect(T, I);
        f.deregister(r.key);
        assert!(f
            .post_rdma_read(t, 6, &mut back, r.descriptor(0, 8))
            .is_err());
        let _ = (i, i2);
    }

    #[test]
    fn scatter_and_gather_follow_the_regions_in_order() {
        let mut f = Fabric::new();
        let (t, _) = f.connect(T, I);
        let m = f.alloc(I, 3 * 4096);
        let regions: Vec<_> = (0..3)
            .rev()
            .map(|k| {
                f.register(m, k * 4096, 4096, Access::REMOTE)
                    .descriptor(0, 4096)
            })
            .collect();
        let data: Vec<u8> = (0..3 * 4096).map(|i| (i / 4096) as u8).collect();
        f.write_scatter(t, 1, &data, &regions).expect("fits");
        assert_eq!(f.memory(m)[0], 2);
        assert_eq!(f.memory(m)[2 * 4096], 0);
        let mut back = vec![0; 3 * 4096];
        f.read_gather(t, 2, &mut back, &regions).expect("fits");
        assert_eq!(back, data);
        assert_eq!(f.counters.transfers, 6);
        assert_eq!(f.counters.registrations, [0, 3]);
    }
}
