//! Login: the I/O shell around `iscsi_pdu`'s sans-IO initiator [`Login`], which takes a
//! connection through the security and operational stages to full feature phase.

use std::time::Duration;

use bytes::BytesMut;
use iscsi_pdu::chap::{ChapCredentials, ENTROPY_LEN};
pub(crate) use iscsi_pdu::initiator::Established;
use iscsi_pdu::initiator::Login;
use iscsi_pdu::negotiation::{
    AuthMethod, AuthSettings, DigestAlgorithm, OperationalParams, SessionType, Settings,
};
use iscsi_pdu::{Deframer, Digests, Isid, Pdu, SerialNumber};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use crate::error::{Error, Result};

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
    /// The session's ISID; a random one when absent. With the initiator name it names the I_T
    /// nexus: the same ISID logs in as the same nexus (keeping its reservation registrations),
    /// another as a new one.
    pub isid: Option<Isid>,
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
            isid: None,
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
    /// Runs the login to full feature phase within the options' timeout.
    pub async fn run(&mut self, opts: &LoginOptions, target: Option<&str>) -> Result<Established> {
        tokio::time::timeout(opts.timeout, self.run_inner(opts, target))
            .await
            .map_err(|_| Error::Timeout)?
    }

    async fn run_inner(
        &mut self,
        opts: &LoginOptions,
        target: Option<&str>,
    ) -> Result<Established> {
        let settings = opts.settings_for(target);
        let (isid, tsih, cid, cmd_sn) = (self.isid, self.tsih, self.cid, self.cmd_sn);
        let mut login = Login::new(settings, isid, tsih, cid, cmd_sn, entropy());
        loop {
            while let Some(pdu) = login.poll_transmit() {
                self.send(&pdu).await?;
            }
            let response = self.receive().await?;
            if let Some(established) = login.handle_response(response)? {
                return Ok(established);
            }
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
