//! The SRP target end to end over the software fabric: logins and their rejections, reads and
//! writes verified on memory units with direct, indirect (32 regions) and partial-table
//! descriptors, credits exhausted and restored, task management, both logouts, and malformed
//! IUs answered without harm to another channel.

use scsi_core::Residual;
use srp::iu::{
    BufferFormats, LoginRejectReason, MultiChannelAction, MultiChannelResult, SrpCmd, SrpRsp,
    TargetLogoutReason, TaskManagementFunction,
};
use srp::testing::{Cmd, Rig, SendError, TARGET};

const INI_A: [u8; 16] = *b"initiator-port-A";
const INI_B: [u8; 16] = *b"initiator-port-B";

fn rig() -> Rig {
    Rig::new(&[(0, 512, 8192), (1, 4096, 1024)])
}

fn login(rig: &mut Rig, port: [u8; 16]) -> usize {
    let ch = rig
        .login(&Rig::login_request(port, MultiChannelAction::SingleChannel))
        .expect("accepted")
        .0;
    clear_unit_attention(rig, ch);
    ch
}

/// A new I_T nexus first hears of the power on (UNIT ATTENTION), once.
fn clear_unit_attention(rig: &mut Rig, ch: usize) {
    let tag = u64::MAX - 1;
    rig.send(
        ch,
        &Cmd {
            tag,
            cdb: vec![0; 6],
            ..Cmd::default()
        },
    )
    .expect("credit");
    rig.run();
    assert_eq!(
        rig.response(ch, tag).and_then(|r| r.sense_code()),
        Some((6, 0x29, 0))
    );
}

fn write10(lba: u32, blocks: u16) -> Vec<u8> {
    let mut c = vec![0x2a, 0];
    c.extend_from_slice(&lba.to_be_bytes());
    c.push(0);
    c.extend_from_slice(&blocks.to_be_bytes());
    c.push(0);
    c
}

fn read10(lba: u32, blocks: u16) -> Vec<u8> {
    let mut c = write10(lba, blocks);
    c[0] = 0x28;
    c
}

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect()
}

/// Writes `data` at `lba` and reads it back, each through `regions` regions.
fn write_read(
    rig: &mut Rig,
    ch: usize,
    tag: u64,
    lba: u32,
    data: &[u8],
    regions: usize,
    partial: bool,
) {
    let blocks = (data.len() / 512) as u16;
    rig.send(
        ch,
        &Cmd {
            tag,
            cdb: write10(lba, blocks),
            data_out: Some(data.to_vec()),
            regions,
            partial,
            ..Cmd::default()
        },
    )
    .expect("credit");
    rig.run();
    let w = rig.response(ch, tag).expect("the write answered");
    assert_eq!(w.status, 0, "write: {w:?}");
    rig.send(
        ch,
        &Cmd {
            tag: tag + 1,
            cdb: read10(lba, blocks),
            data_in: data.len() as u32,
            regions,
            partial,
            ..Cmd::default()
        },
    )
    .expect("credit");
    rig.run();
    let r = rig.response(ch, tag + 1).expect("the read answered");
    assert_eq!(r.status, 0, "read: {r:?}");
    assert_eq!(r.data_in_residual, Residual::None);
    assert!(r.data == data, "the data read back differs");
}

