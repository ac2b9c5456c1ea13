//! SRP_CMD (SRP-2 section 6.8): a SCSI command with the descriptors of the initiator's data
//! buffers.

use nom::bytes::complete::take;
use nom::number::complete::{be_u32, be_u64, be_u8};
use nom::Parser;

use super::descriptor::{DescriptorFormat, Descriptors, MemoryDescriptor, DESCRIPTOR_LEN};
use super::{parsed, IuError, IuType};

/// The fixed part of an SRP_CMD; the additional CDB and the descriptors follow it.
const FIXED: usize = 48;
/// The indirect data buffer descriptor's head: the table's descriptor and the total length.
const INDIRECT_HEAD: usize = DESCRIPTOR_LEN + 4;
/// Bytes of an immediate data buffer descriptor (SRP-2: the data's length).
const IMMEDIATE_LEN: usize = 4;

/// The field an [`IuError::InvalidField`] names when the data-out format is not one the
/// standard defines (a target logs the channel out with UNSUPPORTED DATA-OUT FORMAT).
pub const DATA_OUT_FORMAT: &str = "DATA-OUT BUFFER DESCRIPTOR FORMAT";
/// As [`DATA_OUT_FORMAT`], for data-in.
pub const DATA_IN_FORMAT: &str = "DATA-IN BUFFER DESCRIPTOR FORMAT";

/// TASK ATTRIBUTE (SRP-2 table 19), as SAM-5 defines the attributes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum TaskAttribute {
    /// SIMPLE (0).
    #[default]
    Simple,
    /// HEAD OF QUEUE (1).
    HeadOfQueue,
    /// ORDERED (2).
    Ordered,
    /// ACA (4).
    Aca,
}

impl TaskAttribute {
    fn from_code(code: u8) -> Option<TaskAttribute> {
        Some(match code {
            0 => TaskAttribute::Simple,
            1 => TaskAttribute::HeadOfQueue,
            2 => TaskAttribute::Ordered,
            4 => TaskAttribute::Aca,
            _ => return None,
        })
    }

    fn code(self) -> u8 {
        match self {
            TaskAttribute::Simple => 0,
            TaskAttribute::HeadOfQueue => 1,
            TaskAttribute::Ordered => 2,
            TaskAttribute::Aca => 4,
        }
    }
}

impl From<TaskAttribute> for scsi_core::TaskAttribute {
    fn from(a: TaskAttribute) -> Self {
        match a {
            TaskAttribute::Simple => scsi_core::TaskAttribute::Simple,
            TaskAttribute::HeadOfQueue => scsi_core::TaskAttribute::HeadOfQueue,
            TaskAttribute::Ordered => scsi_core::TaskAttribute::Ordered,
            TaskAttribute::Aca => scsi_core::TaskAttribute::Aca,
        }
    }
}

/// A data buffer descriptor of one direction.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum DataBufferDescriptor<'a> {
    /// No data in this direction.
    #[default]
    None,
    /// One region.
    Direct(MemoryDescriptor),
    /// A table of regions. `partial` holds the descriptors carried in the IU; when they are
    /// fewer than the table holds (`table.len / 16`), the target fetches the whole table from
    /// `table` by RDMA READ.
    Indirect {
        /// Where the whole descriptor table is in the initiator's memory.
        table: MemoryDescriptor,
        /// TOTAL LENGTH: the bytes all the table's regions hold.
        total_len: u32,
        /// The descriptors the IU carries (the DATA-OUT or DATA-IN BUFFER DESCRIPTOR COUNT).
        partial: Descriptors<'a>,
    },
    /// Immediate data of this length in the IU, at the offset negotiated at login (SRP-2,
    /// data-out only).
    Immediate {
        /// Bytes of immediate data.
        len: u32,
    },
}

