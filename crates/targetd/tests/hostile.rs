//! Hostile input and faults against targetd in-process: each case gets a Reject, a login
//! failure or a closed connection, never a panic, and a bystander session on the same reactor
//! keeps working throughout. docs/robustness.md lists the cases and what the target does.

mod common;

use std::sync::atomic::AtomicUsize;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Once;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};

use bytes::Bytes;
use common::raw::{data_out, read, write, Raw};
use common::{config, memory_target, opts, pattern, Daemon, TARGET};
use initiator_bench::scsi::{cdb, Command, Sense};
use initiator_bench::Session;
use iscsi_pdu::{Lun, Pdu, RejectReason, ScsiStatus, SerialNumber, TextRequest, RESERVED_TAG};
use scsi_core::{Asc, SenseKey};

/// The bystander's own target, so nothing a hostile initiator writes can touch its data.
const BYSTANDER: &str = "iqn.2026-11.io.example:bystander";

/// One reactor, so every connection of a test shares its arena and engine with the bystander;
/// the test's target and the bystander's.
fn one_reactor(server: &str) -> String {
    let targets = format!(
        "{}\n{}",
        memory_target(TARGET, ""),
        memory_target(BYSTANDER, "")
    );
    config("", &targets).replace(
        "reactors = 2\nnop_interval = 0",
        &format!("reactors = 1\nnop_interval = 0\n{server}"),
    )
}

/// `text` (of [`one_reactor`]) with the test target's LUN 0 a 16 MiB thin file at `path`.
fn on_file(text: &str, path: &str) -> String {
    let memory = "[[targets.luns]]\nlun = 0\nbackend = \"memory\"\nsize = \"64MiB\"\n";
    assert!(text.contains(memory), "a memory LUN 0 to replace");
    text.replacen(
        memory,
        &format!(
            "[[targets.luns]]\nlun = 0\nbackend = \"file\"\npath = \"{path}\"\nsize = \"16MiB\"\n"
        ),
        1,
    )
}

/// A session on the bystander's target, with 1 MiB of known data at LBA 0.
async fn bystander(d: &Daemon) -> (Session, Bytes) {
    let s = Session::connect(&d.url(BYSTANDER, 0), opts())
        .await
        .expect("the bystander logs in");
    let data = pattern(1 << 20, 11);
    s.write(0, data.clone(), 512).await.unwrap();
    (s, data)
}

/// The bystander still reads back what it wrote, and no reactor thread has panicked.
async fn unharmed(s: &Session, data: &Bytes) {
    s.nop().await.unwrap();
    let got = s.read(0, 2048, 512).await.unwrap();
    assert!(got == *data, "the bystander's data changed");
    assert_eq!(reactor_panics(), 0, "a reactor thread panicked");
}

/// A bystander's `what` (a read or a write), which must succeed within 10 s: longer, and it
/// waited for the hostile connection.
async fn promptly<T>(
    op: impl std::future::Future<Output = initiator_bench::Result<T>>,
    what: &str,
) -> T {
    tokio::time::timeout(Duration::from_secs(10), op)
        .await
        .unwrap_or_else(|_| panic!("a bystander's {what} waited for the hostile connection"))
        .unwrap()
}

/// Panics on the daemon's reactor threads (named `reactor-N`): a connection's task that
/// panics is caught by its runtime and looks like a closed connection from outside, so the
/// tests count them here.
fn reactor_panics() -> usize {
    static PANICS: AtomicUsize = AtomicUsize::new(0);
    static HOOK: Once = Once::new();
    HOOK.call_once(|| {
        let default = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            let name = std::thread::current().name().unwrap_or("").to_string();
            if name.starts_with("reactor-") {
                PANICS.fetch_add(1, Relaxed);
            }
            default(info);
        }));
    });
    PANICS.load(Relaxed)
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
    let (by, data) = bystander(&d).await;
    let _stalled = stall(&d).await;
    // Wait until it holds what it can (the arena reports every second).
    let arena = d.registry.counters.arenas.lock().unwrap()[0].clone();
    let started = std::time::Instant::now();
    while arena.free.load(Relaxed) > (33 << 20) {
        assert!(started.elapsed() < Duration::from_secs(20), "{arena:?}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    for _ in 0..16 {
        let got = promptly(by.read(0, 2048, 512), "read").await;
        assert!(got == data);
    }
    assert_eq!(d.registry.sessions.all().len(), 2, "both sessions are open");
    unharmed(&by, &data).await;
}

/// Once nothing could be sent to it for `send_timeout`, the stalled connection is dropped and
/// counted, and what it held goes back: the bystander reads the whole arena's worth again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_initiator_that_stops_reading_is_dropped_after_the_send_timeout() {
    let d = Daemon::start(&one_reactor("send_timeout = 1"));
    let (by, data) = bystander(&d).await;
    let _stalled = stall(&d).await;
    dropped_and_counted(&d, &by, &data, "targetd_send_timeouts_total").await;
}

/// Once only the bystander is left (within 20 s), the hostile connection's drop is counted in
/// `counter` and all it held is back: 32 MiB reads need whole halves of the arena.
async fn dropped_and_counted(d: &Daemon, by: &Session, data: &Bytes, counter: &str) {
    only_the_bystander_left(d).await;
    let metrics = targetd::metrics::text(&d.registry);
    assert!(metrics.contains(&format!("{counter} 1\n")), "{metrics}");
    for _ in 0..2 {
        let _: Bytes = by.read(0, 65536, 512).await.unwrap();
    }
    unharmed(by, data).await;
}

