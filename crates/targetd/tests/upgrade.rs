//! The running process's half of an upgrade that keeps sessions: iSCSI sessions parked for a
//! handover (every connection stopped between two PDUs, its tasks over) report states that
//! the successor's decoder accepts, and serve on where they stopped when the handover is
//! withdrawn; a write whose initiator owes its data at the park's deadline is aborted; a
//! session waiting for a CmdSN cannot park, and the park gives up without harm.

mod common;

use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use common::program::{
    finish, goes_on, load, load_nvme, nvme_server, running, terminate, Program, TwoSessions,
};
use common::raw::{data_out, read, write, Raw};
use common::{config, keys, memory_target, opts, pattern, pr_out, Daemon, TARGET};
use initiator_bench::scsi::{cdb, Command};
use initiator_bench::LoginOptions;
use iscsi_pdu::handover::SessionState;
use iscsi_pdu::negotiation::DigestAlgorithm;
use iscsi_pdu::{Digests, Pdu, ScsiStatus};
use std::os::unix::net::UnixStream;
use targetd::handover::{
    borrowed, encode_units, receive_handover, send_frame, send_handover, Handover, ReceiveError,
};
use targetd::iscsi::handover::{park_sessions, AdoptError, ParkError};

/// Writers and readers on a session with digests go on across three parks that are
/// withdrawn: while parked no command is answered; each park reports the session's TSIH, its
/// connection with its digests, and a state that encodes and decodes to itself; every block
/// written is read back, and the session never logs in again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn parked_sessions_report_their_state_and_serve_on_when_withdrawn() {
    let d = Daemon::start(&config("", &memory_target(TARGET, "")));
    let mut o = opts();
    o.settings.header_digest = vec![DigestAlgorithm::Crc32c];
    o.settings.data_digest = vec![DigestAlgorithm::Crc32c];
    let s = Arc::new(d.session(o).await);
    let _ = s.capacity().await;
    let (stop, done, workers) = load(&s);
    let tsih = s.info().tsih;
    for _ in 0..3 {
        tokio::time::sleep(Duration::from_millis(100)).await;
        let started = std::time::Instant::now();
        let parked = park_sessions(&d.registry, Duration::from_secs(10))
            .await
            .expect("parked");
        println!("the MC/S session parked in {:?}", started.elapsed());
        assert_eq!(parked.sessions.len(), 1);
        let (state, sockets) = &parked.sessions[0];
        assert_eq!(state.tsih, tsih);
        assert_eq!((state.connections.len(), sockets.len()), (1, 1));
        let c = &state.connections[0];
        assert!(c.params.header_digest && c.params.data_digest, "{c:?}");
        assert_eq!(SessionState::decode(&state.encode()).as_ref(), Ok(state));
        // Answers sent before the park may still be on their way to the workers.
        tokio::time::sleep(Duration::from_millis(100)).await;
        let before = done.load(Relaxed);
        tokio::time::sleep(Duration::from_millis(200)).await;
        assert_eq!(
            done.load(Relaxed),
            before,
            "a command was served while parked"
        );
        drop(parked);
    }
    tokio::time::sleep(Duration::from_millis(100)).await;
    stop.store(true, Relaxed);
    for w in workers {
        w.await.expect("a worker failed");
    }
    assert!(done.load(Relaxed) > 0);
    assert_eq!(s.info().tsih, tsih, "the session logged in again");
    d.stop();
}

/// A session of two connections (MC/S) with writers and readers running parks: its window
/// is held while it parks, so that both connections stop where the initiator had to stop
/// sending; both are reported under the one TSIH, and the I/O goes on when the park is
/// withdrawn (the window announced again).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn both_connections_of_a_loaded_session_park() {
    let d = Daemon::start(&config("", &memory_target(TARGET, "")));
    let mut o = opts();
    o.connections = 2;
    o.settings.operational.max_connections = 2;
    let s = Arc::new(d.session(o).await);
    assert_eq!(s.info().connections, 2);
    let _ = s.capacity().await;
    let (stop, done, workers) = load(&s);
    for _ in 0..3 {
        tokio::time::sleep(Duration::from_millis(100)).await;
        let parked = park_sessions(&d.registry, Duration::from_secs(10))
            .await
            .expect("parked");
        let (state, sockets) = &parked.sessions[0];
        assert_eq!(state.tsih, s.info().tsih);
        assert_eq!((state.connections.len(), sockets.len()), (2, 2));
        drop(parked);
    }
    let before = done.load(Relaxed);
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(done.load(Relaxed) > before, "the I/O did not go on");
    stop.store(true, Relaxed);
    for w in workers {
        w.await.expect("a worker failed");
    }
    d.stop();
}

