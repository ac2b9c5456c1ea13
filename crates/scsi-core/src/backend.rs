//! What the core asks of storage: block operations on one logical unit, the errors a disk
//! reports, and an in-memory backend for tests, fuzzing and demos.
//!
//! The core never holds payload: an operation names blocks, and the buffer it reads into or
//! writes from is the task's buffer, owned by whoever drives the core (the transport and the
//! backend between them). That is what lets crates/backend read straight into a registered slot
//! that the transport then sends.

use crate::sense::{Asc, Sense, SenseKey};

/// One block operation. Offsets and lengths are in logical blocks of the unit's block size;
/// "the buffer" is the task's data buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Op {
    /// Read `blocks` blocks at `lba` into the buffer at `offset` bytes.
    Read {
        /// First block.
        lba: u64,
        /// Number of blocks.
        blocks: u32,
        /// Byte offset in the buffer.
        offset: u32,
        /// Force unit access: read from the medium, not a volatile cache.
        fua: bool,
    },
    /// Write `blocks` blocks at `lba` from the buffer at `offset` bytes.
    Write {
        /// First block.
        lba: u64,
        /// Number of blocks.
        blocks: u32,
        /// Byte offset in the buffer.
        offset: u32,
        /// Force unit access: durable before completion (RWF_DSYNC).
        fua: bool,
    },
    /// Make written blocks durable (SYNCHRONIZE CACHE); `blocks == 0` means to the end.
    Flush {
        /// First block.
        lba: u64,
        /// Number of blocks, 0 for all.
        blocks: u64,
    },
    /// Deallocate blocks; they read back as zeros afterwards.
    Unmap {
        /// First block.
        lba: u64,
        /// Number of blocks.
        blocks: u64,
    },
    /// Write the first block of the buffer (or zeros when `zeros`) to every block of the range;
    /// with `unmap`, the backend may deallocate instead when the block is all zeros.
    WriteSame {
        /// First block.
        lba: u64,
        /// Number of blocks.
        blocks: u64,
        /// The block is all zeros and not in the buffer (NDOB).
        zeros: bool,
        /// Deallocation is allowed.
        unmap: bool,
        /// Force unit access.
        fua: bool,
    },
    /// Compare the buffer from `offset` with the medium; [`BackendError::Miscompare`] gives the
    /// byte offset (from the first block) of the first difference.
    Compare {
        /// First block.
        lba: u64,
        /// Number of blocks.
        blocks: u32,
        /// Byte offset in the buffer.
        offset: u32,
        /// Compare every block with the buffer's first block (VERIFY with BYTCHK 11b).
        same: bool,
    },
    /// COMPARE AND WRITE: the buffer holds `blocks` blocks to verify, then `blocks` to write.
    /// Atomic with respect to other writes, which the core guarantees by holding the range.
    CompareAndWrite {
        /// First block.
        lba: u64,
        /// Number of blocks.
        blocks: u32,
        /// Force unit access.
        fua: bool,
    },
    /// ORWRITE: OR the buffer into the blocks.
    OrWrite {
        /// First block.
        lba: u64,
        /// Number of blocks.
        blocks: u32,
        /// Force unit access.
        fua: bool,
    },
    /// Report whether `lba` is mapped and how many blocks from it share that state.
    LbaStatus {
        /// The block asked about.
        lba: u64,
    },
    /// Bring blocks into cache (PRE-FETCH); a hint.
    Prefetch {
        /// First block.
        lba: u64,
        /// Number of blocks.
        blocks: u64,
    },
}

/// How a WRITE SAME is carried out: decided once ([`Op::write_same_plan`]) for every
/// backend, which then does each step its own way (a file: fallocate; RBD: librbd's discard,
/// write_zeroes and writesame; memory: writes).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WriteSamePlan {
    /// UNMAP bit set and the block is zeros: deallocate the range (it reads back as zeros).
    Deallocate,
    /// The block is zeros (NDOB, or data of zeros): write zeros the store's cheapest way.
    Zeroes,
    /// Write the block over each block of the range.
    Block,
}

