//! A llama-quantize mix applied to the converter's F32 plan: what `llama-quantize ref.gguf
//! out.gguf MIX` does to `convert_hf_to_gguf.py --outtype f32`'s file, without the file.
//!
//! The reference copies the F32 file's KVs, then sets `general.quantization_version` and
//! `general.file_type` (each removed and appended, so they end the list), and writes the
//! tensors in its loader's order ([`quantize_order`]) with the types of
//! [`quant_mix::choose_types`]. Every type is checked writable here, before any output exists.

use super::arch::{Config, OutputTensor, Recipe, GGML_QUANT_VERSION};
use super::imatrix::{self, Imatrix};
use super::kv::{Metadata, Value};
use super::quant_mix::{self, quantize_order, Mix, MixOptions, MixTensor, ModelFacts};
use crate::error::{Error, Result};
use crate::ops::gguf::{encode, GgmlType};

/// Retypes and reorders `outputs` and rewrites `metadata` as llama-quantize would; returns
/// the warnings it prints (tensors whose rows no block type fits, written as F16).
pub fn apply(
    mix: Mix,
    opts: &MixOptions,
    cfg: &Config,
    metadata: &mut Metadata,
    outputs: &mut Vec<OutputTensor>,
) -> Result<Vec<String>> {
    if let Some(t) = outputs
        .iter()
        .find(|o| matches!(o.recipe, Recipe::Mxfp4 { .. }))
    {
        return Err(Error::GgufTensor {
            tensor: t.name.clone(),
            msg: format!(
                "an MXFP4 tensor would be requantised to {}; llama-quantize refuses that (write the MXFP4 experts unchanged with --outtype bf16, f16 or q8_0)",
                mix.name()
            ),
        });
    }
    let names: Vec<&str> = outputs.iter().map(|o| o.name.as_str()).collect();
    let order = quantize_order(&names);
    let mut sorted: Vec<OutputTensor> = order.iter().map(|&i| outputs[i].clone()).collect();
    let facts = model_facts(cfg.spec.gguf_arch, metadata);
    let tensors: Vec<MixTensor> = sorted
        .iter()
        .map(|o| MixTensor {
            name: &o.name,
            shape: &o.shape,
            ty: o.ty,
        })
        .collect();
    let types = quant_mix::choose_types(mix, &facts, opts, &tensors)?;
    quant_mix::check_imatrix(mix, opts, &tensors, &types)?;
    for (o, ty) in sorted.iter_mut().zip(types) {
        if !encode::can_write(ty) {
            return Err(Error::GgufTensor {
                tensor: o.name.clone(),
                msg: format!(
                    "--outtype {} gives it type {}, which tftf cannot write yet",
                    mix.name(),
                    ty.name()
                ),
            });
        }
        o.ty = ty;
    }
    *outputs = sorted;
    metadata.remove("general.quantization_version");
    metadata.remove("general.file_type");
    metadata.set(
        "general.quantization_version",
        Value::U32(GGML_QUANT_VERSION),
    );
    metadata.set("general.file_type", Value::U32(mix.ftype()));
    if let Some(m) = opts.imatrix.as_deref().filter(|m| !m.entries.is_empty()) {
        attach_imatrix(m, outputs)?;
        imatrix_kvs(m, metadata);
    }
    check_weights(mix, opts.imatrix.as_deref(), outputs)?;
    Ok(f16_fallbacks(mix, opts, outputs))
}

/// llama-quantize's "must use F16 due to unusual shape": a quantised tensor whose rows are
/// not a multiple of 32 elements fits no block type, so it is written as F16. The bytes are
/// the reference's; the user is told which tensors, as llama-quantize tells them.
fn f16_fallbacks(mix: Mix, opts: &MixOptions, outputs: &[OutputTensor]) -> Vec<String> {
    // F16 the user asked for is no fallback.
    let named = |n: &str| {
        opts.tensor_types.iter().any(|(re, _)| re.is_match(n))
            || (n == "output.weight" && opts.output_type.is_some())
            || (n == "token_embd.weight" && opts.token_embedding_type.is_some())
    };
    let odd: Vec<String> = outputs
        .iter()
        .filter(|o| o.ty == GgmlType::F16 && o.shape.len() >= 2 && !named(&o.name))
        .filter(|o| o.shape.last().is_some_and(|c| c % 32 != 0))
        .map(|o| format!("`{}` (rows of {})", o.name, o.shape[o.shape.len() - 1]))
        .collect();
    if odd.is_empty() {
        return Vec::new();
    }
    vec![format!(
        "--outtype {}: {} tensor(s) have rows that no block type divides and are written as F16, as llama-quantize does: {}",
        mix.name(),
        odd.len(),
        odd.join(", ")
    )]
}

