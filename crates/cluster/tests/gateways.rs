//! Gateways of one cluster on a virtual clock over an in-memory store (the test kit's `Sim`,
//! which asserts at every decided change that each gateway watching the unit has applied it or
//! is fenced): races, a silent gateway fenced before a change completes and never writing
//! after, rejoining with what it missed, ALUA states from who answers, rejoin backoff, and
//! PREEMPT AND ABORT waiting for the other gateways' aborted tasks.

use std::time::Duration;

use cluster::ask::Refusal;
use cluster::testing::{change_id, nexus, preempt_and_abort, register, reserve, Sim};
use scsi_core::pr::PrError;
use scsi_core::spc::tpg::{AccessState, TargetPortGroupRequest};
use scsi_core::Asc;

fn states(sim: &Sim, i: usize, unit: u64) -> Vec<(u16, AccessState)> {
    sim.nodes[i].groups[&unit]
        .iter()
        .map(|g| (g.id, g.state))
        .collect()
}

fn holder_key(sim: &Sim, i: usize, unit: u64) -> Option<u64> {
    let (_, state) = sim.nodes[i].applied.get(&unit)?;
    let p = &state.persistent;
    let holder = &p.reservation.as_ref()?.holder;
    p.registrations
        .iter()
        .find(|r| r.nexus == *holder)
        .map(|r| r.key)
}

/// Two gateways; host 1 through gw0 registered key 1 and holds the reservation, host 2
/// through gw1 registered key 2.
fn reserved_through_gw0() -> Sim {
    let mut sim = Sim::new(2, 1);
    for (i, host, key) in [(0, 1, 0x1), (1, 2, 0x2)] {
        sim.submit(
            i,
            change_id(0, u64::from(host)),
            0,
            nexus(i, host),
            register(key),
        );
        sim.run();
    }
    sim.submit(0, change_id(0, 10), 0, nexus(0, 1), reserve(0x1));
    sim.run();
    sim
}

#[test]
fn a_change_through_one_gateway_is_applied_on_every_other_before_it_ends() {
    let mut sim = Sim::new(3, 1);
    // Membership settled: the lowest port group optimized, the others non-optimized.
    use AccessState::*;
    for i in 0..3 {
        assert_eq!(
            states(&sim, i, 0),
            [
                (1, ActiveOptimized),
                (2, ActiveNonOptimized),
                (3, ActiveNonOptimized)
            ]
        );
    }
    sim.submit(1, change_id(0, 1), 0, nexus(1, 1), register(0xa));
    sim.run();
    sim.submit(1, change_id(0, 2), 0, nexus(1, 1), reserve(0xa));
    sim.run();
    assert_eq!(
        sim.nodes[1].decided,
        [(change_id(0, 1), Ok(())), (change_id(0, 2), Ok(()))]
    );
    for i in 0..3 {
        assert_eq!(holder_key(&sim, i, 0), Some(0xa), "gw{i}");
    }
    assert_eq!(sim.nodes[1].machine.counters().changes, 2);
}

#[test]
fn racing_gateways_agree_on_one_holder() {
    let mut sim = Sim::new(2, 1);
    sim.submit(0, change_id(0, 1), 0, nexus(0, 1), register(1));
    sim.submit(1, change_id(0, 2), 0, nexus(1, 2), register(2));
    sim.run();
    // Both read the same version, one write won, the other decided again.
    let races: u64 = sim.nodes.iter().map(|n| n.machine.counters().races).sum();
    assert!(races >= 1, "no race was lost");
    assert_eq!(sim.nodes[0].decided, [(change_id(0, 1), Ok(()))]);
    assert_eq!(sim.nodes[1].decided, [(change_id(0, 2), Ok(()))]);
    sim.submit(0, change_id(0, 3), 0, nexus(0, 1), reserve(1));
    sim.submit(1, change_id(0, 4), 0, nexus(1, 2), reserve(2));
    sim.run();
    let results = [
        sim.nodes[0].decided.last().unwrap().1,
        sim.nodes[1].decided.last().unwrap().1,
    ];
    assert!(
        results == [Ok(()), Err(Refusal::Scsi(PrError::Conflict))]
            || results == [Err(Refusal::Scsi(PrError::Conflict)), Ok(())],
        "{results:?}"
    );
    let holder = holder_key(&sim, 0, 0);
    assert!(holder == Some(1) || holder == Some(2));
    assert_eq!(holder_key(&sim, 1, 0), holder);
}

