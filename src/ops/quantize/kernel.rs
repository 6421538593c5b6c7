//! The quantisers' kernel parameter block (kernels/quantize.cuh), built from a scheme: one chunk
//! of whole rows of a weight, of whole 128-row block rows for FP8_BLOCK, of whole row pairs for
//! ModelOpt W4A16. The block itself is declared with the other kernel descriptions (under the
//! plan, which holds ops); what ties it to [`Scheme`] and the weight types stays here.

use super::encode::{BlockMath, WeightType};
use super::Scheme;
use crate::plan::kernel::kernel_dtype;
pub use crate::plan::kernel::quantize::QuantParams;

const MODELOPT: i32 = 2;

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
            flavour: match block {
                BlockMath::CompressedTensors => 0,
                BlockMath::Transformers => 1,
            },
        }
    }

    /// ModelOpt's arithmetic and layout (`ModeloptRows`); `scale_2` is NVFP4's `weight_scale_2`.
    pub fn modelopt(scheme: Scheme, rows: u64, cols: u64, wt: WeightType, scale_2: f32) -> Self {
        QuantParams {
            rows,
            cols,
            scheme: scheme_code(scheme),
            wt: kernel_dtype(wt.dtype()),
            global: scale_2,
            flavour: MODELOPT,
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

    /// Bytes of one weight element (BF16/F16 2, F32 4).
    pub fn weight_bytes(&self) -> u64 {
        if self.wt == kernel_dtype(crate::format::dtype::DType::F32) {
            4
        } else {
            2
        }
    }

    /// Elements per group of a grouped scheme.
    pub fn group(&self) -> u64 {
        match self.scheme {
            1 | 2 => 128, // W8A16, W4A16
            3 => 16,      // NVFP4A16
            _ => 32,      // MXFP4A16, MXFP8A16
        }
    }

    /// Threads of a grouped scheme (`quant_group_threads`): one per group of a row, or of a
    /// row pair for ModelOpt W4A16, whose rows share packed bytes.
    pub fn group_threads(&self) -> u64 {
        let per_row = self.cols / self.group();
        if self.flavour == MODELOPT && self.scheme == scheme_code(Scheme::W4A16) {
            self.rows / 2 * per_row
        } else {
            self.rows * per_row
        }
    }
}
