//! Identify data (NVMe Base Specification 2.0, Identify command): the controller data
//! structure (CNS 01h), the namespace data structure (CNS 00h), the active namespace ID list
//! (CNS 02h) and the namespace identification descriptor list (CNS 03h), each 4096 bytes,
//! built from what a controller and a namespace are.

/// The length of every Identify data structure.
pub const IDENTIFY_LEN: usize = 4096;

/// CNS: which data structure Identify returns.
pub mod cns {
    /// Identify Namespace data structure for the NSID.
    pub const NAMESPACE: u8 = 0x00;
    /// Identify Controller data structure.
    pub const CONTROLLER: u8 = 0x01;
    /// Active Namespace ID list.
    pub const ACTIVE_NAMESPACES: u8 = 0x02;
    /// Namespace Identification Descriptor list.
    pub const NAMESPACE_DESCRIPTORS: u8 = 0x03;
    /// I/O Command Set specific Identify Controller data structure.
    pub const IO_COMMAND_SET_CONTROLLER: u8 = 0x06;
}

/// What Identify Controller says of a controller.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ControllerIdentity {
    /// SN: the subsystem's serial number (20 characters).
    pub serial: String,
    /// MN: the model (40 characters).
    pub model: String,
    /// FR: the firmware revision (8 characters).
    pub firmware: String,
    /// CNTLID.
    pub cntlid: u16,
    /// VER: the version the controller complies with (major << 16 | minor << 8).
    pub version: u32,
    /// CNTRLTYPE: 1 an I/O controller, 2 a discovery controller.
    pub controller_type: u8,
    /// MDTS: the largest transfer, as a power of two of 4 KiB pages (0: no limit).
    pub mdts: u8,
    /// Several ports and controllers, ANA reporting: a subsystem a host reaches by several
    /// paths.
    pub multipath: bool,
    /// NN: the largest namespace ID.
    pub namespaces: u32,
    /// MAXCMD: commands outstanding per I/O queue.
    pub max_commands: u16,
    /// AERL: Asynchronous Event Requests outstanding, 0's based.
    pub aerl: u8,
    /// ELPE: Error Information log entries, 0's based.
    pub elpe: u8,
    /// KAS: keep alive granularity, in 100 ms units (0: no keep alive).
    pub kas: u16,
    /// VWC present: a volatile write cache (Flush matters).
    pub volatile_write_cache: bool,
    /// ONCS: the optional NVM commands supported (Compare, Dataset Management, Write
    /// Zeroes, reservations, Verify, ...).
    pub oncs: u16,
    /// FUSES: Compare and Write.
    pub compare_and_write: bool,
    /// ACWU: the atomic compare-and-write unit, in logical blocks, 0's based.
    pub acwu: u16,
    /// OAES: the asynchronous events the controller sends (namespace attribute notices,
    /// ANA change notices).
    pub oaes: u32,
    /// ANA: ANATT (transition time, seconds), ANACAP, ANAGRPMAX and NANAGRPID; zero when
    /// the controller reports no ANA.
    pub anatt: u8,
    /// ANACAP.
    pub anacap: u8,
    /// ANAGRPMAX.
    pub anagrpmax: u32,
    /// NANAGRPID.
    pub nanagrpid: u32,
    /// SUBNQN.
    pub subnqn: String,
    /// IOCCSZ: the I/O queue command capsule size, in 16-byte units (the SQE and the
    /// in-capsule data).
    pub ioccsz: u32,
    /// IORCSZ: the I/O queue response capsule size, in 16-byte units.
    pub iorcsz: u32,
    /// MSDBD: SGL data block descriptors per command.
    pub msdbd: u8,
}

/// ONCS bit: Compare.
pub const ONCS_COMPARE: u16 = 1 << 0;
/// ONCS bit: Write Uncorrectable.
pub const ONCS_WRITE_UNCORRECTABLE: u16 = 1 << 1;
/// ONCS bit: Dataset Management.
pub const ONCS_DATASET_MANAGEMENT: u16 = 1 << 2;
/// ONCS bit: Write Zeroes.
pub const ONCS_WRITE_ZEROES: u16 = 1 << 3;
/// ONCS bit: the Save field of Set Features and the Select field of Get Features.
pub const ONCS_SAVE_SELECT: u16 = 1 << 4;
/// ONCS bit: reservations.
pub const ONCS_RESERVATIONS: u16 = 1 << 5;
/// ONCS bit: Verify.
pub const ONCS_VERIFY: u16 = 1 << 7;

