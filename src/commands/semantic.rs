//! `validate`'s checks of checkpoints that parse but would load wrong: quantised weights
//! without their scales, a `quantization_config` that no longer describes the tensors, a
//! `torch_dtype` that none of the tensors has. These are what a conversion by a tool that forgot
//! one of the side files leaves behind (a dequantised model still claiming FP8, a filter that
//! dropped the scales). An index whose `total_size` is not the sum of the tensor bytes is only
//! a note ([`notes`]): transformers, vLLM and safetensors read `weight_map` alone, and
//! llm-compressor's `save_pretrained` writes such indexes.
//!
//! The scale conventions are the ops' own: [`scale_candidates`] is what `dequant-fp8` tries,
//! [`mxfp4_expert_scale`] what `repack-fp4` needs, [`resolve_layout`] what binds a scale grid
//! to `weight_block_size`.

use serde_json::{Map, Value};

use crate::escape;
use crate::format::checkpoint::Checkpoint;
use crate::format::dtype::DType;
use crate::ops::fp4::repack::mxfp4_expert_scale;
use crate::ops::fp8::{config_block_size, resolve_layout, scale_candidates, ScaleMode};

/// At most this many tensors are named in one finding.
const NAMED_TENSORS_MAX: usize = 5;

/// One semantic problem: a stable check name (for `--json`) and the message.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Finding {
    pub check: &'static str,
    pub message: String,
}

pub fn check(ckpt: &Checkpoint) -> Vec<Finding> {
    let mut out = Vec::new();
    missing_scales(ckpt, &mut out);
    let config = match ckpt.config() {
        Ok(c) => c,
        Err(e) => {
            out.push(Finding {
                check: "config",
                message: e.to_string(),
            });
            None
        }
    };
    if let Some(cfg) = &config {
        quantization_config(ckpt, cfg, &mut out);
        torch_dtype(ckpt, cfg, &mut out);
    }
    out
}

/// What `validate` notes without calling it a problem: a stale index `total_size`.
pub fn notes(ckpt: &Checkpoint) -> Vec<String> {
    index_total_size(ckpt).into_iter().collect()
}

fn is_fp8(d: DType) -> bool {
    matches!(d, DType::F8_E4M3 | DType::F8_E5M2)
}

fn names(list: &[&str]) -> String {
    let mut s: Vec<String> = list
        .iter()
        .take(NAMED_TENSORS_MAX)
        .map(|n| format!("`{}`", escape::name(n)))
        .collect();
    if list.len() > NAMED_TENSORS_MAX {
        s.push(format!("and {} more", list.len() - NAMED_TENSORS_MAX));
    }
    s.join(", ")
}

/// FP8 weights and MXFP4 experts whose scale tensor is absent.
fn missing_scales(ckpt: &Checkpoint, out: &mut Vec<Finding>) {
    let mut fp8 = Vec::new();
    let mut fp4 = Vec::new();
    for t in &ckpt.tensors[..ckpt.base_count] {
        let name = t.name();
        if is_fp8(t.info.dtype) && name.ends_with("weight") {
            let found = scale_candidates(name, ScaleMode::Multiply)
                .iter()
                .any(|(s, _)| ckpt.get(s).is_some());
            if !found {
                fp8.push(name);
            }
        } else if let Some(scale) = mxfp4_expert_scale(name, t.info.dtype) {
            // After `repack-fp4` the same bytes are NVFP4 codes with `X.weight_scale`.
            let nvfp4_scale = format!("{name}_scale");
            if ckpt.get(&scale).is_none() && ckpt.get(&nvfp4_scale).is_none() {
                fp4.push(name);
            }
        }
    }
    if !fp8.is_empty() {
        out.push(Finding {
            check: "missing-scale",
            message: format!(
                "{} FP8 weight(s) without a scale (`X.weight_scale_inv`, `X.weight_scale` or `X.scale`): {}; the weights cannot be decoded",
                fp8.len(),
                names(&fp8)
            ),
        });
    }
    if !fp4.is_empty() {
        out.push(Finding {
            check: "missing-scale",
            message: format!(
                "{} MXFP4 expert weight(s) without their E8M0 scale (`<expert>.<proj>.scale`, or `X.weight_scale` for NVFP4): {}; the weights cannot be decoded",
                fp4.len(),
                names(&fp4)
            ),
        });
    }
}

/// What a `quantization_config` promises the tensors hold.
#[derive(Debug, PartialEq)]
enum Promise {
    Fp8,
    Nvfp4,
    Mxfp4,
}

fn promise(q: &Map<String, Value>) -> Option<Promise> {
    let text = |k: &str| {
        q.get(k)
            .and_then(Value::as_str)
            .unwrap_or("")
            .to_lowercase()
    };
    let (method, algo, format) = (text("quant_method"), text("quant_algo"), text("format"));
    match method.as_str() {
        "fp8" => Some(Promise::Fp8),
        "mxfp4" => Some(Promise::Mxfp4),
        "modelopt" if algo == "fp8" => Some(Promise::Fp8),
        "modelopt" if algo == "nvfp4" => Some(Promise::Nvfp4),
        "compressed-tensors" if format.contains("float-quantized") => Some(Promise::Fp8),
        "compressed-tensors" if format.contains("nvfp4") => Some(Promise::Nvfp4),
        _ => None,
    }
}