#[test]
fn login_is_accepted_with_the_ports_terms_and_each_rejection_has_its_reason() {
    let mut rig = rig();
    let (_, rsp) = rig
        .login(&Rig::login_request(
            INI_A,
            MultiChannelAction::SingleChannel,
        ))
        .expect("accepted");
    assert_eq!(rsp.req_lim_delta, 128);
    assert_eq!(rsp.max_it_iu_len, 48 + 20 + 32 * 16);
    assert_eq!(rsp.sup_buf_fmt, BufferFormats::BOTH);
    assert_eq!(rsp.multi_channel, MultiChannelResult::NoExistingChannels);
    let reason = |rig: &mut Rig, r| rig.login(&r).map(|_| ()).map_err(|e| e.reason);
    let req = Rig::login_request(INI_B, MultiChannelAction::SingleChannel);
    let mut big = req;
    big.req_it_iu_len = 1 << 20;
    assert_eq!(
        reason(&mut rig, big),
        Err(LoginRejectReason::ItIuLengthTooLarge)
    );
    let mut other = req;
    other.target_port_id = [9; 16];
    assert_eq!(
        reason(&mut rig, other),
        Err(LoginRejectReason::UnableToEstablishChannel)
    );
    let mut fmt = req;
    fmt.req_buf_fmt = BufferFormats(1 << 5);
    assert_eq!(
        reason(&mut rig, fmt),
        Err(LoginRejectReason::UnsupportedDescriptorFormat)
    );
    // MULTI CHANNEL joins the nexus up to the port's limit (4 channels).
    let multi = Rig::login_request(INI_A, MultiChannelAction::MultiChannel);
    for _ in 0..3 {
        let (_, r) = rig.login(&multi).expect("joins");
        assert_eq!(r.multi_channel, MultiChannelResult::Maintained);
    }
    assert_eq!(
        reason(&mut rig, multi),
        Err(LoginRejectReason::ChannelLimitReached)
    );
    assert_eq!(rig.nexuses(), 1);
    // SINGLE CHANNEL replaces the four: each is logged out with MULTI-CHANNEL ACTION.
    let (ch, r) = rig
        .login(&Rig::login_request(
            INI_A,
            MultiChannelAction::SingleChannel,
        ))
        .expect("replaces");
    assert_eq!(r.multi_channel, MultiChannelResult::Terminated);
    for old in 0..4 {
        assert_eq!(
            rig.channels[old].initiator.logged_out,
            Some(TargetLogoutReason::MultiChannelAction)
        );
        assert!(rig.channels[old].gone);
    }
    clear_unit_attention(&mut rig, ch);
    write_read(&mut rig, ch, 1, 0, &pattern(4096, 1), 1, false);
}

#[test]
fn reads_and_writes_verify_with_direct_indirect_and_partial_descriptors() {
    let mut rig = rig();
    let ch = login(&mut rig, INI_A);
    write_read(&mut rig, ch, 10, 0, &pattern(512, 3), 1, false);
    // 128 KiB as 32 discrete 4 KiB regions, all descriptors in the IU.
    write_read(&mut rig, ch, 20, 100, &pattern(128 * 1024, 5), 32, false);
    // The same with only the first descriptor in the IU: the target reads the table.
    write_read(&mut rig, ch, 30, 400, &pattern(128 * 1024, 7), 32, true);
    // A 4 KiB-block unit (whose power-on unit attention comes first).
    rig.send(
        ch,
        &Cmd {
            tag: 39,
            lun: 1 << 48,
            cdb: vec![0; 6],
            ..Cmd::default()
        },
    )
    .expect("credit");
    rig.run();
    assert_eq!(
        rig.response(ch, 39).and_then(|r| r.sense_code()),
        Some((6, 0x29, 0))
    );
    rig.send(
        ch,
        &Cmd {
            tag: 40,
            lun: 1 << 48,
            cdb: write10(3, 2),
            data_out: Some(pattern(8192, 9)),
            regions: 2,
            ..Cmd::default()
        },
    )
    .expect("credit");
    rig.run();
    assert_eq!(rig.response(ch, 40).map(|r| r.status), Some(0));
    rig.send(
        ch,
        &Cmd {
            tag: 41,
            lun: 1 << 48,
            cdb: read10(3, 2),
            data_in: 8192,
            regions: 3,
            ..Cmd::default()
        },
    )
    .expect("credit");
    rig.run();
    assert_eq!(
        rig.response(ch, 41).expect("answered").data,
        pattern(8192, 9)
    );
    // INQUIRY: parameter data by RDMA WRITE, with an underflow residual.
    rig.send(
        ch,
        &Cmd {
            tag: 50,
            cdb: vec![0x12, 0, 0, 0, 255, 0],
            data_in: 255,
            ..Cmd::default()
        },
    )
    .expect("credit");
    rig.run();
    let inq = rig.response(ch, 50).expect("answered");
    assert_eq!(inq.status, 0);
    assert_eq!(&inq.data[8..11], b"RIG");
    assert!(matches!(inq.data_in_residual, Residual::Underflow(_)));
    // Every credit came back.
    assert_eq!(rig.channels[ch].initiator.credit, 128);
    // The target registered its arena once and nothing per I/O.
    assert_eq!(rig.fabric.counters.registrations[TARGET.0 as usize], 1);
}

