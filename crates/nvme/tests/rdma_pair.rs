//! A host and a controller of NVMe/RDMA, machine against machine, with no queue pair: the
//! host side here builds capsules as Linux's nvme-rdma does (a Keyed SGL Data Block naming
//! memory it registered, in-capsule data for small writes) and keeps its registered memory
//! by key; the controller's end is the connection every transport shares over the RDMA
//! queue machine (`nvme::rdma::ControllerConnection`), joined to a `Subsystem`, whose block
//! operations and RDMA work a small shell in this test carries out on an in-memory namespace,
//! checking each RDMA READ and WRITE against the key, bounds and access as a device would.

use std::collections::HashMap;
use std::time::Instant;

use nvme::controller::{Subsystem, SubsystemConfig};
use nvme::fabrics::CNTLID_DYNAMIC;
use nvme::opcode::{AdminOpcode, NvmOpcode};
use nvme::rdma::{CapsuleError, ControllerConnection, Keyed, RdmaQueue, Work};
use nvme::sqe::{Sgl, Sqe};
use nvme::transport::Payload;
use nvme::{testing, Cqe, Status};
use scsi_core::transport::Event;
use scsi_core::{MemoryBackend, Op, TaskId};

const NQN: &str = "nqn.2026-11.io.example:rdma-pair";
const HOST: &str = "nqn.2014-08.org.nvmexpress:uuid:rdma-pair-host";
const BLOCK: u32 = 512;
const BLOCKS: u64 = 4096;
const IN_CAPSULE: u32 = 4096;

/// A region the host registered: its bytes, and whether the controller may read and write it.
struct Region {
    base: u64,
    bytes: Vec<u8>,
    remote_read: bool,
    remote_write: bool,
}

/// One queue: the host's memory and what came back, and the controller's end.
struct Link {
    conn: ControllerConnection<Vec<u8>>,
    regions: HashMap<u32, Region>,
    next_key: u32,
    done: HashMap<u16, Cqe>,
    /// RDMA READs and WRITEs the shell carried out, and those the "device" refused.
    moved: (usize, usize),
    hold: bool,
    held: Vec<(TaskId, Op, Vec<u8>)>,
}

struct Rig {
    now: Instant,
    subsystem: Subsystem,
    medium: MemoryBackend,
}

impl Link {
    /// Registers `bytes` for the controller to read (`remote_read`) or write: the keyed SGL
    /// naming it.
    fn register(&mut self, bytes: Vec<u8>, remote_read: bool) -> Sgl {
        self.next_key += 0x101;
        let key = self.next_key;
        let base = 0x7f00_0000_0000 + u64::from(key) * 0x10_0000;
        let len = bytes.len() as u32;
        self.regions.insert(
            key,
            Region {
                base,
                bytes,
                remote_read,
                remote_write: !remote_read,
            },
        );
        Sgl::keyed(base, len, key)
    }

    /// The bytes of the region `sgl` names.
    fn region(&self, sgl: &Sgl) -> &[u8] {
        let key = u32::from_le_bytes(sgl.to_bytes()[11..15].try_into().unwrap());
        &self.regions[&key].bytes
    }

    /// The device's check of an RDMA READ or WRITE of `remote`.
    fn reach(&mut self, remote: &Keyed, write: bool) -> Option<&mut [u8]> {
        let r = self.regions.get_mut(&remote.key)?;
        let allowed = if write { r.remote_write } else { r.remote_read };
        let at = remote.address.checked_sub(r.base)? as usize;
        let end = at.checked_add(remote.length as usize)?;
        (allowed && end <= r.bytes.len()).then(|| &mut r.bytes[at..end])
    }
}

impl Rig {
    fn new() -> Rig {
        let mut subsystem = Subsystem::new(SubsystemConfig {
            max_io_queues: 2,
            max_in_capsule_data: IN_CAPSULE,
            ..testing::subsystem_config(NQN, &[HOST])
        });
        subsystem.add_namespace(testing::namespace(1, BLOCK, BLOCKS));
        Rig {
            now: Instant::now(),
            subsystem,
            medium: MemoryBackend::new(BLOCK, BLOCKS),
        }
    }

    fn link(&self) -> Link {
        Link {
            conn: ControllerConnection::on(RdmaQueue::new(IN_CAPSULE)),
            regions: HashMap::new(),
            next_key: 0x1000,
            done: HashMap::new(),
            moved: (0, 0),
            hold: false,
            held: Vec::new(),
        }
    }

