//! What the subcommands do beyond running one workload: sweeps, comparisons, the paper's
//! experiments, trace files and reports, and printing.

use std::io::{IsTerminal, Write};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use initiator_bench::login::LoginOptions;
use initiator_bench::nvme::NvmeUrl;
use initiator_bench::plot::{plot, Series};
use initiator_bench::proxy::{parse_duration, parse_rate, Link, Proxy};
use initiator_bench::srp::{LinkModel, RdmaOptions};
use initiator_bench::workload::{parse_size, run_many, Progress, Report, Rw, Workload};
use initiator_bench::IscsiUrl;
use srp::initiator::Registration;

use crate::cli::*;

/// One sweep.csv's column `metric`, by its first column's value.
pub(crate) fn sweep_column(path: &str, metric: &str) -> anyhow::Result<Vec<(f64, f64)>> {
    let text = std::fs::read_to_string(path).map_err(|e| anyhow::anyhow!("{path}: {e}"))?;
    let mut lines = text.lines();
    let header: Vec<&str> = lines.next().unwrap_or_default().split(',').collect();
    let Some(col) = header.iter().position(|h| *h == metric) else {
        bail!(
            "{path} has no column {metric:?} (it has {})",
            header.join(", ")
        );
    };
    let mut points = Vec::new();
    for (n, line) in lines.enumerate() {
        let cells: Vec<&str> = line.split(',').collect();
        let num = |i: usize| -> anyhow::Result<f64> {
            let cell = cells.get(i).copied().unwrap_or_default();
            cell.parse()
                .map_err(|_| anyhow::anyhow!("{path}:{}: {cell:?} is not a number", n + 2))
        };
        // A delay sweep's values are durations (16ms): its x is milliseconds.
        let first = cells.first().copied().unwrap_or_default();
        let x = match initiator_bench::proxy::parse_duration(first) {
            Ok(d) if first.parse::<f64>().is_err() => d.as_secs_f64() * 1e3,
            _ => num(0)?,
        };
        points.push((x, num(col)?));
    }
    Ok(points)
}

/// `initiator-bench combine`: a table and a plot of one metric across sweeps.
pub(crate) fn combine(
    sweeps: &[String],
    (metric, divide): (&str, f64),
    ideal: Option<f64>,
    (x_label, y_label): (&str, &str),
    title: &str,
    out: &std::path::Path,
) -> anyhow::Result<()> {
    let mut series = Vec::new();
    for s in sweeps {
        let Some((label, path)) = s.split_once('=') else {
            bail!("{s:?} is not LABEL=PATH");
        };
        let points = sweep_column(path, metric)?;
        series.push(Series {
            label: label.to_string(),
            points: points.into_iter().map(|(x, y)| (x, y / divide)).collect(),
            upper: Vec::new(),
        });
    }
    let mut xs: Vec<f64> = series
        .iter()
        .flat_map(|s| s.points.iter().map(|p| p.0))
        .collect();
    xs.sort_by(f64::total_cmp);
    xs.dedup();
    if let Some(slope) = ideal {
        series.push(Series {
            label: format!("ideal ({slope} x)"),
            points: xs.iter().map(|&x| (x, slope * x)).collect(),
            upper: Vec::new(),
        });
    }
    let mut md = format!("| {x_label} |");
    for s in &series {
        md.push_str(&format!(" {} |", s.label));
    }
    md.push_str(&format!("\n| --- |{}\n", " --- |".repeat(series.len())));
    for &x in &xs {
        md.push_str(&format!("| {x} |"));
        for s in &series {
            match s.points.iter().find(|p| p.0 == x) {
                Some(p) => md.push_str(&format!(" {:.1} |", p.1)),
                None => md.push_str(" |"),
            }
        }
        md.push('\n');
    }
    if let Some(dir) = out.parent() {
        std::fs::create_dir_all(dir)?;
    }
    std::fs::write(out.with_extension("md"), &md)?;
    print!("{md}");
    match plot(out, title, x_label, y_label, &series) {
        Ok(files) => {
            for f in files {
                println!("wrote {}", f.display());
            }
        }
        Err(e) => eprintln!("no plot: {e}"),
    }
    Ok(())
}

