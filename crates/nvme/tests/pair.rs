//! A host and a controller of NVMe/TCP, machine against machine, with no socket: the host's
//! queues (`HostQueue`) against the controller's connections (`ControllerConnection`, the
//! queue machine joined to a `Subsystem`), whose block operations a small shell in this test
//! runs on an in-memory namespace, on a virtual clock. The host connects an admin queue and
//! an I/O queue as Linux's does, writes through R2Ts and in-capsule data, reads it back,
//! zeroes and deallocates; with and without digests; a corrupted data digest ends its
//! command with Transient Transport Error; a host that stops sending Keep Alive loses its
//! controller and its connections.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use bytes::Bytes;
use nvme::controller::{Subsystem, SubsystemConfig};
use nvme::fabrics::{property, PropertyAccess, CATTR_SQ_FLOW_CONTROL_DISABLE, CNTLID_DYNAMIC};
use nvme::opcode::{AdminOpcode, FabricsType, NvmOpcode};
use nvme::sqe::{Sgl, Sqe};
use nvme::tcp::pdu::Digests;
use nvme::tcp::{
    ControllerConnection, HostEvent, HostQueue, HostSettings, QueueSettings, Transmit,
};
use nvme::{testing, Cqe, Status};
use scsi_core::transport::Event;
use scsi_core::MemoryBackend;

const NQN: &str = "nqn.2026-11.io.example:pair";
const HOST: &str = "nqn.2014-08.org.nvmexpress:uuid:pair-host";
const OTHER_HOST: &str = "nqn.2014-08.org.nvmexpress:uuid:pair-other";
const BLOCK: u32 = 512;
const BLOCKS: u64 = 4096;

/// A host connection and the controller's end of it.
struct Link {
    host: HostQueue,
    conn: ControllerConnection<Vec<u8>>,
    /// What the host got back: completions, and read data by CID.
    done: HashMap<u16, Cqe>,
    read: HashMap<u16, Vec<u8>>,
    /// Write data the host hands over when asked, by CID.
    outgoing: HashMap<u16, Bytes>,
    /// Flip a bit of the next data the host sends.
    corrupt_next: bool,
    /// The controller's terms, once ICResp came.
    terms: Option<nvme::tcp::IcResp>,
    /// Commands the controller counted as ended (I/O commands), and how many with an error.
    ended: (usize, usize),
    /// Block operations are held here instead of run, while `hold` is set.
    hold: bool,
    held: Vec<(scsi_core::TaskId, scsi_core::Op, Vec<u8>)>,
    /// What the shell would note of each PDU it wrote, while tracing.
    sent: Vec<(cmdtrace::Stage, u16, u32)>,
}

struct Rig {
    now: Instant,
    subsystem: Subsystem,
    medium: MemoryBackend,
}

fn deliver<B: std::ops::Deref<Target = [u8]>>(t: Transmit<B>, corrupt: &mut bool) -> Vec<u8> {
    let mut v = t.header.to_vec();
    let at = v.len();
    v.extend_from_slice(&t.data);
    if let Some(d) = t.digest {
        v.extend_from_slice(&d);
    }
    if *corrupt && !t.data.is_empty() {
        v[at] ^= 1;
        *corrupt = false;
    }
    v
}

impl Rig {
    fn new() -> Rig {
        let mut subsystem = Subsystem::new(SubsystemConfig {
            max_io_queues: 2,
            ..testing::subsystem_config(NQN, &[HOST, OTHER_HOST])
        });
        subsystem.add_namespace(testing::namespace(1, BLOCK, BLOCKS));
        let mut medium = MemoryBackend::new(BLOCK, BLOCKS);
        let mut fill = vec![0xee; (u64::from(BLOCK) * BLOCKS) as usize];
        let all = scsi_core::Op::Write {
            lba: 0,
            blocks: BLOCKS as u32,
            offset: 0,
            fua: false,
        };
        medium.execute(&all, &mut fill).unwrap();
        Rig {
            now: Instant::now(),
            subsystem,
            medium,
        }
    }

    fn link(&mut self, digests: Digests) -> Link {
        let mut l = Link {
            host: HostQueue::new(HostSettings {
                digests,
                ..HostSettings::default()
            }),
            conn: ControllerConnection::new(QueueSettings::default()),
            done: HashMap::new(),
            read: HashMap::new(),
            outgoing: HashMap::new(),
            corrupt_next: false,
            terms: None,
            ended: (0, 0),
            hold: false,
            held: Vec::new(),
            sent: Vec::new(),
        };
        self.run(&mut l);
        assert!(matches!(l.terms, Some(r) if r.digests == digests));
        l
    }

    /// Moves bytes both ways and carries out what the controller's end asks, until nothing
    /// moves.
    fn run(&mut self, l: &mut Link) {
        loop {
            let mut moved = false;
            while let Some(t) = l.host.poll_transmit() {
                moved = true;
                let bytes = deliver(t, &mut l.corrupt_next);
                l.conn.receive(&bytes);
            }
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
                    Event::Completed(a) => {
                        l.ended.0 += 1;
                        l.ended.1 += usize::from(a.error);
                    }
                }
            }
            while let Some(t) = l.conn.poll_transmit() {
                moved = true;
                if l.conn.trace_points().is_on() {
                    l.sent.extend(t.sent_stages().into_iter().flatten());
                }
                l.host.receive(&deliver(t, &mut false));
            }
            while let Some(e) = l.host.poll_event() {
                moved = true;
                match e {
                    HostEvent::Initialized(r) => l.terms = Some(r),
                    HostEvent::Response(c) => {
                        l.done.insert(c.cid, c);
                    }
                    HostEvent::Data {
                        cid,
                        offset,
                        data,
                        success,
                        ..
                    } => {
                        let buf = l.read.entry(cid).or_default();
                        buf.resize(offset as usize, 0);
                        buf.extend_from_slice(&data);
                        if success {
                            l.done.insert(cid, Cqe::new(cid, Status::SUCCESS));
                        }
                    }
                    HostEvent::R2T(r2t) => {
                        let data = l.outgoing[&r2t.cccid].clone();
                        let piece = data.slice(r2t.r2to as usize..(r2t.r2to + r2t.r2tl) as usize);
                        l.host.send_data(&r2t, piece).unwrap();
                    }
                    other => panic!("{other:?}"),
                }
            }
            if !moved {
                return;
            }
        }
    }
}

fn connect(l: &mut Link, rig: &mut Rig, qid: u16, cntlid: u16, cattr: u8) -> Cqe {
    connect_as(l, rig, (qid, cntlid, cattr), [5; 16], HOST)
}

