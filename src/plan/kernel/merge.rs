//! The elementwise merge kernel's parameter block (kernels/merge.cuh).

/// Inputs one launch takes; a merge of more models runs on the CPU.
pub const MERGE_MAX_INPUTS: usize = 16;

/// `MERGE_LINEAR` of kernels/merge.cuh: `Σ w_k x_k / denominator`.
pub const MERGE_LINEAR: i32 = 0;
/// `MERGE_TASK`: `x_0 + scale · Σ_{k≥1} w_k (x_k − x_0)`.
pub const MERGE_TASK: i32 = 1;
/// `MERGE_SLERP`: a surveyed slerp's blend `ca · x_0 + cb · x_1`, in f32 out.
pub const MERGE_SLERP: i32 = 2;
/// `MERGE_NUSLERP`: a surveyed nuslerp's blend `back + ca (a − back) + cb (b − back)`.
pub const MERGE_NUSLERP: i32 = 3;
/// `MERGE_MULTISLERP`: a surveyed multislerp's exponential map, per element.
pub const MERGE_MULTISLERP: i32 = 4;
/// `MERGE_MODEL_STOCK`: `t · mean(models) + (1 − t) · base`.
pub const MERGE_MODEL_STOCK: i32 = 5;
/// `MERGE_KARCHER`: `Σ c_i · model_i` over the kept models.
pub const MERGE_KARCHER: i32 = 6;
/// `MERGE_NEARSWAP`: nearswap's per-element interpolation towards the model.
pub const MERGE_NEARSWAP: i32 = 7;
/// `MERGE_RAM`: ram's (ramplus_tl's) rescaled task vectors.
pub const MERGE_RAM: i32 = 8;

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
    /// `MERGE_NUSLERP`, `MERGE_MULTISLERP`: input 0 is the base.
    pub has_base: i32,
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
    /// `MERGE_SLERP`/`MERGE_NUSLERP`: the `(ca, cb)` pairs of [`MergeLaunch::coefs`]; element
    /// `i` of a chunk takes pair `i mod inner` (chunks start at multiples of it).
    /// `MERGE_KARCHER`: the `(model, coefficient)` pairs.
    pub inner: u64,
}

/// One chunk of a merge: the parameters and, for a surveyed blend, its coefficient pairs.
#[derive(Clone, Debug, PartialEq)]
pub struct MergeLaunch {
    pub params: MergeParams,
    pub coefs: Vec<f64>,
}
