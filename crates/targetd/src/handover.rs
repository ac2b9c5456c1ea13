//! Frames of an upgrade's handover between the running targetd and its successor over a UNIX
//! socket: bytes (an encoded session state, [`iscsi_pdu::handover`]) with the descriptors
//! they speak of (listening sockets, each connection's socket) passed beside them as
//! SCM_RIGHTS, so that a connection goes on in the new process on the same TCP socket.
//!
//! A frame is a 16-byte header (magic, the number of descriptors, the payload's length) sent
//! in one `sendmsg` with the descriptors, then the payload. The receiver checks the header
//! before it allocates for the payload, and that every descriptor announced came (the kernel
//! drops those that do not fit its control buffer); descriptors that arrive with a frame it
//! refuses are closed. Blocking I/O: the handover runs on a thread of its own, beside the
//! reactors, which go on serving until it is done.

use std::io::{self, IoSlice, IoSliceMut, Read, Write};
use std::mem::MaybeUninit;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::unix::net::UnixStream;

use rustix::net::{
    recvmsg, sendmsg, RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags, ReturnFlags,
    SendAncillaryBuffer, SendAncillaryMessage, SendFlags,
};

/// The first bytes of a frame.
const MAGIC: [u8; 4] = *b"tdHF";

/// Bytes of a frame's header.
const HEADER: usize = 16;

/// The most descriptors one frame carries (the kernel's SCM_MAX_FD).
pub const MAX_FDS: usize = 253;

/// The longest payload a receiver accepts: an encoded session state at its largest.
pub const MAX_PAYLOAD: u64 =
    iscsi_pdu::handover::MAX_BODY as u64 + iscsi_pdu::handover::HEADER_LEN as u64 + 4;

/// Why a frame could not be sent or was refused.
#[derive(Debug, thiserror::Error)]
pub enum FrameError {
    /// The socket failed.
    #[error("handover socket: {0}")]
    Io(#[from] io::Error),
    /// The peer closed the socket before a frame began.
    #[error("the other process closed the handover socket")]
    Closed,
    /// The bytes are not a frame's header.
    #[error("not a handover frame")]
    NotAFrame,
    /// More descriptors than one frame carries.
    #[error("{0} descriptors in one frame, at most {MAX_FDS}")]
    TooManyFds(usize),
    /// Fewer descriptors came than the header announced.
    #[error("{announced} descriptors announced, {received} received")]
    FdsMissing {
        /// The header's count.
        announced: usize,
        /// What came.
        received: usize,
    },
    /// The payload is longer than [`MAX_PAYLOAD`].
    #[error("a payload of {0} bytes exceeds the limit")]
    TooLong(u64),
}

/// One frame received: its payload and the descriptors that came with it, in the order sent.
#[derive(Debug)]
pub struct Frame {
    /// The payload.
    pub payload: Vec<u8>,
    /// The descriptors.
    pub fds: Vec<OwnedFd>,
}

/// Sends `payload` with `fds` (at most [`MAX_FDS`]) as one frame.
pub fn send_frame(
    socket: &UnixStream,
    payload: &[u8],
    fds: &[BorrowedFd<'_>],
) -> Result<(), FrameError> {
    if fds.len() > MAX_FDS {
        return Err(FrameError::TooManyFds(fds.len()));
    }
    let mut header = [0u8; HEADER];
    header[..4].copy_from_slice(&MAGIC);
    header[4..8].copy_from_slice(&(fds.len() as u32).to_le_bytes());
    header[8..].copy_from_slice(&(payload.len() as u64).to_le_bytes());
    let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(MAX_FDS))];
    let mut control = SendAncillaryBuffer::new(&mut space);
    if !fds.is_empty() {
        let pushed = control.push(SendAncillaryMessage::ScmRights(fds));
        debug_assert!(pushed, "the buffer holds MAX_FDS descriptors");
    }
    // The descriptors go with the header's first bytes; what a short send leaves goes after.
    let sent = sendmsg(
        socket,
        &[IoSlice::new(&header)],
        &mut control,
        SendFlags::NOSIGNAL,
    )
    .map_err(io::Error::from)?;
    let mut w = socket;
    w.write_all(&header[sent..])?;
    w.write_all(payload)?;
    Ok(())
}

