//! A scripted iSCSI target for byte-level tests of the initiator: `iscsi-pdu` in the target role
//! over a RAM disk, with knobs to misbehave. Deliberately small; the real target is targetd.

#![allow(dead_code)]

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use bytes::{Bytes, BytesMut};
use iscsi_pdu::chap::ENTROPY_LEN;
use iscsi_pdu::negotiation::{
    Declarations, Negotiator, OperationalParams, Role, SessionType, Settings,
};
use iscsi_pdu::text::{TextParams, TextReassembler};
use iscsi_pdu::*;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

pub const TARGET: &str = "iqn.2026-11.io.example:scripted";

/// How the target breaks the protocol, for tests of the initiator's defences.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Misbehave {
    None,
    /// The second Data-In of a read skips a DataSN.
    WrongDataSn,
    /// A Data-In lands beyond the command's buffer.
    OffsetBeyondBuffer,
    /// A Data-In carries more than the initiator's MaxRecvDataSegmentLength.
    OversizedPdu,
}

#[derive(Debug, Clone)]
pub struct Config {
    pub settings: Settings,
    pub blocks: u64,
    pub block_size: u32,
    pub misbehave: Misbehave,
    /// CmdSN window granted (MaxCmdSN - ExpCmdSN + 1).
    pub window: u32,
    /// Send a NOP-In ping after login.
    pub ping: bool,
    /// Close the connection after this many SCSI commands.
    pub drop_after: Option<usize>,
    /// Never answer READs (for task management tests).
    pub hold_reads: bool,
    /// Answer every READ with CHECK CONDITION, MEDIUM ERROR / UNRECOVERED READ ERROR, as a
    /// failing disk would.
    pub fail_reads: bool,
}

impl Default for Config {
    fn default() -> Self {
        let settings = Settings {
            declarations: Declarations {
                target_portal_group_tag: Some(1),
                ..Declarations::default()
            },
            max_recv_data_segment_length: 8192,
            operational: OperationalParams {
                max_burst_length: 65536,
                first_burst_length: 16384,
                initial_r2t: false,
                max_outstanding_r2t: 4,
                max_connections: 4,
                ..OperationalParams::default()
            },
            ..Settings::default()
        };
        Config {
            settings,
            blocks: 4096,
            block_size: 512,
            misbehave: Misbehave::None,
            window: 32,
            ping: false,
            drop_after: None,
            hold_reads: false,
            fail_reads: false,
        }
    }
}

#[derive(Debug, Default)]
pub struct Observed {
    /// The session-wide keys the leading connection agreed; later connections use them.
    pub session: Mutex<Option<OperationalParams>>,
    pub pong: AtomicBool,
    pub logins: AtomicUsize,
    pub commands: AtomicUsize,
    pub max_r2ts_outstanding: AtomicUsize,
    /// Connections that have ended.
    pub closed: AtomicUsize,
}

