//! The `file` backend's storage: a regular file or a block device, opened per its
//! configuration, and the blocking implementation of every [`Op`] on it. The thread-pool engine
//! runs everything here; the io_uring engine runs reads, writes, flushes and deallocation on
//! the ring and the rare composite operations (compare, write same, or-write, LBA status)
//! here, on its helper threads.

use std::fs::{File, OpenOptions};
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::{FileExt, FileTypeExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use scsi_core::backend::{write_same_by_writes, BlockStore};
use scsi_core::{BackendError, Op, Output};

/// Alignment O_DIRECT I/O must keep (buffer address, file offset, length); anything else goes
/// through the buffered descriptor.
pub const DIRECT_ALIGN: usize = 4096;

/// How to open a file backend.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FileConfig {
    /// A regular file or a block device.
    pub path: PathBuf,
    /// Capacity in bytes; required when the file does not exist yet. A smaller existing file is
    /// grown (sparse); a larger one is refused (shrinking is an explicit resize).
    pub size: Option<u64>,
    /// 512 or 4096.
    pub block_size: u32,
    /// O_DIRECT: bypass the page cache (misaligned requests use a buffered descriptor).
    pub direct: bool,
    /// Write-through (O_DSYNC): every write is durable when it completes.
    pub write_through: bool,
    /// Open read-only.
    pub read_only: bool,
}

impl FileConfig {
    /// A thin, write-back, buffered file of `size` bytes in 512-byte blocks.
    pub fn new(path: impl Into<PathBuf>, size: Option<u64>) -> FileConfig {
        FileConfig {
            path: path.into(),
            size,
            block_size: 512,
            direct: false,
            write_through: false,
            read_only: false,
        }
    }
}

/// Why a file backend could not be opened; each names the path and the reason.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum OpenError {
    /// The block size is not 512 or 4096.
    #[error("block_size {0}: must be 512 or 4096")]
    BlockSize(u32),
    /// No size for a file that has to be created.
    #[error("{0}: does not exist and no size is given to create it")]
    NoSize(PathBuf),
    /// The size is zero or not a multiple of the block size.
    #[error("size {size}: must be a non-zero multiple of the block size {block_size}")]
    Size {
        /// Bytes configured.
        size: u64,
        /// Block size.
        block_size: u32,
    },
    /// The configured size is larger than a block device, or smaller than an existing file.
    #[error(
        "{path}: size {size} does not fit: the {what} is {actual} bytes (leave the size out \
         to serve it at its own size; a file is never cut to a smaller size when opened)"
    )]
    SizeMismatch {
        /// The path.
        path: PathBuf,
        /// Bytes configured.
        size: u64,
        /// "device" or "file".
        what: &'static str,
        /// Its size.
        actual: u64,
    },
    /// Neither a regular file nor a block device.
    #[error("{0}: not a regular file or block device")]
    Kind(PathBuf),
    /// The directory the file would be created in does not exist: directories are the
    /// administrator's to make (a typo in a path must not become a tree of directories made as
    /// root).
    #[error("{0}: no such directory to create the file in (create it first)")]
    NoDirectory(PathBuf),
    /// The OS refused.
    #[error("{path}: {source}")]
    Io {
        /// The path.
        path: PathBuf,
        /// What the OS said.
        source: io::Error,
    },
}

impl OpenError {
    /// The configuration key the error is about.
    pub fn key(&self) -> &'static str {
        match self {
            OpenError::BlockSize(_) => "block_size",
            OpenError::NoSize(_) | OpenError::Size { .. } | OpenError::SizeMismatch { .. } => {
                "size"
            }
            _ => "path",
        }
    }
}

/// An open file backend: its descriptors and geometry. Shared by the reactor and the helper
/// threads.
#[derive(Debug)]
pub struct FileHandle {
    file: File,
    /// A buffered descriptor beside an O_DIRECT one, for misaligned requests.
    buffered: Option<File>,
    path: PathBuf,
    block_size: u32,
    blocks: u64,
    block_device: bool,
    write_through: bool,
    /// The primary descriptor is O_DIRECT.
    direct: bool,
}

