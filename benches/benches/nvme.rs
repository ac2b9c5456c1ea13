//! NVMe/TCP microbenchmarks: a 4 KiB Read and a 4 KiB Write (in-capsule data) through the
//! controller's end of a connection and the subsystem machine, from the command capsule's
//! bytes to the response's: what the target does per command but the storage I/O (the
//! namespace's data is a buffer here), with and without digests.

use std::hint::black_box;
use std::time::Instant;

use bytes::Bytes;
use criterion::{criterion_group, criterion_main, Criterion};
use nvme::controller::{Answer, Namespace, Queue, Subsystem, SubsystemConfig};
use nvme::fabrics::CNTLID_DYNAMIC;
use nvme::nvm::IoCommand;
use nvme::opcode::NvmOpcode;
use nvme::sqe::{Sgl, Sqe};
use nvme::tcp::pdu::{data_digest, encode, Digests, Framing, Header, IcReq};
use nvme::tcp::{ControllerQueue, QueueEvent, QueueSettings};
use nvme::transport::CommandCapsule;
use nvme::{testing, Cqe, Status};

/// A subsystem with an enabled controller and an I/O queue's connection, initialized with
/// `digests`.
fn connected(digests: Digests) -> (Subsystem, Queue, ControllerQueue) {
    let now = Instant::now();
    let mut s = Subsystem::new(SubsystemConfig {
        max_io_queues: 1,
        ..testing::subsystem_config("nqn.2026-11.io.example:bench", &[])
    });
    s.add_namespace(Namespace {
        thin: false,
        ..testing::namespace(1, 512, 1 << 20)
    });
    let data = |cntlid| {
        testing::connect_data(
            [3; 16],
            cntlid,
            "nqn.2026-11.io.example:bench",
            "nqn.2014-08.org.nvmexpress:uuid:bench",
        )
    };
    let connect = |qid| testing::connect_sqe(1, qid, 127, 0, 0);
    let (admin, _) = s
        .connect(now, &connect(0), &data(CNTLID_DYNAMIC)[..])
        .unwrap();
    s.command(now, &admin, &testing::enable_sqe(2), &[]);
    let (io, _) = s
        .connect(now, &connect(1), &data(admin.cntlid)[..])
        .unwrap();
    let mut q = ControllerQueue::new(QueueSettings::default());
    let icreq = encode(
        &Header::IcReq(IcReq {
            pfv: 0,
            hpda: 0,
            digests,
            maxr2t: 0,
        }),
        0,
        &Framing::default(),
    )
    .unwrap();
    q.receive(&icreq.to_vec());
    while q.poll_event().is_some() {}
    while q.poll_transmit().is_some() {}
    (s, io, q)
}

/// A command capsule's bytes: `sqe` and its in-capsule `data`.
fn capsule(sqe: &Sqe, data: &[u8], digests: Digests) -> Vec<u8> {
    let framing = Framing { digests, pda: 0 };
    let e = encode(&Header::CapsuleCmd(*sqe), data.len() as u32, &framing).unwrap();
    let mut v = e.to_vec();
    v.extend_from_slice(data);
    if e.needs_data_digest() {
        v.extend_from_slice(&data_digest([data]));
    }
    v
}

fn commands(c: &mut Criterion) {
    let block = Bytes::from(vec![0x5a; 4096]);
    for (name, digests) in [
        ("", Digests::default()),
        (
            ", digests",
            Digests {
                header: true,
                data: true,
            },
        ),
    ] {
        let (mut s, io, mut q) = connected(digests);
        let now = Instant::now();
        let mut read = Sqe::new(NvmOpcode::Read.code(), 7);
        read.set_nsid(1);
        read.set_qword(10, 64);
        read.set_cdw(12, 7);
        read.set_sgl(Sgl::transport(4096));
        let read = capsule(&read, &[], digests);
        c.bench_function(
            &format!("NVMe/TCP 4 KiB Read through the controller{name}"),
            |b| {
                b.iter(|| {
                    q.receive(black_box(&read));
                    let Some(QueueEvent::Command(CommandCapsule { sqe, data, .. })) =
                        q.poll_event()
                    else {
                        unreachable!()
                    };
                    let Answer::Io {
                        command: IoCommand::Op { .. },
                        ..
                    } = s.command(now, &io, &sqe, &data)
                    else {
                        unreachable!()
                    };
                    q.send_data(sqe.cid(), 0, block.clone(), true, true)
                        .unwrap();
                    black_box(q.poll_transmit().unwrap());
                })
            },
        );
        let mut write = Sqe::new(NvmOpcode::Write.code(), 8);
        write.set_nsid(1);
        write.set_qword(10, 64);
        write.set_cdw(12, 7);
        write.set_sgl(Sgl::in_capsule(0, 4096));
        let write = capsule(&write, &block, digests);
        c.bench_function(
            &format!("NVMe/TCP 4 KiB Write (in-capsule) through the controller{name}"),
            |b| {
                b.iter(|| {
                    q.receive(black_box(&write));
                    let Some(QueueEvent::Command(CommandCapsule { sqe, data, .. })) =
                        q.poll_event()
                    else {
                        unreachable!()
                    };
                    let Answer::Io {
                        command: IoCommand::Op { .. },
                        ..
                    } = s.command(now, &io, &sqe, &data)
                    else {
                        unreachable!()
                    };
                    black_box(&data);
                    q.complete(Cqe::new(sqe.cid(), Status::SUCCESS)).unwrap();
                    black_box(q.poll_transmit().unwrap());
                })
            },
        );
    }
}

criterion_group!(benches, commands);
criterion_main!(benches);
