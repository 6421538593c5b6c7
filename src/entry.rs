//! The command line's whole run, as a function: what the `tftf` binary's `main` does, callable
//! from another front end (the Python package's `tftf` console command and `python -m tftf`)
//! with the same exit codes and signal behaviour.

use std::ffi::OsString;

use clap::CommandFactory;

/// Runs the command line on `args` (`args[0]` is the program name) and returns the process's
/// exit code: 0 on success, the error's code (see [`crate::Error::exit_code`]), clap's code for
/// a usage error or `--help`, or 128 + the signal's number after SIGINT, SIGTERM or SIGHUP.
///
/// Call it from the process's main thread before other threads start: it takes the signals
/// over for every thread started afterwards ([`crate::signals::install`]).
pub fn run(args: Vec<OsString>) -> i32 {
    crate::sys::return_freed_buffers_to_the_os();
    let cancel = crate::pipeline::Cancel::default();
    let on_signal = cancel.clone();
    // Before any thread starts: every thread inherits the blocked signals.
    if let Err(e) = crate::signals::install(move || on_signal.raise()) {
        // The run can go on: a signal then ends it at once, as it does most programs.
        crate::errln!("warning: cannot take over SIGINT and SIGTERM ({e}); a signal will end the run without removing its temporary files");
    }
    run_with(args, &cancel)
}

/// [`run`] without taking the signals over, for a caller that keeps its own signal handling
/// (a Python program calling the command line in-process) and stops the run through `cancel`.
pub fn run_with(args: Vec<OsString>, cancel: &crate::pipeline::Cancel) -> i32 {
    // `run`'s pipe sections are split off first: clap cannot express them.
    let (args, sections) = crate::commands::run_sections::split(args);
    let matches = match crate::cli::Cli::command().try_get_matches_from(args) {
        Ok(m) => m,
        Err(e) => {
            // `--help` and `--version` print to stdout, usage errors to stderr, as clap's exit.
            let _ = e.print();
            return e.exit_code();
        }
    };
    let result = crate::commands::dispatch(&matches, &sections, cancel);
    match &result {
        Err(e) => crate::errln!("error: {}", crate::escape::name(&e.to_string())),
        // Stdout lost (a full disk, a closed pipe): stderr may still tell.
        Ok(_) => crate::console::notes()
            .iter()
            .for_each(|n| crate::errln!("note: {n}")),
    }
    // A signal ends the run with its code, whatever the run made of the cancel.
    if let Some(signal) = crate::signals::received() {
        return crate::signals::exit_code(signal);
    }
    match result {
        Ok(code) => code,
        Err(e) => e.exit_code(),
    }
}