    /// Sends a capsule: the SQE and in-capsule data, in one SEND.
    fn send(&mut self, l: &mut Link, sqe: &Sqe, data: &[u8]) -> Result<(), CapsuleError> {
        let mut capsule = sqe.as_bytes().to_vec();
        capsule.extend_from_slice(data);
        l.conn.transport_mut().handle_capsule(&capsule)?;
        self.run(l);
        Ok(())
    }

    /// Carries out what the controller's end asks, until nothing moves.
    fn run(&mut self, l: &mut Link) {
        loop {
            let mut moved = false;
            l.conn.handle(self.now, &mut self.subsystem);
            while let Some(e) = l.conn.poll_event() {
                moved = true;
                match e {
                    Event::BufferWanted { tag, len } => {
                        l.conn.handle_buffer(self.now, tag, Some(vec![0; len]))
                    }
                    Event::Backend {
                        task, op, buffer, ..
                    } if l.hold => l.held.push((task, op, buffer)),
                    Event::Backend {
                        task,
                        op,
                        mut buffer,
                        ..
                    } => {
                        let result = self.medium.execute(&op, &mut buffer);
                        l.conn.handle_backend_done(self.now, task, buffer, result);
                    }
                    Event::Completed(_) => {}
                }
            }
            while let Some(w) = l.conn.transport_mut().poll_work() {
                moved = true;
                match w {
                    Work::Respond(cqe) => {
                        let cqe = Cqe::parse(&cqe.to_bytes()).unwrap();
                        assert!(l.done.insert(cqe.cid, cqe).is_none(), "two responses");
                    }
                    Work::Write {
                        payload, remote, ..
                    } => {
                        let data: &[u8] = match &payload {
                            Payload::Bytes(b) => b,
                            Payload::Buffer { buffer, len } => &buffer[..*len],
                        };
                        assert_eq!(data.len(), remote.length as usize);
                        let data = data.to_vec();
                        match l.reach(&remote, true) {
                            Some(dst) => {
                                dst.copy_from_slice(&data);
                                l.moved.0 += 1;
                            }
                            None => l.moved.1 += 1,
                        }
                    }
                    Work::Read {
                        cid,
                        mut buffer,
                        at,
                        len,
                        remote,
                    } => {
                        assert_eq!(len, remote.length);
                        let placed = match l.reach(&remote, false) {
                            Some(src) => {
                                buffer[at..at + len as usize].copy_from_slice(src);
                                l.moved.0 += 1;
                                true
                            }
                            None => {
                                l.moved.1 += 1;
                                false
                            }
                        };
                        l.conn.transport_mut().handle_read(cid, buffer, placed);
                    }
                    Work::FetchConnectData { remote, .. } => {
                        let data = l.reach(&remote, false).map(|d| d.to_vec());
                        l.conn.transport_mut().handle_connect_data(data.as_deref());
                    }
                }
            }
            if !moved && !l.conn.has_pending() {
                return;
            }
        }
    }

    /// Sends `sqe` and returns its completion.
    fn command(&mut self, l: &mut Link, sqe: Sqe, data: &[u8]) -> Cqe {
        let cid = sqe.cid();
        self.send(l, &sqe, data).unwrap();
        l.done.remove(&cid).expect("a completion")
    }

    /// Connect for queue `qid`, its data given by keyed SGL as Linux's nvme-rdma gives it.
    fn connect(&mut self, l: &mut Link, qid: u16, cntlid: u16) -> Cqe {
        let kato = if qid == 0 { 5000 } else { 0 };
        let mut sqe = testing::connect_sqe(100 + qid, qid, 31, kato, 0);
        let data = testing::connect_data([7; 16], cntlid, NQN, HOST);
        sqe.set_sgl(l.register(data, true));
        self.command(l, sqe, &[])
    }
}

fn io_cmd(op: NvmOpcode, cid: u16, slba: u64, blocks: u32, sgl: Sgl) -> Sqe {
    let mut s = Sqe::new(op.code(), cid);
    s.set_nsid(1);
    s.set_qword(10, slba);
    s.set_cdw(12, blocks - 1);
    s.set_sgl(sgl);
    s
}

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect()
}

