//! The target connection machine after a login (normal or discovery), fed Arbitrary sequences of raw bytes,
//! well-formed PDUs (cut anywhere), clock advances, backend completions and buffer grants. After
//! every step the rig checks the stream the initiator would see: no malformed PDU, StatSN never
//! goes back, no Data-In segment beyond the initiator's MaxRecvDataSegmentLength, no command
//! answered twice, every payload plan inside its buffer. Whatever happens, once the connection
//! drops no task is left in its table.
#![no_main]

use std::time::Duration;

use arbitrary::Arbitrary;
use bytes::{Bytes, BytesMut};
use iscsi_pdu::target_node::testing::{Options, Rig};
use iscsi_pdu::*;
use libfuzzer_sys::fuzz_target;

#[derive(Arbitrary, Debug)]
struct Setup {
    header_digest: bool,
    data_digest: bool,
    initial_r2t: bool,
    immediate_data: bool,
    /// The initiator's MaxRecvDataSegmentLength, in 512-byte units (at least 1).
    max_recv: u8,
    window: u8,
    discovery: bool,
}

#[derive(Arbitrary, Debug)]
enum Cdb {
    TestUnitReady,
    Read { lba: u16, blocks: u8 },
    Write { lba: u16, blocks: u8 },
    Inquiry { page: u8, len: u16 },
    Raw([u8; 16]),
}

#[derive(Arbitrary, Debug)]
enum Message {
    Command {
        cdb: Cdb,
        itt: u8,
        /// Relative to the next CmdSN the rig expects.
        cmd_sn: i8,
        immediate: bool,
        read: bool,
        write: bool,
        edtl: u32,
        immediate_len: u16,
        attribute: u8,
        final_bit: bool,
    },
    DataOut {
        itt: u8,
        ttt: Option<u8>,
        data_sn: u8,
        offset: u32,
        len: u16,
        final_bit: bool,
    },
    Nop {
        itt: Option<u8>,
        ttt: Option<u8>,
        immediate: bool,
        len: u16,
    },
    TaskManagement {
        function: u8,
        itt: u8,
        referenced: u8,
        lun: u8,
    },
    Text {
        data: Vec<u8>,
        continue_bit: bool,
        ttt: Option<u8>,
    },
    Logout {
        reason: u8,
        cid: u16,
    },
    Snack,
}

#[derive(Arbitrary, Debug)]
enum Step {
    /// A PDU, cut in two at `cut` (modulo its length).
    Send {
        message: Message,
        cut: u16,
    },
    Raw(Vec<u8>),
    Advance {
        seconds: u8,
    },
    HoldBackend(bool),
    ReleaseBackend,
    HoldBuffers(bool),
    GrantBuffers,
    /// A handover's park ran out of time: the writes owed data-out are aborted.
    ParkOverdue,
}

fn cdb_bytes(c: &Cdb) -> [u8; 16] {
    let mut b = [0u8; 16];
    match *c {
        Cdb::TestUnitReady => {}
        Cdb::Read { lba, blocks } | Cdb::Write { lba, blocks } => {
            b[0] = if matches!(c, Cdb::Read { .. }) {
                0x28
            } else {
                0x2a
            };
            b[2..6].copy_from_slice(&u32::from(lba % 2048).to_be_bytes());
            b[7..9].copy_from_slice(&u16::from(blocks).to_be_bytes());
        }
        Cdb::Inquiry { page, len } => {
            b[0] = 0x12;
            b[1] = u8::from(page != 0);
            b[2] = page;
            b[3..5].copy_from_slice(&len.to_be_bytes());
        }
        Cdb::Raw(raw) => b = raw,
    }
    b
}

fn tag(t: Option<u8>) -> u32 {
    t.map_or(RESERVED_TAG, u32::from)
}

