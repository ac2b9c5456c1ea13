//! `targetctl trace start` / `trace stop`: the daemon's side of cross-layer command tracing
//! (`cmdtrace`). Starting arms a ring on every reactor (made then, so recording allocates
//! nothing) and turns the trace points on; the connections' machines then report each
//! command's stages, which their shells record with the session's ISID and TSIH. Stopping
//! turns them off, takes every reactor's ring and writes one trace file.

use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde_json::{json, Value};

use crate::lock;
use crate::reactor::Handle;

/// Moves a machine's trace points into this reactor's ring as records of `session`, and
/// turns the machine's points on or off with the daemon's tracing: what every connection's
/// and channel's shell does after a step.
pub fn record_points(points: &mut cmdtrace::Points, session: u64, io: &crate::reactor::Io) {
    let on = cmdtrace::enabled();
    if on != points.is_on() {
        points.set(on);
    }
    if !on {
        return;
    }
    let mut any = false;
    while let Some(p) = points.poll() {
        any = true;
        cmdtrace::record(cmdtrace::Record {
            at_ns: io.clock.ns(p.at),
            session,
            itt: p.itt,
            cmd_sn: p.cmd_sn,
            stage: p.stage,
            lane: io.index as u8,
            arg: p.arg,
        });
    }
    if any && cmdtrace::ring_filled() {
        tracing::warn!(
            reactor = io.index,
            "trace ring full: this reactor's records are being dropped from now on \
             (targetctl trace stop; a larger ring: trace start --records)"
        );
    }
}

/// Records each reactor keeps unless `trace start` says otherwise (32 bytes each: 32 MiB per
/// reactor).
pub const RECORDS_PER_REACTOR: usize = 1 << 20;

/// The most records per reactor a trace may ask for (2 GiB per reactor).
pub const MAX_RECORDS_PER_REACTOR: usize = 1 << 26;

/// How long a reactor may take to arm or hand over its ring.
const REACTOR_ANSWER: Duration = Duration::from_secs(5);

/// A trace in progress.
#[derive(Debug)]
struct Run {
    id: u64,
    out: PathBuf,
}

/// Starts and stops traces on the daemon's reactors.
#[derive(Debug)]
pub struct Tracer {
    reactors: Vec<Handle>,
    run: Mutex<Option<Run>>,
    next_id: Mutex<u64>,
    /// What the last trace that stopped at its duration wrote, for the `trace stop` that
    /// comes after it (once).
    ended: Mutex<Option<Value>>,
}

impl Tracer {
    /// The tracer of `reactors`.
    pub fn new(reactors: Vec<Handle>) -> Arc<Tracer> {
        Arc::new(Tracer {
            reactors,
            run: Mutex::new(None),
            next_id: Mutex::new(0),
            ended: Mutex::new(None),
        })
    }

    /// Runs `f` on every reactor thread and collects what each gives back.
    fn on_reactors<T: Send + 'static>(
        &self,
        f: impl Fn() -> T + Clone + Send + 'static,
    ) -> Result<Vec<T>, String> {
        let (tx, rx) = std::sync::mpsc::channel();
        for h in &self.reactors {
            let (tx, f) = (tx.clone(), f.clone());
            let sent = h.spawn(Box::new(move |_| {
                Box::pin(async move {
                    let _ = tx.send(f());
                })
            }));
            if !sent {
                return Err(format!("reactor {} is gone", h.index));
            }
        }
        (0..self.reactors.len())
            .map(|_| {
                rx.recv_timeout(REACTOR_ANSWER)
                    .map_err(|_| "a reactor did not answer".to_string())
            })
            .collect()
    }

    /// Starts a trace into `out`; with `duration`, it stops by itself then.
    pub fn start(
        self: &Arc<Self>,
        out: PathBuf,
        duration: Option<Duration>,
        records: usize,
    ) -> Result<Value, String> {
        let mut run = lock(&self.run);
        if let Some(r) = run.as_ref() {
            return Err(format!(
                "a trace into {} is running already (targetctl trace stop)",
                r.out.display()
            ));
        }
        // Refuse a file that cannot be written now, not when the trace ends.
        std::fs::File::create(&out).map_err(|e| format!("{}: {e}", out.display()))?;
        self.on_reactors(move || cmdtrace::arm(records))?;
        let id = {
            let mut n = lock(&self.next_id);
            *n += 1;
            *n
        };
        *run = Some(Run {
            id,
            out: out.clone(),
        });
        *lock(&self.ended) = None;
        tracing::info!(out = %out.display(), "trace started");
        if let Some(d) = duration {
            let tracer = self.clone();
            tokio::spawn(async move {
                tokio::time::sleep(d).await;
                let _ = tokio::task::spawn_blocking(move || {
                    if let Ok(mut written) = tracer.stop_run(Some(id)) {
                        written["stopped"] = json!("at its duration");
                        *lock(&tracer.ended) = Some(written);
                    }
                })
                .await;
            });
        }
        Ok(json!({
            "out": out.display().to_string(),
            "records_per_reactor": records,
            "duration_seconds": duration.map(|d| d.as_secs_f64()),
        }))
    }

    /// Stops the running trace and writes its file.
    pub fn stop(&self) -> Result<Value, String> {
        // A trace that already stopped at its duration: what it wrote, not an error.
        if lock(&self.run).is_none() {
            if let Some(written) = lock(&self.ended).take() {
                return Ok(written);
            }
        }
        *lock(&self.ended) = None;
        self.stop_run(None)
    }

    /// Stops the trace `id` (any, when `None`) if it runs.
    fn stop_run(&self, id: Option<u64>) -> Result<Value, String> {
        let mut run = lock(&self.run);
        match (run.as_ref(), id) {
            (None, _) => return Err("no trace is running".into()),
            (Some(r), Some(id)) if r.id != id => return Err("another trace runs".into()),
            _ => {}
        }
        let r = run.take().expect("checked");
        cmdtrace::disarm();
        let rings = self.on_reactors(cmdtrace::take)?;
        let mut records = Vec::new();
        let mut dropped = 0;
        for ring in rings.into_iter().flatten() {
            let (mut rs, d) = ring.into_parts();
            records.append(&mut rs);
            dropped += d;
        }
        records.sort_by_key(|r| r.at_ns);
        let file = cmdtrace::TraceFile {
            side: cmdtrace::Side::Target,
            offset_ns: 0,
            dropped,
            records,
        };
        let write = || -> std::io::Result<()> {
            let mut w = std::io::BufWriter::new(std::fs::File::create(&r.out)?);
            file.write_to(&mut w)
        };
        write().map_err(|e| format!("{}: {e}", r.out.display()))?;
        tracing::info!(out = %r.out.display(), records = file.records.len(), dropped, "trace written");
        if dropped > 0 {
            let kept = file.records.len() as f64;
            let share = 100.0 * dropped as f64 / (kept + dropped as f64);
            tracing::warn!(
                dropped,
                "{share:.0}% of the trace's records were dropped: its rings filled \
                 (trace start --records gives each reactor more)"
            );
        }
        Ok(json!({
            "out": r.out.display().to_string(),
            "records": file.records.len(),
            "dropped": dropped,
        }))
    }
}
