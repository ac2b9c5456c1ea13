//! `systemctl restart` without ending a session, through systemd's file descriptor store
//! (`FileDescriptorStoreMax=`, `server.restart_keeps_sessions`).
//!
//! On SIGTERM ([`store_sessions`]) the stopping process parks every iSCSI/TCP session as an
//! upgrade does ([`crate::iscsi::handover::park_sessions`]), then puts in the service
//! manager's store, each under a name of its own (`FDSTORE=1`, `FDNAME=`): the listening
//! sockets, every parked connection's socket, and last a memory file with what they are (the
//! listeners' kinds and addresses, the units' states and each session's state). It waits
//! until the manager has read all of it (`BARRIER=1`) and exits without a word to those
//! initiators. The manager keeps the store while a restart is queued, and passes it to the
//! next start (`LISTEN_FDS`, `LISTEN_FDNAMES`, taken by [`backend::passed`]).
//!
//! The next start ([`Restored`]) reads the memory file, starts on the listening sockets,
//! takes every session whose sockets all came back in (each on its own: one that does not
//! fit this config is closed, its initiator logs in again), removes everything it was passed
//! from the store (`FDSTOREREMOVE=1`, so that a connection it closes is closed) and only then
//! serves the sessions. A start that fails before that leaves the store as it was, for the
//! manager's next attempt (`Restart=on-failure`).
//!
//! What is not kept: a stop that is not followed by a start (`systemctl stop`) closes the
//! stored connections when the manager empties the store, without the logout request a stop
//! sends otherwise; sessions that cannot park in time, and all of them when the process would
//! lose something ([`Loss`]) or the store is too small, are asked to log out as on any stop.

use std::io::{self, Read, Seek, Write};
use std::os::fd::{AsFd, OwnedFd};
use std::time::{Duration, Instant};

use backend::passed::PassedFd;

use crate::handover::{
    decode_listeners, decode_namespaces, decode_units, encode_listeners, encode_namespaces,
    encode_units, Checked, Handover, ListenerKind, ListeningSocket, LISTENERS_MAGIC,
};
use crate::iscsi::handover::{park_sessions, AdoptError, Adopted, ParkError};
use crate::registry::Registry;
use crate::upgrade::Loss;

/// How long the sessions may take to park (their commands in flight to finish) on SIGTERM:
/// well inside the packaged unit's `TimeoutStopSec=30`.
pub const PARK_WITHIN: Duration = Duration::from_secs(10);

/// How long the service manager may take to read what was put in its store.
const BARRIER_WITHIN: Duration = Duration::from_secs(10);

/// The memory file's name in the store.
pub const STATE_NAME: &str = "targetd-state";

/// What every name targetd gives in the store begins with.
const PREFIX: &str = "targetd-";

/// The first bytes of the memory file.
const STATE_MAGIC: [u8; 4] = *b"tdFS";

/// The largest memory file read back: every session at its largest encoding is far below.
const MAX_STATE: u64 = 256 << 20;

/// Listening socket `i`'s name in the store.
fn listener_name(i: usize) -> String {
    format!("{PREFIX}listener-{i}")
}

/// The name in the store of connection `c` of session `s` (in the memory file's order).
fn connection_name(s: usize, c: usize) -> String {
    format!("{PREFIX}connection-{s}-{c}")
}

/// The name in the store of queue `q` of NVMe/TCP controller `c` (in the memory file's
/// order).
fn queue_name(c: usize, q: usize) -> String {
    format!("{PREFIX}nvme-{c}-{q}")
}

