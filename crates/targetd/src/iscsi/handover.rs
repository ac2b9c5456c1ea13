//! An upgrade's handover of iSCSI sessions, the running process's half: every normal
//! session's connections parked ([`Control::park`]: each stops reading between two PDUs,
//! finishes its tasks and reports its state and a duplicate of its socket), each session's
//! state gathered for the successor ([`SessionState`], the encoding `iscsi_pdu::handover`
//! checks). Until [`ParkedSessions::release`], nothing is lost: dropping the parked sessions
//! (the successor failed, refused the state or timed out) lets every connection serve on
//! where it stopped, and the initiators see only a pause.
//!
//! The successor's half, [`adopt`]: a session taken in under its TSIH (its I_T nexus
//! reopened with the unit attentions pending in the old process, its CmdSN order going on),
//! each connection served on a reactor from its state and socket, no login run.
//!
//! Sessions with an iSER connection are not parked (a queue pair cannot move between
//! processes); nor are discovery sessions, which are closed instead. NVMe/TCP controllers
//! park and are taken in beside the sessions, on the same deadline and in the same
//! every-one-or-none adoption ([`crate::nvme::handover`]).

use std::collections::BTreeMap;
use std::os::fd::OwnedFd;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use iscsi_pdu::handover::{ConnectionState, SessionState};
use tokio::sync::{mpsc, watch};

use iscsi_pdu::negotiation::{Negotiator, Role};
use iscsi_pdu::target_node::SessionError;

use super::login::Outcome;
use super::session::{ConnectionInfo, Session};
use crate::control::{Control, Parked, ParkedState};
use crate::handover::{Handover, UnitHandover};
use crate::nvme::handover::{ControllerError, ControllerHandover, NamespaceHandover};
use crate::reactor::{Handle, Task};
use crate::registry::{Peer, Registry};
use crate::unit::next_id;

/// How often the parking looks for a session whose stopped connections hold back its
/// CmdSN order (and those it let read on are asked to park again).
const REOPEN_TICK: Duration = Duration::from_millis(20);

/// How much longer than its deadline a park waits once it has aborted the writes still owed
/// data-out: for those aborts to be answered and the commands whose backend operation runs
/// to end (at most the park's own time).
pub const OVERDUE_GRACE: Duration = Duration::from_secs(1);

/// Why the sessions could not be parked; every connection serves on.
#[derive(Debug, thiserror::Error)]
pub enum ParkError {
    /// Connections still had tasks (commands whose backend operation runs, commands waiting
    /// for an earlier CmdSN) at the deadline and [`OVERDUE_GRACE`] after it.
    #[error(
        "{left} of {asked} connections did not quiesce within {within:?} and the grace after \
         it: {}",
        stuck.join(", ")
    )]
    Timeout {
        /// Connections that did not report.
        left: usize,
        /// Connections asked to park.
        asked: usize,
        /// The deadline.
        within: Duration,
        /// Each of those that did not, for the log: its session's TSIH, its CID, its
        /// initiator's address, and how many commands its session held waiting for an
        /// earlier CmdSN.
        stuck: Vec<String>,
    },
    /// A session's connections changed (one joined or left) or its CmdSN order held a
    /// command while parking.
    #[error("session {0:#x} changed while it was parked")]
    Changed(u16),
    /// An NVMe/TCP controller's queues changed while parking.
    #[error(transparent)]
    Controller(#[from] ControllerError),
}

/// Every handed-over session parked: their states and sockets, and the units' states, for
/// the successor.
#[derive(Debug)]
pub struct ParkedSessions {
    /// Each session's state and its connections' sockets, in the order of its
    /// `connections`.
    pub sessions: Vec<(SessionState, Vec<OwnedFd>)>,
    /// Every unit's state beyond its nexuses (reservations, mode pages), taken once every
    /// session was parked.
    pub units: Vec<UnitHandover>,
    /// Each NVMe/TCP controller's state with its queues' sockets ([`crate::nvme::handover`]).
    pub controllers: Vec<ControllerHandover>,
    /// Every NVMe namespace's reservations.
    pub namespaces: Vec<NamespaceHandover>,
    /// WRITEs aborted at the deadline because their data-out was still owed.
    pub aborted: u64,
    /// The parked connections' controls: told to serve on when this is dropped, or to let
    /// go once released.
    controls: Vec<Arc<Control>>,
    /// The sessions whose windows are held: let go when this is dropped.
    frozen: Vec<Arc<Session>>,
}

