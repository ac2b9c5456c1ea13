//! Workloads: what `initiator-bench run` does, and its report.
//!
//! Each of `qd` workers per session keeps one command outstanding. Latency goes into a per-worker
//! HdrHistogram (nanoseconds, 3 significant digits), merged at the end.
//!
//! `--verify` writes every block with a pattern that depends only on its LBA and the seed (the
//! LBA leads the block), so a block's content is the same whichever write reached it last, and
//! reads check the blocks this run had finished writing when the read was issued (or every
//! block, for a read-only run over data an earlier run wrote with the same seed). After a run
//! that wrote, a verify pass reads back every block written.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use hdrhistogram::Histogram;
use serde::Serialize;

use crate::error::{Error, Result};
use crate::login::LoginOptions;
use crate::multipath::{Failovers, Multipath};
use crate::nvme::{NvmeController, NvmeOptions, NvmeUrl};
use crate::session::Session;
use crate::url::IscsiUrl;

/// The I/O pattern.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum Rw {
    /// Sequential reads.
    Read,
    /// Sequential writes.
    Write,
    /// Random reads.
    Randread,
    /// Random writes.
    Randwrite,
    /// Sequential, mixed (`rwmix` percent reads).
    Rw,
    /// Random, mixed.
    Randrw,
}

impl Rw {
    pub(crate) fn random(self) -> bool {
        matches!(self, Rw::Randread | Rw::Randwrite | Rw::Randrw)
    }

    pub(crate) fn read_percent(self, rwmix: u8) -> u8 {
        match self {
            Rw::Read | Rw::Randread => 100,
            Rw::Write | Rw::Randwrite => 0,
            Rw::Rw | Rw::Randrw => rwmix.min(100),
        }
    }
}

/// One workload.
#[derive(Debug, Clone, Serialize)]
pub struct Workload {
    /// Pattern.
    pub rw: Rw,
    /// Block size of each I/O, bytes (a multiple of the LU's block size).
    pub bs: u32,
    /// Commands outstanding per session.
    pub qd: usize,
    /// Sessions (each its own login).
    pub sessions: usize,
    /// Run time, unless `ios` is given.
    #[serde(serialize_with = "seconds")]
    pub time: Duration,
    /// Total I/Os instead of a time.
    pub ios: Option<u64>,
    /// Percent reads for mixed patterns.
    pub rwmix: u8,
    /// Start of the range, bytes.
    pub offset: u64,
    /// Length of the range, bytes (the rest of the LU when absent).
    pub size: Option<u64>,
    /// Check data integrity.
    pub verify: bool,
    /// Seed for random offsets and the verify pattern.
    pub seed: u64,
    /// How each I/O goes out as SCSI commands.
    pub split: Split,
    /// Record each command's stages (submitted, waiting for the CmdSN window, sent, first
    /// data, status, completed) into [`Report::trace`]; iSCSI sessions and NVMe/TCP
    /// controllers.
    pub trace: bool,
    /// Stop the run once more I/Os than this have failed (none: run on whatever fails).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_errors: Option<u64>,
}

/// Parses a size: `512`, `4k` or `4KiB` (powers of 1024), `10GB` (powers of 1000), `1.5GiB`;
/// the grammar of targetd's config and targetctl ([`units::parse_size`]).
pub fn parse_size(s: &str) -> Result<u64, String> {
    units::parse_size(s)
}

/// How an I/O goes out as commands: whole, or cut into commands of a most some size that are
/// in flight together, as a block layer cuts a request it may not send whole.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub enum Split {
    /// One command per I/O.
    None,
    /// Commands of at most this many bytes (a multiple of the LU's block size).
    Bytes(u32),
    /// As Linux's sd driver sizes requests from the LU's Block Limits page
    /// ([`BlockLimits::linux_max_blocks`](crate::scsi::BlockLimits::linux_max_blocks)).
    Linux,
}

impl std::str::FromStr for Split {
    type Err = String;