impl DataBufferDescriptor<'_> {
    /// The format code.
    pub fn format(&self) -> DescriptorFormat {
        match self {
            DataBufferDescriptor::None => DescriptorFormat::None,
            DataBufferDescriptor::Direct(_) => DescriptorFormat::Direct,
            DataBufferDescriptor::Indirect { .. } => DescriptorFormat::Indirect,
            DataBufferDescriptor::Immediate { .. } => DescriptorFormat::Immediate,
        }
    }

    /// Bytes the initiator expects to move in this direction.
    pub fn expected_len(&self) -> u32 {
        match self {
            DataBufferDescriptor::None => 0,
            DataBufferDescriptor::Direct(d) => d.len,
            DataBufferDescriptor::Indirect { total_len, .. } => *total_len,
            DataBufferDescriptor::Immediate { len } => *len,
        }
    }

    /// The count field this descriptor gives in the IU.
    fn count(&self) -> u8 {
        match self {
            DataBufferDescriptor::Indirect { partial, .. } => partial.len() as u8,
            _ => 0,
        }
    }

    /// Whether the IU carries the whole table (always, but for a partial indirect one).
    pub fn is_complete(&self) -> bool {
        match self {
            DataBufferDescriptor::Indirect { table, partial, .. } => {
                partial.as_bytes().len() == table.len as usize
            }
            _ => true,
        }
    }

    fn encode(&self, out: &mut Vec<u8>) {
        match self {
            DataBufferDescriptor::None => {}
            DataBufferDescriptor::Direct(d) => d.encode(out),
            DataBufferDescriptor::Indirect {
                table,
                total_len,
                partial,
            } => {
                table.encode(out);
                out.extend_from_slice(&total_len.to_be_bytes());
                out.extend_from_slice(partial.as_bytes());
            }
            DataBufferDescriptor::Immediate { len } => out.extend_from_slice(&len.to_be_bytes()),
        }
    }

    fn encoded_len(&self) -> usize {
        match self {
            DataBufferDescriptor::None => 0,
            DataBufferDescriptor::Direct(_) => DESCRIPTOR_LEN,
            DataBufferDescriptor::Indirect { partial, .. } => {
                INDIRECT_HEAD + partial.as_bytes().len()
            }
            DataBufferDescriptor::Immediate { .. } => IMMEDIATE_LEN,
        }
    }
}

/// SRP_CMD.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct SrpCmd<'a> {
    /// Byte 1: SCSOLNT (bit 1) and UCSOLNT (bit 2), whether the response is to be sent with a
    /// solicited event.
    pub sol_not: u8,
    /// TAG.
    pub tag: u64,
    /// LOGICAL UNIT NUMBER (the 8-byte field, big-endian).
    pub lun: u64,
    /// TASK ATTRIBUTE.
    pub task_attribute: TaskAttribute,
    /// The CDB: the 16-byte CDB field followed by any ADDITIONAL CDB.
    pub cdb: &'a [u8],
    /// DATA-OUT BUFFER DESCRIPTOR.
    pub data_out: DataBufferDescriptor<'a>,
    /// DATA-IN BUFFER DESCRIPTOR.
    pub data_in: DataBufferDescriptor<'a>,
}

