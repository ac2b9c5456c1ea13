//! The `rbd` backend: a logical unit whose blocks live in a Ceph RBD image, on librbd's
//! asynchronous API (feature `rbd`; Debian's librbd-dev and librados-dev).
//!
//! Three layers, from the cluster down to one reactor:
//! - [`Cluster`]: one connected librados handle per (ceph.conf, cephx client, keyring, timeout,
//!   cache) in the process, shared by every image that names the same ([`Cluster::shared`]).
//!   Its op timeouts are what turn an OSD or monitor that does not answer into an error
//!   (`-ETIMEDOUT`, then a retryable sense) instead of a command that never ends.
//! - [`Image`]: one open image per logical unit, shared by every reactor. One handle and not
//!   one per reactor, because images have the exclusive-lock feature by default: two handles
//!   in one process would pass the lock back and forth on every write.
//! - [`RbdBackend`]: a reactor's view of an image, implementing [`scsi_core::Backend`] with the
//!   reactor's arena [`Buffer`]s. Reads and writes go to `rbd_aio_read2`/`rbd_aio_write2`
//!   straight from and into the buffer (no copy of ours). librbd calls its completion callback
//!   on one of its own threads; the callback puts the result on the backend's queue and writes
//!   the reactor's completion eventfd, the one its io_uring engine signals, so the reactor wakes
//!   and polls as for a file: no thread per I/O, no allocation of ours per I/O (librbd allocates
//!   its own completion).
//!
//! SCSI maps onto librbd natively: FUA is `LIBRADOS_OP_FLAG_FADVISE_FUA` (librbd writes that
//! I/O through its cache), SYNCHRONIZE CACHE is `rbd_aio_flush`, UNMAP and WRITE SAME with
//! UNMAP of zeros are `rbd_aio_discard` (partial discards zero, so deallocated blocks read as
//! zeros), WRITE SAME is `rbd_aio_writesame` or `rbd_aio_write_zeroes`, COMPARE AND WRITE is
//! `rbd_aio_compare_and_write`, which the OSD applies atomically, so it holds across gateways.
//! The rare composite commands (VERIFY, ORWRITE, GET LBA STATUS and a COMPARE AND WRITE that
//! spans two objects) run on the image's helper thread with librbd's synchronous calls.
//!
//! [`rados`] keeps small objects that several gateways share, changed by versioned
//! compare-and-swap and published by watch/notify.

mod ffi;
pub mod rados;
pub mod testing;

use std::cell::UnsafeCell;
use std::collections::{HashMap, VecDeque};
use std::ffi::{c_void, CString};
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::raw::{c_char, c_int};
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{mpsc, Arc, Mutex, OnceLock, PoisonError, Weak};
use std::time::{Duration, Instant};

use scsi_core::{Backend, BackendError, Op, Output, WriteSamePlan};

use crate::arena::Buffer;

/// How to reach a cluster.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct ClusterConfig {
    /// ceph.conf to read; librados' default search (`$CEPH_CONF`, /etc/ceph/ceph.conf) when
    /// absent.
    pub ceph_conf: Option<PathBuf>,
    /// The cephx id, without `client.` (`admin` when absent in the config).
    pub client: String,
    /// The keyring holding the client's key; the ceph.conf's `keyring` when absent.
    pub keyring: Option<PathBuf>,
    /// How long a monitor or OSD may take to answer before the operation fails: librados'
    /// `rados_osd_op_timeout`, `rados_mon_op_timeout` and `client_mount_timeout`.
    pub timeout: Duration,
    /// librbd's write cache (`rbd_cache`, write-around): writes complete once cached, FUA and
    /// SYNCHRONIZE CACHE wait for the OSDs. Off: every write completes only once the OSDs
    /// have it.
    pub cache: bool,
}

/// Which image.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct ImageSpec {
    /// The pool.
    pub pool: String,
    /// The RADOS namespace in the pool, empty for none.
    pub namespace: String,
    /// The image's name.
    pub image: String,
}

impl std::fmt::Display for ImageSpec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.namespace.is_empty() {
            write!(f, "{}/{}", self.pool, self.image)
        } else {
            write!(f, "{}/{}/{}", self.pool, self.namespace, self.image)
        }
    }
}

/// What went wrong reaching the cluster or the image. [`RbdError::key`] says which
/// configuration key the fix belongs to.
#[derive(Debug, Clone, thiserror::Error)]
#[non_exhaustive]
pub enum RbdError {
    /// The ceph.conf could not be read or parsed.
    #[error("cannot read {path}: {reason}")]
    Conf {
        /// The file.
        path: String,
        /// librados' errno, as text.
        reason: String,
    },
    /// A setting was refused by librados.
    #[error("librados refused {option}={value}: {reason}")]
    Option {
        /// The option.
        option: String,
        /// Its value.
        value: String,
        /// Why.
        reason: String,
    },
    /// No monitor answered, or none could be found, within the timeout.
    #[error("cannot connect to the cluster as client.{client}: {reason}")]
    Connect {
        /// The cephx id.
        client: String,
        /// Why.
        reason: String,
    },
    /// The monitors refused the client's key (cephx).
    #[error("the cluster refused client.{client}'s credentials: {reason}")]
    Credentials {
        /// The cephx id.
        client: String,
        /// Why.
        reason: String,
    },
    /// The pool does not exist.
    #[error("pool {pool}: {reason}")]
    Pool {
        /// The pool.
        pool: String,
        /// Why.
        reason: String,
    },
    /// The image does not exist and no size was given to create it.
    #[error("image {spec} does not exist and no size is given to create it")]
    NoImage {
        /// pool/namespace/image.
        spec: String,
    },
    /// A request to the cluster itself failed.
    #[error("{op}: {}", errno_text((*.errno).into()))]
    Cluster {
        /// The librados call.
        op: &'static str,
        /// Its negative errno.
        errno: i32,
    },
    /// Opening, creating or asking the image failed.
    #[error("image {spec}: {what}: {reason}")]
    Image {
        /// pool/namespace/image.
        spec: String,
        /// What was tried.
        what: &'static str,
        /// Why.
        reason: String,
    },
}

impl RbdError {
    /// The configuration key the error is about, for messages that name it.
    pub fn key(&self) -> &'static str {
        match self {
            RbdError::Conf { .. } => "ceph_conf",
            RbdError::Option { .. } => "ceph_conf",
            RbdError::Connect { .. } => "ceph_conf",
            RbdError::Credentials { .. } => "client",
            RbdError::Pool { .. } => "pool",
            RbdError::NoImage { .. } => "size",
            RbdError::Image { .. } => "image",
            RbdError::Cluster { .. } => "ceph_conf",
        }
    }
}

