//! The Prometheus endpoint (`server.metrics_listen`): `GET /metrics` in the text exposition
//! format 0.0.4, encoded by `prometheus-client` and served over HTTP/1.1 by `hyper`.
//!
//! The figures live where the I/O path counts them (relaxed atomics in the registry, the
//! units and the arenas), so nothing is copied per command: a scrape reads them through one
//! [`Collector`] and the crate writes the text (names, `_total` on counters, label escaping,
//! `HELP`/`TYPE` on every family, histogram buckets).

use std::convert::Infallible;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::time::Duration;

use http_body_util::Full;
use hyper::body::Bytes;
use hyper::{header, Method, Request, Response, StatusCode};
use hyper_util::rt::{TokioIo, TokioTimer};
use prometheus_client::collector::Collector;
use prometheus_client::encoding::{
    DescriptorEncoder, EncodeCounterValue, EncodeGaugeValue, MetricEncoder,
};
use prometheus_client::metrics::MetricType;
use tokio::net::TcpListener;

use crate::registry::Registry;
use crate::store::StoreFigures;

/// The text exposition of every figure, as a scrape gets it.
pub fn text(registry: &Arc<Registry>) -> String {
    let mut exposition = prometheus_client::registry::Registry::default();
    exposition.register_collector(Box::new(Figures(registry.clone())));
    let mut out = String::new();
    // Writing into a String cannot fail, and our collector returns no error of its own.
    let _ = prometheus_client::encoding::prometheus_text::encode(&mut out, &exposition);
    out
}

/// The registry as a [`Collector`]: reads every figure at each scrape.
struct Figures(Arc<Registry>);

impl std::fmt::Debug for Figures {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Figures")
    }
}

/// Label pairs, as the encoder takes them.
type Labels = Vec<(&'static str, String)>;

/// One family's descriptor, then its samples.
struct Family<'b> {
    metric: MetricEncoder<'b>,
    kind: MetricType,
}

/// Starts a family: `name` as it is exposed (a counter's ends in `_total`, which the
/// encoder adds back).
fn family<'b>(
    encoder: &'b mut DescriptorEncoder<'_>,
    name: &'b str,
    help: &str,
    kind: MetricType,
) -> Result<Family<'b>, std::fmt::Error> {
    let name = match kind {
        MetricType::Counter => name.strip_suffix("_total").unwrap_or(name),
        _ => name,
    };
    Ok(Family {
        metric: encoder.encode_descriptor(name, help, None, kind)?,
        kind,
    })
}

impl Family<'_> {
    /// One sample with `labels` (none: the family's only sample), as the family's kind is
    /// encoded: a counter or a gauge.
    fn sample<V: EncodeCounterValue + EncodeGaugeValue>(
        &mut self,
        labels: &Labels,
        v: V,
    ) -> std::fmt::Result {
        let counter = matches!(self.kind, MetricType::Counter);
        match (labels.is_empty(), counter) {
            (true, true) => self.metric.encode_counter::<Labels, _, f64>(&v, None),
            (true, false) => self.metric.encode_gauge(&v),
            (false, true) => self
                .metric
                .encode_family(labels)?
                .encode_counter::<Labels, _, f64>(&v, None),
            (false, false) => self.metric.encode_family(labels)?.encode_gauge(&v),
        }
    }
}

/// Families of one sample each, all with `labels`: (name, kind, help, value).
fn singles<const N: usize>(
    e: &mut DescriptorEncoder<'_>,
    labels: &Labels,
    table: [(&str, MetricType, &str, u64); N],
) -> std::fmt::Result {
    for (name, kind, help, value) in table {
        family(e, name, help, kind)?.sample(labels, value)?;
    }
    Ok(())
}

impl Collector for Figures {
    fn encode(&self, mut e: DescriptorEncoder) -> std::fmt::Result {
        let registry = &*self.0;
        build_info(&mut e)?;
        process(&mut e)?;
        connections(&mut e, registry)?;
        arenas(&mut e, registry)?;
        units(&mut e, registry)?;
        namespaces(&mut e, registry)?;
        rbd(&mut e, registry)?;
        cluster(&mut e, registry)?;
        Ok(())
    }
}