#[test]
fn a_silent_gateway_is_fenced_before_a_change_completes_never_writes_then_rejoins() {
    // Rounds of "who is alive" far apart: the change itself must fence the silent gateway.
    let mut sim = Sim::with(3, 1, |s| s.membership_interval = Duration::from_secs(60));
    sim.silence(2);
    let silent = sim.nodes[2].instance;
    sim.submit(0, change_id(0, 1), 0, nexus(0, 1), register(7));
    sim.run();
    // gw2 does not answer: the command waits.
    assert!(sim.nodes[0].decided.is_empty());
    sim.advance(Duration::from_secs(4));
    assert!(
        sim.nodes[0].decided.is_empty(),
        "decided before the notify timed out"
    );
    sim.advance(Duration::from_secs(2));
    assert_eq!(sim.nodes[0].decided, [(change_id(0, 1), Ok(()))]);
    assert!(
        sim.blocklist.contains(&silent),
        "decided without fencing the silent gateway"
    );
    assert!(sim.nodes[0].machine.counters().unacknowledged >= 1);
    assert!(sim.nodes[0].machine.counters().fenced + sim.nodes[1].machine.counters().fenced >= 1);

    // gw2 wakes: its watches are gone, it is fenced, its own paths unavailable, and what it
    // tries to write fails.
    let writes = sim.writes.len();
    sim.wake(2);
    assert!(sim.nodes[2].machine.is_fenced());
    assert_eq!(sim.nodes[2].fenced_events, 1);
    let own = sim.nodes[2].groups[&0]
        .iter()
        .find(|g| g.id == 3)
        .map(|g| g.state);
    assert_eq!(own, Some(AccessState::Unavailable));
    sim.submit(2, change_id(0, 2), 0, nexus(2, 2), register(9));
    sim.run();
    assert_eq!(
        sim.nodes[2].decided,
        [(change_id(0, 2), Err(Refusal::Unavailable))]
    );
    assert!(
        sim.writes[writes..].iter().all(|w| w.1 != silent),
        "a fenced client wrote"
    );

    // After the rejoin delay it comes back on a new client, with the state it missed.
    let delay = sim.nodes[2].machine.rejoin_delay();
    assert_eq!(
        delay,
        Duration::from_secs(2),
        "rejoin_min_delay first, whatever the rounds' interval"
    );
    sim.advance(delay + Duration::from_secs(1));
    assert!(!sim.nodes[2].machine.is_fenced());
    assert_eq!(sim.nodes[2].rejoined_events, 1);
    assert_ne!(sim.nodes[2].instance, silent);
    assert_eq!(holder_key(&sim, 2, 0), None);
    let (v2, _) = sim.nodes[2].applied[&0].clone();
    let (v0, _) = sim.nodes[0].applied[&0].clone();
    assert_eq!(v2, v0, "the rejoined gateway did not reload the state");
    sim.advance(Duration::from_secs(61));
    use AccessState::*;
    assert_eq!(
        states(&sim, 0, 0),
        [
            (1, ActiveOptimized),
            (2, ActiveNonOptimized),
            (3, ActiveNonOptimized)
        ]
    );
    // And it serves changes again, which reach everyone.
    sim.submit(2, change_id(0, 3), 0, nexus(2, 2), register(9));
    sim.run();
    assert_eq!(
        sim.nodes[2].decided.last(),
        Some(&(change_id(0, 3), Ok(())))
    );
}

