//! The transport-agnostic SCSI target core, sans-IO: transports hand in commands and get back
//! what to do; nothing here owns a socket, a thread or a clock.
//!
//! So far: sense data in fixed and descriptor formats with sense-key-specific field pointers
//! ([`sense`]), and CDB structure with the decoding of the SBC read and write family ([`cdb`]).
//! The task set, the logical unit model, the command handlers and the backend interface follow
//! (issue 3).
#![forbid(unsafe_code)]

pub mod cdb;
pub mod sense;

pub use cdb::BlockIo;
pub use sense::{Asc, FieldIn, FieldPointer, Sense, SenseBytes, SenseKey};
