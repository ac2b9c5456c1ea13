//! EXTENDED COPY (LID1) and RECEIVE COPY RESULTS (SPC-4 sections 6.4 and 6.18): the copy
//! manager copies blocks between logical units of this target, as VMware's XCOPY offload and
//! `sg_xcopy` ask, without the data crossing the network.
//!
//! Supported: the identification descriptor target descriptor (E4h) naming a unit of this
//! target by its NAA designator, and the block-to-block segment descriptor (02h).

use std::collections::VecDeque;

use crate::backend::Op;
use crate::sense::{Asc, FieldPointer, Sense, SenseKey};

/// Parameter list header length (SPC-4 table 96).
pub const HEADER_LEN: usize = 16;
/// Target descriptors one EXTENDED COPY may carry.
pub const MAX_TARGET_DESCRIPTORS: usize = 8;
/// Segment descriptors one EXTENDED COPY may carry.
pub const MAX_SEGMENT_DESCRIPTORS: usize = 64;
/// MAXIMUM DESCRIPTOR LIST LENGTH: room for the most of both.
pub const MAX_DESCRIPTOR_LIST_LENGTH: usize =
    MAX_TARGET_DESCRIPTORS * 32 + MAX_SEGMENT_DESCRIPTORS * 28;
/// The most blocks a block-to-block segment moves (its NUMBER OF BLOCKS field is 16 bits).
pub const MAX_SEGMENT_BLOCKS: u32 = 0xffff;
/// Bytes moved per read and write while copying: the copy borrows one buffer of this size.
pub const CHUNK_BYTES: u32 = 1 << 20;

const TARGET_IDENTIFICATION: u8 = 0xe4;
const SEGMENT_BLOCK_TO_BLOCK: u8 = 0x02;

/// 26/06 TOO MANY TARGET DESCRIPTORS.
pub const TOO_MANY_TARGET_DESCRIPTORS: Asc = Asc(0x26, 0x06);
/// 26/07 UNSUPPORTED TARGET DESCRIPTOR TYPE CODE.
pub const UNSUPPORTED_TARGET_DESCRIPTOR: Asc = Asc(0x26, 0x07);
/// 26/08 TOO MANY SEGMENT DESCRIPTORS.
pub const TOO_MANY_SEGMENT_DESCRIPTORS: Asc = Asc(0x26, 0x08);
/// 26/09 UNSUPPORTED SEGMENT DESCRIPTOR TYPE CODE.
pub const UNSUPPORTED_SEGMENT_DESCRIPTOR: Asc = Asc(0x26, 0x09);
/// 08/04 UNREACHABLE COPY TARGET.
pub const UNREACHABLE_COPY_TARGET: Asc = Asc(0x08, 0x04);

/// A unit a target descriptor may name: its LUN index, NAA designator, block size and capacity.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CopyTarget {
    /// LUN index.
    pub lun: u16,
    /// The NAA designator of VPD page 83h.
    pub naa: [u8; 8],
    /// Block size.
    pub block_size: u32,
    /// Capacity in blocks.
    pub blocks: u64,
}

/// One block-to-block segment, resolved.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Segment {
    /// Source unit.
    pub source: CopyTarget,
    /// First source block.
    pub source_lba: u64,
    /// Destination unit.
    pub destination: CopyTarget,
    /// First destination block.
    pub destination_lba: u64,
    /// Blocks to copy.
    pub blocks: u32,
}

/// A checked EXTENDED COPY parameter list.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CopyPlan {
    /// LIST IDENTIFIER.
    pub list_id: u8,
    /// LIST ID USAGE 00b: the results are held for RECEIVE COPY RESULTS.
    pub hold: bool,
    /// The segments, in order.
    pub segments: Vec<Segment>,
}

fn copy_aborted(asc: Asc) -> Sense {
    Sense::new(SenseKey::CopyAborted, asc)
}

fn field(byte: usize) -> Sense {
    Sense::invalid_field_in_parameter_list(FieldPointer::parameter(byte as u16))
}

