//! The SCSI RDMA Protocol (T10 SRP-2) for the storage target: information-unit codecs
//! ([`iu`]), the target's RDMA channel as a sans-IO state machine on scsi-core's task layer
//! ([`target_port`]), and the verbs it runs on ([`fabric`]: a software fabric in the same process,
//! shared between threads through a [`switch`]; real devices through rdma-sys with the feature
//! `rdma`), an initiator's channel ([`initiator`]), and a whole target with memory units on the
//! switch, run in the caller's thread ([`loopback`]).
//!
//! An SRP initiator sends commands as SRP_CMD IUs that name its data buffers by memory
//! descriptors (virtual address, remote key, length); the target moves the data itself, with
//! RDMA WRITE into those buffers for a read and RDMA READ from them for a write, then answers
//! with SRP_RSP. The target's buffers are slices of one memory region registered when it
//! starts, so no I/O registers memory on the target.
#![cfg_attr(not(feature = "rdma"), forbid(unsafe_code))]
#![cfg_attr(feature = "rdma", deny(unsafe_code))]

pub mod fabric;
pub mod initiator;
pub mod iu;
pub mod loopback;
#[cfg(feature = "rdma")]
pub mod rdma;
pub mod switch;
pub mod target_port;
#[cfg(feature = "testing")]
pub mod testing;
pub mod verbs;

pub use iu::{Iu, IuError, IuType};
