//! The SCSI RDMA Protocol (T10 SRP-2) for the storage target: information-unit codecs
//! ([`iu`]), the target's RDMA channel as a sans-IO state machine on scsi-core's task layer
//! ([`target_port`]), an initiator's channel ([`initiator`]), and a whole target with memory
//! units on storage-target-rdma's software fabric, run in the caller's thread ([`loopback`]).
//! The verbs they run on (the software fabric, real devices) are storage-target-rdma's: SRP's
//! memory descriptors become its [`RemoteRegion`](rdma::verbs::RemoteRegion)s where they are
//! decoded.
//!
//! An SRP initiator sends commands as SRP_CMD IUs that name its data buffers by memory
//! descriptors (virtual address, remote key, length); the target moves the data itself, with
//! RDMA WRITE into those buffers for a read and RDMA READ from them for a write, then answers
//! with SRP_RSP. The target's buffers are slices of one memory region registered when it
//! starts, so no I/O registers memory on the target.
#![forbid(unsafe_code)]

pub mod initiator;
pub mod iu;
pub mod loopback;
pub mod target_port;
#[cfg(feature = "testing")]
pub mod testing;

pub use iu::{Iu, IuError, IuType};
