//! NOP-Out and NOP-In (RFC 7143 sections 11.18 and 11.19): pings in either direction.

use bytes::Bytes;

use super::{no_ahs, Body, Pdu};
use crate::bhs::{Fields, Opcode, View};
use crate::error::DecodeError;
use crate::serial::SerialNumber;
use crate::types::Lun;

/// NOP-Out: an initiator's ping, or its answer to a target's NOP-In (then TTT echoes the
/// target's tag and ITT is `0xffffffff`).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct NopOut {
    /// I bit.
    pub immediate: bool,
    /// LUN (echoed from a NOP-In being answered).
    pub lun: Lun,
    /// Initiator Task Tag; `0xffffffff` when answering a NOP-In.
    pub initiator_task_tag: u32,
    /// Target Transfer Tag: the NOP-In's tag when answering one, else `0xffffffff`.
    pub target_transfer_tag: u32,
    /// CmdSN.
    pub cmd_sn: SerialNumber,
    /// ExpStatSN.
    pub exp_stat_sn: SerialNumber,
    /// Ping data, echoed by the answering NOP-In.
    pub data: Bytes,
}

impl Body for NopOut {
    const OPCODE: Opcode = Opcode::NopOut;

    #[inline(always)]
    fn decode(f: View<'_>, ahs: Option<Bytes>, data: Bytes) -> Result<Pdu, DecodeError> {
        no_ahs(&ahs)?;
        Ok(Pdu::NopOut(NopOut {
            immediate: f.b(0) & 0x40 != 0,
            lun: Lun(f.lun()),
            initiator_task_tag: f.w(0),
            target_transfer_tag: f.w(1),
            cmd_sn: SerialNumber(f.w(2)),
            exp_stat_sn: SerialNumber(f.w(3)),
            data,
        }))
    }

    fn encode(&self, f: &mut Fields) {
        f.b[1] = 0x80;
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

/// NOP-In: the target's answer to a NOP-Out, or its own ping (then TTT is a tag the initiator
/// must echo and ITT is `0xffffffff`).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct NopIn {
    /// LUN.
    pub lun: Lun,
    /// Initiator Task Tag of the NOP-Out answered, or `0xffffffff`.
    pub initiator_task_tag: u32,
    /// Target Transfer Tag: a tag when the target wants an answer, else `0xffffffff`.
    pub target_transfer_tag: u32,
    /// StatSN.
    pub stat_sn: SerialNumber,
    /// ExpCmdSN.
    pub exp_cmd_sn: SerialNumber,
    /// MaxCmdSN.
    pub max_cmd_sn: SerialNumber,
    /// Ping data.
    pub data: Bytes,
}

impl Body for NopIn {
    const OPCODE: Opcode = Opcode::NopIn;

    #[inline(always)]
    fn decode(f: View<'_>, ahs: Option<Bytes>, data: Bytes) -> Result<Pdu, DecodeError> {
        no_ahs(&ahs)?;
        Ok(Pdu::NopIn(NopIn {
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
        f.b[1] = 0x80;
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
