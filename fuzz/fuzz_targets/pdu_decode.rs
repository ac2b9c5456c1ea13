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
    let mut bytes = Bytes::copy_from_slice(rest);
    let Ok(first) = Pdu::decode(&mut bytes, digests, MAX_DATA_SEGMENT_LENGTH) else {
        return;
    };
    let mut wire = BytesMut::new();
    first.encode(digests, &mut wire);
    let mut wire = wire.freeze();
    let second =
        Pdu::decode(&mut wire, digests, MAX_DATA_SEGMENT_LENGTH).expect("own encoding decodes");
    assert_eq!(first, second);
    assert!(wire.is_empty());
});
