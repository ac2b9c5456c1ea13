//! The submission queue entry: the 64 bytes of one command (NVMe Base Specification 2.0,
//! "Common Command Format"), read and written in place through accessors, so a command
//! taken from a receive buffer is never reshaped into another structure.

/// Fused operation (FUSE, CDW0 bits 9:8).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fuse {
    /// A command on its own.
    Normal,
    /// The first of two fused commands (Compare of Compare and Write).
    First,
    /// The second (Write of Compare and Write).
    Second,
    /// 11b: reserved.
    Reserved,
}

/// A submission queue entry.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct Sqe {
    bytes: [u8; Sqe::LEN],
}

impl std::fmt::Debug for Sqe {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Sqe")
            .field("opcode", &format_args!("{:#04x}", self.opcode()))
            .field("cid", &self.cid())
            .field("nsid", &self.nsid())
            .field("sgl", &self.sgl())
            .field(
                "cdw10_15",
                &[10, 11, 12, 13, 14, 15].map(|n| format!("{:#x}", self.cdw(n))),
            )
            .finish()
    }
}

impl Sqe {
    /// Its length.
    pub const LEN: usize = 64;

    /// A command with `opcode` and command identifier `cid`, every other field zero.
    pub fn new(opcode: u8, cid: u16) -> Sqe {
        let mut s = Sqe {
            bytes: [0; Sqe::LEN],
        };
        s.bytes[0] = opcode;
        s.set_cid(cid);
        s
    }

    /// The command in `bytes`, the first 64 of them; `None` when there are fewer.
    pub fn parse(bytes: &[u8]) -> Option<Sqe> {
        Some(Sqe {
            bytes: bytes.get(..Sqe::LEN)?.try_into().ok()?,
        })
    }

    /// Its bytes, as the wire carries them.
    pub fn as_bytes(&self) -> &[u8; Sqe::LEN] {
        &self.bytes
    }

    /// OPC.
    pub fn opcode(&self) -> u8 {
        self.bytes[0]
    }

    /// FUSE.
    pub fn fuse(&self) -> Fuse {
        match self.bytes[1] & 3 {
            0 => Fuse::Normal,
            1 => Fuse::First,
            2 => Fuse::Second,
            _ => Fuse::Reserved,
        }
    }

    /// Sets FUSE.
    pub fn set_fuse(&mut self, fuse: Fuse) {
        let bits = match fuse {
            Fuse::Normal => 0,
            Fuse::First => 1,
            Fuse::Second => 2,
            Fuse::Reserved => 3,
        };
        self.bytes[1] = self.bytes[1] & !3 | bits;
    }

    /// PSDT (CDW0 bits 15:14): 00b PRPs, 01b SGLs with a contiguous metadata buffer, 10b
    /// SGLs with an SGL for metadata. A fabric carries SGLs only.
    pub fn psdt(&self) -> u8 {
        self.bytes[1] >> 6
    }

    /// Sets PSDT.
    pub fn set_psdt(&mut self, psdt: u8) {
        self.bytes[1] = self.bytes[1] & 0x3f | (psdt & 3) << 6;
    }

    /// Bits of CDW0's byte 1 that are reserved (5:2).
    pub fn reserved_flags(&self) -> u8 {
        self.bytes[1] & 0x3c
    }

    /// CID: the command identifier the completion carries back.
    pub fn cid(&self) -> u16 {
        u16::from_le_bytes([self.bytes[2], self.bytes[3]])
    }

    /// Sets CID.
    pub fn set_cid(&mut self, cid: u16) {
        self.bytes[2..4].copy_from_slice(&cid.to_le_bytes());
    }

    /// NSID (for a fabrics command, byte 4 is FCTYPE instead).
    pub fn nsid(&self) -> u32 {
        self.cdw(1)
    }

    /// Sets NSID.
    pub fn set_nsid(&mut self, nsid: u32) {
        self.set_cdw(1, nsid);
    }

    /// FCTYPE: a fabrics command's type ([`crate::opcode::FabricsType`]).
    pub fn fctype(&self) -> u8 {
        self.bytes[4]
    }

    /// Sets FCTYPE.
    pub fn set_fctype(&mut self, fctype: u8) {
        self.bytes[4] = fctype;
    }