impl<'a> SrpCmd<'a> {
    /// Decodes an SRP_CMD from the whole IU.
    pub fn decode(b: &'a [u8]) -> Result<SrpCmd<'a>, IuError> {
        let iu = IuType::Cmd;
        let fixed = super::fixed(b, iu)?;
        let (_, sol_not, _, fmt, out_count, in_count, tag, _, lun, _, attr, _, add_cdb) = parsed(
            (
                be_u8,
                be_u8,
                take(3usize),
                be_u8,
                be_u8,
                be_u8,
                be_u64,
                take(4usize),
                be_u64,
                be_u8,
                be_u8,
                be_u8,
                be_u8,
            )
                .parse(fixed),
        );
        let invalid = IuError::invalid(iu, tag);
        let task_attribute = TaskAttribute::from_code(attr & 0x07)
            .ok_or_else(|| invalid("TASK ATTRIBUTE", "reserved"))?;
        // ADDITIONAL CDB LENGTH is in 4-byte words, in bits 7..2.
        let add_cdb = usize::from(add_cdb & 0xfc);
        let cdb_end = FIXED + add_cdb;
        let truncated = |needed| IuError::Truncated {
            iu,
            len: b.len(),
            needed,
        };
        let cdb = b.get(32..cdb_end).ok_or(truncated(cdb_end))?;
        let out_format = DescriptorFormat::from_code(fmt >> 4)
            .ok_or_else(|| invalid(DATA_OUT_FORMAT, "reserved"))?;
        let in_format = DescriptorFormat::from_code(fmt & 0x0f)
            .ok_or_else(|| invalid(DATA_IN_FORMAT, "reserved"))?;
        if in_format == DescriptorFormat::Immediate {
            return Err(invalid(DATA_IN_FORMAT, "immediate data is data-out only"));
        }
        let (data_out, at) = descriptor(b, cdb_end, out_format, out_count, tag, "DATA-OUT")?;
        let (data_in, _) = descriptor(b, at, in_format, in_count, tag, "DATA-IN")?;
        Ok(SrpCmd {
            sol_not,
            tag,
            lun,
            task_attribute,
            cdb,
            data_out,
            data_in,
        })
    }

    /// Bytes the IU occupies.
    pub fn encoded_len(&self) -> usize {
        let add_cdb = self.cdb.len().saturating_sub(16).next_multiple_of(4);
        FIXED + add_cdb + self.data_out.encoded_len() + self.data_in.encoded_len()
    }

    /// The immediate data of this command in `iu` (the whole IU it was decoded from), which
    /// starts at `offset`, the IMMEDIATE DATA OFFSET of the login: `None` when its data-out
    /// is not immediate, or when the data would overlap the descriptors or run past the IU.
    pub fn immediate_data<'b>(&self, iu: &'b [u8], offset: usize) -> Option<&'b [u8]> {
        let DataBufferDescriptor::Immediate { len } = self.data_out else {
            return None;
        };
        if offset < self.encoded_len() {
            return None;
        }
        iu.get(offset..offset.checked_add(len as usize)?)
    }

    /// Appends the IU, and `data` as immediate data at `offset` (the login's IMMEDIATE DATA
    /// OFFSET; the bytes between the descriptors and it are zeros). The data-out descriptor
    /// must be [`DataBufferDescriptor::Immediate`] of `data`'s length, and `offset` at least
    /// [`SrpCmd::encoded_len`].
    pub fn encode_with_immediate(&self, offset: usize, data: &[u8], out: &mut Vec<u8>) {
        let start = out.len();
        self.encode(out);
        out.resize(start + offset.max(out.len() - start), 0);
        out.extend_from_slice(data);
    }

    /// Appends the IU. A CDB shorter than 16 bytes is padded with zeros; one longer goes on in
    /// ADDITIONAL CDB, padded to a multiple of 4 bytes (at most 252).
    pub fn encode(&self, out: &mut Vec<u8>) {
        let fmt = self.data_out.format().code() << 4 | self.data_in.format().code();
        out.extend_from_slice(&[IuType::Cmd as u8, self.sol_not, 0, 0, 0, fmt]);
        out.push(self.data_out.count());
        out.push(self.data_in.count());
        out.extend_from_slice(&self.tag.to_be_bytes());
        out.extend_from_slice(&[0; 4]);
        out.extend_from_slice(&self.lun.to_be_bytes());
        let add_cdb = self
            .cdb
            .len()
            .saturating_sub(16)
            .next_multiple_of(4)
            .min(252);
        out.extend_from_slice(&[0, self.task_attribute.code(), 0, add_cdb as u8]);
        let cdb = &self.cdb[..self.cdb.len().min(16 + add_cdb)];
        out.extend_from_slice(cdb);
        out.resize(out.len() + (16 + add_cdb - cdb.len()), 0);
        self.data_out.encode(out);
        self.data_in.encode(out);
    }
}

