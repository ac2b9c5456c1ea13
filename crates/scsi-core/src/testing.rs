//! A driver that joins a [`Device`] to in-memory backends with plain `Vec<u8>` buffers, playing
//! the transport's part: for unit tests, property tests, fuzzing and the dispatch benchmark, and
//! as a reference for how a transport drives the core.

use std::collections::{HashMap, VecDeque};

use crate::backend::{Backend, MemoryBackend, Op};
use crate::device::Device;
use crate::lu::LogicalUnit;
use crate::nexus::TransportId;
use crate::task::{
    Action, Command, DataIn, Delegation, NexusId, Residual, Status, TaskAttribute, TaskId,
};
use crate::task::{TmfFunction, TmfResponse};

/// The 8-byte LUN field for a LUN index, as an integer.
fn lun_field(lun: u16) -> u64 {
    u64::from_be_bytes(crate::spc::report_luns::lun_bytes(lun))
}

/// How a command ended, as an initiator sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Outcome {
    /// Status; `None` if the task was aborted.
    pub status: Option<Status>,
    /// Sense data bytes.
    pub sense: Vec<u8>,
    /// Data-in received.
    pub data: Vec<u8>,
    /// Residual.
    pub residual: Residual,
    /// Bytes of data-out the target asked for.
    pub data_out_asked: u32,
}

impl Outcome {
    /// Sense key, ASC and ASCQ, from fixed or descriptor sense.
    pub fn sense_code(&self) -> Option<(u8, u8, u8)> {
        let s = &self.sense;
        match s.first()? & 0x7f {
            0x70 | 0x71 => Some((s[2] & 0x0f, s[12], s[13])),
            0x72 | 0x73 => Some((s[1] & 0x0f, s[2], s[3])),
            _ => None,
        }
    }

    /// GOOD.
    pub fn is_good(&self) -> bool {
        self.status == Some(Status::Good)
    }
}

/// A device, its memory backends and one initiator-side view of each task.
#[derive(Debug)]
pub struct Harness {
    /// The device under test.
    pub device: Device,
    /// Backends by LUN index.
    pub backends: Vec<Option<MemoryBackend>>,
    /// When set, backend operations wait in [`Harness::held`] until released.
    pub hold_backend: bool,
    /// Backend operations waiting for [`Harness::release`].
    pub held: VecDeque<(TaskId, u16, Op)>,
    /// When set, data-out requests wait in [`Harness::held_data_out`].
    pub hold_data_out: bool,
    /// Tasks waiting for data-out, until [`Harness::release_data_out`].
    pub held_data_out: VecDeque<(TaskId, u32)>,
    buffers: Vec<Vec<u8>>,
    data_out: Vec<Vec<u8>>,
    asked: Vec<u32>,
    /// Delegated tasks' operation and plan, by task index, until they are retired; and
    /// whether the core aborted the task while its operation was held in the backend.
    plans: Vec<Option<(u16, Op, Delegation)>>,
    aborted: Vec<bool>,
    /// Finished commands by tag.
    pub outcomes: HashMap<u64, Outcome>,
    /// Finished task management functions by reference.
    pub tmf: HashMap<u64, TmfResponse>,
    /// Unit attentions announced (nexuses that report them), in order.
    pub announced: Vec<(NexusId, u64, crate::SenseBytes)>,
    next_tag: u64,
}

impl Harness {
    /// A harness around `device` (add units with [`Harness::add_lu`]). It finishes delegated
    /// tasks ([`Action::Delegated`]) as a transport does; turn delegation on with
    /// [`Device::set_delegation`].
    pub fn new(device: Device) -> Harness {
        Harness {
            device,
            backends: Vec::new(),
            hold_backend: false,
            held: VecDeque::new(),
            hold_data_out: false,
            held_data_out: VecDeque::new(),
            buffers: Vec::new(),
            data_out: Vec::new(),
            asked: Vec::new(),
            plans: Vec::new(),
            aborted: Vec::new(),
            outcomes: HashMap::new(),
            tmf: HashMap::new(),
            announced: Vec::new(),
            next_tag: 1,
        }
    }

