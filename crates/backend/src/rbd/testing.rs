//! The Ceph cluster a test runs against: the one `CEPH_CONF`, `CEPH_POOL`, `CEPH_KEYRING`
//! and `CEPH_CLIENT` name (`scripts/ceph-dev-cluster.sh start DIR` writes them to DIR/env;
//! `.ci/run` starts one). For the tests of this crate and of the crates built on it, which
//! all find their cluster the same way.

use std::path::PathBuf;
use std::time::Duration;

use super::ClusterConfig;

/// A test cluster: its ceph.conf, keyring, cephx id and the pool the tests use.
#[derive(Debug, Clone)]
pub struct TestCluster {
    /// `CEPH_CONF`.
    pub conf: PathBuf,
    /// `CEPH_KEYRING`, when set.
    pub keyring: Option<PathBuf>,
    /// `CEPH_CLIENT`, "admin" when unset.
    pub client: String,
    /// `CEPH_POOL`.
    pub pool: String,
}

impl TestCluster {
    /// The cluster the environment names; `None`, saying why on stderr, when it names none.
    /// Under `CI` a missing cluster is a failure (a panic) instead: CI must run these tests.
    pub fn from_env() -> Option<TestCluster> {
        let var = |k: &str| std::env::var(k).ok().filter(|v| !v.is_empty());
        match (var("CEPH_CONF"), var("CEPH_POOL")) {
            (Some(conf), Some(pool)) => Some(TestCluster {
                conf: conf.into(),
                keyring: var("CEPH_KEYRING").map(PathBuf::from),
                client: var("CEPH_CLIENT").unwrap_or_else(|| "admin".into()),
                pool,
            }),
            _ if std::env::var_os("CI").is_some() => {
                panic!("CI needs a Ceph cluster: .ci/run starts one (scripts/ceph-dev-cluster.sh)")
            }
            _ => {
                eprintln!(
                    "skipping: no Ceph cluster (scripts/ceph-dev-cluster.sh start DIR, then \
                     source DIR/env)"
                );
                None
            }
        }
    }

    /// How librados reaches it, answering within `timeout`.
    pub fn config(&self, timeout: Duration) -> ClusterConfig {
        ClusterConfig {
            ceph_conf: Some(self.conf.clone()),
            client: self.client.clone(),
            keyring: self.keyring.clone(),
            timeout,
            cache: false,
        }
    }
}
