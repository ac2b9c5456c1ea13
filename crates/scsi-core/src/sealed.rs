//! The envelope of a state one target process hands the next (an iSCSI session's, an NVMe
//! controller's: an upgrade that keeps them), and the checked reads its decoders share.
//!
//! The process that reads it may be another build than the one that wrote it, and a state
//! accepted wrongly would answer a host with the wrong sequence numbers, so the envelope is
//! versioned and checked: a 12-byte header (magic, version, two reserved bytes, the body's
//! length, bounded before anything is allocated for it), the body, then the body's CRC32C.
//! A reader refuses another magic or version, a length past the bound, a bad checksum, a
//! short or a long input, and every decoder built on [`Reader`] a field out of its range, each
//! with a [`SealError`] that says which.

/// Bytes of the header: magic, version, two reserved bytes, the body's length.
pub const HEADER_LEN: usize = 12;

/// Why a sealed state was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum SealError {
    /// It does not start with the magic of what was expected.
    #[error("not a handover of this kind")]
    NotHandover,
    /// Another version of the encoding than this build reads.
    #[error("handover encoding version {found}; this build reads version {supported}")]
    Version {
        /// The version found.
        found: u16,
        /// The one this build reads.
        supported: u16,
    },
    /// The body is longer than the kind's bound.
    #[error("handover body of {0} bytes exceeds the limit")]
    TooLong(u32),
    /// The bytes end before the state does.
    #[error("handover truncated")]
    Truncated,
    /// The body's CRC32C does not match.
    #[error("handover checksum mismatch")]
    Checksum,
    /// A field holds a value outside its range (the field's name).
    #[error("handover field {0} out of range")]
    Invalid(&'static str),
    /// Bytes follow the state.
    #[error("{0} bytes after the handover")]
    Trailing(usize),
}

/// One kind of sealed state: its magic, the version this build writes and reads, and the
/// longest body it accepts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Seal {
    /// The first four bytes.
    pub magic: [u8; 4],
    /// The encoding's version.
    pub version: u16,
    /// The longest body a reader accepts, checked before it allocates for one.
    pub max_body: u32,
}

impl Seal {
    /// `body` behind its header and before its CRC32C.
    pub fn seal(&self, body: &[u8]) -> Vec<u8> {
        let mut out = Vec::with_capacity(HEADER_LEN + body.len() + 4);
        out.extend_from_slice(&self.magic);
        out.extend_from_slice(&self.version.to_le_bytes());
        out.extend_from_slice(&[0, 0]);
        out.extend_from_slice(&(body.len() as u32).to_le_bytes());
        out.extend_from_slice(body);
        out.extend_from_slice(&crc_fast::crc32_iscsi(body).to_le_bytes());
        out
    }

    /// The body's length from a header, after checking its magic, version, reserved bytes
    /// and bound: what a shell reads next off the socket the state comes over.
    pub fn body_len(&self, header: &[u8; HEADER_LEN]) -> Result<usize, SealError> {
        if header[..4] != self.magic {
            return Err(SealError::NotHandover);
        }
        let version = u16::from_le_bytes([header[4], header[5]]);
        if version != self.version {
            return Err(SealError::Version {
                found: version,
                supported: self.version,
            });
        }
        if header[6..8] != [0, 0] {
            return Err(SealError::Invalid("reserved"));
        }
        let len = u32::from_le_bytes([header[8], header[9], header[10], header[11]]);
        if len > self.max_body {
            return Err(SealError::TooLong(len));
        }
        Ok(len as usize)
    }

    /// The body of `bytes`, which must be one sealed state and nothing else, its header and
    /// checksum checked.
    pub fn open<'a>(&self, bytes: &'a [u8]) -> Result<&'a [u8], SealError> {
        let header: &[u8; HEADER_LEN] = bytes
            .get(..HEADER_LEN)
            .and_then(|h| h.try_into().ok())
            .ok_or(SealError::Truncated)?;
        let len = self.body_len(header)?;
        let rest = &bytes[HEADER_LEN..];
        if rest.len() < len + 4 {
            return Err(SealError::Truncated);
        }
        if rest.len() > len + 4 {
            return Err(SealError::Trailing(rest.len() - len - 4));
        }
        let (body, crc) = rest.split_at(len);
        if crc_fast::crc32_iscsi(body).to_le_bytes() != crc {
            return Err(SealError::Checksum);
        }
        Ok(body)
    }
}

/// Checked reads off a body, little-endian: each fails with [`SealError::Truncated`] when
/// the bytes end first, and a count is checked against what is left ([`Reader::count`])
/// before anything is reserved for it.
#[derive(Debug)]
pub struct Reader<'a>(&'a [u8]);

impl<'a> Reader<'a> {
    /// Reads `body` from its start.
    pub fn new(body: &'a [u8]) -> Reader<'a> {
        Reader(body)
    }

    /// The bytes not read yet.
    pub fn rest(&self) -> &'a [u8] {
        self.0
    }

