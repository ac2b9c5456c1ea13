//! Target connections on a bench: one in-process SCSI device with a memory-backed unit shared
//! by every connection through the target's core ([`TargetCore`](super::TargetCore): CmdSN order per session,
//! routes of tasks to their connections), the portal group's sessions ([`SessionTable`](super::SessionTable)), a
//! virtual clock, and a wire per connection that carries bytes in whatever pieces the caller
//! cuts them into. Tests, the fuzz targets and the benches drive the connection machines through
//! it exactly as a daemon would (header first, payloads placed by the machine's plans), but
//! deterministically and without sockets or threads.
//!
//! The rig starts with one connection (index 0); more log in to its session or to new ones
//! ([`Rig::log_in`], [`Rig::join`]), with session and connection reinstatement as targetd
//! does them. The initiator's side is left to the caller: it sends PDUs ([`Rig::send`],
//! [`Rig::send_on`]) or raw bytes ([`Rig::receive`]) and reads back what the target sent
//! ([`Rig::responses`]), which checks the wire-level promises on the way (StatSN never goes
//! back, no Data-In segment beyond the initiator's MaxRecvDataSegmentLength, every command
//! answered once).

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use bytes::{Bytes, BytesMut};
use scsi_core::{
    Backend, BackendError, Device, Geometry, Identity, Limits, LogicalUnit, MemoryBackend, NexusId,
    Op, TargetPort, TaskId,
};

use super::connection::Settings;
use super::connection::{Close, Connection, Core, Event, NoBuffer, Plan};
use super::local::ConnectionCore;
pub use super::local::LocalTarget;
use super::login::Completed;
use super::session::SessionError;
use crate::chap::ENTROPY_LEN;
use crate::negotiation::{self, Negotiator, OperationalParams, Role, SessionType};
use crate::text::TextParams;
use crate::{DecodeError, Deframer, Digests, Isid, Opcode, Pdu, Received, SerialNumber, Stage};

/// The rig's target name.
pub const TARGET: &str = "iqn.2026-11.io.example:rig";
/// The rig's initiator name.
pub const INITIATOR: &str = "iqn.2026-11.io.example:initiator";
/// The ISID of the rig's first session.
pub const ISID: Isid = Isid([0x80, 0, 0, 0, 0, 1]);

/// How the rig is set up.
#[derive(Debug, Clone)]
pub struct Options {
    /// What the target supports and prefers (targetd's defaults unless changed).
    pub target: negotiation::Settings,
    /// Keys the initiator offers in the operational stage of its login, besides its
    /// declarations (for example `("HeaderDigest", "CRC32C")`).
    pub offers: Vec<(String, String)>,
    /// The connection's settings.
    pub settings: Settings,
    /// The session's command window.
    pub window: u32,
    /// The first CmdSN.
    pub cmd_sn: SerialNumber,
    /// LUN 0's block size.
    pub block_size: u32,
    /// LUN 0's capacity in blocks.
    pub blocks: u64,
    /// Whether the core delegates plain reads and writes to the connection (as targetd's
    /// does), so they end without calling the core again.
    pub delegate: bool,
}

impl Default for Options {
    fn default() -> Options {
        Options {
            target: negotiation::Settings {
                max_recv_data_segment_length: 262_144,
                operational: OperationalParams {
                    max_connections: 8,
                    initial_r2t: false,
                    immediate_data: true,
                    max_burst_length: 1 << 20,
                    first_burst_length: 256 << 10,
                    max_outstanding_r2t: 4,
                    ..OperationalParams::default()
                },
                ..negotiation::Settings::default()
            },
            offers: Vec::new(),
            settings: Settings {
                cid: 1,
                session_type: SessionType::Normal,
                max_io: 4 << 20,
                nop_interval: Duration::from_secs(5),
                nop_timeout: Duration::from_secs(5),
                data_out_timeout: Duration::from_secs(30),
            },
            window: 32,
            cmd_sn: SerialNumber(1),
            block_size: 512,
            blocks: 1 << 16,
            delegate: true,
        }
    }
}

