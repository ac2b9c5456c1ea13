//! The target's login machine against an initiator-role `Negotiator`, in memory: normal and
//! discovery sessions, CHAP one-way and mutual and their failures, access refusals, and the
//! request-sequence rules (stages forward only, one ISID/TSIH/CID, the version, missing keys).

use bytes::Bytes;
use iscsi_pdu::chap::{ChapCredentials, ENTROPY_LEN};
use iscsi_pdu::negotiation::{
    AuthMethod, AuthSettings, NegotiationError, Negotiator, Role, SessionType, Settings,
};
use iscsi_pdu::target_node::{Completed, Login, LoginPolicy, Step};
use iscsi_pdu::text::TextParams;
use iscsi_pdu::{Isid, LoginRequest, LoginResponse, LoginStatus, SerialNumber, Stage};

const TARGET: &str = "iqn.2026-11.io.example:disk";
const INITIATOR: &str = "iqn.2026-11.io.example:host";

fn creds(name: &str, secret: &str) -> ChapCredentials {
    ChapCredentials::new(name, secret.as_bytes(), 12).expect("valid credentials")
}

/// A daemon with one target, optional CHAP, and a record of what it was asked.
#[derive(Default)]
struct Policy {
    chap: Option<ChapCredentials>,
    mutual: Option<ChapCredentials>,
    deny: bool,
    /// The OS has no random bytes to give.
    no_entropy: bool,
    refusals: Vec<String>,
    sessions: u16,
}

impl LoginPolicy for Policy {
    fn normal(&mut self, _: &str, target: &str, tsih: u16) -> Result<Settings, LoginStatus> {
        if target != TARGET {
            return Err(LoginStatus::NOT_FOUND);
        }
        if self.deny {
            return Err(LoginStatus::AUTHORIZATION_FAILURE);
        }
        if tsih != 0 && tsih > self.sessions {
            return Err(LoginStatus::SESSION_DOES_NOT_EXIST);
        }
        let mut s = Settings::default();
        if let Some(c) = &self.chap {
            s.auth.methods = vec![AuthMethod::Chap];
            s.auth.peer = Some(c.clone());
            s.auth.local = self.mutual.clone();
        }
        Ok(s)
    }

    fn discovery(&mut self, _: &str) -> Result<Settings, LoginStatus> {
        Ok(Settings::default())
    }

    fn refused(&mut self, _: &str, _: Option<&str>, e: &NegotiationError) {
        self.refusals.push(e.to_string());
    }

    fn window(&self, _: u16, cmd_sn: SerialNumber) -> (SerialNumber, SerialNumber) {
        (cmd_sn, cmd_sn + 31)
    }

    fn complete(
        &mut self,
        login: &Completed,
    ) -> Result<(u16, SerialNumber, SerialNumber), LoginStatus> {
        if login.tsih != 0 {
            return Ok((login.tsih, login.cmd_sn, login.cmd_sn + 31));
        }
        self.sessions += 1;
        Ok((self.sessions, login.cmd_sn, login.cmd_sn + 31))
    }

    fn entropy(&mut self) -> Result<[u8; ENTROPY_LEN], LoginStatus> {
        if self.no_entropy {
            return Err(LoginStatus::TARGET_ERROR);
        }
        Ok([9; ENTROPY_LEN])
    }
}

/// The initiator's settings for `target` (`None`: discovery), with CHAP when given.
fn initiator(
    target: Option<&str>,
    chap: Option<ChapCredentials>,
    mutual: Option<ChapCredentials>,
) -> Settings {
    let mut s = Settings::default();
    s.declarations.initiator_name = Some(INITIATOR.into());
    s.declarations.target_name = target.map(str::to_string);
    s.declarations.session_type = if target.is_some() {
        SessionType::Normal
    } else {
        SessionType::Discovery
    };
    if let Some(c) = chap {
        s.auth = AuthSettings {
            methods: vec![AuthMethod::Chap],
            local: Some(c),
            peer: mutual,
            require_mutual: false,
        };
    }
    s
}