/// `targetd_build_info`: the version and features, always 1.
fn build_info(e: &mut DescriptorEncoder<'_>) -> std::fmt::Result {
    let features: Vec<&str> = [
        ("rbd", cfg!(feature = "rbd")),
        ("rdma", cfg!(feature = "rdma")),
    ]
    .into_iter()
    .filter_map(|(f, on)| on.then_some(f))
    .collect();
    let labels: Labels = vec![
        ("version", env!("CARGO_PKG_VERSION").to_string()),
        ("features", features.join(",")),
    ];
    let mut f = family(
        e,
        "targetd_build_info",
        "the running targetd: its version and features, always 1",
        MetricType::Gauge,
    )?;
    f.sample(&labels, 1u64)
}

/// The `process_*` metrics every Prometheus client library exports (CPU time, memory, file
/// descriptors, threads, start time), from /proc/self, so dashboards made for them work
/// unchanged. What /proc does not give is left out rather than guessed.
fn process(e: &mut DescriptorEncoder<'_>) -> std::fmt::Result {
    use MetricType::{Counter, Gauge};
    let p = ProcessFigures::read();
    let none = Vec::new();
    if let Some(cpu) = p.cpu_seconds {
        family(
            e,
            "process_cpu_seconds_total",
            "user and system CPU time spent, seconds",
            Counter,
        )?
        .sample(&none, cpu)?;
    }
    let gauges = [
        (
            "process_resident_memory_bytes",
            "resident memory size, bytes",
            p.resident_bytes,
        ),
        (
            "process_virtual_memory_bytes",
            "virtual memory size, bytes",
            p.virtual_bytes,
        ),
        ("process_open_fds", "open file descriptors", p.open_fds),
        (
            "process_max_fds",
            "the limit of open file descriptors",
            p.max_fds,
        ),
        ("process_threads", "threads", p.threads),
        (
            "process_start_time_seconds",
            "start time since the Unix epoch, seconds",
            p.start_time_seconds,
        ),
    ];
    for (name, help, value) in gauges {
        if let Some(v) = value {
            family(e, name, help, Gauge)?.sample(&none, v)?;
        }
    }
    Ok(())
}

/// What /proc/self says of this process; `None` for what it could not be read from.
#[derive(Debug, Default, PartialEq)]
struct ProcessFigures {
    cpu_seconds: Option<f64>,
    resident_bytes: Option<u64>,
    virtual_bytes: Option<u64>,
    open_fds: Option<u64>,
    max_fds: Option<u64>,
    threads: Option<u64>,
    start_time_seconds: Option<u64>,
}

/// Clock ticks per second in /proc's times: USER_HZ, 100 on every architecture Linux runs
/// targetd on (the kernel converts to it whatever its own HZ is).
const USER_HZ: f64 = 100.0;

impl ProcessFigures {
    fn read() -> ProcessFigures {
        let read = |p: &str| std::fs::read_to_string(p).ok();
        let mut f = ProcessFigures::parse(
            read("/proc/self/stat").as_deref(),
            read("/proc/self/status").as_deref(),
            read("/proc/self/limits").as_deref(),
            read("/proc/stat").as_deref(),
        );
        f.open_fds = std::fs::read_dir("/proc/self/fd")
            .ok()
            .map(|d| d.count() as u64);
        f
    }

