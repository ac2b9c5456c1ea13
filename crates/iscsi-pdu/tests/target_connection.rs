//! The target connection machine on the rig (one in-process device, a virtual clock, bytes cut
//! anywhere): every R2T path, digests and their errors, DataSN gaps, NOP pings and their
//! timeout in virtual time, CmdSN order, task management, text, logout, buffer waits and
//! malformed PDUs. No sockets, no sleeps: each test is deterministic.

use std::time::Duration;

use bytes::{Bytes, BytesMut};
use iscsi_pdu::target_node::testing::{Options, Rig};
use iscsi_pdu::target_node::{Close, SessionError};
use iscsi_pdu::*;
use proptest::prelude::*;

/// The initiator's side of a session: numbering and PDU building.
struct Initiator {
    cmd_sn: SerialNumber,
    itt: u32,
}

impl Initiator {
    fn new() -> Initiator {
        Initiator {
            cmd_sn: SerialNumber(1),
            itt: 0x10,
        }
    }

    fn next_cmd_sn(&mut self) -> SerialNumber {
        let s = self.cmd_sn;
        self.cmd_sn = s.next();
        s
    }

    fn command(&mut self, cdb: &[u8], read: u32, write: u32, data: Bytes) -> ScsiCommand {
        self.itt += 1;
        let mut c = [0; 16];
        c[..cdb.len()].copy_from_slice(cdb);
        ScsiCommand {
            final_bit: true,
            read: read > 0,
            write: write > 0,
            task_attribute: TaskAttribute::Simple,
            initiator_task_tag: self.itt,
            expected_data_transfer_length: read.max(write),
            cmd_sn: self.next_cmd_sn(),
            cdb: c,
            data,
            ..ScsiCommand::default()
        }
    }
}

fn cdb10(op: u8, lba: u32, blocks: u16) -> [u8; 10] {
    let mut c = [0u8; 10];
    c[0] = op;
    c[2..6].copy_from_slice(&lba.to_be_bytes());
    c[7..9].copy_from_slice(&blocks.to_be_bytes());
    c
}

fn pattern(len: usize, seed: u8) -> Bytes {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect()
}

/// A rig whose power-on unit attention has been cleared.
fn rig(options: Options) -> (Rig, Initiator) {
    let mut rig = Rig::new(options);
    let mut i = Initiator::new();
    let tur = i.command(&[0; 6], 0, 0, Bytes::new());
    rig.send(&Pdu::ScsiCommand(tur));
    let r = rig.responses();
    assert!(matches!(&r[..], [Pdu::ScsiResponse(s)] if s.status == ScsiStatus::CHECK_CONDITION));
    (rig, i)
}

fn offers(pairs: &[(&str, &str)]) -> Options {
    Options {
        offers: pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect(),
        ..Options::default()
    }
}

/// Reads `blocks` at `lba` through the connection and returns the data (and checks GOOD).
fn read(rig: &mut Rig, i: &mut Initiator, lba: u32, blocks: u16) -> Bytes {
    let len = u32::from(blocks) * 512;
    let cmd = i.command(&cdb10(0x28, lba, blocks), len, 0, Bytes::new());
    let itt = cmd.initiator_task_tag;
    rig.send(&Pdu::ScsiCommand(cmd));
    let mut data = BytesMut::new();
    let mut done = false;
    for p in rig.responses() {
        match p {
            Pdu::DataIn(d) if d.initiator_task_tag == itt => {
                assert_eq!(d.buffer_offset as usize, data.len(), "in order");
                data.extend_from_slice(&d.data);
                if let Some(st) = d.status {
                    assert_eq!(st.status, ScsiStatus::GOOD);
                    done = true;
                }
            }
            other => panic!("unexpected {other:?}"),
        }
    }
    assert!(
        done,
        "the read ended with its status collapsed into the last Data-In"
    );
    data.freeze()
}

/// Writes `data` at `lba` as an initiator would under the negotiated parameters: immediate
/// data and unsolicited Data-Out up to FirstBurstLength, the rest as R2Ts ask. Returns the
/// R2Ts seen.
fn write(rig: &mut Rig, i: &mut Initiator, lba: u32, data: &Bytes, op: (bool, bool, u32)) -> usize {
    let (immediate_data, initial_r2t, first_burst) = op;
    let len = data.len() as u32;
    let blocks = (len / 512) as u16;
    let first = if initial_r2t { 0 } else { first_burst.min(len) };
    let immediate = if immediate_data { first.min(8192) } else { 0 };
    let mut cmd = i.command(
        &cdb10(0x2a, lba, blocks),
        0,
        len,
        data.slice(..immediate as usize),
    );
    cmd.final_bit = immediate >= first;
    let itt = cmd.initiator_task_tag;
    rig.send(&Pdu::ScsiCommand(cmd));
    // Unsolicited Data-Out.
    let mut at = immediate;
    let mut sn = 0;
    while at < first {
        let n = (first - at).min(4096);
        rig.send(&Pdu::DataOut(DataOut {
            final_bit: at + n == first,
            initiator_task_tag: itt,
            target_transfer_tag: RESERVED_TAG,
            data_sn: sn,
            buffer_offset: at,
            data: data.slice(at as usize..(at + n) as usize),
            ..DataOut::default()
        }));
        at += n;
        sn += 1;
    }
    let mut r2ts = 0;
    loop {
        let responses = rig.responses();
        assert!(!responses.is_empty(), "the write stalled");
        let mut finished = false;
        for p in responses {
            match p {
                Pdu::ReadyToTransfer(r) => {
                    r2ts += 1;
                    let mut off = r.buffer_offset;
                    let end = off + r.desired_data_transfer_length;
                    let mut sn = 0;
                    while off < end {
                        let n = (end - off).min(8192);
                        rig.send(&Pdu::DataOut(DataOut {
                            final_bit: off + n == end,
                            initiator_task_tag: itt,
                            target_transfer_tag: r.target_transfer_tag,
                            data_sn: sn,
                            buffer_offset: off,
                            data: data.slice(off as usize..(off + n) as usize),
                            ..DataOut::default()
                        }));
                        off += n;
                        sn += 1;
                    }
                }
                Pdu::ScsiResponse(s) => {
                    assert_eq!(s.initiator_task_tag, itt);
                    assert_eq!(s.status, ScsiStatus::GOOD, "{s:?}");
                    finished = true;
                }
                other => panic!("unexpected {other:?}"),
            }
        }
        if finished {
            return r2ts;
        }
    }
}