/// A payload being read into a task's buffer: the buffer, where the payload starts, its
/// length and how much of it has arrived.
#[derive(Debug)]
struct Placing {
    buffer: Vec<u8>,
    at: usize,
    len: usize,
    got: usize,
}

/// One connection of the rig: the machine and its wire.
#[derive(Debug)]
pub struct RigConnection {
    /// The machine under test.
    pub conn: Connection<Vec<u8>>,
    /// Its CID.
    pub cid: u16,
    /// Its session's TSIH.
    pub tsih: u16,
    /// Its session's I_T nexus.
    pub nexus: NexusId,
    /// Digests in force.
    pub digests: Digests,
    /// The initiator's MaxRecvDataSegmentLength (the most a Data-In segment may carry).
    pub initiator_max_recv: u32,
    rx: Deframer,
    placing: Option<Placing>,
    /// The connection is closed, and why.
    pub closed: Option<String>,
    /// Its end has been torn down (its tasks ended, it left its session).
    torn_down: bool,
    tx: BytesMut,
    from_target: Deframer,
    last_stat_sn: Option<SerialNumber>,
    /// Commands the target answered, by ITT (SCSI Response or Data-In with status), to check
    /// that each is answered once.
    pub answered: Vec<u32>,
    /// Commands received and not yet answered, by ITT: more than one when the initiator's
    /// stream gave two commands one tag (a bit flipped where no digest catches it), and then
    /// each of them may be answered.
    unanswered: std::collections::HashMap<u32, u32>,
}

impl RigConnection {
    fn check(&mut self, p: &Pdu) {
        let stat_sn = match p {
            Pdu::ScsiResponse(r) => Some(r.stat_sn),
            Pdu::DataIn(d) => d.status.map(|s| s.stat_sn),
            Pdu::NopIn(n) if n.initiator_task_tag != crate::RESERVED_TAG => Some(n.stat_sn),
            Pdu::TaskManagementResponse(r) => Some(r.stat_sn),
            Pdu::TextResponse(r) => Some(r.stat_sn),
            Pdu::LogoutResponse(r) => Some(r.stat_sn),
            Pdu::Reject(r) => Some(r.stat_sn),
            Pdu::AsyncMessage(m) => Some(m.stat_sn),
            _ => None,
        };
        if let Some(sn) = stat_sn {
            if let Some(last) = self.last_stat_sn {
                assert_eq!(sn, last.next(), "StatSN goes up by one per status");
            }
            self.last_stat_sn = Some(sn);
        }
        if let Pdu::DataIn(d) = p {
            assert!(
                d.data.len() <= self.initiator_max_recv.max(512) as usize,
                "a Data-In segment of {} bytes beyond MaxRecvDataSegmentLength {}",
                d.data.len(),
                self.initiator_max_recv
            );
        }
        let answered = match p {
            Pdu::ScsiResponse(r) => Some(r.initiator_task_tag),
            Pdu::DataIn(d) if d.status.is_some() => Some(d.initiator_task_tag),
            _ => None,
        };
        if let Some(itt) = answered {
            let waiting = self.unanswered.get(&itt).copied().unwrap_or(0);
            if waiting > 1 {
                // One of several commands that arrived under this tag.
                self.unanswered.insert(itt, waiting - 1);
                return;
            }
            self.unanswered.remove(&itt);
            assert!(
                !self.answered.contains(&itt),
                "command {itt:#x} answered twice"
            );
            self.answered.push(itt);
        }
    }

    /// Forgets that `itt` was answered, so the initiator may reuse the tag.
    pub fn reuse_tag(&mut self, itt: u32) {
        self.answered.retain(|&t| t != itt);
    }
}

/// A login the rig has admitted into a session, waiting for its connection
/// ([`Rig::attach`]).
#[derive(Debug, Clone, Copy)]
pub struct Admitted {
    /// The connection's index.
    pub index: usize,
    /// Its session's TSIH.
    pub tsih: u16,
    /// Its session's I_T nexus.
    pub nexus: NexusId,
    /// ExpCmdSN and MaxCmdSN for the final Login Response.
    pub window: (SerialNumber, SerialNumber),
}

