//! Errors of the initiator library, scoped to what recovers: a failed command leaves the session
//! usable; a lost connection fails the commands on it and the session logs in again on next use.

use iscsi_pdu::initiator::{Failure, LoginError};
use iscsi_pdu::negotiation::NegotiationError;
use iscsi_pdu::{LoginStatus, RejectReason, ScsiStatus, TmfResponse};

use crate::scsi::Sense;

/// An initiator error.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The URL is malformed.
    #[error("bad iSCSI URL {url:?}: {reason}")]
    Url {
        /// The URL.
        url: String,
        /// What is wrong with it.
        reason: &'static str,
    },
    /// Socket I/O failed.
    #[error("I/O: {0}")]
    Io(std::io::Error),
    /// The portal could not be reached.
    #[error("cannot connect to {portal}: {error}")]
    Connect {
        /// `host:port`.
        portal: String,
        /// What the OS said (in the text, so not also a source).
        error: std::io::Error,
    },
    /// The target refused the login.
    #[error("the target refused the login{}: status {:#06x}", if .message.is_empty() { String::new() } else { format!(": {}", .message) }, .status.0)]
    LoginRefused {
        /// Status-Class and Status-Detail.
        status: LoginStatus,
        /// A readable name for the status.
        message: &'static str,
    },
    /// Negotiation or authentication failed.
    /// (Its text includes the negotiation's error, so that is not also a source: a chain
    /// printed whole would say it twice.)
    #[error("negotiation: {0}")]
    Negotiation(NegotiationError),
    /// The target broke the protocol; the connection is closed.
    #[error("protocol violation by the target: {0}")]
    Protocol(String),
    /// The target broke the protocol for one command; the session goes on.
    #[error("command failed: {0}")]
    Command(String),
    /// The target rejected a PDU of this command.
    #[error("target rejected the command: {0:?}")]
    Rejected(RejectReason),
    /// A task management function did not complete.
    #[error("task management function failed: {0:?}")]
    TaskManagement(TmfResponse),
    /// The command completed with a status other than GOOD.
    #[error("SCSI status {status:?}{}", .sense.map(|s| format!(": {s}")).unwrap_or_default())]
    Scsi {
        /// The status.
        status: ScsiStatus,
        /// Sense key, ASC and ASCQ, if sense data came.
        sense: Option<Sense>,
    },
    /// An NVMe/TCP command or connection failed.
    #[error("{0}")]
    Nvme(#[from] crate::nvme::NvmeError),
    /// The command was aborted by a task management function.
    #[error("command aborted")]
    Aborted,
    /// The connection carrying the command was lost; the command may or may not have run.
    #[error("connection lost: {0}")]
    ConnectionLost(String),
    /// The command took longer than allowed.
    #[error("timed out")]
    Timeout,
    /// The target asked this login to log out (AsyncEvent 1): the command did not start on
    /// it; another path or the next login takes it.
    #[error("the target asked to log out")]
    LogoutRequested,
}

impl Error {
    /// Whether the session's connection is gone with it, so the next command logs in again:
    /// the connection was lost or refused, the login failed, or the target broke the protocol.
    pub fn ends_the_connection(&self) -> bool {
        matches!(
            self,
            Error::Io(_)
                | Error::Connect { .. }
                | Error::LoginRefused { .. }
                | Error::Negotiation(_)
                | Error::Protocol(_)
                | Error::ConnectionLost(_)
                | Error::LogoutRequested
                | Error::Nvme(
                    crate::nvme::NvmeError::Connection(_) | crate::nvme::NvmeError::Protocol(_)
                )
        )
    }
}

impl From<std::io::Error> for Error {
    fn from(e: std::io::Error) -> Error {
        Error::Io(e)
    }
}

impl From<NegotiationError> for Error {
    fn from(e: NegotiationError) -> Error {
        Error::Negotiation(e)
    }
}

impl From<LoginError> for Error {
    fn from(e: LoginError) -> Error {
        match e {
            LoginError::Refused(status) => Error::LoginRefused {
                status,
                message: login_status_message(status),
            },
            LoginError::Negotiation(e) => Error::Negotiation(e),
            LoginError::Protocol(why) => Error::Protocol(why),
        }
    }
}

impl From<Failure> for Error {
    fn from(f: Failure) -> Error {
        match f {
            Failure::Command(why) => Error::Command(why),
            Failure::Rejected(reason) => Error::Rejected(reason),
            Failure::Aborted => Error::Aborted,
            Failure::ConnectionLost(why) => Error::ConnectionLost(why),
            Failure::TimedOut => Error::Timeout,
        }
    }
}

/// A readable name for a login status.
pub(crate) fn login_status_message(s: LoginStatus) -> &'static str {
    match s {
        LoginStatus::TARGET_MOVED_TEMPORARILY => "target moved temporarily",
        LoginStatus::TARGET_MOVED_PERMANENTLY => "target moved permanently",
        LoginStatus::INITIATOR_ERROR => "initiator error",
        LoginStatus::AUTHENTICATION_FAILURE => "authentication failure",
        LoginStatus::AUTHORIZATION_FAILURE => "authorization failure",
        LoginStatus::NOT_FOUND => "target not found",
        LoginStatus::TARGET_REMOVED => "target removed",
        LoginStatus::UNSUPPORTED_VERSION => "unsupported version",
        LoginStatus::TOO_MANY_CONNECTIONS => "too many connections",
        LoginStatus::MISSING_PARAMETER => "missing parameter",
        LoginStatus::CANT_INCLUDE_IN_SESSION => "can't include in session",
        LoginStatus::SESSION_TYPE_NOT_SUPPORTED => "session type not supported",
        LoginStatus::SESSION_DOES_NOT_EXIST => "session does not exist",
        LoginStatus::INVALID_DURING_LOGIN => "invalid request during login",
        LoginStatus::TARGET_ERROR => "target error",
        LoginStatus::SERVICE_UNAVAILABLE => "service unavailable",
        LoginStatus::OUT_OF_RESOURCES => "out of resources",
        _ => "",
    }
}

/// Result of the initiator library.
pub type Result<T, E = Error> = std::result::Result<T, E>;
