//! SCSI commands as the initiator sends them: a CDB, the data going out, the length coming in;
//! CDB builders for the commands the load generator needs; sense data parsing.

use bytes::Bytes;
use iscsi_pdu::{Residual, ScsiStatus};

use crate::error::{Error, Result};

/// A SCSI command to execute (the initiator machine's).
pub use iscsi_pdu::initiator::Command;

/// Sense key, additional sense code and qualifier.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Sense {
    /// SENSE KEY.
    pub key: u8,
    /// ADDITIONAL SENSE CODE.
    pub asc: u8,
    /// ADDITIONAL SENSE CODE QUALIFIER.
    pub ascq: u8,
}

impl Sense {
    /// Parses fixed (0x70/0x71) or descriptor (0x72/0x73) format sense data.
    pub fn parse(b: &[u8]) -> Option<Sense> {
        match b.first()? & 0x7f {
            0x70 | 0x71 if b.len() >= 14 => Some(Sense {
                key: b[2] & 0x0f,
                asc: b[12],
                ascq: b[13],
            }),
            0x72 | 0x73 if b.len() >= 4 => Some(Sense {
                key: b[1] & 0x0f,
                asc: b[2],
                ascq: b[3],
            }),
            _ => None,
        }
    }
}

/// What a command returned.
#[derive(Debug, Clone)]
pub struct Response {
    /// SCSI status.
    pub status: ScsiStatus,
    /// Sense data, with CHECK CONDITION.
    pub sense: Option<Bytes>,
    /// Data read (as many bytes as the target sent).
    pub data: Bytes,
    /// Residual as the target reported it.
    pub residual: Residual,
}

impl From<iscsi_pdu::initiator::ScsiReply> for Response {
    fn from(r: iscsi_pdu::initiator::ScsiReply) -> Response {
        Response {
            status: r.status,
            sense: r.sense,
            data: r.data,
            residual: r.residual,
        }
    }
}

impl Response {
    /// The response if its status is GOOD (or CONDITION MET), else an error with the sense.
    pub fn good(self) -> Result<Response> {
        if matches!(self.status, ScsiStatus::GOOD | ScsiStatus::CONDITION_MET) {
            Ok(self)
        } else {
            Err(Error::Scsi {
                status: self.status,
                sense: self.sense.as_deref().and_then(Sense::parse),
            })
        }
    }
}

/// CDB builders.
pub mod cdb {
    /// TEST UNIT READY.
    pub fn test_unit_ready() -> [u8; 16] {
        [0; 16]
    }

    /// INQUIRY, standard data.
    pub fn inquiry(allocation_length: u16) -> [u8; 16] {
        let mut c = [0u8; 16];
        c[0] = 0x12;
        c[3..5].copy_from_slice(&allocation_length.to_be_bytes());
        c
    }

    /// READ CAPACITY (16).
    pub fn read_capacity16() -> [u8; 16] {
        let mut c = [0u8; 16];
        c[0] = 0x9e;
        c[1] = 0x10;
        c[13] = 32;
        c
    }

    /// READ (10) when the LBA and length fit, else READ (16).
    pub fn read(lba: u64, blocks: u32) -> [u8; 16] {
        rw(0x28, 0x88, lba, blocks)
    }

    /// WRITE (10) when the LBA and length fit, else WRITE (16).
    pub fn write(lba: u64, blocks: u32) -> [u8; 16] {
        rw(0x2a, 0x8a, lba, blocks)
    }

    fn rw(op10: u8, op16: u8, lba: u64, blocks: u32) -> [u8; 16] {
        let mut c = [0u8; 16];
        match (u32::try_from(lba), u16::try_from(blocks)) {
            (Ok(l), Ok(n)) => {
                c[0] = op10;
                c[2..6].copy_from_slice(&l.to_be_bytes());
                c[7..9].copy_from_slice(&n.to_be_bytes());
            }
            _ => {
                c[0] = op16;
                c[2..10].copy_from_slice(&lba.to_be_bytes());
                c[10..14].copy_from_slice(&blocks.to_be_bytes());
            }
        }
        c
    }

    /// SYNCHRONIZE CACHE (10) of the whole LU.
    pub fn synchronize_cache() -> [u8; 16] {
        let mut c = [0u8; 16];
        c[0] = 0x35;
        c
    }
}

/// Capacity from READ CAPACITY (16) data: (blocks, block size).
pub fn parse_capacity16(data: &[u8]) -> Option<(u64, u32)> {
    if data.len() < 12 {
        return None;
    }
    let last = u64::from_be_bytes(data[..8].try_into().ok()?);
    let bs = u32::from_be_bytes(data[8..12].try_into().ok()?);
    Some((last.checked_add(1)?, bs))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cdbs_and_sense() {
        let r = cdb::read(7, 8);
        assert_eq!(&r[..10], &[0x28, 0, 0, 0, 0, 7, 0, 0, 8, 0]);
        let w = cdb::write(1 << 33, 8);
        assert_eq!(w[0], 0x8a);
        assert_eq!(u64::from_be_bytes(w[2..10].try_into().unwrap()), 1 << 33);
        let fixed = [
            0x70, 0, 0x05, 0, 0, 0, 0, 10, 0, 0, 0, 0, 0x24, 0x00, 0, 0, 0, 0,
        ];
        assert_eq!(
            Sense::parse(&fixed),
            Some(Sense {
                key: 5,
                asc: 0x24,
                ascq: 0
            })
        );
        assert_eq!(
            Sense::parse(&[0x72, 0x06, 0x29, 0x00]),
            Some(Sense {
                key: 6,
                asc: 0x29,
                ascq: 0
            })
        );
        assert_eq!(Sense::parse(&[0x70, 1]), None);
        let mut cap = [0u8; 32];
        cap[..8].copy_from_slice(&1023u64.to_be_bytes());
        cap[8..12].copy_from_slice(&512u32.to_be_bytes());
        assert_eq!(parse_capacity16(&cap), Some((1024, 512)));
    }
}
