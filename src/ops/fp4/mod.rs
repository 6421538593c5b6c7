//! The FP4 family: E2M1 scalars and the Engram requantisation E4M3 → E2M1 (`engram`), the
//! lossless MXFP4 → NVFP4 transcode (`nvfp4`), NVFP4/MXFP4 decoding for `dequant` (`dequant`),
//! and the `repack-fp4` planning step that binds
//! both to a checkpoint (`repack`); `kernel` holds what their CUDA kernels share with the CPU.

pub mod dequant;
pub mod engram;
pub use crate::plan::kernel::fp4 as kernel;
pub mod nvfp4;
pub mod repack;
