//! ALUA: each unit's target port groups and their access states, whose change every
//! nexus hears as ASYMMETRIC ACCESS STATE CHANGED.

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
}
