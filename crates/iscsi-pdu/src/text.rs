//! Text and login data (RFC 7143 sections 6.1 and 6.2): NUL-terminated `key=value` pairs,
//! reassembled across PDUs with the C bit, checked against the RFC's limits.

use base64::Engine as _;
use bytes::{BufMut, Bytes, BytesMut};

/// The longest key name (RFC 7143 section 6.1).
pub const MAX_KEY_LEN: usize = 63;
/// The longest text value.
pub const MAX_VALUE_LEN: usize = 255;
/// The longest binary value (decoded) of the CHAP keys that may exceed [`MAX_VALUE_LEN`].
pub const MAX_CHAP_BINARY_LEN: usize = 1024;
/// The default bound on the text of one negotiation sequence, reassembled.
pub const DEFAULT_MAX_TEXT_LEN: usize = 64 * 1024;

/// Malformed text data.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum TextError {
    /// The bytes are not UTF-8.
    #[error("text is not UTF-8")]
    NotUtf8,
    /// The last pair has no terminating NUL while no continuation follows.
    #[error("the last key=value pair is not NUL-terminated")]
    Unterminated,
    /// A pair has no `=`.
    #[error("{0:?} is not key=value")]
    MissingEquals(String),
    /// A key is empty, too long or holds a character the RFC does not allow.
    #[error("invalid key name {0:?}")]
    InvalidKey(String),
    /// A value is longer than the RFC allows for its key.
    #[error("value of {key} is {len} bytes; at most {limit} are allowed")]
    ValueTooLong {
        /// The key.
        key: String,
        /// The value's length.
        len: usize,
        /// The limit for this key.
        limit: usize,
    },
    /// A key appears twice in one request or response.
    #[error("key {0} appears more than once")]
    DuplicateKey(String),
    /// The reassembled text exceeds the configured bound.
    #[error("text of {len} bytes exceeds the limit of {limit}")]
    TooLong {
        /// Bytes so far.
        len: usize,
        /// The limit.
        limit: usize,
    },
}

/// Keys whose values may appear more than once in a SendTargets response.
fn may_repeat(key: &str) -> bool {
    matches!(key, "TargetName" | "TargetAddress")
}

/// Whether `key` is a syntactically valid key name: a standard label (a letter, then letters,
/// digits, `.`, `-`, `+`, `@`, `_`), or an `X-` / `X#` extension key, at most 63 bytes.
pub fn valid_key(key: &str) -> bool {
    let b = key.as_bytes();
    if b.is_empty() || b.len() > MAX_KEY_LEN || !b[0].is_ascii_alphabetic() {
        return false;
    }
    let ext_hash = key.starts_with("X#");
    b.iter().enumerate().all(|(i, &c)| {
        c.is_ascii_alphanumeric()
            || matches!(c, b'.' | b'-' | b'+' | b'@' | b'_')
            || (ext_hash && i == 1)
    })
}

/// Whether `value` starts with the two ASCII characters `prefix` (any case) and has more after.
fn has_prefix(value: &str, prefix: &str) -> bool {
    value.len() > 2 && value.as_bytes()[..2].eq_ignore_ascii_case(prefix.as_bytes())
}

/// Whether `value` is in binary form (`0x` hex or `0b` base64).
fn is_binary(value: &str) -> bool {
    has_prefix(value, "0x") || has_prefix(value, "0b")
}

/// The longest value allowed for `key`, in its string form.
fn value_limit(key: &str, value: &str) -> usize {
    let binary = is_binary(value);
    let decoded_limit = if matches!(key, "CHAP_C" | "CHAP_R") {
        MAX_CHAP_BINARY_LEN
    } else {
        MAX_VALUE_LEN
    };
    if binary {
        // Hex needs two characters a byte; base64 four for three.
        2 + decoded_limit * 2
    } else {
        MAX_VALUE_LEN
    }
}

/// An ordered list of key=value pairs.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct TextParams {
    pairs: Vec<(String, String)>,
}

impl TextParams {
    /// An empty list.
    pub fn new() -> Self {
        Self::default()
    }

