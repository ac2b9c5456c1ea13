//! What the RDMA initiators' runs share (`initiator-bench run --transport srp|iser`): the
//! workload's plan of block I/Os over one logical unit, the loop that keeps each channel's
//! queue full ([`BlockChannel`]: SRP's channel, iSER's connection), verification, and the
//! report. The clock a run is measured on is its pace's: this machine's, or a software
//! fabric's virtual clock.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use hdrhistogram::Histogram;
use serde::Serialize;
use srp::initiator::Registration;

use crate::srp::LinkModel;
use crate::workload::{cpu_seconds, fill_pattern, Latency, Split, Workload, XorShift};

/// The logical unit's block size.
pub const BLOCK_SIZE: u32 = 512;
/// The logical unit's size when the workload names none.
pub const DEFAULT_SIZE: u64 = 64 << 20;

/// How an RDMA initiator (SRP or iSER) runs.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct RdmaOptions {
    /// How it registers its buffers.
    #[serde(serialize_with = "registration_name")]
    pub registration: Registration,
    /// Regions each command's buffer is cut into (1: one contiguous region; iSER names one).
    pub regions: usize,
    /// What the fabric charges.
    pub link: LinkModel,
    /// Send writes that fit as immediate data (SRP-2's in the IU, iSCSI's ImmediateData), when
    /// the target grants it.
    pub immediate_data: bool,
}

fn registration_name<S: serde::Serializer>(
    r: &Registration,
    s: S,
) -> std::result::Result<S::Ok, S::Error> {
    s.serialize_str(r.name())
}

/// What a run over RDMA measured.
#[derive(Debug, Clone, Serialize)]
pub struct RdmaReport {
    /// The transport: "SRP" or "iSER".
    pub transport: &'static str,
    /// The workload.
    pub workload: Workload,
    /// The initiator's options.
    pub options: RdmaOptions,
    /// Completed I/Os.
    pub ios: u64,
    /// I/Os that ended with a status other than GOOD.
    pub errors: u64,
    /// The fabric's clock over the run, seconds (0 on a free link).
    pub fabric_seconds: f64,
    /// I/Os per second of the fabric's clock.
    pub iops: f64,
    /// Payload bytes per second of the fabric's clock.
    pub bytes_per_sec: f64,
    /// Latency on the fabric's clock.
    pub latency_us: Latency,
    /// Memory registrations the initiator made per I/O.
    pub initiator_registrations_per_io: f64,
    /// Memory registrations the target made during the run (its buffers are registered
    /// once, at start).
    pub target_registrations: u64,
    /// Wall-clock time of the run on this machine, seconds.
    pub elapsed_seconds: f64,
    /// CPU time of this process (initiator and target both) during the run.
    pub cpu_seconds: f64,
    /// Blocks whose content was checked.
    pub verified_blocks: u64,
    /// Blocks that did not hold the expected pattern.
    pub verify_errors: u64,
}

/// One block I/O of a run: a READ, or a WRITE of `data`.
#[derive(Debug, Clone)]
struct BlockIo {
    /// First block.
    lba: u64,
    /// Blocks.
    blocks: u32,
    /// The data of a WRITE; none for a READ.
    data: Option<Vec<u8>>,
    /// A read whose data is to be checked against the pattern.
    checked: bool,
}

/// The I/Os of a workload over one logical unit: which block each goes to, what it
/// writes, which reads can be checked (their slot was written before they were sent), and,
/// after the run, the read-back of every slot written. Both runners draw from it.
struct Plan<'w> {
    w: &'w Workload,
    first: u64,
    per_io: u64,
    slots: u64,
    rng: XorShift,
    cursor: u64,
    read_percent: u64,
    /// Slots a write of this run has finished.
    written: Vec<bool>,
    deadline: Instant,
    issued: u64,
    /// The read-back's position.
    back: usize,
}

