//! The transport-agnostic SCSI target core, sans-IO: transports hand in commands and get back
//! what to do; nothing here owns a socket, a thread or a clock.
//!
//! So far: sense data in fixed and descriptor formats with sense-key-specific field pointers
//! ([`sense`]); CDB structure with the decoding of the SBC read and write family ([`cdb`]); the
//! logical unit's identity, geometry and limits ([`lu`]); INQUIRY with standard data and VPD
//! pages ([`spc::inquiry`](mod@spc::inquiry)), REPORT LUNS ([`spc::report_luns`](mod@spc::report_luns)) and READ CAPACITY 10/16
//! ([`sbc::capacity`](mod@sbc::capacity)). The task set, the other command handlers and the backend interface
//! follow (issue 3).
#![forbid(unsafe_code)]

pub mod cdb;
pub mod lu;
pub mod sbc;
pub mod sense;
pub mod spc;

pub use cdb::BlockIo;
pub use lu::{Geometry, Identity, Limits, LogicalUnit, TargetPort};
pub use sense::{Asc, FieldIn, FieldPointer, Sense, SenseBytes, SenseKey};
