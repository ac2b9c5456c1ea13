//! Property test: random command sequences against a memory-backed unit never panic, and what
//! is read equals what was last written (WRITE, WRITE SAME, UNMAP and COMPARE AND WRITE
//! included), with arbitrary CDBs mixed in.

mod common;

use common::*;
use proptest::prelude::*;
use scsi_core::testing::Harness;
use scsi_core::{Device, Geometry, Identity, Limits, LogicalUnit};

const BLOCKS: u64 = 1024;
const BS: usize = 512;

#[derive(Debug, Clone)]
enum Cmd {
    Write {
        lba: u64,
        blocks: u32,
        seed: u8,
    },
    Read {
        lba: u64,
        blocks: u32,
    },
    WriteSame {
        lba: u64,
        blocks: u32,
        byte: u8,
        unmap: bool,
        ndob: bool,
    },
    Unmap {
        ranges: Vec<(u64, u32)>,
    },
    CompareAndWrite {
        lba: u64,
        blocks: u8,
        seed: u8,
        matching: bool,
    },
    Garbage {
        cdb: Vec<u8>,
        data: Vec<u8>,
    },
}

/// Opcodes that change data, left out of the arbitrary CDBs so the model stays exact.
const WRITERS: [u8; 14] = [
    0x04, 0x0a, 0x2a, 0x2e, 0x41, 0x42, 0x89, 0x8a, 0x8b, 0x8e, 0x93, 0x9c, 0xaa, 0xae,
];

fn cmd() -> impl Strategy<Value = Cmd> {
    let lba = 0..BLOCKS + 4;
    prop_oneof![
        (lba.clone(), 0..40u32, any::<u8>()).prop_map(|(lba, blocks, seed)| Cmd::Write {
            lba,
            blocks,
            seed
        }),
        (lba.clone(), 0..40u32).prop_map(|(lba, blocks)| Cmd::Read { lba, blocks }),
        (
            lba.clone(),
            0..300u32,
            any::<u8>(),
            any::<bool>(),
            any::<bool>()
        )
            .prop_map(|(lba, blocks, byte, unmap, ndob)| Cmd::WriteSame {
                lba,
                blocks,
                byte,
                unmap,
                ndob
            }),
        proptest::collection::vec((lba.clone(), 0..300u32), 0..4)
            .prop_map(|ranges| Cmd::Unmap { ranges }),
        (lba, 0..4u8, any::<u8>(), any::<bool>()).prop_map(|(lba, blocks, seed, matching)| {
            Cmd::CompareAndWrite {
                lba,
                blocks,
                seed,
                matching,
            }
        }),
        (
            proptest::collection::vec(any::<u8>(), 1..17),
            proptest::collection::vec(any::<u8>(), 0..64)
        )
            .prop_filter("no data writers", |(c, _)| !WRITERS.contains(&c[0]))
            .prop_map(|(cdb, data)| Cmd::Garbage { cdb, data }),
    ]
}

