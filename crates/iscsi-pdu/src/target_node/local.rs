//! A whole iSCSI target in one place: one SCSI device ([`TargetCore`]), its sessions
//! ([`SessionTable`]) and the routes of tasks to connections, for an embedder whose I/O runs
//! every connection from one thread (or under one lock), as `examples/tcp_target.rs` does over
//! std sockets and the test rig does on a virtual clock.
//!
//! What is left to the embedder is only I/O: reading bytes into a [`crate::Deframer`], handing
//! PDUs to each connection's [`Connection`] with the [`Core`] that [`LocalTarget::connection`]
//! gives, carrying out its [`super::Event`]s (a backend operation, a buffer), writing its
//! [`super::Transmit`]s, and closing the connections listed in
//! [`LocalTarget::close_requests`]. A daemon that runs connections on several threads shares its
//! core behind a lock instead and writes its own [`Core`] (targetd does).
//!
//! Connections are named by a route, a `u64` the embedder chooses (an index or a token),
//! unique among live connections.

use std::collections::{BTreeMap, VecDeque};

use scsi_core::transport::TaskBuffer;
use scsi_core::{BackendError, Device, NexusId, Output, TaskId, TmfFunction, TransportId};

use super::connection::{Connection, Core, CoreEvent, OrderedCommand, TaskCore};
use super::core::{Sink, TargetCore};
use super::login::{Completed, LoginPolicy};
use super::session::{Created, Left, SessionError, SessionKey, SessionTable};
use crate::chap::ENTROPY_LEN;
use crate::negotiation::{AuthMethod, NegotiationError, Settings};
use crate::text::TextParams;
use crate::{LoginStatus, SerialNumber};

/// Each connection's core events, by route: what the core decided for a connection while
/// another one held it.
#[derive(Debug, Default)]
struct Queues(BTreeMap<u64, VecDeque<CoreEvent>>);

impl Sink<u64> for Queues {
    fn push(&mut self, route: &u64, event: CoreEvent) {
        // A route with no queue is a connection that has gone: its events have no one to reach.
        if let Some(q) = self.0.get_mut(route) {
            q.push_back(event);
        }
    }
}

/// A login admitted into a session ([`LocalTarget::admit`]): what its connection needs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Admitted {
    /// The connection's route.
    pub route: u64,
    /// Its session's TSIH.
    pub tsih: u16,
    /// Its session's I_T nexus.
    pub nexus: NexusId,
    /// ExpCmdSN and MaxCmdSN for the final Login Response.
    pub window: (SerialNumber, SerialNumber),
    /// Routes of connections the login replaced (session reinstatement, or a connection of
    /// the same CID): the embedder closes them ([`LocalTarget::leave`]).
    pub replaced: Vec<u64>,
}

/// One target's SCSI core and sessions, reached by every connection through
/// [`LocalTarget::connection`].
#[derive(Debug)]
pub struct LocalTarget {
    /// The device, each session's CmdSN order and the routes of tasks.
    pub core: TargetCore<u64>,
    /// The sessions: each with its I_T nexus, its connections by route.
    pub sessions: SessionTable<NexusId, u64>,
    /// Connections that something asked to close (a logout naming them, a logout of their
    /// session, TARGET COLD RESET), by route. The embedder closes each and then calls
    /// [`LocalTarget::leave`].
    pub close_requests: Vec<u64>,
    queues: Queues,
    /// What SendTargets answers: target names and their addresses (`host:port,tpgt`).
    addresses: Vec<(String, String)>,
    /// A new session's command window.
    window: u32,
    /// Tasks a connection retired that the core did not know as delegated: a fault in the
    /// connection machine, counted rather than panicking on the network's behalf.
    misretired: u64,
}

impl LocalTarget {
    /// A target serving `device`, whose sessions get a command window of `window` commands.
    pub fn new(device: Device, window: u32) -> LocalTarget {
        LocalTarget {
            core: TargetCore::new(device),
            sessions: SessionTable::new(),
            close_requests: Vec::new(),
            queues: Queues::default(),
            addresses: Vec::new(),
            window: window.max(1),
            misretired: 0,
        }
    }

