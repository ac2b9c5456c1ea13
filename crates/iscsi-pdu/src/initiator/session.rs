//! An initiator's session in full feature phase as a state machine: the task table by Initiator
//! Task Tag, the CmdSN window the target grants (RFC 7143 section 4.2.2.1), immediate and
//! unsolicited data, Data-Out answering R2Ts, Data-In reassembly, NOP (both ways), task
//! management, text, logout, and several connections per session.
//!
//! Inputs are calls (`start_*`, [`Session::handle_pdu`], [`Session::connection_lost`]); outputs
//! are polled: [`Session::poll_transmit`] per connection (PDUs in the order they must be sent;
//! the shell encodes them with the connection's digests) and [`Session::poll_event`] (a task's
//! outcome, the window opening). It owns no socket, clock or thread: time comes in as `now`
//! with each call, and its [`Timers`] (a task's timeout, NOP-Out pings on a quiet connection)
//! run on that clock: the shell sleeps until [`Session::poll_timeout`] and then calls
//! [`Session::handle_timeout`], so they are tested on a virtual clock like the target's.

use std::collections::{HashMap, VecDeque};
use std::time::{Duration, Instant};

use bytes::{Bytes, BytesMut};

use crate::negotiation::{ConnectionParams, SessionParams};
use crate::text::TextReassembler;
use crate::{
    AsyncEvent, DataIn, DataOut, Digests, LogoutReason, LogoutRequest, Lun, NopOut, Opcode, Pdu,
    ReadyToTransfer, RejectReason, Residual, ScsiCommand, ScsiResponse, ScsiResponseCode,
    ScsiStatus, SerialNumber, TaskAttribute, TaskManagementFunction, TaskManagementRequest,
    TextRequest, TextResponse, TmfResponse, RESERVED_TAG,
};

/// A NOP-Out that asks for a NOP-In back.
fn nop_out(itt: u32, cmd_sn: SerialNumber, exp_stat_sn: SerialNumber) -> Pdu {
    Pdu::NopOut(NopOut {
        immediate: true,
        initiator_task_tag: itt,
        target_transfer_tag: RESERVED_TAG,
        cmd_sn,
        exp_stat_sn,
        data: Bytes::new(),
        ..Default::default()
    })
}

/// A SCSI command as the initiator sends it.
#[derive(Debug, Clone)]
pub struct Command {
    /// The logical unit.
    pub lun: Lun,
    /// The CDB (16 bytes; shorter CDBs are zero-padded).
    pub cdb: [u8; 16],
    /// Data to send (writes); empty for none.
    pub data_out: Bytes,
    /// Bytes expected back (reads); 0 for none.
    pub data_in_len: u32,
    /// Task attribute.
    pub attribute: TaskAttribute,
}

impl Command {
    /// A command without data.
    pub fn new(lun: Lun, cdb: [u8; 16]) -> Command {
        Command {
            lun,
            cdb,
            data_out: Bytes::new(),
            data_in_len: 0,
            attribute: TaskAttribute::Simple,
        }
    }

    /// A command reading `len` bytes.
    pub fn read(lun: Lun, cdb: [u8; 16], len: u32) -> Command {
        Command {
            data_in_len: len,
            ..Command::new(lun, cdb)
        }
    }

    /// A command writing `data`.
    pub fn write(lun: Lun, cdb: [u8; 16], data: Bytes) -> Command {
        Command {
            data_out: data,
            ..Command::new(lun, cdb)
        }
    }
}

/// How a SCSI command ended.
#[derive(Debug, Clone)]
pub struct ScsiReply {
    /// SCSI status.
    pub status: ScsiStatus,
    /// Sense data, with CHECK CONDITION.
    pub sense: Option<Bytes>,
    /// Data read (as many bytes as the target sent, and no more than the residual allows).
    pub data: Bytes,
    /// Residual as the target reported it.
    pub residual: Residual,
}

/// What a task resolves to.
#[derive(Debug, Clone)]
pub enum Reply {
    /// A SCSI command's status and data.
    Scsi(ScsiReply),
    /// A NOP-In answered the NOP-Out.
    Nop,
    /// A task management response.
    Tmf(TmfResponse),
    /// The logout was answered; the connection closes.
    Logout,
    /// A whole text response (after as many continuations as it took).
    Text(Bytes),
}

/// Why a task failed, scoped to what recovers: `Command` leaves the session usable; the others
/// mean the task's connection (or session) is gone or the target refused the request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Failure {
    /// The target broke the protocol for this task only.
    Command(String),
    /// The target rejected the request.
    Rejected(RejectReason),
    /// The task was aborted by task management.
    Aborted,
    /// The task's connection or the session ended.
    ConnectionLost(String),
    /// It did not end within [`Timers::task`]; a late answer is ignored.
    TimedOut,
}

/// The session's timers, on the caller's clock; each is off unless set.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Timers {
    /// A task (command, NOP-Out, task management, logout, text) not ended this long after it
    /// started ends with [`Failure::TimedOut`].
    pub task: Option<Duration>,
    /// A connection from which nothing has come for this long is pinged with a NOP-Out
    /// (RFC 7143 section 11.18), which the machine answers itself.
    pub nop_interval: Option<Duration>,
    /// A ping unanswered this long ends its connection ([`Session::connection_lost`]'s
    /// outcome for its tasks); with `nop_interval`.
    pub nop_timeout: Duration,
}