#[test]
fn who_answers_decides_the_alua_states_and_the_silent_are_fenced() {
    let mut sim = Sim::new(3, 2);
    sim.silence(0);
    let silent = sim.nodes[0].instance;
    sim.advance(Duration::from_secs(5));
    use AccessState::*;
    for i in 1..3 {
        for u in 0..2 {
            assert_eq!(
                states(&sim, i, u),
                [
                    (1, Unavailable),
                    (2, ActiveOptimized),
                    (3, ActiveNonOptimized)
                ],
                "gw{i} unit {u}"
            );
        }
    }
    assert!(sim.blocklist.contains(&silent));
    // Each silent gateway is fenced once, not at every round.
    let fenced: u64 = sim.nodes.iter().map(|n| n.machine.counters().fenced).sum();
    sim.advance(Duration::from_secs(10));
    let again: u64 = sim.nodes.iter().map(|n| n.machine.counters().fenced).sum();
    assert_eq!(fenced, again);
}

#[test]
fn a_fenced_gateway_tries_to_rejoin_less_and_less_often_until_it_can() {
    let mut sim = Sim::new(2, 1);
    sim.silence(1);
    sim.advance(Duration::from_secs(5));
    sim.refuse_reconnect = true;
    sim.wake(1);
    assert!(sim.nodes[1].machine.is_fenced());
    // Tries at 2 s, then 4, 8, 16, 30, 30 s apart.
    let mut delays = Vec::new();
    for _ in 0..6 {
        delays.push(sim.nodes[1].machine.rejoin_delay().as_secs());
        let d = sim.nodes[1].machine.rejoin_delay();
        sim.advance(d);
    }
    assert_eq!(delays, [2, 4, 8, 16, 30, 30]);
    assert!(sim.nodes[1].machine.is_fenced());
    sim.refuse_reconnect = false;
    sim.advance(Duration::from_secs(31));
    assert!(!sim.nodes[1].machine.is_fenced());
    assert_eq!(sim.nodes[1].machine.counters().rejoins, 1);
}

#[test]
fn preempt_and_abort_ends_only_once_the_other_gateways_aborted_tasks_have() {
    // Host 1 through gw0 holds the reservation; host 2 through gw1 preempts it with abort.
    let mut sim = reserved_through_gw0();
    assert_eq!(holder_key(&sim, 1, 0), Some(0x1));
    // Host 1's writes are still running on gw0 when the preempt comes.
    sim.nodes[0].aborted_in_flight.insert(0, 3);
    sim.submit(
        1,
        change_id(0, 11),
        0,
        nexus(1, 2),
        preempt_and_abort(0x2, 0x1),
    );
    sim.run();
    assert_eq!(holder_key(&sim, 0, 0), Some(0x2), "gw0 applies at once");
    assert!(
        sim.nodes[1]
            .decided
            .iter()
            .all(|(c, _)| *c != change_id(0, 11)),
        "the preempt ended while gw0 still ran the aborted tasks"
    );
    sim.advance(Duration::from_secs(1));
    assert!(sim.nodes[1]
        .decided
        .iter()
        .all(|(c, _)| *c != change_id(0, 11)));
    sim.end_aborted_tasks(0, 0);
    assert_eq!(
        sim.nodes[1].decided.last(),
        Some(&(change_id(0, 11), Ok(())))
    );
    assert!(sim.blocklist.is_empty(), "nobody needed fencing");
}

#[test]
fn aborted_tasks_that_outlast_the_notify_timeout_get_their_gateway_fenced() {
    let mut sim = reserved_through_gw0();
    sim.nodes[0].aborted_in_flight.insert(0, 1);
    let stuck = sim.nodes[0].instance;
    sim.submit(
        1,
        change_id(0, 11),
        0,
        nexus(1, 2),
        preempt_and_abort(0x2, 0x1),
    );
    sim.run();
    sim.advance(Duration::from_secs(6));
    assert_eq!(
        sim.nodes[1].decided.last(),
        Some(&(change_id(0, 11), Ok(())))
    );
    assert!(sim.blocklist.contains(&stuck));
    assert!(sim.nodes[0].machine.is_fenced());
}