/// An initiator that sends WRITEs and never their data holds at most its connection's share
/// of the arena: the writes past it are answered TASK SET FULL at once (waiting for buffers
/// could wait for data that comes only after them), and a bystander on the same reactor
/// writes and reads 1 MiB commands meanwhile.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_initiator_that_never_sends_write_data_holds_a_bounded_share() {
    let (d, by, data, mut raw) = scene(0x31).await;
    const WRITES: u32 = 100;
    for i in 0..WRITES {
        let sn = raw.take_cmd_sn();
        raw.send(write(0x100 + i, sn, 0, 2048, Bytes::new())).await;
    }
    // 100 MiB of writes against a 32 MiB share: at least the rest are turned away, each
    // taking its CmdSN, and none of them waits.
    let mut turned_away = 0;
    while turned_away < WRITES - 32 {
        let pdu = tokio::time::timeout(Duration::from_secs(10), raw.next())
            .await
            .unwrap_or_else(|_| panic!("only {turned_away} writes turned away"))
            .expect("the connection stays open");
        match pdu {
            Pdu::ScsiResponse(r) if r.status == ScsiStatus::TASK_SET_FULL => turned_away += 1,
            Pdu::ScsiResponse(r) => panic!("a write ended with {:?}", r.status),
            _ => {}
        }
    }
    let arena = d.registry.counters.arenas.lock().unwrap()[0].clone();
    let by_data = pattern(1 << 20, 12);
    for _ in 0..8 {
        promptly(by.write(2048, by_data.clone(), 512), "write").await;
        let got = promptly(by.read(2048, 2048, 512), "read").await;
        assert!(got == by_data);
    }
    // What the hostile connection holds stays within its share (the arena reports every
    // second): half of the 64 MiB arena, whatever it sends.
    tokio::time::sleep(Duration::from_millis(1100)).await;
    let free = arena.free.load(Relaxed);
    assert!(
        free >= 31 << 20,
        "the hostile connection holds more than its share: {arena:?}"
    );
    let metrics = targetd::metrics::text(&d.registry);
    let counted: u32 = metrics
        .lines()
        .find_map(|l| l.strip_prefix("targetd_task_set_full_total "))
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("{metrics}"));
    assert!((turned_away..=WRITES).contains(&counted), "{metrics}");
    assert_eq!(d.registry.sessions.all().len(), 2, "both sessions are open");
    unharmed(&by, &data).await;
}

/// Once it has owed data-out for `data_out_timeout` without sending any, the connection
/// that never sends write data is dropped and counted, and its share goes back: the
/// bystander reads 32 MiB commands (whole halves of the arena) again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_initiator_that_owes_data_out_is_dropped_after_the_data_out_timeout() {
    let d = Daemon::start(&one_reactor("data_out_timeout = 1"));
    let (by, data) = bystander(&d).await;
    let mut raw = ready(&d, 0x32).await;
    for i in 0..40 {
        let sn = raw.take_cmd_sn();
        raw.send(write(0x100 + i, sn, 0, 2048, Bytes::new())).await;
    }
    dropped_and_counted(&d, &by, &data, "targetd_data_out_timeouts_total").await;
}

/// A raw session on the test's target, its first command's unit attention (power on) taken.
async fn ready(d: &Daemon, isid: u8) -> Raw {
    let mut raw = Raw::login(d, [0x80, 0, 0, 0, 0, isid], 0).await.unwrap();
    let sn = raw.take_cmd_sn();
    raw.send(read(1, sn, 0, 1)).await;
    raw.finish(1).await.expect("the unit attention");
    raw
}

/// A daemon on one reactor, the bystander with its data, and a raw session (ISID ending in
/// `isid`) on the test's target, ready for commands.
async fn scene(isid: u8) -> (Daemon, Session, Bytes, Raw) {
    let d = Daemon::start(&one_reactor(""));
    let (by, data) = bystander(&d).await;
    let raw = ready(&d, isid).await;
    (d, by, data, raw)
}

/// READs `blocks` at `lba` with the next CmdSN; they must end GOOD. Their data.
async fn read_good(raw: &mut Raw, itt: u32, lba: u32, blocks: u16) -> bytes::BytesMut {
    let sn = raw.take_cmd_sn();
    raw.send(read(itt, sn, lba, blocks)).await;
    let (status, data) = raw.finish(itt).await.expect("an answer");
    assert_eq!(status, ScsiStatus::GOOD, "READ {itt:#x}");
    data
}

/// Whether `got` holds a Reject for `reason`.
fn rejected(got: &[Pdu], reason: RejectReason) -> bool {
    got.iter()
        .any(|p| matches!(p, Pdu::Reject(r) if r.reason == reason))
}

/// The TTT of the R2T in `got`.
fn r2t(got: &[Pdu]) -> u32 {
    got.iter()
        .find_map(|p| match p {
            Pdu::ReadyToTransfer(r) => Some(r.target_transfer_tag),
            _ => None,
        })
        .unwrap_or_else(|| panic!("no R2T in {got:?}"))
}

