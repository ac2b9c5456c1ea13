//! iscsi-pdu microbenchmarks: BHS decode, Data-In header encode, full PDU decode, CRC32C, and
//! a 64 KiB READ through the initiator's session over TCP (started, its Data-In placed, the
//! last with status, the reply taken), in eight 8 KiB Data-In PDUs and in one: what
//! initiator-bench's iSCSI reads cost on the client's side, so a change that makes them
//! dearer shows here.

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

fn initiator_read(c: &mut Criterion) {
    use iscsi_pdu::initiator::{Command, Event, Session};
    use iscsi_pdu::negotiation::{ConnectionParams, SessionParams};
    use iscsi_pdu::{DataInStatus, Lun, Residual, ScsiStatus};
    const LEN: u32 = 64 * 1024;
    let mut session = Session::new(
        SessionParams::default(),
        1,
        SerialNumber(1),
        SerialNumber(1 << 30),
    );
    let conn = session.add_connection(ConnectionParams::default(), SerialNumber(0));
    let mut cdb = [0u8; 16];
    cdb[0] = 0x28;
    cdb[7..9].copy_from_slice(&((LEN / 512) as u16).to_be_bytes());
    let cmd = Command::read(Lun::ZERO, cdb, LEN);
    let data = Bytes::from(vec![0x5a; LEN as usize]);
    let now = std::time::Instant::now();
    let mut stat_sn = 0u32;
    let mut g = c.benchmark_group("initiator session");
    g.throughput(Throughput::Bytes(u64::from(LEN)));
    for (name, segment) in [("8 Data-In", 8192usize), ("1 Data-In", LEN as usize)] {
        g.bench_function(format!("64 KiB READ over TCP, {name}"), |b| {
            b.iter(|| {
                let itt = session
                    .start_command(now, &cmd)
                    .expect("the window is open");
                while session.poll_transmit(conn).is_some() {}
                let (exp, max) = session.window();
                for (n, at) in (0..LEN as usize).step_by(segment).enumerate() {
                    let last = at + segment >= LEN as usize;
                    let status = last.then(|| {
                        stat_sn += 1;
                        DataInStatus {
                            status: ScsiStatus::GOOD,
                            stat_sn: SerialNumber(stat_sn),
                            residual: Residual::None,
                        }
                    });
                    let d = DataIn {
                        final_bit: last,
                        status,
                        initiator_task_tag: itt,
                        target_transfer_tag: u32::MAX,
                        exp_cmd_sn: exp,
                        max_cmd_sn: max,
                        data_sn: n as u32,
                        buffer_offset: at as u32,
                        data: data.slice(at..at + segment),
                        ..Default::default()
                    };
                    session
                        .handle_pdu(now, conn, Pdu::DataIn(d))
                        .expect("a good Data-In");
                }
                let mut ended = false;
                while let Some(e) = session.poll_event() {
                    if let Event::Done { itt: t, result } = e {
                        ended |= t == itt && black_box(result).is_ok();
                    }
                }
                assert!(ended, "the read ended");
            })
        });
    }
    g.finish();
}

criterion_group!(benches, codec, crc, initiator_read);
criterion_main!(benches);