    /// Command dword `n` (0 to 15), little-endian at byte `4 * n`.
    pub fn cdw(&self, n: usize) -> u32 {
        let at = 4 * (n & 15);
        u32::from_le_bytes(self.bytes[at..at + 4].try_into().unwrap_or_default())
    }

    /// Sets command dword `n` (0 to 15).
    pub fn set_cdw(&mut self, n: usize, value: u32) {
        let at = 4 * (n & 15);
        self.bytes[at..at + 4].copy_from_slice(&value.to_le_bytes());
    }

    /// The 64-bit value of dwords `n` and `n + 1` (an SLBA in CDW10-11, a reservation key).
    pub fn qword(&self, n: usize) -> u64 {
        u64::from(self.cdw(n)) | u64::from(self.cdw(n + 1)) << 32
    }

    /// Sets dwords `n` and `n + 1` to `value`.
    pub fn set_qword(&mut self, n: usize, value: u64) {
        self.set_cdw(n, value as u32);
        self.set_cdw(n + 1, (value >> 32) as u32);
    }

    /// DPTR as the SGL descriptor a fabric carries there (SGL1).
    pub fn sgl(&self) -> Sgl {
        let mut b = [0u8; Sgl::LEN];
        b.copy_from_slice(&self.bytes[24..40]);
        Sgl::from_bytes(b)
    }

    /// Sets SGL1.
    pub fn set_sgl(&mut self, sgl: Sgl) {
        self.bytes[24..40].copy_from_slice(&sgl.to_bytes());
    }
}

/// An SGL descriptor (16 bytes), as NVMe over Fabrics puts in SGL1: where a command's data
/// is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Sgl {
    /// Address (an offset into the capsule for in-capsule data; the host's address for a
    /// keyed descriptor).
    pub address: u64,
    /// Bytes 8-14: a length (bytes 8-11) and, for a keyed descriptor, a 24-bit length and a
    /// 32-bit key.
    pub specific: [u8; 7],
    /// SGL Identifier: the descriptor type (bits 7:4) and sub type (3:0).
    pub id: u8,
}

/// What an SGL descriptor says about where the data is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SglKind {
    /// Data Block with sub type Offset (01h): in the command capsule, `offset` bytes after the
    /// SQE (NVMe/TCP's in-capsule data).
    InCapsule {
        /// Offset into the capsule's data.
        offset: u64,
        /// Length.
        length: u32,
    },
    /// Transport SGL Data Block, transport specific (5Ah): moved by the transport (NVMe/TCP:
    /// R2T and H2CData for a write, C2HData for a read).
    Transport {
        /// Length.
        length: u32,
    },
    /// Keyed SGL Data Block (4xh): the host's memory, for RDMA READ or WRITE.
    Keyed {
        /// The host's address.
        address: u64,
        /// Length (24 bits).
        length: u32,
        /// The remote key.
        key: u32,
        /// Sub type (0h address, Fh invalidate the key).
        subtype: u8,
    },
    /// Any other descriptor.
    Other(u8),
}

impl Sgl {
    /// Its length.
    pub const LEN: usize = 16;
    /// SGL Identifier of in-capsule data: Data Block, sub type Offset.
    pub const IN_CAPSULE: u8 = 0x01;
    /// SGL Identifier of data the transport moves: Transport SGL Data Block, sub type
    /// transport specific.
    pub const TRANSPORT: u8 = 0x5a;
    /// SGL Identifier of the host's registered memory: Keyed SGL Data Block, sub type
    /// Address.
    pub const KEYED: u8 = 0x40;

    /// From its 16 bytes.
    pub fn from_bytes(b: [u8; Sgl::LEN]) -> Sgl {
        let mut specific = [0u8; 7];
        specific.copy_from_slice(&b[8..15]);
        Sgl {
            address: u64::from_le_bytes(b[..8].try_into().unwrap_or_default()),
            specific,
            id: b[15],
        }
    }

    /// Its 16 bytes.
    pub fn to_bytes(&self) -> [u8; Sgl::LEN] {
        let mut b = [0u8; Sgl::LEN];
        b[..8].copy_from_slice(&self.address.to_le_bytes());
        b[8..15].copy_from_slice(&self.specific);
        b[15] = self.id;
        b
    }

