//! The units a target (its LUNs) or an NVMe subsystem (its namespaces) exports: each one's
//! storage, counters and faults ([`Lun`]), the map of them an admin action changes
//! ([`UnitMap`]), and the cache of that map each connection reads on every command
//! ([`UnitCache`]).
//!
//! Every command looks its unit up twice (to size its buffer and submit its operation, then
//! to count it): through the map's lock and a clone of its `Arc` that cost about 3% of a
//! 4 KiB read's CPU. The map counts its changes; a connection's cache keeps what it looked
//! up until the count moves, holding the units weakly so that a unit removed from the map is
//! closed at once even on a connection that sends nothing more.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, PoisonError, RwLock, Weak};

use backend::Faults;
use scsi_core::transport::Accounting;
use scsi_core::{Geometry, Identity, Limits, LogicalUnit};

use crate::cluster::Following;
use crate::config;
use crate::store::UnitStore;

/// Counters of one logical unit, for `targetctl stats` and the metrics endpoint.
#[derive(Debug, Default)]
pub struct LunStats {
    /// Commands that read blocks.
    pub read_commands: AtomicU64,
    /// Commands that wrote blocks.
    pub write_commands: AtomicU64,
    /// Other commands.
    pub other_commands: AtomicU64,
    /// Bytes read.
    pub read_bytes: AtomicU64,
    /// Bytes written.
    pub write_bytes: AtomicU64,
    /// Sum of read command latencies, nanoseconds (arrival to status).
    pub read_latency_ns: AtomicU64,
    /// Sum of write command latencies, nanoseconds.
    pub write_latency_ns: AtomicU64,
    /// Commands that ended with CHECK CONDITION.
    pub errors: AtomicU64,
    /// Reads by latency: how many fell in each of [`LATENCY_BOUNDS_US`] (not cumulative; the
    /// last bucket past every bound).
    pub read_latency_buckets: [AtomicU64; LATENCY_BUCKETS],
    /// Writes by latency, as `read_latency_buckets`.
    pub write_latency_buckets: [AtomicU64; LATENCY_BUCKETS],
}

impl LunStats {
    /// Adds what a connection counted on this unit since it last did ([`Tally`]) and clears
    /// the tally: one atomic addition per counter that moved, however many commands it holds.
    fn take(&self, t: &mut Tally) {
        let add = |c: &AtomicU64, n: u64| {
            if n > 0 {
                c.fetch_add(n, Ordering::Relaxed);
            }
        };
        add(&self.read_commands, t.read_commands);
        add(&self.write_commands, t.write_commands);
        add(&self.other_commands, t.other_commands);
        add(&self.read_bytes, t.read_bytes);
        add(&self.write_bytes, t.write_bytes);
        add(&self.read_latency_ns, t.read_latency_ns);
        add(&self.write_latency_ns, t.write_latency_ns);
        add(&self.errors, t.errors);
        let buckets = |shared: &[AtomicU64; LATENCY_BUCKETS], counted: &[u32; LATENCY_BUCKETS]| {
            for (bucket, n) in shared.iter().zip(counted) {
                add(bucket, u64::from(*n));
            }
        };
        if t.read_commands > 0 {
            buckets(&self.read_latency_buckets, &t.read_latency_buckets);
        }
        if t.write_commands > 0 {
            buckets(&self.write_latency_buckets, &t.write_latency_buckets);
        }
        *t = Tally::default();
    }
}

/// Finished commands on one unit that a connection has counted and not yet added to the
/// unit's [`LunStats`]. The counters are shared by every reactor; adding each command to them
/// took five atomic read-modify-writes, so an iSCSI connection or an NVMe queue tallies a
/// step's commands here and adds them when the step ends ([`UnitCache::tally`],
/// [`UnitCache::flush`]), before anything of the step is sent: whoever saw a command's answer
/// sees it counted.
#[derive(Debug, Default)]
struct Tally {
    read_commands: u64,
    write_commands: u64,
    other_commands: u64,
    read_bytes: u64,
    write_bytes: u64,
    read_latency_ns: u64,
    write_latency_ns: u64,
    errors: u64,
    read_latency_buckets: [u32; LATENCY_BUCKETS],
    write_latency_buckets: [u32; LATENCY_BUCKETS],
}

impl Tally {
    /// Whether it counts no command.
    fn is_empty(&self) -> bool {
        self.read_commands == 0 && self.write_commands == 0 && self.other_commands == 0
    }

