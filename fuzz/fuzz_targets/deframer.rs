//! The deframer fed the same stream at random split points yields the same PDUs and errors as
//! the stream decoded in one piece.
#![no_main]

use arbitrary::Arbitrary;
use iscsi_pdu::{Deframer, Digests, Pdu};
use libfuzzer_sys::fuzz_target;

#[derive(Arbitrary, Debug)]
struct Input {
    header_digest: bool,
    data_digest: bool,
    max_segment: u16,
    splits: Vec<u8>,
    stream: Vec<u8>,
}

/// Everything the deframer yields, up to its first fatal error.
fn run(input: &Input, chunks: impl Iterator<Item = usize>) -> Vec<Result<Pdu, String>> {
    let mut d = Deframer::new();
    d.set_digests(Digests {
        header: input.header_digest,
        data: input.data_digest,
    });
    d.set_max_recv_data_segment_length(u32::from(input.max_segment));
    let mut out = Vec::new();
    let mut at: usize = 0;
    for n in chunks.chain(std::iter::once(usize::MAX)) {
        let end = at.saturating_add(n.max(1)).min(input.stream.len());
        d.feed(&input.stream[at..end]);
        at = end;
        loop {
            match d.next_pdu() {
                Ok(Some(p)) => out.push(Ok(p)),
                Ok(None) => break,
                Err(e) => {
                    let fatal = e.is_fatal();
                    out.push(Err(e.to_string()));
                    if fatal {
                        return out;
                    }
                }
            }
            assert!(d.needed() > 0 || d.buffered() >= 48);
        }
        if at == input.stream.len() {
            break;
        }
    }
    out
}

fuzz_target!(|input: Input| {
    let whole = run(&input, std::iter::once(input.stream.len()));
    let split = run(
        &input,
        input
            .splits
            .iter()
            .map(|&s| usize::from(s))
            .cycle()
            .take(input.stream.len()),
    );
    assert_eq!(whole, split);
});
