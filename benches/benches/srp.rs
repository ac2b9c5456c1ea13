//! SRP microbenchmarks: SRP_CMD decode (direct, and 32 discrete regions in an indirect
//! descriptor, the paper's 128 KiB command) and SRP_RSP encode; and a 4 KiB WRITE through
//! the target machine and the software fabric, its data as immediate data in the SRP_CMD or
//! fetched by RDMA READ (the work the target saves per small write).

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

fn write_paths(c: &mut Criterion) {
    use srp::iu::MultiChannelAction;
    use srp::testing::{Cmd, Rig};
    for (name, immediate) in [("immediate data", true), ("RDMA READ", false)] {
        let mut rig = Rig::new(&[(0, 512, 8192)]);
        let mut req = Rig::login_request(*b"initiator-port-A", MultiChannelAction::SingleChannel);
        if immediate {
            // Linux's ib_srp's default login.
            req.req_it_iu_len = 8260;
            req.immediate_data = true;
            req.imm_data_offset = 68;
        }
        let (ch, rsp) = rig.login(&req).expect("accepted");
        assert_eq!(rsp.immediate_data, immediate);
        // The power-on unit attention.
        let tur = Cmd {
            tag: 1,
            cdb: vec![0; 6],
            ..Cmd::default()
        };
        rig.send(ch, &tur).expect("credit");
        rig.run();
        rig.take_response(ch, 1);
        let write = Cmd {
            tag: 0,
            cdb: vec![0x2a, 0, 0, 0, 0, 8, 0, 0, 8, 0],
            data_out: Some(vec![0x5a; 4096]),
            regions: 1,
            ..Cmd::default()
        };
        let mut tag = 1;
        c.bench_function(&format!("SRP 4 KiB WRITE, {name}"), |b| {
            b.iter(|| {
                tag += 1;
                let cmd = Cmd {
                    tag,
                    ..write.clone()
                };
                rig.send(ch, &cmd).expect("credit");
                rig.run();
                let r = rig.take_response(ch, tag).expect("answered");
                assert_eq!(r.status, 0);
                black_box(r.status)
            })
        });
    }
}

criterion_group!(benches, codec, write_paths);
criterion_main!(benches);