/// The in-process half of an upgrade: a session with digests, writers and readers running,
/// is parked in one server and taken in by another serving the same file LUN (as a new
/// binary would), then let go by the first: the I/O goes on over the same TCP connection
/// under the same TSIH without a new login, every block reads back, and the first server's
/// stop does not touch the session.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_session_taken_in_by_another_server_goes_on_on_its_socket() {
    let dir = tempfile::tempdir().unwrap();
    let targets = format!(
        "[[targets]]\nname = \"{TARGET}\"\n\n[[targets.luns]]\nlun = 0\nbackend = \"file\"\n\
         path = \"{}\"\nsize = \"64MiB\"\n",
        dir.path().join("disk.img").display()
    );
    let a = Daemon::start(&config("", &targets));
    let mut o = opts();
    o.settings.header_digest = vec![DigestAlgorithm::Crc32c];
    o.settings.data_digest = vec![DigestAlgorithm::Crc32c];
    let s = Arc::new(a.session(o).await);
    let _ = s.capacity().await;
    let tsih = s.info().tsih;
    // A persistent reservation (Write Exclusive) the session holds through the first server.
    for (action, kind, key, new_key) in [(0x00, 0, 0, 0xa1), (0x01, 1, 0xa1, 0)] {
        let cmd = pr_out(s.lun(), action, kind, key, new_key, false);
        assert_eq!(
            s.execute(cmd).await.expect("PR OUT").status,
            ScsiStatus::GOOD
        );
    }
    let (stop, done, workers) = load(&s);
    tokio::time::sleep(Duration::from_millis(200)).await;
    let started = std::time::Instant::now();
    let mut parked = park_sessions(&a.registry, Duration::from_secs(10))
        .await
        .expect("parked");
    let park = started.elapsed();
    // As between two processes: each session's state encoded, with its sockets, over a
    // UNIX socket; decoded and checked on the other end.
    let handover = Handover {
        units: std::mem::take(&mut parked.units),
        sessions: std::mem::take(&mut parked.sessions),
        ..Handover::default()
    };
    let (old_end, new_end) = UnixStream::pair().unwrap();
    let sent = std::thread::spawn(move || send_handover(&old_end, &handover));
    let received = receive_handover(&new_end).expect("the sessions received");
    sent.join().unwrap().expect("the sessions sent");
    let adopted = std::sync::Mutex::new(None);
    let b = Daemon::start_with(&config("", &targets), |server| {
        *adopted.lock().unwrap() = Some(server.adopt_sessions(received));
    });
    let adopted = adopted.into_inner().unwrap().unwrap().expect("adopted");
    assert_eq!(adopted.tsihs, [tsih]);
    // Nothing is served by the second server before the first let go.
    let parked_done = done.load(Relaxed);
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(
        done.load(Relaxed),
        parked_done,
        "served before the first let go"
    );
    parked.release();
    adopted.serve();
    let before = done.load(Relaxed);
    while done.load(Relaxed) == before && started.elapsed() < Duration::from_secs(10) {
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    println!(
        "handover: parked in {park:?}, the next I/O done {:?} after the park began \
         (a second server started in between)",
        started.elapsed()
    );
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(
        done.load(Relaxed) > before,
        "no I/O went on after the handover"
    );
    assert!(
        a.registry.sessions.all().is_empty(),
        "the first server kept it"
    );
    assert_eq!(b.registry.sessions.all().len(), 1);
    // The reservation came along: another initiator logging in to the second server may not
    // write, and the holder's key is there.
    let other = b
        .session(LoginOptions {
            initiator_name: "iqn.2026-11.io.example:other".into(),
            ..opts()
        })
        .await;
    let tur = Command::new(other.lun(), cdb::test_unit_ready());
    let _ = other.execute_past_unit_attentions(tur).await;
    let write = Command::write(other.lun(), cdb::write(4000, 1), pattern(512, 1));
    let status = other.execute(write).await.expect("a response").status;
    assert_eq!(status, ScsiStatus::RESERVATION_CONFLICT);
    assert_eq!(keys(&s).await, [0xa1]);
    a.stop();
    tokio::time::sleep(Duration::from_millis(300)).await;
    stop.store(true, Relaxed);
    for w in workers {
        w.await.expect("a worker failed");
    }
    assert_eq!(s.info().tsih, tsih, "the session logged in again");
    // Every worker's last block, written through either server, reads back through B.
    let data = pattern(8192, 77);
    s.write(2048, data.clone(), 512).await.expect("write after");
    assert!(s.read(2048, 16, 512).await.expect("read after") == data);
    b.stop();
}

