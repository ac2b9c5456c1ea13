//! Property tests: encode -> decode -> encode is the identity for every PDU type, with and
//! without digests; arbitrary bytes never make the decoder or the deframer panic.

use bytes::{Bytes, BytesMut};
use iscsi_pdu::text::TextParams;
use iscsi_pdu::*;
use proptest::prelude::*;

fn data(max: usize) -> impl Strategy<Value = Bytes> {
    prop::collection::vec(any::<u8>(), 0..max).prop_map(Bytes::from)
}

fn sn() -> impl Strategy<Value = SerialNumber> {
    any::<u32>().prop_map(SerialNumber)
}

fn lun() -> impl Strategy<Value = Lun> {
    any::<[u8; 8]>().prop_map(Lun)
}

fn residual() -> impl Strategy<Value = Residual> {
    prop_oneof![
        Just(Residual::None),
        any::<u32>().prop_map(Residual::Underflow),
        any::<u32>().prop_map(Residual::Overflow),
    ]
}

fn stage() -> impl Strategy<Value = Stage> {
    (0u8..4).prop_map(Stage::from_bits)
}

/// Transit and continue, never both.
fn t_c() -> impl Strategy<Value = (bool, bool)> {
    prop_oneof![
        Just((false, false)),
        Just((true, false)),
        Just((false, true))
    ]
}

prop_compose! {
    fn nop_out()(immediate in any::<bool>(), lun in lun(), itt in any::<u32>(), ttt in any::<u32>(),
                 cmd_sn in sn(), exp in sn(), data in data(64)) -> Pdu {
        Pdu::NopOut(NopOut { immediate, lun, initiator_task_tag: itt, target_transfer_tag: ttt,
            cmd_sn, exp_stat_sn: exp, data })
    }
}

prop_compose! {
    fn nop_in()(lun in lun(), itt in any::<u32>(), ttt in any::<u32>(), s in sn(), e in sn(), m in sn(),
                data in data(64)) -> Pdu {
        Pdu::NopIn(NopIn { lun, initiator_task_tag: itt, target_transfer_tag: ttt, stat_sn: s,
            exp_cmd_sn: e, max_cmd_sn: m, data })
    }
}

prop_compose! {
    fn scsi_command()(flags in any::<(bool, bool, bool, bool)>(), attr in 0u8..8, lun in lun(),
                      itt in any::<u32>(), edtl in any::<u32>(), c in sn(), e in sn(),
                      cdb in any::<[u8; 16]>(),
                      ext in prop::option::of(prop::collection::vec(any::<u8>(), 0..260)),
                      bidi in prop::option::of(any::<u32>()), data in data(300)) -> Pdu {
        Pdu::ScsiCommand(ScsiCommand { immediate: flags.0, final_bit: flags.1, read: flags.2,
            write: flags.3, task_attribute: TaskAttribute::from_bits(attr), lun,
            initiator_task_tag: itt, expected_data_transfer_length: edtl, cmd_sn: c,
            exp_stat_sn: e, cdb, extended_cdb: ext.map(Bytes::from),
            bidirectional_read_length: bidi, data })
    }
}

prop_compose! {
    fn scsi_response()(bidi in residual(), res in residual(), response in any::<u8>(),
                       status in any::<u8>(), w in any::<[u32; 6]>(), data in data(100)) -> Pdu {
        Pdu::ScsiResponse(ScsiResponse { bidirectional_read_residual: bidi, residual: res,
            response: response.into(), status: ScsiStatus(status), initiator_task_tag: w[0],
            snack_tag: w[1], stat_sn: SerialNumber(w[2]), exp_cmd_sn: SerialNumber(w[3]),
            max_cmd_sn: SerialNumber(w[4]), exp_data_sn: w[5], data })
    }
}

prop_compose! {
    fn tmf_request()(immediate in any::<bool>(), f in 0u8..128, lun in lun(), w in any::<[u32; 6]>()) -> Pdu {
        Pdu::TaskManagementRequest(TaskManagementRequest { immediate, function: f.into(), lun,
            initiator_task_tag: w[0], referenced_task_tag: w[1], cmd_sn: SerialNumber(w[2]),
            exp_stat_sn: SerialNumber(w[3]), ref_cmd_sn: SerialNumber(w[4]), exp_data_sn: w[5] })
    }
}

prop_compose! {
    fn tmf_response()(r in any::<u8>(), w in any::<[u32; 4]>(), info in any::<[u8; 3]>()) -> Pdu {
        Pdu::TaskManagementResponse(TaskManagementResponse { response: r.into(),
            initiator_task_tag: w[0], stat_sn: SerialNumber(w[1]), exp_cmd_sn: SerialNumber(w[2]),
            max_cmd_sn: SerialNumber(w[3]), additional_response_information: info })
    }
}

