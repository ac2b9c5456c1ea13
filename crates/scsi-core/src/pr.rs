//! Persistent reservations (SPC-4 sections 5.13, 6.15 and 6.16): registrations by I_T nexus,
//! the six reservation types with their access rules, PERSISTENT RESERVE IN and OUT, and
//! persistence through a power loss (APTPL) by a [`PrStore`].
//!
//! Every change to a unit's reservations, persistent or SPC-2, is one pure step,
//! [`Reservations::apply`] of a [`ReservationRequest`] from an I_T nexus: the device server
//! takes it on its own state, and gateways that serve one unit together take it on the state
//! they share (read, apply, compare-and-swap, publish), so both decide with the same code.

use std::path::{Path, PathBuf};

use crate::nexus::{ItNexus, TransportId};
use crate::sense::{Asc, FieldPointer, Sense, SenseKey};

/// What a command does to the medium, for reservation conflicts (SPC-4 table 45) and unit
/// attention handling.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Access {
    /// Never conflicts, and is neither blocked by a unit attention nor clears one (INQUIRY,
    /// REPORT LUNS, REQUEST SENSE).
    Exempt,
    /// Allowed under any persistent reservation; conflicts with an SPC-2 reservation.
    Always,
    /// Allowed under any reservation, both kinds.
    Unrestricted,
    /// Reads: conflicts with the exclusive-access types.
    Read,
    /// Writes or changes state: conflicts with every type for a nexus without access.
    Write,
}

/// Reservation TYPE values.
pub mod kind {
    /// Write Exclusive.
    pub const WRITE_EXCLUSIVE: u8 = 1;
    /// Exclusive Access.
    pub const EXCLUSIVE_ACCESS: u8 = 3;
    /// Write Exclusive - Registrants Only.
    pub const WRITE_EXCLUSIVE_REGISTRANTS_ONLY: u8 = 5;
    /// Exclusive Access - Registrants Only.
    pub const EXCLUSIVE_ACCESS_REGISTRANTS_ONLY: u8 = 6;
    /// Write Exclusive - All Registrants.
    pub const WRITE_EXCLUSIVE_ALL_REGISTRANTS: u8 = 7;
    /// Exclusive Access - All Registrants.
    pub const EXCLUSIVE_ACCESS_ALL_REGISTRANTS: u8 = 8;
}

fn valid_type(t: u8) -> bool {
    matches!(t, 1 | 3 | 5 | 6 | 7 | 8)
}

fn all_registrants(t: u8) -> bool {
    matches!(t, 7 | 8)
}

/// One registration.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Registration {
    /// The registered I_T nexus.
    pub nexus: ItNexus,
    /// Its reservation key.
    pub key: u64,
    /// Registered through every target port (ALL_TG_PT).
    pub all_target_ports: bool,
}

impl Registration {
    fn covers(&self, n: &ItNexus) -> bool {
        self.nexus.initiator == n.initiator
            && (self.all_target_ports || self.nexus.relative_port == n.relative_port)
    }
}

/// The persistent reservation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reservation {
    /// The holder (for the all-registrants types, the nexus that reserved; every registrant
    /// holds it).
    pub holder: ItNexus,
    /// TYPE.
    pub kind: u8,
}

/// A logical unit's persistent reservation state.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PrState {
    /// PRGENERATION.
    pub generation: u32,
    /// Registrations, in the order they were made.
    pub registrations: Vec<Registration>,
    /// The reservation, if any.
    pub reservation: Option<Reservation>,
    /// Activate persist through power loss.
    pub aptpl: bool,
}

/// What a change to the reservations did beyond the state: unit attentions to establish,
/// nexuses whose tasks to abort (PREEMPT AND ABORT), and whether the state must be saved.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ReservationEffects {
    /// A unit attention for every I_T nexus of this name.
    pub unit_attentions: Vec<(ItNexus, Asc)>,
    /// The tasks of these I_T nexuses are aborted.
    pub abort: Vec<ItNexus>,
    /// The persistent state changed (an APTPL store must write it).
    pub save: bool,
    /// A LOGICAL UNIT RESET: every other server of the unit resets it too (aborts its tasks,
    /// tells its nexuses), even when the reservations did not change.
    pub reset: bool,
}

/// Why a change to the reservations was refused: the command's status.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PrError {
    /// RESERVATION CONFLICT.
    Conflict,
    /// CHECK CONDITION with this sense.
    Sense(Sense),
}

impl From<Sense> for PrError {
    fn from(s: Sense) -> PrError {
        PrError::Sense(s)
    }
}

/// A change to the reservations by a registrant.
#[derive(Debug, Clone, Copy)]
enum Change {
    Reserve,
    Release,
    Clear,
    Preempt { key: u64, abort: bool },
}

