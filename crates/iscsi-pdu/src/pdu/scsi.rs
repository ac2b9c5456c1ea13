//! SCSI Command and SCSI Response (RFC 7143 sections 11.3 and 11.4), with the extended-CDB and
//! bidirectional-read-length AHS (section 11.2.2).

use bytes::{BufMut, Bytes, BytesMut};

use super::data::{decode_residual, residual_bits};
use super::{code_enum, no_ahs, Body, Pdu};
use crate::bhs::{padding, Fields, Opcode, View};
use crate::error::{DecodeError, PduError};
use crate::serial::SerialNumber;
use crate::types::{Lun, Residual, ScsiStatus, TaskAttribute};

const AHS_EXTENDED_CDB: u8 = 1;
const AHS_BIDI_READ_LENGTH: u8 = 2;

/// The longest extended CDB part this crate encodes: what fits in TotalAHSLength (1020 bytes)
/// beside its 4-byte AHS header and an 8-byte bidirectional-read-length AHS. Real CDBs stop at 260.
pub const MAX_EXTENDED_CDB: usize = 1020 - 4 - 8;

/// SCSI Command.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct ScsiCommand {
    /// I bit.
    pub immediate: bool,
    /// F bit: no unsolicited Data-Out follows.
    pub final_bit: bool,
    /// R bit: data flows to the initiator.
    pub read: bool,
    /// W bit: data flows to the target.
    pub write: bool,
    /// ATTR: the task attribute.
    pub task_attribute: TaskAttribute,
    /// LUN.
    pub lun: Lun,
    /// Initiator Task Tag.
    pub initiator_task_tag: u32,
    /// Expected Data Transfer Length (the write length for bidirectional commands).
    pub expected_data_transfer_length: u32,
    /// CmdSN.
    pub cmd_sn: SerialNumber,
    /// ExpStatSN.
    pub exp_stat_sn: SerialNumber,
    /// The first 16 bytes of the CDB.
    pub cdb: [u8; 16],
    /// CDB bytes beyond the 16th, from an Extended CDB AHS (a zero-copy slice).
    pub extended_cdb: Option<Bytes>,
    /// Bidirectional Read Expected Data Transfer Length, from its AHS.
    pub bidirectional_read_length: Option<u32>,
    /// Immediate data.
    pub data: Bytes,
}

impl ScsiCommand {
    /// The CDB's length: 16 plus the extended part.
    pub fn cdb_len(&self) -> usize {
        16 + self.extended_cdb.as_ref().map_or(0, Bytes::len)
    }
}

impl Body for ScsiCommand {
    const OPCODE: Opcode = Opcode::ScsiCommand;

    #[inline(always)]
    fn decode(f: View<'_>, ahs: Option<Bytes>, data: Bytes) -> Result<Pdu, DecodeError> {
        let flags = f.b(1);
        let cdb = f.bytes(32);
        let (extended_cdb, bidirectional_read_length) = match ahs {
            None => (None, None),
            Some(ahs) => decode_ahs(&ahs)?,
        };
        Ok(Pdu::ScsiCommand(ScsiCommand {
            immediate: f.b(0) & 0x40 != 0,
            final_bit: flags & 0x80 != 0,
            read: flags & 0x40 != 0,
            write: flags & 0x20 != 0,
            task_attribute: TaskAttribute::from_bits(flags),
            lun: Lun(f.lun()),
            initiator_task_tag: f.w(0),
            expected_data_transfer_length: f.w(1),
            cmd_sn: SerialNumber(f.w(2)),
            exp_stat_sn: SerialNumber(f.w(3)),
            cdb,
            extended_cdb,
            bidirectional_read_length,
            data,
        }))
    }

    fn encode(&self, f: &mut Fields) {
        f.b[1] = u8::from(self.final_bit) << 7
            | u8::from(self.read) << 6
            | u8::from(self.write) << 5
            | self.task_attribute.bits();
        f.lun = self.lun.0;
        f.w[0] = self.initiator_task_tag;
        f.w[1] = self.expected_data_transfer_length;
        f.w[2] = self.cmd_sn.0;
        f.w[3] = self.exp_stat_sn.0;
        for i in 0..4 {
            f.w[4 + i] =
                u32::from_be_bytes(self.cdb[4 * i..4 * i + 4].try_into().expect("4 bytes"));
        }
    }

    fn immediate(&self) -> bool {
        self.immediate
    }

    fn write_ahs(&self, dst: &mut BytesMut) {
        if let Some(ext) = &self.extended_cdb {
            let ext = &ext[..ext.len().min(MAX_EXTENDED_CDB)];
            dst.put_u16(ext.len() as u16 + 1);
            dst.put_u8(AHS_EXTENDED_CDB);
            dst.put_u8(0);
            dst.put_slice(ext);
            dst.put_slice(padding(ext.len()));
        }
        if let Some(len) = self.bidirectional_read_length {
            dst.put_u16(5);
            dst.put_u8(AHS_BIDI_READ_LENGTH);
            dst.put_u8(0);
            dst.put_u32(len);
        }
    }

    fn data(&self) -> &Bytes {
        &self.data
    }
}

type Ahs = (Option<Bytes>, Option<u32>);

/// One AHS: AHSLength (2) | AHSType (1) | type-specific bytes (AHSLength of them, the first
/// reserved) | padding to 4 bytes.
fn ahs_entry(i: &[u8]) -> nom::IResult<&[u8], (u8, &[u8])> {
    use nom::bytes::complete::take;
    use nom::number::complete::{be_u16, be_u8};
    use nom::Parser;
    let (i, (len, kind)) = (be_u16, be_u8).parse(i)?;
    let len = usize::from(len);
    let (i, body) = take(len)(i)?;
    let (i, _pad) = take(padding(3 + len).len())(i)?;
    Ok((i, (kind, body)))
}

