//! A minimal NVMe/RDMA host on the software fabric for tests: sets up queues as Linux's
//! nvme-rdma does (the connection manager's request with the queue's terms, Connect with its
//! data by keyed SGL) against a daemon's NVMe/RDMA portal on a [`Switch`], and runs commands
//! one at a time with their data in memory it registered, or in the capsule.

use std::sync::Arc;
use std::time::{Duration, Instant};

use nvme::fabrics::{CNTLID_DYNAMIC, CONNECT_DATA_LEN};
use nvme::opcode::{AdminOpcode, NvmOpcode};
use nvme::rdma::{CmAccept, CmRequest};
use nvme::sqe::{Sgl, Sqe};
use nvme::{testing, Cqe};
use rdma::fabric::{Access, MemoryId, MemoryRegion, NodeId, QpId};
use rdma::switch::{Endpoint, Reply, Switch};
use rdma::verbs::{Verbs, WorkOp, MESSAGE_BUFFER_LEN};

use super::Daemon;

pub const NQN: &str = "nqn.2026-11.io.example:rdma";
pub const HOST: &str = "nqn.2014-08.org.nvmexpress:uuid:8e1b3c9a-0000-4000-8000-726d61686f73";
pub const TARGET_NODE: NodeId = NodeId(0);
pub const HOST_NODE: NodeId = NodeId(1);
pub const SERVICE: &str = "nvme-rdma0";
pub const WAIT: Duration = Duration::from_secs(10);
/// The host's memory: Connect's data, then each command's buffer.
pub const MEMORY: usize = 4 << 20;

/// targetd serving the subsystem (a 16 MiB file namespace) over NVMe/RDMA on a new switch.
pub fn daemon() -> (Arc<Switch>, Daemon) {
    let switch = Switch::new();
    let text = format!(
        "[server]\nportals = [\"127.0.0.1:0\"]\nadmin_socket = \"@SOCKET@\"\nreactors = 2\n\n\
         [[subsystems]]\nnqn = \"{NQN}\"\nhosts = [\"{HOST}\"]\n\n\
         [[subsystems.namespaces]]\nnsid = 1\nbackend = \"file\"\npath = \"@DIR@/ns1.img\"\n\
         size = \"16MiB\"\n"
    );
    let d = Daemon::start_with(&text, |server| {
        server
            .serve_nvme_rdma_fabric(&switch, TARGET_NODE, SERVICE)
            .expect("the service is free");
    });
    (switch, d)
}

