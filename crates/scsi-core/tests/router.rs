//! The router as the one way out of the device: what an administrator's change, a keeper's
//! decision or a change to shared reservations raises reaches the sink of the call that
//! raised it, addressed to its connection, with nothing left in the device for a later
//! caller to find.

mod common;

use common::*;
use scsi_core::pr::{PrError, Reservations};
use scsi_core::spc::tpg::{AccessState, PortGroup};
use scsi_core::transport::{CoreEvent, Router, Sink};
use scsi_core::{
    Action, Command, Device, NexusId, PortGroupsChange, ReservationChange, Sense, SenseKey, Status,
    TaskAttribute, TaskId, TransportId,
};

/// Events by connection, and the changes handed to a keeper (when `keeper` is set).
#[derive(Default)]
struct Out {
    events: Vec<(u32, CoreEvent)>,
    keeper: bool,
    changes: Vec<ReservationChange>,
    port_groups: Vec<PortGroupsChange>,
}

impl Sink<u32> for Out {
    fn push(&mut self, route: &u32, event: CoreEvent) {
        self.events.push((*route, event));
    }

    fn reservation_change(&mut self, change: ReservationChange) -> Option<ReservationChange> {
        if !self.keeper {
            return Some(change);
        }
        self.changes.push(change);
        None
    }

    fn port_groups_change(&mut self, change: PortGroupsChange) -> Option<PortGroupsChange> {
        if !self.keeper {
            return Some(change);
        }
        self.port_groups.push(change);
        None
    }
}

impl Out {
    fn actions(&mut self, route: u32) -> Vec<Action> {
        let (mine, rest) = std::mem::take(&mut self.events)
            .into_iter()
            .partition(|(r, _)| *r == route);
        self.events = rest;
        mine.into_iter()
            .filter_map(|(_, e)| match e {
                CoreEvent::Action(a) => Some(a),
                CoreEvent::Submitted { .. } => None,
            })
            .collect()
    }
}

/// A router whose LUN 0 keeps its reservations with a keeper, and one nexus on it whose
/// power-on unit attention a TEST UNIT READY has taken.
fn shared() -> (Router<u32>, NexusId) {
    let mut router = Router::new(Device::new("iqn.2026-11.io.example:t", ports()));
    let mut out = Out::default();
    router.add_unit(0, unit(true, b"lu0"), &mut out).unwrap();
    router.share_reservations(0).unwrap();
    let nexus = router.open_nexus(TransportId::iscsi("iqn.2026-11.io.example:i", [1; 6]), 1);
    let tur = Command {
        nexus,
        lun: 0,
        cdb: &[0; 6],
        attribute: TaskAttribute::Simple,
        tag: 1,
        data_in_len: 0,
        data_out_len: 0,
    };
    router.submit(tur, &1, &mut out).unwrap();
    assert!(matches!(
        out.actions(1)[..],
        [Action::Complete {
            status: Status::CheckCondition,
            ..
        }]
    ));
    (router, nexus)
}

/// PERSISTENT RESERVE OUT REGISTER of `key` on LUN 0, its parameter list handed over.
fn register(router: &mut Router<u32>, nexus: NexusId, key: u64, out: &mut Out) -> TaskId {
    let mut cdb = vec![0u8; 10];
    cdb[0] = 0x5f;
    cdb[8] = 24;
    let cmd = Command {
        nexus,
        lun: 0,
        cdb: &cdb,
        attribute: TaskAttribute::Simple,
        tag: 9,
        data_in_len: 0,
        data_out_len: 24,
    };
    let task = router.submit(cmd, &1, out).unwrap();
    let asked = out.actions(1);
    assert!(
        matches!(asked[..], [Action::DataOut { len: 24, .. }]),
        "{asked:?}"
    );
    let mut params = [0u8; 24];
    params[8..16].copy_from_slice(&key.to_be_bytes());
    router.data_out(task, &params, out).unwrap();
    task
}