/// With tracing on, each command's stages come out in the order they happened: a read
/// through the core, its buffer and its backend operation to its response, a write (its
/// buffer came with its header) through its R2Ts and data-out; with tracing off, none.
#[test]
fn traced_commands_show_every_stage_in_order() {
    use cmdtrace::Stage;
    let (mut rig, mut i) = rig(offers(&[("InitialR2T", "Yes"), ("ImmediateData", "No")]));
    rig.conn_mut().trace_points().set(true);
    read(&mut rig, &mut i, 0, 8);
    let read_itt = i.itt;
    write(&mut rig, &mut i, 16, &pattern(8192, 1), (false, true, 0));
    let write_itt = i.itt;
    let mut points = Vec::new();
    while let Some(p) = rig.conn_mut().trace_points().poll() {
        points.push(p);
    }
    let stages = |itt: u32| -> Vec<Stage> {
        points
            .iter()
            .filter(|p| p.itt == itt)
            .map(|p| p.stage)
            .collect()
    };
    assert_eq!(
        stages(read_itt),
        [
            Stage::Received,
            Stage::Delivered,
            Stage::Dispatched,
            Stage::BufferWait,
            Stage::BackendSubmit,
            Stage::BackendDone,
            Stage::Responded
        ]
    );
    assert_eq!(
        stages(write_itt),
        [
            Stage::Received,
            Stage::Delivered,
            Stage::Dispatched,
            Stage::R2tSent,
            Stage::DataOutDone,
            Stage::BackendSubmit,
            Stage::BackendDone,
            Stage::Responded
        ]
    );
    let received = points.iter().find(|p| p.itt == write_itt).expect("a point");
    assert_eq!(received.arg, 8192, "the expected data length");
    assert!(
        points.windows(2).all(|w| w[0].at <= w[1].at),
        "in time order"
    );
    rig.conn_mut().trace_points().set(false);
    read(&mut rig, &mut i, 0, 8);
    assert!(
        rig.conn_mut().trace_points().poll().is_none(),
        "off: nothing"
    );
}

#[test]
fn writes_and_reads_through_every_r2t_path() {
    for (immediate, initial) in [(true, false), (true, true), (false, false), (false, true)] {
        let yes = |b: bool| if b { "Yes" } else { "No" };
        let o = offers(&[
            ("ImmediateData", yes(immediate)),
            ("InitialR2T", yes(initial)),
            ("FirstBurstLength", "16384"),
            ("MaxBurstLength", "32768"),
        ]);
        let (mut rig, mut i) = rig(o);
        for (lba, len) in [(0u32, 512usize), (8, 16384), (100, 128 << 10)] {
            let data = pattern(len, lba as u8);
            let r2ts = write(&mut rig, &mut i, lba, &data, (immediate, initial, 16384));
            let solicited = if initial {
                len
            } else {
                len.saturating_sub(16384)
            };
            assert_eq!(
                r2ts,
                solicited.div_ceil(32768),
                "R2Ts at most MaxBurstLength each"
            );
            assert_eq!(rig.stored(u64::from(lba), (len / 512) as u32), data);
            assert_eq!(read(&mut rig, &mut i, lba, (len / 512) as u16), data);
        }
        assert_eq!(rig.conn().task_count(), 0);
    }
}

#[test]
fn data_in_is_cut_at_the_initiators_segment_length_and_collapses_the_status() {
    let (mut rig, mut i) = rig(offers(&[("MaxRecvDataSegmentLength", "4096")]));
    let data = pattern(64 << 10, 3);
    write(&mut rig, &mut i, 0, &data, (true, false, 65536));
    let cmd = i.command(&cdb10(0x28, 0, 128), 64 << 10, 0, Bytes::new());
    rig.send(&Pdu::ScsiCommand(cmd));
    let r = rig.responses();
    assert_eq!(r.len(), 16, "64 KiB in 4 KiB segments");
    for (n, p) in r.iter().enumerate() {
        let Pdu::DataIn(d) = p else { panic!("{p:?}") };
        assert_eq!(d.data_sn, n as u32);
        assert_eq!(d.data.len(), 4096);
        assert_eq!(d.status.is_some(), n == 15, "status in the last only");
    }
}

#[test]
fn a_write_fed_one_byte_at_a_time_lands_whole() {
    let (mut rig, mut i) = rig(offers(&[
        ("HeaderDigest", "CRC32C"),
        ("DataDigest", "CRC32C"),
    ]));
    let data = pattern(8192, 9);
    let cmd = i.command(&cdb10(0x2a, 7, 16), 0, 8192, data.clone());
    let mut wire = BytesMut::new();
    Pdu::ScsiCommand(cmd).encode(rig.digests(), &mut wire);
    for b in wire.iter() {
        rig.receive(&[*b]);
    }
    let r = rig.responses();
    assert!(
        matches!(&r[..], [Pdu::ScsiResponse(s)] if s.status == ScsiStatus::GOOD),
        "{r:?}"
    );
    assert_eq!(rig.stored(7, 16), data);
}

#[test]
fn a_data_digest_error_rejects_the_pdu_and_ends_its_task() {
    let (mut rig, mut i) = rig(offers(&[
        ("DataDigest", "CRC32C"),
        ("InitialR2T", "Yes"),
        ("ImmediateData", "No"),
    ]));
    let cmd = i.command(&cdb10(0x2a, 0, 8), 0, 4096, Bytes::new());
    let itt = cmd.initiator_task_tag;
    rig.send(&Pdu::ScsiCommand(cmd));
    let Pdu::ReadyToTransfer(r2t) = &rig.responses()[0] else {
        panic!("an R2T")
    };
    let mut wire = BytesMut::new();
    let d = DataOut {
        final_bit: true,
        initiator_task_tag: itt,
        target_transfer_tag: r2t.target_transfer_tag,
        data: pattern(4096, 1),
        ..DataOut::default()
    };
    Pdu::DataOut(d).encode(rig.digests(), &mut wire);
    let last = wire.len() - 1;
    wire[last] ^= 0xff;
    rig.receive(&wire);
    let r = rig.responses();
    assert!(
        matches!(&r[0], Pdu::Reject(j) if j.reason == RejectReason::DataDigestError),
        "{r:?}"
    );
    let Pdu::ScsiResponse(s) = &r[1] else {
        panic!("{r:?}")
    };
    assert_eq!(s.status, ScsiStatus::CHECK_CONDITION);
    let sense = s.sense().expect("sense");
    assert_eq!((sense[2] & 0x0f, sense[12], sense[13]), (0x0b, 0x47, 0x05));
    assert_eq!(
        rig.stored(0, 8),
        Bytes::from(vec![0; 4096]),
        "nothing written"
    );
    // The session goes on.
    assert_eq!(read(&mut rig, &mut i, 0, 1).len(), 512);
}

