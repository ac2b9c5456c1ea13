//! The login of an RDMA channel (SRP-2 section 5.5): whether a target port accepts an
//! SRP_LOGIN_REQ and on what terms, and the channels of each I_T nexus, which a new login
//! joins (MULTI CHANNEL) or replaces (SINGLE CHANNEL).
//!
//! [`Logins`] decides a port's logins as iSCSI's `Login` does, with what is not SRP's left to
//! a [`LoginPolicy`]: which target a target port identifier names and who may reach it, the
//! SCSI core's I_T nexuses, and the channels a login replaces. The shell connects an accepted
//! channel ([`Accepted`]) with its verbs, then tells the machine whether it came up.

use std::collections::HashMap;

use scsi_core::sense::MAX_SENSE_LEN;
use scsi_core::NexusId;

use super::channel::ChannelParams;
use crate::iu::{
    BufferFormats, LoginRejectReason, MultiChannelAction, MultiChannelResult, SrpLoginRej,
    SrpLoginReq, SrpLoginRsp, DESCRIPTOR_LEN,
};

/// The largest IU this target sends: an SRP_RSP with a task management function's 4 bytes of
/// response data and the longest sense data scsi-core builds.
pub const MAX_TI_IU_LEN: u32 = 36 + 4 + MAX_SENSE_LEN as u32;

/// The smallest IU an initiator must be able to send: an SRP_CMD with one direct descriptor
/// for each direction.
pub const MIN_IT_IU_LEN: u32 = 48 + 2 * DESCRIPTOR_LEN as u32;

/// The smallest IMMEDIATE DATA OFFSET granted: an SRP_CMD and its immediate descriptor.
pub const MIN_IMM_DATA_OFFSET: u32 = 48 + 4;

/// A target port identifier for a target named `name`, the same on every host and across
/// restarts: two FNV-1a hashes of the name, as ID_EXT and IOC_GUID. targetd names its targets'
/// SRP ports so; an initiator that knows the name (say, from a URL) derives the identifier.
pub fn port_id_for(name: &str) -> [u8; 16] {
    let fnv = |basis: u64| {
        name.bytes().fold(basis, |h, b| {
            (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3)
        })
    };
    let mut id = [0u8; 16];
    id[..8].copy_from_slice(&fnv(0xcbf2_9ce4_8422_2325).to_be_bytes());
    id[8..].copy_from_slice(&fnv(0x6c62_272e_07bb_0142).to_be_bytes());
    id
}

/// The largest IU a port takes unless configured otherwise: 8276 as Linux's ib_srpt, an
/// SRP_CMD (48), 16 bytes of additional CDB, an indirect descriptor's header (20), and 8 KiB
/// of immediate data or of descriptors. Linux's ib_srp asks for 8260 by default (8 KiB of
/// immediate data at offset 68) and does not retry with less.
pub const DEFAULT_MAX_IT_IU_LEN: u32 = 8276;

/// What a target port offers at login.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PortSettings {
    /// The target port's identifier (on InfiniBand, the I/O controller's GUID and an ID
    /// extension): a login naming another is rejected.
    pub target_port_id: [u8; 16],
    /// The largest IU an initiator may send, at most the receive buffers' size. The
    /// default, [`DEFAULT_MAX_IT_IU_LEN`], takes Linux's ib_srp's default login (8 KiB of
    /// immediate data) and an SRP_CMD with 500 descriptors in the IU.
    pub max_it_iu_len: u32,
    /// Grant immediate data (SRP-2) to an initiator that asks: a write whose data fits in
    /// the IU carries it in the SRP_CMD, with no RDMA READ round trip.
    pub immediate_data: bool,
    /// Requests an initiator may have outstanding on a channel: the receives posted for it.
    pub request_limit: u32,
    /// Descriptor formats accepted.
    pub formats: BufferFormats,
    /// The most descriptors one command's table may hold (a fetched table is read into
    /// memory only within this bound): 4096 (64 KiB).
    pub max_descriptors: u32,
    /// Channels one I_T nexus may have.
    pub channels_per_nexus: usize,
}

