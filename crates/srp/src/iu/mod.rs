//! SRP information units (T10 SRP-2 section 6), decoded with nom and encoded by hand, one file
//! per IU family as the standard groups them.
//!
//! Every IU starts with its type in byte 0 and, except SRP_LOGIN_REQ's reserved bytes, carries
//! the initiator's or target's 8-byte TAG at bytes 8..16, which an answer echoes. Layouts and
//! sizes are those of SRP r16a and SRP-2, as Linux's `ib_srp` and `ib_srpt` interoperate on them
//! (the fixed parts: SRP_LOGIN_REQ 64 bytes, SRP_LOGIN_RSP 52, SRP_LOGIN_REJ 32, SRP_CMD 48,
//! SRP_TSK_MGMT 48, SRP_RSP 36, SRP_AER_REQ 36, the others 16).
//!
//! Decoding borrows from the received bytes (an SRP_CMD's CDB and descriptor list are slices of
//! the receive buffer), so taking a command in allocates nothing.

mod aer;
mod cmd;
mod cred;
mod descriptor;
mod login;
mod logout;
mod rsp;
mod tsk_mgmt;

pub use aer::{SrpAerReq, SrpAerRsp};
pub use cmd::{DataBufferDescriptor, SrpCmd, TaskAttribute, DATA_IN_FORMAT, DATA_OUT_FORMAT};
pub use cred::{SrpCredReq, SrpCredRsp};
pub use descriptor::{DescriptorFormat, Descriptors, MemoryDescriptor, DESCRIPTOR_LEN};
pub use login::{
    BufferFormats, LoginRejectReason, MultiChannelAction, MultiChannelResult, SrpLoginRej,
    SrpLoginReq, SrpLoginRsp, RDMA_CM_LOGIN_LEN, RDMA_CM_LOGIN_MIN,
};
pub use logout::{SrpILogout, SrpTLogout, TargetLogoutReason};
pub use rsp::{ResponseCode, SrpRsp, SrpRspFlags};
pub use tsk_mgmt::{SrpTskMgmt, TaskManagementFunction};

use nom::number::complete::{be_u64, be_u8};
use nom::Parser;

/// The IU TYPE field (byte 0 of every IU).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum IuType {
    /// SRP_LOGIN_REQ (initiator to target, carried by the connection manager).
    LoginReq = 0x00,
    /// SRP_TSK_MGMT.
    TskMgmt = 0x01,
    /// SRP_CMD.
    Cmd = 0x02,
    /// SRP_I_LOGOUT.
    ILogout = 0x03,
    /// SRP_LOGIN_RSP.
    LoginRsp = 0xc0,
    /// SRP_RSP.
    Rsp = 0xc1,
    /// SRP_LOGIN_REJ.
    LoginRej = 0xc2,
    /// SRP_T_LOGOUT.
    TLogout = 0x80,
    /// SRP_CRED_REQ (target to initiator).
    CredReq = 0x81,
    /// SRP_AER_REQ (target to initiator).
    AerReq = 0x82,
    /// SRP_CRED_RSP (initiator to target).
    CredRsp = 0x41,
    /// SRP_AER_RSP (initiator to target).
    AerRsp = 0x42,
}

impl IuType {
    /// The type named by byte 0, `None` for a reserved or vendor-specific code.
    pub fn from_u8(b: u8) -> Option<IuType> {
        Some(match b {
            0x00 => IuType::LoginReq,
            0x01 => IuType::TskMgmt,
            0x02 => IuType::Cmd,
            0x03 => IuType::ILogout,
            0xc0 => IuType::LoginRsp,
            0xc1 => IuType::Rsp,
            0xc2 => IuType::LoginRej,
            0x80 => IuType::TLogout,
            0x81 => IuType::CredReq,
            0x82 => IuType::AerReq,
            0x41 => IuType::CredRsp,
            0x42 => IuType::AerRsp,
            _ => return None,
        })
    }

    /// The fixed part's length: the least an IU of this type can be.
    pub fn fixed_len(self) -> usize {
        match self {
            IuType::LoginReq => 64,
            IuType::LoginRsp => 52,
            IuType::LoginRej => 32,
            IuType::Cmd | IuType::TskMgmt => 48,
            IuType::Rsp | IuType::AerReq => 36,
            IuType::ILogout
            | IuType::TLogout
            | IuType::CredReq
            | IuType::CredRsp
            | IuType::AerRsp => 16,
        }
    }

