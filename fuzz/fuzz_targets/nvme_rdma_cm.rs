//! NVMe/RDMA's connection manager private data, as a controller reads a host's request and
//! a host reads a controller's answer, from arbitrary bytes under arbitrary queue limits: it
//! never panics; a request shorter than 32 bytes is Invalid Length; a request accepted has
//! RECFMT 1.0, a QID within the limits, a send queue of 1 to the queue's limit entries and a
//! receive queue at least as large, and reads back as it was; every reject and accept
//! encoded reads back as it was.
#![no_main]

use arbitrary::Arbitrary;
use libfuzzer_sys::fuzz_target;
use nvme::rdma::cm::{CmAccept, CmReject, CmRequest, QueueLimits, QueueTerms, RejectStatus};

#[derive(Arbitrary, Debug)]
struct Input {
    private_data: Vec<u8>,
    admin_entries: u16,
    io_entries: u16,
    max_qid: u16,
}

fuzz_target!(|input: Input| {
    let limits = QueueLimits {
        admin_entries: input.admin_entries,
        io_entries: input.io_entries,
        max_qid: input.max_qid,
    };
    let _ = CmAccept::decode(&input.private_data);
    if let Some(r) = CmReject::decode(&input.private_data) {
        assert_eq!(CmReject::decode(&r.encode()), Some(r));
    }
    let request = match CmRequest::decode(&input.private_data) {
        Ok(r) => r,
        Err(status) => {
            assert_eq!(status, RejectStatus::InvalidLength);
            assert!(input.private_data.len() < 32);
            return;
        }
    };
    assert_eq!(CmRequest::decode(&request.encode()), Ok(request));
    match QueueTerms::negotiate(&request, &limits) {
        Ok(terms) => {
            assert_eq!(request.recfmt, 0);
            assert!(terms.qid <= limits.max_qid);
            let most = if terms.qid == 0 {
                limits.admin_entries
            } else {
                limits.io_entries
            };
            assert!(terms.entries >= 1 && terms.entries <= most);
            assert!(terms.host_receives >= terms.entries);
            let accept = terms.accept();
            assert_eq!(CmAccept::decode(&accept.encode()), Some(accept));
        }
        Err(status) => {
            let reject = CmReject::new(status);
            assert_eq!(CmReject::decode(&reject.encode()), Some(reject));
        }
    }
});
