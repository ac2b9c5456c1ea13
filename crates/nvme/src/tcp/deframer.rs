//! A streaming NVMe/TCP deframer: fed bytes with arbitrary split points, it yields whole
//! PDUs. Every length in the common header (HLEN, PDO, PLEN, and DATAL of a data PDU) is
//! checked against the PDU type and the negotiated limits as soon as the 8-byte common
//! header is in, before any of the PDU is waited for, so a peer never makes it buffer more
//! than [`Limits::max_data`] plus a header. An error names the Fatal Error Status and the
//! offset of the field in error, and keeps the PDU's header for the TermReq that reports it;
//! once failed, the deframer stays failed (the connection ends).

use bytes::{Buf, Bytes, BytesMut};

use super::pdu::{
    Digests, FatalError, Header, PduType, CH_LEN, DDGSTF, DIGEST_LEN, HDGSTF, MAX_HLEN, MAX_PDA,
    MAX_TERM_REQ_LEN,
};

/// Which end of the connection receives: the controller takes the host's PDUs, the host the
/// controller's.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Side {
    /// A controller (a target).
    Controller,
    /// A host.
    Host,
}

/// What the receiving end accepts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// The digests in force.
    pub digests: Digests,
    /// The data alignment this end asked for (CPDA for a controller, HPDA for a host).
    pub pda: u8,
    /// The most data one PDU may carry (a controller: the larger of its in-capsule data size
    /// and MAXH2CDATA; a host: the most a C2HData may carry).
    pub max_data: u32,
}

impl Limits {
    /// Before ICReq and ICResp: no digests, no alignment, no data but a TermReq's.
    pub const INITIAL: Limits = Limits {
        digests: Digests {
            header: false,
            data: false,
        },
        pda: 0,
        max_data: 0,
    };
}

/// A PDU received whole.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Pdu {
    /// Its header.
    pub header: Header,
    /// Its data (in-capsule data, H2CData's or C2HData's data, a TermReq's error data): a
    /// slice of the receive buffer.
    pub data: Bytes,
    /// False when its data digest did not match: not fatal (the command ends with Transient
    /// Transport Error, which the host retries).
    pub data_digest_ok: bool,
}

/// A fatal error in the PDU stream: what the TermReq reports.
#[derive(Clone, PartialEq, Eq)]
pub struct DeframeError {
    /// FES.
    pub fes: FatalError,
    /// FEI: the byte offset of the field in error, for an invalid header field.
    pub fei: u32,
    /// The PDU's header as received, at most [`MAX_HLEN`] bytes (boxed: an error ends the
    /// connection, and a small `Result` keeps every PDU's path cheap).
    header: Box<[u8]>,
}

impl std::fmt::Debug for DeframeError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeframeError")
            .field("fes", &self.fes)
            .field("fei", &self.fei)
            .field("header", &self.pdu_header())
            .finish()
    }
}

impl std::fmt::Display for DeframeError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{:?} (FES {:#x}, FEI {})",
            self.fes,
            self.fes.code(),
            self.fei
        )
    }
}

impl std::error::Error for DeframeError {}

impl DeframeError {
    /// An error with `fes` and `fei` in the PDU whose header (or what of it was received)
    /// is `received`: also for what only the connection can judge (the PDU sequence, a
    /// data PDU nobody asked for).
    pub fn from_parts(fes: FatalError, fei: u32, received: &[u8]) -> DeframeError {
        DeframeError {
            fes,
            fei,
            header: received[..received.len().min(MAX_HLEN)].into(),
        }
    }

    /// The header of the PDU in error, as much of it as was received (at most 128 bytes):
    /// the TermReq's error data.
    pub fn pdu_header(&self) -> &[u8] {
        &self.header
    }
}

/// Where a checked PDU's parts are.
#[derive(Debug, Clone, Copy)]
struct Frame {
    pdu_type: PduType,
    flags: u8,
    hlen: usize,
    header_digest: bool,
    data_digest: bool,
    data_at: usize,
    data_len: usize,
    plen: usize,
}

