//! The environment fails, the conversion must not (issue 24, items 9, 10 and 12): stdout and
//! stderr that cannot be written (a closed pipe, a full device), special files where the run
//! reads files (FIFOs, devices), signals, and output names as long as the filesystem allows.

mod common;

use std::os::fd::{FromRawFd, OwnedFd};
use std::os::unix::fs::symlink;
use std::path::{Path, PathBuf};
use std::process::{Child, Stdio};
use std::time::{Duration, Instant};

use common::interrupt::*;
use common::*;
use tftf::format::dtype::DType;

/// A small two-shard model with a tokenizer config, and its tensors.
fn model(dir: &Path) -> Vec<T> {
    let mut rng = Rng(24);
    let m = Model::new()
        .rand(
            &mut rng,
            "model.embed_tokens.weight",
            DType::BF16,
            &[64, 32],
        )
        .shard()
        .rand(&mut rng, "lm_head.weight", DType::F32, &[64, 32])
        .config(r#"{"model_type": "llama"}"#)
        .file("tokenizer_config.json", r#"{"eos_token": "</s>"}"#);
    m.write(dir);
    m.all()
}

/// A temporary folder with [`model`] written to its `in`, the model's tensors, and the paths
/// `out` and `report.json` in the folder.
fn model_case() -> (tempfile::TempDir, PathBuf, Vec<T>, PathBuf, PathBuf) {
    let d = tmp();
    let src = d.path().join("in");
    let tensors = model(&src);
    let (out, report) = (d.path().join("out"), d.path().join("report.json"));
    (d, src, tensors, out, report)
}

/// The write end of a pipe whose read end is already closed: every write to it fails with
/// EPIPE, as `| head -1` does once head has its line.
fn closed_pipe() -> OwnedFd {
    let mut fds = [0; 2];
    // SAFETY: pipe(2) fills two fds, which we then own.
    assert_eq!(unsafe { libc::pipe(fds.as_mut_ptr()) }, 0);
    // SAFETY: both fds were just returned by pipe(2) and are owned by nobody else.
    let (read, write) = unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) };
    drop(read);
    write
}

fn full_device() -> std::fs::File {
    std::fs::OpenOptions::new()
        .write(true)
        .open("/dev/full")
        .expect("/dev/full")
}

