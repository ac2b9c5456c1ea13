//! Cross-layer tracing of storage commands (paper 000's integrated trace): each layer of the
//! target and the initiator records where a command is, as a fixed-size [`Record`], so that
//! the two machines' records merge into one timeline per command.
//!
//! Recording is per thread (a reactor, or an initiator's runtime thread) into a [`Ring`] made
//! when tracing starts: no lock, no allocation per record, and when tracing is off a record
//! costs one relaxed atomic load ([`record`]). The clock is CLOCK_MONOTONIC in nanoseconds
//! ([`now_ns`]); an [`Instant`] a sans-IO machine handed out converts with a [`Clock`]. A trace
//! file ([`TraceFile`]) holds which side wrote it, the offset of its clock from the other
//! side's when they are different hosts, and the records.
#![forbid(unsafe_code)]

use std::cell::RefCell;
use std::collections::VecDeque;
use std::io::{self, Read, Write};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

/// Where a command is. Target stages first, then the initiator's; the numbers are the file
/// format's.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[repr(u8)]
pub enum Stage {
    /// Target: the command's PDU (its header) arrived; `arg` is its expected data length.
    Received = 1,
    /// Target: handed to the core's CmdSN order (its write buffer, if any, in hand).
    Delivered = 2,
    /// Target: the SCSI core took it (its CmdSN's turn came).
    Dispatched = 3,
    /// Target: a backend operation waits for a buffer of `arg` bytes.
    BufferWait = 4,
    /// Target: a backend operation of `arg` bytes submitted.
    BackendSubmit = 5,
    /// Target: the backend operation ended.
    BackendDone = 6,
    /// Target: an R2T for `arg` bytes sent.
    R2tSent = 7,
    /// Target: all the data-out is in.
    DataOutDone = 8,
    /// Target: Data-In (`arg` bytes) and status queued for sending.
    Responded = 9,
    /// Target: a NOP-Out (its ITT) arrived: with the initiator's [`Stage::NopSent`] and
    /// [`Stage::NopAnswered`] it dates the two clocks against each other.
    NopReceived = 10,
    /// Target: the shell wrote the command's Data-In (`arg` bytes) to the socket.
    DataInSent = 11,
    /// Target: the shell wrote its status (a SCSI Response, or the last Data-In's).
    StatusSent = 12,
    /// Initiator: the workload submitted the command; `arg` is its data length.
    Submitted = 32,
    /// Initiator: the command waits for the target's CmdSN window.
    WindowWait = 33,
    /// Initiator: its PDU went to the socket.
    Sent = 34,
    /// Initiator: the first data of its answer arrived.
    FirstData = 35,
    /// Initiator: its status arrived.
    StatusReceived = 36,
    /// Initiator: handed back to the workload.
    Completed = 37,
    /// Initiator: a NOP-Out sent (to date the clocks).
    NopSent = 38,
    /// Initiator: its NOP-In arrived.
    NopAnswered = 39,
}

impl Stage {
    /// Every stage, in order.
    pub const ALL: [Stage; 20] = [
        Stage::Received,
        Stage::Delivered,
        Stage::Dispatched,
        Stage::BufferWait,
        Stage::BackendSubmit,
        Stage::BackendDone,
        Stage::R2tSent,
        Stage::DataOutDone,
        Stage::Responded,
        Stage::NopReceived,
        Stage::DataInSent,
        Stage::StatusSent,
        Stage::Submitted,
        Stage::WindowWait,
        Stage::Sent,
        Stage::FirstData,
        Stage::StatusReceived,
        Stage::Completed,
        Stage::NopSent,
        Stage::NopAnswered,
    ];

    /// The stage of a file's code.
    pub fn from_code(code: u8) -> Option<Stage> {
        Stage::ALL.into_iter().find(|s| *s as u8 == code)
    }