    /// Adds a logical unit backed by memory.
    pub fn add_lu(&mut self, index: u16, unit: LogicalUnit) {
        let g = unit.geometry;
        self.device.add_lu(index, unit).expect("free LUN");
        let i = usize::from(index);
        if self.backends.len() <= i {
            self.backends.resize_with(i + 1, || None);
        }
        self.backends[i] = Some(MemoryBackend::new(g.block_size, g.blocks));
    }

    /// Opens a nexus for an iSCSI initiator port named `name` with ISID `isid`, through
    /// relative target port 1, and clears its power-on unit attentions.
    pub fn login(&mut self, name: &str, isid: u8) -> NexusId {
        self.login_through(name, isid, 1)
    }

    /// As [`Harness::login`], through relative target port `relative_port`.
    pub fn login_through(&mut self, name: &str, isid: u8, relative_port: u16) -> NexusId {
        let n = self.device.open_nexus(
            TransportId::iscsi(name, [0x80, 0, 0, 0, 0, isid]),
            relative_port,
        );
        for lun in self.device.luns() {
            while !self.command(n, lun, &[0; 6], &[], 0).is_good() {}
        }
        n
    }

    /// Submits a command without running it: returns its tag.
    pub fn submit(
        &mut self,
        nexus: NexusId,
        lun: u16,
        cdb: &[u8],
        attribute: TaskAttribute,
        data_out: &[u8],
        data_in_len: u32,
    ) -> u64 {
        let tag = self.next_tag;
        self.next_tag += 1;
        let id = self
            .device
            .submit(Command {
                nexus,
                lun: lun_field(lun),
                cdb,
                attribute,
                tag,
                data_in_len,
                data_out_len: data_out.len() as u32,
            })
            .expect("live nexus");
        let i = id.index();
        if self.data_out.len() <= i {
            self.data_out.resize_with(i + 1, Vec::new);
            self.buffers.resize_with(i + 1, Vec::new);
            self.asked.resize(i + 1, 0);
            self.plans.resize(i + 1, None);
            self.aborted.resize(i + 1, false);
        }
        self.data_out[i].clear();
        self.data_out[i].extend_from_slice(data_out);
        self.asked[i] = 0;
        tag
    }

    /// Runs one command to completion (unless backend operations are held) and returns how it
    /// ended.
    pub fn command(
        &mut self,
        nexus: NexusId,
        lun: u16,
        cdb: &[u8],
        data_out: &[u8],
        data_in_len: u32,
    ) -> Outcome {
        let tag = self.submit(
            nexus,
            lun,
            cdb,
            TaskAttribute::Simple,
            data_out,
            data_in_len,
        );
        self.run();
        self.outcomes.remove(&tag).expect("the command finished")
    }

    /// Starts a task management function; its response lands in [`Harness::tmf`].
    pub fn task_management(&mut self, nexus: NexusId, lun: u16, f: TmfFunction, reference: u64) {
        self.device
            .task_management(nexus, lun_field(lun), f, reference)
            .expect("live nexus");
        self.run();
    }

    /// Completes the oldest held backend operation.
    pub fn release(&mut self) -> bool {
        let Some((task, lun, op)) = self.held.pop_front() else {
            return false;
        };
        self.execute(task, lun, op);
        self.run();
        true
    }

    /// Sends the data-out of the oldest task waiting for it.
    pub fn release_data_out(&mut self) -> bool {
        let Some((task, len)) = self.held_data_out.pop_front() else {
            return false;
        };
        self.supply_data_out(task, len);
        self.run();
        true
    }

    /// Hands the task the first `len` bytes of its data-out (zero-padded).
    fn supply_data_out(&mut self, task: TaskId, len: u32) {
        let i = task.index();
        self.asked[i] = len;
        let mut buf = std::mem::take(&mut self.buffers[i]);
        buf.clear();
        buf.resize(len as usize, 0);
        let n = self.data_out[i].len().min(len as usize);
        buf[..n].copy_from_slice(&self.data_out[i][..n]);
        self.buffers[i] = buf;
        match self.plans[i] {
            Some((lun, op, _)) => self.run_op(task, lun, op),
            None => self
                .device
                .data_out(task, &self.buffers[i])
                .expect("task waits"),
        }
    }

