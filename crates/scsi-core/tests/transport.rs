//! The task layer: a miniature transport drives a device through a `TaskTable`, as iSCSI and
//! SRP do: data-out fetched when the core asks, buffers granted from a small pool (so backend
//! operations wait for them), completions with data-in and accounting, transport failures
//! reported as ABORTED COMMAND, a unit removed under a task, and tags in use.

mod common;

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use common::*;
use scsi_core::transport::{
    Completion, DataReady, NewTask, Request, Returned, TagError, TaskTable,
};
use scsi_core::{
    Asc, BackendError, Command, DataIn, Device, MemoryBackend, NexusId, SenseKey, Status,
    TaskAttribute, TmfFunction, TransportId,
};

/// A transport's own per-task state: here, the data-out the initiator will send.
#[derive(Debug, Default)]
struct Wire {
    data_out: Vec<u8>,
}

/// One connection of a miniature transport on a virtual clock.
struct Port {
    device: Device,
    backend: MemoryBackend,
    nexus: NexusId,
    table: TaskTable<Wire, Vec<u8>>,
    /// Bytes of buffer the pool may still lend.
    pool: usize,
    waiting: VecDeque<(u64, usize)>,
    backend_ops: VecDeque<(scsi_core::TaskId, scsi_core::Op, Vec<u8>)>,
    done: Vec<Completion<Wire, Vec<u8>>>,
    ended: Vec<u64>,
    now: Instant,
}

impl Port {
    /// A port whose device delegates plain reads and writes when `delegate` is set.
    fn with(delegate: bool) -> Port {
        let mut device = Device::new("iqn.2026-11.io.example:t", ports());
        device.set_delegation(delegate);
        device.add_lu(0, unit(false, b"lu0")).unwrap();
        let nexus = device.open_nexus(TransportId::iscsi("iqn.x:a", [0x80, 0, 0, 0, 0, 1]), 1);
        let mut p = Port {
            device,
            backend: MemoryBackend::new(512, BLOCKS),
            nexus,
            table: TaskTable::new(),
            pool: 1 << 20,
            waiting: VecDeque::new(),
            backend_ops: VecDeque::new(),
            done: Vec::new(),
            ended: Vec::new(),
            now: Instant::now(),
        };
        // Clear the power-on unit attention.
        let tag = p.submit(&[0; 6], Vec::new(), 0);
        p.run();
        assert_eq!(p.take(tag).status, Status::CheckCondition);
        p
    }

    fn submit(&mut self, cdb: &[u8], data_out: Vec<u8>, data_in_len: u32) -> u64 {
        let tag = 1 + self.done.len() as u64 + self.table.len() as u64 + self.ended.len() as u64;
        self.submit_tag(tag, cdb, data_out, data_in_len).unwrap();
        tag
    }

    fn submit_tag(
        &mut self,
        tag: u64,
        cdb: &[u8],
        data_out: Vec<u8>,
        data_in_len: u32,
    ) -> Result<(), TagError> {
        self.submit_with(tag, cdb, TaskAttribute::Simple, data_out, data_in_len)
    }

    fn submit_with(
        &mut self,
        tag: u64,
        cdb: &[u8],
        attribute: TaskAttribute,
        data_out: Vec<u8>,
        data_in_len: u32,
    ) -> Result<(), TagError> {
        let new = NewTask {
            lun: 0,
            data_out_len: data_out.len() as u32,
            data_in_len,
            buffer: None,
            received: 0,
            transport: Wire { data_out },
        };
        self.table.insert(tag, new, self.now)?;
        let len = self.table.get(tag).unwrap().data_out_len;
        let task = self
            .device
            .submit(Command {
                nexus: self.nexus,
                lun: 0,
                cdb,
                attribute,
                tag,
                data_in_len,
                data_out_len: len,
            })
            .unwrap();
        self.table.submitted(tag, task);
        Ok(())
    }

