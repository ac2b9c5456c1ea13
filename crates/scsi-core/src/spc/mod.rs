//! SPC commands, one file per command group.

pub mod inquiry;
pub mod report_luns;

pub use inquiry::inquiry;
pub use report_luns::report_luns;
