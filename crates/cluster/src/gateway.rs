//! One gateway's part in a cluster of gateways, as a machine: what it decides, and the
//! requests to the shared object store and the events for its targets that follow.
//!
//! Two lanes of requests run side by side, each one request at a time (the shell may carry
//! out each lane on a thread of its own, since a notify can take as long as its timeout):
//!
//! - [`Lane::Changes`]: the changes to shared reservations, one after the other. Each is read,
//!   decided with [`Reservations::apply`] (which may refuse it without writing anything),
//!   written only if the object is still at the version read (compare-and-swap; a lost race
//!   is decided again), applied here ([`Event::Apply`]), then notified to every gateway
//!   watching the object. Gateways that do not acknowledge in time are fenced
//!   ([`Request::Fence`]) *before* the change is reported decided ([`Event::Decided`]): the
//!   command ends only once every gateway either enforces the change or can write nothing.
//! - [`Lane::Membership`]: every `membership_interval` (or at once when a gateway says it
//!   joined or left) the gateways object is read and "who is alive" notified; a watcher that
//!   does not answer within `membership_timeout` is fenced, and when the live set changed
//!   every unit gets its new ALUA port groups ([`Event::PortGroups`]). While this gateway is
//!   fenced (its own watch was lost) the lane instead tries to rejoin ([`Request::Reconnect`])
//!   after a delay that doubles after each failure, up to `rejoin_max_delay`.
//!
//! A notification on a unit's object is applied here ([`Event::Apply`]) before it is
//! acknowledged; one that aborts tasks (PREEMPT AND ABORT) is acknowledged only once the shell
//! says those tasks ended ([`Gateway::handle_aborts_ended`]) or `notify_timeout` passed (then
//! the notifier fences this gateway).
//!
//! The machine owns no thread, socket or clock: inputs take `now`, outputs are polled.

use std::collections::{BTreeMap, VecDeque};
use std::time::{Duration, Instant};

use scsi_core::pr::{PrError, ReservationEffects, Reservations};
use scsi_core::spc::tpg::{self, AccessState, PortGroup, TargetPortGroupRequest};
use scsi_core::{BackendError, ItNexus, Sense};

use crate::ask::{Ask, Refusal};
use crate::member::{Member, Membership, PathPolicy, Preference};
use crate::store::{errno_text, CasError, NotifyOutcome, Versioned};

/// The largest reservation state or gateways object read back: registrations of thousands of
/// initiators.
pub const MAX_OBJECT: usize = 1 << 20;

/// How often a change is decided again after losing a compare-and-swap race before its
/// command ends with NOT READY (the initiator retries it).
pub const MAX_RACES: usize = 64;

/// What a gateway is, and its timing.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Settings {
    /// The cluster's name: the prefix of its objects.
    pub cluster: String,
    /// This gateway's name.
    pub gateway: String,
    /// This gateway's ALUA port group.
    pub port_group: u16,
    /// How long a change's notify waits for every gateway to apply it.
    pub notify_timeout: Duration,
    /// How often "who is alive" is asked.
    pub membership_interval: Duration,
    /// How long a gateway has to answer "who is alive".
    pub membership_timeout: Duration,
    /// How long a fenced gateway waits before its first try to rejoin (long enough for the
    /// gateway that fenced it to have broken its image locks).
    pub rejoin_min_delay: Duration,
    /// The longest a fenced gateway waits between two tries to rejoin.
    pub rejoin_max_delay: Duration,
}

impl Settings {
    /// The settings of gateway `gateway` (port group `port_group`) of cluster `cluster`, with
    /// targetd's timing: "who is alive" every 0.5 s with 1 s to answer (a gateway that dies
    /// is fenced within 1.5 s), a rejoin first after 2 s and at least every 30 s,
    /// `notify_timeout` for changes.
    pub fn new(cluster: &str, gateway: &str, port_group: u16, notify_timeout: Duration) -> Self {
        Settings {
            cluster: cluster.into(),
            gateway: gateway.into(),
            port_group,
            notify_timeout,
            membership_interval: Duration::from_millis(500),
            membership_timeout: Duration::from_secs(1),
            rejoin_min_delay: Duration::from_secs(2),
            rejoin_max_delay: Duration::from_secs(30),
        }
    }

    /// The object listing the gateways.
    pub fn gateways_object(&self) -> String {
        format!("{}.gateways", self.cluster)
    }

    /// The object holding the reservations of the units on `image`.
    pub fn reservations_object(&self, image: &str) -> String {
        format!("{}.reservations.{image}", self.cluster)
    }
}

/// A unit shared through the cluster, as the shell names it.
pub type UnitId = u64;

/// A change to reservations, as the shell names it (its command or task management function).
pub type ChangeId = u64;

/// Which lane a request runs in: each lane's requests are carried out one at a time, in order.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Lane {
    /// Changes to shared reservations.
    Changes,
    /// Who is alive; fencing the silent; rejoining.
    Membership,
}

