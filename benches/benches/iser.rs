//! iSER microbenchmarks: a 4 KiB WRITE through the target's iSER connection on the rig
//! (iscsi_pdu::iser::testing), its data as immediate data in the Send or read by an RDMA READ
//! from the initiator's buffer, and a 4 KiB READ written back by an RDMA WRITE: message
//! decode, the iSCSI connection machine, the SCSI core, a memory unit, and the work requests
//! (the rig copies what the verbs would move).

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

criterion_group!(benches, paths);
criterion_main!(benches);