/// OAES bit: Namespace Attribute Notices.
pub const OAES_NAMESPACE_ATTRIBUTE: u32 = 1 << 8;
/// OAES bit: Asymmetric Namespace Access Change Notices.
pub const OAES_ANA_CHANGE: u32 = 1 << 11;

/// Writes `text` as an ASCII field of `len` bytes at `at`, space padded, non-printable
/// characters as spaces.
fn ascii(b: &mut [u8], at: usize, len: usize, text: &str) {
    let field = &mut b[at..at + len];
    field.fill(b' ');
    for (o, c) in field.iter_mut().zip(text.bytes()) {
        *o = if (0x20..0x7f).contains(&c) { c } else { b' ' };
    }
}

fn put16(b: &mut [u8], at: usize, v: u16) {
    b[at..at + 2].copy_from_slice(&v.to_le_bytes());
}

fn put32(b: &mut [u8], at: usize, v: u32) {
    b[at..at + 4].copy_from_slice(&v.to_le_bytes());
}

fn put64(b: &mut [u8], at: usize, v: u64) {
    b[at..at + 8].copy_from_slice(&v.to_le_bytes());
}

/// The Identify Controller data structure.
pub fn controller(c: &ControllerIdentity) -> Box<[u8; IDENTIFY_LEN]> {
    let mut b = Box::new([0u8; IDENTIFY_LEN]);
    ascii(&mut b[..], 4, 20, &c.serial);
    ascii(&mut b[..], 24, 40, &c.model);
    ascii(&mut b[..], 64, 8, &c.firmware);
    // RAB: 2^6 commands per arbitration burst, as Linux's target says.
    b[72] = 6;
    // CMIC: several ports (bit 0), several controllers (bit 1), ANA reporting (bit 3).
    b[76] = if c.multipath { 0x0b } else { 0x02 };
    b[77] = c.mdts;
    put16(&mut b[..], 78, c.cntlid);
    put32(&mut b[..], 80, c.version);
    put32(&mut b[..], 92, c.oaes);
    // CTRATT: 128-bit host identifiers (Connect's HOSTID is 16 bytes).
    put32(&mut b[..], 96, 1);
    b[111] = c.controller_type;
    // ACL: four Aborts outstanding, 0's based.
    b[258] = 3;
    b[259] = c.aerl;
    // FRMW: one firmware slot, read only.
    b[260] = 0x03;
    // LPA: SMART per namespace, Commands Supported and Effects, extended data for Get Log
    // Page.
    b[261] = 0x07;
    b[262] = c.elpe;
    // WCTEMP and CCTEMP (kelvin), as a drive reports them: 343 K and 373 K.
    put16(&mut b[..], 266, 343);
    put16(&mut b[..], 268, 373);
    put16(&mut b[..], 320, c.kas);
    b[342] = c.anatt;
    b[343] = c.anacap;
    put32(&mut b[..], 344, c.anagrpmax);
    put32(&mut b[..], 348, c.nanagrpid);
    // SQES and CQES: 64-byte SQEs, 16-byte CQEs (required and maximum).
    b[512] = 0x66;
    b[513] = 0x44;
    put16(&mut b[..], 514, c.max_commands);
    put32(&mut b[..], 516, c.namespaces);
    put16(&mut b[..], 520, c.oncs);
    put16(&mut b[..], 522, u16::from(c.compare_and_write));
    // VWC: present when there is one; bits 2:1 = 11b: Flush with NSID FFFFFFFFh is
    // supported.
    b[525] = if c.volatile_write_cache { 0x07 } else { 0x06 };
    put16(&mut b[..], 532, c.acwu);
    // SGLS: SGLs supported (bit 0), keyed data blocks (bit 2), offsets (bit 20) and the
    // transport data block descriptor of fabrics.
    put32(&mut b[..], 536, 1 | 1 << 2 | 1 << 20);
    // MNAN: as many namespaces as NN (Linux refuses a controller with ANA reporting whose
    // MNAN is 0 or above NN).
    put32(&mut b[..], 540, c.namespaces);
    let n = c.subnqn.len().min(255);
    b[768..768 + n].copy_from_slice(&c.subnqn.as_bytes()[..n]);
    put32(&mut b[..], 1792, c.ioccsz);
    put32(&mut b[..], 1796, c.iorcsz);
    b[1803] = c.msdbd;
    // PSD0: one power state of 25 W, as fabrics targets report.
    put16(&mut b[..], 2048, 2500);
    b
}

