//! Kernel parameter blocks, laid out exactly as their C twins in `kernels/*.cuh` (checked by
//! tests/kernels.rs, which passes them to the host build of the same code).

use crate::format::dtype::DType;

/// `TftfDtype` of kernels/cast.cuh.
pub fn kernel_dtype(d: DType) -> i32 {
    match d {
        DType::F64 => 0,
        DType::F32 => 1,
        DType::F16 => 2,
        DType::BF16 => 3,
        DType::BOOL => 4,
        DType::U8 => 5,
        DType::I8 => 6,
        DType::I16 => 7,
        DType::U16 => 8,
        DType::I32 => 9,
        DType::U32 => 10,
        DType::I64 => 11,
        DType::U64 => 12,
        DType::F8_E8M0 => 13,
        DType::F8_E4M3 => 14,
        DType::F8_E5M2 => 15,
        _ => unreachable!("{d} has no kernel code"),
    }
}

/// `DT_NONE`: no scale tensor.
pub const KERNEL_DTYPE_NONE: i32 = 255;

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

/// `LoraParams` of kernels/lora.cuh.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct LoraParams {
    pub cols: u64,
    pub scale: f32,
    pub base_dtype: i32,
    pub dst: i32,
    pub dora: i32,
    pub pad: i32,
}

/// `DeltaParams` of kernels/lora.cuh.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct DeltaParams {
    pub rank: u64,
    pub cols: u64,
    pub ci: u64,
    pub ck: u64,
    pub cg: u64,
    pub vk: u64,
    pub vj: u64,
    pub vg: u64,
    pub first_row: u64,
    pub group_rows: u64,
}

/// `BlockSums` of kernels/fp4.cuh (device scratch only).
pub const BLOCK_SUMS_BYTES: usize = 16;
