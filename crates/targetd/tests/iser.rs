//! targetd's iSER portal end to end over the software fabric: the daemon serves iSER on a
//! [`Switch`](rdma::switch::Switch) (its portal on a reactor, data in the reactor's arena, file
//! units through its engine) and a small initiator (tests/common/iser.rs) on the test's thread
//! connects with the iSER CM header, logs in with iscsi-pdu's initiator login asking for
//! RDMAExtensions, and reads and writes with its buffers named in iSER headers: the target
//! moves the data with RDMA READ and WRITE. It is refused without RDMAExtensions, logs out,
//! and is asked to log out when the daemon stops.

mod common;

use bytes::Bytes;
use std::sync::atomic::Ordering::Relaxed;
use std::time::{Duration, Instant};

use common::iser::{daemon, daemon_with, settings, Initiator, WAIT};
use iscsi_pdu::initiator::LoginError;
use iscsi_pdu::iser::IserHeader;
use iscsi_pdu::pdu::LoginStatus;
use iscsi_pdu::{AsyncEvent, LogoutReason, LogoutRequest, Pdu, ScsiStatus, SerialNumber};
use rdma::verbs::Verbs;

fn rw10(op: u8, lba: u32, blocks: u16) -> [u8; 10] {
    let mut c = [0u8; 10];
    c[0] = op;
    c[2..6].copy_from_slice(&lba.to_be_bytes());
    c[7..9].copy_from_slice(&blocks.to_be_bytes());
    c
}

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len).map(|i| (i / 7) as u8 ^ seed).collect()
}

#[test]
fn reads_and_writes_move_by_rdma() {
    let (switch, d) = daemon();
    let mut i = Initiator::connect(&switch);
    let done = i.login(settings(true)).expect("logged in");
    assert!(done.session.operational.rdma_extensions);
    assert!(
        done.session.operational.initial_r2t,
        "iSER asks for InitialR2T=Yes"
    );
    assert_eq!(done.connection.max_send_data_segment_length, 8192);
    // A window the initiator's receives cover (iscsi.cmdsn_window is 2048 over TCP).
    assert_eq!(
        done.max_cmd_sn.0.wrapping_sub(done.exp_cmd_sn.0) + 1,
        targetd::iser::ISER_CMDSN_WINDOW
    );
    // The session list says the connection runs over iSER.
    let sessions = targetd::admin::handle(&d.registry, targetd::admin::AdminRequest::Sessions)
        .expect("the session list");
    assert_eq!(
        sessions[0]["connections"][0]["transport"], "iser",
        "{sessions}"
    );
    // The new session's unit attention.
    let (r, _) = i.command(&[0; 6], None, 0, 0);
    assert_eq!(r.status, ScsiStatus::CHECK_CONDITION);
    // 1 MiB + 8 KiB: 8 KiB of immediate data, the rest read by the target in bursts.
    let data = pattern((1 << 20) + 8192, 0x5a);
    let blocks = (data.len() / 512) as u16;
    let (r, _) = i.command(&rw10(0x2a, 2048, blocks), Some(&data), 8192, 0);
    assert_eq!(r.status, ScsiStatus::GOOD, "{r:?}");
    // On the medium where it should be.
    let file = std::fs::read(d.dir.path().join("lun0.img")).unwrap();
    assert!(file[2048 * 512..2048 * 512 + data.len()] == data[..]);
    // Back by RDMA WRITE, then the status.
    let (r, back) = i.command(&rw10(0x28, 2048, blocks), None, 0, data.len());
    assert_eq!((r.status, r.exp_data_sn), (ScsiStatus::GOOD, 0));
    assert!(back == data);
    // The 1 MiB of solicited data came in four RDMA READs of MaxBurstLength (256 KiB), the
    // read back in one RDMA WRITE.
    let m = &d.registry;
    assert_eq!(m.counters.iser_rdma_reads.load(Relaxed), 4);
    assert_eq!(m.counters.iser_rdma_writes.load(Relaxed), 1);
    assert_eq!(m.counters.iser_connections.load(Relaxed), 1);
    // Parameter data (INQUIRY) goes by RDMA WRITE too.
    let (r, inq) = i.command(&[0x12, 0, 0, 0, 96, 0], None, 0, 96);
    assert_eq!(r.status, ScsiStatus::GOOD);
    assert_eq!(inq[0] & 0x1f, 0, "a disk");
    assert!(
        inq[8..16].iter().all(u8::is_ascii),
        "vendor: {:?}",
        &inq[8..16]
    );
    // A write all in immediate data.
    let small = pattern(4096, 0x33);
    let (r, _) = i.command(&rw10(0x2a, 0, 8), Some(&small), 4096, 0);
    assert_eq!(r.status, ScsiStatus::GOOD);
    let (_, back) = i.command(&rw10(0x28, 0, 8), None, 0, 4096);
    assert!(back == small);
    // The most immediate data behind the largest CDB (260 bytes: an extended-CDB AHS of 252)
    // fits the target's receive buffer; the core sees a WRITE(10) and the bytes beyond it.
    let full = pattern(8192, 0x44);
    let extended = Some(Bytes::from(vec![0u8; 244]));
    let (r, _) = i.command_extended(&rw10(0x2a, 64, 16), extended, Some(&full), 8192, 0);
    assert_eq!(r.status, ScsiStatus::GOOD, "{r:?}");
    let (_, back) = i.command(&rw10(0x28, 64, 16), None, 0, 8192);
    assert!(back == full);
    // Logout: the response, then the target lets the queue pair go.
    let logout = Pdu::LogoutRequest(LogoutRequest {
        immediate: true,
        reason: LogoutReason::CloseSession,
        initiator_task_tag: 0x1000,
        cid: 1,
        cmd_sn: SerialNumber(i.cmd_sn),
        ..LogoutRequest::default()
    });
    i.send(&logout, IserHeader::default());
    assert!(matches!(i.recv(), Some(Pdu::LogoutResponse(_))));
    // The initiator lets the connection go; the target's side ends.
    i.verbs.disconnect(i.qp);
    let deadline = Instant::now() + WAIT;
    while !d.registry.sessions.all().is_empty()
        || d.registry.counters.iser_connections.load(Relaxed) > 0
    {
        assert!(Instant::now() < deadline, "the session ends");
        std::thread::sleep(Duration::from_millis(5));
    }
    d.stop();
}