#[test]
fn a_header_digest_error_closes_the_connection() {
    let (mut rig, mut i) = rig(offers(&[("HeaderDigest", "CRC32C")]));
    let mut wire = BytesMut::new();
    Pdu::ScsiCommand(i.command(&[0; 6], 0, 0, Bytes::new())).encode(rig.digests(), &mut wire);
    wire[50] ^= 1;
    rig.receive(&wire);
    assert!(
        rig.closed().is_some_and(|w| w.contains("digest")),
        "{:?}",
        rig.closed()
    );
}

#[test]
fn a_data_sn_gap_ends_the_task_with_aborted_command() {
    let (mut rig, mut i) = rig(offers(&[("InitialR2T", "No"), ("ImmediateData", "No")]));
    let cmd = i.command(&cdb10(0x2a, 0, 16), 0, 8192, Bytes::new());
    let itt = cmd.initiator_task_tag;
    rig.send(&Pdu::ScsiCommand(cmd));
    for (sn, off) in [(0, 0), (2, 4096)] {
        rig.send(&Pdu::DataOut(DataOut {
            final_bit: off == 4096,
            initiator_task_tag: itt,
            target_transfer_tag: RESERVED_TAG,
            data_sn: sn,
            buffer_offset: off,
            data: pattern(4096, 0),
            ..DataOut::default()
        }));
    }
    let r = rig.responses();
    assert!(
        matches!(&r[0], Pdu::Reject(j) if j.reason == RejectReason::ProtocolError),
        "{r:?}"
    );
    let Pdu::ScsiResponse(s) = &r[1] else {
        panic!("{r:?}")
    };
    let sense = s.sense().expect("sense");
    assert_eq!((sense[2] & 0x0f, sense[12]), (0x0b, 0x4b));
    assert_eq!(rig.conn().task_count(), 0);
}

#[test]
fn an_idle_initiator_is_pinged_and_dropped_when_it_does_not_answer() {
    let (mut rig, _) = rig(Options::default());
    rig.advance(Duration::from_secs(4));
    assert!(rig.responses().is_empty(), "not idle long enough");
    rig.advance(Duration::from_secs(1));
    let r = rig.responses();
    let Pdu::NopIn(ping) = &r[0] else {
        panic!("{r:?}")
    };
    assert_eq!(ping.initiator_task_tag, RESERVED_TAG);
    // Answered: the connection lives on and pings again after the next idle interval.
    rig.send(&Pdu::NopOut(NopOut {
        immediate: true,
        initiator_task_tag: RESERVED_TAG,
        target_transfer_tag: ping.target_transfer_tag,
        ..NopOut::default()
    }));
    rig.advance(Duration::from_secs(5));
    assert!(matches!(&rig.responses()[..], [Pdu::NopIn(_)]));
    assert_eq!(rig.conn().closing(), None);
    // Not answered: dropped once the timeout passes.
    rig.advance(Duration::from_secs(4));
    assert_eq!(rig.conn().closing(), None);
    rig.advance(Duration::from_secs(1));
    assert_eq!(rig.conn().closing(), Some(Close::NoPingAnswer));
}

#[test]
fn commands_run_in_cmd_sn_order_and_outside_the_window_are_dropped() {
    let (mut rig, mut i) = rig(Options {
        window: 4,
        ..Options::default()
    });
    let data = pattern(512, 5);
    let w = i.command(&cdb10(0x2a, 3, 1), 0, 512, data.clone());
    let mut r = i.command(&cdb10(0x28, 3, 1), 512, 0, Bytes::new());
    // ORDERED: the core may not run it before the write (SIMPLE tasks may pass each other).
    r.task_attribute = TaskAttribute::Ordered;
    // The read arrives first but waits for the write's CmdSN.
    rig.send(&Pdu::ScsiCommand(r.clone()));
    assert!(rig.responses().is_empty());
    rig.send(&Pdu::ScsiCommand(w));
    let out = rig.responses();
    assert!(
        matches!(&out[0], Pdu::ScsiResponse(s) if s.status == ScsiStatus::GOOD),
        "{out:?}"
    );
    let Pdu::DataIn(d) = &out[1] else {
        panic!("{out:?}")
    };
    assert_eq!(d.data, data, "the read saw the write");
    // Beyond MaxCmdSN: dropped without an answer, its tag free again.
    let mut far = i.command(&[0; 6], 0, 0, Bytes::new());
    far.cmd_sn = far.cmd_sn + 10;
    rig.send(&Pdu::ScsiCommand(far));
    assert!(rig.responses().is_empty());
    assert_eq!(rig.conn().task_count(), 0);
}

/// Sends a WRITE of `blocks` at `lba` without data, which must be answered by one R2T alone
/// (InitialR2T=Yes): its ITT and that R2T.
fn write_to_its_r2t(
    rig: &mut Rig,
    i: &mut Initiator,
    lba: u32,
    blocks: u16,
) -> (u32, ReadyToTransfer) {
    let w = i.command(
        &cdb10(0x2a, lba, blocks),
        0,
        u32::from(blocks) * 512,
        Bytes::new(),
    );
    let itt = w.initiator_task_tag;
    rig.send(&Pdu::ScsiCommand(w));
    let mut r = rig.responses();
    match r.pop() {
        Some(Pdu::ReadyToTransfer(r2t)) if r.is_empty() => (itt, r2t),
        other => panic!("an R2T alone: {r:?} {other:?}"),
    }
}