fn connect_as(
    l: &mut Link,
    rig: &mut Rig,
    (qid, cntlid, cattr): (u16, u16, u8),
    hostid: [u8; 16],
    hostnqn: &str,
) -> Cqe {
    let kato = if qid == 0 { 5000 } else { 0 };
    let sqe = testing::connect_sqe(100 + qid, qid, 31, kato, cattr);
    let data = testing::connect_data(hostid, cntlid, NQN, hostnqn);
    l.host.send_command(&sqe, Bytes::from(data)).unwrap();
    rig.run(l);
    l.done.remove(&(100 + qid)).expect("Connect's completion")
}

fn admin(l: &mut Link, rig: &mut Rig, sqe: Sqe) -> Cqe {
    let cid = sqe.cid();
    l.host.send_command(&sqe, Bytes::new()).unwrap();
    rig.run(l);
    l.done.remove(&cid).expect("a completion")
}

/// Connects the admin queue, enables the controller and asks for two I/O queues.
fn admin_link(rig: &mut Rig) -> (Link, u16) {
    admin_link_as(rig, [5; 16], HOST)
}

fn admin_link_as(rig: &mut Rig, hostid: [u8; 16], hostnqn: &str) -> (Link, u16) {
    let mut a = rig.link(Digests::default());
    let c = connect_as(&mut a, rig, (0, CNTLID_DYNAMIC, 0), hostid, hostnqn);
    assert!(c.status.is_success(), "{c:?}");
    let cntlid = c.dw0 as u16;
    assert!(admin(&mut a, rig, testing::enable_sqe(1))
        .status
        .is_success());
    let mut get = Sqe::new(AdminOpcode::Fabrics.code(), 2);
    get.set_fctype(FabricsType::PropertyGet.code());
    PropertyAccess {
        eight_bytes: false,
        offset: property::CSTS,
        value: 0,
    }
    .to_sqe(&mut get);
    assert_eq!(admin(&mut a, rig, get).dw0 & 1, 1, "CSTS.RDY");
    let mut identify = Sqe::new(AdminOpcode::Identify.code(), 3);
    identify.set_cdw(10, 1);
    identify.set_sgl(Sgl::transport(4096));
    assert!(admin(&mut a, rig, identify).status.is_success());
    let id = a.read.remove(&3).expect("Identify Controller data");
    assert_eq!(&id[768..768 + NQN.len()], NQN.as_bytes());
    let mut queues = Sqe::new(AdminOpcode::SetFeatures.code(), 4);
    queues.set_cdw(10, 0x07);
    queues.set_cdw(11, 1 | 1 << 16);
    assert_eq!(admin(&mut a, rig, queues).dw0, 1 | 1 << 16);
    (a, cntlid)
}

fn io_cmd(op: NvmOpcode, cid: u16, slba: u64, blocks: u32, sgl: Sgl) -> Sqe {
    let mut s = Sqe::new(op.code(), cid);
    s.set_nsid(1);
    s.set_qword(10, slba);
    s.set_cdw(12, blocks - 1);
    s.set_sgl(sgl);
    s
}

fn pattern(len: usize, seed: u8) -> Bytes {
    Bytes::from(
        (0..len)
            .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
            .collect::<Vec<u8>>(),
    )
}

#[test]
fn a_host_writes_reads_zeroes_and_deallocates_through_the_controller() {
    for (digests, cattr) in [
        (Digests::default(), 0),
        (
            Digests {
                header: true,
                data: true,
            },
            CATTR_SQ_FLOW_CONTROL_DISABLE,
        ),
    ] {
        let mut rig = Rig::new();
        let (_admin, cntlid) = admin_link(&mut rig);
        let mut io = rig.link(digests);
        assert!(connect(&mut io, &mut rig, 1, cntlid, cattr)
            .status
            .is_success());

        // 16 KiB through R2Ts (more than one H2CData of a small MAXH2CDATA is the host's
        // choice; here one R2T, one or more PDUs), then 1 KiB in the capsule.
        let big = pattern(16384, 1);
        io.outgoing.insert(10, big.clone());
        let w = io_cmd(NvmOpcode::Write, 10, 64, 32, Sgl::transport(16384));
        io.host.send_command(&w, Bytes::new()).unwrap();
        let small = pattern(1024, 2);
        let w2 = io_cmd(NvmOpcode::Write, 11, 8, 2, Sgl::in_capsule(0, 1024));
        io.host.send_command(&w2, small.clone()).unwrap();
        rig.run(&mut io);
        assert!(io.done.remove(&10).unwrap().status.is_success());
        assert!(io.done.remove(&11).unwrap().status.is_success());

        // Read both back.
        for (cid, slba, blocks, want) in [(12u16, 64u64, 32u32, &big), (13, 8, 2, &small)] {
            let r = io_cmd(
                NvmOpcode::Read,
                cid,
                slba,
                blocks,
                Sgl::transport(blocks * BLOCK),
            );
            io.host.send_command(&r, Bytes::new()).unwrap();
            rig.run(&mut io);
            assert!(io.done.remove(&cid).unwrap().status.is_success());
            assert_eq!(&io.read.remove(&cid).unwrap()[..], &want[..]);
        }

        // Write Zeroes over the small write, Dataset Management over the big one.
        let wz = io_cmd(NvmOpcode::WriteZeroes, 14, 8, 2, Sgl::transport(0));
        io.host.send_command(&wz, Bytes::new()).unwrap();
        let mut dsm = io_cmd(
            NvmOpcode::DatasetManagement,
            15,
            0,
            1,
            Sgl::in_capsule(0, 16),
        );
        dsm.set_cdw(10, 0);
        dsm.set_cdw(11, 1 << 2);
        let mut range = vec![0u8; 16];
        range[4..8].copy_from_slice(&32u32.to_le_bytes());
        range[8..16].copy_from_slice(&64u64.to_le_bytes());
        io.host.send_command(&dsm, Bytes::from(range)).unwrap();
        rig.run(&mut io);
        assert!(io.done.remove(&14).unwrap().status.is_success());
        assert!(io.done.remove(&15).unwrap().status.is_success());
        let r = io_cmd(NvmOpcode::Read, 16, 8, 2, Sgl::transport(1024));
        io.host.send_command(&r, Bytes::new()).unwrap();
        let r2 = io_cmd(NvmOpcode::Read, 17, 64, 32, Sgl::transport(16384));
        io.host.send_command(&r2, Bytes::new()).unwrap();
        rig.run(&mut io);
        assert!(io.read.remove(&16).unwrap().iter().all(|&b| b == 0));
        assert!(io.read.remove(&17).unwrap().iter().all(|&b| b == 0));

        // Past the end: LBA Out of Range, nothing moved.
        let bad = io_cmd(NvmOpcode::Read, 18, BLOCKS - 1, 2, Sgl::transport(1024));
        io.host.send_command(&bad, Bytes::new()).unwrap();
        rig.run(&mut io);
        assert_eq!(
            io.done.remove(&18).unwrap().status,
            Status::LBA_OUT_OF_RANGE
        );
        assert!(!io.read.contains_key(&18));

        // An in-capsule write whose capsule is shorter than its SGL says: Data SGL Length
        // Invalid, and nothing written (the rest of the buffer is not the host's data).
        let short = io_cmd(NvmOpcode::Write, 20, 8, 2, Sgl::in_capsule(0, 1024));
        io.host.send_command(&short, pattern(512, 7)).unwrap();
        rig.run(&mut io);
        assert_eq!(
            io.done.remove(&20).unwrap().status,
            Status::DATA_SGL_LENGTH_INVALID
        );
        let mut now = vec![0xffu8; 1024];
        rig.medium.read_bytes(8 * 512, &mut now);
        assert!(now.iter().all(|&b| b == 0), "the blocks Write Zeroes left");

        if digests.data {
            // A corrupted in-capsule write: Transient Transport Error, the medium unchanged.
            io.corrupt_next = true;
            let w = io_cmd(NvmOpcode::Write, 19, 8, 2, Sgl::in_capsule(0, 1024));
            io.host.send_command(&w, pattern(1024, 9)).unwrap();
            rig.run(&mut io);
            assert_eq!(
                io.done.remove(&19).unwrap().status,
                Status::TRANSIENT_TRANSPORT_ERROR
            );
            let mut now = vec![0xffu8; 1024];
            rig.medium.read_bytes(8 * 512, &mut now);
            assert!(now.iter().all(|&b| b == 0));
        }
        assert!(!io.host.is_over() && !io.conn.is_over());
        // Counted: 2 writes, 2 reads, Write Zeroes, Dataset Management, 2 reads; not the
        // read refused before it was taken, nor the write whose capsule was damaged.
        assert_eq!(io.ended, (8, 0));
    }
}

