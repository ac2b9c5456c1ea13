//! decode -> encode -> decode is the identity for whatever decodes; nothing panics.
#![no_main]

use bytes::{Bytes, BytesMut};
use iscsi_pdu::{Digests, Pdu, MAX_DATA_SEGMENT_LENGTH};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|input: &[u8]| {
    let Some((&flags, rest)) = input.split_first() else {
        return;
    };
    let digests = Digests {
        header: flags & 1 != 0,
        data: flags & 2 != 0,
    };
    let bytes = Bytes::copy_from_slice(rest);
    let Ok(first) = Pdu::decode(&bytes, digests, MAX_DATA_SEGMENT_LENGTH) else {
        return;
    };
    let mut wire = BytesMut::new();
    first.pdu.encode(digests, &mut wire);
    let second = Pdu::decode(&wire.freeze(), digests, MAX_DATA_SEGMENT_LENGTH)
        .expect("own encoding decodes");
    assert_eq!(first.pdu, second.pdu);
});
