//! NVMe/RDMA through targetd over the software fabric: the daemon serves a subsystem of
//! `[[subsystems]]` on a [`Switch`] (its portal on a reactor, data in the reactor's arena, a
//! file namespace through its engine) and a small host on the test's thread sets up queues as
//! Linux's nvme-rdma does: the connection manager's request with the queue's terms, Connect
//! with its data by keyed SGL, commands whose data the target moves by RDMA READ and WRITE
//! of the memory the host registered, small writes in the capsule. Queues with terms the
//! portal does not take are rejected naming the field; a Connect to an NQN nobody serves is
//! refused; a capsule shorter than an SQE ends its queue and not another's.

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use common::Daemon;
use nvme::fabrics::{CNTLID_DYNAMIC, CONNECT_DATA_LEN};
use nvme::opcode::{AdminOpcode, NvmOpcode};
use nvme::rdma::{CmAccept, CmReject, CmRequest, RejectStatus};
use nvme::sqe::{Sgl, Sqe};
use nvme::{testing, Cqe, Status};
use rdma::fabric::{Access, MemoryId, MemoryRegion, NodeId, QpId};
use rdma::switch::{Endpoint, Reply, Switch};
use rdma::verbs::{Verbs, WorkOp, MESSAGE_BUFFER_LEN};

const NQN: &str = "nqn.2026-11.io.example:rdma";
const HOST: &str = "nqn.2014-08.org.nvmexpress:uuid:8e1b3c9a-0000-4000-8000-726d61686f73";
const TARGET_NODE: NodeId = NodeId(0);
const HOST_NODE: NodeId = NodeId(1);
const SERVICE: &str = "nvme-rdma0";
const WAIT: Duration = Duration::from_secs(10);
/// The host's memory: Connect's data, then each command's buffer.
const MEMORY: usize = 4 << 20;

