//! Asynchronous Message (RFC 7143 section 11.9): events the target raises on its own.

use bytes::Bytes;

use super::{code_enum, no_ahs, Body, Pdu};
use crate::bhs::{Fields, Opcode, View};
use crate::error::DecodeError;
use crate::serial::SerialNumber;
use crate::types::{Lun, RESERVED_TAG};

code_enum! {
    /// AsyncEvent.
    AsyncEvent: u8 {
        /// 0: a SCSI asynchronous event; sense data in the data segment.
        ScsiEvent = 0,
        /// 1: the target asks for a logout within Parameter3 seconds.
        LogoutRequested = 1,
        /// 2: the target will drop connection Parameter1 (Time2Wait and Time2Retain follow).
        ConnectionDropped = 2,
        /// 3: the target will drop all connections of the session.
        SessionDropped = 3,
        /// 4: the target asks for parameter renegotiation.
        NegotiationRequested = 4,
        /// 255: vendor specific.
        VendorSpecific = 255,
    }
}

/// Asynchronous Message. Its Initiator Task Tag is always `0xffffffff`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AsyncMessage {
    /// LUN (for SCSI events).
    pub lun: Lun,
    /// StatSN.
    pub stat_sn: SerialNumber,
    /// ExpCmdSN.
    pub exp_cmd_sn: SerialNumber,
    /// MaxCmdSN.
    pub max_cmd_sn: SerialNumber,
    /// AsyncEvent.
    pub event: AsyncEvent,
    /// AsyncVCode (vendor code).
    pub vcode: u8,
    /// Parameter1.
    pub parameter1: u16,
    /// Parameter2.
    pub parameter2: u16,
    /// Parameter3.
    pub parameter3: u16,
    /// SenseLength | sense data | iSCSI event data.
    pub data: Bytes,
}

impl Default for AsyncMessage {
    fn default() -> Self {
        AsyncMessage {
            lun: Lun::ZERO,
            stat_sn: SerialNumber(0),
            exp_cmd_sn: SerialNumber(0),
            max_cmd_sn: SerialNumber(0),
            event: AsyncEvent::LogoutRequested,
            vcode: 0,
            parameter1: 0,
            parameter2: 0,
            parameter3: 0,
            data: Bytes::new(),
        }
    }
}

impl Body for AsyncMessage {
    const OPCODE: Opcode = Opcode::AsyncMessage;

    #[inline(always)]
    fn decode(f: View<'_>, ahs: Option<Bytes>, data: Bytes) -> Result<Pdu, DecodeError> {
        no_ahs(&ahs)?;
        let [event, vcode, _, _] = f.w(5).to_be_bytes();
        Ok(Pdu::AsyncMessage(AsyncMessage {
            lun: Lun(f.lun()),
            stat_sn: SerialNumber(f.w(2)),
            exp_cmd_sn: SerialNumber(f.w(3)),
            max_cmd_sn: SerialNumber(f.w(4)),
            event: AsyncEvent::from(event),
            vcode,
            parameter1: f.half(5, false),
            parameter2: f.half(6, true),
            parameter3: f.half(6, false),
            data,
        }))
    }

    fn encode(&self, f: &mut Fields) {
        f.b[1] = 0x80;
        f.lun = self.lun.0;
        f.w[0] = RESERVED_TAG;
        f.w[2] = self.stat_sn.0;
        f.w[3] = self.exp_cmd_sn.0;
        f.w[4] = self.max_cmd_sn.0;
        f.w[5] = u32::from(u8::from(self.event)) << 24
            | u32::from(self.vcode) << 16
            | u32::from(self.parameter1);
        f.w[6] = u32::from(self.parameter2) << 16 | u32::from(self.parameter3);
    }

    fn data(&self) -> &Bytes {
        &self.data
    }
}