/// What Identify Namespace says of a namespace.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NamespaceIdentity {
    /// NSZE (and NCAP): the size in logical blocks.
    pub blocks: u64,
    /// NUSE: blocks allocated (thin provisioning), at most NSZE.
    pub used: u64,
    /// The logical block size, a power of two from 512.
    pub block_size: u32,
    /// NSFEAT bit 0: thin provisioning (NCAP may exceed what is allocated); deallocated
    /// blocks read as zeros (DLFEAT).
    pub thin: bool,
    /// NMIC: shared by several controllers (multipath).
    pub shared: bool,
    /// RESCAP: the reservation types supported (0: none).
    pub rescap: u8,
    /// ANAGRPID: the namespace's ANA group (0: none reported).
    pub anagrpid: u32,
    /// NSATTR bit 0: write protected.
    pub write_protected: bool,
    /// NGUID.
    pub nguid: [u8; 16],
    /// NACWU: the atomic compare-and-write unit, in blocks, 0's based.
    pub nacwu: u16,
}

/// RESCAP: every reservation type, and Ignore Existing Key; persist through power loss.
pub const RESCAP_ALL: u8 = 0xff;
/// RESCAP bit 0: persist through power loss.
pub const RESCAP_PTPL: u8 = 0x01;

/// The Identify Namespace data structure.
pub fn namespace(n: &NamespaceIdentity) -> Box<[u8; IDENTIFY_LEN]> {
    let mut b = Box::new([0u8; IDENTIFY_LEN]);
    put64(&mut b[..], 0, n.blocks);
    put64(&mut b[..], 8, n.blocks);
    put64(&mut b[..], 16, n.used.min(n.blocks));
    // NSFEAT: thin provisioning (bit 0), NAWUN/NACWU fields used (bit 1), NUSE reported
    // (DAE, bit 2); OPTPERF fields (bit 4) for NPWG/NOWS.
    b[24] = u8::from(n.thin) | 1 << 1 | 1 << 4;
    // NLBAF 0 (one format), FLBAS 0.
    b[30] = u8::from(n.shared);
    b[31] = n.rescap;
    // DLFEAT: deallocated blocks read as zeros (001b), Write Zeroes can deallocate (bit 3).
    b[33] = if n.thin { 0x09 } else { 0 };
    put16(&mut b[..], 38, n.nacwu);
    // NPWG and NOWS: the preferred write granularity, one block of 4 KiB or the block.
    let per_4k = (4096 / n.block_size.max(512)).max(1) as u16;
    put16(&mut b[..], 64, per_4k - 1);
    put16(&mut b[..], 72, per_4k - 1);
    put32(&mut b[..], 92, n.anagrpid);
    b[99] = u8::from(n.write_protected);
    b[104..120].copy_from_slice(&n.nguid);
    // LBAF0: no metadata, LBADS = log2 of the block size, best relative performance.
    b[130] = n.block_size.max(512).trailing_zeros() as u8;
    b
}

/// The Active Namespace ID list: the active namespace IDs above `after`, ascending, at most
/// 1024 of them.
pub fn active_namespaces(
    nsids: impl IntoIterator<Item = u32>,
    after: u32,
) -> Box<[u8; IDENTIFY_LEN]> {
    let mut b = Box::new([0u8; IDENTIFY_LEN]);
    let mut ids: Vec<u32> = nsids
        .into_iter()
        .filter(|&n| n > after && n != u32::MAX)
        .collect();
    ids.sort_unstable();
    ids.dedup();
    for (i, id) in ids.into_iter().take(IDENTIFY_LEN / 4).enumerate() {
        put32(&mut b[..], 4 * i, id);
    }
    b
}

/// The Namespace Identification Descriptor list: the NGUID, the UUID and the command set
/// (NVM).
pub fn namespace_descriptors(nguid: &[u8; 16], uuid: &[u8; 16]) -> Box<[u8; IDENTIFY_LEN]> {
    let mut b = Box::new([0u8; IDENTIFY_LEN]);
    let mut at = 0;
    for (nidt, nid) in [(0x02u8, &nguid[..]), (0x03, &uuid[..]), (0x04, &[0u8][..])] {
        b[at] = nidt;
        b[at + 1] = nid.len() as u8;
        b[at + 4..at + 4 + nid.len()].copy_from_slice(nid);
        at += 4 + nid.len();
    }
    b
}

