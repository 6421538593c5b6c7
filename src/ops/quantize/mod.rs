//! `quantize`: weight-only quantisation of a bf16/f16/f32 checkpoint into the compressed-tensors
//! layout that llm-compressor's `oneshot` + `save_pretrained(save_compressed=True)` writes for
//! its presets, byte for byte (codes, scales and `quantization_config`; checked against
//! llm-compressor 0.14.0.1 with compressed-tensors 0.20.1 in `tests/quantize.rs`). Also
//! transformers' FineGrainedFP8 layout (`--format fp8-native`) and NVIDIA ModelOpt's export
//! (`--format modelopt`, planned in [`modelopt`]).
//!
//! llm-compressor quantises `Linear` modules; a checkpoint has only tensor names, so a weight is
//! quantised when it is a 2-D floating-point `X.weight` that no ignore rule names. Default
//! ignores: `lm_head`, embeddings (not `Linear`, so not listed in `ignore`) and MoE routers
//! (`*.mlp.gate`, `*.router`, `*.block_sparse_moe.gate`: `Linear`, so listed, as the library
//! lists every `Linear` it left alone). Weight-only presets need no calibration data: every
//! scale is a function of the weight alone (min/max observer), except NVFP4's tensor scale,
//! which llm-compressor shares across fused projections (q/k/v, gate/up) and so is computed
//! here at plan time from each group's amax, reading those weights once beforehand.
//!
//! Per scheme (W = the weight's dtype):
//! | scheme | tensors |
//! | --- | --- |
//! | FP8_DYNAMIC | `weight` F8_E4M3, `weight_scale` W `[out, 1]` |
//! | FP8_BLOCK | `weight` F8_E4M3, `weight_scale` W `[⌈out/128⌉, ⌈in/128⌉]` |
//! | W8A16, W4A16 | `weight_packed` I32 `[out, ⌈in·b/32⌉]`, `weight_scale` W `[out, in/128]`, `weight_shape` I64 `[2]` |
//! | NVFP4A16 | `weight_packed` U8 `[out, in/2]`, `weight_scale` F8_E4M3 `[out, in/16]`, `weight_global_scale` F32 `[1]` |
//! | MXFP4A16 | `weight_packed` U8 `[out, in/2]`, `weight_scale` U8 (E8M0) `[out, in/32]` |
//! | MXFP8A16 | `weight` F8_E4M3, `weight_scale` U8 (E8M0) `[out, in/32]` |

pub mod encode;
pub mod kernel;
pub mod lanes;
pub mod modelopt;
pub mod ops;
pub mod requant;
pub mod tensor_scale;

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};

use serde_json::{json, Map, Value};

use crate::error::{Error, Result};
use crate::format::checkpoint::Checkpoint;
use crate::format::dtype::DType;
use crate::ops::constant::Constant;
use crate::ops::feed::{FedDerive, FeedSource};
use crate::plan::{Derive, Entry, ExtraOutput, FixedOp, PlanStep, Planning};
use crate::transform::Glob;
use encode::WeightType;
use ops::{BlockMath, QuantizeRows};
use tensor_scale::{GlobalScaleTensor, Member, Nvfp4Rows, Piece, ScaleKind, TensorScale};

/// The compressed-tensors version whose output this matches (`quantization_config.version`).
pub const COMPRESSED_TENSORS_VERSION: &str = "0.20.1";

/// Projections whose NVFP4 tensor scales llm-compressor makes equal (`FUSED_LAYER_NAMES`),
/// because vLLM runs each group as one fused matmul.
pub(super) const FUSED_LAYER_NAMES: &[&[&str]] = &[
    &["gate_proj", "up_proj"],
    &["q_proj", "k_proj", "v_proj"],
    &["q_a_proj", "kv_a_proj_with_mqa"],
    &["w1", "w3"],
];

/// Bytes read at a time when a weight's amax is needed at plan time.
const PLAN_READ_BYTES: u64 = 16 << 20;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Scheme {
    Fp8Dynamic,
    Fp8Block,
    W8A16,
    W4A16,
    Nvfp4A16,
    Mxfp4A16,
    Mxfp8A16,
}

impl Scheme {
    pub const ALL: [Scheme; 7] = [
        Scheme::Fp8Dynamic,
        Scheme::Fp8Block,
        Scheme::W8A16,
        Scheme::W4A16,
        Scheme::Nvfp4A16,
        Scheme::Mxfp4A16,
        Scheme::Mxfp8A16,
    ];

