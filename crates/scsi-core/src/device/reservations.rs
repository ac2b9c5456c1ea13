//! Reservations: the device's own (SPC-2 and persistent, with an APTPL store), or shared
//! with other device servers of the unit through a keeper that decides each change
//! ([`Device::share_reservations`], [`ReservationChange`]): changes handed out, states
//! applied, and PREEMPT AND ABORT waiting for the tasks it aborted.

use super::*;

impl Device {
    /// Persists APTPL reservations through `store`, and loads what it holds for the units
    /// already added and those added later.
    pub fn set_reservation_store(&mut self, store: Box<dyn PrStore>) {
        self.store = Some(store);
        for i in 0..self.lus.len() {
            self.load_reservations(i as u16);
        }
    }

    /// Keeps the reservations of unit `lun` elsewhere, shared with other device servers that
    /// serve the same unit (gateways of one target): commands that would change them
    /// (PERSISTENT RESERVE OUT, RESERVE, RELEASE; nexus loss and LOGICAL UNIT RESET for the
    /// SPC-2 reservation) wait while their [`ReservationChange`] goes to the keeper
    /// ([`Device::poll_reservation_change`]), which decides it on the shared state with
    /// [`Reservations::apply`], has every server apply the outcome
    /// ([`Device::apply_reservations`]) and then ends the command
    /// ([`Device::reservation_done`]). Access checks use the state applied last, so a
    /// reservation is enforced here once the keeper has applied it here. APTPL is accepted:
    /// the keeper's state outlives a restart.
    pub fn share_reservations(&mut self, lun: u16) -> Result<(), DeviceError> {
        let lu = self.lu_mut(lun).ok_or(DeviceError::Lun(lun))?;
        lu.shared.get_or_insert(0);
        Ok(())
    }

    /// The next change to shared reservations for their keeper.
    pub fn poll_reservation_change(&mut self) -> Option<ReservationChange> {
        self.changes.pop_front()
    }

    /// Whether a change to shared reservations waits for the keeper: a cheap look for a
    /// caller that polls after every call.
    pub fn has_reservation_changes(&self) -> bool {
        !self.changes.is_empty()
    }

    /// The reservations of unit `lun` as this device server enforces them, and (for shared
    /// ones) the version applied last.
    pub fn reservations(&self, lun: u16) -> Option<(&Reservations, Option<u64>)> {
        self.lu(lun).map(|lu| (&lu.reservations, lu.shared))
    }

    /// The keeper of unit `lun`'s shared reservations says they are `state` at `version`,
    /// after a change with `effects`: the state replaces this server's, and its unit
    /// attentions and aborts reach this server's nexuses of those names. A version not newer
    /// than the one applied last changes nothing (a change heard twice, or late); returns
    /// whether it was applied.
    #[must_use = "a state not applied (not newer than the last) is news the caller may log"]
    pub fn apply_reservations(
        &mut self,
        lun: u16,
        version: u64,
        state: Reservations,
        effects: &ReservationEffects,
    ) -> bool {
        let Some(lu) = self.lu_mut(lun) else {
            return false;
        };
        match lu.shared {
            Some(v) if v < version => lu.shared = Some(version),
            _ => return false,
        }
        lu.reservations = state;
        if effects.reset {
            // Another server's LOGICAL UNIT RESET: this server's tasks on the unit go, and
            // its nexuses hear of it.
            let ids = self.select_tasks(|t| t.lun == lun && t.phase != Phase::Reserving);
            self.abort_tasks(&ids, None);
            self.reset_lu_state(lun);
        }
        self.reservation_effects(lun, effects, None);
        true
    }

    /// The keeper says unit `lun`'s shared reservations are `state` at `version`, and this
    /// server may have missed changes before it (it was cut off from its peers, or read the
    /// state anew): the nexuses here hear the net outcome against the state they last heard
    /// ([`ReservationEffects::missed`]) as [`Device::apply_reservations`] applies it.
    #[must_use = "a state not applied (not newer than the last) is news the caller may log"]
    pub fn catch_up_reservations(&mut self, lun: u16, version: u64, state: Reservations) -> bool {
        let Some(lu) = self.lu(lun) else {
            return false;
        };
        // Not newer than the last applied: nothing changes, so what was missed is not worked out.
        if !matches!(lu.shared, Some(v) if v < version) {
            return false;
        }
        let missed = ReservationEffects::missed(&lu.reservations.persistent, &state.persistent);
        self.apply_reservations(lun, version, state, &missed)
    }

