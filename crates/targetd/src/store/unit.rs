//! The trait a unit's store implements, and the stores that need no outside library: a file
//! or block device, a RAM disk, a null device.

use std::any::Any;
use std::sync::{Arc, Mutex, PoisonError};

use backend::{AnyBackend, Engine, FileConfig, FileHandle, Immediate, NullBackend};
use scsi_core::{Limits, MemoryBackend};

/// Where a unit's blocks are.
pub trait UnitStore: std::fmt::Debug + Send + Sync + 'static {
    /// The backend a reactor runs the unit's operations on (its `engine`; the unit's
    /// geometry).
    fn backend(&self, engine: &Engine, block_size: u32, blocks: u64) -> Result<AnyBackend, String>;
    /// What names the unit in its identity, when the store names it better than the target,
    /// LUN and path do (an RBD image: the same name on every gateway exporting it).
    fn identity_key(&self) -> Option<String> {
        None
    }
    /// Blocks of `block_size` a Compare and Write may cover that the storage itself carries
    /// out atomically, against every writer (NVMe's NACWU: a fused Compare and Write has no
    /// device server's range locks around it); 0 when it cannot (a file: the comparison and
    /// the write are two system calls).
    fn atomic_compare_and_write(&self, block_size: u32) -> u16 {
        let _ = block_size;
        0
    }
    /// The Block Limits the store suits, from `limits` (the config's).
    fn limits(&self, block_size: u32, limits: Limits) -> Limits {
        let _ = block_size;
        limits
    }
    /// The same unit's store at `bytes` (grown or shrunk; the caller checked the size is a
    /// whole number of `block_size` blocks, and a shrink was asked for with force).
    fn resize(
        &self,
        block_size: u32,
        blocks: u64,
        bytes: u64,
    ) -> Result<Arc<dyn UnitStore>, String>;
    /// Makes every acknowledged write durable (at stop).
    fn flush(&self) -> Result<(), String> {
        Ok(())
    }
    /// Calls `resized` with the new size in bytes whenever someone else resizes the store
    /// (an RBD image resized with `rbd` or through another gateway). `Ok` without a watch for
    /// stores no one else reaches.
    fn watch_size(&self, resized: Arc<dyn Fn(u64) + Send + Sync>) -> Result<(), String> {
        let _ = resized;
        Ok(())
    }
    /// What `targetctl luns --json` shows of the store beyond the config (an RBD image's
    /// librbd figures); null when nothing.
    fn details(&self) -> serde_json::Value {
        serde_json::Value::Null
    }
    /// The figures of a store that runs its operations through a library of its own (RBD:
    /// librbd), for the metrics endpoint; `None` for the others, whose operations the
    /// unit's own counters describe.
    fn figures(&self) -> Option<StoreFigures> {
        None
    }
    /// The store as `Any`, for what only one kind has (an RBD image, shared through a
    /// cluster).
    fn as_any(&self) -> &dyn Any;
}

/// What a store's own library did (`targetd_rbd_*` metrics).
#[derive(Debug, Clone, Default)]
pub struct StoreFigures {
    /// Labels naming the store, beyond its target and LUN (RBD: pool and image).
    pub labels: Vec<(&'static str, String)>,
    /// Operations handed to the library and not yet completed.
    pub in_flight: u64,
    /// Operations completed.
    pub completed: u64,
    /// Sum of their latencies, nanoseconds.
    pub latency_ns: u64,
    /// Operations that failed retryably (the cluster did not answer in time).
    pub unavailable: u64,
    /// Operations that failed otherwise.
    pub errors: u64,
}

/// A file or block device, opened by each reactor on its own engine.
#[derive(Debug)]
pub struct FileStore(pub FileConfig);

impl UnitStore for FileStore {
    fn backend(&self, engine: &Engine, _: u32, _: u64) -> Result<AnyBackend, String> {
        let handle = FileHandle::open(&self.0).map_err(|e| e.to_string())?;
        Ok(AnyBackend::File(engine.open(handle)))
    }

    fn resize(&self, _: u32, _: u64, bytes: u64) -> Result<Arc<dyn UnitStore>, String> {
        let path = &self.0.path;
        let file = std::fs::OpenOptions::new()
            .write(true)
            .open(path)
            .map_err(|e| format!("{}: {e}", path.display()))?;
        file.set_len(bytes)
            .map_err(|e| format!("{}: {e}", path.display()))?;
        Ok(Arc::new(FileStore(self.0.clone())))
    }

    fn flush(&self) -> Result<(), String> {
        std::fs::OpenOptions::new()
            .read(true)
            .open(&self.0.path)
            .and_then(|f| f.sync_data())
            .map_err(|e| format!("{}: {e}", self.0.path.display()))
    }

    fn as_any(&self) -> &dyn Any {
        self
    }
}

/// A RAM disk, one for all reactors.
#[derive(Debug)]
pub struct MemoryStore(pub Arc<Mutex<MemoryBackend>>);

/// Blocks a RAM disk compares and writes under its one lock: any number; this many keeps the
/// operation's buffer (twice the blocks) well inside one arena slot.
const MEMORY_COMPARE_AND_WRITE: u16 = 64;

impl UnitStore for MemoryStore {
    fn atomic_compare_and_write(&self, _: u32) -> u16 {
        MEMORY_COMPARE_AND_WRITE
    }

    fn backend(&self, _: &Engine, block_size: u32, blocks: u64) -> Result<AnyBackend, String> {
        Ok(AnyBackend::SharedMemory(Immediate::new(
            self.0.clone(),
            block_size,
            blocks,
        )))
    }

    /// A new RAM disk with the old one's blocks, as many as fit.
    fn resize(
        &self,
        block_size: u32,
        blocks: u64,
        bytes: u64,
    ) -> Result<Arc<dyn UnitStore>, String> {
        let bs = u64::from(block_size);
        let mut fresh = MemoryBackend::new(block_size, bytes / bs);
        let mut buf = vec![0u8; 1 << 20];
        let guard = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        let keep = (bytes / bs).min(blocks) * bs;
        let mut at = 0;
        while at < keep {
            let n = (keep - at).min(buf.len() as u64) as usize;
            guard.read_bytes(at, &mut buf[..n]);
            let op = scsi_core::Op::Write {
                lba: at / bs,
                blocks: (n as u64 / bs) as u32,
                offset: 0,
                fua: false,
            };
            fresh
                .execute(&op, &mut buf[..n])
                .map_err(|e| e.to_string())?;
            at += n as u64;
        }
        Ok(Arc::new(MemoryStore(Arc::new(Mutex::new(fresh)))))
    }

    fn as_any(&self) -> &dyn Any {
        self
    }
}

/// Reads zeros, discards writes.
#[derive(Debug)]
pub struct NullStore;

impl UnitStore for NullStore {
    fn atomic_compare_and_write(&self, _: u32) -> u16 {
        MEMORY_COMPARE_AND_WRITE
    }

    fn backend(&self, _: &Engine, block_size: u32, blocks: u64) -> Result<AnyBackend, String> {
        Ok(AnyBackend::Null(NullBackend::null(block_size, blocks)))
    }

    fn resize(&self, _: u32, _: u64, _: u64) -> Result<Arc<dyn UnitStore>, String> {
        Ok(Arc::new(NullStore))
    }

    fn as_any(&self) -> &dyn Any {
        self
    }
}
