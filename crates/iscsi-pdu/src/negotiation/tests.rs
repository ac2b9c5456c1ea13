use super::*;
use crate::chap::DEFAULT_MIN_SECRET_LEN;

const OP: Stage = Stage::LoginOperationalNegotiation;
const SEC: Stage = Stage::SecurityNegotiation;
const FFP: Stage = Stage::FullFeaturePhase;

fn target_settings() -> Settings {
    Settings {
        header_digest: vec![DigestAlgorithm::None, DigestAlgorithm::Crc32c],
        data_digest: vec![DigestAlgorithm::None, DigestAlgorithm::Crc32c],
        max_recv_data_segment_length: 262_144,
        task_reporting: vec![TaskReporting::Rfc3720, TaskReporting::ResponseFence],
        declarations: Declarations {
            target_portal_group_tag: Some(1),
            ..Declarations::default()
        },
        operational: OperationalParams {
            max_connections: 8,
            initial_r2t: false,
            immediate_data: true,
            max_burst_length: 1_048_576,
            first_burst_length: 262_144,
            default_time2wait: 2,
            default_time2retain: 20,
            max_outstanding_r2t: 16,
            error_recovery_level: 0,
            iscsi_protocol_level: 2,
            ..Settings::default().operational
        },
        ..Settings::default()
    }
}

fn params(pairs: &[(&str, &str)]) -> TextParams {
    let mut t = TextParams::new();
    for (k, v) in pairs {
        t.push(*k, *v);
    }
    t
}

fn target() -> Negotiator {
    Negotiator::new(Role::Target, target_settings(), true, [7; ENTROPY_LEN])
}

/// The target's answer to one offered key in the operational stage of a normal session.
fn answer(key: &str, value: &str) -> Result<Option<String>, NegotiationError> {
    let mut t = target();
    let out = t.receive(OP, &params(&[(key, value)]))?;
    Ok(out.get(key).map(str::to_string))
}

#[test]
fn target_answers_every_key() {
    // (key, offered, expected answer); None = no answer (declarative).
    let table: &[(&str, &str, Option<&str>)] = &[
        ("HeaderDigest", "CRC32C,None", Some("CRC32C")),
        ("HeaderDigest", "None", Some("None")),
        ("HeaderDigest", "MD5", Some("Reject")),
        ("DataDigest", "None,CRC32C", Some("None")),
        ("MaxConnections", "4", Some("4")),
        ("MaxConnections", "100", Some("8")),
        ("MaxConnections", "0", Some("Reject")),
        ("InitialR2T", "Yes", Some("Yes")),
        ("InitialR2T", "No", Some("No")),
        ("InitialR2T", "maybe", Some("Reject")),
        ("ImmediateData", "Yes", Some("Yes")),
        ("ImmediateData", "No", Some("No")),
        ("MaxBurstLength", "16776192", Some("1048576")),
        ("MaxBurstLength", "4096", Some("4096")),
        ("MaxBurstLength", "511", Some("Reject")),
        ("MaxBurstLength", "16777216", Some("Reject")),
        ("FirstBurstLength", "65536", Some("65536")),
        ("FirstBurstLength", "16776192", Some("262144")),
        ("DefaultTime2Wait", "0", Some("2")),
        ("DefaultTime2Wait", "10", Some("10")),
        ("DefaultTime2Wait", "3601", Some("Reject")),
        ("DefaultTime2Retain", "0", Some("0")),
        ("DefaultTime2Retain", "60", Some("20")),
        ("MaxOutstandingR2T", "1", Some("1")),
        ("MaxOutstandingR2T", "64", Some("16")),
        ("DataPDUInOrder", "No", Some("Yes")),
        ("DataSequenceInOrder", "No", Some("Yes")),
        ("ErrorRecoveryLevel", "2", Some("0")),
        ("ErrorRecoveryLevel", "3", Some("Reject")),
        (
            "TaskReporting",
            "FastAbort,ResponseFence",
            Some("ResponseFence"),
        ),
        ("TaskReporting", "FastAbort", Some("Reject")),
        ("iSCSIProtocolLevel", "1", Some("1")),
        ("iSCSIProtocolLevel", "31", Some("2")),
        ("iSCSIProtocolLevel", "32", Some("Reject")),
        ("IFMarker", "Yes", Some("No")),
        ("OFMarker", "No", Some("No")),
        ("IFMarkInt", "2048~8192", Some("Irrelevant")),
        ("OFMarkInt", "2048", Some("Irrelevant")),
        // A TCP connection cannot run iSER: its keys are refused or irrelevant.
        ("RDMAExtensions", "Yes", Some("No")),
        ("TargetRecvDataSegmentLength", "65536", Some("Irrelevant")),
        (
            "InitiatorRecvDataSegmentLength",
            "65536",
            Some("Irrelevant"),
        ),
        ("MaxOutstandingUnexpectedPDUs", "0", Some("Irrelevant")),
        ("X-com.example.Foo", "1", Some("NotUnderstood")),
        ("X#Registered", "1", Some("NotUnderstood")),
        ("NoSuchKey", "1", Some("NotUnderstood")),
        // Declared, not answered: what comes back is the target's own declaration.
        ("MaxRecvDataSegmentLength", "65536", Some("262144")),
        ("InitiatorName", "iqn.1994-05.com.example:a", None),
        ("InitiatorAlias", "host-a", None),
        ("TargetName", "iqn.2026-11.io.example:disk1", None),
        ("SessionType", "Normal", None),
    ];
    for (key, offered, expected) in table {
        assert_eq!(
            answer(key, offered).unwrap().as_deref(),
            *expected,
            "{key}={offered}"
        );
    }
}

