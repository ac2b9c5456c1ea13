//! SRP_LOGIN_REQ, SRP_LOGIN_RSP and SRP_LOGIN_REJ (SRP-2 sections 6.2 to 6.4): an RDMA channel
//! is established by a login the connection manager carries (InfiniBand CM REQ/REP/REJ private
//! data, or rdma_cm's), before any IU flows on the channel.

use nom::bytes::complete::take;
use nom::number::complete::{be_u16, be_u32, be_u64, be_u8};
use nom::Parser;

use super::{head, parsed, IuError, IuType};

/// Data buffer descriptor formats (REQUIRED and SUPPORTED BUFFER FORMATS, SRP-2 table 7).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct BufferFormats(pub u16);

impl BufferFormats {
    /// Direct data buffer descriptors (bit 1).
    pub const DIRECT: BufferFormats = BufferFormats(1 << 1);
    /// Indirect data buffer descriptors (bit 2).
    pub const INDIRECT: BufferFormats = BufferFormats(1 << 2);
    /// Both.
    pub const BOTH: BufferFormats = BufferFormats(1 << 1 | 1 << 2);

    /// Whether every format of `other` is among these.
    pub fn contains(self, other: BufferFormats) -> bool {
        self.0 & other.0 == other.0
    }
}

/// MULTI-CHANNEL ACTION of a login request (SRP-2 table 6).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum MultiChannelAction {
    /// Terminate every existing channel of the same I_T nexus.
    #[default]
    SingleChannel,
    /// Keep them: this channel joins them.
    MultiChannel,
}

/// MULTI-CHANNEL RESULT of a login response (SRP-2 table 9).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum MultiChannelResult {
    /// There were no other channels of the I_T nexus.
    #[default]
    NoExistingChannels,
    /// The other channels were terminated.
    Terminated,
    /// The other channels go on.
    Maintained,
}

/// SRP_LOGIN_REQ.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct SrpLoginReq {
    /// TAG.
    pub tag: u64,
    /// REQUESTED MAXIMUM INITIATOR TO TARGET IU LENGTH: the largest IU the initiator will send.
    pub req_it_iu_len: u32,
    /// REQUIRED BUFFER FORMATS: the descriptor formats the initiator will use.
    pub req_buf_fmt: BufferFormats,
    /// MULTI-CHANNEL ACTION.
    pub multi_channel: MultiChannelAction,
    /// IMMEDIATE DATA REQUESTED (SRP-2).
    pub immediate_data: bool,
    /// IMMEDIATE DATA OFFSET (SRP-2): where immediate data starts in an SRP_CMD.
    pub imm_data_offset: u16,
    /// INITIATOR PORT IDENTIFIER.
    pub initiator_port_id: [u8; 16],
    /// TARGET PORT IDENTIFIER.
    pub target_port_id: [u8; 16],
}

impl SrpLoginReq {
    pub(crate) fn decode(b: &[u8]) -> Result<SrpLoginReq, IuError> {
        let (_, tag, len, _, fmt, flags, _, offset, _, ini, tgt) = parsed(
            (
                take(8usize),
                be_u64,
                be_u32,
                take(4usize),
                be_u16,
                be_u8,
                be_u8,
                be_u16,
                take(2usize),
                take(16usize),
                take(16usize),
            )
                .parse(b),
        );
        let multi_channel = match flags & 0x03 {
            0 => MultiChannelAction::SingleChannel,
            1 => MultiChannelAction::MultiChannel,
            _ => {
                return Err(IuError::InvalidField {
                    iu: IuType::LoginReq,
                    tag,
                    field: "MULTI-CHANNEL ACTION",
                    reason: "reserved",
                })
            }
        };
        Ok(SrpLoginReq {
            tag,
            req_it_iu_len: len,
            req_buf_fmt: BufferFormats(fmt),
            multi_channel,
            immediate_data: flags & 0x80 != 0,
            imm_data_offset: offset,
            initiator_port_id: ini.try_into().expect("16 bytes"),
            target_port_id: tgt.try_into().expect("16 bytes"),
        })
    }