impl Default for PortSettings {
    fn default() -> Self {
        PortSettings {
            target_port_id: [0; 16],
            max_it_iu_len: DEFAULT_MAX_IT_IU_LEN,
            immediate_data: true,
            request_limit: 128,
            formats: BufferFormats::BOTH,
            max_descriptors: 4096,
            channels_per_nexus: 4,
        }
    }
}

impl PortSettings {
    /// The channel's terms if the port accepts `req`, else the rejection.
    pub fn evaluate(&self, req: &SrpLoginReq) -> Result<ChannelParams, SrpLoginRej> {
        if req.target_port_id != self.target_port_id {
            return Err(self.reject(req, LoginRejectReason::UnableToEstablishChannel));
        }
        self.terms(req)
    }

    /// The SRP_LOGIN_REJ of `req` for `reason`.
    pub fn reject(&self, req: &SrpLoginReq, reason: LoginRejectReason) -> SrpLoginRej {
        SrpLoginRej {
            reason,
            tag: req.tag,
            sup_buf_fmt: self.formats,
        }
    }

    /// The channel's terms for `req`, whatever target port it names (a port serving several
    /// targets has checked that with its [`LoginPolicy`]), else the rejection.
    pub fn terms(&self, req: &SrpLoginReq) -> Result<ChannelParams, SrpLoginRej> {
        let reject = |reason| self.reject(req, reason);
        if req.req_it_iu_len > self.max_it_iu_len {
            return Err(reject(LoginRejectReason::ItIuLengthTooLarge));
        }
        if req.req_it_iu_len < MIN_IT_IU_LEN {
            return Err(reject(LoginRejectReason::UnableToEstablishChannel));
        }
        if !self.formats.contains(req.req_buf_fmt) {
            return Err(reject(LoginRejectReason::UnsupportedDescriptorFormat));
        }
        // Immediate data starts after the SRP_CMD and its immediate descriptor at least, and
        // within the IU; an offset that cannot be is not granted (the login stands).
        let offset = u32::from(req.imm_data_offset);
        let imm_data_offset = (self.immediate_data
            && req.immediate_data
            && offset >= MIN_IMM_DATA_OFFSET
            && offset < req.req_it_iu_len)
            .then_some(req.imm_data_offset);
        Ok(ChannelParams {
            imm_data_offset,
            max_it_iu_len: req.req_it_iu_len,
            max_ti_iu_len: MAX_TI_IU_LEN,
            request_limit: self.request_limit,
            formats: self.formats,
            max_descriptors: self.max_descriptors,
        })
    }

    /// The SRP_LOGIN_RSP for an accepted `req`.
    pub fn response(
        &self,
        req: &SrpLoginReq,
        params: &ChannelParams,
        result: MultiChannelResult,
    ) -> SrpLoginRsp {
        SrpLoginRsp {
            req_lim_delta: params.request_limit,
            tag: req.tag,
            max_it_iu_len: params.max_it_iu_len,
            max_ti_iu_len: params.max_ti_iu_len,
            sup_buf_fmt: self.formats,
            multi_channel: result,
            immediate_data: params.imm_data_offset.is_some(),
        }
    }
}

/// An I_T nexus as SRP names it: the initiator port and the target port.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ItNexusKey {
    /// INITIATOR PORT IDENTIFIER.
    pub initiator: [u8; 16],
    /// TARGET PORT IDENTIFIER.
    pub target: [u8; 16],
}

impl ItNexusKey {
    /// The nexus a login request names.
    pub fn of(req: &SrpLoginReq) -> ItNexusKey {
        ItNexusKey {
            initiator: req.initiator_port_id,
            target: req.target_port_id,
        }
    }
}

/// What a login does to the channels of its I_T nexus.
#[derive(Debug, PartialEq, Eq)]
pub enum Admission<C> {
    /// No channel of the nexus exists: open the nexus, then [`ChannelTable::attach`].
    New,
    /// MULTI CHANNEL: the channel joins the nexus (result MAINTAINED).
    Join(NexusId),
    /// SINGLE CHANNEL with channels present: they are logged out (SRP_T_LOGOUT, MULTI-CHANNEL
    /// ACTION) and their nexus closed; open a new one, then attach (result TERMINATED).
    Replace {
        /// The nexus to close.
        nexus: NexusId,
        /// Its channels, to terminate.
        channels: Vec<C>,
    },
}