    /// Adds `address` (`host:port,tpgt`) to what SendTargets answers for `target`.
    pub fn advertise(&mut self, target: &str, address: &str) {
        self.addresses.push((target.into(), address.into()));
    }

    /// ExpCmdSN and MaxCmdSN of the session `nexus`; a session that has ended has no window,
    /// and its connections send nothing more, so zeros do.
    pub fn window(&self, nexus: NexusId) -> (SerialNumber, SerialNumber) {
        let none = (SerialNumber(0), SerialNumber(0));
        self.core.window(nexus).unwrap_or(none)
    }

    /// ExpCmdSN and MaxCmdSN for a Login Response before the last: session `tsih`'s window,
    /// or a new session's from `cmd_sn`.
    pub fn login_window(&self, tsih: u16, cmd_sn: SerialNumber) -> (SerialNumber, SerialNumber) {
        let session = (tsih != 0).then(|| self.sessions.get(tsih)).flatten();
        match session.and_then(|s| self.core.window(s.value)) {
            Some(w) => w,
            None => (cmd_sn, cmd_sn + (self.window - 1)),
        }
    }

    /// Admits a completed login on connection `route`: a new session (TSIH 0), reinstating
    /// any session of the same initiator port, or a connection joining session `login.tsih`,
    /// replacing one with the same CID. The replaced connections are in the answer.
    pub fn admit(&mut self, login: &Completed, route: u64) -> Result<Admitted, SessionError> {
        let (tsih, replaced) = if login.tsih == 0 {
            let key = SessionKey {
                isid: login.isid,
                initiator: login.initiator.clone(),
                target: login.target.clone().unwrap_or_default(),
            };
            let max = login.negotiator.session().operational.max_connections;
            let (core, window) = (&mut self.core, self.window);
            let Created { tsih, reinstated } =
                self.sessions.create(key, max, login.cid, route, |_| {
                    let id = TransportId::iscsi(&login.initiator, login.isid.0);
                    core.open_session(id, 1, login.cmd_sn, window)
                })?;
            (tsih, reinstated)
        } else {
            let target = login.target.as_deref().unwrap_or_default();
            let (tsih, isid, who) = (login.tsih, login.isid, &login.initiator);
            let replaced = self
                .sessions
                .join(tsih, isid, who, target, login.cid, route)?;
            (tsih, replaced.into_iter().collect())
        };
        let nexus = self
            .sessions
            .get(tsih)
            .ok_or(SessionError::NoSession)?
            .value;
        let window = self.window(nexus);
        // A route the embedder reuses starts with nothing of the connection it named before.
        self.queues.0.insert(route, VecDeque::new());
        Ok(Admitted {
            route,
            tsih,
            nexus,
            window,
            replaced,
        })
    }

    /// Connection `route`'s view of its session and the core: the [`Core`] its machine is
    /// handed with every input.
    pub fn connection(&mut self, route: u64, tsih: u16, nexus: NexusId) -> ConnectionCore<'_> {
        ConnectionCore {
            target: self,
            route,
            tsih,
            nexus,
        }
    }

    /// Connection `route` has closed (or was asked to): it leaves its session, its machine
    /// ends its tasks, and the session's nexus closes when it was the last connection.
    /// Call it once per admitted connection, whatever ended it.
    pub fn leave<B: TaskBuffer>(
        &mut self,
        route: u64,
        tsih: u16,
        nexus: NexusId,
        conn: &mut Connection<B>,
    ) {
        let last = match self.sessions.leave(tsih, |&r| r == route) {
            Left::Ended(_) => true,
            Left::Stays | Left::Unknown => false,
        };
        conn.close(last, &mut self.connection(route, tsih, nexus));
        if last {
            self.core.close_session(nexus, &mut self.queues);
        }
    }

    /// Forgets connection `route` once it has left ([`LocalTarget::leave`]) and its machine
    /// is idle ([`Connection::is_idle`]: the backend operations it had out came back and the
    /// core's last events for it were taken), so a long-running target keeps nothing of it.
    pub fn forget(&mut self, route: u64) {
        self.queues.0.remove(&route);
    }

    /// Tasks a connection retired that the core did not know as delegated (a fault of the
    /// connection machine; 0 unless there is one).
    pub fn misretired(&self) -> u64 {
        self.misretired
    }

    /// The routes of session `tsih`'s connections other than `me`.
    fn others(&self, tsih: u16, me: u64) -> Vec<u64> {
        self.sessions.entry(tsih).map_or(Vec::new(), |s| {
            let all = s.connections.iter().map(|&(_, route)| route);
            all.filter(|&r| r != me).collect()
        })
    }
}

