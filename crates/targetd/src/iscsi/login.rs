//! The login phase (RFC 7143 section 6): security and operational negotiation through
//! iscsi-pdu's [`Negotiator`], access control, CHAP, and the session the login creates or joins.

use std::io::Read;
use std::net::SocketAddr;
use std::sync::Arc;

use bytes::Bytes;
use iscsi_pdu::chap::{ChapCredentials, ENTROPY_LEN};
use iscsi_pdu::negotiation::{AuthMethod, NegotiationError, Negotiator, Role, SessionType};
use iscsi_pdu::text::{split_text, TextParams, TextReassembler};
use iscsi_pdu::{Isid, LoginRequest, LoginResponse, LoginStatus, Pdu, SerialNumber, Stage};

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

struct State {
    negotiator: Option<Negotiator>,
    target: Option<Arc<Target>>,
    initiator: String,
    session_type: SessionType,
    first: Option<LoginRequest>,
    stat_sn: SerialNumber,
    text: TextReassembler,
    /// The rest of a response too long for one PDU.
    more: Option<(Bytes, usize)>,
}

/// Runs the login phase to its end: `Some` when the connection enters full feature phase,
/// `None` when the login failed (the refusal has been sent).
pub async fn run(
    reader: &mut Reader,
    writer: &mut Writer,
    shared: &Arc<Shared>,
    peer: &Peer,
) -> Option<Outcome> {
    let mut st = State {
        negotiator: None,
        target: None,
        initiator: String::new(),
        session_type: SessionType::Normal,
        first: None,
        stat_sn: SerialNumber(0),
        text: TextReassembler::default(),
        more: None,
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
        match step(&mut st, &req, shared, peer) {
            Ok((response, outcome)) => {
                if writer.send_pdu(Pdu::LoginResponse(response)).await.is_err() {
                    return None;
                }
                if outcome.is_some() {
                    return outcome;
                }
            }
            Err(status) => {
                let r = response(&st, &req, status);
                let _ = writer.send_pdu(Pdu::LoginResponse(r)).await;
                return None;
            }
        }
    }
}

fn response(st: &State, req: &LoginRequest, status: LoginStatus) -> LoginResponse {
    LoginResponse {
        current_stage: req.current_stage,
        next_stage: req.current_stage,
        isid: req.isid,
        tsih: req.tsih,
        initiator_task_tag: req.initiator_task_tag,
        stat_sn: st.stat_sn,
        exp_cmd_sn: req.cmd_sn,
        max_cmd_sn: req.cmd_sn,
        status,
        ..LoginResponse::default()
    }
}

fn step(
    st: &mut State,
    req: &LoginRequest,
    shared: &Arc<Shared>,
    peer: &Peer,
) -> Result<(LoginResponse, Option<Outcome>), LoginStatus> {
    match &st.first {
        None => {
            st.stat_sn = req.exp_stat_sn;
            if req.version_min > 0 {
                return Err(LoginStatus::UNSUPPORTED_VERSION);
            }
            st.first = Some(req.clone());
        }
        Some(first) => {
            if req.isid != first.isid || req.tsih != first.tsih || req.cid != first.cid {
                return Err(LoginStatus::INITIATOR_ERROR);
            }
            st.stat_sn = st.stat_sn.next();
        }
    }
    if matches!(req.current_stage, Stage::FullFeaturePhase | Stage::Reserved)
        || (req.transit
            && (req.next_stage <= req.current_stage || req.next_stage == Stage::Reserved))
    {
        return Err(LoginStatus::INITIATOR_ERROR);
    }
    let mut r = response(st, req, LoginStatus::SUCCESS);
    // The rest of a long response, asked for with empty requests.
    if let Some((text, at)) = st.more.take() {
        return Ok((continue_response(st, r, text, at), None));
    }
    let all = match st.text.push(&req.data, req.continue_bit) {
        Ok(Some(all)) => all,
        // More of the initiator's text follows: acknowledge with an empty response.
        Ok(None) => return Ok((r, None)),
        Err(_) => return Err(LoginStatus::INITIATOR_ERROR),
    };
    let params = TextParams::parse(&all).map_err(|_| LoginStatus::INITIATOR_ERROR)?;
    if st.negotiator.is_none() {
        st.negotiator = Some(start(st, req, &params, shared, peer)?);
    }
    let neg = st.negotiator.as_mut().expect("set");
    let out = neg
        .receive(req.current_stage, &params)
        .and_then(|out| neg.require_initiator_declarations().map(|()| out))
        .map_err(|e| refuse(shared, peer, &st.initiator, st.target.as_deref(), &e))?;
    let transit = req.transit
        && neg
            .may_transit(req.current_stage, req.next_stage)
            .map_err(|e| refuse(shared, peer, &st.initiator, st.target.as_deref(), &e))?;
    r.transit = transit;
    r.next_stage = if transit {
        req.next_stage
    } else {
        req.current_stage
    };
    let mut outcome = None;
    if transit && req.next_stage == Stage::FullFeaturePhase {
        let (o, tsih, exp, max) = finish(st, req, shared, peer)?;
        r.tsih = tsih;
        r.exp_cmd_sn = exp;
        r.max_cmd_sn = max;
        outcome = Some(o);
    } else if let Some(s) = (req.tsih != 0)
        .then(|| shared.sessions.get(req.tsih))
        .flatten()
    {
        (r.exp_cmd_sn, r.max_cmd_sn) = s.window();
    } else {
        r.max_cmd_sn = req.cmd_sn + (shared.window() - 1);
    }
    let text = out.encode();
    if text.len() > iscsi_pdu::LOGIN_MAX_RECV_DATA_SEGMENT_LENGTH as usize {
        if outcome.is_some() {
            // Cannot both finish and continue; the keys that make a response this long are
            // CHAP's, which never come with the final transit.
            return Err(LoginStatus::TARGET_ERROR);
        }
        r.transit = false;
        r.next_stage = req.current_stage;
        return Ok((continue_response(st, r, text, 0), None));
    }
    r.data = text;
    Ok((r, outcome))
}

