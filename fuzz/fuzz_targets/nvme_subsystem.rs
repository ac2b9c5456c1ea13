//! An NVM subsystem fed arbitrary commands on arbitrary connections and time passing on a
//! virtual clock, with 0 to 3 I/O queues allowed, as an NVM or a discovery subsystem:
//! Connects (admin and I/O, any NQN, queue, size, KATO), any SQE with any
//! in-capsule data, disconnects, keep alive deadlines. It never panics; every command gets
//! exactly one answer (a completion with its CID, data and a completion, an I/O command that
//! stays within the namespace, or held: only Asynchronous Event Requests, at most four per
//! controller, and Preempt and Abort; or, for a reservation command whose data is not in the
//! capsule, a fetch of at most 4 KiB, then answered once the data is handed over); a
//! controller whose keep alive lapsed answers nothing but Keep Alive Timer Expired. Two hosts
//! (two Host Identifiers) share the namespace, so reservations made by one fence the other;
//! connections say at any step that the commands a Preempt and Abort aborted have ended, and
//! at the end every Preempt and Abort held is answered once every queue has said so. When
//! the namespace's reservations are shared by a cluster of gateways, every Register, Acquire
//! and Release is held for the shell and answered once a step decides it (on a state the
//! step keeps, as the cluster would) or refuses it; at the end every one is answered.
#![no_main]

use std::time::{Duration, Instant};

use arbitrary::Arbitrary;
use libfuzzer_sys::fuzz_target;
use nvme::controller::{Answer, Namespace, Queue, Subsystem, SubsystemConfig, MAX_AERS};
use nvme::fabrics::CNTLID_DYNAMIC;
use nvme::nvm::IoCommand;
use nvme::opcode::AdminOpcode;
use nvme::sqe::{Sgl, Sqe};
use nvme::testing;
use nvme::Status;
use scsi_core::pr::PrState;

const NQN: &str = "nqn.2026-11.io.example:fuzz";
const HOST: &str = "nqn.2014-08.org.nvmexpress:uuid:fuzz";
const BLOCKS: u64 = 1024;

#[derive(Arbitrary, Debug)]
enum Step {
    Connect {
        conn: u8,
        qid: u8,
        sqsize: u8,
        kato: u16,
        cntlid: Option<u8>,
        other_host: bool,
        other_subsystem: bool,
        second_hostid: bool,
    },
    Command {
        conn: u8,
        sqe: [u8; 64],
        data: Vec<u8>,
        transport_sgl: bool,
    },
    Disconnect(u8),
    Advance(u16),
    /// A connection carries out what a Preempt and Abort asks of it and takes completions.
    Abort(u8),
    /// The cluster decides the next shared reservation change (refuses it, when set, as an
    /// unreachable cluster would).
    Decide {
        refuse: bool,
    },
    /// The shell sets an ANA group's state (a gateway of a cluster joined or left).
    Ana {
        group: u8,
        state: u8,
    },
}

/// Every queue's connection says its aborted commands have ended; the completions of held
/// commands that are ready, by queue.
fn settle(s: &mut Subsystem, live: &[Queue], done: &mut Vec<(Queue, u16)>, shared: bool) {
    for q in live {
        while let Some((id, nsid)) = s.poll_abort(q) {
            assert_eq!(nsid, 1);
            s.aborted(q, id);
        }
    }
    for q in live {
        while let Some(c) = s.poll_completion(q) {
            // A shared change the cluster refused ends with its refusal.
            assert!(c.status.is_success() || shared);
            done.push((*q, c.cid));
        }
    }
}

/// What the cluster does with the next shared reservation change: decides it on `cluster`
/// (applying what it decided here at the next version) or refuses it. Whether there was one.
fn decide(s: &mut Subsystem, cluster: &mut PrState, version: &mut u64, refuse: bool) -> bool {
    let Some(ask) = s.poll_shared_reservation() else {
        return false;
    };
    assert!(!matches!(
        ask.command,
        nvme::reservation::ReservationCommand::Report { .. }
    ));
    let mut next = cluster.clone();
    let decided = nvme::reservation::apply(&mut next, &ask.host, &ask.command, &ask.data, true);
    match decided {
        _ if refuse => s.shared_reservation_done(ask.id, Err(Status::NAMESPACE_NOT_READY)),
        Ok(fx) => {
            *cluster = next;
            *version += 1;
            assert!(s.apply_shared_reservations(ask.nsid, *version, cluster.clone(), &fx));
            s.shared_reservation_done(ask.id, Ok(()));
        }
        Err(status) => s.shared_reservation_done(ask.id, Err(status)),
    }
    true
}

