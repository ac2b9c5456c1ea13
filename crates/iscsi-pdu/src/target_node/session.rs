//! A portal group's normal sessions as the login phase sees them (RFC 7143 sections 4.4, 6.3.5
//! and 6.3.4): TSIH allocation, session reinstatement (a leading login of an initiator port that
//! already has a session with the target replaces it), connections joining a session (MC/S, at
//! most its MaxConnections), connection reinstatement (a login with the CID of a live connection
//! replaces it), and the end of a session when its last connection leaves.
//!
//! Without locks or I/O, generic over what the caller keeps per session (`S`) and per
//! connection (`C`): targetd keeps one behind a lock with its sessions and their connections'
//! controls; the test rig keeps one in place with connection indexes. The table says which
//! connections to close; closing them is the caller's.

use std::collections::BTreeMap;

use crate::{Isid, LoginStatus};

/// The most sessions a table holds at once: every TSIH but 0, which means "a new session".
pub const MAX_SESSIONS: usize = u16::MAX as usize;

/// Who a session is: the initiator port (InitiatorName and ISID) and the target (SAM's I_T
/// nexus, RFC 7143 section 4.4.1). Names compare without regard to case (iSCSI names are
/// normalized to lower case, section 4.2.7.1, but initiators do not all send them so).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SessionKey {
    /// ISID.
    pub isid: Isid,
    /// InitiatorName.
    pub initiator: String,
    /// TargetName.
    pub target: String,
}

impl SessionKey {
    fn matches(&self, isid: Isid, initiator: &str, target: &str) -> bool {
        self.isid == isid
            && self.initiator.eq_ignore_ascii_case(initiator)
            && self.target.eq_ignore_ascii_case(target)
    }
}

/// One session in the table.
#[derive(Debug)]
pub struct SessionEntry<S, C> {
    /// Its TSIH.
    pub tsih: u16,
    /// Whose it is.
    pub key: SessionKey,
    /// MaxConnections as negotiated by the leading login.
    pub max_connections: u16,
    /// Its connections with their CIDs, oldest first.
    pub connections: Vec<(u16, C)>,
    /// It is ending (reinstated by a new session, or closed): no connection may join, and it
    /// leaves the table when its last connection does.
    pub ending: bool,
    /// The caller's state.
    pub value: S,
}

/// What a leading login made.
#[derive(Debug)]
pub struct Created<C> {
    /// The new session's TSIH.
    pub tsih: u16,
    /// Connections of the sessions it reinstates, to close: their tasks end with them, and
    /// each session ends when its last connection leaves.
    pub reinstated: Vec<C>,
}

/// Why a session could not be made or joined.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SessionError {
    /// No such session, or it belongs to another initiator port or target, or it is ending
    /// (login status "session does not exist").
    NoSession,
    /// It has MaxConnections already ("too many connections").
    TooManyConnections,
    /// The table holds as many sessions as it may, or every TSIH is in use ("out of
    /// resources").
    TooManySessions,
    /// A session handed over from another process ([`SessionTable::adopt`]) names a TSIH
    /// (0 or one in the table) or an I_T nexus (a live session's) that is taken.
    Taken,
}

impl SessionError {
    /// The Login Response status that says so.
    pub fn status(self) -> LoginStatus {
        match self {
            SessionError::NoSession => LoginStatus::SESSION_DOES_NOT_EXIST,
            SessionError::TooManyConnections => LoginStatus::TOO_MANY_CONNECTIONS,
            SessionError::TooManySessions | SessionError::Taken => LoginStatus::OUT_OF_RESOURCES,
        }
    }
}

/// What [`SessionTable::leave`] did.
#[derive(Debug, PartialEq, Eq)]
pub enum Left<S> {
    /// The session goes on with its other connections.
    Stays,
    /// That was its last connection: the session has ended and left the table.
    Ended(S),
    /// No such connection in that session (it had left, or the session had ended).
    Unknown,
}

/// A portal group's normal sessions, by TSIH.
#[derive(Debug)]
pub struct SessionTable<S, C> {
    sessions: BTreeMap<u16, SessionEntry<S, C>>,
    last_tsih: u16,
    limit: usize,
}

impl<S, C> Default for SessionTable<S, C> {
    fn default() -> Self {
        SessionTable {
            sessions: BTreeMap::new(),
            last_tsih: 0,
            limit: MAX_SESSIONS,
        }
    }
}

impl<S, C: Clone> SessionTable<S, C> {
    /// An empty table.
    pub fn new() -> Self {
        Self::default()
    }

