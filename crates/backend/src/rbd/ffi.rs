//! The part of librados' and librbd's C API (Ceph 16.2, `librados.h` and `librbd.h` of Debian's
//! librados-dev and librbd-dev) that the RBD backend calls, declared by hand from those headers:
//! thirty-odd functions need no bindgen (and no libclang) at build time. Every signature below
//! was checked against the header it names; the handle types are the headers' `void *`.

#![allow(non_camel_case_types)]

use std::os::raw::{c_char, c_int, c_void};

/// `rados_t`: a cluster handle.
pub type rados_t = *mut c_void;
/// `rados_ioctx_t`: a pool (and namespace) I/O context.
pub type rados_ioctx_t = *mut c_void;
/// `rbd_image_t`: an open image.
pub type rbd_image_t = *mut c_void;
/// `rbd_completion_t`: an asynchronous operation's completion.
pub type rbd_completion_t = *mut c_void;
/// `rbd_callback_t`: called on a librbd thread when an operation completes.
pub type rbd_callback_t = Option<unsafe extern "C" fn(cb: rbd_completion_t, arg: *mut c_void)>;
/// `rbd_update_callback_t`: called on a librbd thread when the image's header changes.
pub type rbd_update_callback_t = Option<unsafe extern "C" fn(arg: *mut c_void)>;
/// The `rbd_diff_iterate2` callback: (offset, length, exists, arg).
pub type rbd_diff_callback_t =
    Option<unsafe extern "C" fn(off: u64, len: usize, exists: c_int, arg: *mut c_void) -> c_int>;

/// `librbd_progress_fn_t`: (offset, total, arg); librbd calls it without checking for NULL.
pub type librbd_progress_fn_t =
    Option<unsafe extern "C" fn(offset: u64, total: u64, arg: *mut c_void) -> c_int>;

/// `RBD_MAX_BLOCK_NAME_SIZE` and `RBD_MAX_IMAGE_NAME_SIZE` of librbd.h.
pub const RBD_MAX_BLOCK_NAME_SIZE: usize = 24;
/// See [`RBD_MAX_BLOCK_NAME_SIZE`].
pub const RBD_MAX_IMAGE_NAME_SIZE: usize = 96;

/// `rbd_image_info_t`.
#[repr(C)]
pub struct rbd_image_info_t {
    pub size: u64,
    pub obj_size: u64,
    pub num_objs: u64,
    pub order: c_int,
    pub block_name_prefix: [c_char; RBD_MAX_BLOCK_NAME_SIZE],
    pub parent_pool: i64,
    pub parent_name: [c_char; RBD_MAX_IMAGE_NAME_SIZE],
}

/// `LIBRADOS_OP_FLAG_FADVISE_FUA`: librbd writes this I/O through its cache.
pub const LIBRADOS_OP_FLAG_FADVISE_FUA: c_int = 0x80;

/// Feature bits of `rbd/features.h`.
pub const RBD_FEATURE_EXCLUSIVE_LOCK: u64 = 1 << 2;
/// See [`RBD_FEATURE_EXCLUSIVE_LOCK`].
pub const RBD_FEATURE_OBJECT_MAP: u64 = 1 << 3;
/// See [`RBD_FEATURE_EXCLUSIVE_LOCK`].
pub const RBD_FEATURE_FAST_DIFF: u64 = 1 << 4;

#[link(name = "rados")]
unsafe extern "C" {
    pub fn rados_create(cluster: *mut rados_t, id: *const c_char) -> c_int;
    pub fn rados_conf_read_file(cluster: rados_t, path: *const c_char) -> c_int;
    pub fn rados_conf_set(cluster: rados_t, option: *const c_char, value: *const c_char) -> c_int;
    pub fn rados_connect(cluster: rados_t) -> c_int;
    pub fn rados_shutdown(cluster: rados_t);
    pub fn rados_get_instance_id(cluster: rados_t) -> u64;
    pub fn rados_getaddrs(cluster: rados_t, addrs: *mut *mut c_char) -> c_int;
    pub fn rados_blocklist_add(
        cluster: rados_t,
        client_address: *mut c_char,
        expire_seconds: u32,
    ) -> c_int;
    pub fn rados_ioctx_create(
        cluster: rados_t,
        pool_name: *const c_char,
        ioctx: *mut rados_ioctx_t,
    ) -> c_int;
    pub fn rados_ioctx_destroy(io: rados_ioctx_t);
    pub fn rados_ioctx_set_namespace(io: rados_ioctx_t, nspace: *const c_char);
}