/// Waits for `child` at most `limit`; kills it and fails when it is still running then.
fn wait_at_most(child: &mut Child, limit: Duration, what: &str) -> std::process::ExitStatus {
    let started = Instant::now();
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            return status;
        }
        if started.elapsed() > limit {
            let _ = child.kill();
            let _ = child.wait();
            panic!("{what}: still running after {limit:?} (blocked)");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Runs tftf with `args` (stdout and stderr captured) for at most 20 s: a run that blocks fails
/// the test instead of hanging it.
fn run_bounded(args: &[&str]) -> (Option<i32>, String, String) {
    let mut child = tftf_cmd(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let status = wait_at_most(&mut child, Duration::from_secs(20), &args.join(" "));
    let o = child.wait_with_output().unwrap();
    (status.code(), stdout(&o), stderr(&o))
}

/// The tensors of `out` (a file or a folder) are exactly `tensors`, byte for byte.
fn assert_holds(out: &Path, tensors: &[T]) {
    let got = load_all(out);
    let want: std::collections::BTreeMap<String, (String, Vec<usize>, Vec<u8>)> = tensors
        .iter()
        .map(|(name, dtype, shape, bytes)| {
            let shape = shape.iter().map(|&d| d as usize).collect();
            (
                name.clone(),
                (dtype.name().to_string(), shape, bytes.clone()),
            )
        })
        .collect();
    assert_eq!(got, want);
}

/// The output holds exactly the model's tensors, and nothing of the run is left beside it.
fn assert_converted(out: &Path, tensors: &[T]) {
    assert_holds(out, tensors);
    let names = listing(out);
    assert!(
        names.iter().all(|n| !n.starts_with('.')),
        "temporaries or the lock left behind: {names:?}"
    );
}

fn report_notes(path: &Path) -> Vec<String> {
    read_json(path)["notes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|n| n.as_str().unwrap().to_string())
        .collect()
}

// ---------------------------------------------------------------------------------------------
// Item 9: stdout and stderr that cannot be written.

#[test]
fn progress_into_a_closed_pipe_finishes_the_conversion_and_notes_it() {
    let (_d, src, tensors, out, report) = model_case();
    // `tftf … --progress json 2>&1 | head -1` once head has gone.
    let pipe = closed_pipe();
    let status = tftf_cmd(&cmd(
        "passthrough",
        &src,
        &out,
        &[
            "--progress",
            "json",
            "--progress-interval",
            "0.001",
            "--report",
            s(&report),
        ],
    ))
    .stdout(pipe.try_clone().unwrap())
    .stderr(pipe)
    .status()
    .unwrap();
    assert_eq!(status.code(), Some(0), "killed or failed: {status:?}");
    assert_converted(&out, &tensors);
    assert_eq!(
        report_notes(&report),
        [
            "stdout could not be written (Broken pipe (os error 32)); the lines after that were dropped",
            "stderr could not be written (Broken pipe (os error 32)); the lines after that were dropped",
        ]
    );
}

/// What a run whose stdout is full says about it on stderr.
const STDOUT_FULL_NOTE: &str = "note: stdout could not be written (No space left on device \
    (os error 28)); the lines after that were dropped\n";

/// Runs `args` with stdout on a full device; asserts that the run succeeds and returns its
/// stderr.
fn stderr_of_a_run_with_stdout_full(args: &[&str]) -> String {
    let o = tftf_cmd(args).stdout(full_device()).output().unwrap();
    assert_eq!(o.status.code(), Some(0), "{o:?}");
    stderr(&o)
}

#[test]
fn full_stdout_and_stderr_do_not_stop_a_conversion() {
    let (d, src, tensors, out, report) = model_case();
    let o = tftf_cmd(&cmd("passthrough", &src, &out, &["--report", s(&report)]))
        .stdout(full_device())
        .stderr(full_device())
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(0), "panicked or failed: {o:?}");
    assert_converted(&out, &tensors);
    let enospc = "No space left on device (os error 28)";
    assert_eq!(
        report_notes(&report),
        [
            format!("stdout could not be written ({enospc}); the lines after that were dropped"),
            format!("stderr could not be written ({enospc}); the lines after that were dropped"),
        ]
    );
    // Stdout alone full: the summary is lost, and stderr says so.
    let out2 = d.path().join("out2");
    let args = cmd("passthrough", &src, &out2, &["--progress", "none"]);
    assert_eq!(stderr_of_a_run_with_stdout_full(&args), STDOUT_FULL_NOTE);
    assert_converted(&out2, &tensors);
}

#[test]
fn info_validate_verify_and_dry_runs_whose_output_is_lost_exit_1() {
    let (d, src, _, out, _) = model_case();
    passthrough_ok(&src, &out, &["--checksums", "-q"]);
    let dry = d.path().join("dry");
    let commands: [Vec<&str>; 5] = [
        vec!["info", s(&src)],
        vec!["info", s(&src), "--json"],
        vec!["validate", s(&src)],
        vec!["verify", s(&out)],
        cmd("passthrough", &src, &dry, &["--dry-run"]),
    ];
    for args in &commands {
        for (stdout, why) in [
            (
                Stdio::from(full_device()),
                "No space left on device (os error 28)",
            ),
            (Stdio::from(closed_pipe()), "Broken pipe (os error 32)"),
        ] {
            let o = tftf_cmd(args).stdout(stdout).output().unwrap();
            assert_eq!(o.status.code(), Some(1), "{args:?}: {o:?}");
            assert_eq!(
                stderr(&o),
                format!(
                    "error: cannot write to stdout: {why}; the output printed so far is incomplete\n"
                ),
                "{args:?}"
            );
        }
        // Nowhere to say it either: still exit 1, not a panic's 101 or SIGPIPE.
        let o = tftf_cmd(args)
            .stdout(full_device())
            .stderr(full_device())
            .status()
            .unwrap();
        assert_eq!(o.code(), Some(1), "{args:?}");
    }
    assert!(!dry.exists());
    // `recover` changes the directory whatever it could print: its lost line is only noted.
    let o = stderr_of_a_run_with_stdout_full(&["recover", s(&out)]);
    assert_eq!(o, STDOUT_FULL_NOTE);
}

// ---------------------------------------------------------------------------------------------
// Item 10: FIFOs and devices where files are read; signals.

fn mkfifo(path: &Path) {
    let _ = std::fs::remove_file(path);
    let c = std::ffi::CString::new(path.as_os_str().as_encoded_bytes()).unwrap();
    // SAFETY: mkfifo reads a NUL-terminated path.
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o644) }, 0, "mkfifo");
}

