//! One job: the sources (a checkpoint, and what its steps attach: adapters), the plan's steps,
//! a sink (safetensors or GGUF) and the output policy (one run, `--part K/N`, `--resume`,
//! checksums, report, progress). Every writing command, and every library [`crate::Pipeline`],
//! only builds a [`Job`]; [`Job::execute`] plans it from headers, streams it through the shared
//! pipeline and commits it under the policy. Parts, resume and checksums are properties of the
//! output, so every sink gets them.

mod describe;
mod gguf;
mod parts;
mod prepared;
mod report;
mod run;
mod stream;

pub(crate) use describe::*;
pub use parts::print_finalized;
pub(crate) use prepared::*;
pub(crate) use report::*;
pub(crate) use run::{output_names, print_any_plan, OutputSink};
pub use stream::{PlannedStream, Recycler, StreamJob, StreamedTensor};

use std::path::{Path, PathBuf};
use std::time::Instant;

use serde_json::{json, Value};

use crate::error::{Error, Result};
use crate::gpu::DeviceRequest;
use crate::output::parts::PartSpec;
use crate::output::{check_report_path, write_report};
use crate::pipeline::Cancel;
use crate::plan::Step;
use crate::progress::Mode as ProgressMode;
use crate::sink::gguf::GgufSinkOptions as GgufOptions;
use crate::size::{human, parse_size};
use crate::sys;

/// Resolved common options of every writing command.
pub struct WriteOptions {
    pub output: PathBuf,
    pub format: Format,
    pub dry_run: bool,
    pub threads: usize,
    /// `--io-threads`; `None`: chosen from the storage.
    pub io_threads: Option<usize>,
    pub memory_budget: u64,
    pub quiet: bool,
    /// Print nothing at all, not even the input's and the plan's warnings (the report keeps
    /// them): runs through the library API.
    pub silent: bool,
    pub progress: ProgressMode,
    /// Progress events go to this callback, and nothing about progress to stderr.
    pub on_progress: Option<crate::progress::Callback>,
    /// Seconds between progress lines when stderr is not a terminal.
    pub progress_interval: std::time::Duration,
    /// Informational notes on stderr (`-v`).
    pub verbose: bool,
    /// Write even when filters keep nothing or an op finds nothing to do.
    pub allow_empty: bool,
    pub report: Option<PathBuf>,
    pub force: bool,
    pub kernel_copy: bool,
    pub device: DeviceRequest,
    /// `--checksums`: write `SHA256SUMS` and `tftf-manifest.json` with the output; `None`
    /// when not given (on for parts and resumable runs, off otherwise).
    pub checksums: Option<bool>,
    /// `--part K/N`.
    pub part: Option<PartSpec>,
    pub resume: bool,
    pub finalize: bool,
    /// The command and its output-relevant arguments, canonical (for the run's fingerprint).
    pub arguments: String,
}

pub const MAX_DEFAULT_BUDGET_BYTES: u64 = 4 << 30;
pub const MIN_BUDGET_BYTES: u64 = 16 << 20;

pub fn default_budget() -> u64 {
    (sys::available_memory() / 4).clamp(64 << 20, MAX_DEFAULT_BUDGET_BYTES)
}

pub fn parse_budget(arg: Option<&str>) -> Result<u64> {
    match arg {
        None => Ok(default_budget()),
        Some(s) => {
            let b = parse_size(s)?;
            if b < MIN_BUDGET_BYTES {
                return Err(Error::Usage(format!(
                    "--memory-budget {s} is below the minimum of {}",
                    human(MIN_BUDGET_BYTES)
                )));
            }
            Ok(b)
        }
    }
}

/// The output format of a job.
#[derive(Debug, Clone)]
pub enum Format {
    /// Shards and their index in a directory, or one `.safetensors` file.
    Safetensors { max_shard_bytes: Option<u64> },
    /// A `.gguf` file, or its split files.
    Gguf(GgufOptions),
}

/// Runs one writing job and returns its report (the JSON `--report` writes).
/// A writing run, as a command or the library builds it; [`Job::execute`] runs it.
pub struct Job<'a> {
    /// What the run is called in reports and progress (`passthrough`, `gguf`, …).
    pub command: &'a str,
    /// The checkpoint it reads. A step that needs another source (a LoRA adapter, FSDP rank
    /// shards) attaches it to the opened checkpoint ([`crate::plan::PlanStep::attach`]), so
    /// every source is read within the one memory budget.
    pub source: &'a Path,
    /// The plan's steps, in order; the sink adds its own after them.
    pub steps: &'a [Step],
    /// The sink's format and the output policy.
    pub options: &'a WriteOptions,
}

impl Job<'_> {
    /// Plans, streams and commits the job; returns its report. On failure the output is left
    /// as it was and, with `--report`, an error report is written.
    pub fn execute(&self, cancel: &Cancel) -> Result<Value> {
        let started = Instant::now();
        let mut inputs = None;
        let result = run::run(self, cancel, started, &mut inputs);
        if let (Err(e), Some(path)) = (&result, &self.options.report) {
            let report = error_report(self.command, e, started);
            // Never onto an input or over a file that is not an earlier report, even to say
            // why the run was refused.
            if check_report_path(path, inputs.as_ref()).is_ok() {
                let _ = write_report(path, &report);
            }
        }
        result
    }
}

/// The report of a run that failed with `e`.
pub fn error_report(command: &str, e: &Error, started: Instant) -> Value {
    json!({
        "tftf_version": env!("CARGO_PKG_VERSION"),
        "command": command,
        "status": "error",
        "error": e.to_string(),
        "wall_seconds": started.elapsed().as_secs_f64(),
    })
}
