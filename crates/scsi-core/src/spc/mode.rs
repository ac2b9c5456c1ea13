//! MODE SENSE and MODE SELECT 6/10 (SPC-4 sections 6.11 to 6.14, 7.5) with the Read-Write
//! Error Recovery (01h), Caching (08h), Control (0Ah) and Informational Exceptions Control
//! (1Ch) pages: current, changeable, default values; saving is not supported.

use crate::lu::Geometry;
use crate::sense::{Asc, FieldPointer, Sense, SenseKey};

/// The mode parameters an initiator can change.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ModeParameters {
    /// Caching page WCE.
    pub write_cache: bool,
    /// Control page D_SENSE.
    pub d_sense: bool,
    /// Control page SWP.
    pub swp: bool,
}

/// The supported page codes, ascending.
pub const PAGES: [u8; 4] = [0x01, 0x08, 0x0a, 0x1c];

/// Page control.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Pc {
    Current,
    Changeable,
    Default,
}

fn page(code: u8, m: &ModeParameters, default_wce: bool, pc: Pc) -> Vec<u8> {
    let (wce, d_sense, swp) = match pc {
        Pc::Current => (m.write_cache, m.d_sense, m.swp),
        Pc::Changeable => (true, true, true),
        Pc::Default => (default_wce, false, false),
    };
    let changeable = pc == Pc::Changeable;
    let mut p = match code {
        0x01 => {
            let mut p = vec![0u8; 12];
            if !changeable {
                p[2] = 0xc0; // AWRE, ARRE.
            }
            p
        }
        0x08 => {
            let mut p = vec![0u8; 20];
            p[2] = u8::from(wce) << 2;
            p
        }
        0x0a => {
            let mut p = vec![0u8; 12];
            p[2] = u8::from(d_sense) << 2;
            if !changeable {
                p[3] = 0x10; // QUEUE ALGORITHM MODIFIER 1: unrestricted reordering.
                p[8..10].copy_from_slice(&[0xff, 0xff]); // Obsolete, per SPC-4 convention.
            }
            p[4] = u8::from(swp) << 3;
            p
        }
        0x1c => {
            let mut p = vec![0u8; 12];
            if !changeable {
                p[2] = 0x08; // DEXCPT: no informational exceptions reported.
            }
            p
        }
        _ => unreachable!("only supported pages"),
    };
    p[0] = code;
    p[1] = (p.len() - 2) as u8;
    p
}

/// MODE SENSE (6 when `ten` is false, else 10) parameter data, before truncation.
pub fn mode_sense(
    cdb: &[u8],
    ten: bool,
    g: &Geometry,
    m: &ModeParameters,
    default_wce: bool,
) -> Result<Vec<u8>, Sense> {
    let dbd = cdb[1] & 0x08 != 0;
    let llbaa = ten && cdb[1] & 0x10 != 0;
    let pc = match cdb[2] >> 6 {
        0 => Pc::Current,
        1 => Pc::Changeable,
        2 => Pc::Default,
        _ => {
            return Err(Sense {
                field: Some(FieldPointer::cdb_bit(2, 7)),
                ..Sense::new(
                    SenseKey::IllegalRequest,
                    Asc::SAVING_PARAMETERS_NOT_SUPPORTED,
                )
            })
        }
    };
    let code = cdb[2] & 0x3f;
    let subpage = cdb[3];
    let codes: &[u8] = match (code, subpage) {
        (0x3f, 0x00 | 0xff) => &PAGES,
        (c, 0x00 | 0xff) if PAGES.contains(&c) => {
            std::slice::from_ref(PAGES.iter().find(|&&p| p == c).expect("contains"))
        }
        (c, _) if PAGES.contains(&c) || c == 0x3f => {
            return Err(Sense::invalid_field_in_cdb(FieldPointer::cdb(3)))
        }
        _ => return Err(Sense::invalid_field_in_cdb(FieldPointer::cdb_bit(2, 5))),
    };
    let header = if ten { 8 } else { 4 };
    let mut d = vec![0u8; header];
    // DEVICE-SPECIFIC PARAMETER: WP, DPOFUA.
    let wp = pc == Pc::Current && (g.read_only || m.swp);
    d[if ten { 3 } else { 2 }] = u8::from(wp) << 7 | 0x10;
    if !dbd {
        if llbaa {
            d[4] |= 0x01; // LONGLBA
            d.extend_from_slice(&g.blocks.to_be_bytes());
            d.extend_from_slice(&[0; 4]);
            d.extend_from_slice(&g.block_size.to_be_bytes());
        } else {
            let blocks = u32::try_from(g.blocks).unwrap_or(u32::MAX);
            d.extend_from_slice(&blocks.to_be_bytes());
            d.push(0);
            d.extend_from_slice(&g.block_size.to_be_bytes()[1..]);
        }
        let bdl = (d.len() - header) as u16;
        if ten {
            d[6..8].copy_from_slice(&bdl.to_be_bytes());
        } else {
            d[3] = bdl as u8;
        }
    }
    for &c in codes {
        d.extend_from_slice(&page(c, m, default_wce, pc));
    }
    if ten {
        let len = (d.len() - 2) as u16;
        d[0..2].copy_from_slice(&len.to_be_bytes());
    } else {
        d[0] = u8::try_from(d.len() - 1).unwrap_or(u8::MAX);
    }
    Ok(d)
}

