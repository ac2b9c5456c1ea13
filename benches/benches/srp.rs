//! SRP microbenchmarks: SRP_CMD decode (direct, and 32 discrete regions in an indirect
//! descriptor, the paper's 128 KiB command) and SRP_RSP encode.

use std::hint::black_box;

use criterion::{criterion_group, criterion_main, Criterion};
use srp::iu::{DataBufferDescriptor, Descriptors, MemoryDescriptor, SrpCmd, SrpRsp};
use srp::Iu;

fn read10() -> [u8; 10] {
    [0x28, 0, 0, 0, 0x10, 0, 0, 1, 0, 0]
}

fn codec(c: &mut Criterion) {
    let cdb = read10();
    let direct = SrpCmd {
        tag: 7,
        cdb: &cdb,
        data_in: DataBufferDescriptor::Direct(MemoryDescriptor {
            va: 0x1000,
            key: 9,
            len: 131072,
        }),
        ..SrpCmd::default()
    };
    let mut d = Vec::new();
    direct.encode(&mut d);
    c.bench_function("decode SRP_CMD, direct", |b| {
        b.iter(|| match Iu::decode(black_box(&d)) {
            Ok(Iu::Cmd(c)) => black_box(c.data_in.expected_len()),
            _ => unreachable!(),
        })
    });
    let mut list = Vec::new();
    for i in 0..32u64 {
        MemoryDescriptor {
            va: 0x10_0000 + i * 0x3000,
            key: 9,
            len: 4096,
        }
        .encode(&mut list);
    }
    let indirect = SrpCmd {
        tag: 8,
        cdb: &cdb,
        data_in: DataBufferDescriptor::Indirect {
            table: MemoryDescriptor {
                va: 0x5000,
                key: 9,
                len: 512,
            },
            total_len: 131072,
            partial: Descriptors::new(&list).expect("32 descriptors"),
        },
        ..SrpCmd::default()
    };
    let mut i = Vec::new();
    indirect.encode(&mut i);
    c.bench_function("decode SRP_CMD, 32 regions, and walk them", |b| {
        b.iter(|| match Iu::decode(black_box(&i)) {
            Ok(Iu::Cmd(SrpCmd {
                data_in: DataBufferDescriptor::Indirect { partial, .. },
                ..
            })) => black_box(partial.total_len()),
            _ => unreachable!(),
        })
    });
    let mut out = Vec::with_capacity(128);
    c.bench_function("encode SRP_RSP, GOOD", |b| {
        b.iter(|| {
            out.clear();
            SrpRsp {
                tag: black_box(7),
                req_lim_delta: 1,
                ..SrpRsp::default()
            }
            .encode(&mut out);
            black_box(out.len())
        })
    });
}

criterion_group!(benches, codec);
criterion_main!(benches);
