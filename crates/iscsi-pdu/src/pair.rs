//! The deterministic pair: the initiator's machines ([`initiator::Login`],
//! [`initiator::Session`]) and the target's ([`target_node::Login`], then the connections on a
//! [`Rig`] with scsi-core's memory backend) in one process, on one virtual clock, each
//! connection joined by two links that cut the byte stream anywhere, delay it, lose everything
//! after a point or flip a bit. A session may have several connections ([`Pair::connect`]).
//!
//! Both sides log in through their own machines; faults start once the connection is in full
//! feature phase. Nothing here sleeps, spawns or opens a socket, so every run of a test is the
//! same run.

use std::collections::{HashMap, VecDeque};
use std::time::{Duration, Instant};

use bytes::{Bytes, BytesMut};

use crate::chap::ENTROPY_LEN;
use crate::initiator::{self, Command, Failure, Reply, StartError};
use crate::negotiation::{self, SessionType, Settings};
use crate::target_node::testing::{Options, Rig, INITIATOR, TARGET};
use crate::target_node::{self, LocalLogin, Step};
use crate::{Deframer, Digests, Isid, Pdu, SerialNumber};

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

/// Runs a login through both sides' machines, without faults: the initiator's `login` against
/// the target's [`target_node::Login`] answering for `rig`. Returns what the initiator established
/// and the rig's index of the new connection; panics if either side fails.
fn log_in(
    rig: &mut Rig,
    target_settings: &Settings,
    mut login: initiator::Login,
) -> (initiator::Established, usize) {
    let mut target_login = target_node::Login::new();
    // The target's answers: one target, anyone may log in; sessions are made and joined in
    // the rig's session table, as targetd's registry does.
    let route = rig.conns.len() as u64;
    let fixed = || [7; ENTROPY_LEN];
    let mut policy = LocalLogin::new(&mut rig.target, target_settings.clone(), route, Some(fixed));
    let mut from_target = Deframer::new();
    let mut to_target = Deframer::new();
    let mut completed = None;
    loop {
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
            Ok(Some(e)) => {
                let done = completed.expect("the target completed too");
                let admitted = policy.admitted.take().expect("admitted");
                return (e, rig.attach_admitted(admitted, *done));
            }
            Ok(None) => {}
            Err(e) => panic!("the initiator's login failed: {e}"),
        }
    }
}

/// One connection of the pair: the rig's end, the initiator's deframer and the two links.
#[derive(Debug)]
struct PairLink {
    /// The rig's index of the target's end.
    rig: usize,
    deframer: Deframer,
    to_target: Link,
    to_initiator: Link,
    /// Why the initiator's end closed, once it has.
    closed: Option<String>,
    /// Whether the target's end has been torn down (as a daemon does once a connection
    /// closes: its tasks end, and the session's nexus closes with its last connection).
    torn_down: bool,
}

/// The two machines, the links and the clock.
#[derive(Debug)]
pub struct Pair {
    /// The target: its connections, its device and its clock.
    pub rig: Rig,
    /// The initiator's session.
    pub initiator: initiator::Session,
    /// The session's connections, by the initiator's index.
    links: Vec<PairLink>,
    /// Tasks the initiator has seen end, by ITT.
    pub done: HashMap<u32, Result<Reply, Failure>>,
    /// What the initiator proposes, for connections that join later.
    settings: Settings,
    /// What the target supports.
    target_settings: Settings,
}

/// The ISID of the pair's session.
const ISID: Isid = Isid([0x80, 0, 0, 0, 0, 1]);

impl Pair {
    /// Logs in through both sides' login machines (without faults), then arms the links.
    /// Panics if the login fails: the options are the caller's.
    pub fn new(options: PairOptions) -> Pair {
        let mut settings = options.initiator.clone();
        let d = &mut settings.declarations;
        d.initiator_name = Some(INITIATOR.into());
        d.target_name = Some(TARGET.into());
        d.session_type = SessionType::Normal;
        let login = initiator::Login::new(
            settings.clone(),
            ISID,
            0,
            1,
            SerialNumber(0),
            [3; ENTROPY_LEN],
        );
        let mut rig = Rig::empty(options.target.clone());
        let target_settings = options.target.target.clone();
        let (established, index) = log_in(&mut rig, &target_settings, login);
        let session = initiator::Session::new(
            established.session.clone(),
            established.tsih,
            established.exp_cmd_sn,
            established.max_cmd_sn,
        );
        let mut pair = Pair {
            rig,
            initiator: session,
            links: Vec::new(),
            done: HashMap::new(),
            settings,
            target_settings,
        };
        pair.add_link(established, index, options.to_target, options.to_initiator);
        pair
    }

