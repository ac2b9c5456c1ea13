//! scsi-core's device server driven over a file backend on each engine, the way a transport
//! drives it: data-out lands in an arena buffer, the backend runs on that buffer, data-in is
//! read from it. Several commands are in flight at once.

use std::collections::HashMap;

mod common;

use backend::{
    AnyBackend, Arena, ArenaConfig, Buffer, Engine, EngineChoice, EngineConfig, FileConfig,
    FileHandle,
};
use scsi_core::{
    Action, Backend, Command, DataIn, Device, Geometry, Identity, Limits, LogicalUnit, Status,
    TargetPort, TaskAttribute, TaskId, TransportId,
};

struct Driver {
    device: Device,
    nexus: scsi_core::NexusId,
    engine: Engine,
    arena: Arena,
    lu: AnyBackend,
    buffers: HashMap<usize, Buffer>,
    outgoing: HashMap<usize, Vec<u8>>,
    tasks: HashMap<u64, TaskId>,
    in_backend: HashMap<u64, TaskId>,
    done: HashMap<u64, (Status, Vec<u8>)>,
}

impl Driver {
    fn new(choice: EngineChoice, path: &std::path::Path) -> Driver {
        let engine = Engine::new(EngineConfig {
            engine: choice,
            ..EngineConfig::default()
        })
        .unwrap();
        let arena = Arena::new(ArenaConfig {
            slot_size: 64 << 10,
            slots: 32,
            huge_pages: false,
        })
        .unwrap();
        engine.register_arena(&arena).unwrap();
        let file = FileHandle::open(&FileConfig::new(path, Some(64 << 20))).unwrap();
        let blocks = file.blocks();
        let lu = AnyBackend::File(engine.open(file));
        let port = TargetPort::iscsi("iqn.2026-11.io.example:t", 1);
        let mut device = Device::new("iqn.2026-11.io.example:t", vec![port]);
        device
            .add_lu(
                0,
                LogicalUnit {
                    identity: Identity::new("STGT", "file", "0001", b"f"),
                    geometry: Geometry {
                        block_size: 512,
                        blocks,
                        thin: true,
                        write_cache: true,
                        read_only: false,
                    },
                    limits: Limits::default(),
                },
            )
            .unwrap();
        let nexus = device.open_nexus(TransportId::iscsi("iqn.x:i", [0x80, 0, 0, 0, 0, 1]), 1);
        let mut d = Driver {
            device,
            nexus,
            engine,
            arena,
            lu,
            buffers: HashMap::new(),
            outgoing: HashMap::new(),
            tasks: HashMap::new(),
            in_backend: HashMap::new(),
            done: HashMap::new(),
        };
        // The power-on unit attention.
        d.submit(0, &[0; 6], 0, Vec::new());
        d.finish();
        d.done.clear();
        d.tasks.clear();
        d
    }

    fn submit(&mut self, tag: u64, cdb: &[u8], data_in_len: u32, data_out: Vec<u8>) {
        let task = self
            .device
            .submit(Command {
                nexus: self.nexus,
                lun: 0,
                cdb,
                attribute: TaskAttribute::Simple,
                tag,
                data_in_len,
                data_out_len: data_out.len() as u32,
            })
            .unwrap();
        self.outgoing.insert(task.index(), data_out);
        self.tasks.insert(tag, task);
    }

    /// Runs actions and backend completions until every submitted command has completed.
    fn finish(&mut self) {
        loop {
            while let Some(action) = self.device.poll() {
                match action {
                    Action::DataOut { task, len, .. } => {
                        let mut buf = self.arena.try_alloc(len as usize).unwrap().unwrap();
                        let data = self.outgoing.remove(&task.index()).unwrap_or_default();
                        buf[..data.len()].copy_from_slice(&data);
                        self.device.data_out(task, &buf).unwrap();
                        self.buffers.insert(task.index(), buf);
                    }
                    Action::Backend { task, op, .. } => {
                        let need = op.buffer_len(512) as usize;
                        let buf = match self.buffers.remove(&task.index()) {
                            Some(b) if b.len() >= need => b,
                            _ => self.arena.try_alloc(need).unwrap().unwrap(),
                        };
                        self.in_backend.insert(task.index() as u64, task);
                        self.lu.submit(task.index() as u64, op, buf);
                    }
                    Action::Complete {
                        task,
                        tag,
                        status,
                        data_in,
                        ..
                    } => {
                        let data = match data_in {
                            DataIn::None => Vec::new(),
                            DataIn::Parameter(p) => p,
                            DataIn::Buffer { len } => {
                                self.buffers[&task.index()][..len as usize].to_vec()
                            }
                        };
                        self.buffers.remove(&task.index());
                        self.done.insert(tag, (status, data));
                    }
                    other => panic!("unexpected {other:?}"),
                }
            }
            if self.done.len() == self.tasks.len() {
                return;
            }
            let mut progressed = false;
            while let Some((token, result, buf)) = self.lu.poll_completion() {
                progressed = true;
                let task = self.in_backend.remove(&token).unwrap();
                self.buffers.insert(task.index(), buf);
                self.device.backend_done(task, result).unwrap();
            }
            if !progressed {
                assert!(self.engine.wait().unwrap(), "commands stuck");
            }
        }
    }

    fn outcome(&self, tag: u64) -> &(Status, Vec<u8>) {
        &self.done[&tag]
    }
}

fn write10(lba: u32, blocks: u16) -> [u8; 10] {
    let mut c = [0u8; 10];
    c[0] = 0x2a;
    c[2..6].copy_from_slice(&lba.to_be_bytes());
    c[7..9].copy_from_slice(&blocks.to_be_bytes());
    c
}

fn read10(lba: u32, blocks: u16) -> [u8; 10] {
    let mut c = write10(lba, blocks);
    c[0] = 0x28;
    c
}

#[test]
fn the_core_reads_and_writes_through_both_engines() {
    for choice in common::engines() {
        let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
        let mut d = Driver::new(choice, &dir.path().join("lu.img"));
        // Eight 32 KiB writes in flight together, then read all back in one command.
        for i in 0..8u32 {
            let data: Vec<u8> = (0..32768u32).map(|b| (b as u8) ^ (i as u8 * 31)).collect();
            d.submit(u64::from(i) + 1, &write10(i * 64, 64), 0, data);
        }
        d.finish();
        for i in 1..=8 {
            assert_eq!(d.outcome(i).0, Status::Good, "{choice:?} write {i}");
        }
        d.submit(100, &read10(0, 512), 262144, Vec::new());
        // COMPARE AND WRITE on block 0 with the right old data.
        let mut caw = [0u8; 16];
        caw[0] = 0x89;
        caw[13] = 1;
        let mut both: Vec<u8> = (0..512u32).map(|b| b as u8).collect();
        both.extend([0xabu8; 512]);
        d.finish();
        let (status, data) = d.outcome(100).clone();
        assert_eq!(status, Status::Good);
        for (i, chunk) in data.chunks(32768).enumerate() {
            let want: Vec<u8> = (0..32768u32).map(|b| (b as u8) ^ (i as u8 * 31)).collect();
            assert_eq!(chunk, &want[..], "{choice:?} chunk {i}");
        }
        d.submit(101, &caw, 0, both.clone());
        d.finish();
        assert_eq!(d.outcome(101).0, Status::Good, "{choice:?}");
        d.submit(102, &caw, 0, both);
        d.submit(103, &read10(0, 1), 512, Vec::new());
        d.finish();
        assert_eq!(d.outcome(102).0, Status::CheckCondition, "miscompare");
        assert_eq!(d.outcome(103).1, vec![0xab; 512]);
    }
}
