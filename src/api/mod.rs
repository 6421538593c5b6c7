//! The library API: upstream Python tftf's `Pipeline(reader, pipe, writer).run()` in Rust.
//!
//! The command line is one way to drive the conversion engine; programs that convert
//! checkpoints as one step of a larger job (training, evaluation, packaging) want it as a
//! call, with progress and the report as values rather than text on stderr. This module is
//! that call, named as upstream's Python names it so its users recognise it: a [`Reader`]
//! (the input checkpoint), a [`Pipe`] (what happens to the tensors), a [`Writer`] (where they
//! go), put together in a [`Pipeline`] whose [`Pipeline::run`] returns a [`Report`].
//!
//! Nothing here reimplements the CLI: a pipeline runs through the same driver as every
//! writing command (`job::Job::execute`), and a pipe is built by the code that builds
//! `tftf run`'s sections, so a pipeline writes what `tftf run` with the same sections writes.
//! A library run prints nothing; progress goes to [`Pipeline::on_progress`]'s callback.
//!
//! # FP8 dequantisation and LoRA merge in one pass
//!
//! ```
//! use tftf::{DType, Pipe, Pipeline, Reader, Writer};
//!
//! # let tmp = tempfile::tempdir()?;
//! # std::env::set_current_dir(tmp.path())?;
//! # tftf::commands::demo::make_example("DeepSeek-V3".as_ref())?;
//! # tftf::commands::demo::make_example_adapter("my-lora".as_ref())?;
//! let pipe = Pipe::fp8_dequant(DType::BF16) | Pipe::lora_merge("./my-lora/adapter_model.safetensors");
//!
//! let report = Pipeline::new(
//!     Reader::from_path("./DeepSeek-V3/"),
//!     pipe,
//!     Writer::sharded("./DeepSeek-V3-bf16-merged/"),
//! )
//! .run()?;
//!
//! assert!(report.ok());
//! let out = tftf::Checkpoint::open("./DeepSeek-V3-bf16-merged/".as_ref())?;
//! assert!(out.tensors.iter().all(|t| t.info.dtype != DType::F8_E4M3));
//! assert!(out.get("model.layers.0.self_attn.q_proj.weight_scale_inv").is_none());
//! assert_eq!(out.get("model.layers.0.self_attn.q_proj.weight").unwrap().info.dtype, DType::BF16);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! # Dry-run validation
//!
//! [`Writer::null`] plans the whole run and writes nothing; the report says whether it would
//! succeed, and what would stop it.
//!
//! ```
//! use tftf::{DType, Pipe, Pipeline, Reader, Writer};
//!
//! # let tmp = tempfile::tempdir()?;
//! # let model = tmp.path().join("model");
//! # tftf::commands::demo::make_example(&model)?;
//! let report = Pipeline::new(
//!     Reader::from_path(&model),
//!     Pipe::fp8_dequant(DType::BF16),
//!     Writer::null(),
//! )
//! .run()?;
//!
//! println!("{}", report.summary());
//! assert!(report.ok());
//!
//! // A truncated shard is a problem the dry run reports, not an error it returns.
//! # let shard = model.join("model-00002-of-00002.safetensors");
//! # std::fs::OpenOptions::new().write(true).open(&shard)?.set_len(1000)?;
//! let report = Pipeline::new(
//!     Reader::from_path(&model),
//!     Pipe::fp8_dequant(DType::BF16),
//!     Writer::null(),
//! )
//! .run()?;
//! assert!(!report.ok());
//! assert!(report.problems()[0].contains("model-00002-of-00002.safetensors"));
//! assert!(report.summary().contains("FAILED"));
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! # LoRA merge with dtype cast
//!
//! ```
//! use tftf::{DType, Pipe, Pipeline, Reader, Writer};
//!
//! # let tmp = tempfile::tempdir()?;
//! # std::env::set_current_dir(tmp.path())?;
//! # let f32s = |n: usize| (0..n).flat_map(|i| (i as f32 / 64.0).to_le_bytes()).collect::<Vec<u8>>();
//! # let tensor = |name: &str, shape: [u64; 2]| (name.to_string(), DType::F32, shape.to_vec(), f32s((shape[0] * shape[1]) as usize));
//! # tftf::format::write_small("model.safetensors".as_ref(), &[tensor("m.proj.weight", [8, 8]), tensor("m.norm.weight", [1, 8])])?;
//! # tftf::format::write_small("adapter_model.safetensors".as_ref(), &[
//! #     tensor("base_model.model.m.proj.lora_A.weight", [2, 8]),
//! #     tensor("base_model.model.m.proj.lora_B.weight", [8, 2]),
//! # ])?;
//! # std::fs::write("adapter_config.json", r#"{"r": 2, "lora_alpha": 4}"#)?;
//! let pipe = Pipe::lora_merge("adapter_model.safetensors") | Pipe::dtype_cast(DType::F16);
//!
//! let report = Pipeline::new(
//!     Reader::from_path("model.safetensors"),
//!     pipe,
//!     Writer::file("merged.safetensors"),
//! )
//! .run()?;
//!
//! assert_eq!(report.json()["tensors"]["computed"], 2);
//! let out = tftf::Checkpoint::open("merged.safetensors".as_ref())?;
//! assert_eq!(out.tensors.len(), 2);
//! assert!(out.tensors.iter().all(|t| t.info.dtype == DType::F16));
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

