//! targetd in-process, driven by the project's initiator (crates/initiator-bench) and by raw
//! PDUs: every R2T path, digests, CHAP, discovery, MC/S across reactors, reinstatement, task
//! management, NOP timeout, malformed PDUs, and the admin interface.

mod common;

use std::sync::Arc;
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use common::raw::Raw;
use common::{config, memory_target, opts, pattern, Daemon, TARGET};
use initiator_bench::scsi::{cdb, Command};
use initiator_bench::workload::{run, Rw, Split, Workload};
use initiator_bench::{discover, Error, LoginOptions, Session};
use iscsi_pdu::chap::ChapCredentials;
use iscsi_pdu::negotiation::{AuthMethod, DigestAlgorithm};
use iscsi_pdu::{
    Digests, LoginStatus, Lun, Pdu, Residual, ScsiStatus, SerialNumber, TaskAttribute,
    TaskManagementFunction, TextRequest, TmfResponse, RESERVED_TAG,
};
use targetd::admin::{handle, AdminRequest};
use tokio::io::AsyncReadExt;
use tokio::net::TcpStream;

/// Small bursts so every path is taken with small I/Os: FirstBurstLength 16K, MaxBurstLength
/// 64K, segments of 8K.
const SMALL: &str = "max_recv_data_segment_length = 8192\nfirst_burst_length = 16384\n\
                     max_burst_length = 65536\nmax_outstanding_r2t = 4";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reads_and_writes_through_every_r2t_path() {
    let d = Daemon::start(&config(SMALL, &memory_target(TARGET, "")));
    let sizes = [
        512usize,
        8192,
        16384 - 512,
        16384 + 512,
        65536 + 4096,
        3 * 65536 + 1024,
    ];
    let mut seed = 0;
    for immediate in [true, false] {
        for initial_r2t in [true, false] {
            for outstanding in [1u16, 4] {
                let mut o = opts();
                o.settings.operational.immediate_data = immediate;
                o.settings.operational.initial_r2t = initial_r2t;
                o.settings.operational.max_outstanding_r2t = outstanding;
                let s = d.session(o).await;
                let p = s.params().unwrap().operational;
                assert_eq!((p.immediate_data, p.initial_r2t), (immediate, initial_r2t));
                for &len in &sizes {
                    seed += 1;
                    let data = pattern(len.div_ceil(512) * 512, seed);
                    let lba = (seed * 512) as u64;
                    s.write(lba, data.clone(), 512).await.unwrap();
                    let back = s.read(lba, (data.len() / 512) as u32, 512).await.unwrap();
                    assert!(
                        back == data,
                        "immediate {immediate} initial_r2t {initial_r2t} r2t {outstanding} len {len}"
                    );
                }
                s.logout().await.unwrap();
            }
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn digests_on_every_pdu() {
    let d = Daemon::start(&config(SMALL, &memory_target(TARGET, "")));
    let mut o = opts();
    o.settings.header_digest = vec![DigestAlgorithm::Crc32c];
    o.settings.data_digest = vec![DigestAlgorithm::Crc32c];
    let s = d.session(o).await;
    assert_eq!(s.digests(), Some(Digests::BOTH));
    let data = pattern(200 * 1024, 3);
    s.write(10, data.clone(), 512).await.unwrap();
    assert!(s.read(10, 400, 512).await.unwrap() == data);
    s.nop().await.unwrap();
    s.logout().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chap_one_way_and_mutual() {
    let extra = "chap = { username = \"alice\", secret = \"0123456789ab\" }\n\
                 mutual_chap = { username = \"target\", secret = \"ba9876543210\" }";
    let d = Daemon::start(&config("", &memory_target(TARGET, extra)));
    let creds = |u: &str, s: &str| Some(ChapCredentials::new(u, s.as_bytes(), 1).unwrap());
    let chap = |o: &mut LoginOptions| o.settings.auth.methods = vec![AuthMethod::Chap];
    // No CHAP offered: refused.
    let err = Session::connect(&d.url(TARGET, 0), opts())
        .await
        .unwrap_err();
    assert!(
        matches!(err, Error::LoginRefused { status, .. } if status == LoginStatus::AUTHENTICATION_FAILURE),
        "{err}"
    );
    // Wrong secret: refused.
    let mut o = opts();
    chap(&mut o);
    o.chap = creds("alice", "wrongwrongwrong");
    assert!(Session::connect(&d.url(TARGET, 0), o).await.is_err());
    // One-way.
    let mut o = opts();
    chap(&mut o);
    o.chap = creds("alice", "0123456789ab");
    let s = Session::connect(&d.url(TARGET, 0), o.clone())
        .await
        .unwrap();
    s.capacity().await.unwrap();
    s.logout().await.unwrap();
    // Mutual: the target proves itself.
    o.mutual_chap = creds("target", "ba9876543210");
    let s = Session::connect(&d.url(TARGET, 0), o.clone())
        .await
        .unwrap();
    s.logout().await.unwrap();
    // Mutual with the wrong expectation of the target's secret: the initiator refuses, and
    // says once that it was the target's answer that failed.
    o.mutual_chap = creds("target", "not-the-secret");
    let err = Session::connect(&d.url(TARGET, 0), o.clone())
        .await
        .unwrap_err();
    let said = format!("{:?}", anyhow::Error::from(err));
    assert!(
        said.contains("the target's CHAP response does not match"),
        "{said}"
    );
    assert_eq!(said.matches("does not match").count(), 1, "{said}");
    // The two refusals were counted against this address.
    let metrics = targetd::metrics::text(&d.registry);
    // And every login by the target's last answer: the two sessions, and the two refused
    // (no CHAP offered, the wrong secret). The initiator that gave up on the target's mutual
    // CHAP answer left before the target's final answer.
    for line in [
        "targetd_logins_total{transport=\"tcp\",status=\"success\"} 2\n",
        "targetd_logins_total{transport=\"tcp\",status=\"authentication_failure\"} 2\n",
        "targetd_logins_total{transport=\"iser\",status=\"success\"} 0\n",
    ] {
        assert!(metrics.contains(line), "{line} in {metrics}");
    }
    assert!(
        metrics.contains("targetd_auth_failures_total 2\n"),
        "{metrics}"
    );
    assert!(
        metrics.contains("targetd_auth_throttled_sources 1\n"),
        "{metrics}"
    );
    // Two more failures: the address's next login waits its turn (800 ms after four; a lower
    // bound with room for the time the refusal took to arrive), and then works.
    let mut bad = o.clone();
    bad.mutual_chap = None;
    bad.chap = creds("alice", "wrongwrongwrong");
    assert!(Session::connect(&d.url(TARGET, 0), bad.clone())
        .await
        .is_err());
    assert!(Session::connect(&d.url(TARGET, 0), bad).await.is_err());
    let start = std::time::Instant::now();
    o.mutual_chap = None;
    let s = Session::connect(&d.url(TARGET, 0), o).await.unwrap();
    assert!(
        start.elapsed() >= std::time::Duration::from_millis(400),
        "{:?}",
        start.elapsed()
    );
    s.logout().await.unwrap();
    // No secret in the config dump, the config's Debug, or the session list.
    let secrets = ["0123456789ab", "ba9876543210"];
    let dump = handle(&d.registry, AdminRequest::ConfigDump).unwrap();
    let dump = dump.as_str().unwrap();
    let debug = format!("{:?}", *d.registry.config());
    let sessions = handle(&d.registry, AdminRequest::Sessions)
        .unwrap()
        .to_string();
    for text in [dump, &debug, &sessions] {
        for secret in secrets {
            assert!(!text.contains(secret), "{secret} shown in {text}");
        }
    }
    assert!(
        dump.contains("alice") && dump.contains(targetd::config::REDACTED),
        "{dump}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn discovery_with_chap() {
    let iscsi = "discovery_chap = { username = \"finder\", secret = \"0123456789ab\" }";
    let d = Daemon::start(&config(iscsi, &memory_target(TARGET, "")));
    assert!(discover(&d.url(TARGET, 0), &opts()).await.is_err());
    let mut o = opts();
    o.settings.auth.methods = vec![AuthMethod::Chap];
    o.chap = Some(ChapCredentials::new("finder", &b"0123456789ab"[..], 1).unwrap());
    let found = discover(&d.url(TARGET, 0), &o).await.unwrap();
    assert_eq!(found[0].name, TARGET);
    // The target itself has no CHAP: a normal session logs in without.
    d.session(opts()).await.logout().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn discovery_lists_only_targets_the_initiator_may_reach() {
    let open = memory_target(TARGET, "networks = [\"127.0.0.0/8\"]");
    let closed = memory_target(
        "iqn.2026-11.io.example:closed",
        "initiators = [\"iqn.2026-11.io.example:someone-else\"]",
    );
    let elsewhere = memory_target(
        "iqn.2026-11.io.example:elsewhere",
        "networks = [\"10.0.0.0/8\", \"::1/128\"]",
    );
    let d = Daemon::start(&config("", &format!("{open}\n{closed}\n{elsewhere}")));
    let found = discover(&d.url(TARGET, 0), &opts()).await.unwrap();
    assert_eq!(found.len(), 1);
    assert_eq!(found[0].name, TARGET);
    assert_eq!(found[0].addresses, vec![format!("{},1", d.addr)]);
    // The targets not listed refuse the login (by initiator name; by source network) even
    // to an initiator that knows their names.
    for name in [
        "iqn.2026-11.io.example:closed",
        "iqn.2026-11.io.example:elsewhere",
    ] {
        let err = Session::connect(&d.url(name, 0), opts()).await.unwrap_err();
        assert!(
            matches!(err, Error::LoginRefused { status, .. } if status == LoginStatus::AUTHORIZATION_FAILURE),
            "{name}: {err}"
        );
    }
    let err = Session::connect(&d.url("iqn.2026-11.io.example:nope", 0), opts())
        .await
        .unwrap_err();
    assert!(
        matches!(err, Error::LoginRefused { status, .. } if status == LoginStatus::NOT_FOUND),
        "{err}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_of_one_session_on_both_reactors_keep_command_order() {
    let d = Daemon::start(&config(SMALL, &memory_target(TARGET, "")));
    let mut o = opts();
    o.connections = 4;
    o.settings.operational.max_connections = 4;
    let s = d.session(o).await;
    assert_eq!(s.info().connections, 4);
    let sessions = &d.registry.sessions;
    let reactors: std::collections::HashSet<usize> = sessions
        .connections(&sessions.all()[0])
        .iter()
        .map(|c| c.reactor)
        .collect();
    assert_eq!(reactors.len(), 2, "the session spans both reactors");
    // The new nexus's POWER ON unit attention goes to the first command.
    let _ = s
        .execute(Command::new(s.lun(), cdb::test_unit_ready()))
        .await;
    // Many commands in flight over all connections. They are ORDERED tasks: SIMPLE ones may
    // run in any order (SAM-5 8.6), and over four connections a later write's data can well
    // arrive first. The core receives them in CmdSN order across the connections and runs
    // ordered tasks in the order received, so the last write to each block wins.
    let mut pending = Vec::new();
    for i in 0..64u32 {
        let data = pattern(4096, i as usize);
        let mut c = Command::write(s.lun(), cdb::write(u64::from(i % 8) * 8, 8), data);
        c.attribute = TaskAttribute::Ordered;
        pending.push(s.start(c).await.unwrap());
    }
    for p in pending {
        p.wait().await.unwrap().good().unwrap();
    }
    for i in 56..64u32 {
        let back = s.read(u64::from(i % 8) * 8, 8, 512).await.unwrap();
        assert!(back == pattern(4096, i as usize), "block group {}", i % 8);
    }
    s.logout().await.unwrap();
}

/// Reads and writes end at their connection and are retired by whoever takes the core's lock
/// next. An ORDERED command behind them, on another connection and reactor, with nothing
/// after it to take the lock, must still run: the connections that finish the tasks it waits
/// for see that it waits and retire them at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_ordered_command_behind_delegated_tasks_runs_with_nothing_after_it() {
    let file = "[[targets]]\nname = \"iqn.2026-11.io.example:test\"\n[[targets.luns]]\nlun = 0\n\
                backend = \"file\"\npath = \"@DIR@/lun0.img\"\nsize = \"16MiB\"\n";
    let d = Daemon::start(&config("", file));
    let mut o = opts();
    o.connections = 4;
    o.settings.operational.max_connections = 4;
    let s = d.session(o).await;
    let _ = s
        .execute(Command::new(s.lun(), cdb::test_unit_ready()))
        .await;
    for round in 0..20usize {
        let mut pending = Vec::new();
        for i in 0..24u64 {
            let c = if i % 3 == 0 {
                let data = pattern(8192, round * 100 + i as usize);
                Command::write(s.lun(), cdb::write(i * 16, 16), data)
            } else {
                Command::read(s.lun(), cdb::read(i * 16, 16), 8192)
            };
            pending.push(s.start(c).await.unwrap());
        }
        let mut c = Command::write(s.lun(), cdb::write(1000, 16), pattern(8192, round));
        c.attribute = TaskAttribute::Ordered;
        pending.push(s.start(c).await.unwrap());
        let all = async {
            for p in pending {
                p.wait().await.unwrap().good().unwrap();
            }
        };
        tokio::time::timeout(Duration::from_secs(20), all)
            .await
            .unwrap_or_else(|_| panic!("round {round}: a command never ended"));
    }
    let back = s.read(1000, 16, 512).await.unwrap();
    assert!(back == pattern(8192, 19));
    s.logout().await.unwrap();
}

/// A WRITE whose expected data transfer length ends inside a block (200 bytes for one 512-byte
/// block) cannot be written as sent: it is refused with INVALID FIELD IN COMMAND INFORMATION UNIT
/// and the overflow, and nothing is written (it used to answer GOOD having written nothing).
/// Whole blocks short of the CDB's length are written, with the overflow.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_write_ending_inside_a_block_is_refused_and_writes_nothing() {
    let d = Daemon::start(&config("", &memory_target(TARGET, "")));
    let s = d.session(opts()).await;
    let _ = s
        .execute(Command::new(s.lun(), cdb::test_unit_ready()))
        .await;
    s.write(40, pattern(2048, 1), 512).await.unwrap();
    for (blocks, len) in [(1u32, 200usize), (2, 600), (4, 1000)] {
        let data = pattern(len, 9);
        let r = s
            .execute(Command::write(s.lun(), cdb::write(40, blocks), data))
            .await
            .unwrap();
        let sense = initiator_bench::Sense::parse(&r.sense.clone().unwrap()).unwrap();
        assert_eq!((sense.key, sense.asc, sense.ascq), (5, 0x0e, 0x03), "{r:?}");
        let over = blocks * 512 - len as u32;
        assert_eq!(
            r.residual,
            Residual::Overflow(over),
            "{blocks} blocks, {len} bytes"
        );
        let back = s.read(40, 4, 512).await.unwrap();
        assert!(back == pattern(2048, 1), "nothing written for {len} bytes");
    }
    let r = s
        .execute(Command::write(s.lun(), cdb::write(40, 2), pattern(512, 9)))
        .await
        .unwrap()
        .good()
        .unwrap();
    assert_eq!(r.residual, Residual::Overflow(512));
    let back = s.read(40, 4, 512).await.unwrap();
    assert!(back[..512] == pattern(512, 9)[..] && back[512..] == pattern(2048, 1)[512..]);
    s.logout().await.unwrap();
}

/// Text requests with an unknown key or a bad value, as outside clients sent them, get a Text
/// Response answering the key, and the connection goes on (issue 15: a bad value used to get
/// a Reject and the initiator waited for a response that never came).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn text_with_unknown_keys_or_bad_values_gets_answers() {
    let d = Daemon::start(&config("", &memory_target(TARGET, "")));
    let mut raw = Raw::login(&d, [0x80, 0, 0, 0, 0, 0x15], 0).await.unwrap();
    // Unknown keys and SendTargets values it cannot have: Reject (as LIO), then an answer.
    let cases: [(&str, Option<&str>); 5] = [
        ("SendTargetsPlease=All", None),
        ("SendTargets=Alle", None),
        ("SendTargets=A", None),
        ("sENDtARGETS=aLL", None),
        (
            "SendTargets=All",
            Some("TargetName=iqn.2026-11.io.example:test"),
        ),
    ];
    for (n, (request, answer)) in cases.into_iter().enumerate() {
        let itt = 0x100 + n as u32;
        raw.send(Pdu::TextRequest(TextRequest {
            final_bit: true,
            initiator_task_tag: itt,
            target_transfer_tag: RESERVED_TAG,
            cmd_sn: raw.cmd_sn,
            data: Bytes::from(format!("{request}\0")),
            ..TextRequest::default()
        }))
        .await;
        raw.cmd_sn = raw.cmd_sn.next();
        match (raw.next().await, answer) {
            (Some(Pdu::TextResponse(t)), Some(answer)) => {
                assert_eq!(t.initiator_task_tag, itt);
                let text = String::from_utf8_lossy(&t.data);
                assert!(text.starts_with(answer), "{request}: {text}");
            }
            (Some(Pdu::Reject(r)), None) => {
                assert_eq!(
                    r.reason,
                    iscsi_pdu::RejectReason::ProtocolError,
                    "{request}"
                );
            }
            (other, _) => panic!("{request}: {other:?}"),
        }
    }
    assert!(raw.ping(0x200).await, "the connection goes on");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_pdus_are_rejected_without_harm_to_the_session_or_others() {
    let d = Daemon::start(&config("", &memory_target(TARGET, "")));
    let bystander = d.session(opts()).await;
    let mut raw = Raw::login(&d, [0x80, 0, 0, 0, 0, 1], 0).await.unwrap();
    assert!(raw.ping(7).await);
    // A reserved opcode: Reject, the session goes on.
    let mut bhs = [0u8; 48];
    bhs[0] = 0x1f;
    bhs[16..20].copy_from_slice(&9u32.to_be_bytes());
    raw.send_bytes(&bhs).await;
    match raw.next().await {
        Some(Pdu::Reject(r)) => assert_eq!(r.rejected_header().unwrap().0[0] & 0x3f, 0x1f),
        other => panic!("expected a Reject, got {other:?}"),
    }
    assert!(raw.ping(8).await);
    // A Data-Out for no task is dropped; a SNACK at ERL 0 is rejected.
    let mut snack = [0u8; 48];
    snack[0] = 0x10;
    snack[1] = 0x80;
    raw.send_bytes(&snack).await;
    assert!(matches!(raw.next().await, Some(Pdu::Reject(_))));
    assert!(raw.ping(9).await);
    // A data segment longer than MaxRecvDataSegmentLength closes this connection only.
    let mut long = [0u8; 48];
    long[0] = 0x40; // NOP-Out, immediate.
    long[1] = 0x80;
    long[5..8].copy_from_slice(&[0xff, 0xff, 0xff]);
    raw.send_bytes(&long).await;
    assert!(raw.next().await.is_none(), "the connection closes");
    // The other session never noticed.
    bystander.nop().await.unwrap();
    let data = pattern(4096, 1);
    bystander.write(0, data.clone(), 512).await.unwrap();
    assert!(bystander.read(0, 8, 512).await.unwrap() == data);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn digest_errors_at_error_recovery_level_0() {
    let d = Daemon::start(&config("", &memory_target(TARGET, "")));
    let mut raw = Raw::login_with(&d, [0x80, 0, 0, 0, 0, 3], 0, Digests::BOTH)
        .await
        .unwrap();
    assert!(raw.ping(1).await);
    // A WRITE whose immediate data fails its digest: Rejected, the command discarded, its
    // CmdSN not taken (the initiator plugs the gap by sending it again).
    let write = |itt: u32, cmd_sn: u32| {
        Pdu::ScsiCommand(iscsi_pdu::ScsiCommand {
            final_bit: true,
            write: true,
            lun: Lun::ZERO,
            initiator_task_tag: itt,
            expected_data_transfer_length: 512,
            cmd_sn: SerialNumber(cmd_sn),
            cdb: cdb::write(0, 1),
            data: pattern(512, 9),
            ..iscsi_pdu::ScsiCommand::default()
        })
    };
    let mut out = BytesMut::new();
    write(5, 1).encode(Digests::BOTH, &mut out);
    let n = out.len();
    out[n - 1] ^= 0xff;
    raw.send_bytes(&out).await;
    match raw.next().await {
        Some(Pdu::Reject(r)) => assert_eq!(r.reason, iscsi_pdu::RejectReason::DataDigestError),
        other => panic!("expected a Reject, got {other:?}"),
    }
    raw.send(write(6, 1)).await;
    loop {
        match raw.next().await {
            Some(Pdu::ScsiResponse(r)) if r.initiator_task_tag == 6 => break,
            Some(_) => continue,
            None => panic!("the connection closed"),
        }
    }
    // A header digest error: nothing after it can be trusted, the connection closes.
    let mut out = BytesMut::new();
    write(7, 2).encode(Digests::BOTH, &mut out);
    out[50] ^= 0xff;
    raw.send_bytes(&out).await;
    assert!(raw.next().await.is_none());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_login_with_the_same_isid_reinstates_the_session() {
    let d = Daemon::start(&config("", &memory_target(TARGET, "")));
    let isid = [0x80, 1, 2, 3, 4, 5];
    let mut first = Raw::login(&d, isid, 0).await.unwrap();
    let old = first.tsih;
    let mut second = Raw::login(&d, isid, 0).await.unwrap();
    assert_ne!(second.tsih, old);
    assert!(
        first.next().await.is_none(),
        "the old session's connection is closed"
    );
    assert!(second.ping(1).await);
    // Joining the old session is refused; joining the new one works.
    assert_eq!(
        Raw::login(&d, isid, old).await.err(),
        Some(LoginStatus::SESSION_DOES_NOT_EXIST)
    );
    let joined = Raw::login(&d, isid, second.tsih).await;
    assert!(joined.is_ok(), "a second connection may join");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn task_management() {
    let d = Daemon::start(&config("", &memory_target(TARGET, "")));
    let s = d.session(opts()).await;
    let abort = s
        .task_management(TaskManagementFunction::AbortTask, Some(0x1234))
        .await
        .unwrap();
    assert_eq!(abort, TmfResponse::TaskDoesNotExist);
    for f in [
        TaskManagementFunction::AbortTaskSet,
        TaskManagementFunction::ClearTaskSet,
        TaskManagementFunction::LogicalUnitReset,
    ] {
        assert_eq!(
            s.task_management(f, None).await.unwrap(),
            TmfResponse::FunctionComplete
        );
    }
    assert_eq!(
        s.task_management(TaskManagementFunction::TaskReassign, Some(1))
            .await
            .unwrap(),
        TmfResponse::ReassignmentNotSupported
    );
    // The session works after the resets (the unit attention they raised is reported once).
    let _ = s
        .execute(Command::new(s.lun(), cdb::test_unit_ready()))
        .await;
    s.execute_good(Command::new(s.lun(), cdb::test_unit_ready()))
        .await
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn abort_task_ends_a_write_waiting_for_its_data() {
    let d = Daemon::start(&config("", &memory_target(TARGET, "")));
    // The raw login proposes nothing: InitialR2T stays Yes, so a WRITE without immediate data
    // waits for an R2T's Data-Out.
    let mut raw = Raw::login(&d, [0x80, 0, 0, 0, 0, 4], 0).await.unwrap();
    let write = |itt: u32, cmd_sn: u32| {
        Pdu::ScsiCommand(iscsi_pdu::ScsiCommand {
            final_bit: true,
            write: true,
            lun: Lun::ZERO,
            initiator_task_tag: itt,
            expected_data_transfer_length: 4096,
            cmd_sn: SerialNumber(cmd_sn),
            cdb: cdb::write(0, 8),
            ..iscsi_pdu::ScsiCommand::default()
        })
    };
    // The first command collects the POWER ON unit attention.
    raw.send(write(1, 1)).await;
    loop {
        match raw.next().await {
            Some(Pdu::ScsiResponse(r)) if r.initiator_task_tag == 1 => break,
            Some(_) => continue,
            None => panic!("closed"),
        }
    }
    raw.send(write(2, 2)).await;
    match raw.next().await {
        Some(Pdu::ReadyToTransfer(r)) => assert_eq!(r.initiator_task_tag, 2),
        other => panic!("expected an R2T, got {other:?}"),
    }
    raw.send(Pdu::TaskManagementRequest(
        iscsi_pdu::TaskManagementRequest {
            immediate: true,
            function: TaskManagementFunction::AbortTask,
            lun: Lun::ZERO,
            initiator_task_tag: 3,
            referenced_task_tag: 2,
            cmd_sn: SerialNumber(3),
            exp_stat_sn: SerialNumber(0),
            ref_cmd_sn: SerialNumber(2),
            exp_data_sn: 0,
        },
    ))
    .await;
    match raw.next().await {
        Some(Pdu::TaskManagementResponse(r)) => {
            assert_eq!(r.initiator_task_tag, 3);
            assert_eq!(r.response, TmfResponse::FunctionComplete);
        }
        other => panic!("expected the TMF response, got {other:?}"),
    }
    // The aborted write gets no response, and the session carries on.
    assert!(raw.ping(4).await);
    raw.send(write(5, 3)).await;
    match raw.next().await {
        Some(Pdu::ReadyToTransfer(r)) => assert_eq!(r.initiator_task_tag, 5),
        other => panic!("expected an R2T for the next write, got {other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_initiator_that_does_not_answer_pings_is_dropped() {
    let text = config("", &memory_target(TARGET, ""))
        .replace("nop_interval = 0", "nop_interval = 1\nnop_timeout = 2");
    let d = Daemon::start(&text);
    let mut raw = Raw::login(&d, [0x80, 0, 0, 0, 0, 2], 0).await.unwrap();
    // The target pings; this initiator never answers, so the target closes the connection.
    let mut pinged = false;
    loop {
        match raw.next().await {
            Some(Pdu::NopIn(n)) => {
                assert_eq!(n.initiator_task_tag, RESERVED_TAG);
                pinged = true;
            }
            Some(other) => panic!("unexpected {other:?}"),
            None => break,
        }
    }
    assert!(pinged);
    // An initiator that answers stays.
    let s = d.session(opts()).await;
    tokio::time::sleep(Duration::from_secs(4)).await;
    s.nop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn admin_changes_apply_live() {
    let d = Daemon::start(&config("", &memory_target(TARGET, "")));
    let s = d.session(opts()).await;
    let (blocks, _) = s.capacity().await.unwrap();
    assert_eq!(blocks, (64 << 20) / 512);
    // Resize: the initiator sees CAPACITY DATA HAS CHANGED, then the new size.
    let r = handle(
        &d.registry,
        AdminRequest::LunResize {
            target: TARGET.into(),
            lun: 0,
            size: "128MiB".into(),
            force: false,
        },
    );
    assert!(r.is_ok(), "{r:?}");
    let ua = s
        .execute(Command::new(s.lun(), cdb::test_unit_ready()))
        .await
        .unwrap();
    let sense = initiator_bench::Sense::parse(&ua.sense.unwrap()).unwrap();
    assert_eq!((sense.key, sense.asc, sense.ascq), (6, 0x2a, 0x09));
    assert_eq!(s.capacity().await.unwrap().0, (128 << 20) / 512);
    // No silent shrink: a smaller size is refused, saying how much would go, unless forced.
    let shrink = |force| AdminRequest::LunResize {
        target: TARGET.into(),
        lun: 0,
        size: "96MiB".into(),
        force,
    };
    let e = handle(&d.registry, shrink(false)).unwrap_err();
    assert!(e.contains("65536 blocks") && e.contains("--force"), "{e}");
    assert_eq!(s.capacity().await.unwrap().0, (128 << 20) / 512);
    handle(&d.registry, shrink(true)).unwrap();
    let _ = s
        .execute(Command::new(s.lun(), cdb::test_unit_ready()))
        .await;
    assert_eq!(s.capacity().await.unwrap().0, (96 << 20) / 512);
    // Add a LUN, see it, remove it.
    add_lun(
        &d,
        &"lun = 3\nbackend = \"file\"\npath = \"@DIR@/three.img\"\nsize = \"8MiB\""
            .replace("@DIR@", &d.dir.path().display().to_string()),
    )
    .unwrap();
    assert!(d.dir.path().join("three.img").exists());
    let s3 = Session::connect(&d.url(TARGET, 3), opts()).await.unwrap();
    let data = pattern(4096, 5);
    s3.write(0, data.clone(), 512).await.unwrap();
    assert!(s3.read(0, 8, 512).await.unwrap() == data);
    // The running config holds the changes and parses back.
    let dump = handle(&d.registry, AdminRequest::ConfigDump).unwrap();
    let text = dump.as_str().unwrap();
    let back = targetd::Config::parse(std::path::Path::new("dump"), text).unwrap();
    assert_eq!(back.targets[0].luns.len(), 2);
    // The metrics endpoint's text counts what was done.
    let metrics = targetd::metrics::text(&d.registry);
    assert!(metrics.contains("targetd_sessions 2"), "{metrics}");
    let writes = format!("targetd_lun_write_commands_total{{target=\"{TARGET}\",lun=\"3\"}} 1");
    assert!(metrics.contains(&writes), "{metrics}");
    // Sessions are listed and can be killed.
    let sessions = handle(&d.registry, AdminRequest::Sessions).unwrap();
    let tsih = sessions[0]["tsih"].as_u64().unwrap() as u16;
    handle(&d.registry, AdminRequest::SessionKill { tsih }).unwrap();
    // Bad changes are refused with the reason.
    let e = handle(
        &d.registry,
        AdminRequest::LunRemove {
            target: TARGET.into(),
            lun: 9,
            force: false,
        },
    )
    .unwrap_err();
    assert!(e.contains("no LUN 9"), "{e}");
}

#[test]
fn a_busy_port_is_refused_naming_the_key() {
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let text = config("", &memory_target(TARGET, ""))
        .replace("127.0.0.1:0", &taken.local_addr().unwrap().to_string());
    let dir = tempfile::tempdir().unwrap();
    let text = text.replace("@SOCKET@", &dir.path().join("s").display().to_string());
    let c = targetd::Config::parse(std::path::Path::new("t.toml"), &text).unwrap();
    let e = targetd::Server::start(c, "t.toml".into()).err().unwrap();
    assert_eq!(e.key, "server.portals[0]");
    assert!(e.reason.contains("in use"), "{e}");
}

#[test]
fn a_state_dir_that_cannot_be_made_is_refused_naming_the_key_and_no_tree_is_made() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("a-file");
    std::fs::write(&file, b"not a directory").unwrap();
    let text = config("", &memory_target(TARGET, ""))
        .replace("@SOCKET@", &dir.path().join("s").display().to_string())
        .replace(
            "nop_interval = 0",
            &format!("nop_interval = 0\nstate_dir = \"{}/state\"", file.display()),
        );
    let c = targetd::Config::parse(std::path::Path::new("t.toml"), &text).unwrap();
    let e = targetd::Server::start(c, "t.toml".into()).err().unwrap();
    assert_eq!(e.key, "server.state_dir");
    assert!(e.reason.contains("a-file/state"), "{e}");
    // A directory whose parent is missing is not made, nor is its parent: no silent tree.
    let missing = dir.path().join("missing");
    let text = config("", &memory_target(TARGET, ""))
        .replace("@SOCKET@", &dir.path().join("s2").display().to_string())
        .replace(
            "nop_interval = 0",
            &format!(
                "nop_interval = 0\nstate_dir = \"{}/state\"",
                missing.display()
            ),
        );
    let c = targetd::Config::parse(std::path::Path::new("t.toml"), &text).unwrap();
    let e = targetd::Server::start(c, "t.toml".into()).err().unwrap();
    assert_eq!(e.key, "server.state_dir");
    assert!(e.reason.contains("parent directory does not exist"), "{e}");
    assert!(!missing.exists());
}

/// Eight concurrent 16 MiB reads need twice a reactor's 64 MiB arena: the later ones wait for
/// buffers in arrival order and are woken as earlier ones return theirs (no polling), and
/// every read returns what was written.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reads_beyond_the_arena_wait_for_buffers() {
    let d = Daemon::start(&config("", &memory_target(TARGET, "")));
    let s = d.session(opts()).await;
    const CHUNK: usize = 16 << 20;
    let blocks = (CHUNK / 512) as u32;
    for i in 0..4 {
        let data = pattern(CHUNK, 1000 + i);
        s.write((i * CHUNK / 512) as u64, data, 512).await.unwrap();
    }
    let reads = (0..8).map(|n| {
        let s = &s;
        async move {
            let i = n % 4;
            let back = s.read((i * CHUNK / 512) as u64, blocks, 512).await.unwrap();
            assert!(back == pattern(CHUNK, 1000 + i), "read {n} of chunk {i}");
        }
    });
    futures_join_all(reads).await;
    s.logout().await.unwrap();
}

/// 96 concurrent 1 MiB writes on one connection: more than its reactor's whole arena, and
/// three times the connection's share of it, with every buffer waiting for data that comes
/// behind later commands in the stream. (The reader used to wait for the arena here, for
/// space only that data would free: no write ever finished.) The writes past the share are
/// answered TASK SET FULL, the initiator sends them again, and all of them end GOOD with
/// their data in place.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deep_queues_of_large_writes_complete() {
    let big = memory_target(TARGET, "").replace("size = \"64MiB\"", "size = \"96MiB\"");
    let d = Daemon::start(&config("", &big));
    let w = Workload {
        rw: Rw::Write,
        bs: 1 << 20,
        qd: 96,
        ios: Some(288),
        size: Some(96 << 20),
        verify: true,
        ..Workload::default()
    };
    let r = tokio::time::timeout(
        Duration::from_secs(120),
        run(&d.url(TARGET, 0), &opts(), &w, Arc::default()),
    )
    .await
    .expect("the writes finish")
    .unwrap();
    assert_eq!((r.ios, r.errors, r.verify_errors), (288, 0, 0));
    assert_eq!(r.verified_blocks, (96 << 20) / 512);
    assert!(r.resent > 0, "no write was turned away");
}

/// A run whose I/Os all fail stops once more than `max_errors` have (it ran on for its whole
/// time), and counts the failures by what they failed with rather than logging each.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_run_stops_at_max_errors_and_counts_failures_by_kind() {
    let d = Daemon::start(&config("", &memory_target(TARGET, "")));
    handle(
        &d.registry,
        AdminRequest::LunFault {
            target: TARGET.into(),
            lun: 0,
            fault: Some(backend::Fault {
                ops: backend::FaultOps::Read,
                error: backend::FaultError::Eio,
                lba: 0,
                blocks: 0,
                count: None,
            }),
        },
    )
    .unwrap();
    let w = Workload {
        rw: Rw::Randread,
        bs: 4096,
        qd: 4,
        time: Duration::from_secs(60),
        max_errors: Some(20),
        ..Workload::default()
    };
    let started = std::time::Instant::now();
    let r = tokio::time::timeout(
        Duration::from_secs(30),
        run(&d.url(TARGET, 0), &opts(), &w, Arc::default()),
    )
    .await
    .expect("the run stops at max_errors, not after its 60 s")
    .unwrap();
    assert!(started.elapsed() < Duration::from_secs(30));
    assert!(
        (21..=24).contains(&r.errors),
        "{} errors: 21, and at most the 3 others in flight",
        r.errors
    );
    assert_eq!(r.failures.len(), 1, "{:?}", r.failures);
    assert_eq!(r.failures[0].1, r.errors);
    assert!(r.failures[0].0.contains("MEDIUM ERROR"), "{:?}", r.failures);
}

/// The default CmdSN window is never an initiator's cap: 2048 commands (open-iscsi's deepest
/// session queue) may be outstanding, and 2048 reads started at once all run.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_default_command_window_admits_the_deepest_initiator_queue() {
    let d = Daemon::start(&config("", &memory_target(TARGET, "")));
    let s = d.session(opts()).await;
    let _ = s
        .execute(Command::new(s.lun(), cdb::test_unit_ready()))
        .await;
    let (exp, max) = s.command_window().expect("logged in");
    let window = max.0.wrapping_sub(exp.0).wrapping_add(1);
    assert_eq!(window, targetd::config::DEFAULT_CMDSN_WINDOW);
    assert_eq!(window, 2048);
    let mut pending = Vec::new();
    for i in 0..2048u64 {
        let c = Command::read(s.lun(), cdb::read(i, 1), 512);
        pending.push(
            tokio::time::timeout(Duration::from_secs(10), s.start(c))
                .await
                .expect("sent without waiting for the window")
                .unwrap(),
        );
    }
    for p in pending {
        p.wait().await.unwrap().good().unwrap();
    }
}

/// Runs futures concurrently on this task (the initiator's session is shared by reference).
async fn futures_join_all<F: std::future::Future<Output = ()>>(fs: impl Iterator<Item = F>) {
    let mut set: Vec<std::pin::Pin<Box<F>>> = fs.map(Box::pin).collect();
    std::future::poll_fn(|cx| {
        set.retain_mut(|f| f.as_mut().poll(cx).is_pending());
        if set.is_empty() {
            std::task::Poll::Ready(())
        } else {
            std::task::Poll::Pending
        }
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_read_or_write_takes_the_core_lock_once() {
    let d = Daemon::start(&config("", &memory_target(TARGET, "")));
    let s = d.session(opts()).await;
    // The new nexus's POWER ON unit attention goes to the first command.
    let _ = s
        .execute(Command::new(s.lun(), cdb::test_unit_ready()))
        .await;
    let target = d.registry.targets()[0].clone();
    // One at a time, so no step can serve two commands: this is the most a command costs.
    // Before the CmdSN order moved under the core's lock and a step took it once, a read cost
    // three (order, submit, completion) and a write with immediate data four; before reads
    // and writes were delegated to the connection, two (arrival, completion).
    let n = 100u64;
    let before = target.core_acquisitions();
    for i in 0..n {
        s.write(i * 8, pattern(4096, i as usize), 512)
            .await
            .unwrap();
    }
    let writes = target.core_acquisitions() - before;
    let before = target.core_acquisitions();
    for i in 0..n {
        let back = s.read(i * 8, 8, 512).await.unwrap();
        assert!(back == pattern(4096, i as usize), "block {i}");
    }
    let reads = target.core_acquisitions() - before;
    // Writes larger than FirstBurstLength: the rest of the data comes after R2Ts.
    let big = 20u64;
    let before = target.core_acquisitions();
    for i in 0..big {
        s.write(4096 + i * 1024, pattern(512 << 10, i as usize), 512)
            .await
            .unwrap();
    }
    let solicited = target.core_acquisitions() - before;
    let back = s.read(4096 + 7 * 1024, 1024, 512).await.unwrap();
    assert!(
        back == pattern(512 << 10, 7),
        "a solicited write reads back"
    );
    // A little room for a NOP exchange that takes a CmdSN meanwhile.
    assert!(writes <= n + 4, "{writes} acquisitions for {n} writes");
    assert!(reads <= n + 4, "{reads} acquisitions for {n} reads");
    assert!(
        solicited <= big + 4,
        "{solicited} acquisitions for {big} writes with R2Ts"
    );
    // Many in flight: completions that land in one turn share its acquisition.
    let before = target.core_acquisitions();
    let mut pending = Vec::new();
    for i in 0..n {
        let c = Command::read(s.lun(), cdb::read(i * 8, 8), 4096);
        pending.push(s.start(c).await.unwrap());
    }
    for p in pending {
        p.wait().await.unwrap().good().unwrap();
    }
    let concurrent = target.core_acquisitions() - before;
    assert!(
        concurrent <= n + 4,
        "{concurrent} acquisitions for {n} reads"
    );
    eprintln!("core lock acquisitions per command: writes {writes}/{n}, reads {reads}/{n}, writes with R2Ts {solicited}/{big}, {n} reads in flight {concurrent}/{n}");
    s.logout().await.unwrap();
}

/// The commands one socket read brings are taken in one step of the reader: a burst of reads
/// takes the core's lock about once, not once per read (a queue depth's commands arrive this
/// way), and every one is answered with its own data. Writes with immediate data in the same
/// burst end a batch (their data is read into its buffer first) and are answered too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_burst_of_commands_in_one_read_takes_the_core_lock_about_once() {
    let d = Daemon::start(&config("", &memory_target(TARGET, "")));
    let mut r = Raw::login(&d, [0x80, 0, 0, 0, 0, 0x2c], 0).await.unwrap();
    // The nexus's POWER ON unit attention goes to the first command.
    let sn = r.take_cmd_sn();
    r.send(common::raw::read(1, sn, 0, 1)).await;
    r.finish(1).await.expect("answered");
    let target = d.registry.targets()[0].clone();
    let n = 32u32;
    // Every command's status, and its data by tag, however the answers interleave.
    async fn answers(r: &mut Raw, tags: std::ops::Range<u32>) -> Vec<BytesMut> {
        let mut data: Vec<BytesMut> = tags.clone().map(|_| BytesMut::new()).collect();
        let mut left = tags.len();
        while left > 0 {
            let (itt, status, bytes) = match r.next().await.expect("answered") {
                Pdu::DataIn(d) => (d.initiator_task_tag, d.status.map(|s| s.status), d.data),
                Pdu::ScsiResponse(s) => (s.initiator_task_tag, Some(s.status), Bytes::new()),
                _ => continue,
            };
            let i = (itt - tags.start) as usize;
            data[i].extend_from_slice(&bytes);
            if let Some(status) = status {
                assert_eq!(status, ScsiStatus::GOOD, "task {itt}");
                left -= 1;
            }
        }
        data
    }
    // Writes of 4 KiB with immediate data and reads between them, in one segment.
    let mut burst = BytesMut::new();
    for i in 0..n {
        let sn = r.take_cmd_sn();
        let data = pattern(4096, i as usize);
        burst.extend_from_slice(&r.encode(common::raw::write(100 + 2 * i, sn, i * 8, 8, data)));
        let sn = r.take_cmd_sn();
        burst.extend_from_slice(&r.encode(common::raw::read(101 + 2 * i, sn, i * 8, 8)));
    }
    r.send_bytes(&burst).await;
    let mixed = answers(&mut r, 100..100 + 2 * n).await;
    for i in 0..n as usize {
        assert!(mixed[2 * i].is_empty(), "a write sends no data");
        assert!(
            mixed[2 * i + 1] == pattern(4096, i),
            "the read behind write {i} reads its data"
        );
    }
    // Reads only, in one segment: one step takes them all.
    let before = target.core_acquisitions();
    let mut burst = BytesMut::new();
    for i in 0..n {
        let sn = r.take_cmd_sn();
        burst.extend_from_slice(&r.encode(common::raw::read(200 + i, sn, i * 8, 8)));
    }
    r.send_bytes(&burst).await;
    let reads = answers(&mut r, 200..200 + n).await;
    for (i, data) in reads.iter().enumerate() {
        assert!(*data == pattern(4096, i), "read {i}");
    }
    let taken = target.core_acquisitions() - before;
    // One segment is one socket read unless the reader woke in the middle of it: a few
    // steps at most. Taken once per command, it would be 32.
    assert!(taken <= 4, "{taken} acquisitions for a burst of {n} reads");
    eprintln!("core lock acquisitions for a burst of {n} reads in one segment: {taken}");
}

/// The Block Limits page: by default a 32 MiB maximum (what one command may hold of the arena)
/// and a 1 MiB optimal transfer (the default MaxBurstLength), so Linux, which sends at most
/// the optimal transfer per command, sends 1 MiB requests; both set per LU, and the maximum
/// enforced.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn block_limits_follow_the_config_and_let_linux_send_large_requests() {
    let lun1 = "[[targets.luns]]\nlun = 1\nbackend = \"memory\"\nsize = \"16MiB\"\n\
                block_size = 4096\nmax_transfer_length = \"4MiB\"\n\
                optimal_transfer_length = \"256KiB\"\n";
    let d = Daemon::start(&config("", &format!("{}{lun1}", memory_target(TARGET, ""))));
    let s = d.session(opts()).await;
    let l = s.block_limits().await.unwrap();
    assert_eq!((l.max_transfer, l.optimal_transfer), (65536, 2048));
    assert_eq!(l.linux_max_blocks(512) * 512, 1 << 20, "1 MiB requests");
    s.logout().await.unwrap();
    let s = Session::connect(&d.url(TARGET, 1), opts()).await.unwrap();
    let l = s.block_limits().await.unwrap();
    assert_eq!((l.max_transfer, l.optimal_transfer), (1024, 64));
    assert_eq!(l.linux_max_blocks(4096) * 4096, 256 << 10);
    // A transfer of the maximum works; one block more is refused: ILLEGAL REQUEST, INVALID
    // FIELD IN CDB.
    let data = pattern(4 << 20, 3);
    s.write(0, data.clone(), 4096).await.unwrap();
    assert!(s.read(0, 1024, 4096).await.unwrap() == data);
    match s.read(0, 1025, 4096).await {
        Err(Error::Scsi { sense: Some(k), .. }) => {
            assert_eq!((k.key, k.asc, k.ascq), (0x05, 0x24, 0x00))
        }
        other => panic!("a transfer beyond the maximum: {other:?}"),
    }
    s.logout().await.unwrap();
    // 1 MiB writes and reads as Linux would send them: whole on LUN 0 (optimal 1 MiB), as
    // four 256 KiB commands on LUN 1. Every block written is read back and checked, by the
    // write pass and by a read pass of the whole range.
    for (lun, command) in [(0, 1u64 << 20), (1, 256 << 10)] {
        for rw in [Rw::Write, Rw::Read] {
            let w = Workload {
                rw,
                bs: 1 << 20,
                qd: 4,
                ios: Some(16),
                size: Some(16 << 20),
                verify: true,
                split: Split::Linux,
                ..Workload::default()
            };
            let r = run(&d.url(TARGET, lun), &opts(), &w, Arc::default())
                .await
                .unwrap();
            assert_eq!(r.command_bytes, command, "LUN {lun}");
            assert_eq!((r.ios, r.errors, r.verify_errors), (16, 0, 0), "LUN {lun}");
            assert_eq!(
                r.verified_blocks,
                (16 << 20) / if lun == 0 { 512 } else { 4096 }
            );
        }
    }
}

/// Reads until the target closes the connection; false if it sends anything or stays open for
/// `within`.
async fn closed_by_target(stream: &mut TcpStream, within: Duration) -> bool {
    let mut buf = [0u8; 64];
    matches!(
        tokio::time::timeout(within, stream.read(&mut buf)).await,
        Ok(Ok(0) | Err(_))
    )
}

/// Connection and session limits from the config, and a login that never finishes: beyond
/// `max_connections` a connection is closed at once, beyond `max_sessions` a login is refused
/// with "out of resources", a silent connection is dropped after `login_timeout`; the sessions
/// already open keep working throughout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connection_and_session_limits_and_the_login_timeout() {
    let text = config("", &memory_target(TARGET, "")).replace(
        "nop_interval = 0",
        "nop_interval = 0\nmax_connections = 6\nmax_sessions = 2\nlogin_timeout = 1",
    );
    let d = Daemon::start(&text);
    let mut first = Raw::login(&d, [0x80, 0, 0, 0, 0, 1], 0).await.unwrap();
    let _second = Raw::login(&d, [0x80, 0, 0, 0, 0, 2], 0).await.unwrap();
    assert_eq!(
        Raw::login(&d, [0x80, 0, 0, 0, 0, 3], 0).await.err(),
        Some(LoginStatus::OUT_OF_RESOURCES),
        "a third session"
    );
    // 100 connections at once that never log in: four fit beside the two sessions; the rest are
    // closed at once.
    let mut silent = Vec::new();
    for _ in 0..100 {
        silent.push(TcpStream::connect(d.addr).await.unwrap());
    }
    let mut refused = 0;
    for s in &mut silent {
        if closed_by_target(s, Duration::from_millis(300)).await {
            refused += 1;
        }
    }
    assert!(refused >= 94, "{refused} of 100 closed at once");
    assert!(first.ping(1).await, "an open session keeps working");
    // The four that got in are dropped once the login timeout (1 s) passes; then there is room
    // again.
    for s in &mut silent {
        assert!(closed_by_target(s, Duration::from_secs(10)).await);
    }
    let metrics = targetd::metrics::text(&d.registry);
    let count = metrics
        .lines()
        .find_map(|l| l.strip_prefix("targetd_connections_refused_total "))
        .and_then(|n| n.parse::<usize>().ok());
    // Those closed at once, counted by the target (the ones that got in may have timed out
    // while the test looked at the others).
    let count = count.expect("the counter");
    assert!((94..=refused).contains(&count), "{count}: {metrics}");
    drop(first);
    let mut again = None;
    for _ in 0..50 {
        match Raw::login(&d, [0x80, 0, 0, 0, 0, 4], 0).await {
            Ok(r) => {
                again = Some(r);
                break;
            }
            // The first session ends once the target sees its connection go.
            Err(LoginStatus::OUT_OF_RESOURCES) => {
                tokio::time::sleep(Duration::from_millis(100)).await
            }
            Err(e) => panic!("{e:?}"),
        }
    }
    assert!(again.expect("a session after one ended").ping(2).await);
}

/// The admin socket is its owner's alone (mode 0600), and targetctl run by anyone else says so
/// and what to do, instead of a bare errno.
#[test]
fn the_admin_socket_is_the_owners_and_targetctl_says_so() {
    use std::os::unix::fs::PermissionsExt;
    let d = Daemon::start(&config("", &memory_target(TARGET, "")));
    let mode = std::fs::metadata(d.socket()).unwrap().permissions().mode();
    assert_eq!(mode & 0o777, 0o600, "{mode:o}");
    let targetctl = env!("CARGO_BIN_EXE_targetctl");
    let status = std::process::Command::new(targetctl)
        .arg("--socket")
        .arg(d.socket())
        .arg("status")
        .output()
        .unwrap();
    assert!(status.status.success(), "{status:?}");
    // As another user: needs root to become one, and runuser.
    let root = std::process::Command::new("id")
        .arg("-u")
        .output()
        .is_ok_and(|o| o.stdout.starts_with(b"0\n"));
    let runuser = std::process::Command::new("sh")
        .args(["-c", "command -v runuser"])
        .output()
        .is_ok_and(|o| o.status.success());
    if !root || !runuser {
        let why = "needs root and runuser to run targetctl as another user";
        assert!(std::env::var_os("CI").is_none(), "{why}");
        eprintln!("skipped the other-user half: {why}");
        return;
    }
    // A copy of targetctl others may run (the build tree may be private).
    let copy = tempfile::tempdir().unwrap();
    std::fs::set_permissions(copy.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    let exe = copy.path().join("targetctl");
    std::fs::copy(targetctl, &exe).unwrap();
    std::fs::set_permissions(&exe, std::fs::Permissions::from_mode(0o755)).unwrap();
    // Let the other user reach the socket's directory, so the socket's own mode is what stops it.
    std::fs::set_permissions(d.dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    let out = std::process::Command::new("runuser")
        .args(["-u", "nobody", "--"])
        .arg(&exe)
        .arg("--socket")
        .arg(d.socket())
        .arg("status")
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        err.contains("permission denied") && err.contains("0600"),
        "{err}"
    );
}

/// Live changes that last: `config save` writes the running config, secrets included, over
/// the file targetd started with (atomically, mode 0600), keeping its comments and the
/// previous file as `config.toml.bak`, and says so when the file was edited on disk since;
/// a restart from it has the change; with `server.save_on_change`, every change is saved by
/// itself.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn live_changes_are_saved_to_the_config_file() {
    use std::os::unix::fs::PermissionsExt;
    let chap = "chap = { username = \"u\", secret = \"0123456789abcdef\" }";
    let d = Daemon::start(&format!(
        "# The administrator's comment.\n{}",
        config("", &memory_target(TARGET, chap))
    ));
    let file = d.dir.path().join("config.toml");
    add_lun(&d, "lun = 3\nbackend = \"memory\"\nsize = \"8MiB\"").unwrap();
    // Not saved yet: the file still has one LUN.
    let before = targetd::Config::load(&file).unwrap();
    assert_eq!(before.targets[0].luns.len(), 1);
    let e = handle(
        &d.registry,
        AdminRequest::ConfigSave {
            to: Some("relative.toml".into()),
        },
    )
    .unwrap_err();
    assert!(e.contains("absolute"), "{e}");
    handle(&d.registry, AdminRequest::ConfigSave { to: None }).unwrap();
    let after = targetd::Config::load(&file).unwrap();
    assert_eq!(
        after,
        *d.registry.config(),
        "the file holds the running config"
    );
    assert_eq!(after.targets[0].luns.len(), 2);
    assert_eq!(
        after.targets[0].chap.as_ref().unwrap().secret,
        "0123456789abcdef",
        "the real secret, not <redacted>"
    );
    let text = std::fs::read_to_string(&file).unwrap();
    assert!(
        text.starts_with("# The administrator's comment.\n"),
        "{text}"
    );
    let backup = d.dir.path().join("config.toml.bak");
    assert_eq!(targetd::Config::load(&backup).unwrap(), before);
    // Edited on disk, then saved over: the answer says so, and the edit is in the backup.
    std::fs::write(&file, format!("{text}\n# edited by hand\n")).unwrap();
    let said = handle(&d.registry, AdminRequest::ConfigSave { to: None }).unwrap();
    let said = said.as_str().unwrap();
    assert!(said.contains("changed on disk"), "{said}");
    assert!(std::fs::read_to_string(&backup)
        .unwrap()
        .contains("# edited by hand"));
    // Saved again with nothing edited: nothing to warn of.
    let said = handle(&d.registry, AdminRequest::ConfigSave { to: None }).unwrap();
    assert!(
        !said.as_str().unwrap().contains("changed on disk"),
        "{said}"
    );
    let mode = std::fs::metadata(&file).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o600);
    let leftovers: Vec<_> = std::fs::read_dir(d.dir.path())
        .unwrap()
        .filter_map(|e| e.ok())
        .filter(|e| e.file_name().to_string_lossy().contains(".tmp-"))
        .collect();
    assert!(leftovers.is_empty(), "temporary files left: {leftovers:?}");
    d.stop();

    // save_on_change: a change is in the file at once.
    let d = Daemon::start(&config("", &memory_target(TARGET, "")).replace(
        "nop_interval = 0",
        "nop_interval = 0\nsave_on_change = true",
    ));
    let file = d.dir.path().join("config.toml");
    handle(
        &d.registry,
        AdminRequest::LunResize {
            target: TARGET.into(),
            lun: 0,
            size: "128MiB".into(),
            force: false,
        },
    )
    .unwrap();
    let saved = targetd::Config::load(&file).unwrap();
    assert_eq!(
        saved.targets[0].luns[0].size,
        Some(targetd::config::Size(128 << 20))
    );
    assert!(saved.server.save_on_change);
}

/// A reload never silently drops what was made live: LUNs and targets added with targetctl
/// and not saved make it refuse, naming them, unless forced; saved, they stay. A portal added
/// by a reload is shown in `config dump` as waiting for a restart.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reload_keeps_what_was_made_live_unless_forced() {
    let d = Daemon::start(&config("", &memory_target(TARGET, "")));
    let add = |n: u16| {
        add_lun(
            &d,
            &format!("lun = {n}\nbackend = \"memory\"\nsize = \"8MiB\""),
        )
        .unwrap();
    };
    add(3);
    let e = handle(&d.registry, AdminRequest::Reload { force: false }).unwrap_err();
    assert!(
        e.contains(&format!("{TARGET} LUN 3"))
            && e.contains("config save")
            && e.contains("--force"),
        "{e}"
    );
    assert!(
        d.registry.targets()[0].lun(3).is_some(),
        "nothing was dropped"
    );
    // Forced: the file wins.
    handle(&d.registry, AdminRequest::Reload { force: true }).unwrap();
    assert!(d.registry.targets()[0].lun(3).is_none());
    // Saved: a reload keeps it, as the file now has it.
    add(4);
    handle(&d.registry, AdminRequest::ConfigSave { to: None }).unwrap();
    handle(&d.registry, AdminRequest::Reload { force: false }).unwrap();
    assert!(d.registry.targets()[0].lun(4).is_some());
    // Added and removed again: nothing to lose.
    add(5);
    handle(
        &d.registry,
        AdminRequest::LunRemove {
            target: TARGET.into(),
            lun: 5,
            force: false,
        },
    )
    .unwrap();
    handle(&d.registry, AdminRequest::Reload { force: false }).unwrap();

    // A portal added in the file listens at once; a changed reactor count waits for the
    // next start, and dump says so.
    let file = d.dir.path().join("config.toml");
    let text = std::fs::read_to_string(&file).unwrap();
    let text = text
        .replacen("portals = [", "portals = [\"127.0.0.1:0\", ", 1)
        .replacen("reactors = 2", "reactors = 3", 1);
    std::fs::write(&file, text).unwrap();
    let changes = handle(&d.registry, AdminRequest::Reload { force: false }).unwrap();
    let changes = changes.to_string();
    assert!(
        changes.contains("server.portals: listening on 127.0.0.1:")
            && changes.contains("server.reactors: takes effect at the next start"),
        "{changes}"
    );
    assert_eq!(d.registry.portals.lock().unwrap().len(), 2, "{changes}");
    let dump = handle(&d.registry, AdminRequest::ConfigDump).unwrap();
    let dump = dump.as_str().unwrap();
    assert!(
        dump.starts_with("# waiting for a restart: server.reactors = 3 (running with 2)"),
        "{dump}"
    );
    assert!(!dump.contains("server.portals ="), "{dump}");
}

/// A reload never shrinks a unit without --force: a file LUN grown live with targetctl keeps
/// its size and the data written past the file's old end when the config file still gives the
/// old size (SIGHUP and `config reload` alike), and the refusal names the unit and what would
/// be cut. A file that gives no size keeps the unit's size; a larger one grows it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reload_never_shrinks_a_unit_grown_live_unless_forced() {
    let d = Daemon::start(&config(
        "",
        &format!(
            "[[targets]]\nname = \"{TARGET}\"\n[[targets.luns]]\nlun = 0\nbackend = \"file\"\n\
             path = \"@DIR@/zero.img\"\nsize = \"8MiB\"\n"
        ),
    ));
    let image = d.dir.path().join("zero.img");
    let file = d.dir.path().join("config.toml");
    let grow = |size: &str, force| AdminRequest::LunResize {
        target: TARGET.into(),
        lun: 0,
        size: size.into(),
        force,
    };
    handle(&d.registry, grow("24MiB", false)).unwrap();
    let s = d.session(opts()).await;
    let _ = s
        .execute(Command::new(s.lun(), cdb::test_unit_ready()))
        .await;
    let data = pattern(1 << 20, 40);
    let past_old_end = (16u64 << 20) / 512;
    s.write(past_old_end, data.clone(), 512).await.unwrap();
    s.execute(Command::new(s.lun(), cdb::synchronize_cache()))
        .await
        .unwrap();
    let blocks = || d.registry.targets()[0].lun(0).unwrap().blocks;

    // The file still says 8 MiB: refused, nothing cut.
    let e = handle(&d.registry, AdminRequest::Reload { force: false }).unwrap_err();
    assert!(
        e.contains(&format!("{TARGET} LUN 0 is 24 MiB"))
            && e.contains("8 MiB")
            && e.contains("32768 blocks")
            && e.contains("--force"),
        "{e}"
    );
    assert_eq!(std::fs::metadata(&image).unwrap().len(), 24 << 20);
    assert_eq!(blocks(), (24 << 20) / 512);
    // The same through SIGHUP's path (no force).
    assert!(d.registry.reload(false).is_err());
    assert_eq!(std::fs::metadata(&image).unwrap().len(), 24 << 20);
    assert!(s.read(past_old_end, 2048, 512).await.unwrap() == data);

    // No size in the file: the unit keeps the size it has.
    let text = std::fs::read_to_string(&file).unwrap();
    std::fs::write(&file, text.replace("size = \"8MiB\"\n", "")).unwrap();
    handle(&d.registry, AdminRequest::Reload { force: false }).unwrap();
    assert_eq!(std::fs::metadata(&image).unwrap().len(), 24 << 20);
    assert_eq!(blocks(), (24 << 20) / 512);
    // A larger size grows it.
    let text = std::fs::read_to_string(&file).unwrap();
    let text = text.replace("zero.img\"\n", "zero.img\"\nsize = \"32MiB\"\n");
    std::fs::write(&file, &text).unwrap();
    let changes = handle(&d.registry, AdminRequest::Reload { force: false }).unwrap();
    assert!(
        changes.to_string().contains("resized to 32 MiB"),
        "{changes}"
    );
    assert_eq!(std::fs::metadata(&image).unwrap().len(), 32 << 20);
    assert!(s.read(past_old_end, 2048, 512).await.unwrap() == data);

    // A smaller size with another key changed as well: refused too.
    std::fs::write(
        &file,
        text.replace("32MiB", "8MiB")
            .replace("zero.img\"\n", "zero.img\"\nread_only = true\n"),
    )
    .unwrap();
    let e = handle(&d.registry, AdminRequest::Reload { force: false }).unwrap_err();
    assert!(e.contains("cut off"), "{e}");
    assert_eq!(std::fs::metadata(&image).unwrap().len(), 32 << 20);
    // Forced: the file wins, the unit is cut to it and made read-only.
    let changes = handle(&d.registry, AdminRequest::Reload { force: true }).unwrap();
    let changes = changes.to_string();
    assert!(
        changes.contains("resized to 8 MiB") && changes.contains("replaced"),
        "{changes}"
    );
    assert_eq!(std::fs::metadata(&image).unwrap().len(), 8 << 20);
    assert_eq!(blocks(), (8 << 20) / 512);
    assert!(d.registry.targets()[0].lun(0).unwrap().config.read_only);
}

/// A busy target or unit is not removed without --force, and the answer says how many
/// sessions it ends or affects.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn busy_targets_and_units_are_removed_only_when_forced() {
    let d = Daemon::start(&config("", &memory_target(TARGET, "")));
    add_lun(&d, "lun = 1\nbackend = \"memory\"\nsize = \"8MiB\"").unwrap();
    let s = d.session(opts()).await;
    let remove_lun = |force| AdminRequest::LunRemove {
        target: TARGET.into(),
        lun: 1,
        force,
    };
    let remove_target = |force| AdminRequest::TargetRemove {
        name: TARGET.into(),
        force,
    };
    let e = handle(&d.registry, remove_lun(false)).unwrap_err();
    assert!(
        e.contains(&format!(
            "removing {TARGET} LUN 1 would take it from 1 session"
        )) && e.contains("--force"),
        "{e}"
    );
    assert!(d.registry.targets()[0].lun(1).is_some());
    let e = handle(&d.registry, remove_target(false)).unwrap_err();
    assert!(
        e.contains(&format!("removing target {TARGET} would end 1 session")),
        "{e}"
    );
    s.nop().await.unwrap();
    let said = handle(&d.registry, remove_lun(true)).unwrap().to_string();
    assert!(said.contains("removed from 1 session using it"), "{said}");
    assert!(d.registry.targets()[0].lun(1).is_none());
    let said = handle(&d.registry, remove_target(true))
        .unwrap()
        .to_string();
    assert!(said.contains("removed, ending 1 session"), "{said}");
    assert!(d.registry.targets().is_empty());
    // Its connection is closed by its reactor: a NOP sent meanwhile may still be answered.
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while s.nop().await.is_ok() {
        assert!(
            std::time::Instant::now() < deadline,
            "the session did not end"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // The reactor forgets the session as its connection's task ends, just after the socket
    // closes.
    while !d.registry.sessions.all().is_empty() {
        assert!(
            std::time::Instant::now() < deadline,
            "the session was not forgotten"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }

    // Idle: no force needed.
    handle(
        &d.registry,
        AdminRequest::TargetAdd {
            target: toml::from_str(&format!("name = \"{TARGET}\"")).unwrap(),
        },
    )
    .unwrap();
    handle(&d.registry, remove_target(false)).unwrap();
}

/// `targetctl portal add/remove`: a portal listens at once (logins through it, SendTargets
/// names it), stops at once (its sessions stay), and the last one cannot go.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn portals_are_added_and_removed_while_running() {
    let d = Daemon::start(&config("", &memory_target(TARGET, "")));
    let ctl = |args: &[&str]| {
        std::process::Command::new(env!("CARGO_BIN_EXE_targetctl"))
            .arg("--socket")
            .arg(d.socket())
            .args(args)
            .output()
            .unwrap()
    };
    let out = ctl(&["portal", "add", "127.0.0.1:0"]);
    assert!(out.status.success(), "{out:?}");
    let said = String::from_utf8_lossy(&out.stdout).into_owned();
    let added: std::net::SocketAddr = said
        .split("listening on ")
        .nth(1)
        .and_then(|r| r.split_whitespace().next())
        .and_then(|a| a.parse().ok())
        .unwrap_or_else(|| panic!("the new portal's address in {said:?}"));
    // A login through it, and SendTargets through the first portal names both.
    let url = |a: std::net::SocketAddr| {
        initiator_bench::IscsiUrl::parse(&format!("iscsi://{a}/{TARGET}/0")).unwrap()
    };
    let s = Session::connect(&url(added), opts())
        .await
        .expect("a login on the new portal");
    let found = initiator_bench::discover(&d.url(TARGET, 0), &opts())
        .await
        .expect("discovery");
    assert!(
        found[0]
            .addresses
            .iter()
            .any(|a| a.starts_with(&added.to_string())),
        "{:?}",
        found[0].addresses
    );
    // Removed by the address it bound: no new connections, the session stays.
    let out = ctl(&["portal", "remove", &added.to_string()]);
    assert!(out.status.success(), "{out:?}");
    assert!(
        String::from_utf8_lossy(&out.stdout).contains(&format!("no longer listening on {added}")),
        "{out:?}"
    );
    // The accept loop is aborted on the daemon's runtime, which drops its listener when it
    // next runs (at once unless the machine is loaded): connections are refused from then on.
    let mut refused = false;
    for _ in 0..100 {
        if tokio::net::TcpStream::connect(added).await.is_err() {
            refused = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(refused, "still listening 5 s after the removal");
    let r = s
        .execute(Command::read(s.lun(), cdb::read(0, 1), 512))
        .await
        .expect("the session on the removed portal goes on");
    assert!(matches!(
        r.status,
        iscsi_pdu::ScsiStatus::GOOD | iscsi_pdu::ScsiStatus::CHECK_CONDITION
    ));
    // The last portal stays.
    let first = d.addr.to_string();
    let out = ctl(&["portal", "remove", &first]);
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("the only portal"),
        "{out:?}"
    );
    // What runs is what the config says: saved, it keeps the first portal only.
    let dump = ctl(&["config", "dump"]);
    let dump = String::from_utf8_lossy(&dump.stdout);
    assert!(!dump.contains("waiting for a restart"), "{dump}");
}

/// `targetctl lun add` of the LUN `table` describes (a `[[targets.luns]]` table's keys) to the
/// test target.
fn add_lun(d: &Daemon, table: &str) -> Result<serde_json::Value, String> {
    let lun: targetd::config::Lun = toml::from_str(table).unwrap();
    handle(
        &d.registry,
        AdminRequest::LunAdd {
            target: TARGET.into(),
            lun,
        },
    )
}

/// `targetctl target set`: a target's initiator list and CHAP change for the next login,
/// the secret read from stdin (never from argv), and `--no-chap` / `--any-initiator` undo it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn target_set_changes_who_may_log_in_with_secrets_from_stdin() {
    use std::io::Write;
    let d = Daemon::start(&config("", &memory_target(TARGET, "")));
    let ctl = |args: &[&str], stdin: Option<&str>| {
        let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_targetctl"))
            .arg("--socket")
            .arg(d.socket())
            .args(args)
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let mut input = child.stdin.take().unwrap();
        if let Some(s) = stdin {
            input.write_all(s.as_bytes()).unwrap();
        }
        drop(input);
        let out = child.wait_with_output().unwrap();
        assert!(
            out.status.success(),
            "{args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    let named = |name: &str| LoginOptions {
        initiator_name: name.into(),
        ..opts()
    };
    let refused = |err: Error, status: LoginStatus| {
        assert!(
            matches!(err, Error::LoginRefused { status: s, .. } if s == status),
            "{err}"
        )
    };
    // Only initiator "allowed".
    let changed = ctl(
        &[
            "target",
            "set",
            TARGET,
            "--initiator",
            "iqn.2026-11.io.example:allowed",
        ],
        None,
    );
    assert!(changed.contains("access rules changed"), "{changed}");
    let err = Session::connect(&d.url(TARGET, 0), named("iqn.2026-11.io.example:other"))
        .await
        .unwrap_err();
    refused(err, LoginStatus::AUTHORIZATION_FAILURE);
    let s = Session::connect(&d.url(TARGET, 0), named("iqn.2026-11.io.example:allowed"))
        .await
        .expect("the allowed initiator");
    drop(s);
    // CHAP, the secret on stdin: a login without it is refused, one with it goes in.
    ctl(
        &[
            "target",
            "set",
            TARGET,
            "--any-initiator",
            "--chap-user",
            "alice",
            "--chap-secret-file",
            "-",
        ],
        Some("0123456789abcdef\n"),
    );
    let err = Session::connect(&d.url(TARGET, 0), opts())
        .await
        .unwrap_err();
    refused(err, LoginStatus::AUTHENTICATION_FAILURE);
    let mut o = opts();
    o.settings.auth.methods = vec![AuthMethod::Chap];
    o.chap = Some(ChapCredentials::new("alice", b"0123456789abcdef", 1).unwrap());
    Session::connect(&d.url(TARGET, 0), o)
        .await
        .expect("CHAP with the secret from stdin");
    // The running config has it; config dump does not show it.
    let dump = ctl(&["config", "dump"], None);
    assert!(
        dump.contains("alice") && !dump.contains("0123456789abcdef"),
        "{dump}"
    );
    // A secret CHAP cannot use is refused by the daemon, naming the key; nothing changes.
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_targetctl"))
        .arg("--socket")
        .arg(d.socket())
        .args(["target", "set", TARGET, "--chap-user", "bob"])
        .args(["--chap-secret-file", "-"])
        .stdin(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    child.stdin.take().unwrap().write_all(b"short\n").unwrap();
    let out = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(err.contains("chap.secret"), "{err}");
    assert!(ctl(&["config", "dump"], None).contains("alice"));
    // Back to open.
    ctl(&["target", "set", TARGET, "--no-chap"], None);
    Session::connect(&d.url(TARGET, 0), opts())
        .await
        .expect("open again");
}

/// The metrics endpoint: `GET /metrics` gives every family with its HELP and TYPE, and
/// `targetd_build_info`; another path is 404, another method 405.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_metrics_endpoint_answers_at_metrics_only_and_describes_every_family() {
    use std::io::{Read, Write};
    let text = config("", &memory_target(TARGET, "")).replace(
        "reactors = 2",
        "reactors = 2\nmetrics_listen = \"127.0.0.1:0\"",
    );
    let at = std::sync::Mutex::new(None);
    let d = Daemon::start_with(&text, |s| *at.lock().unwrap() = s.metrics_addr());
    let addr = at.lock().unwrap().expect("the metrics endpoint listens");
    // Some reads and writes for the latency histograms.
    let s = d.session(opts()).await;
    let _ = s.capacity().await;
    for lba in 0..8 {
        s.write(lba * 8, pattern(4096, 1), 512).await.unwrap();
        s.read(lba * 8, 8, 512).await.unwrap();
    }
    s.logout().await.unwrap();
    let get = |request: &str| {
        let mut s = std::net::TcpStream::connect(addr).unwrap();
        s.write_all(request.as_bytes()).unwrap();
        let mut answer = String::new();
        s.read_to_string(&mut answer).unwrap();
        answer
    };
    let ok = get("GET /metrics HTTP/1.1\r\nHost: targetd\r\nConnection: close\r\n\r\n");
    assert!(ok.starts_with("HTTP/1.1 200 OK\r\n"), "{ok}");
    let body = ok.split("\r\n\r\n").nth(1).expect("a body");
    assert!(
        body.contains(&format!(
            "targetd_build_info{{version=\"{}\",",
            env!("CARGO_PKG_VERSION")
        )),
        "{body}"
    );
    let described = |prefix: &str| -> std::collections::BTreeSet<String> {
        body.lines()
            .filter_map(|l| l.strip_prefix(prefix))
            .filter_map(|l| l.split_whitespace().next())
            .map(str::to_string)
            .collect()
    };
    let (helped, typed) = (described("# HELP "), described("# TYPE "));
    assert_eq!(helped, typed, "every family has HELP and TYPE");
    assert!(typed.len() > 20, "{typed:?}");
    let histograms: std::collections::BTreeSet<&str> = body
        .lines()
        .filter_map(|l| l.strip_prefix("# TYPE "))
        .filter_map(|l| l.strip_suffix(" histogram"))
        .collect();
    for sample in body
        .lines()
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
    {
        let name = sample.split(['{', ' ']).next().unwrap_or_default();
        // A histogram's samples are its family's name with _bucket, _sum or _count.
        let family = ["_bucket", "_sum", "_count"]
            .iter()
            .find_map(|s| name.strip_suffix(s).filter(|f| histograms.contains(f)))
            .unwrap_or(name);
        assert!(typed.contains(family), "{sample}: no TYPE");
    }
    // Latency in seconds, as histograms: cumulative buckets up to +Inf, which is the count of
    // the unit's reads (8 here, the capacity's READ CAPACITY is not a read).
    let value = |l: &str| l.rsplit(' ').next().unwrap().parse::<f64>().unwrap();
    let lun0 = format!("target=\"{TARGET}\",lun=\"0\"");
    let buckets: Vec<f64> = body
        .lines()
        .filter(|l| l.starts_with("targetd_lun_read_latency_seconds_bucket{") && l.contains(&lun0))
        .map(value)
        .collect();
    assert_eq!(buckets.len(), 20, "{body}");
    assert!(
        buckets.windows(2).all(|w| w[0] <= w[1]),
        "cumulative: {buckets:?}"
    );
    assert_eq!(buckets[19], 8.0);
    let count = body
        .lines()
        .find(|l| l.starts_with("targetd_lun_read_latency_seconds_count{") && l.contains(&lun0))
        .map(value);
    assert_eq!(count, Some(8.0));
    assert!(!body.contains("latency_ns"), "seconds, not nanoseconds");
    // Counts are integers: only seconds (and histogram buckets' bounds) have a fraction.
    for sample in body.lines().filter(|l| !l.starts_with('#')) {
        let name = sample.split(['{', ' ']).next().unwrap_or_default();
        if name.ends_with("_total") && !name.contains("seconds") {
            let v = sample.rsplit(' ').next().unwrap_or_default();
            assert!(v.parse::<u64>().is_ok(), "{sample}: a count as a float");
        }
    }
    // The process_* metrics every client library exports.
    for name in [
        "process_cpu_seconds_total ",
        "process_resident_memory_bytes ",
        "process_open_fds ",
        "process_max_fds ",
        "process_start_time_seconds ",
    ] {
        assert!(
            body.lines().any(|l| l.starts_with(name)),
            "no {name}in {body}"
        );
    }
    let close = "Host: targetd\r\nConnection: close\r\n\r\n";
    assert!(get(&format!("GET / HTTP/1.1\r\n{close}")).starts_with("HTTP/1.1 404 "));
    let post = get(&format!(
        "POST /metrics HTTP/1.1\r\nContent-Length: 0\r\n{close}"
    ));
    assert!(post.starts_with("HTTP/1.1 405 "), "{post}");
    assert!(
        post.to_ascii_lowercase().contains("allow: get, head"),
        "{post}"
    );
    // A scraper keeps its connection: two requests on one, each answered whole.
    let twice = get(&format!(
        "GET /metrics HTTP/1.1\r\nHost: targetd\r\n\r\nHEAD /metrics HTTP/1.1\r\n{close}"
    ));
    assert_eq!(twice.matches("HTTP/1.1 200 OK").count(), 2, "{twice}");
    assert_eq!(
        twice.matches("targetd_build_info{").count(),
        1,
        "HEAD has no body"
    );
    d.stop();
}

/// A gateway that stops asks its initiators to log out (AsyncEvent 1) and serves them a few
/// seconds more: initiator-bench's multipath moves its I/O to the other path at that request,
/// as dm-multipath does, rather than when the gateway closes the connection; no I/O fails.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn multipath_leaves_a_stopping_gateway_at_its_logout_request() {
    // Two daemons with the same target and memory unit: the same device identifier, so two
    // paths to "one" unit for the path logic (reads only: their data is not shared).
    let a = Daemon::start(&config("", &memory_target(TARGET, "")));
    let b = Daemon::start(&config("", &memory_target(TARGET, "")));
    let urls = [a.url(TARGET, 0), b.url(TARGET, 0)];
    let w = Workload {
        rw: Rw::Randread,
        bs: 4096,
        qd: 4,
        time: Duration::from_secs(4),
        size: Some(1 << 20),
        ..Default::default()
    };
    let run = tokio::spawn(async move {
        initiator_bench::workload::run_multipath(&urls, &opts(), &w, Default::default()).await
    });
    // The run logs in to both paths, then runs on A.
    let mut sessions_on_a = 0;
    for _ in 0..100 {
        sessions_on_a = a.registry.sessions.all().len();
        if sessions_on_a == 1 && b.registry.sessions.all().len() == 1 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(sessions_on_a, 1, "the run is on path A");
    tokio::time::sleep(Duration::from_millis(500)).await;
    tokio::task::spawn_blocking(move || a.stop()).await.unwrap();
    let report = run.await.unwrap().expect("a report");
    assert_eq!(report.errors, 0, "{:?}", report.failures);
    assert_eq!(report.failovers, 1, "{report:?}");
    assert_eq!(
        report.failovers_at_logout_request, 1,
        "it left A only when A closed: {report:?}"
    );
    assert!(report.ios > 0);
    drop(b);
}
