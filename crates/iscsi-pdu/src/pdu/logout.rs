//! Logout Request and Logout Response (RFC 7143 sections 11.14 and 11.15).

use bytes::Bytes;

use super::{code_enum, no_ahs, no_data, Body, Pdu, EMPTY};
use crate::bhs::{Fields, Opcode, View};
use crate::error::DecodeError;
use crate::serial::SerialNumber;

code_enum! {
    /// Reason Code of a Logout Request.
    LogoutReason: u8 {
        /// 0: close the session.
        CloseSession = 0,
        /// 1: close the connection.
        CloseConnection = 1,
        /// 2: remove the connection for recovery.
        RemoveConnectionForRecovery = 2,
    }
}

code_enum! {
    /// Response of a Logout Response.
    LogoutResponseCode: u8 {
        /// 0: connection or session closed successfully.
        ClosedSuccessfully = 0,
        /// 1: CID not found.
        CidNotFound = 1,
        /// 2: connection recovery is not supported.
        RecoveryNotSupported = 2,
        /// 3: cleanup failed for various reasons.
        CleanupFailed = 3,
    }
}

/// Logout Request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LogoutRequest {
    /// I bit.
    pub immediate: bool,
    /// Reason Code.
    pub reason: LogoutReason,
    /// Initiator Task Tag.
    pub initiator_task_tag: u32,
    /// CID of the connection to close (reasons 1 and 2).
    pub cid: u16,
    /// CmdSN.
    pub cmd_sn: SerialNumber,
    /// ExpStatSN.
    pub exp_stat_sn: SerialNumber,
}

impl Default for LogoutRequest {
    fn default() -> Self {
        LogoutRequest {
            immediate: false,
            reason: LogoutReason::CloseSession,
            initiator_task_tag: 0,
            cid: 0,
            cmd_sn: SerialNumber(0),
            exp_stat_sn: SerialNumber(0),
        }
    }
}

impl Body for LogoutRequest {
    const OPCODE: Opcode = Opcode::LogoutRequest;

    #[inline(always)]
    fn decode(f: View<'_>, ahs: Option<Bytes>, data: Bytes) -> Result<Pdu, DecodeError> {
        no_ahs(&ahs)?;
        no_data(&data)?;
        Ok(Pdu::LogoutRequest(LogoutRequest {
            immediate: f.b(0) & 0x40 != 0,
            reason: LogoutReason::from(f.b(1) & 0x7f),
            initiator_task_tag: f.w(0),
            cid: f.half(1, true),
            cmd_sn: SerialNumber(f.w(2)),
            exp_stat_sn: SerialNumber(f.w(3)),
        }))
    }

    fn encode(&self, f: &mut Fields) {
        f.b[1] = 0x80 | (u8::from(self.reason) & 0x7f);
        f.w[0] = self.initiator_task_tag;
        f.w[1] = u32::from(self.cid) << 16;
        f.w[2] = self.cmd_sn.0;
        f.w[3] = self.exp_stat_sn.0;
    }

    fn immediate(&self) -> bool {
        self.immediate
    }

    fn data(&self) -> &Bytes {
        &EMPTY
    }
}

/// Logout Response.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LogoutResponse {
    /// Response.
    pub response: LogoutResponseCode,
    /// Initiator Task Tag, echoed.
    pub initiator_task_tag: u32,
    /// StatSN.
    pub stat_sn: SerialNumber,
    /// ExpCmdSN.
    pub exp_cmd_sn: SerialNumber,
    /// MaxCmdSN.
    pub max_cmd_sn: SerialNumber,
    /// Time2Wait, seconds.
    pub time2wait: u16,
    /// Time2Retain, seconds.
    pub time2retain: u16,
}

impl Default for LogoutResponse {
    fn default() -> Self {
        LogoutResponse {
            response: LogoutResponseCode::ClosedSuccessfully,
            initiator_task_tag: 0,
            stat_sn: SerialNumber(0),
            exp_cmd_sn: SerialNumber(0),
            max_cmd_sn: SerialNumber(0),
            time2wait: 0,
            time2retain: 0,
        }
    }
}

impl Body for LogoutResponse {
    const OPCODE: Opcode = Opcode::LogoutResponse;

    #[inline(always)]
    fn decode(f: View<'_>, ahs: Option<Bytes>, data: Bytes) -> Result<Pdu, DecodeError> {
        no_ahs(&ahs)?;
        no_data(&data)?;
        Ok(Pdu::LogoutResponse(LogoutResponse {
            response: LogoutResponseCode::from(f.b(2)),
            initiator_task_tag: f.w(0),
            stat_sn: SerialNumber(f.w(2)),
            exp_cmd_sn: SerialNumber(f.w(3)),
            max_cmd_sn: SerialNumber(f.w(4)),
            time2wait: f.half(6, true),
            time2retain: f.half(6, false),
        }))
    }

    fn encode(&self, f: &mut Fields) {
        f.b[1] = 0x80;
        f.b[2] = self.response.into();
        f.w[0] = self.initiator_task_tag;
        f.w[2] = self.stat_sn.0;
        f.w[3] = self.exp_cmd_sn.0;
        f.w[4] = self.max_cmd_sn.0;
        f.w[6] = u32::from(self.time2wait) << 16 | u32::from(self.time2retain);
    }

    fn data(&self) -> &Bytes {
        &EMPTY
    }
}
