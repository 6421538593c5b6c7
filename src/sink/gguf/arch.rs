//! Architecture table: which Hugging Face model classes we convert, how their tensors are
//! named and transformed in GGUF, and which hyperparameter KVs they get.
//!
//! Adding an architecture is one [`ArchSpec`] entry (its HF class names, GGUF name, the
//! transformers config defaults the reference sees, and its tensor-name table) plus, where its
//! tensors need more than a rename, one arm in [`plan_tensors`]'s special cases. Names and
//! rules come from `gguf-py/gguf/{constants,tensor_mapping}.py` and `conversion/{base,llama,
//! qwen,gpt_oss,deepseek}.py`.
//!
//! The reference reads `config.json` through transformers' `AutoConfig(...).to_dict()`, so class
//! defaults absent from the file are written too (Llama's derived `head_dim` becomes
//! `attention.key_length`, for example); each entry carries the defaults of its class as of
//! transformers 5, checked against `to_dict()` by the test fixtures.

use std::path::{Path, PathBuf};

use serde_json::{Map, Value as Json};

use super::kv::{Metadata, Value};
use super::FileType;
use crate::error::{Error, Result};
use crate::format::dtype::DType;

/// `GGML_QUANT_VERSION`, written as `general.quantization_version`.
pub const GGML_QUANT_VERSION: u32 = 2;

/// Which code paths an architecture takes beyond renaming.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Family {
    /// Q/K rotary permutation, Mixtral expert stacking, Llama-3 `rope_freqs`.
    Llama,
    Qwen2,
    Qwen3,
    Qwen3Moe,
    GptOss,
    DeepseekV3,
    /// Llama's tensors and KVs without `head_dim` (the reference drops it), plus Granite's
    /// four multipliers.
    Granite,
    /// Renames only; OLMo 2 norms after attention and feed-forward, full-width Q/K norms.
    Olmo2,
    /// Norms `+ 1`, its own KVs (soft-caps, sliding window), `lm_head` dropped
    /// (`arch_gemma.rs`).
    Gemma2,
    /// Norms `+ 1`, the common KVs plus local rope theta and sliding window, embedding rows
    /// cut to the vocabulary, multimodal tensors left out (`arch_gemma.rs`).
    Gemma3,
    /// GLM-4.5 (`arch_glm`): NextN/MTP layers kept, partial rotary, sigmoid-routed experts.
    Glm4Moe,
    /// Phi-3 and Phi-4 (`arch_phi`): fused QKV and gate/up, its own KVs, LongRoPE factors.
    Phi3,
    /// Llama 4 text: Llama's KVs and `rope_freqs` without the Q/K permutation, dense and MoE
    /// layers interleaved, fused transposed experts split per column (`ExpertColumns`).
    Llama4,
    /// BitNet b1.58: Llama's layout without the Q/K permutation, sub-norms inside attention
    /// and feed-forward, latent projections ternarised (`Recipe::Ternary`; packed ones are
    /// written as they decode), linear rope scaling of 1 written.
    Bitnet,
}

/// A config default: a number, or derived from other keys.
#[derive(Debug, Clone, Copy)]
pub enum ConfigDefault {
    Int(u64),
    Float(f64),
    Bool(bool),
    /// `hidden_size / num_attention_heads`.
    HiddenPerHead,
    /// A number, unless the file sets the key to null: then `hidden_size / num_attention_heads`.
    HiddenPerHeadOr(u64),
    /// A number, unless the file sets the key to null: then null (`int | None` fields, such as
    /// DeepSeek's `q_lora_rank`, null in V2-Lite).
    IntOrNull(u64),
    /// The value of `num_attention_heads`.
    SameAsHeads,
    /// Always the value of another key, whatever the file says (DeepSeek-V3's `head_dim` is
    /// its `qk_rope_head_dim`).
    Always(&'static str),
}

/// One supported architecture.
#[derive(Debug)]
pub struct ArchSpec {
    /// `architectures[0]` values in `config.json`.
    pub hf_classes: &'static [&'static str],
    /// `general.architecture`.
    pub gguf_arch: &'static str,
    pub family: Family,
    /// transformers config class defaults the reference sees (keys it reads only).
    pub defaults: &'static [(&'static str, ConfigDefault)],
    /// `rope_parameters` when the config has neither it nor `rope_scaling`.
    pub rope_theta_default: f64,
    /// Per-layer names: HF name after `model.layers.{bid}.` without `.weight`/`.bias` → GGUF
    /// name after `blk.{bid}.`, in tables searched in order, then `COMMON_LAYER_TABLE`.
    pub layer_tensors: &'static [LayerTable],
}

/// Per-layer names (HF → GGUF), as in [`ArchSpec::layer_tensors`].
pub type LayerTable = &'static [(&'static str, &'static str)];

pub(super) const COMMON_LAYER_TABLE: LayerTable = &[
    ("input_layernorm", "attn_norm"),
    ("self_attn.q_proj", "attn_q"),
    ("self_attn.k_proj", "attn_k"),
    ("self_attn.v_proj", "attn_v"),
    ("self_attn.o_proj", "attn_output"),
    ("post_attention_layernorm", "ffn_norm"),
    ("mlp.gate_proj", "ffn_gate"),
    ("mlp.up_proj", "ffn_up"),
    ("mlp.down_proj", "ffn_down"),
];

pub(super) const GLOBAL_TABLE: &[(&str, &str)] = &[
    ("model.embed_tokens.weight", "token_embd.weight"),
    ("model.norm.weight", "output_norm.weight"),
    ("lm_head.weight", "output.weight"),
];

/// Q/K norms (Qwen3, OLMo 2, Gemma 3, GLM-4.5).
pub(super) const QK_NORMS: LayerTable = &[
    ("self_attn.q_norm", "attn_q_norm"),
    ("self_attn.k_norm", "attn_k_norm"),
];

/// The norm after attention where the feed-forward one has another name.
pub(super) const POST_ATTENTION_NORM: LayerTable =
    &[("post_attention_layernorm", "post_attention_norm")];

