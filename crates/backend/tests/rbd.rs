//! The RBD backend against a real cluster: every operation, errors naming what is wrong, and
//! resizes seen through the update watch.
//!
//! The cluster is the one `CEPH_CONF`, `CEPH_KEYRING`, `CEPH_CLIENT` and `CEPH_POOL` name
//! (`scripts/ceph-dev-cluster.sh start DIR` writes them to DIR/env). Without them the tests
//! say so and pass; under `CI` they fail instead.
#![cfg(feature = "rbd")]

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use backend::rbd::{Cluster, ClusterConfig, Image, ImageSpec, RbdBackend, RbdError};
use backend::{Arena, ArenaConfig, Buffer, Engine, EngineChoice, EngineConfig};
use scsi_core::{Backend, BackendError, Op, Output};

mod common;

use common::unique;

struct Env {
    config: ClusterConfig,
    pool: String,
}

fn env() -> Option<Env> {
    common::ceph().map(|(config, pool)| Env { config, pool })
}

struct Rig {
    _engine: Engine,
    arena: Arena,
    backend: RbdBackend,
    next: u64,
}

impl Rig {
    fn new(image: Arc<Image>) -> Rig {
        let engine = Engine::new(EngineConfig {
            engine: EngineChoice::Threads,
            ..EngineConfig::default()
        })
        .unwrap();
        let arena = Arena::new(ArenaConfig {
            slot_size: 64 << 10,
            slots: 64,
            huge_pages: false,
        })
        .unwrap();
        let backend = RbdBackend::new(image, 512, engine.event_fd()).unwrap();
        Rig {
            _engine: engine,
            arena,
            backend,
            next: 0,
        }
    }

    fn buffer(&self, fill: &[u8]) -> Buffer {
        let mut b = self.arena.try_alloc(fill.len().max(1)).unwrap().unwrap();
        b.set_len(fill.len());
        b.copy_from_slice(fill);
        b
    }

    /// Runs `op` with a buffer holding `data`; returns the result and the buffer's bytes.
    fn run(&mut self, op: Op, data: &[u8]) -> (Result<Output, BackendError>, Vec<u8>) {
        self.next += 1;
        let token = self.next;
        let buf = self.buffer(data);
        self.backend.submit(token, op, buf);
        loop {
            if let Some((t, r, b)) = self.backend.poll_completion() {
                assert_eq!(t, token);
                return (r, b.to_vec());
            }
            assert!(
                self.backend.wait(Duration::from_secs(30)),
                "{op:?} did not complete"
            );
        }
    }

    fn read(&mut self, lba: u64, blocks: u32) -> Vec<u8> {
        let op = Op::Read {
            lba,
            blocks,
            offset: 0,
            fua: false,
        };
        let (r, b) = self.run(op, &vec![0xee; blocks as usize * 512]);
        r.unwrap();
        b
    }

    fn write(&mut self, lba: u64, data: &[u8], fua: bool) {
        let op = Op::Write {
            lba,
            blocks: (data.len() / 512) as u32,
            offset: 0,
            fua,
        };
        self.run(op, data).0.unwrap();
    }
}

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect()
}