#[test]
fn errors_come_back_as_sense_with_residuals() {
    let mut rig = rig();
    let ch = login(&mut rig, INI_A);
    // Beyond the unit's end.
    rig.send(
        ch,
        &Cmd {
            tag: 1,
            cdb: read10(8190, 8),
            data_in: 4096,
            ..Cmd::default()
        },
    )
    .expect("credit");
    // An absent LUN.
    rig.send(
        ch,
        &Cmd {
            tag: 2,
            lun: 5 << 48,
            cdb: read10(0, 1),
            data_in: 512,
            ..Cmd::default()
        },
    )
    .expect("credit");
    // An initiator that expects less than the CDB reads: overflow, data cut to its buffer.
    rig.send(
        ch,
        &Cmd {
            tag: 3,
            cdb: read10(0, 2),
            data_in: 512,
            ..Cmd::default()
        },
    )
    .expect("credit");
    rig.run();
    assert_eq!(
        rig.response(ch, 1).and_then(|r| r.sense_code()),
        Some((5, 0x21, 0))
    );
    assert_eq!(
        rig.response(ch, 2).and_then(|r| r.sense_code()),
        Some((5, 0x25, 0))
    );
    let r = rig.response(ch, 3).expect("answered");
    assert_eq!(r.status, 0);
    assert_eq!(r.data_in_residual, Residual::Overflow(512));
}

#[test]
fn credits_run_out_and_come_back() {
    let mut rig = rig();
    let ch = login(&mut rig, INI_A);
    rig.hold_backend = true;
    for tag in 0..128 {
        rig.send(
            ch,
            &Cmd {
                tag,
                cdb: read10(tag as u32, 1),
                data_in: 512,
                ..Cmd::default()
            },
        )
        .expect("credit");
    }
    rig.run();
    assert_eq!(rig.channels[ch].initiator.credit, 0);
    assert_eq!(
        rig.send(
            ch,
            &Cmd {
                tag: 500,
                cdb: read10(0, 1),
                data_in: 512,
                ..Cmd::default()
            }
        ),
        Err(SendError::NoCredit)
    );
    // An initiator that sends anyway is told BUSY; the target holds no more than its limit.
    let mut b = Vec::new();
    SrpCmd {
        tag: 501,
        cdb: &read10(0, 1),
        ..SrpCmd::default()
    }
    .encode(&mut b);
    rig.send_raw(ch, &b);
    rig.run();
    assert_eq!(rig.response(ch, 501).map(|r| r.status), Some(0x08));
    assert_eq!(rig.channels[ch].channel.outstanding(), 128);
    rig.hold_backend = false;
    rig.release();
    assert!((0..128).all(|t| rig.response(ch, t).is_some_and(|r| r.status == 0)));
    assert_eq!(rig.channels[ch].initiator.credit, 128);
    write_read(&mut rig, ch, 1000, 0, &pattern(1024, 2), 2, false);
}

