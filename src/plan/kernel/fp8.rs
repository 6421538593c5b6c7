//! The FP8 dequantisation kernel's parameter block (kernels/fp8.cuh).

/// `DequantParams` of kernels/fp8.cuh.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct DequantParams {
    pub cols: u64,
    pub rows: u64,
    pub block_rows: u64,
    pub block_cols: u64,
    pub grid_cols: u64,
    pub expert_stride: u64,
    pub first_row: u64,
    pub scale_base: u64,
    pub scale_dtype: i32,
    pub dst: i32,
    pub e5m2: i32,
    pub divide: i32,
    pub allow_nonfinite: i32,
    pub pad: i32,
}