    /// Runs the core's actions through the table until nothing moves, leaving backend
    /// operations queued (run them with `complete_backend`).
    fn run(&mut self) {
        while let Some(a) = self.device.poll() {
            let r = self
                .table
                .action(a, self.now, |lun| (lun == 0).then_some(512));
            // Nothing: a delegated task aborted while its operation runs ends when it returns.
            let Some(r) = r else { continue };
            match r {
                Request::DataOut { tag, len, received } => {
                    // The "initiator" sends what is wanted into a buffer from the pool.
                    let t = self.table.get_mut(tag).unwrap();
                    let data = t.transport.data_out[received as usize..len as usize].to_vec();
                    let mut buf = self.table.take_buffer(tag).unwrap_or_default();
                    buf.extend_from_slice(&data);
                    self.table.put_buffer(tag, buf);
                    self.table.data_received(tag, data.len() as u32);
                    match self.table.data_complete(tag).expect("all in") {
                        DataReady::Core { task, data } => self.device.data_out(task, data).unwrap(),
                        DataReady::Run(Request::Backend {
                            task, op, buffer, ..
                        }) => self.backend_ops.push_back((task, op, buffer)),
                        DataReady::Run(Request::BufferWanted { tag, len }) => {
                            self.waiting.push_back((tag, len));
                            self.grant();
                        }
                        DataReady::Run(other) => panic!("{other:?}"),
                    }
                }
                Request::BufferWanted { tag, len } => {
                    self.waiting.push_back((tag, len));
                    self.grant();
                }
                Request::Backend {
                    task, op, buffer, ..
                } => self.backend_ops.push_back((task, op, buffer)),
                Request::Complete(c) => self.completed(c),
                Request::Ended { tag, entry } => self.ended(tag, &entry),
                Request::UnitGone { task, .. } => {
                    self.device
                        .backend_done(task, Err(BackendError::Internal))
                        .unwrap();
                }
                Request::TaskManagementDone { .. } | Request::UnitAttention { .. } => {}
            }
        }
    }

    /// Submits a one-block WRITE at LBA 0 with a buffer but no data-out yet, and takes the
    /// core's first action for it (the transport carries it out by hand).
    fn one_block_write(&mut self, tag: u64) -> (scsi_core::TaskId, scsi_core::Action) {
        let new = NewTask {
            lun: 0,
            data_out_len: 512,
            data_in_len: 0,
            buffer: Some(vec![0u8; 512]),
            received: 0,
            transport: Wire::default(),
        };
        self.table.insert(tag, new, self.now).unwrap();
        let task = self
            .device
            .submit(Command {
                nexus: self.nexus,
                lun: 0,
                cdb: &cdb10(0x2a, 0, 0, 1),
                attribute: TaskAttribute::Simple,
                tag,
                data_in_len: 0,
                data_out_len: 512,
            })
            .unwrap();
        self.table.submitted(tag, task);
        (task, self.device.poll().unwrap())
    }

    /// A task has ended with a response; a delegated one is retired after it.
    fn completed(&mut self, c: Completion<Wire, Vec<u8>>) {
        self.pool += c.buffer.as_ref().map_or(0, Vec::capacity);
        let retire = c.retire;
        self.done.push(c);
        if let Some(task) = retire {
            self.device.retire(task).unwrap();
        }
        self.grant();
    }

    /// A task has ended without a response.
    fn ended(&mut self, tag: u64, entry: &scsi_core::transport::TaskEntry<Wire, Vec<u8>>) {
        self.pool += entry.buffer().map_or(0, Vec::capacity);
        self.ended.push(tag);
        if let Some(task) = entry.retire() {
            self.device.retire(task).unwrap();
        }
        self.grant();
    }

    /// Grants buffers in arrival order while the pool has room.
    fn grant(&mut self) {
        while let Some(&(tag, len)) = self.waiting.front() {
            if len > self.pool {
                return;
            }
            self.waiting.pop_front();
            self.pool -= len;
            let r = self.table.grant_buffer(tag, Vec::with_capacity(len));
            if let Some(Request::Backend {
                task, op, buffer, ..
            }) = r
            {
                self.backend_ops.push_back((task, op, buffer));
            }
        }
    }

    fn complete_backend(&mut self) -> bool {
        let Some((task, op, mut buffer)) = self.backend_ops.pop_front() else {
            return false;
        };
        let result = self.backend.execute(&op, &mut buffer);
        self.now += Duration::from_micros(100);
        let ok = result.map(drop);
        match self.table.backend_returned(task, buffer, ok, self.now) {
            Returned::Core(task) => self.device.backend_done(task, result).unwrap(),
            Returned::Complete(c) => self.completed(c),
            Returned::Ended { tag, entry } => self.ended(tag, &entry),
            Returned::Gone => panic!("a task the table does not know"),
        }
        self.run();
        true
    }