/// Why a request could not start.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StartError {
    /// The target's CmdSN window is full: wait for [`Event::WindowOpened`].
    WindowClosed,
    /// No connection of the session is alive.
    NoConnection,
    /// The target asked (AsyncEvent 1) to log out every live connection: no new command
    /// starts on them; the machine logs out once their commands end (or when the target's
    /// Parameter3 runs out), and a new login may then take the work.
    LogoutRequested,
}

/// What the machine reports.
#[derive(Debug)]
#[must_use = "an event is a task's end or the session's news, which the caller is waiting for"]
pub enum Event {
    /// A task ended.
    Done {
        /// Its Initiator Task Tag.
        itt: u32,
        /// Its outcome.
        result: Result<Reply, Failure>,
    },
    /// ExpCmdSN or MaxCmdSN moved: commands refused with [`StartError::WindowClosed`] may go.
    WindowOpened,
    /// The target asked to log out connection `conn` (AsyncEvent 1), as a gateway going down
    /// does: a multipath initiator moves its I/O to another path now rather than when the
    /// connection closes. No new command starts on it; the machine sends the Logout itself
    /// once the connection's commands end, or `within` (the target's Parameter3) from now.
    LogoutRequested {
        /// The connection.
        conn: usize,
        /// How long the target waits for the Logout.
        within: Duration,
    },
}

#[derive(Debug)]
enum TaskKind {
    Scsi {
        /// Where Data-In lands: room for `read_len` bytes (made at the start over TCP, at
        /// the first Data-In where the target places the data itself, as iSER does), filled
        /// up to the end of the data placed so far. Data in order is appended, never zeroed
        /// first; only a gap is filled with zeros.
        read: BytesMut,
        read_len: u32,
        received: u32,
        next_data_sn: u32,
        /// The data of a write, sliced for each Data-Out.
        write: Bytes,
        next_r2t_sn: u32,
        /// The command and its CmdSN, to send again when the target rejects it for a data
        /// digest error (it has not taken the CmdSN: the gap must be filled).
        command: Command,
        cmd_sn: SerialNumber,
        retries: u8,
    },
    Nop,
    /// The machine's own ping of a quiet connection ([`Timers::nop_interval`]): its answer
    /// is no event.
    Ping,
    Tmf {
        function: TaskManagementFunction,
        referenced: u32,
    },
    Logout,
    Text {
        text: TextReassembler,
    },
}

#[derive(Debug)]
struct Task {
    kind: TaskKind,
    /// The connection the task is allegiant to.
    conn: usize,
    /// When it times out ([`Timers::task`]).
    deadline: Option<Instant>,
}

#[derive(Debug)]
struct Connection {
    params: ConnectionParams,
    digests: Digests,
    exp_stat_sn: SerialNumber,
    alive: bool,
    out: VecDeque<Pdu>,
    /// When a PDU last came on it (`None`: not since it was added; the first timer sets it).
    last_rx: Option<Instant>,
    /// The machine's ping on it, unanswered: its ITT and when it is given up.
    ping: Option<(u32, Instant)>,
    /// The target asked to log it out: by when the Logout must be sent.
    logout_by: Option<Instant>,
    /// The machine's Logout for it is sent.
    logging_out: bool,
}

/// Why the target's PDU closes the connection it came on.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct ConnectionError(pub String);

/// One login of a session: its connections, CmdSN window and task table.
#[derive(Debug)]
pub struct Session {
    params: SessionParams,
    tsih: u16,
    cmd_sn: SerialNumber,
    exp_cmd_sn: SerialNumber,
    max_cmd_sn: SerialNumber,
    next_itt: u32,
    tasks: HashMap<u32, Task>,
    conns: Vec<Connection>,
    next_conn: usize,
    events: VecDeque<Event>,
    timers: Timers,
    /// Tasks' deadlines in the order they were set (monotonic, as every task gets the same
    /// timeout); an entry whose task ended or whose ITT was reused is skipped.
    deadlines: VecDeque<(Instant, u32)>,
    /// Whether Data-In brings read data in its PDUs (TCP), so each read gets room for its
    /// data when it starts (not zeroed). False where the target places the data itself
    /// (iSER's RDMA WRITE): no read then has a buffer here.
    data_in_carries_data: bool,
}

impl Session {
    /// A session as its leading login left it: the negotiated session parameters, the TSIH and
    /// the window (the first command takes `exp_cmd_sn`). Add its connections with
    /// [`Session::add_connection`].
    pub fn new(
        params: SessionParams,
        tsih: u16,
        exp_cmd_sn: SerialNumber,
        max_cmd_sn: SerialNumber,
    ) -> Session {
        Session {
            params,
            tsih,
            cmd_sn: exp_cmd_sn,
            exp_cmd_sn,
            max_cmd_sn,
            next_itt: 1,
            tasks: HashMap::new(),
            conns: Vec::new(),
            next_conn: 0,
            events: VecDeque::new(),
            timers: Timers::default(),
            deadlines: VecDeque::new(),
            data_in_carries_data: true,
        }
    }

