//! The handlers of SBC-3's commands in the command table
//! ([`crate::spc::opcodes`]): each turns a CDB whose reserved bits are checked into the
//! task's first [`Step`].

use crate::backend::{Op, Output};
use crate::cdb::BlockIo;
use crate::device::{AfterData, Device, Finish, OpList, Parameters, Reply, Step, TaskError};
use crate::dispatch::{be16, be32, be64, data, in_range, internal, writable, Cdb};
use crate::sbc::{block, capacity, lba_status};
use crate::sense::{Asc, FieldPointer, Sense, SenseKey};

/// FORMAT UNIT: nothing to format, but a write-protected unit refuses.
pub(crate) fn format_unit(_: &mut Device, c: &Cdb<'_>) -> Result<Step, TaskError> {
    writable(&c.geometry, c.swp)?;
    Ok(Step::Done(Reply::Good))
}

/// READ and WRITE (6), (10), (12) and (16).
pub(crate) fn read_write(d: &mut Device, c: &Cdb<'_>) -> Result<Step, TaskError> {
    let io = BlockIo::decode(c.cdb)?;
    let op = if io.write {
        Op::Write {
            lba: io.lba,
            blocks: io.blocks,
            offset: 0,
            fua: io.fua,
        }
    } else {
        Op::Read {
            lba: io.lba,
            blocks: io.blocks,
            offset: 0,
            fua: io.fua,
        }
    };
    // Where TRANSFER LENGTH is, for the sense that points at it.
    let field = match c.cdb.len() {
        6 => 4,
        10 => 7,
        12 => 6,
        _ => 10,
    };
    d.transfer(c, op, io.lba, io.blocks, field)
}

/// START STOP UNIT: START and LOEJ in the active power condition (a prevented unit is not
/// ejected).
pub(crate) fn start_stop_unit(d: &mut Device, c: &Cdb<'_>) -> Result<Step, TaskError> {
    let power_condition = c.cdb[4] >> 4;
    let (loej, start) = (c.cdb[4] & 0x02 != 0, c.cdb[4] & 0x01 != 0);
    let lu = d.lu_mut(c.lun).ok_or_else(internal)?;
    if power_condition == 0 {
        if loej && !lu.prevent.is_empty() {
            let sense = Sense::new(SenseKey::IllegalRequest, Asc::MEDIUM_REMOVAL_PREVENTED);
            return Err(sense.into());
        }
        lu.stopped = !start;
    }
    Ok(Step::Done(Reply::Good))
}

/// PREVENT ALLOW MEDIUM REMOVAL, per I_T nexus.
pub(crate) fn prevent_allow_medium_removal(d: &mut Device, c: &Cdb<'_>) -> Result<Step, TaskError> {
    let me = d.nexus_name(c.nexus)?;
    let lu = d.lu_mut(c.lun).ok_or_else(internal)?;
    lu.prevent.retain(|n| n != &me);
    match c.cdb[4] & 0x03 {
        0x00 => {}
        0x01 => lu.prevent.push(me),
        _ => return Err(Sense::invalid_field_in_cdb(FieldPointer::cdb_bit(4, 1)).into()),
    }
    Ok(Step::Done(Reply::Good))
}

/// READ CAPACITY (10).
pub(crate) fn read_capacity10(_: &mut Device, c: &Cdb<'_>) -> Result<Step, TaskError> {
    data(capacity::read_capacity10(&c.geometry, c.cdb).map(|d| d.to_vec()))
}

/// READ CAPACITY (16).
pub(crate) fn read_capacity16(_: &mut Device, c: &Cdb<'_>) -> Result<Step, TaskError> {
    data(capacity::read_capacity16(&c.geometry, c.cdb))
}

/// WRITE AND VERIFY (10), (12) and (16): a write through to the medium (BYTCHK 0 or 1 only).
pub(crate) fn write_and_verify(d: &mut Device, c: &Cdb<'_>) -> Result<Step, TaskError> {
    let (lba, blocks, field) = block::lba_and_length(c.cdb);
    if block::bytchk(c.cdb) > 1 {
        return Err(Sense::invalid_field_in_cdb(FieldPointer::cdb_bit(1, 2)).into());
    }
    let op = Op::Write {
        lba,
        blocks,
        offset: 0,
        fua: true,
    };
    d.transfer(c, op, lba, blocks, field)
}

