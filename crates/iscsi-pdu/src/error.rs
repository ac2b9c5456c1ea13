//! Decode errors, scoped to what recovers: a malformed PDU is answered with a Reject and the
//! connection goes on; a broken frame (header digest, oversized segment) closes the connection.

use crate::bhs::Bhs;

/// Why one PDU could not be decoded although its frame was intact. Answered with a Reject
/// carrying [`PduError::reject_reason`] and the offending header.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum PduError {
    /// The opcode is reserved, vendor specific, or belongs to the other role.
    #[error("opcode {0:#04x} is not supported")]
    UnsupportedOpcode(u8),
    /// A field holds a value the RFC forbids.
    #[error("invalid {field}: {reason}")]
    InvalidField {
        /// The field, in the RFC's words.
        field: &'static str,
        /// What was wrong with it.
        reason: &'static str,
    },
    /// The data digest did not match: the data segment must be discarded.
    #[error("data digest mismatch: computed {computed:#010x}, received {received:#010x}")]
    DataDigest {
        /// CRC32C of the received segment.
        computed: u32,
        /// The digest that came with it.
        received: u32,
    },
}

/// The error of [`crate::Pdu::decode`] and of the [`crate::Deframer`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum DecodeError {
    /// More input is needed: at least this many further bytes (standalone decode only; the
    /// deframer reports this through [`crate::Deframer::needed`]).
    #[error("incomplete PDU: {needed} more bytes needed")]
    Incomplete {
        /// Bytes still missing before the next step of decoding can succeed.
        needed: usize,
    },
    /// The header digest did not match. The header cannot be trusted, so the PDU's length is
    /// unknown and the connection must be closed (RFC 7143 section 7.8).
    #[error("header digest mismatch: computed {computed:#010x}, received {received:#010x}")]
    HeaderDigest {
        /// CRC32C of the received BHS and AHS.
        computed: u32,
        /// The digest that came with them.
        received: u32,
    },
    /// DataSegmentLength exceeds what this side declared in MaxRecvDataSegmentLength. Checked
    /// before any of the segment is buffered; answered with Reject (protocol error) and a close.
    #[error("data segment of {length} bytes exceeds MaxRecvDataSegmentLength {limit}")]
    DataSegmentTooLong {
        /// The header of the offending PDU.
        header: Box<Bhs>,
        /// DataSegmentLength as received.
        length: u32,
        /// The negotiated limit.
        limit: u32,
    },
    /// The frame was intact but the PDU is malformed: Reject it and go on.
    #[error("{error}")]
    Malformed {
        /// The header of the offending PDU, for the Reject's data segment.
        header: Box<Bhs>,
        /// What was wrong.
        error: PduError,
    },
}

impl DecodeError {
    /// Whether the connection must be closed (after any Reject has been sent).
    pub fn is_fatal(&self) -> bool {
        matches!(
            self,
            DecodeError::HeaderDigest { .. } | DecodeError::DataSegmentTooLong { .. }
        )
    }
}

/// A [`PduError`] from a per-family decoder, its header filled in by the caller.
impl From<PduError> for DecodeError {
    fn from(error: PduError) -> Self {
        DecodeError::Malformed {
            header: Box::new(Bhs([0; crate::bhs::BHS_LEN])),
            error,
        }
    }
}