impl Op {
    /// The plan of this WRITE SAME whose data block (unless NDOB) is the first `block_size`
    /// bytes of `buf`; `None` for any other operation. A block of zeros is written as zeros
    /// (not copied block by block) whether it came as NDOB or as data.
    pub fn write_same_plan(&self, buf: &[u8], block_size: usize) -> Option<WriteSamePlan> {
        let Op::WriteSame { unmap, .. } = *self else {
            return None;
        };
        Some(match (self.writes_zero_block(buf, block_size), unmap) {
            (true, true) => WriteSamePlan::Deallocate,
            (true, false) => WriteSamePlan::Zeroes,
            (false, _) => WriteSamePlan::Block,
        })
    }

    /// Whether this is a WRITE SAME of a block of zeros: without data (NDOB), or with a first
    /// `block_size` bytes of `buf` that are all zero.
    fn writes_zero_block(&self, buf: &[u8], block_size: usize) -> bool {
        match self {
            Op::WriteSame { zeros: true, .. } => true,
            Op::WriteSame { .. } => buf
                .get(..block_size)
                .is_some_and(|b| b.iter().all(|&x| x == 0)),
            _ => false,
        }
    }

    /// The bytes of buffer this operation needs, for `block_size`-byte blocks.
    pub fn buffer_len(&self, block_size: u32) -> u64 {
        let bs = u64::from(block_size);
        match *self {
            Op::Read { blocks, offset, .. } | Op::Write { blocks, offset, .. } => {
                u64::from(offset) + u64::from(blocks) * bs
            }
            Op::Compare {
                blocks,
                offset,
                same,
                ..
            } => u64::from(offset) + if same { bs } else { u64::from(blocks) * bs },
            Op::WriteSame { zeros: false, .. } => bs,
            Op::CompareAndWrite { blocks, .. } => 2 * u64::from(blocks) * bs,
            Op::OrWrite { blocks, .. } => u64::from(blocks) * bs,
            _ => 0,
        }
    }

    /// The blocks a writing operation changes: the range the core holds against other writers.
    pub fn written_range(&self) -> Option<(u64, u64)> {
        match *self {
            Op::Write { lba, blocks, .. }
            | Op::CompareAndWrite { lba, blocks, .. }
            | Op::OrWrite { lba, blocks, .. } => Some((lba, u64::from(blocks))),
            Op::Unmap { lba, blocks } | Op::WriteSame { lba, blocks, .. } => Some((lba, blocks)),
            _ => None,
        }
    }
}

/// What a successful operation reports back.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Output {
    /// Done.
    Done,
    /// [`Op::LbaStatus`]: the state of `blocks` blocks from the asked LBA.
    LbaStatus {
        /// Mapped (or anchored) rather than deallocated.
        mapped: bool,
        /// Blocks in that state, at least 1.
        blocks: u64,
    },
}

/// Errors a backend reports, as a disk would; each becomes sense data.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum BackendError {
    /// The medium could not be read (EIO on read): MEDIUM ERROR / UNRECOVERED READ ERROR.
    #[error("unrecovered read error at LBA {lba}")]
    Read {
        /// The first block that failed.
        lba: u64,
    },
    /// The medium could not be written (EIO on write): MEDIUM ERROR / WRITE ERROR.
    #[error("write error at LBA {lba}")]
    Write {
        /// The first block that failed.
        lba: u64,
    },
    /// No space to allocate blocks (ENOSPC): DATA PROTECT / SPACE ALLOCATION FAILED WRITE PROTECT.
    #[error("space allocation failed")]
    NoSpace,
    /// The compared data differs at byte `offset`: MISCOMPARE / MISCOMPARE DURING VERIFY.
    #[error("miscompare at byte {offset}")]
    Miscompare {
        /// Byte offset of the first difference.
        offset: u64,
    },
    /// The backend cannot do this operation: ILLEGAL REQUEST / INVALID COMMAND OPERATION CODE.
    #[error("operation not supported by this backend")]
    Unsupported,
    /// The storage did not answer in time, or is unreachable for now (a networked backend
    /// whose cluster is down): NOT READY / LOGICAL UNIT IS IN PROCESS OF BECOMING READY, which
    /// initiators retry (Linux's SCSI midlayer does, without failing the path).
    #[error("storage unavailable")]
    Unavailable,
    /// The storage refuses writes (a read-only image): DATA PROTECT / WRITE PROTECTED.
    #[error("write protected")]
    WriteProtected,
    /// Anything else: HARDWARE ERROR / INTERNAL TARGET FAILURE.
    #[error("internal target failure")]
    Internal,
}