fn param_error(byte: u16) -> PrError {
    PrError::Sense(Sense::invalid_field_in_parameter_list(
        FieldPointer::parameter(byte),
    ))
}

impl PrState {
    fn registration(&self, n: &ItNexus) -> Option<&Registration> {
        self.registrations.iter().find(|r| r.covers(n))
    }

    /// Whether `n` holds the reservation.
    pub fn is_holder(&self, n: &ItNexus) -> bool {
        match &self.reservation {
            Some(r) if all_registrants(r.kind) => self.registration(n).is_some(),
            Some(r) => {
                &r.holder == n
                    || self
                        .registration(n)
                        .is_some_and(|reg| reg.covers(&r.holder) && reg.all_target_ports)
            }
            None => false,
        }
    }

    /// Whether a command of class `access` from `n` may run (SPC-4 table 45).
    pub fn allows(&self, n: &ItNexus, access: Access) -> bool {
        let Some(r) = &self.reservation else {
            return true;
        };
        if self.is_holder(n) {
            return true;
        }
        let registered = self.registration(n).is_some();
        match access {
            Access::Exempt | Access::Always | Access::Unrestricted => true,
            Access::Read => match r.kind {
                kind::EXCLUSIVE_ACCESS => false,
                kind::EXCLUSIVE_ACCESS_REGISTRANTS_ONLY
                | kind::EXCLUSIVE_ACCESS_ALL_REGISTRANTS => registered,
                _ => true,
            },
            Access::Write => match r.kind {
                kind::WRITE_EXCLUSIVE | kind::EXCLUSIVE_ACCESS => false,
                _ => registered,
            },
        }
    }

    /// Whether any I_T nexus is registered.
    pub fn has_registrations(&self) -> bool {
        !self.registrations.is_empty()
    }

    /// PERSISTENT RESERVE IN parameter data for `action`, truncated to `alloc` bytes.
    pub fn read(&self, action: u8, alloc: usize, ptpl_capable: bool) -> Result<Vec<u8>, Sense> {
        let mut d = Vec::new();
        d.extend_from_slice(&self.generation.to_be_bytes());
        match action {
            0 => {
                d.extend_from_slice(&((8 * self.registrations.len()) as u32).to_be_bytes());
                for r in &self.registrations {
                    d.extend_from_slice(&r.key.to_be_bytes());
                }
            }
            1 => match &self.reservation {
                None => d.extend_from_slice(&[0; 4]),
                Some(r) => {
                    d.extend_from_slice(&16u32.to_be_bytes());
                    let key = if all_registrants(r.kind) {
                        0
                    } else {
                        self.registration(&r.holder).map_or(0, |x| x.key)
                    };
                    d.extend_from_slice(&key.to_be_bytes());
                    d.extend_from_slice(&[0, 0, 0, 0, 0, r.kind, 0, 0]);
                }
            },
            2 => {
                d.clear();
                // RLR_C 0, CRH, SIP_C, ATP_C, PTPL_C; TMV, ALLOW COMMANDS 001b, PTPL_A.
                let caps = 0x10 | 0x08 | 0x04 | u8::from(ptpl_capable);
                d.extend_from_slice(&[0, 8, caps, 0x80 | 0x10 | u8::from(self.aptpl)]);
                d.extend_from_slice(&[0xea, 0x01, 0, 0]);
            }
            3 => {
                d.extend_from_slice(&[0; 4]);
                for r in &self.registrations {
                    let holder = self.reservation.as_ref().is_some_and(|res| {
                        if all_registrants(res.kind) {
                            true
                        } else {
                            r.covers(&res.holder)
                        }
                    });
                    d.extend_from_slice(&r.key.to_be_bytes());
                    d.extend_from_slice(&[0; 4]);
                    d.push(u8::from(r.all_target_ports) << 1 | u8::from(holder));
                    d.push(match (&self.reservation, holder) {
                        (Some(res), true) => res.kind,
                        _ => 0,
                    });
                    d.extend_from_slice(&[0; 4]);
                    d.extend_from_slice(&r.nexus.relative_port.to_be_bytes());
                    let mut tid = Vec::new();
                    r.nexus.initiator.encode(&mut tid);
                    d.extend_from_slice(&(tid.len() as u32).to_be_bytes());
                    d.extend_from_slice(&tid);
                }
                let len = (d.len() - 8) as u32;
                d[4..8].copy_from_slice(&len.to_be_bytes());
            }
            _ => return Err(Sense::invalid_field_in_cdb(FieldPointer::cdb_bit(1, 4))),
        }
        d.truncate(alloc);
        Ok(d)
    }

