//! The deterministic pair: the initiator's machines ([`initiator::Login`],
//! [`initiator::Session`]) and the target's ([`target::Login`], then the connection on a
//! [`Rig`] with scsi-core's memory backend) in one process, on one virtual clock, joined by two
//! links that cut the byte stream anywhere, delay it, lose everything after a point or flip a bit.
//!
//! Both sides log in through their own machines; faults start once the connection is in full
//! feature phase. Nothing here sleeps, spawns or opens a socket, so every run of a test is the
//! same run.

use std::collections::{HashMap, VecDeque};
use std::time::{Duration, Instant};

use bytes::{Bytes, BytesMut};

use crate::chap::ENTROPY_LEN;
use crate::initiator::{self, Command, Failure, Reply, StartError};
use crate::negotiation::{self, NegotiationError, SessionType, Settings};
use crate::target::testing::{Options, Rig, INITIATOR, TARGET};
use crate::target::{self, Completed, LoginPolicy, Step};
use crate::{Deframer, Digests, Isid, LoginStatus, Pdu, SerialNumber};

/// What a link does to the bytes it carries once the login is over.
#[derive(Debug, Clone, Default)]
pub struct Faults {
    /// Cut the stream into pieces of 1 to 64 bytes chosen by this seed (`None`: whole writes).
    pub cut: Option<u64>,
    /// One-way delay of every piece.
    pub delay: Duration,
    /// The link breaks after this many bytes: the rest is lost (as when a cable is pulled, the
    /// sender does not know).
    pub lose_after: Option<usize>,
    /// The lowest bit of the byte at this offset is flipped.
    pub flip: Option<usize>,
}

/// One direction of the wire.
#[derive(Debug, Default)]
struct Link {
    faults: Faults,
    /// Whether the faults apply (after login).
    armed: bool,
    /// Bytes carried since the faults were armed.
    carried: usize,
    rng: u64,
    queue: VecDeque<(Instant, Bytes)>,
}

impl Link {
    fn arm(&mut self, faults: Faults) {
        self.rng = faults.cut.unwrap_or(0) | 1;
        self.faults = faults;
        self.armed = true;
    }

    fn next_random(&mut self) -> u64 {
        // xorshift64: deterministic, good enough to choose cut points.
        let mut x = self.rng;
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        self.rng = x;
        x
    }

    fn push(&mut self, now: Instant, bytes: Bytes) {
        if bytes.is_empty() {
            return;
        }
        if !self.armed {
            self.queue.push_back((now, bytes));
            return;
        }
        let start = self.carried;
        self.carried += bytes.len();
        let mut bytes = BytesMut::from(&bytes[..]);
        if let Some(at) = self
            .faults
            .flip
            .filter(|&at| at >= start && at < self.carried)
        {
            bytes[at - start] ^= 1;
        }
        if let Some(limit) = self.faults.lose_after {
            bytes.truncate(limit.saturating_sub(start).min(bytes.len()));
        }
        let due = now + self.faults.delay;
        let mut bytes = bytes.freeze();
        while !bytes.is_empty() {
            let n = match self.faults.cut {
                Some(_) => (1 + self.next_random() % 64) as usize,
                None => bytes.len(),
            };
            let piece = bytes.split_to(n.min(bytes.len()));
            self.queue.push_back((due, piece));
        }
    }

    fn pop_due(&mut self, now: Instant) -> Option<Bytes> {
        if self.queue.front().is_some_and(|(at, _)| *at <= now) {
            return self.queue.pop_front().map(|(_, b)| b);
        }
        None
    }

    fn next_due(&self) -> Option<Instant> {
        self.queue.front().map(|(at, _)| *at)
    }
}

/// How the pair is set up.
#[derive(Debug, Clone)]
pub struct PairOptions {
    /// The target's side: what it supports, its window, its unit (see [`Options`]).
    pub target: Options,
    /// What the initiator proposes (its declarations are filled in).
    pub initiator: Settings,
    /// Faults from initiator to target.
    pub to_target: Faults,
    /// Faults from target to initiator.
    pub to_initiator: Faults,
}

impl Default for PairOptions {
    fn default() -> PairOptions {
        let mut initiator = Settings {
            max_recv_data_segment_length: 262_144,
            ..Settings::default()
        };
        let op = &mut initiator.operational;
        op.initial_r2t = false;
        op.immediate_data = true;
        op.max_burst_length = 16_776_192;
        op.first_burst_length = 262_144;
        op.max_outstanding_r2t = 16;
        PairOptions {
            target: Options::default(),
            initiator,
            to_target: Faults::default(),
            to_initiator: Faults::default(),
        }
    }
}

/// The target's answers to the login: one target, anyone may log in, a new session each time.
struct Policy {
    settings: Settings,
    window: u32,
}