#[test]
fn every_operation_on_a_real_image() {
    let Some(env) = env() else { return };
    let cluster = Cluster::shared(&env.config).unwrap();
    let spec = ImageSpec {
        pool: env.pool.clone(),
        namespace: String::new(),
        image: unique("ops"),
    };
    let size = 64u64 << 20;
    let (image, created) = Image::open(cluster.clone(), &spec, Some(size), false).unwrap();
    assert!(created);
    assert_eq!(image.size().unwrap(), size);
    assert_eq!(image.object_size(), 4 << 20, "Ceph's default object size");
    let mut rig = Rig::new(image.clone());

    // Reads of a fresh image are zeros; writes read back, across an object boundary too.
    assert!(rig.read(0, 16).iter().all(|&b| b == 0));
    let data = pattern(64 << 10, 1);
    let boundary = (4 << 20) / 512 - 64; // Straddles objects 0 and 1.
    rig.write(boundary, &data, false);
    assert_eq!(rig.read(boundary, 128), data);
    rig.write(10, &pattern(4096, 2), true);
    assert_eq!(rig.read(10, 8), pattern(4096, 2));
    assert_eq!(
        rig.run(Op::Flush { lba: 0, blocks: 0 }, &[]).0,
        Ok(Output::Done)
    );

    // COMPARE AND WRITE of one sector: atomic at the OSD; a miscompare names the first
    // differing byte.
    let mut caw = pattern(512, 2);
    caw.extend(pattern(512, 3));
    let op = Op::CompareAndWrite {
        lba: 10,
        blocks: 1,
        fua: false,
    };
    assert_eq!(rig.run(op, &caw).0, Ok(Output::Done));
    assert_eq!(rig.read(10, 1), pattern(512, 3));
    let mut wrong = pattern(512, 3);
    wrong[100] ^= 0xff;
    wrong.extend(pattern(512, 4));
    assert_eq!(
        rig.run(op, &wrong).0,
        Err(BackendError::Miscompare { offset: 100 })
    );
    assert_eq!(rig.read(10, 1), pattern(512, 3), "nothing written");
    // Of eight sectors: on the helper thread.
    let mut caw = rig.read(10, 8);
    caw.extend(pattern(4096, 3));
    let op = Op::CompareAndWrite {
        lba: 10,
        blocks: 8,
        fua: false,
    };
    assert_eq!(rig.run(op, &caw).0, Ok(Output::Done));
    assert_eq!(rig.read(10, 8), pattern(4096, 3));
    let mut wrong = pattern(4096, 3);
    wrong[1000] ^= 0xff;
    wrong.extend(pattern(4096, 4));
    assert_eq!(
        rig.run(op, &wrong).0,
        Err(BackendError::Miscompare { offset: 1000 })
    );
    assert_eq!(rig.read(10, 8), pattern(4096, 3), "nothing written");
    // Across an object boundary: compared and written on the helper thread.
    let last = (4 << 20) / 512 - 1;
    let mut across = rig.read(last, 2);
    across.extend(pattern(1024, 5));
    let op = Op::CompareAndWrite {
        lba: last,
        blocks: 2,
        fua: false,
    };
    assert_eq!(rig.run(op, &across).0, Ok(Output::Done));
    assert_eq!(rig.read(last, 2), pattern(1024, 5));
    assert_eq!(
        rig.run(op, &across).0,
        Err(BackendError::Miscompare { offset: 0 })
    );

    // VERIFY (byte check) and ORWRITE.
    let verify = Op::Compare {
        lba: 10,
        blocks: 8,
        offset: 0,
        same: false,
    };
    assert_eq!(rig.run(verify, &pattern(4096, 3)).0, Ok(Output::Done));
    assert_eq!(
        rig.run(verify, &pattern(4096, 9)).0.unwrap_err(),
        BackendError::Miscompare { offset: 0 }
    );
    rig.write(100, &[0x0f; 512], false);
    let or = Op::OrWrite {
        lba: 100,
        blocks: 1,
        fua: false,
    };
    rig.run(or, &[0xf0; 512]).0.unwrap();
    assert!(rig.read(100, 1).iter().all(|&b| b == 0xff));

    // WRITE SAME: a pattern, zeros, and zeros with UNMAP (deallocated, reads zeros).
    let same = Op::WriteSame {
        lba: 200,
        blocks: 64,
        zeros: false,
        unmap: false,
        fua: false,
    };
    rig.run(same, &[0x5a; 512]).0.unwrap();
    assert!(rig.read(200, 64).iter().all(|&b| b == 0x5a));
    let zeros = Op::WriteSame {
        lba: 200,
        blocks: 32,
        zeros: true,
        unmap: false,
        fua: false,
    };
    rig.run(zeros, &[]).0.unwrap();
    let back = rig.read(200, 64);
    assert!(back[..32 * 512].iter().all(|&b| b == 0));
    assert!(back[32 * 512..].iter().all(|&b| b == 0x5a));

    // UNMAP of a partial range zeros it; of whole objects deallocates them, as GET LBA STATUS
    // then says.
    rig.run(
        Op::Unmap {
            lba: 201,
            blocks: 3,
        },
        &[],
    )
    .0
    .unwrap();
    assert!(rig.read(200, 64)[512..4 * 512].iter().all(|&b| b == 0));
    let per_object = (4u64 << 20) / 512;
    rig.write(3 * per_object, &pattern(4096, 6), false);
    let (r, _) = rig.run(
        Op::LbaStatus {
            lba: 3 * per_object,
        },
        &[],
    );
    assert_eq!(
        r,
        Ok(Output::LbaStatus {
            mapped: true,
            blocks: per_object
        }),
        "an object written is mapped whole"
    );
    let (r, _) = rig.run(
        Op::LbaStatus {
            lba: 5 * per_object + 7,
        },
        &[],
    );
    assert_eq!(
        r,
        Ok(Output::LbaStatus {
            mapped: false,
            blocks: size / 512 - 5 * per_object - 7
        }),
        "nothing written beyond object 3"
    );
    rig.run(
        Op::Unmap {
            lba: 3 * per_object,
            blocks: per_object,
        },
        &[],
    )
    .0
    .unwrap();
    let (r, _) = rig.run(
        Op::LbaStatus {
            lba: 2 * per_object,
        },
        &[],
    );
    assert_eq!(
        r,
        Ok(Output::LbaStatus {
            mapped: false,
            blocks: size / 512 - 2 * per_object
        })
    );
    assert!(rig.read(3 * per_object, 8).iter().all(|&b| b == 0));
    assert_eq!(rig.backend.outstanding(), 0);
    drop(rig);

    // Many at once: completions come back whatever their order, each with its buffer.
    let mut rig = Rig::new(image.clone());
    for i in 0..48u64 {
        let op = Op::Write {
            lba: i * 128,
            blocks: 128,
            offset: 0,
            fua: false,
        };
        let buf = rig.buffer(&pattern(64 << 10, i as u8));
        rig.backend.submit(i, op, buf);
    }
    let mut seen = [false; 48];
    while seen.iter().any(|s| !s) {
        while let Some((t, r, _)) = rig.backend.poll_completion() {
            r.unwrap();
            assert!(!seen[t as usize]);
            seen[t as usize] = true;
        }
        if seen.iter().any(|s| !s) {
            assert!(rig.backend.wait(Duration::from_secs(30)));
        }
    }
    for i in 0..48u64 {
        assert_eq!(rig.read(i * 128, 128), pattern(64 << 10, i as u8));
    }
    let stats = image.stats();
    assert_eq!(stats.in_flight.load(Ordering::Relaxed), 0);
    assert!(stats.completed.load(Ordering::Relaxed) >= 100);
}

