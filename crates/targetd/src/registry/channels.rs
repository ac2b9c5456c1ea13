//! The RDMA ports' channels as the admin interface and the metrics see them: each SRP
//! channel logged in, kept in the registry by the port that serves it.

/// An SRP channel as the admin interface sees it.
#[derive(Debug, Clone)]
pub struct SrpChannelInfo {
    /// The target.
    pub target: String,
    /// The initiator port identifier.
    pub initiator_port_id: [u8; 16],
    /// The target port identifier.
    pub target_port_id: [u8; 16],
    /// The RDMA portal (an address, or a software fabric's service).
    pub portal: String,
    /// The reactor serving it.
    pub reactor: usize,
    /// Requests it may have outstanding.
    pub request_limit: u32,
    /// The largest IU the initiator may send, and the largest the target sends.
    pub iu_lengths: (u32, u32),
    /// Its I_T nexus in the target's core.
    pub nexus: scsi_core::NexusId,
}
