//! A streaming deframer: fed bytes with arbitrary split points, it yields whole PDUs and says how
//! many more bytes the next one needs. DataSegmentLength is checked against the negotiated
//! MaxRecvDataSegmentLength as soon as a BHS is complete, before any of the segment is buffered.

use bytes::{Bytes, BytesMut};

use crate::bhs::{Bhs, BHS_LEN};
use crate::digest::Digests;
use crate::error::DecodeError;
use crate::pdu::Pdu;

/// MaxRecvDataSegmentLength in force during login (RFC 7143 section 13.12: 8192 until the
/// declarations take effect after the login phase).
pub const LOGIN_MAX_RECV_DATA_SEGMENT_LENGTH: u32 = 8192;

/// Incremental PDU deframer for one connection.
#[derive(Debug)]
pub struct Deframer {
    buf: BytesMut,
    digests: Digests,
    max_recv_data_segment_length: u32,
    /// Total length of the PDU whose BHS is buffered, once known.
    frame_len: Option<usize>,
}

impl Default for Deframer {
    fn default() -> Self {
        Self::new()
    }
}

impl Deframer {
    /// A deframer in the login state: no digests, 8192-byte segments.
    pub fn new() -> Self {
        Deframer {
            buf: BytesMut::with_capacity(BHS_LEN * 2),
            digests: Digests::NONE,
            max_recv_data_segment_length: LOGIN_MAX_RECV_DATA_SEGMENT_LENGTH,
            frame_len: None,
        }
    }

    /// Switches digests on or off (after the final Login Response).
    pub fn set_digests(&mut self, digests: Digests) {
        self.digests = digests;
        self.frame_len = None;
    }

    /// Sets the MaxRecvDataSegmentLength this side declared (after the login phase).
    pub fn set_max_recv_data_segment_length(&mut self, len: u32) {
        self.max_recv_data_segment_length = len;
        self.frame_len = None;
    }

    /// The digests in force.
    pub fn digests(&self) -> Digests {
        self.digests
    }

    /// Appends received bytes.
    pub fn feed(&mut self, bytes: &[u8]) {
        self.buf.extend_from_slice(bytes);
    }

    /// The receive buffer, for a transport that reads straight into it (`read_buf`).
    /// Reserve with [`Deframer::needed`] first so a read never allocates beyond the next PDU.
    pub fn buffer_mut(&mut self) -> &mut BytesMut {
        &mut self.buf
    }

    /// Bytes buffered and not yet yielded.
    pub fn buffered(&self) -> usize {
        self.buf.len()
    }

    /// How many more bytes the next PDU needs before [`Deframer::next_pdu`] can yield it: the
    /// rest of the BHS while it is incomplete, then the rest of the whole frame. 0 when a PDU is
    /// ready (or a header is ready to be refused).
    pub fn needed(&self) -> usize {
        match self.frame_len {
            Some(n) => n.saturating_sub(self.buf.len()),
            None if self.buf.len() < BHS_LEN => BHS_LEN - self.buf.len(),
            None => 0,
        }
    }

    /// The next whole PDU, `Ok(None)` if more bytes are needed. After an error that is not
    /// [`DecodeError::is_fatal`] the bad PDU has been consumed and the stream goes on; after a
    /// fatal one the connection must be closed.
    pub fn next_pdu(&mut self) -> Result<Option<Pdu>, DecodeError> {
        let len = match self.frame_len {
            Some(n) => n,
            None => {
                if self.buf.len() < BHS_LEN {
                    return Ok(None);
                }
                let mut b = [0u8; BHS_LEN];
                b.copy_from_slice(&self.buf[..BHS_LEN]);
                let header = Bhs(b);
                let dsl = header.data_segment_length();
                if dsl > self.max_recv_data_segment_length {
                    return Err(DecodeError::DataSegmentTooLong {
                        header: Box::new(header),
                        length: dsl,
                        limit: self.max_recv_data_segment_length,
                    });
                }
                let n = header.frame_length(self.digests);
                self.frame_len = Some(n);
                n
            }
        };
        if self.buf.len() < len {
            self.buf.reserve(len - self.buf.len());
            return Ok(None);
        }
        self.frame_len = None;
        let mut frame: Bytes = self.buf.split_to(len).freeze();
        Pdu::decode(&mut frame, self.digests, self.max_recv_data_segment_length).map(Some)
    }
}