/// The session and the core as one connection reaches them ([`LocalTarget::connection`]).
#[derive(Debug)]
pub struct ConnectionCore<'a> {
    target: &'a mut LocalTarget,
    route: u64,
    tsih: u16,
    nexus: NexusId,
}

impl Core for ConnectionCore<'_> {
    fn poll_core(&mut self) -> Option<CoreEvent> {
        self.target.queues.0.get_mut(&self.route)?.pop_front()
    }

    fn window(&self) -> (SerialNumber, SerialNumber) {
        self.target.window(self.nexus)
    }

    fn deliver(&mut self, cmd: OrderedCommand, immediate: bool) -> bool {
        let t = &mut *self.target;
        t.core
            .deliver(self.nexus, cmd, immediate, &self.route, &mut t.queues)
    }

    fn take_cmd_sn(&mut self, cmd_sn: SerialNumber) -> bool {
        let t = &mut *self.target;
        t.core.take_cmd_sn(self.nexus, cmd_sn, &mut t.queues)
    }

    fn send_targets(&mut self, value: &str) -> TextParams {
        // All (discovery), the session's own target (empty), or one target by name.
        let mut t = TextParams::new();
        let wanted = |name: &str| matches!(value, "All" | "") || value == name;
        for (name, address) in &self.target.addresses {
            if wanted(name) {
                t.push("TargetName", name.as_str());
                t.push("TargetAddress", address.as_str());
            }
        }
        t
    }

    fn close_connection(&mut self, cid: u16) -> bool {
        let found = self.target.sessions.entry(self.tsih).and_then(|s| {
            let at = s.connections.iter().find(|&&(c, _)| c == cid);
            at.map(|&(_, route)| route)
        });
        match found {
            Some(route) if route != self.route => {
                self.target.close_requests.push(route);
                true
            }
            _ => false,
        }
    }

    fn cancel_queued(&mut self) {
        self.target.core.cancel_queued(self.nexus, self.route);
    }

    fn close_session(&mut self) -> Option<u64> {
        let others = self.target.others(self.tsih, self.route);
        self.target.close_requests.extend(others);
        None
    }

    fn reset_target(&mut self) {
        let t = &mut *self.target;
        let me = self.route;
        let all = t.sessions.iter().flat_map(|s| s.connections.iter());
        let others: Vec<u64> = all.map(|&(_, r)| r).filter(|&r| r != me).collect();
        t.close_requests.extend(others);
    }
}

impl TaskCore for ConnectionCore<'_> {
    fn data_out(&mut self, task: TaskId, data: &[u8]) {
        let t = &mut *self.target;
        if let Err(e) = t.core.router().data_out(task, data, &mut t.queues) {
            tracing::warn!("data-out refused by the core: {e}");
        }
    }

    fn backend_done(&mut self, task: TaskId, result: Result<Output, BackendError>) {
        let t = &mut *self.target;
        if let Err(e) = t.core.router().backend_done(task, result, &mut t.queues) {
            tracing::warn!("a backend completion refused by the core: {e}");
        }
    }

    fn retire(&mut self, task: TaskId) {
        let t = &mut *self.target;
        if t.core.router().retire(task, &mut t.queues).is_err() {
            t.misretired += 1;
        }
    }

    fn task_management(&mut self, lun: u64, function: TmfFunction) -> Option<u64> {
        let t = &mut *self.target;
        t.core
            .router()
            .task_management(self.nexus, lun, function, &self.route, &mut t.queues)
            .ok()
    }

    fn block_size(&mut self, lun: u16) -> Option<u32> {
        let unit = self.target.core.device().logical_unit(lun);
        unit.map(|u| u.geometry.block_size)
    }
}