#[test]
fn a_silent_host_loses_its_controller() {
    let mut rig = Rig::new();
    let (mut a, cntlid) = admin_link(&mut rig);
    let deadline = rig.subsystem.poll_timeout().expect("KATO 5 s");
    rig.now = deadline - Duration::from_millis(1);
    assert!(rig.subsystem.handle_timeout(rig.now).is_empty());
    let ka = Sqe::new(AdminOpcode::KeepAlive.code(), 20);
    assert!(admin(&mut a, &mut rig, ka).status.is_success());
    let deadline = rig.subsystem.poll_timeout().unwrap();
    rig.now = deadline;
    assert_eq!(rig.subsystem.handle_timeout(rig.now), vec![cntlid]);
    let ka = Sqe::new(AdminOpcode::KeepAlive.code(), 21);
    assert_eq!(
        admin(&mut a, &mut rig, ka).status,
        Status::KEEP_ALIVE_EXPIRED
    );
    // Its connections close, and an I/O queue cannot join it.
    a.conn.handle_timeout(rig.now, &mut rig.subsystem);
    assert!(a.conn.is_over());
    let mut other = rig.link(Digests::default());
    let c = connect(&mut other, &mut rig, 1, cntlid, 0);
    assert_eq!(c.status, Status::CONNECT_INVALID_PARAMETERS);
}

/// A connection closed while a command's block operations run starts no more of them: a
/// Dataset Management of two ranges whose first deallocation is running ends with it, so the
/// shell, which waits for what runs, is not left waiting.
#[test]
fn a_closed_connection_starts_no_more_operations() {
    let mut rig = Rig::new();
    let (_admin, cntlid) = admin_link(&mut rig);
    let mut io = rig.link(Digests::default());
    assert!(connect(&mut io, &mut rig, 1, cntlid, 0).status.is_success());
    let mut dsm = io_cmd(
        NvmOpcode::DatasetManagement,
        30,
        0,
        1,
        Sgl::in_capsule(0, 32),
    );
    dsm.set_cdw(10, 1);
    dsm.set_cdw(11, 1 << 2);
    let mut ranges = vec![0u8; 32];
    for (i, r) in ranges.chunks_exact_mut(16).enumerate() {
        r[4..8].copy_from_slice(&8u32.to_le_bytes());
        r[8..16].copy_from_slice(&(i as u64 * 64).to_le_bytes());
    }
    io.host.send_command(&dsm, Bytes::from(ranges)).unwrap();
    while let Some(t) = io.host.poll_transmit() {
        io.conn.receive(&deliver(t, &mut false));
    }
    io.conn.handle(rig.now, &mut rig.subsystem);
    let Some(Event::BufferWanted { tag, len }) = io.conn.poll_event() else {
        panic!("a buffer wanted")
    };
    io.conn.handle_buffer(rig.now, tag, Some(vec![0; len]));
    let Some(Event::Backend { task, buffer, .. }) = io.conn.poll_event() else {
        panic!("the first deallocation")
    };
    assert_eq!(io.conn.in_backend(), 1);
    io.conn.close(&mut rig.subsystem);
    io.conn
        .handle_backend_done(rig.now, task, buffer, Ok(scsi_core::Output::Done));
    assert_eq!(io.conn.in_backend(), 0);
    while let Some(e) = io.conn.poll_event() {
        assert!(!matches!(e, Event::Backend { .. }), "{e:?}");
    }
}

/// A host's admin and I/O queue.
fn host_links(rig: &mut Rig, hostid: [u8; 16], hostnqn: &str) -> (Link, Link) {
    let (admin, cntlid) = admin_link_as(rig, hostid, hostnqn);
    let mut io = rig.link(Digests::default());
    let c = connect_as(&mut io, rig, (1, cntlid, 0), hostid, hostnqn);
    assert!(c.status.is_success(), "{c:?}");
    (admin, io)
}

/// A reservation command on namespace 1 with CDW10 `cdw10` and `data` (in the capsule, or
/// fetched with an R2T when `r2t`).
fn reservation(
    l: &mut Link,
    rig: &mut Rig,
    op: NvmOpcode,
    cid: u16,
    cdw10: u32,
    data: &[u8],
    r2t: bool,
) -> Option<Cqe> {
    let mut s = Sqe::new(op.code(), cid);
    s.set_nsid(1);
    s.set_cdw(10, cdw10);
    let len = data.len() as u32;
    if r2t {
        s.set_sgl(Sgl::transport(len));
        l.outgoing.insert(cid, Bytes::copy_from_slice(data));
        l.host.send_command(&s, Bytes::new()).unwrap();
    } else {
        s.set_sgl(Sgl::in_capsule(0, len));
        l.host
            .send_command(&s, Bytes::copy_from_slice(data))
            .unwrap();
    }
    rig.run(l);
    l.done.remove(&cid)
}

fn keys(a: u64, b: u64) -> Vec<u8> {
    [a.to_le_bytes(), b.to_le_bytes()].concat()
}