/// Checks a parameter list and resolves its descriptors against `units`.
pub fn parse(data: &[u8], units: &[CopyTarget]) -> Result<CopyPlan, Sense> {
    if data.len() < HEADER_LEN {
        return Err(Sense::parameter_list_length_error());
    }
    let list_id = data[0];
    let usage = (data[1] >> 3) & 3;
    if usage == 1 {
        return Err(field(1));
    }
    let targets_len = usize::from(u16::from_be_bytes([data[2], data[3]]));
    let segments_len = u32::from_be_bytes(data[8..12].try_into().expect("4 bytes")) as usize;
    let inline_len = u32::from_be_bytes(data[12..16].try_into().expect("4 bytes")) as usize;
    let end = HEADER_LEN
        .checked_add(targets_len)
        .and_then(|n| n.checked_add(segments_len))
        .and_then(|n| n.checked_add(inline_len));
    if end.is_none_or(|e| e > data.len()) || targets_len + segments_len > MAX_DESCRIPTOR_LIST_LENGTH
    {
        return Err(Sense::parameter_list_length_error());
    }
    if inline_len != 0 {
        // No descriptor this copy manager supports refers to inline data.
        return Err(field(12));
    }
    let targets = target_descriptors(&data[HEADER_LEN..HEADER_LEN + targets_len], units)?;
    let at = HEADER_LEN + targets_len;
    let segments = segment_descriptors(&data[at..at + segments_len], at, &targets)?;
    Ok(CopyPlan {
        list_id,
        hold: usage == 0,
        segments,
    })
}

/// Length of a target descriptor of type `code` (SPC-4 table 100), none for unknown codes.
fn target_descriptor_len(code: u8) -> Option<usize> {
    match code {
        0xe0..=0xe9 => Some(32),
        0xea | 0xeb => Some(64),
        _ => None,
    }
}

fn target_descriptors(list: &[u8], units: &[CopyTarget]) -> Result<Vec<CopyTarget>, Sense> {
    let mut out = Vec::new();
    let mut at = 0;
    while at < list.len() {
        let code = list[at];
        let Some(len) = target_descriptor_len(code) else {
            return Err(Sense::new(
                SenseKey::IllegalRequest,
                UNSUPPORTED_TARGET_DESCRIPTOR,
            ));
        };
        if at + len > list.len() {
            return Err(Sense::parameter_list_length_error());
        }
        if out.len() == MAX_TARGET_DESCRIPTORS {
            return Err(Sense::new(
                SenseKey::IllegalRequest,
                TOO_MANY_TARGET_DESCRIPTORS,
            ));
        }
        if code != TARGET_IDENTIFICATION {
            return Err(Sense::new(
                SenseKey::IllegalRequest,
                UNSUPPORTED_TARGET_DESCRIPTOR,
            ));
        }
        let d = &list[at..at + len];
        // Byte 1: LU ID TYPE (ignored, SPC-4), NUL (obsolete), PERIPHERAL DEVICE TYPE.
        if d[1] & 0x1f != 0 {
            return Err(copy_aborted(UNREACHABLE_COPY_TARGET));
        }
        // Bytes 4-27: a designation descriptor as in VPD page 83h; NAA is what units carry.
        let (kind, length) = (d[5] & 0x0f, usize::from(d[7]));
        let unit = (kind == 3 && length == 8)
            .then(|| units.iter().find(|u| u.naa[..] == d[8..16]))
            .flatten()
            .ok_or_else(|| copy_aborted(UNREACHABLE_COPY_TARGET))?;
        // Bytes 29-31: DISK BLOCK LENGTH, which must be the unit's.
        let block_length = u32::from_be_bytes([0, d[29], d[30], d[31]]);
        if block_length != unit.block_size {
            return Err(copy_aborted(UNREACHABLE_COPY_TARGET));
        }
        out.push(*unit);
        at += len;
    }
    Ok(out)
}