/// Why the sessions were not put in the store; they are asked to log out instead.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// No service manager started this process.
    #[error("no service manager started targetd (NOTIFY_SOCKET is not set)")]
    NoManager,
    /// The next process would lose something.
    #[error("{0}")]
    Loss(Loss),
    /// The store is smaller than what would go in (systemd says its size in `$FDSTORE`).
    #[error("the service manager's store takes {max} descriptors, {needed} would go in (FileDescriptorStoreMax=)")]
    TooSmall {
        /// Its size.
        max: usize,
        /// What would go in.
        needed: usize,
    },
    /// The sessions did not park.
    #[error("the sessions did not park: {0}")]
    Park(#[from] ParkError),
    /// Putting them in the store failed.
    #[error("the store: {0}")]
    Io(#[from] io::Error),
}

/// What [`store_sessions`] put in the store.
#[derive(Debug, Clone, Copy)]
pub struct Stored {
    /// Sessions and NVMe/TCP controllers.
    pub sessions: usize,
    /// Descriptors (listening sockets, connections and the memory file).
    pub descriptors: usize,
    /// How long the sessions took to park.
    pub parked: Duration,
}

/// Parks every iSCSI/TCP session and puts it, the listening sockets and their state in the
/// service manager's store (see the module's documentation). On success the parked
/// connections are let go of without a word; on failure nothing stays in the store and every
/// session is as before (the caller's stop asks them to log out).
pub async fn store_sessions(registry: &Registry) -> Result<Stored, StoreError> {
    if !crate::notify::has_manager() {
        return Err(StoreError::NoManager);
    }
    if let Some(loss) = Loss::of(registry) {
        return Err(StoreError::Loss(loss));
    }
    // The admin socket is not kept: the manager removes its directory (RuntimeDirectory=)
    // between the stop and the start, and the next process binds it anew.
    let listening: Vec<ListeningSocket> = registry
        .listening_sockets()?
        .into_iter()
        .filter(|l| l.kind != ListenerKind::Admin)
        .collect();
    // This process stops either way: what connects from here waits in the backlog, for the
    // next one.
    registry.succession.hold_accepting(true);
    let started = Instant::now();
    let mut parked = park_sessions(registry, PARK_WITHIN).await?;
    let parked_in = started.elapsed();
    let handover = Handover {
        units: std::mem::take(&mut parked.units),
        sessions: std::mem::take(&mut parked.sessions),
        namespaces: std::mem::take(&mut parked.namespaces),
        controllers: std::mem::take(&mut parked.controllers),
    };
    let needed = listening.len()
        + handover
            .sessions
            .iter()
            .map(|(_, c)| c.len())
            .sum::<usize>()
        + handover
            .controllers
            .iter()
            .map(|(_, c)| c.len())
            .sum::<usize>()
        + 1;
    if let Some(max) = store_size() {
        if max < needed {
            return Err(StoreError::TooSmall { max, needed });
        }
    }
    let count = handover.sessions.len() + handover.controllers.len();
    let state = encode_state(&listening, &handover);
    let put = tokio::task::spawn_blocking(move || put(&listening, &handover, &state))
        .await
        .map_err(|e| io::Error::other(e.to_string()))?;
    put?;
    parked.release();
    Ok(Stored {
        sessions: count,
        descriptors: needed,
        parked: parked_in,
    })
}

/// The store's size as systemd (254 and later) says it, `$FDSTORE`; `None` from a manager
/// that does not say.
fn store_size() -> Option<usize> {
    std::env::var("FDSTORE").ok()?.parse().ok()
}

/// Puts the listeners, the sessions' connections and the memory file with `state` in the
/// store, and waits until the manager read them. On failure takes out again what went in.
fn put(listening: &[ListeningSocket], handover: &Handover, state: &[u8]) -> io::Result<()> {
    let mut names = Vec::new();
    let result = (|| {
        for (i, l) in listening.iter().enumerate() {
            store(&mut names, listener_name(i), l.socket.as_fd())?;
        }
        for (s, (_, conns)) in handover.sessions.iter().enumerate() {
            for (c, socket) in conns.iter().enumerate() {
                store(&mut names, connection_name(s, c), socket.as_fd())?;
            }
        }
        for (c, (_, queues)) in handover.controllers.iter().enumerate() {
            for (q, socket) in queues.iter().enumerate() {
                store(&mut names, queue_name(c, q), socket.as_fd())?;
            }
        }
        let file = state_file(state)?;
        store(&mut names, STATE_NAME.to_string(), file.as_fd())?;
        crate::notify::barrier(BARRIER_WITHIN)
    })();
    if result.is_err() {
        forget(&names);
    }
    result
}

/// Puts `fd` in the store as `name`.
fn store(names: &mut Vec<String>, name: String, fd: std::os::fd::BorrowedFd<'_>) -> io::Result<()> {
    crate::notify::notify_with_fds(&format!("FDSTORE=1\nFDNAME={name}"), &[fd])?;
    names.push(name);
    Ok(())
}

/// Takes what was put under `names` out of the store (best effort: the manager closes its
/// copies), and waits until the manager read it.
fn forget(names: &[String]) {
    for name in names {
        if let Err(e) =
            crate::notify::notify_with_fds(&format!("FDSTOREREMOVE=1\nFDNAME={name}"), &[])
        {
            tracing::warn!("taking {name} out of the service manager's store: {e}");
        }
    }
    if let Err(e) = crate::notify::barrier(BARRIER_WITHIN) {
        tracing::warn!("the service manager's store: {e}");
    }
}

/// A memory file holding `state`, sealed against any change.
fn state_file(state: &[u8]) -> io::Result<OwnedFd> {
    use rustix::fs::{fcntl_add_seals, memfd_create, MemfdFlags, SealFlags};
    let fd = memfd_create(STATE_NAME, MemfdFlags::CLOEXEC | MemfdFlags::ALLOW_SEALING)?;
    let mut file = std::fs::File::from(fd);
    file.write_all(state)?;
    fcntl_add_seals(
        &file,
        SealFlags::SHRINK | SealFlags::GROW | SealFlags::WRITE | SealFlags::SEAL,
    )?;
    Ok(file.into())
}

/// The memory file's bytes: magic; the listeners as their frame describes them
/// ([`encode_listeners`]), the units' states as theirs ([`encode_units`]) and each session's
/// encoded state, each length-prefixed; a CRC32C of everything before it. Listener `i` is
/// stored as [`listener_name`]`(i)`, connection `c` of session `s` as
/// [`connection_name`]`(s, c)`.
fn encode_state(listening: &[ListeningSocket], handover: &Handover) -> Vec<u8> {
    let mut b = STATE_MAGIC.to_vec();
    let part = |b: &mut Vec<u8>, bytes: &[u8]| {
        b.extend_from_slice(&(bytes.len() as u32).to_le_bytes());
        b.extend_from_slice(bytes);
    };
    part(&mut b, &encode_listeners(listening));
    part(&mut b, &encode_units(&handover.units));
    b.extend_from_slice(&(handover.sessions.len() as u32).to_le_bytes());
    for (state, _) in &handover.sessions {
        part(&mut b, &state.encode());
    }
    part(&mut b, &encode_namespaces(&handover.namespaces));
    b.extend_from_slice(&(handover.controllers.len() as u32).to_le_bytes());
    for (state, _) in &handover.controllers {
        part(&mut b, &state.encode());
    }
    let crc = iscsi_pdu::digest::crc32c(&b);
    b.extend_from_slice(&crc.to_le_bytes());
    b
}

/// The memory file's parts, each still encoded.
struct StateParts<'a> {
    /// The listeners' description ([`encode_listeners`]).
    listeners: &'a [u8],
    /// The units' states ([`encode_units`]).
    units: &'a [u8],
    /// Each session's state.
    sessions: Vec<&'a [u8]>,
    /// The NVMe namespaces' reservations ([`encode_namespaces`]).
    namespaces: &'a [u8],
    /// Each NVMe/TCP controller's state.
    controllers: Vec<&'a [u8]>,
}

