#![allow(dead_code)]

use scsi_core::testing::{Harness, Outcome};
use scsi_core::{Device, Geometry, Identity, Limits, LogicalUnit, Status, TargetPort};

pub const BLOCKS: u64 = 1 << 16;

pub fn unit(thin: bool, key: &[u8]) -> LogicalUnit {
    LogicalUnit {
        identity: Identity::new("STGT", "targetd disk", "0001", key),
        geometry: Geometry {
            block_size: 512,
            blocks: BLOCKS,
            thin,
            write_cache: true,
            read_only: false,
        },
        limits: Limits::default(),
    }
}

pub fn ports() -> Vec<TargetPort> {
    (1..=2)
        .map(|p| TargetPort {
            relative_port: p,
            port_group: 1,
            name: format!("iqn.2026-11.io.example:t,t,0x{p}"),
            target_name: "iqn.2026-11.io.example:t".into(),
        })
        .collect()
}

/// A harness with a thin LUN 0 and a thick LUN 1.
pub fn harness() -> Harness {
    harness_with(false)
}

/// A harness whose device delegates plain reads and writes when `delegate` is set.
pub fn harness_with(delegate: bool) -> Harness {
    let mut device = Device::new("iqn.2026-11.io.example:t", ports());
    device.set_delegation(delegate);
    let mut h = Harness::new(device);
    h.add_lu(0, unit(true, b"lu0"));
    h.add_lu(1, unit(false, b"lu1"));
    h
}

pub fn cdb10(op: u8, flags: u8, lba: u32, blocks: u16) -> Vec<u8> {
    let mut c = vec![0u8; 10];
    c[0] = op;
    c[1] = flags;
    c[2..6].copy_from_slice(&lba.to_be_bytes());
    c[7..9].copy_from_slice(&blocks.to_be_bytes());
    c
}

pub fn cdb16(op: u8, flags: u8, lba: u64, blocks: u32) -> Vec<u8> {
    let mut c = vec![0u8; 16];
    c[0] = op;
    c[1] = flags;
    c[2..10].copy_from_slice(&lba.to_be_bytes());
    c[10..14].copy_from_slice(&blocks.to_be_bytes());
    c
}

#[track_caller]
pub fn check(o: &Outcome, key: u8, asc: u8, ascq: u8) {
    assert_eq!(o.status, Some(Status::CheckCondition), "{o:?}");
    assert_eq!(o.sense_code(), Some((key, asc, ascq)), "{o:?}");
}

#[track_caller]
pub fn good(o: &Outcome) {
    assert_eq!(o.status, Some(Status::Good), "{o:?}");
}

pub fn pattern(blocks: usize, seed: u8) -> Vec<u8> {
    (0..blocks * 512)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect()
}