    fn settle(&mut self) {
        self.run();
        while self.complete_backend() {}
    }

    fn take(&mut self, tag: u64) -> Completion<Wire, Vec<u8>> {
        let i = self.done.iter().position(|c| c.tag == tag).expect("done");
        self.done.swap_remove(i)
    }
}

fn data_in(c: &Completion<Wire, Vec<u8>>) -> Vec<u8> {
    match &c.data_in {
        DataIn::None => Vec::new(),
        DataIn::Buffer { len } => c.buffer.as_ref().unwrap()[..*len as usize].to_vec(),
        DataIn::Parameter(v) => v.clone(),
    }
}

#[test]
fn writes_and_reads_move_through_the_table_with_accounting() {
    for delegate in [false, true] {
        let mut p = Port::with(delegate);
        let data: Vec<u8> = (0..4096u32).map(|i| (i * 7) as u8).collect();
        let w = p.submit(&cdb10(0x2a, 0, 10, 8), data.clone(), 0);
        p.settle();
        let c = p.take(w);
        assert_eq!(c.status, Status::Good);
        assert_eq!(c.accounting.write_bytes, 4096);
        assert_eq!(c.accounting.read_bytes, 0);
        assert_eq!(c.accounting.latency, Duration::from_micros(100));
        let r = p.submit(&cdb10(0x28, 0, 10, 8), Vec::new(), 4096);
        p.settle();
        let c = p.take(r);
        assert_eq!(c.status, Status::Good);
        assert_eq!(c.accounting.read_bytes, 4096);
        assert_eq!(data_in(&c), data);
        assert!(p.table.is_empty() && p.table.idle());
        // Parameter data (INQUIRY) comes from the core, not a buffer.
        let i = p.submit(&[0x12, 0, 0, 0, 36, 0], Vec::new(), 36);
        p.settle();
        let c = p.take(i);
        assert!(matches!(c.data_in, DataIn::Parameter(_)));
        assert_eq!(&data_in(&c)[8..15], b"STGT   ");
    }
}

#[test]
fn backend_operations_wait_for_buffers_in_arrival_order() {
    for delegate in [false, true] {
        let mut p = Port::with(delegate);
        p.pool = 8192;
        // Three 8 KiB reads: one buffer's worth at a time.
        let tags: Vec<u64> = (0..3)
            .map(|i| p.submit(&cdb10(0x28, 0, i * 16, 16), Vec::new(), 8192))
            .collect();
        p.run();
        assert_eq!(p.backend_ops.len(), 1);
        assert_eq!(p.table.parked(), 2);
        assert!(p.table.get(tags[1]).unwrap().is_parked());
        // The first completes and its buffer goes back: the second is granted, not the third.
        assert!(p.complete_backend());
        assert_eq!(p.backend_ops.len(), 1);
        assert_eq!(p.table.parked(), 1);
        p.settle();
        assert_eq!(p.table.parked(), 0);
        for t in tags {
            assert_eq!(p.take(t).status, Status::Good);
        }
    }
}

#[test]
fn a_failed_task_ends_with_aborted_command_and_its_asc() {
    for delegate in [false, true] {
        let mut p = Port::with(delegate);
        // A write whose data-out the transport "loses": the core asked, the table fails it.
        let (submitted, a) = p.one_block_write(77);
        match p.table.action(a, p.now, |_| Some(512)) {
            Some(Request::DataOut {
                tag: 77,
                len: 512,
                received: 0,
            }) => {}
            other => panic!("{other:?}"),
        }
        let (task, lun) = p
            .table
            .fail(77, Asc(0x47, 0x05))
            .expect("the core holds it");
        assert_eq!(task, submitted);
        assert_eq!(p.table.fail(77, Asc(0x47, 0x05)), None, "failed once");
        p.table.data_received(77, 512);
        assert!(
            p.table.data_complete(77).is_none(),
            "a failed task gets no data"
        );
        assert_eq!(lun, 0);
        p.device
            .task_management(p.nexus, 0, TmfFunction::AbortTask(77), 1)
            .unwrap();
        let _ = task;
        p.run();
        let c = p.take(77);
        assert_eq!(c.status, Status::CheckCondition);
        let s = c.sense.unwrap();
        let s = s.as_slice();
        assert_eq!((s[2] & 0xf, s[12], s[13]), (0x0b, 0x47, 0x05));
        assert!(p.table.is_empty());
    }
}

