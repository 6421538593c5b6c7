//! From checkpoint tensor headers to GGUF output tensors: name, shape, ggml type, and the
//! recipe that produces the bytes (what `ModelBase.prepare_tensors` and the architectures'
//! `modify_tensors` do, as a plan the pipeline can stream).

use std::collections::BTreeMap;

use serde_json::Value as Json;

use super::arch::{Config, Family, InputTensor, COMMON_LAYER_TABLE, GLOBAL_TABLE};
use super::quant::{q8_0_fits, MXFP4_BLOCK_ELEMS, MXFP4_SRC_BLOCK_BYTES};
use super::transform;
use super::{FileType, GgmlType};
use crate::error::{Error, Result};
use crate::format::dtype::DType;

pub use crate::ops::gguf::tensor::{OutputTensor, Recipe, RowMap};

/// The ggml type `prepare_tensors` picks: F32 for 1-D tensors, `*_norm.weight`, routers
/// (`ffn_gate_inp`) and any name not ending in `.weight`; otherwise the file type's, with Q8_0
/// falling back to F16 when the innermost dimension is not a multiple of 32.
pub fn tensor_type(name: &str, shape: &[u64], file_type: FileType) -> GgmlType {
    let router = name.contains(".ffn_gate_inp.") || name.contains(".ffn_gate_inp_shexp.");
    if shape.len() <= 1 || name.ends_with("_norm.weight") || router || !name.ends_with(".weight") {
        return GgmlType::F32;
    }
    match file_type.tensor_type() {
        GgmlType::Q8_0 if !q8_0_fits(*shape.last().unwrap_or(&0)) => GgmlType::F16,
        t => t,
    }
}

const SKIPPED_SUFFIXES: [&str; 3] = [
    ".attention.masked_bias",
    ".attention.bias",
    ".rotary_emb.inv_freq",
];

/// Maps every checkpoint tensor to GGUF output tensors, in input order (the caller gives each
/// shard's tensors by name, as the reference reads them; a block's stacked experts where its
/// last expert appears, `rope_freqs`, Phi-3's rope factors and gpt-oss's MXFP4 experts first, as
/// the reference emits them).
/// The GGUF tensors `BitnetModel.modify_tensors` passes through `weight_quant`.
const BITNET_TERNARISED: [&str; 7] = [
    "attn_q",
    "attn_k",
    "attn_v",
    "attn_output",
    "ffn_up",
    "ffn_down",
    "ffn_gate",
];

