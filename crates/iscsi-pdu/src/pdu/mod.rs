//! Every PDU of RFC 7143, one file per family, and the [`Pdu`] enum that decodes and encodes them.

use bytes::{Buf, BufMut, Bytes, BytesMut};

use crate::bhs::{
    check_data_digest, frame, padding, Bhs, Fields, Frame, Opcode, View, BHS_LEN,
    MAX_DATA_SEGMENT_LENGTH,
};
use crate::digest::{crc32c, data_digest, Digests};
use crate::error::{DecodeError, PduError};

pub mod async_msg;
pub mod data;
pub mod login;
pub mod logout;
pub mod nop;
pub mod r2t;
pub mod reject;
pub mod scsi;
pub mod snack;
pub mod task_mgmt;
pub mod text;

pub use async_msg::{AsyncEvent, AsyncMessage};
pub use data::{DataIn, DataInStatus, DataOut};
pub use login::{LoginRequest, LoginResponse, LoginStatus, LoginStatusClass};
pub use logout::{LogoutReason, LogoutRequest, LogoutResponse, LogoutResponseCode};
pub use nop::{NopIn, NopOut};
pub use r2t::ReadyToTransfer;
pub use reject::{Reject, RejectReason};
pub use scsi::{ScsiCommand, ScsiResponse, ScsiResponseCode};
pub use snack::{SnackRequest, SnackType};
pub use task_mgmt::{
    TaskManagementFunction, TaskManagementRequest, TaskManagementResponse, TmfResponse,
};
pub use text::{TextRequest, TextResponse};

