//! Logical units on Ceph RBD images (feature `rbd`): the image a LUN's config names, opened on
//! the process's connection to its cluster; the Block Limits it reports; and the watch that
//! turns a resize made elsewhere (the `rbd` CLI, another gateway) into CAPACITY DATA HAS
//! CHANGED.

use std::sync::Arc;
use std::time::Duration;

use backend::rbd::{Cluster, ClusterConfig, Image, ImageSpec, NATIVE_COMPARE_AND_WRITE};
use scsi_core::Limits;

use crate::config;

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
