//! RDMA verbs for the storage target's RDMA transports: SRP, iSER, and NVMe over RDMA to come.
//! Each transport's sans-IO machines decide what to send and which of the peer's memory to
//! read or write; their shells carry that out on these verbs.
//!
//! - [`verbs`]: the [`Verbs`](verbs::Verbs) trait (receives, sends, RDMA READ and WRITE over a
//!   list of [`RemoteRegion`](verbs::RemoteRegion)s, completions that give every buffer
//!   back), [`PeerMemory`](verbs::PeerMemory) (memory the peer reaches) and
//!   [`MessageBuffers`](verbs::MessageBuffers).
//! - [`fabric`]: a software fabric in the process, with keys, bounds and access checked as a
//!   device would, and injected costs on a virtual clock: what tests, fuzzing and the
//!   experiments run on, since most machines have no RDMA device.
//! - [`switch`]: that fabric shared between threads, with rdma_cm's shape of connection setup
//!   (listen, connect with private data, accept or reject).
//! - `ibverbs` (feature `ibverbs`): real devices through libibverbs and librdmacm.
//!
//! A transport's own wire forms stay in its crate: SRP's memory descriptors and iSER's STags
//! become [`RemoteRegion`](verbs::RemoteRegion)s where they are decoded.
#![cfg_attr(not(feature = "ibverbs"), forbid(unsafe_code))]
#![cfg_attr(feature = "ibverbs", deny(unsafe_code))]

pub mod fabric;
#[cfg(feature = "ibverbs")]
pub mod ibverbs;
pub mod switch;
pub mod verbs;
