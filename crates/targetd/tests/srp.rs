//! targetd's SRP port end to end over the software fabric: the daemon serves SRP on a
//! [`Switch`] (its port on a reactor, data in the reactor's arena, file units through its
//! engine) and a small initiator on another thread logs in, reads and writes with direct and
//! 32-region indirect descriptors, sees what iSCSI wrote and the other way round, is refused
//! with the standard's reasons, logs out and is logged out when the daemon stops.

mod common;

use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{config, Daemon, TARGET};
use rdma::fabric::{Access, MemoryId, MemoryRegion, NodeId, QpId};
use rdma::switch::{Endpoint, Reply, Switch};
use rdma::verbs::{Verbs, WorkOp};
use scsi_core::Residual;
use srp::iu::{
    BufferFormats, DataBufferDescriptor, Descriptors, Iu, LoginRejectReason, MemoryDescriptor,
    MultiChannelAction, SrpAerRsp, SrpCmd, SrpCredRsp, SrpILogout, SrpLoginRej, SrpLoginReq,
    SrpLoginRsp, TargetLogoutReason, TaskAttribute,
};

const TARGET_NODE: NodeId = NodeId(0);
const INITIATOR_NODE: NodeId = NodeId(1);
const SERVICE: &str = "srp0";
const PORT_A: [u8; 16] = *b"srp-initiator--A";
const PORT_B: [u8; 16] = *b"srp-initiator--B";
/// The initiator's memory: 32 places of 256 KiB, the first for data, the last for tables.
const MEMORY: usize = 8 << 20;
const WAIT: Duration = Duration::from_secs(10);

/// The daemon serving SRP on a new switch: a target with a 64 MiB file LUN 0 and a 16 MiB
/// memory LUN 1, and a second target that admits one SRP initiator port only.
fn daemon() -> (Arc<Switch>, Daemon) {
    let switch = Switch::new();
    let targets = format!(
        "[[targets]]\nname = \"{TARGET}\"\n\
         [[targets.luns]]\nlun = 0\nbackend = \"file\"\npath = \"@DIR@/lun0.img\"\nsize = \"64MiB\"\n\
         [[targets.luns]]\nlun = 1\nbackend = \"memory\"\nsize = \"16MiB\"\nblock_size = 4096\n\n\
         [[targets]]\nname = \"{TARGET}-only-b\"\nsrp_initiators = [\"{}\"]\n\
         [[targets.luns]]\nlun = 0\nbackend = \"memory\"\nsize = \"1MiB\"\n",
        targetd::srp::hex(&PORT_B)
    );
    let d = Daemon::start_with(&config("", &targets), |server| {
        server
            .serve_srp_fabric(&switch, TARGET_NODE, SERVICE)
            .expect("the service is free");
    });
    (switch, d)
}

/// What a command's SRP_RSP said, and the data-in that reached the initiator's memory.
#[derive(Debug)]
struct Answer {
    status: u8,
    sense: Vec<u8>,
    /// Response data (a task management function's answer).
    response: Vec<u8>,
    data_in_residual: Residual,
    data: Vec<u8>,
}

impl Answer {
    fn sense_key(&self) -> Option<u8> {
        (self.sense.len() > 2).then(|| self.sense[2] & 0x0f)
    }
}

/// A minimal SRP initiator on the switch: one channel, its memory registered once.
struct Initiator {
    switch: Arc<Switch>,
    verbs: Endpoint<Vec<u8>>,
    qp: QpId,
    memory: MemoryId,
    region: MemoryRegion,
    credit: i64,
    next_tag: u64,
    max_ti_iu_len: usize,
    /// SRP_T_LOGOUT received, and why.
    logged_out: Option<TargetLogoutReason>,
    /// Indirect descriptors carry only the first region in the IU: the target fetches the
    /// table by RDMA READ.
    partial: bool,
}

