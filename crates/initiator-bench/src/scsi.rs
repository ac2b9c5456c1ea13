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

/// SENSE KEY names (SPC-5 table 52).
const SENSE_KEYS: [&str; 16] = [
    "NO SENSE",
    "RECOVERED ERROR",
    "NOT READY",
    "MEDIUM ERROR",
    "HARDWARE ERROR",
    "ILLEGAL REQUEST",
    "UNIT ATTENTION",
    "DATA PROTECT",
    "BLANK CHECK",
    "VENDOR SPECIFIC",
    "COPY ABORTED",
    "ABORTED COMMAND",
    "RESERVED",
    "VOLUME OVERFLOW",
    "MISCOMPARE",
    "COMPLETED",
];

/// Names of the additional sense codes a target commonly returns (SPC-5 annex F).
const ASC_NAMES: &[((u8, u8), &str)] = &[
    ((0x00, 0x00), "NO ADDITIONAL SENSE INFORMATION"),
    ((0x04, 0x01), "LOGICAL UNIT IS IN PROCESS OF BECOMING READY"),
    (
        (0x04, 0x02),
        "LOGICAL UNIT NOT READY, INITIALIZING COMMAND REQUIRED",
    ),
    (
        (0x04, 0x0a),
        "LOGICAL UNIT NOT ACCESSIBLE, ASYMMETRIC ACCESS STATE TRANSITION",
    ),
    (
        (0x04, 0x0b),
        "LOGICAL UNIT NOT ACCESSIBLE, TARGET PORT IN STANDBY STATE",
    ),
    (
        (0x04, 0x0c),
        "LOGICAL UNIT NOT ACCESSIBLE, TARGET PORT IN UNAVAILABLE STATE",
    ),
    ((0x0c, 0x00), "WRITE ERROR"),
    ((0x0e, 0x03), "INVALID FIELD IN COMMAND INFORMATION UNIT"),
    ((0x11, 0x00), "UNRECOVERED READ ERROR"),
    ((0x1a, 0x00), "PARAMETER LIST LENGTH ERROR"),
    ((0x1d, 0x00), "MISCOMPARE DURING VERIFY OPERATION"),
    ((0x20, 0x00), "INVALID COMMAND OPERATION CODE"),
    ((0x21, 0x00), "LOGICAL BLOCK ADDRESS OUT OF RANGE"),
    ((0x24, 0x00), "INVALID FIELD IN CDB"),
    ((0x25, 0x00), "LOGICAL UNIT NOT SUPPORTED"),
    ((0x26, 0x00), "INVALID FIELD IN PARAMETER LIST"),
    ((0x26, 0x04), "INVALID RELEASE OF PERSISTENT RESERVATION"),
    ((0x27, 0x00), "WRITE PROTECTED"),
    ((0x27, 0x07), "SPACE ALLOCATION FAILED WRITE PROTECT"),
    (
        (0x29, 0x00),
        "POWER ON, RESET, OR BUS DEVICE RESET OCCURRED",
    ),
    ((0x29, 0x03), "BUS DEVICE RESET FUNCTION OCCURRED"),
    ((0x29, 0x07), "I_T NEXUS LOSS OCCURRED"),
    ((0x2a, 0x01), "MODE PARAMETERS CHANGED"),
    ((0x2a, 0x03), "RESERVATIONS PREEMPTED"),
    ((0x2a, 0x04), "RESERVATIONS RELEASED"),
    ((0x2a, 0x05), "REGISTRATIONS PREEMPTED"),
    ((0x2a, 0x06), "ASYMMETRIC ACCESS STATE CHANGED"),
    ((0x2a, 0x09), "CAPACITY DATA HAS CHANGED"),
    ((0x2c, 0x00), "COMMAND SEQUENCE ERROR"),
    ((0x2f, 0x00), "COMMANDS CLEARED BY ANOTHER INITIATOR"),
    ((0x3a, 0x00), "MEDIUM NOT PRESENT"),
    ((0x3f, 0x0e), "REPORTED LUNS DATA HAS CHANGED"),
    ((0x44, 0x00), "INTERNAL TARGET FAILURE"),
    ((0x47, 0x00), "SCSI PARITY ERROR"),
    ((0x49, 0x00), "INVALID MESSAGE ERROR"),
    ((0x4b, 0x00), "DATA PHASE ERROR"),
    ((0x4e, 0x00), "OVERLAPPED COMMANDS ATTEMPTED"),
    ((0x53, 0x02), "MEDIUM REMOVAL PREVENTED"),
    ((0x55, 0x04), "INSUFFICIENT REGISTRATION RESOURCES"),
];

