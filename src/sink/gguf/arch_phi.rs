//! Phi-3 and Phi-4 (`Phi3ForCausalLM` → `phi3`): what `Phi3MiniModel` in the reference's
//! `conversion/phi.py` does beyond renaming.
//!
//! - Fused tensors kept fused: `self_attn.qkv_proj` → `attn_qkv`, `mlp.gate_up_proj` → `ffn_up`
//!   (gate then up, `2 × intermediate_size` rows).
//! - Its own `set_gguf_parameters` (no common KVs): context length, `original_max_position_
//!   embeddings`, `rope.dimension_count` = `int(partial_rotary_factor × hidden_size) // heads`,
//!   the sliding window (0 when unset: Phi-4), no `rope.scaling.type`.
//! - LongRoPE (Phi-3-mini-128k, Phi-3.5-mini, Phi-4-mini): `rope_factors_long` and
//!   `rope_factors_short` (F32, first in the file) and `rope.scaling.attn_factor` =
//!   `√(1 + ln(max / original) / ln(original))`, which the reference writes while it plans
//!   tensors, so right after `general.architecture`. transformers 5 renames `su` and `yarn`
//!   to `longrope` and gives it the top-level `original_max_position_embeddings`.
//! - The vocabulary: GPT-2 BPE when `tokenizer_config.json` names `GPT2Tokenizer` (Phi-4),
//!   else `tokenizer.model` read by Phi-3's own SentencePiece rules.

use std::path::Path;

use serde_json::Value as Json;

use super::arch::{Config, Family, LayerTable, GGML_QUANT_VERSION};
use super::kv::{Metadata, Value};
use super::tokenizer::{read_json, tok_err};
use super::FileType;
use crate::error::Result;

/// Per-layer names (after `model.layers.{bid}.`, without `.weight`/`.bias`) → GGUF names.
pub(super) const PHI3_LAYER_TABLE: LayerTable = &[
    ("self_attn.qkv_proj", "attn_qkv"),
    ("mlp.gate_up_proj", "ffn_up"),
];

/// Rows of `ffn_up` per `intermediate_size`: 2 for Phi-3's fused gate and up.
pub(super) fn ffn_up_rows_per_ff(fam: Family) -> u64 {
    match fam {
        Family::Phi3 => 2,
        _ => 1,
    }
}

/// `rope_parameters.rope_type` as the config spells it.
fn config_rope_type(cfg: &Config) -> &str {
    cfg.rope
        .get("rope_type")
        .and_then(Json::as_str)
        .unwrap_or("")
}

/// `rope_parameters.rope_type` as transformers 5 leaves it for Phi-3 (`su`, `yarn` →
/// `longrope`), lower-cased as the reference compares it.
fn rope_type(cfg: &Config) -> String {
    match config_rope_type(cfg) {
        "su" | "yarn" => "longrope".into(),
        other => other.to_lowercase(),
    }
}

/// `rope_parameters["original_max_position_embeddings"]`: the top-level value for `longrope`
/// and `yarn` (transformers sets it there before renaming `yarn`), else the rope parameters'
/// own (`su` keeps it) or the top-level one (the reference copies it).
fn original_ctx(cfg: &Config) -> Result<u64> {
    let key = "original_max_position_embeddings";
    let rope = cfg.rope.get(key).filter(|v| !v.is_null());
    let v = match rope {
        Some(v) if !matches!(config_rope_type(cfg), "longrope" | "yarn") => v.as_u64(),
        _ => return cfg.need_u64(key),
    };
    v.ok_or_else(|| {
        cfg.err(format!(
            "`rope_parameters.{key}` is not an unsigned integer"
        ))
    })
}

/// `n_positions`, else `max_position_embeddings`.
fn context_length(cfg: &Config) -> Result<u64> {
    cfg.need_u64_of(&["n_positions", "max_position_embeddings"])
}

