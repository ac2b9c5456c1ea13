//! `systemctl restart` that keeps sessions (`server.restart_keeps_sessions`): targetd, stopped
//! by SIGTERM under a service manager with a file descriptor store, puts its listening
//! sockets, its parked iSCSI connections and their state in the store; the next start takes
//! them back and serves the sessions on where they stopped. The service manager here is a
//! stand-in that speaks systemd's protocol (tests/common/program.rs), since systemd itself
//! does not run in a test.

mod common;

use std::time::{Duration, Instant};

use common::opts;
use common::program::{running, Manager, Program, TwoSessions};

const KEEP: &str = "restart_keeps_sessions = true";

/// Sends SIGTERM to `p`'s process and waits for it to end; its exit status.
fn stop(p: &mut Program) -> std::process::ExitStatus {
    let pid = p.child.id();
    let _ = std::process::Command::new("kill")
        .args(["-TERM", &pid.to_string()])
        .status();
    p.child.wait().unwrap()
}

/// Two restarts in a row under a session with digests and an MC/S session of two
/// connections, both loaded with writes read back at once: each stop puts the listener,
/// the three connections and the state in the store (not the admin socket), each start
/// takes them out again and serves both sessions on the same connections under the same
/// TSIHs, without a failed I/O; the reservation made before the first holds after the last.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restart_through_the_store_keeps_every_session_on_its_connection() {
    let manager = Manager::new();
    let mut p = Program::start_with(KEEP, Some(&manager));
    let two = TwoSessions::start(&p).await;
    for round in 0..2 {
        tokio::time::sleep(Duration::from_millis(300)).await;
        let old = u64::from(p.child.id());
        let began = Instant::now();
        let status = tokio::task::block_in_place(|| stop(&mut p));
        assert!(status.success(), "{status}: {}", p.log());
        let mut names = manager.names();
        names.sort();
        assert_eq!(
            names,
            [
                "targetd-connection-0-0",
                "targetd-connection-1-0",
                "targetd-connection-1-1",
                "targetd-listener-0",
                "targetd-state"
            ],
            "round {round}: {}",
            p.log()
        );
        assert!(manager.said().iter().any(|l| l == "STOPPING=1"));
        tokio::task::block_in_place(|| p.start_again(Some(&manager)));
        println!(
            "restart {round}: the next targetd listened {:?} after SIGTERM",
            began.elapsed()
        );
        assert!(!running(old));
        let status = p.status();
        assert_eq!(status["pid"], p.child.id(), "{status}");
        assert_eq!(status["sessions"], 2, "{status}: {}", p.log());
        assert_eq!(status["connections"], 3, "{status}");
        // Taken out of the store before the sessions were served.
        assert!(manager.names().is_empty(), "{:?}", manager.names());
        two.go_on(&format!("restart {round}")).await;
    }
    two.finish().await;
    let log = p.log();
    if std::env::var_os("TEST_PRINT_LOG").is_some() {
        println!("{log}");
    }
    assert_eq!(
        log.matches("serving the sessions the service manager kept")
            .count(),
        2,
        "{log}"
    );
}

/// A store whose state does not hold (a changed memory file) is not taken in: the next
/// start says why, takes everything out of the store, closes the stored connection (its
/// initiator's next command fails; it would log in again) and serves afresh on its portal.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_damaged_store_is_taken_out_and_the_start_serves_afresh() {
    let manager = Manager::new();
    let mut p = Program::start_with(KEEP, Some(&manager));
    let s = p.session(opts()).await;
    let _ = s.capacity().await;
    let status = tokio::task::block_in_place(|| stop(&mut p));
    assert!(status.success());
    assert!(manager.names().contains(&"targetd-state".to_string()));
    let garbage = rustix::fs::memfd_create("garbage", rustix::fs::MemfdFlags::CLOEXEC).unwrap();
    rustix::io::write(&garbage, b"tdFS not what targetd wrote").unwrap();
    manager.replace("targetd-state", garbage);
    tokio::task::block_in_place(|| p.start_again(Some(&manager)));
    let log = p.log();
    assert!(log.contains("damaged"), "{log}");
    assert!(manager.names().is_empty(), "{:?}", manager.names());
    let failed = tokio::time::timeout(Duration::from_secs(10), s.capacity()).await;
    assert!(
        matches!(failed, Ok(Err(_))),
        "the stored connection still served"
    );
    let other = p.session(opts()).await;
    assert!(other.capacity().await.is_ok());
    assert_eq!(p.status()["sessions"], 1);
}

/// Without room in the store (systemd says its size in `$FDSTORE`) nothing goes in: the
/// stop says why and asks the initiators to log out, as without the key.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_room_in_the_store_the_stop_logs_out() {
    let manager = Manager::with_store_size(2);
    let mut p = Program::start_with(KEEP, Some(&manager));
    let s = p.session(opts()).await;
    let _ = s.capacity().await;
    let status = tokio::task::block_in_place(|| stop(&mut p));
    assert!(status.success());
    let log = p.log();
    assert!(log.contains("takes 2 descriptors, 3 would go in"), "{log}");
    assert!(log.contains("asking initiators to log out"), "{log}");
    assert!(manager.names().is_empty(), "{:?}", manager.names());
}