    /// The keeper has decided the change of reservation task `task` (and, when it succeeded,
    /// applied it here): the command ends with GOOD, RESERVATION CONFLICT or the sense.
    pub fn reservation_done(
        &mut self,
        task: TaskId,
        result: Result<(), PrError>,
    ) -> Result<(), DeviceError> {
        let t = self.task_mut(task)?;
        if t.phase != Phase::Reserving {
            return Err(DeviceError::WrongPhase);
        }
        t.phase = Phase::Enabled;
        if t.aborted {
            let tag = t.tag;
            self.end(task, Some(Action::Aborted { task, tag }));
            return Ok(());
        }
        // PREEMPT AND ABORT: the keeper applied the change here first, aborting this
        // server's tasks of the preempted nexuses; it completes once they have ended (the
        // other servers acknowledged only once theirs had).
        let preempt_and_abort = t.cdb[0] == 0x5f && t.cdb[1] & 0x1f == 5;
        if preempt_and_abort && result.is_ok() {
            let lun = t.lun;
            let waiting = self.aborted_in_flight(lun, task);
            if !waiting.is_empty() {
                self.drain(task, waiting);
                return Ok(());
            }
        }
        let result = match result {
            Ok(()) => Ok(Reply::Good),
            Err(PrError::Conflict) => Err(TaskError::ReservationConflict),
            Err(PrError::Sense(s)) => Err(TaskError::Sense(s)),
        };
        self.complete(task, result);
        Ok(())
    }

    /// The keeper has carried out (or given up on) a change a task management function
    /// (`reference`) waits for: it is answered once nothing else holds it.
    pub fn task_management_change_done(&mut self, reference: u64) {
        if let Some(t) = self.tmfs.iter_mut().find(|t| t.reference == reference) {
            t.keeper = t.keeper.saturating_sub(1);
        }
        self.finish_tmfs();
    }

    /// Unit attentions and aborts of a change to the reservations of `lun`.
    pub(crate) fn reservation_effects(
        &mut self,
        lun: u16,
        fx: &ReservationEffects,
        except: Option<TaskId>,
    ) {
        for (name, asc) in &fx.unit_attentions {
            self.unit_attention_for(lun, *asc, name);
        }
        if !fx.abort.is_empty() {
            self.abort_nexus_tasks(lun, &fx.abort, except);
        }
    }

    /// A command asks to change the reservations: its keeper decides when they are shared,
    /// this server at once otherwise (saving APTPL state to the store).
    pub(crate) fn change_reservations(
        &mut self,
        id: TaskId,
        request: ReservationRequest,
    ) -> Result<Step, TaskError> {
        let t = self.task(id).map_err(|_| Sense::invalid_opcode())?;
        let (lun, nexus) = (t.lun, t.nexus);
        let me = self.nexus_name(nexus)?;
        let lu = self.lu_mut(lun).ok_or(Sense::invalid_opcode())?;
        if lu.shared.is_some() {
            self.changes.push_back(ReservationChange {
                task: Some(id),
                tmf: None,
                lun,
                nexus: me,
                request,
            });
            return Ok(Step::Reserving);
        }
        let before = lu.reservations.persistent.clone();
        let fx = match lu.reservations.apply(&me, &request) {
            Ok(fx) => fx,
            Err(PrError::Conflict) => return Err(TaskError::ReservationConflict),
            Err(PrError::Sense(s)) => return Err(s.into()),
        };
        let after = &lu.reservations.persistent;
        if fx.save && (before.aptpl || after.aptpl) {
            let state = after.aptpl.then(|| after.encode());
            let serial = lu.unit.identity.serial.clone();
            if let Some(store) = self.store.as_mut() {
                if store.save(&serial, state.as_deref()).is_err() {
                    if let Some(lu) = self.lu_mut(lun) {
                        lu.reservations.persistent = before;
                    }
                    return Err(Sense::new(
                        SenseKey::IllegalRequest,
                        Asc::INSUFFICIENT_REGISTRATION_RESOURCES,
                    )
                    .into());
                }
            }
        }
        self.reservation_effects(lun, &fx, Some(id));
        if !fx.abort.is_empty() {
            let waiting = self.aborted_in_flight(lun, id);
            if !waiting.is_empty() {
                return Ok(Step::Draining(waiting));
            }
        }
        Ok(Step::Done(Reply::Good))
    }

    /// The tasks on `lun` that were aborted but have not ended (their I/O is under way),
    /// but `except`.
    pub(super) fn aborted_in_flight(&self, lun: u16, except: TaskId) -> Vec<TaskId> {
        let mut ids = self.select_tasks(|t| t.lun == lun && t.aborted);
        ids.retain(|&t| t != except);
        ids
    }

