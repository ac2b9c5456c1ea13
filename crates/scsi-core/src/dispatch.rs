//! From an enabled task's CDB to what it does: the command table's reserved-bit check, then
//! one arm per command, each handing back a [`Step`].

use std::collections::VecDeque;

use crate::backend::Op;
use crate::cdb::{check_control, BlockIo};
use crate::device::{AfterData, Device, Finish, OpList, Parameters, Reply, Step, TaskError};
use crate::lu::Geometry;
use crate::pr::ReservationRequest;
use crate::sbc::{block, capacity, unmap};
use crate::sense::{Asc, FieldPointer, Sense, SenseKey};
use crate::spc::{copy, inquiry, log, mode, opcodes, report_luns, tpg};
use crate::task::TaskId;

fn internal() -> TaskError {
    Sense::new(SenseKey::HardwareError, Asc::INTERNAL_TARGET_FAILURE).into()
}

fn be16(cdb: &[u8], at: usize) -> u32 {
    u32::from(u16::from_be_bytes([cdb[at], cdb[at + 1]]))
}

fn be32(cdb: &[u8], at: usize) -> u32 {
    u32::from_be_bytes(cdb[at..at + 4].try_into().unwrap())
}

fn writable(g: &Geometry, swp: bool) -> Result<(), TaskError> {
    if g.read_only || swp {
        return Err(Sense::new(SenseKey::DataProtect, Asc::WRITE_PROTECTED).into());
    }
    Ok(())
}

fn in_range(lba: u64, blocks: u64, g: &Geometry) -> Result<(), TaskError> {
    match lba.checked_add(blocks) {
        Some(end) if end <= g.blocks => Ok(()),
        _ => Err(Sense::lba_out_of_range().into()),
    }
}

