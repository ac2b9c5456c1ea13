//! SNACK Request (RFC 7143 section 11.16): asks for PDUs again (ERL > 0).

use bytes::Bytes;

use super::{code_enum, no_ahs, no_data, Body, Pdu, EMPTY};
use crate::bhs::{Fields, Opcode, View};
use crate::error::DecodeError;
use crate::serial::SerialNumber;
use crate::types::Lun;

code_enum! {
    /// Type of a SNACK.
    SnackType: u8 {
        /// 0: Data/R2T SNACK.
        DataR2t = 0,
        /// 1: Status SNACK.
        Status = 1,
        /// 2: DataACK.
        DataAck = 2,
        /// 3: R-Data SNACK.
        RData = 3,
    }
}

/// SNACK Request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SnackRequest {
    /// Type.
    pub snack_type: SnackType,
    /// LUN (DataACK).
    pub lun: Lun,
    /// Initiator Task Tag, or `0xffffffff` for a Status SNACK.
    pub initiator_task_tag: u32,
    /// Target Transfer Tag (DataACK) or SNACK Tag (R-Data), else `0xffffffff`.
    pub target_transfer_tag: u32,
    /// ExpStatSN.
    pub exp_stat_sn: SerialNumber,
    /// BegRun: the first DataSN, R2TSN or StatSN asked for.
    pub beg_run: u32,
    /// RunLength: how many, 0 meaning all from BegRun.
    pub run_length: u32,
}

impl Default for SnackRequest {
    fn default() -> Self {
        SnackRequest {
            snack_type: SnackType::DataR2t,
            lun: Lun::ZERO,
            initiator_task_tag: 0,
            target_transfer_tag: 0,
            exp_stat_sn: SerialNumber(0),
            beg_run: 0,
            run_length: 0,
        }
    }
}

impl Body for SnackRequest {
    const OPCODE: Opcode = Opcode::SnackRequest;

    #[inline(always)]
    fn decode(f: View<'_>, ahs: Option<Bytes>, data: Bytes) -> Result<Pdu, DecodeError> {
        no_ahs(&ahs)?;
        no_data(&data)?;
        Ok(Pdu::SnackRequest(SnackRequest {
            snack_type: SnackType::from(f.b(1) & 0x0f),
            lun: Lun(f.lun()),
            initiator_task_tag: f.w(0),
            target_transfer_tag: f.w(1),
            exp_stat_sn: SerialNumber(f.w(3)),
            beg_run: f.w(6),
            run_length: f.w(7),
        }))
    }

    fn encode(&self, f: &mut Fields) {
        f.b[1] = 0x80 | (u8::from(self.snack_type) & 0x0f);
        f.lun = self.lun.0;
        f.w[0] = self.initiator_task_tag;
        f.w[1] = self.target_transfer_tag;
        f.w[3] = self.exp_stat_sn.0;
        f.w[6] = self.beg_run;
        f.w[7] = self.run_length;
    }

    fn data(&self) -> &Bytes {
        &EMPTY
    }
}
