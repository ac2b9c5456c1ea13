//! What an upgrade needs of the running daemon ([`crate::upgrade`]): its accept loops held
//! while sessions park, a duplicate of every listening socket to hand over, the binary it runs,
//! and the word that a successor serves (after which its stop leaves the admin socket's file
//! and its listeners to that successor).

use std::os::fd::OwnedFd;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;

use tokio::sync::{watch, Notify};

use crate::handover::{ListenerKind, ListeningSocket};
use crate::lock;

/// The running daemon's side of an upgrade.
pub struct Succession {
    /// `true` while an upgrade parks and hands over: the accept loops take no connection
    /// (they wait in the listen backlog, for the successor or for this process again).
    hold: watch::Sender<bool>,
    /// The listening sockets besides the iSCSI portals' (NVMe/TCP, discovery, metrics, the
    /// admin socket), duplicated as the server started serving on them.
    sockets: Mutex<Vec<ListeningSocket>>,
    /// The binary this process runs, as it was when it started (a package upgrade replaces
    /// the file under the same path), and the options to start its successor with beside the
    /// config (the log format): what `targetctl upgrade` starts unless told another binary.
    executable: Mutex<Option<(PathBuf, Vec<String>)>>,
    /// An upgrade is under way.
    running: AtomicBool,
    /// A successor serves this process's sessions and listeners.
    succeeded: AtomicBool,
    /// Told when it does.
    done: Notify,
}

impl Default for Succession {
    fn default() -> Succession {
        Succession {
            hold: watch::Sender::new(false),
            sockets: Mutex::default(),
            executable: Mutex::default(),
            running: AtomicBool::new(false),
            succeeded: AtomicBool::new(false),
            done: Notify::new(),
        }
    }
}

impl Succession {
    /// Holds (`true`) or lets go of (`false`) the accept loops.
    pub fn hold_accepting(&self, hold: bool) {
        self.hold.send_replace(hold);
    }

    /// What an accept loop watches: it accepts only while this holds `false`.
    pub fn accept_hold(&self) -> watch::Receiver<bool> {
        self.hold.subscribe()
    }

    /// Keeps a duplicate of a listening socket the server serves on, to hand over.
    pub fn keep(&self, kind: ListenerKind, address: String, socket: OwnedFd) {
        lock(&self.sockets).push(ListeningSocket {
            kind,
            address,
            socket,
        });
    }

    /// Duplicates of the kept listening sockets.
    pub fn sockets(&self) -> std::io::Result<Vec<ListeningSocket>> {
        lock(&self.sockets)
            .iter()
            .map(ListeningSocket::try_clone)
            .collect()
    }

    /// Names the binary this process runs and the options its successor is to be started
    /// with (targetd's `main` does, at start).
    pub fn set_executable(&self, path: PathBuf, options: Vec<String>) {
        *lock(&self.executable) = Some((path, options));
    }

    /// The binary this process runs and its successor's options, if named.
    pub fn executable(&self) -> Option<(PathBuf, Vec<String>)> {
        lock(&self.executable).clone()
    }

    /// Marks an upgrade begun; `false` when one is under way already.
    pub fn begin(&self) -> bool {
        !self.running.swap(true, Ordering::SeqCst)
    }

    /// Marks the upgrade over (failed, or succeeded: [`Self::succeed`]).
    pub fn end(&self) {
        self.running.store(false, Ordering::SeqCst);
    }

    /// A successor serves: this process is to stop, leaving the listeners and the admin
    /// socket's file to it.
    pub fn succeed(&self) {
        self.succeeded.store(true, Ordering::SeqCst);
        self.done.notify_waiters();
    }

    /// Whether a successor serves.
    pub fn succeeded(&self) -> bool {
        self.succeeded.load(Ordering::SeqCst)
    }

    /// Resolves once a successor serves.
    pub async fn succeeded_wait(&self) {
        loop {
            let notified = self.done.notified();
            if self.succeeded() {
                return;
            }
            notified.await;
        }
    }
}