    /// llm-compressor's preset name.
    pub fn name(self) -> &'static str {
        match self {
            Scheme::Fp8Dynamic => "FP8_DYNAMIC",
            Scheme::Fp8Block => "FP8_BLOCK",
            Scheme::W8A16 => "W8A16",
            Scheme::W4A16 => "W4A16",
            Scheme::Nvfp4A16 => "NVFP4A16",
            Scheme::Mxfp4A16 => "MXFP4A16",
            Scheme::Mxfp8A16 => "MXFP8A16",
        }
    }

    pub fn parse(s: &str) -> Result<Scheme> {
        Scheme::ALL
            .into_iter()
            .find(|x| x.name().eq_ignore_ascii_case(s))
            .ok_or_else(|| {
                let names: Vec<&str> = Scheme::ALL.iter().map(|x| x.name()).collect();
                Error::Usage(format!(
                    "unknown scheme `{s}`: use one of {}",
                    names.join(", ")
                ))
            })
    }

    fn int_bits(self) -> u32 {
        match self {
            Scheme::W8A16 => 8,
            Scheme::W4A16 => 4,
            _ => 0,
        }
    }

    /// Elements per scale along a row, for the schemes that need whole groups.
    fn group(self) -> Option<u64> {
        match self {
            Scheme::W8A16 | Scheme::W4A16 => Some(128),
            Scheme::Nvfp4A16 => Some(16),
            Scheme::Mxfp4A16 | Scheme::Mxfp8A16 => Some(32),
            Scheme::Fp8Dynamic | Scheme::Fp8Block => None,
        }
    }

    /// compressed-tensors `format`.
    fn format(self) -> &'static str {
        match self {
            Scheme::Fp8Dynamic | Scheme::Fp8Block => "float-quantized",
            Scheme::W8A16 | Scheme::W4A16 => "pack-quantized",
            Scheme::Nvfp4A16 => "nvfp4-pack-quantized",
            Scheme::Mxfp4A16 => "mxfp4-pack-quantized",
            Scheme::Mxfp8A16 => "mxfp8-quantized",
        }
    }

    /// Whether the codes are stored as `weight_packed` (else `weight`).
    fn packed(self) -> bool {
        matches!(
            self,
            Scheme::W8A16 | Scheme::W4A16 | Scheme::Nvfp4A16 | Scheme::Mxfp4A16
        )
    }

    /// The `weights` and `input_activations` quantisation args the preset saves.
    fn args(self) -> (Value, Value) {
        let w = |bits: u64, ty: &str, strategy: &str, group: Value| {
            json!({"dynamic": false, "group_size": group, "num_bits": bits,
                   "observer": "memoryless_minmax", "strategy": strategy, "symmetric": true,
                   "type": ty})
        };
        let with = |mut v: Value, key: &str, x: Value| {
            v.as_object_mut().expect("object").insert(key.into(), x);
            sort_keys(v)
        };
        let fp8_act = |strategy: &str, group: Value| {
            json!({"dynamic": true, "group_size": group, "num_bits": 8, "strategy": strategy,
                   "symmetric": true, "type": "float"})
        };
        match self {
            Scheme::Fp8Dynamic => (
                w(8, "float", "channel", Value::Null),
                fp8_act("token", Value::Null),
            ),
            Scheme::Fp8Block => (
                with(
                    w(8, "float", "block", Value::Null),
                    "block_structure",
                    json!([128, 128]),
                ),
                fp8_act("group", json!(128)),
            ),
            Scheme::W8A16 => (w(8, "int", "group", json!(128)), Value::Null),
            Scheme::W4A16 => (w(4, "int", "group", json!(128)), Value::Null),
            Scheme::Nvfp4A16 => (
                with(
                    w(4, "float", "tensor_group", json!(16)),
                    "scale_dtype",
                    json!("torch.float8_e4m3fn"),
                ),
                Value::Null,
            ),
            Scheme::Mxfp4A16 | Scheme::Mxfp8A16 => {
                let bits = if self == Scheme::Mxfp4A16 { 4 } else { 8 };
                (
                    with(
                        w(bits, "float", "group", json!(32)),
                        "scale_dtype",
                        json!("torch.uint8"),
                    ),
                    Value::Null,
                )
            }
        }
    }

    /// `quantization_config` as compressed-tensors saves it, for `ignore`d modules.
    pub fn quantization_config(self, ignore: &[String]) -> Value {
        let (weights, input) = self.args();
        json!({
            "config_groups": {
                "group_0": {
                    "format": self.format(),
                    "input_activations": input,
                    "output_activations": null,
                    "targets": ["Linear"],
                    "weights": weights,
                }
            },
            "format": self.format(),
            "global_compression_ratio": null,
            "ignore": ignore,
            "kv_cache_scheme": null,
            "moe_sparsity_config": null,
            "quant_method": "compressed-tensors",
            "quantization_status": "compressed",
            "sparsity_config": {},
            "transform_config": {},
            "version": COMPRESSED_TENSORS_VERSION,
        })
    }
}

