//! The Basic Header Segment and the framing of a whole PDU (RFC 7143 section 11.2):
//! BHS (48) | AHS (4 * TotalAHSLength) | HeaderDigest (4) | DataSegment | pad to 4 | DataDigest (4).

use core::fmt;
use core::ops::Range;

use crate::digest::{crc32c, Digests};
use crate::error::{DecodeError, PduError};

/// Length of the Basic Header Segment.
pub const BHS_LEN: usize = 48;
/// The longest AHS a BHS can announce (TotalAHSLength is one byte of 4-byte words).
pub const MAX_AHS_LEN: usize = 255 * 4;
/// The largest DataSegmentLength the 24-bit field can carry; also the RFC's upper bound for
/// MaxRecvDataSegmentLength.
pub const MAX_DATA_SEGMENT_LENGTH: u32 = (1 << 24) - 1;
/// The longest header this crate encodes or decodes: BHS, the largest AHS and a header digest.
pub const MAX_HEADER_LEN: usize = BHS_LEN + MAX_AHS_LEN + 4;

/// iSCSI opcodes (RFC 7143 section 11.2.1.2).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum Opcode {
    /// Initiator: NOP-Out.
    NopOut = 0x00,
    /// Initiator: SCSI Command.
    ScsiCommand = 0x01,
    /// Initiator: SCSI Task Management Function Request.
    TaskManagementRequest = 0x02,
    /// Initiator: Login Request.
    LoginRequest = 0x03,
    /// Initiator: Text Request.
    TextRequest = 0x04,
    /// Initiator: SCSI Data-Out.
    DataOut = 0x05,
    /// Initiator: Logout Request.
    LogoutRequest = 0x06,
    /// Initiator: SNACK Request.
    SnackRequest = 0x10,
    /// Target: NOP-In.
    NopIn = 0x20,
    /// Target: SCSI Response.
    ScsiResponse = 0x21,
    /// Target: SCSI Task Management Function Response.
    TaskManagementResponse = 0x22,
    /// Target: Login Response.
    LoginResponse = 0x23,
    /// Target: Text Response.
    TextResponse = 0x24,
    /// Target: SCSI Data-In.
    DataIn = 0x25,
    /// Target: Logout Response.
    LogoutResponse = 0x26,
    /// Target: Ready To Transfer (R2T).
    ReadyToTransfer = 0x31,
    /// Target: Asynchronous Message.
    AsyncMessage = 0x32,
    /// Target: Reject.
    Reject = 0x3f,
}

impl Opcode {
    /// The opcode for the 6-bit field, or `None` for reserved and vendor-specific values.
    pub fn from_u8(v: u8) -> Option<Opcode> {
        use Opcode::*;
        Some(match v {
            0x00 => NopOut,
            0x01 => ScsiCommand,
            0x02 => TaskManagementRequest,
            0x03 => LoginRequest,
            0x04 => TextRequest,
            0x05 => DataOut,
            0x06 => LogoutRequest,
            0x10 => SnackRequest,
            0x20 => NopIn,
            0x21 => ScsiResponse,
            0x22 => TaskManagementResponse,
            0x23 => LoginResponse,
            0x24 => TextResponse,
            0x25 => DataIn,
            0x26 => LogoutResponse,
            0x31 => ReadyToTransfer,
            0x32 => AsyncMessage,
            0x3f => Reject,
            _ => return None,
        })
    }

    /// Whether the initiator sends this opcode (the target sends the others).
    pub fn is_initiator(self) -> bool {
        (self as u8) < 0x20
    }
}

/// A raw 48-byte Basic Header Segment.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct Bhs(pub [u8; BHS_LEN]);

impl Bhs {
    /// The 6-bit opcode field.
    pub fn opcode_byte(&self) -> u8 {
        self.0[0] & 0x3f
    }

    /// The opcode, if defined.
    pub fn opcode(&self) -> Option<Opcode> {
        Opcode::from_u8(self.opcode_byte())
    }

    /// The I (immediate delivery) bit.
    pub fn immediate(&self) -> bool {
        self.0[0] & 0x40 != 0
    }

    /// The F (final) bit, bit 7 of byte 1, for the PDUs that have one.
    pub fn final_bit(&self) -> bool {
        self.0[1] & 0x80 != 0
    }

    /// TotalAHSLength in bytes.
    pub fn total_ahs_length(&self) -> usize {
        usize::from(self.0[4]) * 4
    }

    /// DataSegmentLength in bytes, without padding.
    pub fn data_segment_length(&self) -> u32 {
        u32::from_be_bytes([0, self.0[5], self.0[6], self.0[7]])
    }

    /// The Initiator Task Tag (bytes 16..20).
    pub fn initiator_task_tag(&self) -> u32 {
        u32::from_be_bytes([self.0[16], self.0[17], self.0[18], self.0[19]])
    }

