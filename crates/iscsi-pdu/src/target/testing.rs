//! A target connection on a bench: one in-process SCSI device with a memory-backed unit, the
//! session's CmdSN order, a virtual clock, and a wire that carries bytes in whatever pieces the
//! caller cuts them into. Tests, the fuzz target and the benches drive the connection machine
//! through it exactly as a daemon would (header first, payloads placed by the machine's plans),
//! but deterministically and without sockets or threads.
//!
//! The initiator's side is left to the caller: it sends PDUs ([`Rig::send`]) or raw bytes
//! ([`Rig::receive`]) and reads back what the target sent ([`Rig::responses`]), which checks the
//! wire-level promises on the way (StatSN never goes back, no Data-In segment beyond the
//! initiator's MaxRecvDataSegmentLength).

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use bytes::{Bytes, BytesMut};
use scsi_core::{
    Backend, BackendError, Device, Geometry, Identity, Limits, LogicalUnit, MemoryBackend, NexusId,
    Op, Output, TargetPort, TaskId, TmfFunction, TransportId,
};

use super::connection::Settings;
use super::connection::{Close, Connection, CoreEvent, Event, Nexus, OrderedCommand, Plan};
use super::order::CommandOrder;
use crate::chap::ENTROPY_LEN;
use crate::negotiation::{self, Negotiator, OperationalParams, Role, SessionType};
use crate::text::TextParams;
use crate::{DecodeError, Deframer, Digests, Opcode, Pdu, Received, SerialNumber, Stage};

/// The rig's target name.
pub const TARGET: &str = "iqn.2026-11.io.example:rig";
/// The rig's initiator name.
pub const INITIATOR: &str = "iqn.2026-11.io.example:initiator";

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
            },
            window: 32,
            cmd_sn: SerialNumber(1),
            block_size: 512,
            blocks: 1 << 16,
            delegate: true,
        }
    }
}

/// The session and the SCSI core as the rig's one connection reaches them.
#[derive(Debug)]
pub struct LocalNexus {
    /// The SCSI device.
    pub device: Device,
    /// The session's I_T nexus.
    pub nexus: NexusId,
    order: CommandOrder<OrderedCommand>,
    local: VecDeque<CoreEvent>,
    next_reference: u64,
    /// CIDs of the session's other connections (a logout may name them).
    pub other_cids: Vec<u16>,
    /// Connections closed through [`Nexus::close_connection`].
    pub closed_cids: Vec<u16>,
    /// Whether the session's other connections were closed (logout of the session).
    pub session_closed: bool,
    /// Whether a TARGET COLD RESET closed the target's other sessions.
    pub target_reset: bool,
}

impl LocalNexus {
    fn drain(&mut self) {
        while let Some(a) = self.device.poll() {
            self.local.push_back(CoreEvent::Action(a));
        }
    }

    fn submit(&mut self, q: &OrderedCommand) {
        if let Ok(task) = self.device.submit(q.command(self.nexus)) {
            self.local.push_back(CoreEvent::Submitted {
                tag: u64::from(q.itt),
                task,
            });
        }
        self.drain();
    }

    fn release(&mut self) {
        while let Some(q) = self.order.next_ready() {
            self.submit(&q);
        }
    }
}

impl Nexus for LocalNexus {
    fn poll_core(&mut self) -> Option<CoreEvent> {
        self.local.pop_front()
    }

    fn window(&self) -> (SerialNumber, SerialNumber) {
        self.order.window()
    }

    fn deliver(&mut self, cmd: OrderedCommand, immediate: bool) -> bool {
        if immediate {
            self.submit(&cmd);
            return true;
        }
        if !self.order.admit(cmd.cmd_sn, Some(cmd)) {
            return false;
        }
        self.release();
        true
    }

    fn take_cmd_sn(&mut self, cmd_sn: SerialNumber) -> bool {
        if !self.order.admit(cmd_sn, None) {
            return false;
        }
        self.release();
        true
    }

    fn data_out(&mut self, task: TaskId, data: &[u8]) {
        let _ = self.device.data_out(task, data);
        self.drain();
    }

    fn backend_done(&mut self, task: TaskId, result: Result<Output, BackendError>) {
        let _ = self.device.backend_done(task, result);
        self.drain();
    }

    fn retire(&mut self, task: TaskId) {
        // A retirement the core refuses is the connection's mistake: every test and the fuzz
        // targets check it here.
        self.device
            .retire(task)
            .expect("a delegated task is retired once");
        self.drain();
    }

