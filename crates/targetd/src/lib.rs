//! targetd, the iSCSI target daemon (issue 5, in progress). This first part is its
//! configuration: the schema of ../../DESIGN.md, parsed and checked so that a bad file is refused
//! at start with the key and the reason. The daemon, its reactors and `targetctl` follow.

pub mod config;

pub use config::{Config, ConfigError};
