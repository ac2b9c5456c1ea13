//! The gateways of a cluster as its gateways object lists them, which of them are alive, and
//! the ALUA port groups that follow for a unit.

use scsi_core::spc::tpg::{AccessState, PortGroup};

/// What a gateway's SRP port adds to its port group to make its relative target port
/// identifier: `SRP_PORT_OFFSET + port_group`. Its iSCSI (and iSER) port is `port_group`
/// itself, so every port of every gateway has an identifier of its own, and a gateway that
/// serves SRP takes port groups 1 to 32767.
pub const SRP_PORT_OFFSET: u16 = 0x8000;

/// The relative target port identifier of the SRP port of the gateway with `port_group`;
/// `None` above 32767.
pub fn srp_relative_port(port_group: u16) -> Option<u16> {
    (port_group > 0 && port_group < SRP_PORT_OFFSET).then(|| SRP_PORT_OFFSET + port_group)
}

/// The addresses of flag `prefix` (`nvme=`) among a line's words `w`, after its addresses.
fn flagged(w: &[&str], prefix: &str) -> Vec<std::net::SocketAddr> {
    w.iter()
        .skip(6)
        .find_map(|f| f.strip_prefix(prefix))
        .into_iter()
        .flat_map(|p| p.split(','))
        .filter_map(|a| a.parse().ok())
        .collect()
}

/// One gateway as the cluster's gateways object lists it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Member {
    /// `cluster.gateway`.
    pub gateway: String,
    /// `cluster.port_group`.
    pub port_group: u16,
    /// Its iSCSI portals.
    pub portals: Vec<std::net::SocketAddr>,
    /// Its NVMe/TCP portals (a flag `nvme=ADDR,ADDR` after the addresses; a gateway that
    /// does not know the flag skips it).
    pub nvme_portals: Vec<std::net::SocketAddr>,
    /// Its NVMe/RDMA portals (a flag `nvme-rdma=ADDR,ADDR`, as `nvme=`).
    pub nvme_rdma_portals: Vec<std::net::SocketAddr>,
    /// Its object-store client instance id (how notify outcomes name it).
    pub instance: u64,
    /// The addresses of its object-store clients (the cluster session's and the images'):
    /// what fencing blocklists.
    pub addresses: Vec<String>,
    /// It stopped as planned (SIGTERM) and said so: down, but never fenced for it.
    pub left: bool,
    /// It serves SRP ports: its port group has the port [`srp_relative_port`] names too.
    pub srp: bool,
}

impl Member {
    /// Its line in the gateways object.
    pub fn line(&self) -> String {
        let portals: Vec<String> = self.portals.iter().map(|p| p.to_string()).collect();
        let portals = if portals.is_empty() {
            "-".to_string()
        } else {
            portals.join(",")
        };
        let addresses = if self.addresses.is_empty() {
            "-".to_string()
        } else {
            self.addresses.join(",")
        };
        let flag = |name: &str, portals: &[std::net::SocketAddr]| {
            if portals.is_empty() {
                return String::new();
            }
            let p: Vec<String> = portals.iter().map(|p| p.to_string()).collect();
            format!(" {name}={}", p.join(","))
        };
        let nvme = flag("nvme", &self.nvme_portals) + &flag("nvme-rdma", &self.nvme_rdma_portals);
        format!(
            "gateway {} {} {portals} {} {addresses}{}{}{nvme}\n",
            self.gateway,
            self.port_group,
            self.instance,
            if self.left { " left" } else { "" },
            if self.srp { " srp" } else { "" }
        )
    }

    /// The relative target port identifiers of its ports: its iSCSI port, and its SRP port
    /// when it serves one.
    pub fn relative_ports(&self) -> Vec<u16> {
        let srp = self
            .srp
            .then(|| srp_relative_port(self.port_group))
            .flatten();
        std::iter::once(self.port_group).chain(srp).collect()
    }

