//! `quantize --format modelopt`: the checkpoint NVIDIA ModelOpt 0.47 writes with
//! `mtq.quantize(model, CFG)` + `export_hf_checkpoint(model)` for its weight-only presets,
//! byte for byte (tensors, `hf_quant_config.json`, and config.json's `quantization_config`;
//! checked in `tests/quantize.rs` against tests/fixtures/quantize/modelopt).
//!
//! | scheme | ModelOpt config | `quant_algo` | tensors |
//! | --- | --- | --- | --- |
//! | FP8_BLOCK | `FP8_2D_BLOCKWISE_WEIGHT_ONLY_CFG` | `fp8_pb_wo` | `weight` F8_E4M3, `weight_scale` F32 `[⌈out/128⌉, 1, ⌈in/128⌉, 1]` |
//! | FP8_DYNAMIC | `FP8_PER_CHANNEL_PER_TOKEN_CFG` | `FP8_PER_CHANNEL_PER_TOKEN` | `weight` F8_E4M3, `weight_scale` F32 `[out]` |
//! | NVFP4A16 | `W4A16_NVFP4_CFG` | `W4A16_NVFP4` | `weight` U8 `[out, in/2]`, `weight_scale` F8_E4M3 `[out, in/16]`, `weight_scale_2` F32 `[]` |
//! | MXFP4A16 | `MXFP4_DEFAULT_CFG`, inputs not quantised | `mxfp4` | `weight` U8 `[out, in/2]`, `weight_scale` U8 (E8M0) `[out, in/32]` |
//! | MXFP8A16 | `MXFP8_DEFAULT_CFG`, inputs not quantised | `MXFP8` | `weight` F8_E4M3, `weight_scale` U8 (E8M0) `[out, in/32]` |
//! | W4A16 | `INT4_BLOCKWISE_WEIGHT_ONLY_CFG` | `W4A16_AWQ` | `weight` U8 `[out/2, in]` (rows 2k and 2k+1 in the low and high nibble, two's complement), `weight_scale` F32 `[out, in/128]` |
//!
//! W8A16 (int8, 128 per group) has no ModelOpt counterpart (its INT8 weight-only preset is
//! per channel), so it is refused.
//!
//! ModelOpt computes in f32 after upcasting the weight (see the `modelopt_*` functions of
//! `encode.rs`). Its ignore list (`exclude_modules`) names every module that has a quantizer
//! and was left alone: the `Linear` modules its default rules disable (`*lm_head*`,
//! `*router*`, `*mlp.gate.*`, …) or `--ignore` names, and the embeddings; prefixes that cover
//! no quantised module are summarised as `prefix*` wildcards as ModelOpt does. NVFP4's
//! `weight_scale_2` is shared by projections that read the same input (q/k/v, gate/up),
//! which ModelOpt finds by running the model; here by name, as for compressed-tensors.

use std::collections::{BTreeSet, HashSet};
use std::sync::Arc;

use serde_json::{json, Map, Value};

use super::encode::{
    amax, f32_to_e2m1, f32_to_e4m3, modelopt_e4m3_code, modelopt_fp8_scale, modelopt_int4_code,
    modelopt_int4_scale, modelopt_mx_exponent, modelopt_mx_exponent_bits, modelopt_mxfp4_code,
    modelopt_nvfp4_block_scale, pow2_f32, WeightType, E2M1_MAX, E4M3_MAX,
};
use super::kernel::QuantParams;
use super::lanes::{self, Elem, LaneEncoder, RowChunk, F32};
use super::ops::{decode_rows, nonfinite_rows, row_lane_fields, row_quantiser_op};
use super::tensor_scale::{GlobalScaleTensor, Nvfp4Rows, ScaledRows};
use super::{
    default_ignore, group_scale, linear_weights, refuse_weight, settle_chosen, Added, QuantizeStep,
    Scheme,
};
use crate::error::{Error, Result};
use crate::format::dtype::DType;
use crate::ops::fp8::codec::e4m3_to_f32;
use crate::ops::Op;
use crate::plan::{Derive, ExtraOutput, FixedOp, Planning};

/// The ModelOpt version whose export this matches (`producer.version`).
pub const MODELOPT_VERSION: &str = "0.47.0";

/// The file ModelOpt writes beside config.json.
pub const HF_QUANT_CONFIG: &str = "hf_quant_config.json";

/// FP8 block edge.
const BLOCK: u64 = 128;