/// Asks the daemon for a queue with `request`'s terms: its answer.
pub fn ask(switch: &Arc<Switch>, request: CmRequest) -> Reply {
    let id = switch
        .connect(HOST_NODE, SERVICE, &request.encode())
        .expect("the daemon listens");
    let deadline = Instant::now() + WAIT;
    loop {
        if let Some(r) = switch.reply(id) {
            return r;
        }
        assert!(
            Instant::now() < deadline,
            "no answer to the connect request"
        );
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// One queue of the host: its queue pair, its registered memory, the next free byte of it.
pub struct Queue {
    pub switch: Arc<Switch>,
    pub verbs: Endpoint<Vec<u8>>,
    pub qp: QpId,
    pub memory: MemoryId,
    pub region: MemoryRegion,
    pub next_cid: u16,
}

impl Queue {
    /// Queue `qid` of `entries` entries, connected as Linux's host connects it: the CM
    /// request, its receives posted, its memory registered.
    pub fn open(switch: &Arc<Switch>, qid: u16, entries: u16) -> Queue {
        let request = CmRequest {
            recfmt: 0,
            qid,
            hrqsize: entries,
            hsqsize: entries - 1,
            cntlid: CNTLID_DYNAMIC,
        };
        let Reply::Accepted { qp, private } = ask(switch, request) else {
            panic!("queue {qid} refused");
        };
        let accept = CmAccept::decode(&private).expect("the accept's private data");
        assert_eq!(accept.crqsize, entries);
        let mut verbs: Endpoint<Vec<u8>> = switch.endpoint(HOST_NODE);
        for _ in 0..entries {
            verbs.post_recv(qp, 0, vec![0; MESSAGE_BUFFER_LEN]);
        }
        let (memory, region) = switch.with(|f| {
            let m = f.alloc(HOST_NODE, MEMORY);
            (m, f.register(m, 0, MEMORY, Access::REMOTE))
        });
        Queue {
            switch: switch.clone(),
            verbs,
            qp,
            memory,
            region,
            next_cid: 1,
        }
    }

    /// `len` bytes of the host's memory at `offset` as a keyed SGL.
    pub fn keyed(&self, offset: usize, len: usize) -> Sgl {
        Sgl::keyed(
            self.region.addr + offset as u64,
            len as u32,
            self.region.rkey,
        )
    }

    pub fn put(&self, offset: usize, data: &[u8]) {
        self.switch
            .with(|f| f.memory_mut(self.memory)[offset..offset + data.len()].copy_from_slice(data));
    }

    pub fn get(&self, offset: usize, len: usize) -> Vec<u8> {
        self.switch
            .with(|f| f.memory(self.memory)[offset..offset + len].to_vec())
    }

    /// Sends a capsule: `sqe` and its in-capsule data.
    pub fn send(&mut self, sqe: &Sqe, data: &[u8]) {
        let mut capsule = sqe.as_bytes().to_vec();
        capsule.extend_from_slice(data);
        let n = capsule.len();
        self.verbs.post_send(self.qp, 1, capsule, n);
    }

    /// The next response capsule; `None` once the queue pair is gone.
    pub fn response(&mut self) -> Option<Cqe> {
        let deadline = Instant::now() + WAIT;
        loop {
            while let Some(wc) = self.verbs.poll(self.qp) {
                if wc.op != WorkOp::Recv {
                    assert!(wc.result.is_ok(), "a send failed: {:?}", wc.result);
                    continue;
                }
                if wc.result.is_err() {
                    return None;
                }
                assert_eq!(wc.len, Cqe::LEN, "a response capsule is a CQE");
                let cqe = Cqe::parse(&wc.buffer[..wc.len]).expect("a CQE");
                self.verbs.post_recv(self.qp, 0, wc.buffer);
                return Some(cqe);
            }
            if self.verbs.is_error(self.qp) {
                return None;
            }
            assert!(Instant::now() < deadline, "nothing from the target");
            std::thread::sleep(Duration::from_micros(200));
        }
    }

    /// Runs `sqe` (its CID set here) with in-capsule `data`: its completion.
    pub fn run(&mut self, mut sqe: Sqe, data: &[u8]) -> Cqe {
        let cid = self.next_cid;
        self.next_cid = self.next_cid.wrapping_add(1).max(1);
        sqe.set_cid(cid);
        self.send(&sqe, data);
        let cqe = self.response().expect("a response");
        assert_eq!(cqe.cid, cid);
        cqe
    }

    /// Connect, its data by keyed SGL from the start of the host's memory.
    pub fn connect(&mut self, qid: u16, cntlid: u16, nqn: &str) -> Cqe {
        let kato = if qid == 0 { 5000 } else { 0 };
        self.connect_with(qid, cntlid, nqn, kato)
    }

    /// Connect with the keep alive timeout `kato` (ms).
    pub fn connect_with(&mut self, qid: u16, cntlid: u16, nqn: &str, kato: u32) -> Cqe {
        let mut sqe = testing::connect_sqe(0, qid, 31, kato, 0);
        self.put(0, &testing::connect_data([9; 16], cntlid, nqn, HOST));
        sqe.set_sgl(self.keyed(0, CONNECT_DATA_LEN));
        self.run(sqe, &[])
    }
}

pub fn io(op: NvmOpcode, slba: u64, blocks: u32, sgl: Sgl) -> Sqe {
    let mut s = Sqe::new(op.code(), 0);
    s.set_nsid(1);
    s.set_qword(10, slba);
    s.set_cdw(12, blocks - 1);
    s.set_sgl(sgl);
    s
}

/// The admin queue connected and the controller enabled, with one I/O queue granted.
pub fn controller(switch: &Arc<Switch>) -> (Queue, u16) {
    let mut admin = Queue::open(switch, 0, 32);
    let c = admin.connect(0, CNTLID_DYNAMIC, NQN);
    assert!(c.status.is_success(), "{c:?}");
    let cntlid = c.dw0 as u16;
    assert!(admin.run(testing::enable_sqe(0), &[]).status.is_success());
    let mut queues = Sqe::new(AdminOpcode::SetFeatures.code(), 0);
    queues.set_cdw(10, 0x07);
    queues.set_cdw(11, 1 | 1 << 16);
    assert!(admin.run(queues, &[]).status.is_success());
    (admin, cntlid)
}