#[test]
fn resizes_are_seen_through_the_watch_and_existing_images_are_never_resized() {
    let Some(env) = env() else { return };
    let cluster = Cluster::shared(&env.config).unwrap();
    let spec = ImageSpec {
        pool: env.pool.clone(),
        namespace: String::new(),
        image: unique("resize"),
    };
    let (image, created) = Image::open(cluster.clone(), &spec, Some(8 << 20), false).unwrap();
    assert!(created);
    // A second client (another gateway, the rbd CLI) opens it with another size: untouched.
    let other = Cluster::connect(&env.config).unwrap();
    let (theirs, created) = Image::open(Arc::new(other), &spec, Some(1 << 30), false).unwrap();
    assert!(!created);
    assert_eq!(theirs.size().unwrap(), 8 << 20);

    let (tx, rx) = std::sync::mpsc::channel();
    image
        .watch(move || {
            let _ = tx.send(());
        })
        .unwrap();
    theirs.resize(16 << 20, false).unwrap();
    rx.recv_timeout(Duration::from_secs(20))
        .expect("the update watch saw the other client's resize");
    assert_eq!(image.size().unwrap(), 16 << 20);
    // Shrinking needs to be asked for.
    assert!(image.resize(4 << 20, false).is_err());
    image.resize(4 << 20, true).unwrap();
    assert_eq!(theirs.size().unwrap(), 4 << 20);
}

#[test]
fn errors_name_what_is_wrong() {
    let Some(env) = env() else { return };
    let cluster = Cluster::shared(&env.config).unwrap();
    let missing = ImageSpec {
        pool: env.pool.clone(),
        namespace: String::new(),
        image: unique("absent"),
    };
    let e = Image::open(cluster.clone(), &missing, None, false).unwrap_err();
    assert!(matches!(e, RbdError::NoImage { .. }), "{e}");
    assert_eq!(e.key(), "size");
    let pool = ImageSpec {
        pool: "no-such-pool".into(),
        ..missing
    };
    let e = Image::open(cluster, &pool, Some(1 << 20), false).unwrap_err();
    assert!(matches!(e, RbdError::Pool { .. }), "{e}");
    assert!(e.to_string().contains("no-such-pool"), "{e}");

    // A key the monitors do not know.
    let dir = tempfile::tempdir().unwrap();
    let keyring = dir.path().join("bad.keyring");
    std::fs::write(
        &keyring,
        "[client.targetd]\n\tkey = AQBSdFtnAAAAABAAa0Vh2UHs2SUkX0YbUG7ukw==\n",
    )
    .unwrap();
    let bad = ClusterConfig {
        keyring: Some(keyring),
        client: "targetd".into(),
        timeout: Duration::from_secs(5),
        ..env.config.clone()
    };
    let e = Cluster::connect(&bad).unwrap_err();
    assert_eq!(e.key(), "client", "{e}");

    // No monitor at the address: refused within the timeout, not forever.
    let conf = dir.path().join("nowhere.conf");
    std::fs::write(&conf, "[global]\nmon host = v2:127.0.0.1:1\n").unwrap();
    let nowhere = ClusterConfig {
        ceph_conf: Some(conf),
        timeout: Duration::from_secs(3),
        ..env.config.clone()
    };
    let start = std::time::Instant::now();
    let e = Cluster::connect(&nowhere).unwrap_err();
    assert!(matches!(e, RbdError::Connect { .. }), "{e}");
    assert!(start.elapsed() < Duration::from_secs(30));
    let e = Cluster::connect(&ClusterConfig {
        ceph_conf: Some("/nonexistent/ceph.conf".into()),
        ..env.config
    })
    .unwrap_err();
    assert_eq!(e.key(), "ceph_conf", "{e}");
}