/// Runs a workload against an SRP target on this machine's RDMA device.
#[cfg(feature = "rdma")]
pub(crate) fn run_srp_device(
    url: &initiator_bench::srp::SrpUrl,
    w: &initiator_bench::workload::Workload,
    o: &RdmaOptions,
) -> Result<initiator_bench::srp::RdmaReport, String> {
    initiator_bench::srp::run_rdma(url, w, o)
}

#[cfg(not(feature = "rdma"))]
pub(crate) fn run_srp_device(
    _: &initiator_bench::srp::SrpUrl,
    _: &initiator_bench::workload::Workload,
    _: &RdmaOptions,
) -> Result<initiator_bench::srp::RdmaReport, String> {
    Err(
        "SRP on an RDMA device needs initiator-bench built with the feature rdma \
         (cargo build --release -p storage-target-initiator-bench --features rdma)"
            .into(),
    )
}

/// Runs a workload against an iSER target on this machine's RDMA device.
#[cfg(feature = "rdma")]
pub(crate) fn run_iser_device(
    url: &initiator_bench::iser::IserUrl,
    w: &initiator_bench::workload::Workload,
    o: &RdmaOptions,
) -> Result<initiator_bench::rdma::RdmaReport, String> {
    initiator_bench::iser::run_rdma(url, w, o)
}

#[cfg(not(feature = "rdma"))]
pub(crate) fn run_iser_device(
    _: &initiator_bench::iser::IserUrl,
    _: &initiator_bench::workload::Workload,
    _: &RdmaOptions,
) -> Result<initiator_bench::rdma::RdmaReport, String> {
    Err("iSER needs initiator-bench built with the feature rdma \
         (cargo build --release -p storage-target-initiator-bench --features rdma)"
        .into())
}

/// Runs a workload against an NVMe/RDMA subsystem on this machine's RDMA device.
#[cfg(feature = "rdma")]
pub(crate) fn run_nvme_rdma_device(
    url: &initiator_bench::nvme::NvmeUrl,
    host: &initiator_bench::nvme::NvmeOptions,
    w: &initiator_bench::workload::Workload,
    o: &RdmaOptions,
) -> Result<initiator_bench::rdma::RdmaReport, String> {
    initiator_bench::nvme_rdma::run_rdma(url, host, w, o)
}

#[cfg(not(feature = "rdma"))]
pub(crate) fn run_nvme_rdma_device(
    _: &initiator_bench::nvme::NvmeUrl,
    _: &initiator_bench::nvme::NvmeOptions,
    _: &initiator_bench::workload::Workload,
    _: &RdmaOptions,
) -> Result<initiator_bench::rdma::RdmaReport, String> {
    Err(
        "NVMe/RDMA needs initiator-bench built with the feature rdma \
         (cargo build --release -p storage-target-initiator-bench --features rdma)"
            .into(),
    )
}

/// Prints an RDMA run's report (JSON with `json`) and fails on verification errors or on
/// more failed I/Os than `max_errors`.
pub(crate) fn rdma_outcome(
    report: &initiator_bench::rdma::RdmaReport,
    json: bool,
    max_errors: u64,
) -> anyhow::Result<()> {
    if json {
        println!("{}", serde_json::to_string(report)?);
    } else {
        initiator_bench::rdma::print(report);
    }
    if report.verify_errors > 0 {
        anyhow::bail!("{} blocks failed verification", report.verify_errors);
    }
    if report.errors > max_errors {
        anyhow::bail!("{} I/Os failed (--max-errors {max_errors})", report.errors);
    }
    Ok(())
}

