//! The device server: logical units, I_T nexuses, the task set and its ordering rules (SAM-5
//! section 8), unit attentions, reservations and task management, driven by commands and
//! completions and answering with [`Action`]s.
//!
//! The life of a task: it enters the task set dormant or enabled by its attribute; once enabled
//! its unit attentions and reservation conflicts are checked and its CDB dispatched; it may
//! then ask for data-out, run backend operations one after another (each write holds its block
//! range against other writers, which makes overlapping writes and COMPARE AND WRITE atomic
//! with respect to each other), and complete. Aborted tasks whose backend operation is in
//! flight end when it completes; a task management function answers once its tasks are gone.

use std::collections::VecDeque;

use crate::backend::{BackendError, Op, Output};
use crate::lu::{LogicalUnit, TargetPort};
use crate::nexus::{ItNexus, TransportId};
use crate::pr::{PrError, PrStore, ReservationEffects, ReservationRequest, Reservations};
use crate::sense::{Asc, Sense, SenseKey};
use crate::spc::opcodes::{self, Access, CommandInfo};
use crate::spc::tpg::PortGroup;
use crate::task::{
    Action, Command, DataIn, Delegation, NexusId, Residual, Status, TaskAttribute, TaskId,
    TmfFunction, TmfResponse,
};

mod alua;
mod handover;
pub use handover::UnitState;
mod attention;
mod reservations;
mod tasks;
mod tmf;

/// SET TARGET PORT GROUPS on a unit whose port groups a keeper decides
/// ([`Device::share_port_groups`]): the states asked, for the keeper, which decides them (a
/// cluster of gateways: the group asked active/optimized becomes the unit's preferred one),
/// gives every device server of the unit its new groups ([`Device::set_port_groups`]) and
/// ends the command ([`Device::port_groups_change_done`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PortGroupsChange {
    /// The command.
    pub task: TaskId,
    /// The unit's LUN index.
    pub lun: u16,
    /// The set target port group descriptors.
    pub requests: Vec<crate::spc::tpg::TargetPortGroupRequest>,
}

/// A change to a unit's shared reservations, for their keeper
/// ([`Device::share_reservations`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReservationChange {
    /// The command that asked, to end with [`Device::reservation_done`]; none for a change
    /// the device server makes itself (nexus loss, LOGICAL UNIT RESET).
    pub task: Option<TaskId>,
    /// The task management function (its reference) that waits for the change, a LOGICAL
    /// UNIT RESET: tell [`Device::task_management_change_done`] once it is carried out.
    pub tmf: Option<u64>,
    /// The unit's LUN index.
    pub lun: u16,
    /// The I_T nexus it is made for.
    pub nexus: ItNexus,
    /// The change.
    pub request: ReservationRequest,
}

/// Why a task ended without GOOD status: each becomes the status (and sense) of the response.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum TaskError {
    /// CHECK CONDITION with this sense.
    Sense(Sense),
    /// RESERVATION CONFLICT.
    ReservationConflict,
}

impl From<Sense> for TaskError {
    fn from(s: Sense) -> TaskError {
        TaskError::Sense(s)
    }
}

impl From<BackendError> for TaskError {
    fn from(e: BackendError) -> TaskError {
        TaskError::Sense(e.into())
    }
}

/// A successful command's answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Reply {
    /// GOOD, nothing to send.
    Good,
    /// GOOD with parameter data (untruncated by the expected length).
    Data(Vec<u8>),
}

/// Backend operations a task runs one after another.
#[derive(Debug, Default)]
pub(crate) enum OpList {
    #[default]
    Empty,
    One(Op),
    Many(VecDeque<Op>),
    /// Operations on named units (EXTENDED COPY moves blocks between units).
    Placed(VecDeque<(u16, Op)>),
}