/// Host A registers key A, host B key B (through an R2T when `r2t`), and A takes Write
/// Exclusive on namespace 1.
fn a_holds_write_exclusive(rig: &mut Rig, a: &mut Link, b: &mut Link, r2t: bool) {
    let register = NvmOpcode::ReservationRegister;
    let ok = |c: Option<Cqe>| assert!(c.expect("a completion").status.is_success());
    ok(reservation(a, rig, register, 40, 0, &keys(0, 0xa), false));
    ok(reservation(b, rig, register, 41, 0, &keys(0, 0xb), r2t));
    let acquire = NvmOpcode::ReservationAcquire;
    ok(reservation(
        a,
        rig,
        acquire,
        42,
        1 << 8,
        &keys(0xa, 0),
        false,
    ));
}

/// Two hosts share namespace 1 under NVMe reservations: host A registers and takes Write
/// Exclusive, host B's writes conflict while its reads pass; then B preempts A and aborts
/// its commands while a write of A's runs: B's Preempt and Abort completes only after that
/// write ended (aborted), A hears of it through its Reservation Notification log page, and
/// A's next write conflicts.
#[test]
fn a_preempt_and_abort_waits_for_the_preempted_hosts_commands() {
    let mut rig = Rig::new();
    let (mut a_admin, mut a) = host_links(&mut rig, [5; 16], HOST);
    let (_b_admin, mut b) = host_links(&mut rig, [6; 16], OTHER_HOST);
    let acquire = NvmOpcode::ReservationAcquire;
    // B's key comes through an R2T (a host whose in-capsule size is small sends it so).
    a_holds_write_exclusive(&mut rig, &mut a, &mut b, true);

    // Write Exclusive: B may read, not write; A both.
    let w = io_cmd(NvmOpcode::Write, 43, 0, 1, Sgl::in_capsule(0, 512));
    b.host.send_command(&w, pattern(512, 3)).unwrap();
    let r = io_cmd(NvmOpcode::Read, 44, 0, 1, Sgl::transport(512));
    b.host.send_command(&r, Bytes::new()).unwrap();
    rig.run(&mut b);
    assert_eq!(
        b.done.remove(&43).unwrap().status,
        Status::RESERVATION_CONFLICT
    );
    assert!(b.done.remove(&44).unwrap().status.is_success());

    // A waits for events; a write of A's is running when B preempts and aborts.
    let aer = Sqe::new(AdminOpcode::AsyncEventRequest.code(), 45);
    a_admin.host.send_command(&aer, Bytes::new()).unwrap();
    rig.run(&mut a_admin);
    a.hold = true;
    let w = io_cmd(NvmOpcode::Write, 46, 16, 1, Sgl::in_capsule(0, 512));
    a.host.send_command(&w, pattern(512, 4)).unwrap();
    rig.run(&mut a);
    assert_eq!(a.held.len(), 1);
    let preempt = reservation(
        &mut b,
        &mut rig,
        acquire,
        47,
        2 | 1 << 8,
        &keys(0xb, 0xa),
        false,
    );
    assert!(preempt.is_none(), "held while A's write runs: {preempt:?}");
    rig.run(&mut a);
    rig.run(&mut b);
    assert!(b.done.is_empty(), "still held");
    // A's write ends: aborted; then B's Preempt and Abort completes.
    let (task, op, mut buffer) = a.held.pop().unwrap();
    let result = rig.medium.execute(&op, &mut buffer);
    a.conn.handle_backend_done(rig.now, task, buffer, result);
    a.hold = false;
    rig.run(&mut a);
    assert_eq!(a.done.remove(&46).unwrap().status, Status::ABORTED_PREEMPT);
    rig.run(&mut b);
    assert!(b
        .done
        .remove(&47)
        .expect("B's Preempt and Abort")
        .status
        .is_success());

    // A hears of it: a Reservation Log Page Available notice, and the page names the type.
    rig.run(&mut a_admin);
    let notice = a_admin.done.remove(&45).expect("the notice");
    assert_eq!(notice.dw0, 0x6 | 0x80 << 16);
    let mut log = Sqe::new(AdminOpcode::GetLogPage.code(), 48);
    log.set_cdw(10, 0x80 | 15 << 16);
    log.set_sgl(Sgl::transport(64));
    assert!(admin(&mut a_admin, &mut rig, log).status.is_success());
    let page = a_admin.read.remove(&48).unwrap();
    assert_eq!(
        (page[8], page[9], page[12]),
        (1, 0, 1),
        "registration preempted, ns 1"
    );

    // A is no longer registered: its writes conflict; B holds Write Exclusive alone.
    let w = io_cmd(NvmOpcode::Write, 49, 0, 1, Sgl::in_capsule(0, 512));
    a.host.send_command(&w, pattern(512, 5)).unwrap();
    rig.run(&mut a);
    assert_eq!(
        a.done.remove(&49).unwrap().status,
        Status::RESERVATION_CONFLICT
    );
    let mut report = Sqe::new(NvmOpcode::ReservationReport.code(), 50);
    report.set_nsid(1);
    report.set_cdw(10, 127 / 4);
    report.set_cdw(11, 1);
    report.set_sgl(Sgl::transport(128));
    b.host.send_command(&report, Bytes::new()).unwrap();
    rig.run(&mut b);
    assert!(b.done.remove(&50).unwrap().status.is_success());
    let r = b.read.remove(&50).unwrap();
    assert_eq!(
        (r[4], r[5], r[66]),
        (1, 1, 1),
        "WE, one registrant, the holder"
    );
    assert_eq!(&r[72..80], &0xbu64.to_le_bytes());
    assert_eq!(&r[80..96], &[6; 16]);
}