impl From<BackendError> for Sense {
    fn from(e: BackendError) -> Sense {
        match e {
            BackendError::Read { lba } => Sense {
                information: Some(lba),
                ..Sense::new(SenseKey::MediumError, Asc::UNRECOVERED_READ_ERROR)
            },
            BackendError::Write { lba } => Sense {
                information: Some(lba),
                ..Sense::new(SenseKey::MediumError, Asc::WRITE_ERROR)
            },
            BackendError::NoSpace => Sense::new(
                SenseKey::DataProtect,
                Asc::SPACE_ALLOCATION_FAILED_WRITE_PROTECT,
            ),
            BackendError::Miscompare { offset } => Sense::miscompare(offset),
            BackendError::Unsupported => Sense::invalid_opcode(),
            BackendError::Unavailable => Sense::new(SenseKey::NotReady, Asc::BECOMING_READY),
            BackendError::WriteProtected => Sense::new(SenseKey::DataProtect, Asc::WRITE_PROTECTED),
            BackendError::Internal => {
                Sense::new(SenseKey::HardwareError, Asc::INTERNAL_TARGET_FAILURE)
            }
        }
    }
}

/// A logical unit's storage, as the driver of the core sees it: operations are submitted with
/// the task's buffer and complete later, in any order. Synchronous backends complete inside
/// `submit` and hand the result out on the next `poll_completion`.
pub trait Backend {
    /// The buffer type the backend reads into and writes from.
    type Buffer;

    /// Starts `op` on `buf`; `token` comes back with the completion.
    fn submit(&mut self, token: u64, op: Op, buf: Self::Buffer);

    /// A finished operation, with its token and buffer.
    fn poll_completion(&mut self) -> Option<(u64, Result<Output, BackendError>, Self::Buffer)>;
}

/// Bytes a [`BlockStore`]'s default methods move at a time.
const SCRATCH: usize = 1 << 20;

/// The byte-level primitives of a store that runs operations at once (memory, a file read and
/// written with syscalls). [`execute`] builds every [`Op`] from them, so each store writes only
/// what is its own; the defaults compose the rest from `read` and `write`, a scratch buffer
/// at a time. Byte ranges given to the methods are within the unit ([`execute`] checks).
pub trait BlockStore {
    /// Bytes per block.
    fn block_size(&self) -> u32;
    /// Blocks in the unit.
    fn blocks(&self) -> u64;
    /// Reads `out.len()` bytes at byte `at`.
    fn read(&mut self, at: u64, out: &mut [u8]) -> Result<(), BackendError>;
    /// Writes `data` at byte `at`, on stable storage before it returns when `fua`.
    fn write(&mut self, at: u64, data: &[u8], fua: bool) -> Result<(), BackendError>;
    /// Deallocates `len` bytes at `at`: they read back as zeros.
    fn deallocate(&mut self, at: u64, len: u64) -> Result<(), BackendError>;
    /// Makes everything written so far stable.
    fn flush(&mut self) -> Result<(), BackendError>;
    /// Whether the blocks from `lba` are mapped or deallocated, and for how many.
    fn lba_status(&mut self, lba: u64) -> Result<Output, BackendError>;

