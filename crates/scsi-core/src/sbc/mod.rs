//! SBC commands, one file per command group.

pub mod capacity;

pub use capacity::{read_capacity10, read_capacity16};
