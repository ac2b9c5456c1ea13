//! iSCSI sessions: the registry (iscsi-pdu's [`SessionTable`] behind a lock: TSIH allocation,
//! reinstatement, joining connections) and each session's link to its target's core. Each
//! session's command ordering by CmdSN (RFC 7143 section 4.2.2.1), which holds across all of its
//! connections wherever they run, is kept under its target's core lock ([`Core::deliver`]).

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use iscsi_pdu::handover::{ConnectionState, SessionState};
use iscsi_pdu::negotiation::SessionParams;
use iscsi_pdu::target_node::{
    Left, OrderedCommand, SessionEntry, SessionError, SessionKey, SessionTable,
};
use iscsi_pdu::{Isid, SerialNumber};
use scsi_core::NexusId;

use crate::control::{Control, Request};
use crate::lock;
use crate::target::{Core, Outbox, Route, Target};

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
    /// It runs over iSER (RDMA), not TCP.
    pub iser: bool,
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
    /// MaxCmdSN held where it was while the session parks for a handover: 0 when it is not,
    /// else `1 << 32 | MaxCmdSN`.
    frozen: AtomicU64,
}

impl Session {
    /// ExpCmdSN and MaxCmdSN to advertise now.
    pub fn window(&self) -> (SerialNumber, SerialNumber) {
        let exp = SerialNumber(self.exp_cmd_sn.load(Ordering::Acquire));
        let max = exp + (self.window - 1);
        match self.frozen.load(Ordering::Acquire) {
            0 => (exp, max),
            f => {
                let f = SerialNumber(f as u32);
                (exp, if f.lt(max) { f } else { max })
            }
        }
    }

    /// Holds MaxCmdSN where it is (a park for a handover): the window closes as the commands
    /// already allowed come in, so that the initiator stops sending at a point every
    /// connection of the session reaches, rather than each connection stopping at a
    /// different command.
    pub fn freeze_window(&self) {
        let (_, max) = self.window();
        self.frozen
            .store(1 << 32 | u64::from(max.0), Ordering::Release);
    }

    /// Lets the window move again; the connections announce it
    /// ([`Connection::announce_window`](iscsi_pdu::target_node::Connection::announce_window)).
    pub fn thaw_window(&self) {
        self.frozen.store(0, Ordering::Release);
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

    /// Its state for a handover, with its parked connections' `connections`: what login
    /// agreed, where its CmdSN order stands and the unit attentions its I_T nexus has
    /// pending. `None` while a command waits in its order for an earlier CmdSN, which a
    /// connection still has to bring (or when the core no longer knows the session).
    pub fn handover_state(&self, connections: Vec<ConnectionState>) -> Option<SessionState> {
        self.target.with_core(|core, _| {
            if core.queued(self.nexus) > 0 {
                return None;
            }
            let (exp_cmd_sn, _) = core.window(self.nexus)?;
            let unit_attentions = core.device().pending_unit_attentions(self.nexus).ok()?;
            Some(SessionState {
                tsih: self.tsih,
                isid: self.isid,
                params: self.params.clone(),
                exp_cmd_sn,
                cmd_window: self.window,
                unit_attentions,
                connections,
            })
        })
    }

    /// How many of its commands wait in its CmdSN order for an earlier one.
    pub fn queued(&self) -> usize {
        self.target.with_core(|core, _| core.queued(self.nexus))
    }

    /// Keeps the lock-free copy of ExpCmdSN current.
    fn mirror(&self, core: &Core) {
        if let Some((exp, _)) = core.window(self.nexus) {
            self.exp_cmd_sn.store(exp.0, Ordering::Release);
        }
    }
}

/// Every normal session of the daemon: iscsi-pdu's [`SessionTable`] (TSIH allocation,
/// reinstatement, joins, the last connection out) behind a lock, each session with its
/// connections' controls. The table decides which connections close; this asks them to.
#[derive(Debug, Default)]
pub struct Sessions {
    table: Mutex<SessionTable<Arc<Session>, ConnectionInfo>>,
}

fn close_all(connections: &[ConnectionInfo]) {
    for c in connections {
        c.control.request(Request::Close);
    }
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
    ) -> Result<Arc<Session>, SessionError> {
        let key = SessionKey {
            isid,
            initiator: initiator.to_string(),
            target: target.name.clone(),
        };
        let max = params.operational.max_connections;
        let mut table = lock(&self.table);
        let made = table.create(key, max, first.cid, first, |tsih| {
            let id = scsi_core::TransportId::iscsi(initiator, isid.0);
            // The session's target port is its portal group's (TargetPort::iscsi).
            let port = target.port_group.max(1);
            let nexus = target.with_core(|core, _| core.open_session(id, port, cmd_sn, window));
            Arc::new(Session {
                tsih,
                isid,
                initiator: initiator.to_string(),
                target: target.clone(),
                nexus,
                params,
                window,
                exp_cmd_sn: AtomicU32::new(cmd_sn.0),
                frozen: AtomicU64::new(0),
            })
        })?;
        if !made.reinstated.is_empty() {
            tracing::info!(initiator, "session reinstated: closing the old one");
            close_all(&made.reinstated);
        }
        Ok(table
            .get(made.tsih)
            .map(|s| s.value.clone())
            .expect("just made"))
    }