fn segment_descriptors(
    list: &[u8],
    base: usize,
    targets: &[CopyTarget],
) -> Result<Vec<Segment>, Sense> {
    let mut out = Vec::new();
    let mut at = 0;
    while at < list.len() {
        if at + 4 > list.len() {
            return Err(Sense::parameter_list_length_error());
        }
        let code = list[at];
        if code != SEGMENT_BLOCK_TO_BLOCK {
            return Err(Sense::new(
                SenseKey::IllegalRequest,
                UNSUPPORTED_SEGMENT_DESCRIPTOR,
            ));
        }
        let len = 4 + usize::from(u16::from_be_bytes([list[at + 2], list[at + 3]]));
        if len != 28 {
            return Err(field(base + at + 2));
        }
        if at + len > list.len() {
            return Err(Sense::parameter_list_length_error());
        }
        if out.len() == MAX_SEGMENT_DESCRIPTORS {
            return Err(Sense::new(
                SenseKey::IllegalRequest,
                TOO_MANY_SEGMENT_DESCRIPTORS,
            ));
        }
        let d = &list[at..at + len];
        let index = |i: usize| usize::from(u16::from_be_bytes([d[i], d[i + 1]]));
        let (Some(source), Some(destination)) = (targets.get(index(4)), targets.get(index(6)))
        else {
            return Err(copy_aborted(Asc::NO_ADDITIONAL_SENSE));
        };
        let blocks = u32::from(u16::from_be_bytes([d[10], d[11]]));
        let source_lba = u64::from_be_bytes(d[12..20].try_into().expect("8 bytes"));
        let destination_lba = u64::from_be_bytes(d[20..28].try_into().expect("8 bytes"));
        let fits = |lba: u64, unit: &CopyTarget| {
            lba.checked_add(u64::from(blocks))
                .is_some_and(|end| end <= unit.blocks)
        };
        if !fits(source_lba, source) || !fits(destination_lba, destination) {
            // COPY ABORTED without a further code, as initiators (and libiscsi's tests)
            // expect of a segment outside a unit.
            return Err(copy_aborted(Asc::NO_ADDITIONAL_SENSE));
        }
        if source.block_size != destination.block_size {
            return Err(copy_aborted(UNREACHABLE_COPY_TARGET));
        }
        out.push(Segment {
            source: *source,
            source_lba,
            destination: *destination,
            destination_lba,
            blocks,
        });
        at += len;
    }
    Ok(out)
}

/// The reads and writes that carry out `plan`, each with the LUN it runs on, moving at most
/// [`CHUNK_BYTES`] at a time through one buffer. A segment whose destination overlaps its
/// source further on the same unit is copied from its end, as memmove would.
pub fn ops(plan: &CopyPlan) -> VecDeque<(u16, Op)> {
    let mut out = VecDeque::new();
    for s in &plan.segments {
        let bs = s.source.block_size;
        let chunk = (CHUNK_BYTES / bs).max(1);
        let backwards = s.source.lun == s.destination.lun
            && s.destination_lba > s.source_lba
            && s.destination_lba < s.source_lba + u64::from(s.blocks);
        let mut pieces = Vec::new();
        let mut done = 0u32;
        while done < s.blocks {
            let n = chunk.min(s.blocks - done);
            pieces.push((done, n));
            done += n;
        }
        if backwards {
            pieces.reverse();
        }
        for (from, n) in pieces {
            let from = u64::from(from);
            out.push_back((
                s.source.lun,
                Op::Read {
                    lba: s.source_lba + from,
                    blocks: n,
                    offset: 0,
                    fua: false,
                },
            ));
            out.push_back((
                s.destination.lun,
                Op::Write {
                    lba: s.destination_lba + from,
                    blocks: n,
                    offset: 0,
                    fua: false,
                },
            ));
        }
    }
    out
}

/// RECEIVE COPY RESULTS, COPY STATUS data (SPC-4 table 139) of a finished copy.
pub fn copy_status(segments: u16, bytes: u64) -> [u8; 12] {
    let mut d = [0u8; 12];
    d[3] = 8; // AVAILABLE DATA.
    d[4] = 0x00; // COPY MANAGER STATUS: completed without errors.
    d[5..7].copy_from_slice(&segments.to_be_bytes());
    // TRANSFER COUNT UNITS: bytes, or kibibytes (F1h) when the count would not fit.
    match u32::try_from(bytes) {
        Ok(b) => d[8..12].copy_from_slice(&b.to_be_bytes()),
        Err(_) => {
            d[7] = 0xf1;
            let k = u32::try_from(bytes >> 10).unwrap_or(u32::MAX);
            d[8..12].copy_from_slice(&k.to_be_bytes());
        }
    }
    d
}

