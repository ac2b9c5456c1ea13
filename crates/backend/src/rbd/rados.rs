//! Small shared objects in RADOS: the state several gateways of one target keep together (a
//! logical unit's persistent reservations, who is alive), changed by versioned
//! compare-and-swap and published by watch/notify.
//!
//! - [`Pool::replace`] writes a whole object only if it is still at the version the writer read
//!   (or, for a first write, only if it does not exist yet): of two gateways racing, one wins
//!   and the other is told [`CasError::Conflict`], reads again and decides again.
//! - [`Pool::watch`] registers interest in an object; every [`Pool::notify`] on it reaches the
//!   callback (on a librados thread), which answers with [`Watch::ack`].
//! - [`Pool::notify`] returns once every watcher acknowledged or the timeout passed, with who
//!   acknowledged (and what they replied) and who did not: a change is applied everywhere
//!   before the initiator hears it is done, or the silent gateways are known by name.

use std::ffi::{c_void, CString};
use std::os::raw::{c_char, c_int};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use super::{cstring, errno_text, ffi, Cluster, IoCtx, RbdError};

/// A pool (and RADOS namespace) of small shared objects, on a cluster connection.
pub struct Pool {
    cluster: Arc<Cluster>,
    ioctx: ffi::rados_ioctx_t,
    /// Held across an operation and the read of its version: librados keeps one "last
    /// version" per I/O context.
    op: Mutex<()>,
    name: String,
}

// Safety: a librados I/O context may be used from any thread (librados' thread safety: ioctx
// operations are internally locked); the one piece of per-context state read after an
// operation (its last version) is read under `op`.
unsafe impl Send for Pool {}
// Safety: as for Send.
unsafe impl Sync for Pool {}

impl std::fmt::Debug for Pool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pool").field("name", &self.name).finish()
    }
}

/// An object's bytes and the version they are at.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Versioned {
    /// The whole object.
    pub data: Vec<u8>,
    /// Its version: pass it to [`Pool::replace`] to change exactly this state.
    pub version: u64,
}

/// Why a compare-and-swap did not write.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum CasError {
    /// Someone else changed (or created, or removed) the object first: read it again.
    #[error("the object changed since it was read")]
    Conflict,
    /// RADOS failed the operation (a negative errno).
    #[error("rados: {}", errno_text((*.0).into()))]
    Rados(i32),
}

/// A notification delivered to a watcher.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Notification {
    /// Which notify this is: name it in the ack.
    pub notify_id: u64,
    /// The watch it reached (its cookie).
    pub cookie: u64,
    /// The notifier's instance id (its `client.<id>`).
    pub notifier: u64,
    /// What the notifier sent.
    pub payload: Vec<u8>,
}

/// How a notify ended.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct NotifyOutcome {
    /// The watchers that acknowledged: (instance id, watch cookie, their reply).
    pub acked: Vec<(u64, u64, Vec<u8>)>,
    /// The watchers that did not within the timeout: (instance id, watch cookie).
    pub timed_out: Vec<(u64, u64)>,
}

impl NotifyOutcome {
    /// Decodes librados' notify reply (`rados_notify2`): le32 count, then per ack le64 gid,
    /// le64 cookie, le32 length and the reply; le32 count, then per timeout le64 gid and
    /// le64 cookie. None when it does not parse.
    pub fn decode(mut b: &[u8]) -> Option<NotifyOutcome> {
        fn take<'a>(b: &mut &'a [u8], n: usize) -> Option<&'a [u8]> {
            if b.len() < n {
                return None;
            }
            let (head, tail) = b.split_at(n);
            *b = tail;
            Some(head)
        }
        let u32_ = |b: &mut &[u8]| take(b, 4).map(|x| u32::from_le_bytes(x.try_into().expect("4")));
        let u64_ = |b: &mut &[u8]| take(b, 8).map(|x| u64::from_le_bytes(x.try_into().expect("8")));
        let mut out = NotifyOutcome::default();
        let acks = u32_(&mut b)?;
        for _ in 0..acks {
            let gid = u64_(&mut b)?;
            let cookie = u64_(&mut b)?;
            let len = u32_(&mut b)? as usize;
            out.acked.push((gid, cookie, take(&mut b, len)?.to_vec()));
        }
        let timeouts = u32_(&mut b)?;
        for _ in 0..timeouts {
            out.timed_out.push((u64_(&mut b)?, u64_(&mut b)?));
        }
        Some(out)
    }
}