/// Checks MODE SELECT's CDB: PF must be one (the pages follow SPC-4) and SP zero (nothing is
/// saved).
pub fn check_mode_select(cdb: &[u8]) -> Result<(), Sense> {
    if cdb[1] & 0x01 != 0 {
        return Err(Sense::invalid_field_in_cdb(FieldPointer::cdb_bit(1, 0)));
    }
    if cdb[1] & 0x10 == 0 {
        return Err(Sense::invalid_field_in_cdb(FieldPointer::cdb_bit(1, 4)));
    }
    Ok(())
}

/// Applies a MODE SELECT parameter list to `m`: block descriptors must describe the unit as
/// it is, and only changeable bits may differ from the current values.
pub fn mode_select(
    p: &[u8],
    ten: bool,
    g: &Geometry,
    m: &ModeParameters,
    default_wce: bool,
) -> Result<ModeParameters, Sense> {
    let header = if ten { 8 } else { 4 };
    let bad =
        |at: usize| Sense::invalid_field_in_parameter_list(FieldPointer::parameter(at as u16));
    if p.len() < header {
        return Err(Sense::parameter_list_length_error());
    }
    let bdl = if ten {
        usize::from(u16::from_be_bytes([p[6], p[7]]))
    } else {
        usize::from(p[3])
    };
    let long = ten && p[4] & 0x01 != 0;
    let desc_len = if long { 16 } else { 8 };
    if bdl % desc_len != 0 || header + bdl > p.len() {
        return Err(bad(if ten { 6 } else { 3 }));
    }
    let mut at = header;
    while at < header + bdl {
        let d = &p[at..at + desc_len];
        let (blocks, size) = if long {
            (
                u64::from_be_bytes(d[0..8].try_into().unwrap()),
                u32::from_be_bytes(d[12..16].try_into().unwrap()),
            )
        } else {
            (
                u64::from(u32::from_be_bytes(d[0..4].try_into().unwrap())),
                u32::from_be_bytes([0, d[5], d[6], d[7]]),
            )
        };
        let blocks_ok = blocks == 0
            || blocks == g.blocks
            || (!long && blocks == 0xffff_ffff && g.blocks > 0xffff_ffff);
        if !blocks_ok {
            return Err(bad(at));
        }
        if size != g.block_size {
            return Err(bad(at + if long { 12 } else { 5 }));
        }
        at += desc_len;
    }
    let mut new = *m;
    while at < p.len() {
        let code = p[at] & 0x3f;
        if p[at] & 0x40 != 0 {
            // SPF: no subpages here.
            return Err(bad(at));
        }
        if !PAGES.contains(&code) {
            return Err(bad(at));
        }
        let current = page(code, &new, default_wce, Pc::Current);
        let mask = page(code, &new, default_wce, Pc::Changeable);
        let Some(given) = p.get(at..at + current.len()) else {
            return Err(Sense::parameter_list_length_error());
        };
        if usize::from(given[1]) != current.len() - 2 {
            return Err(bad(at + 1));
        }
        for i in 2..current.len() {
            if (given[i] ^ current[i]) & !mask[i] != 0 {
                return Err(bad(at + i));
            }
        }
        match code {
            0x08 => new.write_cache = given[2] & 0x04 != 0,
            0x0a => {
                new.d_sense = given[2] & 0x04 != 0;
                new.swp = given[4] & 0x08 != 0;
            }
            _ => {}
        }
        at += current.len();
    }
    Ok(new)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn g() -> Geometry {
        Geometry {
            block_size: 512,
            blocks: 1 << 21,
            thin: true,
            write_cache: true,
            read_only: false,
        }
    }

    const M: ModeParameters = ModeParameters {
        write_cache: true,
        d_sense: false,
        swp: false,
    };

    #[test]
    fn sense_all_pages_with_and_without_descriptors() {
        let d = mode_sense(&[0x1a, 0, 0x3f, 0, 255, 0], false, &g(), &M, true).unwrap();
        assert_eq!(usize::from(d[0]) + 1, d.len());
        assert_eq!(d[2], 0x10);
        assert_eq!(d[3], 8);
        assert_eq!(&d[4..12], &[0, 0x20, 0, 0, 0, 0, 2, 0]);
        assert_eq!(d.len(), 12 + 12 + 20 + 12 + 12);
        let ten = mode_sense(
            &[0x5a, 0x18, 0x0a, 0, 0, 0, 0, 1, 0, 0],
            true,
            &g(),
            &M,
            true,
        )
        .unwrap();
        assert_eq!(&ten[..8], &[0, 6 + 12, 0, 0x10, 0, 0, 0, 0]);
        assert_eq!(&ten[8..10], &[0x0a, 0x0a]);
        let long = mode_sense(
            &[0x5a, 0x10, 0x08, 0, 0, 0, 0, 1, 0, 0],
            true,
            &g(),
            &M,
            true,
        )
        .unwrap();
        assert_eq!(long[4], 1);
        assert_eq!(&long[6..8], &[0, 16]);
        let changeable = mode_sense(&[0x1a, 0x08, 0x48, 0, 255, 0], false, &g(), &M, true).unwrap();
        assert_eq!(changeable[4 + 2], 0x04);
        assert!(mode_sense(&[0x1a, 0, 0xc8, 0, 255, 0], false, &g(), &M, true).is_err());
        assert!(mode_sense(&[0x1a, 0, 0x02, 0, 255, 0], false, &g(), &M, true).is_err());
        assert!(mode_sense(&[0x1a, 0, 0x08, 0x01, 255, 0], false, &g(), &M, true).is_err());
    }

    #[test]
    fn select_changes_only_changeable_bits() {
        let mut sensed = mode_sense(&[0x1a, 0x08, 0x0a, 0, 255, 0], false, &g(), &M, true).unwrap();
        sensed[0] = 0;
        sensed[2] = 0;
        sensed[4 + 2] |= 0x04; // D_SENSE
        sensed[4 + 4] |= 0x08; // SWP
        let new = mode_select(&sensed, false, &g(), &M, true).unwrap();
        assert!(new.d_sense && new.swp && new.write_cache);
        let mut bad = sensed.clone();
        bad[4 + 3] = 0; // QUEUE ALGORITHM MODIFIER is not changeable
        let e = mode_select(&bad, false, &g(), &M, true).unwrap_err();
        assert_eq!(e.field.unwrap().byte, 7);
        let with_desc = [0, 0, 0, 8, 0, 0, 0, 0, 0, 0, 0x10, 0];
        let e = mode_select(&with_desc, false, &g(), &M, true).unwrap_err();
        assert_eq!(e.field.unwrap().byte, 9);
        assert!(mode_select(&[0, 0, 0], false, &g(), &M, true).is_err());
    }
}
