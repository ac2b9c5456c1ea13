//! NVMe over Fabrics, sans-IO: the pieces a target (and a host) of NVMe/TCP is built from,
//! taking bytes and handing back bytes, owning no socket, thread or clock.
//!
//! - [`sqe`] and [`cqe`]: the 64-byte submission queue entry and the 16-byte completion queue
//!   entry every NVMe transport carries, with the opcodes of the admin, fabrics and NVM
//!   command sets ([`opcode`]) and the status a command completes with ([`status`]).
//! - [`fabrics`]: Connect and its data, and the properties (CAP, VS, CC, CSTS) with what
//!   enabling, resetting and shutting down a controller do; [`identify`]: the Identify
//!   data structures of a controller and a namespace, and the namespace lists.
//! - [`nvm`]: the NVM command set's I/O commands decoded into the block operations every
//!   backend of this project runs (scsi-core's `Op`), with what a controller must refuse
//!   before any data moves.
//! - [`ana`]: Asymmetric Namespace Access: each namespace's group and each group's state
//!   (optimized, non-optimized, inaccessible, persistent loss, change), and the log page.
//! - [`controller`]: an NVM subsystem and its controllers as a machine: Connect across
//!   queues, the admin commands ([`log_page`] builds the log pages), keep alive on `now`,
//!   and the I/O commands handed to the shell as block operations.
//! - [`tcp`]: the NVMe/TCP transport (NVM Express TCP Transport Specification 1.0): the PDUs
//!   ([`tcp::pdu`]), CRC32C header and data digests, and a streaming deframer
//!   ([`tcp::Deframer`]) that checks each header against the negotiated limits before it
//!   buffers any data, and names a fatal error with the Fatal Error Status the specification
//!   gives (the C2HTermReq a controller sends).
//! - [`rdma`]: the NVMe/RDMA transport (NVM Express RDMA Transport Specification 1.0b): the
//!   connection manager's private data that sets up a queue ([`rdma::cm`]) and the queue
//!   machine ([`rdma::RdmaQueue`]) that turns capsules and keyed SGLs into SENDs, RDMA READs
//!   and RDMA WRITEs for the shell's verbs.
//! - [`handover`]: a quiescent NVMe/TCP controller's state with its queues, and a
//!   namespace's reservations, as one process hands them to the next (an upgrade).
//! - [`connection`]: the controller's end of a queue with its commands carried out, the same
//!   over every transport ([`transport::Transport`] is what it needs of one).
//!
//! The names are the specification's: SQE, CQE, CID, NSID, SGL, ICReq, CapsuleCmd, H2CData,
//! R2T, HPDA/CPDA, MAXH2CDATA, FES.
#![forbid(unsafe_code)]
#![doc = include_str!("../README.md")]

pub mod ana;
pub mod connection;
pub mod controller;
pub mod cqe;
pub mod fabrics;
pub mod handover;
pub mod identify;
pub mod log_page;
pub mod nvm;
pub mod opcode;
pub mod rdma;
pub mod reservation;
pub mod sqe;
pub mod status;
pub mod tcp;
#[cfg(any(test, feature = "testing"))]
pub mod testing;
pub mod transport;

pub use cqe::Cqe;
pub use sqe::{Sgl, Sqe};
pub use status::Status;
