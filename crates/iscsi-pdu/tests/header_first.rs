//! The deframer's header-first mode: payloads of SCSI Commands and Data-Outs are placed by the
//! receiver (partly copied out of the buffer, partly "read straight" past it), other PDUs come
//! out whole, with the same checks as whole-PDU mode: at every split point, with and without
//! digests, with digest errors, discards, and the fatal header errors.

use bytes::{Bytes, BytesMut};
use iscsi_pdu::*;
use proptest::prelude::*;

fn stream(digests: Digests) -> (Vec<Pdu>, Bytes) {
    let pdus = vec![
        Pdu::NopOut(NopOut {
            initiator_task_tag: 1,
            target_transfer_tag: RESERVED_TAG,
            data: Bytes::from_static(b"ping data"),
            ..NopOut::default()
        }),
        Pdu::ScsiCommand(ScsiCommand {
            write: true,
            final_bit: false,
            initiator_task_tag: 2,
            expected_data_transfer_length: 3000,
            data: Bytes::from((0..1001u32).map(|i| i as u8).collect::<Vec<_>>()),
            ..ScsiCommand::default()
        }),
        Pdu::DataOut(DataOut {
            final_bit: true,
            initiator_task_tag: 2,
            target_transfer_tag: RESERVED_TAG,
            buffer_offset: 1001,
            data: Bytes::from((0..1999u32).map(|i| (i * 3) as u8).collect::<Vec<_>>()),
            ..DataOut::default()
        }),
        Pdu::ScsiCommand(ScsiCommand {
            read: true,
            final_bit: true,
            initiator_task_tag: 3,
            expected_data_transfer_length: 512,
            ..ScsiCommand::default()
        }),
        Pdu::LogoutRequest(LogoutRequest {
            initiator_task_tag: 4,
            ..LogoutRequest::default()
        }),
    ];
    let mut out = BytesMut::new();
    for p in &pdus {
        p.encode(digests, &mut out);
    }
    (pdus, out.freeze())
}

fn direct(op: Opcode) -> bool {
    matches!(op, Opcode::ScsiCommand | Opcode::DataOut)
}

/// Receives `wire` fed in chunks of `chunk` bytes, placing payloads as a socket reader would:
/// first what the deframer buffered, then "reads" straight from the wire. Returns each PDU
/// with its payload put back, or the error that ended the stream.
fn receive(wire: &[u8], chunk: usize, digests: Digests) -> Result<Vec<Pdu>, DecodeError> {
    let mut d = Deframer::new();
    d.set_digests(digests);
    d.set_max_recv_data_segment_length(65536);
    let mut at = 0;
    let mut out = Vec::new();
    let feed = |d: &mut Deframer, at: &mut usize| {
        let n = chunk.min(wire.len() - *at);
        d.feed(&wire[*at..*at + n]);
        *at += n;
        n > 0
    };
    loop {
        match d.next_header(direct)? {
            Some(Received::Pdu(p)) => out.push(p),
            Some(Received::Header { mut pdu, len, .. }) => {
                let mut buf = vec![0u8; len as usize];
                let mut got = d.payload(&mut buf);
                while got < buf.len() {
                    // A direct read from the socket into the destination.
                    let n = chunk.min(buf.len() - got).min(wire.len() - at);
                    assert!(n > 0, "the payload is on the wire");
                    buf[got..got + n].copy_from_slice(&wire[at..at + n]);
                    d.payload_direct(&buf[got..got + n]);
                    at += n;
                    got += n;
                }
                while d.end_payload()?.is_none() {
                    assert!(feed(&mut d, &mut at), "the tail is on the wire");
                }
                match &mut pdu {
                    Pdu::ScsiCommand(c) => c.data = Bytes::from(buf),
                    Pdu::DataOut(o) => o.data = Bytes::from(buf),
                    _ => unreachable!(),
                }
                out.push(pdu);
            }
            None => {
                assert!(d.needed() > 0);
                if !feed(&mut d, &mut at) {
                    return Ok(out);
                }
            }
        }
    }
}

/// A stream cut anywhere between two deframers, as a connection handed to another process
/// is: what the first has not made into PDUs (`unread`), fed to the second before the rest of
/// the wire, gives the same PDUs. In the middle of a header-first payload there is nothing to
/// hand over yet.
#[test]
fn unread_bytes_go_on_in_another_deframer() {
    for digests in [Digests::NONE, Digests::BOTH] {
        let (pdus, wire) = stream(digests);
        for cut in 0..=wire.len() {
            let new = || {
                let mut d = Deframer::new();
                d.set_digests(digests);
                d.set_max_recv_data_segment_length(65536);
                d
            };
            let mut first = new();
            first.feed(&wire[..cut]);
            let mut got = Vec::new();
            while let Some(p) = first.next_pdu().unwrap() {
                got.push(p);
            }
            let mut second = new();
            second.feed(first.unread().expect("between PDUs"));
            second.feed(&wire[cut..]);
            while let Some(p) = second.next_pdu().unwrap() {
                got.push(p);
            }
            assert_eq!(got, pdus, "cut at {cut}");
            assert_eq!(second.unread(), Some(&[][..]));
        }
        let mut d = Deframer::new();
        d.set_digests(digests);
        d.feed(&wire);
        assert!(matches!(d.next_header(direct), Ok(Some(Received::Pdu(_)))));
        assert!(matches!(
            d.next_header(direct),
            Ok(Some(Received::Header { .. }))
        ));
        assert_eq!(d.unread(), None, "a payload is pending");
    }
}

