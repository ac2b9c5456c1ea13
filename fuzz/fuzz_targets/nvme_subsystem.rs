//! An NVM subsystem fed arbitrary commands on arbitrary connections and time passing on a
//! virtual clock, with 0 to 3 I/O queues allowed, as an NVM or a discovery subsystem:
//! Connects (admin and I/O, any NQN, queue, size, KATO), any SQE with any
//! in-capsule data, disconnects, keep alive deadlines. It never panics; every command gets
//! exactly one answer (a completion with its CID, data and a completion, an I/O command that
//! stays within the namespace, or held: only Asynchronous Event Requests, at most four per
//! controller); a controller whose keep alive lapsed answers nothing but Keep Alive Timer
//! Expired.
#![no_main]

use std::time::{Duration, Instant};

use arbitrary::Arbitrary;
use libfuzzer_sys::fuzz_target;
use nvme::controller::{Answer, Namespace, Queue, Subsystem, SubsystemConfig, MAX_AERS};
use nvme::fabrics::{Connect, ConnectData, CNTLID_DYNAMIC};
use nvme::nvm::{IoCommand, NamespaceGeometry};
use nvme::opcode::{AdminOpcode, FabricsType};
use nvme::sqe::{Sgl, Sqe};
use nvme::Status;

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
    },
    Command {
        conn: u8,
        sqe: [u8; 64],
        data: Vec<u8>,
        transport_sgl: bool,
    },
    Disconnect(u8),
    Advance(u16),
}

fuzz_target!(|input: (u8, bool, Vec<Step>)| {
    // The subsystem's own terms: 0 to 3 I/O queues; an NVM or a discovery subsystem.
    let (io_queues, discovery, steps) = input;
    let config = SubsystemConfig {
        nqn: NQN.into(),
        serial: "fuzz".into(),
        model: "targetd".into(),
        firmware: "0.1.0".into(),
        hosts: vec![HOST.into()],
        max_io_queues: u16::from(io_queues % 4),
        max_queue_entries: 64,
        max_in_capsule_data: 8192,
        mdts: 3,
    };
    let mut s = if discovery {
        Subsystem::discovery(config)
    } else {
        Subsystem::new(config)
    };
    let nqn = s.config().nqn.clone();
    s.add_namespace(Namespace {
        nsid: 1,
        geometry: NamespaceGeometry {
            block_size: 512,
            blocks: BLOCKS,
            read_only: false,
        },
        nguid: [1; 16],
        uuid: [2; 16],
        thin: true,
        write_cache: true,
    });
    let mut now = Instant::now();
    let mut conns: [Option<Queue>; 4] = [None; 4];
    let mut expired: Vec<u16> = Vec::new();
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
            } => {
                let c = usize::from(conn % 4);
                let mut sqe = Sqe::new(AdminOpcode::Fabrics.code(), 9);
                sqe.set_fctype(FabricsType::Connect.code());
                Connect {
                    recfmt: 0,
                    qid: u16::from(qid % 4),
                    sqsize: u16::from(sqsize),
                    cattr: 0,
                    kato: u32::from(kato),
                }
                .to_sqe(&mut sqe);
                let data = ConnectData {
                    hostid: [3; 16],
                    cntlid: cntlid.map_or(CNTLID_DYNAMIC, |c| u16::from(c % 4)),
                    subnqn: if other_subsystem {
                        "nqn.2026-11.x:y"
                    } else {
                        nqn.as_str()
                    }
                    .into(),
                    hostnqn: if other_host { "nqn.2026-11.x:h" } else { HOST }.into(),
                }
                .to_bytes();
                match s.connect(now, &sqe, &data[..]) {
                    Ok((q, cqe)) => {
                        assert!(cqe.status.is_success() && cqe.cid == 9);
                        // A discovery subsystem admits any host.
                        assert!((!other_host || discovery) && !other_subsystem);
                        conns[c] = Some(q);
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
                match s.command(now, &q, &sqe, &data) {
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
                }
            }
            Step::Advance(ms) => {
                now += Duration::from_millis(u64::from(ms) * 10);
                if s.poll_timeout().is_some_and(|t| t <= now) {
                    expired.extend(s.handle_timeout(now));
                }
            }
        }
    }
});