    fn from_str(s: &str) -> std::result::Result<Split, String> {
        match s {
            "none" => Ok(Split::None),
            "linux" => Ok(Split::Linux),
            size => parse_size(size)
                .ok()
                .and_then(|b| u32::try_from(b).ok())
                .filter(|&b| b > 0)
                .map(Split::Bytes)
                .ok_or_else(|| format!("{s:?}: expected none, linux or a size such as 128k")),
        }
    }
}

fn seconds<S: serde::Serializer>(d: &Duration, s: S) -> std::result::Result<S::Ok, S::Error> {
    s.serialize_f64(d.as_secs_f64())
}

impl Default for Workload {
    fn default() -> Self {
        Workload {
            rw: Rw::Randread,
            bs: 4096,
            qd: 32,
            sessions: 1,
            time: Duration::from_secs(10),
            ios: None,
            rwmix: 50,
            offset: 0,
            size: None,
            verify: false,
            seed: 1,
            split: Split::None,
            trace: false,
            max_errors: None,
        }
    }
}

/// Latency percentiles, microseconds.
#[derive(Debug, Clone, Copy, Serialize, Default)]
pub struct Latency {
    /// Median.
    pub p50: f64,
    /// 90th percentile.
    pub p90: f64,
    /// 99th percentile.
    pub p99: f64,
    /// 99.9th percentile.
    pub p999: f64,
    /// Maximum.
    pub max: f64,
    /// Mean.
    pub mean: f64,
}

impl Latency {
    /// The percentiles of a histogram of nanoseconds.
    pub fn of(hist: &Histogram<u64>) -> Latency {
        let us = |v: u64| v as f64 / 1000.0;
        Latency {
            p50: us(hist.value_at_quantile(0.5)),
            p90: us(hist.value_at_quantile(0.9)),
            p99: us(hist.value_at_quantile(0.99)),
            p999: us(hist.value_at_quantile(0.999)),
            max: us(hist.max()),
            mean: hist.mean() / 1000.0,
        }
    }
}

/// What a run measured.
#[derive(Debug, Clone, Serialize)]
pub struct Report {
    /// The workload.
    pub workload: Workload,
    /// Completed I/Os per second.
    pub iops: f64,
    /// Payload bytes per second.
    pub bytes_per_sec: f64,
    /// Latency of completed I/Os.
    pub latency_us: Latency,
    /// CPU time of this process (user + system) during the run.
    pub cpu_seconds: f64,
    /// Completed I/Os.
    pub ios: u64,
    /// Failed I/Os.
    pub errors: u64,
    /// Failed I/Os by what they failed with (the error's text: the sense for a CHECK
    /// CONDITION), most frequent first. The first [`LOGGED_FAILURES`] are also logged one by
    /// one.
    pub failures: Vec<(String, u64)>,
    /// Wall-clock run time.
    pub elapsed_seconds: f64,
    /// Blocks whose content was checked, and how many were wrong.
    pub verified_blocks: u64,
    /// Blocks that did not hold the expected pattern.
    pub verify_errors: u64,
    /// Completed I/Os of each session, for fairness.
    pub per_session_ios: Vec<u64>,
    /// The largest SCSI command an I/O went out as, bytes (the I/O size unless split).
    pub command_bytes: u64,
    /// Commands sent again because the target answered BUSY or TASK SET FULL.
    pub resent: u64,
    /// Each command's stages, with [`Workload::trace`].
    #[serde(skip)]
    pub trace: Vec<cmdtrace::Record>,
    /// Trace records that found a session's trace full.
    #[serde(skip)]
    pub trace_dropped: u64,
    /// Times I/O moved to another path after a failure (multipath runs).
    pub failovers: u64,
    /// Of those, the moves because the path's target asked to log out (a gateway stopping).
    pub failovers_at_logout_request: u64,
    /// The longest time from a path's failure to the first success on another path. Not the
    /// stall the application saw: a write sent on the new path may wait much longer for it to
    /// take the unit over (`latency_us.max`, which the text report prints beside it).
    pub longest_failover_seconds: Option<f64>,
}

