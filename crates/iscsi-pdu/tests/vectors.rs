//! Every PDU from hand-assembled bytes (RFC 7143 chapter 11 layouts): decode gives the typed PDU,
//! encode gives the bytes back. Plus the error paths a peer can provoke.

use bytes::{Bytes, BytesMut};
use iscsi_pdu::*;

/// Hex with any whitespace and `|` separators.
fn hex(s: &str) -> Vec<u8> {
    let digits: Vec<u8> = s.bytes().filter(u8::is_ascii_hexdigit).collect();
    digits
        .chunks(2)
        .map(|p| u8::from_str_radix(std::str::from_utf8(p).unwrap(), 16).unwrap())
        .collect()
}

fn check(bytes: Vec<u8>, expected: Pdu) {
    let mut input = Bytes::from(bytes.clone());
    let decoded = Pdu::decode(&mut input, Digests::NONE, MAX_DATA_SEGMENT_LENGTH).expect("decodes");
    assert!(input.is_empty(), "consumed the whole PDU");
    assert_eq!(decoded, expected);
    let mut out = BytesMut::new();
    expected.encode(Digests::NONE, &mut out);
    assert_eq!(&out[..], &bytes[..], "encodes to the same bytes");
}

const ZERO16: &str = "00000000 00000000 00000000 00000000";

#[test]
fn nop_out_and_nop_in() {
    let b = hex(&format!(
        "40 80 0000 | 00 000004 | 0001000000000000 | 11223344 | ffffffff | 00000005 | 00000006 | {ZERO16} | 70696e67"
    ));
    check(
        b,
        Pdu::NopOut(NopOut {
            immediate: true,
            lun: Lun::from_index(1),
            initiator_task_tag: 0x1122_3344,
            target_transfer_tag: RESERVED_TAG,
            cmd_sn: SerialNumber(5),
            exp_stat_sn: SerialNumber(6),
            data: Bytes::from_static(b"ping"),
        }),
    );
    let b = hex(&format!(
        "20 80 0000 | 00 000000 | 0000000000000000 | ffffffff | 0000abcd | 00000007 | 00000008 | 00000048 | {}",
        "00000000 00000000 00000000"
    ));
    check(
        b,
        Pdu::NopIn(NopIn {
            lun: Lun::ZERO,
            initiator_task_tag: RESERVED_TAG,
            target_transfer_tag: 0xabcd,
            stat_sn: SerialNumber(7),
            exp_cmd_sn: SerialNumber(8),
            max_cmd_sn: SerialNumber(72),
            data: Bytes::new(),
        }),
    );
}

#[test]
fn scsi_command_read10_from_rfc_appendix_b4() {
    let b = hex(
        "01c00000 00000000 00000000 00000000 14000000 00000400 00000014 00000018
         28000000 00000000 02000000 00000000",
    );
    let mut cdb = [0u8; 16];
    cdb[0] = 0x28;
    cdb[8] = 0x02;
    let pdu = Pdu::ScsiCommand(ScsiCommand {
        immediate: false,
        final_bit: true,
        read: true,
        write: false,
        task_attribute: TaskAttribute::Untagged,
        lun: Lun::ZERO,
        initiator_task_tag: 0x1400_0000,
        expected_data_transfer_length: 1024,
        cmd_sn: SerialNumber(0x14),
        exp_stat_sn: SerialNumber(0x18),
        cdb,
        extended_cdb: None,
        bidirectional_read_length: None,
        data: Bytes::new(),
    });
    check(b.clone(), pdu.clone());
    // With a header digest, the digest is the appendix's value.
    let mut out = BytesMut::new();
    pdu.encode(
        Digests {
            header: true,
            data: false,
        },
        &mut out,
    );
    assert_eq!(&out[48..], &[0x56, 0x3a, 0x96, 0xd9]);
}