    /// Says that the target places read data itself (iSER's RDMA WRITE into the buffer a
    /// command names) rather than in Data-In PDUs: reads then get no reassembly buffer.
    pub fn set_data_in_placed_by_target(&mut self) {
        self.data_in_carries_data = false;
    }

    /// Sets the timers; tasks started from now on get the task timeout.
    pub fn set_timers(&mut self, timers: Timers) {
        self.timers = timers;
    }

    /// When [`Session::handle_timeout`] is next due: a task's deadline, a quiet connection's
    /// ping, or a ping given up.
    pub fn poll_timeout(&self) -> Option<Instant> {
        let task = self.deadlines.front().map(|&(at, _)| at);
        let pings = self
            .conns
            .iter()
            .filter(|c| c.alive)
            .filter_map(|c| match c.ping {
                Some((_, give_up)) => Some(give_up),
                None => Some(c.last_rx? + self.timers.nop_interval?),
            });
        let logouts = self
            .conns
            .iter()
            .filter(|c| c.alive && !c.logging_out)
            .filter_map(|c| c.logout_by);
        task.into_iter().chain(pings).chain(logouts).min()
    }

    /// Time has come to `now`: tasks past their deadline end with [`Failure::TimedOut`]; a
    /// connection quiet for [`Timers::nop_interval`] is pinged, and one whose ping went
    /// unanswered for [`Timers::nop_timeout`] is lost (the caller closes it).
    pub fn handle_timeout(&mut self, now: Instant) {
        while let Some(&(at, itt)) = self.deadlines.front() {
            if at > now {
                break;
            }
            self.deadlines.pop_front();
            if self.tasks.get(&itt).is_some_and(|t| t.deadline == Some(at)) {
                self.complete(itt, Err(Failure::TimedOut));
            }
        }
        for ci in 0..self.conns.len() {
            let c = &mut self.conns[ci];
            if !c.alive {
                continue;
            }
            let quiet_since = *c.last_rx.get_or_insert(now);
            match (c.ping, self.timers.nop_interval) {
                (Some((_, give_up)), _) if give_up <= now => {
                    self.connection_lost(ci, "NOP-Out ping unanswered");
                }
                (None, Some(interval)) if quiet_since + interval <= now => {
                    let give_up = now + self.timers.nop_timeout;
                    let itt = self.start_on(ci, now, TaskKind::Ping, nop_out);
                    self.conns[ci].ping = Some((itt, give_up));
                }
                _ => {}
            }
        }
        self.logout_when_drained(now);
    }

    /// Adds a logged-in connection; returns its index (for `handle_pdu` and `poll_transmit`).
    pub fn add_connection(&mut self, params: ConnectionParams, exp_stat_sn: SerialNumber) -> usize {
        self.conns.push(Connection {
            params,
            digests: Digests {
                header: params.header_digest,
                data: params.data_digest,
            },
            exp_stat_sn,
            alive: true,
            out: VecDeque::new(),
            last_rx: None,
            ping: None,
            logout_by: None,
            logging_out: false,
        });
        self.conns.len() - 1
    }

    /// The negotiated session parameters.
    pub fn params(&self) -> &SessionParams {
        &self.params
    }

    /// TSIH.
    pub fn tsih(&self) -> u16 {
        self.tsih
    }

    /// Connections in the session (alive or not).
    pub fn connection_count(&self) -> usize {
        self.conns.len()
    }

    /// The digests of connection `conn`.
    pub fn digests(&self, conn: usize) -> Digests {
        self.conns.get(conn).map_or(Digests::NONE, |c| c.digests)
    }

    /// The window the target grants now: (ExpCmdSN, MaxCmdSN).
    pub fn window(&self) -> (SerialNumber, SerialNumber) {
        (self.exp_cmd_sn, self.max_cmd_sn)
    }

    /// Whether connection `conn` is alive (not lost, closed or given up by a ping).
    pub fn connection_alive(&self, conn: usize) -> bool {
        self.conns.get(conn).is_some_and(|c| c.alive)
    }

    /// Whether any connection is alive.
    pub fn is_alive(&self) -> bool {
        self.conns.iter().any(|c| c.alive)
    }

    /// Tasks not yet ended.
    pub fn tasks_in_flight(&self) -> usize {
        self.tasks.len()
    }

    /// The next PDU to send on connection `conn`.
    pub fn poll_transmit(&mut self, conn: usize) -> Option<Pdu> {
        self.conns.get_mut(conn)?.out.pop_front()
    }

    /// The next event.
    pub fn poll_event(&mut self) -> Option<Event> {
        self.events.pop_front()
    }

