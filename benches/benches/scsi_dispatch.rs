//! The SCSI core's dispatch path: a command in, through the task set, CDB decode and checks, to
//! its backend operation, and the completion back out to status. No payload moves (the backend
//! is not run), so this is the core's own cost per I/O.

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use scsi_core::{
    Action, Command, Device, Geometry, Identity, Limits, LogicalUnit, Output, TargetPort,
    TaskAttribute, TransportId,
};
use std::hint::black_box;

fn device() -> (Device, scsi_core::NexusId) {
    let port = TargetPort::iscsi("iqn.2026-11.io.example:b", 1);
    let mut d = Device::new("iqn.2026-11.io.example:b", vec![port]);
    d.add_lu(
        0,
        LogicalUnit {
            identity: Identity::new("STGT", "bench", "0001", b"b"),
            geometry: Geometry {
                block_size: 512,
                blocks: 1 << 30,
                thin: true,
                write_cache: true,
                read_only: false,
            },
            limits: Limits::default(),
        },
    )
    .unwrap();
    let n = d.open_nexus(TransportId::iscsi("iqn.x:bench", [0x80, 0, 0, 0, 0, 1]), 1);
    // Clear the power-on unit attention.
    let cmd = Command {
        nexus: n,
        lun: 0,
        cdb: &[0; 6],
        attribute: TaskAttribute::Simple,
        tag: 0,
        data_in_len: 0,
        data_out_len: 0,
    };
    d.submit(cmd).unwrap();
    while d.poll().is_some() {}
    (d, n)
}

/// One command through the core, answering its requests; returns the final status.
fn run(d: &mut Device, cmd: Command<'_>, data: &[u8]) -> u8 {
    d.submit(cmd).unwrap();
    let mut status = 0xff;
    while let Some(a) = d.poll() {
        match a {
            Action::DataOut { task, .. } => d.data_out(task, data).unwrap(),
            Action::Backend { task, .. } => d.backend_done(task, Ok(Output::Done)).unwrap(),
            Action::Complete { status: s, .. } => status = s as u8,
            _ => {}
        }
    }
    status
}

fn dispatch(c: &mut Criterion) {
    let mut g = c.benchmark_group("scsi_dispatch");
    g.throughput(Throughput::Elements(1));
    let (mut d, n) = device();
    let mut lba = 0u32;
    g.bench_function("read10_4k", |b| {
        b.iter(|| {
            lba = lba.wrapping_add(8) & 0xff_ffff;
            let mut cdb = [0x28, 0, 0, 0, 0, 0, 0, 0, 8, 0];
            cdb[2..6].copy_from_slice(&lba.to_be_bytes());
            let cmd = Command {
                nexus: n,
                lun: 0,
                cdb: &cdb,
                attribute: TaskAttribute::Simple,
                tag: u64::from(lba),
                data_in_len: 4096,
                data_out_len: 0,
            };
            black_box(run(&mut d, cmd, &[]))
        })
    });
    let data = vec![0u8; 4096];
    g.bench_function("write16_4k", |b| {
        b.iter(|| {
            lba = lba.wrapping_add(8) & 0xff_ffff;
            let mut cdb = [0u8; 16];
            cdb[0] = 0x8a;
            cdb[2..10].copy_from_slice(&u64::from(lba).to_be_bytes());
            cdb[10..14].copy_from_slice(&8u32.to_be_bytes());
            let cmd = Command {
                nexus: n,
                lun: 0,
                cdb: &cdb,
                attribute: TaskAttribute::Simple,
                tag: u64::from(lba),
                data_in_len: 0,
                data_out_len: 4096,
            };
            black_box(run(&mut d, cmd, &data))
        })
    });
    g.finish();
}

criterion_group!(benches, dispatch);
criterion_main!(benches);