impl Report {
    /// Jain's fairness index of per-session throughput: 1 when all sessions got the same.
    pub fn fairness(&self) -> f64 {
        jain(
            &self
                .per_session_ios
                .iter()
                .map(|&x| x as f64)
                .collect::<Vec<_>>(),
        )
    }
}

/// Jain's fairness index: (sum x)^2 / (n * sum x^2).
pub fn jain(xs: &[f64]) -> f64 {
    let sum: f64 = xs.iter().sum();
    let sq: f64 = xs.iter().map(|x| x * x).sum();
    if xs.is_empty() || sq == 0.0 {
        1.0
    } else {
        sum * sum / (xs.len() as f64 * sq)
    }
}

/// Live counters, for a progress line.
#[derive(Debug, Default)]
pub struct Progress {
    /// I/Os completed so far.
    pub ios: AtomicU64,
    /// Bytes moved so far.
    pub bytes: AtomicU64,
}

/// CPU time of this process so far (user + system), from /proc/self/stat.
pub fn cpu_seconds() -> f64 {
    let Ok(stat) = std::fs::read_to_string("/proc/self/stat") else {
        return 0.0;
    };
    // Fields after the parenthesised command name; utime and stime are the 12th and 13th.
    let Some(rest) = stat.rsplit_once(')').map(|(_, r)| r) else {
        return 0.0;
    };
    let f: Vec<&str> = rest.split_whitespace().collect();
    let ticks = |i: usize| f.get(i).and_then(|v| v.parse::<f64>().ok()).unwrap_or(0.0);
    // USER_HZ is 100 on Linux.
    (ticks(11) + ticks(12)) / 100.0
}

/// The verify pattern of one block: its LBA, the seed, then a xorshift stream of both.
pub fn fill_pattern(block: &mut [u8], lba: u64, seed: u64) {
    let mut x = lba.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ seed ^ 0x2545_f491_4f6c_dd1d;
    for (i, chunk) in block.chunks_mut(8).enumerate() {
        let v = match i {
            0 => lba,
            1 => seed,
            _ => {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                x
            }
        };
        chunk.copy_from_slice(&v.to_be_bytes()[..chunk.len()]);
    }
}

/// A small deterministic generator for offsets.
#[derive(Debug, Clone)]
pub(crate) struct XorShift(pub(crate) u64);

impl XorShift {
    pub(crate) fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
}

/// Blocks this run has finished writing (one bit each), for `--verify`.
#[derive(Debug)]
struct Written(Mutex<Vec<u64>>);

impl Written {
    fn new(blocks: u64) -> Self {
        Written(Mutex::new(vec![0; blocks.div_ceil(64) as usize]))
    }
    fn set(&self, from: u64, n: u64) {
        let mut b = self.0.lock().expect("bitmap");
        for i in from..from + n {
            b[(i / 64) as usize] |= 1 << (i % 64);
        }
    }
    fn get(&self, i: u64) -> bool {
        self.0.lock().expect("bitmap")[(i / 64) as usize] & (1 << (i % 64)) != 0
    }
}

/// Runs `w` against the LU of `url`.
pub async fn run(
    url: &IscsiUrl,
    opts: &LoginOptions,
    w: &Workload,
    progress: Arc<Progress>,
) -> Result<Report> {
    run_many(std::slice::from_ref(url), opts, w, progress).await
}

/// NOP-Outs a traced run sends at its start and at its end, per session.
const CLOCK_PINGS: usize = 8;

/// Runs `w` with its sessions spread round-robin over the LUs of `urls` (one session per URL
/// when `w.sessions` equals their number). The range is taken from the first LU's capacity.
pub async fn run_many(
    urls: &[IscsiUrl],
    opts: &LoginOptions,
    w: &Workload,
    progress: Arc<Progress>,
) -> Result<Report> {
    if urls.is_empty() {
        return Err(Error::Command("no target URL".into()));
    }
    let mut sessions = Vec::new();
    for i in 0..w.sessions.max(1) {
        sessions.push(Arc::new(
            Session::connect(&urls[i % urls.len()], opts.clone()).await?,
        ));
    }
    let ios = sessions.iter().cloned().map(Io::One).collect();
    run_on(sessions, ios, None, w, progress).await
}

