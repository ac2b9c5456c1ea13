//! NVMe/TCP PDUs (NVM Express TCP Transport Specification 1.0, section 3.6): the 8-byte
//! common header, each PDU type's header, and how a header is framed on the wire (header
//! digest, padding up to the PDU data offset the receiver asked for, data, data digest).
//!
//! All multi-byte fields are little-endian. A PDU is `HLEN` bytes of header, a 4-byte header
//! digest when HDGSTF is set, padding up to `PDO`, the data, and a 4-byte data digest when
//! DDGSTF is set; `PLEN` counts all of it.

use crate::cqe::Cqe;
use crate::sqe::Sqe;

/// Length of the common header (CH).
pub const CH_LEN: usize = 8;
/// Length of a header or data digest.
pub const DIGEST_LEN: usize = 4;
/// The longest header any PDU type has (ICReq, ICResp).
pub const MAX_HLEN: usize = 128;
/// The longest H2CTermReq or C2HTermReq: its header and up to 128 bytes of the PDU in error.
pub const MAX_TERM_REQ_LEN: usize = 152;
/// The smallest MAXH2CDATA a controller may declare.
pub const MIN_MAXH2CDATA: u32 = 4096;
/// The largest HPDA or CPDA: data aligned to (31 + 1) * 4 = 128 bytes.
pub const MAX_PDA: u8 = 31;
/// PDU Format Version 1.0, the one there is.
pub const PFV_1_0: u16 = 0;

/// Common header flag: a header digest follows the header.
pub const HDGSTF: u8 = 1 << 0;
/// Common header flag: a data digest follows the data.
pub const DDGSTF: u8 = 1 << 1;
/// H2CData and C2HData flag: the last PDU of the command's data.
pub const LAST_PDU: u8 = 1 << 2;
/// C2HData flag: the command succeeded, and no CapsuleResp follows (needs LAST_PDU).
pub const SUCCESS: u8 = 1 << 3;

/// PDU-type.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum PduType {
    /// Initialize Connection Request (host to controller).
    IcReq,
    /// Initialize Connection Response.
    IcResp,
    /// Host to Controller Terminate Connection Request.
    H2CTermReq,
    /// Controller to Host Terminate Connection Request.
    C2HTermReq,
    /// Command Capsule: an SQE and in-capsule data.
    CapsuleCmd,
    /// Response Capsule: a CQE.
    CapsuleResp,
    /// Host to Controller Data (a write's data, after an R2T).
    H2CData,
    /// Controller to Host Data (a read's data).
    C2HData,
    /// Ready to Transfer: the controller asks for a write's data.
    R2T,
}

impl PduType {
    /// Its code.
    pub fn code(self) -> u8 {
        match self {
            PduType::IcReq => 0x00,
            PduType::IcResp => 0x01,
            PduType::H2CTermReq => 0x02,
            PduType::C2HTermReq => 0x03,
            PduType::CapsuleCmd => 0x04,
            PduType::CapsuleResp => 0x05,
            PduType::H2CData => 0x06,
            PduType::C2HData => 0x07,
            PduType::R2T => 0x09,
        }
    }

    /// The type with `code`.
    pub fn from_code(code: u8) -> Option<PduType> {
        Some(match code {
            0x00 => PduType::IcReq,
            0x01 => PduType::IcResp,
            0x02 => PduType::H2CTermReq,
            0x03 => PduType::C2HTermReq,
            0x04 => PduType::CapsuleCmd,
            0x05 => PduType::CapsuleResp,
            0x06 => PduType::H2CData,
            0x07 => PduType::C2HData,
            0x09 => PduType::R2T,
            _ => return None,
        })
    }

    /// HLEN: the length of its header, common header included, digest excluded.
    pub fn header_len(self) -> usize {
        match self {
            PduType::IcReq | PduType::IcResp => 128,
            PduType::CapsuleCmd => CH_LEN + Sqe::LEN,
            PduType::CapsuleResp => CH_LEN + Cqe::LEN,
            PduType::H2CTermReq
            | PduType::C2HTermReq
            | PduType::H2CData
            | PduType::C2HData
            | PduType::R2T => 24,
        }
    }

    /// Whether the host sends it.
    pub fn from_host(self) -> bool {
        matches!(
            self,
            PduType::IcReq | PduType::H2CTermReq | PduType::CapsuleCmd | PduType::H2CData
        )
    }

