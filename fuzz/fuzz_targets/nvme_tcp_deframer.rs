//! The NVMe/TCP deframer of either end, fed arbitrary bytes in arbitrary pieces under
//! arbitrary limits: it never panics, never holds more than one PDU's worth of bytes beyond
//! what it was fed at once, hands out no PDU with more data than the limits allow, every PDU
//! it hands out frames again under the same limits, and once it reports a fatal error it
//! keeps reporting it.
#![no_main]

use arbitrary::Arbitrary;
use libfuzzer_sys::fuzz_target;
use nvme::tcp::pdu::{encode, Digests, Framing, Header, MAX_TERM_REQ_LEN};
use nvme::tcp::{Deframer, Limits, Side};

#[derive(Arbitrary, Debug)]
struct Input {
    controller: bool,
    header_digest: bool,
    data_digest: bool,
    pda: u8,
    max_data: u16,
    pieces: Vec<Vec<u8>>,
}

fuzz_target!(|input: Input| {
    let side = if input.controller {
        Side::Controller
    } else {
        Side::Host
    };
    let digests = Digests {
        header: input.header_digest,
        data: input.data_digest,
    };
    let limits = Limits {
        digests,
        pda: input.pda % 32,
        max_data: u32::from(input.max_data),
    };
    let mut d = Deframer::new(side);
    d.set_limits(limits);
    let mut failed = false;
    for piece in input.pieces.iter().take(64) {
        d.feed(piece);
        loop {
            match d.next_pdu() {
                Ok(Some(p)) => {
                    assert!(!failed, "a PDU after a fatal error");
                    let term = matches!(p.header, Header::H2CTermReq(_) | Header::C2HTermReq(_));
                    let most = if term {
                        MAX_TERM_REQ_LEN
                    } else {
                        limits.max_data as usize
                    };
                    assert!(p.data.len() <= most, "{} bytes of data", p.data.len());
                    let framing = Framing {
                        digests,
                        pda: limits.pda,
                    };
                    assert!(
                        encode(&p.header, p.data.len() as u32, &framing).is_some(),
                        "{:?} does not frame again",
                        p.header
                    );
                }
                Ok(None) => break,
                Err(e) => {
                    failed = true;
                    assert!(e.pdu_header().len() <= 128);
                    assert!(d.next_pdu().is_err(), "a fatal error that went away");
                    break;
                }
            }
        }
        // What is buffered is at most one PDU: a header, alignment, the data allowed, digests.
        assert!(failed || d.buffered() <= piece.len() + 256 + limits.max_data as usize + 8);
    }
});
