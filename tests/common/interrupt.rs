//! Runs that are stopped while they write: a slow passthrough started in the background,
//! a signal, and what an interrupted run must leave (its exit code, its two lines, no output).

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use super::{cmd, listing, slow_cast_model, stderr, SLOW_CAST};

/// The binary with `args`, `NO_COLOR` set and no stdin.
pub fn tftf_cmd(args: &[&str]) -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_tftf"));
    c.args(args).env("NO_COLOR", "1").stdin(Stdio::null());
    c
}

/// A slow passthrough (`extra` added) of a model made in `dir`, stdout discarded and stderr
/// piped, returned once its temporaries exist, with its output path.
pub fn slow_run_writing(dir: &Path, extra: &[&str]) -> (Child, PathBuf) {
    let src = dir.join("in");
    slow_cast_model(&src);
    let out = dir.join("out");
    let mut child = tftf_cmd(&cmd("passthrough", &src, &out, &SLOW_CAST))
        .args(extra)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // A pipe of one page, so that a run writing progress fills it within a few lines whatever
    // the machine's speed (a 64 KiB pipe let a fast run finish before filling it). Done before
    // the run's first line as a rule; should the pipe already hold more, it keeps its size.
    let fd = std::os::fd::AsRawFd::as_raw_fd(child.stderr.as_ref().unwrap());
    // SAFETY: fcntl(2) on a pipe descriptor we own.
    unsafe { libc::fcntl(fd, libc::F_SETPIPE_SZ, 4096) };
    wait_for_temporaries(&out, &mut child);
    (child, out)
}

/// Waits until `out` holds something; kills `child` and fails after 20 s.
pub fn wait_for_temporaries(out: &Path, child: &mut Child) {
    let started = Instant::now();
    while listing(out).is_empty() {
        if started.elapsed() > Duration::from_secs(20) {
            let _ = child.kill();
            panic!("no output appeared");
        }
        std::thread::sleep(Duration::from_millis(2));
    }
}

/// Sends `signal` to `child`.
pub fn signal(child: &Child, signal: i32) {
    // SAFETY: plain kill(2) on our child's pid.
    unsafe { libc::kill(child.id() as i32, signal) };
}

/// Starts a slow passthrough, sends it `signal_number` once it writes, and asserts that it
/// exited with 128 + that, said `notice` (e.g. `interrupt`) and that it removed its temporary
/// output, and that nothing is left of it.
pub fn assert_a_slow_run_stops_on(signal_number: i32, notice: &str) {
    let d = tempfile::tempdir().unwrap();
    let (child, out) = slow_run_writing(d.path(), &["-q"]);
    signal(&child, signal_number);
    let o = child.wait_with_output().unwrap();
    assert_eq!(
        o.status.code(),
        Some(128 + signal_number),
        "128 + signal {signal_number}"
    );
    assert_eq!(
        stderr(&o),
        format!(
            "{notice}: stopping and removing temporary output…\n\
             error: interrupted; temporary output removed\n"
        )
    );
    assert!(!out.exists(), "left behind: {:?}", listing(&out));
}
