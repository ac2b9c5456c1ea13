//! The zero-copy data path allocates nothing per I/O in steady state: a counting allocator
//! counts heap allocations made on the reactor threads while an initiator runs 4 KiB reads and
//! writes, after a warm-up that lets every table and queue reach its working size; over iSCSI
//! (on a memory LUN, then on a file LUN through the I/O engine), then over SRP, iSER and NVMe/RDMA (the daemon's ports on the software fabric), and over
//! NVMe/TCP. Over SRP, iSER and NVMe/RDMA the count must be 0: the fabric's queues are sized when a queue pair is made and each
//! endpoint provisions its staging copies when receives are posted, so nothing on the reactor
//! depends on how far the initiator's thread lags. Over TCP a few are tolerated for tokio's own
//! bookkeeping (0 in every run measured).

mod common;

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::sync::atomic::{AtomicU64, Ordering};

use common::{config, memory_target, opts, pattern, Daemon, TARGET};
use initiator_bench::scsi::{cdb, Command};

struct Counting;

static REACTOR_ALLOCATIONS: AtomicU64 = AtomicU64::new(0);

thread_local! {
    static ON_REACTOR: Cell<bool> = const { Cell::new(false) };
}

// Safety: forwards to the system allocator; the counting touches only a const-initialised
// thread-local and an atomic, neither of which allocates.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        if ON_REACTOR.with(Cell::get) {
            REACTOR_ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
        }
        // Safety: the caller's layout contract is passed on unchanged.
        unsafe { System.alloc(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // Safety: `ptr` came from `alloc` above with this layout.
        unsafe { System.dealloc(ptr, layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        if ON_REACTOR.with(Cell::get) {
            REACTOR_ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
        }
        // Safety: as for `alloc` and `dealloc`.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reads_and_writes_allocate_nothing_on_the_reactors_in_steady_state() {
    targetd::reactor::on_reactor_thread(|| ON_REACTOR.with(|f| f.set(true)));
    iscsi_steady_state("", &memory_target(TARGET, "")).await;
    // A file LUN through the page cache: reads on the reactor's ring, writes on the ring
    // without blocking or (ext4) on the engine's writer thread.
    iscsi_steady_state(
        " on a file LUN",
        &format!(
            "[[targets]]\nname = \"{TARGET}\"\n\n[[targets.luns]]\nlun = 0\nbackend = \"file\"\n\
             path = \"@DIR@/disk.img\"\nsize = \"64MiB\"\n"
        ),
    )
    .await;
    let during = tokio::task::spawn_blocking(srp_round_trips).await.unwrap();
    println!("reactor allocations during 4096 SRP I/Os in steady state: {during}");
    assert_eq!(
        during, 0,
        "{during} heap allocations on the reactors for 4096 SRP I/Os"
    );
    let during = tokio::task::spawn_blocking(iser_round_trips).await.unwrap();
    println!("reactor allocations during 4096 iSER I/Os in steady state: {during}");
    assert_eq!(
        during, 0,
        "{during} heap allocations on the reactors for 4096 iSER I/Os"
    );
    let during = tokio::task::spawn_blocking(nvme_rdma_round_trips)
        .await
        .unwrap();
    println!(
        "reactor allocations during 4096 NVMe/RDMA I/Os in steady state (reads, writes by RDMA \
         READ, writes in the capsule): {during}"
    );
    assert_eq!(
        during, 0,
        "{during} heap allocations on the reactors for 4096 NVMe/RDMA I/Os"
    );
    let [reads, writes, r2t_writes] = nvme_round_trips().await;
    println!(
        "reactor allocations in steady state during 4096 NVMe/TCP reads, 4096 writes in the \
         capsule, 4096 writes through R2Ts: {reads}, {writes}, {r2t_writes}"
    );
    assert_eq!(
        [reads, writes, r2t_writes],
        [0; 3],
        "heap allocations on the reactors for NVMe/TCP reads, writes, writes through R2Ts"
    );
    #[cfg(feature = "rbd")]
    rbd_round_trips().await;
}

/// The same over NVMe/TCP: initiator-bench's host against a memory namespace, 16 commands in
/// flight over 64 places; the reactor allocations of 4096 reads of 4 KiB, 4096 writes of
/// 4 KiB (in the capsule) and 4096 writes of 16 KiB (through R2Ts), each after as many to
/// warm up.
async fn nvme_round_trips() -> [u64; 3] {
    use initiator_bench::nvme::{NvmeController, NvmeOptions, NvmeUrl};
    use std::sync::Arc;
    let nqn = "nqn.2026-11.io.example:alloc";
    let text = format!(
        "[server]\nportals = [\"127.0.0.1:0\"]\nnvme_portals = [\"127.0.0.1:0\"]\n\
         admin_socket = \"@SOCKET@\"\nreactors = 1\n\n[[subsystems]]\nnqn = \"{nqn}\"\n\
         [[subsystems.namespaces]]\nnsid = 1\nbackend = \"memory\"\nsize = \"64MiB\"\n"
    );
    let addr = std::sync::Mutex::new(None);
    let d = Daemon::start_with(&text, |s| *addr.lock().unwrap() = Some(s.nvme_portals()[0]));
    let addr = addr.into_inner().unwrap().unwrap();
    let url = NvmeUrl::parse(&format!("nvme://{addr}/{nqn}/1")).unwrap();
    let c = Arc::new(
        NvmeController::connect(&url, &NvmeOptions::default())
            .await
            .unwrap(),
    );
    let round = |n: u64, write: bool, len: usize| {
        let (c, data) = (c.clone(), pattern(len, 3));
        async move {
            for batch in 0..n / 16 {
                let mut set = tokio::task::JoinSet::new();
                for i in 0..16u64 {
                    let lba = ((batch * 16 + i) % 64) * 32;
                    let (c, data) = (c.clone(), data.clone());
                    set.spawn(async move {
                        if write {
                            c.write(lba, data).await.unwrap();
                        } else {
                            c.read(lba, 8).await.unwrap();
                        }
                    });
                }
                while set.join_next().await.is_some() {}
            }
        }
    };
    let mut counts = [0u64; 3];
    for (i, (write, len)) in [(false, 4096), (true, 4096), (true, 16384)]
        .into_iter()
        .enumerate()
    {
        round(4096, write, len).await;
        let before = REACTOR_ALLOCATIONS.load(Ordering::Relaxed);
        round(4096, write, len).await;
        counts[i] = REACTOR_ALLOCATIONS.load(Ordering::Relaxed) - before;
    }
    drop(c);
    d.stop();
    counts
}

/// The same over iSER: the test's iSER initiator against the daemon's portal on the software
/// fabric, one command at a time over 64 blocks: 4 KiB writes as immediate data, 4 KiB writes
/// read by RDMA READ, and 4 KiB reads written by RDMA WRITE, in turn.
fn iser_round_trips() -> u64 {
    use common::iser::{daemon, settings, Initiator};

    let (switch, d) = daemon();
    let mut i = Initiator::connect(&switch);
    i.login(settings(true)).expect("logged in");
    let _ = i.command(&[0; 6], None, 0, 0);
    let data = pattern(4096, 1);
    let rw10 = |op: u8, lba: u32| {
        let mut c = [0u8; 10];
        c[0] = op;
        c[2..6].copy_from_slice(&lba.to_be_bytes());
        c[8] = 8;
        c
    };
    let mut round = |n: u32| {
        for k in 0..n {
            let lba = (k % 64) * 8;
            let (r, _) = match k % 3 {
                0 => i.command(&rw10(0x2a, lba), Some(&data), 4096, 0),
                1 => i.command(&rw10(0x2a, lba), Some(&data), 0, 0),
                _ => i.command(&rw10(0x28, lba), None, 0, 4096),
            };
            assert_eq!(r.status, iscsi_pdu::ScsiStatus::GOOD);
        }
    };
    round(4096);
    let before = REACTOR_ALLOCATIONS.load(Ordering::Relaxed);
    round(4096);
    let during = REACTOR_ALLOCATIONS.load(Ordering::Relaxed) - before;
    d.stop();
    during
}

/// The same over NVMe/RDMA (the daemon's portal on the software fabric): 4 KiB reads, writes
/// whose data the target reads by RDMA READ, and writes in the capsule, one at a time.
fn nvme_rdma_round_trips() -> u64 {
    use common::nvme_rdma::{controller, daemon, io, Queue, NQN};
    use nvme::opcode::NvmOpcode;
    use nvme::sqe::Sgl;

    let (switch, d) = daemon();
    let (_admin, cntlid) = controller(&switch);
    let mut q = Queue::open(&switch, 1, 128);
    assert!(q.connect(1, cntlid, NQN).status.is_success());
    let data = pattern(4096, 1);
    q.put(65536, &data);
    let mut round = |n: u32| {
        for k in 0..n {
            let lba = u64::from(k % 64) * 8;
            let cqe = match k % 3 {
                0 => q.run(io(NvmOpcode::Write, lba, 8, q.keyed(65536, 4096)), &[]),
                1 => q.run(
                    io(NvmOpcode::Write, lba, 8, Sgl::in_capsule(0, 4096)),
                    &data,
                ),
                _ => q.run(io(NvmOpcode::Read, lba, 8, q.keyed(1 << 20, 4096)), &[]),
            };
            assert!(cqe.status.is_success(), "{cqe:?}");
        }
    };
    round(4096);
    let before = REACTOR_ALLOCATIONS.load(Ordering::Relaxed);
    round(4096);
    let during = REACTOR_ALLOCATIONS.load(Ordering::Relaxed) - before;
    d.stop();
    during
}

/// The same over iSCSI on an RBD LUN (feature `rbd`, the cluster `CEPH_CONF` and `CEPH_POOL`
/// name): what targetd allocates on its reactors to hand I/O to librbd and take its
/// completions back. librbd's own allocations (its completions, in C++) are not Rust's and are
/// not counted.
#[cfg(feature = "rbd")]
async fn rbd_round_trips() {
    let var = |k: &str| std::env::var(k).ok().filter(|v| !v.is_empty());
    let (Some(conf), Some(pool)) = (var("CEPH_CONF"), var("CEPH_POOL")) else {
        assert!(
            std::env::var_os("CI").is_none(),
            "CI needs a Ceph cluster: .ci/run starts one"
        );
        eprintln!("skipping the RBD half: no Ceph cluster (scripts/ceph-dev-cluster.sh)");
        return;
    };
    let keyring = var("CEPH_KEYRING")
        .map(|k| format!("keyring = \"{k}\"\n"))
        .unwrap_or_default();
    let client = var("CEPH_CLIENT").unwrap_or_else(|| "admin".into());
    let image = format!("allocations-{}", std::process::id());
    iscsi_steady_state(
        " on an RBD LUN",
        &format!(
            "[[targets]]\nname = \"{TARGET}\"\n\n[[targets.luns]]\nlun = 0\nbackend = \"rbd\"\n\
             pool = \"{pool}\"\nimage = \"{image}\"\nsize = \"16MiB\"\nceph_conf = \"{conf}\"\n\
             client = \"{client}\"\n{keyring}"
        ),
    )
    .await;
    let _ = std::process::Command::new("rbd")
        .args(["-c", &conf, "--id", &client])
        .args(
            var("CEPH_KEYRING")
                .map(|k| vec!["--keyring".to_string(), k])
                .unwrap_or_default(),
        )
        .args(["rm", &format!("{pool}/{image}")])
        .output();
}

/// Reactor allocations during 4096 4 KiB I/Os on `s`, after as many to warm up: reads and
/// writes, 16 in flight at a time, over 64 different blocks.
/// A daemon on `target` (a `[[targets]]` table), one iSCSI session, [`steady_state`]'s count
/// printed and checked (`what` names the case), then logout and stop.
async fn iscsi_steady_state(what: &str, target: &str) {
    let d = Daemon::start(&config("", target));
    let s = d.session(opts()).await;
    let _ = s
        .execute(Command::new(s.lun(), cdb::test_unit_ready()))
        .await;
    let during = steady_state(&s).await;
    println!("reactor allocations during 4096 I/Os{what} in steady state: {during}");
    assert!(
        during < 16,
        "{during} heap allocations on the reactors for 4096 I/Os{what}"
    );
    s.logout().await.unwrap();
    d.stop();
}

async fn steady_state(s: &initiator_bench::Session) -> u64 {
    let data = pattern(4096, 1);
    let round = |n: u64| {
        let data = data.clone();
        async move {
            for batch in 0..n / 16 {
                let mut pending = Vec::new();
                for i in 0..16u64 {
                    let lba = ((batch * 16 + i) % 64) * 8;
                    let c = if i % 2 == 0 {
                        Command::write(s.lun(), cdb::write(lba, 8), data.clone())
                    } else {
                        Command::read(s.lun(), cdb::read(lba, 8), 4096)
                    };
                    pending.push(s.start(c).await.unwrap());
                }
                for p in pending {
                    p.wait().await.unwrap().good().unwrap();
                }
            }
        }
    };
    round(4096).await;
    let before = REACTOR_ALLOCATIONS.load(Ordering::Relaxed);
    round(4096).await;
    REACTOR_ALLOCATIONS.load(Ordering::Relaxed) - before
}

/// The same over SRP: initiator-bench's SRP runner against the daemon's port on the software
/// fabric, 4 KiB reads and writes at queue depth 16 cycling over 64 blocks (as above, no two in
/// flight overlap: a write that waits for another's range is another path); the reactor
/// allocations of a second run of 4096 I/Os on the same channel.
fn srp_round_trips() -> u64 {
    use initiator_bench::srp::{run_channels, LinkModel, RdmaOptions};
    use initiator_bench::workload::{Rw, Workload};
    use srp::initiator::Registration;

    let (switch, d) = common::srp_daemon();
    let w = Workload {
        rw: Rw::Rw,
        bs: 4096,
        qd: 16,
        ios: Some(4096),
        size: Some(64 * 4096),
        ..Workload::default()
    };
    let o = RdmaOptions {
        registration: Registration::Pool,
        regions: 1,
        link: LinkModel::Free,
        immediate_data: true,
    };
    let (mut verbs, ch) = common::srp_channel(&switch, 0, &w, &o);
    let mut channels = [ch];
    run_channels(&mut verbs, &mut channels, 0, &w, &o).unwrap();
    let before = REACTOR_ALLOCATIONS.load(Ordering::Relaxed);
    let r = run_channels(&mut verbs, &mut channels, 0, &w, &o).unwrap();
    let during = REACTOR_ALLOCATIONS.load(Ordering::Relaxed) - before;
    assert_eq!((r.ios, r.errors), (4096, 0));
    d.stop();
    during
}
