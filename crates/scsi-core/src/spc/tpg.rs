//! Asymmetric logical unit access (SPC-4 section 5.16): target port groups, each in an
//! asymmetric access state, and REPORT TARGET PORT GROUPS (section 6.37). Implicit ALUA only:
//! the target decides the states (a lone target: one group, active/optimized; gateways of one
//! target: one group each, the states their cluster decides).

use crate::lu::TargetPort;
use crate::sense::Asc;

/// ASYMMETRIC ACCESS STATE of a target port group.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AccessState {
    /// Active/optimized: the preferred path.
    ActiveOptimized,
    /// Active/non-optimized: works, at some cost.
    ActiveNonOptimized,
    /// Standby: only commands that ask about the path.
    Standby,
    /// Unavailable: the group cannot reach the unit (a gateway that is down or fenced).
    Unavailable,
    /// Offline: the ports are gone.
    Offline,
    /// Transitioning between states.
    Transitioning,
}

impl AccessState {
    /// Its name as SPC-4 writes it ("active/optimized", "standby"), for logs and admin tools.
    pub fn name(self) -> &'static str {
        match self {
            AccessState::ActiveOptimized => "active/optimized",
            AccessState::ActiveNonOptimized => "active/non-optimized",
            AccessState::Standby => "standby",
            AccessState::Unavailable => "unavailable",
            AccessState::Offline => "offline",
            AccessState::Transitioning => "transitioning",
        }
    }

    /// The four-bit code.
    pub fn code(self) -> u8 {
        match self {
            AccessState::ActiveOptimized => 0x0,
            AccessState::ActiveNonOptimized => 0x1,
            AccessState::Standby => 0x2,
            AccessState::Unavailable => 0x3,
            AccessState::Offline => 0xe,
            AccessState::Transitioning => 0xf,
        }
    }

    /// Whether commands that access the medium run through a port in this state.
    pub fn is_active(self) -> bool {
        matches!(
            self,
            AccessState::ActiveOptimized | AccessState::ActiveNonOptimized
        )
    }

    /// The NOT READY additional sense for a command refused in this state.
    pub fn not_ready(self) -> Asc {
        match self {
            AccessState::Standby => Asc::TARGET_PORT_IN_STANDBY_STATE,
            AccessState::Transitioning => Asc::ASYMMETRIC_ACCESS_STATE_TRANSITION,
            _ => Asc::TARGET_PORT_IN_UNAVAILABLE_STATE,
        }
    }
}

/// A target port group as REPORT TARGET PORT GROUPS describes it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PortGroup {
    /// TARGET PORT GROUP.
    pub id: u16,
    /// Its asymmetric access state for the unit.
    pub state: AccessState,
    /// PREF: the group the target prefers.
    pub preferred: bool,
    /// Relative target port identifiers of its ports.
    pub ports: Vec<u16>,
}

/// The groups of a lone target: its ports' groups, each active/optimized and preferred.
pub fn groups_of(ports: &[TargetPort]) -> Vec<PortGroup> {
    let mut groups: Vec<PortGroup> = Vec::new();
    for p in ports {
        match groups.iter_mut().find(|g| g.id == p.port_group) {
            Some(g) => g.ports.push(p.relative_port),
            None => groups.push(PortGroup {
                id: p.port_group,
                state: AccessState::ActiveOptimized,
                preferred: true,
                ports: vec![p.relative_port],
            }),
        }
    }
    groups.sort_unstable_by_key(|g| g.id);
    groups
}

/// The parameter data in length-only (`extended` false) or extended header format, before
/// truncation to the allocation length. `all_states`: the target may put groups in every
/// state but standby (gateways of one target), not only active/optimized.
pub fn report_target_port_groups(
    groups: &[PortGroup],
    extended: bool,
    all_states: bool,
) -> Vec<u8> {
    let mut d = vec![0u8; if extended { 8 } else { 4 }];
    if extended {
        d[4] = 0x10; // FORMAT TYPE 001b
    }
    // T_SUP, O_SUP, U_SUP, AN_SUP and AO_SUP; or AO_SUP alone.
    let supported = if all_states {
        0x80 | 0x40 | 0x08 | 0x02 | 0x01
    } else {
        0x01
    };
    for g in groups {
        d.push(u8::from(g.preferred) << 7 | g.state.code());
        d.push(supported);
        d.extend_from_slice(&g.id.to_be_bytes());
        // STATUS CODE 0 (no status available), TARGET PORT COUNT.
        d.extend_from_slice(&[0, 0, 0, g.ports.len().min(255) as u8]);
        for &p in g.ports.iter().take(255) {
            d.extend_from_slice(&[0, 0]);
            d.extend_from_slice(&p.to_be_bytes());
        }
    }
    let len = (d.len() - 4) as u32;
    d[..4].copy_from_slice(&len.to_be_bytes());
    d
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_group_two_ports() {
        let port = |relative_port| TargetPort {
            relative_port,
            port_group: 1,
            name: String::new(),
            target_name: String::new(),
        };
        let groups = groups_of(&[port(1), port(2)]);
        let d = report_target_port_groups(&groups, false, false);
        assert_eq!(
            d,
            [0, 0, 0, 16, 0x80, 0x01, 0, 1, 0, 0, 0, 2, 0, 0, 0, 1, 0, 0, 0, 2]
        );
        let e = report_target_port_groups(&groups_of(&[port(1)]), true, false);
        assert_eq!(&e[..8], &[0, 0, 0, 16, 0x10, 0, 0, 0]);
    }

    #[test]
    fn gateways_report_each_group_in_its_state() {
        let groups = [
            PortGroup {
                id: 1,
                state: AccessState::ActiveOptimized,
                preferred: true,
                ports: vec![1],
            },
            PortGroup {
                id: 2,
                state: AccessState::ActiveNonOptimized,
                preferred: false,
                ports: vec![2],
            },
            PortGroup {
                id: 3,
                state: AccessState::Unavailable,
                preferred: false,
                ports: vec![3],
            },
        ];
        let d = report_target_port_groups(&groups, false, true);
        assert_eq!(u32::from_be_bytes(d[..4].try_into().unwrap()), 36);
        assert_eq!(&d[4..8], &[0x80, 0xcb, 0, 1]);
        assert_eq!(&d[16..20], &[0x01, 0xcb, 0, 2]);
        assert_eq!(&d[28..32], &[0x03, 0xcb, 0, 3]);
        assert_eq!(&d[36..40], &[0, 0, 0, 3]);
    }
}