#[test]
fn target_records_results_and_declarations() {
    let mut t = target();
    let req = params(&[
        ("InitiatorName", "iqn.1994-05.com.Example:A"),
        ("TargetName", "iqn.2026-11.io.example:disk1"),
        ("SessionType", "Normal"),
        ("HeaderDigest", "CRC32C"),
        ("DataDigest", "CRC32C,None"),
        ("FirstBurstLength", "524288"),
        ("MaxBurstLength", "131072"),
        ("MaxRecvDataSegmentLength", "32768"),
        ("InitialR2T", "No"),
    ]);
    let out = t.receive(OP, &req).unwrap();
    // FirstBurstLength came first but is bounded by the MaxBurstLength that followed it.
    assert_eq!(out.get("MaxBurstLength"), Some("131072"));
    assert_eq!(out.get("FirstBurstLength"), Some("131072"));
    // The target declares its own MaxRecvDataSegmentLength and its TPGT.
    assert_eq!(out.get("MaxRecvDataSegmentLength"), Some("262144"));
    assert_eq!(out.get("TargetPortalGroupTag"), Some("1"));
    let s = t.session();
    assert_eq!(
        s.declared.initiator_name.as_deref(),
        Some("iqn.1994-05.com.example:a")
    );
    assert!(!s.operational.initial_r2t);
    let c = t.connection();
    assert!(c.header_digest && c.data_digest);
    assert_eq!(c.max_send_data_segment_length, 32768);
    assert_eq!(c.max_recv_data_segment_length, 262_144);
    assert!(t.may_transit(OP, FFP).unwrap());
    t.require_initiator_declarations().unwrap();
}