/// What the machine asks of the store (or of the shell's cluster session). Each but
/// [`Request::Ack`] is answered with [`Gateway::handle_outcome`] and its lane.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Request {
    /// Read object `oid` ([`Outcome::Read`]).
    Read {
        /// The lane.
        lane: Lane,
        /// The object.
        oid: String,
    },
    /// Write `data` as object `oid` only if it is at version `expected` (or, with `None`, does
    /// not exist) ([`Outcome::Replaced`]).
    Replace {
        /// The lane.
        lane: Lane,
        /// The object.
        oid: String,
        /// The version read.
        expected: Option<u64>,
        /// The whole new object.
        data: Vec<u8>,
    },
    /// Notify every watcher of `oid` with `payload` and wait for their answers up to
    /// `timeout` ([`Outcome::Notified`]).
    Notify {
        /// The lane.
        lane: Lane,
        /// The object.
        oid: String,
        /// What is told.
        payload: Vec<u8>,
        /// How long to wait.
        timeout: Duration,
    },
    /// Fence gateway `member`: blocklist each of its addresses, so that it can change nothing
    /// any more (and its own watches end), then break its locks on the shared units' images
    /// ([`Outcome::Fenced`]).
    Fence {
        /// The lane.
        lane: Lane,
        /// The gateway, as the gateways object lists it.
        member: Member,
    },
    /// This gateway was fenced: connect anew (a new client, which the blocklist of the old one
    /// does not cover), open every shared unit again on it with its state reloaded, list this
    /// gateway again and watch the gateways object; watches made now are of `generation`
    /// ([`Outcome::Reconnected`]).
    Reconnect {
        /// The connection's generation: a lost watch of an older one says nothing.
        generation: u64,
    },
    /// Acknowledge notification `token` with `reply`: the notifier counts this gateway done.
    Ack {
        /// The shell's name for the notification.
        token: u64,
        /// The answer.
        reply: Vec<u8>,
    },
}

/// How a request ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// A [`Request::Read`]: the object, `None` when it does not exist, or an errno.
    Read(Result<Option<Versioned>, i32>),
    /// A [`Request::Replace`]: the new version.
    Replaced(Result<u64, CasError>),
    /// A [`Request::Notify`].
    Notified(Result<NotifyOutcome, i32>),
    /// A [`Request::Fence`]: `Err` names what could not be blocklisted.
    Fenced(Result<(), String>),
    /// A [`Request::Reconnect`].
    Reconnected(Result<(), String>),
}

/// What the machine tells the shell to do with its targets.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Event {
    /// Unit `unit`'s ALUA port groups are now `groups`.
    PortGroups {
        /// The unit.
        unit: UnitId,
        /// Its port groups, this gateway's own unavailable while fenced.
        groups: Vec<PortGroup>,
    },
    /// Unit `unit`'s reservations are `state` at `version`, with `effects` to carry out here
    /// (unit attentions, aborts, a reset). A version not newer than the unit's changes
    /// nothing.
    Apply {
        /// The unit.
        unit: UnitId,
        /// The state's version.
        version: u64,
        /// The state.
        state: Reservations,
        /// What the change does on this gateway.
        effects: ReservationEffects,
    },
    /// Change `change` is decided: its command ends with `result`.
    Decided {
        /// The change.
        change: ChangeId,
        /// Done, or refused in the asking protocol's words ([`Refusal::Unavailable`] when
        /// the cluster did not answer: the host retries).
        result: Result<(), Refusal>,
    },
    /// Tell [`Gateway::handle_aborts_ended`] with `token` once the tasks a change aborted on
    /// `unit` have ended.
    AwaitAborts {
        /// The unit.
        unit: UnitId,
        /// What to hand back.
        token: u64,
    },
    /// This gateway lost its cluster session and serves no shared unit until it has rejoined.
    Fenced,
    /// This gateway rejoined.
    Rejoined,
    /// The live gateways changed (for the log and `targetctl cluster`).
    MembershipChanged(Membership),
}

/// Which object a notification came through.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Watched {
    /// The gateways object: "who is alive", "joined", "left".
    Gateways,
    /// A unit's reservations.
    Unit(UnitId),
}

/// What the machine did since it started (`targetd_cluster_*` metrics).
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Counters {
    /// Changes to reservations decided here (written, refused, or changing nothing).
    pub changes: u64,
    /// Compare-and-swap races lost (decided again).
    pub races: u64,
    /// Gateways fenced by this one.
    pub fenced: u64,
    /// Times this gateway lost its own cluster session (it was fenced).
    pub lost_sessions: u64,
    /// Times it rejoined after that.
    pub rejoins: u64,
    /// Changes some gateway did not acknowledge in time.
    pub unacknowledged: u64,
}

/// A change waiting for its turn.
#[derive(Debug, Clone)]
struct Job {
    change: ChangeId,
    unit: UnitId,
    what: JobKind,
}

/// What a change changes.
#[derive(Debug, Clone)]
enum JobKind {
    /// The unit's reservations, as `nexus` asks.
    Reservations { nexus: ItNexus, request: Ask },
    /// The gateway that is active/optimized for the unit (SET TARGET PORT GROUPS): a
    /// [`Preference`] in the gateways object.
    Prefer { gateway: String, instance: u64 },
}

/// Where the change at the head of the queue is.
#[derive(Debug)]
enum ChangeStep {
    /// Reading the unit's object (after `races` lost races).
    Reading { races: usize },
    /// Writing `next` over the version read.
    Writing {
        races: usize,
        next: Reservations,
        effects: ReservationEffects,
    },
    /// Telling the other gateways.
    Notifying,
    /// Reading who the silent ones are, to fence them.
    ReadingMembers { silent: Vec<(u64, u64)> },
    /// Fencing them, one after the other.
    Fencing { queue: VecDeque<Member> },
    /// SET TARGET PORT GROUPS: reading the gateways object (after `races` lost races).
    ReadingGateways { races: usize },
    /// Writing `preference` into it over the version read.
    Preferring {
        races: usize,
        preference: Preference,
    },
    /// Telling the other gateways to read it again.
    TellingGateways,
}

