//! Sans-IO iSCSI (RFC 7143) for targets and initiators: typed codecs for every PDU, a streaming
//! deframer, text key=value handling, the login/text negotiation engine for every key of
//! RFC 7143 section 13, CHAP, and CRC32C digests.
//!
//! Nothing here owns a socket, a clock or a thread: callers feed bytes and events in and act on
//! what comes back, so the same code serves a tokio daemon, a test harness and a fuzzer.
//!
//! ```
//! use bytes::BytesMut;
//! use iscsi_pdu::{Deframer, Digests, NopOut, Pdu, SerialNumber};
//!
//! let ping = Pdu::NopOut(NopOut { initiator_task_tag: 7, target_transfer_tag: 0xffff_ffff,
//!     cmd_sn: SerialNumber(1), ..Default::default() });
//! let mut wire = BytesMut::new();
//! ping.encode(Digests::NONE, &mut wire);
//!
//! let mut deframer = Deframer::new();
//! deframer.feed(&wire[..10]);
//! assert_eq!(deframer.next_pdu().unwrap(), None);
//! assert_eq!(deframer.needed(), 38);
//! deframer.feed(&wire[10..]);
//! assert_eq!(deframer.next_pdu().unwrap(), Some(ping));
//! ```
#![forbid(unsafe_code)]

pub mod bhs;
pub mod chap;
pub mod deframer;
pub mod digest;
pub mod error;
pub mod names;
pub mod negotiation;
pub mod pdu;
pub mod serial;
pub mod text;
pub mod types;

pub use bhs::{padding, Bhs, Opcode, BHS_LEN, MAX_DATA_SEGMENT_LENGTH, MAX_HEADER_LEN};
pub use deframer::{Deframer, LOGIN_MAX_RECV_DATA_SEGMENT_LENGTH};
pub use digest::{crc32c, data_digest, Crc32c, Digests};
pub use error::{DecodeError, PduError};
pub use pdu::*;
pub use serial::SerialNumber;
pub use types::{Isid, Lun, Residual, ScsiStatus, Stage, TaskAttribute, RESERVED_TAG};
