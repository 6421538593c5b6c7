//! The GGUF encoding kernel's parameter block (kernels/gguf.cuh).

/// `GgufParams` of kernels/gguf.cuh.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct GgufParams {
    /// `TftfDtype` of the source elements (F32, F16 or BF16).
    pub src: i32,
    /// ggml type id of the output (F32, F16, BF16, Q8_0 or a block type of kernels/kquant.cuh).
    pub ty: i32,
    /// Elements per mapped unit; 0 when output element `e` is source element `e`.
    pub unit: u64,
    /// Elements per output row (read by block types only).
    pub inner: u64,
    /// Output rows per row of importance weights (an expert's rows); 0 without weights.
    pub weight_rows: u64,
    /// The chunk's first row, counted from the start of its first weight row's rows.
    pub first_row: u64,
}

/// One chunk of a GGUF tensor: the kernel reads the chunk's inputs joined in order (the
/// experts a stacked tensor takes its rows from follow each other), through `map` when set:
/// output unit `k` is unit `map[k]` of the joined input.
#[derive(Clone, Debug, PartialEq)]
pub struct GgufLaunch {
    pub params: GgufParams,
    pub map: Vec<u32>,
    /// The importance weights of the experts the chunk's rows belong to, one row of `inner`
    /// each, from the expert of the chunk's first row; empty without weights.
    pub weights: Vec<f32>,
    /// The lattice tables of an IQ1/IQ2/IQ3 type (kernels/iq_grid.cuh), else `None`.
    pub tables: Option<std::sync::Arc<[u8]>>,
    /// Work items of the chunk: output elements, or blocks.
    pub items: u64,
    /// Whether the type is a block type of kernels/kquant.cuh (`tftf_gguf_blocks`, one thread
    /// per block) rather than F32/F16/BF16/Q8_0 (`tftf_gguf`).
    pub blocks: bool,
}