    /// Its name in reports.
    pub fn name(self) -> &'static str {
        match self {
            Stage::Received => "received",
            Stage::Delivered => "delivered",
            Stage::Dispatched => "dispatched",
            Stage::BufferWait => "buffer wait",
            Stage::BackendSubmit => "backend submit",
            Stage::BackendDone => "backend done",
            Stage::R2tSent => "R2T sent",
            Stage::DataOutDone => "data-out done",
            Stage::Responded => "responded",
            Stage::NopReceived => "NOP-Out received",
            Stage::DataInSent => "Data-In sent",
            Stage::StatusSent => "status sent",
            Stage::Submitted => "submitted",
            Stage::WindowWait => "window wait",
            Stage::Sent => "sent",
            Stage::FirstData => "first data",
            Stage::StatusReceived => "status received",
            Stage::Completed => "completed",
            Stage::NopSent => "NOP-Out sent",
            Stage::NopAnswered => "NOP-In received",
        }
    }

    /// Whether the target records it (else the initiator).
    pub fn is_target(self) -> bool {
        (self as u8) < 32
    }
}

/// One point of one command's life: 32 bytes on disk.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Record {
    /// CLOCK_MONOTONIC, nanoseconds.
    pub at_ns: u64,
    /// The session: ISID (6 bytes) and TSIH (2 bytes) as one big-endian number.
    pub session: u64,
    /// Initiator Task Tag.
    pub itt: u32,
    /// CmdSN (at [`Stage::Received`] and [`Stage::Submitted`]; 0 where the layer does not
    /// know it).
    pub cmd_sn: u32,
    /// Where the command is.
    pub stage: Stage,
    /// The recording thread's lane (a reactor's index).
    pub lane: u8,
    /// The stage's number (bytes, mostly).
    pub arg: u32,
}

impl Record {
    /// Bytes of a record in a file.
    pub const LEN: usize = 32;

    /// The session number of an ISID and a TSIH.
    pub fn session_of(isid: [u8; 6], tsih: u16) -> u64 {
        let mut b = [0u8; 8];
        b[..6].copy_from_slice(&isid);
        b[6..].copy_from_slice(&tsih.to_be_bytes());
        u64::from_be_bytes(b)
    }

    /// The session number of an SRP I_T nexus's initiator port identifier (its two halves
    /// folded), which stands where iSCSI has ISID and TSIH.
    pub fn session_of_port(id: [u8; 16]) -> u64 {
        let hi = u64::from_be_bytes(id[..8].try_into().expect("8 bytes"));
        let lo = u64::from_be_bytes(id[8..].try_into().expect("8 bytes"));
        hi ^ lo
    }

    /// The session number of an NVMe-oF queue: the subsystem's NQN (hashed, FNV-1a, into
    /// the top 32 bits), the controller ID and the queue ID, which both ends know once the
    /// queue is connected. CIDs stand where ITTs do.
    pub fn session_of_queue(subnqn: &str, cntlid: u16, qid: u16) -> u64 {
        let mut h: u64 = 0xcbf2_9ce4_8422_2325;
        for b in subnqn.bytes() {
            h ^= u64::from(b);
            h = h.wrapping_mul(0x0000_0100_0000_01b3);
        }
        (h >> 32 ^ h & 0xffff_ffff) << 32 | u64::from(cntlid) << 16 | u64::from(qid)
    }

    /// Its 32 bytes (little-endian fields).
    pub fn encode(&self) -> [u8; Record::LEN] {
        let mut b = [0u8; Record::LEN];
        b[0..8].copy_from_slice(&self.at_ns.to_le_bytes());
        b[8..16].copy_from_slice(&self.session.to_le_bytes());
        b[16..20].copy_from_slice(&self.itt.to_le_bytes());
        b[20..24].copy_from_slice(&self.cmd_sn.to_le_bytes());
        b[24] = self.stage as u8;
        b[25] = self.lane;
        b[28..32].copy_from_slice(&self.arg.to_le_bytes());
        b
    }

    /// A record from its bytes; `None` for a stage this reader does not know.
    pub fn decode(b: &[u8; Record::LEN]) -> Option<Record> {
        let u64_at = |i: usize| u64::from_le_bytes(b[i..i + 8].try_into().expect("8 bytes"));
        let u32_at = |i: usize| u32::from_le_bytes(b[i..i + 4].try_into().expect("4 bytes"));
        Some(Record {
            at_ns: u64_at(0),
            session: u64_at(8),
            itt: u32_at(16),
            cmd_sn: u32_at(20),
            stage: Stage::from_code(b[24])?,
            lane: b[25],
            arg: u32_at(28),
        })
    }
}