/// Fused Compare and Write: the Write happens only when the Compare matches, as one
/// operation on the storage; a miscompare leaves the blocks as they were (Compare Failure,
/// and the Write aborted as a failed fused command); a first command without its second,
/// a second without its first, and a pair longer than the namespace's atomic unit are
/// refused, with nothing written.
#[test]
fn a_fused_compare_and_write_writes_only_on_a_match() {
    use nvme::sqe::Fuse;
    let mut rig = Rig::new();
    let (_admin, cntlid) = admin_link(&mut rig);
    let mut io = rig.link(Digests::default());
    assert!(connect(&mut io, &mut rig, 1, cntlid, 0).status.is_success());
    let read = |io: &mut Link, rig: &mut Rig, cid: u16| {
        let r = io_cmd(NvmOpcode::Read, cid, 32, 2, Sgl::transport(1024));
        io.host.send_command(&r, Bytes::new()).unwrap();
        rig.run(io);
        assert!(io.done.remove(&cid).unwrap().status.is_success());
        io.read.remove(&cid).unwrap()
    };
    let old = read(&mut io, &mut rig, 60);
    assert!(old.iter().all(|&b| b == 0xee));
    let pair =
        |io: &mut Link, rig: &mut Rig, cids: (u16, u16), expect: &[u8], new: Bytes, r2t: bool| {
            let mut c = io_cmd(NvmOpcode::Compare, cids.0, 32, 2, Sgl::in_capsule(0, 1024));
            c.set_fuse(Fuse::First);
            let sgl = if r2t {
                Sgl::transport(1024)
            } else {
                Sgl::in_capsule(0, 1024)
            };
            let mut w = io_cmd(NvmOpcode::Write, cids.1, 32, 2, sgl);
            w.set_fuse(Fuse::Second);
            io.host
                .send_command(&c, Bytes::copy_from_slice(expect))
                .unwrap();
            if r2t {
                io.outgoing.insert(cids.1, new);
                io.host.send_command(&w, Bytes::new()).unwrap();
            } else {
                io.host.send_command(&w, new).unwrap();
            }
            rig.run(io);
            (
                io.done
                    .remove(&cids.0)
                    .expect("the Compare's completion")
                    .status,
                io.done
                    .remove(&cids.1)
                    .expect("the Write's completion")
                    .status,
            )
        };
    // A match: written (the Write's data through an R2T, then in the capsule).
    let new = pattern(1024, 3);
    let got = pair(&mut io, &mut rig, (61, 62), &old, new.clone(), true);
    assert_eq!(got, (Status::SUCCESS, Status::SUCCESS));
    assert_eq!(read(&mut io, &mut rig, 63), &new[..]);
    // A miscompare: nothing written.
    let got = pair(&mut io, &mut rig, (64, 65), &old, pattern(1024, 4), false);
    assert_eq!(got, (Status::COMPARE_FAILURE, Status::ABORTED_FAILED_FUSED));
    assert_eq!(read(&mut io, &mut rig, 66), &new[..]);
    // A first command followed by an ordinary one: Missing Fused Command; the other runs.
    let mut c = io_cmd(NvmOpcode::Compare, 67, 32, 2, Sgl::in_capsule(0, 1024));
    c.set_fuse(Fuse::First);
    io.host.send_command(&c, new.clone()).unwrap();
    let r = io_cmd(NvmOpcode::Read, 68, 32, 2, Sgl::transport(1024));
    io.host.send_command(&r, Bytes::new()).unwrap();
    rig.run(&mut io);
    assert_eq!(
        io.done.remove(&67).unwrap().status,
        Status::ABORTED_MISSING_FUSED
    );
    assert!(io.done.remove(&68).unwrap().status.is_success());
    // A second command alone: Missing Fused Command, nothing written.
    let mut w = io_cmd(NvmOpcode::Write, 69, 32, 2, Sgl::in_capsule(0, 1024));
    w.set_fuse(Fuse::Second);
    io.host.send_command(&w, pattern(1024, 5)).unwrap();
    rig.run(&mut io);
    assert_eq!(
        io.done.remove(&69).unwrap().status,
        Status::ABORTED_MISSING_FUSED
    );
    assert_eq!(read(&mut io, &mut rig, 70), &new[..]);
    // More blocks than the namespace's atomic unit (8): refused.
    let mut c = io_cmd(NvmOpcode::Compare, 71, 0, 16, Sgl::transport(8192));
    c.set_fuse(Fuse::First);
    let mut w = io_cmd(NvmOpcode::Write, 72, 0, 16, Sgl::transport(8192));
    w.set_fuse(Fuse::Second);
    io.host.send_command(&c, Bytes::new()).unwrap();
    io.host.send_command(&w, Bytes::new()).unwrap();
    rig.run(&mut io);
    assert_eq!(io.done.remove(&71).unwrap().status, Status::INVALID_FIELD);
    assert_eq!(
        io.done.remove(&72).unwrap().status,
        Status::ABORTED_FAILED_FUSED
    );
    assert!(!io.conn.is_over());
}

/// A preempted host whose connection closes while its write runs: the Preempt and Abort
/// still waits for that write, and is answered once the connection, its operations ended,
/// leaves the subsystem.
#[test]
fn a_preempt_and_abort_waits_for_a_closed_connections_write() {
    let mut rig = Rig::new();
    let (_a_admin, mut a) = host_links(&mut rig, [5; 16], HOST);
    let (_b_admin, mut b) = host_links(&mut rig, [6; 16], OTHER_HOST);
    let acquire = NvmOpcode::ReservationAcquire;
    a_holds_write_exclusive(&mut rig, &mut a, &mut b, false);
    a.hold = true;
    let w = io_cmd(NvmOpcode::Write, 43, 16, 1, Sgl::in_capsule(0, 512));
    a.host.send_command(&w, pattern(512, 4)).unwrap();
    rig.run(&mut a);
    assert_eq!(a.held.len(), 1);
    // A's connection goes while its write runs.
    a.conn.close(&mut rig.subsystem);
    let preempt = reservation(
        &mut b,
        &mut rig,
        acquire,
        44,
        2 | 1 << 8,
        &keys(0xb, 0xa),
        false,
    );
    assert!(preempt.is_none(), "held while A's write runs: {preempt:?}");
    let (task, op, mut buffer) = a.held.pop().unwrap();
    let result = rig.medium.execute(&op, &mut buffer);
    a.conn.handle_backend_done(rig.now, task, buffer, result);
    rig.run(&mut b);
    assert!(b.done.is_empty(), "the queue has not left yet");
    // The shell, its operations ended, closes it again: the queue leaves, B is answered.
    a.conn.close(&mut rig.subsystem);
    rig.run(&mut b);
    assert!(b
        .done
        .remove(&44)
        .expect("B's Preempt and Abort")
        .status
        .is_success());
}

/// While tracing, each command's stages come out in order with its CID (a write through an
/// R2T, a read), a Keep Alive on the admin queue is the clock-dating ping, and each PDU
/// written names what it carried.
#[test]
fn traced_commands_report_their_stages() {
    use cmdtrace::Stage::*;
    let mut rig = Rig::new();
    let (mut admin_q, cntlid) = admin_link(&mut rig);
    let mut io = rig.link(Digests::default());
    assert!(connect(&mut io, &mut rig, 1, cntlid, 0).status.is_success());
    io.conn.trace_points().set(true);
    admin_q.conn.trace_points().set(true);

    io.outgoing.insert(30, pattern(16384, 3));
    let w = io_cmd(NvmOpcode::Write, 30, 0, 32, Sgl::transport(16384));
    io.host.send_command(&w, Bytes::new()).unwrap();
    rig.run(&mut io);
    let r = io_cmd(NvmOpcode::Read, 31, 0, 8, Sgl::transport(4096));
    io.host.send_command(&r, Bytes::new()).unwrap();
    rig.run(&mut io);
    assert!(io.done.remove(&30).unwrap().status.is_success());
    assert!(io.done.remove(&31).unwrap().status.is_success());
    assert!(admin(
        &mut admin_q,
        &mut rig,
        Sqe::new(AdminOpcode::KeepAlive.code(), 40)
    )
    .status
    .is_success());

    let mut points = Vec::new();
    while let Some(p) = io.conn.trace_points().poll() {
        assert_eq!(p.cmd_sn, 0, "NVMe has no CmdSN");
        points.push((p.stage, p.itt, p.arg));
    }
    assert_eq!(
        points,
        [
            (Received, 30, 16384),
            (BufferWait, 30, 16384),
            (R2tSent, 30, 16384),
            (DataOutDone, 30, 0),
            (BackendSubmit, 30, 16384),
            (BackendDone, 30, 0),
            (Responded, 30, 0),
            (Received, 31, 4096),
            (BufferWait, 31, 4096),
            (BackendSubmit, 31, 4096),
            (BackendDone, 31, 0),
            (Responded, 31, 4096),
        ]
    );
    assert_eq!(
        io.sent,
        [
            (StatusSent, 30, 0),
            (DataInSent, 31, 4096),
            (StatusSent, 31, 0),
        ]
    );
    let ping = admin_q.conn.trace_points().poll().expect("a point");
    assert_eq!((ping.stage, ping.itt), (NopReceived, 40));
}