    fn task_management(&mut self, lun: u64, function: TmfFunction) -> Option<u64> {
        self.next_reference += 1;
        let r = self.next_reference;
        let ok = self
            .device
            .task_management(self.nexus, lun, function, r)
            .is_ok();
        self.drain();
        ok.then_some(r)
    }

    fn block_size(&mut self, lun: u16) -> Option<u32> {
        self.device.logical_unit(lun).map(|u| u.geometry.block_size)
    }

    fn send_targets(&mut self, _value: &str) -> TextParams {
        let mut t = TextParams::new();
        t.push("TargetName", TARGET);
        t.push("TargetAddress", "192.0.2.1:3260,1");
        t
    }

    fn close_connection(&mut self, cid: u16) -> bool {
        let known = self.other_cids.contains(&cid);
        if known {
            self.closed_cids.push(cid);
        }
        known
    }

    fn cancel_queued(&mut self) {
        self.order.cancel(|_| true);
    }

    fn close_session(&mut self) {
        self.session_closed = true;
    }

    fn reset_target(&mut self) {
        self.target_reset = true;
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

/// The target connection, its session and device, the wire and the clock.
#[derive(Debug)]
pub struct Rig {
    /// The machine under test.
    pub conn: Connection<Vec<u8>>,
    /// Its session and device.
    pub nexus: LocalNexus,
    /// LUN 0's storage.
    pub backend: MemoryBackend,
    /// When set, backend operations wait in [`Rig::held`] until [`Rig::release_backend`].
    pub hold_backend: bool,
    /// Held backend operations.
    pub held: VecDeque<(TaskId, Op, Vec<u8>)>,
    /// When set, buffers wanted by backend operations wait until [`Rig::grant_buffers`].
    pub hold_buffers: bool,
    wanted: VecDeque<(u64, usize)>,
    /// The virtual clock.
    pub now: Instant,
    /// Digests in force.
    pub digests: Digests,
    /// The initiator's MaxRecvDataSegmentLength (the most a Data-In segment may carry).
    pub initiator_max_recv: u32,
    rx: Deframer,
    placing: Option<Placing>,
    /// The connection is closed, and why.
    pub closed: Option<String>,
    tx: BytesMut,
    from_target: Deframer,
    last_stat_sn: Option<SerialNumber>,
    /// Commands the target answered, by ITT (SCSI Response or Data-In with status), to check
    /// that each is answered once.
    pub answered: Vec<u32>,
}

impl Rig {
    /// A rig after a login with `options`; panics if the login's negotiation fails (the
    /// options are the caller's).
    pub fn new(options: Options) -> Rig {
        let mut n = Negotiator::new(Role::Target, options.target.clone(), true, [0; ENTROPY_LEN]);
        let mut keys = TextParams::new();
        keys.push("InitiatorName", INITIATOR);
        match options.settings.session_type {
            SessionType::Normal => {
                keys.push("SessionType", "Normal");
                keys.push("TargetName", TARGET);
            }
            SessionType::Discovery => keys.push("SessionType", "Discovery"),
        }
        for (k, v) in &options.offers {
            keys.push(k.as_str(), v.as_str());
        }
        n.receive(Stage::LoginOperationalNegotiation, &keys)
            .expect("the rig's login negotiates");
        Rig::after_login(options, n, SerialNumber(1))
    }

    /// A rig whose connection enters full feature phase after a login that ended in `n`, its
    /// next StatSN `stat_sn` (the deterministic pair logs in through the target's [`Login`]
    /// machine and hands over here).
    ///
    /// [`Login`]: super::Login
    pub fn after_login(options: Options, n: Negotiator, stat_sn: SerialNumber) -> Rig {
        let c = *n.connection();
        let op = n.session().operational;
        let digests = Digests {
            header: c.header_digest,
            data: c.data_digest,
        };
        let port = TargetPort {
            relative_port: 1,
            port_group: 1,
            name: format!("{TARGET},t,0x1"),
            target_name: TARGET.into(),
        };
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
        let nexus = device.open_nexus(TransportId::iscsi(INITIATOR, [0x80, 0, 0, 0, 0, 1]), 1);
        let mut rx = Deframer::new();
        rx.set_digests(digests);
        rx.set_max_recv_data_segment_length(c.max_recv_data_segment_length);
        let mut from_target = Deframer::new();
        from_target.set_digests(digests);
        from_target.set_max_recv_data_segment_length(c.max_send_data_segment_length.max(512));
        let now = Instant::now();
        Rig {
            conn: Connection::new(now, options.settings, n, op, stat_sn),
            nexus: LocalNexus {
                device,
                nexus,
                order: CommandOrder::new(options.cmd_sn, options.window),
                local: VecDeque::new(),
                next_reference: 0,
                other_cids: Vec::new(),
                closed_cids: Vec::new(),
                session_closed: false,
                target_reset: false,
            },
            backend: MemoryBackend::new(options.block_size, options.blocks),
            hold_backend: false,
            held: VecDeque::new(),
            hold_buffers: false,
            wanted: VecDeque::new(),
            now,
            digests,
            initiator_max_recv: c.max_send_data_segment_length,
            rx,
            placing: None,
            closed: None,
            tx: BytesMut::new(),
            from_target,
            last_stat_sn: None,
            answered: Vec::new(),
        }
    }

    /// Sends `pdu` from the initiator, in one piece.
    pub fn send(&mut self, pdu: &Pdu) {
        let mut b = BytesMut::new();
        pdu.encode(self.digests, &mut b);
        self.receive(&b);
    }

    /// Bytes from the initiator: the target takes in every whole header and as much payload as
    /// there is, then runs until it has nothing left to do.
    pub fn receive(&mut self, bytes: &[u8]) {
        if self.closed.is_some() {
            return;
        }
        self.rx.feed(bytes);
        self.take_in();
        self.run();
    }

    /// Moves the virtual clock on by `d` and lets the connection's timer fire if it is due.
    pub fn advance(&mut self, d: Duration) {
        self.now += d;
        if self.closed.is_some() {
            return;
        }
        if self.conn.poll_timeout().is_some_and(|t| t <= self.now) {
            self.conn.handle_timeout(self.now, &mut self.nexus);
        }
        self.run();
    }

    /// Completes the oldest held backend operation.
    pub fn release_backend(&mut self) -> bool {
        let Some((task, op, buffer)) = self.held.pop_front() else {
            return false;
        };
        self.execute(task, op, buffer);
        self.run();
        true
    }

    /// Grants every buffer held back by [`Rig::hold_buffers`].
    pub fn grant_buffers(&mut self) {
        while let Some((tag, len)) = self.wanted.pop_front() {
            self.conn
                .handle_buffer(self.now, tag, Some(vec![0; len]), &mut self.nexus);
        }
        self.run();
    }

    /// The daemon is stopping: the connection asks the initiator to log out.
    pub fn ask_logout(&mut self) {
        self.conn.ask_logout(&mut self.nexus);
        self.run();
    }

    /// The connection drops (the initiator went away): the session ends, as when it was its
    /// last connection, and every task ends. Afterwards the task table must be empty.
    pub fn drop_connection(&mut self) {
        self.closed.get_or_insert_with(|| "dropped".into());
        self.run();
        self.conn.close(true, &mut self.nexus);
        let _ = self.nexus.device.close_nexus(self.nexus.nexus);
        self.nexus.drain();
        self.hold_backend = false;
        while let Some((task, op, buffer)) = self.held.pop_front() {
            self.execute(task, op, buffer);
        }
        self.hold_buffers = false;
        self.grant_buffers();
        self.run();
        self.tx.clear();
    }

    /// The bytes the target has sent since the last call, as they go on the wire. They are
    /// decoded and checked on the way as [`Rig::responses`] does (and so panic on a broken
    /// promise); mix the two only at PDU boundaries.
    pub fn take_sent(&mut self) -> Bytes {
        let bytes = self.tx.split().freeze();
        self.from_target.feed(&bytes);
        loop {
            match self.from_target.next_pdu() {
                Ok(Some(p)) => self.check(&p),
                Ok(None) => return bytes,
                Err(e) => panic!("the target sent a malformed PDU: {e}"),
            }
        }
    }

    /// The PDUs the target has sent since the last call, decoded as the initiator would. Panics
    /// if the stream breaks a promise: a malformed PDU, StatSN going back, a Data-In segment
    /// beyond the initiator's MaxRecvDataSegmentLength, or a command answered twice.
    pub fn responses(&mut self) -> Vec<Pdu> {
        self.from_target.feed(&self.tx.split());
        let mut out = Vec::new();
        loop {
            match self.from_target.next_pdu() {
                Ok(Some(p)) => {
                    self.check(&p);
                    out.push(p);
                }
                Ok(None) => return out,
                Err(e) => panic!("the target sent a malformed PDU: {e}"),
            }
        }
    }

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

    fn close(&mut self, why: String) {
        self.closed.get_or_insert(why);
    }

    /// Takes headers and payloads out of the receive buffer while there are whole ones.
    fn take_in(&mut self) {
        let direct = |op: Opcode| matches!(op, Opcode::ScsiCommand | Opcode::DataOut);
        loop {
            if self.closed.is_some() || self.conn.closing().is_some() {
                return;
            }
            if let Some(p) = &mut self.placing {
                let (at, len) = (p.at, p.len);
                p.got += self.rx.payload(&mut p.buffer[at + p.got..at + len]);
                if p.got < len {
                    return;
                }
                match self.rx.end_payload() {
                    Ok(None) => return,
                    Ok(Some(())) => {
                        let p = self.placing.take().expect("placing");
                        self.conn
                            .handle_payload(self.now, p.buffer, &mut self.nexus);
                    }
                    Err(e) => {
                        let p = self.placing.take().expect("placing");
                        match e.reject() {
                            Some((reason, header)) => self.conn.handle_payload_error(
                                p.buffer,
                                reason,
                                header,
                                &mut self.nexus,
                            ),
                            None => return self.close(format!("payload: {e}")),
                        }
                    }
                }
                self.run();
                continue;
            }
            let next = self.rx.next_header(direct);
            if let Ok(Some(
                Received::Pdu(Pdu::ScsiCommand(c))
                | Received::Header {
                    pdu: Pdu::ScsiCommand(c),
                    ..
                },
            )) = &next
            {
                // A new command may reuse the tag of an answered one.
                self.reuse_tag(c.initiator_task_tag);
            }
            let plan = match next {
                Ok(None) => return,
                Ok(Some(Received::Pdu(pdu))) => {
                    self.conn.handle_pdu(self.now, pdu, &mut self.nexus)
                }
                Ok(Some(Received::Header { pdu, header, len })) => {
                    self.conn
                        .handle_header(self.now, pdu, &header, len, &mut self.nexus)
                }
                Err(
                    e @ (DecodeError::HeaderDigest { .. } | DecodeError::DataSegmentTooLong { .. }),
                ) => return self.close(format!("fatal: {e}")),
                Err(e) => match e.reject() {
                    Some((reason, header)) => {
                        self.conn
                            .handle_reject(self.now, reason, header, &mut self.nexus);
                        Plan::Next
                    }
                    None => return self.close(format!("undecodable: {e}")),
                },
            };
            self.follow(plan);
            self.run();
        }
    }

    fn follow(&mut self, mut plan: Plan<Vec<u8>>) {
        loop {
            match plan {
                Plan::Next => return,
                Plan::Discard => {
                    self.rx.discard_payload();
                    return;
                }
                Plan::Allocate(len) => {
                    let b = vec![0; len as usize];
                    plan = self
                        .conn
                        .handle_allocated(self.now, Some(b), &mut self.nexus);
                }
                Plan::Receive { buffer, at, len } => {
                    assert!(at + len <= buffer.len(), "a plan within its buffer");
                    self.placing = Some(Placing {
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

    fn execute(&mut self, task: TaskId, op: Op, buffer: Vec<u8>) {
        self.backend.submit(0, op, buffer);
        while let Some((_, result, buffer)) = self.backend.poll_completion() {
            self.conn
                .handle_backend_done(self.now, task, buffer, result, &mut self.nexus);
        }
    }

    /// Runs the machine's requests and the core's events until neither has anything left,
    /// then puts the output on the wire.
    pub fn run(&mut self) {
        while let Some(ev) = self.conn.poll_event(self.now, &mut self.nexus) {
            match ev {
                Event::Backend {
                    task,
                    lun,
                    op,
                    buffer,
                } => {
                    if lun != 0 {
                        let gone = Err(BackendError::Internal);
                        self.conn.handle_backend_done(
                            self.now,
                            task,
                            buffer,
                            gone,
                            &mut self.nexus,
                        );
                    } else if self.hold_backend {
                        self.held.push_back((task, op, buffer));
                    } else {
                        self.execute(task, op, buffer);
                    }
                }
                Event::BufferWanted { tag, len } => {
                    if self.hold_buffers {
                        self.wanted.push_back((tag, len));
                    } else {
                        self.conn
                            .handle_buffer(self.now, tag, Some(vec![0; len]), &mut self.nexus);
                    }
                }
                Event::Completed(_) => {}
            }
        }
        let (exp, max) = self.nexus.window();
        let max_segment = self.conn.max_send_data_segment_length();
        while let Some(t) = self.conn.poll_transmit() {
            if self.closed.is_none() {
                t.encode(self.digests, max_segment, exp, max, &mut self.tx);
            }
        }
        if self.conn.closing() == Some(Close::NoPingAnswer) {
            self.close("no answer to a ping".into());
        }
    }

    /// A read of `blocks` blocks at `lba` straight from LUN 0's storage.
    pub fn stored(&mut self, lba: u64, blocks: u32) -> Bytes {
        let bs = self
            .nexus
            .device
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
