//! Task management: ABORT TASK and ABORT TASK SET, CLEAR TASK SET, LOGICAL UNIT and target
//! resets, I_T nexus reset, QUERY TASK; each answered once the tasks it ends are gone.

use super::*;

impl Device {
    /// Answers the task management functions that wait for nothing any more.
    pub(super) fn finish_tmfs(&mut self) {
        let mut i = 0;
        while i < self.tmfs.len() {
            if self.tmfs[i].waiting.is_empty() && self.tmfs[i].keeper == 0 {
                let tmf = self.tmfs.remove(i);
                self.actions.push_back(Action::TaskManagementDone {
                    nexus: tmf.nexus,
                    reference: tmf.reference,
                    response: tmf.response,
                });
            } else {
                i += 1;
            }
        }
    }

    /// Tasks matching `f`, oldest first.
    pub(super) fn select_tasks(&self, f: impl Fn(&Task) -> bool) -> Vec<TaskId> {
        let mut v: Vec<(u64, TaskId)> = self
            .tasks
            .iter()
            .enumerate()
            .filter_map(|(i, s)| {
                let t = s.value.as_ref()?;
                f(t).then_some((
                    t.seq,
                    TaskId {
                        index: i as u32,
                        generation: s.generation,
                    },
                ))
            })
            .collect();
        v.sort_unstable_by_key(|e| e.0);
        v.into_iter().map(|e| e.1).collect()
    }

    /// Aborts tasks: those not in the backend end now; the others when their operation
    /// completes. Returns the latter, which a task management function waits for. `by` is
    /// the nexus on whose behalf the tasks are aborted: other nexuses' tasks leave them a
    /// COMMANDS CLEARED BY ANOTHER INITIATOR unit attention (TAS is zero).
    pub(super) fn abort_tasks(&mut self, ids: &[TaskId], by: Option<NexusId>) -> Vec<TaskId> {
        // Delegated tasks learn of their first abort only: they end at their transport.
        let mut first = Vec::with_capacity(ids.len());
        for &id in ids {
            if let Ok(t) = self.task_mut(id) {
                first.push(!t.aborted);
                t.aborted = true;
            } else {
                first.push(false);
            }
        }
        let mut in_flight = Vec::new();
        for (&id, first) in ids.iter().zip(first) {
            let Ok(t) = self.task(id) else { continue };
            let (nexus, lun, tag, phase) = (t.nexus, t.lun, t.tag, t.phase);
            if by.is_some_and(|b| b != nexus) {
                let announced = self
                    .nexus_mut(nexus)
                    .and_then(|n| push_ua(n, lun, Asc::COMMANDS_CLEARED_BY_ANOTHER_INITIATOR));
                self.actions.extend(announced);
            }
            if phase == Phase::Delegated {
                in_flight.push(id);
                if first {
                    self.actions.push_back(Action::Aborted { task: id, tag });
                }
            } else if matches!(phase, Phase::Backend | Phase::Reserving | Phase::Draining) {
                in_flight.push(id);
            } else {
                self.end(id, Some(Action::Aborted { task: id, tag }));
            }
        }
        in_flight
    }

