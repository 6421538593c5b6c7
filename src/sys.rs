//! Thin safe wrappers over the Linux calls the pipeline needs and `std` lacks: page-cache
//! advice, write-back control, in-kernel copies, free space and memory limits.
//!
//! `libc` rather than `rustix`: `sync_file_range` and the `FICLONERANGE` ioctl are not in
//! rustix's safe API, and one binding crate keeps the unsafe surface in one file.

use std::fs::File;
use std::io;
use std::os::unix::io::AsRawFd;
use std::path::Path;

/// Tells the kernel the byte range will not be needed again, so its cached pages are dropped.
/// Advisory: failures are ignored.
pub fn drop_cache(file: &File, offset: u64, len: u64) {
    // SAFETY: posix_fadvise only reads its integer arguments; the fd is valid for `file`'s life.
    unsafe {
        libc::posix_fadvise(
            file.as_raw_fd(),
            offset as libc::off_t,
            len as libc::off_t,
            libc::POSIX_FADV_DONTNEED,
        );
    }
}

/// Starts reading a range into the cache in the background, so a later copy finds it there.
pub fn prefetch(file: &File, offset: u64, len: u64) {
    // SAFETY: as in `drop_cache`.
    unsafe {
        libc::posix_fadvise(
            file.as_raw_fd(),
            offset as libc::off_t,
            len as libc::off_t,
            libc::POSIX_FADV_WILLNEED,
        );
    }
}

pub fn advise_sequential(file: &File) {
    // SAFETY: as in `drop_cache`.
    unsafe {
        libc::posix_fadvise(file.as_raw_fd(), 0, 0, libc::POSIX_FADV_SEQUENTIAL);
    }
}

/// Starts write-back of a range without waiting.
pub fn start_writeback(file: &File, offset: u64, len: u64) {
    // SAFETY: sync_file_range takes an fd and integers; no memory is passed.
    unsafe {
        libc::sync_file_range(
            file.as_raw_fd(),
            offset as libc::off64_t,
            len as libc::off64_t,
            libc::SYNC_FILE_RANGE_WRITE,
        );
    }
}

/// Waits until a range is on disk, then drops its pages from the cache.
pub fn finish_writeback(file: &File, offset: u64, len: u64) -> io::Result<()> {
    // SAFETY: as in `start_writeback`.
    let rc = unsafe {
        libc::sync_file_range(
            file.as_raw_fd(),
            offset as libc::off64_t,
            len as libc::off64_t,
            libc::SYNC_FILE_RANGE_WAIT_BEFORE
                | libc::SYNC_FILE_RANGE_WRITE
                | libc::SYNC_FILE_RANGE_WAIT_AFTER,
        )
    };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    drop_cache(file, offset, len);
    Ok(())
}

/// One `copy_file_range` call; returns the bytes copied (possibly short, 0 at end of input).
pub fn copy_file_range(
    src: &File,
    src_off: u64,
    dst: &File,
    dst_off: u64,
    len: u64,
) -> io::Result<u64> {
    let mut s = src_off as libc::loff_t;
    let mut d = dst_off as libc::loff_t;
    // SAFETY: the offset pointers point to live locals; fds are valid for the borrows.
    let n = unsafe {
        libc::copy_file_range(
            src.as_raw_fd(),
            &mut s,
            dst.as_raw_fd(),
            &mut d,
            len.min(1 << 30) as usize,
            0,
        )
    };
    if n < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(n as u64)
    }
}

/// Bytes available to an unprivileged user on the filesystem holding `path`.
pub fn free_space(path: &Path) -> io::Result<u64> {
    use std::os::unix::ffi::OsStrExt;
    let c = std::ffi::CString::new(path.as_os_str().as_bytes())
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "path holds a NUL byte"))?;
    let mut st = std::mem::MaybeUninit::<libc::statvfs>::uninit();
    // SAFETY: `c` is a valid C string and `st` is writable storage of the right type.
    let rc = unsafe { libc::statvfs(c.as_ptr(), st.as_mut_ptr()) };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: statvfs returned 0, so it filled `st`.
    let st = unsafe { st.assume_init() };
    // The field types differ between targets (u32 on some 32-bit ones).
    #[allow(clippy::unnecessary_cast)]
    Ok(st.f_bavail as u64 * st.f_frsize as u64)
}

