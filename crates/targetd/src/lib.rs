//! targetd, the storage target daemon (iSCSI, iSER, SRP, NVMe/TCP): `cargo run --release --bin targetd -- config.toml`.
//!
//! - [`config`]: the config file's schema (config.toml in the repository shows every key),
//!   checked so a bad file is refused at start with the key and the reason;
//!   [`config_file`]: `config save` over the administrator's file, comments and layout kept.
//! - [`registry`]: the targets, sessions and connections every part shares, the login policy
//!   and reloads (its counters and the RDMA channels' table in modules of their own);
//!   [`server`]: listeners, reactors and drain; [`reactor`]: one thread per core with its own
//!   io_uring engine and buffer arena, running the tasks it is handed.
//! - [`carrier`]: what every transport's shell does with its machine's events on a reactor,
//!   written once; [`fabric`] and [`port`]: what an RDMA port runs on and its task.
//! - [`target`]: a target's SCSI device (crates/scsi-core) and logical units (crates/backend);
//!   `rbd` (feature `rbd`): units on Ceph RBD images; `cluster` (feature `rbd`): several
//!   gateways as one target, their units' reservations kept in RADOS.
//! - [`iscsi`]: login, discovery, sessions and the full feature phase over TCP; [`iser`]: the
//!   same over RDMA; [`srp`]: SRP target ports; [`nvme`]: NVM subsystems and their namespaces
//!   over NVMe/TCP.
//! - [`handover`], [`upgrade`] and [`takeover`]: `targetctl upgrade`, live sessions handed
//!   to a new binary (the frames, the running process's half, the successor's).
//! - [`admin`]: the `targetctl` socket; [`metrics`]: the Prometheus endpoint; [`notify`]:
//!   readiness for systemd (`Type=notify`); [`manual`]: man pages and completions of the
//!   programs.

pub mod admin;
pub mod carrier;
pub mod cluster;
pub mod config;
pub mod config_file;
pub mod control;
pub mod fabric;
pub mod fdstore;
pub mod handover;
pub mod iscsi;
pub mod iser;
pub mod manual;
pub mod metrics;
pub mod notify;
pub mod nvme;
pub mod port;
#[cfg(feature = "rbd")]
pub mod rbd;
pub mod reactor;
pub mod registry;
pub mod server;
pub mod srp;
pub mod store;
pub mod takeover;
pub mod target;
pub mod trace;
pub mod unit;
pub mod upgrade;

pub use config::{Config, ConfigError};

/// Locks `m`, also after a thread panicked holding it (the daemon's state stays usable: every
/// critical section leaves it consistent).
pub(crate) fn lock<T>(m: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}
pub use registry::Registry;
pub use server::{Server, StartError};
