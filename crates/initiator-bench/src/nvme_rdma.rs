//! Workloads over NVMe/RDMA: `initiator-bench run --transport nvme-rdma
//! nvme://ADDR[:PORT]/SUBNQN/NSID` on an RDMA device (feature `rdma`), and on any other verbs
//! (the software fabric in tests).
//!
//! A controller of two queues, each its own reliable connection set up with the NVMe/RDMA
//! connection manager's private data (crates/nvme's [`nvme::rdma::CmRequest`]): the admin
//! queue connects, enables the controller, asks for one I/O queue and identifies the
//! namespace; the I/O queue carries the run. As Linux's host does, every command's data, Connect's included, lies in the
//! host's registered memory named by a Keyed SGL Data Block: the target reads a write's data
//! with RDMA READ and writes a read's with RDMA WRITE. Each command's buffer is a place of an
//! [`srp::initiator::DataMemory`] registered as `--registration` says (one region: a keyed SGL
//! names one). Keep Alive goes on the admin queue every half of the keep alive timeout. The
//! run itself is [`crate::rdma`]'s, as SRP's and iSER's are: its READ(16) and WRITE(16) become
//! NVMe Read and Write of the namespace, and its TEST UNIT READY, which clears a SCSI unit
//! attention, is answered here (NVMe has none).

use std::collections::{HashMap, VecDeque};
use std::time::{Duration, Instant};

use nvme::fabrics::{property, CC_EN, CNTLID_DYNAMIC, CONNECT_DATA_LEN, CSTS_RDY};
use nvme::identify::cns;
use nvme::opcode::{AdminOpcode, NvmOpcode};
use nvme::sqe::{Sgl, Sqe};
use nvme::Cqe;
use rdma::verbs::{MessageBuffers, PeerMemory, Verbs, WorkOp};
use srp::initiator::{DataMemory, Exposed};

use crate::nvme::{connect_command, namespace_info, NamespaceInfo, NvmeOptions, NvmeUrl};
use crate::rdma::{Answered, BlockChannel, RdmaOptions, Request, BLOCK_SIZE};

/// Entries of the admin queue (Linux's NVME_AQ_DEPTH).
pub const ADMIN_ENTRIES: u16 = 32;
/// Entries of the I/O queue (Linux's default; targetd takes at most 128 over RDMA).
pub const IO_ENTRIES: u16 = 128;
/// How long the set-up and each command may take.
const WAIT: Duration = Duration::from_secs(30);
/// The place a set-up command's data takes (Identify's 4 KiB).
const SETUP_LEN: usize = 4096;
const _: () = assert!(
    CONNECT_DATA_LEN <= SETUP_LEN,
    "Connect's data fits a set-up place"
);

/// One queue: its queue pair and the next CID of its own.
#[derive(Debug)]
struct Queue<Q> {
    qp: Q,
    next_cid: u16,
}

/// A command in flight on the I/O queue.
#[derive(Debug, Clone, Copy)]
struct InFlight {
    tag: u64,
    key: Option<u64>,
    read_len: u32,
}

/// An NVMe/RDMA controller as the runner drives it: its admin queue and one I/O queue.
#[derive(Debug)]
pub struct NvmeRdmaChannel<V: Verbs + PeerMemory> {
    admin: Queue<V::Qp>,
    io: Queue<V::Qp>,
    memory: DataMemory<V::Memory>,
    places: usize,
    nsid: u32,
    /// What Identify Namespace said.
    pub namespace: NamespaceInfo,
    /// Its controller ID.
    pub cntlid: u16,
    in_flight: HashMap<u16, InFlight>,
    next_key: u64,
    answers: VecDeque<Answered>,
    keep_alive: (Duration, Instant),
    failed: Option<String>,
}