    /// A line of the gateways object; `None` when it is not one.
    pub fn parse(line: &str) -> Option<Member> {
        let w: Vec<&str> = line.split_whitespace().collect();
        if w.first() != Some(&"gateway") {
            return None;
        }
        Some(Member {
            gateway: w.get(1)?.to_string(),
            port_group: w.get(2)?.parse().ok()?,
            portals: w
                .get(3)?
                .split(',')
                .filter_map(|a| a.parse().ok())
                .collect(),
            instance: w.get(4)?.parse().ok()?,
            addresses: w
                .get(5)?
                .split(',')
                .filter(|a| *a != "-")
                .map(str::to_string)
                .collect(),
            // Flags after the addresses, in any order (a gateway that knows none of them
            // reads the first as `left` only when it is).
            left: w.iter().skip(6).any(|f| *f == "left"),
            srp: w.iter().skip(6).any(|f| *f == "srp"),
            nvme_portals: flagged(&w, "nvme="),
            nvme_rdma_portals: flagged(&w, "nvme-rdma="),
        })
    }

    /// Every member the gateways object's bytes list (lines that do not parse are skipped).
    pub fn parse_all(bytes: &[u8]) -> Vec<Member> {
        String::from_utf8_lossy(bytes)
            .lines()
            .filter_map(Member::parse)
            .collect()
    }

    /// The gateways object `bytes` rewritten with `members` (in port group order), the
    /// preferences of gateways still listed kept after them: how a gateway lists itself,
    /// leaves or forgets another without losing an initiator's choice.
    pub fn rewrite_all(bytes: &[u8], members: &mut [Member]) -> Vec<u8> {
        Member::rewrite(members, &Preference::parse_all(bytes))
    }

    /// The gateways object's bytes for `members` (in port group order) and those of
    /// `preferences` whose gateway is still listed.
    pub fn rewrite(members: &mut [Member], preferences: &[Preference]) -> Vec<u8> {
        let mut data = Member::encode_all(members);
        for p in preferences {
            if members.iter().any(|m| m.gateway == p.gateway) {
                data.extend_from_slice(p.line().as_bytes());
            }
        }
        data
    }

    /// The gateways object's bytes for `members`, in port group order.
    pub fn encode_all(members: &mut [Member]) -> Vec<u8> {
        members.sort_by_key(|m| m.port_group);
        members
            .iter()
            .map(Member::line)
            .collect::<String>()
            .into_bytes()
    }
}

/// An initiator's choice of the gateway that is active/optimized for the units on one object
/// (SET TARGET PORT GROUPS, explicit ALUA), as a `prefer` line of the gateways object. It
/// holds while that gateway runs as the instance it names: once the gateway is down or has
/// restarted, the units' configured policy (`preferred_gateway`) applies again, so a choice
/// made in a failure does not outlive the gateway it chose.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Preference {
    /// The units' shared object (their reservations object): the same name on every gateway.
    pub oid: String,
    /// The gateway chosen.
    pub gateway: String,
    /// Its object-store client instance when it was chosen.
    pub instance: u64,
}

impl Preference {
    /// Its line in the gateways object.
    pub fn line(&self) -> String {
        format!("prefer {} {} {}\n", self.oid, self.gateway, self.instance)
    }

    /// A line of the gateways object; `None` when it is not a preference.
    pub fn parse(line: &str) -> Option<Preference> {
        let w: Vec<&str> = line.split_whitespace().collect();
        match w.as_slice() {
            ["prefer", oid, gateway, instance] => Some(Preference {
                oid: oid.to_string(),
                gateway: gateway.to_string(),
                instance: instance.parse().ok()?,
            }),
            _ => None,
        }
    }