/// Receives one frame, checking its header before reading the payload.
pub fn receive_frame(socket: &UnixStream) -> Result<Frame, FrameError> {
    let mut header = [0u8; HEADER];
    let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(MAX_FDS))];
    let mut control = RecvAncillaryBuffer::new(&mut space);
    let got = recvmsg(
        socket,
        &mut [IoSliceMut::new(&mut header)],
        &mut control,
        RecvFlags::CMSG_CLOEXEC,
    )
    .map_err(io::Error::from)?;
    // Taken before anything is checked, so that they are closed if the frame is refused.
    let mut fds = Vec::new();
    for message in control.drain() {
        if let RecvAncillaryMessage::ScmRights(received) = message {
            fds.extend(received);
        }
    }
    if got.bytes == 0 {
        return Err(FrameError::Closed);
    }
    let mut r = socket;
    r.read_exact(&mut header[got.bytes..])?;
    if header[..4] != MAGIC {
        return Err(FrameError::NotAFrame);
    }
    let announced = u32::from_le_bytes(header[4..8].try_into().expect("4 bytes")) as usize;
    if announced > MAX_FDS {
        return Err(FrameError::TooManyFds(announced));
    }
    if fds.len() != announced || got.flags.contains(ReturnFlags::CTRUNC) {
        return Err(FrameError::FdsMissing {
            announced,
            received: fds.len(),
        });
    }
    let len = u64::from_le_bytes(header[8..].try_into().expect("8 bytes"));
    if len > MAX_PAYLOAD {
        return Err(FrameError::TooLong(len));
    }
    let mut payload = vec![0u8; len as usize];
    r.read_exact(&mut payload)?;
    Ok(Frame { payload, fds })
}

/// A session as it travels: its state and its connections' sockets, in the order of
/// `state.connections`.
pub type SessionHandover = (iscsi_pdu::handover::SessionState, Vec<OwnedFd>);

/// An NVMe/TCP controller as it travels: its state (its queues' in it) and its queues'
/// sockets, in the order of `state.queues`.
pub type ControllerHandover = (nvme::handover::ControllerState, Vec<OwnedFd>);

/// An NVMe namespace's reservations as they travel, under its subsystem's NQN.
pub type NamespaceHandover = (String, nvme::handover::NamespaceState);