/// The router of `mlp.experts.*`, and DeepSeek's/GLM's routing bias.
const ROUTER: LayerTable = &[("mlp.gate", "ffn_gate_inp")];
pub(super) const ROUTER_WITH_BIAS: LayerTable = &[
    ("mlp.gate", "ffn_gate_inp"),
    ("mlp.gate.e_score_correction", "exp_probs_b"),
];

/// Routed experts, stacked (`mlp.experts.{gate,up,down}_proj`).
pub(super) const EXPERTS: LayerTable = &[
    ("mlp.experts.gate_proj", "ffn_gate_exps"),
    ("mlp.experts.up_proj", "ffn_up_exps"),
    ("mlp.experts.down_proj", "ffn_down_exps"),
];

/// DeepSeek's and GLM-4.5's shared experts.
pub(super) const SHARED_EXPERTS: LayerTable = &[
    ("mlp.shared_experts.gate_proj", "ffn_gate_shexp"),
    ("mlp.shared_experts.up_proj", "ffn_up_shexp"),
    ("mlp.shared_experts.down_proj", "ffn_down_shexp"),
];

/// DeepSeek-V2/V3's MLA. V2-Lite's plain `q_proj` is common.
const DEEPSEEK_MLA: LayerTable = &[
    ("self_attn.q_a_proj", "attn_q_a"),
    ("self_attn.q_a_layernorm", "attn_q_a_norm"),
    ("self_attn.q_b_proj", "attn_q_b"),
    ("self_attn.kv_a_proj_with_mqa", "attn_kv_a_mqa"),
    ("self_attn.kv_a_layernorm", "attn_kv_a_norm"),
];
const DEEPSEEK_LAYER: &[LayerTable] = &[DEEPSEEK_MLA, ROUTER_WITH_BIAS, SHARED_EXPERTS, EXPERTS];

/// Llama 4's feed-forward: dense layers, the router, the shared expert. The routed experts
/// (`feed_forward.experts.{gate_up,down}_proj`) are planned by `recipe::llama4_experts`.
const LLAMA4_LAYER: LayerTable = &[
    ("feed_forward.gate_proj", "ffn_gate"),
    ("feed_forward.up_proj", "ffn_up"),
    ("feed_forward.down_proj", "ffn_down"),
    ("feed_forward.router", "ffn_gate_inp"),
    ("feed_forward.shared_expert.gate_proj", "ffn_gate_shexp"),
    ("feed_forward.shared_expert.up_proj", "ffn_up_shexp"),
    ("feed_forward.shared_expert.down_proj", "ffn_down_shexp"),
];

/// BitNet's sub-norms: the 1bitLLM names the reference's tensor map knows, and the names
/// transformers' BitNet (`microsoft/bitnet-b1.58-2B-4T`) uses, which it does not.
const BITNET_LAYER: LayerTable = &[
    ("self_attn.inner_attn_ln", "attn_sub_norm"),
    ("mlp.ffn_layernorm", "ffn_sub_norm"),
    ("self_attn.attn_sub_norm", "attn_sub_norm"),
    ("mlp.ffn_sub_norm", "ffn_sub_norm"),
];

/// `model_type`s transformers does not know (their checkpoints ship remote code): the
/// reference, which never runs remote code, falls back to reading `config.json` as it is, so
/// no class defaults apply. Kimi K2 is a DeepSeek-V3 checkpoint with `kimi_k2`.
const RAW_CONFIG_MODEL_TYPES: &[&str] = &["kimi_k2"];

use ConfigDefault::*;

/// Gemma 2 and 3: norms before and after attention and feed-forward, Q/K norms (Gemma 3).
const GEMMA_NORMS: LayerTable = &[
    ("pre_feedforward_layernorm", "ffn_norm"),
    ("post_feedforward_layernorm", "post_ffw_norm"),
];
const GEMMA_LAYER: &[LayerTable] = &[POST_ATTENTION_NORM, GEMMA_NORMS, QK_NORMS];

/// One [`ArchSpec`].
const fn spec(
    hf_classes: &'static [&'static str],
    gguf_arch: &'static str,
    family: Family,
    rope_theta_default: f64,
    layer_tensors: &'static [LayerTable],
    defaults: &'static [(&'static str, ConfigDefault)],
) -> ArchSpec {
    ArchSpec {
        hf_classes,
        gguf_arch,
        family,
        defaults,
        rope_theta_default,
        layer_tensors,
    }
}