/// Writes an initiator's trace file.
pub(crate) fn write_trace(
    path: &std::path::Path,
    records: &[cmdtrace::Record],
    dropped: u64,
) -> anyhow::Result<()> {
    let file = cmdtrace::TraceFile {
        side: cmdtrace::Side::Initiator,
        offset_ns: 0,
        dropped,
        records: records.to_vec(),
    };
    let f = std::fs::File::create(path).map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))?;
    file.write_to(&mut std::io::BufWriter::new(f))
        .map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))?;
    eprintln!("trace: {} records in {}", records.len(), path.display());
    Ok(())
}

/// Reads a trace file.
pub(crate) fn read_trace(path: &std::path::Path) -> anyhow::Result<cmdtrace::TraceFile> {
    let f = std::fs::File::open(path).map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))?;
    cmdtrace::TraceFile::read_from(&mut std::io::BufReader::new(f))
        .map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))
}

/// `initiator-bench trace report`.
pub(crate) fn trace_report(
    target: &std::path::Path,
    initiator: Option<&std::path::Path>,
    (window, estimate): (Option<&str>, bool),
    out: &std::path::Path,
) -> anyhow::Result<()> {
    let window = window
        .map(|window| {
            window
                .split_once(':')
                .and_then(|(a, b)| Some((a.parse::<f64>().ok()?, b.parse::<f64>().ok()?)))
                .filter(|&(a, b)| a >= 0.0 && b > 0.0 && a.is_finite() && b.is_finite())
                .ok_or_else(|| anyhow::anyhow!("--window {window:?} is not START:LENGTH in ms"))
        })
        .transpose()?;
    let t = read_trace(target)?;
    let i = initiator.map(read_trace).transpose()?;
    // Each file says which side wrote it: swapped or doubled files would make a report of
    // nothing, or of the wrong thing.
    if t.side != cmdtrace::Side::Target {
        bail!(
            "{} was written by an initiator (run --trace): the target's trace (targetctl trace \
             stop) comes first",
            target.display()
        );
    }
    if let (Some(path), Some(file)) = (initiator, &i) {
        if file.side != cmdtrace::Side::Initiator {
            bail!(
                "{} was written by a target: the second trace is the initiator's (run --trace)",
                path.display()
            );
        }
    }
    for (path, file) in std::iter::once((target, &t)).chain(initiator.zip(i.as_ref())) {
        if file.dropped > 0 {
            eprintln!(
                "warning: {} lost {} records to a full ring: the report covers what was kept",
                path.display(),
                file.dropped
            );
        }
    }
    let r = initiator_bench::trace::report(&t, i.as_ref(), estimate);
    let i = match (i, r.clock) {
        (Some(mut i), Some((c, true))) => {
            i.offset_ns = c.offset_ns;
            Some(i)
        }
        (i, _) => i,
    };
    let text = initiator_bench::trace::text(&r);
    std::fs::create_dir_all(out)?;
    std::fs::write(out.join("report.md"), &text)?;
    let json = initiator_bench::trace::perfetto(&t, i.as_ref());
    std::fs::write(out.join("trace.json"), serde_json::to_vec(&json)?)?;
    print!("{text}");
    println!(
        "wrote {} and {} (open it in ui.perfetto.dev)",
        out.join("report.md").display(),
        out.join("trace.json").display()
    );
    let series = initiator_bench::trace::in_flight_series(&t, i.as_ref(), 400);
    let title = "commands in flight at each layer";
    match initiator_bench::plot::plot(&out.join("in-flight"), title, "ms", "commands", &series) {
        Ok(_) => println!("wrote {}", out.join("in-flight.png").display()),
        Err(e) => eprintln!("no in-flight plot: {e}"),
    }
    // The estimate goes into the initiator's trace file, for whoever reads it next.
    if let (Some(path), Some((c, true)), Some(file)) = (initiator, r.clock, &i) {
        let mut f = std::io::BufWriter::new(std::fs::File::create(path)?);
        file.write_to(&mut f)?;
        println!(
            "wrote the clock offset ({:.1} us) into {}",
            c.offset_ns as f64 / 1e3,
            path.display()
        );
    }
    let (from, len) =
        window.unwrap_or_else(|| initiator_bench::trace::default_window(&t, i.as_ref()));
    let tracks = initiator_bench::trace::timeline(&t, i.as_ref(), from, len);
    let title = format!("commands from {from} ms to {} ms", from + len);
    match initiator_bench::plot::timeline(&out.join("timeline.png"), &title, &tracks) {
        Ok(()) => println!("wrote {}", out.join("timeline.png").display()),
        Err(e) => eprintln!("no timeline.png: {e}"),
    }
    Ok(())
}

