//! Log pages (Get Log Page): what a controller reports of itself, each built whole and then
//! cut to the offset and length asked.

/// Log page identifiers.
pub mod lid {
    /// Error Information.
    pub const ERROR: u8 = 0x01;
    /// SMART / Health Information.
    pub const SMART: u8 = 0x02;
    /// Firmware Slot Information.
    pub const FIRMWARE_SLOT: u8 = 0x03;
    /// Changed Namespace List.
    pub const CHANGED_NAMESPACES: u8 = 0x04;
    /// Commands Supported and Effects.
    pub const COMMANDS_EFFECTS: u8 = 0x05;
    /// Asymmetric Namespace Access.
    pub const ANA: u8 = 0x0c;
    /// Reservation Notification.
    pub const RESERVATION_NOTIFICATION: u8 = 0x80;
    /// Discovery (discovery controllers).
    pub const DISCOVERY: u8 = 0x70;
}

/// What Get Log Page asks: the page, where in it, how much.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LogRequest {
    /// LID.
    pub lid: u8,
    /// LSP: log specific field (the ANA page's RGO bit).
    pub lsp: u8,
    /// RAE: retain the asynchronous event (do not clear it).
    pub retain: bool,
    /// Bytes asked (NUMD + 1 dwords).
    pub len: u32,
    /// Byte offset (LPO).
    pub offset: u64,
}

impl LogRequest {
    /// From a Get Log Page SQE.
    pub fn from_sqe(sqe: &crate::sqe::Sqe) -> LogRequest {
        let c10 = sqe.cdw(10);
        let numd = (c10 >> 16) | (sqe.cdw(11) & 0xffff) << 16;
        LogRequest {
            lid: c10 as u8,
            lsp: ((c10 >> 8) & 0x7f) as u8,
            retain: c10 & 1 << 15 != 0,
            len: numd.saturating_add(1).saturating_mul(4),
            offset: sqe.qword(12),
        }
    }

    /// `page` cut to this request: from the offset, `len` bytes, zeros past the page's end
    /// (the log page's own length is the host's to know; hosts read a page in pieces of a
    /// size of their own, Linux's libnvme 4 KiB at a time, and may ask past its end). `None`
    /// when the offset is not a whole number of dwords, or more than `max` bytes are asked:
    /// nothing is allocated for a length the host chose before it is checked.
    pub fn cut(&self, page: &[u8], max: u32) -> Option<Vec<u8>> {
        if self.offset % 4 != 0 || self.len > max {
            return None;
        }
        let mut out = vec![0u8; self.len as usize];
        let start = usize::try_from(self.offset)
            .unwrap_or(usize::MAX)
            .min(page.len());
        let n = (page.len() - start).min(out.len());
        out[..n].copy_from_slice(&page[start..start + n]);
        Some(out)
    }
}

/// The SMART / Health Information page (512 bytes) of a controller in good health: a
/// temperature, all spare available, nothing used up, `data_units_read` and
/// `data_units_written` (in thousands of 512-byte units), the commands it completed.
pub fn smart(
    data_units_read: u128,
    data_units_written: u128,
    reads: u128,
    writes: u128,
) -> [u8; 512] {
    let mut b = [0u8; 512];
    // Composite temperature 310 K.
    b[1..3].copy_from_slice(&310u16.to_le_bytes());
    // Available spare 100 %, threshold 10 %.
    b[3] = 100;
    b[4] = 10;
    b[32..48].copy_from_slice(&data_units_read.to_le_bytes());
    b[48..64].copy_from_slice(&data_units_written.to_le_bytes());
    b[64..80].copy_from_slice(&reads.to_le_bytes());
    b[80..96].copy_from_slice(&writes.to_le_bytes());
    b
}

/// The Firmware Slot Information page: slot 1 active, holding `firmware`.
pub fn firmware_slot(firmware: &str) -> [u8; 512] {
    let mut b = [0u8; 512];
    b[0] = 1;
    let f = &mut b[8..16];
    f.fill(b' ');
    for (o, c) in f.iter_mut().zip(firmware.bytes()) {
        *o = c;
    }
    b
}

/// The Changed Namespace List: the namespaces whose attributes changed since the host last
/// read it (at most 1024; more sets the first entry to FFFFFFFFh).
pub fn changed_namespaces(nsids: &[u32]) -> Box<[u8; 4096]> {
    let mut b = Box::new([0u8; 4096]);
    if nsids.len() > 1024 {
        b[..4].copy_from_slice(&u32::MAX.to_le_bytes());
        return b;
    }
    for (i, n) in nsids.iter().enumerate() {
        b[4 * i..4 * i + 4].copy_from_slice(&n.to_le_bytes());
    }
    b
}