    /// Appends the 64 bytes.
    pub fn encode(&self, out: &mut Vec<u8>) {
        head(out, IuType::LoginReq, 0, [0; 6], self.tag);
        out.extend_from_slice(&self.req_it_iu_len.to_be_bytes());
        out.extend_from_slice(&[0; 4]);
        out.extend_from_slice(&self.req_buf_fmt.0.to_be_bytes());
        let action = match self.multi_channel {
            MultiChannelAction::SingleChannel => 0,
            MultiChannelAction::MultiChannel => 1,
        };
        out.push(action | if self.immediate_data { 0x80 } else { 0 });
        out.push(0);
        out.extend_from_slice(&self.imm_data_offset.to_be_bytes());
        out.extend_from_slice(&[0; 2]);
        out.extend_from_slice(&self.initiator_port_id);
        out.extend_from_slice(&self.target_port_id);
    }
}

/// Bytes of an SRP_LOGIN_REQ in rdma_cm's private data, as Linux's initiator (ib_srp) and
/// target (ib_srpt) lay it out (`struct srp_login_req_rdma`): a connect request over InfiniBand
/// carries at most 56 bytes of private data after rdma_cm's own 36 (92 in all), so the 64-byte
/// IU is sent with its reserved bytes removed and its fields reordered.
pub const RDMA_CM_LOGIN_LEN: usize = 56;
/// The shortest such login: kernels older than SRP-2 immediate data send 48 bytes, without
/// IMMEDIATE DATA OFFSET.
pub const RDMA_CM_LOGIN_MIN: usize = 48;

impl SrpLoginReq {
    /// Decodes an SRP_LOGIN_REQ from rdma_cm's private data (`struct srp_login_req_rdma`:
    /// TAG at 0, REQUIRED BUFFER FORMATS at 8, the flags at 10, IU TYPE at 11, REQUESTED
    /// MAXIMUM INITIATOR TO TARGET IU LENGTH at 12, the port identifiers at 16 and 32, IMMEDIATE
    /// DATA OFFSET at 48 when present). The connection manager may pad the private data, so
    /// longer input is accepted and what follows is ignored.
    pub fn decode_rdma_cm(b: &[u8]) -> Result<SrpLoginReq, IuError> {
        if b.len() < RDMA_CM_LOGIN_MIN {
            return Err(IuError::Truncated {
                iu: IuType::LoginReq,
                len: b.len(),
                needed: RDMA_CM_LOGIN_MIN,
            });
        }
        let (tag, fmt, flags, opcode, len, ini, tgt) = parsed(
            (
                be_u64,
                be_u16,
                be_u8,
                be_u8,
                be_u32,
                take(16usize),
                take(16usize),
            )
                .parse(b),
        );
        if opcode != IuType::LoginReq as u8 {
            return Err(IuError::InvalidField {
                iu: IuType::LoginReq,
                tag,
                field: "IU TYPE",
                reason: "not SRP_LOGIN_REQ",
            });
        }
        let offset = match b.get(48..50) {
            Some(o) => u16::from_be_bytes([o[0], o[1]]),
            None => 0,
        };
        // The same bytes in the IU's own order, decoded by the one decoder of the IU.
        let mut iu = Vec::with_capacity(64);
        SrpLoginReq {
            tag,
            req_it_iu_len: len,
            req_buf_fmt: BufferFormats(fmt),
            imm_data_offset: offset,
            initiator_port_id: ini.try_into().expect("16 bytes"),
            target_port_id: tgt.try_into().expect("16 bytes"),
            ..SrpLoginReq::default()
        }
        .encode(&mut iu);
        iu[LOGIN_REQ_FLAGS] = flags;
        SrpLoginReq::decode(&iu)
    }