    /// PERSISTENT RESERVE OUT from `me` with `action`, SCOPE and TYPE byte `scope_type`, and
    /// parameter list `p` (whose length the CDB gave).
    pub fn out(
        &mut self,
        me: &ItNexus,
        action: u8,
        scope_type: u8,
        p: &[u8],
    ) -> Result<ReservationEffects, PrError> {
        let fx = ReservationEffects::default();
        if action == 7 {
            return self.register_and_move(me, scope_type, p, fx);
        }
        if p.len() < 24 {
            return Err(Sense::parameter_list_length_error().into());
        }
        let be64 = |at: usize| u64::from_be_bytes(p[at..at + 8].try_into().unwrap());
        let key = be64(0);
        let sa_key = be64(8);
        let spec_i_pt = p[20] & 0x08 != 0;
        let all_tg_pt = p[20] & 0x04 != 0;
        let aptpl = p[20] & 0x01 != 0;
        if p.len() != 24 && !(spec_i_pt && matches!(action, 0)) {
            return Err(Sense::parameter_list_length_error().into());
        }
        let scope = scope_type >> 4;
        let ty = scope_type & 0x0f;
        let mine = self.registration(me).cloned();
        match action {
            0 | 6 => {
                if action == 6 && spec_i_pt {
                    return Err(param_error(20));
                }
                match &mine {
                    None if action == 0 && key != 0 => return Err(PrError::Conflict),
                    Some(r) if action == 0 && r.key != key => return Err(PrError::Conflict),
                    Some(_) if spec_i_pt => return Err(param_error(20)),
                    _ => {}
                }
                let mut new = Vec::new();
                if spec_i_pt && sa_key != 0 {
                    if p.len() < 28 {
                        return Err(Sense::parameter_list_length_error().into());
                    }
                    let len = u32::from_be_bytes(p[24..28].try_into().unwrap()) as usize;
                    if p.len() != 28 + len {
                        return Err(Sense::parameter_list_length_error().into());
                    }
                    let mut at = 28;
                    while at < p.len() {
                        let (tid, n) = TransportId::parse(&p[at..], at)?;
                        if tid.port.is_none() && tid.protocol == crate::nexus::protocol::ISCSI {
                            // A name-only TransportID designates every port of the name: we
                            // cannot register ports we have not seen; refuse rather than guess.
                            return Err(param_error(at as u16));
                        }
                        // Through this target port, or (ALL_TG_PT) every port, as the
                        // registration records.
                        new.push(ItNexus {
                            initiator: tid,
                            relative_port: me.relative_port,
                        });
                        at += n;
                    }
                    if new
                        .iter()
                        .any(|n| self.registration(n).is_some() && n != me)
                    {
                        // An already registered nexus named in the list: the whole command fails.
                        return Err(param_error(24));
                    }
                }
                Ok(self.set_key(me, mine.is_some(), sa_key, all_tg_pt, Some(aptpl), new))
            }
            1..=5 => {
                self.check_key(me, key)?;
                if spec_i_pt || all_tg_pt {
                    return Err(param_error(20));
                }
                let needs_type =
                    matches!(action, 1 | 4 | 5) || (action == 2 && self.reservation.is_some());
                if needs_type && (scope != 0 || !valid_type(ty)) {
                    return Err(Sense::invalid_field_in_cdb(FieldPointer::cdb(2)).into());
                }
                let change = match action {
                    1 => Change::Reserve,
                    2 => Change::Release,
                    3 => Change::Clear,
                    _ => Change::Preempt {
                        key: sa_key,
                        abort: action == 5,
                    },
                };
                self.change(me, change, ty)
            }
            _ => Err(Sense::invalid_field_in_cdb(FieldPointer::cdb_bit(1, 4)).into()),
        }
    }

    /// Registers `me` with `new_key`, or (`new_key` 0) unregisters it: PERSISTENT RESERVE
    /// OUT's REGISTER (`key` its RESERVATION KEY, which must be the registration's, or 0 for
    /// none) or REGISTER AND IGNORE EXISTING KEY (`key` `None`), and what NVMe's Reservation
    /// Register does after its own checks. `aptpl` sets persistence through power loss
    /// (`None`: unchanged).
    pub fn register(
        &mut self,
        me: &ItNexus,
        key: Option<u64>,
        new_key: u64,
        all_target_ports: bool,
        aptpl: Option<bool>,
    ) -> Result<ReservationEffects, PrError> {
        let mine = self.registration(me).map(|r| r.key);
        match (key, mine) {
            (Some(k), None) if k != 0 => return Err(PrError::Conflict),
            (Some(k), Some(r)) if r != k => return Err(PrError::Conflict),
            _ => {}
        }
        Ok(self.set_key(
            me,
            mine.is_some(),
            new_key,
            all_target_ports,
            aptpl,
            Vec::new(),
        ))
    }