/// `strerror` of a negative errno as librados returns them.
fn errno_text(ret: i64) -> String {
    io::Error::from_raw_os_error((-ret) as i32).to_string()
}

fn cstring(s: &str) -> CString {
    // Names and paths come from validated configuration; an interior NUL cannot be named in
    // TOML's basic strings without an escape, which the config check refuses before this.
    CString::new(s.replace('\0', "")).expect("NULs removed")
}

/// A connected librados handle.
pub struct Cluster {
    rados: ffi::rados_t,
    config: ClusterConfig,
}

// Safety: librados' cluster handle is thread-safe: every call on it may come from any thread
// (librados' documentation, "thread safety": a rados_t and the ioctxs made from it may be
// shared between threads).
unsafe impl Send for Cluster {}
// Safety: as for Send.
unsafe impl Sync for Cluster {}

impl std::fmt::Debug for Cluster {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Cluster")
            .field("config", &self.config)
            .finish()
    }
}

fn clusters() -> &'static Mutex<HashMap<ClusterConfig, Weak<Cluster>>> {
    static CLUSTERS: OnceLock<Mutex<HashMap<ClusterConfig, Weak<Cluster>>>> = OnceLock::new();
    CLUSTERS.get_or_init(Default::default)
}

impl Cluster {
    /// Every connection [`Cluster::shared`] keeps open in this process: what fencing this
    /// process must blocklist.
    pub fn open() -> Vec<Arc<Cluster>> {
        clusters()
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .values()
            .filter_map(Weak::upgrade)
            .collect()
    }

    /// Connects, waiting at most `config.timeout` for the monitors.
    pub fn connect(config: &ClusterConfig) -> Result<Cluster, RbdError> {
        let mut rados: ffi::rados_t = std::ptr::null_mut();
        let id = cstring(&config.client);
        // Safety: rados_create writes a new handle into `rados`; `id` outlives the call.
        let ret = unsafe { ffi::rados_create(&mut rados, id.as_ptr()) };
        if ret < 0 {
            return Err(RbdError::Connect {
                client: config.client.clone(),
                reason: errno_text(ret.into()),
            });
        }
        // From here the handle is shut down on every exit by Cluster's Drop.
        let cluster = Cluster {
            rados,
            config: config.clone(),
        };
        let path = config
            .ceph_conf
            .as_ref()
            .map(|p| cstring(&p.to_string_lossy()));
        // Safety: the handle is live and not connected; a null path asks for the default
        // search; `path` outlives the call.
        let ret = unsafe {
            ffi::rados_conf_read_file(
                rados,
                path.as_ref().map_or(std::ptr::null(), |p| p.as_ptr()),
            )
        };
        if ret < 0 {
            return Err(RbdError::Conf {
                path: config
                    .ceph_conf
                    .as_ref()
                    .map_or("the default ceph.conf".into(), |p| p.display().to_string()),
                reason: errno_text(ret.into()),
            });
        }
        let secs = config.timeout.as_secs().max(1).to_string();
        let mut options = vec![
            ("rados_osd_op_timeout", secs.clone()),
            ("rados_mon_op_timeout", secs.clone()),
            ("client_mount_timeout", secs),
            ("rbd_cache", config.cache.to_string()),
            ("rbd_cache_policy", "writearound".into()),
            // Deallocated blocks must read as zeros (LBPRZ): partial discards zero.
            ("rbd_skip_partial_discard", "false".into()),
        ];
        if let Some(k) = &config.keyring {
            options.push(("keyring", k.display().to_string()));
        }
        // librbd hands each request to, and each reply back through, librados' io_context
        // threads (2 by default). On a machine of two cores, where the reactors already keep
        // both busy, one such thread means fewer switches: measured 16% more 4 KiB reads at
        // queue depth 32 through targetd (docs/ceph.md). Ceph's default elsewhere.
        if std::thread::available_parallelism().map_or(1, |n| n.get()) <= 2 {
            options.push(("librados_thread_count", "1".into()));
        }
        for (option, value) in options {
            let (o, v) = (cstring(option), cstring(&value));
            // Safety: live, unconnected handle; both strings outlive the call.
            let ret = unsafe { ffi::rados_conf_set(rados, o.as_ptr(), v.as_ptr()) };
            if ret < 0 {
                return Err(RbdError::Option {
                    option: option.into(),
                    value,
                    reason: errno_text(ret.into()),
                });
            }
        }
        // Safety: live handle, configured above; blocks at most client_mount_timeout.
        let ret = unsafe { ffi::rados_connect(rados) };
        if ret < 0 {
            let reason = errno_text(ret.into());
            let client = config.client.clone();
            return Err(match -ret {
                libc::EACCES | libc::EPERM => RbdError::Credentials { client, reason },
                libc::ENOENT => RbdError::Credentials {
                    client,
                    reason: format!("{reason} (no keyring with the client's key?)"),
                },
                _ => RbdError::Connect { client, reason },
            });
        }
        Ok(cluster)
    }

    /// The process's connection for `config`: made on first use, shared while any image holds
    /// it.
    pub fn shared(config: &ClusterConfig) -> Result<Arc<Cluster>, RbdError> {
        let mut map = clusters().lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(c) = map.get(config).and_then(Weak::upgrade) {
            return Ok(c);
        }
        map.retain(|_, w| w.strong_count() > 0);
        let c = Arc::new(Cluster::connect(config)?);
        map.insert(config.clone(), Arc::downgrade(&c));
        Ok(c)
    }

    /// Forgets the process's shared connections: the next [`Cluster::shared`] connects anew.
    /// For a process whose clients were blocklisted (fenced by another gateway): the OSDs
    /// refuse a blocklisted client's operations for good, and a new connection is a new
    /// client. The connections in use stay with their holders until they let go.
    pub fn forget_shared() {
        clusters()
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clear();
    }

    /// How it was configured.
    pub fn config(&self) -> &ClusterConfig {
        &self.config
    }

    /// This client's instance id (`client.<id>` in `ceph osd blocklist`, the watchers of an
    /// image).
    pub fn instance_id(&self) -> u64 {
        // Safety: connected handle.
        unsafe { ffi::rados_get_instance_id(self.rados) }
    }