/// The supported architectures: HF classes, GGUF arch, family, rope theta default, layer
/// tables, then the transformers class defaults (one table row each; not reflowed).
#[rustfmt::skip]
pub static ARCHS: &[ArchSpec] = &[
    spec(&["LlamaForCausalLM"], "llama", Family::Llama, 10000.0, &[], &[
        ("max_position_embeddings", Int(2048)), ("rms_norm_eps", Float(1e-6)),
        ("num_key_value_heads", SameAsHeads), ("head_dim", HiddenPerHead),
    ]),
    spec(&["MistralForCausalLM"], "llama", Family::Llama, 10000.0, &[], &[
        ("max_position_embeddings", Int(131072)), ("rms_norm_eps", Float(1e-6)),
        ("num_key_value_heads", Int(8)), ("head_dim", HiddenPerHead),
    ]),
    spec(&["MixtralForCausalLM"], "llama", Family::Llama, 1e6, &[&[
        ("block_sparse_moe.gate", "ffn_gate_inp"),
        ("block_sparse_moe.experts.w1", "ffn_gate_exps"),
        ("block_sparse_moe.experts.w2", "ffn_down_exps"),
        ("block_sparse_moe.experts.w3", "ffn_up_exps"),
    ]], &[
        ("max_position_embeddings", Int(131072)), ("rms_norm_eps", Float(1e-5)),
        ("num_key_value_heads", Int(8)), ("num_local_experts", Int(8)), ("num_experts_per_tok", Int(2)),
    ]),
    spec(&["Qwen2ForCausalLM"], "qwen2", Family::Qwen2, 10000.0, &[], &[
        ("max_position_embeddings", Int(32768)), ("rms_norm_eps", Float(1e-6)), ("num_key_value_heads", Int(32)),
    ]),
    spec(&["Qwen3ForCausalLM"], "qwen3", Family::Qwen3, 10000.0, &[QK_NORMS], &[
        ("max_position_embeddings", Int(32768)), ("rms_norm_eps", Float(1e-6)),
        ("num_key_value_heads", Int(32)), ("head_dim", Int(128)),
    ]),
    // config.json spells `num_experts`; transformers maps it to `num_local_experts`.
    spec(&["Qwen3MoeForCausalLM"], "qwen3moe", Family::Qwen3Moe, 10000.0, &[QK_NORMS, ROUTER, EXPERTS], &[
        ("max_position_embeddings", Int(32768)), ("rms_norm_eps", Float(1e-6)), ("num_key_value_heads", Int(4)),
        ("num_experts_per_tok", Int(8)), ("moe_intermediate_size", Int(768)), ("num_experts", Int(128)),
        ("norm_topk_prob", Bool(false)),
    ]),
    spec(&["GptOssForCausalLM"], "gpt-oss", Family::GptOss, 150000.0, &[POST_ATTENTION_NORM, &[
        ("self_attn.sinks", "attn_sinks"),
        ("mlp.router", "ffn_gate_inp"),
    ], EXPERTS], &[
        ("max_position_embeddings", Int(131072)), ("rms_norm_eps", Float(1e-5)),
        ("num_key_value_heads", Int(8)), ("head_dim", HiddenPerHeadOr(64)), ("num_experts_per_tok", Int(4)),
        ("num_local_experts", Int(128)), ("sliding_window", Int(128)),
    ]),
    // `head_dim` last: it copies `qk_rope_head_dim`.
    spec(&["DeepseekV3ForCausalLM"], "deepseek2", Family::DeepseekV3, 10000.0, DEEPSEEK_LAYER, &[
        ("max_position_embeddings", Int(4096)), ("rms_norm_eps", Float(1e-6)),
        ("num_key_value_heads", SameAsHeads), ("num_experts_per_tok", Int(8)),
        ("moe_intermediate_size", Int(2048)), ("norm_topk_prob", Bool(true)), ("n_group", Int(8)),
        ("topk_group", Int(4)), ("n_routed_experts", Int(256)), ("n_shared_experts", Int(1)),
        ("routed_scaling_factor", Float(2.5)), ("first_k_dense_replace", Int(3)),
        ("kv_lora_rank", Int(512)), ("q_lora_rank", IntOrNull(1536)), ("qk_rope_head_dim", Int(64)),
        ("qk_nope_head_dim", Int(128)), ("v_head_dim", Int(128)), ("head_dim", Always("qk_rope_head_dim")),
    ]),
    // The reference's Qwen3-MoE class is Qwen2-MoE's: the same KVs and expert stacking.
    spec(&["Qwen2MoeForCausalLM"], "qwen2moe", Family::Qwen3Moe, 10000.0, &[ROUTER, EXPERTS, &[
        ("mlp.shared_expert_gate", "ffn_gate_inp_shexp"),
        ("mlp.shared_expert.gate_proj", "ffn_gate_shexp"),
        ("mlp.shared_expert.up_proj", "ffn_up_shexp"),
        ("mlp.shared_expert.down_proj", "ffn_down_shexp"),
    ]], &[
        ("max_position_embeddings", Int(32768)), ("rms_norm_eps", Float(1e-6)), ("num_key_value_heads", Int(16)),
        ("num_experts_per_tok", Int(4)), ("moe_intermediate_size", Int(1408)),
        ("shared_expert_intermediate_size", Int(5632)), ("num_experts", Int(60)),
    ]),
    spec(&["GraniteForCausalLM"], "granite", Family::Granite, 10000.0, &[], &[
        ("max_position_embeddings", Int(2048)), ("rms_norm_eps", Float(1e-6)),
        ("num_key_value_heads", SameAsHeads), ("attention_multiplier", Float(1.0)),
        ("embedding_multiplier", Float(1.0)), ("residual_multiplier", Float(1.0)), ("logits_scaling", Float(1.0)),
    ]),
    spec(&["Gemma2ForCausalLM"], "gemma2", Family::Gemma2, 10000.0, GEMMA_LAYER, &[
        ("max_position_embeddings", Int(8192)), ("rms_norm_eps", Float(1e-6)), ("num_key_value_heads", Int(4)),
        ("head_dim", Int(256)), ("attn_logit_softcapping", Float(50.0)),
        ("final_logit_softcapping", Float(30.0)), ("sliding_window", Int(4096)),
    ]),
    spec(&["Gemma3ForCausalLM", "Gemma3ForConditionalGeneration"], "gemma3", Family::Gemma3, 1e6, GEMMA_LAYER, &[
        ("max_position_embeddings", Int(131072)), ("rms_norm_eps", Float(1e-6)), ("num_key_value_heads", Int(4)),
        ("head_dim", Int(256)), ("sliding_window", Int(4096)), ("rope_local_base_freq", Float(10000.0)),
        ("vocab_size", Int(262208)),
    ]),
    spec(&["Olmo2ForCausalLM"], "olmo2", Family::Olmo2, 10000.0, &[QK_NORMS, &[
        ("post_attention_layernorm", "post_attention_norm"),
        ("post_feedforward_layernorm", "post_ffw_norm"),
    ]], &[
        ("max_position_embeddings", Int(2048)), ("rms_norm_eps", Float(1e-5)), ("num_key_value_heads", SameAsHeads),
    ]),
    // The reference converts V2 and V3 with one class; only the config defaults differ.
    spec(&["DeepseekV2ForCausalLM"], "deepseek2", Family::DeepseekV3, 10000.0, DEEPSEEK_LAYER, &[
        ("max_position_embeddings", Int(2048)), ("rms_norm_eps", Float(1e-6)),
        ("num_key_value_heads", SameAsHeads), ("moe_intermediate_size", Int(1407)),
        ("norm_topk_prob", Bool(false)), ("n_routed_experts", Int(64)), ("n_shared_experts", Int(2)),
        ("routed_scaling_factor", Float(1.0)), ("first_k_dense_replace", Int(0)), ("kv_lora_rank", Int(512)),
        ("q_lora_rank", IntOrNull(1536)), ("qk_rope_head_dim", Int(64)), ("qk_nope_head_dim", Int(128)),
        ("v_head_dim", Int(128)), ("head_dim", Always("qk_rope_head_dim")),
    ]),
    spec(&["Glm4MoeForCausalLM"], "glm4moe", Family::Glm4Moe, 10000.0, super::arch_glm::GLM4_MOE_LAYER, &[
        ("max_position_embeddings", Int(131072)), ("rms_norm_eps", Float(1e-5)), ("num_key_value_heads", Int(8)),
        ("moe_intermediate_size", Int(1408)), ("num_experts_per_tok", Int(8)), ("n_shared_experts", Int(1)),
        ("n_routed_experts", Int(128)), ("routed_scaling_factor", Float(1.0)), ("n_group", Int(1)),
        ("topk_group", Int(1)), ("first_k_dense_replace", Int(1)), ("norm_topk_prob", Bool(true)),
    ]),
    // Phi-3 (mini, medium, 128k), Phi-3.5-mini, Phi-4 and Phi-4-mini.
    spec(&["Phi3ForCausalLM"], "phi3", Family::Phi3, 10000.0, &[super::arch_phi::PHI3_LAYER_TABLE], &[
        ("max_position_embeddings", Int(4096)), ("original_max_position_embeddings", Int(4096)),
        ("rms_norm_eps", Float(1e-5)), ("num_key_value_heads", SameAsHeads), ("vocab_size", Int(32064)),
    ]),
    // Llama 4 Scout and Maverick ship the multimodal class; its `text_config` is Llama4TextConfig.
    spec(&["Llama4ForConditionalGeneration", "Llama4ForCausalLM"], "llama4", Family::Llama4, 500000.0, &[LLAMA4_LAYER], &[
        ("max_position_embeddings", Int(131072)), ("rms_norm_eps", Float(1e-5)), ("num_key_value_heads", Int(8)),
        ("head_dim", HiddenPerHeadOr(128)), ("vocab_size", Int(202048)), ("intermediate_size", Int(8192)),
        ("intermediate_size_mlp", Int(16384)), ("num_experts_per_tok", Int(1)), ("num_local_experts", Int(16)),
        ("interleave_moe_layer_step", Int(1)),
    ]),
    // 1bitLLM's checkpoints say `model_type: llama`: LlamaConfig's defaults.
    spec(&["BitnetForCausalLM"], "bitnet", Family::Bitnet, 10000.0, &[BITNET_LAYER], &[
        ("max_position_embeddings", Int(2048)), ("rms_norm_eps", Float(1e-6)),
        ("num_key_value_heads", SameAsHeads), ("head_dim", HiddenPerHead),
    ]),
    // transformers' BitNetConfig (`model_type: bitnet`).
    spec(&["BitNetForCausalLM"], "bitnet", Family::Bitnet, 500000.0, &[BITNET_LAYER], &[
        ("max_position_embeddings", Int(2048)), ("rms_norm_eps", Float(1e-5)), ("num_key_value_heads", Int(5)),
    ]),
];

