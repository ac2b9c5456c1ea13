//! Arbitrary sequences of proposals thrown at a target negotiator (and the answers at an
//! initiator) never panic, and every error maps to a login status.
#![no_main]

use arbitrary::Arbitrary;
use iscsi_pdu::chap::{ChapCredentials, ENTROPY_LEN};
use iscsi_pdu::negotiation::{AuthMethod, AuthSettings, Negotiator, Role, Settings};
use iscsi_pdu::text::TextParams;
use iscsi_pdu::Stage;
use libfuzzer_sys::fuzz_target;

const KEYS: &[&str] = &[
    "HeaderDigest",
    "DataDigest",
    "MaxConnections",
    "SendTargets",
    "TargetName",
    "InitiatorName",
    "TargetAlias",
    "InitiatorAlias",
    "TargetAddress",
    "TargetPortalGroupTag",
    "InitialR2T",
    "ImmediateData",
    "MaxRecvDataSegmentLength",
    "MaxBurstLength",
    "FirstBurstLength",
    "DefaultTime2Wait",
    "DefaultTime2Retain",
    "MaxOutstandingR2T",
    "DataPDUInOrder",
    "DataSequenceInOrder",
    "ErrorRecoveryLevel",
    "SessionType",
    "AuthMethod",
    "TaskReporting",
    "iSCSIProtocolLevel",
    "IFMarker",
    "OFMarker",
    "IFMarkInt",
    "OFMarkInt",
    "CHAP_A",
    "CHAP_I",
    "CHAP_C",
    "CHAP_N",
    "CHAP_R",
    "X-vendor.Key",
];
const VALUES: &[&str] = &[
    "Yes",
    "No",
    "None",
    "CRC32C",
    "CRC32C,None",
    "CHAP",
    "CHAP,None",
    "0",
    "1",
    "2",
    "512",
    "8192",
    "65536",
    "16777215",
    "16777216",
    "3600",
    "Normal",
    "Discovery",
    "All",
    "5",
    "0x00",
    "0xffffffffffffffffffffffffffffffff",
    "0bAAAA",
    "iqn.2026-11.io.example:t",
    "iqn.1994-05.com.example:i",
    "user",
    "Reject",
    "Irrelevant",
    "NotUnderstood",
    "",
];

#[derive(Arbitrary, Debug)]
enum Value {
    Known(u8),
    Raw(String),
}

#[derive(Arbitrary, Debug)]
struct Step {
    stage: u8,
    pairs: Vec<(u8, Value)>,
    new_exchange: bool,
}

#[derive(Arbitrary, Debug)]
struct Input {
    initiator: bool,
    leading: bool,
    chap: bool,
    entropy: [u8; ENTROPY_LEN],
    steps: Vec<Step>,
}

fn settings(chap: bool) -> Settings {
    let mut s = Settings::default();
    if chap {
        s.auth = AuthSettings {
            methods: vec![AuthMethod::Chap, AuthMethod::None],
            local: ChapCredentials::new("user", b"0123456789ab".to_vec(), 12).ok(),
            peer: ChapCredentials::new("target", b"ba9876543210".to_vec(), 12).ok(),
            require_mutual: false,
        };
    }
    s
}

fuzz_target!(|input: Input| {
    let role = if input.initiator {
        Role::Initiator
    } else {
        Role::Target
    };
    let mut n = Negotiator::new(role, settings(input.chap), input.leading, input.entropy);
    for step in input.steps.iter().take(16) {
        let stage = Stage::from_bits(step.stage);
        if step.new_exchange {
            n.begin_text_exchange();
        }
        let _ = n.offers(stage);
        let mut text = TextParams::new();
        for (k, v) in &step.pairs {
            let key = KEYS[usize::from(*k) % KEYS.len()];
            let value = match v {
                Value::Known(i) => VALUES[usize::from(*i) % VALUES.len()].to_string(),
                Value::Raw(s) => s.chars().filter(|c| *c != '\0').take(300).collect(),
            };
            text.push(key, value);
        }
        match n.receive(stage, &text) {
            Ok(reply) => {
                // What we send must itself parse.
                let _ = TextParams::parse(&reply.encode());
            }
            Err(e) => {
                let _ = e.login_status();
                return;
            }
        }
        let _ = n.may_transit(stage, Stage::FullFeaturePhase);
    }
    let _ = (n.session(), n.connection(), n.authenticated());
});