    /// This client's addresses as the OSDs know it, in the form `ceph osd blocklist add`
    /// takes (`v2:127.0.0.1:0/1234`): what another client names to fence this one.
    pub fn address(&self) -> Result<String, RbdError> {
        let mut out: *mut std::os::raw::c_char = std::ptr::null_mut();
        // Safety: connected handle; librados allocates the string with malloc, freed below.
        let ret = unsafe { ffi::rados_getaddrs(self.rados, &mut out) };
        if ret < 0 || out.is_null() {
            return Err(RbdError::Cluster {
                op: "rados_getaddrs",
                errno: if ret < 0 { ret } else { -libc::EIO },
            });
        }
        // Safety: a NUL-terminated string librados returned; copied before the free.
        let text = unsafe { std::ffi::CStr::from_ptr(out) }
            .to_string_lossy()
            .into_owned();
        // Safety: allocated by librados with malloc (its documentation: free it), freed once.
        unsafe { libc::free(out.cast()) };
        // "[v2:127.0.0.1:0/1234,v1:127.0.0.1:0/1234]": the first address is enough.
        Ok(text
            .trim_matches(|c| c == '[' || c == ']')
            .split(',')
            .next()
            .unwrap_or_default()
            .to_string())
    }

    /// Fences the client at `address` (another gateway's [`Cluster::address`]): the OSDs
    /// refuse its operations, its watches end, for `expire` (0: the cluster's default).
    pub fn blocklist(&self, address: &str, expire: Duration) -> Result<(), RbdError> {
        let a = cstring(address);
        let mut bytes = a.into_bytes_with_nul();
        // Safety: connected handle; `bytes` is a NUL-terminated string that outlives the call
        // (librados takes a mutable pointer but does not keep it).
        let ret = unsafe {
            ffi::rados_blocklist_add(
                self.rados,
                bytes.as_mut_ptr().cast(),
                expire.as_secs().min(u64::from(u32::MAX)) as u32,
            )
        };
        if ret < 0 {
            return Err(RbdError::Cluster {
                op: "rados_blocklist_add",
                errno: ret,
            });
        }
        Ok(())
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        // Safety: every ioctx and image made from this handle holds an Arc on it, so none is
        // left; the handle is shut down once.
        unsafe { ffi::rados_shutdown(self.rados) }
    }
}

/// librbd's version, `(major, minor, extra)`: 1.16 is Ceph 16.2.
pub fn librbd_version() -> (i32, i32, i32) {
    let (mut a, mut b, mut c) = (0, 0, 0);
    // Safety: writes three ints.
    unsafe { ffi::rbd_version(&mut a, &mut b, &mut c) };
    (a, b, c)
}

/// Counters of one image, for metrics and `targetctl luns`.
#[derive(Debug, Default)]
pub struct ImageStats {
    /// Operations handed to librbd and not yet completed.
    pub in_flight: AtomicU64,
    /// Operations completed.
    pub completed: AtomicU64,
    /// Sum of their latencies (submit to the reactor's seeing the completion), nanoseconds.
    pub latency_ns: AtomicU64,
    /// Operations that failed because the cluster did not answer in time (`-ETIMEDOUT`) or
    /// this client was blocklisted.
    pub unavailable: AtomicU64,
    /// Operations that failed otherwise.
    pub errors: AtomicU64,
}

type WatchFn = Box<dyn Fn() + Send + Sync>;

/// An open image, shared by every reactor.
pub struct Image {
    cluster: Arc<Cluster>,
    ioctx: ffi::rados_ioctx_t,
    image: ffi::rbd_image_t,
    spec: ImageSpec,
    object_size: u64,
    features: u64,
    read_only: bool,
    /// The update watch's handle and the callback it calls (boxed twice: the inner box's
    /// address is the callback's argument).
    watch: Mutex<Option<(u64, Box<WatchFn>)>>,
    helper: Mutex<Option<mpsc::Sender<Job>>>,
    stats: ImageStats,
}

// Safety: librbd's image handle may be used from several threads at once for I/O (aio calls,
// stat, flush), as QEMU and tcmu-runner do; the calls made here that change the handle's own
// state (close, update_watch/unwatch) are made with exclusive access (&mut in Drop) or under
// the `watch` mutex.
unsafe impl Send for Image {}
// Safety: as for Send.
unsafe impl Sync for Image {}

impl std::fmt::Debug for Image {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Image")
            .field("spec", &self.spec)
            .field("object_size", &self.object_size)
            .finish()
    }
}

impl Image {
    /// Opens the image `spec` names, creating it at `size` bytes when it does not exist (an
    /// existing image is never resized here). Returns whether it was created.
    pub fn open(
        cluster: Arc<Cluster>,
        spec: &ImageSpec,
        size: Option<u64>,
        read_only: bool,
    ) -> Result<(Arc<Image>, bool), RbdError> {
        let image_err = |what, ret: i64| RbdError::Image {
            spec: spec.to_string(),
            what,
            reason: errno_text(ret),
        };
        let ioctx = IoCtx::open(&cluster, &spec.pool, &spec.namespace)?;
        let name = cstring(&spec.image);
        let open = |handle: &mut ffi::rbd_image_t| {
            // Safety: live ioctx; `name` outlives the call; a null snapshot is the head.
            unsafe {
                if read_only {
                    ffi::rbd_open_read_only(ioctx.0, name.as_ptr(), handle, std::ptr::null())
                } else {
                    ffi::rbd_open(ioctx.0, name.as_ptr(), handle, std::ptr::null())
                }
            }
        };
        let mut handle: ffi::rbd_image_t = std::ptr::null_mut();
        let mut created = false;
        let mut ret = open(&mut handle);
        if ret == -libc::ENOENT {
            let Some(size) = size else {
                return Err(RbdError::NoImage {
                    spec: spec.to_string(),
                });
            };
            let mut order: c_int = 0;
            // Safety: live ioctx; `name` outlives the call; order 0 asks for the default
            // object size; features come from the cluster's rbd_default_features.
            let r = unsafe { ffi::rbd_create(ioctx.0, name.as_ptr(), size, &mut order) };
            if r < 0 && r != -libc::EEXIST {
                return Err(image_err("create", r.into()));
            }
            created = r == 0;
            ret = open(&mut handle);
        }
        if ret < 0 {
            return Err(image_err("open", ret.into()));
        }
        let mut image = Image {
            cluster,
            ioctx: ioctx.take(),
            image: handle,
            spec: spec.clone(),
            object_size: 0,
            features: 0,
            read_only,
            watch: Mutex::new(None),
            helper: Mutex::new(None),
            stats: ImageStats::default(),
        };
        let info = image.stat().map_err(|r| image_err("stat", r))?;
        image.object_size = info.obj_size;
        let mut features = 0u64;
        // Safety: open image; writes a u64.
        let ret = unsafe { ffi::rbd_get_features(image.image, &mut features) };
        if ret < 0 {
            return Err(image_err("features", ret.into()));
        }
        image.features = features;
        Ok((Arc::new(image), created))
    }

