//! The transport-agnostic SCSI target core, sans-IO: transports hand in commands and get back
//! what to do; nothing here owns a socket, a thread or a clock.
//!
//! A [`Device`] is a SCSI target device: logical units, the I_T nexuses that reach it and
//! their task sets. A transport opens a nexus per initiator port, [submits](Device::submit)
//! commands and [polls](Device::poll) [`Action`]s: fetch data-out, run a backend [`Op`],
//! complete with status, sense and residual. Backend completions come back through
//! [`Device::backend_done`]. Payload stays in buffers the transport and backend own; the core
//! reads only parameter lists. [`testing::Harness`] joins a device to in-memory backends for
//! tests, fuzzing and benchmarks.
//!
//! Modules follow the standards: [`sense`], [`cdb`], SPC commands under [`spc`], SBC commands
//! under [`sbc`], persistent reservations in [`pr`], initiator ports in [`nexus`], the task
//! vocabulary in [`task`], and the [`backend`] interface.
#![forbid(unsafe_code)]

pub mod backend;
pub mod cdb;
mod device;
mod dispatch;
pub mod lu;
pub mod nexus;
pub mod pr;
mod router;
pub mod sbc;
pub mod sealed;
pub mod sense;
pub mod spc;
pub mod task;
#[cfg(feature = "testing")]
pub mod testing;
pub mod transport;

pub use backend::{Backend, BackendError, BlockStore, MemoryBackend, Op, Output, WriteSamePlan};
pub use cdb::BlockIo;
pub use device::{
    lun_index, lun_number, Device, DeviceError, PortGroupsChange, ReservationChange, TaskError,
    UnitState, MAX_LUN,
};
pub use lu::{Geometry, Identity, Limits, LogicalUnit, TargetPort};
pub use nexus::{ItNexus, TransportId};
pub use sense::{Asc, FieldIn, FieldPointer, Sense, SenseBytes, SenseKey};
pub use task::{
    Action, Command, DataIn, Delegation, NexusId, Outcome, Residual, Status, TaskAttribute, TaskId,
    TmfFunction, TmfResponse,
};
