//! iscsi-pdu microbenchmarks: BHS decode, Data-In header encode, full PDU decode, CRC32C.

use std::hint::black_box;

use bytes::{Bytes, BytesMut};
use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use iscsi_pdu::{
    crc32c, DataIn, Deframer, Digests, Pdu, ScsiCommand, SerialNumber, MAX_DATA_SEGMENT_LENGTH,
};

fn read10() -> Pdu {
    let mut cdb = [0u8; 16];
    cdb[0] = 0x28;
    cdb[8] = 8;
    Pdu::ScsiCommand(ScsiCommand {
        final_bit: true,
        read: true,
        initiator_task_tag: 0x1234,
        expected_data_transfer_length: 4096,
        cmd_sn: SerialNumber(77),
        exp_stat_sn: SerialNumber(78),
        cdb,
        ..Default::default()
    })
}

/// The PDU's wire form in static memory, so cloning the input in a benchmark loop is a copy of
/// a pointer and a length, as a slice of a receive buffer would be, not a reference count update.
fn encode(pdu: &Pdu, digests: Digests) -> Bytes {
    let mut b = BytesMut::new();
    pdu.encode(digests, &mut b);
    Bytes::from_static(Vec::leak(b.to_vec()))
}

fn codec(c: &mut Criterion) {
    let bhs = encode(&read10(), Digests::NONE);
    c.bench_function("decode SCSI Command BHS", |b| {
        b.iter(|| {
            Pdu::decode(
                &mut black_box(&bhs).clone(),
                Digests::NONE,
                MAX_DATA_SEGMENT_LENGTH,
            )
            .unwrap()
        })
    });

    let data_in = Pdu::DataIn(DataIn {
        final_bit: true,
        initiator_task_tag: 0x1234,
        target_transfer_tag: 0xffff_ffff,
        exp_cmd_sn: SerialNumber(79),
        max_cmd_sn: SerialNumber(206),
        data_sn: 3,
        buffer_offset: 24576,
        ..Default::default()
    });
    let mut out = BytesMut::with_capacity(64);
    c.bench_function("encode Data-In header", |b| {
        b.iter(|| {
            out.clear();
            black_box(&data_in).encode_header(8192, false, &mut out);
            black_box(&out);
        })
    });
    c.bench_function("encode Data-In header + header digest", |b| {
        b.iter(|| {
            out.clear();
            black_box(&data_in).encode_header(8192, true, &mut out);
            black_box(&out);
        })
    });

    let mut write = read10();
    if let Pdu::ScsiCommand(cmd) = &mut write {
        cmd.cdb[0] = 0x2a;
        cmd.read = false;
        cmd.write = true;
        cmd.expected_data_transfer_length = 8192;
        cmd.data = Bytes::from(vec![0xa5u8; 8192]);
    }
    let mut group = c.benchmark_group("decode PDU with 8 KiB data");
    group.throughput(Throughput::Bytes(8192 + 48));
    let plain = encode(&write, Digests::NONE);
    group.bench_function("no digests", |b| {
        b.iter(|| {
            Pdu::decode(
                &mut black_box(&plain).clone(),
                Digests::NONE,
                MAX_DATA_SEGMENT_LENGTH,
            )
            .unwrap()
        })
    });
    let digested = encode(&write, Digests::BOTH);
    group.bench_function("header and data digests", |b| {
        b.iter(|| {
            Pdu::decode(
                &mut black_box(&digested).clone(),
                Digests::BOTH,
                MAX_DATA_SEGMENT_LENGTH,
            )
            .unwrap()
        })
    });
    group.finish();

    // A stream of 4 KiB-read commands through the deframer, fed in 1500-byte pieces.
    let stream: Vec<u8> = (0..64)
        .flat_map(|_| encode(&read10(), Digests::NONE).to_vec())
        .collect();
    let mut group = c.benchmark_group("deframe 64 SCSI Commands");
    group.throughput(Throughput::Elements(64));
    group.bench_function("1500-byte reads", |b| {
        let mut d = Deframer::new();
        b.iter(|| {
            let mut n = 0;
            for chunk in stream.chunks(1500) {
                d.feed(chunk);
                while let Some(p) = d.next_pdu().unwrap() {
                    black_box(p);
                    n += 1;
                }
            }
            assert_eq!(n, 64);
        })
    });
    group.finish();
}

fn crc(c: &mut Criterion) {
    let mut group = c.benchmark_group("crc32c");
    for size in [48usize, 8 << 10, 256 << 10] {
        let buf: Vec<u8> = (0..size).map(|i| i as u8).collect();
        group.throughput(Throughput::Bytes(size as u64));
        group.bench_function(format!("{size} B"), |b| b.iter(|| crc32c(black_box(&buf))));
    }
    group.finish();
}

criterion_group!(benches, codec, crc);
criterion_main!(benches);