/// Runs `w` on one logical unit through every URL as a path ([`Multipath`]): a session per
/// path, the I/O on the path ALUA prefers, failed commands sent again on another path. The
/// report counts the failovers and the longest time I/O waited for one.
pub async fn run_multipath(
    urls: &[IscsiUrl],
    opts: &LoginOptions,
    w: &Workload,
    progress: Arc<Progress>,
) -> Result<Report> {
    let m = Arc::new(Multipath::connect(urls, opts).await?);
    let sessions = m.sessions().cloned().collect();
    run_on(sessions, vec![Io::Paths(m.clone())], Some(m), w, progress).await
}

/// Runs `w` on one NVMe namespace through every URL as a path ([`Multipath`]): a controller
/// per path, the I/O on the path whose ANA state is optimized, failed commands sent again on
/// another path. The report counts the failovers and the longest time I/O waited for one.
pub async fn run_nvme_multipath(
    urls: &[NvmeUrl],
    opts: &NvmeOptions,
    w: &Workload,
    progress: Arc<Progress>,
) -> Result<Report> {
    let m = Arc::new(Multipath::connect_nvme(urls, opts).await?);
    run_on(
        Vec::new(),
        vec![Io::NvmePaths(m.clone())],
        Some(m),
        w,
        progress,
    )
    .await
}

/// Runs `w` against the NVMe/TCP namespaces of `urls`: `w.sessions` controllers (each its
/// admin queue and one I/O queue), spread round-robin over the URLs.
pub async fn run_nvme(
    urls: &[NvmeUrl],
    opts: &NvmeOptions,
    w: &Workload,
    progress: Arc<Progress>,
) -> Result<Report> {
    if urls.is_empty() {
        return Err(Error::Command("no NVMe/TCP URL".into()));
    }
    let mut ends = Vec::new();
    for i in 0..w.sessions.max(1) {
        let c = NvmeController::connect(&urls[i % urls.len()], opts).await?;
        ends.push(Io::Nvme(Arc::new(c)));
    }
    run_on(Vec::new(), ends, None, w, progress).await
}

/// Where a worker sends its I/O: one session, one logical unit through several paths, or an
/// NVMe/TCP controller's namespace.
#[derive(Debug, Clone)]
enum Io {
    One(Arc<Session>),
    Paths(Arc<Multipath>),
    Nvme(Arc<NvmeController>),
    NvmePaths(Arc<Multipath<NvmeController>>),
}

impl Io {
    /// The NVMe/TCP controller, if that is where commands go.
    fn nvme(&self) -> Option<&Arc<NvmeController>> {
        match self {
            Io::Nvme(c) => Some(c),
            Io::NvmePaths(m) => Some(m.controller()),
            _ => None,
        }
    }

    /// The session commands go to now (none for NVMe/TCP).
    fn session(&self) -> Option<&Arc<Session>> {
        match self {
            Io::One(s) => Some(s),
            Io::Paths(m) => Some(m.session()),
            Io::Nvme(_) | Io::NvmePaths(_) => None,
        }
    }

    /// Where the commands go, for a failure's message.
    fn portal(&self) -> String {
        match self {
            Io::Nvme(_) | Io::NvmePaths(_) => self.nvme().expect("a controller").portal.clone(),
            other => other
                .session()
                .map(|s| s.url().portal.clone())
                .unwrap_or_default(),
        }
    }

    /// The unit's size in blocks and its block size.
    async fn capacity(&self) -> Result<(u64, u32)> {
        match self {
            Io::Nvme(_) | Io::NvmePaths(_) => {
                let c = self.nvme().expect("a controller");
                Ok((c.namespace.blocks, c.namespace.block_size))
            }
            other => other.session().expect("a session").capacity().await,
        }
    }