/// Where the membership lane is.
#[derive(Debug)]
enum MembershipStep {
    /// Nothing under way.
    Idle,
    /// Reading the gateways object.
    Reading,
    /// Asking who is alive.
    Asking {
        members: Vec<Member>,
        preferences: Vec<Preference>,
    },
    /// Fencing the gateways that did not answer, then taking `seen` as the answer.
    Fencing {
        seen: Membership,
        queue: VecDeque<Member>,
    },
    /// Connecting anew after this gateway was fenced.
    Reconnecting,
}

/// A unit shared through the cluster.
#[derive(Debug, Clone)]
struct Unit {
    oid: String,
    policy: PathPolicy,
}

/// A notification applied here whose acknowledgement waits for aborted tasks.
#[derive(Debug)]
struct PendingAck {
    token: u64,
    deadline: Instant,
}

/// One gateway of a cluster. See the module's documentation.
#[derive(Debug)]
pub struct Gateway {
    settings: Settings,
    units: BTreeMap<UnitId, Unit>,
    /// This gateway's line, once it has joined.
    me: Option<Member>,
    membership: Membership,
    jobs: VecDeque<Job>,
    change: Option<ChangeStep>,
    membership_step: MembershipStep,
    /// When the membership lane runs next (a round, or a rejoin while fenced).
    next_round: Option<Instant>,
    fenced: bool,
    leaving: bool,
    rejoin_attempts: u32,
    generation: u64,
    /// The instances of the gateways this one fenced (each once).
    fenced_instances: Vec<u64>,
    pending_acks: Vec<PendingAck>,
    requests: VecDeque<Request>,
    events: VecDeque<Event>,
    counters: Counters,
}

impl Gateway {
    /// A gateway that has not joined yet: it decides changes, but asks nobody who is alive.
    pub fn new(settings: Settings) -> Gateway {
        Gateway {
            settings,
            units: BTreeMap::new(),
            me: None,
            membership: Membership::default(),
            jobs: VecDeque::new(),
            change: None,
            membership_step: MembershipStep::Idle,
            next_round: None,
            fenced: false,
            leaving: false,
            rejoin_attempts: 0,
            generation: 0,
            fenced_instances: Vec::new(),
            pending_acks: Vec::new(),
            requests: VecDeque::new(),
            events: VecDeque::new(),
            counters: Counters::default(),
        }
    }

    /// Its settings.
    pub fn settings(&self) -> &Settings {
        &self.settings
    }

    /// The membership as last seen.
    pub fn membership(&self) -> &Membership {
        &self.membership
    }

    /// Whether this gateway is fenced (it lost its cluster session and has not rejoined).
    pub fn is_fenced(&self) -> bool {
        self.fenced
    }

    /// What it did.
    pub fn counters(&self) -> Counters {
        self.counters
    }

    /// The generation of the current connection: the shell tags each watch it makes with it.
    pub fn generation(&self) -> u64 {
        self.generation
    }

    /// This gateway is listed as `me` and watches the gateways object: from now on it asks who
    /// is alive every `membership_interval`, the first time at once.
    pub fn joined(&mut self, now: Instant, me: Member) {
        self.me = Some(me);
        self.next_round = Some(now);
        self.drive_membership(now);
    }

    /// This gateway's line changed (its portals, its clients' addresses).
    pub fn relisted(&mut self, me: Member) {
        self.me = Some(me);
    }

    /// This gateway's ports changed (it serves SRP now, [`Gateway::relisted`] first): every
    /// unit gets its port groups again, with the new port in this gateway's group, when the
    /// membership is known.
    pub fn refresh_port_groups(&mut self) {
        if !self.membership.members.is_empty() {
            self.give_groups();
        }
    }

    /// This gateway is stopping: no more rounds, no rejoin.
    pub fn leave(&mut self) {
        self.leaving = true;
        self.next_round = None;
    }

    /// Unit `unit` is shared through `oid` with `policy`; it gets its port groups at once when
    /// the membership is known.
    pub fn add_unit(&mut self, unit: UnitId, oid: String, policy: PathPolicy) {
        self.units.insert(unit, Unit { oid, policy });
        if !self.membership.members.is_empty() {
            let groups = self.unit_groups(&self.units[&unit]);
            self.events.push_back(Event::PortGroups { unit, groups });
        }
    }

    /// Unit `unit` is no longer shared here.
    pub fn remove_unit(&mut self, unit: UnitId) {
        self.units.remove(&unit);
    }

    /// Asks to decide `request` of `nexus` (a SCSI I_T nexus, or an NVMe host as
    /// [`nvme::reservation::host`] names it) on unit `unit`; [`Event::Decided`] with
    /// `change` tells the outcome.
    pub fn submit(
        &mut self,
        _now: Instant,
        change: ChangeId,
        unit: UnitId,
        nexus: ItNexus,
        request: impl Into<Ask>,
    ) {
        self.jobs.push_back(Job {
            change,
            unit,
            what: JobKind::Reservations {
                nexus,
                request: request.into(),
            },
        });
        self.drive_changes();
    }

