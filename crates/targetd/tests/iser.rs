//! targetd's iSER portal end to end over the software fabric: the daemon serves iSER on a
//! [`Switch`] (its portal on a reactor, data in the reactor's arena, file units through its
//! engine) and a small initiator on the test's thread connects with the iSER CM header, logs
//! in with iscsi-pdu's initiator login asking for RDMAExtensions, and reads and writes with
//! its buffers named in iSER headers: the target moves the data with RDMA READ and WRITE. It
//! is refused without RDMAExtensions, logs out, and is asked to log out when the daemon stops.

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::{Bytes, BytesMut};
use common::{config, Daemon, TARGET};
use iscsi_pdu::chap::ENTROPY_LEN;
use iscsi_pdu::initiator::{Established, Login, LoginError};
use iscsi_pdu::iser::{self, CmReply, CmRequest, IserHeader, RemoteBuffer};
use iscsi_pdu::negotiation::{Declarations, DigestAlgorithm, OperationalParams, Settings};
use iscsi_pdu::pdu::LoginStatus;
use iscsi_pdu::{
    AsyncEvent, Isid, LogoutReason, LogoutRequest, Lun, Pdu, ScsiCommand, ScsiResponse, ScsiStatus,
    SerialNumber,
};
use srp::fabric::{Access, MemoryId, MemoryRegion, NodeId, QpId};
use srp::switch::{Endpoint, Reply, Switch};
use srp::verbs::{Verbs, WorkOp, IU_BUFFER_LEN};

const TARGET_NODE: NodeId = NodeId(0);
const INITIATOR_NODE: NodeId = NodeId(1);
const SERVICE: &str = "iser0";
const INITIATOR: &str = "iqn.2026-11.io.example:iser-initiator";
/// The initiator's memory: data-out in the first half, data-in in the second.
const MEMORY: usize = 8 << 20;
const DATA_IN: usize = MEMORY / 2;
const WAIT: Duration = Duration::from_secs(10);

/// The daemon serving iSER on a new switch: a target with a 64 MiB file LUN 0.
fn daemon() -> (Arc<Switch>, Daemon) {
    let switch = Switch::new();
    let targets = format!(
        "[[targets]]\nname = \"{TARGET}\"\n\
         [[targets.luns]]\nlun = 0\nbackend = \"file\"\npath = \"@DIR@/lun0.img\"\nsize = \"64MiB\"\n"
    );
    let d = Daemon::start_with(&config("", &targets), |server| {
        server
            .serve_iser_fabric(&switch, TARGET_NODE, SERVICE)
            .expect("the service is free");
    });
    (switch, d)
}

/// What Linux's iSER initiator offers: RDMAExtensions, no digests, 8 KiB each way.
fn settings(rdma: bool) -> Settings {
    Settings {
        header_digest: vec![DigestAlgorithm::None],
        data_digest: vec![DigestAlgorithm::None],
        max_recv_data_segment_length: 8192,
        operational: OperationalParams {
            rdma_extensions: rdma,
            immediate_data: true,
            initial_r2t: false,
            max_burst_length: 262_144,
            first_burst_length: 65_536,
            ..OperationalParams::default()
        },
        declarations: Declarations {
            initiator_name: Some(INITIATOR.into()),
            target_name: Some(TARGET.into()),
            ..Declarations::default()
        },
        ..Settings::default()
    }
}

/// A minimal iSER initiator on the switch: one connection, its memory registered once.
struct Initiator {
    switch: Arc<Switch>,
    verbs: Endpoint<Vec<u8>>,
    qp: QpId,
    memory: MemoryId,
    region: MemoryRegion,
    cmd_sn: u32,
    itt: u32,
}

impl Initiator {
    fn connect(switch: &Arc<Switch>) -> Initiator {
        let private = CmRequest {
            zbva_not_supported: true,
            send_with_invalidate_not_supported: true,
        }
        .encode();
        let id = switch
            .connect(INITIATOR_NODE, SERVICE, &private)
            .expect("the daemon listens");
        let deadline = Instant::now() + WAIT;
        let reply = loop {
            if let Some(r) = switch.reply(id) {
                break r;
            }
            assert!(
                Instant::now() < deadline,
                "no answer to the connect request"
            );
            std::thread::sleep(Duration::from_millis(1));
        };
        let Reply::Accepted { qp, private } = reply else {
            panic!("refused: {reply:?}");
        };
        assert_eq!(CmReply::decode(&private), CmReply::default());
        let mut verbs: Endpoint<Vec<u8>> = switch.endpoint(INITIATOR_NODE);
        for _ in 0..16 {
            verbs.post_recv(qp, 0, vec![0; IU_BUFFER_LEN]);
        }
        let (memory, region) = switch.with(|f| {
            let m = f.alloc(INITIATOR_NODE, MEMORY);
            (m, f.register(m, 0, MEMORY, Access::REMOTE))
        });
        Initiator {
            switch: switch.clone(),
            verbs,
            qp,
            memory,
            region,
            cmd_sn: 1,
            itt: 0,
        }
    }

