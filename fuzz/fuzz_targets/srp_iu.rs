//! SRP information units from arbitrary bytes: decoding never panics, and whatever decodes
//! encodes to bytes that decode to the same IU.
#![no_main]

use libfuzzer_sys::fuzz_target;
use srp::Iu;

fuzz_target!(|data: &[u8]| {
    if let Ok(iu) = Iu::decode(data) {
        let mut again = Vec::new();
        iu.encode(&mut again);
        assert_eq!(Iu::decode(&again).as_ref(), Ok(&iu));
        if let Iu::Cmd(c) = &iu {
            assert_eq!(again.len(), c.encoded_len());
        }
    }
});