/// Where a command was at `at`, as a sans-IO machine reports it ([`Points`]): what its shell
/// records, with the session, as a [`Record`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Point {
    /// The stage.
    pub stage: Stage,
    /// The command's tag (iSCSI's ITT; SRP's tag, its low 32 bits).
    pub itt: u32,
    /// Its CmdSN where known, else 0.
    pub cmd_sn: u32,
    /// Bytes, mostly (see [`Stage`]).
    pub arg: u32,
    /// When (the machine's `now`).
    pub at: Instant,
}

/// The trace points a sans-IO machine queues for its shell: off (nothing kept) until
/// [`Points::set`], bounded, taken with [`Points::poll`] after each step.
#[derive(Debug, Default)]
pub struct Points {
    queue: Option<VecDeque<Point>>,
}

/// Points a machine keeps untaken at most.
const POINTS: usize = 4096;

impl Points {
    /// Turns the points on or off (off drops what is queued).
    pub fn set(&mut self, on: bool) {
        if on != self.queue.is_some() {
            self.queue = on.then(|| VecDeque::with_capacity(POINTS));
        }
    }

    /// Whether they are on.
    pub fn is_on(&self) -> bool {
        self.queue.is_some()
    }

    /// Notes that command `itt` reached `stage` at `at`, when on and not full.
    #[inline]
    pub fn push(&mut self, at: Instant, stage: Stage, itt: u32, cmd_sn: u32, arg: u32) {
        if let Some(q) = &mut self.queue {
            if q.len() < POINTS {
                q.push_back(Point {
                    stage,
                    itt,
                    cmd_sn,
                    arg,
                    at,
                });
            }
        }
    }

    /// The oldest point not yet taken.
    pub fn poll(&mut self) -> Option<Point> {
        self.queue.as_mut()?.pop_front()
    }
}

/// CLOCK_MONOTONIC now, in nanoseconds: the same clock in every process of a host.
pub fn now_ns() -> u64 {
    let t = rustix::time::clock_gettime(rustix::time::ClockId::Monotonic);
    (t.tv_sec as u64).saturating_mul(1_000_000_000) + t.tv_nsec as u64
}

/// Turns the [`Instant`]s a sans-IO machine hands out into [`now_ns`] time.
#[derive(Debug, Clone, Copy)]
pub struct Clock {
    instant: Instant,
    ns: u64,
}

impl Clock {
    /// A clock anchored now: the instant read between two readings of the monotonic clock
    /// that are close together (a thread preempted between them would skew every time it
    /// converts), and their midpoint.
    pub fn new() -> Clock {
        let mut best: Option<(u64, Clock)> = None;
        for _ in 0..16 {
            let before = now_ns();
            let instant = Instant::now();
            let after = now_ns();
            let gap = after.saturating_sub(before);
            let c = Clock {
                instant,
                ns: before + gap / 2,
            };
            if best.as_ref().is_none_or(|(g, _)| gap < *g) {
                best = Some((gap, c));
            }
            if gap < 1_000 {
                break;
            }
        }
        best.expect("at least one reading").1
    }

    /// `at` in CLOCK_MONOTONIC nanoseconds.
    pub fn ns(&self, at: Instant) -> u64 {
        match at.checked_duration_since(self.instant) {
            Some(d) => self.ns + d.as_nanos() as u64,
            None => self
                .ns
                .saturating_sub(self.instant.duration_since(at).as_nanos() as u64),
        }
    }
}

impl Default for Clock {
    fn default() -> Self {
        Clock::new()
    }
}

/// A thread's records: a fixed capacity made when tracing starts, then no allocation. When
/// full, later records are counted and dropped (the start of a run is kept whole).
#[derive(Debug)]
pub struct Ring {
    records: Vec<Record>,
    capacity: usize,
    dropped: u64,
    /// The first drop has been reported ([`ring_filled`]).
    told: bool,
}

impl Ring {
    /// A ring of `capacity` records.
    pub fn with_capacity(capacity: usize) -> Ring {
        Ring {
            records: Vec::with_capacity(capacity),
            capacity,
            dropped: 0,
            told: false,
        }
    }

