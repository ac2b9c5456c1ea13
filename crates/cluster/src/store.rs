//! What the machine asks of the object store the gateways share, in its own words: whole
//! small objects read and replaced by compare-and-swap on their version, watch/notify with
//! the watchers' answers, and fencing. targetd's shell carries these out on RADOS; the test kit
//! on an in-memory store.

/// An object's bytes and the version they are at.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Versioned {
    /// The whole object.
    pub data: Vec<u8>,
    /// Its version: replace exactly this state by naming it.
    pub version: u64,
}

/// Why a compare-and-swap did not write.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CasError {
    /// Someone else changed (or created, or removed) the object first: read it again.
    Conflict,
    /// The store failed the operation (a negative errno).
    Failed(i32),
}

/// How a notify ended.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct NotifyOutcome {
    /// The watchers that acknowledged: (instance id, watch cookie, their reply).
    pub acked: Vec<(u64, u64, Vec<u8>)>,
    /// The watchers that did not within the timeout: (instance id, watch cookie).
    pub timed_out: Vec<(u64, u64)>,
}

/// An errno's text, for the log.
pub fn errno_text(e: i32) -> String {
    std::io::Error::from_raw_os_error(-e).to_string()
}