    fn send(&mut self, pdu: &Pdu, header: IserHeader) {
        let mut m = BytesMut::new();
        iser::encode(pdu, &header, &mut m);
        let n = m.len();
        self.verbs.post_send(self.qp, 1, m.to_vec(), n);
    }

    /// The next PDU the target sent; `None` once the queue pair is gone.
    fn recv(&mut self) -> Option<Pdu> {
        let deadline = Instant::now() + WAIT;
        loop {
            while let Some(wc) = self.verbs.poll(self.qp) {
                if wc.op != WorkOp::Recv {
                    assert!(wc.result.is_ok(), "a send failed: {:?}", wc.result);
                    continue;
                }
                if wc.result.is_err() {
                    return None;
                }
                let msg = wc.buffer[..wc.len].to_vec();
                self.verbs.post_recv(self.qp, 0, wc.buffer);
                match iser::decode(&msg, 1 << 20).expect("a well-formed message") {
                    iser::Message::Control(h, iser::Received::Pdu(p)) => {
                        assert_eq!(h, IserHeader::default(), "a target names no buffers");
                        return Some(p);
                    }
                    other => panic!("unexpected from the target: {other:?}"),
                }
            }
            if self.verbs.is_error(self.qp) {
                return None;
            }
            assert!(Instant::now() < deadline, "nothing from the target");
            std::thread::sleep(Duration::from_micros(200));
        }
    }

    fn login(&mut self, settings: Settings) -> Result<Established, LoginError> {
        let isid = Isid([0x80, 0, 0, 0, 0x1e, 1]);
        let mut login = Login::new(settings, isid, 0, 1, SerialNumber(1), [3; ENTROPY_LEN]);
        loop {
            while let Some(pdu) = login.poll_transmit() {
                self.send(&pdu, IserHeader::default());
            }
            let Some(Pdu::LoginResponse(r)) = self.recv() else {
                panic!("not a login response");
            };
            if let Some(done) = login.handle_response(r)? {
                self.cmd_sn = done.exp_cmd_sn.0;
                return Ok(done);
            }
        }
    }

    /// Runs a command whose data-out is `data_out` (its first `imm` bytes as immediate data)
    /// or whose data-in is `data_in` bytes; returns the response and the data-in.
    fn command(
        &mut self,
        cdb: &[u8],
        data_out: Option<&[u8]>,
        imm: usize,
        data_in: usize,
    ) -> (ScsiResponse, Vec<u8>) {
        self.itt += 1;
        let itt = self.itt;
        let mut c = [0u8; 16];
        c[..cdb.len()].copy_from_slice(cdb);
        let base = self.region.addr;
        let mut header = IserHeader::default();
        let mut immediate = Bytes::new();
        if let Some(data) = data_out {
            self.switch
                .with(|f| f.memory_mut(self.memory)[..data.len()].copy_from_slice(data));
            immediate = Bytes::copy_from_slice(&data[..imm]);
            if imm < data.len() {
                header.write = Some(RemoteBuffer {
                    stag: self.region.rkey,
                    va: base + imm as u64,
                });
            }
        }
        if data_in > 0 {
            header.read = Some(RemoteBuffer {
                stag: self.region.rkey,
                va: base + DATA_IN as u64,
            });
        }
        let sn = self.cmd_sn;
        self.cmd_sn += 1;
        let cmd = Pdu::ScsiCommand(ScsiCommand {
            final_bit: true,
            read: data_in > 0,
            write: data_out.is_some(),
            lun: Lun::ZERO,
            initiator_task_tag: itt,
            expected_data_transfer_length: data_out.map_or(data_in, <[u8]>::len) as u32,
            cmd_sn: SerialNumber(sn),
            cdb: c,
            data: immediate,
            ..ScsiCommand::default()
        });
        self.send(&cmd, header);
        match self.recv() {
            Some(Pdu::ScsiResponse(r)) if r.initiator_task_tag == itt => {
                let data = self
                    .switch
                    .with(|f| f.memory(self.memory)[DATA_IN..DATA_IN + data_in].to_vec());
                (r, data)
            }
            Some(other) => panic!("not the command's response: {other:?}"),
            None => panic!("the connection dropped"),
        }
    }
}

fn rw10(op: u8, lba: u32, blocks: u16) -> [u8; 10] {
    let mut c = [0u8; 10];
    c[0] = op;
    c[2..6].copy_from_slice(&lba.to_be_bytes());
    c[7..9].copy_from_slice(&blocks.to_be_bytes());
    c
}

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len).map(|i| (i / 7) as u8 ^ seed).collect()
}

