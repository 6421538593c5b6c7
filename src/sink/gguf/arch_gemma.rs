//! Gemma 2 and Gemma 3 (text) as `conversion/gemma.py` writes them.
//!
//! - Both store RMSNorm weights as `w` for `x · (1 + w)`: every `*norm.weight` gets `+ 1`,
//!   added in f32 after the reference widens BF16 to f32 ([`Recipe::Shifted`]).
//! - Gemma 2's `set_gguf_parameters` does not call the common one: no rope KVs, and its soft-caps
//!   and sliding window are required. `lm_head.weight` is dropped (the embeddings are tied).
//! - Gemma 3 takes the common KVs, then its class defaults, `rope.freq_base_swa` (the local
//!   layers' theta), `final_logit_softcapping` when set, and the sliding window unless
//!   `sliding_window_pattern` is 1. `Gemma3ForConditionalGeneration` is read through its
//!   `text_config`; its vision tower and projector are left out as the converter leaves them
//!   out of the text GGUF. Embedding rows past the vocabulary the GGUF lists are cut.

use serde_json::Value as Json;

use super::arch::{Config, Family, GGML_QUANT_VERSION};
use super::kv::{Metadata, Value};
use super::recipe::Recipe;
use super::sentencepiece::load_pieces;
use super::FileType;
use crate::error::Result;

/// Whether the architecture adds 1 to its stored norm weights.
pub fn shifts_norms(fam: Family) -> bool {
    matches!(fam, Family::Gemma2 | Family::Gemma3)
}

/// The recipe of a Gemma norm weight `src` (HF name after the reference's renames `name`), or
/// `None` when it is not one.
pub fn norm_recipe(fam: Family, name: &str, src: &str) -> Option<Recipe> {
    (shifts_norms(fam) && name.ends_with("norm.weight")).then(|| Recipe::Shifted {
        src: src.into(),
        add: 1.0,
    })
}

/// Whether the converter drops checkpoint tensor `name` for Gemma: Gemma 2's `lm_head.weight`
/// (its embeddings are tied).
pub fn skipped(fam: Family, name: &str) -> bool {
    fam == Family::Gemma2 && name == "lm_head.weight"
}

/// Gemma 2's KVs (`Gemma2Model.set_gguf_parameters`), `general.*` included.
pub fn gemma2_model_kvs(cfg: &Config, file_type: FileType, name: &str) -> Result<Metadata> {
    let arch = cfg.spec.gguf_arch;
    let k = |s: &str| format!("{arch}.{s}");
    let mut m = super::arch::general_kvs(arch, name);
    let u32s = [
        ("max_position_embeddings", "context_length"),
        ("hidden_size", "embedding_length"),
        ("num_hidden_layers", "block_count"),
        ("intermediate_size", "feed_forward_length"),
        ("num_attention_heads", "attention.head_count"),
        ("num_key_value_heads", "attention.head_count_kv"),
    ];
    for (hf, gguf) in u32s {
        m.set(k(gguf), cfg.u32_kv(hf, cfg.need_u64(hf)?)?);
    }
    m.set(
        k("attention.layer_norm_rms_epsilon"),
        Value::F32(cfg.need_f64("rms_norm_eps")? as f32),
    );
    let head_dim = cfg.need_u64("head_dim")?;
    m.set(k("attention.key_length"), cfg.u32_kv("head_dim", head_dim)?);
    m.set(
        k("attention.value_length"),
        cfg.u32_kv("head_dim", head_dim)?,
    );
    m.set("general.file_type", Value::U32(file_type.id()));
    for (hf, gguf) in [
        ("attn_logit_softcapping", "attn_logit_softcapping"),
        ("final_logit_softcapping", "final_logit_softcapping"),
    ] {
        m.set(k(gguf), Value::F32(cfg.need_f64(hf)? as f32));
    }
    m.set(
        k("attention.sliding_window"),
        cfg.u32_kv("sliding_window", cfg.need_u64("sliding_window")?)?,
    );
    m.set(
        "general.quantization_version",
        Value::U32(GGML_QUANT_VERSION),
    );
    Ok(m)
}

/// `Gemma3Model.set_gguf_parameters` after the common KVs (`cfg` holds the class defaults).
pub fn gemma3_kvs(cfg: &Config, m: &mut Metadata, k: &dyn Fn(&str) -> String) -> Result<()> {
    if let Some(theta) = local_rope_theta(cfg)? {
        m.set(k("rope.freq_base_swa"), Value::F32(theta as f32));
    }
    if cfg.find(&["attn_logit_softcapping"]).is_some() {
        return Err(cfg.err("`attn_logit_softcapping` is set, but Gemma 3 has none".into()));
    }
    if let Some(cap) = cfg.f64(&["final_logit_softcapping"])?.filter(|c| *c != 0.0) {
        m.set(k("final_logit_softcapping"), Value::F32(cap as f32));
    }
    if cfg.map.get("sliding_window_pattern").and_then(Json::as_u64) != Some(1) {
        m.set(
            k("attention.sliding_window"),
            cfg.u32_kv("sliding_window", cfg.need_u64("sliding_window")?)?,
        );
    }
    Ok(())
}

