//! tftf: stream-convert huge LLM checkpoints (safetensors, PyTorch `.bin`, DCP in; safetensors,
//! GGUF out) with bounded memory.
//!
//! `format` parses input headers into placed tensors, `plan` decides which tensors the output
//! holds and how each is made, a `sink` lays them out in files, and `pipeline` then streams the
//! data through a reader, compute workers and a writer. See `shared/DESIGN.md` for the architecture.
//!
//! # Library API
//!
//! The [`api`] module drives the same engine as the command line, in upstream Python tftf's
//! terms: a [`Reader`], a [`Pipe`] of transformations composed with `|`, a [`Writer`], run by
//! a [`Pipeline`] that returns a [`Report`]. Runs print nothing; progress goes to a callback.
//!
//! ```
//! use tftf::{DType, Pipe, Pipeline, Reader, Writer};
//!
//! # let tmp = tempfile::tempdir()?;
//! # let (model, adapter, out) = (tmp.path().join("model"), tmp.path().join("adapter"), tmp.path().join("out"));
//! # tftf::commands::demo::make_example(&model)?;
//! # tftf::commands::demo::make_example_adapter(&adapter)?;
//! let report = Pipeline::new(
//!     Reader::from_path(&model),
//!     Pipe::fp8_dequant(DType::BF16) | Pipe::lora_merge(&adapter),
//!     Writer::sharded(&out).max_shard_size(100_000),
//! )
//! .threads(4)
//! .on_progress(|e| eprintln!("{}: {} of {} bytes", e.file, e.bytes_done, e.bytes_total))
//! .run()?;
//! assert!(report.ok(), "{}", report.summary());
//! # assert!(out.join("model.safetensors.index.json").exists());
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

#[macro_use]
pub mod console;
pub mod api;
pub mod cli;
pub mod commands;
pub mod entry;
pub mod error;
pub mod escape;
pub mod format;
pub mod gpu;
pub mod job;
pub mod lcg;
pub mod ops;
pub mod output;
pub mod pipeline;
pub mod plan;
pub mod progress;
pub mod signals;
pub mod sink;
pub mod size;
pub mod sys;
#[cfg(test)]
mod test_fixtures;
pub mod transform;

pub use api::{
    Cancel, DType, DeviceRequest, GgufFileType, Pipe, Pipeline, ProgressEvent, Reader, Report,
    Writer,
};
pub use error::{Error, Result};
pub use format::checkpoint::Checkpoint;
pub use plan::{Plan, Recipe, Step};
