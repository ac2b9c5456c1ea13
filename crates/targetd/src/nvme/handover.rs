//! An upgrade's handover of NVMe/TCP controllers, beside the iSCSI sessions'
//! ([`crate::iscsi::handover`], which runs both on one deadline): the running process asks
//! every queue of each controller whose queues are all NVMe/TCP connections here to park
//! ([`ask`]: each stops taking commands, finishes those in flight and reports its queue's
//! state and a duplicate of its socket), then takes each controller's state from its
//! subsystem with its queues' ([`gather`]), and every namespace's reservations. The
//! successor takes each controller in under its CNTLID ([`adopt`]) and serves its queues from
//! where they stopped ([`spawn`]), no Connect run; the host sees a pause.
//!
//! Not handed over: discovery controllers, and a controller with a queue on another
//! transport or one not connected yet; their connections close as the old process stops,
//! and the host reconnects.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Instant;

pub use crate::handover::{ControllerHandover, NamespaceHandover};
use tokio::sync::{mpsc, watch};

use super::NvmeSubsystem;
use crate::control::{Control, Parked, ParkedState};
use crate::reactor::{Handle, Task};
use crate::registry::{ConnectionSlot, Registry};

/// Why the controllers were not parked or taken in.
#[derive(Debug, thiserror::Error)]
pub enum ControllerError {
    /// A queue of the controller left, or its queues changed, while parking.
    #[error("controller {cntlid} of {nqn} changed while it was parked")]
    Changed {
        /// Its subsystem.
        nqn: String,
        /// CNTLID.
        cntlid: u16,
    },
    /// No subsystem of that NQN here.
    #[error("no subsystem {0} here")]
    NoSubsystem(String),
    /// The subsystem refused it.
    #[error("controller {cntlid} of {nqn}: {error}")]
    Adopt {
        /// Its subsystem.
        nqn: String,
        /// CNTLID.
        cntlid: u16,
        /// Why.
        error: nvme::controller::AdoptError,
    },
    /// Not one socket per queue.
    #[error("controller {cntlid}: {sockets} sockets for {queues} queues")]
    Sockets {
        /// CNTLID.
        cntlid: u16,
        /// Sockets.
        sockets: usize,
        /// Queues.
        queues: usize,
    },
    /// A socket is not a connected TCP socket.
    #[error("a queue's socket: {0}")]
    Socket(std::io::Error),
    /// `server.max_connections` are open.
    #[error("server.max_connections connections are open")]
    TooManyConnections,
    /// No reactor runs.
    #[error("no reactor runs")]
    NoReactor,
}

/// A controller asked to park: its subsystem, CNTLID and queues (connection id, QID, control).
pub struct Asked {
    subsystem: Arc<NvmeSubsystem>,
    cntlid: u16,
    queues: Vec<(u64, u16, Arc<Control>)>,
}

impl Asked {
    /// Its queues' connection ids.
    pub fn ids(&self) -> impl Iterator<Item = u64> + '_ {
        self.queues.iter().map(|(id, _, _)| *id)
    }

    /// Its queues' controls.
    pub fn controls(&self) -> impl Iterator<Item = &Arc<Control>> + '_ {
        self.queues.iter().map(|(_, _, c)| c)
    }

    /// What the log says of it.
    pub fn describe(&self) -> String {
        format!(
            "NVMe controller {} of {} ({} queues)",
            self.cntlid,
            self.subsystem.nqn,
            self.queues.len()
        )
    }

    /// Whether its queues are still the connections it was asked with.
    pub fn unchanged(&self, registry: &Registry) -> bool {
        let now = registry.nvme_queues();
        self.queues
            .iter()
            .all(|(id, _, _)| now.iter().any(|(i, _)| i == id))
    }

    /// The error that says it changed.
    pub fn changed(&self) -> ControllerError {
        ControllerError::Changed {
            nqn: self.subsystem.nqn.clone(),
            cntlid: self.cntlid,
        }
    }
}