/// With no room for write buffers, a write is turned away with TASK SET FULL (its immediate
/// data skipped, its CmdSN taken) while another write's buffer waits for data-out: that data
/// comes behind it on the wire, so waiting could never end. With nothing waiting for data-out
/// the connection may wait, and does.
#[test]
fn a_write_is_turned_away_while_another_waits_for_its_data_out() {
    let (mut rig, mut i) = rig(offers(&[("InitialR2T", "Yes")]));
    rig.short_of_write_buffers = true;
    let data = pattern(8192, 5);
    // A: nothing waits for data-out yet, so its buffer is waited for; its R2T goes out.
    let (a_itt, r2t) = write_to_its_r2t(&mut rig, &mut i, 0, 16);
    assert!(
        !rig.conn().may_wait_for_buffer(),
        "A's buffer waits for data-out"
    );
    // B, with immediate data: turned away at once, in its CmdSN turn.
    let b = i.command(&cdb10(0x2a, 64, 1), 0, 512, pattern(512, 6));
    let b_itt = b.initiator_task_tag;
    rig.send(&Pdu::ScsiCommand(b));
    let r = rig.responses();
    match &r[..] {
        [Pdu::ScsiResponse(s)] => {
            assert_eq!(s.initiator_task_tag, b_itt);
            assert_eq!(s.status, ScsiStatus::TASK_SET_FULL);
            assert!(s.data.is_empty(), "no sense with TASK SET FULL");
        }
        other => panic!("TASK SET FULL for B: {other:?}"),
    }
    assert_eq!(rig.window().0, i.cmd_sn, "B took its CmdSN");
    // A's data lands and A ends GOOD; B wrote nothing.
    rig.send(&Pdu::DataOut(DataOut {
        final_bit: true,
        initiator_task_tag: a_itt,
        target_transfer_tag: r2t.target_transfer_tag,
        buffer_offset: 0,
        data: data.clone(),
        ..DataOut::default()
    }));
    let r = rig.responses();
    let good = |p: &Pdu| {
        matches!(p, Pdu::ScsiResponse(s)
            if s.initiator_task_tag == a_itt && s.status == ScsiStatus::GOOD)
    };
    assert!(r.len() == 1 && good(&r[0]), "{r:?}");
    assert!(rig.conn().may_wait_for_buffer());
    assert_eq!(read(&mut rig, &mut i, 0, 16), data);
    assert_eq!(read(&mut rig, &mut i, 64, 1), Bytes::from(vec![0u8; 512]));
    // Sent again with nothing waiting, B goes through.
    let again = pattern(512, 6);
    write(&mut rig, &mut i, 64, &again, (true, true, 0));
    assert_eq!(read(&mut rig, &mut i, 64, 1), again);
}

/// An initiator that owes data-out (here an R2T's) and sends none for the data-out timeout is
/// dropped; data in time starts the clock again, and one that owes nothing is never dropped,
/// however long it idles.
#[test]
fn an_initiator_that_owes_data_out_is_dropped_after_the_data_out_timeout() {
    let mut o = offers(&[("InitialR2T", "Yes")]);
    o.settings.nop_interval = Duration::ZERO;
    o.settings.data_out_timeout = Duration::from_secs(10);
    let (mut rig, mut i) = rig(o);
    rig.advance(Duration::from_secs(25));
    assert_eq!(rig.conn().closing(), None, "nothing owed");
    let (itt, r2t) = write_to_its_r2t(&mut rig, &mut i, 0, 32);
    let data = pattern(16384, 9);
    let half = Pdu::DataOut(DataOut {
        initiator_task_tag: itt,
        target_transfer_tag: r2t.target_transfer_tag,
        data: data.slice(..8192),
        ..DataOut::default()
    });
    rig.advance(Duration::from_secs(9));
    assert_eq!(rig.conn().closing(), None);
    rig.send(&half);
    rig.advance(Duration::from_secs(9));
    assert_eq!(
        rig.conn().closing(),
        None,
        "the clock started again with the data"
    );
    rig.advance(Duration::from_secs(1));
    assert_eq!(rig.conn().closing(), Some(Close::DataOutTimeout));
    // The same, answered in time: the write ends GOOD and nothing is owed any more.
    let (mut rig, mut i) = self::rig(Options {
        settings: iscsi_pdu::target_node::Settings {
            nop_interval: Duration::ZERO,
            data_out_timeout: Duration::from_secs(10),
            ..Options::default().settings
        },
        ..offers(&[("InitialR2T", "Yes")])
    });
    write(&mut rig, &mut i, 0, &data, (false, true, 0));
    rig.advance(Duration::from_secs(60));
    assert_eq!(rig.conn().closing(), None);
}

/// A handover's park that runs out of time aborts the writes still waiting for data-out:
/// each ends with TASK ABORTED (which initiators retry), a write whose data is all in and a
/// read in the backend are left to end as they do, nothing then waits for the initiator and
/// the connection is quiescent; the aborted write's Data-Out arriving late is discarded
/// without a Reject, and the write sent again lands.
#[test]
fn a_park_that_runs_out_of_time_aborts_the_writes_owed_data() {
    use iscsi_pdu::target_node::Busy;

    let (mut rig, mut i) = rig(offers(&[("InitialR2T", "Yes"), ("ImmediateData", "No")]));
    let data = pattern(8192, 11);
    let (owed, r2t) = write_to_its_r2t(&mut rig, &mut i, 0, 16);
    // A read whose operation is in the backend.
    rig.hold_backend = true;
    let cmd = i.command(&cdb10(0x28, 100, 8), 4096, 0, Bytes::new());
    let read_itt = cmd.initiator_task_tag;
    rig.send(&Pdu::ScsiCommand(cmd));
    assert!(rig.conn().awaits_initiator());
    assert_eq!(
        rig.abort_awaiting_data_out(),
        1,
        "the write owed data alone"
    );
    assert_eq!(
        rig.abort_awaiting_data_out(),
        0,
        "asked again: already aborted"
    );
    let r = rig.responses();
    assert_eq!(status_of(&r, owed), Some(ScsiStatus::TASK_ABORTED), "{r:?}");
    assert_eq!(r.len(), 1, "{r:?}");
    assert!(!rig.conn().awaits_initiator());
    assert_eq!(rig.conn().handover(), Err(Busy::Tasks), "the read runs");
    rig.hold_backend = false;
    assert!(rig.release_backend());
    assert_eq!(
        status_of(&rig.responses(), read_itt),
        Some(ScsiStatus::GOOD)
    );
    assert!(rig.conn().handover().is_ok(), "quiescent");
    // The initiator had sent the data before it saw the status: dropped without a word.
    rig.send(&Pdu::DataOut(DataOut {
        final_bit: true,
        initiator_task_tag: owed,
        target_transfer_tag: r2t.target_transfer_tag,
        data: data.clone(),
        ..DataOut::default()
    }));
    assert_eq!(rig.responses(), Vec::<Pdu>::new());
    assert_eq!(rig.closed(), None);
    assert_eq!(read(&mut rig, &mut i, 0, 16), Bytes::from(vec![0u8; 8192]));
    // Its retry lands.
    write(&mut rig, &mut i, 0, &data, (false, true, 0));
    assert_eq!(read(&mut rig, &mut i, 0, 16), data);
}