/// Why a handover was refused: the successor takes none of it.
#[derive(Debug, thiserror::Error)]
pub enum ReceiveError {
    /// A frame did not hold.
    #[error(transparent)]
    Frame(#[from] FrameError),
    /// A session's state did not decode (another version, a changed or cut byte).
    #[error("a session's state: {0}")]
    State(#[from] iscsi_pdu::handover::HandoverError),
    /// A session came without one socket per connection.
    #[error("session {tsih:#x}: {sockets} sockets for {connections} connections")]
    Sockets {
        /// Its TSIH.
        tsih: u16,
        /// Sockets that came.
        sockets: usize,
        /// Its connections.
        connections: usize,
    },
    /// Two sessions under one TSIH.
    #[error("session {0:#x} came twice")]
    Twice(u16),
    /// The units' states did not decode.
    #[error("the units' states are damaged")]
    Units,
    /// The listeners' frame did not decode.
    #[error("the listening sockets' frame is damaged")]
    Listeners,
    /// A step of the handshake did not decode.
    #[error("not a step of the handover")]
    Step,
    /// An NVMe/TCP controller's state did not decode.
    #[error("an NVMe controller's state: {0}")]
    Controller(iscsi_pdu::handover::HandoverError),
    /// A controller came without one socket per queue, or twice.
    #[error("NVMe controller {cntlid}: {sockets} sockets for {queues} queues, or it came twice")]
    ControllerSockets {
        /// Its CNTLID.
        cntlid: u16,
        /// Sockets that came.
        sockets: usize,
        /// Its queues.
        queues: usize,
    },
    /// The NVMe namespaces' reservations did not decode.
    #[error("the NVMe namespaces' reservations are damaged")]
    Namespaces,
}

/// A logical unit's state as it travels: the target and LUN index it is under, its serial
/// number (the successor checks it has the same unit there) and the state.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UnitHandover {
    /// The target's name.
    pub target: String,
    /// The LUN index.
    pub lun: u16,
    /// The unit's serial number.
    pub serial: String,
    /// What it holds beyond its nexuses and medium.
    pub state: scsi_core::UnitState,
}

/// Everything one process hands the next: the units' states and the parked sessions, the
/// NVMe namespaces' reservations and the parked NVMe/TCP controllers.
#[derive(Debug, Default)]
pub struct Handover {
    /// The units' states, taken in before the sessions.
    pub units: Vec<UnitHandover>,
    /// The sessions.
    pub sessions: Vec<SessionHandover>,
    /// The NVMe namespaces' reservations, taken in before the controllers.
    pub namespaces: Vec<NamespaceHandover>,
    /// The NVMe/TCP controllers.
    pub controllers: Vec<ControllerHandover>,
}

/// The first bytes of the NVMe namespaces' frame.
const NAMESPACES_MAGIC: [u8; 4] = *b"tdNS";

/// The NVMe namespaces' frame's payload: magic, count, then per namespace its subsystem's
/// NQN (length-prefixed), NSID, NGUID and reservations (length-prefixed), and a CRC32C.
pub fn encode_namespaces(namespaces: &[NamespaceHandover]) -> Vec<u8> {
    let mut b = NAMESPACES_MAGIC.to_vec();
    b.extend_from_slice(&(namespaces.len() as u32).to_le_bytes());
    for (nqn, n) in namespaces {
        b.extend_from_slice(&(nqn.len() as u16).to_le_bytes());
        b.extend_from_slice(nqn.as_bytes());
        b.extend_from_slice(&n.nsid.to_le_bytes());
        b.extend_from_slice(&n.nguid);
        b.extend_from_slice(&(n.reservations.len() as u32).to_le_bytes());
        b.extend_from_slice(&n.reservations);
    }
    let crc = iscsi_pdu::digest::crc32c(&b);
    b.extend_from_slice(&crc.to_le_bytes());
    b
}

/// Parses the NVMe namespaces' frame: `None` when anything does not hold.
pub(crate) fn decode_namespaces(bytes: &[u8]) -> Option<Vec<NamespaceHandover>> {
    let mut r = Checked::new(bytes, &NAMESPACES_MAGIC)?;
    let count = r.u32()?;
    let mut namespaces = Vec::new();
    for _ in 0..count {
        let len = r.u16()?;
        let nqn = r.text(usize::from(len))?;
        let nsid = r.u32()?;
        let nguid = r.take(16)?.try_into().ok()?;
        let len = r.u32()?;
        let reservations = r.take(len as usize)?.to_vec();
        namespaces.push((
            nqn,
            nvme::handover::NamespaceState {
                nsid,
                nguid,
                reservations,
            },
        ));
    }
    r.end().then_some(namespaces)
}

/// The first bytes of the units' frame.
const UNITS_MAGIC: [u8; 4] = *b"tdUN";

/// The units' frame's payload: magic, count, then per unit the target's name, the LUN index,
/// the serial number and the state (each length-prefixed), and a CRC32C of all before it.
pub fn encode_units(units: &[UnitHandover]) -> Vec<u8> {
    let mut b = UNITS_MAGIC.to_vec();
    b.extend_from_slice(&(units.len() as u32).to_le_bytes());
    for u in units {
        let state = u.state.encode();
        b.extend_from_slice(&(u.target.len() as u16).to_le_bytes());
        b.extend_from_slice(u.target.as_bytes());
        b.extend_from_slice(&u.lun.to_le_bytes());
        b.extend_from_slice(&(u.serial.len() as u16).to_le_bytes());
        b.extend_from_slice(u.serial.as_bytes());
        b.extend_from_slice(&(state.len() as u32).to_le_bytes());
        b.extend_from_slice(&state);
    }
    let crc = iscsi_pdu::digest::crc32c(&b);
    b.extend_from_slice(&crc.to_le_bytes());
    b
}

/// Parses the units' frame: `None` when its magic, checksum, any length or any state does
/// not hold, or bytes are left over. Every length is checked against the bytes there before
/// anything is taken.
pub(crate) fn decode_units(bytes: &[u8]) -> Option<Vec<UnitHandover>> {
    let mut r = Checked::new(bytes, &UNITS_MAGIC)?;
    let count = r.u32()?;
    let mut units = Vec::new();
    for _ in 0..count {
        let len = r.u16()?;
        let target = r.text(usize::from(len))?;
        let lun = r.u16()?;
        let len = r.u16()?;
        let serial = r.text(usize::from(len))?;
        let len = r.u32()?;
        let state = scsi_core::UnitState::decode(r.take(len as usize)?)?;
        units.push(UnitHandover {
            target,
            lun,
            serial,
            state,
        });
    }
    r.end().then_some(units)
}

/// Sends a handover: the units' states in one frame, then the parked sessions, one frame
/// each (its encoded state and its sockets), then the NVMe namespaces' reservations in one
/// frame and each NVMe/TCP controller in one (its encoded state and its queues' sockets),
/// then an empty frame that ends them.
pub fn send_handover(socket: &UnixStream, handover: &Handover) -> Result<(), FrameError> {
    send_frame(socket, &encode_units(&handover.units), &[])?;
    for (state, sockets) in &handover.sessions {
        send_frame(socket, &state.encode(), &borrowed(sockets))?;
    }
    send_frame(socket, &encode_namespaces(&handover.namespaces), &[])?;
    for (state, sockets) in &handover.controllers {
        send_frame(socket, &state.encode(), &borrowed(sockets))?;
    }
    send_frame(socket, &[], &[])
}

/// Receives what [`send_handover`] sent, each state decoded and checked and each session's
/// sockets counted, all of it before any is taken in: a successor takes every session or
/// none, so that no connection is ever served by two processes.
pub fn receive_handover(socket: &UnixStream) -> Result<Handover, ReceiveError> {
    let frame = receive_frame(socket)?;
    let units = decode_units(&frame.payload).ok_or(ReceiveError::Units)?;
    let mut h = Handover {
        units,
        ..Handover::default()
    };
    loop {
        let frame = receive_frame(socket)?;
        if frame.payload.is_empty() && frame.fds.is_empty() {
            return Ok(h);
        }
        if frame.payload.starts_with(&NAMESPACES_MAGIC) {
            h.namespaces = decode_namespaces(&frame.payload).ok_or(ReceiveError::Namespaces)?;
            continue;
        }
        if frame.payload.starts_with(&nvme::handover::MAGIC) {
            let state = nvme::handover::ControllerState::decode(&frame.payload)
                .map_err(ReceiveError::Controller)?;
            let twice = h
                .controllers
                .iter()
                .any(|(c, _)| c.cntlid == state.cntlid && c.subnqn == state.subnqn);
            if frame.fds.len() != state.queues.len() || twice {
                return Err(ReceiveError::ControllerSockets {
                    cntlid: state.cntlid,
                    sockets: frame.fds.len(),
                    queues: state.queues.len(),
                });
            }
            h.controllers.push((state, frame.fds));
            continue;
        }
        let sessions = &mut h.sessions;
        let state = iscsi_pdu::handover::SessionState::decode(&frame.payload)?;
        if frame.fds.len() != state.connections.len() {
            return Err(ReceiveError::Sockets {
                tsih: state.tsih,
                sockets: frame.fds.len(),
                connections: state.connections.len(),
            });
        }
        if sessions.iter().any(|(s, _)| s.tsih == state.tsih) {
            return Err(ReceiveError::Twice(state.tsih));
        }
        sessions.push((state, frame.fds));
    }
}

/// What a listening socket handed to a successor serves: it takes the one whose kind and
/// configured address match a socket it would bind, instead of binding (which the running
/// process's socket would refuse), so that no connection attempt is refused across an upgrade.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ListenerKind {
    /// An iSCSI portal (`server.portals`).
    Iscsi,
    /// An NVMe/TCP portal (`server.nvme_portals`).
    NvmeTcp,
    /// An NVMe/TCP discovery portal (`server.nvme_discovery_portals`).
    NvmeDiscovery,
    /// The metrics endpoint (`server.metrics_listen`).
    Metrics,
    /// The admin socket (`server.admin_socket`), a UNIX socket.
    Admin,
}

