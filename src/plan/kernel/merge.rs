//! The elementwise merge kernel's parameter block (kernels/merge.cuh).

/// Inputs one launch takes; a merge of more models runs on the CPU.
pub const MERGE_MAX_INPUTS: usize = 16;

/// `MergeMethod` of kernels/merge.cuh: the formula of [`MergeParams::method`].
#[repr(i32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MergeMethod {
    /// `Σ w_k x_k / denominator`.
    Linear = 0,
    /// `x_0 + scale · Σ_{k≥1} w_k (x_k − x_0)`.
    Task = 1,
    /// A surveyed slerp's blend `ca · x_0 + cb · x_1`, in f32 out.
    Slerp = 2,
    /// A surveyed nuslerp's blend `back + ca (a − back) + cb (b − back)`.
    Nuslerp = 3,
    /// A surveyed multislerp's exponential map, per element.
    Multislerp = 4,
    /// `t · mean(models) + (1 − t) · base`.
    ModelStock = 5,
    /// `Σ c_i · model_i` over the kept models.
    Karcher = 6,
    /// nearswap's per-element interpolation towards the model.
    Nearswap = 7,
    /// ram's (ramplus_tl's) rescaled task vectors.
    Ram = 8,
    /// arcee_fusion's choice of the model's or the base's element.
    Fusion = 9,
    /// TIES, breadcrumbs, DARE, DELLA: survivors, rescaled, weighted, sign-elected or summed.
    Sparse = 10,
    /// SCE: the elements of largest variance, sign-elected, weighted.
    Sce = 11,
}

/// `MergeParams` of kernels/merge.cuh. The inputs are joined into one buffer, input `k` at
/// byte `offsets[k]`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct MergeParams {
    /// A [`MergeMethod`].
    pub method: i32,
    /// Inputs (task arithmetic: the base first).
    pub n: i32,
    /// `TftfDtype` of the output.
    pub dst: i32,
    /// Nuslerp, multislerp, model_stock, karcher, nearswap, ram: input 0 is the base.
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
    /// Slerp, nuslerp: the `(ca, cb)` pairs of [`MergeLaunch::coefs`]; element `i` of a chunk
    /// takes pair `i mod inner` (chunks start at multiples of it). Karcher: the `(model,
    /// coefficient)` pairs. Sparse, SCE: the chunk's first element (draws and rank ties go by
    /// position in the tensor).
    pub inner: u64,
}

/// One chunk of a merge: the parameters and, for a surveyed blend, its coefficient pairs.
#[derive(Clone, Debug, PartialEq)]
pub struct MergeLaunch {
    pub params: MergeParams,
    pub coefs: Vec<f64>,
}