    /// Refuses bytes left over.
    pub fn end(&self) -> Result<(), SealError> {
        match self.0.len() {
            0 => Ok(()),
            n => Err(SealError::Trailing(n)),
        }
    }

    /// The next `n` bytes.
    pub fn bytes(&mut self, n: usize) -> Result<&'a [u8], SealError> {
        if self.0.len() < n {
            return Err(SealError::Truncated);
        }
        let (head, rest) = self.0.split_at(n);
        self.0 = rest;
        Ok(head)
    }

    /// The next `N` bytes.
    pub fn array<const N: usize>(&mut self) -> Result<[u8; N], SealError> {
        let b = self.bytes(N)?;
        b.try_into().map_err(|_| SealError::Truncated)
    }

    /// A byte.
    pub fn u8(&mut self) -> Result<u8, SealError> {
        Ok(self.array::<1>()?[0])
    }

    /// A u16.
    pub fn u16(&mut self) -> Result<u16, SealError> {
        Ok(u16::from_le_bytes(self.array()?))
    }

    /// A u32.
    pub fn u32(&mut self) -> Result<u32, SealError> {
        Ok(u32::from_le_bytes(self.array()?))
    }

    /// A u64.
    pub fn u64(&mut self) -> Result<u64, SealError> {
        Ok(u64::from_le_bytes(self.array()?))
    }

    /// A flag, 0 or 1; anything else is `field` out of range.
    pub fn bool(&mut self, field: &'static str) -> Result<bool, SealError> {
        match self.u8()? {
            0 => Ok(false),
            1 => Ok(true),
            _ => Err(SealError::Invalid(field)),
        }
    }

    /// A count (u32) of items that take at least `each` bytes: refused as truncated when
    /// the bytes left cannot hold them, so that nothing is reserved for a count the input
    /// does not back.
    pub fn count(&mut self, each: usize) -> Result<usize, SealError> {
        let n = self.u32()? as usize;
        if n.saturating_mul(each.max(1)) > self.0.len() {
            return Err(SealError::Truncated);
        }
        Ok(n)
    }

    /// Bytes behind a u32 length of at most `max`; a longer length is `field` out of range.
    pub fn blob(&mut self, max: usize, field: &'static str) -> Result<&'a [u8], SealError> {
        let n = self.u32()? as usize;
        if n > max {
            return Err(SealError::Invalid(field));
        }
        self.bytes(n)
    }
}

/// What [`Reader::blob`] reads: `bytes` behind their u32 length.
pub fn put_blob(w: &mut Vec<u8>, bytes: &[u8]) {
    w.extend_from_slice(&(bytes.len() as u32).to_le_bytes());
    w.extend_from_slice(bytes);
}

#[cfg(test)]
mod tests {
    use super::*;

    const SEAL: Seal = Seal {
        magic: *b"TEST",
        version: 3,
        max_body: 64,
    };

    /// A sealed body opens to itself; every cut, changed byte and added byte is refused.
    #[test]
    fn a_sealed_body_opens_whole_or_is_refused() {
        let sealed = SEAL.seal(b"the body");
        assert_eq!(SEAL.open(&sealed), Ok(&b"the body"[..]));
        for cut in 0..sealed.len() {
            assert!(SEAL.open(&sealed[..cut]).is_err(), "cut at {cut}");
        }
        for i in 0..sealed.len() {
            let mut changed = sealed.clone();
            changed[i] ^= 0x10;
            assert!(SEAL.open(&changed).is_err(), "byte {i}");
        }
        let mut longer = sealed.clone();
        longer.push(0);
        assert_eq!(SEAL.open(&longer), Err(SealError::Trailing(1)));
        let other = Seal { version: 4, ..SEAL };
        assert_eq!(
            other.open(&sealed),
            Err(SealError::Version {
                found: 3,
                supported: 4
            })
        );
        assert_eq!(SEAL.open(&SEAL.seal(&[0; 65])), Err(SealError::TooLong(65)));
    }

    /// The reader refuses what the bytes do not hold, and counts they cannot back.
    #[test]
    fn the_reader_refuses_what_is_not_there() {
        let mut r = Reader::new(&[2, 0, 0, 0, 7, 9, 1, 2]);
        assert_eq!(r.count(2), Ok(2));
        assert_eq!(r.u16(), Ok(0x0907));
        assert_eq!(r.bool("flag"), Ok(true));
        assert_eq!(r.bool("flag"), Err(SealError::Invalid("flag")));
        assert_eq!(r.end(), Ok(()));
        assert_eq!(r.u8(), Err(SealError::Truncated));
        let mut r = Reader::new(&[9, 0, 0, 0, 1]);
        assert_eq!(r.count(1), Err(SealError::Truncated));
        let mut w = Vec::new();
        put_blob(&mut w, b"abc");
        let mut r = Reader::new(&w);
        assert_eq!(r.blob(2, "blob"), Err(SealError::Invalid("blob")));
        let mut r = Reader::new(&w);
        assert_eq!(r.blob(3, "blob"), Ok(&b"abc"[..]));
    }
}
