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
    /// A change to shared reservations went to their keeper.
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
    /// [`Device::reservation_done`].
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
    /// PREEMPT AND ABORT commands and the aborted tasks each waits for.
    drains: Vec<(TaskId, Vec<TaskId>)>,
    /// Plain reads and writes are delegated to the transport ([`Device::set_delegation`]).
    delegate: bool,
    /// Reused by `retry_lock_waiters` (the waiters it goes through, the ranges of those that
    /// stay), so a write released by another's end allocates nothing.
    scratch: (Vec<TaskId>, Vec<(u64, u64)>),
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
            drains: Vec::new(),
            delegate: false,
            scratch: (Vec::new(), Vec::new()),
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

    /// Persists APTPL reservations through `store`, and loads what it holds for the units
    /// already added and those added later.
    pub fn set_reservation_store(&mut self, store: Box<dyn PrStore>) {
        self.store = Some(store);
        for i in 0..self.lus.len() {
            self.load_reservations(i as u16);
        }
    }

    /// Keeps the reservations of unit `lun` elsewhere, shared with other device servers that
    /// serve the same unit (gateways of one target): commands that would change them
    /// (PERSISTENT RESERVE OUT, RESERVE, RELEASE; nexus loss and LOGICAL UNIT RESET for the
    /// SPC-2 reservation) wait while their [`ReservationChange`] goes to the keeper
    /// ([`Device::poll_reservation_change`]), which decides it on the shared state with
    /// [`Reservations::apply`], has every server apply the outcome
    /// ([`Device::apply_reservations`]) and then ends the command
    /// ([`Device::reservation_done`]). Access checks use the state applied last, so a
    /// reservation is enforced here once the keeper has applied it here. APTPL is accepted:
    /// the keeper's state outlives a restart.
    pub fn share_reservations(&mut self, lun: u16) -> Result<(), DeviceError> {
        let lu = self.lu_mut(lun).ok_or(DeviceError::Lun(lun))?;
        lu.shared.get_or_insert(0);
        Ok(())
    }

    /// The next change to shared reservations for their keeper.
    pub fn poll_reservation_change(&mut self) -> Option<ReservationChange> {
        self.changes.pop_front()
    }

    /// Whether a change to shared reservations waits for the keeper: a cheap look for a
    /// caller that polls after every call.
    pub fn has_reservation_changes(&self) -> bool {
        !self.changes.is_empty()
    }

    /// The reservations of unit `lun` as this device server enforces them, and (for shared
    /// ones) the version applied last.
    pub fn reservations(&self, lun: u16) -> Option<(&Reservations, Option<u64>)> {
        self.lu(lun).map(|lu| (&lu.reservations, lu.shared))
    }

    /// The keeper of unit `lun`'s shared reservations says they are `state` at `version`,
    /// after a change with `effects`: the state replaces this server's, and its unit
    /// attentions and aborts reach this server's nexuses of those names. A version not newer
    /// than the one applied last changes nothing (a change heard twice, or late); returns
    /// whether it was applied.
    #[must_use = "a state not applied (not newer than the last) is news the caller may log"]
    pub fn apply_reservations(
        &mut self,
        lun: u16,
        version: u64,
        state: Reservations,
        effects: &ReservationEffects,
    ) -> bool {
        let Some(lu) = self.lu_mut(lun) else {
            return false;
        };
        match lu.shared {
            Some(v) if v < version => lu.shared = Some(version),
            _ => return false,
        }
        lu.reservations = state;
        if effects.reset {
            // Another server's LOGICAL UNIT RESET: this server's tasks on the unit go, and
            // its nexuses hear of it.
            let ids = self.select_tasks(|t| t.lun == lun && t.phase != Phase::Reserving);
            self.abort_tasks(&ids, None);
            self.reset_lu_state(lun);
        }
        self.reservation_effects(lun, effects, None);
        true
    }

    /// The keeper has decided the change of reservation task `task` (and, when it succeeded,
    /// applied it here): the command ends with GOOD, RESERVATION CONFLICT or the sense.
    pub fn reservation_done(
        &mut self,
        task: TaskId,
        result: Result<(), PrError>,
    ) -> Result<(), DeviceError> {
        let t = self.task_mut(task)?;
        if t.phase != Phase::Reserving {
            return Err(DeviceError::WrongPhase);
        }
        t.phase = Phase::Enabled;
        if t.aborted {
            let tag = t.tag;
            self.end(task, Some(Action::Aborted { task, tag }));
            return Ok(());
        }
        // PREEMPT AND ABORT: the keeper applied the change here first, aborting this
        // server's tasks of the preempted nexuses; it completes once they have ended (the
        // other servers acknowledged only once theirs had).
        let preempt_and_abort = t.cdb[0] == 0x5f && t.cdb[1] & 0x1f == 5;
        if preempt_and_abort && result.is_ok() {
            let lun = t.lun;
            let waiting = self.aborted_in_flight(lun, task);
            if !waiting.is_empty() {
                self.drain(task, waiting);
                return Ok(());
            }
        }
        let result = match result {
            Ok(()) => Ok(Reply::Good),
            Err(PrError::Conflict) => Err(TaskError::ReservationConflict),
            Err(PrError::Sense(s)) => Err(TaskError::Sense(s)),
        };
        self.complete(task, result);
        Ok(())
    }

    /// The keeper has carried out (or given up on) a change a task management function
    /// (`reference`) waits for: it is answered once nothing else holds it.
    pub fn task_management_change_done(&mut self, reference: u64) {
        if let Some(t) = self.tmfs.iter_mut().find(|t| t.reference == reference) {
            t.keeper = t.keeper.saturating_sub(1);
        }
        self.finish_tmfs();
    }

    /// Unit attentions and aborts of a change to the reservations of `lun`.
    pub(crate) fn reservation_effects(
        &mut self,
        lun: u16,
        fx: &ReservationEffects,
        except: Option<TaskId>,
    ) {
        for (name, asc) in &fx.unit_attentions {
            self.unit_attention_for(lun, *asc, name);
        }
        if !fx.abort.is_empty() {
            self.abort_nexus_tasks(lun, &fx.abort, except);
        }
    }

    /// A command asks to change the reservations: its keeper decides when they are shared,
    /// this server at once otherwise (saving APTPL state to the store).
    pub(crate) fn change_reservations(
        &mut self,
        id: TaskId,
        request: ReservationRequest,
    ) -> Result<Step, TaskError> {
        let t = self.task(id).map_err(|_| Sense::invalid_opcode())?;
        let (lun, nexus) = (t.lun, t.nexus);
        let me = self.nexus_name(nexus)?;
        let lu = self.lu_mut(lun).ok_or(Sense::invalid_opcode())?;
        if lu.shared.is_some() {
            self.changes.push_back(ReservationChange {
                task: Some(id),
                tmf: None,
                lun,
                nexus: me,
                request,
            });
            return Ok(Step::Reserving);
        }
        let before = lu.reservations.persistent.clone();
        let fx = match lu.reservations.apply(&me, &request) {
            Ok(fx) => fx,
            Err(PrError::Conflict) => return Err(TaskError::ReservationConflict),
            Err(PrError::Sense(s)) => return Err(s.into()),
        };
        let after = &lu.reservations.persistent;
        if fx.save && (before.aptpl || after.aptpl) {
            let state = after.aptpl.then(|| after.encode());
            let serial = lu.unit.identity.serial.clone();
            if let Some(store) = self.store.as_mut() {
                if store.save(&serial, state.as_deref()).is_err() {
                    if let Some(lu) = self.lu_mut(lun) {
                        lu.reservations.persistent = before;
                    }
                    return Err(Sense::new(
                        SenseKey::IllegalRequest,
                        Asc::INSUFFICIENT_REGISTRATION_RESOURCES,
                    )
                    .into());
                }
            }
        }
        self.reservation_effects(lun, &fx, Some(id));
        if !fx.abort.is_empty() {
            let waiting = self.aborted_in_flight(lun, id);
            if !waiting.is_empty() {
                return Ok(Step::Draining(waiting));
            }
        }
        Ok(Step::Done(Reply::Good))
    }

    /// The tasks on `lun` that were aborted but have not ended (their I/O is under way),
    /// but `except`.
    fn aborted_in_flight(&self, lun: u16, except: TaskId) -> Vec<TaskId> {
        let mut ids = self.select_tasks(|t| t.lun == lun && t.aborted);
        ids.retain(|&t| t != except);
        ids
    }

    /// How many tasks on `lun` were aborted and have not ended yet. A server that applies
    /// another's PREEMPT AND ABORT ([`Device::apply_reservations`]) acknowledges it once
    /// this is 0, so that no write of a preempted nexus reaches the medium after the
    /// preempting command completed.
    pub fn aborted_tasks_in_flight(&self, lun: u16) -> usize {
        self.select_tasks(|t| t.lun == lun && t.aborted).len()
    }

    /// Task `id` (a PREEMPT AND ABORT) completes once `waiting` have ended.
    fn drain(&mut self, id: TaskId, waiting: Vec<TaskId>) {
        if let Ok(t) = self.task_mut(id) {
            t.phase = Phase::Draining;
            self.drains.push((id, waiting));
        }
    }

    /// Completes the PREEMPT AND ABORT commands whose aborted tasks have all ended, now that
    /// `ended` has.
    fn finish_drains(&mut self, ended: TaskId) {
        for (_, waiting) in &mut self.drains {
            waiting.retain(|&w| w != ended);
        }
        while let Some(i) = self.drains.iter().position(|(_, w)| w.is_empty()) {
            let (id, _) = self.drains.swap_remove(i);
            let Ok(t) = self.task_mut(id) else { continue };
            t.phase = Phase::Enabled;
            if t.aborted {
                let tag = t.tag;
                self.end(id, Some(Action::Aborted { task: id, tag }));
            } else {
                self.complete(id, Ok(Reply::Good));
            }
        }
    }

    /// Sets the target port groups of unit `lun` and their asymmetric access states (implicit
    /// ALUA decided by the target, e.g. by its cluster of gateways). When a group's state
    /// changes, every nexus gets ASYMMETRIC ACCESS STATE CHANGED for the unit. Commands that
    /// arrive through a port whose group is not active are refused with NOT READY, but those
    /// that ask about the path (INQUIRY, REPORT LUNS, REPORT TARGET PORT GROUPS, REQUEST
    /// SENSE). Returns whether a state changed.
    pub fn set_port_groups(
        &mut self,
        lun: u16,
        groups: Vec<PortGroup>,
    ) -> Result<bool, DeviceError> {
        let ports = self.ports.clone();
        let lu = self.lu_mut(lun).ok_or(DeviceError::Lun(lun))?;
        let before = match &lu.port_groups {
            Some(g) => g.clone(),
            None => crate::spc::tpg::groups_of(&ports),
        };
        let state_of = |gs: &[PortGroup], id: u16| gs.iter().find(|g| g.id == id).map(|g| g.state);
        let changed = groups
            .iter()
            .any(|g| state_of(&before, g.id) != Some(g.state))
            || before.iter().any(|g| state_of(&groups, g.id).is_none());
        lu.port_groups = Some(groups);
        if changed {
            self.unit_attention_all(lun, Asc::ASYMMETRIC_ACCESS_STATE_CHANGED, None);
        }
        Ok(changed)
    }

    /// The target port groups of unit `lun` as REPORT TARGET PORT GROUPS reports them.
    pub fn port_groups(&self, lun: u16) -> Option<Vec<PortGroup>> {
        let lu = self.lu(lun)?;
        Some(match &lu.port_groups {
            Some(g) => g.clone(),
            None => crate::spc::tpg::groups_of(&self.ports),
        })
    }

    /// Whether the I_T nexus `nexus` holds an SPC-2 reservation of a unit whose reservations
    /// are shared: its loss must reach the other servers of the unit.
    pub fn holds_shared_reservation(&self, nexus: NexusId) -> bool {
        let Ok(n) = self.nexus(nexus) else {
            return false;
        };
        self.lus
            .iter()
            .flatten()
            .any(|lu| lu.shared.is_some() && lu.reservations.spc2.as_ref() == Some(&n.name))
    }

    /// Whether APTPL may be set on unit `lun`: a store keeps the state, or its keeper does.
    pub(crate) fn ptpl_capable(&self, lun: u16) -> bool {
        self.store.is_some() || self.lu(lun).is_some_and(|lu| lu.shared.is_some())
    }

    fn load_reservations(&mut self, index: u16) {
        let (Some(store), Some(Some(lu))) = (&self.store, self.lus.get_mut(usize::from(index)))
        else {
            return;
        };
        if let Some(bytes) = store.load(&lu.unit.identity.serial) {
            if let Some(pr) = crate::pr::PrState::decode(&bytes) {
                lu.reservations.persistent = pr;
            }
        }
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
        let mut nexus = Nexus {
            name: ItNexus {
                initiator,
                relative_port,
            },
            id: NexusId {
                index: 0,
                generation: 0,
            },
            announce: false,
            unit_attentions: self
                .luns()
                .into_iter()
                .map(|l| (l, Asc::POWER_ON_RESET))
                .collect(),
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

    /// Whether the transport of nexus `id` reports asynchronous events (SRP's SRP_AER_REQ):
    /// from now on each unit attention established for it (a capacity change, a unit added
    /// or removed, reservations preempted, commands cleared by another initiator) is also an
    /// [`Action::UnitAttention`] naming it, so the initiator hears of it without sending a
    /// command. The unit attention stays pending and is reported on the next command as
    /// well: an initiator may ignore the event (Linux's ib_srp logs it and does nothing).
    pub fn report_unit_attentions(&mut self, id: NexusId, on: bool) -> Result<(), DeviceError> {
        self.nexus_mut(id)
            .ok_or(DeviceError::UnknownNexus)?
            .announce = on;
        Ok(())
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

    /// What an I_T nexus loss or reset drops: its SPC-2 reservations and its medium removal
    /// prevention (persistent reservations stay).
    fn release_nexus_holds(&mut self, name: &ItNexus, tmf: Option<u64>) {
        for (i, lu) in self.lus.iter_mut().enumerate() {
            let Some(lu) = lu else { continue };
            if lu.reservations.spc2.as_ref() == Some(name) {
                if lu.shared.is_some() {
                    self.changes.push_back(ReservationChange {
                        task: None,
                        tmf,
                        lun: i as u16,
                        nexus: name.clone(),
                        request: ReservationRequest::NexusLost,
                    });
                } else {
                    lu.reservations.spc2 = None;
                }
            }
            lu.prevent.retain(|n| n != name);
        }
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

    /// Establishes a unit attention on `lun` for every nexus but `except`.
    pub(crate) fn unit_attention_all(&mut self, lun: u16, asc: Asc, except: Option<NexusId>) {
        for (i, s) in self.nexuses.iter_mut().enumerate() {
            let me = except.is_some_and(|e| e.index as usize == i && e.generation == s.generation);
            if let (false, Some(n)) = (me, s.value.as_mut()) {
                self.actions.extend(push_ua(n, lun, asc));
            }
        }
    }

    /// Establishes a unit attention on `lun` for every nexus named `name`.
    pub(crate) fn unit_attention_for(&mut self, lun: u16, asc: Asc, name: &ItNexus) {
        for n in self.nexuses.iter_mut().filter_map(|s| s.value.as_mut()) {
            if &n.name == name {
                self.actions.extend(push_ua(n, lun, asc));
            }
        }
    }

    /// The next action for the transport.
    pub fn poll(&mut self) -> Option<Action> {
        self.actions.pop_front()
    }

    pub(crate) fn task(&self, id: TaskId) -> Result<&Task, DeviceError> {
        self.tasks
            .get(id.index as usize)
            .filter(|s| s.generation == id.generation)
            .and_then(|s| s.value.as_ref())
            .ok_or(DeviceError::UnknownTask)
    }

    pub(crate) fn task_mut(&mut self, id: TaskId) -> Result<&mut Task, DeviceError> {
        self.tasks
            .get_mut(id.index as usize)
            .filter(|s| s.generation == id.generation)
            .and_then(|s| s.value.as_mut())
            .ok_or(DeviceError::UnknownTask)
    }

    /// Accepts a command. Its outcome comes out of [`Device::poll`], possibly at once (a
    /// command for an absent LUN completes immediately).
    pub fn submit(&mut self, cmd: Command<'_>) -> Result<TaskId, DeviceError> {
        self.nexus(cmd.nexus)?;
        let index = lun_index(cmd.lun).filter(|&i| self.lu(i).is_some());
        let mut cdb = [0u8; 16];
        let n = cmd.cdb.len().min(16);
        cdb[..n].copy_from_slice(&cmd.cdb[..n]);
        self.seq += 1;
        let task = Task {
            nexus: cmd.nexus,
            lun: index.unwrap_or(u16::MAX),
            tag: cmd.tag,
            attribute: cmd.attribute,
            seq: self.seq,
            cdb,
            data_in_len: cmd.data_in_len,
            data_out_len: cmd.data_out_len,
            phase: Phase::Dormant,
            aborted: false,
            in_set: false,
            wanted: None,
            ops: OpList::Empty,
            finish: Finish::Good,
            after: None,
            current: None,
            op_lun: index.unwrap_or(u16::MAX),
            output: Output::Done,
        };
        let id = match self.free_tasks.pop() {
            Some(i) => {
                let slot = &mut self.tasks[i as usize];
                slot.value = Some(task);
                TaskId {
                    index: i,
                    generation: slot.generation,
                }
            }
            None => {
                self.tasks.push(Slot {
                    generation: 0,
                    value: Some(task),
                });
                TaskId {
                    index: (self.tasks.len() - 1) as u32,
                    generation: 0,
                }
            }
        };
        if cmd.cdb.len() > 16 {
            self.complete(id, Err(Sense::invalid_opcode().into()));
            return Ok(id);
        }
        let Some(index) = index else {
            let r = self.no_such_lun(&cdb);
            self.complete(id, r);
            return Ok(id);
        };
        if cmd.attribute == TaskAttribute::Aca {
            // No ACA condition is ever established (NACA is refused).
            self.complete(
                id,
                Err(Sense::new(SenseKey::IllegalRequest, Asc::INVALID_MESSAGE_ERROR).into()),
            );
            return Ok(id);
        }
        self.task_mut(id).expect("just made").in_set = true;
        let lu = self.lu_mut(index).expect("checked above");
        let enabled = match cmd.attribute {
            TaskAttribute::HeadOfQueue => true,
            TaskAttribute::Ordered => lu.live == 0,
            _ => lu.blockers == 0 && lu.dormant == 0,
        };
        lu.live += 1;
        if matches!(
            cmd.attribute,
            TaskAttribute::Ordered | TaskAttribute::HeadOfQueue
        ) {
            lu.blockers += 1;
        }
        if enabled {
            self.start(id);
        } else {
            lu.dormant += 1;
        }
        Ok(id)
    }

    /// Commands addressed to a LUN without a logical unit: INQUIRY answers with peripheral
    /// qualifier 011b, REPORT LUNS and REQUEST SENSE work, anything else is LOGICAL UNIT NOT
    /// SUPPORTED.
    fn no_such_lun(&mut self, cdb: &[u8; 16]) -> Result<Reply, TaskError> {
        match cdb[0] {
            0x12 => {
                let alloc = usize::from(u16::from_be_bytes([cdb[3], cdb[4]]));
                if cdb[1] & 0x01 != 0 || cdb[2] != 0 {
                    return Err(Sense::new(
                        SenseKey::IllegalRequest,
                        Asc::LOGICAL_UNIT_NOT_SUPPORTED,
                    )
                    .into());
                }
                let mut d = vec![0u8; 36];
                d[0] = 0x7f;
                d[2] = 0x06;
                d[3] = 0x02;
                d[4] = 31;
                d.truncate(alloc);
                Ok(Reply::Data(d))
            }
            0xa0 => Ok(Reply::Data(crate::spc::report_luns::report_luns(
                &self.luns(),
                &cdb[..12],
            )?)),
            0x03 => {
                let mut d = Sense::new(SenseKey::IllegalRequest, Asc::LOGICAL_UNIT_NOT_SUPPORTED)
                    .encode(cdb[1] & 1 != 0)
                    .as_slice()
                    .to_vec();
                d.truncate(usize::from(cdb[4]));
                Ok(Reply::Data(d))
            }
            _ => Err(Sense::new(SenseKey::IllegalRequest, Asc::LOGICAL_UNIT_NOT_SUPPORTED).into()),
        }
    }

    /// Runs an enabled task up to its first wait.
    fn start(&mut self, id: TaskId) {
        let Ok(t) = self.task_mut(id) else { return };
        t.phase = Phase::Enabled;
        let (nexus, lun, cdb) = (t.nexus, t.lun, t.cdb);
        let step = self
            .admit(nexus, lun, &cdb)
            .and_then(|info| self.dispatch(id, info));
        self.proceed(id, step);
    }

    /// Unit attentions, reservations and NOT READY: whether the command may run at all. Gives
    /// the command's table entry on to the dispatch.
    fn admit(
        &mut self,
        nexus: NexusId,
        lun: u16,
        cdb: &[u8; 16],
    ) -> Result<&'static CommandInfo, TaskError> {
        let info = opcodes::lookup(cdb)?;
        if info.access == Access::Exempt {
            return Ok(info);
        }
        if let Some(n) = self.nexus_mut(nexus) {
            if let Some(i) = n.unit_attentions.iter().position(|&(l, _)| l == lun) {
                let (_, asc) = n.unit_attentions.remove(i);
                return Err(Sense::unit_attention(asc).into());
            }
        }
        // Borrowed, not cloned: this runs for every command.
        let name = &self.nexus(nexus).map_err(|_| Sense::invalid_opcode())?.name;
        let lu = self.lu(lun).expect("tasks live on existing units");
        if let Some(groups) = &lu.port_groups {
            let state = groups
                .iter()
                .find(|g| g.ports.contains(&name.relative_port))
                .map(|g| g.state);
            if let Some(state) = state.filter(|s| !s.is_active()) {
                if !crate::spc::tpg::processed_in(state, cdb) {
                    return Err(Sense::new(SenseKey::NotReady, state.not_ready()).into());
                }
            }
        }
        if let Some(holder) = &lu.reservations.spc2 {
            let allowed = info.access == Access::Unrestricted && !matches!(cdb[0], 0x5e | 0x5f)
                || matches!(cdb[0], 0x17 | 0x57);
            if holder != name && !allowed {
                return Err(TaskError::ReservationConflict);
            }
        }
        if !lu.reservations.persistent.allows(name, info.access) {
            return Err(TaskError::ReservationConflict);
        }
        if lu.stopped && (is_media_access(cdb[0]) || cdb[0] == 0x00) {
            return Err(Sense::new(
                SenseKey::NotReady,
                Asc::NOT_READY_INITIALIZING_COMMAND_REQUIRED,
            )
            .into());
        }
        Ok(info)
    }

    /// Carries out a dispatch result.
    pub(crate) fn proceed(&mut self, id: TaskId, step: Result<Step, TaskError>) {
        match step {
            Err(e) => self.complete(id, Err(e)),
            Ok(Step::Done(reply)) => self.complete(id, Ok(reply)),
            Ok(Step::Ops(ops, finish)) => {
                if let (OpList::One(op @ Op::Read { .. }), Finish::ReadData { len }) =
                    (&ops, finish)
                {
                    if self.delegated(id, *op, 0, len) {
                        return;
                    }
                }
                if let Ok(t) = self.task_mut(id) {
                    t.ops = ops;
                    t.finish = finish;
                }
                self.issue_next(id);
            }
            Ok(Step::Reserving) => {
                if let Ok(t) = self.task_mut(id) {
                    t.phase = Phase::Reserving;
                }
            }
            Ok(Step::Draining(waiting)) => self.drain(id, waiting),
            Ok(Step::DataOut { len, then }) => {
                let Ok(t) = self.task_mut(id) else { return };
                if t.wanted.is_none() {
                    t.wanted = Some(u64::from(len));
                }
                let mut then = then;
                let mut len = len;
                if len > t.data_out_len {
                    if let Some(short) = truncated_write(&then, t.data_out_len, len) {
                        // The initiator sends whole blocks, fewer than the command names: write
                        // them and report the overflow (FCP-4 9.4.2 a), as initiators expect
                        // of iSCSI targets.
                        then = short.0;
                        len = short.1;
                    }
                }
                if len > t.data_out_len {
                    // The initiator would send less than the command needs: transfer nothing
                    // (SAM-5, FCP-4 9.4.2 b).
                    let e = Sense::new(
                        SenseKey::IllegalRequest,
                        Asc::INVALID_FIELD_IN_COMMAND_INFORMATION_UNIT,
                    );
                    return self.complete(id, Err(e.into()));
                }
                if len == 0 && matches!(then, AfterData::Ops(OpList::Empty, _)) {
                    return self.complete(id, Ok(Reply::Good));
                }
                if let AfterData::Ops(OpList::One(op @ Op::Write { .. }), Finish::Good) = &then {
                    if len > 0 && self.delegated(id, *op, len, 0) {
                        return;
                    }
                }
                let Ok(t) = self.task_mut(id) else { return };
                t.after = Some(then);
                t.phase = Phase::DataOut;
                if len == 0 {
                    return self.after_data(id, &[]);
                }
                let tag = t.tag;
                self.actions
                    .push_back(Action::DataOut { task: id, tag, len });
            }
        }
    }

    /// Delegates a plain read (`read` bytes of data-in) or write (`data_out` bytes) to the
    /// transport, if delegation is on and a write's block range is free now (else the task
    /// goes the ordinary way, waiting for its range in order). Returns whether it did.
    fn delegated(&mut self, id: TaskId, mut op: Op, data_out: u32, read: u32) -> bool {
        if !self.delegate {
            return false;
        }
        let Ok(t) = self.task(id) else { return false };
        let lun = t.lun;
        let Some(lu) = self.lu(lun) else { return false };
        let d_sense = lu.d_sense;
        lu.write_through(&mut op);
        if let Some((start, blocks)) = op.written_range() {
            let end = start.saturating_add(blocks);
            if lu.range_busy(start, end) || !lu.lock_waiters.is_empty() {
                return false;
            }
            self.lu_mut(lun)
                .expect("checked")
                .locks
                .push((id, start, end));
        }
        let t = self.task_mut(id).expect("checked");
        let plan = if data_out == 0 {
            let (data_in, residual) = read_data(read, t.data_in_len);
            Delegation {
                data_in,
                residual,
                failed_residual: residual_without_data(t, false),
                d_sense,
            }
        } else {
            Delegation {
                data_in: 0,
                residual: residual_without_data(t, true),
                failed_residual: residual_without_data(t, false),
                d_sense,
            }
        };
        t.phase = Phase::Delegated;
        t.current = Some(op);
        t.op_lun = lun;
        let tag = t.tag;
        self.actions.push_back(Action::Delegated {
            task: id,
            tag,
            lun,
            op,
            data_out,
            plan,
        });
        true
    }

    /// A delegated task ([`Action::Delegated`]) has ended at its transport: it leaves the task
    /// set, a write's block range is free again, and what waited for it goes on.
    pub fn retire(&mut self, id: TaskId) -> Result<(), DeviceError> {
        if self.task(id)?.phase != Phase::Delegated {
            return Err(DeviceError::WrongPhase);
        }
        self.release_range(id);
        self.end(id, None);
        Ok(())
    }

    /// The task's operation has ended: a write's block range is free, and writers waiting
    /// for it may go.
    fn release_range(&mut self, id: TaskId) {
        let Ok(t) = self.task_mut(id) else { return };
        let lun = t.op_lun;
        if t.current.take().and_then(|o| o.written_range()).is_some() {
            if let Some(lu) = self.lu_mut(lun) {
                lu.locks.retain(|&(holder, _, _)| holder != id);
            }
            self.retry_lock_waiters(lun);
        }
    }

    /// Whether retiring a delegated task could let something go on now: a dormant task, a
    /// write waiting for a block range, or a task management function waiting for tasks to
    /// end. A transport that queues retirements checks this before it lets the core go, and
    /// retires at once while it holds.
    pub fn awaits_retirement(&self) -> bool {
        !self.tmfs.is_empty()
            || self
                .lus
                .iter()
                .flatten()
                .any(|lu| lu.dormant > 0 || !lu.lock_waiters.is_empty())
    }

    /// The data-out asked for by [`Action::DataOut`] is in the task's buffer; `data` is that
    /// buffer (the core reads it only for parameter lists).
    pub fn data_out(&mut self, id: TaskId, data: &[u8]) -> Result<(), DeviceError> {
        let t = self.task(id)?;
        if t.phase != Phase::DataOut {
            return Err(DeviceError::WrongPhase);
        }
        self.after_data(id, data);
        Ok(())
    }

    fn after_data(&mut self, id: TaskId, data: &[u8]) {
        let Ok(t) = self.task_mut(id) else { return };
        t.phase = Phase::Enabled;
        match t.after.take() {
            Some(AfterData::Ops(ops, finish)) => self.proceed(id, Ok(Step::Ops(ops, finish))),
            Some(AfterData::Parameters(p)) => {
                let len = t.wanted.unwrap_or(0) as usize;
                let data = &data[..len.min(data.len())];
                let step = self.parameters(id, p, data);
                self.proceed(id, step);
            }
            None => self.complete(
                id,
                Err(Sense::new(SenseKey::HardwareError, Asc::INTERNAL_TARGET_FAILURE).into()),
            ),
        }
    }

    /// Issues the task's next backend operation, or finishes it.
    fn issue_next(&mut self, id: TaskId) {
        let Ok(t) = self.task_mut(id) else { return };
        let op_lun = t.op_lun;
        let next = match t.current.take() {
            Some(op) => Some((Some(op_lun), op)),
            None => t.ops.pop(),
        };
        let Some((place, mut op)) = next else {
            let finish = t.finish;
            let output = t.output;
            let reply = match finish {
                Finish::Good => Ok(Reply::Good),
                Finish::ReadData { len } => {
                    let (sent, residual) = read_data(len, t.data_in_len);
                    let tag = t.tag;
                    return self.end(
                        id,
                        Some(Action::Complete {
                            task: id,
                            tag,
                            status: Status::Good,
                            sense: None,
                            data_in: DataIn::Buffer { len: sent },
                            residual,
                        }),
                    );
                }
                Finish::LbaStatus { lba, alloc } => Ok(Reply::Data(
                    crate::sbc::lba_status::descriptor(lba, output, alloc),
                )),
                Finish::Copied {
                    list_id,
                    hold,
                    segments,
                    bytes,
                } => {
                    if hold {
                        self.hold_copy_status(id, list_id, segments, bytes);
                    }
                    Ok(Reply::Good)
                }
            };
            return self.complete(id, reply);
        };
        let lun = place.unwrap_or(t.lun);
        t.op_lun = lun;
        let Some(lu) = self.lu(lun) else {
            // A copy's other unit went away meanwhile.
            let e = Sense::new(
                SenseKey::CopyAborted,
                crate::spc::copy::UNREACHABLE_COPY_TARGET,
            );
            return self.complete(id, Err(e.into()));
        };
        lu.write_through(&mut op);
        if let Some((start, blocks)) = op.written_range() {
            let end = start.saturating_add(blocks);
            let lu = self.lu_mut(lun).expect("checked");
            let busy = lu.range_busy(start, end);
            if busy || !lu.lock_waiters.is_empty() {
                lu.lock_waiters.push_back(id);
                let t = self.task_mut(id).expect("checked");
                t.current = Some(op);
                t.phase = Phase::Locked;
                if !busy {
                    self.retry_lock_waiters(lun);
                }
                return;
            }
            lu.locks.push((id, start, end));
        }
        let t = self.task_mut(id).expect("checked");
        t.current = Some(op);
        t.phase = Phase::Backend;
        self.actions
            .push_back(Action::Backend { task: id, lun, op });
    }

    /// Lets waiting writers whose ranges are free go, in arrival order: a waiter also blocks
    /// later waiters that overlap it.
    fn retry_lock_waiters(&mut self, lun: u16) {
        let (mut waiters, mut still) = std::mem::take(&mut self.scratch);
        let Some(lu) = self.lu_mut(lun) else {
            self.scratch = (waiters, still);
            return;
        };
        waiters.clear();
        still.clear();
        waiters.extend(lu.lock_waiters.drain(..));
        for &id in &waiters {
            let Some((start, blocks)) = self
                .task(id)
                .ok()
                .and_then(|t| t.current)
                .and_then(|op| op.written_range())
            else {
                continue;
            };
            let end = start.saturating_add(blocks);
            let lu = self.lu_mut(lun).expect("checked");
            let overlaps = |&(s, e): &(u64, u64)| s < end && start < e;
            if lu.range_busy(start, end) || still.iter().any(overlaps) {
                lu.lock_waiters.push_back(id);
                still.push((start, end));
                continue;
            }
            lu.locks.push((id, start, end));
            let t = self.task_mut(id).expect("checked");
            let op = t.current.expect("waiters hold an op");
            t.phase = Phase::Backend;
            self.actions
                .push_back(Action::Backend { task: id, lun, op });
        }
        self.scratch = (waiters, still);
    }

    /// A backend operation of [`Action::Backend`] has finished.
    pub fn backend_done(
        &mut self,
        id: TaskId,
        result: Result<Output, BackendError>,
    ) -> Result<(), DeviceError> {
        let t = self.task_mut(id)?;
        if t.phase != Phase::Backend {
            return Err(DeviceError::WrongPhase);
        }
        t.phase = Phase::Enabled;
        self.release_range(id);
        let t = self.task_mut(id).expect("checked");
        if t.aborted {
            let tag = t.tag;
            self.end(id, Some(Action::Aborted { task: id, tag }));
            return Ok(());
        }
        match result {
            Ok(output) => {
                t.output = output;
                self.issue_next(id);
            }
            Err(e) => self.complete(id, Err(e.into())),
        }
        Ok(())
    }

    /// Ends a task with status.
    pub(crate) fn complete(&mut self, id: TaskId, result: Result<Reply, TaskError>) {
        let Ok(t) = self.task(id) else { return };
        let d_sense = self.lu(t.lun).is_some_and(|lu| lu.d_sense);
        let (status, sense, data) = match result {
            Ok(Reply::Good) => (Status::Good, None, None),
            Ok(Reply::Data(d)) => (Status::Good, None, Some(d)),
            Err(TaskError::ReservationConflict) => (Status::ReservationConflict, None, None),
            Err(TaskError::Sense(s)) => (Status::CheckCondition, Some(s.encode(d_sense)), None),
        };
        let (data_in, residual) = match data {
            Some(mut d) => {
                let residual = Residual::of(d.len() as u64, t.data_in_len);
                d.truncate(t.data_in_len as usize);
                (DataIn::Parameter(d), residual)
            }
            None => (
                DataIn::None,
                residual_without_data(t, status == Status::Good),
            ),
        };
        let tag = t.tag;
        self.end(
            id,
            Some(Action::Complete {
                task: id,
                tag,
                status,
                sense,
                data_in,
                residual,
            }),
        );
    }

    /// Keeps a finished copy's status for RECEIVE COPY RESULTS (the last few per unit).
    fn hold_copy_status(&mut self, id: TaskId, list_id: u8, segments: u16, bytes: u64) {
        const HELD: usize = 16;
        let Ok(t) = self.task(id) else { return };
        let (lun, nexus) = (t.lun, t.nexus);
        let Ok(name) = self.nexus(nexus).map(|n| n.name.clone()) else {
            return;
        };
        let Some(lu) = self.lu_mut(lun) else { return };
        lu.copies.retain(|(n, l, _)| !(n == &name && *l == list_id));
        if lu.copies.len() == HELD {
            lu.copies.pop_front();
        }
        let status = crate::spc::copy::copy_status(segments, bytes);
        lu.copies.push_back((name, list_id, status));
    }

    /// Removes a task from the task set, emits its last action, and lets waiting tasks go.
    /// A retired task (`last` is `None`) has nothing more to say.
    fn end(&mut self, id: TaskId, last: Option<Action>) {
        let slot = &mut self.tasks[id.index as usize];
        let Some(t) = slot.value.take() else { return };
        slot.generation = slot.generation.wrapping_add(1);
        self.free_tasks.push(id.index);
        self.actions.extend(last);
        if t.phase == Phase::Locked && t.op_lun != t.lun {
            if let Some(lu) = self.lu_mut(t.op_lun) {
                lu.lock_waiters.retain(|&w| w != id);
            }
        }
        if let Some(lu) = self.lu_mut(t.lun).filter(|_| t.in_set) {
            lu.live -= 1;
            if matches!(
                t.attribute,
                TaskAttribute::Ordered | TaskAttribute::HeadOfQueue
            ) {
                lu.blockers -= 1;
            }
            if t.phase == Phase::Dormant {
                lu.dormant -= 1;
            }
            if t.phase == Phase::Locked && t.op_lun == t.lun {
                lu.lock_waiters.retain(|&w| w != id);
            }
            if lu.dormant > 0 {
                self.enable_dormant(t.lun);
            }
        }
        if !self.tmfs.is_empty() {
            for tmf in &mut self.tmfs {
                tmf.waiting.retain(|&w| w != id);
            }
            self.finish_tmfs();
        }
        if !self.drains.is_empty() {
            self.finish_drains(id);
        }
    }

    /// Answers the task management functions that wait for nothing any more.
    fn finish_tmfs(&mut self) {
        let mut i = 0;
        while i < self.tmfs.len() {
            if self.tmfs[i].waiting.is_empty() && self.tmfs[i].keeper == 0 {
                let tmf = self.tmfs.remove(i);
                self.actions.push_back(Action::TaskManagementDone {
                    nexus: tmf.nexus,
                    reference: tmf.reference,
                    response: tmf.response,
                });
            } else {
                i += 1;
            }
        }
    }

    /// Applies the task attribute rules to the unit's dormant tasks.
    fn enable_dormant(&mut self, lun: u16) {
        let (mut older_live, mut older_blocker) = (false, false);
        let mut enable = Vec::new();
        for id in self.select_tasks(|t| t.lun == lun) {
            let t = self.task(id).expect("just selected");
            let (attribute, phase, aborted) = (t.attribute, t.phase, t.aborted);
            let blocker = matches!(
                attribute,
                TaskAttribute::Ordered | TaskAttribute::HeadOfQueue
            );
            if phase == Phase::Dormant && !aborted {
                let go = match attribute {
                    TaskAttribute::Ordered => !older_live,
                    _ => !older_blocker,
                };
                if go {
                    enable.push(id);
                }
            }
            older_live = true;
            older_blocker |= blocker;
        }
        for id in enable {
            // A task that completes at once ends and enables the dormant tasks after it from
            // within start(): skip those this loop would otherwise start a second time.
            if !matches!(self.task(id), Ok(t) if t.phase == Phase::Dormant) {
                continue;
            }
            if let Some(lu) = self.lu_mut(lun) {
                lu.dormant -= 1;
            }
            self.start(id);
        }
    }

    /// Tasks matching `f`, oldest first.
    fn select_tasks(&self, f: impl Fn(&Task) -> bool) -> Vec<TaskId> {
        let mut v: Vec<(u64, TaskId)> = self
            .tasks
            .iter()
            .enumerate()
            .filter_map(|(i, s)| {
                let t = s.value.as_ref()?;
                f(t).then_some((
                    t.seq,
                    TaskId {
                        index: i as u32,
                        generation: s.generation,
                    },
                ))
            })
            .collect();
        v.sort_unstable_by_key(|e| e.0);
        v.into_iter().map(|e| e.1).collect()
    }

    /// Aborts tasks: those not in the backend end now; the others when their operation
    /// completes. Returns the latter, which a task management function waits for. `by` is
    /// the nexus on whose behalf the tasks are aborted: other nexuses' tasks leave them a
    /// COMMANDS CLEARED BY ANOTHER INITIATOR unit attention (TAS is zero).
    fn abort_tasks(&mut self, ids: &[TaskId], by: Option<NexusId>) -> Vec<TaskId> {
        // Delegated tasks learn of their first abort only: they end at their transport.
        let mut first = Vec::with_capacity(ids.len());
        for &id in ids {
            if let Ok(t) = self.task_mut(id) {
                first.push(!t.aborted);
                t.aborted = true;
            } else {
                first.push(false);
            }
        }
        let mut in_flight = Vec::new();
        for (&id, first) in ids.iter().zip(first) {
            let Ok(t) = self.task(id) else { continue };
            let (nexus, lun, tag, phase) = (t.nexus, t.lun, t.tag, t.phase);
            if by.is_some_and(|b| b != nexus) {
                let announced = self
                    .nexus_mut(nexus)
                    .and_then(|n| push_ua(n, lun, Asc::COMMANDS_CLEARED_BY_ANOTHER_INITIATOR));
                self.actions.extend(announced);
            }
            if phase == Phase::Delegated {
                in_flight.push(id);
                if first {
                    self.actions.push_back(Action::Aborted { task: id, tag });
                }
            } else if matches!(phase, Phase::Backend | Phase::Reserving | Phase::Draining) {
                in_flight.push(id);
            } else {
                self.end(id, Some(Action::Aborted { task: id, tag }));
            }
        }
        in_flight
    }

    /// Starts a task management function; [`Action::TaskManagementDone`] answers it.
    pub fn task_management(
        &mut self,
        nexus: NexusId,
        lun: u64,
        function: TmfFunction,
        reference: u64,
    ) -> Result<(), DeviceError> {
        let name = self.nexus(nexus)?.name.clone();
        let index = lun_index(lun).filter(|&i| self.lu(i).is_some());
        let mut response = TmfResponse::Complete;
        let needs_lu = !matches!(
            function,
            TmfFunction::ItNexusReset | TmfFunction::TargetWarmReset
        );
        let waiting = match (function, index) {
            (_, None) if needs_lu => {
                response = TmfResponse::IncorrectLun;
                Vec::new()
            }
            (TmfFunction::AbortTask(tag), Some(l)) => {
                let ids = self.select_tasks(|t| t.nexus == nexus && t.lun == l && t.tag == tag);
                if ids.is_empty() {
                    response = TmfResponse::TaskNotFound;
                }
                self.abort_tasks(&ids, Some(nexus))
            }
            (TmfFunction::AbortTaskSet, Some(l)) => {
                let ids = self.select_tasks(|t| t.nexus == nexus && t.lun == l);
                self.abort_tasks(&ids, Some(nexus))
            }
            (TmfFunction::ClearTaskSet, Some(l)) => {
                let ids = self.select_tasks(|t| t.lun == l);
                self.abort_tasks(&ids, Some(nexus))
            }
            (TmfFunction::ClearAca, Some(_)) => Vec::new(),
            (TmfFunction::LogicalUnitReset, Some(l)) => {
                let ids = self.select_tasks(|t| t.lun == l);
                let w = self.abort_tasks(&ids, None);
                self.reset_lu(l, &name, reference);
                w
            }
            (TmfFunction::ItNexusReset, _) => {
                let ids = self.select_tasks(|t| t.nexus == nexus);
                let w = self.abort_tasks(&ids, None);
                self.release_nexus_holds(&name, Some(reference));
                for l in self.luns() {
                    let announced = self
                        .nexus_mut(nexus)
                        .and_then(|n| push_ua(n, l, Asc::I_T_NEXUS_LOSS));
                    self.actions.extend(announced);
                }
                w
            }
            (TmfFunction::TargetWarmReset, _) => {
                let ids = self.select_tasks(|_| true);
                let w = self.abort_tasks(&ids, None);
                for l in self.luns() {
                    self.reset_lu(l, &name, reference);
                }
                w
            }
            (TmfFunction::QueryTask(tag), Some(l)) => {
                if self
                    .select_tasks(|t| t.nexus == nexus && t.lun == l && t.tag == tag && !t.aborted)
                    .is_empty()
                {
                    response = TmfResponse::Complete
                } else {
                    response = TmfResponse::Succeeded(None)
                }
                Vec::new()
            }
            (TmfFunction::QueryTaskSet, Some(l)) => {
                if !self
                    .select_tasks(|t| t.nexus == nexus && t.lun == l && !t.aborted)
                    .is_empty()
                {
                    response = TmfResponse::Succeeded(None)
                }
                Vec::new()
            }
            (TmfFunction::QueryAsynchronousEvent, Some(l)) => {
                let n = self.nexus(nexus)?;
                if let Some(&(_, asc)) = n.unit_attentions.iter().find(|&&(x, _)| x == l) {
                    response =
                        TmfResponse::Succeeded(Some([SenseKey::UnitAttention as u8, asc.0, asc.1]));
                }
                Vec::new()
            }
            (_, None) => Vec::new(),
        };
        // A reset of a unit whose reservations are shared is answered once every server of
        // the unit has reset it too.
        let keeper = self
            .changes
            .iter()
            .filter(|c| c.tmf == Some(reference))
            .count();
        if waiting.is_empty() && keeper == 0 {
            self.actions.push_back(Action::TaskManagementDone {
                nexus,
                reference,
                response,
            });
        } else {
            self.tmfs.push(PendingTmf {
                nexus,
                reference,
                response,
                waiting,
                keeper,
            });
        }
        Ok(())
    }

    /// LOGICAL UNIT RESET's effects on the unit's state (SAM-5 section 6.3.3): the SPC-2
    /// reservation and medium removal prevention go, mode parameters return to their defaults,
    /// and every nexus gets a unit attention (persistent reservations stay).
    /// With shared reservations the reset goes to the keeper too, which has every other
    /// device server serving the unit reset it as well (its SPC-2 reservation is shared
    /// state; its tasks and unit attentions are each server's).
    fn reset_lu(&mut self, lun: u16, by: &ItNexus, tmf: u64) {
        if let Some(lu) = self.lu_mut(lun) {
            if lu.shared.is_none() {
                lu.reservations.spc2 = None;
            } else {
                self.changes.push_back(ReservationChange {
                    task: None,
                    tmf: Some(tmf),
                    lun,
                    nexus: by.clone(),
                    request: ReservationRequest::Reset,
                });
            }
        }
        self.reset_lu_state(lun);
    }

    /// What a LOGICAL UNIT RESET resets of a unit here, beside its reservations.
    fn reset_lu_state(&mut self, lun: u16) {
        if let Some(lu) = self.lu_mut(lun) {
            lu.prevent.clear();
            lu.stopped = false;
            lu.d_sense = false;
        }
        self.unit_attention_all(lun, Asc::BUS_DEVICE_RESET_OCCURRED, None);
    }
}

impl Device {
    /// Takes the nexus's oldest unit attention on `lun` (REQUEST SENSE reports it).
    pub(crate) fn nexus_ua_pop(&mut self, nexus: NexusId, lun: u16) -> Option<Asc> {
        let n = self.nexus_mut(nexus)?;
        let i = n.unit_attentions.iter().position(|&(l, _)| l == lun)?;
        Some(n.unit_attentions.remove(i).1)
    }

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

    /// PREEMPT AND ABORT: aborts the tasks on `lun` of the nexuses named, except `except`.
    pub(crate) fn abort_nexus_tasks(
        &mut self,
        lun: u16,
        names: &[ItNexus],
        except: Option<TaskId>,
    ) {
        let ids: Vec<NexusId> = self
            .nexus_ids()
            .into_iter()
            .filter(|&n| self.nexus(n).is_ok_and(|x| names.contains(&x.name)))
            .collect();
        // Not `except` (the PREEMPT AND ABORT itself), nor a change to shared reservations
        // under way at their keeper: its outcome is decided there.
        let doomed = self.select_tasks(|t| {
            t.lun == lun && ids.contains(&t.nexus) && t.phase != Phase::Reserving
        });
        let doomed: Vec<TaskId> = doomed.into_iter().filter(|&t| Some(t) != except).collect();
        self.abort_tasks(&doomed, None);
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