/// RECEIVE COPY RESULTS, OPERATING PARAMETERS data (SPC-4 table 141).
pub fn operating_parameters() -> Vec<u8> {
    let codes = [SEGMENT_BLOCK_TO_BLOCK, TARGET_IDENTIFICATION];
    let mut d = vec![0u8; 44 + codes.len()];
    let available = (d.len() - 4) as u32;
    d[0..4].copy_from_slice(&available.to_be_bytes());
    d[4] = 0x00; // SNLID: a list identifier is always used.
    d[8..10].copy_from_slice(&(MAX_TARGET_DESCRIPTORS as u16).to_be_bytes());
    d[10..12].copy_from_slice(&(MAX_SEGMENT_DESCRIPTORS as u16).to_be_bytes());
    d[12..16].copy_from_slice(&(MAX_DESCRIPTOR_LIST_LENGTH as u32).to_be_bytes());
    // MAXIMUM SEGMENT LENGTH in bytes: the most a block-to-block segment can name at 4 KiB.
    d[16..20].copy_from_slice(&(MAX_SEGMENT_BLOCKS * 4096).to_be_bytes());
    // MAXIMUM INLINE DATA LENGTH, HELD DATA LIMIT, MAXIMUM STREAM DEVICE TRANSFER SIZE: none.
    d[34..36].copy_from_slice(&1u16.to_be_bytes()); // TOTAL CONCURRENT COPIES.
    d[36] = 1; // MAXIMUM CONCURRENT COPIES.
    d[37] = 9; // DATA SEGMENT GRANULARITY: 512 bytes (log 2).
    d[43] = codes.len() as u8;
    d[44..].copy_from_slice(&codes);
    d
}

/// The Third-party Copy VPD page (8Fh, SPC-4 section 7.8.17) body: one Supported Commands
/// descriptor naming EXTENDED COPY (LID1) and the two RECEIVE COPY RESULTS service actions.
pub fn vpd_page() -> Vec<u8> {
    // Per command: OPERATION CODE, SERVICE ACTION LIST LENGTH, the service actions.
    let commands: [&[u8]; 2] = [&[0x83, 1, 0x00], &[0x84, 2, 0x00, 0x03]];
    let list: Vec<u8> = commands.concat();
    let mut body = vec![list.len() as u8];
    body.extend_from_slice(&list);
    while body.len() % 4 != 0 {
        body.push(0);
    }
    let mut d = Vec::with_capacity(4 + body.len());
    d.extend_from_slice(&0x0001u16.to_be_bytes()); // Supported Commands.
    d.extend_from_slice(&(body.len() as u16).to_be_bytes());
    d.extend_from_slice(&body);
    d
}

#[cfg(test)]
mod tests {
    use super::*;

    fn unit(lun: u16) -> CopyTarget {
        CopyTarget {
            lun,
            naa: [0x30 | lun as u8, 1, 2, 3, 4, 5, 6, 7],
            block_size: 512,
            blocks: 10_000,
        }
    }

    fn target(u: &CopyTarget) -> Vec<u8> {
        let mut d = vec![0u8; 32];
        d[0] = 0xe4;
        d[4] = 0x01; // Binary code set.
        d[5] = 0x03; // NAA.
        d[7] = 8;
        d[8..16].copy_from_slice(&u.naa);
        d[29..32].copy_from_slice(&u.block_size.to_be_bytes()[1..]);
        d
    }

    fn segment(src: u16, dst: u16, blocks: u16, from: u64, to: u64) -> Vec<u8> {
        let mut d = vec![0u8; 28];
        d[0] = 0x02;
        d[2..4].copy_from_slice(&24u16.to_be_bytes());
        d[4..6].copy_from_slice(&src.to_be_bytes());
        d[6..8].copy_from_slice(&dst.to_be_bytes());
        d[10..12].copy_from_slice(&blocks.to_be_bytes());
        d[12..20].copy_from_slice(&from.to_be_bytes());
        d[20..28].copy_from_slice(&to.to_be_bytes());
        d
    }

    fn list(targets: &[Vec<u8>], segments: &[Vec<u8>]) -> Vec<u8> {
        let t: Vec<u8> = targets.concat();
        let s: Vec<u8> = segments.concat();
        let mut d = vec![0u8; 16];
        d[0] = 7;
        d[2..4].copy_from_slice(&(t.len() as u16).to_be_bytes());
        d[8..12].copy_from_slice(&(s.len() as u32).to_be_bytes());
        d.extend_from_slice(&t);
        d.extend_from_slice(&s);
        d
    }

    fn asc(e: Sense) -> (SenseKey, u8, u8) {
        (e.key, e.asc.0, e.asc.1)
    }