    /// SET TARGET PORT GROUPS `requests` on unit `unit`; [`Event::Decided`] with `change`
    /// tells the outcome. A group asked to be active/optimized names a live gateway, which
    /// becomes the unit's preferred one on every gateway (a [`Preference`] in the gateways
    /// object: here at once, on the others when they read it, told at once) while it runs;
    /// every other descriptor must ask the state its group then has. Otherwise ILLEGAL
    /// REQUEST, INVALID FIELD IN PARAMETER LIST, and nothing changes.
    pub fn submit_port_groups(
        &mut self,
        _now: Instant,
        change: ChangeId,
        unit: UnitId,
        requests: &[TargetPortGroupRequest],
    ) {
        let Some(u) = self.units.get(&unit) else {
            return self.decided(change, Err(Refusal::Unavailable));
        };
        let optimized = match tpg::optimized_request(requests) {
            Ok(o) => o,
            Err(sense) => return self.decided(change, Err(Refusal::Scsi(PrError::Sense(sense)))),
        };
        let policy = self.membership.policy_for(&u.oid, &u.policy);
        let now_groups = self.groups_of(&policy);
        let chosen = optimized.and_then(|group| {
            self.membership
                .members
                .iter()
                .find(|m| m.port_group == group && self.membership.live.contains(&m.gateway))
                .cloned()
        });
        let after = match &chosen {
            Some(m) => self.groups_of(&PathPolicy {
                preferred: Some(m.gateway.clone()),
                standby: policy.standby,
            }),
            None => now_groups.clone(),
        };
        // A group asked active/optimized that is no live gateway's: an unknown group, or one
        // that cannot be (unavailable, fenced): the check names it.
        let check = match (optimized, &chosen) {
            (Some(group), None) => requests
                .iter()
                .find(|r| r.group == group && r.state == AccessState::ActiveOptimized)
                .map(|r| {
                    Sense::invalid_field_in_parameter_list(scsi_core::FieldPointer::parameter(
                        r.offset + 2,
                    ))
                })
                .map_or(Ok(()), Err),
            _ => tpg::check_set_target_port_groups(requests, &after),
        };
        if let Err(sense) = check.and(if self.fenced {
            Err(Sense::from(BackendError::Unavailable))
        } else {
            Ok(())
        }) {
            return self.decided(change, Err(Refusal::Scsi(PrError::Sense(sense))));
        }
        match chosen {
            // Already so: nothing to write.
            Some(m) if after != now_groups || policy.preferred.as_deref() != Some(&m.gateway) => {
                self.jobs.push_back(Job {
                    change,
                    unit,
                    what: JobKind::Prefer {
                        gateway: m.gateway,
                        instance: m.instance,
                    },
                });
                self.drive_changes();
            }
            _ => self.decided(change, Ok(())),
        }
    }

    /// The next request for the store.
    pub fn poll_request(&mut self) -> Option<Request> {
        self.requests.pop_front()
    }

    /// The next event for the shell.
    pub fn poll_event(&mut self) -> Option<Event> {
        self.events.pop_front()
    }

    /// Whether an event waits for [`Gateway::poll_event`].
    pub fn has_events(&self) -> bool {
        !self.events.is_empty()
    }

    /// When [`Gateway::handle_timeout`] is due.
    pub fn poll_timeout(&self) -> Option<Instant> {
        let round = match self.membership_step {
            MembershipStep::Idle if !self.leaving => self.next_round,
            _ => None,
        };
        let acks = self.pending_acks.iter().map(|p| p.deadline).min();
        match (round, acks) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }

    /// Time passed: a membership round or a rejoin may be due, and acknowledgements that
    /// waited too long for aborted tasks go.
    pub fn handle_timeout(&mut self, now: Instant) {
        let late: Vec<u64> = self
            .pending_acks
            .iter()
            .filter(|p| p.deadline <= now)
            .map(|p| p.token)
            .collect();
        for token in late {
            tracing::warn!(
                token,
                "aborted tasks outlived notify_timeout: acknowledged anyway"
            );
            self.ack_pending(token);
        }
        self.drive_membership(now);
    }

    /// The tasks a change aborted (the notification `token` of [`Event::AwaitAborts`]) have
    /// ended: its acknowledgement goes.
    pub fn handle_aborts_ended(&mut self, _now: Instant, token: u64) {
        self.ack_pending(token);
    }

    fn ack_pending(&mut self, token: u64) {
        if let Some(i) = self.pending_acks.iter().position(|p| p.token == token) {
            self.pending_acks.remove(i);
            self.requests.push_back(Request::Ack {
                token,
                reply: Vec::new(),
            });
        }
    }

