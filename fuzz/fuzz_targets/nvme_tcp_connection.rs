//! The controller's end of an NVMe/TCP connection with its commands carried out
//! (`ControllerConnection`: the queue machine, a subsystem with one namespace, and the block
//! operations a shell runs) fed arbitrary steps on a virtual clock: raw bytes, well-framed
//! PDUs with arbitrary fields (ICReq, Connect, any command capsule, H2CData), buffers granted
//! or refused, block operations ending well or badly, time passing, the connection closing.
//! It never panics; every block operation it asks for stays within the namespace and comes
//! with a buffer as long as the operation needs; it counts as running exactly the operations
//! the shell holds; each finished command is counted once, and never more commands than were
//! started; and what it sends reads back on a host's deframer.
#![no_main]

use std::time::{Duration, Instant};

use arbitrary::Arbitrary;
use libfuzzer_sys::fuzz_target;
use nvme::controller::{Subsystem, SubsystemConfig};
use nvme::fabrics::CNTLID_DYNAMIC;
use nvme::opcode::NvmOpcode;
use nvme::sqe::{Sgl, Sqe};
use nvme::tcp::pdu::{data_digest, encode, DataHeader, Digests, Framing, Header, IcReq};
use nvme::tcp::{ControllerConnection, Deframer, Limits, QueueSettings, Side};
use nvme::testing;
use scsi_core::transport::Event;
use scsi_core::{BackendError, Output, TaskId};

const NQN: &str = "nqn.2026-11.io.example:fuzz";
const HOST: &str = "nqn.2014-08.org.nvmexpress:uuid:fuzz";
const BLOCK: u32 = 512;
const BLOCKS: u64 = 256;

#[derive(Arbitrary, Debug)]
enum Step {
    Raw(Vec<u8>),
    IcReq {
        header_digest: bool,
        data_digest: bool,
    },
    Connect {
        qid: u8,
        cntlid: Option<u8>,
    },
    Command {
        sqe: [u8; 64],
        cid: u8,
        data: u16,
        transport_sgl: bool,
    },
    /// A well-formed NVM command: one of the opcodes the namespace runs.
    Io {
        op: u8,
        cid: u8,
        slba: u16,
        nlb: u8,
        in_capsule: bool,
    },
    H2CData {
        cid: u8,
        ttag: u8,
        datao: u16,
        datal: u16,
        last: bool,
    },
    Grant {
        which: u8,
        refuse: bool,
    },
    Finish {
        which: u8,
        fail: bool,
    },
    Advance(u16),
    Close,
}

