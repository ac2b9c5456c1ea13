//! `initiator-bench trace report`: what a command trace (`cmdtrace`, written by `targetctl
//! trace stop`) says. The records are cut into commands (a session's ITT from one arrival to
//! its response; an ITT used again starts a new command), then the report gives how long
//! commands spent between each pair of stages (percentiles), how many were in flight at each
//! layer, a diagnosis of where concurrency stopped, and a Chrome/Perfetto trace-event file
//! with a track per layer and a slice per command per layer, to look at in a viewer
//! (ui.perfetto.dev, chrome://tracing).

use std::collections::HashMap;
use std::fmt::Write as _;

use cmdtrace::{Record, Stage, TraceFile};
use serde_json::{json, Value};

/// One command's life at the target: its stages in order.
#[derive(Debug, Clone)]
pub struct CommandLife {
    /// Its session (ISID and TSIH).
    pub session: u64,
    /// Its ITT.
    pub itt: u32,
    /// Its CmdSN.
    pub cmd_sn: u32,
    /// Its expected data length.
    pub len: u32,
    /// (stage, time in ns), in time order.
    pub stages: Vec<(Stage, u64)>,
}

impl CommandLife {
    /// When it reached `stage` first.
    pub fn at(&self, stage: Stage) -> Option<u64> {
        self.stages.iter().find(|s| s.0 == stage).map(|s| s.1)
    }

    /// Whether it ended (its response queued at the target, or handed back at the
    /// initiator).
    pub fn ended(&self) -> bool {
        self.at(Stage::Responded)
            .or(self.at(Stage::Completed))
            .is_some()
    }
}

/// Cuts target records into commands.
pub fn commands(records: &[Record]) -> Vec<CommandLife> {
    lives(records, Stage::Received, Stage::Responded)
}

/// Cuts records into commands that begin at `first` (the target's, or the initiator's), by
/// session and ITT; a command begun before the trace has no life here. (`last`, where a
/// command ends, names the side's end; records after it until the ITT's next arrival are
/// still the command's: the status as written.)
pub fn lives(records: &[Record], first: Stage, last: Stage) -> Vec<CommandLife> {
    let side = first.is_target();
    let mut sorted: Vec<&Record> = records
        .iter()
        .filter(|r| r.stage.is_target() == side)
        .collect();
    sorted.sort_by_key(|r| r.at_ns);
    let mut open: HashMap<(u64, u32), usize> = HashMap::new();
    let mut lives: Vec<CommandLife> = Vec::new();
    for r in sorted {
        let key = (r.session, r.itt);
        if r.stage == first {
            open.insert(key, lives.len());
            lives.push(CommandLife {
                session: r.session,
                itt: r.itt,
                cmd_sn: r.cmd_sn,
                len: r.arg,
                stages: Vec::with_capacity(8),
            });
        }
        // A command's records run to the next arrival of its ITT (the ITT is its own until it
        // ends): its end (`last`) may be followed by the shell's (the status written).
        if let Some(&i) = open.get(&key) {
            lives[i].stages.push((r.stage, r.at_ns));
        }
    }
    let _ = last;
    lives
}

/// The spans a report measures: from one stage to the next that a command reached.
pub const SPANS: [(Stage, Stage, &str); 9] = [
    (
        Stage::Received,
        Stage::Delivered,
        "arrival to CmdSN order (write buffer)",
    ),
    (
        Stage::Delivered,
        Stage::Dispatched,
        "CmdSN order to the SCSI core",
    ),
    (
        Stage::Dispatched,
        Stage::BufferWait,
        "core to buffer request",
    ),
    (
        Stage::BufferWait,
        Stage::BackendSubmit,
        "waiting for a buffer",
    ),
    (
        Stage::R2tSent,
        Stage::DataOutDone,
        "R2T to the last data-out",
    ),
    (Stage::BackendSubmit, Stage::BackendDone, "backend"),
    (Stage::BackendDone, Stage::Responded, "backend to response"),
    (
        Stage::Responded,
        Stage::StatusSent,
        "response queued to its status written",
    ),
    (
        Stage::Received,
        Stage::Responded,
        "arrival to response (at the target)",
    ),
];

/// For each span `(from, to, name)`, the percentiles of how long the commands that reached
/// both stages took between them.
fn span_percentiles(
    commands: &[&CommandLife],
    spans: &[(Stage, Stage, &'static str)],
) -> Vec<(&'static str, Option<Percentiles>)> {
    spans
        .iter()
        .map(|&(a, b, name)| {
            let ns = commands
                .iter()
                .filter_map(|c| Some(c.at(b)?.saturating_sub(c.at(a)?)))
                .collect();
            (name, percentiles(ns))
        })
        .collect()
}

/// When each command that reached `from` was between it and `to` (still there at `end` if it
/// never reached `to`).
fn intervals(lives: &[CommandLife], from: Stage, to: Stage, end: u64) -> Vec<(u64, u64)> {
    lives
        .iter()
        .filter_map(|c| Some((c.at(from)?, c.at(to).unwrap_or(end))))
        .collect()
}

/// Percentiles of a set of durations, microseconds.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Percentiles {
    /// How many.
    pub count: usize,
    /// Median.
    pub p50: f64,
    /// 90th.
    pub p90: f64,
    /// 99th.
    pub p99: f64,
    /// Largest.
    pub max: f64,
}

/// The percentiles of `ns` (nanoseconds); `None` for none.
pub fn percentiles(mut ns: Vec<u64>) -> Option<Percentiles> {
    if ns.is_empty() {
        return None;
    }
    ns.sort_unstable();
    let at = |q: f64| ns[((ns.len() - 1) as f64 * q).round() as usize] as f64 / 1e3;
    Some(Percentiles {
        count: ns.len(),
        p50: at(0.5),
        p90: at(0.9),
        p99: at(0.99),
        max: *ns.last().expect("not empty") as f64 / 1e3,
    })
}

/// Commands in flight at one layer over the trace.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct InFlight {
    /// The most at once.
    pub max: usize,
    /// The time-weighted mean.
    pub mean: f64,
}