type NotifyFn = Box<dyn Fn(Notification) + Send + Sync>;
type ErrorFn = Box<dyn Fn(i32) + Send + Sync>;

struct Callbacks {
    on_notify: NotifyFn,
    on_error: ErrorFn,
}

/// A registered watch; dropping it unregisters it (and waits for a callback under way).
pub struct Watch {
    pool: Arc<Pool>,
    oid: CString,
    cookie: u64,
    /// Boxed so its address, the callbacks' argument, stays put.
    callbacks: Option<Box<Callbacks>>,
}

impl std::fmt::Debug for Watch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Watch")
            .field("oid", &self.oid)
            .field("cookie", &self.cookie)
            .finish()
    }
}

unsafe extern "C" fn deliver_notify(
    arg: *mut c_void,
    notify_id: u64,
    handle: u64,
    notifier: u64,
    data: *mut c_void,
    len: usize,
) {
    // Safety: `arg` is the Callbacks box of a Watch, which lives until rados_unwatch2 and
    // rados_watch_flush have returned (Watch's Drop), so no callback outlives it.
    let cb = unsafe { &*(arg as *const Callbacks) };
    let payload = if data.is_null() || len == 0 {
        Vec::new()
    } else {
        // Safety: librados hands `len` readable bytes at `data` for the callback's duration.
        unsafe { std::slice::from_raw_parts(data as *const u8, len) }.to_vec()
    };
    (cb.on_notify)(Notification {
        notify_id,
        cookie: handle,
        notifier,
        payload,
    });
}

unsafe extern "C" fn on_watch_error(arg: *mut c_void, _cookie: u64, err: c_int) {
    // Safety: as in on_notify.
    let cb = unsafe { &*(arg as *const Callbacks) };
    (cb.on_error)(err);
}

impl Pool {
    /// The pool `pool` (in RADOS namespace `namespace`, empty for none) on `cluster`.
    pub fn open(cluster: Arc<Cluster>, pool: &str, namespace: &str) -> Result<Arc<Pool>, RbdError> {
        let ioctx = IoCtx::open(&cluster, pool, namespace)?.take();
        Ok(Arc::new(Pool {
            cluster,
            ioctx,
            op: Mutex::new(()),
            name: if namespace.is_empty() {
                pool.into()
            } else {
                format!("{pool}/{namespace}")
            },
        }))
    }

    /// The connection it is on.
    pub fn cluster(&self) -> &Arc<Cluster> {
        &self.cluster
    }

    /// The whole object `oid` and its version; None when it does not exist. An object larger
    /// than `max` bytes is an error (`-EFBIG`): these objects are small by design.
    pub fn read(&self, oid: &str, max: usize) -> Result<Option<Versioned>, i32> {
        let o = cstring(oid);
        let mut buf = vec![0u8; max + 1];
        let _op = self.op.lock().unwrap_or_else(PoisonError::into_inner);
        // Safety: live ioctx; librados writes at most buf.len() bytes into buf.
        let ret = unsafe {
            ffi::rados_read(
                self.ioctx,
                o.as_ptr(),
                buf.as_mut_ptr().cast::<c_char>(),
                buf.len(),
                0,
            )
        };
        if ret == -libc::ENOENT {
            return Ok(None);
        }
        if ret < 0 {
            return Err(ret);
        }
        // Safety: live ioctx; the version of the read just made (under `op`).
        let version = unsafe { ffi::rados_get_last_version(self.ioctx) };
        let n = ret as usize;
        if n > max {
            return Err(-libc::EFBIG);
        }
        buf.truncate(n);
        Ok(Some(Versioned { data: buf, version }))
    }