/// Runs a workload, with a live progress line when stderr is a terminal.
pub(crate) async fn run_with_progress(
    urls: &[IscsiUrl],
    login: &LoginOptions,
    w: &Workload,
) -> anyhow::Result<Report> {
    with_progress(|progress| run_many(urls, login, w, progress)).await
}

/// Runs a workload on one LU through every URL as a path, with the progress line.
pub(crate) async fn run_multipath_with_progress(
    urls: &[IscsiUrl],
    login: &LoginOptions,
    w: &Workload,
) -> anyhow::Result<Report> {
    with_progress(|progress| initiator_bench::workload::run_multipath(urls, login, w, progress))
        .await
}

/// Runs `run`, with a live progress line when stderr is a terminal.
pub(crate) async fn with_progress<F, Fut>(run: F) -> anyhow::Result<Report>
where
    F: FnOnce(Arc<Progress>) -> Fut,
    Fut: std::future::Future<Output = initiator_bench::Result<Report>>,
{
    let progress = Arc::new(Progress::default());
    let ticker = std::io::stderr().is_terminal().then(|| {
        let p = progress.clone();
        tokio::spawn(async move {
            let t0 = Instant::now();
            let (mut last_ios, mut last_bytes) = (0u64, 0u64);
            loop {
                tokio::time::sleep(Duration::from_secs(1)).await;
                let (ios, bytes) = (
                    p.ios.load(Ordering::Relaxed),
                    p.bytes.load(Ordering::Relaxed),
                );
                eprint!(
                    "\r{:>6.1}s  {:>10.0} IOPS  {:>9.1} MB/s   ",
                    t0.elapsed().as_secs_f64(),
                    (ios - last_ios) as f64,
                    (bytes - last_bytes) as f64 / 1e6
                );
                let _ = std::io::stderr().flush();
                (last_ios, last_bytes) = (ios, bytes);
            }
        })
    });
    let report = run(progress).await;
    if let Some(t) = ticker {
        t.abort();
        eprintln!();
    }
    Ok(report?)
}

