//! UNMAP (SBC-3 section 5.28): the parameter list of block descriptors.

use crate::lu::{Geometry, Limits};
use crate::sense::{FieldPointer, Sense};

/// The ranges (LBA, blocks) an UNMAP parameter list names, checked against the unit's
/// capacity and limits. Descriptors with no blocks are dropped.
pub fn parse(p: &[u8], g: &Geometry, l: &Limits) -> Result<Vec<(u64, u64)>, Sense> {
    if p.len() < 8 {
        return Err(Sense::parameter_list_length_error());
    }
    let data_len = usize::from(u16::from_be_bytes([p[0], p[1]]));
    let desc_len = usize::from(u16::from_be_bytes([p[2], p[3]]));
    // UNMAP DATA LENGTH counts the bytes after itself; a shorter list than it claims is an
    // error, as is a descriptor length that is not whole descriptors.
    if data_len + 2 > p.len() && data_len != 0 {
        return Err(Sense::parameter_list_length_error());
    }
    if desc_len % 16 != 0 || 8 + desc_len > p.len() {
        return Err(Sense::parameter_list_length_error());
    }
    let count = desc_len / 16;
    if count > l.max_unmap_descriptors as usize {
        return Err(Sense::invalid_field_in_parameter_list(
            FieldPointer::parameter(2),
        ));
    }
    let mut ranges = Vec::with_capacity(count);
    for i in 0..count {
        let d = &p[8 + 16 * i..8 + 16 * (i + 1)];
        let lba = u64::from_be_bytes(d[0..8].try_into().unwrap());
        let blocks = u64::from(u32::from_be_bytes(d[8..12].try_into().unwrap()));
        if lba.checked_add(blocks).is_none_or(|end| end > g.blocks) {
            return Err(Sense::lba_out_of_range());
        }
        if blocks > u64::from(l.max_unmap_blocks) {
            return Err(Sense::invalid_field_in_parameter_list(
                FieldPointer::parameter((8 + 16 * i + 8) as u16),
            ));
        }
        if blocks > 0 {
            ranges.push((lba, blocks));
        }
    }
    Ok(ranges)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sense::Asc;

    fn list(descs: &[(u64, u32)]) -> Vec<u8> {
        let mut p = Vec::new();
        p.extend_from_slice(&((6 + 16 * descs.len()) as u16).to_be_bytes());
        p.extend_from_slice(&((16 * descs.len()) as u16).to_be_bytes());
        p.extend_from_slice(&[0; 4]);
        for &(lba, n) in descs {
            p.extend_from_slice(&lba.to_be_bytes());
            p.extend_from_slice(&n.to_be_bytes());
            p.extend_from_slice(&[0; 4]);
        }
        p
    }

    #[test]
    fn parses_and_checks() {
        let g = Geometry {
            block_size: 512,
            blocks: 1000,
            thin: true,
            write_cache: true,
            read_only: false,
        };
        let l = Limits::default();
        assert_eq!(
            parse(&list(&[(0, 8), (10, 0), (992, 8)]), &g, &l).unwrap(),
            vec![(0, 8), (992, 8)]
        );
        assert_eq!(parse(&list(&[]), &g, &l).unwrap(), vec![]);
        assert_eq!(
            parse(&list(&[(993, 8)]), &g, &l).unwrap_err().asc,
            Asc::LBA_OUT_OF_RANGE
        );
        assert_eq!(
            parse(&[0, 6, 0], &g, &l).unwrap_err().asc,
            Asc::PARAMETER_LIST_LENGTH_ERROR
        );
        let mut odd = list(&[(0, 1)]);
        odd[3] = 15;
        assert!(parse(&odd, &g, &l).is_err());
    }
}