impl ListenerKind {
    const ALL: [ListenerKind; 5] = [
        ListenerKind::Iscsi,
        ListenerKind::NvmeTcp,
        ListenerKind::NvmeDiscovery,
        ListenerKind::Metrics,
        ListenerKind::Admin,
    ];

    fn code(self) -> u8 {
        match self {
            ListenerKind::Iscsi => 1,
            ListenerKind::NvmeTcp => 2,
            ListenerKind::NvmeDiscovery => 3,
            ListenerKind::Metrics => 4,
            ListenerKind::Admin => 5,
        }
    }
}

/// A listening socket as it travels: what it serves, the address the config names it by (the
/// admin socket's path) and the socket.
#[derive(Debug)]
pub struct ListeningSocket {
    /// What it serves.
    pub kind: ListenerKind,
    /// The configured address (`host:port` as written, or the admin socket's path).
    pub address: String,
    /// The socket.
    pub socket: OwnedFd,
}

impl ListeningSocket {
    /// Another of it: the same socket under a second descriptor.
    pub fn try_clone(&self) -> io::Result<ListeningSocket> {
        Ok(ListeningSocket {
            kind: self.kind,
            address: self.address.clone(),
            socket: self.socket.try_clone()?,
        })
    }
}

/// The first bytes of the listeners' frame.
pub(crate) const LISTENERS_MAGIC: [u8; 4] = *b"tdLS";

/// Sends the listening sockets in one frame ([`encode_listeners`]), the sockets beside them
/// in the same order.
pub fn send_listeners(
    socket: &UnixStream,
    listeners: &[ListeningSocket],
) -> Result<(), FrameError> {
    let fds: Vec<BorrowedFd<'_>> = listeners.iter().map(|l| l.socket.as_fd()).collect();
    send_frame(socket, &encode_listeners(listeners), &fds)
}

/// What the listeners' frame says of them: magic, count, each one's kind and address
/// (length-prefixed), a CRC32C; their sockets travel beside it, in the same order.
pub fn encode_listeners(listeners: &[ListeningSocket]) -> Vec<u8> {
    let mut b = LISTENERS_MAGIC.to_vec();
    b.extend_from_slice(&(listeners.len() as u32).to_le_bytes());
    for l in listeners {
        b.push(l.kind.code());
        b.extend_from_slice(&(l.address.len() as u16).to_le_bytes());
        b.extend_from_slice(l.address.as_bytes());
    }
    let crc = iscsi_pdu::digest::crc32c(&b);
    b.extend_from_slice(&crc.to_le_bytes());
    b
}