/// A successor that cannot take the sessions in leaves the first server serving them: a
/// state altered on its way is refused before anything is adopted, and so is a session of a
/// target the successor does not serve; the parked session then goes on where it was, same
/// TSIH, its I/O verified, and the successor serves nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_successor_that_refuses_leaves_the_first_server_serving() {
    let a = Daemon::start(&config("", &memory_target(TARGET, "")));
    let s = Arc::new(a.session(opts()).await);
    let _ = s.capacity().await;
    let tsih = s.info().tsih;
    let (stop, done, workers) = load(&s);
    tokio::time::sleep(Duration::from_millis(100)).await;
    let mut parked = park_sessions(&a.registry, Duration::from_secs(10))
        .await
        .expect("parked");
    let (state, sockets) = &parked.sessions[0];
    // One byte of the state changed on its way.
    let mut bytes = state.encode();
    let n = bytes.len();
    bytes[n / 2] ^= 1;
    let (old_end, new_end) = UnixStream::pair().unwrap();
    send_frame(&old_end, &encode_units(&parked.units), &[]).unwrap();
    send_frame(&old_end, &bytes, &borrowed(sockets)).unwrap();
    send_frame(&old_end, &[], &[]).unwrap();
    match receive_handover(&new_end) {
        Err(ReceiveError::State(_)) => {}
        other => panic!("an altered state was taken: {other:?}"),
    }
    // A successor whose config has no such target.
    let (old_end, new_end) = UnixStream::pair().unwrap();
    let handover = Handover {
        units: std::mem::take(&mut parked.units),
        sessions: std::mem::take(&mut parked.sessions),
        ..Handover::default()
    };
    send_handover(&old_end, &handover).unwrap();
    let received = receive_handover(&new_end).expect("received");
    let refused = std::sync::Mutex::new(None);
    let b = Daemon::start_with(
        &config("", &memory_target("iqn.2026-11.io.example:other", "")),
        |server| *refused.lock().unwrap() = Some(server.adopt_sessions(received)),
    );
    match refused.into_inner().unwrap().unwrap() {
        Err(AdoptError::NoTarget(t)) => assert_eq!(t, TARGET),
        other => panic!("expected the session refused, got {other:?}"),
    }
    assert!(b.registry.sessions.all().is_empty());
    b.stop();
    // The handover failed: the first server serves on.
    drop(parked);
    let before = done.load(Relaxed);
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(done.load(Relaxed) > before, "the session did not go on");
    stop.store(true, Relaxed);
    for w in workers {
        w.await.expect("a worker failed");
    }
    assert_eq!(s.info().tsih, tsih);
    a.stop();
}

