//! iSER: the message and CM private-data decoders fed raw bytes, and the target's iSER
//! connection on the rig fed Arbitrary sequences of reads and writes (with and without the
//! buffers their data needs, with immediate data, beyond the registered memory), raw and
//! mutated messages, Hellos, ABORT TASK, and RDMA READs held, done or failed in any order.
//! Nothing panics; a read of memory the initiator never registered closes the connection as
//! a queue pair would; and once every read is done, none is left in flight or waiting. The
//! initiator's datamover (`IserInitiator`) takes the raw bytes and every PDU the target sent as
//! messages from a target, with commands of its own in flight: nothing panics, and no task
//! ends that it did not start.
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

/// The rig's initiator datamover with a write, a read and a command without data in flight.
fn initiator(r: &IserRig, now: std::time::Instant) -> iser::IserInitiator {
    use iscsi_pdu::initiator::Command;
    let mut i = r.initiator();
    let buffer = RemoteBuffer { stag: 7, va: 4096 };
    let write = Command::write(Lun::ZERO, [0x2a; 16], Bytes::from(vec![1u8; 20_000]));
    let read = Command::read(Lun::ZERO, [0x28; 16], 4096);
    let _ = i.start_command(now, &write, Some(buffer), None);
    let _ = i.start_command(now, &read, None, Some(buffer));
    let _ = i.start_command(now, &Command::new(Lun::ZERO, [0; 16]), None, None);
    let mut m = BytesMut::new();
    while i.poll_transmit(&mut m) {}
    i
}

/// Hands `msg` to the initiator as a target's message; what ends must be one of its tasks.
fn to_initiator(i: &mut iser::IserInitiator, now: std::time::Instant, msg: &[u8]) {
    let _ = i.handle_message(now, msg);
    while let Some(e) = i.poll_event() {
        if let iscsi_pdu::initiator::Event::Done { itt, .. } = e {
            assert!((1..=3).contains(&itt), "task {itt} was never started");
        }
    }
    let mut m = BytesMut::new();
    while i.poll_transmit(&mut m) {}
}

fuzz_target!(|input: (Vec<u8>, Vec<Step>)| {
    let (bytes, steps) = input;
    // The decoders alone.
    let _ = iser::decode(&bytes, 8192);
    let _ = CmRequest::decode(&bytes);
    let mut r = IserRig::new();
    let now = r.now;
    let mut initiator = initiator(&r, now);
    to_initiator(&mut initiator, now, &bytes);
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
    // What the target sent, as the initiator's datamover takes it.
    for pdu in r.sent.iter().take(64) {
        let mut m = BytesMut::new();
        iser::encode(pdu, &IserHeader::default(), &mut m);
        to_initiator(&mut initiator, now, &m);
    }
});
