//! `initiator-bench`: tests, benchmarks and compares iSCSI targets.

mod cli;
mod commands;

use anyhow::bail;
use clap::Parser;
use initiator_bench::proxy::{parse_duration, parse_rate, Cut, Link, Proxy};
use initiator_bench::workload::parse_size;
use initiator_bench::{discover, IscsiUrl};

use cli::*;
use commands::*;

fn main() -> anyhow::Result<()> {
    use std::io::IsTerminal;
    tracing_subscriber::fmt()
        // Colour only on a terminal: escapes in a file or a pipe are noise.
        .with_ansi(std::io::stderr().is_terminal())
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "warn".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    let mut cli = Cli::parse();
    if let Cmd::Run {
        urls, transport, ..
    } = &mut cli.command
    {
        transport.get_or_insert_with(|| Transport::of_urls(urls));
    }
    // From the definitions in cli.rs, so they cannot drift from what is parsed.
    match &cli.command {
        Cmd::Completions { shell } => {
            let mut cmd = <Cli as clap::CommandFactory>::command();
            clap_complete::generate(*shell, &mut cmd, "initiator-bench", &mut std::io::stdout());
            return Ok(());
        }
        Cmd::Man { dir } => {
            if !dir.is_dir() {
                bail!("{}: no such directory", dir.display());
            }
            clap_mangen::generate_to(<Cli as clap::CommandFactory>::command(), dir)?;
            println!("man pages in {}", dir.display());
            return Ok(());
        }
        _ => {}
    }
    // One thread by default: the workers, readers and writers then wake each other without
    // crossing threads, which measured 15% less CPU per I/O than two (10.8 vs 12.5 us per 4 KiB
    // read against tgtd); a target faster than one core of initiator needs more.
    let rt = match cli.threads {
        0 | 1 => tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?,
        n => tokio::runtime::Builder::new_multi_thread()
            .worker_threads(n)
            .enable_all()
            .build()?,
    };
    rt.block_on(async move {
        match cli.command {
            Cmd::Run {
                urls,
                transport: Some(Transport::Srp),
                srp,
                workload,
                json,
                max_errors,
                ..
            } => {
                if urls.len() != 1 {
                    bail!("--transport srp runs against one target: `fabric` or srp://...");
                }
                let w = workload.workload()?;
                let report = if urls[0] == "fabric" {
                    initiator_bench::srp::run_fabric(&w, &srp.options())
                } else {
                    let url = initiator_bench::srp::SrpUrl::parse(&urls[0])
                        .map_err(|e| anyhow::anyhow!(e))?;
                    run_srp_device(&url, &w, &srp.options())
                }
                .map_err(|e| anyhow::anyhow!(e))?;
                rdma_outcome(&report, json, max_errors)
            }
            Cmd::Run {
                urls,
                transport: Some(Transport::Iser),
                srp,
                workload,
                json,
                max_errors,
                ..
            } => {
                if urls.len() != 1 {
                    bail!("--transport iser runs against one target: iser://...");
                }
                let w = workload.workload()?;
                let url = initiator_bench::iser::IserUrl::parse(&urls[0])
                    .map_err(|e| anyhow::anyhow!(e))?;
                let report =
                    run_iser_device(&url, &w, &srp.options()).map_err(|e| anyhow::anyhow!(e))?;
                rdma_outcome(&report, json, max_errors)
            }
            Cmd::Run {
                urls,
                transport: Some(Transport::NvmeRdma),
                srp,
                workload,
                login,
                json,
                max_errors,
                ..
            } => {
                if urls.len() != 1 {
                    bail!("--transport nvme-rdma runs against one subsystem: nvme://...");
                }
                let w = workload.workload()?;
                let url = initiator_bench::nvme::NvmeUrl::parse(&urls[0])?;
                let host = login.nvme_options(w.qd)?;
                let report = run_nvme_rdma_device(&url, &host, &w, &srp.options())
                    .map_err(|e| anyhow::anyhow!(e))?;
                rdma_outcome(&report, json, max_errors)
            }
            Cmd::Run {
                urls,
                transport: Some(Transport::NvmeTcp),
                workload,
                login,
                json,
                trace,
                max_errors,
                multipath,
                ..
            } => {
                let urls = urls
                    .iter()
                    .map(|u| initiator_bench::nvme::NvmeUrl::parse(u))
                    .collect::<Result<Vec<_>, _>>()?;
                let mut w = workload.workload()?;
                w.trace = trace.is_some();
                if !multipath {
                    // As for iSCSI: a multipath run rides through failures, then is judged.
                    w.max_errors = Some(max_errors);
                }
                let o = login.nvme_options(w.qd)?;
                use initiator_bench::workload::{run_nvme, run_nvme_multipath};
                let report = if multipath {
                    with_progress(|p| run_nvme_multipath(&urls, &o, &w, p)).await?
                } else {
                    with_progress(|p| run_nvme(&urls, &o, &w, p)).await?
                };
                if let Some(path) = &trace {
                    write_trace(path, &report.trace, report.trace_dropped)?;
                }
                run_outcome(&report, json, max_errors)
            }
            Cmd::Paper004 { out, ios } => paper004(&out, ios),
            Cmd::Trace {
                action:
                    TraceCmd::Report {
                        target_trace,
                        initiator_trace,
                        window,
                        estimate_offset,
                        out,
                    },
            } => trace_report(
                &target_trace,
                initiator_trace.as_deref(),
                (window.as_deref(), estimate_offset),
                &out,
            ),
            Cmd::Combine {
                sweeps,
                metric,
                ideal,
                divide,
                y_label,
                x_label,
                title,
                out,
            } => {
                let y_label = y_label.unwrap_or_else(|| metric.clone());
                let axes = (x_label.as_str(), y_label.as_str());
                combine(&sweeps, (&metric, divide), ideal, axes, &title, &out)
            }
            Cmd::Run {
                urls,
                workload,
                login,
                json,
                trace,
                max_errors,
                multipath,
                ..
            } => {
                let urls = urls
                    .iter()
                    .map(|u| IscsiUrl::parse(u))
                    .collect::<Result<Vec<_>, _>>()?;
                let mut w = workload.workload()?;
                w.trace = trace.is_some();
                if !multipath {
                    // A multipath run rides through failures by design; the count still ends
                    // it in error below.
                    w.max_errors = Some(max_errors);
                }
                let report = if multipath {
                    run_multipath_with_progress(&urls, &login.options()?, &w).await?
                } else {
                    run_with_progress(&urls, &login.options()?, &w).await?
                };
                if let Some(path) = &trace {
                    write_trace(path, &report.trace, report.trace_dropped)?;
                }
                run_outcome(&report, json, max_errors)
            }
            Cmd::Sweep {
                url,
                param,
                values,
                out,
                rate,
                workload,
                login,
            } => {
                sweep(
                    &IscsiUrl::parse(&url)?,
                    param,
                    &values,
                    &out,
                    rate.as_deref(),
                    &workload,
                    &login.options()?,
                )
                .await
            }
            Cmd::Proxy {
                listen,
                to,
                delay,
                rate,
                cut_upstream,
                cut_downstream,
            } => {
                let bytes = |flag: &str, v: Option<String>| {
                    v.as_deref()
                        .map(parse_size)
                        .transpose()
                        .map_err(|e| anyhow::anyhow!("{flag}: {e}"))
                };
                let cut = Cut {
                    upstream: bytes("--cut-upstream", cut_upstream)?,
                    downstream: bytes("--cut-downstream", cut_downstream)?,
                };
                let link = Link {
                    delay: parse_duration(&delay).map_err(anyhow::Error::msg)?,
                    rate_bps: rate
                        .as_deref()
                        .map(parse_rate)
                        .transpose()
                        .map_err(anyhow::Error::msg)?,
                };
                let proxy = Proxy::start_with_cut(&listen, &to, link, cut).await?;
                eprintln!(
                    "relaying {} -> {to} with {:?} each way",
                    proxy.local_addr, link.delay
                );
                tokio::signal::ctrl_c().await?;
                Ok(())
            }
            Cmd::Compare {
                url_a,
                url_b,
                rounds,
                target_pid,
                workload,
                login,
                json,
            } => {
                let pids = match target_pid[..] {
                    [] => None,
                    [one] => Some((one, one)),
                    [a, b] => Some((a, b)),
                    _ => anyhow::bail!("--target-pid: at most two, A's and B's"),
                };
                compare(
                    &Endpoint::parse(&url_a)?,
                    &Endpoint::parse(&url_b)?,
                    rounds,
                    pids,
                    &workload.workload()?,
                    &login,
                    json,
                )
                .await
            }
            Cmd::Completions { .. } | Cmd::Man { .. } => Ok(()),
            Cmd::Discover { url, login } if url.starts_with("nvme://") => {
                let host = url.trim_start_matches("nvme://").trim_end_matches('/');
                let portal = initiator_bench::portal::portal(host, 8009).map_err(|reason| {
                    initiator_bench::nvme::NvmeError::Url {
                        url: url.clone(),
                        reason,
                    }
                })?;
                let found =
                    initiator_bench::nvme::discover(&portal, &login.nvme_options(1)?).await?;
                for d in found {
                    let kind = match d.subtype {
                        1 => "referral",
                        2 => "nvme",
                        3 => "discovery",
                        _ => "unknown",
                    };
                    println!(
                        "{kind} {} {}:{} portid {}",
                        d.nqn, d.address, d.port, d.port_id
                    );
                }
                Ok(())
            }
            Cmd::Ping { url, count, login } => {
                let s = initiator_bench::Session::connect(&IscsiUrl::parse(&url)?, login.options()?)
                    .await?;
                for _ in 0..100 {
                    s.nop().await?;
                }
                let mut ns = Vec::with_capacity(count);
                for _ in 0..count.max(1) {
                    let t = std::time::Instant::now();
                    s.nop().await?;
                    ns.push(t.elapsed().as_nanos() as u64);
                }
                s.logout().await?;
                let mean = ns.iter().sum::<u64>() as f64 / ns.len() as f64 / 1e3;
                let p = initiator_bench::trace::percentiles(ns).expect("at least one");
                println!(
                    "{} NOP-Out round trips to {url}: p50 {:.1} us  p90 {:.1}  p99 {:.1}  max {:.1}  mean {mean:.1}",
                    p.count, p.p50, p.p90, p.p99, p.max
                );
                Ok(())
            }
            Cmd::Discover { url, login } => {
                for t in discover(&IscsiUrl::parse(&url)?, &login.options()?).await? {
                    println!("{} {}", t.name, t.addresses.join(" "));
                }
                Ok(())
            }
        }
    })
}
