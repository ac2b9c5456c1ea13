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

use crate::verbs::RemoteRegion;
pub use crate::verbs::{Access, MemoryRegion, VerbsError};
use crate::verbs::{Completion, MessageBuffers, PeerMemory, Verbs, WorkOp, MESSAGE_BUFFER_LEN};

/// A side of the fabric (a host): remote access is checked against the region's node.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct NodeId(pub u32);

/// A piece of memory allocated from the fabric.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct MemoryId(u32);

/// A queue pair.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct QpId(usize);

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

/// The fabric's costs set from paper 004's measurements (InfiniBand 4x, a 600 MB/s link): 32
/// registrations of 4 KiB took 260 us and one registration of a 128 KiB scatter list 22 us, so
/// a registration costs 7.68 us plus 0.109 ns per byte; each RDMA operation or send costs
/// its InfiniBand headers on the wire (LRH, BTH, RETH, ICRC, VCRC: 42 bytes, 70 ns); each
/// byte 1.667 ns.
pub const PAPER_004_COSTS: Costs = Costs {
    per_registration: Duration::from_nanos(7_677),
    per_registered_byte_ns: 0.10927,
    per_transfer: Duration::from_nanos(70),
    per_byte_ns: 1.6667,
    per_send: Duration::from_nanos(70),
};

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

#[derive(Debug)]
struct Region {
    node: NodeId,
    memory: MemoryId,
    offset: usize,
    len: usize,
    access: Access,
}

/// Entries each queue pair's receive and completion queues hold before they grow, as a real
/// device's queues are sized when they are made: a peer that polls late makes the other side
/// post into room that is already there, not allocate on its thread.
const QUEUE_DEPTH: usize = 1024;

#[derive(Debug)]
struct Qp {
    node: NodeId,
    peer: Option<usize>,
    error: bool,
    /// Receives posted: their ids and buffers.
    receives: VecDeque<(u64, Vec<u8>)>,
    completions: VecDeque<Completion<Vec<u8>>>,
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

