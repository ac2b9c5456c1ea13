//! iSER microbenchmarks: a 4 KiB WRITE through the target's iSER connection on the rig
//! (iscsi_pdu::iser::testing), its data as immediate data in the Send or read by an RDMA READ
//! from the initiator's buffer, and a 4 KiB READ written back by an RDMA WRITE: message
//! decode, the iSCSI connection machine, the SCSI core, a memory unit, and the work requests
//! (the rig copies what the verbs would move). Then the same READ and a WRITE started by the
//! initiator's datamover (`IserInitiator` around the initiator's session) and its answer
//! taken by it: the difference is what the initiator's side costs.

use std::hint::black_box;

use bytes::Bytes;
use criterion::{criterion_group, criterion_main, Criterion};
use iscsi_pdu::iser::testing::IserRig;
use iscsi_pdu::iser::IserHeader;
use iscsi_pdu::ScsiStatus;

fn paths(c: &mut Criterion) {
    let data = vec![0x5a; 4096];
    for (name, imm) in [("immediate data", 4096usize), ("RDMA READ", 0)] {
        let mut p = IserRig::new();
        let mut buffer = p.register(1, data.clone());
        buffer.va += imm as u64;
        let immediate = Bytes::copy_from_slice(&data[..imm]);
        let header = IserHeader {
            write: (imm < data.len()).then_some(buffer),
            read: None,
        };
        let mut itt = 0u32;
        c.bench_function(&format!("iSER 4 KiB WRITE, {name}"), |b| {
            b.iter(|| {
                itt = itt.wrapping_add(1) & 0xffff;
                let cmd = p.command(itt, true, 0, 8, immediate.clone());
                p.send(&cmd, header);
                assert_eq!(p.status(itt), Some(ScsiStatus::GOOD));
                p.sent.clear();
                p.posted.clear();
                black_box(itt)
            })
        });
    }
    let mut p = IserRig::new();
    let buffer = p.register(2, vec![0; 4096]);
    let header = IserHeader {
        write: None,
        read: Some(buffer),
    };
    let mut itt = 0u32;
    c.bench_function("iSER 4 KiB READ, RDMA WRITE", |b| {
        b.iter(|| {
            itt = itt.wrapping_add(1) & 0xffff;
            let cmd = p.command(itt, false, 0, 8, Bytes::new());
            p.send(&cmd, header);
            assert_eq!(p.status(itt), Some(ScsiStatus::GOOD));
            p.sent.clear();
            p.posted.clear();
            black_box(itt)
        })
    });
}

fn initiator_paths(c: &mut Criterion) {
    use bytes::BytesMut;
    use iscsi_pdu::initiator::{Command, Event};
    use iscsi_pdu::Lun;
    let mut cdb = [0u8; 16];
    cdb[7..9].copy_from_slice(&8u16.to_be_bytes());
    let data = Bytes::from(vec![0x5a; 4096]);
    for (name, write) in [("READ", false), ("WRITE, immediate data", true)] {
        let mut p = IserRig::new();
        let mut i = p.initiator();
        let buffer = p.register(3, vec![0; 4096]);
        cdb[0] = if write { 0x2a } else { 0x28 };
        let cmd = if write {
            Command::write(Lun::ZERO, cdb, data.clone())
        } else {
            Command::read(Lun::ZERO, cdb, 4096)
        };
        let (w, r) = if write {
            (Some(buffer), None)
        } else {
            (None, Some(buffer))
        };
        let now = p.now;
        let mut m = BytesMut::with_capacity(16384);
        c.bench_function(&format!("iSER 4 KiB {name}, initiator and target"), |b| {
            b.iter(|| {
                let itt = i
                    .start_command(now, &cmd, w, r)
                    .expect("the window is open");
                m.clear();
                while i.poll_transmit(&mut m) {
                    p.message(&m);
                    m.clear();
                }
                for pdu in p.sent.drain(..) {
                    m.clear();
                    iscsi_pdu::iser::encode(&pdu, &IserHeader::default(), &mut m);
                    i.handle_message(now, &m).expect("the target's message");
                }
                let mut ended = false;
                while let Some(e) = i.poll_event() {
                    ended |= matches!(e, Event::Done { itt: t, result: Ok(_) } if t == itt);
                }
                assert!(ended, "the command ended");
                p.posted.clear();
                black_box(itt)
            })
        });
    }
}

criterion_group!(benches, paths, initiator_paths);
criterion_main!(benches);