impl Sense {
    /// The sense key's name.
    pub fn key_name(&self) -> &'static str {
        SENSE_KEYS[usize::from(self.key & 0x0f)]
    }

    /// The additional sense code's name, when it is one a target commonly returns.
    pub fn asc_name(&self) -> Option<&'static str> {
        ASC_NAMES
            .iter()
            .find(|(code, _)| *code == (self.asc, self.ascq))
            .map(|(_, n)| *n)
    }
}

/// As a person reads it: `ILLEGAL REQUEST / LOGICAL UNIT NOT SUPPORTED (25h/00h)`.
impl std::fmt::Display for Sense {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let (asc, ascq) = (self.asc, self.ascq);
        match self.asc_name() {
            Some(n) => write!(f, "{} / {n} ({asc:02X}h/{ascq:02X}h)", self.key_name()),
            None => write!(f, "{} / ASC {asc:02X}h, ASCQ {ascq:02X}h", self.key_name()),
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

    /// INQUIRY of vital product data page `page`.
    pub fn inquiry_vpd(page: u8, allocation_length: u16) -> [u8; 16] {
        let mut c = inquiry(allocation_length);
        c[1] = 0x01; // EVPD.
        c[2] = page;
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

/// What the Block Limits page (VPD B0h) says about transfer lengths, in blocks; 0 is "not
/// reported".
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlockLimits {
    /// MAXIMUM TRANSFER LENGTH.
    pub max_transfer: u32,
    /// OPTIMAL TRANSFER LENGTH.
    pub optimal_transfer: u32,
}

impl BlockLimits {
    /// Parses the page (with its 4-byte header).
    pub fn parse(page: &[u8]) -> Option<BlockLimits> {
        if page.len() < 16 || page[1] != 0xb0 {
            return None;
        }
        let word = |at: usize| u32::from_be_bytes(page[at..at + 4].try_into().expect("4 bytes"));
        Some(BlockLimits {
            max_transfer: word(8),
            optimal_transfer: word(12),
        })
    }

    /// The most blocks Linux's sd driver puts in one request for a unit with these limits
    /// and `block_size`-byte blocks (drivers/scsi/sd.c, sd_revalidate_disk and
    /// sd_validate_opt_xfer_size: the optimal length when it is valid, at least a 4 KiB page,
    /// within the maximum and the driver's 0xffff blocks; else the maximum, capped at
    /// BLK_DEF_MAX_SECTORS_CAP, 2560 sectors of 512 bytes).
    pub fn linux_max_blocks(&self, block_size: u32) -> u32 {
        let bs = u64::from(block_size.max(1));
        let optimal = u64::from(self.optimal_transfer) * bs;
        let within = self.max_transfer == 0 || self.optimal_transfer <= self.max_transfer;
        let valid = optimal >= 4096 && within && self.optimal_transfer <= 0xffff;
        if valid {
            return self.optimal_transfer;
        }
        let cap = 2560 * 512 / bs;
        match self.max_transfer {
            0 => cap as u32,
            m => u64::from(m).min(cap) as u32,
        }
    }
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

    #[test]
    fn block_limits_and_linux_request_sizes() {
        let mut page = [0u8; 64];
        page[1] = 0xb0;
        page[8..12].copy_from_slice(&65536u32.to_be_bytes());
        page[12..16].copy_from_slice(&256u32.to_be_bytes());
        let l = BlockLimits::parse(&page).unwrap();
        assert_eq!((l.max_transfer, l.optimal_transfer), (65536, 256));
        // 256 blocks of 512: Linux sends 128 KiB commands.
        assert_eq!(l.linux_max_blocks(512), 256);
        // No optimal length: the maximum, capped at 1280 KiB (what it sends to tgt).
        let none = BlockLimits {
            optimal_transfer: 0,
            ..l
        };
        assert_eq!(none.linux_max_blocks(512), 2560);
        assert_eq!(none.linux_max_blocks(4096), 320);
        // An optimal length below a page is ignored.
        let tiny = BlockLimits {
            optimal_transfer: 4,
            ..l
        };
        assert_eq!(tiny.linux_max_blocks(512), 2560);
        assert_eq!(BlockLimits::parse(&page[..8]), None);
    }
}