    /// The verbs of `node`: what a shell on that host is given.
    pub fn port(&mut self, node: NodeId) -> Port<'_> {
        Port { fabric: self, node }
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
            lkey: key,
            rkey: key,
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
                receives: VecDeque::with_capacity(QUEUE_DEPTH),
                completions: VecDeque::with_capacity(QUEUE_DEPTH),
            });
        }
        (QpId(ia), QpId(ib))
    }

    /// Puts a queue pair in the error state, flushing its receives.
    fn break_qp(&mut self, i: usize) {
        let q = &mut self.qps[i];
        q.error = true;
        while let Some((wr_id, buffer)) = q.receives.pop_front() {
            q.completions.push_back(Completion {
                wr_id,
                op: WorkOp::Recv,
                buffer,
                len: 0,
                result: Err(VerbsError::Flushed),
            });
        }
    }

    /// Disconnects a queue pair: both it and its peer go to the error state.
    pub fn disconnect(&mut self, qp: QpId) {
        if let Some(peer) = self.qps[qp.0].peer.take() {
            self.qps[peer].peer = None;
            self.break_qp(peer);
        }
        self.break_qp(qp.0);
    }

    /// The node at the other end of `qp`, while they are connected.
    pub fn peer_node(&self, qp: QpId) -> Option<NodeId> {
        let peer = self.qps.get(qp.0)?.peer?;
        Some(self.qps[peer].node)
    }

    /// Whether the queue pair is in the error state.
    pub fn is_error(&self, qp: QpId) -> bool {
        self.qps[qp.0].error
    }

    /// Posts a receive into `buffer`.
    pub fn post_recv(&mut self, qp: QpId, wr_id: u64, buffer: Vec<u8>) {
        self.qps[qp.0].receives.push_back((wr_id, buffer));
        if self.qps[qp.0].error {
            self.break_qp(qp.0);
        }
    }

    /// Receives posted and not yet consumed.
    pub fn receives(&self, qp: QpId) -> usize {
        self.qps[qp.0].receives.len()
    }

    /// The next completion of `qp`.
    pub fn poll(&mut self, qp: QpId) -> Option<Completion<Vec<u8>>> {
        self.qps[qp.0].completions.pop_front()
    }

    fn complete(&mut self, qp: QpId, wr_id: u64, op: WorkOp, buffer: Vec<u8>, len: usize) {
        self.qps[qp.0].completions.push_back(Completion {
            wr_id,
            op,
            buffer,
            len,
            result: Ok(()),
        });
    }

    /// Completes a request with `e` and puts the queue pair (and its peer) in the error state.
    fn fail(&mut self, qp: QpId, wr_id: u64, op: WorkOp, buffer: Vec<u8>, e: VerbsError) {
        self.qps[qp.0].completions.push_back(Completion {
            wr_id,
            op,
            buffer,
            len: 0,
            result: Err(e),
        });
        self.disconnect(qp);
    }

    fn ready(&self, qp: QpId) -> Result<usize, VerbsError> {
        let q = &self.qps[qp.0];
        match q.peer {
            Some(p) if !q.error => Ok(p),
            _ => Err(VerbsError::Flushed),
        }
    }

    /// Sends the first `len` bytes of `buffer` to the peer's next posted receive.
    pub fn post_send(&mut self, qp: QpId, wr_id: u64, buffer: Vec<u8>, len: usize) {
        let peer = match self.ready(qp) {
            Ok(p) => p,
            Err(e) => return self.fail(qp, wr_id, WorkOp::Send, buffer, e),
        };
        let Some((rwr, mut rbuf)) = self.qps[peer].receives.pop_front() else {
            return self.fail(
                qp,
                wr_id,
                WorkOp::Send,
                buffer,
                VerbsError::ReceiverNotReady,
            );
        };
        if len > rbuf.len() || len > buffer.len() {
            let e = VerbsError::LengthError {
                len,
                posted: rbuf.len(),
            };
            self.qps[peer].receives.push_front((rwr, rbuf));
            return self.fail(qp, wr_id, WorkOp::Send, buffer, e);
        }
        self.counters.sends += 1;
        self.elapsed += self.costs.per_send + ns(self.costs.per_byte_ns * len as f64);
        rbuf[..len].copy_from_slice(&buffer[..len]);
        self.qps[peer].completions.push_back(Completion {
            wr_id: rwr,
            op: WorkOp::Recv,
            buffer: rbuf,
            len,
            result: Ok(()),
        });
        self.complete(qp, wr_id, WorkOp::Send, buffer, len);
    }

    /// Where the bytes `d` names are in memory of the peer of `qp`, if it grants `write` or
    /// read access.
    fn remote(
        &self,
        qp: QpId,
        d: &RemoteRegion,
        write: bool,
    ) -> Result<(usize, usize), VerbsError> {
        let peer = self.ready(qp)?;
        let bad = VerbsError::RemoteAccess {
            key: d.rkey,
            va: d.addr,
            len: d.len,
        };
        let r = self.regions.get(&d.rkey).ok_or(bad)?;
        if r.node != self.qps[peer].node {
            return Err(bad);
        }
        let allowed = if write {
            r.access.remote_write
        } else {
            r.access.remote_read
        };
        if !allowed {
            return Err(VerbsError::RemoteOperation(d.rkey));
        }
        let base = Self::address(r.memory, r.offset);
        let start = d.addr.checked_sub(base).ok_or(bad)?;
        let end = start.checked_add(u64::from(d.len)).ok_or(bad)?;
        if end > r.len as u64 {
            return Err(bad);
        }
        Ok((r.memory.0 as usize, r.offset + start as usize))
    }

    /// One RDMA operation per descriptor of `remote` over the first `len` bytes of `buffer`,
    /// in order: WRITE copies the buffer out to the peer, READ copies the peer's bytes in. The
    /// first failure ends it and puts the queue pair in the error state.
    #[allow(clippy::too_many_arguments)]
    fn rdma(
        &mut self,
        qp: QpId,
        wr_id: u64,
        mut buffer: Vec<u8>,
        start: usize,
        len: usize,
        remote: &[RemoteRegion],
        write: bool,
    ) {
        let op = if write {
            WorkOp::RdmaWrite
        } else {
            WorkOp::RdmaRead
        };
        let end = start.saturating_add(len);
        let mut at = start;
        for d in remote {
            if at >= end {
                break;
            }
            let n = (end - at).min(d.len as usize);
            let part = RemoteRegion {
                len: n as u32,
                ..*d
            };
            let checked = match self.remote(qp, &part, write) {
                Ok(_) if at + n > buffer.len() => Err(VerbsError::LengthError {
                    len: end,
                    posted: buffer.len(),
                }),
                other => other,
            };
            let (m, offset) = match checked {
                Ok(place) => place,
                Err(e) => return self.fail(qp, wr_id, op, buffer, e),
            };
            let theirs = &mut self.memory[m].1[offset..offset + n];
            if write {
                theirs.copy_from_slice(&buffer[at..at + n]);
            } else {
                buffer[at..at + n].copy_from_slice(theirs);
            }
            self.counters.transfers += 1;
            self.counters.transferred_bytes += n as u64;
            self.elapsed += self.costs.per_transfer + ns(self.costs.per_byte_ns * n as f64);
            at += n;
        }
        self.complete(qp, wr_id, op, buffer, at - start);
    }

    /// RDMA WRITE of `buffer[at..at + len]` over the peer's regions `remote`, in order (a
    /// read's data-in).
    pub fn post_rdma_write(
        &mut self,
        qp: QpId,
        wr_id: u64,
        buffer: Vec<u8>,
        at: usize,
        len: usize,
        remote: &[RemoteRegion],
    ) {
        self.rdma(qp, wr_id, buffer, at, len, remote, true);
    }

    /// RDMA READ of `len` bytes from the peer's regions `remote`, in order, into
    /// `buffer[at..]` (a write's data-out).
    pub fn post_rdma_read(
        &mut self,
        qp: QpId,
        wr_id: u64,
        buffer: Vec<u8>,
        at: usize,
        len: usize,
        remote: &[RemoteRegion],
    ) {
        self.rdma(qp, wr_id, buffer, at, len, remote, false);
    }
}