#[test]
fn a_normal_session_without_rdma_extensions_is_refused() {
    let (switch, d) = daemon();
    let mut i = Initiator::connect(&switch);
    let e = i.login(settings(false)).unwrap_err();
    assert_eq!(e, LoginError::Refused(LoginStatus::MISSING_PARAMETER));
    // An initiator that stays is disconnected by the target soon after.
    let started = Instant::now();
    assert!(i.recv().is_none(), "disconnected after the refusal");
    assert!(
        started.elapsed() >= Duration::from_secs(1),
        "the initiator had time to go first"
    );
    // A discovery session needs no RDMA: it logs in and asks SendTargets.
    let mut i = Initiator::connect(&switch);
    let mut s = settings(false);
    s.declarations.session_type = iscsi_pdu::negotiation::SessionType::Discovery;
    s.declarations.target_name = None;
    i.login(s).expect("a discovery session");
    // Both logins counted by their answers, under iSER.
    let counted = |status: LoginStatus| d.registry.counters.logins[1][status.index()].load(Relaxed);
    assert_eq!(counted(LoginStatus::MISSING_PARAMETER), 1);
    assert_eq!(counted(LoginStatus::SUCCESS), 1);
    d.stop();
}

#[test]
fn the_daemon_asks_a_live_session_to_log_out_when_it_stops() {
    let (switch, d) = daemon();
    let mut i = Initiator::connect(&switch);
    i.login(settings(true)).expect("logged in");
    let stopping = std::thread::spawn(move || d.stop());
    match i.recv() {
        Some(Pdu::AsyncMessage(m)) => assert_eq!(m.event, AsyncEvent::LogoutRequested),
        other => panic!("no logout request: {other:?}"),
    }
    let logout = Pdu::LogoutRequest(LogoutRequest {
        immediate: true,
        reason: LogoutReason::CloseSession,
        initiator_task_tag: 9,
        cid: 1,
        cmd_sn: SerialNumber(i.cmd_sn),
        ..LogoutRequest::default()
    });
    i.send(&logout, IserHeader::default());
    assert!(matches!(i.recv(), Some(Pdu::LogoutResponse(_))));
    stopping.join().expect("the daemon stops");
}

