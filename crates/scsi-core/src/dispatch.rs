//! From an enabled task's CDB to what it does: the command table's reserved-bit check, then
//! the handler its table entry names ([`opcodes::CommandInfo`], as tgt's `ops[]`): SPC's in
//! [`crate::spc::commands`], SBC's in [`crate::sbc::commands`], each handing back a [`Step`].
//! What several handlers share is here: a block transfer, a parameter list, the checks of a
//! write and a range, and what the parameter lists do once they have come.

use std::collections::VecDeque;

use crate::backend::Op;
use crate::cdb::check_control;
use crate::device::{AfterData, Device, Finish, OpList, Parameters, Reply, Step, TaskError};
use crate::lu::{Geometry, Limits};
use crate::pr::ReservationRequest;
use crate::sbc::unmap;
use crate::sense::{Asc, FieldPointer, Sense, SenseKey};
use crate::spc::{copy, mode, opcodes};
use crate::task::{NexusId, TaskId};

/// A command as its handler sees it: the task, its CDB (as long as the command's), and the
/// logical unit's state when it started.
#[derive(Debug)]
pub(crate) struct Cdb<'a> {
    /// The task.
    pub(crate) id: TaskId,
    /// The CDB, its reserved bits checked.
    pub(crate) cdb: &'a [u8],
    /// LUN index.
    pub(crate) lun: u16,
    /// The I_T nexus.
    pub(crate) nexus: NexusId,
    /// The unit's geometry.
    pub(crate) geometry: Geometry,
    /// Its limits.
    pub(crate) limits: Limits,
    /// Software write protect (MODE SELECT's SWP).
    pub(crate) swp: bool,
}

/// What a command table entry runs ([`opcodes::CommandInfo`]).
pub(crate) type Handler = fn(&mut Device, &Cdb<'_>) -> Result<Step, TaskError>;

/// The handlers of [`opcodes::for_each_command`]'s list, in its order.
macro_rules! command_handlers {
    ($( $op:literal $(/ $sa:literal)? $access:ident $name:literal [$($u:literal),*]
        => $group:ident :: $handler:ident ;)*) => {
        /// What runs each command of [`opcodes::COMMANDS`], by its index there.
        static HANDLERS: [Handler; opcodes::COMMAND_COUNT] =
            [$(crate::$group::commands::$handler),*];
    };
}

opcodes::for_each_command!(command_handlers);

pub(crate) fn internal() -> TaskError {
    Sense::new(SenseKey::HardwareError, Asc::INTERNAL_TARGET_FAILURE).into()
}

/// Parameter data as the command's answer.
pub(crate) fn data(d: Result<Vec<u8>, Sense>) -> Result<Step, TaskError> {
    Ok(Step::Done(Reply::Data(d?)))
}

pub(crate) fn be16(cdb: &[u8], at: usize) -> u32 {
    u32::from(u16::from_be_bytes([cdb[at], cdb[at + 1]]))
}

pub(crate) fn be32(cdb: &[u8], at: usize) -> u32 {
    u32::from_be_bytes(cdb[at..at + 4].try_into().unwrap())
}

pub(crate) fn be64(cdb: &[u8], at: usize) -> u64 {
    u64::from_be_bytes(cdb[at..at + 8].try_into().unwrap())
}

/// DATA PROTECT, WRITE PROTECTED for a read-only unit or one with SWP set.
pub(crate) fn writable(g: &Geometry, swp: bool) -> Result<(), TaskError> {
    if g.read_only || swp {
        return Err(Sense::new(SenseKey::DataProtect, Asc::WRITE_PROTECTED).into());
    }
    Ok(())
}

/// LOGICAL BLOCK ADDRESS OUT OF RANGE unless `blocks` from `lba` lie on the unit.
pub(crate) fn in_range(lba: u64, blocks: u64, g: &Geometry) -> Result<(), TaskError> {
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
        let command = Cdb {
            id,
            cdb,
            lun,
            nexus,
            geometry: lu.unit.geometry,
            limits: lu.unit.limits,
            swp: lu.swp,
        };
        HANDLERS[info.index](self, &command)
    }

    /// A block transfer of `c`: READ-like ops return data, write-like ops fetch it first.
    /// `length_field` is where the CDB's TRANSFER LENGTH is.
    pub(crate) fn transfer(
        &mut self,
        c: &Cdb<'_>,
        op: Op,
        lba: u64,
        blocks: u32,
        length_field: u16,
    ) -> Result<Step, TaskError> {
        let g = &c.geometry;
        let reads = matches!(op, Op::Read { .. });
        if !reads {
            writable(g, c.swp)?;
        }
        if blocks > c.limits.max_transfer {
            return Err(Sense::invalid_field_in_cdb(FieldPointer::cdb(length_field)).into());
        }
        in_range(lba, blocks.into(), g)?;
        let len = u64::from(blocks) * u64::from(g.block_size);
        let len = u32::try_from(len).map_err(|_| internal())?;
        if let Ok(t) = self.task_mut(c.id) {
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

    /// Asks for a parameter list of `len` bytes (none: the command is done).
    pub(crate) fn parameter_list(
        &mut self,
        id: TaskId,
        len: u32,
        p: Parameters,
    ) -> Result<Step, TaskError> {
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
    pub(crate) fn held_copy_status(&self, id: TaskId, list_id: u8) -> Result<[u8; 12], TaskError> {
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
                let m = self.mode_parameters(lun)?;
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
            Parameters::SetTargetPortGroups => self.set_target_port_groups(id, lun, data),
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
    pub(crate) fn mode_parameters(&self, lun: u16) -> Result<mode::ModeParameters, TaskError> {
        let lu = self.lu(lun).ok_or_else(internal)?;
        Ok(mode::ModeParameters {
            write_cache: lu.unit.geometry.write_cache,
            d_sense: lu.d_sense,
            swp: lu.swp,
        })
    }
}