    fn stat(&self) -> Result<ffi::rbd_image_info_t, i64> {
        // Safety: rbd_image_info_t is plain data; all-zero is a valid value.
        let mut info: ffi::rbd_image_info_t = unsafe { std::mem::zeroed() };
        // Safety: open image; writes at most `infosize` bytes into `info`.
        let ret = unsafe {
            ffi::rbd_stat(
                self.image,
                &mut info,
                std::mem::size_of::<ffi::rbd_image_info_t>(),
            )
        };
        if ret < 0 {
            Err(ret.into())
        } else {
            Ok(info)
        }
    }

    /// pool/namespace/image.
    pub fn spec(&self) -> &ImageSpec {
        &self.spec
    }

    /// The connection it was opened on.
    pub fn cluster(&self) -> &Arc<Cluster> {
        &self.cluster
    }

    /// Bytes per RADOS object: the unit of allocation and the OPTIMAL TRANSFER LENGTH
    /// GRANULARITY.
    pub fn object_size(&self) -> u64 {
        self.object_size
    }

    /// Whether librbd keeps an object map with fast-diff (GET LBA STATUS is then cheap).
    pub fn fast_diff(&self) -> bool {
        self.features & ffi::RBD_FEATURE_FAST_DIFF != 0
            && self.features & ffi::RBD_FEATURE_OBJECT_MAP != 0
    }

    /// Whether the image has the exclusive-lock feature.
    pub fn exclusive_lock(&self) -> bool {
        self.features & ffi::RBD_FEATURE_EXCLUSIVE_LOCK != 0
    }

    /// Opened read-only.
    pub fn read_only(&self) -> bool {
        self.read_only
    }

    /// Its counters.
    pub fn stats(&self) -> &ImageStats {
        &self.stats
    }

    /// The size now, in bytes (librbd refreshes the header first when it changed).
    pub fn size(&self) -> Result<u64, RbdError> {
        let mut size = 0u64;
        // Safety: open image; writes a u64.
        let ret = unsafe { ffi::rbd_get_size(self.image, &mut size) };
        if ret < 0 {
            return Err(RbdError::Image {
                spec: self.spec.to_string(),
                what: "size",
                reason: errno_text(ret.into()),
            });
        }
        Ok(size)
    }

    /// The owners of the image's exclusive lock, as librbd names them.
    pub fn lock_owners(&self) -> Result<Vec<String>, RbdError> {
        let mut owners: [*mut std::os::raw::c_char; 8] = [std::ptr::null_mut(); 8];
        let mut count = owners.len();
        let mut mode = 0;
        // Safety: open image; `owners` has room for `count` pointers, which librbd fills with
        // strings it allocates; freed below with rbd_lock_get_owners_cleanup.
        let ret = unsafe {
            ffi::rbd_lock_get_owners(self.image, &mut mode, owners.as_mut_ptr(), &mut count)
        };
        if ret == -libc::ENOENT {
            return Ok(Vec::new());
        }
        if ret < 0 {
            return Err(RbdError::Image {
                spec: self.spec.to_string(),
                what: "lock owners",
                reason: errno_text(ret.into()),
            });
        }
        let list = owners[..count.min(owners.len())]
            .iter()
            .filter(|p| !p.is_null())
            // Safety: NUL-terminated strings librbd returned, read before the cleanup.
            .map(|&p| {
                unsafe { std::ffi::CStr::from_ptr(p) }
                    .to_string_lossy()
                    .into_owned()
            })
            .collect();
        // Safety: the `count` strings librbd allocated above, freed once.
        unsafe { ffi::rbd_lock_get_owners_cleanup(owners.as_mut_ptr(), count.min(8)) };
        Ok(list)
    }

    /// Breaks the exclusive lock `owner` holds (an owner [`Image::lock_owners`] named, which
    /// has been fenced): the next write here takes the lock at once instead of waiting for
    /// the owner to answer a request it never will.
    pub fn break_lock(&self, owner: &str) -> Result<(), RbdError> {
        let o = cstring(owner);
        // Safety: open image; `o` outlives the call.
        let ret = unsafe { ffi::rbd_lock_break(self.image, 0, o.as_ptr()) };
        if ret < 0 && ret != -libc::ENOENT {
            return Err(RbdError::Image {
                spec: self.spec.to_string(),
                what: "break lock",
                reason: errno_text(ret.into()),
            });
        }
        Ok(())
    }

    /// Resizes the image (shrinking only when `allow_shrink`).
    pub fn resize(&self, bytes: u64, allow_shrink: bool) -> Result<(), RbdError> {
        unsafe extern "C" fn progress(_: u64, _: u64, _: *mut c_void) -> c_int {
            0
        }
        // Safety: open image; librbd calls the progress callback (which ignores its
        // argument) only during the call.
        let ret = unsafe {
            ffi::rbd_resize2(
                self.image,
                bytes,
                allow_shrink,
                Some(progress),
                std::ptr::null_mut(),
            )
        };
        if ret < 0 {
            return Err(RbdError::Image {
                spec: self.spec.to_string(),
                what: "resize",
                reason: errno_text(ret.into()),
            });
        }
        Ok(())
    }

    /// Writes what librbd's cache holds to the OSDs and waits for them.
    pub fn flush(&self) -> Result<(), RbdError> {
        // Safety: open image; blocks until the flush completes (or the op timeout).
        let ret = unsafe { ffi::rbd_flush(self.image) };
        if ret < 0 {
            return Err(RbdError::Image {
                spec: self.spec.to_string(),
                what: "flush",
                reason: errno_text(ret.into()),
            });
        }
        Ok(())
    }

    /// Calls `f` (on a librbd thread) whenever the image's header changes: a resize by this
    /// or any other client, a snapshot, a feature change. Replaces an earlier watch.
    pub fn watch(&self, f: impl Fn() + Send + Sync + 'static) -> Result<(), RbdError> {
        let mut w = self.watch.lock().unwrap_or_else(PoisonError::into_inner);
        self.unwatch(&mut w);
        let boxed: Box<WatchFn> = Box::new(Box::new(f));
        let arg = &*boxed as *const WatchFn as *mut c_void;
        let mut handle = 0u64;
        // Safety: open image; `arg` points to the inner box, which stays at its address until
        // the watch is removed (in `unwatch`, which rbd_update_unwatch makes wait for a
        // callback under way) because the outer box is kept beside the handle.
        let ret = unsafe { ffi::rbd_update_watch(self.image, &mut handle, Some(on_update), arg) };
        if ret < 0 {
            return Err(RbdError::Image {
                spec: self.spec.to_string(),
                what: "watch",
                reason: errno_text(ret.into()),
            });
        }
        *w = Some((handle, boxed));
        Ok(())
    }

