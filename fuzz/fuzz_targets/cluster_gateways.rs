//! Gateways of one cluster on a virtual clock (the cluster crate's test kit), fed Arbitrary
//! sequences of reservation changes through any gateway, gateways going silent and waking,
//! aborted tasks that end late or never, the cluster refusing rejoins, and time passing. The
//! kit asserts at every decided change that each gateway watching the unit has applied it or
//! is fenced; here, besides, every change is decided in the end, a gateway that is not fenced
//! and runs agrees with every other on each unit's state once all is quiet, and a gateway
//! that was only slow (its answers arriving within the membership timeout) is never fenced.
//! Initiators' SET TARGET PORT GROUPS come through any gateway too, and once all is quiet
//! every gateway gives each unit the same port groups. NVMe hosts' reservation commands come
//! through any gateway as well, decided on the same state.
#![no_main]

use std::time::Duration;

use arbitrary::Arbitrary;
use cluster::ask::Ask;
use cluster::testing::{change_id, nexus, nvme_host, preempt_and_abort, register, reserve, Sim};
use libfuzzer_sys::fuzz_target;
use nvme::opcode::NvmOpcode;
use scsi_core::pr::ReservationRequest;
use scsi_core::spc::tpg::{AccessState, TargetPortGroupRequest};

#[derive(Arbitrary, Debug)]
enum Step {
    Register {
        gw: u8,
        host: u8,
        unit: u8,
        key: u8,
    },
    Reserve {
        gw: u8,
        host: u8,
        unit: u8,
        key: u8,
    },
    Preempt {
        gw: u8,
        host: u8,
        unit: u8,
        key: u8,
        victim: u8,
    },
    Release {
        gw: u8,
        host: u8,
        unit: u8,
    },
    Reset {
        gw: u8,
        unit: u8,
    },
    Silence(u8),
    Wake(u8),
    /// Tasks of a unit on a gateway that a PREEMPT AND ABORT will wait for.
    Busy {
        gw: u8,
        unit: u8,
        tasks: u8,
    },
    EndTasks {
        gw: u8,
        unit: u8,
    },
    RefuseRejoins(bool),
    Advance(u16),
    /// A gateway's answers take `tenths` tenths of a second to arrive (busy, or a slow link).
    Slow {
        gw: u8,
        tenths: u8,
    },
    /// An NVMe reservation command (Register, Acquire or Release by `command`, its CDW10 as
    /// given) from NVMe host `host` through a gateway, with keys 0 to 3.
    Nvme {
        gw: u8,
        host: u8,
        unit: u8,
        command: u8,
        cdw10: u32,
        crkey: u8,
        other: u8,
    },
    /// SET TARGET PORT GROUPS through a gateway: `group` (0 to 4: some are nobody's) asked
    /// active/optimized, and another group asked `other`'s state when set.
    Prefer {
        gw: u8,
        unit: u8,
        group: u8,
        other: Option<(u8, u8)>,
    },
}

const GATEWAYS: usize = 3;
const UNITS: u64 = 2;