/// Paper 004 on the fabric: every strategy and region count, READs and WRITEs of 128 KiB.
pub(crate) fn paper004(out: &std::path::Path, ios: u64) -> anyhow::Result<()> {
    std::fs::create_dir_all(out).with_context(|| format!("{}", out.display()))?;
    let regions = [1usize, 2, 4, 8, 16, 32];
    let mut md = String::from(
        "| registration | regions per 128 KiB command | READ MB/s | WRITE MB/s | READ latency us (mean) | initiator registrations per command | target registrations |\n| --- | --- | --- | --- | --- | --- | --- |\n",
    );
    let mut csv = String::from(
        "registration,regions,read_mb_s,write_mb_s,read_latency_us,registrations_per_command,target_registrations\n",
    );
    let mut series = Vec::new();
    for registration in Registration::ALL {
        let mut points = Vec::new();
        for &n in &regions {
            let options = RdmaOptions {
                registration,
                regions: n,
                link: LinkModel::Paper004,
                immediate_data: true,
            };
            let mut w = Workload {
                rw: Rw::Read,
                bs: 128 * 1024,
                qd: 1,
                ios: Some(ios),
                size: Some(64 << 20),
                ..Workload::default()
            };
            let read =
                initiator_bench::srp::run_fabric(&w, &options).map_err(anyhow::Error::msg)?;
            w.rw = Rw::Write;
            let write =
                initiator_bench::srp::run_fabric(&w, &options).map_err(anyhow::Error::msg)?;
            let (r, wr) = (read.bytes_per_sec / 1e6, write.bytes_per_sec / 1e6);
            let regs =
                (read.initiator_registrations_per_io + write.initiator_registrations_per_io) / 2.0;
            let target = read.target_registrations + write.target_registrations;
            md += &format!(
                "| {} | {n} | {r:.0} | {wr:.0} | {:.1} | {regs:.2} | {target} |\n",
                registration.name(),
                read.latency_us.mean
            );
            csv += &format!(
                "{},{n},{r:.1},{wr:.1},{:.2},{regs:.2},{target}\n",
                registration.name(),
                read.latency_us.mean
            );
            points.push((n as f64, (r + wr) / 2.0));
            eprintln!(
                "{} {n}: READ {r:.0} MB/s, WRITE {wr:.0} MB/s",
                registration.name()
            );
        }
        series.push(Series {
            label: registration.name().to_string(),
            points,
            upper: Vec::new(),
        });
    }
    std::fs::write(out.join("paper004.md"), &md)?;
    std::fs::write(out.join("paper004.csv"), &csv)?;
    print!("{md}");
    match plot(
        &out.join("paper004"),
        "Paper 004 on the software fabric: 128 KiB commands",
        "regions per command",
        "MB/s (mean of READ and WRITE)",
        &series,
    ) {
        Ok(files) => {
            for f in files {
                eprintln!("wrote {}", f.display());
            }
        }
        Err(e) => eprintln!("no plot: {e}"),
    }
    Ok(())
}

/// Prints a run's report (one JSON object with `json`) and says whether the run failed: a
/// block that failed verification, or more failed I/Os than `max_errors`.
pub(crate) fn run_outcome(report: &Report, json: bool, max_errors: u64) -> anyhow::Result<()> {
    if json {
        println!("{}", serde_json::to_string(report)?);
    } else {
        print_report(report);
    }
    if report.verify_errors > 0 {
        bail!("{} blocks failed verification", report.verify_errors);
    }
    if report.errors > max_errors {
        bail!(
            "{} I/Os failed (--max-errors {max_errors}); the report counts them by kind",
            report.errors
        );
    }
    Ok(())
}

pub(crate) fn print_report(r: &Report) {
    let w = &r.workload;
    println!(
        "{:?} bs={} qd={} sessions={}: {} I/Os in {:.2}s, {} errors",
        w.rw, w.bs, w.qd, w.sessions, r.ios, r.elapsed_seconds, r.errors
    );
    println!(
        "  IOPS {:.0}   throughput {:.1} MB/s   commands of at most {} bytes",
        r.iops,
        r.bytes_per_sec / 1e6,
        r.command_bytes
    );
    let l = &r.latency_us;
    println!(
        "  latency us: p50 {:.1}  p90 {:.1}  p99 {:.1}  p99.9 {:.1}  max {:.1}  mean {:.1}",
        l.p50, l.p90, l.p99, l.p999, l.max, l.mean
    );
    println!(
        "  client CPU {:.2}s ({:.1} us per I/O)",
        r.cpu_seconds,
        r.cpu_seconds * 1e6 / r.ios.max(1) as f64
    );
    if w.sessions > 1 {
        println!(
            "  per-session I/Os {:?}, Jain's fairness {:.3}",
            r.per_session_ios,
            r.fairness()
        );
    }
    for (what, n) in &r.failures {
        println!("  {n} I/Os failed with: {what}");
    }
    if r.resent > 0 {
        println!(
            "  {} commands sent again after BUSY or TASK SET FULL",
            r.resent
        );
    }
    if r.failovers > 0 {
        println!(
            "  {} failovers to another path, the first success there {:.1} s after the \
             failure; the slowest I/O of the run took {:.1} s (a write waits there until \
             the new path holds the unit)",
            r.failovers,
            r.longest_failover_seconds.unwrap_or_default(),
            r.latency_us.max / 1e6
        );
        if r.failovers_at_logout_request > 0 {
            println!(
                "  {} of them when a target asked to log out (a gateway stopping)",
                r.failovers_at_logout_request
            );
        }
    }
    if w.verify {
        println!(
            "  verified {} blocks, {} wrong",
            r.verified_blocks, r.verify_errors
        );
    }
}

