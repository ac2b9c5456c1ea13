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

/// Whether a command is processed through a target port group in `state` that is not
/// active (the others end with NOT READY and [`AccessState::not_ready`]).
///
/// In standby, what SPC-4 5.16.2.4.4 lists (INQUIRY, LOG SELECT/SENSE, MODE SELECT/SENSE,
/// REPORT LUNS, RECEIVE/SEND DIAGNOSTIC, REPORT and SET TARGET PORT GROUPS, REQUEST SENSE,
/// PERSISTENT RESERVE IN/OUT, READ/WRITE BUFFER in echo mode), and READ CAPACITY(10) and (16),
/// as Linux's target answers them: an initiator that scans the path while it is standby
/// (Linux's sd) must learn the unit's size there, or it records the disk as 0 blocks and
/// fails every write after a failover to that path. Unavailable, transitioning or offline:
/// only what asks about the path (SPC-4 5.16.2.4.5), INQUIRY, REPORT LUNS, REPORT and SET
/// TARGET PORT GROUPS, REQUEST SENSE, the echo buffer, and READ CAPACITY for the same reason.
pub fn processed_in(state: AccessState, cdb: &[u8; 16]) -> bool {
    let service_action = cdb[1] & 0x1f;
    let echo_buffer = matches!(cdb[0], 0x3b | 0x3c) && cdb[1] & 0x1f == 0x0a;
    let about_the_path = matches!(cdb[0], 0x03 | 0x12 | 0xa0 | 0x25)
        // REPORT TARGET PORT GROUPS, REPORT SUPPORTED OPERATION CODES and TMFs; SET
        // TARGET PORT GROUPS; READ CAPACITY(16).
        || (cdb[0] == 0xa3 && matches!(service_action, 0x0a | 0x0c | 0x0d))
        || (cdb[0] == 0xa4 && service_action == 0x0a)
        || (cdb[0] == 0x9e && service_action == 0x10)
        || echo_buffer;
    match state {
        AccessState::ActiveOptimized | AccessState::ActiveNonOptimized => true,
        AccessState::Standby => {
            about_the_path
                || matches!(
                    cdb[0],
                    0x4c | 0x4d | 0x15 | 0x55 | 0x1a | 0x5a | 0x1c | 0x1d | 0x5e | 0x5f
                )
        }
        AccessState::Unavailable | AccessState::Transitioning | AccessState::Offline => {
            about_the_path
        }
    }
}

/// The parameter data in length-only (`extended` false) or extended header format, before
/// truncation to the allocation length. `all_states`: the target may put groups in every
/// state (gateways of one target: standby with a unit's `standby` policy), not only
/// active/optimized.
pub fn report_target_port_groups(
    groups: &[PortGroup],
    extended: bool,
    all_states: bool,
) -> Vec<u8> {
    let mut d = vec![0u8; if extended { 8 } else { 4 }];
    if extended {
        d[4] = 0x10; // FORMAT TYPE 001b
    }
    // T_SUP, O_SUP, U_SUP, S_SUP, AN_SUP and AO_SUP; or AO_SUP alone.
    let supported = if all_states {
        0x80 | 0x40 | 0x08 | 0x04 | 0x02 | 0x01
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

    /// What a standby and an unavailable path answer: SPC-4's lists and READ CAPACITY
    /// (Linux sizes the disk at scan, on every path); media access never.
    #[test]
    fn standby_and_unavailable_paths_process_what_spc_lists() {
        let cdb = |bytes: &[u8]| {
            let mut c = [0u8; 16];
            c[..bytes.len()].copy_from_slice(bytes);
            c
        };
        let read_capacity_16 = cdb(&[0x9e, 0x10]);
        let rtpg = cdb(&[0xa3, 0x0a]);
        let both = [
            cdb(&[0x12]),
            cdb(&[0xa0]),
            cdb(&[0x03]),
            cdb(&[0x25]),
            read_capacity_16,
            rtpg,
            cdb(&[0x3c, 0x0a]),
        ];
        let standby_only = [
            cdb(&[0x1a]),
            cdb(&[0x5a]),
            cdb(&[0x15]),
            cdb(&[0x4d]),
            cdb(&[0x5e]),
            cdb(&[0x5f]),
            cdb(&[0x1c]),
        ];
        let never = [
            cdb(&[0x28]),
            cdb(&[0x2a]),
            cdb(&[0x00]),
            cdb(&[0x35]),
            cdb(&[0x93]),
            cdb(&[0x3c, 0x02]),
            cdb(&[0x9e, 0x12]),
        ];
        for c in both {
            assert!(processed_in(AccessState::Standby, &c), "{:02x}", c[0]);
            assert!(processed_in(AccessState::Unavailable, &c), "{:02x}", c[0]);
        }
        for c in standby_only {
            assert!(processed_in(AccessState::Standby, &c), "{:02x}", c[0]);
            assert!(!processed_in(AccessState::Unavailable, &c), "{:02x}", c[0]);
        }
        for c in never {
            for state in [
                AccessState::Standby,
                AccessState::Unavailable,
                AccessState::Transitioning,
            ] {
                assert!(!processed_in(state, &c), "{:02x} {state:?}", c[0]);
            }
            assert!(processed_in(AccessState::ActiveNonOptimized, &c));
        }
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
        assert_eq!(&d[4..8], &[0x80, 0xcf, 0, 1]);
        assert_eq!(&d[16..20], &[0x01, 0xcf, 0, 2]);
        assert_eq!(&d[28..32], &[0x03, 0xcf, 0, 3]);
        assert_eq!(&d[36..40], &[0, 0, 0, 3]);
    }
}
