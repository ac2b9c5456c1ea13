//! What a connection of any transport (iSCSI, iSER, SRP, NVMe) is asked to do from outside its
//! task: carry on, ask its initiator to log out (the daemon is stopping), or close (an admin
//! command, a logout of its session on another connection, a reinstatement); and, apart
//! from those, to park for a handover (an upgrade): stop reading at a PDU boundary, finish
//! what is in flight, report its state and its socket, then serve on or let go.

use std::os::fd::OwnedFd;
use std::sync::atomic::{AtomicU64, AtomicU8, Ordering};
use std::sync::Mutex;

use iscsi_pdu::handover::ConnectionState;
use tokio::sync::{mpsc, Notify};

/// What a connection is asked to do from outside.
#[derive(Debug, Default)]
pub struct Control {
    state: AtomicU8,
    /// Signalled when `state` or the park request changes.
    pub notify: Notify,
    /// [`Park`] as a number: apart from `state`, since a park is withdrawn when a handover
    /// fails, and `state` only ever rises.
    park: AtomicU8,
    /// Counts the park requests' changes: a parked connection told to serve and asked to park
    /// again before it woke still sees that it was told to read on.
    turns: AtomicU64,
    /// Wakes the connection's reader: a park asked or withdrawn, or the worker found that a
    /// parked reader must read on (a ping went out).
    pub reader: Notify,
    /// Where the connection reports once parked.
    report: Mutex<Option<mpsc::UnboundedSender<Parked>>>,
    /// The park turn whose deadline passed ([`Control::overdue`]), plus one; 0 for none.
    overdue: AtomicU64,
}

/// A handover's request to a connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Park {
    /// Serve (no handover, or it failed and the connection goes on here).
    Serve,
    /// Stop reading at a PDU boundary once nothing begun waits for the initiator, let the
    /// tasks in flight finish, and report.
    Park,
    /// Another process serves the connection now: let it go without a word to the
    /// initiator (its socket lives on in the other process).
    Release,
}

/// A connection parked for a handover: its state and a duplicate of its socket.
#[derive(Debug)]
pub struct Parked {
    /// The connection's daemon-wide id.
    pub id: u64,
    /// Its machine's state, with the bytes read ahead.
    pub state: ParkedState,
    /// Its TCP socket.
    pub socket: OwnedFd,
}

/// What a parked connection's machine holds, by transport.
#[derive(Debug)]
pub enum ParkedState {
    /// An iSCSI connection of session `tsih`.
    Iscsi {
        /// Its session's TSIH.
        tsih: u16,
        /// The connection's state.
        state: ConnectionState,
    },
    /// An NVMe/TCP queue (its controller's state is the subsystem's, taken once all of its
    /// queues are parked).
    NvmeTcp(nvme::handover::QueueState),
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

    /// Asks the connection to park and to report to `report` once it has.
    pub fn park(&self, report: mpsc::UnboundedSender<Parked>) {
        *crate::lock(&self.report) = Some(report);
        self.set_park(Park::Park);
    }

    /// Withdraws a park: the connection serves on, here.
    pub fn serve(&self) {
        self.set_park(Park::Serve);
    }

    /// Lets a parked connection go: another process serves it now.
    pub fn release(&self) {
        self.set_park(Park::Release);
    }

    /// The park's deadline passed: what keeps the connection from parking because it waits
    /// for the initiator (a write's data-out) is aborted, and the connection parks without
    /// it. Withdrawn by the next park request.
    pub fn overdue(&self) {
        self.overdue.store(self.park_turns() + 1, Ordering::SeqCst);
        self.notify.notify_one();
        self.reader.notify_one();
    }

    /// Whether the park in force is past its deadline ([`Control::overdue`]).
    pub fn is_overdue(&self) -> bool {
        self.parking() == Park::Park && self.overdue.load(Ordering::SeqCst) == self.park_turns() + 1
    }

    fn set_park(&self, p: Park) {
        self.turns.fetch_add(1, Ordering::SeqCst);
        self.park.store(p as u8, Ordering::SeqCst);
        self.notify.notify_one();
        self.reader.notify_one();
    }

    /// How many times the park request changed.
    pub fn park_turns(&self) -> u64 {
        self.turns.load(Ordering::SeqCst)
    }

    /// The park request in force.
    pub fn parking(&self) -> Park {
        match self.park.load(Ordering::SeqCst) {
            0 => Park::Serve,
            1 => Park::Park,
            _ => Park::Release,
        }
    }

    /// Reports a parked connection; false when nobody listens any more (the handover gave
    /// up), and the connection serves on.
    pub fn report(&self, parked: Parked) -> bool {
        crate::lock(&self.report)
            .as_ref()
            .is_some_and(|tx| tx.send(parked).is_ok())
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
