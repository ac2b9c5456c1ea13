//! Login: drives `iscsi_pdu`'s negotiation engine over a connection through the security and
//! operational stages to full feature phase.

use std::time::Duration;

use bytes::BytesMut;
use iscsi_pdu::chap::{ChapCredentials, ENTROPY_LEN};
use iscsi_pdu::negotiation::{
    AuthMethod, AuthSettings, ConnectionParams, DigestAlgorithm, Negotiator, OperationalParams,
    Role, SessionParams, SessionType, Settings,
};
use iscsi_pdu::text::{split_text, TextParams, TextReassembler};
use iscsi_pdu::{Deframer, Digests, Isid, LoginRequest, LoginStatus, Pdu, SerialNumber, Stage};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use crate::error::{login_status_message, Error, Result};

/// What the initiator proposes and how it authenticates.
#[derive(Debug, Clone)]
pub struct LoginOptions {
    /// InitiatorName.
    pub initiator_name: String,
    /// InitiatorAlias.
    pub initiator_alias: Option<String>,
    /// Proposals for every operational key (digests, bursts, R2T, ...).
    pub settings: Settings,
    /// CHAP credentials of this initiator (one-way CHAP).
    pub chap: Option<ChapCredentials>,
    /// The credentials the target must prove (mutual CHAP).
    pub mutual_chap: Option<ChapCredentials>,
    /// Connections per session (MC/S); the target may grant fewer.
    pub connections: u16,
    /// Bound on each login and each command.
    pub timeout: Duration,
}

impl Default for LoginOptions {
    /// Proposals suited to throughput: no digests, immediate and unsolicited data, large bursts,
    /// 16 outstanding R2Ts.
    fn default() -> Self {
        LoginOptions {
            initiator_name: "iqn.2026-11.io.storage-target:initiator-bench".into(),
            initiator_alias: None,
            settings: Settings {
                header_digest: vec![DigestAlgorithm::None],
                data_digest: vec![DigestAlgorithm::None],
                max_recv_data_segment_length: 262_144,
                operational: OperationalParams {
                    initial_r2t: false,
                    immediate_data: true,
                    max_burst_length: 16_776_192,
                    first_burst_length: 262_144,
                    max_outstanding_r2t: 16,
                    max_connections: 1,
                    default_time2wait: 0,
                    default_time2retain: 0,
                    ..OperationalParams::default()
                },
                ..Settings::default()
            },
            chap: None,
            mutual_chap: None,
            connections: 1,
            timeout: Duration::from_secs(30),
        }
    }
}

impl LoginOptions {
    /// The negotiation settings for one login: the proposals plus identity and authentication.
    pub(crate) fn settings_for(&self, target: Option<&str>) -> Settings {
        let mut s = self.settings.clone();
        let d = &mut s.declarations;
        d.initiator_name = Some(self.initiator_name.clone());
        d.initiator_alias = self.initiator_alias.clone();
        d.target_name = target.map(str::to_string);
        d.session_type = if target.is_some() {
            SessionType::Normal
        } else {
            SessionType::Discovery
        };
        s.operational.max_connections = s.operational.max_connections.max(self.connections);
        if let Some(chap) = &self.chap {
            s.auth = AuthSettings {
                methods: vec![AuthMethod::Chap],
                local: Some(chap.clone()),
                peer: self.mutual_chap.clone(),
                require_mutual: false,
            };
        }
        s
    }
}

/// What a successful login established.
#[derive(Debug, Clone)]
pub(crate) struct LoginOutcome {
    pub session: SessionParams,
    pub connection: ConnectionParams,
    pub tsih: u16,
    pub exp_stat_sn: SerialNumber,
    pub exp_cmd_sn: SerialNumber,
    pub max_cmd_sn: SerialNumber,
}

/// Fresh CHAP entropy. The initiator is not sans-IO, so it asks the OS-seeded hasher state,
/// mixed with the time, which is unpredictable enough for a test initiator's challenges.
pub(crate) fn entropy() -> [u8; ENTROPY_LEN] {
    use std::collections::hash_map::RandomState;
    use std::hash::{BuildHasher, Hasher};
    let mut out = [0u8; ENTROPY_LEN];
    for (i, chunk) in out.chunks_mut(8).enumerate() {
        let mut h = RandomState::new().build_hasher();
        h.write_usize(i);
        h.write_u128(
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_nanos()),
        );
        let v = h.finish().to_le_bytes();
        chunk.copy_from_slice(&v[..chunk.len()]);
    }
    out
}

/// A random ISID (type 0x80: random).
pub fn random_isid() -> Isid {
    let e = entropy();
    Isid([0x80, e[0], e[1], e[2], e[3], e[4]])
}

/// One connection's login PDU exchange.
pub(crate) struct LoginExchange<'a> {
    pub stream: &'a mut TcpStream,
    pub deframer: &'a mut Deframer,
    pub isid: Isid,
    pub tsih: u16,
    pub cid: u16,
    pub cmd_sn: SerialNumber,
}

