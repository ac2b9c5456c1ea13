//! Runs each hot codec operation N times (default 100000) for instruction counting, which is
//! repeatable where wall-clock timings on a shared VM are not:
//!
//! ```sh
//! cargo build --release -p benches --example instructions
//! valgrind --tool=callgrind --callgrind-out-file=/tmp/cg.out \
//!     target/release/examples/instructions decode-bhs 100000
//! ```
//!
//! Instructions per operation = (total - the same run with N = 0) / N.

use std::hint::black_box;

use bytes::{Bytes, BytesMut};
use iscsi_pdu::{DataIn, Digests, Pdu, ScsiCommand, SerialNumber, MAX_DATA_SEGMENT_LENGTH};

fn main() {
    let mut args = std::env::args().skip(1);
    let op = args.next().unwrap_or_else(|| "decode-bhs".into());
    let n: u64 = args.next().and_then(|v| v.parse().ok()).unwrap_or(100_000);
    let mut cdb = [0u8; 16];
    cdb[0] = 0x28;
    let cmd = Pdu::ScsiCommand(ScsiCommand {
        final_bit: true,
        read: true,
        initiator_task_tag: 1,
        expected_data_transfer_length: 4096,
        cmd_sn: SerialNumber(1),
        cdb,
        ..Default::default()
    });
    let mut wire = BytesMut::new();
    cmd.encode(Digests::NONE, &mut wire);
    let wire = Bytes::from_static(Vec::leak(wire.to_vec()));
    let data_in = Pdu::DataIn(DataIn {
        final_bit: true,
        initiator_task_tag: 1,
        ..Default::default()
    });
    let mut out = BytesMut::with_capacity(64);
    match op.as_str() {
        "decode-bhs" => {
            for _ in 0..n {
                black_box(
                    Pdu::decode(
                        &mut black_box(&wire).clone(),
                        Digests::NONE,
                        MAX_DATA_SEGMENT_LENGTH,
                    )
                    .unwrap(),
                );
            }
        }
        "encode-data-in-header" => {
            for _ in 0..n {
                out.clear();
                black_box(&data_in).encode_header(8192, false, &mut out);
                black_box(&out);
            }
        }
        other => panic!("unknown operation {other}; use decode-bhs or encode-data-in-header"),
    }
}