/// ANA groups: a group made inaccessible (or changing) through these controllers refuses I/O
/// to its namespaces with the ANA status (the host retries on another path) while another
/// group's namespace is served; the host that asked for ANA Change notices gets one, masked
/// until it reads the ANA log page, which gives each group's state, namespaces and change
/// count; optimized again, I/O flows.
#[test]
fn ana_states_reach_the_host_and_refuse_io_where_a_group_is_unreachable() {
    use nvme::ana::AnaState;
    let mut rig = Rig::new();
    let mut second = rig.subsystem.namespace(1).unwrap().clone();
    second.nsid = 2;
    second.ana_group = 2;
    rig.subsystem.add_namespace(second);
    let (mut admin_q, cntlid) = admin_link(&mut rig);
    let mut aec = Sqe::new(AdminOpcode::SetFeatures.code(), 49);
    aec.set_cdw(10, 0x0b);
    aec.set_cdw(11, nvme::controller::AEC_ANA_CHANGE);
    assert!(admin(&mut admin_q, &mut rig, aec).status.is_success());
    let mut io = rig.link(Digests::default());
    assert!(connect(&mut io, &mut rig, 1, cntlid, 0).status.is_success());
    let read = |io: &mut Link, rig: &mut Rig, cid: u16, nsid: u32| {
        let mut r = io_cmd(NvmOpcode::Read, cid, 0, 1, Sgl::transport(512));
        r.set_nsid(nsid);
        io.host.send_command(&r, Bytes::new()).unwrap();
        rig.run(io);
        io.read.remove(&cid);
        io.done.remove(&cid).expect("a completion").status
    };
    let ana_log = |admin_q: &mut Link, rig: &mut Rig, cid: u16| {
        let mut log = Sqe::new(AdminOpcode::GetLogPage.code(), cid);
        log.set_cdw(10, 0x0c | (4096 / 4 - 1) << 16);
        log.set_sgl(Sgl::transport(4096));
        assert!(admin(admin_q, rig, log).status.is_success());
        admin_q.read.remove(&cid).expect("the ANA log")
    };

    let aer = Sqe::new(AdminOpcode::AsyncEventRequest.code(), 50);
    admin_q.host.send_command(&aer, Bytes::new()).unwrap();
    rig.run(&mut admin_q);
    rig.subsystem.set_ana_state(1, AnaState::Inaccessible);
    rig.run(&mut admin_q);
    let notice = admin_q.done.remove(&50).expect("an ANA Change notice");
    assert_eq!(notice.dw0, 0x2 | 0x03 << 8 | 0x0c << 16);
    assert_eq!(read(&mut io, &mut rig, 60, 1), Status::ANA_INACCESSIBLE);
    assert!(
        read(&mut io, &mut rig, 61, 2).is_success(),
        "group 2 is served"
    );

    // The log: change count 1; group 1 inaccessible (changed at 1) with namespace 1, group 2
    // optimized with namespace 2.
    let page = ana_log(&mut admin_q, &mut rig, 51);
    assert_eq!(u64::from_le_bytes(page[..8].try_into().unwrap()), 1);
    assert_eq!(u16::from_le_bytes([page[8], page[9]]), 2);
    let g1 = &page[16..52];
    assert_eq!((g1[0], g1[4], g1[8], g1[16], g1[32]), (1, 1, 1, 0x03, 1));
    let g2 = &page[52..88];
    assert_eq!((g2[0], g2[4], g2[8], g2[16], g2[32]), (2, 1, 0, 0x01, 2));

    // Read, the notice is unmasked: the next change sends another.
    let aer = Sqe::new(AdminOpcode::AsyncEventRequest.code(), 52);
    admin_q.host.send_command(&aer, Bytes::new()).unwrap();
    rig.run(&mut admin_q);
    rig.subsystem.set_ana_state(1, AnaState::Change);
    rig.run(&mut admin_q);
    assert!(admin_q.done.remove(&52).is_some(), "a second notice");
    assert_eq!(read(&mut io, &mut rig, 62, 1), Status::ANA_TRANSITION);
    // Not read since: a third change sends none.
    let aer = Sqe::new(AdminOpcode::AsyncEventRequest.code(), 53);
    admin_q.host.send_command(&aer, Bytes::new()).unwrap();
    rig.run(&mut admin_q);
    rig.subsystem.set_ana_state(1, AnaState::Optimized);
    rig.run(&mut admin_q);
    assert!(
        admin_q.done.remove(&53).is_none(),
        "masked until the log is read"
    );
    assert!(read(&mut io, &mut rig, 63, 1).is_success());
    // Identify Namespace names each namespace's group.
    let mut id = Sqe::new(AdminOpcode::Identify.code(), 54);
    id.set_nsid(2);
    id.set_sgl(Sgl::transport(4096));
    assert!(admin(&mut admin_q, &mut rig, id).status.is_success());
    let ns = admin_q.read.remove(&54).unwrap();
    assert_eq!(
        u32::from_le_bytes(ns[92..96].try_into().unwrap()),
        2,
        "ANAGRPID"
    );
}

