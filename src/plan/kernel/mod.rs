//! Kernel descriptions: what an op asks a GPU to run for one chunk, as plain data.
//!
//! An op describes a chunk with [`Kernel`] (its parameter blocks are laid out exactly as their C
//! twins in `kernels/*.cuh`, which tests/kernels.rs checks by running the host build of the same
//! code); the GPU backend executes descriptions and never sees an op. What a kernel gathers
//! besides its outputs (quality sums) comes back as [`KernelStats`] for the op to fold in.
//!
//! The descriptions live under the plan, beside the [`Op`](super::Op) trait that names them, so
//! the plan can hold ops; each op family re-exports its parameter blocks as its `kernel` module.

pub mod fp4;
pub mod fp8;
pub mod gguf;
pub mod int;
pub mod lora;
pub mod merge;
pub mod quantize;

use crate::format::dtype::DType;
use fp4::{Fp4Params, RowSums};
use fp8::DequantParams;
use gguf::GgufLaunch;
use int::{GptqParams, Int4Params, IntParams};
use lora::LoraLaunch;
use merge::MergeLaunch;
use quantize::QuantParams;

/// One chunk's kernel. Inputs and outputs are the op's own (`Op::input_ranges`, every output).
#[derive(Clone, Debug)]
pub enum Kernel {
    /// Elementwise cast (kernels/cast.cuh).
    Cast { src: DType, dst: DType },
    /// FP8 dequantisation (kernels/fp8.cuh); refuses non-finite values unless allowed.
    DequantFp8(DequantParams),
    /// Packed FP4 dequantisation (kernels/fp4_dequant.cuh): codes, block scales, optional
    /// tensor scale; refuses non-finite values unless allowed.
    DequantFp4(Fp4Params),
    /// Packed-integer dequantisation (kernels/int.cuh): codes, scales, optional zero points.
    DequantInt(IntParams),
    /// GPTQ dequantisation (kernels/int.cuh): qweight, qzeros, scales, optional g_idx; refuses a
    /// group index outside the scales.
    DequantGptq(GptqParams),
    /// ModelOpt INT4 dequantisation (kernels/int.cuh): codes, F32 scales; refuses non-finite
    /// results.
    DequantInt4Modelopt(Int4Params),
    /// MXFP4 E8M0 scales → NVFP4 E4M3 block scales under tensor scale `2^g`.
    NvBlockScales { g: i32 },
    /// NVFP4 re-encoding of blocks outside the E4M3 window.
    NvReencode { g: i32 },
    /// E4M3 → E2M1 requantisation of rows of `cols` elements, with quality sums.
    Engram { cols: u64 },
    /// LoRA/DoRA merge (kernels/lora.cuh).
    Lora(LoraLaunch),
    /// A GGUF tensor's chunk (kernels/gguf.cuh): source elements, gathered through a unit map,
    /// to F32/F16/BF16 elements or Q8_0 blocks.
    Gguf(GgufLaunch),
    /// An elementwise merge or a surveyed slerp/nuslerp blend (kernels/merge.cuh): every
    /// model's chunk, one input each.
    Merge(Box<MergeLaunch>),
    /// Weight-only quantisation (kernels/quantize.cuh): weight rows → codes (output 0) and
    /// scales (output 1); refuses non-finite weights.
    Quantize(QuantParams),
    /// A merge whose rows stay on the device and are quantised there (`merge-lora --requant`):
    /// the `Lora` kernels into the base's float dtype, then the `Quantize` ones; with
    /// `measure`, the merged rows come back too, for the op's error figures.
    Requant {
        merge: LoraLaunch,
        quant: QuantParams,
        measure: bool,
    },
}

/// Figures a kernel gathered for its chunk, handed back to the op (`Op::absorb`).
#[derive(Clone, Debug)]
pub enum KernelStats {
    /// Per-row quality sums of the E2M1 requantisation, and blocks raised to the least scale.
    Engram { rows: Vec<RowSums>, clamped: u64 },
    /// A requantised chunk (rows `rows`): its merged rows and what they were quantised to.
    Requant {
        rows: std::ops::Range<u64>,
        merged: Vec<u8>,
        codes: Vec<u8>,
        scales: Vec<u8>,
    },
}

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
