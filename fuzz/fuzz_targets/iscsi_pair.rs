//! The deterministic pair under Arbitrary settings, link faults, initiator timers and sequences
//! of commands, task management, NOPs, backend holds and clock advances. Checked: no panic in
//! either machine (the rig checks the target's stream on the way); every task the initiator
//! started ends, or the connection closed (unless a bit flipped without digests to catch it
//! and the initiator has no task timeout to end it); once closed, no task
//! is left on the target; and when the links only cut
//! and delay (no loss, no flipped bit), every read returns what the last write to its blocks
//! wrote.
#![no_main]

use std::collections::{HashMap, HashSet};
use std::time::Duration;

use arbitrary::Arbitrary;
use bytes::Bytes;
use iscsi_pdu::initiator::{Command, Reply, Timers};
use iscsi_pdu::negotiation::DigestAlgorithm;
use iscsi_pdu::pair::{Faults, Pair, PairOptions};
use iscsi_pdu::{Lun, ScsiStatus, TaskManagementFunction};
use libfuzzer_sys::fuzz_target;

#[derive(Arbitrary, Debug)]
struct Setup {
    digests: bool,
    initial_r2t: bool,
    immediate_data: bool,
    /// Segment lengths in 512-byte units (at least 1).
    target_segment: u8,
    initiator_segment: u8,
    window: u8,
    cut: Option<u64>,
    delay_us: u16,
    lose_after: Option<u16>,
    flip: Option<u16>,
    /// The initiator's timers in milliseconds of the virtual clock (0: off).
    task_timeout_ms: u16,
    nop_interval_ms: u16,
    nop_timeout_ms: u16,
}

#[derive(Arbitrary, Debug)]
enum Step {
    Write { block: u8, blocks: u8, seed: u8 },
    Read { block: u8, blocks: u8 },
    Nop,
    AbortLast,
    HoldBackend(bool),
    Release,
    Advance(u16),
}

fn cdb16(op: u8, lba: u64, blocks: u32) -> [u8; 16] {
    let mut c = [0u8; 16];
    c[0] = op;
    c[2..10].copy_from_slice(&lba.to_be_bytes());
    c[10..14].copy_from_slice(&blocks.to_be_bytes());
    c
}