/// The local (sliding-window) layers' rope theta: `rope_parameters.sliding_attention`, else
/// the first of the keys the reference looks for.
fn local_rope_theta(cfg: &Config) -> Result<Option<f64>> {
    let nested = cfg
        .map
        .get("rope_parameters")
        .and_then(|r| r.pointer("/sliding_attention/rope_theta"))
        .and_then(Json::as_f64);
    match nested {
        Some(t) => Ok(Some(t)),
        None => cfg.f64(&[
            "local_rope_theta",
            "rope_local_theta",
            "rope_theta_local",
            "swa_rope_theta",
            "rope_local_base_freq",
        ]),
    }
}

/// Gemma 3: the number of tokens the GGUF lists, to which the embedding rows are cut (the
/// SentencePiece vocabulary padded to `vocab_size`, or `tokenizer.json`'s vocabulary and
/// added tokens).
pub fn gemma3_vocab_rows(cfg: &Config) -> Result<Option<u64>> {
    if cfg.spec.family != Family::Gemma3 {
        return Ok(None);
    }
    let dir = cfg.path.parent().unwrap_or(std::path::Path::new("."));
    let spm = dir.join("tokenizer.model");
    if spm.exists() {
        let vocab = cfg.u64(&["vocab_size_per_layer_input", "vocab_size"])?;
        return match vocab.filter(|&v| v > 0) {
            Some(v) => Ok(Some(v)),
            None => Ok(Some(load_pieces(&spm)?.len() as u64)),
        };
    }
    let tj = super::tokenizer::read_json(&dir.join("tokenizer.json"))?;
    Ok(tj.map(|tj| {
        let n = |p: &str| {
            tj.pointer(p).map_or(0, |v| match v {
                Json::Object(o) => o.len(),
                Json::Array(a) => a.len(),
                _ => 0,
            })
        };
        (n("/model/vocab") + n("/added_tokens")) as u64
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gemma3(edit: Json) -> Config {
        let base = serde_json::json!({
            "architectures": ["Gemma3ForCausalLM"], "hidden_size": 64, "intermediate_size": 128,
            "num_attention_heads": 4, "num_hidden_layers": 2, "head_dim": 32,
            "sliding_window": 512, "vocab_size": 400, "rope_local_base_freq": 10000.0,
        });
        Config::edited(base, edit)
    }

    fn kvs(cfg: &Config) -> Result<Metadata> {
        let mut m = Metadata::new();
        gemma3_kvs(cfg, &mut m, &|s: &str| format!("gemma3.{s}"))?;
        Ok(m)
    }

    #[test]
    fn gemma3_kvs_take_the_local_theta_and_the_sliding_window_unless_the_pattern_is_1() {
        let edited = serde_json::json!({
            "sliding_window_pattern": 1, "final_logit_softcapping": 30.0,
            "rope_parameters": {"sliding_attention": {"rope_theta": 5000.0}},
        });
        // (edit, local theta, sliding window, final soft-cap)
        for (edit, theta, window, cap) in [
            (serde_json::json!({}), 10000.0, Some(Value::U32(512)), None),
            (edited, 5000.0, None, Some(Value::F32(30.0))),
        ] {
            let m = kvs(&gemma3(edit)).unwrap();
            let got = |key: &str| m.get(&format!("gemma3.{key}")).cloned();
            assert_eq!(got("rope.freq_base_swa"), Some(Value::F32(theta)));
            assert_eq!(got("attention.sliding_window"), window);
            assert_eq!(got("final_logit_softcapping"), cap);
        }
    }

    #[test]
    fn gemma3_with_an_attention_soft_cap_is_refused_naming_the_key_and_file() {
        let cfg = gemma3(serde_json::json!({"attn_logit_softcapping": 50.0}));
        let msg = kvs(&cfg).unwrap_err().to_string();
        assert!(msg.contains("`attn_logit_softcapping` is set"), "{msg}");
        assert!(msg.contains("m/config.json"), "{msg}");
    }

    #[test]
    fn only_gemma_norm_weights_are_shifted_and_only_gemma_drops_lm_head() {
        assert!(norm_recipe(Family::Gemma2, "model.norm.weight", "s").is_some());
        assert!(norm_recipe(
            Family::Gemma3,
            "model.layers.0.self_attn.q_norm.weight",
            "s"
        )
        .is_some());
        assert!(norm_recipe(Family::Gemma3, "model.layers.0.mlp.up_proj.weight", "s").is_none());
        assert!(norm_recipe(Family::Olmo2, "model.norm.weight", "s").is_none());
        assert!(skipped(Family::Gemma2, "lm_head.weight"));
        assert!(!skipped(Family::Granite, "lm_head.weight"));
    }
}