/// AHS whose own length disagrees with TotalAHSLength, or of an unknown type: a Reject
/// (invalid PDU field) for that command, and the connection goes on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ahs_that_lies_or_is_unknown_is_rejected() {
    let (_d, by, data, mut raw) = scene(1).await;
    let sn = raw.cmd_sn.0;
    // TotalAHSLength one word; the AHS in it claims 100 bytes.
    let mut lies = raw.encode(read(0x10, sn, 0, 1)).to_vec();
    lies[4] = 1;
    lies.splice(48..48, [0u8, 100, 1, 0]);
    // A consistent length, a reserved type (0x3f).
    let mut unknown = raw.encode(read(0x11, sn, 0, 1)).to_vec();
    unknown[4] = 2;
    unknown.splice(48..48, [0u8, 4, 0x3f, 0, 1, 2, 3, 4]);
    for (n, bytes) in [lies, unknown].iter().enumerate() {
        let (got, alive) = raw.probe(bytes, 0x100 + n as u32).await;
        assert!(alive, "case {n}");
        assert!(
            rejected(&got, RejectReason::InvalidPduField),
            "case {n}: {got:?}"
        );
    }
    // The rejected commands took no CmdSN: the next one at the same number runs.
    read_good(&mut raw, 0x12, 0, 1).await;
    unharmed(&by, &data).await;
}

/// Commands whose CmdSN lies outside the window (ahead of MaxCmdSN, behind ExpCmdSN, half the
/// number space away) are dropped silently as RFC 7143 section 4.2.2.1 says; the window stays
/// where it was.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn commands_outside_the_cmd_sn_window_are_dropped_silently() {
    let (_d, by, data, mut raw) = scene(2).await;
    let sn = raw.cmd_sn.0;
    for (itt, cmd_sn) in [
        (0x20, sn + 1000),
        (0x21, sn - 1),
        (0x22, sn.wrapping_add(1 << 31)),
    ] {
        let (got, alive) = raw.probe(&raw.encode(read(itt, cmd_sn, 0, 1)), itt).await;
        assert!(alive && got.is_empty(), "CmdSN {cmd_sn}: {got:?}");
    }
    read_good(&mut raw, 0x23, 0, 1).await;
    unharmed(&by, &data).await;
}

/// A command that reuses the ITT of a task still running is rejected (task in progress); the
/// running task is untouched and finishes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reused_itt_is_rejected_while_its_task_runs() {
    let (_d, by, data, mut raw) = scene(3).await;
    let sn = raw.take_cmd_sn();
    let (got, _) = raw
        .probe(&raw.encode(write(0x30, sn, 0, 8, Bytes::new())), 1)
        .await;
    let ttt = r2t(&got);
    let (got, alive) = raw
        .probe(&raw.encode(read(0x30, raw.cmd_sn.0, 0, 1)), 2)
        .await;
    assert!(
        alive && rejected(&got, RejectReason::TaskInProgress),
        "{got:?}"
    );
    let written = pattern(4096, 30);
    raw.send(data_out(0x30, ttt, 0, written.clone())).await;
    assert_eq!(raw.finish(0x30).await.unwrap().0, ScsiStatus::GOOD);
    assert!(read_good(&mut raw, 0x31, 0, 8).await == written[..]);
    unharmed(&by, &data).await;
}

/// Data-Out that does not fit its R2T (more data than the R2T asked for, an offset past the
/// command's data, a segment running past the end) is rejected (protocol error) and none of
/// it is written; the right Data-Out then completes the command. One naming a TTT the target
/// never gave breaks the sequence, which ERL 0 cannot repair: rejected, and the command ends
/// with ABORTED COMMAND, DATA PHASE ERROR, nothing written.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn data_out_that_does_not_fit_its_r2t_is_rejected() {
    let (_d, by, data, mut raw) = scene(4).await;
    let junk = pattern(8192, 99);
    let cases: [(&str, Option<u32>, u32, usize); 4] = [
        ("more than the R2T asked for", None, 0, 8192),
        ("an offset past the data", None, 8192, 512),
        ("a segment past the end", None, 3584, 1024),
        ("a TTT never given", Some(99), 0, 4096),
    ];
    for (n, (case, ttt, offset, len)) in cases.into_iter().enumerate() {
        let itt = 0x40 + n as u32;
        let lba = 8 * n as u32;
        let sn = raw.take_cmd_sn();
        let (got, _) = raw
            .probe(&raw.encode(write(itt, sn, lba, 8, Bytes::new())), 1)
            .await;
        let given = r2t(&got);
        let bad = data_out(itt, ttt.unwrap_or(given), offset, junk.slice(..len));
        let (got, alive) = raw.probe(&raw.encode(bad), 2).await;
        assert!(alive, "{case}");
        assert!(
            rejected(&got, RejectReason::ProtocolError),
            "{case}: {got:?}"
        );
        let right = pattern(4096, n);
        let expected = if ttt.is_none() {
            raw.send(data_out(itt, given, 0, right.clone())).await;
            assert_eq!(raw.finish(itt).await.unwrap().0, ScsiStatus::GOOD, "{case}");
            right
        } else {
            let ended = got.iter().find_map(|p| match p {
                Pdu::ScsiResponse(r) if r.initiator_task_tag == itt => Some(r),
                _ => None,
            });
            let r = ended.unwrap_or_else(|| panic!("{case}: the command goes on: {got:?}"));
            assert_eq!(r.status, ScsiStatus::CHECK_CONDITION);
            // Fixed-format sense after its 2-byte length: key 0x0b, ASC/ASCQ 4B/00.
            assert_eq!(
                (r.data[4] & 0xf, r.data[14], r.data[15]),
                (0x0b, 0x4b, 0),
                "{case}"
            );
            Bytes::from(vec![0u8; 4096])
        };
        let back = read_good(&mut raw, 0x50, lba, 8).await;
        assert!(back == expected[..], "{case}: the bad Data-Out was written");
    }
    unharmed(&by, &data).await;
}