    /// Parses complete text data (every pair NUL-terminated), refusing duplicate keys.
    pub fn parse(data: &[u8]) -> Result<Self, TextError> {
        Self::parse_inner(data, false)
    }

    /// Parses a SendTargets response, where TargetName and TargetAddress repeat.
    pub fn parse_send_targets(data: &[u8]) -> Result<Self, TextError> {
        Self::parse_inner(data, true)
    }

    fn parse_inner(data: &[u8], send_targets: bool) -> Result<Self, TextError> {
        let text = core::str::from_utf8(data).map_err(|_| TextError::NotUtf8)?;
        if !text.is_empty() && !text.ends_with('\0') {
            return Err(TextError::Unterminated);
        }
        let mut out = TextParams::new();
        // Empty strings between NULs (stray padding some initiators send) carry no pair.
        for pair in text.split('\0').filter(|p| !p.is_empty()) {
            let (key, value) = pair
                .split_once('=')
                .ok_or_else(|| TextError::MissingEquals(pair.into()))?;
            if !valid_key(key) {
                return Err(TextError::InvalidKey(key.into()));
            }
            let limit = value_limit(key, value);
            if value.len() > limit {
                return Err(TextError::ValueTooLong {
                    key: key.into(),
                    len: value.len(),
                    limit,
                });
            }
            if out.get(key).is_some() && !(send_targets && may_repeat(key)) {
                return Err(TextError::DuplicateKey(key.into()));
            }
            out.pairs.push((key.into(), value.into()));
        }
        Ok(out)
    }

    /// The first value of `key`.
    pub fn get(&self, key: &str) -> Option<&str> {
        self.pairs
            .iter()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v.as_str())
    }

    /// Appends a pair.
    pub fn push(&mut self, key: impl Into<String>, value: impl Into<String>) {
        self.pairs.push((key.into(), value.into()));
    }

    /// The pairs in order.
    pub fn iter(&self) -> impl Iterator<Item = (&str, &str)> {
        self.pairs.iter().map(|(k, v)| (k.as_str(), v.as_str()))
    }

    /// Number of pairs.
    pub fn len(&self) -> usize {
        self.pairs.len()
    }

    /// Whether there are no pairs.
    pub fn is_empty(&self) -> bool {
        self.pairs.is_empty()
    }

    /// Appends every pair of `other`.
    pub fn extend(&mut self, other: TextParams) {
        self.pairs.extend(other.pairs);
    }

    /// The wire form: every pair followed by a NUL.
    pub fn encode(&self) -> Bytes {
        let mut b =
            BytesMut::with_capacity(self.pairs.iter().map(|(k, v)| k.len() + v.len() + 2).sum());
        for (k, v) in &self.pairs {
            b.put_slice(k.as_bytes());
            b.put_u8(b'=');
            b.put_slice(v.as_bytes());
            b.put_u8(0);
        }
        b.freeze()
    }
}

/// Reassembles text that spans PDUs (C bit set on all but the last), bounded in size.
#[derive(Debug)]
pub struct TextReassembler {
    buf: BytesMut,
    limit: usize,
}

impl Default for TextReassembler {
    fn default() -> Self {
        Self::new(DEFAULT_MAX_TEXT_LEN)
    }
}

impl TextReassembler {
    /// A reassembler that refuses more than `limit` bytes of text.
    pub fn new(limit: usize) -> Self {
        TextReassembler {
            buf: BytesMut::new(),
            limit,
        }
    }

    /// Adds one PDU's data segment. Returns the whole text when `continue_bit` is clear.
    pub fn push(&mut self, data: &[u8], continue_bit: bool) -> Result<Option<Bytes>, TextError> {
        let len = self.buf.len() + data.len();
        if len > self.limit {
            self.buf.clear();
            return Err(TextError::TooLong {
                len,
                limit: self.limit,
            });
        }
        self.buf.extend_from_slice(data);
        if continue_bit {
            Ok(None)
        } else {
            Ok(Some(self.buf.split().freeze()))
        }
    }

    /// Whether a partial text is held.
    pub fn in_progress(&self) -> bool {
        !self.buf.is_empty()
    }

