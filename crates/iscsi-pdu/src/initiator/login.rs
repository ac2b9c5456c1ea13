//! An initiator's login (RFC 7143 section 6) as a state machine: the security and operational
//! stages through the [`Negotiator`] (and CHAP) to full feature phase, text split over several
//! requests when it is long (each partial request answered by an empty response) and responses
//! reassembled (asking for the rest with empty requests).
//!
//! Send what [`Login::poll_transmit`] hands out, feed each Login Response to
//! [`Login::handle_response`] until it returns [`Established`] or an error.

use std::collections::VecDeque;

use bytes::Bytes;

use crate::chap::ENTROPY_LEN;
use crate::negotiation::{
    AuthMethod, ConnectionParams, NegotiationError, Negotiator, Role, SessionParams, Settings,
};
use crate::text::{split_text, TextParams, TextReassembler};
use crate::{
    Isid, LoginRequest, LoginResponse, LoginStatus, Pdu, SerialNumber, Stage,
    LOGIN_MAX_RECV_DATA_SEGMENT_LENGTH,
};

/// What a finished login established.
#[derive(Debug, Clone)]
pub struct Established {
    /// Session parameters (the leading connection's).
    pub session: SessionParams,
    /// This connection's parameters.
    pub connection: ConnectionParams,
    /// TSIH the target assigned.
    pub tsih: u16,
    /// The next StatSN expected on this connection.
    pub exp_stat_sn: SerialNumber,
    /// ExpCmdSN from the final response.
    pub exp_cmd_sn: SerialNumber,
    /// MaxCmdSN from the final response.
    pub max_cmd_sn: SerialNumber,
}

/// Why a login failed. Each variant's text includes what it wraps, which is therefore not
/// also a source (a chain printed whole would repeat it).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LoginError {
    /// The target refused it with this status.
    #[error("login refused: status {0:?}")]
    Refused(LoginStatus),
    /// Negotiation or authentication failed.
    #[error("negotiation: {0}")]
    Negotiation(NegotiationError),
    /// The target broke the login's rules.
    #[error("protocol violation by the target during login: {0}")]
    Protocol(String),
}

impl From<NegotiationError> for LoginError {
    fn from(e: NegotiationError) -> LoginError {
        LoginError::Negotiation(e)
    }
}

/// Where the exchange of one request's text stands.
#[derive(Debug)]
enum Exchange {
    /// Segments of the request still to send, each after the target's empty answer to the
    /// previous one.
    Sending(VecDeque<(Bytes, bool)>),
    /// The whole request is out; the response is coming, perhaps in parts.
    Receiving(TextReassembler),
}

/// One connection's login, from the initiator's side.
#[derive(Debug)]
pub struct Login {
    neg: Negotiator,
    stage: Stage,
    chap_offered: bool,
    /// The request being exchanged, without its text.
    request: LoginRequest,
    exchange: Exchange,
    exp_stat_sn: SerialNumber,
    out: VecDeque<Pdu>,
}

impl Login {
    /// A login with `settings` (declarations included: InitiatorName, TargetName or discovery)
    /// for ISID `isid`, joining session `tsih` (0 for a new one) as connection `cid`, its
    /// first request carrying `cmd_sn`. `entropy` seeds CHAP challenges.
    pub fn new(
        settings: Settings,
        isid: Isid,
        tsih: u16,
        cid: u16,
        cmd_sn: SerialNumber,
        entropy: [u8; ENTROPY_LEN],
    ) -> Login {
        let chap_offered =
            !settings.auth.methods.is_empty() && settings.auth.methods != [AuthMethod::None];
        let mut neg = Negotiator::new(Role::Initiator, settings, tsih == 0, entropy);
        let stage = Stage::SecurityNegotiation;
        let out = neg.offers(stage);
        let request = LoginRequest {
            current_stage: stage,
            isid,
            tsih,
            initiator_task_tag: 0,
            cid,
            cmd_sn,
            ..LoginRequest::default()
        };
        let mut login = Login {
            neg,
            stage,
            chap_offered,
            request,
            exchange: Exchange::Receiving(TextReassembler::default()),
            exp_stat_sn: SerialNumber(0),
            out: VecDeque::new(),
        };
        login.send(out);
        login
    }

    /// The next Login Request to send.
    pub fn poll_transmit(&mut self) -> Option<Pdu> {
        self.out.pop_front()
    }