impl OpList {
    /// The next operation, with its unit when it is not the task's own.
    fn pop(&mut self) -> Option<(Option<u16>, Op)> {
        match std::mem::take(self) {
            OpList::Empty => None,
            OpList::One(op) => Some((None, op)),
            OpList::Many(mut q) => {
                let op = q.pop_front();
                if !q.is_empty() {
                    *self = OpList::Many(q);
                }
                op.map(|op| (None, op))
            }
            OpList::Placed(mut q) => {
                let next = q.pop_front();
                if !q.is_empty() {
                    *self = OpList::Placed(q);
                }
                next.map(|(lun, op)| (Some(lun), op))
            }
        }
    }
}

/// How a task answers once its operations are done.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Finish {
    /// GOOD.
    Good,
    /// GOOD after sending `len` bytes the backend read into the buffer.
    ReadData { len: u32 },
    /// GET LBA STATUS parameter data from the last operation's output.
    LbaStatus { lba: u64, alloc: u32 },
    /// GOOD after an EXTENDED COPY; with `hold`, its status is kept for RECEIVE COPY RESULTS.
    Copied {
        list_id: u8,
        hold: bool,
        segments: u16,
        bytes: u64,
    },
}

/// A command that takes a parameter list.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Parameters {
    ModeSelect { ten: bool },
    Unmap,
    PersistentReserveOut { action: u8, scope_type: u8 },
    ExtendedCopy,
    SetTargetPortGroups,
}

/// What a dispatched command does next.
#[derive(Debug)]
pub(crate) enum Step {
    Done(Reply),
    Ops(OpList, Finish),
    DataOut {
        len: u32,
        then: AfterData,
    },
    /// A change to shared reservations (or port groups) went to their keeper.
    Reserving,
    /// A PREEMPT AND ABORT completes once these tasks it aborted have ended.
    Draining(Vec<TaskId>),
}

/// What happens once data-out has arrived.
#[derive(Debug)]
pub(crate) enum AfterData {
    Ops(OpList, Finish),
    Parameters(Parameters),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    Dormant,
    Enabled,
    DataOut,
    Locked,
    Backend,
    /// Handed to the transport to finish ([`Action::Delegated`]) until it is retired.
    Delegated,
    /// A change to shared reservations, with their keeper until
    /// [`Device::reservation_done`] (or SET TARGET PORT GROUPS until
    /// [`Device::port_groups_change_done`]).
    Reserving,
    /// A PREEMPT AND ABORT that has changed the reservations and waits for the tasks it
    /// aborted to end (their I/O may still reach the medium) before it completes.
    Draining,
}

#[derive(Debug)]
pub(crate) struct Task {
    pub(crate) nexus: NexusId,
    pub(crate) lun: u16,
    pub(crate) tag: u64,
    attribute: TaskAttribute,
    seq: u64,
    pub(crate) cdb: [u8; 16],
    pub(crate) data_in_len: u32,
    pub(crate) data_out_len: u32,
    phase: Phase,
    aborted: bool,
    /// Counted in its unit's task set (commands refused on arrival never are).
    in_set: bool,
    /// Bytes the command transfers, once known, for the residual.
    pub(crate) wanted: Option<u64>,
    ops: OpList,
    finish: Finish,
    after: Option<AfterData>,
    /// The operation in flight or waiting for its range.
    current: Option<Op>,
    /// The unit `current` runs on.
    op_lun: u16,
    output: Output,
}

#[derive(Debug)]
struct Slot<T> {
    generation: u32,
    value: Option<T>,
}

#[derive(Debug)]
pub(crate) struct Nexus {
    pub(crate) name: ItNexus,
    /// Its handle.
    pub(crate) id: NexusId,
    /// Pending unit attentions by LUN index, oldest first.
    pub(crate) unit_attentions: Vec<(u16, Asc)>,
    /// Its transport reports asynchronous events ([`Device::report_unit_attentions`]): each
    /// unit attention established from now on is also an [`Action::UnitAttention`].
    pub(crate) announce: bool,
}

