//! Durability: what an initiator was told is stored stays stored when targetd is killed
//! (SIGKILL) in the middle of writes and started again; persistent reservations made with APTPL
//! come back after the restart; and registrations follow SPC-4 when an initiator logs in again.
//! docs/robustness.md lists the cases.

mod common;

use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use common::{config, keys, memory_target, opts, pr_in, pr_out, Daemon, TARGET};
use initiator_bench::scsi::{cdb, Command};
use initiator_bench::{IscsiUrl, LoginOptions, Session};
use iscsi_pdu::{Isid, Lun, ScsiStatus};

// ---- Persistent reservations, as fence_scsi uses them --------------------------------------

const REGISTER: u8 = 0x00;
const RESERVE: u8 = 0x01;
const REGISTER_AND_IGNORE_EXISTING_KEY: u8 = 0x06;
/// Write Exclusive – Registrants Only: what fence_scsi reserves.
const WRITE_EXCLUSIVE_REGISTRANTS_ONLY: u8 = 0x05;

/// The reservation (READ RESERVATION): its holder's key and its type.
async fn reservation(s: &Session) -> Option<(u64, u8)> {
    let d = pr_in(s, 1).await;
    let len = u32::from_be_bytes(d[4..8].try_into().unwrap());
    (len >= 16).then(|| {
        (
            u64::from_be_bytes(d[8..16].try_into().unwrap()),
            d[21] & 0x0f,
        )
    })
}

/// The status of `cmd`, after any UNIT ATTENTION a new nexus reports first.
async fn status(s: &Session, cmd: Command) -> ScsiStatus {
    let r = s.execute_past_unit_attentions(cmd).await;
    r.expect("an answer").status
}

fn with_isid(isid: u8) -> LoginOptions {
    LoginOptions {
        isid: Some(Isid([0x80, 0, 0, 0x42, 0, isid])),
        ..opts()
    }
}

/// SPC-4 5.14.3: a registration belongs to an I_T nexus, named by the initiator port (the
/// initiator name and the ISID), not to a connection or session. Logging in again with the
/// same ISID is the same nexus: the registration is still there and its key still works.
/// Another ISID is another, unregistered nexus, which is refused what registrants may do until
/// REGISTER AND IGNORE EXISTING KEY registers it (fence_scsi relies on both).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn registrations_follow_the_nexus_across_logins() {
    let d = Daemon::start(&config("", &memory_target(TARGET, "")));
    let url = d.url(TARGET, 0);
    let lun = Lun::ZERO;
    let a = Session::connect(&url, with_isid(1)).await.unwrap();
    let reg = pr_out(lun, REGISTER, 0, 0, 0xa, false);
    assert_eq!(status(&a, reg).await, ScsiStatus::GOOD);
    let wero = WRITE_EXCLUSIVE_REGISTRANTS_ONLY;
    assert_eq!(
        status(&a, pr_out(lun, RESERVE, wero, 0xa, 0, false)).await,
        ScsiStatus::GOOD
    );

    // The same ISID logs in again (session reinstatement): still registered, key 0xa works.
    a.reconnect().await.unwrap();
    assert_eq!(keys(&a).await, vec![0xa]);
    let reserve_again = pr_out(lun, RESERVE, wero, 0xa, 0, false);
    assert_eq!(status(&a, reserve_again).await, ScsiStatus::GOOD);
    a.logout().await.unwrap();
    drop(a);
    let a = Session::connect(&url, with_isid(1)).await.unwrap();
    let write = |s: &Session| Command::write(s.lun(), cdb::write(0, 1), Bytes::from(vec![1; 512]));
    assert_eq!(
        status(&a, write(&a)).await,
        ScsiStatus::GOOD,
        "a registrant"
    );

    // A new ISID: a new nexus, not registered, so a registrants-only write conflicts, and its
    // key is not 0xa's; REGISTER AND IGNORE EXISTING KEY registers it.
    let b = Session::connect(&url, with_isid(2)).await.unwrap();
    assert_eq!(
        status(&b, write(&b)).await,
        ScsiStatus::RESERVATION_CONFLICT
    );
    let reserve_as_a = pr_out(lun, RESERVE, wero, 0xa, 0, false);
    assert_eq!(
        status(&b, reserve_as_a).await,
        ScsiStatus::RESERVATION_CONFLICT
    );
    let ignore = pr_out(lun, REGISTER_AND_IGNORE_EXISTING_KEY, 0, 0, 0xb, false);
    assert_eq!(status(&b, ignore).await, ScsiStatus::GOOD);
    assert_eq!(keys(&b).await, vec![0xa, 0xb]);
    assert_eq!(status(&b, write(&b)).await, ScsiStatus::GOOD);
    // Again, over its own key: replaced, whatever key it had.
    let again = pr_out(lun, REGISTER_AND_IGNORE_EXISTING_KEY, 0, 0x77, 0xc, false);
    assert_eq!(status(&b, again).await, ScsiStatus::GOOD);
    assert_eq!(keys(&b).await, vec![0xa, 0xc]);
    assert_eq!(reservation(&b).await, Some((0xa, wero)));
}

