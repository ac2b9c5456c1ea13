//! The iSER datamover's tests, on the [`IserRig`](super::testing::IserRig).

use bytes::Bytes;

use super::testing::IserRig;
use super::{Hello, HelloReply, IserError, IserHeader};
use crate::{
    Lun, Pdu, RejectReason, Residual, ScsiCommand, ScsiStatus, SerialNumber,
    TaskManagementFunction, TaskManagementRequest,
};

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31) ^ seed)
        .collect()
}

#[test]
fn writes_are_read_by_rdma_and_reads_written_by_rdma() {
    let mut p = IserRig::new();
    // 8 KiB of immediate data, the rest in four R2T bursts of 64 KiB read from the
    // initiator's write buffer.
    let data = pattern(8192 + 4 * 65_536, 1);
    p.write(1, 100, 16, &data, 8192);
    assert_eq!(p.status(1), Some(ScsiStatus::GOOD));
    assert_eq!(p.posted, "RRRRS", "one read per burst, then the status");
    assert_eq!(p.rig.stored(16, (data.len() / 512) as u32), data);
    // The data comes back by RDMA WRITE, then the status in a SCSI Response.
    p.posted.clear();
    p.read(2, 200, 16, (data.len() / 512) as u16);
    assert_eq!(p.posted, "WS", "the data before the status");
    assert_eq!(p.memory[&200], data);
    let Some(Pdu::ScsiResponse(r)) = p.sent.last() else {
        panic!("a SCSI Response");
    };
    assert_eq!((r.status, r.exp_data_sn), (ScsiStatus::GOOD, 0));
    // A write all in immediate data needs no read, nor a write buffer.
    p.posted.clear();
    let small = pattern(4096, 2);
    p.write(3, 300, 0, &small, 4096);
    assert_eq!(p.posted, "S");
    assert_eq!(p.rig.stored(0, 8), small);
    // No R2T and no Data-In ever goes in a Send; StatSN goes up by one per status.
    let mut stat_sn = None;
    for pdu in &p.sent {
        assert!(
            !matches!(pdu, Pdu::ReadyToTransfer(_) | Pdu::DataIn(_)),
            "{pdu:?}"
        );
        if let Pdu::ScsiResponse(r) = pdu {
            if let Some(last) = stat_sn {
                assert_eq!(r.stat_sn, SerialNumber::next(last));
            }
            stat_sn = Some(r.stat_sn);
        }
    }
}

#[test]
fn tasks_read_at_once_each_one_burst_at_a_time() {
    let mut p = IserRig::new();
    p.hold_reads = true;
    let a = pattern(3 * 65_536, 3);
    let b = pattern(2 * 65_536, 4);
    p.write(1, 100, 0, &a, 0);
    p.write(2, 200, 1024, &b, 0);
    // One read of each task in flight; their other bursts wait for them.
    assert_eq!(p.iser.reads_in_flight(), 2);
    assert_eq!(p.reads.len(), 2);
    let tasks: Vec<u32> = p.reads.iter().map(|r| r.0.itt()).collect();
    assert_eq!(tasks, [1, 2]);
    // Each burst read lands at its offset: the write buffer names the first solicited byte.
    for _ in 0..3 {
        p.complete_reads(usize::MAX);
        p.run();
    }
    assert_eq!(p.status(1), Some(ScsiStatus::GOOD));
    assert_eq!(p.status(2), Some(ScsiStatus::GOOD));
    assert_eq!(p.rig.stored(0, (a.len() / 512) as u32), a);
    assert_eq!(p.rig.stored(1024, (b.len() / 512) as u32), b);
}

#[test]
fn a_command_without_the_buffers_its_data_needs_is_rejected() {
    let mut p = IserRig::new();
    // A read with no read buffer.
    let cmd = p.command(1, false, 0, 8, Bytes::new());
    p.send(&cmd, IserHeader::default());
    // A write beyond its immediate data with no write buffer.
    let cmd = p.command(2, true, 0, 16, Bytes::from(vec![0; 4096]));
    p.send(&cmd, IserHeader::default());
    let rejects: Vec<_> = p
        .sent
        .iter()
        .filter_map(|pdu| match pdu {
            Pdu::Reject(r) => Some((r.reason, r.rejected_header()?.initiator_task_tag())),
            _ => None,
        })
        .collect();
    assert_eq!(
        rejects,
        [
            (RejectReason::ProtocolError, 1),
            (RejectReason::ProtocolError, 2)
        ]
    );
    assert!(p.iser.connection().is_idle());
}

