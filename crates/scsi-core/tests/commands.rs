//! Table tests for the commands, driven through the device and memory backends.

mod common;

use common::*;
use scsi_core::{Residual, Status, TmfFunction};

#[test]
fn new_nexus_sees_power_on_then_tur_is_good() {
    for delegate in [false, true] {
        let mut h = harness_with(delegate);
        let n = h
            .device
            .open_nexus(scsi_core::TransportId::iscsi("iqn.x:a", [1; 6]), 1);
        // INQUIRY and REPORT LUNS neither report nor clear it.
        good(&h.command(n, 0, &[0x12, 0, 0, 0, 96, 0], &[], 96));
        check(&h.command(n, 0, &[0; 6], &[], 0), 6, 0x29, 0x00);
        good(&h.command(n, 0, &[0; 6], &[], 0));
        // REQUEST SENSE reports (and clears) LUN 1's.
        let rs = h.command(n, 1, &[0x03, 0, 0, 0, 18, 0], &[], 18);
        good(&rs);
        assert_eq!((rs.data[2], rs.data[12]), (0x06, 0x29));
        let rs = h.command(n, 1, &[0x03, 0, 0, 0, 18, 0], &[], 18);
        assert_eq!((rs.data[2], rs.data[12]), (0x00, 0x00));
    }
}

/// A nexus handed over from another process goes on with the unit attentions pending there,
/// not with POWER ON, RESET: its initiator saw no reset. Those of units the device does not
/// have are dropped.
#[test]
fn an_adopted_nexus_keeps_its_pending_unit_attentions_and_no_power_on() {
    use scsi_core::{Asc, TransportId};
    for delegate in [false, true] {
        let mut h = harness_with(delegate);
        let old = h
            .device
            .open_nexus(TransportId::iscsi("iqn.x:a", [1; 6]), 1);
        good(&h.command(old, 1, &[0x12, 0, 0, 0, 96, 0], &[], 96));
        check(&h.command(old, 0, &[0; 6], &[], 0), 6, 0x29, 0x00);
        // What the old process hands over: LUN 1's power-on is still pending.
        let pending = h.device.pending_unit_attentions(old).unwrap();
        assert_eq!(pending, [(1, Asc::POWER_ON_RESET)]);
        let mut carried = pending.clone();
        carried.push((0, Asc::CAPACITY_DATA_HAS_CHANGED));
        carried.push((9, Asc::POWER_ON_RESET));
        let n = h
            .device
            .adopt_nexus(TransportId::iscsi("iqn.x:b", [2; 6]), 1, carried);
        assert_eq!(
            h.device.pending_unit_attentions(n).unwrap(),
            [
                (1, Asc::POWER_ON_RESET),
                (0, Asc::CAPACITY_DATA_HAS_CHANGED)
            ],
            "LUN 9 is not here"
        );
        check(&h.command(n, 0, &[0; 6], &[], 0), 6, 0x2a, 0x09);
        good(&h.command(n, 0, &[0; 6], &[], 0));
        check(&h.command(n, 1, &[0; 6], &[], 0), 6, 0x29, 0x00);
        good(&h.command(n, 1, &[0; 6], &[], 0));
        // Nothing pending: good at once.
        let quiet = h
            .device
            .adopt_nexus(TransportId::iscsi("iqn.x:c", [3; 6]), 1, Vec::new());
        good(&h.command(quiet, 0, &[0; 6], &[], 0));
        good(&h.command(quiet, 1, &[0; 6], &[], 0));
    }
}

#[test]
fn absent_lun() {
    for delegate in [false, true] {
        let mut h = harness_with(delegate);
        let n = h.login("iqn.x:a", 1);
        let inq = h.command(n, 7, &[0x12, 0, 0, 0, 36, 0], &[], 36);
        good(&inq);
        assert_eq!(inq.data[0], 0x7f);
        check(&h.command(n, 7, &[0; 6], &[], 0), 5, 0x25, 0);
        let rl = h.command(n, 7, &[0xa0, 0, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0], &[], 256);
        good(&rl);
        assert_eq!(&rl.data[..4], &[0, 0, 0, 16]);
    }
}