/// The receiving end of a connection, the host's or the controller's: its deframer, and what
/// it does with each whole PDU. Bytes become PDUs here, in one loop for both ends.
pub(super) trait Receiving {
    /// Its deframer.
    fn deframer(&mut self) -> &mut Deframer;
    /// Whether the connection is over (nothing more is taken).
    fn over(&self) -> bool;
    /// Takes one whole PDU; the fatal error that ends the connection.
    fn take_pdu(&mut self, pdu: Pdu) -> Result<(), DeframeError>;
    /// Ends the connection for `e` (a TermReq).
    fn fail(&mut self, e: DeframeError);

    /// Takes every whole PDU buffered, until one lacks bytes or the connection ends.
    fn take_buffered(&mut self) {
        while !self.over() {
            match self.deframer().next_pdu() {
                Ok(Some(pdu)) => {
                    if let Err(e) = self.take_pdu(pdu) {
                        return self.fail(e);
                    }
                }
                Ok(None) => return,
                Err(e) => return self.fail(e),
            }
        }
    }
}

/// The deframer of one connection's receiving end.
#[derive(Debug)]
pub struct Deframer {
    buf: BytesMut,
    side: Side,
    limits: Limits,
    failed: Option<DeframeError>,
    /// The capacity [`Deframer::reserve_for_read`] sized the buffer to.
    sized: usize,
}

impl Deframer {
    /// A deframer for `side` before the connection is initialized ([`Limits::INITIAL`]).
    pub fn new(side: Side) -> Deframer {
        Deframer {
            buf: BytesMut::with_capacity(2 * MAX_HLEN),
            side,
            limits: Limits::INITIAL,
            failed: None,
            sized: 0,
        }
    }

    /// The limits in force from the next PDU on (after ICResp).
    pub fn set_limits(&mut self, limits: Limits) {
        self.limits = Limits {
            pda: limits.pda.min(MAX_PDA),
            ..limits
        };
    }

    /// The limits in force.
    pub fn limits(&self) -> Limits {
        self.limits
    }

    /// Adds received bytes.
    pub fn feed(&mut self, bytes: &[u8]) {
        self.buf.extend_from_slice(bytes);
    }

    /// The receive buffer, for a shell that reads straight into it (`read_buf`) and then
    /// takes the PDUs: one copy fewer than [`Deframer::feed`]. Reserve
    /// [`Deframer::needed`] (checked against the limits before it is known) first, so a read
    /// never grows it beyond the next PDU at the peer's word.
    pub fn buffer_mut(&mut self) -> &mut BytesMut {
        &mut self.buf
    }

    /// Makes room for a read of at least `read` bytes (more when the next PDU needs more).
    /// The first call under the limits in force sizes the buffer for every later one: room
    /// for the read beside a PDU of the largest size they allow kept at the front and as many
    /// bytes before it, which is the most a reclaim in place needs. Later calls then only
    /// reclaim the space of the PDUs handed out, and allocate nothing while no PDU's data is
    /// still held; a buffer that grew whenever a part PDU first outgrew its slack would
    /// allocate at a time no one chose, long after the connection began.
    pub fn reserve_for_read(&mut self, read: usize) {
        let floor = read + 2 * self.max_pdu_len();
        if self.sized < floor {
            self.buf.reserve(floor);
            self.sized = floor;
        }
        self.buf.reserve(self.needed().max(read));
    }

    /// The longest PDU the limits in force let through: the longest header with its digest,
    /// the padding up to the data alignment, the most data and its digest.
    pub fn max_pdu_len(&self) -> usize {
        MAX_HLEN
            + 2 * DIGEST_LEN
            + (usize::from(self.limits.pda) + 1) * 4
            + self.limits.max_data as usize
    }

