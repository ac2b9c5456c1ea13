//! `targetctl trace start` / `stop` through the admin socket: the daemon records every
//! command's stages on its reactors and writes one trace file whose records follow each
//! command from its arrival to its response, keyed by the session's TSIH and the ITT.

mod common;

use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::time::Duration;

use cmdtrace::{Record, Side, Stage, TraceFile};
use common::{config, memory_target, opts, pattern, Daemon, TARGET};
use serde_json::{json, Value};

/// Tracing is on or off for the whole process (one daemon per process in production): the
/// tests here take turns.
static ONE_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// One admin request: its result, or the daemon's error.
fn admin(d: &Daemon, req: Value) -> Result<Value, String> {
    let mut s = UnixStream::connect(d.socket()).expect("the admin socket");
    let mut line = serde_json::to_vec(&req).expect("json");
    line.push(b'\n');
    s.write_all(&line).expect("sent");
    let mut answer = String::new();
    BufReader::new(&s).read_line(&mut answer).expect("answered");
    let a: Value = serde_json::from_str(&answer).expect("json answer");
    if a["ok"] == true {
        Ok(a["result"].clone())
    } else {
        Err(a["error"].as_str().unwrap_or_default().to_string())
    }
}

fn read_trace(path: &std::path::Path) -> TraceFile {
    let mut f = std::fs::File::open(path).expect("the trace file");
    TraceFile::read_from(&mut f).expect("a trace")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_trace_follows_every_command_from_arrival_to_response() {
    let _turn = ONE_AT_A_TIME.lock().await;
    let d = Daemon::start(&config("", &memory_target(TARGET, "")));
    let out = d.dir.path().join("target.trace");
    assert!(
        admin(&d, json!({"command": "trace-stop"})).is_err_and(|e| e.contains("no trace")),
        "nothing to stop"
    );
    let relative = admin(&d, json!({"command": "trace-start", "out": "t.trace"}));
    assert!(relative.is_err_and(|e| e.contains("absolute")));
    admin(&d, json!({"command": "trace-start", "out": out})).expect("started");
    let again = admin(&d, json!({"command": "trace-start", "out": out}));
    assert!(again.is_err_and(|e| e.contains("running already")));
    let s = d.session(opts()).await;
    let (_, bs) = s.capacity().await.expect("capacity");
    for k in 0..16u64 {
        s.write(k * 8, pattern(4096, k as usize), bs)
            .await
            .expect("write");
        s.read(k * 8, 8, bs).await.expect("read");
    }
    let tsih = s.info().tsih;
    s.logout().await.expect("logout");
    let stopped = admin(&d, json!({"command": "trace-stop"})).expect("stopped");
    let t = read_trace(&out);
    assert_eq!(t.side, Side::Target);
    assert_eq!(t.dropped, 0);
    assert_eq!(stopped["records"], t.records.len());
    // Each command's points, of this session only: from its arrival to its status written.
    let mine: Vec<&Record> = t
        .records
        .iter()
        .filter(|r| r.session & 0xffff == u64::from(tsih))
        .collect();
    let lives: Vec<_> = initiator_bench::trace::commands(&t.records)
        .into_iter()
        .filter(|c| c.session & 0xffff == u64::from(tsih))
        .collect();
    assert!(
        lives.len() >= 33,
        "a capacity, 16 writes and 16 reads: {}",
        lives.len()
    );
    for c in &lives {
        let stages: Vec<Stage> = c.stages.iter().map(|s| s.0).collect();
        let itt = c.itt;
        assert_eq!(
            stages.first(),
            Some(&Stage::Received),
            "ITT {itt:#x}: {stages:?}"
        );
        assert!(
            stages.contains(&Stage::Dispatched),
            "ITT {itt:#x}: {stages:?}"
        );
        assert!(
            stages.contains(&Stage::Responded),
            "ITT {itt:#x}: {stages:?}"
        );
        assert_eq!(
            stages.last(),
            Some(&Stage::StatusSent),
            "ITT {itt:#x}: {stages:?}"
        );
    }
    // Every record of the session belongs to one of them (none lost at the start).
    let counted: usize = lives.iter().map(|c| c.stages.len()).sum();
    assert_eq!(counted, mine.len());
    assert!(
        mine.windows(2).all(|w| w[0].at_ns <= w[1].at_ns),
        "in time order"
    );
    assert!(mine
        .iter()
        .any(|r| r.stage == Stage::Received && r.arg == 4096));
    // Off again: commands now leave no record.
    let s = d.session(opts()).await;
    s.read(0, 8, bs).await.expect("read");
    s.logout().await.expect("logout");
    assert!(admin(&d, json!({"command": "trace-stop"})).is_err());
    d.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_trace_with_a_duration_stops_by_itself() {
    let _turn = ONE_AT_A_TIME.lock().await;
    let d = Daemon::start(&config("", &memory_target(TARGET, "")));
    let out = d.dir.path().join("timed.trace");
    admin(
        &d,
        json!({"command": "trace-start", "out": out, "duration_seconds": 0.5}),
    )
    .expect("started");
    let s = d.session(opts()).await;
    s.read(0, 8, 512).await.expect("read");
    tokio::time::sleep(Duration::from_millis(1500)).await;
    // It stopped by itself: the stop that follows says what it wrote, once.
    let said = admin(&d, json!({"command": "trace-stop"})).expect("what the trace wrote");
    assert_eq!(said["stopped"], "at its duration", "{said}");
    assert!(said["records"].as_u64().is_some_and(|n| n > 0), "{said}");
    assert!(
        admin(&d, json!({"command": "trace-stop"})).is_err_and(|e| e.contains("no trace")),
        "nothing runs"
    );
    let t = read_trace(&out);
    assert!(t.records.iter().any(|r| r.stage == Stage::Responded));
    s.logout().await.expect("logout");
    d.stop();
}

/// Runs `w` against `d`'s target through a proxy with `delay` each way, tracing both sides;
/// the report of the two traces and the run's IOPS.
async fn traced_run(
    d: &Daemon,
    delay: Duration,
    w: initiator_bench::workload::Workload,
) -> (initiator_bench::trace::Report, f64) {
    use initiator_bench::proxy::{Link, Proxy};
    let proxy = Proxy::start(
        "127.0.0.1:0",
        &d.addr.to_string(),
        Link {
            delay,
            rate_bps: None,
        },
    )
    .await
    .expect("a proxy");
    let url = initiator_bench::IscsiUrl::parse(&format!("iscsi://{}/{TARGET}/0", proxy.local_addr))
        .expect("url");
    let out = d.dir.path().join("diagnosis.trace");
    admin(d, json!({"command": "trace-start", "out": out})).expect("started");
    let w = initiator_bench::workload::Workload { trace: true, ..w };
    let r = initiator_bench::workload::run(&url, &opts(), &w, Default::default())
        .await
        .expect("the run");
    admin(d, json!({"command": "trace-stop"})).expect("stopped");
    let target = read_trace(&out);
    let initiator = TraceFile {
        side: Side::Initiator,
        offset_ns: 0,
        dropped: 0,
        records: r.trace.clone(),
    };
    (
        initiator_bench::trace::report(&target, Some(&initiator), false),
        r.iops,
    )
}

/// Paper 000 through the product: over a 16 ms link, reads at queue depth 2 are capped by the
/// initiator's queue depth, which the report says; at 64 the target's window is not what caps
/// them and throughput scales; against a target whose window is 4, the report names the
/// target's command window.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_report_names_where_concurrency_stops() {
    use initiator_bench::workload::{Rw, Workload};
    let _turn = ONE_AT_A_TIME.lock().await;
    let reads = |qd: usize| Workload {
        rw: Rw::Read,
        bs: 512,
        qd,
        time: Duration::from_secs(2),
        ..Workload::default()
    };
    let d = Daemon::start(&config("", &memory_target(TARGET, "")));
    let delay = Duration::from_millis(16);
    let (qd2, iops2) = traced_run(&d, delay, reads(2)).await;
    assert!(
        qd2.diagnosis[0].contains("the cap is the initiator's queue depth")
            && qd2.diagnosis[0].contains("never has more than 2 commands"),
        "{:?}",
        qd2.diagnosis
    );
    // One host, one clock: the NOP round trips (through the same 16 ms each way) find an
    // offset near zero, within half the round trip they bound it by.
    let (clock, _) = qd2.clock.expect("NOPs in both traces");
    assert!(clock.samples >= 8, "{clock:?}");
    // Near zero against a 32 ms round trip; a loaded 2-core runner stretches the samples, so
    // the bound is a sixth of that round trip, not a tight one.
    assert!(clock.offset_ns.unsigned_abs() < 5_000_000, "{clock:?}");
    assert!(clock.offset_ns.unsigned_abs() <= clock.round_trip_ns / 2);
    let (qd64, iops64) = traced_run(&d, delay, reads(64)).await;
    assert!(
        !qd64.diagnosis.iter().any(|l| l.contains("command window")),
        "{:?}",
        qd64.diagnosis
    );
    assert!(
        // 32 times the streams over the same link; at least 10 times the rate even when
        // the runner is busy (a cap would hold it near 1).
        iops64 > 10.0 * iops2,
        "64 streams over the link scale: {iops64:.0} against {iops2:.0} IOPS"
    );
    d.stop();
    let d = Daemon::start(&config("cmdsn_window = 4", &memory_target(TARGET, "")));
    // The same 16 ms link, over which the window, not the initiator, holds commands back
    // however busy the runner is. (Under load the initiator's waiters are woken unevenly and
    // about half the commands never wait; the report's time-weighted share of waiting
    // commands still names the window, where the median wait read zero.)
    let (w4, _) = traced_run(&d, delay, reads(16)).await;
    let most = w4.diagnosis[0]
        .split("never had more than ")
        .nth(1)
        .and_then(|rest| rest.split(' ').next())
        .and_then(|n| n.parse::<u32>().ok());
    assert!(
        w4.diagnosis[0].contains("the cap is the target's command window")
            && most.is_some_and(|n| (1..=4).contains(&n)),
        "the window of 4 holds the target to 4 commands at most: {:?}",
        w4.diagnosis
    );
    d.stop();
}

/// SRP channels are traced as iSCSI connections are: each command from its SRP_CMD to its
/// response, keyed by the initiator port.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn srp_commands_are_traced_too() {
    use initiator_bench::srp::{login_request, run_channels, LinkModel, RdmaOptions};
    use initiator_bench::workload::{Rw, Workload};
    let _turn = ONE_AT_A_TIME.lock().await;
    let (switch, d) = common::srp_daemon();
    let out = d.dir.path().join("srp.trace");
    admin(&d, json!({"command": "trace-start", "out": out})).expect("started");
    let w = Workload {
        rw: Rw::Randrw,
        bs: 4096,
        qd: 4,
        ios: Some(200),
        size: Some(1 << 20),
        ..Workload::default()
    };
    let o = RdmaOptions {
        registration: srp::initiator::Registration::Pool,
        regions: 1,
        link: LinkModel::Free,
        immediate_data: true,
    };
    let r = tokio::task::spawn_blocking(move || {
        let (mut verbs, ch) = common::srp_channel(&switch, 3, &w, &o);
        let mut channels = [ch];
        run_channels(&mut verbs, &mut channels, 0, &w, &o).expect("the run")
    })
    .await
    .expect("the initiator's thread");
    assert_eq!(r.errors, 0);
    admin(&d, json!({"command": "trace-stop"})).expect("stopped");
    let t = read_trace(&out);
    let port = login_request(3, [0; 16], 0).initiator_port_id;
    let session = Record::session_of_port(port);
    let lives: Vec<_> = initiator_bench::trace::commands(&t.records)
        .into_iter()
        .filter(|c| c.session == session && c.ended())
        .collect();
    assert!(lives.len() >= 200, "{} SRP commands traced", lives.len());
    assert!(lives
        .iter()
        .all(|c| c.at(Stage::BackendSubmit).is_some() || c.len == 0));
    d.stop();
}