/// A held backend operation: its connection, task, operation and buffer.
type Held = (usize, TaskId, Op, Vec<u8>);

/// The target, its connections, the wire and the clock.
#[derive(Debug)]
pub struct Rig {
    /// The target behind the connections.
    pub target: LocalTarget,
    /// The connections by index; 0 is the first.
    pub conns: Vec<RigConnection>,
    /// LUN 0's storage.
    pub backend: MemoryBackend,
    /// When set, backend operations wait in [`Rig::held`] until [`Rig::release_backend`].
    pub hold_backend: bool,
    /// Held backend operations.
    pub held: VecDeque<Held>,
    /// When set, buffers wanted by backend operations wait until [`Rig::grant_buffers`].
    pub hold_buffers: bool,
    /// When set, the allocator has no room for write buffers now: a write gets one only when
    /// the connection may wait for it (the wait is taken as granted), else
    /// [`NoBuffer::Busy`], as targetd's reader answers with its share of the arena full.
    pub short_of_write_buffers: bool,
    wanted: VecDeque<(usize, u64, usize)>,
    /// The virtual clock.
    pub now: Instant,
    options: Options,
}

impl Rig {
    /// A rig after a login with `options`; panics if the login's negotiation fails (the
    /// options are the caller's).
    pub fn new(options: Options) -> Rig {
        let mut rig = Rig::empty(options);
        let first = rig.negotiated(None);
        rig.log_in(first, SerialNumber(1))
            .expect("the first login makes a session");
        rig
    }

    /// A login as if it had negotiated the options' offers, joining session `tsih` as CID `cid`
    /// when `join` is `Some((tsih, cid))`, else a new session of [`ISID`].
    fn negotiated(&self, join: Option<(u16, u16)>) -> Completed {
        let o = &self.options;
        let mut n = Negotiator::new(
            Role::Target,
            o.target.clone(),
            join.is_none(),
            [0; ENTROPY_LEN],
        );
        let mut keys = TextParams::new();
        keys.push("InitiatorName", INITIATOR);
        match o.settings.session_type {
            SessionType::Normal => {
                keys.push("SessionType", "Normal");
                keys.push("TargetName", TARGET);
            }
            SessionType::Discovery => keys.push("SessionType", "Discovery"),
        }
        for (k, v) in &o.offers {
            keys.push(k.as_str(), v.as_str());
        }
        n.receive(Stage::LoginOperationalNegotiation, &keys)
            .expect("the rig's login negotiates");
        let (tsih, cid) = join.unwrap_or((0, o.settings.cid));
        Completed {
            negotiator: n,
            initiator: INITIATOR.into(),
            target: (o.settings.session_type == SessionType::Normal).then(|| TARGET.into()),
            isid: ISID,
            tsih,
            cid,
            cmd_sn: o.cmd_sn,
            stat_sn: SerialNumber(1),
        }
    }

    /// The target with its unit and no connection yet: logins come through [`Rig::admit`]
    /// and [`Rig::attach`] (the deterministic pair runs the login machines for them).
    pub fn empty(options: Options) -> Rig {
        let port = TargetPort::iscsi(TARGET, 1);
        let mut device = Device::new(TARGET, vec![port]);
        device.set_delegation(options.delegate);
        let unit = LogicalUnit {
            identity: Identity::new("RIG", "memory", "0001", b"rig-lu0"),
            geometry: Geometry {
                block_size: options.block_size,
                blocks: options.blocks,
                thin: true,
                write_cache: true,
                read_only: false,
            },
            limits: Limits::default(),
        };
        device.add_lu(0, unit).expect("LUN 0 is free");
        Rig {
            target: {
                let mut t = LocalTarget::new(device, options.window);
                t.advertise(TARGET, "192.0.2.1:3260,1");
                t
            },
            conns: Vec::new(),
            backend: MemoryBackend::new(options.block_size, options.blocks),
            hold_backend: false,
            held: VecDeque::new(),
            hold_buffers: false,
            short_of_write_buffers: false,
            wanted: VecDeque::new(),
            now: Instant::now(),
            options,
        }
    }

