//! The vocabulary between a transport and the core (SAM-5 sections 5 and 8): commands in,
//! actions out, task attributes, status, residuals and task management.

use crate::backend::{BackendError, Op};
use crate::sense::{Sense, SenseBytes};

/// Task attribute (SAM-5 section 8.6): how a command is ordered in the task set.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum TaskAttribute {
    /// Enabled once every older HEAD OF QUEUE and ORDERED task has ended.
    #[default]
    Simple,
    /// Enabled once every older task has ended; newer SIMPLE tasks wait for it.
    Ordered,
    /// Enabled at once, ahead of everything waiting.
    HeadOfQueue,
    /// For an ACA condition, which this target does not establish (NACA is not supported).
    Aca,
}

/// SCSI status (SAM-5 section 5.3).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum Status {
    /// GOOD.
    Good = 0x00,
    /// CHECK CONDITION: sense data follows.
    CheckCondition = 0x02,
    /// CONDITION MET (PRE-FETCH found room in cache).
    ConditionMet = 0x04,
    /// BUSY.
    Busy = 0x08,
    /// RESERVATION CONFLICT.
    ReservationConflict = 0x18,
    /// TASK SET FULL.
    TaskSetFull = 0x28,
    /// ACA ACTIVE.
    AcaActive = 0x30,
    /// TASK ABORTED.
    TaskAborted = 0x40,
}

/// A task's handle while it is in the core. Handles are reused after the task ends; the
/// generation tells a stale handle from a live one.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct TaskId {
    pub(crate) index: u32,
    pub(crate) generation: u32,
}

impl TaskId {
    /// A dense index, below the number of tasks ever live at once: transports can keep their
    /// per-task state in a vector indexed by it.
    pub fn index(&self) -> usize {
        self.index as usize
    }

    /// The handle as one integer, for a transport that passes handles through atomics (a
    /// lock-free queue of tasks to retire).
    pub fn to_bits(self) -> u64 {
        u64::from(self.generation) << 32 | u64::from(self.index)
    }

    /// The handle [`TaskId::to_bits`] made. Any integer gives a handle; one the device never
    /// issued is stale, which every call that takes a handle checks.
    pub fn from_bits(bits: u64) -> TaskId {
        TaskId {
            index: bits as u32,
            generation: (bits >> 32) as u32,
        }
    }
}

/// An I_T nexus's handle (see [`crate::Device::open_nexus`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct NexusId {
    pub(crate) index: u32,
    pub(crate) generation: u32,
}

impl NexusId {
    /// A dense index, below the number of nexuses ever open at once: transports can keep their
    /// per-nexus state in a vector indexed by it (a closed nexus's index is reused).
    pub fn index(&self) -> usize {
        self.index as usize
    }
}

/// Residual (SAM-5 section 5.4.3): how the data the command wanted compares with what the
/// initiator expected to transfer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Residual {
    /// They agree.
    #[default]
    None,
    /// The command wanted more than the expected length by this many bytes.
    Overflow(u32),
    /// The command moved this many bytes less than the expected length.
    Underflow(u32),
}

impl Residual {
    /// From the command's transfer length and the initiator's expected length.
    pub fn of(wanted: u64, expected: u32) -> Residual {
        let e = u64::from(expected);
        if wanted > e {
            Residual::Overflow(u32::try_from(wanted - e).unwrap_or(u32::MAX))
        } else if wanted < e {
            Residual::Underflow((e - wanted) as u32)
        } else {
            Residual::None
        }
    }
}

/// A command as a transport hands it in.
#[derive(Debug, Clone, Copy)]
pub struct Command<'a> {
    /// The I_T nexus it arrived on.
    pub nexus: NexusId,
    /// The 8-byte LUN field, as a big-endian integer.
    pub lun: u64,
    /// The CDB (up to 16 bytes).
    pub cdb: &'a [u8],
    /// Task attribute.
    pub attribute: TaskAttribute,
    /// The transport's tag (iSCSI Initiator Task Tag, SRP tag); returned in every action.
    pub tag: u64,
    /// Expected length of data-in, in bytes (0 when the command does not read).
    pub data_in_len: u32,
    /// Expected length of data-out, in bytes (0 when the command does not write).
    pub data_out_len: u32,
}

/// Data-in that goes with a completion.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum DataIn {
    /// None.
    #[default]
    None,
    /// The first `len` bytes of the task's buffer, where the backend read them.
    Buffer {
        /// Bytes to send (already limited to the expected length).
        len: u32,
    },
    /// Parameter data built by the core (already limited to the expected length).
    Parameter(Vec<u8>),
}

