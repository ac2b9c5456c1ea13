//! Reservations shared by two device servers (two gateways of one target serving one unit):
//! every change goes to one keeper, which decides it on the one shared state with
//! `Reservations::apply` and has both servers apply the outcome before the command ends, as
//! targetd's RADOS keeper does. What one gateway grants, the other enforces on the very next
//! command.

mod common;

use common::*;
use scsi_core::pr::{ReservationRequest, Reservations};
use scsi_core::testing::{Harness, Outcome};
use scsi_core::{Asc, Device, NexusId, Status, TaskAttribute, TransportId, UnitState};

/// The shared state and its version, as one RADOS object would hold them.
#[derive(Default)]
struct Keeper {
    state: Reservations,
    version: u64,
    /// Changes decided, for the test to look at.
    decided: Vec<ReservationRequest>,
}

impl Keeper {
    /// Takes every pending change from every gateway, decides it, applies the outcome on all
    /// of them and ends the commands that asked, until nothing is pending.
    fn settle(&mut self, gateways: &mut [&mut Harness]) {
        loop {
            let mut any = false;
            for i in 0..gateways.len() {
                while let Some(c) = gateways[i].device.poll_reservation_change() {
                    any = true;
                    let mut next = self.state.clone();
                    let result = next.apply(&c.nexus, &c.request);
                    if let Ok(fx) = &result {
                        // A reset is published even when it changes no shared state.
                        if next != self.state || fx.reset {
                            self.version += 1;
                            self.state = next;
                        }
                        for (j, g) in gateways.iter_mut().enumerate() {
                            // The gateway that made a reset has carried it out already.
                            let mut fx = fx.clone();
                            fx.reset &= j != i;
                            // Every server hears each new version once: it applies.
                            assert!(g.device.apply_reservations(
                                c.lun,
                                self.version,
                                self.state.clone(),
                                &fx,
                            ));
                        }
                    }
                    self.decided.push(c.request.clone());
                    if let Some(task) = c.task {
                        gateways[i]
                            .device
                            .reservation_done(task, result.map(|_| ()))
                            .expect("a task waiting for its keeper");
                    }
                    if let Some(reference) = c.tmf {
                        gateways[i].device.task_management_change_done(reference);
                    }
                }
                gateways[i].run();
            }
            if !any {
                return;
            }
        }
    }
}

/// Gateways A and B with their keeper, an initiator logged in to each (A through relative
/// port 1, B through 2).
fn two_gateways() -> (Harness, Harness, Keeper, NexusId, NexusId) {
    let (mut a, mut b) = (gateway(), gateway());
    let na = a.login_through("iqn.x:one", 1, 1);
    let nb = b.login_through("iqn.x:two", 2, 2);
    (a, b, Keeper::default(), na, nb)
}

fn gateway() -> Harness {
    let mut h = Harness::new(Device::new("iqn.2026-11.io.example:t", ports()));
    h.add_lu(0, unit(true, b"lu0"));
    h.device.share_reservations(0).expect("LUN 0 exists");
    h
}

/// Runs one command on gateway `at` of `gws` to its end, the keeper deciding what it asks.
fn command(
    k: &mut Keeper,
    gws: &mut [&mut Harness],
    at: usize,
    n: NexusId,
    cdb: &[u8],
    data_out: &[u8],
    data_in: u32,
) -> Outcome {
    let tag = gws[at].submit(n, 0, cdb, TaskAttribute::Simple, data_out, data_in);
    gws[at].run();
    k.settle(gws);
    gws[at].outcomes.remove(&tag).expect("the command finished")
}

fn prout_cdb(sa: u8, ty: u8, len: usize) -> Vec<u8> {
    let mut c = vec![0u8; 10];
    c[0] = 0x5f;
    c[1] = sa;
    c[2] = ty;
    c[5..9].copy_from_slice(&(len as u32).to_be_bytes());
    c
}

fn params(key: u64, sa_key: u64, flags: u8) -> Vec<u8> {
    let mut p = vec![0u8; 24];
    p[..8].copy_from_slice(&key.to_be_bytes());
    p[8..16].copy_from_slice(&sa_key.to_be_bytes());
    p[20] = flags;
    p
}