/// The layout written.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Format {
    /// compressed-tensors, as llm-compressor saves it.
    CompressedTensors,
    /// transformers FineGrainedFP8 / DeepSeek-V3: `weight` F8_E4M3 and `weight_scale_inv` F32
    /// per 128×128 block, `quant_method: fp8` (FP8_BLOCK only).
    Fp8Native,
    /// NVIDIA ModelOpt's `export_hf_checkpoint` (`quant_method: modelopt`, with
    /// `hf_quant_config.json`): every scheme but W8A16.
    Modelopt,
}

impl Format {
    pub fn parse(s: &str) -> Result<Format> {
        match s {
            "compressed-tensors" => Ok(Format::CompressedTensors),
            "fp8-native" => Ok(Format::Fp8Native),
            "modelopt" => Ok(Format::Modelopt),
            _ => Err(Error::Usage(format!(
                "unknown --format `{s}`: use compressed-tensors, fp8-native or modelopt"
            ))),
        }
    }
}

/// `quantization_config` of `--format fp8-native`: transformers' `FineGrainedFP8Config`
/// (5.24) as `to_dict` gives it, with the modules left alone.
fn fp8_native_config(ignore: &[String]) -> Value {
    json!({
        "quant_method": "fp8",
        "modules_to_not_convert": ignore,
        "modules_to_convert": null,
        "activation_scheme": "dynamic",
        "weight_block_size": [128, 128],
        "dequantize": false,
        "scale_fmt": "float",
        "expert_dtype": "fp8",
    })
}

fn sort_keys(v: Value) -> Value {
    match v {
        Value::Object(m) => {
            let sorted: BTreeMap<String, Value> = m.into_iter().collect();
            Value::Object(sorted.into_iter().map(|(k, v)| (k, sort_keys(v))).collect())
        }
        other => other,
    }
}

/// A module-name rule of `--ignore`: a glob, or a regex after `re:` as llm-compressor writes
/// them (matched from the start of the module name).
#[derive(Debug)]
pub enum IgnoreRule {
    Glob(Glob),
    Regex(regex::Regex),
}

impl IgnoreRule {
    pub fn new(pattern: &str) -> Result<IgnoreRule> {
        match pattern.strip_prefix("re:") {
            Some(re) => regex::Regex::new(&format!("^(?:{re})"))
                .map(IgnoreRule::Regex)
                .map_err(|e| Error::Usage(format!("--ignore `{pattern}`: {e}"))),
            None => Glob::new(pattern).map(IgnoreRule::Glob),
        }
    }

    /// Whether the rule names the module (or its weight tensor).
    pub(super) fn matches(&self, module: &str, tensor: &str) -> bool {
        match self {
            IgnoreRule::Glob(g) => g.matches(module) || g.matches(tensor),
            IgnoreRule::Regex(r) => r.is_match(module),
        }
    }
}

/// Why a 2-D float `X.weight` is left alone by default: `Some(true)` for `Linear` modules
/// (listed in `ignore`), `Some(false)` for modules that are not `Linear` (embeddings).
pub(super) fn default_ignore(module: &str) -> Option<bool> {
    let last = module.rsplit('.').next().unwrap_or(module);
    let parent = module
        .rsplit_once('.')
        .map_or("", |(p, _)| p.rsplit('.').next().unwrap_or(p));
    if last.contains("embed") || matches!(last, "wte" | "wpe" | "word_embeddings") {
        return Some(false);
    }
    if last == "lm_head" || last == "router" {
        return Some(true);
    }
    if last == "gate" && matches!(parent, "mlp" | "block_sparse_moe" | "moe") {
        return Some(true);
    }
    None
}

#[derive(Debug)]
pub struct QuantizeStep {
    pub scheme: Scheme,
    pub format: Format,
    pub ignore: Vec<IgnoreRule>,
    /// Apply the default ignores (`lm_head`, embeddings, routers).
    pub default_ignore: bool,
    /// `quantization_config` once `apply` knows what was ignored.
    config: Mutex<Option<Value>>,
    /// `hf_quant_config.json` of `--format modelopt`, once `apply` knows what was ignored.
    hf_quant_config: Mutex<Option<String>>,
}

impl QuantizeStep {
    /// Refuses a format the scheme has no layout in.
    pub fn new(
        scheme: Scheme,
        format: Format,
        ignore: Vec<IgnoreRule>,
        default_ignore: bool,
    ) -> Result<QuantizeStep> {
        if format == Format::Fp8Native && scheme != Scheme::Fp8Block {
            return Err(Error::Usage(format!(
                "--format fp8-native holds 128x128-block FP8 only: use --scheme FP8_BLOCK, not {}",
                scheme.name()
            )));
        }
        if format == Format::Modelopt {
            modelopt::check_scheme(scheme)?;
        }
        Ok(QuantizeStep {
            scheme,
            format,
            ignore,
            default_ignore,
            config: Mutex::new(None),
            hf_quant_config: Mutex::new(None),
        })
    }

