//! Every operation on real files, on both engines; creation rules; queue depth; a full device;
//! the eventfd under tokio; and a property test that both engines leave identical contents.

use std::os::unix::fs::MetadataExt;

use backend::{
    AnyBackend, Arena, ArenaConfig, Buffer, BufferedWrites, Engine, EngineChoice, EngineConfig,
    EngineKind, FileBackend, FileConfig, FileHandle, MemoryBackend, NullBackend, OpenError,
    NOWAIT_PROBES,
};
use proptest::prelude::*;

mod common;
use scsi_core::{Backend, BackendError, Op, Output, Sense, SenseKey};

const BS: u32 = 512;

fn engine(choice: EngineChoice) -> Engine {
    let engine = Engine::new(EngineConfig {
        engine: choice,
        ..EngineConfig::default()
    })
    .expect("engine");
    let want = match choice {
        EngineChoice::Threads => EngineKind::Threads,
        _ => EngineKind::Uring,
    };
    assert_eq!(engine.kind(), want);
    engine
}

fn arena() -> Arena {
    Arena::new(ArenaConfig {
        slot_size: 64 << 10,
        slots: 64,
        huge_pages: false,
    })
    .unwrap()
}

struct Rig {
    _dir: tempfile::TempDir,
    path: std::path::PathBuf,
    arena: Arena,
    engine: Engine,
    lu: FileBackend,
}

fn rig(choice: EngineChoice, blocks: u64, direct: bool) -> Rig {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let path = dir.path().join("disk.img");
    let engine = engine(choice);
    let arena = arena();
    engine.register_arena(&arena).unwrap();
    let file = FileHandle::open(&FileConfig {
        direct,
        ..FileConfig::new(&path, Some(blocks * u64::from(BS)))
    })
    .unwrap();
    let lu = engine.open(file);
    Rig {
        _dir: dir,
        path,
        arena,
        engine,
        lu,
    }
}

/// Submits one op and waits for it.
fn run<B: Backend<Buffer = Buffer>>(
    engine: &Engine,
    lu: &mut B,
    op: Op,
    buf: Buffer,
) -> (Result<Output, BackendError>, Buffer) {
    lu.submit(7, op, buf);
    loop {
        if let Some((token, result, buf)) = lu.poll_completion() {
            assert_eq!(token, 7);
            return (result, buf);
        }
        assert!(engine.wait().unwrap(), "an operation went missing");
    }
}

impl Rig {
    fn buf(&self, bytes: &[u8]) -> Buffer {
        let mut b = self.arena.try_alloc(bytes.len()).unwrap().unwrap();
        b.copy_from_slice(bytes);
        b
    }

    fn op(&mut self, op: Op, data: &[u8]) -> Result<Output, BackendError> {
        let buf = self.buf(data);
        run(&self.engine, &mut self.lu, op, buf).0
    }

    /// A write, with FUA at even LBAs.
    fn write(&mut self, lba: u64, data: &[u8]) {
        self.write_fua(lba, data, lba % 2 == 0);
    }

    /// A write without FUA.
    fn write_plain(&mut self, lba: u64, data: &[u8]) {
        self.write_fua(lba, data, false);
    }

    fn write_fua(&mut self, lba: u64, data: &[u8], fua: bool) {
        let blocks = (data.len() / BS as usize) as u32;
        let op = Op::Write {
            lba,
            blocks,
            offset: 0,
            fua,
        };
        assert_eq!(self.op(op, data), Ok(Output::Done));
    }

    fn read(&mut self, lba: u64, blocks: u32) -> Vec<u8> {
        let buf = self.buf(&vec![0xee; (blocks * BS) as usize]);
        let op = Op::Read {
            lba,
            blocks,
            offset: 0,
            fua: false,
        };
        let (r, buf) = run(&self.engine, &mut self.lu, op, buf);
        assert_eq!(r, Ok(Output::Done));
        buf.to_vec()
    }

    fn status(&mut self, lba: u64) -> Output {
        self.op(Op::LbaStatus { lba }, &[]).unwrap()
    }
}

fn pattern(seed: u8, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| seed.wrapping_add((i * 7 + i / 512) as u8))
        .collect()
}

fn both(f: impl Fn(EngineChoice)) {
    for choice in common::engines() {
        f(choice);
    }
}

