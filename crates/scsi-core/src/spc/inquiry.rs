//! INQUIRY (SPC-4 section 6.6): standard data with version descriptors, and the VPD pages 00h,
//! 80h, 83h, 86h, B0h, B1h and B2h.

use crate::cdb::check_control;
use crate::lu::{LogicalUnit, TargetPort};
use crate::sense::{FieldPointer, Sense};

/// The VPD pages this logical unit supports, in ascending order.
pub const SUPPORTED_VPD_PAGES: [u8; 8] = [0x00, 0x80, 0x83, 0x86, 0x8f, 0xb0, 0xb1, 0xb2];

/// Version descriptors (SPC-4 table 143): SAM-5, iSCSI (no version claimed), SPC-4, SBC-3.
const VERSION_DESCRIPTORS: [u16; 4] = [0x00a0, 0x0960, 0x0460, 0x04c0];

/// The parameter data of an INQUIRY command, truncated to its ALLOCATION LENGTH.
pub fn inquiry(lu: &LogicalUnit, port: &TargetPort, cdb: &[u8]) -> Result<Vec<u8>, Sense> {
    if cdb.len() < 6 {
        return Err(Sense::invalid_field_in_cdb(FieldPointer::cdb(0)));
    }
    check_control(cdb, 6)?;
    if cdb[1] & 0x02 != 0 {
        // CMDDT is obsolete.
        return Err(Sense::invalid_field_in_cdb(FieldPointer::cdb_bit(1, 1)));
    }
    let evpd = cdb[1] & 0x01 != 0;
    let page = cdb[2];
    let mut data = match (evpd, page) {
        (false, 0) => standard(lu),
        (false, _) => return Err(Sense::invalid_field_in_cdb(FieldPointer::cdb(2))),
        (true, p) => {
            vpd(lu, port, p).ok_or_else(|| Sense::invalid_field_in_cdb(FieldPointer::cdb(2)))?
        }
    };
    data.truncate(usize::from(u16::from_be_bytes([cdb[3], cdb[4]])));
    Ok(data)
}

/// Standard INQUIRY data, 96 bytes.
fn standard(lu: &LogicalUnit) -> Vec<u8> {
    let mut b = vec![0u8; 96];
    b[0] = 0x00; // Peripheral qualifier 0, direct access block device.
    b[2] = 0x06; // SPC-4.
    b[3] = 0x10 | 0x02; // HISUP, response data format 2.
    b[4] = (b.len() - 5) as u8;
    // TPGS 11b: implicit and explicit asymmetric logical unit access (SET TARGET PORT
    // GROUPS); 3PC.
    b[5] = 0x30 | 0x08;
    b[7] = 0x02; // CMDQUE.
    b[8..16].copy_from_slice(&lu.identity.vendor);
    b[16..32].copy_from_slice(&lu.identity.product);
    b[32..36].copy_from_slice(&lu.identity.revision);
    for (i, v) in VERSION_DESCRIPTORS.iter().enumerate() {
        b[58 + 2 * i..60 + 2 * i].copy_from_slice(&v.to_be_bytes());
    }
    b
}

/// A VPD page, or `None` if unsupported.
fn vpd(lu: &LogicalUnit, port: &TargetPort, page: u8) -> Option<Vec<u8>> {
    let body = match page {
        0x00 => SUPPORTED_VPD_PAGES.to_vec(),
        0x80 => lu.identity.serial.as_bytes().to_vec(),
        0x83 => device_identification(lu, port),
        0x86 => extended_inquiry(lu),
        0x8f => crate::spc::copy::vpd_page(),
        0xb0 => block_limits(lu),
        0xb1 => {
            let mut b = vec![0u8; 0x3c];
            b[1] = 0x01; // MEDIUM ROTATION RATE 1: non-rotating medium.
            b
        }
        0xb2 => logical_block_provisioning(lu),
        _ => return None,
    };
    let mut b = Vec::with_capacity(4 + body.len());
    b.extend_from_slice(&[0x00, page]);
    b.extend_from_slice(&(body.len() as u16).to_be_bytes());
    b.extend_from_slice(&body);
    Some(b)
}

/// One designation descriptor (SPC-4 section 7.8.6.1).
fn designator(out: &mut Vec<u8>, protocol_and_code_set: u8, piv_association_type: u8, id: &[u8]) {
    out.extend_from_slice(&[
        protocol_and_code_set,
        piv_association_type,
        0,
        id.len() as u8,
    ]);
    out.extend_from_slice(id);
}

/// A SCSI name string: UTF-8, NUL terminated, padded to a multiple of four bytes.
fn name_string(name: &str) -> Vec<u8> {
    let mut v = name.as_bytes().to_vec();
    v.push(0);
    while v.len() % 4 != 0 {
        v.push(0);
    }
    v
}

