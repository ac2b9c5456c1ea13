//! The task layer: a miniature transport drives a device through a `TaskTable`, as iSCSI and
//! SRP do: data-out fetched when the core asks, buffers granted from a small pool (so backend
//! operations wait for them), completions with data-in and accounting, transport failures
//! reported as ABORTED COMMAND, a unit removed under a task, and tags in use.

mod common;

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use common::*;
use scsi_core::transport::{Completion, NewTask, Request, TagError, TaskTable};
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
    fn new() -> Port {
        let mut device = Device::new("iqn.2026-11.io.example:t", ports());
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
                attribute: TaskAttribute::Simple,
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
            match r.expect("every action is for this table") {
                Request::DataOut { tag, len, received } => {
                    // The "initiator" sends what is wanted into a buffer from the pool.
                    let t = self.table.get_mut(tag).unwrap();
                    let data = t.transport.data_out[received as usize..len as usize].to_vec();
                    let mut buf = self.table.take_buffer(tag).unwrap_or_default();
                    buf.extend_from_slice(&data);
                    self.table.put_buffer(tag, buf);
                    self.table.data_received(tag, data.len() as u32);
                    let (task, data) = self.table.data_complete(tag).expect("all in");
                    self.device.data_out(task, data).unwrap();
                }
                Request::BufferWanted { tag, len } => {
                    self.waiting.push_back((tag, len));
                    self.grant();
                }
                Request::Backend {
                    task, op, buffer, ..
                } => self.backend_ops.push_back((task, op, buffer)),
                Request::Complete(c) => {
                    self.pool += c.buffer.as_ref().map_or(0, Vec::capacity);
                    self.done.push(c);
                    self.grant();
                }
                Request::Ended { tag, entry } => {
                    self.pool += entry.buffer().map_or(0, Vec::capacity);
                    self.ended.push(tag);
                    self.grant();
                }
                Request::UnitGone { task, .. } => {
                    self.device
                        .backend_done(task, Err(BackendError::Internal))
                        .unwrap();
                }
                Request::TaskManagementDone { .. } => {}
            }
        }
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
        assert!(self.table.backend_returned(task, buffer));
        self.device.backend_done(task, result).unwrap();
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
    let mut p = Port::new();
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

#[test]
fn backend_operations_wait_for_buffers_in_arrival_order() {
    let mut p = Port::new();
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

#[test]
fn a_failed_task_ends_with_aborted_command_and_its_asc() {
    let mut p = Port::new();
    // A write whose data-out the transport "loses": the core asked, the table fails it.
    let new = NewTask {
        lun: 0,
        data_out_len: 512,
        data_in_len: 0,
        buffer: Some(vec![0u8; 512]),
        received: 0,
        transport: Wire::default(),
    };
    p.table.insert(77, new, p.now).unwrap();
    let task = p
        .device
        .submit(Command {
            nexus: p.nexus,
            lun: 0,
            cdb: &cdb10(0x2a, 0, 0, 1),
            attribute: TaskAttribute::Simple,
            tag: 77,
            data_in_len: 0,
            data_out_len: 512,
        })
        .unwrap();
    p.table.submitted(77, task);
    let a = p.device.poll().unwrap();
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

#[test]
fn an_aborted_task_ends_without_a_response() {
    let mut p = Port::new();
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

#[test]
fn tags_in_use_and_refusals() {
    let mut p = Port::new();
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

#[test]
fn a_unit_removed_under_a_task_fails_it() {
    let mut p = Port::new();
    let r = p.submit(&cdb10(0x28, 0, 0, 1), Vec::new(), 512);
    // The core wants the backend for LUN 0, which the transport no longer has.
    let a = p.device.poll().unwrap();
    match p.table.action(a, p.now, |_| None) {
        Some(Request::UnitGone { tag, task }) => {
            assert_eq!(tag, r);
            p.device
                .backend_done(task, Err(BackendError::Internal))
                .unwrap();
        }
        other => panic!("{other:?}"),
    }
    p.run();
    let c = p.take(r);
    assert_eq!(c.status, Status::CheckCondition);
}
