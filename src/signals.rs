//! What signals do to a run.
//!
//! SIGINT, SIGTERM and SIGHUP end every run with 128 + the signal's number (130, 143, 129) and
//! its temporaries removed. They are blocked in every thread and taken by one thread of their
//! own (`sigwait`), which knows which signal came. The first one raises the run's cancel flag,
//! and the run stops at its next check and cleans up as after any error. A run can be stuck
//! where no check comes (a write to a pipe nobody reads, a read from a hung network
//! filesystem), so if it has not ended [`GRACE`] later — or at a second signal — the
//! signal thread removes the files registered with [`remove_on_exit`] (temporaries, the lock,
//! directories the run created) and exits itself.
//!
//! SIGPIPE is ignored: a closed stdout or stderr is a write error that [`crate::console`]
//! turns into "stop printing", never the end of a conversion with its temporaries left behind.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicI32, Ordering};
use std::sync::Mutex;
use std::time::Duration;

/// How long a run may take to stop after a signal before it is ended from outside.
pub const GRACE: Duration = Duration::from_secs(3);

/// Stack of the signal threads: they only wait, print a line and remove files (a fixed size
/// also keeps `RUST_MIN_STACK` from stopping them).
const SIGNAL_THREAD_STACK_BYTES: usize = 256 << 10;

/// The signals that end a run.
const ENDING: [libc::c_int; 3] = [libc::SIGINT, libc::SIGTERM, libc::SIGHUP];

/// The first ending signal received (0: none yet).
static RECEIVED: AtomicI32 = AtomicI32::new(0);

/// Paths to remove if a signal ends the process, in the order registered; removed last first.
static ON_EXIT: Mutex<Vec<PathBuf>> = Mutex::new(Vec::new());

/// Registers a file or directory (removed only if empty) that a signal ending the process
/// removes.
pub fn remove_on_exit(path: &Path) {
    on_exit().push(path.to_path_buf());
}

/// Forgets a path given to [`remove_on_exit`]: the run removed it itself, or it is output now.
pub fn keep_on_exit(path: &Path) {
    on_exit().retain(|p| p != path);
}

fn on_exit() -> std::sync::MutexGuard<'static, Vec<PathBuf>> {
    ON_EXIT.lock().unwrap_or_else(|e| e.into_inner())
}

/// The ending signal received, if any.
pub fn received() -> Option<i32> {
    match RECEIVED.load(Ordering::SeqCst) {
        0 => None,
        s => Some(s),
    }
}

/// The exit code of a process ended by `signal`: 128 + its number, as shells report it.
pub fn exit_code(signal: i32) -> i32 {
    128 + signal
}

fn label(signal: i32) -> &'static str {
    match signal {
        libc::SIGINT => "interrupt",
        libc::SIGTERM => "terminated",
        _ => "hangup",
    }
}

/// Takes over SIGINT, SIGTERM and SIGHUP (see the module docs) and ignores SIGPIPE. `cancel`
/// is called at the first signal. Call it first thing in `main`, before any thread starts, so
/// that every thread inherits the blocked signals. When the signal thread cannot start, the
/// signals keep their default action (they end the process at once) and the error says why.
pub fn install(cancel: impl Fn() + Send + 'static) -> std::io::Result<()> {
    let mut set = std::mem::MaybeUninit::<libc::sigset_t>::uninit();
    // SAFETY: sigemptyset initialises the set it is given; sigaddset and pthread_sigmask read
    // it and integer arguments; signal sets one disposition.
    let set = unsafe {
        libc::sigemptyset(set.as_mut_ptr());
        let mut set = set.assume_init();
        for s in ENDING {
            libc::sigaddset(&mut set, s);
        }
        let rc = libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut());
        if rc != 0 {
            return Err(std::io::Error::from_raw_os_error(rc));
        }
        libc::signal(libc::SIGPIPE, libc::SIG_IGN);
        set
    };
    let spawned = std::thread::Builder::new()
        .name("signals".into())
        .stack_size(SIGNAL_THREAD_STACK_BYTES)
        .spawn(move || loop {
            let mut signal: libc::c_int = 0;
            // SAFETY: `set` is an initialised sigset_t; sigwait writes one int.
            if unsafe { libc::sigwait(&set, &mut signal) } != 0 {
                continue;
            }
            if RECEIVED
                .compare_exchange(0, signal, Ordering::SeqCst, Ordering::SeqCst)
                .is_err()
            {
                end_now(signal, "a second signal came");
            }
            // The deadline first: printing the message can block (a full pipe on stderr).
            let deadline = std::thread::Builder::new().stack_size(SIGNAL_THREAD_STACK_BYTES);
            let _ = deadline.spawn(move || {
                std::thread::sleep(GRACE);
                end_now(signal, "the run did not stop in time");
            });
            crate::errln!("{}: stopping and removing temporary output…", label(signal));
            cancel();
        });
    if let Err(e) = spawned {
        // Nobody would take the blocked signals: give them back their default action.
        // SAFETY: as above.
        unsafe { libc::pthread_sigmask(libc::SIG_UNBLOCK, &set, std::ptr::null_mut()) };
        return Err(e);
    }
    Ok(())
}

/// Removes the registered paths and exits with the first signal's code, not waiting for the
/// run; `why` says why, in the last line.
fn end_now(signal: i32, why: &str) -> ! {
    let paths = on_exit();
    for p in paths.iter().rev() {
        if std::fs::remove_file(p).is_err() {
            let _ = std::fs::remove_dir(p);
        }
    }
    let first = received().unwrap_or(signal);
    let line = format!(
        "{}: {why}; removed the temporary output and exited\n",
        label(first)
    );
    write_if_ready(libc::STDERR_FILENO, line.as_bytes());
    // SAFETY: _exit ends the process at once; nothing runs after it.
    unsafe { libc::_exit(exit_code(first)) }
}

/// Writes `bytes` to `fd` only if that cannot block (a full pipe is left alone).
fn write_if_ready(fd: libc::c_int, bytes: &[u8]) {
    let mut poll = libc::pollfd {
        fd,
        events: libc::POLLOUT,
        revents: 0,
    };
    // SAFETY: poll reads one pollfd; write reads `bytes.len()` bytes from a live slice.
    unsafe {
        if libc::poll(&mut poll, 1, 0) == 1 && poll.revents & libc::POLLOUT != 0 {
            libc::write(fd, bytes.as_ptr().cast(), bytes.len());
        }
    }
}