impl<'w> Plan<'w> {
    /// The plan of `w`, or why `w` cannot run over RDMA (SRP or iSER).
    fn new(w: &'w Workload) -> Result<Plan<'w>, String> {
        if !matches!(w.split, Split::None) {
            return Err("--split applies to iSCSI over TCP only; over RDMA (SRP, iSER) each I/O is one command".into());
        }
        let bs = u64::from(BLOCK_SIZE);
        if w.bs == 0 || u64::from(w.bs) % bs != 0 {
            return Err(format!("--bs must be a multiple of {BLOCK_SIZE} bytes"));
        }
        if w.offset % bs != 0 {
            return Err(format!("--offset must be a multiple of {BLOCK_SIZE} bytes"));
        }
        let size = w.size.unwrap_or(DEFAULT_SIZE);
        let slots = size / u64::from(w.bs);
        if slots == 0 {
            return Err(format!("--size {size} holds no I/O of {} bytes", w.bs));
        }
        Ok(Plan {
            w,
            first: w.offset / bs,
            per_io: u64::from(w.bs) / bs,
            slots,
            rng: XorShift(w.seed | 1),
            cursor: 0,
            read_percent: u64::from(w.rw.read_percent(w.rwmix)),
            written: vec![false; slots as usize],
            deadline: Instant::now() + w.time,
            issued: 0,
            back: 0,
        })
    }

    /// Blocks the logical unit needs.
    fn blocks(&self) -> u64 {
        self.first + self.slots * self.per_io
    }

    /// Starts the clock of a run that lasts `--time`.
    fn start(&mut self) {
        self.deadline = Instant::now() + self.w.time;
    }

    /// The next I/O of the run.
    fn next(&mut self) -> Option<BlockIo> {
        let done = match self.w.ios {
            Some(n) => self.issued >= n,
            None => Instant::now() >= self.deadline,
        };
        if done {
            return None;
        }
        self.issued += 1;
        let slot = if self.w.rw.random() {
            self.rng.next() % self.slots
        } else {
            self.cursor += 1;
            (self.cursor - 1) % self.slots
        };
        let lba = self.first + slot * self.per_io;
        let read = self.rng.next() % 100 < self.read_percent;
        let data = (!read).then(|| pattern(lba, self.per_io, self.w));
        Some(BlockIo {
            lba,
            blocks: self.per_io as u32,
            data,
            checked: read && self.w.verify && self.written[slot as usize],
        })
    }

    /// The next read of the read-back: a slot written during the run.
    fn next_back(&mut self) -> Option<BlockIo> {
        let at = self.written[self.back..].iter().position(|&b| b)? + self.back;
        self.back = at + 1;
        Some(BlockIo {
            lba: self.first + at as u64 * self.per_io,
            blocks: self.per_io as u32,
            data: None,
            checked: true,
        })
    }
}

/// Blocks of [`BLOCK_SIZE`] bytes the logical unit of `w` needs, or why `w` cannot run over
/// RDMA.
pub fn blocks(w: &Workload) -> Result<u64, String> {
    Ok(Plan::new(w)?.blocks())
}

/// What the I/Os of a run came to.
pub(crate) struct Tally {
    hist: Histogram<u64>,
    ios: u64,
    errors: u64,
    verified: u64,
    verify_errors: u64,
}

impl Tally {
    fn new() -> Tally {
        Tally {
            hist: Histogram::<u64>::new(3).expect("3 significant digits"),
            ios: 0,
            errors: 0,
            verified: 0,
            verify_errors: 0,
        }
    }

    /// An I/O of the run ended with `status` and, for a read, `data`.
    fn done(
        &mut self,
        plan: &mut Plan<'_>,
        io: &BlockIo,
        status: u8,
        data: &[u8],
        latency: Duration,
    ) {
        self.ios += 1;
        let _ = self.hist.record(latency.as_nanos() as u64);
        if status != 0 {
            self.errors += 1;
        } else if io.data.is_some() {
            plan.written[((io.lba - plan.first) / plan.per_io) as usize] = true;
        } else if io.checked {
            self.check(plan, io, status, data);
        }
    }

