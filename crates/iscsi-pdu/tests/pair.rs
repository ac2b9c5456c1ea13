//! The deterministic pair: the initiator's and the target's machines against each other on a
//! virtual clock, through links that cut, delay, lose and corrupt bytes. Both sides log in
//! through their own login machines; every run is the same run.

use std::time::Duration;

use bytes::Bytes;
use iscsi_pdu::initiator::{Command, Failure, Reply, ScsiReply, Timers};
use iscsi_pdu::pair::{Faults, Pair, PairOptions};
use iscsi_pdu::target_node::Close;
use iscsi_pdu::{Lun, ScsiStatus, TaskManagementFunction, TmfResponse};
use proptest::prelude::*;

const MINUTE: Duration = Duration::from_secs(60);

fn cdb16(op: u8, lba: u64, blocks: u32) -> [u8; 16] {
    let mut c = [0u8; 16];
    c[0] = op;
    c[2..10].copy_from_slice(&lba.to_be_bytes());
    c[10..14].copy_from_slice(&blocks.to_be_bytes());
    c
}

fn write(lba: u64, data: Bytes) -> Command {
    let blocks = (data.len() / 512) as u32;
    Command::write(Lun::ZERO, cdb16(0x8a, lba, blocks), data)
}

fn read(lba: u64, blocks: u32) -> Command {
    Command::read(Lun::ZERO, cdb16(0x88, lba, blocks), blocks * 512)
}

fn pattern(len: usize, seed: u8) -> Bytes {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed) ^ (i >> 9) as u8)
        .collect()
}

fn scsi(r: Option<Result<Reply, Failure>>) -> ScsiReply {
    match r {
        Some(Ok(Reply::Scsi(s))) => s,
        other => panic!("a SCSI reply, not {other:?}"),
    }
}

fn good(r: Option<Result<Reply, Failure>>) -> Bytes {
    let s = scsi(r);
    assert_eq!(s.status, ScsiStatus::GOOD, "{s:?}");
    s.data
}

/// A pair whose power-on unit attention has been taken by a TEST UNIT READY.
fn pair(options: PairOptions) -> Pair {
    let mut p = Pair::new(options);
    let tur = Command::new(Lun::ZERO, [0; 16]);
    let r = scsi(p.execute(&tur));
    assert_eq!(
        r.status,
        ScsiStatus::CHECK_CONDITION,
        "power on reported once"
    );
    good(p.execute(&tur));
    p
}

/// Small segments and bursts on both sides, so that a few KiB take many PDUs and R2Ts.
fn small(initial_r2t: bool, immediate_data: bool, digests: bool) -> PairOptions {
    let mut o = PairOptions::default();
    let t = &mut o.target.target;
    t.max_recv_data_segment_length = 8192;
    t.operational.first_burst_length = 16384;
    t.operational.max_burst_length = 65536;
    t.operational.max_outstanding_r2t = 4;
    let i = &mut o.initiator;
    i.max_recv_data_segment_length = 4096;
    i.operational.initial_r2t = initial_r2t;
    i.operational.immediate_data = immediate_data;
    i.operational.first_burst_length = 16384;
    i.operational.max_burst_length = 65536;
    if digests {
        use iscsi_pdu::negotiation::DigestAlgorithm::{Crc32c, None};
        for s in [&mut o.target.target, &mut o.initiator] {
            s.header_digest = vec![Crc32c, None];
            s.data_digest = vec![Crc32c, None];
        }
        o.initiator.header_digest = vec![Crc32c];
        o.initiator.data_digest = vec![Crc32c];
    }
    o
}

