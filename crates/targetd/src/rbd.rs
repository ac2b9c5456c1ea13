//! Logical units on Ceph RBD images (feature `rbd`): the image a LUN's config names, opened on
//! the process's connection to its cluster; the Block Limits it reports; and the watch that
//! turns a resize made elsewhere (the `rbd` CLI, another gateway) into CAPACITY DATA HAS
//! CHANGED.

use std::sync::Arc;
use std::time::Duration;

use backend::rbd::{Cluster, ClusterConfig, Image, ImageSpec, NATIVE_COMPARE_AND_WRITE};
use scsi_core::Limits;

use crate::config;
use crate::store::unit::{StoreFigures, UnitStore};

/// The cluster a LUN's config reaches.
pub fn cluster_config(c: &config::Lun) -> ClusterConfig {
    reach(
        &c.ceph_conf,
        &c.client,
        &c.keyring,
        c.ceph_timeout,
        c.write_cache,
    )
}

/// A cluster as its config keys name it (a LUN's or `[cluster]`'s `ceph_conf`, `client`,
/// `keyring`, `ceph_timeout`), with librbd's write cache or without.
pub fn reach(
    ceph_conf: &Option<std::path::PathBuf>,
    client: &Option<String>,
    keyring: &Option<std::path::PathBuf>,
    ceph_timeout: Option<u64>,
    cache: bool,
) -> ClusterConfig {
    ClusterConfig {
        ceph_conf: ceph_conf.clone(),
        client: client.clone().unwrap_or_else(|| "admin".into()),
        keyring: keyring.clone(),
        timeout: Duration::from_secs(ceph_timeout.unwrap_or(config::DEFAULT_CEPH_TIMEOUT)),
        cache,
    }
}

/// The image a LUN's config names.
pub fn image_spec(c: &config::Lun) -> ImageSpec {
    ImageSpec {
        pool: c.pool.clone().unwrap_or_default(),
        namespace: c.namespace.clone().unwrap_or_default(),
        image: c.image.clone().unwrap_or_default(),
    }
}

/// Connects (or reuses the connection) and opens the image, creating it at `size` when it
/// does not exist; returns it and its size in bytes. Errors start with the config key they
/// are about ("pool: ...").
pub fn open(c: &config::Lun) -> Result<(Arc<Image>, u64), String> {
    let named = |e: backend::rbd::RbdError| format!("{}: {e}", e.key());
    let cluster = Cluster::shared(&cluster_config(c)).map_err(named)?;
    let spec = image_spec(c);
    let (image, created) =
        Image::open(cluster, &spec, c.size.map(|s| s.0), c.read_only).map_err(named)?;
    if created {
        tracing::info!(image = %spec, size = c.size.map(|s| s.0), "created the RBD image");
    }
    let bs = u64::from(c.block_size);
    let bytes = image.size().map_err(named)?;
    if bytes % bs != 0 {
        return Err(format!(
            "block_size: the image {spec} is {bytes} bytes, not a multiple of {bs}"
        ));
    }
    if bytes == 0 {
        return Err(format!("image: {spec} is empty"));
    }
    Ok((image, bytes))
}

/// The Block Limits of a unit on `image`: transfers aligned to its objects suit it best, as
/// do unmaps of whole objects; COMPARE AND WRITE is librbd's, one sector, so that it is
/// atomic at the OSD and holds across gateways.
pub fn limits(image: &Image, block_size: u32, mut limits: Limits) -> Limits {
    let per_object = (image.object_size() / u64::from(block_size)).max(1);
    limits.optimal_granularity = per_object.min(u64::from(u16::MAX)) as u16;
    limits.unmap_granularity = per_object.min(u64::from(u32::MAX)) as u32;
    limits.max_compare_and_write = (NATIVE_COMPARE_AND_WRITE / u64::from(block_size)).max(1) as u8;
    limits
}

/// Watches `image` for resizes made by anyone, and hands each new size in bytes to
/// `resized` (the unit's target), on a thread of its own.
pub fn watch_capacity(
    image: &Arc<Image>,
    resized: impl Fn(u64) + Clone + Send + Sync + 'static,
) -> Result<(), String> {
    let weak = Arc::downgrade(image);
    image
        .watch(move || {
            // On a librbd thread, which must not wait on librbd: read the size elsewhere.
            let (image, resized) = (weak.clone(), resized.clone());
            let _ = std::thread::Builder::new()
                .name("rbd-resize".into())
                .spawn(move || {
                    let Some(image) = image.upgrade() else {
                        return;
                    };
                    match image.size() {
                        Ok(bytes) => resized(bytes),
                        Err(e) => tracing::warn!("after an update of the image: {e}"),
                    }
                });
        })
        .map_err(|e| format!("{}: {e}", e.key()))
}