    /// From the texts of /proc/self/stat, /proc/self/status, /proc/self/limits and /proc/stat.
    fn parse(
        stat: Option<&str>,
        status: Option<&str>,
        limits: Option<&str>,
        system: Option<&str>,
    ) -> ProcessFigures {
        // The fields after the command name, which is in parentheses and may hold spaces:
        // state is field 3, utime 14, stime 15, starttime 22 (proc(5)).
        let fields: Vec<&str> = stat
            .and_then(|s| s.rsplit_once(')'))
            .map(|(_, rest)| rest.split_whitespace().collect())
            .unwrap_or_default();
        let field = |n: usize| fields.get(n - 3).and_then(|v| v.parse::<u64>().ok());
        let cpu_seconds = field(14)
            .zip(field(15))
            .map(|(u, s)| (u + s) as f64 / USER_HZ);
        let kib = |name: &str| {
            status?
                .lines()
                .find_map(|l| l.strip_prefix(name))?
                .split_whitespace()
                .next()?
                .parse::<u64>()
                .ok()
        };
        let boot = system.and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("btime "))
                .and_then(|v| v.trim().parse::<u64>().ok())
        });
        let max_fds = limits.and_then(|l| {
            l.lines()
                .find(|l| l.starts_with("Max open files"))?
                .split_whitespace()
                .nth(3)?
                .parse::<u64>()
                .ok()
        });
        ProcessFigures {
            cpu_seconds,
            resident_bytes: kib("VmRSS:").map(|k| k * 1024),
            virtual_bytes: kib("VmSize:").map(|k| k * 1024),
            open_fds: None,
            max_fds,
            threads: kib("Threads:"),
            start_time_seconds: boot
                .zip(field(22))
                .map(|(b, ticks)| b + (ticks as f64 / USER_HZ) as u64),
        }
    }
}

/// Sessions, channels, connections and logins, by transport.
fn connections(e: &mut DescriptorEncoder<'_>, registry: &Registry) -> std::fmt::Result {
    use MetricType::{Counter, Gauge};
    let auth = {
        let auth = crate::lock(&registry.auth);
        (auth.failures, auth.sources())
    };
    let srp = crate::lock(&registry.srp_channels).len();
    singles(
        e,
        &Vec::new(),
        [
            (
                "targetd_sessions",
                Gauge,
                "normal iSCSI sessions logged in",
                registry.sessions.all().len() as u64,
            ),
            (
                "targetd_srp_channels",
                Gauge,
                "SRP channels logged in",
                srp as u64,
            ),
            (
                "targetd_srp_logins_rejected_total",
                Counter,
                "answered SRP_LOGIN_REJ",
                registry.counters.srp_logins_rejected.load(Relaxed),
            ),
            (
                "targetd_srp_immediate_writes_total",
                Counter,
                "SRP writes whose data came in the SRP_CMD",
                registry.counters.srp_immediate_writes.load(Relaxed),
            ),
            (
                "targetd_iser_connections",
                Gauge,
                "iSER connections open on the iSER portals, logged in or not",
                registry.counters.iser_connections.load(Relaxed),
            ),
            (
                "targetd_iser_rdma_reads_total",
                Counter,
                "RDMA READs of solicited write data the iSER portals issued",
                registry.counters.iser_rdma_reads.load(Relaxed),
            ),
            (
                "targetd_iser_rdma_writes_total",
                Counter,
                "RDMA WRITEs of read data the iSER portals issued",
                registry.counters.iser_rdma_writes.load(Relaxed),
            ),
            (
                "targetd_connections",
                Gauge,
                "iSCSI connections open, logged in or not",
                registry.connection_count() as u64,
            ),
            (
                "targetd_connections_refused_total",
                Counter,
                "closed at once: server.max_connections were open",
                registry.counters.connections_refused.load(Relaxed),
            ),
            (
                "targetd_send_timeouts_total",
                Counter,
                "dropped: nothing could be sent for server.send_timeout",
                registry.counters.send_timeouts.load(Relaxed),
            ),
            (
                "targetd_data_out_timeouts_total",
                Counter,
                "dropped: data-out owed and none sent for server.data_out_timeout",
                registry.counters.data_out_timeouts.load(Relaxed),
            ),
            (
                "targetd_park_aborts_total",
                Counter,
                "writes aborted (TASK ABORTED) because their data-out was still owed when an \
                 upgrade's park ran out of time",
                registry.counters.park_aborts.load(Relaxed),
            ),
            (
                "targetd_task_set_full_total",
                Counter,
                "writes answered TASK SET FULL: their connection's share of the arena held \
                 buffers waiting for data-out",
                registry.counters.task_set_full.load(Relaxed),
            ),
            (
                "targetd_auth_failures_total",
                Counter,
                "logins refused for an authentication failure",
                auth.0,
            ),
            (
                "targetd_auth_throttled_sources",
                Gauge,
                "addresses whose logins are slowed by recent failures",
                auth.1 as u64,
            ),
        ],
    )?;
    let mut f = family(
        e,
        "targetd_logins_total",
        "logins answered, by transport and Login Response status",
        Counter,
    )?;
    for (t, transport) in ["tcp", "iser"].iter().enumerate() {
        for (i, status) in iscsi_pdu::pdu::LoginStatus::ALL.iter().enumerate() {
            let n = registry.counters.logins[t][i].load(Relaxed);
            // Success always; a refusal once one happened.
            if n > 0 || i == 0 {
                let labels = vec![
                    ("transport", transport.to_string()),
                    ("status", status.name().to_string()),
                ];
                f.sample(&labels, n)?;
            }
        }
    }
    Ok(())
}