fn request(target: &str, port: [u8; 16]) -> SrpLoginReq {
    SrpLoginReq {
        tag: 7,
        req_it_iu_len: 48 + 20 + 32 * 16,
        req_buf_fmt: BufferFormats::BOTH,
        multi_channel: MultiChannelAction::SingleChannel,
        initiator_port_id: port,
        target_port_id: targetd::srp::port_id(target),
        ..SrpLoginReq::default()
    }
}

/// Sends a login request and waits for the answer.
fn connect(switch: &Arc<Switch>, req: &SrpLoginReq) -> Reply {
    let mut b = Vec::new();
    req.encode(&mut b);
    let id = switch
        .connect(INITIATOR_NODE, SERVICE, &b)
        .expect("the daemon listens");
    let deadline = Instant::now() + WAIT;
    loop {
        if let Some(r) = switch.reply(id) {
            return r;
        }
        assert!(Instant::now() < deadline, "no answer to the login");
        std::thread::sleep(Duration::from_millis(1));
    }
}

fn rejected(reply: Reply) -> LoginRejectReason {
    let Reply::Rejected(private) = reply else {
        panic!("accepted: {reply:?}");
    };
    match Iu::decode(&private) {
        Ok(Iu::LoginRej(SrpLoginRej { reason, .. })) => reason,
        other => panic!("not an SRP_LOGIN_REJ: {other:?}"),
    }
}

impl Initiator {
    fn login(switch: &Arc<Switch>, req: &SrpLoginReq) -> (Initiator, SrpLoginRsp) {
        let reply = connect(switch, req);
        let Reply::Accepted { qp, private } = reply else {
            panic!("refused: {:?}", rejected(reply));
        };
        let Ok(Iu::LoginRsp(rsp)) = Iu::decode(&private) else {
            panic!("not an SRP_LOGIN_RSP");
        };
        let mut verbs: Endpoint<Vec<u8>> = switch.endpoint(INITIATOR_NODE);
        for _ in 0..rsp.req_lim_delta + 4 {
            verbs.post_recv(qp, 0, vec![0; rsp.max_ti_iu_len as usize]);
        }
        let (memory, region) = switch.with(|f| {
            let m = f.alloc(INITIATOR_NODE, MEMORY);
            (m, f.register(m, 0, MEMORY, Access::REMOTE))
        });
        let me = Initiator {
            switch: switch.clone(),
            verbs,
            qp,
            memory,
            region,
            credit: i64::from(rsp.req_lim_delta),
            next_tag: 100,
            max_ti_iu_len: rsp.max_ti_iu_len as usize,
            logged_out: None,
            partial: false,
        };
        (me, rsp)
    }

    /// The descriptor of `len` bytes as `regions` regions of the data place, each in a 8 KiB
    /// stride (so they lie apart), in reverse order when more than one; with a table at the
    /// end of memory for an indirect one.
    fn describe(&mut self, len: usize, regions: usize) -> (Vec<(usize, usize)>, Vec<u8>) {
        if regions == 1 {
            return (vec![(0, len)], Vec::new());
        }
        let each = len / regions;
        let places: Vec<(usize, usize)> = (0..regions)
            .rev()
            .map(|i| (i * (each + 8192), each))
            .collect();
        let mut table = Vec::new();
        for &(offset, n) in &places {
            MemoryDescriptor::from(self.region.remote(offset as u32, n as u32)).encode(&mut table);
        }
        (places, table)
    }