#[test]
fn abort_task_and_logical_unit_reset() {
    let mut rig = rig();
    let ch = login(&mut rig, INI_A);
    rig.hold_backend = true;
    for tag in 1..=3 {
        rig.send(
            ch,
            &Cmd {
                tag,
                cdb: read10(0, 1),
                data_in: 512,
                ..Cmd::default()
            },
        )
        .expect("credit");
    }
    rig.run();
    rig.task_management(ch, 100, 0, TaskManagementFunction::AbortTask, 2);
    rig.run();
    // The task's operation is in the backend: the abort completes once it has returned.
    assert!(rig.response(ch, 100).is_none());
    rig.hold_backend = false;
    rig.release();
    let r = rig.response(ch, 100).expect("answered");
    assert_eq!(r.response_data, [0, 0, 0, 0]);
    assert!(rig.response(ch, 1).is_some());
    assert!(
        rig.response(ch, 2).is_none(),
        "an aborted command gets no response"
    );
    assert!(rig.response(ch, 3).is_some());
    // The aborted command's credit came back (with a response or an SRP_CRED_REQ).
    assert_eq!(rig.channels[ch].initiator.credit, 128);
    // LOGICAL UNIT RESET ends what the unit holds; a unit attention follows.
    rig.hold_backend = true;
    rig.send(
        ch,
        &Cmd {
            tag: 10,
            cdb: read10(0, 1),
            data_in: 512,
            ..Cmd::default()
        },
    )
    .expect("credit");
    rig.run();
    rig.task_management(ch, 101, 0, TaskManagementFunction::LogicalUnitReset, 0);
    rig.run();
    rig.hold_backend = false;
    rig.release();
    assert_eq!(
        rig.response(ch, 101).map(|r| r.response_data.clone()),
        Some(vec![0, 0, 0, 0])
    );
    assert!(rig.response(ch, 10).is_none(), "{:?}", rig.response(ch, 10));
    rig.send(
        ch,
        &Cmd {
            tag: 11,
            cdb: read10(0, 1),
            data_in: 512,
            ..Cmd::default()
        },
    )
    .expect("credit");
    rig.run();
    assert_eq!(
        rig.response(ch, 11).and_then(|r| r.sense_code()),
        Some((6, 0x29, 0x03))
    );
    assert_eq!(rig.channels[ch].initiator.credit, 128);
    // A function the target does not know, and an absent LUN.
    rig.task_management(ch, 102, 0, TaskManagementFunction::Other(0x20), 0);
    rig.task_management(
        ch,
        103,
        9 << 48,
        TaskManagementFunction::LogicalUnitReset,
        0,
    );
    rig.run();
    assert_eq!(
        rig.response(ch, 102).map(|r| r.response_data[3]),
        Some(0x04)
    );
    assert_eq!(
        rig.response(ch, 103).map(|r| r.response_data[3]),
        Some(0x09)
    );
    assert_eq!(rig.device_tasks(), 0);
}

#[test]
fn logouts_end_the_channel_and_its_tasks() {
    let mut rig = rig();
    let a = login(&mut rig, INI_A);
    let b = login(&mut rig, INI_B);
    rig.hold_backend = true;
    rig.send(
        a,
        &Cmd {
            tag: 1,
            cdb: read10(0, 1),
            data_in: 512,
            ..Cmd::default()
        },
    )
    .expect("credit");
    rig.run();
    rig.logout(a);
    rig.hold_backend = false;
    rig.release();
    assert!(rig.channels[a].gone);
    assert_eq!(rig.nexuses(), 1);
    assert_eq!(rig.device_tasks(), 0);
    // The target logs out a channel that sends an IU only a target sends.
    let mut rsp = Vec::new();
    SrpRsp {
        tag: 1,
        ..SrpRsp::default()
    }
    .encode(&mut rsp);
    rig.send_raw(b, &rsp);
    rig.run();
    assert_eq!(
        rig.channels[b].initiator.logged_out,
        Some(TargetLogoutReason::InvalidIuType)
    );
    assert!(rig.channels[b].gone);
    assert_eq!(rig.nexuses(), 0);
}

