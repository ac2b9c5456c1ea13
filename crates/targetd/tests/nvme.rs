//! NVMe/TCP through targetd: a subsystem of `[[subsystems]]` reached over a real socket by
//! initiator-bench's NVMe/TCP host (crates/nvme's host machine), as Linux's `nvme connect`
//! reaches it: Connect, Identify, writes in the capsule and through R2Ts, reads back, Flush,
//! Write Zeroes, Dataset Management; with digests; a Connect to an NQN nobody serves and one
//! from a host the subsystem does not admit are refused; another controller is unharmed.

mod common;

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use common::{pattern, Daemon};
use initiator_bench::nvme::{discover, NvmeController, NvmeError, NvmeOptions, NvmeUrl};
use nvme::tcp::Digests;
use nvme::Status;

const NQN: &str = "nqn.2026-11.io.example:ssd";
const HOST: &str = "nqn.2014-08.org.nvmexpress:uuid:8e1b3c9a-0000-4000-8000-696e69746961";

/// targetd with the subsystem NQN (admitting HOST; `extra` more of its keys), its NVMe/TCP
/// portal, its discovery portal and its metrics endpoint.
fn daemon(extra: &str) -> (Daemon, SocketAddr, SocketAddr, SocketAddr) {
    let text = format!(
        "[server]\nportals = [\"127.0.0.1:0\"]\nnvme_portals = [\"127.0.0.1:0\"]\n\
         nvme_discovery_portals = [\"127.0.0.1:0\"]\nmetrics_listen = \"127.0.0.1:0\"\nadmin_socket = \"@SOCKET@\"\nreactors = 2\n\n\
         [[subsystems]]\nnqn = \"{NQN}\"\nhosts = [\"{HOST}\"]\n{extra}\n\
         [[subsystems.namespaces]]\nnsid = 1\nbackend = \"memory\"\nsize = \"64MiB\"\n\n\
         [[subsystems.namespaces]]\nnsid = 2\nbackend = \"file\"\npath = \"@DIR@/ns2.img\"\n\
         size = \"16MiB\"\nblock_size = 4096\n"
    );
    let addrs = Mutex::new(None);
    let d = Daemon::start_with(&text, |s| {
        *addrs.lock().unwrap() = Some((
            s.nvme_portals()[0],
            s.nvme_discovery_portals()[0],
            s.metrics_addr().expect("metrics"),
        ))
    });
    let (addr, discovery, metrics) = addrs.into_inner().unwrap().expect("NVMe/TCP portals");
    (d, addr, discovery, metrics)
}

/// The metrics endpoint's text.
fn metrics(at: SocketAddr) -> String {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(at).unwrap();
    s.write_all(b"GET /metrics HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n")
        .unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).unwrap();
    out
}