/// The entry for `config.json`'s `architectures[0]`, or an error naming the supported ones.
pub fn lookup(hf_class: &str) -> Result<&'static ArchSpec> {
    ARCHS
        .iter()
        .find(|a| a.hf_classes.contains(&hf_class))
        .ok_or_else(|| Error::GgufUnsupportedArch {
            arch: hf_class.to_string(),
            supported: ARCHS
                .iter()
                .flat_map(|a| a.hf_classes.iter().copied())
                .collect::<Vec<_>>()
                .join(", "),
        })
}

/// `config.json` as the reference sees it: the file over the class defaults, with transformers
/// 5's `rope_parameters` (from `rope_parameters`, else `rope_scaling` with `type` renamed
/// `rope_type`, with `rope_theta` folded in).
#[derive(Debug, Clone)]
pub struct Config {
    pub path: PathBuf,
    pub spec: &'static ArchSpec,
    pub map: Map<String, Json>,
    pub rope: Map<String, Json>,
}

impl Config {
    pub fn load(path: &Path) -> Result<Config> {
        let text = crate::sys::read_regular_to_string(path).map_err(|e| Error::io(path, e))?;
        let json: Json = serde_json::from_str(&text).map_err(|e| Error::GgufConfig {
            path: path.into(),
            msg: format!("not valid JSON: {e}"),
        })?;
        Config::from_json(path, json)
    }

