//! targetd serving SRP on a real RDMA device (feature `rdma`): `server.rdma_portals` on an
//! address of the device, an initiator on the same device logs in over rdma_cm, writes and
//! reads back a block. It needs RDMA hardware or a soft device (rxe, siw) and
//! `RDMA_TEST_ADDR`, an IP address of it; without them it prints why and skips, also
//! under `CI` (no CI machine has such a device: it is hardware, not a tool to install). The
//! same port code runs in `tests/srp.rs` over the software fabric, on every machine.
#![cfg(feature = "rdma")]

mod common;

use std::net::{IpAddr, SocketAddr};
use std::time::{Duration, Instant};

use common::{config, memory_target, Daemon, TARGET};
use rdma::ibverbs::{devices, QueueDepth, RdmaVerbs};
use rdma::verbs::{Access, PeerMemory, Verbs, WorkOp};
use srp::iu::{
    BufferFormats, DataBufferDescriptor, Iu, MultiChannelAction, SrpCmd, SrpLoginReq, TaskAttribute,
};

fn wait<T>(what: &str, mut f: impl FnMut() -> Option<T>) -> T {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        if let Some(t) = f() {
            return t;
        }
        assert!(Instant::now() < deadline, "timed out: {what}");
        std::thread::yield_now();
    }
}

#[test]
fn an_initiator_on_an_rdma_device_writes_and_reads_through_targetd() {
    let names = devices().expect("the device list can be read");
    let addr = std::env::var("RDMA_TEST_ADDR")
        .ok()
        .and_then(|a| a.parse::<IpAddr>().ok());
    let Some(addr) = addr.filter(|_| !names.is_empty()) else {
        eprintln!(
            "skipped: needs an RDMA device (found {names:?}) and RDMA_TEST_ADDR, an IP \
             address of it; this is hardware (or rxe/siw in the kernel), not a tool to install"
        );
        return;
    };
    let portal = SocketAddr::new(addr, 5600 + (std::process::id() % 300) as u16);
    let text = config("", &memory_target(TARGET, "")).replace(
        "reactors = 2",
        &format!("reactors = 2\nrdma_portals = [\"{portal}\"]"),
    );
    let d = Daemon::start(&text);
    let mut v: RdmaVerbs = RdmaVerbs::open(None, 256, 8192).expect("the device opens");
    let req = SrpLoginReq {
        tag: 1,
        req_it_iu_len: 8192,
        req_buf_fmt: BufferFormats::BOTH,
        multi_channel: MultiChannelAction::SingleChannel,
        initiator_port_id: *b"rdma-initiator-1",
        target_port_id: targetd::srp::port_id(TARGET),
        ..SrpLoginReq::default()
    };
    let mut private = Vec::new();
    req.encode_rdma_cm(&mut private);
    let depth = QueueDepth {
        send: 256,
        recv: 140,
    };
    let (qp, reply) = v.connect(portal, depth, &private).expect("logged in");
    let Ok(Iu::LoginRsp(rsp)) = Iu::decode(&reply) else {
        panic!("not an SRP_LOGIN_RSP: {reply:02x?}");
    };
    for _ in 0..rsp.req_lim_delta + 4 {
        let slot = v.slot().expect("a slot");
        v.post_recv(qp, 0, slot);
    }
    let m = v.alloc(1 << 20).expect("memory");
    let data: Vec<u8> = (0..4096).map(|i| (i * 7) as u8).collect();
    v.write(&m, 0, &data);
    let region = v
        .register(&m, 0, 1 << 20, Access::REMOTE)
        .expect("registered");
    let run = |v: &mut RdmaVerbs, tag: u64, cdb: &[u8], write: bool, at: u32| {
        let d = DataBufferDescriptor::Direct(region.remote(at, 4096).into());
        let (out, inn) = if write {
            (d, DataBufferDescriptor::None)
        } else {
            (DataBufferDescriptor::None, d)
        };
        let cmd = SrpCmd {
            sol_not: 0,
            tag,
            lun: 0,
            task_attribute: TaskAttribute::Simple,
            cdb,
            data_out: out,
            data_in: inn,
        };
        let mut b = Vec::new();
        cmd.encode(&mut b);
        let mut slot = v.slot().expect("a slot");
        slot[..b.len()].copy_from_slice(&b);
        v.post_send(qp, 1, slot, b.len());
        let wc = wait("an SRP_RSP", || {
            v.poll(qp)
                .filter(|c| c.op == WorkOp::Recv && c.result.is_ok())
        });
        let status = match Iu::decode(&wc.buffer[..wc.len]) {
            Ok(Iu::Rsp(r)) => r.status,
            other => panic!("{other:?}"),
        };
        v.post_recv(qp, 0, wc.buffer);
        status
    };
    let write = [0x2a, 0, 0, 0, 0, 8, 0, 0, 8, 0];
    let read = [0x28, 0, 0, 0, 0, 8, 0, 0, 8, 0];
    // The first command hears of the power on.
    let mut status = run(&mut v, 10, &write, true, 0);
    if status == 2 {
        status = run(&mut v, 11, &write, true, 0);
    }
    assert_eq!(status, 0);
    assert_eq!(run(&mut v, 12, &read, false, 8192), 0);
    let mut back = vec![0; 4096];
    v.read(&m, 8192, &mut back);
    assert_eq!(back, data, "read back what was written");
    assert_eq!(d.registry.srp_channels().len(), 1);
    drop(v);
    d.stop();
}
