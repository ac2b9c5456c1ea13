//! What the tests share: which engines this machine can run, and the Ceph cluster the RBD
//! tests use.

use backend::{Engine, EngineChoice, EngineConfig};

/// The engines to test: io_uring when the kernel lets us set one up, and the thread pool.
/// Without io_uring the io_uring half is skipped with the reason, unless `CI` is set, where it
/// fails: CI machines must exercise both.
#[allow(dead_code)]
pub fn engines() -> Vec<EngineChoice> {
    let probe = Engine::new(EngineConfig {
        engine: EngineChoice::Uring,
        ..EngineConfig::default()
    });
    match probe {
        Ok(_) => vec![EngineChoice::Uring, EngineChoice::Threads],
        Err(e) if std::env::var_os("CI").is_some() => {
            panic!("io_uring cannot be set up ({e}) and CI requires it")
        }
        Err(e) => {
            eprintln!("skipping the io_uring engine: it cannot be set up here ({e})");
            vec![EngineChoice::Threads]
        }
    }
}

/// The cluster the environment names (`backend::rbd::testing`), with its pool; None, saying
/// why, when none is configured, and under `CI` a failure instead.
#[cfg(feature = "rbd")]
#[allow(dead_code)]
pub fn ceph() -> Option<(backend::rbd::ClusterConfig, String)> {
    let c = backend::rbd::testing::TestCluster::from_env()?;
    Some((c.config(std::time::Duration::from_secs(10)), c.pool))
}

/// A name no other test run uses.
#[allow(dead_code)]
pub fn unique(prefix: &str) -> String {
    use std::sync::atomic::{AtomicUsize, Ordering};
    static N: AtomicUsize = AtomicUsize::new(0);
    format!(
        "{prefix}-{}-{}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    )
}