    pub fn from_json(path: &Path, json: Json) -> Result<Config> {
        let bad = |msg: String| Error::GgufConfig {
            path: path.into(),
            msg,
        };
        let Json::Object(mut map) = json else {
            return Err(bad("not a JSON object".into()));
        };
        // The reference moves a multimodal model's `text_config` to the root.
        if let Some(Json::Object(text)) = map.get("text_config").cloned() {
            map.extend(text.into_iter().filter(|(k, _)| k != "architectures"));
        }
        let class = map
            .get("architectures")
            .and_then(|a| a.get(0))
            .and_then(Json::as_str)
            .ok_or_else(|| bad("no `architectures` list".into()))?;
        let spec = lookup(class)?;
        let raw = map
            .get("model_type")
            .and_then(Json::as_str)
            .is_some_and(|t| RAW_CONFIG_MODEL_TYPES.contains(&t));
        let defaults = if raw { &[][..] } else { spec.defaults };
        for (key, default) in defaults {
            let present = map.get(*key);
            if present.is_some_and(|v| !v.is_null()) && !matches!(default, Always(_)) {
                continue;
            }
            let explicit_null = present.is_some_and(Json::is_null);
            let heads = map.get("num_attention_heads").and_then(Json::as_u64);
            let hidden = map.get("hidden_size").and_then(Json::as_u64);
            let v = match default {
                Always(other) => match map.get(*other) {
                    Some(v) => v.clone(),
                    None => continue,
                },
                HiddenPerHeadOr(n) | IntOrNull(n) if !explicit_null => Json::from(*n),
                IntOrNull(_) => continue,
                HiddenPerHeadOr(_) => match (hidden, heads) {
                    (Some(d), Some(h)) if h > 0 => Json::from(d / h),
                    _ => continue,
                },
                Int(n) => Json::from(*n),
                Float(f) => Json::from(*f),
                Bool(b) => Json::from(*b),
                SameAsHeads => match heads {
                    Some(h) => Json::from(h),
                    None => continue,
                },
                HiddenPerHead => match (hidden, heads) {
                    (Some(d), Some(h)) if h > 0 => Json::from(d / h),
                    _ => continue,
                },
            };
            map.insert(key.to_string(), v);
        }
        if spec.family == Family::Llama4 {
            // `Llama4Model.__init__`: the dense layers' size is the feed-forward length, the
            // experts' the expert one.
            let moe = map.get("intermediate_size").cloned().unwrap_or(Json::Null);
            let mlp = map
                .get("intermediate_size_mlp")
                .cloned()
                .unwrap_or(Json::Null);
            map.insert("intermediate_size_moe".into(), moe);
            map.insert("intermediate_size".into(), mlp);
        }
        let mut rope = match map
            .get("rope_parameters")
            .or_else(|| map.get("rope_scaling"))
        {
            Some(Json::Object(r)) => r.clone(),
            _ => Map::new(),
        };
        // Per-layer-type parameters (transformers 5's Gemma 3): the global layers' are the
        // ones the common KVs take.
        if let Some(Json::Object(full)) = rope.get("full_attention").cloned() {
            rope = full;
        }
        if !rope.contains_key("rope_type") {
            let t = rope.get("type").cloned().unwrap_or(Json::from("default"));
            rope.insert("rope_type".into(), t);
        }
        if !rope.contains_key("rope_theta") {
            let theta = map
                .get("rope_theta")
                .cloned()
                .unwrap_or(Json::from(spec.rope_theta_default));
            rope.insert("rope_theta".into(), theta);
        }
        Ok(Config {
            path: path.into(),
            spec,
            map,
            rope,
        })
    }

    /// `base` with `edit`'s keys set, read as `m/config.json`.
    #[cfg(test)]
    pub(super) fn edited(mut base: Json, edit: Json) -> Config {
        for (k, v) in edit.as_object().unwrap() {
            base[k] = v.clone();
        }
        Config::from_json(Path::new("m/config.json"), base).unwrap()
    }

    pub(super) fn err(&self, msg: String) -> Error {
        Error::GgufConfig {
            path: self.path.clone(),
            msg,
        }
    }

    /// The first of `keys` present and not null.
    pub fn find(&self, keys: &[&str]) -> Option<&Json> {
        keys.iter()
            .find_map(|k| self.map.get(*k).filter(|v| !v.is_null()))
    }

    /// The first of `keys` present and not null, as an unsigned integer; any other value (`4.5`,
    /// `"4"`, `-1`) is an error naming the key, not a field left out of the GGUF.
    pub fn u64(&self, keys: &[&str]) -> Result<Option<u64>> {
        self.typed(keys, Json::as_u64, "an unsigned integer")
    }

    /// As [`Config::u64`], for a number.
    pub fn f64(&self, keys: &[&str]) -> Result<Option<f64>> {
        self.typed(keys, Json::as_f64, "a number")
    }

    fn typed<T>(
        &self,
        keys: &[&str],
        get: fn(&Json) -> Option<T>,
        what: &str,
    ) -> Result<Option<T>> {
        let Some((key, v)) = keys
            .iter()
            .find_map(|k| self.map.get(*k).filter(|v| !v.is_null()).map(|v| (k, v)))
        else {
            return Ok(None);
        };
        get(v)
            .map(Some)
            .ok_or_else(|| self.err(format!("`{key}` is {v}, not {what}")))
    }

    pub fn need_u64(&self, key: &str) -> Result<u64> {
        self.u64(&[key])?
            .ok_or_else(|| self.err(format!("`{key}` is missing")))
    }

    pub(super) fn u32_kv(&self, key: &str, v: u64) -> Result<Value> {
        u32::try_from(v)
            .map(Value::U32)
            .map_err(|_| self.err(format!("`{key}` = {v} does not fit a u32")))
    }

    /// The first of `keys` present and not null, as an unsigned integer; none is an error
    /// naming them all.
    pub fn need_u64_of(&self, keys: &[&str]) -> Result<u64> {
        self.u64(keys)?.ok_or_else(|| {
            let names: Vec<String> = keys.iter().map(|k| format!("`{k}`")).collect();
            self.err(format!("{} is missing", names.join(" or ")))
        })
    }

    pub fn need_f64(&self, key: &str) -> Result<f64> {
        self.f64(&[key])?
            .ok_or_else(|| self.err(format!("`{key}` is missing")))
    }

    /// The main layers, plus the NextN/MTP layers where the reference keeps them (GLM-4.5).
    pub fn block_count(&self) -> Result<u64> {
        let main = self
            .u64(&["n_layers", "num_hidden_layers", "n_layer", "num_layers"])?
            .ok_or_else(|| self.err("`num_hidden_layers` is missing".into()))?;
        main.checked_add(super::arch_glm::nextn_layers(self)?)
            .ok_or_else(|| self.err("`num_nextn_predict_layers` is too large".into()))
    }

    /// `partial_rotary_factor`: the rope parameters' (where transformers puts it), else the
    /// top-level one, else `default`.
    pub(super) fn partial_rotary_factor(&self, default: f64) -> Result<f64> {
        let key = "partial_rotary_factor";
        match self.rope.get(key).filter(|v| !v.is_null()) {
            Some(v) => v
                .as_f64()
                .ok_or_else(|| self.err(format!("`{key}` is {v}, not a number"))),
            None => Ok(self.f64(&[key])?.unwrap_or(default)),
        }
    }

    fn rope_f64(&self, key: &str) -> Option<f64> {
        self.rope.get(key).and_then(Json::as_f64)
    }
}

/// The KVs every file starts with: `general.architecture`, `general.type`, `general.name`.
pub(super) fn general_kvs(arch: &str, name: &str) -> Metadata {
    let mut m = Metadata::new();
    m.set("general.architecture", Value::String(arch.into()));
    m.set("general.type", Value::String("model".into()));
    m.set("general.name", Value::String(name.into()));
    m
}