#[test]
fn both_login_machines_agree_and_every_r2t_path_moves_the_bytes() {
    for (initial_r2t, immediate_data) in
        [(false, true), (true, true), (false, false), (true, false)]
    {
        let mut p = pair(small(initial_r2t, immediate_data, false));
        let op = p.params().operational;
        assert_eq!(
            (op.initial_r2t, op.immediate_data),
            (initial_r2t, immediate_data)
        );
        for (n, bytes) in [512usize, 8192, 16384 + 512, 65536 + 4096, 300 * 1024]
            .into_iter()
            .enumerate()
        {
            let lba = n as u64 * 1024;
            let data = pattern(bytes, n as u8);
            good(p.execute(&write(lba, data.clone())));
            assert!(
                p.rig.stored(lba, (bytes / 512) as u32) == data,
                "stored {bytes}"
            );
            let back = good(p.execute(&read(lba, (bytes / 512) as u32)));
            assert!(back == data, "read back {bytes}");
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(24))]
    /// Writes and reads in flight together, every byte stream cut at random points both ways,
    /// with and without digests, with a delay: the same bytes land and come back.
    #[test]
    fn any_cut_and_delay_gives_the_same_result(
        seed in 1u64..u64::MAX,
        digests in any::<bool>(),
        delay_us in 0u64..2000,
        initial_r2t in any::<bool>(),
    ) {
        let mut p = pair(small(initial_r2t, true, digests));
        let faults = Faults {
            cut: Some(seed),
            delay: Duration::from_micros(delay_us),
            ..Faults::default()
        };
        p.set_faults(faults.clone(), Faults { cut: Some(seed ^ 0x5555), ..faults });
        let writes: Vec<_> = (0..6u8)
            .map(|k| {
                let data = pattern(4096 * (1 + k as usize), k);
                (u64::from(k) * 256, data)
            })
            .collect();
        let itts: Vec<u32> = writes
            .iter()
            .map(|(lba, data)| p.start(&write(*lba, data.clone())).expect("in the window"))
            .collect();
        for itt in itts {
            good(p.wait(itt, MINUTE));
        }
        let reads: Vec<u32> = writes
            .iter()
            .map(|(lba, data)| p.start(&read(*lba, (data.len() / 512) as u32)).expect("window"))
            .collect();
        for ((_, data), itt) in writes.iter().zip(reads) {
            prop_assert!(good(p.wait(itt, MINUTE)) == *data);
        }
    }
}

#[test]
fn a_command_whose_data_digest_fails_is_sent_again_and_fills_its_cmd_sn() {
    let mut p = pair(small(false, true, true));
    // Past the 48-byte header and its 4-byte digest: inside the immediate data.
    let flip = Faults {
        flip: Some(48 + 4 + 100),
        ..Faults::default()
    };
    p.set_faults(flip, Faults::default());
    let data = pattern(4096, 9);
    good(p.execute(&write(8, data.clone())));
    assert!(p.rig.stored(8, 8) == data, "the retried write landed whole");
    // The CmdSN the rejected copy carried was filled: later commands run.
    assert!(good(p.execute(&read(8, 8))) == data);
}

#[test]
fn a_data_out_whose_digest_fails_ends_its_command_with_check_condition() {
    let mut p = pair(small(true, false, true));
    // The command goes first (a header and its digest, no data: ImmediateData=No), then the
    // Data-Out answering the R2T: its data starts after its own header and digest.
    let flip = Faults {
        flip: Some(52 + 52 + 10),
        ..Faults::default()
    };
    p.set_faults(flip, Faults::default());
    let itt = p.start(&write(0, pattern(8192, 4))).expect("window");
    let r = scsi(p.wait(itt, MINUTE));
    assert_eq!(r.status, ScsiStatus::CHECK_CONDITION);
    let sense = r.sense.expect("sense");
    assert_eq!((sense[2] & 0x0f, sense[12], sense[13]), (0x0b, 0x47, 0x05));
    // The session goes on.
    good(p.execute(&read(0, 1)));
}

#[test]
fn a_flipped_header_bit_closes_the_connection_and_fails_its_tasks() {
    let mut p = pair(small(false, true, true));
    p.set_faults(
        Faults {
            flip: Some(20),
            ..Faults::default()
        },
        Faults::default(),
    );
    let r = p.execute(&read(0, 8));
    assert!(
        matches!(r, Some(Err(Failure::ConnectionLost(_)))),
        "the task fails with the connection: {r:?}"
    );
    assert!(p.rig.closed().is_some_and(|w| w.contains("digest")));
    assert!(!p.initiator.is_alive());
    assert!(p.rig.conn().is_idle());
}

#[test]
fn a_cut_link_is_found_by_the_targets_ping_in_virtual_time() {
    let mut p = pair(PairOptions::default());
    // Nothing from the initiator reaches the target any more.
    p.set_faults(
        Faults {
            lose_after: Some(0),
            ..Faults::default()
        },
        Faults::default(),
    );
    let start = p.now();
    let closed = p.run_until(|p| p.rig.closed().is_some(), MINUTE);
    assert!(closed, "the target gave up on the initiator");
    assert_eq!(p.rig.conn().closing(), Some(Close::NoPingAnswer));
    // Ping after 5 s of silence, drop 5 s later (the rig's defaults).
    assert_eq!(p.now() - start, Duration::from_secs(10));
    // The initiator answered the ping; its answer was lost on the way.
    assert!(p.initiator_closed().is_some());
}

#[test]
fn an_answered_ping_keeps_an_idle_connection() {
    let mut p = pair(PairOptions::default());
    let stayed = !p.run_until(|p| p.rig.closed().is_some(), Duration::from_secs(120));
    assert!(stayed, "pinged every 5 s and answered, for two minutes");
    good(p.execute(&read(0, 1)));
}

