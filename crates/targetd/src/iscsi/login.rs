//! The login phase (RFC 7143 section 6): the I/O shell around iscsi-pdu's sans-IO
//! [`Login`], and the daemon's [`LoginPolicy`]: which targets exist, who may reach them (ACLs),
//! with which CHAP credentials, and the session the login creates or joins.

use std::io::Read;
use std::net::SocketAddr;
use std::sync::Arc;

use iscsi_pdu::chap::{ChapCredentials, ENTROPY_LEN};
use iscsi_pdu::negotiation::{AuthMethod, NegotiationError, Negotiator, Settings};
use iscsi_pdu::target::{Completed, Login, LoginPolicy, Step};
use iscsi_pdu::{Isid, LoginStatus, Pdu, SerialNumber};

use super::session::{ConnectionInfo, JoinError, Session};
use super::wire::{Incoming, Reader, Writer};
use crate::server::Shared;
use crate::target::{Target, PORTAL_GROUP};

/// A finished login.
pub enum Outcome {
    /// A discovery session.
    Discovery {
        /// The negotiation, kept for text exchanges.
        negotiator: Negotiator,
        /// InitiatorName.
        initiator: String,
        /// The next StatSN.
        stat_sn: SerialNumber,
        /// The session's ExpCmdSN.
        exp_cmd_sn: SerialNumber,
    },
    /// A normal session, created or joined.
    Normal {
        /// The session.
        session: Arc<Session>,
        /// The negotiation, kept for text exchanges.
        negotiator: Negotiator,
        /// The next StatSN.
        stat_sn: SerialNumber,
    },
}

/// Who is connecting.
pub struct Peer {
    /// Daemon-wide connection id.
    pub id: u64,
    /// Remote address.
    pub addr: SocketAddr,
    /// The portal reached.
    pub local: SocketAddr,
    /// The reactor serving it.
    pub reactor: usize,
    /// Its control.
    pub control: Arc<super::session::Control>,
}

/// Fresh random bytes for CHAP identifiers and challenges.
fn entropy() -> [u8; ENTROPY_LEN] {
    let mut e = [0u8; ENTROPY_LEN];
    if std::fs::File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(&mut e))
        .is_err()
    {
        // No urandom: mix the clock and the address of a stack value.
        let t = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or_default();
        let mut x = t ^ (&e as *const _ as usize as u128);
        for b in e.iter_mut() {
            x = x
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            *b = (x >> 64) as u8;
        }
    }
    e
}

/// The daemon's answers to a login's questions, for one connection.
struct Policy<'a> {
    shared: &'a Arc<Shared>,
    peer: &'a Peer,
    target: Option<Arc<Target>>,
    session: Option<Arc<Session>>,
}