    /// The most blocks Linux would put in one command to this unit.
    async fn linux_max_blocks(&self, block_size: u32) -> Result<u32> {
        match self {
            Io::Nvme(_) | Io::NvmePaths(_) => {
                Ok(self.nvme().expect("a controller").max_transfer / block_size)
            }
            other => {
                let limits = other.session().expect("a session").block_limits().await?;
                Ok(limits.linux_max_blocks(block_size))
            }
        }
    }

    async fn read_split(&self, lba: u64, blocks: u32, bs: u32, max: u32) -> Result<Bytes> {
        match self {
            Io::One(s) => s.read_split(lba, blocks, bs, max).await,
            Io::Paths(m) => m.read_split(lba, blocks, bs, max).await,
            Io::Nvme(c) => Ok(c.read_split(lba, blocks, max).await?),
            Io::NvmePaths(m) => m.read_split(lba, blocks, max).await,
        }
    }

    async fn write_split(&self, lba: u64, data: Bytes, bs: u32, max: u32) -> Result<()> {
        match self {
            Io::One(s) => s.write_split(lba, data, bs, max).await,
            Io::Paths(m) => m.write_split(lba, data, bs, max).await,
            Io::Nvme(c) => Ok(c.write_split(lba, data, max).await?),
            Io::NvmePaths(m) => m.write_split(lba, data, max).await,
        }
    }

    async fn read(&self, lba: u64, blocks: u32, bs: u32) -> Result<Bytes> {
        match self {
            Io::One(s) => s.read(lba, blocks, bs).await,
            Io::Paths(m) => m.read(lba, blocks, bs).await,
            Io::Nvme(_) | Io::NvmePaths(_) => {
                let max = (self.nvme().expect("a controller").max_transfer / bs).max(1);
                self.read_split(lba, blocks, bs, max).await
            }
        }
    }
}

