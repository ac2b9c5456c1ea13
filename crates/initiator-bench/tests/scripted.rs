//! The initiator against the scripted in-process target: login, CHAP, digests, every data path,
//! the CmdSN window, NOP, task management, MC/S, discovery, reconnect, and a misbehaving target.

mod common;

use std::sync::atomic::Ordering;
use std::time::Duration;

use bytes::Bytes;
use common::{Config, Misbehave, ScriptedTarget, TARGET};
use initiator_bench::scsi::{cdb, Command};
use initiator_bench::{discover, Error, IscsiUrl, LoginOptions, Session};
use iscsi_pdu::chap::ChapCredentials;
use iscsi_pdu::negotiation::{AuthMethod, AuthSettings, DigestAlgorithm};
use iscsi_pdu::{LoginStatus, TaskManagementFunction, TmfResponse};

fn pattern(len: usize, seed: usize) -> Bytes {
    Bytes::from(
        (0..len)
            .map(|i| (i * 31 + seed * 7 + i / 512) as u8)
            .collect::<Vec<u8>>(),
    )
}

fn opts() -> LoginOptions {
    LoginOptions {
        timeout: Duration::from_secs(5),
        ..LoginOptions::default()
    }
}

async fn session(t: &ScriptedTarget, o: LoginOptions) -> Session {
    Session::connect(&IscsiUrl::parse(&t.url()).unwrap(), o)
        .await
        .expect("login")
}

#[tokio::test]
async fn reads_and_writes_through_every_r2t_path() {
    // FirstBurstLength 16K and MaxBurstLength 64K at the target; segments of 8K.
    let t = ScriptedTarget::start(Config::default()).await;
    let sizes = [
        512usize,
        8192,
        16384 - 512,
        16384 + 512,
        65536 + 4096,
        3 * 65536 + 1024,
    ];
    for immediate in [true, false] {
        for initial_r2t in [true, false] {
            for outstanding in [1u16, 4] {
                let mut o = opts();
                o.settings.operational.immediate_data = immediate;
                o.settings.operational.initial_r2t = initial_r2t;
                o.settings.operational.max_outstanding_r2t = outstanding;
                let s = session(&t, o).await;
                let p = s.params().unwrap().operational;
                assert_eq!((p.immediate_data, p.initial_r2t), (immediate, initial_r2t));
                let (_, bs) = s.capacity().await.unwrap();
                for (k, &len) in sizes.iter().enumerate() {
                    let data = pattern(len - len % 512, k + len);
                    let lba = (k * 512) as u64;
                    s.write(lba, data.clone(), bs).await.unwrap();
                    let back = s.read(lba, (data.len() / 512) as u32, bs).await.unwrap();
                    assert_eq!(
                        back, data,
                        "immediate {immediate} initial_r2t {initial_r2t} len {len}"
                    );
                }
                s.logout().await.unwrap();
            }
        }
    }
    assert!(
        t.observed.max_r2ts_outstanding.load(Ordering::SeqCst) >= 2,
        "several R2Ts were outstanding"
    );
}

#[tokio::test]
async fn digests_and_a_small_cmdsn_window() {
    let t = ScriptedTarget::start(Config {
        window: 1,
        ..Config::default()
    })
    .await;
    let mut o = opts();
    o.settings.header_digest = vec![DigestAlgorithm::Crc32c];
    o.settings.data_digest = vec![DigestAlgorithm::Crc32c];
    let s = std::sync::Arc::new(session(&t, o).await);
    assert_eq!(s.digests(), Some(iscsi_pdu::Digests::BOTH));
    let (_, bs) = s.capacity().await.unwrap();
    // Eight commands at once through a window of one.
    let mut handles = Vec::new();
    for i in 0..8u64 {
        let s = s.clone();
        handles.push(tokio::spawn(async move {
            let data = pattern(4096, i as usize);
            s.write(i * 8, data.clone(), bs).await.unwrap();
            assert_eq!(s.read(i * 8, 8, bs).await.unwrap(), data);
        }));
    }
    for h in handles {
        h.await.unwrap();
    }
    s.logout().await.unwrap();
}

fn creds(name: &str, secret: &str) -> ChapCredentials {
    ChapCredentials::new(name, secret.as_bytes().to_vec(), 12).unwrap()
}