    /// Counts a finished command (a SCSI task's or an NVMe command's).
    fn count(&mut self, a: &Accounting) {
        let ns = a.latency.as_nanos() as u64;
        if a.error {
            self.errors += 1;
        }
        if a.read_bytes > 0 {
            self.read_commands += 1;
            self.read_bytes += a.read_bytes;
            self.read_latency_ns += ns;
            self.read_latency_buckets[latency_bucket(ns)] += 1;
        } else if a.write_bytes > 0 {
            self.write_commands += 1;
            self.write_bytes += a.write_bytes;
            self.write_latency_ns += ns;
            self.write_latency_buckets[latency_bucket(ns)] += 1;
        } else {
            self.other_commands += 1;
        }
    }
}

/// The upper bounds of the latency histograms' buckets, microseconds: 50 us to 5 s, so a p99
/// of a fast unit and of a stalled one both show.
pub const LATENCY_BOUNDS_US: [u64; 19] = [
    5, 10, 25, 50, 100, 250, 500, 1_000, 2_500, 5_000, 10_000, 25_000, 50_000, 100_000, 250_000,
    500_000, 1_000_000, 2_500_000, 5_000_000,
];

/// Buckets of a latency histogram: one per bound and one past them.
pub const LATENCY_BUCKETS: usize = LATENCY_BOUNDS_US.len() + 1;

/// The bucket a latency of `ns` falls in.
pub fn latency_bucket(ns: u64) -> usize {
    let us = ns / 1000;
    LATENCY_BOUNDS_US
        .iter()
        .position(|&b| us < b || (us == b && ns % 1000 == 0))
        .unwrap_or(LATENCY_BOUNDS_US.len())
}

/// A logical unit: its config, its storage and its counters. Replaced as a whole when it
/// changes (resize), so a reactor that opened the old one opens the new one afresh.
#[derive(Debug)]
pub struct Lun {
    /// Unique for the daemon's life.
    pub id: u64,
    /// The config it was made from.
    pub config: config::Lun,
    /// Block size in bytes.
    pub block_size: u32,
    /// Capacity in blocks.
    pub blocks: u64,
    /// Where its blocks are.
    pub storage: Arc<dyn UnitStore>,
    /// Counters (kept across a resize).
    pub stats: Arc<LunStats>,
    /// Faults armed by `targetctl lun fault` (kept across a resize).
    pub faults: Arc<Faults>,
    /// The shared state this gateway follows (a unit on shared storage in a cluster).
    pub shared: Option<Following>,
}

impl Lun {
    /// The unit as a target's or subsystem's definition gives it: shared storage names itself
    /// alike on every gateway (an RBD image: `rbd:<spec>`, with its block size and whether it
    /// is read-only); any other is `gateway`'s own.
    pub fn definition(&self, gateway: &str) -> String {
        match self.storage.identity_key() {
            Some(storage) => format!(
                "{storage} block_size {} read_only {}",
                self.block_size, self.config.read_only
            ),
            None => format!(
                "{} storage of gateway {gateway} alone (another disk through each gateway)",
                self.config.backend
            ),
        }
    }

    /// Checks that `bytes` is a size this unit can take (a non-zero multiple of its block
    /// size) and resizes its storage: the new storage and its blocks.
    pub fn resize_storage(&self, bytes: u64) -> Result<(Arc<dyn UnitStore>, u64), String> {
        let bs = u64::from(self.block_size);
        if bytes == 0 || bytes % bs != 0 {
            return Err(format!(
                "{bytes} is not a non-zero multiple of the block size {bs}"
            ));
        }
        let storage = self.storage.resize(self.block_size, self.blocks, bytes)?;
        Ok((storage, bytes / bs))
    }

    /// This unit at its new size on `storage` (resized): a new identity for the reactors'
    /// open backends, the counters and faults kept.
    pub fn resized(&self, storage: Arc<dyn UnitStore>, blocks: u64) -> Lun {
        let mut config = self.config.clone();
        config.size = Some(config::Size(blocks * u64::from(self.block_size)));
        Lun {
            id: next_id(),
            config,
            block_size: self.block_size,
            blocks,
            storage,
            stats: self.stats.clone(),
            faults: self.faults.clone(),
            shared: self.shared.clone(),
        }
    }
}

static NEXT_ID: AtomicU64 = AtomicU64::new(1);

