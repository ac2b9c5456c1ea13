//! Workloads over SRP: `initiator-bench run --transport srp fabric`.
//!
//! The initiator is the SRP rig's ([`srp::testing::Rig`]): its commands' buffers lie in an
//! [`srp::initiator::DataMemory`], registered per command, through a cache or as one pool
//! (paper 004's three ways), cut into `regions` discrete regions each; the target is the real
//! SRP channel on scsi-core, in the same process, with a memory logical unit, over the software
//! fabric. The fabric charges its costs to a virtual clock (with `--link paper004`, the
//! paper's measured costs of registration and of the wire), so throughput and latency are
//! reported on that clock, deterministic whatever this machine is doing; the wall-clock and
//! CPU time this process spent are reported beside them, as the software's own cost.
//!
//! The fabric serialises everything it charges (one link, no overlap), so on its clock queue
//! depth adds no parallelism: it shows what a command costs, as the paper's figures do.

use std::time::{Duration, Instant};

use hdrhistogram::Histogram;
use serde::Serialize;
use srp::initiator::Registration;
use srp::iu::{MultiChannelAction, DESCRIPTOR_LEN};
use srp::testing::{BlockIo, Rig, ARENA_SLOT, PAPER_004_COSTS};

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

/// Runs `w` over SRP on the software fabric against an in-process target with one memory
/// logical unit of `w.offset + w.size` bytes (64 MiB of range by default).
pub fn run_fabric(w: &Workload, o: &SrpOptions) -> Result<SrpReport, String> {
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
    let per_io = u64::from(w.bs) / bs;
    let slots = size / u64::from(w.bs);
    if slots == 0 {
        return Err(format!("--size {size} holds no I/O of {} bytes", w.bs));
    }
    let first = w.offset / bs;
    let mut rig = Rig::new(&[(0, BLOCK_SIZE, first + slots * per_io)]);
    rig.registration = o.registration;
    // A place holds the command's regions apart (twice its bytes) and its table.
    rig.place_len = ARENA_SLOT.max(2 * w.bs as usize + o.regions * DESCRIPTOR_LEN);
    let mut chs = Vec::new();
    for s in 0..w.sessions.max(1) {
        let mut port = *b"initiator-bench\0";
        port[15] = s as u8;
        let (ch, _) = rig
            .login(&Rig::login_request(port, MultiChannelAction::SingleChannel))
            .map_err(|rej| format!("login refused: {:?}", rej.reason))?;
        chs.push(ch);
    }
    // Each nexus's first command hears of the power on: a TEST UNIT READY takes it.
    for &ch in &chs {
        rig.send(
            ch,
            &srp::testing::Cmd {
                tag: 1,
                cdb: vec![0; 6],
                ..Default::default()
            },
        )
        .map_err(|e| format!("TEST UNIT READY: {e:?}"))?;
    }
    rig.run();
    if o.link == LinkModel::Paper004 {
        rig.fabric.costs = PAPER_004_COSTS;
    }

    let mut rng = XorShift(w.seed | 1);
    let mut cursor = 0u64;
    let read_percent = u64::from(w.rw.read_percent(w.rwmix));
    // Slots a write of this run has finished, as Cells: the source of I/Os reads them (a read
    // is checked if its slot was written before it was sent) and completions set them.
    let written = vec![std::cell::Cell::new(false); slots as usize];
    let limit = w.ios;
    let deadline = Instant::now() + w.time;
    let mut issued = 0u64;
    let mut next = |_: usize| -> Option<BlockIo> {
        if limit.map_or(Instant::now() >= deadline, |n| issued >= n) {
            return None;
        }
        issued += 1;
        let slot = if w.rw.random() {
            rng.next() % slots
        } else {
            cursor += 1;
            (cursor - 1) % slots
        };
        let lba = first + slot * per_io;
        let read = rng.next() % 100 < read_percent;
        let data = (!read).then(|| pattern(lba, per_io, w));
        Some(BlockIo {
            lba,
            blocks: per_io as u32,
            data,
            cookie: u64::from(read && w.verify && written[slot as usize].get()),
        })
    };
    let mut hist = Histogram::<u64>::new(3).expect("3 significant digits");
    let (mut ios, mut errors, mut verified, mut verify_errors) = (0u64, 0u64, 0u64, 0u64);
    let mut done = |_: usize, io: BlockIo, r: srp::testing::Response, latency: Duration| {
        ios += 1;
        let _ = hist.record(latency.as_nanos() as u64);
        if r.status != 0 {
            errors += 1;
        } else if io.data.is_some() {
            written[((io.lba - first) / per_io) as usize].set(true);
        } else if io.cookie == 1 {
            let (v, e) = check(&r.data, io.lba, w);
            verified += v;
            verify_errors += e;
        }
    };
    let before = rig.fabric.counters;
    let clock = rig.fabric.elapsed;
    let cpu0 = cpu_seconds();
    let t0 = Instant::now();
    let run = rig.closed_loop(
        &chs,
        w.qd.max(1),
        BLOCK_SIZE,
        o.regions,
        &mut next,
        &mut done,
    );
    let elapsed = t0.elapsed().as_secs_f64();
    let cpu = cpu_seconds() - cpu0;
    let fabric = (rig.fabric.elapsed - clock).as_secs_f64();
    let after = rig.fabric.counters;
    run.map_err(|e| format!("a command was refused: {e:?}"))?;
    // After a run that wrote, read back every block written.
    if w.verify {
        let mut slot = 0usize;
        let mut source = |_: usize| {
            let at = written[slot..].iter().position(|b| b.get())? + slot;
            slot = at + 1;
            Some(BlockIo {
                lba: first + at as u64 * per_io,
                blocks: per_io as u32,
                data: None,
                cookie: 1,
            })
        };
        let back = rig.closed_loop(
            &chs,
            w.qd.max(1),
            BLOCK_SIZE,
            o.regions,
            &mut source,
            |_, io, r, _| {
                if r.status != 0 {
                    verify_errors += per_io;
                    return;
                }
                let (v, e) = check(&r.data, io.lba, w);
                verified += v;
                verify_errors += e;
            },
        );
        back.map_err(|e| format!("a read-back command was refused: {e:?}"))?;
    }
    let per_sec = |n: f64| if fabric > 0.0 { n / fabric } else { 0.0 };
    Ok(SrpReport {
        workload: w.clone(),
        options: *o,
        ios,
        errors,
        fabric_seconds: fabric,
        iops: per_sec(ios as f64),
        bytes_per_sec: per_sec((ios * u64::from(w.bs)) as f64),
        latency_us: Latency::of(&hist),
        initiator_registrations_per_io: (after.registrations[1] - before.registrations[1]) as f64
            / ios.max(1) as f64,
        target_registrations: after.registrations[0] - before.registrations[0],
        elapsed_seconds: elapsed,
        cpu_seconds: cpu,
        verified_blocks: verified,
        verify_errors,
    })
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
    println!(
        "SRP over the software fabric ({:?} link), registration {}, {} region(s) per command",
        o.link,
        o.registration.name(),
        o.regions
    );
    println!(
        "{:?} bs={} qd={} sessions={}: {} I/Os, {} errors",
        w.rw, w.bs, w.qd, w.sessions, r.ios, r.errors
    );
    if r.fabric_seconds > 0.0 {
        let l = &r.latency_us;
        println!(
            "  fabric clock: {:.4}s, IOPS {:.0}, throughput {:.1} MB/s",
            r.fabric_seconds,
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