    /// Keeps `r`, if there is room.
    #[inline]
    pub fn push(&mut self, r: Record) {
        if self.records.len() < self.capacity {
            self.records.push(r);
        } else {
            self.dropped += 1;
        }
    }

    /// The records kept.
    pub fn records(&self) -> &[Record] {
        &self.records
    }

    /// Records that found no room.
    pub fn dropped(&self) -> u64 {
        self.dropped
    }

    /// Its records, and how many were dropped.
    pub fn into_parts(self) -> (Vec<Record>, u64) {
        (self.records, self.dropped)
    }
}

/// Whether any thread records: the one check a trace point makes when tracing is off.
static ENABLED: AtomicBool = AtomicBool::new(false);

thread_local! {
    static RING: RefCell<Option<Ring>> = const { RefCell::new(None) };
}

/// Starts recording on this thread into a ring of `capacity` records (allocated now), and
/// turns the trace points on.
pub fn arm(capacity: usize) {
    RING.with(|r| *r.borrow_mut() = Some(Ring::with_capacity(capacity)));
    ENABLED.store(true, Ordering::Release);
}

/// Stops recording everywhere; each thread's ring stays for [`take`].
pub fn disarm() {
    ENABLED.store(false, Ordering::Release);
}

/// Whether trace points record now.
#[inline]
pub fn enabled() -> bool {
    ENABLED.load(Ordering::Relaxed)
}

/// Whether this thread's ring has just begun to drop records: true once per ring, the first
/// time it is asked after its first drop, so the recorder can say so loudly while the trace
/// still runs.
pub fn ring_filled() -> bool {
    RING.with(|ring| match ring.borrow_mut().as_mut() {
        Some(r) if r.dropped > 0 && !r.told => {
            r.told = true;
            true
        }
        _ => false,
    })
}

/// This thread's ring, taken (recording on this thread stops).
pub fn take() -> Option<Ring> {
    RING.with(|r| r.borrow_mut().take())
}

/// Records `r` on this thread, if tracing is on and the thread is armed.
#[inline]
pub fn record(r: Record) {
    if !enabled() {
        return;
    }
    RING.with(|ring| {
        if let Some(ring) = ring.borrow_mut().as_mut() {
            ring.push(r);
        }
    });
}

/// Which side wrote a trace.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Side {
    /// A target.
    Target,
    /// An initiator.
    Initiator,
}

/// A trace file: its side, the clock offset, the records, and how many were dropped.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TraceFile {
    /// Who recorded it.
    pub side: Side,
    /// Nanoseconds to add to this file's times to put them on the other side's clock (0 on
    /// one host; estimated from NOP round trips across hosts).
    pub offset_ns: i64,
    /// Records lost to full rings.
    pub dropped: u64,
    /// The records, in no particular order.
    pub records: Vec<Record>,
}

/// The file's first bytes.
const MAGIC: &[u8; 8] = b"CMDTRACE";
/// Its format version.
const VERSION: u32 = 1;

impl TraceFile {
    /// Writes it: magic, version, side, offset, dropped, count, then the records.
    pub fn write_to(&self, w: &mut impl Write) -> io::Result<()> {
        let mut h = Vec::with_capacity(40);
        h.extend_from_slice(MAGIC);
        h.extend_from_slice(&VERSION.to_le_bytes());
        h.extend_from_slice(&(self.side as u32).to_le_bytes());
        h.extend_from_slice(&self.offset_ns.to_le_bytes());
        h.extend_from_slice(&self.dropped.to_le_bytes());
        h.extend_from_slice(&(self.records.len() as u64).to_le_bytes());
        w.write_all(&h)?;
        for r in &self.records {
            w.write_all(&r.encode())?;
        }
        w.flush()
    }