/// The io_uring engine, or None (after printing why) where it cannot run.
fn uring() -> Option<EngineChoice> {
    common::engines()
        .into_iter()
        .find(|&c| c == EngineChoice::Uring)
}

#[test]
fn probe_reports_the_kernels_opcodes() {
    let Some(choice) = uring() else { return };
    let e = engine(choice);
    let s = e.uring_support().unwrap();
    println!("io_uring support on this kernel: {s:?}");
    assert!(s.read_write || s.fixed);
    let a = arena();
    e.register_arena(&a).unwrap();
    println!("fixed buffers registered: {}", e.fixed_buffers());
    assert!(engine(EngineChoice::Threads).uring_support().is_none());
}

#[test]
fn reads_what_was_written_with_and_without_fua() {
    both(|c| {
        let mut r = rig(c, 4096, false);
        let data = pattern(1, 64 * 1024);
        r.write(10, &data);
        r.write(200, &data[..512]);
        assert_eq!(r.read(10, 128), data, "{c:?}");
        assert_eq!(r.read(200, 1), data[..512], "{c:?}");
        assert!(
            r.read(1000, 4).iter().all(|&b| b == 0),
            "{c:?}: a hole reads zeros"
        );
        assert_eq!(r.op(Op::Flush { lba: 0, blocks: 0 }, &[]), Ok(Output::Done));
        // Another descriptor sees the data: it reached the file.
        let on_disk = std::fs::read(&r.path).unwrap();
        assert_eq!(&on_disk[10 * 512..10 * 512 + data.len()], &data[..]);
    });
}

/// Writes through the page cache are tried on the ring without blocking; where the file system
/// refuses (ext4 has no non-blocking buffered writes) they go to the engine's writer thread,
/// and after NOWAIT_PROBES refusals counted (after a write completed on the writer) straight
/// there. Whichever way, every byte lands; FUA
/// writes and O_DIRECT writes never probe.
#[test]
fn buffered_writes_find_their_way_and_land() {
    let Some(c) = uring() else { return };
    let mut r = rig(c, 8192, false);
    assert_eq!(r.lu.buffered_writes(), UNTRIED);
    // FUA (even LBAs in Rig::write) is synchronous: never tried without blocking.
    r.write(4000, &pattern(9, 4096));
    assert_eq!(r.lu.buffered_writes(), UNTRIED);
    let n = u64::from(NOWAIT_PROBES) + 8;
    for i in 0..n {
        r.write(8 * i + 1, &pattern(i as u8, 4096));
    }
    let route = r.lu.buffered_writes();
    println!("buffered writes on this file system: {route:?}");
    assert!(!matches!(route, BufferedWrites::Probe { refused: 0, .. }));
    if fs_type(&r.path) == Some(EXT4_SUPER_MAGIC) {
        assert_eq!(
            route,
            BufferedWrites::Threads,
            "ext4 refuses RWF_NOWAIT buffered writes"
        );
    }
    // Composite operations (the helper threads) and writes (the writer) alternating, each
    // waited for as a reactor does, by the eventfd: its completion is there after the signal
    // that announced it, whichever thread finished it.
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let completions = r.engine.completions().unwrap();
        for i in 0..4u64 {
            let cmp = Op::Compare {
                lba: 8 * i + 1,
                blocks: 8,
                offset: 0,
                same: false,
            };
            let write = Op::Write {
                lba: 8 * i + 1,
                blocks: 8,
                offset: 0,
                fua: false,
            };
            for op in [cmp, write] {
                r.lu.submit(i, op, r.buf(&pattern(i as u8, 4096)));
                r.engine.submit_pending().unwrap();
                let done = loop {
                    let signal = tokio::time::timeout(
                        std::time::Duration::from_secs(5),
                        completions.ready(),
                    );
                    signal.await.expect("no completion signalled").unwrap();
                    if let Some(done) = r.lu.poll_completion() {
                        break done;
                    }
                };
                assert_eq!((done.0, done.1), (i, Ok(Output::Done)), "{op:?}");
            }
        }
    });
    for i in 0..n {
        assert!(r.read(8 * i + 1, 8) == pattern(i as u8, 4096), "write {i}");
    }
    let on_disk = std::fs::read(&r.path).unwrap();
    for i in 0..n {
        let at = (8 * i + 1) as usize * 512;
        assert!(
            on_disk[at..at + 4096] == pattern(i as u8, 4096),
            "write {i} on disk"
        );
    }
    assert!(on_disk[4000 * 512..4000 * 512 + 4096] == pattern(9, 4096));

    // O_DIRECT: aligned writes go to the device as before; misaligned ones (the buffered
    // descriptor) are tried without blocking, the first refusal not counted (no write of the
    // unit has completed on the writer yet: the file's timestamps may be stale, which is
    // why XFS refuses), the second counted or taken.
    let mut d = rig(c, 8192, true);
    for i in 0..4 {
        d.write_plain(8 * i + 8, &pattern(i as u8, 4096));
    }
    let aligned = d.lu.buffered_writes();
    d.write(3, &pattern(3, 512));
    d.write(5, &pattern(5, 512));
    println!(
        "O_DIRECT unit after aligned writes: {aligned:?}, after two misaligned ones: {:?}",
        d.lu.buffered_writes()
    );
    assert_eq!(aligned, UNTRIED);
    assert!(!matches!(
        d.lu.buffered_writes(),
        BufferedWrites::Probe { refused: 0, .. }
    ));
    assert_eq!(d.read(3, 1), pattern(3, 512));
    assert_eq!(d.read(5, 1), pattern(5, 512));
}