/// Replaces `path` with a FIFO (`"fifo"`) or a symlink to the device `make`; returns what the
/// refusal calls it.
fn make_special(path: &Path, make: &str) -> &'static str {
    let _ = std::fs::remove_file(path);
    if make == "fifo" {
        mkfifo(path);
        "a FIFO (named pipe)"
    } else {
        symlink(make, path).unwrap();
        "a symlink to a character device"
    }
}

/// Runs `check` with `path` replaced by the special file `make` (given what the refusal calls
/// it), then puts the file back.
fn with_special(path: &Path, make: &str, check: impl FnOnce(&str)) {
    let saved = std::fs::read(path).unwrap();
    check(make_special(path, make));
    std::fs::remove_file(path).unwrap();
    std::fs::write(path, saved).unwrap();
}

#[test]
fn special_side_files_are_refused_before_any_output() {
    let (_d, src, _, out, _) = model_case();
    // A FIFO `config.json` is not taken for a missing one either.
    for (name, make) in [
        ("tokenizer_config.json", "fifo"),
        ("tokenizer_config.json", "/dev/zero"),
        ("config.json", "fifo"),
    ] {
        let side = src.join(name);
        with_special(&side, make, |what| {
            let (code, _, err) = run_bounded(&cmd("passthrough", &src, &out, &[]));
            assert_eq!(code, Some(1), "{name} as {make}");
            assert_eq!(
                err,
                format!("error: {}: {what}, not a regular file\n", side.display())
            );
            assert!(!out.exists(), "{name} as {make}");
        });
    }
}

#[test]
fn a_fifo_as_the_report_or_as_the_old_index_of_the_output_does_not_block() {
    let (_d, src, tensors, out, report) = model_case();
    mkfifo(&report);
    let (code, _, err) = run_bounded(&cmd("passthrough", &src, &out, &["--report", s(&report)]));
    assert_eq!(code, Some(2));
    assert_eq!(
        err,
        format!(
            "error: --report {} exists and is not a tftf report; remove it or choose another path\n",
            report.display()
        )
    );
    assert!(!out.exists());
    // An earlier output's index that is a FIFO is replaced under --force, not read forever.
    std::fs::create_dir(&out).unwrap();
    mkfifo(&out.join("model.safetensors.index.json"));
    let (code, _, err) = run_bounded(&cmd("passthrough", &src, &out, &["--force", "-q"]));
    assert_eq!(code, Some(0), "{err}");
    assert_converted(&out, &tensors);
}

#[test]
fn gguf_refuses_a_fifo_or_a_device_as_a_tokenizer_file() {
    let case = gguf::GgufCase::dense(3, "llama3");
    let out = case.path("out.gguf");
    for (name, make) in [
        ("tokenizer_config.json", "fifo"),
        ("tokenizer.json", "fifo"),
        ("tokenizer.json", "/dev/urandom"),
    ] {
        let file = case.model.join(name);
        with_special(&file, make, |what| {
            let (code, _, err) = run_bounded(&[
                "gguf",
                s(&case.model),
                "-o",
                s(&out),
                "--vocab-pre",
                "llama-bpe",
            ]);
            assert_eq!(code, Some(1), "{name}: {err}");
            assert_mentions(
                &err,
                &[&format!("{}: {what}, not a regular file", file.display())],
            );
            assert!(!out.exists(), "{name}");
        });
    }
}