    /// Reads `len` bytes at `at` ahead of need (a hint); by default nothing.
    fn prefetch(&mut self, at: u64, len: u64) {
        let _ = (at, len);
    }

    /// Writes `block` (zeros when `None`) over each block of the `len` bytes at `at`.
    fn write_same(
        &mut self,
        at: u64,
        len: usize,
        block: Option<&[u8]>,
        fua: bool,
    ) -> Result<(), BackendError> {
        write_same_by_writes(self, at, len, block, fua)
    }

    /// ORs `data` into the bytes at `at` (ORWRITE).
    fn or_write(&mut self, at: u64, data: &[u8], fua: bool) -> Result<(), BackendError> {
        let mut scratch = vec![0u8; data.len().min(SCRATCH)];
        let mut done = 0;
        while done < data.len() {
            let k = scratch.len().min(data.len() - done);
            let pos = at + done as u64;
            self.read(pos, &mut scratch[..k])?;
            let theirs = &data[done..done + k];
            scratch[..k]
                .iter_mut()
                .zip(theirs)
                .for_each(|(d, s)| *d |= s);
            self.write(pos, &scratch[..k], fua)?;
            done += k;
        }
        Ok(())
    }

    /// Compares the `len` bytes at `at` with `expected`, repeated when it is shorter (one
    /// block, for VERIFY with BYTCHK 11b); a difference is a miscompare at its offset.
    fn compare(&mut self, at: u64, len: usize, expected: &[u8]) -> Result<(), BackendError> {
        let mut scratch = vec![0u8; len.min(SCRATCH)];
        let mut done = 0;
        while done < len {
            let k = scratch.len().min(len - done);
            self.read(at + done as u64, &mut scratch[..k])?;
            for (i, &b) in scratch[..k].iter().enumerate() {
                let j = done + i;
                if b != expected[j % expected.len()] {
                    return Err(BackendError::Miscompare { offset: j as u64 });
                }
            }
            done += k;
        }
        Ok(())
    }
}

/// [`BlockStore::write_same`] by plain writes: `block` (zeros when `None`) repeated in a
/// scratch buffer, written over the range a buffer at a time. For a store whose own way (a
/// zeroing call) does not apply.
pub fn write_same_by_writes<S: BlockStore + ?Sized>(
    store: &mut S,
    at: u64,
    len: usize,
    block: Option<&[u8]>,
    fua: bool,
) -> Result<(), BackendError> {
    let bs = store.block_size() as usize;
    let mut scratch = vec![0u8; len.min(SCRATCH)];
    if let Some(block) = block {
        scratch
            .chunks_mut(bs)
            .for_each(|c| c.copy_from_slice(block));
    }
    let mut done = 0;
    while done < len {
        let k = scratch.len().min(len - done);
        store.write(at + done as u64, &scratch[..k], fua)?;
        done += k;
    }
    Ok(())
}