fn url(addr: SocketAddr, nqn: &str, nsid: u32) -> NvmeUrl {
    NvmeUrl::parse(&format!("nvme://{addr}/{nqn}/{nsid}")).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_host_connects_writes_reads_zeroes_and_deallocates() {
    let (d, addr, _, metrics_at) = daemon("");
    for digests in [
        Digests::default(),
        Digests {
            header: true,
            data: true,
        },
    ] {
        let o = NvmeOptions {
            digests,
            ..NvmeOptions::default()
        };
        let c = Arc::new(
            NvmeController::connect(&url(addr, NQN, 1), &o)
                .await
                .expect("connect"),
        );
        assert_eq!(c.namespace.block_size, 512);
        assert_eq!(c.namespace.blocks, 64 << 11);
        // 4 KiB goes in the capsule; 128 KiB through an R2T; both read back.
        let small = pattern(4096, 1);
        let big = pattern(128 * 1024, 2);
        c.write(8, small.clone()).await.expect("in-capsule write");
        c.write(1024, big.clone()).await.expect("R2T write");
        assert_eq!(c.read(8, 8).await.unwrap(), small);
        assert_eq!(c.read(1024, 256).await.unwrap(), big);
        c.flush().await.expect("flush");
        // Write Zeroes over the first, Dataset Management over the second: zeros read back.
        c.write_zeroes(8, 8, false).await.expect("write zeroes");
        c.deallocate(&[(1024, 256)]).await.expect("deallocate");
        assert!(c.read(8, 8).await.unwrap().iter().all(|&b| b == 0));
        assert!(c.read(1024, 256).await.unwrap().iter().all(|&b| b == 0));
        // Past the end: LBA Out of Range, and the controller goes on.
        let e = c.read(c.namespace.blocks - 1, 2).await.unwrap_err();
        assert!(
            matches!(e, NvmeError::Status { status, .. } if status == Status::LBA_OUT_OF_RANGE),
            "{e}"
        );
        // Many at once, more than one command's buffer each.
        let mut writes = Vec::new();
        for i in 0..64u64 {
            let data = pattern(8192, i as usize);
            writes.push((i, data));
        }
        let mut set = tokio::task::JoinSet::new();
        for (i, data) in &writes {
            let (c, i, data) = (c.clone(), *i, data.clone());
            set.spawn(async move { c.write(4096 + i * 16, data).await });
        }
        while let Some(r) = set.join_next().await {
            r.unwrap().expect("concurrent write");
        }
        for (i, data) in &writes {
            assert_eq!(&c.read(4096 + i * 16, 16).await.unwrap(), data);
        }
    }
    // The 4 KiB-block file namespace.
    let c = NvmeController::connect(&url(addr, NQN, 2), &NvmeOptions::default())
        .await
        .unwrap();
    assert_eq!((c.namespace.block_size, c.namespace.blocks), (4096, 4096));
    let data = pattern(3 * 4096, 7);
    c.write(5, data.clone()).await.unwrap();
    assert_eq!(c.read(5, 3).await.unwrap(), data);
    let stats = d
        .registry
        .subsystem(NQN)
        .unwrap()
        .namespace(2)
        .unwrap()
        .stats
        .clone();
    assert_eq!(
        stats
            .write_commands
            .load(std::sync::atomic::Ordering::Relaxed),
        1
    );
    // The metrics say the same, per subsystem and namespace.
    let text = metrics(metrics_at);
    let ns2 = format!("{{subsystem=\"{NQN}\",nsid=\"2\"}}");
    for line in [
        format!("targetd_namespace_write_commands_total{ns2} 1"),
        format!("targetd_namespace_read_commands_total{ns2} 1"),
        format!("targetd_namespace_write_bytes_total{ns2} 12288"),
        format!("targetd_namespace_read_latency_seconds_count{ns2} 1"),
        format!("targetd_nvme_controllers{{subsystem=\"{NQN}\"}} 1"),
    ] {
        assert!(text.contains(&line), "{line} missing:\n{text}");
    }
    drop(c);
    d.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connects_the_subsystem_does_not_admit_are_refused() {
    let (d, addr, _, _) = daemon("");
    let ok = NvmeController::connect(&url(addr, NQN, 1), &NvmeOptions::default())
        .await
        .unwrap();
    // No subsystem of that NQN: Connect Invalid Parameters.
    let e = NvmeController::connect(
        &url(addr, "nqn.2026-11.io.example:nobody", 1),
        &NvmeOptions::default(),
    )
    .await
    .unwrap_err();
    assert!(
        matches!(e, NvmeError::Status { status, .. } if status == Status::CONNECT_INVALID_PARAMETERS),
        "{e}"
    );
    // A host not in `hosts`: Connect Invalid Host.
    let stranger = NvmeOptions {
        hostnqn: "nqn.2014-08.org.nvmexpress:uuid:00000000-0000-4000-8000-000000000bad".into(),
        ..NvmeOptions::default()
    };
    let e = NvmeController::connect(&url(addr, NQN, 1), &stranger)
        .await
        .unwrap_err();
    assert!(
        matches!(e, NvmeError::Status { status, .. } if status == Status::CONNECT_INVALID_HOST),
        "{e}"
    );
    // A namespace that is not there: the host finds it inactive.
    let e = NvmeController::connect(&url(addr, NQN, 9), &NvmeOptions::default())
        .await
        .unwrap_err();
    assert!(
        matches!(e, NvmeError::Protocol(_) | NvmeError::Status { .. }),
        "{e}"
    );
    // Garbage on a connection: it is closed, and the good controller goes on.
    {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
        s.write_all(&[0xffu8; 300]).await.unwrap();
        let mut buf = vec![0u8; 256];
        // A C2HTermReq, then the close.
        let mut got = 0;
        loop {
            match s.read(&mut buf[got..]).await {
                Ok(0) | Err(_) => break,
                Ok(n) => got += n,
            }
        }
        assert_eq!(buf[0], 0x03, "C2HTermReq");
    }
    let data = Bytes::from(vec![0x5a; 512]);
    ok.write(0, data.clone()).await.unwrap();
    assert_eq!(ok.read(0, 1).await.unwrap(), data);
    drop(ok);
    d.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_discovery_controller_names_what_each_host_may_reach() {
    let (d, addr, disc, _) = daemon("");
    // At the discovery portal and at the I/O portal alike.
    for at in [disc, addr] {
        let found = discover(&at.to_string(), &NvmeOptions::default())
            .await
            .expect("discover");
        let nvm: Vec<_> = found.iter().filter(|e| e.subtype == 2).collect();
        assert_eq!(nvm.len(), 1, "{found:?}");
        assert_eq!(nvm[0].nqn, NQN);
        assert_eq!(
            (nvm[0].address.as_str(), nvm[0].port.clone()),
            ("127.0.0.1", addr.port().to_string())
        );
        let own: Vec<_> = found.iter().filter(|e| e.subtype == 3).collect();
        assert_eq!(own.len(), 1, "{found:?}");
        assert_eq!(own[0].port, disc.port().to_string());
    }
    // A host the subsystem does not admit is not told of it.
    let stranger = NvmeOptions {
        hostnqn: "nqn.2014-08.org.nvmexpress:uuid:00000000-0000-4000-8000-000000000bad".into(),
        ..NvmeOptions::default()
    };
    let found = discover(&disc.to_string(), &stranger).await.unwrap();
    assert!(found.iter().all(|e| e.subtype != 2), "{found:?}");
    // A discovery controller has no I/O queue.
    let e = NvmeController::connect(
        &url(disc, nvme::fabrics::DISCOVERY_NQN, 1),
        &NvmeOptions::default(),
    )
    .await
    .unwrap_err();
    assert!(
        matches!(e, NvmeError::Protocol(_) | NvmeError::Status { .. }),
        "{e}"
    );
    d.stop();
}

/// A namespace added to the config and reloaded appears to the hosts connected (the
/// Changed Namespace List names it; it can be connected to and used); removed, it is refused
/// while controllers are connected unless forced, and then gone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn namespaces_come_and_go_on_a_reload() {
    let (d, addr, _, _) = daemon("");
    let c = NvmeController::connect(&url(addr, NQN, 1), &NvmeOptions::default())
        .await
        .unwrap();
    let path = d.dir.path().join("config.toml");
    let before = std::fs::read_to_string(&path).unwrap();
    let added = format!(
        "{before}\n[[subsystems.namespaces]]\nnsid = 3\nbackend = \"memory\"\nsize = \"8MiB\"\n"
    );
    std::fs::write(&path, &added).unwrap();
    let changes = d.registry.reload(false).expect("reload");
    assert!(
        changes.iter().any(|c| c.contains("namespace 3 added")),
        "{changes:?}"
    );
    // The host that was connected reads the Changed Namespace List: namespace 3.
    let mut log = nvme::sqe::Sqe::new(nvme::opcode::AdminOpcode::GetLogPage.code(), 0);
    log.set_cdw(10, 0x04 | 1023 << 16);
    let (_, list) = c.admin(log, Bytes::new(), 4096).await.unwrap();
    assert_eq!(&list[..8], &[3, 0, 0, 0, 0, 0, 0, 0]);
    let c3 = NvmeController::connect(&url(addr, NQN, 3), &NvmeOptions::default())
        .await
        .expect("the new namespace");
    // targetctl lists it, and the two controllers.
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_targetctl"))
        .arg("--socket")
        .arg(d.socket())
        .arg("subsystems")
        .output()
        .unwrap();
    let table = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{table}");
    assert!(table.contains(NQN) && table.contains("8 MiB"), "{table}");
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_targetctl"))
        .arg("--socket")
        .arg(d.socket())
        .args(["--json", "subsystems"])
        .output()
        .unwrap();
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("JSON");
    assert_eq!(v[0]["controllers"].as_array().map(Vec::len), Some(2), "{v}");
    let nsids: Vec<u64> = v[0]["namespaces"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|n| n["nsid"].as_u64())
        .collect();
    assert_eq!(nsids, [1, 2, 3]);
    assert_eq!(c3.namespace.blocks, 8 << 11);
    let data = pattern(4096, 9);
    c3.write(0, data.clone()).await.unwrap();
    assert_eq!(c3.read(0, 8).await.unwrap(), data);
    // Removed: refused while controllers are connected, unless forced.
    std::fs::write(&path, &before).unwrap();
    let e = d.registry.reload(false).unwrap_err();
    assert!(e.contains("namespace 3") && e.contains("--force"), "{e}");
    assert_eq!(c3.read(0, 8).await.unwrap(), data);
    let changes = d.registry.reload(true).expect("forced");
    assert!(
        changes.iter().any(|c| c.contains("namespace 3 removed")),
        "{changes:?}"
    );
    let e = c3.read(0, 8).await.unwrap_err();
    assert!(
        matches!(e, NvmeError::Status { status, .. } if status == Status::INVALID_NAMESPACE),
        "{e}"
    );
    // The others are untouched.
    c.write(0, data.clone()).await.unwrap();
    assert_eq!(c.read(0, 8).await.unwrap(), data);
    drop((c, c3));
    d.stop();
}

/// A reservation command on namespace 1 with CDW10 `cdw10`, the keys as its data (or
/// `read_len` bytes to read, Report): the completion's data, or the status that ended it.
async fn reservation(
    c: &NvmeController,
    op: nvme::opcode::NvmOpcode,
    cdw10: u32,
    keys: &[u64],
    read_len: usize,
) -> Result<Bytes, Status> {
    let mut sqe = nvme::Sqe::new(op.code(), 0);
    sqe.set_nsid(1);
    sqe.set_cdw(10, cdw10);
    if read_len > 0 {
        // Extended data structure: the 128-bit Host Identifiers.
        sqe.set_cdw(11, 1);
    }
    let data: Vec<u8> = keys.iter().flat_map(|k| k.to_le_bytes()).collect();
    match c.io(sqe, Bytes::from(data), read_len).await {
        Ok((_, bytes)) => Ok(bytes),
        Err(NvmeError::Status { status, .. }) => Err(status),
        Err(e) => panic!("{e}"),
    }
}

/// Two hosts under NVMe reservations through targetd: host A registers (with persist
/// through power loss) and takes Write Exclusive; B's writes get Reservation Conflict and
/// its reads pass; the reservation is there after targetd restarts (kept in
/// `server.state_dir`); B preempts and aborts A, and then A's writes conflict; B releases
/// and unregisters, and A writes again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reservations_fence_other_hosts_and_persist_through_a_restart() {
    use nvme::opcode::NvmOpcode::{
        ReservationAcquire as Acquire, ReservationRegister as Register,
        ReservationRelease as Release, ReservationReport as Report,
    };
    let dir = tempfile::tempdir().unwrap();
    let text = format!(
        "[server]\nportals = [\"127.0.0.1:0\"]\nnvme_portals = [\"127.0.0.1:0\"]\n\
         admin_socket = \"@SOCKET@\"\nreactors = 2\nstate_dir = \"{0}/state\"\n\n\
         [[subsystems]]\nnqn = \"{NQN}\"\n\n\
         [[subsystems.namespaces]]\nnsid = 1\nbackend = \"file\"\npath = \"{0}/ns1.img\"\n\
         size = \"16MiB\"\n",
        dir.path().display()
    );
    let start = || {
        let addr = Mutex::new(None);
        let d = Daemon::start_with(&text, |s| *addr.lock().unwrap() = Some(s.nvme_portals()[0]));
        let addr = addr.into_inner().unwrap().unwrap();
        (d, addr)
    };
    let host = |name: &str, id: u8| NvmeOptions {
        hostnqn: format!("nqn.2014-08.org.nvmexpress:uuid:{name}"),
        hostid: [id; 16],
        ..NvmeOptions::default()
    };
    let (ha, hb) = (host("host-a", 0xa), host("host-b", 0xb));
    let both = |addr| {
        let (ha, hb) = (ha.clone(), hb.clone());
        async move {
            let a = NvmeController::connect(&url(addr, NQN, 1), &ha).await;
            let b = NvmeController::connect(&url(addr, NQN, 1), &hb).await;
            (a.expect("host A"), b.expect("host B"))
        }
    };
    let (d, addr) = start();
    let (a, b) = both(addr).await;
    // A registers key A with PTPL set (CPTPL 11b), B key B; A takes Write Exclusive.
    reservation(&a, Register, 3 << 30, &[0, 0xa], 0)
        .await
        .unwrap();
    reservation(&b, Register, 0, &[0, 0xb], 0).await.unwrap();
    reservation(&a, Acquire, 1 << 8, &[0xa, 0], 0)
        .await
        .unwrap();
    let conflict = |r: Result<(), NvmeError>| {
        assert!(
            matches!(r, Err(NvmeError::Status { status, .. }) if status == Status::RESERVATION_CONFLICT),
            "{r:?}"
        )
    };
    conflict(b.write(0, pattern(512, 1)).await);
    b.read(0, 1)
        .await
        .expect("a registrant reads under Write Exclusive");
    a.write(0, pattern(512, 2))
        .await
        .expect("the holder writes");
    let r = reservation(&b, Report, 191 / 4, &[], 192).await.unwrap();
    assert_eq!(
        (r[4], r[5], r[9]),
        (1, 2, 1),
        "Write Exclusive, 2 registrants, PTPL"
    );
    drop((a, b));
    d.stop();

    // After a restart: still reserved.
    let (d, addr) = start();
    let (a, b) = both(addr).await;
    conflict(b.write(0, pattern(512, 3)).await);
    a.write(0, pattern(512, 4))
        .await
        .expect("the holder still writes");
    // B preempts A and aborts its commands: B holds Write Exclusive, A is not registered.
    reservation(&b, Acquire, 2 | 1 << 8, &[0xb, 0xa], 0)
        .await
        .unwrap();
    conflict(a.write(0, pattern(512, 5)).await);
    b.write(0, pattern(512, 6))
        .await
        .expect("the new holder writes");
    assert_eq!(
        reservation(&a, Acquire, 1 << 8, &[0xa, 0], 0).await,
        Err(Status::RESERVATION_CONFLICT),
        "A's key is gone"
    );
    let r = reservation(&a, Report, 191 / 4, &[], 192).await.unwrap();
    assert_eq!((r[4], r[5], r[66]), (1, 1, 1));
    assert_eq!(&r[80..96], &[0xb; 16]);
    // B releases and unregisters: A writes again.
    reservation(&b, Release, 1 << 8, &[0xb], 0).await.unwrap();
    reservation(&b, Register, 1, &[0xb, 0], 0).await.unwrap();
    a.write(0, pattern(512, 7))
        .await
        .expect("no reservation left");
    drop((a, b));
    d.stop();
}

/// The Changed Namespace List, read through `c`'s admin queue.
async fn changed_namespaces(c: &NvmeController) -> Result<(nvme::Cqe, Bytes), NvmeError> {
    let mut log = nvme::sqe::Sqe::new(nvme::opcode::AdminOpcode::GetLogPage.code(), 0);
    log.set_cdw(10, 0x04 | 1023 << 16);
    c.admin(log, Bytes::new(), 4096).await
}

/// targetctl with the daemon's socket: stdout, or the failure's stderr.
fn targetctl(d: &Daemon, args: &[&str]) -> Result<String, String> {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_targetctl"))
        .arg("--socket")
        .arg(d.socket())
        .args(args)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    if out.status.success() {
        Ok(text)
    } else {
        Err(format!("{text}{}", String::from_utf8_lossy(&out.stderr)))
    }
}

/// `targetctl namespace add`, `resize` and `remove` while a host is connected: the host
/// hears of each (the Changed Namespace List), Identify Namespace gives the new size, data
/// written stays across a growth, a shrink and a removal need --force, and `config save`
/// writes what runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn targetctl_adds_resizes_and_removes_namespaces() {
    let (d, addr, _, _) = daemon("");
    let c = NvmeController::connect(&url(addr, NQN, 1), &NvmeOptions::default())
        .await
        .unwrap();
    let file = d.dir.path().join("ns4.img");
    let file = file.to_str().unwrap();
    let out = targetctl(
        &d,
        &[
            "namespace",
            "add",
            NQN,
            "4",
            "--path",
            file,
            "--size",
            "8MiB",
        ],
    )
    .expect("namespace add");
    assert!(out.contains("namespace 4 added"), "{out}");
    // Not saved: a reload of the file, which lacks it, is refused.
    let e = d.registry.reload(false).unwrap_err();
    assert!(e.contains(&format!("subsystem {NQN} namespace 4")), "{e}");
    let (_, list) = changed_namespaces(&c).await.unwrap();
    assert_eq!(&list[..8], &[4, 0, 0, 0, 0, 0, 0, 0]);
    let c4 = NvmeController::connect(&url(addr, NQN, 4), &NvmeOptions::default())
        .await
        .expect("namespace 4");
    assert_eq!(c4.namespace.blocks, 8 << 11);
    let data = pattern(4096, 4);
    c4.write(100, data.clone()).await.unwrap();

    // Grown: the host hears of it, Identify Namespace says 16 MiB, the data stays.
    let out = targetctl(&d, &["namespace", "resize", NQN, "4", "16MiB"]).expect("resize");
    assert!(out.contains("namespace 4 resized to 16 MiB"), "{out}");
    let (_, list) = changed_namespaces(&c4).await.unwrap();
    assert_eq!(&list[..4], &[4, 0, 0, 0]);
    let mut id = nvme::sqe::Sqe::new(nvme::opcode::AdminOpcode::Identify.code(), 0);
    id.set_nsid(4);
    let (_, ns) = c4.admin(id, Bytes::new(), 4096).await.unwrap();
    assert_eq!(u64::from_le_bytes(ns[..8].try_into().unwrap()), 16 << 11);
    c4.read((16 << 11) - 8, 8)
        .await
        .expect("a block past the old end");
    assert_eq!(c4.read(100, 8).await.unwrap(), data);
    assert_eq!(std::fs::metadata(file).unwrap().len(), 16 << 20);

    // A shrink would cut blocks off: refused without --force.
    let e = targetctl(&d, &["namespace", "resize", NQN, "4", "4MiB"]).unwrap_err();
    assert!(e.contains("cut off") && e.contains("--force"), "{e}");
    assert_eq!(std::fs::metadata(file).unwrap().len(), 16 << 20);

    // Removing it while controllers are connected needs --force.
    let e = targetctl(&d, &["namespace", "remove", NQN, "4"]).unwrap_err();
    assert!(e.contains("--force"), "{e}");
    targetctl(&d, &["config", "save"]).expect("save");
    let saved = std::fs::read_to_string(d.dir.path().join("config.toml")).unwrap();
    assert!(
        saved.contains("nsid = 4") && saved.contains("ns4.img"),
        "{saved}"
    );
    let out = targetctl(&d, &["namespace", "remove", NQN, "4", "--force"]).expect("forced");
    assert!(out.contains("namespace 4 removed"), "{out}");
    let e = c4.read(100, 8).await.unwrap_err();
    assert!(
        matches!(e, NvmeError::Status { status, .. } if status == Status::INVALID_NAMESPACE),
        "{e}"
    );
    // Unknown subsystems and namespaces are named.
    let e = targetctl(&d, &["namespace", "remove", "nqn.2026-11.x:none", "1"]).unwrap_err();
    assert!(e.contains("no subsystem nqn.2026-11.x:none"), "{e}");
    let e = targetctl(&d, &["namespace", "resize", NQN, "9", "1GiB"]).unwrap_err();
    assert!(e.contains("has no namespace 9"), "{e}");
    drop((c, c4));
    d.stop();
}

