//! SRP_RSP (SRP-2 section 6.9): the end of a command or task management function: status,
//! residuals, response data and sense data, and the credit the target gives back.

use nom::bytes::complete::take;
use nom::number::complete::{be_u32, be_u64, be_u8};
use nom::Parser;
use scsi_core::Residual;

use super::{parsed, IuError, IuType};

const FIXED: usize = 36;

/// Byte 18 of an SRP_RSP (SRP-2 table 22).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct SrpRspFlags(pub u8);

impl SrpRspFlags {
    /// RSPVALID: response data follows.
    pub const RSPVALID: u8 = 1 << 0;
    /// SNSVALID: sense data follows.
    pub const SNSVALID: u8 = 1 << 1;
    /// DOOVER: data-out overflow.
    pub const DOOVER: u8 = 1 << 2;
    /// DOUNDER: data-out underflow.
    pub const DOUNDER: u8 = 1 << 3;
    /// DIOVER: data-in overflow.
    pub const DIOVER: u8 = 1 << 4;
    /// DIUNDER: data-in underflow.
    pub const DIUNDER: u8 = 1 << 5;
}

/// RSP_CODE of a task management function's response data (SRP-2 table 24).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ResponseCode {
    /// NO FAILURE or TASK MANAGEMENT FUNCTION COMPLETE.
    Complete,
    /// REQUEST FIELDS INVALID.
    RequestFieldsInvalid,
    /// TASK MANAGEMENT FUNCTION NOT SUPPORTED.
    NotSupported,
    /// TASK MANAGEMENT FUNCTION FAILED.
    Failed,
    /// TASK MANAGEMENT FUNCTION SUCCEEDED (a query found what it asked about).
    Succeeded,
    /// INCORRECT LOGICAL UNIT NUMBER.
    IncorrectLun,
    /// A code this implementation does not name.
    Other(u8),
}

impl ResponseCode {
    /// The code.
    pub fn code(self) -> u8 {
        match self {
            ResponseCode::Complete => 0x00,
            ResponseCode::RequestFieldsInvalid => 0x02,
            ResponseCode::NotSupported => 0x04,
            ResponseCode::Failed => 0x05,
            ResponseCode::Succeeded => 0x08,
            ResponseCode::IncorrectLun => 0x09,
            ResponseCode::Other(c) => c,
        }
    }

    /// The response code named by `c`.
    pub fn from_code(c: u8) -> ResponseCode {
        match c {
            0x00 => ResponseCode::Complete,
            0x02 => ResponseCode::RequestFieldsInvalid,
            0x04 => ResponseCode::NotSupported,
            0x05 => ResponseCode::Failed,
            0x08 => ResponseCode::Succeeded,
            0x09 => ResponseCode::IncorrectLun,
            c => ResponseCode::Other(c),
        }
    }

    /// The 4 bytes of response data that carry it.
    pub fn response_data(self) -> [u8; 4] {
        [0, 0, 0, self.code()]
    }
}

/// SRP_RSP.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct SrpRsp<'a> {
    /// Byte 1: SOLNT.
    pub sol_not: u8,
    /// REQUEST LIMIT DELTA: credit returned to the initiator.
    pub req_lim_delta: u32,
    /// TAG of the request answered.
    pub tag: u64,
    /// STATUS (SAM-5).
    pub status: u8,
    /// Data-out residual (DOOVER/DOUNDER and DATA-OUT RESIDUAL COUNT).
    pub data_out_residual: Residual,
    /// Data-in residual (DIOVER/DIUNDER and DATA-IN RESIDUAL COUNT).
    pub data_in_residual: Residual,
    /// RESPONSE DATA (with RSPVALID; a task management function's response code).
    pub response_data: &'a [u8],
    /// SENSE DATA (with SNSVALID).
    pub sense: &'a [u8],
}

/// The flags and count of a residual.
fn residual_bits(r: Residual, over: u8, under: u8) -> (u8, u32) {
    match r {
        Residual::None => (0, 0),
        Residual::Overflow(n) => (over, n),
        Residual::Underflow(n) => (under, n),
    }
}