/// The admin queue connected and the controller enabled; an I/O queue connected.
fn connected(rig: &mut Rig) -> (Link, Link) {
    let mut admin = rig.link();
    let c = rig.connect(&mut admin, 0, CNTLID_DYNAMIC);
    assert!(c.status.is_success(), "{c:?}");
    let cntlid = c.dw0 as u16;
    assert!(rig
        .command(&mut admin, testing::enable_sqe(1), &[])
        .status
        .is_success());
    let mut io = rig.link();
    let c = rig.connect(&mut io, 1, cntlid);
    assert!(c.status.is_success(), "{c:?}");
    (admin, io)
}

#[test]
fn a_host_connects_identifies_writes_and_reads_over_keyed_sgls_and_capsules() {
    let mut rig = Rig::new();
    let (mut admin, mut io) = connected(&mut rig);

    // Identify Controller into the host's memory by RDMA WRITE: the subsystem's NQN, and the
    // in-capsule data the I/O queues take (IOCCSZ, in 16-byte units with the SQE).
    let mut identify = Sqe::new(AdminOpcode::Identify.code(), 3);
    identify.set_cdw(10, 1);
    let sgl = admin.register(vec![0; 4096], false);
    identify.set_sgl(sgl);
    assert!(rig.command(&mut admin, identify, &[]).status.is_success());
    let id = admin.region(&sgl);
    assert_eq!(&id[768..768 + NQN.len()], NQN.as_bytes());
    let ioccsz = u32::from_le_bytes(id[1792..1796].try_into().unwrap());
    assert_eq!(ioccsz, (64 + IN_CAPSULE) / 16);

    // 64 KiB by RDMA READ of the host's memory; 4 KiB in the capsule; both read back by
    // RDMA WRITE.
    let big = pattern(65536, 1);
    let w = io_cmd(
        NvmOpcode::Write,
        10,
        64,
        128,
        io.register(big.clone(), true),
    );
    assert!(rig.command(&mut io, w, &[]).status.is_success());
    let small = pattern(4096, 2);
    let w = io_cmd(NvmOpcode::Write, 11, 8, 8, Sgl::in_capsule(0, 4096));
    assert!(rig.command(&mut io, w, &small).status.is_success());
    for (cid, slba, want) in [(12u16, 64u64, &big), (13, 8, &small)] {
        let blocks = want.len() as u32 / BLOCK;
        let sgl = io.register(vec![0; want.len()], false);
        let r = io_cmd(NvmOpcode::Read, cid, slba, blocks, sgl);
        assert!(rig.command(&mut io, r, &[]).status.is_success());
        assert_eq!(io.region(&sgl), &want[..]);
    }
    assert_eq!(io.moved, (3, 0));
    assert_eq!(io.conn.transport().keyed_in_flight(), 0);
    assert_eq!(io.conn.in_flight(), 0);
}

#[test]
fn descriptors_rdma_does_not_carry_and_short_keyed_sgls_are_refused_before_data_moves() {
    let mut rig = Rig::new();
    let (_admin, mut io) = connected(&mut rig);
    // A keyed SGL naming less than the command's blocks.
    let sgl = io.register(vec![0xaa; 1024], true);
    let w = io_cmd(NvmOpcode::Write, 20, 0, 4, sgl);
    assert_eq!(
        rig.command(&mut io, w, &[]).status,
        Status::DATA_SGL_LENGTH_INVALID
    );
    // NVMe/TCP's Transport SGL Data Block means nothing here.
    let r = io_cmd(NvmOpcode::Read, 21, 0, 1, Sgl::transport(512));
    assert_eq!(
        rig.command(&mut io, r, &[]).status,
        Status::SGL_DESCRIPTOR_TYPE_INVALID
    );
    // In-capsule data shorter than its SGL says.
    let w = io_cmd(NvmOpcode::Write, 22, 0, 2, Sgl::in_capsule(0, 1024));
    assert_eq!(
        rig.command(&mut io, w, &[1; 512]).status,
        Status::DATA_SGL_LENGTH_INVALID
    );
    assert_eq!(io.moved, (0, 0));
    assert_eq!(io.conn.transport().keyed_in_flight(), 0);

    // A capsule shorter than an SQE, or more in-capsule data than the queue takes, ends
    // the queue.
    let mut q: RdmaQueue<Vec<u8>> = RdmaQueue::new(IN_CAPSULE);
    assert_eq!(q.handle_capsule(&[0; 63]), Err(CapsuleError::Short(63)));
    let mut big = io_cmd(NvmOpcode::Write, 1, 0, 1, Sgl::in_capsule(0, 8192))
        .as_bytes()
        .to_vec();
    big.resize(64 + 8192, 0);
    assert!(matches!(
        q.handle_capsule(&big),
        Err(CapsuleError::TooMuchData { len: 8192, .. })
    ));
}