    /// Holds at most `limit` sessions (at most [`MAX_SESSIONS`]), ending ones included: a
    /// leading login beyond is refused with `TooManySessions`. Sessions already in the table
    /// stay.
    pub fn set_limit(&mut self, limit: usize) {
        self.limit = limit.clamp(1, MAX_SESSIONS);
    }

    /// Makes a session for a leading login (TSIH 0) whose first connection is `conn` with CID
    /// `cid`; `make` builds the caller's state given the new TSIH. Sessions of the same
    /// initiator port with the same target are reinstated: they are marked ending and their
    /// connections handed back to close (RFC 7143 section 6.3.5).
    pub fn create(
        &mut self,
        key: SessionKey,
        max_connections: u16,
        cid: u16,
        conn: C,
        make: impl FnOnce(u16) -> S,
    ) -> Result<Created<C>, SessionError> {
        if self.sessions.len() >= self.limit {
            return Err(SessionError::TooManySessions);
        }
        let mut reinstated = Vec::new();
        for s in self.sessions.values_mut() {
            if !s.ending && s.key.matches(key.isid, &key.initiator, &key.target) {
                s.ending = true;
                reinstated.extend(s.connections.iter().map(|(_, c)| c.clone()));
            }
        }
        // A TSIH is never one in the table, ending sessions' included, so it names one
        // session until that session has left.
        let mut tsih = self.last_tsih;
        loop {
            tsih = tsih.wrapping_add(1);
            if tsih != 0 && !self.sessions.contains_key(&tsih) {
                break;
            }
        }
        self.last_tsih = tsih;
        self.sessions.insert(
            tsih,
            SessionEntry {
                tsih,
                key,
                max_connections: max_connections.max(1),
                connections: vec![(cid, conn)],
                ending: false,
                value: make(tsih),
            },
        );
        Ok(Created { tsih, reinstated })
    }

    /// Takes in a live session another process handed over ([`crate::handover`]) under the
    /// TSIH its initiator knows it by, with its connections (CID and the caller's state, at
    /// least one, each CID once, at most its MaxConnections). Refused with
    /// [`SessionError::Taken`] when the TSIH is 0 or in the table, or a live session has the
    /// same initiator port and target, and with [`SessionError::TooManySessions`] when the
    /// table is full.
    pub fn adopt(&mut self, mut session: SessionEntry<S, C>) -> Result<(), SessionError> {
        if self.sessions.len() >= self.limit {
            return Err(SessionError::TooManySessions);
        }
        let key = &session.key;
        let nexus_taken = self
            .sessions
            .values()
            .any(|s| !s.ending && s.key.matches(key.isid, &key.initiator, &key.target));
        let tsih = session.tsih;
        if tsih == 0 || self.sessions.contains_key(&tsih) || nexus_taken {
            return Err(SessionError::Taken);
        }
        let conns = &session.connections;
        let cids_unique = conns
            .iter()
            .enumerate()
            .all(|(i, (cid, _))| conns[..i].iter().all(|(c, _)| c != cid));
        session.max_connections = session.max_connections.max(1);
        if conns.is_empty() || conns.len() > usize::from(session.max_connections) || !cids_unique {
            return Err(SessionError::TooManyConnections);
        }
        session.ending = false;
        self.sessions.insert(tsih, session);
        Ok(())
    }

    /// Adds connection `conn` with CID `cid` to the session `tsih` of this initiator port and
    /// target. A connection of the session with the same CID is replaced and handed back to
    /// close (connection reinstatement, RFC 7143 section 6.3.4).
    pub fn join(
        &mut self,
        tsih: u16,
        isid: Isid,
        initiator: &str,
        target: &str,
        cid: u16,
        conn: C,
    ) -> Result<Option<C>, SessionError> {
        let s = self
            .sessions
            .get_mut(&tsih)
            .filter(|s| !s.ending && s.key.matches(isid, initiator, target))
            .ok_or(SessionError::NoSession)?;
        let same_cid = s.connections.iter().position(|(c, _)| *c == cid);
        if same_cid.is_none() && s.connections.len() >= usize::from(s.max_connections) {
            return Err(SessionError::TooManyConnections);
        }
        let replaced = same_cid.map(|i| s.connections.remove(i).1);
        s.connections.push((cid, conn));
        Ok(replaced)
    }