const EXT4_SUPER_MAGIC: i64 = 0xEF53;

/// A unit none of whose writes went through the page cache yet.
const UNTRIED: BufferedWrites = BufferedWrites::Probe {
    refused: 0,
    counting: false,
};

/// The file system type of `path` (statfs' f_type, from coreutils' stat), if it can be read.
fn fs_type(path: &std::path::Path) -> Option<i64> {
    let out = std::process::Command::new("stat")
        .args(["-f", "-c", "%t"])
        .arg(path)
        .output()
        .ok()?;
    i64::from_str_radix(String::from_utf8_lossy(&out.stdout).trim(), 16).ok()
}

#[test]
fn reads_and_writes_at_buffer_offsets() {
    both(|c| {
        let mut r = rig(c, 1024, false);
        let data = pattern(3, 4096);
        let op = Op::Write {
            lba: 5,
            blocks: 4,
            offset: 2048,
            fua: false,
        };
        assert_eq!(r.op(op, &data), Ok(Output::Done));
        let buf = r.buf(&[0xaa; 4096]);
        let op = Op::Read {
            lba: 5,
            blocks: 2,
            offset: 1024,
            fua: false,
        };
        let (res, buf) = run(&r.engine, &mut r.lu, op, buf);
        assert_eq!(res, Ok(Output::Done));
        assert!(buf[..1024].iter().all(|&b| b == 0xaa));
        assert_eq!(&buf[1024..2048], &data[2048..3072]);
        assert!(buf[2048..].iter().all(|&b| b == 0xaa), "{c:?}");
    });
}

#[test]
fn unmap_and_write_same_unmap_punch_holes() {
    both(|c| {
        let mut r = rig(c, 8192, false);
        r.write(0, &pattern(9, 1 << 20));
        let allocated = std::fs::metadata(&r.path).unwrap().blocks();
        assert!(
            allocated >= 2048,
            "{c:?}: 1 MiB written, {allocated} sectors"
        );
        assert_eq!(
            r.status(0),
            Output::LbaStatus {
                mapped: true,
                blocks: 2048
            }
        );
        assert_eq!(
            r.op(
                Op::Unmap {
                    lba: 0,
                    blocks: 1024
                },
                &[]
            ),
            Ok(Output::Done)
        );
        let ws = Op::WriteSame {
            lba: 1024,
            blocks: 1024,
            zeros: true,
            unmap: true,
            fua: false,
        };
        assert_eq!(r.op(ws, &[]), Ok(Output::Done));
        assert_eq!(std::fs::metadata(&r.path).unwrap().blocks(), 0, "{c:?}");
        assert!(r.read(0, 128).iter().all(|&b| b == 0));
        assert_eq!(
            r.status(0),
            Output::LbaStatus {
                mapped: false,
                blocks: 8192
            },
            "{c:?}"
        );
        // A zero block with UNMAP allowed also deallocates.
        r.write(16, &pattern(1, 4096));
        let ws = Op::WriteSame {
            lba: 0,
            blocks: 64,
            zeros: false,
            unmap: true,
            fua: false,
        };
        assert_eq!(r.op(ws, &[0; 512]), Ok(Output::Done));
        assert_eq!(
            r.status(0),
            Output::LbaStatus {
                mapped: false,
                blocks: 8192
            },
            "{c:?}"
        );
    });
}