impl LoginExchange<'_> {
    /// Logs in to `target` (a discovery session when `None`).
    pub async fn run(&mut self, opts: &LoginOptions, target: Option<&str>) -> Result<LoginOutcome> {
        tokio::time::timeout(opts.timeout, self.run_inner(opts, target))
            .await
            .map_err(|_| Error::Timeout)?
    }

    async fn run_inner(
        &mut self,
        opts: &LoginOptions,
        target: Option<&str>,
    ) -> Result<LoginOutcome> {
        let settings = opts.settings_for(target);
        let chap_offered =
            !settings.auth.methods.is_empty() && settings.auth.methods != [AuthMethod::None];
        let mut neg = Negotiator::new(Role::Initiator, settings, self.tsih == 0, entropy());
        let mut stage = Stage::SecurityNegotiation;
        let mut out = neg.offers(stage);
        let mut exp_stat_sn = SerialNumber(0);
        let mut itt = 0u32;
        loop {
            let next = if stage == Stage::SecurityNegotiation {
                Stage::LoginOperationalNegotiation
            } else {
                Stage::FullFeaturePhase
            };
            // Ask to move on unless a CHAP step is still to come from our side.
            let transit = stage != Stage::SecurityNegotiation
                || !chap_offered
                || out.get("CHAP_R").is_some()
                || neg.authenticated();
            let request = LoginRequest {
                transit,
                current_stage: stage,
                next_stage: if transit { next } else { stage },
                isid: self.isid,
                tsih: self.tsih,
                initiator_task_tag: itt,
                cid: self.cid,
                cmd_sn: self.cmd_sn,
                exp_stat_sn,
                ..LoginRequest::default()
            };
            let (response, text) = self.exchange(request, out.encode()).await?;
            itt = itt.wrapping_add(1);
            if response.status != LoginStatus::SUCCESS {
                return Err(Error::LoginRefused {
                    status: response.status,
                    message: login_status_message(response.status),
                });
            }
            exp_stat_sn = response.stat_sn.next();
            let params = TextParams::parse(&text)
                .map_err(|e| Error::Protocol(format!("login text: {e}")))?;
            let reply = neg.receive(stage, &params)?;
            if response.transit {
                if response.next_stage <= stage
                    || response.next_stage == Stage::Reserved
                    || !transit
                {
                    return Err(Error::Protocol(format!(
                        "login response moves from {stage:?} to {:?}",
                        response.next_stage
                    )));
                }
                if stage == Stage::SecurityNegotiation && !neg.authenticated() {
                    return Err(Error::Protocol(
                        "target left the security stage before authentication".into(),
                    ));
                }
                stage = response.next_stage;
                if stage == Stage::FullFeaturePhase {
                    if neg.is_waiting() {
                        return Err(Error::Protocol(
                            "target entered full feature phase with keys unanswered".into(),
                        ));
                    }
                    return Ok(LoginOutcome {
                        session: neg.session().clone(),
                        connection: *neg.connection(),
                        tsih: response.tsih,
                        exp_stat_sn,
                        exp_cmd_sn: response.exp_cmd_sn,
                        max_cmd_sn: response.max_cmd_sn,
                    });
                }
                out = reply;
                out.extend(neg.offers(stage));
            } else {
                out = reply;
            }
        }
    }

    /// Sends one login request (split with the C bit if its text is long) and reads the whole
    /// response, following the target's C bit.
    async fn exchange(
        &mut self,
        request: LoginRequest,
        text: bytes::Bytes,
    ) -> Result<(iscsi_pdu::LoginResponse, bytes::Bytes)> {
        let segments = split_text(
            &text,
            iscsi_pdu::LOGIN_MAX_RECV_DATA_SEGMENT_LENGTH as usize,
        );
        for (segment, more) in segments {
            let pdu = LoginRequest {
                continue_bit: more,
                transit: request.transit && !more,
                data: segment,
                ..request.clone()
            };
            self.send(&Pdu::LoginRequest(pdu)).await?;
            if more {
                // The target answers each partial request with an empty response.
                let r = self.receive().await?;
                if r.status != LoginStatus::SUCCESS {
                    return Err(Error::LoginRefused {
                        status: r.status,
                        message: login_status_message(r.status),
                    });
                }
            }
        }
        let mut text = TextReassembler::default();
        loop {
            let r = self.receive().await?;
            if r.initiator_task_tag != request.initiator_task_tag {
                return Err(Error::Protocol("login response for another task".into()));
            }
            let more = r.continue_bit;
            let whole = text
                .push(&r.data, more)
                .map_err(|e| Error::Protocol(format!("login text: {e}")))?;
            if let Some(whole) = whole {
                return Ok((r, whole));
            }
            // Ask for the rest with an empty request of the same stage.
            let cont = LoginRequest {
                transit: false,
                continue_bit: false,
                next_stage: request.current_stage,
                exp_stat_sn: r.stat_sn.next(),
                data: bytes::Bytes::new(),
                ..request.clone()
            };
            self.send(&Pdu::LoginRequest(cont)).await?;
        }
    }

    async fn send(&mut self, pdu: &Pdu) -> Result<()> {
        let mut buf = BytesMut::new();
        pdu.encode(Digests::NONE, &mut buf);
        self.stream.write_all(&buf).await?;
        Ok(())
    }

    async fn receive(&mut self) -> Result<iscsi_pdu::LoginResponse> {
        loop {
            match self.deframer.next_pdu() {
                Ok(Some(Pdu::LoginResponse(r))) => return Ok(r),
                Ok(Some(other)) => {
                    return Err(Error::Protocol(format!(
                        "{:?} during login",
                        other.opcode()
                    )));
                }
                Ok(None) => {}
                Err(e) => return Err(Error::Protocol(format!("during login: {e}"))),
            }
            let need = self.deframer.needed().max(48);
            self.deframer.buffer_mut().reserve(need);
            if self.stream.read_buf(self.deframer.buffer_mut()).await? == 0 {
                return Err(Error::ConnectionLost(
                    "target closed the connection during login".into(),
                ));
            }
        }
    }
}