    #[test]
    fn a_plan_between_two_units_resolves_and_chunks() {
        let units = [unit(0), unit(1)];
        let d = list(
            &[target(&units[0]), target(&units[1])],
            &[segment(0, 1, 3000, 10, 20)],
        );
        let plan = parse(&d, &units).unwrap();
        assert_eq!((plan.list_id, plan.hold), (7, true));
        assert_eq!(plan.segments[0].destination.lun, 1);
        let ops = ops(&plan);
        // 3000 blocks in chunks of 2048: read, write, read, write.
        assert_eq!(ops.len(), 4);
        assert_eq!(
            ops[1],
            (
                1,
                Op::Write {
                    lba: 20,
                    blocks: 2048,
                    offset: 0,
                    fua: false
                }
            )
        );
        assert_eq!(
            ops[2].1,
            Op::Read {
                lba: 10 + 2048,
                blocks: 952,
                offset: 0,
                fua: false
            }
        );
    }

    #[test]
    fn an_overlapping_forward_copy_runs_from_the_end() {
        let units = [unit(0)];
        let d = list(&[target(&units[0])], &[segment(0, 0, 4096, 0, 100)]);
        let ops = ops(&parse(&d, &units).unwrap());
        assert!(matches!(ops[0].1, Op::Read { lba: 2048, .. }));
        assert!(matches!(ops[3].1, Op::Write { lba: 100, .. }));
    }

    #[test]
    fn refusals() {
        let units = [unit(0)];
        let t = target(&units[0]);
        let s = segment(0, 0, 8, 0, 100);
        let full = list(std::slice::from_ref(&t), std::slice::from_ref(&s));
        // Truncated anywhere: PARAMETER LIST LENGTH ERROR.
        for cut in [8, 16 + 31, full.len() - 1] {
            assert_eq!(
                asc(parse(&full[..cut], &units).unwrap_err()),
                (SenseKey::IllegalRequest, 0x1a, 0x00),
                "cut at {cut}"
            );
        }
        let many_targets = list(&vec![t.clone(); 9], std::slice::from_ref(&s));
        assert_eq!(
            asc(parse(&many_targets, &units).unwrap_err()),
            (SenseKey::IllegalRequest, 0x26, 0x06)
        );
        let many_segments = list(std::slice::from_ref(&t), &vec![s.clone(); 65]);
        assert_eq!(
            asc(parse(&many_segments, &units).unwrap_err()),
            (SenseKey::IllegalRequest, 0x26, 0x08)
        );
        let mut fc = t.clone();
        fc[0] = 0xe0;
        assert_eq!(
            asc(parse(&list(&[fc], std::slice::from_ref(&s)), &units).unwrap_err()),
            (SenseKey::IllegalRequest, 0x26, 0x07)
        );
        let mut stream = s.clone();
        stream[0] = 0x03;
        assert_eq!(
            asc(parse(&list(std::slice::from_ref(&t), &[stream]), &units).unwrap_err()),
            (SenseKey::IllegalRequest, 0x26, 0x09)
        );
        let bad_index = list(std::slice::from_ref(&t), &[segment(0, 1, 8, 0, 0)]);
        assert_eq!(
            parse(&bad_index, &units).unwrap_err().key,
            SenseKey::CopyAborted
        );
        let beyond = list(std::slice::from_ref(&t), &[segment(0, 0, 8, 0, 9_999)]);
        assert_eq!(
            parse(&beyond, &units).unwrap_err().key,
            SenseKey::CopyAborted
        );
        let other = list(&[target(&unit(5))], std::slice::from_ref(&s));
        assert_eq!(
            asc(parse(&other, &units).unwrap_err()),
            (SenseKey::CopyAborted, 0x08, 0x04)
        );
    }

    #[test]
    fn results_pages() {
        let p = operating_parameters();
        assert_eq!(
            u32::from_be_bytes(p[0..4].try_into().unwrap()) as usize,
            p.len() - 4
        );
        assert_eq!(u16::from_be_bytes([p[8], p[9]]), 8);
        assert_eq!(&p[44..], &[0x02, 0xe4]);
        let s = copy_status(1, 4096);
        assert_eq!((s[3], s[6], s[11]), (8, 1, 0x00));
        assert_eq!(u32::from_be_bytes(s[8..12].try_into().unwrap()), 4096);
        let v = vpd_page();
        assert_eq!(v.len() % 4, 0);
        assert_eq!(&v[..2], &[0, 1]);
    }
}