impl<C> Admission<C> {
    /// The login response's MULTI-CHANNEL RESULT.
    pub fn result(&self) -> MultiChannelResult {
        match self {
            Admission::New => MultiChannelResult::NoExistingChannels,
            Admission::Join(_) => MultiChannelResult::Maintained,
            Admission::Replace { .. } => MultiChannelResult::Terminated,
        }
    }
}

/// What leaving did.
#[derive(Debug, PartialEq, Eq)]
pub enum Left {
    /// Other channels keep the nexus.
    Stays,
    /// That was the last channel: close the nexus.
    Ended(NexusId),
    /// The channel was not in the table (replaced already).
    Unknown,
}

/// A target port's channels by I_T nexus.
#[derive(Debug)]
pub struct ChannelTable<C> {
    nexuses: HashMap<ItNexusKey, (NexusId, Vec<C>)>,
    per_nexus: usize,
}

impl<C: Clone + PartialEq> ChannelTable<C> {
    /// An empty table allowing `per_nexus` channels per I_T nexus.
    pub fn new(per_nexus: usize) -> ChannelTable<C> {
        ChannelTable {
            nexuses: HashMap::new(),
            per_nexus: per_nexus.max(1),
        }
    }

    /// What a login of `key` with `action` does, or why it is rejected. The table changes
    /// only for a replacement (the old channels leave it).
    pub fn admit(
        &mut self,
        key: ItNexusKey,
        action: MultiChannelAction,
    ) -> Result<Admission<C>, LoginRejectReason> {
        let Some((nexus, channels)) = self.nexuses.get(&key) else {
            return Ok(Admission::New);
        };
        match action {
            MultiChannelAction::MultiChannel if channels.len() >= self.per_nexus => {
                Err(LoginRejectReason::ChannelLimitReached)
            }
            MultiChannelAction::MultiChannel => Ok(Admission::Join(*nexus)),
            MultiChannelAction::SingleChannel => {
                let (nexus, channels) = self.nexuses.remove(&key).expect("found above");
                Ok(Admission::Replace { nexus, channels })
            }
        }
    }

    /// Adds an admitted channel of `nexus`.
    pub fn attach(&mut self, key: ItNexusKey, nexus: NexusId, channel: C) {
        let e = self
            .nexuses
            .entry(key)
            .or_insert_with(|| (nexus, Vec::new()));
        e.1.push(channel);
    }

    /// A channel has ended.
    pub fn leave(&mut self, key: ItNexusKey, channel: &C) -> Left {
        let Some((nexus, channels)) = self.nexuses.get_mut(&key) else {
            return Left::Unknown;
        };
        let Some(i) = channels.iter().position(|c| c == channel) else {
            return Left::Unknown;
        };
        channels.swap_remove(i);
        if channels.is_empty() {
            let nexus = *nexus;
            self.nexuses.remove(&key);
            return Left::Ended(nexus);
        }
        Left::Stays
    }

    /// The channels of `key`.
    pub fn channels(&self, key: &ItNexusKey) -> &[C] {
        self.nexuses.get(key).map_or(&[], |(_, c)| c.as_slice())
    }

    /// I_T nexuses with a channel.
    pub fn len(&self) -> usize {
        self.nexuses.len()
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.nexuses.is_empty()
    }
}

/// A login refused: the SRP_LOGIN_REJ to send, and why, for the port's log.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Refusal {
    /// The rejection.
    pub reject: SrpLoginRej,
    /// Why, in words.
    pub why: &'static str,
}

/// What a target port decides of a login beyond SRP's terms. `C` names a channel.
pub trait LoginPolicy<C> {
    /// What an accepted channel serves (a daemon: its target, and the connection slot it
    /// holds).
    type Target;