    /// Takes in a session another process handed over ([`SessionState`]) under its TSIH,
    /// with its connections (`conns`, one per connection of the state, same CIDs): its I_T
    /// nexus reopened in `target`'s core with the unit attentions pending there (not POWER
    /// ON), its CmdSN order going on from ExpCmdSN. Refused as [`SessionTable::adopt`]
    /// refuses, and then nothing is left of it.
    pub fn adopt(
        &self,
        state: &SessionState,
        initiator: &str,
        target: Arc<Target>,
        conns: Vec<ConnectionInfo>,
    ) -> Result<Arc<Session>, SessionError> {
        let id = scsi_core::TransportId::iscsi(initiator, state.isid.0);
        let port = target.port_group.max(1);
        let nexus = target.with_core(|core, _| {
            core.adopt_session(
                id,
                port,
                state.exp_cmd_sn,
                state.cmd_window,
                state.unit_attentions.clone(),
            )
        });
        let session = Arc::new(Session {
            tsih: state.tsih,
            isid: state.isid,
            initiator: initiator.to_string(),
            target: target.clone(),
            nexus,
            params: state.params.clone(),
            window: state.cmd_window,
            exp_cmd_sn: AtomicU32::new(state.exp_cmd_sn.0),
            frozen: AtomicU64::new(0),
        });
        let entry = SessionEntry {
            tsih: state.tsih,
            key: SessionKey {
                isid: state.isid,
                initiator: initiator.to_string(),
                target: target.name.clone(),
            },
            max_connections: state.params.operational.max_connections,
            connections: conns.into_iter().map(|c| (c.cid, c)).collect(),
            ending: false,
            value: session.clone(),
        };
        let adopted = lock(&self.table).adopt(entry);
        match adopted {
            Ok(()) => Ok(session),
            Err(e) => {
                target.with_core(|core, out| core.close_session(nexus, out));
                Err(e)
            }
        }
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
    ) -> Result<Arc<Session>, SessionError> {
        let mut table = lock(&self.table);
        let replaced = table.join(tsih, isid, initiator, target, conn.cid, conn)?;
        if let Some(old) = replaced {
            tracing::info!(
                tsih,
                cid = old.cid,
                "connection reinstated: closing the old one"
            );
            old.control.request(Request::Close);
        }
        Ok(table
            .get(tsih)
            .map(|s| s.value.clone())
            .expect("just joined"))
    }

    /// The live session `tsih` (for a login that wants to join it).
    pub fn get(&self, tsih: u16) -> Option<Arc<Session>> {
        lock(&self.table).get(tsih).map(|s| s.value.clone())
    }

    /// Removes connection `id` from its session; the last one out ends the session: it leaves
    /// the registry, and the caller closes its I_T nexus. Returns whether it ended.
    pub fn leave(&self, session: &Session, id: u64) -> bool {
        let left = lock(&self.table).leave(session.tsih, |c| c.id == id);
        matches!(left, Left::Ended(_))
    }

    /// Asks every connection of `session` to close; it ends when the last one has left.
    pub fn close(&self, session: &Session) {
        let conns = lock(&self.table).close(session.tsih);
        close_all(&conns);
    }

    /// The connections of `session` now.
    pub fn connections(&self, session: &Session) -> Vec<ConnectionInfo> {
        lock(&self.table)
            .entry(session.tsih)
            .map(|s| s.connections.iter().map(|(_, c)| c.clone()).collect())
            .unwrap_or_default()
    }

    /// Holds at most `limit` sessions (`server.max_sessions`); those already open stay.
    pub fn set_limit(&self, limit: usize) {
        lock(&self.table).set_limit(limit);
    }

    /// Every session, ending ones included, by TSIH.
    pub fn all(&self) -> Vec<Arc<Session>> {
        lock(&self.table).iter().map(|s| s.value.clone()).collect()
    }
}
