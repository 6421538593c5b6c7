//! The quantisers' parameter block (kernels/quantize.cuh), as plain data; the quantisers build
//! it from their scheme and weight type.

/// `QuantParams` of kernels/quantize.cuh.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct QuantParams {
    /// Rows in the chunk.
    pub rows: u64,
    pub cols: u64,
    /// `QuantScheme`: the scheme's code (`scheme_code` beside the quantisers).
    pub scheme: i32,
    /// The weight dtype's kernel code (BF16, F16 or F32).
    pub wt: i32,
    /// NVFP4's tensor scale (compressed-tensors) or `weight_scale_2` (ModelOpt); 1 for other
    /// schemes.
    pub global: f32,
    /// `QuantFlavour`: 0 compressed-tensors, 1 transformers (FP8_BLOCK), 2 ModelOpt.
    pub flavour: i32,
}