    /// The live connection to start on, in turn; for a SCSI command (`command`) not one the
    /// target asked to log out.
    fn pick_conn(&mut self, command: bool) -> Result<usize, StartError> {
        let n = self.conns.len();
        let start = self.next_conn;
        self.next_conn = self.next_conn.wrapping_add(1);
        let usable = |c: &Connection| c.alive && !(command && c.logout_by.is_some());
        match (0..n)
            .map(|k| (start + k) % n)
            .find(|&i| usable(&self.conns[i]))
        {
            Some(i) => Ok(i),
            None if self.conns.iter().any(|c| c.alive) => Err(StartError::LogoutRequested),
            None => Err(StartError::NoConnection),
        }
    }

    /// Whether the target asked to log out every live connection (no command can start).
    pub fn logout_requested(&self) -> bool {
        let mut live = self.conns.iter().filter(|c| c.alive).peekable();
        live.peek().is_some() && live.all(|c| c.logout_by.is_some())
    }

    /// Sends the Logout of each connection the target asked to log out whose commands have
    /// ended, or whose time (the target's Parameter3) is up: closing the session when no
    /// other connection stays, else closing that connection.
    fn logout_when_drained(&mut self, now: Instant) {
        for ci in 0..self.conns.len() {
            let c = &self.conns[ci];
            let Some(by) = c.logout_by.filter(|_| c.alive && !c.logging_out) else {
                continue;
            };
            let busy = self
                .tasks
                .values()
                .any(|t| t.conn == ci && !matches!(t.kind, TaskKind::Ping | TaskKind::Logout));
            if busy && by > now {
                continue;
            }
            let others = self
                .conns
                .iter()
                .enumerate()
                .any(|(i, c)| i != ci && c.alive && c.logout_by.is_none());
            let reason = if others {
                LogoutReason::CloseConnection
            } else {
                LogoutReason::CloseSession
            };
            self.conns[ci].logging_out = true;
            self.start_on(ci, now, TaskKind::Logout, |itt, cmd_sn, exp| {
                Pdu::LogoutRequest(LogoutRequest {
                    immediate: true,
                    reason,
                    initiator_task_tag: itt,
                    // Connections are numbered by their CID from 0, as added.
                    cid: ci as u16,
                    cmd_sn,
                    exp_stat_sn: exp,
                })
            });
        }
    }

    fn next_itt(&mut self) -> u32 {
        loop {
            let itt = self.next_itt;
            self.next_itt = self.next_itt.wrapping_add(1);
            if itt != RESERVED_TAG && !self.tasks.contains_key(&itt) {
                return itt;
            }
        }
    }

    /// The CmdSN the next command will take.
    pub fn next_cmd_sn(&self) -> SerialNumber {
        self.cmd_sn
    }

    /// Starts a SCSI command: takes a CmdSN inside the window and queues the command with its
    /// immediate data and the unsolicited Data-Out, in CmdSN order, on one connection.
    pub fn start_command(&mut self, now: Instant, cmd: &Command) -> Result<u32, StartError> {
        if !self.cmd_sn.le(self.max_cmd_sn) {
            return Err(StartError::WindowClosed);
        }
        let ci = self.pick_conn(true)?;
        let itt = self.next_itt();
        let cmd_sn = self.cmd_sn;
        self.cmd_sn = cmd_sn.next();
        self.queue_command(ci, cmd, itt, cmd_sn);
        let kind = TaskKind::Scsi {
            // Room, not zeroed, where Data-In carries the data: a buffer made when the read
            // starts keeps initiator-bench's allocations steady (made at the first Data-In,
            // they cost it more system time). None where the target places the data itself
            // (iSER's RDMA WRITE).
            read: if self.data_in_carries_data {
                BytesMut::with_capacity(cmd.data_in_len as usize)
            } else {
                BytesMut::new()
            },
            read_len: cmd.data_in_len,
            received: 0,
            next_data_sn: 0,
            write: cmd.data_out.clone(),
            next_r2t_sn: 0,
            command: cmd.clone(),
            cmd_sn,
            retries: 0,
        };
        self.insert(now, itt, kind, ci);
        Ok(itt)
    }

    /// Enters a started task, with its deadline.
    fn insert(&mut self, now: Instant, itt: u32, kind: TaskKind, conn: usize) {
        // The machine's own ping has its own deadline (`Timers::nop_timeout`).
        let timed = !matches!(kind, TaskKind::Ping);
        let deadline = self.timers.task.filter(|_| timed).map(|t| now + t);
        if let Some(at) = deadline {
            self.deadlines.push_back((at, itt));
        }
        self.tasks.insert(
            itt,
            Task {
                kind,
                conn,
                deadline,
            },
        );
    }