    /// A read of the read-back (or a checked read) ended.
    fn check(&mut self, plan: &Plan<'_>, io: &BlockIo, status: u8, data: &[u8]) {
        if status != 0 {
            self.verify_errors += plan.per_io;
            return;
        }
        let (v, e) = check(data, io.lba, plan.w);
        self.verified += v;
        self.verify_errors += e;
    }
}

/// Which clock a report's rates and latencies are on.
pub(crate) enum Clock {
    /// The fabric's virtual clock, over this many seconds.
    Fabric(f64),
    /// This machine's: the run's wall-clock seconds.
    Wall(f64),
    /// None (a free fabric charges nothing): only this machine's cost is reported.
    Free,
}

/// Registrations made during a run.
pub(crate) struct Registrations {
    /// By the initiator, in all.
    pub(crate) initiator: f64,
    /// By the target (known on a fabric; 0 where the initiator cannot see it).
    pub(crate) target: u64,
}

/// What the measured part of a run took: this machine's wall-clock and CPU seconds, the clock
/// its rates are on, the registrations made.
struct Measured {
    elapsed: f64,
    cpu: f64,
    clock: Clock,
    registrations: Registrations,
}

fn report(
    transport: &'static str,
    w: &Workload,
    o: &RdmaOptions,
    t: Tally,
    m: Measured,
) -> RdmaReport {
    let Measured {
        elapsed,
        cpu,
        clock,
        registrations,
    } = m;
    let (fabric, seconds) = match clock {
        Clock::Fabric(s) => (s, s),
        Clock::Wall(s) => (0.0, s),
        Clock::Free => (0.0, 0.0),
    };
    let per_sec = |n: f64| if seconds > 0.0 { n / seconds } else { 0.0 };
    RdmaReport {
        transport,
        workload: w.clone(),
        options: *o,
        ios: t.ios,
        errors: t.errors,
        fabric_seconds: fabric,
        iops: per_sec(t.ios as f64),
        bytes_per_sec: per_sec((t.ios * u64::from(w.bs)) as f64),
        latency_us: Latency::of(&t.hist),
        initiator_registrations_per_io: registrations.initiator / t.ios.max(1) as f64,
        target_registrations: registrations.target,
        elapsed_seconds: elapsed,
        cpu_seconds: cpu,
        verified_blocks: t.verified,
        verify_errors: t.verify_errors,
    }
}

/// How long a command waits for its answer before the run gives up on the target (the
/// channel's timeout).
pub(crate) const STALL: Duration = Duration::from_secs(30);

/// Bytes of each buffer place of an initiator's data memory for `w`: its regions apart
/// (twice its bytes) and its descriptor table.
pub fn place_len(w: &Workload, o: &RdmaOptions) -> usize {
    2 * w.bs as usize + o.regions * srp::iu::DESCRIPTOR_LEN + 4096
}

/// One command of a run as a channel sends it.
#[derive(Debug, Clone, Copy)]
pub struct Request<'a> {
    /// The tag the runner proposes (a channel whose protocol assigns its own returns that).
    pub tag: u64,
    /// The LUN index.
    pub lun: u16,
    /// The CDB, zero-padded.
    pub cdb: &'a [u8; 16],
    /// A write's data.
    pub data_out: Option<&'a [u8]>,
    /// A read's length.
    pub data_in: u32,
    /// Regions its buffer is cut into.
    pub regions: usize,
}

/// How a command ended.
#[derive(Debug, Clone)]
pub struct Answered {
    /// Its tag, as [`BlockChannel::send`] returned it.
    pub tag: u64,
    /// SCSI status.
    pub status: u8,
    /// A read's data (as much as the target sent).
    pub data: Vec<u8>,
}

/// One connection of an RDMA initiator as the runner drives it.
pub trait BlockChannel<V> {
    /// The transport's name in reports.
    const TRANSPORT: &'static str;
    /// Readies the channel for a run with `o` (immediate data, the command timeout), or says
    /// why it cannot run it.
    fn prepare(&mut self, o: &RdmaOptions) -> Result<(), String>;
    /// Whether the target takes another command now (credit, the CmdSN window).
    fn room(&self) -> bool;
    /// Sends `r`; its tag.
    fn send(&mut self, now: Instant, verbs: &mut V, r: &Request<'_>) -> Result<u64, String>;
    /// The next command that ended.
    fn poll(&mut self, verbs: &mut V) -> Option<Answered>;
    /// Runs the channel's timers; an error (a command past its timeout, the connection gone)
    /// ends the run.
    fn check(&mut self, now: Instant, verbs: &mut V) -> Result<(), String>;
}

/// What a run's loop does besides its channels: the clock its latencies are on, the turn of
/// a target in the same thread, and what it can count of the run.
pub(crate) trait Pace {
    /// The clock latencies are measured on.
    fn now(&mut self) -> Duration;
    /// A turn of the loop ended; `moved`: an answer came. An error when nothing can come.
    fn turn(&mut self, moved: bool) -> Result<(), String>;
    /// The measured part of the run starts.
    fn start(&mut self);
    /// The measured part ended after `elapsed` seconds on this machine: the clock its rates
    /// are on, and the registrations made during it (`ios` commands of `o`).
    fn end(&mut self, elapsed: f64, ios: u64, o: &RdmaOptions) -> (Clock, Registrations);
}

/// A target elsewhere (a device, another thread): this machine's clock; an idle turn yields.
pub(crate) struct WallClock(pub(crate) Instant);

impl Pace for WallClock {
    fn now(&mut self) -> Duration {
        self.0.elapsed()
    }

