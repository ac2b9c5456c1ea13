//! CRC32C header and data digests (RFC 7143 section 13.1, appendix B.4).
//!
//! The digest is the CRC-32/ISCSI (Castagnoli) value of the covered bytes and travels on the wire
//! least significant byte first: 32 zero bytes give `0x8a9136aa`, sent as `aa 36 91 8a`.
//! Computation uses `crc-fast`, which picks the widest CRC/carry-less-multiply instructions the CPU
//! has at run time.

use crc_fast::{CrcAlgorithm, Digest};

/// Which digests are in force on a connection. Both are off during login; they take effect with the
/// first PDU after the final Login Response.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Hash)]
pub struct Digests {
    /// HeaderDigest=CRC32C: a digest follows the BHS and AHS.
    pub header: bool,
    /// DataDigest=CRC32C: a digest follows every non-empty data segment (after its padding).
    pub data: bool,
}

impl Digests {
    /// No digests, as during login.
    pub const NONE: Digests = Digests {
        header: false,
        data: false,
    };
    /// Both digests on.
    pub const BOTH: Digests = Digests {
        header: true,
        data: true,
    };
}

/// CRC32C of one contiguous buffer.
#[inline]
pub fn crc32c(bytes: &[u8]) -> u32 {
    crc_fast::crc32_iscsi(bytes)
}

/// Incremental CRC32C, for a data segment that lives in several slices (a list of buffer slots
/// followed by padding). Holds no heap memory.
#[derive(Clone, Copy, Debug)]
pub struct Crc32c(Digest);

impl Default for Crc32c {
    fn default() -> Self {
        Self::new()
    }
}

impl Crc32c {
    /// A digest over nothing yet.
    #[inline]
    pub fn new() -> Self {
        Crc32c(Digest::new(CrcAlgorithm::Crc32Iscsi))
    }

    /// Adds bytes to the digest.
    #[inline]
    pub fn update(&mut self, bytes: &[u8]) {
        self.0.update(bytes);
    }

    /// The digest of everything added so far.
    #[inline]
    pub fn finish(&self) -> u32 {
        // CRC-32/ISCSI is 32 bits wide; the upper half of the u64 is always zero.
        self.0.finalize() as u32
    }
}

/// The data digest of a segment given as slices, with its padding to a 4-byte boundary included
/// as RFC 7143 requires.
pub fn data_digest<'a>(slices: impl IntoIterator<Item = &'a [u8]>) -> u32 {
    let mut crc = Crc32c::new();
    let mut len = 0usize;
    for s in slices {
        crc.update(s);
        len += s.len();
    }
    crc.update(crate::padding(len));
    crc.finish()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// RFC 7143 appendix B.4 (the same vectors as RFC 3720 B.4).
    #[test]
    fn rfc7143_appendix_b4_vectors() {
        assert_eq!(crc32c(&[0u8; 32]).to_le_bytes(), [0xaa, 0x36, 0x91, 0x8a]);
        assert_eq!(
            crc32c(&[0xffu8; 32]).to_le_bytes(),
            [0x43, 0xab, 0xa8, 0x62]
        );
        let inc: Vec<u8> = (0u8..32).collect();
        assert_eq!(crc32c(&inc).to_le_bytes(), [0x4e, 0x79, 0xdd, 0x46]);
        let dec: Vec<u8> = (0u8..32).rev().collect();
        assert_eq!(crc32c(&dec).to_le_bytes(), [0x5c, 0xdb, 0x3f, 0x11]);
        // An iSCSI Read (10) command PDU, 48 bytes.
        let read10: [u8; 48] = [
            0x01, 0xc0, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00,
            0x00, 0x00, 0x14, 0x00, 0x00, 0x00, 0x00, 0x00, 0x04, 0x00, 0x00, 0x00, 0x00, 0x14,
            0x00, 0x00, 0x00, 0x18, 0x28, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x02, 0x00,
            0x00, 0x00, 0x00, 0x00, 0x00, 0x00,
        ];
        assert_eq!(crc32c(&read10).to_le_bytes(), [0x56, 0x3a, 0x96, 0xd9]);
    }

    #[test]
    fn check_value_and_incremental_agree() {
        assert_eq!(crc32c(b"123456789"), 0xe306_9283);
        let data: Vec<u8> = (0..10_000u32).map(|i| (i * 7 + 3) as u8).collect();
        let mut inc = Crc32c::new();
        for chunk in data.chunks(333) {
            inc.update(chunk);
        }
        assert_eq!(inc.finish(), crc32c(&data));
    }

    #[test]
    fn data_digest_covers_padding() {
        let seg = [1u8, 2, 3, 4, 5];
        let mut padded = seg.to_vec();
        padded.extend_from_slice(&[0, 0, 0]);
        assert_eq!(data_digest([&seg[..2], &seg[2..]]), crc32c(&padded));
    }
}