/// A WRITE whose data the initiator has not sent by the park's deadline (it waits for an
/// R2T's answer) is aborted: it ends TASK ABORTED, counted, and the connection parks (after
/// the deadline, within its grace). When the park is withdrawn the connection serves on:
/// the WRITE's data arriving late is dropped without a word, the WRITE sent again lands and
/// reads back, and the aborted one wrote nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_write_owed_data_at_the_park_deadline_is_aborted_and_sent_again() {
    let d = Daemon::start(&config("", &memory_target(TARGET, "")));
    let mut raw = past_the_unit_attention(d.addr, 0x45).await;
    let sn = raw.take_cmd_sn();
    raw.send(write(2, sn, 8, 8, Bytes::new())).await;
    let ttt = raw.r2t(2).await;
    let within = Duration::from_millis(500);
    let started = std::time::Instant::now();
    let parked = park_sessions(&d.registry, within)
        .await
        .expect("parked once the write was aborted");
    let took = started.elapsed();
    assert!(took >= within, "parked in {took:?}, before its deadline");
    assert_eq!(parked.sessions[0].0.tsih, raw.tsih);
    assert_eq!(parked.aborted, 1);
    let (status, _) = raw.finish(2).await.expect("the WRITE's status");
    assert_eq!(status, ScsiStatus::TASK_ABORTED);
    assert_eq!(d.registry.counters.park_aborts.load(Relaxed), 1);
    drop(parked);
    let data = pattern(4096, 7);
    // Sent before the initiator saw the status.
    raw.send(data_out(2, ttt, 0, data.clone())).await;
    assert!(raw.ping(9).await, "the connection serves on after the park");
    let sn = raw.take_cmd_sn();
    raw.send(read(3, sn, 8, 8)).await;
    let (status, back) = raw.finish(3).await.expect("the READ's status");
    assert_eq!(status, ScsiStatus::GOOD);
    assert!(back.iter().all(|&b| b == 0), "the aborted WRITE wrote");
    // Sent again, it lands.
    sent_again_it_lands(&mut raw, &data).await;
    d.stop();
}

/// A raw session with the target at `addr` (its ISID ending in `isid`) whose READ with ITT 1
/// has met the power on unit attention.
async fn past_the_unit_attention(addr: std::net::SocketAddr, isid: u8) -> Raw {
    let mut raw = Raw::login_at(addr, [0x80, 0, 0, 0, 0, isid], 0, Digests::NONE, 0)
        .await
        .unwrap();
    let sn = raw.take_cmd_sn();
    raw.send(read(1, sn, 0, 1)).await;
    raw.finish(1).await.expect("the power on unit attention");
    raw
}

/// The aborted WRITE (8 blocks at LBA 8) sent again as ITT 4 lands, and reads back as ITT 5.
async fn sent_again_it_lands(raw: &mut Raw, data: &Bytes) {
    let sn = raw.take_cmd_sn();
    raw.send(write(4, sn, 8, 8, Bytes::new())).await;
    let ttt = raw.r2t(4).await;
    raw.send(data_out(4, ttt, 0, data.clone())).await;
    let (status, _) = raw.finish(4).await.expect("the WRITE's status");
    assert_eq!(status, ScsiStatus::GOOD);
    let sn = raw.take_cmd_sn();
    raw.send(read(5, sn, 8, 8)).await;
    let (status, back) = raw.finish(5).await.expect("the READ's status");
    assert_eq!(status, ScsiStatus::GOOD);
    assert_eq!(&back[..], &data[..]);
}

/// MC/S: of a session's two connections one owes a WRITE's data at the park's deadline, the
/// other is idle: the WRITE is aborted and both connections park; withdrawn, the session
/// serves on over both (a READ on the other connection finds nothing written, the WRITE sent
/// again lands).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_mcs_session_owing_a_write_parks_at_its_deadline_on_both_connections() {
    let d = Daemon::start(&config("", &memory_target(TARGET, "")));
    let mut a = past_the_unit_attention(d.addr, 0x48).await;
    let mut b = Raw::login_at(d.addr, [0x80, 0, 0, 0, 0, 0x48], a.tsih, Digests::NONE, 1)
        .await
        .expect("a second connection joins");
    let sn = a.take_cmd_sn();
    a.send(write(2, sn, 8, 8, Bytes::new())).await;
    let ttt = a.r2t(2).await;
    assert!(b.ping(7).await);
    let parked = park_sessions(&d.registry, Duration::from_millis(500))
        .await
        .expect("parked once the write was aborted");
    assert_eq!(parked.sessions.len(), 1);
    assert_eq!(parked.sessions[0].0.connections.len(), 2);
    assert_eq!(parked.aborted, 1);
    let (status, _) = a.finish(2).await.expect("the WRITE's status");
    assert_eq!(status, ScsiStatus::TASK_ABORTED);
    drop(parked);
    let data = pattern(4096, 5);
    a.send(data_out(2, ttt, 0, data.clone())).await;
    // The session's CmdSN count goes on over the other connection.
    let sn = a.take_cmd_sn();
    b.send(read(3, sn, 8, 8)).await;
    let (status, back) = b.finish(3).await.expect("the READ's status");
    assert_eq!(status, ScsiStatus::GOOD);
    assert!(back.iter().all(|&x| x == 0), "the aborted WRITE wrote");
    sent_again_it_lands(&mut a, &data).await;
    d.stop();
}