    /// Admits a completed login as targetd does: a new session (TSIH 0), reinstating any
    /// session of the same initiator port (whose connections close now), or a connection
    /// joining session `login.tsih`, replacing one with the same CID.
    pub fn admit(&mut self, login: &Completed) -> Result<Admitted, SessionError> {
        let route = self.conns.len() as u64;
        let a = self.target.admit(login, route)?;
        Ok(self.take_admitted(a))
    }

    /// Attaches a login that [`super::LocalLogin`] admitted, closing the connections it
    /// replaced first; returns the new connection's index.
    pub fn attach_admitted(&mut self, a: super::Admitted, login: Completed) -> usize {
        let admitted = self.take_admitted(a);
        self.attach(admitted, login)
    }

    /// What the target admitted, as the rig keeps it: the connections the login replaced are
    /// closed now.
    fn take_admitted(&mut self, a: super::Admitted) -> Admitted {
        for old in a.replaced {
            self.shut(old as usize, "reinstated by a new login");
        }
        Admitted {
            index: a.route as usize,
            tsih: a.tsih,
            nexus: a.nexus,
            window: a.window,
        }
    }

    /// ExpCmdSN and MaxCmdSN for a Login Response: session `tsih`'s window, or a new session's
    /// from `cmd_sn`.
    pub fn login_window(&self, tsih: u16, cmd_sn: SerialNumber) -> (SerialNumber, SerialNumber) {
        self.target.login_window(tsih, cmd_sn)
    }

    /// The connection of an admitted login enters full feature phase; returns its index.
    pub fn attach(&mut self, admitted: Admitted, login: Completed) -> usize {
        assert_eq!(admitted.index, self.conns.len(), "attached as admitted");
        let n = login.negotiator;
        let c = *n.connection();
        let op = n.session().operational;
        let digests = Digests {
            header: c.header_digest,
            data: c.data_digest,
        };
        let mut rx = Deframer::new();
        rx.set_digests(digests);
        rx.set_max_recv_data_segment_length(c.max_recv_data_segment_length);
        let mut from_target = Deframer::new();
        from_target.set_digests(digests);
        from_target.set_max_recv_data_segment_length(c.max_send_data_segment_length.max(512));
        let settings = Settings {
            cid: login.cid,
            ..self.options.settings
        };
        self.conns.push(RigConnection {
            conn: Connection::new(self.now, settings, n, op, login.stat_sn),
            cid: login.cid,
            tsih: admitted.tsih,
            nexus: admitted.nexus,
            digests,
            initiator_max_recv: c.max_send_data_segment_length,
            rx,
            placing: None,
            closed: None,
            torn_down: false,
            tx: BytesMut::new(),
            from_target,
            last_stat_sn: None,
            answered: Vec::new(),
            unanswered: Default::default(),
        });
        admitted.index
    }

    /// Admits and attaches a completed login whose next StatSN is `stat_sn`.
    pub fn log_in(
        &mut self,
        mut login: Completed,
        stat_sn: SerialNumber,
    ) -> Result<usize, SessionError> {
        login.stat_sn = stat_sn;
        let admitted = self.admit(&login)?;
        Ok(self.attach(admitted, login))
    }

    /// A connection with CID `cid` joins the session of connection 0 (negotiating as it did);
    /// returns its index.
    pub fn join(&mut self, cid: u16) -> Result<usize, SessionError> {
        let tsih = self.conns[0].tsih;
        let login = self.negotiated(Some((tsih, cid)));
        self.log_in(login, SerialNumber(1))
    }

    /// A new leading login of the rig's initiator port ([`ISID`]): it reinstates the session
    /// of connection 0. Returns the new connection's index.
    pub fn reinstate(&mut self, cmd_sn: SerialNumber) -> usize {
        let mut login = self.negotiated(None);
        login.cmd_sn = cmd_sn;
        self.log_in(login, SerialNumber(1))
            .expect("a new session is made")
    }

