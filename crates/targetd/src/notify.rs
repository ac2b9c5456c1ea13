//! Readiness for the service manager (systemd's `Type=notify`, sd_notify(3)): one datagram of
//! `KEY=value` lines to the socket `$NOTIFY_SOCKET` names. `READY=1` once every portal listens,
//! `RELOADING=1` then `READY=1` around a reload (SIGHUP), `STOPPING=1` when the drain starts.
//! Without the variable (not started by a service manager) nothing is sent.

use std::io::{self, IoSlice};
use std::mem::MaybeUninit;
use std::os::fd::{AsFd, BorrowedFd};
use std::os::unix::net::UnixDatagram;
use std::time::Duration;

use rustix::event::{PollFd, PollFlags};
use rustix::net::{
    sendmsg_addr, SendAncillaryBuffer, SendAncillaryMessage, SendFlags, SocketAddrUnix,
};

/// Sends `state` (e.g. `"READY=1"`) to the service manager, if there is one. Failures are
/// logged, never fatal: the daemon serves either way.
pub fn notify(state: &str) {
    if !has_manager() {
        return;
    }
    if let Err(e) = notify_with_fds(state, &[]) {
        let socket = std::env::var_os("NOTIFY_SOCKET");
        tracing::warn!(?socket, "telling the service manager {state:?}: {e}");
    }
}

/// `RELOADING=1` with the monotonic time systemd wants beside it (`MONOTONIC_USEC`).
pub fn reloading() {
    let usec = cmdtrace::now_ns() / 1000;
    notify(&format!("RELOADING=1\nMONOTONIC_USEC={usec}"));
}

/// Whether a service manager is there to tell (`$NOTIFY_SOCKET` is set).
pub fn has_manager() -> bool {
    std::env::var_os("NOTIFY_SOCKET").is_some()
}

/// Sends `state` with `fds` beside it (SCM_RIGHTS) to the service manager: `FDSTORE=1` and
/// `FDNAME=` put them in its file descriptor store, `BARRIER=1` passes the end of a pipe.
/// An error when there is no manager or the send fails: the caller decides what that means.
pub fn notify_with_fds(state: &str, fds: &[BorrowedFd<'_>]) -> io::Result<()> {
    let path = std::env::var_os("NOTIFY_SOCKET")
        .ok_or_else(|| io::Error::new(io::ErrorKind::NotFound, "NOTIFY_SOCKET is not set"))?;
    let bytes = std::os::unix::ffi::OsStrExt::as_bytes(path.as_os_str());
    let addr = match bytes.strip_prefix(b"@") {
        // An abstract socket (systemd's default since v254).
        Some(name) => SocketAddrUnix::new_abstract_name(name)?,
        None => SocketAddrUnix::new(bytes)?,
    };
    let socket = UnixDatagram::unbound()?;
    let mut space = vec![MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(fds.len()))];
    let mut control = SendAncillaryBuffer::new(&mut space);
    if !fds.is_empty() && !control.push(SendAncillaryMessage::ScmRights(fds)) {
        return Err(io::Error::other("descriptors do not fit one message"));
    }
    let iov = [IoSlice::new(state.as_bytes())];
    sendmsg_addr(&socket, &addr, &iov, &mut control, SendFlags::empty())?;
    Ok(())
}

/// Waits until the service manager has read every message sent before (`BARRIER=1`,
/// sd_notify_barrier(3)): it closes the end of a pipe it was passed, which is how this
/// process learns it, within `within`. Before a process exits, so that what it put in the
/// store is there when the manager sees it end.
pub fn barrier(within: Duration) -> io::Result<()> {
    let (read, write) = rustix::pipe::pipe_with(rustix::pipe::PipeFlags::CLOEXEC)?;
    notify_with_fds("BARRIER=1", &[write.as_fd()])?;
    drop(write);
    let deadline = std::time::Instant::now() + within;
    loop {
        let left = deadline.saturating_duration_since(std::time::Instant::now());
        if left.is_zero() {
            return Err(io::Error::new(
                io::ErrorKind::TimedOut,
                "the service manager did not answer BARRIER=1",
            ));
        }
        let timeout = rustix::event::Timespec {
            tv_sec: left.as_secs() as i64,
            tv_nsec: i64::from(left.subsec_nanos()),
        };
        let mut fds = [PollFd::new(&read, PollFlags::IN)];
        match rustix::event::poll(&mut fds, Some(&timeout)) {
            Ok(_) if fds[0].revents().intersects(PollFlags::HUP | PollFlags::ERR) => return Ok(()),
            Ok(_) | Err(rustix::io::Errno::INTR) => {}
            Err(e) => return Err(e.into()),
        }
    }
}