    fn add_link(
        &mut self,
        established: initiator::Established,
        rig: usize,
        to_target: Faults,
        to_initiator: Faults,
    ) -> usize {
        let ci = self
            .initiator
            .add_connection(established.connection, established.exp_stat_sn);
        let mut deframer = Deframer::new();
        deframer.set_digests(self.initiator.digests(ci));
        deframer
            .set_max_recv_data_segment_length(established.connection.max_recv_data_segment_length);
        let mut link = PairLink {
            rig,
            deframer,
            to_target: Link::default(),
            to_initiator: Link::default(),
            closed: None,
            torn_down: false,
        };
        link.to_target.arm(to_target);
        link.to_initiator.arm(to_initiator);
        assert_eq!(ci, self.links.len(), "one link per connection");
        self.links.push(link);
        ci
    }

    /// Another connection with CID `cid` logs in to the session (MC/S) through both login
    /// machines, its links with these faults once it is in full feature phase. Returns the
    /// initiator's index of it (the initiator spreads commands over its connections).
    pub fn connect(&mut self, cid: u16, to_target: Faults, to_initiator: Faults) -> usize {
        let login = initiator::Login::new(
            self.settings.clone(),
            ISID,
            self.initiator.tsih(),
            cid,
            self.initiator.window().0,
            [3; ENTROPY_LEN],
        );
        let (established, index) = log_in(&mut self.rig, &self.target_settings, login);
        self.add_link(established, index, to_target, to_initiator)
    }

    /// Changes the faults of connection 0's links from now on (offsets count from here).
    pub fn set_faults(&mut self, to_target: Faults, to_initiator: Faults) {
        self.set_faults_on(0, to_target, to_initiator);
    }

    /// Changes the faults of connection `ci`'s links from now on (offsets count from here).
    pub fn set_faults_on(&mut self, ci: usize, to_target: Faults, to_initiator: Faults) {
        let link = &mut self.links[ci];
        link.to_target.carried = 0;
        link.to_initiator.carried = 0;
        link.to_target.arm(to_target);
        link.to_initiator.arm(to_initiator);
    }

    /// Why the initiator's connection 0 closed, once it has.
    pub fn initiator_closed(&self) -> Option<&str> {
        self.closed_on(0)
    }

    /// Why the initiator's connection `ci` closed, once it has.
    pub fn closed_on(&self, ci: usize) -> Option<&str> {
        self.links[ci].closed.as_deref()
    }

    /// The rig's index of the initiator's connection `ci`.
    pub fn rig_index(&self, ci: usize) -> usize {
        self.links[ci].rig
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
        let r = self.initiator.start_command(self.rig.now, cmd);
        self.pump();
        r
    }

    /// Starts a request with `f` on the initiator's session at the virtual time now (NOP,
    /// TMF, text, logout).
    pub fn start_with(
        &mut self,
        f: impl FnOnce(&mut initiator::Session, Instant) -> Result<u32, StartError>,
    ) -> Result<u32, StartError> {
        let r = f(&mut self.initiator, self.rig.now);
        self.pump();
        r
    }