#[test]
fn every_split_with_and_without_digests() {
    for digests in [
        Digests::NONE,
        Digests {
            header: true,
            data: true,
        },
        Digests {
            header: false,
            data: true,
        },
    ] {
        let (pdus, wire) = stream(digests);
        for chunk in [1, 2, 3, 5, 47, 48, 49, 100, 1000, 4096, wire.len()] {
            let got = receive(&wire, chunk, digests).unwrap();
            assert_eq!(got, pdus, "chunk {chunk}, digests {digests:?}");
        }
    }
}

#[test]
fn a_payload_digest_error_is_reported_and_the_stream_goes_on() {
    let digests = Digests {
        header: true,
        data: true,
    };
    let (_, wire) = stream(digests);
    let mut wire = wire.to_vec();
    // Flip a byte inside the SCSI Command's immediate data (after the NOP-Out's frame).
    let nop = 48 + 4 + 12 + 4;
    wire[nop + 52 + 500] ^= 0xff;
    let mut d = Deframer::new();
    d.set_digests(digests);
    d.feed(&wire);
    assert!(matches!(d.next_header(direct), Ok(Some(Received::Pdu(_)))));
    let Ok(Some(Received::Header { len, .. })) = d.next_header(direct) else {
        panic!("the command's header");
    };
    let mut buf = vec![0u8; len as usize];
    assert_eq!(d.payload(&mut buf), len as usize);
    match d.end_payload() {
        Err(e @ DecodeError::Malformed { .. }) => {
            assert!(!e.is_fatal());
            assert_eq!(e.reject().unwrap().0, RejectReason::DataDigestError);
        }
        other => panic!("{other:?}"),
    }
    // The Data-Out that follows is intact.
    assert!(matches!(
        d.next_header(direct),
        Ok(Some(Received::Header {
            pdu: Pdu::DataOut(_),
            len: 1999,
            ..
        }))
    ));
}

#[test]
fn a_discarded_payload_is_skipped_as_it_arrives() {
    let (pdus, wire) = stream(Digests::NONE);
    let mut d = Deframer::new();
    let mut seen = Vec::new();
    for b in wire.iter() {
        d.feed(&[*b]);
        while let Some(r) = d.next_header(direct).unwrap() {
            match r {
                Received::Pdu(p) => seen.push(p.opcode()),
                Received::Header { pdu, .. } => {
                    seen.push(pdu.opcode());
                    d.discard_payload();
                }
            }
        }
    }
    let want: Vec<Opcode> = pdus.iter().map(Pdu::opcode).collect();
    assert_eq!(seen, want);
    assert_eq!(d.buffered(), 0);
}

#[test]
fn fatal_header_errors_are_the_same_as_in_whole_mode() {
    let (_, wire) = stream(Digests::NONE);
    // DataSegmentLength beyond the limit, judged on the BHS alone.
    let mut d = Deframer::new();
    d.set_max_recv_data_segment_length(512);
    let nop = 48 + 12;
    d.feed(&wire[nop..nop + 48]);
    match d.next_header(direct) {
        Err(e @ DecodeError::DataSegmentTooLong { .. }) => assert!(e.is_fatal()),
        other => panic!("{other:?}"),
    }
    // A header digest that does not match.
    let digests = Digests {
        header: true,
        data: false,
    };
    let (_, wire) = stream(digests);
    let mut wire = wire.to_vec();
    wire[3] ^= 1;
    let mut d = Deframer::new();
    d.set_digests(digests);
    d.feed(&wire[..52]);
    assert!(matches!(
        d.next_header(direct),
        Err(DecodeError::HeaderDigest { .. })
    ));
}

#[test]
fn a_payload_must_be_taken_before_the_next_header() {
    let (_, wire) = stream(Digests::NONE);
    let mut d = Deframer::new();
    d.feed(&wire);
    assert!(matches!(d.next_header(direct), Ok(Some(Received::Pdu(_)))));
    assert!(matches!(
        d.next_header(direct),
        Ok(Some(Received::Header { .. }))
    ));
    assert!(matches!(
        d.next_header(direct),
        Err(DecodeError::Malformed { .. })
    ));
}

proptest! {
    /// Arbitrary bytes at arbitrary splits never panic header-first mode.
    #[test]
    fn arbitrary_bytes_never_panic(bytes in prop::collection::vec(any::<u8>(), 0..4000),
                                   chunk in 1usize..300, header in any::<bool>(), data in any::<bool>()) {
        let mut d = Deframer::new();
        d.set_digests(Digests { header, data });
        for c in bytes.chunks(chunk) {
            d.feed(c);
            loop {
                match d.next_header(direct) {
                    Ok(Some(Received::Header { len, .. })) => {
                        let mut buf = vec![0u8; (len as usize).min(256)];
                        d.payload(&mut buf);
                        // Not all here yet: drop it, so the next header skips it.
                        if let Ok(None) = d.end_payload() {
                            d.discard_payload();
                        }
                    }
                    Ok(Some(Received::Pdu(_))) => continue,
                    Ok(None) => break,
                    Err(e) if e.is_fatal() => return Ok(()),
                    Err(_) => continue,
                }
            }
        }
    }
}