/// `general.*` and `{arch}.*` KVs, in the order the reference writes them.
pub fn model_kvs(cfg: &Config, file_type: FileType, name: &str) -> Result<Metadata> {
    let arch = cfg.spec.gguf_arch;
    let k = |s: &str| format!("{arch}.{s}");
    let fam = cfg.spec.family;
    match fam {
        Family::Gemma2 => return super::arch_gemma::gemma2_model_kvs(cfg, file_type, name),
        Family::Phi3 => return super::arch_phi::phi3_model_kvs(cfg, file_type, name),
        _ => {}
    }
    let mut m = general_kvs(arch, name);
    let mut n_kv_override = None;
    if fam == Family::DeepseekV3 {
        n_kv_override = Some(1); // MLA is written as MQA
    }

    // TextModel.set_gguf_parameters
    m.set(
        k("block_count"),
        cfg.u32_kv("block_count", cfg.block_count()?)?,
    );
    let u32s: &[(&[&str], &str)] = &[
        (
            &[
                "max_position_embeddings",
                "n_ctx",
                "n_positions",
                "max_length",
                "max_sequence_length",
                "model_max_length",
            ],
            "context_length",
        ),
        (&["hidden_size", "n_embd", "dim"], "embedding_length"),
        (
            &[
                "prefix_dense_intermediate_size",
                "dense_intermediate_size",
                "intermediate_size",
                "n_inner",
                "hidden_dim",
            ],
            "feed_forward_length",
        ),
        (
            &["num_attention_heads", "n_head", "n_heads"],
            "attention.head_count",
        ),
    ];
    for (keys, gguf) in u32s {
        if let Some(v) = cfg.u64(keys)? {
            m.set(k(gguf), cfg.u32_kv(keys[0], v)?);
        }
    }
    if let Some(v) = n_kv_override.or(cfg.u64(&["num_key_value_heads", "n_kv_heads"])?) {
        m.set(
            k("attention.head_count_kv"),
            cfg.u32_kv("num_key_value_heads", v)?,
        );
    }
    let rope_type = cfg
        .rope
        .get("rope_type")
        .and_then(Json::as_str)
        .unwrap_or("");
    let factor = cfg.rope_f64("factor");
    match (rope_type, factor) {
        ("linear", Some(f)) => {
            m.set(k("rope.scaling.type"), Value::String("linear".into()));
            m.set(k("rope.scaling.factor"), Value::F32(f as f32));
        }
        ("yarn", Some(f)) => {
            m.set(k("rope.scaling.type"), Value::String("yarn".into()));
            m.set(k("rope.scaling.factor"), Value::F32(f as f32));
            let orig = cfg
                .rope
                .get("original_max_position_embeddings")
                .and_then(Json::as_u64)
                .ok_or_else(|| {
                    cfg.err("yarn rope scaling lacks `original_max_position_embeddings`".into())
                })?;
            m.set(
                k("rope.scaling.original_context_length"),
                cfg.u32_kv("original_max_position_embeddings", orig)?,
            );
            for (hf, gguf) in [
                ("extrapolation_factor", "rope.scaling.yarn_ext_factor"),
                ("attention_factor", "rope.scaling.yarn_attn_factor"),
                ("beta_fast", "rope.scaling.yarn_beta_fast"),
                ("beta_slow", "rope.scaling.yarn_beta_slow"),
            ] {
                let v = cfg.rope_f64(hf).or_else(|| {
                    (hf == "attention_factor")
                        .then(|| cfg.rope_f64("attn_factor"))
                        .flatten()
                });
                if let Some(v) = v {
                    m.set(k(gguf), Value::F32(v as f32));
                }
            }
        }
        ("su" | "longrope", _) => m.set(k("rope.scaling.type"), Value::String("longrope".into())),
        _ => {}
    }
    if let Some(theta) = cfg.rope_f64("rope_theta") {
        m.set(k("rope.freq_base"), Value::F32(theta as f32));
    }
    if let Some(eps) = cfg.f64(&["rms_norm_eps", "norm_eps"])? {
        m.set(
            k("attention.layer_norm_rms_epsilon"),
            Value::F32(eps as f32),
        );
    }
    let counts: &[(&[&str], &str)] = &[
        (
            &["num_local_experts", "num_experts", "n_routed_experts"],
            "expert_count",
        ),
        (
            &[
                "num_experts_per_tok",
                "num_experts_per_token",
                "top_k_experts",
            ],
            "expert_used_count",
        ),
        (&["n_group"], "expert_group_count"),
        (&["topk_group"], "expert_group_used_count"),
    ];
    for (keys, gguf) in counts {
        if let Some(v) = cfg.u64(keys)? {
            m.set(k(gguf), cfg.u32_kv(keys[0], v)?);
        }
    }
    if let Some(f) = cfg.find(&["score_function", "scoring_func", "score_func"]) {
        let id = match f.as_str() {
            Some("softmax") => 1,
            Some("sigmoid") => 2,
            Some("sqrtsoftplus") => 4,
            _ => return Err(cfg.err(format!("unsupported expert scoring function {f}"))),
        };
        m.set(k("expert_gating_func"), Value::U32(id));
    }
    if let Some(hd) = head_dim(cfg)? {
        m.set(k("attention.key_length"), cfg.u32_kv("head_dim", hd)?);
        m.set(k("attention.value_length"), cfg.u32_kv("head_dim", hd)?);
    }
    let ftype = match (fam, file_type) {
        (Family::GptOss, FileType::AllF32 | FileType::MostlyF16 | FileType::MostlyBf16) => {
            MXFP4_MOE_FILE_TYPE
        }
        _ => file_type.id(),
    };
    m.set("general.file_type", Value::U32(ftype));

    // Per-architecture additions.
    match fam {
        Family::Llama | Family::Granite | Family::Llama4 => {
            m.set(
                k("vocab_size"),
                cfg.u32_kv("vocab_size", cfg.need_u64("vocab_size")?)?,
            );
            m.set(
                k("rope.dimension_count"),
                cfg.u32_kv("head_dim", rope_dim(cfg)?)?,
            );
            if fam == Family::Llama4 {
                llama4_kvs(cfg, &mut m, &k)?;
            }
        }
        Family::Qwen2 | Family::Qwen3 | Family::Olmo2 | Family::Gemma2 | Family::Phi3 => {}
        // BitnetModel.set_gguf_parameters, after TextModel's.
        Family::Bitnet => {
            m.set(k("rope.scaling.type"), Value::String("linear".into()));
            m.set(k("rope.scaling.factor"), Value::F32(1.0));
        }
        Family::Gemma3 => super::arch_gemma::gemma3_kvs(cfg, &mut m, &k)?,
        Family::Qwen3Moe => {
            if let Some(v) = cfg.u64(&["moe_intermediate_size"])? {
                m.set(
                    k("expert_feed_forward_length"),
                    cfg.u32_kv("moe_intermediate_size", v)?,
                );
            }
            if let Some(v) = cfg.u64(&["shared_expert_intermediate_size"])? {
                m.set(
                    k("expert_shared_feed_forward_length"),
                    cfg.u32_kv("shared_expert_intermediate_size", v)?,
                );
            }
        }
        Family::GptOss => {
            m.set(
                k("attention.sliding_window"),
                cfg.u32_kv("sliding_window", cfg.need_u64("sliding_window")?)?,
            );
            m.set(
                k("expert_feed_forward_length"),
                cfg.u32_kv("intermediate_size", cfg.need_u64("intermediate_size")?)?,
            );
        }
        Family::DeepseekV3 => deepseek_kvs(cfg, &mut m, &k)?,
        Family::Glm4Moe => super::arch_glm::glm4moe_kvs(cfg, &mut m, &k)?,
    }
    if fam == Family::Granite {
        granite_kvs(cfg, &mut m, &k)?;
    }
    m.set(
        "general.quantization_version",
        Value::U32(GGML_QUANT_VERSION),
    );
    Ok(m)
}

