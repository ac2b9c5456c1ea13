//! A minimal SRP initiator on the software fabric for tests that need SRP paths beside their
//! own subject (a cluster of gateways): one channel to one service, commands one at a time
//! with direct descriptors into memory registered once. tests/srp.rs has the thorough one.

use std::sync::Arc;
use std::time::{Duration, Instant};

use rdma::fabric::{Access, MemoryId, MemoryRegion, NodeId, QpId};
use rdma::switch::{Endpoint, Reply, Switch};
use rdma::verbs::{Verbs, WorkOp};
use srp::iu::{
    BufferFormats, DataBufferDescriptor, Iu, MultiChannelAction, SrpAerRsp, SrpCmd, SrpCredRsp,
    SrpLoginReq, TaskAttribute,
};

/// The initiator's memory: data-out in the first half, data-in in the second.
const MEMORY: usize = 2 << 20;
const DATA_IN: usize = MEMORY / 2;
const WAIT: Duration = Duration::from_secs(10);

/// What a command's SRP_RSP said, with the data-in.
#[derive(Debug)]
pub struct SrpAnswer {
    pub status: u8,
    pub sense: Vec<u8>,
    pub data: Vec<u8>,
}

impl SrpAnswer {
    /// The sense key, when there is sense.
    pub fn sense_key(&self) -> Option<u8> {
        (self.sense.len() > 2).then(|| self.sense[2] & 0x0f)
    }
}

/// One logged-in channel.
pub struct SrpClient {
    switch: Arc<Switch>,
    verbs: Endpoint<Vec<u8>>,
    qp: QpId,
    memory: MemoryId,
    region: MemoryRegion,
    max_ti_iu_len: usize,
    next_tag: u64,
}

impl SrpClient {
    /// Logs initiator port `port`, as switch node `node`, in to target `target` served at
    /// `service`.
    pub fn login(
        switch: &Arc<Switch>,
        node: NodeId,
        service: &str,
        target: &str,
        port: [u8; 16],
    ) -> SrpClient {
        let req = SrpLoginReq {
            tag: 7,
            req_it_iu_len: 48 + 20 + 16 * 16,
            req_buf_fmt: BufferFormats::BOTH,
            multi_channel: MultiChannelAction::SingleChannel,
            initiator_port_id: port,
            target_port_id: targetd::srp::port_id(target),
            ..SrpLoginReq::default()
        };
        let mut b = Vec::new();
        req.encode(&mut b);
        let id = switch
            .connect(node, service, &b)
            .expect("the daemon listens");
        let deadline = Instant::now() + WAIT;
        let reply = loop {
            if let Some(r) = switch.reply(id) {
                break r;
            }
            assert!(Instant::now() < deadline, "no answer to the login");
            std::thread::sleep(Duration::from_millis(1));
        };
        let Reply::Accepted { qp, private } = reply else {
            panic!("the login was refused: {reply:?}");
        };
        let Ok(Iu::LoginRsp(rsp)) = Iu::decode(&private) else {
            panic!("not an SRP_LOGIN_RSP");
        };
        let mut verbs: Endpoint<Vec<u8>> = switch.endpoint(node);
        for _ in 0..rsp.req_lim_delta + 4 {
            verbs.post_recv(qp, 0, vec![0; rsp.max_ti_iu_len as usize]);
        }
        let (memory, region) = switch.with(|f| {
            let m = f.alloc(node, MEMORY);
            (m, f.register(m, 0, MEMORY, Access::REMOTE))
        });
        SrpClient {
            switch: switch.clone(),
            verbs,
            qp,
            memory,
            region,
            max_ti_iu_len: rsp.max_ti_iu_len as usize,
            next_tag: 100,
        }
    }

    /// Runs a command on LUN index `lun`: `data_out` from memory, or `data_in` bytes back.
    pub fn command(
        &mut self,
        lun: u64,
        cdb: &[u8],
        data_out: Option<&[u8]>,
        data_in: usize,
    ) -> SrpAnswer {
        self.next_tag += 1;
        let tag = self.next_tag;
        let (out, inn) = match data_out {
            Some(data) => {
                self.switch
                    .with(|f| f.memory_mut(self.memory)[..data.len()].copy_from_slice(data));
                let d = self.region.remote(0, data.len() as u32).into();
                (DataBufferDescriptor::Direct(d), DataBufferDescriptor::None)
            }
            None if data_in > 0 => {
                let d = self.region.remote(DATA_IN as u32, data_in as u32).into();
                (DataBufferDescriptor::None, DataBufferDescriptor::Direct(d))
            }
            None => (DataBufferDescriptor::None, DataBufferDescriptor::None),
        };
        let cmd = SrpCmd {
            sol_not: 0,
            tag,
            lun: lun << 48,
            task_attribute: TaskAttribute::Simple,
            cdb,
            data_out: out,
            data_in: inn,
        };
        let mut b = Vec::new();
        cmd.encode(&mut b);
        let n = b.len();
        self.verbs.post_send(self.qp, 1, b, n);
        let mut answer = self.answer(tag);
        if data_out.is_none() && data_in > 0 {
            answer.data = self
                .switch
                .with(|f| f.memory(self.memory)[DATA_IN..DATA_IN + data_in].to_vec());
        }
        answer
    }

    /// Runs a command until it is past the unit attentions the nexus has pending.
    pub fn past_attentions(
        &mut self,
        lun: u64,
        cdb: &[u8],
        data_out: Option<&[u8]>,
        data_in: usize,
    ) -> SrpAnswer {
        for _ in 0..8 {
            let a = self.command(lun, cdb, data_out, data_in);
            if a.sense_key() != Some(0x6) {
                return a;
            }
        }
        panic!("unit attentions never end");
    }

    /// Waits for the SRP_RSP of `tag`, answering the target's own requests meanwhile.
    fn answer(&mut self, tag: u64) -> SrpAnswer {
        let deadline = Instant::now() + WAIT;
        loop {
            while let Some(wc) = self.verbs.poll(self.qp) {
                assert!(wc.result.is_ok(), "{:?} failed: {:?}", wc.op, wc.result);
                if wc.op != WorkOp::Recv {
                    continue;
                }
                let mut found = None;
                match Iu::decode(&wc.buffer[..wc.len]) {
                    Ok(Iu::Rsp(r)) if r.tag == tag => {
                        found = Some(SrpAnswer {
                            status: r.status,
                            sense: r.sense.to_vec(),
                            data: Vec::new(),
                        });
                    }
                    Ok(Iu::CredReq(r)) => {
                        let mut b = Vec::new();
                        SrpCredRsp { tag: r.tag }.encode(&mut b);
                        let n = b.len();
                        self.verbs.post_send(self.qp, 2, b, n);
                    }
                    Ok(Iu::AerReq(r)) => {
                        let mut b = Vec::new();
                        SrpAerRsp { tag: r.tag }.encode(&mut b);
                        let n = b.len();
                        self.verbs.post_send(self.qp, 2, b, n);
                    }
                    _ => {}
                }
                let mut buffer = wc.buffer;
                buffer.resize(self.max_ti_iu_len, 0);
                self.verbs.post_recv(self.qp, 0, buffer);
                if let Some(a) = found {
                    return a;
                }
            }
            assert!(Instant::now() < deadline, "no SRP_RSP for tag {tag:#x}");
            std::thread::sleep(Duration::from_millis(1));
        }
    }
}