    fn turn(&mut self, moved: bool) -> Result<(), String> {
        if !moved {
            std::thread::yield_now();
        }
        Ok(())
    }

    fn start(&mut self) {}

    fn end(&mut self, elapsed: f64, ios: u64, o: &RdmaOptions) -> (Clock, Registrations) {
        // The initiator's registrations: as many per command as its strategy makes (the
        // target's cannot be seen from here).
        let per_command = match o.registration {
            Registration::PerCommand => o.regions as f64,
            _ => 0.0,
        };
        let registrations = Registrations {
            initiator: per_command * ios as f64,
            target: 0,
        };
        (Clock::Wall(elapsed), registrations)
    }
}

/// Runs `w` on LUN `lun` through `channels` (logged in over `verbs`), on this machine's
/// clock: the runner for real devices, and for a target on a software fabric shared between
/// threads. Each channel keeps `w.qd` commands in flight while the target has room.
pub fn run_channels<V, C: BlockChannel<V>>(
    verbs: &mut V,
    channels: &mut [C],
    lun: u16,
    w: &Workload,
    o: &RdmaOptions,
) -> Result<RdmaReport, String> {
    let mut pace = WallClock(Instant::now());
    run(verbs, channels, lun, w, o, &mut pace)
}

/// The runners' loop: each channel keeps `w.qd` commands in flight while the target has room;
/// after a run that wrote (with `--verify`), every slot written is read back and checked,
/// outside the measured part.
pub(crate) fn run<V, C: BlockChannel<V>>(
    verbs: &mut V,
    channels: &mut [C],
    lun: u16,
    w: &Workload,
    o: &RdmaOptions,
    pace: &mut dyn Pace,
) -> Result<RdmaReport, String> {
    let mut plan = Plan::new(w)?;
    for ch in channels.iter_mut() {
        ch.prepare(o)?;
    }
    let mut tag = 0u64;
    // Each nexus's first command hears of the power on: a TEST UNIT READY takes it.
    for ch in channels.iter_mut() {
        for _ in 0..3 {
            tag += 1;
            let tur = Request {
                tag,
                lun,
                cdb: &[0; 16],
                data_out: None,
                data_in: 0,
                regions: 1,
            };
            let sent = ch
                .send(Instant::now(), verbs, &tur)
                .map_err(|e| format!("TEST UNIT READY: {e}"))?;
            let a = wait_answer(verbs, ch, sent, pace)?;
            if a.status == 0 {
                break;
            }
        }
    }
    let mut tally = Tally::new();
    let mut in_flight: Vec<HashMap<u64, (BlockIo, Duration)>> =
        channels.iter().map(|_| HashMap::new()).collect();
    let cpu0 = cpu_seconds();
    let t0 = Instant::now();
    plan.start();
    pace.start();
    let mut measured = None;
    let mut open = true;
    let mut read_back = false;
    let mut cdb = [0u8; 16];
    loop {
        for (i, ch) in channels.iter_mut().enumerate() {
            while open && in_flight[i].len() < w.qd.max(1) && ch.room() {
                let io = if read_back {
                    plan.next_back()
                } else {
                    plan.next()
                };
                let Some(io) = io else {
                    open = false;
                    break;
                };
                tag += 1;
                cdb[0] = if io.data.is_some() { 0x8a } else { 0x88 };
                cdb[2..10].copy_from_slice(&io.lba.to_be_bytes());
                cdb[10..14].copy_from_slice(&io.blocks.to_be_bytes());
                let len = io.blocks * BLOCK_SIZE;
                let cmd = Request {
                    tag,
                    lun,
                    cdb: &cdb,
                    data_out: io.data.as_deref(),
                    data_in: if io.data.is_some() { 0 } else { len },
                    regions: o.regions,
                };
                // The command's time starts before the initiator registers its buffer.
                let start = pace.now();
                let sent = ch
                    .send(Instant::now(), verbs, &cmd)
                    .map_err(|e| format!("a command was refused: {e}"))?;
                in_flight[i].insert(sent, (io, start));
            }
        }
        let mut moved = false;
        for (i, ch) in channels.iter_mut().enumerate() {
            while let Some(a) = ch.poll(verbs) {
                moved = true;
                let Some((io, start)) = in_flight[i].remove(&a.tag) else {
                    continue;
                };
                if read_back {
                    tally.check(&plan, &io, a.status, &a.data);
                } else {
                    let latency = pace.now().saturating_sub(start);
                    tally.done(&mut plan, &io, a.status, &a.data, latency);
                }
            }
            ch.check(Instant::now(), verbs)
                .map_err(|e| format!("{e}, with {} commands in flight", in_flight[i].len()))?;
        }
        if in_flight.iter().all(HashMap::is_empty) && !open {
            if measured.is_none() {
                let elapsed = t0.elapsed().as_secs_f64();
                let cpu = cpu_seconds() - cpu0;
                let (clock, registrations) = pace.end(elapsed, tally.ios, o);
                measured = Some(Measured {
                    elapsed,
                    cpu,
                    clock,
                    registrations,
                });
            }
            if w.verify && !read_back {
                read_back = true;
                open = true;
                continue;
            }
            break;
        }
        pace.turn(moved)?;
    }
    let measured = measured.expect("the measured part ended");
    Ok(report(C::TRANSPORT, w, o, tally, measured))
}

/// Waits for the answer to `tag` on `ch`.
fn wait_answer<V, C: BlockChannel<V>>(
    verbs: &mut V,
    ch: &mut C,
    tag: u64,
    pace: &mut dyn Pace,
) -> Result<Answered, String> {
    loop {
        while let Some(a) = ch.poll(verbs) {
            if a.tag == tag {
                return Ok(a);
            }
        }
        ch.check(Instant::now(), verbs)?;
        pace.turn(false)?;
    }
}

/// The verify pattern of `blocks` blocks from `lba`.
fn pattern(lba: u64, blocks: u64, w: &Workload) -> Vec<u8> {
    let mut data = vec![0; (blocks * u64::from(BLOCK_SIZE)) as usize];
    for (i, block) in data.chunks_mut(BLOCK_SIZE as usize).enumerate() {
        fill_pattern(block, lba + i as u64, w.seed);
    }
    data
}

/// Checks a read from `lba` against the pattern: (blocks checked, blocks wrong).
fn check(data: &[u8], lba: u64, w: &Workload) -> (u64, u64) {
    let want = pattern(lba, data.len() as u64 / u64::from(BLOCK_SIZE), w);
    let blocks = data
        .chunks(BLOCK_SIZE as usize)
        .zip(want.chunks(BLOCK_SIZE as usize));
    let wrong = blocks.clone().filter(|(a, b)| a != b).count() as u64;
    (blocks.count() as u64, wrong)
}

/// Prints a report as `initiator-bench run` does.
pub fn print(r: &RdmaReport) {
    let w = &r.workload;
    let o = &r.options;
    let over = if r.fabric_seconds > 0.0 || r.iops == 0.0 {
        format!("the software fabric ({:?} link)", o.link)
    } else {
        "RDMA verbs".to_string()
    };
    println!(
        "{} over {over}, registration {}, {} region(s) per command",
        r.transport,
        o.registration.name(),
        o.regions
    );
    println!(
        "{:?} bs={} qd={} sessions={}: {} I/Os, {} errors",
        w.rw, w.bs, w.qd, w.sessions, r.ios, r.errors
    );
    if r.iops > 0.0 {
        let l = &r.latency_us;
        let (clock, seconds) = if r.fabric_seconds > 0.0 {
            ("fabric clock", r.fabric_seconds)
        } else {
            ("wall clock", r.elapsed_seconds)
        };
        println!(
            "  {clock}: {seconds:.4}s, IOPS {:.0}, throughput {:.1} MB/s",
            r.iops,
            r.bytes_per_sec / 1e6
        );
        println!(
            "  latency us: p50 {:.1}  p90 {:.1}  p99 {:.1}  p99.9 {:.1}  max {:.1}  mean {:.1}",
            l.p50, l.p90, l.p99, l.p999, l.max, l.mean
        );
    }
    println!(
        "  registrations: initiator {:.2} per I/O, target {}",
        r.initiator_registrations_per_io, r.target_registrations
    );
    println!(
        "  this machine: {:.2}s wall, {:.2}s CPU ({:.1} us per I/O, initiator and target)",
        r.elapsed_seconds,
        r.cpu_seconds,
        r.cpu_seconds * 1e6 / r.ios.max(1) as f64
    );
    if w.verify {
        println!(
            "  verified {} blocks, {} wrong",
            r.verified_blocks, r.verify_errors
        );
    }
}