    /// The bytes taken in and not yet made into PDUs (the start of the next one), unless
    /// the deframer failed. A connection handed to another process ([`crate::handover`])
    /// carries them, for that process's deframer to [`feed`](Self::feed) first.
    pub fn unread(&self) -> Option<&[u8]> {
        self.failed.is_none().then_some(&self.buf[..])
    }

    /// Bytes buffered and not yet handed out.
    pub fn buffered(&self) -> usize {
        self.buf.len()
    }

    /// How many more bytes the next PDU needs (0 when one is ready): what to read next.
    pub fn needed(&self) -> usize {
        if self.buf.len() < CH_LEN {
            return CH_LEN - self.buf.len();
        }
        match self.check(&self.buf) {
            Ok(f) => f.plen.saturating_sub(self.buf.len()),
            Err(_) => 0,
        }
    }

    /// The next whole PDU, `Ok(None)` when more bytes are needed, or the fatal error that
    /// ends the connection.
    pub fn next_pdu(&mut self) -> Result<Option<Pdu>, DeframeError> {
        if let Some(e) = &self.failed {
            return Err(e.clone());
        }
        if self.buf.len() < CH_LEN {
            return Ok(None);
        }
        let f = match self.check(&self.buf) {
            Ok(f) => f,
            Err(e) => return Err(self.failed.insert(e).clone()),
        };
        if self.buf.len() < f.plen {
            return Ok(None);
        }
        let header = &self.buf[..f.hlen];
        if f.header_digest {
            let sent = &self.buf[f.hlen..f.hlen + DIGEST_LEN];
            if crc_fast::crc32_iscsi(header).to_le_bytes() != sent {
                let e = DeframeError::from_parts(FatalError::HeaderDigest, 0, header);
                return Err(self.failed.insert(e).clone());
            }
        }
        let decoded = Header::read(f.pdu_type, f.flags, header);
        let mut frame = self.buf.split_to(f.plen);
        frame.advance(f.data_at);
        // A PDU without data hands out no slice of the receive buffer: an empty slice would
        // keep it shared while its command lives (an R2T's write waits for its data), and
        // the next bytes received would then need a new buffer.
        let mut data = if frame.is_empty() {
            Bytes::new()
        } else {
            frame.freeze()
        };
        let mut data_digest_ok = true;
        if f.data_digest {
            let sent = data.split_off(f.data_len);
            data_digest_ok = super::pdu::data_digest([&data[..]]) == sent[..];
        }
        Ok(Some(Pdu {
            header: decoded,
            data,
            data_digest_ok,
        }))
    }