#[test]
fn malformed_ius_are_answered_without_harm_to_another_channel() {
    let mut rig = rig();
    let a = login(&mut rig, INI_A);
    let b = login(&mut rig, INI_B);
    // A reserved task attribute: CHECK CONDITION, INVALID FIELD IN COMMAND INFORMATION UNIT.
    let mut cmd = Vec::new();
    SrpCmd {
        tag: 7,
        cdb: &read10(0, 1),
        ..SrpCmd::default()
    }
    .encode(&mut cmd);
    cmd[29] = 3;
    rig.channels[a].initiator.credit -= 1;
    rig.send_raw(a, &cmd);
    rig.run();
    assert_eq!(
        rig.response(a, 7).and_then(|r| r.sense_code()),
        Some((5, 0x0e, 0x03))
    );
    assert_eq!(rig.channels[a].initiator.credit, 128);
    // A descriptor list whose regions hold less than its total length.
    let mut bad = Vec::new();
    let list = srp::iu::MemoryDescriptor {
        va: 0,
        key: 1,
        len: 16,
    };
    let mut lb = Vec::new();
    list.encode(&mut lb);
    SrpCmd {
        tag: 8,
        cdb: &read10(0, 1),
        data_in: srp::iu::DataBufferDescriptor::Indirect {
            table: srp::iu::MemoryDescriptor {
                va: 0,
                key: 1,
                len: 16,
            },
            total_len: 512,
            partial: srp::iu::Descriptors::new(&lb).expect("one"),
        },
        ..SrpCmd::default()
    }
    .encode(&mut bad);
    rig.send_raw(a, &bad);
    rig.run();
    assert_eq!(
        rig.response(a, 8).and_then(|r| r.sense_code()),
        Some((5, 0x0e, 0x03))
    );
    // A tag in use.
    rig.hold_backend = true;
    rig.send(
        a,
        &Cmd {
            tag: 9,
            cdb: read10(0, 1),
            data_in: 512,
            ..Cmd::default()
        },
    )
    .expect("credit");
    rig.send(
        a,
        &Cmd {
            tag: 9,
            cdb: read10(1, 1),
            data_in: 512,
            ..Cmd::default()
        },
    )
    .expect("credit");
    rig.run();
    assert_eq!(
        rig.response(a, 9).and_then(|r| r.sense_code()),
        Some((0x0b, 0x4e, 0))
    );
    rig.hold_backend = false;
    rig.release();
    // A descriptor pointing at memory the initiator never registered: the RDMA fails and
    // the channel's queue pair with it; the other channel goes on.
    let mut wild = Vec::new();
    SrpCmd {
        tag: 10,
        cdb: &read10(0, 1),
        data_in: srp::iu::DataBufferDescriptor::Direct(srp::iu::MemoryDescriptor {
            va: 0xdead_0000,
            key: 0x7777,
            len: 512,
        }),
        ..SrpCmd::default()
    }
    .encode(&mut wild);
    rig.send_raw(a, &wild);
    rig.run();
    assert!(rig.channels[a].gone);
    // A truncated IU and an unknown type end channel b's successors, never b's neighbour.
    let c = login(&mut rig, *b"initiator-port-C");
    rig.send_raw(c, &[0x02; 20]);
    rig.run();
    assert_eq!(
        rig.channels[c].initiator.logged_out,
        Some(TargetLogoutReason::InvalidIuLength)
    );
    let d = login(&mut rig, *b"initiator-port-D");
    rig.send_raw(d, &[0x77; 64]);
    rig.run();
    assert_eq!(
        rig.channels[d].initiator.logged_out,
        Some(TargetLogoutReason::InvalidIuType)
    );
    // A reserved data-out or data-in descriptor format: logged out with the matching reason.
    for (fmt, reason) in [
        (0x50, TargetLogoutReason::UnsupportedDataOutFormat),
        (0x05, TargetLogoutReason::UnsupportedDataInFormat),
    ] {
        let e = login(&mut rig, [fmt; 16]);
        let mut cmd = Vec::new();
        SrpCmd {
            tag: 1,
            cdb: &read10(0, 1),
            ..SrpCmd::default()
        }
        .encode(&mut cmd);
        cmd[5] = fmt;
        rig.send_raw(e, &cmd);
        rig.run();
        assert_eq!(rig.channels[e].initiator.logged_out, Some(reason));
    }
    write_read(&mut rig, b, 1, 10, &pattern(4096, 4), 4, false);
    assert_eq!(rig.device_tasks(), 0);
}

/// RDMA completes when it completes: a command aborted while its data-out is being read, its
/// tag then used again, must not take the late data of the first.
#[test]
fn a_late_rdma_read_of_an_aborted_command_does_not_reach_its_tags_next_command() {
    let mut rig = rig();
    let ch = login(&mut rig, INI_A);
    let (old, new) = (pattern(4096, 1), pattern(4096, 2));
    rig.hold_reads = true;
    let write = |data: &[u8]| Cmd {
        tag: 5,
        cdb: write10(16, 8),
        data_out: Some(data.to_vec()),
        regions: 4,
        ..Cmd::default()
    };
    rig.send(ch, &write(&old)).expect("credit");
    rig.run();
    rig.task_management(ch, 100, 0, TaskManagementFunction::AbortTask, 5);
    rig.run();
    let r = rig.response(ch, 100).expect("the abort is answered");
    assert_eq!(r.response_data, [0, 0, 0, 0], "FUNCTION COMPLETE");
    assert!(rig.response(ch, 5).is_none());
    rig.send(ch, &write(&new)).expect("credit");
    rig.run();
    // Both reads complete now, the aborted command's first.
    rig.release_reads();
    assert_eq!(rig.response(ch, 5).map(|r| r.status), Some(0));
    rig.hold_reads = false;
    rig.send(
        ch,
        &Cmd {
            tag: 6,
            cdb: read10(16, 8),
            data_in: 4096,
            ..Cmd::default()
        },
    )
    .expect("credit");
    rig.run();
    assert_eq!(rig.response(ch, 6).expect("read").data, new);
}

