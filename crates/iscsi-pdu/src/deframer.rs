//! A streaming deframer: fed bytes with arbitrary split points, it yields whole PDUs and says how
//! many more bytes the next one needs. DataSegmentLength is checked against the negotiated
//! MaxRecvDataSegmentLength as soon as a BHS is complete, before any of the segment is buffered.
//!
//! It has two modes, one set of checks:
//! - whole PDUs ([`Deframer::next_pdu`]): every segment is buffered and handed out as a slice
//!   of the receive buffer;
//! - header first ([`Deframer::next_header`]): a PDU whose payload the receiver wants to place
//!   itself (a SCSI Command's immediate data or a Data-Out, bound for a task's registered
//!   buffer) comes out as its header alone ([`Received::Header`]); the receiver copies the
//!   payload out of the buffer with [`Deframer::payload`], reads the rest straight into its
//!   destination (reporting it with [`Deframer::payload_direct`]), and
//!   [`Deframer::end_payload`] checks the padding and data digest. Or it drops the payload with
//!   [`Deframer::discard_payload`]. Other PDUs come out whole ([`Received::Pdu`]). This mode
//!   never splits the receive buffer, so the buffer is reused and receiving allocates only for
//!   the data segments of control PDUs.

use bytes::{Buf, Bytes, BytesMut};

use crate::bhs::{check_data_digest, check_header, frame, padding, Bhs, Opcode, BHS_LEN};
use crate::digest::{Crc32c, Digests};
use crate::error::{DecodeError, PduError};
use crate::pdu::Pdu;

/// What [`Deframer::next_header`] yields.
#[derive(Debug)]
pub enum Received {
    /// A whole PDU, its data segment (if any) copied out and its digest checked.
    Pdu(Pdu),
    /// A header whose `len` bytes of payload follow: `pdu` is decoded as if it had no data
    /// segment, and the payload is the caller's to place or discard.
    Header {
        /// The PDU, with an empty data segment.
        pdu: Pdu,
        /// The header as received (for a Reject).
        header: Bhs,
        /// The payload's length (DataSegmentLength).
        len: u32,
    },
}

