//! REPORT LUNS (SPC-4 section 6.33).

use crate::cdb::check_control;
use crate::sense::{FieldPointer, Sense};

/// The 8-byte LUN for `index`: peripheral device addressing below 256, flat space addressing
/// up to 16383 (SAM-5 section 4.7).
pub fn lun_bytes(index: u16) -> [u8; 8] {
    let mut b = [0u8; 8];
    if index < 256 {
        b[1] = index as u8;
    } else {
        let i = index.min(0x3fff);
        b[0] = 0x40 | (i >> 8) as u8;
        b[1] = i as u8;
    }
    b
}

/// REPORT LUNS parameter data for the logical units `luns` (ascending), truncated to the
/// ALLOCATION LENGTH. SELECT REPORT 00h and 02h list them; 01h (well-known logical units only)
/// lists none, as this target has none; other values, and an ALLOCATION LENGTH under 16, are
/// invalid.
pub fn report_luns(luns: &[u16], cdb: &[u8]) -> Result<Vec<u8>, Sense> {
    if cdb.len() < 12 {
        return Err(Sense::invalid_field_in_cdb(FieldPointer::cdb(0)));
    }
    check_control(cdb, 12)?;
    let listed: &[u16] = match cdb[2] {
        0x00 | 0x02 => luns,
        0x01 => &[],
        _ => return Err(Sense::invalid_field_in_cdb(FieldPointer::cdb(2))),
    };
    let alloc = u32::from_be_bytes([cdb[6], cdb[7], cdb[8], cdb[9]]) as usize;
    if alloc < 16 {
        return Err(Sense::invalid_field_in_cdb(FieldPointer::cdb(6)));
    }
    let mut d = Vec::with_capacity(8 + 8 * listed.len());
    d.extend_from_slice(&((8 * listed.len()) as u32).to_be_bytes());
    d.extend_from_slice(&[0; 4]);
    for &lun in listed {
        d.extend_from_slice(&lun_bytes(lun));
    }
    d.truncate(alloc);
    Ok(d)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cdb(select: u8, alloc: u32) -> [u8; 12] {
        let mut c = [0u8; 12];
        c[0] = 0xa0;
        c[2] = select;
        c[6..10].copy_from_slice(&alloc.to_be_bytes());
        c
    }

    #[test]
    fn lists_luns_in_both_addressing_methods() {
        let d = report_luns(&[0, 1, 300], &cdb(0, 4096)).unwrap();
        assert_eq!(&d[..8], &[0, 0, 0, 24, 0, 0, 0, 0]);
        assert_eq!(&d[8..16], &[0; 8]);
        assert_eq!(&d[16..24], &[0, 1, 0, 0, 0, 0, 0, 0]);
        assert_eq!(&d[24..32], &[0x41, 0x2c, 0, 0, 0, 0, 0, 0]);
        // The length says how much there is even when the buffer is short.
        let short = report_luns(&[0, 1, 300], &cdb(2, 16)).unwrap();
        assert_eq!(short.len(), 16);
        assert_eq!(&short[..4], &[0, 0, 0, 24]);
        assert_eq!(report_luns(&[0, 1], &cdb(1, 64)).unwrap(), [0u8; 8]);
    }

    #[test]
    fn refuses_bad_select_report_and_short_allocation() {
        assert_eq!(
            report_luns(&[0], &cdb(3, 64))
                .unwrap_err()
                .field
                .unwrap()
                .byte,
            2
        );
        assert_eq!(
            report_luns(&[0], &cdb(0, 15))
                .unwrap_err()
                .field
                .unwrap()
                .byte,
            6
        );
    }
}
