//! The completion queue entry: the 16 bytes that end a command (NVMe Base Specification 2.0,
//! "Common Completion Queue Entry").

use crate::status::Status;

/// A completion queue entry.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Cqe {
    /// Dword 0, command specific (Connect: the controller ID; Get Features: the value).
    pub dw0: u32,
    /// Dword 1, command specific.
    pub dw1: u32,
    /// SQ Head Pointer.
    pub sqhd: u16,
    /// SQ Identifier.
    pub sqid: u16,
    /// The command's CID.
    pub cid: u16,
    /// How it ended.
    pub status: Status,
}

impl Cqe {
    /// Its length.
    pub const LEN: usize = 16;

    /// Command `cid` ended with `status`, nothing else to say.
    pub fn new(cid: u16, status: Status) -> Cqe {
        Cqe {
            dw0: 0,
            dw1: 0,
            sqhd: 0,
            sqid: 0,
            cid,
            status,
        }
    }

    /// Its bytes (phase tag clear: a fabric has no completion queue in memory to phase).
    pub fn to_bytes(&self) -> [u8; Cqe::LEN] {
        let mut b = [0u8; Cqe::LEN];
        b[..4].copy_from_slice(&self.dw0.to_le_bytes());
        b[4..8].copy_from_slice(&self.dw1.to_le_bytes());
        b[8..10].copy_from_slice(&self.sqhd.to_le_bytes());
        b[10..12].copy_from_slice(&self.sqid.to_le_bytes());
        b[12..14].copy_from_slice(&self.cid.to_le_bytes());
        b[14..16].copy_from_slice(&self.status.to_field(false).to_le_bytes());
        b
    }

    /// From the first 16 of `bytes`; `None` when there are fewer.
    pub fn parse(bytes: &[u8]) -> Option<Cqe> {
        let b = bytes.get(..Cqe::LEN)?;
        let u16_at = |i: usize| u16::from_le_bytes([b[i], b[i + 1]]);
        let u32_at = |i: usize| u32::from_le_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]]);
        Some(Cqe {
            dw0: u32_at(0),
            dw1: u32_at(4),
            sqhd: u16_at(8),
            sqid: u16_at(10),
            cid: u16_at(12),
            status: Status::from_field(u16_at(14)),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_cqe_reads_back() {
        let c = Cqe {
            dw0: 0x0001_0002,
            dw1: 3,
            sqhd: 4,
            sqid: 5,
            cid: 0xbeef,
            status: Status::RESERVATION_CONFLICT,
        };
        let b = c.to_bytes();
        assert_eq!(&b[12..16], &[0xef, 0xbe, 0x06, 0x81]);
        assert_eq!(Cqe::parse(&b), Some(c));
        assert_eq!(Cqe::parse(&b[..15]), None);
    }
}