/// A trace whose rings fill keeps the start of the run, counts the rest as dropped, and says
/// so in its answer; the ring's size is the caller's, within bounds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_small_ring_fills_and_the_loss_is_counted() {
    let _turn = ONE_AT_A_TIME.lock().await;
    let d = Daemon::start(&config("", &memory_target(TARGET, "")));
    let out = d.dir.path().join("small.trace");
    let refused = admin(
        &d,
        json!({"command": "trace-start", "out": out, "records_per_reactor": 10}),
    );
    assert!(
        refused.is_err_and(|e| e.contains("outside 1024")),
        "too small a ring is refused"
    );
    let started = admin(
        &d,
        json!({"command": "trace-start", "out": out, "records_per_reactor": 1024}),
    )
    .expect("started");
    assert_eq!(started["records_per_reactor"], 1024);
    let s = d.session(opts()).await;
    // Each read leaves several records; 600 of them cannot fit 1024 per reactor.
    for i in 0..600 {
        s.read(i % 64 * 8, 8, 512).await.expect("read");
    }
    let stopped = admin(&d, json!({"command": "trace-stop"})).expect("stopped");
    let (records, dropped) = (
        stopped["records"].as_u64().unwrap(),
        stopped["dropped"].as_u64().unwrap(),
    );
    assert!(records <= 2 * 1024, "{stopped}");
    assert!(dropped > 0, "{stopped}");
    let t = read_trace(&out);
    assert_eq!(t.dropped, dropped, "the file counts the loss too");
    s.logout().await.expect("logout");
    d.stop();
}

