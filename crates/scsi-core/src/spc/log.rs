//! LOG SENSE (SPC-4 section 6.8): the Supported Log Pages page (00h) and its subpage list
//! (00h/FFh). The unit keeps no other logs.

use crate::sense::{FieldPointer, Sense};

/// LOG SENSE parameter data, before truncation to the allocation length.
pub fn log_sense(cdb: &[u8]) -> Result<Vec<u8>, Sense> {
    if cdb[1] & 0x01 != 0 {
        // SP: saving is not supported.
        return Err(Sense::invalid_field_in_cdb(FieldPointer::cdb_bit(1, 0)));
    }
    let page = cdb[2] & 0x3f;
    let subpage = cdb[3];
    if u16::from_be_bytes([cdb[5], cdb[6]]) != 0 {
        return Err(Sense::invalid_field_in_cdb(FieldPointer::cdb(5)));
    }
    match (page, subpage) {
        (0x00, 0x00) => Ok(vec![0x00, 0x00, 0x00, 0x01, 0x00]),
        (0x00, 0xff) => Ok(vec![0x40, 0xff, 0x00, 0x04, 0x00, 0x00, 0x00, 0xff]),
        (0x00, _) => Err(Sense::invalid_field_in_cdb(FieldPointer::cdb(3))),
        _ => Err(Sense::invalid_field_in_cdb(FieldPointer::cdb_bit(2, 5))),
    }
}