    /// The CmdSN a request takes in its session's order: that of a non-immediate NOP-Out,
    /// SCSI Command, Task Management, Text or Logout Request (bytes 24..28); `None` for an
    /// immediate request and for every other PDU, which take none.
    pub fn taken_cmd_sn(&self) -> Option<crate::SerialNumber> {
        use Opcode::*;
        let takes = matches!(
            self.opcode(),
            Some(NopOut | ScsiCommand | TaskManagementRequest | TextRequest | LogoutRequest)
        );
        (takes && !self.immediate()).then(|| {
            crate::SerialNumber(u32::from_be_bytes([
                self.0[24], self.0[25], self.0[26], self.0[27],
            ]))
        })
    }

    /// The length of the whole PDU this header announces, with the given digests.
    pub fn frame_length(&self, digests: Digests) -> usize {
        frame_length(self.0[4], self.data_segment_length(), digests)
    }
}

impl fmt::Debug for Bhs {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "Bhs(opcode {:#04x}, itt {:#010x})",
            self.opcode_byte(),
            self.initiator_task_tag()
        )
    }
}

/// The length of a whole PDU from its TotalAHSLength (in words) and DataSegmentLength.
#[inline]
fn frame_length(ahs_words: u8, dsl: u32, digests: Digests) -> usize {
    let dsl = dsl as usize;
    // Padding to a 4-byte boundary is (-dsl) mod 4.
    let mut n = BHS_LEN + usize::from(ahs_words) * 4 + dsl + (dsl.wrapping_neg() & 3);
    if digests.header {
        n += 4;
    }
    if digests.data && dsl > 0 {
        n += 4;
    }
    n
}

/// The zero bytes that pad a segment of `len` bytes to a 4-byte boundary.
#[inline]
pub fn padding(len: usize) -> &'static [u8] {
    const ZEROS: [u8; 3] = [0; 3];
    &ZEROS[..(4 - len % 4) % 4]
}

/// The BHS as fields: bytes 0..4, the eight bytes at 8..16 (LUN or opcode specific), and the
/// seven 32-bit words from byte 16 on (ITT first). TotalAHSLength and DataSegmentLength belong to
/// the frame and are filled in by the encoder.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Fields {
    pub b: [u8; 4],
    pub lun: [u8; 8],
    pub w: [u32; 8],
}

impl Fields {
    /// Writes the fields, with the frame's TotalAHSLength and DataSegmentLength.
    pub fn write(&self, ahs_len: usize, data_len: u32, out: &mut [u8; BHS_LEN]) {
        out[..4].copy_from_slice(&self.b);
        out[4] = (ahs_len / 4) as u8;
        out[5..8].copy_from_slice(&data_len.to_be_bytes()[1..]);
        out[8..16].copy_from_slice(&self.lun);
        for (i, w) in self.w.iter().enumerate() {
            out[16 + 4 * i..20 + 4 * i].copy_from_slice(&w.to_be_bytes());
        }
    }
}

/// A received BHS seen as fields, for the per-family decoders: each accessor is one load at a
/// constant offset, so decoding writes the PDU's fields straight from the header bytes.
#[derive(Clone, Copy)]
pub(crate) struct View<'a>(pub &'a [u8; BHS_LEN]);

impl View<'_> {
    /// Byte `i` (0..4 are the opcode byte, the flags and two opcode-specific bytes).
    #[inline(always)]
    pub fn b(&self, i: usize) -> u8 {
        self.0[i]
    }

    /// Bytes 8..16 (LUN, or ISID and TSIH).
    #[inline(always)]
    pub fn lun(&self) -> [u8; 8] {
        *self.0[8..16].first_chunk().expect("8 bytes")
    }

    /// Word `i` of the seven 32-bit words from byte 16 on (ITT first).
    #[inline(always)]
    pub fn w(&self, i: usize) -> u32 {
        u32::from_be_bytes(
            *self.0[16 + 4 * i..20 + 4 * i]
                .first_chunk()
                .expect("4 bytes"),
        )
    }

    /// A 16-bit half of word `i`: the upper half when `high`.
    #[inline(always)]
    pub fn half(&self, i: usize, high: bool) -> u16 {
        let w = self.w(i);
        if high {
            (w >> 16) as u16
        } else {
            w as u16
        }
    }

    /// Bytes `N` bytes from `at`.
    #[inline(always)]
    pub fn bytes<const N: usize>(&self, at: usize) -> [u8; N] {
        *self.0[at..at + N].first_chunk().expect("in the BHS")
    }
}

/// Where the parts of one framed PDU lie in its input.
#[derive(Debug, Clone)]
pub(crate) struct Frame {
    pub ahs: Range<usize>,
    pub data: Range<usize>,
    pub data_digest: Option<u32>,
    pub len: usize,
}

