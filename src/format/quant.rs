//! Which tensors of a checkpoint are quantisation metadata: scales, global scales, zero points,
//! group indices and packed codes of a quantised weight. `--dtype` casts real weights only;
//! these keep their dtype and bytes, because rounding a scale (an F32 `weight_scale_inv` to
//! BF16, say) silently changes every value it decodes.
//!
//! Names as the producing tools write them: DeepSeek / transformers FineGrainedFP8
//! (`weight_scale_inv`), compressed-tensors (`weight_scale`, `weight_global_scale`,
//! `weight_zero_point`, `weight_packed`, `weight_shape`, `input_*`), ModelOpt (`weight_scale_2`,
//! `input_scale`), GPTQ (`qweight`, `qzeros`, `scales`, `g_idx`), KV-cache schemes (`k_scale`,
//! `v_scale`), gpt-oss (`*_blocks` with `*_scales`) and DeepSeek-V4 (`X.scale` beside a
//! quantised `X.weight`).

use crate::format::dtype::DType;

/// Last name segments that only ever name quantisation metadata.
const METADATA_SEGMENTS: &[&str] = &[
    "weight_scale",
    "weight_scale_inv",
    "weight_scale_2",
    "weight_global_scale",
    "weight_zero_point",
    "weight_packed",
    "weight_shape",
    "weight_g_idx",
    "input_scale",
    "input_global_scale",
    "input_zero_point",
    "output_scale",
    "activation_scale",
    "k_scale",
    "v_scale",
    "q_scale",
    "qweight",
    "qzeros",
    "scales",
    "g_idx",
];

/// Suffixes of metadata named after a fused parameter `X` (`X` + one of these), metadata when
/// `X` is quantised.
const FUSED_SCALE_SUFFIXES: &[&str] = &[
    "_scale",
    "_scales",
    "_scale_2",
    "_global_scale",
    "_zero_point",
    "_input_scale",
    "_activation_scale",
];

/// Scale names a quantised `X.weight` is stored beside (`X.` + one of these).
const WEIGHT_SCALE_SEGMENTS: &[&str] = &["weight_scale", "weight_scale_inv", "scale"];

/// Whether tensor `name` (of `dtype`) is quantisation metadata; `dtype_of` looks up another
/// tensor of the same checkpoint by name.
pub fn is_metadata(name: &str, dtype: DType, dtype_of: &dyn Fn(&str) -> Option<DType>) -> bool {
    let (module, last) = match name.rsplit_once('.') {
        Some((m, l)) => (Some(m), l),
        None => (None, name),
    };
    if METADATA_SEGMENTS.contains(&last) {
        return true;
    }
    let sibling = |seg: &str| match module {
        Some(m) => dtype_of(&format!("{m}.{seg}")),
        None => dtype_of(seg),
    };
    // gpt-oss MXFP4 experts: `gate_up_proj_blocks` with `gate_up_proj_scales`.
    for (this, other) in [("_blocks", "_scales"), ("_scales", "_blocks")] {
        if let Some(stem) = last.strip_suffix(this) {
            if sibling(&format!("{stem}{other}")).is_some() {
                return true;
            }
        }
    }
    let quantised = |d: DType| !d.is_castable_float();
    // An inverse scale is never a weight, whatever it is the inverse scale of.
    if last.ends_with("_scale_inv") {
        return true;
    }
    // Fused layouts name the scale after the parameter: transformers' FineGrainedFP8 experts
    // store `mlp.experts.down_proj` (F8_E4M3 `[E, out, in]`) with `down_proj_scale_inv`, and
    // other tools `X_scale`, `X_scale_2`, `X_zero_point` beside a quantised `X`.
    for suffix in FUSED_SCALE_SUFFIXES {
        if let Some(stem) = last.strip_suffix(suffix) {
            if !stem.is_empty() && sibling(stem).is_some_and(quantised) {
                return true;
            }
        }
    }
    match last {
        // DeepSeek-V4: `X.scale` beside an FP8/FP4 `X.weight`.
        "scale" => sibling("weight").is_some_and(quantised),
        // Packed codes stored as `X.weight` (ModelOpt NVFP4 `U8`, FP8 weights) beside a scale.
        "weight" => quantised(dtype) && WEIGHT_SCALE_SEGMENTS.iter().any(|s| sibling(s).is_some()),
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn with<'a>(tensors: &'a [(&'a str, DType)]) -> impl Fn(&str) -> bool + 'a {
        move |name: &str| {
            let dtype = tensors.iter().find(|t| t.0 == name).unwrap().1;
            let lookup = |n: &str| tensors.iter().find(|t| t.0 == n).map(|t| t.1);
            is_metadata(name, dtype, &lookup)
        }
    }

    #[test]
    fn scales_and_codes_of_every_tool_are_metadata_and_weights_are_not() {
        let t = [
            ("a.weight", DType::F8_E4M3),
            ("a.weight_scale_inv", DType::F32),
            ("b.weight", DType::U8),
            ("b.weight_scale", DType::F8_E4M3),
            ("b.weight_scale_2", DType::F32),
            ("b.input_scale", DType::F32),
            ("c.weight", DType::F8_E4M3),
            ("c.scale", DType::F8_E8M0),
            ("norm.weight", DType::F32),
            ("norm.scale", DType::F32),
            ("e.gate_up_proj_blocks", DType::U8),
            ("e.gate_up_proj_scales", DType::U8),
            ("e.gate_up_proj_bias", DType::F32),
            ("g.qweight", DType::I32),
            ("g.scales", DType::F16),
            ("attn.k_scale", DType::F32),
            ("lm_head.weight", DType::BF16),
            ("mlp.experts.down_proj", DType::F8_E4M3),
            ("mlp.experts.down_proj_scale_inv", DType::F32),
            ("mlp.experts.gate_up_proj", DType::F8_E4M3),
            ("mlp.experts.gate_up_proj_scale", DType::F32),
            ("mlp.experts.up_scale_inv", DType::F32),
            ("mlp.experts.bf16_proj", DType::BF16),
            ("mlp.experts.bf16_proj_scale", DType::F32),
        ];
        let is = with(&t);
        for meta in [
            "a.weight",
            "a.weight_scale_inv",
            "b.weight",
            "b.weight_scale",
            "b.weight_scale_2",
            "b.input_scale",
            "c.weight",
            "c.scale",
            "e.gate_up_proj_blocks",
            "e.gate_up_proj_scales",
            "g.qweight",
            "g.scales",
            "attn.k_scale",
            "mlp.experts.down_proj_scale_inv",
            "mlp.experts.gate_up_proj_scale",
            "mlp.experts.up_scale_inv",
        ] {
            assert!(is(meta), "{meta} is metadata");
        }
        for weight in [
            "norm.weight",
            "norm.scale",
            "e.gate_up_proj_bias",
            "lm_head.weight",
            "mlp.experts.bf16_proj",
            "mlp.experts.bf16_proj_scale",
        ] {
            assert!(!is(weight), "{weight} is a weight");
        }
    }
}
