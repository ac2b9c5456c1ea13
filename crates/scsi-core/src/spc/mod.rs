//! SPC-4 primary commands: one module per command group.

pub(crate) mod commands;
pub mod copy;
pub mod inquiry;
pub mod log;
pub mod mode;
pub mod opcodes;
pub mod report_luns;
pub mod tpg;