/// `int(partial_rotary_factor × hidden_size) // num_attention_heads`.
fn rope_dims(cfg: &Config) -> Result<u64> {
    let hidden = cfg.need_u64("hidden_size")?;
    let heads = cfg.need_u64("num_attention_heads")?;
    if heads == 0 {
        return Err(cfg.err("`num_attention_heads` is 0".into()));
    }
    // Python's int(): truncation towards zero.
    Ok((cfg.partial_rotary_factor(1.0)? * hidden as f64) as u64 / heads)
}

/// `Phi3MiniModel.set_gguf_parameters` (and `rope.scaling.attn_factor` from
/// `generate_extra_tensors`), `general.*` included.
pub fn phi3_model_kvs(cfg: &Config, file_type: FileType, name: &str) -> Result<Metadata> {
    let arch = cfg.spec.gguf_arch;
    let k = |s: &str| format!("{arch}.{s}");
    let mut m = super::arch::general_kvs(arch, name);
    if let Some(f) = attn_factor(cfg)? {
        m.insert_after(
            "general.architecture",
            k("rope.scaling.attn_factor"),
            Value::F32(f as f32),
        );
    }
    m.set(
        k("context_length"),
        cfg.u32_kv("max_position_embeddings", context_length(cfg)?)?,
    );
    m.set(
        k("rope.scaling.original_context_length"),
        cfg.u32_kv("original_max_position_embeddings", original_ctx(cfg)?)?,
    );
    m.set(k("embedding_length"), u32_of(cfg, "hidden_size")?);
    m.set(k("feed_forward_length"), u32_of(cfg, "intermediate_size")?);
    m.set(
        k("block_count"),
        cfg.u32_kv("num_hidden_layers", cfg.block_count()?)?,
    );
    m.set(
        k("attention.head_count"),
        u32_of(cfg, "num_attention_heads")?,
    );
    m.set(
        k("attention.head_count_kv"),
        u32_of(cfg, "num_key_value_heads")?,
    );
    m.set(
        k("attention.layer_norm_rms_epsilon"),
        Value::F32(cfg.need_f64("rms_norm_eps")? as f32),
    );
    m.set(
        k("rope.dimension_count"),
        cfg.u32_kv("hidden_size", rope_dims(cfg)?)?,
    );
    let theta = cfg
        .rope
        .get("rope_theta")
        .and_then(Json::as_f64)
        .ok_or_else(|| cfg.err("`rope_theta` is not a number".into()))?;
    m.set(k("rope.freq_base"), Value::F32(theta as f32));
    m.set("general.file_type", Value::U32(file_type.id()));
    let window = cfg.u64(&["sliding_window"])?.unwrap_or(0);
    m.set(
        k("attention.sliding_window"),
        cfg.u32_kv("sliding_window", window)?,
    );
    m.set(
        "general.quantization_version",
        Value::U32(GGML_QUANT_VERSION),
    );
    Ok(m)
}

fn u32_of(cfg: &Config, key: &str) -> Result<Value> {
    cfg.u32_kv(key, cfg.need_u64(key)?)
}

/// A LongRoPE factor list (`long_factor` / `short_factor`), `None` when absent or empty.
fn factors(cfg: &Config, key: &str) -> Result<Option<Vec<f32>>> {
    let Some(v) = cfg.rope.get(key).filter(|v| !v.is_null()) else {
        return Ok(None);
    };
    let bad = || cfg.err(format!("`rope_scaling.{key}` is not a list of numbers"));
    let list = v.as_array().ok_or_else(bad)?;
    let values: Option<Vec<f32>> = list.iter().map(|x| x.as_f64().map(|f| f as f32)).collect();
    Ok(Some(values.ok_or_else(bad)?).filter(|v| !v.is_empty()))
}