#[test]
fn scsi_command_with_extended_cdb_bidi_ahs_and_immediate_data() {
    let ext: Vec<u8> = (16u8..32).collect();
    let b = hex(&format!(
        "01 e1 0000 | 07 000003 | 0000000000000000 | 00000001 | 00000200 | 00000002 | 00000003 | {}
         | 0011 01 00 {} | 0005 02 00 00001000 | 616263 00",
        "7f000000 00000000 00000000 00000000",
        ext.iter().map(|b| format!("{b:02x}")).collect::<String>()
    ));
    let mut cdb = [0u8; 16];
    cdb[0] = 0x7f;
    check(
        b,
        Pdu::ScsiCommand(ScsiCommand {
            immediate: false,
            final_bit: true,
            read: true,
            write: true,
            task_attribute: TaskAttribute::Simple,
            lun: Lun::ZERO,
            initiator_task_tag: 1,
            expected_data_transfer_length: 512,
            cmd_sn: SerialNumber(2),
            exp_stat_sn: SerialNumber(3),
            cdb,
            extended_cdb: Some(Bytes::from(ext)),
            bidirectional_read_length: Some(4096),
            data: Bytes::from_static(b"abc"),
        }),
    );
}

#[test]
fn scsi_response_with_sense_and_residual() {
    let sense = hex("70 00 05 00 00 00 00 0a 00 00 00 00 24 00 00 00 00 00");
    let b = hex(&format!(
        "21 82 00 02 | 00 000014 | 0000000000000000 | 00000009 | 00000000 | 00000010 | 00000011 | 00000090
         | 00000000 | 00000000 | 00000200 | 0012 {}",
        sense.iter().map(|b| format!("{b:02x}")).collect::<String>()
    ));
    let data = ScsiResponse::sense_segment(&sense);
    let pdu = ScsiResponse {
        bidirectional_read_residual: Residual::None,
        residual: Residual::Underflow(512),
        response: ScsiResponseCode::CommandCompleted,
        status: ScsiStatus::CHECK_CONDITION,
        initiator_task_tag: 9,
        snack_tag: 0,
        stat_sn: SerialNumber(0x10),
        exp_cmd_sn: SerialNumber(0x11),
        max_cmd_sn: SerialNumber(0x90),
        exp_data_sn: 0,
        data,
    };
    assert_eq!(pdu.sense().unwrap(), Bytes::from(sense));
    check(b, Pdu::ScsiResponse(pdu));
}

#[test]
fn task_management_request_and_response() {
    let b = hex(
        "42 81 0000 | 00 000000 | 0002000000000000 | 00000020 | 00000007 | 00000030 | 00000031 | 00000029
         | 00000000 | 00000000 00000000",
    );
    check(
        b,
        Pdu::TaskManagementRequest(TaskManagementRequest {
            immediate: true,
            function: TaskManagementFunction::AbortTask,
            lun: Lun::from_index(2),
            initiator_task_tag: 0x20,
            referenced_task_tag: 7,
            cmd_sn: SerialNumber(0x30),
            exp_stat_sn: SerialNumber(0x31),
            ref_cmd_sn: SerialNumber(0x29),
            exp_data_sn: 0,
        }),
    );
    let b = hex(
        "22 80 07 00 | 00 000000 | 0000000000000000 | 00000020 | 00000000 | 00000040 | 00000032 | 000000b1
         | 06290000 | 00000000 00000000",
    );
    check(
        b,
        Pdu::TaskManagementResponse(TaskManagementResponse {
            response: TmfResponse::FunctionSucceeded,
            initiator_task_tag: 0x20,
            stat_sn: SerialNumber(0x40),
            exp_cmd_sn: SerialNumber(0x32),
            max_cmd_sn: SerialNumber(0xb1),
            additional_response_information: [0x06, 0x29, 0x00],
        }),
    );
}

#[test]
fn login_request_and_response() {
    let text = b"SessionType=Normal\0";
    let b = hex(&format!(
        "43 87 00 00 | 00 {:06x} | 80123456789a 0000 | 00000001 | 0001 0000 | 00000001 | 00000000 | {ZERO16} | {} 00",
        text.len(),
        text.iter().map(|b| format!("{b:02x}")).collect::<String>()
    ));
    check(
        b,
        Pdu::LoginRequest(LoginRequest {
            transit: true,
            continue_bit: false,
            current_stage: Stage::LoginOperationalNegotiation,
            next_stage: Stage::FullFeaturePhase,
            version_max: 0,
            version_min: 0,
            isid: Isid([0x80, 0x12, 0x34, 0x56, 0x78, 0x9a]),
            tsih: 0,
            initiator_task_tag: 1,
            cid: 1,
            cmd_sn: SerialNumber(1),
            exp_stat_sn: SerialNumber(0),
            data: Bytes::from_static(text),
        }),
    );
    let b = hex(
        "23 00 00 00 | 00 000000 | 80123456789a 0005 | 00000001 | 00000000 | 00000000 | 00000001 | 00000001
         | 0201 0000 | 00000000 00000000",
    );
    let r = LoginResponse {
        transit: false,
        continue_bit: false,
        current_stage: Stage::SecurityNegotiation,
        next_stage: Stage::SecurityNegotiation,
        version_max: 0,
        version_active: 0,
        isid: Isid([0x80, 0x12, 0x34, 0x56, 0x78, 0x9a]),
        tsih: 5,
        initiator_task_tag: 1,
        stat_sn: SerialNumber(0),
        exp_cmd_sn: SerialNumber(1),
        max_cmd_sn: SerialNumber(1),
        status: LoginStatus::AUTHENTICATION_FAILURE,
        data: Bytes::new(),
    };
    assert_eq!(r.status.class(), LoginStatusClass::InitiatorError);
    check(b, Pdu::LoginResponse(r));
}