    fn unwatch(&self, w: &mut Option<(u64, Box<WatchFn>)>) {
        if let Some((handle, f)) = w.take() {
            // Safety: a handle rbd_update_watch gave for this image; after it returns librbd
            // calls the callback no more, so `f` may be dropped.
            unsafe { ffi::rbd_update_unwatch(self.image, handle) };
            drop(f);
        }
    }

    fn helper(&self) -> Option<mpsc::Sender<Job>> {
        let mut h = self.helper.lock().unwrap_or_else(PoisonError::into_inner);
        if h.is_none() {
            let (tx, rx) = mpsc::channel::<Job>();
            let spawned = std::thread::Builder::new()
                .name("rbd-helper".into())
                .spawn(move || {
                    // Ends when the image drops its sender.
                    for job in rx {
                        job.run();
                    }
                });
            if spawned.is_err() {
                return None;
            }
            *h = Some(tx);
        }
        h.clone()
    }

    /// Reads bytes into `buf` synchronously.
    fn read_sync(&self, at: u64, buf: &mut [u8]) -> Result<(), i64> {
        // Safety: open image; librbd writes at most buf.len() bytes into buf.
        let ret = unsafe { ffi::rbd_read2(self.image, at, buf.len(), buf.as_mut_ptr().cast(), 0) };
        if ret < 0 {
            return Err(ret as i64);
        }
        if (ret as usize) < buf.len() {
            buf[ret as usize..].fill(0);
        }
        Ok(())
    }

    /// Writes `buf` synchronously.
    fn write_sync(&self, at: u64, buf: &[u8], flags: c_int) -> Result<(), i64> {
        // Safety: open image; librbd reads buf.len() bytes of buf during the call.
        let ret = unsafe { ffi::rbd_write2(self.image, at, buf.len(), buf.as_ptr().cast(), flags) };
        if ret < 0 {
            return Err(ret as i64);
        }
        Ok(())
    }

    /// Whether the byte at `at` is allocated, and how many bytes from it (up to `limit`) share
    /// that state, from the object map where the image has fast-diff.
    fn allocation(&self, at: u64, limit: u64) -> Result<(bool, u64), i64> {
        struct Scan {
            at: u64,
            end: u64,
            /// The first extent that ends after `at`: (start, end).
            first: Option<(u64, u64)>,
        }
        unsafe extern "C" fn cb(off: u64, len: usize, exists: c_int, arg: *mut c_void) -> c_int {
            // Safety: `arg` is the Scan on allocation's stack, alive for the whole
            // rbd_diff_iterate2 call that calls this.
            let scan = unsafe { &mut *(arg as *mut Scan) };
            let end = off + len as u64;
            if exists == 0 || end <= scan.at {
                return 0;
            }
            match &mut scan.first {
                None => scan.first = Some((off, end)),
                Some((_, e)) if off <= *e => *e = (*e).max(end),
                // A gap after the first extent: nothing further matters.
                Some(_) => return -libc::ECANCELED,
            }
            if scan.first.is_some_and(|(s, _)| s > scan.at) {
                // Unallocated from `at` up to this extent.
                return -libc::ECANCELED;
            }
            0
        }
        let end = at.saturating_add(limit);
        let mut scan = Scan {
            at,
            end,
            first: None,
        };
        // Safety: open image; the callback and its argument live for the call.
        let ret = unsafe {
            ffi::rbd_diff_iterate2(
                self.image,
                std::ptr::null(),
                at,
                limit,
                1,
                u8::from(self.fast_diff()),
                Some(cb),
                (&mut scan as *mut Scan).cast(),
            )
        };
        if ret < 0 && ret != -libc::ECANCELED {
            return Err(ret.into());
        }
        Ok(match scan.first {
            Some((s, e)) if s <= at => (true, e.min(scan.end) - at),
            Some((s, _)) => (false, s - at),
            None => (false, scan.end - at),
        })
    }

    /// Runs an operation with librbd's synchronous calls, on the helper thread.
    fn execute_sync(&self, op: &Op, buf: &mut [u8], bs: u64) -> Result<Output, BackendError> {
        let fail = |lba: u64, write: bool| move |ret: i64| map_errno(ret, lba, write, &self.stats);
        match *op {
            Op::Compare {
                lba,
                blocks,
                offset,
                same,
            } => {
                let len = u64::from(blocks) * bs;
                let o = offset as usize;
                let mut have = vec![0u8; len as usize];
                self.read_sync(lba * bs, &mut have)
                    .map_err(fail(lba, false))?;
                let first = if same {
                    have.chunks(bs as usize).enumerate().find_map(|(i, c)| {
                        first_difference(c, &buf[o..o + bs as usize]).map(|p| i * bs as usize + p)
                    })
                } else {
                    first_difference(&have, &buf[o..o + len as usize])
                };
                match first {
                    Some(i) => Err(BackendError::Miscompare { offset: i as u64 }),
                    None => Ok(Output::Done),
                }
            }
            Op::OrWrite { lba, blocks, fua } => {
                let len = (u64::from(blocks) * bs) as usize;
                let mut have = vec![0u8; len];
                self.read_sync(lba * bs, &mut have)
                    .map_err(fail(lba, false))?;
                have.iter_mut().zip(&buf[..len]).for_each(|(h, b)| *h |= b);
                self.write_sync(lba * bs, &have, fua_flag(fua))
                    .map_err(fail(lba, true))?;
                Ok(Output::Done)
            }
            Op::CompareAndWrite { lba, blocks, fua } => {
                // Only when librbd cannot (more than one sector): atomic on this gateway (the
                // core holds the range against its other writers), not across gateways.
                let len = (u64::from(blocks) * bs) as usize;
                let mut have = vec![0u8; len];
                self.read_sync(lba * bs, &mut have)
                    .map_err(fail(lba, false))?;
                if let Some(i) = first_difference(&have, &buf[..len]) {
                    return Err(BackendError::Miscompare { offset: i as u64 });
                }
                self.write_sync(lba * bs, &buf[len..2 * len], fua_flag(fua))
                    .map_err(fail(lba, true))?;
                Ok(Output::Done)
            }
            Op::LbaStatus { lba } => {
                let size = self.size().map_err(|_| BackendError::Internal)?;
                let at = lba * bs;
                if at >= size {
                    return Err(BackendError::Internal);
                }
                // At most 256 objects per answer: GET LBA STATUS may be asked again from the
                // next LBA, and without fast-diff each object costs a round trip.
                let limit = (size - at).min(self.object_size.max(bs) * 256);
                let (mapped, bytes) = self.allocation(at, limit).map_err(fail(lba, false))?;
                Ok(Output::LbaStatus {
                    mapped,
                    blocks: (bytes / bs).max(1),
                })
            }
            _ => Err(BackendError::Internal),
        }
    }
}

