//! `examples/fabric_target.rs`, the embedding example, runs: an initiator channel logs in to
//! its target through the switch's connection manager, writes 1 MiB, reads it back equal, and
//! logs out, the target's channel ending with it.

#[path = "../examples/fabric_target.rs"]
#[allow(dead_code)]
mod example;

#[test]
fn the_embedding_example_moves_verified_data() {
    assert_eq!(example::demo(), Ok(1 << 20));
}