/// A namespace whose reservations a cluster of gateways keeps: a reservation command is held
/// and handed to the shell, which has the cluster decide it; the state the cluster decided
/// (through this gateway or another) is applied with its effects, a version heard twice
/// changes nothing, refusals come back as the cluster says them, and another gateway's
/// Preempt and Abort aborts the preempted host's commands here and counts them until they
/// end (the cluster acknowledges it only then).
#[test]
fn a_shared_namespace_has_the_cluster_decide_its_reservations() {
    use nvme::reservation::{self, AcquireAction, ReservationCommand};
    use scsi_core::pr::PrState;
    let mut rig = Rig::new();
    rig.subsystem.add_namespace(nvme::controller::Namespace {
        shared_reservations: true,
        ..testing::namespace(1, BLOCK, BLOCKS)
    });
    let (_a_admin, mut a) = host_links(&mut rig, [5; 16], HOST);
    let mut cluster = PrState::default();
    let mut version = 0;
    // What a cluster does with an ask: decide on its state, apply it here, answer.
    let decide = |rig: &mut Rig, cluster: &mut PrState, version: &mut u64| {
        let ask = rig
            .subsystem
            .poll_shared_reservation()
            .expect("an ask for the cluster");
        let mut next = cluster.clone();
        let result = reservation::apply(&mut next, &ask.host, &ask.command, &ask.data, true);
        if let Ok(fx) = &result {
            *cluster = next;
            *version += 1;
            assert!(rig
                .subsystem
                .apply_shared_reservations(1, *version, cluster.clone(), fx));
            // Heard twice: nothing.
            assert!(!rig
                .subsystem
                .apply_shared_reservations(1, *version, cluster.clone(), fx));
        }
        rig.subsystem
            .shared_reservation_done(ask.id, result.map(|_| ()));
        ask
    };

    // A registers: held until the cluster decides, then done.
    let register = NvmOpcode::ReservationRegister;
    assert!(reservation(&mut a, &mut rig, register, 40, 0, &keys(0, 0xa), false).is_none());
    let ask = decide(&mut rig, &mut cluster, &mut version);
    assert_eq!(ask.host, reservation::host([5; 16]));
    assert_eq!(&ask.data[8..], &0xau64.to_le_bytes());
    rig.run(&mut a);
    assert!(a.done.remove(&40).expect("registered").status.is_success());

    // Another gateway's host B registers and takes Write Exclusive: applied here, A's
    // writes conflict, its Acquire too (as the cluster decides it).
    let b = reservation::host([6; 16]);
    let mut other = cluster.clone();
    other.register(&b, None, 0xb, true, None).unwrap();
    other
        .reserve(&b, 0xb, scsi_core::pr::kind::WRITE_EXCLUSIVE)
        .unwrap();
    cluster = other;
    version += 1;
    assert!(rig.subsystem.apply_shared_reservations(
        1,
        version,
        cluster.clone(),
        &Default::default()
    ));
    let w = io_cmd(NvmOpcode::Write, 41, 0, 1, Sgl::in_capsule(0, 512));
    a.host.send_command(&w, pattern(512, 1)).unwrap();
    rig.run(&mut a);
    assert_eq!(
        a.done.remove(&41).unwrap().status,
        Status::RESERVATION_CONFLICT
    );
    let acquire = NvmOpcode::ReservationAcquire;
    assert!(reservation(&mut a, &mut rig, acquire, 42, 1 << 8, &keys(0xa, 0), false).is_none());
    let ask = decide(&mut rig, &mut cluster, &mut version);
    assert!(matches!(
        ask.command,
        ReservationCommand::Acquire {
            action: AcquireAction::Acquire,
            rtype: 1
        }
    ));
    rig.run(&mut a);
    assert_eq!(
        a.done.remove(&42).unwrap().status,
        Status::RESERVATION_CONFLICT
    );

    // B preempts A with abort through the other gateway while A's read runs here: A's
    // command is aborted and counted until it ends.
    a.hold = true;
    let r = io_cmd(NvmOpcode::Read, 43, 0, 1, Sgl::transport(512));
    a.host.send_command(&r, Bytes::new()).unwrap();
    rig.run(&mut a);
    assert_eq!(a.held.len(), 1);
    let mut next = cluster.clone();
    let fx = next
        .preempt(&b, 0xb, 0xa, scsi_core::pr::kind::WRITE_EXCLUSIVE, true)
        .unwrap();
    assert_eq!(fx.abort, vec![reservation::host([5; 16])]);
    version += 1;
    assert!(rig
        .subsystem
        .apply_shared_reservations(1, version, next, &fx));
    rig.run(&mut a);
    assert_eq!(rig.subsystem.aborted_in_flight(1), 1);
    let (task, op, mut buffer) = a.held.pop().unwrap();
    let result = rig.medium.execute(&op, &mut buffer);
    a.conn.handle_backend_done(rig.now, task, buffer, result);
    a.hold = false;
    rig.run(&mut a);
    assert_eq!(a.done.remove(&43).unwrap().status, Status::ABORTED_PREEMPT);
    assert_eq!(rig.subsystem.aborted_in_flight(1), 0);
}

/// Controllers handed to the next process while a shared namespace's reservations change
/// (another gateway preempts their host after this process took its state, before the next
/// one has the controller) hear it: a Registration Preempted notice and its event.
#[test]
fn a_preempt_while_controllers_move_to_the_next_process_is_told_to_them() {
    use nvme::reservation::{self, notice};
    use scsi_core::pr::{kind::WRITE_EXCLUSIVE, PrState};
    let shared = || nvme::controller::Namespace {
        shared_reservations: true,
        ..testing::namespace(1, BLOCK, BLOCKS)
    };
    let mut rig = Rig::new();
    rig.subsystem.add_namespace(shared());
    let (_admin, _io) = host_links(&mut rig, [5; 16], HOST);
    let (cntlid, _) = rig.subsystem.controllers().next().expect("a controller");
    // Host A (on this gateway) and host B (on another) registered; A holds Write Exclusive.
    let (a, b) = (reservation::host([5; 16]), reservation::host([6; 16]));
    let mut cluster = PrState::default();
    cluster.register(&a, None, 0xa, true, None).unwrap();
    cluster.register(&b, None, 0xb, true, None).unwrap();
    cluster.reserve(&a, 0xa, WRITE_EXCLUSIVE).unwrap();
    let none = Default::default();
    assert!(rig
        .subsystem
        .apply_shared_reservations(1, 1, cluster.clone(), &none));
    let state = rig.subsystem.controller_state(cntlid).unwrap();
    assert!(state.reservation_log.is_empty());
    let namespaces = rig.subsystem.namespace_states();

    // The next process reads the cluster's state; then B preempts A through its gateway.
    let mut next = Rig::new();
    next.subsystem.add_namespace(shared());
    assert!(next
        .subsystem
        .apply_shared_reservations(1, 1, cluster.clone(), &none));
    let fx = cluster
        .preempt(&b, 0xb, 0xa, WRITE_EXCLUSIVE, false)
        .unwrap();
    assert!(next
        .subsystem
        .apply_shared_reservations(1, 2, cluster.clone(), &fx));
    for n in &namespaces {
        next.subsystem.adopt_namespace_state(n).unwrap();
    }
    next.subsystem.adopt_controller(next.now, &state).unwrap();
    let adopted = next.subsystem.controller_state(cntlid).unwrap();
    assert_eq!(
        adopted.reservation_log,
        [(1, notice::REGISTRATION_PREEMPTED, 1)]
    );
    assert!(adopted.notices.contains(&(0x6 | 0x80 << 16)));
    // The state is the cluster's, not the one handed over.
    assert_eq!(next.subsystem.reservations(1), Some(&cluster));
}