    /// Checks the common header at the start of `b` (and DATAL of a data PDU, once in):
    /// where the PDU's parts are, or the fatal error.
    fn check(&self, b: &[u8]) -> Result<Frame, DeframeError> {
        let fail = |fes, fei| {
            Err(DeframeError::from_parts(
                fes,
                fei,
                &b[..b.len().min(MAX_HLEN)],
            ))
        };
        let invalid = |fei| fail(FatalError::InvalidHeaderField, fei);
        let Some(t) = PduType::from_code(b[0]) else {
            return invalid(0);
        };
        if t.from_host() != (self.side == Side::Controller) {
            return invalid(0);
        }
        let flags = b[1];
        let hlen = usize::from(b[2]);
        if hlen != t.header_len() {
            return invalid(2);
        }
        let plen = u32::from_le_bytes([b[4], b[5], b[6], b[7]]) as usize;
        let digests = if t.has_digests() {
            self.limits.digests
        } else {
            Digests::default()
        };
        let header_digest = flags & HDGSTF != 0;
        if header_digest != digests.header || (flags & DDGSTF != 0 && !digests.data) {
            return invalid(1);
        }
        let hd = if header_digest { DIGEST_LEN } else { 0 };
        let bare = Frame {
            pdu_type: t,
            flags,
            hlen,
            header_digest,
            data_digest: false,
            data_at: hlen + hd,
            data_len: 0,
            plen: hlen + hd,
        };
        match t {
            PduType::IcReq | PduType::IcResp | PduType::CapsuleResp | PduType::R2T => {
                if plen != hlen + hd {
                    return invalid(4);
                }
                Ok(bare)
            }
            PduType::H2CTermReq | PduType::C2HTermReq => {
                if plen < hlen || plen > MAX_TERM_REQ_LEN {
                    return invalid(4);
                }
                Ok(Frame {
                    data_at: hlen,
                    data_len: plen - hlen,
                    plen,
                    ..bare
                })
            }
            PduType::CapsuleCmd | PduType::H2CData | PduType::C2HData => {
                if plen < hlen + hd {
                    return invalid(4);
                }
                let data_digest = flags & DDGSTF != 0;
                let dd = if data_digest { DIGEST_LEN } else { 0 };
                let f = if plen == hlen + hd {
                    if data_digest {
                        return invalid(1);
                    }
                    bare
                } else {
                    if digests.data && !data_digest {
                        return invalid(1);
                    }
                    let pdo = usize::from(b[3]);
                    let align = (usize::from(self.limits.pda) + 1) * 4;
                    if pdo < hlen + hd || pdo % align != 0 || pdo + dd > plen {
                        return invalid(3);
                    }
                    let data_len = plen - pdo - dd;
                    if data_len > self.limits.max_data as usize {
                        return fail(FatalError::DataLimitExceeded, 4);
                    }
                    Frame {
                        data_digest,
                        data_at: pdo,
                        data_len,
                        plen,
                        ..bare
                    }
                };
                // DATAL says the same as PLEN, once the header is in.
                if matches!(t, PduType::H2CData | PduType::C2HData) && b.len() >= 20 {
                    let datal = u32::from_le_bytes([b[16], b[17], b[18], b[19]]) as usize;
                    if datal != f.data_len {
                        return invalid(16);
                    }
                }
                Ok(f)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::pdu::{encode, DataHeader, Framing, IcReq, TermReq};
    use super::*;
    use crate::sqe::{Sgl, Sqe};

    fn both() -> Digests {
        Digests {
            header: true,
            data: true,
        }
    }

    fn pdu(header: Header, data: &[u8], framing: &Framing) -> Vec<u8> {
        let e = encode(&header, data.len() as u32, framing).unwrap();
        let mut v = e.to_vec();
        v.extend_from_slice(data);
        if e.needs_data_digest() {
            v.extend_from_slice(&super::super::pdu::data_digest([data]));
        }
        v
    }

    fn controller(limits: Limits) -> Deframer {
        let mut d = Deframer::new(Side::Controller);
        d.set_limits(limits);
        d
    }

    fn write_capsule(len: u32) -> Header {
        let mut sqe = Sqe::new(0x01, 7);
        sqe.set_sgl(Sgl::in_capsule(0, len));
        Header::CapsuleCmd(sqe)
    }

    /// Once sized by `reserve_for_read`, the buffer is never moved to a new allocation,
    /// whatever the reads cut: capsules of 4 KiB and H2CData of 8 KiB read in pieces of
    /// every length from 1 byte to the whole room, each PDU dropped once taken, stay in the
    /// one allocation (its data pointers all inside it), and come out intact.
    #[test]
    fn a_sized_buffer_is_reclaimed_in_place_whatever_the_reads_cut() {
        let framing = Framing {
            digests: both(),
            pda: 0,
        };
        let mut d = controller(Limits {
            digests: both(),
            pda: 0,
            max_data: 8192,
        });
        let data: Vec<u8> = (0..8192u32).map(|i| (i * 7) as u8).collect();
        let cmd = pdu(write_capsule(4096), &data[..4096], &framing);
        let h2c = pdu(
            Header::H2CData(DataHeader {
                cccid: 7,
                ttag: 1,
                datao: 0,
                datal: 8192,
                last: true,
                success: false,
            }),
            &data,
            &framing,
        );
        let stream: Vec<u8> = (0..64)
            .flat_map(|i| if i % 3 == 0 { h2c.clone() } else { cmd.clone() })
            .collect();
        const READ: usize = 16 * 1024;
        d.reserve_for_read(READ);
        let base = d.buffer_mut().as_ptr() as usize;
        let end = base + d.buffer_mut().capacity();
        let (mut at, mut cut, mut pdus) = (0, 1usize, 0);
        while at < stream.len() {
            d.reserve_for_read(READ);
            let b = d.buffer_mut();
            let p = b.as_ptr() as usize;
            assert!(p >= base && p + b.capacity() <= end, "moved at byte {at}");
            let n = cut.min(b.capacity() - b.len()).min(stream.len() - at);
            b.extend_from_slice(&stream[at..at + n]);
            at += n;
            cut = cut * 5 % 40_009 + 1;
            while let Some(p) = d.next_pdu().unwrap() {
                assert!(p.data_digest_ok);
                assert_eq!(&p.data[..], &data[..p.data.len()]);
                pdus += 1;
            }
        }
        assert_eq!(pdus, 64);
    }

    /// An ICReq, then a command capsule with in-capsule data and an H2CData, fed a byte at a
    /// time, with digests and a 16-byte alignment: each comes out whole, data intact.
    #[test]
    fn pdus_fed_a_byte_at_a_time_come_out_whole() {
        let framing = Framing {
            digests: both(),
            pda: 3,
        };
        let limits = Limits {
            digests: both(),
            pda: 3,
            max_data: 8192,
        };
        let ic = pdu(
            Header::IcReq(IcReq {
                pfv: 0,
                hpda: 0,
                digests: both(),
                maxr2t: 0,
            }),
            &[],
            &Framing::default(),
        );
        let data: Vec<u8> = (0..4096u32).map(|i| i as u8).collect();
        let cmd = pdu(write_capsule(4096), &data, &framing);
        let h2c = pdu(
            Header::H2CData(DataHeader {
                cccid: 7,
                ttag: 1,
                datao: 0,
                datal: 512,
                last: true,
                success: false,
            }),
            &data[..512],
            &framing,
        );
        let mut d = Deframer::new(Side::Controller);
        for &b in &ic {
            assert!(d.next_pdu().unwrap().is_none());
            d.feed(&[b]);
        }
        let p = d.next_pdu().unwrap().unwrap();
        assert!(matches!(p.header, Header::IcReq(r) if r.digests == both()));
        d.set_limits(limits);
        let mut got = Vec::new();
        for &b in cmd.iter().chain(&h2c) {
            d.feed(&[b]);
            if let Some(p) = d.next_pdu().unwrap() {
                got.push(p);
            }
        }
        assert_eq!(got.len(), 2);
        assert_eq!(got[0].header, write_capsule(4096));
        assert_eq!(&got[0].data[..], &data[..]);
        assert!(got[0].data_digest_ok);
        assert!(matches!(got[1].header, Header::H2CData(h) if h.last && h.ttag == 1));
        assert_eq!(&got[1].data[..], &data[..512]);
        assert_eq!(d.buffered(), 0);
    }

    /// The lengths a peer sends are checked from the common header alone, before its data
    /// is waited for, each naming the field.
    #[test]
    fn bad_headers_are_fatal_and_name_the_field() {
        let limits = Limits {
            digests: Digests::default(),
            pda: 0,
            max_data: 8192,
        };
        let check = |bytes: Vec<u8>, fes: FatalError, fei: u32| {
            let mut d = controller(limits);
            d.feed(&bytes[..CH_LEN]);
            let e = d.next_pdu().expect_err("fatal on the common header");
            assert_eq!((e.fes, e.fei), (fes, fei), "{bytes:?}");
            assert_eq!(&e.pdu_header()[..CH_LEN], &bytes[..CH_LEN]);
            assert!(d.next_pdu().is_err(), "stays failed");
        };
        let good = pdu(write_capsule(16), &[0; 16], &Framing::default());
        // An unknown type; a controller's PDU sent to a controller.
        let mut b = good.clone();
        b[0] = 0x08;
        check(b, FatalError::InvalidHeaderField, 0);
        let mut b = good.clone();
        b[0] = PduType::R2T.code();
        check(b, FatalError::InvalidHeaderField, 0);
        // HLEN.
        let mut b = good.clone();
        b[2] = 70;
        check(b, FatalError::InvalidHeaderField, 2);
        // A header digest flag without header digests.
        let mut b = good.clone();
        b[1] |= HDGSTF;
        check(b, FatalError::InvalidHeaderField, 1);
        // PDO inside the header.
        let mut b = good.clone();
        b[3] = 8;
        check(b, FatalError::InvalidHeaderField, 3);
        // 4 GiB of in-capsule data announced: refused before anything is buffered.
        let mut b = good.clone();
        b[4..8].copy_from_slice(&u32::MAX.to_le_bytes());
        check(b, FatalError::DataLimitExceeded, 4);
        // An ICReq of another length.
        let mut b = pdu(
            Header::IcReq(IcReq {
                pfv: 0,
                hpda: 0,
                digests: Digests::default(),
                maxr2t: 0,
            }),
            &[],
            &Framing::default(),
        );
        b[4] = 200;
        check(b, FatalError::InvalidHeaderField, 4);
        // A TermReq longer than 152 bytes.
        let mut b = pdu(
            Header::H2CTermReq(TermReq {
                fes: FatalError::PduSequence,
                fei: 0,
            }),
            &[],
            &Framing::default(),
        );
        b[4] = 153;
        check(b, FatalError::InvalidHeaderField, 4);
    }

    #[test]
    fn datal_must_match_plen_and_digests_are_checked() {
        let limits = Limits {
            digests: both(),
            pda: 0,
            max_data: 8192,
        };
        let framing = Framing {
            digests: both(),
            pda: 0,
        };
        let h2c = |datal| {
            Header::H2CData(DataHeader {
                cccid: 1,
                ttag: 1,
                datao: 0,
                datal,
                last: true,
                success: false,
            })
        };
        // DATAL 100 with 64 bytes of data.
        let mut d = controller(limits);
        d.feed(&pdu(h2c(100), &[1; 64], &framing));
        let e = d.next_pdu().unwrap_err();
        assert_eq!((e.fes, e.fei), (FatalError::InvalidHeaderField, 16));
        // A header digest that does not match: fatal.
        let mut b = pdu(h2c(64), &[1; 64], &framing);
        b[9] ^= 1;
        let mut d = controller(limits);
        d.feed(&b);
        assert_eq!(d.next_pdu().unwrap_err().fes, FatalError::HeaderDigest);
        // A data digest that does not match: the PDU, marked.
        let mut b = pdu(h2c(64), &[1; 64], &framing);
        let n = b.len();
        b[n - 1] ^= 1;
        let mut d = controller(limits);
        d.feed(&b);
        let p = d.next_pdu().unwrap().unwrap();
        assert!(!p.data_digest_ok);
        assert_eq!(p.data.len(), 64);
        // Data without the data digest flag while data digests are on.
        let mut b = pdu(h2c(64), &[1; 64], &framing);
        b[1] &= !DDGSTF;
        let mut d = controller(limits);
        d.feed(&b);
        assert_eq!(d.next_pdu().unwrap_err().fei, 1);
    }

    #[test]
    fn needed_says_what_to_read_next() {
        let mut d = controller(Limits {
            digests: Digests::default(),
            pda: 0,
            max_data: 8192,
        });
        assert_eq!(d.needed(), CH_LEN);
        let b = pdu(write_capsule(100), &[0; 100], &Framing::default());
        d.feed(&b[..CH_LEN]);
        assert_eq!(d.needed(), b.len() - CH_LEN);
        d.feed(&b[CH_LEN..]);
        assert_eq!(d.needed(), 0);
        assert!(d.next_pdu().unwrap().is_some());
    }
}
