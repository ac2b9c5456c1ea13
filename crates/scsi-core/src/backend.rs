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

impl Op {
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

    fn byte_range(&self, lba: u64, blocks: u64) -> Result<(u64, u64), BackendError> {
        match lba.checked_add(blocks) {
            Some(end) if end <= self.blocks => {
                let bs = u64::from(self.block_size);
                Ok((lba * bs, end * bs))
            }
            _ => Err(BackendError::Internal),
        }
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

    /// Zeros bytes `[start, end)`, freeing whole chunks.
    fn deallocate(&mut self, start: u64, end: u64) {
        let mut at = start;
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
    }

    fn compare(&self, at: u64, expected: &[u8]) -> Result<(), BackendError> {
        let mut block = vec![0u8; expected.len().min(MEMORY_CHUNK)];
        let mut done = 0;
        while done < expected.len() {
            let n = block.len().min(expected.len() - done);
            self.read_bytes(at + done as u64, &mut block[..n]);
            if let Some(i) = block[..n]
                .iter()
                .zip(&expected[done..done + n])
                .position(|(a, b)| a != b)
            {
                return Err(BackendError::Miscompare {
                    offset: (done + i) as u64,
                });
            }
            done += n;
        }
        Ok(())
    }

    /// Runs `op` on `buf` now.
    pub fn execute(&mut self, op: &Op, buf: &mut [u8]) -> Result<Output, BackendError> {
        let bs = self.block_size as usize;
        if (buf.len() as u64) < op.buffer_len(self.block_size) {
            return Err(BackendError::Internal);
        }
        match *op {
            Op::Read {
                lba,
                blocks,
                offset,
                ..
            } => {
                let (start, end) = self.byte_range(lba, blocks.into())?;
                let o = offset as usize;
                self.read_bytes(start, &mut buf[o..o + (end - start) as usize]);
            }
            Op::Write {
                lba,
                blocks,
                offset,
                ..
            } => {
                let (start, end) = self.byte_range(lba, blocks.into())?;
                let o = offset as usize;
                self.update(start, &buf[o..o + (end - start) as usize], |d, s| {
                    d.copy_from_slice(s)
                });
            }
            Op::Flush { .. } | Op::Prefetch { .. } => {}
            Op::Unmap { lba, blocks } => {
                let (start, end) = self.byte_range(lba, blocks)?;
                self.deallocate(start, end);
            }
            Op::WriteSame {
                lba,
                blocks,
                zeros,
                unmap,
                ..
            } => {
                let (start, end) = self.byte_range(lba, blocks)?;
                let block = if zeros { None } else { Some(&buf[..bs]) };
                if block.is_none_or(|b| b.iter().all(|&x| x == 0)) && unmap {
                    self.deallocate(start, end);
                } else {
                    let zero = vec![0u8; bs];
                    let block = block.unwrap_or(&zero).to_vec();
                    let mut at = start;
                    while at < end {
                        self.update(at, &block, |d, s| d.copy_from_slice(s));
                        at += bs as u64;
                    }
                }
            }
            Op::Compare {
                lba,
                blocks,
                offset,
                same,
            } => {
                let (start, end) = self.byte_range(lba, blocks.into())?;
                let o = offset as usize;
                if same {
                    let mut at = start;
                    while at < end {
                        self.compare(at, &buf[o..o + bs]).map_err(|e| match e {
                            BackendError::Miscompare { offset } => BackendError::Miscompare {
                                offset: at - start + offset,
                            },
                            e => e,
                        })?;
                        at += bs as u64;
                    }
                } else {
                    self.compare(start, &buf[o..o + (end - start) as usize])?;
                }
            }
            Op::CompareAndWrite { lba, blocks, .. } => {
                let (start, end) = self.byte_range(lba, blocks.into())?;
                let n = (end - start) as usize;
                self.compare(start, &buf[..n])?;
                self.update(start, &buf[n..2 * n], |d, s| d.copy_from_slice(s));
            }
            Op::OrWrite { lba, blocks, .. } => {
                let (start, end) = self.byte_range(lba, blocks.into())?;
                self.update(start, &buf[..(end - start) as usize], |d, s| {
                    d.iter_mut().zip(s).for_each(|(d, s)| *d |= s)
                });
            }
            Op::LbaStatus { lba } => {
                if lba >= self.blocks {
                    return Err(BackendError::Internal);
                }
                let per_chunk = (MEMORY_CHUNK / bs) as u64;
                let first = (lba / per_chunk) as usize;
                let mapped = self.chunks[first].is_some();
                let same = self.chunks[first..]
                    .iter()
                    .take_while(|c| c.is_some() == mapped)
                    .count() as u64;
                let end = ((first as u64 + same) * per_chunk).min(self.blocks);
                return Ok(Output::LbaStatus {
                    mapped,
                    blocks: end - lba,
                });
            }
        }
        Ok(Output::Done)
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