/// `LlamaFileType.MOSTLY_MXFP4_MOE`: what the reference writes for gpt-oss whenever the other
/// tensors are F32/F16/BF16.
pub const MXFP4_MOE_FILE_TYPE: u32 = 38;

/// `head_dim` as the reference sees it: Granite's class pops it before writing anything.
fn head_dim(cfg: &Config) -> Result<Option<u64>> {
    match cfg.spec.family {
        Family::Granite => Ok(None),
        _ => cfg.u64(&["head_dim"]),
    }
}

/// `GraniteModel.set_gguf_parameters`: its `*_multiplier`s and `logits_scaling` as scales,
/// each written when set and not zero.
fn granite_kvs(cfg: &Config, m: &mut Metadata, k: &dyn Fn(&str) -> String) -> Result<()> {
    for (hf, gguf) in [
        ("attention_multiplier", "attention.scale"),
        ("embedding_multiplier", "embedding_scale"),
        ("residual_multiplier", "residual_scale"),
        ("logits_scaling", "logit_scale"),
    ] {
        if let Some(v) = cfg.f64(&[hf])?.filter(|v| *v != 0.0) {
            m.set(k(gguf), Value::F32(v as f32));
        }
    }
    Ok(())
}

/// `Llama4Model.set_gguf_parameters`: the MoE interleave, the experts' feed-forward length, and
/// a sliding window of 0 when every layer is full attention.
fn llama4_kvs(cfg: &Config, m: &mut Metadata, k: &dyn Fn(&str) -> String) -> Result<()> {
    let step = cfg.need_u64("interleave_moe_layer_step")?;
    m.set(
        k("interleave_moe_layer_step"),
        cfg.u32_kv("interleave_moe_layer_step", step)?,
    );
    let moe = cfg.need_u64("intermediate_size_moe")?;
    m.set(
        k("expert_feed_forward_length"),
        cfg.u32_kv("intermediate_size", moe)?,
    );
    if llama4_layer_types(cfg)?
        .iter()
        .all(|t| t == "full_attention")
    {
        m.set(k("attention.sliding_window"), Value::U32(0));
    }
    Ok(())
}

/// Llama4TextConfig's `layer_types`: the file's, else chunked attention on the layers that use
/// rope (`no_rope_layers`, by default all but every `no_rope_layer_interval`-th) while
/// `attention_chunk_size` is set (8192 when absent), full attention elsewhere.
fn llama4_layer_types(cfg: &Config) -> Result<Vec<String>> {
    if let Some(types) = cfg.find(&["layer_types"]) {
        return types
            .as_array()
            .and_then(|a| a.iter().map(|t| t.as_str().map(String::from)).collect())
            .ok_or_else(|| cfg.err(format!("`layer_types` is {types}, not a list of strings")));
    }
    let n = cfg.need_u64("num_hidden_layers")?;
    let interval = cfg.u64(&["no_rope_layer_interval"])?.unwrap_or(4).max(1);
    let given: Vec<u64> = match cfg.find(&["no_rope_layers"]) {
        Some(v) => v
            .as_array()
            .and_then(|a| a.iter().map(Json::as_u64).collect())
            .ok_or_else(|| cfg.err(format!("`no_rope_layers` is {v}, not a list of integers")))?,
        None => Vec::new(),
    };
    let no_rope = if given.is_empty() {
        (0..n).map(|l| u64::from((l + 1) % interval != 0)).collect()
    } else {
        given
    };
    let chunked = !cfg
        .map
        .get("attention_chunk_size")
        .is_some_and(Json::is_null);
    Ok(no_rope
        .iter()
        .map(|&r| {
            if r != 0 && chunked {
                "chunked_attention"
            } else {
                "full_attention"
            }
            .into()
        })
        .collect())
}

fn rope_dim(cfg: &Config) -> Result<u64> {
    match head_dim(cfg)? {
        Some(d) => Ok(d),
        None => Ok(cfg.need_u64("hidden_size")? / cfg.need_u64("num_attention_heads")?.max(1)),
    }
}

