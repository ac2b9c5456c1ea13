//! The test kit (feature `testing`): gateways on a virtual clock over an in-memory object
//! store with watch/notify and a blocklist, where a gateway can go silent (its watches stay,
//! it answers nothing: stopped, cut off), be killed, come back, and have its tasks outlive an
//! abort. [`Sim`] checks, as it runs, the property the cluster exists for: a change to the
//! reservations is reported decided only once every gateway watching the unit has applied it
//! or has been fenced (blocklisted, so that it can write nothing).

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use scsi_core::pr::{ReservationRequest, Reservations};
use scsi_core::spc::tpg::PortGroup;
use scsi_core::ItNexus;

use crate::ask::{Ask, Refusal};
use crate::gateway::{ChangeId, Event, Gateway, Lane, Outcome, Request, Settings, UnitId, Watched};
use crate::member::{Member, PathPolicy};
use crate::store::{CasError, NotifyOutcome, Versioned};

/// The errno a blocklisted client gets (ESHUTDOWN).
pub const EBLOCKLISTED: i32 = -108;

/// A notify under way.
#[derive(Debug)]
struct Notify {
    from: usize,
    lane: Lane,
    /// The watchers still to answer: (node, instance).
    waiting: Vec<(usize, u64)>,
    acked: Vec<(u64, u64, Vec<u8>)>,
    deadline: Instant,
}

/// One gateway of the simulation.
#[derive(Debug)]
pub struct Node {
    /// Its machine.
    pub machine: Gateway,
    /// Its client's instance in the store (a new one after each reconnect).
    pub instance: u64,
    /// The objects it watches, and the generation each watch was made in.
    watches: Vec<(String, Watched, u64)>,
    /// Silent: it receives and answers nothing, and its timers do not run.
    pub silent: bool,
    /// How long its acknowledgements take to reach the store: a gateway that is busy (its
    /// threads and its network loaded) but alive.
    pub ack_delay: Duration,
    /// The state each unit applied: (version, state).
    pub applied: BTreeMap<UnitId, (u64, Reservations)>,
    /// Each unit's port groups as last given.
    pub groups: BTreeMap<UnitId, Vec<PortGroup>>,
    /// Changes decided, in order.
    pub decided: Vec<(ChangeId, Result<(), Refusal>)>,
    /// Tasks each unit still runs that a PREEMPT AND ABORT aborted.
    pub aborted_in_flight: BTreeMap<UnitId, usize>,
    /// Acknowledgements waiting for those tasks.
    awaiting: Vec<(UnitId, u64)>,
    /// The units it shares, by object.
    units: BTreeMap<UnitId, String>,
    /// Events it reported (fenced, rejoined), for tests to look at.
    pub fenced_events: usize,
    /// Rejoins it reported.
    pub rejoined_events: usize,
}

/// Gateways on a virtual clock over an in-memory store.
#[derive(Debug)]
pub struct Sim {
    /// The virtual clock.
    pub now: Instant,
    /// The gateways.
    pub nodes: Vec<Node>,
    objects: BTreeMap<String, Versioned>,
    next_version: u64,
    next_instance: u64,
    /// Blocklisted instances.
    pub blocklist: BTreeSet<u64>,
    notifies: Vec<Notify>,
    /// Writes that succeeded: (node, instance, object, version).
    pub writes: Vec<(usize, u64, String, u64)>,
    /// Reconnects refused while this is set (the cluster unreachable for the fenced).
    pub refuse_reconnect: bool,
    next_token: u64,
    /// Notification tokens: token -> (notify index key, node).
    tokens: BTreeMap<u64, (u64, usize)>,
    next_notify: u64,
    notify_ids: Vec<u64>,
    /// Acknowledgements on their way: when they arrive, the token, the reply.
    delayed_acks: Vec<(Instant, u64, Vec<u8>)>,
}

/// The name of gateway `i`.
pub fn gateway_name(i: usize) -> String {
    format!("gw{i}")
}

/// The cluster's name in the simulation.
pub const CLUSTER: &str = "sim";

impl Sim {
    /// `n` gateways (port groups 1..=n), each sharing `units` units (ids 0..units, image
    /// `image<k>`), joined and with the membership settled.
    pub fn new(n: usize, units: u64) -> Sim {
        Sim::with(n, units, |_| {})
    }

