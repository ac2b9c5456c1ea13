//! The `memory` and `null` backends: they complete inside `submit`, so they need no engine and
//! serve tests, demos and protocol benchmarks (null measures the protocol path alone, as tgt's
//! null store does).

use std::collections::VecDeque;
use std::sync::{Arc, Mutex, PoisonError};

use scsi_core::{Backend, BackendError, Op, Output};

use crate::arena::Buffer;

/// Storage that runs an operation on a contiguous buffer at once.
pub trait Execute {
    /// Runs `op` on `buf`.
    fn execute(&mut self, op: &Op, buf: &mut [u8]) -> Result<Output, BackendError>;
}

impl Execute for scsi_core::MemoryBackend {
    fn execute(&mut self, op: &Op, buf: &mut [u8]) -> Result<Output, BackendError> {
        scsi_core::MemoryBackend::execute(self, op, buf)
    }
}

/// Storage shared between reactors: each runs its operations under the lock.
impl<E: Execute> Execute for Arc<Mutex<E>> {
    fn execute(&mut self, op: &Op, buf: &mut [u8]) -> Result<Output, BackendError> {
        self.lock()
            .unwrap_or_else(PoisonError::into_inner)
            .execute(op, buf)
    }
}

/// Reads return zeros, writes are discarded, compares succeed against zeros, every block
/// reports deallocated.
#[derive(Debug, Clone, Copy, Default)]
pub struct Null {
    block_size: u32,
}

impl Execute for Null {
    fn execute(&mut self, op: &Op, buf: &mut [u8]) -> Result<Output, BackendError> {
        let bs = self.block_size as usize;
        match *op {
            // Zero the buffer: a slot may hold another command's data.
            Op::Read { blocks, offset, .. } => {
                let o = offset as usize;
                buf[o..o + blocks as usize * bs].fill(0);
            }
            Op::Compare {
                blocks,
                offset,
                same,
                ..
            } => {
                let o = offset as usize;
                let n = if same { bs } else { blocks as usize * bs };
                if let Some(i) = buf[o..o + n].iter().position(|&b| b != 0) {
                    return Err(BackendError::Miscompare { offset: i as u64 });
                }
            }
            Op::CompareAndWrite { blocks, .. } => {
                let n = blocks as usize * bs;
                if let Some(i) = buf[..n].iter().position(|&b| b != 0) {
                    return Err(BackendError::Miscompare { offset: i as u64 });
                }
            }
            Op::LbaStatus { .. } => {
                return Ok(Output::LbaStatus {
                    mapped: false,
                    blocks: u64::from(u32::MAX),
                })
            }
            _ => {}
        }
        Ok(Output::Done)
    }
}

/// A backend whose operations complete inside `submit`, handed out on the next poll.
#[derive(Debug)]
pub struct Immediate<E> {
    storage: E,
    block_size: u32,
    blocks: u64,
    done: VecDeque<(u64, Result<Output, BackendError>, Buffer)>,
}

/// A thin RAM disk (64 KiB chunks allocated on first write, freed by UNMAP).
pub type MemoryBackend = Immediate<scsi_core::MemoryBackend>;

/// Zeros in, nothing out.
pub type NullBackend = Immediate<Null>;

/// A RAM disk that several reactors reach: one [`scsi_core::MemoryBackend`] behind a lock.
pub type SharedMemoryBackend = Immediate<Arc<Mutex<scsi_core::MemoryBackend>>>;

impl<E> Immediate<E> {
    /// A backend over `storage` of `blocks` blocks of `block_size` bytes.
    pub fn new(storage: E, block_size: u32, blocks: u64) -> Immediate<E> {
        Immediate {
            storage,
            block_size,
            blocks,
            done: VecDeque::with_capacity(64),
        }
    }

    /// Block size in bytes.
    pub fn block_size(&self) -> u32 {
        self.block_size
    }

    /// Capacity in blocks.
    pub fn blocks(&self) -> u64 {
        self.blocks
    }

    /// The storage behind it.
    pub fn storage(&self) -> &E {
        &self.storage
    }
}

impl MemoryBackend {
    /// A RAM disk of `blocks` blocks of `block_size` bytes.
    pub fn memory(block_size: u32, blocks: u64) -> MemoryBackend {
        Immediate::new(
            scsi_core::MemoryBackend::new(block_size, blocks),
            block_size,
            blocks,
        )
    }
}

impl NullBackend {
    /// A null unit of `blocks` blocks of `block_size` bytes.
    pub fn null(block_size: u32, blocks: u64) -> NullBackend {
        Immediate::new(Null { block_size }, block_size, blocks)
    }
}

impl<E: Execute> Backend for Immediate<E> {
    type Buffer = Buffer;

    fn submit(&mut self, token: u64, op: Op, mut buf: Buffer) {
        let result = if (buf.len() as u64) < op.buffer_len(self.block_size) {
            Err(BackendError::Internal)
        } else {
            self.storage.execute(&op, &mut buf)
        };
        self.done.push_back((token, result, buf));
    }

    fn poll_completion(&mut self) -> Option<(u64, Result<Output, BackendError>, Buffer)> {
        self.done.pop_front()
    }
}
