//! The backend engines at queue depth 32 on a page-cache file: 4 KiB random reads and writes,
//! 128 KiB sequential reads and writes, each on io_uring with the arena and file registered
//! (READ_FIXED/WRITE_FIXED, fixed files), io_uring without registration, and the thread pool.
//! One criterion iteration is one operation, so the element rate is IOPS. The 4 KiB writes are
//! the path where a file system without non-blocking buffered writes (ext4) sends io_uring's
//! writes to the engine's writer thread.

use std::time::{Duration, Instant};

use backend::{
    Arena, ArenaConfig, Engine, EngineChoice, EngineConfig, FileBackend, FileConfig, FileHandle,
};
use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use scsi_core::{Backend, Op};

const QD: usize = 32;
const FILE_BYTES: u64 = 256 << 20;
const BS: u32 = 512;

struct Setup {
    arena: Arena,
    engine: Engine,
    lu: FileBackend,
}

fn setup(name: &str, path: &std::path::Path) -> Setup {
    let (choice, register) = match name {
        "uring-registered" => (EngineChoice::Uring, true),
        "uring-plain" => (EngineChoice::Uring, false),
        _ => (EngineChoice::Threads, false),
    };
    let engine = Engine::new(EngineConfig {
        engine: choice,
        register,
        threads: 4,
        queue_depth: QD as u32,
        ..EngineConfig::default()
    })
    .expect("engine");
    let arena = Arena::new(ArenaConfig {
        slot_size: 128 << 10,
        slots: 64,
        huge_pages: true,
    })
    .expect("arena");
    engine.register_arena(&arena).expect("register arena");
    let lu = engine.open(FileHandle::open(&FileConfig::new(path, Some(FILE_BYTES))).expect("file"));
    Setup { arena, engine, lu }
}

/// Runs `iters` operations with `QD` in flight; `op(i)` is the i-th operation.
fn drive(s: &mut Setup, iters: u64, len: usize, mut op: impl FnMut(u64) -> Op) -> Duration {
    let mut free: Vec<_> = (0..QD)
        .map(|_| s.arena.try_alloc(len).unwrap().unwrap())
        .collect();
    let start = Instant::now();
    let (mut submitted, mut done) = (0u64, 0u64);
    while done < iters {
        while submitted < iters {
            let Some(b) = free.pop() else { break };
            s.lu.submit(submitted, op(submitted), b);
            submitted += 1;
        }
        s.engine.submit_pending().unwrap();
        let mut got = false;
        while let Some((_, r, b)) = s.lu.poll_completion() {
            r.expect("I/O");
            free.push(b);
            done += 1;
            got = true;
        }
        if !got && done < iters {
            s.engine.wait().unwrap();
        }
    }
    start.elapsed()
}

fn engines(c: &mut Criterion) {
    let dir = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join("backend-bench");
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("page-cache.img");
    // Fill the file so reads come from the page cache, not holes.
    std::fs::write(&path, vec![0x5a; FILE_BYTES as usize]).unwrap();
    let blocks = FILE_BYTES / u64::from(BS);
    let names = ["uring-registered", "uring-plain", "threads"];

    for (group, write) in [("randread-4k-qd32", false), ("randwrite-4k-qd32", true)] {
        let mut g = c.benchmark_group(group);
        g.throughput(Throughput::Elements(1));
        for name in names {
            let mut s = setup(name, &path);
            g.bench_function(BenchmarkId::from_parameter(name), |b| {
                b.iter_custom(|iters| {
                    let mut x = 0x9e37_79b9_7f4a_7c15u64;
                    drive(&mut s, iters, 4096, |_| {
                        x ^= x << 13;
                        x ^= x >> 7;
                        x ^= x << 17;
                        let lba = (x % (blocks / 8)) * 8;
                        if write {
                            Op::Write {
                                lba,
                                blocks: 8,
                                offset: 0,
                                fua: false,
                            }
                        } else {
                            Op::Read {
                                lba,
                                blocks: 8,
                                offset: 0,
                                fua: false,
                            }
                        }
                    })
                })
            });
        }
        g.finish();
    }

    let chunk = 128u64 << 10;
    let per = (chunk / u64::from(BS)) as u32;
    for (group, write) in [("seqread-128k-qd32", false), ("seqwrite-128k-qd32", true)] {
        let mut g = c.benchmark_group(group);
        g.throughput(Throughput::Bytes(chunk));
        for name in names {
            let mut s = setup(name, &path);
            g.bench_function(BenchmarkId::from_parameter(name), |b| {
                b.iter_custom(|iters| {
                    drive(&mut s, iters, chunk as usize, |i| {
                        let lba = (i * u64::from(per)) % (blocks - u64::from(per));
                        if write {
                            Op::Write {
                                lba,
                                blocks: per,
                                offset: 0,
                                fua: false,
                            }
                        } else {
                            Op::Read {
                                lba,
                                blocks: per,
                                offset: 0,
                                fua: false,
                            }
                        }
                    })
                })
            });
        }
        g.finish();
    }
}

criterion_group!(benches, engines);
criterion_main!(benches);
