//! Asymmetric Namespace Access (NVMe base specification, 8.1 "Asymmetric Namespace Access
//! Reporting"): every namespace belongs to an ANA group, and every group has one state as the
//! controllers of this subsystem report it: optimized, non-optimized, inaccessible,
//! persistent loss, or change.
//!
//! A gateway alone reports every group optimized. Several gateways exporting one subsystem
//! each report, through their own controllers, the state its shell derives from which
//! gateways are alive and the namespace's path policy (the same derivation ALUA's port groups
//! have); a host with native multipath then sends I/O where its group is optimized. The
//! machine ([`crate::controller::Subsystem::set_ana_state`]) keeps the states and their
//! change counts here, tells every controller's host through the ANA log page and its notice,
//! and refuses I/O to a namespace its group makes unreachable with the status the state names
//! (so the host retries on another path).

use std::collections::BTreeMap;

use crate::log_page::{self, AnaGroup};
use crate::status::Status;

/// The group a namespace is in unless its shell says otherwise.
pub const DEFAULT_GROUP: u32 = 1;
/// The largest ANA group identifier (ANAGRPMAX): room for one group per port group of a
/// cluster of gateways (1 to 65535) and its standby variant.
pub const MAX_GROUP_ID: u32 = 2 * 65535 + 1;
/// How many ANA groups a controller reports at most (NANAGRPID): one per namespace at most
/// (the largest NSID here is 1024).
pub const MAX_GROUPS: u32 = 1024;
/// ANATT: seconds a host waits in the change state before it counts a path as lost.
pub const TRANSITION_TIME: u8 = 10;

/// A group's state through this subsystem's controllers (ANAS).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum AnaState {
    /// I/O goes here first.
    Optimized,
    /// Reachable, at a cost (another gateway is optimized).
    NonOptimized,
    /// Not reachable through these controllers now (another path is).
    Inaccessible,
    /// Not reachable through these controllers again.
    PersistentLoss,
    /// Moving between states: I/O is retried after a while.
    Change,
}

impl AnaState {
    /// ANAS as the log page says it.
    pub fn code(self) -> u8 {
        match self {
            AnaState::Optimized => 0x01,
            AnaState::NonOptimized => 0x02,
            AnaState::Inaccessible => 0x03,
            AnaState::PersistentLoss => 0x04,
            AnaState::Change => 0x0f,
        }
    }

    /// The status an I/O command to a namespace in this state ends with, when it cannot run.
    pub fn refusal(self) -> Option<Status> {
        match self {
            AnaState::Optimized | AnaState::NonOptimized => None,
            AnaState::Inaccessible => Some(Status::ANA_INACCESSIBLE),
            AnaState::PersistentLoss => Some(Status::ANA_PERSISTENT_LOSS),
            AnaState::Change => Some(Status::ANA_TRANSITION),
        }
    }
}

/// The states of a subsystem's ANA groups and their change counts.
#[derive(Debug, Clone, Default)]
pub struct AnaGroups {
    /// Groups whose state was set, with the change count of their last change; a group not
    /// here is optimized.
    states: BTreeMap<u32, (AnaState, u64)>,
    /// The log page's change count: moves on with every change of any group's state.
    change_count: u64,
}

impl AnaGroups {
    /// The state of `group`.
    pub fn state(&self, group: u32) -> AnaState {
        self.states
            .get(&group)
            .map_or(AnaState::Optimized, |(s, _)| *s)
    }

    /// Sets `group`'s state; whether that changed it.
    pub fn set(&mut self, group: u32, state: AnaState) -> bool {
        if self.state(group) == state {
            return false;
        }
        self.change_count += 1;
        self.states.insert(group, (state, self.change_count));
        true
    }

    /// The log page's change count.
    pub fn change_count(&self) -> u64 {
        self.change_count
    }

    /// The ANA log page for the attached namespaces `namespaces` (NSID, group), each group
    /// that has one once, in group order; with `groups_only` (RGO) without their NSIDs.
    pub fn log_page(
        &self,
        namespaces: impl IntoIterator<Item = (u32, u32)>,
        groups_only: bool,
    ) -> Vec<u8> {
        let mut by_group: BTreeMap<u32, Vec<u32>> = BTreeMap::new();
        for (nsid, group) in namespaces {
            by_group.entry(group).or_default().push(nsid);
        }
        let groups: Vec<AnaGroup> = by_group
            .into_iter()
            .map(|(id, nsids)| {
                let (state, change_count) = self
                    .states
                    .get(&id)
                    .copied()
                    .unwrap_or((AnaState::Optimized, 0));
                AnaGroup {
                    id,
                    state: state.code(),
                    change_count,
                    nsids,
                }
            })
            .collect();
        log_page::ana(self.change_count, &groups, groups_only)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn groups_are_optimized_until_set_and_each_change_is_counted() {
        let mut g = AnaGroups::default();
        assert_eq!(g.state(7), AnaState::Optimized);
        assert!(!g.set(7, AnaState::Optimized), "no change");
        assert_eq!(g.change_count(), 0);
        assert!(g.set(7, AnaState::Inaccessible));
        assert!(!g.set(7, AnaState::Inaccessible));
        assert!(g.set(8, AnaState::NonOptimized));
        assert_eq!(g.change_count(), 2);
        assert_eq!(g.state(7).refusal(), Some(Status::ANA_INACCESSIBLE));
        assert_eq!(g.state(8).refusal(), None);
        assert_eq!(AnaState::Change.refusal(), Some(Status::ANA_TRANSITION));
        // Namespaces 1 and 3 in group 7, 2 in group 8, 4 in a group never set.
        let page = g.log_page([(1, 7), (2, 8), (3, 7), (4, 1)], false);
        assert_eq!(u64::from_le_bytes(page[..8].try_into().unwrap()), 2);
        assert_eq!(u16::from_le_bytes([page[8], page[9]]), 3, "three groups");
        // Group 1 first: optimized, change count 0, NSID 4.
        let d = &page[16..];
        assert_eq!(u32::from_le_bytes(d[..4].try_into().unwrap()), 1);
        assert_eq!(u32::from_le_bytes(d[4..8].try_into().unwrap()), 1);
        assert_eq!(d[16], 0x01);
        assert_eq!(u32::from_le_bytes(d[32..36].try_into().unwrap()), 4);
        // Then group 7: inaccessible, changed first (count 1), NSIDs 1 and 3.
        let d = &d[36..];
        assert_eq!(u32::from_le_bytes(d[..4].try_into().unwrap()), 7);
        assert_eq!(u32::from_le_bytes(d[4..8].try_into().unwrap()), 2);
        assert_eq!(u64::from_le_bytes(d[8..16].try_into().unwrap()), 1);
        assert_eq!(d[16], 0x03);
        assert_eq!(&d[32..40], &[1, 0, 0, 0, 3, 0, 0, 0]);
        // Groups only: 16 bytes of header and 32 per group.
        assert_eq!(g.log_page([(1, 7), (2, 8)], true).len(), 16 + 2 * 32);
    }
}
