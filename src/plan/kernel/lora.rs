//! The LoRA/DoRA merge kernels' description (kernels/lora.cuh): parameter blocks and the
//! per-chunk launch.

use super::fp4::Fp4Params;
use super::fp8::DequantParams;
use crate::format::dtype::DType;

/// A LoRA-style merge as the GPU runs it: `base (+ dequantised by base_dequant) + scale · Δ`,
/// Δ summed in rank order from the operands `delta` describes, optionally DoRA-normalised.
#[derive(Clone, Debug)]
pub struct LoraLaunch {
    /// Inputs: `base_inputs` of the base, then A, B and (DoRA) the magnitude.
    pub base_inputs: usize,
    /// The dequantisation producing the base as f32, when the base is computed.
    pub base_dequant: Option<BaseDequant>,
    pub base_dtype: DType,
    pub a_dtype: DType,
    pub b_dtype: DType,
    pub m_dtype: Option<DType>,
    pub scale: f32,
    pub dst: DType,
    pub delta: DeltaParams,
    /// Δ's coefficients come from A (else from B); the vectors from the other factor.
    pub coef_is_a: bool,
}

/// How a computed base is made on the device: FP8 (kernels/fp8.cuh) or FP4 (kernels/
/// fp4_dequant.cuh) dequantisation to f32.
#[derive(Clone, Copy, Debug)]
pub enum BaseDequant {
    Fp8(DequantParams),
    Fp4(Fp4Params),
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