/// Device Identification (83h): the logical unit's NAA designator, then the target port's
/// relative port, port group and name, and the target device's name.
fn device_identification(lu: &LogicalUnit, port: &TargetPort) -> Vec<u8> {
    const ISCSI: u8 = 0x50; // Protocol identifier 5, for PIV = 1 descriptors.
    const BINARY: u8 = 0x01;
    const UTF8: u8 = 0x03;
    let mut d = Vec::new();
    designator(&mut d, BINARY, 0x03, &lu.identity.naa);
    let [hi, lo] = port.relative_port.to_be_bytes();
    designator(&mut d, ISCSI | BINARY, 0x94, &[0, 0, hi, lo]);
    let [hi, lo] = port.port_group.to_be_bytes();
    designator(&mut d, ISCSI | BINARY, 0x95, &[0, 0, hi, lo]);
    designator(&mut d, ISCSI | UTF8, 0x98, &name_string(&port.name));
    designator(&mut d, ISCSI | UTF8, 0xa8, &name_string(&port.target_name));
    d
}

/// Extended INQUIRY Data (86h): all three task attributes; a volatile cache when WCE is on.
fn extended_inquiry(lu: &LogicalUnit) -> Vec<u8> {
    let mut b = vec![0u8; 0x3c];
    b[1] = 0x07; // HEADSUP, ORDSUP, SIMPSUP.
    b[2] = if lu.geometry.write_cache { 0x01 } else { 0x00 }; // V_SUP.
    b
}

/// Block Limits (B0h).
fn block_limits(lu: &LogicalUnit) -> Vec<u8> {
    let l = &lu.limits;
    let thin = lu.geometry.thin;
    let mut b = vec![0u8; 0x3c];
    b[0] = 0x01; // WSNZ: WRITE SAME with zero blocks is refused.
    b[1] = l.max_compare_and_write;
    b[2..4].copy_from_slice(&l.optimal_granularity.max(1).to_be_bytes());
    b[4..8].copy_from_slice(&l.max_transfer.to_be_bytes());
    b[8..12].copy_from_slice(&l.optimal_transfer.to_be_bytes());
    b[12..16].copy_from_slice(&l.max_transfer.to_be_bytes()); // MAXIMUM PREFETCH LENGTH.
    if thin {
        b[16..20].copy_from_slice(&l.max_unmap_blocks.to_be_bytes());
        b[20..24].copy_from_slice(&l.max_unmap_descriptors.to_be_bytes());
        b[24..28].copy_from_slice(&l.unmap_granularity.to_be_bytes());
    }
    b[32..40].copy_from_slice(&l.max_write_same.to_be_bytes());
    // WRITE ATOMIC(16): up to a full transfer, any alignment, no boundaries.
    b[40..44].copy_from_slice(&l.max_transfer.to_be_bytes());
    b[44..48].copy_from_slice(&1u32.to_be_bytes());
    b[48..52].copy_from_slice(&1u32.to_be_bytes());
    b
}