    fn format_name(&self) -> String {
        match self.format {
            Format::CompressedTensors => format!("compressed-tensors {}", self.scheme.format()),
            Format::Fp8Native => "fp8 (transformers FineGrainedFP8)".into(),
            Format::Modelopt => format!("ModelOpt {}", modelopt::quant_algo(self.scheme)),
        }
    }

    fn block_math(&self) -> BlockMath {
        match self.format {
            Format::CompressedTensors | Format::Modelopt => BlockMath::CompressedTensors,
            Format::Fp8Native => BlockMath::Transformers,
        }
    }
}

/// Tensors a quantiser adds beside the weights (scales, shapes), with fresh entry ids.
pub(super) struct Added {
    next_id: usize,
    items: Vec<(usize, Entry)>,
}

impl Added {
    pub(super) fn new(entries: &[Entry]) -> Added {
        Added {
            next_id: entries.iter().map(|e| e.id).max().map_or(0, |m| m + 1),
            items: Vec::new(),
        }
    }

    /// `{module}.{name}`, made by `derive` from input tensor `source`, to follow entry `after`.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn push(
        &mut self,
        after: usize,
        module: &str,
        source: usize,
        name: &str,
        dtype: DType,
        shape: Vec<u64>,
        derive: Arc<dyn Derive>,
    ) {
        self.items.push((
            after,
            Entry {
                id: self.next_id,
                name: format!("{module}.{name}"),
                source,
                dtype,
                shape,
                derive: Some(derive),
                relabel: false,
            },
        ));
        self.next_id += 1;
    }

    /// Puts each weight's new tensors right after it, in the order they were added.
    pub(super) fn splice_into(self, entries: &mut Vec<Entry>) {
        let mut added = self.items.into_iter().peekable();
        let mut merged = Vec::with_capacity(entries.len() + added.len());
        for (i, e) in std::mem::take(entries).into_iter().enumerate() {
            merged.push(e);
            while let Some((_, x)) = added.next_if(|(after, _)| *after == i) {
                merged.push(x);
            }
        }
        *entries = merged;
    }
}

/// The 2-D BF16/F16/F32 `X.weight` entries, stored or computed by an earlier step (a merge, a
/// cast) — by name, the `Linear` weights a quantiser may take: (entry index, module `X`,
/// weight type).
pub(super) fn linear_weights(entries: &[Entry]) -> Vec<(usize, String, WeightType)> {
    entries
        .iter()
        .enumerate()
        .filter(|(_, e)| {
            let primary = e.derive.as_ref().is_none_or(|d| d.secondary_of().is_none());
            primary && !e.relabel && e.shape.len() == 2
        })
        .filter_map(|(i, e)| {
            let module = e.name.strip_suffix(".weight")?;
            Some((i, module.to_string(), WeightType::of(e.dtype)?))
        })
        .collect()
}

/// Adds `lm_head` to the modules left alone (`listed`) when the embeddings are tied and the
/// default rules apply: a tied `lm_head` has no tensor but is still a `Linear` the libraries list.
/// What both formats do with the weights they chose: list a tied `lm_head` among the modules
/// left alone (`left_alone`, then sorted as the libraries list them), refuse weights whose
/// columns `group` does not divide, and read NVFP4's tensor scales (by entry index; none for the
/// other schemes).
pub(super) fn settle_chosen(
    step: &QuantizeStep,
    ckpt: &Checkpoint,
    config: Option<&Map<String, Value>>,
    entries: &[Entry],
    chosen: &[(usize, String, WeightType)],
    left_alone: &mut Vec<String>,
    group: Option<u64>,
) -> Result<HashMap<usize, Arc<TensorScale>>> {
    let (tool, kind) = if step.format == Format::Modelopt {
        ("ModelOpt", ScaleKind::Modelopt)
    } else {
        ("llm-compressor", ScaleKind::CompressedTensors)
    };
    list_tied_lm_head(config, step.default_ignore, entries, left_alone);
    left_alone.sort_by_cached_key(|m| module_order(m));
    refuse_partial_groups(ckpt, entries, chosen, step.scheme, group, tool)?;
    if step.scheme == Scheme::Nvfp4A16 {
        nvfp4_globals(ckpt, entries, chosen, kind)
    } else {
        Ok(HashMap::new())
    }
}

fn list_tied_lm_head(
    config: Option<&Map<String, Value>>,
    default_rules: bool,
    entries: &[Entry],
    listed: &mut Vec<String>,
) {
    let tied = config
        .and_then(|c| c.get("tie_word_embeddings"))
        .and_then(Value::as_bool)
        == Some(true);
    if tied
        && default_rules
        && !listed.iter().any(|m| m == "lm_head")
        && !entries.iter().any(|e| e.name == "lm_head.weight")
    {
        listed.push("lm_head".into());
    }
}