impl ParkedSessions {
    /// The successor serves them: every parked connection ends here without a word to its
    /// initiator (its socket lives on in the successor).
    pub fn release(mut self) {
        self.frozen.clear();
        for c in self.controls.drain(..) {
            c.release();
        }
    }
}

impl Drop for ParkedSessions {
    /// Not released: the handover failed, and every connection serves on here.
    fn drop(&mut self) {
        for s in self.frozen.drain(..) {
            s.thaw_window();
        }
        for c in self.controls.drain(..) {
            c.serve();
        }
    }
}

/// Parks every normal iSCSI session over TCP within `within`: each connection stops reading
/// between two PDUs once nothing begun waits for its initiator, and reports once its tasks
/// are over. At the deadline, the writes still owed data-out are aborted (they end TASK
/// ABORTED, and their initiators send them again), and the connections get
/// [`OVERDUE_GRACE`] more. On any failure every connection serves on.
pub async fn park_sessions(
    registry: &Registry,
    within: Duration,
) -> Result<ParkedSessions, ParkError> {
    let (tx, mut rx) = mpsc::unbounded_channel();
    let mut parked = ParkedSessions {
        sessions: Vec::new(),
        units: Vec::new(),
        controllers: Vec::new(),
        namespaces: Vec::new(),
        aborted: 0,
        controls: Vec::new(),
        frozen: Vec::new(),
    };
    let aborts_before = registry.counters.park_aborts.load(Ordering::Relaxed);
    let mut asked = Vec::new();
    for session in registry.sessions.all() {
        let conns = registry.sessions.connections(&session);
        // An ending session (logged out, reinstated, killed) is not handed over: its
        // connections close rather than report.
        let ending = registry.sessions.get(session.tsih).is_none();
        if ending || conns.is_empty() || conns.iter().any(|c| c.iser) {
            continue;
        }
        session.freeze_window();
        parked.frozen.push(session.clone());
        for c in &conns {
            c.control.park(tx.clone());
            parked.controls.push(c.control.clone());
        }
        asked.push((session, conns));
    }
    // NVMe/TCP controllers park beside them, on the same deadline.
    let controllers = crate::nvme::handover::ask(registry, &tx);
    parked
        .controls
        .extend(controllers.iter().flat_map(|a| a.controls().cloned()));
    let expected: usize = asked.iter().map(|(_, c)| c.len()).sum::<usize>()
        + controllers.iter().map(|a| a.ids().count()).sum::<usize>();
    let mut reports: BTreeMap<u64, Parked> = BTreeMap::new();
    let mut deadline = tokio::time::Instant::now() + within;
    let mut overdue = false;
    let mut tick = tokio::time::interval(REOPEN_TICK);
    while reports.len() < expected {
        tokio::select! {
            p = rx.recv() => {
                if let Some(p) = p {
                    reports.insert(p.id, p);
                }
            }
            _ = tick.tick() => {
                // A queue that left never reports: the park fails now.
                if let Some(a) = controllers.iter().find(|a| !a.unchanged(registry)) {
                    return Err(ParkError::Controller(a.changed()));
                }
                // Of two connections of a session, one may have stopped with the next
                // command in its socket while the other read the one after, which then waits
                // for it: the stopped ones are asked to park anew, and read on to the gap's
                // end (only what fills it) before they stop again.
                for (session, conns) in &asked {
                    // A connection that left (its initiator logged out or it broke) never
                    // reports: the park fails now rather than at its deadline.
                    let now = registry.sessions.connections(session);
                    if now.len() != conns.len() || now.iter().zip(conns).any(|(a, b)| a.id != b.id) {
                        return Err(ParkError::Changed(session.tsih));
                    }
                    // A reader that could not stop when asked (a command of its session
                    // waited for an earlier one) waits for bytes that, the window held, may
                    // never come: it looks again.
                    for c in conns.iter().filter(|c| !reports.contains_key(&c.id)) {
                        tracing::debug!(
                            tsih = session.tsih,
                            connection = c.id,
                            queued = session.queued(),
                            "not parked yet: looks again"
                        );
                        c.control.reader.notify_one();
                    }
                    let stopped: Vec<_> =
                        conns.iter().filter(|c| reports.contains_key(&c.id)).collect();
                    if !stopped.is_empty() && stopped.len() < conns.len() && session.queued() > 0 {
                        for c in stopped {
                            reports.remove(&c.id);
                            c.control.serve();
                            c.control.park(tx.clone());
                            if overdue {
                                c.control.overdue();
                            }
                        }
                    }
                }
            }
            _ = tokio::time::sleep_until(deadline) => {
                if !overdue {
                    // What waits for its initiator's data-out is aborted as ABORT TASK would
                    // (it ends TASK ABORTED, and the initiator sends it again): those
                    // connections can stop reading, and get a little longer to park.
                    overdue = true;
                    deadline = tokio::time::Instant::now() + within.min(OVERDUE_GRACE);
                    for (_, conns) in &asked {
                        for c in conns.iter().filter(|c| !reports.contains_key(&c.id)) {
                            c.control.overdue();
                        }
                    }
                    tracing::info!(
                        left = expected - reports.len(),
                        "not parked within {within:?}: aborting the writes still owed data-out"
                    );
                    continue;
                }
                let stuck = asked
                    .iter()
                    .flat_map(|(session, conns)| {
                        let queued = session.queued();
                        conns
                            .iter()
                            .filter(|c| !reports.contains_key(&c.id))
                            .map(move |c| {
                                format!(
                                    "session {:#x} connection {} from {} ({queued} commands \
                                     waiting for an earlier CmdSN)",
                                    session.tsih, c.cid, c.peer
                                )
                            })
                    })
                    .chain(
                        controllers
                            .iter()
                            .filter(|a| a.ids().any(|id| !reports.contains_key(&id)))
                            .map(|a| a.describe()),
                    )
                    .collect();
                return Err(ParkError::Timeout {
                    left: expected - reports.len(),
                    asked: expected,
                    within,
                    stuck,
                });
            }
        }
    }
    for (session, conns) in asked {
        let now = registry.sessions.connections(&session);
        let same = now.len() == conns.len() && now.iter().zip(&conns).all(|(a, b)| a.id == b.id);
        let mut states = Vec::with_capacity(conns.len());
        let mut sockets = Vec::with_capacity(conns.len());
        for c in &conns {
            match reports.remove(&c.id) {
                Some(Parked {
                    state: ParkedState::Iscsi { tsih, state },
                    socket,
                    ..
                }) if same && tsih == session.tsih => {
                    states.push(state);
                    sockets.push(socket);
                }
                _ => return Err(ParkError::Changed(session.tsih)),
            }
        }
        let state = session
            .handover_state(states)
            .ok_or(ParkError::Changed(session.tsih))?;
        parked.sessions.push((state, sockets));
    }
    let (nvme, namespaces) = crate::nvme::handover::gather(registry, &controllers, &mut reports)?;
    parked.controllers = nvme;
    parked.namespaces = namespaces;
    // Every connection that aborted a write did so before it reported.
    parked.aborted = registry
        .counters
        .park_aborts
        .load(Ordering::Relaxed)
        .saturating_sub(aborts_before);
    // Nothing of the parked sessions runs now: their units' reservations and mode pages are
    // what the successor must start from.
    for target in registry.targets() {
        let states = target.with_core(|core, _| core.device().unit_states());
        parked
            .units
            .extend(states.into_iter().map(|(lun, serial, state)| UnitHandover {
                target: target.name.clone(),
                lun,
                serial,
                state,
            }));
    }
    Ok(parked)
}

