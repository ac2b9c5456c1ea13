//! The target's login phase (RFC 7143 section 6) as a state machine without I/O: each Login
//! Request in, its Login Response out. It checks the request sequence (one ISID, TSIH and CID
//! throughout, stages that only move forward), reassembles long requests and continues long
//! responses, negotiates through a [`Negotiator`] (CHAP included), and asks a [`LoginPolicy`]
//! the questions only the daemon can answer: which targets exist, who may reach them with which
//! credentials, and the session the login creates or joins.

use bytes::Bytes;

use crate::chap::ENTROPY_LEN;
use crate::negotiation::{NegotiationError, Negotiator, Role, SessionType, Settings};
use crate::text::{split_text, TextParams, TextReassembler};
use crate::{Isid, LoginRequest, LoginResponse, LoginStatus, SerialNumber, Stage};

/// What a login needs from the daemon. Each refusal is a Login Response status; the policy logs
/// its own reasons.
pub trait LoginPolicy {
    /// The settings to negotiate a normal session of `initiator` with `target` (its CHAP
    /// credentials included), or why not: `NOT_FOUND`, `AUTHORIZATION_FAILURE`,
    /// `SESSION_DOES_NOT_EXIST` (a `tsih` to join that is not live), `SERVICE_UNAVAILABLE`.
    fn normal(&mut self, initiator: &str, target: &str, tsih: u16)
        -> Result<Settings, LoginStatus>;
    /// The settings to negotiate a discovery session of `initiator`, or why not.
    fn discovery(&mut self, initiator: &str) -> Result<Settings, LoginStatus>;
    /// The negotiation failed (a key out of range, a wrong CHAP response, ...).
    fn refused(&mut self, initiator: &str, target: Option<&str>, error: &NegotiationError);
    /// ExpCmdSN and MaxCmdSN for a response before the last: the window of session `tsih`
    /// when the login joins one, else a new session's window from `cmd_sn`.
    fn window(&self, tsih: u16, cmd_sn: SerialNumber) -> (SerialNumber, SerialNumber);
    /// The final transit: create the session (or, for `login.tsih != 0`, join it) and return
    /// its TSIH, ExpCmdSN and MaxCmdSN; or why not (`TOO_MANY_CONNECTIONS`, ...).
    fn complete(
        &mut self,
        login: &Completed,
    ) -> Result<(u16, SerialNumber, SerialNumber), LoginStatus>;
    /// Fresh random bytes for CHAP identifiers and challenges, from a CSPRNG; without them
    /// the login fails (fail closed: a predictable challenge lets a recorded answer replay).
    fn entropy(&mut self) -> Result<[u8; ENTROPY_LEN], LoginStatus>;
}

/// A login that has reached full feature phase.
#[derive(Debug)]
pub struct Completed {
    /// The negotiation, kept for text exchanges in full feature phase.
    pub negotiator: Negotiator,
    /// InitiatorName.
    pub initiator: String,
    /// TargetName; `None` for a discovery session.
    pub target: Option<String>,
    /// ISID.
    pub isid: Isid,
    /// The TSIH the initiator asked for: 0 for a new session, else the session to join.
    pub tsih: u16,
    /// The connection's CID.
    pub cid: u16,
    /// The CmdSN of the last request (a new session's first ExpCmdSN).
    pub cmd_sn: SerialNumber,
    /// The connection's next StatSN.
    pub stat_sn: SerialNumber,
}

/// What answering a Login Request ends in.
#[derive(Debug)]
#[must_use = "a login step holds the Login Response to send"]
pub enum Step {
    /// Send the response; the login goes on.
    Continue(LoginResponse),
    /// Send the response; full feature phase starts.
    Done(LoginResponse, Box<Completed>),
    /// Send the response; the login has failed: close the connection.
    Refused(LoginResponse),
}

/// One connection's login phase.
#[derive(Debug, Default)]
pub struct Login {
    negotiator: Option<Negotiator>,
    initiator: String,
    target: Option<String>,
    first: Option<LoginRequest>,
    stat_sn: SerialNumber,
    text: TextReassembler,
    /// The rest of a response too long for one PDU, and how much of it was sent.
    more: Option<(Bytes, usize)>,
}

impl Login {
    /// A connection that has sent nothing yet.
    pub fn new() -> Login {
        Login::default()
    }

    /// The InitiatorName the login gave (empty before its first request).
    pub fn initiator(&self) -> &str {
        &self.initiator
    }

    /// The TargetName a normal login asked for (none before it, and for discovery).
    pub fn target(&self) -> Option<&str> {
        self.target.as_deref()
    }

    /// Answers one Login Request.
    pub fn handle_request(&mut self, req: &LoginRequest, policy: &mut impl LoginPolicy) -> Step {
        match self.step(req, policy) {
            Ok((r, None)) => Step::Continue(r),
            Ok((r, Some(done))) => Step::Done(r, Box::new(done)),
            Err(status) => Step::Refused(self.response(req, status)),
        }
    }

    fn response(&self, req: &LoginRequest, status: LoginStatus) -> LoginResponse {
        LoginResponse {
            current_stage: req.current_stage,
            next_stage: req.current_stage,
            isid: req.isid,
            tsih: req.tsih,
            initiator_task_tag: req.initiator_task_tag,
            stat_sn: self.stat_sn,
            exp_cmd_sn: req.cmd_sn,
            max_cmd_sn: req.cmd_sn,
            status,
            ..LoginResponse::default()
        }
    }