#[test]
fn abort_task_and_lun_reset() {
    let (mut rig, mut i) = rig(Options::default());
    rig.hold_backend = true;
    let cmd = i.command(&cdb10(0x28, 0, 8), 4096, 0, Bytes::new());
    let itt = cmd.initiator_task_tag;
    rig.send(&Pdu::ScsiCommand(cmd));
    assert_eq!(rig.held.len(), 1);
    rig.send(&Pdu::TaskManagementRequest(TaskManagementRequest {
        immediate: true,
        function: TaskManagementFunction::AbortTask,
        initiator_task_tag: 0x999,
        referenced_task_tag: itt,
        cmd_sn: i.cmd_sn,
        ..TaskManagementRequest::default()
    }));
    // The abort waits for the backend operation in flight.
    rig.release_backend();
    let r = rig.responses();
    assert!(
        matches!(&r[..], [Pdu::TaskManagementResponse(t)] if t.response == TmfResponse::FunctionComplete && t.initiator_task_tag == 0x999),
        "the aborted read is not answered: {r:?}"
    );
    assert_eq!(rig.conn().task_count(), 0);
    rig.hold_backend = false;
    rig.send(&Pdu::TaskManagementRequest(TaskManagementRequest {
        immediate: true,
        function: TaskManagementFunction::LogicalUnitReset,
        initiator_task_tag: 0x99a,
        ..TaskManagementRequest::default()
    }));
    let r = rig.responses();
    assert!(
        matches!(&r[..], [Pdu::TaskManagementResponse(t)] if t.response == TmfResponse::FunctionComplete),
        "{r:?}"
    );
}

#[test]
fn reads_wait_for_buffers_in_order() {
    let (mut rig, mut i) = rig(Options::default());
    rig.hold_buffers = true;
    let a = i.command(&cdb10(0x28, 0, 8), 4096, 0, Bytes::new());
    let b = i.command(&cdb10(0x28, 8, 8), 4096, 0, Bytes::new());
    rig.send(&Pdu::ScsiCommand(a));
    rig.send(&Pdu::ScsiCommand(b));
    assert!(rig.responses().is_empty(), "both wait for a buffer");
    rig.grant_buffers();
    let r = rig.responses();
    let tags: Vec<u32> = r
        .iter()
        .map(|p| match p {
            Pdu::DataIn(d) => d.initiator_task_tag,
            other => panic!("{other:?}"),
        })
        .collect();
    assert_eq!(tags, [0x12, 0x13]);
}

#[test]
fn malformed_and_misplaced_pdus_are_rejected_and_the_session_goes_on() {
    let (mut rig, mut i) = rig(Options::default());
    // A reused tag while its task runs.
    rig.hold_backend = true;
    let cmd = i.command(&cdb10(0x28, 0, 1), 512, 0, Bytes::new());
    let mut dup = cmd.clone();
    dup.cmd_sn = i.next_cmd_sn();
    rig.send(&Pdu::ScsiCommand(cmd));
    rig.send(&Pdu::ScsiCommand(dup.clone()));
    let r = rig.responses();
    assert!(
        matches!(&r[..], [Pdu::Reject(j)] if j.reason == RejectReason::TaskInProgress),
        "{r:?}"
    );
    // A rejected command does not take its CmdSN: the initiator's next command carries it.
    i.cmd_sn = dup.cmd_sn;
    rig.hold_backend = false;
    rig.release_backend();
    assert_eq!(rig.responses().len(), 1);
    // Immediate data on a read.
    let bad = i.command(&cdb10(0x28, 0, 1), 512, 0, pattern(512, 0));
    rig.send(&Pdu::ScsiCommand(bad.clone()));
    assert!(
        matches!(&rig.responses()[..], [Pdu::Reject(j)] if j.reason == RejectReason::ProtocolError)
    );
    i.cmd_sn = bad.cmd_sn;
    // A Data-Out beyond the expected length.
    let cmd = i.command(&cdb10(0x2a, 0, 1), 0, 512, Bytes::new());
    let itt = cmd.initiator_task_tag;
    rig.send(&Pdu::ScsiCommand(cmd));
    rig.send(&Pdu::DataOut(DataOut {
        final_bit: true,
        initiator_task_tag: itt,
        target_transfer_tag: RESERVED_TAG,
        buffer_offset: 512,
        data: pattern(512, 0),
        ..DataOut::default()
    }));
    let r = rig.responses();
    assert!(
        matches!(&r[..], [Pdu::ReadyToTransfer(_), Pdu::Reject(_)]),
        "an R2T for the write (InitialR2T=Yes), a Reject for the Data-Out: {r:?}"
    );
    // A SNACK (ErrorRecoveryLevel 0) and a login request in full feature phase.
    rig.send(&Pdu::SnackRequest(SnackRequest::default()));
    assert!(
        matches!(&rig.responses()[..], [Pdu::Reject(j)] if j.reason == RejectReason::SnackReject)
    );
    // An unknown opcode.
    let mut raw = [0u8; 48];
    raw[0] = 0x1f;
    rig.receive(&raw);
    assert!(matches!(&rig.responses()[..], [Pdu::Reject(_)]));
    // Data-Out for a task that does not exist: dropped.
    rig.send(&Pdu::DataOut(DataOut {
        initiator_task_tag: 0xdead,
        data: pattern(512, 0),
        ..DataOut::default()
    }));
    assert!(rig.responses().is_empty());
    assert_eq!(rig.closed(), None);
    let fresh = i.command(&[0; 6], 0, 0, Bytes::new());
    rig.send(&Pdu::ScsiCommand(fresh));
    let r = rig.responses();
    assert!(
        matches!(&r[..], [Pdu::ScsiResponse(s)] if s.status == ScsiStatus::GOOD),
        "{r:?}"
    );
}

#[test]
fn text_send_targets_and_logout() {
    let (mut rig, mut i) = rig(offers(&[("MaxConnections", "4")]));
    rig.send(&text_request(
        0x50,
        i.next_cmd_sn(),
        Bytes::from_static(b"SendTargets=All\0"),
    ));
    let r = rig.responses();
    let Pdu::TextResponse(t) = &r[0] else {
        panic!("{r:?}")
    };
    assert!(t
        .data
        .starts_with(b"TargetName=iqn.2026-11.io.example:rig\0"));
    // Two more connections in the session: CIDs 2 and 3 (the first is CID 1).
    let two = rig.join(2).expect("joins");
    let three = rig.join(3).expect("joins");
    for (cid, code) in [
        (7, LogoutResponseCode::CidNotFound),
        (2, LogoutResponseCode::ClosedSuccessfully),
    ] {
        rig.send(&Pdu::LogoutRequest(LogoutRequest {
            reason: LogoutReason::CloseConnection,
            initiator_task_tag: 0x60 + u32::from(cid),
            cid,
            cmd_sn: i.next_cmd_sn(),
            ..LogoutRequest::default()
        }));
        assert!(matches!(&rig.responses()[..], [Pdu::LogoutResponse(l)] if l.response == code));
    }
    assert!(
        rig.conns[two].closed.is_some(),
        "the connection named closes"
    );
    assert_eq!(rig.conns[three].closed, None);
    assert_eq!(rig.conn().closing(), None);
    rig.send(&Pdu::LogoutRequest(LogoutRequest {
        reason: LogoutReason::CloseSession,
        initiator_task_tag: 0x70,
        cmd_sn: i.next_cmd_sn(),
        ..LogoutRequest::default()
    }));
    assert!(matches!(&rig.responses()[..], [Pdu::LogoutResponse(_)]));
    assert_eq!(rig.conn().closing(), Some(Close::AfterFlush));
    assert!(
        rig.conns[three].closed.is_some(),
        "the session's other connections close"
    );
}

