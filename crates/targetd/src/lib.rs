//! targetd, the iSCSI target daemon: `cargo run --release --bin targetd -- config.toml`.
//!
//! - [`config`]: the schema of ../../DESIGN.md, checked so a bad file is refused at start with
//!   the key and the reason.
//! - [`server`]: listeners, reactors, reload and drain; [`reactor`]: one thread per core with
//!   its own io_uring engine and buffer arena.
//! - [`target`]: a target's SCSI device (crates/scsi-core) and logical units (crates/backend).
//! - [`iscsi`]: login, discovery, sessions and the full feature phase over TCP.
//! - [`admin`]: the `targetctl` socket and the Prometheus endpoint.

pub mod admin;
pub mod config;
pub mod iscsi;
pub mod reactor;
pub mod server;
pub mod target;

pub use config::{Config, ConfigError};
pub use server::{Server, Shared, StartError};