/// Checks a PDU's header at the start of `input`: DataSegmentLength within `max_data` as soon
/// as the BHS is there, then the header digest once BHS, AHS and digest are. Returns the BHS
/// and the header's length (BHS, AHS, digest). Both framing modes start here, so a header is
/// judged the same way whichever way its segment is received.
pub(crate) fn check_header(
    input: &[u8],
    digests: Digests,
    max_data: u32,
) -> Result<(&[u8; BHS_LEN], usize), DecodeError> {
    let Some(bhs) = input.first_chunk::<BHS_LEN>() else {
        return Err(DecodeError::Incomplete {
            needed: BHS_LEN - input.len(),
        });
    };
    let dsl = u32::from_be_bytes([0, bhs[5], bhs[6], bhs[7]]);
    if dsl > max_data {
        return Err(DecodeError::DataSegmentTooLong {
            header: Box::new(Bhs(*bhs)),
            length: dsl,
            limit: max_data,
        });
    }
    let ahs_end = BHS_LEN + usize::from(bhs[4]) * 4;
    let header_len = ahs_end + if digests.header { 4 } else { 0 };
    if input.len() < header_len {
        return Err(DecodeError::Incomplete {
            needed: header_len - input.len(),
        });
    }
    if digests.header {
        let at = ahs_end;
        let received = u32::from_le_bytes(input[at..at + 4].try_into().expect("4 bytes"));
        let computed = crc32c(&input[..at]);
        if computed != received {
            return Err(DecodeError::HeaderDigest { computed, received });
        }
    }
    Ok((bhs, header_len))
}

/// Checks a framed PDU's data digest, over the data segment and its padding as received (RFC
/// 7143 includes the padding in the digest).
pub(crate) fn check_data_digest(input: &[u8], fr: &Frame) -> Result<(), PduError> {
    if let Some(received) = fr.data_digest {
        let padded_end = fr.data.end + padding(fr.data.len()).len();
        let computed = crc32c(&input[fr.data.start..padded_end]);
        if computed != received {
            return Err(PduError::DataDigest { computed, received });
        }
    }
    Ok(())
}

/// Frames one PDU: BHS, AHS, header digest, data, padding, data digest. The layout is fixed
/// once the BHS is in, so this is arithmetic on its two length fields; the header is checked by
/// [`check_header`] before the segment has to be present.
#[inline]
pub(crate) fn frame(input: &[u8], digests: Digests, max_data: u32) -> Result<Frame, DecodeError> {
    let (bhs, at) = match check_header(input, digests, max_data) {
        Ok(h) => h,
        // Once the BHS is in, the whole frame's length is known: ask for all of it.
        Err(DecodeError::Incomplete { needed }) => {
            let needed = match input.first_chunk::<BHS_LEN>() {
                Some(b) => Bhs(*b).frame_length(digests) - input.len(),
                None => needed,
            };
            return Err(DecodeError::Incomplete { needed });
        }
        Err(e) => return Err(e),
    };
    let dsl = u32::from_be_bytes([0, bhs[5], bhs[6], bhs[7]]);
    let len = frame_length(bhs[4], dsl, digests);
    if input.len() < len {
        return Err(DecodeError::Incomplete {
            needed: len - input.len(),
        });
    }
    let ahs = BHS_LEN..BHS_LEN + usize::from(bhs[4]) * 4;
    let data = at..at + dsl as usize;
    let data_digest = (digests.data && dsl > 0).then(|| {
        let d = len - 4;
        u32::from_le_bytes(input[d..len].try_into().expect("4 bytes"))
    });
    Ok(Frame {
        ahs,
        data,
        data_digest,
        len,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::SerialNumber;

    /// A header of `opcode` (with the I bit when `immediate`) whose bytes 24..28 hold
    /// 0x01020304.
    fn header(opcode: Opcode, immediate: bool) -> Bhs {
        let mut b = [0u8; BHS_LEN];
        b[0] = opcode as u8 | if immediate { 0x40 } else { 0 };
        b[24..28].copy_from_slice(&[1, 2, 3, 4]);
        Bhs(b)
    }

    /// Only a non-immediate request takes a CmdSN; a Data-Out, a SNACK, an immediate request
    /// or a target's PDU none.
    #[test]
    fn the_cmd_sn_a_header_takes() {
        use Opcode::*;
        for op in [
            NopOut,
            ScsiCommand,
            TaskManagementRequest,
            TextRequest,
            LogoutRequest,
        ] {
            let sn = Some(SerialNumber(0x0102_0304));
            assert_eq!(header(op, false).taken_cmd_sn(), sn, "{op:?}");
            assert_eq!(header(op, true).taken_cmd_sn(), None, "{op:?} immediate");
        }
        for op in [
            DataOut,
            SnackRequest,
            LoginRequest,
            ScsiResponse,
            NopIn,
            DataIn,
        ] {
            assert_eq!(header(op, false).taken_cmd_sn(), None, "{op:?}");
        }
    }
}