/// A session whose CmdSN order waits for a command that does not come (the initiator sent
/// the next one first) cannot park: nothing of it can be aborted to make it, and the park
/// gives up at its deadline and grace naming the connection, which serves on: the missing
/// command sent then completes both.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_session_waiting_for_a_cmd_sn_does_not_park_and_serves_on() {
    let d = Daemon::start(&config("", &memory_target(TARGET, "")));
    let mut raw = past_the_unit_attention(d.addr, 0x46).await;
    let missing = raw.take_cmd_sn();
    let sn = raw.take_cmd_sn();
    raw.send(read(3, sn, 0, 1)).await;
    assert!(raw.ping(8).await, "the read waits, the connection answers");
    match park_sessions(&d.registry, Duration::from_millis(300)).await {
        Err(
            e @ ParkError::Timeout {
                left: 1, asked: 1, ..
            },
        ) => {
            // The log names the connection.
            let said = e.to_string();
            let tsih = raw.tsih;
            assert!(
                said.contains(&format!("session {tsih:#x} connection ")),
                "{said}"
            );
        }
        other => panic!("expected the park to time out, got {other:?}"),
    }
    assert_eq!(d.registry.counters.park_aborts.load(Relaxed), 0);
    raw.send(read(2, missing, 0, 1)).await;
    for itt in [2, 3] {
        let (status, _) = raw.finish(itt).await.expect("a READ's status");
        assert_eq!(status, ScsiStatus::GOOD);
    }
    // Now nothing is owed: it parks.
    let parked = park_sessions(&d.registry, Duration::from_secs(5))
        .await
        .expect("parked");
    assert_eq!(parked.sessions[0].0.tsih, raw.tsih);
    drop(parked);
    assert!(raw.ping(9).await, "the connection serves on after the park");
    d.stop();
}

/// A connection that leaves while the others park (its initiator went away owing data) fails
/// the park at once rather than at its deadline, and the sessions that parked serve on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_that_leaves_fails_the_park_at_once() {
    let d = Daemon::start(&config("", &memory_target(TARGET, "")));
    let s = Arc::new(d.session(opts()).await);
    let _ = s.capacity().await;
    let mut raw = past_the_unit_attention(d.addr, 0x46).await;
    let sn = raw.take_cmd_sn();
    raw.send(write(2, sn, 8, 8, Bytes::new())).await;
    loop {
        if let Pdu::ReadyToTransfer(_) = raw.next().await.expect("an R2T") {
            break;
        }
    }
    let started = std::time::Instant::now();
    let park = {
        let registry = d.registry.clone();
        tokio::spawn(async move { park_sessions(&registry, Duration::from_secs(20)).await })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    drop(raw);
    match park.await.unwrap() {
        Err(ParkError::Changed(_)) => {}
        other => panic!("expected the park to fail as the connection left, got {other:?}"),
    }
    assert!(
        started.elapsed() < Duration::from_secs(15),
        "the park waited for its deadline"
    );
    let data = pattern(4096, 3);
    s.write(64, data.clone(), 512).await.expect("serves on");
    assert_eq!(s.read(64, 8, 512).await.unwrap(), data);
    d.stop();
}