    /// A registration's key set (`sa_key` 0: the registration goes), checks passed; `new`
    /// are more nexuses registered with it (SPEC_I_PT).
    fn set_key(
        &mut self,
        me: &ItNexus,
        registered: bool,
        sa_key: u64,
        all_tg_pt: bool,
        aptpl: Option<bool>,
        new: Vec<ItNexus>,
    ) -> ReservationEffects {
        let mut fx = ReservationEffects {
            save: true,
            ..ReservationEffects::default()
        };
        if sa_key == 0 {
            if registered {
                self.unregister(me, &mut fx);
                self.generation = self.generation.wrapping_add(1);
            }
            // Unregistering (or registering nothing) still sets APTPL.
            if let Some(a) = aptpl {
                self.aptpl = a && self.has_registrations();
            }
            return fx;
        }
        match self.registrations.iter_mut().find(|r| r.covers(me)) {
            Some(r) => r.key = sa_key,
            None => self.registrations.push(Registration {
                nexus: me.clone(),
                key: sa_key,
                all_target_ports: all_tg_pt,
            }),
        }
        for n in new.into_iter().filter(|n| n != me) {
            self.registrations.push(Registration {
                nexus: n,
                key: sa_key,
                all_target_ports: all_tg_pt,
            });
        }
        if let Some(a) = aptpl {
            self.aptpl = a;
        }
        self.generation = self.generation.wrapping_add(1);
        fx
    }

    /// RESERVATION CONFLICT unless `me` is registered with `key`.
    fn check_key(&self, me: &ItNexus, key: u64) -> Result<(), PrError> {
        match self.registration(me) {
            Some(r) if r.key == key => Ok(()),
            _ => Err(PrError::Conflict),
        }
    }

    /// Reserves with TYPE `ty` for `me`, registered with `key` (PERSISTENT RESERVE OUT's
    /// RESERVE; NVMe's Reservation Acquire).
    pub fn reserve(
        &mut self,
        me: &ItNexus,
        key: u64,
        ty: u8,
    ) -> Result<ReservationEffects, PrError> {
        self.check_key(me, key)?;
        self.change(me, Change::Reserve, ty)
    }

    /// Releases the reservation of TYPE `ty` `me` holds (nothing when it holds none).
    pub fn release(
        &mut self,
        me: &ItNexus,
        key: u64,
        ty: u8,
    ) -> Result<ReservationEffects, PrError> {
        self.check_key(me, key)?;
        self.change(me, Change::Release, ty)
    }

    /// Clears every registration and the reservation.
    pub fn clear(&mut self, me: &ItNexus, key: u64) -> Result<ReservationEffects, PrError> {
        self.check_key(me, key)?;
        self.change(me, Change::Clear, 0)
    }

    /// Preempts the registrations of `victim` (and the reservation, when its holder's) for
    /// `me`, which then holds a reservation of TYPE `ty`; `abort`: the tasks of the
    /// preempted nexuses are aborted (PREEMPT AND ABORT).
    pub fn preempt(
        &mut self,
        me: &ItNexus,
        key: u64,
        victim: u64,
        ty: u8,
        abort: bool,
    ) -> Result<ReservationEffects, PrError> {
        self.check_key(me, key)?;
        self.change(me, Change::Preempt { key: victim, abort }, ty)
    }

    /// A change by `me`, whose registration's key was checked.
    fn change(
        &mut self,
        me: &ItNexus,
        change: Change,
        ty: u8,
    ) -> Result<ReservationEffects, PrError> {
        let mut fx = ReservationEffects::default();
        match change {
            Change::Reserve => match &self.reservation {
                None => {
                    self.reservation = Some(Reservation {
                        holder: me.clone(),
                        kind: ty,
                    });
                }
                Some(r) if self.is_holder(me) && r.kind == ty => {}
                Some(_) => return Err(PrError::Conflict),
            },
            Change::Release => {
                let Some(r) = self.reservation.clone() else {
                    return Ok(fx);
                };
                if !self.is_holder(me) {
                    return Ok(fx);
                }
                if r.kind != ty {
                    return Err(Sense::new(
                        SenseKey::IllegalRequest,
                        Asc::INVALID_RELEASE_OF_PERSISTENT_RESERVATION,
                    )
                    .into());
                }
                self.reservation = None;
                if !matches!(r.kind, kind::WRITE_EXCLUSIVE | kind::EXCLUSIVE_ACCESS) {
                    self.notify_others(me, Asc::RESERVATIONS_RELEASED, &mut fx);
                }
            }
            Change::Clear => {
                self.notify_others(me, Asc::RESERVATIONS_PREEMPTED, &mut fx);
                self.registrations.clear();
                self.reservation = None;
                self.generation = self.generation.wrapping_add(1);
            }
            Change::Preempt { key, abort } => self.preempt_key(me, key, ty, abort, &mut fx)?,
        }
        fx.save = true;
        Ok(fx)
    }