#[test]
fn a_change_for_a_unit_not_shared_here_is_not_ready() {
    let mut sim = Sim::new(1, 1);
    sim.submit(0, change_id(5, 1), 5, nexus(0, 1), register(1));
    sim.run();
    assert_eq!(
        sim.nodes[0].decided,
        [(change_id(5, 1), Err(Refusal::Unavailable))]
    );
}

/// The target's share of a failover: a gateway that dies is fenced by the others (and its
/// port group reported unavailable) within one round's interval and one answer's timeout of
/// its death, wherever in the round it dies; with the default timing that is at most 1.5 s,
/// which leaves the fence's own blocklist and lock break inside 2 s.
#[test]
fn a_dead_gateway_is_fenced_within_one_interval_and_one_timeout_of_its_death() {
    let defaults = cluster::gateway::Settings::new("sim", "gw0", 1, Duration::from_secs(5));
    let bound = defaults.membership_interval + defaults.membership_timeout;
    assert!(bound <= Duration::from_millis(1500), "{bound:?}");
    let step = Duration::from_millis(100);
    for offset in 0..10u64 {
        let mut sim = Sim::new(2, 1);
        sim.advance(Duration::from_millis(offset * 100));
        let victim = sim.nodes[1].instance;
        sim.silence(1);
        let mut waited = Duration::ZERO;
        while !sim.blocklist.contains(&victim) {
            assert!(
                waited <= bound,
                "not fenced {waited:?} after it died ({offset}00 ms into the run)"
            );
            sim.advance(step);
            waited += step;
        }
        assert_eq!(
            states(&sim, 0, 0),
            [
                (1, AccessState::ActiveOptimized),
                (2, AccessState::Unavailable)
            ]
        );
    }
}

/// A gateway that is busy (its answers take most of the timeout to arrive) but alive is never
/// fenced, however long it stays busy.
#[test]
fn a_busy_gateway_answering_within_the_timeout_is_never_fenced() {
    let mut sim = Sim::new(3, 1);
    let timeout = sim.nodes[0].machine.settings().membership_timeout;
    sim.nodes[2].ack_delay = timeout - Duration::from_millis(200);
    // A change on the unit while it is busy: its notify waits for the slow answer too.
    sim.submit(0, change_id(0, 1), 0, nexus(0, 1), register(7));
    sim.advance(Duration::from_secs(60));
    assert_eq!(sim.nodes[0].decided, [(change_id(0, 1), Ok(()))]);
    assert!(sim.blocklist.is_empty(), "{:?}", sim.blocklist);
    for n in &sim.nodes {
        assert_eq!(n.machine.membership().live.len(), 3);
        assert_eq!(n.machine.counters().fenced, 0);
        assert!(!n.machine.is_fenced());
    }

    // One whose answers come after the timeout counts as gone.
    let mut sim = Sim::new(3, 1);
    sim.nodes[2].ack_delay = timeout + Duration::from_millis(200);
    let late = sim.nodes[2].instance;
    sim.advance(Duration::from_secs(3));
    assert!(sim.blocklist.contains(&late));
}

/// SET TARGET PORT GROUPS `(state, group)` descriptors, as a device server parses them.
fn stpg(ds: &[(AccessState, u16)]) -> Vec<TargetPortGroupRequest> {
    ds.iter()
        .enumerate()
        .map(|(i, &(state, group))| TargetPortGroupRequest {
            group,
            state,
            offset: 4 + 4 * i as u16,
        })
        .collect()
}