fuzz_target!(|steps: Vec<Step>| {
    let mut sub = Subsystem::new(SubsystemConfig {
        serial: "fuzz".into(),
        max_io_queues: 2,
        max_queue_entries: 64,
        mdts: 3,
        ..testing::subsystem_config(NQN, &[HOST])
    });
    sub.add_namespace(testing::namespace(1, BLOCK, BLOCKS));
    let mut now = Instant::now();
    // A controller enabled through its admin queue elsewhere: the fuzzed connection may join
    // it as an I/O queue and run block operations.
    let cntlid = {
        let sqe = testing::connect_sqe(1, 0, 31, 5000, 0);
        let data = testing::connect_data([3; 16], CNTLID_DYNAMIC, NQN, HOST);
        let (admin, _) = sub.connect(now, &sqe, &data).expect("the admin queue");
        let _ = sub.command(now, &admin, &testing::enable_sqe(2), &[]);
        admin.cntlid
    };
    let mut c: ControllerConnection<Vec<u8>> = ControllerConnection::new(QueueSettings::default());
    let mut framing = Framing::default();
    let mut host = Deframer::new(Side::Host);
    let mut wants: Vec<(u64, usize)> = Vec::new();
    let mut running: Vec<(TaskId, Vec<u8>)> = Vec::new();
    let (mut started, mut ended) = (0usize, 0usize);
    for step in steps.into_iter().take(64) {
        let framed = |h: Header, data: &[u8], framing: &Framing| -> Option<Vec<u8>> {
            let e = encode(&h, data.len() as u32, framing)?;
            let mut v = e.to_vec();
            v.extend_from_slice(data);
            if e.needs_data_digest() {
                v.extend_from_slice(&data_digest([data]));
            }
            Some(v)
        };
        let bytes = match step {
            Step::Raw(b) => Some(b),
            Step::IcReq {
                header_digest,
                data_digest,
            } => {
                let digests = Digests {
                    header: header_digest,
                    data: data_digest,
                };
                let b = framed(
                    Header::IcReq(IcReq {
                        pfv: 0,
                        hpda: 0,
                        digests,
                        maxr2t: 0,
                    }),
                    &[],
                    &Framing::default(),
                );
                framing = Framing { digests, pda: 0 };
                b
            }
            Step::Connect { qid, cntlid: asked } => {
                let sqe = testing::connect_sqe(7, u16::from(qid % 3), 31, 1000, 0);
                let asked = asked.map_or(cntlid, |c| u16::from(c % 3));
                let data = testing::connect_data([3; 16], asked, NQN, HOST);
                framed(Header::CapsuleCmd(sqe), &data, &framing)
            }
            Step::Command {
                sqe,
                cid,
                data,
                transport_sgl,
            } => Sqe::parse(&sqe).and_then(|mut s| {
                s.set_cid(u16::from(cid % 16));
                let len = u32::from(data % 9000);
                let payload = if transport_sgl {
                    s.set_sgl(Sgl::transport(len));
                    Vec::new()
                } else {
                    s.set_sgl(Sgl::in_capsule(0, len));
                    vec![0x11; len as usize]
                };
                framed(Header::CapsuleCmd(s), &payload, &framing)
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
                    NvmOpcode::Verify,
                ];
                let op = ops[usize::from(op) % ops.len()];
                let mut s = Sqe::new(op.code(), u16::from(cid % 16));
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
                let to_host = op == NvmOpcode::Read;
                let payload = if in_capsule && !to_host && len > 0 {
                    s.set_sgl(Sgl::in_capsule(0, len));
                    let mut d = vec![0u8; len as usize];
                    if op == NvmOpcode::DatasetManagement {
                        d[4..8].copy_from_slice(&u32::from(nlb).to_le_bytes());
                        d[8..16].copy_from_slice(&u64::from(slba % 300).to_le_bytes());
                    }
                    d
                } else {
                    s.set_sgl(Sgl::transport(len));
                    Vec::new()
                };
                framed(Header::CapsuleCmd(s), &payload, &framing)
            }
            Step::H2CData {
                cid,
                ttag,
                datao,
                datal,
                last,
            } => {
                let datal = u32::from(datal % 9000);
                framed(
                    Header::H2CData(DataHeader {
                        cccid: u16::from(cid % 16),
                        ttag: u16::from(ttag % 4),
                        datao: u32::from(datao),
                        datal,
                        last,
                        success: false,
                    }),
                    &vec![0x22u8; datal as usize],
                    &framing,
                )
            }
            Step::Grant { which, refuse } => {
                if !wants.is_empty() {
                    let (tag, len) = wants.remove(usize::from(which) % wants.len());
                    let buffer = (!refuse).then(|| vec![0u8; len]);
                    c.handle_buffer(now, tag, buffer);
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
        if let Some(b) = bytes {
            c.receive(&b);
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
                    if let scsi_core::Op::Read { lba, blocks, .. } = op {
                        assert!(lba + u64::from(blocks) <= BLOCKS, "{op:?} past the end");
                    }
                    running.push((task, buffer));
                }
                Event::Completed(_) => ended += 1,
            }
        }
        assert_eq!(c.in_backend(), running.len(), "operations running");
        assert!(ended <= started, "{ended} ended of {started} started");
        while let Some(t) = c.poll_transmit() {
            for s in t.slices() {
                host.feed(s);
            }
            loop {
                match host.next_pdu() {
                    Ok(Some(p)) => {
                        if let Header::IcResp(r) = p.header {
                            host.set_limits(Limits {
                                digests: r.digests,
                                pda: 0,
                                max_data: 1 << 21,
                            });
                        }
                    }
                    Ok(None) => break,
                    Err(e) => panic!("the controller sent what a host cannot read: {e:?}"),
                }
            }
        }
    }
});