/// Fused Compare and Write through targetd: on a memory namespace (whose storage compares
/// and writes under one lock) the Write happens on a match only; Identify Controller says
/// fused operations are supported; on a file namespace (no atomic compare-and-write in the
/// storage) the pair is refused and nothing is written.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fused_compare_and_write_is_atomic_where_the_storage_is() {
    use nvme::opcode::{AdminOpcode, NvmOpcode};
    use nvme::sqe::Fuse;
    let (d, addr, _, _) = daemon("");
    let pair = |nsid: u32, lba: u64, blocks: u32| {
        let mk = |op: NvmOpcode, fuse| {
            let mut s = nvme::Sqe::new(op.code(), 0);
            s.set_nsid(nsid);
            s.set_qword(10, lba);
            s.set_cdw(12, blocks - 1);
            s.set_fuse(fuse);
            s
        };
        (
            mk(NvmOpcode::Compare, Fuse::First),
            mk(NvmOpcode::Write, Fuse::Second),
        )
    };
    let status = |r: Result<(nvme::Cqe, Bytes), NvmeError>| match r {
        Ok(_) => Status::SUCCESS,
        Err(NvmeError::Status { status, .. }) => status,
        Err(e) => panic!("{e}"),
    };
    let c = NvmeController::connect(&url(addr, NQN, 1), &NvmeOptions::default())
        .await
        .unwrap();
    let id = nvme::Sqe::new(AdminOpcode::Identify.code(), 0);
    let mut id = id;
    id.set_cdw(10, 1);
    let (_, ctrl) = c.admin(id, Bytes::new(), 4096).await.unwrap();
    assert_eq!(ctrl[522] & 1, 1, "FUSES: Compare and Write");
    let old = pattern(1024, 1);
    c.write(40, old.clone()).await.unwrap();
    let new = pattern(1024, 2);
    let (cmp, wr) = pair(1, 40, 2);
    let (a, b) = tokio::join!(c.io(cmp, old.clone(), 0), c.io(wr, new.clone(), 0));
    assert_eq!((status(a), status(b)), (Status::SUCCESS, Status::SUCCESS));
    assert_eq!(c.read(40, 2).await.unwrap(), new);
    let (cmp, wr) = pair(1, 40, 2);
    let (a, b) = tokio::join!(c.io(cmp, old.clone(), 0), c.io(wr, pattern(1024, 3), 0));
    assert_eq!(
        (status(a), status(b)),
        (Status::COMPARE_FAILURE, Status::ABORTED_FAILED_FUSED)
    );
    assert_eq!(
        c.read(40, 2).await.unwrap(),
        new,
        "a miscompare writes nothing"
    );

    // The file namespace cannot compare and write atomically: refused, nothing written.
    let f = NvmeController::connect(&url(addr, NQN, 2), &NvmeOptions::default())
        .await
        .unwrap();
    let before = f.read(0, 1).await.unwrap();
    let (cmp, wr) = pair(2, 0, 1);
    let (a, b) = tokio::join!(f.io(cmp, before.clone(), 0), f.io(wr, pattern(4096, 4), 0));
    assert_eq!(
        (status(a), status(b)),
        (Status::INVALID_FIELD, Status::ABORTED_FAILED_FUSED)
    );
    assert_eq!(f.read(0, 1).await.unwrap(), before);
    drop((c, f));
    d.stop();
}