// ---- targetd as a process, killed -----------------------------------------------------------

/// targetd as a child process on `config`, serving `addr`.
struct Targetd {
    child: Child,
}

impl Targetd {
    fn start(config: &Path, addr: SocketAddr, log: &Path) -> Targetd {
        let child = std::process::Command::new(env!("CARGO_BIN_EXE_targetd"))
            .arg(config)
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(log).unwrap())
            .spawn()
            .expect("targetd starts");
        let started = Instant::now();
        while std::net::TcpStream::connect(addr).is_err() {
            assert!(
                started.elapsed() < Duration::from_secs(30),
                "targetd does not listen: {}",
                std::fs::read_to_string(log).unwrap_or_default()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        Targetd { child }
    }

    /// SIGKILL: no draining, no flushing, nothing of the daemon's runs after it.
    fn kill(mut self) {
        self.child.kill().unwrap();
        self.child.wait().unwrap();
    }
}

impl Drop for Targetd {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A loopback address no one listens on now.
fn free_addr() -> SocketAddr {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
}

/// How each writer makes its writes durable.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Durable {
    /// The LU has `write_cache = false`: every write is.
    WriteThrough,
    /// Each write has FUA set.
    Fua,
    /// Writes count once a SYNCHRONIZE CACHE after them has ended GOOD.
    Synchronized,
}

/// Blocks per write and the slots each writer owns (disjoint, so a slot has at most one write
/// in flight: after the kill it holds the last acknowledged version or the one in flight).
const BLOCKS: u32 = 16;
const SLOTS_PER_WRITER: u64 = 64;

/// The content of version `v` of `slot`: every block says which.
fn version(slot: u64, v: u32) -> Bytes {
    let mut b = vec![0u8; BLOCKS as usize * 512];
    for (i, block) in b.chunks_mut(512).enumerate() {
        block[..8].copy_from_slice(&slot.to_be_bytes());
        block[8..12].copy_from_slice(&v.to_be_bytes());
        block[12..16].copy_from_slice(&(i as u32).to_be_bytes());
        for (j, x) in block[16..].iter_mut().enumerate() {
            *x = (slot as usize * 7 + v as usize * 13 + j) as u8;
        }
    }
    Bytes::from(b)
}

/// Per slot: the version known durable and a version that may have landed (in flight, or
/// written but not yet synchronized).
#[derive(Debug, Default, Clone, Copy)]
struct Slot {
    durable: u32,
    maybe: Option<u32>,
}

/// One writer: versions of its slots until the daemon dies under it.
async fn writer(s: Arc<Session>, id: u64, mode: Durable, book: Arc<Mutex<HashMap<u64, Slot>>>) {
    let mut v = 0u32;
    let mut unsynced: Vec<(u64, u32)> = Vec::new();
    loop {
        v += 1;
        let slot = id * SLOTS_PER_WRITER + u64::from(v) % SLOTS_PER_WRITER;
        book.lock().unwrap().entry(slot).or_default().maybe = Some(v);
        let mut c = cdb::write(slot * u64::from(BLOCKS), BLOCKS);
        if mode == Durable::Fua {
            c[1] |= 0x08;
        }
        let r = s
            .execute(Command::write(s.lun(), c, version(slot, v)))
            .await;
        if !r.is_ok_and(|r| r.status == ScsiStatus::GOOD) {
            return;
        }
        if mode == Durable::Synchronized {
            unsynced.push((slot, v));
            if unsynced.len() < 8 {
                continue;
            }
            let sync = Command::new(s.lun(), cdb::synchronize_cache());
            if !s
                .execute(sync)
                .await
                .is_ok_and(|r| r.status == ScsiStatus::GOOD)
            {
                return;
            }
            let mut b = book.lock().unwrap();
            for (slot, v) in unsynced.drain(..) {
                let e = b.get_mut(&slot).unwrap();
                e.durable = e.durable.max(v);
            }
            continue;
        }
        let mut b = book.lock().unwrap();
        let e = b.get_mut(&slot).unwrap();
        e.durable = v;
        e.maybe = None;
    }
}

fn url(addr: SocketAddr, lun: u16) -> IscsiUrl {
    IscsiUrl::parse(&format!("iscsi://{addr}/{TARGET}/{lun}")).unwrap()
}

/// targetd is killed with SIGKILL while 12 writers write and synchronize on three file LUs
/// (write-through; FUA; write-back with SYNCHRONIZE CACHE): after a restart every write known
/// durable reads back (or the version after it, if that one was in flight), and the
/// reservation made with APTPL before the kill is back, with its keys.
///
/// SIGKILL stops the daemon but not the kernel: what targetd handed to the kernel survives in
/// the page cache. The test shows that targetd acknowledges nothing before handing it over and
/// that its state on disk is whole after a kill; a power cut, which would also lose the page
/// cache, cannot be made here (FUA, SYNCHRONIZE CACHE and write-through map to RWF_DSYNC,
/// fdatasync and O_DSYNC: crates/backend/README.md).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn acknowledged_writes_and_aptpl_reservations_survive_sigkill() {
    let dir = tempfile::tempdir().unwrap();
    let addr = free_addr();
    let path = |name: &str| -> PathBuf { dir.path().join(name) };
    let lun = |n: u16, file: &str, write_cache: bool| {
        format!(
            "[[targets.luns]]\nlun = {n}\nbackend = \"file\"\npath = \"{}\"\nsize = \"64MiB\"\n\
             write_cache = {write_cache}\n",
            path(file).display()
        )
    };
    let text = format!(
        "[server]\nportals = [\"{addr}\"]\nadmin_socket = \"{}\"\nreactors = 2\n\
         nop_interval = 0\nstate_dir = \"{}\"\n\n[[targets]]\nname = \"{TARGET}\"\n{}{}{}",
        path("admin.sock").display(),
        path("state").display(),
        lun(0, "through.img", false),
        lun(1, "fua.img", true),
        lun(2, "synced.img", true),
    );
    let config = path("config.toml");
    std::fs::write(&config, text).unwrap();
    let log = path("targetd.log");
    let daemon = Targetd::start(&config, addr, &log);