    /// The SCSI Command PDU with its immediate data, and the unsolicited Data-Out PDUs.
    fn queue_command(&mut self, ci: usize, cmd: &Command, itt: u32, cmd_sn: SerialNumber) {
        let op = &self.params.operational;
        let len = cmd.data_out.len() as u32;
        let conn = &mut self.conns[ci];
        let mrdsl = conn.params.max_send_data_segment_length;
        let first_burst = if op.initial_r2t && !op.immediate_data {
            0
        } else {
            op.first_burst_length.min(len)
        };
        let immediate = if op.immediate_data {
            first_burst.min(mrdsl)
        } else {
            0
        };
        let unsolicited_end = if op.initial_r2t {
            immediate
        } else {
            first_burst
        };
        conn.out.push_back(Pdu::ScsiCommand(ScsiCommand {
            immediate: false,
            final_bit: unsolicited_end == immediate,
            read: cmd.data_in_len > 0,
            write: len > 0,
            task_attribute: cmd.attribute,
            lun: cmd.lun,
            initiator_task_tag: itt,
            expected_data_transfer_length: if len > 0 { len } else { cmd.data_in_len },
            cmd_sn,
            exp_stat_sn: conn.exp_stat_sn,
            cdb: cmd.cdb,
            extended_cdb: None,
            bidirectional_read_length: (len > 0 && cmd.data_in_len > 0).then_some(cmd.data_in_len),
            data: cmd.data_out.slice(..immediate as usize),
        }));
        let seq = DataOutSequence {
            lun: cmd.lun,
            itt,
            ttt: RESERVED_TAG,
            from: immediate,
            to: unsolicited_end,
        };
        seq.queue(conn, &cmd.data_out);
    }

    /// Starts an immediate request (it does not advance CmdSN) built by `build` from its ITT,
    /// CmdSN and ExpStatSN.
    fn start_immediate(
        &mut self,
        now: Instant,
        kind: TaskKind,
        build: impl FnOnce(u32, SerialNumber, SerialNumber) -> Pdu,
    ) -> Result<u32, StartError> {
        let ci = self.pick_conn(false)?;
        Ok(self.start_on(ci, now, kind, build))
    }

    /// Starts an immediate request on connection `ci`.
    fn start_on(
        &mut self,
        ci: usize,
        now: Instant,
        kind: TaskKind,
        build: impl FnOnce(u32, SerialNumber, SerialNumber) -> Pdu,
    ) -> u32 {
        let itt = self.next_itt();
        let conn = &mut self.conns[ci];
        conn.out
            .push_back(build(itt, self.cmd_sn, conn.exp_stat_sn));
        self.insert(now, itt, kind, ci);
        itt
    }

    /// A NOP-Out ping, answered by a NOP-In ([`Reply::Nop`]).
    pub fn start_nop(&mut self, now: Instant) -> Result<u32, StartError> {
        self.start_immediate(now, TaskKind::Nop, nop_out)
    }

    /// A task management function on `lun`; `referenced` is the ITT of the task for ABORT TASK
    /// and QUERY TASK. When an ABORT TASK completes, the aborted task ends with
    /// [`Failure::Aborted`].
    pub fn start_task_management(
        &mut self,
        now: Instant,
        function: TaskManagementFunction,
        lun: Lun,
        referenced: Option<u32>,
    ) -> Result<u32, StartError> {
        let referenced = referenced.unwrap_or(RESERVED_TAG);
        let kind = TaskKind::Tmf {
            function,
            referenced,
        };
        self.start_immediate(now, kind, |itt, cmd_sn, exp| {
            Pdu::TaskManagementRequest(TaskManagementRequest {
                immediate: true,
                function,
                lun,
                initiator_task_tag: itt,
                referenced_task_tag: referenced,
                cmd_sn,
                exp_stat_sn: exp,
                ref_cmd_sn: cmd_sn,
                exp_data_sn: 0,
            })
        })
    }

    /// A logout closing the session (from connection CID 0's point of view).
    pub fn start_logout(&mut self, now: Instant) -> Result<u32, StartError> {
        self.start_immediate(now, TaskKind::Logout, |itt, cmd_sn, exp| {
            Pdu::LogoutRequest(LogoutRequest {
                immediate: true,
                reason: LogoutReason::CloseSession,
                initiator_task_tag: itt,
                cid: 0,
                cmd_sn,
                exp_stat_sn: exp,
            })
        })
    }

    /// A text request with `data` (key=value pairs); the whole response comes back as
    /// [`Reply::Text`], continuations asked for as they come.
    pub fn start_text(&mut self, now: Instant, data: Bytes) -> Result<u32, StartError> {
        let kind = TaskKind::Text {
            text: TextReassembler::default(),
        };
        self.start_immediate(now, kind, |itt, cmd_sn, exp| {
            Pdu::TextRequest(TextRequest {
                immediate: true,
                final_bit: true,
                continue_bit: false,
                lun: Lun::ZERO,
                initiator_task_tag: itt,
                target_transfer_tag: RESERVED_TAG,
                cmd_sn,
                exp_stat_sn: exp,
                data,
            })
        })
    }

    /// Forgets a task the caller abandoned (timed out): a late response for it is ignored.
    pub fn forget(&mut self, itt: u32) {
        self.tasks.remove(&itt);
        self.prune_deadlines();
    }

    fn complete(&mut self, itt: u32, result: Result<Reply, Failure>) {
        let Some(task) = self.tasks.remove(&itt) else {
            return;
        };
        self.prune_deadlines();
        if let TaskKind::Ping = task.kind {
            // Answered, or given up with its connection: nobody waits for it.
            if let Some(c) = self.conns.get_mut(task.conn) {
                c.ping = None;
            }
            return;
        }
        self.events.push_back(Event::Done { itt, result });
    }