impl Drop for Image {
    fn drop(&mut self) {
        let mut w = self
            .watch
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        self.unwatch(&mut w);
        // Close the helper's channel: its thread ends (no job is left: each holds the image).
        self.helper
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        // Safety: no backend is left (each holds an Arc<Image>) and so no I/O is in flight;
        // the image and then its ioctx are closed once.
        unsafe {
            ffi::rbd_close(self.image);
            ffi::rados_ioctx_destroy(self.ioctx);
        }
    }
}

/// An ioctx destroyed when dropped unless taken.
struct IoCtx(ffi::rados_ioctx_t);

impl IoCtx {
    /// An I/O context on `pool`, in RADOS namespace `namespace` (empty for none).
    fn open(cluster: &Cluster, pool: &str, namespace: &str) -> Result<IoCtx, RbdError> {
        let mut ioctx: ffi::rados_ioctx_t = std::ptr::null_mut();
        let name = cstring(pool);
        // Safety: connected handle; `name` outlives the call; writes the new ioctx.
        let ret = unsafe { ffi::rados_ioctx_create(cluster.rados, name.as_ptr(), &mut ioctx) };
        if ret < 0 {
            return Err(RbdError::Pool {
                pool: pool.into(),
                reason: errno_text(ret.into()),
            });
        }
        let ioctx = IoCtx(ioctx);
        if !namespace.is_empty() {
            let ns = cstring(namespace);
            // Safety: live ioctx; librados copies the name.
            unsafe { ffi::rados_ioctx_set_namespace(ioctx.0, ns.as_ptr()) };
        }
        Ok(ioctx)
    }

    fn take(mut self) -> ffi::rados_ioctx_t {
        std::mem::replace(&mut self.0, std::ptr::null_mut())
    }
}

impl Drop for IoCtx {
    fn drop(&mut self) {
        if !self.0.is_null() {
            // Safety: an ioctx from rados_ioctx_create that nothing else holds.
            unsafe { ffi::rados_ioctx_destroy(self.0) }
        }
    }
}

unsafe extern "C" fn on_update(arg: *mut c_void) {
    // Safety: `arg` is the WatchFn that `Image::watch` keeps alive until the watch is
    // removed.
    let f = unsafe { &*(arg as *const WatchFn) };
    f();
}

/// The offset of the first byte where `a` and `b` differ.
fn first_difference(a: &[u8], b: &[u8]) -> Option<usize> {
    a.iter().zip(b).position(|(x, y)| x != y)
}

fn fua_flag(fua: bool) -> c_int {
    if fua {
        ffi::LIBRADOS_OP_FLAG_FADVISE_FUA
    } else {
        0
    }
}

/// What a negative errno from librbd means to the initiator.
fn map_errno(ret: i64, lba: u64, write: bool, stats: &ImageStats) -> BackendError {
    let e = (-ret) as i32;
    match e {
        libc::ETIMEDOUT | libc::ESHUTDOWN | libc::ENOTCONN | libc::EAGAIN => {
            stats.unavailable.fetch_add(1, Ordering::Relaxed);
            BackendError::Unavailable
        }
        _ => {
            stats.errors.fetch_add(1, Ordering::Relaxed);
            match e {
                libc::ENOSPC | libc::EDQUOT => BackendError::NoSpace,
                libc::EROFS => BackendError::WriteProtected,
                _ if write => BackendError::Write { lba },
                _ => BackendError::Read { lba },
            }
        }
    }
}

/// A job for the image's helper thread.
struct Job {
    image: Arc<Image>,
    shared: Arc<Shared>,
    index: u32,
    op: Op,
    buf: *mut u8,
    len: usize,
    bs: u64,
}

// Safety: `buf` points into an arena buffer that the submitting backend keeps (in its pending
// table, untouched) until this job's completion comes back; nothing else reads or writes it
// meanwhile.
unsafe impl Send for Job {}

impl Job {
    fn run(self) {
        // Safety: see `impl Send for Job`: the buffer is this job's alone until it completes.
        let buf = unsafe { std::slice::from_raw_parts_mut(self.buf, self.len) };
        let result = self.image.execute_sync(&self.op, buf, self.bs);
        self.shared.push(self.index, Finished::Sync(result));
    }
}

/// How an operation finished, as the callback or the helper hands it over.
#[derive(Debug, Clone, Copy)]
enum Finished {
    /// librbd's return value.
    Aio(i64),
    /// A helper job's result.
    Sync(Result<Output, BackendError>),
}

/// The queue librbd's threads hand completions to, and the reactor's wake-up.
struct Shared {
    done: Mutex<Vec<(u32, Finished)>>,
    wake: OwnedFd,
}

impl Shared {
    fn push(&self, index: u32, f: Finished) {
        let mut done = self.done.lock().unwrap_or_else(PoisonError::into_inner);
        // Capacity is reserved for every slot, and a slot has one operation at a time.
        done.push((index, f));
        let first = done.len() == 1;
        drop(done);
        if first {
            crate::engine::signal(self.wake.as_raw_fd());
        }
    }
}

/// A completion's argument: which slot, of which backend. Lives at a fixed address (chunks
/// are boxed and never moved or freed while the backend lives).
struct SlotCell {
    shared: *const Shared,
    index: u32,
    /// Where librbd writes a compare-and-write's mismatch offset.
    mismatch: UnsafeCell<u64>,
}

const CHUNK: usize = 64;

/// The most librbd's compare-and-write takes: one 512-byte sector. Longer ones run on the
/// helper thread, atomic against this gateway's writes only; so an RBD unit in 512-byte
/// blocks reports MAXIMUM COMPARE AND WRITE LENGTH 1 ([`NATIVE_COMPARE_AND_WRITE`] bytes).
pub const NATIVE_COMPARE_AND_WRITE: u64 = 512;

/// What the reactor keeps of an operation in flight.
struct Pending {
    token: u64,
    op: Op,
    buffer: Buffer,
    started: Instant,
}

/// A reactor's backend for one image: see the module's documentation.
pub struct RbdBackend {
    image: Arc<Image>,
    block_size: u32,
    shared: Arc<Shared>,
    cells: Vec<Box<[SlotCell]>>,
    pending: Vec<Option<Pending>>,
    free: Vec<u32>,
    outstanding: usize,
    spare: Vec<(u32, Finished)>,
    completions: VecDeque<(u64, Result<Output, BackendError>, Buffer)>,
}

impl std::fmt::Debug for RbdBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RbdBackend")
            .field("image", &self.image.spec)
            .field("outstanding", &self.outstanding)
            .finish()
    }
}