/// ModelOpt's default rules that leave a module's weight alone
/// (`default_disabled_quantizers`), matched against `MODULE.weight_quantizer`.
const DISABLED: &[&str] = &[
    "*block_sparse_moe.gate*",
    "*linear_attn.conv1d*",
    "*self_attention.conv1d*",
    "*linear_attn.in_proj_a*",
    "*linear_attn.in_proj_b*",
    "*lm_head*",
    "*mixer.conv1d*",
    "*mlp.gate.*",
    "*mlp.shared_expert_gate.*",
    "*output_layer*",
    "*proj_out.*",
    "*router*",
    "mtp.*",
    "output.*",
    "*embed_vision*",
    "*vision_tower*",
    "*visual*",
    "*vision_model*",
    "*multi_modal_projector*",
];

/// Refuses a scheme ModelOpt has no weight-only export for.
pub fn check_scheme(scheme: Scheme) -> Result<()> {
    match scheme {
        Scheme::Fp8Block
        | Scheme::Fp8Dynamic
        | Scheme::Nvfp4A16
        | Scheme::Mxfp4A16
        | Scheme::Mxfp8A16
        | Scheme::W4A16 => Ok(()),
        Scheme::W8A16 => Err(Error::Usage(format!(
            "--format modelopt cannot hold {}: ModelOpt has no int8 weight-only export with 128-element groups (its INT8 weight-only is per channel); use --format compressed-tensors, or --format modelopt with FP8_BLOCK, FP8_DYNAMIC, NVFP4A16, MXFP4A16, MXFP8A16 or W4A16",
            scheme.name()
        ))),
    }
}

/// `quant_algo` in `hf_quant_config.json`.
pub fn quant_algo(scheme: Scheme) -> &'static str {
    match scheme {
        Scheme::Fp8Block => "fp8_pb_wo",
        Scheme::Fp8Dynamic => "FP8_PER_CHANNEL_PER_TOKEN",
        Scheme::Nvfp4A16 => "W4A16_NVFP4",
        Scheme::Mxfp4A16 => "mxfp4",
        Scheme::Mxfp8A16 => "MXFP8",
        Scheme::W4A16 => "W4A16_AWQ",
        Scheme::W8A16 => unreachable!("refused by check_scheme"),
    }
}

/// Elements per scale along a row, for the schemes that need whole groups.
fn group(scheme: Scheme) -> Option<u64> {
    match scheme {
        Scheme::Nvfp4A16 => Some(16),
        Scheme::Mxfp4A16 | Scheme::Mxfp8A16 => Some(32),
        Scheme::W4A16 => Some(128),
        _ => None,
    }
}

/// `group_size` as `hf_quant_config.json` states it (ModelOpt omits it for some algorithms).
fn stated_group_size(scheme: Scheme) -> Option<u64> {
    match scheme {
        Scheme::Nvfp4A16 => Some(16),
        Scheme::Mxfp8A16 => Some(32),
        Scheme::W4A16 => Some(128),
        _ => None,
    }
}

/// `fnmatch` with `*` as the only wildcard (all ModelOpt's default rules use).
fn wildcard(pattern: &str, name: &str) -> bool {
    let parts: Vec<&str> = pattern.split('*').collect();
    let (first, last) = (parts[0], parts[parts.len() - 1]);
    if parts.len() == 1 {
        return pattern == name;
    }
    if !name.starts_with(first) || name.len() < first.len() + last.len() || !name.ends_with(last) {
        return false;
    }
    let mut rest = &name[first.len()..name.len() - last.len()];
    for p in &parts[1..parts.len() - 1] {
        match rest.find(p) {
            Some(i) => rest = &rest[i + p.len()..],
            None => return false,
        }
    }
    true
}

/// Whether ModelOpt's default rules leave the `Linear` module alone.
fn disabled_by_default(module: &str) -> bool {
    let q = format!("{module}.weight_quantizer");
    DISABLED.iter().any(|p| wildcard(p, &q))
}