#[cfg(test)]
mod tests {
    use super::*;

    fn identity() -> ControllerIdentity {
        ControllerIdentity {
            serial: "0123456789abcdef".into(),
            model: "targetd".into(),
            firmware: "0.1.0".into(),
            cntlid: 7,
            version: 0x0001_0400,
            controller_type: 1,
            mdts: 5,
            multipath: true,
            namespaces: 1024,
            max_commands: 128,
            aerl: 3,
            elpe: 63,
            kas: 1,
            volatile_write_cache: true,
            oncs: ONCS_COMPARE | ONCS_DATASET_MANAGEMENT | ONCS_WRITE_ZEROES | ONCS_RESERVATIONS,
            compare_and_write: true,
            acwu: 0,
            oaes: OAES_NAMESPACE_ATTRIBUTE | OAES_ANA_CHANGE,
            anatt: 10,
            anacap: 0x47,
            anagrpmax: 128,
            nanagrpid: 128,
            subnqn: "nqn.2026-11.io.example:subsystem".into(),
            ioccsz: (64 + 8192) / 16,
            iorcsz: 1,
            msdbd: 1,
        }
    }

    /// The fields Linux's host reads, where it reads them.
    #[test]
    fn controller_fields_sit_where_hosts_read_them() {
        let b = controller(&identity());
        assert_eq!(&b[4..24], b"0123456789abcdef    ");
        assert_eq!(&b[24..31], b"targetd");
        assert_eq!(b[76], 0x0b);
        assert_eq!(b[77], 5);
        assert_eq!(u16::from_le_bytes([b[78], b[79]]), 7);
        assert_eq!(
            u32::from_le_bytes(b[80..84].try_into().unwrap()),
            0x0001_0400
        );
        assert_eq!(b[111], 1);
        assert_eq!(u16::from_le_bytes([b[320], b[321]]), 1);
        assert_eq!((b[342], b[343]), (10, 0x47));
        assert_eq!((b[512], b[513]), (0x66, 0x44));
        assert_eq!(u32::from_le_bytes(b[516..520].try_into().unwrap()), 1024);
        assert_eq!(u16::from_le_bytes([b[520], b[521]]), 0x2d);
        assert_eq!(b[522], 1);
        assert_eq!(&b[768..800], b"nqn.2026-11.io.example:subsystem");
        assert_eq!(b[800], 0);
        assert_eq!(u32::from_le_bytes(b[1792..1796].try_into().unwrap()), 516);
    }

    #[test]
    fn namespace_fields() {
        let n = NamespaceIdentity {
            blocks: 1 << 21,
            used: 1 << 20,
            block_size: 4096,
            thin: true,
            shared: true,
            rescap: RESCAP_ALL,
            anagrpid: 2,
            write_protected: false,
            nguid: [0xab; 16],
            nacwu: 0,
        };
        let b = namespace(&n);
        assert_eq!(u64::from_le_bytes(b[0..8].try_into().unwrap()), 1 << 21);
        assert_eq!(u64::from_le_bytes(b[16..24].try_into().unwrap()), 1 << 20);
        assert_eq!(b[24] & 1, 1);
        assert_eq!((b[30], b[31], b[33]), (1, 0xff, 0x09));
        assert_eq!(u32::from_le_bytes(b[92..96].try_into().unwrap()), 2);
        assert_eq!(&b[104..120], &[0xab; 16]);
        assert_eq!(b[130], 12, "LBADS: 4096 bytes");
    }

    #[test]
    fn namespace_lists() {
        let b = active_namespaces([3, 1, 2, 2, u32::MAX], 1);
        assert_eq!(&b[..12], &[2, 0, 0, 0, 3, 0, 0, 0, 0, 0, 0, 0]);
        let d = namespace_descriptors(&[1; 16], &[2; 16]);
        assert_eq!(&d[..4], &[0x02, 16, 0, 0]);
        assert_eq!(&d[20..24], &[0x03, 16, 0, 0]);
        assert_eq!(&d[40..45], &[0x04, 1, 0, 0, 0]);
        assert_eq!(d[45], 0, "the list ends");
    }
}