#[test]
fn text_request_and_response() {
    let b = hex(&format!(
        "44 80 0000 | 00 000010 | 0000000000000000 | 00000003 | ffffffff | 00000004 | 00000005 | {ZERO16}
         | 53656e645461726765747 33d416c6c00"
    ));
    check(
        b,
        Pdu::TextRequest(TextRequest {
            immediate: true,
            final_bit: true,
            continue_bit: false,
            lun: Lun::ZERO,
            initiator_task_tag: 3,
            target_transfer_tag: RESERVED_TAG,
            cmd_sn: SerialNumber(4),
            exp_stat_sn: SerialNumber(5),
            data: Bytes::from_static(b"SendTargets=All\0"),
        }),
    );
    let b = hex(
        "24 40 0000 | 00 000000 | 0000000000000000 | 00000003 | 00000099 | 00000005 | 00000005 | 00000014
         | 00000000 00000000 00000000",
    );
    check(
        b,
        Pdu::TextResponse(TextResponse {
            final_bit: false,
            continue_bit: true,
            lun: Lun::ZERO,
            initiator_task_tag: 3,
            target_transfer_tag: 0x99,
            stat_sn: SerialNumber(5),
            exp_cmd_sn: SerialNumber(5),
            max_cmd_sn: SerialNumber(0x14),
            data: Bytes::new(),
        }),
    );
}

#[test]
fn data_out_and_data_in() {
    let b = hex(
        "05 80 0000 | 00 000004 | 0000000000000000 | 0000000a | 0000000b | 00000000 | 0000000c | 00000000
         | 00000002 | 00002000 | 00000000 | deadbeef",
    );
    check(
        b,
        Pdu::DataOut(DataOut {
            final_bit: true,
            lun: Lun::ZERO,
            initiator_task_tag: 0xa,
            target_transfer_tag: 0xb,
            exp_stat_sn: SerialNumber(0xc),
            data_sn: 2,
            buffer_offset: 0x2000,
            data: Bytes::from_static(&[0xde, 0xad, 0xbe, 0xef]),
        }),
    );
    // Final Data-In with phase-collapsed status and an underflow.
    let b = hex(
        "25 83 00 00 | 00 000002 | 0000000000000000 | 0000000a | ffffffff | 00000021 | 00000022 | 00000062
         | 00000003 | 00003000 | 00000100 | abcd 0000",
    );
    check(
        b,
        Pdu::DataIn(DataIn {
            final_bit: true,
            acknowledge: false,
            status: Some(DataInStatus {
                status: ScsiStatus::GOOD,
                stat_sn: SerialNumber(0x21),
                residual: Residual::Underflow(0x100),
            }),
            lun: Lun::ZERO,
            initiator_task_tag: 0xa,
            target_transfer_tag: RESERVED_TAG,
            exp_cmd_sn: SerialNumber(0x22),
            max_cmd_sn: SerialNumber(0x62),
            data_sn: 3,
            buffer_offset: 0x3000,
            data: Bytes::from_static(&[0xab, 0xcd]),
        }),
    );
}