impl<V> NvmeRdmaChannel<V>
where
    V: Verbs + PeerMemory + MessageBuffers<Message = <V as Verbs>::Buffer>,
{
    /// Sets up a controller of `url`'s subsystem over `admin` and `io`, queue pairs connected
    /// with the connection manager's requests for queue 0 of [`ADMIN_ENTRIES`] and queue 1 of
    /// [`IO_ENTRIES`]: Connect, CC.EN, CSTS.RDY, Number of Queues, Identify Namespace, then
    /// the I/O queue's Connect. Its data memory is `places` places of `place_len` bytes,
    /// registered as `o` says.
    #[allow(clippy::too_many_arguments)]
    pub fn connect(
        verbs: &mut V,
        admin: V::Qp,
        io: V::Qp,
        url: &NvmeUrl,
        host: &NvmeOptions,
        o: &RdmaOptions,
        places: usize,
        place_len: usize,
    ) -> Result<NvmeRdmaChannel<V>, String> {
        for (qp, n) in [(admin, ADMIN_ENTRIES), (io, IO_ENTRIES)] {
            for _ in 0..n {
                let b = verbs
                    .message_buffer()
                    .ok_or("no message buffer for a receive")?;
                verbs.post_recv(qp, 0, b);
            }
        }
        let memory = DataMemory::new(
            verbs,
            o.registration,
            places,
            place_len.max(2 * SETUP_LEN + 64),
        )
        .map_err(|e| format!("the host's memory: {e}"))?;
        let mut c = NvmeRdmaChannel {
            admin: Queue {
                qp: admin,
                next_cid: 1,
            },
            io: Queue {
                qp: io,
                next_cid: 1,
            },
            memory,
            places,
            nsid: url.nsid,
            namespace: NamespaceInfo {
                blocks: 0,
                block_size: 0,
                nguid: [0; 16],
                ana_group: 0,
            },
            cntlid: 0,
            in_flight: HashMap::new(),
            next_key: 0,
            answers: VecDeque::new(),
            keep_alive: (host.kato / 2, Instant::now() + host.kato / 2),
            failed: None,
        };
        let (sqe, data) = connect_command(url, host, 0, CNTLID_DYNAMIC, ADMIN_ENTRIES - 1);
        let (cqe, _) = c.setup(verbs, false, sqe, Some(&data[..]), 0)?;
        c.cntlid = cqe.dw0 as u16;
        let enable = crate::nvme::property(property::CC, Some(CC_EN | 6 << 16 | 4 << 20));
        c.setup(verbs, false, enable, None, 0)?;
        let deadline = Instant::now() + WAIT;
        loop {
            let csts = crate::nvme::property(property::CSTS, None);
            let (cqe, _) = c.setup(verbs, false, csts, None, 0)?;
            if cqe.dw0 & CSTS_RDY != 0 {
                break;
            }
            if Instant::now() > deadline {
                return Err("CSTS.RDY never set".into());
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        let mut queues = Sqe::new(AdminOpcode::SetFeatures.code(), 0);
        queues.set_cdw(10, 0x07);
        queues.set_cdw(11, 0);
        c.setup(verbs, false, queues, None, 0)?;
        let mut identify = Sqe::new(AdminOpcode::Identify.code(), 0);
        identify.set_nsid(url.nsid);
        identify.set_cdw(10, u32::from(cns::NAMESPACE));
        let (_, ns) = c.setup(verbs, false, identify, None, SETUP_LEN)?;
        c.namespace = namespace_info(&ns, url.nsid).map_err(|e| e.to_string())?;
        let (sqe, data) = connect_command(url, host, 1, c.cntlid, IO_ENTRIES - 1);
        c.setup(verbs, true, sqe, Some(&data[..]), 0)?;
        Ok(c)
    }

    /// Runs one set-up command on the admin queue (or the I/O queue's Connect) and waits for
    /// it: its completion, and `read` bytes of data it wrote into the host's memory.
    fn setup(
        &mut self,
        verbs: &mut V,
        on_io: bool,
        mut sqe: Sqe,
        data_out: Option<&[u8]>,
        read: usize,
    ) -> Result<(Cqe, Vec<u8>), String> {
        let len = data_out.map_or(read, <[u8]>::len);
        let key = u64::MAX;
        let sgl = if len > 0 {
            let exposed = self
                .memory
                .expose(verbs, key, len, 1, false, data_out)
                .map_err(|e| format!("a set-up command's buffer: {e}"))?;
            let Exposed::Direct(d) = exposed else {
                return Err("a buffer of one region is direct".into());
            };
            Sgl::keyed(d.va, len as u32, d.key)
        } else {
            Sgl::keyed(0, 0, 0)
        };
        sqe.set_sgl(sgl);
        let q = if on_io { &mut self.io } else { &mut self.admin };
        let cid = q.next_cid;
        q.next_cid = q.next_cid.wrapping_add(1).max(1);
        sqe.set_cid(cid);
        let qp = q.qp;
        let result = post_capsule(verbs, qp, &sqe).and_then(|()| wait_response(verbs, qp, cid));
        let mut out = Vec::new();
        if len > 0 {
            if result.is_ok() && read > 0 {
                self.memory.read_data(verbs, key, &mut out);
                out.truncate(read);
            }
            self.memory.release(verbs, key);
        }
        let cqe = result?;
        if !cqe.status.is_success() {
            return Err(format!(
                "{} answered with {:?}",
                command_name(&sqe),
                cqe.status
            ));
        }
        Ok((cqe, out))
    }

    /// Takes the I/O queue's completions, and the admin queue's (Keep Alive's).
    fn receive(&mut self, verbs: &mut V) {
        while let Some(wc) = verbs.poll(self.io.qp) {
            if wc.op != WorkOp::Recv {
                if wc.result.is_err() {
                    self.failed.get_or_insert("a send failed".into());
                }
                verbs.recycle_message(wc.buffer);
                continue;
            }
            if wc.result.is_err() {
                self.failed.get_or_insert("the I/O queue ended".into());
                verbs.recycle_message(wc.buffer);
                continue;
            }
            let cqe = Cqe::parse(&wc.buffer[..wc.len]);
            verbs.post_recv(self.io.qp, 0, wc.buffer);
            let Some(cqe) = cqe else {
                self.failed
                    .get_or_insert(format!("a response capsule of {} bytes", wc.len));
                continue;
            };
            let Some(f) = self.in_flight.remove(&cqe.cid) else {
                self.failed
                    .get_or_insert(format!("a response to CID {} not in flight", cqe.cid));
                continue;
            };
            let mut data = Vec::new();
            if let Some(key) = f.key {
                if f.read_len > 0 && cqe.status.is_success() {
                    self.memory.read_data(verbs, key, &mut data);
                    data.truncate(f.read_len as usize);
                }
                self.memory.release(verbs, key);
            }
            self.answers.push_back(Answered {
                tag: f.tag,
                // GOOD, or CHECK CONDITION: the runner counts it failed.
                status: if cqe.status.is_success() { 0 } else { 2 },
                data,
            });
        }
        while let Some(wc) = verbs.poll(self.admin.qp) {
            if wc.op != WorkOp::Recv || wc.result.is_err() {
                if wc.result.is_err() {
                    self.failed.get_or_insert("the admin queue ended".into());
                }
                verbs.recycle_message(wc.buffer);
                continue;
            }
            let cqe = Cqe::parse(&wc.buffer[..wc.len]);
            verbs.post_recv(self.admin.qp, 0, wc.buffer);
            if let Some(c) = cqe.filter(|c| !c.status.is_success()) {
                self.failed
                    .get_or_insert(format!("Keep Alive answered with {:?}", c.status));
            }
        }
    }
}

/// Posts `sqe` as a command capsule.
fn post_capsule<V>(verbs: &mut V, qp: V::Qp, sqe: &Sqe) -> Result<(), String>
where
    V: Verbs + MessageBuffers<Message = <V as Verbs>::Buffer>,
{
    let mut b = verbs
        .message_buffer()
        .ok_or("no message buffer for a send")?;
    b[..Sqe::LEN].copy_from_slice(sqe.as_bytes());
    verbs.post_send(qp, 0, b, Sqe::LEN);
    Ok(())
}

/// Waits for the response to `cid` on `qp` (during the set-up, when nothing else is in flight).
fn wait_response<V>(verbs: &mut V, qp: V::Qp, cid: u16) -> Result<Cqe, String>
where
    V: Verbs + MessageBuffers<Message = <V as Verbs>::Buffer>,
{
    let deadline = Instant::now() + WAIT;
    loop {
        let Some(wc) = verbs.poll(qp) else {
            if verbs.is_error(qp) {
                return Err("the queue ended during the set-up".into());
            }
            if Instant::now() > deadline {
                return Err(format!("no response for {WAIT:?}"));
            }
            std::thread::yield_now();
            continue;
        };
        if wc.op != WorkOp::Recv {
            let failed = wc.result.is_err();
            verbs.recycle_message(wc.buffer);
            if failed {
                return Err("a send failed during the set-up".into());
            }
            continue;
        }
        if wc.result.is_err() {
            return Err("the queue ended during the set-up".into());
        }
        let cqe = Cqe::parse(&wc.buffer[..wc.len]);
        verbs.post_recv(qp, 0, wc.buffer);
        match cqe {
            Some(c) if c.cid == cid => return Ok(c),
            Some(_) => continue,
            None => return Err(format!("a response capsule of {} bytes", wc.len)),
        }
    }
}

/// A set-up command's name, for errors.
fn command_name(sqe: &Sqe) -> String {
    match AdminOpcode::from_code(sqe.opcode()) {
        Some(AdminOpcode::Fabrics) => format!("Fabrics command {:#04x}", sqe.fctype()),
        Some(op) => format!("{op:?}"),
        None => format!("opcode {:#04x}", sqe.opcode()),
    }
}

/// NVMe/RDMA's controller in the runner: CIDs of its own, as many commands in flight as the
/// I/O queue takes less one, Keep Alive on the admin queue.
impl<V> BlockChannel<V> for NvmeRdmaChannel<V>
where
    V: Verbs + PeerMemory + MessageBuffers<Message = <V as Verbs>::Buffer>,
{
    const TRANSPORT: &'static str = "NVMe/RDMA";

    fn prepare(&mut self, o: &RdmaOptions) -> Result<(), String> {
        if o.regions != 1 {
            return Err("a keyed SGL names one region: --regions 1".into());
        }
        if self.namespace.block_size != BLOCK_SIZE {
            return Err(format!(
                "namespace {} has {}-byte blocks; RDMA runs take {BLOCK_SIZE}",
                self.nsid, self.namespace.block_size
            ));
        }
        Ok(())
    }

    fn room(&self) -> bool {
        self.in_flight.len() < usize::from(IO_ENTRIES) - 1 && self.memory.in_flight() < self.places
    }

    fn send(&mut self, _now: Instant, verbs: &mut V, r: &Request<'_>) -> Result<u64, String> {
        let (opcode, write) = match r.cdb[0] {
            // TEST UNIT READY: NVMe has no unit attention to clear.
            0x00 => {
                self.answers.push_back(Answered {
                    tag: r.tag,
                    status: 0,
                    data: Vec::new(),
                });
                return Ok(r.tag);
            }
            0x88 => (NvmOpcode::Read, false),
            0x8a => (NvmOpcode::Write, true),
            other => {
                return Err(format!(
                    "operation code {other:#04x} has no NVMe command here"
                ))
            }
        };
        let lba = u64::from_be_bytes(r.cdb[2..10].try_into().expect("8 bytes"));
        let blocks = u32::from_be_bytes(r.cdb[10..14].try_into().expect("4 bytes"));
        if blocks == 0 || blocks > 1 << 16 {
            return Err(format!("{blocks} blocks in one NVMe command"));
        }
        let len = (blocks * BLOCK_SIZE) as usize;
        self.next_key += 1;
        let key = self.next_key;
        let exposed = self
            .memory
            .expose(verbs, key, len, 1, false, r.data_out.filter(|_| write))
            .map_err(|e| format!("the command's buffer: {e}"))?;
        let Exposed::Direct(d) = exposed else {
            self.memory.release(verbs, key);
            return Err("a buffer of one region is direct".into());
        };
        let mut cid = self.io.next_cid;
        while self.in_flight.contains_key(&cid) {
            cid = cid.wrapping_add(1).max(1);
        }
        self.io.next_cid = cid.wrapping_add(1).max(1);
        let mut sqe = Sqe::new(opcode.code(), cid);
        sqe.set_nsid(self.nsid);
        sqe.set_qword(10, lba);
        sqe.set_cdw(12, blocks - 1);
        sqe.set_sgl(Sgl::keyed(d.va, len as u32, d.key));
        if let Err(e) = post_capsule(verbs, self.io.qp, &sqe) {
            self.memory.release(verbs, key);
            return Err(e);
        }
        self.in_flight.insert(
            cid,
            InFlight {
                tag: r.tag,
                key: Some(key),
                read_len: if write { 0 } else { len as u32 },
            },
        );
        Ok(r.tag)
    }

    fn poll(&mut self, verbs: &mut V) -> Option<Answered> {
        if self.answers.is_empty() {
            self.receive(verbs);
        }
        self.answers.pop_front()
    }

    fn check(&mut self, now: Instant, verbs: &mut V) -> Result<(), String> {
        let (period, due) = self.keep_alive;
        if now >= due {
            self.keep_alive.1 = now + period;
            let cid = self.admin.next_cid;
            self.admin.next_cid = cid.wrapping_add(1).max(1);
            let mut ka = Sqe::new(AdminOpcode::KeepAlive.code(), cid);
            ka.set_sgl(Sgl::keyed(0, 0, 0));
            post_capsule(verbs, self.admin.qp, &ka)?;
        }
        self.receive(verbs);
        if let Some(why) = &self.failed {
            return Err(why.clone());
        }
        if verbs.is_error(self.io.qp) || verbs.is_error(self.admin.qp) {
            return Err("the controller's queues ended".into());
        }
        Ok(())
    }
}

/// The connection manager's request for queue `qid` of `entries` entries.
pub fn cm_request(qid: u16, entries: u16) -> [u8; nvme::rdma::cm::REQUEST_LEN] {
    nvme::rdma::CmRequest {
        recfmt: 0,
        qid,
        hrqsize: entries,
        hsqsize: entries - 1,
        cntlid: CNTLID_DYNAMIC,
    }
    .encode()
}

/// Why the target answered a queue's connect request as it did: `Ok` when it accepted with
/// at least `entries` receives, else its reject's status.
pub fn cm_answer(private: &[u8], entries: u16) -> Result<(), String> {
    match nvme::rdma::CmAccept::decode(private) {
        Some(a) if a.crqsize >= entries => Ok(()),
        Some(a) => Err(format!(
            "the target posts {} receives for a queue of {entries}",
            a.crqsize
        )),
        None => Err("no accept in the connection manager's reply".into()),
    }
}

/// Runs `w` against the NVMe/RDMA subsystem `url` on this machine's RDMA device (feature
/// `rdma`): one controller, disconnected after the run.
#[cfg(feature = "rdma")]
pub fn run_rdma(
    url: &NvmeUrl,
    host: &NvmeOptions,
    w: &crate::workload::Workload,
    o: &RdmaOptions,
) -> Result<crate::rdma::RdmaReport, String> {
    use rdma::ibverbs::{QueueDepth, RdmaVerbs};
    let addr: std::net::SocketAddr = url
        .portal
        .parse()
        .map_err(|_| format!("{} is not an address:port", url.portal))?;
    let places = w.qd.clamp(1, usize::from(IO_ENTRIES) - 1);
    let slots = u32::from(ADMIN_ENTRIES + IO_ENTRIES) + 2 * places as u32 + 64;
    let mut verbs: RdmaVerbs =
        RdmaVerbs::open(None, slots, rdma::verbs::MESSAGE_BUFFER_LEN).map_err(|e| e.to_string())?;
    let mut qps = Vec::new();
    for (qid, entries) in [(0, ADMIN_ENTRIES), (1, IO_ENTRIES)] {
        let depth = QueueDepth {
            send: 1024,
            recv: u32::from(entries) + 16,
        };
        let (qp, reply) = verbs
            .connect(addr, depth, &cm_request(qid, entries))
            .map_err(|e| format!("queue {qid} to {addr}: {e}"))?;
        cm_answer(&reply, entries).map_err(|e| format!("queue {qid}: {e}"))?;
        qps.push(qp);
    }
    let ch = NvmeRdmaChannel::connect(
        &mut verbs,
        qps[0],
        qps[1],
        url,
        host,
        o,
        places,
        crate::rdma::place_len(w, o),
    )?;
    let mut channels = [ch];
    let report = crate::rdma::run_channels(&mut verbs, &mut channels, 0, w, o);
    for qp in qps {
        verbs.disconnect(qp);
    }
    report
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_connection_managers_answer_is_read() {
        let accept = nvme::rdma::CmAccept {
            recfmt: 0,
            crqsize: 128,
        }
        .encode();
        assert_eq!(cm_answer(&accept, 128), Ok(()));
        assert!(cm_answer(&accept, 256)
            .unwrap_err()
            .contains("128 receives"));
        assert!(cm_answer(&[1], 32).is_err());
        let r = nvme::rdma::CmRequest::decode(&cm_request(1, 128)).unwrap();
        assert_eq!((r.qid, r.hrqsize, r.hsqsize), (1, 128, 127));
    }
}