    /// A notification `token` with `payload` came through `watched`.
    pub fn handle_notification(
        &mut self,
        now: Instant,
        watched: Watched,
        token: u64,
        payload: &[u8],
    ) {
        match watched {
            Watched::Gateways => {
                if payload == b"joined" || payload == b"left" || payload == b"preferred" {
                    // Look again now rather than at the next round.
                    if self.me.is_some() && !self.fenced && !self.leaving {
                        self.next_round = Some(now);
                    }
                }
                self.requests.push_back(Request::Ack {
                    token,
                    reply: self.settings.gateway.as_bytes().to_vec(),
                });
                self.drive_membership(now);
            }
            Watched::Unit(unit) => {
                let mut aborted = false;
                if let Some((version, state, effects)) = crate::change::decode(payload) {
                    if self.units.contains_key(&unit) {
                        aborted = !effects.abort.is_empty();
                        self.events.push_back(Event::Apply {
                            unit,
                            version,
                            state,
                            effects,
                        });
                    }
                }
                if aborted {
                    // PREEMPT AND ABORT: acknowledged once the tasks it aborted here have
                    // ended, so that no write of a preempted initiator reaches the image
                    // after the command completed.
                    self.pending_acks.push(PendingAck {
                        token,
                        deadline: now + self.settings.notify_timeout,
                    });
                    self.events.push_back(Event::AwaitAborts { unit, token });
                } else {
                    self.requests.push_back(Request::Ack {
                        token,
                        reply: Vec::new(),
                    });
                }
            }
        }
    }

    /// A watch of connection `generation` was lost with `errno`: this gateway was blocklisted
    /// by another that could not reach it, or the store lost it for longer than its timeout.
    /// Either way the others may have changed the reservations without it: its shared units
    /// turn unavailable (initiators move to another path) and it serves them no more until it
    /// has rejoined.
    pub fn handle_watch_lost(&mut self, now: Instant, generation: u64, errno: i32) {
        if generation != self.generation || self.fenced || self.leaving {
            return;
        }
        self.fenced = true;
        self.counters.lost_sessions += 1;
        self.rejoin_attempts = 0;
        tracing::error!(
            gateway = %self.settings.gateway,
            "lost the cluster session ({}): this gateway is fenced and serves no shared unit \
             until it has rejoined",
            errno_text(errno)
        );
        let mut m = self.membership.clone();
        m.live.retain(|g| *g != self.settings.gateway);
        if !m.members.iter().any(|g| g.gateway == self.settings.gateway) {
            m.members.push(Member {
                gateway: self.settings.gateway.clone(),
                port_group: self.settings.port_group,
                portals: Vec::new(),
                instance: 0,
                addresses: Vec::new(),
                left: false,
                srp: self.me.as_ref().is_some_and(|me| me.srp),
                nvme_portals: Vec::new(),
                nvme_rdma_portals: Vec::new(),
            });
        }
        self.membership = m;
        self.give_groups();
        self.events.push_back(Event::Fenced);
        if self.me.is_some() {
            self.next_round = Some(now + self.rejoin_delay());
        }
        self.drive_membership(now);
    }

    /// How long a fenced gateway waits before it tries to rejoin: `rejoin_min_delay` first
    /// (the gateway that fenced it has broken its locks by then), doubling after each failed
    /// try up to `rejoin_max_delay`.
    pub fn rejoin_delay(&self) -> Duration {
        let tries = self.rejoin_attempts.min(8);
        (self.settings.rejoin_min_delay * 2u32.pow(tries)).min(self.settings.rejoin_max_delay)
    }

    /// Request `lane`'s last request ended with `outcome`.
    pub fn handle_outcome(&mut self, now: Instant, lane: Lane, outcome: Outcome) {
        match lane {
            Lane::Changes => self.change_outcome(now, outcome),
            Lane::Membership => self.membership_outcome(now, outcome),
        }
    }

    // ---- Changes ----

    fn drive_changes(&mut self) {
        while self.change.is_none() {
            let Some(job) = self.jobs.front() else {
                return;
            };
            self.counters.changes += 1;
            let Some(unit) = self.units.get(&job.unit) else {
                let change = job.change;
                self.jobs.pop_front();
                self.decided(change, Err(Refusal::Unavailable));
                continue;
            };
            let (step, oid) = match job.what {
                JobKind::Reservations { .. } => {
                    (ChangeStep::Reading { races: 0 }, unit.oid.clone())
                }
                JobKind::Prefer { .. } => (
                    ChangeStep::ReadingGateways { races: 0 },
                    self.settings.gateways_object(),
                ),
            };
            self.change = Some(step);
            self.requests.push_back(Request::Read {
                lane: Lane::Changes,
                oid,
            });
        }
    }

    fn decided(&mut self, change: ChangeId, result: Result<(), Refusal>) {
        self.events.push_back(Event::Decided { change, result });
    }

    /// The head job ends with `result`; the next one starts.
    fn finish_change(&mut self, result: Result<(), Refusal>) {
        self.change = None;
        if let Some(job) = self.jobs.pop_front() {
            self.decided(job.change, result);
        }
        self.drive_changes();
    }