/// `rados_write_op_t`.
pub type rados_write_op_t = *mut c_void;
/// `rados_watchcb2_t`: (arg, notify_id, handle, notifier_id, data, data_len).
pub type rados_watchcb2_t = Option<
    unsafe extern "C" fn(
        arg: *mut c_void,
        notify_id: u64,
        handle: u64,
        notifier_id: u64,
        data: *mut c_void,
        data_len: usize,
    ),
>;
/// `rados_watcherrcb_t`: (arg, cookie, err).
pub type rados_watcherrcb_t =
    Option<unsafe extern "C" fn(pre: *mut c_void, cookie: u64, err: c_int)>;
/// `LIBRADOS_CREATE_EXCLUSIVE`.
pub const LIBRADOS_CREATE_EXCLUSIVE: c_int = 1;

#[link(name = "rados")]
unsafe extern "C" {
    pub fn rados_get_last_version(io: rados_ioctx_t) -> u64;
    pub fn rados_read(
        io: rados_ioctx_t,
        oid: *const c_char,
        buf: *mut c_char,
        len: usize,
        off: u64,
    ) -> c_int;
    pub fn rados_remove(io: rados_ioctx_t, oid: *const c_char) -> c_int;
    pub fn rados_create_write_op() -> rados_write_op_t;
    pub fn rados_release_write_op(write_op: rados_write_op_t);
    pub fn rados_write_op_assert_version(write_op: rados_write_op_t, ver: u64);
    pub fn rados_write_op_create(
        write_op: rados_write_op_t,
        exclusive: c_int,
        category: *const c_char,
    );
    pub fn rados_write_op_write_full(write_op: rados_write_op_t, buffer: *const c_char, len: usize);
    pub fn rados_write_op_operate(
        write_op: rados_write_op_t,
        io: rados_ioctx_t,
        oid: *const c_char,
        mtime: *mut libc::time_t,
        flags: c_int,
    ) -> c_int;
    pub fn rados_watch3(
        io: rados_ioctx_t,
        o: *const c_char,
        cookie: *mut u64,
        watchcb: rados_watchcb2_t,
        watcherrcb: rados_watcherrcb_t,
        timeout: u32,
        arg: *mut c_void,
    ) -> c_int;
    pub fn rados_watch_check(io: rados_ioctx_t, cookie: u64) -> c_int;
    pub fn rados_unwatch2(io: rados_ioctx_t, cookie: u64) -> c_int;
    pub fn rados_watch_flush(cluster: rados_t) -> c_int;
    pub fn rados_notify2(
        io: rados_ioctx_t,
        o: *const c_char,
        buf: *const c_char,
        buf_len: c_int,
        timeout_ms: u64,
        reply_buffer: *mut *mut c_char,
        reply_buffer_len: *mut usize,
    ) -> c_int;
    pub fn rados_notify_ack(
        io: rados_ioctx_t,
        o: *const c_char,
        notify_id: u64,
        cookie: u64,
        buf: *const c_char,
        buf_len: c_int,
    ) -> c_int;
    pub fn rados_buffer_free(buf: *mut c_char);
}