/// ModelOpt's `_prefix_wildcard_summarize_exclude_modules`, then `sorted`.
pub fn summarize_excluded(unquantized: &[String], quantized: &[String]) -> Vec<String> {
    let mut negative: HashSet<String> = HashSet::new();
    for l in quantized {
        negative.insert(l.clone());
        for (i, _) in l.char_indices().chain(std::iter::once((l.len(), ' '))) {
            negative.insert(format!("{}*", &l[..i]));
        }
    }
    let candidates = |name: &str| -> Vec<Vec<String>> {
        let mut v = Vec::new();
        for (i, c) in name.char_indices() {
            if c == '.' {
                v.push(vec![format!("{}*", &name[..i])]);
                v.push(vec![name[..i].to_string(), format!("{}.*", &name[..i])]);
            }
        }
        v.push(vec![name.to_string()]);
        v
    };
    let mut res: BTreeSet<String> = BTreeSet::new();
    for layer in unquantized {
        let mut chosen: Vec<String> = Vec::new();
        for wildcards in candidates(layer) {
            if wildcards.iter().any(|w| negative.contains(w)) {
                continue;
            }
            if wildcards.iter().all(|w| res.contains(w)) {
                chosen.clear();
                break;
            }
            chosen = wildcards;
            break;
        }
        if chosen.len() == 2 {
            let (a, b) = if chosen[0].len() <= chosen[1].len() {
                (&chosen[0], &chosen[1])
            } else {
                (&chosen[1], &chosen[0])
            };
            if *b == format!("{a}.*") {
                res.insert(b.clone());
            } else {
                res.extend(chosen);
            }
        } else {
            res.extend(chosen);
        }
    }
    res.into_iter().collect()
}

/// `hf_quant_config.json` as a value, keys in ModelOpt's order.
pub fn hf_quant_config(scheme: Scheme, exclude: &[String]) -> Value {
    let mut q = Map::new();
    q.insert("quant_algo".into(), json!(quant_algo(scheme)));
    q.insert("kv_cache_quant_algo".into(), Value::Null);
    if let Some(g) = stated_group_size(scheme) {
        q.insert("group_size".into(), json!(g));
    }
    if scheme == Scheme::W4A16 {
        q.insert("has_zero_point".into(), json!(false));
        q.insert("pre_quant_scale".into(), json!(true));
    }
    q.insert("exclude_modules".into(), json!(exclude));
    json!({
        "producer": {"name": "modelopt", "version": MODELOPT_VERSION},
        "quantization": Value::Object(q),
    })
}

/// config.json's `quantization_config` (`convert_hf_quant_config_format`).
pub fn quantization_config(scheme: Scheme, exclude: &[String]) -> Value {
    let mut c = Map::new();
    if scheme == Scheme::Nvfp4A16 {
        c.insert(
            "config_groups".into(),
            json!({"group_0": {
                "weights": {"dynamic": false, "num_bits": 4, "type": "float", "group_size": 16},
                "targets": ["Linear"],
            }}),
        );
    }
    c.insert("ignore".into(), json!(exclude));
    c.insert("quant_algo".into(), json!(quant_algo(scheme)));
    c.insert(
        "producer".into(),
        json!({"name": "modelopt", "version": MODELOPT_VERSION}),
    );
    c.insert("quant_method".into(), json!("modelopt"));
    Value::Object(c)
}

/// `json.dump(v, f, indent=4)`: four-space indents, ASCII only, no final newline.
pub fn python_json(v: &Value) -> String {
    use serde::Serialize;
    let mut buf = Vec::new();
    let fmt = serde_json::ser::PrettyFormatter::with_indent(b"    ");
    let mut ser = serde_json::Serializer::with_formatter(&mut buf, fmt);
    v.serialize(&mut ser).expect("JSON value");
    let text = String::from_utf8(buf).expect("serde_json writes UTF-8");
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        if c.is_ascii() {
            out.push(c);
        } else {
            let mut units = [0u16; 2];
            for u in c.encode_utf16(&mut units) {
                out.push_str(&format!("\\u{u:04x}"));
            }
        }
    }
    out
}

