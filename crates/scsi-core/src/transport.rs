//! The task layer every transport drives: what a SCSI transport protocol (iSCSI, SRP) keeps
//! for each command between the wire and the [`Device`](crate::Device), in one place, so a
//! transport adds only its own framing and data movement.
//!
//! A [`TaskTable`] maps the transport's tag (iSCSI Initiator Task Tag, SRP tag) to a task:
//! the core's [`TaskId`] once the command is in, the task's data buffer, the expected
//! data-out and data-in lengths, how much data-out has arrived, the backend operation that
//! waits for a buffer, a transport failure to report, and what the task moved (for per-LU
//! accounting). The transport owns the table; [`TaskTable::action`] turns each [`Action`] the
//! core hands out into a [`Request`] the transport carries out:
//!
//! | the core's [`Action`] | the transport's [`Request`] |
//! | --- | --- |
//! | `DataOut` | [`Request::DataOut`]: fetch data-out up to this length (R2T, RDMA READ) |
//! | `Backend` | [`Request::Backend`] with the task's buffer, or [`Request::BufferWanted`] |
//! | `Delegated` | as `DataOut` (a write), then as `Backend`; the table ends the task itself |
//! | `Complete` | [`Request::Complete`]: send the data-in, then the status with sense |
//! | `Aborted` | [`Request::Complete`] for a task the transport failed, else [`Request::Ended`] |
//! | `TaskManagementDone` | [`Request::TaskManagementDone`] |
//! | `UnitAttention` | [`Request::UnitAttention`]: tell the initiator (SRP_AER_REQ) |
//!
//! Buffers are the transport's type `B` ([`TaskBuffer`]): a registered arena slot run in the
//! daemon, a `Vec<u8>` in tests. The table never allocates one: it says how many bytes it
//! wants ([`Request::BufferWanted`]) and the transport grants it ([`TaskTable::grant_buffer`])
//! when its allocator has room, which is how a short arena becomes backpressure instead of an
//! error. Time comes in as an argument (sans-IO), as it does everywhere in this crate.
//!
//! Calls into the [`Device`](crate::Device) stay with the transport: it decides when to take
//! the device's lock and may batch them. The table says what to call: a task whose data-out
//! is complete ([`TaskTable::data_complete`]), one to abort ([`TaskTable::fail`]), one whose
//! backend operation returned ([`TaskTable::backend_returned`]), one to retire
//! ([`Completion::retire`], [`TaskEntry::retire`]).
//!
//! How a transport machine carries out the requests is the same for every transport except
//! where its protocol differs: [`Carrier`] holds the shared part (an [`Event`] for the shell
//! for each backend operation and wanted buffer, data delivery, finish then retire, fail then
//! abort), and the machine supplies its own (fetching data-out, answering a finished task,
//! task management). [`TaskCore`] is what of the core that needs.
//!
//! A delegated task ([`Action::Delegated`], a plain READ or WRITE) is carried to its end by
//! the table: data-out, then the backend operation, then the completion the core planned,
//! with no call into the core between its submission and its retirement. That is how a
//! command costs one acquisition of a core shared between threads.

use std::collections::HashMap;
use std::time::{Duration, Instant};

pub use crate::router::{CoreEvent, Router, Sink};
pub use carry::{Carrier, Event, TaskCore};

mod carry;

use crate::backend::{BackendError, Op};
use crate::sense::{Asc, Sense, SenseBytes, SenseKey};
use crate::task::{Action, DataIn, Delegation, NexusId, Residual, Status, TaskId, TmfResponse};

/// A task's data buffer as the table sees it: bytes with a usable length within a capacity.
pub trait TaskBuffer: std::ops::DerefMut<Target = [u8]> {
    /// Bytes it can hold without reallocation.
    fn capacity(&self) -> usize;
    /// Sets the usable length, at most [`TaskBuffer::capacity`].
    fn set_len(&mut self, len: usize);
}