/// The refusals left once the weights are attached, at the first tensor (in llama-quantize's
/// order) that has none: a type that needs an imatrix while the imatrix has no entry for the
/// tensor (llama-quantize: "Missing importance matrix for tensor"), and a type ggml cannot
/// encode without weights at all (IQ2_XXS, IQ2_XS, IQ1_S for output or token_embd, which
/// llama-quantize exempts from the imatrix rule and then aborts on in ggml).
fn check_weights(mix: Mix, m: Option<&Imatrix>, outputs: &[OutputTensor]) -> Result<()> {
    for o in outputs.iter().filter(|o| o.quant_weights.is_none()) {
        let ty = o.ty.name();
        match m {
            Some(m) if quant_mix::requires_imatrix(&o.name, o.ty, mix) => {
                return Err(Error::GgufImatrix {
                    path: m.file.clone().into(),
                    msg: format!(
                        "no entry for `{}`, which --outtype {} makes {ty}: a type that needs one (llama-quantize refuses it too: missing importance matrix)",
                        o.name,
                        mix.name()
                    ),
                });
            }
            _ if encode::needs_quant_weights(o.ty) => {
                return Err(Error::GgufTensor {
                    tensor: o.name.clone(),
                    msg: format!(
                        "{ty} cannot be encoded without importance weights (ggml asserts them; llama-quantize aborts): give --imatrix with an entry for it, or another type"
                    ),
                });
            }
            _ => {}
        }
    }
    Ok(())
}

/// Gives each quantised tensor its importance weights, as llama-quantize matches them: by
/// name, `cols × n_expert` of them (a size that differs is refused, except for
/// `token_embd.weight`, which llama-quantize quantises without). An imatrix none of whose
/// entries names a tensor of this model is refused: it was made for another model (where
/// llama-quantize would silently quantise everything without it).
fn attach_imatrix(m: &Imatrix, outputs: &mut [OutputTensor]) -> Result<()> {
    let err = |msg: String| Error::GgufImatrix {
        path: m.file.clone().into(),
        msg,
    };
    if !outputs.iter().any(|o| m.entries.contains_key(&o.name)) {
        let some: Vec<&str> = m.entries.keys().take(3).map(|k| k.as_str()).collect();
        return Err(err(format!(
            "none of its {} entries ({} …) is a tensor of this model: it was made for another model",
            m.entries.len(),
            some.join(", ")
        )));
    }
    for o in outputs.iter_mut().filter(|o| o.ty.is_quantized()) {
        let Some(w) = m.entries.get(&o.name) else {
            continue;
        };
        let n = o.shape.len();
        let cols = o.shape[n - 1];
        let experts = if n >= 3 { o.shape[n - 3] } else { 1 };
        if w.len() as u64 == cols * experts {
            o.quant_weights = Some(w.clone());
        } else if !matches!(
            o.name.as_str(),
            "token_embd.weight" | "per_layer_token_embd.weight"
        ) {
            return Err(err(format!(
                "`{}` has {} weights, but the tensor has {cols} columns × {experts} experts: it was made for another model",
                o.name,
                w.len()
            )));
        }
    }
    Ok(())
}

/// llama-quantize's `quantize.imatrix.*` KVs, after `general.file_type` in its order.
fn imatrix_kvs(m: &Imatrix, metadata: &mut Metadata) {
    let s = |v: &str| Value::String(imatrix::kv_str(v));
    metadata.set("quantize.imatrix.file", s(&m.file));
    if let Some(d) = m.datasets.first() {
        metadata.set("quantize.imatrix.dataset", s(d));
    }
    let n = Value::U32(m.entries.len() as u32);
    metadata.set("quantize.imatrix.entries_count", n);
    if m.chunk_count > 0 {
        metadata.set(
            "quantize.imatrix.chunks_count",
            Value::U32(m.chunk_count as u32),
        );
    }
}

/// The hyperparameters the rules read, from the KVs llama.cpp's loader reads them from.
pub fn model_facts(arch: &str, metadata: &Metadata) -> ModelFacts {
    let u = |k: &str| match metadata.get(&format!("{arch}.{k}")) {
        Some(Value::U32(v)) => *v as u64,
        _ => 0,
    };
    let (n_layer, n_head, n_head_kv) = (
        u("block_count"),
        u("attention.head_count"),
        u("attention.head_count_kv"),
    );
    let n_head_kv = if metadata
        .get(&format!("{arch}.attention.head_count_kv"))
        .is_some()
    {
        n_head_kv
    } else {
        n_head
    };
    let n_expert = u("expert_count");
    ModelFacts {
        n_layer,
        n_gqa: n_head.checked_div(n_head_kv).unwrap_or(0),
        n_expert: if n_expert <= 1 { 0 } else { n_expert },
        is_70b: n_layer == 80 && ((arch == "llama" && n_head != n_head_kv) || arch == "qwen2"),
    }
}
