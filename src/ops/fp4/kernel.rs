//! The E2M1 requantisation kernel's shared records (kernels/fp4.cuh).

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