#[test]
fn read_write_round_trip_with_residuals() {
    for delegate in [false, true] {
        let mut h = harness_with(delegate);
        let n = h.login("iqn.x:a", 1);
        let data = pattern(8, 1);
        let w = h.command(n, 0, &cdb10(0x2a, 0x08, 100, 8), &data, 4096);
        good(&w);
        assert_eq!((w.data_out_asked, w.residual), (4096, Residual::None));
        let r = h.command(n, 0, &cdb16(0x88, 0, 100, 8), &[], 4096);
        good(&r);
        assert_eq!(r.data, data);
        // The initiator expects less: overflow, truncated data.
        let r = h.command(n, 0, &cdb10(0x28, 0, 100, 8), &[], 1000);
        assert_eq!((r.data.len(), r.residual), (1000, Residual::Overflow(3096)));
        assert_eq!(r.data, data[..1000]);
        // More: underflow.
        let r = h.command(n, 0, &cdb10(0x28, 0, 100, 1), &[], 10000);
        assert_eq!(r.residual, Residual::Underflow(10000 - 512));
        // A write whose expected length is short writes the whole blocks the initiator sends and
        // reports the overflow (FCP-4 9.4.2 a).
        let w = h.command(n, 0, &cdb10(0x2a, 0, 100, 2), &pattern(1, 9), 0);
        good(&w);
        assert_eq!(
            (w.data_out_asked, w.residual),
            (512, Residual::Overflow(512))
        );
        // A partial block cannot be written as sent: nothing is written and the command is
        // refused (FCP-4 9.4.2 b), with the overflow; never GOOD for bytes dropped.
        let w = h.command(n, 0, &cdb10(0x2a, 0, 101, 1), &pattern(1, 5)[..200], 0);
        check(&w, 5, 0x0e, 0x03);
        assert_eq!((w.data_out_asked, w.residual), (0, Residual::Overflow(312)));
        let w = h.command(n, 0, &cdb10(0x2a, 0, 102, 2), &pattern(2, 5)[..600], 0);
        check(&w, 5, 0x0e, 0x03);
        assert_eq!((w.data_out_asked, w.residual), (0, Residual::Overflow(424)));
        let mut expect = data.clone();
        expect[..512].copy_from_slice(&pattern(1, 9));
        assert_eq!(
            h.command(n, 0, &cdb10(0x28, 0, 100, 8), &[], 4096).data,
            expect
        );
        // A COMPARE AND WRITE or WRITE SAME whose data-out is not exactly what it needs is
        // refused.
        let mut caw = [0u8; 16];
        caw[0] = 0x89;
        caw[13] = 1;
        check(&h.command(n, 0, &caw, &pattern(4, 1), 0), 5, 0x24, 0x00);
        let ws = cdb10(0x41, 0, 0, 1);
        check(&h.command(n, 0, &ws, &pattern(2, 1), 0), 5, 0x24, 0x00);
        good(&h.command(n, 0, &ws, &pattern(1, 1), 0));
        h.command(n, 0, &cdb10(0x2a, 0, 100, 8), &data, 0);
        // Extra expected data-out: only the command's length is written.
        let mut long = pattern(2, 7);
        long.extend_from_slice(&[0xee; 100]);
        let w = h.command(n, 0, &cdb10(0x2a, 0, 0, 2), &long, 0);
        assert_eq!(w.residual, Residual::Underflow(100));
        // READ(6) with transfer length 0 means 256 blocks.
        let r = h.command(n, 0, &[0x08, 0, 0, 0, 0, 0], &[], 256 * 512);
        good(&r);
        assert_eq!(r.data.len(), 256 * 512);
        // Zero blocks: nothing moves.
        good(&h.command(n, 0, &cdb10(0x28, 0, 0, 0), &[], 0));
    }
}