impl LoginPolicy for Policy<'_> {
    fn normal(&mut self, initiator: &str, name: &str, tsih: u16) -> Result<Settings, LoginStatus> {
        let shared = self.shared;
        if shared.stopping() {
            return Err(LoginStatus::SERVICE_UNAVAILABLE);
        }
        let Some(target) = shared.target(name) else {
            shared.refused(self.peer.addr, initiator, name, "no such target");
            return Err(LoginStatus::NOT_FOUND);
        };
        if !target.admits(initiator, self.peer.addr.ip()) {
            let why = "initiator or network not allowed";
            shared.refused(self.peer.addr, initiator, name, why);
            return Err(LoginStatus::AUTHORIZATION_FAILURE);
        }
        if tsih != 0 && shared.sessions.get(tsih).is_none() {
            return Err(LoginStatus::SESSION_DOES_NOT_EXIST);
        }
        let mut settings = shared.settings();
        settings.declarations.target_portal_group_tag = Some(PORTAL_GROUP);
        let c = target
            .config
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        require_chap(&mut settings, c.chap.as_ref(), c.mutual_chap.as_ref());
        drop(c);
        self.target = Some(target);
        Ok(settings)
    }

    fn discovery(&mut self, _initiator: &str) -> Result<Settings, LoginStatus> {
        if self.shared.stopping() {
            return Err(LoginStatus::SERVICE_UNAVAILABLE);
        }
        let mut settings = self.shared.settings();
        let c = self.shared.config();
        let i = &c.iscsi;
        let (chap, mutual) = (i.discovery_chap.as_ref(), i.discovery_mutual_chap.as_ref());
        require_chap(&mut settings, chap, mutual);
        Ok(settings)
    }

    fn refused(&mut self, initiator: &str, target: Option<&str>, e: &NegotiationError) {
        let target = target.unwrap_or("discovery");
        self.shared
            .refused(self.peer.addr, initiator, target, &e.to_string());
    }

    fn window(&self, tsih: u16, cmd_sn: SerialNumber) -> (SerialNumber, SerialNumber) {
        match (tsih != 0)
            .then(|| self.shared.sessions.get(tsih))
            .flatten()
        {
            Some(s) => s.window(),
            None => (cmd_sn, cmd_sn + (self.shared.window() - 1)),
        }
    }

    fn complete(
        &mut self,
        login: &Completed,
    ) -> Result<(u16, SerialNumber, SerialNumber), LoginStatus> {
        let (shared, peer) = (self.shared, self.peer);
        let cmd = login.cmd_sn;
        let Some(target) = self.target.clone() else {
            // Discovery sessions are never joined; any non-zero TSIH outside the normal range.
            let tsih = 0x8000 | (peer.id & 0x7fff) as u16;
            return Ok((tsih, cmd, cmd + (shared.window() - 1)));
        };
        let c = *login.negotiator.connection();
        let info = ConnectionInfo {
            cid: login.cid,
            id: peer.id,
            peer: peer.addr,
            local: peer.local,
            reactor: peer.reactor,
            digests: (c.header_digest, c.data_digest),
            segment_lengths: (
                c.max_recv_data_segment_length,
                c.max_send_data_segment_length,
            ),
            control: peer.control.clone(),
        };
        let session = if login.tsih == 0 {
            let params = login.negotiator.session().clone();
            let (initiator, window) = (&login.initiator, shared.window());
            let s = &shared.sessions;
            s.create(login.isid, initiator, target, params, window, cmd, info)
        } else {
            let name = &target.name;
            shared
                .sessions
                .join(login.tsih, login.isid, &login.initiator, name, info)
                .map_err(|e| match e {
                    JoinError::NoSession => LoginStatus::SESSION_DOES_NOT_EXIST,
                    JoinError::TooMany => LoginStatus::TOO_MANY_CONNECTIONS,
                })?
        };
        let (exp, max) = session.window();
        tracing::info!(
            tsih = session.tsih,
            initiator = %session.initiator,
            isid = %Isid(login.isid.0),
            target = %session.target.name,
            peer = %peer.addr,
            cid = login.cid,
            "login"
        );
        let tsih = session.tsih;
        self.session = Some(session);
        Ok((tsih, exp, max))
    }

    fn entropy(&mut self) -> [u8; ENTROPY_LEN] {
        entropy()
    }
}

/// Runs the login phase to its end: `Some` when the connection enters full feature phase,
/// `None` when the login failed (the refusal has been sent).
pub async fn run(
    reader: &mut Reader,
    writer: &mut Writer,
    shared: &Arc<Shared>,
    peer: &Peer,
) -> Option<Outcome> {
    let mut login = Login::new();
    let mut policy = Policy {
        shared,
        peer,
        target: None,
        session: None,
    };
    loop {
        let req = match reader.next().await {
            Ok(Incoming::Whole(Pdu::LoginRequest(r))) => r,
            Ok(other) => {
                tracing::debug!(peer = %peer.addr, "not a login request during login: {other:?}");
                return None;
            }
            Err(e) => {
                tracing::debug!(peer = %peer.addr, "login: {e}");
                return None;
            }
        };
        let (response, done) = match login.handle_request(&req, &mut policy) {
            Step::Continue(r) => (r, None),
            Step::Done(r, done) => (r, Some(done)),
            Step::Refused(r) => {
                let _ = writer.send_pdu(Pdu::LoginResponse(r)).await;
                return None;
            }
        };
        if writer.send_pdu(Pdu::LoginResponse(response)).await.is_err() {
            return None;
        }
        let Some(done) = done else { continue };
        let Completed {
            negotiator,
            initiator,
            stat_sn,
            cmd_sn,
            ..
        } = *done;
        return Some(match policy.session.take() {
            Some(session) => Outcome::Normal {
                session,
                negotiator,
                stat_sn,
            },
            None => Outcome::Discovery {
                negotiator,
                initiator,
                stat_sn,
                exp_cmd_sn: cmd_sn,
            },
        });
    }
}

/// Makes CHAP the only AuthMethod when `chap` is configured: the initiator proves `chap`, and
/// the target proves `mutual` when the initiator asks.
fn require_chap(
    settings: &mut Settings,
    chap: Option<&crate::config::Chap>,
    mutual: Option<&crate::config::Chap>,
) {
    let Some(chap) = chap else { return };
    let creds =
        |c: &crate::config::Chap| ChapCredentials::new(&c.username, c.secret.as_bytes(), 1).ok();
    settings.auth.methods = vec![AuthMethod::Chap];
    settings.auth.peer = creds(chap);
    settings.auth.local = mutual.and_then(creds);
}