pub(crate) async fn sweep(
    url: &IscsiUrl,
    param: Param,
    values: &[String],
    out: &std::path::Path,
    rate: Option<&str>,
    args: &WorkloadArgs,
    login: &LoginOptions,
) -> anyhow::Result<()> {
    std::fs::create_dir_all(out).with_context(|| format!("creating {}", out.display()))?;
    let rate_bps = rate
        .map(parse_rate)
        .transpose()
        .map_err(anyhow::Error::msg)?;
    let (name, unit) = match param {
        Param::Qd => ("queue depth", ""),
        Param::Bs => ("block size", " (bytes)"),
        Param::Sessions => ("sessions", ""),
        Param::Delay => ("one-way delay", " (ms)"),
    };
    let mut rows = Vec::new();
    for v in values {
        let mut w = args.workload()?;
        let mut target = url.clone();
        let mut _proxy = None;
        let x = match param {
            Param::Qd => {
                w.qd = v.parse().with_context(|| format!("queue depth {v:?}"))?;
                w.qd as f64
            }
            Param::Bs => {
                w.bs = u32::try_from(parse_size(v).map_err(anyhow::Error::msg)?)?;
                f64::from(w.bs)
            }
            Param::Sessions => {
                w.sessions = v.parse().with_context(|| format!("sessions {v:?}"))?;
                w.sessions as f64
            }
            Param::Delay => {
                let delay = parse_duration(v).map_err(anyhow::Error::msg)?;
                let proxy =
                    Proxy::start("127.0.0.1:0", &url.portal, Link { delay, rate_bps }).await?;
                target.portal = proxy.local_addr.to_string();
                _proxy = Some(proxy);
                delay.as_secs_f64() * 1e3
            }
        };
        eprintln!("{name} = {v} ...");
        let r = run_with_progress(std::slice::from_ref(&target), login, &w).await?;
        eprintln!(
            "  {:.0} IOPS, {:.1} MB/s, p99 {:.0} us",
            r.iops,
            r.bytes_per_sec / 1e6,
            r.latency_us.p99
        );
        rows.push((v.clone(), x, r));
    }
    let mut md = format!(
        "| {name} | IOPS | MB/s | p50 us | p99 us | client CPU s | fairness |\n| --- | --- | --- | --- | --- | --- | --- |\n"
    );
    let mut csv = String::from(
        "value,iops,bytes_per_sec,p50_us,p90_us,p99_us,p999_us,max_us,cpu_seconds,fairness\n",
    );
    for (v, _, r) in &rows {
        let l = &r.latency_us;
        md.push_str(&format!(
            "| {v} | {:.0} | {:.1} | {:.0} | {:.0} | {:.2} | {:.3} |\n",
            r.iops,
            r.bytes_per_sec / 1e6,
            l.p50,
            l.p99,
            r.cpu_seconds,
            r.fairness()
        ));
        csv.push_str(&format!(
            "{v},{:.1},{:.1},{:.1},{:.1},{:.1},{:.1},{:.1},{:.3},{:.4}\n",
            r.iops,
            r.bytes_per_sec,
            l.p50,
            l.p90,
            l.p99,
            l.p999,
            l.max,
            r.cpu_seconds,
            r.fairness()
        ));
    }
    std::fs::write(out.join("sweep.md"), &md)?;
    std::fs::write(out.join("sweep.csv"), &csv)?;
    let reports: Vec<&Report> = rows.iter().map(|(_, _, r)| r).collect();
    std::fs::write(
        out.join("sweep.json"),
        serde_json::to_string_pretty(&reports)?,
    )?;
    let by_bytes = matches!(param, Param::Bs | Param::Delay);
    let series = vec![Series {
        label: if by_bytes {
            "MB/s".into()
        } else {
            "IOPS".into()
        },
        points: rows
            .iter()
            .map(|(_, x, r)| {
                (
                    *x,
                    if by_bytes {
                        r.bytes_per_sec / 1e6
                    } else {
                        r.iops
                    },
                )
            })
            .collect(),
        upper: Vec::new(),
    }];
    let w = args.workload()?;
    // The fixed parameters; the swept one is the x axis.
    let mut fixed = vec![format!("{:?}", w.rw)];
    for (p, text) in [
        (Param::Bs, format!("bs={}", w.bs)),
        (Param::Qd, format!("qd={}", w.qd)),
        (Param::Sessions, format!("sessions={}", w.sessions)),
    ] {
        if std::mem::discriminant(&p) != std::mem::discriminant(&param) {
            fixed.push(text);
        }
    }
    if let (Param::Delay, Some(r)) = (param, rate) {
        fixed.push(format!("link {r}"));
    }
    let title = fixed.join(" ");
    let files = match plot(
        &out.join("sweep"),
        &title,
        &format!("{name}{unit}"),
        if by_bytes { "MB/s" } else { "IOPS" },
        &series,
    ) {
        Ok(files) => files,
        Err(e) => {
            eprintln!("no plot: {e}");
            Vec::new()
        }
    };
    print!("{md}");
    for f in files {
        eprintln!("wrote {}", f.display());
    }
    Ok(())
}