impl TaskBuffer for Vec<u8> {
    fn capacity(&self) -> usize {
        Vec::capacity(self)
    }

    fn set_len(&mut self, len: usize) {
        self.resize(len, 0);
    }
}

/// A command as the transport hands it to the table, before the core has it.
#[derive(Debug)]
pub struct NewTask<T, B> {
    /// The 8-byte LUN field.
    pub lun: u64,
    /// Bytes of data-out the initiator expects to send (0 for none).
    pub data_out_len: u32,
    /// Bytes of data-in the initiator expects to receive (0 for none).
    pub data_in_len: u32,
    /// The buffer data-out lands in, when the transport had one ready (immediate data).
    pub buffer: Option<B>,
    /// Bytes of data-out already in `buffer` (iSCSI immediate data).
    pub received: u32,
    /// The transport's own per-task state (iSCSI: R2T and DataSN bookkeeping; SRP: the
    /// initiator's memory descriptors).
    pub transport: T,
}

/// One task in the table.
#[derive(Debug)]
pub struct TaskEntry<T, B> {
    /// The 8-byte LUN field.
    pub lun: u64,
    /// Bytes of data-out the initiator expects to send.
    pub data_out_len: u32,
    /// Bytes of data-in the initiator expects to receive.
    pub data_in_len: u32,
    /// Bytes of data-out received so far.
    pub received: u32,
    /// Bytes of data-out the core asked for (at most `data_out_len`), once it has.
    pub wanted: Option<u32>,
    /// The transport's own state.
    pub transport: T,
    task: Option<TaskId>,
    buffer: Option<B>,
    data_delivered: bool,
    /// A backend operation waiting for a buffer: LUN index, operation, bytes needed.
    parked: Option<(u16, Op, usize)>,
    failed: Option<Asc>,
    arrived: Instant,
    read_bytes: u64,
    write_bytes: u64,
    /// How a delegated task ends.
    delegation: Option<Delegation>,
    /// A delegated write's operation, waiting for its data-out: LUN index, operation, bytes.
    queued: Option<(u16, Op, usize)>,
    /// A delegated task's operation is in the backend.
    running: bool,
    /// The core aborted the delegated task while its operation ran.
    aborted: bool,
}

impl<T, B> TaskEntry<T, B> {
    /// The core's handle, once the command is in the core.
    pub fn task(&self) -> Option<TaskId> {
        self.task
    }

    /// The task's buffer, when the table holds it (not lent to the backend or the wire).
    pub fn buffer(&self) -> Option<&B> {
        self.buffer.as_ref()
    }

    /// Whether the transport failed the task ([`TaskTable::fail`]).
    pub fn failed(&self) -> Option<Asc> {
        self.failed
    }

    /// Whether the task holds a buffer that only more data-out from the initiator lets go:
    /// its data-out is not all in, or not yet handed on ([`TaskTable::awaits_data_out`]).
    pub fn awaits_data_out(&self) -> bool {
        self.data_out_len > 0
            && !self.data_delivered
            && self.failed.is_none()
            && self.buffer.is_some()
    }

    /// Whether a backend operation waits for a buffer.
    pub fn is_parked(&self) -> bool {
        self.parked.is_some()
    }

    /// The core's handle of a delegated task, which the transport retires
    /// ([`Device::retire`](crate::Device::retire)) once the table has let it go.
    pub fn retire(&self) -> Option<TaskId> {
        self.delegation.and(self.task)
    }
}

/// What a finished task moved, for per-LU counters.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Accounting {
    /// The 8-byte LUN field.
    pub lun: u64,
    /// Bytes the backend read for it.
    pub read_bytes: u64,
    /// Bytes the backend wrote for it.
    pub write_bytes: u64,
    /// From arrival to completion.
    pub latency: Duration,
    /// Whether it ended with CHECK CONDITION.
    pub error: bool,
}

