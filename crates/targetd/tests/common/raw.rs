//! A bare iSCSI connection for tests that speak raw PDUs: a login with a fixed ISID and the
//! minimum of keys, then whatever bytes the test sends.

use std::time::Duration;

use bytes::{Bytes, BytesMut};
use initiator_bench::scsi::cdb;
use iscsi_pdu::text::TextParams;
use iscsi_pdu::{
    DataOut, Deframer, Digests, Isid, LoginRequest, LoginStatus, Lun, NopOut, Pdu, ScsiCommand,
    ScsiStatus, SerialNumber, Stage, RESERVED_TAG,
};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use super::{Daemon, TARGET};

/// A bare connection: login with a fixed ISID and the minimum of keys, then raw PDUs.
pub struct Raw {
    pub stream: TcpStream,
    pub deframer: Deframer,
    pub cmd_sn: SerialNumber,
    pub tsih: u16,
    pub digests: Digests,
}

impl Raw {
    pub async fn login(d: &Daemon, isid: [u8; 6], tsih: u16) -> Result<Raw, LoginStatus> {
        Raw::login_with(d, isid, tsih, Digests::NONE).await
    }

    pub async fn login_with(
        d: &Daemon,
        isid: [u8; 6],
        tsih: u16,
        digests: Digests,
    ) -> Result<Raw, LoginStatus> {
        Raw::login_at(d.addr, isid, tsih, digests, 0).await
    }

    /// A login to the target at `addr` (a daemon in another process) as connection `cid`.
    pub async fn login_at(
        addr: std::net::SocketAddr,
        isid: [u8; 6],
        tsih: u16,
        digests: Digests,
        cid: u16,
    ) -> Result<Raw, LoginStatus> {
        let mut stream = TcpStream::connect(addr).await.unwrap();
        let mut text = TextParams::new();
        text.push("InitiatorName", "iqn.2026-11.io.example:raw");
        text.push("TargetName", TARGET);
        text.push("SessionType", "Normal");
        // Room for a second connection (MC/S), which a test may join as another CID.
        text.push("MaxConnections", "2");
        let digest = |on: bool| if on { "CRC32C" } else { "None" };
        text.push("HeaderDigest", digest(digests.header));
        text.push("DataDigest", digest(digests.data));
        let req = LoginRequest {
            transit: true,
            current_stage: Stage::LoginOperationalNegotiation,
            next_stage: Stage::FullFeaturePhase,
            isid: Isid(isid),
            tsih,
            cid,
            initiator_task_tag: 1,
            cmd_sn: SerialNumber(1),
            data: text.encode(),
            ..LoginRequest::default()
        };
        let mut out = BytesMut::new();
        Pdu::LoginRequest(req).encode(Digests::NONE, &mut out);
        stream.write_all(&out).await.unwrap();
        let mut raw = Raw {
            stream,
            deframer: Deframer::new(),
            cmd_sn: SerialNumber(1),
            tsih: 0,
            digests,
        };
        match raw.next().await {
            Some(Pdu::LoginResponse(r)) if r.status == LoginStatus::SUCCESS => {
                assert!(r.transit && r.next_stage == Stage::FullFeaturePhase);
                raw.tsih = r.tsih;
                raw.deframer.set_digests(digests);
                Ok(raw)
            }
            Some(Pdu::LoginResponse(r)) => Err(r.status),
            other => panic!("login answered with {other:?}"),
        }
    }

    pub async fn send_bytes(&mut self, b: &[u8]) {
        self.stream.write_all(b).await.unwrap();
    }

    pub async fn send(&mut self, pdu: Pdu) {
        let mut out = BytesMut::new();
        pdu.encode(self.digests, &mut out);
        self.send_bytes(&out).await;
    }

    /// The next PDU, or `None` when the target closed the connection. Silence for 10 s fails
    /// the test: the target must answer or close.
    pub async fn next(&mut self) -> Option<Pdu> {
        loop {
            if let Ok(Some(p)) = self.deframer.next_pdu() {
                return Some(p);
            }
            let mut buf = [0u8; 4096];
            let read = tokio::time::timeout(Duration::from_secs(10), self.stream.read(&mut buf))
                .await
                .expect("the target neither answered nor closed the connection in 10 s");
            match read {
                Ok(0) | Err(_) => return None,
                Ok(n) => self.deframer.feed(&buf[..n]),
            }
        }
    }

    /// An immediate NOP-Out with tag `itt` and data "ping", which the target must answer.
    pub fn ping_pdu(&self, itt: u32) -> Pdu {
        Pdu::NopOut(NopOut {
            immediate: true,
            lun: Lun::ZERO,
            initiator_task_tag: itt,
            target_transfer_tag: RESERVED_TAG,
            cmd_sn: self.cmd_sn,
            exp_stat_sn: SerialNumber(0),
            data: Bytes::from_static(b"ping"),
        })
    }