    /// Drops the deadlines at the front whose tasks have ended, so that the queue holds about
    /// the tasks in flight (they mostly end in the order they started) and needs no memory
    /// beyond that in steady state.
    fn prune_deadlines(&mut self) {
        while let Some(&(at, itt)) = self.deadlines.front() {
            if self.tasks.get(&itt).is_some_and(|t| t.deadline == Some(at)) {
                break;
            }
            self.deadlines.pop_front();
        }
    }

    /// Every task ends with `why`; no connection is alive any more.
    pub fn shutdown(&mut self, why: &str) {
        for c in &mut self.conns {
            c.alive = false;
            c.out.clear();
        }
        let mut itts: Vec<u32> = self.tasks.keys().copied().collect();
        itts.sort_unstable();
        for itt in itts {
            self.complete(itt, Err(Failure::ConnectionLost(why.into())));
        }
        self.events.push_back(Event::WindowOpened);
    }

    /// Connection `conn` ended: its tasks fail; the session ends with its last connection.
    pub fn connection_lost(&mut self, conn: usize, why: &str) {
        let Some(c) = self.conns.get_mut(conn) else {
            return;
        };
        c.alive = false;
        c.out.clear();
        if !self.is_alive() {
            return self.shutdown(why);
        }
        let mut lost: Vec<u32> = self
            .tasks
            .iter()
            .filter(|(_, t)| t.conn == conn)
            .map(|(k, _)| *k)
            .collect();
        lost.sort_unstable();
        for itt in lost {
            self.complete(itt, Err(Failure::ConnectionLost(why.into())));
        }
    }

    /// ExpCmdSN and MaxCmdSN from a target PDU: ignored when MaxCmdSN < ExpCmdSN - 1, and only
    /// ever moved forward.
    fn update_window(&mut self, exp: SerialNumber, max: SerialNumber) {
        if max.lt(SerialNumber(exp.0.wrapping_sub(1))) {
            return;
        }
        let mut moved = false;
        if exp.gt(self.exp_cmd_sn) {
            self.exp_cmd_sn = exp;
            moved = true;
        }
        if max.gt(self.max_cmd_sn) {
            self.max_cmd_sn = max;
            moved = true;
        }
        if moved {
            self.events.push_back(Event::WindowOpened);
        }
    }

    fn advance(&mut self, conn: usize, stat_sn: SerialNumber) {
        let c = &mut self.conns[conn];
        if stat_sn.next().gt(c.exp_stat_sn) {
            c.exp_stat_sn = stat_sn.next();
        }
    }

    /// A PDU from the target on connection `conn`. An error closes that connection (call
    /// [`Session::connection_lost`] once it is closed); a logout response is one.
    pub fn handle_pdu(
        &mut self,
        now: Instant,
        conn: usize,
        pdu: Pdu,
    ) -> Result<(), ConnectionError> {
        match self.conns.get_mut(conn) {
            Some(c) if c.alive => c.last_rx = Some(now),
            _ => return Err(ConnectionError("connection closed".into())),
        }
        match pdu {
            Pdu::DataIn(d) => {
                self.update_window(d.exp_cmd_sn, d.max_cmd_sn);
                if let Some(s) = &d.status {
                    self.advance(conn, s.stat_sn);
                }
                self.data_in(d);
            }
            Pdu::ScsiResponse(r) => {
                self.update_window(r.exp_cmd_sn, r.max_cmd_sn);
                self.advance(conn, r.stat_sn);
                self.scsi_response(r);
            }
            Pdu::ReadyToTransfer(r2t) => {
                self.update_window(r2t.exp_cmd_sn, r2t.max_cmd_sn);
                self.ready_to_transfer(conn, r2t);
            }
            Pdu::NopIn(n) => {
                self.update_window(n.exp_cmd_sn, n.max_cmd_sn);
                if n.initiator_task_tag != RESERVED_TAG {
                    self.advance(conn, n.stat_sn);
                    self.complete(n.initiator_task_tag, Ok(Reply::Nop));
                }
                if n.target_transfer_tag != RESERVED_TAG {
                    // The target pings: answer with the same TTT, LUN and data.
                    let c = &mut self.conns[conn];
                    c.out.push_back(Pdu::NopOut(NopOut {
                        immediate: true,
                        lun: n.lun,
                        initiator_task_tag: RESERVED_TAG,
                        target_transfer_tag: n.target_transfer_tag,
                        cmd_sn: self.cmd_sn,
                        exp_stat_sn: c.exp_stat_sn,
                        data: n.data,
                    }));
                }
            }
            Pdu::TaskManagementResponse(t) => {
                self.update_window(t.exp_cmd_sn, t.max_cmd_sn);
                self.advance(conn, t.stat_sn);
                let aborted = match self.tasks.get(&t.initiator_task_tag) {
                    Some(Task {
                        kind:
                            TaskKind::Tmf {
                                function: TaskManagementFunction::AbortTask,
                                referenced,
                            },
                        ..
                    }) if t.response == TmfResponse::FunctionComplete => Some(*referenced),
                    _ => None,
                };
                self.complete(t.initiator_task_tag, Ok(Reply::Tmf(t.response)));
                if let Some(itt) = aborted {
                    self.complete(itt, Err(Failure::Aborted));
                }
            }
            Pdu::LogoutResponse(l) => {
                self.advance(conn, l.stat_sn);
                self.complete(l.initiator_task_tag, Ok(Reply::Logout));
                return Err(ConnectionError("logged out".into()));
            }
            Pdu::TextResponse(t) => {
                self.update_window(t.exp_cmd_sn, t.max_cmd_sn);
                self.advance(conn, t.stat_sn);
                self.text_response(conn, t);
            }
            Pdu::Reject(r) => {
                self.update_window(r.exp_cmd_sn, r.max_cmd_sn);
                if let Some(h) = r.rejected_header() {
                    self.rejected(h.opcode(), h.initiator_task_tag(), r.reason);
                }
            }
            Pdu::AsyncMessage(a) if a.event == AsyncEvent::LogoutRequested => {
                self.update_window(a.exp_cmd_sn, a.max_cmd_sn);
                let within = Duration::from_secs(u64::from(a.parameter3));
                let c = &mut self.conns[conn];
                if c.logout_by.is_none() {
                    c.logout_by = Some(now + within);
                    self.events
                        .push_back(Event::LogoutRequested { conn, within });
                }
            }
            Pdu::AsyncMessage(a) => {
                self.update_window(a.exp_cmd_sn, a.max_cmd_sn);
                if matches!(
                    a.event,
                    AsyncEvent::ConnectionDropped | AsyncEvent::SessionDropped
                ) {
                    return Err(ConnectionError(format!(
                        "target dropping the connection ({:?})",
                        a.event
                    )));
                }
            }
            other => {
                return Err(ConnectionError(format!(
                    "target sent an initiator PDU: {:?}",
                    other.opcode()
                )))
            }
        }
        // A task that ended may have been the last one holding back a requested logout.
        self.logout_when_drained(now);
        Ok(())
    }