    /// How many tasks on `lun` were aborted and have not ended yet. A server that applies
    /// another's PREEMPT AND ABORT ([`Device::apply_reservations`]) acknowledges it once
    /// this is 0, so that no write of a preempted nexus reaches the medium after the
    /// preempting command completed.
    pub fn aborted_tasks_in_flight(&self, lun: u16) -> usize {
        self.select_tasks(|t| t.lun == lun && t.aborted).len()
    }

    /// Task `id` (a PREEMPT AND ABORT) completes once `waiting` have ended.
    pub(super) fn drain(&mut self, id: TaskId, waiting: Vec<TaskId>) {
        if let Ok(t) = self.task_mut(id) {
            t.phase = Phase::Draining;
            self.drains.push((id, waiting));
        }
    }

    /// Completes the PREEMPT AND ABORT commands whose aborted tasks have all ended, now that
    /// `ended` has.
    pub(super) fn finish_drains(&mut self, ended: TaskId) {
        for (_, waiting) in &mut self.drains {
            waiting.retain(|&w| w != ended);
        }
        while let Some(i) = self.drains.iter().position(|(_, w)| w.is_empty()) {
            let (id, _) = self.drains.swap_remove(i);
            let Ok(t) = self.task_mut(id) else { continue };
            t.phase = Phase::Enabled;
            if t.aborted {
                let tag = t.tag;
                self.end(id, Some(Action::Aborted { task: id, tag }));
            } else {
                self.complete(id, Ok(Reply::Good));
            }
        }
    }

    /// Whether the I_T nexus `nexus` holds an SPC-2 reservation of a unit whose reservations
    /// are shared: its loss must reach the other servers of the unit.
    pub fn holds_shared_reservation(&self, nexus: NexusId) -> bool {
        let Ok(n) = self.nexus(nexus) else {
            return false;
        };
        self.lus
            .iter()
            .flatten()
            .any(|lu| lu.shared.is_some() && lu.reservations.spc2.as_ref() == Some(&n.name))
    }

    /// Whether APTPL may be set on unit `lun`: a store keeps the state, or its keeper does.
    pub(crate) fn ptpl_capable(&self, lun: u16) -> bool {
        self.store.is_some() || self.lu(lun).is_some_and(|lu| lu.shared.is_some())
    }

    pub(super) fn load_reservations(&mut self, index: u16) {
        let (Some(store), Some(Some(lu))) = (&self.store, self.lus.get_mut(usize::from(index)))
        else {
            return;
        };
        if let Some(bytes) = store.load(&lu.unit.identity.serial) {
            if let Some(pr) = crate::pr::PrState::decode(&bytes) {
                lu.reservations.persistent = pr;
            }
        }
    }

    /// What an I_T nexus loss or reset drops: its SPC-2 reservations and its medium removal
    /// prevention (persistent reservations stay).
    pub(super) fn release_nexus_holds(&mut self, name: &ItNexus, tmf: Option<u64>) {
        for (i, lu) in self.lus.iter_mut().enumerate() {
            let Some(lu) = lu else { continue };
            if lu.reservations.spc2.as_ref() == Some(name) {
                if lu.shared.is_some() {
                    self.changes.push_back(ReservationChange {
                        task: None,
                        tmf,
                        lun: i as u16,
                        nexus: name.clone(),
                        request: ReservationRequest::NexusLost,
                    });
                } else {
                    lu.reservations.spc2 = None;
                }
            }
            lu.prevent.retain(|n| n != name);
        }
    }

    /// PREEMPT AND ABORT: aborts the tasks on `lun` of the nexuses named, except `except`.
    pub(crate) fn abort_nexus_tasks(
        &mut self,
        lun: u16,
        names: &[ItNexus],
        except: Option<TaskId>,
    ) {
        let ids: Vec<NexusId> = self
            .nexus_ids()
            .into_iter()
            .filter(|&n| self.nexus(n).is_ok_and(|x| names.contains(&x.name)))
            .collect();
        // Not `except` (the PREEMPT AND ABORT itself), nor a change to shared reservations
        // under way at their keeper: its outcome is decided there.
        let doomed = self.select_tasks(|t| {
            t.lun == lun && ids.contains(&t.nexus) && t.phase != Phase::Reserving
        });
        let doomed: Vec<TaskId> = doomed.into_iter().filter(|&t| Some(t) != except).collect();
        self.abort_tasks(&doomed, None);
    }
}