/// PERSISTENT RESERVE OUT with `action`, TYPE `ty` and the basic parameter list, through
/// gateway `at`.
#[allow(clippy::too_many_arguments)]
fn prout(
    k: &mut Keeper,
    gws: &mut [&mut Harness],
    at: usize,
    n: NexusId,
    action: u8,
    ty: u8,
    key: u64,
    sa_key: u64,
) -> Outcome {
    let p = params(key, sa_key, 0);
    command(k, gws, at, n, &prout_cdb(action, ty, 24), &p, 0)
}

/// A READ of one block by `n` that stays in `g`'s backend until released; its tag.
fn held_read(g: &mut Harness, n: NexusId) -> u64 {
    g.hold_backend = true;
    let tag = g.submit(n, 0, &cdb10(0x28, 0, 0, 1), TaskAttribute::Simple, &[], 512);
    g.run();
    g.hold_backend = false;
    assert_eq!(g.held.len(), 1, "the read waits in the backend");
    tag
}

/// PERSISTENT RESERVE OUT PREEMPT AND ABORT (EXCLUSIVE ACCESS) of `victim` by `n` with `key`,
/// submitted on `g`; its tag.
fn preempt_and_abort(g: &mut Harness, n: NexusId, key: u64, victim: u64) -> u64 {
    let p = params(key, victim, 0);
    let tag = g.submit(n, 0, &prout_cdb(5, 3, 24), TaskAttribute::Simple, &p, 0);
    g.run();
    tag
}

const RESERVE6: [u8; 6] = [0x16, 0, 0, 0, 0, 0];
const READ_KEYS: [u8; 10] = [0x5e, 0, 0, 0, 0, 0, 0, 4, 0, 0];
const READ_RESERVATION: [u8; 10] = [0x5e, 1, 0, 0, 0, 0, 0, 4, 0, 0];

#[test]
fn a_reservation_taken_through_one_gateway_is_enforced_by_the_other_at_once() {
    let (mut a, mut b, mut k, na, nb) = two_gateways();
    let mut gws = [&mut a, &mut b];
    good(&prout(&mut k, &mut gws, 0, na, 0, 0, 0, 0xa));
    good(&prout(&mut k, &mut gws, 1, nb, 0, 0, 0, 0xb));
    // WRITE EXCLUSIVE through gateway A.
    good(&prout(&mut k, &mut gws, 0, na, 1, 1, 0xa, 0));
    // Gateway B: the next write conflicts, reads run.
    let w = command(
        &mut k,
        &mut gws,
        1,
        nb,
        &cdb10(0x2a, 0, 0, 1),
        &pattern(1, 0),
        512,
    );
    assert_eq!(w.status, Some(Status::ReservationConflict));
    good(&command(
        &mut k,
        &mut gws,
        1,
        nb,
        &cdb10(0x28, 0, 0, 1),
        &[],
        512,
    ));
    // Both gateways report the same keys, generation and holder.
    let keys_a = command(&mut k, &mut gws, 0, na, &READ_KEYS, &[], 1024);
    let keys_b = command(&mut k, &mut gws, 1, nb, &READ_KEYS, &[], 1024);
    assert_eq!(keys_a.data, keys_b.data);
    assert_eq!(
        &keys_a.data[..8],
        &[0, 0, 0, 2, 0, 0, 0, 16],
        "generation 2, two keys"
    );
    let res_a = command(&mut k, &mut gws, 0, na, &READ_RESERVATION, &[], 1024);
    let res_b = command(&mut k, &mut gws, 1, nb, &READ_RESERVATION, &[], 1024);
    assert_eq!(res_a.data, res_b.data);
    assert_eq!(&res_b.data[8..16], &0xau64.to_be_bytes());
    assert_eq!(res_b.data[21], 1, "WRITE EXCLUSIVE");
    // The holder's registration was made through port 1: READ FULL STATUS on B names it.
    let full = command(
        &mut k,
        &mut gws,
        1,
        nb,
        &[0x5e, 3, 0, 0, 0, 0, 0, 4, 0, 0],
        &[],
        1024,
    );
    good(&full);
    assert_eq!(&full.data[8..16], &0xau64.to_be_bytes());
    assert_eq!(u16::from_be_bytes([full.data[26], full.data[27]]), 1);
    // A reservation conflict decided by the keeper: B cannot reserve over A's.
    let r = prout(&mut k, &mut gws, 1, nb, 1, 3, 0xb, 0);
    assert_eq!(r.status, Some(Status::ReservationConflict));
    // APTPL is accepted: the keeper's state outlives restarts.
    let p = params(0xa, 0xa, 1);
    good(&command(
        &mut k,
        &mut gws,
        0,
        na,
        &prout_cdb(0, 0, 24),
        &p,
        0,
    ));
    assert!(k.state.persistent.aptpl);
}

