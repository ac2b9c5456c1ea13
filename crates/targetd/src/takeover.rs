//! `targetctl upgrade`, the successor's half (`targetd --take-over PATH CONFIG`, started by
//! the running process, [`crate::upgrade`]): it connects to the handover socket at `PATH`,
//! starts on the listening sockets it is handed, says it is ready, takes in the units' states
//! and every session, and serves them once the running process let go of them. Whatever goes
//! wrong before that it says (when it still can) and exits; the running process then serves
//! on as before.

use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::time::Duration;

use crate::handover::{receive_handover, receive_listeners, send_step, Step};
use crate::server::{ClusterEntry, Server};
use crate::Config;

/// How long the successor waits for each word of the running process. The running process
/// bounds the upgrade as a whole; this only keeps an orphaned successor from waiting forever.
const WAIT: Duration = Duration::from_secs(300);

/// The environment variable that makes a successor fail on purpose at a stage of the
/// handover (for the tests of a failed upgrade): `exit-at-start`, `crash-after-ready`,
/// `crash-after-handover`, `crash-after-adopted`, `crash-after-released`, or `refuse` (it
/// answers the sessions with a refusal as it would an encoding it cannot read).
pub const FAULT_VARIABLE: &str = "TARGETD_UPGRADE_FAULT";

/// Why the successor did not serve.
#[derive(Debug, thiserror::Error)]
pub enum TakeOverError {
    /// The handover socket failed.
    #[error("{path}: {error}")]
    Connect {
        /// The socket's path.
        path: PathBuf,
        /// Why.
        error: std::io::Error,
    },
    /// A frame or step did not hold.
    #[error(transparent)]
    Handover(#[from] crate::handover::ReceiveError),
    /// The start failed (a unit, a portal, a reactor).
    #[error(transparent)]
    Start(#[from] crate::StartError),
    /// The sessions were not taken in.
    #[error("the sessions: {0}")]
    Adopt(#[from] crate::iscsi::handover::AdoptError),
    /// Taking the predecessor's place in the cluster of gateways failed.
    #[error("taking the gateway's place in the cluster: {0}")]
    Cluster(String),
    /// The running process did not let go of the sessions.
    #[error("the running targetd did not let go of the sessions ({0:?})")]
    NotReleased(Option<Step>),
    /// A failure injected by [`FAULT_VARIABLE`].
    #[error("refused on purpose ({FAULT_VARIABLE})")]
    Injected,
}

/// Takes over from the running targetd at the handover socket `link`: starts serving `config`
/// on its listeners and serves its sessions. The server returned runs them (`Server::run`).
pub fn take_over(
    link: &Path,
    config: Config,
    config_path: PathBuf,
) -> Result<Server, TakeOverError> {
    fault("exit-at-start");
    let socket = UnixStream::connect(link).map_err(|error| TakeOverError::Connect {
        path: link.to_path_buf(),
        error,
    })?;
    let timeouts = socket
        .set_read_timeout(Some(WAIT))
        .and_then(|()| socket.set_write_timeout(Some(WAIT)));
    if let Err(error) = timeouts {
        return Err(TakeOverError::Connect {
            path: link.to_path_buf(),
            error,
        });
    }
    let result = run(&socket, config, config_path);
    if let Err(e) = &result {
        // Best effort: a broken socket is its own message.
        let _ = send_step(&socket, &Step::Refused(e.to_string()));
    }
    result
}

fn run(socket: &UnixStream, config: Config, config_path: PathBuf) -> Result<Server, TakeOverError> {
    let listeners = receive_listeners(socket)?;
    let server =
        Server::start_inheriting(config, config_path, listeners, ClusterEntry::AtHandover)?;
    send_step(socket, &Step::Ready).map_err(crate::handover::ReceiveError::from)?;
    fault("crash-after-ready");
    let handover = receive_handover(socket)?;
    fault("crash-after-handover");
    if injected("refuse") {
        return Err(TakeOverError::Injected);
    }
    let adopted = server.adopt_sessions(handover)?;
    server.end_handover();
    // The predecessor has parked: this process becomes the cluster's gateway before it says
    // it took the sessions in (a failure here leaves them to the predecessor, which lists
    // itself again).
    server
        .take_cluster_place()
        .map_err(TakeOverError::Cluster)?;
    let (adopted_sessions, adopted_controllers) = (adopted.tsihs.len(), adopted.cntlids.len());
    let count = (adopted_sessions + adopted_controllers) as u32;
    send_step(socket, &Step::Adopted(count)).map_err(crate::handover::ReceiveError::from)?;
    fault("crash-after-adopted");
    match crate::handover::receive_step(socket) {
        Ok(Step::Released) => {
            fault("crash-after-released");
            // Said before a byte is read: if this process dies before, the running one
            // serves on.
            send_step(socket, &Step::Serving).map_err(crate::handover::ReceiveError::from)?;
            adopted.serve();
            tracing::info!(
                sessions = adopted_sessions,
                controllers = adopted_controllers,
                "upgrade: serving the sessions and controllers handed over"
            );
            Ok(server)
        }
        // Dropping `adopted` ends the connections here without a word: the running process
        // serves them on.
        Ok(other) => Err(TakeOverError::NotReleased(Some(other))),
        Err(_) => Err(TakeOverError::NotReleased(None)),
    }
}

/// Whether the injected failure `what` is asked for.
fn injected(what: &str) -> bool {
    std::env::var(FAULT_VARIABLE).is_ok_and(|v| v == what)
}

/// Ends the process when `what` is asked for: at once as a crash would (`crash-...`), or as
/// a binary that fails to start (exit status 3).
fn fault(what: &str) {
    if injected(what) {
        eprintln!("targetd: {FAULT_VARIABLE}={what}: exiting");
        if what.starts_with("crash") {
            std::process::abort();
        }
        std::process::exit(3);
    }
}