    // A reservation that must outlive the daemon, on LU 2.
    let holder = Session::connect(&url(addr, 2), with_isid(9)).await.unwrap();
    let lu2 = holder.lun();
    let wero = WRITE_EXCLUSIVE_REGISTRANTS_ONLY;
    for (action, kind, key, new_key) in [(REGISTER, 0, 0, 0xfe11), (RESERVE, wero, 0xfe11, 0)] {
        let cmd = pr_out(lu2, action, kind, key, new_key, true);
        assert_eq!(status(&holder, cmd).await, ScsiStatus::GOOD);
    }

    let modes = [
        (0, Durable::WriteThrough),
        (1, Durable::Fua),
        (2, Durable::Synchronized),
    ];
    let mut books = Vec::new();
    let mut writers = Vec::new();
    for (lun, mode) in modes {
        let book = Arc::new(Mutex::new(HashMap::new()));
        books.push((lun, mode, book.clone()));
        for id in 0..4 {
            // Writers on the reserved LU register first (registrants may write), with APTPL
            // still set: the last APTPL received decides whether the state persists.
            let s = Arc::new(Session::connect(&url(addr, lun), opts()).await.unwrap());
            let tur = Command::new(s.lun(), cdb::test_unit_ready());
            assert_eq!(status(&s, tur).await, ScsiStatus::GOOD);
            if lun == 2 {
                let reg = pr_out(
                    s.lun(),
                    REGISTER_AND_IGNORE_EXISTING_KEY,
                    0,
                    0,
                    0x100 + id,
                    true,
                );
                assert_eq!(status(&s, reg).await, ScsiStatus::GOOD);
            }
            writers.push(tokio::spawn(writer(s, id, mode, book.clone())));
        }
    }
    // Kill once every LU has durable writes, with writes in flight.
    let started = Instant::now();
    loop {
        tokio::time::sleep(Duration::from_millis(200)).await;
        let durable = |b: &Mutex<HashMap<u64, Slot>>| {
            b.lock().unwrap().values().filter(|s| s.durable > 0).count()
        };
        if books.iter().all(|(_, _, b)| durable(b) >= 64) {
            break;
        }
        let counts: Vec<usize> = books.iter().map(|(_, _, b)| durable(b)).collect();
        let finished = writers.iter().filter(|w| w.is_finished()).count();
        assert!(
            started.elapsed() < Duration::from_secs(60),
            "slots with durable writes per LU: {counts:?}; writers stopped: {finished}"
        );
    }
    daemon.kill();
    for w in writers {
        w.await.unwrap();
    }
    drop(holder);