#[test]
fn an_abort_while_its_burst_is_read_drops_the_burst() {
    let mut p = IserRig::new();
    p.hold_reads = true;
    let a = pattern(2 * 65_536, 5);
    p.write(7, 100, 0, &a, 0);
    assert_eq!(p.reads.len(), 1);
    let tmf = Pdu::TaskManagementRequest(TaskManagementRequest {
        immediate: true,
        function: TaskManagementFunction::AbortTask,
        lun: Lun::ZERO,
        initiator_task_tag: 8,
        referenced_task_tag: 7,
        cmd_sn: SerialNumber(p.cmd_sn),
        ..TaskManagementRequest::default()
    });
    p.send(&tmf, IserHeader::default());
    // The read completes after the task is gone: its buffer is dropped, nothing is written.
    p.hold_reads = false;
    p.complete_reads(usize::MAX);
    assert!(p.status(7).is_none(), "an aborted task has no status");
    assert!(p
        .sent
        .iter()
        .any(|pdu| matches!(pdu, Pdu::TaskManagementResponse(r) if r.initiator_task_tag == 8)));
    assert!(p.iser.connection().is_idle());
    assert_eq!(p.rig.stored(0, 8), vec![0; 4096]);
}

#[test]
fn a_hello_is_answered_and_a_bad_message_is_an_error() {
    let mut p = IserRig::new();
    let hello = Hello {
        max_version: 10,
        min_version: 10,
        ird: 2,
    };
    p.message(&hello.encode());
    assert_eq!(p.posted, "S");
    let now = p.now;
    let mut nx = p.rig.core(0);
    let e = p.iser.handle_message(now, &[0x10; 30], &mut nx);
    assert!(
        matches!(e, Err(IserError::Short(30)) | Err(IserError::Length { .. })),
        "{e:?}"
    );
    let reply = HelloReply {
        reject: false,
        max_version: 10,
        current_version: 10,
        ord: 1,
    };
    let e = p.iser.handle_message(now, &reply.encode(), &mut nx);
    assert!(matches!(e, Err(IserError::Unexpected(_))));
}

#[test]
fn a_write_announcing_immediate_data_it_does_not_send_is_read_whole() {
    // libiscsi 1.19: DataSegmentLength says 4 KiB, the Send holds the headers only, and the
    // write buffer names the data from its first byte.
    let mut p = IserRig::new();
    let data = pattern(16384, 9);
    let b = p.register(100, data.clone());
    let cmd = p.command(1, true, 0, 32, Bytes::copy_from_slice(&data[..4096]));
    let mut m = bytes::BytesMut::new();
    super::encode(
        &cmd,
        &IserHeader {
            write: Some(b),
            read: None,
        },
        &mut m,
    );
    m.truncate(super::ISER_HEADERS_LEN);
    p.message(&m);
    assert_eq!(p.status(1), Some(ScsiStatus::GOOD));
    assert_eq!(p.rig.stored(0, 32), data);
}

#[test]
fn parameter_data_short_of_the_buffer_is_followed_by_zeros() {
    let mut p = IserRig::new();
    // INQUIRY for 255 bytes into a buffer that holds something else.
    let b = p.register(400, vec![0xee; 300]);
    let mut cdb = [0u8; 16];
    cdb[..6].copy_from_slice(&[0x12, 0, 0, 0, 255, 0]);
    let sn = p.cmd_sn;
    p.cmd_sn += 1;
    let inquiry = Pdu::ScsiCommand(ScsiCommand {
        final_bit: true,
        read: true,
        lun: Lun::ZERO,
        initiator_task_tag: 9,
        expected_data_transfer_length: 255,
        cmd_sn: SerialNumber(sn),
        cdb,
        ..ScsiCommand::default()
    });
    p.send(
        &inquiry,
        IserHeader {
            write: None,
            read: Some(b),
        },
    );
    let Some(Pdu::ScsiResponse(r)) = p.sent.last() else {
        panic!("a SCSI Response");
    };
    let Residual::Underflow(short) = r.residual else {
        panic!("the answer is shorter than 255: {:?}", r.residual);
    };
    let data = 255 - short as usize;
    let m = &p.memory[&400];
    assert_eq!(usize::from(m[4]) + 5, data, "the answer's own length");
    assert!(m[data..255].iter().all(|&x| x == 0), "zeros after it");
    assert!(
        m[255..].iter().all(|&x| x == 0xee),
        "nothing past the buffer"
    );
}