    /// The target rejected a PDU of task `itt`. A SCSI Command rejected for a data digest error
    /// was not taken (nor its CmdSN): it is sent again, same ITT and CmdSN, a few times. A
    /// rejected Data-Out leaves the task to the target, which ends it with status. Any other
    /// rejected request ends.
    fn rejected(&mut self, opcode: Option<Opcode>, itt: u32, reason: RejectReason) {
        const RETRIES: u8 = 3;
        match opcode {
            Some(Opcode::DataOut) => {}
            Some(Opcode::ScsiCommand) if reason == RejectReason::DataDigestError => {
                let Some(Task {
                    kind:
                        TaskKind::Scsi {
                            command,
                            cmd_sn,
                            retries,
                            next_r2t_sn,
                            ..
                        },
                    conn,
                    ..
                }) = self.tasks.get_mut(&itt)
                else {
                    return;
                };
                if *retries >= RETRIES || !self.conns[*conn].alive {
                    return self.complete(itt, Err(Failure::Rejected(reason)));
                }
                *retries += 1;
                *next_r2t_sn = 0;
                let (command, cmd_sn, conn) = (command.clone(), *cmd_sn, *conn);
                self.queue_command(conn, &command, itt, cmd_sn);
            }
            _ => self.complete(itt, Err(Failure::Rejected(reason))),
        }
    }

    /// Places Data-In payload, checking DataSN order and bounds; a bad PDU fails its command
    /// only.
    fn data_in(&mut self, d: DataIn) {
        let Some(task) = self.tasks.get_mut(&d.initiator_task_tag) else {
            return; // Already failed, aborted or forgotten.
        };
        let failure = match &mut task.kind {
            TaskKind::Scsi {
                read,
                read_len,
                received,
                next_data_sn,
                ..
            } => {
                let end = u64::from(d.buffer_offset) + d.data.len() as u64;
                if d.data_sn != *next_data_sn {
                    Some(format!(
                        "Data-In DataSN {} where {} was due",
                        d.data_sn, next_data_sn
                    ))
                } else if end > u64::from(*read_len) {
                    Some(format!(
                        "Data-In for bytes {}..{end} of a {read_len}-byte buffer",
                        d.buffer_offset
                    ))
                } else {
                    let (at, end) = (d.buffer_offset as usize, end as usize);
                    if read.capacity() == 0 {
                        // Checked against read_len above: one allocation, not zeroed.
                        read.reserve(*read_len as usize);
                    }
                    if at == read.len() {
                        read.extend_from_slice(&d.data);
                    } else {
                        if read.len() < end {
                            read.resize(end, 0);
                        }
                        read[at..end].copy_from_slice(&d.data);
                    }
                    *received += d.data.len() as u32;
                    *next_data_sn += 1;
                    None
                }
            }
            _ => Some("Data-In for a task that is not a SCSI command".into()),
        };
        if let Some(why) = failure {
            return self.complete(d.initiator_task_tag, Err(Failure::Command(why)));
        }
        if let Some(s) = d.status {
            self.finish_scsi(d.initiator_task_tag, s.status, None, s.residual);
        }
    }