    /// Writes `data` as the whole object `oid` if it is still at version `expected` (None: if
    /// it does not exist yet). Returns the new version.
    pub fn replace(&self, oid: &str, expected: Option<u64>, data: &[u8]) -> Result<u64, CasError> {
        let o = cstring(oid);
        let _op = self.op.lock().unwrap_or_else(PoisonError::into_inner);
        // Safety: a new write op, released below on every path.
        let op = unsafe { ffi::rados_create_write_op() };
        if op.is_null() {
            return Err(CasError::Rados(-libc::ENOMEM));
        }
        // Safety: `op` is live; `data` outlives rados_write_op_operate, which sends it; the
        // op is released once.
        let ret = unsafe {
            match expected {
                Some(v) => ffi::rados_write_op_assert_version(op, v),
                None => {
                    ffi::rados_write_op_create(op, ffi::LIBRADOS_CREATE_EXCLUSIVE, std::ptr::null())
                }
            }
            ffi::rados_write_op_write_full(op, data.as_ptr().cast::<c_char>(), data.len());
            let ret =
                ffi::rados_write_op_operate(op, self.ioctx, o.as_ptr(), std::ptr::null_mut(), 0);
            ffi::rados_release_write_op(op);
            ret
        };
        match -ret {
            0 => {
                // Safety: live ioctx; the version of the write just made (under `op`).
                Ok(unsafe { ffi::rados_get_last_version(self.ioctx) })
            }
            // Another version (ERANGE: older, EOVERFLOW: newer), created meanwhile, or gone.
            libc::ERANGE | libc::EOVERFLOW | libc::EEXIST | libc::ENOENT => Err(CasError::Conflict),
            _ => Err(CasError::Rados(ret)),
        }
    }

    /// Removes the object (nothing to do when it does not exist).
    pub fn remove(&self, oid: &str) -> Result<(), i32> {
        let o = cstring(oid);
        let _op = self.op.lock().unwrap_or_else(PoisonError::into_inner);
        // Safety: live ioctx; `o` outlives the call.
        let ret = unsafe { ffi::rados_remove(self.ioctx, o.as_ptr()) };
        if ret < 0 && ret != -libc::ENOENT {
            return Err(ret);
        }
        Ok(())
    }

    /// Watches `oid` (which must exist): `on_notify` gets every notification (answer each with
    /// [`Watch::ack`]), `on_error` the errno when the watch is lost (`-ENOTCONN` when the
    /// OSD lost this client for `timeout`, `-EBLOCKLISTED`/`-ESHUTDOWN` when it was fenced).
    /// Both run on librados threads and must not block on this pool.
    pub fn watch(
        self: &Arc<Self>,
        oid: &str,
        timeout: Duration,
        on_notify: impl Fn(Notification) + Send + Sync + 'static,
        on_error: impl Fn(i32) + Send + Sync + 'static,
    ) -> Result<Watch, i32> {
        let o = cstring(oid);
        let callbacks = Box::new(Callbacks {
            on_notify: Box::new(on_notify),
            on_error: Box::new(on_error),
        });
        let arg = &*callbacks as *const Callbacks as *mut c_void;
        let mut cookie = 0u64;
        // Safety: live ioctx; `arg` points to the boxed callbacks, which the Watch keeps at
        // their address until the watch is removed and flushed.
        let ret = unsafe {
            ffi::rados_watch3(
                self.ioctx,
                o.as_ptr(),
                &mut cookie,
                Some(deliver_notify),
                Some(on_watch_error),
                timeout.as_secs().clamp(1, u64::from(u32::MAX)) as u32,
                arg,
            )
        };
        if ret < 0 {
            return Err(ret);
        }
        Ok(Watch {
            pool: self.clone(),
            oid: o,
            cookie,
            callbacks: Some(callbacks),
        })
    }

    /// Acknowledges notification `n` of a watch on `oid` with `reply` (from the watch's
    /// callback too: it may hold an `Arc<Pool>` where it cannot hold its own [`Watch`]).
    pub fn ack(&self, oid: &str, n: &Notification, reply: &[u8]) -> Result<(), i32> {
        self.ack_raw(&cstring(oid), n, reply)
    }

    fn ack_raw(&self, oid: &CString, n: &Notification, reply: &[u8]) -> Result<(), i32> {
        let len = c_int::try_from(reply.len()).map_err(|_| -libc::EINVAL)?;
        // Safety: live ioctx; `oid` and `reply` outlive the call.
        let ret = unsafe {
            ffi::rados_notify_ack(
                self.ioctx,
                oid.as_ptr(),
                n.notify_id,
                n.cookie,
                reply.as_ptr().cast::<c_char>(),
                len,
            )
        };
        if ret < 0 {
            return Err(ret);
        }
        Ok(())
    }

