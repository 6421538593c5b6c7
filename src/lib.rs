//! tftf: stream-convert huge LLM checkpoints (safetensors, PyTorch `.bin`, DCP in; safetensors,
//! GGUF out) with bounded memory.
//!
//! `format` parses input headers into placed tensors, `plan` decides which tensors the output
//! holds and how each is made, a `sink` lays them out in files, and `pipeline` then streams the
//! data through a reader, compute workers and a writer. See `shared/DESIGN.md` for the architecture.

pub mod cli;
pub mod commands;
pub mod error;
pub mod escape;
pub mod format;
pub mod gpu;
pub mod ops;
pub mod output;
pub mod pipeline;
pub mod plan;
pub mod progress;
pub mod sink;
pub mod size;
pub mod sys;
#[cfg(test)]
mod test_fixtures;
pub mod transform;

pub use error::{Error, Result};
pub use format::checkpoint::Checkpoint;
pub use plan::{Plan, Recipe, Step};