#[test]
fn preempt_and_abort_on_one_gateway_aborts_and_warns_on_the_other() {
    let (mut a, mut b, mut k, na, nb) = two_gateways();
    {
        let mut gws = [&mut a, &mut b];
        good(&prout(&mut k, &mut gws, 0, na, 0, 0, 0, 0xa));
        good(&prout(&mut k, &mut gws, 1, nb, 0, 0, 0, 0xb));
        good(&prout(&mut k, &mut gws, 0, na, 1, 3, 0xa, 0));
    }
    // A read of A's sits in gateway A's backend.
    let held = held_read(&mut a, na);
    // B preempts A's reservation and aborts its tasks.
    let tag = preempt_and_abort(&mut b, nb, 0xb, 0xa);
    k.settle(&mut [&mut a, &mut b]);
    good(&b.outcomes.remove(&tag).expect("ended"));
    // What gateway A's keeper waits for before it acknowledges the change.
    assert_eq!(a.device.aborted_tasks_in_flight(0), 1);
    a.release();
    a.run();
    assert_eq!(
        a.outcomes.remove(&held).expect("ended").status,
        None,
        "aborted on gateway A"
    );
    assert_eq!(a.device.aborted_tasks_in_flight(0), 0);
    // A hears REGISTRATIONS PREEMPTED, then its access is B's to grant.
    let mut gws = [&mut a, &mut b];
    let o = command(&mut k, &mut gws, 0, na, &[0; 6], &[], 0);
    let asc = Asc::REGISTRATIONS_PREEMPTED;
    assert_eq!(o.sense_code(), Some((6, asc.0, asc.1)));
    let r = command(&mut k, &mut gws, 0, na, &cdb10(0x28, 0, 0, 1), &[], 512);
    assert_eq!(r.status, Some(Status::ReservationConflict));
}

#[test]
fn an_spc2_reservation_holds_on_every_gateway_until_its_nexus_is_lost() {
    let (mut a, mut b, mut k, na, nb) = two_gateways();
    {
        let mut gws = [&mut a, &mut b];
        good(&command(&mut k, &mut gws, 0, na, &RESERVE6, &[], 0));
        let r = command(&mut k, &mut gws, 1, nb, &cdb10(0x28, 0, 0, 1), &[], 512);
        assert_eq!(r.status, Some(Status::ReservationConflict));
        // RESERVE from B while A holds: the keeper refuses it too.
        let r = command(&mut k, &mut gws, 1, nb, &RESERVE6, &[], 0);
        assert_eq!(r.status, Some(Status::ReservationConflict));
    }
    // A's session ends: its reservation goes on every gateway.
    a.device.close_nexus(na).expect("live");
    let mut gws = [&mut a, &mut b];
    k.settle(&mut gws);
    assert_eq!(k.decided.last(), Some(&ReservationRequest::NexusLost));
    assert_eq!(k.state.spc2, None);
    good(&command(
        &mut k,
        &mut gws,
        1,
        nb,
        &cdb10(0x28, 0, 0, 1),
        &[],
        512,
    ));
}

#[test]
fn shared_state_and_effects_survive_their_encoding() {
    let (mut a, mut b, mut k, na, nb) = two_gateways();
    let mut gws = [&mut a, &mut b];
    good(&prout(&mut k, &mut gws, 0, na, 0, 0, 0, 0xa));
    good(&prout(&mut k, &mut gws, 1, nb, 0, 0, 0, 0xb));
    // RESERVE with registrations present conflicts (SPC-4 5.13.3), decided by the keeper.
    let r = command(&mut k, &mut gws, 1, nb, &RESERVE6, &[], 0);
    assert_eq!(r.status, Some(Status::ReservationConflict));
    let bytes = k.state.encode();
    assert_eq!(Reservations::decode(&bytes), Some(k.state.clone()));
    let mut next = k.state.clone();
    let fx = next
        .apply(
            &k.state.persistent.registrations[0].nexus.clone(),
            &ReservationRequest::PersistentReserveOut {
                action: 3,
                scope_type: 0,
                parameters: params(0xa, 0, 0),
            },
        )
        .expect("CLEAR by a registrant");
    assert!(!fx.unit_attentions.is_empty());
    let decoded = scsi_core::pr::ReservationEffects::decode(&fx.encode()).expect("parses");
    assert_eq!(decoded.unit_attentions, fx.unit_attentions);
    assert_eq!(Reservations::decode(b"spc2 1 2\n"), None, "damaged");
}