/// Explicit ALUA: an initiator asks a gateway for its group to be active/optimized; every
/// gateway gives the unit the new states (the asking one before the command ends, the others
/// at once by notify), other units keep theirs, a request that cannot be met changes nothing,
/// and the choice ends when the chosen gateway goes down: the configured policy applies again,
/// also after it rejoined.
#[test]
fn an_initiators_choice_of_the_optimized_gateway_reaches_every_gateway_while_it_runs() {
    use AccessState::*;
    let mut sim = Sim::new(2, 2);
    let before = [(1, ActiveOptimized), (2, ActiveNonOptimized)];
    let chosen = [(1, ActiveNonOptimized), (2, ActiveOptimized)];
    assert_eq!(states(&sim, 0, 0), before);

    // Asking what cannot be: an unknown group; two optimized; another state than follows.
    for (n, bad) in [
        stpg(&[(ActiveOptimized, 9)]),
        stpg(&[(ActiveOptimized, 1), (ActiveOptimized, 2)]),
        stpg(&[(ActiveOptimized, 2), (Standby, 1)]),
    ]
    .into_iter()
    .enumerate()
    {
        sim.submit_port_groups(1, change_id(0, n as u64), 0, &bad);
        sim.run();
        let (_, result) = *sim.nodes[1].decided.last().unwrap();
        let Err(Refusal::Scsi(PrError::Sense(sense))) = result else {
            panic!("{result:?}");
        };
        assert_eq!(sense.asc, Asc::INVALID_FIELD_IN_PARAMETER_LIST);
    }
    assert_eq!(states(&sim, 1, 0), before, "nothing changed");

    // Through gw1, for its own group (as Linux's scsi_dh_alua asks).
    sim.submit_port_groups(1, change_id(0, 10), 0, &stpg(&[(ActiveOptimized, 2)]));
    sim.run();
    assert_eq!(
        sim.nodes[1].decided.last().unwrap(),
        &(change_id(0, 10), Ok(()))
    );
    for i in 0..2 {
        assert_eq!(states(&sim, i, 0), chosen, "gw{i}");
        assert_eq!(
            states(&sim, i, 1),
            before,
            "gw{i}: another unit keeps its states"
        );
    }
    // It holds over rounds.
    sim.advance(Duration::from_secs(5));
    assert_eq!(states(&sim, 0, 0), chosen);
    // Asked again: nothing to write.
    let writes = sim.writes.len();
    sim.submit_port_groups(0, change_id(0, 11), 0, &stpg(&[(ActiveOptimized, 2)]));
    sim.run();
    assert_eq!(sim.writes.len(), writes);

    // gw1 goes down: gw0 is optimized; gw1 back (another instance): the configured policy.
    sim.silence(1);
    sim.advance(Duration::from_secs(5));
    assert_eq!(states(&sim, 0, 0), [(1, ActiveOptimized), (2, Unavailable)]);
    sim.wake(1);
    sim.advance(Duration::from_secs(10));
    assert!(!sim.nodes[1].machine.is_fenced());
    for i in 0..2 {
        assert_eq!(states(&sim, i, 0), before, "gw{i}");
    }
}

