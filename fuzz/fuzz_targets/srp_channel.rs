//! SRP target channels over the software fabric, fed Arbitrary sequences of logins, commands
//! (with direct, indirect and partial-table descriptors), raw and mutated IUs, task management,
//! logouts and held backend operations. The rig's initiator panics on any IU it cannot decode;
//! the channel never holds more requests than the credit it gave; and once everything is
//! released and every channel logged out, the device holds no task.
#![no_main]

use arbitrary::Arbitrary;
use libfuzzer_sys::fuzz_target;
use srp::iu::{MultiChannelAction, SrpCmd, TaskManagementFunction};
use srp::testing::{Cmd, Registration, Rig};

#[derive(Arbitrary, Debug)]
enum Step {
    Login {
        port: u8,
        multi: bool,
    },
    Io {
        write: bool,
        ch: u8,
        tag: u8,
        lba: u16,
        blocks: u8,
        regions: u8,
        partial: bool,
    },
    Inquiry {
        ch: u8,
        tag: u8,
        len: u8,
    },
    Raw {
        ch: u8,
        bytes: Vec<u8>,
    },
    Mutated {
        ch: u8,
        tag: u8,
        at: u8,
        byte: u8,
    },
    Tmf {
        ch: u8,
        tag: u8,
        function: u8,
        task_tag: u8,
    },
    Logout {
        ch: u8,
    },
    Hold(bool),
    Release,
    /// Hold the target's RDMA READ completions, or hand them in (a slow fabric).
    HoldReads(bool),
    /// How the initiators register their buffers from now on.
    Registration(u8),
}

fn cdb(op: u8, lba: u16, blocks: u8) -> Vec<u8> {
    vec![op, 0, 0, 0, (lba >> 8) as u8, lba as u8, 0, 0, blocks, 0]
}

fuzz_target!(|steps: Vec<Step>| {
    let mut rig = Rig::new(&[(0, 512, 4096)]);
    let live = |rig: &Rig, ch: u8| {
        let n = rig.channels.len();
        (n > 0).then(|| ch as usize % n)
    };
    for step in steps.into_iter().take(200) {
        match step {
            Step::Login { port, multi } => {
                let action = if multi {
                    MultiChannelAction::MultiChannel
                } else {
                    MultiChannelAction::SingleChannel
                };
                let _ = rig.login(&Rig::login_request([port % 4; 16], action));
            }
            Step::Io {
                write,
                ch,
                tag,
                lba,
                blocks,
                regions,
                partial,
            } => {
                if let Some(ch) = live(&rig, ch) {
                    let blocks = blocks % 17;
                    let len = usize::from(blocks) * 512;
                    let cmd = Cmd {
                        tag: u64::from(tag),
                        cdb: cdb(if write { 0x2a } else { 0x28 }, lba, blocks),
                        data_out: (write && blocks > 0).then(|| vec![tag; len]),
                        data_in: if write { 0 } else { len as u32 },
                        regions: usize::from(regions % 9),
                        partial,
                        ..Cmd::default()
                    };
                    let _ = rig.send(ch, &cmd);
                }
            }
            Step::Inquiry { ch, tag, len } => {
                if let Some(ch) = live(&rig, ch) {
                    let cmd = Cmd {
                        tag: u64::from(tag),
                        cdb: vec![0x12, 0, 0, 0, len, 0],
                        data_in: u32::from(len),
                        ..Cmd::default()
                    };
                    let _ = rig.send(ch, &cmd);
                }
            }
            Step::Raw { ch, bytes } => {
                if let Some(ch) = live(&rig, ch) {
                    rig.send_raw(ch, &bytes);
                }
            }
            Step::Mutated { ch, tag, at, byte } => {
                if let Some(ch) = live(&rig, ch) {
                    let cdb = cdb(0x28, 0, 1);
                    let mut b = Vec::new();
                    SrpCmd {
                        tag: u64::from(tag),
                        cdb: &cdb,
                        ..SrpCmd::default()
                    }
                    .encode(&mut b);
                    let i = usize::from(at) % b.len();
                    b[i] = byte;
                    rig.send_raw(ch, &b);
                }
            }
            Step::Tmf {
                ch,
                tag,
                function,
                task_tag,
            } => {
                if let Some(ch) = live(&rig, ch) {
                    let f = TaskManagementFunction::from_code(function);
                    rig.task_management(ch, u64::from(tag), 0, f, u64::from(task_tag));
                }
            }
            Step::Logout { ch } => {
                if let Some(ch) = live(&rig, ch) {
                    rig.logout(ch);
                }
            }
            Step::Hold(h) => rig.hold_backend = h,
            Step::Release => rig.release(),
            Step::HoldReads(true) => rig.hold_reads = true,
            Step::Registration(r) => {
                rig.registration = [
                    Registration::PerCommand,
                    Registration::Cache,
                    Registration::Pool,
                ][r as usize % 3]
            }
            Step::HoldReads(false) => {
                rig.hold_reads = false;
                rig.release_reads();
            }
        }
        rig.run();
        for c in &rig.channels {
            assert!(c.channel.outstanding() <= c.channel.params().request_limit);
        }
    }
    rig.hold_backend = false;
    rig.hold_reads = false;
    rig.release_reads();
    rig.release();
    for ch in 0..rig.channels.len() {
        if !rig.channels[ch].gone {
            rig.logout(ch);
        }
    }
    rig.run();
    rig.release_reads();
    rig.release();
    assert!(rig.channels.iter().all(|c| c.gone), "a channel did not end");
    assert_eq!(rig.device_tasks(), 0, "tasks left in the device");
    assert_eq!(rig.nexuses(), 0);
});