#[test]
fn an_aborted_task_ends_without_a_response() {
    for delegate in [false, true] {
        let mut p = Port::with(delegate);
        let r = p.submit(&cdb10(0x28, 0, 0, 1), Vec::new(), 512);
        p.run();
        assert_eq!(p.backend_ops.len(), 1);
        p.device
            .task_management(p.nexus, 0, TmfFunction::AbortTask(r), 9)
            .unwrap();
        p.run();
        // The abort waits for the backend; then the task ends silently.
        p.settle();
        assert_eq!(p.ended, [r]);
        assert!(p.done.iter().all(|c| c.tag != r));
        assert!(p.table.is_empty());
    }
}

#[test]
fn tags_in_use_and_refusals() {
    for delegate in [false, true] {
        let mut p = Port::with(delegate);
        p.pool = 0;
        let r = p.submit(&cdb10(0x28, 0, 0, 1), Vec::new(), 512);
        p.run();
        assert_eq!(
            p.submit_tag(r, &cdb10(0x28, 0, 0, 1), Vec::new(), 512),
            Err(TagError::InUse(r))
        );
        assert_eq!(p.table.in_core().collect::<Vec<_>>(), [(r, 0)]);
        // A command the transport refuses itself never reaches the core.
        let new = NewTask {
            lun: 0,
            data_out_len: 0,
            data_in_len: 0,
            buffer: None,
            received: 0,
            transport: Wire::default(),
        };
        p.table.insert(500, new, p.now).unwrap();
        let c = p
            .table
            .refuse(
                500,
                SenseKey::IllegalRequest,
                Asc::INVALID_FIELD_IN_CDB,
                p.now,
            )
            .unwrap();
        assert!(c.accounting.error);
        assert_eq!(c.status, Status::CheckCondition);
        assert!(p.table.get(500).is_none());
        p.pool = 4096;
        p.grant();
        p.settle();
        assert_eq!(p.take(r).status, Status::Good);
    }
}

/// What holds a buffer for data-out still to come, and a task turned away for want of one.
#[test]
fn buffers_awaiting_data_out_and_tasks_turned_away() {
    let mut p = Port::with(false);
    assert!(!p.table.awaits_data_out(), "nothing is held");
    // A read holds no buffer for data-out.
    let r = p.submit(&cdb10(0x28, 0, 0, 1), Vec::new(), 512);
    p.run();
    assert!(!p.table.awaits_data_out());
    // A write with its buffer and none of its data waits for the initiator ...
    let (task, action) = p.one_block_write(700);
    assert!(p.table.awaits_data_out(), "a buffer waiting for data-out");
    let Some(Request::DataOut { tag, .. }) = p.table.action(action, p.now, |_| Some(512)) else {
        panic!("the core wants the data-out");
    };
    assert_eq!(tag, 700);
    let b = p.table.take_buffer(700).unwrap();
    p.table.put_buffer(700, b);
    p.table.data_received(700, 512);
    assert!(p.table.awaits_data_out(), "in, but not yet handed on");
    // ... until its data has gone to the core.
    match p.table.data_complete(700) {
        Some(DataReady::Core { task: t, data }) => {
            assert_eq!(t, task);
            p.device.data_out(t, data).unwrap();
        }
        other => panic!("{other:?}"),
    }
    assert!(!p.table.awaits_data_out(), "its data is in the core");
    p.settle();
    assert_eq!(p.take(700).status, Status::Good);
    assert_eq!(p.take(r).status, Status::Good);
    // A failed write holds its buffer only until the abort ends it: not for data-out.
    let (_, action) = p.one_block_write(701);
    let _ = p.table.action(action, p.now, |_| Some(512));
    assert!(p.table.awaits_data_out());
    assert!(p.table.fail(701, Asc::DATA_PHASE_ERROR).is_some());
    assert!(!p.table.awaits_data_out());
    // Turned away: the status alone, not an error, and the tag is free again.
    let new = NewTask {
        lun: 0,
        data_out_len: 4096,
        data_in_len: 0,
        buffer: None,
        received: 0,
        transport: Wire::default(),
    };
    p.table.insert(702, new, p.now).unwrap();
    let c = p.table.turn_away(702, Status::TaskSetFull, p.now).unwrap();
    assert_eq!(c.status, Status::TaskSetFull);
    assert!(c.sense.is_none() && !c.accounting.error);
    assert!(matches!(c.data_in, DataIn::None));
    assert!(!p.table.contains(702));
}