    /// An upgrade's successor takes `predecessor`'s place as `instance`: the initiators'
    /// choices of the predecessor go on for it, since their sessions go on too (a restart
    /// that ends them leaves the choices to lapse). Choices of an older instance of the same
    /// gateway stay lapsed.
    pub fn carry_over(preferences: &mut [Preference], predecessor: &Member, instance: u64) {
        for p in preferences
            .iter_mut()
            .filter(|p| p.gateway == predecessor.gateway && p.instance == predecessor.instance)
        {
            p.instance = instance;
        }
    }

    /// Every preference the gateways object's bytes hold.
    pub fn parse_all(bytes: &[u8]) -> Vec<Preference> {
        String::from_utf8_lossy(bytes)
            .lines()
            .filter_map(Preference::parse)
            .collect()
    }

    /// The gateways object `bytes` with `preference` replacing any other for its object (the
    /// members' lines and the other preferences kept as they are).
    pub fn replace_in(bytes: &[u8], preference: &Preference) -> Vec<u8> {
        let mut text: String = String::from_utf8_lossy(bytes)
            .lines()
            .filter(|l| Preference::parse(l).is_none_or(|p| p.oid != preference.oid))
            .map(|l| format!("{l}\n"))
            .collect();
        text.push_str(&preference.line());
        text.into_bytes()
    }
}

/// The gateways the cluster lists and which of them answered last.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Membership {
    /// Every gateway that ever joined, by port group.
    pub members: Vec<Member>,
    /// The names of those that answered.
    pub live: Vec<String>,
    /// The initiators' choices of optimized gateways (SET TARGET PORT GROUPS).
    pub preferences: Vec<Preference>,
}

/// How a unit wants its paths: which gateway is optimized, and what the others are.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PathPolicy {
    /// `preferred_gateway`: optimized while it is live.
    pub preferred: Option<String>,
    /// `standby`: the other live gateways are standby, not active/non-optimized.
    pub standby: bool,
}

impl Membership {
    /// The policy of the units on object `oid` whose configured policy is `policy`: the
    /// gateway an initiator chose (a [`Preference`]) while it runs as the instance chosen,
    /// else `policy`.
    pub fn policy_for(&self, oid: &str, policy: &PathPolicy) -> PathPolicy {
        let chosen = self.preferences.iter().find(|p| {
            p.oid == oid
                && self.live.contains(&p.gateway)
                && self
                    .members
                    .iter()
                    .any(|m| m.gateway == p.gateway && m.instance == p.instance)
        });
        match chosen {
            Some(p) => PathPolicy {
                preferred: Some(p.gateway.clone()),
                standby: policy.standby,
            },
            None => policy.clone(),
        }
    }