    /// Whether it may carry data (a TermReq's data is the PDU in error).
    pub fn carries_data(self) -> bool {
        matches!(
            self,
            PduType::H2CTermReq
                | PduType::C2HTermReq
                | PduType::CapsuleCmd
                | PduType::H2CData
                | PduType::C2HData
        )
    }

    /// Whether the digests negotiated apply to it: never to the connection's initialization
    /// and termination PDUs.
    pub fn has_digests(self) -> bool {
        !matches!(
            self,
            PduType::IcReq | PduType::IcResp | PduType::H2CTermReq | PduType::C2HTermReq
        )
    }
}

/// Which digests a connection uses, as ICReq asks and ICResp grants.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Hash)]
pub struct Digests {
    /// HDGST_ENABLE.
    pub header: bool,
    /// DDGST_ENABLE.
    pub data: bool,
}

impl Digests {
    fn from_bits(b: u8) -> Digests {
        Digests {
            header: b & 1 != 0,
            data: b & 2 != 0,
        }
    }

    fn bits(self) -> u8 {
        u8::from(self.header) | u8::from(self.data) << 1
    }
}

/// Fatal Error Status of a TermReq: why the connection ends.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum FatalError {
    /// 01h: Invalid PDU Header Field (FEI: the byte offset of the field).
    InvalidHeaderField,
    /// 02h: PDU Sequence Error (a PDU where none of its type may come).
    PduSequence,
    /// 03h: Header Digest Error.
    HeaderDigest,
    /// 04h: Data Transfer Out of Range (data beyond what an R2T asked, or the command has).
    DataOutOfRange,
    /// 05h: Data Transfer Limit Exceeded (more data in one PDU than negotiated; R2T limit
    /// exceeded).
    DataLimitExceeded,
    /// 06h: Unsupported Parameter (FEI: the byte offset of the field).
    UnsupportedParameter,
    /// Any other code, kept as read.
    Other(u16),
}

impl FatalError {
    /// FES.
    pub fn code(self) -> u16 {
        match self {
            FatalError::InvalidHeaderField => 1,
            FatalError::PduSequence => 2,
            FatalError::HeaderDigest => 3,
            FatalError::DataOutOfRange => 4,
            FatalError::DataLimitExceeded => 5,
            FatalError::UnsupportedParameter => 6,
            FatalError::Other(c) => c,
        }
    }

    /// From FES.
    pub fn from_code(code: u16) -> FatalError {
        match code {
            1 => FatalError::InvalidHeaderField,
            2 => FatalError::PduSequence,
            3 => FatalError::HeaderDigest,
            4 => FatalError::DataOutOfRange,
            5 => FatalError::DataLimitExceeded,
            6 => FatalError::UnsupportedParameter,
            c => FatalError::Other(c),
        }
    }
}

/// ICReq: what the host asks of the connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct IcReq {
    /// PFV: 0.
    pub pfv: u16,
    /// HPDA: the alignment the host wants for data in PDUs to it, (HPDA + 1) * 4 bytes.
    pub hpda: u8,
    /// The digests the host asks for.
    pub digests: Digests,
    /// MAXR2T: R2Ts the controller may have outstanding per command, 0's based.
    pub maxr2t: u32,
}

/// ICResp: what the controller grants.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct IcResp {
    /// PFV: 0.
    pub pfv: u16,
    /// CPDA: the alignment the controller wants for data in PDUs to it.
    pub cpda: u8,
    /// The digests in force from now on.
    pub digests: Digests,
    /// MAXH2CDATA: the most data one H2CData PDU may carry.
    pub maxh2cdata: u32,
}

/// H2CTermReq or C2HTermReq.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct TermReq {
    /// FES.
    pub fes: FatalError,
    /// FEI: for a header field, the byte offset of the field in error.
    pub fei: u32,
}

/// H2CData or C2HData.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct DataHeader {
    /// CCCID: the command's CID.
    pub cccid: u16,
    /// TTAG: the R2T's transfer tag (H2CData; zero in C2HData).
    pub ttag: u16,
    /// DATAO: the data's offset in the command's data.
    pub datao: u32,
    /// DATAL: the data's length in this PDU.
    pub datal: u32,
    /// LAST_PDU.
    pub last: bool,
    /// SUCCESS (C2HData): no CapsuleResp follows.
    pub success: bool,
}