impl RbdBackend {
    /// A backend on `image` in `block_size`-byte blocks whose completions are signalled on
    /// `wake` (an eventfd: the reactor engine's, [`crate::Engine::event_fd`]); the descriptor
    /// is duplicated.
    pub fn new(image: Arc<Image>, block_size: u32, wake: RawFd) -> io::Result<RbdBackend> {
        // Safety: dup of a descriptor the caller has open gives a new one owned here.
        let fd = unsafe { libc::dup(wake) };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // Safety: fd is fresh and owned only here.
        let wake = unsafe { OwnedFd::from_raw_fd(fd) };
        Ok(RbdBackend {
            image,
            block_size,
            shared: Arc::new(Shared {
                done: Mutex::new(Vec::new()),
                wake,
            }),
            cells: Vec::new(),
            pending: Vec::new(),
            free: Vec::new(),
            outstanding: 0,
            spare: Vec::new(),
            completions: VecDeque::new(),
        })
    }

    /// The image.
    pub fn image(&self) -> &Arc<Image> {
        &self.image
    }

    /// Block size in bytes.
    pub fn block_size(&self) -> u32 {
        self.block_size
    }

    /// Capacity in blocks, as the image's size is now (0 when librbd cannot say).
    pub fn blocks(&self) -> u64 {
        self.image.size().unwrap_or(0) / u64::from(self.block_size)
    }

    /// Operations handed to librbd or the helper and not yet seen complete.
    pub fn outstanding(&self) -> usize {
        self.outstanding
    }

    fn slot(&mut self) -> u32 {
        if let Some(i) = self.free.pop() {
            return i;
        }
        let base = self.pending.len() as u32;
        let shared: *const Shared = &*self.shared;
        let chunk: Box<[SlotCell]> = (0..CHUNK as u32)
            .map(|i| SlotCell {
                shared,
                index: base + i,
                mismatch: UnsafeCell::new(0),
            })
            .collect();
        self.cells.push(chunk);
        self.pending.extend((0..CHUNK).map(|_| None));
        let total = self.pending.len();
        // Room for every slot's completion: pushes from librbd's threads never allocate.
        {
            let mut done = self
                .shared
                .done
                .lock()
                .unwrap_or_else(PoisonError::into_inner);
            let extra = total - done.len();
            done.reserve(extra);
        }
        self.spare.reserve(total);
        self.free.extend((base + 1..base + CHUNK as u32).rev());
        base
    }

    fn cell(&self, index: u32) -> &SlotCell {
        &self.cells[index as usize / CHUNK][index as usize % CHUNK]
    }

    /// Starts slot `index`'s operation through librbd's asynchronous API; the negative errno
    /// when librbd refused it at once (the caller queues it as the completion).
    fn start_aio(&mut self, index: u32) -> Result<(), i64> {
        let bs = u64::from(self.block_size);
        let cell: *const SlotCell = self.cell(index);
        let p = self.pending[index as usize].as_mut().expect("slot in use");
        let plan = p.op.write_same_plan(&p.buffer, bs as usize);
        let base = p.buffer.as_mut_ptr();
        let mut c: ffi::rbd_completion_t = std::ptr::null_mut();
        // Safety: the callback's argument is a SlotCell at a fixed address that outlives the
        // operation (RbdBackend's Drop waits for every outstanding completion before the
        // chunks go).
        let ret = unsafe {
            ffi::rbd_aio_create_completion(cell as *mut c_void, Some(on_complete), &mut c)
        };
        if ret < 0 {
            return Err(ret.into());
        }
        let img = self.image.image;
        // Safety (for every call below): the image is open (held by the Arc); the buffer
        // pointers point into `p.buffer`, which stays in the pending table, untouched, until
        // this completion is polled, and each length is within the buffer (the core sized it
        // with Op::buffer_len, checked in submit); the mismatch offset lives in the SlotCell.
        let ret: i64 = unsafe {
            match p.op {
                Op::Read {
                    lba,
                    blocks,
                    offset,
                    ..
                } => ffi::rbd_aio_read2(
                    img,
                    lba * bs,
                    (u64::from(blocks) * bs) as usize,
                    base.add(offset as usize).cast(),
                    c,
                    0,
                )
                .into(),
                Op::Write {
                    lba,
                    blocks,
                    offset,
                    fua,
                } => ffi::rbd_aio_write2(
                    img,
                    lba * bs,
                    (u64::from(blocks) * bs) as usize,
                    base.add(offset as usize).cast::<c_char>(),
                    c,
                    fua_flag(fua),
                )
                .into(),
                Op::Flush { .. } => ffi::rbd_aio_flush(img, c).into(),
                Op::Unmap { lba, blocks } => {
                    ffi::rbd_aio_discard(img, lba * bs, blocks * bs, c).into()
                }
                Op::WriteSame {
                    lba, blocks, fua, ..
                } => {
                    if plan == Some(WriteSamePlan::Deallocate) {
                        ffi::rbd_aio_discard(img, lba * bs, blocks * bs, c).into()
                    } else if plan == Some(WriteSamePlan::Zeroes) {
                        ffi::rbd_aio_write_zeroes(
                            img,
                            lba * bs,
                            (blocks * bs) as usize,
                            c,
                            0,
                            fua_flag(fua),
                        )
                        .into()
                    } else {
                        ffi::rbd_aio_writesame(
                            img,
                            lba * bs,
                            (blocks * bs) as usize,
                            base.cast::<c_char>(),
                            bs as usize,
                            c,
                            fua_flag(fua),
                        )
                        .into()
                    }
                }
                Op::CompareAndWrite { lba, blocks, fua } => {
                    let len = (u64::from(blocks) * bs) as usize;
                    (*cell).mismatch.get().write(0);
                    ffi::rbd_aio_compare_and_write(
                        img,
                        lba * bs,
                        len,
                        base.cast::<c_char>(),
                        base.add(len).cast::<c_char>(),
                        c,
                        (*cell).mismatch.get(),
                        fua_flag(fua),
                    ) as i64
                }
                _ => -i64::from(libc::EINVAL),
            }
        };
        if ret < 0 {
            // Safety: the completion was never handed to an operation: release it here.
            unsafe { ffi::rbd_aio_release(c) };
            return Err(ret);
        }
        Ok(())
    }

