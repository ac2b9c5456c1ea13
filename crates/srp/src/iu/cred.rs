//! SRP_CRED_REQ and SRP_CRED_RSP (SRP-2 sections 6.10 and 6.11): the target gives credit
//! without answering a request.

use nom::bytes::complete::take;
use nom::number::complete::{be_u32, be_u64, be_u8};
use nom::Parser;

use super::{head, parsed, type_and_tag, IuType};

/// SRP_CRED_REQ.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct SrpCredReq {
    /// Byte 1: SOLNT.
    pub sol_not: u8,
    /// REQUEST LIMIT DELTA.
    pub req_lim_delta: u32,
    /// TAG (the target's).
    pub tag: u64,
}

impl SrpCredReq {
    pub(crate) fn decode(b: &[u8]) -> SrpCredReq {
        let (_, sol_not, _, delta, tag) =
            parsed((be_u8, be_u8, take(2usize), be_u32, be_u64).parse(b));
        SrpCredReq {
            sol_not,
            req_lim_delta: delta,
            tag,
        }
    }

    /// Appends the 16 bytes.
    pub fn encode(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(&[IuType::CredReq as u8, self.sol_not, 0, 0]);
        out.extend_from_slice(&self.req_lim_delta.to_be_bytes());
        out.extend_from_slice(&self.tag.to_be_bytes());
    }
}

/// SRP_CRED_RSP: the initiator's acknowledgement of an SRP_CRED_REQ.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct SrpCredRsp {
    /// TAG of the SRP_CRED_REQ.
    pub tag: u64,
}

impl SrpCredRsp {
    pub(crate) fn decode(b: &[u8]) -> SrpCredRsp {
        SrpCredRsp {
            tag: type_and_tag(b).1,
        }
    }

    /// Appends the 16 bytes.
    pub fn encode(&self, out: &mut Vec<u8>) {
        head(out, IuType::CredRsp, 0, [0; 6], self.tag);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::iu::Iu;

    #[test]
    fn credit_request_and_response_round_trip() {
        let r = SrpCredReq {
            sol_not: 1,
            req_lim_delta: 16,
            tag: 9,
        };
        let mut b = Vec::new();
        r.encode(&mut b);
        assert_eq!(b.len(), 16);
        assert_eq!(Iu::decode(&b), Ok(Iu::CredReq(r)));
        let mut b = Vec::new();
        SrpCredRsp { tag: 9 }.encode(&mut b);
        assert_eq!(b[0], 0x41);
        assert_eq!(Iu::decode(&b), Ok(Iu::CredRsp(SrpCredRsp { tag: 9 })));
    }
}