/// R2T.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct R2t {
    /// CCCID.
    pub cccid: u16,
    /// TTAG: what the H2CData PDUs answering it carry.
    pub ttag: u16,
    /// R2TO: the offset of the data asked.
    pub r2to: u32,
    /// R2TL: its length.
    pub r2tl: u32,
}

/// A PDU's header, decoded.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Header {
    /// ICReq.
    IcReq(IcReq),
    /// ICResp.
    IcResp(IcResp),
    /// H2CTermReq.
    H2CTermReq(TermReq),
    /// C2HTermReq.
    C2HTermReq(TermReq),
    /// CapsuleCmd.
    CapsuleCmd(Sqe),
    /// CapsuleResp.
    CapsuleResp(Cqe),
    /// H2CData.
    H2CData(DataHeader),
    /// C2HData.
    C2HData(DataHeader),
    /// R2T.
    R2T(R2t),
}

fn u16_at(b: &[u8], i: usize) -> u16 {
    u16::from_le_bytes([b[i], b[i + 1]])
}

fn u32_at(b: &[u8], i: usize) -> u32 {
    u32::from_le_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]])
}

impl Header {
    /// Its PDU type.
    pub fn pdu_type(&self) -> PduType {
        match self {
            Header::IcReq(_) => PduType::IcReq,
            Header::IcResp(_) => PduType::IcResp,
            Header::H2CTermReq(_) => PduType::H2CTermReq,
            Header::C2HTermReq(_) => PduType::C2HTermReq,
            Header::CapsuleCmd(_) => PduType::CapsuleCmd,
            Header::CapsuleResp(_) => PduType::CapsuleResp,
            Header::H2CData(_) => PduType::H2CData,
            Header::C2HData(_) => PduType::C2HData,
            Header::R2T(_) => PduType::R2T,
        }
    }

    /// The type-specific flags it sets (LAST_PDU, SUCCESS).
    fn flags(&self) -> u8 {
        match self {
            Header::H2CData(d) | Header::C2HData(d) => {
                (if d.last { LAST_PDU } else { 0 }) | (if d.success { SUCCESS } else { 0 })
            }
            _ => 0,
        }
    }

    /// Writes the header after the common header into `h` (HLEN bytes, zeroed).
    fn write_specific(&self, h: &mut [u8]) {
        match self {
            Header::IcReq(r) => {
                h[8..10].copy_from_slice(&r.pfv.to_le_bytes());
                h[10] = r.hpda;
                h[11] = r.digests.bits();
                h[12..16].copy_from_slice(&r.maxr2t.to_le_bytes());
            }
            Header::IcResp(r) => {
                h[8..10].copy_from_slice(&r.pfv.to_le_bytes());
                h[10] = r.cpda;
                h[11] = r.digests.bits();
                h[12..16].copy_from_slice(&r.maxh2cdata.to_le_bytes());
            }
            Header::H2CTermReq(t) | Header::C2HTermReq(t) => {
                h[8..10].copy_from_slice(&t.fes.code().to_le_bytes());
                h[10..14].copy_from_slice(&t.fei.to_le_bytes());
            }
            Header::CapsuleCmd(sqe) => h[8..72].copy_from_slice(sqe.as_bytes()),
            Header::CapsuleResp(cqe) => h[8..24].copy_from_slice(&cqe.to_bytes()),
            Header::H2CData(d) | Header::C2HData(d) => {
                h[8..10].copy_from_slice(&d.cccid.to_le_bytes());
                h[10..12].copy_from_slice(&d.ttag.to_le_bytes());
                h[12..16].copy_from_slice(&d.datao.to_le_bytes());
                h[16..20].copy_from_slice(&d.datal.to_le_bytes());
            }
            Header::R2T(r) => {
                h[8..10].copy_from_slice(&r.cccid.to_le_bytes());
                h[10..12].copy_from_slice(&r.ttag.to_le_bytes());
                h[12..16].copy_from_slice(&r.r2to.to_le_bytes());
                h[16..20].copy_from_slice(&r.r2tl.to_le_bytes());
            }
        }
    }