    /// Whether an initiator sends it over an RDMA channel (what a target's channel receives).
    pub fn from_initiator(self) -> bool {
        matches!(
            self,
            IuType::TskMgmt | IuType::Cmd | IuType::ILogout | IuType::CredRsp | IuType::AerRsp
        )
    }
}

/// Why bytes are not a valid IU. What the receiver does about it depends on how far it got:
/// with a tag ([`IuError::tag`]) a target answers the request; without one it logs the channel
/// out (SRP_T_LOGOUT).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum IuError {
    /// Empty input: no IU TYPE.
    #[error("an empty information unit")]
    Empty,
    /// Byte 0 names no IU.
    #[error("IU type {0:#04x} is reserved")]
    UnknownType(u8),
    /// Shorter than its type requires.
    #[error("{iu:?} of {len} bytes: at least {needed} needed")]
    Truncated {
        /// The IU.
        iu: IuType,
        /// Bytes received.
        len: usize,
        /// Bytes the fixed part and the lengths it gives need.
        needed: usize,
    },
    /// A field holds a value the standard forbids or this implementation does not support.
    #[error("{iu:?} tag {tag:#x}: invalid {field}: {reason}")]
    InvalidField {
        /// The IU.
        iu: IuType,
        /// Its tag, for the answer.
        tag: u64,
        /// The field, in the standard's words.
        field: &'static str,
        /// What is wrong with it.
        reason: &'static str,
    },
}

impl IuError {
    /// The error for an invalid field of the IU `iu` tagged `tag`, as a function of the field
    /// and the reason (what a decoder calls for each field it checks).
    pub(crate) fn invalid(iu: IuType, tag: u64) -> impl Fn(&'static str, &'static str) -> IuError {
        move |field, reason| IuError::InvalidField {
            iu,
            tag,
            field,
            reason,
        }
    }

    /// The IU's type and tag when they could be read, so the request can be answered.
    pub fn tag(&self) -> Option<(IuType, u64)> {
        match self {
            IuError::InvalidField { iu, tag, .. } => Some((*iu, *tag)),
            _ => None,
        }
    }
}

