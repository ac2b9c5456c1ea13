//! Asymmetric logical unit access (SPC-4 section 5.16): target port groups, each in an
//! asymmetric access state, REPORT TARGET PORT GROUPS (section 6.37) and SET TARGET PORT
//! GROUPS (section 6.40). Implicit and explicit ALUA: the target decides the states (a lone
//! target: one group, active/optimized; gateways of one target: one group each, the states
//! their cluster decides), and an initiator may ask for a group to be active/optimized (the
//! cluster then prefers that gateway for the unit; a lone target has nothing else to give).

use crate::lu::TargetPort;
use crate::sense::{Asc, FieldPointer, Sense};

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

/// The state a code of SET TARGET PORT GROUPS asks for: active/optimized,
/// active/non-optimized, standby or unavailable (offline and transitioning cannot be asked).
fn settable(code: u8) -> Option<AccessState> {
    match code {
        0x0 => Some(AccessState::ActiveOptimized),
        0x1 => Some(AccessState::ActiveNonOptimized),
        0x2 => Some(AccessState::Standby),
        0x3 => Some(AccessState::Unavailable),
        _ => None,
    }
}

/// One set target port group descriptor of SET TARGET PORT GROUPS: a group and the state
/// asked for it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TargetPortGroupRequest {
    /// TARGET PORT GROUP.
    pub group: u16,
    /// ASYMMETRIC ACCESS STATE asked.
    pub state: AccessState,
    /// Where the descriptor starts in the parameter list, for the sense's field pointer.
    pub offset: u16,
}

/// The longest SET TARGET PORT GROUPS parameter list taken: the header and a descriptor for
/// each of 1024 groups (a target has one group per gateway).
pub const MAX_SET_TARGET_PORT_GROUPS: u32 = 4 + 4 * 1024;

/// The descriptors of a SET TARGET PORT GROUPS parameter list: a four-byte header, then four
/// bytes per group (state in byte 0 bits 3-0, the group in bytes 2-3). A length that is not
/// the header and whole descriptors is a PARAMETER LIST LENGTH ERROR; a state that cannot be
/// asked, INVALID FIELD IN PARAMETER LIST pointing at it.
pub fn parse_set_target_port_groups(data: &[u8]) -> Result<Vec<TargetPortGroupRequest>, Sense> {
    if data.len() < 4 || (data.len() - 4) % 4 != 0 {
        return Err(Sense::parameter_list_length_error());
    }
    data[4..]
        .chunks_exact(4)
        .enumerate()
        .map(|(i, d)| {
            let offset = (4 + 4 * i) as u16;
            let state = settable(d[0] & 0x0f).ok_or_else(|| {
                Sense::invalid_field_in_parameter_list(FieldPointer::parameter_bit(offset, 3))
            })?;
            Ok(TargetPortGroupRequest {
                group: u16::from_be_bytes([d[2], d[3]]),
                state,
                offset,
            })
        })
        .collect()
}

/// Checks SET TARGET PORT GROUPS `requests` against the groups they would leave (`after`):
/// every group named exists and is asked the state it then has; otherwise INVALID FIELD IN
/// PARAMETER LIST pointing at the first descriptor that is not (an unknown group, or a
/// combination of states the target cannot establish).
pub fn check_set_target_port_groups(
    requests: &[TargetPortGroupRequest],
    after: &[PortGroup],
) -> Result<(), Sense> {
    for r in requests {
        let Some(g) = after.iter().find(|g| g.id == r.group) else {
            return Err(Sense::invalid_field_in_parameter_list(
                FieldPointer::parameter(r.offset + 2),
            ));
        };
        if g.state != r.state {
            return Err(Sense::invalid_field_in_parameter_list(
                FieldPointer::parameter_bit(r.offset, 3),
            ));
        }
    }
    Ok(())
}

/// The one group `requests` ask to be active/optimized, if any; two or more is an invalid
/// combination (INVALID FIELD IN PARAMETER LIST at the second).
pub fn optimized_request(requests: &[TargetPortGroupRequest]) -> Result<Option<u16>, Sense> {
    let mut asked = requests
        .iter()
        .filter(|r| r.state == AccessState::ActiveOptimized);
    let first = asked.next().map(|r| r.group);
    match asked.find(|r| Some(r.group) != first) {
        Some(second) => Err(Sense::invalid_field_in_parameter_list(
            FieldPointer::parameter_bit(second.offset, 3),
        )),
        None => Ok(first),
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

    /// SET TARGET PORT GROUPS: the parameter list's shape, the states that can be asked, and
    /// what a lone target (every group active/optimized) accepts.
    #[test]
    fn set_target_port_groups_parameters_are_checked() {
        let port = |relative_port, port_group| TargetPort {
            relative_port,
            port_group,
            name: String::new(),
            target_name: String::new(),
        };
        let groups = groups_of(&[port(1, 1), port(2, 2)]);
        let list = |ds: &[(u8, u16)]| {
            let mut d = vec![0u8; 4];
            for &(state, group) in ds {
                d.extend_from_slice(&[state, 0]);
                d.extend_from_slice(&group.to_be_bytes());
            }
            d
        };
        let asc = |s: Sense| (s.key, s.asc);
        let parsed = parse_set_target_port_groups(&list(&[(0, 1), (0x80, 2)])).unwrap();
        assert_eq!(
            parsed[1].state,
            AccessState::ActiveOptimized,
            "PREF-like high bits ignored"
        );
        assert_eq!(parsed[1].offset, 8);
        assert_eq!(check_set_target_port_groups(&parsed, &groups), Ok(()));
        assert!(parse_set_target_port_groups(&[]).is_err());
        assert_eq!(
            asc(parse_set_target_port_groups(&[0; 6]).unwrap_err()),
            asc(Sense::parameter_list_length_error())
        );
        // Offline and transitioning cannot be asked.
        let e = parse_set_target_port_groups(&list(&[(0xe, 1)])).unwrap_err();
        assert_eq!(e.asc, Asc::INVALID_FIELD_IN_PARAMETER_LIST);
        // An unknown group, and a state the lone target cannot give.
        let unknown = parse_set_target_port_groups(&list(&[(0, 9)])).unwrap();
        assert!(check_set_target_port_groups(&unknown, &groups).is_err());
        let standby = parse_set_target_port_groups(&list(&[(2, 1)])).unwrap();
        assert!(check_set_target_port_groups(&standby, &groups).is_err());
        // One group optimized at most.
        let two = parse_set_target_port_groups(&list(&[(0, 1), (0, 2)])).unwrap();
        assert!(optimized_request(&two).is_err());
        assert_eq!(optimized_request(&parsed[..1]), Ok(Some(1)));
        assert_eq!(optimized_request(&standby), Ok(None));
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
