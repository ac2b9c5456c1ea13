//! NVMe over Fabrics: the subsystems of `[[subsystems]]` and their namespaces
//! ([`subsystem`]), the shell of one NVMe/TCP connection on a reactor ([`tcp`]) and of an
//! NVMe/RDMA portal's queues ([`rdma`]), and what both shells share ([`queue`]). The protocol is
//! crates/nvme's, sans-IO: the subsystem machine (Connect, the admin commands, keep alive,
//! asynchronous events) and each connection's machine (PDUs, R2Ts, digests, a command's
//! buffer and block operation). A namespace is a unit like a LUN (the same stores, the same
//! reactor engines and arenas, the same counters), and a connection's events are carried by
//! the one carrier every transport uses.

pub mod handover;
pub mod queue;
pub mod rdma;
pub mod subsystem;
pub mod tcp;

pub use subsystem::{controller_ids, NvmeSubsystem, CNTLIDS_PER_GATEWAY, MAX_NVME_PORT_GROUP};