#[test]
fn a_logical_unit_reset_on_one_gateway_resets_the_unit_on_the_other() {
    let (mut a, mut b, mut k, na, nb) = two_gateways();
    {
        let mut gws = [&mut a, &mut b];
        good(&command(&mut k, &mut gws, 1, nb, &RESERVE6, &[], 0));
    }
    // A read of B's sits in gateway B's backend when A resets the unit.
    b.hold_backend = true;
    let held = b.submit(
        nb,
        0,
        &cdb10(0x28, 0, 0, 1),
        TaskAttribute::Simple,
        &[],
        512,
    );
    b.run();
    a.task_management(na, 0, scsi_core::TmfFunction::LogicalUnitReset, 77);
    assert!(
        !a.tmf.contains_key(&77),
        "answered before the other gateway reset the unit"
    );
    k.settle(&mut [&mut a, &mut b]);
    assert_eq!(a.tmf.get(&77), Some(&scsi_core::TmfResponse::Complete));
    b.release();
    b.run();
    let aborted = b.outcomes.remove(&held).expect("ended");
    assert_eq!(aborted.status, None, "aborted on B");
    b.hold_backend = false;
    // B's SPC-2 reservation is gone and B hears of the reset.
    assert_eq!(k.state.spc2, None);
    let mut gws = [&mut a, &mut b];
    let o = command(&mut k, &mut gws, 1, nb, &[0; 6], &[], 0);
    let asc = Asc::BUS_DEVICE_RESET_OCCURRED;
    assert_eq!(o.sense_code(), Some((6, asc.0, asc.1)));
    // A hears of its own reset too, once, as on a lone target.
    let o = command(&mut k, &mut gws, 0, na, &[0; 6], &[], 0);
    assert_eq!(o.sense_code(), Some((6, asc.0, asc.1)));
    good(&command(
        &mut k,
        &mut gws,
        0,
        na,
        &cdb10(0x28, 0, 0, 1),
        &[],
        512,
    ));
}

#[test]
fn access_states_announce_their_changes_and_refuse_media_access_when_not_active() {
    use scsi_core::spc::tpg::{AccessState, PortGroup};
    let mut a = gateway();
    let n1 = a.login_through("iqn.x:one", 1, 1);
    let n2 = a.login_through("iqn.x:two", 2, 2);
    let group = |id: u16, state| PortGroup {
        id,
        state,
        preferred: state == AccessState::ActiveOptimized,
        ports: vec![id],
    };
    let groups = vec![
        group(1, AccessState::ActiveOptimized),
        group(2, AccessState::ActiveNonOptimized),
    ];
    assert!(a.device.set_port_groups(0, groups.clone()).expect("LUN 0"));
    let changed = Asc::ASYMMETRIC_ACCESS_STATE_CHANGED;
    for n in [n1, n2] {
        let o = a.command(n, 0, &[0; 6], &[], 0);
        assert_eq!(o.sense_code(), Some((6, changed.0, changed.1)));
        good(&a.command(n, 0, &cdb10(0x28, 0, 0, 1), &[], 512));
    }
    assert!(
        !a.device.set_port_groups(0, groups).expect("LUN 0"),
        "no change"
    );
    // Group 2 becomes unavailable: media access through port 2 is NOT READY, the path
    // questions are answered.
    let groups = vec![
        group(1, AccessState::ActiveOptimized),
        group(2, AccessState::Unavailable),
    ];
    assert!(a.device.set_port_groups(0, groups).expect("LUN 0"));
    let _ = a.command(n2, 0, &[0x12, 0, 0, 0, 36, 0], &[], 36);
    let o = a.command(n2, 0, &[0; 6], &[], 0);
    assert_eq!(o.sense_code(), Some((6, changed.0, changed.1)));
    let r = a.command(n2, 0, &cdb10(0x28, 0, 0, 1), &[], 512);
    let unavailable = Asc::TARGET_PORT_IN_UNAVAILABLE_STATE;
    assert_eq!(r.sense_code(), Some((2, unavailable.0, unavailable.1)));
    good(&a.command(n2, 0, &[0x12, 0, 0, 0, 36, 0], &[], 36));
    let mut rtpg = [0u8; 12];
    rtpg[0] = 0xa3;
    rtpg[1] = 0x0a;
    rtpg[9] = 255;
    let d = a.command(n2, 0, &rtpg, &[], 255);
    good(&d);
    assert_eq!(&d.data[4..8], &[0x80, 0xcf, 0, 1]);
    assert_eq!(&d.data[16..20], &[0x03, 0xcf, 0, 2]);
    let o = a.command(n1, 0, &[0; 6], &[], 0);
    assert_eq!(o.sense_code(), Some((6, changed.0, changed.1)));
    good(&a.command(n1, 0, &cdb10(0x28, 0, 0, 1), &[], 512));
}