/// Why a handed-over session was not taken in; its sockets are closed, and its initiator
/// logs in again.
#[derive(Debug, thiserror::Error)]
pub enum AdoptError {
    /// Not one socket per connection of the state.
    #[error("{sockets} sockets for {connections} connections")]
    Sockets {
        /// Sockets that came.
        sockets: usize,
        /// Connections in the state.
        connections: usize,
    },
    /// The state names no target, or one this process does not serve.
    #[error("no target {0:?} here")]
    NoTarget(String),
    /// The state names no initiator.
    #[error("the state names no InitiatorName")]
    NoInitiator,
    /// A socket is not a connected TCP socket.
    #[error("a connection's socket: {0}")]
    Socket(std::io::Error),
    /// `server.max_connections` are open.
    #[error("server.max_connections connections are open")]
    TooManyConnections,
    /// The session table refused it (its TSIH or I_T nexus is taken, the table is full).
    #[error("the session table refused it: {0:?}")]
    Session(SessionError),
    /// No reactor runs.
    #[error("no reactor runs")]
    NoReactor,
    /// An NVMe/TCP controller was not taken in.
    #[error(transparent)]
    Controller(#[from] ControllerError),
}

/// Sessions taken in ([`adopt`]), their connections on the reactors but not reading or
/// writing yet: the old process has not let go of them. [`serve`](Self::serve) once it has;
/// dropped without, each connection ends without a word (its socket closed, not shut down, so
/// that the old process serves on on it).
#[derive(Debug)]
pub struct Adopted {
    /// Their TSIHs.
    pub tsihs: Vec<u16>,
    /// The NVMe/TCP controllers taken in beside them, by CNTLID.
    pub cntlids: Vec<u16>,
    go: watch::Sender<bool>,
}

impl Adopted {
    /// The old process let go: every connection reads from where it stopped, its first PDU
    /// announcing the command window.
    pub fn serve(self) {
        self.go.send_replace(true);
    }
}

/// One connection of a session being taken in: everything it needs to be served, had
/// before anything is registered.
struct Taken<'r> {
    state: ConnectionState,
    stream: std::net::TcpStream,
    slot: crate::registry::ConnectionSlot,
    reactor: &'r Handle,
    peer: Peer,
    info: ConnectionInfo,
}