    /// Runs a command: data-out from memory, data-in gathered back from it.
    fn command(
        &mut self,
        lun: u64,
        cdb: &[u8],
        data_out: Option<&[u8]>,
        data_in: usize,
        regions: usize,
    ) -> Answer {
        self.next_tag += 1;
        let tag = self.next_tag;
        let len = data_out.map_or(data_in, <[u8]>::len);
        let (places, table) = self.describe(len, regions);
        if let Some(data) = data_out {
            self.switch.with(|f| {
                let m = f.memory_mut(self.memory);
                let mut at = 0;
                for &(offset, n) in &places {
                    m[offset..offset + n].copy_from_slice(&data[at..at + n]);
                    at += n;
                }
            });
        }
        let table_at = MEMORY - 64 * 1024;
        let descriptor = match (len, regions) {
            (0, _) => DataBufferDescriptor::None,
            (_, 1) => DataBufferDescriptor::Direct(self.region.remote(0, len as u32).into()),
            _ => {
                self.switch.with(|f| {
                    f.memory_mut(self.memory)[table_at..table_at + table.len()]
                        .copy_from_slice(&table)
                });
                let in_iu = if self.partial {
                    &table[..16]
                } else {
                    &table[..]
                };
                DataBufferDescriptor::Indirect {
                    table: self
                        .region
                        .remote(table_at as u32, table.len() as u32)
                        .into(),
                    total_len: len as u32,
                    partial: Descriptors::new(in_iu).expect("16-byte descriptors"),
                }
            }
        };
        let (out, inn) = match data_out {
            Some(_) => (descriptor, DataBufferDescriptor::None),
            None => (DataBufferDescriptor::None, descriptor),
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
        assert!(self.credit > 0, "a credit to send with");
        self.credit -= 1;
        let n = b.len();
        self.verbs.post_send(self.qp, 1, b, n);
        let answer = self.answer(tag);
        let data = match data_out {
            Some(_) => Vec::new(),
            None => self.switch.with(|f| {
                let m = f.memory(self.memory);
                places
                    .iter()
                    .flat_map(|&(offset, n)| m[offset..offset + n].to_vec())
                    .collect()
            }),
        };
        Answer { data, ..answer }
    }

    /// Waits for the SRP_RSP of `tag`, answering the target's own requests meanwhile.
    fn answer(&mut self, tag: u64) -> Answer {
        let deadline = Instant::now() + WAIT;
        loop {
            while let Some(wc) = self.verbs.poll(self.qp) {
                assert!(wc.result.is_ok(), "{:?} failed: {:?}", wc.op, wc.result);
                if wc.op != WorkOp::Recv {
                    continue;
                }
                let mut found = None;
                match Iu::decode(&wc.buffer[..wc.len]) {
                    Ok(Iu::Rsp(r)) => {
                        self.credit += i64::from(r.req_lim_delta);
                        if r.tag == tag {
                            found = Some(Answer {
                                status: r.status,
                                sense: r.sense.to_vec(),
                                response: r.response_data.to_vec(),
                                data_in_residual: r.data_in_residual,
                                data: Vec::new(),
                            });
                        }
                    }
                    Ok(Iu::CredReq(r)) => {
                        self.credit += i64::from(r.req_lim_delta);
                        let mut b = Vec::new();
                        SrpCredRsp { tag: r.tag }.encode(&mut b);
                        let n = b.len();
                        self.verbs.post_send(self.qp, 2, b, n);
                    }
                    // A unit attention reported at once (a LOGICAL UNIT RESET's, say):
                    // answered, and heard on the next command as well.
                    Ok(Iu::AerReq(r)) => {
                        self.credit += i64::from(r.req_lim_delta);
                        let mut b = Vec::new();
                        SrpAerRsp { tag: r.tag }.encode(&mut b);
                        let n = b.len();
                        self.verbs.post_send(self.qp, 2, b, n);
                    }
                    Ok(Iu::TLogout(t)) => self.logged_out = Some(t.reason),
                    other => panic!("the target sent {other:?}"),
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

    /// Logs `port` in to the test target and takes the new nexus's unit attentions.
    fn ready(switch: &Arc<Switch>, port: [u8; 16]) -> Initiator {
        let (mut i, _) = Initiator::login(switch, &request(TARGET, port));
        i.good(0, &TUR, None, 0, 1);
        i
    }

    /// Sends raw bytes as an IU (taking a credit) and waits for the answer to `tag`.
    fn raw(&mut self, iu: &[u8], tag: u64) -> Answer {
        self.credit -= 1;
        self.verbs.post_send(self.qp, 4, iu.to_vec(), iu.len());
        self.answer(tag)
    }

    /// Runs a command until it is past the new nexus's unit attentions.
    fn good(
        &mut self,
        lun: u64,
        cdb: &[u8],
        data_out: Option<&[u8]>,
        data_in: usize,
        regions: usize,
    ) -> Answer {
        for _ in 0..4 {
            let a = self.command(lun, cdb, data_out, data_in, regions);
            if a.sense_key() != Some(0x6) {
                assert_eq!(a.status, 0, "sense {:02x?}", a.sense);
                return a;
            }
        }
        panic!("unit attentions never end");
    }

    /// Waits until the target logs the channel out or disconnects it.
    fn wait_for_logout(&mut self) -> Option<TargetLogoutReason> {
        let deadline = Instant::now() + WAIT;
        loop {
            // What arrived before a disconnection is still there to take.
            let lost = self.verbs.is_error(self.qp);
            while let Some(wc) = self.verbs.poll(self.qp) {
                if wc.op == WorkOp::Recv && wc.result.is_ok() {
                    if let Ok(Iu::TLogout(t)) = Iu::decode(&wc.buffer[..wc.len]) {
                        self.logged_out = Some(t.reason);
                    }
                }
            }
            if self.logged_out.is_some() || lost {
                return self.logged_out;
            }
            assert!(Instant::now() < deadline, "never logged out");
            std::thread::sleep(Duration::from_millis(1));
        }
    }
}

/// TEST UNIT READY.
const TUR: [u8; 6] = [0; 6];

fn rw10(opcode: u8, lba: u32, blocks: u16) -> Vec<u8> {
    let mut c = vec![opcode, 0];
    c.extend_from_slice(&lba.to_be_bytes());
    c.push(0);
    c.extend_from_slice(&blocks.to_be_bytes());
    c.push(0);
    c
}

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31) ^ seed ^ (i >> 9) as u8)
        .collect()
}

/// Waits until `f` holds.
fn eventually(what: &str, mut f: impl FnMut() -> bool) {
    let deadline = Instant::now() + WAIT;
    while !f() {
        assert!(Instant::now() < deadline, "never: {what}");
        std::thread::sleep(Duration::from_millis(5));
    }
}

#[test]
fn reads_and_writes_over_srp_reach_file_and_memory_units_that_iscsi_shares() {
    let (switch, d) = daemon();
    let (mut i, rsp) = Initiator::login(&switch, &request(TARGET, PORT_A));
    assert_eq!(rsp.req_lim_delta, 128);
    // INQUIRY reaches the target's device, through its SRP port.
    let inquiry = i.good(0, &[0x12, 0, 0, 0, 96, 0], None, 96, 1);
    assert_eq!(&inquiry.data[8..16], b"TARGETD ");
    // 64 KiB on the file unit, direct descriptors, verified.
    let data = pattern(64 * 1024, 1);
    i.good(0, &rw10(0x2a, 2048, 128), Some(&data), 0, 1);
    let back = i.good(0, &rw10(0x28, 2048, 128), None, data.len(), 1);
    assert_eq!(back.data, data, "the file unit gives back what SRP wrote");
    // 128 KiB on the memory unit as 32 discrete 4 KiB regions, in an indirect table.
    let data = pattern(128 * 1024, 2);
    i.good(1, &rw10(0x2a, 64, 32), Some(&data), 0, 32);
    let back = i.good(1, &rw10(0x28, 64, 32), None, data.len(), 32);
    assert_eq!(back.data, data, "32 regions gathered in order");
    // A short buffer: the residual says what did not move.
    let short = i.good(1, &rw10(0x28, 64, 1), None, 8192, 1);
    assert_eq!(short.data_in_residual, Residual::Underflow(4096));
    // A write beyond the end: CHECK CONDITION, ILLEGAL REQUEST.
    let beyond = i.command(1, &rw10(0x2a, 4096, 1), Some(&[0; 4096]), 0, 1);
    assert_eq!((beyond.status, beyond.sense_key()), (2, Some(0x5)));
    // The channel is listed and counted.
    let channels = d.registry.srp_channels();
    assert_eq!(channels.len(), 1);
    let c = channels.values().next().expect("one");
    assert_eq!((c.target.as_str(), c.initiator_port_id), (TARGET, PORT_A));
    let metrics = targetd::metrics::text(&d.registry);
    assert!(metrics.contains("targetd_srp_channels 1"), "{metrics}");
    let sessions = targetd::admin::sessions_json(&d.registry);
    assert!(
        sessions.to_string().contains("\"transport\":\"srp\""),
        "{sessions}"
    );
    // iSCSI sees what SRP wrote, and SRP what iSCSI writes: one logical unit, two ports.
    let rt = tokio::runtime::Runtime::new().expect("runtime");
    let from_iscsi = rt.block_on(async {
        let s = d.session(common::opts()).await;
        let got = s.read(2048, 128, 512).await.expect("read over iSCSI");
        s.write(4096, pattern(4096, 3).into(), 512)
            .await
            .expect("write over iSCSI");
        s.logout().await.expect("logout");
        got
    });
    assert_eq!(&from_iscsi[..], &pattern(64 * 1024, 1)[..]);
    let back = i.good(0, &rw10(0x28, 4096, 8), None, 4096, 1);
    assert_eq!(back.data, pattern(4096, 3));
    // The initiator logs out; the channel ends and its nexus with it.
    let mut b = Vec::new();
    SrpILogout { tag: 9 }.encode(&mut b);
    let n = b.len();
    i.verbs.post_send(i.qp, 3, b, n);
    eventually("the channel ends", || d.registry.srp_channels().is_empty());
    d.stop();
}

#[test]
fn logins_are_refused_with_the_standards_reasons() {
    let (switch, d) = daemon();
    // No target has that port identifier.
    let unknown = request("iqn.2026-11.io.example:nobody", PORT_A);
    assert_eq!(
        rejected(connect(&switch, &unknown)),
        LoginRejectReason::UnableToEstablishChannel
    );
    // IUs longer than the port takes.
    let long = SrpLoginReq {
        req_it_iu_len: 1 << 20,
        ..request(TARGET, PORT_A)
    };
    assert_eq!(
        rejected(connect(&switch, &long)),
        LoginRejectReason::ItIuLengthTooLarge
    );
    // The second target admits port B only.
    let only_b = format!("{TARGET}-only-b");
    assert_eq!(
        rejected(connect(&switch, &request(&only_b, PORT_A))),
        LoginRejectReason::UnableToEstablishChannel
    );
    let (mut b, _) = Initiator::login(&switch, &request(&only_b, PORT_B));
    b.good(0, &TUR, None, 0, 1);
    // Not a login request at all.
    let id = switch
        .connect(INITIATOR_NODE, SERVICE, &[0x02; 36])
        .expect("listened");
    let deadline = Instant::now() + WAIT;
    let reply = loop {
        if let Some(r) = switch.reply(id) {
            break r;
        }
        assert!(Instant::now() < deadline);
        std::thread::sleep(Duration::from_millis(1));
    };
    assert!(matches!(reply, Reply::Rejected(_)));
    assert_eq!(
        d.registry
            .counters
            .srp_logins_rejected
            .load(std::sync::atomic::Ordering::Relaxed),
        4
    );
    // The channel refused nothing of the one that logged in.
    b.good(0, &TUR, None, 0, 1);
    d.stop();
}

#[test]
fn a_second_single_channel_login_replaces_the_first_and_a_lost_channel_ends() {
    let (switch, d) = daemon();
    let mut first = Initiator::ready(&switch, PORT_A);
    // The same initiator port logs in again, SINGLE CHANNEL: the first is logged out.
    let (mut second, rsp) = Initiator::login(&switch, &request(TARGET, PORT_A));
    assert_eq!(rsp.multi_channel, srp::iu::MultiChannelResult::Terminated);
    assert_eq!(
        first.wait_for_logout(),
        Some(TargetLogoutReason::MultiChannelAction)
    );
    second.good(1, &TUR, None, 0, 1);
    eventually("one channel left", || d.registry.srp_channels().len() == 1);
    // The initiator vanishes (its queue pair disconnected) with writes and reads in flight:
    // the channel ends all the same.
    for k in 0..16u32 {
        let place = second.region.remote(k * 256 * 1024, 256 * 1024).into();
        let (cdb, data_out, data_in) = if k % 2 == 0 {
            let d = DataBufferDescriptor::Direct(place);
            (rw10(0x2a, k * 512, 512), d, DataBufferDescriptor::None)
        } else {
            let d = DataBufferDescriptor::Direct(place);
            (rw10(0x28, k * 512, 512), DataBufferDescriptor::None, d)
        };
        let cmd = SrpCmd {
            tag: 1000 + u64::from(k),
            cdb: &cdb,
            data_out,
            data_in,
            ..SrpCmd::default()
        };
        let mut b = Vec::new();
        cmd.encode(&mut b);
        let n = b.len();
        second.verbs.post_send(second.qp, 6, b, n);
    }
    second.verbs.disconnect(second.qp);
    eventually("the lost channel ends", || {
        d.registry.srp_channels().is_empty()
    });
    d.stop();
}

#[test]
fn a_stopping_daemon_logs_srp_channels_out() {
    let (switch, d) = daemon();
    let mut i = Initiator::ready(&switch, PORT_A);
    let stopper = std::thread::spawn(move || d.stop());
    assert_eq!(i.wait_for_logout(), Some(TargetLogoutReason::NoReason));
    stopper.join().expect("the daemon drains");
    // The port no longer listens.
    assert!(switch
        .connect(INITIATOR_NODE, SERVICE, b"")
        .is_err_and(|e| e.to_string().contains("no target listens")));
}

/// initiator-bench's SRP runner (the one it runs on RDMA devices) against targetd over the
/// switch: random reads and writes at queue depth 16 on the file unit, each command 16
/// discrete regions, every read checked and every block written read back, for each way of
/// registering.
#[test]
fn initiator_bench_runs_verified_workloads_against_targetd() {
    use initiator_bench::srp::{login_request, place_len, run_channels, LinkModel, RdmaOptions};
    use initiator_bench::workload::{Rw, Workload};
    use srp::initiator::channel::InitiatorChannel;
    use srp::initiator::Registration;

    let (switch, d) = daemon();
    for (s, registration) in Registration::ALL.into_iter().enumerate() {
        let w = Workload {
            rw: Rw::Randrw,
            bs: 32 * 1024,
            qd: 16,
            sessions: 1,
            ios: Some(600),
            size: Some(4 << 20),
            verify: true,
            ..Workload::default()
        };
        let o = RdmaOptions {
            registration,
            regions: 16,
            link: LinkModel::Free,
            immediate_data: true,
        };
        let req = login_request(s, targetd::srp::port_id(TARGET), 8192);
        let Reply::Accepted { qp, private } = connect(&switch, &req) else {
            panic!("refused");
        };
        let Ok(Iu::LoginRsp(rsp)) = Iu::decode(&private) else {
            panic!("not an SRP_LOGIN_RSP");
        };
        let mut verbs: Endpoint<Vec<u8>> = switch.endpoint(INITIATOR_NODE);
        let ch = InitiatorChannel::new(&mut verbs, qp, &rsp, registration, 16, place_len(&w, &o))
            .expect("the channel's memory");
        let mut channels = [ch];
        let r = run_channels(&mut verbs, &mut channels, 0, &w, &o).expect("the run");
        assert_eq!((r.ios, r.errors), (600, 0), "{}", registration.name());
        assert!(r.verified_blocks > 0, "reads were checked");
        assert_eq!(r.verify_errors, 0, "{}", registration.name());
        channels[0].logout(&mut verbs).expect("logged out");
    }
    eventually("the channels end", || d.registry.srp_channels().is_empty());
    d.stop();
}

/// Linux's ib_srp's default login (8260-byte IUs, immediate data at offset 68) is accepted
/// with immediate data granted; verified small writes then carry their data in the SRP_CMD,
/// mixed with reads and with writes too large for the IU, which go by RDMA READ.
#[test]
fn linux_default_login_and_immediate_data_through_the_daemon() {
    use initiator_bench::srp::{
        login_request, place_len, run_channels, LinkModel, RdmaOptions, IMM_DATA_OFFSET,
    };
    use initiator_bench::workload::{Rw, Workload};
    use srp::initiator::channel::InitiatorChannel;
    use srp::initiator::Registration;

    let (switch, d) = daemon();
    let req = login_request(0, targetd::srp::port_id(TARGET), 8260);
    assert!(
        req.immediate_data && req.imm_data_offset == 68,
        "as ib_srp asks"
    );
    let Reply::Accepted { qp, private } = connect(&switch, &req) else {
        panic!("ib_srp's default login refused");
    };
    let Ok(Iu::LoginRsp(rsp)) = Iu::decode(&private) else {
        panic!("not an SRP_LOGIN_RSP");
    };
    assert!(rsp.immediate_data, "IMMEDIATE DATA SUPPORTED");
    assert_eq!(rsp.max_it_iu_len, 8260);
    let mut verbs: Endpoint<Vec<u8>> = switch.endpoint(INITIATOR_NODE);
    let o = RdmaOptions {
        registration: Registration::Pool,
        regions: 1,
        link: LinkModel::Free,
        immediate_data: true,
    };
    let mut total = 0;
    for bs in [4096, 8192, 16384] {
        let w = Workload {
            rw: Rw::Randrw,
            bs,
            qd: 8,
            sessions: 1,
            ios: Some(400),
            size: Some(4 << 20),
            verify: true,
            ..Workload::default()
        };
        let mut ch =
            InitiatorChannel::new(&mut verbs, qp, &rsp, o.registration, 8, place_len(&w, &o))
                .expect("the channel's memory");
        assert!(ch.use_immediate_data(IMM_DATA_OFFSET));
        assert_eq!(ch.immediate_data_limit(), 8192);
        let before = d.registry.counters.srp_immediate_writes.load(Relaxed);
        let mut channels = [ch];
        let r = run_channels(&mut verbs, &mut channels, 0, &w, &o).expect("the run");
        assert_eq!((r.ios, r.errors, r.verify_errors), (400, 0, 0), "{bs}");
        assert!(r.verified_blocks > 0);
        let immediate = d.registry.counters.srp_immediate_writes.load(Relaxed) - before;
        if bs <= 8192 {
            assert!(
                immediate > 100,
                "{bs}-byte writes as immediate data: {immediate}"
            );
        } else {
            assert_eq!(immediate, 0, "{bs}-byte writes do not fit in the IU");
        }
        total += immediate;
        // The next size runs on the same queue pair, its memory made anew.
        let [ch] = channels;
        drop(ch);
    }
    let metrics = targetd::metrics::text(&d.registry);
    assert!(
        metrics.contains(&format!("targetd_srp_immediate_writes_total {total}")),
        "{metrics}"
    );
    d.stop();
}

/// Through the daemon: `lun resize` reaches a logged-in SRP initiator at once, as an
/// SRP_AER_REQ with CAPACITY DATA HAS CHANGED, before it sends any command.
#[test]
fn a_resize_reaches_the_srp_initiator_as_an_asynchronous_event() {
    use initiator_bench::srp::login_request;
    use srp::initiator::channel::InitiatorChannel;
    use srp::initiator::Registration;

    let (switch, d) = daemon();
    let req = login_request(0, targetd::srp::port_id(TARGET), 8260);
    let Reply::Accepted { qp, private } = connect(&switch, &req) else {
        panic!("refused");
    };
    let Ok(Iu::LoginRsp(rsp)) = Iu::decode(&private) else {
        panic!("not an SRP_LOGIN_RSP");
    };
    let mut verbs: Endpoint<Vec<u8>> = switch.endpoint(INITIATOR_NODE);
    let mut ch = InitiatorChannel::new(&mut verbs, qp, &rsp, Registration::Pool, 2, 4096)
        .expect("the channel's memory");
    let resize = targetd::admin::AdminRequest::LunResize {
        target: TARGET.into(),
        lun: 1,
        size: "32MiB".into(),
        force: false,
    };
    targetd::admin::handle(&d.registry, resize).expect("resized");
    let mut events = Vec::new();
    eventually("the SRP_AER_REQ", || {
        assert!(ch.poll(&mut verbs).is_none(), "no command was sent");
        events.extend(ch.take_events());
        !events.is_empty()
    });
    assert_eq!(events.len(), 1, "{events:?}");
    let e = &events[0];
    assert_eq!(e.lun, 1 << 48);
    assert_eq!(
        (e.sense[0], e.sense[2] & 0xf, e.sense[12], e.sense[13]),
        (0x70, 6, 0x2a, 0x09),
        "UNIT ATTENTION, CAPACITY DATA HAS CHANGED"
    );
    d.stop();
}

/// Through the daemon: a descriptor table the target must fetch (into its arena), a
/// LOGICAL UNIT RESET answered through the core's routing, and malformed IUs answered on one
/// channel while another goes on.
#[test]
fn partial_tables_task_management_and_malformed_ius_through_the_daemon() {
    use srp::iu::{SrpTskMgmt, TaskManagementFunction};

    let (switch, d) = daemon();
    let mut a = Initiator::ready(&switch, PORT_A);
    let mut b = Initiator::ready(&switch, PORT_B);
    // 32 regions, only the first in the IU: the target reads the table, then the data.
    a.partial = true;
    let data = pattern(128 * 1024, 4);
    a.good(0, &rw10(0x2a, 512, 256), Some(&data), 0, 32);
    let back = a.good(0, &rw10(0x28, 512, 256), None, data.len(), 32);
    assert_eq!(back.data, data, "written and read through fetched tables");
    a.partial = false;
    // LOGICAL UNIT RESET of LUN 1: answered FUNCTION COMPLETE; the other nexus hears of it.
    let mut tmf = Vec::new();
    SrpTskMgmt {
        sol_not: 0,
        tag: 77,
        lun: 1 << 48,
        function: TaskManagementFunction::LogicalUnitReset,
        task_tag: 0,
    }
    .encode(&mut tmf);
    let answer = a.raw(&tmf, 77);
    assert_eq!(
        answer.response.get(3),
        Some(&0),
        "FUNCTION COMPLETE: {answer:?}"
    );
    let ua = b.command(1, &TUR, None, 0, 1);
    assert_eq!(
        (ua.status, ua.sense_key()),
        (2, Some(0x6)),
        "the other nexus gets a unit attention after the reset"
    );
    // A reserved task attribute: CHECK CONDITION, INVALID FIELD IN COMMAND INFORMATION UNIT.
    let mut cmd = Vec::new();
    SrpCmd {
        tag: 78,
        cdb: &rw10(0x28, 0, 1),
        ..SrpCmd::default()
    }
    .encode(&mut cmd);
    cmd[29] = 3;
    let bad = b.raw(&cmd, 78);
    assert_eq!(bad.status, 2);
    assert_eq!((bad.sense[12], bad.sense[13]), (0x0e, 0x03));
    // An SRP_AER_RSP to an SRP_AER_REQ never sent: the channel is logged out; A goes on.
    b.verbs.post_send(b.qp, 5, vec![0x41; 64], 64);
    assert_eq!(
        b.wait_for_logout(),
        Some(TargetLogoutReason::UnexpectedResponse)
    );
    let back = a.good(0, &rw10(0x28, 512, 256), None, data.len(), 1);
    assert_eq!(back.data, data);
    eventually("B's channel ends", || d.registry.srp_channels().len() == 1);
    d.stop();
}