/// Asks every queue of each controller whose admin queue and every I/O queue its subsystem
/// counts are NVMe/TCP connections here to park, and to report to `tx`.
pub fn ask(registry: &Registry, tx: &mpsc::UnboundedSender<Parked>) -> Vec<Asked> {
    let mut by_controller: BTreeMap<(u64, u16), Asked> = BTreeMap::new();
    for (id, q) in registry.nvme_queues() {
        if Arc::ptr_eq(&q.subsystem, &registry.nvme_discovery) {
            continue;
        }
        by_controller
            .entry((q.subsystem.id, q.queue.cntlid))
            .or_insert_with(|| Asked {
                subsystem: q.subsystem.clone(),
                cntlid: q.queue.cntlid,
                queues: Vec::new(),
            })
            .queues
            .push((id, q.queue.qid, q.control.clone()));
    }
    let mut asked = Vec::new();
    for (_, mut a) in by_controller {
        a.queues.sort_by_key(|(_, qid, _)| *qid);
        let io: Vec<u16> = a
            .queues
            .iter()
            .map(|(_, q, _)| *q)
            .filter(|&q| q > 0)
            .collect();
        let whole = a.queues.first().is_some_and(|(_, q, _)| *q == 0)
            && a.subsystem.with_machine(|m| m.io_queues(a.cntlid)) == io;
        if !whole {
            tracing::info!(
                controller = a.cntlid,
                subsystem = a.subsystem.nqn,
                "an NVMe controller with a queue not connected here is not handed over"
            );
            continue;
        }
        for (_, _, control) in &a.queues {
            control.park(tx.clone());
        }
        asked.push(a);
    }
    asked
}

/// Once every queue of `asked` reported (in `reports`, taken from there): each controller's
/// state with its queues' states and sockets, and every subsystem's namespaces'
/// reservations.
pub fn gather(
    registry: &Registry,
    asked: &[Asked],
    reports: &mut BTreeMap<u64, Parked>,
) -> Result<(Vec<ControllerHandover>, Vec<NamespaceHandover>), ControllerError> {
    let mut controllers = Vec::with_capacity(asked.len());
    for a in asked {
        let mut queues = Vec::with_capacity(a.queues.len());
        let mut sockets = Vec::with_capacity(a.queues.len());
        for (id, qid, _) in &a.queues {
            match reports.remove(id) {
                Some(Parked {
                    state: ParkedState::NvmeTcp(q),
                    socket,
                    ..
                }) if q.qid == *qid => {
                    queues.push(q);
                    sockets.push(socket);
                }
                _ => return Err(a.changed()),
            }
        }
        let mut state = a
            .subsystem
            .with_machine(|m| m.controller_state(a.cntlid))
            .ok_or_else(|| a.changed())?;
        state.queues = queues;
        controllers.push((state, sockets));
    }
    let namespaces = registry
        .subsystems()
        .iter()
        .flat_map(|s| {
            let states = s.with_machine(|m| m.namespace_states());
            states.into_iter().map(|n| (s.nqn.clone(), n))
        })
        .collect();
    Ok((controllers, namespaces))
}

/// A controller taken in, its queues' connections ready to be served.
pub struct Taken<'r> {
    subsystem: Arc<NvmeSubsystem>,
    admin: nvme::controller::Queue,
    queues: Vec<TakenQueue<'r>>,
}

struct TakenQueue<'r> {
    /// Its state, the binding the subsystem gave it and the digests granted: its machine is
    /// made on its reactor (it holds the reactor's buffers).
    state: nvme::handover::QueueState,
    bound: nvme::controller::Queue,
    grants: nvme::tcp::Digests,
    stream: std::net::TcpStream,
    slot: ConnectionSlot,
    reactor: &'r Handle,
}

/// Takes in the namespaces' reservations, then every controller under its CNTLID, every one
/// or none (one refused takes the others out again). Nothing is served until [`spawn`].
pub fn adopt<'r>(
    registry: &Registry,
    reactors: &'r [Handle],
    controllers: Vec<ControllerHandover>,
    namespaces: Vec<NamespaceHandover>,
) -> Result<Vec<Taken<'r>>, ControllerError> {
    for (nqn, n) in &namespaces {
        let adopted = registry
            .subsystem(nqn)
            .map(|s| s.with_machine(|m| m.adopt_namespace_state(n)));
        if !matches!(adopted, Some(Ok(()))) {
            tracing::warn!(
                subsystem = nqn,
                nsid = n.nsid,
                "a namespace's reservations for a namespace not served here: dropped"
            );
        }
    }
    let mut taken: Vec<Taken<'r>> = Vec::with_capacity(controllers.len());
    for c in controllers {
        match adopt_one(registry, reactors, c) {
            Ok(t) => taken.push(t),
            Err(e) => {
                undo(&taken);
                return Err(e);
            }
        }
    }
    Ok(taken)
}