fn fits(lba: u64, blocks: u32) -> bool {
    lba + u64::from(blocks) <= BLOCKS
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]
    #[test]
    fn reads_return_what_was_last_written(
        cmds in proptest::collection::vec(cmd(), 1..40),
        delegate in any::<bool>(),
    ) {
        let mut device = Device::new("iqn.2026-11.io.example:t", ports());
        device.set_delegation(delegate);
        let mut h = Harness::new(device);
        h.add_lu(0, LogicalUnit {
            identity: Identity::new("STGT", "model", "0001", b"m"),
            geometry: Geometry { block_size: BS as u32, blocks: BLOCKS, thin: true, write_cache: true, read_only: false },
            limits: Limits::default(),
        });
        let n = h.login("iqn.x:model", 1);
        let mut model = vec![0u8; BLOCKS as usize * BS];
        for c in cmds {
            match c {
                Cmd::Write { lba, blocks, seed } => {
                    let data = pattern(blocks as usize, seed);
                    let o = h.command(n, 0, &cdb16(0x8a, 0, lba, blocks), &data, data.len() as u32);
                    prop_assert_eq!(o.is_good(), fits(lba, blocks), "{:?}", o);
                    if o.is_good() {
                        let at = lba as usize * BS;
                        model[at..at + data.len()].copy_from_slice(&data);
                    }
                }
                Cmd::Read { lba, blocks } => {
                    let o = h.command(n, 0, &cdb16(0x88, 0, lba, blocks), &[], blocks * BS as u32);
                    prop_assert_eq!(o.is_good(), fits(lba, blocks));
                    if o.is_good() {
                        let at = lba as usize * BS;
                        prop_assert!(o.data == model[at..at + blocks as usize * BS], "read {} +{}", lba, blocks);
                    }
                }
                Cmd::WriteSame { lba, blocks, byte, unmap, ndob } => {
                    let block = vec![byte; BS];
                    let flags = u8::from(unmap) << 3 | u8::from(ndob);
                    let out: &[u8] = if ndob { &[] } else { &block };
                    let o = h.command(n, 0, &cdb16(0x93, flags, lba, blocks), out, out.len() as u32);
                    prop_assert_eq!(o.is_good(), blocks > 0 && fits(lba, blocks), "{:?}", o);
                    if o.is_good() {
                        let fill = if ndob { 0 } else { byte };
                        let at = lba as usize * BS;
                        model[at..at + blocks as usize * BS].fill(fill);
                    }
                }
                Cmd::Unmap { ranges } => {
                    let mut p = vec![0u8; 8];
                    for &(lba, n) in &ranges {
                        p.extend_from_slice(&lba.to_be_bytes());
                        p.extend_from_slice(&n.to_be_bytes());
                        p.extend_from_slice(&[0; 4]);
                    }
                    let dl = (p.len() - 2) as u16;
                    p[0..2].copy_from_slice(&dl.to_be_bytes());
                    p[2..4].copy_from_slice(&(16 * ranges.len() as u16).to_be_bytes());
                    let mut c = [0x42, 0, 0, 0, 0, 0, 0, 0, 0, 0];
                    c[7..9].copy_from_slice(&(p.len() as u16).to_be_bytes());
                    let o = h.command(n, 0, &c, &p, p.len() as u32);
                    let ok = ranges.iter().all(|&(l, b)| fits(l, b));
                    prop_assert_eq!(o.is_good(), ok, "{:?}", o);
                    if ok {
                        for (lba, blocks) in ranges {
                            let at = lba as usize * BS;
                            model[at..at + blocks as usize * BS].fill(0);
                        }
                    }
                }
                Cmd::CompareAndWrite { lba, blocks, seed, matching } => {
                    let n_bytes = blocks as usize * BS;
                    let mut verify = if fits(lba, blocks.into()) {
                        model[lba as usize * BS..lba as usize * BS + n_bytes].to_vec()
                    } else {
                        vec![0; n_bytes]
                    };
                    if !matching && n_bytes > 0 {
                        verify[n_bytes / 2] ^= 0x5a;
                    }
                    let new = pattern(blocks.into(), seed);
                    let mut c = cdb16(0x89, 0, lba, 0);
                    c[13] = blocks;
                    let data = [verify, new.clone()].concat();
                    let o = h.command(n, 0, &c, &data, data.len() as u32);
                    if !fits(lba, blocks.into()) {
                        check(&o, 5, 0x21, 0);
                    } else if matching || blocks == 0 {
                        prop_assert!(o.is_good(), "{:?}", o);
                        let at = lba as usize * BS;
                        model[at..at + n_bytes].copy_from_slice(&new);
                    } else {
                        check(&o, 0x0e, 0x1d, 0);
                    }
                }
                Cmd::Garbage { cdb, data } => {
                    let o = h.command(n, 0, &cdb, &data, data.len() as u32);
                    prop_assert!(o.status.is_some());
                    // Whatever it did (a STOP, a reservation), put the unit back.
                    h.command(n, 0, &[0x1b, 0, 0, 0, 1, 0], &[], 0);
                    h.command(n, 0, &[0x16, 0, 0, 0, 0, 0], &[], 0);
                    h.command(n, 0, &[0x17, 0, 0, 0, 0, 0], &[], 0);
                    let mut page = h.command(n, 0, &[0x1a, 0x08, 0x0a, 0, 255, 0], &[], 255).data;
                    if page.len() == 16 {
                        page[0] = 0;
                        page[2] = 0;
                        page[4 + 4] &= !0x08;
                        h.command(n, 0, &[0x15, 0x10, 0, 0, 16, 0], &page, 16);
                    }
                    while !h.command(n, 0, &[0; 6], &[], 0).is_good() {}
                }
            }
            prop_assert_eq!(h.device.task_count(), 0);
        }
    }
}
