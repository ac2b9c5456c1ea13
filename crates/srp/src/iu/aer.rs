//! SRP_AER_REQ and SRP_AER_RSP (SRP-2 sections 6.12 and 6.13): the target reports an
//! asynchronous event (sense data for a logical unit) to the initiator.

use nom::bytes::complete::take;
use nom::number::complete::{be_u32, be_u64, be_u8};
use nom::Parser;

use super::{head, parsed, type_and_tag, IuError, IuType};

const FIXED: usize = 36;

/// SRP_AER_REQ.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct SrpAerReq<'a> {
    /// Byte 1: SOLNT.
    pub sol_not: u8,
    /// REQUEST LIMIT DELTA.
    pub req_lim_delta: u32,
    /// TAG (the target's).
    pub tag: u64,
    /// LOGICAL UNIT NUMBER.
    pub lun: u64,
    /// SENSE DATA.
    pub sense: &'a [u8],
}

impl<'a> SrpAerReq<'a> {
    pub(crate) fn decode(b: &'a [u8]) -> Result<SrpAerReq<'a>, IuError> {
        let fixed = super::fixed(b, IuType::AerReq)?;
        let (_, sol_not, _, delta, tag, _, lun, sense_len) = parsed(
            (
                be_u8,
                be_u8,
                take(2usize),
                be_u32,
                be_u64,
                take(4usize),
                be_u64,
                be_u32,
            )
                .parse(fixed),
        );
        let end = FIXED.saturating_add(sense_len as usize);
        let sense = b.get(FIXED..end).ok_or(IuError::Truncated {
            iu: IuType::AerReq,
            len: b.len(),
            needed: end,
        })?;
        Ok(SrpAerReq {
            sol_not,
            req_lim_delta: delta,
            tag,
            lun,
            sense,
        })
    }

    /// Appends the IU.
    pub fn encode(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(&[IuType::AerReq as u8, self.sol_not, 0, 0]);
        out.extend_from_slice(&self.req_lim_delta.to_be_bytes());
        out.extend_from_slice(&self.tag.to_be_bytes());
        out.extend_from_slice(&[0; 4]);
        out.extend_from_slice(&self.lun.to_be_bytes());
        out.extend_from_slice(&(self.sense.len() as u32).to_be_bytes());
        out.extend_from_slice(&[0; 4]);
        out.extend_from_slice(self.sense);
    }
}

/// SRP_AER_RSP: the initiator's acknowledgement of an SRP_AER_REQ.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct SrpAerRsp {
    /// TAG of the SRP_AER_REQ.
    pub tag: u64,
}

impl SrpAerRsp {
    pub(crate) fn decode(b: &[u8]) -> SrpAerRsp {
        SrpAerRsp {
            tag: type_and_tag(b).1,
        }
    }

    /// Appends the 16 bytes.
    pub fn encode(&self, out: &mut Vec<u8>) {
        head(out, IuType::AerRsp, 0, [0; 6], self.tag);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::iu::Iu;

    #[test]
    fn an_event_carries_its_sense() {
        let sense = [
            0x70, 0, 6, 0, 0, 0, 0, 10, 0, 0, 0, 0, 0x3f, 0x0e, 0, 0, 0, 0,
        ];
        let r = SrpAerReq {
            sol_not: 0,
            req_lim_delta: 0,
            tag: 5,
            lun: 0,
            sense: &sense,
        };
        let mut b = Vec::new();
        r.encode(&mut b);
        assert_eq!(b.len(), 36 + 18);
        assert_eq!(Iu::decode(&b), Ok(Iu::AerReq(r)));
        assert!(Iu::decode(&b[..40]).is_err());
        let mut b = Vec::new();
        SrpAerRsp { tag: 5 }.encode(&mut b);
        assert_eq!(Iu::decode(&b), Ok(Iu::AerRsp(SrpAerRsp { tag: 5 })));
    }
}
