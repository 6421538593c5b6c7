//! The one table from a ggml block type to its row encoder, in the row form every encoder has:
//! `fn(src_row, dst_row, quant_weights)` (`quant_weights`: one importance weight per column,
//! or `None`). A type missing here is refused by name before any output exists
//! ([`row_encoder`] returns `None`), so a mix that needs it fails early and whole.

use super::kquants;
use super::legacy;
use super::quant::quantize_q8_0;
use super::GgmlType;

/// One row of f32 values to one row of blocks.
pub type RowEncoder = fn(&[f32], &mut [u8], Option<&[f32]>);

/// ggml's `quantize_q8_0` ignores quant weights.
fn q8_0_row(src: &[f32], dst: &mut [u8], _quant_weights: Option<&[f32]>) {
    quantize_q8_0(src, dst)
}

const ENCODERS: &[(GgmlType, RowEncoder)] = &[
    (GgmlType::Q4_0, legacy::quantize_row_q4_0),
    (GgmlType::Q4_1, legacy::quantize_row_q4_1),
    (GgmlType::Q5_0, legacy::quantize_row_q5_0),
    (GgmlType::Q5_1, legacy::quantize_row_q5_1),
    (GgmlType::Q8_0, q8_0_row),
    (GgmlType::Q2_K, kquants::quantize_row_q2_k),
    (GgmlType::Q3_K, kquants::quantize_row_q3_k),
    (GgmlType::Q4_K, kquants::quantize_row_q4_k),
    (GgmlType::Q5_K, kquants::quantize_row_q5_k),
    (GgmlType::Q6_K, kquants::quantize_row_q6_k),
    (GgmlType::IQ4_NL, kquants::quantize_row_iq4_nl),
    (GgmlType::IQ4_XS, kquants::quantize_row_iq4_xs),
    (GgmlType::IQ3_XXS, kquants::quantize_row_iq3_xxs),
    (GgmlType::IQ3_S, kquants::quantize_row_iq3_s),
    (GgmlType::TQ1_0, kquants::quantize_row_tq1_0),
    (GgmlType::TQ2_0, kquants::quantize_row_tq2_0),
    (GgmlType::IQ2_XXS, kquants::quantize_row_iq2_xxs),
    (GgmlType::IQ2_XS, kquants::quantize_row_iq2_xs),
    (GgmlType::IQ2_S, kquants::quantize_row_iq2_s),
    (GgmlType::IQ1_S, kquants::quantize_row_iq1_s),
    (GgmlType::IQ1_M, kquants::quantize_row_iq1_m),
];

/// Whether `ty`'s encoder has no reference without importance weights
/// (`ggml_quantize_requires_imatrix`: ggml asserts them, so planning must refuse the tensor).
pub fn needs_quant_weights(ty: GgmlType) -> bool {
    matches!(ty, GgmlType::IQ2_XXS | GgmlType::IQ2_XS | GgmlType::IQ1_S)
}

/// The row encoder of a block type, `None` for a type tftf cannot write yet (and for the
/// float types, which are converted, not encoded).
pub fn row_encoder(ty: GgmlType) -> Option<RowEncoder> {
    ENCODERS.iter().find(|(t, _)| *t == ty).map(|(_, f)| *f)
}

/// Whether the GPU encodes `ty` (kernels/kquant.cuh, kernels/iq_encode.cuh): every block type
/// but Q8_0, which kernels/gguf.cuh encodes.
pub fn has_kernel(ty: GgmlType) -> bool {
    matches!(
        ty,
        GgmlType::Q4_0
            | GgmlType::Q4_1
            | GgmlType::Q5_0
            | GgmlType::Q5_1
            | GgmlType::Q2_K
            | GgmlType::Q3_K
            | GgmlType::Q4_K
            | GgmlType::Q5_K
            | GgmlType::Q6_K
            | GgmlType::IQ4_NL
            | GgmlType::IQ4_XS
            | GgmlType::TQ1_0
            | GgmlType::TQ2_0
            | GgmlType::IQ2_XXS
            | GgmlType::IQ2_XS
            | GgmlType::IQ2_S
            | GgmlType::IQ3_XXS
            | GgmlType::IQ3_S
            | GgmlType::IQ1_S
            | GgmlType::IQ1_M
    )
}

/// Whether tftf can write tensors of `ty`.
pub fn can_write(ty: GgmlType) -> bool {
    matches!(
        ty,
        GgmlType::F32 | GgmlType::F16 | GgmlType::Bf16 | GgmlType::Mxfp4
    ) || row_encoder(ty).is_some()
}
