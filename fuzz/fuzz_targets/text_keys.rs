//! Text parsing and reassembly never panic; whatever parses round-trips; values parse safely.
#![no_main]

use iscsi_pdu::text::{
    parse_binary, parse_boolean, parse_number, split_text, TextParams, TextReassembler,
};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|input: &[u8]| {
    if let Ok(t) = TextParams::parse(input) {
        let wire = t.encode();
        assert_eq!(TextParams::parse(&wire).unwrap(), t);
        for (_, v) in t.iter() {
            let _ = (parse_number(v), parse_boolean(v), parse_binary(v));
        }
        // Split and reassembled, the text is the same.
        let mut r = TextReassembler::new(1 << 16);
        let mut whole = None;
        for (segment, more) in split_text(&wire, 7) {
            whole = r.push(&segment, more).unwrap();
        }
        assert_eq!(whole.unwrap(), wire);
    }
    let _ = TextParams::parse_send_targets(input);
});