/// `rope.scaling.attn_factor` when the model has LongRoPE factors; an error for a rope type
/// the reference does not handle.
fn attn_factor(cfg: &Config) -> Result<Option<f64>> {
    if cfg.spec.family != Family::Phi3 || factors(cfg, "long_factor")?.is_none() {
        return Ok(None);
    }
    let ty = rope_type(cfg);
    if ty != "longrope" {
        return Err(cfg.err(format!(
            "rope scaling type `{ty}` with `long_factor`: only LongRoPE is supported"
        )));
    }
    let orig = original_ctx(cfg)? as f64;
    let scale = context_length(cfg)? as f64 / orig;
    Ok(Some(if scale > 1.0 {
        (1.0 + scale.ln() / orig.ln()).sqrt()
    } else {
        1.0
    }))
}

/// `generate_extra_tensors`: `rope_factors_long.weight` and `rope_factors_short.weight`
/// (LongRoPE only), each `rope.dimension_count / 2` values.
pub fn rope_factors(cfg: &Config) -> Result<Vec<(String, Vec<f32>)>> {
    if attn_factor(cfg)?.is_none() {
        return Ok(Vec::new());
    }
    let long = factors(cfg, "long_factor")?.unwrap_or_default();
    let Some(short) = factors(cfg, "short_factor")? else {
        return Err(cfg.err("LongRoPE `short_factor` is missing".into()));
    };
    let dims = rope_dims(cfg)?;
    if long.len() != short.len() || 2 * long.len() as u64 != dims {
        return Err(cfg.err(format!(
            "the LongRoPE factors must be rope dimensions / 2 = {} long, not {} (long) and {} (short)",
            dims as f64 / 2.0,
            long.len(),
            short.len()
        )));
    }
    Ok(vec![
        ("rope_factors_long.weight".into(), long),
        ("rope_factors_short.weight".into(), short),
    ])
}

