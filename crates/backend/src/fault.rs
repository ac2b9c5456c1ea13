//! Fault injection: a wrapper that fails chosen operations of any backend with the error a
//! failing disk would give, so the path from a backend error to the initiator's sense data can
//! be tested on healthy storage, and operators can rehearse a failing disk (`targetctl lun
//! fault`).
//!
//! The wrapper costs one relaxed atomic load per operation while nothing is armed. A failed
//! operation completes without reaching the wrapped backend: nothing of a failed write is
//! written, as a disk that reports a write error makes no promise either way.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;

use scsi_core::{Backend, BackendError, Op, Output};

use crate::file::errno_to_error;

/// Which operations a [`Fault`] fails.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum FaultOps {
    /// Reads, compares, PRE-FETCH and GET LBA STATUS.
    Read,
    /// Everything that changes blocks: writes, WRITE SAME, UNMAP, COMPARE AND WRITE, ORWRITE.
    Write,
    /// SYNCHRONIZE CACHE.
    Flush,
    /// Every operation.
    All,
}

/// The error a [`Fault`] gives, as the errno a file or device would return.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum FaultError {
    /// EIO: MEDIUM ERROR (UNRECOVERED READ ERROR or WRITE ERROR).
    Eio,
    /// ENOSPC: DATA PROTECT, SPACE ALLOCATION FAILED WRITE PROTECT.
    Enospc,
}

impl FaultError {
    fn errno(self) -> i32 {
        match self {
            FaultError::Eio => libc::EIO,
            FaultError::Enospc => libc::ENOSPC,
        }
    }
}

/// One armed fault: operations of kind `ops` touching `[lba, lba + blocks)` (every block when
/// `blocks` is 0) fail with `error`, `count` times (for ever when absent).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Fault {
    /// The operations it fails.
    pub ops: FaultOps,
    /// The error they get.
    pub error: FaultError,
    /// First block of the range.
    #[serde(default)]
    pub lba: u64,
    /// Blocks in the range; 0 for the whole unit.
    #[serde(default)]
    pub blocks: u64,
    /// How many operations it fails before it disarms itself; for ever when absent.
    #[serde(default)]
    pub count: Option<u64>,
}

/// "read fail with eio from LBA 100 (8 blocks), until cleared": what targetctl and the log say.
impl std::fmt::Display for Fault {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let ops = match self.ops {
            FaultOps::Read => "read",
            FaultOps::Write => "write",
            FaultOps::Flush => "flush",
            FaultOps::All => "all",
        };
        let error = match self.error {
            FaultError::Eio => "eio",
            FaultError::Enospc => "enospc",
        };
        write!(f, "{ops} fail with {error} from LBA {} ", self.lba)?;
        match self.blocks {
            0 => write!(f, "(0 blocks: all)")?,
            1 => write!(f, "(1 block)")?,
            n => write!(f, "({n} blocks)")?,
        }
        match self.count {
            Some(1) => write!(f, ", 1 more time"),
            Some(n) => write!(f, ", {n} more times"),
            None => write!(f, ", until cleared"),
        }
    }
}

impl Fault {
    /// The error for `op`, if this fault applies to it.
    fn applies(&self, op: &Op) -> Option<BackendError> {
        let (kind, range) = classify(op);
        let wanted = self.ops == FaultOps::All || self.ops == kind;
        let overlaps = self.blocks == 0
            || range.is_none_or(|(lba, n)| {
                let end = if n == 0 {
                    u64::MAX
                } else {
                    lba.saturating_add(n)
                };
                lba < self.lba.saturating_add(self.blocks) && self.lba < end
            });
        (wanted && overlaps && self.count != Some(0)).then(|| {
            let first = range.map_or(0, |(lba, _)| lba.max(self.lba));
            errno_to_error(self.error.errno(), kind != FaultOps::Read, first)
        })
    }
}

/// The kind of `op` and the blocks it touches (`(lba, 0)`: from `lba` to the end).
fn classify(op: &Op) -> (FaultOps, Option<(u64, u64)>) {
    if let Some(range) = op.written_range() {
        return (FaultOps::Write, Some(range));
    }
    match *op {
        Op::Flush { lba, blocks } => (FaultOps::Flush, Some((lba, blocks))),
        Op::Read { lba, blocks, .. } | Op::Compare { lba, blocks, .. } => {
            (FaultOps::Read, Some((lba, u64::from(blocks))))
        }
        Op::Prefetch { lba, blocks } => (FaultOps::Read, Some((lba, blocks))),
        Op::LbaStatus { lba } => (FaultOps::Read, Some((lba, 1))),
        _ => (FaultOps::Read, None),
    }
}

/// The faults armed on one logical unit, shared by the wrappers of every reactor that has it
/// open and by whoever arms them.
#[derive(Debug, Default)]
pub struct Faults {
    armed: AtomicBool,
    list: Mutex<Vec<Fault>>,
}

impl Faults {
    /// Arms `fault` after those already armed (the first that applies to an operation wins).
    pub fn arm(&self, fault: Fault) {
        let mut list = self.list.lock().unwrap_or_else(|e| e.into_inner());
        list.push(fault);
        self.armed.store(true, Ordering::Release);
    }

    /// Disarms every fault.
    pub fn clear(&self) {
        let mut list = self.list.lock().unwrap_or_else(|e| e.into_inner());
        list.clear();
        self.armed.store(false, Ordering::Release);
    }

