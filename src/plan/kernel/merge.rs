//! The elementwise merge kernel's parameter block (kernels/merge.cuh).

/// Inputs one launch takes; a merge of more models runs on the CPU.
pub const MERGE_MAX_INPUTS: usize = 16;

/// `MERGE_LINEAR` of kernels/merge.cuh: `Σ w_k x_k / denominator`.
pub const MERGE_LINEAR: i32 = 0;
/// `MERGE_TASK`: `x_0 + scale · Σ_{k≥1} w_k (x_k − x_0)`.
pub const MERGE_TASK: i32 = 1;

/// `MergeParams` of kernels/merge.cuh. The inputs are joined into one buffer, input `k` at
/// byte `offsets[k]`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct MergeParams {
    pub method: i32,
    /// Inputs (task arithmetic: the base first).
    pub n: i32,
    /// `TftfDtype` of the output.
    pub dst: i32,
    pub pad: i32,
    /// `TftfDtype` of each input.
    pub dtypes: [i32; MERGE_MAX_INPUTS],
    /// `TftfDtype` each input is rounded to before merging (mergekit's `dtype`), or `DT_NONE`.
    pub round: [i32; MERGE_MAX_INPUTS],
    /// Byte offset of each input in the joined buffer (set by the GPU backend).
    pub offsets: [u64; MERGE_MAX_INPUTS],
    /// Linear: input `k`'s weight; task arithmetic: model `k`'s (`k ≥ 1`).
    pub weights: [f64; MERGE_MAX_INPUTS],
    pub denominator: f64,
    pub scale: f64,
}
