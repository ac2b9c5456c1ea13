//! Carrying out the task layer's requests: the part every transport machine does the same way,
//! written once.
//!
//! An operation for the backend or a buffer it waits for becomes an [`Event`] for the shell; a
//! logical unit gone while its task ran is reported to the core as a backend error; data-out,
//! once all of it is in, goes to the core or runs a delegated write; a finished task is
//! accounted, answered, then retired; a task the transport fails is aborted through the core.
//! A transport machine supplies its own part through [`Carrier`]: how it fetches data-out (R2T,
//! RDMA READ), how it answers a finished task (Data-In and SCSI Response, RDMA WRITE and
//! SRP_RSP), what it forgets of an ended one, and how it answers task management. The machines
//! implement [`Carrier`] on a private view of themselves, so these hooks are not their API.

use std::time::Instant;

use cmdtrace::Stage;

use super::{
    Accounting, Completion, DataReady, Request, Returned, TaskBuffer, TaskEntry, TaskTable,
};
use crate::backend::{BackendError, Op, Output};
use crate::sense::{Asc, SenseBytes};
use crate::task::{Action, TaskId, TmfFunction, TmfResponse};

/// The calls into the SCSI core that carrying out a task's requests makes: what every
/// transport's handle on the core has (iSCSI's connection and SRP's channel each add their
/// own). A daemon implements it over its shared core (taking the lock once per step), a
/// single-threaded embedder over a [`Router`](super::Router).
pub trait TaskCore {
    /// All the data-out the core asked of `task` is in `data`.
    fn data_out(&mut self, task: TaskId, data: &[u8]);
    /// A backend operation of `task` has ended (or could not run).
    fn backend_done(&mut self, task: TaskId, result: Result<Output, BackendError>);
    /// A delegated task (a plain READ or WRITE the transport finished without the core,
    /// [`Action::Delegated`]) has ended: [`Device::retire`](crate::Device::retire). Its
    /// response is already queued. A daemon that shares the core between threads may queue
    /// this without taking the core's lock, as long as the queue is applied before anything
    /// that waits for it ([`Device::awaits_retirement`](crate::Device::awaits_retirement)).
    fn retire(&mut self, task: TaskId);
    /// Starts a task management function for the transport's I_T nexus; its answer comes back
    /// as [`Action::TaskManagementDone`] with the returned reference. `None`: the core refused
    /// it.
    fn task_management(&mut self, lun: u64, function: TmfFunction) -> Option<u64>;
    /// The block size of LUN index `lun`, `None` when it is gone.
    fn block_size(&mut self, lun: u16) -> Option<u32>;
}

/// What a transport machine asks of its shell besides sending: the same for every transport.
#[derive(Debug)]
#[must_use = "an event is work the machine waits for (a backend operation, a buffer)"]
pub enum Event<B> {
    /// Run `op` on LUN index `lun` with `buffer`, then hand the buffer and the outcome back to
    /// the machine (`handle_backend_done`).
    Backend {
        /// The core's handle.
        task: TaskId,
        /// LUN index.
        lun: u16,
        /// The operation.
        op: Op,
        /// Its buffer, at least [`Op::buffer_len`] long.
        buffer: B,
    },
    /// Task `tag` waits for a buffer of `len` bytes (for a backend operation, or for SRP's
    /// data-out): hand one to the machine (`handle_buffer`) when the allocator has room, in
    /// the order asked, or `None` when it never can.
    BufferWanted {
        /// The task's tag.
        tag: u64,
        /// Bytes needed.
        len: usize,
    },
    /// A task has ended: what it moved, for the per-LU counters.
    Completed(Accounting),
}

/// A transport machine's own part in carrying out its task table's requests; the provided
/// methods are the part every transport shares. `C` is the machine's handle on the core.
pub trait Carrier<B: TaskBuffer, C: TaskCore + ?Sized> {
    /// The transport's state of a task.
    type Task;

    /// The machine's task table.
    fn tasks(&mut self) -> &mut TaskTable<Self::Task, B>;
    /// Queues an event for the shell, in order.
    fn event(&mut self, event: Event<B>);
    /// Whether the machine records trace points (finding a task's tag is skipped when not).
    fn tracing(&self) -> bool;
    /// Records that task `tag` reached `stage`, with `arg`, when tracing.
    fn trace(&mut self, stage: Stage, tag: u64, arg: u32);
    /// The core wants `len` bytes of task `tag`'s data-out, `received` of them already in:
    /// fetch the rest (iSCSI: R2Ts beyond the unsolicited data; SRP: a buffer, then RDMA
    /// READ), and call [`Carrier::deliver_data`] when it has landed.
    fn fetch_data_out(&mut self, tag: u64, len: u32, received: u32, core: &mut C);
    /// A task has ended: queue its data-in and status. It has been accounted; a delegated
    /// task is retired after this returns, so what its retirement lets go follows the
    /// response.
    fn respond(&mut self, completion: Completion<Self::Task, B>, core: &mut C);
    /// A task has ended with nothing to send (aborted): let go of what the transport held for
    /// it. A delegated one is retired after this returns.
    fn forget(&mut self, tag: u64, entry: &mut TaskEntry<Self::Task, B>);
    /// The core has answered task management function `reference`.
    fn tmf_done(&mut self, reference: u64, response: TmfResponse, core: &mut C);
    /// The core aborts a task the transport failed, under task management function
    /// `reference`: its answer is the machine's own, for no initiator.
    fn aborting(&mut self, reference: u64);
    /// A unit attention to report at once (SRP_AER_REQ); a transport that did not ask for
    /// them ([`Device::report_unit_attentions`](crate::Device::report_unit_attentions))
    /// never gets one, and the default ignores it.
    fn unit_attention(&mut self, lun: u64, sense: SenseBytes) {
        let _ = (lun, sense);
    }