/// A fresh id for a target, LUN or connection.
pub fn next_id() -> u64 {
    NEXT_ID.fetch_add(1, Ordering::Relaxed)
}

impl Lun {
    /// Opens (creating a missing file) the storage `config` describes.
    pub fn open(config: &config::Lun, stats: Arc<LunStats>) -> Result<Lun, String> {
        let bs = config.block_size;
        let (storage, blocks) = crate::store::open(config)?;
        Ok(Lun {
            id: next_id(),
            config: config.clone(),
            block_size: bs,
            blocks,
            storage,
            stats,
            faults: Arc::default(),
            shared: None,
        })
    }

    /// How the SCSI core describes this unit. The identity derives from the storage when
    /// it is shared (an RBD image: every gateway names it alike), or else from the target
    /// name, the LUN and the backing path, so it is stable across restarts and unique per
    /// unit; and, for a gateway of a cluster (`gateway`), from the gateway's name too: one
    /// gateway's own file or memory is another disk than another gateway's under the same
    /// target and LUN, and an initiator's multipath must not take them for one.
    pub fn logical_unit(&self, target: &str, gateway: Option<&str>) -> LogicalUnit {
        let c = &self.config;
        let key = self.storage.identity_key().unwrap_or_else(|| {
            let own = format!(
                "{target}/{}/{}",
                c.lun,
                c.path
                    .as_ref()
                    .map(|p| p.display().to_string())
                    .unwrap_or_default()
            );
            match gateway {
                Some(g) => format!("{own}@{g}"),
                None => own,
            }
        });
        LogicalUnit {
            identity: Identity::new(
                "TARGETD",
                &format!("{} disk", c.backend),
                "0001",
                key.as_bytes(),
            ),
            geometry: Geometry {
                block_size: self.block_size,
                blocks: self.blocks,
                thin: c.thin && c.backend != "null",
                write_cache: c.write_cache,
                read_only: c.read_only,
            },
            limits: {
                let (max_transfer, optimal_transfer) = c.transfer_lengths();
                let limits = Limits {
                    max_transfer,
                    optimal_transfer,
                    ..Limits::default()
                };
                self.storage.limits(self.block_size, limits)
            },
        }
    }
}

/// The units of a target (by LUN index) or of a subsystem (by NSID). Every change counts
/// in its generation, after the change and under the write lock, so a cache that read the
/// generation before a change looks again.
#[derive(Debug)]
pub struct UnitMap<K> {
    units: RwLock<BTreeMap<K, Arc<Lun>>>,
    generation: AtomicU64,
}

impl<K> Default for UnitMap<K> {
    fn default() -> Self {
        UnitMap {
            units: RwLock::new(BTreeMap::new()),
            // A new cache's 0 is never current.
            generation: AtomicU64::new(1),
        }
    }
}

impl<K: Ord + Copy> UnitMap<K> {
    /// The unit under `key`.
    pub fn get(&self, key: K) -> Option<Arc<Lun>> {
        self.read().get(&key).cloned()
    }

    /// Every unit, by key.
    pub fn list(&self) -> Vec<(K, Arc<Lun>)> {
        self.read().iter().map(|(k, u)| (*k, u.clone())).collect()
    }

    /// Puts `unit` under `key`; the unit it replaces.
    pub fn insert(&self, key: K, unit: Arc<Lun>) -> Option<Arc<Lun>> {
        self.change(|units| units.insert(key, unit))
    }

    /// Takes the unit under `key` out.
    pub fn remove(&self, key: K) -> Option<Arc<Lun>> {
        self.change(|units| units.remove(&key))
    }

    fn read(&self) -> std::sync::RwLockReadGuard<'_, BTreeMap<K, Arc<Lun>>> {
        self.units.read().unwrap_or_else(PoisonError::into_inner)
    }

    fn change<R>(&self, f: impl FnOnce(&mut BTreeMap<K, Arc<Lun>>) -> R) -> R {
        let mut units = self.units.write().unwrap_or_else(PoisonError::into_inner);
        let r = f(&mut units);
        self.generation.fetch_add(1, Ordering::Release);
        r
    }
}

/// How many units a connection's cache keeps: a session seldom uses more; past it, the
/// oldest entry makes room.
const CACHED_UNITS: usize = 8;