#[tokio::test]
async fn chap_one_way_mutual_and_refused() {
    let mut config = Config::default();
    config.settings.auth = AuthSettings {
        methods: vec![AuthMethod::Chap],
        local: Some(creds("target", "ba9876543210")),
        peer: Some(creds("user", "0123456789ab")),
        require_mutual: false,
    };
    let t = ScriptedTarget::start(config).await;
    let url = format!("iscsi://user%0123456789ab@{}/{TARGET}/0", t.addr);
    let s = Session::connect(&IscsiUrl::parse(&url).unwrap(), opts())
        .await
        .unwrap();
    s.nop().await.unwrap();
    s.logout().await.unwrap();

    let mut o = opts();
    o.mutual_chap = Some(creds("target", "ba9876543210"));
    let s = Session::connect(&IscsiUrl::parse(&url).unwrap(), o)
        .await
        .unwrap();
    s.logout().await.unwrap();

    // The target proves the wrong secret: the initiator refuses it.
    let mut o = opts();
    o.mutual_chap = Some(creds("target", "wrongwrong12"));
    assert!(matches!(
        Session::connect(&IscsiUrl::parse(&url).unwrap(), o).await,
        Err(Error::Negotiation(_))
    ));

    // A wrong secret: the target refuses the login.
    let bad = format!("iscsi://user%wrongsecret1@{}/{TARGET}/0", t.addr);
    match Session::connect(&IscsiUrl::parse(&bad).unwrap(), opts()).await {
        Err(Error::LoginRefused { status, .. }) => {
            assert_eq!(status, LoginStatus::AUTHENTICATION_FAILURE)
        }
        other => panic!("expected an authentication failure, got {other:?}"),
    }
    // No credentials at all.
    match Session::connect(&IscsiUrl::parse(&t.url()).unwrap(), opts()).await {
        Err(Error::LoginRefused { status, .. }) => {
            assert_eq!(status, LoginStatus::AUTHENTICATION_FAILURE)
        }
        other => panic!("expected an authentication failure, got {other:?}"),
    }
}

#[tokio::test]
async fn answers_target_pings_and_runs_task_management() {
    let t = ScriptedTarget::start(Config {
        ping: true,
        hold_reads: true,
        ..Config::default()
    })
    .await;
    let s = session(&t, opts()).await;
    s.nop().await.unwrap();
    assert!(
        t.observed.pong.load(Ordering::SeqCst),
        "the target's NOP-In was echoed"
    );
    let pending = s
        .start(Command::read(s.lun(), cdb::read(0, 8), 4096))
        .await
        .unwrap();
    let itt = pending.itt;
    assert_eq!(
        s.task_management(TaskManagementFunction::AbortTask, Some(itt))
            .await
            .unwrap(),
        TmfResponse::FunctionComplete
    );
    assert!(matches!(pending.wait().await, Err(Error::Aborted)));
    assert_eq!(
        s.task_management(TaskManagementFunction::LogicalUnitReset, None)
            .await
            .unwrap(),
        TmfResponse::FunctionComplete
    );
    s.logout().await.unwrap();
}

#[tokio::test]
async fn several_connections_per_session() {
    let t = ScriptedTarget::start(Config::default()).await;
    let o = LoginOptions {
        connections: 3,
        ..opts()
    };
    let s = std::sync::Arc::new(session(&t, o).await);
    assert_eq!(s.info().connections, 3);
    assert_eq!(t.observed.logins.load(Ordering::SeqCst), 3);
    let (_, bs) = s.capacity().await.unwrap();
    let mut handles = Vec::new();
    for i in 0..12u64 {
        let s = s.clone();
        handles.push(tokio::spawn(async move {
            let data = pattern(20480, i as usize);
            s.write(i * 40, data.clone(), bs).await.unwrap();
            assert_eq!(s.read(i * 40, 40, bs).await.unwrap(), data);
        }));
    }
    for h in handles {
        h.await.unwrap();
    }
    s.logout().await.unwrap();
}

#[tokio::test]
async fn discovery_lists_the_target() {
    let t = ScriptedTarget::start(Config::default()).await;
    let found = discover(
        &IscsiUrl::parse(&format!("iscsi://{}", t.addr)).unwrap(),
        &opts(),
    )
    .await
    .unwrap();
    assert_eq!(found.len(), 1);
    assert_eq!(found[0].name, TARGET);
    assert_eq!(found[0].addresses, vec![format!("{},1", t.addr)]);
}

#[tokio::test]
async fn logs_in_again_after_a_dropped_connection() {
    let t = ScriptedTarget::start(Config {
        drop_after: Some(3),
        ..Config::default()
    })
    .await;
    let s = session(&t, opts()).await;
    let (_, bs) = s.capacity().await.unwrap();
    s.write(0, pattern(4096, 1), bs).await.unwrap();
    s.read(0, 8, bs).await.unwrap();
    // The fourth command finds the connection closed under it.
    assert!(matches!(
        s.read(0, 8, bs).await,
        Err(Error::ConnectionLost(_))
    ));
    // The next one logs in again and works.
    assert_eq!(s.read(0, 8, bs).await.unwrap(), pattern(4096, 1));
    assert_eq!(t.observed.logins.load(Ordering::SeqCst), 2);
}