impl FileHandle {
    /// Opens (creating sparse when missing) the file `config` names.
    pub fn open(config: &FileConfig) -> Result<FileHandle, OpenError> {
        let bs = config.block_size;
        let path = &config.path;
        let io_err = |source| OpenError::Io {
            path: path.clone(),
            source,
        };
        let exists = preflight(config)?;
        let open = |direct: bool| {
            let mut o = OpenOptions::new();
            o.read(true).write(!config.read_only);
            if !config.read_only && !exists {
                o.create(true);
            }
            let mut flags = libc::O_CLOEXEC;
            if direct {
                flags |= libc::O_DIRECT;
            }
            if config.write_through {
                flags |= libc::O_DSYNC;
            }
            o.custom_flags(flags).open(path)
        };
        let file = open(config.direct).map_err(io_err)?;
        let meta = file.metadata().map_err(io_err)?;
        let kind = meta.file_type();
        let (blocks, block_device) = if kind.is_block_device() {
            let actual = device_size(&file).map_err(io_err)?;
            let size = config.size.unwrap_or(actual - actual % u64::from(bs));
            if size > actual || size == 0 {
                return Err(OpenError::SizeMismatch {
                    path: path.clone(),
                    size,
                    what: "device",
                    actual,
                });
            }
            (size / u64::from(bs), true)
        } else if kind.is_file() {
            let actual = meta.len();
            let size = file_size(config, actual)?;
            if size > actual {
                if exists {
                    tracing::info!(path = %path.display(), from = actual, to = size, "growing backing file");
                }
                file.set_len(size).map_err(io_err)?;
            }
            (size / u64::from(bs), false)
        } else {
            return Err(OpenError::Kind(path.clone()));
        };
        let buffered = if config.direct {
            Some(open(false).map_err(io_err)?)
        } else {
            None
        };
        Ok(FileHandle {
            file,
            buffered,
            path: path.clone(),
            block_size: bs,
            blocks,
            block_device,
            write_through: config.write_through,
            direct: config.direct,
        })
    }

    /// What [`open`](Self::open) would refuse, found without opening the file (so a check of
    /// a config neither creates, grows nor locks anything): the block size and size, a missing
    /// file without a size or without its directory, something neither a file nor a block
    /// device, a file larger than its configured size, and whether this process may read the
    /// file and, unless it is read-only, write it (or create it in its directory). A block
    /// device's size is known only once it is open, so it is not compared here.
    pub fn check(config: &FileConfig) -> Result<(), OpenError> {
        let path = &config.path;
        let io_err = |source| OpenError::Io {
            path: path.clone(),
            source,
        };
        if !preflight(config)? {
            let dir = match path.parent().filter(|d| !d.as_os_str().is_empty()) {
                Some(dir) => dir,
                None => Path::new("."),
            };
            return may_create_in(dir).map_err(|source| OpenError::Io {
                path: dir.to_path_buf(),
                source,
            });
        }
        let meta = std::fs::metadata(path).map_err(io_err)?;
        let kind = meta.file_type();
        if kind.is_file() {
            file_size(config, meta.len())?;
        } else if !kind.is_block_device() {
            return Err(OpenError::Kind(path.clone()));
        }
        let mode = if config.read_only {
            libc::R_OK
        } else {
            libc::R_OK | libc::W_OK
        };
        may_access(path, mode).map_err(io_err)
    }

    /// Wraps an already open descriptor of `blocks` blocks, e.g. a character device such as
    /// /dev/full in tests, or a file the embedder opened itself.
    pub fn from_file(file: File, block_size: u32, blocks: u64) -> FileHandle {
        // Safety: F_GETFL reads the open file's status flags and takes no argument.
        let flags = unsafe { libc::fcntl(file.as_raw_fd(), libc::F_GETFL) };
        FileHandle {
            direct: flags >= 0 && flags & libc::O_DIRECT != 0,
            file,
            buffered: None,
            path: PathBuf::new(),
            block_size,
            blocks,
            block_device: false,
            write_through: false,
        }
    }

