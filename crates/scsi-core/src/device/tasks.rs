//! The task set and dispatch: a command enters dormant or enabled by its attribute, is
//! checked for unit attentions and reservation conflicts and dispatched, asks for data-out,
//! runs its backend operations (writes holding their block ranges), or is delegated to its
//! transport and retired; it ends with its status.

use super::*;

impl Device {
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
    pub(super) fn no_such_lun(&mut self, cdb: &[u8; 16]) -> Result<Reply, TaskError> {
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
    pub(super) fn start(&mut self, id: TaskId) {
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
    pub(super) fn admit(
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
    pub(super) fn delegated(&mut self, id: TaskId, mut op: Op, data_out: u32, read: u32) -> bool {
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
    pub(super) fn release_range(&mut self, id: TaskId) {
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

    pub(super) fn after_data(&mut self, id: TaskId, data: &[u8]) {
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
    pub(super) fn issue_next(&mut self, id: TaskId) {
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
    pub(super) fn retry_lock_waiters(&mut self, lun: u16) {
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
    pub(super) fn hold_copy_status(&mut self, id: TaskId, list_id: u8, segments: u16, bytes: u64) {
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
    pub(super) fn end(&mut self, id: TaskId, last: Option<Action>) {
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

    /// Applies the task attribute rules to the unit's dormant tasks.
    pub(super) fn enable_dormant(&mut self, lun: u16) {
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
}
