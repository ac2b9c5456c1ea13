//! SCSI Data-Out and Data-In (RFC 7143 sections 11.7.1 and 11.7.2).

use bytes::Bytes;

use super::{no_ahs, Body, Pdu};
use crate::bhs::{Fields, Opcode, View};
use crate::error::{DecodeError, PduError};
use crate::serial::SerialNumber;
use crate::types::{Lun, Residual, ScsiStatus};

/// SCSI Data-Out: write data, unsolicited (TTT `0xffffffff`) or answering an R2T.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct DataOut {
    /// F bit: the last PDU of a sequence (an R2T's burst or the unsolicited data).
    pub final_bit: bool,
    /// LUN.
    pub lun: Lun,
    /// Initiator Task Tag of the command.
    pub initiator_task_tag: u32,
    /// Target Transfer Tag of the R2T answered, or `0xffffffff` for unsolicited data.
    pub target_transfer_tag: u32,
    /// ExpStatSN.
    pub exp_stat_sn: SerialNumber,
    /// DataSN within the sequence, from 0.
    pub data_sn: u32,
    /// Buffer Offset of this segment in the command's data.
    pub buffer_offset: u32,
    /// The data.
    pub data: Bytes,
}

impl Body for DataOut {
    const OPCODE: Opcode = Opcode::DataOut;

    #[inline(always)]
    fn decode(f: View<'_>, ahs: Option<Bytes>, data: Bytes) -> Result<Pdu, DecodeError> {
        no_ahs(&ahs)?;
        Ok(Pdu::DataOut(DataOut {
            final_bit: f.b(1) & 0x80 != 0,
            lun: Lun(f.lun()),
            initiator_task_tag: f.w(0),
            target_transfer_tag: f.w(1),
            exp_stat_sn: SerialNumber(f.w(3)),
            data_sn: f.w(5),
            buffer_offset: f.w(6),
            data,
        }))
    }

    fn encode(&self, f: &mut Fields) {
        f.b[1] = if self.final_bit { 0x80 } else { 0 };
        f.lun = self.lun.0;
        f.w[0] = self.initiator_task_tag;
        f.w[1] = self.target_transfer_tag;
        f.w[3] = self.exp_stat_sn.0;
        f.w[5] = self.data_sn;
        f.w[6] = self.buffer_offset;
    }

    fn data(&self) -> &Bytes {
        &self.data
    }
}

/// The status phase collapsed into a final Data-In (S bit).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct DataInStatus {
    /// SCSI status (never CHECK CONDITION: sense needs a SCSI Response).
    pub status: ScsiStatus,
    /// StatSN of this status.
    pub stat_sn: SerialNumber,
    /// Residual of the command.
    pub residual: Residual,
}

/// SCSI Data-In: read data, optionally with the command's status.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct DataIn {
    /// F bit: the last PDU of the sequence.
    pub final_bit: bool,
    /// A bit: the target asks for a DataACK SNACK (ERL > 0).
    pub acknowledge: bool,
    /// Status, when the S bit is set (then F is set too).
    pub status: Option<DataInStatus>,
    /// LUN (meaningful with the A bit).
    pub lun: Lun,
    /// Initiator Task Tag of the command.
    pub initiator_task_tag: u32,
    /// Target Transfer Tag (with the A bit), else `0xffffffff`.
    pub target_transfer_tag: u32,
    /// ExpCmdSN.
    pub exp_cmd_sn: SerialNumber,
    /// MaxCmdSN.
    pub max_cmd_sn: SerialNumber,
    /// DataSN, numbering the command's Data-In PDUs from 0.
    pub data_sn: u32,
    /// Buffer Offset of this segment.
    pub buffer_offset: u32,
    /// The data (empty when the sender supplies it separately with [`crate::Pdu::encode_header`]).
    pub data: Bytes,
}

impl Body for DataIn {
    const OPCODE: Opcode = Opcode::DataIn;

    #[inline(always)]
    fn decode(f: View<'_>, ahs: Option<Bytes>, data: Bytes) -> Result<Pdu, DecodeError> {
        no_ahs(&ahs)?;
        let flags = f.b(1);
        let final_bit = flags & 0x80 != 0;
        let status = if flags & 0x01 != 0 {
            if !final_bit {
                return Err(PduError::InvalidField {
                    field: "S bit",
                    reason: "set without the F bit",
                }
                .into());
            }
            Some(DataInStatus {
                status: ScsiStatus(f.b(3)),
                stat_sn: SerialNumber(f.w(2)),
                residual: decode_residual(flags >> 1, f.w(7), "O/U bits")?,
            })
        } else {
            None
        };
        Ok(Pdu::DataIn(DataIn {
            final_bit,
            acknowledge: flags & 0x40 != 0,
            status,
            lun: Lun(f.lun()),
            initiator_task_tag: f.w(0),
            target_transfer_tag: f.w(1),
            exp_cmd_sn: SerialNumber(f.w(3)),
            max_cmd_sn: SerialNumber(f.w(4)),
            data_sn: f.w(5),
            buffer_offset: f.w(6),
            data,
        }))
    }

    fn encode(&self, f: &mut Fields) {
        let mut flags = 0u8;
        if self.final_bit || self.status.is_some() {
            flags |= 0x80;
        }
        if self.acknowledge {
            flags |= 0x40;
        }
        if let Some(s) = &self.status {
            flags |= 0x01 | (residual_bits(s.residual) << 1);
            f.b[3] = s.status.0;
            f.w[2] = s.stat_sn.0;
            f.w[7] = s.residual.count();
        }
        f.b[1] = flags;
        f.lun = self.lun.0;
        f.w[0] = self.initiator_task_tag;
        f.w[1] = self.target_transfer_tag;
        f.w[3] = self.exp_cmd_sn.0;
        f.w[4] = self.max_cmd_sn.0;
        f.w[5] = self.data_sn;
        f.w[6] = self.buffer_offset;
    }

    fn data(&self) -> &Bytes {
        &self.data
    }
}

/// Decodes an O/U pair (bit 1 = O, bit 0 = U of `bits`) and a count.
pub(crate) fn decode_residual(
    bits: u8,
    count: u32,
    field: &'static str,
) -> Result<Residual, PduError> {
    match bits & 3 {
        0 => Ok(Residual::None),
        1 => Ok(Residual::Underflow(count)),
        2 => Ok(Residual::Overflow(count)),
        _ => Err(PduError::InvalidField {
            field,
            reason: "overflow and underflow both set",
        }),
    }
}

/// The O/U pair of a residual (bit 1 = O, bit 0 = U).
pub(crate) fn residual_bits(r: Residual) -> u8 {
    match r {
        Residual::None => 0,
        Residual::Underflow(_) => 1,
        Residual::Overflow(_) => 2,
    }
}