pub struct ScriptedTarget {
    pub addr: SocketAddr,
    pub observed: Arc<Observed>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for ScriptedTarget {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl ScriptedTarget {
    pub async fn start(config: Config) -> ScriptedTarget {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let disk = Arc::new(Mutex::new(vec![
            0u8;
            (config.blocks * u64::from(config.block_size))
                as usize
        ]));
        let observed = Arc::new(Observed::default());
        let obs = observed.clone();
        let task = tokio::spawn(async move {
            while let Ok((stream, _)) = listener.accept().await {
                let (c, d, o) = (config.clone(), disk.clone(), obs.clone());
                tokio::spawn(async move {
                    let result = Conn::new(stream, c, d, o.clone(), addr).serve().await;
                    o.closed.fetch_add(1, Ordering::SeqCst);
                    if let Err(e) = result {
                        if std::env::var_os("SCRIPTED_TARGET_LOG").is_some() {
                            eprintln!("scripted target: connection ended: {e}");
                        }
                    }
                });
            }
        });
        ScriptedTarget {
            addr,
            observed,
            task,
        }
    }

    pub fn url(&self) -> String {
        format!("iscsi://{}/{TARGET}/0", self.addr)
    }
}

/// A write being received.
struct Write {
    lba: u64,
    data: Vec<u8>,
    received: u32,
    next_offset: u32,
    r2ts: u32,
    outstanding: usize,
    lun: Lun,
}

struct Conn {
    stream: TcpStream,
    deframer: Deframer,
    config: Config,
    disk: Arc<Mutex<Vec<u8>>>,
    observed: Arc<Observed>,
    addr: SocketAddr,
    stat_sn: SerialNumber,
    exp_cmd_sn: SerialNumber,
    digests: Digests,
    send_max: u32,
    writes: HashMap<u32, Write>,
    next_ttt: u32,
    commands: usize,
    burst: u32,
    first_burst: u32,
    max_r2t: usize,
    immediate_data: bool,
    initial_r2t: bool,
}

type R = Result<(), String>;

impl Conn {
    fn new(
        stream: TcpStream,
        config: Config,
        disk: Arc<Mutex<Vec<u8>>>,
        observed: Arc<Observed>,
        addr: SocketAddr,
    ) -> Conn {
        Conn {
            stream,
            deframer: Deframer::new(),
            config,
            disk,
            observed,
            addr,
            stat_sn: SerialNumber(1),
            exp_cmd_sn: SerialNumber(0),
            digests: Digests::NONE,
            send_max: 8192,
            writes: HashMap::new(),
            next_ttt: 1,
            commands: 0,
            burst: 0,
            first_burst: 0,
            max_r2t: 1,
            immediate_data: true,
            initial_r2t: true,
        }
    }

    async fn recv(&mut self) -> Result<Pdu, String> {
        loop {
            match self.deframer.next_pdu() {
                Ok(Some(p)) => return Ok(p),
                Ok(None) => {}
                Err(e) => return Err(e.to_string()),
            }
            let need = self.deframer.needed().max(4096);
            self.deframer.buffer_mut().reserve(need);
            if self
                .stream
                .read_buf(self.deframer.buffer_mut())
                .await
                .map_err(|e| e.to_string())?
                == 0
            {
                return Err("closed".into());
            }
        }
    }

    async fn send(&mut self, pdu: Pdu) -> R {
        let mut b = BytesMut::new();
        pdu.encode(self.digests, &mut b);
        self.stream.write_all(&b).await.map_err(|e| e.to_string())
    }

    fn max_cmd_sn(&self) -> SerialNumber {
        self.exp_cmd_sn + (self.config.window - 1)
    }

    fn next_stat_sn(&mut self) -> SerialNumber {
        let s = self.stat_sn;
        self.stat_sn = s.next();
        s
    }

    async fn serve(mut self) -> R {
        self.login().await?;
        self.observed.logins.fetch_add(1, Ordering::SeqCst);
        if self.config.ping {
            let ping = NopIn {
                initiator_task_tag: RESERVED_TAG,
                target_transfer_tag: 0x1234,
                stat_sn: self.stat_sn,
                exp_cmd_sn: self.exp_cmd_sn,
                max_cmd_sn: self.max_cmd_sn(),
                data: Bytes::from_static(b"ping"),
                ..Default::default()
            };
            self.send(Pdu::NopIn(ping)).await?;
        }
        loop {
            let pdu = self.recv().await?;
            match pdu {
                Pdu::ScsiCommand(c) => {
                    if !c.immediate {
                        self.exp_cmd_sn = c.cmd_sn.next();
                    }
                    self.commands += 1;
                    self.observed.commands.fetch_add(1, Ordering::SeqCst);
                    if self.config.drop_after.is_some_and(|n| self.commands > n) {
                        return Err("dropping as configured".into());
                    }
                    self.command(c).await?;
                }
                Pdu::DataOut(d) => self.data_out(d).await?,
                Pdu::NopOut(n) => {
                    if n.target_transfer_tag == 0x1234 {
                        self.observed
                            .pong
                            .store(n.data[..] == b"ping"[..], Ordering::SeqCst);
                    }
                    if n.initiator_task_tag != RESERVED_TAG {
                        let r = NopIn {
                            lun: n.lun,
                            initiator_task_tag: n.initiator_task_tag,
                            target_transfer_tag: RESERVED_TAG,
                            stat_sn: self.next_stat_sn(),
                            exp_cmd_sn: self.exp_cmd_sn,
                            max_cmd_sn: self.max_cmd_sn(),
                            data: n.data,
                        };
                        self.send(Pdu::NopIn(r)).await?;
                    }
                }
                Pdu::TaskManagementRequest(t) => {
                    let r = TaskManagementResponse {
                        response: TmfResponse::FunctionComplete,
                        initiator_task_tag: t.initiator_task_tag,
                        stat_sn: self.next_stat_sn(),
                        exp_cmd_sn: self.exp_cmd_sn,
                        max_cmd_sn: self.max_cmd_sn(),
                        ..Default::default()
                    };
                    self.send(Pdu::TaskManagementResponse(r)).await?;
                }
                Pdu::TextRequest(t) => {
                    let mut out = TextParams::new();
                    out.push("TargetName", TARGET);
                    out.push("TargetAddress", format!("{},1", self.addr));
                    let r = TextResponse {
                        final_bit: true,
                        initiator_task_tag: t.initiator_task_tag,
                        target_transfer_tag: RESERVED_TAG,
                        stat_sn: self.next_stat_sn(),
                        exp_cmd_sn: self.exp_cmd_sn,
                        max_cmd_sn: self.max_cmd_sn(),
                        data: out.encode(),
                        ..Default::default()
                    };
                    self.send(Pdu::TextResponse(r)).await?;
                }
                Pdu::LogoutRequest(l) => {
                    let r = LogoutResponse {
                        initiator_task_tag: l.initiator_task_tag,
                        stat_sn: self.next_stat_sn(),
                        exp_cmd_sn: self.exp_cmd_sn,
                        max_cmd_sn: self.max_cmd_sn(),
                        ..Default::default()
                    };
                    self.send(Pdu::LogoutResponse(r)).await?;
                    return Ok(());
                }
                other => return Err(format!("unexpected {:?}", other.opcode())),
            }
        }
    }

    async fn login(&mut self) -> R {
        let mut neg: Option<Negotiator> = None;
        let mut text = TextReassembler::default();
        loop {
            let Pdu::LoginRequest(req) = self.recv().await? else {
                return Err("not a login".into());
            };
            let neg = neg.get_or_insert_with(|| {
                Negotiator::new(
                    Role::Target,
                    self.config.settings.clone(),
                    req.tsih == 0,
                    [5; ENTROPY_LEN],
                )
            });
            let Some(all) = text
                .push(&req.data, req.continue_bit)
                .map_err(|e| e.to_string())?
            else {
                let r = LoginResponse {
                    current_stage: req.current_stage,
                    next_stage: req.current_stage,
                    isid: req.isid,
                    initiator_task_tag: req.initiator_task_tag,
                    stat_sn: self.stat_sn,
                    exp_cmd_sn: req.cmd_sn,
                    max_cmd_sn: req.cmd_sn,
                    ..Default::default()
                };
                self.send(Pdu::LoginResponse(r)).await?;
                continue;
            };
            let outcome = TextParams::parse(&all)
                .map_err(iscsi_pdu::negotiation::NegotiationError::Text)
                .and_then(|p| neg.receive(req.current_stage, &p))
                .and_then(|out| neg.require_initiator_declarations().map(|()| out));
            let (status, out) = match outcome {
                Ok(out) => (LoginStatus::SUCCESS, out),
                Err(e) => (e.login_status(), TextParams::new()),
            };
            let transit = status == LoginStatus::SUCCESS
                && req.transit
                && neg
                    .may_transit(req.current_stage, req.next_stage)
                    .unwrap_or(false);
            self.exp_cmd_sn = req.cmd_sn;
            let ffp = transit && req.next_stage == Stage::FullFeaturePhase;
            let r = LoginResponse {
                transit,
                current_stage: req.current_stage,
                next_stage: if transit {
                    req.next_stage
                } else {
                    req.current_stage
                },
                isid: req.isid,
                tsih: if ffp { req.tsih.max(1) } else { 0 },
                initiator_task_tag: req.initiator_task_tag,
                stat_sn: self.next_stat_sn(),
                exp_cmd_sn: self.exp_cmd_sn,
                max_cmd_sn: self.max_cmd_sn(),
                status,
                data: out.encode(),
                ..Default::default()
            };
            self.send(Pdu::LoginResponse(r)).await?;
            if status != LoginStatus::SUCCESS {
                return Err(format!("login refused: {status:?}"));
            }
            if ffp {
                let c = *neg.connection();
                let op = if req.tsih == 0 {
                    let op = neg.session().operational;
                    *self.observed.session.lock().unwrap() = Some(op);
                    op
                } else {
                    self.observed
                        .session
                        .lock()
                        .unwrap()
                        .expect("a leading login came first")
                };
                self.digests = Digests {
                    header: c.header_digest,
                    data: c.data_digest,
                };
                self.deframer.set_digests(self.digests);
                self.deframer
                    .set_max_recv_data_segment_length(c.max_recv_data_segment_length);
                self.send_max = c.max_send_data_segment_length;
                self.burst = op.max_burst_length;
                self.first_burst = op.first_burst_length;
                self.max_r2t = usize::from(op.max_outstanding_r2t);
                self.immediate_data = op.immediate_data;
                self.initial_r2t = op.initial_r2t;
                let s = neg.session();
                assert_eq!(
                    s.declared.session_type == SessionType::Discovery,
                    s.declared.target_name.is_none()
                );
                return Ok(());
            }
        }
    }

    async fn command(&mut self, c: ScsiCommand) -> R {
        let bs = u64::from(self.config.block_size);
        let (lba, blocks) = match c.cdb[0] {
            0x28 | 0x2a => (
                u64::from(u32::from_be_bytes(c.cdb[2..6].try_into().unwrap())),
                u64::from(u16::from_be_bytes(c.cdb[7..9].try_into().unwrap())),
            ),
            0x88 | 0x8a => (
                u64::from_be_bytes(c.cdb[2..10].try_into().unwrap()),
                u64::from(u32::from_be_bytes(c.cdb[10..14].try_into().unwrap())),
            ),
            _ => (0, 0),
        };
        match c.cdb[0] {
            0x28 | 0x88 => {
                if self.config.hold_reads {
                    return Ok(());
                }
                if self.config.fail_reads {
                    // MEDIUM ERROR / UNRECOVERED READ ERROR.
                    return self.check_condition(c.initiator_task_tag, 0x03, 0x11).await;
                }
                let start = (lba * bs) as usize;
                let data =
                    self.disk.lock().unwrap()[start..start + (blocks * bs) as usize].to_vec();
                self.read_reply(&c, Bytes::from(data), self.config.misbehave)
                    .await
            }
            0x2a | 0x8a => {
                let len = (blocks * bs) as u32;
                let mut w = Write {
                    lba,
                    data: vec![0; len as usize],
                    received: 0,
                    next_offset: 0,
                    r2ts: 0,
                    outstanding: 0,
                    lun: c.lun,
                };
                w.data[..c.data.len()].copy_from_slice(&c.data);
                w.received = c.data.len() as u32;
                // Solicited data starts after the unsolicited part.
                let unsolicited = if self.initial_r2t {
                    c.data.len() as u32
                } else {
                    self.first_burst.min(len)
                };
                w.next_offset = unsolicited.max(c.data.len() as u32);
                self.writes.insert(c.initiator_task_tag, w);
                self.pump_r2ts(c.initiator_task_tag).await
            }
            0x9e => {
                let mut d = vec![0u8; 32];
                d[..8].copy_from_slice(&(self.config.blocks - 1).to_be_bytes());
                d[8..12].copy_from_slice(&self.config.block_size.to_be_bytes());
                self.read_reply(&c, Bytes::from(d), Misbehave::None).await
            }
            0x00 => {
                self.status(c.initiator_task_tag, ScsiStatus::GOOD, Residual::None)
                    .await
            }
            // REZERO UNIT (obsolete): never answered, for the initiator's timeout.
            0x01 => Ok(()),
            // ILLEGAL REQUEST / INVALID COMMAND OPERATION CODE.
            _ => self.check_condition(c.initiator_task_tag, 0x05, 0x20).await,
        }
    }

    /// CHECK CONDITION with fixed-format sense: `key`, ASC `asc`, ASCQ 0.
    async fn check_condition(&mut self, itt: u32, key: u8, asc: u8) -> R {
        let sense = [0x70, 0, key, 0, 0, 0, 0, 10, 0, 0, 0, 0, asc, 0, 0, 0, 0, 0];
        let r = ScsiResponse {
            status: ScsiStatus::CHECK_CONDITION,
            initiator_task_tag: itt,
            stat_sn: self.next_stat_sn(),
            exp_cmd_sn: self.exp_cmd_sn,
            max_cmd_sn: self.max_cmd_sn(),
            data: ScsiResponse::sense_segment(&sense),
            ..Default::default()
        };
        self.send(Pdu::ScsiResponse(r)).await
    }

    async fn read_reply(&mut self, c: &ScsiCommand, data: Bytes, misbehave: Misbehave) -> R {
        let want = c.expected_data_transfer_length as usize;
        let data = data.slice(..data.len().min(want));
        let residual = if data.len() < want {
            Residual::Underflow((want - data.len()) as u32)
        } else {
            Residual::None
        };
        let max = self.send_max as usize;
        let n = data.len().div_ceil(max).max(1);
        for i in 0..n {
            let mut offset = (i * max) as u32;
            let mut seg = data.slice(i * max..((i + 1) * max).min(data.len()));
            let mut data_sn = i as u32;
            match misbehave {
                Misbehave::WrongDataSn if i == 1 => data_sn += 1,
                Misbehave::OffsetBeyondBuffer if i == n - 1 => offset += 4096,
                Misbehave::OversizedPdu if i == 0 => seg = Bytes::from(vec![0u8; max + 512]),
                _ => {}
            }
            let last = i == n - 1;
            let status = last.then(|| DataInStatus {
                status: ScsiStatus::GOOD,
                stat_sn: self.next_stat_sn(),
                residual,
            });
            let d = DataIn {
                final_bit: last,
                status,
                initiator_task_tag: c.initiator_task_tag,
                target_transfer_tag: RESERVED_TAG,
                exp_cmd_sn: self.exp_cmd_sn,
                max_cmd_sn: self.max_cmd_sn(),
                data_sn,
                buffer_offset: offset,
                data: seg,
                ..Default::default()
            };
            self.send(Pdu::DataIn(d)).await?;
        }
        Ok(())
    }

    async fn status(&mut self, itt: u32, status: ScsiStatus, residual: Residual) -> R {
        let r = ScsiResponse {
            status,
            residual,
            initiator_task_tag: itt,
            stat_sn: self.next_stat_sn(),
            exp_cmd_sn: self.exp_cmd_sn,
            max_cmd_sn: self.max_cmd_sn(),
            ..Default::default()
        };
        self.send(Pdu::ScsiResponse(r)).await
    }

    /// Issues R2Ts up to MaxOutstandingR2T; completes the write when all data is in.
    async fn pump_r2ts(&mut self, itt: u32) -> R {
        let (burst, max_r2t) = (self.burst, self.max_r2t);
        let mut r2ts = Vec::new();
        let done = {
            let w = self.writes.get_mut(&itt).unwrap();
            let len = w.data.len() as u32;
            while w.outstanding < max_r2t && w.next_offset < len {
                let n = burst.min(len - w.next_offset);
                r2ts.push((w.r2ts, w.next_offset, n, w.lun));
                w.r2ts += 1;
                w.next_offset += n;
                w.outstanding += 1;
            }
            self.observed
                .max_r2ts_outstanding
                .fetch_max(w.outstanding, Ordering::SeqCst);
            w.received == len
        };
        for (r2t_sn, offset, n, lun) in r2ts {
            let ttt = self.next_ttt;
            self.next_ttt += 1;
            let r = ReadyToTransfer {
                lun,
                initiator_task_tag: itt,
                target_transfer_tag: ttt,
                stat_sn: self.stat_sn,
                exp_cmd_sn: self.exp_cmd_sn,
                max_cmd_sn: self.max_cmd_sn(),
                r2t_sn,
                buffer_offset: offset,
                desired_data_transfer_length: n,
            };
            self.send(Pdu::ReadyToTransfer(r)).await?;
        }
        if done {
            let w = self.writes.remove(&itt).unwrap();
            let bs = u64::from(self.config.block_size);
            let start = (w.lba * bs) as usize;
            self.disk.lock().unwrap()[start..start + w.data.len()].copy_from_slice(&w.data);
            self.status(itt, ScsiStatus::GOOD, Residual::None).await?;
        }
        Ok(())
    }

    async fn data_out(&mut self, d: DataOut) -> R {
        let Some(w) = self.writes.get_mut(&d.initiator_task_tag) else {
            return Err("Data-Out for no write".into());
        };
        let end = d.buffer_offset as usize + d.data.len();
        if end > w.data.len() {
            return Err("Data-Out beyond the write".into());
        }
        w.data[d.buffer_offset as usize..end].copy_from_slice(&d.data);
        w.received += d.data.len() as u32;
        if d.final_bit && d.target_transfer_tag != RESERVED_TAG {
            w.outstanding -= 1;
        }
        self.pump_r2ts(d.initiator_task_tag).await
    }
}