/// Receives what [`send_listeners`] sent, refused when the frame does not hold (its magic,
/// checksum, a length, a kind, or one socket per entry).
pub fn receive_listeners(socket: &UnixStream) -> Result<Vec<ListeningSocket>, ReceiveError> {
    let frame = receive_frame(socket)?;
    decode_listeners(&frame.payload, frame.fds).ok_or(ReceiveError::Listeners)
}

/// The listeners [`encode_listeners`] described, with their sockets `fds` in the same order:
/// `None` when its magic, checksum, a length or a kind does not hold, or the count is not
/// that of `fds`.
pub fn decode_listeners(bytes: &[u8], fds: Vec<OwnedFd>) -> Option<Vec<ListeningSocket>> {
    let mut r = Checked::new(bytes, &LISTENERS_MAGIC)?;
    let count = r.u32()? as usize;
    if count != fds.len() {
        return None;
    }
    let mut listeners = Vec::with_capacity(count);
    for socket in fds {
        let code = r.take(1)?[0];
        let kind = *ListenerKind::ALL.iter().find(|k| k.code() == code)?;
        let len = r.u16()?;
        let address = r.text(usize::from(len))?;
        listeners.push(ListeningSocket {
            kind,
            address,
            socket,
        });
    }
    r.end().then_some(listeners)
}

/// A step of an upgrade's handshake, after the listeners, each in a frame of its own: the
/// successor is `Ready` for the sessions once it started; it answers them `Adopted` (taken in,
/// not yet read from) or `Refused`; the running process answers `Adopted` with `Released`
/// (from now on it serves them on only if the successor dies before saying `Serving`); the
/// successor says `Serving` before it reads a byte of them. A stream socket delivers what
/// was sent before the sender died before it tells of its end, so the running process,
/// reading the end without `Serving` first, knows that the successor read nothing.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Step {
    /// The successor started: its units are open, it listens, its reactors run.
    Ready,
    /// The successor took in this many sessions; none is served until `Released`.
    Adopted(u32),
    /// The successor took nothing in, for this reason.
    Refused(String),
    /// The running process lets the successor serve the sessions.
    Released,
    /// The successor serves them (said before it reads from them).
    Serving,
}

/// The first bytes of a step's frame.
const STEP_MAGIC: [u8; 4] = *b"tdST";

/// Sends one step.
pub fn send_step(socket: &UnixStream, step: &Step) -> Result<(), FrameError> {
    let mut b = STEP_MAGIC.to_vec();
    match step {
        Step::Ready => b.push(1),
        Step::Adopted(n) => {
            b.push(2);
            b.extend_from_slice(&n.to_le_bytes());
        }
        Step::Refused(why) => {
            b.push(3);
            b.extend_from_slice(why.as_bytes());
        }
        Step::Released => b.push(4),
        Step::Serving => b.push(5),
    }
    send_frame(socket, &b, &[])
}

/// Receives one step; a frame that is not one (or brings descriptors) is refused.
pub fn receive_step(socket: &UnixStream) -> Result<Step, ReceiveError> {
    let frame = receive_frame(socket)?;
    if !frame.fds.is_empty() {
        return Err(ReceiveError::Step);
    }
    let body = frame
        .payload
        .strip_prefix(&STEP_MAGIC)
        .ok_or(ReceiveError::Step)?;
    match body.split_first() {
        Some((1, [])) => Ok(Step::Ready),
        Some((2, n)) => Ok(Step::Adopted(u32::from_le_bytes(
            n.try_into().map_err(|_| ReceiveError::Step)?,
        ))),
        Some((3, why)) => Ok(Step::Refused(String::from_utf8_lossy(why).into_owned())),
        Some((4, [])) => Ok(Step::Released),
        Some((5, [])) => Ok(Step::Serving),
        _ => Err(ReceiveError::Step),
    }
}

/// Reads a checked payload (magic first, CRC32C of everything before it last): every length
/// is checked against the bytes there before anything is taken.
pub(crate) struct Checked<'a> {
    rest: &'a [u8],
}

impl<'a> Checked<'a> {
    /// The body between `magic` and the checksum, when both hold.
    pub(crate) fn new(bytes: &'a [u8], magic: &[u8; 4]) -> Option<Checked<'a>> {
        let (body, crc) = bytes.split_at_checked(bytes.len().checked_sub(4)?)?;
        if iscsi_pdu::digest::crc32c(body).to_le_bytes() != crc {
            return None;
        }
        Some(Checked {
            rest: body.strip_prefix(magic)?,
        })
    }

    pub(crate) fn take(&mut self, n: usize) -> Option<&'a [u8]> {
        let (a, rest) = self.rest.split_at_checked(n)?;
        self.rest = rest;
        Some(a)
    }

    pub(crate) fn u16(&mut self) -> Option<u16> {
        Some(u16::from_le_bytes(self.take(2)?.try_into().ok()?))
    }