/// The median; the mean of the middle two for an even count.
pub(crate) fn median(mut xs: Vec<f64>) -> f64 {
    xs.sort_by(f64::total_cmp);
    let n = xs.len();
    match n {
        0 => f64::NAN,
        _ if n % 2 == 1 => xs[n / 2],
        _ => (xs[n / 2 - 1] + xs[n / 2]) / 2.0,
    }
}

/// What `compare` runs against: an iSCSI LU or an NVMe/TCP namespace, told by the URL's
/// scheme, so that the two transports compare on one backend.
pub(crate) enum Endpoint {
    /// iscsi://...
    Iscsi(IscsiUrl),
    /// nvme://...
    Nvme(NvmeUrl),
}

impl Endpoint {
    pub(crate) fn parse(url: &str) -> anyhow::Result<Endpoint> {
        Ok(if Transport::of_url(url) == Transport::NvmeTcp {
            Endpoint::Nvme(NvmeUrl::parse(url)?)
        } else {
            Endpoint::Iscsi(IscsiUrl::parse(url)?)
        })
    }

    async fn run(&self, login: &LoginArgs, w: &Workload) -> anyhow::Result<Report> {
        match self {
            Endpoint::Iscsi(u) => {
                run_with_progress(std::slice::from_ref(u), &login.options()?, w).await
            }
            Endpoint::Nvme(u) => {
                let o = login.nvme_options(w.qd)?;
                with_progress(|p| {
                    initiator_bench::workload::run_nvme(std::slice::from_ref(u), &o, w, p)
                })
                .await
            }
        }
    }
}

impl std::fmt::Display for Endpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Endpoint::Iscsi(u) => write!(f, "{u}"),
            Endpoint::Nvme(u) => write!(f, "nvme://{}/{}/{}", u.portal, u.nqn, u.nsid),
        }
    }
}

/// A named figure of a run.
type Metric = (&'static str, fn(&Run) -> f64);

/// `cpu` seconds over the run's I/Os, in microseconds.
fn per_io(cpu: f64, r: &Report) -> f64 {
    cpu * 1e6 / r.ios.max(1) as f64
}

/// One run of `compare`: the report, and the CPU the target process spent meanwhile.
struct Run {
    report: Report,
    target_cpu: Option<f64>,
}

/// CPU seconds (user + system) process `pid` has spent, from /proc/PID/stat.
fn process_cpu_seconds(pid: u32) -> anyhow::Result<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .with_context(|| format!("--target-pid {pid}"))?;
    let rest = stat
        .rsplit_once(')')
        .map(|(_, r)| r)
        .context("/proc/PID/stat without a command name")?;
    let f: Vec<&str> = rest.split_whitespace().collect();
    let ticks = |i: usize| f.get(i).and_then(|v| v.parse::<f64>().ok()).unwrap_or(0.0);
    // utime and stime, in USER_HZ (100 on Linux).
    Ok((ticks(11) + ticks(12)) / 100.0)
}