/// A refusal of chosen weight `e`, naming it and the `--ignore` that leaves it out.
pub(super) fn refuse_weight(ckpt: &Checkpoint, e: &Entry, why: String) -> Error {
    Error::TensorData {
        path: e.path(ckpt),
        tensor: e.name.clone(),
        msg: format!(
            "{why}; leave it unquantised with --ignore '{}'",
            e.name.strip_suffix(".weight").unwrap_or(&e.name)
        ),
    }
}

/// The quantiser `op` of entry `e`'s rows: reading the stored tensor; a stored tensor that an
/// earlier `--dtype-cast` retyped, through that cast; or, for a weight an earlier step computes
/// (a merge), the rows that step's op computes, in `e`'s dtype ([`crate::ops::feed`]). Call it
/// before `e` takes the codes' dtype.
pub(super) fn quantised_rows(
    ckpt: &Checkpoint,
    e: &Entry,
    op: Arc<dyn crate::ops::Op>,
) -> Arc<dyn Derive> {
    let fixed = Arc::new(FixedOp {
        inputs: vec![e.source],
        op,
    });
    let stored = ckpt.tensors[e.source].info.dtype;
    let feed: Arc<dyn Derive> = match &e.derive {
        Some(d) => d.clone(),
        None if stored == e.dtype => return fixed,
        None => crate::ops::cast::Cast::of_entry(ckpt, e),
    };
    Arc::new(FedDerive {
        outer: fixed,
        feeds: vec![FeedSource::Derived(feed, e.dtype)],
    })
}

/// Whether entry `e` is computed by an earlier step (a merge, a LoRA merge, a dequantisation)
/// or retyped by a cast, rather than stored as it is.
fn computed(ckpt: &Checkpoint, e: &Entry) -> bool {
    e.derive.is_some() || ckpt.tensors[e.source].info.dtype != e.dtype
}

/// Where tensor `t`'s bytes lie, piece by piece in order (`None` for a strided tensor, whose
/// elements are not runs of bytes), its files opened once in `files`.
fn pieces_of(
    ckpt: &Checkpoint,
    t: usize,
    files: &mut HashMap<usize, Arc<std::fs::File>>,
) -> Result<Option<Vec<Piece>>> {
    let Some(pieces) = ckpt.tensors[t].pieces() else {
        return Ok(None);
    };
    let mut ps = Vec::new();
    for (shard, offset, len) in pieces {
        let file = match files.get(&shard) {
            Some(f) => f.clone(),
            None => {
                let f = Arc::new(ckpt.shards[shard].file.try_clone().map_err(|e| {
                    Error::Other(format!(
                        "{}: {e}",
                        crate::escape::path(&ckpt.shards[shard].path)
                    ))
                })?);
                files.insert(shard, f.clone());
                f
            }
        };
        ps.push(Piece {
            file,
            path: ckpt.shards[shard].path.clone(),
            offset,
            len,
        });
    }
    Ok(Some(ps))
}

/// Refuses a chosen weight whose column count `group` does not divide (`tool` refuses such
/// layers too).
fn refuse_partial_groups(
    ckpt: &Checkpoint,
    entries: &[Entry],
    chosen: &[(usize, String, WeightType)],
    scheme: Scheme,
    group: Option<u64>,
    tool: &str,
) -> Result<()> {
    for &(i, _, _) in chosen {
        let e = &entries[i];
        let cols = e.shape[1];
        if let Some(g) = group.filter(|g| !cols.is_multiple_of(*g)) {
            let why = format!(
                "has {cols} columns, which {}'s group size {g} does not divide ({tool} refuses such layers too)",
                scheme.name()
            );
            return Err(refuse_weight(ckpt, e, why));
        }
    }
    Ok(())
}

/// The amax of a whole weight, read in pieces (for NVFP4 tensor scales).
pub(super) fn weight_amax(ckpt: &Checkpoint, src: usize, wt: WeightType) -> Result<f32> {
    let t = &ckpt.tensors[src];
    let total = t
        .info
        .dtype
        .byte_len(t.info.shape.iter().product())
        .unwrap_or(0);
    let piece = PLAN_READ_BYTES / 4 * 4;
    let read = |at: u64, buf: &mut [u8]| ckpt.read_tensor_at(t, at, buf);
    lanes::amax_read(wt, total, piece, read, |v| Error::TensorData {
        path: ckpt.shards[t.shard()].path.clone(),
        tensor: t.info.name.clone(),
        msg: format!("holds {v}: a non-finite weight cannot be quantised"),
    })
}

