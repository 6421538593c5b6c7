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