/// Any information unit, borrowing from the bytes it was decoded from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Iu<'a> {
    /// SRP_LOGIN_REQ.
    LoginReq(SrpLoginReq),
    /// SRP_LOGIN_RSP.
    LoginRsp(SrpLoginRsp),
    /// SRP_LOGIN_REJ.
    LoginRej(SrpLoginRej),
    /// SRP_I_LOGOUT.
    ILogout(SrpILogout),
    /// SRP_T_LOGOUT.
    TLogout(SrpTLogout),
    /// SRP_TSK_MGMT.
    TskMgmt(SrpTskMgmt),
    /// SRP_CMD.
    Cmd(SrpCmd<'a>),
    /// SRP_RSP.
    Rsp(SrpRsp<'a>),
    /// SRP_CRED_REQ.
    CredReq(SrpCredReq),
    /// SRP_CRED_RSP.
    CredRsp(SrpCredRsp),
    /// SRP_AER_REQ.
    AerReq(SrpAerReq<'a>),
    /// SRP_AER_RSP.
    AerRsp(SrpAerRsp),
}

impl<'a> Iu<'a> {
    /// Decodes one IU: `b` is the whole message as received (trailing bytes beyond what the IU
    /// describes are allowed, as a receive buffer may be larger than the IU).
    pub fn decode(b: &'a [u8]) -> Result<Iu<'a>, IuError> {
        let ty = *b.first().ok_or(IuError::Empty)?;
        let ty = IuType::from_u8(ty).ok_or(IuError::UnknownType(ty))?;
        let fixed = fixed(b, ty)?;
        Ok(match ty {
            IuType::LoginReq => Iu::LoginReq(SrpLoginReq::decode(fixed)?),
            IuType::LoginRsp => Iu::LoginRsp(SrpLoginRsp::decode(fixed)),
            IuType::LoginRej => Iu::LoginRej(SrpLoginRej::decode(fixed)),
            IuType::ILogout => Iu::ILogout(SrpILogout::decode(fixed)),
            IuType::TLogout => Iu::TLogout(SrpTLogout::decode(fixed)),
            IuType::TskMgmt => Iu::TskMgmt(SrpTskMgmt::decode(fixed)?),
            IuType::Cmd => Iu::Cmd(SrpCmd::decode(b)?),
            IuType::Rsp => Iu::Rsp(SrpRsp::decode(b)?),
            IuType::CredReq => Iu::CredReq(SrpCredReq::decode(fixed)),
            IuType::CredRsp => Iu::CredRsp(SrpCredRsp::decode(fixed)),
            IuType::AerReq => Iu::AerReq(SrpAerReq::decode(b)?),
            IuType::AerRsp => Iu::AerRsp(SrpAerRsp::decode(fixed)),
        })
    }

    /// Appends the IU's bytes to `out`.
    pub fn encode(&self, out: &mut Vec<u8>) {
        match self {
            Iu::LoginReq(x) => x.encode(out),
            Iu::LoginRsp(x) => x.encode(out),
            Iu::LoginRej(x) => x.encode(out),
            Iu::ILogout(x) => x.encode(out),
            Iu::TLogout(x) => x.encode(out),
            Iu::TskMgmt(x) => x.encode(out),
            Iu::Cmd(x) => x.encode(out),
            Iu::Rsp(x) => x.encode(out),
            Iu::CredReq(x) => x.encode(out),
            Iu::CredRsp(x) => x.encode(out),
            Iu::AerReq(x) => x.encode(out),
            Iu::AerRsp(x) => x.encode(out),
        }
    }

    /// The IU's type.
    pub fn iu_type(&self) -> IuType {
        match self {
            Iu::LoginReq(_) => IuType::LoginReq,
            Iu::LoginRsp(_) => IuType::LoginRsp,
            Iu::LoginRej(_) => IuType::LoginRej,
            Iu::ILogout(_) => IuType::ILogout,
            Iu::TLogout(_) => IuType::TLogout,
            Iu::TskMgmt(_) => IuType::TskMgmt,
            Iu::Cmd(_) => IuType::Cmd,
            Iu::Rsp(_) => IuType::Rsp,
            Iu::CredReq(_) => IuType::CredReq,
            Iu::CredRsp(_) => IuType::CredRsp,
            Iu::AerReq(_) => IuType::AerReq,
            Iu::AerRsp(_) => IuType::AerRsp,
        }
    }
}

/// The fixed part of an IU of type `ty`, or why `b` is too short for it.
pub(crate) fn fixed(b: &[u8], ty: IuType) -> Result<&[u8], IuError> {
    let needed = ty.fixed_len();
    b.get(..needed).ok_or(IuError::Truncated {
        iu: ty,
        len: b.len(),
        needed,
    })
}

/// Reads byte 0 and the TAG at bytes 8..16 of an IU at least 16 bytes long.
pub(crate) fn type_and_tag(b: &[u8]) -> (u8, u64) {
    let r: nom::IResult<&[u8], (u8, &[u8], u64)> =
        (be_u8, nom::bytes::complete::take(7usize), be_u64).parse(b);
    let (_, (ty, _, tag)) = r.expect("every fixed part is at least 16 bytes");
    (ty, tag)
}

/// Writes the 16-byte head most IUs share: type, byte 1, bytes 2..8 as given, and the tag.
pub(crate) fn head(out: &mut Vec<u8>, ty: IuType, b1: u8, b2_8: [u8; 6], tag: u64) {
    out.push(ty as u8);
    out.push(b1);
    out.extend_from_slice(&b2_8);
    out.extend_from_slice(&tag.to_be_bytes());
}

/// A nom parse over a slice already checked to be long enough cannot fail.
pub(crate) fn parsed<T>(r: nom::IResult<&[u8], T>) -> T {
    r.expect("the fixed part's length was checked").1
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_type_round_trips_through_its_code() {
        for b in 0..=255u8 {
            if let Some(t) = IuType::from_u8(b) {
                assert_eq!(t as u8, b);
            }
        }
    }

    #[test]
    fn empty_unknown_and_short_ius_are_errors() {
        assert_eq!(Iu::decode(&[]), Err(IuError::Empty));
        assert_eq!(Iu::decode(&[0x7f; 64]), Err(IuError::UnknownType(0x7f)));
        assert_eq!(
            Iu::decode(&[0x02; 47]),
            Err(IuError::Truncated {
                iu: IuType::Cmd,
                len: 47,
                needed: 48
            })
        );
    }
}
