//! Every line tftf prints goes through here, so that printing can never stop a conversion.
//!
//! Messages and progress are not the job: a closed pipe (`tftf … 2>&1 | head -1`), a full
//! device (`> /dev/full`, a log on a full quota) or any other write error on stdout or stderr
//! makes that stream stop taking lines, and the run goes on and commits its output. The first
//! error on each stream is kept: [`notes`] says what was lost (the run's report carries it), and
//! the commands whose output *is* their result (`info`, `validate`, `verify`, dry runs) turn it
//! into an error with [`require_stdout`]. `main` ignores SIGPIPE, so a closed pipe is an EPIPE
//! error here rather than the end of the process with its temporaries left behind.
//!
//! [`outln!`](crate::outln) and [`errln!`](crate::errln) are `println!` and `eprintln!` with
//! that behaviour.

use std::fmt;
use std::io::Write;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::OnceLock;

use crate::error::{Error, Result};

/// One of the two streams tftf prints to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Stream {
    Out,
    Err,
}

impl Stream {
    fn label(self) -> &'static str {
        match self {
            Stream::Out => "stdout",
            Stream::Err => "stderr",
        }
    }

    /// The first write error on this stream, once there was one.
    fn lost(self) -> &'static OnceLock<String> {
        static OUT: OnceLock<String> = OnceLock::new();
        static ERR: OnceLock<String> = OnceLock::new();
        match self {
            Stream::Out => &OUT,
            Stream::Err => &ERR,
        }
    }
}

/// Set by [`set_silent`]: every line is dropped.
static SILENT: AtomicBool = AtomicBool::new(false);

/// Drops every line from now on, for a harness that runs many commands in one process and
/// judges them by their results (the fuzz tests).
pub fn set_silent(silent: bool) {
    SILENT.store(silent, Ordering::Relaxed);
}

/// Prints `args` and a newline on `stream`, flushed; after the stream's first write error,
/// nothing (see the module docs).
pub fn line(stream: Stream, args: fmt::Arguments) {
    if SILENT.load(Ordering::Relaxed) || stream.lost().get().is_some() {
        return;
    }
    let written = match stream {
        Stream::Out => {
            let mut s = std::io::stdout().lock();
            writeln!(s, "{args}").and_then(|()| s.flush())
        }
        Stream::Err => {
            let mut s = std::io::stderr().lock();
            writeln!(s, "{args}").and_then(|()| s.flush())
        }
    };
    if let Err(e) = written {
        let _ = stream.lost().set(e.to_string());
    }
}

/// Why `stream` stopped taking lines, if it did.
pub fn lost(stream: Stream) -> Option<&'static str> {
    stream.lost().get().map(String::as_str)
}

/// One note per stream that stopped taking lines, for the run's report.
pub fn notes() -> Vec<String> {
    [Stream::Out, Stream::Err]
        .into_iter()
        .filter_map(|s| {
            lost(s).map(|why| {
                format!(
                    "{} could not be written ({why}); the lines after that were dropped",
                    s.label()
                )
            })
        })
        .collect()
}

/// For a command whose printed output is its result: an error when stdout stopped taking
/// lines, since what it printed is incomplete.
pub fn require_stdout() -> Result<()> {
    match lost(Stream::Out) {
        Some(why) => Err(Error::OutputLost {
            stream: Stream::Out.label(),
            reason: why.to_string(),
        }),
        None => Ok(()),
    }
}

/// `println!` that never panics: see [`line`](fn@line).
#[macro_export]
macro_rules! outln {
    ($($arg:tt)*) => {
        $crate::console_line!(Out, $($arg)*)
    };
}

/// `eprintln!` that never panics: see [`line`](fn@line).
#[macro_export]
macro_rules! errln {
    ($($arg:tt)*) => {
        $crate::console_line!(Err, $($arg)*)
    };
}

/// The body of [`outln!`] and [`errln!`]: an empty or a formatted line to a [`Stream`].
#[doc(hidden)]
#[macro_export]
macro_rules! console_line {
    ($stream:ident,) => {
        $crate::console::line($crate::console::Stream::$stream, format_args!(""))
    };
    ($stream:ident, $($arg:tt)*) => {
        $crate::console::line($crate::console::Stream::$stream, format_args!($($arg)*))
    };
}
