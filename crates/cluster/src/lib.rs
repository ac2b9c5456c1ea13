//! Several storage gateways as one target, as a sans-IO machine.
//!
//! Each gateway of a cluster runs a [`gateway::Gateway`]: it decides changes to the
//! reservations of shared units (asked by SCSI initiators or NVMe hosts, [`ask`]) by
//! compare-and-swap over an object per unit, tells the other
//! gateways by notify and fences those that do not answer before a change completes; it asks
//! who is alive and derives every unit's ALUA port groups from the answer
//! ([`member::Membership::port_groups`]); and when it loses its own session it turns its
//! paths unavailable and rejoins with a growing delay. The machine takes outcomes,
//! notifications and `now`, and hands out requests for the object store and events for the
//! targets; it owns no thread, socket or clock. targetd's shell carries the requests out on
//! RADOS (crates/targetd/src/cluster/keeper.rs); the test kit (`testing`, feature `testing`) on an
//! in-memory store with gateways on a virtual clock that can go silent, be killed, race and
//! lose notifies. Whole targets are compared across gateways by [`definition`]: the last
//! one edited is recorded, the others warn where they differ.
#![forbid(unsafe_code)]

pub mod ask;
pub mod change;
pub mod definition;
pub mod gateway;
pub mod member;
pub mod store;
#[cfg(feature = "testing")]
pub mod testing;

pub use gateway::{Event, Gateway, Lane, Outcome, Request, Settings, Watched};
pub use member::{Member, Membership, PathPolicy, Preference};