/// `targetctl subsystem add` exports a subsystem at once (the discovery log lists it, its
/// namespaces come with `namespace add`, a reload keeps it until saved); `subsystem remove`
/// is refused while controllers are connected unless forced, and then closes them: the host
/// loses the subsystem, discovery no longer names it, the other subsystem is untouched.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn targetctl_adds_and_removes_subsystems() {
    const SECOND: &str = "nqn.2026-11.io.example:second";
    let (d, addr, disc, _) = daemon("");
    let first = NvmeController::connect(&url(addr, NQN, 1), &NvmeOptions::default())
        .await
        .unwrap();
    let listed = |found: &[initiator_bench::nvme::Discovered]| {
        found
            .iter()
            .filter(|e| e.subtype == 2)
            .map(|e| e.nqn.clone())
            .collect::<Vec<_>>()
    };
    let found = discover(&disc.to_string(), &NvmeOptions::default())
        .await
        .unwrap();
    assert_eq!(listed(&found), [NQN]);

    let out = targetctl(&d, &["subsystem", "add", SECOND, "--host", HOST]).expect("add");
    assert!(
        out.contains(&format!("subsystem {SECOND} added (0 namespaces)")),
        "{out}"
    );
    let e = targetctl(&d, &["subsystem", "add", SECOND]).unwrap_err();
    assert!(e.contains("exists already"), "{e}");
    let found = discover(&disc.to_string(), &NvmeOptions::default())
        .await
        .unwrap();
    assert_eq!(listed(&found), [NQN, SECOND]);
    let out = targetctl(
        &d,
        &[
            "namespace",
            "add",
            SECOND,
            "1",
            "--backend",
            "memory",
            "--size",
            "8MiB",
        ],
    )
    .expect("namespace add");
    assert!(out.contains("namespace 1 added"), "{out}");
    let second = NvmeController::connect(&url(addr, SECOND, 1), &NvmeOptions::default())
        .await
        .expect("the new subsystem");
    let data = pattern(4096, 7);
    second.write(8, data.clone()).await.unwrap();
    assert_eq!(second.read(8, 8).await.unwrap(), data);
    // The tree shows it with its controller, that controller's I/O queue and its namespace;
    // status counts both subsystems' controllers.
    let tree = targetctl(&d, &["tree"]).expect("tree");
    let mine = &tree[tree.find(SECOND).expect("the subsystem in the tree")..];
    for line in [
        "├── access: hosts ".to_string(),
        format!(": {HOST}, I/O queues 1\n"),
        "    └── 1: memory, 8 MiB, 512-byte blocks\n".to_string(),
    ] {
        assert!(mine.contains(&line), "{line:?} in {tree}");
    }
    let status: serde_json::Value =
        serde_json::from_str(&targetctl(&d, &["--json", "status"]).expect("status")).unwrap();
    assert_eq!(status["nvme_controllers"], 2, "{status}");

    // Made live and not saved: a reload of the file (which lacks it) is refused.
    let e = d.registry.reload(false).unwrap_err();
    assert!(e.contains(&format!("subsystem {SECOND}")), "{e}");
    // Connected: removing it needs --force.
    let e = targetctl(&d, &["subsystem", "remove", SECOND]).unwrap_err();
    assert!(e.contains("1 controller") && e.contains("--force"), "{e}");
    assert_eq!(second.read(8, 8).await.unwrap(), data);
    targetctl(&d, &["config", "save"]).expect("save");
    let saved = std::fs::read_to_string(d.dir.path().join("config.toml")).unwrap();
    assert!(saved.contains(SECOND), "{saved}");

    let out = targetctl(&d, &["subsystem", "remove", SECOND, "--force"]).expect("forced");
    assert!(
        out.contains(&format!("subsystem {SECOND} removed")),
        "{out}"
    );
    let e = second.read(8, 8).await.unwrap_err();
    assert!(
        matches!(e, NvmeError::Connection(_)),
        "its connections closed: {e}"
    );
    let found = discover(&disc.to_string(), &NvmeOptions::default())
        .await
        .unwrap();
    assert_eq!(listed(&found), [NQN]);
    let e = NvmeController::connect(&url(addr, SECOND, 1), &NvmeOptions::default())
        .await
        .unwrap_err();
    assert!(
        matches!(e, NvmeError::Status { .. } | NvmeError::Protocol(_)),
        "{e}"
    );
    let e = targetctl(&d, &["subsystem", "remove", SECOND]).unwrap_err();
    assert!(e.contains(&format!("no subsystem {SECOND}")), "{e}");
    // The first subsystem and its host are untouched.
    first.write(0, data.clone()).await.unwrap();
    assert_eq!(first.read(0, 8).await.unwrap(), data);
    drop((first, second));
    d.stop();
}