/// `targetctl upgrade` to the binary itself, twice (the successor upgrades in turn): a session
/// with digests and an MC/S session of two connections, both loaded with writes read back at
/// once, go on over the same TCP connections under the same TSIHs without a new login (the
/// initiator would see its I/O fail) and without a failed I/O; the old process exits, the new
/// one answers on the admin socket and holds the reservation made through the first.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upgrade_to_a_new_binary_keeps_every_session_on_its_connection() {
    let mut first = Program::start();
    let two = TwoSessions::start(&first).await;
    let mut pid = u64::from(first.child.id());
    for round in 0..2 {
        tokio::time::sleep(Duration::from_millis(300)).await;
        let upgraded = first.upgrade(&[]).await.expect("upgraded");
        println!("upgrade {round}: {upgraded}");
        assert_eq!(upgraded["sessions"], 2, "{upgraded}");
        let new = upgraded["pid"].as_u64().unwrap();
        assert_ne!(new, pid);
        if round == 0 {
            let status = first.child.wait().expect("the first targetd exits");
            assert!(status.success(), "{status}");
        } else {
            let until = std::time::Instant::now() + Duration::from_secs(30);
            while running(pid) && std::time::Instant::now() < until {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            assert!(!running(pid), "the previous targetd did not exit");
        }
        pid = new;
        two.go_on(&format!("upgrade {round}")).await;
        let status = first.status();
        assert_eq!(status["pid"], pid, "{status}");
        assert_eq!(status["sessions"], 2, "{status}");
        assert_eq!(status["connections"], 3, "{status}");
    }
    two.finish().await;
    terminate(pid);
    assert!(!running(pid));
}

/// `targetctl upgrade` while an initiator owes a WRITE's data and does not send it: at the
/// park's deadline the WRITE is aborted (TASK ABORTED) and the upgrade goes through, saying
/// so; the session goes on in the new process on the same connection under the same TSIH:
/// the WRITE's data arriving late is dropped there, the WRITE sent again lands and reads back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upgrade_aborts_a_write_owed_data_at_its_deadline_and_the_session_goes_on() {
    let first = Program::start();
    let mut raw = past_the_unit_attention(first.addr, 0x47).await;
    let sn = raw.take_cmd_sn();
    raw.send(write(2, sn, 8, 8, Bytes::new())).await;
    let ttt = raw.r2t(2).await;
    let upgraded = first
        .upgrade(&["--park-timeout", "500ms"])
        .await
        .expect("upgraded");
    println!("{upgraded}");
    assert_eq!(upgraded["sessions"], 1, "{upgraded}");
    assert_eq!(upgraded["aborted_writes"], 1, "{upgraded}");
    let pid = upgraded["pid"].as_u64().unwrap();
    let (status, _) = raw.finish(2).await.expect("the WRITE's status");
    assert_eq!(status, ScsiStatus::TASK_ABORTED);
    let data = pattern(4096, 9);
    raw.send(data_out(2, ttt, 0, data.clone())).await;
    assert!(raw.ping(9).await, "the new process serves the connection");
    sent_again_it_lands(&mut raw, &data).await;
    let status = first.status();
    assert_eq!(status["pid"], pid, "{status}");
    assert_eq!(status["sessions"], 1, "{status}");
    terminate(pid);
}