/// One connection's view of a [`UnitMap`]: the units it used, valid while the map's
/// generation is the one read when they were looked up. A unit is held weakly (a connection
/// that stays idle keeps no removed unit open, no image watched); its counters, which
/// outlive it across a resize, and its block size, which never changes for one `Lun`, are
/// kept outright, so counting a command or sizing its buffer takes no atomic operation.
#[derive(Debug)]
pub struct UnitCache<K> {
    generation: u64,
    entries: Vec<Cached<K>>,
    /// The entry the next one replaces once `entries` is full.
    next: usize,
    /// Some entry holds a tally ([`UnitCache::tally`]).
    tallied: bool,
}

/// A unit as a connection's cache holds it, for one backend operation: taking a count on it
/// (an atomic increment and decrement per operation) is left to whoever needs one, the
/// reactor only when it opens the unit's backend.
#[derive(Debug, Clone, Copy)]
pub struct CachedUnit<'a> {
    /// [`Lun::id`].
    pub id: u64,
    /// The unit.
    pub unit: &'a Weak<Lun>,
}

#[derive(Debug)]
struct Cached<K> {
    key: K,
    id: u64,
    unit: Weak<Lun>,
    block_size: u32,
    stats: Arc<LunStats>,
    /// Commands counted and not yet added to `stats`.
    tally: Tally,
}

impl<K> Cached<K> {
    /// Adds the tally to the unit's counters.
    fn flush(&mut self) {
        if !self.tally.is_empty() {
            self.stats.take(&mut self.tally);
        }
    }
}

impl<K> Default for UnitCache<K> {
    fn default() -> Self {
        UnitCache {
            generation: 0,
            entries: Vec::new(),
            next: 0,
            tallied: false,
        }
    }
}

impl<K> UnitCache<K> {
    /// Adds every tally to its unit's counters.
    pub fn flush(&mut self) {
        if std::mem::take(&mut self.tallied) {
            self.entries.iter_mut().for_each(Cached::flush);
        }
    }
}

/// A connection's last tallies reach the counters when it ends.
impl<K> Drop for UnitCache<K> {
    fn drop(&mut self) {
        self.flush();
    }
}

impl<K: Ord + Copy> UnitCache<K> {
    /// The unit under `key` in `map`, for a backend operation; `None` when there is none.
    pub fn unit(&mut self, map: &UnitMap<K>, key: K) -> Option<CachedUnit<'_>> {
        let mut i = self.find(map, key)?;
        if self.entries[i].unit.strong_count() == 0 {
            // Dropped by a change whose generation this did not see yet: as the map says.
            self.entries.swap_remove(i).flush();
            i = self.find(map, key)?;
        }
        let entry = &self.entries[i];
        Some(CachedUnit {
            id: entry.id,
            unit: &entry.unit,
        })
    }

    /// The block size of the unit under `key`.
    pub fn block_size(&mut self, map: &UnitMap<K>, key: K) -> Option<u32> {
        let i = self.find(map, key)?;
        Some(self.entries[i].block_size)
    }

    /// Counts a finished command on the unit under `key` (nothing when it is gone), on its
    /// counters at once.
    pub fn account(&mut self, map: &UnitMap<K>, key: K, done: &Accounting) {
        if let Some(i) = self.find(map, key) {
            let entry = &mut self.entries[i];
            entry.tally.count(done);
            entry.flush();
        }
    }

    /// Counts a finished command on the unit under `key` (nothing when it is gone) in this
    /// cache's tally, which [`UnitCache::flush`] adds to the unit's counters: the caller
    /// flushes before it sends anything that answers the command.
    pub fn tally(&mut self, map: &UnitMap<K>, key: K, done: &Accounting) {
        if let Some(i) = self.find(map, key) {
            self.entries[i].tally.count(done);
            self.tallied = true;
        }
    }

    /// The entry for `key`, looked up in `map` when the cache has none or the map changed.
    fn find(&mut self, map: &UnitMap<K>, key: K) -> Option<usize> {
        let generation = map.generation.load(Ordering::Acquire);
        if generation != self.generation {
            // The counters of a unit replaced (a resize) are the new one's too.
            self.flush();
            self.entries.clear();
            self.next = 0;
            self.generation = generation;
        }
        if let Some(i) = self.entries.iter().position(|e| e.key == key) {
            return Some(i);
        }
        let unit = map.get(key)?;
        let entry = Cached {
            key,
            id: unit.id,
            unit: Arc::downgrade(&unit),
            block_size: unit.block_size,
            stats: unit.stats.clone(),
            tally: Tally::default(),
        };
        if self.entries.len() < CACHED_UNITS {
            self.entries.push(entry);
            return Some(self.entries.len() - 1);
        }
        let i = self.next;
        self.entries[i].flush();
        self.entries[i] = entry;
        self.next = (i + 1) % CACHED_UNITS;
        Some(i)
    }
}