#[test]
fn range_protect_and_reserved_bits() {
    for delegate in [false, true] {
        let mut h = harness_with(delegate);
        let n = h.login("iqn.x:a", 1);
        let end = BLOCKS as u32;
        check(
            &h.command(n, 0, &cdb10(0x28, 0, end, 1), &[], 512),
            5,
            0x21,
            0,
        );
        check(
            &h.command(n, 0, &cdb10(0x28, 0, end - 1, 2), &[], 1024),
            5,
            0x21,
            0,
        );
        good(&h.command(n, 0, &cdb10(0x28, 0, end - 1, 1), &[], 512));
        check(
            &h.command(n, 0, &cdb16(0x88, 0, u64::MAX, 1), &[], 512),
            5,
            0x21,
            0,
        );
        // RDPROTECT
        let o = h.command(n, 0, &cdb10(0x28, 0x20, 0, 1), &[], 512);
        check(&o, 5, 0x24, 0);
        // Reserved bit in byte 6 of READ(10) (GROUP NUMBER's top bits).
        let mut c = cdb10(0x28, 0, 0, 1);
        c[6] = 0x80;
        let o = h.command(n, 0, &c, &[], 512);
        check(&o, 5, 0x24, 0);
        // SKSV, C/D, BPV, bit 7, byte 6.
        assert_eq!(&o.sense[15..18], &[0xc8 | 7, 0, 6]);
        // NACA in CONTROL.
        let mut c = cdb10(0x28, 0, 0, 1);
        c[9] = 0x04;
        check(&h.command(n, 0, &c, &[], 512), 5, 0x24, 0);
        // Unknown opcode and unknown service action.
        check(&h.command(n, 0, &[0xc0, 0, 0, 0, 0, 0], &[], 0), 5, 0x20, 0);
        check(
            &h.command(n, 0, &cdb16(0x9e, 0x05, 0, 0), &[], 0),
            5,
            0x24,
            0,
        );
        // Transfer length beyond MAXIMUM TRANSFER LENGTH.
        check(
            &h.command(n, 0, &cdb16(0x88, 0, 0, 8193), &[], 0),
            5,
            0x24,
            0,
        );
    }
}

#[test]
fn capacity_inquiry_and_reports() {
    for delegate in [false, true] {
        let mut h = harness_with(delegate);
        let n = h.login("iqn.x:a", 1);
        let rc = h.command(n, 0, &[0x25, 0, 0, 0, 0, 0, 0, 0, 0, 0], &[], 8);
        assert_eq!(rc.data, [0, 0, 0xff, 0xff, 0, 0, 2, 0]);
        let mut c16 = cdb16(0x9e, 0x10, 0, 32);
        c16[10..14].copy_from_slice(&32u32.to_be_bytes());
        let rc16 = h.command(n, 0, &c16, &[], 32);
        assert_eq!(
            rc16.data[14] & 0xc0,
            0xc0,
            "LBPME and LBPRZ on the thin unit"
        );
        let rc16 = h.command(n, 1, &c16, &[], 32);
        assert_eq!(rc16.data[14] & 0xc0, 0, "not on the thick one");
        let vpd83 = h.command(n, 0, &[0x12, 1, 0x83, 1, 0, 0], &[], 256);
        good(&vpd83);
        let rl = h.command(n, 0, &[0xa0, 0, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0], &[], 256);
        assert_eq!(&rl.data[..4], &[0, 0, 0, 16]);
        assert_eq!(
            &rl.data[8..24],
            &[0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0]
        );
        let rtpg = h.command(n, 0, &[0xa3, 0x0a, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0], &[], 256);
        assert_eq!(&rtpg.data[4..8], &[0x80, 0x01, 0, 1]);
        assert_eq!(rtpg.data[11], 2);
        let rsoc = h.command(
            n,
            0,
            &[0xa3, 0x0c, 0x01, 0x89, 0, 0, 0, 0, 0, 64, 0, 0],
            &[],
            64,
        );
        assert_eq!(&rsoc.data[..5], &[0, 3, 0, 16, 0x89]);
        let rstmf = h.command(n, 0, &[0xa3, 0x0d, 0, 0, 0, 0, 0, 0, 0, 4, 0, 0], &[], 4);
        assert_eq!(rstmf.data, [0xfe, 0x07, 0, 0]);
        let log = h.command(n, 0, &[0x4d, 0, 0, 0, 0, 0, 0, 1, 0, 0], &[], 256);
        assert_eq!(log.data, [0, 0, 0, 1, 0]);
        let defects = h.command(n, 0, &[0x37, 0, 0x1d, 0, 0, 0, 0, 0, 4, 0], &[], 4);
        assert_eq!(defects.data, [0, 0x1d, 0, 0]);
    }
}

