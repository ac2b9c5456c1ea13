//! SRP information units from arbitrary bytes: decoding never panics, and whatever decodes
//! encodes to bytes that decode to the same IU. The same for a login request in rdma_cm's
//! private data.
#![no_main]

use libfuzzer_sys::fuzz_target;
use srp::iu::SrpLoginReq;
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
    if let Ok(req) = SrpLoginReq::decode_rdma_cm(data) {
        let mut again = Vec::new();
        req.encode_rdma_cm(&mut again);
        assert_eq!(SrpLoginReq::decode_rdma_cm(&again), Ok(req));
    }
});