    /// The target that `req`'s TARGET PORT IDENTIFIER names, if `req`'s initiator port may
    /// log in to it now; else the reason to refuse (UNABLE TO ESTABLISH CHANNEL for an
    /// unknown target or a port not let in, INSUFFICIENT RESOURCES when full) and why.
    fn target(
        &mut self,
        req: &SrpLoginReq,
    ) -> Result<Self::Target, (LoginRejectReason, &'static str)>;
    /// Opens the SCSI core's I_T nexus for the first channel of `req`'s nexus.
    fn open_nexus(&mut self, target: &Self::Target, req: &SrpLoginReq) -> NexusId;
    /// Closes an I_T nexus that has no channel left (replaced, or its first channel never
    /// came up).
    fn close_nexus(&mut self, target: &Self::Target, nexus: NexusId);
    /// Logs out a channel that a SINGLE CHANNEL login replaces (SRP_T_LOGOUT, MULTI-CHANNEL
    /// ACTION); its nexus is closed after its channels.
    fn terminate(&mut self, channel: C);
}

/// A login the port accepted, to connect: answer with [`Accepted::response`], then tell the
/// port whether the channel came up ([`Logins::connected`], [`Logins::failed`]).
#[derive(Debug)]
#[must_use = "an accepted login holds its nexus until connected or failed"]
pub struct Accepted<T> {
    /// What the channel serves.
    pub target: T,
    /// Its I_T nexus as SRP names it.
    pub key: ItNexusKey,
    /// The core's nexus.
    pub nexus: NexusId,
    /// The channel's terms.
    pub params: ChannelParams,
    /// The SRP_LOGIN_RSP.
    pub response: SrpLoginRsp,
}

/// A target port's logins: its terms and its channels by I_T nexus.
#[derive(Debug)]
pub struct Logins<C> {
    settings: PortSettings,
    table: ChannelTable<C>,
}

impl<C: Clone + PartialEq> Logins<C> {
    /// A port offering `settings`, with no channel yet.
    pub fn new(settings: PortSettings) -> Logins<C> {
        let table = ChannelTable::new(settings.channels_per_nexus);
        Logins { settings, table }
    }

    /// What the port offers.
    pub fn settings(&self) -> &PortSettings {
        &self.settings
    }

    /// Decides `req`: the policy's target and its access, the port's terms, then the
    /// channels of its I_T nexus (a MULTI CHANNEL login joins them, a SINGLE CHANNEL one
    /// replaces them, logging them out).
    pub fn login<P: LoginPolicy<C>>(
        &mut self,
        req: &SrpLoginReq,
        policy: &mut P,
    ) -> Result<Accepted<P::Target>, Refusal> {
        let refuse = |reason, why| Refusal {
            reject: self.settings.reject(req, reason),
            why,
        };
        let target = policy
            .target(req)
            .map_err(|(reason, why)| refuse(reason, why))?;
        let params = self.settings.terms(req).map_err(|reject| Refusal {
            reject,
            why: "its terms are not the port's",
        })?;
        let key = ItNexusKey::of(req);
        let admission = self
            .table
            .admit(key, req.multi_channel)
            .map_err(|reason| refuse(reason, "the I_T nexus has all its channels"))?;
        let result = admission.result();
        let nexus = match admission {
            Admission::Join(nexus) => nexus,
            Admission::New => policy.open_nexus(&target, req),
            Admission::Replace { nexus, channels } => {
                for channel in channels {
                    policy.terminate(channel);
                }
                policy.close_nexus(&target, nexus);
                policy.open_nexus(&target, req)
            }
        };
        let response = self.settings.response(req, &params, result);
        Ok(Accepted {
            target,
            key,
            nexus,
            params,
            response,
        })
    }

    /// The accepted login's channel is connected: it joins its nexus as `channel`.
    pub fn connected<T>(&mut self, accepted: &Accepted<T>, channel: C) {
        self.table.attach(accepted.key, accepted.nexus, channel);
    }

    /// The accepted login's channel did not come up (no receive buffers, the connection
    /// failed): a nexus it was to be the first channel of is closed.
    pub fn failed<P: LoginPolicy<C>>(&mut self, accepted: Accepted<P::Target>, policy: &mut P) {
        if self.table.channels(&accepted.key).is_empty() {
            policy.close_nexus(&accepted.target, accepted.nexus);
        }
    }

    /// A channel has ended.
    pub fn leave(&mut self, key: ItNexusKey, channel: &C) -> Left {
        self.table.leave(key, channel)
    }

    /// The channels of `key`.
    pub fn channels(&self, key: &ItNexusKey) -> &[C] {
        self.table.channels(key)
    }