impl LoginPolicy for Policy {
    fn normal(&mut self, _: &str, target: &str, tsih: u16) -> Result<Settings, LoginStatus> {
        if !target.eq_ignore_ascii_case(TARGET) {
            return Err(LoginStatus::NOT_FOUND);
        }
        if tsih != 0 {
            return Err(LoginStatus::SESSION_DOES_NOT_EXIST);
        }
        let mut s = self.settings.clone();
        s.declarations.target_portal_group_tag = Some(1);
        Ok(s)
    }

    fn discovery(&mut self, _: &str) -> Result<Settings, LoginStatus> {
        Ok(self.settings.clone())
    }

    fn refused(&mut self, _: &str, _: Option<&str>, _: &NegotiationError) {}

    fn window(&self, _: u16, cmd_sn: SerialNumber) -> (SerialNumber, SerialNumber) {
        (cmd_sn, cmd_sn + (self.window - 1))
    }

    fn complete(
        &mut self,
        login: &Completed,
    ) -> Result<(u16, SerialNumber, SerialNumber), LoginStatus> {
        Ok((1, login.cmd_sn, login.cmd_sn + (self.window - 1)))
    }

    fn entropy(&mut self) -> [u8; ENTROPY_LEN] {
        [7; ENTROPY_LEN]
    }
}

/// The two machines, the links and the clock.
#[derive(Debug)]
pub struct Pair {
    /// The target connection, its device and its clock.
    pub rig: Rig,
    /// The initiator's session.
    pub initiator: initiator::Session,
    deframer: Deframer,
    to_target: Link,
    to_initiator: Link,
    /// Tasks the initiator has seen end, by ITT.
    pub done: HashMap<u32, Result<Reply, Failure>>,
    /// Why the initiator's connection closed, once it has.
    pub initiator_closed: Option<String>,
    /// Whether the target's end has been torn down (as a daemon does once a connection
    /// closes: its tasks end, the session's nexus closes).
    torn_down: bool,
}

impl Pair {
    /// Logs in through both sides' login machines (without faults), then arms the links.
    /// Panics if the login fails: the options are the caller's.
    pub fn new(options: PairOptions) -> Pair {
        let mut settings = options.initiator.clone();
        let d = &mut settings.declarations;
        d.initiator_name = Some(INITIATOR.into());
        d.target_name = Some(TARGET.into());
        d.session_type = SessionType::Normal;
        let isid = Isid([0x80, 0, 0, 0, 0, 1]);
        let mut login =
            initiator::Login::new(settings, isid, 0, 1, SerialNumber(0), [3; ENTROPY_LEN]);
        let mut target_login = target::Login::new();
        let mut policy = Policy {
            settings: options.target.target.clone(),
            window: options.target.window,
        };
        let mut from_target = Deframer::new();
        let mut to_target = Deframer::new();
        let (established, completed) = loop {
            let mut completed = None;
            while let Some(pdu) = login.poll_transmit() {
                to_target.feed(&encode(&pdu, Digests::NONE));
                while let Ok(Some(Pdu::LoginRequest(req))) = to_target.next_pdu() {
                    let response = match target_login.handle_request(&req, &mut policy) {
                        Step::Continue(r) => r,
                        Step::Done(r, done) => {
                            completed = Some(done);
                            r
                        }
                        Step::Refused(r) => panic!("the target refused the login: {r:?}"),
                    };
                    from_target.feed(&encode(&Pdu::LoginResponse(response), Digests::NONE));
                }
            }
            let Ok(Some(Pdu::LoginResponse(r))) = from_target.next_pdu() else {
                panic!("the target did not answer a login request");
            };
            match login.handle_response(r) {
                Ok(Some(e)) => break (e, completed.expect("the target completed too")),
                Ok(None) => {}
                Err(e) => panic!("the initiator's login failed: {e}"),
            }
        };
        let mut target = options.target.clone();
        target.cmd_sn = completed.cmd_sn;
        let rig = Rig::after_login(target, completed.negotiator, completed.stat_sn);
        let mut session = initiator::Session::new(
            established.session.clone(),
            established.tsih,
            established.exp_cmd_sn,
            established.max_cmd_sn,
        );
        let ci = session.add_connection(established.connection, established.exp_stat_sn);
        let mut deframer = Deframer::new();
        deframer.set_digests(session.digests(ci));
        deframer
            .set_max_recv_data_segment_length(established.connection.max_recv_data_segment_length);
        let mut pair = Pair {
            rig,
            initiator: session,
            deframer,
            to_target: Link::default(),
            to_initiator: Link::default(),
            done: HashMap::new(),
            initiator_closed: None,
            torn_down: false,
        };
        pair.to_target.arm(options.to_target);
        pair.to_initiator.arm(options.to_initiator);
        pair
    }

    /// Changes the faults of both links from now on (offsets count from here).
    pub fn set_faults(&mut self, to_target: Faults, to_initiator: Faults) {
        self.to_target.carried = 0;
        self.to_initiator.carried = 0;
        self.to_target.arm(to_target);
        self.to_initiator.arm(to_initiator);
    }

    /// The negotiated session parameters, as the initiator has them.
    pub fn params(&self) -> &negotiation::SessionParams {
        self.initiator.params()
    }