/// A portal listening on every address (0.0.0.0) is named in the discovery log by the
/// address the host reached, which it can connect to, not by the wildcard.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wildcard_portal_is_discovered_by_the_address_reached() {
    let text = format!(
        "[server]\nportals = [\"127.0.0.1:0\"]\nnvme_portals = [\"0.0.0.0:0\"]\n\
         admin_socket = \"@SOCKET@\"\nreactors = 1\n\n\
         [[subsystems]]\nnqn = \"{NQN}\"\n\n\
         [[subsystems.namespaces]]\nnsid = 1\nbackend = \"memory\"\nsize = \"8MiB\"\n"
    );
    let portal = Mutex::new(None);
    let d = Daemon::start_with(&text, |s| {
        *portal.lock().unwrap() = Some(s.nvme_portals()[0])
    });
    let portal = portal.into_inner().unwrap().expect("an NVMe/TCP portal");
    assert!(portal.ip().is_unspecified(), "{portal}");
    let reached = SocketAddr::from(([127, 0, 0, 1], portal.port()));
    let found = discover(&reached.to_string(), &NvmeOptions::default())
        .await
        .expect("discover");
    let nvm: Vec<_> = found.iter().filter(|e| e.subtype == 2).collect();
    assert_eq!(nvm.len(), 1, "{found:?}");
    assert_eq!(
        (nvm[0].address.as_str(), nvm[0].port.clone()),
        ("127.0.0.1", portal.port().to_string())
    );
    // And the host connects where it was told.
    let at: SocketAddr = format!("{}:{}", nvm[0].address, nvm[0].port)
        .parse()
        .unwrap();
    let c = NvmeController::connect(&url(at, NQN, 1), &NvmeOptions::default())
        .await
        .expect("connect at the discovered address");
    drop(c);
    d.stop();
}