/// A logical unit's state in the device server.
#[derive(Debug)]
pub(crate) struct Lu {
    pub(crate) unit: LogicalUnit,
    /// Control mode page D_SENSE: descriptor-format sense.
    pub(crate) d_sense: bool,
    /// Control mode page SWP: software write protect.
    pub(crate) swp: bool,
    /// WCE as configured, the Caching page's default.
    pub(crate) default_wce: bool,
    /// Stopped by START STOP UNIT: media access reports NOT READY.
    pub(crate) stopped: bool,
    /// I_T nexuses that prevent medium removal.
    pub(crate) prevent: Vec<ItNexus>,
    /// Persistent and SPC-2 reservations.
    pub(crate) reservations: Reservations,
    /// The reservations are kept elsewhere ([`Device::share_reservations`]): the version of
    /// the shared state applied last.
    pub(crate) shared: Option<u64>,
    /// Target port groups and their access states, when the target sets them
    /// ([`Device::set_port_groups`]); the device's own ports, active/optimized, otherwise.
    pub(crate) port_groups: Option<Vec<PortGroup>>,
    /// A keeper decides the port groups' states ([`Device::share_port_groups`]): SET TARGET
    /// PORT GROUPS goes to it.
    pub(crate) port_groups_shared: bool,
    /// Tasks in the task set (not ended).
    live: u32,
    /// Live ORDERED and HEAD OF QUEUE tasks.
    blockers: u32,
    dormant: u32,
    /// Ranges (start, end) held by write operations in flight.
    locks: Vec<(TaskId, u64, u64)>,
    lock_waiters: VecDeque<TaskId>,
    /// Results of finished EXTENDED COPY commands held for RECEIVE COPY RESULTS: the nexus,
    /// the list identifier and the COPY STATUS data, newest last.
    pub(crate) copies: VecDeque<(ItNexus, u8, [u8; 12])>,
}

#[derive(Debug)]
struct PendingTmf {
    nexus: NexusId,
    reference: u64,
    response: TmfResponse,
    waiting: Vec<TaskId>,
    /// Changes to shared reservations (a reset) it waits for the keeper to carry out.
    keeper: usize,
}

/// A SCSI target device: its logical units, the I_T nexuses that reach it and their tasks.
pub struct Device {
    pub(crate) target_name: String,
    pub(crate) ports: Vec<TargetPort>,
    pub(crate) lus: Vec<Option<Lu>>,
    nexuses: Vec<Slot<Nexus>>,
    tasks: Vec<Slot<Task>>,
    free_tasks: Vec<u32>,
    actions: VecDeque<Action>,
    seq: u64,
    tmfs: Vec<PendingTmf>,
    pub(crate) store: Option<Box<dyn PrStore>>,
    /// Changes to shared reservations for their keeper ([`Device::poll_reservation_change`]).
    changes: VecDeque<ReservationChange>,
    /// SET TARGET PORT GROUPS for the port groups' keeper
    /// ([`Device::poll_port_groups_change`]).
    port_groups_changes: VecDeque<PortGroupsChange>,
    /// PREEMPT AND ABORT commands and the aborted tasks each waits for.
    drains: Vec<(TaskId, Vec<TaskId>)>,
    /// Plain reads and writes are delegated to the transport ([`Device::set_delegation`]).
    delegate: bool,
    /// Reused by `retry_lock_waiters` (the waiters it goes through, the ranges of those that
    /// stay), so a write released by another's end allocates nothing.
    scratch: (Vec<TaskId>, Vec<(u64, u64)>),
    /// Unit attentions for I_T nexuses a handover is about to bring (LUN index, ASC): what
    /// shared reservations went through between the process before and this one's reading
    /// of them ([`Device::adopt_unit_state`]), given to each nexus as [`Device::adopt_nexus`]
    /// opens it.
    handed_unit_attentions: Vec<(ItNexus, u16, Asc)>,
}

impl std::fmt::Debug for Device {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Device")
            .field("target_name", &self.target_name)
            .field("luns", &self.luns())
            .field("tasks", &self.task_count())
            .finish()
    }
}

