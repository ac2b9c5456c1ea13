//! `transport::Carrier` as an embedder's transport uses it: a miniature transport supplies
//! only its own part (how data-out arrives, what a response is, what an ended task lets go,
//! task management), and the provided methods carry out the rest: backend operations and
//! wanted buffers as events, accounting, finish then retire, fail then abort.

mod common;

use std::cell::RefCell;
use std::collections::{HashMap, VecDeque};
use std::rc::Rc;
use std::time::Instant;

use cmdtrace::Stage;
use common::*;
use scsi_core::transport::{
    Carrier, Completion, CoreEvent, Event, NewTask, Router, Sink, TaskCore, TaskEntry, TaskTable,
};
use scsi_core::{
    Asc, BackendError, Command, Device, MemoryBackend, NexusId, Output, Status, TaskAttribute,
    TaskId, TmfFunction, TmfResponse, TransportId,
};

/// What happened, in order, on both sides of the trait.
type Log = Rc<RefCell<Vec<String>>>;

/// The core's events for the one connection.
#[derive(Default)]
struct Queue(VecDeque<CoreEvent>);

impl Sink<()> for Queue {
    fn push(&mut self, _: &(), event: CoreEvent) {
        self.0.push_back(event);
    }
}

/// The core as the miniature transport reaches it.
struct Core<'a> {
    router: &'a mut Router<()>,
    queue: &'a mut Queue,
    nexus: NexusId,
    log: Log,
}

impl TaskCore for Core<'_> {
    fn data_out(&mut self, task: TaskId, data: &[u8]) {
        self.router
            .data_out(task, data, self.queue)
            .expect("wanted");
    }

    fn backend_done(&mut self, task: TaskId, result: Result<Output, BackendError>) {
        self.router
            .backend_done(task, result, self.queue)
            .expect("running");
    }

    fn retire(&mut self, task: TaskId) {
        self.log.borrow_mut().push("retire".into());
        self.router.retire(task, self.queue).expect("delegated");
    }

    fn task_management(&mut self, lun: u64, function: TmfFunction) -> Option<u64> {
        let r = self
            .router
            .task_management(self.nexus, lun, function, &(), self.queue);
        r.ok()
    }

    fn block_size(&mut self, lun: u16) -> Option<u32> {
        let unit = self.router.device().logical_unit(lun)?;
        Some(unit.geometry.block_size)
    }
}

/// A response as the transport recorded it: status, data-in, sense.
type Response = (Status, Vec<u8>, Option<Vec<u8>>);

/// The miniature transport: data-out comes whole from `wire`, responses are recorded.
#[derive(Default)]
struct Mini {
    tasks: TaskTable<(), Vec<u8>>,
    events: VecDeque<Event<Vec<u8>>>,
    wire: HashMap<u64, Vec<u8>>,
    /// Data-out that never arrives (a lost transfer): the transport fails these tasks.
    lost: Vec<u64>,
    responses: HashMap<u64, Response>,
    aborting: Vec<u64>,
    log: Log,
}