#[test]
fn mode_select_changes_d_sense_wce_and_swp() {
    for delegate in [false, true] {
        let mut h = harness_with(delegate);
        let a = h.login("iqn.x:a", 1);
        let b = h.login("iqn.x:b", 2);
        let mut page = h
            .command(a, 0, &[0x1a, 0x08, 0x0a, 0, 255, 0], &[], 255)
            .data;
        assert_eq!(page.len(), 16);
        page[0] = 0;
        page[4 + 2] |= 0x04;
        good(&h.command(a, 0, &[0x15, 0x10, 0, 0, page.len() as u8, 0], &page, 0));
        // Descriptor-format sense from now on; the other nexus hears about the change.
        let o = h.command(a, 0, &cdb10(0x28, 0, BLOCKS as u32, 1), &[], 512);
        assert_eq!(o.sense[0], 0x72);
        check(&o, 5, 0x21, 0);
        check(&h.command(b, 0, &[0; 6], &[], 0), 6, 0x2a, 0x01);
        // SWP: writes refused with DATA PROTECT.
        page[4 + 2] &= !0x04;
        page[4 + 4] |= 0x08;
        good(&h.command(a, 0, &[0x15, 0x10, 0, 0, page.len() as u8, 0], &page, 0));
        check(
            &h.command(a, 0, &cdb10(0x2a, 0, 0, 1), &pattern(1, 0), 0),
            7,
            0x27,
            0,
        );
        let ms = h.command(a, 0, &[0x1a, 0, 0x0a, 0, 255, 0], &[], 255);
        assert_eq!(ms.data[2] & 0x80, 0x80, "WP in the header");
        // SP=1 and PF=0 refused; a page with a non-changeable bit flipped too.
        check(
            &h.command(a, 0, &[0x15, 0x11, 0, 0, 16, 0], &page, 0),
            5,
            0x24,
            0,
        );
        check(
            &h.command(a, 0, &[0x15, 0x00, 0, 0, 16, 0], &page, 0),
            5,
            0x24,
            0,
        );
        page[4 + 3] = 0;
        check(
            &h.command(a, 0, &[0x15, 0x10, 0, 0, 16, 0], &page, 0),
            5,
            0x26,
            0,
        );
        // Saved values are not supported.
        check(
            &h.command(a, 0, &[0x1a, 0, 0xca, 0, 255, 0], &[], 255),
            5,
            0x39,
            0,
        );
    }
}

#[test]
fn verify_compare_and_write_orwrite() {
    for delegate in [false, true] {
        let mut h = harness_with(delegate);
        let n = h.login("iqn.x:a", 1);
        let data = pattern(4, 3);
        good(&h.command(n, 0, &cdb10(0x2a, 0, 10, 4), &data, 2048));
        good(&h.command(n, 0, &cdb10(0x2f, 0x02, 10, 4), &data, 0));
        let mut wrong = data.clone();
        wrong[700] ^= 1;
        let o = h.command(n, 0, &cdb10(0x2f, 0x02, 10, 4), &wrong, 0);
        check(&o, 0x0e, 0x1d, 0);
        assert_eq!(
            &o.sense[3..7],
            &700u32.to_be_bytes(),
            "INFORMATION: the offset"
        );
        check(
            &h.command(n, 0, &cdb10(0x2f, 0x04, 10, 4), &data, 0),
            5,
            0x24,
            0,
        );
        // BYTCHK 11b: one block against each.
        good(&h.command(n, 0, &cdb10(0x2a, 0, 20, 1), &data[..512], 512));
        let same: Vec<u8> = data[..512].repeat(3);
        good(&h.command(n, 0, &cdb10(0x2a, 0, 21, 3), &same, 1536));
        good(&h.command(n, 0, &cdb10(0x2f, 0x06, 20, 4), &data[..512], 0));
        // COMPARE AND WRITE.
        let mut caw = cdb16(0x89, 0, 10, 0);
        caw[13] = 2;
        let new = pattern(2, 99);
        let o = h.command(n, 0, &caw, &[&data[..1024], &new[..]].concat(), 0);
        good(&o);
        assert_eq!(h.command(n, 0, &cdb10(0x28, 0, 10, 2), &[], 1024).data, new);
        let o = h.command(n, 0, &caw, &[&data[..1024], &new[..]].concat(), 0);
        check(&o, 0x0e, 0x1d, 0);
        let mut big = cdb16(0x89, 0, 1000, 0);
        big[13] = 255;
        good(&h.command(n, 0, &big, &vec![0; 255 * 1024], 0));
        caw[13] = 0;
        good(&h.command(n, 0, &caw, &[], 0));
        // ORWRITE
        good(&h.command(n, 0, &cdb16(0x8b, 0, 30, 1), &[0x0f; 512], 0));
        good(&h.command(n, 0, &cdb16(0x8b, 0, 30, 1), &[0xf0; 512], 0));
        assert_eq!(
            h.command(n, 0, &cdb10(0x28, 0, 30, 1), &[], 512).data,
            vec![0xff; 512]
        );
    }
}