/// Builder methods that each set one field and return the builder: a doc comment, then
/// `name(arg: Type) => field = value;` per method.
macro_rules! setters {
    ($($(#[$doc:meta])* $name:ident($arg:ident: $t:ty) => $field:ident = $value:expr;)*) => {
        $(
            $(#[$doc])*
            pub fn $name(mut self, $arg: $t) -> Self {
                self.$field = $value;
                self
            }
        )*
    };
}

mod pipe;
mod records;
mod report;
mod writer;

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

pub use crate::format::dtype::DType;
pub use crate::gpu::DeviceRequest;
pub use crate::pipeline::Cancel;
pub use crate::progress::Event as ProgressEvent;
pub use crate::sink::gguf::FileType as GgufFileType;
pub use pipe::Pipe;
pub use records::{Records, Recycler, StreamedTensor};
pub use report::Report;
pub use writer::Writer;

use crate::error::{Error, Result};
use crate::job::{self, Job, WriteOptions, MIN_BUDGET_BYTES};
use crate::progress::{Callback, Mode as ProgressMode, DEFAULT_INTERVAL_SECS};
use crate::size::human;

/// The command name library runs carry in their reports and progress.
const COMMAND: &str = "pipeline";

/// The input checkpoint, upstream's `ShardedSafetensorsReader.from_path` and
/// `SafetensorsReader`: a `.safetensors` file, a directory of shards (with or without an
/// index), PyTorch `.bin` files or a DCP checkpoint, whatever `tftf` reads.
#[derive(Debug, Clone)]
pub struct Reader {
    path: PathBuf,
}

impl Reader {
    /// The checkpoint at `path`; it is opened when the pipeline runs.
    pub fn from_path(path: impl Into<PathBuf>) -> Reader {
        Reader { path: path.into() }
    }

    /// Where the checkpoint is.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

/// A conversion: read a checkpoint, transform it with a [`Pipe`], write it with a [`Writer`].
///
/// The data streams through with bounded memory, every output file is written under a
/// temporary name and committed together at the end, and the run prints nothing.
///
/// ```
/// # use tftf::{Cancel, Pipe, Pipeline, Reader, Writer, DType};
/// # let tmp = tempfile::tempdir()?;
/// # let model = tmp.path().join("model");
/// # tftf::commands::demo::make_example(&model)?;
/// use std::sync::{Arc, Mutex};
///
/// let files = Arc::new(Mutex::new(std::collections::BTreeSet::new()));
/// let seen = files.clone();
/// let report = Pipeline::new(Reader::from_path(&model), Pipe::new(), Writer::sharded(tmp.path().join("copy")))
///     .threads(2)
///     .memory_budget(64 << 20)
///     .on_progress(move |e| {
///         assert!(e.bytes_done <= e.bytes_total);
///         seen.lock().unwrap().insert(e.file.to_string());
///     })
///     .run()?;
/// assert!(report.ok());
/// assert_eq!(files.lock().unwrap().len(), 2);
///
/// // A raised flag stops a run, from any thread.
/// let cancel = Cancel::default();
/// cancel.raise();
/// let run = Pipeline::new(Reader::from_path(&model), Pipe::new(), Writer::sharded(tmp.path().join("other")))
///     .cancel(cancel)
///     .run();
/// assert!(matches!(run, Err(tftf::Error::Cancelled)));
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub struct Pipeline {
    reader: Reader,
    pipe: Pipe,
    writer: Writer,
    threads: Option<usize>,
    memory_budget: Option<u64>,
    device: DeviceRequest,
    on_progress: Option<Callback>,
    cancel: Cancel,
}

impl Pipeline {
    /// A pipeline from `reader` through `pipe` into `writer`, with the command line's
    /// defaults: all cores, a quarter of the free memory (at most 4 GiB), `--device auto`.
    pub fn new(reader: Reader, pipe: Pipe, writer: Writer) -> Pipeline {
        Pipeline {
            reader,
            pipe,
            writer,
            threads: None,
            memory_budget: None,
            device: DeviceRequest::Auto,
            on_progress: None,
            cancel: Cancel::default(),
        }
    }

    setters! {
        /// Compute threads (`--threads`); at least 1.
        threads(n: usize) => threads = Some(n);
        /// Memory for tensor data in flight (`--memory-budget`); at least 16 MiB.
        memory_budget(bytes: u64) => memory_budget = Some(bytes);
        /// Where ops compute (`--device`): [`DeviceRequest::Auto`] uses a CUDA GPU when there
        /// is one and an op has a kernel for it.
        device(device: DeviceRequest) => device = device;
        /// Stops the run when `flag` is raised (from any thread): [`Pipeline::run`] then
        /// returns [`Error::Cancelled`] and the output is left as it was.
        cancel(flag: Cancel) => cancel = flag;
    }

    /// Calls `callback` as output bytes are written, from the writer threads: bytes done,
    /// bytes in all, and the file the latest bytes went to.
    pub fn on_progress(
        mut self,
        callback: impl Fn(&ProgressEvent) + Send + Sync + 'static,
    ) -> Pipeline {
        self.on_progress = Some(Arc::new(callback));
        self
    }

    /// Runs the conversion and returns its report.
    ///
    /// Errors are the command line's: an unreadable input, a pipe that cannot apply, an
    /// existing output without [`Writer::force`], no space, a cancelled run. A dry run
    /// ([`Writer::null`]) lists them in its report instead, except cancellation.
    pub fn run(&self) -> Result<Report> {
        let started = Instant::now();
        let result = self.write_options().and_then(|opts| {
            let steps = self.pipe.steps()?;
            if self.writer.is_gguf() {
                self.pipe.refuse_quantised_for_gguf()?;
            }
            Job {
                command: COMMAND,
                source: self.reader.path(),
                steps: &steps,
                options: &opts,
            }
            .execute(&self.cancel)
        });
        match result {
            Ok(json) => Ok(Report::new(json)),
            Err(e) if self.writer.is_null() && !matches!(e, Error::Cancelled) => {
                Ok(Report::new(job::error_report(COMMAND, &e, started)))
            }
            Err(e) => Err(e),
        }
    }

    /// Runs the reader and the pipe and hands out the resulting tensors one at a time, in the
    /// order a writer would get them, instead of writing them: for a program that consumes
    /// tensors itself (the Python package's pipelines with pipes of their own). The writer is
    /// not used. Planning errors are returned here, before any data moves; errors while
    /// streaming come out of the iterator. Dropping the [`Records`] stops the stream.
    pub fn records(&self) -> Result<Records> {
        let (threads, memory_budget) = self.resources()?;
        let steps = self.pipe.steps()?;
        let planned = job::StreamJob {
            source: self.reader.path(),
            steps: &steps,
            memory_budget,
            device: &self.device,
            allow_empty: false,
        }
        .plan()?;
        Ok(Records::start(planned, threads, self.cancel.clone()))
    }

    /// Compute threads and memory budget, checked, with the command line's defaults.
    fn resources(&self) -> Result<(usize, u64)> {
        let threads = match self.threads {
            Some(0) => return Err(Error::Usage("threads must be at least 1".into())),
            Some(n) => n,
            None => std::thread::available_parallelism().map_or(1, |n| n.get()),
        };
        let memory_budget = match self.memory_budget {
            Some(b) if b < MIN_BUDGET_BYTES => {
                return Err(Error::Usage(format!(
                    "memory budget {} is below the minimum of {}",
                    human(b),
                    human(MIN_BUDGET_BYTES)
                )))
            }
            Some(b) => b,
            None => job::default_budget(),
        };
        Ok((threads, memory_budget))
    }

    /// The driver's options: the writer's target, these settings, and silence.
    fn write_options(&self) -> Result<WriteOptions> {
        let (output, format) = self.writer.target()?;
        let (threads, memory_budget) = self.resources()?;
        Ok(WriteOptions {
            output,
            format,
            dry_run: self.writer.is_null(),
            threads,
            io_threads: None,
            memory_budget,
            quiet: true,
            silent: true,
            progress: ProgressMode::Off,
            on_progress: self.on_progress.clone(),
            progress_interval: std::time::Duration::from_secs_f64(DEFAULT_INTERVAL_SECS),
            verbose: false,
            allow_empty: false,
            report: None,
            force: self.writer.forces(),
            kernel_copy: true,
            device: self.device.clone(),
            checksums: None,
            part: None,
            resume: false,
            finalize: false,
            arguments: String::new(),
        })
    }
}