/// Takes in the sessions another process parked and handed over (`sockets` each session's
/// connections' in the order of its `state.connections`), every one or none: each is checked
/// and its connections' places, reactors and sockets had first, then all are entered in the
/// session table (one refused takes the others out again), and only then is any connection
/// served, on the least loaded of `reactors`. So a refusal leaves nothing served here, and the
/// old process, told so, serves on. The connections wait for [`Adopted::serve`].
pub fn adopt(
    registry: &Arc<Registry>,
    reactors: &[Handle],
    handover: Handover,
) -> Result<Adopted, AdoptError> {
    let Handover {
        units,
        sessions,
        namespaces,
        controllers,
    } = handover;
    let mut prepared = Vec::with_capacity(sessions.len());
    for (state, sockets) in sessions {
        let (target, initiator, conns) = prepare(registry, reactors, &state, sockets)?;
        prepared.push((state, target, initiator, conns));
    }
    // The NVMe/TCP controllers, every one or none, before any session is entered: a
    // session refused below takes them out again.
    let nvme = crate::nvme::handover::adopt(registry, reactors, controllers, namespaces)?;
    // The units first, so that the sessions find their reservations as they left them. A
    // unit this process does not serve under that target and LUN, or serves with another
    // serial number (another unit), keeps its own state.
    for u in units {
        let Some(target) = registry.target(&u.target) else {
            tracing::warn!(
                target = u.target,
                lun = u.lun,
                "a unit's state for a target not served here: dropped"
            );
            continue;
        };
        let adopted = target.with_core(|core, _| {
            let same = core.device().unit_serial(u.lun) == Some(u.serial.as_str());
            same.then(|| core.router().adopt_unit_state(u.lun, u.state))
        });
        if !matches!(adopted, Some(Ok(()))) {
            tracing::warn!(
                target = u.target,
                lun = u.lun,
                serial = u.serial,
                "a unit's state for a unit not served here: dropped"
            );
        }
    }
    let mut entered: Vec<(Arc<Session>, Vec<Taken>)> = Vec::new();
    for (state, target, initiator, conns) in prepared {
        let infos = conns.iter().map(|c| c.info.clone()).collect();
        match registry.sessions.adopt(&state, &initiator, target, infos) {
            Ok(session) => entered.push((session, conns)),
            Err(e) => {
                crate::nvme::handover::undo(&nvme);
                for (session, conns) in entered {
                    for c in &conns {
                        registry.sessions.leave(&session, c.peer.id);
                    }
                    let nexus = session.nexus;
                    session
                        .target
                        .with_core(|core, out| core.close_session(nexus, out));
                }
                return Err(AdoptError::Session(e));
            }
        }
    }
    let settings = registry.settings();
    let (go, waiting) = watch::channel(false);
    let cntlids = crate::nvme::handover::spawn(registry, nvme, &waiting);
    let mut tsihs = Vec::with_capacity(entered.len());
    for (session, conns) in entered {
        tsihs.push(session.tsih);
        tracing::info!(
            tsih = session.tsih,
            initiator = session.initiator,
            target = session.target.name,
            "session adopted"
        );
        for Taken {
            mut state,
            stream,
            slot,
            reactor,
            peer,
            ..
        } in conns
        {
            registry.register(peer.id, peer.control.clone());
            let negotiator = Negotiator::established(
                Role::Target,
                settings.clone(),
                session.params.clone(),
                state.params,
            );
            let unread = std::mem::take(&mut state.unread);
            let outcome = Outcome::Adopted {
                session: session.clone(),
                negotiator,
                state,
            };
            let registry = registry.clone();
            let (id, index) = (peer.id, reactor.index);
            let mut waiting = waiting.clone();
            let task: Task = Box::new(move |io| {
                Box::pin(async move {
                    if waiting.wait_for(|go| *go).await.is_err() {
                        // Not let go of by the old process, which serves on: the socket is
                        // closed without a shutdown, and the connection leaves its session
                        // here without closing the nexus.
                        if let Outcome::Adopted { session, .. } = &outcome {
                            registry.sessions.leave(session, id);
                        }
                        registry.unregister(id);
                        drop(slot);
                        return;
                    }
                    super::connection::resume(stream, io, registry, peer, outcome, unread).await;
                    drop(slot);
                })
            });
            if !reactor.spawn(task) {
                tracing::error!(connection = id, "reactor {index} is gone");
            }
        }
    }
    Ok(Adopted { tsihs, cntlids, go })
}