    /// The path opened.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Block size in bytes.
    pub fn block_size(&self) -> u32 {
        self.block_size
    }

    /// Capacity in blocks.
    pub fn blocks(&self) -> u64 {
        self.blocks
    }

    /// A block device rather than a file.
    pub fn is_block_device(&self) -> bool {
        self.block_device
    }

    /// Opened O_DSYNC.
    pub fn write_through(&self) -> bool {
        self.write_through
    }

    /// Grows or shrinks a regular file's capacity (blocks beyond the old end read as zeros).
    pub fn resize(&mut self, blocks: u64) -> io::Result<()> {
        if self.block_device {
            return Err(io::Error::from_raw_os_error(libc::EINVAL));
        }
        self.file.set_len(blocks * u64::from(self.block_size))?;
        self.blocks = blocks;
        Ok(())
    }

    /// Whether I/O on the descriptor [`fd_for`](Self::fd_for) chose (`primary` or not) goes
    /// through the page cache.
    pub fn buffered(&self, primary: bool) -> bool {
        !primary || !self.direct
    }

    /// The descriptor to use for `len` bytes at file offset `at` from memory `ptr`: the
    /// O_DIRECT one when everything is aligned, the buffered one otherwise.
    pub fn fd_for(&self, ptr: *const u8, at: u64, len: usize) -> (i32, bool) {
        match &self.buffered {
            Some(b)
                if (ptr as usize) % DIRECT_ALIGN != 0
                    || at % DIRECT_ALIGN as u64 != 0
                    || len % DIRECT_ALIGN != 0 =>
            {
                (b.as_raw_fd(), false)
            }
            _ => (self.file.as_raw_fd(), true),
        }
    }

    fn file_for(&self, buf: &[u8], at: u64) -> &File {
        match (&self.buffered, self.fd_for(buf.as_ptr(), at, buf.len()).1) {
            (Some(b), false) => b,
            _ => &self.file,
        }
    }

    /// The primary descriptor, for registering with a ring.
    pub fn raw_fd(&self) -> i32 {
        self.file.as_raw_fd()
    }

    fn read_into(&self, buf: &mut [u8], at: u64) -> Result<(), BackendError> {
        let bs = u64::from(self.block_size);
        let mut done = 0;
        while done < buf.len() {
            let pos = at + done as u64;
            let f = self.file_for(&buf[done..], pos);
            match f.read_at(&mut buf[done..], pos) {
                Ok(0) => return Err(BackendError::Read { lba: pos / bs }),
                Ok(n) => done += n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(error_for(e, false, pos / bs)),
            }
        }
        Ok(())
    }

    fn write_from(&self, buf: &[u8], at: u64, fua: bool) -> Result<(), BackendError> {
        let bs = u64::from(self.block_size);
        let mut done = 0;
        while done < buf.len() {
            let pos = at + done as u64;
            let f = self.file_for(&buf[done..], pos);
            let r = if fua && !self.write_through {
                pwrite_dsync(f, &buf[done..], pos)
            } else {
                f.write_at(&buf[done..], pos)
            };
            match r {
                Ok(0) => return Err(BackendError::Write { lba: pos / bs }),
                Ok(n) => done += n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(error_for(e, true, pos / bs)),
            }
        }
        Ok(())
    }

    /// Deallocates `len` bytes at `at` (the range reads back as zeros).
    pub fn punch_hole(&self, at: u64, len: u64) -> Result<(), BackendError> {
        let mode = libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE;
        fallocate(&self.file, mode, at, len).map_err(|e| error_for(e, true, at))
    }

    /// Runs `op` on `buf` now, blocking ([`scsi_core::backend::execute`] over this file).
    pub fn execute(&self, op: &Op, buf: &mut [u8]) -> Result<Output, BackendError> {
        scsi_core::backend::execute(&mut &*self, op, buf)
    }

    /// fdatasync; a no-op cost when opened write-through.
    pub fn flush(&self) -> Result<(), BackendError> {
        self.file.sync_data().map_err(|e| error_for(e, true, 0))
    }