#[cfg(test)]
mod latency_tests {
    use super::{latency_bucket, LATENCY_BOUNDS_US};

    #[test]
    fn a_latency_falls_in_the_first_bucket_whose_bound_holds_it() {
        assert_eq!(latency_bucket(0), 0);
        assert_eq!(latency_bucket(5_000), 0, "5 us is within le=0.000005");
        assert_eq!(
            latency_bucket(8_000),
            1,
            "a fast read has buckets below 50 us"
        );
        assert_eq!(latency_bucket(50_000), 3, "50 us is within le=0.00005");
        assert_eq!(latency_bucket(50_001), 4);
        assert_eq!(latency_bucket(999_999), 7);
        assert_eq!(latency_bucket(1_000_000), 7, "1 ms is within le=0.001");
        assert_eq!(latency_bucket(5_000_000_000), 18);
        assert_eq!(latency_bucket(60_000_000_000), LATENCY_BOUNDS_US.len());
    }
}

#[cfg(test)]
mod cache_tests {
    use std::sync::atomic::Ordering;
    use std::sync::Arc;
    use std::time::Duration;

    use scsi_core::transport::Accounting;

    use super::{Lun, UnitCache, UnitMap, CACHED_UNITS};
    use crate::config;

    fn unit(lun: u16, block_size: u32) -> Arc<Lun> {
        let text = format!(
            "[server]\nportals = [\"127.0.0.1:0\"]\n[[targets]]\nname = \"iqn.2026-11.test:t\"\n\
             [[targets.luns]]\nlun = {lun}\nbackend = \"memory\"\nsize = \"1MiB\"\n\
             block_size = {block_size}\n"
        );
        let config =
            config::Config::parse(std::path::Path::new("/tmp/x.toml"), &text).expect("a config");
        Arc::new(Lun::open(&config.targets[0].luns[0], Arc::default()).expect("a memory unit"))
    }

    /// The unit a cache lends, counted.
    fn upgrade(unit: Option<super::CachedUnit<'_>>) -> Arc<Lun> {
        let unit = unit.expect("a unit");
        let strong = unit.unit.upgrade().expect("alive");
        assert_eq!(unit.id, strong.id);
        strong
    }

    fn read(lun: u64) -> Accounting {
        Accounting {
            lun,
            read_bytes: 4096,
            write_bytes: 0,
            latency: Duration::from_micros(3),
            error: false,
        }
    }

    #[test]
    fn a_cached_unit_is_the_maps_until_the_map_changes() {
        let map = UnitMap::default();
        let first = unit(0, 512);
        map.insert(0u16, first.clone());
        let mut cache = UnitCache::default();
        assert_eq!(cache.block_size(&map, 0), Some(512));
        assert!(Arc::ptr_eq(&upgrade(cache.unit(&map, 0)), &first));
        assert!(cache.unit(&map, 1).is_none(), "no unit 1");

        // Replaced (a resize, a reload): the next look finds the new one.
        let second = unit(0, 4096);
        map.insert(0, second.clone());
        assert_eq!(cache.block_size(&map, 0), Some(4096));
        assert!(Arc::ptr_eq(&upgrade(cache.unit(&map, 0)), &second));

        map.remove(0);
        assert!(cache.unit(&map, 0).is_none());
        assert!(cache.block_size(&map, 0).is_none());
    }

    /// A unit replaced and dropped by a change whose generation the cache has not seen (the
    /// map changes its units, then bumps the generation; a cache may look in between): the
    /// cache lends the map's unit, not the dropped one.
    #[test]
    fn a_dropped_unit_is_looked_up_again_before_the_generation_moves() {
        let map = UnitMap::default();
        map.insert(0u16, unit(0, 512));
        let mut cache = UnitCache::default();
        cache.tally(&map, 0, &read(0));
        let replaced = map.get(0).expect("unit 0").stats.clone();
        let second = unit(0, 4096);
        map.insert(0, second.clone());
        map.generation.fetch_sub(1, Ordering::Release);
        assert!(Arc::ptr_eq(&upgrade(cache.unit(&map, 0)), &second));
        assert_eq!(cache.block_size(&map, 0), Some(4096));
        assert_eq!(
            replaced.read_commands.load(Ordering::Relaxed),
            1,
            "its tally flushed"
        );
        map.remove(0);
        assert!(cache.unit(&map, 0).is_none());
    }