prop_compose! {
    fn login_request()(tc in t_c(), csg in stage(), nsg in stage(), v in any::<(u8, u8)>(),
                       isid in any::<[u8; 6]>(), tsih in any::<u16>(), itt in any::<u32>(),
                       cid in any::<u16>(), c in sn(), e in sn(), data in data(200)) -> Pdu {
        Pdu::LoginRequest(LoginRequest { transit: tc.0, continue_bit: tc.1, current_stage: csg,
            next_stage: nsg, version_max: v.0, version_min: v.1, isid: Isid(isid), tsih,
            initiator_task_tag: itt, cid, cmd_sn: c, exp_stat_sn: e, data })
    }
}

prop_compose! {
    fn login_response()(tc in t_c(), csg in stage(), nsg in stage(), v in any::<(u8, u8)>(),
                        isid in any::<[u8; 6]>(), tsih in any::<u16>(), w in any::<[u32; 4]>(),
                        status in any::<u16>(), data in data(200)) -> Pdu {
        Pdu::LoginResponse(LoginResponse { transit: tc.0, continue_bit: tc.1, current_stage: csg,
            next_stage: nsg, version_max: v.0, version_active: v.1, isid: Isid(isid), tsih,
            initiator_task_tag: w[0], stat_sn: SerialNumber(w[1]), exp_cmd_sn: SerialNumber(w[2]),
            max_cmd_sn: SerialNumber(w[3]), status: LoginStatus(status), data })
    }
}

prop_compose! {
    fn text_request()(immediate in any::<bool>(), fc in t_c(), lun in lun(), w in any::<[u32; 4]>(),
                      data in data(200)) -> Pdu {
        Pdu::TextRequest(TextRequest { immediate, final_bit: fc.0, continue_bit: fc.1, lun,
            initiator_task_tag: w[0], target_transfer_tag: w[1], cmd_sn: SerialNumber(w[2]),
            exp_stat_sn: SerialNumber(w[3]), data })
    }
}

prop_compose! {
    fn text_response()(fc in t_c(), lun in lun(), w in any::<[u32; 5]>(), data in data(200)) -> Pdu {
        Pdu::TextResponse(TextResponse { final_bit: fc.0, continue_bit: fc.1, lun,
            initiator_task_tag: w[0], target_transfer_tag: w[1], stat_sn: SerialNumber(w[2]),
            exp_cmd_sn: SerialNumber(w[3]), max_cmd_sn: SerialNumber(w[4]), data })
    }
}

prop_compose! {
    fn data_out()(f in any::<bool>(), lun in lun(), w in any::<[u32; 5]>(), data in data(300)) -> Pdu {
        Pdu::DataOut(DataOut { final_bit: f, lun, initiator_task_tag: w[0], target_transfer_tag: w[1],
            exp_stat_sn: SerialNumber(w[2]), data_sn: w[3], buffer_offset: w[4], data })
    }
}

prop_compose! {
    fn data_in()(f in any::<bool>(), a in any::<bool>(),
                 status in prop::option::of((any::<u8>(), sn(), residual())), lun in lun(),
                 w in any::<[u32; 6]>(), data in data(300)) -> Pdu {
        let status = status.map(|(s, sn, r)| DataInStatus { status: ScsiStatus(s), stat_sn: sn, residual: r });
        // The S bit implies the F bit.
        let final_bit = f || status.is_some();
        Pdu::DataIn(DataIn { final_bit, acknowledge: a, status, lun, initiator_task_tag: w[0],
            target_transfer_tag: w[1], exp_cmd_sn: SerialNumber(w[2]), max_cmd_sn: SerialNumber(w[3]),
            data_sn: w[4], buffer_offset: w[5], data })
    }
}

prop_compose! {
    fn logout_request()(immediate in any::<bool>(), reason in 0u8..128, itt in any::<u32>(),
                        cid in any::<u16>(), c in sn(), e in sn()) -> Pdu {
        Pdu::LogoutRequest(LogoutRequest { immediate, reason: reason.into(), initiator_task_tag: itt,
            cid, cmd_sn: c, exp_stat_sn: e })
    }
}

prop_compose! {
    fn logout_response()(r in any::<u8>(), w in any::<[u32; 4]>(), t in any::<(u16, u16)>()) -> Pdu {
        Pdu::LogoutResponse(LogoutResponse { response: r.into(), initiator_task_tag: w[0],
            stat_sn: SerialNumber(w[1]), exp_cmd_sn: SerialNumber(w[2]), max_cmd_sn: SerialNumber(w[3]),
            time2wait: t.0, time2retain: t.1 })
    }
}

prop_compose! {
    fn snack()(t in 0u8..16, lun in lun(), w in any::<[u32; 5]>()) -> Pdu {
        Pdu::SnackRequest(SnackRequest { snack_type: t.into(), lun, initiator_task_tag: w[0],
            target_transfer_tag: w[1], exp_stat_sn: SerialNumber(w[2]), beg_run: w[3], run_length: w[4] })
    }
}

