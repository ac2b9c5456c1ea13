//! The rdma-sys binding against this machine's RDMA devices (feature `ibverbs`). Without a device,
//! the binding must say so clearly (what targetd reports when a config names rdma portals);
//! with one, memory registers and, given an address of the device in `RDMA_TEST_ADDR`,
//! two queue pairs connect over rdma_cm and move data with send, RDMA WRITE and RDMA READ.
//! No CI machine has an RDMA device (it is hardware, not a tool to install), so there the
//! device part prints why it is skipped, also under `CI`.
#![cfg(feature = "ibverbs")]

use std::net::SocketAddr;

use rdma::ibverbs::{devices, Connection, Listener, QueueDepth, RdmaError, RdmaVerbs};
use rdma::verbs::{Access, PeerMemory, RemoteRegion, Verbs, WorkOp};

#[test]
fn without_a_device_the_binding_says_so() {
    let names = devices().expect("the device list can be read");
    if !names.is_empty() {
        eprintln!("RDMA devices present ({names:?}): the no-device case is not this machine's");
        return;
    }
    match RdmaVerbs::<rdma::ibverbs::Slot>::open(None, 4, 4096) {
        Err(e @ RdmaError::NoDevice(_)) => assert_eq!(e.to_string(), "no RDMA device found"),
        other => panic!("opened without a device: {other:?}"),
    }
    let addr: SocketAddr = "127.0.0.1:0".parse().expect("an address");
    let e = Listener::bind(addr, 16).expect_err("no device serves the address");
    eprintln!("listening without a device: {e}");
    assert!(
        e.to_string().contains("failed"),
        "an error naming the call that failed: {e}"
    );
}

fn wait<T>(mut f: impl FnMut() -> Option<T>) -> T {
    for _ in 0..2_000_000 {
        if let Some(t) = f() {
            return t;
        }
        std::thread::yield_now();
    }
    panic!("timed out");
}

#[test]
fn a_device_registers_memory_and_moves_data_over_rdma_cm() {
    let names = devices().expect("the device list can be read");
    if names.is_empty() {
        eprintln!(
            "skipped: no RDMA device found (ibv_get_device_list is empty); this test needs RDMA \
             hardware or a soft device (rxe, siw) in the kernel"
        );
        return;
    }
    let mut v: RdmaVerbs = RdmaVerbs::open(None, 64, 8192).expect("the device opens");
    let m = v.alloc(1 << 20).expect("memory");
    v.write(&m, 0, b"srp!");
    let r = v
        .register(&m, 0, 1 << 20, Access::REMOTE)
        .expect("registered");
    assert_eq!(r.len, 1 << 20);
    v.deregister(r);
    drop(v);
    let Some(addr) = std::env::var("RDMA_TEST_ADDR")
        .ok()
        .and_then(|a| a.parse::<std::net::IpAddr>().ok())
    else {
        eprintln!("loopback skipped: set RDMA_TEST_ADDR to an IP address of {names:?}");
        return;
    };
    let port = 5555 + (std::process::id() % 1000) as u16;
    let mut listener = Listener::bind(SocketAddr::new(addr, port), 4).expect("listening");
    let depth = QueueDepth { send: 64, recv: 16 };
    let initiator = std::thread::spawn(move || {
        let mut v: RdmaVerbs = RdmaVerbs::open(None, 16, 8192).expect("the device opens");
        let (qp, reply) = v
            .connect(SocketAddr::new(addr, port), depth, b"login")
            .expect("connected");
        assert_eq!(reply, b"welcome");
        // Memory the target writes into and reads from, its descriptor sent to the target.
        let m = v.alloc(8192).expect("memory");
        v.write(&m, 4096, b"read");
        let r = v.register(&m, 0, 8192, Access::REMOTE).expect("registered");
        let mut iu = v.slot().expect("a slot");
        iu[..16].copy_from_slice(&encode(r.remote(0, 8192)));
        v.post_recv(qp, 2, v.slot().expect("a slot"));
        v.post_send(qp, 1, iu, 16);
        let done = wait(|| v.poll(qp).filter(|c| c.op == WorkOp::Recv));
        assert_eq!(done.result, Ok(()));
        let mut got = [0; 5];
        v.read(&m, 0, &mut got);
        assert_eq!(&got, b"hello");
    });
    let request = wait(|| listener.accept());
    assert_eq!(request.private, b"login");
    let mut v: RdmaVerbs = RdmaVerbs::open(None, 16, 8192).expect("the device opens");
    let receive = v.slot().expect("a slot");
    let qp = v
        .accept(request, depth, [receive], b"welcome")
        .expect("accepted");
    wait(|| {
        v.poll_connection()
            .filter(|(_, c)| *c == Connection::Established)
    });
    let got = wait(|| v.poll(qp).filter(|c| c.op == WorkOp::Recv));
    assert_eq!((got.wr_id, got.len, got.result), (0, 16, Ok(())));
    let d = decode(&got.buffer[..16]);
    let mut data = v.slot().expect("a slot");
    data[..5].copy_from_slice(b"hello");
    v.post_rdma_write(qp, 8, data, 0, 5, &[d]);
    let w = wait(|| v.poll(qp));
    assert_eq!((w.op, w.result), (WorkOp::RdmaWrite, Ok(())));
    let mut back = v.slot().expect("a slot");
    back[..4].fill(0);
    let at = RemoteRegion {
        addr: d.addr + 4096,
        len: 4,
        ..d
    };
    v.post_rdma_read(qp, 9, back, 0, 4, &[at]);
    let rd = wait(|| v.poll(qp));
    assert_eq!((rd.op, rd.result), (WorkOp::RdmaRead, Ok(())));
    assert_eq!(&rd.buffer[..4], b"read");
    let mut ack = v.slot().expect("a slot");
    ack[..5].copy_from_slice(b"done!");
    v.post_send(qp, 10, ack, 5);
    initiator.join().expect("the initiator's side");
}

/// The region as the test's initiator sends it: address, key and length, big-endian.
fn encode(r: RemoteRegion) -> [u8; 16] {
    let mut b = [0; 16];
    b[..8].copy_from_slice(&r.addr.to_be_bytes());
    b[8..12].copy_from_slice(&r.rkey.to_be_bytes());
    b[12..].copy_from_slice(&r.len.to_be_bytes());
    b
}

fn decode(b: &[u8]) -> RemoteRegion {
    RemoteRegion {
        addr: u64::from_be_bytes(b[..8].try_into().expect("8 bytes")),
        rkey: u32::from_be_bytes(b[8..12].try_into().expect("4 bytes")),
        len: u32::from_be_bytes(b[12..16].try_into().expect("4 bytes")),
    }
}