/// Decodes the data buffer descriptor of one direction at `at`; returns it and where the next
/// one starts.
fn descriptor<'a>(
    b: &'a [u8],
    at: usize,
    format: DescriptorFormat,
    count: u8,
    tag: u64,
    direction: &'static str,
) -> Result<(DataBufferDescriptor<'a>, usize), IuError> {
    let iu = IuType::Cmd;
    let truncated = |needed| IuError::Truncated {
        iu,
        len: b.len(),
        needed,
    };
    let field = match direction {
        "DATA-OUT" => "DATA-OUT BUFFER DESCRIPTOR",
        _ => "DATA-IN BUFFER DESCRIPTOR",
    };
    match format {
        DescriptorFormat::None => Ok((DataBufferDescriptor::None, at)),
        DescriptorFormat::Direct => {
            let end = at + DESCRIPTOR_LEN;
            let d = b.get(at..end).ok_or(truncated(end))?;
            Ok((
                DataBufferDescriptor::Direct(MemoryDescriptor::decode(d)),
                end,
            ))
        }
        DescriptorFormat::Indirect => {
            let head_end = at + INDIRECT_HEAD;
            let head = b.get(at..head_end).ok_or(truncated(head_end))?;
            let table = MemoryDescriptor::decode(&head[..DESCRIPTOR_LEN]);
            let total_len = parsed(be_u32.parse(&head[DESCRIPTOR_LEN..]));
            let invalid = |reason| IuError::InvalidField {
                iu,
                tag,
                field,
                reason,
            };
            if table.len as usize % DESCRIPTOR_LEN != 0 {
                return Err(invalid("the table's length is not a multiple of 16"));
            }
            let in_iu = usize::from(count) * DESCRIPTOR_LEN;
            if in_iu > table.len as usize {
                return Err(invalid("more descriptors in the IU than in the table"));
            }
            if table.len == 0 {
                return Err(invalid("an empty descriptor table"));
            }
            let end = head_end + in_iu;
            let list = b.get(head_end..end).ok_or(truncated(end))?;
            let partial = Descriptors::new(list).expect("a multiple of 16");
            Ok((
                DataBufferDescriptor::Indirect {
                    table,
                    total_len,
                    partial,
                },
                end,
            ))
        }
        DescriptorFormat::Immediate => {
            let end = at + IMMEDIATE_LEN;
            let d = b.get(at..end).ok_or(truncated(end))?;
            let len = parsed(be_u32.parse(d));
            Ok((DataBufferDescriptor::Immediate { len }, end))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::iu::Iu;

    /// A WRITE(10) of one 512-byte block with its data in the IU, as Linux's ib_srp sends it
    /// (IMMEDIATE DATA OFFSET 68: the SRP_CMD, room for 16 bytes of additional CDB, the
    /// 4-byte immediate descriptor).
    #[test]
    fn immediate_data_lies_at_the_logins_offset() {
        let data: Vec<u8> = (0..512u32).map(|i| i as u8).collect();
        let cmd = SrpCmd {
            tag: 9,
            cdb: &[0x2a, 0, 0, 0, 0, 1, 0, 0, 1, 0],
            data_out: DataBufferDescriptor::Immediate { len: 512 },
            ..SrpCmd::default()
        };
        let mut b = Vec::new();
        cmd.encode_with_immediate(68, &data, &mut b);
        assert_eq!(b.len(), 68 + 512);
        assert_eq!(b[5] >> 4, 3, "DATA-OUT FORMAT: immediate");
        assert_eq!(&b[48..52], &512u32.to_be_bytes());
        let Ok(Iu::Cmd(c)) = Iu::decode(&b) else {
            panic!("an SRP_CMD")
        };
        assert_eq!(c.data_out, DataBufferDescriptor::Immediate { len: 512 });
        assert_eq!(c.immediate_data(&b, 68), Some(&data[..]));
        // Inside the descriptors, or running past the IU: none.
        assert_eq!(c.immediate_data(&b, 50), None);
        assert_eq!(c.immediate_data(&b[..300], 68), None);
        assert_eq!(c.immediate_data(&b, usize::MAX), None);
    }

    /// A READ(10) of 8 blocks at LBA 0x1234 into one region, byte by byte as an initiator
    /// builds it.
    #[test]
    fn a_direct_read_decodes_field_by_field() {
        let mut b = vec![0u8; 64];
        b[0] = 0x02;
        b[5] = 0x01; // data-in direct
        b[8..16].copy_from_slice(&0x1122_3344_5566_7788u64.to_be_bytes());
        b[20..28].copy_from_slice(&0x0001_0000_0000_0000u64.to_be_bytes());
        b[29] = 2; // ORDERED
        b[32..42].copy_from_slice(&[0x28, 0, 0, 0, 0x12, 0x34, 0, 0, 8, 0]);
        b[48..56].copy_from_slice(&0xdead_beef_0000u64.to_be_bytes());
        b[56..60].copy_from_slice(&0x99u32.to_be_bytes());
        b[60..64].copy_from_slice(&4096u32.to_be_bytes());
        let Ok(Iu::Cmd(c)) = Iu::decode(&b) else {
            panic!("an SRP_CMD");
        };
        assert_eq!(c.tag, 0x1122_3344_5566_7788);
        assert_eq!(c.lun, 0x0001_0000_0000_0000);
        assert_eq!(c.task_attribute, TaskAttribute::Ordered);
        assert_eq!(&c.cdb[..10], &[0x28, 0, 0, 0, 0x12, 0x34, 0, 0, 8, 0]);
        assert_eq!(c.cdb.len(), 16);
        assert_eq!(c.data_out, DataBufferDescriptor::None);
        assert_eq!(
            c.data_in,
            DataBufferDescriptor::Direct(MemoryDescriptor {
                va: 0xdead_beef_0000,
                key: 0x99,
                len: 4096
            })
        );
        let mut again = Vec::new();
        c.encode(&mut again);
        assert_eq!(again, b);
        assert_eq!(c.encoded_len(), 64);
    }

    /// A WRITE with 32 regions of 4 KiB in an indirect descriptor, all in the IU.
    #[test]
    fn an_indirect_write_with_32_regions() {
        let mut list = Vec::new();
        for i in 0..32u64 {
            MemoryDescriptor {
                va: 0x10_0000 + i * 0x2000,
                key: 7,
                len: 4096,
            }
            .encode(&mut list);
        }
        let c = SrpCmd {
            tag: 9,
            cdb: &[0x2a, 0, 0, 0, 0, 0, 0, 1, 0, 0],
            data_out: DataBufferDescriptor::Indirect {
                table: MemoryDescriptor {
                    va: 0x5000,
                    key: 7,
                    len: 32 * 16,
                },
                total_len: 128 * 1024,
                partial: Descriptors::new(&list).expect("32 descriptors"),
            },
            ..SrpCmd::default()
        };
        let mut b = Vec::new();
        c.encode(&mut b);
        assert_eq!(b.len(), 48 + 20 + 512);
        assert_eq!(b[5], 0x20);
        assert_eq!(b[6], 32);
        let d = SrpCmd::decode(&b).expect("valid");
        assert_eq!(d.data_out.expected_len(), 128 * 1024);
        assert!(d.data_out.is_complete());
        let DataBufferDescriptor::Indirect { partial, .. } = d.data_out else {
            panic!("indirect");
        };
        assert_eq!(partial.len(), 32);
        assert_eq!(partial.total_len(), 128 * 1024);
        assert_eq!(partial.get(31).map(|d| d.va), Some(0x10_0000 + 31 * 0x2000));
    }

    #[test]
    fn a_partial_table_is_marked_incomplete() {
        let mut list = Vec::new();
        MemoryDescriptor {
            va: 1,
            key: 2,
            len: 3,
        }
        .encode(&mut list);
        let c = SrpCmd {
            data_in: DataBufferDescriptor::Indirect {
                table: MemoryDescriptor {
                    va: 0x5000,
                    key: 7,
                    len: 4 * 16,
                },
                total_len: 12,
                partial: Descriptors::new(&list).expect("one"),
            },
            ..SrpCmd::default()
        };
        let mut b = Vec::new();
        c.encode(&mut b);
        let d = SrpCmd::decode(&b).expect("valid");
        assert!(!d.data_in.is_complete());
    }

    #[test]
    fn invalid_fields_name_the_field_and_keep_the_tag() {
        let c = SrpCmd {
            tag: 5,
            cdb: &[0; 16],
            ..SrpCmd::default()
        };
        let mut b = Vec::new();
        c.encode(&mut b);
        let mut bad = b.clone();
        bad[5] = 0x50; // reserved data-out format
        let e = SrpCmd::decode(&bad).expect_err("reserved");
        assert_eq!(e.tag(), Some((IuType::Cmd, 5)));
        assert!(e.to_string().contains("DATA-OUT BUFFER DESCRIPTOR FORMAT"));
        let mut bad = b.clone();
        bad[29] = 3;
        assert!(SrpCmd::decode(&bad)
            .expect_err("reserved attribute")
            .to_string()
            .contains("TASK ATTRIBUTE"));
        let mut bad = b.clone();
        bad[5] = 0x03; // immediate data-in
        assert!(SrpCmd::decode(&bad).is_err());
        // An additional CDB the IU does not hold.
        let mut bad = b.clone();
        bad[31] = 16;
        assert!(matches!(
            SrpCmd::decode(&bad),
            Err(IuError::Truncated { needed: 64, .. })
        ));
        // An indirect descriptor whose count exceeds its table.
        let mut bad = b;
        bad[5] = 0x20;
        bad[6] = 2;
        let mut head = Vec::new();
        MemoryDescriptor {
            va: 0,
            key: 0,
            len: 16,
        }
        .encode(&mut head);
        bad.extend_from_slice(&head);
        bad.extend_from_slice(&[0; 4 + 32]);
        assert!(SrpCmd::decode(&bad)
            .expect_err("count beyond table")
            .to_string()
            .contains("more descriptors"));
    }

    #[test]
    fn a_32_byte_cdb_goes_on_in_additional_cdb() {
        let cdb: Vec<u8> = (0..32).collect();
        let c = SrpCmd {
            cdb: &cdb,
            ..SrpCmd::default()
        };
        let mut b = Vec::new();
        c.encode(&mut b);
        assert_eq!(b.len(), 64);
        assert_eq!(b[31], 16);
        assert_eq!(SrpCmd::decode(&b).expect("valid").cdb, &cdb[..]);
    }
}