/// Every part of a handover has been through [`adopt`] (an upgrade hands everything in one,
/// a restart through the service manager's store the units and then each session on its
/// own): what the units' states kept for nexuses that did not come goes
/// ([`scsi_core::Device::end_handover`]).
pub fn end_handover(registry: &Registry) {
    for target in registry.targets() {
        target.with_core(|core, _| core.router().end_handover());
    }
}

/// Checks a handed-over session against this process (its target served here, its initiator
/// named, one socket per connection) and has each connection's place, reactor and socket.
fn prepare<'r>(
    registry: &Registry,
    reactors: &'r [Handle],
    state: &SessionState,
    sockets: Vec<OwnedFd>,
) -> Result<(Arc<crate::target::Target>, String, Vec<Taken<'r>>), AdoptError> {
    if sockets.len() != state.connections.len() {
        return Err(AdoptError::Sockets {
            sockets: sockets.len(),
            connections: state.connections.len(),
        });
    }
    let declared = &state.params.declared;
    let name = declared.target_name.clone().unwrap_or_default();
    let target = registry
        .target(&name)
        .ok_or_else(|| AdoptError::NoTarget(name.clone()))?;
    let initiator = declared
        .initiator_name
        .clone()
        .ok_or(AdoptError::NoInitiator)?;
    let mut conns = Vec::with_capacity(sockets.len());
    for (c, fd) in state.connections.iter().zip(sockets) {
        let stream = std::net::TcpStream::from(fd);
        let (addr, local) = stream
            .peer_addr()
            .and_then(|a| stream.local_addr().map(|l| (a, l)))
            .map_err(AdoptError::Socket)?;
        let slot = registry
            .open_connection()
            .ok_or(AdoptError::TooManyConnections)?;
        let reactor = reactors
            .iter()
            .min_by_key(|r| r.connections.load(std::sync::atomic::Ordering::Relaxed))
            .ok_or(AdoptError::NoReactor)?;
        let peer = Peer {
            id: next_id(),
            addr,
            local,
            reactor: reactor.index,
            control: Arc::new(Control::default()),
            iser: false,
            max_window: u32::MAX,
        };
        let info = ConnectionInfo {
            cid: c.cid,
            id: peer.id,
            peer: addr,
            local,
            reactor: reactor.index,
            digests: (c.params.header_digest, c.params.data_digest),
            iser: false,
            segment_lengths: (
                c.params.max_recv_data_segment_length,
                c.params.max_send_data_segment_length,
            ),
            control: peer.control.clone(),
        };
        conns.push(Taken {
            state: c.clone(),
            stream,
            slot,
            reactor,
            peer,
            info,
        });
    }
    Ok((target, initiator, conns))
}
