//! What llama.cpp's loader needs of a model, checked against the planned GGUF tensors before
//! any output exists: the token embeddings and the output norm, every block up to
//! `num_hidden_layers` with the tensors its sibling blocks have, and shapes that agree with
//! `config.json` (`hidden_size`, `vocab_size`, heads × head size, `intermediate_size`, the
//! expert count). The reference converter writes such a model anyway and llama.cpp then fails
//! to load it (`missing tensor`, `wrong shape`); here the conversion stops, naming the tensor
//! and the field.

use std::collections::{BTreeMap, BTreeSet};

use super::arch::{Config, Family};
use super::recipe::{OutputTensor, Recipe};
use crate::error::{Error, Result};

/// Refuses a planned GGUF model llama.cpp could not load.
pub fn refuse_incomplete(cfg: &Config, outputs: &[OutputTensor]) -> Result<()> {
    let by_name: BTreeMap<&str, &OutputTensor> =
        outputs.iter().map(|o| (o.name.as_str(), o)).collect();
    for (name, hf) in [
        ("token_embd.weight", "model.embed_tokens.weight"),
        ("output_norm.weight", "model.norm.weight"),
    ] {
        if !by_name.contains_key(name) {
            return Err(missing(name, &format!("the checkpoint has no `{hf}`")));
        }
    }
    blocks_complete(cfg, outputs)?;
    for o in outputs {
        if let Some(want) = expected_shape(cfg, &o.name)? {
            let agrees = if want.leading_only {
                o.shape.first() == want.shape.first()
            } else {
                o.shape == want.shape
            };
            if !agrees {
                return Err(Error::GgufConfig {
                    path: cfg.path.clone(),
                    msg: format!(
                    "tensor `{}`{} is {:?} but {} make it {:?}; llama.cpp would refuse the GGUF",
                    o.name,
                    source_of(o).map_or(String::new(), |s| format!(" (from `{s}`)")),
                    o.shape,
                    want.because,
                    want.shape
                ),
                });
            }
        }
    }
    Ok(())
}

fn missing(name: &str, why: &str) -> Error {
    Error::GgufTensor {
        tensor: name.into(),
        msg: format!("missing: {why}; llama.cpp cannot load a model without it"),
    }
}

/// Every block `0..num_hidden_layers` has tensors, and each has every tensor the other blocks
/// of its kind (dense or mixture-of-experts) have.
fn blocks_complete(cfg: &Config, outputs: &[OutputTensor]) -> Result<()> {
    let blocks = cfg.block_count()?;
    let mut per_block: BTreeMap<u64, BTreeSet<&str>> = BTreeMap::new();
    for o in outputs {
        let Some(rest) = o.name.strip_prefix("blk.") else {
            continue;
        };
        if let Some((b, suffix)) = rest
            .split_once('.')
            .and_then(|(b, s)| Some((b.parse::<u64>().ok()?, s)))
        {
            let set = per_block.entry(b).or_default();
            // GLM-4.5's NextN layers have their own tensors on top of a MoE block's.
            if !suffix.starts_with("nextn.") {
                set.insert(suffix);
            }
        }
    }
    if let Some(b) = (0..blocks).find(|b| !per_block.contains_key(b)) {
        return Err(missing(
            &format!("blk.{b}"),
            &format!(
                "block {b} of num_hidden_layers = {blocks} has no tensors (no `model.layers.{b}.*`)"
            ),
        ));
    }
    let moe = |set: &BTreeSet<&str>| set.contains("ffn_gate_inp.weight");
    for kind in [false, true] {
        let union: BTreeSet<&str> = per_block
            .values()
            .filter(|s| moe(s) == kind)
            .flatten()
            .copied()
            .collect();
        for (b, set) in per_block.iter().filter(|(_, s)| moe(s) == kind) {
            if let Some(gone) = union.iter().find(|s| !set.contains(*s)) {
                return Err(missing(
                    &format!("blk.{b}.{gone}"),
                    &format!("other blocks have `{gone}` but block {b} does not"),
                ));
            }
        }
    }
    Ok(())
}

/// A shape the config implies, and which fields say so.
struct Expected {
    shape: Vec<u64>,
    /// Only the outermost dimension is implied (the expert count of a stacked expert tensor).
    leading_only: bool,
    because: String,
}