    /// Unit attentions to every registrant other than `me`.
    fn notify_others(&self, me: &ItNexus, asc: Asc, fx: &mut ReservationEffects) {
        for r in self.registrations.iter().filter(|r| !r.covers(me)) {
            fx.unit_attentions.push((r.nexus.clone(), asc));
        }
    }

    fn unregister(&mut self, me: &ItNexus, fx: &mut ReservationEffects) {
        let was_holder = self.is_holder(me);
        self.registrations.retain(|r| !r.covers(me));
        if let Some(r) = self.reservation.clone() {
            let release = if all_registrants(r.kind) {
                self.registrations.is_empty()
            } else {
                was_holder
            };
            if release {
                self.reservation = None;
                if matches!(
                    r.kind,
                    kind::WRITE_EXCLUSIVE_REGISTRANTS_ONLY
                        | kind::EXCLUSIVE_ACCESS_REGISTRANTS_ONLY
                ) {
                    self.notify_others(me, Asc::RESERVATIONS_RELEASED, fx);
                }
            }
        }
    }

    fn preempt_key(
        &mut self,
        me: &ItNexus,
        sa_key: u64,
        ty: u8,
        abort: bool,
        fx: &mut ReservationEffects,
    ) -> Result<(), PrError> {
        let res = self.reservation.clone();
        let removed: Vec<Registration> = match &res {
            Some(r) if all_registrants(r.kind) && sa_key == 0 => {
                // Preempting an all-registrants reservation with key 0: every other
                // registration goes and the caller holds the new reservation.
                let gone = self
                    .registrations
                    .iter()
                    .filter(|x| !x.covers(me))
                    .cloned()
                    .collect();
                self.reservation = Some(Reservation {
                    holder: me.clone(),
                    kind: ty,
                });
                gone
            }
            Some(r)
                if !all_registrants(r.kind)
                    && self
                        .registration(&r.holder)
                        .is_some_and(|h| h.key == sa_key) =>
            {
                let gone = self
                    .registrations
                    .iter()
                    .filter(|x| x.key == sa_key && !x.covers(me))
                    .cloned()
                    .collect();
                self.reservation = Some(Reservation {
                    holder: me.clone(),
                    kind: ty,
                });
                gone
            }
            _ => {
                if sa_key == 0 {
                    return Err(param_error(8));
                }
                let gone: Vec<Registration> = self
                    .registrations
                    .iter()
                    .filter(|x| x.key == sa_key)
                    .cloned()
                    .collect();
                if gone.is_empty() {
                    return Err(PrError::Conflict);
                }
                gone
            }
        };
        self.registrations.retain(|x| !removed.contains(x));
        for r in &removed {
            fx.unit_attentions
                .push((r.nexus.clone(), Asc::REGISTRATIONS_PREEMPTED));
            if abort {
                fx.abort.push(r.nexus.clone());
            }
        }
        if let (Some(old), Some(new)) = (&res, &self.reservation) {
            if old.kind != new.kind || old.holder != new.holder {
                for r in self.registrations.iter().filter(|r| !r.covers(me)) {
                    if !removed.contains(r) {
                        fx.unit_attentions
                            .push((r.nexus.clone(), Asc::RESERVATIONS_RELEASED));
                    }
                }
            }
        }
        self.generation = self.generation.wrapping_add(1);
        Ok(())
    }

    fn register_and_move(
        &mut self,
        me: &ItNexus,
        scope_type: u8,
        p: &[u8],
        mut fx: ReservationEffects,
    ) -> Result<ReservationEffects, PrError> {
        if p.len() < 24 {
            return Err(Sense::parameter_list_length_error().into());
        }
        let key = u64::from_be_bytes(p[0..8].try_into().unwrap());
        let sa_key = u64::from_be_bytes(p[8..16].try_into().unwrap());
        let unreg = p[17] & 0x02 != 0;
        let aptpl = p[17] & 0x01 != 0;
        let port = u16::from_be_bytes([p[18], p[19]]);
        let tid_len = u32::from_be_bytes(p[20..24].try_into().unwrap()) as usize;
        if p.len() < 24 + tid_len {
            return Err(Sense::parameter_list_length_error().into());
        }
        let Some(mine) = self.registration(me).cloned() else {
            return Err(PrError::Conflict);
        };
        if mine.key != key {
            return Err(PrError::Conflict);
        }
        let Some(res) = self.reservation.clone() else {
            return Err(PrError::Conflict);
        };
        if all_registrants(res.kind) || !self.is_holder(me) {
            return Err(PrError::Conflict);
        }
        if sa_key == 0 {
            return Err(param_error(8));
        }
        let (tid, _) = TransportId::parse(&p[24..24 + tid_len], 24)?;
        if tid.port.is_none() && tid.protocol == crate::nexus::protocol::ISCSI {
            return Err(param_error(24));
        }
        let dest = ItNexus {
            initiator: tid,
            relative_port: port,
        };
        if &dest == me || (dest.initiator == me.initiator && mine.all_target_ports) {
            return Err(param_error(24));
        }
        let ty = scope_type & 0x0f;
        if scope_type >> 4 != 0 || !valid_type(ty) {
            return Err(Sense::invalid_field_in_cdb(FieldPointer::cdb(2)).into());
        }
        match self.registrations.iter_mut().find(|r| r.covers(&dest)) {
            Some(r) => r.key = sa_key,
            None => self.registrations.push(Registration {
                nexus: dest.clone(),
                key: sa_key,
                all_target_ports: false,
            }),
        }
        self.reservation = Some(Reservation {
            holder: dest,
            kind: ty,
        });
        if unreg {
            self.registrations.retain(|r| !r.covers(me));
        }
        self.aptpl = aptpl;
        self.generation = self.generation.wrapping_add(1);
        fx.save = true;
        Ok(fx)
    }