/// Refuses a checkpoint that is quantised already (by its config or its tensors).
fn refuse_quantized(ckpt: &Checkpoint, config: Option<&Map<String, Value>>) -> Result<()> {
    if let Some(q) = config.and_then(|c| c.get("quantization_config")) {
        let method = q.get("quant_method").and_then(Value::as_str).unwrap_or("?");
        return Err(Error::Other(format!(
            "{}: config.json has a quantization_config (quant_method `{method}`): the model is quantised already; dequantise it first (tftf dequant)",
            crate::escape::path(&ckpt.input)
        )));
    }
    let dtype_of = |n: &str| ckpt.get(n).map(|t| t.info.dtype);
    for t in &ckpt.tensors[..ckpt.base_count] {
        let quantized = matches!(
            t.info.dtype,
            DType::F8_E4M3
                | DType::F8_E5M2
                | DType::F8_E8M0
                | DType::F8_E4M3FNUZ
                | DType::F8_E5M2FNUZ
                | DType::F4
                | DType::F6_E2M3
                | DType::F6_E3M2
        ) || crate::format::quant::is_metadata(t.name(), t.info.dtype, &dtype_of);
        if quantized {
            return Err(Error::TensorData {
                path: ckpt.shards[t.shard()].path.clone(),
                tensor: t.info.name.clone(),
                msg: format!(
                    "is quantisation data ({}): the model is quantised already; dequantise it first (tftf dequant)",
                    t.info.dtype
                ),
            });
        }
    }
    Ok(())
}

impl PlanStep for QuantizeStep {
    fn apply(&self, p: Planning) -> Result<bool> {
        let (ckpt, config, entries, notes) = (p.ckpt, p.config, p.entries, p.notes);
        refuse_quantized(ckpt, config)?;
        if self.format == Format::Modelopt {
            let (changed, cfg, hf) = modelopt::plan(
                self,
                Planning {
                    ckpt,
                    config,
                    entries,
                    notes,
                },
            )?;
            *self.config.lock().unwrap() = Some(cfg);
            *self.hf_quant_config.lock().unwrap() = Some(hf);
            return Ok(changed);
        }
        let scheme = self.scheme;
        // (entry index, module name, weight type)
        let mut chosen: Vec<(usize, String, WeightType)> = Vec::new();
        let mut ignored: Vec<String> = Vec::new();
        let mut left: Vec<String> = Vec::new();
        for (i, module, wt) in linear_weights(entries) {
            let name = &entries[i].name;
            if self.ignore.iter().any(|r| r.matches(&module, name)) {
                ignored.push(module);
                continue;
            }
            match default_ignore(&module).filter(|_| self.default_ignore) {
                Some(true) => ignored.push(module),
                Some(false) => left.push(name.clone()),
                None => chosen.push((i, module, wt)),
            }
        }
        let globals = settle_chosen(
            self,
            ckpt,
            config,
            entries,
            &chosen,
            &mut ignored,
            scheme.group(),
        )?;

        let mut added = Added::new(entries);
        for &(i, ref module, wt) in &chosen {
            let e = &entries[i];
            let (rows, cols, src, id) = (e.shape[0], e.shape[1], e.source, e.id);
            let before = e.clone();
            let tensor_scale = globals.get(&i).cloned();
            let op = QuantizeRows {
                scheme,
                rows,
                cols,
                wt,
                global: 1.0,
                block: self.block_math(),
            };
            let mut extra = |name: &str, dtype: DType, shape: Vec<u64>, d: Arc<dyn Derive>| {
                added.push(i, module, src, name, dtype, shape, d)
            };
            let secondary = Arc::new(ExtraOutput {
                primary: id,
                output: 1,
            });
            let w = wt.dtype();
            let (code_dtype, code_shape) = match scheme {
                Scheme::Fp8Dynamic => {
                    extra("weight_scale", w, vec![rows, 1], secondary);
                    (DType::F8_E4M3, vec![rows, cols])
                }
                Scheme::Fp8Block => {
                    let shape = vec![rows.div_ceil(128), cols.div_ceil(128)];
                    let name = match self.format {
                        Format::CompressedTensors => "weight_scale",
                        Format::Fp8Native => "weight_scale_inv",
                        Format::Modelopt => unreachable!("planned by modelopt::plan"),
                    };
                    extra(name, self.block_math().scale_dtype(wt), shape, secondary);
                    (DType::F8_E4M3, vec![rows, cols])
                }
                Scheme::W8A16 | Scheme::W4A16 => {
                    extra("weight_scale", w, vec![rows, cols / 128], secondary);
                    let mut bytes = (rows as i64).to_le_bytes().to_vec();
                    bytes.extend((cols as i64).to_le_bytes());
                    let shape_op = Arc::new(Constant {
                        what: "quantize weight_shape",
                        bytes,
                    });
                    extra(
                        "weight_shape",
                        DType::I64,
                        vec![2],
                        Arc::new(FixedOp {
                            inputs: Vec::new(),
                            op: shape_op,
                        }),
                    );
                    let words = (cols * scheme.int_bits() as u64).div_ceil(32);
                    (DType::I32, vec![rows, words])
                }
                Scheme::Nvfp4A16 => {
                    let (d, shape) = group_scale(scheme, rows, cols);
                    extra("weight_scale", d, shape, secondary);
                    let g_op = Arc::new(GlobalScaleTensor(
                        tensor_scale
                            .clone()
                            .expect("NVFP4 weights have a tensor scale"),
                    ));
                    extra(
                        "weight_global_scale",
                        DType::F32,
                        vec![1],
                        Arc::new(FixedOp {
                            inputs: Vec::new(),
                            op: g_op,
                        }),
                    );
                    (DType::U8, vec![rows, cols / 2])
                }
                Scheme::Mxfp4A16 | Scheme::Mxfp8A16 => {
                    let (d, shape) = group_scale(scheme, rows, cols);
                    extra("weight_scale", d, shape, secondary);
                    match scheme {
                        Scheme::Mxfp4A16 => (DType::U8, vec![rows, cols / 2]),
                        _ => (DType::F8_E4M3, vec![rows, cols]),
                    }
                }
            };
            let e = &mut entries[i];
            if scheme.packed() {
                e.name = format!("{module}.weight_packed");
            }
            e.dtype = code_dtype;
            e.shape = code_shape;
            let op: Arc<dyn crate::ops::Op> = match tensor_scale {
                Some(scale) => Arc::new(Nvfp4Rows { rows: op, scale }),
                None => Arc::new(op),
            };
            e.derive = Some(quantised_rows(ckpt, &before, op));
        }
        added.splice_into(entries);

        notes.lines.push(format!(
            "{}: {} Linear weight(s) quantised ({} format)",
            scheme.name(),
            chosen.len(),
            self.format_name()
        ));
        if !ignored.is_empty() {
            notes.lines.push(format!(
                "left unquantised (quantization_config.ignore): {}",
                ignored.join(", ")
            ));
        }
        if !left.is_empty() {
            notes.lines.push(format!(
                "left unquantised (not Linear weights): {}",
                left.join(", ")
            ));
        }
        *self.config.lock().unwrap() = Some(match self.format {
            Format::CompressedTensors => scheme.quantization_config(&ignored),
            Format::Fp8Native => fp8_native_config(&ignored),
            Format::Modelopt => unreachable!("planned by modelopt::plan"),
        });
        Ok(!chosen.is_empty())
    }

