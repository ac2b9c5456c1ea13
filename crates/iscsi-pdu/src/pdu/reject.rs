//! Reject (RFC 7143 section 11.17): the answer to a PDU the receiver will not process.

use bytes::Bytes;

use super::{code_enum, no_ahs, Body, Pdu};
use crate::bhs::{Bhs, Fields, Opcode, View, BHS_LEN};
use crate::error::{DecodeError, PduError};
use crate::serial::SerialNumber;
use crate::types::RESERVED_TAG;

code_enum! {
    /// Reason of a Reject.
    RejectReason: u8 {
        /// 0x02: data (payload) digest error.
        DataDigestError = 0x02,
        /// 0x03: SNACK reject.
        SnackReject = 0x03,
        /// 0x04: protocol error.
        ProtocolError = 0x04,
        /// 0x05: command not supported.
        CommandNotSupported = 0x05,
        /// 0x06: immediate command reject: too many immediate commands.
        ImmediateCommandReject = 0x06,
        /// 0x07: task in progress.
        TaskInProgress = 0x07,
        /// 0x08: invalid data ack.
        InvalidDataAck = 0x08,
        /// 0x09: invalid PDU field.
        InvalidPduField = 0x09,
        /// 0x0a: long operation reject: can't generate a Target Transfer Tag (out of resources).
        LongOperationReject = 0x0a,
        /// 0x0b: deprecated (was negotiation reset).
        NegotiationReset = 0x0b,
        /// 0x0c: waiting for logout.
        WaitingForLogout = 0x0c,
    }
}

// The errors' Rejects are said here, beside the reasons, so that the errors need not know
// the Reject PDU.
impl PduError {
    /// The Reject reason RFC 7143 section 11.17.1 prescribes for this error.
    pub fn reject_reason(&self) -> RejectReason {
        match self {
            PduError::UnsupportedOpcode(_) => RejectReason::CommandNotSupported,
            PduError::InvalidField { .. } => RejectReason::InvalidPduField,
            PduError::DataDigest { .. } => RejectReason::DataDigestError,
        }
    }
}

impl DecodeError {
    /// The Reject this error should be answered with, if any: its reason and the header to
    /// return in its data segment.
    pub fn reject(&self) -> Option<(RejectReason, &Bhs)> {
        match self {
            DecodeError::Malformed { header, error } => Some((error.reject_reason(), header)),
            DecodeError::DataSegmentTooLong { header, .. } => {
                Some((RejectReason::ProtocolError, header))
            }
            _ => None,
        }
    }
}

/// Reject. Its data segment is the complete header of the rejected PDU.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reject {
    /// Reason.
    pub reason: RejectReason,
    /// StatSN.
    pub stat_sn: SerialNumber,
    /// ExpCmdSN.
    pub exp_cmd_sn: SerialNumber,
    /// MaxCmdSN.
    pub max_cmd_sn: SerialNumber,
    /// DataSN or R2TSN (for a rejected SNACK), else 0.
    pub data_sn_or_r2t_sn: u32,
    /// The rejected PDU's header.
    pub data: Bytes,
}

impl Default for Reject {
    fn default() -> Self {
        Reject {
            reason: RejectReason::ProtocolError,
            stat_sn: SerialNumber(0),
            exp_cmd_sn: SerialNumber(0),
            max_cmd_sn: SerialNumber(0),
            data_sn_or_r2t_sn: 0,
            data: Bytes::new(),
        }
    }
}

impl Reject {
    /// A Reject of the PDU whose header is `header`.
    pub fn of(reason: RejectReason, header: &Bhs) -> Reject {
        Reject {
            reason,
            data: Bytes::copy_from_slice(&header.0),
            ..Reject::default()
        }
    }

    /// The BHS of the rejected PDU, if the data segment holds one.
    pub fn rejected_header(&self) -> Option<Bhs> {
        let b: [u8; BHS_LEN] = self.data.get(..BHS_LEN)?.try_into().ok()?;
        Some(Bhs(b))
    }
}

impl Body for Reject {
    const OPCODE: Opcode = Opcode::Reject;

    #[inline(always)]
    fn decode(f: View<'_>, ahs: Option<Bytes>, data: Bytes) -> Result<Pdu, DecodeError> {
        no_ahs(&ahs)?;
        Ok(Pdu::Reject(Reject {
            reason: RejectReason::from(f.b(2)),
            stat_sn: SerialNumber(f.w(2)),
            exp_cmd_sn: SerialNumber(f.w(3)),
            max_cmd_sn: SerialNumber(f.w(4)),
            data_sn_or_r2t_sn: f.w(5),
            data,
        }))
    }

    fn encode(&self, f: &mut Fields) {
        f.b[1] = 0x80;
        f.b[2] = self.reason.into();
        f.w[0] = RESERVED_TAG;
        f.w[2] = self.stat_sn.0;
        f.w[3] = self.exp_cmd_sn.0;
        f.w[4] = self.max_cmd_sn.0;
        f.w[5] = self.data_sn_or_r2t_sn;
    }

    fn data(&self) -> &Bytes {
        &self.data
    }
}