#[test]
fn odd_cases() {
    // A key negotiated twice in one login.
    let mut t = target();
    t.receive(OP, &params(&[("MaxBurstLength", "65536")]))
        .unwrap();
    let e = t
        .receive(OP, &params(&[("MaxBurstLength", "65536")]))
        .unwrap_err();
    assert_eq!(
        e,
        NegotiationError::KeyRenegotiated("MaxBurstLength".into())
    );
    assert_eq!(e.login_status(), LoginStatus::INITIATOR_ERROR);

    // Security keys outside the security stage.
    let e = target()
        .receive(OP, &params(&[("AuthMethod", "None")]))
        .unwrap_err();
    assert!(matches!(e, NegotiationError::KeyNotAllowed { .. }));
    let e = target()
        .receive(OP, &params(&[("CHAP_A", "5")]))
        .unwrap_err();
    assert!(matches!(e, NegotiationError::KeyNotAllowed { .. }));

    // Keys only a target sends, offered by an initiator.
    let e = target()
        .receive(OP, &params(&[("TargetPortalGroupTag", "1")]))
        .unwrap_err();
    assert!(matches!(e, NegotiationError::KeyNotAllowed { .. }));

    // SendTargets during login.
    let e = target()
        .receive(OP, &params(&[("SendTargets", "All")]))
        .unwrap_err();
    assert!(matches!(e, NegotiationError::KeyNotAllowed { .. }));

    // Malformed declarations.
    let e = target()
        .receive(OP, &params(&[("MaxRecvDataSegmentLength", "100")]))
        .unwrap_err();
    assert!(matches!(e, NegotiationError::InvalidValue { .. }));
    let e = target()
        .receive(OP, &params(&[("InitiatorName", "not a name")]))
        .unwrap_err();
    assert!(matches!(e, NegotiationError::InvalidValue { .. }));
    let e = target()
        .receive(OP, &params(&[("SessionType", "Bogus")]))
        .unwrap_err();
    assert_eq!(e.login_status(), LoginStatus::SESSION_TYPE_NOT_SUPPORTED);

    // Missing declarations.
    let t = target();
    assert_eq!(
        t.require_initiator_declarations(),
        Err(NegotiationError::MissingParameter("InitiatorName"))
    );

    // Leading-only keys on a connection joining a session are irrelevant; IO keys still count.
    let mut t = Negotiator::new(Role::Target, target_settings(), false, [0; ENTROPY_LEN]);
    let out = t
        .receive(
            OP,
            &params(&[("MaxBurstLength", "4096"), ("HeaderDigest", "CRC32C")]),
        )
        .unwrap();
    assert_eq!(out.get("MaxBurstLength"), Some("Irrelevant"));
    assert_eq!(out.get("HeaderDigest"), Some("CRC32C"));

    // Discovery sessions: data-transfer keys are irrelevant, SessionType is read first.
    let mut t = target();
    let out = t
        .receive(
            OP,
            &params(&[
                ("MaxBurstLength", "4096"),
                ("InitialR2T", "No"),
                ("SessionType", "Discovery"),
            ]),
        )
        .unwrap();
    assert_eq!(out.get("MaxBurstLength"), Some("Irrelevant"));
    assert_eq!(out.get("InitialR2T"), Some("Irrelevant"));
    assert_eq!(out.get("TargetPortalGroupTag"), None);
    t.require_initiator_declarations().unwrap_err();

    // Full feature phase: declarations are fine, login-only keys are rejected, SendTargets is
    // left to the caller, and a new exchange may declare again.
    let mut t = target();
    t.receive(OP, &params(&[("MaxRecvDataSegmentLength", "8192")]))
        .unwrap();
    t.begin_text_exchange();
    let out = t
        .receive(
            FFP,
            &params(&[
                ("MaxRecvDataSegmentLength", "16384"),
                ("MaxBurstLength", "4096"),
                ("SendTargets", "All"),
            ]),
        )
        .unwrap();
    assert_eq!(out.get("MaxBurstLength"), Some("Reject"));
    assert_eq!(out.get("SendTargets"), None);
    assert_eq!(t.connection().max_send_data_segment_length, 16384);
}