/// targetd serving the subsystem (a 16 MiB file namespace) over NVMe/RDMA on a new switch.
fn daemon() -> (Arc<Switch>, Daemon) {
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
fn ask(switch: &Arc<Switch>, request: CmRequest) -> Reply {
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
struct Queue {
    switch: Arc<Switch>,
    verbs: Endpoint<Vec<u8>>,
    qp: QpId,
    memory: MemoryId,
    region: MemoryRegion,
    next_cid: u16,
}

impl Queue {
    /// Queue `qid` of `entries` entries, connected as Linux's host connects it: the CM
    /// request, its receives posted, its memory registered.
    fn open(switch: &Arc<Switch>, qid: u16, entries: u16) -> Queue {
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
    fn keyed(&self, offset: usize, len: usize) -> Sgl {
        Sgl::keyed(
            self.region.addr + offset as u64,
            len as u32,
            self.region.rkey,
        )
    }

    fn put(&self, offset: usize, data: &[u8]) {
        self.switch
            .with(|f| f.memory_mut(self.memory)[offset..offset + data.len()].copy_from_slice(data));
    }

    fn get(&self, offset: usize, len: usize) -> Vec<u8> {
        self.switch
            .with(|f| f.memory(self.memory)[offset..offset + len].to_vec())
    }

    /// Sends a capsule: `sqe` and its in-capsule data.
    fn send(&mut self, sqe: &Sqe, data: &[u8]) {
        let mut capsule = sqe.as_bytes().to_vec();
        capsule.extend_from_slice(data);
        let n = capsule.len();
        self.verbs.post_send(self.qp, 1, capsule, n);
    }

    /// The next response capsule; `None` once the queue pair is gone.
    fn response(&mut self) -> Option<Cqe> {
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
    fn run(&mut self, mut sqe: Sqe, data: &[u8]) -> Cqe {
        let cid = self.next_cid;
        self.next_cid = self.next_cid.wrapping_add(1).max(1);
        sqe.set_cid(cid);
        self.send(&sqe, data);
        let cqe = self.response().expect("a response");
        assert_eq!(cqe.cid, cid);
        cqe
    }

    /// Connect, its data by keyed SGL from the start of the host's memory.
    fn connect(&mut self, qid: u16, cntlid: u16, nqn: &str) -> Cqe {
        let kato = if qid == 0 { 5000 } else { 0 };
        let mut sqe = testing::connect_sqe(0, qid, 31, kato, 0);
        self.put(0, &testing::connect_data([9; 16], cntlid, nqn, HOST));
        sqe.set_sgl(self.keyed(0, CONNECT_DATA_LEN));
        self.run(sqe, &[])
    }
}

fn io(op: NvmOpcode, slba: u64, blocks: u32, sgl: Sgl) -> Sqe {
    let mut s = Sqe::new(op.code(), 0);
    s.set_nsid(1);
    s.set_qword(10, slba);
    s.set_cdw(12, blocks - 1);
    s.set_sgl(sgl);
    s
}

/// The admin queue connected and the controller enabled, with one I/O queue granted.
fn controller(switch: &Arc<Switch>) -> (Queue, u16) {
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

#[test]
fn a_host_connects_identifies_writes_and_reads_over_rdma() {
    let (switch, d) = daemon();
    let (mut admin, cntlid) = controller(&switch);
    // Identify Controller, written into the host's memory.
    let mut identify = Sqe::new(AdminOpcode::Identify.code(), 0);
    identify.set_cdw(10, 1);
    identify.set_sgl(admin.keyed(8192, 4096));
    assert!(admin.run(identify, &[]).status.is_success());
    let id = admin.get(8192, 4096);
    assert_eq!(&id[768..768 + NQN.len()], NQN.as_bytes());
    let sgls = u32::from_le_bytes(id[536..540].try_into().unwrap());
    assert_ne!(sgls & 1 << 2, 0, "keyed SGL data blocks supported");

    let mut q = Queue::open(&switch, 1, 128);
    assert!(q.connect(1, cntlid, NQN).status.is_success());
    // 256 KiB read by the target from the host's memory (RDMA READ), 4 KiB in the capsule.
    let big = common::pattern(256 << 10, 0x5a).to_vec();
    q.put(65536, &big);
    let w = io(NvmOpcode::Write, 2048, 512, q.keyed(65536, big.len()));
    assert!(q.run(w, &[]).status.is_success());
    let small = common::pattern(4096, 0x33).to_vec();
    let w = io(NvmOpcode::Write, 8, 8, Sgl::in_capsule(0, 4096));
    assert!(q.run(w, &small).status.is_success());
    // On the medium where they should be.
    let file = std::fs::read(d.dir.path().join("ns1.img")).unwrap();
    assert!(file[2048 * 512..2048 * 512 + big.len()] == big[..]);
    assert!(file[8 * 512..8 * 512 + 4096] == small[..]);
    // Back by RDMA WRITE into the host's memory.
    let at = 1 << 20;
    let r = io(NvmOpcode::Read, 2048, 512, q.keyed(at, big.len()));
    assert!(q.run(r, &[]).status.is_success());
    assert!(q.get(at, big.len()) == big);
    let r = io(NvmOpcode::Read, 8, 8, q.keyed(at, 4096));
    assert!(q.run(r, &[]).status.is_success());
    assert!(q.get(at, 4096) == small);
    // A keyed SGL shorter than the command's data is refused before anything moves.
    let r = io(NvmOpcode::Read, 0, 8, q.keyed(at, 512));
    assert_eq!(q.run(r, &[]).status, Status::DATA_SGL_LENGTH_INVALID);
    // Keep Alive on the admin queue, and the subsystem lists the controller.
    let ka = Sqe::new(AdminOpcode::KeepAlive.code(), 0);
    assert!(admin.run(ka, &[]).status.is_success());
    d.stop();
}

#[test]
fn queues_with_terms_the_portal_does_not_take_are_rejected_naming_the_field() {
    let (switch, d) = daemon();
    let reject = |request: CmRequest| match ask(&switch, request) {
        Reply::Rejected(private) => CmReject::decode(&private).expect("a reject").status,
        other => panic!("accepted: {other:?}"),
    };
    let base = CmRequest {
        recfmt: 0,
        qid: 1,
        hrqsize: 128,
        hsqsize: 127,
        cntlid: 1,
    };
    assert_eq!(
        reject(CmRequest {
            hsqsize: 1023,
            hrqsize: 1024,
            ..base
        }),
        RejectStatus::InvalidHsqsize
    );
    assert_eq!(
        reject(CmRequest {
            hrqsize: 16,
            ..base
        }),
        RejectStatus::InvalidHrqsize
    );
    assert_eq!(
        reject(CmRequest { recfmt: 7, ..base }),
        RejectStatus::InvalidRecfmt
    );
    assert_eq!(
        reject(CmRequest { qid: 9, ..base }),
        RejectStatus::InvalidQid
    );
    // A Connect naming a subsystem nobody serves ends with Invalid Parameters.
    let mut q = Queue::open(&switch, 0, 32);
    let c = q.connect(0, CNTLID_DYNAMIC, "nqn.2026-11.io.example:nobody");
    assert_eq!(c.status, Status::CONNECT_INVALID_PARAMETERS);
    d.stop();
}

#[test]
fn a_capsule_shorter_than_an_sqe_ends_its_queue_and_not_another() {
    let (switch, d) = daemon();
    let (mut admin, cntlid) = controller(&switch);
    let mut bad = Queue::open(&switch, 1, 32);
    assert!(bad.connect(1, cntlid, NQN).status.is_success());
    let n = 20;
    bad.verbs.post_send(bad.qp, 1, vec![0xff; n], n);
    assert!(bad.response().is_none(), "the queue pair is disconnected");
    // The admin queue goes on.
    let ka = Sqe::new(AdminOpcode::KeepAlive.code(), 0);
    assert!(admin.run(ka, &[]).status.is_success());
    d.stop();
}

/// initiator-bench's NVMe/RDMA host (`run --transport nvme-rdma`'s channel) against targetd on
/// the software fabric: verified random reads and writes at queue depth 16, every block
/// written read back, for each way of registering its memory.
#[test]
fn initiator_bench_runs_verified_workloads_over_nvme_rdma() {
    use initiator_bench::nvme::{NvmeOptions, NvmeUrl};
    use initiator_bench::nvme_rdma::{
        cm_answer, cm_request, NvmeRdmaChannel, ADMIN_ENTRIES, IO_ENTRIES,
    };
    use initiator_bench::rdma::{place_len, run_channels, RdmaOptions};
    use initiator_bench::srp::LinkModel;
    use initiator_bench::workload::{Rw, Workload};
    use srp::initiator::Registration;

    let (switch, d) = daemon();
    let url = NvmeUrl::parse(&format!("nvme://192.0.2.1/{NQN}/1")).unwrap();
    let host = NvmeOptions {
        hostnqn: HOST.into(),
        ..NvmeOptions::default()
    };
    for registration in Registration::ALL {
        let w = Workload {
            rw: Rw::Randrw,
            bs: 16 * 1024,
            qd: 16,
            ios: Some(800),
            size: Some(8 << 20),
            verify: true,
            ..Workload::default()
        };
        let o = RdmaOptions {
            registration,
            regions: 1,
            link: LinkModel::Free,
            immediate_data: false,
        };
        let mut qps = Vec::new();
        for (qid, entries) in [(0, ADMIN_ENTRIES), (1, IO_ENTRIES)] {
            let id = switch
                .connect(HOST_NODE, SERVICE, &cm_request(qid, entries))
                .expect("the daemon listens");
            let deadline = Instant::now() + WAIT;
            let reply = loop {
                if let Some(r) = switch.reply(id) {
                    break r;
                }
                assert!(Instant::now() < deadline, "no answer");
                std::thread::sleep(Duration::from_millis(1));
            };
            let Reply::Accepted { qp, private } = reply else {
                panic!("queue {qid} refused");
            };
            cm_answer(&private, entries).expect("accepted with enough receives");
            qps.push(qp);
        }
        let mut verbs: Endpoint<Vec<u8>> = switch.endpoint(HOST_NODE);
        let ch = NvmeRdmaChannel::connect(
            &mut verbs,
            qps[0],
            qps[1],
            &url,
            &host,
            &o,
            16,
            place_len(&w, &o),
        )
        .expect("the controller");
        assert_eq!(ch.namespace.blocks, 16 << 11);
        let mut channels = [ch];
        let r = run_channels(&mut verbs, &mut channels, 0, &w, &o).expect("the run");
        assert_eq!((r.ios, r.errors), (800, 0), "{}", registration.name());
        assert!(r.verified_blocks > 0, "reads were checked");
        assert_eq!(r.verify_errors, 0, "{}", registration.name());
        for qp in qps {
            verbs.disconnect(qp);
        }
    }
    d.stop();
}
