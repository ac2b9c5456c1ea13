//! Whole targets compared across gateways: every gateway that exports a target should give
//! it the same access rules (initiators, networks, SRP initiators), the same CHAP and the same
//! units, or an initiator finds a path that refuses it, asks other credentials or shows
//! another disk. Each gateway describes its target as a [`Definition`] (keys and values); the
//! cluster keeps the last one recorded as a [`Record`] in one object per target; and each
//! gateway compares its own with it ([`Comparison`]) at start and then periodically.
//!
//! The rule, decided by [`Comparison::decide`]: the gateway whose definition changed last
//! (an edit through its admin socket, a reload) writes its own as the record, and every
//! gateway whose definition differs from the record warns, naming the keys and who recorded
//! them. A gateway that starts with a definition other than a live gateway's record does not
//! replace it: it warns (a stale config brought back must not pass for the newest). Nothing
//! is refused: unlike a unit's definition (another LUN number or block size for one image
//! would corrupt data, so targetd refuses it), differing access rules cost a path, not data,
//! and refusing them would forbid changing a running cluster one gateway after another.

use std::collections::BTreeMap;

/// A target as one gateway exports it: what must be alike on every gateway, by key
/// (`initiators`, `chap`, `lun.0`, ...), each value one line of text.
pub type Definition = BTreeMap<String, String>;

/// The definition of a target the cluster recorded last, and which gateway recorded it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Record {
    /// The gateway that wrote it.
    pub written_by: String,
    /// Its definition.
    pub definition: Definition,
}

/// The largest record read back.
pub const MAX_RECORD: usize = 1 << 20;

impl Record {
    /// The object's bytes: a `written_by` line, then one `key value` line per key.
    pub fn encode(&self) -> Vec<u8> {
        let mut text = format!("written_by {}\n", self.written_by);
        for (k, v) in &self.definition {
            text.push_str(k);
            text.push(' ');
            text.push_str(v);
            text.push('\n');
        }
        text.into_bytes()
    }

    /// Reads an object's bytes back; `None` when they are not a record (no `written_by`, a
    /// key without a value, a key twice, or not UTF-8).
    pub fn decode(bytes: &[u8]) -> Option<Record> {
        let text = std::str::from_utf8(bytes).ok()?;
        let mut lines = text.lines();
        let written_by = lines.next()?.strip_prefix("written_by ")?.to_string();
        let mut definition = Definition::new();
        for line in lines {
            let (k, v) = line.split_once(' ')?;
            if k.is_empty() || definition.insert(k.into(), v.into()).is_some() {
                return None;
            }
        }
        Some(Record {
            written_by,
            definition,
        })
    }
}

/// One key on which two definitions differ; `None` where one has no such key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Difference {
    /// The key.
    pub key: String,
    /// This gateway's value.
    pub mine: Option<String>,
    /// The record's value.
    pub theirs: Option<String>,
}

impl std::fmt::Display for Difference {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let side = |v: &Option<String>| v.clone().unwrap_or_else(|| "(none)".into());
        write!(
            f,
            "{}: here {}, recorded {}",
            self.key,
            side(&self.mine),
            side(&self.theirs)
        )
    }
}

/// The keys on which `mine` and `theirs` differ, in key order.
pub fn differences(mine: &Definition, theirs: &Definition) -> Vec<Difference> {
    let mut keys: Vec<&String> = mine.keys().chain(theirs.keys()).collect();
    keys.sort_unstable();
    keys.dedup();
    keys.into_iter()
        .filter(|k| mine.get(*k) != theirs.get(*k))
        .map(|k| Difference {
            key: k.clone(),
            mine: mine.get(k).cloned(),
            theirs: theirs.get(k).cloned(),
        })
        .collect()
}

/// What to do after comparing a target's definition here with the cluster's record.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Decision {
    /// The record is this gateway's definition already.
    Same,
    /// Write this gateway's definition as the record (compare-and-swap on the version read):
    /// there was none, it was this gateway's own, its writer is not live, or this gateway's
    /// definition changed since it last compared. `replaced` is what it differed in from the
    /// record it replaces (empty when there was none).
    Record {
        /// The record's writer before, if any.
        replaced_from: Option<String>,
        /// What changes in the record.
        replaced: Vec<Difference>,
    },
    /// This gateway's definition differs from what live gateway `written_by` recorded.
    Differs {
        /// Who recorded it.
        written_by: String,
        /// How.
        differences: Vec<Difference>,
    },
}

/// One target's comparisons on one gateway: what it compared last, to tell an edit here
/// from an edit elsewhere, and whether it warns now, to log only when that changes.
#[derive(Debug, Clone, Default)]
pub struct Comparison {
    last: Option<Definition>,
    warned: Option<(String, Vec<Difference>)>,
}

impl Comparison {
    /// Compares `mine`, this gateway's (`me`) definition now, with `record`, the cluster's
    /// (none when the object does not exist); `live` tells whether a gateway is live. Call
    /// [`Comparison::recorded`] once a [`Decision::Record`] is written.
    pub fn decide(
        &mut self,
        me: &str,
        mine: &Definition,
        record: Option<&Record>,
        live: impl Fn(&str) -> bool,
    ) -> Decision {
        let changed_here = self.last.as_ref().is_some_and(|l| l != mine);
        let decision = match record {
            None => Decision::Record {
                replaced_from: None,
                replaced: Vec::new(),
            },
            Some(r) if &r.definition == mine => Decision::Same,
            Some(r) if changed_here || r.written_by == me || !live(&r.written_by) => {
                Decision::Record {
                    replaced_from: Some(r.written_by.clone()),
                    replaced: differences(mine, &r.definition),
                }
            }
            Some(r) => Decision::Differs {
                written_by: r.written_by.clone(),
                differences: differences(mine, &r.definition),
            },
        };
        if !matches!(decision, Decision::Record { .. }) {
            self.last = Some(mine.clone());
        }
        decision
    }