    pub async fn ping(&mut self, itt: u32) -> bool {
        self.send(self.ping_pdu(itt)).await;
        loop {
            match self.next().await {
                Some(Pdu::NopIn(n)) if n.initiator_task_tag == itt => {
                    return &n.data[..] == b"ping"
                }
                Some(_) => continue,
                None => return false,
            }
        }
    }
}

impl Raw {
    /// Sends `bytes`, then a ping with tag `itt`: what the target sent before the ping's answer,
    /// and whether the ping was answered (false: the target closed the connection, perhaps
    /// while the bytes were still being sent).
    pub async fn probe(&mut self, bytes: &[u8], itt: u32) -> (Vec<Pdu>, bool) {
        let ping = self.encode(self.ping_pdu(itt));
        if self.stream.write_all(bytes).await.is_ok() {
            let _ = self.stream.write_all(&ping).await;
        }
        let mut got = Vec::new();
        loop {
            match self.next().await {
                Some(Pdu::NopIn(n)) if n.initiator_task_tag == itt => return (got, true),
                Some(p) => got.push(p),
                // Also when the bytes could not all be sent: the target closed first.
                None => return (got, false),
            }
        }
    }

    /// `pdu` encoded with the connection's digests.
    pub fn encode(&self, pdu: Pdu) -> BytesMut {
        let mut out = BytesMut::new();
        pdu.encode(self.digests, &mut out);
        out
    }
}

impl Raw {
    /// The CmdSN for the next non-immediate command, advancing the count.
    pub fn take_cmd_sn(&mut self) -> u32 {
        let sn = self.cmd_sn;
        self.cmd_sn = sn.next();
        sn.0
    }

    /// The Target Transfer Tag of the next R2T for task `itt`, skipping anything else.
    pub async fn r2t(&mut self, itt: u32) -> u32 {
        loop {
            match self.next().await.expect("an R2T") {
                Pdu::ReadyToTransfer(r) if r.initiator_task_tag == itt => {
                    return r.target_transfer_tag
                }
                _ => continue,
            }
        }
    }

    /// How the command `itt` ended: its status and the data of its Data-In, skipping
    /// anything else (R2T, NOP-In, other tasks); `None` when the target closed the connection.
    pub async fn finish(&mut self, itt: u32) -> Option<(ScsiStatus, BytesMut)> {
        let mut data = BytesMut::new();
        loop {
            match self.next().await? {
                Pdu::ScsiResponse(r) if r.initiator_task_tag == itt => {
                    return Some((r.status, data))
                }
                Pdu::DataIn(d) if d.initiator_task_tag == itt => {
                    data.extend_from_slice(&d.data);
                    if let Some(s) = d.status {
                        return Some((s.status, data));
                    }
                }
                _ => continue,
            }
        }
    }
}

/// A READ (10) of `blocks` 512-byte blocks at `lba` on LUN 0.
pub fn read(itt: u32, cmd_sn: u32, lba: u32, blocks: u16) -> Pdu {
    Pdu::ScsiCommand(ScsiCommand {
        final_bit: true,
        read: true,
        lun: Lun::ZERO,
        initiator_task_tag: itt,
        expected_data_transfer_length: u32::from(blocks) * 512,
        cmd_sn: SerialNumber(cmd_sn),
        cdb: cdb::read(u64::from(lba), u32::from(blocks)),
        ..ScsiCommand::default()
    })
}

/// A WRITE (10) of `blocks` 512-byte blocks at `lba` on LUN 0, `data` its immediate data
/// (empty: all of it owed, to be asked for by R2T).
pub fn write(itt: u32, cmd_sn: u32, lba: u32, blocks: u16, data: Bytes) -> Pdu {
    Pdu::ScsiCommand(ScsiCommand {
        final_bit: true,
        write: true,
        lun: Lun::ZERO,
        initiator_task_tag: itt,
        expected_data_transfer_length: u32::from(blocks) * 512,
        cmd_sn: SerialNumber(cmd_sn),
        cdb: cdb::write(u64::from(lba), u32::from(blocks)),
        data,
        ..ScsiCommand::default()
    })
}

/// A Data-Out on LUN 0 answering the R2T `ttt` of task `itt` (DataSN 0, final): `data` at
/// `offset`.
pub fn data_out(itt: u32, ttt: u32, offset: u32, data: Bytes) -> Pdu {
    Pdu::DataOut(DataOut {
        final_bit: true,
        lun: Lun::ZERO,
        initiator_task_tag: itt,
        target_transfer_tag: ttt,
        exp_stat_sn: SerialNumber(0),
        data_sn: 0,
        buffer_offset: offset,
        data,
    })
}