/// A payload being received in header-first mode.
#[derive(Debug)]
struct Payload {
    header: Bhs,
    /// Payload bytes not yet taken.
    left: usize,
    /// Padding and data digest after the payload.
    tail: usize,
    /// CRC32C so far, when data digests are on.
    crc: Option<Crc32c>,
    /// Dropped as it arrives.
    discard: bool,
}

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
    /// Header-first mode: the payload after the last header.
    payload: Option<Payload>,
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
            payload: None,
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

    /// The bytes taken in and not yet made into PDUs, when the deframer is between PDUs (no
    /// header-first payload pending); `None` in the middle of one. A connection handed to
    /// another process ([`crate::handover`]) carries them, for that process's deframer to
    /// [`feed`](Self::feed) before anything read from the socket.
    pub fn unread(&self) -> Option<&[u8]> {
        self.payload.is_none().then_some(&self.buf[..])
    }

    /// Bytes buffered and not yet yielded.
    pub fn buffered(&self) -> usize {
        self.buf.len()
    }

    /// How many more bytes the next PDU needs before [`Deframer::next_pdu`] can yield it: the
    /// rest of the BHS while it is incomplete, then the rest of the whole frame. 0 when a PDU is
    /// ready (or a header is ready to be refused).
    pub fn needed(&self) -> usize {
        if let Some(p) = &self.payload {
            // Until the payload and its padding and digest are in (what the caller reads past
            // the buffer with payload_direct counts as in).
            return (p.left + p.tail).saturating_sub(self.buf.len());
        }
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

    /// Header-first mode: the next PDU, as a header whose payload follows when `direct` says
    /// its opcode's payload is placed by the caller, else whole. `Ok(None)` when more bytes
    /// are needed ([`Deframer::needed`]). A payload left from the last header must have been
    /// taken or discarded; a discarded one is dropped here as its bytes arrive.
    ///
    /// Errors as [`Deframer::next_pdu`]'s: a malformed header whose payload follows is reported
    /// with the payload set to be discarded, so the stream goes on after the Reject.
    pub fn next_header(
        &mut self,
        direct: impl Fn(Opcode) -> bool,
    ) -> Result<Option<Received>, DecodeError> {
        if let Some(p) = &mut self.payload {
            if !p.discard {
                return Err(DecodeError::Malformed {
                    header: Box::new(p.header),
                    error: PduError::InvalidField {
                        field: "DataSegmentLength",
                        reason: "the previous payload was not taken",
                    },
                });
            }
            let n = p.left.min(self.buf.len());
            p.left -= n;
            self.buf.advance(n);
            if p.left > 0 || self.buf.len() < p.tail {
                return Ok(None);
            }
            self.buf.advance(p.tail);
            self.payload = None;
        }
        let Some(bhs) = self.buf.first_chunk::<BHS_LEN>() else {
            self.frame_len = Some(BHS_LEN);
            return Ok(None);
        };
        let header = Bhs(*bhs);
        let len = header.data_segment_length();
        let max = self.max_recv_data_segment_length;
        if len > 0 && header.opcode().is_some_and(&direct) {
            let header_len = match check_header(&self.buf, self.digests, max) {
                Ok((_, n)) => n,
                Err(DecodeError::Incomplete { needed }) => {
                    self.frame_len = Some(self.buf.len() + needed);
                    return Ok(None);
                }
                Err(e) => return Err(e),
            };
            let ahs = self.ahs(&header);
            self.buf.advance(header_len);
            self.frame_len = None;
            let mut bare = header;
            bare.0[5..8].fill(0);
            let decoded = Pdu::from_header_and_data(&bare, ahs, Bytes::new());
            let digest = if self.digests.data { 4 } else { 0 };
            self.payload = Some(Payload {
                header,
                left: len as usize,
                tail: padding(len as usize).len() + digest,
                crc: self.digests.data.then(Crc32c::new),
                discard: decoded.is_err(),
            });
            let pdu = decoded.map_err(|e| match e {
                DecodeError::Malformed { error, .. } => DecodeError::Malformed {
                    header: Box::new(header),
                    error,
                },
                e => e,
            })?;
            return Ok(Some(Received::Header { pdu, header, len }));
        }
        let fr = match frame(&self.buf, self.digests, max) {
            Ok(fr) => fr,
            Err(DecodeError::Incomplete { needed }) => {
                self.frame_len = Some(self.buf.len() + needed);
                self.buf.reserve(needed);
                return Ok(None);
            }
            Err(e) => return Err(e),
        };
        self.frame_len = None;
        if let Err(error) = check_data_digest(&self.buf, &fr) {
            self.buf.advance(fr.len);
            return Err(DecodeError::Malformed {
                header: Box::new(header),
                error,
            });
        }
        let ahs = self.ahs(&header);
        let data = match len {
            0 => Bytes::new(),
            _ => Bytes::copy_from_slice(&self.buf[fr.data]),
        };
        self.buf.advance(fr.len);
        Pdu::from_header_and_data(&header, ahs, data).map(|p| Some(Received::Pdu(p)))
    }

    /// A copy of the buffered header's AHS (none for nearly every PDU, so no allocation).
    fn ahs(&self, header: &Bhs) -> Bytes {
        match header.total_ahs_length() {
            0 => Bytes::new(),
            n => Bytes::copy_from_slice(&self.buf[BHS_LEN..BHS_LEN + n]),
        }
    }

    /// Payload bytes of the last [`Received::Header`] not yet taken.
    pub fn payload_left(&self) -> usize {
        self.payload.as_ref().map_or(0, |p| p.left)
    }

    /// Copies the payload's buffered bytes into `dst` (from where the last call stopped) and
    /// returns how many; the rest comes straight from the transport
    /// ([`Deframer::payload_direct`]).
    pub fn payload(&mut self, dst: &mut [u8]) -> usize {
        let Some(p) = &mut self.payload else {
            return 0;
        };
        let n = dst.len().min(p.left).min(self.buf.len());
        dst[..n].copy_from_slice(&self.buf[..n]);
        if let Some(crc) = &mut p.crc {
            crc.update(&dst[..n]);
        }
        p.left -= n;
        self.buf.advance(n);
        n
    }

    /// The caller received these payload bytes itself, past the buffer (at most
    /// [`Deframer::payload_left`]; any more are not counted).
    pub fn payload_direct(&mut self, bytes: &[u8]) {
        if let Some(p) = &mut self.payload {
            let n = bytes.len().min(p.left);
            if let Some(crc) = &mut p.crc {
                crc.update(&bytes[..n]);
            }
            p.left -= n;
        }
    }

    /// Once the payload has been taken: checks its padding and data digest when they are
    /// buffered (`Ok(None)` until then). A digest mismatch is [`DecodeError::Malformed`] with
    /// [`PduError::DataDigest`]: the payload is consumed, answer with a Reject.
    pub fn end_payload(&mut self) -> Result<Option<()>, DecodeError> {
        let Some(p) = &mut self.payload else {
            return Ok(Some(()));
        };
        if p.left > 0 || self.buf.len() < p.tail {
            return Ok(None);
        }
        let pad = p.tail - if p.crc.is_some() { 4 } else { 0 };
        let result = match &mut p.crc {
            Some(crc) => {
                crc.update(&self.buf[..pad]);
                let received =
                    u32::from_le_bytes(self.buf[pad..pad + 4].try_into().expect("4 bytes"));
                let computed = crc.finish();
                if computed == received {
                    Ok(Some(()))
                } else {
                    Err(DecodeError::Malformed {
                        header: Box::new(p.header),
                        error: PduError::DataDigest { computed, received },
                    })
                }
            }
            None => Ok(Some(())),
        };
        self.buf.advance(p.tail);
        self.payload = None;
        result
    }

    /// Drops the rest of the payload as it arrives (the next [`Deframer::next_header`] skips
    /// it).
    pub fn discard_payload(&mut self) {
        if let Some(p) = &mut self.payload {
            p.discard = true;
        }
    }
}
