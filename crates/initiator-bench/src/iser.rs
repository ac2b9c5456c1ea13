//! Workloads over iSER: `initiator-bench run --transport iser iser://ADDR:PORT/TARGET/LUN`
//! (feature `rdma`).
//!
//! The initiator is iscsi-pdu's: its login ([`Login`], with `RDMAExtensions=Yes`), its session
//! and iSER's datamover around it ([`IserInitiator`]). Each command's buffer is a place of an
//! [`srp::initiator::DataMemory`] registered as `--registration` says (one region: iSER names
//! one buffer per direction), named in the SCSI Command's iSER header; the target reads a
//! write's solicited data from it by RDMA READ and writes a read's data into it by RDMA WRITE.
//! The run itself is [`crate::rdma`]'s, as SRP's is, on this machine's clock.

use std::collections::{HashMap, VecDeque};
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use bytes::{Bytes, BytesMut};
use iscsi_pdu::chap::ENTROPY_LEN;
use iscsi_pdu::initiator::{Command, Event, Login, Reply, Session, Timers};
use iscsi_pdu::iser::{self, IserHeader, IserInitiator, Message, Received, RemoteBuffer};
use iscsi_pdu::negotiation::{Declarations, DigestAlgorithm, OperationalParams, Settings};
use iscsi_pdu::{Isid, Lun, Pdu, Residual, SerialNumber};
use rdma::verbs::{MessageBuffers, PeerMemory, Verbs, WorkOp};
use srp::initiator::{DataMemory, Exposed};

pub use crate::rdma::run_channels;
#[cfg(feature = "rdma")]
use crate::rdma::RdmaReport;
use crate::rdma::{Answered, BlockChannel, RdmaOptions, Request};
#[cfg(feature = "rdma")]
use crate::workload::Workload;

/// The default iSCSI port, which iSER portals use too.
pub const DEFAULT_PORT: u16 = 3260;

/// Receives the initiator keeps posted: a response for each command the target's window
/// admits (targetd's is at most 128 over iSER), and room for NOP-Ins and asynchronous
/// messages.
pub const RECEIVES: usize = 160;

/// The data segment this initiator receives and sends at most (both RecvDataSegmentLength
/// keys): what fits an IU buffer of the verbs with the iSER header, the BHS and any AHS.
pub const DATA_SEGMENT: u32 = 8192;

/// How long the login and each command may take.
const WAIT: Duration = Duration::from_secs(30);

/// The initiator's name.
pub const INITIATOR_NAME: &str = "iqn.2026-11.io.example:initiator-bench";

/// An iSER target as a URL names it: `iser://ADDR[:PORT]/TARGET/LUN`, as libiscsi writes it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IserUrl {
    /// The portal's rdma_cm address.
    pub addr: SocketAddr,
    /// The target's name.
    pub target: String,
    /// The LUN.
    pub lun: u16,
}

impl IserUrl {
    /// Parses `iser://ADDR[:PORT]/TARGET/LUN`.
    pub fn parse(url: &str) -> Result<IserUrl, String> {
        let bad = || format!("{url:?} is not iser://ADDR[:PORT]/TARGET/LUN");
        let rest = url.strip_prefix("iser://").ok_or_else(bad)?;
        let mut parts = rest.splitn(3, '/');
        let (Some(addr), Some(target), Some(lun)) = (parts.next(), parts.next(), parts.next())
        else {
            return Err(bad());
        };
        let addr = addr
            .parse()
            .or_else(|_| {
                addr.parse::<std::net::IpAddr>()
                    .map(|ip| SocketAddr::new(ip, DEFAULT_PORT))
            })
            .or_else(|_| {
                addr.trim_start_matches('[')
                    .trim_end_matches(']')
                    .parse::<std::net::IpAddr>()
                    .map(|ip| SocketAddr::new(ip, DEFAULT_PORT))
            })
            .map_err(|_| format!("{addr:?} in {url:?} is not an address[:port]"))?;
        if target.is_empty() {
            return Err(bad());
        }
        let lun = lun
            .parse()
            .map_err(|_| format!("{lun:?} in {url:?} is not a LUN"))?;
        Ok(IserUrl {
            addr,
            target: target.to_string(),
            lun,
        })
    }
}

