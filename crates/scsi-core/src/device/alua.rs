//! ALUA: each unit's target port groups and their access states, whose change every
//! nexus hears as ASYMMETRIC ACCESS STATE CHANGED; SET TARGET PORT GROUPS, decided here for
//! a lone target's groups or by a keeper for shared ones.

use crate::spc::tpg;

use super::*;

impl Device {
    /// Sets the target port groups of unit `lun` and their asymmetric access states (implicit
    /// ALUA decided by the target, e.g. by its cluster of gateways). When a group's state
    /// changes, every nexus gets ASYMMETRIC ACCESS STATE CHANGED for the unit. Commands that
    /// arrive through a port whose group is not active are refused with NOT READY, but those
    /// that ask about the path (INQUIRY, REPORT LUNS, REPORT TARGET PORT GROUPS, REQUEST
    /// SENSE). Returns whether a state changed.
    pub fn set_port_groups(
        &mut self,
        lun: u16,
        groups: Vec<PortGroup>,
    ) -> Result<bool, DeviceError> {
        let ports = self.ports.clone();
        let lu = self.lu_mut(lun).ok_or(DeviceError::Lun(lun))?;
        let before = match &lu.port_groups {
            Some(g) => g.clone(),
            None => crate::spc::tpg::groups_of(&ports),
        };
        let state_of = |gs: &[PortGroup], id: u16| gs.iter().find(|g| g.id == id).map(|g| g.state);
        let changed = groups
            .iter()
            .any(|g| state_of(&before, g.id) != Some(g.state))
            || before.iter().any(|g| state_of(&groups, g.id).is_none());
        lu.port_groups = Some(groups);
        if changed {
            self.unit_attention_all(lun, Asc::ASYMMETRIC_ACCESS_STATE_CHANGED, None);
        }
        Ok(changed)
    }

    /// The target port groups of unit `lun` as REPORT TARGET PORT GROUPS reports them.
    pub fn port_groups(&self, lun: u16) -> Option<Vec<PortGroup>> {
        let lu = self.lu(lun)?;
        Some(match &lu.port_groups {
            Some(g) => g.clone(),
            None => crate::spc::tpg::groups_of(&self.ports),
        })
    }

    /// Unit `lun`'s port groups are decided by a keeper (a cluster of gateways): SET TARGET
    /// PORT GROUPS goes to it as a [`PortGroupsChange`] ([`Device::poll_port_groups_change`])
    /// and ends when it says ([`Device::port_groups_change_done`]).
    pub fn share_port_groups(&mut self, lun: u16) -> Result<(), DeviceError> {
        self.lu_mut(lun)
            .ok_or(DeviceError::Lun(lun))?
            .port_groups_shared = true;
        Ok(())
    }

    /// The next SET TARGET PORT GROUPS for the port groups' keeper.
    pub fn poll_port_groups_change(&mut self) -> Option<PortGroupsChange> {
        self.port_groups_changes.pop_front()
    }

    /// Whether a SET TARGET PORT GROUPS waits for the keeper.
    pub fn has_port_groups_changes(&self) -> bool {
        !self.port_groups_changes.is_empty()
    }

    /// The keeper decided SET TARGET PORT GROUPS task `task` (and, when it succeeded, gave
    /// this server the new groups): GOOD, or the sense.
    pub fn port_groups_change_done(
        &mut self,
        task: TaskId,
        result: Result<(), Sense>,
    ) -> Result<(), DeviceError> {
        self.reservation_done(task, result.map_err(PrError::Sense))
    }

    /// SET TARGET PORT GROUPS with parameter list `data`: to the keeper for shared groups;
    /// for the device's own (every group active/optimized, nothing else to give), GOOD when
    /// each descriptor asks what its group is.
    pub(crate) fn set_target_port_groups(
        &mut self,
        id: TaskId,
        lun: u16,
        data: &[u8],
    ) -> Result<Step, TaskError> {
        let requests = tpg::parse_set_target_port_groups(data)?;
        let shared = self
            .lu(lun)
            .ok_or(Sense::invalid_opcode())?
            .port_groups_shared;
        if requests.is_empty() {
            return Ok(Step::Done(Reply::Good));
        }
        if shared {
            tpg::optimized_request(&requests)?;
            self.port_groups_changes.push_back(PortGroupsChange {
                task: id,
                lun,
                requests,
            });
            return Ok(Step::Reserving);
        }
        let groups = self.port_groups(lun).ok_or(Sense::invalid_opcode())?;
        tpg::check_set_target_port_groups(&requests, &groups)?;
        Ok(Step::Done(Reply::Good))
    }
}
