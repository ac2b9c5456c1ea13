//! An async iSCSI initiator (tokio) built on `iscsi-pdu`, and the `initiator-bench` load
//! generator that tests, benchmarks and compares targets.
//!
//! ```no_run
//! # async fn demo() -> initiator_bench::Result<()> {
//! use initiator_bench::{IscsiUrl, LoginOptions, Session};
//!
//! let url = IscsiUrl::parse("iscsi://127.0.0.1/iqn.2026-11.io.example:disk1/0")?;
//! let session = Session::connect(&url, LoginOptions::default()).await?;
//! let (blocks, block_size) = session.capacity().await?;
//! let first = session.read(0, 8, block_size).await?;
//! session.logout().await?;
//! # let _ = (blocks, first); Ok(()) }
//! ```

pub mod error;
pub mod login;
pub mod multipath;
pub mod nvme;
pub mod portal;
pub mod scsi;
pub mod session;
pub mod trace;
pub mod url;

pub use error::{Error, Result};
pub use login::LoginOptions;
pub use scsi::{Command, Response, Sense};
pub use session::{discover, DiscoveredTarget, PendingCommand, Session};
pub use url::IscsiUrl;
pub mod iser;
pub mod nvme_rdma;
pub mod plot;
pub mod proxy;
pub mod rdma;
pub mod srp;
pub mod workload;