    /// Decodes header `h` (HLEN bytes, common header first) of type `t` with `flags`.
    pub(crate) fn read(t: PduType, flags: u8, h: &[u8]) -> Header {
        let data = |ttag: bool| DataHeader {
            cccid: u16_at(h, 8),
            ttag: if ttag { u16_at(h, 10) } else { 0 },
            datao: u32_at(h, 12),
            datal: u32_at(h, 16),
            last: flags & LAST_PDU != 0,
            success: flags & SUCCESS != 0,
        };
        let term = || TermReq {
            fes: FatalError::from_code(u16_at(h, 8)),
            fei: u32_at(h, 10),
        };
        match t {
            PduType::IcReq => Header::IcReq(IcReq {
                pfv: u16_at(h, 8),
                hpda: h[10],
                digests: Digests::from_bits(h[11]),
                maxr2t: u32_at(h, 12),
            }),
            PduType::IcResp => Header::IcResp(IcResp {
                pfv: u16_at(h, 8),
                cpda: h[10],
                digests: Digests::from_bits(h[11]),
                maxh2cdata: u32_at(h, 12),
            }),
            PduType::H2CTermReq => Header::H2CTermReq(term()),
            PduType::C2HTermReq => Header::C2HTermReq(term()),
            PduType::CapsuleCmd => {
                Header::CapsuleCmd(Sqe::parse(&h[8..]).unwrap_or_else(|| Sqe::new(0, 0)))
            }
            PduType::CapsuleResp => Header::CapsuleResp(
                Cqe::parse(&h[8..]).unwrap_or_else(|| Cqe::new(0, crate::Status::SUCCESS)),
            ),
            PduType::H2CData => Header::H2CData(data(true)),
            PduType::C2HData => Header::C2HData(data(false)),
            PduType::R2T => Header::R2T(R2t {
                cccid: u16_at(h, 8),
                ttag: u16_at(h, 10),
                r2to: u32_at(h, 12),
                r2tl: u32_at(h, 16),
            }),
        }
    }
}

/// How PDUs are framed toward a receiver: the digests in force and the data alignment the
/// receiver asked for (HPDA for PDUs to the host, CPDA for PDUs to the controller).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Framing {
    /// The digests in force (none before ICResp).
    pub digests: Digests,
    /// The receiver's PDU data alignment, 0 to 31: data starts at a multiple of
    /// (`pda` + 1) * 4 bytes.
    pub pda: u8,
}

impl Framing {
    /// The data alignment in bytes.
    pub fn alignment(&self) -> usize {
        (usize::from(self.pda.min(MAX_PDA)) + 1) * 4
    }
}

/// The most bytes before a PDU's data: the largest header with data (CapsuleCmd and its digest,
/// 76 bytes) padded to a 72-byte alignment (PDA 17) is 144; ICReq and ICResp are 128.
pub const MAX_ENCODED_HEADER: usize = 144;

/// The bytes of a PDU's header that an [`EncodedHeader`] holds: the longest header whose bytes
/// are not all zero at the end, CapsuleCmd's 72 and its digest (ICReq's and ICResp's last 112
/// bytes are reserved, zeros; so is the padding up to PDO).
const INLINE_HEADER: usize = 80;

/// What the zeros at an encoded header's end are sent from.
static ZEROS: [u8; MAX_ENCODED_HEADER] = [0; MAX_ENCODED_HEADER];

/// A PDU's bytes before its data: header, header digest, padding; on the stack, and small (a
/// transmit is moved through queues once per PDU, so its size is paid on every I/O: with the
/// 144 bytes the longest needs inline, each move was a call to memcpy, 6% of targetd's samples
/// at 4 KiB reads). The trailing zeros (reserved bytes, padding) are not held but sent from a
/// static: [`EncodedHeader::slices`].
#[derive(Clone, Copy)]
pub struct EncodedHeader {
    bytes: [u8; INLINE_HEADER],
    len: u8,
    zeros: u8,
    data_digest: bool,
}

impl std::fmt::Debug for EncodedHeader {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EncodedHeader")
            .field("bytes", &self.head())
            .field("zeros", &self.zeros)
            .finish()
    }
}

impl EncodedHeader {
    /// The bytes to send before the data, in order: the header's own, then zeros.
    pub fn slices(&self) -> [&[u8]; 2] {
        [self.head(), &ZEROS[..usize::from(self.zeros)]]
    }

    /// The header's bytes before its trailing zeros (at least the common header and the
    /// PDU-specific fields).
    pub fn head(&self) -> &[u8] {
        &self.bytes[..usize::from(self.len)]
    }

