//! `initiator-bench`: the command-line load generator.

fn main() {}