    /// The virtual time now.
    pub fn now(&self) -> Instant {
        self.rig.now
    }

    /// Starts a SCSI command.
    pub fn start(&mut self, cmd: &Command) -> Result<u32, StartError> {
        let r = self.initiator.start_command(cmd);
        self.pump();
        r
    }

    /// Starts a request with `f` on the initiator's session (NOP, TMF, text, logout).
    pub fn start_with(
        &mut self,
        f: impl FnOnce(&mut initiator::Session) -> Result<u32, StartError>,
    ) -> Result<u32, StartError> {
        let r = f(&mut self.initiator);
        self.pump();
        r
    }

    /// Runs until task `itt` ends or `limit` of virtual time has passed without it.
    pub fn wait(&mut self, itt: u32, limit: Duration) -> Option<Result<Reply, Failure>> {
        self.run_until(|p| p.done.contains_key(&itt), limit);
        self.done.remove(&itt)
    }

    /// Runs a SCSI command to its end (within a minute of virtual time).
    pub fn execute(&mut self, cmd: &Command) -> Option<Result<Reply, Failure>> {
        let itt = self.start(cmd).ok()?;
        self.wait(itt, Duration::from_secs(60))
    }

    /// Moves everything that can move now: the initiator's output onto its link, the target's
    /// onto its own, and what is due off both; until nothing moves.
    pub fn pump(&mut self) {
        loop {
            let mut moved = false;
            let now = self.rig.now;
            let digests = self.initiator.digests(0);
            while let Some(pdu) = self.initiator.poll_transmit(0) {
                if self.initiator_closed.is_none() {
                    self.to_target.push(now, encode(&pdu, digests));
                }
                moved = true;
            }
            let sent = self.rig.take_sent();
            if !sent.is_empty() {
                self.to_initiator.push(now, sent);
                moved = true;
            }
            while let Some(bytes) = self.to_target.pop_due(now) {
                self.rig.receive(&bytes);
                moved = true;
            }
            while let Some(bytes) = self.to_initiator.pop_due(now) {
                self.initiator_receives(&bytes);
                moved = true;
            }
            while let Some(ev) = self.initiator.poll_event() {
                if let initiator::Event::Done { itt, result } = ev {
                    self.done.insert(itt, result);
                }
                moved = true;
            }
            if let Some(why) = self.rig.closed.clone() {
                if self.initiator_closed.is_none() {
                    // The target closed its end: the initiator sees the connection go.
                    self.initiator_lost(format!("target closed: {why}"));
                    moved = true;
                }
                self.tear_down();
            }
            if !moved {
                return;
            }
        }
    }

    fn initiator_receives(&mut self, bytes: &[u8]) {
        if self.initiator_closed.is_some() {
            return;
        }
        self.deframer.feed(bytes);
        loop {
            match self.deframer.next_pdu() {
                Ok(Some(pdu)) => {
                    if let Err(e) = self.initiator.handle_pdu(0, pdu) {
                        return self.initiator_lost(e.0);
                    }
                }
                Ok(None) => return,
                Err(e) if e.is_fatal() => return self.initiator_lost(format!("{e}")),
                // A PDU the initiator cannot use (a data digest error): it is dropped, and its
                // command waits for recovery (none at ErrorRecoveryLevel 0) or a timeout.
                Err(_) => {}
            }
        }
    }

    /// The initiator's connection is gone: its tasks fail and the target's end drops too.
    fn initiator_lost(&mut self, why: String) {
        self.initiator_closed = Some(why.clone());
        self.initiator.connection_lost(0, &why);
        self.tear_down();
    }

    /// The target's end is gone: its tasks end and the session's nexus closes.
    fn tear_down(&mut self) {
        if !self.torn_down {
            self.torn_down = true;
            self.rig.drop_connection();
        }
    }

    /// Runs, moving the virtual clock to each next event (a piece of the wire falling due, the
    /// target's timer), until `done` holds or `limit` has passed. Returns whether `done` held.
    pub fn run_until(&mut self, mut done: impl FnMut(&Pair) -> bool, limit: Duration) -> bool {
        let end = self.rig.now + limit;
        loop {
            self.pump();
            if done(self) {
                return true;
            }
            let next = [
                self.to_target.next_due(),
                self.to_initiator.next_due(),
                self.rig
                    .closed
                    .is_none()
                    .then(|| self.rig.conn.poll_timeout())
                    .flatten(),
            ]
            .into_iter()
            .flatten()
            .min();
            match next {
                Some(at) if at <= end => {
                    let step = at.saturating_duration_since(self.rig.now);
                    self.rig.advance(step);
                }
                _ => {
                    let step = end.saturating_duration_since(self.rig.now);
                    self.rig.advance(step);
                    self.pump();
                    return done(self);
                }
            }
        }
    }
}

fn encode(pdu: &Pdu, digests: Digests) -> Bytes {
    let mut b = BytesMut::new();
    pdu.encode(digests, &mut b);
    b.freeze()
}