#[test]
fn hostile_messages_end_their_connection_and_no_other() {
    let (switch, d) = daemon();
    let mut good = Initiator::connect(&switch);
    good.login(settings(true)).expect("logged in");
    let _ = good.command(&[0; 6], None, 0, 0);
    // A PDU with an opcode no initiator sends is answered with a Reject; the connection goes on.
    let mut bad = Initiator::connect(&switch);
    bad.isid = 2;
    bad.login(settings(true)).expect("logged in");
    let mut m = bytes::BytesMut::new();
    iscsi_pdu::iser::encode(
        &Pdu::NopOut(iscsi_pdu::NopOut {
            initiator_task_tag: 1,
            target_transfer_tag: iscsi_pdu::RESERVED_TAG,
            cmd_sn: SerialNumber(bad.cmd_sn),
            ..iscsi_pdu::NopOut::default()
        }),
        &IserHeader::default(),
        &mut m,
    );
    m[iscsi_pdu::iser::ISER_HEADER_LEN] = 0x1e;
    let n = m.len();
    bad.verbs.post_send(bad.qp, 1, m.to_vec(), n);
    assert!(matches!(bad.recv(), Some(Pdu::Reject(_))), "a Reject");
    let (r, _) = bad.command(&[0; 6], None, 0, 0);
    assert_eq!(
        r.status,
        ScsiStatus::CHECK_CONDITION,
        "the new session's unit attention"
    );
    // A message shorter than its header says: the framing cannot be trusted, and the target
    // lets the connection go.
    bad.verbs.post_send(bad.qp, 2, vec![0x10; 40], 40);
    assert!(bad.recv().is_none(), "disconnected");
    // An unknown iSER opcode on a third connection: the same.
    let mut third = Initiator::connect(&switch);
    third.verbs.post_send(third.qp, 1, vec![0x70; 80], 80);
    assert!(third.recv().is_none(), "disconnected");
    // The first connection has seen nothing of it.
    let data = vec![0x42; 8192];
    let (r, _) = good.command(&[0x2a, 0, 0, 0, 0, 0, 0, 0, 16, 0], Some(&data), 8192, 0);
    assert_eq!(r.status, ScsiStatus::GOOD);
    let (r, back) = good.command(&[0x28, 0, 0, 0, 0, 0, 0, 0, 16, 0], None, 0, 8192);
    assert_eq!(r.status, ScsiStatus::GOOD);
    assert!(back == data);
    d.stop();
}

#[test]
fn an_idle_connection_is_pinged_and_dropped_when_it_does_not_answer() {
    let (switch, d) =
        daemon_with(|t| t.replace("nop_interval = 0", "nop_interval = 1\nnop_timeout = 1"));
    let mut i = Initiator::connect(&switch);
    i.login(settings(true)).expect("logged in");
    // A NOP-In ping after a second of silence; answered, the connection stays.
    let Some(Pdu::NopIn(ping)) = i.recv() else {
        panic!("no ping");
    };
    assert_eq!(ping.initiator_task_tag, iscsi_pdu::RESERVED_TAG);
    let answer = Pdu::NopOut(iscsi_pdu::NopOut {
        immediate: true,
        initiator_task_tag: iscsi_pdu::RESERVED_TAG,
        target_transfer_tag: ping.target_transfer_tag,
        cmd_sn: SerialNumber(i.cmd_sn),
        ..iscsi_pdu::NopOut::default()
    });
    i.send(&answer, IserHeader::default());
    let (r, _) = i.command(&[0; 6], None, 0, 0);
    assert_eq!(r.status, ScsiStatus::CHECK_CONDITION, "still served");
    // The next ping goes unanswered: the connection is dropped.
    assert!(matches!(i.recv(), Some(Pdu::NopIn(_))));
    assert!(i.recv().is_none(), "dropped after the NOP timeout");
    d.stop();
}

