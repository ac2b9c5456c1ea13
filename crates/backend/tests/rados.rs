//! Shared objects in RADOS on a real cluster: compare-and-swap that never loses an update
//! when clients race, and watch/notify that reports who applied a change and who stayed
//! silent. The base several gateways keep their shared state on.
//!
//! The cluster is the one `CEPH_CONF`, `CEPH_KEYRING`, `CEPH_CLIENT` and `CEPH_POOL` name
//! (`scripts/ceph-dev-cluster.sh start DIR` writes them to DIR/env). Without them the tests
//! say so and pass; under `CI` they fail instead.
#![cfg(feature = "rbd")]

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::time::Duration;

use backend::rbd::rados::{CasError, Pool};
use backend::rbd::{Cluster, ClusterConfig};

mod common;

fn pool() -> Option<(ClusterConfig, String)> {
    common::ceph()
}

use common::unique;

/// A separate connection, as another gateway has.
fn gateway(config: &ClusterConfig, pool: &str) -> Arc<Pool> {
    Pool::open(Arc::new(Cluster::connect(config).unwrap()), pool, "").unwrap()
}

#[test]
fn compare_and_swap_lets_one_of_two_racers_win_and_loses_no_update() {
    let Some((config, name)) = pool() else { return };
    let a = gateway(&config, &name);
    let b = gateway(&config, &name);
    let oid = unique("cas");
    assert_eq!(a.read(&oid, 64).unwrap(), None);
    let v1 = a.replace(&oid, None, b"0").unwrap();
    // Created once: a second creation conflicts.
    assert_eq!(b.replace(&oid, None, b"x"), Err(CasError::Conflict));
    let seen = b.read(&oid, 64).unwrap().unwrap();
    assert_eq!((seen.data.as_slice(), seen.version), (&b"0"[..], v1));
    // A write at the version read wins; the other writer, still at that version, loses.
    let v2 = a.replace(&oid, Some(v1), b"a").unwrap();
    assert!(v2 > v1);
    assert_eq!(b.replace(&oid, Some(v1), b"b"), Err(CasError::Conflict));
    assert_eq!(b.read(&oid, 64).unwrap().unwrap().data, b"a");
    // Objects are small by design: a larger one is refused, not cut.
    assert_eq!(a.read(&oid, 0), Err(-libc::EFBIG));

    // Two gateways add 1 to a counter 40 times each by read, add, swap; every update lands.
    a.replace(&oid, Some(v2), b"0").unwrap();
    let conflicts = Arc::new(AtomicUsize::new(0));
    let racers: Vec<_> = [a.clone(), b.clone()]
        .into_iter()
        .map(|p| {
            let (oid, conflicts) = (oid.clone(), conflicts.clone());
            std::thread::spawn(move || {
                for _ in 0..40 {
                    loop {
                        let cur = p.read(&oid, 64).unwrap().unwrap();
                        let n: u64 = std::str::from_utf8(&cur.data).unwrap().parse().unwrap();
                        match p.replace(&oid, Some(cur.version), (n + 1).to_string().as_bytes()) {
                            Ok(_) => break,
                            Err(CasError::Conflict) => {
                                conflicts.fetch_add(1, Ordering::Relaxed);
                            }
                            Err(e) => panic!("{e}"),
                        }
                    }
                }
            })
        })
        .collect();
    for r in racers {
        r.join().unwrap();
    }
    assert_eq!(a.read(&oid, 64).unwrap().unwrap().data, b"80");
    println!(
        "80 increments by two racing clients, {} conflicts retried",
        conflicts.load(Ordering::Relaxed)
    );
    a.remove(&oid).unwrap();
    a.remove(&oid).unwrap();
    assert_eq!(a.read(&oid, 64).unwrap(), None);
}

#[test]
fn notify_waits_for_every_watcher_and_names_the_silent_ones() {
    let Some((config, name)) = pool() else { return };
    let notifier = gateway(&config, &name);
    let oid = unique("watched");
    notifier.replace(&oid, None, b"state").unwrap();

    // Gateway B applies each change and acknowledges with what it applied.
    let b = gateway(&config, &name);
    let b_id = b.cluster().instance_id();
    let applied = Arc::new(Mutex::new(Vec::new()));
    let watch = {
        let (applied, pool, obj) = (applied.clone(), b.clone(), oid.clone());
        b.watch(
            &oid,
            Duration::from_secs(30),
            move |n| {
                applied.lock().unwrap().push(n.payload.clone());
                pool.ack(&obj, &n, b"applied").unwrap();
            },
            |e| panic!("watch lost: {e}"),
        )
        .unwrap()
    };
    assert!(watch.check().is_ok());
    let out = notifier
        .notify(&oid, b"change 1", Duration::from_secs(10))
        .unwrap();
    assert_eq!(out.acked, vec![(b_id, watch.cookie(), b"applied".to_vec())]);
    assert!(out.timed_out.is_empty());
    assert_eq!(applied.lock().unwrap().as_slice(), [b"change 1".to_vec()]);

    // Gateway C receives but never answers: the notify ends at its timeout naming C.
    let c = gateway(&config, &name);
    let c_id = c.cluster().instance_id();
    let (tx, rx) = mpsc::channel();
    let tx = Mutex::new(tx);
    let silent = c
        .watch(
            &oid,
            Duration::from_secs(30),
            move |n| {
                let _ = tx.lock().unwrap().send(n.payload);
            },
            |_| {},
        )
        .unwrap();
    let out = notifier
        .notify(&oid, b"change 2", Duration::from_secs(2))
        .unwrap();
    assert_eq!(out.acked, vec![(b_id, watch.cookie(), b"applied".to_vec())]);
    assert_eq!(out.timed_out, vec![(c_id, silent.cookie())]);
    assert_eq!(
        rx.recv_timeout(Duration::from_secs(5)).unwrap(),
        b"change 2"
    );

    // Unwatched, C no longer counts.
    drop(silent);
    let out = notifier
        .notify(&oid, b"change 3", Duration::from_secs(5))
        .unwrap();
    assert_eq!((out.acked.len(), out.timed_out.len()), (1, 0));
    drop(watch);
    notifier.remove(&oid).unwrap();
}
