//! iSCSI sessions: the registry (TSIH allocation, reinstatement, joining connections). Each
//! session's command ordering by CmdSN (RFC 7143 section 4.2.2.1), which holds across all of its
//! connections wherever they run, is kept under its target's core lock ([`Core::deliver`]).

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU8, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use iscsi_pdu::negotiation::SessionParams;
use iscsi_pdu::target::OrderedCommand;
use iscsi_pdu::{Isid, SerialNumber};
use scsi_core::NexusId;
use tokio::sync::Notify;

use crate::target::{Core, Outbox, Route, Target};

/// What a connection is asked to do from outside.
#[derive(Debug, Default)]
pub struct Control {
    state: AtomicU8,
    /// Signalled when `state` changes.
    pub notify: Notify,
}

/// Requests a [`Control`] carries, strongest last.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
#[repr(u8)]
pub enum Request {
    /// Carry on.
    Run = 0,
    /// Ask the initiator to log out (Asynchronous Message), the daemon is stopping.
    Logout = 1,
    /// Close now.
    Close = 2,
}

impl Control {
    /// Raises the request to `r` (never lowers it).
    pub fn request(&self, r: Request) {
        self.state.fetch_max(r as u8, Ordering::SeqCst);
        self.notify.notify_one();
    }

    /// The request in force.
    pub fn get(&self) -> Request {
        match self.state.load(Ordering::SeqCst) {
            0 => Request::Run,
            1 => Request::Logout,
            _ => Request::Close,
        }
    }
}

/// A connection as its session and the admin interface see it.
#[derive(Debug, Clone)]
pub struct ConnectionInfo {
    /// Connection ID.
    pub cid: u16,
    /// Daemon-wide id.
    pub id: u64,
    /// The initiator's address.
    pub peer: SocketAddr,
    /// The portal it reached.
    pub local: SocketAddr,
    /// The reactor serving it.
    pub reactor: usize,
    /// HeaderDigest / DataDigest in force.
    pub digests: (bool, bool),
    /// MaxRecvDataSegmentLength of the target and of the initiator.
    pub segment_lengths: (u32, u32),
    /// Its control.
    pub control: Arc<Control>,
}

/// One session with a target.
#[derive(Debug)]
pub struct Session {
    /// TSIH.
    pub tsih: u16,
    /// ISID.
    pub isid: Isid,
    /// InitiatorName.
    pub initiator: String,
    /// The target.
    pub target: Arc<Target>,
    /// Its I_T nexus in the target's SCSI core.
    pub nexus: NexusId,
    /// What was negotiated by the leading connection.
    pub params: SessionParams,
    window: u32,
    /// ExpCmdSN as the core's order last left it, read without the core's lock for every
    /// response.
    exp_cmd_sn: AtomicU32,
    /// Its connections.
    pub connections: Mutex<Vec<ConnectionInfo>>,
    /// Set once it is ending: no connection may join.
    pub closing: AtomicBool,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

impl Session {
    /// ExpCmdSN and MaxCmdSN to advertise now.
    pub fn window(&self) -> (SerialNumber, SerialNumber) {
        let exp = SerialNumber(self.exp_cmd_sn.load(Ordering::Acquire));
        (exp, exp + (self.window - 1))
    }

    /// Hands a SCSI command to the core in CmdSN order ([`Core::deliver`]); `core` is the
    /// session's target's, locked by the caller.
    pub fn deliver(
        &self,
        core: &mut Core,
        cmd: OrderedCommand,
        immediate: bool,
        route: &Route,
        out: &mut Outbox,
    ) -> bool {
        let taken = core.deliver(self.nexus, cmd, immediate, route, out);
        self.mirror(core);
        taken
    }

    /// Takes a CmdSN for a request handled on arrival ([`Core::take_cmd_sn`]).
    pub fn take_cmd_sn(&self, core: &mut Core, cmd_sn: SerialNumber, out: &mut Outbox) -> bool {
        let taken = core.take_cmd_sn(self.nexus, cmd_sn, out);
        self.mirror(core);
        taken
    }

    /// Keeps the lock-free copy of ExpCmdSN current.
    fn mirror(&self, core: &Core) {
        if let Some((exp, _)) = core.window(self.nexus) {
            self.exp_cmd_sn.store(exp.0, Ordering::Release);
        }
    }

    /// Asks every connection to close.
    pub fn close(&self) {
        self.closing.store(true, Ordering::SeqCst);
        for c in lock(&self.connections).iter() {
            c.control.request(Request::Close);
        }
    }