/// Errors of the calls a transport makes; they are the transport's mistakes, not the
/// initiator's.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum DeviceError {
    /// The nexus handle is stale.
    #[error("unknown I_T nexus")]
    UnknownNexus,
    /// The task handle is stale.
    #[error("unknown task")]
    UnknownTask,
    /// The task is not waiting for that event.
    #[error("the task is not waiting for this")]
    WrongPhase,
    /// A logical unit with that LUN exists already, or none does.
    #[error("LUN {0} is in use or absent")]
    Lun(u16),
}

/// The largest LUN index (flat space addressing).
pub const MAX_LUN: u16 = 0x3fff;

/// The 8-byte LUN field of LUN index `index`: peripheral device addressing below 256, flat
/// space addressing above (the inverse of [`lun_index`]).
pub fn lun_number(index: u16) -> u64 {
    let field = if index < 256 {
        index
    } else {
        0x4000 | (index & MAX_LUN)
    };
    u64::from(field) << 48
}

/// The LUN index of an 8-byte LUN field in peripheral or flat space addressing.
pub fn lun_index(lun: u64) -> Option<u16> {
    let b = lun.to_be_bytes();
    if b[2..].iter().any(|&x| x != 0) {
        return None;
    }
    match b[0] >> 6 {
        0 if b[0] == 0 => Some(u16::from(b[1])),
        1 => Some(u16::from(b[0] & 0x3f) << 8 | u16::from(b[1])),
        _ => None,
    }
}

/// A plain write (WRITE, WRITE AND VERIFY without compare) cut to the `expected` bytes the
/// initiator sends instead of the `wanted` the CDB names, when those are whole blocks: the new
/// continuation and the data-out length. `None` for anything else, and for a partial last
/// block, which the caller refuses without writing anything (FCP-4 9.4.2 b): writing the whole
/// blocks alone and answering GOOD would report bytes as written that were dropped.
fn truncated_write(then: &AfterData, expected: u32, wanted: u32) -> Option<(AfterData, u32)> {
    let AfterData::Ops(
        OpList::One(Op::Write {
            lba,
            blocks,
            offset: 0,
            fua,
        }),
        finish,
    ) = then
    else {
        return None;
    };
    let block_size = wanted / blocks.max(&1);
    if block_size == 0 || wanted != block_size * blocks || expected % block_size != 0 {
        return None;
    }
    let whole = expected / block_size;
    let ops = if whole == 0 {
        OpList::Empty
    } else {
        OpList::One(Op::Write {
            lba: *lba,
            blocks: whole,
            offset: 0,
            fua: *fua,
        })
    };
    Some((AfterData::Ops(ops, *finish), whole * block_size))
}

impl Device {
    /// A device named `target_name` (the SCSI target device name) reached through `ports`.
    pub fn new(target_name: &str, ports: Vec<TargetPort>) -> Device {
        Device {
            target_name: target_name.to_string(),
            ports,
            lus: Vec::new(),
            nexuses: Vec::new(),
            tasks: Vec::new(),
            free_tasks: Vec::new(),
            actions: VecDeque::new(),
            seq: 0,
            tmfs: Vec::new(),
            store: None,
            changes: VecDeque::new(),
            port_groups_changes: VecDeque::new(),
            drains: Vec::new(),
            delegate: false,
            scratch: (Vec::new(), Vec::new()),
            handed_unit_attentions: Vec::new(),
        }
    }

    /// Adds a port the device is reached through (a transport started after the device was
    /// made); a port with the same relative port identifier is left as it is. Returns whether
    /// it was added.
    pub fn add_port(&mut self, port: TargetPort) -> bool {
        if self
            .ports
            .iter()
            .any(|p| p.relative_port == port.relative_port)
        {
            return false;
        }
        self.ports.push(port);
        true
    }

