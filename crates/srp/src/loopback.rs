//! An SRP target with memory logical units on the software fabric's [`Switch`], run in the
//! caller's thread, and the login of an [`InitiatorChannel`] to it: what a benchmark or an
//! embedder's own tests run an SRP initiator against when there is no RDMA device and no
//! daemon (initiator-bench's `run --transport srp fabric` and `paper004` do).
//!
//! The target is the crate's machines and nothing else: [`Logins`] answers each connect
//! request (with [`LocalPolicy`]: one target port, nexuses in a [`LocalCore`]), a [`Channel`]
//! runs each logged-in channel, a [`Driver`] turns its transmits into work requests on the
//! switch and its completions back into inputs. [`LoopbackTarget::step`] is the whole shell,
//! the order in which a target over real verbs moves them too.
//!
//! The switch's fabric charges its [`Costs`](rdma::fabric::Costs) to a virtual clock
//! ([`Switch::with`]; [`PAPER_004_COSTS`](rdma::fabric::PAPER_004_COSTS) for paper 004's
//! InfiniBand link), so a run that steps the target in its own thread measures on a clock
//! that does not depend on this machine's load.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Instant;

use scsi_core::{
    BackendError, Device, Geometry, Identity, Limits, LogicalUnit, MemoryBackend, NexusId,
    TargetPort,
};

use crate::initiator::channel::InitiatorChannel;
use crate::initiator::Registration;
use crate::iu::{Iu, LoginRejectReason, SrpLoginReq, SrpLoginRsp};
use crate::target_port::channel::SPARE_RECEIVES;
use crate::target_port::{
    Channel, Driver, Event, ItNexusKey, Left, LocalChannel, LocalCore, LocalPolicy, Logins,
    PortSettings, VecBuffers,
};
use rdma::fabric::{NodeId, QpId};
use rdma::switch::{Endpoint, Reply, Switch, SwitchError};
use rdma::verbs::{Verbs, VerbsError};

/// An initiator's channel on the switch, as [`LoopbackTarget::login`] makes it.
pub type LoopbackInitiator = InitiatorChannel<Endpoint<Vec<u8>>>;

/// A memory logical unit of a [`LoopbackTarget`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MemoryUnit {
    /// Its LUN index.
    pub lun: u16,
    /// Bytes per logical block.
    pub block_size: u32,
    /// Logical blocks.
    pub blocks: u64,
}

/// One logged-in channel of the target: its machine, its queue pair's driver, its buffers.
#[derive(Debug)]
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

/// An SRP target port on a switch: its login settings, its nexuses and channels, the device
/// and its memory units' storage.
#[derive(Debug)]
pub struct LoopbackTarget {
    verbs: Endpoint<Vec<u8>>,
    service: String,
    target_port_id: [u8; 16],
    logins: Logins<usize>,
    core: LocalCore,
    storage: HashMap<u16, MemoryBackend>,
    channels: Vec<TargetChannel>,
}

/// Why a [`LoopbackTarget`] could not be made.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LoopbackError {
    /// The service has a listener already.
    #[error(transparent)]
    Switch(#[from] SwitchError),
    /// Two units have the same LUN, or a LUN beyond the device's.
    #[error("LUN {0} cannot be added: {1}")]
    Unit(u16, String),
}

/// Why a login to a [`LoopbackTarget`] gave no channel.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LoginError {
    /// Nobody listens on the service.
    #[error(transparent)]
    Switch(#[from] SwitchError),
    /// The target refused the login (SRP_LOGIN_REJ).
    #[error("the target refused the login: {0:?}")]
    Rejected(LoginRejectReason),
    /// The target answered with something other than an SRP_LOGIN_RSP or SRP_LOGIN_REJ, or
    /// not at all.
    #[error("the target's answer to the login is not an SRP_LOGIN_RSP")]
    NoResponse,
    /// The initiator's IU buffers or data memory could not be had.
    #[error("the initiator's memory: {0}")]
    Memory(VerbsError),
}