/// Runs a login as an initiator would: the security stage (when CHAP is offered), then the
/// operational stage, then full feature phase.
fn login(
    policy: &mut Policy,
    settings: Settings,
    tsih: u16,
) -> Result<(LoginResponse, Completed), LoginResponse> {
    let chap = settings.auth.methods == [AuthMethod::Chap];
    let mut neg = Negotiator::new(Role::Initiator, settings, tsih == 0, [3; ENTROPY_LEN]);
    let mut machine = Login::new();
    let mut stage = Stage::SecurityNegotiation;
    let mut out = neg.offers(stage);
    let mut exp_stat_sn = SerialNumber(0);
    for itt in 0..16 {
        let next = if stage == Stage::SecurityNegotiation {
            Stage::LoginOperationalNegotiation
        } else {
            Stage::FullFeaturePhase
        };
        let transit = stage != Stage::SecurityNegotiation
            || !chap
            || out.get("CHAP_R").is_some()
            || neg.authenticated();
        let req = LoginRequest {
            transit,
            current_stage: stage,
            next_stage: if transit { next } else { stage },
            isid: Isid([0x80, 0, 0, 0, 0, 1]),
            tsih,
            initiator_task_tag: itt,
            cid: 1,
            cmd_sn: SerialNumber(5),
            exp_stat_sn,
            data: out.encode(),
            ..LoginRequest::default()
        };
        let (r, done) = match machine.handle_request(&req, policy) {
            Step::Refused(r) => return Err(r),
            Step::Continue(r) => (r, None),
            Step::Done(r, done) => (r, Some(done)),
        };
        assert_eq!(r.status, LoginStatus::SUCCESS);
        exp_stat_sn = r.stat_sn.next();
        let params = TextParams::parse(&r.data).expect("the target's text parses");
        let reply = neg
            .receive(stage, &params)
            .expect("the target's answers are valid");
        if let Some(done) = done {
            assert!(r.transit && r.next_stage == Stage::FullFeaturePhase);
            assert!(!neg.is_waiting(), "every key answered");
            return Ok((r, *done));
        }
        if r.transit {
            stage = r.next_stage;
            out = reply;
            out.extend(neg.offers(stage));
        } else {
            out = reply;
        }
    }
    panic!("the login did not end");
}

#[test]
fn a_normal_login_creates_a_session() {
    let mut p = Policy::default();
    let (r, done) = login(&mut p, initiator(Some(TARGET), None, None), 0).expect("login");
    assert_eq!(r.tsih, 1);
    assert_eq!(
        (r.exp_cmd_sn, r.max_cmd_sn),
        (SerialNumber(5), SerialNumber(36))
    );
    assert_eq!(done.target.as_deref(), Some(TARGET));
    assert_eq!(done.initiator, INITIATOR);
    assert_eq!(done.stat_sn, r.stat_sn.next());
    // A second connection joins it.
    let (r, done) = login(&mut p, initiator(Some(TARGET), None, None), 1).expect("join");
    assert_eq!((r.tsih, done.tsih), (1, 1));
    // A session that does not exist.
    let e = login(&mut p, initiator(Some(TARGET), None, None), 7).unwrap_err();
    assert_eq!(e.status, LoginStatus::SESSION_DOES_NOT_EXIST);
}

#[test]
fn a_discovery_login_has_no_target() {
    let mut p = Policy::default();
    let (_, done) = login(&mut p, initiator(None, None, None), 0).expect("login");
    assert_eq!(done.target, None);
}

#[test]
fn unknown_targets_and_denied_initiators_are_refused() {
    let mut p = Policy::default();
    let e = login(
        &mut p,
        initiator(Some("iqn.2026-11.io.example:none"), None, None),
        0,
    )
    .unwrap_err();
    assert_eq!(e.status, LoginStatus::NOT_FOUND);
    p.deny = true;
    let e = login(&mut p, initiator(Some(TARGET), None, None), 0).unwrap_err();
    assert_eq!(e.status, LoginStatus::AUTHORIZATION_FAILURE);
    assert_eq!(p.sessions, 0);
}

#[test]
fn without_random_bytes_a_login_fails_closed() {
    let mut p = Policy {
        chap: Some(creds("host", "initiator-secret")),
        no_entropy: true,
        ..Policy::default()
    };
    let e = login(
        &mut p,
        initiator(Some(TARGET), Some(creds("host", "initiator-secret")), None),
        0,
    )
    .unwrap_err();
    assert_eq!(e.status, LoginStatus::TARGET_ERROR);
    assert_eq!(p.sessions, 0);
}