#[test]
fn an_it_nexus_reset_is_answered_once_its_shared_spc2_reservation_is_gone_everywhere() {
    let (mut a, mut b, mut k, na, nb) = two_gateways();
    {
        let mut gws = [&mut a, &mut b];
        good(&command(&mut k, &mut gws, 0, na, &RESERVE6, &[], 0));
    }
    assert!(a.device.holds_shared_reservation(na));
    assert!(!b.device.holds_shared_reservation(nb));
    // What a logout of A's session does before it is answered.
    a.task_management(na, 0, scsi_core::TmfFunction::ItNexusReset, 5);
    assert!(
        !a.tmf.contains_key(&5),
        "answered before the release was shared"
    );
    k.settle(&mut [&mut a, &mut b]);
    assert_eq!(a.tmf.get(&5), Some(&scsi_core::TmfResponse::Complete));
    assert_eq!(k.state.spc2, None);
    let mut gws = [&mut a, &mut b];
    good(&command(&mut k, &mut gws, 1, nb, &RESERVE6, &[], 0));
}

#[test]
fn a_gateway_that_missed_changes_hears_their_outcome_when_it_comes_back() {
    let (mut a, mut b, mut k, na, nb) = two_gateways();
    {
        let mut gws = [&mut a, &mut b];
        good(&prout(&mut k, &mut gws, 0, na, 0, 0, 0, 0xa));
        good(&prout(&mut k, &mut gws, 1, nb, 0, 0, 0, 0xb));
        // A holds WRITE EXCLUSIVE - REGISTRANTS ONLY.
        good(&prout(&mut k, &mut gws, 0, na, 1, 5, 0xa, 0));
    }
    let (before, _) = a.device.reservations(0).expect("LUN 0");
    let before = before.clone();
    // Gateway A is cut off (fenced): B preempts A's registration and reservation alone.
    good(&prout(&mut k, &mut [&mut b], 0, nb, 4, 5, 0xb, 0xa));
    assert_eq!(
        a.device.reservations(0).expect("LUN 0").0,
        &before,
        "A heard nothing"
    );
    // A comes back: it loads the shared state and tells its nexuses what they missed.
    assert!(a
        .device
        .catch_up_reservations(0, k.version, k.state.clone()));
    // The same version heard again (a late notify) changes nothing, and says so.
    assert!(!a
        .device
        .catch_up_reservations(0, k.version, k.state.clone()));
    let mut gws = [&mut a, &mut b];
    let o = command(&mut k, &mut gws, 0, na, &[0; 6], &[], 0);
    let asc = Asc::REGISTRATIONS_PREEMPTED;
    assert_eq!(o.sense_code(), Some((6, asc.0, asc.1)));
    // And enforces B's reservation: A is no registrant any more.
    let w = command(
        &mut k,
        &mut gws,
        0,
        na,
        &cdb10(0x2a, 0, 0, 1),
        &pattern(1, 0),
        512,
    );
    assert_eq!(w.status, Some(Status::ReservationConflict));
    // B's own nexus was there for the change: it hears nothing more.
    let fx_b = scsi_core::pr::ReservationEffects::missed(&k.state.persistent, &k.state.persistent);
    assert_eq!(fx_b, Default::default());
    // A registrant that stays hears that the reservation it knew went.
    let mut released = before.clone();
    released.persistent.reservation = None;
    let fx = scsi_core::pr::ReservationEffects::missed(&before.persistent, &released.persistent);
    assert_eq!(fx.unit_attentions.len(), 2);
    assert!(fx
        .unit_attentions
        .iter()
        .all(|(_, asc)| *asc == Asc::RESERVATIONS_RELEASED));
}

