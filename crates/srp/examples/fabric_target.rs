//! An SRP target on the software RDMA fabric, on the crate's public API alone: one target port
//! with a 64 MiB memory logical unit, an initiator channel that logs in, writes, reads back
//! and compares, then logs out.
//!
//! ```text
//! cargo run -p storage-target-srp --example fabric_target
//! ```
//!
//! The target is [`LoopbackTarget`]: the protocol is in the crate's machines ([`Logins`]
//! answers the login, a `Channel` runs each logged-in channel: SRP_CMD into the SCSI core,
//! RDMA READ of data-out, RDMA WRITE of data-in, SRP_RSP, credits), and
//! [`LoopbackTarget::step`] is only the shell around them: the switch's connection manager
//! and queue pairs, the memory unit, and the order of the steps (read `src/loopback.rs` to
//! write one over other verbs). The initiator is an [`InitiatorChannel`] on the same switch.
//! On real hardware the same machines run over `rdma::ibverbs`'s verbs (feature `rdma`), with
//! rdma_cm carrying the login as the switch does here.
//!
//! [`Logins`]: srp::target_port::Logins

use std::time::Instant;

use rdma::fabric::NodeId;
use rdma::switch::{Endpoint, Switch};
use srp::initiator::channel::{Command, InitiatorChannel};
use srp::initiator::Registration;
use srp::iu::{BufferFormats, MultiChannelAction, SrpLoginReq, TaskAttribute};
use srp::loopback::{LoopbackTarget, MemoryUnit};
use srp::target_port::PortSettings;

/// The target's host on the fabric.
const TARGET: NodeId = NodeId(0);
/// The initiator's host.
const INITIATOR: NodeId = NodeId(1);
/// The service the target listens on (rdma_cm's port).
const SERVICE: &str = "srp";
/// The target port's identifier (the initiator names it in its login).
pub const TARGET_PORT: [u8; 16] = *b"example-srp-tgt0";
const BLOCK_SIZE: u32 = 512;
const BLOCKS: u64 = (64 << 20) / BLOCK_SIZE as u64;

fn main() {
    match demo() {
        Ok(verified) => println!("{verified} bytes written, read back and compared over SRP"),
        Err(e) => {
            eprintln!("{e}");
            std::process::exit(1);
        }
    }
}

/// Logs in, writes 1 MiB in 64 KiB commands, reads it back and compares, logs out. Returns
/// how many bytes were verified.
pub fn demo() -> Result<usize, String> {
    let switch = Switch::new();
    let settings = PortSettings {
        target_port_id: TARGET_PORT,
        ..PortSettings::default()
    };
    let unit = MemoryUnit {
        lun: 0,
        block_size: BLOCK_SIZE,
        blocks: BLOCKS,
    };
    let mut target = LoopbackTarget::new(&switch, TARGET, SERVICE, settings, &[unit])
        .map_err(|e| format!("the target: {e}"))?;
    let req = SrpLoginReq {
        tag: 1,
        // Room for an SRP_CMD with a table of 16 descriptors.
        req_it_iu_len: 48 + 20 + 16 * 16,
        req_buf_fmt: BufferFormats::BOTH,
        multi_channel: MultiChannelAction::SingleChannel,
        initiator_port_id: *b"example-srp-init",
        target_port_id: TARGET_PORT,
        ..SrpLoginReq::default()
    };
    let mut verbs: Endpoint<Vec<u8>> = switch.endpoint(INITIATOR);
    let (mut channel, _) = target
        .login(&mut verbs, &req, Registration::Pool, 8, 1 << 17)
        .map_err(|e| format!("login: {e}"))?;

    // One command at a time, run until its answer comes.
    let mut run = |channel: &mut InitiatorChannel<_>, cmd: Command<'_>| {
        channel
            .send(Instant::now(), &mut verbs, &cmd)
            .map_err(|e| format!("send: {e:?}"))?;
        loop {
            if let Some(answer) = channel.poll(&mut verbs) {
                return Ok(answer);
            }
            if !target.step(Instant::now()) {
                return Err("the target stopped without answering".to_string());
            }
        }
    };
    // The first command hears of the power on (a unit attention); TEST UNIT READY takes it.
    run(&mut channel, command(1, &[0; 10]))?;
    let chunk = 64 << 10;
    let data: Vec<u8> = (0..16 * chunk).map(|i| (i * 7 + i / 4096) as u8).collect();
    let rw10 = |opcode: u8, at: usize| {
        let lba = (at / BLOCK_SIZE as usize) as u32;
        let blocks = (chunk / BLOCK_SIZE as usize) as u16;
        let mut cdb = [opcode, 0, 0, 0, 0, 0, 0, 0, 0, 0];
        cdb[2..6].copy_from_slice(&lba.to_be_bytes());
        cdb[7..9].copy_from_slice(&blocks.to_be_bytes());
        cdb
    };
    for (i, at) in (0..data.len()).step_by(chunk).enumerate() {
        let cdb = rw10(0x2a, at);
        let write = Command {
            data_out: Some(&data[at..at + chunk]),
            ..command(2 + i as u64, &cdb)
        };
        let answer = run(&mut channel, write)?;
        if answer.status != 0 {
            return Err(format!("WRITE(10) at {at}: status {:#x}", answer.status));
        }
    }
    for (i, at) in (0..data.len()).step_by(chunk).enumerate() {
        let cdb = rw10(0x28, at);
        let read = Command {
            data_in: chunk as u32,
            ..command(100 + i as u64, &cdb)
        };
        let answer = run(&mut channel, read)?;
        if answer.status != 0 || answer.data != data[at..at + chunk] {
            return Err(format!(
                "READ(10) at {at}: status {:#x}, data differs",
                answer.status
            ));
        }
    }
    channel
        .logout(&mut verbs)
        .map_err(|e| format!("logout: {e:?}"))?;
    while target.step(Instant::now()) {}
    if target.channels() != 0 {
        return Err("the channel is still open after the logout".into());
    }
    Ok(data.len())
}

/// A command of `cdb` to LUN 0 with tag `tag`, in one region, without data.
fn command(tag: u64, cdb: &[u8]) -> Command<'_> {
    Command {
        tag,
        lun: 0,
        cdb,
        data_out: None,
        data_in: 0,
        regions: 1,
        partial: false,
        attribute: TaskAttribute::Simple,
    }
}