#[test]
fn a_command_left_unanswered_times_out_on_the_initiators_clock_and_its_late_answer_is_ignored() {
    let mut p = pair(PairOptions::default());
    p.set_timers(Timers {
        task: Some(Duration::from_secs(3)),
        ..Timers::default()
    });
    // Every answer takes 5 s to come back.
    let late = Faults {
        delay: Duration::from_secs(5),
        ..Faults::default()
    };
    p.set_faults(Faults::default(), late);
    let start = p.now();
    let itt = p.start(&read(0, 8)).expect("window open");
    assert!(matches!(p.wait(itt, MINUTE), Some(Err(Failure::TimedOut))));
    assert_eq!(
        p.now() - start,
        Duration::from_secs(3),
        "at its deadline, not later"
    );
    // The answer arrives after all: nobody waits for it, and the session goes on.
    p.run_until(|_| false, Duration::from_secs(5));
    assert!(p.wait(itt, Duration::ZERO).is_none(), "no second end");
    assert!(p.initiator_closed().is_none());
    p.set_faults(Faults::default(), Faults::default());
    good(p.execute(&read(0, 1)));
}

#[test]
fn the_initiator_pings_a_quiet_connection_and_gives_it_up_when_no_answer_comes() {
    let mut p = pair(PairOptions::default());
    p.set_timers(Timers {
        nop_interval: Some(Duration::from_secs(2)),
        nop_timeout: Duration::from_secs(3),
        ..Timers::default()
    });
    // Answered pings keep the connection, and surface as no task's end.
    let stayed = !p.run_until(|p| p.initiator_closed().is_some(), MINUTE);
    assert!(stayed, "pinged every 2 s and answered, for a minute");
    good(p.execute(&read(0, 1)));
    // Nothing from the target reaches the initiator any more.
    p.set_faults(
        Faults::default(),
        Faults {
            lose_after: Some(0),
            ..Faults::default()
        },
    );
    let start = p.now();
    let itt = p.start(&read(0, 1)).expect("window open");
    let closed = p.run_until(|p| p.initiator_closed().is_some(), MINUTE);
    assert!(closed, "the initiator gave the connection up");
    // A ping after 2 s of silence, given up 3 s later.
    assert_eq!(p.now() - start, Duration::from_secs(5));
    assert!(matches!(
        p.wait(itt, Duration::ZERO),
        Some(Err(Failure::ConnectionLost(_)))
    ));
}

#[test]
fn the_window_holds_commands_back_until_the_target_opens_it() {
    let mut o = PairOptions::default();
    o.target.window = 4;
    let mut p = pair(o);
    p.rig.hold_backend = true;
    let started: Vec<_> = (0..6).map(|k| p.start(&read(k, 1))).collect();
    assert!(started[..4].iter().all(Result::is_ok), "{started:?}");
    assert!(
        started[4..]
            .iter()
            .all(|r| *r == Err(iscsi_pdu::initiator::StartError::WindowClosed)),
        "{started:?}"
    );
    p.rig.hold_backend = false;
    while p.rig.release_backend() {
        p.pump();
    }
    for itt in started.into_iter().flatten() {
        good(p.wait(itt, MINUTE));
    }
    // The window moved with the responses: the two held back may go now.
    for k in 4..6 {
        good(p.execute(&read(k, 1)));
    }
}

#[test]
fn abort_task_ends_the_task_on_both_sides() {
    let mut p = pair(PairOptions::default());
    p.rig.hold_backend = true;
    let itt = p.start(&read(0, 8)).expect("window");
    let tmf = p
        .start_with(|s, now| {
            s.start_task_management(now, TaskManagementFunction::AbortTask, Lun::ZERO, Some(itt))
        })
        .expect("immediate");
    p.rig.hold_backend = false;
    while p.rig.release_backend() {
        p.pump();
    }
    match p.wait(tmf, MINUTE) {
        Some(Ok(Reply::Tmf(TmfResponse::FunctionComplete))) => {}
        other => panic!("{other:?}"),
    }
    let aborted = p.done.remove(&itt);
    assert!(
        matches!(aborted, Some(Err(Failure::Aborted))),
        "{aborted:?}"
    );
    assert!(p.rig.conn().is_idle());
    good(p.execute(&read(0, 1)));
}

#[test]
fn send_targets_in_full_feature_phase() {
    let mut p = pair(PairOptions::default());
    let itt = p
        .start_with(|s, now| s.start_text(now, Bytes::from_static(b"SendTargets=All\0")))
        .expect("immediate");
    match p.wait(itt, MINUTE) {
        Some(Ok(Reply::Text(t))) => assert!(
            t.starts_with(b"TargetName=iqn.2026-11.io.example:rig\0"),
            "{t:?}"
        ),
        other => panic!("{other:?}"),
    }
    good(p.execute(&read(0, 1)));
}

