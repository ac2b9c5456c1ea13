//! An SRP target on the software RDMA fabric, on the crate's public API alone: one target port
//! with a 64 MiB memory logical unit, an initiator channel that logs in, writes, reads back
//! and compares, then logs out.
//!
//! ```text
//! cargo run -p storage-target-srp --example fabric_target
//! ```
//!
//! The protocol is in the machines: [`Logins`] answers the login (with [`LocalPolicy`]: one
//! target port, nexuses in the [`LocalCore`]),
//! [`Channel`] runs each logged-in channel (SRP_CMD into the SCSI core, RDMA READ of data-out,
//! RDMA WRITE of data-in, SRP_RSP, credits), [`Driver`] turns its transmits into work requests
//! and its completions back into inputs, and [`LocalCore`] holds the device. What is here is
//! only the shell: the fabric's connection manager and queue pairs (`srp::switch`), the memory
//! unit, and the order of the steps. On real hardware the same code runs over `srp::rdma`'s
//! verbs (feature `rdma`), with rdma_cm carrying the login as the switch does here.

use std::sync::Arc;
use std::time::Instant;

use scsi_core::{
    Device, Geometry, Identity, Limits, LogicalUnit, MemoryBackend, NexusId, TargetPort,
};
use srp::fabric::{NodeId, QpId};
use srp::initiator::channel::{Command, InitiatorChannel};
use srp::initiator::Registration;
use srp::iu::{BufferFormats, Iu, MultiChannelAction, SrpLoginReq, TaskAttribute};
use srp::switch::{Endpoint, Reply, Switch};
use srp::target::channel::SPARE_RECEIVES;
use srp::target::{
    Channel, Driver, Event, ItNexusKey, Left, LocalChannel, LocalCore, LocalPolicy, Logins,
    PortSettings, VecBuffers,
};
use srp::verbs::Verbs;

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

/// One logged-in channel of the target: its machine, its queue pair's driver, its buffers.
struct TargetChannel {
    channel: Channel<Vec<u8>>,
    driver: Driver<QpId>,
    buffers: VecBuffers,
    key: ItNexusKey,
    nexus: NexusId,
    gone: bool,
}

impl LocalChannel for TargetChannel {
    type Buffer = Vec<u8>;

    fn machine(&mut self) -> &mut Channel<Vec<u8>> {
        &mut self.channel
    }
}

/// The target: its port's login settings, the nexuses and their channels, the device and the
/// memory unit's storage.
pub struct Target {
    verbs: Endpoint<Vec<u8>>,
    logins: Logins<usize>,
    core: LocalCore,
    storage: MemoryBackend,
    channels: Vec<TargetChannel>,
}

impl Target {
    /// A target with one memory unit as LUN 0, listening on the switch.
    pub fn new(switch: &Arc<Switch>) -> Target {
        let name = "example-srp-target";
        let mut device = Device::new(name, vec![TargetPort::srp(name, TARGET_PORT, 1)]);
        let unit = LogicalUnit {
            identity: Identity::new("EXAMPLE", "srp-memory", "0001", b"srp-lu0"),
            geometry: Geometry {
                block_size: BLOCK_SIZE,
                blocks: BLOCKS,
                thin: false,
                write_cache: false,
                read_only: false,
            },
            limits: Limits::default(),
        };
        device.add_lu(0, unit).expect("LUN 0 is free");
        let settings = PortSettings {
            target_port_id: TARGET_PORT,
            ..PortSettings::default()
        };
        let verbs = switch.endpoint(TARGET);
        verbs.listen(SERVICE).expect("the service is free");
        Target {
            verbs,
            logins: Logins::new(settings),
            core: LocalCore::new(device),
            storage: MemoryBackend::new(BLOCK_SIZE, BLOCKS),
            channels: Vec::new(),
        }
    }

