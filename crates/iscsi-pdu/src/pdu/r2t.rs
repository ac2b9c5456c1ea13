//! Ready To Transfer (RFC 7143 section 11.8): the target asks for a burst of Data-Out.

use bytes::Bytes;

use super::{no_ahs, no_data, Body, Pdu, EMPTY};
use crate::bhs::{Fields, Opcode, View};
use crate::error::{DecodeError, PduError};
use crate::serial::SerialNumber;
use crate::types::Lun;

/// R2T: asks the initiator for `desired_data_transfer_length` bytes from `buffer_offset`.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct ReadyToTransfer {
    /// LUN.
    pub lun: Lun,
    /// Initiator Task Tag of the command.
    pub initiator_task_tag: u32,
    /// Target Transfer Tag the Data-Out PDUs of this burst must carry.
    pub target_transfer_tag: u32,
    /// StatSN (not advanced by an R2T).
    pub stat_sn: SerialNumber,
    /// ExpCmdSN.
    pub exp_cmd_sn: SerialNumber,
    /// MaxCmdSN.
    pub max_cmd_sn: SerialNumber,
    /// R2TSN, numbering the R2Ts of a command from 0.
    pub r2t_sn: u32,
    /// Buffer Offset of the burst.
    pub buffer_offset: u32,
    /// Desired Data Transfer Length: never 0, never above MaxBurstLength.
    pub desired_data_transfer_length: u32,
}

impl Body for ReadyToTransfer {
    const OPCODE: Opcode = Opcode::ReadyToTransfer;

    #[inline(always)]
    fn decode(f: View<'_>, ahs: Option<Bytes>, data: Bytes) -> Result<Pdu, DecodeError> {
        no_ahs(&ahs)?;
        no_data(&data)?;
        if f.w(7) == 0 {
            return Err(PduError::InvalidField {
                field: "DesiredDataTransferLength",
                reason: "must not be 0",
            }
            .into());
        }
        Ok(Pdu::ReadyToTransfer(ReadyToTransfer {
            lun: Lun(f.lun()),
            initiator_task_tag: f.w(0),
            target_transfer_tag: f.w(1),
            stat_sn: SerialNumber(f.w(2)),
            exp_cmd_sn: SerialNumber(f.w(3)),
            max_cmd_sn: SerialNumber(f.w(4)),
            r2t_sn: f.w(5),
            buffer_offset: f.w(6),
            desired_data_transfer_length: f.w(7),
        }))
    }

    fn encode(&self, f: &mut Fields) {
        f.b[1] = 0x80;
        f.lun = self.lun.0;
        f.w = [
            self.initiator_task_tag,
            self.target_transfer_tag,
            self.stat_sn.0,
            self.exp_cmd_sn.0,
            self.max_cmd_sn.0,
            self.r2t_sn,
            self.buffer_offset,
            self.desired_data_transfer_length,
        ];
    }

    fn data(&self) -> &Bytes {
        &EMPTY
    }
}
