//! The initiator channel's own timer: a command its target never answers ends the channel at
//! its deadline, on the caller's clock, and gives every command in flight back.

use std::sync::Arc;
use std::time::{Duration, Instant};

use rdma::fabric::NodeId;
use rdma::switch::{Endpoint, Reply, Switch};
use srp::initiator::channel::{Command, InitiatorChannel};
use srp::initiator::Registration;
use srp::iu::{
    BufferFormats, Iu, MultiChannelAction, MultiChannelResult, SrpLoginReq, SrpLoginRsp,
    TaskAttribute,
};

const TARGET: NodeId = NodeId(1);
const INITIATOR: NodeId = NodeId(2);
const SERVICE: &str = "silent";

/// The initiator's channel over the switch.
type Channel = InitiatorChannel<Endpoint<Vec<u8>>>;

/// A channel to a target that accepts the login and then answers nothing.
fn silent_target() -> (Arc<Switch>, Endpoint<Vec<u8>>, Channel) {
    let switch = Switch::new();
    let mut target: Endpoint<Vec<u8>> = switch.endpoint(TARGET);
    target.listen(SERVICE).expect("the service is free");
    let req = SrpLoginReq {
        tag: 1,
        req_it_iu_len: 580,
        req_buf_fmt: BufferFormats::BOTH,
        multi_channel: MultiChannelAction::SingleChannel,
        initiator_port_id: [2; 16],
        target_port_id: [1; 16],
        ..SrpLoginReq::default()
    };
    let mut private = Vec::new();
    req.encode(&mut private);
    let id = switch
        .connect(INITIATOR, SERVICE, &private)
        .expect("listening");
    let request = target.next_request(SERVICE).expect("the connect request");
    let rsp = SrpLoginRsp {
        req_lim_delta: 8,
        tag: 1,
        max_it_iu_len: 580,
        max_ti_iu_len: 112,
        sup_buf_fmt: BufferFormats::BOTH,
        multi_channel: MultiChannelResult::NoExistingChannels,
        immediate_data: false,
    };
    let mut answer = Vec::new();
    rsp.encode(&mut answer);
    let receives = (0..12).map(|_| vec![0; 580]);
    let _target_qp = target.accept(request, receives, &answer);
    let Some(Reply::Accepted { qp, private }) = switch.reply(id) else {
        panic!("accepted");
    };
    let Ok(Iu::LoginRsp(rsp)) = Iu::decode(&private) else {
        panic!("an SRP_LOGIN_RSP");
    };
    let mut verbs: Endpoint<Vec<u8>> = switch.endpoint(INITIATOR);
    let ch = InitiatorChannel::new(&mut verbs, qp, &rsp, Registration::Pool, 4, 8192)
        .expect("the channel's memory");
    (switch, verbs, ch)
}

fn read(tag: u64) -> Command<'static> {
    Command {
        tag,
        lun: 0,
        cdb: &[0x28, 0, 0, 0, 0, 0, 0, 0, 8, 0],
        data_out: None,
        data_in: 4096,
        regions: 1,
        partial: false,
        attribute: TaskAttribute::Simple,
    }
}

#[test]
fn an_unanswered_command_ends_the_channel_at_its_deadline() {
    let (_switch, mut verbs, mut ch) = silent_target();
    let t0 = Instant::now();
    assert_eq!(ch.poll_timeout(), None, "nothing is due without a timeout");
    ch.set_timeout(Some(Duration::from_secs(5)));
    ch.send(t0, &mut verbs, &read(1)).expect("sent");
    ch.send(t0 + Duration::from_secs(1), &mut verbs, &read(2))
        .expect("sent");
    assert_eq!(ch.in_flight(), 2);
    assert_eq!(ch.poll_timeout(), Some(t0 + Duration::from_secs(5)));
    assert!(ch.poll(&mut verbs).is_none(), "the target is silent");
    // Before the deadline nothing happens.
    let early = ch.handle_timeout(t0 + Duration::from_secs(4), &mut verbs);
    assert!(early.is_empty());
    assert!(!ch.is_gone(&verbs));
    // At it, the channel ends and gives both commands back.
    let lost = ch.handle_timeout(t0 + Duration::from_secs(5), &mut verbs);
    assert_eq!(lost, [1, 2]);
    assert_eq!(ch.in_flight(), 0);
    assert!(ch.is_gone(&verbs), "the queue pair is disconnected");
    assert_eq!(ch.poll_timeout(), None);
    assert!(
        ch.send(t0, &mut verbs, &read(3)).is_err(),
        "a gone channel sends nothing"
    );
}

#[test]
fn without_a_timeout_a_silent_target_is_waited_for() {
    let (_switch, mut verbs, mut ch) = silent_target();
    let t0 = Instant::now();
    ch.send(t0, &mut verbs, &read(1)).expect("sent");
    assert_eq!(ch.poll_timeout(), None);
    let never = ch.handle_timeout(t0 + Duration::from_secs(3600), &mut verbs);
    assert!(never.is_empty());
    assert_eq!(ch.in_flight(), 1);
    assert!(!ch.is_gone(&verbs));
}