    /// The connection `is_it` picks leaves the session `tsih`; the last one out ends it.
    pub fn leave(&mut self, tsih: u16, is_it: impl Fn(&C) -> bool) -> Left<S> {
        let Some(s) = self.sessions.get_mut(&tsih) else {
            return Left::Unknown;
        };
        let Some(i) = s.connections.iter().position(|(_, c)| is_it(c)) else {
            return Left::Unknown;
        };
        s.connections.remove(i);
        if !s.connections.is_empty() {
            return Left::Stays;
        }
        match self.sessions.remove(&tsih) {
            Some(s) => Left::Ended(s.value),
            None => Left::Unknown,
        }
    }

    /// Ends the session `tsih` (an administrator's order, a logout of the session, a target
    /// reset): no connection may join it any more; its connections are handed back to close.
    pub fn close(&mut self, tsih: u16) -> Vec<C> {
        match self.sessions.get_mut(&tsih) {
            Some(s) => {
                s.ending = true;
                s.connections.iter().map(|(_, c)| c.clone()).collect()
            }
            None => Vec::new(),
        }
    }

    /// The live (not ending) session `tsih`.
    pub fn get(&self, tsih: u16) -> Option<&SessionEntry<S, C>> {
        self.sessions.get(&tsih).filter(|s| !s.ending)
    }

    /// The session `tsih`, ending or not.
    pub fn entry(&self, tsih: u16) -> Option<&SessionEntry<S, C>> {
        self.sessions.get(&tsih)
    }

    /// Every session in the table, ending ones included, by TSIH.
    pub fn iter(&self) -> impl Iterator<Item = &SessionEntry<S, C>> {
        self.sessions.values()
    }

    /// How many sessions the table holds.
    pub fn len(&self) -> usize {
        self.sessions.len()
    }