#[test]
fn a_read_of_memory_the_host_did_not_register_ends_the_command_and_writes_nothing() {
    let mut rig = Rig::new();
    let (_admin, mut io) = connected(&mut rig);
    let before = {
        let mut b = vec![0; 4096];
        rig.medium
            .execute(
                &Op::Read {
                    lba: 0,
                    blocks: 8,
                    offset: 0,
                    fua: false,
                },
                &mut b,
            )
            .unwrap();
        b
    };
    // Registered for the controller to write into, not to read: the device refuses the read.
    let sgl = io.register(pattern(4096, 9), false);
    let w = io_cmd(NvmOpcode::Write, 30, 0, 8, sgl);
    assert_eq!(
        rig.command(&mut io, w, &[]).status,
        Status::TRANSIENT_TRANSPORT_ERROR
    );
    assert_eq!(io.moved, (0, 1));
    let mut after = vec![0; 4096];
    rig.medium
        .execute(
            &Op::Read {
                lba: 0,
                blocks: 8,
                offset: 0,
                fua: false,
            },
            &mut after,
        )
        .unwrap();
    assert_eq!(before, after);
}

#[test]
fn a_command_reusing_a_cid_in_flight_is_refused_and_the_first_still_moves_its_data() {
    let mut rig = Rig::new();
    let (_admin, mut io) = connected(&mut rig);
    let data = pattern(2048, 4);
    let w = io_cmd(
        NvmOpcode::Write,
        40,
        100,
        4,
        io.register(data.clone(), true),
    );
    io.hold = true;
    rig.send(&mut io, &w, &[]).unwrap();
    assert_eq!(io.held.len(), 1);
    // The same CID again while the first's block operation runs.
    let sgl = io.register(vec![0; 512], false);
    let again = io_cmd(NvmOpcode::Read, 40, 0, 1, sgl);
    rig.send(&mut io, &again, &[]).unwrap();
    assert_eq!(
        io.done.remove(&40).map(|c| c.status),
        Some(Status::COMMAND_ID_CONFLICT)
    );
    io.hold = false;
    let (task, op, mut buffer) = io.held.pop().unwrap();
    let result = rig.medium.execute(&op, &mut buffer);
    io.conn.handle_backend_done(rig.now, task, buffer, result);
    rig.run(&mut io);
    assert!(io.done.remove(&40).unwrap().status.is_success());
    // Read back: the first command's data is on the medium, and a read through the same CID
    // now moves it.
    let sgl = io.register(vec![0; 2048], false);
    let r = io_cmd(NvmOpcode::Read, 40, 100, 4, sgl);
    assert!(rig.command(&mut io, r, &[]).status.is_success());
    assert_eq!(io.region(&sgl), &data[..]);
    assert_eq!(io.conn.transport().keyed_in_flight(), 0);
}

#[test]
fn a_capsule_while_connect_data_is_read_ends_the_queue() {
    let mut q: RdmaQueue<Vec<u8>> = RdmaQueue::new(IN_CAPSULE);
    let mut sqe = testing::connect_sqe(1, 0, 31, 5000, 0);
    sqe.set_sgl(Sgl::keyed(0x1000, 1024, 0x77));
    q.handle_capsule(sqe.as_bytes()).unwrap();
    assert!(matches!(
        q.poll_work(),
        Some(Work::FetchConnectData {
            cid: 1,
            len: 1024,
            ..
        })
    ));
    assert_eq!(
        q.handle_capsule(testing::enable_sqe(2).as_bytes()),
        Err(CapsuleError::BeforeConnect)
    );
    // A failed read of the data ends the Connect with an error, and the queue goes on.
    q.handle_connect_data(None);
    let mut c: ControllerConnection<Vec<u8>> = ControllerConnection::on(q);
    let mut rig = Rig::new();
    let now = rig.now;
    c.handle(now, &mut rig.subsystem);
    match c.transport_mut().poll_work() {
        Some(Work::Respond(cqe)) => assert_eq!(cqe.status, Status::TRANSIENT_TRANSPORT_ERROR),
        other => panic!("{other:?}"),
    }
}
