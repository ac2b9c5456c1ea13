//! iSCSI over TCP (RFC 7143): the login phase, discovery and normal sessions, and the wire.

pub mod connection;
pub mod handover;
pub mod login;
pub mod session;
pub mod throttle;
pub mod wire;
