//! The integer dequantisation kernels' parameter blocks (kernels/int.cuh).

/// `IntParams` of kernels/int.cuh.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct IntParams {
    pub cols: u64,
    pub words: u64,
    pub group: u64,
    pub groups: u64,
    pub bits: i32,
    pub scale_dtype: i32,
    pub dst: i32,
    pub zero_point: i32,
}

/// `GptqParams` of kernels/int.cuh: the whole tensor.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct GptqParams {
    pub rows: u64,
    pub cols: u64,
    pub groups: u64,
    /// Inputs per group; 0 when `g_idx` (the fourth input) gives each input's group.
    pub group_size: u64,
    pub bits: i32,
    pub scale_dtype: i32,
    pub dst: i32,
    pub zero_offset: i32,
}

/// `Int4Params` of kernels/int.cuh: a chunk of whole packed rows.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct Int4Params {
    pub cols: u64,
    pub group: u64,
    pub groups: u64,
    pub dst: i32,
    pub pad: i32,
}