/// Walks the AHS list of a SCSI Command (RFC 7143 section 11.2.2).
fn decode_ahs(ahs: &Bytes) -> Result<Ahs, PduError> {
    let bad = |reason| PduError::InvalidField {
        field: "AHS",
        reason,
    };
    let (mut ext, mut bidi) = (None, None);
    let mut rest: &[u8] = ahs;
    while !rest.is_empty() {
        let (next, (kind, body)) =
            ahs_entry(rest).map_err(|_| bad("AHSLength runs past TotalAHSLength"))?;
        if body.is_empty() {
            return Err(bad("AHSLength is 0"));
        }
        let start = ahs.len() - rest.len() + 4;
        match kind {
            AHS_EXTENDED_CDB if ext.is_none() => {
                ext = Some(ahs.slice(start..start + body.len() - 1))
            }
            AHS_BIDI_READ_LENGTH if bidi.is_none() => {
                let b: [u8; 4] = body[1..]
                    .try_into()
                    .map_err(|_| bad("bidirectional read length AHS must have AHSLength 5"))?;
                bidi = Some(u32::from_be_bytes(b));
            }
            AHS_EXTENDED_CDB | AHS_BIDI_READ_LENGTH => return Err(bad("AHS type repeated")),
            _ => return Err(bad("unknown AHS type")),
        }
        rest = next;
    }
    Ok((ext, bidi))
}

code_enum! {
    /// The Response field of a SCSI Response (RFC 7143 section 11.4.3).
    ScsiResponseCode: u8 {
        /// 0x00: Command Completed at Target; the Status field is meaningful.
        CommandCompleted = 0x00,
        /// 0x01: Target Failure.
        TargetFailure = 0x01,
    }
}

// `code_enum!` cannot carry `#[default]`.
#[allow(clippy::derivable_impls)]
impl Default for ScsiResponseCode {
    fn default() -> Self {
        ScsiResponseCode::CommandCompleted
    }
}

/// SCSI Response: status, residuals, and sense data in the data segment.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct ScsiResponse {
    /// o/u bits and Bidirectional Read Residual Count.
    pub bidirectional_read_residual: Residual,
    /// O/U bits and Residual Count.
    pub residual: Residual,
    /// Response.
    pub response: ScsiResponseCode,
    /// Status.
    pub status: ScsiStatus,
    /// Initiator Task Tag.
    pub initiator_task_tag: u32,
    /// SNACK Tag (0 unless answering an R-Data SNACK).
    pub snack_tag: u32,
    /// StatSN.
    pub stat_sn: SerialNumber,
    /// ExpCmdSN.
    pub exp_cmd_sn: SerialNumber,
    /// MaxCmdSN.
    pub max_cmd_sn: SerialNumber,
    /// ExpDataSN: the number of Data-In (and R2T) PDUs the target sent for the command.
    pub exp_data_sn: u32,
    /// SenseLength (2 bytes) | Sense Data | Response Data; see [`ScsiResponse::sense`].
    pub data: Bytes,
}

impl ScsiResponse {
    /// The sense data of the data segment, if any (a zero-copy slice).
    pub fn sense(&self) -> Option<Bytes> {
        if self.data.len() < 2 {
            return None;
        }
        let len = usize::from(u16::from_be_bytes([self.data[0], self.data[1]]));
        if len == 0 || 2 + len > self.data.len() {
            return None;
        }
        Some(self.data.slice(2..2 + len))
    }

    /// Builds the data segment for `sense`: SenseLength followed by the sense bytes.
    pub fn sense_segment(sense: &[u8]) -> Bytes {
        let mut b = BytesMut::with_capacity(2 + sense.len());
        b.put_u16(sense.len().min(usize::from(u16::MAX)) as u16);
        b.put_slice(sense);
        b.freeze()
    }
}

impl Body for ScsiResponse {
    const OPCODE: Opcode = Opcode::ScsiResponse;

    #[inline(always)]
    fn decode(f: View<'_>, ahs: Option<Bytes>, data: Bytes) -> Result<Pdu, DecodeError> {
        no_ahs(&ahs)?;
        let flags = f.b(1);
        Ok(Pdu::ScsiResponse(ScsiResponse {
            bidirectional_read_residual: decode_residual(flags >> 3, f.w(6), "o/u bits")?,
            residual: decode_residual(flags >> 1, f.w(7), "O/U bits")?,
            response: ScsiResponseCode::from(f.b(2)),
            status: ScsiStatus(f.b(3)),
            initiator_task_tag: f.w(0),
            snack_tag: f.w(1),
            stat_sn: SerialNumber(f.w(2)),
            exp_cmd_sn: SerialNumber(f.w(3)),
            max_cmd_sn: SerialNumber(f.w(4)),
            exp_data_sn: f.w(5),
            data,
        }))
    }

    fn encode(&self, f: &mut Fields) {
        f.b[1] = 0x80
            | residual_bits(self.bidirectional_read_residual) << 3
            | residual_bits(self.residual) << 1;
        f.b[2] = self.response.into();
        f.b[3] = self.status.0;
        f.w = [
            self.initiator_task_tag,
            self.snack_tag,
            self.stat_sn.0,
            self.exp_cmd_sn.0,
            self.max_cmd_sn.0,
            self.exp_data_sn,
            self.bidirectional_read_residual.count(),
            self.residual.count(),
        ];
    }

    fn data(&self) -> &Bytes {
        &self.data
    }
}