impl LoopbackTarget {
    /// A target on `node` of `switch`, listening on `service`, with the port's `settings` and
    /// `units`. Plain READs and WRITEs are delegated to the channels, as a daemon's are.
    pub fn new(
        switch: &Arc<Switch>,
        node: NodeId,
        service: &str,
        settings: PortSettings,
        units: &[MemoryUnit],
    ) -> Result<LoopbackTarget, LoopbackError> {
        let name = "loopback-srp-target";
        let port = TargetPort::srp(name, settings.target_port_id, 1);
        let mut device = Device::new(name, vec![port]);
        device.set_delegation(true);
        let mut storage = HashMap::new();
        for u in units {
            let unit = LogicalUnit {
                identity: Identity::new(
                    "LOOPBACK",
                    "srp-memory",
                    "0001",
                    format!("srp-{}", u.lun).as_bytes(),
                ),
                geometry: Geometry {
                    block_size: u.block_size,
                    blocks: u.blocks,
                    thin: true,
                    write_cache: true,
                    read_only: false,
                },
                limits: Limits::default(),
            };
            device
                .add_lu(u.lun, unit)
                .map_err(|e| LoopbackError::Unit(u.lun, format!("{e:?}")))?;
            storage.insert(u.lun, MemoryBackend::new(u.block_size, u.blocks));
        }
        let verbs = switch.endpoint(node);
        verbs.listen(service)?;
        Ok(LoopbackTarget {
            verbs,
            service: service.to_string(),
            target_port_id: settings.target_port_id,
            logins: Logins::new(settings),
            core: LocalCore::new(device),
            storage,
            channels: Vec::new(),
        })
    }

    /// The device.
    pub fn core(&self) -> &LocalCore {
        &self.core
    }

    /// Channels logged in and not yet gone.
    pub fn channels(&self) -> usize {
        self.channels.iter().filter(|c| !c.gone).count()
    }

    /// Answers the connect requests waiting on the service: each carries an SRP_LOGIN_REQ;
    /// it is accepted with an SRP_LOGIN_RSP (a queue pair connected, its receives posted) or
    /// refused with an SRP_LOGIN_REJ. True if there was one.
    pub fn accept_logins(&mut self) -> bool {
        let mut any = false;
        while let Some(request) = self.verbs.next_request(&self.service) {
            any = true;
            let Ok(Iu::LoginReq(req)) = Iu::decode(&request.private) else {
                // Not an SRP login: refused without an answer to decode.
                self.verbs.reject(request, &[]);
                continue;
            };
            let mut private = Vec::new();
            let mut policy = LocalPolicy {
                core: &mut self.core,
                target_port_id: self.target_port_id,
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
                    // Unit attentions go to the nexus's newest channel (SRP_AER_REQ).
                    let _ = self.core.announce_to(accepted.nexus, Some(ch));
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
        any
    }

    /// Moves every channel on as far as it goes now: logins answered, completions in, the
    /// core's requests carried out, work requests out; a channel that is over leaves once its
    /// tasks have ended. True if anything moved.
    pub fn step(&mut self, now: Instant) -> bool {
        let mut moved = self.accept_logins();
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
                    // Memory units complete at once; a unit that is gone fails the operation.
                    Event::Backend {
                        task,
                        lun,
                        op,
                        mut buffer,
                    } => {
                        let result = match self.storage.get_mut(&lun) {
                            Some(unit) => unit.execute(&op, &mut buffer),
                            None => Err(BackendError::Internal),
                        };
                        c.channel
                            .handle_backend_done(now, task, buffer, result, core);
                    }
                    Event::BufferWanted { tag, len } => {
                        c.channel.handle_buffer(now, tag, Some(vec![0; len]), core)
                    }
                    Event::Completed(_) => {}
                }
            }
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

    /// Logs an initiator channel in from `verbs`'s node with `req`: the connect request goes
    /// through the switch and this target answers it at once. The channel's data memory is
    /// `places` places of `place_len` bytes, registered as `registration` says
    /// ([`InitiatorChannel::new`]).
    pub fn login(
        &mut self,
        verbs: &mut Endpoint<Vec<u8>>,
        req: &SrpLoginReq,
        registration: Registration,
        places: usize,
        place_len: usize,
    ) -> Result<(LoopbackInitiator, SrpLoginRsp), LoginError> {
        let mut private = Vec::new();
        req.encode(&mut private);
        let switch = Arc::clone(verbs.switch());
        let id = switch.connect(verbs.node(), &self.service, &private)?;
        self.step(Instant::now());
        let (qp, private) = match switch.reply(id) {
            Some(Reply::Accepted { qp, private }) => (qp, private),
            Some(Reply::Rejected(private)) => {
                return Err(match Iu::decode(&private) {
                    Ok(Iu::LoginRej(rej)) => LoginError::Rejected(rej.reason),
                    _ => LoginError::NoResponse,
                })
            }
            None => return Err(LoginError::NoResponse),
        };
        let Ok(Iu::LoginRsp(rsp)) = Iu::decode(&private) else {
            return Err(LoginError::NoResponse);
        };
        let channel = InitiatorChannel::new(verbs, qp, &rsp, registration, places, place_len)
            .map_err(LoginError::Memory)?;
        Ok((channel, rsp))
    }
}