    /// Answers the connect requests waiting on the service: each carries an SRP_LOGIN_REQ;
    /// it is accepted with an SRP_LOGIN_RSP (a queue pair connected, its receives posted) or
    /// refused with an SRP_LOGIN_REJ.
    pub fn accept_logins(&mut self) {
        while let Some(request) = self.verbs.next_request(SERVICE) {
            let Ok(Iu::LoginReq(req)) = Iu::decode(&request.private) else {
                // Not an SRP login: refused without an answer to decode.
                self.verbs.reject(request, &[]);
                continue;
            };
            let mut private = Vec::new();
            let mut policy = LocalPolicy {
                core: &mut self.core,
                target_port_id: TARGET_PORT,
                channels: &mut self.channels,
            };
            match self.logins.login(&req, &mut policy) {
                Ok(accepted) => {
                    accepted.response.encode(&mut private);
                    let params = accepted.params;
                    let receives = (0..params.request_limit + SPARE_RECEIVES)
                        .map(|_| vec![0; params.max_it_iu_len as usize]);
                    let qp = self.verbs.accept(request, receives, &private);
                    let ch = self.channels.len();
                    self.logins.connected(&accepted, ch);
                    self.channels.push(TargetChannel {
                        channel: Channel::new(accepted.nexus, params),
                        driver: Driver::new(qp),
                        buffers: VecBuffers::default(),
                        key: accepted.key,
                        nexus: accepted.nexus,
                        gone: false,
                    });
                }
                Err(refusal) => {
                    refusal.reject.encode(&mut private);
                    self.verbs.reject(request, &private);
                }
            }
        }
    }

    /// Moves every channel on as far as it goes now: completions in, the core's requests
    /// carried out, work requests out. True if anything moved.
    pub fn step(&mut self) -> bool {
        let now = Instant::now();
        let mut moved = false;
        self.accept_logins();
        for (ch, c) in self.channels.iter_mut().enumerate() {
            if c.gone {
                continue;
            }
            let core = &mut self.core.channel(ch, c.nexus);
            let verbs = &mut self.verbs;
            let qp = c.driver.qp();
            while let Some(wc) = verbs.poll(qp) {
                moved = true;
                let machine = &mut c.channel;
                if c.driver
                    .complete(now, wc, machine, core, verbs, &mut c.buffers)
                    .is_err()
                {
                    verbs.disconnect(qp);
                }
            }
            if core.core().has_work(ch) {
                moved = true;
                c.channel.handle_core(now, core);
            }
            match c
                .driver
                .transmit(now, &mut c.channel, core, verbs, &mut c.buffers)
            {
                Ok(any) => moved |= any,
                Err(_) => verbs.disconnect(qp),
            }
            while let Some(event) = c.channel.poll_event() {
                moved = true;
                match event {
                    // The memory unit completes at once.
                    Event::Backend {
                        task,
                        op,
                        mut buffer,
                        ..
                    } => {
                        let result = self.storage.execute(&op, &mut buffer);
                        c.channel
                            .handle_backend_done(now, task, buffer, result, core);
                    }
                    Event::BufferWanted { tag, len } => {
                        c.channel.handle_buffer(now, tag, Some(vec![0; len]), core)
                    }
                    Event::Completed(_) => {}
                }
            }
            // A channel that is over (a logout, a lost queue pair) leaves once its tasks end.
            let lost = verbs.is_error(qp);
            if lost {
                c.channel.close(false, core);
            }
            if (c.channel.closing().is_some() || lost) && c.channel.is_idle() {
                c.gone = true;
                moved = true;
                verbs.disconnect(qp);
                if let Left::Ended(nexus) = self.logins.leave(c.key, &ch) {
                    let _ = core.core().close_nexus(nexus);
                }
            }
        }
        moved
    }
}

/// Logs in, writes 1 MiB in 64 KiB commands, reads it back and compares, logs out. Returns
/// how many bytes were verified.
pub fn demo() -> Result<usize, String> {
    let switch = Switch::new();
    let mut target = Target::new(&switch);
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
    let mut private = Vec::new();
    req.encode(&mut private);
    let id = switch
        .connect(INITIATOR, SERVICE, &private)
        .map_err(|e| format!("connect: {e}"))?;
    target.step();
    let (qp, private) = match switch.reply(id) {
        Some(Reply::Accepted { qp, private }) => (qp, private),
        other => return Err(format!("login refused: {other:?}")),
    };
    let Ok(Iu::LoginRsp(rsp)) = Iu::decode(&private) else {
        return Err("the answer is not an SRP_LOGIN_RSP".into());
    };
    let mut verbs: Endpoint<Vec<u8>> = switch.endpoint(INITIATOR);
    let mut channel = InitiatorChannel::new(&mut verbs, qp, &rsp, Registration::Pool, 8, 1 << 17)
        .map_err(|e| format!("the initiator's memory: {e}"))?;

    // One command at a time, run until its answer comes.
    let mut run = |channel: &mut InitiatorChannel<_>, cmd: Command<'_>| {
        channel
            .send(Instant::now(), &mut verbs, &cmd)
            .map_err(|e| format!("send: {e:?}"))?;
        loop {
            if let Some(answer) = channel.poll(&mut verbs) {
                return Ok(answer);
            }
            if !target.step() {
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
    while target.step() {}
    if !target.channels.iter().all(|c| c.gone) {
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