    /// The state as text, for a [`PrStore`]: one line per fact, names as they are.
    pub fn encode(&self) -> Vec<u8> {
        let mut s = format!(
            "generation {}\naptpl {}\n",
            self.generation,
            u8::from(self.aptpl)
        );
        let nexus = encode_nexus;
        for r in &self.registrations {
            s += &format!(
                "register {:016x} {} {}\n",
                r.key,
                u8::from(r.all_target_ports),
                nexus(&r.nexus)
            );
        }
        if let Some(r) = &self.reservation {
            s += &format!("reserve {} {}\n", r.kind, nexus(&r.holder));
        }
        s.into_bytes()
    }

    /// Parses what [`PrState::encode`] wrote; `None` if it is damaged.
    pub fn decode(bytes: &[u8]) -> Option<PrState> {
        let text = std::str::from_utf8(bytes).ok()?;
        let mut st = PrState::default();
        let nexus = decode_nexus;
        for line in text.lines() {
            let w: Vec<&str> = line.split_whitespace().collect();
            match w.first().copied() {
                Some("generation") => st.generation = w.get(1)?.parse().ok()?,
                Some("aptpl") => st.aptpl = *w.get(1)? == "1",
                Some("register") => st.registrations.push(Registration {
                    key: u64::from_str_radix(w.get(1)?, 16).ok()?,
                    all_target_ports: *w.get(2)? == "1",
                    nexus: nexus(w.get(3..)?)?,
                }),
                Some("reserve") => {
                    st.reservation = Some(Reservation {
                        kind: w.get(1)?.parse().ok().filter(|&t| valid_type(t))?,
                        holder: nexus(w.get(2..)?)?,
                    })
                }
                None => {}
                Some(_) => return None,
            }
        }
        Some(st)
    }
}

/// A change to a unit's reservations asked by one I_T nexus.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ReservationRequest {
    /// PERSISTENT RESERVE OUT with its service action, SCOPE and TYPE byte and parameter list.
    PersistentReserveOut {
        /// SERVICE ACTION.
        action: u8,
        /// SCOPE (high nibble) and TYPE.
        scope_type: u8,
        /// The parameter list, as long as the CDB said.
        parameters: Vec<u8>,
    },
    /// RESERVE(6) or RESERVE(10): the SPC-2 reservation of the whole unit.
    Reserve,
    /// RELEASE(6) or RELEASE(10).
    Release,
    /// The nexus is gone (I_T nexus loss or reset): its SPC-2 reservation goes with it.
    NexusLost,
    /// LOGICAL UNIT RESET: the SPC-2 reservation goes, whoever holds it.
    Reset,
}

/// Everything that reserves a logical unit: its persistent reservations and its SPC-2
/// reservation. Gateways that serve one unit together share exactly this.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Reservations {
    /// Registrations and the persistent reservation.
    pub persistent: PrState,
    /// The SPC-2 (RESERVE/RELEASE) reservation's holder.
    pub spc2: Option<ItNexus>,
}