    /// As [`Sim::new`], each gateway's settings changed by `tune` first.
    pub fn with(n: usize, units: u64, tune: impl Fn(&mut Settings)) -> Sim {
        let now = Instant::now();
        let mut sim = Sim {
            now,
            nodes: Vec::new(),
            objects: BTreeMap::new(),
            next_version: 1,
            next_instance: 1000,
            blocklist: BTreeSet::new(),
            notifies: Vec::new(),
            writes: Vec::new(),
            refuse_reconnect: false,
            next_token: 1,
            tokens: BTreeMap::new(),
            next_notify: 1,
            notify_ids: Vec::new(),
            delayed_acks: Vec::new(),
        };
        for i in 0..n {
            let mut settings = Settings::new(
                CLUSTER,
                &gateway_name(i),
                i as u16 + 1,
                Duration::from_secs(5),
            );
            tune(&mut settings);
            let instance = sim.new_instance();
            sim.nodes.push(Node {
                machine: Gateway::new(settings),
                instance,
                watches: Vec::new(),
                silent: false,
                ack_delay: Duration::ZERO,
                applied: BTreeMap::new(),
                groups: BTreeMap::new(),
                decided: Vec::new(),
                aborted_in_flight: BTreeMap::new(),
                awaiting: Vec::new(),
                units: BTreeMap::new(),
                fenced_events: 0,
                rejoined_events: 0,
            });
        }
        for i in 0..n {
            for u in 0..units {
                let oid = sim.nodes[i]
                    .machine
                    .settings()
                    .reservations_object(&format!("image{u}"));
                sim.nodes[i].units.insert(u, oid.clone());
                sim.nodes[i]
                    .machine
                    .add_unit(u, oid.clone(), PathPolicy::default());
                let generation = sim.nodes[i].machine.generation();
                sim.nodes[i]
                    .watches
                    .push((oid, Watched::Unit(u), generation));
            }
            sim.enter(i);
            let me = sim.member(i);
            let now = sim.now;
            sim.nodes[i].machine.joined(now, me);
        }
        sim.run();
        sim
    }

    fn new_instance(&mut self) -> u64 {
        self.next_instance += 1;
        self.next_instance
    }

    /// Gateway `i`'s line in the gateways object.
    pub fn member(&self, i: usize) -> Member {
        let s = self.nodes[i].machine.settings();
        let instance = self.nodes[i].instance;
        Member {
            gateway: s.gateway.clone(),
            port_group: s.port_group,
            portals: Vec::new(),
            instance,
            addresses: vec![format!("client.{instance}")],
            left: false,
            srp: false,
            nvme_portals: Vec::new(),
            nvme_rdma_portals: Vec::new(),
        }
    }

    /// Lists gateway `i` (as its shell does on joining) and watches the gateways object.
    fn enter(&mut self, i: usize) {
        let me = self.member(i);
        let oid = format!("{CLUSTER}.gateways");
        let old = self
            .objects
            .get(&oid)
            .map(|v| v.data.clone())
            .unwrap_or_default();
        let mut members = Member::parse_all(&old);
        members.retain(|m| m.gateway != me.gateway);
        members.push(me);
        let data = Member::rewrite_all(&old, &mut members);
        let version = self.bump();
        self.objects
            .insert(oid.clone(), Versioned { data, version });
        let generation = self.nodes[i].machine.generation();
        self.nodes[i].watches.retain(|(o, _, _)| *o != oid);
        self.nodes[i]
            .watches
            .push((oid, Watched::Gateways, generation));
    }

    fn bump(&mut self) -> u64 {
        self.next_version += 1;
        self.next_version
    }

    /// Asks gateway `i` to decide `request` of `nexus` on `unit`, as change `change`.
    pub fn submit(
        &mut self,
        i: usize,
        change: ChangeId,
        unit: UnitId,
        nexus: ItNexus,
        request: impl Into<Ask>,
    ) {
        let now = self.now;
        self.nodes[i]
            .machine
            .submit(now, change, unit, nexus, request);
    }

    /// Asks gateway `i` to decide SET TARGET PORT GROUPS `requests` on `unit`, as change
    /// `change`.
    pub fn submit_port_groups(
        &mut self,
        i: usize,
        change: ChangeId,
        unit: UnitId,
        requests: &[scsi_core::spc::tpg::TargetPortGroupRequest],
    ) {
        let now = self.now;
        self.nodes[i]
            .machine
            .submit_port_groups(now, change, unit, requests);
    }

    /// Moves everything that can move without the clock: requests, events, notifies whose
    /// watchers all answered.
    pub fn run(&mut self) {
        for _ in 0..100_000 {
            let mut progress = false;
            for i in 0..self.nodes.len() {
                if self.nodes[i].silent {
                    continue;
                }
                // One request per gateway per turn: gateways' requests interleave at the
                // store as they would over a network (two reads, then two writes: a race).
                if let Some(r) = self.nodes[i].machine.poll_request() {
                    progress = true;
                    self.carry(i, r);
                }
                while let Some(e) = self.nodes[i].machine.poll_event() {
                    progress = true;
                    self.event(i, e);
                }
            }
            progress |= self.complete_notifies(false);
            if !progress {
                return;
            }
        }
        panic!("the simulation does not settle");
    }