    fn change_outcome(&mut self, now: Instant, outcome: Outcome) {
        let (Some(step), Some(job)) = (self.change.take(), self.jobs.front().cloned()) else {
            return;
        };
        let Some(oid) = self.units.get(&job.unit).map(|u| u.oid.clone()) else {
            return self.finish_change(Err(Refusal::Unavailable));
        };
        match (step, outcome) {
            (ChangeStep::Reading { races }, Outcome::Read(read)) => {
                let (state, version) = match read {
                    Ok(Some(v)) => match Reservations::decode(&v.data) {
                        Some(s) => (s, Some(v.version)),
                        None => {
                            tracing::error!(object = %oid, "the shared reservations are damaged");
                            return self.finish_change(Err(Refusal::Unavailable));
                        }
                    },
                    Ok(None) => (Reservations::default(), None),
                    Err(e) => {
                        tracing::warn!(object = %oid, "reading the reservations: {}", errno_text(e));
                        return self.finish_change(Err(Refusal::Unavailable));
                    }
                };
                let JobKind::Reservations { nexus, request } = &job.what else {
                    return self.finish_change(Err(Refusal::Unavailable));
                };
                let mut next = state.clone();
                let effects = match request.apply(&mut next, nexus) {
                    Ok(fx) => fx,
                    Err(e) => return self.finish_change(Err(e)),
                };
                // A reset changes nothing shared when no SPC-2 reservation is held, but the
                // other gateways must reset too: it is written (a new version) all the same.
                if next == state && !effects.reset {
                    return self.finish_change(Ok(()));
                }
                let data = next.encode();
                self.change = Some(ChangeStep::Writing {
                    races,
                    next,
                    effects,
                });
                self.requests.push_back(Request::Replace {
                    lane: Lane::Changes,
                    oid,
                    expected: version,
                    data,
                });
            }
            (
                ChangeStep::Writing {
                    races,
                    next,
                    effects,
                },
                Outcome::Replaced(r),
            ) => match r {
                Ok(version) => {
                    let payload = crate::change::encode(version, &next, &effects);
                    // This gateway made the change: a reset has been carried out here already.
                    self.events.push_back(Event::Apply {
                        unit: job.unit,
                        version,
                        state: next,
                        effects: ReservationEffects {
                            reset: false,
                            ..effects
                        },
                    });
                    self.change = Some(ChangeStep::Notifying);
                    self.requests.push_back(Request::Notify {
                        lane: Lane::Changes,
                        oid,
                        payload,
                        timeout: self.settings.notify_timeout,
                    });
                }
                Err(CasError::Conflict) => {
                    self.counters.races += 1;
                    if races + 1 >= MAX_RACES {
                        tracing::warn!(
                            object = %oid,
                            "lost {MAX_RACES} races to change the reservations"
                        );
                        return self.finish_change(Err(Refusal::Unavailable));
                    }
                    self.change = Some(ChangeStep::Reading { races: races + 1 });
                    self.requests.push_back(Request::Read {
                        lane: Lane::Changes,
                        oid,
                    });
                }
                Err(CasError::Failed(e)) => {
                    tracing::warn!(object = %oid, "writing the reservations: {}", errno_text(e));
                    self.finish_change(Err(Refusal::Unavailable))
                }
            },
            (ChangeStep::Notifying, Outcome::Notified(n)) => match n {
                Ok(o) if o.timed_out.is_empty() => self.finish_change(Ok(())),
                Ok(o) => {
                    self.counters.unacknowledged += 1;
                    tracing::warn!(
                        object = %oid,
                        silent = ?o.timed_out.iter().map(|(gid, _)| format!("client.{gid}")).collect::<Vec<_>>(),
                        "gateways did not apply a change to the reservations in time: fencing them"
                    );
                    // The command ends only once those that did not apply the change can
                    // enforce nothing any more.
                    self.change = Some(ChangeStep::ReadingMembers {
                        silent: o.timed_out,
                    });
                    let oid = self.settings.gateways_object();
                    self.requests.push_back(Request::Read {
                        lane: Lane::Changes,
                        oid,
                    });
                }
                Err(e) => {
                    tracing::warn!(
                        object = %oid,
                        "telling the other gateways of a change: {}",
                        errno_text(e)
                    );
                    self.finish_change(Ok(()))
                }
            },
            (ChangeStep::ReadingMembers { silent }, Outcome::Read(read)) => {
                let members = match read {
                    Ok(Some(v)) => Member::parse_all(&v.data),
                    Ok(None) => Vec::new(),
                    Err(e) => {
                        tracing::warn!(
                            "reading the cluster's gateways to fence: {}",
                            errno_text(e)
                        );
                        Vec::new()
                    }
                };
                let queue = self.to_fence(&members, &silent);
                self.fence_next(now, Lane::Changes, queue);
            }
            (ChangeStep::Fencing { queue }, Outcome::Fenced(r)) => {
                self.fenced_one(&queue, r);
                let mut queue = queue;
                queue.pop_front();
                self.fence_next(now, Lane::Changes, queue);
            }
            (ChangeStep::ReadingGateways { races }, Outcome::Read(read)) => {
                let JobKind::Prefer { gateway, instance } = job.what else {
                    return self.finish_change(Err(Refusal::Unavailable));
                };
                let (bytes, version) = match read {
                    Ok(Some(v)) => (v.data, Some(v.version)),
                    Ok(None) => (Vec::new(), None),
                    Err(e) => {
                        tracing::warn!("reading the cluster's gateways: {}", errno_text(e));
                        return self.finish_change(Err(Refusal::Unavailable));
                    }
                };
                let preference = Preference {
                    oid,
                    gateway,
                    instance,
                };
                let data = Preference::replace_in(&bytes, &preference);
                self.change = Some(ChangeStep::Preferring { races, preference });
                self.requests.push_back(Request::Replace {
                    lane: Lane::Changes,
                    oid: self.settings.gateways_object(),
                    expected: version,
                    data,
                });
            }
            (ChangeStep::Preferring { races, preference }, Outcome::Replaced(r)) => match r {
                Ok(_) => {
                    tracing::info!(
                        object = %preference.oid,
                        gateway = %preference.gateway,
                        "an initiator chose the active/optimized gateway (SET TARGET PORT GROUPS)"
                    );
                    let mut m = self.membership.clone();
                    m.preferences.retain(|p| p.oid != preference.oid);
                    m.preferences.push(preference);
                    self.membership = m;
                    self.give_groups();
                    self.change = Some(ChangeStep::TellingGateways);
                    self.requests.push_back(Request::Notify {
                        lane: Lane::Changes,
                        oid: self.settings.gateways_object(),
                        payload: b"preferred".to_vec(),
                        timeout: self.settings.membership_timeout,
                    });
                }
                Err(CasError::Conflict) if races + 1 < MAX_RACES => {
                    self.counters.races += 1;
                    self.change = Some(ChangeStep::ReadingGateways { races: races + 1 });
                    self.requests.push_back(Request::Read {
                        lane: Lane::Changes,
                        oid: self.settings.gateways_object(),
                    });
                }
                Err(e) => {
                    tracing::warn!("writing the chosen gateway: {e:?}");
                    self.finish_change(Err(Refusal::Unavailable))
                }
            },
            // The others read the object at once, or at their next round: the command ends
            // either way (a silent gateway is the membership lane's to fence).
            (ChangeStep::TellingGateways, Outcome::Notified(_)) => self.finish_change(Ok(())),
            (step, outcome) => {
                tracing::error!(
                    ?step,
                    ?outcome,
                    "an outcome the change lane did not ask for"
                );
                self.finish_change(Err(Refusal::Unavailable));
            }
        }
    }