impl Reservations {
    /// Applies `request` from `nexus`: the new state is `self`, the effects are returned. On
    /// an error nothing changed.
    pub fn apply(
        &mut self,
        nexus: &ItNexus,
        request: &ReservationRequest,
    ) -> Result<ReservationEffects, PrError> {
        let held_by_other = self.spc2.as_ref().is_some_and(|h| h != nexus);
        match request {
            ReservationRequest::PersistentReserveOut {
                action,
                scope_type,
                parameters,
            } => {
                if held_by_other {
                    return Err(PrError::Conflict);
                }
                let mut next = self.persistent.clone();
                let fx = next.out(nexus, *action, *scope_type, parameters)?;
                self.persistent = next;
                Ok(fx)
            }
            ReservationRequest::Reserve => {
                if held_by_other || self.persistent.has_registrations() {
                    return Err(PrError::Conflict);
                }
                self.spc2 = Some(nexus.clone());
                Ok(ReservationEffects::default())
            }
            ReservationRequest::Release | ReservationRequest::NexusLost => {
                if self.spc2.as_ref() == Some(nexus) {
                    self.spc2 = None;
                }
                Ok(ReservationEffects::default())
            }
            ReservationRequest::Reset => {
                self.spc2 = None;
                Ok(ReservationEffects {
                    reset: true,
                    ..ReservationEffects::default()
                })
            }
        }
    }

    /// The state as text ([`PrState::encode`], and a line for the SPC-2 holder).
    pub fn encode(&self) -> Vec<u8> {
        let mut b = self.persistent.encode();
        if let Some(n) = &self.spc2 {
            b.extend_from_slice(format!("spc2 {}\n", encode_nexus(n)).as_bytes());
        }
        b
    }

    /// Parses what [`Reservations::encode`] wrote; `None` if it is damaged.
    pub fn decode(bytes: &[u8]) -> Option<Reservations> {
        let text = std::str::from_utf8(bytes).ok()?;
        let mut persistent = String::new();
        let mut spc2 = None;
        for line in text.lines() {
            match line.strip_prefix("spc2 ") {
                Some(rest) => {
                    let w: Vec<&str> = rest.split_whitespace().collect();
                    spc2 = Some(decode_nexus(&w)?);
                }
                None => {
                    persistent.push_str(line);
                    persistent.push('\n');
                }
            }
        }
        Some(Reservations {
            persistent: PrState::decode(persistent.as_bytes())?,
            spc2,
        })
    }
}

impl ReservationEffects {
    /// What the nexuses of a server that missed the changes from `before` to `after` should
    /// hear (a gateway cut off from its peers while they changed the shared state): a
    /// registration gone is REGISTRATIONS PREEMPTED; a persistent reservation gone or
    /// changed is RESERVATIONS RELEASED or RESERVATIONS PREEMPTED to the registrants that
    /// remain. The exact effects of each change were told to the servers that were there;
    /// this one learns the net outcome, which is what its initiators must re-read.
    /// Only persistent reservations count: an SPC-2 reservation is not shared.
    pub fn missed(old: &PrState, new: &PrState) -> ReservationEffects {
        let mut fx = ReservationEffects::default();
        let registered = |st: &PrState, n: &ItNexus| st.registrations.iter().any(|r| r.nexus == *n);
        for r in &old.registrations {
            if !registered(new, &r.nexus) {
                fx.unit_attentions
                    .push((r.nexus.clone(), Asc::REGISTRATIONS_PREEMPTED));
            }
        }
        if old.reservation.is_some() && old.reservation != new.reservation {
            let asc = if new.reservation.is_none() {
                Asc::RESERVATIONS_RELEASED
            } else {
                Asc::RESERVATIONS_PREEMPTED
            };
            for r in &old.registrations {
                if registered(new, &r.nexus) {
                    fx.unit_attentions.push((r.nexus.clone(), asc));
                }
            }
        }
        fx
    }

    /// The effects as text, one line each (for a gateway to tell the others).
    pub fn encode(&self) -> Vec<u8> {
        let mut s = String::new();
        for (n, asc) in &self.unit_attentions {
            s += &format!("ua {:02x} {:02x} {}\n", asc.0, asc.1, encode_nexus(n));
        }
        for n in &self.abort {
            s += &format!("abort {}\n", encode_nexus(n));
        }
        if self.reset {
            s += "reset\n";
        }
        s.into_bytes()
    }

    /// Parses what [`ReservationEffects::encode`] wrote; `None` if it is damaged.
    pub fn decode(bytes: &[u8]) -> Option<ReservationEffects> {
        let text = std::str::from_utf8(bytes).ok()?;
        let mut fx = ReservationEffects::default();
        for line in text.lines() {
            let w: Vec<&str> = line.split_whitespace().collect();
            match w.first().copied() {
                Some("ua") => {
                    let asc = u8::from_str_radix(w.get(1)?, 16).ok()?;
                    let ascq = u8::from_str_radix(w.get(2)?, 16).ok()?;
                    fx.unit_attentions
                        .push((decode_nexus(w.get(3..)?)?, Asc(asc, ascq)));
                }
                Some("abort") => fx.abort.push(decode_nexus(w.get(1..)?)?),
                Some("reset") => fx.reset = true,
                None => {}
                Some(_) => return None,
            }
        }
        Some(fx)
    }
}