/// A finished task: what to send, and what the table held for it.
#[derive(Debug)]
pub struct Completion<T, B> {
    /// The transport's tag.
    pub tag: u64,
    /// The 8-byte LUN field.
    pub lun: u64,
    /// Status.
    pub status: Status,
    /// Sense data, with CHECK CONDITION.
    pub sense: Option<SenseBytes>,
    /// Data-in to send before the status: `DataIn::Buffer` names bytes of `buffer`.
    pub data_in: DataIn,
    /// Residual.
    pub residual: Residual,
    /// The task's buffer, if the table held one.
    pub buffer: Option<B>,
    /// The transport's state.
    pub transport: T,
    /// For the per-LU counters.
    pub accounting: Accounting,
    /// A delegated task: retire it ([`Device::retire`](crate::Device::retire)) once its
    /// response is on its way (queued ahead of anything the retirement may cause).
    pub retire: Option<TaskId>,
}

/// A task's data-out is all in ([`TaskTable::data_complete`]).
#[derive(Debug)]
pub enum DataReady<'a, T, B> {
    /// Hand it to the core: [`Device::data_out`](crate::Device::data_out).
    Core {
        /// The core's handle.
        task: TaskId,
        /// The data-out the core asked for.
        data: &'a [u8],
    },
    /// A delegated write: carry out this [`Request::Backend`] or [`Request::BufferWanted`].
    Run(Request<T, B>),
}

/// A backend operation has returned ([`TaskTable::backend_returned`]).
#[derive(Debug)]
pub enum Returned<T, B> {
    /// Tell the core: [`Device::backend_done`](crate::Device::backend_done).
    Core(TaskId),
    /// A delegated task has ended: send it, then retire it ([`Completion::retire`]).
    Complete(Completion<T, B>),
    /// A delegated task the core aborted meanwhile: send nothing, retire it
    /// ([`TaskEntry::retire`]).
    Ended {
        /// The transport's tag.
        tag: u64,
        /// What the table held for it.
        entry: TaskEntry<T, B>,
    },
    /// The task is gone (its buffer is dropped).
    Gone,
}

/// What the transport is to do for a task, from the core's [`Action`]s.
#[derive(Debug)]
pub enum Request<T, B> {
    /// The core wants `len` bytes of data-out (already limited to the expected length); the
    /// transport fetches what has not arrived (`received..len` less what is on its way
    /// unsolicited) and calls [`TaskTable::data_received`] as it lands.
    DataOut {
        /// The transport's tag.
        tag: u64,
        /// Bytes wanted in all.
        len: u32,
        /// Bytes already in the buffer.
        received: u32,
    },
    /// Run `op` on LUN index `lun` with `buffer` (lent out of the table: it comes back with
    /// [`TaskTable::backend_returned`], then the core hears of it through
    /// [`Device::backend_done`](crate::Device::backend_done)).
    Backend {
        /// The transport's tag.
        tag: u64,
        /// The core's handle.
        task: TaskId,
        /// LUN index.
        lun: u16,
        /// The operation.
        op: Op,
        /// Its buffer, at least [`Op::buffer_len`] long.
        buffer: B,
    },
    /// A backend operation waits for a buffer of `len` bytes: grant one with
    /// [`TaskTable::grant_buffer`] when the allocator has room.
    BufferWanted {
        /// The transport's tag.
        tag: u64,
        /// Bytes needed.
        len: usize,
    },
    /// The task has ended: send the data-in, then the status.
    Complete(Completion<T, B>),
    /// The task has ended with nothing to send (aborted by the initiator or the nexus); a
    /// delegated one is to be retired ([`TaskEntry::retire`]).
    Ended {
        /// The transport's tag.
        tag: u64,
        /// What the table held for it.
        entry: TaskEntry<T, B>,
    },
    /// The logical unit of a backend operation is gone (removed while the task ran): tell
    /// the core with [`Device::backend_done`](crate::Device::backend_done) and an error.
    UnitGone {
        /// The transport's tag.
        tag: u64,
        /// The core's handle.
        task: TaskId,
    },
    /// A task management function has finished.
    TaskManagementDone {
        /// The nexus that asked.
        nexus: NexusId,
        /// The reference the transport gave it.
        reference: u64,
        /// The outcome.
        response: TmfResponse,
    },
    /// A unit attention for the nexus, to report as an asynchronous event (SRP_AER_REQ):
    /// only a nexus whose transport asked for them gets one
    /// ([`Device::report_unit_attentions`](crate::Device::report_unit_attentions)).
    UnitAttention {
        /// The nexus.
        nexus: NexusId,
        /// The 8-byte LUN.
        lun: u64,
        /// Fixed-format sense data.
        sense: SenseBytes,
    },
}