/// NVMe reservations across gateways: a host registers through one gateway, another acquires
/// Write Exclusive through the other, and both gateways then refuse a third host's writes;
/// Preempt and Abort ends only once the gateway running the preempted host's commands has
/// ended them; refusals come back as NVMe statuses.
#[test]
fn nvme_reservations_are_one_state_on_every_gateway() {
    use cluster::testing::{nvme_ask, nvme_host};
    use nvme::opcode::NvmOpcode::{ReservationAcquire, ReservationRegister};
    use nvme::status::Status;
    use scsi_core::spc::opcodes::Access;
    let mut sim = Sim::new(2, 1);
    // Host 1 registers key 0xa through gw0, host 2 key 0xb through gw1.
    sim.submit(
        0,
        change_id(0, 1),
        0,
        nvme_host(1),
        nvme_ask(ReservationRegister, 0, 0, 0xa),
    );
    sim.submit(
        1,
        change_id(0, 2),
        0,
        nvme_host(2),
        nvme_ask(ReservationRegister, 0, 0, 0xb),
    );
    sim.run();
    // Host 2 acquires Write Exclusive (RTYPE 1) through gw1.
    sim.submit(
        1,
        change_id(0, 3),
        0,
        nvme_host(2),
        nvme_ask(ReservationAcquire, 1 << 8, 0xb, 0),
    );
    sim.run();
    assert_eq!(sim.nodes[0].decided, [(change_id(0, 1), Ok(()))]);
    assert_eq!(
        sim.nodes[1].decided,
        [(change_id(0, 2), Ok(())), (change_id(0, 3), Ok(()))]
    );
    for i in 0..2 {
        let (_, st) = &sim.nodes[i].applied[&0];
        let p = &st.persistent;
        assert!(p.is_holder(&nvme_host(2)), "gw{i}");
        assert!(!p.allows(&nvme_host(3), Access::Write), "gw{i}");
        assert!(p.allows(&nvme_host(3), Access::Read), "gw{i}");
        assert_eq!(p.registrations.len(), 2, "gw{i}");
    }
    // Host 1 acquiring through gw0 conflicts, in NVMe's words.
    sim.submit(
        0,
        change_id(0, 4),
        0,
        nvme_host(1),
        nvme_ask(ReservationAcquire, 1 << 8, 0xa, 0),
    );
    sim.run();
    assert_eq!(
        sim.nodes[0].decided.last(),
        Some(&(
            change_id(0, 4),
            Err(Refusal::Nvme(Status::RESERVATION_CONFLICT))
        ))
    );
    // Host 1 preempts host 2 with abort through gw0 while host 2's commands still run on
    // gw1: decided only once they have ended there.
    sim.nodes[1].aborted_in_flight.insert(0, 2);
    sim.submit(
        0,
        change_id(0, 5),
        0,
        nvme_host(1),
        nvme_ask(ReservationAcquire, 2 | 1 << 8, 0xa, 0xb),
    );
    sim.run();
    assert!(
        sim.nodes[0]
            .decided
            .iter()
            .all(|(c, _)| *c != change_id(0, 5)),
        "the preempt ended while gw1 still ran the aborted commands"
    );
    sim.end_aborted_tasks(1, 0);
    assert_eq!(
        sim.nodes[0].decided.last(),
        Some(&(change_id(0, 5), Ok(())))
    );
    for i in 0..2 {
        let (_, st) = &sim.nodes[i].applied[&0];
        assert!(st.persistent.is_holder(&nvme_host(1)), "gw{i}");
        assert_eq!(st.persistent.registrations.len(), 1, "gw{i}");
    }
    assert!(sim.blocklist.is_empty(), "nobody needed fencing");
}

/// Eight NVMe hosts on two gateways register and acquire at once: one holder, every
/// registration, the same state on both gateways.
#[test]
fn eight_nvme_hosts_racing_on_two_gateways_end_in_one_state() {
    use cluster::testing::{nvme_ask, nvme_host};
    use nvme::opcode::NvmOpcode::{ReservationAcquire, ReservationRegister};
    let mut sim = Sim::new(2, 1);
    for h in 1..=8u8 {
        let g = usize::from(h % 2);
        let key = u64::from(h);
        sim.submit(
            g,
            change_id(0, key),
            0,
            nvme_host(h),
            nvme_ask(ReservationRegister, 0, 0, key),
        );
        sim.submit(
            g,
            change_id(0, 100 + key),
            0,
            nvme_host(h),
            nvme_ask(ReservationAcquire, 1 << 8, key, 0),
        );
    }
    sim.run();
    let acquired: Vec<_> = sim
        .nodes
        .iter()
        .flat_map(|n| n.decided.iter())
        .filter(|(c, r)| *c & 0xffff_ffff > 100 && r.is_ok())
        .collect();
    assert_eq!(acquired.len(), 1, "one acquire won: {acquired:?}");
    let (v0, s0) = &sim.nodes[0].applied[&0];
    let (v1, s1) = &sim.nodes[1].applied[&0];
    assert_eq!((v0, s0), (v1, s1), "the gateways disagree");
    assert_eq!(s0.persistent.registrations.len(), 8);
    assert!(s0.persistent.reservation.is_some());
}