    /// A connection that sends nothing more after a unit is removed does not keep it (its
    /// backend open, its image watched).
    #[test]
    fn a_removed_unit_is_not_kept_alive_by_a_cache() {
        let map = UnitMap::default();
        let u = unit(3, 512);
        let weak = Arc::downgrade(&u);
        map.insert(3u16, u);
        let mut cache = UnitCache::default();
        assert!(cache.unit(&map, 3).is_some());
        cache.account(&map, 3, &read(3));
        map.remove(3);
        assert!(weak.upgrade().is_none(), "only the map held the unit");
    }

    #[test]
    fn commands_are_counted_on_their_units_counters() {
        let map = UnitMap::default();
        let (a, b) = (unit(0, 512), unit(1, 512));
        map.insert(0u16, a.clone());
        map.insert(1, b.clone());
        let mut cache = UnitCache::default();
        for _ in 0..3 {
            cache.account(&map, 0, &read(0));
        }
        cache.account(&map, 1, &read(1));
        cache.account(&map, 2, &read(2));
        assert_eq!(a.stats.read_commands.load(Ordering::Relaxed), 3);
        assert_eq!(a.stats.read_bytes.load(Ordering::Relaxed), 3 * 4096);
        assert_eq!(b.stats.read_commands.load(Ordering::Relaxed), 1);
        // A resize keeps the counters: the replacement counts on.
        map.insert(0, Arc::new(a.resized(a.storage.clone(), a.blocks)));
        cache.account(&map, 0, &read(0));
        assert_eq!(a.stats.read_commands.load(Ordering::Relaxed), 4);
    }

    /// A tally reaches the counters when it is flushed, when the map changes under the cache
    /// and when the cache is dropped (its connection ended), never twice.
    #[test]
    fn tallied_commands_reach_the_counters_once_flushed() {
        let map = UnitMap::default();
        let a = unit(0, 512);
        map.insert(0u16, a.clone());
        let reads = |u: &Lun| u.stats.read_commands.load(Ordering::Relaxed);
        let mut cache = UnitCache::default();
        for _ in 0..3 {
            cache.tally(&map, 0, &read(0));
        }
        assert_eq!(reads(&a), 0, "tallied, not yet added");
        cache.flush();
        assert_eq!(reads(&a), 3);
        assert_eq!(a.stats.read_bytes.load(Ordering::Relaxed), 3 * 4096);
        let buckets: u64 = a
            .stats
            .read_latency_buckets
            .iter()
            .map(|b| b.load(Ordering::Relaxed))
            .sum();
        assert_eq!(buckets, 3);
        cache.flush();
        assert_eq!(reads(&a), 3, "added once");
        // The map changes (a resize): the tally goes to the counters the units share.
        cache.tally(&map, 0, &read(0));
        map.insert(0, Arc::new(a.resized(a.storage.clone(), a.blocks)));
        cache.tally(&map, 0, &read(0));
        assert_eq!(reads(&a), 4);
        // Immediate accounting adds at once, and what was tallied with it.
        cache.account(&map, 0, &read(0));
        assert_eq!(reads(&a), 6);
        cache.tally(&map, 0, &read(0));
        drop(cache);
        assert_eq!(reads(&a), 7, "the connection's end adds its tally");
    }

    #[test]
    fn more_units_than_the_cache_holds_are_each_found() {
        let map = UnitMap::default();
        let units: Vec<_> = (0..CACHED_UNITS as u16 * 2 + 1)
            .map(|i| {
                let u = unit(i, 512);
                map.insert(i, u.clone());
                u
            })
            .collect();
        let mut cache = UnitCache::default();
        for round in 0..3 {
            for (i, u) in units.iter().enumerate() {
                let found = upgrade(cache.unit(&map, i as u16));
                assert!(Arc::ptr_eq(&found, u), "round {round} unit {i}");
            }
        }
        assert!(cache.entries.len() <= CACHED_UNITS);
    }
}