    /// Whether it holds none.
    pub fn is_empty(&self) -> bool {
        self.sessions.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_handed_over_session_keeps_its_tsih_and_takes_joins_and_reinstatement() {
        let mut t = SessionTable::<&str, u64>::new();
        let a = t.create(key(1, T), 4, 0, 10, |_| "a").unwrap();
        let handed = |tsih, isid, max, connections: Vec<(u16, u64)>| SessionEntry {
            tsih,
            key: key(isid, T),
            max_connections: max,
            connections,
            ending: false,
            value: "handed",
        };
        // Adopted beside a session made here: its TSIH as it was.
        t.adopt(handed(700, 2, 2, vec![(0, 20), (3, 23)])).unwrap();
        let e = t.get(700).expect("adopted");
        assert_eq!((e.value, e.connections.len()), ("handed", 2));
        for (tsih, isid, max, conns, why) in [
            (700, 3, 2, vec![(0, 30)], "its TSIH is taken"),
            (a.tsih, 3, 2, vec![(0, 30)], "a TSIH made here"),
            (0, 3, 2, vec![(0, 30)], "TSIH 0"),
            (
                701,
                1,
                2,
                vec![(0, 30)],
                "a live session of that port and target",
            ),
        ] {
            assert_eq!(
                t.adopt(handed(tsih, isid, max, conns)),
                Err(SessionError::Taken),
                "{why}"
            );
        }
        for conns in [
            vec![(0, 40), (1, 41), (2, 42)],
            vec![(1, 40), (1, 41)],
            vec![],
        ] {
            assert_eq!(
                t.adopt(handed(702, 4, 2, conns.clone())),
                Err(SessionError::TooManyConnections),
                "{conns:?}"
            );
        }
        // It is a session like any other: a full one refuses a join, a leading login of its
        // initiator port reinstates it, and new TSIHs pass over it.
        assert_eq!(
            t.join(700, key(2, T).isid, I, T, 5, 25),
            Err(SessionError::TooManyConnections)
        );
        let b = t.create(key(2, T), 4, 0, 50, |_| "b").unwrap();
        assert_eq!(b.reinstated, [20, 23]);
        assert_ne!(b.tsih, 700);
        assert_eq!(t.leave(700, |&c| c == 20), Left::Stays);
        assert_eq!(t.leave(700, |&c| c == 23), Left::Ended("handed"));
    }

    const I: &str = "iqn.2026-11.io.example:i";
    const T: &str = "iqn.2026-11.io.example:t";

    fn key(isid: u8, target: &str) -> SessionKey {
        SessionKey {
            isid: Isid([0x80, 0, 0, 0, 0, isid]),
            initiator: I.into(),
            target: target.into(),
        }
    }

    #[test]
    fn a_leading_login_of_the_same_initiator_port_reinstates_the_session() {
        let mut t = SessionTable::<&str, u64>::new();
        let a = t.create(key(1, T), 4, 0, 10, |_| "a").unwrap();
        assert!(a.reinstated.is_empty());
        t.join(a.tsih, key(1, T).isid, I, T, 1, 11).unwrap();
        // Another ISID, or another target: another I_T nexus, left alone.
        let other = t.create(key(2, T), 4, 0, 20, |_| "other").unwrap();
        let elsewhere = t.create(key(1, "iqn.x:y"), 4, 0, 30, |_| "y").unwrap();
        assert!(other.reinstated.is_empty() && elsewhere.reinstated.is_empty());
        // The same port (the initiator's name in another case): the first session ends.
        let b = t
            .create(key(1, &T.to_uppercase()), 4, 0, 40, |_| "b")
            .unwrap();
        assert_eq!(b.reinstated, [10, 11]);
        assert_ne!(b.tsih, a.tsih);
        assert!(t.get(a.tsih).is_none(), "the old session takes no joins");
        assert_eq!(
            t.join(a.tsih, key(1, T).isid, I, T, 2, 12),
            Err(SessionError::NoSession)
        );
        // It leaves the table with its last connection, and only then.
        assert_eq!(t.leave(a.tsih, |&c| c == 10), Left::Stays);
        assert_eq!(t.leave(a.tsih, |&c| c == 11), Left::Ended("a"));
        assert_eq!(t.leave(a.tsih, |&c| c == 11), Left::Unknown);
        assert_eq!(t.get(b.tsih).map(|s| s.value), Some("b"));
        assert_eq!(t.len(), 3);
    }

    #[test]
    fn joins_check_the_port_and_max_connections_and_reinstate_a_cid() {
        let mut t = SessionTable::<(), u64>::new();
        let isid = key(1, T).isid;
        let s = t.create(key(1, T), 2, 0, 10, |_| ()).unwrap().tsih;
        let wrong_isid = Isid([0x80, 0, 0, 0, 0, 9]);
        assert_eq!(
            t.join(s, wrong_isid, I, T, 1, 11),
            Err(SessionError::NoSession)
        );
        assert_eq!(
            t.join(s, isid, "iqn.x:z", T, 1, 11),
            Err(SessionError::NoSession)
        );
        assert_eq!(
            t.join(s, isid, I, "iqn.x:y", 1, 11),
            Err(SessionError::NoSession)
        );
        assert_eq!(
            t.join(s + 1, isid, I, T, 1, 11),
            Err(SessionError::NoSession)
        );
        assert_eq!(t.join(s, isid, I, T, 1, 11), Ok(None));
        assert_eq!(
            t.join(s, isid, I, T, 2, 12),
            Err(SessionError::TooManyConnections)
        );
        // The same CID again replaces the old connection, even at MaxConnections.
        assert_eq!(t.join(s, isid, I, T, 1, 13), Ok(Some(11)));
        let conns: Vec<_> = t.get(s).unwrap().connections.clone();
        assert_eq!(conns, [(0, 10), (1, 13)]);
        // The replaced connection leaving is no one's business.
        assert_eq!(t.leave(s, |&c| c == 11), Left::Unknown);
        assert_eq!(t.close(s), [10, 13]);
        assert_eq!(t.join(s, isid, I, T, 2, 14), Err(SessionError::NoSession));
        assert_eq!(t.leave(s, |&c| c == 10), Left::Stays);
        assert_eq!(t.leave(s, |&c| c == 13), Left::Ended(()));
        assert!(t.is_empty());
    }

    #[test]
    fn a_tsih_names_one_session_until_it_has_left() {
        let mut t = SessionTable::<u16, u64>::new();
        t.last_tsih = u16::MAX - 1;
        let a = t.create(key(1, T), 1, 0, 1, |tsih| tsih).unwrap().tsih;
        assert_eq!(a, u16::MAX);
        // Wrapping skips 0 (a new session) and any TSIH still in the table, ending or not.
        t.last_tsih = 0;
        t.sessions.insert(
            1,
            SessionEntry {
                tsih: 1,
                key: key(3, T),
                max_connections: 1,
                connections: vec![(0, 3)],
                ending: true,
                value: 1,
            },
        );
        let b = t.create(key(2, T), 1, 0, 2, |tsih| tsih).unwrap();
        assert_eq!(b.tsih, 2);
        assert_eq!(t.get(2).map(|s| s.value), Some(2), "made with its TSIH");
        // A limit counts ending sessions too: their resources are still held.
        t.set_limit(3);
        assert_eq!(
            t.create(key(4, T), 1, 0, 4, |tsih| tsih).err(),
            Some(SessionError::TooManySessions)
        );
        assert_eq!(t.leave(1, |&c| c == 3), Left::Ended(1));
        assert!(t.create(key(4, T), 1, 0, 4, |tsih| tsih).is_ok());
    }
}
