//! `--outtype auto`: the type each tensor gets when the user names none.
//!
//! An unquantised checkpoint (F32/F16/BF16 weights) gets what `convert_hf_to_gguf.py --outtype
//! auto` writes, byte for byte: BF16 if the first tensor of two or more dimensions that is BF16
//! or F16 is BF16, F16 otherwise (so an all-F32 checkpoint becomes F16).
//!
//! A quantised checkpoint gets the "mostly unchanged types" rule proposed for llama.cpp's
//! converter (issue #14762, PR #14810): every weight keeps about the precision it was shipped
//! in, so the GGUF is neither blown up to 16 bits nor quantised a second time below what it was:
//!
//! | stored as | GGUF type |
//! |---|---|
//! | FP8 with float or E8M0 scales (block, channel, tensor; MXFP8) | BF16 |
//! | packed int of 5–8 bits (pack-quantized, GPTQ) | Q8_0 |
//! | packed int of 1–4 bits (pack-quantized, GPTQ, ModelOpt INT4) | Q4_1 (its offset keeps asymmetric grids) |
//! | NVFP4, MXFP4 (compressed-tensors, ModelOpt) | Q8_0 (Q4_1 would re-round their uneven grid) |
//! | BitNet packed ternary (`quant_method: bitnet`) | TQ1_0 (of the decoded `±1/weight_scale`, 0) |
//! | gpt-oss MXFP4 experts | MXFP4, repacked losslessly |
//! | unquantised BF16 / F16 / F32 weights beside them | unchanged |
//!
//! Q8_0 and Q4_1 need rows of a multiple of 32, TQ1_0 of 256; other rows become BF16. Norms,
//! biases, routers and 1-D tensors stay F32 as in every converter output. `general.file_type`
//! names the type of the first quantised weight (BF16 32, Q8_0 7, Q4_1 3, TQ1_0 36).

use super::arch::{self, OutputTensor};
use super::quantised::{DequantView, Stored};
use super::recipe::tensor_type;
use super::{FileType, GgmlType};
use crate::format::dtype::DType;
use crate::ops::gguf::op::source_names;

/// The file type `auto` gives the checkpoint `view`.
pub fn file_type(view: &DequantView) -> FileType {
    let first = view
        .tensors
        .iter()
        .find_map(|t| view.decoded.get(&t.name).map(|d| d.stored));
    match first {
        None => arch::resolve_auto_file_type(&view.tensors),
        Some(stored) => FileType::Unchanged(ggml_type(stored)),
    }
}

/// The GGUF type of a weight stored as `stored` (before the row-length fallback).
pub fn ggml_type(stored: Stored) -> GgmlType {
    match stored {
        Stored::Float(DType::BF16) | Stored::Fp8 => GgmlType::Bf16,
        Stored::Float(DType::F16) => GgmlType::F16,
        Stored::Float(_) => GgmlType::F32,
        Stored::Fp4 => GgmlType::Q8_0,
        Stored::Int(bits) if bits > 4 => GgmlType::Q8_0,
        Stored::Int(_) => GgmlType::Q4_1,
        Stored::Ternary => GgmlType::TQ1_0,
    }
}

/// Types each weight of a quantised checkpoint by how its source was stored; leaves an
/// unquantised checkpoint's plan (the converter's) alone.
pub fn retype(view: &DequantView, outputs: &mut [OutputTensor]) {
    if !view.is_quantised() {
        return;
    }
    for o in outputs.iter_mut() {
        // Only the weights the converter types by the file type (not norms, biases, routers,
        // MXFP4 repacks or computed values).
        let by_file_type = tensor_type(&o.name, &o.shape, FileType::MostlyBf16) == GgmlType::Bf16;
        let Some(stored) = source_names(o).first().and_then(|n| view.stored(n)) else {
            continue;
        };
        if !by_file_type || o.ty == GgmlType::Mxfp4 {
            continue;
        }
        let ty = ggml_type(stored);
        let (block, _) = ty.block();
        let cols = o.shape.last().copied().unwrap_or(0);
        o.ty = if cols % block == 0 {
            ty
        } else {
            GgmlType::Bf16
        };
    }
}