/// Data-Out for a command whose data is all in, sent right behind the last one (the write may
/// still be running) or after its status, naming the finished transfer or none: rejected or
/// dropped, never written; the command answers once, GOOD, with the first data.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn data_out_for_a_finished_command_does_not_touch_it() {
    // A file LU, so the write runs on the engine while the late Data-Out arrives.
    let d = Daemon::start(&on_file(&one_reactor(""), "@DIR@/lun0.img"));
    let (by, data) = bystander(&d).await;
    let mut raw = ready(&d, 5).await;
    for n in 0..8u32 {
        let itt = 0x60 + n;
        let sn = raw.take_cmd_sn();
        let (got, _) = raw
            .probe(&raw.encode(write(itt, sn, 8 * n, 8, Bytes::new())), 1)
            .await;
        let given = r2t(&got);
        let right = pattern(4096, n as usize);
        let late = pattern(4096, 77);
        raw.send(data_out(itt, given, 0, right.clone())).await;
        raw.send(data_out(itt, given, 0, late.clone())).await;
        assert_eq!(raw.finish(itt).await.unwrap().0, ScsiStatus::GOOD);
        for (ttt, m) in [(given, 2), (RESERVED_TAG, 3)] {
            let (got, alive) = raw
                .probe(&raw.encode(data_out(itt, ttt, 0, late.clone())), m)
                .await;
            assert!(alive);
            assert!(
                !got.iter()
                    .any(|p| matches!(p, Pdu::ScsiResponse(r) if r.initiator_task_tag == itt)),
                "a second status: {got:?}"
            );
        }
        let back = read_good(&mut raw, 0x70, 8 * n, 8).await;
        assert!(back == right[..], "late data was written");
    }
    unharmed(&by, &data).await;
}

fn text(itt: u32, cmd_sn: u32, data: Vec<u8>, continued: bool) -> Pdu {
    Pdu::TextRequest(TextRequest {
        final_bit: !continued,
        continue_bit: continued,
        initiator_task_tag: itt,
        target_transfer_tag: RESERVED_TAG,
        cmd_sn: SerialNumber(cmd_sn),
        data: Bytes::from(data),
        ..TextRequest::default()
    })
}

/// Text keys at and past RFC 7143's limits: a 63-byte name with a 255-byte value is a key
/// like any other (unknown: a Reject, as LIO answers); a 64-byte name is rejected; neither
/// ends the session; a request continued (C bit) past
/// the 64 KiB the target reassembles is rejected at that bound, not buffered further; the
/// next exchange works.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn text_keys_of_maximal_length_and_endless_continuations() {
    let (_d, by, data, mut raw) = scene(6).await;
    let name = "X".repeat(63);
    let longest = format!("{name}={}\0", "v".repeat(255)).into_bytes();
    let sn = raw.take_cmd_sn();
    let (got, alive) = raw
        .probe(&raw.encode(text(0x80, sn, longest, false)), 1)
        .await;
    assert!(
        alive && rejected(&got, RejectReason::ProtocolError),
        "{got:?}"
    );
    let too_long = format!("{name}Y={}\0", "v".repeat(8000)).into_bytes();
    let sn = raw.take_cmd_sn();
    let (got, alive) = raw
        .probe(&raw.encode(text(0x81, sn, too_long, false)), 2)
        .await;
    assert!(
        alive && rejected(&got, RejectReason::ProtocolError),
        "{got:?}"
    );
    let mut continued = 0;
    loop {
        let sn = raw.take_cmd_sn();
        let part = text(0x82, sn, vec![b'A'; 8192], true);
        let (got, alive) = raw.probe(&raw.encode(part), 3).await;
        assert!(alive);
        match &got[..] {
            [Pdu::TextResponse(t)] if !t.final_bit && t.data.is_empty() => continued += 1,
            [Pdu::Reject(r)] if r.reason == RejectReason::ProtocolError => break,
            other => panic!("{other:?}"),
        }
        assert!(continued <= 8, "more than 64 KiB of text reassembled");
    }
    assert_eq!(continued, 8, "64 KiB are taken in pieces");
    let sn = raw.take_cmd_sn();
    let again = text(0x83, sn, b"SendTargets=All\0".to_vec(), false);
    let (got, alive) = raw.probe(&raw.encode(again), 4).await;
    assert!(
        alive && matches!(&got[..], [Pdu::TextResponse(t)] if t.data.starts_with(b"TargetName=")),
        "{got:?}"
    );
    unharmed(&by, &data).await;
}

/// A small deterministic generator (xorshift64*), so a failing case can be replayed by seed.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
}

/// `pdu` with one to four of its header bytes changed (any of them: opcode, flags, lengths,
/// tags, sequence numbers). When TotalAHSLength or DataSegmentLength changed, the bytes after
/// the header are made as long as the header now says (up to a bound past the target's
/// MaxRecvDataSegmentLength), so the next PDU starts where the target looks for it.
fn mutate(rng: &mut Rng, pdu: &[u8]) -> Vec<u8> {
    let mut b = pdu.to_vec();
    for _ in 0..1 + rng.below(4) {
        let at = rng.below(48);
        b[at] = match rng.below(4) {
            0 => 0,
            1 => 0xff,
            2 => b[at] ^ (1 << rng.below(8)),
            _ => rng.next() as u8,
        };
    }
    let ahs = usize::from(b[4]) * 4;
    let dsl = usize::from(b[5]) << 16 | usize::from(b[6]) << 8 | usize::from(b[7]);
    let claimed = 48 + ahs + dsl.div_ceil(4) * 4;
    if claimed <= 48 + 1020 + 300 * 1024 {
        b.resize(claimed, 0xa5);
    }
    b
}

