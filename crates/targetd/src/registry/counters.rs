//! What the daemon counts: the registry's counters ([`Counters`], the `targetd_*` metrics),
//! each reactor's arena as it reports it ([`ArenaGauge`]), and the connections open
//! ([`ConnectionSlot`]). Below everything that counts: the reactors, the transports' shells
//! and the metrics reach these without the registry's login policy or reloads.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

/// The counters connections, ports and reactors add to, shared through the registry.
#[derive(Debug, Default)]
pub struct Counters {
    /// Connections closed at once because the daemon had `server.max_connections` open.
    pub connections_refused: AtomicU64,
    /// Connections dropped because nothing could be sent for `server.send_timeout`.
    pub send_timeouts: AtomicU64,
    /// Write commands answered TASK SET FULL: their connection's share of the arena was full
    /// with buffers waiting for data-out.
    pub task_set_full: AtomicU64,
    /// Connections dropped because they owed data-out and sent none for
    /// `server.data_out_timeout`.
    pub data_out_timeouts: AtomicU64,
    /// Writes aborted (TASK ABORTED) because their data-out was still owed at a handover's
    /// park deadline.
    pub park_aborts: AtomicU64,
    /// Each reactor's buffer arena as it last reported it, in reactor order.
    pub arenas: Mutex<Vec<Arc<ArenaGauge>>>,
    /// SRP logins refused (SRP_LOGIN_REJ).
    pub srp_logins_rejected: AtomicU64,
    /// SRP writes whose data came as immediate data in the SRP_CMD (no RDMA READ).
    pub srp_immediate_writes: AtomicU64,
    /// iSER connections open on the iSER portals, logged in or not.
    pub iser_connections: AtomicU64,
    /// Logins answered, by transport (TCP, iSER) and Login Response status
    /// (`LoginStatus::index`).
    pub logins: [[AtomicU64; 19]; 2],
    /// RDMA READs an iSER portal issued (one per burst of solicited data-out).
    pub iser_rdma_reads: AtomicU64,
    /// RDMA WRITEs an iSER portal issued (one per command's data-in).
    pub iser_rdma_writes: AtomicU64,
}

/// A reactor's buffer arena, reported every second for the metrics: how much of it is free,
/// and how many allocations wait for room.
#[derive(Debug, Default)]
pub struct ArenaGauge {
    /// Its size in bytes.
    pub bytes: AtomicU64,
    /// Bytes in free slots.
    pub free: AtomicU64,
    /// Allocations queued for slots.
    pub waiting: AtomicU64,
}

/// One connection's place among `server.max_connections`, given back on drop.
#[derive(Debug)]
pub struct ConnectionSlot(Arc<AtomicUsize>);

impl Drop for ConnectionSlot {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

impl ConnectionSlot {
    /// Takes a place among `open` connections if fewer than `max` are.
    pub(super) fn take(open: &Arc<AtomicUsize>, max: usize) -> Option<ConnectionSlot> {
        open.fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
            (n < max).then_some(n + 1)
        })
        .ok()
        .map(|_| ConnectionSlot(open.clone()))
    }
}
