//! The GGUF encoding kernel's parameter block (kernels/gguf.cuh).

/// `GgufParams` of kernels/gguf.cuh.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct GgufParams {
    /// `TftfDtype` of the source elements (F32, F16 or BF16).
    pub src: i32,
    /// ggml type id of the output (F32, F16, BF16 or Q8_0).
    pub ty: i32,
    /// Elements per mapped unit; 0 when output element `e` is source element `e`.
    pub unit: u64,
}

/// One chunk of a GGUF tensor: the kernel reads the chunk's inputs joined in order (the
/// experts a stacked tensor takes its rows from follow each other), through `map` when set:
/// output unit `k` is unit `map[k]` of the joined input.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GgufLaunch {
    pub params: GgufParams,
    pub map: Vec<u32>,
    /// Work items of the chunk: output elements, or Q8_0 blocks.
    pub items: u64,
}