/// Mutated PDUs at every stage: as the first PDU of a login, in full feature phase (every
/// request an initiator sends), and in the middle of a write's transfer. After each, the
/// target answers a ping or closes the connection within the probe's 10 s; never a panic;
/// every connection it closes is gone from its books; the bystander's data is intact.
/// `HOSTILE_ROUNDS` (default 40) sets the rounds per stage, `HOSTILE_SEED` the seed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mutated_pdus_at_every_stage() {
    let d = Daemon::start(&one_reactor(""));
    let (by, data) = bystander(&d).await;
    let env = |k: &str, default: u64| {
        std::env::var(k)
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(default)
    };
    let rounds = env("HOSTILE_ROUNDS", 40);
    let seed = env("HOSTILE_SEED", 0x5eed_1e55);
    let mut rng = Rng(seed | 1);
    let mut closed = 0;
    // Login: a mutated first request; the answer is a Login Response or a close.
    let login = login_request(0x71);
    for round in 0..rounds {
        let bytes = mutate(&mut rng, &login);
        let mut s = tokio::net::TcpStream::connect(d.addr).await.unwrap();
        s.write_all(&bytes).await.unwrap();
        let mut deframer = iscsi_pdu::Deframer::new();
        let mut buf = vec![0u8; 65536];
        let answer = loop {
            if let Ok(Some(p)) = deframer.next_pdu() {
                break Some(p);
            }
            match tokio::time::timeout(Duration::from_secs(10), s.read(&mut buf)).await {
                Ok(Ok(0) | Err(_)) => break None,
                Ok(Ok(n)) => deframer.feed(&buf[..n]),
                Err(_) => panic!("login round {round} (seed {seed:#x}): no answer in 10 s"),
            }
        };
        assert!(
            matches!(answer, None | Some(Pdu::LoginResponse(_))),
            "login round {round}: {answer:?}"
        );
    }
    // Full feature phase: each kind of request, mutated.
    let mut raw = ready(&d, 0x72).await;
    // Each fresh session gets its own ISID, from 0x73 on (0x72 is the first session's).
    let mut isid = 0x73u8;
    let next = |isid: &mut u8| {
        let this = *isid;
        *isid = isid.wrapping_add(1).max(0x73);
        this
    };
    for round in 0..rounds {
        let sn = raw.cmd_sn.0;
        let requests = [
            raw.encode(read(0x90, sn, 0, 8)),
            raw.encode(write(0x91, sn, 8, 2, pattern(1024, 1))),
            raw.encode(write(0x92, sn, 8, 8, Bytes::new())),
            raw.encode(text(0x93, sn, b"SendTargets=All\0".to_vec(), false)),
            raw.encode(Pdu::TaskManagementRequest(
                iscsi_pdu::TaskManagementRequest {
                    immediate: true,
                    function: iscsi_pdu::TaskManagementFunction::AbortTask,
                    initiator_task_tag: 0x94,
                    referenced_task_tag: 0x92,
                    cmd_sn: SerialNumber(sn),
                    ..iscsi_pdu::TaskManagementRequest::default()
                },
            )),
            raw.encode(Pdu::NopOut(iscsi_pdu::NopOut {
                immediate: true,
                initiator_task_tag: 0x95,
                target_transfer_tag: RESERVED_TAG,
                cmd_sn: SerialNumber(sn),
                data: Bytes::from_static(b"data"),
                ..iscsi_pdu::NopOut::default()
            })),
            raw.encode(data_out(0x92, 7, 0, pattern(512, 2))),
        ];
        let pick = rng.below(requests.len());
        let bytes = mutate(&mut rng, &requests[pick]);
        let (_, alive) = raw.probe(&bytes, 0x1_0000 + round as u32).await;
        // Resynchronise on the window the target has now: a mutated command may have taken a
        // CmdSN or not.
        if !alive {
            closed += 1;
            raw = ready(&d, next(&mut isid)).await;
        } else {
            raw.cmd_sn = window(&mut raw).await;
        }
    }
    // Mid-transfer: a write waits for its data; its Data-Out arrives mutated. A session of
    // its own, so no task a mutated command left waiting (a write whose data never comes)
    // overlaps these writes.
    drop(raw);
    let mut raw = ready(&d, next(&mut isid)).await;
    for round in 0..rounds {
        let itt = 0xa0 + round as u32;
        let sn = raw.take_cmd_sn();
        let lba = 1024 + 8 * (round as u32 % 4096);
        let (got, alive) = raw
            .probe(&raw.encode(write(itt, sn, lba, 8, Bytes::new())), 1)
            .await;
        assert!(alive);
        let given = r2t(&got);
        let bytes = mutate(
            &mut rng,
            &raw.encode(data_out(itt, given, 0, pattern(4096, 3))),
        );
        let (_, alive) = raw.probe(&bytes, 0x2_0000 + round as u32).await;
        if !alive {
            closed += 1;
            raw = ready(&d, next(&mut isid)).await;
        } else {
            // End the write either way: its data, or an abort if the mutation ended it.
            raw.send(data_out(itt, given, 0, pattern(4096, 3))).await;
            raw.cmd_sn = window(&mut raw).await;
        }
    }
    drop(raw);
    eprintln!(
        "{} rounds per stage, seed {seed:#x}: {closed} connections closed by the target",
        rounds
    );
    // Every hostile connection goes from the target's books; only the bystander stays.
    only_the_bystander_left(&d).await;
    unharmed(&by, &data).await;
}

/// The target's ExpCmdSN, from the answer to a ping (a NOP-In carries it).
async fn window(raw: &mut Raw) -> SerialNumber {
    raw.send(raw.ping_pdu(0xfff0)).await;
    loop {
        match raw.next().await {
            Some(Pdu::NopIn(n)) if n.initiator_task_tag == 0xfff0 => return n.exp_cmd_sn,
            Some(_) => continue,
            None => panic!("closed while asking for the window"),
        }
    }
}

