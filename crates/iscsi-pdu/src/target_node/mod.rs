//! The target side of iSCSI as state machines without I/O: the login phase ([`Login`], asking
//! a [`LoginPolicy`]), a connection in full feature phase ([`Connection`]), a session's CmdSN
//! order ([`CommandOrder`]), a target's core shared by its sessions' connections ([`TargetCore`]), the
//! portal group's sessions ([`SessionTable`]) and the text exchange ([`TextExchange`]). They take PDUs, events and the time, and hand back what to send and
//! what to do; a daemon (targetd) or a test wraps them with sockets, clocks and the SCSI core.

pub mod connection;
pub mod core;
pub mod local;
pub mod login;
pub mod order;
pub mod session;
#[cfg(feature = "testing")]
pub mod testing;
pub mod text;

pub use self::core::{Route, Sink, TargetCore};
pub use connection::{
    Busy, Close, Connection, Core, CoreEvent, Event, IscsiTask, NoBuffer, OrderedCommand, Payload,
    Plan, Settings, TaskCore, Transmit, LOGOUT_GRACE,
};
pub use local::{Admitted, ConnectionCore, LocalLogin, LocalTarget};
pub use login::{Completed, Login, LoginPolicy, Step};
pub use order::CommandOrder;
pub use session::{Created, Left, SessionEntry, SessionError, SessionKey, SessionTable};
pub use text::TextExchange;
