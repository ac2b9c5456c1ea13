//! GET LBA STATUS (SBC-3 section 5.16): the provisioning status of the blocks from an LBA.

use crate::backend::Output;

/// GET LBA STATUS parameter data with one descriptor, truncated to `alloc` bytes: the state the
/// backend reported for the blocks from `lba`.
pub fn descriptor(lba: u64, output: Output, alloc: u32) -> Vec<u8> {
    let (mapped, blocks) = match output {
        Output::LbaStatus { mapped, blocks } => (mapped, blocks),
        Output::Done => (true, 1),
    };
    let mut d = Vec::with_capacity(24);
    d.extend_from_slice(&20u32.to_be_bytes());
    d.extend_from_slice(&[0; 4]);
    d.extend_from_slice(&lba.to_be_bytes());
    d.extend_from_slice(&u32::try_from(blocks).unwrap_or(u32::MAX).to_be_bytes());
    // PROVISIONING STATUS: 0 mapped, 1 deallocated.
    d.push(u8::from(!mapped));
    d.extend_from_slice(&[0; 3]);
    d.truncate(alloc as usize);
    d
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_descriptor() {
        let d = descriptor(
            8,
            Output::LbaStatus {
                mapped: false,
                blocks: 1 << 40,
            },
            64,
        );
        assert_eq!(d.len(), 24);
        assert_eq!(&d[..4], &[0, 0, 0, 20]);
        assert_eq!(&d[8..16], &8u64.to_be_bytes());
        assert_eq!(&d[16..20], &[0xff; 4]);
        assert_eq!(d[20], 1);
        assert_eq!(descriptor(0, Output::Done, 8).len(), 8);
    }
}