#[test]
fn write_same_unmap_and_lba_status() {
    for delegate in [false, true] {
        let mut h = harness_with(delegate);
        let n = h.login("iqn.x:a", 1);
        let lba_status = |h: &mut scsi_core::testing::Harness, lba: u64| {
            let mut c = cdb16(0x9e, 0x12, lba, 24);
            c[10..14].copy_from_slice(&24u32.to_be_bytes());
            let o = h.command(n, 0, &c, &[], 24);
            good(&o);
            (
                u32::from_be_bytes(o.data[16..20].try_into().unwrap()),
                o.data[20],
            )
        };
        assert_eq!(lba_status(&mut h, 0), (BLOCKS as u32, 1));
        let block = pattern(1, 5);
        good(&h.command(n, 0, &cdb10(0x41, 0, 0, 256), &block, 512));
        let r = h.command(n, 0, &cdb10(0x28, 0, 0, 256), &[], 256 * 512);
        assert!(r.data.chunks(512).all(|c| c == block));
        assert_eq!(lba_status(&mut h, 0), (256, 0), "two 64 KiB chunks");
        // WRITE SAME with UNMAP and a zero block deallocates.
        good(&h.command(n, 0, &cdb10(0x41, 0x08, 0, 128), &[0; 512], 512));
        assert_eq!(lba_status(&mut h, 0).1, 1);
        // NDOB on WRITE SAME(16).
        good(&h.command(n, 0, &cdb16(0x93, 0x09, 128, 128), &[], 0));
        assert_eq!(lba_status(&mut h, 0).1, 1);
        assert!(h
            .command(n, 0, &cdb10(0x28, 0, 0, 256), &[], 256 * 512)
            .data
            .iter()
            .all(|&b| b == 0));
        // Zero blocks (WSNZ), ANCHOR and out-of-range refused.
        check(
            &h.command(n, 0, &cdb10(0x41, 0, 0, 0), &block, 512),
            5,
            0x24,
            0,
        );
        check(
            &h.command(n, 0, &cdb10(0x41, 0x18, 0, 1), &block, 512),
            5,
            0x24,
            0,
        );
        check(
            &h.command(n, 0, &cdb10(0x41, 0, BLOCKS as u32, 1), &block, 512),
            5,
            0x21,
            0,
        );
        // UNMAP.
        good(&h.command(
            n,
            0,
            &cdb10(0x2a, 0, 1024, 256),
            &pattern(256, 1),
            256 * 512,
        ));
        assert_eq!(lba_status(&mut h, 1024).1, 0);
        let mut list = vec![0, 22, 0, 16, 0, 0, 0, 0];
        list.extend_from_slice(&1024u64.to_be_bytes());
        list.extend_from_slice(&256u32.to_be_bytes());
        list.extend_from_slice(&[0; 4]);
        let mut c = [0x42, 0, 0, 0, 0, 0, 0, 0, 24, 0];
        good(&h.command(n, 0, &c, &list, 0));
        assert_eq!(lba_status(&mut h, 1024).1, 1);
        c[8] = 4;
        check(&h.command(n, 0, &c, &list[..4], 0), 5, 0x1a, 0);
        list[8..16].copy_from_slice(&(BLOCKS - 1).to_be_bytes());
        c[8] = 24;
        check(&h.command(n, 0, &c, &list, 0), 5, 0x21, 0);
        // The thick unit has no UNMAP and reports everything mapped.
        check(&h.command(n, 1, &c, &list, 0), 5, 0x20, 0);
        // Nor WRITE SAME with UNMAP (its LBPWS bits are zero): refused, nothing written;
        // without UNMAP it writes.
        good(&h.command(n, 1, &cdb10(0x2a, 0, 0, 1), &pattern(1, 3), 512));
        for ws in [
            cdb10(0x41, 0x08, 0, 1).to_vec(),
            cdb16(0x93, 0x08, 0, 1).to_vec(),
        ] {
            check(&h.command(n, 1, &ws, &[0; 512], 512), 5, 0x24, 0);
        }
        assert_eq!(
            h.command(n, 1, &cdb10(0x28, 0, 0, 1), &[], 512).data,
            pattern(1, 3)
        );
        good(&h.command(n, 1, &cdb10(0x41, 0, 0, 1), &[0; 512], 512));
        let mut gls = cdb16(0x9e, 0x12, 0, 0);
        gls[10..14].copy_from_slice(&24u32.to_be_bytes());
        let o = h.command(n, 1, &gls, &[], 24);
        assert_eq!(o.data[20], 0);
    }
}