/// Each reactor's buffer arena.
fn arenas(e: &mut DescriptorEncoder<'_>, registry: &Registry) -> std::fmt::Result {
    type Field = fn(&crate::registry::ArenaGauge) -> &std::sync::atomic::AtomicU64;
    let arenas = crate::lock(&registry.counters.arenas).clone();
    let fields: [(&str, &str, Field); 3] = [
        (
            "targetd_arena_bytes",
            "size of a reactor's buffer arena",
            |g| &g.bytes,
        ),
        (
            "targetd_arena_free_bytes",
            "free in a reactor's buffer arena",
            |g| &g.free,
        ),
        (
            "targetd_arena_waiting",
            "allocations waiting for arena slots",
            |g| &g.waiting,
        ),
    ];
    for (name, help, field) in fields {
        let mut f = family(e, name, help, MetricType::Gauge)?;
        for (reactor, g) in arenas.iter().enumerate() {
            f.sample(
                &vec![("reactor", reactor.to_string())],
                field(g).load(Relaxed),
            )?;
        }
    }
    Ok(())
}

/// Per target and unit: the core lock, commands, bytes, errors and latency histograms.
fn units(e: &mut DescriptorEncoder<'_>, registry: &Registry) -> std::fmt::Result {
    let targets = registry.targets();
    let mut f = family(
        e,
        "targetd_target_core_lock_acquisitions_total",
        "times a target's SCSI core lock was taken",
        MetricType::Counter,
    )?;
    for t in &targets {
        f.sample(&vec![("target", t.name.clone())], t.core_acquisitions())?;
    }
    let units: Vec<(Labels, Arc<crate::unit::Lun>)> = targets
        .iter()
        .flat_map(|t| {
            t.lun_list().into_iter().map(|lun| {
                let labels = vec![
                    ("target", t.name.clone()),
                    ("lun", lun.config.lun.to_string()),
                ];
                (labels, lun)
            })
        })
        .collect();
    unit_families(e, "lun", "CHECK CONDITION", &units)
}

/// Per NVM subsystem, the controllers connected; per namespace, what a LUN has (the families
/// `targetd_namespace_*`, labelled by subsystem NQN and NSID).
fn namespaces(e: &mut DescriptorEncoder<'_>, registry: &Registry) -> std::fmt::Result {
    let subsystems = registry.subsystems();
    let mut f = family(
        e,
        "targetd_nvme_controllers",
        "NVMe controllers connected to a subsystem",
        MetricType::Gauge,
    )?;
    for s in &subsystems {
        f.sample(
            &vec![("subsystem", s.nqn.clone())],
            s.controllers().len() as u64,
        )?;
    }
    let units: Vec<(Labels, Arc<crate::unit::Lun>)> = subsystems
        .iter()
        .flat_map(|s| {
            s.namespaces().into_iter().map(|(nsid, unit)| {
                let labels = vec![("subsystem", s.nqn.clone()), ("nsid", nsid.to_string())];
                (labels, unit)
            })
        })
        .collect();
    unit_families(e, "namespace", "an NVMe error status", &units)
}