    /// I_T nexuses with a channel.
    pub fn nexuses(&self) -> usize {
        self.table.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req() -> SrpLoginReq {
        SrpLoginReq {
            tag: 1,
            req_it_iu_len: 580,
            req_buf_fmt: BufferFormats::BOTH,
            target_port_id: [7; 16],
            initiator_port_id: [1; 16],
            ..SrpLoginReq::default()
        }
    }

    #[test]
    fn each_rejection_names_its_reason() {
        let s = PortSettings {
            target_port_id: [7; 16],
            formats: BufferFormats::DIRECT,
            ..PortSettings::default()
        };
        let reason = |r: SrpLoginReq| s.evaluate(&r).map(|_| ()).map_err(|e| e.reason);
        assert_eq!(
            reason(req()),
            Err(LoginRejectReason::UnsupportedDescriptorFormat)
        );
        let direct = SrpLoginReq {
            req_buf_fmt: BufferFormats::DIRECT,
            ..req()
        };
        assert_eq!(reason(direct), Ok(()));
        assert_eq!(
            reason(SrpLoginReq {
                req_it_iu_len: 8277,
                ..direct
            }),
            Err(LoginRejectReason::ItIuLengthTooLarge)
        );
        assert_eq!(
            reason(SrpLoginReq {
                req_it_iu_len: 64,
                ..direct
            }),
            Err(LoginRejectReason::UnableToEstablishChannel)
        );
        assert_eq!(
            reason(SrpLoginReq {
                target_port_id: [8; 16],
                ..direct
            }),
            Err(LoginRejectReason::UnableToEstablishChannel)
        );
        let params = s.evaluate(&direct).expect("accepted");
        let rsp = s.response(&direct, &params, MultiChannelResult::NoExistingChannels);
        assert_eq!(rsp.req_lim_delta, 128);
        assert_eq!(rsp.max_it_iu_len, 580);
        assert_eq!(rsp.max_ti_iu_len, MAX_TI_IU_LEN);
        assert!(!rsp.immediate_data, "not asked for");
    }

    /// Linux's ib_srp by default: 8 KiB of immediate data at offset 68, an IU of 8260 bytes.
    #[test]
    fn linux_default_login_gets_immediate_data() {
        let s = PortSettings {
            target_port_id: [7; 16],
            ..PortSettings::default()
        };
        let linux = SrpLoginReq {
            req_it_iu_len: 8260,
            immediate_data: true,
            imm_data_offset: 68,
            ..req()
        };
        let params = s.evaluate(&linux).expect("accepted");
        assert_eq!(params.imm_data_offset, Some(68));
        assert_eq!(params.max_it_iu_len, 8260);
        let rsp = s.response(&linux, &params, MultiChannelResult::NoExistingChannels);
        assert!(rsp.immediate_data);
        // ib_srpt's largest default request is accepted too.
        let largest = SrpLoginReq {
            req_it_iu_len: 8276,
            ..linux
        };
        assert!(s.evaluate(&largest).is_ok());
        // An offset inside the SRP_CMD, or past the IU, is not granted; the login stands.
        for offset in [0, 51, 8260] {
            let odd = SrpLoginReq {
                imm_data_offset: offset,
                ..linux
            };
            assert_eq!(s.evaluate(&odd).expect("accepted").imm_data_offset, None);
        }
        // A port that offers none grants none.
        let off = PortSettings {
            immediate_data: false,
            ..s.clone()
        };
        let params = off.evaluate(&linux).expect("accepted");
        assert!(
            !off.response(&linux, &params, MultiChannelResult::NoExistingChannels)
                .immediate_data
        );
    }

    #[test]
    fn multi_channel_joins_single_channel_replaces() {
        let mut t: ChannelTable<u32> = ChannelTable::new(2);
        let key = ItNexusKey::of(&req());
        let nexus =
            scsi_core::Device::new("t", vec![]).open_nexus(scsi_core::TransportId::srp([1; 16]), 1);
        assert_eq!(
            t.admit(key, MultiChannelAction::MultiChannel),
            Ok(Admission::New)
        );
        t.attach(key, nexus, 1);
        assert_eq!(
            t.admit(key, MultiChannelAction::MultiChannel),
            Ok(Admission::Join(nexus))
        );
        t.attach(key, nexus, 2);
        assert_eq!(
            t.admit(key, MultiChannelAction::MultiChannel),
            Err(LoginRejectReason::ChannelLimitReached)
        );
        assert_eq!(t.leave(key, &2), Left::Stays);
        assert_eq!(
            t.admit(key, MultiChannelAction::SingleChannel),
            Ok(Admission::Replace {
                nexus,
                channels: vec![1]
            })
        );
        assert_eq!(t.leave(key, &1), Left::Unknown);
        t.attach(key, nexus, 3);
        assert_eq!(t.leave(key, &3), Left::Ended(nexus));
        assert!(t.is_empty());
    }

    /// A policy that records what the machine asked of it, its nexuses in a device.
    struct Recorder {
        device: scsi_core::Device,
        opened: Vec<NexusId>,
        closed: Vec<NexusId>,
        terminated: Vec<u32>,
        refuse: Option<(LoginRejectReason, &'static str)>,
    }

    impl LoginPolicy<u32> for Recorder {
        type Target = ();

        fn target(&mut self, _: &SrpLoginReq) -> Result<(), (LoginRejectReason, &'static str)> {
            self.refuse.map_or(Ok(()), Err)
        }

        fn open_nexus(&mut self, _: &(), _: &SrpLoginReq) -> NexusId {
            let initiator = scsi_core::TransportId::srp([self.opened.len() as u8; 16]);
            let nexus = self.device.open_nexus(initiator, 1);
            self.opened.push(nexus);
            nexus
        }

        fn close_nexus(&mut self, _: &(), nexus: NexusId) {
            self.closed.push(nexus);
        }

        fn terminate(&mut self, channel: u32) {
            self.terminated.push(channel);
        }
    }

    #[test]
    fn logins_join_replace_and_let_go_of_a_nexus_whose_first_channel_failed() {
        let mut logins = Logins::new(PortSettings::default());
        let port = scsi_core::TargetPort::srp("iqn.2026-11.io.example:t", [7; 16], 1);
        let mut policy = Recorder {
            device: scsi_core::Device::new("iqn.2026-11.io.example:t", vec![port]),
            opened: Vec::new(),
            closed: Vec::new(),
            terminated: Vec::new(),
            refuse: None,
        };
        let multi = SrpLoginReq {
            multi_channel: MultiChannelAction::MultiChannel,
            ..req()
        };
        // The first channel opens the nexus; a MULTI CHANNEL login joins it.
        let first = logins.login(&multi, &mut policy).expect("accepted");
        assert_eq!(
            first.response.multi_channel,
            MultiChannelResult::NoExistingChannels
        );
        logins.connected(&first, 10);
        let second = logins.login(&multi, &mut policy).expect("accepted");
        assert_eq!(
            second.response.multi_channel,
            MultiChannelResult::Maintained
        );
        assert_eq!(second.nexus, first.nexus);
        // The second never comes up: the nexus stays for the first.
        logins.failed(second, &mut policy);
        assert!(policy.closed.is_empty());
        // SINGLE CHANNEL replaces them: the first logged out, its nexus closed, a new one.
        let single = logins.login(&req(), &mut policy).expect("accepted");
        assert_eq!(
            single.response.multi_channel,
            MultiChannelResult::Terminated
        );
        assert_eq!(policy.terminated, [10]);
        assert_eq!(policy.closed, [first.nexus]);
        assert_ne!(single.nexus, first.nexus);
        // It fails too: the nexus it opened goes, as nothing else holds it.
        let nexus = single.nexus;
        logins.failed(single, &mut policy);
        assert_eq!(policy.closed, [first.nexus, nexus]);
        assert_eq!(logins.nexuses(), 0);
        // The policy refuses, and the terms are checked after: both with the request's tag.
        policy.refuse = Some((LoginRejectReason::InsufficientResources, "full"));
        let r = logins.login(&req(), &mut policy).expect_err("refused");
        assert_eq!(
            (r.reject.reason, r.reject.tag, r.why),
            (LoginRejectReason::InsufficientResources, 1, "full")
        );
        policy.refuse = None;
        let big = SrpLoginReq {
            req_it_iu_len: 1 << 20,
            ..req()
        };
        let r = logins.login(&big, &mut policy).expect_err("refused");
        assert_eq!(r.reject.reason, LoginRejectReason::ItIuLengthTooLarge);
    }
}