#[test]
fn logout_ends_the_session_cleanly() {
    let mut p = pair(PairOptions::default());
    let itt = p
        .start_with(|s, now| s.start_logout(now))
        .expect("immediate");
    match p.wait(itt, MINUTE) {
        Some(Ok(Reply::Logout)) => {}
        other => panic!("{other:?}"),
    }
    assert!(p.initiator_closed() == Some("logged out"));
}

/// A pair whose initiator and target allow `n` connections per session.
fn multi(n: u16) -> PairOptions {
    let mut o = PairOptions::default();
    o.initiator.operational.max_connections = n;
    o
}

fn slow(ms: u64) -> Faults {
    Faults {
        delay: Duration::from_millis(ms),
        ..Faults::default()
    }
}

#[test]
fn connections_of_one_session_keep_command_order_across_their_delays() {
    let mut p = pair(multi(4));
    // Two more connections, each slower than the one before: a command on a slow connection
    // reaches the target after later commands on faster ones, which must wait for it.
    for (cid, ms) in [(2, 3), (3, 7)] {
        p.connect(cid, slow(ms), slow(ms));
    }
    assert_eq!(p.initiator.connection_count(), 3);
    // ORDERED writes over all three connections (the initiator takes turns), six to each of
    // four block groups, so each group's writes go over every connection: SIMPLE tasks could
    // run in any order (SAM-5 8.6), ORDERED ones run in the order the target received them,
    // which is CmdSN order across connections.
    let mut started = Vec::new();
    for k in 0..24u8 {
        let mut c = write(u64::from(k % 4) * 8, pattern(4096, k));
        c.attribute = iscsi_pdu::TaskAttribute::Ordered;
        started.push(p.start(&c).expect("window"));
    }
    let nexus = p.rig.conns[0].nexus;
    assert!(
        p.rig.target.core.queued(nexus) > 0,
        "commands arrived ahead of their CmdSN and wait"
    );
    for itt in started {
        good(p.wait(itt, MINUTE));
    }
    for k in 20..24u8 {
        let lba = u64::from(k % 4) * 8;
        assert!(p.rig.stored(lba, 8) == pattern(4096, k), "group {}", k % 4);
        assert!(good(p.execute(&read(lba, 8))) == pattern(4096, k));
    }
    // Each command was answered on the connection it came on (the initiator would have
    // failed the task otherwise), and every connection carried some.
    for ci in 0..3 {
        let index = p.rig_index(ci);
        assert!(!p.rig.conns[index].answered.is_empty(), "connection {ci}");
    }
    assert_eq!(p.rig.target.core.queued(nexus), 0);
}

#[test]
fn a_lost_connection_fails_its_own_tasks_and_the_session_goes_on() {
    let mut p = pair(multi(2));
    let second = p.connect(2, Faults::default(), Faults::default());
    p.rig.hold_backend = true;
    let itts: Vec<u32> = (0..4)
        .map(|k| p.start(&read(k, 8)).expect("window"))
        .collect();
    // The second connection's cable is pulled: nothing more arrives either way; the target
    // finds out by its ping.
    let cut = Faults {
        lose_after: Some(0),
        ..Faults::default()
    };
    p.set_faults_on(second, cut.clone(), cut);
    p.rig.hold_backend = false;
    while p.rig.release_backend() {
        p.pump();
    }
    let gone = p.run_until(|p| p.closed_on(second).is_some(), MINUTE);
    assert!(gone, "the target gave up on the silent connection");
    let (mut ok, mut lost) = (0, 0);
    for itt in itts {
        match p.wait(itt, MINUTE) {
            Some(Ok(_)) => ok += 1,
            Some(Err(Failure::ConnectionLost(_))) => lost += 1,
            other => panic!("{other:?}"),
        }
    }
    assert_eq!((ok, lost), (2, 2), "each connection carried two");
    let index = p.rig_index(second);
    assert!(p.rig.conns[index].conn.is_idle());
    // The session lives on over its first connection.
    let tsih = p.initiator.tsih();
    assert!(p.rig.target.sessions.get(tsih).is_some());
    good(p.execute(&read(0, 8)));
    // A new connection with the lost one's CID joins in its place.
    let again = p.connect(2, Faults::default(), Faults::default());
    for k in 0..4 {
        good(p.execute(&read(k, 1)));
    }
    assert!(!p.rig.conns[p.rig_index(again)].answered.is_empty());
}