/// What this initiator offers at login: RDMAExtensions, no digests, [`DATA_SEGMENT`] each
/// way, immediate data as `o` says (InitialR2T=Yes: the rest of a write is read by the
/// target).
pub fn settings(target: &str, o: &RdmaOptions) -> Settings {
    Settings {
        header_digest: vec![DigestAlgorithm::None],
        data_digest: vec![DigestAlgorithm::None],
        max_recv_data_segment_length: DATA_SEGMENT,
        operational: OperationalParams {
            rdma_extensions: true,
            immediate_data: o.immediate_data,
            initial_r2t: true,
            max_burst_length: 262_144,
            first_burst_length: 65_536,
            ..OperationalParams::default()
        },
        declarations: Declarations {
            initiator_name: Some(INITIATOR_NAME.into()),
            target_name: Some(target.into()),
            ..Declarations::default()
        },
        ..Settings::default()
    }
}

/// One command in flight: its key in the data memory (none without data) and a read's length.
#[derive(Debug, Clone, Copy)]
struct InFlight {
    key: Option<u64>,
    read_len: u32,
}

/// An initiator's iSER connection, logged in: the datamover, the data memory its commands'
/// buffers lie in, the answers not yet taken.
#[derive(Debug)]
pub struct IserChannel<V: Verbs + PeerMemory> {
    qp: V::Qp,
    datamover: IserInitiator,
    memory: DataMemory<V::Memory>,
    places: usize,
    in_flight: HashMap<u32, InFlight>,
    next_key: u64,
    scratch: BytesMut,
    answers: VecDeque<Answered>,
    /// Why the connection cannot go on.
    failed: Option<String>,
}