    /// Appends the 56 bytes of rdma_cm's private data for this request (see
    /// [`SrpLoginReq::decode_rdma_cm`]).
    pub fn encode_rdma_cm(&self, out: &mut Vec<u8>) {
        let mut iu = Vec::with_capacity(64);
        self.encode(&mut iu);
        out.extend_from_slice(&self.tag.to_be_bytes());
        out.extend_from_slice(&self.req_buf_fmt.0.to_be_bytes());
        out.push(iu[LOGIN_REQ_FLAGS]);
        out.push(IuType::LoginReq as u8);
        out.extend_from_slice(&self.req_it_iu_len.to_be_bytes());
        out.extend_from_slice(&self.initiator_port_id);
        out.extend_from_slice(&self.target_port_id);
        out.extend_from_slice(&self.imm_data_offset.to_be_bytes());
        out.extend_from_slice(&[0; 6]);
    }
}

/// Where an SRP_LOGIN_REQ's flags (MULTI-CHANNEL ACTION, IMMEDIATE DATA REQUESTED) lie.
const LOGIN_REQ_FLAGS: usize = 26;

/// SRP_LOGIN_RSP.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct SrpLoginRsp {
    /// REQUEST LIMIT DELTA: the initiator's first credit, the requests it may have
    /// outstanding.
    pub req_lim_delta: u32,
    /// TAG of the login request.
    pub tag: u64,
    /// MAXIMUM INITIATOR TO TARGET IU LENGTH the target accepts.
    pub max_it_iu_len: u32,
    /// MAXIMUM TARGET TO INITIATOR IU LENGTH the target will send.
    pub max_ti_iu_len: u32,
    /// SUPPORTED BUFFER FORMATS.
    pub sup_buf_fmt: BufferFormats,
    /// MULTI-CHANNEL RESULT.
    pub multi_channel: MultiChannelResult,
    /// IMMEDIATE DATA SUPPORTED (SRP-2).
    pub immediate_data: bool,
}

impl SrpLoginRsp {
    pub(crate) fn decode(b: &[u8]) -> SrpLoginRsp {
        let (_, delta, tag, it, ti, fmt, flags) =
            parsed((take(4usize), be_u32, be_u64, be_u32, be_u32, be_u16, be_u8).parse(b));
        SrpLoginRsp {
            req_lim_delta: delta,
            tag,
            max_it_iu_len: it,
            max_ti_iu_len: ti,
            sup_buf_fmt: BufferFormats(fmt),
            multi_channel: match flags & 0x03 {
                1 => MultiChannelResult::Terminated,
                2 => MultiChannelResult::Maintained,
                _ => MultiChannelResult::NoExistingChannels,
            },
            immediate_data: flags & 0x80 != 0,
        }
    }

    /// Appends the 52 bytes.
    pub fn encode(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(&[IuType::LoginRsp as u8, 0, 0, 0]);
        out.extend_from_slice(&self.req_lim_delta.to_be_bytes());
        out.extend_from_slice(&self.tag.to_be_bytes());
        out.extend_from_slice(&self.max_it_iu_len.to_be_bytes());
        out.extend_from_slice(&self.max_ti_iu_len.to_be_bytes());
        out.extend_from_slice(&self.sup_buf_fmt.0.to_be_bytes());
        let result = match self.multi_channel {
            MultiChannelResult::NoExistingChannels => 0,
            MultiChannelResult::Terminated => 1,
            MultiChannelResult::Maintained => 2,
        };
        out.push(result | if self.immediate_data { 0x80 } else { 0 });
        out.extend_from_slice(&[0; 25]);
    }
}

/// REASON of an SRP_LOGIN_REJ (SRP-2 table 11).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum LoginRejectReason {
    /// Unable to establish RDMA channel, no reason specified.
    UnableToEstablishChannel,
    /// Insufficient RDMA channel resources.
    InsufficientResources,
    /// Requested maximum initiator to target IU length value too large.
    ItIuLengthTooLarge,
    /// Unable to associate RDMA channel with specified I_T nexus.
    UnableToAssociateChannel,
    /// One or more requested data buffer descriptor formats are not supported.
    UnsupportedDescriptorFormat,
    /// SRP target port does not support multiple RDMA channels per I_T nexus.
    MultiChannelUnsupported,
    /// RDMA channel limit reached for this initiator.
    ChannelLimitReached,
    /// A code this implementation does not name.
    Other(u32),
}