#[test]
fn sync_prefetch_start_stop_and_reserve() {
    for delegate in [false, true] {
        let mut h = harness_with(delegate);
        let a = h.login("iqn.x:a", 1);
        let b = h.login("iqn.x:b", 2);
        good(&h.command(a, 0, &cdb10(0x35, 0, 0, 0), &[], 0));
        good(&h.command(a, 0, &cdb16(0x91, 0x02, 0, 100), &[], 0));
        good(&h.command(a, 0, &cdb10(0x34, 0, 0, 100), &[], 0));
        check(
            &h.command(a, 0, &cdb10(0x34, 0, BLOCKS as u32 - 1, 2), &[], 0),
            5,
            0x21,
            0,
        );
        // STOP: media access and TUR report NOT READY; START brings it back.
        good(&h.command(a, 0, &[0x1b, 0, 0, 0, 0, 0], &[], 0));
        check(&h.command(a, 0, &[0; 6], &[], 0), 2, 0x04, 0x02);
        check(
            &h.command(a, 0, &cdb10(0x28, 0, 0, 1), &[], 512),
            2,
            0x04,
            0x02,
        );
        good(&h.command(a, 0, &[0x12, 0, 0, 0, 36, 0], &[], 36));
        good(&h.command(a, 0, &[0x1b, 0, 0, 0, 1, 0], &[], 0));
        good(&h.command(a, 0, &cdb10(0x28, 0, 0, 1), &[], 512));
        // RESERVE(6): the other nexus conflicts until RELEASE.
        good(&h.command(a, 0, &[0x16, 0, 0, 0, 0, 0], &[], 0));
        let o = h.command(b, 0, &cdb10(0x28, 0, 0, 1), &[], 512);
        assert_eq!(o.status, Some(Status::ReservationConflict));
        good(&h.command(b, 0, &[0x12, 0, 0, 0, 36, 0], &[], 36));
        good(&h.command(b, 0, &[0x17, 0, 0, 0, 0, 0], &[], 0));
        assert_eq!(
            h.command(b, 0, &[0; 6], &[], 0).status,
            Some(Status::ReservationConflict)
        );
        good(&h.command(a, 0, &[0x17, 0, 0, 0, 0, 0], &[], 0));
        good(&h.command(b, 0, &cdb10(0x28, 0, 0, 1), &[], 512));
        // Released by an I_T nexus reset too.
        good(&h.command(a, 0, &[0x56, 0, 0, 0, 0, 0, 0, 0, 0, 0], &[], 0));
        h.task_management(a, 0, TmfFunction::ItNexusReset, 1);
        good(&h.command(b, 0, &cdb10(0x28, 0, 0, 1), &[], 512));
    }
}