/// The counters and latency histograms of units (`targetd_{kind}_*`): commands, bytes, the
/// commands that ended in `error` (CHECK CONDITION, or an NVMe error status).
fn unit_families(
    e: &mut DescriptorEncoder<'_>,
    kind: &str,
    error: &str,
    units: &[(Labels, Arc<crate::unit::Lun>)],
) -> std::fmt::Result {
    type Field = fn(&crate::unit::LunStats) -> &std::sync::atomic::AtomicU64;
    let counters: [(&str, String, Field); 6] = [
        (
            "read_commands_total",
            "commands that read blocks".into(),
            |s| &s.read_commands,
        ),
        (
            "write_commands_total",
            "commands that wrote blocks".into(),
            |s| &s.write_commands,
        ),
        ("other_commands_total", "other commands".into(), |s| {
            &s.other_commands
        }),
        ("read_bytes_total", "bytes read".into(), |s| &s.read_bytes),
        ("write_bytes_total", "bytes written".into(), |s| {
            &s.write_bytes
        }),
        (
            "errors_total",
            format!("commands ended with {error}"),
            |s| &s.errors,
        ),
    ];
    for (name, help, field) in counters {
        let name = format!("targetd_{kind}_{name}");
        let mut f = family(e, &name, &help, MetricType::Counter)?;
        for (labels, lun) in units {
            f.sample(labels, field(&lun.stats).load(Relaxed))?;
        }
    }
    latency_histograms(e, kind, units)
}

/// Each unit's read and write latencies (from a command's arrival to its status) as
/// histograms in seconds: buckets from 5 us (a read from memory or the page cache takes
/// well under 50 us) to 5 s, so quantiles (a p99) can be computed.
fn latency_histograms(
    e: &mut DescriptorEncoder<'_>,
    kind: &str,
    units: &[(Labels, Arc<crate::unit::Lun>)],
) -> std::fmt::Result {
    use crate::unit::LATENCY_BOUNDS_US;
    for read in [true, false] {
        let dir = if read { "read" } else { "write" };
        let name = format!("targetd_{kind}_{dir}_latency_seconds");
        let help = format!("{dir} commands by latency, from arrival to status");
        let mut f = family(e, &name, &help, MetricType::Histogram)?;
        for (labels, lun) in units {
            let s = &lun.stats;
            let (buckets, sum) = if read {
                (&s.read_latency_buckets, &s.read_latency_ns)
            } else {
                (&s.write_latency_buckets, &s.write_latency_ns)
            };
            // Each bucket's own count (the encoder sums them); the last is above every bound.
            let counts: Vec<(f64, u64)> = buckets
                .iter()
                .enumerate()
                .map(|(i, b)| {
                    let le = LATENCY_BOUNDS_US
                        .get(i)
                        .map_or(f64::INFINITY, |&us| us as f64 / 1e6);
                    (le, b.load(Relaxed))
                })
                .collect();
            let count = counts.iter().map(|c| c.1).sum();
            let seconds = sum.load(Relaxed) as f64 / 1e9;
            f.metric
                .encode_family(labels)?
                .encode_histogram::<Labels>(seconds, count, &counts, None)?;
        }
    }
    Ok(())
}

/// The figures of each unit whose store runs its operations through a library of its own
/// (an RBD unit: librbd's): in flight now, completed, their summed latency, and those that
/// failed because the cluster did not answer in time or otherwise.
fn rbd(e: &mut DescriptorEncoder<'_>, registry: &Registry) -> std::fmt::Result {
    use MetricType::{Counter, Gauge};
    // Counts as integers (a counter of operations is never 12.0); seconds as decimals.
    enum Number {
        Count(u64),
        Seconds(f64),
    }
    use Number::{Count, Seconds};
    type Field = fn(&StoreFigures) -> Number;
    let mut rows = Vec::new();
    for t in registry.targets() {
        for lun in t.lun_list() {
            if let Some(figures) = lun.storage.figures() {
                let mut labels = vec![
                    ("target", t.name.clone()),
                    ("lun", lun.config.lun.to_string()),
                ];
                labels.extend(figures.labels.iter().cloned());
                rows.push((labels, figures));
            }
        }
    }
    let families: [(&str, MetricType, &str, Field); 5] = [
        (
            "targetd_rbd_in_flight",
            Gauge,
            "operations librbd has not completed",
            |s| Count(s.in_flight),
        ),
        (
            "targetd_rbd_operations_total",
            Counter,
            "operations librbd completed",
            |s| Count(s.completed),
        ),
        (
            "targetd_rbd_latency_seconds_total",
            Counter,
            "sum of librbd operation latencies, seconds",
            |s| Seconds(s.latency_ns as f64 / 1e9),
        ),
        (
            "targetd_rbd_unavailable_total",
            Counter,
            "operations failed retryably: the cluster did not answer within ceph_timeout",
            |s| Count(s.unavailable),
        ),
        (
            "targetd_rbd_errors_total",
            Counter,
            "operations failed otherwise",
            |s| Count(s.errors),
        ),
    ];
    if rows.is_empty() {
        return Ok(());
    }
    for (name, kind, help, field) in families {
        let mut f = family(e, name, help, kind)?;
        for (labels, figures) in &rows {
            match field(figures) {
                Count(n) => f.sample(labels, n)?,
                Seconds(s) => f.sample(labels, s)?,
            }
        }
    }
    Ok(())
}