/// Sends what the initiator has to the rig's target, and hands back what the target sent.
fn exchange(p: &mut IserRig, i: &mut super::IserInitiator) {
    let now = p.now;
    loop {
        let mut m = bytes::BytesMut::new();
        if !i.poll_transmit(&mut m) {
            break;
        }
        p.message(&m);
    }
    for pdu in std::mem::take(&mut p.sent) {
        let mut m = bytes::BytesMut::new();
        super::encode(&pdu, &IserHeader::default(), &mut m);
        i.handle_message(now, &m).expect("the target's message");
    }
}

/// The status a task ended with, and its reply's data and residual.
fn done(i: &mut super::IserInitiator, itt: u32) -> (ScsiStatus, Bytes, Residual) {
    use crate::initiator::{Event, Reply};
    while let Some(e) = i.poll_event() {
        if let Event::Done {
            itt: t,
            result: Ok(Reply::Scsi(r)),
        } = e
        {
            if t == itt {
                return (r.status, r.data, r.residual);
            }
        }
    }
    panic!("task {itt} did not end");
}

#[test]
fn the_initiators_datamover_names_its_buffers_past_the_immediate_data() {
    use crate::initiator::Command;
    let mut p = IserRig::new();
    let mut i = p.initiator();
    let now = p.now;
    // 8 KiB go as immediate data; the target reads the rest from the write buffer, whose base
    // offset the datamover moves to the first solicited byte.
    let data = pattern(8192 + 2 * 65_536, 7);
    let write_buf = p.register(10, data.clone());
    let mut cdb = [0u8; 16];
    cdb[0] = 0x2a;
    cdb[2..6].copy_from_slice(&32u32.to_be_bytes());
    cdb[7..9].copy_from_slice(&((data.len() / 512) as u16).to_be_bytes());
    let cmd = Command::write(Lun::ZERO, cdb, Bytes::from(data.clone()));
    let w = i
        .start_command(now, &cmd, Some(write_buf), None)
        .expect("the window is open");
    exchange(&mut p, &mut i);
    assert_eq!(done(&mut i, w).0, ScsiStatus::GOOD);
    assert_eq!(p.posted, "RRS", "two bursts read, then the status");
    assert_eq!(p.rig.stored(32, (data.len() / 512) as u32), data);
    // A read's data is written into the buffer it names; the reply carries none.
    let read_buf = p.register(11, vec![0; data.len()]);
    cdb[0] = 0x28;
    let cmd = Command::read(Lun::ZERO, cdb, data.len() as u32);
    let r = i
        .start_command(now, &cmd, None, Some(read_buf))
        .expect("the window is open");
    exchange(&mut p, &mut i);
    let (status, reply_data, residual) = done(&mut i, r);
    assert_eq!(
        (status, reply_data.len(), residual),
        (ScsiStatus::GOOD, 0, Residual::None)
    );
    assert_eq!(p.memory[&11], data);
    // A write that fits in its immediate data names no write buffer at all.
    let small = pattern(4096, 9);
    cdb[0] = 0x2a;
    cdb[7..9].copy_from_slice(&8u16.to_be_bytes());
    let cmd = Command::write(Lun::ZERO, cdb, Bytes::from(small.clone()));
    p.posted.clear();
    let s = i
        // (a buffer no one registered: naming it would close the connection)
        .start_command(
            now,
            &cmd,
            Some(super::RemoteBuffer { stag: 12, va: 0 }),
            None,
        )
        .expect("the window is open");
    exchange(&mut p, &mut i);
    assert_eq!(done(&mut i, s).0, ScsiStatus::GOOD);
    assert_eq!(p.posted, "S", "no RDMA READ");
    assert_eq!(p.rig.stored(32, 8), small);
    assert_eq!(p.closed, None);
}