    /// Runs a backend operation now, or holds it.
    fn run_op(&mut self, task: TaskId, lun: u16, op: Op) {
        if self.hold_backend {
            self.held.push_back((task, lun, op));
        } else {
            self.execute(task, lun, op);
        }
    }

    fn execute(&mut self, task: TaskId, lun: u16, op: Op) {
        let i = task.index();
        let backend = self.backends[usize::from(lun)]
            .as_mut()
            .expect("backend for every unit");
        let need = op.buffer_len(
            self.device
                .logical_unit(lun)
                .map_or(512, |u| u.geometry.block_size),
        ) as usize;
        let buf = std::mem::take(&mut self.buffers[i]);
        let mut buf = buf;
        if buf.len() < need {
            buf.resize(need, 0);
        }
        backend.submit(i as u64, op, buf);
        let mut done = Vec::with_capacity(1);
        while let Some(c) = backend.poll_completion() {
            done.push(c);
        }
        for (_, result, buf) in done {
            self.buffers[i] = buf;
            match self.plans[i].take() {
                Some((_, _, plan)) => {
                    let tag = self.device.tag(task).expect("a live task");
                    let o = plan.outcome(result.map(drop));
                    if !std::mem::take(&mut self.aborted[i]) {
                        self.finished(task, tag, o);
                    }
                    self.device.retire(task).expect("delegated");
                }
                None => self.device.backend_done(task, result).expect("task waits"),
            }
        }
    }

    /// Records how a task ended.
    fn finished(&mut self, task: TaskId, tag: u64, o: crate::task::Outcome) {
        let i = task.index();
        let data = match o.data_in {
            DataIn::None => Vec::new(),
            DataIn::Parameter(d) => d,
            DataIn::Buffer { len } => self.buffers[i][..len as usize].to_vec(),
        };
        self.outcomes.insert(
            tag,
            Outcome {
                status: Some(o.status),
                sense: o.sense.map(|s| s.as_slice().to_vec()).unwrap_or_default(),
                data,
                residual: o.residual,
                data_out_asked: self.asked[i],
            },
        );
    }

    /// Processes actions until none is left (held backend operations stay held).
    pub fn run(&mut self) {
        while let Some(action) = self.device.poll() {
            match action {
                Action::DataOut { task, len, .. } if self.hold_data_out => {
                    self.asked[task.index()] = len;
                    self.held_data_out.push_back((task, len));
                }
                Action::DataOut { task, len, .. } => self.supply_data_out(task, len),
                Action::Backend { task, lun, op } => self.run_op(task, lun, op),
                Action::Delegated {
                    task,
                    lun,
                    op,
                    data_out,
                    plan,
                    ..
                } => {
                    self.plans[task.index()] = Some((lun, op, plan));
                    match data_out {
                        0 => self.run_op(task, lun, op),
                        len if self.hold_data_out => {
                            self.asked[task.index()] = len;
                            self.held_data_out.push_back((task, len));
                        }
                        len => self.supply_data_out(task, len),
                    }
                }
                Action::Complete {
                    task,
                    tag,
                    status,
                    sense,
                    data_in,
                    residual,
                } => {
                    let o = crate::task::Outcome {
                        status,
                        sense,
                        data_in,
                        residual,
                    };
                    self.finished(task, tag, o);
                }
                Action::Aborted { task, tag } => {
                    let i = task.index();
                    if self.held.iter().any(|h| h.0 == task) && self.plans[i].is_some() {
                        // In the backend: retired once the operation returns.
                        self.aborted[i] = true;
                    } else if self.plans[i].take().is_some() {
                        // Not started: nothing more happens for it.
                        self.held_data_out.retain(|h| h.0 != task);
                        self.device.retire(task).expect("delegated");
                    }
                    self.outcomes.insert(
                        tag,
                        Outcome {
                            status: None,
                            sense: Vec::new(),
                            data: Vec::new(),
                            residual: Residual::None,
                            data_out_asked: self.asked[task.index()],
                        },
                    );
                }
                Action::TaskManagementDone {
                    reference,
                    response,
                    ..
                } => {
                    self.tmf.insert(reference, response);
                }
                Action::UnitAttention { nexus, lun, sense } => {
                    self.announced.push((nexus, lun, sense));
                }
            }
        }
    }
}