impl<V> IserChannel<V>
where
    V: Verbs + PeerMemory + MessageBuffers<Message = <V as Verbs>::Buffer>,
{
    /// Logs in to `target` over queue pair `qp` (connected with the iSER CM request), the
    /// session's ISID qualified by `session`; its data memory `places` places of `place_len`
    /// bytes, registered as `o` says.
    pub fn login(
        verbs: &mut V,
        qp: V::Qp,
        target: &str,
        session: u16,
        o: &RdmaOptions,
        places: usize,
        place_len: usize,
    ) -> Result<IserChannel<V>, String> {
        for _ in 0..RECEIVES {
            let b = verbs.message_buffer().ok_or("no IU buffer for a receive")?;
            verbs.post_recv(qp, 0, b);
        }
        let [hi, lo] = session.to_be_bytes();
        let isid = Isid([0x80, 0x00, 0x1e, 0xb0, hi, lo]);
        let entropy = [0u8; ENTROPY_LEN];
        let mut login = Login::new(settings(target, o), isid, 0, 0, SerialNumber(1), entropy);
        let mut scratch = BytesMut::new();
        let deadline = Instant::now() + WAIT;
        let established = 'login: loop {
            while let Some(pdu) = login.poll_transmit() {
                scratch.clear();
                iser::encode(&pdu, &IserHeader::default(), &mut scratch);
                post(verbs, qp, &scratch)?;
            }
            loop {
                let Some(wc) = verbs.poll(qp) else {
                    if verbs.is_error(qp) {
                        return Err("the connection ended during the login".into());
                    }
                    if Instant::now() > deadline {
                        return Err(format!("no login response for {WAIT:?}"));
                    }
                    std::thread::yield_now();
                    continue;
                };
                if wc.op != WorkOp::Recv {
                    verbs.recycle_message(wc.buffer);
                    continue;
                }
                if wc.result.is_err() {
                    return Err("the connection ended during the login".into());
                }
                let response = match iser::decode(&wc.buffer[..wc.len], DATA_SEGMENT) {
                    Ok(Message::Control(_, Received::Pdu(Pdu::LoginResponse(r)))) => r,
                    other => return Err(format!("not a login response: {other:?}")),
                };
                verbs.post_recv(qp, 0, wc.buffer);
                match login.handle_response(response) {
                    Ok(Some(done)) => break 'login done,
                    Ok(None) => continue 'login,
                    Err(e) => return Err(format!("login: {e}")),
                }
            }
        };
        let mut session = Session::new(
            established.session.clone(),
            established.tsih,
            established.exp_cmd_sn,
            established.max_cmd_sn,
        );
        session.set_timers(Timers {
            task: Some(crate::rdma::STALL),
            ..Timers::default()
        });
        let conn = session.add_connection(established.connection, established.exp_stat_sn);
        let receives = established.connection.max_recv_data_segment_length;
        let memory = DataMemory::new(verbs, o.registration, places, place_len)
            .map_err(|e| format!("the initiator's memory: {e}"))?;
        Ok(IserChannel {
            qp,
            datamover: IserInitiator::new(session, conn, receives),
            memory,
            places,
            in_flight: HashMap::new(),
            next_key: 0,
            scratch,
            answers: VecDeque::new(),
            failed: None,
        })
    }

    /// The datamover (its session: the window, the negotiated parameters).
    pub fn datamover(&self) -> &IserInitiator {
        &self.datamover
    }

    /// Sends what the session has to send.
    fn transmit(&mut self, verbs: &mut V) -> Result<(), String> {
        loop {
            self.scratch.clear();
            if !self.datamover.poll_transmit(&mut self.scratch) {
                return Ok(());
            }
            post(verbs, self.qp, &self.scratch)?;
        }
    }

    /// Takes the connection's completions and the session's events.
    fn receive(&mut self, verbs: &mut V) {
        let now = Instant::now();
        while let Some(wc) = verbs.poll(self.qp) {
            if wc.op != WorkOp::Recv {
                if wc.result.is_err() {
                    self.failed.get_or_insert("a send failed".into());
                }
                verbs.recycle_message(wc.buffer);
                continue;
            }
            if wc.result.is_err() {
                self.failed.get_or_insert("the connection ended".into());
                verbs.recycle_message(wc.buffer);
                continue;
            }
            if let Err(e) = self.datamover.handle_message(now, &wc.buffer[..wc.len]) {
                self.failed
                    .get_or_insert(format!("the target's message: {e}"));
            }
            verbs.post_recv(self.qp, 0, wc.buffer);
        }
        if let Err(e) = self.transmit(verbs) {
            self.failed.get_or_insert(e);
        }
        while let Some(event) = self.datamover.poll_event() {
            let Event::Done { itt, result } = event else {
                continue;
            };
            let Some(f) = self.in_flight.remove(&itt) else {
                continue;
            };
            match result {
                Ok(Reply::Scsi(r)) => {
                    let mut data = Vec::new();
                    if let Some(key) = f.key {
                        if f.read_len > 0 {
                            self.memory.read_data(verbs, key, &mut data);
                            let residual = match r.residual {
                                Residual::Underflow(n) => n as usize,
                                _ => 0,
                            };
                            data.truncate((f.read_len as usize).saturating_sub(residual));
                        }
                        self.memory.release(verbs, key);
                    }
                    self.answers.push_back(Answered {
                        tag: u64::from(itt),
                        status: r.status.0,
                        data,
                    });
                }
                Ok(other) => {
                    self.failed
                        .get_or_insert(format!("a SCSI command answered with {other:?}"));
                }
                Err(e) => {
                    self.failed
                        .get_or_insert(format!("a command failed: {e:?}"));
                }
            }
        }
    }

    /// Logs out and waits for the answer (the target then disconnects).
    pub fn logout(&mut self, verbs: &mut V) -> Result<(), String> {
        let itt = self
            .datamover
            .session_mut()
            .start_logout(Instant::now())
            .map_err(|e| format!("logout: {e:?}"))?;
        self.transmit(verbs)?;
        let deadline = Instant::now() + WAIT;
        loop {
            while let Some(wc) = verbs.poll(self.qp) {
                if wc.op == WorkOp::Recv && wc.result.is_ok() {
                    let done = self
                        .datamover
                        .handle_message(Instant::now(), &wc.buffer[..wc.len]);
                    verbs.post_recv(self.qp, 0, wc.buffer);
                    if done.is_err() {
                        // The logout response closes the session's connection.
                        return Ok(());
                    }
                } else {
                    verbs.recycle_message(wc.buffer);
                }
            }
            while let Some(e) = self.datamover.poll_event() {
                if let Event::Done { itt: t, result } = e {
                    if t == itt {
                        return match result {
                            Ok(Reply::Logout) => Ok(()),
                            other => Err(format!("logout answered with {other:?}")),
                        };
                    }
                }
            }
            if verbs.is_error(self.qp) {
                return Ok(());
            }
            if Instant::now() > deadline {
                return Err(format!("no logout response for {WAIT:?}"));
            }
            std::thread::yield_now();
        }
    }
}