/// Declares a code field as an enum whose unnamed values are kept in `Other`, so that a value the
/// RFC reserves or a vendor defines survives decode and encode for the state machine to answer.
macro_rules! code_enum {
    ($(#[$m:meta])* $name:ident: $repr:ty { $($(#[$vm:meta])* $variant:ident = $val:literal,)+ }) => {
        $(#[$m])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
        pub enum $name {
            $($(#[$vm])* $variant,)+
            /// A value without a name here, kept as received.
            Other($repr),
        }
        impl From<$repr> for $name {
            fn from(v: $repr) -> Self {
                match v {
                    $($val => $name::$variant,)+
                    other => $name::Other(other),
                }
            }
        }
        impl From<$name> for $repr {
            fn from(v: $name) -> $repr {
                match v {
                    $($name::$variant => $val,)+
                    $name::Other(other) => other,
                }
            }
        }
    };
}
pub(crate) use code_enum;

/// One PDU family's BHS layout: how its fields map to the BHS words, and its AHS and data.
pub(crate) trait Body: Sized {
    const OPCODE: Opcode;
    /// Builds the PDU from the parsed BHS, the raw AHS and the data segment (a zero-copy slice).
    fn decode(f: View<'_>, ahs: Option<Bytes>, data: Bytes) -> Result<Pdu, DecodeError>;
    /// Fills `f` (all but the opcode byte, which the caller sets from `OPCODE` and `immediate`).
    fn encode(&self, f: &mut Fields);
    /// The I bit (initiator PDUs only).
    fn immediate(&self) -> bool {
        false
    }
    /// Writes the AHS, padded, if the PDU has one.
    fn write_ahs(&self, _dst: &mut BytesMut) {}
    /// The data segment carried inline.
    fn data(&self) -> &Bytes;
}

/// Checks that a PDU that must not carry an AHS has none.
pub(crate) fn no_ahs(ahs: &Option<Bytes>) -> Result<(), PduError> {
    if ahs.is_none() {
        Ok(())
    } else {
        Err(PduError::InvalidField {
            field: "TotalAHSLength",
            reason: "this PDU carries no AHS",
        })
    }
}

/// Checks that a PDU without a data segment has none.
pub(crate) fn no_data(data: &Bytes) -> Result<(), PduError> {
    if data.is_empty() {
        Ok(())
    } else {
        Err(PduError::InvalidField {
            field: "DataSegmentLength",
            reason: "this PDU carries no data",
        })
    }
}

/// Puts the offending header into a [`DecodeError::Malformed`] from a [`Body`] decoder.
#[inline(always)]
fn with_header(result: &mut Result<Pdu, DecodeError>, bhs: &[u8; BHS_LEN]) {
    if let Err(DecodeError::Malformed { header, .. }) = result {
        **header = Bhs(*bhs);
    }
}

/// The empty data segment, for PDU families that have none.
pub(crate) static EMPTY: Bytes = Bytes::new();

macro_rules! pdu_enum {
    ($($variant:ident($ty:ty),)+) => {
        /// Any iSCSI PDU, typed. Data segments are zero-copy slices of the decoded input.
        #[derive(Debug, Clone, PartialEq, Eq)]
        #[allow(clippy::large_enum_variant)]
        pub enum Pdu {
            $(
                #[doc = concat!("A ", stringify!($variant), " PDU.")]
                $variant($ty),
            )+
        }

        $(impl From<$ty> for Pdu {
            fn from(p: $ty) -> Pdu {
                Pdu::$variant(p)
            }
        })+

        impl Pdu {
            /// The opcode.
            pub fn opcode(&self) -> Opcode {
                match self {
                    $(Pdu::$variant(_) => <$ty as Body>::OPCODE,)+
                }
            }

            #[inline(always)]
            fn from_parts(opcode: Opcode, f: View<'_>, ahs: Option<Bytes>, data: Bytes) -> Result<Pdu, DecodeError> {
                match opcode {
                    $(Opcode::$variant => <$ty as Body>::decode(f, ahs, data),)+
                }
            }

            /// The data segment carried inline (empty for PDUs without one, and for headers whose
            /// payload the sender supplies separately).
            pub fn data(&self) -> &Bytes {
                match self {
                    $(Pdu::$variant(p) => p.data(),)+
                }
            }

            fn fields(&self) -> Fields {
                match self {
                    $(Pdu::$variant(p) => fields_of(p),)+
                }
            }

            fn write_ahs(&self, dst: &mut BytesMut) {
                match self {
                    $(Pdu::$variant(p) => p.write_ahs(dst),)+
                }
            }
        }
    };
}

pdu_enum! {
    NopOut(NopOut),
    ScsiCommand(ScsiCommand),
    TaskManagementRequest(TaskManagementRequest),
    LoginRequest(LoginRequest),
    TextRequest(TextRequest),
    DataOut(DataOut),
    LogoutRequest(LogoutRequest),
    SnackRequest(SnackRequest),
    NopIn(NopIn),
    ScsiResponse(ScsiResponse),
    TaskManagementResponse(TaskManagementResponse),
    LoginResponse(LoginResponse),
    TextResponse(TextResponse),
    DataIn(DataIn),
    LogoutResponse(LogoutResponse),
    ReadyToTransfer(ReadyToTransfer),
    AsyncMessage(AsyncMessage),
    Reject(Reject),
}

fn fields_of<B: Body>(p: &B) -> Fields {
    let mut f = Fields::default();
    p.encode(&mut f);
    f.b[0] = B::OPCODE as u8 | if p.immediate() { 0x40 } else { 0 };
    f
}

impl Pdu {
    /// Decodes the PDU at the start of `buf` and advances `buf` past it. The data segment (and
    /// an extended CDB) are zero-copy slices of `buf`. `max_data_segment_length` is this side's
    /// declared MaxRecvDataSegmentLength; a longer segment is refused before it is looked at.
    ///
    /// On [`DecodeError::Incomplete`] and on fatal errors `buf` is left as it was. After a
    /// [`DecodeError::Malformed`] the bad PDU has been consumed: answer it with a Reject and go on.
    #[inline]
    pub fn decode(
        buf: &mut Bytes,
        digests: Digests,
        max_data_segment_length: u32,
    ) -> Result<Pdu, DecodeError> {
        let fr = frame(buf, digests, max_data_segment_length)?;
        let result = Pdu::decode_frame(buf, &fr);
        buf.advance(fr.len);
        result
    }

    #[inline(always)]
    fn decode_frame(input: &Bytes, fr: &Frame) -> Result<Pdu, DecodeError> {
        let bhs: &[u8; BHS_LEN] = input[..BHS_LEN]
            .try_into()
            .expect("framed input holds a BHS");
        // The header is copied only on the error path, for the Reject.
        let malformed = |error: PduError| DecodeError::Malformed {
            header: Box::new(Bhs(*bhs)),
            error,
        };
        check_data_digest(input, fr).map_err(malformed)?;
        let opcode = Opcode::from_u8(bhs[0] & 0x3f)
            .ok_or_else(|| malformed(PduError::UnsupportedOpcode(bhs[0] & 0x3f)))?;
        let ahs = (!fr.ahs.is_empty()).then(|| input.slice(fr.ahs.clone()));
        let data = if fr.data.is_empty() {
            Bytes::new()
        } else {
            input.slice(fr.data.clone())
        };
        let mut result = Pdu::from_parts(opcode, View(bhs), ahs, data);
        with_header(&mut result, bhs);
        result
    }

    /// Decodes a PDU from its parts, for transports that read the BHS first and then receive the
    /// AHS and data segment into buffers of their own. Digests must already have been checked.
    pub fn from_header_and_data(header: &Bhs, ahs: Bytes, data: Bytes) -> Result<Pdu, DecodeError> {
        let malformed = |error: PduError| DecodeError::Malformed {
            header: Box::new(*header),
            error,
        };
        let opcode = header
            .opcode()
            .ok_or_else(|| malformed(PduError::UnsupportedOpcode(header.opcode_byte())))?;
        if ahs.len() != header.total_ahs_length()
            || data.len() != header.data_segment_length() as usize
        {
            return Err(malformed(PduError::InvalidField {
                field: "DataSegmentLength",
                reason: "does not match the segment",
            }));
        }
        let ahs = (!ahs.is_empty()).then_some(ahs);
        let mut result = Pdu::from_parts(opcode, View(&header.0), ahs, data);
        with_header(&mut result, &header.0);
        result
    }

    /// Encodes the whole PDU: header, header digest, data segment, padding, data digest.
    pub fn encode(&self, digests: Digests, dst: &mut BytesMut) {
        let data = self.data();
        self.encode_header(data.len() as u32, digests.header, dst);
        dst.put_slice(data);
        dst.put_slice(padding(data.len()));
        if digests.data && !data.is_empty() {
            dst.put_u32_le(data_digest([&data[..]]));
        }
    }

    /// Encodes only the header (BHS, AHS and, when `header_digest`, its CRC32C) announcing a data
    /// segment of `data_len` bytes, so a sender can write header + payload slices + padding
    /// ([`padding`]) + data digest ([`data_digest`]) with one vectored write. The inline data
    /// segment, if any, is not written.
    pub fn encode_header(&self, data_len: u32, header_digest: bool, dst: &mut BytesMut) {
        debug_assert!(data_len <= MAX_DATA_SEGMENT_LENGTH);
        let start = dst.len();
        dst.reserve(BHS_LEN + 4);
        dst.put_bytes(0, BHS_LEN);
        self.write_ahs(dst);
        let ahs_len = dst.len() - start - BHS_LEN;
        let mut bhs = [0u8; BHS_LEN];
        self.fields().write(ahs_len, data_len, &mut bhs);
        dst[start..start + BHS_LEN].copy_from_slice(&bhs);
        if header_digest {
            let d = crc32c(&dst[start..]);
            dst.put_u32_le(d);
        }
    }

    /// The BHS alone (48 bytes), as a Reject returns it.
    pub fn bhs(&self) -> Bhs {
        let mut scratch = BytesMut::with_capacity(BHS_LEN);
        self.encode_header(self.data().len() as u32, false, &mut scratch);
        let mut b = [0u8; BHS_LEN];
        b.copy_from_slice(&scratch[..BHS_LEN]);
        Bhs(b)
    }
}
