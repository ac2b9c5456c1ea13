//! `srp::loopback`: the in-process target an initiator is run against without a device.

use std::time::Instant;

use rdma::fabric::NodeId;
use rdma::switch::{Endpoint, Switch, SwitchError};
use srp::initiator::channel::{Answer, Command, InitiatorChannel};
use srp::initiator::Registration;
use srp::iu::{BufferFormats, LoginRejectReason, MultiChannelAction, SrpLoginReq, TaskAttribute};
use srp::loopback::{LoginError, LoopbackError, LoopbackTarget, MemoryUnit};
use srp::target_port::PortSettings;

const PORT: [u8; 16] = *b"loopback-target0";

fn unit(lun: u16) -> MemoryUnit {
    MemoryUnit {
        lun,
        block_size: 512,
        blocks: 2048,
    }
}

fn settings() -> PortSettings {
    PortSettings {
        target_port_id: PORT,
        ..PortSettings::default()
    }
}

fn request(initiator: u8, action: MultiChannelAction) -> SrpLoginReq {
    let mut initiator_port_id = *b"loopback-initi-0";
    initiator_port_id[15] = initiator;
    SrpLoginReq {
        tag: 1,
        req_it_iu_len: 48 + 20 + 16 * 16,
        req_buf_fmt: BufferFormats::BOTH,
        multi_channel: action,
        initiator_port_id,
        target_port_id: PORT,
        ..SrpLoginReq::default()
    }
}

type Channel = InitiatorChannel<Endpoint<Vec<u8>>>;

/// Sends `cmd` and steps the target until its answer comes.
fn run(
    target: &mut LoopbackTarget,
    verbs: &mut Endpoint<Vec<u8>>,
    ch: &mut Channel,
    cmd: Command<'_>,
) -> Answer {
    ch.send(Instant::now(), verbs, &cmd).expect("sent");
    loop {
        if let Some(a) = ch.poll(verbs) {
            return a;
        }
        assert!(target.step(Instant::now()), "the target answers");
    }
}

fn command(tag: u64, lun: u16, cdb: &[u8]) -> Command<'_> {
    Command {
        tag,
        lun: u64::from(lun) << 48,
        cdb,
        data_out: None,
        data_in: 0,
        regions: 1,
        partial: false,
        attribute: TaskAttribute::Simple,
    }
}

fn rw10(opcode: u8, lba: u32, blocks: u16) -> [u8; 10] {
    let mut cdb = [opcode, 0, 0, 0, 0, 0, 0, 0, 0, 0];
    cdb[2..6].copy_from_slice(&lba.to_be_bytes());
    cdb[7..9].copy_from_slice(&blocks.to_be_bytes());
    cdb
}

#[test]
fn two_channels_of_a_nexus_reach_each_unit_by_its_lun_and_leave_on_logout() {
    let switch = Switch::new();
    let mut target =
        LoopbackTarget::new(&switch, NodeId(0), "srp", settings(), &[unit(0), unit(3)])
            .expect("the target");
    let mut verbs: Endpoint<Vec<u8>> = switch.endpoint(NodeId(1));
    let (mut a, rsp) = target
        .login(
            &mut verbs,
            &request(1, MultiChannelAction::SingleChannel),
            Registration::Pool,
            4,
            1 << 16,
        )
        .expect("login");
    assert!(rsp.req_lim_delta > 0);
    let (mut b, _) = target
        .login(
            &mut verbs,
            &request(1, MultiChannelAction::MultiChannel),
            Registration::PerCommand,
            4,
            1 << 16,
        )
        .expect("a second channel of the nexus");
    assert_eq!(target.channels(), 2);
    // The nexus's first command to each unit hears of the power on.
    for (tag, lun) in [(1, 0), (11, 3)] {
        let tur = run(&mut target, &mut verbs, &mut a, command(tag, lun, &[0; 6]));
        assert_eq!(tur.sense_code(), Some((0x06, 0x29, 0x00)), "LUN {lun}");
    }
    let data: Vec<u8> = (0..8192u32).map(|i| (i % 251) as u8).collect();
    let write = rw10(0x2a, 8, 16);
    let answer = run(
        &mut target,
        &mut verbs,
        &mut a,
        Command {
            data_out: Some(&data),
            ..command(2, 3, &write)
        },
    );
    assert_eq!(answer.status, 0);
    // Read back on the other channel: LUN 3 holds it, LUN 0 does not.
    let read = rw10(0x28, 8, 16);
    let on_3 = run(
        &mut target,
        &mut verbs,
        &mut b,
        Command {
            data_in: 8192,
            ..command(3, 3, &read)
        },
    );
    assert_eq!((on_3.status, on_3.data == data), (0, true));
    let on_0 = run(
        &mut target,
        &mut verbs,
        &mut b,
        Command {
            data_in: 8192,
            ..command(4, 0, &read)
        },
    );
    assert_eq!(on_0.status, 0);
    assert!(on_0.data.iter().all(|&x| x == 0), "LUN 0 was not written");
    // A LUN with no unit is refused with sense data, not lost.
    let none = run(&mut target, &mut verbs, &mut b, command(5, 7, &[0; 6]));
    assert_eq!(none.status, 2);
    assert_eq!(none.sense_code(), Some((0x05, 0x25, 0x00)));
    a.logout(&mut verbs).expect("logout");
    b.logout(&mut verbs).expect("logout");
    while target.step(Instant::now()) {}
    assert_eq!(target.channels(), 0);
    assert_eq!(target.core().device().task_count(), 0);
}

#[test]
fn refusals_name_their_reason() {
    let switch = Switch::new();
    let mut target =
        LoopbackTarget::new(&switch, NodeId(0), "srp", settings(), &[unit(0)]).expect("the target");
    let mut verbs: Endpoint<Vec<u8>> = switch.endpoint(NodeId(1));
    let mut wrong_port = request(1, MultiChannelAction::SingleChannel);
    wrong_port.target_port_id = *b"some-other-port0";
    let e = target
        .login(&mut verbs, &wrong_port, Registration::Pool, 1, 4096)
        .expect_err("no such port");
    assert_eq!(
        e,
        LoginError::Rejected(LoginRejectReason::UnableToEstablishChannel)
    );
    // A second target cannot listen on the same service; a unit's LUN is checked.
    let again = LoopbackTarget::new(&switch, NodeId(2), "srp", settings(), &[]);
    assert!(matches!(
        again,
        Err(LoopbackError::Switch(SwitchError::InUse(_)))
    ));
    let twice = LoopbackTarget::new(&switch, NodeId(2), "other", settings(), &[unit(1), unit(1)]);
    assert!(matches!(twice, Err(LoopbackError::Unit(1, _))));
}