#[test]
fn a_unit_removed_under_a_task_fails_it() {
    for delegate in [false, true] {
        let mut p = Port::with(delegate);
        let r = p.submit(&cdb10(0x28, 0, 0, 1), Vec::new(), 512);
        // The core wants the backend for LUN 0, which the transport no longer has.
        let a = p.device.poll().unwrap();
        match p.table.action(a, p.now, |_| None) {
            Some(Request::UnitGone { tag, task }) if !delegate => {
                assert_eq!(tag, r);
                p.device
                    .backend_done(task, Err(BackendError::Internal))
                    .unwrap();
            }
            // A delegated read ends in the table, and is retired.
            Some(Request::Complete(c)) if delegate => p.completed(c),
            other => panic!("{other:?}"),
        }
        p.run();
        let c = p.take(r);
        assert_eq!(c.status, Status::CheckCondition);
        let s = c.sense.unwrap();
        assert_eq!((s.as_slice()[2] & 0xf, s.as_slice()[12]), (0x04, 0x44));
        assert_eq!(p.device.task_count(), 0, "retired");
    }
}

/// The outcome of a command run alone through a port, delegated or not.
fn run_alone(
    p: &mut Port,
    cdb: &[u8],
    data_out: Vec<u8>,
    data_in_len: u32,
) -> (Status, Option<Vec<u8>>, scsi_core::Residual, Vec<u8>) {
    let tag = p.submit(cdb, data_out, data_in_len);
    p.settle();
    let c = p.take(tag);
    let data = data_in(&c);
    (
        c.status,
        c.sense.map(|s| s.as_slice().to_vec()),
        c.residual,
        data,
    )
}

#[test]
fn delegated_tasks_end_as_the_core_would_end_them() {
    let mut plain = Port::with(false);
    let mut delegated = Port::with(true);
    let block: Vec<u8> = (0..512u32).map(|i| i as u8).collect();
    let cases: Vec<(Vec<u8>, Vec<u8>, u32)> = vec![
        // Writes: exact, initiator expects more, less, and a partial block.
        (cdb10(0x2a, 0, 3, 1), block.clone(), 0),
        (
            cdb10(0x2a, 0x08, 4, 2),
            [block.clone(), block.clone()].concat(),
            0,
        ),
        (
            cdb10(0x2a, 0, 6, 1),
            [block.clone(), block.clone()].concat(),
            0,
        ),
        (cdb10(0x2a, 0, 7, 2), block.clone(), 0),
        (cdb10(0x2a, 0, 8, 1), block[..200].to_vec(), 0),
        // Reads: exact, more and less expected than the command moves.
        (cdb10(0x28, 0, 3, 1), Vec::new(), 512),
        (cdb10(0x28, 0, 4, 2), Vec::new(), 4096),
        (cdb10(0x28, 0, 3, 4), Vec::new(), 1024),
        (cdb10(0x28, 0, 8, 1), Vec::new(), 0),
        // Out of range, and past the end: the core answers either way.
        (cdb10(0x28, 0, BLOCKS as u32 - 1, 2), Vec::new(), 1024),
        (cdb10(0x2a, 0, BLOCKS as u32, 1), block.clone(), 0),
    ];
    for (cdb, out, inn) in cases {
        let a = run_alone(&mut plain, &cdb, out.clone(), inn);
        let b = run_alone(&mut delegated, &cdb, out, inn);
        assert_eq!(a, b, "{cdb:02x?}");
    }
    assert_eq!(delegated.device.task_count(), 0);
}

