//! Hostile input against targetd in-process: each case gets a Reject, a login failure or a
//! closed connection, never a panic, and a bystander session on the same reactor keeps
//! working throughout. docs/robustness.md lists the cases and what the target does.

mod common;

use std::sync::atomic::Ordering::Relaxed;
use std::time::Duration;

use bytes::Bytes;
use common::raw::Raw;
use common::{config, memory_target, opts, pattern, Daemon, TARGET};
use initiator_bench::scsi::cdb;
use iscsi_pdu::{Lun, Pdu, ScsiCommand, SerialNumber};

/// One reactor, so every connection of a test shares its arena and engine with the bystander.
fn one_reactor(server: &str) -> String {
    config("", &memory_target(TARGET, "")).replace(
        "reactors = 2\nnop_interval = 0",
        &format!("reactors = 1\nnop_interval = 0\n{server}"),
    )
}

/// A READ(10) of `blocks` 512-byte blocks at `lba`.
fn read(itt: u32, cmd_sn: u32, lba: u32, blocks: u16) -> Pdu {
    Pdu::ScsiCommand(ScsiCommand {
        final_bit: true,
        read: true,
        lun: Lun::ZERO,
        initiator_task_tag: itt,
        expected_data_transfer_length: u32::from(blocks) * 512,
        cmd_sn: SerialNumber(cmd_sn),
        cdb: cdb::read(u64::from(lba), u32::from(blocks)),
        ..ScsiCommand::default()
    })
}

/// Logs in and sends 128 READs of 1 MiB (twice the reactor's 64 MiB arena), reading nothing.
async fn stall(d: &Daemon) -> Raw {
    let mut stalled = Raw::login(d, [0x80, 0, 0, 0, 0, 1], 0).await.unwrap();
    for i in 0..128u32 {
        stalled.send(read(i + 1, 1 + i, 0, 2048)).await;
    }
    stalled
}

/// An initiator that stops reading Data-In holds at most half its reactor's arena (the
/// connection's share): a bystander on the same reactor gets its 1 MiB reads done while the
/// stalled connection is still open (`send_timeout` is an hour here).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_initiator_that_stops_reading_data_in_holds_a_bounded_share() {
    let d = Daemon::start(&one_reactor("send_timeout = 3600"));
    let bystander = d.session(opts()).await;
    let data = pattern(1 << 20, 3);
    bystander.write(0, data.clone(), 512).await.unwrap();
    let _stalled = stall(&d).await;
    // Wait until it holds what it can (the arena reports every second).
    let arena = d.registry.arenas.lock().unwrap()[0].clone();
    let started = std::time::Instant::now();
    while arena.free.load(Relaxed) > (33 << 20) {
        assert!(started.elapsed() < Duration::from_secs(20), "{arena:?}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    for _ in 0..16 {
        let got = tokio::time::timeout(Duration::from_secs(10), bystander.read(0, 2048, 512))
            .await
            .expect("a bystander's read waited for the stalled connection")
            .unwrap();
        assert!(got == data);
    }
    assert_eq!(d.registry.sessions.all().len(), 2, "both sessions are open");
}

/// Once nothing could be sent to it for `send_timeout`, the stalled connection is dropped and
/// counted, and what it held goes back: the bystander reads the whole arena's worth again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_initiator_that_stops_reading_is_dropped_after_the_send_timeout() {
    let d = Daemon::start(&one_reactor("send_timeout = 1"));
    let bystander = d.session(opts()).await;
    let stalled = stall(&d).await;
    let started = std::time::Instant::now();
    while d.registry.sessions.all().len() > 1 {
        assert!(
            started.elapsed() < Duration::from_secs(20),
            "the stalled connection is still open"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    drop(stalled);
    let metrics = targetd::admin::metrics_text(&d.registry);
    assert!(
        metrics.contains("targetd_send_timeouts_total 1\n"),
        "{metrics}"
    );
    // 32 MiB reads need whole halves of the arena: nothing of the stalled connection is left.
    for _ in 0..2 {
        let _: Bytes = bystander.read(0, 65536, 512).await.unwrap();
    }
}