#[test]
fn write_same_fills_the_range_and_stays_mapped() {
    both(|c| {
        let mut r = rig(c, 65536, false);
        let block = pattern(5, 512);
        let ws = Op::WriteSame {
            lba: 100,
            blocks: 5000,
            zeros: false,
            unmap: false,
            fua: false,
        };
        assert_eq!(r.op(ws, &block), Ok(Output::Done));
        let got = r.read(100, 128);
        assert!(got.chunks(512).all(|b| b == &block[..]), "{c:?}");
        assert_eq!(r.read(5099, 1), block);
        assert!(r.read(5100, 1).iter().all(|&b| b == 0));
        // Zeros without UNMAP: allocated, reads zero, reported mapped.
        let ws = Op::WriteSame {
            lba: 20000,
            blocks: 256,
            zeros: true,
            unmap: false,
            fua: false,
        };
        assert_eq!(r.op(ws, &[]), Ok(Output::Done));
        assert!(r.read(20000, 256).iter().all(|&b| b == 0));
        assert!(
            matches!(r.status(20000), Output::LbaStatus { mapped: true, blocks } if blocks >= 256),
            "{c:?}: {:?}",
            r.status(20000)
        );
    });
}

#[test]
fn compare_verify_and_compare_and_write() {
    both(|c| {
        let mut r = rig(c, 1024, false);
        let data = pattern(2, 2048);
        r.write(8, &data);
        let cmp = Op::Compare {
            lba: 8,
            blocks: 4,
            offset: 0,
            same: false,
        };
        assert_eq!(r.op(cmp, &data), Ok(Output::Done));
        let mut bad = data.clone();
        bad[1500] ^= 1;
        assert_eq!(
            r.op(cmp, &bad),
            Err(BackendError::Miscompare { offset: 1500 }),
            "{c:?}"
        );
        // BYTCHK 11b: one block against each.
        r.write(100, &[9; 2048]);
        let same = Op::Compare {
            lba: 100,
            blocks: 4,
            offset: 0,
            same: true,
        };
        assert_eq!(r.op(same, &[9; 512]), Ok(Output::Done));
        r.write(102, &[8; 512]);
        assert_eq!(
            r.op(same, &[9; 512]),
            Err(BackendError::Miscompare { offset: 1024 })
        );
        // COMPARE AND WRITE: verify half, write half; a miscompare writes nothing.
        let new = pattern(77, 1024);
        let caw = Op::CompareAndWrite {
            lba: 8,
            blocks: 2,
            fua: true,
        };
        let mut both_halves = data[..1024].to_vec();
        both_halves.extend_from_slice(&new);
        assert_eq!(r.op(caw, &both_halves), Ok(Output::Done));
        assert_eq!(r.read(8, 2), new);
        assert_eq!(
            r.op(caw, &both_halves),
            Err(BackendError::Miscompare { offset: 0 })
        );
        assert_eq!(r.read(8, 2), new, "{c:?}: a miscompare must not write");
    });
}

#[test]
fn or_write_prefetch_and_short_buffers() {
    both(|c| {
        let mut r = rig(c, 1024, false);
        r.write(0, &[0x0f; 1024]);
        let or = Op::OrWrite {
            lba: 0,
            blocks: 2,
            fua: false,
        };
        assert_eq!(r.op(or, &[0xf0; 1024]), Ok(Output::Done));
        assert!(r.read(0, 2).iter().all(|&b| b == 0xff));
        let pf = Op::Prefetch { lba: 0, blocks: 8 };
        assert_eq!(r.op(pf, &[]), Ok(Output::Done));
        let short = Op::Read {
            lba: 0,
            blocks: 4,
            offset: 0,
            fua: false,
        };
        assert_eq!(r.op(short, &[0; 512]), Err(BackendError::Internal), "{c:?}");
    });
}