/// This gateway's view of its cluster (`[cluster]`): who is alive, whether it is fenced, and
/// what its keeper did.
fn cluster(e: &mut DescriptorEncoder<'_>, registry: &Registry) -> std::fmt::Result {
    use MetricType::{Counter, Gauge};
    let Some(k) = &registry.target_env.cluster else {
        return Ok(());
    };
    let membership = k.membership();
    let c = k.counters();
    let labels = vec![("gateway", k.gateway().to_string())];
    singles(
        e,
        &labels,
        [
            (
                "targetd_cluster_gateways",
                Gauge,
                "gateways the cluster lists",
                membership.members.len() as u64,
            ),
            (
                "targetd_cluster_gateways_live",
                Gauge,
                "gateways that answered the last membership question",
                membership.live.len() as u64,
            ),
            (
                "targetd_cluster_fenced",
                Gauge,
                "1 while this gateway has lost its cluster session and serves no shared unit",
                u64::from(k.is_fenced()),
            ),
            (
                "targetd_cluster_reservation_changes_total",
                Counter,
                "changes to shared reservations this gateway decided",
                c.changes,
            ),
            (
                "targetd_cluster_reservation_races_total",
                Counter,
                "compare-and-swap races lost to another gateway (decided again)",
                c.races,
            ),
            (
                "targetd_cluster_unacknowledged_changes_total",
                Counter,
                "changes some gateway did not acknowledge within notify_timeout",
                c.unacknowledged,
            ),
            (
                "targetd_cluster_fenced_gateways_total",
                Counter,
                "gateways this one fenced (blocklisted) for not answering",
                c.fenced,
            ),
            (
                "targetd_cluster_lost_sessions_total",
                Counter,
                "times this gateway lost its own cluster session (was fenced)",
                c.lost_sessions,
            ),
            (
                "targetd_cluster_rejoins_total",
                Counter,
                "times this gateway rejoined the cluster after losing its session",
                c.rejoins,
            ),
        ],
    )?;
    let view = k.view();
    // Each shared target whose definition here differs from the cluster's record.
    let mut f = family(
        e,
        "targetd_cluster_target_definition_differs",
        "1 while this gateway exports a shared target otherwise than the cluster's record of it \
         (access rules, CHAP, units; targetctl cluster names the keys)",
        Gauge,
    )?;
    for t in view["targets"].as_array().into_iter().flatten() {
        let labels = vec![(
            "target",
            t["target"].as_str().unwrap_or_default().to_string(),
        )];
        f.sample(&labels, u64::from(t["definition"] == "differs"))?;
    }
    // Each shared unit's access state through each port group, as its REPORT TARGET PORT
    // GROUPS says: 1 for the state it is in, 0 for the others, so an alert can watch a unit
    // with no active/optimized path.
    let mut f = family(
        e,
        "targetd_cluster_unit_access_state",
        "1 for the ALUA state a shared unit has through a port group (gateway), 0 for the others",
        Gauge,
    )?;
    for u in view["units"].as_array().into_iter().flatten() {
        for g in u["groups"].as_array().into_iter().flatten() {
            for state in [
                "active/optimized",
                "active/non-optimized",
                "standby",
                "unavailable",
            ] {
                let labels = vec![
                    (
                        "target",
                        u["target"].as_str().unwrap_or_default().to_string(),
                    ),
                    ("lun", u["lun"].to_string()),
                    ("port_group", g["port_group"].to_string()),
                    (
                        "gateway",
                        g["gateway"].as_str().unwrap_or_default().to_string(),
                    ),
                    ("state", state.to_string()),
                ];
                f.sample(&labels, u64::from(g["state"] == state))?;
            }
        }
    }
    Ok(())
}

