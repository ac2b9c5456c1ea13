//! Unit attentions: established per nexus and unit, reported on the next command (or REQUEST
//! SENSE), and announced at once to the transports that report asynchronous events (SRP's
//! SRP_AER_REQ).

use super::*;

impl Device {
    /// Whether the transport of nexus `id` reports asynchronous events (SRP's SRP_AER_REQ):
    /// from now on each unit attention established for it (a capacity change, a unit added
    /// or removed, reservations preempted, commands cleared by another initiator) is also an
    /// [`Action::UnitAttention`] naming it, so the initiator hears of it without sending a
    /// command. The unit attention stays pending and is reported on the next command as
    /// well: an initiator may ignore the event (Linux's ib_srp logs it and does nothing).
    pub fn report_unit_attentions(&mut self, id: NexusId, on: bool) -> Result<(), DeviceError> {
        self.nexus_mut(id)
            .ok_or(DeviceError::UnknownNexus)?
            .announce = on;
        Ok(())
    }

    /// Establishes a unit attention on `lun` for every nexus but `except`.
    pub(crate) fn unit_attention_all(&mut self, lun: u16, asc: Asc, except: Option<NexusId>) {
        for (i, s) in self.nexuses.iter_mut().enumerate() {
            let me = except.is_some_and(|e| e.index as usize == i && e.generation == s.generation);
            if let (false, Some(n)) = (me, s.value.as_mut()) {
                self.actions.extend(push_ua(n, lun, asc));
            }
        }
    }

    /// Establishes a unit attention on `lun` for every nexus named `name`.
    pub(crate) fn unit_attention_for(&mut self, lun: u16, asc: Asc, name: &ItNexus) {
        for n in self.nexuses.iter_mut().filter_map(|s| s.value.as_mut()) {
            if &n.name == name {
                self.actions.extend(push_ua(n, lun, asc));
            }
        }
    }

    /// Takes the nexus's oldest unit attention on `lun` (REQUEST SENSE reports it).
    pub(crate) fn nexus_ua_pop(&mut self, nexus: NexusId, lun: u16) -> Option<Asc> {
        let n = self.nexus_mut(nexus)?;
        let i = n.unit_attentions.iter().position(|&(l, _)| l == lun)?;
        Some(n.unit_attentions.remove(i).1)
    }
}