/// Why a command cannot enter the table.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum TagError {
    /// A task with this tag is in progress (iSCSI: Reject with TASK IN PROGRESS; SRP: a
    /// response with INVALID FIELD).
    #[error("a task with tag {0:#x} is in progress")]
    InUse(u64),
}

/// A map on the per-command path keyed by what a peer chooses (a tag, an ITT, a CID):
/// foldhash, seeded at random for each map, hashes an integer in a few nanoseconds where the
/// standard SipHash takes tens (a handful of lookups per command), and without the seed a peer
/// cannot pick keys that collide.
pub type TagMap<K, V> = HashMap<K, V, foldhash::fast::RandomState>;

/// A new [`TagMap`] holding `capacity` entries without growing.
pub fn tag_map<K, V>(capacity: usize) -> TagMap<K, V> {
    HashMap::with_capacity_and_hasher(capacity, foldhash::fast::RandomState::default())
}

/// A transport connection's (or channel's) tasks, by the transport's tag.
#[derive(Debug)]
pub struct TaskTable<T, B> {
    tasks: TagMap<u64, TaskEntry<T, B>>,
    /// Tag by the core's task index: actions name tasks by [`TaskId`].
    by_task: Vec<Option<u64>>,
    parked: usize,
}

/// How many tasks a table holds without growing.
const INITIAL_TASKS: usize = 256;

impl<T, B: TaskBuffer> Default for TaskTable<T, B> {
    fn default() -> Self {
        Self::new()
    }
}

impl<T, B: TaskBuffer> TaskTable<T, B> {
    /// An empty table, sized for a few hundred tasks so steady state does not allocate.
    pub fn new() -> Self {
        TaskTable {
            tasks: tag_map(INITIAL_TASKS),
            by_task: Vec::with_capacity(INITIAL_TASKS),
            parked: 0,
        }
    }

    /// Tasks held.
    pub fn len(&self) -> usize {
        self.tasks.len()
    }

    /// Whether no task is held.
    pub fn is_empty(&self) -> bool {
        self.tasks.is_empty()
    }

    /// Whether no task is in the core (what a closing connection waits for).
    pub fn idle(&self) -> bool {
        self.tasks.values().all(|t| t.task.is_none())
    }

    /// Whether a task holds a buffer that only more data-out from the initiator lets go: its
    /// data-out is not all in, or not yet handed on (an iSCSI command waiting for its CmdSN
    /// turn waits for the initiator too). A transport that reads commands and their data from
    /// one stream must not stop reading to wait for buffer space while this holds: what
    /// frees the space may be behind the command it would wait for. Costs a pass over the
    /// table, so ask only when an allocation has failed.
    pub fn awaits_data_out(&self) -> bool {
        self.tasks.values().any(TaskEntry::awaits_data_out)
    }

    /// Backend operations waiting for a buffer.
    pub fn parked(&self) -> usize {
        self.parked
    }