/// The Commands Supported and Effects page: each admin and I/O opcode supported (CSUPP),
/// those that change the logical blocks' content (LBCC), and those that change the
/// namespace inventory or capabilities (NCC, NIC).
pub fn commands_effects(admin: &[u8], io: &[(u8, bool)]) -> Box<[u8; 4096]> {
    let mut b = Box::new([0u8; 4096]);
    for &op in admin {
        let at = 4 * usize::from(op);
        b[at..at + 4].copy_from_slice(&1u32.to_le_bytes());
    }
    for &(op, changes_content) in io {
        let at = 1024 + 4 * usize::from(op);
        let e = 1u32 | u32::from(changes_content) << 1;
        b[at..at + 4].copy_from_slice(&e.to_le_bytes());
    }
    b
}

/// An ANA group as the ANA log page describes it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AnaGroup {
    /// ANAGRPID.
    pub id: u32,
    /// ANAS: 01h optimized, 02h non-optimized, 03h inaccessible, 04h persistent loss, 0Fh
    /// change.
    pub state: u8,
    /// Its change count.
    pub change_count: u64,
    /// The active namespaces in it (left out when the host asks for groups only).
    pub nsids: Vec<u32>,
}

/// The Asymmetric Namespace Access page: a header with the change count and the number of
/// groups, then each group; with `groups_only` (LSP's RGO) no namespace lists.
pub fn ana(change_count: u64, groups: &[AnaGroup], groups_only: bool) -> Vec<u8> {
    let mut b = Vec::with_capacity(16 + groups.len() * 32);
    b.extend_from_slice(&change_count.to_le_bytes());
    b.extend_from_slice(&(groups.len() as u16).to_le_bytes());
    b.extend_from_slice(&[0; 6]);
    for g in groups {
        let nsids: &[u32] = if groups_only { &[] } else { &g.nsids };
        b.extend_from_slice(&g.id.to_le_bytes());
        b.extend_from_slice(&(nsids.len() as u32).to_le_bytes());
        b.extend_from_slice(&g.change_count.to_le_bytes());
        b.push(g.state);
        b.extend_from_slice(&[0; 15]);
        for n in nsids {
            b.extend_from_slice(&n.to_le_bytes());
        }
    }
    b
}

/// TRTYPE: RDMA.
pub const TRTYPE_RDMA: u8 = 1;
/// TRTYPE: TCP.
pub const TRTYPE_TCP: u8 = 3;
/// ADRFAM: IPv4.
pub const ADRFAM_IPV4: u8 = 1;
/// ADRFAM: IPv6.
pub const ADRFAM_IPV6: u8 = 2;
/// SUBTYPE: a referral to another discovery service.
pub const SUBTYPE_REFERRAL: u8 = 1;
/// SUBTYPE: an NVM subsystem.
pub const SUBTYPE_NVM: u8 = 2;
/// SUBTYPE: this discovery subsystem (reachable at the entry's address).
pub const SUBTYPE_CURRENT_DISCOVERY: u8 = 3;
/// Bytes of the discovery log page's header, and of each entry.
pub const DISCOVERY_RECORD_LEN: usize = 1024;

/// One entry of the discovery log page: where a subsystem (or a discovery service) is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DiscoveryEntry {
    /// TRTYPE.
    pub trtype: u8,
    /// ADRFAM.
    pub adrfam: u8,
    /// SUBTYPE.
    pub subtype: u8,
    /// PORTID: the port (each listening address its own).
    pub portid: u16,
    /// TRSVCID: the port number, as text.
    pub trsvcid: String,
    /// SUBNQN.
    pub subnqn: String,
    /// TRADDR: the address, as text.
    pub traddr: String,
}