/// Memory this process may use: `MemAvailable`, lowered by a cgroup (v2 or v1) limit. The
/// limit itself rather than limit minus usage, since the usage counts reclaimable page cache.
pub fn available_memory() -> u64 {
    let meminfo = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
    let mut avail = meminfo
        .lines()
        .find_map(|l| l.strip_prefix("MemAvailable:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .map_or(8 << 30, |kb| kb * 1024);
    for limit_file in [
        "/sys/fs/cgroup/memory.max",
        "/sys/fs/cgroup/memory/memory.limit_in_bytes",
    ] {
        if let Some(limit) = std::fs::read_to_string(limit_file)
            .ok()
            .and_then(|s| s.trim().parse::<u64>().ok())
        {
            avail = avail.min(limit);
        }
    }
    avail
}

/// Peak resident set size of this process (`VmHWM`), in bytes.
pub fn peak_rss() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .map_or(0, |kb| kb * 1024)
}

/// Makes glibc serve every allocation of 1 MiB or more with its own `mmap`, so freeing a
/// pipeline buffer returns its pages at once. By default glibc raises this threshold after the
/// first large free (up to 32 MiB), after which freed chunk buffers stay in the heap and
/// resident memory drifts past the budget (measured: 399 MiB RSS under a 256 MiB budget).
pub fn return_freed_buffers_to_the_os() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: mallopt only sets an allocator tunable; called before any thread starts.
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, 1 << 20);
    }
}