/// An I_T nexus as four words: protocol, relative port, initiator name, port ("-" for none).
pub(crate) fn encode_nexus(n: &ItNexus) -> String {
    format!(
        "{} {} {} {}",
        n.initiator.protocol,
        n.relative_port,
        n.initiator.name,
        n.initiator.port.as_deref().unwrap_or("-")
    )
}

pub(crate) fn decode_nexus(w: &[&str]) -> Option<ItNexus> {
    Some(ItNexus {
        initiator: TransportId {
            protocol: w.first()?.parse().ok()?,
            name: w.get(2)?.to_string(),
            port: match *w.get(3)? {
                "-" => None,
                p => Some(p.to_string()),
            },
        },
        relative_port: w.get(1)?.parse().ok()?,
    })
}

/// Where reservations with APTPL set are kept across restarts, by logical unit serial number.
pub trait PrStore: Send {
    /// What was saved for `unit`.
    fn load(&self, unit: &str) -> Option<Vec<u8>>;
    /// Saves `state` for `unit`, durably; `None` forgets it.
    fn save(&mut self, unit: &str, state: Option<&[u8]>) -> std::io::Result<()>;
}

/// A [`PrStore`] in memory (tests, or units that need no persistence).
#[derive(Debug, Default)]
pub struct MemoryStore(pub std::collections::HashMap<String, Vec<u8>>);

impl PrStore for MemoryStore {
    fn load(&self, unit: &str) -> Option<Vec<u8>> {
        self.0.get(unit).cloned()
    }

    fn save(&mut self, unit: &str, state: Option<&[u8]>) -> std::io::Result<()> {
        match state {
            Some(s) => self.0.insert(unit.to_string(), s.to_vec()),
            None => self.0.remove(unit),
        };
        Ok(())
    }
}

/// Replaces the file at `path` with `bytes` so that a crash leaves the old contents or the
/// new ones, never a torn file: a temporary file beside it (created with `mode`, less the
/// umask), fsync, rename over `path`, fsync of the directory.
pub fn replace_file(path: &Path, bytes: &[u8], mode: u32) -> std::io::Result<()> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let dir = path
        .parent()
        .filter(|d| !d.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    let name = path
        .file_name()
        .ok_or_else(|| std::io::Error::new(std::io::ErrorKind::InvalidInput, "not a file name"))?;
    let tmp = dir.join(format!(
        ".{}.tmp-{}",
        name.to_string_lossy(),
        std::process::id()
    ));
    let written = (|| {
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(mode)
            .open(&tmp)?;
        f.write_all(bytes)?;
        f.sync_all()?;
        std::fs::rename(&tmp, path)
    })();
    if let Err(e) = written {
        let _ = std::fs::remove_file(&tmp);
        return Err(e);
    }
    std::fs::File::open(dir)?.sync_all()
}

/// A [`PrStore`] in a directory, one file per unit. Saves are atomic ([`replace_file`]): a
/// crash leaves the old state or the new one, never a torn file.
#[derive(Debug)]
pub struct FileStore {
    dir: PathBuf,
}

impl FileStore {
    /// A store in `dir`, created (mode 0700) if missing, but only it: its parent must exist,
    /// so a mistyped path makes no tree of directories anywhere.
    pub fn new(dir: impl Into<PathBuf>) -> std::io::Result<FileStore> {
        use std::os::unix::fs::DirBuilderExt;
        let dir = dir.into();
        if !dir.is_dir() {
            std::fs::DirBuilder::new()
                .mode(0o700)
                .create(&dir)
                .map_err(|e| match e.kind() {
                    std::io::ErrorKind::NotFound => std::io::Error::new(
                        e.kind(),
                        "its parent directory does not exist (only the last component is made)",
                    ),
                    _ => e,
                })?;
        }
        Ok(FileStore { dir })
    }

    fn path(&self, unit: &str) -> PathBuf {
        let safe: String = unit
            .chars()
            .map(|c| if c.is_ascii_alphanumeric() { c } else { '_' })
            .collect();
        self.dir.join(format!("{safe}.pr"))
    }
}

impl PrStore for FileStore {
    fn load(&self, unit: &str) -> Option<Vec<u8>> {
        std::fs::read(self.path(unit)).ok()
    }

    fn save(&mut self, unit: &str, state: Option<&[u8]>) -> std::io::Result<()> {
        let path = self.path(unit);
        match state {
            None => match std::fs::remove_file(&path) {
                Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(e),
                _ => std::fs::File::open(&self.dir)?.sync_all(),
            },
            // 0o666 less the umask, as File::create makes it.
            Some(bytes) => replace_file(&path, bytes, 0o666),
        }
    }
}