/// Plans `--format modelopt`: rewrites `entries`, returns whether anything is quantised,
/// config.json's `quantization_config` and the text of `hf_quant_config.json`.
pub(super) fn plan(step: &QuantizeStep, p: Planning) -> Result<(bool, Value, String)> {
    let (ckpt, config, entries, notes) = (p.ckpt, p.config, p.entries, p.notes);
    let scheme = step.scheme;
    let mut chosen: Vec<(usize, String, WeightType)> = Vec::new();
    // Modules with a quantizer left alone: `Linear` (ignored) and embeddings.
    let mut unquantized: Vec<String> = Vec::new();
    for (i, module, wt) in linear_weights(entries) {
        if default_ignore(&module) == Some(false) {
            // an embedding: never quantised, listed as ModelOpt lists it
            unquantized.push(module);
        } else if step
            .ignore
            .iter()
            .any(|r| r.matches(&module, &entries[i].name))
            || (step.default_ignore && disabled_by_default(&module))
        {
            unquantized.push(module);
        } else {
            chosen.push((i, module, wt));
        }
    }
    let scale_2 = settle_chosen(
        step,
        ckpt,
        config,
        entries,
        &chosen,
        &mut unquantized,
        group(scheme),
    )?;
    for &(i, _, _) in &chosen {
        let e = &entries[i];
        if scheme == Scheme::W4A16 && !e.shape[0].is_multiple_of(2) {
            let why = format!(
                "has {} rows: ModelOpt packs INT4 codes of two rows a byte and refuses an odd count",
                e.shape[0]
            );
            return Err(refuse_weight(ckpt, e, why));
        }
    }

    let mut added = Added::new(entries);
    for &(i, ref module, wt) in &chosen {
        let e = &entries[i];
        let (rows, cols, src, id) = (e.shape[0], e.shape[1], e.source, e.id);
        let before = e.clone();
        let s2 = scale_2.get(&i).cloned();
        let mut extra = |name: &str, dtype: DType, shape: Vec<u64>, d: Arc<dyn Derive>| {
            added.push(i, module, src, name, dtype, shape, d)
        };
        let secondary = Arc::new(ExtraOutput {
            primary: id,
            output: 1,
        });
        let fixed = |op: Arc<dyn Op>, inputs: Vec<usize>| Arc::new(FixedOp { inputs, op });
        let code_dtype = match scheme {
            Scheme::Fp8Block => {
                let shape = vec![rows.div_ceil(BLOCK), 1, cols.div_ceil(BLOCK), 1];
                extra("weight_scale", DType::F32, shape, secondary);
                DType::F8_E4M3
            }
            Scheme::Fp8Dynamic => {
                extra("weight_scale", DType::F32, vec![rows], secondary);
                DType::F8_E4M3
            }
            Scheme::Nvfp4A16 => {
                let (d, shape) = group_scale(scheme, rows, cols);
                extra("weight_scale", d, shape, secondary);
                let s2 = GlobalScaleTensor(s2.clone().expect("NVFP4 weights have a scale"));
                extra(
                    "weight_scale_2",
                    DType::F32,
                    Vec::new(),
                    fixed(Arc::new(s2), Vec::new()),
                );
                DType::U8
            }
            Scheme::Mxfp4A16 | Scheme::Mxfp8A16 => {
                let (d, shape) = group_scale(scheme, rows, cols);
                extra("weight_scale", d, shape, secondary);
                match scheme {
                    Scheme::Mxfp4A16 => DType::U8,
                    _ => DType::F8_E4M3,
                }
            }
            Scheme::W4A16 => {
                extra(
                    "weight_scale",
                    DType::F32,
                    vec![rows, cols / 128],
                    secondary,
                );
                DType::U8
            }
            Scheme::W8A16 => unreachable!("refused by check_scheme"),
        };
        let op = ModeloptRows {
            scheme,
            rows,
            cols,
            wt,
            // replaced by the group's scale when a chunk is encoded
            scale_2: 1.0,
        };
        let e = &mut entries[i];
        e.dtype = code_dtype;
        e.shape = if scheme == Scheme::W4A16 {
            vec![rows / 2, cols]
        } else {
            vec![rows, op.row_code_bytes()]
        };
        let op: Arc<dyn Op> = match s2 {
            Some(scale) => Arc::new(Nvfp4Rows { rows: op, scale }),
            None => Arc::new(op),
        };
        e.derive = Some(super::quantised_rows(ckpt, &before, op));
    }
    added.splice_into(entries);

    let quantized: Vec<String> = chosen.iter().map(|(_, m, _)| m.clone()).collect();
    let exclude = summarize_excluded(&unquantized, &quantized);
    notes.lines.push(format!(
        "{}: {} Linear weight(s) quantised (ModelOpt {} format)",
        scheme.name(),
        chosen.len(),
        quant_algo(scheme)
    ));
    if !exclude.is_empty() {
        notes.lines.push(format!(
            "left unquantised (exclude_modules, embeddings included): {}",
            exclude.join(", ")
        ));
    }
    let hf = python_json(&hf_quant_config(scheme, &exclude));
    Ok((
        !chosen.is_empty(),
        quantization_config(scheme, &exclude),
        hf,
    ))
}