/// Shares `len` bytes of `src` at `src_off` into `dst` at `dst_off` (`FICLONERANGE`). Offsets
/// and length must be multiples of the filesystem block size (or the range must end at the end
/// of `src`). Fails instead of copying, so a caller knows whether extents are shared.
pub fn clone_range(src: &File, src_off: u64, dst: &File, dst_off: u64, len: u64) -> io::Result<()> {
    let arg = libc::file_clone_range {
        src_fd: src.as_raw_fd() as i64,
        src_offset: src_off,
        src_length: len,
        dest_offset: dst_off,
    };
    // SAFETY: FICLONERANGE takes a pointer to a `file_clone_range`, which `arg` is and which
    // outlives the call; both fds are valid for the borrows.
    let rc = unsafe { libc::ioctl(dst.as_raw_fd(), libc::FICLONERANGE, &arg) };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Shares all of `src` into the empty file `dst` (`FICLONE`).
pub fn clone_file(src: &File, dst: &File) -> io::Result<()> {
    // SAFETY: FICLONE takes the source fd as its integer argument.
    let rc = unsafe { libc::ioctl(dst.as_raw_fd(), libc::FICLONE, src.as_raw_fd()) };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Whether an error from a clone or in-kernel copy means "not possible here" (fall back to the
/// next method) rather than a real I/O failure.
pub fn is_unsupported(e: &io::Error) -> bool {
    matches!(
        e.raw_os_error(),
        Some(
            libc::EXDEV
                | libc::EOPNOTSUPP
                | libc::ENOSYS
                | libc::EINVAL
                | libc::ENOTTY
                | libc::EBADF
                | libc::EPERM
        )
    )
}

/// Preferred I/O block size of the file's filesystem (`st_blksize`).
pub fn block_size(file: &File) -> u64 {
    use std::os::unix::fs::MetadataExt;
    file.metadata().map_or(4096, |m| m.blksize().max(1))
}

/// Filesystem name of a path, for messages about extent sharing.
pub fn filesystem_name(path: &Path) -> &'static str {
    use std::os::unix::ffi::OsStrExt;
    let Ok(c) = std::ffi::CString::new(path.as_os_str().as_bytes()) else {
        return "unknown";
    };
    let mut st = std::mem::MaybeUninit::<libc::statfs>::uninit();
    // SAFETY: `c` is a valid C string and `st` writable storage of the right type.
    if unsafe { libc::statfs(c.as_ptr(), st.as_mut_ptr()) } != 0 {
        return "unknown";
    }
    // SAFETY: statfs returned 0, so it filled `st`.
    // f_type is i64 on x86-64 but a narrower type on some targets.
    #[allow(clippy::unnecessary_cast)]
    let magic = unsafe { st.assume_init() }.f_type as i64;
    match magic {
        0x5846_5342 => "xfs",
        0x9123_683E => "btrfs",
        0xCA45_1A4E => "bcachefs",
        0x2FC1_2FC1 => "zfs",
        0xEF53 => "ext4",
        0x0102_1994 => "tmpfs",
        0x794C_7630 => "overlayfs",
        _ => "other",
    }
}

/// Whether a filesystem of this name can share extents at all.
pub fn can_reflink(fs: &str) -> bool {
    matches!(fs, "xfs" | "btrfs" | "bcachefs" | "zfs")
}

/// Opens an input file for reading, refusing anything but a regular file (symlinks followed):
/// a FIFO would block `open` and `read` forever, and a device (`/dev/urandom`, `/dev/zero`)
/// would never end or would pass for a file of zero bytes. The type is checked before the open,
/// the open itself does not block (`O_NONBLOCK`, dropped again once the file is known to be
/// regular) and the opened file is checked again, so a file swapped in between is caught too.
pub fn open_regular(path: &Path) -> io::Result<File> {
    use std::os::unix::fs::OpenOptionsExt;
    refuse_special(path, &std::fs::metadata(path)?)?;
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK | libc::O_NOCTTY)
        .open(path)?;
    refuse_special(path, &file.metadata()?)?;
    let fd = file.as_raw_fd();
    // SAFETY: fcntl on an fd valid for `file`'s life, with integer flags.
    unsafe {
        let flags = libc::fcntl(fd, libc::F_GETFL);
        if flags < 0 || libc::fcntl(fd, libc::F_SETFL, flags & !libc::O_NONBLOCK) < 0 {
            return Err(io::Error::last_os_error());
        }
    }
    Ok(file)
}

/// [`std::fs::read`] through [`open_regular`].
pub fn read_regular(path: &Path) -> io::Result<Vec<u8>> {
    use std::io::Read;
    let mut file = open_regular(path)?;
    let mut bytes = Vec::new();
    file.read_to_end(&mut bytes)?;
    Ok(bytes)
}

/// [`std::fs::read_to_string`] through [`open_regular`].
pub fn read_regular_to_string(path: &Path) -> io::Result<String> {
    String::from_utf8(read_regular(path)?).map_err(|_| {
        io::Error::new(
            io::ErrorKind::InvalidData,
            "stream did not contain valid UTF-8",
        )
    })
}

/// An error unless `meta` (of `path`, symlinks followed) is a regular file; the message says
/// what it is instead.
pub fn refuse_special(path: &Path, meta: &std::fs::Metadata) -> io::Result<()> {
    use std::os::unix::fs::FileTypeExt;
    let t = meta.file_type();
    if t.is_file() {
        return Ok(());
    }
    let what = if t.is_dir() {
        "a directory"
    } else if t.is_fifo() {
        "a FIFO (named pipe)"
    } else if t.is_char_device() {
        "a character device"
    } else if t.is_block_device() {
        "a block device"
    } else if t.is_socket() {
        "a socket"
    } else {
        "a special file"
    };
    let link = std::fs::symlink_metadata(path).is_ok_and(|m| m.file_type().is_symlink());
    let what = if link {
        format!("a symlink to {what}")
    } else {
        what.to_string()
    };
    Err(io::Error::new(
        io::ErrorKind::InvalidInput,
        format!("{what}, not a regular file"),
    ))
}

/// Whether `path` lives on a rotational disk, from `/sys/dev/block/MAJ:MIN/queue/rotational`
/// (or the whole disk's, for a partition). `None` for storage without a block device (tmpfs,
/// network filesystems) or when sysfs does not say.
pub fn is_rotational(path: &Path) -> Option<bool> {
    use std::os::unix::fs::MetadataExt;
    let dev = std::fs::metadata(path).ok()?.dev();
    let node = format!(
        "/sys/dev/block/{}:{}",
        libc::major(dev as libc::dev_t),
        libc::minor(dev as libc::dev_t)
    );
    let dir = std::fs::canonicalize(node).ok()?;
    let read = |d: &Path| std::fs::read_to_string(d.join("queue/rotational")).ok();
    let text = read(&dir).or_else(|| read(dir.parent()?))?;
    Some(text.trim() == "1")
}
