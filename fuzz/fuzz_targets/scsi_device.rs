//! Arbitrary commands, parameter lists, task attributes, task management and nexus churn from
//! three initiators against a device with two memory-backed units, with plain reads and writes
//! delegated to the harness or not: nothing panics, every command ends exactly once, and the
//! task set drains.
#![no_main]

use arbitrary::Arbitrary;
use libfuzzer_sys::fuzz_target;
use scsi_core::pr::MemoryStore;
use scsi_core::testing::Harness;
use scsi_core::{
    Device, Geometry, Identity, Limits, LogicalUnit, TargetPort, TaskAttribute, TmfFunction,
};

#[derive(Arbitrary, Debug)]
enum Step {
    Command {
        nexus: u8,
        lun: u8,
        cdb: Vec<u8>,
        attribute: u8,
        data_out: Vec<u8>,
        data_in_len: u16,
    },
    Release,
    ReleaseDataOut,
    Tmf {
        nexus: u8,
        lun: u8,
        function: u8,
        tag: u8,
    },
    Reconnect {
        nexus: u8,
    },
}

fn unit(thin: bool, block_size: u32) -> LogicalUnit {
    LogicalUnit {
        identity: Identity::new("STGT", "fuzz", "0001", &[thin as u8]),
        geometry: Geometry {
            block_size,
            blocks: 4096,
            thin,
            write_cache: !thin,
            read_only: false,
        },
        limits: Limits::default(),
    }
}

fuzz_target!(|input: (bool, Vec<Step>)| {
    let (delegate, steps) = input;
    let port = TargetPort::iscsi("iqn.2026-11.io.example:f", 1);
    let mut device = Device::new("iqn.2026-11.io.example:f", vec![port]);
    // Plain reads and writes delegated to the harness (as targetd's core does), or not.
    device.set_delegation(delegate);
    let mut h = Harness::new(device);
    h.device
        .set_reservation_store(Box::new(MemoryStore::default()));
    h.add_lu(0, unit(true, 512));
    h.add_lu(1, unit(false, 4096));
    h.hold_backend = true;
    h.hold_data_out = true;
    let mut nexuses: Vec<_> = (0..3)
        .map(|i| {
            h.device.open_nexus(
                scsi_core::TransportId::iscsi("iqn.x:f", [0, 0, 0, 0, 0, i]),
                1,
            )
        })
        .collect();
    let mut submitted = Vec::new();
    for step in steps.into_iter().take(64) {
        match step {
            Step::Command {
                nexus,
                lun,
                cdb,
                attribute,
                data_out,
                data_in_len,
            } => {
                if data_out.len() > 1 << 16 {
                    continue;
                }
                let attribute = match attribute % 4 {
                    0 => TaskAttribute::Simple,
                    1 => TaskAttribute::Ordered,
                    2 => TaskAttribute::HeadOfQueue,
                    _ => TaskAttribute::Aca,
                };
                let n = nexuses[usize::from(nexus % 3)];
                let tag = h.submit(
                    n,
                    u16::from(lun % 3),
                    &cdb,
                    attribute,
                    &data_out,
                    data_in_len.into(),
                );
                submitted.push(tag);
                h.run();
            }
            Step::Release => {
                h.release();
            }
            Step::ReleaseDataOut => {
                h.release_data_out();
            }
            Step::Tmf {
                nexus,
                lun,
                function,
                tag,
            } => {
                let tag = submitted.get(usize::from(tag)).copied().unwrap_or(0);
                let f = match function % 10 {
                    0 => TmfFunction::AbortTask(tag),
                    1 => TmfFunction::AbortTaskSet,
                    2 => TmfFunction::ClearTaskSet,
                    3 => TmfFunction::ClearAca,
                    4 => TmfFunction::LogicalUnitReset,
                    5 => TmfFunction::ItNexusReset,
                    6 => TmfFunction::TargetWarmReset,
                    7 => TmfFunction::QueryTask(tag),
                    8 => TmfFunction::QueryTaskSet,
                    _ => TmfFunction::QueryAsynchronousEvent,
                };
                h.task_management(nexuses[usize::from(nexus % 3)], u16::from(lun % 3), f, 0);
            }
            Step::Reconnect { nexus } => {
                let i = usize::from(nexus % 3);
                h.device.close_nexus(nexuses[i]).unwrap();
                h.run();
                nexuses[i] = h.device.open_nexus(
                    scsi_core::TransportId::iscsi("iqn.x:f", [0, 0, 0, 0, 0, i as u8]),
                    1,
                );
            }
        }
    }
    h.hold_backend = false;
    h.hold_data_out = false;
    while h.release_data_out() || h.release() {}
    assert_eq!(h.device.task_count(), 0);
    for tag in submitted {
        assert!(h.outcomes.contains_key(&tag), "task {tag} never ended");
    }
});