    pub(crate) fn u32(&mut self) -> Option<u32> {
        Some(u32::from_le_bytes(self.take(4)?.try_into().ok()?))
    }

    pub(crate) fn text(&mut self, len: usize) -> Option<String> {
        Some(std::str::from_utf8(self.take(len)?).ok()?.to_string())
    }

    /// Whether every byte was read.
    pub(crate) fn end(&self) -> bool {
        self.rest.is_empty()
    }
}

/// Borrows each of `fds` for [`send_frame`].
pub fn borrowed<F: AsFd>(fds: &[F]) -> Vec<BorrowedFd<'_>> {
    fds.iter().map(|f| f.as_fd()).collect()
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use std::net::{TcpListener, TcpStream};

    #[test]
    fn listeners_and_connections_go_on_in_the_receiver() {
        let (a, b) = UnixStream::pair().unwrap();
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let mut client = TcpStream::connect(addr).unwrap();
        let (served, _) = listener.accept().unwrap();
        send_frame(&a, b"state", &borrowed(&[listener.as_fd(), served.as_fd()])).unwrap();
        // The sender lets go of its copies, as an old process exits.
        drop((listener, served));
        let frame = receive_frame(&b).unwrap();
        assert_eq!(frame.payload, b"state");
        let mut fds = frame.fds.into_iter();
        let listener = TcpListener::from(fds.next().unwrap());
        let mut served = TcpStream::from(fds.next().unwrap());
        // The established connection: bytes both ways.
        client.write_all(b"ping").unwrap();
        let mut got = [0u8; 4];
        served.read_exact(&mut got).unwrap();
        assert_eq!(&got, b"ping");
        served.write_all(b"pong").unwrap();
        client.read_exact(&mut got).unwrap();
        assert_eq!(&got, b"pong");
        // The listener takes new connections.
        let _second = TcpStream::connect(addr).unwrap();
        listener.accept().unwrap();
        // A frame without descriptors, and a large payload.
        let big = vec![7u8; 3 << 20];
        let sender = std::thread::spawn(move || send_frame(&a, &big, &[]).map(|_| a));
        let frame = receive_frame(&b).unwrap();
        assert!(frame.fds.is_empty() && frame.payload.len() == 3 << 20);
        drop(sender.join().unwrap().unwrap());
        assert!(matches!(receive_frame(&b), Err(FrameError::Closed)));
    }

    /// A session of `conns` connections (CIDs 1, 2, ...) under `tsih`.
    pub(crate) fn session(tsih: u16, conns: u16) -> iscsi_pdu::handover::SessionState {
        let mut params = iscsi_pdu::negotiation::SessionParams::default();
        params.operational.max_connections = 4;
        params.declared.initiator_name = Some("iqn.2026-12.io.example:i".into());
        params.declared.target_name = Some("iqn.2026-12.io.example:t".into());
        iscsi_pdu::handover::SessionState {
            tsih,
            isid: iscsi_pdu::Isid([0x80, 0, 0, 0, 0, 1]),
            params,
            exp_cmd_sn: iscsi_pdu::SerialNumber(7),
            cmd_window: 32,
            unit_attentions: Vec::new(),
            connections: (1..=conns)
                .map(|cid| iscsi_pdu::handover::ConnectionState {
                    cid,
                    params: Default::default(),
                    stat_sn: iscsi_pdu::SerialNumber(3),
                    next_ttt: 1,
                    logout_asked: false,
                    unread: vec![1, 2, 3],
                })
                .collect(),
        }
    }

    /// Sessions go as sent, each with its sockets; one without a socket per connection, or
    /// two under one TSIH, are refused, and then none is taken.
    #[test]
    fn sessions_arrive_whole_or_are_refused() {
        let sockets = |n: usize| -> Vec<OwnedFd> {
            (0..n)
                .map(|_| OwnedFd::from(TcpListener::bind("127.0.0.1:0").unwrap()))
                .collect()
        };
        let (a, b) = UnixStream::pair().unwrap();
        let units = vec![
            unit("iqn.2026-12.io.example:t", 0),
            unit("iqn.2026-12.io.example:t", 3),
        ];
        let namespaces = vec![(
            "nqn.2026-12.io.example:s".to_string(),
            nvme::handover::NamespaceState {
                nsid: 1,
                nguid: [3; 16],
                reservations: b"some reservations".to_vec(),
            },
        )];
        let sent = Handover {
            units: units.clone(),
            sessions: vec![(session(1, 2), sockets(2)), (session(2, 1), sockets(1))],
            namespaces: namespaces.clone(),
            controllers: vec![(controller(7, 3), sockets(3))],
        };
        send_handover(&a, &sent).unwrap();
        let got = receive_handover(&b).unwrap();
        assert_eq!(got.units, units);
        assert_eq!(got.sessions.len(), 2);
        for ((s, f), (t, g)) in got.sessions.iter().zip(&sent.sessions) {
            assert_eq!((s, f.len()), (t, g.len()));
        }
        assert_eq!(got.namespaces, namespaces);
        assert_eq!(got.controllers.len(), 1);
        assert_eq!(got.controllers[0].0, sent.controllers[0].0);
        assert_eq!(got.controllers[0].1.len(), 3);
        // A controller without a socket per queue is refused.
        send_frame(&a, &encode_units(&[]), &[]).unwrap();
        send_frame(&a, &controller(8, 2).encode(), &borrowed(&sockets(1))).unwrap();
        assert!(matches!(
            receive_handover(&b),
            Err(ReceiveError::ControllerSockets { cntlid: 8, .. })
        ));
        let (a, b) = UnixStream::pair().unwrap();
        send_frame(&a, &encode_units(&[]), &[]).unwrap();
        send_frame(&a, &session(3, 2).encode(), &borrowed(&sockets(1))).unwrap();
        assert!(matches!(
            receive_handover(&b),
            Err(ReceiveError::Sockets {
                tsih: 3,
                sockets: 1,
                connections: 2
            })
        ));
        let (a, b) = UnixStream::pair().unwrap();
        let twice = Handover {
            sessions: vec![(session(4, 1), sockets(1)), (session(4, 1), sockets(1))],
            ..Handover::default()
        };
        send_handover(&a, &twice).unwrap();
        assert!(matches!(receive_handover(&b), Err(ReceiveError::Twice(4))));
    }

    /// Listening sockets arrive with their kinds and addresses and still listen; a listeners'
    /// frame with a changed byte, or with a socket more or less than it names, is refused.
    #[test]
    fn listening_sockets_arrive_named_or_are_refused() {
        let tcp = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = tcp.local_addr().unwrap();
        let sent = vec![
            ListeningSocket {
                kind: ListenerKind::Iscsi,
                address: "127.0.0.1:0".into(),
                socket: tcp.into(),
            },
            ListeningSocket {
                kind: ListenerKind::Admin,
                address: "/run/targetd/targetd.sock".into(),
                socket: TcpListener::bind("127.0.0.1:0").unwrap().into(),
            },
        ];
        let (a, b) = UnixStream::pair().unwrap();
        send_listeners(&a, &sent).unwrap();
        drop(sent);
        let got = receive_listeners(&b).unwrap();
        let named: Vec<_> = got.iter().map(|l| (l.kind, l.address.as_str())).collect();
        assert_eq!(
            named,
            [
                (ListenerKind::Iscsi, "127.0.0.1:0"),
                (ListenerKind::Admin, "/run/targetd/targetd.sock")
            ]
        );
        let listener = TcpListener::from(got.into_iter().next().unwrap().socket);
        let _client = TcpStream::connect(addr).unwrap();
        listener.accept().unwrap();
        let one = || {
            vec![ListeningSocket {
                kind: ListenerKind::Metrics,
                address: "[::1]:9100".into(),
                socket: TcpListener::bind("127.0.0.1:0").unwrap().into(),
            }]
        };
        let mut payload = Vec::new();
        {
            let (a, b) = UnixStream::pair().unwrap();
            send_listeners(&a, &one()).unwrap();
            let frame = receive_frame(&b).unwrap();
            payload.extend_from_slice(&frame.payload);
            assert_eq!(
                decode_listeners(&payload, frame.fds).map(|l| l.len()),
                Some(1)
            );
        }
        for at in 0..payload.len() {
            let mut p = payload.clone();
            p[at] ^= 0x01;
            let fds = one().into_iter().map(|l| l.socket).collect();
            assert!(decode_listeners(&p, fds).is_none(), "byte {at} changed");
        }
        assert!(decode_listeners(&payload, Vec::new()).is_none());
        let two = one().into_iter().chain(one()).map(|l| l.socket).collect();
        assert!(decode_listeners(&payload, two).is_none());
    }

    /// Each step arrives as sent; anything else is refused.
    #[test]
    fn steps_arrive_as_sent() {
        let (a, b) = UnixStream::pair().unwrap();
        let steps = [
            Step::Ready,
            Step::Adopted(3),
            Step::Refused("session 0x1: no such target".into()),
            Step::Released,
            Step::Serving,
        ];
        for s in &steps {
            send_step(&a, s).unwrap();
            assert_eq!(&receive_step(&b).unwrap(), s);
        }
        for bad in [
            &b"tdST"[..],
            b"tdST\x06",
            b"tdST\x01\x00",
            b"tdST\x02\x01",
            b"xxxx\x01",
        ] {
            send_frame(&a, bad, &[]).unwrap();
            assert!(
                matches!(receive_step(&b), Err(ReceiveError::Step)),
                "{bad:?}"
            );
        }
        send_frame(&a, b"tdST\x04", &[a.as_fd()]).unwrap();
        assert!(matches!(receive_step(&b), Err(ReceiveError::Step)));
        drop(a);
        assert!(matches!(
            receive_step(&b),
            Err(ReceiveError::Frame(FrameError::Closed))
        ));
    }

    /// NVMe/TCP controller `cntlid` with `queues` queues (the admin queue and I/O queues).
    pub(crate) fn controller(cntlid: u16, queues: u16) -> nvme::handover::ControllerState {
        nvme::handover::ControllerState {
            subnqn: "nqn.2026-12.io.example:s".into(),
            cntlid,
            hostnqn: "nqn.2014-08.org.nvmexpress:uuid:h".into(),
            hostid: [9; 16],
            cap: 0x20_1e01_007f,
            vs: nvme::controller::VERSION,
            cc: 0x46_0001,
            csts: 1,
            aec: 0,
            vwc: true,
            io_queues_granted: Some(queues - 1),
            kato_ms: 5000,
            aers: vec![3],
            notices: Vec::new(),
            changed: Vec::new(),
            namespace_notice_masked: false,
            discovery_notice_masked: false,
            reservation_notice_masked: false,
            ana_notice_masked: false,
            reached: None,
            reservation_log: Vec::new(),
            reservation_count: 0,
            reservation_masks: Vec::new(),
            queues: (0..queues)
                .map(|qid| nvme::handover::QueueState {
                    qid,
                    size: 128,
                    sq_flow_control_disabled: false,
                    sqhd: 1,
                    cpda: 0,
                    maxh2cdata: 131_072,
                    max_in_capsule_data: 8192,
                    digests: Default::default(),
                    hpda: 0,
                    max_r2t: 1,
                    next_ttag: 1,
                    unread: Vec::new(),
                })
                .collect(),
        }
    }

    pub(crate) fn unit(target: &str, lun: u16) -> UnitHandover {
        UnitHandover {
            target: target.into(),
            lun,
            serial: format!("{lun:016x}"),
            state: scsi_core::UnitState {
                reservations: Some(Default::default()),
                write_cache: lun % 2 == 0,
                d_sense: true,
                swp: false,
                stopped: false,
                prevent: Vec::new(),
            },
        }
    }

    /// The units' frame: what is encoded decodes; any cut, any changed byte and any byte
    /// added are refused.
    #[test]
    fn the_units_frame_holds_or_is_refused() {
        let units = vec![
            unit("iqn.2026-12.io.example:t", 0),
            unit("iqn.2026-12.io.example:u", 7),
        ];
        let bytes = encode_units(&units);
        assert_eq!(decode_units(&bytes), Some(units));
        for cut in 0..bytes.len() {
            assert_eq!(decode_units(&bytes[..cut]), None, "cut at {cut}");
        }
        for at in 0..bytes.len() {
            let mut b = bytes.clone();
            b[at] ^= 0x20;
            assert_eq!(decode_units(&b), None, "byte {at} changed");
        }
        let mut longer = bytes.clone();
        longer.push(0);
        assert_eq!(decode_units(&longer), None);
    }

    #[test]
    fn a_frame_that_does_not_hold_is_refused_before_its_payload() {
        let header = |magic: &[u8; 4], fds: u32, len: u64| {
            let mut h = magic.to_vec();
            h.extend_from_slice(&fds.to_le_bytes());
            h.extend_from_slice(&len.to_le_bytes());
            h
        };
        // The bytes, then the sender's end closed (nothing more comes).
        let raw = |bytes: Vec<u8>| {
            let (mut a, b) = UnixStream::pair().unwrap();
            a.write_all(&bytes).unwrap();
            drop(a);
            receive_frame(&b)
        };
        assert!(matches!(
            raw(header(b"nope", 0, 0)),
            Err(FrameError::NotAFrame)
        ));
        assert!(matches!(
            raw(header(&MAGIC, 0, MAX_PAYLOAD + 1)),
            Err(FrameError::TooLong(_))
        ));
        assert!(matches!(
            raw(header(&MAGIC, 2, 0)),
            Err(FrameError::FdsMissing {
                announced: 2,
                received: 0
            })
        ));
        assert!(matches!(
            raw(header(&MAGIC, 1000, 0)),
            Err(FrameError::TooManyFds(1000))
        ));
        // A payload cut short by the sender's end.
        assert!(matches!(raw(header(&MAGIC, 0, 10)), Err(FrameError::Io(_))));
        let (a, _b) = UnixStream::pair().unwrap();
        let many: Vec<OwnedFd> = (0..MAX_FDS + 1)
            .map(|_| a.as_fd().try_clone_to_owned().unwrap())
            .collect();
        assert!(matches!(
            send_frame(&a, b"", &borrowed(&many)),
            Err(FrameError::TooManyFds(254))
        ));
    }
}