/// libiscsi's client across an upgrade: `iscsi-perf` (random 4 KiB reads, 32 in flight,
/// `-x 0`: no reconnect allowed) goes on under the same TSIH, its connection never lost, and
/// keeps reading from the new process.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn libiscsi_reads_on_across_an_upgrade() {
    if !common::tool("iscsi-perf") {
        return;
    }
    let mut first = Program::start();
    let initiator = "iqn.2026-12.io.example:libiscsi-perf";
    let out = first.dir.path().join("perf.txt");
    let started = std::time::Instant::now();
    let mut perf = std::process::Command::new("iscsi-perf")
        .args(["-r", "-x", "0", "-i", initiator])
        .arg(format!("iscsi://{}/{TARGET}/0", first.addr))
        .stdout(std::fs::File::create(&out).unwrap())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let tsih = |p: &Program| -> Option<u64> {
        let sessions = p.sessions();
        sessions
            .as_array()?
            .iter()
            .find(|s| s["initiator"] == initiator)?["tsih"]
            .as_u64()
    };
    let until = std::time::Instant::now() + Duration::from_secs(10);
    while tsih(&first).is_none() && std::time::Instant::now() < until {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let before = tsih(&first).expect("iscsi-perf logged in");
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let upgraded = first.upgrade(&[]).await.expect("upgraded");
    let upgraded_at = started.elapsed();
    assert_eq!(upgraded["sessions"], 1, "{upgraded}");
    assert!(first.child.wait().unwrap().success());
    tokio::time::sleep(Duration::from_millis(3000)).await;
    let read = || std::fs::read_to_string(&out).unwrap().replace('\r', "\n");
    assert!(
        perf.try_wait().unwrap().is_none(),
        "iscsi-perf ended: {}",
        read()
    );
    assert_eq!(tsih(&first), Some(before), "not the same session");
    // Its CTRL-C: it prints what it has and ends.
    let _ = std::process::Command::new("kill")
        .args(["-INT", &perf.id().to_string()])
        .status();
    let _ = perf.wait();
    let text = read();
    println!("{}", text.trim());
    assert!(!text.to_lowercase().contains("reconnect"), "{text}");
    // Each line counts the second before its time since iscsi-perf started: those from a
    // whole second after the upgrade on are reads the new process served.
    let after: Vec<u64> = text
        .lines()
        .filter_map(|l| {
            let (time, rest) = l.split_once(" - ")?;
            let secs = time
                .split(':')
                .try_fold(0u64, |t, part| Some(t * 60 + part.parse::<u64>().ok()?))?;
            let iops = rest
                .split("iops current ")
                .nth(1)?
                .split_whitespace()
                .next()?;
            (secs > upgraded_at.as_secs() + 1).then(|| iops.parse().ok())?
        })
        .collect();
    assert!(
        after.iter().any(|&n| n > 0),
        "no reads after the upgrade ({upgraded_at:?}): {text}"
    );
}

/// Every way an upgrade can fail leaves the running targetd serving its session as before,
/// no I/O failed and no new login: a new binary whose check refuses the config, one that
/// exits at once, one that never connects (the start timeout), one that crashes after it
/// started, after the sessions came, after it took them in and after it was let serve them,
/// and one that refuses them (as an encoding it cannot read). New logins are taken after
/// each; then an upgrade to the real binary succeeds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_upgrade_leaves_the_running_targetd_serving() {
    const NQN: &str = "nqn.2026-12.io.example:failed";
    let mut first = Program::start_with(&nvme_server(NQN), None);
    let s = Arc::new(first.session(opts()).await);
    let tsih = s.info().tsih;
    let _ = s.capacity().await;
    let (stop, done, workers) = load(&s);
    let c = Arc::new(first.nvme_controller(NQN).await);
    let (stop_nvme, done_nvme, workers_nvme) = load_nvme(&c);
    let pid = u64::from(first.child.id());
    // A new binary that refuses the config, one that never connects, and one per failure
    // the successor injects (TARGETD_UPGRADE_FAULT), each with what the refusal says.
    let mut cases = vec![
        ("check", first.binary("check", ""), "--check refused"),
        (
            "hang",
            first.binary("hang", "exec sleep 60"),
            "took too long (connecting)",
        ),
    ];
    std::fs::write(
        &cases[0].1,
        "#!/bin/sh\necho 'this binary refuses' >&2\nexit 1\n",
    )
    .unwrap();
    for (fault, said) in [
        ("exit-at-start", "exited"),
        ("crash-after-ready", "broke"),
        ("crash-after-handover", "broke"),
        ("crash-after-adopted", "broke"),
        ("crash-after-released", "broke"),
        ("refuse", "refused on purpose"),
    ] {
        let start = format!(
            "{}={fault} exec {} \"$@\"",
            targetd::takeover::FAULT_VARIABLE,
            env!("CARGO_BIN_EXE_targetd")
        );
        cases.push((fault, first.binary(fault, &start), said));
    }
    for (name, binary, said) in &cases {
        let before = done.load(Relaxed);
        let before_nvme = done_nvme.load(Relaxed);
        let failed = first
            .upgrade(&["--binary", binary, "--start-timeout", "2s"])
            .await
            .expect_err(name);
        println!("{name}: {}", failed.trim());
        assert!(failed.contains(said), "{name}: {failed}");
        assert!(
            first.child.try_wait().unwrap().is_none(),
            "{name}: it exited"
        );
        tokio::time::sleep(Duration::from_millis(300)).await;
        assert!(done.load(Relaxed) > before, "{name}: the I/O stopped");
        assert!(
            done_nvme.load(Relaxed) > before_nvme,
            "{name}: the NVMe/TCP I/O stopped"
        );
        let status = first.status();
        assert_eq!(
            (status["pid"].as_u64(), status["sessions"].as_u64()),
            (Some(pid), Some(1)),
            "{name}"
        );
        // It accepts again.
        let other = first
            .session(LoginOptions {
                initiator_name: format!("iqn.2026-11.io.example:{name}"),
                ..opts()
            })
            .await;
        other.logout().await.expect("logout");
    }
    let upgraded = first.upgrade(&[]).await.expect("upgraded at last");
    assert_eq!(upgraded["sessions"], 1);
    assert_eq!(upgraded["controllers"], 1);
    assert!(first.child.wait().unwrap().success());
    let (before, before_nvme) = (done.load(Relaxed), done_nvme.load(Relaxed));
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(
        done.load(Relaxed) > before,
        "the I/O stopped after the upgrade"
    );
    assert!(
        done_nvme.load(Relaxed) > before_nvme,
        "the NVMe/TCP I/O stopped after the upgrade"
    );
    stop.store(true, Relaxed);
    stop_nvme.store(true, Relaxed);
    for w in workers.into_iter().chain(workers_nvme) {
        w.await.expect("a worker failed");
    }
    assert_eq!(s.info().tsih, tsih);
    terminate(upgraded["pid"].as_u64().unwrap());
}