/// Whether `Phi3MiniModel.set_vocab` takes GPT-2 BPE: `tokenizer_config.json` names
/// `GPT2Tokenizer` (Phi-4). The reference fails on a `tokenizer_config.json` without a
/// `tokenizer_class`; so does this.
pub fn gpt2_vocab(dir: &Path) -> Result<bool> {
    let path = dir.join("tokenizer_config.json");
    if !path.is_file() {
        return Ok(false);
    }
    let Some(tc) = read_json(&path)? else {
        return Ok(false);
    };
    match tc.get("tokenizer_class") {
        Some(class) => Ok(class.as_str() == Some("GPT2Tokenizer")),
        None => Err(tok_err(
            &path,
            "no `tokenizer_class`: Phi-3's converter reads it to choose the vocabulary",
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ones() -> Json {
        Json::from(vec![1.0; 8])
    }

    /// A Phi-3.5-shaped config (hidden 64, 4 heads: 8 factors) with `edit` over it.
    fn phi(edit: Json) -> Config {
        let mut c = serde_json::json!({
            "architectures": ["Phi3ForCausalLM"], "hidden_size": 64, "intermediate_size": 128,
            "num_attention_heads": 4, "num_hidden_layers": 2, "max_position_embeddings": 131072,
            "original_max_position_embeddings": 4096, "sliding_window": 262144,
            "rope_scaling": {"type": "longrope", "long_factor": [1, 2, 3, 4, 5, 6, 7, 8.5],
                             "short_factor": ones()},
        });
        for (k, v) in edit.as_object().unwrap() {
            c[k] = v.clone();
        }
        Config::from_json(Path::new("m/config.json"), c).unwrap()
    }

    #[test]
    fn longrope_gives_the_attention_factor_first_and_both_factor_tensors() {
        let m = phi3_model_kvs(&phi(serde_json::json!({})), FileType::MostlyBf16, "p").unwrap();
        let keys: Vec<&str> = m.iter().map(|(k, _)| k).take(3).collect();
        assert_eq!(
            keys,
            [
                "general.architecture",
                "phi3.rope.scaling.attn_factor",
                "general.type"
            ]
        );
        let want = (1.0 + 32f64.ln() / 4096f64.ln()).sqrt() as f32;
        assert_eq!(
            m.get("phi3.rope.scaling.attn_factor"),
            Some(&Value::F32(want))
        );
        assert_eq!(m.get("phi3.rope.scaling.type"), None);
        let t = rope_factors(&phi(serde_json::json!({}))).unwrap();
        assert_eq!(t[0].0, "rope_factors_long.weight");
        assert_eq!(t[0].1[7], 8.5);
        assert_eq!(t[1].1, vec![1.0; 8]);
    }

    /// transformers 5 renames `su` (early Phi-3-128k configs) and `yarn` to `longrope`; `yarn`
    /// (as `longrope`) takes the top-level original context, `su` keeps its own.
    #[test]
    fn su_and_yarn_are_longrope_with_their_original_context() {
        for (ty, orig) in [("su", 8192), ("yarn", 4096), ("longrope", 4096)] {
            let cfg = phi(serde_json::json!({"rope_scaling": {
                "type": ty, "long_factor": ones(), "short_factor": ones(),
                "original_max_position_embeddings": 8192,
            }}));
            let m = phi3_model_kvs(&cfg, FileType::MostlyF16, "p").unwrap();
            assert_eq!(
                m.get("phi3.rope.scaling.original_context_length"),
                Some(&Value::U32(orig)),
                "{ty}"
            );
            let want = (1.0 + (131072.0 / orig as f64).ln() / (orig as f64).ln()).sqrt();
            assert_eq!(
                m.get("phi3.rope.scaling.attn_factor"),
                Some(&Value::F32(want as f32)),
                "{ty}"
            );
        }
    }

    #[test]
    fn no_factors_no_extras_and_an_unset_window_is_0() {
        let cfg = phi(
            serde_json::json!({"rope_scaling": null, "sliding_window": null,
                                         "partial_rotary_factor": 0.75}),
        );
        let m = phi3_model_kvs(&cfg, FileType::MostlyF16, "p").unwrap();
        assert_eq!(m.get("phi3.rope.scaling.attn_factor"), None);
        assert_eq!(m.get("phi3.attention.sliding_window"), Some(&Value::U32(0)));
        // int(0.75 × 64) // 4
        assert_eq!(m.get("phi3.rope.dimension_count"), Some(&Value::U32(12)));
        assert!(rope_factors(&cfg).unwrap().is_empty());
    }

    #[test]
    fn factors_of_the_wrong_length_or_rope_type_are_refused_naming_the_file() {
        let short = phi(serde_json::json!({"partial_rotary_factor": 0.5}));
        let msg = rope_factors(&short).unwrap_err().to_string();
        assert!(
            msg.contains("m/config.json") && msg.contains("= 4 long, not 8"),
            "{msg}"
        );
        let dynamic = phi(serde_json::json!({"rope_scaling": {
            "type": "dynamic", "long_factor": ones(), "short_factor": ones()}}));
        let msg = rope_factors(&dynamic).unwrap_err().to_string();
        assert!(msg.contains("`dynamic`"), "{msg}");
    }

    #[test]
    fn the_tokenizer_class_chooses_gpt2_bpe_and_its_absence_is_an_error() {
        let d = tempfile::tempdir().unwrap();
        assert!(!gpt2_vocab(d.path()).unwrap());
        let tc = d.path().join("tokenizer_config.json");
        for (text, want) in [
            (r#"{"tokenizer_class": "GPT2Tokenizer"}"#, true),
            (r#"{"tokenizer_class": "LlamaTokenizer"}"#, false),
        ] {
            std::fs::write(&tc, text).unwrap();
            assert_eq!(gpt2_vocab(d.path()).unwrap(), want, "{text}");
        }
        std::fs::write(&tc, "{}").unwrap();
        let msg = gpt2_vocab(d.path()).unwrap_err().to_string();
        assert!(msg.contains("tokenizer_config.json") && msg.contains("tokenizer_class"));
    }
}