#[test]
fn a_discovery_session_takes_only_text_nop_and_logout() {
    let mut o = Options::default();
    o.settings.session_type = iscsi_pdu::negotiation::SessionType::Discovery;
    let mut rig = Rig::new(o);
    let mut i = Initiator::new();
    // A SCSI command, with data and without, and task management: rejected, nothing runs.
    for data in [Bytes::new(), pattern(512, 1)] {
        let cmd = i.command(&cdb10(0x2a, 0, 1), 0, 512, data);
        rig.send(&Pdu::ScsiCommand(cmd));
        let r = rig.responses();
        assert!(
            matches!(&r[..], [Pdu::Reject(j)] if j.reason == RejectReason::ProtocolError),
            "{r:?}"
        );
    }
    rig.send(&Pdu::TaskManagementRequest(TaskManagementRequest {
        immediate: true,
        function: TaskManagementFunction::LogicalUnitReset,
        ..TaskManagementRequest::default()
    }));
    assert!(matches!(&rig.responses()[..], [Pdu::Reject(_)]));
    assert_eq!(rig.conn().task_count(), 0);
    i.cmd_sn = SerialNumber(1);
    rig.send(&text_request(
        0x50,
        i.next_cmd_sn(),
        Bytes::from_static(b"SendTargets=All\0"),
    ));
    assert!(
        matches!(&rig.responses()[..], [Pdu::TextResponse(t)] if t.data.starts_with(b"TargetName="))
    );
    // Never pinged, however long it idles.
    rig.advance(Duration::from_secs(3600));
    assert!(rig.responses().is_empty());
    // Any logout ends it.
    rig.send(&Pdu::LogoutRequest(LogoutRequest {
        reason: LogoutReason::CloseConnection,
        cid: 9,
        cmd_sn: i.next_cmd_sn(),
        ..LogoutRequest::default()
    }));
    let r = rig.responses();
    assert!(
        matches!(&r[..], [Pdu::LogoutResponse(l)] if l.response == LogoutResponseCode::ClosedSuccessfully),
        "{r:?}"
    );
    assert_eq!(rig.conn().closing(), Some(Close::AfterFlush));
}

#[test]
fn a_stopping_daemon_asks_for_a_logout_once() {
    let (mut rig, _) = rig(Options::default());
    rig.ask_logout();
    rig.ask_logout();
    let r = rig.responses();
    assert!(
        matches!(&r[..], [Pdu::AsyncMessage(m)] if m.event == AsyncEvent::LogoutRequested),
        "{r:?}"
    );
}

#[test]
fn a_dropped_connection_leaves_no_task_behind() {
    let (mut rig, mut i) = rig(offers(&[("InitialR2T", "Yes")]));
    rig.hold_backend = true;
    rig.send(&Pdu::ScsiCommand(i.command(
        &cdb10(0x28, 0, 8),
        4096,
        0,
        Bytes::new(),
    )));
    rig.send(&Pdu::ScsiCommand(i.command(
        &cdb10(0x2a, 0, 8),
        0,
        4096,
        Bytes::new(),
    )));
    assert_eq!(rig.conn().task_count(), 2);
    rig.drop_connection();
    assert_eq!(rig.conn().task_count(), 0);
    assert!(rig.conn().is_idle());
}

#[test]
fn a_command_waiting_behind_a_gap_is_forgotten_when_the_connection_drops() {
    // Found by the iscsi_connection fuzz target: the command never reached the core, so
    // closing the nexus did not end it, and it stayed in the table (and, with more connections
    // in the session, would have reached the core later with no connection to answer it).
    let (mut rig, mut i) = rig(Options::default());
    let mut cmd = i.command(&[0; 6], 0, 0, Bytes::new());
    cmd.cmd_sn = cmd.cmd_sn + 1;
    rig.send(&Pdu::ScsiCommand(cmd));
    assert_eq!(rig.conn().task_count(), 1);
    rig.drop_connection();
    assert_eq!(rig.conn().task_count(), 0);
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    /// A write and a read, their bytes cut into pieces anywhere, with or without digests.
    #[test]
    fn any_cut_of_the_stream_gives_the_same_result(
        cuts in proptest::collection::vec(1usize..700, 1..40),
        digests in any::<bool>(),
        seed in any::<u8>(),
    ) {
        let yes = if digests { "CRC32C" } else { "None" };
        let (mut rig, mut i) = rig(offers(&[("HeaderDigest", yes), ("DataDigest", yes), ("InitialR2T", "No")]));
        let data = pattern(12288, seed);
        let cmd = i.command(&cdb10(0x2a, 1, 24), 0, 12288, data.slice(..4096));
        let itt = cmd.initiator_task_tag;
        let mut wire = BytesMut::new();
        Pdu::ScsiCommand(cmd).encode(rig.digests(), &mut wire);
        for (sn, off) in [(0u32, 4096u32), (1, 8192)] {
            Pdu::DataOut(DataOut {
                final_bit: off == 8192,
                initiator_task_tag: itt,
                target_transfer_tag: RESERVED_TAG,
                data_sn: sn,
                buffer_offset: off,
                data: data.slice(off as usize..off as usize + 4096),
                ..DataOut::default()
            }).encode(rig.digests(), &mut wire);
        }
        let mut at = 0;
        for c in cuts.iter().cycle() {
            if at >= wire.len() {
                break;
            }
            let end = (at + c).min(wire.len());
            rig.receive(&wire[at..end]);
            at = end;
        }
        let r = rig.responses();
        prop_assert!(matches!(&r[..], [Pdu::ScsiResponse(s)] if s.status == ScsiStatus::GOOD), "{:?}", r);
        prop_assert_eq!(rig.stored(1, 24), data);
    }
}

