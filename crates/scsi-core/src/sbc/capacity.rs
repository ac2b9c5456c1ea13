//! READ CAPACITY (10) and (16) (SBC-3 sections 5.15 and 5.16), with the thin provisioning bits.

use crate::cdb::check_control;
use crate::lu::Geometry;
use crate::sense::{FieldPointer, Sense};

/// The SERVICE ACTION IN (16) service action of READ CAPACITY (16).
pub const SERVICE_ACTION_READ_CAPACITY_16: u8 = 0x10;

/// READ CAPACITY (10): the last LBA (0xFFFFFFFF when it does not fit: use the 16-byte command)
/// and the block length. PMI and a non-zero LOGICAL BLOCK ADDRESS are obsolete and refused.
pub fn read_capacity10(g: &Geometry, cdb: &[u8]) -> Result<[u8; 8], Sense> {
    if cdb.len() < 10 {
        return Err(Sense::invalid_field_in_cdb(FieldPointer::cdb(0)));
    }
    check_control(cdb, 10)?;
    if cdb[2..6] != [0; 4] {
        return Err(Sense::invalid_field_in_cdb(FieldPointer::cdb(2)));
    }
    if cdb[8] & 0x01 != 0 {
        return Err(Sense::invalid_field_in_cdb(FieldPointer::cdb_bit(8, 0)));
    }
    let last = g.blocks.saturating_sub(1);
    // 0xFFFFFFFF also says "too large for this command" (SBC-3 5.15.2).
    let returned = u32::try_from(last).unwrap_or(u32::MAX);
    let mut d = [0u8; 8];
    d[..4].copy_from_slice(&returned.to_be_bytes());
    d[4..].copy_from_slice(&g.block_size.to_be_bytes());
    Ok(d)
}

/// READ CAPACITY (16): 32 bytes of data truncated to the ALLOCATION LENGTH, with LBPME and
/// LBPRZ set for a thin logical unit.
pub fn read_capacity16(g: &Geometry, cdb: &[u8]) -> Result<Vec<u8>, Sense> {
    if cdb.len() < 16 {
        return Err(Sense::invalid_field_in_cdb(FieldPointer::cdb(0)));
    }
    check_control(cdb, 16)?;
    if cdb[1] & 0x1f != SERVICE_ACTION_READ_CAPACITY_16 {
        return Err(Sense::invalid_field_in_cdb(FieldPointer::cdb_bit(1, 4)));
    }
    if cdb[2..10] != [0; 8] {
        return Err(Sense::invalid_field_in_cdb(FieldPointer::cdb(2)));
    }
    if cdb[14] & 0x01 != 0 {
        return Err(Sense::invalid_field_in_cdb(FieldPointer::cdb_bit(14, 0)));
    }
    let mut d = vec![0u8; 32];
    d[..8].copy_from_slice(&g.blocks.saturating_sub(1).to_be_bytes());
    d[8..12].copy_from_slice(&g.block_size.to_be_bytes());
    if g.thin {
        d[14] = 0x80 | 0x40; // LBPME, LBPRZ.
    }
    d.truncate(u32::from_be_bytes([cdb[10], cdb[11], cdb[12], cdb[13]]) as usize);
    Ok(d)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sense::Asc;

    fn geometry(blocks: u64, thin: bool) -> Geometry {
        Geometry {
            block_size: 512,
            blocks,
            thin,
            write_cache: true,
            read_only: false,
        }
    }

    fn rc16(alloc: u32) -> [u8; 16] {
        let mut c = [0u8; 16];
        c[0] = 0x9e;
        c[1] = 0x10;
        c[10..14].copy_from_slice(&alloc.to_be_bytes());
        c
    }

    #[test]
    fn capacity_10_and_16() {
        let d =
            read_capacity10(&geometry(2048, false), &[0x25, 0, 0, 0, 0, 0, 0, 0, 0, 0]).unwrap();
        assert_eq!(d, [0, 0, 0x07, 0xff, 0, 0, 0x02, 0x00]);
        // Too large for 32 bits: the initiator must use READ CAPACITY (16).
        let d = read_capacity10(
            &geometry(1 << 33, false),
            &[0x25, 0, 0, 0, 0, 0, 0, 0, 0, 0],
        )
        .unwrap();
        assert_eq!(&d[..4], &[0xff; 4]);

        let d = read_capacity16(&geometry(1 << 33, true), &rc16(32)).unwrap();
        assert_eq!(
            u64::from_be_bytes(d[..8].try_into().unwrap()),
            (1 << 33) - 1
        );
        assert_eq!(&d[8..12], &512u32.to_be_bytes());
        assert_eq!(d[14], 0xc0);
        assert_eq!(
            read_capacity16(&geometry(8, false), &rc16(32)).unwrap()[14],
            0
        );
        assert_eq!(
            read_capacity16(&geometry(8, false), &rc16(12))
                .unwrap()
                .len(),
            12
        );
    }

    #[test]
    fn obsolete_fields_are_refused() {
        let e =
            read_capacity10(&geometry(8, false), &[0x25, 0, 0, 0, 0, 1, 0, 0, 0, 0]).unwrap_err();
        assert_eq!(e.field.unwrap().byte, 2);
        let e =
            read_capacity10(&geometry(8, false), &[0x25, 0, 0, 0, 0, 0, 0, 0, 1, 0]).unwrap_err();
        assert_eq!((e.field.unwrap().byte, e.field.unwrap().bit), (8, Some(0)));
        let mut c = rc16(32);
        c[14] = 1;
        assert_eq!(
            read_capacity16(&geometry(8, false), &c).unwrap_err().asc,
            Asc::INVALID_FIELD_IN_CDB
        );
        let mut c = rc16(32);
        c[1] = 0x11;
        assert_eq!(
            read_capacity16(&geometry(8, false), &c)
                .unwrap_err()
                .field
                .unwrap()
                .byte,
            1
        );
    }
}