#[link(name = "rbd")]
unsafe extern "C" {
    pub fn rbd_lock_get_owners(
        image: rbd_image_t,
        lock_mode: *mut c_int,
        lock_owners: *mut *mut c_char,
        max_lock_owners: *mut usize,
    ) -> c_int;
    pub fn rbd_lock_get_owners_cleanup(lock_owners: *mut *mut c_char, lock_owner_count: usize);
    pub fn rbd_lock_break(image: rbd_image_t, lock_mode: c_int, lock_owner: *const c_char)
        -> c_int;
    pub fn rbd_version(major: *mut c_int, minor: *mut c_int, extra: *mut c_int);
    pub fn rbd_create(
        io: rados_ioctx_t,
        name: *const c_char,
        size: u64,
        order: *mut c_int,
    ) -> c_int;
    pub fn rbd_open(
        io: rados_ioctx_t,
        name: *const c_char,
        image: *mut rbd_image_t,
        snap_name: *const c_char,
    ) -> c_int;
    pub fn rbd_open_read_only(
        io: rados_ioctx_t,
        name: *const c_char,
        image: *mut rbd_image_t,
        snap_name: *const c_char,
    ) -> c_int;
    pub fn rbd_close(image: rbd_image_t) -> c_int;
    pub fn rbd_resize2(
        image: rbd_image_t,
        size: u64,
        allow_shrink: bool,
        cb: librbd_progress_fn_t,
        cbdata: *mut c_void,
    ) -> c_int;
    pub fn rbd_stat(image: rbd_image_t, info: *mut rbd_image_info_t, infosize: usize) -> c_int;
    pub fn rbd_get_size(image: rbd_image_t, size: *mut u64) -> c_int;
    pub fn rbd_get_features(image: rbd_image_t, features: *mut u64) -> c_int;
    pub fn rbd_update_watch(
        image: rbd_image_t,
        handle: *mut u64,
        watch_cb: rbd_update_callback_t,
        arg: *mut c_void,
    ) -> c_int;
    pub fn rbd_update_unwatch(image: rbd_image_t, handle: u64) -> c_int;
    pub fn rbd_diff_iterate2(
        image: rbd_image_t,
        fromsnapname: *const c_char,
        ofs: u64,
        len: u64,
        include_parent: u8,
        whole_object: u8,
        cb: rbd_diff_callback_t,
        arg: *mut c_void,
    ) -> c_int;
    pub fn rbd_read2(
        image: rbd_image_t,
        ofs: u64,
        len: usize,
        buf: *mut c_char,
        op_flags: c_int,
    ) -> isize;
    pub fn rbd_write2(
        image: rbd_image_t,
        ofs: u64,
        len: usize,
        buf: *const c_char,
        op_flags: c_int,
    ) -> isize;

    pub fn rbd_aio_create_completion(
        cb_arg: *mut c_void,
        complete_cb: rbd_callback_t,
        c: *mut rbd_completion_t,
    ) -> c_int;
    pub fn rbd_aio_get_return_value(c: rbd_completion_t) -> isize;
    pub fn rbd_aio_release(c: rbd_completion_t);
    pub fn rbd_aio_read2(
        image: rbd_image_t,
        off: u64,
        len: usize,
        buf: *mut c_char,
        c: rbd_completion_t,
        op_flags: c_int,
    ) -> c_int;
    pub fn rbd_aio_write2(
        image: rbd_image_t,
        off: u64,
        len: usize,
        buf: *const c_char,
        c: rbd_completion_t,
        op_flags: c_int,
    ) -> c_int;
    pub fn rbd_aio_discard(image: rbd_image_t, off: u64, len: u64, c: rbd_completion_t) -> c_int;
    pub fn rbd_aio_writesame(
        image: rbd_image_t,
        off: u64,
        len: usize,
        buf: *const c_char,
        data_len: usize,
        c: rbd_completion_t,
        op_flags: c_int,
    ) -> c_int;
    pub fn rbd_aio_write_zeroes(
        image: rbd_image_t,
        off: u64,
        len: usize,
        c: rbd_completion_t,
        zero_flags: c_int,
        op_flags: c_int,
    ) -> c_int;
    pub fn rbd_aio_compare_and_write(
        image: rbd_image_t,
        off: u64,
        len: usize,
        cmp_buf: *const c_char,
        buf: *const c_char,
        c: rbd_completion_t,
        mismatch_off: *mut u64,
        op_flags: c_int,
    ) -> isize;
    pub fn rbd_aio_flush(image: rbd_image_t, c: rbd_completion_t) -> c_int;
    pub fn rbd_flush(image: rbd_image_t) -> c_int;
}