    /// Sends `payload` to every watcher of `oid` and waits until each acknowledged or
    /// `timeout` passed. A timeout is not an error here: the outcome names who did not answer.
    pub fn notify(
        &self,
        oid: &str,
        payload: &[u8],
        timeout: Duration,
    ) -> Result<NotifyOutcome, i32> {
        let o = cstring(oid);
        let mut reply: *mut c_char = std::ptr::null_mut();
        let mut reply_len = 0usize;
        let len = c_int::try_from(payload.len()).map_err(|_| -libc::EINVAL)?;
        // Safety: live ioctx; `payload` outlives the call; librados allocates the reply, freed
        // below with rados_buffer_free.
        let ret = unsafe {
            ffi::rados_notify2(
                self.ioctx,
                o.as_ptr(),
                payload.as_ptr().cast::<c_char>(),
                len,
                timeout.as_millis().max(1) as u64,
                &mut reply,
                &mut reply_len,
            )
        };
        let outcome = if reply.is_null() {
            None
        } else {
            // Safety: librados gave `reply_len` bytes at `reply`; copied out before the free.
            let bytes = unsafe { std::slice::from_raw_parts(reply as *const u8, reply_len) };
            let outcome = NotifyOutcome::decode(bytes);
            // Safety: the buffer librados allocated for this reply, freed once.
            unsafe { ffi::rados_buffer_free(reply) };
            outcome
        };
        match (ret, outcome) {
            (0, Some(o)) => Ok(o),
            (r, Some(o)) if r == -libc::ETIMEDOUT => Ok(o),
            (0, None) => Ok(NotifyOutcome::default()),
            (r, _) if r < 0 => Err(r),
            _ => Err(-libc::EIO),
        }
    }
}

impl Drop for Pool {
    fn drop(&mut self) {
        // Safety: every Watch holds an Arc<Pool>, so none is left; callbacks already returned
        // (each Watch flushed when it dropped); the ioctx is destroyed once.
        unsafe { ffi::rados_ioctx_destroy(self.ioctx) }
    }
}

impl Watch {
    /// The watch's cookie (how notifiers' outcomes name it, with the instance id).
    pub fn cookie(&self) -> u64 {
        self.cookie
    }

    /// Acknowledges notification `n` with `reply`: the notifier counts this watcher as done.
    pub fn ack(&self, n: &Notification, reply: &[u8]) -> Result<(), i32> {
        self.pool.ack_raw(&self.oid, n, reply)
    }

    /// Whether the watch still holds: how long since the OSD last confirmed it, or the errno
    /// it was lost with.
    pub fn check(&self) -> Result<Duration, i32> {
        // Safety: live ioctx and a cookie rados_watch3 gave.
        let ret = unsafe { ffi::rados_watch_check(self.pool.ioctx, self.cookie) };
        if ret < 0 {
            return Err(ret);
        }
        Ok(Duration::from_millis(ret as u64))
    }
}

impl Drop for Watch {
    fn drop(&mut self) {
        // Safety: the cookie of a registered watch, removed once; the flush waits for every
        // callback under way, so the callbacks may be freed after it.
        unsafe {
            ffi::rados_unwatch2(self.pool.ioctx, self.cookie);
            ffi::rados_watch_flush(self.pool.cluster.rados);
        }
        self.callbacks.take();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn notify_replies_decode_and_bad_ones_do_not() {
        let mut b = Vec::new();
        b.extend(2u32.to_le_bytes());
        for (gid, cookie, reply) in [(4100u64, 7u64, &b"ok"[..]), (4200, 9, &b""[..])] {
            b.extend(gid.to_le_bytes());
            b.extend(cookie.to_le_bytes());
            b.extend((reply.len() as u32).to_le_bytes());
            b.extend(reply);
        }
        b.extend(1u32.to_le_bytes());
        b.extend(4300u64.to_le_bytes());
        b.extend(11u64.to_le_bytes());
        let o = NotifyOutcome::decode(&b).unwrap();
        assert_eq!(
            o.acked,
            vec![(4100, 7, b"ok".to_vec()), (4200, 9, Vec::new())]
        );
        assert_eq!(o.timed_out, vec![(4300, 11)]);
        for cut in 0..b.len() {
            assert!(NotifyOutcome::decode(&b[..cut]).is_none(), "cut at {cut}");
        }
        // A length beyond the buffer is refused, not trusted.
        let mut bad = 1u32.to_le_bytes().to_vec();
        bad.extend([0u8; 16]);
        bad.extend(u32::MAX.to_le_bytes());
        assert!(NotifyOutcome::decode(&bad).is_none());
    }
}