/// A [`LoginPolicy`] for a [`LocalTarget`]: normal sessions with any target the device
/// advertises, discovery sessions for anyone, the same negotiation settings for both, and the
/// session admitted on the final transit. Authorization beyond that (initiator names, CHAP
/// credentials in `settings`) is the embedder's, in a policy of its own.
#[derive(Debug)]
pub struct LocalLogin<'a> {
    target: &'a mut LocalTarget,
    settings: Settings,
    route: u64,
    entropy: Option<fn() -> [u8; ENTROPY_LEN]>,
    /// The login's admission once it completes.
    pub admitted: Option<Admitted>,
}

impl<'a> LocalLogin<'a> {
    /// The policy for a login on connection `route`, negotiating with `settings`. `entropy`
    /// gives a CSPRNG's bytes for CHAP challenges; without it, settings that offer CHAP fail
    /// every login closed (TARGET ERROR) rather than challenge predictably.
    pub fn new(
        target: &'a mut LocalTarget,
        settings: Settings,
        route: u64,
        entropy: Option<fn() -> [u8; ENTROPY_LEN]>,
    ) -> LocalLogin<'a> {
        LocalLogin {
            target,
            settings,
            route,
            entropy,
            admitted: None,
        }
    }
}

impl LoginPolicy for LocalLogin<'_> {
    fn normal(&mut self, _: &str, target: &str, tsih: u16) -> Result<Settings, LoginStatus> {
        let known = self.target.addresses.iter();
        if !known
            .map(|(n, _)| n)
            .any(|n| n.eq_ignore_ascii_case(target))
        {
            return Err(LoginStatus::NOT_FOUND);
        }
        if tsih != 0 && self.target.sessions.get(tsih).is_none() {
            return Err(LoginStatus::SESSION_DOES_NOT_EXIST);
        }
        // A normal session's first response names the portal group (RFC 7143 13.9); the
        // default is 1, as `TargetPort::iscsi(name, 1)` declares it to the SCSI device.
        let mut s = self.settings.clone();
        s.declarations.target_portal_group_tag.get_or_insert(1);
        Ok(s)
    }

    fn discovery(&mut self, _: &str) -> Result<Settings, LoginStatus> {
        Ok(self.settings.clone())
    }

    fn refused(&mut self, _: &str, _: Option<&str>, _: &NegotiationError) {}

    fn window(&self, tsih: u16, cmd_sn: SerialNumber) -> (SerialNumber, SerialNumber) {
        self.target.login_window(tsih, cmd_sn)
    }

    fn complete(
        &mut self,
        login: &Completed,
    ) -> Result<(u16, SerialNumber, SerialNumber), LoginStatus> {
        let a = self
            .target
            .admit(login, self.route)
            .map_err(SessionError::status)?;
        let answer = (a.tsih, a.window.0, a.window.1);
        self.admitted = Some(a);
        Ok(answer)
    }

    fn entropy(&mut self) -> Result<[u8; ENTROPY_LEN], LoginStatus> {
        match self.entropy {
            Some(fresh) => Ok(fresh()),
            // Settings that cannot negotiate CHAP make no challenge: nothing to predict.
            None if !self.settings.auth.methods.contains(&AuthMethod::Chap) => Ok([0; ENTROPY_LEN]),
            None => Err(LoginStatus::TARGET_ERROR),
        }
    }
}