#[test]
fn o_direct_handles_aligned_and_misaligned_requests() {
    both(|c| {
        let mut r = rig(c, 2048, true);
        let data = pattern(4, 16384);
        r.write(8, &data); // 4 KiB aligned: O_DIRECT descriptor
        r.write(3, &data[..1024]); // 512-aligned only: the buffered one
        assert_eq!(r.read(3, 2), data[..1024]);
        assert_eq!(r.read(8, 32), data);
        let op = Op::Read {
            lba: 8,
            blocks: 8,
            offset: 512,
            fua: false,
        };
        let buf = r.buf(&[0; 8192]);
        let (res, buf) = run(&r.engine, &mut r.lu, op, buf);
        assert_eq!(res, Ok(Output::Done), "{c:?}");
        assert_eq!(&buf[512..4608], &data[..4096]);
    });
}

#[test]
fn queue_depth_limits_what_is_in_flight() {
    both(|c| {
        let mut r = rig(c, 4096, false);
        r.lu.set_queue_depth(2);
        for i in 0..16u64 {
            let buf = r.buf(&pattern(i as u8, 4096));
            r.lu.submit(
                i,
                Op::Write {
                    lba: i * 8,
                    blocks: 8,
                    offset: 0,
                    fua: false,
                },
                buf,
            );
            assert!(r.engine.in_flight() <= 2, "{c:?}");
        }
        let mut done = Vec::new();
        while done.len() < 16 {
            while let Some((t, res, _)) = r.lu.poll_completion() {
                assert_eq!(res, Ok(Output::Done));
                done.push(t);
            }
            assert!(r.engine.in_flight() <= 2);
            if done.len() < 16 {
                assert!(r.engine.wait().unwrap());
            }
        }
        for i in 0..16u64 {
            assert_eq!(r.read(i * 8, 8), pattern(i as u8, 4096), "{c:?}");
        }
    });
}

#[test]
fn a_full_device_reports_space_allocation_failed() {
    both(|c| {
        let e = engine(c);
        let a = arena();
        e.register_arena(&a).unwrap();
        let full = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open("/dev/full")
            .unwrap();
        let mut lu = e.open(FileHandle::from_file(full, BS, 1024));
        let buf = a.try_alloc(4096).unwrap().unwrap();
        let op = Op::Write {
            lba: 0,
            blocks: 8,
            offset: 0,
            fua: false,
        };
        let (res, _) = run(&e, &mut lu, op, buf);
        assert_eq!(res, Err(BackendError::NoSpace), "{c:?}");
        let sense = Sense::from(res.unwrap_err());
        assert_eq!(sense.key, SenseKey::DataProtect);
        assert_eq!((sense.asc.0, sense.asc.1), (0x27, 0x07));
    });
}

#[test]
fn errnos_map_to_the_sense_a_disk_gives() {
    use backend::file::errno_to_error as map;
    assert_eq!(map(libc::EIO, false, 9), BackendError::Read { lba: 9 });
    assert_eq!(map(libc::EIO, true, 9), BackendError::Write { lba: 9 });
    assert_eq!(map(libc::ENOSPC, true, 0), BackendError::NoSpace);
    assert_eq!(map(libc::EDQUOT, true, 0), BackendError::NoSpace);
    assert_eq!(map(libc::EOPNOTSUPP, true, 0), BackendError::Unsupported);
    assert_eq!(map(libc::EBADF, true, 0), BackendError::Internal);
    let s = Sense::from(map(libc::EIO, false, 9));
    assert_eq!(
        (s.key, s.asc.0, s.asc.1),
        (SenseKey::MediumError, 0x11, 0x00)
    );
    let s = Sense::from(map(libc::EIO, true, 9));
    assert_eq!(
        (s.key, s.asc.0, s.asc.1),
        (SenseKey::MediumError, 0x0c, 0x00)
    );
}