#[test]
fn logout_request_and_response() {
    let b = hex(&format!(
        "46 81 0000 | 00 000000 | 0000000000000000 | 00000044 | 0002 0000 | 00000009 | 0000000a | {ZERO16}"
    ));
    check(
        b,
        Pdu::LogoutRequest(LogoutRequest {
            immediate: true,
            reason: LogoutReason::CloseConnection,
            initiator_task_tag: 0x44,
            cid: 2,
            cmd_sn: SerialNumber(9),
            exp_stat_sn: SerialNumber(10),
        }),
    );
    let b = hex(
        "26 80 00 00 | 00 000000 | 0000000000000000 | 00000044 | 00000000 | 0000000a | 0000000a | 0000004a
         | 00000000 | 0002 0014 | 00000000",
    );
    check(
        b,
        Pdu::LogoutResponse(LogoutResponse {
            response: LogoutResponseCode::ClosedSuccessfully,
            initiator_task_tag: 0x44,
            stat_sn: SerialNumber(10),
            exp_cmd_sn: SerialNumber(10),
            max_cmd_sn: SerialNumber(0x4a),
            time2wait: 2,
            time2retain: 20,
        }),
    );
}

#[test]
fn snack_r2t_async_reject() {
    let b = hex(
        "10 81 0000 | 00 000000 | 0000000000000000 | ffffffff | ffffffff | 00000000 | 00000007 | 00000000
         | 00000000 | 00000005 | 00000000",
    );
    check(
        b,
        Pdu::SnackRequest(SnackRequest {
            snack_type: SnackType::Status,
            lun: Lun::ZERO,
            initiator_task_tag: RESERVED_TAG,
            target_transfer_tag: RESERVED_TAG,
            exp_stat_sn: SerialNumber(7),
            beg_run: 5,
            run_length: 0,
        }),
    );
    let b = hex(
        "31 80 0000 | 00 000000 | 0000000000000000 | 0000000a | 00000100 | 00000021 | 00000022 | 00000062
         | 00000001 | 00040000 | 00040000",
    );
    check(
        b,
        Pdu::ReadyToTransfer(ReadyToTransfer {
            lun: Lun::ZERO,
            initiator_task_tag: 0xa,
            target_transfer_tag: 0x100,
            stat_sn: SerialNumber(0x21),
            exp_cmd_sn: SerialNumber(0x22),
            max_cmd_sn: SerialNumber(0x62),
            r2t_sn: 1,
            buffer_offset: 0x40000,
            desired_data_transfer_length: 0x40000,
        }),
    );
    let b = hex(
        "32 80 0000 | 00 000000 | 0000000000000000 | ffffffff | 00000000 | 00000021 | 00000022 | 00000062
         | 01 00 0000 | 0000 000a | 00000000",
    );
    check(
        b,
        Pdu::AsyncMessage(AsyncMessage {
            lun: Lun::ZERO,
            stat_sn: SerialNumber(0x21),
            exp_cmd_sn: SerialNumber(0x22),
            max_cmd_sn: SerialNumber(0x62),
            event: AsyncEvent::LogoutRequested,
            vcode: 0,
            parameter1: 0,
            parameter2: 0,
            parameter3: 10,
            data: Bytes::new(),
        }),
    );
    let rejected = Pdu::NopOut(NopOut {
        initiator_task_tag: 1,
        ..Default::default()
    })
    .bhs();
    let b = hex(&format!(
        "3f 80 09 00 | 00 000030 | 0000000000000000 | ffffffff | 00000000 | 00000021 | 00000022 | 00000062
         | 00000000 | 00000000 00000000 | {}",
        rejected.0.iter().map(|b| format!("{b:02x}")).collect::<String>()
    ));
    let reject = Reject {
        reason: RejectReason::InvalidPduField,
        stat_sn: SerialNumber(0x21),
        exp_cmd_sn: SerialNumber(0x22),
        max_cmd_sn: SerialNumber(0x62),
        ..Reject::of(RejectReason::InvalidPduField, &rejected)
    };
    assert_eq!(reject.rejected_header(), Some(rejected));
    check(b, Pdu::Reject(reject));
}

fn encoded(pdu: &Pdu, digests: Digests) -> Vec<u8> {
    let mut out = BytesMut::new();
    pdu.encode(digests, &mut out);
    out.to_vec()
}

fn write10(data: &'static [u8]) -> Pdu {
    let mut cdb = [0u8; 16];
    cdb[0] = 0x2a;
    Pdu::ScsiCommand(ScsiCommand {
        final_bit: true,
        write: true,
        initiator_task_tag: 42,
        expected_data_transfer_length: data.len() as u32,
        cdb,
        data: Bytes::from_static(data),
        ..Default::default()
    })
}