prop_compose! {
    fn r2t()(lun in lun(), w in any::<[u32; 7]>(), desired in 1u32..) -> Pdu {
        Pdu::ReadyToTransfer(ReadyToTransfer { lun, initiator_task_tag: w[0], target_transfer_tag: w[1],
            stat_sn: SerialNumber(w[2]), exp_cmd_sn: SerialNumber(w[3]), max_cmd_sn: SerialNumber(w[4]),
            r2t_sn: w[5], buffer_offset: w[6], desired_data_transfer_length: desired })
    }
}

prop_compose! {
    fn async_message()(lun in lun(), w in any::<[u32; 3]>(), ev in any::<(u8, u8)>(),
                       p in any::<(u16, u16, u16)>(), data in data(100)) -> Pdu {
        Pdu::AsyncMessage(AsyncMessage { lun, stat_sn: SerialNumber(w[0]), exp_cmd_sn: SerialNumber(w[1]),
            max_cmd_sn: SerialNumber(w[2]), event: ev.0.into(), vcode: ev.1, parameter1: p.0,
            parameter2: p.1, parameter3: p.2, data })
    }
}

prop_compose! {
    fn reject()(reason in any::<u8>(), w in any::<[u32; 4]>(), data in data(100)) -> Pdu {
        Pdu::Reject(Reject { reason: reason.into(), stat_sn: SerialNumber(w[0]),
            exp_cmd_sn: SerialNumber(w[1]), max_cmd_sn: SerialNumber(w[2]), data_sn_or_r2t_sn: w[3], data })
    }
}

fn any_pdu() -> impl Strategy<Value = Pdu> {
    prop_oneof![
        nop_out(),
        nop_in(),
        scsi_command(),
        scsi_response(),
        tmf_request(),
        tmf_response(),
        login_request(),
        login_response(),
        text_request(),
        text_response(),
        data_out(),
        data_in(),
        logout_request(),
        logout_response(),
        snack(),
        r2t(),
        async_message(),
        reject(),
    ]
}

fn digests() -> impl Strategy<Value = Digests> {
    any::<(bool, bool)>().prop_map(|(header, data)| Digests { header, data })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2000))]

    #[test]
    fn encode_decode_encode_is_identity(pdu in any_pdu(), digests in digests()) {
        let mut first = BytesMut::new();
        pdu.encode(digests, &mut first);
        let first = first.freeze();
        let mut input = first.clone();
        let decoded = Pdu::decode(&mut input, digests, MAX_DATA_SEGMENT_LENGTH).expect("own encoding decodes");
        prop_assert!(input.is_empty(), "consumed the whole PDU");
        prop_assert_eq!(&decoded, &pdu);
        let mut second = BytesMut::new();
        decoded.encode(digests, &mut second);
        prop_assert_eq!(&first[..], &second[..]);
    }

    #[test]
    fn arbitrary_bytes_never_panic(bytes in prop::collection::vec(any::<u8>(), 0..400),
                                   digests in digests(), limit in 0u32..2048) {
        let mut input = Bytes::from(bytes);
        let before = input.len();
        let result = Pdu::decode(&mut input, digests, limit);
        match &result {
            Err(DecodeError::Incomplete { .. }) => prop_assert_eq!(input.len(), before),
            Err(e) if e.is_fatal() => prop_assert_eq!(input.len(), before),
            _ => prop_assert!(input.len() < before),
        }
        if let Ok(d) = result {
            // Whatever decodes re-encodes and decodes to the same PDU.
            let mut again = BytesMut::new();
            d.encode(digests, &mut again);
            let again = Pdu::decode(&mut again.freeze(), digests, MAX_DATA_SEGMENT_LENGTH).unwrap();
            prop_assert_eq!(again, d);
        }
    }

    #[test]
    fn deframer_survives_arbitrary_streams(bytes in prop::collection::vec(any::<u8>(), 0..2000),
                                           chunk in 1usize..300, digests in digests()) {
        let mut d = Deframer::new();
        d.set_digests(digests);
        'outer: for c in bytes.chunks(chunk) {
            d.feed(c);
            loop {
                match d.next_pdu() {
                    Ok(Some(_)) => {}
                    Ok(None) => break,
                    Err(e) if e.is_fatal() => break 'outer,
                    Err(_) => {}
                }
            }
        }
    }

    #[test]
    fn text_parse_never_panics_and_round_trips(bytes in prop::collection::vec(any::<u8>(), 0..300)) {
        if let Ok(t) = TextParams::parse(&bytes) {
            prop_assert_eq!(TextParams::parse(&t.encode()).unwrap(), t);
        }
    }
}