    /// How many bytes go before the data (PDO when data follows, else HLEN and the digest).
    pub fn len(&self) -> usize {
        usize::from(self.len) + usize::from(self.zeros)
    }

    /// Never empty: every PDU has a header.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The bytes before the data, in one vector (tests, and the header a TermReq quotes).
    pub fn to_vec(&self) -> Vec<u8> {
        let mut v = Vec::with_capacity(self.len());
        for s in self.slices() {
            v.extend_from_slice(s);
        }
        v
    }

    /// Whether a data digest must follow the data ([`data_digest`]).
    pub fn needs_data_digest(&self) -> bool {
        self.data_digest
    }
}

/// Frames `header` for a PDU with `data_len` bytes of data: the common header (with PLEN,
/// PDO and the digest flags), the header, its digest, and the padding up to PDO. The caller
/// sends the data after it and, when [`EncodedHeader::needs_data_digest`], the
/// [`data_digest`] of the data. `None` when the header cannot be framed (a TermReq with more
/// than 128 bytes of error data, or data on a PDU type that carries none).
pub fn encode(header: &Header, data_len: u32, framing: &Framing) -> Option<EncodedHeader> {
    let t = header.pdu_type();
    let hlen = t.header_len();
    if data_len > 0 && !t.carries_data() {
        return None;
    }
    let digests = if t.has_digests() {
        framing.digests
    } else {
        Digests::default()
    };
    let hd = if digests.header { DIGEST_LEN } else { 0 };
    let dd = digests.data && data_len > 0;
    let (pdo, plen) = if matches!(t, PduType::H2CTermReq | PduType::C2HTermReq) {
        // The error data follows the header at once; PDO is not used.
        if hlen + data_len as usize > MAX_TERM_REQ_LEN {
            return None;
        }
        (0, hlen as u64 + u64::from(data_len))
    } else if data_len > 0 {
        let a = framing.alignment();
        let pdo = (hlen + hd).div_ceil(a) * a;
        (
            pdo,
            pdo as u64 + u64::from(data_len) + if dd { DIGEST_LEN as u64 } else { 0 },
        )
    } else {
        (0, (hlen + hd) as u64)
    };
    let plen = u32::try_from(plen).ok()?;
    let len = if pdo > 0 { pdo } else { hlen + hd };
    debug_assert!(len <= MAX_ENCODED_HEADER);
    // What is held: up to the last byte that may not be zero.
    let held = if hlen + hd <= INLINE_HEADER {
        hlen + hd
    } else {
        IC_FIELDS_END
    };
    let mut out = EncodedHeader {
        bytes: [0; INLINE_HEADER],
        len: held as u8,
        zeros: u8::try_from(len - held).ok()?,
        data_digest: dd,
    };
    let fill = |h: &mut [u8]| {
        h[0] = t.code();
        h[1] =
            header.flags() | if digests.header { HDGSTF } else { 0 } | if dd { DDGSTF } else { 0 };
        h[2] = hlen as u8;
        h[3] = pdo as u8;
        h[4..8].copy_from_slice(&plen.to_le_bytes());
        header.write_specific(&mut h[..hlen]);
        if digests.header {
            let crc = crc_fast::crc32_iscsi(&h[..hlen]);
            h[hlen..hlen + DIGEST_LEN].copy_from_slice(&crc.to_le_bytes());
        }
    };
    if hlen + hd <= INLINE_HEADER {
        // Every header that goes with data (and its digest) is written where it is held.
        fill(&mut out.bytes[..hlen + hd]);
    } else {
        // ICReq and ICResp (no digests, no data) are 128 bytes of which only the first 16
        // are not reserved: written whole into a scratch buffer, their reserved bytes go out
        // as zeros.
        let mut scratch = [0u8; 128];
        fill(&mut scratch[..hlen + hd]);
        debug_assert!(scratch[held..hlen + hd].iter().all(|&b| b == 0));
        out.bytes[..held].copy_from_slice(&scratch[..held]);
    }
    Some(out)
}

/// Where ICReq's and ICResp's fields end (MAXR2T, MAXH2CDATA); reserved bytes follow.
const IC_FIELDS_END: usize = 16;