/// The verbs of one node of a [`Fabric`].
#[derive(Debug)]
pub struct Port<'a> {
    fabric: &'a mut Fabric,
    node: NodeId,
}

impl PeerMemory for Port<'_> {
    type Memory = MemoryId;

    fn alloc(&mut self, len: usize) -> Result<MemoryId, VerbsError> {
        Ok(self.fabric.alloc(self.node, len))
    }

    fn read(&self, m: &MemoryId, offset: usize, out: &mut [u8]) {
        out.copy_from_slice(&self.fabric.memory(*m)[offset..offset + out.len()]);
    }

    fn write(&mut self, m: &MemoryId, offset: usize, data: &[u8]) {
        self.fabric.memory_mut(*m)[offset..offset + data.len()].copy_from_slice(data);
    }

    fn register(
        &mut self,
        m: &MemoryId,
        offset: usize,
        len: usize,
        access: Access,
    ) -> Result<MemoryRegion, VerbsError> {
        let fits = match self.fabric.memory.get(m.0 as usize) {
            Some((node, bytes)) => {
                *node == self.node && offset.checked_add(len).is_some_and(|e| e <= bytes.len())
            }
            None => false,
        };
        if !fits {
            return Err(VerbsError::Registration);
        }
        Ok(self.fabric.register(*m, offset, len, access))
    }

    fn deregister(&mut self, region: MemoryRegion) {
        self.fabric.deregister(region.rkey);
    }
}

impl MessageBuffers for Port<'_> {
    type Message = Vec<u8>;

    fn message_buffer(&mut self) -> Option<Vec<u8>> {
        Some(vec![0; MESSAGE_BUFFER_LEN])
    }
}

impl Verbs for Port<'_> {
    type Qp = QpId;
    type Buffer = Vec<u8>;

    fn post_recv(&mut self, qp: QpId, wr_id: u64, buffer: Vec<u8>) {
        self.fabric.post_recv(qp, wr_id, buffer);
    }

    fn post_send(&mut self, qp: QpId, wr_id: u64, buffer: Vec<u8>, len: usize) {
        self.fabric.post_send(qp, wr_id, buffer, len);
    }

    fn post_rdma_write(
        &mut self,
        qp: QpId,
        wr_id: u64,
        buffer: Vec<u8>,
        at: usize,
        len: usize,
        remote: &[RemoteRegion],
    ) {
        self.fabric
            .post_rdma_write(qp, wr_id, buffer, at, len, remote);
    }

    fn post_rdma_read(
        &mut self,
        qp: QpId,
        wr_id: u64,
        buffer: Vec<u8>,
        at: usize,
        len: usize,
        remote: &[RemoteRegion],
    ) {
        self.fabric
            .post_rdma_read(qp, wr_id, buffer, at, len, remote);
    }

    fn poll(&mut self, qp: QpId) -> Option<Completion<Vec<u8>>> {
        self.fabric.poll(qp)
    }

    fn is_error(&self, qp: QpId) -> bool {
        self.fabric.is_error(qp)
    }

    fn disconnect(&mut self, qp: QpId) {
        self.fabric.disconnect(qp);
    }
}
#[cfg(test)]
mod tests {
    use super::*;

    const T: NodeId = NodeId(0);
    const I: NodeId = NodeId(1);

    fn done(f: &mut Fabric, qp: QpId) -> Completion<Vec<u8>> {
        f.poll(qp).expect("a completion")
    }