#[test]
fn a_reservation_change_reaches_the_sink_and_the_keepers_decision_ends_its_command() {
    let (mut router, nexus) = shared();
    let mut out = Out {
        keeper: true,
        ..Out::default()
    };
    let task = register(&mut router, nexus, 0xabc, &mut out);
    assert_eq!(out.changes.len(), 1, "handed to the keeper by the call");
    assert_eq!(out.changes[0].task, Some(task));
    assert!(
        out.actions(1).is_empty(),
        "the command waits for the keeper"
    );
    assert!(
        !router.device().has_reservation_changes(),
        "nothing left behind"
    );

    // The keeper decides on the shared state, has it applied, and ends the command.
    let mut state = Reservations::default();
    let change = out.changes.remove(0);
    let effects = state
        .apply(&change.nexus, &change.request)
        .expect("a registration");
    assert!(router.apply_reservations(0, 1, state, &effects, &mut out));
    router.reservation_done(task, Ok(()), &mut out).unwrap();
    let ended = out.actions(1);
    assert!(
        matches!(
            ended[..],
            [Action::Complete {
                status: Status::Good,
                tag: 9,
                ..
            }]
        ),
        "{ended:?}"
    );
    let (r, version) = router.device().reservations(0).unwrap();
    assert_eq!((r.persistent.registrations.len(), version), (1, Some(1)));
}

#[test]
fn a_change_no_keeper_takes_ends_its_command_with_not_ready() {
    let (mut router, nexus) = shared();
    let mut out = Out::default();
    register(&mut router, nexus, 0xabc, &mut out);
    let ended = out.actions(1);
    let [Action::Complete {
        status: Status::CheckCondition,
        sense: Some(sense),
        ..
    }] = &ended[..]
    else {
        panic!("{ended:?}");
    };
    let b = sense.as_slice();
    // Fixed format has the key in byte 2, descriptor format (72h, 73h) in byte 1.
    let key = if b[0] & 0x7e == 0x72 { b[1] } else { b[2] } & 0x0f;
    assert_eq!(key, SenseKey::NotReady as u8, "{sense:?}");
    assert!(!router.device().has_reservation_changes());
}

#[test]
fn a_keeper_refusing_a_change_ends_its_command_as_the_router_would() {
    let (mut router, nexus) = shared();
    let mut out = Out {
        keeper: true,
        ..Out::default()
    };
    register(&mut router, nexus, 0xabc, &mut out);
    let change = out.changes.remove(0);
    router.refuse_reservation_change(change, &mut out);
    let ended = out.actions(1);
    assert!(
        matches!(
            ended[..],
            [Action::Complete {
                status: Status::CheckCondition,
                ..
            }]
        ),
        "{ended:?}"
    );
    // And a decision that comes after all finds no task waiting.
    let late = router.reservation_done(TaskId::from_bits(0), Err(PrError::Conflict), &mut out);
    assert!(late.is_err());
}

#[test]
fn an_administrators_changes_reach_the_connection_that_announces_unit_attentions() {
    let (mut router, nexus) = shared();
    let mut out = Out::default();
    router.announce_to(nexus, Some(7)).unwrap();
    router.resize_unit(0, BLOCKS * 2, &mut out).unwrap();
    router.add_unit(3, unit(false, b"lu3"), &mut out).unwrap();
    let groups = vec![PortGroup {
        id: 1,
        state: AccessState::Standby,
        preferred: false,
        ports: vec![1, 2],
    }];
    assert!(router.set_port_groups(0, groups, &mut out).unwrap());
    router.remove_unit(3, &mut out).unwrap();
    let heard = out.actions(7);
    assert_eq!(
        heard
            .iter()
            .filter(|a| matches!(a, Action::UnitAttention { .. }))
            .count(),
        heard.len()
    );
    assert!(heard.len() >= 3, "{heard:?}");
    assert!(
        out.events.is_empty(),
        "only the announcing connection hears"
    );
}

/// SET TARGET PORT GROUPS asking group `group` for `state` on LUN 0, its parameter list
/// handed over.
fn set_target_port_groups(
    router: &mut Router<u32>,
    nexus: NexusId,
    state: u8,
    group: u16,
    out: &mut Out,
) -> TaskId {
    let mut cdb = vec![0u8; 12];
    cdb[0] = 0xa4;
    cdb[1] = 0x0a;
    cdb[9] = 8;
    let cmd = Command {
        nexus,
        lun: 0,
        cdb: &cdb,
        attribute: TaskAttribute::Simple,
        tag: 11,
        data_in_len: 0,
        data_out_len: 8,
    };
    let task = router.submit(cmd, &1, out).unwrap();
    let asked = out.actions(1);
    assert!(
        matches!(asked[..], [Action::DataOut { len: 8, .. }]),
        "{asked:?}"
    );
    let [hi, lo] = group.to_be_bytes();
    router
        .data_out(task, &[0, 0, 0, 0, state, 0, hi, lo], out)
        .unwrap();
    task
}

