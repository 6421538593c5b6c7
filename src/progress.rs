//! Progress on stderr, in the form the place it goes can use.
//!
//! On a terminal: an indicatif bar naming the op and the shard being written, laid out to fit
//! 80 columns. Anywhere else (Slurm and CI logs, `nohup`): a bar would be one endless line of
//! carriage returns, so one plain line is printed at the start and then a ticker thread prints
//! one every `--progress-interval` seconds (default 30) — op, shard, bytes done of total, rate
//! and ETA:
//!
//! ```text
//! progress: dequant-fp8 model-00002-of-00005.safetensors: 1.50 GiB of 6.00 GiB (25%), 312.40 MiB/s, ETA 15s
//! ```
//!
//! With `--progress json` (for build systems): one JSON object per line on stderr, on the same
//! ticks, plus one when each output file's bytes are all written and one at the end, then the
//! run's report as the last line. The schema is versioned by its `tftf_progress` field and
//! documented in the README; fields are only ever added.
//!
//! A library caller gets the same figures as [`Event`]s passed to its own [`Callback`]
//! ([`Progress::with_callback`]) instead, and nothing is printed.
//!
//! Lines stop when the run finishes or when the last handle is dropped (a failed run), so no
//! line follows the error message.

use std::io::IsTerminal;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use crossbeam_channel::{bounded, RecvTimeoutError, Sender};

use crate::error::{Error, Result};
use crate::size::human;

/// Seconds between plain progress lines when stderr is not a terminal.
pub const DEFAULT_INTERVAL_SECS: f64 = 30.0;
/// The width the bar is laid out for.
const BAR_COLUMNS: usize = 80;
/// Columns of the bar line besides its message at their widest: bar, percentage, bytes done
/// (`1023.99 MiB`), rate (`1023.99 MiB/s`) and ETA (`HH:MM:SS`), with spaces.
const BAR_FIXED_COLUMNS: usize = 1 + 9 + 1 + 4 + 1 + 11 + 1 + 13 + 5 + 8;
const BAR_TEMPLATE: &str =
    "{msg} {bar:9} {percent:>3}% {bytes:>11} {binary_bytes_per_sec:>13} ETA {eta_precise}";

/// Parses `--progress-interval SECS`: a positive number of seconds, fractions allowed.
pub fn parse_interval(arg: Option<&str>) -> Result<Duration> {
    let Some(s) = arg else {
        return Ok(Duration::from_secs_f64(DEFAULT_INTERVAL_SECS));
    };
    match s.trim().parse::<f64>() {
        Ok(v) if v.is_finite() && v > 0.0 && v < 1e9 => Ok(Duration::from_secs_f64(v)),
        _ => Err(Error::Usage(format!(
            "--progress-interval `{s}`: give a positive number of seconds, e.g. 30 or 0.5"
        ))),
    }
}

/// The version of the `--progress json` line schema.
pub const JSON_SCHEMA_VERSION: u32 = 1;

/// `--progress`: how progress is shown.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    /// A bar on a terminal, plain lines elsewhere; off with `-q`.
    Auto,
    /// Plain lines even on a terminal.
    Plain,
    /// JSON lines (also with `-q`).
    Json,
    Off,
}

/// Parses `--progress MODE` with `--no-progress` and `-q`: an explicit `plain` or `json` wins
/// over `-q`, which only silences the default.
pub fn parse_mode(arg: Option<&str>, no_progress: bool, quiet: bool) -> Result<Mode> {
    let mode = match arg {
        None | Some("auto") => Mode::Auto,
        Some("plain") => Mode::Plain,
        Some("json") => Mode::Json,
        Some("none" | "off") => Mode::Off,
        Some(other) => {
            return Err(Error::Usage(format!(
                "--progress `{other}`: use auto, plain, json or none"
            )))
        }
    };
    Ok(match mode {
        _ if no_progress => Mode::Off,
        Mode::Auto if quiet => Mode::Off,
        m => m,
    })
}

/// One step of a run's progress, as a [`Callback`] receives it.
#[derive(Debug, Clone, Copy)]
pub struct Event<'a> {
    /// Bytes of tensor data written so far.
    pub bytes_done: u64,
    /// Bytes of tensor data the run writes in all.
    pub bytes_total: u64,
    /// The output file the latest bytes went to.
    pub file: &'a str,
}