#[test]
fn open_creates_grows_and_refuses() {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let p = dir.path().join("a/b/thin.img");
    std::fs::create_dir_all(dir.path().join("a/b")).unwrap();
    let f = FileHandle::open(&FileConfig::new(&p, Some(1 << 30))).unwrap();
    assert_eq!(f.blocks(), (1 << 30) / 512);
    let meta = std::fs::metadata(&p).unwrap();
    assert_eq!((meta.len(), meta.blocks()), (1 << 30, 0), "created sparse");
    drop(f);
    // Size from the file; a larger config grows it; a smaller one is refused.
    assert_eq!(
        FileHandle::open(&FileConfig::new(&p, None))
            .unwrap()
            .blocks(),
        (1 << 30) / 512
    );
    let g = FileHandle::open(&FileConfig::new(&p, Some(2 << 30))).unwrap();
    assert_eq!(g.blocks(), (2 << 30) / 512);
    let e = FileHandle::open(&FileConfig::new(&p, Some(1 << 20))).unwrap_err();
    assert!(matches!(e, OpenError::SizeMismatch { .. }), "{e}");
    let e = FileHandle::open(&FileConfig::new(dir.path().join("none"), None)).unwrap_err();
    assert!(matches!(e, OpenError::NoSize(_)), "{e}");
    let e = FileHandle::open(&FileConfig::new(dir.path().join("odd"), Some(1000))).unwrap_err();
    assert!(e.to_string().contains("multiple of the block size"), "{e}");
    let e = FileHandle::open(&FileConfig {
        block_size: 1024,
        ..FileConfig::new(&p, None)
    })
    .unwrap_err();
    assert!(e.to_string().contains("512 or 4096"), "{e}");
    let e = FileHandle::open(&FileConfig::new("/dev/null", Some(4096))).unwrap_err();
    assert!(matches!(e, OpenError::Kind(_)), "{e}");
    let e = FileHandle::open(&FileConfig::new("/proc/nope/x", Some(4096))).unwrap_err();
    assert!(e.to_string().starts_with("/proc/nope"), "{e}");
    // No directory is made: a missing one is an error naming it, and nothing is created.
    let typo = dir.path().join("no-such-dir").join("disk.img");
    let e = FileHandle::open(&FileConfig::new(&typo, Some(1 << 20))).unwrap_err();
    assert!(matches!(e, OpenError::NoDirectory(_)), "{e}");
    assert_eq!(e.key(), "path");
    assert!(!dir.path().join("no-such-dir").exists());
}

#[test]
fn memory_and_null_backends() {
    let e = engine(EngineChoice::Threads);
    let a = arena();
    let mut mem = AnyBackend::Memory(MemoryBackend::memory(BS, 1 << 20));
    let mut null = AnyBackend::Null(NullBackend::null(BS, 1 << 20));
    assert_eq!((mem.block_size(), null.blocks()), (BS, 1 << 20));
    let mut w = a.try_alloc(4096).unwrap().unwrap();
    w.fill(3);
    let write = Op::Write {
        lba: 1,
        blocks: 8,
        offset: 0,
        fua: false,
    };
    let read = Op::Read {
        lba: 1,
        blocks: 8,
        offset: 0,
        fua: false,
    };
    let (res, w) = run(&e, &mut mem, write, w);
    assert_eq!(res, Ok(Output::Done));
    let (_, r) = run(&e, &mut mem, read, a.try_alloc(4096).unwrap().unwrap());
    assert!(r.iter().all(|&b| b == 3));
    let (res, _) = run(&e, &mut null, write, w);
    assert_eq!(res, Ok(Output::Done));
    // The slot still holds 3s from the memory read: null must zero it.
    let (_, r) = run(&e, &mut null, read, r);
    assert!(r.iter().all(|&b| b == 0));
}

#[test]
fn dropping_with_operations_in_flight_is_safe() {
    both(|c| {
        let r = rig(c, 65536, false);
        let Rig {
            arena,
            engine,
            mut lu,
            _dir,
            ..
        } = r;
        for i in 0..32u64 {
            let buf = arena.try_alloc(64 << 10).unwrap().unwrap();
            let op = Op::Write {
                lba: i * 128,
                blocks: 128,
                offset: 0,
                fua: false,
            };
            lu.submit(i, op, buf);
        }
        engine.submit_pending().unwrap();
        drop(lu);
        drop(engine);
        assert_eq!(arena.free_slots(), 64, "{c:?}: every slot came back");
    });
}

#[test]
fn completions_wake_tokio_through_the_eventfd() {
    both(|c| {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async {
            let mut r = rig(c, 1024, false);
            r.write(0, &pattern(6, 4096));
            let completions = r.engine.completions().unwrap();
            let buf = r.arena.alloc(4096).await.unwrap();
            let op = Op::Read {
                lba: 0,
                blocks: 8,
                offset: 0,
                fua: false,
            };
            r.lu.submit(1, op, buf);
            r.engine.submit_pending().unwrap();
            let got = loop {
                completions.ready().await.unwrap();
                if let Some(done) = r.lu.poll_completion() {
                    break done;
                }
            };
            assert_eq!(got.1, Ok(Output::Done));
            assert_eq!(&got.2[..], &pattern(6, 4096)[..], "{c:?}");
        });
    });
}

