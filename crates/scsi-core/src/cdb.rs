//! CDB structure shared by every command (SPC-4 section 4.2) and the decoding of the SBC block
//! read and write family (SBC-3 sections 5.8 to 5.11, 5.32 to 5.35): a CDB either decodes into a
//! typed command or into the sense data that says which field was wrong.

use crate::sense::{FieldPointer, Sense};

/// The length of a CDB from its operation code's group (SPC-4 section 4.2.5.1); `None` for the
/// variable-length (0x7F) and vendor-specific groups.
pub fn cdb_length(opcode: u8) -> Option<usize> {
    match opcode >> 5 {
        0 => Some(6),
        1 | 2 => Some(10),
        4 => Some(16),
        5 => Some(12),
        3 if opcode != 0x7f => Some(10),
        _ => None,
    }
}

/// Checks the CONTROL byte (the last of the CDB): NACA set asks for ACA, which this target does
/// not offer; the obsolete LINK bit must be zero.
pub fn check_control(cdb: &[u8], len: usize) -> Result<(), Sense> {
    let at = len - 1;
    let control = cdb[at];
    if control & 0x04 != 0 {
        return Err(Sense::invalid_field_in_cdb(FieldPointer::cdb_bit(
            at as u16, 2,
        )));
    }
    if control & 0x01 != 0 {
        return Err(Sense::invalid_field_in_cdb(FieldPointer::cdb_bit(
            at as u16, 0,
        )));
    }
    Ok(())
}

/// A decoded READ or WRITE (6, 10, 12 or 16).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlockIo {
    /// WRITE rather than READ.
    pub write: bool,
    /// First logical block.
    pub lba: u64,
    /// Number of blocks; 0 transfers nothing and is not an error.
    pub blocks: u32,
    /// DPO: the blocks need not be kept in cache.
    pub dpo: bool,
    /// FUA: the write reaches (or the read comes from) the medium, not a volatile cache.
    pub fua: bool,
    /// GROUP NUMBER.
    pub group: u8,
}

impl BlockIo {
    /// Decodes READ/WRITE 6, 10, 12 and 16. The LU has no protection information, so
    /// RDPROTECT/WRPROTECT other than zero is an invalid field.
    pub fn decode(cdb: &[u8]) -> Result<BlockIo, Sense> {
        let opcode = *cdb.first().ok_or_else(Sense::invalid_opcode)?;
        let (write, len) = match opcode {
            0x08 => (false, 6),
            0x0a => (true, 6),
            0x28 => (false, 10),
            0x2a => (true, 10),
            0xa8 => (false, 12),
            0xaa => (true, 12),
            0x88 => (false, 16),
            0x8a => (true, 16),
            _ => return Err(Sense::invalid_opcode()),
        };
        if cdb.len() < len {
            return Err(Sense::invalid_field_in_cdb(FieldPointer::cdb(0)));
        }
        check_control(cdb, len)?;
        let be32 = |at: usize| u32::from_be_bytes([cdb[at], cdb[at + 1], cdb[at + 2], cdb[at + 3]]);
        if len == 6 {
            // 21-bit LBA; a TRANSFER LENGTH of 0 means 256 blocks.
            let lba = u64::from(u32::from_be_bytes([0, cdb[1] & 0x1f, cdb[2], cdb[3]]));
            let blocks = if cdb[4] == 0 { 256 } else { u32::from(cdb[4]) };
            return Ok(BlockIo {
                write,
                lba,
                blocks,
                dpo: false,
                fua: false,
                group: 0,
            });
        }
        let flags = cdb[1];
        if flags & 0xe0 != 0 {
            return Err(Sense::invalid_field_in_cdb(FieldPointer::cdb_bit(1, 7)));
        }
        let (lba, blocks, group) = match len {
            10 => (
                u64::from(be32(2)),
                u32::from(u16::from_be_bytes([cdb[7], cdb[8]])),
                cdb[6],
            ),
            12 => (u64::from(be32(2)), be32(6), cdb[10]),
            _ => (
                u64::from(be32(2)) << 32 | u64::from(be32(6)),
                be32(10),
                cdb[14],
            ),
        };
        Ok(BlockIo {
            write,
            lba,
            blocks,
            dpo: flags & 0x10 != 0,
            fua: flags & 0x08 != 0,
            group: group & 0x3f,
        })
    }

    /// LOGICAL BLOCK ADDRESS OUT OF RANGE unless the blocks lie within `capacity` blocks.
    pub fn check_range(&self, capacity: u64) -> Result<(), Sense> {
        match self.lba.checked_add(u64::from(self.blocks)) {
            Some(end) if end <= capacity => Ok(()),
            _ => Err(Sense::lba_out_of_range()),
        }
    }