/// NVMe/TCP commands are traced on both sides, keyed by subsystem, controller and queue, with
/// the CID for the ITT: the report joins each of the host's commands to the target's, and
/// Keep Alives on the admin queue date the clocks as NOPs do.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nvme_commands_are_traced_on_both_sides() {
    use initiator_bench::nvme::{NvmeOptions, NvmeUrl};
    use initiator_bench::workload::{Rw, Workload};
    let _turn = ONE_AT_A_TIME.lock().await;
    const NQN: &str = "nqn.2026-11.io.example:traced";
    let text = format!(
        "[server]\nportals = [\"127.0.0.1:0\"]\nnvme_portals = [\"127.0.0.1:0\"]\n\
         admin_socket = \"@SOCKET@\"\nreactors = 1\n\n\
         [[subsystems]]\nnqn = \"{NQN}\"\n\n\
         [[subsystems.namespaces]]\nnsid = 1\nbackend = \"memory\"\nsize = \"16MiB\"\n"
    );
    let portal = std::sync::Mutex::new(None);
    let d = Daemon::start_with(&text, |s| {
        *portal.lock().unwrap() = Some(s.nvme_portals()[0])
    });
    let portal = portal.into_inner().unwrap().expect("an NVMe/TCP portal");
    let url = NvmeUrl::parse(&format!("nvme://{portal}/{NQN}/1")).expect("url");
    let out = d.dir.path().join("nvme.trace");
    admin(&d, json!({"command": "trace-start", "out": out})).expect("started");
    let w = Workload {
        rw: Rw::Randrw,
        bs: 16384,
        qd: 4,
        ios: Some(300),
        size: Some(1 << 20),
        trace: true,
        ..Workload::default()
    };
    let r = initiator_bench::workload::run_nvme(
        std::slice::from_ref(&url),
        &NvmeOptions::default(),
        &w,
        Default::default(),
    )
    .await
    .expect("the run");
    assert_eq!(r.errors, 0);
    admin(&d, json!({"command": "trace-stop"})).expect("stopped");
    let target = read_trace(&out);
    // The I/O queue's session: this subsystem, the first controller, queue 1.
    let session = Record::session_of_queue(NQN, 1, 1);
    let lives: Vec<_> = initiator_bench::trace::commands(&target.records)
        .into_iter()
        .filter(|c| c.session == session && c.ended())
        .collect();
    assert!(
        lives.len() >= 300,
        "{} NVMe/TCP commands traced",
        lives.len()
    );
    for c in &lives {
        let stages: Vec<Stage> = c.stages.iter().map(|s| s.0).collect();
        for s in [Stage::BufferWait, Stage::BackendSubmit, Stage::BackendDone] {
            assert!(stages.contains(&s), "CID {}: {stages:?}", c.itt);
        }
        assert_eq!(
            stages.last(),
            Some(&Stage::StatusSent),
            "CID {}: {stages:?}",
            c.itt
        );
        if stages.contains(&Stage::R2tSent) {
            assert!(
                stages.contains(&Stage::DataOutDone),
                "CID {}: {stages:?}",
                c.itt
            );
        }
    }
    assert!(
        lives.iter().any(|c| c.at(Stage::DataInSent).is_some()),
        "reads sent data"
    );
    assert!(
        lives.iter().any(|c| c.at(Stage::R2tSent).is_some()),
        "16 KiB writes (more than in a capsule) take an R2T"
    );
    let initiator = TraceFile {
        side: Side::Initiator,
        offset_ns: 0,
        dropped: 0,
        records: r.trace.clone(),
    };
    assert!(initiator
        .records
        .iter()
        .all(|r| r.session >> 16 == session >> 16));
    let report = initiator_bench::trace::report(&target, Some(&initiator), false);
    let (clock, _) = report.clock.expect("Keep Alives in both traces");
    assert!(clock.samples >= 8, "{clock:?}");
    let side = report.initiator.expect("the host's side");
    assert!(side.commands >= 300, "{}", side.commands);
    let joined = side
        .spans
        .iter()
        .find(|(name, _)| *name == "sent to arrival at the target")
        .and_then(|(_, p)| p.as_ref())
        .expect("commands joined across the two sides");
    assert!(joined.count >= 300, "{joined:?}");
    d.stop();
}