/// More writes at once than the portal's share of the arena holds (15 of 4 MiB, half of a
/// 64 MiB arena): the later ones wait for buffers the earlier give back, which they do as
/// their RDMA READs end. (A write waiting for its buffer once stopped its queue pair's
/// completions, those READs' among them: a deadlock that libiscsi's Write10.Async found.)
#[test]
fn writes_beyond_the_arena_wait_for_buffers_earlier_writes_give_back() {
    use iscsi_pdu::iser::RemoteBuffer;
    use iscsi_pdu::{Lun, ScsiCommand};

    let (switch, d) = daemon();
    let mut i = Initiator::connect(&switch);
    i.login(settings(true)).expect("logged in");
    let (r, _) = i.command(&[0; 6], None, 0, 0);
    assert_eq!(
        r.status,
        ScsiStatus::CHECK_CONDITION,
        "the new session's attention"
    );
    let data = pattern(4 << 20, 0x21);
    switch.with(|f| f.memory_mut(i.memory)[..data.len()].copy_from_slice(&data));
    let writes = 15u32;
    let send = |i: &mut Initiator, k: u32| {
        i.itt += 1;
        let mut cdb = [0u8; 16];
        cdb[..10].copy_from_slice(&rw10(0x2a, k * 8192, 8192));
        let cmd = Pdu::ScsiCommand(ScsiCommand {
            final_bit: true,
            write: true,
            lun: Lun::ZERO,
            initiator_task_tag: i.itt,
            expected_data_transfer_length: 4 << 20,
            cmd_sn: SerialNumber(i.cmd_sn),
            cdb,
            ..ScsiCommand::default()
        });
        i.cmd_sn += 1;
        let write = Some(RemoteBuffer {
            stag: i.region.rkey,
            va: i.region.addr,
        });
        i.send(&cmd, IserHeader { write, read: None });
        i.itt
    };
    let mut pending: std::collections::HashMap<u32, u32> =
        (0..writes).map(|k| (send(&mut i, k), k)).collect();
    // Every write is answered: GOOD, or TASK SET FULL when the connection's share of the
    // arena is all waiting for data-out (then sent again, as an initiator does).
    let mut busy = 0;
    while !pending.is_empty() {
        let Some(Pdu::ScsiResponse(r)) = i.recv() else {
            panic!("a SCSI Response for each write");
        };
        let k = pending.remove(&r.initiator_task_tag).expect("a write's");
        match r.status {
            ScsiStatus::GOOD => {}
            ScsiStatus::TASK_SET_FULL => {
                busy += 1;
                let itt = send(&mut i, k);
                pending.insert(itt, k);
            }
            _ => panic!("{r:?}"),
        }
    }
    println!("{busy} writes answered TASK SET FULL and sent again");
    let file = std::fs::read(d.dir.path().join("lun0.img")).unwrap();
    for k in [0, writes as usize - 1] {
        let at = k * 8192 * 512;
        assert!(
            file[at..at + data.len()] == data[..],
            "write {k} on the medium"
        );
    }
    d.stop();
}

/// initiator-bench's iSER runner (the one it runs on RDMA devices) against targetd over the
/// switch: random reads and writes at queue depth 16 on the file unit, small writes with
/// immediate data and large ones read by the target, every read checked and every block
/// written read back, for each way of registering; then a logout.
#[test]
fn initiator_bench_runs_verified_iser_workloads_against_targetd() {
    use common::iser::INITIATOR_NODE;
    use initiator_bench::iser::{run_channels, IserChannel};
    use initiator_bench::rdma::{place_len, RdmaOptions};
    use initiator_bench::srp::LinkModel;
    use initiator_bench::workload::{Rw, Workload};
    use rdma::switch::Endpoint;
    use srp::initiator::Registration;

    let (switch, d) = daemon();
    for (s, (registration, bs)) in [
        (Registration::Pool, 4096),
        (Registration::Cache, 32 * 1024),
        (Registration::PerCommand, 128 * 1024),
    ]
    .into_iter()
    .enumerate()
    {
        let w = Workload {
            rw: Rw::Randrw,
            bs,
            qd: 16,
            sessions: 1,
            ios: Some(600),
            size: Some(4 << 20),
            verify: true,
            ..Workload::default()
        };
        let o = RdmaOptions {
            registration,
            regions: 1,
            link: LinkModel::Free,
            immediate_data: true,
        };
        let qp = common::iser::connect_queue_pair(&switch);
        let mut verbs: Endpoint<Vec<u8>> = switch.endpoint(INITIATOR_NODE);
        let ch = IserChannel::login(
            &mut verbs,
            qp,
            common::TARGET,
            s as u16,
            &o,
            16,
            place_len(&w, &o),
        )
        .expect("logged in");
        assert!(
            ch.datamover()
                .session()
                .params()
                .operational
                .rdma_extensions
        );
        let mut channels = [ch];
        let r = run_channels(&mut verbs, &mut channels, 0, &w, &o).expect("the run");
        assert_eq!(r.transport, "iSER");
        assert_eq!((r.ios, r.errors), (600, 0), "{}", registration.name());
        assert!(r.verified_blocks > 0, "reads were checked");
        assert_eq!(r.verify_errors, 0, "{}", registration.name());
        channels[0].logout(&mut verbs).expect("logged out");
        if s == 2 {
            // More than one region cannot be named in an iSER header: the run says so before
            // it sends anything.
            let o = RdmaOptions { regions: 2, ..o };
            let e = run_channels(&mut verbs, &mut channels, 0, &w, &o).unwrap_err();
            assert!(e.contains("--regions 1"), "{e}");
        }
    }
    d.stop();
}
