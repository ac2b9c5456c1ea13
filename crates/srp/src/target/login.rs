//! The login of an RDMA channel (SRP-2 section 5.5): whether a target port accepts an
//! SRP_LOGIN_REQ and on what terms, and the channels of each I_T nexus, which a new login
//! joins (MULTI CHANNEL) or replaces (SINGLE CHANNEL).

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
        let reject = |reason| SrpLoginRej {
            reason,
            tag: req.tag,
            sup_buf_fmt: self.formats,
        };
        if req.target_port_id != self.target_port_id {
            return Err(reject(LoginRejectReason::UnableToEstablishChannel));
        }
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
}