    /// Every task: tag and entry, in no particular order.
    pub fn iter(&self) -> impl Iterator<Item = (u64, &TaskEntry<T, B>)> + '_ {
        self.tasks.iter().map(|(tag, t)| (*tag, t))
    }

    /// Whether `tag` is in use.
    pub fn contains(&self, tag: u64) -> bool {
        self.tasks.contains_key(&tag)
    }

    /// A task by tag.
    pub fn get(&self, tag: u64) -> Option<&TaskEntry<T, B>> {
        self.tasks.get(&tag)
    }

    /// A task by tag, to change its transport state.
    pub fn get_mut(&mut self, tag: u64) -> Option<&mut TaskEntry<T, B>> {
        self.tasks.get_mut(&tag)
    }

    /// The tag of a task the core names, if this table holds it.
    pub fn tag_of(&self, task: TaskId) -> Option<u64> {
        let tag = (*self.by_task.get(task.index())?)?;
        self.tasks
            .get(&tag)
            .filter(|t| t.task == Some(task))
            .map(|_| tag)
    }

    /// Every task the core holds: (tag, LUN field), for a closing connection to abort.
    pub fn in_core(&self) -> impl Iterator<Item = (u64, u64)> + '_ {
        self.tasks
            .iter()
            .filter(|(_, t)| t.task.is_some())
            .map(|(tag, t)| (*tag, t.lun))
    }

    /// Every task the core does not hold yet (iSCSI: waiting for its CmdSN turn), for a
    /// closing connection to forget.
    pub fn not_in_core(&self) -> impl Iterator<Item = u64> + '_ {
        self.tasks
            .iter()
            .filter(|(_, t)| t.task.is_none())
            .map(|(tag, _)| *tag)
    }

    /// Records a command arriving at `now`. The transport then submits it to the core and
    /// tells the table its handle with [`TaskTable::submitted`].
    pub fn insert(&mut self, tag: u64, new: NewTask<T, B>, now: Instant) -> Result<(), TagError> {
        if self.tasks.contains_key(&tag) {
            return Err(TagError::InUse(tag));
        }
        self.tasks.insert(
            tag,
            TaskEntry {
                lun: new.lun,
                data_out_len: new.data_out_len,
                data_in_len: new.data_in_len,
                received: new.received,
                wanted: None,
                transport: new.transport,
                task: None,
                buffer: new.buffer,
                data_delivered: false,
                parked: None,
                failed: None,
                arrived: now,
                read_bytes: 0,
                write_bytes: 0,
                delegation: None,
                queued: None,
                running: false,
                aborted: false,
            },
        );
        Ok(())
    }

    /// The command with `tag` entered the core as `task`.
    pub fn submitted(&mut self, tag: u64, task: TaskId) {
        let Some(t) = self.tasks.get_mut(&tag) else {
            return;
        };
        t.task = Some(task);
        let i = task.index();
        if self.by_task.len() <= i {
            self.by_task.resize(i + 1, None);
        }
        self.by_task[i] = Some(tag);
    }

    /// Drops a task, returning what it held: one the core never had (refused before
    /// submission, or outside the command window), or one that has ended.
    pub fn remove(&mut self, tag: u64) -> Option<TaskEntry<T, B>> {
        let t = self.tasks.remove(&tag)?;
        if t.parked.is_some() {
            self.parked -= 1;
        }
        if let Some(task) = t.task {
            if let Some(slot) = self.by_task.get_mut(task.index()) {
                *slot = None;
            }
        }
        Some(t)
    }

    /// Lends the task's buffer out (to receive data-out into it); give it back with
    /// [`TaskTable::put_buffer`].
    pub fn take_buffer(&mut self, tag: u64) -> Option<B> {
        self.tasks.get_mut(&tag)?.buffer.take()
    }

    /// Gives a lent buffer back. Without a task for `tag` the buffer is dropped (freed).
    pub fn put_buffer(&mut self, tag: u64, buffer: B) {
        if let Some(t) = self.tasks.get_mut(&tag) {
            t.buffer = Some(buffer);
        }
    }

    /// `len` more bytes of data-out have landed in the task's buffer.
    pub fn data_received(&mut self, tag: u64, len: u32) {
        if let Some(t) = self.tasks.get_mut(&tag) {
            t.received = t.received.saturating_add(len);
        }
    }

    /// Once all the data-out the core asked for is in, the task and its data, for
    /// [`Device::data_out`](crate::Device::data_out), or a delegated write's operation to run;
    /// `None` until then (and after, and for a failed task).
    pub fn data_complete(&mut self, tag: u64) -> Option<DataReady<'_, T, B>> {
        let t = self.tasks.get(&tag)?;
        let (wanted, task) = (t.wanted?, t.task?);
        if t.data_delivered || t.received < wanted || t.failed.is_some() {
            return None;
        }
        if t.queued.is_some() {
            if t.buffer.as_ref().is_none_or(|b| b.len() < wanted as usize) {
                return None;
            }
            let t = self.tasks.get_mut(&tag).expect("found above");
            t.data_delivered = true;
            let (lun, op, need) = t.queued.take().expect("checked");
            return Some(DataReady::Run(self.run(tag, lun, op, need)));
        }
        let t = self.tasks.get_mut(&tag).expect("found above");
        let data: &[u8] = match &t.buffer {
            Some(b) if b.len() >= wanted as usize => &b[..wanted as usize],
            None if wanted == 0 => &[],
            // Lent out, or too short (the transport's mistake): not yet.
            _ => return None,
        };
        t.data_delivered = true;
        Some(DataReady::Core { task, data })
    }

    /// The transport has failed the task (a lost or out-of-order data-out it cannot ask for
    /// again): it will end with CHECK CONDITION, ABORTED COMMAND and `asc`. Returns the task
    /// and its LUN field when the core holds it and must be asked to abort it; the abort's
    /// [`Action::Aborted`] then becomes that [`Request::Complete`].
    pub fn fail(&mut self, tag: u64, asc: Asc) -> Option<(TaskId, u64)> {
        let t = self.tasks.get_mut(&tag)?;
        if t.failed.is_some() {
            return None;
        }
        t.failed = Some(asc);
        Some((t.task?, t.lun))
    }

    /// A backend operation came back with the task's buffer and `result`, at `now`: whom to
    /// tell, or the end of a delegated task.
    pub fn backend_returned(
        &mut self,
        task: TaskId,
        buffer: B,
        result: Result<(), BackendError>,
        now: Instant,
    ) -> Returned<T, B> {
        let Some(tag) = self.tag_of(task) else {
            return Returned::Gone;
        };
        let t = self.tasks.get_mut(&tag).expect("tag_of found it");
        t.buffer = Some(buffer);
        if t.delegation.is_none() {
            return Returned::Core(task);
        }
        t.running = false;
        self.delegated_end(tag, result, now)
    }

    /// Ends a delegated task whose operation returned `result` (or will not run).
    fn delegated_end(
        &mut self,
        tag: u64,
        result: Result<(), BackendError>,
        now: Instant,
    ) -> Returned<T, B> {
        let Some(entry) = self.remove(tag) else {
            return Returned::Gone;
        };
        let plan = entry.delegation.expect("a delegated task");
        if entry.aborted {
            return match entry.failed {
                Some(asc) => Returned::Complete(Self::check_condition(
                    tag,
                    entry,
                    SenseKey::AbortedCommand,
                    asc,
                    now,
                )),
                None => Returned::Ended { tag, entry },
            };
        }
        let o = plan.outcome(result);
        Returned::Complete(Self::completion(
            tag, entry, o.status, o.sense, o.data_in, o.residual, now,
        ))
    }

    /// A buffer for a task whose backend operation waits ([`Request::BufferWanted`]): the
    /// operation to run now, or `None` when nothing waits any more (the buffer is dropped).
    pub fn grant_buffer(&mut self, tag: u64, buffer: B) -> Option<Request<T, B>> {
        let t = self.tasks.get_mut(&tag)?;
        let (lun, op, need) = t.parked.take()?;
        self.parked -= 1;
        let old = t.buffer.replace(buffer);
        // The new buffer replaces a smaller one; what data-out it held was delivered already
        // (the core copies what it keeps before asking for an operation that needs more).
        drop(old);
        Some(self.lend(tag, lun, op, need))
    }

    /// No buffer can ever be had for the task's waiting operation (larger than the whole
    /// allocator): it fails as if the backend had (the core to tell, or a delegated task's
    /// end). `None` when nothing waits.
    pub fn buffer_refused(&mut self, tag: u64, now: Instant) -> Option<Returned<T, B>> {
        let t = self.tasks.get_mut(&tag)?;
        t.parked.take()?;
        self.parked -= 1;
        let task = t.task?;
        if t.delegation.is_none() {
            return Some(Returned::Core(task));
        }
        Some(self.delegated_end(tag, Err(BackendError::Internal), now))
    }

    /// Turns the core's action into what the transport does, at `now`. `block_size` gives a
    /// LUN index's block size (for the bytes a backend operation needs). `None` when the
    /// action is not for this table's tasks.
    pub fn action(
        &mut self,
        action: Action,
        now: Instant,
        mut block_size: impl FnMut(u16) -> Option<u32>,
    ) -> Option<Request<T, B>> {
        match action {
            Action::DataOut { task, len, .. } => {
                let tag = self.tag_of(task)?;
                let t = self.tasks.get_mut(&tag).expect("tag_of found it");
                let len = len.min(t.data_out_len);
                t.wanted = Some(len);
                Some(Request::DataOut {
                    tag,
                    len,
                    received: t.received,
                })
            }
            Action::Backend { task, lun, op } => {
                let tag = self.tag_of(task)?;
                let Some(bs) = block_size(lun) else {
                    return Some(Request::UnitGone { tag, task });
                };
                Some(self.run(tag, lun, op, op.buffer_len(bs) as usize))
            }
            Action::Delegated {
                task,
                lun,
                op,
                data_out,
                plan,
                ..
            } => {
                let tag = self.tag_of(task)?;
                let bs = block_size(lun);
                let t = self.tasks.get_mut(&tag).expect("tag_of found it");
                t.delegation = Some(plan);
                let Some(bs) = bs else {
                    // The unit went away between submission and now.
                    return match self.delegated_end(tag, Err(BackendError::Internal), now) {
                        Returned::Complete(c) => Some(Request::Complete(c)),
                        Returned::Ended { tag, entry } => Some(Request::Ended { tag, entry }),
                        Returned::Core(_) | Returned::Gone => None,
                    };
                };
                let need = op.buffer_len(bs) as usize;
                if data_out == 0 {
                    return Some(self.run(tag, lun, op, need));
                }
                let len = data_out.min(t.data_out_len);
                t.wanted = Some(len);
                t.queued = Some((lun, op, need));
                Some(Request::DataOut {
                    tag,
                    len,
                    received: t.received,
                })
            }
            Action::Complete {
                task,
                status,
                sense,
                data_in,
                residual,
                ..
            } => {
                let tag = self.tag_of(task)?;
                let entry = self.remove(tag)?;
                Some(Request::Complete(Self::completion(
                    tag, entry, status, sense, data_in, residual, now,
                )))
            }
            Action::Aborted { task, .. } => {
                let tag = self.tag_of(task)?;
                let t = self.tasks.get_mut(&tag).expect("tag_of found it");
                if t.running {
                    // A delegated task ends when its operation returns.
                    t.aborted = true;
                    return None;
                }
                let entry = self.remove(tag)?;
                match entry.failed {
                    Some(asc) => Some(Request::Complete(Self::check_condition(
                        tag,
                        entry,
                        SenseKey::AbortedCommand,
                        asc,
                        now,
                    ))),
                    None => Some(Request::Ended { tag, entry }),
                }
            }
            Action::TaskManagementDone {
                nexus,
                reference,
                response,
            } => Some(Request::TaskManagementDone {
                nexus,
                reference,
                response,
            }),
            Action::UnitAttention { nexus, lun, sense } => {
                Some(Request::UnitAttention { nexus, lun, sense })
            }
        }
    }

    /// Ends a task the transport turns away for want of resources, with `status` (TASK SET
    /// FULL or BUSY) and no sense or data: the initiator sends it again later.
    pub fn turn_away(
        &mut self,
        tag: u64,
        status: Status,
        now: Instant,
    ) -> Option<Completion<T, B>> {
        let entry = self.remove(tag)?;
        Some(Self::completion(
            tag,
            entry,
            status,
            None,
            DataIn::None,
            Residual::None,
            now,
        ))
    }

    /// Ends a task the transport itself refuses before or instead of the core (too large to
    /// buffer, say): CHECK CONDITION with `key` and `asc`, no data.
    pub fn refuse(
        &mut self,
        tag: u64,
        key: SenseKey,
        asc: Asc,
        now: Instant,
    ) -> Option<Completion<T, B>> {
        let entry = self.remove(tag)?;
        Some(Self::check_condition(tag, entry, key, asc, now))
    }

    /// A completion with CHECK CONDITION, `key` and `asc`, and no data.
    fn check_condition(
        tag: u64,
        entry: TaskEntry<T, B>,
        key: SenseKey,
        asc: Asc,
        now: Instant,
    ) -> Completion<T, B> {
        let sense = Sense::new(key, asc).fixed();
        Self::completion(
            tag,
            entry,
            Status::CheckCondition,
            Some(sense),
            DataIn::None,
            Residual::None,
            now,
        )
    }

    /// Runs `op` (`need` bytes of buffer) on LUN index `lun` for the task: with its buffer
    /// when that is large enough, else once one is granted.
    fn run(&mut self, tag: u64, lun: u16, op: Op, need: usize) -> Request<T, B> {
        let t = self.tasks.get_mut(&tag).expect("the caller found it");
        // A task without a buffer is granted one even for an operation that moves no data (an
        // empty one, which takes no slot), so every operation has one.
        let fits = t.buffer.as_ref().is_some_and(|b| b.capacity() >= need);
        if !fits {
            if t.parked.is_none() {
                self.parked += 1;
            }
            t.parked = Some((lun, op, need));
            return Request::BufferWanted { tag, len: need };
        }
        self.lend(tag, lun, op, need)
    }

    /// Takes the task's buffer (sized to what `op` needs) out for the backend.
    fn lend(&mut self, tag: u64, lun: u16, op: Op, need: usize) -> Request<T, B> {
        let t = self.tasks.get_mut(&tag).expect("the caller found it");
        let task = t
            .task
            .expect("only tasks in the core run backend operations");
        match op {
            Op::Read { .. } => t.read_bytes += need as u64,
            Op::Write { .. } | Op::OrWrite { .. } => t.write_bytes += need as u64,
            Op::CompareAndWrite { .. } => t.write_bytes += need as u64 / 2,
            _ => {}
        }
        t.running = t.delegation.is_some();
        let mut buffer = t.buffer.take().expect("the caller saw a buffer that fits");
        if buffer.len() < need {
            buffer.set_len(need);
        }
        Request::Backend {
            tag,
            task,
            lun,
            op,
            buffer,
        }
    }

    fn completion(
        tag: u64,
        mut entry: TaskEntry<T, B>,
        status: Status,
        sense: Option<SenseBytes>,
        data_in: DataIn,
        residual: Residual,
        now: Instant,
    ) -> Completion<T, B> {
        Completion {
            tag,
            retire: entry.retire(),
            lun: entry.lun,
            status,
            sense,
            data_in,
            residual,
            buffer: entry.buffer.take(),
            accounting: Accounting {
                lun: entry.lun,
                read_bytes: entry.read_bytes,
                write_bytes: entry.write_bytes,
                latency: now.saturating_duration_since(entry.arrived),
                error: status == Status::CheckCondition,
            },
            transport: entry.transport,
        }
    }
}
