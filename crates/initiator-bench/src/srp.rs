//! Workloads over SRP: `initiator-bench run --transport srp fabric|URL`.
//!
//! The initiator is the crate's [`InitiatorChannel`]: its commands' buffers lie in an
//! [`srp::initiator::DataMemory`], registered per command, through a cache or as one pool
//! (paper 004's three ways), cut into `regions` discrete regions each. Over an RDMA device
//! (`run_rdma`, feature `rdma`) the target is whatever the URL names. On the software fabric
//! ([`run_fabric`]) it is a [`LoopbackTarget`] (the real SRP channel on scsi-core, with a
//! memory logical unit) in the same process and thread: the fabric charges its costs to a
//! virtual clock (with `--link paper004`, the paper's measured costs of registration and of
//! the wire), so throughput and latency are reported on that clock, deterministic whatever
//! this machine is doing; the wall-clock and CPU time this process spent are reported beside
//! them, as the software's own cost.
//!
//! The fabric serialises everything it charges (one link, no overlap), so on its clock queue
//! depth adds no parallelism: it shows what a command costs, as the paper's figures do.

use std::time::{Duration, Instant};

use hdrhistogram::Histogram;
use serde::Serialize;
use std::collections::HashMap;

use srp::fabric::{Counters, NodeId, PAPER_004_COSTS};
use srp::initiator::channel::{Answer, Command, InitiatorChannel};
use srp::initiator::Registration;
use srp::iu::{BufferFormats, MultiChannelAction, SrpLoginReq, TaskAttribute, DESCRIPTOR_LEN};
use srp::loopback::{LoopbackTarget, MemoryUnit};
use srp::switch::{Endpoint, Switch};
use srp::target_port::PortSettings;
use srp::verbs::{IuBuffers, PeerMemory, Verbs};

use crate::workload::{cpu_seconds, fill_pattern, Latency, Split, Workload, XorShift};

/// The logical unit's block size.
pub const BLOCK_SIZE: u32 = 512;
/// The logical unit's size when the workload names none.
pub const DEFAULT_SIZE: u64 = 64 << 20;

/// What the fabric charges.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum LinkModel {
    /// Paper 004's measured costs ([`PAPER_004_COSTS`]: a 600 MB/s InfiniBand link,
    /// registrations at 7.68 us plus 0.109 ns per byte).
    Paper004,
    /// Nothing: only this machine's own time is reported.
    Free,
}

/// How the SRP initiator runs.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct SrpOptions {
    /// How it registers its buffers.
    #[serde(serialize_with = "registration_name")]
    pub registration: Registration,
    /// Regions each command's buffer is cut into (1: one contiguous region).
    pub regions: usize,
    /// What the fabric charges.
    pub link: LinkModel,
    /// Send writes that fit in the IU as immediate data (SRP-2), when the target grants it.
    pub immediate_data: bool,
}

fn registration_name<S: serde::Serializer>(
    r: &Registration,
    s: S,
) -> std::result::Result<S::Ok, S::Error> {
    s.serialize_str(r.name())
}