#[test]
fn verify_refuses_special_files_in_place_of_listed_files() {
    let d = tmp();
    let src = d.path().join("in");
    std::fs::create_dir_all(&src).unwrap();
    model(&src);
    // An empty side file: a device that reads as nothing passed for it.
    std::fs::write(src.join("README.md"), "").unwrap();
    let out = d.path().join("out");
    passthrough_ok(&src, &out, &["--checksums", "-q"]);
    tftf_ok(&["verify", s(&out)]);
    for (name, make) in [
        ("README.md", "/dev/urandom"),
        ("tokenizer_config.json", "fifo"),
    ] {
        let file = out.join(name);
        with_special(&file, make, |what| {
            let (code, stdout_text, _) = run_bounded(&["verify", s(&out)]);
            assert_eq!(code, Some(1), "{name} as {make}");
            assert_eq!(
                stdout_text,
                format!("{}: {name}: {what}, not a regular file\n", out.display())
            );
        });
    }
}

#[test]
fn sigterm_ends_a_run_with_143_and_removes_its_temporaries() {
    assert_a_slow_run_stops_on(libc::SIGTERM, "terminated");
}

#[test]
fn sigterm_ends_a_run_stuck_on_a_stderr_nobody_reads() {
    let d = tmp();
    // Progress lines every 0.1 ms fill the pipe at once; nobody reads it, so the next line
    // blocks the writer, and no cancel check is ever reached.
    let (mut child, out) = slow_run_writing(
        d.path(),
        &["--progress", "json", "--progress-interval", "0.0001"],
    );
    std::thread::sleep(Duration::from_millis(500));
    if let Some(status) = child.try_wait().unwrap() {
        // Say how it ended, so that a run that was never stuck can be told apart from one
        // that failed.
        let mut err = String::new();
        let _ = std::io::Read::read_to_string(&mut child.stderr.take().unwrap(), &mut err);
        let tail: String = err.lines().rev().take(3).collect::<Vec<_>>().join(" / ");
        panic!("the run was not stuck: it ended with {status}; its last stderr lines: {tail}");
    }
    let signalled = Instant::now();
    signal(&child, libc::SIGTERM);
    let status = wait_at_most(&mut child, Duration::from_secs(15), "after SIGTERM");
    let took = signalled.elapsed();
    assert_eq!(status.code(), Some(143), "128 + SIGTERM");
    assert!(
        took >= tftf::signals::GRACE - Duration::from_millis(100),
        "ended after {took:?}: the run was not stuck"
    );
    assert!(!out.exists(), "left behind: {:?}", listing(&out));
}

// ---------------------------------------------------------------------------------------------
// Item 12: names as long as the filesystem allows.

#[test]
fn output_and_side_file_names_of_240_bytes_are_written() {
    let (d, src, tensors, _, _) = model_case();
    let side = format!("{}.json", "s".repeat(235));
    std::fs::write(src.join(&side), "{}").unwrap();
    let file = d
        .path()
        .join("file")
        .join(format!("{}.safetensors", "f".repeat(228)));
    assert_eq!(file.file_name().unwrap().len(), 240);
    passthrough_ok(&src, &file, &["-q"]);
    assert_holds(&file, &tensors);
    assert_eq!(listing(file.parent().unwrap()).len(), 1);
    let out = d.path().join("dir");
    passthrough_ok(&src, &out, &["-q", "--checksums"]);
    assert_eq!(std::fs::read(out.join(&side)).unwrap(), b"{}");
    assert_converted(&out, &tensors);
    tftf_ok(&["verify", s(&out)]);
}