    /// Sets the initiator's timers (a task's timeout, pings of a quiet connection).
    pub fn set_timers(&mut self, timers: initiator::Timers) {
        self.initiator.set_timers(timers);
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

    /// Moves everything that can move now: the initiator's output onto its links, the
    /// target's onto its own, and what is due off all of them; until nothing moves.
    pub fn pump(&mut self) {
        loop {
            let mut moved = false;
            let now = self.rig.now;
            if self.initiator.poll_timeout().is_some_and(|at| at <= now) {
                self.initiator.handle_timeout(now);
                moved = true;
            }
            for ci in 0..self.links.len() {
                if !self.initiator.connection_alive(ci) && self.links[ci].closed.is_none() {
                    // The initiator gave the connection up (its ping went unanswered).
                    self.links[ci].closed = Some("given up by the initiator".into());
                    self.tear_down(ci);
                }
                moved |= self.pump_link(ci, now);
            }
            while let Some(ev) = self.initiator.poll_event() {
                if let initiator::Event::Done { itt, result } = ev {
                    self.done.insert(itt, result);
                }
                moved = true;
            }
            for ci in 0..self.links.len() {
                let index = self.links[ci].rig;
                if let Some(why) = self.rig.conns[index].closed.clone() {
                    if self.links[ci].closed.is_none() {
                        // The target closed its end: the initiator sees the connection go.
                        self.initiator_lost(ci, format!("target closed: {why}"));
                        moved = true;
                    }
                    self.tear_down(ci);
                }
            }
            if !moved {
                return;
            }
        }
    }

    /// Moves what can move on connection `ci`'s links; whether anything did.
    fn pump_link(&mut self, ci: usize, now: Instant) -> bool {
        let mut moved = false;
        let digests = self.initiator.digests(ci);
        let link = &mut self.links[ci];
        while let Some(pdu) = self.initiator.poll_transmit(ci) {
            if link.closed.is_none() {
                link.to_target.push(now, encode(&pdu, digests));
            }
            moved = true;
        }
        let sent = self.rig.take_sent_on(link.rig);
        if !sent.is_empty() {
            link.to_initiator.push(now, sent);
            moved = true;
        }
        while let Some(bytes) = self.links[ci].to_target.pop_due(now) {
            self.rig.receive_on(self.links[ci].rig, &bytes);
            moved = true;
        }
        while let Some(bytes) = self.links[ci].to_initiator.pop_due(now) {
            self.initiator_receives(ci, &bytes);
            moved = true;
        }
        moved
    }

    fn initiator_receives(&mut self, ci: usize, bytes: &[u8]) {
        if self.links[ci].closed.is_some() {
            return;
        }
        self.links[ci].deframer.feed(bytes);
        loop {
            match self.links[ci].deframer.next_pdu() {
                Ok(Some(pdu)) => {
                    if let Err(e) = self.initiator.handle_pdu(self.rig.now, ci, pdu) {
                        return self.initiator_lost(ci, e.0);
                    }
                }
                Ok(None) => return,
                Err(e) if e.is_fatal() => return self.initiator_lost(ci, format!("{e}")),
                // A PDU the initiator cannot use (a data digest error): it is dropped, and its
                // command waits for recovery (none at ErrorRecoveryLevel 0) or a timeout.
                Err(_) => {}
            }
        }
    }

    /// The initiator's connection `ci` is gone: its tasks fail and the target's end drops too.
    fn initiator_lost(&mut self, ci: usize, why: String) {
        self.links[ci].closed = Some(why.clone());
        self.initiator.connection_lost(ci, &why);
        self.tear_down(ci);
    }

    /// The target's end of connection `ci` is gone: its tasks end, and the session's nexus
    /// closes with its last connection.
    fn tear_down(&mut self, ci: usize) {
        let link = &mut self.links[ci];
        if !link.torn_down {
            link.torn_down = true;
            self.rig.shut(link.rig, "dropped");
        }
    }

    /// Runs, moving the virtual clock to each next event (a piece of a wire falling due, a
    /// target's timer), until `done` holds or `limit` has passed. Returns whether `done` held.
    pub fn run_until(&mut self, mut done: impl FnMut(&Pair) -> bool, limit: Duration) -> bool {
        let end = self.rig.now + limit;
        loop {
            self.pump();
            if done(self) {
                return true;
            }
            let wires = self
                .links
                .iter()
                .flat_map(|l| [l.to_target.next_due(), l.to_initiator.next_due()]);
            let timers = [self.rig.poll_timeout(), self.initiator.poll_timeout()];
            let next = wires.chain(timers).flatten().min();
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