/// What an SRP run measured.
#[derive(Debug, Clone, Serialize)]
pub struct SrpReport {
    /// The workload.
    pub workload: Workload,
    /// The initiator's options.
    pub options: SrpOptions,
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
    /// The plan of `w`, or why `w` cannot run over SRP.
    fn new(w: &'w Workload) -> Result<Plan<'w>, String> {
        if !matches!(w.split, Split::None) {
            return Err("--split applies to iSCSI only; SRP sends each I/O as one command".into());
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

/// What the I/Os of a run came to.
struct Tally {
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

/// The target's node on the software fabric.
const FABRIC_TARGET: NodeId = NodeId(0);
/// The initiator's.
const FABRIC_INITIATOR: NodeId = NodeId(1);
/// The in-process target's port identifier.
const FABRIC_TARGET_PORT: [u8; 16] = *b"srp-target-port0";

/// Runs `w` over SRP on the software fabric against an in-process [`LoopbackTarget`] with one
/// memory logical unit of `w.offset + w.size` bytes (64 MiB of range by default), stepped in
/// this thread between the initiator's turns. Rates and latencies are on the fabric's clock
/// (none on a free link); the registrations of both sides are the fabric's counts.
pub fn run_fabric(w: &Workload, o: &SrpOptions) -> Result<SrpReport, String> {
    let blocks = Plan::new(w)?.blocks();
    let switch = Switch::new();
    let settings = PortSettings {
        target_port_id: FABRIC_TARGET_PORT,
        ..PortSettings::default()
    };
    let unit = MemoryUnit {
        lun: 0,
        block_size: BLOCK_SIZE,
        blocks,
    };
    let mut target = LoopbackTarget::new(&switch, FABRIC_TARGET, "srp", settings, &[unit])
        .map_err(|e| e.to_string())?;
    let mut verbs: Endpoint<Vec<u8>> = switch.endpoint(FABRIC_INITIATOR);
    let place = place_len(w, o);
    let mut channels = Vec::new();
    for s in 0..w.sessions.max(1) {
        let mut req = login_request(s, FABRIC_TARGET_PORT, 48 + 20 + 32 * 16);
        if o.immediate_data {
            // As Linux's ib_srp asks by default: 8 KiB of immediate data.
            req.req_it_iu_len = req.req_it_iu_len.max(u32::from(IMM_DATA_OFFSET) + 8192);
        } else {
            req.immediate_data = false;
        }
        let places = w.qd.max(1);
        let (ch, _) = target
            .login(&mut verbs, &req, o.registration, places, place)
            .map_err(|e| e.to_string())?;
        channels.push(ch);
    }
    if o.link == LinkModel::Paper004 {
        switch.with(|f| f.costs = PAPER_004_COSTS);
    }
    let mut pace = InProcess {
        target: &mut target,
        switch: &switch,
        at_start: (Duration::ZERO, Counters::default()),
    };
    run(&mut verbs, &mut channels, 0, w, o, &mut pace)
}

/// The initiator port identifier of session `s`.
fn initiator_port(s: usize) -> [u8; 16] {
    let mut port = *b"initiator-bench\0";
    port[15] = s as u8;
    port
}

/// Which clock a report's rates and latencies are on.
enum Clock {
    /// The fabric's virtual clock, over this many seconds.
    Fabric(f64),
    /// This machine's: the run's wall-clock seconds.
    Wall(f64),
    /// None (a free fabric charges nothing): only this machine's cost is reported.
    Free,
}

/// Registrations made during a run.
struct Registrations {
    /// By the initiator, in all.
    initiator: f64,
    /// By the target (known on a fabric; 0 where the initiator cannot see it).
    target: u64,
}

fn report(
    w: &Workload,
    o: &SrpOptions,
    t: Tally,
    clock: Clock,
    registrations: Registrations,
    elapsed: f64,
    cpu: f64,
) -> SrpReport {
    let (fabric, seconds) = match clock {
        Clock::Fabric(s) => (s, s),
        Clock::Wall(s) => (0.0, s),
        Clock::Free => (0.0, 0.0),
    };
    let per_sec = |n: f64| if seconds > 0.0 { n / seconds } else { 0.0 };
    SrpReport {
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

/// An SRP target on an RDMA device as a URL names it: `srp://ADDR:PORT/TARGET/LUN`, where
/// TARGET is its target port identifier in 32 hex digits, or a targetd target's name (whose
/// identifier is derived from it, [`srp::target_port::port_id_for`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SrpUrl {
    /// The target's rdma_cm address.
    pub addr: std::net::SocketAddr,
    /// Its target port identifier.
    pub target_port_id: [u8; 16],
    /// The LUN.
    pub lun: u16,
}

impl SrpUrl {
    /// Parses `srp://ADDR:PORT/TARGET/LUN`.
    pub fn parse(url: &str) -> Result<SrpUrl, String> {
        let rest = url
            .strip_prefix("srp://")
            .ok_or_else(|| format!("{url:?} is not srp://ADDR:PORT/TARGET/LUN"))?;
        let mut parts = rest.splitn(3, '/');
        let (Some(addr), Some(target), Some(lun)) = (parts.next(), parts.next(), parts.next())
        else {
            return Err(format!("{url:?} is not srp://ADDR:PORT/TARGET/LUN"));
        };
        let addr = addr
            .parse()
            .map_err(|_| format!("{addr:?} in {url:?} is not an address:port"))?;
        let lun = lun
            .parse()
            .map_err(|_| format!("{lun:?} in {url:?} is not a LUN"))?;
        let hex = target.len() == 32 && target.bytes().all(|b| b.is_ascii_hexdigit());
        let target_port_id = if hex {
            let mut id = [0u8; 16];
            for (i, b) in id.iter_mut().enumerate() {
                *b = u8::from_str_radix(&target[2 * i..2 * i + 2], 16).expect("hex digits");
            }
            id
        } else {
            srp::target_port::port_id_for(target)
        };
        Ok(SrpUrl {
            addr,
            target_port_id,
            lun,
        })
    }
}

/// Where this initiator puts immediate data in an SRP_CMD, as Linux's ib_srp does: after the
/// 48-byte SRP_CMD, 16 bytes of additional CDB and the 4-byte immediate descriptor.
pub const IMM_DATA_OFFSET: u16 = 68;

/// The login request of session `s` to `target_port_id`, asking for IUs of `it_iu_len` bytes
/// and for immediate data at [`IMM_DATA_OFFSET`], as Linux's ib_srp does.
pub fn login_request(s: usize, target_port_id: [u8; 16], it_iu_len: u32) -> SrpLoginReq {
    SrpLoginReq {
        tag: s as u64,
        req_it_iu_len: it_iu_len,
        immediate_data: true,
        imm_data_offset: IMM_DATA_OFFSET,
        req_buf_fmt: BufferFormats::BOTH,
        multi_channel: MultiChannelAction::SingleChannel,
        initiator_port_id: initiator_port(s),
        target_port_id,
    }
}

/// How long a command waits for its answer before the run gives up on the target (the
/// channel's timeout).
const STALL: Duration = Duration::from_secs(30);

/// Runs `w` on LUN `lun` through `channels` (logged in over `verbs`), on this machine's
/// clock: the runner for real devices, and for a target on a software fabric shared between
/// threads. Each channel keeps `w.qd` commands in flight while its credit lasts.
pub fn run_channels<V>(
    verbs: &mut V,
    channels: &mut [InitiatorChannel<V>],
    lun: u16,
    w: &Workload,
    o: &SrpOptions,
) -> Result<SrpReport, String>
where
    V: Verbs + PeerMemory + IuBuffers<Iu = <V as Verbs>::Buffer>,
{
    let mut pace = WallClock(Instant::now());
    run(verbs, channels, lun, w, o, &mut pace)
}

/// What a run's loop does besides its channels: the clock its latencies are on, the turn of
/// a target in the same thread, and what it can count of the run.
trait Pace {
    /// The clock latencies are measured on.
    fn now(&mut self) -> Duration;
    /// A turn of the loop ended; `moved`: an answer came. An error when nothing can come.
    fn turn(&mut self, moved: bool) -> Result<(), String>;
    /// The measured part of the run starts.
    fn start(&mut self);
    /// The measured part ended after `elapsed` seconds on this machine: the clock its rates
    /// are on, and the registrations made during it (`ios` commands of `o`).
    fn end(&mut self, elapsed: f64, ios: u64, o: &SrpOptions) -> (Clock, Registrations);
}

/// A target elsewhere (a device, another thread): this machine's clock; an idle turn yields.
struct WallClock(Instant);

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

    fn end(&mut self, elapsed: f64, ios: u64, o: &SrpOptions) -> (Clock, Registrations) {
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

/// A [`LoopbackTarget`] in this thread: each turn steps it; the fabric's clock and counters.
struct InProcess<'a> {
    target: &'a mut LoopbackTarget,
    switch: &'a std::sync::Arc<Switch>,
    /// The fabric's clock and counters when the measured part started.
    at_start: (Duration, Counters),
}

impl Pace for InProcess<'_> {
    fn now(&mut self) -> Duration {
        self.switch.with(|f| f.elapsed)
    }

    fn turn(&mut self, moved: bool) -> Result<(), String> {
        if self.target.step(Instant::now()) || moved {
            Ok(())
        } else {
            Err("the in-process target has nothing left to do, yet commands wait".into())
        }
    }

    fn start(&mut self) {
        self.at_start = self.switch.with(|f| (f.elapsed, f.counters));
    }

    fn end(&mut self, _elapsed: f64, _ios: u64, _o: &SrpOptions) -> (Clock, Registrations) {
        let (clock, before) = self.at_start;
        let (now, after) = self.switch.with(|f| (f.elapsed, f.counters));
        let fabric = (now - clock).as_secs_f64();
        let registrations = Registrations {
            initiator: (after.registrations[1] - before.registrations[1]) as f64,
            target: after.registrations[0] - before.registrations[0],
        };
        let clock = if fabric > 0.0 {
            Clock::Fabric(fabric)
        } else {
            Clock::Free
        };
        (clock, registrations)
    }
}

/// The loop of [`run_channels`] and [`run_fabric`]; after a run that wrote (with `--verify`),
/// every slot written is read back and checked, outside the measured part.
fn run<V>(
    verbs: &mut V,
    channels: &mut [InitiatorChannel<V>],
    lun: u16,
    w: &Workload,
    o: &SrpOptions,
    pace: &mut dyn Pace,
) -> Result<SrpReport, String>
where
    V: Verbs + PeerMemory + IuBuffers<Iu = <V as Verbs>::Buffer>,
{
    let mut plan = Plan::new(w)?;
    for ch in channels.iter_mut() {
        if o.immediate_data {
            ch.use_immediate_data(IMM_DATA_OFFSET);
        }
        // A command unanswered this long ends its channel (the channel's own timer).
        ch.set_timeout(Some(STALL));
    }
    let lun_field = u64::from(lun) << 48;
    let mut tag = 0u64;
    // Each nexus's first command hears of the power on: a TEST UNIT READY takes it.
    for ch in channels.iter_mut() {
        for _ in 0..3 {
            tag += 1;
            let tur = Command {
                tag,
                lun: lun_field,
                cdb: &[0; 6],
                data_out: None,
                data_in: 0,
                regions: 1,
                partial: false,
                attribute: TaskAttribute::Simple,
            };
            ch.send(Instant::now(), verbs, &tur)
                .map_err(|e| format!("TEST UNIT READY: {e}"))?;
            let a = wait_answer(verbs, ch, pace)?;
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
            while open && in_flight[i].len() < w.qd.max(1) && ch.credit() > 0 {
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
                let cmd = Command {
                    tag,
                    lun: lun_field,
                    cdb: &cdb,
                    data_out: io.data.as_deref(),
                    data_in: if io.data.is_some() { 0 } else { len },
                    regions: o.regions,
                    partial: false,
                    attribute: TaskAttribute::Simple,
                };
                // The command's time starts before the initiator registers its buffer.
                let start = pace.now();
                ch.send(Instant::now(), verbs, &cmd)
                    .map_err(|e| format!("a command was refused: {e}"))?;
                in_flight[i].insert(tag, (io, start));
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
            let lost = ch.handle_timeout(Instant::now(), verbs);
            if !lost.is_empty() {
                return Err(format!(
                    "no answer from the target for {STALL:?}: {} commands in flight",
                    lost.len()
                ));
            }
            if ch.is_gone(verbs) {
                return Err(format!(
                    "the channel ended ({:?}) with {} commands in flight",
                    ch.logged_out(),
                    in_flight[i].len()
                ));
            }
        }
        if in_flight.iter().all(HashMap::is_empty) && !open {
            if measured.is_none() {
                let elapsed = t0.elapsed().as_secs_f64();
                let cpu = cpu_seconds() - cpu0;
                let (clock, registrations) = pace.end(elapsed, tally.ios, o);
                measured = Some((elapsed, cpu, clock, registrations));
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
    let (elapsed, cpu, clock, registrations) = measured.expect("the measured part ended");
    Ok(report(w, o, tally, clock, registrations, elapsed, cpu))
}

/// Waits for the next answer on `ch`.
fn wait_answer<V>(
    verbs: &mut V,
    ch: &mut InitiatorChannel<V>,
    pace: &mut dyn Pace,
) -> Result<Answer, String>
where
    V: Verbs + PeerMemory + IuBuffers<Iu = <V as Verbs>::Buffer>,
{
    loop {
        if let Some(a) = ch.poll(verbs) {
            return Ok(a);
        }
        if !ch.handle_timeout(Instant::now(), verbs).is_empty() {
            return Err(format!("no answer from the target for {STALL:?}"));
        }
        if ch.is_gone(verbs) {
            return Err(format!("the channel ended ({:?})", ch.logged_out()));
        }
        pace.turn(false)?;
    }
}

/// Runs `w` against the SRP target `url` on this machine's RDMA device (feature `rdma`).
#[cfg(feature = "rdma")]
pub fn run_rdma(url: &SrpUrl, w: &Workload, o: &SrpOptions) -> Result<SrpReport, String> {
    use srp::rdma::{QueueDepth, RdmaVerbs};
    let sessions = w.sessions.max(1);
    let slots = (sessions * (w.qd.max(1) + 2 * 140)) as u32;
    let mut verbs: RdmaVerbs =
        RdmaVerbs::open(None, slots, srp::verbs::IU_BUFFER_LEN).map_err(|e| e.to_string())?;
    let place = place_len(w, o);
    let mut channels = Vec::new();
    for s in 0..sessions {
        let mut private = Vec::new();
        login_request(s, url.target_port_id, srp::verbs::IU_BUFFER_LEN as u32)
            .encode_rdma_cm(&mut private);
        let depth = QueueDepth {
            send: 4096,
            recv: 256,
        };
        let (qp, reply) = verbs
            .connect(url.addr, depth, &private)
            .map_err(|e| format!("login to {}: {e}", url.addr))?;
        let rsp = match srp::Iu::decode(&reply) {
            Ok(srp::Iu::LoginRsp(r)) => r,
            other => return Err(format!("login answered with {other:?}")),
        };
        let places = w.qd.max(1).min(rsp.req_lim_delta as usize);
        let ch = InitiatorChannel::new(&mut verbs, qp, &rsp, o.registration, places, place)
            .map_err(|e| e.to_string())?;
        channels.push(ch);
    }
    run_channels(&mut verbs, &mut channels, url.lun, w, o)
}

/// Bytes of each buffer place of an initiator's data memory for `w`: its regions apart
/// (twice its bytes) and its descriptor table.
pub fn place_len(w: &Workload, o: &SrpOptions) -> usize {
    2 * w.bs as usize + o.regions * DESCRIPTOR_LEN + 4096
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
pub fn print(r: &SrpReport) {
    let w = &r.workload;
    let o = &r.options;
    let over = if r.fabric_seconds > 0.0 || r.iops == 0.0 {
        format!("the software fabric ({:?} link)", o.link)
    } else {
        "RDMA verbs".to_string()
    };
    println!(
        "SRP over {over}, registration {}, {} region(s) per command",
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn srp_urls_name_the_target_by_identifier_or_by_name() {
        let u = SrpUrl::parse("srp://192.0.2.7:5555/0011223344556677a8b9cadbecfd0e1f/3")
            .expect("parses");
        assert_eq!(u.addr, "192.0.2.7:5555".parse().expect("address"));
        assert_eq!(u.target_port_id[0], 0x00);
        assert_eq!(u.target_port_id[15], 0x1f);
        assert_eq!(u.lun, 3);
        let named =
            SrpUrl::parse("srp://[::1]:5555/iqn.2026-11.io.example:disk1/0").expect("parses");
        assert_eq!(
            named.target_port_id,
            srp::target_port::port_id_for("iqn.2026-11.io.example:disk1")
        );
        for bad in [
            "iscsi://h/t/0",
            "srp://nowhere/t/0",
            "srp://192.0.2.7:5555/t",
            "srp://192.0.2.7:5555/t/lun",
        ] {
            assert!(SrpUrl::parse(bad).is_err(), "{bad}");
        }
    }
}