fn quantization_config(ckpt: &Checkpoint, cfg: &Map<String, Value>, out: &mut Vec<Finding>) {
    let Some(q) = cfg.get("quantization_config").and_then(Value::as_object) else {
        return;
    };
    let Some(promise) = promise(q) else {
        return;
    };
    let tensors = &ckpt.tensors[..ckpt.base_count];
    let method = q.get("quant_method").and_then(Value::as_str).unwrap_or("?");
    let (holds, what) = match promise {
        Promise::Fp8 => (
            tensors.iter().any(|t| is_fp8(t.info.dtype)),
            "F8_E4M3 or F8_E5M2 tensors",
        ),
        Promise::Nvfp4 => (
            tensors.iter().any(|t| {
                let n = t.name();
                n.ends_with("weight_scale_2") || n.ends_with("weight_global_scale")
            }),
            "NVFP4 weights (with `weight_scale_2` or `weight_global_scale`)",
        ),
        Promise::Mxfp4 => (
            tensors
                .iter()
                .any(|t| t.name().ends_with("_blocks") || t.name().ends_with(".scale")),
            "MXFP4 blocks and scales",
        ),
    };
    if !holds {
        out.push(Finding {
            check: "quantization-config",
            message: format!(
                "config.json: quantization_config (quant_method `{}`) promises {what}, but the checkpoint has none; loaders will mis-read it: remove quantization_config (or convert with a tftf command, which updates it)",
                escape::name(method)
            ),
        });
        return;
    }
    if promise != Promise::Fp8 {
        return;
    }
    let block = match config_block_size(cfg) {
        Ok(Some(block)) => block,
        Ok(None) => return,
        Err(msg) => {
            out.push(Finding {
                check: "quantization-config",
                message: format!("config.json: {msg}"),
            });
            return;
        }
    };
    let mut misfits = Vec::new();
    for t in tensors.iter().filter(|t| is_fp8(t.info.dtype)) {
        let scale = scale_candidates(t.name(), ScaleMode::Multiply)
            .into_iter()
            .find_map(|(s, _)| ckpt.get(&s));
        if let Some(s) = scale {
            if resolve_layout(&t.info.shape, &s.info.shape, Some(block)).is_err() {
                misfits.push(t.name());
            }
        }
    }
    if !misfits.is_empty() {
        out.push(Finding {
            check: "quantization-config",
            message: format!(
                "config.json: quantization_config.weight_block_size [{}, {}] does not fit the scales of {} FP8 weight(s): {}",
                block.0,
                block.1,
                misfits.len(),
                names(&misfits)
            ),
        });
    }
}

/// `torch_dtype` (or `dtype`) naming a float dtype that none of the float tensors has.
fn torch_dtype(ckpt: &Checkpoint, cfg: &Map<String, Value>, out: &mut Vec<Finding>) {
    let Some((key, claimed)) = ["torch_dtype", "dtype"]
        .into_iter()
        .find_map(|k| Some((k, cfg.get(k)?.as_str()?)))
    else {
        return;
    };
    let Some(want) = DType::parse_cast_target(claimed) else {
        return;
    };
    let mut bytes_by_dtype: Vec<(DType, u64)> = Vec::new();
    for t in &ckpt.tensors[..ckpt.base_count] {
        let d = t.info.dtype;
        if !matches!(d, DType::F16 | DType::BF16 | DType::F32 | DType::F64) {
            continue;
        }
        match bytes_by_dtype.iter_mut().find(|(x, _)| *x == d) {
            Some((_, b)) => *b += t.info.nbytes(),
            None => bytes_by_dtype.push((d, t.info.nbytes())),
        }
    }
    let Some(&(most, _)) = bytes_by_dtype.iter().max_by_key(|(_, b)| *b) else {
        return;
    };
    if !bytes_by_dtype.iter().any(|(d, _)| *d == want) {
        out.push(Finding {
            check: "torch-dtype",
            message: format!(
                "config.json: {key} is `{}` but no tensor is {want} (the float tensors are mostly {most}): set {key} to `{}`",
                escape::name(claimed),
                most.torch_name()
            ),
        });
    }
}

/// The index's `metadata.total_size` against the bytes of the tensors it lists. Loaders never
/// read it (transformers' `load_sharded_checkpoint` and `from_pretrained` take `weight_map`
/// only), so a difference is a note.
fn index_total_size(ckpt: &Checkpoint) -> Option<String> {
    let index = ckpt.index_path.as_ref()?;
    let text = std::fs::read_to_string(index).ok()?;
    let v = serde_json::from_str::<Value>(&text).ok()?;
    let total = v.pointer("/metadata/total_size")?;
    let actual = ckpt.total_bytes();
    let claimed = total.as_u64().or_else(|| {
        total
            .as_f64()
            .filter(|f| f.fract() == 0.0)
            .map(|f| f as u64)
    });
    (claimed != Some(actual)).then(|| {
        format!(
            "{}: metadata.total_size is {total} but the tensors it lists hold {actual} bytes; loaders read only weight_map, so the checkpoint loads (tftf writes the sum)",
            escape::path(index)
        )
    })
}