/// The memory file's parts, checked (its magic, checksum and every length) but not decoded
/// further.
fn split_state(bytes: &[u8]) -> Option<StateParts<'_>> {
    let mut r = Checked::new(bytes, &STATE_MAGIC)?;
    let len = r.u32()?;
    let listeners = r.take(len as usize)?;
    let len = r.u32()?;
    let units = r.take(len as usize)?;
    let sessions = parts(&mut r)?;
    let len = r.u32()?;
    let namespaces = r.take(len as usize)?;
    let controllers = parts(&mut r)?;
    r.end().then_some(StateParts {
        listeners,
        units,
        sessions,
        namespaces,
        controllers,
    })
}

/// A count, then that many length-prefixed parts.
fn parts<'a>(r: &mut Checked<'a>) -> Option<Vec<&'a [u8]>> {
    let count = r.u32()?;
    let mut parts = Vec::new();
    for _ in 0..count {
        let len = r.u32()?;
        parts.push(r.take(len as usize)?);
    }
    Some(parts)
}

/// Why what the store held was not taken in: the process starts as if it had held nothing,
/// and the stored sessions' initiators log in again.
#[derive(Debug, thiserror::Error)]
pub enum RestoreError {
    /// No memory file came, but descriptors of targetd's did.
    #[error("no {STATE_NAME} came with targetd's {0} descriptors")]
    NoState(usize),
    /// The memory file could not be read.
    #[error("{STATE_NAME}: {0}")]
    Io(#[from] io::Error),
    /// The memory file is larger than any targetd writes.
    #[error("{STATE_NAME} holds {0} bytes")]
    TooLarge(u64),
    /// Its magic, checksum or a length does not hold (another version, a changed byte).
    #[error("{STATE_NAME} is damaged or of another version")]
    Damaged,
    /// A listening socket the memory file names did not come.
    #[error("{0} did not come")]
    Missing(String),
    /// The listeners' part or the units' part does not decode.
    #[error("{STATE_NAME}: the {0} do not decode")]
    Part(&'static str),
}

/// What a start found in the service manager's store (see the module's documentation): the
/// listening sockets to start on, then the sessions to take in and serve.
#[derive(Debug, Default)]
pub struct Restored {
    /// The listening sockets, for [`crate::server::Server::start_inheriting`].
    pub listeners: Vec<ListeningSocket>,
    /// The units' states and the sessions whose sockets all came.
    handover: Handover,
    /// Every name of targetd's passed, to take out of the store once served.
    names: Vec<String>,
}

impl Restored {
    /// Reads what the store passed this process (nothing when it passed nothing of
    /// targetd's). What does not hold is logged and closed, and taken out of the store, so
    /// that the process starts afresh: binding its portals, its initiators logging in again.
    pub fn take(passed: Vec<PassedFd>) -> Restored {
        let (ours, others): (Vec<_>, Vec<_>) =
            passed.into_iter().partition(|p| p.name.starts_with(PREFIX));
        for p in others {
            tracing::warn!(
                name = p.name,
                "a descriptor passed that is not targetd's: closed"
            );
        }
        if ours.is_empty() {
            return Restored::default();
        }
        let names: Vec<String> = ours.iter().map(|p| p.name.clone()).collect();
        match Restored::read(ours) {
            Ok(mut r) => {
                r.names = names;
                r
            }
            Err(e) => {
                tracing::error!("the service manager's store: {e}; starting afresh");
                forget(&names);
                Restored::default()
            }
        }
    }

    fn read(mut ours: Vec<PassedFd>) -> Result<Restored, RestoreError> {
        let count = ours.len();
        let mut take = |name: &str| -> Option<OwnedFd> {
            let i = ours.iter().position(|p| p.name == name)?;
            Some(ours.swap_remove(i).fd)
        };
        let file = take(STATE_NAME).ok_or(RestoreError::NoState(count))?;
        let mut file = std::fs::File::from(file);
        let len = file.metadata()?.len();
        if len > MAX_STATE {
            return Err(RestoreError::TooLarge(len));
        }
        let mut bytes = Vec::with_capacity(len as usize);
        file.rewind()?;
        file.take(len).read_to_end(&mut bytes)?;
        let StateParts {
            listeners,
            units,
            sessions: states,
            namespaces,
            controllers: controller_states,
        } = split_state(&bytes).ok_or(RestoreError::Damaged)?;
        let count = listeners_count(listeners).ok_or(RestoreError::Part("listeners"))?;
        let mut fds = Vec::with_capacity(count);
        let mut missing = Vec::new();
        for i in 0..count {
            match take(&listener_name(i)) {
                Some(fd) => fds.push(fd),
                None => missing.push(i),
            }
        }
        // The manager never closes a listening socket on its own; one missing means the
        // store is not what this process put there.
        if let Some(i) = missing.first() {
            return Err(RestoreError::Missing(listener_name(*i)));
        }
        let listeners = decode_listeners(listeners, fds).ok_or(RestoreError::Part("listeners"))?;
        let units = decode_units(units).ok_or(RestoreError::Part("units' states"))?;
        let sessions = whole(
            "session",
            states,
            iscsi_pdu::handover::SessionState::decode,
            |s| s.connections.len(),
            connection_name,
            &mut take,
        );
        let namespaces =
            decode_namespaces(namespaces).ok_or(RestoreError::Part("NVMe namespaces"))?;
        let controllers = whole(
            "NVMe controller",
            controller_states,
            nvme::handover::ControllerState::decode,
            |c| c.queues.len(),
            queue_name,
            &mut take,
        );
        for p in ours {
            tracing::warn!(name = p.name, "a stored descriptor no state names: closed");
        }
        Ok(Restored {
            listeners,
            handover: Handover {
                units,
                sessions,
                namespaces,
                controllers,
            },
            names: Vec::new(),
        })
    }

    /// Whether the store held anything of targetd's.
    pub fn is_empty(&self) -> bool {
        self.names.is_empty()
    }

    /// Takes the units' states and each session in with `adopt` (the server's
    /// `adopt_sessions`, once started on [`listeners`](Self::listeners)), takes everything
    /// out of the store, then serves the sessions taken in. A session `adopt` refuses is
    /// closed, and its initiator logs in again. The sessions served.
    pub fn serve(self, mut adopt: impl FnMut(Handover) -> Result<Adopted, AdoptError>) -> usize {
        let Handover {
            units,
            sessions,
            namespaces,
            controllers,
        } = self.handover;
        // The units and namespaces first, then each session and each controller on its own:
        // one refused does not keep the others back.
        let parts = std::iter::once((
            "the units' and namespaces' states".to_string(),
            Handover {
                units,
                namespaces,
                ..Handover::default()
            },
        ))
        .chain(sessions.into_iter().map(|s| {
            let what = format!("stored session {:#x}", s.0.tsih);
            let h = Handover {
                sessions: vec![s],
                ..Handover::default()
            };
            (what, h)
        }))
        .chain(controllers.into_iter().map(|c| {
            let what = format!("stored NVMe controller {}", c.0.cntlid);
            let h = Handover {
                controllers: vec![c],
                ..Handover::default()
            };
            (what, h)
        }));
        let mut adopted = Vec::new();
        for (what, h) in parts {
            match adopt(h) {
                Ok(a) => adopted.push(a),
                Err(e) => tracing::error!("{what}: {e}; closed"),
            }
        }
        // Out of the store before a byte is read: a process that served them and died
        // would otherwise leave a stale state for the next start.
        forget(&self.names);
        let mut served = 0;
        for a in adopted {
            served += a.tsihs.len() + a.cntlids.len();
            a.serve();
        }
        served
    }
}

/// Each of `states` decoded, with its sockets (`sockets(state)` of them, stored as
/// `name(i, j)`) taken from what was passed; one that does not decode, or lost a socket (the
/// manager closes a socket it sees hang up: its peer left while targetd restarted), is left
/// out and its sockets closed.
fn whole<T, E: std::fmt::Display>(
    what: &str,
    states: Vec<&[u8]>,
    decode: impl Fn(&[u8]) -> Result<T, E>,
    sockets: impl Fn(&T) -> usize,
    name: impl Fn(usize, usize) -> String,
    take: &mut impl FnMut(&str) -> Option<OwnedFd>,
) -> Vec<(T, Vec<OwnedFd>)> {
    let mut taken = Vec::new();
    for (i, bytes) in states.into_iter().enumerate() {
        let state = match decode(bytes) {
            Ok(state) => state,
            Err(e) => {
                tracing::error!("stored {what} {i}: {e}; closed");
                continue;
            }
        };
        let fds: Vec<Option<OwnedFd>> = (0..sockets(&state)).map(|j| take(&name(i, j))).collect();
        if fds.iter().any(Option::is_none) {
            tracing::warn!("stored {what} {i} lost a connection while targetd restarted: closed");
            continue;
        }
        taken.push((state, fds.into_iter().flatten().collect()));
    }
    taken
}

/// The count the listeners' description gives, checked against its checksum.
fn listeners_count(bytes: &[u8]) -> Option<usize> {
    let mut r = Checked::new(bytes, &LISTENERS_MAGIC)?;
    Some(r.u32()? as usize)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::handover::tests::{controller, session, unit};
    use std::net::TcpListener;

    fn sockets(n: usize) -> Vec<OwnedFd> {
        (0..n)
            .map(|_| OwnedFd::from(TcpListener::bind("127.0.0.1:0").unwrap()))
            .collect()
    }

    fn listening() -> Vec<ListeningSocket> {
        vec![
            ListeningSocket {
                kind: ListenerKind::Iscsi,
                address: "127.0.0.1:0".into(),
                socket: sockets(1).remove(0),
            },
            ListeningSocket {
                kind: ListenerKind::NvmeTcp,
                address: "[::1]:4420".into(),
                socket: sockets(1).remove(0),
            },
        ]
    }

    /// The memory file's parts come back as they went in; any cut, any changed byte and
    /// any byte added are refused.
    #[test]
    fn the_state_holds_or_is_refused() {
        let units = vec![unit("iqn.2026-12.io.example:t", 0)];
        let handover = Handover {
            units: units.clone(),
            sessions: vec![(session(1, 2), sockets(2)), (session(2, 1), sockets(1))],
            namespaces: Vec::new(),
            controllers: vec![(controller(5, 2), sockets(2))],
        };
        let bytes = encode_state(&listening(), &handover);
        let StateParts {
            listeners: l,
            units: u,
            sessions: s,
            namespaces: n,
            controllers: c,
        } = split_state(&bytes).unwrap();
        assert_eq!(l, encode_listeners(&listening()));
        assert_eq!(decode_units(u), Some(units));
        assert_eq!(s.len(), 2);
        assert_eq!(
            iscsi_pdu::handover::SessionState::decode(s[1]).unwrap(),
            handover.sessions[1].0
        );
        assert_eq!(decode_namespaces(n), Some(Vec::new()));
        assert_eq!(
            nvme::handover::ControllerState::decode(c[0]).unwrap(),
            handover.controllers[0].0
        );
        for cut in 0..bytes.len() {
            assert!(split_state(&bytes[..cut]).is_none(), "cut at {cut}");
        }
        for i in 0..bytes.len() {
            let mut changed = bytes.clone();
            changed[i] ^= 0x40;
            assert!(split_state(&changed).is_none(), "byte {i} changed");
        }
        let mut longer = bytes.clone();
        longer.push(0);
        assert!(split_state(&longer).is_none());
    }

    /// What a start is passed: the listeners and every session whose connections all came
    /// are taken; a session that lost a connection, and descriptors that are not targetd's
    /// or that the state does not name, are closed.
    #[test]
    fn a_start_takes_what_came_whole() {
        let units = vec![unit("iqn.2026-12.io.example:t", 0)];
        let handover = Handover {
            units: units.clone(),
            sessions: vec![
                (session(1, 2), sockets(2)),
                (session(2, 1), sockets(1)),
                (session(3, 2), sockets(2)),
            ],
            namespaces: Vec::new(),
            controllers: vec![
                (controller(5, 2), sockets(2)),
                (controller(6, 1), sockets(1)),
            ],
        };
        let sessions = &handover.sessions;
        let state = encode_state(&listening(), &handover);
        let passed = |skip: &str| {
            let mut p = vec![PassedFd {
                name: "unknown".into(),
                fd: sockets(1).remove(0),
            }];
            let mut names = vec![listener_name(0), listener_name(1), "targetd-stray".into()];
            for (s, (state, _)) in sessions.iter().enumerate() {
                names.extend((0..state.connections.len()).map(|c| connection_name(s, c)));
            }
            for (c, (state, _)) in handover.controllers.iter().enumerate() {
                names.extend((0..state.queues.len()).map(|q| queue_name(c, q)));
            }
            for name in names.into_iter().filter(|n| n != skip) {
                p.push(PassedFd {
                    name,
                    fd: sockets(1).remove(0),
                });
            }
            p.push(PassedFd {
                name: STATE_NAME.into(),
                fd: state_file(&state).unwrap(),
            });
            p
        };
        let r = Restored::take(passed(&connection_name(2, 1)));
        // The first controller lost a queue; the second came whole.
        let r = {
            let mut p = passed(&connection_name(2, 1));
            p.retain(|f| f.name != queue_name(0, 1));
            drop(r);
            Restored::take(p)
        };
        let cntlids: Vec<u16> = r
            .handover
            .controllers
            .iter()
            .map(|(c, _)| c.cntlid)
            .collect();
        assert_eq!(cntlids, [6]);
        assert!(!r.is_empty());
        let kinds: Vec<_> = r
            .listeners
            .iter()
            .map(|l| (l.kind, l.address.as_str()))
            .collect();
        assert_eq!(
            kinds,
            [
                (ListenerKind::Iscsi, "127.0.0.1:0"),
                (ListenerKind::NvmeTcp, "[::1]:4420")
            ]
        );
        assert_eq!(r.handover.units, units);
        let tsihs: Vec<u16> = r.handover.sessions.iter().map(|(s, _)| s.tsih).collect();
        assert_eq!(tsihs, [1, 2]);
        assert_eq!(r.handover.sessions[0].1.len(), 2);
        // Without a listener, or without the state, nothing is taken.
        assert!(Restored::take(passed(&listener_name(1)))
            .listeners
            .is_empty());
        let mut no_state = passed("");
        no_state.pop();
        let r = Restored::take(no_state);
        assert!(r.is_empty() && r.listeners.is_empty());
        // Nothing of targetd's: nothing.
        let r = Restored::take(passed("").into_iter().take(1).collect());
        assert!(r.is_empty());
    }
}