pub fn plan_tensors(
    cfg: &Config,
    inputs: &[InputTensor],
    file_type: FileType,
) -> Result<Vec<OutputTensor>> {
    let fam = cfg.spec.family;
    let blocks = cfg.block_count()?;
    let by_name: BTreeMap<&str, &InputTensor> =
        inputs.iter().map(|t| (t.name.as_str(), t)).collect();
    let mut out = Vec::new();
    let bad = |tensor: &str, msg: String| Error::GgufTensor {
        tensor: tensor.to_string(),
        msg,
    };
    let mut push = |out: &mut Vec<OutputTensor>,
                    name: String,
                    shape: Vec<u64>,
                    recipe: Recipe,
                    src_dtype: Option<DType>| {
        let ty = match &recipe {
            Recipe::Mxfp4 { .. } => GgmlType::Mxfp4,
            Recipe::Values(_) => GgmlType::F32,
            _ => tensor_type(&name, &shape, file_type),
        };
        out.push(OutputTensor::new(name, shape, ty, recipe, src_dtype));
    };

    // `generate_extra_tensors`: Llama 3's `rope_freqs`, Phi-3's LongRoPE factors.
    let extra = match llama3_rope_freqs(cfg)? {
        Some(freqs) => vec![("rope_freqs.weight".to_string(), freqs)],
        None => super::arch_phi::rope_factors(cfg)?,
    };
    for (name, values) in extra {
        let n = values.len() as u64;
        push(&mut out, name, vec![n], Recipe::Values(values), None);
    }

    // (bid, source weight) → (gguf base, expert id → source name). A block's stacks are
    // emitted, in source weight order, where its last expert tensor appears (the reference
    // waits for all 3·E of them), or at the end when some are missing (then an error).
    type Group = (&'static str, BTreeMap<u64, String>);
    let mut experts: BTreeMap<(u64, &'static str), Group> = BTreeMap::new();
    let mut seen: BTreeMap<u64, u64> = BTreeMap::new();
    let n_experts = cfg.u64(&["num_local_experts", "num_experts", "n_routed_experts"])?;
    let tied = cfg.find(&["tie_word_embeddings"]).and_then(Json::as_bool) == Some(true);
    let gemma3_rows = super::arch_gemma::gemma3_vocab_rows(cfg)?;

    for t in inputs {
        let src = t.name.as_str();
        if SKIPPED_SUFFIXES.iter().any(|s| src.ends_with(s)) {
            continue;
        }
        if t.name.ends_with("_scale_inv") || t.name.ends_with(".weight_scale") {
            return Err(bad(
                src,
                "FP8 scales must be applied (dequantised) before GGUF planning".into(),
            ));
        }
        let mut name = src.replace("language_model.", "");
        if multimodal(&name) || super::arch_gemma::skipped(fam, &name) {
            continue;
        }
        if name.ends_with("e_score_correction_bias") {
            name = name.replace("e_score_correction_bias", "e_score_correction.bias");
        }
        if fam == Family::GptOss && name.contains("sinks") {
            name.push_str(".weight");
        }
        if let Some((_, g)) = GLOBAL_TABLE.iter().find(|(h, _)| *h == name) {
            if fam == Family::DeepseekV3 && tied && *g == "output.weight" {
                continue;
            }
            let mut shape = t.shape.clone();
            if *g == "token_embd.weight" {
                if let Some(n) = gemma3_rows.filter(|&n| n < shape[0]) {
                    shape[0] = n; // the reference's `data_torch[:n_vocab_real]`
                }
            }
            let recipe = super::arch_gemma::norm_recipe(fam, &name, src)
                .unwrap_or(Recipe::Direct { src: src.into() });
            push(&mut out, g.to_string(), shape, recipe, Some(t.dtype));
            continue;
        }
        let Some(rest) = name.strip_prefix("model.layers.") else {
            return Err(bad(
                src,
                format!("cannot map tensor to a {} GGUF name", cfg.spec.gguf_arch),
            ));
        };
        let (bid, rest) = rest
            .split_once('.')
            .and_then(|(b, r)| Some((b.parse::<u64>().ok()?, r)))
            .ok_or_else(|| bad(src, "no layer number".into()))?;
        if bid >= blocks {
            if fam == Family::DeepseekV3 {
                continue; // multi-token-prediction layers, skipped by the reference
            }
            return Err(bad(src, format!("layer {bid} but the config has {blocks}")));
        }
        let blk = |base: &str, suffix: &str| format!("blk.{bid}.{base}{suffix}");

        // Per-expert tensors, stacked later.
        if let Some((x, w)) = expert_id(fam, rest) {
            let base = map_layer(cfg, w).ok_or_else(|| bad(src, "unknown expert weight".into()))?;
            experts
                .entry((bid, w))
                .or_insert_with(|| (base, BTreeMap::new()))
                .1
                .insert(x, src.to_string());
            let count = seen.entry(bid).or_default();
            *count += 1;
            if n_experts.is_some_and(|n| *count == 3 * n) {
                let keys: Vec<_> = experts
                    .range((bid, "")..(bid + 1, ""))
                    .map(|(k, _)| *k)
                    .collect();
                for k in keys {
                    let (base, group) = experts.remove(&k).unwrap();
                    stack_experts(bid, base, group, n_experts, &by_name, &mut out, &mut push)?;
                }
            }
            continue;
        }

        match (fam, rest) {
            (Family::GptOss, r) if r.starts_with("mlp.experts.") => {
                gpt_oss_experts(cfg, t, r, bid, &by_name, &mut out, &mut push)?;
                continue;
            }
            (Family::Qwen3Moe, "mlp.experts.gate_up_proj" | "mlp.experts.gate_up_proj.weight") => {
                let [e, rows2, n] = three(t, src)?;
                for (half, base) in [(0, "ffn_gate_exps"), (1, "ffn_up_exps")] {
                    let map = RowMap::Halves {
                        rows_out_per_expert: rows2 / 2,
                        half,
                    };
                    push(
                        &mut out,
                        blk(base, ".weight"),
                        vec![e, rows2 / 2, n],
                        Recipe::Rows {
                            src: src.into(),
                            map,
                            row_elems: n,
                        },
                        Some(t.dtype),
                    );
                }
                continue;
            }
            (Family::Qwen3Moe, "mlp.experts.down_proj" | "mlp.experts.down_proj.weight") => {
                push(
                    &mut out,
                    blk("ffn_down_exps", ".weight"),
                    t.shape.clone(),
                    Recipe::Direct { src: src.into() },
                    Some(t.dtype),
                );
                continue;
            }
            (Family::Llama4, r) if r.starts_with("feed_forward.experts.") => {
                llama4_experts(t, bid, &mut out, &mut push)?;
                continue;
            }
            (Family::DeepseekV3, "self_attn.kv_b_proj.weight") => {
                deepseek_kv_b(cfg, t, bid, &mut out, &mut push)?;
                continue;
            }
            _ => {}
        }

        let (base, suffix) = match rest.rsplit_once('.') {
            Some((b, s @ ("weight" | "bias"))) => {
                (b, if s == "weight" { ".weight" } else { ".bias" })
            }
            _ => (rest, ""),
        };
        let g = map_layer(cfg, base).ok_or_else(|| {
            bad(
                src,
                format!("cannot map tensor to a {} GGUF name", cfg.spec.gguf_arch),
            )
        })?;
        let recipe = match (fam, base) {
            (Family::Llama | Family::Granite, "self_attn.q_proj" | "self_attn.k_proj") => {
                let heads = cfg.need_u64("num_attention_heads")?;
                let n_head = if base == "self_attn.k_proj" {
                    cfg.u64(&["num_key_value_heads"])?.unwrap_or(heads)
                } else {
                    heads
                };
                let rows = t.shape[0];
                if !transform::qk_permute_fits(rows, n_head) {
                    return Err(bad(
                        src,
                        format!("{rows} rows do not split into {n_head} heads of even size"),
                    ));
                }
                let row_elems = t.shape[1..].iter().product();
                Recipe::Rows {
                    src: src.into(),
                    map: RowMap::QkPermute { rows, n_head },
                    row_elems,
                }
            }
            // BitnetModel.modify_tensors: the projections' weights re-ternarised.
            (Family::Bitnet, _) if suffix == ".weight" && BITNET_TERNARISED.contains(&g) => {
                Recipe::Ternary { src: src.into() }
            }
            _ => super::arch_gemma::norm_recipe(fam, &name, src)
                .unwrap_or(Recipe::Direct { src: src.into() }),
        };
        push(
            &mut out,
            blk(g, suffix),
            t.shape.clone(),
            recipe,
            Some(t.dtype),
        );
    }

    for ((bid, _), (base, group)) in experts {
        stack_experts(bid, base, group, n_experts, &by_name, &mut out, &mut push)?;
    }
    if fam == Family::GptOss {
        // The reference writes the repacked MXFP4 experts first (`generate_extra_tensors`).
        let (mx, rest): (Vec<_>, Vec<_>) = out
            .into_iter()
            .partition(|o| matches!(o.recipe, Recipe::Mxfp4 { .. }));
        out = mx.into_iter().chain(rest).collect();
    }
    Ok(out)
}

/// One stacked expert tensor `blk.{bid}.{base}.weight` from `group` (expert id → source).
#[allow(clippy::too_many_arguments)]
fn stack_experts(
    bid: u64,
    base: &str,
    group: BTreeMap<u64, String>,
    n_experts: Option<u64>,
    by_name: &BTreeMap<&str, &InputTensor>,
    out: &mut Vec<OutputTensor>,
    push: &mut impl FnMut(&mut Vec<OutputTensor>, String, Vec<u64>, Recipe, Option<DType>),
) -> Result<()> {
    let bad = |tensor: &str, msg: String| Error::GgufTensor {
        tensor: tensor.to_string(),
        msg,
    };
    let n = n_experts.unwrap_or(group.len() as u64);
    let missing: Vec<u64> = (0..n).filter(|x| !group.contains_key(x)).collect();
    let name = format!("blk.{bid}.{base}.weight");
    if !missing.is_empty() || group.len() as u64 != n {
        return Err(bad(
            &name,
            format!("expected {n} experts; missing ids {missing:?}"),
        ));
    }
    let first = by_name[group[&0].as_str()];
    for s in group.values() {
        let t = by_name[s.as_str()];
        if t.shape != first.shape || t.dtype != first.dtype {
            return Err(bad(s, "experts differ in shape or dtype".into()));
        }
    }
    let mut shape = vec![n];
    shape.extend_from_slice(&first.shape);
    push(
        out,
        name,
        shape,
        Recipe::Stack {
            srcs: group.into_values().collect(),
        },
        Some(first.dtype),
    );
    Ok(())
}

fn three(t: &InputTensor, src: &str) -> Result<[u64; 3]> {
    match t.shape[..] {
        [a, b, c] if b % 2 == 0 => Ok([a, b, c]),
        _ => Err(Error::GgufTensor {
            tensor: src.into(),
            msg: format!("expected [experts, 2 * ff, n], got {:?}", t.shape),
        }),
    }
}

/// `(expert id, HF base name without the id)` for per-expert tensors.
fn expert_id(fam: Family, rest: &str) -> Option<(u64, &'static str)> {
    let (prefix, bases): (&str, &[(&str, &'static str)]) = match fam {
        Family::Llama => (
            "block_sparse_moe.experts.",
            &[
                ("w1", "block_sparse_moe.experts.w1"),
                ("w2", "block_sparse_moe.experts.w2"),
                ("w3", "block_sparse_moe.experts.w3"),
            ],
        ),
        Family::Qwen3Moe | Family::DeepseekV3 | Family::Glm4Moe => (
            "mlp.experts.",
            &[
                ("gate_proj", "mlp.experts.gate_proj"),
                ("up_proj", "mlp.experts.up_proj"),
                ("down_proj", "mlp.experts.down_proj"),
            ],
        ),
        _ => return None,
    };
    let r = rest.strip_prefix(prefix)?.strip_suffix(".weight")?;
    let (x, w) = r.split_once('.')?;
    let x = x.parse().ok()?;
    bases
        .iter()
        .find(|(b, _)| *b == w)
        .map(|(_, full)| (x, *full))
}

/// The multimodal tensors every text model leaves out (`TextModel.filter_tensors`): a vision
/// tower, an audio encoder, a projector (Gemma 3's, Llama 4's).
fn multimodal(name: &str) -> bool {
    // The reference's lists, one line each.
    #[rustfmt::skip]
    const PREFIXES: [&str; 10] = ["mlp", "vit.", "vpm.", "siglip2.", "conformer.", "merger.", "resampler.", "sound_encoder.", "sound_projection.", "speech_embeddings."];
    #[rustfmt::skip]
    const PARTS: [&str; 17] = ["visual.", "vision.", "audio.", "talker.", "vision_", "audio_", "token2wav.", "code2wav.", "projector.", "pre_mm_projector_norm", "image_newline", "view_seperator", "patch_embed", "patch_embedding", "patch_merger.", "patch_merge_mlp.", "model.connector."];
    PREFIXES.iter().any(|p| name.starts_with(p)) || PARTS.iter().any(|p| name.contains(p))
}

/// An error about checkpoint tensor `tensor`, from its message.
fn tensor_error(tensor: &str) -> impl Fn(String) -> Error + '_ {
    move |msg| Error::GgufTensor {
        tensor: tensor.into(),
        msg,
    }
}

fn map_layer(cfg: &Config, base: &str) -> Option<&'static str> {
    cfg.spec
        .layer_tensors
        .iter()
        .copied()
        .flatten()
        .chain(COMMON_LAYER_TABLE)
        .find(|(h, _)| *h == base)
        .map(|(_, g)| *g)
}

type Push<'a> = dyn FnMut(&mut Vec<OutputTensor>, String, Vec<u64>, Recipe, Option<DType>) + 'a;

fn gpt_oss_experts(
    cfg: &Config,
    t: &InputTensor,
    rest: &str,
    bid: u64,
    by_name: &BTreeMap<&str, &InputTensor>,
    out: &mut Vec<OutputTensor>,
    push: &mut Push,
) -> Result<()> {
    let src = t.name.as_str();
    let bad = tensor_error(src);
    let blk = |base: &str, suffix: &str| format!("blk.{bid}.{base}{suffix}");
    match rest.strip_prefix("mlp.experts.").unwrap() {
        "gate_up_proj_scales" | "down_proj_scales" => Ok(()), // consumed with the blocks
        w @ ("gate_up_proj_blocks" | "down_proj_blocks") => {
            let scales_name = src.replace("_blocks", "_scales");
            let scales = by_name
                .get(scales_name.as_str())
                .ok_or_else(|| bad(format!("MXFP4 blocks without `{scales_name}`")))?;
            let [e, rows, g, b] = match t.shape[..] {
                [e, r, g, b] => [e, r, g, b],
                _ => return Err(bad(format!("expected [E, rows, groups, 16], got {:?}", t.shape))),
            };
            if b != MXFP4_SRC_BLOCK_BYTES as u64 || scales.shape != [e, rows, g] {
                return Err(bad(format!("blocks {:?} and scales {:?} do not match", t.shape, scales.shape)));
            }
            let cols = g * MXFP4_BLOCK_ELEMS as u64;
            if w == "down_proj_blocks" {
                push(out, blk("ffn_down_exps", ".weight"), vec![e, rows, cols], Recipe::Mxfp4 { blocks: src.into(), scales: scales_name, map: None }, None);
            } else {
                if rows % 2 != 0 {
                    return Err(bad(format!("gate_up has an odd row count {rows}")));
                }
                for (half, base) in [(0, "ffn_gate_exps"), (1, "ffn_up_exps")] {
                    let map = Some(RowMap::Interleaved { rows_out_per_expert: rows / 2, half });
                    push(out, blk(base, ".weight"), vec![e, rows / 2, cols], Recipe::Mxfp4 { blocks: src.into(), scales: scales_name.clone(), map }, None);
                }
            }
            Ok(())
        }
        "gate_up_proj_bias" => {
            let [e, n2] = match t.shape[..] {
                [e, n] if n % 2 == 0 => [e, n],
                _ => return Err(bad(format!("expected [E, 2 * ff], got {:?}", t.shape))),
            };
            for (half, base) in [(0, "ffn_gate_exps"), (1, "ffn_up_exps")] {
                // Even/odd *columns*: each element is a row of one.
                let map = RowMap::Interleaved { rows_out_per_expert: n2 / 2, half };
                push(out, blk(base, ".bias"), vec![e, n2 / 2], Recipe::Rows { src: src.into(), map, row_elems: 1 }, Some(t.dtype));
            }
            Ok(())
        }
        "down_proj_bias" => {
            push(out, blk("ffn_down_exps", ".bias"), t.shape.clone(), Recipe::Direct { src: src.into() }, Some(t.dtype));
            Ok(())
        }
        other => Err(bad(format!(
            "gpt-oss expert tensor `{other}` is not MXFP4 blocks/scales or a bias; only MXFP4 checkpoints are supported (cfg {})",
            cfg.path.display()
        ))),
    }
}

/// Llama 4's routed experts (`Llama4Model.modify_tensors`): `gate_up_proj` `[E, n, 2·ff]`
/// transposed and split into `ffn_gate_exps` and `ffn_up_exps` `[E, ff, n]`, `down_proj`
/// `[E, ff, n]` transposed into `ffn_down_exps` `[E, n, ff]`.
fn llama4_experts(
    t: &InputTensor,
    bid: u64,
    out: &mut Vec<OutputTensor>,
    push: &mut Push,
) -> Result<()> {
    let src = t.name.as_str();
    let bad = tensor_error(src);
    let w = src.rsplit("feed_forward.experts.").next().unwrap_or(src);
    let [e, rows, cols] = match t.shape[..] {
        [e, r, c] => [e, r, c],
        _ => {
            return Err(bad(format!(
                "expected [experts, rows, columns], got {:?}",
                t.shape
            )))
        }
    };
    let parts: &[(&str, u64, u64)] = match w.strip_suffix(".weight").unwrap_or(w) {
        "gate_up_proj" if cols % 2 == 0 => &[
            ("ffn_gate_exps", 0, cols / 2),
            ("ffn_up_exps", cols / 2, cols / 2),
        ],
        "gate_up_proj" => return Err(bad(format!("gate_up_proj has an odd column count {cols}"))),
        "down_proj" => &[("ffn_down_exps", 0, cols)],
        other => return Err(bad(format!("unknown Llama 4 expert tensor `{other}`"))),
    };
    for &(base, first_col, width) in parts {
        let recipe = Recipe::ExpertColumns {
            src: src.into(),
            rows,
            cols,
            first_col,
            width,
        };
        push(
            out,
            format!("blk.{bid}.{base}.weight"),
            vec![e, width, rows],
            recipe,
            Some(t.dtype),
        );
    }
    Ok(())
}

fn deepseek_kv_b(
    cfg: &Config,
    t: &InputTensor,
    bid: u64,
    out: &mut Vec<OutputTensor>,
    push: &mut Push,
) -> Result<()> {
    // The reference splits with the config's num_key_value_heads (before it writes 1).
    let n_head = cfg.need_u64("num_key_value_heads")?;
    let nope = cfg.need_u64("qk_nope_head_dim")?;
    let v = cfg.need_u64("v_head_dim")?;
    let src = t.name.as_str();
    let [rows, lora] = match t.shape[..] {
        [r, l] => [r, l],
        _ => {
            return Err(Error::GgufTensor {
                tensor: src.into(),
                msg: format!("expected 2-D, got {:?}", t.shape),
            })
        }
    };
    if rows != n_head * (nope + v) {
        return Err(Error::GgufTensor {
            tensor: src.into(),
            msg: format!(
                "{rows} rows, expected num_key_value_heads × (qk_nope_head_dim + v_head_dim) = {}",
                n_head * (nope + v)
            ),
        });
    }
    push(
        out,
        format!("blk.{bid}.attn_k_b.weight"),
        vec![n_head, lora, nope],
        Recipe::KvBK {
            src: src.into(),
            n_head,
            nope,
            v,
            lora,
        },
        Some(t.dtype),
    );
    push(
        out,
        format!("blk.{bid}.attn_v_b.weight"),
        vec![n_head, v, lora],
        Recipe::Rows {
            src: src.into(),
            map: RowMap::KvBV { nope, v },
            row_elems: lora,
        },
        Some(t.dtype),
    );
    Ok(())
}

/// Llama-3 `rope_freqs` values when `rope_type` is `llama3` (Llama family only).
fn llama3_rope_freqs(cfg: &Config) -> Result<Option<Vec<f32>>> {
    if !matches!(cfg.spec.family, Family::Llama | Family::Llama4) {
        return Ok(None);
    }
    let ty = cfg
        .rope
        .get("rope_type")
        .and_then(Json::as_str)
        .unwrap_or("");
    if !ty.eq_ignore_ascii_case("llama3") {
        return Ok(None);
    }
    let get = |k: &str, d: f64| cfg.rope.get(k).and_then(Json::as_f64).unwrap_or(d);
    let dim = match cfg.u64(&["head_dim"])? {
        Some(d) => d,
        None => cfg.need_u64("hidden_size")? / cfg.need_u64("num_attention_heads")?.max(1),
    };
    Ok(Some(transform::llama3_rope_freqs(
        get("rope_theta", 10000.0),
        dim,
        get("factor", 8.0),
        get("low_freq_factor", 1.0),
        get("high_freq_factor", 4.0),
        get("original_max_position_embeddings", 8192.0),
    )))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn vision_towers_and_projectors_are_left_out_and_language_tensors_kept() {
        for name in [
            "model.vision_tower.vision_model.post_layernorm.weight",
            "model.multi_modal_projector.mm_soft_emb_norm.weight",
            "vision_model.model.layers.0.self_attn.q_proj.weight",
            "multi_modal_projector.linear_1.weight",
            "mlp1.0.weight",
        ] {
            assert!(multimodal(name), "{name}");
        }
        for name in [
            "model.layers.0.mlp.up_proj.weight",
            "model.layers.1.feed_forward.experts.gate_up_proj",
            "lm_head.weight",
        ] {
            assert!(!multimodal(name), "{name}");
        }
    }
}