#[test]
fn lun_changes_raise_unit_attentions() {
    for delegate in [false, true] {
        let mut h = harness_with(delegate);
        let n = h.login("iqn.x:a", 1);
        h.device.resize_lu(0, BLOCKS * 2).unwrap();
        check(&h.command(n, 0, &[0; 6], &[], 0), 6, 0x2a, 0x09);
        h.add_lu(5, unit(true, b"lu5"));
        check(&h.command(n, 0, &[0; 6], &[], 0), 6, 0x3f, 0x0e);
        // REPORT LUNS clears the LUN-inventory attention on every unit.
        good(&h.command(n, 1, &[0xa0, 0, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0], &[], 256));
        good(&h.command(n, 1, &[0; 6], &[], 0));
        check(&h.command(n, 5, &[0; 6], &[], 0), 6, 0x29, 0);
        h.device.remove_lu(5).unwrap();
        check(&h.command(n, 5, &[0; 6], &[], 0), 5, 0x25, 0);
    }
}

/// A nexus whose transport reports asynchronous events (SRP_AER_REQ) gets each unit
/// attention established for it as an action too; it stays pending for its next command.
#[test]
fn unit_attentions_are_announced_to_the_nexuses_that_ask() {
    let mut h = harness();
    let a = h.login("iqn.x:a", 1);
    let b = h.login("iqn.x:b", 1);
    h.device.report_unit_attentions(a, true).unwrap();
    h.device.resize_lu(0, BLOCKS * 2).unwrap();
    h.run();
    assert_eq!(h.announced.len(), 1, "only the nexus that asked");
    let (nexus, lun, sense) = &h.announced[0];
    assert_eq!((*nexus, *lun), (a, 0));
    let s = sense.as_slice();
    assert_eq!((s[0], s[2], s[12], s[13]), (0x70, 6, 0x2a, 0x09));
    check(&h.command(a, 0, &[0; 6], &[], 0), 6, 0x2a, 0x09);
    // The other nexus hears of it the usual way.
    check(&h.command(b, 0, &[0; 6], &[], 0), 6, 0x2a, 0x09);
    // A unit added: its power-on and the inventory change, each announced once.
    h.add_lu(5, unit(true, b"lu5"));
    h.run();
    let codes: Vec<(u64, u8, u8)> = h.announced[1..]
        .iter()
        .map(|(_, lun, s)| (*lun, s.as_slice()[12], s.as_slice()[13]))
        .collect();
    assert!(codes.contains(&(5 << 48, 0x29, 0)), "{codes:?}");
    assert!(codes.contains(&(0, 0x3f, 0x0e)), "{codes:?}");
    // Asked no more: nothing announced.
    let before = h.announced.len();
    h.device.report_unit_attentions(a, false).unwrap();
    h.device.resize_lu(0, BLOCKS).unwrap();
    h.run();
    assert_eq!(h.announced.len(), before);
    for i in [0u16, 1, 255, 256, 0x3fff] {
        assert_eq!(scsi_core::lun_index(scsi_core::lun_number(i)), Some(i));
    }
}

/// An EXTENDED COPY (LID1) parameter list: identification target descriptors naming units by
/// NAA, then block-to-block segments (source index, destination index, blocks, LBAs).
fn xcopy_list(list_id: u8, units: &[[u8; 8]], segments: &[(u16, u16, u16, u64, u64)]) -> Vec<u8> {
    let mut t = Vec::new();
    for naa in units {
        let mut d = [0u8; 32];
        d[0] = 0xe4;
        d[4] = 0x01;
        d[5] = 0x03;
        d[7] = 8;
        d[8..16].copy_from_slice(naa);
        d[29..32].copy_from_slice(&512u32.to_be_bytes()[1..]);
        t.extend_from_slice(&d);
    }
    let mut s = Vec::new();
    for &(src, dst, blocks, from, to) in segments {
        let mut d = [0u8; 28];
        d[0] = 0x02;
        d[3] = 24;
        d[4..6].copy_from_slice(&src.to_be_bytes());
        d[6..8].copy_from_slice(&dst.to_be_bytes());
        d[10..12].copy_from_slice(&blocks.to_be_bytes());
        d[12..20].copy_from_slice(&from.to_be_bytes());
        d[20..28].copy_from_slice(&to.to_be_bytes());
        s.extend_from_slice(&d);
    }
    let mut h = vec![0u8; 16];
    h[0] = list_id;
    h[2..4].copy_from_slice(&(t.len() as u16).to_be_bytes());
    h[8..12].copy_from_slice(&(s.len() as u32).to_be_bytes());
    [h, t, s].concat()
}