fuzz_target!(|input: (u8, bool, bool, Vec<Step>)| {
    // The subsystem's own terms: 0 to 3 I/O queues; an NVM or a discovery subsystem; the
    // namespace's reservations its own or a cluster's.
    let (io_queues, discovery, shared, steps) = input;
    let config = SubsystemConfig {
        serial: "fuzz".into(),
        max_io_queues: u16::from(io_queues % 4),
        max_queue_entries: 64,
        mdts: 3,
        ..testing::subsystem_config(NQN, &[HOST])
    };
    let mut s = if discovery {
        Subsystem::discovery(config)
    } else {
        Subsystem::new(config)
    };
    let nqn = s.config().nqn.clone();
    s.add_namespace(Namespace {
        shared_reservations: shared,
        ..testing::namespace(1, 512, BLOCKS)
    });
    let (mut cluster, mut version) = (PrState::default(), 0u64);
    let mut now = Instant::now();
    let mut conns: [Option<Queue>; 4] = [None; 4];
    let mut expired: Vec<u16> = Vec::new();
    // Queues connected and not disconnected; Preempt and Abort commands held, and answered.
    let mut live: Vec<Queue> = Vec::new();
    let mut held: Vec<(Queue, u16)> = Vec::new();
    let mut answered: Vec<(Queue, u16)> = Vec::new();
    for step in steps.into_iter().take(64) {
        match step {
            Step::Connect {
                conn,
                qid,
                sqsize,
                kato,
                cntlid,
                other_host,
                other_subsystem,
                second_hostid,
            } => {
                let c = usize::from(conn % 4);
                let sqe = testing::connect_sqe(
                    9,
                    u16::from(qid % 4),
                    u16::from(sqsize),
                    u32::from(kato),
                    0,
                );
                let subnqn = if other_subsystem {
                    "nqn.2026-11.x:y"
                } else {
                    nqn.as_str()
                };
                let hostnqn = if other_host { "nqn.2026-11.x:h" } else { HOST };
                let hostid = if second_hostid { [4; 16] } else { [3; 16] };
                let asked = cntlid.map_or(CNTLID_DYNAMIC, |c| u16::from(c % 4));
                let data = testing::connect_data(hostid, asked, subnqn, hostnqn);
                match s.connect(now, &sqe, &data[..]) {
                    Ok((q, cqe)) => {
                        assert!(cqe.status.is_success() && cqe.cid == 9);
                        // A discovery subsystem admits any host.
                        assert!((!other_host || discovery) && !other_subsystem);
                        conns[c] = Some(q);
                        live.push(q);
                    }
                    Err(cqe) => assert!(!cqe.status.is_success() && cqe.cid == 9),
                }
            }
            Step::Command {
                conn,
                sqe,
                data,
                transport_sgl,
            } => {
                let Some(q) = conns[usize::from(conn % 4)] else {
                    continue;
                };
                let mut sqe = Sqe::parse(&sqe).expect("64 bytes");
                if transport_sgl {
                    let len = sqe.sgl().length() % 16384;
                    sqe.set_sgl(Sgl::transport(len));
                }
                let cid = sqe.cid();
                let was_expired = expired.contains(&q.cntlid);
                let mut answer = s.command(now, &q, &sqe, &data);
                if let Answer::Fetch { len } = answer {
                    assert!(nvme::reservation::is_reservation(sqe.opcode()) && q.qid != 0);
                    assert!(len <= 4096);
                    answer = s.fetched(&q, &sqe, &data);
                    assert!(!matches!(answer, Answer::Fetch { .. } | Answer::Io { .. }));
                }
                match answer {
                    Answer::Fetch { .. } => unreachable!("fetched above"),
                    Answer::Complete(c) => {
                        assert_eq!(c.cid, cid);
                        if was_expired {
                            assert!(
                                matches!(
                                    c.status,
                                    Status::KEEP_ALIVE_EXPIRED | Status::COMMAND_SEQUENCE_ERROR
                                ) || sqe.opcode() == AdminOpcode::Fabrics.code()
                            );
                        }
                    }
                    Answer::Data { data, cqe } => {
                        assert_eq!(cqe.cid, cid);
                        assert!(data.len() < 16384);
                    }
                    Answer::Io { nsid, command } => {
                        assert!(!was_expired);
                        assert_eq!(nsid, 1);
                        if let IoCommand::Op { op, .. } = command {
                            if let scsi_core::Op::Read { lba, blocks, .. }
                            | scsi_core::Op::Write { lba, blocks, .. } = op
                            {
                                assert!(lba + u64::from(blocks) <= BLOCKS, "{op:?}");
                            }
                        }
                    }
                    Answer::Held if q.qid != 0 && shared => {
                        // For the cluster to decide.
                        assert!(nvme::reservation::is_reservation(sqe.opcode()));
                        held.push((q, cid));
                    }
                    Answer::Held if q.qid != 0 => {
                        // Preempt and Abort, waiting for the preempted host's queues.
                        assert_eq!(
                            sqe.opcode(),
                            nvme::opcode::NvmOpcode::ReservationAcquire.code()
                        );
                        assert_eq!(sqe.cdw(10) & 7, 2);
                        held.push((q, cid));
                    }
                    Answer::Held => {
                        assert_eq!(sqe.opcode(), AdminOpcode::AsyncEventRequest.code());
                        assert_eq!(q.qid, 0);
                        let held = s.take_async_event_requests(q.cntlid);
                        assert!(held.len() <= MAX_AERS && held.contains(&cid));
                    }
                }
            }
            Step::Disconnect(conn) => {
                if let Some(q) = conns[usize::from(conn % 4)].take() {
                    s.disconnect(&q);
                    // The admin queue takes its controller's queues with it.
                    let gone = |o: &Queue| o.cntlid == q.cntlid && (q.qid == 0 || o.qid == q.qid);
                    live.retain(|o| !gone(o));
                    held.retain(|(o, _)| !gone(o));
                }
            }
            Step::Abort(conn) => {
                if let Some(q) = conns[usize::from(conn % 4)] {
                    settle(&mut s, &[q], &mut answered, shared);
                }
            }
            Step::Decide { refuse } => {
                decide(&mut s, &mut cluster, &mut version, refuse);
            }
            Step::Ana { group, state } => {
                use nvme::ana::AnaState;
                let state = [
                    AnaState::Optimized,
                    AnaState::NonOptimized,
                    AnaState::Inaccessible,
                    AnaState::PersistentLoss,
                    AnaState::Change,
                ][usize::from(state % 5)];
                let group = u32::from(group % 3) + 1;
                s.set_ana_state(group, state);
                assert_eq!(s.ana_state(group), state);
            }
            Step::Advance(ms) => {
                now += Duration::from_millis(u64::from(ms) * 10);
                if s.poll_timeout().is_some_and(|t| t <= now) {
                    expired.extend(s.handle_timeout(now));
                }
            }
        }
    }
    // The cluster decides what is left, and every queue says its aborted commands ended:
    // every command still held by a controller that is there is answered, once.
    while decide(&mut s, &mut cluster, &mut version, false) {}
    settle(&mut s, &live, &mut answered, shared);
    for (q, cid) in &held {
        let there = s.controllers().any(|(id, _)| id == q.cntlid);
        let n = answered.iter().filter(|(o, c)| o == q && c == cid).count();
        assert!(
            !there || n >= 1,
            "held command {cid} on {q:?} never answered"
        );
    }
    for (q, cid) in &answered {
        assert!(
            held.contains(&(*q, *cid)),
            "an answer nobody waited for: {cid} on {q:?}"
        );
    }
});
