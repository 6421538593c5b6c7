//! GLM-4.5 (`Glm4MoeForCausalLM` → `glm4moe`): what `Glm4MoeModel` in the reference's
//! `conversion/glm.py` adds to renaming.
//!
//! - The NextN/MTP layers (`num_nextn_predict_layers`, after the main ones) are kept: they count
//!   in `block_count`, and their `eh_proj`, `enorm`, `hnorm`, `embed_tokens` and `shared_head`
//!   tensors become `blk.N.nextn.*`.
//! - Partial rotary: `rope.dimension_count` is `head_dim × partial_rotary_factor` (0.5 when the
//!   config has none); Q/K are not permuted (GLM-4.5 already uses NeoX order).
//! - Routing KVs: sigmoid gating always, `expert_weights_norm` whenever `norm_topk_prob` is set.
//! - Special tokens from GLM's added tokens: `[gMASK]` as BOS, `<|user|>` as EOT,
//!   `<|endoftext|>` as UNK, `<|observation|>` as EOM, each unless the tokenizer files already
//!   name one (gguf-py's `SpecialVocab` keeps the first id it is given).

use std::path::Path;

use serde_json::Value as Json;

use super::arch::{
    Config, Family, LayerTable, EXPERTS, POST_ATTENTION_NORM, QK_NORMS, ROUTER_WITH_BIAS,
    SHARED_EXPERTS,
};
use super::kv::{Metadata, Value};
use crate::error::{Error, Result};

/// Per-layer names (after `model.layers.{bid}.`, without `.weight`/`.bias`) → GGUF names:
/// DeepSeek's routing and experts with Q/K norms, and the NextN/MTP layers' own tensors.
pub(super) const GLM4_MOE_LAYER: &[LayerTable] = &[
    POST_ATTENTION_NORM,
    QK_NORMS,
    ROUTER_WITH_BIAS,
    SHARED_EXPERTS,
    EXPERTS,
    &[
        ("eh_proj", "nextn.eh_proj"),
        ("embed_tokens", "nextn.embed_tokens"),
        ("enorm", "nextn.enorm"),
        ("hnorm", "nextn.hnorm"),
        ("shared_head.head", "nextn.shared_head_head"),
        ("shared_head.norm", "nextn.shared_head_norm"),
    ],
];

/// `ExpertGatingFuncType.SIGMOID`.
const GATING_SIGMOID: u32 = 2;

/// The NextN/MTP layers the reference keeps after the main ones (0 for other families).
pub(super) fn nextn_layers(cfg: &Config) -> Result<u64> {
    match cfg.spec.family {
        Family::Glm4Moe => Ok(cfg.u64(&["num_nextn_predict_layers"])?.unwrap_or(0)),
        _ => Ok(0),
    }
}

/// `Glm4MoeModel.set_gguf_parameters` after the common KVs.
pub(super) fn glm4moe_kvs(
    cfg: &Config,
    m: &mut Metadata,
    k: &dyn Fn(&str) -> String,
) -> Result<()> {
    let head_dim = match cfg.u64(&["head_dim"])? {
        Some(d) => d,
        None => cfg.need_u64("hidden_size")? / cfg.need_u64("num_attention_heads")?.max(1),
    };
    let factor = cfg.partial_rotary_factor(0.5)?;
    // Python's int(): truncation towards zero.
    m.set(
        k("rope.dimension_count"),
        cfg.u32_kv("head_dim", (head_dim as f64 * factor) as u64)?,
    );
    for (hf, gguf) in [
        ("n_routed_experts", "expert_count"),
        ("moe_intermediate_size", "expert_feed_forward_length"),
        ("n_shared_experts", "expert_shared_count"),
        ("first_k_dense_replace", "leading_dense_block_count"),
    ] {
        if let Some(v) = cfg.u64(&[hf])? {
            m.set(k(gguf), cfg.u32_kv(hf, v)?);
        }
    }
    m.set(k("expert_gating_func"), Value::U32(GATING_SIGMOID));
    if let Some(s) = cfg.f64(&["routed_scaling_factor"])? {
        m.set(k("expert_weights_scale"), Value::F32(s as f32));
    }
    if let Some(v) = cfg.find(&["norm_topk_prob"]) {
        let b = v
            .as_bool()
            .ok_or_else(|| cfg.err(format!("`norm_topk_prob` is {v}, not a boolean")))?;
        m.set(k("expert_weights_norm"), Value::Bool(b));
    }
    if let Some(n) = cfg.u64(&["num_nextn_predict_layers"])? {
        m.set(
            k("nextn_predict_layers"),
            cfg.u32_kv("num_nextn_predict_layers", n)?,
        );
    }
    Ok(())
}