fn continue_response(
    st: &mut State,
    mut r: LoginResponse,
    text: Bytes,
    at: usize,
) -> LoginResponse {
    let max = iscsi_pdu::LOGIN_MAX_RECV_DATA_SEGMENT_LENGTH as usize;
    let rest = text.slice(at..);
    let (chunk, more) = split_text(&rest, max)
        .next()
        .unwrap_or((Bytes::new(), false));
    r.transit = false;
    r.continue_bit = more;
    if more {
        st.more = Some((text, at + chunk.len()));
    }
    r.data = chunk;
    r
}

/// The first request: who is connecting to what, and may they.
fn start(
    st: &mut State,
    req: &LoginRequest,
    params: &TextParams,
    shared: &Arc<Shared>,
    peer: &Peer,
) -> Result<Negotiator, LoginStatus> {
    let initiator = params
        .get("InitiatorName")
        .ok_or(LoginStatus::MISSING_PARAMETER)?;
    st.initiator = initiator.to_string();
    st.session_type = match params.get("SessionType") {
        None | Some("Normal") => SessionType::Normal,
        Some("Discovery") => SessionType::Discovery,
        Some(_) => return Err(LoginStatus::SESSION_TYPE_NOT_SUPPORTED),
    };
    if shared.stopping() {
        return Err(LoginStatus::SERVICE_UNAVAILABLE);
    }
    let mut settings = shared.settings();
    if st.session_type == SessionType::Normal {
        let name = params
            .get("TargetName")
            .ok_or(LoginStatus::MISSING_PARAMETER)?;
        let Some(target) = shared.target(name) else {
            shared.refused(peer.addr, initiator, name, "no such target");
            return Err(LoginStatus::NOT_FOUND);
        };
        if !target.admits(initiator, peer.addr.ip()) {
            shared.refused(
                peer.addr,
                initiator,
                name,
                "initiator or network not allowed",
            );
            return Err(LoginStatus::AUTHORIZATION_FAILURE);
        }
        if req.tsih != 0 && shared.sessions.get(req.tsih).is_none() {
            return Err(LoginStatus::SESSION_DOES_NOT_EXIST);
        }
        settings.declarations.target_portal_group_tag = Some(PORTAL_GROUP);
        let c = target
            .config
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        require_chap(&mut settings, c.chap.as_ref(), c.mutual_chap.as_ref());
        drop(c);
        st.target = Some(target);
    } else {
        let c = shared.config();
        let i = &c.iscsi;
        require_chap(
            &mut settings,
            i.discovery_chap.as_ref(),
            i.discovery_mutual_chap.as_ref(),
        );
    }
    Ok(Negotiator::new(
        Role::Target,
        settings,
        req.tsih == 0,
        entropy(),
    ))
}

/// Makes CHAP the only AuthMethod when `chap` is configured: the initiator proves `chap`, and
/// the target proves `mutual` when the initiator asks.
fn require_chap(
    settings: &mut iscsi_pdu::negotiation::Settings,
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

fn refuse(
    shared: &Shared,
    peer: &Peer,
    initiator: &str,
    target: Option<&Target>,
    e: &NegotiationError,
) -> LoginStatus {
    let status = e.login_status();
    shared.refused(
        peer.addr,
        initiator,
        target.map_or("discovery", |t| &t.name),
        &e.to_string(),
    );
    status
}

/// The final transit: create or join the session.
fn finish(
    st: &mut State,
    req: &LoginRequest,
    shared: &Arc<Shared>,
    peer: &Peer,
) -> Result<(Outcome, u16, SerialNumber, SerialNumber), LoginStatus> {
    let neg = st.negotiator.take().expect("negotiating");
    let c = *neg.connection();
    let info = ConnectionInfo {
        cid: req.cid,
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
    let stat_sn = st.stat_sn.next();
    let Some(target) = st.target.clone() else {
        let cmd = req.cmd_sn;
        return Ok((
            Outcome::Discovery {
                negotiator: neg,
                initiator: st.initiator.clone(),
                stat_sn,
                exp_cmd_sn: cmd,
            },
            // Discovery sessions are never joined; any non-zero TSIH outside the normal range.
            0x8000 | (peer.id & 0x7fff) as u16,
            cmd,
            cmd + (shared.window() - 1),
        ));
    };
    let session = if req.tsih == 0 {
        shared.sessions.create(
            req.isid,
            &st.initiator,
            target,
            neg.session().clone(),
            shared.window(),
            req.cmd_sn,
            info,
        )
    } else {
        shared
            .sessions
            .join(req.tsih, req.isid, &st.initiator, &target.name, info)
            .map_err(|e| match e {
                JoinError::NoSession => LoginStatus::SESSION_DOES_NOT_EXIST,
                JoinError::TooMany => LoginStatus::TOO_MANY_CONNECTIONS,
            })?
    };
    let (exp, max) = session.window();
    tracing::info!(
        tsih = session.tsih,
        initiator = %session.initiator,
        isid = %Isid(req.isid.0),
        target = %session.target.name,
        peer = %peer.addr,
        cid = req.cid,
        "login"
    );
    Ok((
        Outcome::Normal {
            session: session.clone(),
            negotiator: neg,
            stat_sn,
        },
        session.tsih,
        exp,
        max,
    ))
}