/// The status and sense key a command ended with.
fn ended(out: &mut Out) -> (Status, Option<u8>) {
    let ended = out.actions(1);
    let [Action::Complete { status, sense, .. }] = &ended[..] else {
        panic!("{ended:?}");
    };
    let key = sense.as_ref().map(|s| {
        let b = s.as_slice();
        (if b[0] & 0x7e == 0x72 { b[1] } else { b[2] }) & 0x0f
    });
    (*status, key)
}

/// Explicit ALUA: on a unit whose port groups a keeper decides, SET TARGET PORT GROUPS waits
/// for the keeper, which gives the new groups and ends it; without a keeper it ends NOT
/// READY. On a unit with the device's own groups it asks what is (GOOD) or what cannot be
/// (ILLEGAL REQUEST).
#[test]
fn set_target_port_groups_goes_to_the_keeper_of_shared_port_groups() {
    let (mut router, nexus) = shared();
    let mut out = Out {
        keeper: true,
        ..Out::default()
    };
    // The device's own groups: group 1 is active/optimized, and can be nothing else.
    set_target_port_groups(&mut router, nexus, 0, 1, &mut out);
    assert_eq!(ended(&mut out), (Status::Good, None));
    set_target_port_groups(&mut router, nexus, 2, 1, &mut out);
    assert_eq!(
        ended(&mut out),
        (Status::CheckCondition, Some(SenseKey::IllegalRequest as u8))
    );
    assert!(out.port_groups.is_empty());

    router.share_port_groups(0).unwrap();
    let task = set_target_port_groups(&mut router, nexus, 0, 2, &mut out);
    assert_eq!(out.port_groups.len(), 1, "handed to the keeper by the call");
    let change = out.port_groups.remove(0);
    assert_eq!((change.task, change.lun), (task, 0));
    assert_eq!(
        (change.requests[0].group, change.requests[0].state),
        (2, AccessState::ActiveOptimized)
    );
    assert!(
        out.actions(1).is_empty(),
        "the command waits for the keeper"
    );
    let groups = vec![
        PortGroup {
            id: 1,
            state: AccessState::Standby,
            preferred: false,
            ports: vec![1],
        },
        PortGroup {
            id: 2,
            state: AccessState::ActiveOptimized,
            preferred: true,
            ports: vec![2],
        },
    ];
    assert!(router.set_port_groups(0, groups, &mut out).unwrap());
    router
        .port_groups_change_done(task, Ok(()), &mut out)
        .unwrap();
    assert_eq!(ended(&mut out), (Status::Good, None));
    // The nexus hears of the new states (ASYMMETRIC ACCESS STATE CHANGED) at its next command.
    let tur = Command {
        nexus,
        lun: 0,
        cdb: &[0; 6],
        attribute: TaskAttribute::Simple,
        tag: 12,
        data_in_len: 0,
        data_out_len: 0,
    };
    router.submit(tur, &1, &mut out).unwrap();
    assert_eq!(
        ended(&mut out),
        (Status::CheckCondition, Some(SenseKey::UnitAttention as u8))
    );
    // A keeper's refusal is the command's sense.
    let task = set_target_port_groups(&mut router, nexus, 0, 9, &mut out);
    out.port_groups.clear();
    let invalid = Sense::new(
        SenseKey::IllegalRequest,
        scsi_core::Asc::INVALID_FIELD_IN_PARAMETER_LIST,
    );
    router
        .port_groups_change_done(task, Err(invalid), &mut out)
        .unwrap();
    assert_eq!(
        ended(&mut out),
        (Status::CheckCondition, Some(SenseKey::IllegalRequest as u8))
    );

    // No keeper: NOT READY, which the initiator retries.
    out.keeper = false;
    set_target_port_groups(&mut router, nexus, 0, 2, &mut out);
    assert_eq!(
        ended(&mut out),
        (Status::CheckCondition, Some(SenseKey::NotReady as u8))
    );
    assert!(!router.device().has_port_groups_changes());
}