/// An NVMe/TCP controller (its admin queue and an I/O queue, digests on), loaded with writes
/// read back at once, goes on across two upgrades and then a restart through the service
/// manager's store, on the same connections: no failed command (the host here does not
/// reconnect), each new process says it took the controller in, the old ones exit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_nvme_tcp_controller_goes_on_across_upgrades_and_a_restart() {
    const NQN: &str = "nqn.2026-12.io.example:upgrade";
    let manager = common::program::Manager::new();
    let server = format!("restart_keeps_sessions = true\n{}", nvme_server(NQN));
    let mut p = Program::start_with(&server, Some(&manager));
    let c = Arc::new(p.nvme_controller(NQN).await);
    let cntlid = c.cntlid;
    let nvme_load = load_nvme(&c);
    goes_on(&nvme_load, "before").await;
    let mut pid = u64::from(p.child.id());
    for round in 0..2 {
        let upgraded = p.upgrade(&[]).await.expect("upgraded");
        println!("upgrade {round}: {upgraded}");
        assert_eq!(
            (
                upgraded["sessions"].as_u64(),
                upgraded["controllers"].as_u64()
            ),
            (Some(0), Some(1)),
            "{upgraded}"
        );
        let until = std::time::Instant::now() + Duration::from_secs(30);
        while running(pid) && std::time::Instant::now() < until {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        assert!(!running(pid), "the previous targetd did not exit");
        if round == 0 {
            p.child.wait().unwrap();
        }
        pid = upgraded["pid"].as_u64().unwrap();
        goes_on(&nvme_load, &format!("upgrade {round}")).await;
    }
    // `systemctl restart`: SIGTERM to the serving process, then a start with the store.
    terminate(pid);
    let names = manager.names();
    assert!(
        names
            .iter()
            .filter(|n| n.starts_with("targetd-nvme-"))
            .count()
            == 2,
        "{names:?}: {}",
        p.log()
    );
    tokio::task::block_in_place(|| p.start_again(Some(&manager)));
    goes_on(&nvme_load, "restart").await;
    assert!(manager.names().is_empty());
    finish(nvme_load).await;
    assert_eq!(c.cntlid, cntlid);
    let log = p.log();
    assert_eq!(log.matches("NVMe controller adopted").count(), 3, "{log}");
}
