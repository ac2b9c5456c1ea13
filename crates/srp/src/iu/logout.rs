//! SRP_I_LOGOUT and SRP_T_LOGOUT (SRP-2 sections 6.5 and 6.6): either side ends an RDMA
//! channel; the target says why.

use nom::bytes::complete::take;
use nom::number::complete::{be_u32, be_u64, be_u8};
use nom::Parser;

use super::{head, parsed, type_and_tag, IuType};

/// SRP_I_LOGOUT: the initiator ends the channel.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct SrpILogout {
    /// TAG.
    pub tag: u64,
}

impl SrpILogout {
    pub(crate) fn decode(b: &[u8]) -> SrpILogout {
        SrpILogout {
            tag: type_and_tag(b).1,
        }
    }

    /// Appends the 16 bytes.
    pub fn encode(&self, out: &mut Vec<u8>) {
        head(out, IuType::ILogout, 0, [0; 6], self.tag);
    }
}

/// REASON of an SRP_T_LOGOUT (SRP-2 table 16).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum TargetLogoutReason {
    /// No reason specified.
    NoReason,
    /// Inactive RDMA channel (reclaiming resources).
    InactiveChannel,
    /// Invalid information unit type code received by the target.
    InvalidIuType,
    /// The initiator answered a request the target never made.
    UnexpectedResponse,
    /// The channel was ended by a later login's multi-channel action.
    MultiChannelAction,
    /// Unsupported DATA-OUT BUFFER DESCRIPTOR FORMAT.
    UnsupportedDataOutFormat,
    /// Unsupported DATA-IN BUFFER DESCRIPTOR FORMAT.
    UnsupportedDataInFormat,
    /// Invalid IU length.
    InvalidIuLength,
    /// A code this implementation does not name.
    Other(u32),
}

impl TargetLogoutReason {
    /// The 32-bit code.
    pub fn code(self) -> u32 {
        match self {
            TargetLogoutReason::NoReason => 0,
            TargetLogoutReason::InactiveChannel => 1,
            TargetLogoutReason::InvalidIuType => 2,
            TargetLogoutReason::UnexpectedResponse => 3,
            TargetLogoutReason::MultiChannelAction => 4,
            TargetLogoutReason::UnsupportedDataOutFormat => 6,
            TargetLogoutReason::UnsupportedDataInFormat => 7,
            TargetLogoutReason::InvalidIuLength => 8,
            TargetLogoutReason::Other(c) => c,
        }
    }

    /// The reason with this code.
    pub fn from_code(c: u32) -> TargetLogoutReason {
        match c {
            0 => TargetLogoutReason::NoReason,
            1 => TargetLogoutReason::InactiveChannel,
            2 => TargetLogoutReason::InvalidIuType,
            3 => TargetLogoutReason::UnexpectedResponse,
            4 => TargetLogoutReason::MultiChannelAction,
            6 => TargetLogoutReason::UnsupportedDataOutFormat,
            7 => TargetLogoutReason::UnsupportedDataInFormat,
            8 => TargetLogoutReason::InvalidIuLength,
            c => TargetLogoutReason::Other(c),
        }
    }
}

/// SRP_T_LOGOUT: the target ends the channel.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SrpTLogout {
    /// SOLNT (bit 0 of byte 1).
    pub sol_not: u8,
    /// REASON.
    pub reason: TargetLogoutReason,
    /// TAG (the target's).
    pub tag: u64,
}

impl SrpTLogout {
    pub(crate) fn decode(b: &[u8]) -> SrpTLogout {
        let (_, sol_not, _, reason, tag) =
            parsed((be_u8, be_u8, take(2usize), be_u32, be_u64).parse(b));
        SrpTLogout {
            sol_not,
            reason: TargetLogoutReason::from_code(reason),
            tag,
        }
    }

    /// Appends the 16 bytes.
    pub fn encode(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(&[IuType::TLogout as u8, self.sol_not, 0, 0]);
        out.extend_from_slice(&self.reason.code().to_be_bytes());
        out.extend_from_slice(&self.tag.to_be_bytes());
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::iu::Iu;

    #[test]
    fn logouts_round_trip() {
        let mut b = Vec::new();
        SrpILogout { tag: 3 }.encode(&mut b);
        assert_eq!(b.len(), 16);
        assert_eq!(b[0], 0x03);
        assert_eq!(Iu::decode(&b), Ok(Iu::ILogout(SrpILogout { tag: 3 })));
        let t = SrpTLogout {
            sol_not: 1,
            reason: TargetLogoutReason::InvalidIuType,
            tag: 4,
        };
        let mut b = Vec::new();
        t.encode(&mut b);
        assert_eq!(&b[..8], &[0x80, 1, 0, 0, 0, 0, 0, 2]);
        assert_eq!(Iu::decode(&b), Ok(Iu::TLogout(t)));
    }
}