impl Carrier<Vec<u8>, Core<'_>> for Mini {
    type Task = ();

    fn tasks(&mut self) -> &mut TaskTable<(), Vec<u8>> {
        &mut self.tasks
    }

    fn event(&mut self, event: Event<Vec<u8>>) {
        self.events.push_back(event);
    }

    fn tracing(&self) -> bool {
        false
    }

    fn trace(&mut self, _: Stage, _: u64, _: u32) {}

    fn fetch_data_out(&mut self, tag: u64, len: u32, received: u32, _: &mut Core<'_>) {
        if self.lost.contains(&tag) {
            return;
        }
        let data = self.wire.remove(&tag).expect("the initiator's data");
        let mut b = self.tasks.take_buffer(tag).unwrap_or_default();
        b.resize(len as usize, 0);
        b[received as usize..].copy_from_slice(&data[received as usize..len as usize]);
        self.tasks.put_buffer(tag, b);
        self.tasks.data_received(tag, len - received);
    }

    fn respond(&mut self, c: Completion<(), Vec<u8>>, _: &mut Core<'_>) {
        self.log.borrow_mut().push(format!("respond {}", c.tag));
        let data = match (c.data_in, c.buffer) {
            (scsi_core::DataIn::Buffer { len }, Some(b)) => b[..len as usize].to_vec(),
            (scsi_core::DataIn::Parameter(v), _) => v,
            _ => Vec::new(),
        };
        let sense = c.sense.map(|s| s.as_slice().to_vec());
        self.responses.insert(c.tag, (c.status, data, sense));
    }

    fn forget(&mut self, tag: u64, _: &mut TaskEntry<(), Vec<u8>>) {
        self.log.borrow_mut().push(format!("forget {tag}"));
    }

    fn tmf_done(&mut self, reference: u64, response: TmfResponse, _: &mut Core<'_>) {
        self.log
            .borrow_mut()
            .push(format!("tmf {reference} {response:?}"));
    }

    fn aborting(&mut self, reference: u64) {
        self.aborting.push(reference);
    }
}

/// A device with delegation on, the transport, and a memory unit.
struct Rig {
    router: Router<()>,
    queue: Queue,
    nexus: NexusId,
    mini: Mini,
    store: MemoryBackend,
    /// Wanted buffers larger than this are refused for good.
    max_buffer: usize,
    completed: u32,
    now: Instant,
}

impl Rig {
    fn new() -> Rig {
        let mut device = Device::new("iqn.2026-11.io.example:t", ports());
        device.set_delegation(true);
        device.add_lu(0, unit(false, b"lu0")).unwrap();
        let nexus = device.open_nexus(TransportId::iscsi("iqn.x:a", [0x80, 0, 0, 0, 0, 1]), 1);
        let mut rig = Rig {
            router: Router::new(device),
            queue: Queue::default(),
            nexus,
            mini: Mini::default(),
            store: MemoryBackend::new(512, BLOCKS),
            max_buffer: usize::MAX,
            completed: 0,
            now: Instant::now(),
        };
        // The power-on unit attention.
        rig.submit(1, &[0; 6], Vec::new(), 0);
        rig.run();
        assert_eq!(rig.mini.responses[&1].0, Status::CheckCondition);
        rig
    }

    fn submit(&mut self, tag: u64, cdb: &[u8], data_out: Vec<u8>, data_in_len: u32) {
        let new = NewTask {
            lun: 0,
            data_out_len: data_out.len() as u32,
            data_in_len,
            buffer: None,
            received: 0,
            transport: (),
        };
        self.mini
            .tasks
            .insert(tag, new, self.now)
            .expect("a new tag");
        if !data_out.is_empty() {
            self.mini.wire.insert(tag, data_out.clone());
        }
        let cmd = Command {
            nexus: self.nexus,
            lun: 0,
            cdb,
            attribute: TaskAttribute::Simple,
            tag,
            data_in_len,
            data_out_len: data_out.len() as u32,
        };
        self.router
            .submit(cmd, &(), &mut self.queue)
            .expect("submitted");
    }

    /// Carries out everything until nothing moves: the core's events through the carrier,
    /// the carrier's events here (backend operations run at once on the memory unit).
    fn run(&mut self) {
        loop {
            let mut core = Core {
                router: &mut self.router,
                queue: &mut self.queue,
                nexus: self.nexus,
                log: self.mini.log.clone(),
            };
            if let Some(e) = core.queue.0.pop_front() {
                match e {
                    CoreEvent::Submitted { tag, task } => self.mini.tasks.submitted(tag, task),
                    CoreEvent::Action(a) => self.mini.action(a, self.now, &mut core),
                }
                continue;
            }
            let Some(e) = self.mini.events.pop_front() else {
                return;
            };
            match e {
                Event::Backend {
                    task,
                    op,
                    mut buffer,
                    ..
                } => {
                    let result = self.store.execute(&op, &mut buffer);
                    self.mini
                        .backend_done(task, buffer, result, self.now, &mut core);
                }
                Event::BufferWanted { tag, len } => {
                    let buffer = (len <= self.max_buffer).then(|| vec![0; len]);
                    self.mini.grant_buffer(tag, buffer, self.now, &mut core);
                }
                Event::Completed(_) => self.completed += 1,
            }
        }
    }