/// Posts `msg` in an IU buffer of the verbs.
fn post<V>(verbs: &mut V, qp: V::Qp, msg: &[u8]) -> Result<(), String>
where
    V: Verbs + MessageBuffers<Message = <V as Verbs>::Buffer>,
{
    let mut b = verbs.message_buffer().ok_or("no IU buffer for a send")?;
    if msg.len() > b.len() {
        return Err(format!(
            "a message of {} bytes does not fit an IU buffer",
            msg.len()
        ));
    }
    b[..msg.len()].copy_from_slice(msg);
    verbs.post_send(qp, 0, b, msg.len());
    Ok(())
}

/// iSER's connection in the runner: the session's ITTs, its CmdSN window, immediate data as
/// negotiated, the session's task timeout.
impl<V> BlockChannel<V> for IserChannel<V>
where
    V: Verbs + PeerMemory + MessageBuffers<Message = <V as Verbs>::Buffer>,
{
    const TRANSPORT: &'static str = "iSER";

    fn prepare(&mut self, o: &RdmaOptions) -> Result<(), String> {
        if o.regions != 1 {
            return Err("iSER names one buffer per direction: --regions 1".into());
        }
        Ok(())
    }

    fn room(&self) -> bool {
        let s = self.datamover.session();
        let (_, max_cmd_sn) = s.window();
        s.next_cmd_sn().le(max_cmd_sn) && self.memory.in_flight() < self.places
    }

    fn send(&mut self, now: Instant, verbs: &mut V, r: &Request<'_>) -> Result<u64, String> {
        let len = r.data_out.map_or(r.data_in as usize, <[u8]>::len);
        let mut key = None;
        let mut buffer = None;
        if len > 0 {
            self.next_key += 1;
            let k = self.next_key;
            let exposed = self
                .memory
                .expose(verbs, k, len, 1, false, r.data_out)
                .map_err(|e| format!("the command's buffer: {e}"))?;
            let Exposed::Direct(d) = exposed else {
                return Err("a buffer of one region is direct".into());
            };
            key = Some(k);
            buffer = Some(RemoteBuffer {
                stag: d.key,
                va: d.va,
            });
        }
        let lun = Lun::from_index(r.lun);
        let cmd = match r.data_out {
            Some(data) => Command::write(lun, *r.cdb, Bytes::copy_from_slice(data)),
            None if r.data_in > 0 => Command::read(lun, *r.cdb, r.data_in),
            None => Command::new(lun, *r.cdb),
        };
        let (write, read) = match r.data_out {
            Some(_) => (buffer, None),
            None => (None, buffer),
        };
        let itt = match self.datamover.start_command(now, &cmd, write, read) {
            Ok(itt) => itt,
            Err(e) => {
                if let Some(k) = key {
                    self.memory.release(verbs, k);
                }
                return Err(format!("{e:?}"));
            }
        };
        self.in_flight.insert(
            itt,
            InFlight {
                key,
                read_len: r.data_in,
            },
        );
        self.transmit(verbs)?;
        Ok(u64::from(itt))
    }

    fn poll(&mut self, verbs: &mut V) -> Option<Answered> {
        if self.answers.is_empty() {
            self.receive(verbs);
        }
        self.answers.pop_front()
    }

    fn check(&mut self, now: Instant, verbs: &mut V) -> Result<(), String> {
        let session = self.datamover.session_mut();
        if session.poll_timeout().is_some_and(|at| at <= now) {
            session.handle_timeout(now);
            self.receive(verbs);
        }
        if let Some(why) = &self.failed {
            return Err(why.clone());
        }
        if verbs.is_error(self.qp) {
            return Err("the connection ended".into());
        }
        Ok(())
    }
}