    let _daemon = Targetd::start(&config, addr, &log);
    for (lun, mode, book) in books {
        let s = Session::connect(&url(addr, lun), opts()).await.unwrap();
        let tur = Command::new(s.lun(), cdb::test_unit_ready());
        assert_eq!(status(&s, tur).await, ScsiStatus::GOOD);
        let book = book.lock().unwrap().clone();
        let mut durable_slots = 0;
        for (slot, state) in book {
            let lba = slot * u64::from(BLOCKS);
            let got = s.read(lba, BLOCKS, 512).await.unwrap();
            // Block by block: a write in flight at the kill may have landed in part.
            for (i, block) in got.chunks(512).enumerate() {
                let v = u32::from_be_bytes(block[8..12].try_into().unwrap());
                let whole = version(slot, v);
                let ok = if block.iter().all(|&b| b == 0) {
                    state.durable == 0
                } else if block != &whole[i * 512..(i + 1) * 512] {
                    false
                } else if mode == Durable::Synchronized {
                    // Any write after the last SYNCHRONIZE CACHE may have landed too.
                    v >= state.durable
                } else {
                    v == state.durable || state.maybe == Some(v)
                };
                assert!(
                    ok,
                    "{mode:?}: slot {slot} block {i} holds version {v}, {state:?}"
                );
            }
            durable_slots += usize::from(state.durable > 0);
        }
        eprintln!("{mode:?}: {durable_slots} slots with durable writes checked after SIGKILL");
    }

    let s = Session::connect(&url(addr, 2), opts()).await.unwrap();
    assert_eq!(reservation(&s).await, Some((0xfe11, wero)));
    let k = keys(&s).await;
    assert!(k.contains(&0xfe11) && k.len() == 5, "{k:x?}");
}