/// With tracing on, an SRP channel reports each command's stages as iSCSI's connection does:
/// a write through its buffer and RDMA READ to its backend operation and response, a read
/// through its backend operation to its response; off, none.
#[test]
fn traced_commands_show_their_stages() {
    use cmdtrace::Stage;
    let mut rig = rig();
    let ch = login(&mut rig, INI_A);
    rig.channels[ch].channel.trace_points().set(true);
    write_read(&mut rig, ch, 40, 8, &pattern(4096, 3), 4, false);
    let mut points = Vec::new();
    while let Some(p) = rig.channels[ch].channel.trace_points().poll() {
        points.push(p);
    }
    let stages = |tag: u32| -> Vec<Stage> {
        points
            .iter()
            .filter(|p| p.itt == tag)
            .map(|p| p.stage)
            .collect()
    };
    assert_eq!(
        stages(40),
        [
            Stage::Received,
            Stage::Dispatched,
            Stage::BufferWait,
            Stage::DataOutDone,
            Stage::BackendSubmit,
            Stage::BackendDone,
            Stage::Responded
        ]
    );
    assert_eq!(
        stages(41),
        [
            Stage::Received,
            Stage::Dispatched,
            Stage::BufferWait,
            Stage::BackendSubmit,
            Stage::BackendDone,
            Stage::Responded
        ]
    );
    assert_eq!(
        points.iter().find(|p| p.itt == 40).map(|p| p.arg),
        Some(4096)
    );
    rig.channels[ch].channel.trace_points().set(false);
    write_read(&mut rig, ch, 50, 8, &pattern(4096, 4), 1, false);
    assert!(rig.channels[ch].channel.trace_points().poll().is_none());
}

/// Linux's ib_srp's default login asks for immediate data: a write's data comes in the
/// SRP_CMD at the granted offset, with no RDMA READ, and reads back as written.
#[test]
fn immediate_data_carries_a_write_in_the_srp_cmd() {
    let mut rig = rig();
    let linux = srp::iu::SrpLoginReq {
        req_it_iu_len: 8260,
        immediate_data: true,
        imm_data_offset: 68,
        ..Rig::login_request(INI_A, MultiChannelAction::SingleChannel)
    };
    let (ch, rsp) = rig.login(&linux).expect("accepted");
    assert!(rsp.immediate_data, "granted");
    assert_eq!(rsp.max_it_iu_len, 8260);
    clear_unit_attention(&mut rig, ch);
    let data = pattern(8192, 5);
    let immediate = |tag: u64, lba: u32, data: &[u8]| {
        let mut iu = Vec::new();
        SrpCmd {
            tag,
            cdb: &write10(lba, (data.len() / 512) as u16),
            data_out: srp::iu::DataBufferDescriptor::Immediate {
                len: data.len() as u32,
            },
            ..SrpCmd::default()
        }
        .encode_with_immediate(68, data, &mut iu);
        iu
    };
    let iu = immediate(1, 16, &data);
    assert_eq!(iu.len(), 8260, "the largest Linux sends");
    rig.channels[ch].initiator.credit -= 1;
    rig.send_raw(ch, &iu);
    rig.run();
    let r = rig.take_response(ch, 1).expect("answered");
    assert_eq!(r.status, 0, "{:?}", r.sense_code());
    assert_eq!(r.data_out_residual, Residual::None);
    rig.send(
        ch,
        &Cmd {
            tag: 2,
            cdb: read10(16, 16),
            data_in: 8192,
            regions: 1,
            ..Cmd::default()
        },
    )
    .expect("credit");
    rig.run();
    assert_eq!(rig.take_response(ch, 2).expect("answered").data, data);
    // Immediate data that would run past the IU: CHECK CONDITION, INVALID FIELD IN COMMAND
    // INFORMATION UNIT, and the channel goes on.
    let mut short = immediate(3, 0, &data[..1024]);
    short.truncate(68 + 512);
    rig.channels[ch].initiator.credit -= 1;
    rig.send_raw(ch, &short);
    rig.run();
    assert_eq!(
        rig.response(ch, 3).and_then(|r| r.sense_code()),
        Some((5, 0x0e, 0x03))
    );
    assert_eq!(rig.channels[ch].initiator.credit, 128);
    // A channel that was not granted immediate data is logged out for using it.
    let b = login(&mut rig, INI_B);
    rig.channels[b].initiator.credit -= 1;
    rig.send_raw(b, &immediate(4, 0, &data[..512]));
    rig.run();
    assert_eq!(
        rig.channels[b].initiator.logged_out,
        Some(TargetLogoutReason::UnsupportedDataOutFormat)
    );
}

