//! Every information unit survives encode then decode unchanged, and decoding arbitrary bytes
//! never panics and, when it succeeds, gives an IU that encodes back to an equal one.

use proptest::prelude::*;
use scsi_core::Residual;
use srp::iu::*;
use srp::Iu;

fn descriptor() -> impl Strategy<Value = MemoryDescriptor> {
    (any::<u64>(), any::<u32>(), any::<u32>()).prop_map(|(va, key, len)| MemoryDescriptor {
        va,
        key,
        len,
    })
}

fn residual() -> impl Strategy<Value = Residual> {
    prop_oneof![
        Just(Residual::None),
        any::<u32>().prop_map(Residual::Overflow),
        any::<u32>().prop_map(Residual::Underflow),
    ]
}

/// A data buffer descriptor of one direction, over `list` (bytes of whole descriptors) when
/// indirect; `extra` more descriptors are in the table than in the IU (a partial table).
fn buffer(
    kind: u8,
    d: MemoryDescriptor,
    list: &[u8],
    extra: u32,
    total: u32,
    out: bool,
) -> DataBufferDescriptor<'_> {
    match kind % 4 {
        0 => DataBufferDescriptor::None,
        1 => DataBufferDescriptor::Direct(d),
        2 => DataBufferDescriptor::Indirect {
            table: MemoryDescriptor {
                len: list.len() as u32 + 16 * (extra % 8) + if list.is_empty() { 16 } else { 0 },
                ..d
            },
            total_len: total,
            partial: Descriptors::new(list).expect("whole descriptors"),
        },
        _ if out => DataBufferDescriptor::Immediate { len: total },
        _ => DataBufferDescriptor::None,
    }
}

proptest! {
    #[test]
    fn srp_cmd_round_trips(
        tag in any::<u64>(), lun in any::<u64>(), sol_not in any::<u8>(),
        attr in 0u8..4, cdb_words in 0usize..8, seed in any::<u8>(),
        out_kind in any::<u8>(), in_kind in any::<u8>(),
        d in descriptor(), e in descriptor(),
        out_list in proptest::collection::vec(descriptor(), 0..40),
        in_list in proptest::collection::vec(descriptor(), 0..40),
        extra in any::<u32>(), total in any::<u32>(),
    ) {
        let cdb: Vec<u8> = (0..16 + 4 * cdb_words).map(|i| seed.wrapping_add(i as u8)).collect();
        let mut ob = Vec::new();
        out_list.iter().for_each(|d| d.encode(&mut ob));
        let mut ib = Vec::new();
        in_list.iter().for_each(|d| d.encode(&mut ib));
        let attribute = [TaskAttribute::Simple, TaskAttribute::HeadOfQueue, TaskAttribute::Ordered, TaskAttribute::Aca][attr as usize];
        let c = SrpCmd {
            sol_not, tag, lun, task_attribute: attribute, cdb: &cdb,
            data_out: buffer(out_kind, d, &ob, extra, total, true),
            data_in: buffer(in_kind, e, &ib, extra, total, false),
        };
        let mut b = Vec::new();
        c.encode(&mut b);
        prop_assert_eq!(b.len(), c.encoded_len());
        prop_assert_eq!(Iu::decode(&b), Ok(Iu::Cmd(c)));
    }

    #[test]
    fn srp_rsp_round_trips(
        tag in any::<u64>(), delta in any::<u32>(), status in any::<u8>(), sol_not in any::<u8>(),
        dout in residual(), din in residual(),
        response in proptest::collection::vec(any::<u8>(), 0..8),
        sense in proptest::collection::vec(any::<u8>(), 0..252),
    ) {
        let r = SrpRsp { sol_not, req_lim_delta: delta, tag, status, data_out_residual: dout, data_in_residual: din, response_data: &response, sense: &sense };
        let mut b = Vec::new();
        r.encode(&mut b);
        prop_assert_eq!(b.len(), r.encoded_len());
        prop_assert_eq!(Iu::decode(&b), Ok(Iu::Rsp(r)));
    }

    #[test]
    fn login_ius_round_trip(
        tag in any::<u64>(), len in any::<u32>(), fmt in any::<u16>(), multi in any::<bool>(),
        imm in any::<bool>(), offset in any::<u16>(), ini in any::<[u8; 16]>(), tgt in any::<[u8; 16]>(),
        delta in any::<u32>(), ti in any::<u32>(), result in 0u8..3, reason in any::<u32>(),
    ) {
        let req = SrpLoginReq {
            tag, req_it_iu_len: len, req_buf_fmt: BufferFormats(fmt),
            multi_channel: if multi { MultiChannelAction::MultiChannel } else { MultiChannelAction::SingleChannel },
            immediate_data: imm, imm_data_offset: offset, initiator_port_id: ini, target_port_id: tgt,
        };
        let rsp = SrpLoginRsp {
            req_lim_delta: delta, tag, max_it_iu_len: len, max_ti_iu_len: ti, sup_buf_fmt: BufferFormats(fmt),
            multi_channel: [MultiChannelResult::NoExistingChannels, MultiChannelResult::Terminated, MultiChannelResult::Maintained][result as usize],
            immediate_data: imm,
        };
        let rej = SrpLoginRej { reason: LoginRejectReason::from_code(reason), tag, sup_buf_fmt: BufferFormats(fmt) };
        let mut cm = Vec::new();
        req.encode_rdma_cm(&mut cm);
        prop_assert_eq!(cm.len(), srp::iu::RDMA_CM_LOGIN_LEN);
        prop_assert_eq!(SrpLoginReq::decode_rdma_cm(&cm), Ok(req));
        for iu in [Iu::LoginReq(req), Iu::LoginRsp(rsp), Iu::LoginRej(rej)] {
            let mut b = Vec::new();
            iu.encode(&mut b);
            prop_assert_eq!(b.len(), iu.iu_type().fixed_len());
            prop_assert_eq!(Iu::decode(&b), Ok(iu));
        }
    }

    #[test]
    fn the_small_ius_round_trip(
        tag in any::<u64>(), lun in any::<u64>(), task_tag in any::<u64>(), function in any::<u8>(),
        sol_not in any::<u8>(), delta in any::<u32>(), reason in any::<u32>(),
        sense in proptest::collection::vec(any::<u8>(), 0..64),
    ) {
        let ius = [
            Iu::ILogout(SrpILogout { tag }),
            Iu::TLogout(SrpTLogout { sol_not, reason: TargetLogoutReason::from_code(reason), tag }),
            Iu::TskMgmt(SrpTskMgmt { sol_not, tag, lun, function: TaskManagementFunction::from_code(function), task_tag }),
            Iu::CredReq(SrpCredReq { sol_not, req_lim_delta: delta, tag }),
            Iu::CredRsp(SrpCredRsp { tag }),
            Iu::AerReq(SrpAerReq { sol_not, req_lim_delta: delta, tag, lun, sense: &sense }),
            Iu::AerRsp(SrpAerRsp { tag }),
        ];
        for iu in ius {
            let mut b = Vec::new();
            iu.encode(&mut b);
            prop_assert_eq!(Iu::decode(&b), Ok(iu));
        }
    }

    #[test]
    fn arbitrary_bytes_decode_or_fail_cleanly(b in proptest::collection::vec(any::<u8>(), 0..700)) {
        if let Ok(iu) = Iu::decode(&b) {
            let mut again = Vec::new();
            iu.encode(&mut again);
            prop_assert_eq!(Iu::decode(&again), Ok(iu));
        }
    }
}