    fn edit_config(&self, cfg: &mut Map<String, Value>) -> Vec<String> {
        let Some(q) = self.config.lock().unwrap().clone() else {
            return Vec::new();
        };
        cfg.insert("quantization_config".into(), q);
        vec![format!(
            "config.json: quantization_config added ({} {})",
            self.scheme.name(),
            self.format_name()
        )]
    }

    fn generated_files(&self) -> Vec<(String, String)> {
        self.hf_quant_config
            .lock()
            .unwrap()
            .clone()
            .map(|text| vec![(modelopt::HF_QUANT_CONFIG.to_string(), text)])
            .unwrap_or_default()
    }

    fn nothing_done(&self) -> String {
        "quantize found no Linear weight to quantise (a 2-D bf16, f16 or f32 `*.weight` that no ignore rule names)".into()
    }
}

/// The order llm-compressor lists ignored modules in (`model.named_modules()`), as far as
/// names tell it: layers by number, `lm_head` (defined after the model body) last; modules of
/// one layer by name, where the library has definition order (they differ only when several
/// modules of one layer are ignored).
pub(super) fn module_order(module: &str) -> (bool, Vec<(u64, String)>) {
    let key = module
        .split('.')
        .map(|seg| match seg.parse::<u64>() {
            Ok(n) => (n, String::new()),
            Err(_) => (u64::MAX, seg.to_string()),
        })
        .collect();
    (module == "lm_head", key)
}