    /// The faults armed now, with what is left of their counts.
    pub fn armed(&self) -> Vec<Fault> {
        self.list.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// The error `op` gets, if an armed fault applies; counts it against that fault.
    pub fn check(&self, op: &Op) -> Option<BackendError> {
        if !self.armed.load(Ordering::Relaxed) {
            return None;
        }
        let mut list = self.list.lock().unwrap_or_else(|e| e.into_inner());
        let hit = list.iter_mut().find_map(|f| {
            let e = f.applies(op)?;
            if let Some(n) = &mut f.count {
                *n -= 1;
            }
            Some(e)
        });
        list.retain(|f| f.count != Some(0));
        if list.is_empty() {
            self.armed.store(false, Ordering::Release);
        }
        hit
    }
}

/// A backend whose operations fail as its [`Faults`] say.
#[derive(Debug)]
pub struct Faulty<B: Backend> {
    inner: B,
    faults: std::sync::Arc<Faults>,
    failed: VecDeque<(u64, Result<Output, BackendError>, B::Buffer)>,
}

impl<B: Backend> Faulty<B> {
    /// `inner`, failing as `faults` say.
    pub fn new(inner: B, faults: std::sync::Arc<Faults>) -> Faulty<B> {
        Faulty {
            inner,
            faults,
            failed: VecDeque::new(),
        }
    }

    /// The wrapped backend.
    pub fn inner(&self) -> &B {
        &self.inner
    }

    /// The wrapped backend, to change.
    pub fn inner_mut(&mut self) -> &mut B {
        &mut self.inner
    }
}

impl<B: Backend> Backend for Faulty<B> {
    type Buffer = B::Buffer;

    fn submit(&mut self, token: u64, op: Op, buf: B::Buffer) {
        match self.faults.check(&op) {
            Some(e) => self.failed.push_back((token, Err(e), buf)),
            None => self.inner.submit(token, op, buf),
        }
    }

    fn poll_completion(&mut self) -> Option<(u64, Result<Output, BackendError>, B::Buffer)> {
        self.failed
            .pop_front()
            .or_else(|| self.inner.poll_completion())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    fn read(lba: u64, blocks: u32) -> Op {
        Op::Read {
            lba,
            blocks,
            offset: 0,
            fua: false,
        }
    }

    fn write(lba: u64, blocks: u32) -> Op {
        Op::Write {
            lba,
            blocks,
            offset: 0,
            fua: false,
        }
    }

    #[test]
    fn faults_apply_by_kind_range_and_count() {
        let f = Faults::default();
        assert_eq!(f.check(&read(0, 8)), None);
        f.arm(Fault {
            ops: FaultOps::Read,
            error: FaultError::Eio,
            lba: 100,
            blocks: 10,
            count: None,
        });
        assert_eq!(f.check(&read(0, 100)), None, "ends before the range");
        assert_eq!(f.check(&read(96, 8)), Some(BackendError::Read { lba: 100 }));
        assert_eq!(
            f.check(&read(105, 1)),
            Some(BackendError::Read { lba: 105 })
        );
        assert_eq!(f.check(&read(110, 8)), None, "starts after the range");
        assert_eq!(f.check(&write(100, 1)), None, "reads only");
        f.arm(Fault {
            ops: FaultOps::Write,
            error: FaultError::Enospc,
            lba: 0,
            blocks: 0,
            count: Some(2),
        });
        assert_eq!(f.check(&write(7, 1)), Some(BackendError::NoSpace));
        let unmap = Op::Unmap { lba: 1, blocks: 1 };
        assert_eq!(f.check(&unmap), Some(BackendError::NoSpace));
        assert_eq!(f.check(&write(7, 1)), None, "count spent");
        assert_eq!(f.armed().len(), 1);
        f.arm(Fault {
            ops: FaultOps::Flush,
            error: FaultError::Eio,
            lba: 50,
            blocks: 1,
            count: None,
        });
        let all = Op::Flush { lba: 0, blocks: 0 };
        assert_eq!(f.check(&all), Some(BackendError::Write { lba: 50 }));
        f.clear();
        assert_eq!(f.check(&read(105, 1)), None);
        assert!(f.armed().is_empty());
    }

    #[test]
    fn a_failed_operation_never_reaches_the_backend() {
        let faults = Arc::new(Faults::default());
        let mut b = Faulty::new(scsi_core::MemoryBackend::new(512, 64), faults.clone());
        let data = vec![0xa5u8; 512];
        faults.arm(Fault {
            ops: FaultOps::All,
            error: FaultError::Eio,
            lba: 0,
            blocks: 0,
            count: Some(1),
        });
        b.submit(1, write(3, 1), data.clone());
        let (token, result, _) = b.poll_completion().unwrap();
        assert_eq!((token, result), (1, Err(BackendError::Write { lba: 3 })));
        b.submit(2, read(3, 1), vec![0xffu8; 512]);
        let (token, result, buf) = b.poll_completion().unwrap();
        assert_eq!((token, result), (2, Ok(Output::Done)));
        assert_eq!(buf, vec![0u8; 512], "the failed write wrote nothing");
        b.submit(3, write(3, 1), data.clone());
        assert_eq!(b.poll_completion().unwrap().1, Ok(Output::Done));
        b.submit(4, read(3, 1), vec![0u8; 512]);
        assert_eq!(b.poll_completion().unwrap().2, data);
    }
}