    // ---- Fencing ----

    /// The gateways among `members` whose clients are `silent` that this gateway fences: not
    /// itself, not one that left, not one fenced before.
    fn to_fence(&self, members: &[Member], silent: &[(u64, u64)]) -> VecDeque<Member> {
        members
            .iter()
            .filter(|m| {
                m.gateway != self.settings.gateway
                    && !m.left
                    && silent.iter().any(|(gid, _)| *gid == m.instance)
                    && !self.fenced_instances.contains(&m.instance)
            })
            .cloned()
            .collect()
    }

    /// Asks to fence the head of `queue` in `lane`, or ends the fencing.
    fn fence_next(&mut self, now: Instant, lane: Lane, queue: VecDeque<Member>) {
        let Some(member) = queue.front().cloned() else {
            return match lane {
                Lane::Changes => self.finish_change(Ok(())),
                Lane::Membership => {
                    let step = std::mem::replace(&mut self.membership_step, MembershipStep::Idle);
                    if let MembershipStep::Fencing { seen, .. } = step {
                        self.seen(seen);
                    }
                    self.round_over(now)
                }
            };
        };
        match lane {
            Lane::Changes => self.change = Some(ChangeStep::Fencing { queue }),
            Lane::Membership => {
                if let MembershipStep::Fencing { queue: q, .. } = &mut self.membership_step {
                    *q = queue;
                }
            }
        }
        self.requests.push_back(Request::Fence { lane, member });
    }

    /// The gateway at the head of `queue` was fenced (or could not be).
    fn fenced_one(&mut self, queue: &VecDeque<Member>, r: Result<(), String>) {
        let Some(m) = queue.front() else { return };
        match r {
            Ok(()) => {
                tracing::error!(
                    gateway = %m.gateway,
                    addresses = ?m.addresses,
                    "fenced a gateway that did not answer"
                );
                self.counters.fenced += 1;
                self.fenced_instances.push(m.instance);
            }
            Err(e) => tracing::error!(gateway = %m.gateway, refused = %e, "cannot fence"),
        }
    }

    // ---- Membership ----

    fn drive_membership(&mut self, now: Instant) {
        if !matches!(self.membership_step, MembershipStep::Idle) || self.leaving {
            return;
        }
        let Some(at) = self.next_round else { return };
        if at > now || self.me.is_none() {
            return;
        }
        self.next_round = None;
        if self.fenced {
            self.rejoin_attempts += 1;
            self.generation += 1;
            self.membership_step = MembershipStep::Reconnecting;
            self.requests.push_back(Request::Reconnect {
                generation: self.generation,
            });
            return;
        }
        self.membership_step = MembershipStep::Reading;
        self.requests.push_back(Request::Read {
            lane: Lane::Membership,
            oid: self.settings.gateways_object(),
        });
    }

    /// The round is over: the next one in `membership_interval`.
    fn round_over(&mut self, now: Instant) {
        self.membership_step = MembershipStep::Idle;
        if self.next_round.is_none() && !self.fenced {
            self.next_round = Some(now + self.settings.membership_interval);
        }
        self.drive_membership(now);
    }