    /// Carries out what the task layer makes of the core's action `action` at `now`.
    fn action(&mut self, action: Action, now: Instant, core: &mut C) {
        if let Some(request) = self.tasks().action(action, now, |lun| core.block_size(lun)) {
            self.request(request, core);
        }
    }

    /// Carries out a request of the task layer.
    fn request(&mut self, request: Request<Self::Task, B>, core: &mut C) {
        match request {
            Request::DataOut { tag, len, received } => {
                self.fetch_data_out(tag, len, received, core);
                // Unsolicited data may have brought all of it already.
                self.deliver_data(tag, core);
            }
            Request::Backend {
                tag,
                task,
                lun,
                op,
                buffer,
            } => {
                self.trace(Stage::BackendSubmit, tag, buffer.len() as u32);
                self.event(Event::Backend {
                    task,
                    lun,
                    op,
                    buffer,
                })
            }
            Request::BufferWanted { tag, len } => {
                self.trace(Stage::BufferWait, tag, len as u32);
                self.event(Event::BufferWanted { tag, len })
            }
            Request::Complete(c) => self.finish(c, core),
            Request::Ended { tag, entry } => self.ended(tag, entry, core),
            Request::UnitGone { task, .. } => core.backend_done(task, Err(BackendError::Internal)),
            Request::TaskManagementDone {
                reference,
                response,
                ..
            } => self.tmf_done(reference, response, core),
            Request::UnitAttention { lun, sense, .. } => self.unit_attention(lun, sense),
        }
    }

    /// A backend operation of `task` has ended at `now` with `result`; its buffer comes back
    /// to the task. A delegated task ends here, without the core.
    fn backend_done(
        &mut self,
        task: TaskId,
        buffer: B,
        result: Result<Output, BackendError>,
        now: Instant,
        core: &mut C,
    ) {
        if self.tracing() {
            if let Some(tag) = self.tasks().tag_of(task) {
                self.trace(Stage::BackendDone, tag, 0);
            }
        }
        let ok = result.as_ref().map(drop).map_err(|e| *e);
        let returned = self.tasks().backend_returned(task, buffer, ok, now);
        self.returned(returned, result, core);
    }

    /// The buffer task `tag` waited for ([`Event::BufferWanted`]) for its backend operation, or
    /// `None` when the allocator can never give it: the operation fails as if the backend had.
    fn grant_buffer(&mut self, tag: u64, buffer: Option<B>, now: Instant, core: &mut C) {
        match buffer {
            Some(buffer) => {
                if let Some(r) = self.tasks().grant_buffer(tag, buffer) {
                    self.request(r, core);
                }
            }
            None => {
                if let Some(r) = self.tasks().buffer_refused(tag, now) {
                    self.returned(r, Err(BackendError::Internal), core);
                }
            }
        }
    }

    /// Carries out what the task layer makes of a backend operation's end.
    fn returned(
        &mut self,
        returned: Returned<Self::Task, B>,
        result: Result<Output, BackendError>,
        core: &mut C,
    ) {
        match returned {
            Returned::Core(task) => core.backend_done(task, result),
            Returned::Complete(c) => self.finish(c, core),
            Returned::Ended { tag, entry } => self.ended(tag, entry, core),
            Returned::Gone => {}
        }
    }

    /// Hands task `tag`'s data-out to the core once all it asked for is in, or runs a
    /// delegated write's operation.
    fn deliver_data(&mut self, tag: u64, core: &mut C) {
        let run = match self.tasks().data_complete(tag) {
            Some(DataReady::Core { task, data }) => {
                core.data_out(task, data);
                None
            }
            Some(DataReady::Run(r)) => Some(r),
            None => return,
        };
        self.trace(Stage::DataOutDone, tag, 0);
        if let Some(r) = run {
            self.request(r, core);
        }
    }

    /// A task has ended: accounted, answered, then retired if delegated, so that what the
    /// retirement lets go (a task management function's answer) goes out after it.
    fn finish(&mut self, c: Completion<Self::Task, B>, core: &mut C) {
        let data_in = c.accounting.read_bytes.min(u64::from(u32::MAX)) as u32;
        self.trace(Stage::Responded, c.tag, data_in);
        self.event(Event::Completed(c.accounting));
        let retire = c.retire;
        self.respond(c, core);
        if let Some(task) = retire {
            core.retire(task);
        }
    }

    /// A task has ended with nothing to send; a delegated one is retired.
    fn ended(&mut self, tag: u64, mut entry: TaskEntry<Self::Task, B>, core: &mut C) {
        self.forget(tag, &mut entry);
        if let Some(task) = entry.retire() {
            core.retire(task);
        }
    }

    /// The transport fails task `tag` (data it cannot ask for again): the core aborts it,
    /// and it ends with CHECK CONDITION, ABORTED COMMAND and `asc`.
    fn fail(&mut self, tag: u64, asc: Asc, core: &mut C) {
        let Some((_, lun)) = self.tasks().fail(tag, asc) else {
            return;
        };
        if let Some(reference) = core.task_management(lun, TmfFunction::AbortTask(tag)) {
            self.aborting(reference);
        }
    }
}