/// The data digest of a PDU's data, in however many slices it lies: CRC32C, little-endian.
pub fn data_digest<'a>(data: impl IntoIterator<Item = &'a [u8]>) -> [u8; DIGEST_LEN] {
    let mut d = crc_fast::Digest::new(crc_fast::CrcAlgorithm::Crc32Iscsi);
    for s in data {
        d.update(s);
    }
    (d.finalize() as u32).to_le_bytes()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A Linux host's ICReq (HPDA 0, both digests, MAXR2T 0) byte for byte, and a
    /// controller's ICResp.
    #[test]
    fn icreq_and_icresp_bytes() {
        let req = Header::IcReq(IcReq {
            pfv: PFV_1_0,
            hpda: 0,
            digests: Digests {
                header: true,
                data: true,
            },
            maxr2t: 0,
        });
        let e = encode(&req, 0, &Framing::default()).unwrap();
        let b = &e.to_vec();
        assert_eq!(b.len(), 128);
        assert_eq!(
            &b[..16],
            &[0, 0, 128, 0, 128, 0, 0, 0, 0, 0, 0, 3, 0, 0, 0, 0]
        );
        assert!(b[16..].iter().all(|&x| x == 0));
        assert_eq!(Header::read(PduType::IcReq, b[1], b), req);

        let resp = Header::IcResp(IcResp {
            pfv: 0,
            cpda: 0,
            digests: Digests::default(),
            maxh2cdata: 0x20000,
        });
        // Digests in force do not apply to ICResp.
        let framing = Framing {
            digests: Digests {
                header: true,
                data: true,
            },
            pda: 0,
        };
        let b = encode(&resp, 0, &framing).unwrap();
        assert_eq!(
            &b.to_vec()[..16],
            &[1, 0, 128, 0, 128, 0, 0, 0, 0, 0, 0, 0, 0, 0, 2, 0]
        );
    }

    /// A C2HData with 4 KiB to a host that asked HPDA 7 (32-byte alignment), digests on:
    /// PDO 32, PLEN 32 + 4096 + 4.
    #[test]
    fn data_is_aligned_and_digested() {
        let d = Header::C2HData(DataHeader {
            cccid: 5,
            ttag: 0,
            datao: 0,
            datal: 4096,
            last: true,
            success: true,
        });
        let framing = Framing {
            digests: Digests {
                header: true,
                data: true,
            },
            pda: 7,
        };
        let e = encode(&d, 4096, &framing).unwrap();
        let b = &e.to_vec();
        assert_eq!(b.len(), 32);
        assert_eq!(b[0], 7);
        assert_eq!(b[1], HDGSTF | DDGSTF | LAST_PDU | SUCCESS);
        assert_eq!((b[2], b[3]), (24, 32));
        assert_eq!(
            u32::from_le_bytes(b[4..8].try_into().unwrap()),
            32 + 4096 + 4
        );
        assert_eq!(
            u32::from_le_bytes(b[24..28].try_into().unwrap()),
            crc_fast::crc32_iscsi(&b[..24])
        );
        assert!(e.needs_data_digest());
        // 32 zero bytes: the digest iSCSI's RFC gives (aa 36 91 8a).
        assert_eq!(
            data_digest([&[0u8; 16][..], &[0u8; 16][..]]),
            [0xaa, 0x36, 0x91, 0x8a]
        );
        // No data, no PDO, no data digest flag.
        let resp = Header::CapsuleResp(Cqe::new(5, crate::Status::SUCCESS));
        let b = encode(&resp, 0, &framing).unwrap();
        assert_eq!(b.to_vec().len(), 28);
        assert_eq!(b.to_vec()[1], HDGSTF);
        assert_eq!(b.to_vec()[3], 0);
        assert!(
            encode(&resp, 1, &framing).is_none(),
            "a CapsuleResp has no data"
        );
    }

    /// The largest header (a CapsuleCmd with its digest) at every alignment a peer may ask
    /// fits [`MAX_ENCODED_HEADER`], and its PDO is where the data starts.
    #[test]
    fn every_alignment_fits_the_encoded_header() {
        let cmd = Header::CapsuleCmd(Sqe::new(0x01, 1));
        for pda in 0..=u8::MAX {
            for header in [false, true] {
                let framing = Framing {
                    digests: Digests { header, data: true },
                    pda,
                };
                let e = encode(&cmd, 4096, &framing).unwrap();
                let b = &e.to_vec();
                assert!(b.len() <= MAX_ENCODED_HEADER);
                assert_eq!(usize::from(b[3]), b.len(), "PDO at pda {pda}");
                assert_eq!(b.len() % framing.alignment(), 0);
            }
        }
    }
}