/// `_set_vocab_glm`'s special tokens, looked up among `tokenizer.json`'s added tokens (the
/// reference fails with a `KeyError` when one is missing: an error naming it here), each set
/// only when the tokenizer files did not already give one, after the ids already there.
pub fn special_tokens(dir: &Path, m: &mut Metadata) -> Result<()> {
    let path = dir.join("tokenizer.json");
    let bad = |msg: String| Error::GgufTokenizer {
        path: path.clone(),
        msg,
    };
    let text = crate::sys::read_regular_to_string(&path).map_err(|e| Error::io(&path, e))?;
    let tj: Json = serde_json::from_str(&text).map_err(|e| bad(format!("not valid JSON: {e}")))?;
    let added = tj.get("added_tokens").and_then(Json::as_array);
    let id_of = |content: &str| {
        added
            .into_iter()
            .flatten()
            .find(|a| a.get("content").and_then(Json::as_str) == Some(content))
            .and_then(|a| a.get("id")?.as_u64())
            .ok_or_else(|| {
                bad(format!(
                    "GLM's special token `{content}` is not among the added tokens"
                ))
            })
    };
    let mut after = m
        .iter()
        .map(|(k, _)| k)
        .filter(|k| *k == "tokenizer.ggml.merges" || k.ends_with("_token_id"))
        .last()
        .unwrap_or("tokenizer.ggml.token_type")
        .to_string();
    for (key, content) in [
        ("tokenizer.ggml.bos_token_id", "[gMASK]"),
        ("tokenizer.ggml.eot_token_id", "<|user|>"),
        ("tokenizer.ggml.unknown_token_id", "<|endoftext|>"),
        ("tokenizer.ggml.eom_token_id", "<|observation|>"),
    ] {
        let id = id_of(content)?;
        if m.get(key).is_some() {
            continue;
        }
        let id = u32::try_from(id).map_err(|_| bad(format!("`{content}` has id {id}")))?;
        m.insert_after(&after, key, Value::U32(id));
        after = key.to_string();
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tokenizer_dir(added: &[(&str, u64)]) -> tempfile::TempDir {
        let dir = tempfile::tempdir().unwrap();
        let added: Vec<Json> = added
            .iter()
            .map(|(t, id)| serde_json::json!({"id": id, "content": t, "special": true}))
            .collect();
        let tj = serde_json::json!({"added_tokens": added, "model": {"type": "BPE"}});
        std::fs::write(dir.path().join("tokenizer.json"), tj.to_string()).unwrap();
        dir
    }

    const GLM_TOKENS: [(&str, u64); 4] = [
        ("[gMASK]", 7),
        ("<|user|>", 8),
        ("<|endoftext|>", 9),
        ("<|observation|>", 10),
    ];

    fn u32_at(m: &Metadata, key: &str) -> Option<u32> {
        match m.get(key) {
            Some(Value::U32(v)) => Some(*v),
            _ => None,
        }
    }

    /// Without ids from the tokenizer files, `[gMASK]` is BOS and the other three follow, after
    /// the ids already there (gguf-py's dict order).
    #[test]
    fn glm_special_tokens_fill_only_what_the_tokenizer_files_leave_unset() {
        let dir = tokenizer_dir(&GLM_TOKENS);
        let mut m = Metadata::new();
        m.set("tokenizer.ggml.merges", Value::Bool(true));
        m.set("tokenizer.ggml.eos_token_id", Value::U32(1));
        m.set("tokenizer.ggml.add_bos_token", Value::Bool(false));
        special_tokens(dir.path(), &mut m).unwrap();
        let keys: Vec<&str> = m.iter().map(|(k, _)| k).collect();
        assert_eq!(
            keys,
            [
                "tokenizer.ggml.merges",
                "tokenizer.ggml.eos_token_id",
                "tokenizer.ggml.bos_token_id",
                "tokenizer.ggml.eot_token_id",
                "tokenizer.ggml.unknown_token_id",
                "tokenizer.ggml.eom_token_id",
                "tokenizer.ggml.add_bos_token",
            ]
        );
        assert_eq!(u32_at(&m, "tokenizer.ggml.bos_token_id"), Some(7));
        assert_eq!(u32_at(&m, "tokenizer.ggml.eom_token_id"), Some(10));

        // A BOS the tokenizer files name is kept, as `_set_special_token` keeps the first.
        let mut m = Metadata::new();
        m.set("tokenizer.ggml.bos_token_id", Value::U32(3));
        special_tokens(dir.path(), &mut m).unwrap();
        assert_eq!(u32_at(&m, "tokenizer.ggml.bos_token_id"), Some(3));
        assert_eq!(u32_at(&m, "tokenizer.ggml.eot_token_id"), Some(8));
    }

    #[test]
    fn a_missing_glm_special_token_is_an_error_naming_it() {
        let dir = tokenizer_dir(&GLM_TOKENS[..3]);
        let err = special_tokens(dir.path(), &mut Metadata::new()).unwrap_err();
        let msg = err.to_string();
        assert!(
            msg.contains("`<|observation|>` is not among the added tokens"),
            "{msg}"
        );
        assert!(msg.contains("tokenizer.json"), "{msg}");
    }
}