/// What the transport is to do next.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
#[must_use = "an action is what the transport must do for the task; ignored, the task hangs"]
pub enum Action {
    /// Gather `len` bytes of data-out into the task's buffer, then call
    /// [`Device::data_out`](crate::Device::data_out).
    DataOut {
        /// The task.
        task: TaskId,
        /// Its tag.
        tag: u64,
        /// Bytes wanted.
        len: u32,
    },
    /// Run `op` on logical unit `lun` with the task's buffer, then call
    /// [`Device::backend_done`](crate::Device::backend_done).
    Backend {
        /// The task.
        task: TaskId,
        /// The LUN index.
        lun: u16,
        /// The operation.
        op: Op,
    },
    /// A plain read or write the transport carries out to the end by itself: fetch `data_out`
    /// bytes of data-out into the task's buffer (none for a read), run `op` on logical unit
    /// `lun` with it, send the status [`Delegation::outcome`] gives for the operation's result,
    /// then call [`Device::retire`](crate::Device::retire). The core does not hear of the data
    /// or the backend, so such a command costs its transport one call into the core (the
    /// submission), which is what lets a transport that shares the core between threads take
    /// the core's lock once per command. The core holds the task, and a write's block range,
    /// until it is retired. If the task is aborted meanwhile, [`Action::Aborted`] names it: the
    /// transport sends nothing for it and retires it once its operation, if started, has
    /// returned.
    Delegated {
        /// The task.
        task: TaskId,
        /// Its tag.
        tag: u64,
        /// The LUN index.
        lun: u16,
        /// The operation.
        op: Op,
        /// Bytes of data-out to fetch before running `op` (0 for a read).
        data_out: u32,
        /// How the task ends.
        plan: Delegation,
    },
    /// The task has ended: send the data-in, then the status (with sense when there is any).
    Complete {
        /// The task (its handle is free from now on).
        task: TaskId,
        /// Its tag.
        tag: u64,
        /// Status.
        status: Status,
        /// Sense data, with CHECK CONDITION.
        sense: Option<SenseBytes>,
        /// Data-in to send before the status.
        data_in: DataIn,
        /// Residual for the response.
        residual: Residual,
    },
    /// The task was aborted: send nothing for it and release its buffer. A delegated task
    /// ([`Action::Delegated`]) is retired once its operation, if started, has returned.
    Aborted {
        /// The task (its handle is free from now on, unless it was delegated).
        task: TaskId,
        /// Its tag.
        tag: u64,
    },
    /// A unit attention was established for a nexus whose transport reports asynchronous
    /// events ([`Device::report_unit_attentions`](crate::Device::report_unit_attentions)):
    /// tell its initiator (SRP_AER_REQ). It stays pending for the next command too.
    UnitAttention {
        /// The nexus.
        nexus: NexusId,
        /// The 8-byte LUN.
        lun: u64,
        /// Its sense data (fixed format, UNIT ATTENTION).
        sense: SenseBytes,
    },
    /// A task management function has finished.
    TaskManagementDone {
        /// The nexus that asked.
        nexus: NexusId,
        /// The transport's reference for the request.
        reference: u64,
        /// The outcome.
        response: TmfResponse,
    },
}

/// How a delegated task ([`Action::Delegated`]) ends, decided by the core when it delegated
/// it: the transport only says whether the backend operation succeeded.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Delegation {
    /// Bytes of the buffer to send as data-in when the operation succeeds (a read's data,
    /// already limited to the expected length; 0 for a write).
    pub data_in: u32,
    /// The residual with GOOD status.
    pub residual: Residual,
    /// The residual with CHECK CONDITION.
    pub failed_residual: Residual,
    /// Sense in descriptor format (the unit's D_SENSE).
    pub d_sense: bool,
}

/// How a task ends: its status, sense, data-in and residual.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Outcome {
    /// Status.
    pub status: Status,
    /// Sense data, with CHECK CONDITION.
    pub sense: Option<SenseBytes>,
    /// Data-in to send before the status.
    pub data_in: DataIn,
    /// Residual.
    pub residual: Residual,
}

impl Delegation {
    /// The task's ending after its operation returned `result`: GOOD with the data-in, or
    /// CHECK CONDITION with the sense the core gives the backend's error.
    pub fn outcome(&self, result: Result<(), BackendError>) -> Outcome {
        match result {
            Ok(()) => Outcome {
                status: Status::Good,
                sense: None,
                data_in: if self.data_in > 0 {
                    DataIn::Buffer { len: self.data_in }
                } else {
                    DataIn::None
                },
                residual: self.residual,
            },
            Err(e) => Outcome {
                status: Status::CheckCondition,
                sense: Some(Sense::from(e).encode(self.d_sense)),
                data_in: DataIn::None,
                residual: self.failed_residual,
            },
        }
    }
}

/// Task management functions (SAM-5 section 7).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum TmfFunction {
    /// Abort the task with this tag.
    AbortTask(u64),
    /// Abort the nexus's tasks on the LU.
    AbortTaskSet,
    /// Abort every task on the LU.
    ClearTaskSet,
    /// Clear an ACA condition.
    ClearAca,
    /// Reset the LU.
    LogicalUnitReset,
    /// Abort the nexus's tasks on every LU and reset its state.
    ItNexusReset,
    /// Reset every LU of the target.
    TargetWarmReset,
    /// Is the task with this tag in the task set?
    QueryTask(u64),
    /// Has the nexus any task on the LU?
    QueryTaskSet,
    /// Is a unit attention pending for the nexus on the LU?
    QueryAsynchronousEvent,
}

/// The outcome of a task management function (SAM-5 section 7.12).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TmfResponse {
    /// FUNCTION COMPLETE.
    Complete,
    /// FUNCTION SUCCEEDED (the query found what it asked about). For QUERY ASYNCHRONOUS EVENT,
    /// the pending unit attention's sense key, ASC and ASCQ.
    Succeeded(Option<[u8; 3]>),
    /// The referenced task does not exist (ABORT TASK on a tag the core does not hold).
    TaskNotFound,
    /// INCORRECT LOGICAL UNIT NUMBER.
    IncorrectLun,
    /// FUNCTION REJECTED.
    Rejected,
}