/// Runs `op` on `buf` now, on `store`: the one reading of every [`Op`] that stores which
/// complete at once share (scsi-core's [`MemoryBackend`], the backend crate's files read and
/// written with syscalls).
pub fn execute(
    store: &mut impl BlockStore,
    op: &Op,
    buf: &mut [u8],
) -> Result<Output, BackendError> {
    let block_size = store.block_size();
    let bs = block_size as usize;
    if (buf.len() as u64) < op.buffer_len(block_size) {
        return Err(BackendError::Internal);
    }
    let blocks_in_unit = store.blocks();
    // The bytes `[at, at + len)` of `blocks` blocks from `lba`, if they are in the unit.
    let bytes = |lba: u64, blocks: u64| match lba.checked_add(blocks) {
        Some(end) if end <= blocks_in_unit => Ok((
            lba * u64::from(block_size),
            (blocks * u64::from(block_size)) as usize,
        )),
        _ => Err(BackendError::Internal),
    };
    match *op {
        Op::Read {
            lba,
            blocks,
            offset,
            ..
        } => {
            let (at, n) = bytes(lba, blocks.into())?;
            let o = offset as usize;
            store.read(at, &mut buf[o..o + n])?;
        }
        Op::Write {
            lba,
            blocks,
            offset,
            fua,
        } => {
            let (at, n) = bytes(lba, blocks.into())?;
            let o = offset as usize;
            store.write(at, &buf[o..o + n], fua)?;
        }
        Op::Flush { .. } => store.flush()?,
        Op::Prefetch { lba, blocks } => {
            let (at, n) = bytes(lba, blocks)?;
            store.prefetch(at, n as u64);
        }
        Op::Unmap { lba, blocks } => {
            let (at, n) = bytes(lba, blocks)?;
            store.deallocate(at, n as u64)?;
        }
        Op::WriteSame {
            lba, blocks, fua, ..
        } => {
            let (at, n) = bytes(lba, blocks)?;
            match op.write_same_plan(buf, bs) {
                Some(WriteSamePlan::Deallocate) => store.deallocate(at, n as u64)?,
                Some(WriteSamePlan::Zeroes) => store.write_same(at, n, None, fua)?,
                _ => store.write_same(at, n, Some(&buf[..bs]), fua)?,
            }
        }
        Op::Compare {
            lba,
            blocks,
            offset,
            same,
        } => {
            let (at, n) = bytes(lba, blocks.into())?;
            let o = offset as usize;
            store.compare(at, n, &buf[o..o + if same { bs } else { n }])?;
        }
        Op::CompareAndWrite { lba, blocks, fua } => {
            let (at, n) = bytes(lba, blocks.into())?;
            store.compare(at, n, &buf[..n])?;
            store.write(at, &buf[n..2 * n], fua)?;
        }
        Op::OrWrite { lba, blocks, fua } => {
            let (at, n) = bytes(lba, blocks.into())?;
            store.or_write(at, &buf[..n], fua)?;
        }
        Op::LbaStatus { lba } => {
            if lba >= blocks_in_unit {
                return Err(BackendError::Internal);
            }
            return store.lba_status(lba);
        }
    }
    Ok(Output::Done)
}

/// Chunk size of [`MemoryBackend`]: the unit of allocation and deallocation.
pub const MEMORY_CHUNK: usize = 64 * 1024;

/// A thin RAM disk: storage is allocated in 64 KiB chunks on first write and freed by UNMAP, so a
/// terabyte-sized unit costs nothing until written. Operations complete synchronously.
#[derive(Debug)]
pub struct MemoryBackend {
    block_size: u32,
    blocks: u64,
    chunks: Vec<Option<Box<[u8]>>>,
    completions: std::collections::VecDeque<(u64, Result<Output, BackendError>, Vec<u8>)>,
}

impl MemoryBackend {
    /// A unit of `blocks` blocks of `block_size` bytes (a power of two, at most 64 KiB).
    pub fn new(block_size: u32, blocks: u64) -> MemoryBackend {
        assert!(block_size.is_power_of_two() && block_size as usize <= MEMORY_CHUNK);
        let bytes = blocks * u64::from(block_size);
        let chunks = bytes.div_ceil(MEMORY_CHUNK as u64) as usize;
        MemoryBackend {
            block_size,
            blocks,
            chunks: (0..chunks).map(|_| None).collect(),
            completions: Default::default(),
        }
    }

    /// Bytes currently allocated.
    pub fn allocated(&self) -> usize {
        self.chunks.iter().flatten().count() * MEMORY_CHUNK
    }

    /// Copies bytes `[at, at + out.len())` of the unit into `out`.
    pub fn read_bytes(&self, mut at: u64, out: &mut [u8]) {
        let mut done = 0;
        while done < out.len() {
            let chunk = (at / MEMORY_CHUNK as u64) as usize;
            let within = (at % MEMORY_CHUNK as u64) as usize;
            let n = (MEMORY_CHUNK - within).min(out.len() - done);
            match &self.chunks[chunk] {
                Some(c) => out[done..done + n].copy_from_slice(&c[within..within + n]),
                None => out[done..done + n].fill(0),
            }
            done += n;
            at += n as u64;
        }
    }