#[tokio::test]
async fn a_misbehaving_target_fails_the_command_not_the_process() {
    for (bad, connection_survives) in [
        (Misbehave::WrongDataSn, true),
        (Misbehave::OffsetBeyondBuffer, true),
        (Misbehave::OversizedPdu, false),
    ] {
        let t = ScriptedTarget::start(Config {
            misbehave: bad,
            ..Config::default()
        })
        .await;
        // Small segments, so a 32 KiB read takes several Data-In PDUs.
        let mut o = opts();
        o.settings.max_recv_data_segment_length = 4096;
        let s = session(&t, o).await;
        let (_, bs) = s.capacity().await.unwrap();
        let Err(e) = s.read(0, 64, bs).await else {
            panic!("{bad:?}: the read succeeded")
        };
        match (bad, &e) {
            (Misbehave::OversizedPdu, Error::ConnectionLost(_)) => {}
            (Misbehave::WrongDataSn | Misbehave::OffsetBeyondBuffer, Error::Command(_)) => {}
            _ => panic!("{bad:?}: unexpected {e}"),
        }
        // Small commands still work: on the same connection, or after logging in again.
        s.nop().await.unwrap();
        assert_eq!(
            t.observed.logins.load(Ordering::SeqCst),
            if connection_survives { 1 } else { 2 }
        );
    }
}

#[tokio::test]
async fn dropping_a_session_closes_its_connection_even_when_the_target_is_silent() {
    let t = ScriptedTarget::start(Config {
        hold_reads: true,
        ..Config::default()
    })
    .await;
    let s = session(&t, opts()).await;
    let pending = s
        .start(Command::read(s.lun(), cdb::read(0, 8), 4096))
        .await
        .unwrap();
    drop(pending);
    drop(s);
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while t.observed.closed.load(Ordering::SeqCst) == 0 {
        assert!(
            std::time::Instant::now() < deadline,
            "the connection stayed open"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

#[tokio::test]
async fn a_command_the_target_never_answers_times_out_and_the_session_goes_on() {
    let t = ScriptedTarget::start(Config::default()).await;
    let o = LoginOptions {
        timeout: Duration::from_millis(300),
        ..opts()
    };
    let s = session(&t, o).await;
    s.capacity().await.unwrap();
    let mut rezero = [0u8; 16];
    rezero[0] = 0x01;
    let r = s.execute(Command::new(iscsi_pdu::Lun::ZERO, rezero)).await;
    assert!(matches!(r, Err(Error::Timeout)), "{r:?}");
    // The machine timed it out on its own clock and forgot it: the session goes on.
    s.capacity().await.unwrap();
    s.logout().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streams_waiting_for_the_window_each_get_their_turn() {
    let t = ScriptedTarget::start(Config {
        window: 1,
        ..Config::default()
    })
    .await;
    let s = std::sync::Arc::new(session(&t, opts()).await);
    let (_, bs) = s.capacity().await.unwrap();
    // Eight streams through a window of one, each sending its next command as soon as its
    // last ends: one that has just finished must not pass those already waiting.
    let done = std::sync::Arc::new(std::sync::atomic::AtomicU32::new(0));
    let start = std::sync::Arc::new(tokio::sync::Barrier::new(8));
    let mut handles = Vec::new();
    for i in 0..8u64 {
        let (s, done, start) = (s.clone(), done.clone(), start.clone());
        handles.push(tokio::spawn(async move {
            // All start together: a stream scheduled late would miss the first rounds.
            start.wait().await;
            let mut mine = 0u32;
            while done.load(Ordering::Relaxed) < 400 {
                s.read(i * 8, 8, bs).await.unwrap();
                done.fetch_add(1, Ordering::Relaxed);
                mine += 1;
            }
            mine
        }));
    }
    let mut counts = Vec::new();
    for h in handles {
        counts.push(h.await.unwrap());
    }
    // The window's permits go in the order asked for, so each stream has its turn once a
    // round: on an idle machine the counts differ by at most 1 (woken all at once, as they
    // were, they raced for the window and spread from 44 to 58). A busy runner can keep a
    // stream's own task from running for a few rounds, so only starvation is an error here;
    // and every permit comes back, or the streams would stall.
    let fewest = *counts.iter().min().unwrap();
    let mean = counts.iter().sum::<u32>() / 8;
    assert!(fewest * 2 >= mean, "each stream had its turns: {counts:?}");
    s.logout().await.unwrap();
}