/// VERIFY (10), (12) and (16): medium verification (BYTCHK 0) or a compare with the
/// data-out, block by block (1) or one block against each (3).
pub(crate) fn verify(_: &mut Device, c: &Cdb<'_>) -> Result<Step, TaskError> {
    let (lba, blocks, field) = block::lba_and_length(c.cdb);
    let bytchk = block::bytchk(c.cdb);
    if bytchk == 2 {
        return Err(Sense::invalid_field_in_cdb(FieldPointer::cdb_bit(1, 2)).into());
    }
    if blocks > c.limits.max_transfer {
        return Err(Sense::invalid_field_in_cdb(FieldPointer::cdb(field)).into());
    }
    in_range(lba, blocks.into(), &c.geometry)?;
    if blocks == 0 || bytchk == 0 {
        // Medium verification: the medium is readable by construction.
        return Ok(Step::Done(Reply::Good));
    }
    let same = bytchk == 3;
    let bs = c.geometry.block_size;
    let len = if same { bs } else { blocks * bs };
    let op = Op::Compare {
        lba,
        blocks,
        offset: 0,
        same,
    };
    Ok(Step::DataOut {
        len,
        then: AfterData::Ops(OpList::One(op), Finish::Good),
    })
}

/// PRE-FETCH (10) and (16).
pub(crate) fn pre_fetch(_: &mut Device, c: &Cdb<'_>) -> Result<Step, TaskError> {
    let (lba, blocks, _) = block::lba_and_length(c.cdb);
    in_range(lba, blocks.into(), &c.geometry)?;
    if blocks == 0 {
        return Ok(Step::Done(Reply::Good));
    }
    let op = Op::Prefetch {
        lba,
        blocks: blocks.into(),
    };
    Ok(Step::Ops(OpList::One(op), Finish::Good))
}

/// SYNCHRONIZE CACHE (10) and (16).
pub(crate) fn synchronize_cache(_: &mut Device, c: &Cdb<'_>) -> Result<Step, TaskError> {
    let (lba, blocks, _) = block::lba_and_length(c.cdb);
    in_range(lba, blocks.into(), &c.geometry)?;
    let op = Op::Flush {
        lba,
        blocks: blocks.into(),
    };
    Ok(Step::Ops(OpList::One(op), Finish::Good))
}

/// READ DEFECT DATA (10) and (12): an empty list.
pub(crate) fn read_defect_data(_: &mut Device, c: &Cdb<'_>) -> Result<Step, TaskError> {
    let alloc = if c.cdb[0] == 0x37 {
        be16(c.cdb, 7)
    } else {
        be32(c.cdb, 6)
    };
    let mut bytes = block::read_defect_data(c.cdb)?;
    bytes.truncate(alloc as usize);
    data(Ok(bytes))
}

/// WRITE SAME (10) and (16): one block of data-out written over the range, or unmapped
/// (UNMAP, thin units only), or zeros without data-out (NDOB).
pub(crate) fn write_same(d: &mut Device, c: &Cdb<'_>) -> Result<Step, TaskError> {
    let (cdb, g) = (c.cdb, &c.geometry);
    writable(g, c.swp)?;
    let (lba, blocks, field) = block::lba_and_length(cdb);
    let anchor = cdb[1] & 0x10 != 0;
    let unmap = cdb[1] & 0x08 != 0;
    let ndob = cdb[0] == 0x93 && cdb[1] & 0x01 != 0;
    if anchor {
        return Err(Sense::invalid_field_in_cdb(FieldPointer::cdb_bit(1, 4)).into());
    }
    if unmap && !g.thin {
        // A fully provisioned unit declares LBPWS and LBPWS10 zero (VPD B2h): asked to
        // unmap, it refuses rather than quietly write, as libiscsi's UnmapVPD tests and
        // LIO take it.
        return Err(Sense::invalid_field_in_cdb(FieldPointer::cdb_bit(1, 3)).into());
    }
    if blocks == 0 {
        // WSNZ is set in the Block Limits page.
        return Err(Sense::invalid_field_in_cdb(FieldPointer::cdb(field)).into());
    }
    if u64::from(blocks) > c.limits.max_write_same {
        return Err(Sense::invalid_field_in_cdb(FieldPointer::cdb(field)).into());
    }
    in_range(lba, blocks.into(), g)?;
    let op = Op::WriteSame {
        lba,
        blocks: blocks.into(),
        zeros: ndob,
        unmap,
        fua: false,
    };
    if ndob {
        return Ok(Step::Ops(OpList::One(op), Finish::Good));
    }
    // One block of data-out, exactly: more or less is an initiator that means another
    // command.
    if d.task(c.id).is_ok_and(|t| t.data_out_len != g.block_size) {
        return Err(Sense::invalid_field_in_cdb(FieldPointer::cdb(field)).into());
    }
    Ok(Step::DataOut {
        len: g.block_size,
        then: AfterData::Ops(OpList::One(op), Finish::Good),
    })
}