/// ModelOpt's FP8 scales of the 128×128 blocks of rows `x` (at most 128 of them).
fn block_scales(x: &[f32], rows: usize, cols: usize) -> Vec<f32> {
    let b = BLOCK as usize;
    (0..cols.div_ceil(b))
        .map(|j| {
            let (c0, c1) = (j * b, ((j + 1) * b).min(cols));
            let m = (0..rows).fold(0f32, |m, r| m.max(amax(&x[r * cols + c0..r * cols + c1])));
            modelopt_fp8_scale(m)
        })
        .collect()
}

/// Codes (output 0) and scales (output 1: a row of 128×128 block scales per 128 rows for FP8
/// blocks) of rows of a weight, as ModelOpt exports them.
#[derive(Clone, Copy, Debug)]
pub struct ModeloptRows {
    pub scheme: Scheme,
    pub rows: u64,
    pub cols: u64,
    pub wt: WeightType,
    /// NVFP4's `weight_scale_2`.
    pub scale_2: f32,
}

impl ModeloptRows {
    /// The kernel's parameters for a chunk of `rows` rows.
    fn quant_params(&self, rows: u64) -> QuantParams {
        QuantParams::modelopt(self.scheme, rows, self.cols, self.wt, self.scale_2)
    }

    fn row(&self, x: &[f32], codes: &mut [u8], scales: &mut [u8]) {
        match self.scheme {
            Scheme::Fp8Dynamic => {
                let s = modelopt_fp8_scale(amax(x));
                scales.copy_from_slice(&s.to_le_bytes());
                for (c, &v) in codes.iter_mut().zip(x) {
                    *c = modelopt_e4m3_code(v, s);
                }
            }
            Scheme::Nvfp4A16 => {
                let s2 = self.scale_2;
                for (k, xs) in x.chunks_exact(16).enumerate() {
                    let sc = modelopt_nvfp4_block_scale(amax(xs), s2);
                    scales[k] = sc;
                    let eff = e4m3_to_f32(sc) * s2;
                    for (j, p) in xs.chunks_exact(2).enumerate() {
                        codes[k * 8 + j] = f32_to_e2m1(p[0] / eff) | f32_to_e2m1(p[1] / eff) << 4;
                    }
                }
            }
            Scheme::Mxfp4A16 => {
                for (k, xs) in x.chunks_exact(32).enumerate() {
                    let e = modelopt_mx_exponent(amax(xs), 6.0);
                    scales[k] = (e + 127) as u8;
                    let p = pow2_f32(e);
                    for (j, v) in xs.chunks_exact(2).enumerate() {
                        codes[k * 16 + j] =
                            modelopt_mxfp4_code(v[0] / p) | modelopt_mxfp4_code(v[1] / p) << 4;
                    }
                }
            }
            Scheme::Mxfp8A16 => {
                for (k, xs) in x.chunks_exact(32).enumerate() {
                    let e = modelopt_mx_exponent(amax(xs), E4M3_MAX);
                    scales[k] = (e + 127) as u8;
                    let f = pow2_f32(-e);
                    for (c, &v) in codes[k * 32..(k + 1) * 32].iter_mut().zip(xs) {
                        *c = f32_to_e4m3((v * f).clamp(-E4M3_MAX, E4M3_MAX));
                    }
                }
            }
            _ => unreachable!("FP8 blocks are encoded a block row at a time"),
        }
    }
}

impl ScaledRows for ModeloptRows {
    fn scaled(self, s: f32) -> Self {
        ModeloptRows { scale_2: s, ..self }
    }
}

impl Op for ModeloptRows {
    fn granularity(&self) -> u64 {
        match self.scheme {
            Scheme::Fp8Block => BLOCK,
            Scheme::W4A16 => 2,
            _ => 1,
        }
    }
    row_quantiser_op!();
}

