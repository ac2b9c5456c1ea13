//! The login phase (RFC 7143 section 6): the I/O shell around iscsi-pdu's sans-IO
//! [`Login`]. The daemon's answers to the login's questions (targets, ACLs, CHAP, the session
//! made or joined) are the registry's [`Admission`](crate::registry::Admission).

use std::sync::Arc;
use std::time::Instant;

use iscsi_pdu::handover::ConnectionState;
use iscsi_pdu::negotiation::Negotiator;
use iscsi_pdu::target_node::{Completed, Login, Step};
use iscsi_pdu::{Pdu, SerialNumber};

use super::session::Session;
use super::wire::{Incoming, Reader, Writer};
use crate::lock;
use crate::registry::{Peer, Registry};

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
    /// A connection of a normal session another process handed over
    /// ([`super::handover::adopt`]): no login ran here; the machine goes on from `state`.
    Adopted {
        /// The session, adopted.
        session: Arc<Session>,
        /// What was agreed in the other process.
        negotiator: Negotiator,
        /// The connection's state as handed over.
        state: ConnectionState,
    },
}

impl Outcome {
    /// The outcome of a login that has reached full feature phase: a normal session when the
    /// login made or joined `session`, else a discovery session.
    pub fn of(done: Completed, session: Option<Arc<Session>>) -> Outcome {
        let Completed {
            negotiator,
            initiator,
            stat_sn,
            cmd_sn,
            ..
        } = done;
        match session {
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
        }
    }
}

/// Runs the login phase to its end: `Some` when the connection enters full feature phase,
/// `None` when the login failed (the refusal has been sent).
pub async fn run(
    reader: &mut Reader,
    writer: &mut Writer,
    registry: &Arc<Registry>,
    peer: &Peer,
) -> Option<Outcome> {
    // A source that failed authentication repeatedly waits for its turn (the connection's
    // login timeout still runs).
    let wait = lock(&registry.auth).admit(peer.addr.ip(), Instant::now());
    if !wait.is_zero() {
        tracing::debug!(peer = %peer.addr, ?wait, "login slowed after authentication failures");
        tokio::time::sleep(wait).await;
    }
    let mut login = Login::new();
    let mut policy = registry.admission(peer);
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
            Step::Done(r, done) => {
                registry.count_login(false, r.status);
                (r, Some(done))
            }
            Step::Refused(r) => {
                registry.login_refused(peer, &login, &req, r.status);
                let _ = writer.send_pdu(Pdu::LoginResponse(r)).await;
                return None;
            }
        };
        if writer.send_pdu(Pdu::LoginResponse(response)).await.is_err() {
            return None;
        }
        let Some(done) = done else { continue };
        return Some(Outcome::of(*done, policy.take_session()));
    }
}
