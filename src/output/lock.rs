//! One writer per output directory: an exclusive `flock` on `DIR/.tftf.lock`, held from before
//! the first check of the directory's contents until after the commit.
//!
//! `flock` rather than a pid file: the kernel releases it when its holder dies (SIGKILL, OOM,
//! power loss), so a stale lock can never block the next run, and holding it proves that every
//! tftf temporary in the directory is an orphan. The file records the holder's pid for the
//! message a second run prints. It is unlinked while still locked, and a run that locked a file
//! which was unlinked meanwhile retries on the new one, so removing it is race-free.

use std::fs::{File, OpenOptions};
use std::io::{Read, Seek, Write};
use std::os::unix::fs::MetadataExt;
use std::os::unix::io::AsRawFd;
use std::path::{Path, PathBuf};

use crate::error::{Error, Result};

pub const LOCK_FILE_NAME: &str = ".tftf.lock";

#[derive(Debug)]
pub struct OutputLock {
    path: PathBuf,
    file: Option<File>,
}

impl OutputLock {
    /// Takes the lock of `dir` (which must exist) or fails at once, naming the holder.
    pub fn acquire(dir: &Path) -> Result<OutputLock> {
        let path = dir.join(LOCK_FILE_NAME);
        loop {
            // A FIFO or a device in the lock's place would be read forever below.
            if let Ok(m) = std::fs::metadata(&path) {
                crate::sys::refuse_special(&path, &m).map_err(|e| Error::io(&path, e))?;
            }
            let mut file = OpenOptions::new()
                .read(true)
                .write(true)
                .create(true)
                .truncate(false)
                .open(&path)
                .map_err(|e| Error::io(&path, e))?;
            // SAFETY: flock takes an fd valid for `file`'s life and integer flags.
            let rc = unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) };
            if rc != 0 {
                let err = std::io::Error::last_os_error();
                if err.raw_os_error() == Some(libc::EWOULDBLOCK) {
                    let mut holder = String::new();
                    let _ = file.read_to_string(&mut holder);
                    return Err(Error::OutputLocked {
                        dir: dir.to_path_buf(),
                        holder: holder.trim().to_string(),
                    });
                }
                return Err(Error::io(&path, err));
            }
            // The previous holder may have unlinked the file between our open and our flock.
            let ours = file.metadata().map_err(|e| Error::io(&path, e))?;
            match std::fs::metadata(&path) {
                Ok(m) if m.dev() == ours.dev() && m.ino() == ours.ino() => {}
                _ => continue,
            }
            file.set_len(0).map_err(|e| Error::io(&path, e))?;
            file.rewind().map_err(|e| Error::io(&path, e))?;
            writeln!(file, "pid {}", std::process::id()).map_err(|e| Error::io(&path, e))?;
            crate::signals::remove_on_exit(&path);
            return Ok(OutputLock {
                path,
                file: Some(file),
            });
        }
    }
}

/// Whether a run holds `dir`'s lock right now (without taking it).
pub fn is_held(dir: &Path) -> bool {
    let Ok(file) = File::open(dir.join(LOCK_FILE_NAME)) else {
        return false;
    };
    // SAFETY: flock on an fd valid for `file`'s life.
    let rc = unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_SH | libc::LOCK_NB) };
    if rc == 0 {
        // SAFETY: as above; dropping the fd would release it too.
        unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_UN) };
        return false;
    }
    std::io::Error::last_os_error().raw_os_error() == Some(libc::EWOULDBLOCK)
}

impl Drop for OutputLock {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
        crate::signals::keep_on_exit(&self.path);
        drop(self.file.take());
    }
}