#[test]
fn target_proposes_only_what_the_defaults_would_violate() {
    let settings = Settings {
        header_digest: vec![DigestAlgorithm::Crc32c],
        operational: OperationalParams {
            immediate_data: false,
            max_burst_length: 131_072,
            first_burst_length: 32_768,
            ..target_settings().operational
        },
        ..target_settings()
    };
    let mut t = Negotiator::new(Role::Target, settings, true, [0; ENTROPY_LEN]);
    let out = t.receive(OP, &params(&[("InitialR2T", "Yes")])).unwrap();
    assert_eq!(out.get("ImmediateData"), Some("No"));
    assert_eq!(out.get("MaxBurstLength"), Some("131072"));
    assert_eq!(out.get("FirstBurstLength"), Some("32768"));
    assert_eq!(out.get("HeaderDigest"), Some("CRC32C"));
    assert_eq!(out.get("MaxConnections"), None);
    assert_eq!(out.get("DataDigest"), None);
    assert!(!t.may_transit(OP, FFP).unwrap());
    // The initiator's answers settle them.
    let answers = params(&[
        ("ImmediateData", "No"),
        ("MaxBurstLength", "65536"),
        ("FirstBurstLength", "32768"),
        ("HeaderDigest", "CRC32C"),
    ]);
    t.receive(OP, &answers).unwrap();
    assert!(t.may_transit(OP, FFP).unwrap());
    assert!(!t.session().operational.immediate_data);
    assert_eq!(t.session().operational.max_burst_length, 65536);
    assert!(t.connection().header_digest);
    // An answer breaking the result function is refused.
    let settings = Settings {
        operational: OperationalParams {
            immediate_data: false,
            ..target_settings().operational
        },
        ..target_settings()
    };
    let mut t = Negotiator::new(Role::Target, settings, true, [0; ENTROPY_LEN]);
    t.receive(OP, &TextParams::new()).unwrap();
    let e = t
        .receive(OP, &params(&[("ImmediateData", "Yes")]))
        .unwrap_err();
    assert!(matches!(e, NegotiationError::InvalidAnswer { .. }));
}

fn initiator_settings() -> Settings {
    Settings {
        declarations: Declarations {
            initiator_name: Some("iqn.1994-05.com.example:client".into()),
            target_name: Some("iqn.2026-11.io.example:disk1".into()),
            ..Declarations::default()
        },
        header_digest: vec![DigestAlgorithm::Crc32c, DigestAlgorithm::None],
        data_digest: vec![DigestAlgorithm::None],
        max_recv_data_segment_length: 65_536,
        operational: OperationalParams {
            initial_r2t: false,
            immediate_data: true,
            max_burst_length: 16_776_192,
            first_burst_length: 262_144,
            max_outstanding_r2t: 8,
            max_connections: 4,
            ..Settings::default().operational
        },
        ..Settings::default()
    }
}

#[test]
fn initiator_checks_answers() {
    let bad: &[(&str, &str)] = &[
        ("MaxBurstLength", "16777215"), // above the proposal
        ("InitialR2T", "Yes"),          // fine for OR...
        ("ImmediateData", "maybe"),
        ("HeaderDigest", "MD5"),
        ("MaxOutstandingR2T", "0"),
        ("DefaultTime2Wait", "1"), // Max: below the proposal
    ];
    for (key, value) in bad {
        let mut i = Negotiator::new(
            Role::Initiator,
            initiator_settings(),
            true,
            [0; ENTROPY_LEN],
        );
        let offers = i.offers(OP);
        assert!(offers.get(key).is_some(), "{key} proposed");
        let r = i.receive(OP, &params(&[(key, value)]));
        if *key == "InitialR2T" {
            assert!(r.is_ok());
            assert!(i.session().operational.initial_r2t);
        } else {
            assert!(
                matches!(r, Err(NegotiationError::InvalidAnswer { .. })),
                "{key}={value}: {r:?}"
            );
        }
    }
    // OR: a proposed Yes must stay Yes.
    let settings = Settings {
        operational: OperationalParams {
            data_pdu_in_order: true,
            ..initiator_settings().operational
        },
        ..initiator_settings()
    };
    let mut i = Negotiator::new(Role::Initiator, settings, true, [0; ENTROPY_LEN]);
    i.offers(OP);
    assert!(i.receive(OP, &params(&[("DataPDUInOrder", "No")])).is_err());
    // NotUnderstood keeps the default when the default is acceptable, and fails otherwise.
    let mut i = Negotiator::new(
        Role::Initiator,
        initiator_settings(),
        true,
        [0; ENTROPY_LEN],
    );
    i.offers(OP);
    i.receive(
        OP,
        &params(&[
            ("iSCSIProtocolLevel", "NotUnderstood"),
            ("TaskReporting", "NotUnderstood"),
        ]),
    )
    .unwrap();
    let settings = Settings {
        data_digest: vec![DigestAlgorithm::Crc32c],
        ..initiator_settings()
    };
    let mut i = Negotiator::new(Role::Initiator, settings, true, [0; ENTROPY_LEN]);
    i.offers(OP);
    assert_eq!(
        i.receive(OP, &params(&[("DataDigest", "Reject")])),
        Err(NegotiationError::NoAgreement("DataDigest".into()))
    );
    assert!(i.is_waiting());
}