/// Text requests in full feature phase with keys the target does not know (key names being
/// case-sensitive) or a SendTargets value it cannot take get a Reject (protocol error), as LIO
/// answers: libiscsi's client took the RFC's key=NotUnderstood and SendTargets=Reject answers
/// for a broken reply and reconnected. A known key's value outside its range is answered
/// key=Reject in a Text Response. Either way the session goes on.
#[test]
fn text_with_unknown_keys_or_bad_values_is_answered_and_the_session_goes_on() {
    let (mut rig, mut i) = rig(Options::default());
    // An unknown key, or a SendTargets value it cannot have: a Reject (protocol error), as
    // LIO answers, and the session goes on.
    let rejected: [&[u8]; 5] = [
        b"SendTargetsPlease=All\0",
        b"sENDtARGETS=aLL\0",
        b"SendTargets=Alle\0",
        b"SendTargets=A\0",
        b"X-io.example.thing=1\0",
    ];
    for (n, request) in rejected.into_iter().enumerate() {
        rig.send(&text_request(
            0x50 + n as u32,
            i.next_cmd_sn(),
            Bytes::copy_from_slice(request),
        ));
        let r = rig.responses();
        let [Pdu::Reject(j)] = &r[..] else {
            panic!("{}: {r:?}", String::from_utf8_lossy(request))
        };
        assert_eq!(j.reason, RejectReason::ProtocolError);
        assert_eq!(rig.conn().closing(), None);
        assert_eq!(rig.closed(), None);
    }
    // A known key with a value it cannot take is answered in the text: key=Reject.
    rig.send(&text_request(
        0x58,
        i.next_cmd_sn(),
        Bytes::from_static(b"MaxRecvDataSegmentLength=lots\0"),
    ));
    let r = rig.responses();
    let [Pdu::TextResponse(t)] = &r[..] else {
        panic!("{r:?}")
    };
    assert_eq!(&t.data[..], b"MaxRecvDataSegmentLength=Reject\0");
    // A good request still works, and so do commands.
    rig.send(&text_request(
        0x60,
        i.next_cmd_sn(),
        Bytes::from_static(b"SendTargets=All\0"),
    ));
    assert!(
        matches!(&rig.responses()[..], [Pdu::TextResponse(t)] if t.data.starts_with(b"TargetName="))
    );
    let cmd = i.command(&[0; 6], 0, 0, Bytes::new());
    rig.send(&Pdu::ScsiCommand(cmd));
    assert!(matches!(&rig.responses()[..], [Pdu::ScsiResponse(_)]));
}

/// A final Text Request with no Target Transfer Tag.
fn text_request(itt: u32, cmd_sn: SerialNumber, data: Bytes) -> Pdu {
    Pdu::TextRequest(TextRequest {
        final_bit: true,
        initiator_task_tag: itt,
        target_transfer_tag: RESERVED_TAG,
        cmd_sn,
        data,
        ..TextRequest::default()
    })
}

/// The status a connection answered `itt` with.
fn status_of(r: &[Pdu], itt: u32) -> Option<ScsiStatus> {
    r.iter().find_map(|p| match p {
        Pdu::ScsiResponse(s) if s.initiator_task_tag == itt => Some(s.status),
        Pdu::DataIn(d) if d.initiator_task_tag == itt => d.status.map(|s| s.status),
        _ => None,
    })
}

#[test]
fn a_new_leading_login_of_the_same_port_reinstates_the_session() {
    let (mut rig, mut i) = rig(offers(&[("MaxConnections", "2")]));
    let old_tsih = rig.conns[0].tsih;
    let old_nexus = rig.conns[0].nexus;
    let second = rig.join(2).expect("joins");
    // A read in flight on the old session when the initiator logs in again with its ISID
    // (RFC 7143 section 6.3.5: the old session's tasks end, the new session starts clean).
    rig.hold_backend = true;
    rig.send(&Pdu::ScsiCommand(i.command(
        &cdb10(0x28, 0, 8),
        4096,
        0,
        Bytes::new(),
    )));
    assert_eq!(rig.held.len(), 1);
    rig.hold_backend = false;
    let new = rig.reinstate(SerialNumber(100));
    for old in [0, second] {
        assert!(rig.conns[old].closed.is_some(), "connection {old} closed");
        assert_eq!(rig.conns[old].conn.task_count(), 0);
        assert!(rig.conns[old].conn.is_idle());
    }
    assert!(rig.held.is_empty(), "the held operation was let go");
    assert_eq!(
        rig.target.core.window(old_nexus),
        None,
        "the old I_T nexus is gone"
    );
    let new_tsih = rig.conns[new].tsih;
    assert_ne!(new_tsih, old_tsih);
    assert!(rig.target.sessions.get(old_tsih).is_none());
    // The new session has its own nexus (its own power-on unit attention) and window.
    let mut j = Initiator::new();
    j.cmd_sn = SerialNumber(100);
    let tur = j.command(&[0; 6], 0, 0, Bytes::new());
    let itt = tur.initiator_task_tag;
    rig.send_on(new, &Pdu::ScsiCommand(tur));
    let r = rig.responses_on(new);
    assert_eq!(
        status_of(&r, itt),
        Some(ScsiStatus::CHECK_CONDITION),
        "{r:?}"
    );
    let read = j.command(&cdb10(0x28, 0, 8), 4096, 0, Bytes::new());
    let itt = read.initiator_task_tag;
    rig.send_on(new, &Pdu::ScsiCommand(read));
    assert_eq!(
        status_of(&rig.responses_on(new), itt),
        Some(ScsiStatus::GOOD)
    );
}

#[test]
fn a_login_with_a_live_cid_replaces_that_connection() {
    let (mut rig, mut i) = rig(offers(&[("MaxConnections", "2")]));
    let first = rig.join(2).expect("joins");
    // MaxConnections 2: a third is refused, the session untouched.
    assert_eq!(rig.join(3), Err(SessionError::TooManyConnections));
    assert_eq!(rig.conns[first].closed, None);
    // A read in flight on CID 2 when the initiator logs in with CID 2 again (RFC 7143
    // section 6.3.4: connection reinstatement): the old connection's tasks end, the session
    // and its other connection go on.
    rig.hold_backend = true;
    let read = i.command(&cdb10(0x28, 0, 8), 4096, 0, Bytes::new());
    rig.send_on(first, &Pdu::ScsiCommand(read));
    assert_eq!(rig.held.len(), 1);
    rig.hold_backend = false;
    let again = rig.join(2).expect("replaces CID 2");
    assert!(rig.conns[first].closed.is_some());
    assert_eq!(rig.conns[first].conn.task_count(), 0);
    assert_eq!(rig.conns[0].closed, None);
    let tsih = rig.conns[0].tsih;
    let cids: Vec<u16> = rig
        .target
        .sessions
        .get(tsih)
        .expect("lives")
        .connections
        .iter()
        .map(|&(cid, _)| cid)
        .collect();
    assert_eq!(cids, [1, 2]);
    // Both connections of the session carry commands in one CmdSN order.
    for (conn, lba) in [(again, 0), (0, 8), (again, 16)] {
        let cmd = i.command(&cdb10(0x28, lba, 1), 512, 0, Bytes::new());
        let itt = cmd.initiator_task_tag;
        rig.send_on(conn, &Pdu::ScsiCommand(cmd));
        assert_eq!(
            status_of(&rig.responses_on(conn), itt),
            Some(ScsiStatus::GOOD)
        );
    }
}