    /// Drops any partial text.
    pub fn reset(&mut self) {
        self.buf.clear();
    }
}

/// Splits text into data segments of at most `max` bytes; each but the last goes out with the
/// C bit set. A pair may be split across segments, as the RFC allows.
pub fn split_text(text: &Bytes, max: usize) -> impl Iterator<Item = (Bytes, bool)> + '_ {
    let max = max.max(1);
    let n = text.len().div_ceil(max).max(1);
    (0..n).map(move |i| {
        let start = i * max;
        let end = (start + max).min(text.len());
        (text.slice(start..end), i + 1 < n)
    })
}

/// Parses a numerical value: decimal, or hex with `0x`. Values in base64 (`0b`) are accepted too,
/// big-endian, up to eight bytes.
pub fn parse_number(value: &str) -> Option<u64> {
    if is_binary(value) {
        let bytes = parse_binary(value).ok()?;
        if bytes.len() > 8 {
            return None;
        }
        return Some(bytes.iter().fold(0u64, |acc, &b| acc << 8 | u64::from(b)));
    }
    if value.is_empty() || !value.bytes().all(|c| c.is_ascii_digit()) {
        return None;
    }
    value.parse().ok()
}

/// Parses `Yes` / `No`.
pub fn parse_boolean(value: &str) -> Option<bool> {
    match value {
        "Yes" => Some(true),
        "No" => Some(false),
        _ => None,
    }
}

/// The wire form of a boolean.
pub fn boolean(v: bool) -> &'static str {
    if v {
        "Yes"
    } else {
        "No"
    }
}