impl<'a> SrpRsp<'a> {
    /// Decodes an SRP_RSP from the whole IU.
    pub fn decode(b: &'a [u8]) -> Result<SrpRsp<'a>, IuError> {
        let iu = IuType::Rsp;
        let fixed = super::fixed(b, iu)?;
        let (_, sol_not, _, delta, tag, _, flags, status, dout, din, sense_len, rsp_len) = parsed(
            (
                be_u8,
                be_u8,
                take(2usize),
                be_u32,
                be_u64,
                take(2usize),
                be_u8,
                be_u8,
                be_u32,
                be_u32,
                be_u32,
                be_u32,
            )
                .parse(fixed),
        );
        let invalid = IuError::invalid(iu, tag);
        let residual = |count, over, under, field| match (flags & over != 0, flags & under != 0) {
            (false, false) => Ok(Residual::None),
            (true, false) => Ok(Residual::Overflow(count)),
            (false, true) => Ok(Residual::Underflow(count)),
            (true, true) => Err(invalid(field, "both overflow and underflow")),
        };
        let data_out_residual = residual(
            dout,
            SrpRspFlags::DOOVER,
            SrpRspFlags::DOUNDER,
            "DOOVER and DOUNDER",
        )?;
        let data_in_residual = residual(
            din,
            SrpRspFlags::DIOVER,
            SrpRspFlags::DIUNDER,
            "DIOVER and DIUNDER",
        )?;
        let rsp_len = if flags & SrpRspFlags::RSPVALID != 0 {
            rsp_len as usize
        } else {
            0
        };
        let sense_len = if flags & SrpRspFlags::SNSVALID != 0 {
            sense_len as usize
        } else {
            0
        };
        let truncated = |needed| IuError::Truncated {
            iu,
            len: b.len(),
            needed,
        };
        let rsp_end = FIXED.checked_add(rsp_len).ok_or(truncated(usize::MAX))?;
        let sense_end = rsp_end
            .checked_add(sense_len)
            .ok_or(truncated(usize::MAX))?;
        let response_data = b.get(FIXED..rsp_end).ok_or(truncated(rsp_end))?;
        let sense = b.get(rsp_end..sense_end).ok_or(truncated(sense_end))?;
        Ok(SrpRsp {
            sol_not,
            req_lim_delta: delta,
            tag,
            status,
            data_out_residual,
            data_in_residual,
            response_data,
            sense,
        })
    }

    /// The response code of a task management function's response data.
    pub fn response_code(&self) -> Option<ResponseCode> {
        self.response_data
            .get(3)
            .map(|c| ResponseCode::from_code(*c))
    }

    /// Bytes the IU occupies.
    pub fn encoded_len(&self) -> usize {
        FIXED + self.response_data.len() + self.sense.len()
    }

    /// Appends the IU.
    pub fn encode(&self, out: &mut Vec<u8>) {
        let (dout_flags, dout) = residual_bits(
            self.data_out_residual,
            SrpRspFlags::DOOVER,
            SrpRspFlags::DOUNDER,
        );
        let (din_flags, din) = residual_bits(
            self.data_in_residual,
            SrpRspFlags::DIOVER,
            SrpRspFlags::DIUNDER,
        );
        let mut flags = dout_flags | din_flags;
        if !self.response_data.is_empty() {
            flags |= SrpRspFlags::RSPVALID;
        }
        if !self.sense.is_empty() {
            flags |= SrpRspFlags::SNSVALID;
        }
        out.extend_from_slice(&[IuType::Rsp as u8, self.sol_not, 0, 0]);
        out.extend_from_slice(&self.req_lim_delta.to_be_bytes());
        out.extend_from_slice(&self.tag.to_be_bytes());
        out.extend_from_slice(&[0, 0, flags, self.status]);
        out.extend_from_slice(&dout.to_be_bytes());
        out.extend_from_slice(&din.to_be_bytes());
        out.extend_from_slice(&(self.sense.len() as u32).to_be_bytes());
        out.extend_from_slice(&(self.response_data.len() as u32).to_be_bytes());
        out.extend_from_slice(self.response_data);
        out.extend_from_slice(self.sense);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::iu::Iu;

    #[test]
    fn a_check_condition_with_sense_and_underflow() {
        let sense = [0x70, 0, 5, 0, 0, 0, 0, 10, 0, 0, 0, 0, 0x24, 0, 0, 0, 0, 0];
        let r = SrpRsp {
            req_lim_delta: 1,
            tag: 0x42,
            status: 0x02,
            data_in_residual: Residual::Underflow(512),
            sense: &sense,
            ..SrpRsp::default()
        };
        let mut b = Vec::new();
        r.encode(&mut b);
        assert_eq!(b.len(), 36 + 18);
        assert_eq!(b[18], SrpRspFlags::SNSVALID | SrpRspFlags::DIUNDER);
        assert_eq!(b[19], 0x02);
        assert_eq!(&b[24..28], &512u32.to_be_bytes());
        assert_eq!(&b[28..32], &18u32.to_be_bytes());
        assert_eq!(Iu::decode(&b), Ok(Iu::Rsp(r)));
    }

    #[test]
    fn response_data_comes_before_sense() {
        let r = SrpRsp {
            tag: 1,
            response_data: &ResponseCode::IncorrectLun.response_data(),
            ..SrpRsp::default()
        };
        let mut b = Vec::new();
        r.encode(&mut b);
        assert_eq!(b[18], SrpRspFlags::RSPVALID);
        let d = SrpRsp::decode(&b).expect("valid");
        assert_eq!(d.response_code(), Some(ResponseCode::IncorrectLun));
    }

    #[test]
    fn lengths_beyond_the_iu_and_contradictory_flags_are_errors() {
        let r = SrpRsp::default();
        let mut b = Vec::new();
        r.encode(&mut b);
        let mut bad = b.clone();
        bad[18] = SrpRspFlags::SNSVALID;
        bad[28..32].copy_from_slice(&u32::MAX.to_be_bytes());
        assert!(matches!(
            SrpRsp::decode(&bad),
            Err(IuError::Truncated { .. })
        ));
        let mut bad = b;
        bad[18] = SrpRspFlags::DIOVER | SrpRspFlags::DIUNDER;
        assert!(SrpRsp::decode(&bad).is_err());
    }
}
