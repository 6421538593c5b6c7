//! The packed-integer dequantisation kernel's parameter block (kernels/int.cuh).

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