    /// The ALUA port groups of a shared unit with `policy`: its preferred gateway, when live,
    /// is active/optimized, or else the live gateway with the lowest port group; the other
    /// live ones are active/non-optimized (standby with `policy.standby`); the rest
    /// unavailable. The same on every gateway that sees the same membership.
    pub fn port_groups(&self, policy: &PathPolicy) -> Vec<PortGroup> {
        let live = |m: &&Member| self.live.contains(&m.gateway);
        let optimized = self
            .members
            .iter()
            .filter(live)
            .find(|m| Some(m.gateway.as_str()) == policy.preferred.as_deref())
            .or_else(|| {
                self.members
                    .iter()
                    .filter(live)
                    .min_by_key(|m| m.port_group)
            })
            .map(|m| m.port_group);
        let others = if policy.standby {
            AccessState::Standby
        } else {
            AccessState::ActiveNonOptimized
        };
        self.members
            .iter()
            .map(|m| {
                let state = if !self.live.contains(&m.gateway) {
                    AccessState::Unavailable
                } else if Some(m.port_group) == optimized {
                    AccessState::ActiveOptimized
                } else {
                    others
                };
                PortGroup {
                    id: m.port_group,
                    state,
                    preferred: state == AccessState::ActiveOptimized,
                    ports: m.relative_ports(),
                }
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_line_reads_back_and_junk_is_skipped() {
        let m = Member {
            gateway: "a".into(),
            port_group: 3,
            portals: vec!["127.0.0.1:3260".parse().unwrap()],
            instance: 42,
            addresses: vec!["127.0.0.1:0/1".into(), "127.0.0.1:0/2".into()],
            left: true,
            srp: true,
            nvme_portals: vec![
                "127.0.0.1:4420".parse().unwrap(),
                "[::1]:4420".parse().unwrap(),
            ],
            nvme_rdma_portals: vec!["192.0.2.10:4420".parse().unwrap()],
        };
        assert!(
            m.line()
                .ends_with(" nvme=127.0.0.1:4420,[::1]:4420 nvme-rdma=192.0.2.10:4420\n"),
            "{}",
            m.line()
        );
        assert_eq!(Member::parse(&m.line()), Some(m.clone()));
        let bare = Member {
            portals: vec![],
            addresses: vec![],
            left: false,
            srp: false,
            nvme_portals: vec![],
            nvme_rdma_portals: vec![],
            ..m.clone()
        };
        assert_eq!(Member::parse(&bare.line()), Some(bare.clone()));
        let text = format!("junk\n{}gateway x\n", m.line());
        assert_eq!(Member::parse_all(text.as_bytes()), vec![m]);
    }

    #[test]
    fn a_gateway_serving_srp_has_its_srp_port_in_its_group_and_old_lines_read() {
        let m = |g: &str, pg, srp| Member {
            gateway: g.into(),
            port_group: pg,
            portals: vec![],
            instance: 7,
            addresses: vec!["c".into()],
            left: false,
            srp,
            nvme_portals: vec![],
            nvme_rdma_portals: vec![],
        };
        let a = m("a", 1, true);
        assert!(a.line().ends_with(" srp\n"), "{}", a.line());
        assert_eq!(Member::parse(&a.line()), Some(a.clone()));
        // A line written before SRP ports could join, and one with both flags.
        let old = Member::parse("gateway b 2 - 8 c left").unwrap();
        assert!(old.left && !old.srp);
        let both = Member::parse("gateway b 2 - 8 c left srp").unwrap();
        assert!(both.left && both.srp);
        let ms = Membership {
            members: vec![a, m("b", 2, false)],
            live: vec!["a".into(), "b".into()],
            preferences: vec![],
        };
        let ports: Vec<Vec<u16>> = ms
            .port_groups(&PathPolicy::default())
            .into_iter()
            .map(|g| g.ports)
            .collect();
        assert_eq!(ports, [vec![1, 0x8001], vec![2]]);
        assert_eq!(srp_relative_port(0x7fff), Some(0xffff));
        assert_eq!(srp_relative_port(0x8000), None);
        assert_eq!(srp_relative_port(0), None);
    }

    #[test]
    fn the_preferred_live_gateway_is_optimized_else_the_lowest_group() {
        let member = |g: &str, pg| Member {
            gateway: g.into(),
            port_group: pg,
            portals: vec![],
            instance: 0,
            addresses: vec![],
            left: false,
            srp: false,
            nvme_portals: vec![],
            nvme_rdma_portals: vec![],
        };
        let m = Membership {
            members: vec![member("a", 1), member("b", 2), member("c", 3)],
            live: vec!["b".into(), "c".into()],
            preferences: vec![],
        };
        let states = |p: &PathPolicy| -> Vec<AccessState> {
            m.port_groups(p).iter().map(|g| g.state).collect()
        };
        use AccessState::*;
        assert_eq!(
            states(&PathPolicy::default()),
            [Unavailable, ActiveOptimized, ActiveNonOptimized]
        );
        let c = PathPolicy {
            preferred: Some("c".into()),
            standby: true,
        };
        assert_eq!(states(&c), [Unavailable, Standby, ActiveOptimized]);
        // A preferred gateway that is down: the lowest live one.
        let a = PathPolicy {
            preferred: Some("a".into()),
            standby: false,
        };
        assert_eq!(
            states(&a),
            [Unavailable, ActiveOptimized, ActiveNonOptimized]
        );
    }

    /// An initiator's choice holds while the chosen gateway runs as the instance chosen; the
    /// line replaces an older choice for the same object and keeps every other line.
    #[test]
    fn a_preference_holds_while_its_gateway_runs_as_chosen() {
        let member = |g: &str, pg, instance| Member {
            gateway: g.into(),
            port_group: pg,
            portals: vec![],
            instance,
            addresses: vec![],
            left: false,
            srp: false,
            nvme_portals: vec![],
            nvme_rdma_portals: vec![],
        };
        let p = Preference {
            oid: "gws.reservations.rbd/vm1".into(),
            gateway: "b".into(),
            instance: 8,
        };
        assert_eq!(Preference::parse(&p.line()), Some(p.clone()));
        assert_eq!(Member::parse(&p.line()), None);
        let mut m = Membership {
            members: vec![member("a", 1, 7), member("b", 2, 8)],
            live: vec!["a".into(), "b".into()],
            preferences: vec![p.clone()],
        };
        let configured = PathPolicy {
            preferred: Some("a".into()),
            standby: true,
        };
        let chosen = m.policy_for(&p.oid, &configured);
        assert_eq!(chosen.preferred.as_deref(), Some("b"));
        assert!(chosen.standby);
        assert_eq!(
            m.policy_for("gws.reservations.rbd/vm2", &configured),
            configured
        );
        // b restarted (another instance): the configured policy again.
        m.members[1].instance = 9;
        assert_eq!(m.policy_for(&p.oid, &configured), configured);
        // b down: the same.
        m.members[1].instance = 8;
        m.live.pop();
        assert_eq!(m.policy_for(&p.oid, &configured), configured);

        let object = format!(
            "{}{}prefer gws.reservations.rbd/vm2 a 7\n{}",
            member("a", 1, 7).line(),
            member("b", 2, 8).line(),
            p.line()
        );
        let again = Preference {
            gateway: "a".into(),
            instance: 7,
            ..p.clone()
        };
        let edited = Preference::replace_in(object.as_bytes(), &again);
        assert_eq!(Member::parse_all(&edited).len(), 2);
        let prefs = Preference::parse_all(&edited);
        assert_eq!(prefs.len(), 2, "{}", String::from_utf8_lossy(&edited));
        assert!(prefs.contains(&again));
    }

    /// An upgrade's successor keeps the choices of the process it succeeds, not those of an
    /// older instance of its gateway, nor another gateway's.
    #[test]
    fn a_successor_carries_over_its_predecessors_choices_only() {
        let b = Member {
            gateway: "b".into(),
            port_group: 2,
            portals: vec![],
            instance: 8,
            addresses: vec![],
            left: false,
            srp: false,
            nvme_portals: vec![],
            nvme_rdma_portals: vec![],
        };
        let choice = |oid: &str, gateway: &str, instance| Preference {
            oid: oid.into(),
            gateway: gateway.into(),
            instance,
        };
        let mut prefs = vec![
            choice("vm1", "b", 8),
            choice("vm2", "b", 5),
            choice("vm3", "a", 8),
        ];
        Preference::carry_over(&mut prefs, &b, 11);
        assert_eq!(
            prefs,
            [
                choice("vm1", "b", 11),
                choice("vm2", "b", 5),
                choice("vm3", "a", 8)
            ]
        );
        let mut members = vec![Member {
            instance: 11,
            ..b.clone()
        }];
        let text = Member::rewrite(&mut members, &prefs);
        assert_eq!(Member::parse_all(&text), members);
        let policy = Membership {
            members,
            live: vec!["b".into()],
            preferences: Preference::parse_all(&text),
        }
        .policy_for("vm1", &PathPolicy::default());
        assert_eq!(policy.preferred.as_deref(), Some("b"));
    }
}