/// Runs `w` with `w.qd` workers per entry of `ends`; `sessions` are every session involved
/// (for tracing, resends and logout).
async fn run_on(
    sessions: Vec<Arc<Session>>,
    ends: Vec<Io>,
    multipath: Option<Arc<dyn Failovers>>,
    w: &Workload,
    progress: Arc<Progress>,
) -> Result<Report> {
    let (lu_blocks, block_size) = ends[0].capacity().await?;
    if w.bs == 0 || w.bs % block_size != 0 {
        return Err(Error::Command(format!(
            "--bs {} is not a multiple of the LU's {block_size}-byte blocks",
            w.bs
        )));
    }
    let lu_bytes = lu_blocks * u64::from(block_size);
    let start = w.offset / u64::from(block_size);
    let len = w
        .size
        .unwrap_or(lu_bytes.saturating_sub(w.offset))
        .min(lu_bytes.saturating_sub(w.offset));
    let io_blocks = u64::from(w.bs / block_size);
    let command_blocks = match w.split {
        Split::None => io_blocks,
        Split::Bytes(b) if b % block_size == 0 => u64::from(b / block_size),
        Split::Bytes(b) => {
            return Err(Error::Command(format!(
                "--split {b} is not a multiple of the LU's {block_size}-byte blocks"
            )))
        }
        Split::Linux => u64::from(ends[0].linux_max_blocks(block_size).await?),
    }
    .clamp(1, io_blocks.max(1));
    let slots = len / u64::from(w.bs);
    if slots == 0 {
        return Err(Error::Command(format!(
            "the range holds no {}-byte I/O",
            w.bs
        )));
    }
    let shared = Arc::new(Shared {
        w: w.clone(),
        block_size,
        start,
        io_blocks,
        command_blocks: command_blocks as u32,
        slots,
        stop: AtomicBool::new(false),
        issued: AtomicU64::new(0),
        // Each session streams its own sequence, from its own part of the range.
        cursors: (0..ends.len() as u64)
            .map(|i| AtomicU64::new(i * slots / ends.len() as u64))
            .collect(),
        errors: AtomicU64::new(0),
        failures: Mutex::default(),
        verified: AtomicU64::new(0),
        verify_errors: AtomicU64::new(0),
        written: w.verify.then(|| Written::new(slots * io_blocks)),
        progress,
    });
    if w.trace {
        for s in &sessions {
            s.start_trace();
            // NOP round trips date the two clocks against each other (the report's offset).
            for _ in 0..CLOCK_PINGS {
                s.nop().await?;
            }
        }
        for c in ends.iter().filter_map(Io::nvme) {
            c.start_trace();
            // Keep Alives are NVMe's NOPs.
            for _ in 0..CLOCK_PINGS {
                c.ping().await?;
            }
        }
    }
    let cpu0 = cpu_seconds();
    let t0 = Instant::now();
    let mut workers = Vec::new();
    for (si, s) in ends.iter().enumerate() {
        for q in 0..w.qd.max(1) {
            let seed =
                w.seed ^ ((si as u64) << 32 | q as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
            workers.push((
                si,
                tokio::spawn(worker(shared.clone(), si, s.clone(), XorShift(seed))),
            ));
        }
    }
    if w.ios.is_none() {
        let stopper = shared.clone();
        let time = w.time;
        tokio::spawn(async move {
            tokio::time::sleep(time).await;
            stopper.stop.store(true, Ordering::Release);
        });
    }
    let mut hist = Histogram::<u64>::new(3).expect("3 significant digits");
    let mut per_session = vec![0u64; ends.len()];
    let mut ios = 0u64;
    for (si, h) in workers {
        let (n, wh) = h
            .await
            .map_err(|e| Error::Command(format!("worker failed: {e}")))?;
        hist.add(&wh).expect("same precision");
        per_session[si] += n;
        ios += n;
    }
    let elapsed = t0.elapsed().as_secs_f64();
    let cpu = cpu_seconds() - cpu0;
    let mut trace = Vec::new();
    let mut trace_dropped = 0;
    if w.trace {
        for s in &sessions {
            for _ in 0..CLOCK_PINGS {
                s.nop().await?;
            }
            let (mut records, dropped) = s.take_trace();
            trace.append(&mut records);
            trace_dropped += dropped;
        }
        for c in ends.iter().filter_map(Io::nvme) {
            for _ in 0..CLOCK_PINGS {
                c.ping().await?;
            }
            let (mut records, dropped) = c.take_trace();
            trace.append(&mut records);
            trace_dropped += dropped;
        }
        trace.sort_by_key(|r| r.at_ns);
    }
    if w.verify && w.rw.read_percent(w.rwmix) < 100 {
        verify_pass(&shared, &ends[0]).await?;
    }
    for s in &sessions {
        let _ = s.logout().await;
    }
    Ok(Report {
        workload: w.clone(),
        iops: ios as f64 / elapsed,
        bytes_per_sec: (ios * u64::from(w.bs)) as f64 / elapsed,
        latency_us: Latency::of(&hist),
        cpu_seconds: cpu,
        ios,
        errors: shared.errors.load(Ordering::Relaxed),
        failures: shared.failures(),
        elapsed_seconds: elapsed,
        verified_blocks: shared.verified.load(Ordering::Relaxed),
        verify_errors: shared.verify_errors.load(Ordering::Relaxed),
        per_session_ios: per_session,
        command_bytes: command_blocks * u64::from(block_size),
        resent: sessions.iter().map(|s| s.resent()).sum(),
        trace,
        trace_dropped,
        failovers: multipath.as_ref().map_or(0, |m| m.failovers()),
        failovers_at_logout_request: multipath
            .as_ref()
            .map_or(0, |m| m.failovers_at_logout_request()),
        longest_failover_seconds: multipath
            .and_then(|m| m.longest_failover())
            .map(|d| d.as_secs_f64()),
    })
}

#[derive(Debug)]
struct Shared {
    w: Workload,
    block_size: u32,
    /// First LBA of the range.
    start: u64,
    io_blocks: u64,
    /// The most blocks of one command.
    command_blocks: u32,
    /// I/O-sized slots in the range.
    slots: u64,
    stop: AtomicBool,
    issued: AtomicU64,
    /// The next sequential slot of each session.
    cursors: Vec<AtomicU64>,
    errors: AtomicU64,
    /// Failed I/Os by the error's text.
    failures: Mutex<std::collections::BTreeMap<String, u64>>,
    verified: AtomicU64,
    verify_errors: AtomicU64,
    written: Option<Written>,
    progress: Arc<Progress>,
}

/// How many failed I/Os are logged one by one; the rest are counted by kind in
/// [`Report::failures`] (a removed LUN fails every I/O: a line each flooded the log).
pub const LOGGED_FAILURES: u64 = 10;

/// The pause before the first retry of a path whose connection or login failed; it doubles
/// with each further failure, up to [`MAX_BACKOFF`], and starts again after a success.
pub const FIRST_BACKOFF: Duration = Duration::from_millis(100);

/// The longest pause between logins to a target that keeps failing them.
pub const MAX_BACKOFF: Duration = Duration::from_secs(5);

impl Shared {
    /// Counts a failed I/O at `lba`: logged while few have failed, counted by kind always, and
    /// the run stopped once more than `max_errors` have.
    fn failed(&self, lba: u64, portal: &str, e: &Error) {
        let n = self.errors.fetch_add(1, Ordering::Relaxed) + 1;
        let what = e.to_string();
        if n <= LOGGED_FAILURES {
            tracing::warn!("I/O at LBA {lba} on {portal} failed: {what}");
        }
        if n == LOGGED_FAILURES + 1 {
            tracing::warn!(
                "more I/Os failed: counted by kind in the report, not logged one by one"
            );
        }
        *self
            .failures
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .entry(what)
            .or_default() += 1;
        if self.w.max_errors.is_some_and(|max| n > max) {
            self.stop.store(true, Ordering::Release);
        }
    }

    /// The failures by kind, most frequent first.
    fn failures(&self) -> Vec<(String, u64)> {
        let mut all: Vec<(String, u64)> = self
            .failures
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .iter()
            .map(|(k, &v)| (k.clone(), v))
            .collect();
        all.sort_by(|a, b| b.1.cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
        all
    }

    /// Claims the next I/O, or `None` when the run is over.
    fn claim(&self) -> Option<()> {
        if self.stop.load(Ordering::Acquire) {
            return None;
        }
        match self.w.ios {
            Some(n) => (self.issued.fetch_add(1, Ordering::AcqRel) < n).then_some(()),
            None => Some(()),
        }
    }

    fn block_data(&self, lba: u64) -> Bytes {
        let bs = self.block_size as usize;
        let mut buf = vec![0u8; self.w.bs as usize];
        if self.w.verify {
            for (i, block) in buf.chunks_mut(bs).enumerate() {
                fill_pattern(block, lba + i as u64, self.w.seed);
            }
        } else {
            // Not all zeros, so thin targets store it, and cheap to make.
            for (i, b) in buf.iter_mut().enumerate().step_by(512) {
                *b = (lba as usize + i) as u8 | 1;
            }
        }
        Bytes::from(buf)
    }

    /// Checks read data against the pattern, block by block: every block with `all`, otherwise
    /// those marked written now (right only when no write is in flight, as in the verify pass).
    fn check(&self, lba: u64, data: &[u8], all: bool) {
        let bs = self.block_size as usize;
        let mut expect = vec![0u8; bs];
        for (i, block) in data.chunks(bs).enumerate() {
            let b = lba + i as u64;
            let written = self.written.as_ref().is_some_and(|w| w.get(b - self.start));
            if !(all || written) {
                continue;
            }
            fill_pattern(&mut expect, b, self.w.seed);
            self.verified.fetch_add(1, Ordering::Relaxed);
            if block != &expect[..] {
                self.verify_errors.fetch_add(1, Ordering::Relaxed);
                tracing::error!("block {b}: data does not match the pattern written for it");
            }
        }
    }
}

async fn worker(
    sh: Arc<Shared>,
    si: usize,
    session: Io,
    mut rng: XorShift,
) -> (u64, Histogram<u64>) {
    let mut hist = Histogram::<u64>::new(3).expect("3 significant digits");
    let mut done = 0u64;
    let read_percent = u64::from(sh.w.rw.read_percent(sh.w.rwmix));
    let read_only = read_percent == 100;
    let mut backoff = FIRST_BACKOFF;
    while sh.claim().is_some() {
        let slot = if sh.w.rw.random() {
            rng.next() % sh.slots
        } else {
            sh.cursors[si].fetch_add(1, Ordering::Relaxed) % sh.slots
        };
        let lba = sh.start + slot * sh.io_blocks;
        let is_read = rng.next() % 100 < read_percent;
        // Whether the blocks hold this run's pattern must be known when the read is issued: a
        // write acknowledged while the read is in flight may land after the read took the data.
        // A slot's blocks are written and marked together, so its first block speaks for all.
        let written = sh.w.verify
            && (read_only || sh.written.as_ref().is_some_and(|w| w.get(lba - sh.start)));
        let t = Instant::now();
        let result = if is_read {
            session
                .read_split(lba, sh.io_blocks as u32, sh.block_size, sh.command_blocks)
                .await
                .map(|d| {
                    if written {
                        sh.check(lba, &d, true);
                    }
                })
        } else {
            let data = sh.block_data(lba);
            let (bs, max) = (sh.block_size, sh.command_blocks);
            session.write_split(lba, data, bs, max).await.map(|()| {
                if let Some(w) = &sh.written {
                    w.set(lba - sh.start, sh.io_blocks);
                }
            })
        };
        match result {
            Ok(()) => {
                backoff = FIRST_BACKOFF;
                let ns = t.elapsed().as_nanos().min(u128::from(u64::MAX)) as u64;
                let _ = hist.record(ns.max(1));
                done += 1;
                sh.progress.ios.fetch_add(1, Ordering::Relaxed);
                sh.progress
                    .bytes
                    .fetch_add(u64::from(sh.w.bs), Ordering::Relaxed);
            }
            Err(e) => {
                sh.failed(lba, &session.portal(), &e);
                if e.ends_the_connection() {
                    // The next command logs in again: wait longer after each failure in a row,
                    // so a target that is gone is not hammered with logins.
                    tokio::time::sleep(backoff).await;
                    backoff = (backoff * 2).min(MAX_BACKOFF);
                }
            }
        }
    }
    (done, hist)
}

/// Reads back every block the run wrote and checks it.
async fn verify_pass(sh: &Shared, session: &Io) -> Result<()> {
    let Some(w) = &sh.written else { return Ok(()) };
    for slot in 0..sh.slots {
        let lba = sh.start + slot * sh.io_blocks;
        if !(0..sh.io_blocks).any(|i| w.get(lba - sh.start + i)) {
            continue;
        }
        let data = session
            .read(lba, sh.io_blocks as u32, sh.block_size)
            .await?;
        sh.check(lba, &data, false);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pattern_and_fairness() {
        let mut a = [0u8; 512];
        let mut b = [0u8; 512];
        fill_pattern(&mut a, 7, 1);
        fill_pattern(&mut b, 7, 1);
        assert_eq!(a, b);
        assert_eq!(&a[..8], &7u64.to_be_bytes());
        fill_pattern(&mut b, 8, 1);
        assert_ne!(a, b);
        fill_pattern(&mut b, 7, 2);
        assert_ne!(a, b);
        assert!((jain(&[1.0, 1.0, 1.0]) - 1.0).abs() < 1e-9);
        assert!((jain(&[1.0, 0.0, 0.0, 0.0]) - 0.25).abs() < 1e-9);
        assert_eq!(Rw::Randrw.read_percent(70), 70);
        assert_eq!(Rw::Write.read_percent(70), 0);
    }
}