    #[test]
    fn sends_need_a_posted_receive_of_the_length() {
        let mut f = Fabric::new();
        let (t, i) = f.connect(T, I);
        f.post_recv(i, 7, vec![0; 16]);
        f.post_send(t, 1, b"hello".to_vec(), 5);
        let r = done(&mut f, i);
        assert_eq!(
            (r.wr_id, r.op, r.len, r.result),
            (7, WorkOp::Recv, 5, Ok(()))
        );
        assert_eq!(&r.buffer[..5], b"hello");
        let s = done(&mut f, t);
        assert_eq!((s.wr_id, s.op, s.result), (1, WorkOp::Send, Ok(())));
        // No receive posted: the sender's request fails and both sides break.
        f.post_send(t, 2, b"again".to_vec(), 5);
        let s = done(&mut f, t);
        assert_eq!(s.result, Err(VerbsError::ReceiverNotReady));
        assert_eq!(s.buffer, b"again", "the buffer comes back");
        assert!(f.is_error(t) && f.is_error(i));
        // A receive posted on a broken queue pair is flushed back.
        f.post_recv(i, 8, vec![0; 4]);
        assert_eq!(done(&mut f, i).result, Err(VerbsError::Flushed));
        let (t, i) = f.connect(T, I);
        f.post_recv(i, 9, vec![0; 4]);
        f.post_send(t, 3, b"hello".to_vec(), 5);
        assert!(matches!(
            done(&mut f, t).result,
            Err(VerbsError::LengthError { .. })
        ));
        let r = done(&mut f, i);
        assert_eq!((r.wr_id, r.result), (9, Err(VerbsError::Flushed)));
    }

    #[test]
    fn rdma_checks_keys_bounds_nodes_and_access() {
        let mut f = Fabric::new();
        f.costs.per_registration = Duration::from_micros(8);
        let (t, _) = f.connect(T, I);
        let m = f.alloc(I, 8192);
        let r = f.register(m, 4096, 4096, Access::REMOTE);
        assert_eq!(f.elapsed, Duration::from_micros(8));
        f.post_rdma_write(t, 1, vec![7; 100], 0, 100, &[r.remote(10, 100)]);
        assert_eq!(done(&mut f, t).result, Ok(()));
        assert_eq!(&f.memory(m)[4106..4206], &[7; 100][..]);
        f.post_rdma_read(t, 2, vec![0; 100], 0, 100, &[r.remote(10, 100)]);
        let back = done(&mut f, t);
        assert_eq!((back.op, back.len), (WorkOp::RdmaRead, 100));
        assert_eq!(back.buffer, [7; 100]);
        // Beyond the region, though inside the memory.
        f.post_rdma_write(t, 3, vec![1; 100], 0, 100, &[r.remote(4090, 100)]);
        assert!(matches!(
            done(&mut f, t).result,
            Err(VerbsError::RemoteAccess { .. })
        ));
        assert!(f.is_error(t));
        // Read-only.
        let (t, _) = f.connect(T, I);
        let ro = f.register(
            m,
            0,
            4096,
            Access {
                remote_read: true,
                remote_write: false,
            },
        );
        f.post_rdma_write(t, 4, vec![1; 8], 0, 8, &[ro.remote(0, 8)]);
        assert_eq!(
            done(&mut f, t).result,
            Err(VerbsError::RemoteOperation(ro.rkey))
        );
        // A region of the target's own node is not the peer's.
        let (t, _) = f.connect(T, I);
        let own = f.alloc(T, 64);
        let own = f.register(own, 0, 64, Access::REMOTE);
        f.post_rdma_write(t, 5, vec![1; 8], 0, 8, &[own.remote(0, 8)]);
        assert!(done(&mut f, t).result.is_err());
        // A deregistered key grants nothing.
        let (t, _) = f.connect(T, I);
        f.deregister(r.rkey);
        f.post_rdma_read(t, 6, vec![0; 8], 0, 8, &[r.remote(0, 8)]);
        assert!(done(&mut f, t).result.is_err());
        // The verbs of a node register only that node's memory.
        assert_eq!(
            f.port(T).register(&m, 0, 8, Access::REMOTE),
            Err(VerbsError::Registration)
        );
        assert!(f.port(I).register(&m, 8000, 400, Access::REMOTE).is_err());
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
                    .remote(0, 4096)
            })
            .collect();
        let data: Vec<u8> = (0..3 * 4096).map(|i| (i / 4096) as u8).collect();
        f.post_rdma_write(t, 1, data.clone(), 0, data.len(), &regions);
        assert_eq!(done(&mut f, t).len, 3 * 4096);
        assert_eq!(f.memory(m)[0], 2);
        assert_eq!(f.memory(m)[2 * 4096], 0);
        f.post_rdma_read(t, 2, vec![0; 3 * 4096], 0, 3 * 4096, &regions);
        assert_eq!(done(&mut f, t).buffer, data);
        assert_eq!(f.counters.transfers, 6);
        assert_eq!(f.counters.registrations, [0, 3]);
    }
}