    /// The record of [`Decision::Record`] was written: this gateway's definition is the
    /// cluster's.
    pub fn recorded(&mut self, mine: &Definition) {
        self.last = Some(mine.clone());
        self.warned = None;
    }

    /// Whether `decision` is news to log: a difference that is new or other than the one
    /// warned of last, or the end of one (`true` when it ends a warning). Call after
    /// [`Comparison::decide`].
    pub fn is_news(&mut self, decision: &Decision) -> bool {
        match decision {
            Decision::Differs {
                written_by,
                differences,
            } => {
                let now = Some((written_by.clone(), differences.clone()));
                let news = self.warned != now;
                self.warned = now;
                news
            }
            Decision::Same => self.warned.take().is_some(),
            Decision::Record { .. } => true,
        }
    }

    /// Whether this gateway's definition differs from the cluster's record as last compared.
    pub fn differs(&self) -> bool {
        self.warned.is_some()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn def(pairs: &[(&str, &str)]) -> Definition {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    fn record(by: &str, d: &Definition) -> Record {
        Record {
            written_by: by.into(),
            definition: d.clone(),
        }
    }

    #[test]
    fn a_record_reads_back_and_junk_is_refused() {
        let r = record(
            "gw1",
            &def(&[("initiators", "iqn.a iqn.b"), ("lun.0", "rbd rbd/vm1 512")]),
        );
        assert_eq!(Record::decode(&r.encode()), Some(r));
        assert_eq!(Record::decode(b"initiators x\n"), None);
        assert_eq!(Record::decode(b"written_by a\nk v\nk w\n"), None);
        assert_eq!(Record::decode(b"written_by a\nnovalue\n"), None);
        assert_eq!(Record::decode(&[0xff, 0xfe]), None);
    }

    #[test]
    fn differences_name_each_key_and_both_sides() {
        let mine = def(&[("a", "1"), ("b", "2")]);
        let theirs = def(&[("b", "3"), ("c", "4")]);
        let d = differences(&mine, &theirs);
        let text: Vec<String> = d.iter().map(ToString::to_string).collect();
        assert_eq!(
            text,
            [
                "a: here 1, recorded (none)",
                "b: here 2, recorded 3",
                "c: here (none), recorded 4"
            ]
        );
    }

    /// Two gateways, A and B, changed one after the other as an administrator rolls a
    /// change through a cluster: the one edited last is recorded, the other warns until it
    /// is given the same, and a stale one that starts again does not replace the record.
    #[test]
    fn the_last_edited_definition_is_recorded_and_the_others_warn() {
        let old = def(&[("initiators", "iqn.a")]);
        let new = def(&[("initiators", "iqn.a iqn.b")]);
        let live = |_: &str| true;
        let (mut a, mut b) = (Comparison::default(), Comparison::default());

        // A starts first: no record yet.
        let d = a.decide("a", &old, None, live);
        assert!(matches!(
            d,
            Decision::Record {
                replaced_from: None,
                ..
            }
        ));
        a.recorded(&old);
        let mut stored = record("a", &old);
        // B starts alike.
        assert_eq!(b.decide("b", &old, Some(&stored), live), Decision::Same);
        assert!(!b.is_news(&Decision::Same));

        // A is edited (targetctl acl add): A's definition is recorded; B warns once.
        let d = a.decide("a", &new, Some(&stored), live);
        assert!(
            matches!(&d, Decision::Record { replaced_from: Some(w), replaced } if w == "a" && replaced.len() == 1)
        );
        a.recorded(&new);
        stored = record("a", &new);
        let d = b.decide("b", &old, Some(&stored), live);
        assert!(
            matches!(&d, Decision::Differs { written_by, differences } if written_by == "a" && differences[0].key == "initiators")
        );
        assert!(b.is_news(&d));
        assert!(b.differs());
        let again = b.decide("b", &old, Some(&stored), live);
        assert!(!b.is_news(&again), "the same difference is told once");

        // B is given the same: the warning ends, and says so once.
        let d = b.decide("b", &new, Some(&stored), live);
        assert_eq!(d, Decision::Same);
        assert!(b.is_news(&d));
        assert!(!b.differs());

        // B restarts with a stale config: it warns, and does not replace A's record.
        let mut b = Comparison::default();
        let d = b.decide("b", &old, Some(&stored), live);
        assert!(matches!(d, Decision::Differs { .. }));

        // ... unless A is not live: then B's definition is the one served.
        let d = b.decide("b", &old, Some(&stored), |g| g != "a");
        assert!(matches!(&d, Decision::Record { replaced_from: Some(w), .. } if w == "a"));
    }

    /// A gateway's own stale record (its write failed, or it restarted with an edit) is
    /// replaced by its definition now.
    #[test]
    fn a_gateway_replaces_its_own_record() {
        let mut a = Comparison::default();
        let stored = record("a", &def(&[("chap", "none")]));
        let d = a.decide("a", &def(&[("chap", "user 0123")]), Some(&stored), |_| true);
        assert!(matches!(d, Decision::Record { .. }));
    }
}