/// How a connection of the flood ended up.
#[derive(Debug)]
enum Fate {
    /// Closed by the target before any answer (past `max_connections`).
    Closed,
    /// Logged in; the stream is kept open.
    In(tokio::net::TcpStream),
    /// The login was answered with this status.
    Refused(iscsi_pdu::LoginStatus),
}

/// The soft limit on open files of this process (the daemon runs in it too).
fn open_files_limit() -> usize {
    std::fs::read_to_string("/proc/self/limits")
        .ok()
        .and_then(|l| {
            let line = l.lines().find(|l| l.starts_with("Max open files"))?;
            line.split_whitespace().nth(3)?.parse().ok()
        })
        .unwrap_or(1024)
}

/// 1000 connections at once, each logging in at once, against `max_connections = 64` and
/// `max_sessions = 16`: past the connection limit they are closed before any answer, past the
/// session limit the login is refused (out of resources), the rest log in; the daemon never
/// holds more than its limits, the bystander works while they are all open, and once they go
/// the books hold the bystander alone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_thousand_connections_at_once_are_held_to_the_limits() {
    let limit = open_files_limit();
    // The flood's sockets, the daemon's and the test's own descriptors share the limit.
    let n = 1000.min(limit.saturating_sub(300));
    if n < 1000 {
        eprintln!("{n} connections, not 1000: this process may open {limit} files");
    }
    let d = Daemon::start(&one_reactor("max_connections = 64\nmax_sessions = 16"));
    let (by, data) = bystander(&d).await;
    let addr = d.addr;
    let flood: Vec<_> = (0..n)
        .map(|i| {
            tokio::spawn(async move {
                let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
                let login = login_request(i as u32);
                if s.write_all(&login).await.is_err() {
                    return Fate::Closed;
                }
                let mut deframer = iscsi_pdu::Deframer::new();
                let mut buf = vec![0u8; 4096];
                loop {
                    if let Ok(Some(p)) = deframer.next_pdu() {
                        return match p {
                            Pdu::LoginResponse(r)
                                if r.status == iscsi_pdu::LoginStatus::SUCCESS =>
                            {
                                Fate::In(s)
                            }
                            Pdu::LoginResponse(r) => Fate::Refused(r.status),
                            other => panic!("{other:?}"),
                        };
                    }
                    match tokio::time::timeout(Duration::from_secs(30), s.read(&mut buf)).await {
                        Ok(Ok(0) | Err(_)) => return Fate::Closed,
                        Ok(Ok(k)) => deframer.feed(&buf[..k]),
                        Err(_) => panic!("connection {i}: no answer and no close in 30 s"),
                    }
                }
            })
        })
        .collect();
    let mut fates = Vec::new();
    for f in flood {
        fates.push(f.await.unwrap());
    }
    let logged_in = fates.iter().filter(|f| matches!(f, Fate::In(_))).count();
    let refused = fates
        .iter()
        .filter(|f| matches!(f, Fate::Refused(s) if *s == iscsi_pdu::LoginStatus::OUT_OF_RESOURCES))
        .count();
    let closed = fates.iter().filter(|f| matches!(f, Fate::Closed)).count();
    eprintln!("{n} connections: {logged_in} logged in, {refused} refused (out of resources), {closed} closed at once");
    assert_eq!(logged_in + refused + closed, n, "{fates:?}");
    assert!(
        (1..=15).contains(&logged_in),
        "{logged_in} sessions beside the bystander"
    );
    assert!(closed >= n - 64 - refused, "{closed} closed at once");
    assert!(d.registry.sessions.all().len() <= 16);
    assert!(d.registry.connection_count() <= 64);
    unharmed(&by, &data).await;
    for f in &fates {
        if let Fate::In(s) = f {
            assert!(
                s.peer_addr().is_ok(),
                "a session that got in is still connected"
            );
        }
    }
    drop(fates);
    only_the_bystander_left(&d).await;
    unharmed(&by, &data).await;
}