    /// Hands connection `i`'s machine a whole PDU, data segment inline, as a deframer in
    /// whole-PDU mode would ([`Connection::handle_pdu`]), follows its plan, then runs as after
    /// any input.
    pub fn send_whole(&mut self, i: usize, pdu: Pdu) {
        let now = self.now;
        let plan = {
            let (t, c) = (&mut self.target, &mut self.conns[i]);
            c.conn.handle_pdu(now, pdu, &mut via(t, i, c))
        };
        assert!(
            !matches!(plan, Plan::Receive { .. } | Plan::Discard),
            "a whole PDU leaves nothing on the wire"
        );
        self.follow(i, plan);
        self.run();
    }

    /// Connection `i`'s view of the target (its session, the core, the routes to it), for a
    /// transport that drives a machine of its own on `i`'s session (iSER's tests): the
    /// rig's own machine `i` is then left alone.
    pub fn core(&mut self, i: usize) -> impl Core + '_ {
        via(&mut self.target, i, &self.conns[i])
    }

    /// ExpCmdSN and MaxCmdSN of connection 0's session now.
    pub fn window(&self) -> (SerialNumber, SerialNumber) {
        self.target.window(self.conns[0].nexus)
    }

    /// Connection 0's machine.
    pub fn conn(&self) -> &Connection<Vec<u8>> {
        &self.conns[0].conn
    }

    /// Connection 0's machine, to change (say, to trace it).
    pub fn conn_mut(&mut self) -> &mut Connection<Vec<u8>> {
        &mut self.conns[0].conn
    }

    /// Why connection 0 closed, once it has.
    pub fn closed(&self) -> Option<&str> {
        self.conns[0].closed.as_deref()
    }

    /// Connection 0's digests.
    pub fn digests(&self) -> Digests {
        self.conns[0].digests
    }

    /// Sends `pdu` from the initiator on connection 0, in one piece.
    pub fn send(&mut self, pdu: &Pdu) {
        self.send_on(0, pdu);
    }

    /// Sends `pdu` from the initiator on connection `i`, in one piece.
    pub fn send_on(&mut self, i: usize, pdu: &Pdu) {
        let mut b = BytesMut::new();
        pdu.encode(self.conns[i].digests, &mut b);
        self.receive_on(i, &b);
    }

    /// Bytes from the initiator on connection 0.
    pub fn receive(&mut self, bytes: &[u8]) {
        self.receive_on(0, bytes);
    }

    /// Bytes from the initiator on connection `i`: the target takes in every whole header and
    /// as much payload as there is, then runs until it has nothing left to do.
    pub fn receive_on(&mut self, i: usize, bytes: &[u8]) {
        if self.conns[i].closed.is_some() {
            return;
        }
        self.conns[i].rx.feed(bytes);
        self.take_in(i);
        self.run();
    }

    /// The earliest timer of the open connections.
    pub fn poll_timeout(&self) -> Option<Instant> {
        let open = self.conns.iter().filter(|c| c.closed.is_none());
        open.filter_map(|c| c.conn.poll_timeout()).min()
    }

    /// Moves the virtual clock on by `d` and lets the connections' timers fire if they are due.
    pub fn advance(&mut self, d: Duration) {
        self.now += d;
        for i in 0..self.conns.len() {
            let (t, c) = (&mut self.target, &mut self.conns[i]);
            if c.closed.is_none() && c.conn.poll_timeout().is_some_and(|at| at <= self.now) {
                c.conn.handle_timeout(self.now, &mut via(t, i, c));
            }
        }
        self.run();
    }

    /// Completes the oldest held backend operation.
    pub fn release_backend(&mut self) -> bool {
        let Some((i, task, op, buffer)) = self.held.pop_front() else {
            return false;
        };
        self.execute(i, task, op, buffer);
        self.run();
        true
    }

    /// Grants every buffer held back by [`Rig::hold_buffers`].
    pub fn grant_buffers(&mut self) {
        while let Some((i, tag, len)) = self.wanted.pop_front() {
            let (t, c) = (&mut self.target, &mut self.conns[i]);
            c.conn
                .handle_buffer(self.now, tag, Some(vec![0; len]), &mut via(t, i, c));
        }
        self.run();
    }

    /// The daemon is stopping: connection 0 asks the initiator to log out.
    pub fn ask_logout(&mut self) {
        let (t, c) = (&mut self.target, &mut self.conns[0]);
        c.conn.ask_logout(&mut via(t, 0, c));
        self.run();
    }

    /// Connection 0 tells the initiator the window ([`Connection::announce_window`]).
    pub fn announce_window(&mut self) {
        let (t, c) = (&mut self.target, &mut self.conns[0]);
        c.conn.announce_window(&mut via(t, 0, c));
        self.run();
    }

    /// A handover's park ran out of time: connection 0 aborts its tasks waiting for data-out
    /// ([`Connection::abort_awaiting_data_out`]); how many.
    pub fn abort_awaiting_data_out(&mut self) -> usize {
        let (t, c) = (&mut self.target, &mut self.conns[0]);
        let n = c.conn.abort_awaiting_data_out(&mut via(t, 0, c));
        self.run();
        n
    }

    /// Connection 0 drops (the initiator went away).
    pub fn drop_connection(&mut self) {
        self.shut(0, "dropped");
    }

    /// Connection `i` closes for `why` and its end is torn down as targetd does: its queued
    /// commands are cancelled, it leaves its session, and its tasks end (the session's nexus
    /// closes when it was the last connection; else its own tasks are aborted). Its held
    /// backend operations and buffers are let go, and it holds none from now on. Afterwards
    /// its task table must be empty.
    pub fn shut(&mut self, i: usize, why: &str) {
        if self.conns[i].torn_down {
            return;
        }
        self.conns[i].closed.get_or_insert_with(|| why.into());
        self.run();
        let (t, c) = (&mut self.target, &mut self.conns[i]);
        c.torn_down = true;
        t.leave(i as u64, c.tsih, c.nexus, &mut c.conn);
        let held = std::mem::take(&mut self.held);
        let (mine, others): (VecDeque<Held>, _) = held.into_iter().partition(|h| h.0 == i);
        self.held = others;
        for (i, task, op, buffer) in mine {
            self.execute(i, task, op, buffer);
        }
        let wanted = std::mem::take(&mut self.wanted);
        let (mine, others): (VecDeque<_>, _) = wanted.into_iter().partition(|w| w.0 == i);
        self.wanted = others;
        for (i, tag, len) in mine {
            let (t, c) = (&mut self.target, &mut self.conns[i]);
            c.conn
                .handle_buffer(self.now, tag, Some(vec![0; len]), &mut via(t, i, c));
        }
        self.run();
        self.conns[i].tx.clear();
    }

    /// The bytes connection 0 has sent since the last call ([`Rig::take_sent_on`]).
    pub fn take_sent(&mut self) -> Bytes {
        self.take_sent_on(0)
    }

    /// The bytes connection `i` has sent since the last call, as they go on the wire. They
    /// are decoded and checked on the way as [`Rig::responses`] does (and so panic on a broken
    /// promise); mix the two only at PDU boundaries.
    pub fn take_sent_on(&mut self, i: usize) -> Bytes {
        let c = &mut self.conns[i];
        let bytes = c.tx.split().freeze();
        c.from_target.feed(&bytes);
        loop {
            match c.from_target.next_pdu() {
                Ok(Some(p)) => c.check(&p),
                Ok(None) => return bytes,
                Err(e) => panic!("the target sent a malformed PDU: {e}"),
            }
        }
    }

    /// The PDUs connection 0 has sent since the last call ([`Rig::responses_on`]).
    pub fn responses(&mut self) -> Vec<Pdu> {
        self.responses_on(0)
    }

    /// The PDUs connection `i` has sent since the last call, decoded as the initiator would.
    /// Panics if the stream breaks a promise: a malformed PDU, StatSN going back, a Data-In
    /// segment beyond the initiator's MaxRecvDataSegmentLength, or a command answered twice.
    pub fn responses_on(&mut self, i: usize) -> Vec<Pdu> {
        let c = &mut self.conns[i];
        c.from_target.feed(&c.tx.split());
        let mut out = Vec::new();
        loop {
            match c.from_target.next_pdu() {
                Ok(Some(p)) => {
                    c.check(&p);
                    out.push(p);
                }
                Ok(None) => return out,
                Err(e) => panic!("the target sent a malformed PDU: {e}"),
            }
        }
    }

    /// Forgets that `itt` was answered on connection 0, so the initiator may reuse the tag.
    pub fn reuse_tag(&mut self, itt: u32) {
        self.conns[0].reuse_tag(itt);
    }

    /// Takes headers and payloads out of connection `i`'s receive buffer while there are whole
    /// ones.
    fn take_in(&mut self, i: usize) {
        let direct = |op: Opcode| matches!(op, Opcode::ScsiCommand | Opcode::DataOut);
        loop {
            let (t, c) = (&mut self.target, &mut self.conns[i]);
            if c.closed.is_some() || c.conn.closing().is_some() {
                return;
            }
            if let Some(p) = &mut c.placing {
                let (at, len) = (p.at, p.len);
                p.got += c.rx.payload(&mut p.buffer[at + p.got..at + len]);
                if p.got < len {
                    return;
                }
                match c.rx.end_payload() {
                    Ok(None) => return,
                    Ok(Some(())) => {
                        let p = c.placing.take().expect("placing");
                        c.conn.handle_payload(self.now, p.buffer, &mut via(t, i, c));
                    }
                    Err(e) => {
                        let p = c.placing.take().expect("placing");
                        match e.reject() {
                            Some((reason, header)) => c.conn.handle_payload_error(
                                p.buffer,
                                reason,
                                header,
                                &mut via(t, i, c),
                            ),
                            None => {
                                c.closed.get_or_insert(format!("payload: {e}"));
                                return;
                            }
                        }
                    }
                }
                self.run();
                continue;
            }
            let next = c.rx.next_header(direct);
            if let Ok(Some(
                Received::Pdu(Pdu::ScsiCommand(cmd))
                | Received::Header {
                    pdu: Pdu::ScsiCommand(cmd),
                    ..
                },
            )) = &next
            {
                // A new command may reuse the tag of an answered one.
                c.reuse_tag(cmd.initiator_task_tag);
                *c.unanswered.entry(cmd.initiator_task_tag).or_default() += 1;
            }
            let now = self.now;
            let plan = match next {
                Ok(None) => return,
                Ok(Some(Received::Pdu(pdu))) => c.conn.handle_pdu(now, pdu, &mut via(t, i, c)),
                Ok(Some(Received::Header { pdu, header, len })) => {
                    c.conn
                        .handle_header(now, pdu, &header, len, &mut via(t, i, c))
                }
                Err(
                    e @ (DecodeError::HeaderDigest { .. } | DecodeError::DataSegmentTooLong { .. }),
                ) => {
                    c.closed.get_or_insert(format!("fatal: {e}"));
                    return;
                }
                Err(e) => match e.reject() {
                    Some((reason, header)) => {
                        c.conn.handle_reject(now, reason, header, &mut via(t, i, c));
                        Plan::Next
                    }
                    None => {
                        c.closed.get_or_insert(format!("undecodable: {e}"));
                        return;
                    }
                },
            };
            self.follow(i, plan);
            self.run();
        }
    }

    fn follow(&mut self, i: usize, mut plan: Plan<Vec<u8>>) {
        loop {
            let (t, c) = (&mut self.target, &mut self.conns[i]);
            match plan {
                Plan::Next => return,
                Plan::Discard => {
                    c.rx.discard_payload();
                    return;
                }
                Plan::Allocate(len) => {
                    let b = if self.short_of_write_buffers && !c.conn.may_wait_for_buffer() {
                        Err(NoBuffer::Busy)
                    } else {
                        Ok(vec![0; len as usize])
                    };
                    plan = c.conn.handle_allocated(self.now, b, &mut via(t, i, c));
                }
                Plan::Receive { buffer, at, len } => {
                    assert!(at + len <= buffer.len(), "a plan within its buffer");
                    c.placing = Some(Placing {
                        buffer,
                        at,
                        len,
                        got: 0,
                    });
                    return;
                }
            }
        }
    }

    fn execute(&mut self, i: usize, task: TaskId, op: Op, buffer: Vec<u8>) {
        self.backend.submit(0, op, buffer);
        while let Some((_, result, buffer)) = self.backend.poll_completion() {
            let (t, c) = (&mut self.target, &mut self.conns[i]);
            c.conn
                .handle_backend_done(self.now, task, buffer, result, &mut via(t, i, c));
        }
    }

    /// Runs every connection's requests and the core's events until none has anything left,
    /// closes the connections something asked to close, then puts the output on the wires.
    pub fn run(&mut self) {
        self.run_until_still();
        // A retirement the core refuses is the connection's mistake: every test and the fuzz
        // targets check it here.
        assert_eq!(
            self.target.misretired(),
            0,
            "a delegated task is retired once"
        );
    }

    fn run_until_still(&mut self) {
        loop {
            let mut moved = false;
            for i in 0..self.conns.len() {
                while self.step(i) {
                    moved = true;
                }
            }
            let asked = std::mem::take(&mut self.target.close_requests);
            for i in asked.into_iter().map(|route| route as usize) {
                // Its output so far goes out first (a logout's response on another
                // connection is queued before the close).
                self.flush(i);
                self.shut(i, "closed by the session");
                moved = true;
            }
            if !moved {
                break;
            }
        }
        for i in 0..self.conns.len() {
            self.flush(i);
            let c = &mut self.conns[i];
            if c.conn.closing() == Some(Close::NoPingAnswer) {
                c.closed.get_or_insert_with(|| "no answer to a ping".into());
            }
        }
    }

    /// Handles one event of connection `i`; false when it had none.
    fn step(&mut self, i: usize) -> bool {
        let (t, c) = (&mut self.target, &mut self.conns[i]);
        let Some(ev) = c.conn.poll_event(self.now, &mut via(t, i, c)) else {
            return false;
        };
        match ev {
            Event::Backend {
                task,
                lun,
                op,
                buffer,
            } => {
                if lun != 0 {
                    let gone = Err(BackendError::Internal);
                    c.conn
                        .handle_backend_done(self.now, task, buffer, gone, &mut via(t, i, c));
                } else if self.hold_backend && !c.torn_down {
                    self.held.push_back((i, task, op, buffer));
                } else {
                    self.execute(i, task, op, buffer);
                }
            }
            Event::BufferWanted { tag, len } => {
                if self.hold_buffers && !c.torn_down {
                    self.wanted.push_back((i, tag, len));
                } else {
                    c.conn
                        .handle_buffer(self.now, tag, Some(vec![0; len]), &mut via(t, i, c));
                }
            }
            Event::Completed(_) => {}
        }
        true
    }

    /// Puts connection `i`'s output on its wire (dropped once it is closed).
    fn flush(&mut self, i: usize) {
        let (t, c) = (&self.target, &mut self.conns[i]);
        let (exp, max) = t.window(c.nexus);
        let max_segment = c.conn.max_send_data_segment_length();
        while let Some(x) = c.conn.poll_transmit() {
            if c.closed.is_none() {
                x.encode(c.digests, max_segment, exp, max, &mut c.tx);
            }
        }
    }

    /// A read of `blocks` blocks at `lba` straight from LUN 0's storage.
    pub fn stored(&mut self, lba: u64, blocks: u32) -> Bytes {
        let bs = self
            .target
            .core
            .device()
            .logical_unit(0)
            .map_or(512, |u| u.geometry.block_size);
        let buf = vec![0; (blocks * bs) as usize];
        self.backend.submit(
            0,
            Op::Read {
                lba,
                blocks,
                offset: 0,
                fua: false,
            },
            buf,
        );
        let (_, r, buf) = self
            .backend
            .poll_completion()
            .expect("memory completes at once");
        r.expect("in range");
        Bytes::from(buf)
    }
}

/// Connection `i`'s view of the target ([`Core`]).
fn via<'a>(target: &'a mut LocalTarget, i: usize, c: &RigConnection) -> ConnectionCore<'a> {
    target.connection(i as u64, c.tsih, c.nexus)
}
