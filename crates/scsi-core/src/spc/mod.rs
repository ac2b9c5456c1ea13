//! SPC commands, one file per command group.

pub mod inquiry;

pub use inquiry::inquiry;