    /// Mapped or deallocated from `lba`, and for how many blocks, from SEEK_DATA/SEEK_HOLE.
    fn lba_status(&self, lba: u64) -> Result<Output, BackendError> {
        if lba >= self.blocks {
            return Err(BackendError::Internal);
        }
        let bs = u64::from(self.block_size);
        let end = self.blocks * bs;
        let at = lba * bs;
        let fd = self.file.as_raw_fd();
        let (mapped, until) = match seek(fd, at, libc::SEEK_DATA) {
            Ok(d) if d <= at => (true, seek(fd, at, libc::SEEK_HOLE).unwrap_or(end)),
            Ok(d) => (false, d),
            Err(libc::ENXIO) => (false, end),
            // No hole support (a block device): everything is mapped.
            Err(_) => (true, end),
        };
        let until = until.min(end);
        // A block partly mapped counts as mapped; so round the extent's end to blocks.
        let blocks = if mapped {
            until.div_ceil(bs) - lba
        } else {
            (until / bs).saturating_sub(lba)
        };
        Ok(Output::LbaStatus {
            mapped: mapped || blocks == 0,
            blocks: blocks.max(1),
        })
    }
}

/// A file read and written with syscalls, for the operations io_uring does not carry and for
/// the thread-pool engine. For `&FileHandle`: the handle is shared by the threads that run
/// operations on it.
impl BlockStore for &FileHandle {
    fn block_size(&self) -> u32 {
        FileHandle::block_size(self)
    }

    fn blocks(&self) -> u64 {
        FileHandle::blocks(self)
    }

    fn read(&mut self, at: u64, out: &mut [u8]) -> Result<(), BackendError> {
        self.read_into(out, at)
    }

    fn write(&mut self, at: u64, data: &[u8], fua: bool) -> Result<(), BackendError> {
        self.write_from(data, at, fua)
    }

    fn deallocate(&mut self, at: u64, len: u64) -> Result<(), BackendError> {
        self.punch_hole(at, len)
    }

    fn flush(&mut self) -> Result<(), BackendError> {
        FileHandle::flush(self)
    }

    fn lba_status(&mut self, lba: u64) -> Result<Output, BackendError> {
        FileHandle::lba_status(self, lba)
    }

    fn prefetch(&mut self, at: u64, len: u64) {
        // Safety: posix_fadvise only reads its integer arguments; the fd is open.
        unsafe {
            libc::posix_fadvise(
                self.file.as_raw_fd(),
                at as i64,
                len as i64,
                libc::POSIX_FADV_WILLNEED,
            );
        }
    }

    /// Zeros without FUA are a fallocate that keeps them allocated (anchored), without
    /// moving them through memory, when the file system can; else the block is written over
    /// the range.
    fn write_same(
        &mut self,
        at: u64,
        len: usize,
        block: Option<&[u8]>,
        fua: bool,
    ) -> Result<(), BackendError> {
        if block.is_none() && !fua {
            let mode = libc::FALLOC_FL_ZERO_RANGE | libc::FALLOC_FL_KEEP_SIZE;
            if fallocate(&self.file, mode, at, len as u64).is_ok() {
                return Ok(());
            }
        }
        write_same_by_writes(self, at, len, block, fua)
    }
}

/// The checks [`FileHandle::open`] and [`FileHandle::check`] share that need no descriptor;
/// whether the path exists.
fn preflight(config: &FileConfig) -> Result<bool, OpenError> {
    let bs = config.block_size;
    if bs != 512 && bs != 4096 {
        return Err(OpenError::BlockSize(bs));
    }
    if let Some(size) = config.size {
        if size == 0 || size % u64::from(bs) != 0 {
            return Err(OpenError::Size {
                size,
                block_size: bs,
            });
        }
    }
    let path = &config.path;
    let exists = path.exists();
    if !exists {
        if config.size.is_none() {
            return Err(OpenError::NoSize(path.clone()));
        }
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            if !dir.is_dir() {
                return Err(OpenError::NoDirectory(dir.to_path_buf()));
            }
        }
    }
    Ok(exists)
}

