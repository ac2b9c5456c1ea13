//! NVMe over RDMA (NVM Express RDMA Transport Specification 1.0b): a queue is an RDMA
//! reliable connection made through the RDMA connection manager, whose private data carry
//! the queue's terms ([`cm`]); a command capsule (the SQE and in-capsule data) comes in a
//! SEND, a response capsule (the CQE) goes back in one, and a command's data outside its
//! capsule moves by RDMA READ and WRITE of the host's memory that a keyed SGL descriptor
//! names ([`crate::sqe::SglKind::Keyed`]). [`RdmaQueue`] is a queue's transport machine,
//! under the connection every transport shares ([`ControllerConnection`]).

pub mod cm;
pub mod queue;

pub use cm::{CmAccept, CmReject, CmRequest, QueueLimits, QueueTerms, RejectStatus};
pub use queue::{CapsuleError, Keyed, RdmaQueue, RdmaQueueError, Work};

/// The controller's end of one NVMe/RDMA queue with its commands carried out.
pub type ControllerConnection<B> = crate::connection::ControllerConnection<B, RdmaQueue<B>>;