    fn step(
        &mut self,
        req: &LoginRequest,
        policy: &mut impl LoginPolicy,
    ) -> Result<(LoginResponse, Option<Completed>), LoginStatus> {
        match &self.first {
            None => {
                self.stat_sn = req.exp_stat_sn;
                if req.version_min > 0 {
                    return Err(LoginStatus::UNSUPPORTED_VERSION);
                }
                self.first = Some(req.clone());
            }
            Some(first) => {
                if req.isid != first.isid || req.tsih != first.tsih || req.cid != first.cid {
                    return Err(LoginStatus::INITIATOR_ERROR);
                }
                self.stat_sn = self.stat_sn.next();
            }
        }
        if matches!(req.current_stage, Stage::FullFeaturePhase | Stage::Reserved)
            || (req.transit
                && (req.next_stage <= req.current_stage || req.next_stage == Stage::Reserved))
        {
            return Err(LoginStatus::INITIATOR_ERROR);
        }
        let mut r = self.response(req, LoginStatus::SUCCESS);
        // The rest of a long response, asked for with empty requests.
        if let Some((text, at)) = self.more.take() {
            return Ok((self.continue_response(r, text, at), None));
        }
        let all = match self.text.push(&req.data, req.continue_bit) {
            Ok(Some(all)) => all,
            // More of the initiator's text follows: acknowledge with an empty response.
            Ok(None) => return Ok((r, None)),
            Err(_) => return Err(LoginStatus::INITIATOR_ERROR),
        };
        let params = TextParams::parse(&all).map_err(|_| LoginStatus::INITIATOR_ERROR)?;
        if self.negotiator.is_none() {
            self.negotiator = Some(self.start(req, &params, policy)?);
        }
        let neg = self.negotiator.as_mut().expect("set above");
        let target = self.target.as_deref();
        let mut refuse = |e: NegotiationError| {
            policy.refused(&self.initiator, target, &e);
            e.login_status()
        };
        let out = neg
            .receive(req.current_stage, &params)
            .and_then(|out| neg.require_initiator_declarations().map(|()| out))
            .map_err(&mut refuse)?;
        let transit = req.transit
            && neg
                .may_transit(req.current_stage, req.next_stage)
                .map_err(&mut refuse)?;
        r.transit = transit;
        r.next_stage = if transit {
            req.next_stage
        } else {
            req.current_stage
        };
        let text = out.encode();
        let long = text.len() > crate::LOGIN_MAX_RECV_DATA_SEGMENT_LENGTH as usize;
        if transit && req.next_stage == Stage::FullFeaturePhase {
            if long {
                // Cannot both finish and continue; the keys that make a response this long
                // are CHAP's, which never come with the final transit.
                return Err(LoginStatus::TARGET_ERROR);
            }
            let done = Completed {
                negotiator: self.negotiator.take().expect("negotiating"),
                initiator: self.initiator.clone(),
                target: self.target.clone(),
                isid: req.isid,
                tsih: req.tsih,
                cid: req.cid,
                cmd_sn: req.cmd_sn,
                stat_sn: self.stat_sn.next(),
            };
            (r.tsih, r.exp_cmd_sn, r.max_cmd_sn) = policy.complete(&done)?;
            r.data = text;
            return Ok((r, Some(done)));
        }
        (r.exp_cmd_sn, r.max_cmd_sn) = policy.window(req.tsih, req.cmd_sn);
        if long {
            r.transit = false;
            r.next_stage = req.current_stage;
            return Ok((self.continue_response(r, text, 0), None));
        }
        r.data = text;
        Ok((r, None))
    }

    fn continue_response(&mut self, mut r: LoginResponse, text: Bytes, at: usize) -> LoginResponse {
        let max = crate::LOGIN_MAX_RECV_DATA_SEGMENT_LENGTH as usize;
        let rest = text.slice(at..);
        let (chunk, more) = split_text(&rest, max)
            .next()
            .unwrap_or((Bytes::new(), false));
        r.transit = false;
        r.continue_bit = more;
        if more {
            self.more = Some((text, at + chunk.len()));
        }
        r.data = chunk;
        r
    }

    /// The first request: who is connecting to what, and may they.
    fn start(
        &mut self,
        req: &LoginRequest,
        params: &TextParams,
        policy: &mut impl LoginPolicy,
    ) -> Result<Negotiator, LoginStatus> {
        let initiator = params
            .get("InitiatorName")
            .ok_or(LoginStatus::MISSING_PARAMETER)?;
        self.initiator = initiator.to_string();
        let session_type = match params.get("SessionType") {
            None | Some("Normal") => SessionType::Normal,
            Some("Discovery") => SessionType::Discovery,
            Some(_) => return Err(LoginStatus::SESSION_TYPE_NOT_SUPPORTED),
        };
        let settings = match session_type {
            SessionType::Normal => {
                let target = params
                    .get("TargetName")
                    .ok_or(LoginStatus::MISSING_PARAMETER)?;
                let s = policy.normal(initiator, target, req.tsih)?;
                self.target = Some(target.to_string());
                s
            }
            SessionType::Discovery => policy.discovery(initiator)?,
        };
        Ok(Negotiator::new(
            Role::Target,
            settings,
            req.tsih == 0,
            policy.entropy()?,
        ))
    }
}