    /// Applies `f(unit_bytes, data_bytes)` over bytes `[at, at + data.len())` of the unit,
    /// allocating chunks as needed.
    fn update(&mut self, mut at: u64, data: &[u8], f: impl Fn(&mut [u8], &[u8])) {
        let mut done = 0;
        while done < data.len() {
            let chunk = (at / MEMORY_CHUNK as u64) as usize;
            let within = (at % MEMORY_CHUNK as u64) as usize;
            let n = (MEMORY_CHUNK - within).min(data.len() - done);
            let c = self.chunks[chunk].get_or_insert_with(|| vec![0; MEMORY_CHUNK].into());
            f(&mut c[within..within + n], &data[done..done + n]);
            done += n;
            at += n as u64;
        }
    }

    /// Runs `op` on `buf` now ([`execute`]).
    pub fn execute(&mut self, op: &Op, buf: &mut [u8]) -> Result<Output, BackendError> {
        execute(self, op, buf)
    }
}

/// Memory: chunks allocated on first write and freed by deallocation.
impl BlockStore for MemoryBackend {
    fn block_size(&self) -> u32 {
        self.block_size
    }

    fn blocks(&self) -> u64 {
        self.blocks
    }

    fn read(&mut self, at: u64, out: &mut [u8]) -> Result<(), BackendError> {
        self.read_bytes(at, out);
        Ok(())
    }

    fn write(&mut self, at: u64, data: &[u8], _fua: bool) -> Result<(), BackendError> {
        self.update(at, data, |d, s| d.copy_from_slice(s));
        Ok(())
    }

    /// Zeros the bytes, freeing whole chunks.
    fn deallocate(&mut self, at: u64, len: u64) -> Result<(), BackendError> {
        let (mut at, end) = (at, at + len);
        while at < end {
            let chunk = (at / MEMORY_CHUNK as u64) as usize;
            let within = (at % MEMORY_CHUNK as u64) as usize;
            let n = ((MEMORY_CHUNK - within) as u64).min(end - at) as usize;
            if n == MEMORY_CHUNK {
                self.chunks[chunk] = None;
            } else if let Some(c) = &mut self.chunks[chunk] {
                c[within..within + n].fill(0);
            }
            at += n as u64;
        }
        Ok(())
    }

    fn flush(&mut self) -> Result<(), BackendError> {
        Ok(())
    }

    /// Chunks allocated or not, from the one holding `lba`.
    fn lba_status(&mut self, lba: u64) -> Result<Output, BackendError> {
        let per_chunk = (MEMORY_CHUNK / self.block_size as usize) as u64;
        let first = (lba / per_chunk) as usize;
        let mapped = self.chunks[first].is_some();
        let same = self.chunks[first..]
            .iter()
            .take_while(|c| c.is_some() == mapped)
            .count() as u64;
        let end = ((first as u64 + same) * per_chunk).min(self.blocks);
        Ok(Output::LbaStatus {
            mapped,
            blocks: end - lba,
        })
    }

    /// In place, chunk by chunk, without a scratch copy.
    fn or_write(&mut self, at: u64, data: &[u8], _fua: bool) -> Result<(), BackendError> {
        self.update(at, data, |d, s| {
            d.iter_mut().zip(s).for_each(|(d, s)| *d |= s)
        });
        Ok(())
    }
}

impl Backend for MemoryBackend {
    type Buffer = Vec<u8>;

    fn submit(&mut self, token: u64, op: Op, mut buf: Vec<u8>) {
        let result = self.execute(&op, &mut buf);
        self.completions.push_back((token, result, buf));
    }

