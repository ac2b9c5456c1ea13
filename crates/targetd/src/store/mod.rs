//! What a logical unit (and, with NVMe, a namespace) is stored on: one trait,
//! [`UnitStore`], with a file, memory and null implementation ([`unit`](mod@unit)) and (feature `rbd`)
//! an RBD one (`crate::rbd::RbdStore`). The stores are registered by their config name here,
//! in [`open`] and [`check`], the one place that names the RBD store; everything else (the
//! target, the reactors, the admin interface, the drain) asks the trait.

use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use backend::{FileConfig, FileHandle};
use scsi_core::MemoryBackend;

use crate::config;

pub mod unit;

pub use unit::{FileStore, MemoryStore, NullStore, StoreFigures, UnitStore};

/// Opens (creating a missing file) the store `config` describes; with its size in blocks.
pub fn open(config: &config::Lun) -> Result<(Arc<dyn UnitStore>, u64), String> {
    let bs = config.block_size;
    let size = config.size.map(|s| s.0);
    Ok(match config.backend.as_str() {
        "file" => {
            let mut fc = file_config(config)?;
            let handle = FileHandle::open(&fc).map_err(|e| format!("{}: {e}", e.key()))?;
            let blocks = handle.blocks();
            // The file now exists at its size: reactors open it as it is.
            fc.size = None;
            (Arc::new(FileStore(fc)), blocks)
        }
        "memory" => {
            let blocks = size.unwrap_or(0) / u64::from(bs);
            let m = MemoryBackend::new(bs, blocks);
            (Arc::new(MemoryStore(Arc::new(Mutex::new(m)))), blocks)
        }
        #[cfg(feature = "rbd")]
        "rbd" => crate::rbd::RbdStore::open(config)?,
        _ => (Arc::new(NullStore), size.unwrap_or(0) / u64::from(bs)),
    })
}

/// What opening the unit `config` describes would refuse, found without opening it for I/O
/// (`targetd --check`): for a file, what [`FileHandle::check`] finds; for an RBD image, a
/// ceph.conf or keyring this process cannot read. The reason starts with the key at fault
/// ("path: ...").
pub fn check(config: &config::Lun) -> Result<(), String> {
    match config.backend.as_str() {
        "file" => FileHandle::check(&file_config(config)?).map_err(|e| format!("{}: {e}", e.key())),
        "rbd" => {
            for (key, path) in [
                ("ceph_conf", &config.ceph_conf),
                ("keyring", &config.keyring),
            ] {
                if let Some(path) = path {
                    std::fs::File::open(path)
                        .map_err(|e| format!("{key}: {}: {e}", path.display()))?;
                }
            }
            Ok(())
        }
        _ => Ok(()),
    }
}

/// How the file backend opens the file of a `backend = "file"` unit.
fn file_config(config: &config::Lun) -> Result<FileConfig, String> {
    let path: PathBuf = config.path.clone().ok_or("the file backend needs a path")?;
    let mut fc = FileConfig::new(path, config.size.map(|s| s.0));
    fc.block_size = config.block_size;
    fc.direct = config.direct;
    fc.write_through = !config.write_cache;
    fc.read_only = config.read_only;
    Ok(fc)
}