impl LoginRejectReason {
    /// The 32-bit code.
    pub fn code(self) -> u32 {
        match self {
            LoginRejectReason::UnableToEstablishChannel => 0x0001_0000,
            LoginRejectReason::InsufficientResources => 0x0001_0001,
            LoginRejectReason::ItIuLengthTooLarge => 0x0001_0002,
            LoginRejectReason::UnableToAssociateChannel => 0x0001_0003,
            LoginRejectReason::UnsupportedDescriptorFormat => 0x0001_0004,
            LoginRejectReason::MultiChannelUnsupported => 0x0001_0005,
            LoginRejectReason::ChannelLimitReached => 0x0001_0006,
            LoginRejectReason::Other(c) => c,
        }
    }

    /// The reason with this code.
    pub fn from_code(c: u32) -> LoginRejectReason {
        match c {
            0x0001_0000 => LoginRejectReason::UnableToEstablishChannel,
            0x0001_0001 => LoginRejectReason::InsufficientResources,
            0x0001_0002 => LoginRejectReason::ItIuLengthTooLarge,
            0x0001_0003 => LoginRejectReason::UnableToAssociateChannel,
            0x0001_0004 => LoginRejectReason::UnsupportedDescriptorFormat,
            0x0001_0005 => LoginRejectReason::MultiChannelUnsupported,
            0x0001_0006 => LoginRejectReason::ChannelLimitReached,
            c => LoginRejectReason::Other(c),
        }
    }
}

/// SRP_LOGIN_REJ.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SrpLoginRej {
    /// REASON.
    pub reason: LoginRejectReason,
    /// TAG of the login request.
    pub tag: u64,
    /// SUPPORTED BUFFER FORMATS (so the initiator can try again).
    pub sup_buf_fmt: BufferFormats,
}

impl SrpLoginRej {
    pub(crate) fn decode(b: &[u8]) -> SrpLoginRej {
        let (_, reason, tag, _, fmt) =
            parsed((take(4usize), be_u32, be_u64, take(8usize), be_u16).parse(b));
        SrpLoginRej {
            reason: LoginRejectReason::from_code(reason),
            tag,
            sup_buf_fmt: BufferFormats(fmt),
        }
    }

