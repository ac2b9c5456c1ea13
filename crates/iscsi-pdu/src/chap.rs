//! CHAP authentication (RFC 1994, RFC 7143 section 12.1.3), MD5 (CHAP_A=5) only, for both roles,
//! one-way and mutual. Randomness comes in from the caller (sans-IO): give each side fresh
//! entropy from the OS for every login.

use md5::{Digest as _, Md5};
use subtle::ConstantTimeEq;

use crate::text::{encode_hex, parse_binary, parse_number, TextParams, MAX_CHAP_BINARY_LEN};

/// The CHAP algorithm number for MD5.
pub const CHAP_MD5: u8 = 5;
/// The shortest secret accepted by default: RFC 7143 section 12.1.3 asks for at least 96 bits.
pub const DEFAULT_MIN_SECRET_LEN: usize = 12;
/// Length of the challenges this crate issues.
pub const CHALLENGE_LEN: usize = 16;
/// Entropy consumed per side: one identifier byte and a challenge.
pub const ENTROPY_LEN: usize = 1 + CHALLENGE_LEN;

/// Why CHAP failed. Every variant ends the login with an authentication failure.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ChapError {
    /// A configured secret is shorter than the minimum.
    #[error("CHAP secret is {len} bytes; at least {min} are required")]
    SecretTooShort {
        /// Its length.
        len: usize,
        /// The minimum.
        min: usize,
    },
    /// The same secret is configured for both directions of mutual CHAP.
    #[error("mutual CHAP must not use the initiator's secret for the target")]
    SameSecretBothWays,
    /// The peer offered no algorithm this side supports (only MD5, 5).
    #[error("no supported CHAP algorithm in {0:?}")]
    UnsupportedAlgorithm(String),
    /// A CHAP key the exchange needs now is missing.
    #[error("{0} is missing")]
    MissingKey(&'static str),
    /// A CHAP key is malformed.
    #[error("{key} is malformed: {reason}")]
    Malformed {
        /// The key.
        key: &'static str,
        /// What is wrong.
        reason: &'static str,
    },
    /// The peer sent back the challenge this side issued (a reflection attack).
    #[error("the peer reflected our challenge")]
    ReflectedChallenge,
    /// CHAP_N names an unknown user.
    #[error("unknown CHAP name {0:?}")]
    WrongName(String),
    /// CHAP_R does not match.
    #[error("CHAP response does not match")]
    WrongResponse,
    /// Mutual CHAP, seen by the initiator: the target answered with another CHAP_N than the
    /// name it must prove.
    #[error("the target proved itself as {given:?}, not as {expected:?} (mutual CHAP)")]
    TargetWrongName {
        /// The CHAP_N it sent.
        given: String,
        /// The name it must prove.
        expected: String,
    },
    /// Mutual CHAP, seen by the initiator: the target's CHAP_R does not match the secret it
    /// must prove (the initiator's and the target's configurations disagree).
    #[error("the target's CHAP response does not match the secret it must prove (mutual CHAP)")]
    TargetWrongResponse,
    /// The initiator asked the target to authenticate itself, but no target secret is configured.
    #[error("mutual CHAP requested but not configured")]
    MutualNotConfigured,
    /// This side requires mutual CHAP and the peer did not do it.
    #[error("mutual CHAP required")]
    MutualRequired,
    /// A CHAP key arrived after the exchange ended or before it began.
    #[error("unexpected CHAP key {0}")]
    Unexpected(&'static str),
}

/// A CHAP name and secret.
#[derive(Clone, PartialEq, Eq)]
pub struct ChapCredentials {
    name: String,
    secret: Vec<u8>,
}

impl core::fmt::Debug for ChapCredentials {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("ChapCredentials")
            .field("name", &self.name)
            .field("secret", &"<redacted>")
            .finish()
    }
}

impl ChapCredentials {
    /// Credentials whose secret has at least `min_secret_len` bytes
    /// ([`DEFAULT_MIN_SECRET_LEN`] unless policy says otherwise).
    pub fn new(
        name: impl Into<String>,
        secret: impl Into<Vec<u8>>,
        min_secret_len: usize,
    ) -> Result<Self, ChapError> {
        let secret = secret.into();
        if secret.len() < min_secret_len {
            return Err(ChapError::SecretTooShort {
                len: secret.len(),
                min: min_secret_len,
            });
        }
        Ok(ChapCredentials {
            name: name.into(),
            secret,
        })
    }