    /// Advances the clock by `d`, in steps of 100 ms, running what comes due.
    pub fn advance(&mut self, d: Duration) {
        let end = self.now + d;
        while self.now < end {
            self.now = (self.now + Duration::from_millis(100)).min(end);
            let now = self.now;
            let (due, later) = std::mem::take(&mut self.delayed_acks)
                .into_iter()
                .partition(|(at, _, _)| *at <= now);
            self.delayed_acks = later;
            for (_, token, reply) in due {
                self.deliver_ack(token, reply);
            }
            self.complete_notifies(true);
            for n in self.nodes.iter_mut().filter(|n| !n.silent) {
                if n.machine.poll_timeout().is_some_and(|t| t <= now) {
                    n.machine.handle_timeout(now);
                }
            }
            self.run();
        }
    }

    /// Gateway `i` goes silent: stopped or cut off, its watches still there, it answers
    /// nothing and its timers do not run.
    pub fn silence(&mut self, i: usize) {
        self.nodes[i].silent = true;
    }

    /// Gateway `i` runs again; if it was fenced meanwhile, it hears now that its watches
    /// ended.
    pub fn wake(&mut self, i: usize) {
        self.nodes[i].silent = false;
        if self.blocklist.contains(&self.nodes[i].instance) {
            self.lose_watches(i);
        }
        self.run();
    }

    /// The tasks aborted on `unit` of gateway `i` end now.
    pub fn end_aborted_tasks(&mut self, i: usize, unit: UnitId) {
        self.nodes[i].aborted_in_flight.insert(unit, 0);
        self.release_acks(i);
        self.run();
    }

    fn release_acks(&mut self, i: usize) {
        let now = self.now;
        let node = &mut self.nodes[i];
        let ready: Vec<(UnitId, u64)> = node
            .awaiting
            .iter()
            .filter(|(u, _)| node.aborted_in_flight.get(u).copied().unwrap_or(0) == 0)
            .copied()
            .collect();
        node.awaiting
            .retain(|(u, _)| node.aborted_in_flight.get(u).copied().unwrap_or(0) > 0);
        for (_, token) in ready {
            node.machine.handle_aborts_ended(now, token);
        }
    }