fn xcopy_cdb(len: usize) -> Vec<u8> {
    let mut c = vec![0u8; 16];
    c[0] = 0x83;
    c[10..14].copy_from_slice(&(len as u32).to_be_bytes());
    c
}

fn copy_results_cdb(service_action: u8, list_id: u8) -> Vec<u8> {
    let mut c = vec![0u8; 16];
    c[0] = 0x84;
    c[1] = service_action;
    c[2] = list_id;
    c[10..14].copy_from_slice(&1024u32.to_be_bytes());
    c
}

#[test]
fn extended_copy_moves_blocks_within_and_between_units_and_reports_status() {
    for delegate in [false, true] {
        let mut h = harness_with(delegate);
        let n = h.login("iqn.x:a", 1);
        let naa = |h: &mut scsi_core::testing::Harness, lun: u16| {
            let mut c = vec![0u8; 6];
            c[0] = 0x12;
            c[1] = 1;
            c[2] = 0x83;
            c[4] = 255;
            let id = h.command(n, lun, &c, &[], 255);
            let mut a = [0u8; 8];
            a.copy_from_slice(&id.data[8..16]);
            a
        };
        let (naa0, naa1) = (naa(&mut h, 0), naa(&mut h, 1));
        // 3000 blocks: more than one chunk of the copy's buffer.
        let data = pattern(3000, 3);
        good(&h.command(n, 0, &cdb16(0x8a, 0, 0, 3000), &data, 0));
        // Nothing held yet.
        check(
            &h.command(n, 0, &copy_results_cdb(0, 5), &[], 1024),
            5,
            0x24,
            0x00,
        );
        // LUN 0 blocks 0.. to LUN 1 blocks 100.., then LUN 0 to itself, overlapping forward.
        let list = xcopy_list(
            5,
            &[naa0, naa1],
            &[(0, 1, 3000, 0, 100), (0, 0, 3000, 0, 10)],
        );
        good(&h.command(n, 0, &xcopy_cdb(list.len()), &list, 0));
        let r = h.command(n, 1, &cdb16(0x88, 0, 100, 3000), &[], 3000 * 512);
        assert!(r.data == data, "LUN 1 holds the copy");
        let r = h.command(n, 0, &cdb16(0x88, 0, 10, 3000), &[], 3000 * 512);
        assert!(r.data == data, "the overlapping copy on LUN 0 is intact");
        // The status is held for this nexus and list identifier.
        let st = h.command(n, 0, &copy_results_cdb(0, 5), &[], 1024);
        good(&st);
        assert_eq!(st.data[6], 2, "segments processed");
        assert_eq!(
            u32::from_be_bytes(st.data[8..12].try_into().unwrap()),
            2 * 3000 * 512
        );
        let other = h.login("iqn.x:b", 2);
        check(
            &h.command(other, 0, &copy_results_cdb(0, 5), &[], 1024),
            5,
            0x24,
            0x00,
        );
        let op = h.command(n, 0, &copy_results_cdb(3, 0), &[], 1024);
        good(&op);
        assert_eq!(&op.data[44..], &[0x02, 0xe4]);
        // An empty list does nothing; a unit this target does not have aborts the copy.
        good(&h.command(n, 0, &xcopy_cdb(0), &[], 0));
        let list = xcopy_list(6, &[[0x3f; 8]], &[(0, 0, 8, 0, 0)]);
        check(
            &h.command(n, 0, &xcopy_cdb(list.len()), &list, 0),
            0x0a,
            0x08,
            0x04,
        );
    }
}