/// Runs a whole login between an initiator and a target negotiator, through the wire form of the
/// text, and returns both.
fn login(
    init: Settings,
    targ: Settings,
    with_security: bool,
) -> Result<(Negotiator, Negotiator), NegotiationError> {
    let mut i = Negotiator::new(Role::Initiator, init, true, [1; ENTROPY_LEN]);
    let mut t = Negotiator::new(Role::Target, targ, true, [2; ENTROPY_LEN]);
    let wire = |p: &TextParams| TextParams::parse(&p.encode()).unwrap();
    let stages: &[Stage] = if with_security { &[SEC, OP] } else { &[OP] };
    for &stage in stages {
        let mut req = i.offers(stage);
        for _round in 0..8 {
            let resp = t.receive(stage, &wire(&req))?;
            if stage == stages[0] && stage == SEC {
                t.require_initiator_declarations()?;
            }
            req = i.receive(stage, &wire(&resp))?;
            let next = if stage == SEC { OP } else { FFP };
            if req.is_empty() && i.may_transit(stage, next)? && t.may_transit(stage, next)? {
                break;
            }
        }
        assert!(
            !i.is_waiting() && !t.is_waiting(),
            "stage {stage:?} settled"
        );
    }
    Ok((i, t))
}

#[test]
fn full_login_agrees_on_both_sides() {
    let (i, t) = login(initiator_settings(), target_settings(), true).unwrap();
    assert_eq!(i.session().operational.max_burst_length, 1_048_576);
    assert_eq!(i.session().operational.first_burst_length, 262_144);
    assert_eq!(i.session().operational.max_connections, 4);
    assert_eq!(i.session().operational.max_outstanding_r2t, 8);
    assert!(!i.session().operational.initial_r2t);
    assert_eq!(i.session().declared.target_portal_group_tag, Some(1));
    assert_eq!(i.session().auth_method, Some(AuthMethod::None));
    let fields: [fn(&SessionParams) -> u32; 3] = [
        |s| s.operational.max_burst_length,
        |s| s.operational.first_burst_length,
        |s| u32::from(s.operational.max_connections),
    ];
    for field in fields {
        assert_eq!(field(i.session()), field(t.session()));
    }
    assert_eq!(
        i.session().operational.initial_r2t,
        t.session().operational.initial_r2t
    );
    assert_eq!(
        i.session().operational.immediate_data,
        t.session().operational.immediate_data
    );
    assert_eq!(i.session().task_reporting, t.session().task_reporting);
    assert!(i.connection().header_digest && t.connection().header_digest);
    assert!(!i.connection().data_digest && !t.connection().data_digest);
    assert_eq!(i.connection().max_send_data_segment_length, 262_144);
    assert_eq!(t.connection().max_send_data_segment_length, 65_536);
}