/// Runs `w` on `end`, with the target's CPU meanwhile when its process is named.
async fn measured(
    end: &Endpoint,
    login: &LoginArgs,
    w: &Workload,
    target_pid: Option<u32>,
    round: usize,
    name: &str,
) -> anyhow::Result<Run> {
    let before = target_pid.map(process_cpu_seconds).transpose()?;
    let report = end
        .run(login, w)
        .await
        .with_context(|| format!("round {round}, {name}"))?;
    let after = target_pid.map(process_cpu_seconds).transpose()?;
    Ok(Run {
        report,
        target_cpu: before.zip(after).map(|(x, y)| y - x),
    })
}

pub(crate) async fn compare(
    a: &Endpoint,
    b: &Endpoint,
    rounds: usize,
    target_pids: Option<(u32, u32)>,
    w: &Workload,
    login: &LoginArgs,
    json: bool,
) -> anyhow::Result<()> {
    let mut pairs = Vec::new();
    let (pid_a, pid_b) = (target_pids.map(|p| p.0), target_pids.map(|p| p.1));
    for round in 0..rounds.max(1) {
        // A then B, B then A: neither always runs on a machine the other just warmed.
        let one = |end, pid, name| measured(end, login, w, pid, round, name);
        let (ra, rb) = if round % 2 == 0 {
            let ra = one(a, pid_a, "A").await?;
            (ra, one(b, pid_b, "B").await?)
        } else {
            let rb = one(b, pid_b, "B").await?;
            (one(a, pid_a, "A").await?, rb)
        };
        pairs.push((ra, rb));
    }
    let mut metrics: Vec<Metric> = vec![
        ("IOPS", |r| r.report.iops),
        ("MB/s", |r| r.report.bytes_per_sec / 1e6),
        ("p50 us", |r| r.report.latency_us.p50),
        ("p99 us", |r| r.report.latency_us.p99),
        ("CPU us/IO", |r| per_io(r.report.cpu_seconds, &r.report)),
    ];
    if target_pids.is_some() {
        metrics.push(("target CPU us/IO", |r| {
            per_io(r.target_cpu.unwrap_or(f64::NAN), &r.report)
        }));
    }
    if json {
        let rows: Vec<serde_json::Value> = pairs
            .iter()
            .map(|(ra, rb)| {
                let mut m = serde_json::Map::new();
                for (name, f) in &metrics {
                    m.insert(
                        (*name).into(),
                        serde_json::json!({ "a": f(ra), "b": f(rb), "b_over_a": f(rb) / f(ra) }),
                    );
                }
                serde_json::Value::Object(m)
            })
            .collect();
        println!(
            "{}",
            serde_json::json!({ "a": a.to_string(), "b": b.to_string(), "workload": w, "rounds": rows })
        );
        return Ok(());
    }
    println!("A = {a}\nB = {b}");
    println!("| round | metric | A | B | B/A |\n| --- | --- | --- | --- | --- |");
    for (i, (ra, rb)) in pairs.iter().enumerate() {
        for (name, f) in &metrics {
            println!(
                "| {} | {name} | {:.1} | {:.1} | {:.3} |",
                i + 1,
                f(ra),
                f(rb),
                f(rb) / f(ra)
            );
        }
    }
    for (name, f) in &metrics {
        let ratios: Vec<f64> = pairs.iter().map(|(ra, rb)| f(rb) / f(ra)).collect();
        println!("median B/A {name}: {:.3}", median(ratios));
    }
    Ok(())
}