/// A unit attention reaches the initiator at once as SRP_AER_REQ (SRP-2 6.12), without
/// waiting for a command, on every nexus, and stays for the next command too; answered with
/// SRP_AER_RSP, the next one goes.
#[test]
fn a_capacity_change_is_reported_at_once_by_srp_aer_req() {
    let mut rig = rig();
    let a = login(&mut rig, INI_A);
    let b = login(&mut rig, INI_B);
    let tur = |tag, lun| Cmd {
        tag,
        lun,
        cdb: vec![0; 6],
        ..Cmd::default()
    };
    // LUN 1's power-on unit attention, heard on each nexus first.
    for ch in [a, b] {
        rig.send(ch, &tur(5, 1 << 48)).expect("credit");
        rig.run();
        assert_eq!(
            rig.response(ch, 5).and_then(|r| r.sense_code()),
            Some((6, 0x29, 0))
        );
    }
    assert!(rig.channels[a].initiator.events.is_empty());
    let credit = rig.channels[a].initiator.credit;
    rig.resize(1, 2048);
    // LUN 1 (peripheral addressing), fixed sense: UNIT ATTENTION, CAPACITY DATA HAS CHANGED.
    for ch in [a, b] {
        let events = &rig.channels[ch].initiator.events;
        assert_eq!(events.len(), 1, "channel {ch}: {events:?}");
        let (lun, sense) = &events[0];
        assert_eq!(*lun, 1 << 48);
        assert_eq!(
            (sense[0], sense[2] & 0xf, sense[12], sense[13]),
            (0x70, 6, 0x2a, 0x09)
        );
    }
    assert_eq!(
        rig.channels[a].initiator.credit, credit,
        "no credit rides on it"
    );
    // Still pending: the next command to the unit reports it too (an initiator may ignore
    // the event, as Linux's ib_srp does); one to another unit does not.
    rig.send(a, &tur(7, 0)).expect("credit");
    rig.send(a, &tur(8, 1 << 48)).expect("credit");
    rig.run();
    assert_eq!(rig.response(a, 7).map(|r| r.status), Some(0));
    assert_eq!(
        rig.response(a, 8).and_then(|r| r.sense_code()),
        Some((6, 0x2a, 0x09))
    );
    // Established again (the first was reported on A), reported again, one event each time
    // once the last was answered; B's is still pending, so B hears nothing new.
    rig.resize(1, 4096);
    assert_eq!(rig.channels[a].initiator.events.len(), 2);
    assert_eq!(rig.channels[b].initiator.events.len(), 1);
    // Commands go on as before.
    write_read(&mut rig, a, 100, 0, &pattern(4096, 9), 1, false);
}

#[test]
fn a_data_out_buffer_that_can_never_be_had_ends_its_command_not_the_channel() {
    let mut rig = rig();
    rig.max_buffer = Some(16 * 1024);
    let ch = login(&mut rig, INI_A);
    // A 64 KiB write, its data-out by RDMA READ: no buffer for it, ever.
    rig.send(
        ch,
        &Cmd {
            tag: 1,
            cdb: write10(0, 128),
            data_out: Some(pattern(64 * 1024, 1)),
            ..Cmd::default()
        },
    )
    .expect("credit");
    rig.run();
    assert_eq!(
        rig.response(ch, 1).and_then(|r| r.sense_code()),
        Some((0xb, 0x55, 0x03)),
        "ABORTED COMMAND, INSUFFICIENT RESOURCES"
    );
    assert_eq!(rig.device_tasks(), 0, "the core let it go");
    // The channel goes on: a write that fits lands and reads back.
    write_read(&mut rig, ch, 10, 0, &pattern(8 * 1024, 2), 1, false);
}