/// How many intervals `[start, end)` overlap, at most and on average over `[t0, t1]`.
fn in_flight(intervals: &[(u64, u64)], t0: u64, t1: u64) -> InFlight {
    let mut edges: Vec<(u64, i64)> = Vec::with_capacity(intervals.len() * 2);
    for &(a, b) in intervals {
        edges.push((a, 1));
        edges.push((b.max(a), -1));
    }
    edges.sort_unstable();
    let (mut now, mut max, mut last, mut area) = (0i64, 0i64, t0, 0f64);
    for (t, d) in edges {
        area += now as f64 * t.saturating_sub(last) as f64;
        last = t;
        now += d;
        max = max.max(now);
    }
    let span = t1.saturating_sub(t0).max(1) as f64;
    InFlight {
        max: max.max(0) as usize,
        mean: area / span,
    }
}

/// Commands in flight in one bucket of time: the time-weighted mean and the most at once.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Bucket {
    /// The bucket's start, ms from the start of the trace.
    pub at_ms: f64,
    /// Time-weighted mean over the bucket.
    pub mean: f64,
    /// The most open at any instant of the bucket.
    pub max: usize,
}

/// How many of `intervals` (`[start, end)`, ns) are open over `[t0, t1]`, cut into `buckets`
/// equal buckets: each bucket's mean and maximum. Sampling at instants instead would show a
/// pattern that depends on where the samples fall (bursts shorter than the sample spacing are
/// missed); the mean and max of a bucket hold every instant of it.
pub fn in_flight_buckets(
    intervals: &[(u64, u64)],
    t0: u64,
    t1: u64,
    buckets: usize,
) -> Vec<Bucket> {
    let mut edges: Vec<(u64, i64)> = Vec::with_capacity(intervals.len() * 2);
    for &(a, b) in intervals {
        // Ends sort before starts at one instant: a command that ends as another begins
        // does not count as two at once.
        edges.push((a, 1));
        edges.push((b.max(a), -1));
    }
    edges.sort_unstable();
    let span = t1.saturating_sub(t0).max(1);
    let n = buckets.max(1) as u64;
    let (mut open, mut next) = (0i64, 0usize);
    (0..n)
        .map(|k| {
            let (b0, b1) = (t0 + span * k / n, t0 + span * (k + 1) / n);
            // What began (or ended) by the bucket's first instant is (or is not) open at it.
            while next < edges.len() && edges[next].0 <= b0 {
                open += edges[next].1;
                next += 1;
            }
            let (mut area, mut max, mut cursor) = (0f64, open, b0);
            while next < edges.len() && edges[next].0 < b1 {
                let (t, d) = edges[next];
                area += open as f64 * t.saturating_sub(cursor) as f64;
                cursor = t.max(cursor);
                open += d;
                max = max.max(open);
                next += 1;
            }
            area += open as f64 * b1.saturating_sub(cursor) as f64;
            Bucket {
                at_ms: (b0 - t0) as f64 / 1e6,
                mean: area / (b1 - b0).max(1) as f64,
                max: max.max(0) as usize,
            }
        })
        .collect()
}

/// The series of commands in flight over time at each layer of the traces (the initiator's
/// when given, the target's, its SCSI core's and its backend's), in `buckets` buckets: the
/// mean per bucket as the line, the most at once as its upper line.
pub fn in_flight_series(
    target: &TraceFile,
    initiator: Option<&TraceFile>,
    buckets: usize,
) -> Vec<crate::plot::Series> {
    let tlives = commands(&target.records);
    let mut layers: Vec<(String, Vec<(u64, u64)>)> = Vec::new();
    let span = |lives: &[CommandLife], from: Stage, to: Stage, offset: i64| -> Vec<(u64, u64)> {
        let at = |ns: u64| (ns as i64 + offset).max(0) as u64;
        lives
            .iter()
            .filter_map(|c| Some((at(c.at(from)?), at(c.at(to)?))))
            .collect()
    };
    if let Some(i) = initiator {
        let ilives = lives(&i.records, Stage::Submitted, Stage::Completed);
        let s = span(&ilives, Stage::Submitted, Stage::Completed, i.offset_ns);
        layers.push(("initiator".into(), s));
    }
    layers.push((
        "target".into(),
        span(&tlives, Stage::Received, Stage::Responded, 0),
    ));
    layers.push((
        "SCSI core".into(),
        span(&tlives, Stage::Dispatched, Stage::Responded, 0),
    ));
    layers.push((
        "backend".into(),
        span(&tlives, Stage::BackendSubmit, Stage::BackendDone, 0),
    ));
    let all = layers
        .iter()
        .flat_map(|l| l.1.iter().flat_map(|i| [i.0, i.1]));
    let (t0, t1) = all.fold((u64::MAX, 0), |(a, b), t| (a.min(t), b.max(t)));
    if t0 > t1 {
        return Vec::new();
    }
    layers
        .into_iter()
        .map(|(label, intervals)| {
            let buckets = in_flight_buckets(&intervals, t0, t1, buckets);
            crate::plot::Series {
                label,
                points: buckets.iter().map(|b| (b.at_ms, b.mean)).collect(),
                upper: buckets.iter().map(|b| (b.at_ms, b.max as f64)).collect(),
            }
        })
        .collect()
}