/// Receives a run's progress [`Event`]s, from the writer threads (so possibly from several at
/// once).
pub type Callback = Arc<dyn Fn(&Event) + Send + Sync>;

/// A handle on one run's progress; clones share it.
#[derive(Clone)]
/// The `usize` is added to the file indices given to [`Progress::advance`], for a pipeline
/// that writes a slice of the files.
pub struct Progress(Arc<Inner>, usize);

struct Inner {
    op: String,
    /// Names of the files being written (or read), by index.
    shards: Vec<String>,
    total: u64,
    done: AtomicU64,
    shard: AtomicUsize,
    started: Instant,
    finished: AtomicBool,
    /// Held while a line is printed, so no tick lands after the last line.
    printing: std::sync::Mutex<()>,
    json: bool,
    /// Bytes each file receives, and how many it has so far (JSON mode's per-file events).
    shard_bytes: Vec<u64>,
    shard_done: Vec<AtomicU64>,
    shard_reported: Vec<AtomicBool>,
    bar: Option<indicatif::ProgressBar>,
    /// The library caller's callback, which gets every advance instead of lines.
    callback: Option<Callback>,
    /// Dropping it (with the last handle) stops the ticker.
    _stop: Option<Sender<()>>,
}

impl Inner {
    /// Progress that shows nothing yet: no bar, no ticker, no callback.
    fn new(op: &str, shards: Vec<String>, shard_bytes: Vec<u64>, total: u64) -> Inner {
        Inner {
            op: op.into(),
            shards,
            total,
            done: AtomicU64::new(0),
            shard: AtomicUsize::new(0),
            started: Instant::now(),
            finished: AtomicBool::new(false),
            printing: std::sync::Mutex::new(()),
            json: false,
            shard_done: shard_bytes.iter().map(|_| AtomicU64::new(0)).collect(),
            shard_reported: shard_bytes.iter().map(|_| AtomicBool::new(false)).collect(),
            shard_bytes,
            bar: None,
            callback: None,
            _stop: None,
        }
    }
}

impl Progress {
    /// Progress of `op` over files `shards` receiving `shard_bytes` bytes each (`total` in
    /// all). `Mode::Auto`: a bar when stderr is a terminal, else plain lines every `interval`.
    pub fn new(
        op: &str,
        shards: Vec<String>,
        shard_bytes: Vec<u64>,
        total: u64,
        interval: Duration,
        mode: Mode,
    ) -> Progress {
        let json = mode == Mode::Json;
        let terminal = mode == Mode::Auto && std::io::stderr().is_terminal();
        let bar = terminal.then(|| {
            let bar = indicatif::ProgressBar::with_draw_target(
                Some(total),
                indicatif::ProgressDrawTarget::stderr(),
            );
            bar.set_style(
                indicatif::ProgressStyle::with_template(BAR_TEMPLATE).expect("valid template"),
            );
            bar
        });
        let (stop, stopped) = bounded::<()>(0);
        let p = Progress(
            Arc::new(Inner {
                json,
                bar,
                _stop: (!terminal).then_some(stop),
                ..Inner::new(op, shards, shard_bytes, total)
            }),
            0,
        );
        if let Some(bar) = &p.0.bar {
            bar.set_message(p.bar_message());
            return p;
        }
        // A first line at once: the log shows the run started and how much it has to do.
        p.emit("start");
        let weak: Weak<Inner> = Arc::downgrade(&p.0);
        // Progress is advisory: a ticker thread that cannot start leaves only the first line,
        // and the run itself reports the shortage when its own threads cannot start.
        let _ = std::thread::Builder::new().spawn(move || {
            while let Err(RecvTimeoutError::Timeout) = stopped.recv_timeout(interval) {
                let Some(inner) = weak.upgrade() else { break };
                let p = Progress(inner, 0);
                let _printing = p.0.printing.lock().unwrap_or_else(|e| e.into_inner());
                if p.0.finished.load(Ordering::Relaxed) {
                    break;
                }
                p.print("tick");
            }
        });
        p
    }

    /// Progress of `op` over files `shards` (as for [`Progress::new`]) that prints nothing and
    /// passes every advance to `callback`.
    pub fn with_callback(
        op: &str,
        shards: Vec<String>,
        shard_bytes: Vec<u64>,
        total: u64,
        callback: Callback,
    ) -> Progress {
        let inner = Inner {
            callback: Some(callback),
            ..Inner::new(op, shards, shard_bytes, total)
        };
        Progress(Arc::new(inner), 0)
    }