    /// Whether plain reads and writes are delegated to the transport ([`Action::Delegated`]):
    /// READ and WRITE commands of one backend operation then end without another call into
    /// the core but [`Device::retire`], which a transport that locks the core per call may make
    /// without the lock (queued, and applied by whoever holds it next). Off by default, so a
    /// transport that does not finish tasks by itself never sees such an action.
    pub fn set_delegation(&mut self, on: bool) {
        self.delegate = on;
    }

    /// The LUN indexes in use, ascending.
    pub fn luns(&self) -> Vec<u16> {
        (0..self.lus.len())
            .filter(|&i| self.lus[i].is_some())
            .map(|i| i as u16)
            .collect()
    }

    /// The logical unit at `index`.
    pub fn logical_unit(&self, index: u16) -> Option<&LogicalUnit> {
        self.lu(index).map(|lu| &lu.unit)
    }

    pub(crate) fn lu(&self, index: u16) -> Option<&Lu> {
        self.lus.get(usize::from(index)).and_then(Option::as_ref)
    }

    pub(crate) fn lu_mut(&mut self, index: u16) -> Option<&mut Lu> {
        self.lus
            .get_mut(usize::from(index))
            .and_then(Option::as_mut)
    }

    /// Tasks in the task sets.
    pub fn task_count(&self) -> usize {
        self.tasks.len() - self.free_tasks.len()
    }

    /// The transport's tag of a live task.
    pub fn tag(&self, task: TaskId) -> Option<u64> {
        self.task(task).ok().map(|t| t.tag)
    }

    /// Adds a logical unit; nexuses already connected get REPORTED LUNS DATA HAS CHANGED.
    pub fn add_lu(&mut self, index: u16, unit: LogicalUnit) -> Result<(), DeviceError> {
        if index > MAX_LUN || self.lu(index).is_some() {
            return Err(DeviceError::Lun(index));
        }
        let i = usize::from(index);
        if self.lus.len() <= i {
            self.lus.resize_with(i + 1, || None);
        }
        self.lus[i] = Some(Lu {
            d_sense: false,
            swp: false,
            default_wce: unit.geometry.write_cache,
            unit,
            stopped: false,
            prevent: Vec::new(),
            reservations: Reservations::default(),
            shared: None,
            port_groups: None,
            port_groups_shared: false,
            live: 0,
            blockers: 0,
            dormant: 0,
            locks: Vec::new(),
            lock_waiters: VecDeque::new(),
            copies: VecDeque::new(),
        });
        self.load_reservations(index);
        let luns = self.luns();
        for n in self.nexuses.iter_mut().filter_map(|s| s.value.as_mut()) {
            self.actions.extend(push_ua(n, index, Asc::POWER_ON_RESET));
            for &l in luns.iter().filter(|&&l| l != index) {
                self.actions
                    .extend(push_ua(n, l, Asc::REPORTED_LUNS_DATA_HAS_CHANGED));
            }
        }
        Ok(())
    }

    /// Removes a logical unit, aborting its tasks; other units' nexuses get REPORTED LUNS DATA
    /// HAS CHANGED. Tasks with a backend operation in flight end when it completes.
    pub fn remove_lu(&mut self, index: u16) -> Result<(), DeviceError> {
        if self.lu(index).is_none() {
            return Err(DeviceError::Lun(index));
        }
        let doomed = self.select_tasks(|t| t.lun == index);
        let survivors = self.abort_tasks(&doomed, None);
        // Tasks still in the backend (or at their transport) keep their slot until they end;
        // the unit is gone for new commands at once, and they no longer count in its task set
        // (a unit added again at this LUN starts with an empty one).
        for id in survivors {
            if let Ok(t) = self.task_mut(id) {
                t.in_set = false;
            }
        }
        self.lus[usize::from(index)] = None;
        let luns = self.luns();
        for n in self.nexuses.iter_mut().filter_map(|s| s.value.as_mut()) {
            n.unit_attentions.retain(|&(l, _)| l != index);
            for &l in &luns {
                self.actions
                    .extend(push_ua(n, l, Asc::REPORTED_LUNS_DATA_HAS_CHANGED));
            }
        }
        Ok(())
    }

