//! The FP4 kernels' shared records: the E2M1 requantisation's (kernels/fp4.cuh) and the
//! FP4 dequantisation's parameter block (kernels/fp4_dequant.cuh).

/// One row's quality sums in f64, scaled back to the tensor's values: `Σ x·y`, `Σ x²`, `Σ y²`
/// and `Σ (x-y)²`, the blocks taken in order. Same layout as `RowSums` in kernels/fp4.cuh.
#[repr(C)]
#[derive(Debug, Default, Clone, Copy, PartialEq)]
pub struct RowSums {
    pub dot: f64,
    pub xx: f64,
    pub yy: f64,
    pub sq_err: f64,
}

/// `BlockSums` of kernels/fp4.cuh (device scratch only).
pub const BLOCK_SUMS_BYTES: usize = 16;

/// `Fp4Params` of kernels/fp4_dequant.cuh.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct Fp4Params {
    pub cols: u64,
    pub rows: u64,
    pub group: u64,
    pub groups: u64,
    pub e8m0: i32,
    /// 0: no tensor scale, 1: divide, 2: multiply.
    pub global: i32,
    pub transpose: i32,
    pub negative_zero: i32,
    pub dst: i32,
    pub allow_nonfinite: i32,
}