/// The size a regular file of `actual` bytes is served at: the configured size (the file
/// grows to it, never shrinks), or its own when none is configured.
fn file_size(config: &FileConfig, actual: u64) -> Result<u64, OpenError> {
    let bs = u64::from(config.block_size);
    match config.size {
        Some(size) if size < actual => Err(OpenError::SizeMismatch {
            path: config.path.clone(),
            size,
            what: "file",
            actual,
        }),
        Some(size) => Ok(size),
        None if actual == 0 || actual % bs != 0 => Err(OpenError::Size {
            size: actual,
            block_size: config.block_size,
        }),
        None => Ok(actual),
    }
}

/// Whether this process may create files in the directory `dir` (write and search
/// permission, as open(2) checks them for its effective user), without creating one.
pub fn may_create_in(dir: &Path) -> io::Result<()> {
    may_access(dir, libc::W_OK | libc::X_OK)
}

/// Whether this process, as the effective user open(2) checks, may use `path` as `mode`
/// (`R_OK`, `W_OK`, `X_OK` bits) says.
fn may_access(path: &Path, mode: libc::c_int) -> io::Result<()> {
    use std::os::unix::ffi::OsStrExt;
    let c = std::ffi::CString::new(path.as_os_str().as_bytes())
        .map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
    // Safety: `c` is a NUL-terminated string that lives across the call, and faccessat only
    // reads it.
    let r = unsafe { libc::faccessat(libc::AT_FDCWD, c.as_ptr(), mode, libc::AT_EACCESS) };
    if r == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// The errno of a failed operation as the sense a disk would give: see the crate README.
pub fn errno_to_error(errno: i32, writing: bool, lba: u64) -> BackendError {
    match errno {
        libc::ENOSPC | libc::EDQUOT => BackendError::NoSpace,
        libc::EOPNOTSUPP | libc::ENOSYS => BackendError::Unsupported,
        libc::EIO | libc::ENODATA | libc::EILSEQ | libc::EREMOTEIO => {
            if writing {
                BackendError::Write { lba }
            } else {
                BackendError::Read { lba }
            }
        }
        _ => BackendError::Internal,
    }
}

fn error_for(e: io::Error, writing: bool, lba: u64) -> BackendError {
    errno_to_error(e.raw_os_error().unwrap_or(0), writing, lba)
}

fn pwrite_dsync(f: &File, buf: &[u8], at: u64) -> io::Result<usize> {
    let iov = libc::iovec {
        iov_base: buf.as_ptr() as *mut _,
        iov_len: buf.len(),
    };
    // Safety: one iovec describing `buf`, which outlives the call; the kernel only reads it.
    let n = unsafe { libc::pwritev2(f.as_raw_fd(), &iov, 1, at as i64, libc::RWF_DSYNC) };
    if n < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(n as usize)
    }
}

fn fallocate(f: &File, mode: i32, at: u64, len: u64) -> io::Result<()> {
    // Safety: fallocate reads only its integer arguments; the descriptor is open.
    let r = unsafe { libc::fallocate(f.as_raw_fd(), mode, at as i64, len as i64) };
    if r < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(())
    }
}

fn seek(fd: i32, at: u64, whence: i32) -> Result<u64, i32> {
    // Safety: lseek reads only its integer arguments.
    let r = unsafe { libc::lseek(fd, at as i64, whence) };
    if r < 0 {
        Err(io::Error::last_os_error().raw_os_error().unwrap_or(0))
    } else {
        Ok(r as u64)
    }
}

fn device_size(f: &File) -> io::Result<u64> {
    // BLKGETSIZE64 = _IOR(0x12, 114, size_t).
    const BLKGETSIZE64: libc::c_ulong = 0x8008_1272;
    let mut size: u64 = 0;
    // Safety: BLKGETSIZE64 writes one u64 through the pointer, which points at `size`.
    let r = unsafe { libc::ioctl(f.as_raw_fd(), BLKGETSIZE64 as _, &mut size as *mut u64) };
    if r < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(size)
    }
}