/// The shape (outermost first) `config.json` implies for GGUF tensor `name`, where it implies
/// one that every supported architecture shares.
fn expected_shape(cfg: &Config, name: &str) -> Result<Option<Expected>> {
    let hidden = cfg.u64(&["hidden_size", "n_embd", "dim"])?;
    let vocab = cfg.u64(&["vocab_size"])?;
    let field = |keys: &[(&str, u64)]| -> String {
        let parts: Vec<String> = keys.iter().map(|(k, v)| format!("{k} = {v}")).collect();
        format!("config.json's {}", parts.join(", "))
    };
    let base = name.rsplit_once('.').map_or(name, |(b, _)| b);
    let weight = name.ends_with(".weight");
    let block = base
        .strip_prefix("blk.")
        .and_then(|r| r.split_once('.'))
        .map(|(_, b)| b);
    let expect = |shape: Vec<u64>, keys: &[(&str, u64)]| {
        Ok(Some(Expected {
            shape,
            leading_only: false,
            because: field(keys),
        }))
    };
    match (base, block, hidden) {
        ("token_embd" | "output", _, Some(h)) if weight => match vocab {
            Some(v) => expect(vec![v, h], &[("vocab_size", v), ("hidden_size", h)]),
            None => Ok(None),
        },
        ("output_norm", _, Some(h))
        | (_, Some("attn_norm" | "ffn_norm" | "post_attention_norm"), Some(h))
            if weight =>
        {
            expect(vec![h], &[("hidden_size", h)])
        }
        (_, Some(b), Some(h)) if weight => block_shape(cfg, b, h),
        _ => Ok(None),
    }
}

/// Attention, dense feed-forward and expert shapes of one block tensor (`b`: its name after
/// `blk.N.`, without `.weight`).
fn block_shape(cfg: &Config, b: &str, hidden: u64) -> Result<Option<Expected>> {
    let plain_attention = cfg.spec.family != Family::DeepseekV3;
    let heads = cfg.u64(&["num_attention_heads", "n_head", "n_heads"])?;
    let kv_heads = cfg.u64(&["num_key_value_heads", "n_kv_heads"])?.or(heads);
    let head_dim = match cfg.u64(&["head_dim"])? {
        Some(d) => Some(d),
        None => heads.filter(|&h| h > 0).map(|h| hidden / h),
    };
    let ff = cfg.u64(&[
        "prefix_dense_intermediate_size",
        "dense_intermediate_size",
        "intermediate_size",
        "n_inner",
        "hidden_dim",
    ])?;
    let experts = cfg.u64(&["num_local_experts", "num_experts", "n_routed_experts"])?;
    let because = |keys: &[(&str, Option<u64>)]| {
        let parts: Vec<String> = keys
            .iter()
            .map(|(k, v)| format!("{k} = {}", v.unwrap_or(0)))
            .collect();
        format!("config.json's {}", parts.join(", "))
    };
    let (shape, fields) = match (b, heads, kv_heads, head_dim, ff) {
        ("attn_q", Some(h), _, Some(d), _) if plain_attention => (
            vec![h * d, hidden],
            vec![("num_attention_heads", heads), ("head_dim", head_dim)],
        ),
        ("attn_k" | "attn_v", _, Some(k), Some(d), _) if plain_attention => (
            vec![k * d, hidden],
            vec![("num_key_value_heads", kv_heads), ("head_dim", head_dim)],
        ),
        ("attn_output", Some(h), _, Some(d), _) if plain_attention => (
            vec![hidden, h * d],
            vec![("num_attention_heads", heads), ("head_dim", head_dim)],
        ),
        ("attn_qkv", Some(h), Some(k), Some(d), _) => (
            vec![(h + 2 * k) * d, hidden],
            vec![
                ("num_attention_heads", heads),
                ("num_key_value_heads", kv_heads),
                ("head_dim", head_dim),
            ],
        ),
        ("ffn_gate", _, _, _, Some(f)) => (
            vec![f, hidden],
            vec![("intermediate_size", ff), ("hidden_size", Some(hidden))],
        ),
        // Phi-3's fused gate and up: twice the rows.
        ("ffn_up", _, _, _, Some(f)) => (
            vec![
                f * super::arch_phi::ffn_up_rows_per_ff(cfg.spec.family),
                hidden,
            ],
            vec![("intermediate_size", ff), ("hidden_size", Some(hidden))],
        ),
        ("ffn_down", _, _, _, Some(f)) => (
            vec![hidden, f],
            vec![("intermediate_size", ff), ("hidden_size", Some(hidden))],
        ),
        _ => {
            return Ok(experts
                .filter(|_| b.ends_with("_exps") || b == "ffn_gate_inp")
                .map(|e| Expected {
                    shape: vec![e],
                    leading_only: true,
                    because: because(&[("num_experts", experts)]),
                }))
        }
    };
    Ok(Some(Expected {
        shape,
        leading_only: false,
        because: because(&fields),
    }))
}

/// The checkpoint tensor a GGUF tensor comes from, when it is one.
fn source_of(o: &OutputTensor) -> Option<&str> {
    match &o.recipe {
        Recipe::Direct { src }
        | Recipe::Rows { src, .. }
        | Recipe::Shifted { src, .. }
        | Recipe::Ternary { src }
        | Recipe::ExpertColumns { src, .. } => Some(src),
        Recipe::Stack { srcs } => srcs.first().map(String::as_str),
        _ => None,
    }
}