#[test]
fn waiting_allocations_proceed_as_buffers_return() {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let local = tokio::task::LocalSet::new();
    local.block_on(&rt, async {
        let mut r = rig(*common::engines().first().unwrap(), 4096, false);
        let arena = r.arena.clone();
        // 64 slots, 48 requests of 4 slots each: most must wait for earlier ones to finish.
        let mut handles = Vec::new();
        for i in 0..48u64 {
            let arena = arena.clone();
            handles.push(tokio::task::spawn_local(async move {
                let b = arena.alloc(256 << 10).await.unwrap();
                (i, b)
            }));
        }
        let mut finished = 0;
        for h in handles {
            let (i, mut b) = h.await.unwrap();
            b.fill(i as u8);
            let op = Op::Write {
                lba: (i % 8) * 512,
                blocks: 512,
                offset: 0,
                fua: false,
            };
            let (res, b) = run(&r.engine, &mut r.lu, op, b);
            assert_eq!(res, Ok(Output::Done));
            drop(b);
            finished += 1;
        }
        assert_eq!(finished, 48);
        assert_eq!(arena.free_slots(), 64);
        assert_eq!(arena.waiting(), 0);
    });
}

#[derive(Debug, Clone)]
enum Step {
    Write {
        lba: u64,
        blocks: u32,
        seed: u8,
    },
    Unmap {
        lba: u64,
        blocks: u64,
    },
    Same {
        lba: u64,
        blocks: u64,
        seed: u8,
        unmap: bool,
    },
    Or {
        lba: u64,
        blocks: u32,
        seed: u8,
    },
    Flush,
}

const PROP_BLOCKS: u64 = 512;

fn step() -> impl Strategy<Value = Step> {
    let lba = 0..PROP_BLOCKS - 64;
    prop_oneof![
        4 => (lba.clone(), 1u32..64, any::<u8>()).prop_map(|(lba, blocks, seed)| Step::Write { lba, blocks, seed }),
        1 => (lba.clone(), 1u64..64).prop_map(|(lba, blocks)| Step::Unmap { lba, blocks }),
        1 => (lba.clone(), 1u64..64, any::<u8>(), any::<bool>())
            .prop_map(|(lba, blocks, seed, unmap)| Step::Same { lba, blocks, seed: seed % 3, unmap }),
        1 => (lba, 1u32..16, any::<u8>()).prop_map(|(lba, blocks, seed)| Step::Or { lba, blocks, seed }),
        1 => Just(Step::Flush),
    ]
}

fn apply(r: &mut Rig, s: &Step) {
    let res = match *s {
        Step::Write { lba, blocks, seed } => {
            let op = Op::Write {
                lba,
                blocks,
                offset: 0,
                fua: seed % 4 == 0,
            };
            r.op(op, &pattern(seed, (blocks * BS) as usize))
        }
        Step::Unmap { lba, blocks } => r.op(Op::Unmap { lba, blocks }, &[]),
        Step::Same {
            lba,
            blocks,
            seed,
            unmap,
        } => {
            let op = Op::WriteSame {
                lba,
                blocks,
                zeros: false,
                unmap,
                fua: false,
            };
            r.op(op, &[seed; 512])
        }
        Step::Or { lba, blocks, seed } => {
            let op = Op::OrWrite {
                lba,
                blocks,
                fua: false,
            };
            r.op(op, &pattern(seed, (blocks * BS) as usize))
        }
        Step::Flush => r.op(Op::Flush { lba: 0, blocks: 0 }, &[]),
    };
    assert_eq!(res, Ok(Output::Done), "{s:?}");
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, ..ProptestConfig::default() })]

    #[test]
    fn both_engines_leave_identical_contents(steps in proptest::collection::vec(step(), 1..24)) {
        let Some(choice) = uring() else { return Ok(()) };
        let mut uring = rig(choice, PROP_BLOCKS, false);
        let mut threads = rig(EngineChoice::Threads, PROP_BLOCKS, true);
        for s in &steps {
            apply(&mut uring, s);
            apply(&mut threads, s);
        }
        let a = uring.read(0, PROP_BLOCKS as u32);
        let b = threads.read(0, PROP_BLOCKS as u32);
        prop_assert!(a == b, "contents differ after {:?}", steps);
        prop_assert_eq!(std::fs::read(&uring.path).unwrap(), a);
    }
}