    /// Moves what librbd and the helper finished into the completion queue.
    fn collect(&mut self) {
        {
            let mut done = self
                .shared
                .done
                .lock()
                .unwrap_or_else(PoisonError::into_inner);
            std::mem::swap(&mut *done, &mut self.spare);
        }
        let bs = u64::from(self.block_size);
        let mut finished = std::mem::take(&mut self.spare);
        for (index, f) in finished.drain(..) {
            let Some(p) = self.pending[index as usize].take() else {
                continue;
            };
            self.outstanding -= 1;
            self.free.push(index);
            let stats = &self.image.stats;
            stats.in_flight.fetch_sub(1, Ordering::Relaxed);
            stats.completed.fetch_add(1, Ordering::Relaxed);
            stats
                .latency_ns
                .fetch_add(p.started.elapsed().as_nanos() as u64, Ordering::Relaxed);
            let result = match f {
                Finished::Sync(r) => r,
                Finished::Aio(ret) if ret >= 0 => Ok(Output::Done),
                Finished::Aio(ret) => {
                    let (lba, write) = op_lba(&p.op);
                    if ret == -i64::from(libc::EILSEQ) {
                        // Safety: the operation is complete; librbd no longer writes it.
                        let at = unsafe { *self.cell(index).mismatch.get() };
                        // Ceph 16.2 gives the offset in the compared bytes; an offset in the
                        // image (as later releases may) is taken as well.
                        let start = lba * bs;
                        let offset = if at >= start && start > 0 {
                            at - start
                        } else {
                            at
                        };
                        Err(BackendError::Miscompare { offset })
                    } else {
                        Err(map_errno(ret, lba, write, stats))
                    }
                }
            };
            self.completions.push_back((p.token, result, p.buffer));
        }
        self.spare = finished;
    }

    /// Blocks until something completes or `timeout` passes: for tests and drivers without a
    /// reactor. Returns false at once when nothing is outstanding.
    pub fn wait(&mut self, timeout: Duration) -> bool {
        if !self.completions.is_empty() {
            return true;
        }
        if self.outstanding == 0 {
            return false;
        }
        let deadline = Instant::now() + timeout;
        loop {
            self.collect();
            if !self.completions.is_empty() {
                return true;
            }
            if Instant::now() >= deadline {
                return false;
            }
            let mut pfd = libc::pollfd {
                fd: self.shared.wake.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            };
            // Safety: one live pollfd; a bounded timeout.
            unsafe { libc::poll(&mut pfd, 1, 10) };
            let mut n = 0u64;
            // Safety: reads 8 bytes into a live u64. The engine's eventfd is non-blocking
            // (EFD_NONBLOCK), and the dup here shares that flag, so this never blocks.
            unsafe { libc::read(pfd.fd, (&mut n as *mut u64).cast(), 8) };
        }
    }
}

/// The first block an operation names, and whether it writes.
fn op_lba(op: &Op) -> (u64, bool) {
    match *op {
        Op::Read { lba, .. } | Op::Compare { lba, .. } | Op::Prefetch { lba, .. } => (lba, false),
        Op::LbaStatus { lba } => (lba, false),
        Op::Write { lba, .. }
        | Op::Unmap { lba, .. }
        | Op::WriteSame { lba, .. }
        | Op::CompareAndWrite { lba, .. }
        | Op::OrWrite { lba, .. }
        | Op::Flush { lba, .. } => (lba, true),
        _ => (0, false),
    }
}

unsafe extern "C" fn on_complete(c: ffi::rbd_completion_t, arg: *mut c_void) {
    // Safety: `arg` is the SlotCell given at rbd_aio_create_completion; it and the Shared it
    // points to live until the backend has seen this completion (RbdBackend's Drop waits).
    let cell = unsafe { &*(arg as *const SlotCell) };
    // Safety: `c` is the completion being completed; librbd lets the callback read its
    // value and release it (its reference count keeps it alive while librbd finishes).
    let ret = unsafe {
        let ret = ffi::rbd_aio_get_return_value(c);
        ffi::rbd_aio_release(c);
        ret
    };
    // Safety: as above.
    let shared = unsafe { &*cell.shared };
    shared.push(cell.index, Finished::Aio(ret as i64));
}

impl Backend for RbdBackend {
    type Buffer = Buffer;

    fn submit(&mut self, token: u64, op: Op, buffer: Buffer) {
        let bs = self.block_size;
        if (buffer.len() as u64) < op.buffer_len(bs) {
            self.completions
                .push_back((token, Err(BackendError::Internal), buffer));
            return;
        }
        let read_only_violation =
            self.image.read_only && op_lba(&op).1 && !matches!(op, Op::Flush { .. });
        if read_only_violation {
            self.completions
                .push_back((token, Err(BackendError::WriteProtected), buffer));
            return;
        }
        if matches!(op, Op::Prefetch { .. }) {
            self.completions
                .push_back((token, Ok(Output::Done), buffer));
            return;
        }
        let object = self.image.object_size.max(1);
        let on_helper = match op {
            Op::Compare { .. } | Op::OrWrite { .. } | Op::LbaStatus { .. } => true,
            // librbd compares and writes one 512-byte sector of one object at a time
            // (ImageCompareAndWriteRequest refuses more with EINVAL).
            Op::CompareAndWrite { lba, blocks, .. } => {
                let start = lba * u64::from(bs);
                let len = u64::from(blocks) * u64::from(bs);
                start % NATIVE_COMPARE_AND_WRITE + len > NATIVE_COMPARE_AND_WRITE
                    || start / object != (start + len - 1) / object
            }
            _ => false,
        };
        let index = self.slot();
        self.pending[index as usize] = Some(Pending {
            token,
            op,
            buffer,
            started: Instant::now(),
        });
        self.outstanding += 1;
        self.image.stats.in_flight.fetch_add(1, Ordering::Relaxed);
        if on_helper {
            let p = self.pending[index as usize].as_mut().expect("just set");
            let job = Job {
                image: self.image.clone(),
                shared: self.shared.clone(),
                index,
                op,
                buf: p.buffer.as_mut_ptr(),
                len: p.buffer.len(),
                bs: u64::from(bs),
            };
            let sent = self.image.helper().is_some_and(|h| h.send(job).is_ok());
            if !sent {
                self.shared
                    .push(index, Finished::Sync(Err(BackendError::Internal)));
            }
            return;
        }
        if let Err(ret) = self.start_aio(index) {
            self.shared.push(index, Finished::Aio(ret));
        }
    }

    fn poll_completion(&mut self) -> Option<(u64, Result<Output, BackendError>, Buffer)> {
        if self.completions.is_empty() && self.outstanding > 0 {
            self.collect();
        }
        self.completions.pop_front()
    }
}

impl Drop for RbdBackend {
    fn drop(&mut self) {
        // librbd and the helper may still write into buffers and slot cells: wait for every
        // outstanding operation (each ends, at the latest, at the cluster's op timeout).
        let mut warned = false;
        let start = Instant::now();
        while self.outstanding > 0 {
            self.collect();
            if self.outstanding == 0 {
                break;
            }
            if !warned && start.elapsed() > Duration::from_secs(5) {
                tracing::warn!(
                    image = %self.image.spec,
                    outstanding = self.outstanding,
                    "closing an RBD backend waits for operations still in flight"
                );
                warned = true;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
    }
}
