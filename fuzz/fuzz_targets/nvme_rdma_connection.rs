//! The controller's end of an NVMe/RDMA queue with its commands carried out (the connection
//! every transport shares over `RdmaQueue`, a subsystem with one namespace, and the block
//! operations and RDMA work a shell runs) fed arbitrary steps on a virtual clock: raw
//! capsules, Connect with its data by keyed SGL, any command with a keyed, in-capsule or
//! foreign SGL, well-formed NVM commands, buffers granted or refused, RDMA READs ending well
//! or not, block operations ending well or badly, time passing, the connection closing. It
//! never panics; every block operation stays within the namespace with a buffer as long as
//! it needs; every RDMA READ and WRITE stays within the keyed SGL its command named (never
//! more than the host registered); each command is answered at most once per arrival; and
//! no more commands end than were started.
#![no_main]

use std::collections::HashMap;
use std::time::{Duration, Instant};

use arbitrary::Arbitrary;
use libfuzzer_sys::fuzz_target;
use nvme::controller::{Subsystem, SubsystemConfig};
use nvme::fabrics::CNTLID_DYNAMIC;
use nvme::opcode::NvmOpcode;
use nvme::rdma::{ControllerConnection, Keyed, RdmaQueue, Work};
use nvme::sqe::{Sgl, Sqe};
use nvme::testing;
use scsi_core::transport::Event;
use scsi_core::{BackendError, Output, TaskId};

const NQN: &str = "nqn.2026-11.io.example:fuzz";
const HOST: &str = "nqn.2014-08.org.nvmexpress:uuid:fuzz";
const BLOCK: u32 = 512;
const BLOCKS: u64 = 256;
const IN_CAPSULE: u32 = 4096;

#[derive(Arbitrary, Debug)]
enum Sgls {
    Keyed { length: u16, key: u8 },
    InCapsule { length: u16 },
    Transport { length: u16 },
    Raw([u8; 16]),
}

#[derive(Arbitrary, Debug)]
enum Step {
    Raw(Vec<u8>),
    Connect {
        qid: u8,
        cntlid: Option<u8>,
        keyed: bool,
    },
    Command {
        sqe: [u8; 64],
        cid: u8,
        sgl: Sgls,
        data: u16,
    },
    Io {
        op: u8,
        cid: u8,
        slba: u16,
        nlb: u8,
        in_capsule: bool,
    },
    Grant {
        which: u8,
        refuse: bool,
    },
    /// Ends the oldest RDMA READ in flight.
    Read {
        fail: bool,
    },
    /// Ends the Connect data read in flight.
    ConnectData {
        fail: bool,
    },
    Finish {
        which: u8,
        fail: bool,
    },
    Advance(u16),
    Close,
}

/// The memory the host registered, by key: what each command's keyed SGL was allowed.
fn keyed(sqe: &Sqe) -> Option<(u32, Keyed)> {
    match sqe.sgl().kind() {
        nvme::sqe::SglKind::Keyed {
            address,
            length,
            key,
            ..
        } => Some((
            key,
            Keyed {
                address,
                key,
                length,
            },
        )),
        _ => None,
    }
}