    fn carry(&mut self, i: usize, r: Request) {
        let now = self.now;
        let instance = self.nodes[i].instance;
        let blocked = self.blocklist.contains(&instance);
        match r {
            Request::Read { lane, oid } => {
                let out = if blocked {
                    Err(EBLOCKLISTED)
                } else {
                    Ok(self.objects.get(&oid).cloned())
                };
                self.nodes[i]
                    .machine
                    .handle_outcome(now, lane, Outcome::Read(out));
            }
            Request::Replace {
                lane,
                oid,
                expected,
                data,
            } => {
                let out = if blocked {
                    Err(CasError::Failed(EBLOCKLISTED))
                } else if self.objects.get(&oid).map(|v| v.version) != expected {
                    Err(CasError::Conflict)
                } else {
                    let version = self.bump();
                    self.objects
                        .insert(oid.clone(), Versioned { data, version });
                    self.writes.push((i, instance, oid, version));
                    Ok(version)
                };
                self.nodes[i]
                    .machine
                    .handle_outcome(now, lane, Outcome::Replaced(out));
            }
            Request::Notify {
                lane,
                oid,
                payload,
                timeout,
            } => {
                if blocked {
                    self.nodes[i].machine.handle_outcome(
                        now,
                        lane,
                        Outcome::Notified(Err(EBLOCKLISTED)),
                    );
                    return;
                }
                let id = self.next_notify;
                self.next_notify += 1;
                let mut waiting = Vec::new();
                for (j, n) in self.nodes.iter().enumerate() {
                    if self.blocklist.contains(&n.instance) {
                        continue;
                    }
                    if n.watches.iter().any(|(o, _, _)| *o == oid) {
                        waiting.push((j, n.instance));
                    }
                }
                self.notifies.push(Notify {
                    from: i,
                    lane,
                    waiting: waiting.clone(),
                    acked: Vec::new(),
                    deadline: now + timeout,
                });
                self.notify_ids.push(id);
                for (j, _) in waiting {
                    if self.nodes[j].silent {
                        continue;
                    }
                    let Some(&(_, watched, _)) =
                        self.nodes[j].watches.iter().find(|(o, _, _)| *o == oid)
                    else {
                        continue;
                    };
                    let token = self.next_token;
                    self.next_token += 1;
                    self.tokens.insert(token, (id, j));
                    self.nodes[j]
                        .machine
                        .handle_notification(now, watched, token, &payload);
                }
            }
            Request::Ack { token, reply } => {
                let delay = self.nodes[i].ack_delay;
                if delay > Duration::ZERO {
                    self.delayed_acks.push((now + delay, token, reply));
                } else {
                    self.deliver_ack(token, reply);
                }
            }
            Request::Fence { lane, member } => {
                let out = if blocked {
                    Err("this gateway is blocklisted itself".to_string())
                } else {
                    self.blocklist.insert(member.instance);
                    Ok(())
                };
                // The fenced gateway's watches end: it hears of it unless it is silent (then
                // when it wakes).
                if let Some(j) = self
                    .nodes
                    .iter()
                    .position(|n| n.instance == member.instance)
                {
                    if !self.nodes[j].silent {
                        self.lose_watches(j);
                    }
                }
                self.nodes[i]
                    .machine
                    .handle_outcome(now, lane, Outcome::Fenced(out));
            }
            Request::Reconnect { generation: _ } => {
                let out = if self.refuse_reconnect {
                    Err("the cluster is unreachable".to_string())
                } else {
                    let instance = self.new_instance();
                    self.nodes[i].instance = instance;
                    let generation = self.nodes[i].machine.generation();
                    let units: Vec<(UnitId, String)> = self.nodes[i]
                        .units
                        .iter()
                        .map(|(u, o)| (*u, o.clone()))
                        .collect();
                    self.nodes[i].watches.clear();
                    for (u, oid) in units {
                        // Reloaded: what it missed.
                        if let Some(v) = self.objects.get(&oid) {
                            if let Some(state) = Reservations::decode(&v.data) {
                                self.nodes[i].applied.insert(u, (v.version, state));
                            }
                        }
                        self.nodes[i]
                            .watches
                            .push((oid, Watched::Unit(u), generation));
                    }
                    self.enter(i);
                    let me = self.member(i);
                    self.nodes[i].machine.relisted(me);
                    Ok(())
                };
                self.nodes[i].machine.handle_outcome(
                    now,
                    Lane::Membership,
                    Outcome::Reconnected(out),
                );
            }
        }
    }

    /// Gateway `j`'s watches end (it was blocklisted).
    fn lose_watches(&mut self, j: usize) {
        let now = self.now;
        let watches = std::mem::take(&mut self.nodes[j].watches);
        if let Some(generation) = watches.first().map(|w| w.2) {
            self.nodes[j]
                .machine
                .handle_watch_lost(now, generation, EBLOCKLISTED);
        }
    }

    fn event(&mut self, i: usize, e: Event) {
        match e {
            Event::PortGroups { unit, groups } => {
                self.nodes[i].groups.insert(unit, groups);
            }
            Event::Apply {
                unit,
                version,
                state,
                ..
            } => {
                let node = &mut self.nodes[i];
                let newer = node.applied.get(&unit).is_none_or(|(v, _)| *v < version);
                if newer {
                    node.applied.insert(unit, (version, state));
                }
            }
            Event::Decided { change, result } => {
                self.nodes[i].decided.push((change, result));
                self.check_decided(i);
            }
            Event::AwaitAborts { unit, token } => {
                self.nodes[i].awaiting.push((unit, token));
                self.release_acks(i);
            }
            Event::Fenced => self.nodes[i].fenced_events += 1,
            Event::Rejoined => self.nodes[i].rejoined_events += 1,
            Event::MembershipChanged(_) => {}
        }
    }

    /// Ends the notifies every watcher answered (and, with `deadlines`, those past their
    /// deadline, naming the silent).
    /// The store has the acknowledgement `token` (counted if its notify still waits).
    fn deliver_ack(&mut self, token: u64, reply: Vec<u8>) {
        let Some((id, j)) = self.tokens.remove(&token) else {
            return;
        };
        let Some(k) = self.notify_ids.iter().position(|x| *x == id) else {
            return;
        };
        let n = &mut self.notifies[k];
        if let Some(w) = n.waiting.iter().position(|(node, _)| *node == j) {
            let (_, inst) = n.waiting.remove(w);
            n.acked.push((inst, j as u64, reply));
        }
    }