    /// Starts a task management function; [`Action::TaskManagementDone`] answers it.
    pub fn task_management(
        &mut self,
        nexus: NexusId,
        lun: u64,
        function: TmfFunction,
        reference: u64,
    ) -> Result<(), DeviceError> {
        let name = self.nexus(nexus)?.name.clone();
        let index = lun_index(lun).filter(|&i| self.lu(i).is_some());
        let mut response = TmfResponse::Complete;
        let needs_lu = !matches!(
            function,
            TmfFunction::ItNexusReset | TmfFunction::TargetWarmReset
        );
        let waiting = match (function, index) {
            (_, None) if needs_lu => {
                response = TmfResponse::IncorrectLun;
                Vec::new()
            }
            (TmfFunction::AbortTask(tag), Some(l)) => {
                let ids = self.select_tasks(|t| t.nexus == nexus && t.lun == l && t.tag == tag);
                if ids.is_empty() {
                    response = TmfResponse::TaskNotFound;
                }
                self.abort_tasks(&ids, Some(nexus))
            }
            (TmfFunction::AbortTaskSet, Some(l)) => {
                let ids = self.select_tasks(|t| t.nexus == nexus && t.lun == l);
                self.abort_tasks(&ids, Some(nexus))
            }
            (TmfFunction::ClearTaskSet, Some(l)) => {
                let ids = self.select_tasks(|t| t.lun == l);
                self.abort_tasks(&ids, Some(nexus))
            }
            (TmfFunction::ClearAca, Some(_)) => Vec::new(),
            (TmfFunction::LogicalUnitReset, Some(l)) => {
                let ids = self.select_tasks(|t| t.lun == l);
                let w = self.abort_tasks(&ids, None);
                self.reset_lu(l, &name, reference);
                w
            }
            (TmfFunction::ItNexusReset, _) => {
                let ids = self.select_tasks(|t| t.nexus == nexus);
                let w = self.abort_tasks(&ids, None);
                self.release_nexus_holds(&name, Some(reference));
                for l in self.luns() {
                    let announced = self
                        .nexus_mut(nexus)
                        .and_then(|n| push_ua(n, l, Asc::I_T_NEXUS_LOSS));
                    self.actions.extend(announced);
                }
                w
            }
            (TmfFunction::TargetWarmReset, _) => {
                let ids = self.select_tasks(|_| true);
                let w = self.abort_tasks(&ids, None);
                for l in self.luns() {
                    self.reset_lu(l, &name, reference);
                }
                w
            }
            (TmfFunction::QueryTask(tag), Some(l)) => {
                if self
                    .select_tasks(|t| t.nexus == nexus && t.lun == l && t.tag == tag && !t.aborted)
                    .is_empty()
                {
                    response = TmfResponse::Complete
                } else {
                    response = TmfResponse::Succeeded(None)
                }
                Vec::new()
            }
            (TmfFunction::QueryTaskSet, Some(l)) => {
                if !self
                    .select_tasks(|t| t.nexus == nexus && t.lun == l && !t.aborted)
                    .is_empty()
                {
                    response = TmfResponse::Succeeded(None)
                }
                Vec::new()
            }
            (TmfFunction::QueryAsynchronousEvent, Some(l)) => {
                let n = self.nexus(nexus)?;
                if let Some(&(_, asc)) = n.unit_attentions.iter().find(|&&(x, _)| x == l) {
                    response =
                        TmfResponse::Succeeded(Some([SenseKey::UnitAttention as u8, asc.0, asc.1]));
                }
                Vec::new()
            }
            (_, None) => Vec::new(),
        };
        // A reset of a unit whose reservations are shared is answered once every server of
        // the unit has reset it too.
        let keeper = self
            .changes
            .iter()
            .filter(|c| c.tmf == Some(reference))
            .count();
        if waiting.is_empty() && keeper == 0 {
            self.actions.push_back(Action::TaskManagementDone {
                nexus,
                reference,
                response,
            });
        } else {
            self.tmfs.push(PendingTmf {
                nexus,
                reference,
                response,
                waiting,
                keeper,
            });
        }
        Ok(())
    }

    /// LOGICAL UNIT RESET's effects on the unit's state (SAM-5 section 6.3.3): the SPC-2
    /// reservation and medium removal prevention go, mode parameters return to their defaults,
    /// and every nexus gets a unit attention (persistent reservations stay).
    /// With shared reservations the reset goes to the keeper too, which has every other
    /// device server serving the unit reset it as well (its SPC-2 reservation is shared
    /// state; its tasks and unit attentions are each server's).
    pub(super) fn reset_lu(&mut self, lun: u16, by: &ItNexus, tmf: u64) {
        if let Some(lu) = self.lu_mut(lun) {
            if lu.shared.is_none() {
                lu.reservations.spc2 = None;
            } else {
                self.changes.push_back(ReservationChange {
                    task: None,
                    tmf: Some(tmf),
                    lun,
                    nexus: by.clone(),
                    request: ReservationRequest::Reset,
                });
            }
        }
        self.reset_lu_state(lun);
    }

    /// What a LOGICAL UNIT RESET resets of a unit here, beside its reservations.
    pub(super) fn reset_lu_state(&mut self, lun: u16) {
        if let Some(lu) = self.lu_mut(lun) {
            lu.prevent.clear();
            lu.stopped = false;
            lu.d_sense = false;
        }
        self.unit_attention_all(lun, Asc::BUS_DEVICE_RESET_OCCURRED, None);
    }
}