    /// Starts the exchange of a request carrying `text`: the first segment now, the rest as
    /// the target acknowledges each.
    fn send(&mut self, text: TextParams) {
        let next = if self.stage == Stage::SecurityNegotiation {
            Stage::LoginOperationalNegotiation
        } else {
            Stage::FullFeaturePhase
        };
        // Ask to move on unless a CHAP step is still to come from our side.
        let transit = self.stage != Stage::SecurityNegotiation
            || !self.chap_offered
            || text.get("CHAP_R").is_some()
            || self.neg.authenticated();
        self.request.transit = transit;
        self.request.current_stage = self.stage;
        self.request.next_stage = if transit { next } else { self.stage };
        self.request.exp_stat_sn = self.exp_stat_sn;
        let text = text.encode();
        let segments = split_text(&text, LOGIN_MAX_RECV_DATA_SEGMENT_LENGTH as usize).collect();
        self.exchange = Exchange::Sending(segments);
        self.send_segment();
    }

    fn send_segment(&mut self) {
        let Exchange::Sending(segments) = &mut self.exchange else {
            return;
        };
        let (data, more) = segments.pop_front().unwrap_or_default();
        self.out.push_back(Pdu::LoginRequest(LoginRequest {
            continue_bit: more,
            transit: self.request.transit && !more,
            exp_stat_sn: self.exp_stat_sn,
            data,
            ..self.request.clone()
        }));
        if !more {
            self.exchange = Exchange::Receiving(TextReassembler::default());
        }
    }

    /// A Login Response: `Ok(Some)` once the connection is in full feature phase, `Ok(None)`
    /// while the login goes on (send what [`Login::poll_transmit`] has).
    pub fn handle_response(&mut self, r: LoginResponse) -> Result<Option<Established>, LoginError> {
        if r.status != LoginStatus::SUCCESS {
            return Err(LoginError::Refused(r.status));
        }
        if r.initiator_task_tag != self.request.initiator_task_tag {
            return Err(LoginError::Protocol(
                "login response for another task".into(),
            ));
        }
        self.exp_stat_sn = r.stat_sn.next();
        let whole = match &mut self.exchange {
            Exchange::Sending(_) => {
                // The empty answer to a partial request.
                self.send_segment();
                return Ok(None);
            }
            Exchange::Receiving(text) => text
                .push(&r.data, r.continue_bit)
                .map_err(|e| LoginError::Protocol(format!("login text: {e}")))?,
        };
        let Some(text) = whole else {
            // Ask for the rest with an empty request of the same stage.
            self.out.push_back(Pdu::LoginRequest(LoginRequest {
                transit: false,
                continue_bit: false,
                next_stage: self.request.current_stage,
                exp_stat_sn: self.exp_stat_sn,
                data: Bytes::new(),
                ..self.request.clone()
            }));
            return Ok(None);
        };
        self.response(&r, &text).map(|e| e.map(|e| *e))
    }

    /// The whole text of a response.
    fn response(
        &mut self,
        r: &LoginResponse,
        text: &Bytes,
    ) -> Result<Option<Box<Established>>, LoginError> {
        let params = TextParams::parse(text)
            .map_err(|e| LoginError::Protocol(format!("login text: {e}")))?;
        let stage = self.stage;
        let mut reply = self.neg.receive(stage, &params)?;
        self.request.initiator_task_tag = self.request.initiator_task_tag.wrapping_add(1);
        if !r.transit {
            self.send(reply);
            return Ok(None);
        }
        if r.next_stage <= stage || r.next_stage == Stage::Reserved || !self.request.transit {
            return Err(LoginError::Protocol(format!(
                "login response moves from {stage:?} to {:?}",
                r.next_stage
            )));
        }
        if stage == Stage::SecurityNegotiation && !self.neg.authenticated() {
            return Err(LoginError::Protocol(
                "target left the security stage before authentication".into(),
            ));
        }
        self.stage = r.next_stage;
        if self.stage == Stage::FullFeaturePhase {
            if self.neg.is_waiting() {
                return Err(LoginError::Protocol(
                    "target entered full feature phase with keys unanswered".into(),
                ));
            }
            return Ok(Some(Box::new(Established {
                session: self.neg.session().clone(),
                connection: *self.neg.connection(),
                tsih: r.tsih,
                exp_stat_sn: self.exp_stat_sn,
                exp_cmd_sn: r.exp_cmd_sn,
                max_cmd_sn: r.max_cmd_sn,
            })));
        }
        reply.extend(self.neg.offers(self.stage));
        self.send(reply);
        Ok(None)
    }
}
