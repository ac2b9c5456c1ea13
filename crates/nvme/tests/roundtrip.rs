//! Every PDU a controller or a host may send, framed with any digests and alignment and fed
//! to the other end's deframer in arbitrary pieces, comes out as it went in.

use nvme::sqe::{Sgl, Sqe};
use nvme::tcp::pdu::{data_digest, encode, DataHeader, Digests, Framing, Header, R2t};
use nvme::tcp::{Deframer, Limits, Side};
use nvme::{Cqe, Status};
use proptest::prelude::*;

fn header() -> impl Strategy<Value = Header> {
    prop_oneof![
        (any::<u16>(), any::<u32>(), any::<u32>()).prop_map(|(cid, nsid, len)| {
            let mut s = Sqe::new(0x01, cid);
            s.set_nsid(nsid);
            s.set_sgl(Sgl::in_capsule(0, len));
            Header::CapsuleCmd(s)
        }),
        (any::<u16>(), any::<u16>(), any::<u32>(), any::<bool>()).prop_map(
            |(cccid, ttag, datao, last)| Header::H2CData(DataHeader {
                cccid,
                ttag,
                datao,
                datal: 0,
                last,
                success: false,
            })
        ),
        (any::<u16>(), any::<u32>(), any::<bool>()).prop_map(|(cccid, datao, last)| {
            Header::C2HData(DataHeader {
                cccid,
                ttag: 0,
                datao,
                datal: 0,
                last,
                success: last,
            })
        }),
        (any::<u16>(), any::<u32>()).prop_map(|(cid, dw0)| Header::CapsuleResp(Cqe {
            dw0,
            ..Cqe::new(cid, Status::LBA_OUT_OF_RANGE)
        })),
        (any::<u16>(), any::<u16>(), any::<u32>(), any::<u32>()).prop_map(
            |(cccid, ttag, r2to, r2tl)| Header::R2T(R2t {
                cccid,
                ttag,
                r2to,
                r2tl
            })
        ),
    ]
}

proptest! {
    #[test]
    fn a_pdu_comes_out_as_it_went_in(
        header in header(),
        data in proptest::collection::vec(any::<u8>(), 0..3000),
        digests in (any::<bool>(), any::<bool>()),
        pda in 0u8..32,
        cuts in proptest::collection::vec(1usize..200, 1..40),
    ) {
        let digests = Digests { header: digests.0, data: digests.1 };
        let t = header.pdu_type();
        let data = if t.carries_data() { data } else { Vec::new() };
        // DATAL says how much data a data PDU has.
        let header = match header {
            Header::H2CData(d) => Header::H2CData(DataHeader { datal: data.len() as u32, ..d }),
            Header::C2HData(d) => Header::C2HData(DataHeader { datal: data.len() as u32, ..d }),
            h => h,
        };
        let framing = Framing { digests, pda };
        let e = encode(&header, data.len() as u32, &framing).unwrap();
        let mut wire = e.to_vec();
        wire.extend_from_slice(&data);
        if e.needs_data_digest() {
            wire.extend_from_slice(&data_digest([&data[..]]));
        }
        let side = if t.from_host() { Side::Controller } else { Side::Host };
        let mut d = Deframer::new(side);
        d.set_limits(Limits { digests, pda, max_data: 4096 });
        let mut at = 0;
        let mut got = None;
        for cut in cuts.iter().cycle() {
            if at >= wire.len() {
                break;
            }
            let end = (at + cut).min(wire.len());
            d.feed(&wire[at..end]);
            at = end;
            if let Some(p) = d.next_pdu().unwrap() {
                got = Some(p);
            }
        }
        let p = got.expect("the PDU");
        prop_assert_eq!(p.header, header);
        prop_assert_eq!(&p.data[..], &data[..]);
        prop_assert!(p.data_digest_ok);
        prop_assert_eq!(d.buffered(), 0);
    }
}
