//! SBC-3 block commands: one module per command group.

pub mod block;
pub mod capacity;
pub(crate) mod commands;
pub mod lba_status;
pub mod unmap;
