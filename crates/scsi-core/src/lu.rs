//! A logical unit's description: identity (stable across restarts), geometry and the limits it
//! reports in its VPD pages.

/// Who a logical unit says it is. The serial number and the NAA designator derive from a stable
/// key (say the target name, the LUN and the backing path), so they survive restarts and differ
/// between logical units.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Identity {
    /// T10 VENDOR IDENTIFICATION, 8 ASCII bytes, space padded.
    pub vendor: [u8; 8],
    /// PRODUCT IDENTIFICATION, 16 ASCII bytes.
    pub product: [u8; 16],
    /// PRODUCT REVISION LEVEL, 4 ASCII bytes.
    pub revision: [u8; 4],
    /// UNIT SERIAL NUMBER (VPD 80h): 16 hex digits.
    pub serial: String,
    /// NAA designator (VPD 83h), locally assigned (NAA 3): 8 bytes.
    pub naa: [u8; 8],
}

/// ASCII, space padded or truncated to `N` bytes; non-printable characters become spaces.
fn ascii<const N: usize>(s: &str) -> [u8; N] {
    let mut out = [b' '; N];
    for (o, c) in out.iter_mut().zip(s.bytes()) {
        *o = if (0x20..0x7f).contains(&c) { c } else { b' ' };
    }
    out
}

/// 64-bit FNV-1a: stable across runs and platforms, unlike std's hasher.
fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    })
}

impl Identity {
    /// An identity for the logical unit named by `stable_key`.
    pub fn new(vendor: &str, product: &str, revision: &str, stable_key: &[u8]) -> Identity {
        let h = fnv1a(stable_key);
        // NAA 3 (locally assigned): the top four bits, then 60 bits of the key's hash.
        let naa = ((3u64 << 60) | (h & 0x0fff_ffff_ffff_ffff)).to_be_bytes();
        Identity {
            vendor: ascii(vendor),
            product: ascii(product),
            revision: ascii(revision),
            serial: format!("{h:016x}"),
            naa,
        }
    }
}

/// Size, provisioning and caching of a logical unit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Geometry {
    /// Logical block length in bytes (512 or 4096).
    pub block_size: u32,
    /// Number of logical blocks.
    pub blocks: u64,
    /// Thin provisioned: UNMAP, WRITE SAME with UNMAP, GET LBA STATUS; unmapped blocks read as
    /// zeros (LBPRZ).
    pub thin: bool,
    /// A volatile write cache is enabled (WCE).
    pub write_cache: bool,
    /// Writes are refused with DATA PROTECT.
    pub read_only: bool,
}

/// What the logical unit advertises in the Block Limits VPD page, in blocks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// MAXIMUM TRANSFER LENGTH.
    pub max_transfer: u32,
    /// OPTIMAL TRANSFER LENGTH.
    pub optimal_transfer: u32,
    /// OPTIMAL TRANSFER LENGTH GRANULARITY: transfers in multiples of this many blocks, from
    /// a multiple of it, suit the storage best (an RBD image's object size).
    pub optimal_granularity: u16,
    /// MAXIMUM COMPARE AND WRITE LENGTH (at most 255).
    pub max_compare_and_write: u8,
    /// MAXIMUM UNMAP LBA COUNT.
    pub max_unmap_blocks: u32,
    /// MAXIMUM UNMAP BLOCK DESCRIPTOR COUNT.
    pub max_unmap_descriptors: u32,
    /// OPTIMAL UNMAP GRANULARITY.
    pub unmap_granularity: u32,
    /// MAXIMUM WRITE SAME LENGTH. 65535 blocks by default, as Linux's target (LIO) reports:
    /// a WRITE SAME longer than that is refused with INVALID FIELD IN CDB, so a client that
    /// checks this limit before sizing a WRITE SAME and a WRITE alike (libiscsi's suite
    /// writes 65536 blocks with one WRITE(16) when this allows 65536) stays within the
    /// MAXIMUM TRANSFER LENGTH at every block size.
    pub max_write_same: u64,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_transfer: 8192,
            optimal_transfer: 256,
            optimal_granularity: 1,
            max_compare_and_write: 255,
            max_unmap_blocks: 1 << 20,
            max_unmap_descriptors: 256,
            unmap_granularity: 8,
            max_write_same: 65535,
        }
    }
}

/// A logical unit as the command handlers see it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LogicalUnit {
    /// Identity.
    pub identity: Identity,
    /// Geometry.
    pub geometry: Geometry,
    /// Limits.
    pub limits: Limits,
}

/// The target port a command arrived through, for the port designators of VPD 83h.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TargetPort {
    /// RELATIVE TARGET PORT IDENTIFIER (not 0).
    pub relative_port: u16,
    /// TARGET PORT GROUP.
    pub port_group: u16,
    /// The target port's SCSI name string, e.g. `iqn.2026-11.io.example:disk1,t,0x1`.
    pub name: String,
    /// The target device's SCSI name string (the target name).
    pub target_name: String,
}

impl TargetPort {
    /// An iSCSI target port: target `target` through portal group `portal_group`, named as
    /// RFC 7143 section 4.2.7.1 and SPC-4's SCSI name string designator say
    /// (`<target>,t,0x<tpgt>`), its relative port identifier the group's tag.
    pub fn iscsi(target: &str, portal_group: u16) -> TargetPort {
        TargetPort {
            relative_port: portal_group.max(1),
            port_group: portal_group,
            name: format!("{target},t,0x{portal_group:04x}"),
            target_name: target.to_string(),
        }
    }

    /// An SRP target port of target `target`: the port's 16-byte identifier (in hex) names
    /// it, and `relative_port` tells it from the target's other ports.
    pub fn srp(target: &str, port_id: [u8; 16], relative_port: u16) -> TargetPort {
        let id: String = port_id.iter().map(|b| format!("{b:02x}")).collect();
        TargetPort {
            relative_port: relative_port.max(1),
            port_group: relative_port.max(1),
            name: format!("{target},srp,0x{id}"),
            target_name: target.to_string(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn identity_is_stable_unique_and_well_formed() {
        let a = Identity::new(
            "STGT",
            "targetd disk",
            "0001",
            b"iqn.2026-11.io.example:d1/0/data/disk1.img",
        );
        let again = Identity::new(
            "STGT",
            "targetd disk",
            "0001",
            b"iqn.2026-11.io.example:d1/0/data/disk1.img",
        );
        let b = Identity::new(
            "STGT",
            "targetd disk",
            "0001",
            b"iqn.2026-11.io.example:d1/1/data/disk2.img",
        );
        assert_eq!(a, again);
        assert_ne!(a.serial, b.serial);
        assert_ne!(a.naa, b.naa);
        assert_eq!(a.naa[0] >> 4, 3);
        assert_eq!(a.serial.len(), 16);
        assert_eq!(&a.vendor, b"STGT    ");
        assert_eq!(&a.product, b"targetd disk    ");
        assert_eq!(&Identity::new("a\nb", "", "", b"").vendor, b"a b     ");
        // The hash is fixed: identities must not change between releases.
        assert_eq!(fnv1a(b""), 0xcbf2_9ce4_8422_2325);
        assert_eq!(fnv1a(b"a"), 0xaf63_dc4c_8601_ec8c);
    }
}