/// A controller handed over while quiescent goes on in another subsystem (another process's,
/// on the same storage): its admin queue and an I/O queue with digests resume where they
/// stopped, the bytes of a command half read go on in the new deframer, the Asynchronous
/// Event Request it held answers a namespace change made there, and the reservation its
/// host made holds. While a command is in flight the connection says it is busy; the same
/// controller is not taken in twice.
#[test]
fn a_quiescent_controller_goes_on_in_another_subsystem() {
    use nvme::handover::{Busy, ControllerState};
    let mut rig = Rig::new();
    let (mut a, cntlid) = admin_link(&mut rig);
    let digests = Digests {
        header: true,
        data: true,
    };
    let mut io = rig.link(digests);
    assert!(
        connect(&mut io, &mut rig, 1, cntlid, CATTR_SQ_FLOW_CONTROL_DISABLE)
            .status
            .is_success()
    );
    // Namespace attribute notices on, and an Asynchronous Event Request held.
    let mut aec = Sqe::new(AdminOpcode::SetFeatures.code(), 5);
    aec.set_cdw(10, 0x0b);
    aec.set_cdw(11, nvme::controller::AEC_NAMESPACE_ATTRIBUTE);
    assert!(admin(&mut a, &mut rig, aec).status.is_success());
    let aer = Sqe::new(AdminOpcode::AsyncEventRequest.code(), 6);
    a.host.send_command(&aer, Bytes::new()).unwrap();
    rig.run(&mut a);
    assert!(!a.done.contains_key(&6), "the AER is held");
    // Its host registers a key.
    let mut register = io_cmd(
        NvmOpcode::ReservationRegister,
        9,
        0,
        1,
        Sgl::in_capsule(0, 16),
    );
    register.set_cdw(10, 0);
    io.host
        .send_command(&register, keys(0, 0xb2).into())
        .unwrap();
    rig.run(&mut io);
    assert!(io.done.remove(&9).unwrap().status.is_success());
    // 4 KiB written through an R2T.
    let data = pattern(4096, 3);
    io.outgoing.insert(10, data.clone());
    let w = io_cmd(NvmOpcode::Write, 10, 16, 8, Sgl::transport(4096));
    io.host.send_command(&w, Bytes::new()).unwrap();
    rig.run(&mut io);
    assert!(io.done.remove(&10).unwrap().status.is_success());

    // A command in flight: busy.
    io.hold = true;
    let r = io_cmd(NvmOpcode::Read, 11, 16, 8, Sgl::transport(4096));
    io.host.send_command(&r, Bytes::new()).unwrap();
    rig.run(&mut io);
    assert_eq!(io.conn.handover(), Err(Busy::InFlight(1)));
    for (task, op, mut buffer) in std::mem::take(&mut io.held) {
        let result = rig.medium.execute(&op, &mut buffer);
        io.conn.handle_backend_done(rig.now, task, buffer, result);
    }
    io.hold = false;
    rig.run(&mut io);
    assert!(io.done.remove(&11).unwrap().status.is_success());
    assert_eq!(&io.read.remove(&11).unwrap()[..], &data[..]);

    // A read whose capsule is half read when the controller stops: the rest waits in the
    // "socket" for the next process.
    let r = io_cmd(NvmOpcode::Read, 12, 16, 8, Sgl::transport(4096));
    io.host.send_command(&r, Bytes::new()).unwrap();
    let capsule = deliver(io.host.poll_transmit().unwrap(), &mut false);
    let (first, rest) = capsule.split_at(20);
    io.conn.receive(first);
    rig.run(&mut io);
    assert!(!io.done.contains_key(&12));

    let mut state = rig.subsystem.controller_state(cntlid).unwrap();
    state.queues = vec![a.conn.handover().unwrap(), io.conn.handover().unwrap()];
    assert_eq!(state.queues[1].unread, first);
    assert_eq!(state.aers, [6]);
    let namespaces = rig.subsystem.namespace_states();
    let state = ControllerState::decode(&state.encode()).unwrap();

    // The next process, on the same storage.
    let mut next = Rig::new();
    next.medium = std::mem::replace(&mut rig.medium, MemoryBackend::new(BLOCK, 1));
    for n in &namespaces {
        next.subsystem.adopt_namespace_state(n).unwrap();
    }
    let queues = next.subsystem.adopt_controller(next.now, &state).unwrap();
    assert_eq!(
        next.subsystem.adopt_controller(next.now, &state),
        Err(nvme::controller::AdoptError::Taken(cntlid))
    );
    // A subsystem that hands out other CNTLIDs (another gateway's range) refuses it.
    let mut other = Subsystem::new(SubsystemConfig {
        cntlids: (0x100, 0x1ff),
        ..testing::subsystem_config(NQN, &[HOST])
    });
    assert_eq!(
        other.adopt_controller(next.now, &state),
        Err(nvme::controller::AdoptError::Cntlid(cntlid))
    );
    let grants = QueueSettings::default().digests;
    a.conn = ControllerConnection::resume(&state.queues[0], queues[0], grants);
    io.conn = ControllerConnection::resume(&state.queues[1], queues[1], grants);
    io.conn.receive(rest);
    next.run(&mut io);
    assert!(io.done.remove(&12).unwrap().status.is_success());
    assert_eq!(&io.read.remove(&12).unwrap()[..], &data[..]);
    // The held AER answers a resize made in the next process.
    next.subsystem
        .add_namespace(testing::namespace(1, BLOCK, BLOCKS * 2));
    next.run(&mut a);
    let notice = a.done.remove(&6).expect("the AER answered");
    assert!(notice.status.is_success(), "{notice:?}");
    // The key its host registered holds in the next process.
    let mut report = Sqe::new(NvmOpcode::ReservationReport.code(), 13);
    report.set_nsid(1);
    report.set_cdw(10, 127 / 4);
    report.set_cdw(11, 1);
    report.set_sgl(Sgl::transport(128));
    io.host.send_command(&report, Bytes::new()).unwrap();
    next.run(&mut io);
    assert!(io.done.remove(&13).unwrap().status.is_success());
    let r = io.read.remove(&13).unwrap();
    assert_eq!(r[5], 1, "one registrant");
    assert_eq!(r[64 + 8..64 + 16], 0xb2u64.to_le_bytes(), "its key");
    // Keep Alive on the admin queue.
    let ka = Sqe::new(AdminOpcode::KeepAlive.code(), 7);
    assert!(admin(&mut a, &mut next, ka).status.is_success());
}
