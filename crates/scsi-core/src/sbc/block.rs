//! Fields shared by the SBC block commands (VERIFY, WRITE AND VERIFY, WRITE SAME, PRE-FETCH,
//! SYNCHRONIZE CACHE, ORWRITE, WRITE ATOMIC, COMPARE AND WRITE) and READ DEFECT DATA.

use crate::cdb::cdb_length;
use crate::sense::{FieldPointer, Sense};

/// LOGICAL BLOCK ADDRESS and the length field of a 10, 12 or 16-byte block CDB in the common
/// layout, with the length field's byte offset (for field pointers).
pub fn lba_and_length(cdb: &[u8]) -> (u64, u32, u16) {
    let be32 = |at: usize| u32::from_be_bytes(cdb[at..at + 4].try_into().unwrap());
    match cdb_length(cdb[0]) {
        Some(10) => (
            u64::from(be32(2)),
            u32::from(u16::from_be_bytes([cdb[7], cdb[8]])),
            7,
        ),
        Some(12) => (u64::from(be32(2)), be32(6), 6),
        _ => (
            u64::from_be_bytes(cdb[2..10].try_into().unwrap()),
            be32(10),
            10,
        ),
    }
}

/// BYTCHK (bits 2-1 of byte 1) of VERIFY and WRITE AND VERIFY.
pub fn bytchk(cdb: &[u8]) -> u8 {
    (cdb[1] >> 1) & 0x03
}

/// READ DEFECT DATA (10 or 12): an empty defect list in the requested format, before
/// truncation to the allocation length.
pub fn read_defect_data(cdb: &[u8]) -> Result<Vec<u8>, Sense> {
    let twelve = cdb[0] == 0xb7;
    let flags = if twelve { cdb[1] } else { cdb[2] };
    let format = flags & 0x07;
    if matches!(format, 0x07) {
        return Err(Sense::invalid_field_in_cdb(FieldPointer::cdb_bit(
            if twelve { 1 } else { 2 },
            2,
        )));
    }
    Ok(if twelve {
        vec![0, flags & 0x1f, 0, 0, 0, 0, 0, 0]
    } else {
        vec![0, flags & 0x1f, 0, 0]
    })
}