fuzz_target!(|input: (Setup, Vec<Step>)| {
    let (setup, steps) = input;
    let mut o = PairOptions::default();
    let t = &mut o.target.target;
    t.max_recv_data_segment_length = 512 * u32::from(setup.target_segment.max(1));
    t.operational.first_burst_length = 8192;
    t.operational.max_burst_length = 16384;
    o.target.window = u32::from(setup.window % 16) + 1;
    o.target.blocks = 256;
    let i = &mut o.initiator;
    i.max_recv_data_segment_length = 512 * u32::from(setup.initiator_segment.max(1));
    i.operational.initial_r2t = setup.initial_r2t;
    i.operational.immediate_data = setup.immediate_data;
    if setup.digests {
        for s in [&mut o.target.target, &mut o.initiator] {
            s.header_digest = vec![DigestAlgorithm::Crc32c, DigestAlgorithm::None];
            s.data_digest = vec![DigestAlgorithm::Crc32c, DigestAlgorithm::None];
        }
    }
    let mut p = Pair::new(o);
    let ms = |v: u16| (v > 0).then(|| Duration::from_millis(u64::from(v)));
    p.set_timers(Timers {
        task: ms(setup.task_timeout_ms),
        nop_interval: ms(setup.nop_interval_ms),
        nop_timeout: Duration::from_millis(u64::from(setup.nop_timeout_ms.max(1))),
    });
    let clean = setup.lose_after.is_none() && setup.flip.is_none();
    let faults = Faults {
        cut: setup.cut,
        delay: Duration::from_micros(u64::from(setup.delay_us)),
        lose_after: setup.lose_after.map(usize::from),
        flip: setup.flip.map(usize::from),
    };
    p.set_faults(
        faults.clone(),
        Faults {
            flip: None,
            ..faults
        },
    );
    // What each block holds, where that is known: a block written by one write at a time,
    // each of which ended GOOD. Concurrent SIMPLE writes to a block may land in any order, and
    // a failed write may have landed or not: either makes the block unknown until the next
    // write to it alone.
    let mut model: HashMap<u64, Block> = HashMap::new();
    let mut started: Vec<u32> = Vec::new();
    let mut writes: Vec<(u32, u64, Bytes)> = Vec::new();
    let mut settled = HashSet::new();
    for step in steps.into_iter().take(64) {
        match step {
            Step::Write {
                block,
                blocks,
                seed,
            } => {
                let (lba, n) = (u64::from(block), u32::from(blocks % 8) + 1);
                let data: Bytes = (0..n as usize * 512)
                    .map(|k| (k as u8).wrapping_mul(31) ^ seed)
                    .collect();
                let cmd = Command::write(Lun::ZERO, cdb16(0x8a, lba, n), data.clone());
                if let Ok(itt) = p.start(&cmd) {
                    started.push(itt);
                    writes.push((itt, lba, data));
                    for b in lba..lba + u64::from(n) {
                        model.entry(b).or_default().start();
                    }
                }
            }
            Step::Read { block, blocks } => {
                let (lba, n) = (u64::from(block), u32::from(blocks % 8) + 1);
                let cmd = Command::read(Lun::ZERO, cdb16(0x88, lba, n), n * 512);
                if let Ok(itt) = p.start(&cmd) {
                    started.push(itt);
                }
            }
            Step::Nop => {
                if let Ok(itt) = p.start_with(|s, now| s.start_nop(now)) {
                    started.push(itt);
                }
            }
            Step::AbortLast => {
                if let Some(&last) = started.last() {
                    let f = TaskManagementFunction::AbortTask;
                    if let Ok(itt) = p
                        .start_with(|s, now| s.start_task_management(now, f, Lun::ZERO, Some(last)))
                    {
                        started.push(itt);
                    }
                }
            }
            Step::HoldBackend(on) => p.rig.hold_backend = on,
            Step::Release => {
                p.rig.release_backend();
                p.pump();
            }
            Step::Advance(ms) => {
                p.run_until(|_| false, Duration::from_millis(u64::from(ms)));
            }
        }
        settle(&p, &writes, &mut settled, &mut model);
    }
    // Let everything finish: backend released, the clock run on.
    p.rig.hold_backend = false;
    while p.rig.release_backend() {
        p.pump();
    }
    let all_done = |p: &Pair| started.iter().all(|itt| p.done.contains_key(itt));
    let ended = p.run_until(
        |p| all_done(p) || p.initiator_closed().is_some(),
        Duration::from_secs(120),
    );
    // Without digests a flipped bit can go unnoticed (a CmdSN off by one is a command the
    // target waits for forever, as RFC 7143 says); an initiator's timeout is what ends such a
    // task. With digests every flip is caught.
    let detectable = setup.flip.is_none() || setup.digests || setup.task_timeout_ms > 0;
    assert!(
        ended || !detectable,
        "a task never ended on a live connection"
    );
    settle(&p, &writes, &mut settled, &mut model);
    if p.initiator_closed().is_some() || p.rig.closed().is_some() {
        p.run_until(|_| false, Duration::from_secs(1));
        assert!(p.rig.conn().is_idle(), "a task left on a closed connection");
    }
    if clean && p.initiator_closed().is_none() {
        // Everything has ended: a read now sees every known block.
        for (b, block) in model {
            let Some(want) = block.known() else { continue };
            let cmd = Command::read(Lun::ZERO, cdb16(0x88, b, 1), 512);
            match p.execute(&cmd) {
                Some(Ok(Reply::Scsi(r))) if r.status == ScsiStatus::GOOD => {
                    assert_eq!(r.data, want, "block {b}");
                }
                // A unit attention or an ended session says nothing about the data.
                _ => {}
            }
        }
    }
});

/// One block of the model.
#[derive(Debug, Default)]
struct Block {
    writers: u32,
    tainted: bool,
    value: Option<Bytes>,
}

impl Block {
    fn start(&mut self) {
        if self.writers > 0 {
            self.tainted = true;
        } else {
            self.tainted = false;
        }
        self.writers += 1;
        self.value = None;
    }

    fn end(&mut self, good: Option<Bytes>) {
        self.writers = self.writers.saturating_sub(1);
        match good {
            Some(v) if !self.tainted => self.value = Some(v),
            _ => {
                self.tainted = true;
                self.value = None;
            }
        }
    }

    fn known(&self) -> Option<Bytes> {
        (self.writers == 0 && !self.tainted)
            .then(|| self.value.clone())
            .flatten()
    }
}

/// Ends in the model the writes whose outcome has come in since the last call.
fn settle(
    p: &Pair,
    writes: &[(u32, u64, Bytes)],
    settled: &mut HashSet<u32>,
    model: &mut HashMap<u64, Block>,
) {
    for (itt, lba, data) in writes {
        if settled.contains(itt) {
            continue;
        }
        let Some(result) = p.done.get(itt) else {
            continue;
        };
        settled.insert(*itt);
        let good = matches!(result, Ok(Reply::Scsi(r)) if r.status == ScsiStatus::GOOD);
        for (j, chunk) in data.chunks(512).enumerate() {
            let b = model.entry(lba + j as u64).or_default();
            b.end(good.then(|| Bytes::copy_from_slice(chunk)));
        }
    }
}