/// UNMAP (thin units): the parameter list, then [`Parameters::Unmap`].
pub(crate) fn unmap(d: &mut Device, c: &Cdb<'_>) -> Result<Step, TaskError> {
    if !c.geometry.thin {
        return Err(Sense::invalid_opcode().into());
    }
    writable(&c.geometry, c.swp)?;
    if c.cdb[1] & 0x01 != 0 {
        // ANCHOR: anchored blocks are not supported (ANC_SUP 0).
        return Err(Sense::invalid_field_in_cdb(FieldPointer::cdb_bit(1, 0)).into());
    }
    let len = be16(c.cdb, 7);
    if len > 0 && len < 8 {
        return Err(Sense::parameter_list_length_error().into());
    }
    d.parameter_list(c.id, len, Parameters::Unmap)
}

/// COMPARE AND WRITE: the verify and the write data, exactly, then both as one operation.
pub(crate) fn compare_and_write(d: &mut Device, c: &Cdb<'_>) -> Result<Step, TaskError> {
    let (cdb, g) = (c.cdb, &c.geometry);
    writable(g, c.swp)?;
    let lba = be64(cdb, 2);
    let blocks = u32::from(cdb[13]);
    if blocks > u32::from(c.limits.max_compare_and_write) {
        return Err(Sense::invalid_field_in_cdb(FieldPointer::cdb(13)).into());
    }
    in_range(lba, blocks.into(), g)?;
    if blocks == 0 {
        // Nothing to compare, yet the initiator means to send data: the length field is
        // not what it meant (say 256 blocks wrapped to 0).
        if d.task(c.id).map_or(0, |t| t.data_out_len) > 0 {
            return Err(Sense::invalid_field_in_cdb(FieldPointer::cdb(13)).into());
        }
        return Ok(Step::Done(Reply::Good));
    }
    if d.task(c.id)
        .is_ok_and(|t| t.data_out_len != 2 * blocks * g.block_size)
    {
        return Err(Sense::invalid_field_in_cdb(FieldPointer::cdb(13)).into());
    }
    let op = Op::CompareAndWrite {
        lba,
        blocks,
        fua: cdb[1] & 0x08 != 0,
    };
    Ok(Step::DataOut {
        len: 2 * blocks * g.block_size,
        then: AfterData::Ops(OpList::One(op), Finish::Good),
    })
}

/// ORWRITE (16).
pub(crate) fn orwrite(d: &mut Device, c: &Cdb<'_>) -> Result<Step, TaskError> {
    let (lba, blocks, field) = block::lba_and_length(c.cdb);
    let op = Op::OrWrite {
        lba,
        blocks,
        fua: c.cdb[1] & 0x08 != 0,
    };
    d.transfer(c, op, lba, blocks, field)
}

/// WRITE ATOMIC (16): a write no larger than the unit's atomic limits, with no boundary.
pub(crate) fn write_atomic(d: &mut Device, c: &Cdb<'_>) -> Result<Step, TaskError> {
    let lba = be64(c.cdb, 2);
    if be16(c.cdb, 10) != 0 {
        // ATOMIC BOUNDARY: the unit reports no boundary support.
        return Err(Sense::invalid_field_in_cdb(FieldPointer::cdb(10)).into());
    }
    let blocks = be16(c.cdb, 12);
    let op = Op::Write {
        lba,
        blocks,
        offset: 0,
        fua: c.cdb[1] & 0x08 != 0,
    };
    d.transfer(c, op, lba, blocks, 12)
}

/// GET LBA STATUS: a fully provisioned unit is mapped throughout; a thin one asks its
/// backend.
pub(crate) fn get_lba_status(_: &mut Device, c: &Cdb<'_>) -> Result<Step, TaskError> {
    let g = &c.geometry;
    let lba = be64(c.cdb, 2);
    let alloc = be32(c.cdb, 10);
    if lba >= g.blocks {
        return Err(Sense::lba_out_of_range().into());
    }
    if !g.thin {
        let out = Output::LbaStatus {
            mapped: true,
            blocks: g.blocks - lba,
        };
        return data(Ok(lba_status::descriptor(lba, out, alloc)));
    }
    Ok(Step::Ops(
        OpList::One(Op::LbaStatus { lba }),
        Finish::LbaStatus { lba, alloc },
    ))
}