    fn poll_completion(&mut self) -> Option<(u64, Result<Output, BackendError>, Vec<u8>)> {
        self.completions.pop_front()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// One plan for every backend: zeros (NDOB or data) with UNMAP deallocate, zeros without
    /// it are written as zeros, anything else block by block.
    #[test]
    fn write_same_plans() {
        let same = |zeros: bool, unmap: bool| Op::WriteSame {
            lba: 0,
            blocks: 8,
            zeros,
            unmap,
            fua: false,
        };
        let (zero, data) = ([0u8; 512], [1u8; 512]);
        use WriteSamePlan::*;
        for (op, buf, plan) in [
            (same(true, true), &[][..], Deallocate),
            (same(false, true), &zero[..], Deallocate),
            (same(false, true), &data[..], Block),
            (same(true, false), &[][..], Zeroes),
            (same(false, false), &zero[..], Zeroes),
            (same(false, false), &data[..], Block),
        ] {
            assert_eq!(op.write_same_plan(buf, 512), Some(plan), "{op:?}");
        }
        let flush = Op::Flush { lba: 0, blocks: 0 };
        assert_eq!(flush.write_same_plan(&[], 512), None);
    }

    #[test]
    fn memory_backend_reads_what_was_written_and_unmaps() {
        let mut m = MemoryBackend::new(512, 1 << 20);
        assert_eq!(m.allocated(), 0);
        let mut buf = vec![7u8; 4096];
        let w = Op::Write {
            lba: 127,
            blocks: 8,
            offset: 0,
            fua: false,
        };
        m.execute(&w, &mut buf).unwrap();
        assert_eq!(
            m.allocated(),
            2 * MEMORY_CHUNK,
            "the write straddles two chunks"
        );
        let mut out = vec![0u8; 5120];
        let r = Op::Read {
            lba: 126,
            blocks: 10,
            offset: 0,
            fua: false,
        };
        m.execute(&r, &mut out).unwrap();
        assert!(out[..512].iter().all(|&b| b == 0));
        assert!(out[512..4608].iter().all(|&b| b == 7));
        assert!(out[4608..].iter().all(|&b| b == 0));
        assert_eq!(
            m.execute(&Op::LbaStatus { lba: 0 }, &mut []).unwrap(),
            Output::LbaStatus {
                mapped: true,
                blocks: 256
            }
        );
        m.execute(
            &Op::Unmap {
                lba: 0,
                blocks: 128,
            },
            &mut [],
        )
        .unwrap();
        assert_eq!(m.allocated(), MEMORY_CHUNK);
        assert_eq!(
            m.execute(&Op::LbaStatus { lba: 3 }, &mut []).unwrap(),
            Output::LbaStatus {
                mapped: false,
                blocks: 125
            }
        );
        let cmp = Op::Compare {
            lba: 128,
            blocks: 7,
            offset: 0,
            same: true,
        };
        m.execute(&cmp, &mut buf).unwrap();
        buf[..512].fill(8);
        assert_eq!(
            m.execute(&cmp, &mut buf),
            Err(BackendError::Miscompare { offset: 0 })
        );
        let caw = Op::CompareAndWrite {
            lba: 128,
            blocks: 1,
            fua: false,
        };
        let mut caw_buf = [[7u8; 512], [9u8; 512]].concat();
        caw_buf[100] = 0;
        assert_eq!(
            m.execute(&caw, &mut caw_buf),
            Err(BackendError::Miscompare { offset: 100 })
        );
        caw_buf[100] = 7;
        m.execute(&caw, &mut caw_buf).unwrap();
        m.execute(&r, &mut out).unwrap();
        assert!(out[1024..1536].iter().all(|&b| b == 9));
        assert!(m.execute(&r, &mut [0u8; 10]).is_err(), "short buffer");
        let beyond = Op::Read {
            lba: (1 << 20) - 1,
            blocks: 2,
            offset: 0,
            fua: false,
        };
        assert!(m.execute(&beyond, &mut out).is_err());
    }
}