/// NVFP4 tensor scales by entry index: each weight's own amax, or its fused group's, one
/// [`TensorScale`] per group, read when the pipeline first needs it (weights that are not one
/// byte range per file, such as strided views, are read here at plan time). A fused group is
/// the projections that read one input (q/k/v, gate/up): compressed-tensors fuses them only
/// when all are quantised, ModelOpt whichever are.
fn nvfp4_globals(
    ckpt: &Checkpoint,
    entries: &[Entry],
    chosen: &[(usize, String, WeightType)],
    kind: ScaleKind,
) -> Result<HashMap<usize, Arc<TensorScale>>> {
    let by_module: HashMap<&str, (usize, WeightType)> = chosen
        .iter()
        .map(|(i, m, wt)| (m.as_str(), (*i, *wt)))
        .collect();
    let mut files: HashMap<usize, Arc<std::fs::File>> = HashMap::new();
    let mut shared: HashMap<(Vec<usize>, WeightType), Arc<TensorScale>> = HashMap::new();
    let mut out = HashMap::new();
    let mut order: Vec<Arc<TensorScale>> = Vec::new();
    for &(i, ref module, wt) in chosen {
        let (parent, last) = module.rsplit_once('.').unwrap_or(("", module));
        let mut group: Vec<usize> = FUSED_LAYER_NAMES
            .iter()
            .find(|names| names.contains(&last))
            .and_then(|names| {
                let found: Vec<Option<usize>> = names
                    .iter()
                    .map(|n| {
                        let m = if parent.is_empty() {
                            n.to_string()
                        } else {
                            format!("{parent}.{n}")
                        };
                        by_module.get(m.as_str()).map(|&(j, _)| j)
                    })
                    .collect();
                match kind {
                    ScaleKind::CompressedTensors => found.into_iter().collect(),
                    ScaleKind::Modelopt => Some(found.into_iter().flatten().collect()),
                }
            })
            .unwrap_or_else(|| vec![i]);
        group.sort_unstable();
        let key = (group, wt);
        if let Some(s) = shared.get(&key) {
            out.insert(i, s.clone());
            continue;
        }
        let mut members = Vec::new();
        let mut lazy = true;
        for &j in &key.0 {
            let e = &entries[j];
            let member_wt = by_module
                .values()
                .find(|&&(k, _)| k == j)
                .map_or(wt, |&(_, w)| w);
            let source = if computed(ckpt, e) {
                // The rows the earlier step computes, evaluated once more for the amax.
                let derive = match &e.derive {
                    Some(d) => d.clone(),
                    None => crate::ops::cast::Cast::of_entry(ckpt, e),
                };
                let inputs: Option<Vec<Vec<Piece>>> = (derive.inputs().iter())
                    .map(|&t| pieces_of(ckpt, t, &mut files))
                    .collect::<Result<Vec<_>>>()?
                    .into_iter()
                    .collect();
                let Some(inputs) = inputs else {
                    return Err(refuse_weight(
                        ckpt,
                        e,
                        "is computed by an earlier step from tensors that cannot be read piecewise, and NVFP4's tensor scale needs the whole computed weight's amax before its first block: write that step's output, then quantise it".into(),
                    ));
                };
                Member::Computed {
                    op: derive.build(e.dtype),
                    inputs,
                }
            } else {
                match pieces_of(ckpt, e.source, &mut files)? {
                    Some(ps) => Member::Stored(ps),
                    None => {
                        lazy = false;
                        break;
                    }
                }
            };
            members.push((e.name.clone(), member_wt, source));
        }
        if !lazy {
            if let Some(&j) = key.0.iter().find(|&&j| computed(ckpt, &entries[j])) {
                return Err(refuse_weight(
                    ckpt,
                    &entries[j],
                    "is computed by an earlier step, in an NVFP4 tensor-scale group with a weight that cannot be read piecewise: write that step's output, then quantise it".into(),
                ));
            }
        }
        let scale = if lazy {
            TensorScale::lazy(wt, kind, members)
        } else {
            let mut m = 0f32;
            for &j in &key.0 {
                let member_wt = by_module
                    .values()
                    .find(|&&(k, _)| k == j)
                    .map_or(wt, |&(_, w)| w);
                let a = weight_amax(ckpt, entries[j].source, member_wt)?;
                if let Some(why) = kind.refuse(&entries[j].name, a) {
                    let t = &ckpt.tensors[entries[i].source];
                    return Err(Error::TensorData {
                        path: ckpt.shards[t.shard()].path.clone(),
                        tensor: entries[i].name.clone(),
                        msg: why,
                    });
                }
                m = m.max(a);
            }
            TensorScale::known(wt, kind, m)
        };
        let scale = Arc::new(scale);
        shared.insert(key, scale.clone());
        order.push(scale.clone());
        out.insert(i, scale);
    }
    // Chosen weights come in the output's order, so each group's read asks for the next.
    for pair in order.windows(2) {
        pair[0].read_ahead(&pair[1]);
    }
    Ok(out)
}

/// The `weight_scale` of the FP4/FP8 group schemes (NVFP4: E4M3 per 16; MXFP4, MXFP8: E8M0 per
/// 32), as every format stores it.
pub(crate) fn group_scale(scheme: Scheme, rows: u64, cols: u64) -> (DType, Vec<u64>) {
    match scheme {
        Scheme::Nvfp4A16 => (DType::F8_E4M3, vec![rows, cols / 16]),
        _ => (DType::U8, vec![rows, cols / 32]),
    }
}