    /// The unit attentions pending for nexus `id` (LUN index, ASC and ASCQ), oldest first:
    /// what a handover carries for [`Device::adopt_nexus`].
    pub fn pending_unit_attentions(&self, id: NexusId) -> Result<Vec<(u16, Asc)>, DeviceError> {
        Ok(self.nexus(id)?.unit_attentions.clone())
    }

    /// Changes a unit's capacity; every nexus gets CAPACITY DATA HAS CHANGED.
    pub fn resize_lu(&mut self, index: u16, blocks: u64) -> Result<(), DeviceError> {
        let lu = self.lu_mut(index).ok_or(DeviceError::Lun(index))?;
        lu.unit.geometry.blocks = blocks;
        self.unit_attention_all(index, Asc::CAPACITY_DATA_HAS_CHANGED, None);
        Ok(())
    }

    /// Opens an I_T nexus for `initiator` through the target port `relative_port`; it starts
    /// with a POWER ON, RESET unit attention on every unit.
    pub fn open_nexus(&mut self, initiator: TransportId, relative_port: u16) -> NexusId {
        // A new login, not a nexus handed over: POWER ON, RESET says all it must hear.
        self.handed_unit_attentions
            .retain(|(n, _, _)| !(n.initiator == initiator && n.relative_port == relative_port));
        let power_on: Vec<(u16, Asc)> = self
            .luns()
            .into_iter()
            .map(|l| (l, Asc::POWER_ON_RESET))
            .collect();
        self.adopt_nexus(initiator, relative_port, power_on)
    }

    /// Opens an I_T nexus that goes on from another process (an upgrade that hands sessions
    /// over): it starts with the unit attentions that were pending there (LUN index, ASC and
    /// ASCQ, oldest first; those of units this device does not have are dropped), not with
    /// POWER ON, RESET, since for its initiator nothing was reset; then those of the shared
    /// reservations' changes it missed meanwhile ([`Device::adopt_unit_state`]).
    pub fn adopt_nexus(
        &mut self,
        initiator: TransportId,
        relative_port: u16,
        mut unit_attentions: Vec<(u16, Asc)>,
    ) -> NexusId {
        let name = ItNexus {
            initiator,
            relative_port,
        };
        self.handed_unit_attentions.retain(|(n, lun, asc)| {
            if *n != name {
                return true;
            }
            if !unit_attentions.contains(&(*lun, *asc)) {
                unit_attentions.push((*lun, *asc));
            }
            false
        });
        unit_attentions.retain(|(lun, _)| self.lu(*lun).is_some());
        let mut nexus = Nexus {
            name,
            id: NexusId {
                index: 0,
                generation: 0,
            },
            announce: false,
            unit_attentions,
        };
        let index = match self.nexuses.iter().position(|s| s.value.is_none()) {
            Some(i) => i,
            None => {
                self.nexuses.push(Slot {
                    generation: 0,
                    value: None,
                });
                self.nexuses.len() - 1
            }
        };
        let slot = &mut self.nexuses[index];
        nexus.id = NexusId {
            index: index as u32,
            generation: slot.generation,
        };
        let id = nexus.id;
        slot.value = Some(nexus);
        id
    }

    /// Closes an I_T nexus (I_T nexus loss): its tasks are aborted, its SPC-2 reservations
    /// released and its medium-removal prevention dropped; persistent reservations stay.
    pub fn close_nexus(&mut self, id: NexusId) -> Result<(), DeviceError> {
        let name = self.nexus(id)?.name.clone();
        let doomed = self.select_tasks(|t| t.nexus == id);
        self.abort_tasks(&doomed, None);
        self.release_nexus_holds(&name, None);
        let slot = &mut self.nexuses[id.index as usize];
        slot.value = None;
        slot.generation = slot.generation.wrapping_add(1);
        Ok(())
    }