fuzz_target!(|steps: Vec<Step>| {
    let mut sub = Subsystem::new(SubsystemConfig {
        serial: "fuzz".into(),
        max_io_queues: 2,
        max_queue_entries: 64,
        mdts: 3,
        max_in_capsule_data: IN_CAPSULE,
        ..testing::subsystem_config(NQN, &[HOST])
    });
    sub.add_namespace(testing::namespace(1, BLOCK, BLOCKS));
    let mut now = Instant::now();
    let cntlid = {
        let sqe = testing::connect_sqe(1, 0, 31, 5000, 0);
        let data = testing::connect_data([3; 16], CNTLID_DYNAMIC, NQN, HOST);
        let (admin, _) = sub.connect(now, &sqe, &data).expect("the admin queue");
        let _ = sub.command(now, &admin, &testing::enable_sqe(2), &[]);
        admin.cntlid
    };
    let mut c: ControllerConnection<Vec<u8>> = ControllerConnection::on(RdmaQueue::new(IN_CAPSULE));
    // Every region the host registered, by key (a later command may reuse a key: the
    // larger region counts, as the device would know it).
    let mut registered: HashMap<u32, Keyed> = HashMap::new();
    let mut wants: Vec<(u64, usize)> = Vec::new();
    let mut running: Vec<(TaskId, Vec<u8>)> = Vec::new();
    let mut reads: Vec<(u16, Vec<u8>)> = Vec::new();
    let mut connect_data: Option<Vec<u8>> = None;
    let mut connecting = false;
    let (mut started, mut ended) = (0usize, 0usize);
    let register = |sqe: &Sqe, registered: &mut HashMap<u32, Keyed>| {
        if let Some((key, k)) = keyed(sqe) {
            let r = registered.entry(key).or_insert(k);
            if k.address == r.address && k.length > r.length {
                r.length = k.length;
            }
        }
    };
    for step in steps.into_iter().take(64) {
        let capsule: Option<Vec<u8>> = match step {
            Step::Raw(b) => Some(b),
            Step::Connect {
                qid,
                cntlid: asked,
                keyed,
            } => {
                let mut sqe = testing::connect_sqe(7, u16::from(qid % 3), 31, 1000, 0);
                let asked = asked.map_or(cntlid, |c| u16::from(c % 3));
                let data = testing::connect_data([3; 16], asked, NQN, HOST);
                if keyed {
                    sqe.set_sgl(Sgl::keyed(0x1000, 1024, 0x99));
                    connect_data = Some(data);
                    Some(sqe.as_bytes().to_vec())
                } else {
                    let mut v = sqe.as_bytes().to_vec();
                    v.extend_from_slice(&data);
                    Some(v)
                }
            }
            Step::Command {
                sqe,
                cid,
                sgl,
                data,
            } => Sqe::parse(&sqe).map(|mut s| {
                s.set_cid(u16::from(cid % 16));
                let mut payload = Vec::new();
                s.set_sgl(match sgl {
                    Sgls::Keyed { length, key } => {
                        Sgl::keyed(u64::from(key) << 20, u32::from(length), u32::from(key))
                    }
                    Sgls::InCapsule { length } => {
                        payload = vec![0x11; usize::from(data % 5000)];
                        Sgl::in_capsule(0, u32::from(length))
                    }
                    Sgls::Transport { length } => Sgl::transport(u32::from(length)),
                    Sgls::Raw(b) => Sgl::from_bytes(b),
                });
                register(&s, &mut registered);
                let mut v = s.as_bytes().to_vec();
                v.extend_from_slice(&payload);
                v
            }),
            Step::Io {
                op,
                cid,
                slba,
                nlb,
                in_capsule,
            } => {
                let ops = [
                    NvmOpcode::Read,
                    NvmOpcode::Write,
                    NvmOpcode::Flush,
                    NvmOpcode::WriteZeroes,
                    NvmOpcode::DatasetManagement,
                    NvmOpcode::Compare,
                ];
                let op = ops[usize::from(op) % ops.len()];
                let cid = u16::from(cid % 16);
                let mut s = Sqe::new(op.code(), cid);
                s.set_nsid(1);
                s.set_qword(10, u64::from(slba % 300));
                s.set_cdw(12, u32::from(nlb % 40));
                let len = match op {
                    NvmOpcode::DatasetManagement => {
                        s.set_cdw(11, 1 << 2);
                        16
                    }
                    NvmOpcode::Read | NvmOpcode::Write | NvmOpcode::Compare => {
                        (u32::from(nlb % 40) + 1) * BLOCK
                    }
                    _ => 0,
                };
                let mut payload = Vec::new();
                if in_capsule && op != NvmOpcode::Read && len > 0 && len <= IN_CAPSULE {
                    s.set_sgl(Sgl::in_capsule(0, len));
                    payload = vec![0u8; len as usize];
                } else {
                    s.set_sgl(Sgl::keyed(
                        0x5000_0000 + u64::from(cid) * 0x10_0000,
                        len,
                        0x500 + u32::from(cid),
                    ));
                }
                register(&s, &mut registered);
                let mut v = s.as_bytes().to_vec();
                v.extend_from_slice(&payload);
                Some(v)
            }
            Step::Grant { which, refuse } => {
                if !wants.is_empty() {
                    let (tag, len) = wants.remove(usize::from(which) % wants.len());
                    let buffer = (!refuse).then(|| vec![0u8; len]);
                    c.handle_buffer(now, tag, buffer);
                }
                None
            }
            Step::Read { fail } => {
                if !reads.is_empty() {
                    let (cid, buffer) = reads.remove(0);
                    c.transport_mut().handle_read(cid, buffer, !fail);
                }
                None
            }
            Step::ConnectData { fail } => {
                if connecting {
                    connecting = false;
                    let data = connect_data.take().filter(|_| !fail);
                    c.transport_mut().handle_connect_data(data.as_deref());
                }
                None
            }
            Step::Finish { which, fail } => {
                if !running.is_empty() {
                    let (task, buffer) = running.remove(usize::from(which) % running.len());
                    let result = if fail {
                        Err(BackendError::Read { lba: 0 })
                    } else {
                        Ok(Output::Done)
                    };
                    c.handle_backend_done(now, task, buffer, result);
                }
                None
            }
            Step::Advance(ms) => {
                now += Duration::from_millis(u64::from(ms));
                c.handle_timeout(now, &mut sub);
                None
            }
            Step::Close => {
                c.close(&mut sub);
                None
            }
        };
        if let Some(capsule) = capsule {
            // An error ends the queue: the shell would disconnect.
            if c.transport_mut().handle_capsule(&capsule).is_err() {
                break;
            }
        }
        c.handle(now, &mut sub);
        while let Some(e) = c.poll_event() {
            match e {
                Event::BufferWanted { tag, len } => {
                    assert!(len <= 1 << 20, "a buffer of {len} bytes");
                    started += 1;
                    wants.push((tag, len));
                }
                Event::Backend {
                    task,
                    lun,
                    op,
                    buffer,
                } => {
                    assert_eq!(lun, 1, "only namespace 1 exists");
                    assert!(buffer.len() as u64 >= op.buffer_len(BLOCK), "{op:?}");
                    if let Some((lba, n)) = op.written_range() {
                        assert!(lba + n <= BLOCKS, "{op:?} past the end");
                    }
                    running.push((task, buffer));
                }
                Event::Completed(_) => ended += 1,
            }
        }
        assert_eq!(c.in_backend(), running.len(), "operations running");
        assert!(ended <= started, "{ended} ended of {started} started");
        let within = |r: &Keyed, registered: &HashMap<u32, Keyed>| {
            let k = registered.get(&r.key).expect("a key the host registered");
            assert!(
                r.address >= k.address
                    && r.address + u64::from(r.length) <= k.address + u64::from(k.length),
                "{r:?} outside {k:?}"
            );
        };
        while let Some(w) = c.transport_mut().poll_work() {
            match w {
                Work::Respond(_) => {}
                Work::Write {
                    payload, remote, ..
                } => {
                    assert_eq!(payload.len(), remote.length as usize);
                    within(&remote, &registered);
                }
                Work::Read {
                    cid,
                    buffer,
                    at,
                    len,
                    remote,
                } => {
                    assert_eq!(len, remote.length);
                    assert!(at + len as usize <= buffer.len(), "a read past its buffer");
                    within(&remote, &registered);
                    reads.push((cid, buffer));
                }
                Work::FetchConnectData { len, .. } => {
                    assert_eq!(len, 1024);
                    connecting = true;
                }
            }
        }
    }
});