fn creds(name: &str, secret: &str) -> ChapCredentials {
    ChapCredentials::new(name, secret.as_bytes().to_vec(), DEFAULT_MIN_SECRET_LEN).unwrap()
}

#[test]
fn login_with_chap_one_way_and_mutual() {
    let mut init = initiator_settings();
    init.auth = AuthSettings {
        methods: vec![AuthMethod::Chap, AuthMethod::None],
        local: Some(creds("user", "0123456789ab")),
        peer: None,
        require_mutual: false,
    };
    let mut targ = target_settings();
    targ.auth = AuthSettings {
        methods: vec![AuthMethod::Chap],
        local: Some(creds("target", "ba9876543210")),
        peer: Some(creds("user", "0123456789ab")),
        require_mutual: false,
    };
    let (i, t) = login(init.clone(), targ.clone(), true).unwrap();
    assert!(i.authenticated() && t.authenticated());
    assert_eq!(t.session().auth_method, Some(AuthMethod::Chap));

    init.auth.peer = Some(creds("target", "ba9876543210"));
    let (i, t) = login(init.clone(), targ.clone(), true).unwrap();
    assert!(i.authenticated() && t.authenticated());

    // Wrong secret: authentication failure.
    let mut bad = init.clone();
    bad.auth.local = Some(creds("user", "wrongwrongwr"));
    let e = login(bad, targ.clone(), true).unwrap_err();
    assert_eq!(e.login_status(), LoginStatus::AUTHENTICATION_FAILURE);

    // The target requires CHAP; an initiator offering only None fails, and so does one that skips
    // the security stage.
    let mut none = init.clone();
    none.auth = AuthSettings::default();
    let e = login(none.clone(), targ.clone(), true).unwrap_err();
    assert_eq!(e, NegotiationError::AuthenticationRequired);
    let e = login(none, targ, false).unwrap_err();
    assert_eq!(e, NegotiationError::AuthenticationRequired);
}

#[test]
fn login_without_security_stage() {
    let (i, t) = login(initiator_settings(), target_settings(), false).unwrap();
    assert!(t.authenticated());
    assert_eq!(
        i.session().operational.max_burst_length,
        t.session().operational.max_burst_length
    );
    t.require_initiator_declarations().unwrap();
}

#[test]
fn discovery_login() {
    let base = initiator_settings();
    let init = Settings {
        declarations: Declarations {
            session_type: SessionType::Discovery,
            target_name: None,
            ..base.declarations.clone()
        },
        ..base
    };
    let (i, t) = login(init, target_settings(), true).unwrap();
    assert_eq!(t.session().declared.session_type, SessionType::Discovery);
    assert_eq!(
        i.session().operational.max_burst_length,
        262_144,
        "irrelevant keys keep their defaults"
    );
    t.require_initiator_declarations().unwrap();
}

#[test]
fn settings_validation_names_the_key() {
    let mut s = Settings {
        operational: OperationalParams {
            max_burst_length: 100,
            ..Settings::default().operational
        },
        ..Settings::default()
    };
    assert_eq!(s.validate().unwrap_err().key, "MaxBurstLength");
    s = Settings {
        operational: OperationalParams {
            first_burst_length: 1 << 20,
            max_burst_length: 1 << 19,
            ..Settings::default().operational
        },
        ..Settings::default()
    };
    assert_eq!(s.validate().unwrap_err().key, "FirstBurstLength");
    s = Settings {
        max_recv_data_segment_length: 1 << 24,
        ..Settings::default()
    };
    assert_eq!(s.validate().unwrap_err().key, "MaxRecvDataSegmentLength");
    s = Settings {
        operational: OperationalParams {
            error_recovery_level: 3,
            ..Settings::default().operational
        },
        ..Settings::default()
    };
    assert_eq!(s.validate().unwrap_err().key, "ErrorRecoveryLevel");
    s = Settings {
        declarations: Declarations {
            initiator_name: Some("bad name".into()),
            ..Declarations::default()
        },
        ..Settings::default()
    };
    assert_eq!(s.validate().unwrap_err().key, "InitiatorName");
    Settings::default().validate().unwrap();
    target_settings().validate().unwrap();
}