    fn complete_notifies(&mut self, deadlines: bool) -> bool {
        let now = self.now;
        let mut progress = false;
        let mut k = 0;
        while k < self.notifies.len() {
            let n = &self.notifies[k];
            let done = n.waiting.is_empty() || (deadlines && n.deadline <= now);
            if !done {
                k += 1;
                continue;
            }
            let n = self.notifies.remove(k);
            self.notify_ids.remove(k);
            progress = true;
            let outcome = NotifyOutcome {
                acked: n.acked,
                timed_out: n
                    .waiting
                    .iter()
                    .map(|(j, inst)| (*inst, *j as u64))
                    .collect(),
            };
            if self.nodes[n.from].silent {
                continue;
            }
            self.nodes[n.from]
                .machine
                .handle_outcome(now, n.lane, Outcome::Notified(Ok(outcome)));
        }
        progress
    }

    /// The safety property, at each change gateway `i` reports decided: every gateway that
    /// watches the unit's object has applied a version at least as new as the one the change
    /// wrote, or is blocklisted.
    fn check_decided(&mut self, i: usize) {
        let Some((change, Ok(()))) = self.nodes[i].decided.last().cloned() else {
            return;
        };
        // Which unit: the simulation's changes name their unit in the high bits (see
        // `change_id`).
        let unit = change >> 32;
        let Some(oid) = self.nodes[i].units.get(&unit).cloned() else {
            return;
        };
        // The version this gateway wrote last to the unit's object: its change's (another
        // gateway's newer write is that one's to see applied before it is decided).
        let Some(version) = self
            .writes
            .iter()
            .rev()
            .find(|w| w.0 == i && w.2 == oid)
            .map(|w| w.3)
        else {
            return;
        };
        for (j, n) in self.nodes.iter().enumerate() {
            if self.blocklist.contains(&n.instance) {
                continue;
            }
            if !n.watches.iter().any(|(o, _, _)| *o == oid) {
                continue;
            }
            let applied = n.applied.get(&unit).map_or(0, |(v, _)| *v);
            assert!(
                applied >= version,
                "change {change:#x} decided on gw{i} while gw{j} (not fenced) has applied \
                 version {applied} of {oid}, not {version}"
            );
        }
    }
}

/// A change id for `unit` in the simulation (the unit in the high 32 bits, so the safety
/// check finds it).
pub fn change_id(unit: UnitId, n: u64) -> ChangeId {
    (unit << 32) | (n & 0xffff_ffff)
}

/// The I_T nexus of initiator `n` through gateway `i`.
pub fn nexus(i: usize, n: u8) -> ItNexus {
    ItNexus {
        initiator: scsi_core::TransportId::iscsi(
            &format!("iqn.2026-11.sim:host{n}"),
            [0x80, 0, 0, 0, 0, n],
        ),
        relative_port: i as u16 + 1,
    }
}

/// A PERSISTENT RESERVE OUT: REGISTER with service action key `key`.
pub fn register(key: u64) -> ReservationRequest {
    prout(0x00, 0, 0, key)
}

/// A PERSISTENT RESERVE OUT: RESERVE, Write Exclusive, with key `key`.
pub fn reserve(key: u64) -> ReservationRequest {
    prout(0x01, 0x01, key, 0)
}

/// A PERSISTENT RESERVE OUT: PREEMPT AND ABORT of `victim` by `key` (Write Exclusive).
pub fn preempt_and_abort(key: u64, victim: u64) -> ReservationRequest {
    prout(0x05, 0x01, key, victim)
}

/// NVMe host `n` (its Host Identifier sixteen times `n`), as reservations name it through
/// any gateway.
pub fn nvme_host(n: u8) -> ItNexus {
    nvme::reservation::host([n; 16])
}

/// An NVMe reservation command `opcode` with CDW10 `cdw10` and the keys `first` (CRKEY) and
/// `second` (NRKEY or PRKEY).
pub fn nvme_ask(opcode: nvme::opcode::NvmOpcode, cdw10: u32, first: u64, second: u64) -> Ask {
    let mut sqe = nvme::sqe::Sqe::new(opcode.code(), 1);
    sqe.set_cdw(10, cdw10);
    let mut data = [0; 16];
    data[..8].copy_from_slice(&first.to_le_bytes());
    data[8..].copy_from_slice(&second.to_le_bytes());
    Ask::Nvme {
        command: nvme::reservation::decode(&sqe).expect("a reservation command"),
        data,
    }
}

fn prout(action: u8, scope_type: u8, key: u64, sa_key: u64) -> ReservationRequest {
    let mut parameters = vec![0; 24];
    parameters[..8].copy_from_slice(&key.to_be_bytes());
    parameters[8..16].copy_from_slice(&sa_key.to_be_bytes());
    ReservationRequest::PersistentReserveOut {
        action,
        scope_type,
        parameters,
    }
}
