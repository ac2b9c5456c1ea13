//! Readiness for the service manager (systemd's `Type=notify`, sd_notify(3)): one datagram of
//! `KEY=value` lines to the socket `$NOTIFY_SOCKET` names. `READY=1` once every portal listens,
//! `RELOADING=1` then `READY=1` around a reload (SIGHUP), `STOPPING=1` when the drain starts.
//! Without the variable (not started by a service manager) nothing is sent.

use std::os::unix::net::UnixDatagram;

/// Sends `state` (e.g. `"READY=1"`) to the service manager, if there is one. Failures are
/// logged, never fatal: the daemon serves either way.
pub fn notify(state: &str) {
    let Some(path) = std::env::var_os("NOTIFY_SOCKET") else {
        return;
    };
    if let Err(e) = send(&path, state) {
        tracing::warn!(socket = ?path, "telling the service manager {state:?}: {e}");
    }
}

fn send(path: &std::ffi::OsStr, state: &str) -> std::io::Result<()> {
    let socket = UnixDatagram::unbound()?;
    let bytes = std::os::unix::ffi::OsStrExt::as_bytes(path);
    match bytes.strip_prefix(b"@") {
        // An abstract socket (systemd's default since v254).
        Some(name) => {
            use std::os::linux::net::SocketAddrExt;
            let addr = std::os::unix::net::SocketAddr::from_abstract_name(name)?;
            socket.send_to_addr(state.as_bytes(), &addr)?;
        }
        None => {
            socket.send_to(state.as_bytes(), path)?;
        }
    }
    Ok(())
}

/// `RELOADING=1` with the monotonic time systemd wants beside it (`MONOTONIC_USEC`).
pub fn reloading() {
    let usec = cmdtrace::now_ns() / 1000;
    notify(&format!("RELOADING=1\nMONOTONIC_USEC={usec}"));
}