fuzz_target!(|steps: Vec<Step>| {
    let mut sim = Sim::new(GATEWAYS, UNITS);
    let mut submitted = vec![Vec::new(); GATEWAYS];
    let mut n = 0u64;
    let gw = |g: u8| usize::from(g) % GATEWAYS;
    let unit = |u: u8| u64::from(u) % UNITS;
    let timeout = sim.nodes[0].machine.settings().membership_timeout;
    // Gateways that may be fenced: silenced, answering late, or holding aborted tasks a
    // PREEMPT AND ABORT waits for.
    let mut may_be_fenced = [false; GATEWAYS];
    let instances: Vec<u64> = sim.nodes.iter().map(|n| n.instance).collect();
    for step in steps.into_iter().take(64) {
        let mut submit = |sim: &mut Sim, g: usize, u: u64, host: u8, r: ReservationRequest| {
            n += 1;
            let c = change_id(u, n);
            submitted[g].push(c);
            sim.submit(g, c, u, nexus(g, host % 4), r);
        };
        if let Step::Nvme {
            gw: g,
            host,
            unit: u,
            command,
            cdw10,
            crkey,
            other,
        } = step
        {
            // NVMe hosts share the units with the SCSI initiators: one state decides both.
            let opcode = [
                NvmOpcode::ReservationRegister,
                NvmOpcode::ReservationAcquire,
                NvmOpcode::ReservationRelease,
            ][usize::from(command % 3)];
            let mut sqe = nvme::sqe::Sqe::new(opcode.code(), 1);
            sqe.set_cdw(10, cdw10);
            if let Ok(command) = nvme::reservation::decode(&sqe) {
                n += 1;
                let c = change_id(unit(u), n);
                submitted[gw(g)].push(c);
                let mut data = [0; 16];
                data[..8].copy_from_slice(&u64::from(crkey % 4).to_le_bytes());
                data[8..].copy_from_slice(&u64::from(other % 4).to_le_bytes());
                sim.submit(
                    gw(g),
                    c,
                    unit(u),
                    nvme_host(host % 4),
                    Ask::Nvme { command, data },
                );
            }
            sim.run();
            continue;
        }
        match step {
            Step::Register {
                gw: g,
                host,
                unit: u,
                key,
            } => submit(&mut sim, gw(g), unit(u), host, register(u64::from(key))),
            Step::Reserve {
                gw: g,
                host,
                unit: u,
                key,
            } => submit(&mut sim, gw(g), unit(u), host, reserve(u64::from(key))),
            Step::Preempt {
                gw: g,
                host,
                unit: u,
                key,
                victim,
            } => submit(
                &mut sim,
                gw(g),
                unit(u),
                host,
                preempt_and_abort(u64::from(key), u64::from(victim)),
            ),
            Step::Release {
                gw: g,
                host,
                unit: u,
            } => submit(&mut sim, gw(g), unit(u), host, ReservationRequest::Release),
            Step::Reset { gw: g, unit: u } => {
                submit(&mut sim, gw(g), unit(u), 0, ReservationRequest::Reset)
            }
            Step::Silence(g) => {
                may_be_fenced[gw(g)] = true;
                sim.silence(gw(g))
            }
            Step::Wake(g) => sim.wake(gw(g)),
            Step::Busy {
                gw: g,
                unit: u,
                tasks,
            } => {
                may_be_fenced[gw(g)] |= tasks % 4 > 0;
                sim.nodes[gw(g)]
                    .aborted_in_flight
                    .insert(unit(u), usize::from(tasks % 4));
            }
            Step::EndTasks { gw: g, unit: u } => sim.end_aborted_tasks(gw(g), unit(u)),
            Step::RefuseRejoins(r) => sim.refuse_reconnect = r,
            Step::Advance(ms) => sim.advance(Duration::from_millis(u64::from(ms) * 10)),
            Step::Prefer {
                gw: g,
                unit: u,
                group,
                other,
            } => {
                n += 1;
                let c = change_id(unit(u), n);
                submitted[gw(g)].push(c);
                let mut requests = vec![TargetPortGroupRequest {
                    group: u16::from(group % 5),
                    state: AccessState::ActiveOptimized,
                    offset: 4,
                }];
                if let Some((group, state)) = other {
                    requests.push(TargetPortGroupRequest {
                        group: u16::from(group % 5),
                        state: [
                            AccessState::ActiveNonOptimized,
                            AccessState::Standby,
                            AccessState::Unavailable,
                        ][usize::from(state % 3)],
                        offset: 8,
                    });
                }
                sim.submit_port_groups(gw(g), c, unit(u), &requests);
            }
            Step::Nvme { .. } => {}
            Step::Slow { gw: g, tenths } => {
                let delay = Duration::from_millis(u64::from(tenths % 20) * 100);
                // At the timeout's edge counts as late: the clock moves in 100 ms steps.
                may_be_fenced[gw(g)] |= delay + Duration::from_millis(100) >= timeout;
                sim.nodes[gw(g)].ack_delay = delay;
            }
        }
        sim.run();
    }
    for g in 0..GATEWAYS {
        assert!(
            may_be_fenced[g] || !sim.blocklist.contains(&instances[g]),
            "gw{g} was fenced though it was never silent, late or holding aborted tasks"
        );
    }
    // Quiet: everyone runs, answers at once, tasks end, rejoins succeed, time passes.
    sim.refuse_reconnect = false;
    for n in sim.nodes.iter_mut() {
        n.ack_delay = Duration::ZERO;
    }
    for g in 0..GATEWAYS {
        sim.wake(g);
        for u in 0..UNITS {
            sim.end_aborted_tasks(g, u);
        }
    }
    sim.advance(Duration::from_secs(70));
    for (g, changes) in submitted.iter().enumerate() {
        for c in changes {
            assert!(
                sim.nodes[g].decided.iter().any(|(d, _)| d == c),
                "change {c:#x} on gw{g} never decided"
            );
        }
    }
    // Every gateway gives each unit the same port groups (an initiator's choice included).
    for u in 0..UNITS {
        let groups: Vec<_> = sim.nodes.iter().map(|n| n.groups.get(&u)).collect();
        for (g, gr) in groups.iter().enumerate() {
            assert_eq!(
                *gr, groups[0],
                "gw{g}'s port groups of unit {u} after all is quiet"
            );
        }
    }
    for u in 0..UNITS {
        let states: Vec<_> = sim
            .nodes
            .iter()
            .map(|n| n.applied.get(&u).map(|(v, s)| (*v, s.clone())))
            .collect();
        let newest = states.iter().flatten().map(|(v, _)| *v).max();
        for (g, s) in states.iter().enumerate() {
            if let (Some(newest), Some((v, _))) = (newest, s) {
                assert_eq!(
                    *v, newest,
                    "gw{g} holds an old state of unit {u} after all is quiet"
                );
            }
        }
    }
});
