//! Storage backends for scsi-core, on io_uring with a registered buffer arena.
//!
//! The zero-copy path (docs/architecture.md, "The path of a read"): each reactor owns one [`Arena`] (a mapping cut into
//! slots) and one [`Engine`] (an io_uring with that arena registered as a fixed buffer and the
//! backing files as fixed files). A read lands in a slot that the transport then sends; a write
//! is received into a slot and written from it. Where io_uring cannot be set up, or the config
//! says so, the engine is a thread pool with the same interface.
//!
//! Backends implement [`scsi_core::Backend`] with [`Buffer`] as their buffer type:
//! - [`FileBackend`]: a regular file or block device, thin through hole punching.
//! - [`MemoryBackend`]: a thin RAM disk.
//! - [`NullBackend`]: reads zeros, discards writes.
//! - `rbd::RbdBackend` (feature `rbd`): a Ceph RBD image on librbd's asynchronous API.
//!
//! [`passed`] takes the descriptors a service manager passed at start (sd_listen_fds(3)): it
//! needs unsafe code, which lives here and not in the daemon.
//!
//! [`AnyBackend`] is whichever of the three a logical unit's config names; [`Faulty`] wraps any
//! backend to fail chosen operations as a failing disk would.

pub mod arena;
mod engine;
pub mod fault;
pub mod file;
mod immediate;
pub mod passed;
mod pool;
#[cfg(feature = "rbd")]
pub mod rbd;

pub use arena::{Alloc, Arena, ArenaConfig, ArenaError, Buffer, HugePages, Share, ShareAlloc};
#[cfg(feature = "tokio")]
pub use engine::Readiness;
pub use engine::{
    BufferedWrites, Engine, EngineChoice, EngineConfig, EngineKind, FileBackend, UringSupport,
    NOWAIT_PROBES,
};
pub use fault::{Fault, FaultError, FaultOps, Faults, Faulty};
pub use file::{FileConfig, FileHandle, OpenError};
pub use immediate::{Execute, Immediate, MemoryBackend, Null, NullBackend, SharedMemoryBackend};

use scsi_core::{Backend, BackendError, Op, Output};

/// Any backend a logical unit may have.
#[derive(Debug)]
pub enum AnyBackend {
    /// A file or block device on the reactor's engine.
    File(FileBackend),
    /// A RAM disk.
    Memory(MemoryBackend),
    /// A RAM disk shared between reactors.
    SharedMemory(SharedMemoryBackend),
    /// Zeros in, nothing out.
    Null(NullBackend),
    /// A Ceph RBD image.
    #[cfg(feature = "rbd")]
    Rbd(rbd::RbdBackend),
}

impl AnyBackend {
    /// Block size in bytes.
    pub fn block_size(&self) -> u32 {
        match self {
            AnyBackend::File(f) => f.file().block_size(),
            AnyBackend::Memory(m) => m.block_size(),
            AnyBackend::SharedMemory(m) => m.block_size(),
            AnyBackend::Null(n) => n.block_size(),
            #[cfg(feature = "rbd")]
            AnyBackend::Rbd(r) => r.block_size(),
        }
    }

    /// Capacity in blocks.
    pub fn blocks(&self) -> u64 {
        match self {
            AnyBackend::File(f) => f.file().blocks(),
            AnyBackend::Memory(m) => m.blocks(),
            AnyBackend::SharedMemory(m) => m.blocks(),
            AnyBackend::Null(n) => n.blocks(),
            #[cfg(feature = "rbd")]
            AnyBackend::Rbd(r) => r.blocks(),
        }
    }
}

impl Backend for AnyBackend {
    type Buffer = Buffer;

    fn submit(&mut self, token: u64, op: Op, buf: Buffer) {
        match self {
            AnyBackend::File(f) => f.submit(token, op, buf),
            AnyBackend::Memory(m) => m.submit(token, op, buf),
            AnyBackend::SharedMemory(m) => m.submit(token, op, buf),
            AnyBackend::Null(n) => n.submit(token, op, buf),
            #[cfg(feature = "rbd")]
            AnyBackend::Rbd(r) => r.submit(token, op, buf),
        }
    }

    fn poll_completion(&mut self) -> Option<(u64, Result<Output, BackendError>, Buffer)> {
        match self {
            AnyBackend::File(f) => f.poll_completion(),
            AnyBackend::Memory(m) => m.poll_completion(),
            AnyBackend::SharedMemory(m) => m.poll_completion(),
            AnyBackend::Null(n) => n.poll_completion(),
            #[cfg(feature = "rbd")]
            AnyBackend::Rbd(r) => r.poll_completion(),
        }
    }
}