    /// Reads one; records of stages this reader does not know are skipped.
    pub fn read_from(r: &mut impl Read) -> io::Result<TraceFile> {
        let bad = |why: &str| io::Error::new(io::ErrorKind::InvalidData, why.to_string());
        let mut h = [0u8; 40];
        r.read_exact(&mut h)?;
        if &h[..8] != MAGIC {
            return Err(bad("not a command trace (no CMDTRACE magic)"));
        }
        let u32_at = |i: usize| u32::from_le_bytes(h[i..i + 4].try_into().expect("4 bytes"));
        let u64_at = |i: usize| u64::from_le_bytes(h[i..i + 8].try_into().expect("8 bytes"));
        if u32_at(8) != VERSION {
            return Err(bad("a command trace of another version"));
        }
        let side = match u32_at(12) {
            0 => Side::Target,
            1 => Side::Initiator,
            _ => return Err(bad("a command trace of an unknown side")),
        };
        let count = u64_at(32);
        let mut records = Vec::new();
        let mut b = [0u8; Record::LEN];
        for _ in 0..count {
            r.read_exact(&mut b)?;
            records.extend(Record::decode(&b));
        }
        Ok(TraceFile {
            side,
            offset_ns: u64_at(16) as i64,
            dropped: u64_at(24),
            records,
        })
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn an_nvme_queue_is_its_subsystem_controller_and_queue() {
        let a = Record::session_of_queue("nqn.2026-11.io.example:a", 1, 1);
        assert_eq!(a & 0xffff_ffff, 1 << 16 | 1);
        assert_ne!(
            a,
            Record::session_of_queue("nqn.2026-11.io.example:a", 1, 0)
        );
        assert_ne!(
            a,
            Record::session_of_queue("nqn.2026-11.io.example:a", 2, 1)
        );
        assert_ne!(
            a,
            Record::session_of_queue("nqn.2026-11.io.example:b", 1, 1)
        );
        assert_eq!(
            a,
            Record::session_of_queue("nqn.2026-11.io.example:a", 1, 1)
        );
    }

    use super::*;

    fn r(stage: Stage, at_ns: u64) -> Record {
        Record {
            at_ns,
            session: Record::session_of([0x80, 1, 2, 3, 4, 5], 7),
            itt: 9,
            cmd_sn: 3,
            stage,
            lane: 1,
            arg: 512,
        }
    }

    #[test]
    fn records_and_files_round_trip() {
        for s in Stage::ALL {
            let x = r(s, 123_456_789);
            assert_eq!(Record::decode(&x.encode()), Some(x));
        }
        let mut unknown = r(Stage::Sent, 1).encode();
        unknown[24] = 200;
        assert_eq!(Record::decode(&unknown), None);
        let f = TraceFile {
            side: Side::Initiator,
            offset_ns: -42,
            dropped: 3,
            records: vec![r(Stage::Submitted, 1), r(Stage::Completed, 2)],
        };
        let mut b = Vec::new();
        f.write_to(&mut b).expect("written");
        assert_eq!(b.len(), 40 + 2 * Record::LEN);
        assert_eq!(TraceFile::read_from(&mut &b[..]).expect("read"), f);
        assert!(
            TraceFile::read_from(&mut &b"not a trace file at all, no............"[..]).is_err()
        );
        assert!(TraceFile::read_from(&mut &b[..50]).is_err(), "cut short");
    }

    #[test]
    fn a_ring_keeps_the_start_and_counts_what_it_drops() {
        let mut ring = Ring::with_capacity(2);
        for t in 0..5 {
            ring.push(r(Stage::Received, t));
        }
        assert_eq!(ring.records().len(), 2);
        assert_eq!(ring.records()[1].at_ns, 1);
        assert_eq!(ring.dropped(), 3);
    }

    #[test]
    fn threads_record_only_when_armed_and_enabled() {
        std::thread::spawn(|| {
            record(r(Stage::Received, 1));
            assert!(take().is_none(), "never armed");
            arm(16);
            record(r(Stage::Received, 2));
            disarm();
            record(r(Stage::Received, 3));
            let ring = take().expect("armed");
            assert_eq!(ring.records().len(), 1);
            assert_eq!(ring.records()[0].at_ns, 2);
        })
        .join()
        .expect("the recording thread");
    }

    #[test]
    fn the_clock_turns_instants_into_monotonic_nanoseconds() {
        let c = Clock::new();
        let before = now_ns();
        let later = Instant::now() + std::time::Duration::from_millis(5);
        let ns = c.ns(later);
        assert!(ns >= before + 4_000_000, "{ns} {before}");
        assert!(c.ns(c.instant) == c.ns);
    }
}