/// The discovery log page (LID 70h): GENCTR, the number of records, and each entry; CNTLID
/// FFFFh (dynamic controllers), an admin queue of 32 entries, no secure channel required.
/// An RDMA entry's transport specific address subtype says how to reach it: a reliable
/// connected queue pair (RDMA_QPTYPE 1), any RDMA provider (RDMA_PRTYPE 1), set up through
/// the RDMA connection manager (RDMA_CMS 1), as Linux's host and target both expect.
pub fn discovery(genctr: u64, entries: &[&DiscoveryEntry]) -> Vec<u8> {
    let mut b = vec![0u8; DISCOVERY_RECORD_LEN * (1 + entries.len())];
    b[0..8].copy_from_slice(&genctr.to_le_bytes());
    b[8..16].copy_from_slice(&(entries.len() as u64).to_le_bytes());
    for (i, e) in entries.iter().enumerate() {
        let r = &mut b[DISCOVERY_RECORD_LEN * (i + 1)..DISCOVERY_RECORD_LEN * (i + 2)];
        r[0] = e.trtype;
        r[1] = e.adrfam;
        r[2] = e.subtype;
        r[4..6].copy_from_slice(&e.portid.to_le_bytes());
        r[6..8].copy_from_slice(&0xffffu16.to_le_bytes());
        r[8..10].copy_from_slice(&32u16.to_le_bytes());
        let text = |r: &mut [u8], at: usize, len: usize, t: &str| {
            let n = t.len().min(len);
            r[at..at + n].copy_from_slice(&t.as_bytes()[..n]);
            // TRSVCID and TRADDR are space padded; SUBNQN is NUL terminated.
            if at != 256 {
                r[at + n..at + len].fill(b' ');
            }
        };
        text(r, 32, 32, &e.trsvcid);
        text(r, 256, 256, &e.subnqn);
        text(r, 512, 256, &e.traddr);
        if e.trtype == TRTYPE_RDMA {
            r[768..771].copy_from_slice(&[1, 1, 1]);
        }
    }
    b
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sqe::Sqe;

    #[test]
    fn a_request_is_cut_from_the_page() {
        let mut s = Sqe::new(0x02, 1);
        // LID 0Ch, RGO, 4 dwords at byte 8.
        s.set_cdw(10, 0x0c | 1 << 8 | 3 << 16);
        s.set_qword(12, 8);
        let r = LogRequest::from_sqe(&s);
        assert_eq!((r.lid, r.lsp, r.len, r.offset), (0x0c, 1, 16, 8));
        let page: Vec<u8> = (0..20).collect();
        assert_eq!(
            r.cut(&page, 4096),
            Some(vec![
                8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 0, 0, 0, 0
            ])
        );
        // Past the end: zeros (libnvme reads in 4 KiB pieces); not dword aligned: refused;
        // a length beyond the largest transfer: refused before anything is allocated.
        let far = LogRequest { offset: 24, ..r };
        assert_eq!(far.cut(&page, 4096), Some(vec![0; 16]));
        let odd = LogRequest { offset: 21, ..r };
        assert_eq!(odd.cut(&page, 4096), None);
        let huge = LogRequest { len: u32::MAX, ..r };
        assert_eq!(huge.cut(&page, 1 << 20), None);
    }

    #[test]
    fn the_discovery_page() {
        let e = DiscoveryEntry {
            trtype: TRTYPE_TCP,
            adrfam: ADRFAM_IPV4,
            subtype: SUBTYPE_NVM,
            portid: 2,
            trsvcid: "4420".into(),
            subnqn: "nqn.2026-11.io.example:a".into(),
            traddr: "192.0.2.1".into(),
        };
        let p = discovery(7, &[&e, &e]);
        assert_eq!(p.len(), 3 * 1024);
        assert_eq!(u64::from_le_bytes(p[0..8].try_into().unwrap()), 7);
        assert_eq!(u64::from_le_bytes(p[8..16].try_into().unwrap()), 2);
        let r = &p[2048..3072];
        assert_eq!(&r[..3], &[3, 1, 2]);
        assert_eq!(&r[4..10], &[2, 0, 0xff, 0xff, 32, 0]);
        assert_eq!(&r[32..36], b"4420");
        assert_eq!(r[36], b' ');
        assert_eq!(&r[256..280], b"nqn.2026-11.io.example:a");
        assert_eq!(r[280], 0);
        assert_eq!(&r[512..521], b"192.0.2.1");
        assert_eq!(&r[768..771], &[0, 0, 0], "TCP's TSAS: none");
        let rdma = DiscoveryEntry {
            trtype: TRTYPE_RDMA,
            ..e
        };
        let r = discovery(8, &[&rdma])[1024..2048].to_vec();
        assert_eq!(r[0], 1);
        assert_eq!(&r[768..772], &[1, 1, 1, 0], "RC, any provider, RDMA_CM");
    }

    #[test]
    fn the_ana_page() {
        let g = AnaGroup {
            id: 1,
            state: 1,
            change_count: 5,
            nsids: vec![1, 2],
        };
        let b = ana(7, std::slice::from_ref(&g), false);
        assert_eq!(b.len(), 16 + 32 + 8);
        assert_eq!(&b[..10], &[7, 0, 0, 0, 0, 0, 0, 0, 1, 0]);
        assert_eq!(&b[16..24], &[1, 0, 0, 0, 2, 0, 0, 0]);
        assert_eq!(b[32], 1);
        assert_eq!(&b[48..56], &[1, 0, 0, 0, 2, 0, 0, 0]);
        assert_eq!(ana(7, &[g], true).len(), 48);
    }

    #[test]
    fn effects_and_changes() {
        let e = commands_effects(&[0x06], &[(0x01, true), (0x02, false)]);
        assert_eq!(&e[24..28], &[1, 0, 0, 0]);
        assert_eq!(&e[1028..1032], &[3, 0, 0, 0]);
        assert_eq!(&e[1032..1036], &[1, 0, 0, 0]);
        let c = changed_namespaces(&[3]);
        assert_eq!(&c[..8], &[3, 0, 0, 0, 0, 0, 0, 0]);
        assert_eq!(&changed_namespaces(&[1; 1025])[..4], &[0xff; 4]);
        assert_eq!(&firmware_slot("0.1")[8..16], b"0.1     ");
        assert_eq!(smart(1, 2, 3, 4)[3], 100);
    }
}
