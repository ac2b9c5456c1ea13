//! Memory descriptors (SRP-2 section 5.6): where an initiator's data buffer is, as RDMA sees it.
//! The target moves data with RDMA READ (data-out) and RDMA WRITE (data-in) to and from these
//! regions; it never registers them.

use nom::number::complete::{be_u32, be_u64};
use nom::Parser;

/// Bytes of one memory descriptor.
pub const DESCRIPTOR_LEN: usize = 16;

/// A memory descriptor: a region of the initiator's memory, its virtual address, the remote
/// key (R_Key) that grants access to it, and its length.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct MemoryDescriptor {
    /// VIRTUAL ADDRESS.
    pub va: u64,
    /// MEMORY HANDLE (the R_Key).
    pub key: u32,
    /// LENGTH in bytes.
    pub len: u32,
}

/// The region a descriptor names, as the verbs take it.
impl From<MemoryDescriptor> for rdma::verbs::RemoteRegion {
    fn from(d: MemoryDescriptor) -> Self {
        rdma::verbs::RemoteRegion {
            addr: d.va,
            rkey: d.key,
            len: d.len,
        }
    }
}

/// The descriptor naming a region (an initiator's, for its SRP_CMD).
impl From<rdma::verbs::RemoteRegion> for MemoryDescriptor {
    fn from(r: rdma::verbs::RemoteRegion) -> Self {
        MemoryDescriptor {
            va: r.addr,
            key: r.rkey,
            len: r.len,
        }
    }
}

impl MemoryDescriptor {
    /// Decodes 16 bytes (the caller checked the length).
    pub(crate) fn decode(b: &[u8]) -> MemoryDescriptor {
        let (va, key, len) = super::parsed((be_u64, be_u32, be_u32).parse(b));
        MemoryDescriptor { va, key, len }
    }

    /// Appends the 16 bytes.
    pub fn encode(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(&self.va.to_be_bytes());
        out.extend_from_slice(&self.key.to_be_bytes());
        out.extend_from_slice(&self.len.to_be_bytes());
    }
}

/// A DATA-OUT or DATA-IN BUFFER DESCRIPTOR FORMAT code (SRP-2 table 13).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum DescriptorFormat {
    /// No data buffer descriptor.
    #[default]
    None,
    /// A direct data buffer descriptor: one memory descriptor.
    Direct,
    /// An indirect data buffer descriptor: a table of memory descriptors.
    Indirect,
    /// Immediate data in the IU (SRP-2).
    Immediate,
}

impl DescriptorFormat {
    /// The format named by a 4-bit code, `None` for a reserved code.
    pub fn from_code(code: u8) -> Option<DescriptorFormat> {
        Some(match code {
            0 => DescriptorFormat::None,
            1 => DescriptorFormat::Direct,
            2 => DescriptorFormat::Indirect,
            3 => DescriptorFormat::Immediate,
            _ => return None,
        })
    }

    /// The 4-bit code.
    pub fn code(self) -> u8 {
        match self {
            DescriptorFormat::None => 0,
            DescriptorFormat::Direct => 1,
            DescriptorFormat::Indirect => 2,
            DescriptorFormat::Immediate => 3,
        }
    }
}

/// Memory descriptors laid out back to back, borrowed from an IU (or from a descriptor table
/// fetched by RDMA READ): iterating decodes them, nothing is copied.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Descriptors<'a>(&'a [u8]);

impl<'a> Descriptors<'a> {
    /// The descriptors in `b`, whose length must be a multiple of 16 (else `None`).
    pub fn new(b: &'a [u8]) -> Option<Descriptors<'a>> {
        (b.len() % DESCRIPTOR_LEN == 0).then_some(Descriptors(b))
    }

    /// How many there are.
    pub fn len(&self) -> usize {
        self.0.len() / DESCRIPTOR_LEN
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// The bytes they occupy.
    pub fn as_bytes(&self) -> &'a [u8] {
        self.0
    }

    /// The descriptor at `i`.
    pub fn get(&self, i: usize) -> Option<MemoryDescriptor> {
        let at = i.checked_mul(DESCRIPTOR_LEN)?;
        let b = self.0.get(at..at + DESCRIPTOR_LEN)?;
        Some(MemoryDescriptor::decode(b))
    }

    /// Each descriptor in order.
    pub fn iter(&self) -> impl ExactSizeIterator<Item = MemoryDescriptor> + 'a {
        self.0
            .chunks_exact(DESCRIPTOR_LEN)
            .map(MemoryDescriptor::decode)
    }

    /// The sum of their lengths (as u64: 255 descriptors of 4 GiB each do not fit a u32).
    pub fn total_len(&self) -> u64 {
        self.iter().map(|d| u64::from(d.len)).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_descriptor_is_va_key_len_big_endian() {
        let d = MemoryDescriptor {
            va: 0x0102_0304_0506_0708,
            key: 0x0a0b_0c0d,
            len: 0x1000,
        };
        let mut b = Vec::new();
        d.encode(&mut b);
        assert_eq!(
            b,
            [1, 2, 3, 4, 5, 6, 7, 8, 0x0a, 0x0b, 0x0c, 0x0d, 0, 0, 0x10, 0]
        );
        let list = Descriptors::new(&b).expect("16 bytes");
        assert_eq!(list.len(), 1);
        assert_eq!(list.get(0), Some(d));
        assert_eq!(list.get(1), None);
        assert_eq!(list.total_len(), 0x1000);
        assert!(Descriptors::new(&b[..15]).is_none());
    }
}