/// Malformed binary value.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("malformed binary value: {0}")]
pub struct BinaryError(pub &'static str);

/// Decodes a binary value: `0x` + hex digits (an odd count gets a leading zero nibble) or
/// `0b` + base64.
pub fn parse_binary(value: &str) -> Result<Vec<u8>, BinaryError> {
    if !is_binary(value) {
        return Err(BinaryError("neither 0x nor 0b followed by digits"));
    }
    // The prefix is ASCII, so byte 2 is a character boundary.
    let body = &value[2..];
    if has_prefix(value, "0x") {
        let digits: Vec<u8> = body
            .bytes()
            .map(|c| {
                (c as char)
                    .to_digit(16)
                    .map(|d| d as u8)
                    .ok_or(BinaryError("not a hex digit"))
            })
            .collect::<Result<_, _>>()?;
        let mut out = Vec::with_capacity(digits.len().div_ceil(2));
        let mut it = digits.iter();
        if digits.len() % 2 == 1 {
            out.push(*it.next().expect("odd count is at least one"));
        }
        while let (Some(h), Some(l)) = (it.next(), it.next()) {
            out.push(h << 4 | l);
        }
        Ok(out)
    } else {
        base64::engine::general_purpose::STANDARD
            .decode(body)
            .map_err(|_| BinaryError("not base64"))
    }
}

/// Encodes bytes as `0x` + lowercase hex.
pub fn encode_hex(bytes: &[u8]) -> String {
    let mut s = String::with_capacity(2 + bytes.len() * 2);
    s.push_str("0x");
    for b in bytes {
        s.push(char::from_digit(u32::from(b >> 4), 16).expect("nibble"));
        s.push(char::from_digit(u32::from(b & 15), 16).expect("nibble"));
    }
    s
}

/// Encodes bytes as `0b` + base64.
pub fn encode_base64(bytes: &[u8]) -> String {
    format!(
        "0b{}",
        base64::engine::general_purpose::STANDARD.encode(bytes)
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_pairs_and_round_trips() {
        let t = TextParams::parse(b"InitiatorName=iqn.1994-05.com.example:a\0SessionType=Normal\0")
            .unwrap();
        assert_eq!(t.get("SessionType"), Some("Normal"));
        assert_eq!(TextParams::parse(&t.encode()).unwrap(), t);
    }

    #[test]
    fn detects_malformed_text() {
        assert_eq!(TextParams::parse(b"A=1"), Err(TextError::Unterminated));
        assert_eq!(
            TextParams::parse(b"A1\0"),
            Err(TextError::MissingEquals("A1".into()))
        );
        assert_eq!(
            TextParams::parse(b"=1\0"),
            Err(TextError::InvalidKey("".into()))
        );
        assert_eq!(
            TextParams::parse(b"A b=1\0"),
            Err(TextError::InvalidKey("A b".into()))
        );
        assert_eq!(
            TextParams::parse(b"A=1\0A=2\0"),
            Err(TextError::DuplicateKey("A".into()))
        );
        let long_key = format!("{}=1\0", "K".repeat(64));
        assert!(matches!(
            TextParams::parse(long_key.as_bytes()),
            Err(TextError::InvalidKey(_))
        ));
        let long_value = format!("K={}\0", "v".repeat(256));
        assert!(matches!(
            TextParams::parse(long_value.as_bytes()),
            Err(TextError::ValueTooLong { .. })
        ));
        assert_eq!(TextParams::parse(&[0xff, b'=', 0]), Err(TextError::NotUtf8));
        // X- and X# keys are valid names.
        assert!(TextParams::parse(b"X-com.example.Key=1\0X#Reg=2\0").is_ok());
        // Repeats are allowed only in SendTargets responses, and only for target keys.
        let st = b"TargetName=iqn.a\0TargetAddress=1.2.3.4:3260,1\0TargetName=iqn.b\0";
        assert!(TextParams::parse(st).is_err());
        assert_eq!(TextParams::parse_send_targets(st).unwrap().len(), 3);
        // CHAP_C may carry up to 1024 binary bytes.
        let chap = format!("CHAP_C={}\0", encode_hex(&[7u8; 1024]));
        assert!(TextParams::parse(chap.as_bytes()).is_ok());
        let chap = format!("CHAP_C={}\0", encode_hex(&[7u8; 1025]));
        assert!(TextParams::parse(chap.as_bytes()).is_err());
    }

    #[test]
    fn reassembles_across_pdus_with_a_bound() {
        let mut r = TextReassembler::new(16);
        assert_eq!(r.push(b"Max", true), Ok(None));
        assert_eq!(
            r.push(b"Key=1\0", false),
            Ok(Some(Bytes::from_static(b"MaxKey=1\0")))
        );
        assert!(r.push(&[b'a'; 10], true).is_ok());
        assert!(matches!(
            r.push(&[b'a'; 10], true),
            Err(TextError::TooLong { .. })
        ));
        assert!(!r.in_progress());
    }

    #[test]
    fn split_marks_continuation() {
        let t = Bytes::from_static(b"abcdefghij");
        let parts: Vec<_> = split_text(&t, 4).collect();
        assert_eq!(parts.len(), 3);
        assert!(parts[0].1 && parts[1].1 && !parts[2].1);
        assert_eq!(split_text(&Bytes::new(), 4).count(), 1);
    }

    #[test]
    fn values() {
        assert_eq!(parse_number("8192"), Some(8192));
        assert_eq!(parse_number("0x2000"), Some(8192));
        assert_eq!(parse_number("-1"), None);
        assert_eq!(parse_number(""), None);
        assert_eq!(parse_number("99999999999999999999999"), None);
        assert_eq!(parse_binary("0xabc").unwrap(), vec![0x0a, 0xbc]);
        assert_eq!(parse_binary("0XAB").unwrap(), vec![0xab]);
        assert_eq!(parse_binary("0bAQID").unwrap(), vec![1, 2, 3]);
        assert!(parse_binary("0xg1").is_err());
        assert!(parse_binary("0b!!").is_err());
        assert_eq!(
            parse_binary(&encode_base64(&[9, 8, 7, 6])).unwrap(),
            vec![9, 8, 7, 6]
        );
        assert_eq!(encode_hex(&[0, 255]), "0x00ff");
        // Multi-byte characters where a prefix would be (found by fuzzing).
        assert_eq!(parse_number("é1"), None);
        assert!(parse_binary("0é").is_err());
        assert!(parse_binary("0x").is_err());
        assert!(TextParams::parse("K=é\0".as_bytes()).is_ok());
    }
}