/// Gateway A's initiator registered and holding the reservation, A's old process parked with
/// its units' state taken, A's next process following the shared state, and B then
/// preempting A's initiator before the sessions are in: (A's next process, B, the keeper, the
/// state A's old process hands over).
fn preempted_while_handed_over() -> (Harness, Harness, Keeper, UnitState) {
    let (mut a, mut b, mut k, na, nb) = two_gateways();
    {
        let mut gws = [&mut a, &mut b];
        good(&prout(&mut k, &mut gws, 0, na, 0, 0, 0, 0xa));
        good(&prout(&mut k, &mut gws, 1, nb, 0, 0, 0, 0xb));
        good(&prout(&mut k, &mut gws, 0, na, 1, 5, 0xa, 0));
    }
    let (_, _, handed) = a.device.unit_states().remove(0);
    let mut next = gateway();
    assert!(next
        .device
        .apply_reservations(0, k.version, k.state.clone(), &Default::default()));
    good(&prout(
        &mut k,
        &mut [&mut b, &mut next],
        0,
        nb,
        4,
        5,
        0xb,
        0xa,
    ));
    (next, b, k, handed)
}

/// A gateway's sessions handed to its next process (an upgrade): a PREEMPT made through
/// another gateway after the old process took its snapshot, which the new process applied
/// before the sessions' nexuses existed in it, still reaches them as a unit attention.
#[test]
fn a_change_made_while_sessions_move_to_the_next_process_reaches_them() {
    let (mut next, mut b, mut k, handed) = preempted_while_handed_over();
    // The sessions come in: the unit's state, then the nexus with what it had pending.
    next.device.adopt_unit_state(0, handed).expect("LUN 0");
    let one = TransportId::iscsi("iqn.x:one", [0x80, 0, 0, 0, 0, 1]);
    let n = next.device.adopt_nexus(one, 1, Vec::new());
    let mut gws = [&mut next, &mut b];
    let o = command(&mut k, &mut gws, 0, n, &[0; 6], &[], 0);
    let asc = Asc::REGISTRATIONS_PREEMPTED;
    assert_eq!(o.sense_code(), Some((6, asc.0, asc.1)));
    good(&command(&mut k, &mut gws, 0, n, &[0; 6], &[], 0));
    let w = command(
        &mut k,
        &mut gws,
        0,
        n,
        &cdb10(0x2a, 0, 0, 1),
        &pattern(1, 0),
        512,
    );
    assert_eq!(w.status, Some(Status::ReservationConflict));
    // A new login of another initiator hears POWER ON, RESET only.
    let fresh = next
        .device
        .open_nexus(TransportId::iscsi("iqn.x:three", [0x80, 0, 0, 0, 0, 3]), 1);
    assert_eq!(
        next.device.pending_unit_attentions(fresh).unwrap(),
        [(0, Asc::POWER_ON_RESET)]
    );
}

/// What a handover kept for nexuses it did not bring is gone once it ends: a nexus of that
/// name adopted later (none is, in practice: later ones log in) hears none of it.
#[test]
fn a_handovers_unit_attentions_for_nexuses_it_did_not_bring_go_when_it_ends() {
    let (mut next, _, _, handed) = preempted_while_handed_over();
    next.device.adopt_unit_state(0, handed).expect("LUN 0");
    next.device.end_handover();
    let one = TransportId::iscsi("iqn.x:one", [0x80, 0, 0, 0, 0, 1]);
    let n = next.device.adopt_nexus(one, 1, Vec::new());
    assert_eq!(next.device.pending_unit_attentions(n).unwrap(), []);
}