/// A unit on an RBD image: one handle for all reactors.
#[derive(Debug)]
pub struct RbdStore(pub Arc<Image>);

impl RbdStore {
    /// Opens the image `config` names (creating it at its `size` when missing); with its size
    /// in blocks. An image that exists at another size is served at its own.
    pub fn open(config: &config::Lun) -> Result<(Arc<dyn UnitStore>, u64), String> {
        let (image, bytes) = open(config)?;
        if let Some(size) = config.size.map(|s| s.0).filter(|&s| s != bytes) {
            tracing::info!(
                image = %image.spec(),
                configured = size,
                actual = bytes,
                "the image exists at another size than configured: served at its own \
                 size (targetctl lun resize changes it)"
            );
        }
        Ok((
            Arc::new(RbdStore(image)),
            bytes / u64::from(config.block_size),
        ))
    }
}

/// The image a store is, when it is an RBD one.
pub fn image_of(store: &dyn UnitStore) -> Option<&Arc<Image>> {
    store.as_any().downcast_ref::<RbdStore>().map(|s| &s.0)
}

impl UnitStore for RbdStore {
    fn backend(
        &self,
        engine: &backend::Engine,
        block_size: u32,
        _: u64,
    ) -> Result<backend::AnyBackend, String> {
        backend::rbd::RbdBackend::new(self.0.clone(), block_size, engine.event_fd())
            .map(backend::AnyBackend::Rbd)
            .map_err(|e| e.to_string())
    }

    /// The image alone: every gateway exporting it names the unit alike.
    fn identity_key(&self) -> Option<String> {
        Some(format!("rbd:{}", self.0.spec()))
    }

    fn limits(&self, block_size: u32, l: Limits) -> Limits {
        limits(&self.0, block_size, l)
    }

    /// librbd's compare-and-write: one 512-byte sector (a 4096-byte block is more than it
    /// takes at once).
    fn atomic_compare_and_write(&self, block_size: u32) -> u16 {
        u16::from(u64::from(block_size) <= NATIVE_COMPARE_AND_WRITE)
    }

    fn resize(&self, _: u32, _: u64, bytes: u64) -> Result<Arc<dyn UnitStore>, String> {
        self.0.resize(bytes, true).map_err(|e| e.to_string())?;
        Ok(Arc::new(RbdStore(self.0.clone())))
    }

    fn flush(&self) -> Result<(), String> {
        self.0.flush().map_err(|e| e.to_string())
    }

    fn watch_size(&self, resized: Arc<dyn Fn(u64) + Send + Sync>) -> Result<(), String> {
        match watch_capacity(&self.0, move |bytes| resized(bytes)) {
            Ok(()) => Ok(()),
            // An image opened read-only has no watch on its header: its size is the one it
            // had when opened.
            Err(e) if self.0.read_only() => {
                tracing::warn!(image = %self.0.spec(), "resizes made elsewhere go unseen: {e}");
                Ok(())
            }
            Err(e) => Err(e),
        }
    }

    /// The image and librbd's figures for it.
    fn details(&self) -> serde_json::Value {
        use std::sync::atomic::Ordering::Relaxed;
        let (image, s) = (&self.0, self.0.stats());
        let spec = image.spec();
        serde_json::json!({
            "pool": spec.pool,
            "namespace": spec.namespace,
            "image": spec.image,
            "object_size": image.object_size(),
            "in_flight": s.in_flight.load(Relaxed),
            "completed": s.completed.load(Relaxed),
            "latency_ns_total": s.latency_ns.load(Relaxed),
            "unavailable": s.unavailable.load(Relaxed),
            "errors": s.errors.load(Relaxed),
        })
    }

    fn figures(&self) -> Option<StoreFigures> {
        use std::sync::atomic::Ordering::Relaxed;
        let (spec, s) = (self.0.spec(), self.0.stats());
        Some(StoreFigures {
            labels: vec![("pool", spec.pool.clone()), ("image", spec.image.clone())],
            in_flight: s.in_flight.load(Relaxed),
            completed: s.completed.load(Relaxed),
            latency_ns: s.latency_ns.load(Relaxed),
            unavailable: s.unavailable.load(Relaxed),
            errors: s.errors.load(Relaxed),
        })
    }

    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}