#[test]
fn reads_and_writes_move_by_rdma() {
    let (switch, d) = daemon();
    let mut i = Initiator::connect(&switch);
    let done = i.login(settings(true)).expect("logged in");
    assert!(done.session.operational.rdma_extensions);
    assert!(
        done.session.operational.initial_r2t,
        "iSER asks for InitialR2T=Yes"
    );
    assert_eq!(done.connection.max_send_data_segment_length, 8192);
    // The new session's unit attention.
    let (r, _) = i.command(&[0; 6], None, 0, 0);
    assert_eq!(r.status, ScsiStatus::CHECK_CONDITION);
    // 1 MiB + 8 KiB: 8 KiB of immediate data, the rest read by the target in bursts.
    let data = pattern((1 << 20) + 8192, 0x5a);
    let blocks = (data.len() / 512) as u16;
    let (r, _) = i.command(&rw10(0x2a, 2048, blocks), Some(&data), 8192, 0);
    assert_eq!(r.status, ScsiStatus::GOOD, "{r:?}");
    // On the medium where it should be.
    let file = std::fs::read(d.dir.path().join("lun0.img")).unwrap();
    assert!(file[2048 * 512..2048 * 512 + data.len()] == data[..]);
    // Back by RDMA WRITE, then the status.
    let (r, back) = i.command(&rw10(0x28, 2048, blocks), None, 0, data.len());
    assert_eq!((r.status, r.exp_data_sn), (ScsiStatus::GOOD, 0));
    assert!(back == data);
    // Parameter data (INQUIRY) goes by RDMA WRITE too.
    let (r, inq) = i.command(&[0x12, 0, 0, 0, 96, 0], None, 0, 96);
    assert_eq!(r.status, ScsiStatus::GOOD);
    assert_eq!(inq[0] & 0x1f, 0, "a disk");
    assert!(
        inq[8..16].iter().all(u8::is_ascii),
        "vendor: {:?}",
        &inq[8..16]
    );
    // A write all in immediate data.
    let small = pattern(4096, 0x33);
    let (r, _) = i.command(&rw10(0x2a, 0, 8), Some(&small), 4096, 0);
    assert_eq!(r.status, ScsiStatus::GOOD);
    let (_, back) = i.command(&rw10(0x28, 0, 8), None, 0, 4096);
    assert!(back == small);
    // Logout: the response, then the target lets the queue pair go.
    let logout = Pdu::LogoutRequest(LogoutRequest {
        immediate: true,
        reason: LogoutReason::CloseSession,
        initiator_task_tag: 0x1000,
        cid: 1,
        cmd_sn: SerialNumber(i.cmd_sn),
        ..LogoutRequest::default()
    });
    i.send(&logout, IserHeader::default());
    assert!(matches!(i.recv(), Some(Pdu::LogoutResponse(_))));
    // The initiator lets the connection go; the target's side ends.
    i.verbs.disconnect(i.qp);
    let deadline = Instant::now() + WAIT;
    while !d.registry.sessions.all().is_empty() {
        assert!(Instant::now() < deadline, "the session ends");
        std::thread::sleep(Duration::from_millis(5));
    }
    d.stop();
}

#[test]
fn a_normal_session_without_rdma_extensions_is_refused() {
    let (switch, d) = daemon();
    let mut i = Initiator::connect(&switch);
    let e = i.login(settings(false)).unwrap_err();
    assert_eq!(e, LoginError::Refused(LoginStatus::MISSING_PARAMETER));
    // An initiator that stays is disconnected by the target soon after.
    let started = Instant::now();
    assert!(i.recv().is_none(), "disconnected after the refusal");
    assert!(
        started.elapsed() >= Duration::from_secs(1),
        "the initiator had time to go first"
    );
    // A discovery session needs no RDMA: it logs in and asks SendTargets.
    let mut i = Initiator::connect(&switch);
    let mut s = settings(false);
    s.declarations.session_type = iscsi_pdu::negotiation::SessionType::Discovery;
    s.declarations.target_name = None;
    i.login(s).expect("a discovery session");
    d.stop();
}

#[test]
fn the_daemon_asks_a_live_session_to_log_out_when_it_stops() {
    let (switch, d) = daemon();
    let mut i = Initiator::connect(&switch);
    i.login(settings(true)).expect("logged in");
    let stopping = std::thread::spawn(move || d.stop());
    match i.recv() {
        Some(Pdu::AsyncMessage(m)) => assert_eq!(m.event, AsyncEvent::LogoutRequested),
        other => panic!("no logout request: {other:?}"),
    }
    let logout = Pdu::LogoutRequest(LogoutRequest {
        immediate: true,
        reason: LogoutReason::CloseSession,
        initiator_task_tag: 9,
        cid: 1,
        cmd_sn: SerialNumber(i.cmd_sn),
        ..LogoutRequest::default()
    });
    i.send(&logout, IserHeader::default());
    assert!(matches!(i.recv(), Some(Pdu::LogoutResponse(_))));
    stopping.join().expect("the daemon stops");
}