    /// The CHAP name.
    pub fn name(&self) -> &str {
        &self.name
    }
}

/// CHAP response for MD5: MD5(identifier || secret || challenge).
pub fn chap_md5_response(identifier: u8, secret: &[u8], challenge: &[u8]) -> [u8; 16] {
    let mut h = Md5::new();
    h.update([identifier]);
    h.update(secret);
    h.update(challenge);
    h.finalize().into()
}

fn get<'a>(p: &'a TextParams, key: &'static str) -> Result<&'a str, ChapError> {
    p.get(key).ok_or(ChapError::MissingKey(key))
}

fn binary(p: &TextParams, key: &'static str) -> Result<Vec<u8>, ChapError> {
    let v = parse_binary(get(p, key)?).map_err(|e| ChapError::Malformed { key, reason: e.0 })?;
    if v.is_empty() || v.len() > MAX_CHAP_BINARY_LEN {
        return Err(ChapError::Malformed {
            key,
            reason: "length must be 1 to 1024 bytes",
        });
    }
    Ok(v)
}

fn identifier(p: &TextParams) -> Result<u8, ChapError> {
    parse_number(get(p, "CHAP_I")?)
        .and_then(|n| u8::try_from(n).ok())
        .ok_or(ChapError::Malformed {
            key: "CHAP_I",
            reason: "not a number from 0 to 255",
        })
}

/// Verifies a peer's CHAP_N / CHAP_R against `expected` for the challenge this side issued.
fn verify(
    p: &TextParams,
    expected: &ChapCredentials,
    id: u8,
    challenge: &[u8],
) -> Result<(), ChapError> {
    let name = get(p, "CHAP_N")?;
    let response = binary(p, "CHAP_R")?;
    let want = chap_md5_response(id, &expected.secret, challenge);
    // Compare the response first and in constant time; report the name only after.
    let ok_response: bool = response.len() == want.len() && bool::from(response.ct_eq(&want));
    if name != expected.name {
        return Err(ChapError::WrongName(name.into()));
    }
    if !ok_response {
        return Err(ChapError::WrongResponse);
    }
    Ok(())
}