    pub(crate) fn nexus(&self, id: NexusId) -> Result<&Nexus, DeviceError> {
        self.nexuses
            .get(id.index as usize)
            .filter(|s| s.generation == id.generation)
            .and_then(|s| s.value.as_ref())
            .ok_or(DeviceError::UnknownNexus)
    }

    pub(crate) fn nexus_mut(&mut self, id: NexusId) -> Option<&mut Nexus> {
        self.nexuses
            .get_mut(id.index as usize)
            .filter(|s| s.generation == id.generation)
            .and_then(|s| s.value.as_mut())
    }

    /// Live nexuses with their handles.
    pub(crate) fn nexus_ids(&self) -> Vec<NexusId> {
        self.nexuses
            .iter()
            .enumerate()
            .filter(|(_, s)| s.value.is_some())
            .map(|(i, s)| NexusId {
                index: i as u32,
                generation: s.generation,
            })
            .collect()
    }
}

impl Device {
    /// The relative target port of a nexus.
    pub(crate) fn relative_port(&self, nexus: NexusId) -> Option<u16> {
        self.nexus(nexus).ok().map(|n| n.name.relative_port)
    }

    /// The name of a nexus, for reservations.
    pub(crate) fn nexus_name(&self, nexus: NexusId) -> Result<ItNexus, TaskError> {
        self.nexus(nexus)
            .map(|n| n.name.clone())
            .map_err(|_| Sense::new(SenseKey::HardwareError, Asc::INTERNAL_TARGET_FAILURE).into())
    }

    /// The configured write cache setting of a unit.
    pub(crate) fn default_wce(&self, lun: u16) -> bool {
        self.lu(lun).is_some_and(|lu| lu.default_wce)
    }
}

/// A read's data-in and residual: `len` bytes read, at most `expected` of them sent.
fn read_data(len: u32, expected: u32) -> (u32, Residual) {
    (len.min(expected), Residual::of(u64::from(len), expected))
}

impl Lu {
    /// Whether a write in flight holds a block of `start..end`.
    fn range_busy(&self, start: u64, end: u64) -> bool {
        self.locks.iter().any(|&(_, s, e)| s < end && start < e)
    }

    /// Forces a write to the medium when the unit is write-through (its write cache off).
    fn write_through(&self, op: &mut Op) {
        if !self.unit.geometry.write_cache {
            if let Op::Write { fua, .. }
            | Op::WriteSame { fua, .. }
            | Op::CompareAndWrite { fua, .. }
            | Op::OrWrite { fua, .. } = op
            {
                *fua = true;
            }
        }
    }
}

/// The residual of a task that ends with no data-in: the command's own length (if known)
/// against the larger of the expected lengths.
fn residual_without_data(t: &Task, good: bool) -> Residual {
    let expected = t.data_in_len.max(t.data_out_len);
    match t.wanted {
        Some(w) if good || w > u64::from(expected) => Residual::of(w, expected),
        _ if expected > 0 => Residual::Underflow(expected),
        _ => Residual::None,
    }
}

/// Queues a unit attention unless the same one is already pending.
/// Establishes a unit attention on `lun` for the nexus `n`; the announcement its transport
/// asked for ([`Device::report_unit_attentions`]), if any, to queue.
#[must_use]
pub(crate) fn push_ua(n: &mut Nexus, lun: u16, asc: Asc) -> Option<Action> {
    if n.unit_attentions.contains(&(lun, asc)) {
        return None;
    }
    n.unit_attentions.push((lun, asc));
    n.announce.then(|| Action::UnitAttention {
        nexus: n.id,
        lun: lun_number(lun),
        sense: Sense::unit_attention(asc).fixed(),
    })
}

/// Commands that touch the medium, refused while the unit is stopped.
fn is_media_access(opcode: u8) -> bool {
    matches!(
        opcode,
        0x08 | 0x0a | 0x28 | 0x2a | 0x2e | 0x2f | 0x34 | 0x35 | 0x41 | 0x42 | 0x88
            ..=0x93 | 0x9c | 0xa8 | 0xaa | 0xae | 0xaf
    )
}