fn pdu(m: Message, next_cmd_sn: SerialNumber) -> Pdu {
    let cmd_sn = |d: i8| SerialNumber(next_cmd_sn.0.wrapping_add(d as u32));
    let data = |len: u16| Bytes::from(vec![0xa5; usize::from(len) % 16384]);
    match m {
        Message::Command {
            cdb,
            itt,
            cmd_sn: d,
            immediate,
            read,
            write,
            edtl,
            immediate_len,
            attribute,
            final_bit,
        } => Pdu::ScsiCommand(ScsiCommand {
            immediate,
            final_bit,
            read,
            write,
            task_attribute: match attribute % 4 {
                0 => TaskAttribute::Simple,
                1 => TaskAttribute::Ordered,
                2 => TaskAttribute::HeadOfQueue,
                _ => TaskAttribute::Aca,
            },
            initiator_task_tag: u32::from(itt),
            expected_data_transfer_length: edtl % (512 << 10),
            cmd_sn: cmd_sn(d),
            cdb: cdb_bytes(&cdb),
            data: data(immediate_len),
            ..ScsiCommand::default()
        }),
        Message::DataOut {
            itt,
            ttt,
            data_sn,
            offset,
            len,
            final_bit,
        } => Pdu::DataOut(DataOut {
            final_bit,
            initiator_task_tag: u32::from(itt),
            target_transfer_tag: tag(ttt),
            data_sn: u32::from(data_sn),
            buffer_offset: offset % (512 << 10),
            data: data(len),
            ..DataOut::default()
        }),
        Message::Nop {
            itt,
            ttt,
            immediate,
            len,
        } => Pdu::NopOut(NopOut {
            immediate,
            initiator_task_tag: tag(itt),
            target_transfer_tag: tag(ttt),
            cmd_sn: next_cmd_sn,
            data: data(len),
            ..NopOut::default()
        }),
        Message::TaskManagement {
            function,
            itt,
            referenced,
            lun,
        } => Pdu::TaskManagementRequest(TaskManagementRequest {
            immediate: true,
            function: TaskManagementFunction::from(function % 16),
            lun: Lun::from_index(u16::from(lun % 3)),
            initiator_task_tag: 0x1000 + u32::from(itt),
            referenced_task_tag: u32::from(referenced),
            cmd_sn: next_cmd_sn,
            ..TaskManagementRequest::default()
        }),
        Message::Text {
            data,
            continue_bit,
            ttt,
        } => Pdu::TextRequest(TextRequest {
            final_bit: !continue_bit,
            continue_bit,
            initiator_task_tag: 0x2000,
            target_transfer_tag: tag(ttt),
            cmd_sn: next_cmd_sn,
            data: Bytes::from(data),
            ..TextRequest::default()
        }),
        Message::Logout { reason, cid } => Pdu::LogoutRequest(LogoutRequest {
            immediate: true,
            reason: LogoutReason::from(reason % 4),
            initiator_task_tag: 0x3000,
            cid: cid % 4,
            cmd_sn: next_cmd_sn,
            ..LogoutRequest::default()
        }),
        Message::Snack => Pdu::SnackRequest(SnackRequest::default()),
    }
}

fuzz_target!(|input: (Setup, Vec<Step>)| {
    let (setup, steps) = input;
    let yes = |b: bool| if b { "Yes" } else { "No" };
    let crc = |b: bool| if b { "CRC32C" } else { "None" };
    let max_recv = (u32::from(setup.max_recv.max(1)) * 512).to_string();
    let mut options = Options {
        window: u32::from(setup.window % 16) + 1,
        offers: [
            ("HeaderDigest", crc(setup.header_digest)),
            ("DataDigest", crc(setup.data_digest)),
            ("InitialR2T", yes(setup.initial_r2t)),
            ("ImmediateData", yes(setup.immediate_data)),
            ("MaxRecvDataSegmentLength", max_recv.as_str()),
            ("MaxConnections", "2"),
        ]
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect(),
        blocks: 2048,
        ..Options::default()
    };
    options.settings.max_io = 256 << 10;
    if setup.discovery {
        options.settings.session_type = iscsi_pdu::negotiation::SessionType::Discovery;
    }
    let mut rig = Rig::new(options);
    // A second connection in a normal session, which a logout may name.
    let other = (!setup.discovery).then(|| rig.join(2).expect("a connection joins"));
    for step in steps.into_iter().take(128) {
        match step {
            Step::Send { message, cut } => {
                let (next, _) = rig.window();
                let mut wire = BytesMut::new();
                pdu(message, next).encode(rig.digests(), &mut wire);
                let at = usize::from(cut) % (wire.len() + 1);
                rig.receive(&wire[..at]);
                rig.receive(&wire[at..]);
            }
            Step::Raw(bytes) => rig.receive(&bytes),
            Step::Advance { seconds } => rig.advance(Duration::from_secs(u64::from(seconds % 16))),
            Step::HoldBackend(h) => rig.hold_backend = h,
            Step::ReleaseBackend => {
                rig.release_backend();
            }
            Step::HoldBuffers(h) => rig.hold_buffers = h,
            Step::GrantBuffers => rig.grant_buffers(),
            Step::ParkOverdue => {
                rig.abort_awaiting_data_out();
                assert_eq!(
                    rig.abort_awaiting_data_out(),
                    0,
                    "a write aborted twice, or one still owed data"
                );
            }
        }
        // Checks the stream as the initiator reads it.
        let _ = rig.responses();
        if rig.closed().is_some() {
            break;
        }
    }
    // Its session lives on in the other connection: its own tasks end all the same.
    rig.drop_connection();
    assert_eq!(rig.conn().task_count(), 0, "a task outlived its connection");
    if let Some(other) = other {
        rig.shut(other, "dropped");
    }
    for c in &rig.conns {
        assert_eq!(c.conn.task_count(), 0, "a task outlived its connection");
        assert!(c.conn.is_idle());
    }
});