/// Runs `w` against the iSER target `url` on this machine's RDMA device (feature `rdma`):
/// one connection per session, logged out after the run.
#[cfg(feature = "rdma")]
pub fn run_rdma(url: &IserUrl, w: &Workload, o: &RdmaOptions) -> Result<RdmaReport, String> {
    use iscsi_pdu::iser::{CmReply, CmRequest};
    use rdma::ibverbs::{QueueDepth, RdmaVerbs};
    let sessions = w.sessions.max(1);
    let places = w.qd.clamp(1, 128);
    let slots = (sessions * (RECEIVES + 2 * places + 64)) as u32;
    let mut verbs: RdmaVerbs =
        RdmaVerbs::open(None, slots, rdma::verbs::MESSAGE_BUFFER_LEN).map_err(|e| e.to_string())?;
    let private = CmRequest {
        zbva_not_supported: true,
        send_with_invalidate_not_supported: true,
    }
    .encode();
    let mut channels = Vec::new();
    for s in 0..sessions {
        let depth = QueueDepth {
            send: 1024,
            recv: RECEIVES as u32 + 16,
        };
        let (qp, reply) = verbs
            .connect(url.addr, depth, &private)
            .map_err(|e| format!("connect to {}: {e}", url.addr))?;
        let _ = CmReply::decode(&reply);
        let ch = IserChannel::login(
            &mut verbs,
            qp,
            &url.target,
            s as u16,
            o,
            places,
            crate::rdma::place_len(w, o),
        )?;
        channels.push(ch);
    }
    let report = run_channels(&mut verbs, &mut channels, url.lun, w, o);
    for ch in &mut channels {
        let _ = ch.logout(&mut verbs);
    }
    report
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn iser_urls_take_libiscsis_form() {
        let u = IserUrl::parse("iser://192.0.2.7:3260/iqn.2026-11.io.example:disk1/2").unwrap();
        assert_eq!(u.addr, "192.0.2.7:3260".parse().unwrap());
        assert_eq!(u.target, "iqn.2026-11.io.example:disk1");
        assert_eq!(u.lun, 2);
        let default_port = IserUrl::parse("iser://10.0.0.1/iqn.x:y/0").unwrap();
        assert_eq!(default_port.addr.port(), DEFAULT_PORT);
        let v6 = IserUrl::parse("iser://[fd00::1]:3261/iqn.x:y/0").unwrap();
        assert_eq!(v6.addr, "[fd00::1]:3261".parse().unwrap());
        for bad in [
            "iscsi://10.0.0.1/iqn.x:y/0",
            "iser://nowhere/iqn.x:y/0",
            "iser://10.0.0.1/iqn.x:y",
            "iser://10.0.0.1//0",
            "iser://10.0.0.1/iqn.x:y/lun",
        ] {
            assert!(IserUrl::parse(bad).is_err(), "{bad}");
        }
    }
}