    /// The length in bytes 8-11 (every unkeyed descriptor).
    pub fn length(&self) -> u32 {
        u32::from_le_bytes(self.specific[..4].try_into().unwrap_or_default())
    }

    fn with_length(id: u8, address: u64, length: u32) -> Sgl {
        let mut specific = [0u8; 7];
        specific[..4].copy_from_slice(&length.to_le_bytes());
        Sgl {
            address,
            specific,
            id,
        }
    }

    /// `length` bytes of in-capsule data at `offset`.
    pub fn in_capsule(offset: u64, length: u32) -> Sgl {
        Sgl::with_length(Sgl::IN_CAPSULE, offset, length)
    }

    /// `length` bytes the transport moves.
    pub fn transport(length: u32) -> Sgl {
        Sgl::with_length(Sgl::TRANSPORT, 0, length)
    }

    /// `length` bytes (at most 2^24 - 1) of the host's memory at `address`, registered with
    /// `key`: a Keyed SGL Data Block, sub type Address (NVMe/RDMA's data outside the capsule).
    pub fn keyed(address: u64, length: u32, key: u32) -> Sgl {
        let mut specific = [0u8; 7];
        specific[..3].copy_from_slice(&length.to_le_bytes()[..3]);
        specific[3..].copy_from_slice(&key.to_le_bytes());
        Sgl {
            address,
            specific,
            id: Sgl::KEYED,
        }
    }

    /// What it describes.
    pub fn kind(&self) -> SglKind {
        match self.id {
            Sgl::IN_CAPSULE => SglKind::InCapsule {
                offset: self.address,
                length: self.length(),
            },
            Sgl::TRANSPORT => SglKind::Transport {
                length: self.length(),
            },
            id if id >> 4 == 4 => SglKind::Keyed {
                address: self.address,
                length: u32::from_le_bytes([
                    self.specific[0],
                    self.specific[1],
                    self.specific[2],
                    0,
                ]),
                key: u32::from_le_bytes(self.specific[3..7].try_into().unwrap_or_default()),
                subtype: id & 0x0f,
            },
            id => SglKind::Other(id),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A Linux host's 4 KiB Read of LBA 8 on namespace 1, data moved by the transport: the
    /// fields where the specification puts them.
    #[test]
    fn fields_sit_where_the_specification_puts_them() {
        let mut s = Sqe::new(0x02, 0x1234);
        s.set_psdt(1);
        s.set_nsid(1);
        s.set_qword(10, 8);
        s.set_cdw(12, 7);
        s.set_sgl(Sgl::transport(4096));
        let b = s.as_bytes();
        assert_eq!(&b[..8], &[0x02, 0x40, 0x34, 0x12, 1, 0, 0, 0]);
        assert_eq!(
            &b[24..40],
            &[0, 0, 0, 0, 0, 0, 0, 0, 0, 0x10, 0, 0, 0, 0, 0, 0x5a]
        );
        assert_eq!(&b[40..52], &[8, 0, 0, 0, 0, 0, 0, 0, 7, 0, 0, 0]);
        let back = Sqe::parse(b).unwrap();
        assert_eq!(back, s);
        assert_eq!(back.qword(10), 8);
        assert_eq!(back.sgl().kind(), SglKind::Transport { length: 4096 });
        assert_eq!(back.fuse(), Fuse::Normal);
        assert!(Sqe::parse(&b[..63]).is_none());
    }

    #[test]
    fn sgl_kinds() {
        assert_eq!(
            Sgl::in_capsule(0, 512).kind(),
            SglKind::InCapsule {
                offset: 0,
                length: 512
            }
        );
        let mut b = [0u8; 16];
        b[..8].copy_from_slice(&0x1000u64.to_le_bytes());
        b[8..11].copy_from_slice(&[0x00, 0x20, 0x00]);
        b[11..15].copy_from_slice(&0xabcdu32.to_le_bytes());
        b[15] = 0x4f;
        assert_eq!(
            Sgl::from_bytes(b).kind(),
            SglKind::Keyed {
                address: 0x1000,
                length: 0x2000,
                key: 0xabcd,
                subtype: 0xf
            }
        );
        assert_eq!(Sgl::from_bytes(b).to_bytes(), b);
    }
}