    fn scsi_response(&mut self, r: ScsiResponse) {
        if r.response != ScsiResponseCode::CommandCompleted {
            let why = format!("target failure ({:?})", r.response);
            return self.complete(r.initiator_task_tag, Err(Failure::Command(why)));
        }
        let sense = r.sense();
        self.finish_scsi(r.initiator_task_tag, r.status, sense, r.residual);
    }

    fn finish_scsi(
        &mut self,
        itt: u32,
        status: ScsiStatus,
        sense: Option<Bytes>,
        residual: Residual,
    ) {
        let Some(task) = self.tasks.get_mut(&itt) else {
            return;
        };
        let TaskKind::Scsi {
            read,
            read_len,
            received,
            ..
        } = &mut task.kind
        else {
            let why = "SCSI status for a non-SCSI task".to_string();
            return self.complete(itt, Err(Failure::Command(why)));
        };
        // What the residual says came, and never more than did come.
        let len = match residual {
            Residual::Underflow(n) => read_len.saturating_sub(n),
            _ => *read_len,
        }
        .min(*received);
        let mut data = std::mem::take(read);
        // Whatever a gap at the end left unplaced reads as zeros, as it always did.
        data.resize(len as usize, 0);
        let reply = ScsiReply {
            status,
            sense,
            data: data.freeze(),
            residual,
        };
        self.complete(itt, Ok(Reply::Scsi(reply)));
    }

    /// Answers an R2T with Data-Out PDUs from the command's data.
    fn ready_to_transfer(&mut self, conn: usize, r2t: ReadyToTransfer) {
        let itt = r2t.initiator_task_tag;
        let Some(task) = self.tasks.get_mut(&itt) else {
            return;
        };
        let checked = match &mut task.kind {
            TaskKind::Scsi {
                write, next_r2t_sn, ..
            } => {
                let end =
                    u64::from(r2t.buffer_offset) + u64::from(r2t.desired_data_transfer_length);
                if r2t.r2t_sn != *next_r2t_sn {
                    Err(format!(
                        "R2TSN {} where {} was due",
                        r2t.r2t_sn, next_r2t_sn
                    ))
                } else if end > write.len() as u64 {
                    Err(format!(
                        "R2T for bytes {}..{end} of a {}-byte write",
                        r2t.buffer_offset,
                        write.len()
                    ))
                } else {
                    *next_r2t_sn += 1;
                    Ok(write.clone())
                }
            }
            _ => Err("R2T for a task that is not a SCSI command".into()),
        };
        match checked {
            Ok(data) => {
                let seq = DataOutSequence {
                    lun: r2t.lun,
                    itt,
                    ttt: r2t.target_transfer_tag,
                    from: r2t.buffer_offset,
                    to: r2t.buffer_offset + r2t.desired_data_transfer_length,
                };
                seq.queue(&mut self.conns[conn], &data);
            }
            Err(why) => self.complete(itt, Err(Failure::Command(why))),
        }
    }

    fn text_response(&mut self, conn: usize, t: TextResponse) {
        let itt = t.initiator_task_tag;
        let Some(Task {
            kind: TaskKind::Text { text },
            ..
        }) = self.tasks.get_mut(&itt)
        else {
            return;
        };
        match text.push(&t.data, t.continue_bit || !t.final_bit) {
            Err(e) => {
                let why = format!("text response: {e}");
                self.complete(itt, Err(Failure::Command(why)));
            }
            Ok(Some(all)) => self.complete(itt, Ok(Reply::Text(all))),
            Ok(None) => {
                // Ask for the rest: an empty Text Request with the target's TTT.
                let c = &mut self.conns[conn];
                c.out.push_back(Pdu::TextRequest(TextRequest {
                    immediate: true,
                    final_bit: true,
                    continue_bit: false,
                    lun: t.lun,
                    initiator_task_tag: itt,
                    target_transfer_tag: t.target_transfer_tag,
                    cmd_sn: self.cmd_sn,
                    exp_stat_sn: c.exp_stat_sn,
                    data: Bytes::new(),
                }));
            }
        }
    }
}

/// Data-Out PDUs for bytes `from..to` of a write: one sequence (DataSN from 0, F on the last),
/// each at most the target's MaxRecvDataSegmentLength.
struct DataOutSequence {
    lun: Lun,
    itt: u32,
    ttt: u32,
    from: u32,
    to: u32,
}

impl DataOutSequence {
    fn queue(&self, conn: &mut Connection, data: &Bytes) {
        let max = conn.params.max_send_data_segment_length.max(512);
        let mut offset = self.from;
        let mut data_sn = 0;
        while offset < self.to {
            let n = max.min(self.to - offset);
            conn.out.push_back(Pdu::DataOut(DataOut {
                final_bit: offset + n == self.to,
                lun: self.lun,
                initiator_task_tag: self.itt,
                target_transfer_tag: self.ttt,
                exp_stat_sn: conn.exp_stat_sn,
                data_sn,
                buffer_offset: offset,
                data: data.slice(offset as usize..(offset + n) as usize),
            }));
            offset += n;
            data_sn += 1;
        }
    }
}
