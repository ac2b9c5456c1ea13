//! A minimal iSER initiator on the software fabric for tests: connects to a daemon's iSER
//! portal on a [`Switch`] with the iSER CM header, logs in with iscsi-pdu's initiator login,
//! and runs commands one at a time with its buffers named in iSER headers (the target moves
//! the data by RDMA READ and WRITE).

use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::{Bytes, BytesMut};
use iscsi_pdu::chap::ENTROPY_LEN;
use iscsi_pdu::initiator::{Established, Login, LoginError};
use iscsi_pdu::iser::{self, CmReply, CmRequest, IserHeader, RemoteBuffer};
use iscsi_pdu::negotiation::{Declarations, DigestAlgorithm, OperationalParams, Settings};
use iscsi_pdu::{Isid, Lun, Pdu, ScsiCommand, ScsiResponse, SerialNumber};
use rdma::fabric::{Access, MemoryId, MemoryRegion, NodeId, QpId};
use rdma::switch::{Endpoint, Reply, Switch};
use rdma::verbs::{Verbs, WorkOp, MESSAGE_BUFFER_LEN};

use super::{config, Daemon, TARGET};

pub const TARGET_NODE: NodeId = NodeId(0);
pub const INITIATOR_NODE: NodeId = NodeId(1);
pub const SERVICE: &str = "iser0";
pub const INITIATOR: &str = "iqn.2026-11.io.example:iser-initiator";
/// The initiator's memory: data-out in the first half, data-in in the second.
pub const MEMORY: usize = 8 << 20;
pub const DATA_IN: usize = MEMORY / 2;
pub const WAIT: Duration = Duration::from_secs(10);

/// The daemon serving iSER on a new switch: a target with a 64 MiB file LUN 0.
pub fn daemon() -> (Arc<Switch>, Daemon) {
    daemon_with(|text| text)
}

/// As [`daemon`], its config text changed by `edit` first.
pub fn daemon_with(edit: impl FnOnce(String) -> String) -> (Arc<Switch>, Daemon) {
    let switch = Switch::new();
    let targets = format!(
        "[[targets]]\nname = \"{TARGET}\"\n\
         [[targets.luns]]\nlun = 0\nbackend = \"file\"\npath = \"@DIR@/lun0.img\"\nsize = \"64MiB\"\n"
    );
    let d = Daemon::start_with(&edit(config("", &targets)), |server| {
        server
            .serve_iser_fabric(&switch, TARGET_NODE, SERVICE)
            .expect("the service is free");
    });
    (switch, d)
}

/// What Linux's iSER initiator offers: RDMAExtensions, no digests, 8 KiB each way.
pub fn settings(rdma: bool) -> Settings {
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
pub struct Initiator {
    pub switch: Arc<Switch>,
    pub verbs: Endpoint<Vec<u8>>,
    pub qp: QpId,
    pub memory: MemoryId,
    pub region: MemoryRegion,
    pub cmd_sn: u32,
    /// The last byte of the ISID its login uses: initiators that log in at once differ here,
    /// or the second login reinstates the first's session.
    pub isid: u8,
    pub itt: u32,
}

/// Connects a queue pair to the daemon's iSER service with the iSER CM request, as Linux's
/// initiator does; the daemon accepts it with the default CM reply.
pub fn connect_queue_pair(switch: &Arc<Switch>) -> QpId {
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
    qp
}

impl Initiator {
    pub fn connect(switch: &Arc<Switch>) -> Initiator {
        let qp = connect_queue_pair(switch);
        let mut verbs: Endpoint<Vec<u8>> = switch.endpoint(INITIATOR_NODE);
        for _ in 0..16 {
            verbs.post_recv(qp, 0, vec![0; MESSAGE_BUFFER_LEN]);
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
            isid: 1,
            itt: 0,
        }
    }

    pub fn send(&mut self, pdu: &Pdu, header: IserHeader) {
        let mut m = BytesMut::new();
        iser::encode(pdu, &header, &mut m);
        let n = m.len();
        self.verbs.post_send(self.qp, 1, m.to_vec(), n);
    }

    /// The next PDU the target sent; `None` once the queue pair is gone.
    pub fn recv(&mut self) -> Option<Pdu> {
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

    pub fn login(&mut self, settings: Settings) -> Result<Established, LoginError> {
        let isid = Isid([0x80, 0, 0, 0, 0x1e, self.isid]);
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
    pub fn command(
        &mut self,
        cdb: &[u8],
        data_out: Option<&[u8]>,
        imm: usize,
        data_in: usize,
    ) -> (ScsiResponse, Vec<u8>) {
        self.command_extended(cdb, None, data_out, imm, data_in)
    }

    /// [`Self::command`] with the CDB's bytes beyond 16 in an extended-CDB AHS.
    pub fn command_extended(
        &mut self,
        cdb: &[u8],
        extended_cdb: Option<Bytes>,
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
            extended_cdb,
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