#[test]
fn digests_round_trip_and_detect_corruption() {
    let pdu = write10(b"hello, target");
    let bytes = encoded(&pdu, Digests::BOTH);
    assert_eq!(bytes.len(), 48 + 4 + 16 + 4);
    let d = Pdu::decode(&mut Bytes::from(bytes.clone()), Digests::BOTH, 8192).unwrap();
    assert_eq!(d, pdu);

    // A flipped header bit: the header cannot be trusted, the connection must close.
    let mut bad = bytes.clone();
    bad[20] ^= 1;
    let e = Pdu::decode(&mut Bytes::from(bad), Digests::BOTH, 8192).unwrap_err();
    assert!(matches!(e, DecodeError::HeaderDigest { .. }) && e.is_fatal());

    // A flipped data bit: Reject with reason "data digest error", the stream goes on.
    let mut bad = bytes.clone();
    bad[55] ^= 1;
    let mut input = Bytes::from(bad);
    let e = Pdu::decode(&mut input, Digests::BOTH, 8192).unwrap_err();
    assert!(!e.is_fatal());
    assert!(input.is_empty(), "the rejected PDU is consumed");
    let (reason, header) = e.reject().unwrap();
    assert_eq!(reason, RejectReason::DataDigestError);
    assert_eq!(header.initiator_task_tag(), 42);

    // Padding is covered by the data digest too.
    let mut bad = bytes;
    bad[48 + 4 + 14] = 1;
    assert!(Pdu::decode(&mut Bytes::from(bad), Digests::BOTH, 8192).is_err());
}

#[test]
fn malformed_pdus_are_answered_with_reject() {
    let cases: Vec<(Vec<u8>, RejectReason)> = vec![
        // Vendor-specific and reserved opcodes.
        (
            hex(&format!("1c 80 0000 00000000 {ZERO16} {ZERO16} {ZERO16}")),
            RejectReason::CommandNotSupported,
        ),
        (
            hex(&format!("3c 80 0000 00000000 {ZERO16} {ZERO16} {ZERO16}")),
            RejectReason::CommandNotSupported,
        ),
        // An AHS on a NOP-Out.
        (
            hex(&format!(
                "00 80 0000 01000000 {ZERO16} {ZERO16} {ZERO16} 00010900"
            )),
            RejectReason::InvalidPduField,
        ),
        // Both residual flags on a SCSI Response.
        (
            hex(&format!("21 86 0000 00000000 {ZERO16} {ZERO16} {ZERO16}")),
            RejectReason::InvalidPduField,
        ),
        // T and C together on a Login Request.
        (
            hex(&format!("43 c1 0000 00000000 {ZERO16} {ZERO16} {ZERO16}")),
            RejectReason::InvalidPduField,
        ),
        // S without F on a Data-In.
        (
            hex(&format!("25 01 0000 00000000 {ZERO16} {ZERO16} {ZERO16}")),
            RejectReason::InvalidPduField,
        ),
        // An R2T for zero bytes.
        (
            hex(&format!("31 80 0000 00000000 {ZERO16} {ZERO16} {ZERO16}")),
            RejectReason::InvalidPduField,
        ),
        // A TMF request with data.
        (
            hex(&format!(
                "02 81 0000 00000004 {ZERO16} {ZERO16} {ZERO16} 00000000"
            )),
            RejectReason::InvalidPduField,
        ),
        // An unknown AHS type on a SCSI Command.
        (
            hex(&format!(
                "01 80 0000 01000000 {ZERO16} {ZERO16} {ZERO16} 00010900"
            )),
            RejectReason::InvalidPduField,
        ),
    ];
    for (bytes, reason) in cases {
        let e = Pdu::decode(&mut Bytes::from(bytes.clone()), Digests::NONE, 8192).unwrap_err();
        assert!(!e.is_fatal(), "{e}");
        assert_eq!(e.reject().unwrap().0, reason, "{e}");
        assert_eq!(e.reject().unwrap().1 .0[..], bytes[..48]);
    }
}

#[test]
fn deframer_refuses_oversized_segments_before_buffering_them() {
    let mut d = Deframer::new();
    d.set_max_recv_data_segment_length(8192);
    let mut header = encoded(&write10(b""), Digests::NONE);
    header[5..8].copy_from_slice(&[0x01, 0x00, 0x00]); // 64 KiB announced
    d.feed(&header);
    let e = d.next_pdu().unwrap_err();
    assert!(e.is_fatal());
    assert!(matches!(
        e,
        DecodeError::DataSegmentTooLong {
            length: 65536,
            limit: 8192,
            ..
        }
    ));
    assert_eq!(e.reject().unwrap().0, RejectReason::ProtocolError);
    // Nothing beyond the header was reserved for the segment.
    assert!(d.buffer_mut().capacity() < 1024);
}

