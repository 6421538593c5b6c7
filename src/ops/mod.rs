//! Tensor operations. An op owns everything specific to it — which inputs it reads, how its
//! output splits into independent units, and its CPU implementation — so adding one never
//! touches the reader or the writer.
//!
//! Units are the op's natural rows: elements for a cast, 128-row blocks for block-scaled FP8,
//! and so on. The reader hands an op any contiguous run of whole units (a multiple of
//! [`Op::granularity`], except at the end) and the op must produce the same bytes however the
//! tensor is cut, which is what keeps output independent of chunk size and thread count.

pub mod cast;
pub mod constant;
pub mod dequant;
pub mod feed;
pub mod fp4;
pub mod fp8;
pub mod gguf;
pub mod int;
pub mod lora;
pub mod merge;
pub mod quantize;
pub(crate) mod simd;

pub use crate::plan::kernel;
pub use crate::plan::Op;
