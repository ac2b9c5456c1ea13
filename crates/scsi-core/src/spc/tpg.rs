//! REPORT TARGET PORT GROUPS (SPC-4 section 6.37): implicit ALUA with one target port group,
//! active/optimized, holding every target port.

use crate::lu::TargetPort;

/// The parameter data in length-only (`extended` false) or extended header format, before
/// truncation to the allocation length.
pub fn report_target_port_groups(ports: &[TargetPort], extended: bool) -> Vec<u8> {
    let mut d = vec![0u8; if extended { 8 } else { 4 }];
    if extended {
        d[4] = 0x10; // FORMAT TYPE 001b
    }
    let mut groups: Vec<u16> = ports.iter().map(|p| p.port_group).collect();
    groups.sort_unstable();
    groups.dedup();
    for g in groups {
        let members: Vec<&TargetPort> = ports.iter().filter(|p| p.port_group == g).collect();
        // PREF 1, ASYMMETRIC ACCESS STATE active/optimized; only that state is supported
        // (AO_SUP), STATUS CODE 0.
        d.extend_from_slice(&[0x80, 0x01]);
        d.extend_from_slice(&g.to_be_bytes());
        d.extend_from_slice(&[0, 0, 0, members.len() as u8]);
        for p in members {
            d.extend_from_slice(&[0, 0]);
            d.extend_from_slice(&p.relative_port.to_be_bytes());
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
        let d = report_target_port_groups(&[port(1), port(2)], false);
        assert_eq!(
            d,
            [0, 0, 0, 16, 0x80, 0x01, 0, 1, 0, 0, 0, 2, 0, 0, 0, 1, 0, 0, 0, 2]
        );
        let e = report_target_port_groups(&[port(1)], true);
        assert_eq!(&e[..8], &[0, 0, 0, 16, 0x10, 0, 0, 0]);
    }
}