    /// `n` more bytes done, in shard `shard`.
    pub fn advance(&self, shard: usize, n: u64) {
        let shard = shard + self.1;
        let i = &self.0;
        let done = i.done.fetch_add(n, Ordering::Relaxed) + n;
        if let Some(callback) = &i.callback {
            callback(&Event {
                bytes_done: done.min(i.total),
                bytes_total: i.total,
                file: i.shards.get(shard).map_or("", String::as_str),
            });
        }
        let previous = i.shard.swap(shard, Ordering::Relaxed);
        if i.json {
            if let (Some(done), Some(&want)) = (i.shard_done.get(shard), i.shard_bytes.get(shard)) {
                if done.fetch_add(n, Ordering::Relaxed) + n >= want {
                    self.shard_written(shard);
                }
            }
        }
        if let Some(bar) = &i.bar {
            if previous != shard {
                bar.set_message(self.bar_message());
            }
            bar.inc(n);
        }
    }

    /// The same progress for a pipeline whose file `k` is this one's file `first + k`.
    pub fn from_file(&self, first: usize) -> Progress {
        Progress(self.0.clone(), first)
    }

    /// Stops the lines and clears the bar; in JSON mode, says every file is written.
    pub fn finish(&self) {
        let i = &self.0;
        {
            let _printing = i.printing.lock().unwrap_or_else(|e| e.into_inner());
            if i.finished.swap(true, Ordering::Relaxed) {
                return;
            }
        }
        if let Some(bar) = &i.bar {
            bar.finish_and_clear();
        }
        if i.json {
            // Files with nothing to write (an empty shard) are written too.
            for k in 0..i.shard_bytes.len() {
                self.shard_written(k);
            }
            self.emit("finish");
        }
    }

    /// The once-per-file `shard_written` event.
    fn shard_written(&self, k: usize) {
        let i = &self.0;
        if i.shard_reported
            .get(k)
            .is_some_and(|r| !r.swap(true, Ordering::Relaxed))
        {
            i.shard.store(k, Ordering::Relaxed);
            self.emit("shard_written");
        }
    }

    /// Prints one progress line (plain or JSON) for `event`.
    fn emit(&self, event: &str) {
        let _printing = self.0.printing.lock().unwrap_or_else(|e| e.into_inner());
        self.print(event);
    }

    fn print(&self, event: &str) {
        if self.0.json {
            errln!("{}", self.json_line(event));
        } else {
            errln!("{}", self.line());
        }
    }

    /// One `--progress json` line: every figure a build system needs, units in the names.
    pub fn json_line(&self, event: &str) -> serde_json::Value {
        let i = &self.0;
        let done = i.done.load(Ordering::Relaxed).min(i.total);
        let secs = i.started.elapsed().as_secs_f64();
        let rate = if secs > 0.0 { done as f64 / secs } else { 0.0 };
        let eta = if done >= i.total {
            Some(0.0)
        } else if rate >= 1.0 {
            Some(((i.total - done) as f64 / rate).ceil())
        } else {
            None
        };
        let k = i.shard.load(Ordering::Relaxed);
        let phase = match event {
            "start" => "start",
            "finish" => "done",
            _ => "write",
        };
        serde_json::json!({
            "tftf_progress": JSON_SCHEMA_VERSION,
            "event": event,
            "phase": phase,
            "op": i.op,
            "shard": i.shards.get(k),
            "shard_index": k,
            "shards": i.shards.len(),
            "shard_bytes_done": i.shard_done.get(k).map(|d| d.load(Ordering::Relaxed)),
            "shard_bytes_total": i.shard_bytes.get(k),
            "bytes_done": done,
            "bytes_total": i.total,
            "elapsed_seconds": secs,
            "rate_bytes_per_second": rate,
            "eta_seconds": eta,
        })
    }

    fn shard_name(&self) -> &str {
        let i = &self.0;
        i.shards
            .get(i.shard.load(Ordering::Relaxed))
            .map_or("", String::as_str)
    }

    /// The plain line printed when stderr is not a terminal.
    pub fn line(&self) -> String {
        let i = &self.0;
        let done = i.done.load(Ordering::Relaxed).min(i.total);
        let secs = i.started.elapsed().as_secs_f64();
        format_line(&i.op, self.shard_name(), done, i.total, secs)
    }

