//! iSER: the message and CM private-data decoders fed raw bytes, and the target's iSER
//! connection on the rig fed Arbitrary sequences of reads and writes (with and without the
//! buffers their data needs, with immediate data, beyond the registered memory), raw and
//! mutated messages, Hellos, ABORT TASK, and RDMA READs held, done or failed in any order.
//! Nothing panics; a read of memory the initiator never registered closes the connection as
//! a queue pair would; and once every read is done, none is left in flight or waiting.
#![no_main]

use arbitrary::Arbitrary;
use bytes::{Bytes, BytesMut};
use iscsi_pdu::iser::testing::IserRig;
use iscsi_pdu::iser::{self, CmRequest, Hello, IserHeader, RemoteBuffer};
use iscsi_pdu::*;
use libfuzzer_sys::fuzz_target;

#[derive(Arbitrary, Debug)]
enum Step {
    Write {
        itt: u8,
        lba: u16,
        blocks: u8,
        /// Blocks of immediate data (at most 16).
        imm: u8,
        /// Name the write buffer; and register it short by this many bytes.
        buffer: bool,
        short: u16,
    },
    Read {
        itt: u8,
        lba: u16,
        blocks: u8,
        buffer: bool,
        stag: u8,
    },
    Raw(Vec<u8>),
    Mutated {
        itt: u8,
        at: u16,
        byte: u8,
    },
    Hello {
        max: u8,
        min: u8,
        ird: u16,
    },
    Abort {
        itt: u8,
    },
    HoldReads(bool),
    CompleteReads(u8),
}

fuzz_target!(|input: (Vec<u8>, Vec<Step>)| {
    let (bytes, steps) = input;
    // The decoders alone.
    let _ = iser::decode(&bytes, 8192);
    let _ = CmRequest::decode(&bytes);
    let mut r = IserRig::new();
    for step in steps.into_iter().take(64) {
        match step {
            Step::Write {
                itt,
                lba,
                blocks,
                imm,
                buffer,
                short,
            } => {
                let len = usize::from(blocks.max(1)) * 512;
                let imm = (usize::from(imm.min(16)) * 512).min(len);
                let data: Vec<u8> = (0..len).map(|i| i as u8 ^ itt).collect();
                let stag = 1000 + u32::from(itt);
                let registered = data[..len - usize::from(short).min(len)].to_vec();
                let mut b = r.register(stag, registered);
                b.va += imm as u64;
                let cmd = r.command(
                    u32::from(itt),
                    true,
                    u32::from(lba),
                    u16::from(blocks.max(1)),
                    Bytes::copy_from_slice(&data[..imm]),
                );
                let write = buffer.then_some(b);
                r.send(&cmd, IserHeader { write, read: None });
            }
            Step::Read {
                itt,
                lba,
                blocks,
                buffer,
                stag,
            } => {
                let blocks = u16::from(blocks.max(1));
                let b = r.register(2000 + u32::from(stag), vec![0; usize::from(blocks) * 512]);
                let cmd = r.command(u32::from(itt), false, u32::from(lba), blocks, Bytes::new());
                let read = buffer.then_some(RemoteBuffer {
                    stag: 2000 + u32::from(itt),
                    ..b
                });
                r.send(&cmd, IserHeader { write: None, read });
            }
            Step::Raw(m) => r.message(&m),
            Step::Mutated { itt, at, byte } => {
                let cmd = r.command(u32::from(itt), false, 0, 1, Bytes::new());
                let mut m = BytesMut::new();
                let b = r.register(3000, vec![0; 512]);
                iser::encode(
                    &cmd,
                    &IserHeader {
                        write: None,
                        read: Some(b),
                    },
                    &mut m,
                );
                let at = usize::from(at) % m.len();
                m[at] = byte;
                r.message(&m);
            }
            Step::Hello { max, min, ird } => r.message(
                &Hello {
                    max_version: max,
                    min_version: min,
                    ird,
                }
                .encode(),
            ),
            Step::Abort { itt } => {
                let tmf = Pdu::TaskManagementRequest(TaskManagementRequest {
                    immediate: true,
                    function: TaskManagementFunction::AbortTask,
                    lun: Lun::ZERO,
                    initiator_task_tag: 0x8000 + u32::from(itt),
                    referenced_task_tag: u32::from(itt),
                    cmd_sn: SerialNumber(r.cmd_sn),
                    ..TaskManagementRequest::default()
                });
                r.send(&tmf, IserHeader::default());
            }
            Step::HoldReads(h) => r.hold_reads = h,
            Step::CompleteReads(n) => {
                r.complete_reads(usize::from(n));
                r.run();
            }
        }
        if r.closed.is_some() {
            break;
        }
    }
    // Every read done: a read is never lost, and nothing waits on one.
    r.hold_reads = false;
    r.complete_reads(usize::MAX);
    r.run();
    assert_eq!(r.iser.reads_in_flight(), 0);
    assert!(r.reads.is_empty());
});
