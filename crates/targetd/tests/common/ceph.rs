//! The Ceph cluster the RBD tests use: the one `CEPH_CONF`, `CEPH_KEYRING`, `CEPH_CLIENT` and
//! `CEPH_POOL` name (`scripts/ceph-dev-cluster.sh start DIR` writes them to DIR/env; `.ci/run`
//! starts one). Without them the tests print why and pass; under `CI` they fail.

use std::process::Command as Process;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Mutex, MutexGuard};

use super::TARGET;

pub use backend::rbd::testing::TestCluster as Ceph;

/// The cluster, or None (with the reason printed) when none is configured outside CI.
pub fn ceph() -> Option<Ceph> {
    Ceph::from_env()
}

/// The tests take turns: one of them stops the cluster's OSD.
pub fn turn() -> MutexGuard<'static, ()> {
    static TURN: Mutex<()> = Mutex::new(());
    TURN.lock().unwrap_or_else(|e| e.into_inner())
}

pub fn unique(prefix: &str) -> String {
    static N: AtomicUsize = AtomicUsize::new(0);
    format!(
        "{prefix}-{}-{}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    )
}

/// What targetd's tests do with the cluster.
pub trait CephExt {
    /// A `[[targets]]` table with LUN 0 on `image` (created at `size`), and `extra` keys.
    fn target(&self, image: &str, size: &str, extra: &str) -> String;
    /// Runs the `rbd` CLI as the test's client.
    fn rbd(&self, args: &[&str]) -> std::process::Output;
    /// Removes image `image` of the test's pool (a test's end).
    fn remove_image(&self, image: &str);
    /// Runs a Ceph CLI (`rbd`, `rados`, `ceph`) as the test's client.
    fn tool(&self, tool: &str, args: &[&str]) -> std::process::Output;
    /// QEMU's URI of `image` for its rbd driver.
    fn qemu_rbd(&self, image: &str) -> String;
    /// The pid of OSD `id` of a cluster from scripts/ceph-dev-cluster.sh.
    fn osd_pid(&self, id: u32) -> Option<u32>;
    /// `keyring = "..."` and a newline, when there is a keyring.
    fn keyring_key(&self) -> String;
}

impl CephExt for Ceph {
    fn keyring_key(&self) -> String {
        self.keyring
            .as_ref()
            .map(|k| format!("keyring = \"{}\"\n", k.display()))
            .unwrap_or_default()
    }

    fn target(&self, image: &str, size: &str, extra: &str) -> String {
        let keyring = self.keyring_key();
        format!(
            "[[targets]]\nname = \"{TARGET}\"\n\n[[targets.luns]]\nlun = 0\nbackend = \"rbd\"\n\
             pool = \"{}\"\nimage = \"{image}\"\nsize = \"{size}\"\nceph_conf = \"{}\"\n\
             client = \"{}\"\n{keyring}{extra}\n",
            self.pool,
            self.conf.display(),
            self.client
        )
    }

    fn rbd(&self, args: &[&str]) -> std::process::Output {
        self.tool("rbd", args)
    }

    fn remove_image(&self, image: &str) {
        self.rbd(&["rm", &format!("{}/{image}", self.pool)]);
    }

    fn tool(&self, tool: &str, args: &[&str]) -> std::process::Output {
        let mut c = Process::new(tool);
        c.arg("-c").arg(&self.conf).args(["--id", &self.client]);
        if let Some(k) = &self.keyring {
            c.arg("--keyring").arg(k);
        }
        c.args(args).output().expect("rbd CLI (ceph-common)")
    }

    fn qemu_rbd(&self, image: &str) -> String {
        let mut s = format!(
            "rbd:{}/{image}:conf={}:id={}",
            self.pool,
            self.conf.display(),
            self.client
        );
        if let Some(k) = &self.keyring {
            s.push_str(&format!(":keyring={}", k.display()));
        }
        s
    }

    fn osd_pid(&self, id: u32) -> Option<u32> {
        let run = self
            .conf
            .parent()?
            .join("run")
            .join(format!("osd.{id}.pid"));
        std::fs::read_to_string(run).ok()?.trim().parse().ok()
    }
}