#[test]
fn deframer_yields_pdus_at_any_split_and_continues_after_a_reject() {
    let pdus = [
        write10(b"0123456789"),
        Pdu::NopOut(NopOut {
            initiator_task_tag: 1,
            data: Bytes::from_static(b"x"),
            ..Default::default()
        }),
        Pdu::TextRequest(TextRequest {
            final_bit: true,
            data: Bytes::from_static(b"SendTargets=All\0"),
            ..Default::default()
        }),
    ];
    for digests in [Digests::NONE, Digests::BOTH] {
        let mut wire = Vec::new();
        for p in &pdus {
            wire.extend(encoded(p, digests));
        }
        // A vendor PDU in the middle is rejected and skipped.
        let mut vendor = encoded(&pdus[1], digests);
        vendor[0] = 0x1d;
        if digests.header {
            let crc = crc32c(&vendor[..48]).to_le_bytes();
            vendor[48..52].copy_from_slice(&crc);
        }
        let at = encoded(&pdus[0], digests).len();
        wire.splice(at..at, vendor);
        for split in 1..wire.len() {
            let mut d = Deframer::new();
            d.set_digests(digests);
            let mut got = Vec::new();
            let mut rejects = 0;
            for chunk in wire.chunks(split) {
                d.feed(chunk);
                loop {
                    match d.next_pdu() {
                        Ok(Some(p)) => got.push(p),
                        Ok(None) => break,
                        Err(e) => {
                            assert!(!e.is_fatal());
                            rejects += 1;
                        }
                    }
                }
            }
            assert_eq!(got, pdus, "split {split}");
            assert_eq!(rejects, 1);
            assert_eq!(d.buffered(), 0);
            assert_eq!(d.needed(), 48);
        }
    }
}

#[test]
fn header_only_encoding_matches_full_encoding() {
    let payload = Bytes::from(vec![0x5au8; 8191]);
    let full = Pdu::DataIn(DataIn {
        final_bit: true,
        initiator_task_tag: 5,
        target_transfer_tag: RESERVED_TAG,
        data: payload.clone(),
        ..Default::default()
    });
    let header_only = Pdu::DataIn(DataIn {
        data: Bytes::new(),
        ..match &full {
            Pdu::DataIn(d) => d.clone(),
            _ => unreachable!(),
        }
    });
    let mut hdr = BytesMut::new();
    header_only.encode_header(payload.len() as u32, true, &mut hdr);
    let mut vectored = hdr.to_vec();
    vectored.extend_from_slice(&payload[..4000]);
    vectored.extend_from_slice(&payload[4000..]);
    vectored.extend_from_slice(padding(payload.len()));
    vectored.extend_from_slice(&data_digest([&payload[..4000], &payload[4000..]]).to_le_bytes());
    assert_eq!(vectored, encoded(&full, Digests::BOTH));
}

#[test]
fn decode_reports_how_much_more_it_needs() {
    let bytes = encoded(&write10(b"0123456789"), Digests::NONE);
    let mut short = Bytes::copy_from_slice(&bytes[..10]);
    let e = Pdu::decode(&mut short, Digests::NONE, 8192).unwrap_err();
    assert_eq!(short.len(), 10, "nothing consumed");
    assert_eq!(e, DecodeError::Incomplete { needed: 38 });
    let e = Pdu::decode(
        &mut Bytes::copy_from_slice(&bytes[..50]),
        Digests::NONE,
        8192,
    )
    .unwrap_err();
    assert_eq!(e, DecodeError::Incomplete { needed: 10 });
}

#[test]
fn pdu_from_separately_received_parts() {
    let pdu = write10(b"0123456789");
    let bytes = encoded(&pdu, Digests::NONE);
    let header = Bhs(bytes[..48].try_into().unwrap());
    let data = Bytes::copy_from_slice(&bytes[48..58]);
    assert_eq!(
        Pdu::from_header_and_data(&header, Bytes::new(), data).unwrap(),
        pdu
    );
    assert!(Pdu::from_header_and_data(&header, Bytes::new(), Bytes::new()).is_err());
}