/// Logical Block Provisioning (B2h).
fn logical_block_provisioning(lu: &LogicalUnit) -> Vec<u8> {
    if lu.geometry.thin {
        // LBPU, LBPWS, LBPWS10, LBPRZ; provisioning type 2: thin.
        vec![0x00, 0x80 | 0x40 | 0x20 | 0x04, 0x02, 0x00]
    } else {
        vec![0x00; 4]
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::lu::{Geometry, Identity, Limits};
    use crate::sense::{Asc, FieldIn};

    fn lu(thin: bool) -> LogicalUnit {
        LogicalUnit {
            identity: Identity::new("STGT", "targetd disk", "0001", b"key"),
            geometry: Geometry {
                block_size: 512,
                blocks: 1 << 21,
                thin,
                write_cache: true,
                read_only: false,
            },
            limits: Limits::default(),
        }
    }

    fn port() -> TargetPort {
        TargetPort {
            relative_port: 1,
            port_group: 1,
            name: "iqn.2026-11.io.example:d1,t,0x1".into(),
            target_name: "iqn.2026-11.io.example:d1".into(),
        }
    }

    fn cdb(evpd: bool, page: u8, alloc: u16) -> [u8; 6] {
        let [hi, lo] = alloc.to_be_bytes();
        [0x12, u8::from(evpd), page, hi, lo, 0]
    }

    #[test]
    fn standard_data() {
        let d = inquiry(&lu(false), &port(), &cdb(false, 0, 255)).unwrap();
        assert_eq!(d.len(), 96);
        assert_eq!(&d[..8], &[0x00, 0x00, 0x06, 0x12, 91, 0x38, 0x00, 0x02]);
        assert_eq!(&d[8..16], b"STGT    ");
        assert_eq!(
            &d[58..66],
            &[0x00, 0xa0, 0x09, 0x60, 0x04, 0x60, 0x04, 0xc0]
        );
        // Truncated to the allocation length, down to nothing.
        assert_eq!(
            inquiry(&lu(false), &port(), &cdb(false, 0, 36)).unwrap(),
            d[..36]
        );
        assert!(inquiry(&lu(false), &port(), &cdb(false, 0, 0))
            .unwrap()
            .is_empty());
    }

    #[test]
    fn vpd_pages() {
        let l = lu(true);
        let pages = inquiry(&l, &port(), &cdb(true, 0x00, 255)).unwrap();
        assert_eq!(
            pages,
            [&[0x00, 0x00, 0x00, 0x08][..], &SUPPORTED_VPD_PAGES].concat()
        );
        let serial = inquiry(&l, &port(), &cdb(true, 0x80, 255)).unwrap();
        assert_eq!(&serial[4..], l.identity.serial.as_bytes());
        assert_eq!(serial[3] as usize, l.identity.serial.len());

        let id = inquiry(&l, &port(), &cdb(true, 0x83, 1024)).unwrap();
        assert_eq!(u16::from_be_bytes([id[2], id[3]]) as usize, id.len() - 4);
        // First: the NAA designator of the logical unit (binary, association 0, type 3).
        assert_eq!(&id[4..8], &[0x01, 0x03, 0x00, 0x08]);
        assert_eq!(&id[8..16], &l.identity.naa);
        // Then the relative target port and the target port group.
        assert_eq!(&id[16..24], &[0x51, 0x94, 0x00, 0x04, 0, 0, 0, 1]);
        assert_eq!(&id[24..32], &[0x51, 0x95, 0x00, 0x04, 0, 0, 0, 1]);
        // Then the port's SCSI name string, NUL terminated and padded to four bytes.
        assert_eq!(&id[32..34], &[0x53, 0x98]);
        let n = id[35] as usize;
        assert_eq!(n % 4, 0);
        assert_eq!(&id[36..36 + 31], b"iqn.2026-11.io.example:d1,t,0x1");
        assert_eq!(id[36 + 31], 0);

        let ext = inquiry(&l, &port(), &cdb(true, 0x86, 255)).unwrap();
        assert_eq!((ext[3], ext[5], ext[6]), (0x3c, 0x07, 0x01));
        let limits = inquiry(&l, &port(), &cdb(true, 0xb0, 255)).unwrap();
        assert_eq!(limits[3], 0x3c);
        assert_eq!(limits[5], 255);
        assert_eq!(u32::from_be_bytes(limits[8..12].try_into().unwrap()), 8192);
        assert_eq!(
            u32::from_be_bytes(limits[20..24].try_into().unwrap()),
            1 << 20
        );
        let chars = inquiry(&l, &port(), &cdb(true, 0xb1, 255)).unwrap();
        assert_eq!(&chars[4..6], &[0x00, 0x01]);
        let prov = inquiry(&l, &port(), &cdb(true, 0xb2, 255)).unwrap();
        assert_eq!(prov, [0x00, 0xb2, 0x00, 0x04, 0x00, 0xe4, 0x02, 0x00]);
        let full = inquiry(&lu(false), &port(), &cdb(true, 0xb2, 255)).unwrap();
        assert_eq!(&full[4..], &[0, 0, 0, 0]);
        let limits = inquiry(&lu(false), &port(), &cdb(true, 0xb0, 255)).unwrap();
        assert_eq!(
            &limits[20..32],
            &[0; 12],
            "no UNMAP limits without thin provisioning"
        );
    }

    #[test]
    fn invalid_fields_point_at_the_field() {
        let check = |c: [u8; 6], byte: u16, bit: Option<u8>| {
            let e = inquiry(&lu(false), &port(), &c).unwrap_err();
            assert_eq!(e.asc, Asc::INVALID_FIELD_IN_CDB);
            let f = e.field.unwrap();
            assert_eq!((f.within, f.byte, f.bit), (FieldIn::Cdb, byte, bit));
        };
        check(cdb(false, 0x80, 255), 2, None); // a page without EVPD
        check(cdb(true, 0x42, 255), 2, None); // an unsupported page
        let mut cmddt = cdb(false, 0, 255);
        cmddt[1] = 0x02;
        check(cmddt, 1, Some(1));
        let mut naca = cdb(false, 0, 255);
        naca[5] = 0x04;
        check(naca, 5, Some(2));
    }
}
