#![doc = include_str!("../README.md")]
#![forbid(unsafe_code)]

pub mod bhs;
pub mod chap;
pub mod deframer;
pub mod digest;
pub mod error;
pub mod handover;
pub mod initiator;
pub mod iser;
pub mod names;
pub mod negotiation;
#[cfg(feature = "testing")]
pub mod pair;
pub mod pdu;
pub mod serial;
pub mod target_node;
pub mod text;
pub mod types;

pub use bhs::{padding, Bhs, Opcode, BHS_LEN, MAX_DATA_SEGMENT_LENGTH, MAX_HEADER_LEN};
pub use deframer::{Deframer, Received, LOGIN_MAX_RECV_DATA_SEGMENT_LENGTH};
pub use digest::{crc32c, data_digest, Crc32c, Digests};
pub use error::{DecodeError, PduError};
pub use pdu::*;
pub use serial::SerialNumber;
pub use types::{Isid, Lun, Residual, ScsiStatus, Stage, TaskAttribute, RESERVED_TAG};
