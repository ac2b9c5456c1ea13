//! What a connection of any transport (iSCSI, iSER, SRP) is asked to do from outside its
//! task: carry on, ask its initiator to log out (the daemon is stopping), or close (an admin
//! command, a logout of its session on another connection, a reinstatement).

use std::sync::atomic::{AtomicU8, Ordering};

use tokio::sync::Notify;

/// What a connection is asked to do from outside.
#[derive(Debug, Default)]
pub struct Control {
    state: AtomicU8,
    /// Signalled when `state` changes.
    pub notify: Notify,
}

/// Requests a [`Control`] carries, strongest last.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
#[repr(u8)]
pub enum Request {
    /// Carry on.
    Run = 0,
    /// Ask the initiator to log out (Asynchronous Message), the daemon is stopping.
    Logout = 1,
    /// Close now.
    Close = 2,
}

impl Control {
    /// Raises the request to `r` (never lowers it).
    pub fn request(&self, r: Request) {
        self.state.fetch_max(r as u8, Ordering::SeqCst);
        self.notify.notify_one();
    }

    /// The request in force.
    pub fn get(&self) -> Request {
        match self.state.load(Ordering::SeqCst) {
            0 => Request::Run,
            1 => Request::Logout,
            _ => Request::Close,
        }
    }
}