/// What a trace says.
#[derive(Debug, Clone)]
pub struct Report {
    /// Commands whose arrival is in the trace.
    pub commands: usize,
    /// Of them, ended within it.
    pub ended: usize,
    /// Sessions seen.
    pub sessions: usize,
    /// Records lost to full rings.
    pub dropped: u64,
    /// Seconds from the first record to the last.
    pub seconds: f64,
    /// Per span of [`SPANS`]: its name and percentiles.
    pub spans: Vec<(&'static str, Option<Percentiles>)>,
    /// Commands in flight at the target (arrival to response), in the SCSI core (dispatch to
    /// response), and in the backend.
    pub in_flight: [(&'static str, InFlight); 3],
    /// The initiator's side, when its trace was given.
    pub initiator: Option<InitiatorSide>,
    /// The initiator's clock against the target's, when NOP round trips date it, and whether
    /// the estimate was applied (else the file's offset was).
    pub clock: Option<(ClockOffset, bool)>,
    /// Where concurrency stopped, in words.
    pub diagnosis: Vec<String>,
}

/// The initiator's clock dated against the target's by NOP round trips.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ClockOffset {
    /// Nanoseconds to add to the initiator's times to put them on the target's clock: the
    /// target's arrival time of a NOP-Out less the midpoint of its round trip at the initiator.
    pub offset_ns: i64,
    /// The round trip of the NOP that dated it (the shortest, the least uncertain: the error
    /// is at most half of it).
    pub round_trip_ns: u64,
    /// Round trips seen in both traces.
    pub samples: usize,
}

/// Dates the initiator's clock against the target's from the NOP-Outs both traces recorded.
pub fn clock_offset(target: &TraceFile, initiator: &TraceFile) -> Option<ClockOffset> {
    let arrived: HashMap<(u64, u32), u64> = target
        .records
        .iter()
        .filter(|r| r.stage == Stage::NopReceived)
        .map(|r| ((r.session, r.itt), r.at_ns))
        .collect();
    let answered: HashMap<(u64, u32), u64> = initiator
        .records
        .iter()
        .filter(|r| r.stage == Stage::NopAnswered)
        .map(|r| ((r.session, r.itt), r.at_ns))
        .collect();
    let mut best: Option<ClockOffset> = None;
    let mut samples = 0;
    for r in initiator
        .records
        .iter()
        .filter(|r| r.stage == Stage::NopSent)
    {
        let key = (r.session, r.itt);
        let (Some(&at), Some(&back)) = (arrived.get(&key), answered.get(&key)) else {
            continue;
        };
        let Some(rtt) = back.checked_sub(r.at_ns) else {
            continue;
        };
        samples += 1;
        let mid = r.at_ns + rtt / 2;
        let estimate = ClockOffset {
            offset_ns: at as i64 - mid as i64,
            round_trip_ns: rtt,
            samples: 0,
        };
        if best.is_none_or(|b| rtt < b.round_trip_ns) {
            best = Some(estimate);
        }
    }
    best.map(|b| ClockOffset { samples, ..b })
}

/// What the initiator's trace adds.
#[derive(Debug, Clone)]
pub struct InitiatorSide {
    /// Commands submitted while tracing, and of them completed.
    pub commands: usize,
    /// Of them, waited for the CmdSN window before they were sent.
    pub waited: usize,
    /// Per initiator span (and across both sides, joined by session and ITT): its name and
    /// percentiles.
    pub spans: Vec<(&'static str, Option<Percentiles>)>,
    /// Commands in flight at the initiator (submitted to completed), and waiting for the
    /// window.
    pub in_flight: [(&'static str, InFlight); 2],
}

/// The initiator's spans.
pub const INITIATOR_SPANS: [(Stage, Stage, &str); 4] = [
    (
        Stage::Submitted,
        Stage::Sent,
        "waiting for the CmdSN window (initiator)",
    ),
    (
        Stage::Sent,
        Stage::StatusReceived,
        "sent to status (link and target)",
    ),
    (
        Stage::StatusReceived,
        Stage::Completed,
        "status to completion (initiator)",
    ),
    (
        Stage::Submitted,
        Stage::Completed,
        "submitted to completed (initiator)",
    ),
];

/// The initiator's side of a trace, its times moved by `offset_ns` onto the target's clock,
/// and the spans across both sides (commands joined by session and ITT).
fn initiator_side(init: &TraceFile, target: &[CommandLife]) -> InitiatorSide {
    let mut lives = lives(&init.records, Stage::Submitted, Stage::Completed);
    for c in &mut lives {
        for s in &mut c.stages {
            s.1 = (s.1 as i64 + init.offset_ns).max(0) as u64;
        }
    }
    let ended: Vec<&CommandLife> = lives.iter().filter(|c| c.ended()).collect();
    let mut spans = span_percentiles(&ended, &INITIATOR_SPANS);
    // The same command at the target: its arrival between the initiator's send and status.
    let mut at_target: HashMap<(u64, u32), Vec<&CommandLife>> = HashMap::new();
    for t in target {
        at_target.entry((t.session, t.itt)).or_default().push(t);
    }
    let (mut out, mut back) = (Vec::new(), Vec::new());
    for c in &ended {
        let (Some(sent), Some(status)) = (c.at(Stage::Sent), c.at(Stage::StatusReceived)) else {
            continue;
        };
        let same = at_target.get(&(c.session, c.itt)).and_then(|ts| {
            ts.iter().find(|t| {
                let same_sn = c.cmd_sn == 0 || t.cmd_sn == c.cmd_sn;
                same_sn
                    && t.at(Stage::Received)
                        .is_some_and(|r| r >= sent && r <= status)
            })
        });
        if let Some(t) = same {
            if let (Some(rx), Some(resp)) = (t.at(Stage::Received), t.at(Stage::Responded)) {
                out.push(rx.saturating_sub(sent));
                back.push(status.saturating_sub(resp));
            }
        }
    }
    spans.push(("sent to arrival at the target", percentiles(out)));
    spans.push(("response to status at the initiator", percentiles(back)));
    let all: Vec<u64> = lives
        .iter()
        .flat_map(|c| c.stages.iter().map(|s| s.1))
        .collect();
    let t0 = all.iter().copied().min().unwrap_or(0);
    let t1 = all.iter().copied().max().unwrap_or(0);
    let layer = |from, to| intervals(&lives, from, to, t1);
    InitiatorSide {
        commands: lives.len(),
        waited: lives
            .iter()
            .filter(|c| c.at(Stage::WindowWait).is_some())
            .count(),
        spans,
        in_flight: [
            (
                "initiator",
                in_flight(&layer(Stage::Submitted, Stage::Completed), t0, t1),
            ),
            (
                "waiting for the window",
                in_flight(&layer(Stage::WindowWait, Stage::Sent), t0, t1),
            ),
        ],
    }
}

/// Reads a target trace, and the initiator's if given, into a [`Report`]; with `estimate`,
/// the initiator's times are moved by the offset NOP round trips give (two hosts), else by
/// its file's (0 on one host).
pub fn report(target: &TraceFile, initiator: Option<&TraceFile>, estimate: bool) -> Report {
    let clock = initiator.and_then(|i| clock_offset(target, i));
    let moved = initiator.map(|i| {
        let mut i = i.clone();
        if let (true, Some(c)) = (estimate, clock) {
            i.offset_ns = c.offset_ns;
        }
        i
    });
    let initiator = moved.as_ref();
    let lives = commands(&target.records);
    let ended: Vec<&CommandLife> = lives.iter().filter(|c| c.ended()).collect();
    let t0 = target.records.iter().map(|r| r.at_ns).min().unwrap_or(0);
    let t1 = target.records.iter().map(|r| r.at_ns).max().unwrap_or(0);
    let spans = span_percentiles(&ended, &SPANS);
    let layer = |from, to| intervals(&lives, from, to, t1);
    let in_flight = [
        (
            "target",
            in_flight(&layer(Stage::Received, Stage::Responded), t0, t1),
        ),
        (
            "SCSI core",
            in_flight(&layer(Stage::Dispatched, Stage::Responded), t0, t1),
        ),
        (
            "backend",
            in_flight(&layer(Stage::BackendSubmit, Stage::BackendDone), t0, t1),
        ),
    ];
    let mut sessions: Vec<u64> = lives.iter().map(|c| c.session).collect();
    sessions.sort_unstable();
    sessions.dedup();
    let mut r = Report {
        commands: lives.len(),
        ended: ended.len(),
        sessions: sessions.len(),
        dropped: target.dropped,
        seconds: t1.saturating_sub(t0) as f64 / 1e9,
        spans,
        in_flight,
        initiator: initiator.map(|i| initiator_side(i, &lives)),
        clock: clock.map(|c| (c, estimate)),
        diagnosis: Vec::new(),
    };
    r.diagnosis = diagnose(&r);
    r
}

/// Where concurrency stopped, from the target's side.
fn diagnose(r: &Report) -> Vec<String> {
    let mut d = Vec::new();
    if r.commands == 0 {
        d.push("no command arrived while tracing".into());
        return d;
    }
    let span = |name: &str| r.spans.iter().find(|s| s.0 == name).and_then(|s| s.1);
    let total = span("arrival to response (at the target)");
    let order = span("CmdSN order to the SCSI core");
    let buffer = span("waiting for a buffer");
    let backend = span("backend");
    let target = r.in_flight[0].1;
    let share = |p: Option<Percentiles>| match (p, total) {
        (Some(p), Some(t)) if t.p50 > 0.0 => p.p50 / t.p50,
        _ => 0.0,
    };
    // How much of the time the target holds the commands it holds at its busiest.
    let busy = if target.max > 0 {
        target.mean / target.max as f64
    } else {
        0.0
    };
    if let Some(i) = &r.initiator {
        let span = |name: &str| i.spans.iter().find(|s| s.0 == name).and_then(|s| s.1);
        let wait = span("waiting for the CmdSN window (initiator)");
        let whole = span("submitted to completed (initiator)");
        let waited = i.waited as f64 / i.commands.max(1) as f64;
        // Of the commands the initiator holds, on average, the share waiting for MaxCmdSN: a
        // time-weighted figure, which holds when waiters are woken unevenly (some wait long,
        // others not at all), where a median over all commands can read zero.
        let outstanding = i.in_flight[0].1.mean;
        let wait_share = if outstanding > 0.0 {
            i.in_flight[1].1.mean / outstanding
        } else {
            0.0
        };
        if waited > 0.1 && wait_share > 0.1 {
            d.insert(
                0,
                format!(
                    "commands wait for MaxCmdSN before they are sent ({:.0}% of them, {:.0}% of \
                     those outstanding at a time, median {:.0} us of {:.0} us): the cap is the \
                     target's command window; the target never had more than {} commands at \
                     once while the initiator had up to {}",
                    waited * 100.0,
                    wait_share * 100.0,
                    wait.map_or(0.0, |p| p.p50),
                    whole.map_or(0.0, |p| p.p50),
                    target.max,
                    i.in_flight[0].1.max
                ),
            );
            return d;
        }
        if busy < 0.5 {
            d.push(format!(
                "the initiator never has more than {} commands in flight while the target's \
                 queues are empty (the target holds commands {:.0}% of the time, each for {:.0} \
                 us of the initiator's {:.0}): the cap is the initiator's queue depth",
                i.in_flight[0].1.max,
                busy * 100.0,
                total.map_or(0.0, |p| p.p50),
                whole.map_or(0.0, |p| p.p50)
            ));
            return d;
        }
    }
    if busy < 0.5 {
        d.push(format!(
            "the target holds commands {:.0}% of the time, never more than {} at once (mean \
             {:.2}), each for {:.0} us (median): the cap is outside the target. Commands spend \
             their time on the way to it and back, and the initiator keeps no more than {} \
             outstanding: its queue depth (or its CmdSN window, if it waits for MaxCmdSN) \
             caps concurrency",
            busy * 100.0,
            target.max,
            target.mean,
            total.map_or(0.0, |p| p.p50),
            target.max
        ));
        return d;
    }
    // The target is busy: where its time goes.
    if share(order) > 0.25 {
        d.push(format!(
            "commands wait for their CmdSN turn (median {:.0} us of {:.0} us at the target): \
             an earlier command is missing or slow to arrive",
            order.map_or(0.0, |p| p.p50),
            total.map_or(0.0, |p| p.p50)
        ));
    }
    if share(buffer) > 0.25 {
        d.push(format!(
            "commands wait for arena buffers (median {:.0} us): the cap is the target's \
             buffer memory",
            buffer.map_or(0.0, |p| p.p50)
        ));
    }
    if share(backend) > 0.5 {
        d.push(format!(
            "the target is busy and the backend takes most of each command's time there \
             (median {:.0} us of {:.0} us), with up to {} operations in flight: the cap is \
             the storage",
            backend.map_or(0.0, |p| p.p50),
            total.map_or(0.0, |p| p.p50),
            r.in_flight[2].1.max
        ));
    } else if d.is_empty() {
        d.push(format!(
            "the target is busy ({:.0}% of the time, up to {} commands at once) and no stage \
             dominates: the cap is the target's processing (CPU)",
            busy * 100.0,
            target.max
        ));
    }
    d
}

/// A table of spans' percentiles.
fn spans_table(s: &mut String, spans: &[(&str, Option<Percentiles>)]) {
    let _ = writeln!(
        s,
        "\n| span | commands | p50 us | p90 us | p99 us | max us |\n| --- | --- | --- | --- | --- | --- |"
    );
    for (name, p) in spans {
        if let Some(p) = p {
            let _ = writeln!(
                s,
                "| {name} | {} | {:.1} | {:.1} | {:.1} | {:.1} |",
                p.count, p.p50, p.p90, p.p99, p.max
            );
        }
    }
}

/// A table of commands in flight per layer.
fn in_flight_table(s: &mut String, layers: &[(&str, InFlight)]) {
    let _ = writeln!(
        s,
        "\n| layer | in flight, most | in flight, mean |\n| --- | --- | --- |"
    );
    for (name, f) in layers {
        let _ = writeln!(s, "| {name} | {} | {:.2} |", f.max, f.mean);
    }
}

/// The report as text.
pub fn text(r: &Report) -> String {
    let mut s = String::new();
    let _ = writeln!(
        s,
        "{} commands ({} ended) of {} sessions over {:.3} s; {} records dropped",
        r.commands, r.ended, r.sessions, r.seconds, r.dropped
    );
    if r.dropped > 0 {
        let _ = writeln!(
            s,
            "WARNING: the target's trace rings filled and {} records were lost: the commands \
             after that point are missing or cut short (targetctl trace start --records N)",
            r.dropped
        );
    }
    spans_table(&mut s, &r.spans);
    in_flight_table(&mut s, &r.in_flight);
    if let Some((c, applied)) = r.clock {
        let _ = writeln!(
            s,
            "\nClocks: the initiator's runs {:.1} us behind the target's (the best of {} NOP \
             round trips, {:.1} us, bounds the error to {:.1} us); {}",
            c.offset_ns as f64 / 1e3,
            c.samples,
            c.round_trip_ns as f64 / 1e3,
            c.round_trip_ns as f64 / 2e3,
            if applied {
                "applied"
            } else {
                "not applied (one host: the trace files' offset is used)"
            }
        );
    }
    if let Some(i) = &r.initiator {
        let _ = writeln!(
            s,
            "\nInitiator: {} commands, {} of them waited for the CmdSN window",
            i.commands, i.waited
        );
        spans_table(&mut s, &i.spans);
        in_flight_table(&mut s, &i.in_flight);
    }
    let _ = writeln!(s, "\nDiagnosis:");
    for line in &r.diagnosis {
        let _ = writeln!(s, "- {line}");
    }
    s
}

/// The tracks of the Perfetto file, each a layer: (name, from, to).
const TRACKS: [(&str, Stage, Stage); 4] = [
    (
        "target: arrival to response",
        Stage::Received,
        Stage::Responded,
    ),
    ("CmdSN order", Stage::Delivered, Stage::Dispatched),
    ("SCSI core", Stage::Dispatched, Stage::Responded),
    ("backend", Stage::BackendSubmit, Stage::BackendDone),
];

/// The initiator's tracks.
const INITIATOR_TRACKS: [(&str, Stage, Stage); 3] = [
    (
        "initiator: submitted to completed",
        Stage::Submitted,
        Stage::Completed,
    ),
    (
        "waiting for the CmdSN window",
        Stage::WindowWait,
        Stage::Sent,
    ),
    ("sent to status", Stage::Sent, Stage::StatusReceived),
];

/// The time of the traces' first record (the initiator's moved by its offset), 0 if none.
fn first_record(target: &TraceFile, initiator: Option<&TraceFile>) -> u64 {
    let mut t0 = target
        .records
        .iter()
        .map(|r| r.at_ns)
        .min()
        .unwrap_or(u64::MAX);
    if let Some(i) = initiator {
        let first = i.records.iter().map(|r| r.at_ns).min().unwrap_or(u64::MAX);
        t0 = t0.min((first as i64 + i.offset_ns).max(0) as u64);
    }
    if t0 == u64::MAX {
        0
    } else {
        t0
    }
}

/// A Chrome/Perfetto trace-event file of the commands: a track per layer, a slice per
/// command per layer (microseconds from the trace's start); the initiator's layers as a
/// second process when its trace is given.
pub fn perfetto(target: &TraceFile, initiator: Option<&TraceFile>) -> Value {
    let t0 = first_record(target, initiator);
    let mut events = Vec::new();
    slices(
        &mut events,
        1,
        "target",
        &commands(&target.records),
        &TRACKS,
        t0,
        0,
    );
    if let Some(i) = initiator {
        let lives = lives(&i.records, Stage::Submitted, Stage::Completed);
        slices(
            &mut events,
            2,
            "initiator",
            &lives,
            &INITIATOR_TRACKS,
            t0,
            i.offset_ns,
        );
    }
    json!({ "traceEvents": events, "displayTimeUnit": "ns" })
}

/// The timeline window to draw when none is asked for, (start, length) in ms from the first
/// record: ten times the median command's time at the target (arrival to response), so a
/// few commands' lives are wide enough to read, from the middle of the trace, where the
/// load is steady (not its ramp up or drain).
pub fn default_window(target: &TraceFile, initiator: Option<&TraceFile>) -> (f64, f64) {
    let mut at_target: Vec<u64> = commands(&target.records)
        .iter()
        .filter_map(|c| {
            Some(
                c.at(Stage::Responded)?
                    .saturating_sub(c.at(Stage::Received)?),
            )
        })
        .collect();
    let len_ms = if at_target.is_empty() {
        1.0
    } else {
        let mid = at_target.len() / 2;
        let p50 = *at_target.select_nth_unstable(mid).1;
        // At least 10 us, so a window is never empty of time.
        (p50 as f64 * 10.0 / 1e6).max(0.01)
    };
    let t0 = first_record(target, initiator);
    let t1 = target.records.iter().map(|r| r.at_ns).max().unwrap_or(t0);
    let span_ms = t1.saturating_sub(t0) as f64 / 1e6;
    let from_ms = ((span_ms - len_ms) / 2.0).max(0.0);
    (round3(from_ms), round3(len_ms))
}

/// `x` to three decimals.
fn round3(x: f64) -> f64 {
    (x * 1e3).round() / 1e3
}

/// The timeline of a window of the trace, `from_ms` milliseconds after its first record for
/// `len_ms`: a track per layer (the initiator's first when given), each command's slice on it.
pub fn timeline(
    target: &TraceFile,
    initiator: Option<&TraceFile>,
    from_ms: f64,
    len_ms: f64,
) -> Vec<crate::plot::Track> {
    let t0 = first_record(target, initiator);
    let (lo, hi) = (from_ms, from_ms + len_ms);
    let mut tracks = Vec::new();
    let mut add = |lives: &[CommandLife], defs: &[(&str, Stage, Stage)], offset_ns: i64| {
        let ms = |ns: u64| ((ns as i64 + offset_ns).max(0) as u64).saturating_sub(t0) as f64 / 1e6;
        for &(name, from, to) in defs {
            let slices = lives
                .iter()
                .filter_map(|c| Some((ms(c.at(from)?), ms(c.at(to)?))))
                .filter(|&(a, b)| b >= lo && a <= hi)
                .map(|(a, b)| (a.max(lo), b.min(hi)))
                .collect();
            tracks.push(crate::plot::Track {
                label: name.to_string(),
                slices,
            });
        }
    };
    if let Some(i) = initiator {
        let lives = lives(&i.records, Stage::Submitted, Stage::Completed);
        add(&lives, &INITIATOR_TRACKS, i.offset_ns);
    }
    add(&commands(&target.records), &TRACKS, 0);
    tracks
}

/// The slices of `lives` on `tracks` of process `pid`.
fn slices(
    events: &mut Vec<Value>,
    pid: u32,
    process: &str,
    lives: &[CommandLife],
    tracks: &[(&str, Stage, Stage)],
    t0: u64,
    offset_ns: i64,
) {
    // Microseconds with three decimals, which is every nanosecond and no binary noise
    // (1234.567, not 1234.5670000000002): the file is read by people and diffed.
    let ns = |at: u64| ((at as i64 + offset_ns).max(0) as u64).saturating_sub(t0);
    let us = |ns: u64| round3(ns as f64 / 1e3);
    events.push(json!({
        "name": "process_name", "ph": "M", "pid": pid, "args": {"name": process}
    }));
    for (tid, (name, ..)) in tracks.iter().enumerate() {
        events.push(json!({
            "name": "thread_name", "ph": "M", "pid": pid, "tid": tid,
            "args": {"name": name}
        }));
    }
    for c in lives {
        for (tid, &(_, from, to)) in tracks.iter().enumerate() {
            let (Some(a), Some(b)) = (c.at(from), c.at(to)) else {
                continue;
            };
            events.push(json!({
                "name": format!("ITT {:#x}", c.itt),
                "ph": "X",
                "pid": pid,
                "tid": tid,
                "ts": us(ns(a)),
                "dur": us(ns(b).saturating_sub(ns(a))),
                "args": {
                    "session": format!("{:016x}", c.session),
                    "cmd_sn": c.cmd_sn,
                    "bytes": c.len,
                },
            }));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(itt: u32, stage: Stage, at_us: u64) -> Record {
        Record {
            at_ns: at_us * 1000,
            session: 7,
            itt,
            cmd_sn: itt,
            stage,
            lane: 0,
            arg: 512,
        }
    }

    fn life(itt: u32, start: u64, backend: u64) -> Vec<Record> {
        vec![
            rec(itt, Stage::Received, start),
            rec(itt, Stage::Delivered, start + 1),
            rec(itt, Stage::Dispatched, start + 2),
            rec(itt, Stage::BackendSubmit, start + 3),
            rec(itt, Stage::BackendDone, start + 3 + backend),
            rec(itt, Stage::Responded, start + 4 + backend),
        ]
    }

    fn file(records: Vec<Record>) -> TraceFile {
        TraceFile {
            side: cmdtrace::Side::Target,
            offset_ns: 0,
            dropped: 0,
            records,
        }
    }

    #[test]
    fn commands_are_cut_at_each_arrival_and_spans_measured() {
        let mut rs = life(1, 0, 10);
        rs.extend(life(1, 100, 10)); // the ITT again, later: another command
        rs.extend(life(2, 5, 10));
        rs.push(rec(9, Stage::Responded, 50)); // began before the trace
        let lives = commands(&rs);
        assert_eq!(lives.len(), 3);
        assert!(lives.iter().all(CommandLife::ended));
        let r = report(&file(rs), None, false);
        let backend = r.spans.iter().find(|s| s.0 == "backend").and_then(|s| s.1);
        assert_eq!(backend.map(|p| (p.count, p.p50)), Some((3, 10.0)));
        assert_eq!(r.in_flight[0].1.max, 2, "commands 1 and 2 overlap");
    }

    #[test]
    fn a_busy_slow_backend_is_named_and_an_idle_target_is_not_the_cap() {
        // Eight commands at once, each mostly in the backend, back to back.
        let slow: Vec<Record> = (0..64)
            .flat_map(|i| life(i, u64::from(i / 8) * 1005, 1000))
            .collect();
        let r = report(&file(slow), None, false);
        assert!(
            r.diagnosis[0].contains("the cap is the storage"),
            "{:?}",
            r.diagnosis
        );
        // One command now and then, quick at the target: the initiator is the cap.
        let quick: Vec<Record> = (0..8).flat_map(|i| life(i, i as u64 * 100, 2)).collect();
        let r = report(&file(quick), None, false);
        assert!(
            r.diagnosis[0].contains("cap is outside the target"),
            "{:?}",
            r.diagnosis
        );
        assert_eq!(r.in_flight[0].1.max, 1);
        let p = perfetto(&file(life(1, 0, 10)), None);
        let slices = p["traceEvents"]
            .as_array()
            .expect("events")
            .iter()
            .filter(|e| e["ph"] == "X")
            .count();
        assert_eq!(slices, 4, "one per layer");
    }

    #[test]
    fn trace_json_times_are_whole_nanoseconds() {
        // Arrival at 1 ns past 1.234567 ms: binary noise would print 1234.5670000000002.
        let mut records = life(1, 1234, 10);
        for r in &mut records {
            r.at_ns += 567;
        }
        records.insert(0, rec(9, Stage::Received, 0));
        let text = serde_json::to_string(&perfetto(&file(records), None)).unwrap();
        assert!(text.contains("\"ts\":1234.567"), "{text}");
        for number in text.split([',', ':', '{', '}', '[', ']']) {
            if let Some((_, decimals)) = number.split_once('.') {
                if number.parse::<f64>().is_ok() {
                    assert!(decimals.len() <= 3, "{number} in {text}");
                }
            }
        }
    }

    #[test]
    fn the_default_window_is_ten_median_commands_from_the_middle() {
        // 101 commands 1 ms apart, each 40 us at the target (4 us to the backend, 10 in it,
        // ...): the trace spans 100.044 ms; the median command takes 14 us.
        let records: Vec<Record> = (0..101)
            .flat_map(|i| life(i, u64::from(i) * 1000, 10))
            .collect();
        let (from, len) = default_window(&file(records), None);
        assert_eq!(len, 0.14);
        assert!((from - (100.014 - 0.14) / 2.0).abs() < 0.002, "{from}");
        // No command: a millisecond from the start.
        assert_eq!(default_window(&file(Vec::new()), None), (0.0, 1.0));
    }
}

#[cfg(test)]
mod clock_tests {
    use super::*;

    #[test]
    fn commands_in_flight_are_binned_by_mean_and_max() {
        let b = in_flight_buckets(&[(0, 10), (5, 20), (30, 40), (12, 12)], 0, 40, 4);
        let means: Vec<f64> = b.iter().map(|b| b.mean).collect();
        let maxes: Vec<usize> = b.iter().map(|b| b.max).collect();
        // [0,10): one, two from 5 (15 ns of 10); [10,20): one (the first ended at 10, the
        // empty one never counts); [20,30): none; [30,40): one.
        assert_eq!(means, [1.5, 1.0, 0.0, 1.0]);
        assert_eq!(maxes, [2, 1, 0, 1]);
        // A burst shorter than a bucket still shows in its max.
        let b = in_flight_buckets(&[(1, 2), (1, 2), (1, 2)], 0, 100, 1);
        assert_eq!(b[0].max, 3);
        assert!((b[0].mean - 0.03).abs() < 1e-12);
        // What began before the window is open at its start.
        let b = in_flight_buckets(&[(0, 100)], 50, 100, 1);
        assert_eq!((b[0].mean, b[0].max), (1.0, 1));
    }

    #[test]
    fn nop_round_trips_date_the_initiators_clock() {
        let rec = |stage, itt, at_ns| Record {
            at_ns,
            session: 3,
            itt,
            cmd_sn: 0,
            stage,
            lane: 0,
            arg: 0,
        };
        // The initiator's clock is 1 ms behind the target's; two pings, the second quicker.
        let target = TraceFile {
            side: cmdtrace::Side::Target,
            offset_ns: 0,
            dropped: 0,
            records: vec![
                rec(Stage::NopReceived, 1, 1_000_000 + 5_000),
                rec(Stage::NopReceived, 2, 1_000_000 + 50_000 + 1_000),
            ],
        };
        let initiator = TraceFile {
            side: cmdtrace::Side::Initiator,
            offset_ns: 0,
            dropped: 0,
            records: vec![
                rec(Stage::NopSent, 1, 0),
                rec(Stage::NopAnswered, 1, 12_000),
                rec(Stage::NopSent, 2, 50_000),
                rec(Stage::NopAnswered, 2, 52_000),
            ],
        };
        let c = clock_offset(&target, &initiator).expect("dated");
        assert_eq!(c.samples, 2);
        assert_eq!(c.round_trip_ns, 2_000, "the quicker round trip");
        assert_eq!(c.offset_ns, 1_000_000);
        let r = report(&target, Some(&initiator), true);
        assert_eq!(r.clock, Some((c, true)));
    }
}