/// How long a client has to send a request's headers; an idle kept-alive connection is
/// closed after as long.
const HEADER_TIMEOUT: Duration = Duration::from_secs(10);

/// Serves the metrics on `listener`: `GET` (or `HEAD`) `/metrics`; 404 for another path, 405
/// for another method. Each connection is its own task, so a slow client holds no other.
pub async fn serve(listener: TcpListener, registry: Arc<Registry>) {
    loop {
        let Ok((stream, _)) = listener.accept().await else {
            continue;
        };
        let registry = registry.clone();
        tokio::spawn(async move {
            let service = hyper::service::service_fn(move |request: Request<_>| {
                let response = answer(&registry, request.method(), request.uri().path());
                async move { Ok::<_, Infallible>(response) }
            });
            let _ = hyper::server::conn::http1::Builder::new()
                .timer(TokioTimer::new())
                .header_read_timeout(HEADER_TIMEOUT)
                .serve_connection(TokioIo::new(stream), service)
                .await;
        });
    }
}

/// The response to one request.
fn answer(registry: &Arc<Registry>, method: &Method, path: &str) -> Response<Full<Bytes>> {
    let (status, body) = match (method, path) {
        (&Method::GET | &Method::HEAD, "/metrics") => (StatusCode::OK, text(registry)),
        (&Method::GET | &Method::HEAD, _) => (
            StatusCode::NOT_FOUND,
            "the metrics are at /metrics\n".to_string(),
        ),
        _ => (StatusCode::METHOD_NOT_ALLOWED, "GET /metrics\n".to_string()),
    };
    let kind = if status == StatusCode::OK {
        "text/plain; version=0.0.4; charset=utf-8"
    } else {
        "text/plain; charset=utf-8"
    };
    let mut response = Response::new(Full::new(Bytes::from(body)));
    *response.status_mut() = status;
    let headers = response.headers_mut();
    headers.insert(header::CONTENT_TYPE, header::HeaderValue::from_static(kind));
    if status == StatusCode::METHOD_NOT_ALLOWED {
        headers.insert(header::ALLOW, header::HeaderValue::from_static("GET, HEAD"));
    }
    response
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn process_figures_come_from_proc() {
        let stat = "4242 (target d) S 1 4242 4242 0 -1 4194560 900 0 0 0 250 50 0 0 20 0 3 0 \
                    123400 1000000 512 18446744073709551615";
        let status = "Name:\ttargetd\nVmSize:\t  204800 kB\nVmRSS:\t   10240 kB\nThreads:\t3\n";
        let limits = "Limit                     Soft Limit           Hard Limit           Units\n\
                      Max open files            1024                 524288               files\n";
        let system = "cpu  1 2 3\nbtime 1790000000\nprocesses 10\n";
        let f = ProcessFigures::parse(Some(stat), Some(status), Some(limits), Some(system));
        assert_eq!(
            f,
            ProcessFigures {
                cpu_seconds: Some(3.0),
                resident_bytes: Some(10 << 20),
                virtual_bytes: Some(200 << 20),
                open_fds: None,
                max_fds: Some(1024),
                threads: Some(3),
                start_time_seconds: Some(1_790_000_000 + 1234),
            }
        );
        assert_eq!(
            ProcessFigures::parse(None, None, None, None),
            ProcessFigures::default()
        );
        // This process's own, read for real.
        let me = ProcessFigures::read();
        assert!(me.open_fds.is_some_and(|n| n >= 3), "{me:?}");
        assert!(me.threads.is_some_and(|n| n >= 1), "{me:?}");
        assert!(me.start_time_seconds.is_some(), "{me:?}");
    }
}