    /// Bytes moved for `block_size`-byte blocks.
    pub fn bytes(&self, block_size: u32) -> u64 {
        u64::from(self.blocks) * u64::from(block_size)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sense::{Asc, FieldIn, SenseKey};

    fn cdb16(opcode: u8, flags: u8, lba: u64, blocks: u32) -> [u8; 16] {
        let mut c = [0u8; 16];
        c[0] = opcode;
        c[1] = flags;
        c[2..10].copy_from_slice(&lba.to_be_bytes());
        c[10..14].copy_from_slice(&blocks.to_be_bytes());
        c
    }

    #[test]
    fn lengths_by_group() {
        assert_eq!(cdb_length(0x08), Some(6));
        assert_eq!(cdb_length(0x28), Some(10));
        assert_eq!(cdb_length(0x5e), Some(10));
        assert_eq!(cdb_length(0x88), Some(16));
        assert_eq!(cdb_length(0xa8), Some(12));
        assert_eq!(cdb_length(0x7f), None);
        assert_eq!(cdb_length(0xc0), None);
    }

    #[test]
    fn decodes_every_size() {
        let r6 = [0x08, 0x1f, 0xff, 0xff, 0x00, 0x00];
        assert_eq!(
            BlockIo::decode(&r6).unwrap(),
            BlockIo {
                write: false,
                lba: 0x1f_ffff,
                blocks: 256,
                dpo: false,
                fua: false,
                group: 0
            }
        );
        let w10 = [0x2a, 0x18, 0, 0, 0x10, 0, 0x05, 0, 8, 0];
        assert_eq!(
            BlockIo::decode(&w10).unwrap(),
            BlockIo {
                write: true,
                lba: 0x1000,
                blocks: 8,
                dpo: true,
                fua: true,
                group: 5
            }
        );
        let r12 = [0xa8, 0, 0, 0, 0, 7, 0, 1, 0, 0, 0, 0];
        assert_eq!(BlockIo::decode(&r12).unwrap().blocks, 65536);
        let w16 = cdb16(0x8a, 0x08, 1 << 40, 3);
        let io = BlockIo::decode(&w16).unwrap();
        assert_eq!(
            (io.write, io.lba, io.blocks, io.fua),
            (true, 1 << 40, 3, true)
        );
        assert_eq!(io.bytes(4096), 3 * 4096);
    }

    #[test]
    fn refuses_protection_naca_and_unknown_opcodes() {
        for protect in [0x20u8, 0x40, 0xe0] {
            let e = BlockIo::decode(&cdb16(0x88, protect, 0, 1)).unwrap_err();
            assert_eq!(
                (e.key, e.asc),
                (SenseKey::IllegalRequest, Asc::INVALID_FIELD_IN_CDB)
            );
            let f = e.field.unwrap();
            assert_eq!((f.within, f.byte, f.bit), (FieldIn::Cdb, 1, Some(7)));
        }
        let mut naca = cdb16(0x88, 0, 0, 1);
        naca[15] = 0x04;
        let f = BlockIo::decode(&naca).unwrap_err().field.unwrap();
        assert_eq!((f.byte, f.bit), (15, Some(2)));
        let e = BlockIo::decode(&[0x12, 0, 0, 0, 0, 0]).unwrap_err();
        assert_eq!(e.asc, Asc::INVALID_COMMAND_OPERATION_CODE);
    }

    #[test]
    fn range_checks_do_not_overflow() {
        let io = |lba, blocks| BlockIo {
            write: false,
            lba,
            blocks,
            dpo: false,
            fua: false,
            group: 0,
        };
        assert!(io(1000, 24).check_range(1024).is_ok());
        assert!(io(1000, 25).check_range(1024).is_err());
        assert!(io(1024, 0).check_range(1024).is_ok());
        assert!(io(u64::MAX, 2).check_range(u64::MAX).is_err());
        assert_eq!(
            io(2000, 1).check_range(1024).unwrap_err().asc,
            Asc::LBA_OUT_OF_RANGE
        );
    }

    proptest::proptest! {
        #[test]
        fn decoding_never_panics(cdb in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..20)) {
            let _ = BlockIo::decode(&cdb);
        }

        #[test]
        fn sixteen_byte_round_trip(write in proptest::prelude::any::<bool>(), lba in proptest::prelude::any::<u64>(),
                                   blocks in proptest::prelude::any::<u32>(), dpo in proptest::prelude::any::<bool>(),
                                   fua in proptest::prelude::any::<bool>()) {
            let flags = u8::from(dpo) << 4 | u8::from(fua) << 3;
            let io = BlockIo::decode(&cdb16(if write { 0x8a } else { 0x88 }, flags, lba, blocks)).unwrap();
            proptest::prop_assert_eq!(io, BlockIo { write, lba, blocks, dpo, fua, group: 0 });
        }
    }
}