/// Refuses one secret for both directions, and splits the entropy into this side's CHAP
/// identifier and challenge.
fn checked_setup(
    initiator: &ChapCredentials,
    target: Option<&ChapCredentials>,
    entropy: [u8; ENTROPY_LEN],
) -> Result<(u8, [u8; CHALLENGE_LEN]), ChapError> {
    if target.is_some_and(|t| t.secret == initiator.secret) {
        return Err(ChapError::SameSecretBothWays);
    }
    let mut challenge = [0u8; CHALLENGE_LEN];
    challenge.copy_from_slice(&entropy[1..]);
    Ok((entropy[0], challenge))
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum TargetState {
    AwaitAlgorithms,
    AwaitResponse,
    Done,
}

/// The target's side of CHAP: issues a challenge, checks the initiator's response, and answers
/// the initiator's challenge for mutual CHAP.
#[derive(Debug)]
pub struct ChapTarget {
    initiator: ChapCredentials,
    target: Option<ChapCredentials>,
    require_mutual: bool,
    identifier: u8,
    challenge: [u8; CHALLENGE_LEN],
    state: TargetState,
}

impl ChapTarget {
    /// `initiator`: the credentials the initiator must prove; `target`: this target's own, for
    /// mutual CHAP; `entropy`: fresh random bytes for the identifier and the challenge.
    pub fn new(
        initiator: ChapCredentials,
        target: Option<ChapCredentials>,
        entropy: [u8; ENTROPY_LEN],
    ) -> Result<Self, ChapError> {
        let (identifier, challenge) = checked_setup(&initiator, target.as_ref(), entropy)?;
        Ok(ChapTarget {
            initiator,
            target,
            require_mutual: false,
            identifier,
            challenge,
            state: TargetState::AwaitAlgorithms,
        })
    }

    /// Refuse initiators that do not authenticate the target too.
    pub fn require_mutual(mut self, yes: bool) -> Self {
        self.require_mutual = yes;
        self
    }

    /// Whether the initiator has proved its identity (and, if it asked, the target answered).
    pub fn is_done(&self) -> bool {
        self.state == TargetState::Done
    }

    /// Handles the CHAP keys of one login request, writing the answer to `out`.
    pub fn receive(&mut self, p: &TextParams, out: &mut TextParams) -> Result<(), ChapError> {
        match self.state {
            TargetState::AwaitAlgorithms => {
                let offered = get(p, "CHAP_A")?;
                if !offered
                    .split(',')
                    .any(|a| parse_number(a) == Some(u64::from(CHAP_MD5)))
                {
                    return Err(ChapError::UnsupportedAlgorithm(offered.into()));
                }
                for key in ["CHAP_N", "CHAP_R", "CHAP_I", "CHAP_C"] {
                    if p.get(key).is_some() {
                        return Err(ChapError::Unexpected(key_name(key)));
                    }
                }
                out.push("CHAP_A", CHAP_MD5.to_string());
                out.push("CHAP_I", self.identifier.to_string());
                out.push("CHAP_C", encode_hex(&self.challenge));
                self.state = TargetState::AwaitResponse;
                Ok(())
            }
            TargetState::AwaitResponse => {
                verify(p, &self.initiator, self.identifier, &self.challenge)?;
                match (p.get("CHAP_I"), p.get("CHAP_C")) {
                    (None, None) if self.require_mutual => return Err(ChapError::MutualRequired),
                    (None, None) => {}
                    (Some(_), Some(_)) => {
                        let own = self.target.as_ref().ok_or(ChapError::MutualNotConfigured)?;
                        let id = identifier(p)?;
                        let challenge = binary(p, "CHAP_C")?;
                        if challenge == self.challenge {
                            return Err(ChapError::ReflectedChallenge);
                        }
                        out.push("CHAP_N", own.name.clone());
                        out.push(
                            "CHAP_R",
                            encode_hex(&chap_md5_response(id, &own.secret, &challenge)),
                        );
                    }
                    (None, Some(_)) => return Err(ChapError::MissingKey("CHAP_I")),
                    (Some(_), None) => return Err(ChapError::MissingKey("CHAP_C")),
                }
                self.state = TargetState::Done;
                Ok(())
            }
            TargetState::Done => Err(ChapError::Unexpected("CHAP_N")),
        }
    }
}

fn key_name(key: &str) -> &'static str {
    match key {
        "CHAP_N" => "CHAP_N",
        "CHAP_R" => "CHAP_R",
        "CHAP_I" => "CHAP_I",
        _ => "CHAP_C",
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum InitiatorState {
    Start,
    AwaitChallenge,
    AwaitTargetResponse,
    Done,
}

/// The initiator's side of CHAP: answers the target's challenge and, for mutual CHAP, checks the
/// target's answer to its own.
#[derive(Debug)]
pub struct ChapInitiator {
    initiator: ChapCredentials,
    target: Option<ChapCredentials>,
    identifier: u8,
    challenge: [u8; CHALLENGE_LEN],
    state: InitiatorState,
}

impl ChapInitiator {
    /// `initiator`: this initiator's credentials; `target`: the credentials the target must prove
    /// (mutual CHAP), if any; `entropy`: fresh random bytes for the mutual challenge.
    pub fn new(
        initiator: ChapCredentials,
        target: Option<ChapCredentials>,
        entropy: [u8; ENTROPY_LEN],
    ) -> Result<Self, ChapError> {
        let (identifier, challenge) = checked_setup(&initiator, target.as_ref(), entropy)?;
        Ok(ChapInitiator {
            initiator,
            target,
            identifier,
            challenge,
            state: InitiatorState::Start,
        })
    }

    /// Whether authentication (both ways, if mutual) is complete.
    pub fn is_done(&self) -> bool {
        self.state == InitiatorState::Done
    }

    /// Whether the next step waits for the target (as opposed to sending the first CHAP_A).
    pub fn started(&self) -> bool {
        self.state != InitiatorState::Start
    }

    /// The first CHAP message: the algorithms offered.
    pub fn start(&mut self, out: &mut TextParams) {
        out.push("CHAP_A", CHAP_MD5.to_string());
        self.state = InitiatorState::AwaitChallenge;
    }

    /// Handles the CHAP keys of one login response, writing the next request's keys to `out`.
    pub fn receive(&mut self, p: &TextParams, out: &mut TextParams) -> Result<(), ChapError> {
        match self.state {
            InitiatorState::Start => Err(ChapError::Unexpected("CHAP_A")),
            InitiatorState::AwaitChallenge => {
                let a = get(p, "CHAP_A")?;
                if parse_number(a) != Some(u64::from(CHAP_MD5)) {
                    return Err(ChapError::UnsupportedAlgorithm(a.into()));
                }
                let id = identifier(p)?;
                let challenge = binary(p, "CHAP_C")?;
                out.push("CHAP_N", self.initiator.name.clone());
                out.push(
                    "CHAP_R",
                    encode_hex(&chap_md5_response(id, &self.initiator.secret, &challenge)),
                );
                if self.target.is_some() {
                    if challenge == self.challenge {
                        // Never send back what the target sent: change one bit.
                        self.challenge[0] ^= 1;
                    }
                    out.push("CHAP_I", self.identifier.to_string());
                    out.push("CHAP_C", encode_hex(&self.challenge));
                    self.state = InitiatorState::AwaitTargetResponse;
                } else {
                    self.state = InitiatorState::Done;
                }
                Ok(())
            }
            InitiatorState::AwaitTargetResponse => {
                let expected = self.target.as_ref().ok_or(ChapError::MutualNotConfigured)?;
                // Said as the target's failure: the initiator's own login succeeded.
                verify(p, expected, self.identifier, &self.challenge).map_err(|e| match e {
                    ChapError::WrongName(given) => ChapError::TargetWrongName {
                        given,
                        expected: expected.name.clone(),
                    },
                    ChapError::WrongResponse => ChapError::TargetWrongResponse,
                    e => e,
                })?;
                self.state = InitiatorState::Done;
                Ok(())
            }
            InitiatorState::Done => Err(ChapError::Unexpected("CHAP_N")),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn creds(name: &str, secret: &str) -> ChapCredentials {
        ChapCredentials::new(name, secret.as_bytes().to_vec(), DEFAULT_MIN_SECRET_LEN).unwrap()
    }

    fn exchange(target: &mut ChapTarget, initiator: &mut ChapInitiator) -> Result<(), ChapError> {
        let mut req = TextParams::new();
        initiator.start(&mut req);
        let mut resp = TextParams::new();
        target.receive(&req, &mut resp)?;
        let mut req = TextParams::new();
        initiator.receive(&resp, &mut req)?;
        let mut resp = TextParams::new();
        target.receive(&req, &mut resp)?;
        if !initiator.is_done() {
            initiator.receive(&resp, &mut TextParams::new())?;
        }
        Ok(())
    }

    #[test]
    fn rfc1994_md5_vector() {
        // MD5(0x01 || "secret" || 16 x 0x00) computed independently.
        let r = chap_md5_response(1, b"secret", &[0u8; 16]);
        let mut h = Md5::new();
        h.update([1u8]);
        h.update(b"secret");
        h.update([0u8; 16]);
        assert_eq!(r, <[u8; 16]>::from(h.finalize()));
    }

    #[test]
    fn one_way_and_mutual_succeed() {
        let mut t = ChapTarget::new(creds("user", "0123456789ab"), None, [3; ENTROPY_LEN]).unwrap();
        let mut i =
            ChapInitiator::new(creds("user", "0123456789ab"), None, [4; ENTROPY_LEN]).unwrap();
        exchange(&mut t, &mut i).unwrap();
        assert!(t.is_done() && i.is_done());

        let mut t = ChapTarget::new(
            creds("user", "0123456789ab"),
            Some(creds("tgt", "ba9876543210")),
            [5; ENTROPY_LEN],
        )
        .unwrap()
        .require_mutual(true);
        let mut i = ChapInitiator::new(
            creds("user", "0123456789ab"),
            Some(creds("tgt", "ba9876543210")),
            [6; ENTROPY_LEN],
        )
        .unwrap();
        exchange(&mut t, &mut i).unwrap();
        assert!(t.is_done() && i.is_done());
    }

    #[test]
    fn failures() {
        let mut t = ChapTarget::new(creds("user", "0123456789ab"), None, [3; ENTROPY_LEN]).unwrap();
        let mut i =
            ChapInitiator::new(creds("user", "0123456789XX"), None, [4; ENTROPY_LEN]).unwrap();
        assert_eq!(exchange(&mut t, &mut i), Err(ChapError::WrongResponse));

        let mut t = ChapTarget::new(creds("user", "0123456789ab"), None, [3; ENTROPY_LEN]).unwrap();
        let mut i =
            ChapInitiator::new(creds("other", "0123456789ab"), None, [4; ENTROPY_LEN]).unwrap();
        assert_eq!(
            exchange(&mut t, &mut i),
            Err(ChapError::WrongName("other".into()))
        );

        // Mutual asked of a target without a secret of its own.
        let mut t = ChapTarget::new(creds("user", "0123456789ab"), None, [3; ENTROPY_LEN]).unwrap();
        let mut i = ChapInitiator::new(
            creds("user", "0123456789ab"),
            Some(creds("tgt", "ba9876543210")),
            [4; ENTROPY_LEN],
        )
        .unwrap();
        assert_eq!(
            exchange(&mut t, &mut i),
            Err(ChapError::MutualNotConfigured)
        );

        // The target proves the wrong secret.
        let mut t = ChapTarget::new(
            creds("user", "0123456789ab"),
            Some(creds("tgt", "wrongwrong12")),
            [3; ENTROPY_LEN],
        )
        .unwrap();
        let mut i = ChapInitiator::new(
            creds("user", "0123456789ab"),
            Some(creds("tgt", "ba9876543210")),
            [4; ENTROPY_LEN],
        )
        .unwrap();
        assert_eq!(
            exchange(&mut t, &mut i),
            Err(ChapError::TargetWrongResponse)
        );

        // Mutual required but not done.
        let mut t = ChapTarget::new(
            creds("user", "0123456789ab"),
            Some(creds("tgt", "ba9876543210")),
            [3; ENTROPY_LEN],
        )
        .unwrap()
        .require_mutual(true);
        let mut i =
            ChapInitiator::new(creds("user", "0123456789ab"), None, [4; ENTROPY_LEN]).unwrap();
        assert_eq!(exchange(&mut t, &mut i), Err(ChapError::MutualRequired));
    }

    #[test]
    fn refuses_short_and_shared_secrets_and_bad_algorithms() {
        assert_eq!(
            ChapCredentials::new("u", b"short".to_vec(), DEFAULT_MIN_SECRET_LEN),
            Err(ChapError::SecretTooShort { len: 5, min: 12 })
        );
        assert!(ChapCredentials::new("u", b"short".to_vec(), 4).is_ok());
        assert_eq!(
            ChapTarget::new(
                creds("u", "0123456789ab"),
                Some(creds("t", "0123456789ab")),
                [0; ENTROPY_LEN]
            )
            .unwrap_err(),
            ChapError::SameSecretBothWays
        );
        let mut t = ChapTarget::new(creds("user", "0123456789ab"), None, [3; ENTROPY_LEN]).unwrap();
        let mut req = TextParams::new();
        req.push("CHAP_A", "7,6");
        assert_eq!(
            t.receive(&req, &mut TextParams::new()),
            Err(ChapError::UnsupportedAlgorithm("7,6".into()))
        );
    }

    #[test]
    fn refuses_a_reflected_challenge() {
        let entropy = [9u8; ENTROPY_LEN];
        let user = creds("user", "0123456789ab");
        let mut t =
            ChapTarget::new(user.clone(), Some(creds("tgt", "ba9876543210")), entropy).unwrap();
        let mut req = TextParams::new();
        req.push("CHAP_A", "5");
        let mut resp = TextParams::new();
        t.receive(&req, &mut resp).unwrap();
        // An attacker answers correctly (say, from a relay) and sends our own challenge back.
        let c = resp.get("CHAP_C").unwrap().to_string();
        let mut req = TextParams::new();
        req.push("CHAP_N", "user");
        req.push(
            "CHAP_R",
            encode_hex(&chap_md5_response(9, b"0123456789ab", &[9u8; 16])),
        );
        req.push("CHAP_I", "9");
        req.push("CHAP_C", c);
        assert_eq!(
            t.receive(&req, &mut TextParams::new()),
            Err(ChapError::ReflectedChallenge)
        );
    }

    #[test]
    fn accepts_base64_responses() {
        use crate::text::encode_base64;
        let mut t = ChapTarget::new(creds("user", "0123456789ab"), None, [3; ENTROPY_LEN]).unwrap();
        let mut req = TextParams::new();
        req.push("CHAP_A", "5");
        let mut resp = TextParams::new();
        t.receive(&req, &mut resp).unwrap();
        let c = parse_binary(resp.get("CHAP_C").unwrap()).unwrap();
        let mut req = TextParams::new();
        req.push("CHAP_N", "user");
        req.push(
            "CHAP_R",
            encode_base64(&chap_md5_response(3, b"0123456789ab", &c)),
        );
        t.receive(&req, &mut TextParams::new()).unwrap();
        assert!(t.is_done());
    }
}