    fn fail(&mut self, tag: u64) {
        let mut core = Core {
            router: &mut self.router,
            queue: &mut self.queue,
            nexus: self.nexus,
            log: self.mini.log.clone(),
        };
        self.mini.fail(tag, Asc::DATA_PHASE_ERROR, &mut core);
    }
}

fn rw16(op: u8, lba: u64, blocks: u32) -> [u8; 16] {
    let mut c = [0u8; 16];
    c[0] = op;
    c[2..10].copy_from_slice(&lba.to_be_bytes());
    c[10..14].copy_from_slice(&blocks.to_be_bytes());
    c
}

#[test]
fn a_write_and_a_read_are_carried_out_answered_then_retired() {
    let mut rig = Rig::new();
    let data: Vec<u8> = (0..4096).map(|i| (i * 7) as u8).collect();
    rig.submit(2, &rw16(0x8a, 8, 8), data.clone(), 0);
    rig.run();
    rig.submit(3, &rw16(0x88, 8, 8), Vec::new(), 4096);
    rig.run();
    assert_eq!(rig.mini.responses[&2].0, Status::Good);
    let (status, read, _) = &rig.mini.responses[&3];
    assert_eq!(*status, Status::Good);
    assert_eq!(read, &data, "what was written reads back");
    assert_eq!(rig.completed, 3, "each accounted, the first too");
    // A delegated task is retired after its response is queued.
    let log = rig.mini.log.borrow().clone();
    assert_eq!(
        log,
        ["respond 1", "respond 2", "retire", "respond 3", "retire"]
    );
    assert!(rig.mini.tasks.is_empty());
}

#[test]
fn a_transfer_the_transport_fails_is_aborted_through_the_core_and_answered() {
    let mut rig = Rig::new();
    rig.mini.lost.push(2);
    rig.submit(2, &rw16(0x8a, 0, 8), vec![1; 4096], 0);
    rig.run();
    assert!(!rig.mini.responses.contains_key(&2), "waits for its data");
    rig.fail(2);
    rig.run();
    assert_eq!(
        rig.mini.aborting.len(),
        1,
        "an ABORT TASK of the transport's own"
    );
    let (status, _, sense) = &rig.mini.responses[&2];
    assert_eq!(*status, Status::CheckCondition);
    let sense = sense.as_ref().expect("sense");
    assert_eq!(
        (sense[2] & 0xf, sense[12], sense[13]),
        (0x0b, 0x4b, 0x00),
        "ABORTED COMMAND, DATA PHASE ERROR"
    );
    let reference = rig.mini.aborting[0];
    let log = rig.mini.log.borrow().clone();
    assert!(
        log.contains(&format!("tmf {reference} Complete")),
        "its answer reached the transport: {log:?}"
    );
    assert!(rig.mini.tasks.is_empty());
}

#[test]
fn a_buffer_that_can_never_be_had_fails_the_operation_as_the_backend_would() {
    let mut rig = Rig::new();
    rig.max_buffer = 2048;
    rig.submit(2, &rw16(0x88, 0, 8), Vec::new(), 4096);
    rig.run();
    let (status, _, _) = &rig.mini.responses[&2];
    assert_eq!(*status, Status::CheckCondition);
    assert!(rig.mini.tasks.is_empty());
    // A read that fits goes on.
    rig.submit(3, &rw16(0x88, 0, 4), Vec::new(), 2048);
    rig.run();
    assert_eq!(rig.mini.responses[&3].0, Status::Good);
}