    /// Its connections now.
    pub fn connection_list(&self) -> Vec<ConnectionInfo> {
        lock(&self.connections).clone()
    }
}

/// Why a connection could not join a session.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum JoinError {
    /// No such session (or it belongs to another initiator or target).
    NoSession,
    /// It has MaxConnections already.
    TooMany,
}

/// Every normal session of the daemon, by TSIH.
#[derive(Debug, Default)]
pub struct Sessions {
    map: Mutex<HashMap<u16, Arc<Session>>>,
    last_tsih: Mutex<u16>,
}

impl Sessions {
    /// Creates a session for a leading login, closing any session of the same initiator port
    /// with the same target (session reinstatement, RFC 7143 section 6.3.5).
    #[allow(clippy::too_many_arguments)]
    pub fn create(
        &self,
        isid: Isid,
        initiator: &str,
        target: Arc<Target>,
        params: SessionParams,
        window: u32,
        cmd_sn: SerialNumber,
        first: ConnectionInfo,
    ) -> Arc<Session> {
        let mut map = lock(&self.map);
        let old: Vec<u16> = map
            .values()
            .filter(|s| {
                s.isid == isid
                    && s.initiator.eq_ignore_ascii_case(initiator)
                    && Arc::ptr_eq(&s.target, &target)
            })
            .map(|s| s.tsih)
            .collect();
        for tsih in old {
            if let Some(s) = map.remove(&tsih) {
                tracing::info!(tsih, initiator, "session reinstated: closing the old one");
                s.close();
            }
        }
        let mut last = lock(&self.last_tsih);
        let mut tsih = *last;
        loop {
            tsih = tsih.wrapping_add(1);
            if tsih != 0 && !map.contains_key(&tsih) {
                break;
            }
        }
        *last = tsih;
        let id = scsi_core::TransportId::iscsi(initiator, isid.0);
        let nexus = target.core().open_session(id, cmd_sn, window);
        let s = Arc::new(Session {
            tsih,
            isid,
            initiator: initiator.to_string(),
            target,
            nexus,
            params,
            window,
            exp_cmd_sn: AtomicU32::new(cmd_sn.0),
            connections: Mutex::new(vec![first]),
            closing: AtomicBool::new(false),
        });
        map.insert(tsih, s.clone());
        s
    }

    /// Adds a connection to the session `tsih` of `initiator`/`isid`; a connection with the
    /// same CID is closed first (connection reinstatement).
    pub fn join(
        &self,
        tsih: u16,
        isid: Isid,
        initiator: &str,
        target: &str,
        conn: ConnectionInfo,
    ) -> Result<Arc<Session>, JoinError> {
        let map = lock(&self.map);
        let s = map
            .get(&tsih)
            .filter(|s| {
                s.isid == isid
                    && s.initiator.eq_ignore_ascii_case(initiator)
                    && s.target.name.eq_ignore_ascii_case(target)
                    && !s.closing.load(Ordering::SeqCst)
            })
            .ok_or(JoinError::NoSession)?;
        let mut conns = lock(&s.connections);
        if let Some(i) = conns.iter().position(|c| c.cid == conn.cid) {
            let old = conns.remove(i);
            old.control.request(Request::Close);
        }
        if conns.len() >= usize::from(s.params.operational.max_connections) {
            return Err(JoinError::TooMany);
        }
        conns.push(conn);
        Ok(s.clone())
    }

    /// Whether `tsih` names a live session (for a login that wants to join it).
    pub fn get(&self, tsih: u16) -> Option<Arc<Session>> {
        lock(&self.map).get(&tsih).cloned()
    }

    /// Removes connection `id` from its session; the last one out ends the session: it leaves
    /// the registry and its I_T nexus closes (its tasks are aborted). Returns whether it ended.
    pub fn leave(&self, session: &Arc<Session>, id: u64) -> bool {
        let mut map = lock(&self.map);
        let mut conns = lock(&session.connections);
        conns.retain(|c| c.id != id);
        if !conns.is_empty() {
            return false;
        }
        drop(conns);
        if map
            .get(&session.tsih)
            .is_some_and(|s| Arc::ptr_eq(s, session))
        {
            map.remove(&session.tsih);
        }
        session.closing.store(true, Ordering::SeqCst);
        true
    }

    /// Every session.
    pub fn all(&self) -> Vec<Arc<Session>> {
        let mut v: Vec<_> = lock(&self.map).values().cloned().collect();
        v.sort_by_key(|s| s.tsih);
        v
    }
}
