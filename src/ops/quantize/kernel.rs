//! The quantisers' kernel parameter block (kernels/quantize.cuh): one chunk of whole rows of a
//! weight, or of whole 128-row block rows for FP8_BLOCK.

use super::encode::WeightType;
use super::ops::BlockMath;
use super::Scheme;
use crate::ops::kernel::kernel_dtype;

/// `QuantParams` of kernels/quantize.cuh.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct QuantParams {
    /// Rows in the chunk.
    pub rows: u64,
    pub cols: u64,
    /// `QuantScheme`: see [`scheme_code`].
    pub scheme: i32,
    /// The weight dtype's kernel code (BF16, F16 or F32).
    pub wt: i32,
    /// NVFP4's tensor scale (1 for other schemes).
    pub global: f32,
    /// FP8_BLOCK: 0 compressed-tensors, 1 transformers.
    pub block_math: i32,
}

/// `QuantScheme` of kernels/quantize.cuh.
pub fn scheme_code(s: Scheme) -> i32 {
    match s {
        Scheme::Fp8Dynamic => 0,
        Scheme::W8A16 => 1,
        Scheme::W4A16 => 2,
        Scheme::Nvfp4A16 => 3,
        Scheme::Mxfp4A16 => 4,
        Scheme::Mxfp8A16 => 5,
        Scheme::Fp8Block => 6,
    }
}

impl QuantParams {
    /// The parameters of a chunk of `rows` rows of a `cols`-column weight.
    pub fn new(
        scheme: Scheme,
        rows: u64,
        cols: u64,
        wt: WeightType,
        global: f32,
        block: BlockMath,
    ) -> QuantParams {
        QuantParams {
            rows,
            cols,
            scheme: scheme_code(scheme),
            wt: kernel_dtype(wt.dtype()),
            global,
            block_math: match block {
                BlockMath::CompressedTensors => 0,
                BlockMath::Transformers => 1,
            },
        }
    }

    /// Whether this is FP8_BLOCK (scales per 128×128 block).
    pub fn is_fp8_block(&self) -> bool {
        self.scheme == scheme_code(Scheme::Fp8Block)
    }

    /// Whether this is FP8_DYNAMIC (a scale per row).
    pub fn is_fp8_rows(&self) -> bool {
        self.scheme == scheme_code(Scheme::Fp8Dynamic)
    }

    /// Elements per group of a grouped scheme (one thread each).
    pub fn group(&self) -> u64 {
        match self.scheme {
            1 | 2 => 128, // W8A16, W4A16
            3 => 16,      // NVFP4A16
            _ => 32,      // MXFP4A16, MXFP8A16
        }
    }
}