impl ModeloptRows {
    /// The scalar encoder, element by element as ModelOpt's arithmetic reads: the reference the
    /// lane-parallel encoder is tested against.
    pub fn compute_reference(&self, c: RowChunk) -> Result<(), String> {
        let (n, cols, cb, sb) = (c.n, c.cols, c.cb, c.sb);
        let (codes, scales) = (c.codes, c.scales);
        let x = decode_rows(self.wt, self.cols, c.units.start, c.input)?;
        if self.scheme == Scheme::Fp8Block {
            let b = BLOCK as usize;
            for r0 in (0..n).step_by(b) {
                let r1 = (r0 + b).min(n);
                let s = block_scales(&x[r0 * cols..r1 * cols], r1 - r0, cols);
                let row = &mut scales[r0 / b * sb..(r0 / b + 1) * sb];
                for (o, v) in row.chunks_exact_mut(4).zip(&s) {
                    o.copy_from_slice(&v.to_le_bytes());
                }
                for r in r0..r1 {
                    for (c, code) in codes[r * cb..(r + 1) * cb].iter_mut().enumerate() {
                        *code = modelopt_e4m3_code(x[r * cols + c], s[c / b]);
                    }
                }
            }
            return Ok(());
        }
        if self.scheme == Scheme::W4A16 {
            // Rows 2k and 2k+1 share a packed row of `cols` bytes.
            let mut s = vec![0f32; cols / 128];
            for r in 0..n {
                let xr = &x[r * cols..(r + 1) * cols];
                for (g, xs) in xr.chunks_exact(128).enumerate() {
                    s[g] = modelopt_int4_scale(amax(xs));
                    scales[r * sb + 4 * g..r * sb + 4 * g + 4].copy_from_slice(&s[g].to_le_bytes());
                }
                let packed = &mut codes[(r / 2) * cols..(r / 2 + 1) * cols];
                let shift = 4 * (r % 2);
                for (c, o) in packed.iter_mut().enumerate() {
                    let q = modelopt_int4_code(xr[c], s[c / 128]);
                    *o = if shift == 0 { q } else { *o | q << 4 };
                }
            }
            return Ok(());
        }
        for r in 0..n {
            self.row(
                &x[r * cols..(r + 1) * cols],
                &mut codes[r * cb..(r + 1) * cb],
                &mut scales[r * sb..(r + 1) * sb],
            );
        }
        Ok(())
    }
}

impl LaneEncoder for ModeloptRows {
    row_lane_fields!();
    /// Code bytes per row (W4A16: half of a packed row of two).
    fn row_code_bytes(&self) -> u64 {
        match self.scheme {
            Scheme::Nvfp4A16 | Scheme::Mxfp4A16 | Scheme::W4A16 => self.cols / 2,
            _ => self.cols,
        }
    }

    /// Scale bytes per row (FP8 blocks: per 128-row block row).
    fn row_scale_bytes(&self) -> u64 {
        match self.scheme {
            Scheme::Fp8Block => 4 * self.cols.div_ceil(BLOCK),
            Scheme::Fp8Dynamic => 4,
            Scheme::Nvfp4A16 => self.cols / 16,
            Scheme::Mxfp4A16 | Scheme::Mxfp8A16 => self.cols / 32,
            Scheme::W4A16 => 4 * self.cols / 128,
            _ => 0,
        }
    }