fn adopt_one<'r>(
    registry: &Registry,
    reactors: &'r [Handle],
    (state, sockets): ControllerHandover,
) -> Result<Taken<'r>, ControllerError> {
    if sockets.len() != state.queues.len() {
        return Err(ControllerError::Sockets {
            cntlid: state.cntlid,
            sockets: sockets.len(),
            queues: state.queues.len(),
        });
    }
    let subsystem = registry
        .subsystem(&state.subnqn)
        .filter(|s| !Arc::ptr_eq(s, &registry.nvme_discovery))
        .ok_or_else(|| ControllerError::NoSubsystem(state.subnqn.clone()))?;
    // Everything the queues need had before the controller is entered.
    let mut had = Vec::with_capacity(sockets.len());
    for fd in sockets {
        let stream = std::net::TcpStream::from(fd);
        stream.peer_addr().map_err(ControllerError::Socket)?;
        let slot = registry
            .open_connection()
            .ok_or(ControllerError::TooManyConnections)?;
        let reactor = reactors
            .iter()
            .min_by_key(|r| r.connections.load(std::sync::atomic::Ordering::Relaxed))
            .ok_or(ControllerError::NoReactor)?;
        had.push((stream, slot, reactor));
    }
    let bound = subsystem
        .with_machine(|m| m.adopt_controller(Instant::now(), &state))
        .map_err(|error| ControllerError::Adopt {
            nqn: state.subnqn.clone(),
            cntlid: state.cntlid,
            error,
        })?;
    let grants = super::tcp::settings(&registry.config().nvme).digests;
    let queues = state
        .queues
        .iter()
        .zip(bound.iter())
        .zip(had)
        .map(|((q, b), (stream, slot, reactor))| TakenQueue {
            state: q.clone(),
            bound: *b,
            grants,
            stream,
            slot,
            reactor,
        })
        .collect();
    tracing::info!(
        controller = state.cntlid,
        subsystem = state.subnqn,
        host = state.hostnqn,
        queues = state.queues.len(),
        "NVMe controller adopted"
    );
    Ok(Taken {
        subsystem,
        admin: bound[0],
        queues,
    })
}

/// Takes controllers taken in out of their subsystems again (another part of the handover
/// was refused).
pub fn undo(taken: &[Taken<'_>]) {
    for t in taken {
        t.subsystem.with_machine(|m| m.disconnect(&t.admin));
    }
}

/// Puts every queue of `taken` on its reactor, to be served once `waiting` says go; dropped
/// without (the old process serves on), each ends without a word. The CNTLIDs.
pub fn spawn(
    registry: &Arc<Registry>,
    taken: Vec<Taken<'_>>,
    waiting: &watch::Receiver<bool>,
) -> Vec<u16> {
    let mut cntlids = Vec::with_capacity(taken.len());
    for t in taken {
        cntlids.push(t.admin.cntlid);
        for q in t.queues {
            let (registry, subsystem) = (registry.clone(), t.subsystem.clone());
            let mut waiting = waiting.clone();
            let TakenQueue {
                state,
                bound,
                grants,
                stream,
                slot,
                reactor,
            } = q;
            let index = reactor.index;
            let task: Task = Box::new(move |io| {
                Box::pin(async move {
                    if waiting.wait_for(|go| *go).await.is_ok() {
                        let machine =
                            nvme::tcp::ControllerConnection::resume(&state, bound, grants);
                        match tokio::net::TcpStream::from_std(stream) {
                            Ok(s) => super::tcp::resume(s, io, registry, machine, subsystem).await,
                            Err(e) => tracing::warn!("an adopted NVMe/TCP queue's socket: {e}"),
                        }
                    }
                    drop(slot);
                })
            });
            if !reactor.spawn(task) {
                tracing::error!("reactor {index} is gone");
            }
        }
    }
    cntlids
}