    fn membership_outcome(&mut self, now: Instant, outcome: Outcome) {
        let step = std::mem::replace(&mut self.membership_step, MembershipStep::Idle);
        match (step, outcome) {
            (MembershipStep::Reading, Outcome::Read(read)) => {
                let (members, preferences) = match read {
                    Ok(Some(v)) => (Member::parse_all(&v.data), Preference::parse_all(&v.data)),
                    Ok(None) => (Vec::new(), Vec::new()),
                    Err(e) => {
                        tracing::warn!("reading the cluster's gateways: {}", errno_text(e));
                        return self.round_over(now);
                    }
                };
                if self.fenced || self.leaving {
                    return self.round_over(now);
                }
                self.membership_step = MembershipStep::Asking {
                    members,
                    preferences,
                };
                self.requests.push_back(Request::Notify {
                    lane: Lane::Membership,
                    oid: self.settings.gateways_object(),
                    payload: b"who".to_vec(),
                    timeout: self.settings.membership_timeout,
                });
            }
            (
                MembershipStep::Asking {
                    members,
                    preferences,
                },
                Outcome::Notified(n),
            ) => {
                let o = match n {
                    Ok(o) => o,
                    Err(e) => {
                        tracing::warn!("asking who is alive: {}", errno_text(e));
                        return self.round_over(now);
                    }
                };
                let mut live: Vec<String> = o
                    .acked
                    .iter()
                    .map(|(_, _, reply)| String::from_utf8_lossy(reply).into_owned())
                    .collect();
                live.sort();
                live.dedup();
                // A gateway whose watch is there but which does not answer is alive to the
                // store and silent to us (stopped, cut off, killed with its watch not yet timed
                // out): it could still write with what it last knew. Fenced now, its image
                // locks broken, the others take over its initiators' I/O at once.
                let queue = self.to_fence(&members, &o.timed_out);
                let seen = Membership {
                    members,
                    live,
                    preferences,
                };
                self.fence_then_settle(now, seen, queue);
            }
            (MembershipStep::Fencing { seen, queue }, Outcome::Fenced(r)) => {
                self.fenced_one(&queue, r);
                let mut queue = queue;
                queue.pop_front();
                self.fence_then_settle(now, seen, queue);
            }
            (MembershipStep::Reconnecting, Outcome::Reconnected(r)) => match r {
                Ok(()) => {
                    self.fenced = false;
                    self.counters.rejoins += 1;
                    tracing::info!(
                        gateway = %self.settings.gateway,
                        "rejoined the cluster: serving the shared units again"
                    );
                    // Whatever was seen before the fence is stale: the states are given anew.
                    self.membership = Membership::default();
                    self.events.push_back(Event::Rejoined);
                    self.next_round = Some(now);
                    self.drive_membership(now);
                }
                Err(e) => {
                    tracing::warn!(
                        gateway = %self.settings.gateway,
                        retry_in = ?self.rejoin_delay(),
                        "rejoining the cluster: {e}"
                    );
                    self.next_round = Some(now + self.rejoin_delay());
                    self.drive_membership(now);
                }
            },
            (step, outcome) => {
                tracing::error!(
                    ?step,
                    ?outcome,
                    "an outcome the membership lane did not ask for"
                );
                self.round_over(now);
            }
        }
    }

    /// Fences the gateways of `queue` one after the other, then takes `members` and `live`
    /// as the round's answer and ends the round.
    fn fence_then_settle(&mut self, now: Instant, seen: Membership, queue: VecDeque<Member>) {
        if queue.is_empty() {
            self.seen(seen);
            return self.round_over(now);
        }
        self.membership_step = MembershipStep::Fencing {
            seen,
            queue: VecDeque::new(),
        };
        self.fence_next(now, Lane::Membership, queue);
    }

    /// The membership is `now_seen`: when it changed, every unit gets its port groups.
    fn seen(&mut self, now_seen: Membership) {
        if self.fenced || now_seen == self.membership {
            return;
        }
        for m in &now_seen.members {
            let was = self
                .membership
                .members
                .iter()
                .find(|o| o.gateway == m.gateway);
            if m.left && !was.is_some_and(|o| o.left) {
                tracing::info!(gateway = %m.gateway, "a gateway left the cluster (a planned stop)");
            }
        }
        for gone in self
            .membership
            .members
            .iter()
            .filter(|m| !now_seen.members.iter().any(|n| n.gateway == m.gateway))
        {
            tracing::info!(gateway = %gone.gateway, "a gateway was forgotten by the cluster");
        }
        tracing::info!(
            live = ?now_seen.live,
            gateways = now_seen.members.len(),
            "the cluster's gateways changed"
        );
        self.membership = now_seen;
        self.events
            .push_back(Event::MembershipChanged(self.membership.clone()));
        self.give_groups();
    }

    /// Every unit's port groups under the membership seen.
    fn give_groups(&mut self) {
        let all: Vec<(UnitId, Vec<PortGroup>)> = self
            .units
            .iter()
            .map(|(id, u)| (*id, self.unit_groups(u)))
            .collect();
        for (unit, groups) in all {
            self.events.push_back(Event::PortGroups { unit, groups });
        }
    }

    /// The port groups of `unit`: with the gateway an initiator chose, while it runs, or its
    /// configured policy ([`Membership::policy_for`]).
    fn unit_groups(&self, unit: &Unit) -> Vec<PortGroup> {
        self.groups_of(&self.membership.policy_for(&unit.oid, &unit.policy))
    }

    /// The port groups of a unit with `policy`, this gateway's own unavailable once fenced.
    pub fn groups_of(&self, policy: &PathPolicy) -> Vec<PortGroup> {
        let mut groups = self.membership.port_groups(policy);
        // This gateway's own ports as it serves them now, whatever the object said when it
        // was read last: a port missing from every group would have no access state here.
        if let Some(me) = &self.me {
            for g in groups.iter_mut().filter(|g| g.id == me.port_group) {
                for p in me.relative_ports() {
                    if !g.ports.contains(&p) {
                        g.ports.push(p);
                    }
                }
            }
        }
        if self.fenced {
            for g in groups
                .iter_mut()
                .filter(|g| g.id == self.settings.port_group)
            {
                g.state = AccessState::Unavailable;
                g.preferred = false;
            }
        }
        groups
    }
}