/// Waits until the daemon's books hold the bystander's session and connection alone: every
/// connection a test opened or the target closed is gone from them.
async fn only_the_bystander_left(d: &Daemon) {
    let started = std::time::Instant::now();
    while d.registry.sessions.all().len() > 1 || d.registry.connection_count() > 1 {
        assert!(
            started.elapsed() < Duration::from_secs(20),
            "connections left behind"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// A Login Request straight to full feature phase, with ISID `n`.
fn login_request(n: u32) -> Vec<u8> {
    let mut text = iscsi_pdu::text::TextParams::new();
    text.push("InitiatorName", "iqn.2026-11.io.example:raw");
    text.push("TargetName", TARGET);
    text.push("SessionType", "Normal");
    let b = n.to_be_bytes();
    let req = iscsi_pdu::LoginRequest {
        transit: true,
        current_stage: iscsi_pdu::Stage::LoginOperationalNegotiation,
        next_stage: iscsi_pdu::Stage::FullFeaturePhase,
        isid: iscsi_pdu::Isid([0x80, 0, b[0], b[1], b[2], b[3]]),
        initiator_task_tag: 1,
        cmd_sn: SerialNumber(1),
        data: text.encode(),
        ..iscsi_pdu::LoginRequest::default()
    };
    let mut out = bytes::BytesMut::new();
    Pdu::LoginRequest(req).encode(iscsi_pdu::Digests::NONE, &mut out);
    out.to_vec()
}

/// Connections cut in the middle of a 1 MiB write's Data-Out and of a 1 MiB read's Data-In
/// (through initiator-bench's proxy, cut after 600 KiB one way): the initiator sees the
/// failure, the target ends the session and frees what it held, and the unacknowledged write
/// left nothing behind (the target writes a command's data only once all of it is in).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_cut_mid_data_out_and_mid_data_in() {
    use initiator_bench::proxy::{Cut, Link, Proxy};
    let d = Daemon::start(&one_reactor(""));
    let (by, data) = bystander(&d).await;
    let direct = d.session(opts()).await;
    let old = pattern(1 << 20, 5);
    direct.write(0, old.clone(), 512).await.unwrap();
    let link = Link {
        delay: Duration::ZERO,
        rate_bps: None,
    };
    let at = Some(600 << 10);
    for (case, cut) in [
        (
            "mid-Data-Out",
            Cut {
                upstream: at,
                downstream: None,
            },
        ),
        (
            "mid-Data-In",
            Cut {
                upstream: None,
                downstream: at,
            },
        ),
    ] {
        let proxy = Proxy::start_with_cut("127.0.0.1:0", &d.addr.to_string(), link, cut)
            .await
            .unwrap();
        let url = format!("iscsi://{}/{TARGET}/0", proxy.local_addr);
        let s = Session::connect(&initiator_bench::IscsiUrl::parse(&url).unwrap(), opts())
            .await
            .unwrap();
        let failed = match case {
            "mid-Data-Out" => s.write(0, pattern(1 << 20, 6), 512).await.is_err(),
            _ => s.read(0, 2048, 512).await.is_err(),
        };
        assert!(failed, "{case}: the initiator saw no failure");
        let started = std::time::Instant::now();
        while d.registry.sessions.all().len() > 2 {
            assert!(
                started.elapsed() < Duration::from_secs(20),
                "{case}: the session stays"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let now = direct.read(0, 2048, 512).await.unwrap();
        assert!(
            now == old,
            "{case}: the unacknowledged write left data behind"
        );
    }
    unharmed(&by, &data).await;
}

/// The status and sense (key, ASC, ASCQ) of `cmd`, after any UNIT ATTENTION a new nexus
/// reports first.
async fn outcome(s: &Session, cmd: Command) -> (ScsiStatus, Option<(u8, u8, u8)>) {
    let r = s.execute_past_unit_attentions(cmd).await;
    let r = r.expect("an answer");
    let sense = r.sense.as_deref().and_then(Sense::parse);
    (r.status, sense.map(|x| (x.key, x.asc, x.ascq)))
}

fn write_cmd(lba: u64, data: Bytes) -> Command {
    Command::write(Lun::ZERO, cdb::write(lba, (data.len() / 512) as u32), data)
}

fn read_cmd(lba: u64, blocks: u32) -> Command {
    Command::read(Lun::ZERO, cdb::read(lba, blocks), blocks * 512)
}

/// Sense as [`outcome`] gives it.
fn sense(key: SenseKey, asc: Asc) -> Option<(u8, u8, u8)> {
    Some((key as u8, asc.0, asc.1))
}

/// A backend that fails (faults armed through the admin interface, as `targetctl lun fault`
/// does): each failure is CHECK CONDITION with the sense a disk would give, a failed write
/// writes nothing, the session goes on, and once the faults are cleared all works again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_backend_answers_with_sense_and_harms_no_one() {
    use targetd::admin::{handle, AdminRequest};
    let d = Daemon::start(&on_file(&one_reactor(""), "@DIR@/lun0.img"));
    let (by, by_data) = bystander(&d).await;
    let s = d.session(opts()).await;
    let old = pattern(64 << 10, 21);
    s.write(0, old.clone(), 512).await.unwrap();
    let arm = |json: serde_json::Value| {
        let fault = serde_json::from_value(json).unwrap();
        let req = AdminRequest::LunFault {
            target: TARGET.into(),
            lun: 0,
            fault,
        };
        handle(&d.registry, req).unwrap()
    };

    // Reads of blocks 64..72 fail; the rest of the unit reads.
    arm(serde_json::json!({"ops": "read", "error": "eio", "lba": 64, "blocks": 8}));
    let unrecovered_read_error = sense(SenseKey::MediumError, Asc::UNRECOVERED_READ_ERROR);
    let got = outcome(&s, read_cmd(0, 128)).await;
    assert_eq!(got, (ScsiStatus::CHECK_CONDITION, unrecovered_read_error));
    assert_eq!(s.read(0, 64, 512).await.unwrap(), old.slice(..32 << 10));

    // One write fails and writes nothing; the next one is written.
    arm(serde_json::json!({"ops": "write", "error": "eio", "count": 1}));
    let new = pattern(4096, 22);
    let write_error = sense(SenseKey::MediumError, Asc::WRITE_ERROR);
    let got = outcome(&s, write_cmd(0, new.clone())).await;
    assert_eq!(got, (ScsiStatus::CHECK_CONDITION, write_error));
    assert_eq!(s.read(0, 8, 512).await.unwrap(), old.slice(..4096));
    s.write(0, new.clone(), 512).await.unwrap();
    assert_eq!(s.read(0, 8, 512).await.unwrap(), new);

    // SYNCHRONIZE CACHE fails as a write error; ENOSPC is DATA PROTECT, SPACE ALLOCATION
    // FAILED WRITE PROTECT.
    arm(serde_json::json!({"ops": "flush", "error": "eio"}));
    let sync = Command::new(Lun::ZERO, cdb::synchronize_cache());
    assert_eq!(
        outcome(&s, sync.clone()).await,
        (ScsiStatus::CHECK_CONDITION, write_error)
    );
    arm(serde_json::json!({"ops": "write", "error": "enospc"}));
    let got = outcome(&s, write_cmd(8, new.clone())).await;
    assert_eq!(
        got,
        (
            ScsiStatus::CHECK_CONDITION,
            sense(
                SenseKey::DataProtect,
                Asc::SPACE_ALLOCATION_FAILED_WRITE_PROTECT
            )
        )
    );
    // The unit's list shows them; clearing disarms all.
    let listed = targetd::admin::handle(&d.registry, AdminRequest::Luns { target: None }).unwrap();
    let faults = listed
        .as_array()
        .unwrap()
        .iter()
        .find(|l| l["target"] == TARGET)
        .unwrap()["faults"]
        .clone();
    assert_eq!(faults.as_array().unwrap().len(), 3, "{faults}");
    assert_eq!(arm(serde_json::Value::Null), serde_json::json!([]));
    assert_eq!(outcome(&s, sync).await, (ScsiStatus::GOOD, None));
    s.write(8, new.clone(), 512).await.unwrap();
    assert_eq!(s.read(0, 64, 512).await.unwrap().slice(4096..8192), new);
    unharmed(&by, &by_data).await;

    // targetctl arms and clears the same way.
    let targetctl = |args: &[&str]| {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_targetctl"))
            .arg("--socket")
            .arg(d.socket())
            .args(["lun", "fault", TARGET, "0"])
            .args(args)
            .output()
            .unwrap();
        assert!(out.status.success(), "{out:?}");
        String::from_utf8(out.stdout).unwrap()
    };
    let said = targetctl(&["--ops", "read", "--count", "1"]);
    assert!(said.contains("read fail with eio"), "{said}");
    let got = outcome(&s, read_cmd(100, 1)).await;
    assert_eq!(got, (ScsiStatus::CHECK_CONDITION, unrecovered_read_error));
    assert_eq!(s.read(100, 1, 512).await.unwrap().len(), 512, "count spent");
    targetctl(&["--ops", "all", "--error", "enospc"]);
    assert_eq!(targetctl(&["--clear"]).trim(), "no faults armed");
    s.read(100, 1, 512).await.unwrap();
}

/// Mounts a tmpfs of `size` at `dir` for the life of the guard; `None` when mounting is not
/// allowed here (needs root), after saying so, unless CI is set, where that fails.
struct Mount(std::path::PathBuf);

impl Mount {
    fn tmpfs(dir: &std::path::Path, size: &str) -> Option<Mount> {
        let ok = std::process::Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={size}"), "tmpfs"])
            .arg(dir)
            .status()
            .is_ok_and(|s| s.success());
        if !ok {
            let why = "cannot mount a tmpfs here (needs root, or CAP_SYS_ADMIN)";
            assert!(std::env::var_os("CI").is_none(), "{why}");
            eprintln!("skipped: {why}");
            return None;
        }
        Some(Mount(dir.to_path_buf()))
    }

    fn resize(&self, size: &str) {
        let ok = std::process::Command::new("mount")
            .args(["-o", &format!("remount,size={size}")])
            .arg(&self.0)
            .status()
            .is_ok_and(|s| s.success());
        assert!(ok, "remount {}", self.0.display());
    }
}

impl Drop for Mount {
    fn drop(&mut self) {
        let _ = std::process::Command::new("umount")
            .arg("-l")
            .arg(&self.0)
            .status();
    }
}

/// A thin file LU on a filesystem that fills up: the write that finds no space gets DATA
/// PROTECT, SPACE ALLOCATION FAILED WRITE PROTECT; every acknowledged write reads back; the
/// session goes on, and once the filesystem has room again writes succeed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_filesystem_answers_data_protect_and_recovers() {
    let fs = tempfile::tempdir().unwrap();
    let Some(mount) = Mount::tmpfs(fs.path(), "2m") else {
        return;
    };
    let path = fs.path().join("lun0.img");
    let d = Daemon::start(&on_file(&one_reactor(""), &path.display().to_string()));
    let (by, by_data) = bystander(&d).await;
    let s = d.session(opts()).await;
    let chunk = 256 << 10;
    let mut acknowledged = Vec::new();
    let mut full = None;
    for i in 0..16u64 {
        let data = pattern(chunk, 30 + i as usize);
        match outcome(&s, write_cmd(i * 512, data.clone())).await {
            (ScsiStatus::GOOD, None) => acknowledged.push((i, data)),
            got => {
                full = Some(got);
                break;
            }
        }
    }
    assert_eq!(
        full,
        Some((
            ScsiStatus::CHECK_CONDITION,
            sense(
                SenseKey::DataProtect,
                Asc::SPACE_ALLOCATION_FAILED_WRITE_PROTECT
            )
        )),
        "16 x 256 KiB on a 2 MiB filesystem"
    );
    assert!(
        !acknowledged.is_empty() && acknowledged.len() <= 8,
        "{} acknowledged",
        acknowledged.len()
    );
    for (i, data) in &acknowledged {
        let back = s.read(i * 512, 512, 512).await.unwrap();
        assert!(back == *data, "acknowledged chunk {i} lost");
    }
    unharmed(&by, &by_data).await;
    // The operator grows the filesystem: the same write goes through.
    mount.resize("8m");
    let next = acknowledged.len() as u64;
    let data = pattern(chunk, 99);
    s.write(next * 512, data.clone(), 512).await.unwrap();
    assert_eq!(s.read(next * 512, 512, 512).await.unwrap(), data);
    drop(s);
    d.stop();
}