#[test]
fn chap_one_way_mutual_and_wrong_secrets() {
    let user = creds("host", "initiator-secret");
    let target = creds("disk", "the-target-secret");
    let mut p = Policy {
        chap: Some(user.clone()),
        ..Policy::default()
    };
    login(&mut p, initiator(Some(TARGET), Some(user.clone()), None), 0).expect("one-way CHAP");
    // Without CHAP the initiator cannot get in.
    let e = login(&mut p, initiator(Some(TARGET), None, None), 0).unwrap_err();
    assert_eq!(e.status.0 >> 8, 2, "an initiator error: {:?}", e.status);
    // A wrong secret.
    let wrong = creds("host", "not-the-secret");
    let e = login(&mut p, initiator(Some(TARGET), Some(wrong), None), 0).unwrap_err();
    assert_eq!(e.status, LoginStatus::AUTHENTICATION_FAILURE);
    assert!(!p.refusals.is_empty(), "the refusal reached the policy");
    assert!(
        p.refusals
            .iter()
            .all(|r| !r.contains("initiator-secret") && !r.contains("not-the-secret")),
        "no secret in a refusal: {:?}",
        p.refusals
    );
    // Mutual: the target proves itself too.
    p.mutual = Some(target.clone());
    login(&mut p, initiator(Some(TARGET), Some(user), Some(target)), 0).expect("mutual CHAP");
}

fn request(stage: Stage, next: Stage, transit: bool, text: &str) -> LoginRequest {
    LoginRequest {
        transit,
        current_stage: stage,
        next_stage: next,
        isid: Isid([0x80, 0, 0, 0, 0, 2]),
        cmd_sn: SerialNumber(1),
        data: Bytes::copy_from_slice(text.as_bytes()),
        ..LoginRequest::default()
    }
}

fn refused(step: Step) -> LoginStatus {
    match step {
        Step::Refused(r) => r.status,
        other => panic!("not refused: {other:?}"),
    }
}

#[test]
fn the_request_sequence_is_checked() {
    const OP: Stage = Stage::LoginOperationalNegotiation;
    const FFP: Stage = Stage::FullFeaturePhase;
    let names = format!("InitiatorName={INITIATOR}\0TargetName={TARGET}\0");
    let mut p = Policy::default();
    // No InitiatorName.
    let r = Login::new().handle_request(&request(OP, OP, false, "SessionType=Normal\0"), &mut p);
    assert_eq!(refused(r), LoginStatus::MISSING_PARAMETER);
    // An unsupported version.
    let mut v = request(OP, OP, false, &names);
    v.version_min = 1;
    assert_eq!(
        refused(Login::new().handle_request(&v, &mut p)),
        LoginStatus::UNSUPPORTED_VERSION
    );
    // A session type that does not exist.
    let r = Login::new().handle_request(
        &request(OP, OP, false, "InitiatorName=a\0SessionType=Other\0"),
        &mut p,
    );
    assert_eq!(refused(r), LoginStatus::SESSION_TYPE_NOT_SUPPORTED);
    // A transit backwards.
    let r = Login::new().handle_request(
        &request(OP, Stage::SecurityNegotiation, true, &names),
        &mut p,
    );
    assert_eq!(refused(r), LoginStatus::INITIATOR_ERROR);
    // The ISID changing half-way.
    let mut l = Login::new();
    assert!(matches!(
        l.handle_request(&request(OP, OP, false, &names), &mut p),
        Step::Continue(_)
    ));
    let mut other = request(OP, FFP, true, "");
    other.isid = Isid([0x80, 0, 0, 0, 0, 3]);
    assert_eq!(
        refused(l.handle_request(&other, &mut p)),
        LoginStatus::INITIATOR_ERROR
    );
    assert_eq!(p.sessions, 0);
}

#[test]
fn a_request_continued_over_several_pdus_is_reassembled() {
    let mut p = Policy::default();
    let names = format!("InitiatorName={INITIATOR}\0TargetName={TARGET}\0SessionType=Normal\0");
    let (a, b) = names.split_at(20);
    let op = Stage::LoginOperationalNegotiation;
    let mut l = Login::new();
    let mut first = request(op, op, false, a);
    first.continue_bit = true;
    let Step::Continue(r) = l.handle_request(&first, &mut p) else {
        panic!("an empty response invites the rest")
    };
    assert!(r.data.is_empty());
    let rest = request(op, Stage::FullFeaturePhase, true, b);
    let Step::Done(r, done) = l.handle_request(&rest, &mut p) else {
        panic!("the login completes")
    };
    assert_eq!(r.tsih, 1);
    assert_eq!(done.initiator, INITIATOR);
}