    /// Appends the 32 bytes.
    pub fn encode(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(&[IuType::LoginRej as u8, 0, 0, 0]);
        out.extend_from_slice(&self.reason.code().to_be_bytes());
        out.extend_from_slice(&self.tag.to_be_bytes());
        out.extend_from_slice(&[0; 8]);
        out.extend_from_slice(&self.sup_buf_fmt.0.to_be_bytes());
        out.extend_from_slice(&[0; 6]);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::iu::Iu;

    /// The fields both login layouts' byte vectors hold.
    fn assert_is_linuxs_example(r: &SrpLoginReq) {
        assert_eq!(r.tag, 7);
        assert_eq!(r.req_it_iu_len, 580);
        assert_eq!(r.req_buf_fmt, BufferFormats::BOTH);
        assert_eq!(r.multi_channel, MultiChannelAction::MultiChannel);
        assert!(r.immediate_data);
        assert_eq!(r.imm_data_offset, 68);
        assert_eq!(r.initiator_port_id, [0xaa; 16]);
        assert_eq!(r.target_port_id, [0xbb; 16]);
    }

    #[test]
    fn a_login_request_as_linux_sends_it() {
        let mut b = vec![0u8; 64];
        b[8..16].copy_from_slice(&7u64.to_be_bytes());
        b[16..20].copy_from_slice(&580u32.to_be_bytes());
        b[24..26].copy_from_slice(&0x0006u16.to_be_bytes());
        b[26] = 0x81;
        b[28..30].copy_from_slice(&68u16.to_be_bytes());
        b[32..48].copy_from_slice(&[0xaa; 16]);
        b[48..64].copy_from_slice(&[0xbb; 16]);
        let Ok(Iu::LoginReq(r)) = Iu::decode(&b) else {
            panic!("a login request");
        };
        assert_is_linuxs_example(&r);
        let mut again = Vec::new();
        r.encode(&mut again);
        assert_eq!(again, b);
        b[26] = 2;
        assert!(Iu::decode(&b).is_err());
    }

    #[test]
    fn a_login_request_in_rdma_cm_private_data_as_linux_lays_it_out() {
        let mut b = vec![0u8; RDMA_CM_LOGIN_LEN];
        b[0..8].copy_from_slice(&7u64.to_be_bytes());
        b[8..10].copy_from_slice(&0x0006u16.to_be_bytes());
        b[10] = 0x81;
        b[11] = 0x00;
        b[12..16].copy_from_slice(&580u32.to_be_bytes());
        b[16..32].copy_from_slice(&[0xaa; 16]);
        b[32..48].copy_from_slice(&[0xbb; 16]);
        b[48..50].copy_from_slice(&68u16.to_be_bytes());
        let r = SrpLoginReq::decode_rdma_cm(&b).unwrap();
        assert_is_linuxs_example(&r);
        let mut again = Vec::new();
        r.encode_rdma_cm(&mut again);
        assert_eq!(again, b);
        // Padding after the 56 bytes is ignored; an older kernel's 48 bytes have no offset.
        let mut padded = b.clone();
        padded.extend_from_slice(&[0xff; 8]);
        assert_eq!(SrpLoginReq::decode_rdma_cm(&padded), Ok(r));
        let old = SrpLoginReq::decode_rdma_cm(&b[..RDMA_CM_LOGIN_MIN]).unwrap();
        assert_eq!(old.imm_data_offset, 0);
        assert_eq!(old.initiator_port_id, [0xaa; 16]);
        // Refused: short, another IU type, a reserved MULTI-CHANNEL ACTION.
        assert!(matches!(
            SrpLoginReq::decode_rdma_cm(&b[..47]),
            Err(IuError::Truncated { needed: 48, .. })
        ));
        let mut other = b.clone();
        other[11] = IuType::Cmd as u8;
        assert!(matches!(
            SrpLoginReq::decode_rdma_cm(&other),
            Err(IuError::InvalidField {
                field: "IU TYPE",
                tag: 7,
                ..
            })
        ));
        let mut reserved = b.clone();
        reserved[10] = 0x02;
        assert!(matches!(
            SrpLoginReq::decode_rdma_cm(&reserved),
            Err(IuError::InvalidField {
                field: "MULTI-CHANNEL ACTION",
                ..
            })
        ));
    }

    #[test]
    fn response_and_reject_have_their_sizes_and_fields() {
        let rsp = SrpLoginRsp {
            req_lim_delta: 128,
            tag: 7,
            max_it_iu_len: 8192,
            max_ti_iu_len: 292,
            sup_buf_fmt: BufferFormats::BOTH,
            multi_channel: MultiChannelResult::Maintained,
            immediate_data: false,
        };
        let mut b = Vec::new();
        rsp.encode(&mut b);
        assert_eq!(b.len(), 52);
        assert_eq!(&b[4..8], &128u32.to_be_bytes());
        assert_eq!(b[26], 2);
        assert_eq!(Iu::decode(&b), Ok(Iu::LoginRsp(rsp)));
        let rej = SrpLoginRej {
            reason: LoginRejectReason::ItIuLengthTooLarge,
            tag: 7,
            sup_buf_fmt: BufferFormats::BOTH,
        };
        let mut b = Vec::new();
        rej.encode(&mut b);
        assert_eq!(b.len(), 32);
        assert_eq!(&b[4..8], &[0, 1, 0, 2]);
        assert_eq!(Iu::decode(&b), Ok(Iu::LoginRej(rej)));
    }
}