/// Settings of a side of an iSER connection: digests None only (RFC 7145 leaves them to the
/// RDMA transport), RDMAExtensions offered.
fn iser(mut s: Settings) -> Settings {
    s.header_digest = vec![DigestAlgorithm::None];
    s.data_digest = vec![DigestAlgorithm::None];
    s.operational.rdma_extensions = true;
    s
}

#[test]
fn iser_login_agrees_on_rdma_and_the_two_segment_lengths() {
    let (i, t) = login(iser(initiator_settings()), iser(target_settings()), true).unwrap();
    assert!(i.session().operational.rdma_extensions);
    assert!(t.session().operational.rdma_extensions);
    // Both lengths are the minimum of the two sides (65536 and 262144); MaxRecvDataSegmentLength
    // plays no part.
    for c in [i.connection(), t.connection()] {
        assert_eq!(c.max_recv_data_segment_length, 65_536);
        assert_eq!(c.max_send_data_segment_length, 65_536);
        assert!(!c.header_digest && !c.data_digest);
    }
    // A target whose segments are smaller bounds what the initiator sends it, not the other
    // way: Linux's iSER initiator declares TargetRecvDataSegmentLength=8192 and
    // InitiatorRecvDataSegmentLength=262144.
    let mut t = Negotiator::new(
        Role::Target,
        iser(target_settings()),
        true,
        [0; ENTROPY_LEN],
    );
    let out = t
        .receive(
            OP,
            &params(&[
                ("SessionType", "Normal"),
                ("InitiatorRecvDataSegmentLength", "262144"),
                ("TargetRecvDataSegmentLength", "8192"),
                ("RDMAExtensions", "Yes"),
                ("MaxRecvDataSegmentLength", "1024"),
            ]),
        )
        .unwrap();
    assert_eq!(out.get("RDMAExtensions"), Some("Yes"));
    assert_eq!(out.get("TargetRecvDataSegmentLength"), Some("8192"));
    assert_eq!(out.get("InitiatorRecvDataSegmentLength"), Some("262144"));
    assert_eq!(out.get("MaxRecvDataSegmentLength"), None);
    assert_eq!(t.connection().max_recv_data_segment_length, 8192);
    assert_eq!(t.connection().max_send_data_segment_length, 262_144);
    assert!(t.may_transit(OP, FFP).unwrap());
}

#[test]
fn iser_connection_refuses_a_normal_session_without_rdma() {
    // An initiator that does not do iSER answers the target's RDMAExtensions=Yes with No.
    let e = login(initiator_settings(), iser(target_settings()), false).unwrap_err();
    assert_eq!(e, NegotiationError::MissingParameter("RDMAExtensions"));
    assert_eq!(e.login_status(), LoginStatus::MISSING_PARAMETER);
    // A discovery session needs no data movement: RDMAExtensions is irrelevant to it.
    let mut t = Negotiator::new(
        Role::Target,
        iser(target_settings()),
        true,
        [0; ENTROPY_LEN],
    );
    let out = t
        .receive(
            OP,
            &params(&[("SessionType", "Discovery"), ("RDMAExtensions", "Yes")]),
        )
        .unwrap();
    assert_eq!(out.get("RDMAExtensions"), Some("Irrelevant"));
    assert!(t.may_transit(OP, FFP).unwrap());
    // MaxOutstandingUnexpectedPDUs is checked and needs no answer.
    let mut t = Negotiator::new(
        Role::Target,
        iser(target_settings()),
        true,
        [0; ENTROPY_LEN],
    );
    let bad = params(&[
        ("RDMAExtensions", "Yes"),
        ("MaxOutstandingUnexpectedPDUs", "1"),
    ]);
    assert!(matches!(
        t.receive(OP, &bad),
        Err(NegotiationError::InvalidValue { .. })
    ));
}