#[test]
fn whole_pdus_with_their_data_inline_lose_none_of_it() {
    // A write of 16 KiB: 8 KiB of immediate data inline in the command, the rest in a Data-Out
    // that answers the R2T, also inline; both handed in whole (Connection::handle_pdu).
    let (mut rig, mut i) = rig(Options::default());
    let data = pattern(16384, 7);
    let cmd = i.command(&cdb10(0x2a, 100, 32), 0, 16384, data.slice(..8192));
    let itt = cmd.initiator_task_tag;
    rig.send_whole(0, Pdu::ScsiCommand(cmd));
    let r = rig.responses();
    let [Pdu::ReadyToTransfer(r2t)] = &r[..] else {
        panic!("an R2T for the rest: {r:?}");
    };
    assert_eq!(
        (r2t.buffer_offset, r2t.desired_data_transfer_length),
        (8192, 8192)
    );
    let out = DataOut {
        final_bit: true,
        initiator_task_tag: itt,
        target_transfer_tag: r2t.target_transfer_tag,
        data_sn: 0,
        buffer_offset: 8192,
        data: data.slice(8192..),
        ..DataOut::default()
    };
    rig.send_whole(0, Pdu::DataOut(out));
    let r = rig.responses();
    assert!(
        matches!(&r[..], [Pdu::ScsiResponse(s)] if s.status == ScsiStatus::GOOD),
        "{r:?}"
    );
    assert_eq!(rig.stored(100, 32), data);
    // Inline data on a command that may not carry it is refused, as from the wire.
    let read = i.command(&cdb10(0x28, 0, 1), 512, 0, Bytes::from_static(b"junk"));
    rig.send_whole(0, Pdu::ScsiCommand(read));
    assert!(matches!(&rig.responses()[..], [Pdu::Reject(_)]));
}

/// A quiescent connection handed over (its state encoded and decoded, then resumed as a new
/// machine, as a new process would) goes on where it stopped: the next response carries the
/// next StatSN, digests and segment lengths are as negotiated, and reads return what was
/// written before. While a task is in flight it is not handed over.
#[test]
fn a_quiescent_connection_is_handed_over_and_goes_on() {
    use iscsi_pdu::handover::SessionState;
    use iscsi_pdu::negotiation::{Negotiator, Role};
    use iscsi_pdu::target_node::testing::ISID;
    use iscsi_pdu::target_node::{Busy, Connection};

    let options = offers(&[
        ("HeaderDigest", "CRC32C"),
        ("DataDigest", "CRC32C"),
        ("MaxRecvDataSegmentLength", "16384"),
    ]);
    let (mut rig, mut i) = rig(options.clone());
    let data = pattern(64 << 10, 3);
    write(&mut rig, &mut i, 100, &data, (true, false, 256 << 10));
    assert!(read(&mut rig, &mut i, 100, 128) == data);

    // A read whose backend operation has not returned: not yet.
    rig.hold_backend = true;
    let cmd = i.command(&cdb10(0x28, 100, 8), 4096, 0, Bytes::new());
    rig.send(&Pdu::ScsiCommand(cmd));
    assert_eq!(rig.conn().handover(), Err(Busy::Tasks));
    rig.hold_backend = false;
    assert!(rig.release_backend());
    assert_eq!(
        rig.responses().len(),
        1,
        "the read's Data-In with its status"
    );

    let state = rig.conn().handover().expect("quiescent");
    let (exp, max) = rig.window();
    let session = SessionState {
        tsih: rig.conns[0].tsih,
        isid: ISID,
        params: rig.conn().session_params().clone(),
        exp_cmd_sn: exp,
        cmd_window: max.0.wrapping_sub(exp.0) + 1,
        unit_attentions: Vec::new(),
        connections: vec![state],
    };
    let back = SessionState::decode(&session.encode()).expect("its own encoding");
    assert_eq!(back, session);
    let c = &back.connections[0];
    assert!(c.params.header_digest && c.params.data_digest);
    assert_eq!(c.params.max_send_data_segment_length, 16384);
    let next_stat_sn = rig.conn().stat_sn();

    let negotiator = Negotiator::established(
        Role::Target,
        options.target.clone(),
        back.params.clone(),
        c.params,
    );
    let settings = iscsi_pdu::target_node::Settings {
        cid: c.cid,
        ..options.settings
    };
    rig.conns[0].conn =
        Connection::resume(rig.now, settings, negotiator, back.params.operational, c);
    assert_eq!(rig.conn().stat_sn(), next_stat_sn);
    assert_eq!(rig.conn().max_send_data_segment_length(), 16384);

    // The same session goes on: a NOP-Out answered with the next StatSN, then I/O.
    let ping = NopOut {
        initiator_task_tag: 0x7000,
        target_transfer_tag: RESERVED_TAG,
        cmd_sn: i.next_cmd_sn(),
        immediate: false,
        ..NopOut::default()
    };
    // The resumed connection first tells the initiator the window (which the old process
    // held back while it parked): a NOP-In that asks for no answer and takes no StatSN.
    rig.announce_window();
    match &rig.responses()[..] {
        [Pdu::NopIn(n)] => {
            assert_eq!(
                (n.initiator_task_tag, n.target_transfer_tag),
                (RESERVED_TAG, RESERVED_TAG)
            );
            assert_eq!((n.exp_cmd_sn, n.max_cmd_sn), rig.window());
            assert_eq!(n.stat_sn, next_stat_sn);
        }
        other => panic!("{other:?}"),
    }
    rig.send(&Pdu::NopOut(ping));
    match &rig.responses()[..] {
        [Pdu::NopIn(n)] => assert_eq!(n.stat_sn, next_stat_sn),
        other => panic!("{other:?}"),
    }
    assert!(read(&mut rig, &mut i, 100, 128) == data);
    let more = pattern(32 << 10, 4);
    write(&mut rig, &mut i, 1000, &more, (true, false, 256 << 10));
    assert!(read(&mut rig, &mut i, 1000, 64) == more);
    assert!(rig.closed().is_none());
}