    fn bar_message(&self) -> String {
        bar_message(
            &self.0.op,
            self.shard_name(),
            BAR_COLUMNS - BAR_FIXED_COLUMNS,
        )
    }
}

/// The `--progress json` line that carries the run's report, the last one of a run.
pub fn report_line(op: &str, report: &serde_json::Value) -> serde_json::Value {
    serde_json::json!({
        "tftf_progress": JSON_SCHEMA_VERSION,
        "event": "report",
        "op": op,
        "report": report,
    })
}

/// `progress: OP SHARD: DONE of TOTAL (P%), RATE/s, ETA T`.
pub fn format_line(op: &str, shard: &str, done: u64, total: u64, secs: f64) -> String {
    let rate = if secs > 0.0 { done as f64 / secs } else { 0.0 };
    let pct = (done * 100).checked_div(total).unwrap_or(100);
    let eta = if done >= total {
        "0s".to_string()
    } else if rate >= 1.0 {
        duration_text(((total - done) as f64 / rate).ceil() as u64)
    } else {
        "unknown".to_string()
    };
    let place = if shard.is_empty() {
        String::new()
    } else {
        format!(" {}", crate::escape::name(shard))
    };
    format!(
        "progress: {op}{place}: {} of {} ({pct}%), {}/s, ETA {eta}",
        human(done),
        human(total),
        human(rate as u64)
    )
}

/// `45s`, `3m05s`, `2h07m`.
fn duration_text(secs: u64) -> String {
    match secs {
        0..60 => format!("{secs}s"),
        60..3600 => format!("{}m{:02}s", secs / 60, secs % 60),
        _ => format!("{}h{:02}m", secs / 3600, secs % 3600 / 60),
    }
}

/// `OP SHARD` in exactly `width` columns: the shard loses `.safetensors`, then if need be a
/// leading `model-`, then its head.
fn bar_message(op: &str, shard: &str, width: usize) -> String {
    let shard = crate::escape::name(shard);
    let mut shard = shard.strip_suffix(".safetensors").unwrap_or(&shard);
    let room = width.saturating_sub(op.chars().count() + 1);
    if shard.chars().count() > room {
        shard = shard.strip_prefix("model-").unwrap_or(shard);
    }
    let n = shard.chars().count();
    let shown: String = if n <= room {
        shard.to_string()
    } else if room == 0 {
        String::new()
    } else {
        let tail: String = shard.chars().skip(n - (room - 1)).collect();
        format!("…{tail}")
    };
    let msg = format!("{op} {shown}");
    format!("{:<width$}", msg.chars().take(width).collect::<String>())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plain_line_names_op_shard_bytes_rate_and_eta() {
        assert_eq!(
            format_line("passthrough", "model-00001-of-00002.safetensors", 1 << 30, 4 << 30, 2.0),
            "progress: passthrough model-00001-of-00002.safetensors: 1.00 GiB of 4.00 GiB (25%), 512.00 MiB/s, ETA 6s"
        );
        assert_eq!(
            format_line("validate", "", 0, 100, 0.0),
            "progress: validate: 0 B of 100 B (0%), 0 B/s, ETA unknown"
        );
        assert_eq!(duration_text(185), "3m05s");
        assert_eq!(duration_text(7620), "2h07m");
    }

    #[test]
    fn bar_fits_eighty_columns() {
        let width = BAR_COLUMNS - BAR_FIXED_COLUMNS;
        let m = bar_message("dequant-fp8", "model-00001-of-00005.safetensors", width);
        assert_eq!(m, "dequant-fp8 00001-of-00005");
        assert_eq!(m.chars().count(), width);
        let m = bar_message("passthrough", "model.safetensors", width);
        assert_eq!(m.trim_end(), "passthrough model");
        assert_eq!(m.chars().count(), width);
        assert_eq!(width, 26);
        let m = bar_message("merge-fsdp-lora", "model-00001-of-00005.safetensors", width);
        assert_eq!(m, "merge-fsdp-lora …-of-00005");
    }

    #[test]
    fn interval_takes_fractions_and_refuses_nonsense() {
        assert_eq!(
            parse_interval(Some("0.05")).unwrap(),
            Duration::from_millis(50)
        );
        assert_eq!(parse_interval(None).unwrap(), Duration::from_secs(30));
        for bad in ["0", "-1", "soon", "inf", "NaN"] {
            assert!(
                matches!(parse_interval(Some(bad)), Err(Error::Usage(_))),
                "{bad}"
            );
        }
    }
}
