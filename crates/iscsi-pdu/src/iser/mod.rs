//! iSCSI Extensions for RDMA (RFC 7145): the iSCSI target over an RDMA reliable connection,
//! its data moved by the target with RDMA READ and WRITE into and out of the buffers the
//! initiator names, its control PDUs carried in Sends behind an iSER header.
//!
//! - [`header`]: the iSER header, Hello and HelloReply.
//! - [`cm`]: the private data of the RDMA/CM connection request and reply.
//! - [`message`]: control-type PDUs in Sends.
//! - [`initiator`]: the initiator's datamover around an initiator session: its PDUs in Sends,
//!   each SCSI Command naming the buffers the target moves the data with.
//! - [`target`]: the target's connection in full feature phase, iSER's datamover on the
//!   iSCSI target [`Connection`](crate::target_node::Connection): R2Ts become RDMA READs, Data-In
//!   becomes RDMA WRITEs, the rest goes in Sends.
//!
//! The login is the iSCSI login, its PDUs in Sends ([`message`]), with
//! `RDMAExtensions=Yes` and the two RecvDataSegmentLength keys
//! ([`negotiation`](crate::negotiation)).

pub mod cm;
pub mod header;
pub mod initiator;
pub mod message;
pub mod target;
#[cfg(feature = "testing")]
pub mod testing;

pub use cm::{CmReply, CmRequest, CM_HEADER_LEN};
pub use header::{Hello, HelloReply, IserHeader, RemoteBuffer, ISER_HEADER_LEN, ISER_VERSION};
pub use initiator::{IserInitiator, IserInitiatorError};
pub use message::{decode, encode, message_len, receive_len, Message, Received};
pub use target::{DataOutRead, IserConnection, IserPlan, Work};

use crate::DecodeError;

/// Bytes of the iSER header and a BHS: what a Send carries before any AHS and data.
pub const ISER_HEADERS_LEN: usize = ISER_HEADER_LEN + crate::BHS_LEN;

/// The most AHS a PDU may carry (TotalAHSLength is one byte of 4-byte words). The data
/// segment limits (TargetRecvDataSegmentLength) do not count it, so a receive buffer that
/// holds [`ISER_HEADERS_LEN`], this and the data segment takes every message within them:
/// an initiator may put the largest CDB (an extended-CDB AHS) before the most immediate data.
pub const MAX_AHS_LEN: usize = 255 * 4;

/// Why a received message cannot be taken. All but [`IserError::Pdu`] with a malformed PDU
/// close the connection: the message's framing cannot be trusted.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum IserError {
    /// Shorter than the headers.
    #[error("a message of {0} bytes is shorter than its headers")]
    Short(usize),
    /// An iSER opcode this side does not know.
    #[error("unknown iSER opcode {0:#x}")]
    Opcode(u8),
    /// The message's length does not match its header's.
    #[error("a message of {received} bytes for a PDU of {expected}")]
    Length {
        /// Bytes received.
        received: usize,
        /// Bytes the BHS announces.
        expected: usize,
    },
    /// A data segment beyond TargetRecvDataSegmentLength.
    #[error("data segment of {length} bytes exceeds TargetRecvDataSegmentLength {limit}")]
    DataSegmentTooLong {
        /// DataSegmentLength.
        length: u32,
        /// The negotiated limit.
        limit: u32,
    },
    /// The PDU itself: a malformed one is rejected and the connection goes on.
    #[error("{0}")]
    Pdu(DecodeError),
    /// A message that has no place in full feature phase (a HelloReply to a target).
    #[error("unexpected iSER message: {0}")]
    Unexpected(&'static str),
}

#[cfg(test)]
mod tests;
