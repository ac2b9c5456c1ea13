//! Descriptors a service manager passed this process when it started it (sd_listen_fds(3)):
//! `LISTEN_PID` names the process they are for, `LISTEN_FDS` how many there are, from
//! descriptor 3 on, and `LISTEN_FDNAMES` their names, separated by colons. systemd passes
//! this way the sockets of socket units and what the service put in its file descriptor store
//! (`FDSTORE=1`) before it last stopped, which is how targetd keeps its sessions across
//! `systemctl restart`.
//!
//! Taking a descriptor by its number is the one step here that Rust cannot check: the
//! protocol gives this process ownership of descriptors it never opened. That is why it lives
//! in this crate, beside the other unsafe code, and not in the daemon.

use std::os::fd::{FromRawFd, OwnedFd, RawFd};
use std::sync::atomic::{AtomicBool, Ordering};

/// The first descriptor passed (`SD_LISTEN_FDS_START`).
pub const FIRST_PASSED_FD: RawFd = 3;

/// The most descriptors taken: systemd's own store holds at most 4096 per service
/// (`FileDescriptorStoreMax=`), and a count beyond this is not a count it sent.
pub const MAX_PASSED_FDS: usize = 65_536;

/// Set once the descriptors were taken: a second taker would own them twice.
static TAKEN: AtomicBool = AtomicBool::new(false);

/// One descriptor passed, with the name the service manager gave it (`"unknown"` without
/// names, as sd_listen_fds_with_names(3) says).
#[derive(Debug)]
pub struct PassedFd {
    /// Its name (`FDNAME=` when it was stored, the socket unit's `FileDescriptorName=`).
    pub name: String,
    /// The descriptor, this process's from now on (close-on-exec).
    pub fd: OwnedFd,
}

/// Why the passed descriptors were not taken.
#[derive(Debug, thiserror::Error)]
pub enum PassedFdsError {
    /// `LISTEN_FDS` is not a count, or a larger one than any manager passes.
    #[error("LISTEN_FDS={0:?} is not a count of descriptors (at most {MAX_PASSED_FDS})")]
    Count(String),
    /// A descriptor the count includes is not open.
    #[error("LISTEN_FDS={count}: descriptor {fd} is not open")]
    NotOpen {
        /// The count.
        count: usize,
        /// The descriptor.
        fd: RawFd,
    },
    /// They were taken already.
    #[error("the passed descriptors were taken already")]
    Taken,
}

/// Takes the descriptors passed to this process, and removes the three variables from its
/// environment so that no child sees them. None when the variables are absent or name
/// another process (a parent's, inherited). Call it once, before threads start (it changes
/// the environment).
pub fn take_passed_fds() -> Result<Vec<PassedFd>, PassedFdsError> {
    if TAKEN.swap(true, Ordering::SeqCst) {
        return Err(PassedFdsError::Taken);
    }
    let pid = std::env::var("LISTEN_PID").ok();
    let count = std::env::var("LISTEN_FDS").ok();
    let names = std::env::var("LISTEN_FDNAMES").ok();
    for v in ["LISTEN_PID", "LISTEN_FDS", "LISTEN_FDNAMES"] {
        std::env::remove_var(v);
    }
    let ours = pid.and_then(|p| p.parse::<u32>().ok()) == Some(std::process::id());
    let Some(count) = count.filter(|_| ours) else {
        return Ok(Vec::new());
    };
    let n = match count.parse::<usize>() {
        Ok(n) if n <= MAX_PASSED_FDS => n,
        _ => return Err(PassedFdsError::Count(count)),
    };
    let names: Vec<String> = match names {
        Some(names) if names.split(':').count() == n => {
            names.split(':').map(str::to_string).collect()
        }
        _ => vec!["unknown".to_string(); n],
    };
    // Every one checked open before any is taken: an error takes none.
    for i in 0..n {
        let fd = FIRST_PASSED_FD + i as RawFd;
        // Safety: F_GETFD reads the descriptor's flags and changes nothing; on a number that
        // is not open it fails with EBADF.
        if unsafe { libc::fcntl(fd, libc::F_GETFD) } < 0 {
            return Err(PassedFdsError::NotOpen { count: n, fd });
        }
    }
    let mut passed = Vec::with_capacity(n);
    for (i, name) in names.into_iter().enumerate() {
        let raw = FIRST_PASSED_FD + i as RawFd;
        // Safety: `raw` is open (checked above) and, by the protocol, this process's: the
        // manager opened it for this process before exec, nothing in this process opened it
        // (an open gets the lowest free number, and these were never free), and nothing
        // else takes it: TAKEN lets this run once, and the variables that name it are gone.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        // Safety: F_SETFD on a descriptor this process owns; setting FD_CLOEXEC only keeps
        // it from a child (as sd_listen_fds does).
        unsafe { libc::fcntl(raw, libc::F_SETFD, libc::FD_CLOEXEC) };
        passed.push(PassedFd { name, fd });
    }
    Ok(passed)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Without the variables (a process not started by a service manager) nothing is taken;
    /// a second call is refused, whatever the first found.
    #[test]
    fn nothing_passed_is_nothing_taken_and_once() {
        std::env::set_var("LISTEN_PID", "1");
        std::env::set_var("LISTEN_FDS", "2");
        // Another process's: not taken, and the variables are gone.
        assert!(take_passed_fds().unwrap().is_empty());
        assert!(std::env::var("LISTEN_FDS").is_err());
        assert!(matches!(take_passed_fds(), Err(PassedFdsError::Taken)));
    }
}
