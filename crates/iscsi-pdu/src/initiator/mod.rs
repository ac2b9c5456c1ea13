//! The initiator's protocol half, without I/O: the login of a connection ([`Login`]) and a
//! session in full feature phase ([`Session`]). initiator-bench is their I/O shell (sockets,
//! timeouts, workloads); the deterministic pair in `tests/pair.rs` drives them against the
//! target's machines on a virtual clock.

mod login;
mod session;

pub use login::{Established, Login, LoginError};
pub use session::{
    Command, ConnectionError, Event, Failure, Reply, ScsiReply, Session, StartError, Timers,
};