impl Device {
    /// Decodes and starts the task's command; `info` is its entry in the command table.
    pub(crate) fn dispatch(
        &mut self,
        id: TaskId,
        info: &'static opcodes::CommandInfo,
    ) -> Result<Step, TaskError> {
        let t = self.task(id).map_err(|_| internal())?;
        let (cdb, lun, nexus) = (t.cdb, t.lun, t.nexus);
        let len = info.usage.len();
        let cdb = &cdb[..len];
        check_control(cdb, len)?;
        // Every bit the command does not use is reserved.
        for (i, (&byte, &usage)) in cdb.iter().zip(info.usage).enumerate().take(len - 1).skip(1) {
            let extra = byte & !usage;
            if extra != 0 {
                let bit = 7 - extra.leading_zeros() as u8;
                return Err(
                    Sense::invalid_field_in_cdb(FieldPointer::cdb_bit(i as u16, bit)).into(),
                );
            }
        }
        let lu = self.lu(lun).ok_or_else(internal)?;
        let g = lu.unit.geometry;
        let limits = lu.unit.limits;
        let swp = lu.swp;
        let bs = g.block_size;
        let data = |d: Result<Vec<u8>, Sense>| -> Result<Step, TaskError> {
            Ok(Step::Done(Reply::Data(d?)))
        };
        match cdb[0] {
            0x00 => Ok(Step::Done(Reply::Good)),
            0x03 => {
                let desc = cdb[1] & 0x01 != 0;
                let n = self.nexus_ua_pop(nexus, lun);
                let sense = match n {
                    Some(asc) => Sense::unit_attention(asc),
                    None => Sense::new(SenseKey::NoSense, Asc::NO_ADDITIONAL_SENSE),
                };
                let mut d = sense.encode(desc).as_slice().to_vec();
                d.truncate(usize::from(cdb[4]));
                data(Ok(d))
            }
            0x04 => {
                writable(&g, swp)?;
                Ok(Step::Done(Reply::Good))
            }
            0x08 | 0x0a | 0x28 | 0x2a | 0x88 | 0x8a | 0xa8 | 0xaa => {
                let io = BlockIo::decode(cdb)?;
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
                let field = match len {
                    6 => 4,
                    10 => 7,
                    12 => 6,
                    _ => 10,
                };
                self.transfer(
                    id,
                    op,
                    io.lba,
                    io.blocks,
                    field,
                    &g,
                    swp,
                    limits.max_transfer,
                )
            }
            0x12 => {
                let port = self
                    .ports
                    .iter()
                    .find(|p| Some(p.relative_port) == self.relative_port(nexus))
                    .or(self.ports.first())
                    .cloned()
                    .ok_or_else(internal)?;
                data(inquiry::inquiry(&lu.unit, &port, cdb))
            }
            0x15 | 0x55 => {
                mode::check_mode_select(cdb)?;
                let ten = cdb[0] == 0x55;
                let plen = if ten { be16(cdb, 7) } else { u32::from(cdb[4]) };
                self.parameter_list(id, plen, Parameters::ModeSelect { ten })
            }
            0x16 | 0x56 => self.change_reservations(id, ReservationRequest::Reserve),
            0x17 | 0x57 => self.change_reservations(id, ReservationRequest::Release),
            0x1a | 0x5a => {
                let ten = cdb[0] == 0x5a;
                let m = self.mode_parameters(lun);
                let alloc = if ten { be16(cdb, 7) } else { u32::from(cdb[4]) };
                let mut d = mode::mode_sense(cdb, ten, &g, &m, self.default_wce(lun))?;
                d.truncate(alloc as usize);
                data(Ok(d))
            }
            0x1b => {
                let power_condition = cdb[4] >> 4;
                let (loej, start) = (cdb[4] & 0x02 != 0, cdb[4] & 0x01 != 0);
                let lu = self.lu_mut(lun).ok_or_else(internal)?;
                if power_condition == 0 {
                    if loej && !lu.prevent.is_empty() {
                        return Err(Sense::new(
                            SenseKey::IllegalRequest,
                            Asc::MEDIUM_REMOVAL_PREVENTED,
                        )
                        .into());
                    }
                    lu.stopped = !start;
                }
                Ok(Step::Done(Reply::Good))
            }
            0x1e => {
                let me = self.nexus_name(nexus)?;
                let lu = self.lu_mut(lun).ok_or_else(internal)?;
                lu.prevent.retain(|n| n != &me);
                if cdb[4] & 0x03 == 0x01 {
                    lu.prevent.push(me);
                } else if cdb[4] & 0x03 != 0 {
                    return Err(Sense::invalid_field_in_cdb(FieldPointer::cdb_bit(4, 1)).into());
                }
                Ok(Step::Done(Reply::Good))
            }
            0x25 => data(capacity::read_capacity10(&g, cdb).map(|d| d.to_vec())),
            0x2e | 0x8e | 0xae => {
                let (lba, blocks, field) = block::lba_and_length(cdb);
                if block::bytchk(cdb) > 1 {
                    return Err(Sense::invalid_field_in_cdb(FieldPointer::cdb_bit(1, 2)).into());
                }
                let op = Op::Write {
                    lba,
                    blocks,
                    offset: 0,
                    fua: true,
                };
                self.transfer(id, op, lba, blocks, field, &g, swp, limits.max_transfer)
            }
            0x2f | 0x8f | 0xaf => {
                let (lba, blocks, field) = block::lba_and_length(cdb);
                let bytchk = block::bytchk(cdb);
                if bytchk == 2 {
                    return Err(Sense::invalid_field_in_cdb(FieldPointer::cdb_bit(1, 2)).into());
                }
                if blocks > limits.max_transfer {
                    return Err(Sense::invalid_field_in_cdb(FieldPointer::cdb(field)).into());
                }
                in_range(lba, blocks.into(), &g)?;
                if blocks == 0 || bytchk == 0 {
                    // Medium verification: the medium is readable by construction.
                    return Ok(Step::Done(Reply::Good));
                }
                let same = bytchk == 3;
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
            0x34 | 0x90 => {
                let (lba, blocks, _) = block::lba_and_length(cdb);
                in_range(lba, blocks.into(), &g)?;
                if blocks == 0 {
                    return Ok(Step::Done(Reply::Good));
                }
                let op = Op::Prefetch {
                    lba,
                    blocks: blocks.into(),
                };
                Ok(Step::Ops(OpList::One(op), Finish::Good))
            }
            0x35 | 0x91 => {
                let (lba, blocks, _) = block::lba_and_length(cdb);
                in_range(lba, blocks.into(), &g)?;
                let op = Op::Flush {
                    lba,
                    blocks: blocks.into(),
                };
                Ok(Step::Ops(OpList::One(op), Finish::Good))
            }
            0x37 | 0xb7 => {
                let alloc = if cdb[0] == 0x37 {
                    be16(cdb, 7)
                } else {
                    be32(cdb, 6)
                };
                let mut d = block::read_defect_data(cdb)?;
                d.truncate(alloc as usize);
                data(Ok(d))
            }
            0x41 | 0x93 => self.write_same(id, cdb, &g, swp, limits.max_write_same),
            0x42 => {
                if !g.thin {
                    return Err(Sense::invalid_opcode().into());
                }
                writable(&g, swp)?;
                if cdb[1] & 0x01 != 0 {
                    // ANCHOR: anchored blocks are not supported (ANC_SUP 0).
                    return Err(Sense::invalid_field_in_cdb(FieldPointer::cdb_bit(1, 0)).into());
                }
                let plen = be16(cdb, 7);
                if plen > 0 && plen < 8 {
                    return Err(Sense::parameter_list_length_error().into());
                }
                self.parameter_list(id, plen, Parameters::Unmap)
            }
            0x4d => {
                let mut d = log::log_sense(cdb)?;
                d.truncate(be16(cdb, 7) as usize);
                data(Ok(d))
            }
            0x5e => {
                let alloc = be16(cdb, 7) as usize;
                let capable = self.ptpl_capable(lun);
                data(
                    lu.reservations
                        .persistent
                        .read(cdb[1] & 0x1f, alloc, capable),
                )
            }
            0x5f => {
                let plen = be32(cdb, 5);
                let action = cdb[1] & 0x1f;
                if plen == 0 {
                    // Every service action needs at least the basic parameter list.
                    return Err(Sense::parameter_list_length_error().into());
                }
                self.parameter_list(
                    id,
                    plen,
                    Parameters::PersistentReserveOut {
                        action,
                        scope_type: cdb[2],
                    },
                )
            }
            0x89 => {
                writable(&g, swp)?;
                let lba = u64::from_be_bytes(cdb[2..10].try_into().unwrap());
                let blocks = u32::from(cdb[13]);
                if blocks > u32::from(limits.max_compare_and_write) {
                    return Err(Sense::invalid_field_in_cdb(FieldPointer::cdb(13)).into());
                }
                in_range(lba, blocks.into(), &g)?;
                if blocks == 0 {
                    // Nothing to compare, yet the initiator means to send data: the length
                    // field is not what it meant (say 256 blocks wrapped to 0).
                    let sends = self.task(id).map_or(0, |t| t.data_out_len);
                    if sends > 0 {
                        return Err(Sense::invalid_field_in_cdb(FieldPointer::cdb(13)).into());
                    }
                    return Ok(Step::Done(Reply::Good));
                }
                // The verify and the write data, exactly.
                if self
                    .task(id)
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
                    len: 2 * blocks * bs,
                    then: AfterData::Ops(OpList::One(op), Finish::Good),
                })
            }
            0x8b => {
                let (lba, blocks, field) = block::lba_and_length(cdb);
                let op = Op::OrWrite {
                    lba,
                    blocks,
                    fua: cdb[1] & 0x08 != 0,
                };
                self.transfer(id, op, lba, blocks, field, &g, swp, limits.max_transfer)
            }
            0x9c => {
                let lba = u64::from_be_bytes(cdb[2..10].try_into().unwrap());
                if be16(cdb, 10) != 0 {
                    // ATOMIC BOUNDARY: the unit reports no boundary support.
                    return Err(Sense::invalid_field_in_cdb(FieldPointer::cdb(10)).into());
                }
                let blocks = be16(cdb, 12);
                let op = Op::Write {
                    lba,
                    blocks,
                    offset: 0,
                    fua: cdb[1] & 0x08 != 0,
                };
                self.transfer(id, op, lba, blocks, 12, &g, swp, limits.max_transfer)
            }
            0x83 => {
                // EXTENDED COPY (LID1): the opcode table admits service action 00h only.
                let plen = u32::from_be_bytes(cdb[10..14].try_into().unwrap());
                self.parameter_list(id, plen, Parameters::ExtendedCopy)
            }
            0x84 => {
                let alloc = u32::from_be_bytes(cdb[10..14].try_into().unwrap()) as usize;
                let mut d = if cdb[1] & 0x1f == 0x03 {
                    copy::operating_parameters()
                } else {
                    self.held_copy_status(id, cdb[2])?.to_vec()
                };
                d.truncate(alloc);
                Ok(Step::Done(Reply::Data(d)))
            }
            0x9e if cdb[1] & 0x1f == capacity::SERVICE_ACTION_READ_CAPACITY_16 => {
                data(capacity::read_capacity16(&g, cdb))
            }
            0x9e => {
                let lba = u64::from_be_bytes(cdb[2..10].try_into().unwrap());
                let alloc = be32(cdb, 10);
                if lba >= g.blocks {
                    return Err(Sense::lba_out_of_range().into());
                }
                if !g.thin {
                    let out = crate::backend::Output::LbaStatus {
                        mapped: true,
                        blocks: g.blocks - lba,
                    };
                    return data(Ok(crate::sbc::lba_status::descriptor(lba, out, alloc)));
                }
                Ok(Step::Ops(
                    OpList::One(Op::LbaStatus { lba }),
                    Finish::LbaStatus { lba, alloc },
                ))
            }
            0xa0 => {
                let luns = self.luns();
                let d = report_luns::report_luns(&luns, cdb)?;
                if let Some(n) = self.nexus_mut(nexus) {
                    n.unit_attentions
                        .retain(|&(_, asc)| asc != Asc::REPORTED_LUNS_DATA_HAS_CHANGED);
                }
                data(Ok(d))
            }
            0xa3 => {
                let alloc = be32(cdb, 6) as usize;
                let mut d = match cdb[1] & 0x1f {
                    0x0a => {
                        let set = lu.port_groups.is_some();
                        let groups = self.port_groups(lun).ok_or_else(internal)?;
                        tpg::report_target_port_groups(&groups, cdb[1] & 0x20 != 0, set)
                    }
                    0x0c => return data(opcodes::report_supported_operation_codes(cdb)),
                    _ => return data(opcodes::report_supported_tmfs(cdb)),
                };
                d.truncate(alloc);
                data(Ok(d))
            }
            _ => Err(Sense::invalid_opcode().into()),
        }
    }

    /// A block transfer: READ-like ops return data, write-like ops fetch it first.
    #[allow(clippy::too_many_arguments)]
    fn transfer(
        &mut self,
        id: TaskId,
        op: Op,
        lba: u64,
        blocks: u32,
        length_field: u16,
        g: &Geometry,
        swp: bool,
        max_transfer: u32,
    ) -> Result<Step, TaskError> {
        let reads = matches!(op, Op::Read { .. });
        if !reads {
            writable(g, swp)?;
        }
        if blocks > max_transfer {
            return Err(Sense::invalid_field_in_cdb(FieldPointer::cdb(length_field)).into());
        }
        in_range(lba, blocks.into(), g)?;
        let len = u64::from(blocks) * u64::from(g.block_size);
        let len = u32::try_from(len).map_err(|_| internal())?;
        if let Ok(t) = self.task_mut(id) {
            t.wanted = Some(u64::from(len));
        }
        if blocks == 0 {
            return Ok(Step::Done(Reply::Good));
        }
        if reads {
            Ok(Step::Ops(OpList::One(op), Finish::ReadData { len }))
        } else {
            Ok(Step::DataOut {
                len,
                then: AfterData::Ops(OpList::One(op), Finish::Good),
            })
        }
    }

    /// WRITE SAME (10) and (16).
    fn write_same(
        &mut self,
        id: TaskId,
        cdb: &[u8],
        g: &Geometry,
        swp: bool,
        max: u64,
    ) -> Result<Step, TaskError> {
        writable(g, swp)?;
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
        if u64::from(blocks) > max {
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
        if self.task(id).is_ok_and(|t| t.data_out_len != g.block_size) {
            return Err(Sense::invalid_field_in_cdb(FieldPointer::cdb(field)).into());
        }
        Ok(Step::DataOut {
            len: g.block_size,
            then: AfterData::Ops(OpList::One(op), Finish::Good),
        })
    }

    /// Asks for a parameter list of `len` bytes (none: the command is done).
    fn parameter_list(&mut self, id: TaskId, len: u32, p: Parameters) -> Result<Step, TaskError> {
        if let Ok(t) = self.task_mut(id) {
            t.wanted = Some(u64::from(len));
        }
        if len == 0 {
            return Ok(Step::Done(Reply::Good));
        }
        Ok(Step::DataOut {
            len,
            then: AfterData::Parameters(p),
        })
    }

    /// RECEIVE COPY RESULTS, COPY STATUS: what a finished EXTENDED COPY of this nexus with
    /// `list_id` left; INVALID FIELD IN CDB when there is none.
    fn held_copy_status(&self, id: TaskId, list_id: u8) -> Result<[u8; 12], TaskError> {
        let t = self.task(id).map_err(|_| internal())?;
        let name = &self.nexus(t.nexus).map_err(|_| internal())?.name;
        let lu = self.lu(t.lun).ok_or_else(internal)?;
        lu.copies
            .iter()
            .rev()
            .find(|(n, l, _)| n == name && *l == list_id)
            .map(|(_, _, status)| *status)
            .ok_or_else(|| Sense::invalid_field_in_cdb(FieldPointer::cdb(2)).into())
    }

    /// A parameter list has arrived.
    pub(crate) fn parameters(
        &mut self,
        id: TaskId,
        p: Parameters,
        data: &[u8],
    ) -> Result<Step, TaskError> {
        let t = self.task(id).map_err(|_| internal())?;
        let (lun, nexus) = (t.lun, t.nexus);
        let lu = self.lu(lun).ok_or_else(internal)?;
        let g = lu.unit.geometry;
        match p {
            Parameters::ModeSelect { ten } => {
                let m = self.mode_parameters(lun);
                let new = mode::mode_select(data, ten, &g, &m, self.default_wce(lun))?;
                if new != m {
                    let lu = self.lu_mut(lun).ok_or_else(internal)?;
                    lu.unit.geometry.write_cache = new.write_cache;
                    lu.d_sense = new.d_sense;
                    lu.swp = new.swp;
                    self.unit_attention_all(lun, Asc::MODE_PARAMETERS_CHANGED, Some(nexus));
                }
                Ok(Step::Done(Reply::Good))
            }
            Parameters::ExtendedCopy => {
                let units: Vec<copy::CopyTarget> = self
                    .lus
                    .iter()
                    .enumerate()
                    .filter_map(|(i, lu)| {
                        let u = &lu.as_ref()?.unit;
                        Some(copy::CopyTarget {
                            lun: i as u16,
                            naa: u.identity.naa,
                            block_size: u.geometry.block_size,
                            blocks: u.geometry.blocks,
                        })
                    })
                    .collect();
                let plan = copy::parse(data, &units)?;
                let mut bytes = 0u64;
                for s in &plan.segments {
                    let dst = self.lu(s.destination.lun).ok_or_else(internal)?;
                    writable(&dst.unit.geometry, dst.swp)?;
                    bytes += u64::from(s.blocks) * u64::from(s.source.block_size);
                }
                let finish = Finish::Copied {
                    list_id: plan.list_id,
                    hold: plan.hold,
                    segments: plan.segments.len() as u16,
                    bytes,
                };
                Ok(Step::Ops(OpList::Placed(copy::ops(&plan)), finish))
            }
            Parameters::Unmap => {
                let ranges = unmap::parse(data, &g, &lu.unit.limits)?;
                let ops: VecDeque<Op> = ranges
                    .into_iter()
                    .map(|(lba, blocks)| Op::Unmap { lba, blocks })
                    .collect();
                if ops.is_empty() {
                    return Ok(Step::Done(Reply::Good));
                }
                Ok(Step::Ops(OpList::Many(ops), Finish::Good))
            }
            Parameters::PersistentReserveOut { action, scope_type } => {
                self.persistent_reserve_out(id, lun, action, scope_type, data)
            }
        }
    }

    fn persistent_reserve_out(
        &mut self,
        id: TaskId,
        lun: u16,
        action: u8,
        scope_type: u8,
        data: &[u8],
    ) -> Result<Step, TaskError> {
        let aptpl_at = if action == 7 { 17 } else { 20 };
        if !self.ptpl_capable(lun) && data.get(aptpl_at).is_some_and(|b| b & 0x01 != 0) {
            return Err(
                Sense::invalid_field_in_parameter_list(FieldPointer::parameter_bit(
                    aptpl_at as u16,
                    0,
                ))
                .into(),
            );
        }
        self.change_reservations(
            id,
            ReservationRequest::PersistentReserveOut {
                action,
                scope_type,
                parameters: data.to_vec(),
            },
        )
    }

    /// The mode parameters of a unit as they stand.
    fn mode_parameters(&self, lun: u16) -> mode::ModeParameters {
        let lu = self.lu(lun).expect("tasks live on existing units");
        mode::ModeParameters {
            write_cache: lu.unit.geometry.write_cache,
            d_sense: lu.d_sense,
            swp: lu.swp,
        }
    }
}