    /// The lane-parallel encoder: [`Self::compute_reference`]'s arithmetic a row at a time (each
    /// row decoded into a buffer that stays in cache), group scales first and codes after.
    #[inline(always)]
    fn encode_lanes<E: Elem>(&self, c: RowChunk) -> Result<(), String> {
        let (input, n, cols, ib) = (c.input, c.n, c.cols, c.ib);
        let (cb, sb, codes, scales) = (c.cb, c.sb, c.codes, c.scales);
        let refuse = || nonfinite_rows(self.wt, self.cols, c.units.start, input);
        let mut x = vec![0f32; cols];
        if self.scheme == Scheme::Fp8Block {
            let bs = BLOCK as usize;
            let blocks = cols.div_ceil(bs);
            let (mut m, mut s) = (vec![0u32; blocks], vec![0f32; blocks]);
            for (b, r0) in (0..n).step_by(bs).enumerate() {
                let r1 = (r0 + bs).min(n);
                if lanes::block_mags::<E>(&input[r0 * ib..r1 * ib], cols, bs, &mut m) {
                    return refuse();
                }
                let row = &mut scales[b * sb..(b + 1) * sb];
                for ((&mj, sj), o) in m.iter().zip(s.iter_mut()).zip(row.chunks_exact_mut(4)) {
                    *sj = modelopt_fp8_scale(E::from_mag(mj));
                    o.copy_from_slice(&sj.to_le_bytes());
                }
                for r in r0..r1 {
                    lanes::decode::<E>(&input[r * ib..(r + 1) * ib], &mut x);
                    let out = &mut codes[r * cb..(r + 1) * cb];
                    for ((seg, o), &f) in x.chunks(bs).zip(out.chunks_mut(bs)).zip(&s) {
                        lanes::e4m3_div_f32(seg, f, o);
                    }
                }
            }
            return Ok(());
        }
        let mut eff = Vec::new();
        let mut q = [0i32; 128];
        for r in 0..n {
            if lanes::decode::<E>(&input[r * ib..(r + 1) * ib], &mut x) {
                return refuse();
            }
            let sc = &mut scales[r * sb..(r + 1) * sb];
            match self.scheme {
                Scheme::Fp8Dynamic => {
                    let s = modelopt_fp8_scale(lanes::amax(&x));
                    sc.copy_from_slice(&s.to_le_bytes());
                    lanes::e4m3_div_f32(&x, s, &mut codes[r * cb..(r + 1) * cb]);
                }
                Scheme::Nvfp4A16 => {
                    let s2 = self.scale_2;
                    eff.clear();
                    for (xs, o) in x.chunks_exact(16).zip(sc.iter_mut()) {
                        *o = modelopt_nvfp4_block_scale(lanes::amax(xs), s2);
                        eff.push(lanes::E4M3_VALUES[*o as usize] * s2);
                    }
                    let out = codes[r * cb..(r + 1) * cb].chunks_exact_mut(8);
                    for ((xs, o), &e) in x.chunks_exact(16).zip(out).zip(&eff) {
                        let (xs, o) = (xs.try_into().expect("16"), o.try_into().expect("8"));
                        lanes::e2m1_div::<E, false, 16, 8>(xs, e, o);
                    }
                }
                Scheme::Mxfp4A16 => {
                    eff.clear();
                    for (xs, o) in x.chunks_exact(32).zip(sc.iter_mut()) {
                        let e = modelopt_mx_exponent_bits(lanes::amax(xs), E2M1_MAX);
                        *o = (e + 127) as u8;
                        eff.push(pow2_f32(e));
                    }
                    let out = codes[r * cb..(r + 1) * cb].chunks_exact_mut(16);
                    for ((xs, o), &p) in x.chunks_exact(32).zip(out).zip(&eff) {
                        let (xs, o) = (xs.try_into().expect("32"), o.try_into().expect("16"));
                        lanes::mxfp4_modelopt_div::<32, 16>(xs, p, o);
                    }
                }
                Scheme::Mxfp8A16 => {
                    eff.clear();
                    for (xs, o) in x.chunks_exact(32).zip(sc.iter_mut()) {
                        let e = modelopt_mx_exponent_bits(lanes::amax(xs), E4M3_MAX);
                        *o = (e + 127) as u8;
                        eff.push(pow2_f32(-e));
                    }
                    let out = codes[r * cb..(r + 1) * cb].chunks_exact_mut(32);
                    for ((xs, o), &f) in x.chunks_exact(32).zip(out).zip(&eff) {
                        lanes::e4m3_mul(xs, f, o);
                    }
                }
                Scheme::W4A16 => {
                    // Rows 2k and 2k+1 share a packed row of `cols` bytes (chunks start on an
                    // even row).
                    let packed = &mut codes[(r / 2) * cols..(r / 2 + 1) * cols];
                    let high = r % 2 == 1;
                    let groups = x.chunks_exact(128).zip(packed.chunks_exact_mut(128));
                    for (g, (xs, o)) in groups.enumerate() {
                        let s = modelopt_int4_scale(lanes::amax(xs));
                        sc[4 * g..4 * g + 4].copy_from_slice(&s.to_le_bytes());
                        // Clamping before rounding is the same as after: the bounds are integers.
                        lanes::int_div::<F32>(xs, s, -8.0, 7.0, &mut q);
                        for (o, &v) in o.iter_mut().zip(&q) {
                            let nib = v as u8 & 0x0F;
                            *o = if high { *o | nib << 4 } else { nib };
                        }
                    }
                }
                Scheme::W8A16 | Scheme::Fp8Block => unreachable!("refused, or encoded above"),
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::ops::Range;

    fn v(xs: &[&str]) -> Vec<String> {
        xs.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn excluded_modules_are_summarised_as_modelopt_does() {
        let q = v(&[
            "model.layers.0.self_attn.q_proj",
            "model.layers.0.mlp.gate_proj",
        ]);
        assert_eq!(
            summarize_excluded(&v(&["model.embed_tokens", "lm_head"]), &q),
            v(&["lm_head", "model.embed_tokens"])
        );
        // a subtree with nothing quantised becomes one wildcard
        assert_eq!(
            summarize_excluded(
                &v(&[
                    "model.visual.blocks.0.qkv",
                    "model.visual.blocks.1.qkv",
                    "model.layers.0.mlp.gate"
                ]),
                &q
            ),
            v(&["model.layers.0.mlp.gate", "model.visual*"])
        );
    }

    #[test]
    fn default_rules_match_modelopts_patterns() {
        assert!(disabled_by_default("lm_head"));
        assert!(disabled_by_default("model.layers.3.mlp.gate"));
        assert!(!disabled_by_default("model.layers.3.mlp.gate_proj"));
        assert!(disabled_by_default("model.layers.3.block_sparse_moe.gate"));
        assert!(disabled_by_default("model.layers.3.mlp.router"));
        assert!(disabled_by_default("mtp.layers.0.proj"));
        assert!(!disabled_by_default("model.mtp.proj"));
        assert!(!disabled_by_default("model.layers.0.self_attn.o_proj"));
        assert!(wildcard("a*b*c", "aXbYc") && !wildcard("a*b*c", "aXc"));
    }

    #[test]
    fn chunks_at_the_ops_granularity_give_the_same_bytes() {
        let (rows, cols) = (8u64, 256u64);
        let x: Vec<f32> = (0..rows * cols)
            .map(|i| ((i * 7919 % 1000) as f32 - 500.0) / 300.0)
            .collect();
        let bytes: Vec<u8> = x.iter().flat_map(|v| v.to_le_bytes()).collect();
        for scheme in [
            Scheme::W4A16,
            Scheme::Nvfp4A16,
            Scheme::Mxfp4A16,
            Scheme::Mxfp8A16,
            Scheme::Fp8Dynamic,
        ] {
            let op = ModeloptRows {
                scheme,
                rows,
                cols,
                wt: WeightType::F32,
                scale_2: 0.01,
            };
            let (cb, sb) = (op.out_unit_bytes() as usize, op.row_scale_bytes() as usize);
            let run = |units: Range<u64>| {
                let n = (units.end - units.start) as usize;
                let (mut c, mut s) = (vec![0u8; n * cb], vec![0u8; n * sb]);
                let r = op.input_ranges(units.clone())[0].clone();
                let input = &bytes[r.start as usize..r.end as usize];
                op.compute_all(units, &[input], &mut [&mut c, &mut s])
                    .unwrap();
                (c, s)
            };
            let whole = run(0..rows);
            let g = op.granularity();
            let (mut c, mut s) = run(0..2 * g);
            let rest = run(2 * g..rows);
            c.extend(rest.0);
            s.extend(rest.1);
            assert_eq!((c, s), whole, "{scheme:?}");
        }
    }

    /// The lane encoder (baseline and AVX2 builds) against the scalar reference, on the
    /// selftest's weights (zeros, ties, subnormal and huge scales), every scheme and weight
    /// dtype, FP8 blocks ragged both ways.
    #[test]
    fn lane_encoders_equal_the_scalar_reference() {
        use super::super::encode::modelopt_nvfp4_scale_2;
        use crate::commands::selftest::encoders::quantize_weight;
        use crate::commands::selftest::table::Lcg;
        let mut rng = Lcg(0x5eed);
        for wt in [WeightType::BF16, WeightType::F16, WeightType::F32] {
            for (scheme, cols) in [
                (Scheme::Fp8Block, 328u64),
                (Scheme::Fp8Dynamic, 328),
                (Scheme::Nvfp4A16, 352),
                (Scheme::Mxfp4A16, 352),
                (Scheme::Mxfp8A16, 352),
                (Scheme::W4A16, 384),
            ] {
                let rows = 260;
                let input = quantize_weight(wt, rows, cols, &mut rng);
                let mut x = Vec::new();
                wt.decode(&input, &mut x);
                let op = ModeloptRows {
                    scheme,
                    rows,
                    cols,
                    wt,
                    scale_2: modelopt_nvfp4_scale_2(amax(&x)),
                };
                let what = format!("{} {wt:?}", scheme.name());
                let reference = |c: RowChunk| op.compute_reference(c);
                lanes::assert_lanes_agree(&op, rows, &input, reference, &what);
            }
        }
    }

    #[test]
    fn json_is_written_as_pythons_json_dump_with_indent_4() {
        let v = hf_quant_config(Scheme::Nvfp4A16, &v(&["lm_head"]));
        let want = "{\n    \"producer\": {\n        \"name\": \"modelopt\",\n        \"version\": \"0.47.0\"\n    },\n    \"quantization\": {\n        \"quant_algo\": \"W4A16_NVFP4\",\n        \"kv_cache_quant_algo\": null,\n        \"group_size\": 16,\n        \"exclude_modules\": [\n            \"lm_head\"\n        ]\n    }\n}";
        assert_eq!(python_json(&v), want);
        assert_eq!(python_json(&json!(["é"])), "[\n    \"\\u00e9\"\n]");
    }
}
