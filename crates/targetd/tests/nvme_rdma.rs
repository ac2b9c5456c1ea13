//! NVMe/RDMA through targetd over the software fabric: the daemon serves a subsystem of
//! `[[subsystems]]` on a [`Switch`] (its portal on a reactor, data in the reactor's arena, a
//! file namespace through its engine) and a small host on the test's thread sets up queues as
//! Linux's nvme-rdma does: the connection manager's request with the queue's terms, Connect
//! with its data by keyed SGL, commands whose data the target moves by RDMA READ and WRITE
//! of the memory the host registered, small writes in the capsule. Queues with terms the
//! portal does not take are rejected naming the field; a Connect to an NQN nobody serves is
//! refused; a capsule shorter than an SQE ends its queue and not another's.

mod common;

use std::time::{Duration, Instant};

use common::nvme_rdma::{ask, controller, daemon, io, Queue, HOST, HOST_NODE, NQN, SERVICE, WAIT};
use nvme::fabrics::CNTLID_DYNAMIC;
use nvme::opcode::{AdminOpcode, NvmOpcode};
use nvme::rdma::{CmReject, CmRequest, RejectStatus};
use nvme::sqe::{Sgl, Sqe};
use nvme::Status;
use rdma::switch::{Endpoint, Reply};
use rdma::verbs::Verbs;

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

#[test]
fn a_host_that_stops_sending_keep_alive_loses_its_controller_and_queues() {
    let (switch, d) = daemon();
    let mut admin = Queue::open(&switch, 0, 32);
    let c = admin.connect_with(0, CNTLID_DYNAMIC, NQN, 1000);
    assert!(c.status.is_success(), "{c:?}");
    let cntlid = c.dw0 as u16;
    assert!(admin
        .run(nvme::testing::enable_sqe(0), &[])
        .status
        .is_success());
    let mut queues = Sqe::new(AdminOpcode::SetFeatures.code(), 0);
    queues.set_cdw(10, 0x07);
    queues.set_cdw(11, 1 | 1 << 16);
    assert!(admin.run(queues, &[]).status.is_success());
    let mut q = Queue::open(&switch, 1, 32);
    assert!(q.connect(1, cntlid, NQN).status.is_success());
    // Keep Alive within the timeout keeps it.
    for _ in 0..3 {
        std::thread::sleep(Duration::from_millis(400));
        let ka = Sqe::new(AdminOpcode::KeepAlive.code(), 0);
        assert!(admin.run(ka, &[]).status.is_success());
    }
    // Then silence: the controller fails and its admin queue pair is disconnected.
    let started = Instant::now();
    assert!(admin.response().is_none(), "the admin queue ends");
    let waited = started.elapsed();
    assert!(waited >= Duration::from_millis(500), "{waited:?}");
    println!("the silent host's admin queue ended {waited:?} after its last Keep Alive");
    // Its I/O queue ends too, at its next command at the latest.
    let r = io(NvmOpcode::Read, 0, 8, q.keyed(4096, 4096));
    q.send(&r, &[]);
    match q.response() {
        None => {}
        Some(c) => assert!(!c.status.is_success(), "{c:?}"),
    }
    d.stop();
}