#[test]
fn delegated_tasks_hold_the_task_set_until_retired() {
    let mut p = Port::with(true);
    // Two reads in the backend, then an ORDERED read: it waits for both to be retired.
    let r1 = p.submit(&cdb10(0x28, 0, 0, 1), Vec::new(), 512);
    let r2 = p.submit(&cdb10(0x28, 0, 1, 1), Vec::new(), 512);
    p.submit_with(
        50,
        &cdb10(0x28, 0, 2, 1),
        TaskAttribute::Ordered,
        Vec::new(),
        512,
    )
    .unwrap();
    p.run();
    assert_eq!(p.backend_ops.len(), 2, "the ORDERED read waits");
    assert!(p.device.awaits_retirement());
    assert!(p.complete_backend());
    assert_eq!(p.take(r1).status, Status::Good);
    assert_eq!(p.backend_ops.len(), 1);
    assert!(p.complete_backend());
    assert_eq!(p.take(r2).status, Status::Good);
    // Both retired: the ORDERED read is enabled (and itself delegated).
    assert_eq!(p.backend_ops.len(), 1);
    assert!(!p.device.awaits_retirement());
    p.settle();
    assert_eq!(p.take(50).status, Status::Good);

    // Overlapping writes: the second is not delegated while the first holds its range, and
    // runs once the first is retired.
    let w1 = p.submit(&cdb10(0x2a, 0, 10, 4), vec![1; 2048], 0);
    p.run();
    let w2 = p.submit(&cdb10(0x2a, 0, 12, 4), vec![2; 2048], 0);
    p.run();
    assert_eq!(
        p.backend_ops.len(),
        1,
        "the second write waits for its range"
    );
    assert!(p.device.awaits_retirement());
    p.settle();
    assert_eq!(p.take(w1).status, Status::Good);
    assert_eq!(p.take(w2).status, Status::Good);
    let (_, _, _, data) = run_alone(&mut p, &cdb10(0x28, 0, 10, 6), Vec::new(), 3072);
    assert_eq!(data, [vec![1; 1024], vec![2; 2048]].concat());
    assert_eq!(p.device.task_count(), 0);
}

#[test]
fn aborting_a_delegated_task() {
    let mut p = Port::with(true);
    // A write waiting for its data-out ends at once, without a response, and is retired.
    let (_, a) = p.one_block_write(70);
    assert!(matches!(
        a,
        scsi_core::Action::Delegated { data_out: 512, .. }
    ));
    assert!(matches!(
        p.table.action(a, p.now, |_| Some(512)),
        Some(Request::DataOut { len: 512, .. })
    ));
    p.device
        .task_management(p.nexus, 0, TmfFunction::AbortTask(70), 1)
        .unwrap();
    p.run();
    assert_eq!(p.ended, [70]);
    assert_eq!(p.device.task_count(), 0);
    // A read whose operation runs: the abort waits for it, then it ends without a response.
    let r = p.submit(&cdb10(0x28, 0, 0, 1), Vec::new(), 512);
    p.run();
    p.device
        .task_management(p.nexus, 0, TmfFunction::AbortTask(r), 2)
        .unwrap();
    p.run();
    assert_eq!(p.device.task_count(), 1, "in the backend");
    assert!(p.device.awaits_retirement(), "the abort waits");
    p.settle();
    assert_eq!(p.ended, [70, r]);
    assert!(p.done.iter().all(|c| c.tag != r));
    assert_eq!(p.device.task_count(), 0);
    assert!(!p.device.awaits_retirement());
}

#[test]
fn a_delegated_read_that_fails_reports_the_backends_error() {
    let mut p = Port::with(true);
    let r = p.submit(&cdb10(0x28, 0, 5, 1), Vec::new(), 512);
    p.run();
    let (task, _, buffer) = p.backend_ops.pop_front().unwrap();
    let err = Err(BackendError::Read { lba: 5 });
    match p.table.backend_returned(task, buffer, err, p.now) {
        Returned::Complete(c) => p.completed(c),
        other => panic!("{other:?}"),
    }
    let c = p.take(r);
    assert_eq!(c.status, Status::CheckCondition);
    let s = c.sense.unwrap();
    let s = s.as_slice();
    // MEDIUM ERROR, UNRECOVERED READ ERROR, the LBA in INFORMATION.
    assert_eq!((s[2] & 0xf, s[12], s[13]), (0x03, 0x11, 0x00));
    assert_eq!(&s[3..7], &5u32.to_be_bytes());
    assert_eq!(p.device.task_count(), 0);
}
