//! Arbitrary CDBs never panic the block I/O decoder; whatever decodes satisfies the range check
//! without overflow, and every refusal encodes as sense data in both formats.
#![no_main]

use libfuzzer_sys::fuzz_target;
use scsi_core::BlockIo;

fuzz_target!(|cdb: &[u8]| {
    match BlockIo::decode(cdb) {
        Ok(io) => {
            let _ = io.check_range(u64::from(u32::MAX));
            let _ = io.bytes(4096);
        }
        Err(sense) => {
            assert_eq!(sense.fixed().as_slice().len(), 18);
            assert!(sense.descriptor().as_slice().len() >= 8);
        }
    }
});