/// A gateway's next process whose configuration no longer shares the unit (its cluster
/// section went): the unit keeps the reservations its sessions held, now as its own, and
/// enforces them without a keeper.
#[test]
fn a_unit_no_longer_shared_in_the_next_process_keeps_the_reservations_its_sessions_held() {
    let (mut a, mut b, mut k, na, nb) = two_gateways();
    {
        let mut gws = [&mut a, &mut b];
        good(&prout(&mut k, &mut gws, 0, na, 0, 0, 0, 0xa));
        good(&prout(&mut k, &mut gws, 1, nb, 0, 0, 0, 0xb));
        good(&prout(&mut k, &mut gws, 0, na, 1, 5, 0xa, 0));
    }
    let held = a.device.reservations(0).expect("LUN 0").0.clone();
    let (_, _, handed) = a.device.unit_states().remove(0);
    let mut next = Harness::new(Device::new("iqn.2026-11.io.example:t", ports()));
    next.add_lu(0, unit(true, b"lu0"));
    next.device.adopt_unit_state(0, handed).expect("LUN 0");
    assert_eq!(next.device.reservations(0).expect("LUN 0"), (&held, None));
    let one = TransportId::iscsi("iqn.x:one", [0x80, 0, 0, 0, 0, 1]);
    let n = next.device.adopt_nexus(one, 1, Vec::new());
    let two = next
        .device
        .open_nexus(TransportId::iscsi("iqn.x:two", [0x80, 0, 0, 0, 0, 2]), 2);
    let mut lone = Keeper::default();
    let mut gws = [&mut next];
    good(&command(&mut lone, &mut gws, 0, n, &[0; 6], &[], 0));
    good(&command(
        &mut lone,
        &mut gws,
        0,
        n,
        &cdb10(0x2a, 0, 0, 1),
        &pattern(1, 0),
        512,
    ));
    // The other registrant logs in here anew (POWER ON first): still registered, it writes
    // (WRITE EXCLUSIVE - REGISTRANTS ONLY); an initiator that never registered conflicts.
    let o = command(&mut lone, &mut gws, 0, two, &[0; 6], &[], 0);
    assert_eq!(o.sense_code().map(|(k, _, _)| k), Some(6));
    let write = |k: &mut Keeper, gws: &mut [&mut Harness], n| {
        command(k, gws, 0, n, &cdb10(0x2a, 0, 0, 1), &pattern(1, 0), 512).status
    };
    assert_eq!(write(&mut lone, &mut gws, two), Some(Status::Good));
    let three = gws[0]
        .device
        .open_nexus(TransportId::iscsi("iqn.x:three", [0x80, 0, 0, 0, 0, 3]), 1);
    command(&mut lone, &mut gws, 0, three, &[0; 6], &[], 0);
    assert_eq!(
        write(&mut lone, &mut gws, three),
        Some(Status::ReservationConflict)
    );
    assert!(
        lone.state.persistent.registrations.is_empty(),
        "no keeper was asked"
    );
}

#[test]
fn preempt_and_abort_through_the_preempted_nexus_gateway_waits_for_its_aborted_tasks() {
    let (mut a, mut b, mut k, na, _nb) = two_gateways();
    let nc = a.login_through("iqn.x:three", 3, 1);
    {
        let mut gws = [&mut a, &mut b];
        good(&prout(&mut k, &mut gws, 0, na, 0, 0, 0, 0xa));
        good(&prout(&mut k, &mut gws, 0, nc, 0, 0, 0, 0xc));
        good(&prout(&mut k, &mut gws, 0, na, 1, 3, 0xa, 0));
    }
    // A read of A's initiator sits in gateway A's backend.
    let held = held_read(&mut a, na);
    // The third initiator, on the same gateway, preempts A and aborts its tasks.
    let tag = preempt_and_abort(&mut a, nc, 0xc, 0xa);
    k.settle(&mut [&mut a, &mut b]);
    assert!(
        !a.outcomes.contains_key(&tag),
        "PREEMPT AND ABORT ended while the read it aborted was under way"
    );
    while a.release() {}
    a.run();
    good(&a.outcomes.remove(&tag).expect("PREEMPT AND ABORT ended"));
    assert_eq!(a.outcomes.remove(&held).expect("ended").status, None);
}
