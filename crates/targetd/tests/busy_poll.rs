//! `server.busy_poll`: reactors that keep polling after their connections last did something
//! serve iSCSI and NVMe/TCP as sleeping ones do, spin while I/O goes on, and sleep again once
//! the window has passed with nothing to do (an idle daemon burns no core).
//!
//! The only test of its binary: the reactor threads it reads the CPU time of are this
//! daemon's alone.

mod common;

use std::time::Duration;

use common::{memory_target, opts, pattern, Daemon, TARGET};
use initiator_bench::nvme::{NvmeController, NvmeOptions, NvmeUrl};

const NQN: &str = "nqn.2026-11.io.example:spin";

/// CPU seconds the daemon's reactor threads have used so far.
fn reactor_cpu() -> f64 {
    let mut ticks = 0u64;
    for task in std::fs::read_dir("/proc/self/task").unwrap() {
        let dir = task.unwrap().path();
        let comm = std::fs::read_to_string(dir.join("comm")).unwrap_or_default();
        if !comm.starts_with("reactor-") {
            continue;
        }
        let stat = std::fs::read_to_string(dir.join("stat")).unwrap_or_default();
        // After the command name's closing parenthesis: state is field 3, utime 14, stime 15.
        let fields: Vec<&str> = stat
            .rsplit_once(')')
            .map_or("", |s| s.1)
            .split_whitespace()
            .collect();
        if fields.len() > 12 {
            ticks += fields[11].parse::<u64>().unwrap() + fields[12].parse::<u64>().unwrap();
        }
    }
    // In USER_HZ: 100 per second on Linux.
    ticks as f64 / 100.0
}

/// The reactors' CPU over `span` of wall time.
async fn cpu_over(span: Duration) -> f64 {
    let before = reactor_cpu();
    tokio::time::sleep(span).await;
    reactor_cpu() - before
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn busy_polling_reactors_serve_spin_while_busy_and_sleep_when_idle() {
    let text = format!(
        "[server]\nportals = [\"127.0.0.1:0\"]\nnvme_portals = [\"127.0.0.1:0\"]\n\
         admin_socket = \"@SOCKET@\"\nreactors = 1\nnop_interval = 0\nbusy_poll = \"1s\"\n\n\
         {}\n[[subsystems]]\nnqn = \"{NQN}\"\n[[subsystems.namespaces]]\nnsid = 1\n\
         backend = \"memory\"\nsize = \"16MiB\"\n",
        memory_target(TARGET, "")
    );
    let nvme = std::sync::Mutex::new(None);
    let d = Daemon::start_with(&text, |s| *nvme.lock().unwrap() = Some(s.nvme_portals()[0]));
    let nvme_addr = nvme.into_inner().unwrap().expect("an NVMe/TCP portal");

    // `targetctl status` says so with the engine.
    let engine = d.registry.engine.lock().unwrap().clone();
    assert!(engine.ends_with(", busy polling 1s"), "{engine}");

    // Nothing connected yet: the reactor sleeps.
    let idle = cpu_over(Duration::from_millis(500)).await;
    assert!(
        idle < 0.1,
        "an idle reactor used {idle:.2} s of CPU in 0.5 s"
    );

    // iSCSI reads and writes, verified, one at a time (the latency-bound case).
    let s = d.session(opts()).await;
    for i in 0..200u64 {
        let data = pattern(4096, i as usize);
        s.write(i * 8, data.clone(), 512).await.unwrap();
        assert_eq!(s.read(i * 8, 8, 512).await.unwrap(), data, "block {i}");
    }
    // Just after the last request, inside the window: the reactor keeps polling.
    let spinning = cpu_over(Duration::from_millis(400)).await;
    assert!(
        spinning > 0.1,
        "within busy_poll's window the reactor polls: {spinning:.2} s of CPU in 0.4 s"
    );

    // NVMe/TCP, the same way.
    let url = NvmeUrl::parse(&format!("nvme://{nvme_addr}/{NQN}/1")).unwrap();
    let c = NvmeController::connect(&url, &NvmeOptions::default())
        .await
        .expect("connect");
    for i in 0..200u64 {
        let data = pattern(4096, 1000 + i as usize);
        c.write(i * 8, data.clone()).await.unwrap();
        assert_eq!(c.read(i * 8, 8).await.unwrap(), data, "NVMe block {i}");
    }

    // Past the window with nothing to do (the iSCSI session open and silent: no NOP-In; the
    // NVMe/TCP host, whose Keep Alive would be activity, gone): the reactor sleeps again.
    drop(c);
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let after = cpu_over(Duration::from_millis(500)).await;
    assert!(
        after < 0.1,
        "an idle busy-polling reactor must sleep: {after:.2} s of CPU in 0.5 s"
    );
    s.logout().await.unwrap();
    d.stop();
}
