//! Text Request and Text Response (RFC 7143 sections 11.10 and 11.11).

use bytes::Bytes;

use super::{no_ahs, Body, Pdu};
use crate::bhs::{Fields, Opcode, View};
use crate::error::{DecodeError, PduError};
use crate::serial::SerialNumber;
use crate::types::Lun;

fn final_continue(flags: u8) -> Result<(bool, bool), PduError> {
    let (f, c) = (flags & 0x80 != 0, flags & 0x40 != 0);
    if f && c {
        return Err(PduError::InvalidField {
            field: "F and C bits",
            reason: "both set",
        });
    }
    Ok((f, c))
}

/// Text Request: key=value pairs in full feature phase (SendTargets, renegotiation).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct TextRequest {
    /// I bit.
    pub immediate: bool,
    /// F bit: the last request of the exchange.
    pub final_bit: bool,
    /// C bit: the text continues in the next request.
    pub continue_bit: bool,
    /// LUN.
    pub lun: Lun,
    /// Initiator Task Tag.
    pub initiator_task_tag: u32,
    /// Target Transfer Tag: `0xffffffff` to start, else the tag of the response continued.
    pub target_transfer_tag: u32,
    /// CmdSN.
    pub cmd_sn: SerialNumber,
    /// ExpStatSN.
    pub exp_stat_sn: SerialNumber,
    /// Text key=value pairs.
    pub data: Bytes,
}

impl Body for TextRequest {
    const OPCODE: Opcode = Opcode::TextRequest;

    #[inline(always)]
    fn decode(f: View<'_>, ahs: Option<Bytes>, data: Bytes) -> Result<Pdu, DecodeError> {
        no_ahs(&ahs)?;
        let (final_bit, continue_bit) = final_continue(f.b(1))?;
        Ok(Pdu::TextRequest(TextRequest {
            immediate: f.b(0) & 0x40 != 0,
            final_bit,
            continue_bit,
            lun: Lun(f.lun()),
            initiator_task_tag: f.w(0),
            target_transfer_tag: f.w(1),
            cmd_sn: SerialNumber(f.w(2)),
            exp_stat_sn: SerialNumber(f.w(3)),
            data,
        }))
    }

    fn encode(&self, f: &mut Fields) {
        f.b[1] = u8::from(self.final_bit) << 7 | u8::from(self.continue_bit) << 6;
        f.lun = self.lun.0;
        f.w[0] = self.initiator_task_tag;
        f.w[1] = self.target_transfer_tag;
        f.w[2] = self.cmd_sn.0;
        f.w[3] = self.exp_stat_sn.0;
    }

    fn immediate(&self) -> bool {
        self.immediate
    }

    fn data(&self) -> &Bytes {
        &self.data
    }
}

/// Text Response.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct TextResponse {
    /// F bit: the target has nothing more to say.
    pub final_bit: bool,
    /// C bit: the text continues in the next response.
    pub continue_bit: bool,
    /// LUN.
    pub lun: Lun,
    /// Initiator Task Tag, echoed.
    pub initiator_task_tag: u32,
    /// Target Transfer Tag: a tag while more responses follow, else `0xffffffff`.
    pub target_transfer_tag: u32,
    /// StatSN.
    pub stat_sn: SerialNumber,
    /// ExpCmdSN.
    pub exp_cmd_sn: SerialNumber,
    /// MaxCmdSN.
    pub max_cmd_sn: SerialNumber,
    /// Text key=value pairs.
    pub data: Bytes,
}

impl Body for TextResponse {
    const OPCODE: Opcode = Opcode::TextResponse;

    #[inline(always)]
    fn decode(f: View<'_>, ahs: Option<Bytes>, data: Bytes) -> Result<Pdu, DecodeError> {
        no_ahs(&ahs)?;
        let (final_bit, continue_bit) = final_continue(f.b(1))?;
        Ok(Pdu::TextResponse(TextResponse {
            final_bit,
            continue_bit,
            lun: Lun(f.lun()),
            initiator_task_tag: f.w(0),
            target_transfer_tag: f.w(1),
            stat_sn: SerialNumber(f.w(2)),
            exp_cmd_sn: SerialNumber(f.w(3)),
            max_cmd_sn: SerialNumber(f.w(4)),
            data,
        }))
    }

    fn encode(&self, f: &mut Fields) {
        f.b[1] = u8::from(self.final_bit) << 7 | u8::from(self.continue_bit) << 6;
        f.lun = self.lun.0;
        f.w[0] = self.initiator_task_tag;
        f.w[1] = self.target_transfer_tag;
        f.w[2] = self.stat_sn.0;
        f.w[3] = self.exp_cmd_sn.0;
        f.w[4] = self.max_cmd_sn.0;
    }

    fn data(&self) -> &Bytes {
        &self.data
    }
}