fn deepseek_kvs(cfg: &Config, m: &mut Metadata, k: &dyn Fn(&str) -> String) -> Result<()> {
    let has_moe = cfg.u64(&["n_routed_experts"])?.is_some();
    let dense = match cfg.u64(&["first_k_dense_replace"])? {
        Some(v) => v,
        None if has_moe => 0,
        None => cfg.need_u64("num_hidden_layers")?,
    };
    m.set(
        k("leading_dense_block_count"),
        cfg.u32_kv("first_k_dense_replace", dense)?,
    );
    let kv_lora = cfg.u64(&["kv_lora_rank"])?.unwrap_or(512);
    m.set(
        k("vocab_size"),
        cfg.u32_kv("vocab_size", cfg.need_u64("vocab_size")?)?,
    );
    if let Some(q) = cfg.u64(&["q_lora_rank"])? {
        m.set(k("attention.q_lora_rank"), cfg.u32_kv("q_lora_rank", q)?);
    }
    let rope = cfg.need_u64("qk_rope_head_dim")?;
    let nope = cfg.need_u64("qk_nope_head_dim")?;
    let v = cfg.need_u64("v_head_dim")?;
    for (gguf, hf, n) in [
        ("attention.kv_lora_rank", "kv_lora_rank", kv_lora),
        ("attention.key_length", "kv_lora_rank", kv_lora + rope),
        ("attention.value_length", "kv_lora_rank", kv_lora),
        ("attention.key_length_mla", "qk_nope_head_dim", nope + rope),
        ("attention.value_length_mla", "v_head_dim", v),
    ] {
        m.set(k(gguf), cfg.u32_kv(hf, n)?);
    }
    let moe_ff = cfg.need_u64_of(&["moe_intermediate_size", "intermediate_size"])?;
    m.set(
        k("expert_feed_forward_length"),
        cfg.u32_kv("moe_intermediate_size", moe_ff)?,
    );
    if let Some(n) = cfg.u64(&["n_routed_experts"])? {
        m.set(k("expert_count"), cfg.u32_kv("n_routed_experts", n)?);
    }
    m.set(
        k("expert_shared_count"),
        cfg.u32_kv(
            "n_shared_experts",
            cfg.u64(&["n_shared_experts"])?.unwrap_or(0),
        )?,
    );
    if let Some(s) = cfg.f64(&["routed_scaling_factor"])? {
        m.set(k("expert_weights_scale"), Value::F32(s as f32));
    }
    if cfg.find(&["norm_topk_prob"]).and_then(Json::as_bool) == Some(true) {
        m.set(k("expert_weights_norm"), Value::Bool(true));
    }
    m.set(
        k("rope.dimension_count"),
        cfg.u32_kv("qk_rope_head_dim", rope)?,
    );
    if let Some(ms) = cfg.rope_f64("mscale_all_dim") {
        m.set(
            k("rope.scaling.yarn_log_multiplier"),
            Value::F32((0.1 * ms) as f32),
        );
    }
    Ok(())
}

/// `--outtype auto`: BF16 if the first tensor with two or more dimensions that is BF16 or F16
/// is BF16, F16 otherwise (the reference skips F32 and integer tensors while looking).
pub fn resolve_auto_file_type<'a>(inputs: impl IntoIterator<Item = &'a InputTensor>) -> FileType {
    for t in inputs {
        if t.shape.len() < 2 {
            continue;
        }
        match t.dtype {
            DType::BF16 => return FileType::MostlyBf16,
            DType::F16 => return FileType::MostlyF16,
            _ => {}
        }
    }
    FileType::MostlyF16
}

/// A checkpoint tensor as the planner sees it (FP8 weights already counted as dequantised by
/// the pipeline's FP8 op, with its output dtype).
#[derive(Debug, Clone, PartialEq)]
pub struct InputTensor {
    pub name: String,
    pub dtype: DType,
    pub shape: Vec<u64>,
}

pub use super::recipe::{plan_tensors, OutputTensor, Recipe, RowMap};

#[cfg(test)]
mod tests {
    use super::*;

    fn llama4(edit: Json) -> Config {
        Config::edited(
            serde_json::json!({
                "architectures": ["Llama4ForCausalLM"], "hidden_size": 64, "num_attention_heads": 4,
                "num_hidden_layers": 4, "intermediate_size": 96, "intermediate_size_mlp": 128,
                "vocab_size": 410,
            }),
            edit,
        )
    }

    fn kv(cfg: &Config, key: &str) -> Option<Value> {
        model_kvs(cfg, FileType::MostlyBf16, "m")
            .unwrap()
            .get(&format!("llama4.{key}"))
            .cloned()
    }

    #[test]
    fn llama4_swaps_the_feed_forward_lengths_and_drops_the_window_only_when_every_layer_is_full() {
        let cfg = llama4(serde_json::json!({}));
        assert_eq!(kv(&cfg, "feed_forward_length"), Some(Value::U32(128)));
        assert_eq!(kv(&cfg, "expert_feed_forward_length"), Some(Value::U32(96)));
        // Llama4TextConfig's defaults: head_dim 128, one MoE layer in every one.
        assert_eq!(kv(&cfg, "attention.key_length"), Some(Value::U32(128)));
        assert_eq!(kv(&cfg, "interleave_moe_layer_step"), Some(Value::U32(1)));
        // Default layers: three chunked, then a full NoPE one: no window KV.
        assert_eq!(kv(&cfg, "attention.sliding_window"), None);
        for full in [
            serde_json::json!({"no_rope_layers": [0, 0, 0, 0]}),
            serde_json::json!({"attention_chunk_size": null}),
            serde_json::json!({"layer_types": ["full_attention", "full_attention", "full_attention", "full_attention"]}),
        ] {
            let cfg = llama4(full.clone());
            assert_eq!(
                kv(&cfg, "attention.sliding_window"),
                Some(Value::U32(0)),
                "{full}"
            );
        }
        // An empty `no_rope_layers` is the default pattern, as transformers reads it.
        let cfg = llama4(serde_json::json!({"no_rope_layers": []}));
        assert_eq!(kv(&cfg, "attention.sliding_window"), None);
        let bad = llama4(serde_json::json!({"layer_types": "full_attention"}));
        let err = model_kvs(&bad, FileType::MostlyBf16, "m")
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("`layer_types` is \"full_attention\", not a list of strings"),
            "{err}"
        );
    }
}
