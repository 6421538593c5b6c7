//! The `dequant` planning step: finds every quantised weight, binds it to the decode op of its
//! scheme (the FP4 family's [`DequantFp4`], the FP8 family's block dequantisation), and drops
//! the quantisation leftovers (activation and KV-cache scales) with `quantization_config`.
//!
//! Schemes, recognised by tensor names and dtypes and checked against `config.json`'s
//! `quantization_config` (`quant_method`, the compressed-tensors `format`s):
//! - compressed-tensors `nvfp4-pack-quantized`: `X.weight_packed` `U8`, `X.weight_scale`
//!   `F8_E4M3` per 16, `X.weight_global_scale` `F32` (divides);
//! - compressed-tensors `mxfp4-pack-quantized`: `X.weight_packed` `U8`, `X.weight_scale` `U8`
//!   (E8M0) per 32;
//! - compressed-tensors `mxfp8-quantized`: `X.weight` `F8_E4M3`, `X.weight_scale` `U8` (E8M0)
//!   per 32;
//! - ModelOpt NVFP4 (`quant_method: modelopt`, `quant_algo: NVFP4` or `W4A16_NVFP4`): `X.weight` `U8`,
//!   `X.weight_scale` `F8_E4M3` per 16, `X.weight_scale_2` `F32` (multiplies);
//! - gpt-oss MXFP4 (`quant_method: mxfp4`): `X_blocks` `U8 [E, out, G, 16]`, `X_scales` `U8
//!   [E, out, G]` → `X` `[E, in, out]`;
//! - compressed-tensors `pack-quantized` (int, 1–8 bits): `X.weight_packed` `I32`,
//!   `X.weight_scale` float per group or channel, `X.weight_shape` (read at plan time), and for
//!   asymmetric schemes `X.weight_zero_point` `I32` packed down the columns;
//! - GPTQ (`quant_method: gptq`): `X.qweight`, `X.qzeros`, `X.scales`, `X.g_idx` → `X.weight`;
//! - ModelOpt MXFP4 (`quant_algo: mxfp4`): `X.weight` `U8`, `X.weight_scale` `U8` (E8M0) per 32;
//! - ModelOpt MXFP8 (`quant_algo: MXFP8`): as compressed-tensors `mxfp8-quantized`;
//! - ModelOpt INT4 (`quant_algo: W4A16_AWQ`): `X.weight` `U8 [out/2, in]` (two rows a byte),
//!   `X.weight_scale` `F32 [out, in/G]` ([`crate::ops::int::modelopt`]);
//! - BitNet b1.58 (`quant_method: bitnet`): `X.weight` `U8 [out/4, in]` (four rows a byte),
//!   `X.weight_scale` one float, the divisor ([`crate::ops::int::bitnet`]);
//! - FP8 with float scales: [`DequantFp8Step`], unchanged (`dequant-fp8`).
//!
//! A tensor whose layout the config does not name (NVFP4 codes in a checkpoint whose config
//! says `fp8`, say) is an error naming the tensor, as is a missing scale.

use std::collections::{BTreeSet, HashMap};
use std::sync::Arc;

use serde_json::{Map, Value};

use crate::error::{Error, Result, ScaleOf};
use crate::format::checkpoint::Checkpoint;
use crate::format::dtype::DType;
use crate::ops::fp4::dequant::{BlockScale, DequantFp4, GlobalScale};
use crate::ops::fp8::{mxfp8_derive, scale_candidates, DequantFp8Step, ScaleMode};
use crate::ops::int::gptq::{self, GptqConfig};
use crate::ops::int::DequantPackedInt;
use crate::plan::{DeferredDst, Derive, Entry, PlanStep, Planning};

/// Activation and KV-cache scales: meaningless once the weights are dequantised.
pub const ACTIVATION_SCALES: [&str; 6] = [
    "input_scale",
    "input_global_scale",
    "activation_scale",
    "output_scale",
    "k_scale",
    "v_scale",
];

#[derive(Debug)]
pub struct DequantStep {
    /// FP8 weights with float scales, and the options every scheme shares.
    pub fp8: DequantFp8Step,
    /// `--keep-kv-scales`: keep `k_scale`/`v_scale` and `kv_cache_scheme`.
    pub keep_kv_scales: bool,
}

/// KV-cache scales, kept by `--keep-kv-scales` (the KV cache can stay FP8 with BF16 weights).
const KV_SCALES: [&str; 2] = ["k_scale", "v_scale"];

/// What `quantization_config` says.
#[derive(Debug, Default)]
struct Declared {
    present: bool,
    method: String,
    /// compressed-tensors formats (top level and per group); ModelOpt `quant_algo`.
    formats: BTreeSet<String>,
    /// `num_bits` of the compressed-tensors groups with integer weights.
    int_bits: BTreeSet<u64>,
    /// GPTQ `bits`, `group_size` (-1: one group per row) and `checkpoint_format`.
    gptq_bits: Option<u64>,
    group_size: Option<i64>,
    checkpoint_format: Option<String>,
}

impl Declared {
    fn read(ckpt: &Checkpoint, config: Option<&Map<String, Value>>) -> Declared {
        let mut d = Declared::default();
        let take = |d: &mut Declared, q: &Value| {
            d.present = true;
            if let Some(m) = q.get("quant_method").and_then(Value::as_str) {
                d.method = m.to_ascii_lowercase();
            }
            d.gptq_bits = q.get("bits").and_then(Value::as_u64);
            d.group_size = q.get("group_size").and_then(Value::as_i64);
            d.checkpoint_format = q
                .get("checkpoint_format")
                .and_then(Value::as_str)
                .map(str::to_ascii_lowercase);
            for key in ["format", "quant_algo"] {
                if let Some(f) = q.get(key).and_then(Value::as_str) {
                    d.formats.insert(f.to_ascii_lowercase());
                }
            }
            if let Some(groups) = q.get("config_groups").and_then(Value::as_object) {
                for g in groups.values() {
                    if let Some(f) = g.get("format").and_then(Value::as_str) {
                        d.formats.insert(f.to_ascii_lowercase());
                    }
                    let w = g.get("weights");
                    if w.and_then(|w| w.get("type")).and_then(Value::as_str) == Some("int") {
                        if let Some(b) = w.and_then(|w| w.get("num_bits")).and_then(Value::as_u64) {
                            d.int_bits.insert(b);
                        }
                    }
                }
            }
        };
        if let Some(q) = config.and_then(|c| c.get("quantization_config")) {
            take(&mut d, q);
        }
        // ModelOpt's own file, read when config.json does not say.
        if d.method.is_empty() {
            let path = ckpt.dir.join("hf_quant_config.json");
            if let Ok(text) = std::fs::read_to_string(path) {
                if let Ok(v) = serde_json::from_str::<Value>(&text) {
                    if let Some(q) = v.get("quantization") {
                        take(&mut d, q);
                        d.method = "modelopt".into();
                    }
                }
            }
        }
        d
    }

    /// Whether the config allows `scheme` (no config at all: the layout alone decides).
    fn allows(&self, scheme: Scheme) -> bool {
        if !self.present {
            return true;
        }
        let ct = self.method == "compressed-tensors";
        match scheme {
            Scheme::CtNvfp4 => ct && self.formats.contains("nvfp4-pack-quantized"),
            Scheme::CtMxfp4 => ct && self.formats.contains("mxfp4-pack-quantized"),
            // ModelOpt's MXFP8 has the same tensors: E4M3 `weight`, E8M0 `weight_scale` per 32.
            Scheme::CtMxfp8 => {
                (ct && self.formats.contains("mxfp8-quantized"))
                    || (self.method == "modelopt" && self.formats.contains("mxfp8"))
            }
            Scheme::CtInt => ct && self.formats.contains("pack-quantized"),
            // `W4A16_NVFP4` (weight-only) stores the same tensors as `NVFP4`.
            Scheme::ModeloptNvfp4 => {
                self.method == "modelopt"
                    && (self.formats.contains("nvfp4") || self.formats.contains("w4a16_nvfp4"))
            }
            Scheme::ModeloptMxfp4 => {
                self.method == "modelopt"
                    && (self.formats.contains("mxfp4") || self.formats.contains("w4a8_mxfp4_fp8"))
            }
            Scheme::ModeloptInt4 => self.method == "modelopt" && self.formats.contains("w4a16_awq"),
            Scheme::GptOssMxfp4 => self.method == "mxfp4",
            Scheme::Gptq => self.method == "gptq",
            Scheme::Bitnet => self.method == "bitnet",
        }
    }

    /// Whether the config allows FP8 weights with float scales (block, channel or tensor):
    /// no config, an FP8 method, or one whose formats are not all of other schemes. Unknown
    /// methods are given the benefit of the doubt; the others named here store no FP8 weights.
    fn allows_fp8(&self) -> bool {
        const NOT_FP8_METHODS: [&str; 12] = [
            "gptq",
            "awq",
            "mxfp4",
            "bitsandbytes",
            "hqq",
            "aqlm",
            "eetq",
            "exl2",
            "higgs",
            "vptq",
            "spqr",
            "bitnet",
        ];
        const NOT_FP8_CT_FORMATS: [&str; 6] = [
            "nvfp4-pack-quantized",
            "mxfp4-pack-quantized",
            "mxfp8-quantized",
            "pack-quantized",
            "int-quantized",
            "marlin-24",
        ];
        if !self.present {
            return true;
        }
        match self.method.as_str() {
            "compressed-tensors" => {
                self.formats.is_empty()
                    || self
                        .formats
                        .iter()
                        .any(|f| !NOT_FP8_CT_FORMATS.contains(&f.as_str()))
            }
            "modelopt" => {
                self.formats.is_empty()
                    || self
                        .formats
                        .iter()
                        .any(|f| f.starts_with("fp8") || f == "mixed_precision")
            }
            m => !NOT_FP8_METHODS.contains(&m),
        }
    }

    /// Whether the config names a ModelOpt FP4 algorithm, whose `X.weight` U8 are codes.
    fn fp4_codes_named(&self) -> bool {
        self.method == "modelopt"
            && self
                .formats
                .iter()
                .any(|f| f.contains("nvfp4") || f.contains("mxfp4"))
    }

    fn describe(&self) -> String {
        if !self.present {
            return "no quantization_config".into();
        }
        let formats: Vec<&str> = self.formats.iter().map(String::as_str).collect();
        format!(
            "quantization_config says quant_method `{}`{}",
            self.method,
            if formats.is_empty() {
                String::new()
            } else {
                format!(" with {}", formats.join(", "))
            }
        )
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Scheme {
    CtNvfp4,
    CtMxfp4,
    CtMxfp8,
    ModeloptNvfp4,
    ModeloptMxfp4,
    ModeloptInt4,
    GptOssMxfp4,
    CtInt,
    Gptq,
    Bitnet,
}

impl Scheme {
    fn name(self) -> &'static str {
        match self {
            Scheme::CtNvfp4 => "compressed-tensors NVFP4 (nvfp4-pack-quantized)",
            Scheme::CtMxfp4 => "compressed-tensors MXFP4 (mxfp4-pack-quantized)",
            Scheme::CtMxfp8 => "compressed-tensors MXFP8 (mxfp8-quantized)",
            Scheme::ModeloptNvfp4 => "ModelOpt NVFP4",
            Scheme::ModeloptMxfp4 => "ModelOpt MXFP4",
            Scheme::ModeloptInt4 => "ModelOpt INT4 (W4A16_AWQ)",
            Scheme::GptOssMxfp4 => "gpt-oss MXFP4",
            Scheme::CtInt => "compressed-tensors int (pack-quantized)",
            Scheme::Gptq => "GPTQ",
            Scheme::Bitnet => "BitNet ternary (bitnet)",
        }
    }
}

/// A weight bound to its scheme: the tensors it reads and what it becomes.
struct Found {
    scheme: Scheme,
    /// Entry indices: codes, block scales, optional tensor scale.
    codes: usize,
    scales: usize,
    global: Option<usize>,
    name: String,
}

/// The `[out, in]` a `weight_shape` tensor (`I64`/`I32 [2]`) holds, read at plan time.
fn read_shape(ckpt: &Checkpoint, e: &Entry) -> std::result::Result<(u64, u64), String> {
    let t = &ckpt.tensors[e.source];
    let size = match (t.info.dtype, &t.info.shape[..]) {
        (DType::I64, [2]) => 8,
        (DType::I32, [2]) => 4,
        (d, shape) => {
            return Err(format!(
                "a weight shape must be I64 or I32 [2], not {d} {shape:?}"
            ))
        }
    };
    let mut buf = vec![0u8; 2 * size];
    ckpt.read_tensor_at(t, 0, &mut buf)
        .map_err(|err| err.to_string())?;
    let v: Vec<i64> = buf
        .chunks_exact(size)
        .map(|c| {
            if size == 8 {
                i64::from_le_bytes(c.try_into().unwrap())
            } else {
                i32::from_le_bytes(c.try_into().unwrap()) as i64
            }
        })
        .collect();
    match v[..] {
        [r, c] if r > 0 && c > 0 => Ok((r as u64, c as u64)),
        _ => Err(format!("holds {v:?}, not a weight shape")),
    }
}

/// A weight's decoding and its decoded shape.
type Decoding = (Arc<dyn Derive>, Vec<u64>);

/// A BitNet weight's decoding: its `[out/4, in]` codes and its one scale, read here (a scale
/// that is not one finite, non-zero float is refused before any output exists).
fn bitnet_derive<'a>(
    ckpt: &Checkpoint,
    w: &'a Entry,
    s: &'a Entry,
) -> std::result::Result<Decoding, (&'a Entry, String)> {
    let [packed_rows, cols] = w.shape[..] else {
        return Err((
            w,
            format!("BitNet codes must be U8 [out/4, in], not {:?}", w.shape),
        ));
    };
    let n: u64 = s.shape.iter().product();
    let size = match s.dtype {
        DType::F32 => 4,
        DType::BF16 | DType::F16 => 2,
        d => return Err((s, format!("a BitNet weight scale must be a float, not {d}"))),
    };
    if n != 1 {
        return Err((
            s,
            format!("a BitNet weight scale must be one value, not {:?}", s.shape),
        ));
    }
    let t = &ckpt.tensors[s.source];
    let mut buf = vec![0u8; size];
    ckpt.read_tensor_at(t, 0, &mut buf)
        .map_err(|err| (s, err.to_string()))?;
    let scale = crate::ops::cast::to_f32(s.dtype, &buf)[0];
    if !scale.is_finite() || scale == 0.0 {
        return Err((
            s,
            format!("the scale of `{}` is {scale}: it divides the codes, so it must be finite and not zero", w.name),
        ));
    }
    let d = DeferredDst {
        inputs: vec![w.source; crate::ops::int::bitnet::ROWS_PER_BYTE as usize],
        op: crate::ops::int::bitnet::DequantBitnet {
            packed_rows,
            cols,
            scale,
            // set by `build`
            dst: DType::F32,
        },
    };
    let rows = packed_rows * crate::ops::int::bitnet::ROWS_PER_BYTE;
    Ok((Arc::new(d), vec![rows, cols]))
}

fn is_activation_scale(name: &str) -> bool {
    name.rsplit_once('.')
        .is_some_and(|(_, last)| ACTIVATION_SCALES.contains(&last))
}

fn is_kv_scale(name: &str) -> bool {
    name.rsplit_once('.')
        .is_some_and(|(_, last)| KV_SCALES.contains(&last))
}

impl PlanStep for DequantStep {
    fn apply(&self, p: Planning) -> Result<bool> {
        let (ckpt, config, entries, notes) = (p.ckpt, p.config, p.entries, p.notes);
        let declared = Declared::read(ckpt, config);
        let index: HashMap<String, usize> = entries
            .iter()
            .enumerate()
            .filter(|(_, e)| e.derive.is_none())
            .map(|(i, e)| (e.name.clone(), i))
            .collect();
        let get = |name: &str| index.get(name).copied();
        let missing =
            |e: &Entry, looked: &[String]| e.missing_scale(ckpt, ScaleOf::QuantWeight, looked);
        let mut found: Vec<Found> = Vec::new();
        for (i, e) in entries.iter().enumerate() {
            if e.derive.is_some() {
                continue;
            }
            let n = e.name.as_str();
            let scheme_and_parts = if let (Some(base), DType::U8) =
                (n.strip_suffix(".weight_packed"), e.dtype)
            {
                let scale_name = format!("{base}.weight_scale");
                let Some(si) = get(&scale_name) else {
                    return Err(missing(e, &[scale_name]));
                };
                match entries[si].dtype {
                    DType::F8_E4M3 => {
                        let g_name = format!("{base}.weight_global_scale");
                        let Some(gi) = get(&g_name) else {
                            return Err(missing(e, &[g_name]));
                        };
                        Some((Scheme::CtNvfp4, si, Some(gi), format!("{base}.weight")))
                    }
                    DType::U8 | DType::F8_E8M0 => {
                        Some((Scheme::CtMxfp4, si, None, format!("{base}.weight")))
                    }
                    d => {
                        return Err(entries[si].bad_scale(
                            ckpt,
                            &e.name,
                            format!(
                                "{d} block scales of packed U8 codes are neither NVFP4 (F8_E4M3) nor MXFP4 (U8 exponents)"
                            ),
                        ))
                    }
                }
            } else if let (Some(base), DType::I32) = (n.strip_suffix(".weight_packed"), e.dtype) {
                let scale_name = format!("{base}.weight_scale");
                let shape_name = format!("{base}.weight_shape");
                let (Some(si), Some(hi)) = (get(&scale_name), get(&shape_name)) else {
                    return Err(missing(e, &[scale_name, shape_name]));
                };
                Some((Scheme::CtInt, si, Some(hi), format!("{base}.weight")))
            } else if let (Some(base), DType::I32) = (n.strip_suffix(".qweight"), e.dtype) {
                let (zeros, scales) = (format!("{base}.qzeros"), format!("{base}.scales"));
                let (Some(zi), Some(si)) = (get(&zeros), get(&scales)) else {
                    return Err(missing(e, &[zeros, scales]));
                };
                Some((Scheme::Gptq, si, Some(zi), format!("{base}.weight")))
            } else if let (Some(base), DType::U8) = (n.strip_suffix("_blocks"), e.dtype) {
                let scale_name = format!("{base}_scales");
                let Some(si) = get(&scale_name) else {
                    return Err(missing(e, &[scale_name]));
                };
                Some((Scheme::GptOssMxfp4, si, None, base.to_string()))
            } else if let (Some(_), DType::U8) = (n.strip_suffix(".weight"), e.dtype) {
                let s2 = format!("{n}_scale_2");
                match (get(&format!("{n}_scale")), get(&s2)) {
                    // BitNet's packed ternary codes and their one divisor.
                    (Some(si), None) if declared.method == "bitnet" => {
                        Some((Scheme::Bitnet, si, None, n.to_string()))
                    }
                    (None, _) if declared.method == "bitnet" => {
                        return Err(missing(e, &[format!("{n}_scale")]));
                    }
                    (Some(si), Some(gi)) if entries[si].dtype == DType::F8_E4M3 => {
                        Some((Scheme::ModeloptNvfp4, si, Some(gi), n.to_string()))
                    }
                    (Some(si), None) if entries[si].dtype == DType::F8_E4M3 => {
                        return Err(missing(e, &[s2]));
                    }
                    (Some(si), None) if matches!(entries[si].dtype, DType::U8 | DType::F8_E8M0) => {
                        Some((Scheme::ModeloptMxfp4, si, None, n.to_string()))
                    }
                    // INT4 codes of two rows a byte, F32 scales per group.
                    (Some(si), None)
                        if entries[si].dtype == DType::F32
                            && declared.allows(Scheme::ModeloptInt4)
                            && declared.present =>
                    {
                        Some((Scheme::ModeloptInt4, si, None, n.to_string()))
                    }
                    // U8 codes of a ModelOpt FP4 checkpoint without their block scales.
                    (None, _) if declared.fp4_codes_named() => {
                        return Err(missing(e, &[format!("{n}_scale")]));
                    }
                    _ => None,
                }
            } else if matches!(e.dtype, DType::F8_E4M3 | DType::F8_E5M2) {
                let scale = format!("{n}_scale");
                let found = get(&scale)
                    .filter(|&si| entries[si].dtype == DType::U8)
                    .map(|si| (Scheme::CtMxfp8, si, None, n.to_string()));
                // MXFP8 codes need their exponents: not the FP8 path's unscaled-cast advice.
                let unscaled = scale_candidates(n, ScaleMode::Multiply)
                    .iter()
                    .all(|(c, _)| get(c).is_none());
                if found.is_none() && unscaled && declared.formats.contains("mxfp8-quantized") {
                    return Err(missing(e, &[scale]));
                }
                found
            } else {
                None
            };
            let Some((scheme, scales, global, name)) = scheme_and_parts else {
                continue;
            };
            if !declared.allows(scheme) {
                return Err(Error::TensorData {
                    path: e.path(ckpt),
                    tensor: e.name.clone(),
                    msg: format!(
                        "laid out as {} but config.json's {}: cannot tell how to decode it; fix quantization_config",
                        scheme.name(),
                        declared.describe()
                    ),
                });
            }
            found.push(Found {
                scheme,
                codes: i,
                scales,
                global,
                name,
            });
        }

        let allow_nonfinite = self.fp8.opts.allow_nonfinite;
        let mut consumed = vec![false; entries.len()];
        // (codes entry, output name, output shape, recipe)
        type Bound = (usize, String, Vec<u64>, Arc<dyn Derive>);
        let mut bound: Vec<Bound> = Vec::new();
        let mut counts: std::collections::BTreeMap<&'static str, usize> = Default::default();
        for f in &found {
            let w = &entries[f.codes];
            let s = &entries[f.scales];
            let bad = |msg: String| s.bad_scale(ckpt, &w.name, msg);
            if let (Some(gi), false) = (f.global, matches!(f.scheme, Scheme::CtInt | Scheme::Gptq))
            {
                let g = &entries[gi];
                let n: u64 = g.shape.iter().product();
                if g.dtype != DType::F32 || n != 1 {
                    return Err(g.bad_scale(
                        ckpt,
                        &w.name,
                        format!(
                            "a tensor scale must be one F32 value, not {} {:?}",
                            g.dtype, g.shape
                        ),
                    ));
                }
            }
            let (derive, shape): (Arc<dyn Derive>, Vec<u64>) = match f.scheme {
                Scheme::CtMxfp8 => {
                    let d = mxfp8_derive(w, ckpt, s, 32, allow_nonfinite).map_err(bad)?;
                    (d, w.shape.clone())
                }
                Scheme::CtInt => {
                    let h = &entries[f.global.expect("int weights have a weight_shape")];
                    let bad_w = |msg: String| Error::TensorData {
                        path: w.path(ckpt),
                        tensor: w.name.clone(),
                        msg,
                    };
                    let (rows, cols) = read_shape(ckpt, h).map_err(|m| Error::TensorData {
                        path: h.path(ckpt),
                        tensor: h.name.clone(),
                        msg: m,
                    })?;
                    let [wr, words] = w.shape[..] else {
                        return Err(bad_w(format!(
                            "packed int codes must be [out, words], not {:?}",
                            w.shape
                        )));
                    };
                    if wr != rows {
                        return Err(bad_w(format!(
                            "{wr} rows, but `{}` says [{rows}, {cols}]",
                            h.name
                        )));
                    }
                    let fits: Vec<u64> = (1..=8u64)
                        .filter(|b| (cols * b).div_ceil(32) == words)
                        .filter(|b| declared.int_bits.is_empty() || declared.int_bits.contains(b))
                        .collect();
                    let [bits] = fits[..] else {
                        return Err(bad_w(format!(
                            "cannot tell the bit width: {words} words per row of {cols} elements fit {fits:?} bits (config.json's int num_bits: {:?})",
                            declared.int_bits
                        )));
                    };
                    if !matches!(s.dtype, DType::F32 | DType::BF16 | DType::F16) {
                        return Err(bad(format!(
                            "dtype {} is not a scale dtype (F32, BF16, F16)",
                            s.dtype
                        )));
                    }
                    let groups = match s.shape[..] {
                        [r, g] if r == rows && g > 0 && cols % g == 0 => g,
                        _ => {
                            return Err(bad(format!(
                                "shape {:?} does not fit weight [{rows}, {cols}] (expected [{rows}, G] with G dividing {cols})",
                                s.shape
                            )))
                        }
                    };
                    let mut inputs = vec![w.source, s.source];
                    let zp_name = format!("{}_zero_point", f.name);
                    let zero_point = get(&zp_name);
                    if let Some(zi) = zero_point {
                        let z = &entries[zi];
                        let want = [(rows * bits).div_ceil(32), groups];
                        if z.dtype != DType::I32 || z.shape != want {
                            return Err(z.bad_scale(
                                ckpt,
                                &w.name,
                                format!(
                                    "packed zero points of {bits}-bit weights [{rows}, {cols}] in {groups} groups must be I32 {want:?}, not {} {:?}",
                                    z.dtype, z.shape
                                ),
                            ));
                        }
                        inputs.push(z.source);
                        consumed[zi] = true;
                    }
                    let d = DeferredDst {
                        inputs,
                        op: DequantPackedInt {
                            rows,
                            cols,
                            bits: bits as u32,
                            words,
                            group: cols / groups,
                            scale_dtype: s.dtype,
                            zero_point: zero_point.is_some(),
                            // set by `build`
                            dst: DType::F32,
                        },
                    };
                    (Arc::new(d), vec![rows, cols])
                }
                Scheme::Gptq => {
                    let z = &entries[f.global.expect("GPTQ weights have qzeros")];
                    let gidx = get(&format!("{}g_idx", f.name.trim_end_matches("weight")));
                    let (d, shape) = gptq::bind(
                        GptqConfig {
                            bits: declared.gptq_bits,
                            group_size: declared.group_size,
                            checkpoint_format: declared.checkpoint_format.as_deref(),
                        },
                        w,
                        s,
                        z,
                        gidx.map(|i| &entries[i]),
                    )
                    .map_err(|(t, msg)| Error::TensorData {
                        path: t.path(ckpt),
                        tensor: t.name.clone(),
                        msg,
                    })?;
                    if let Some(i) = gidx {
                        consumed[i] = true;
                    }
                    (d, shape)
                }
                Scheme::ModeloptInt4 => {
                    let [half, cols] = w.shape[..] else {
                        return Err(Error::TensorData {
                            path: w.path(ckpt),
                            tensor: w.name.clone(),
                            msg: format!(
                                "ModelOpt INT4 codes must be [out/2, in], not {:?}",
                                w.shape
                            ),
                        });
                    };
                    let rows = 2 * half;
                    let group = match s.shape[..] {
                        [r, g] if r == rows && g > 0 && cols % g == 0 => cols / g,
                        _ => {
                            return Err(bad(format!(
                                "shape {:?} does not fit codes {:?} (expected [{rows}, G] with G dividing {cols})",
                                s.shape, w.shape
                            )))
                        }
                    };
                    let d = DeferredDst {
                        inputs: vec![w.source, s.source],
                        op: crate::ops::int::modelopt::DequantModeloptInt4 {
                            rows,
                            cols,
                            group,
                            // set by `build`
                            dst: DType::F32,
                        },
                    };
                    (Arc::new(d), vec![rows, cols])
                }
                Scheme::GptOssMxfp4 => {
                    let [e, out, g, 16] = w.shape[..] else {
                        return Err(Error::TensorData {
                            path: w.path(ckpt),
                            tensor: w.name.clone(),
                            msg: format!(
                                "gpt-oss MXFP4 blocks are [experts, out, groups, 16], not {:?}",
                                w.shape
                            ),
                        });
                    };
                    if s.shape != [e, out, g] {
                        return Err(bad(format!(
                            "shape {:?} does not fit blocks {:?} (expected [{e}, {out}, {g}])",
                            s.shape, w.shape
                        )));
                    }
                    let d = DeferredDst {
                        inputs: vec![w.source, s.source],
                        op: DequantFp4 {
                            experts: e,
                            rows: out,
                            cols: g * 32,
                            group: 32,
                            scale: BlockScale::E8M0,
                            global: GlobalScale::None,
                            transpose: true,
                            negative_zero: true,
                            allow_nonfinite,
                            // set by `build`
                            dst: DType::F32,
                        },
                    };
                    (Arc::new(d), vec![e, g * 32, out])
                }
                Scheme::Bitnet => {
                    bitnet_derive(ckpt, w, s).map_err(|(t, msg)| Error::TensorData {
                        path: t.path(ckpt),
                        tensor: t.name.clone(),
                        msg,
                    })?
                }
                Scheme::CtNvfp4
                | Scheme::CtMxfp4
                | Scheme::ModeloptNvfp4
                | Scheme::ModeloptMxfp4 => {
                    let [rows, half] = w.shape[..] else {
                        return Err(Error::TensorData {
                            path: w.path(ckpt),
                            tensor: w.name.clone(),
                            msg: format!("packed FP4 codes must be [out, in/2], not {:?}", w.shape),
                        });
                    };
                    let cols = half * 2;
                    let (group, scale) =
                        if matches!(f.scheme, Scheme::CtMxfp4 | Scheme::ModeloptMxfp4) {
                            (32, BlockScale::E8M0)
                        } else {
                            (16, BlockScale::E4M3)
                        };
                    if s.shape != [rows, cols.div_ceil(group)] {
                        return Err(bad(format!(
                            "shape {:?} does not fit codes {:?}: {} expects one scale per {group} elements, [{rows}, {}]",
                            s.shape,
                            w.shape,
                            f.scheme.name(),
                            cols.div_ceil(group)
                        )));
                    }
                    let mut inputs = vec![w.source, s.source];
                    inputs.extend(f.global.map(|g| entries[g].source));
                    let d = DeferredDst {
                        inputs,
                        op: DequantFp4 {
                            experts: 1,
                            rows,
                            cols,
                            group,
                            scale,
                            global: match f.scheme {
                                Scheme::CtNvfp4 => GlobalScale::Divide,
                                Scheme::ModeloptNvfp4 => GlobalScale::Multiply,
                                _ => GlobalScale::None,
                            },
                            transpose: false,
                            negative_zero: f.scheme != Scheme::ModeloptNvfp4,
                            allow_nonfinite,
                            // set by `build`
                            dst: DType::F32,
                        },
                    };
                    (Arc::new(d), vec![rows, cols])
                }
            };
            consumed[f.scales] = true;
            if let Some(g) = f.global {
                consumed[g] = true;
            }
            *counts.entry(f.scheme.name()).or_default() += 1;
            bound.push((f.codes, f.name.clone(), shape, derive));
        }
        let ours = !bound.is_empty();
        for (i, name, shape, derive) in bound {
            let e = &mut entries[i];
            e.name = name;
            e.shape = shape;
            e.dtype = self.fp8.opts.dtype;
            e.derive = Some(derive);
        }
        for (scheme, n) in counts {
            notes.lines.push(format!("{scheme}: {n} weights decoded"));
        }
        let mut i = 0;
        entries.retain(|_| {
            i += 1;
            !consumed[i - 1]
        });
        // What is left in FP8 would be decoded by the FP8 path: the config must allow it.
        let fp8_left = entries
            .iter()
            .find(|e| e.derive.is_none() && matches!(e.dtype, DType::F8_E4M3 | DType::F8_E5M2));
        if let (Some(e), false) = (fp8_left, declared.allows_fp8()) {
            return Err(Error::TensorData {
                path: e.path(ckpt),
                tensor: e.name.clone(),
                msg: format!(
                    "an FP8 ({}) weight, but config.json's {}: cannot tell how to decode it; fix quantization_config",
                    e.dtype,
                    declared.describe()
                ),
            });
        }
        let fp8 = self.fp8.apply(Planning {
            ckpt,
            config,
            entries,
            notes,
        })?;
        let changed = ours || fp8;
        if changed {
            let mut dropped = Vec::new();
            let keep_kv = self.keep_kv_scales;
            let mut kept = 0;
            entries.retain(|e| {
                let scale = e.derive.is_none() && is_activation_scale(&e.name);
                let keep = keep_kv && is_kv_scale(&e.name);
                if scale && keep {
                    kept += 1;
                } else if scale {
                    dropped.push(e.name.clone());
                }
                !scale || keep
            });
            if kept > 0 {
                notes
                    .lines
                    .push(format!("kept {kept} KV-cache scales (--keep-kv-scales)"));
            }
            if !dropped.is_empty() {
                notes.lines.push(format!(
                    "dropped {} activation/KV-cache scales with the quantization config: {}",
                    dropped.len(),
                    dropped.join(", ")
                ));
            }
        }
        Ok(changed)
    }

    fn nothing_done(&self) -> String {
        "dequant found no quantised weight (no FP8, NVFP4, MXFP4, MXFP8, pack-quantized int, GPTQ or BitNet weight), so there is nothing to dequantise".into()
    }

    fn edit_config(&self, cfg: &mut Map<String, Value>) -> Vec<String> {
        let kv = self
            .keep_kv_scales
            .then(|| cfg.get("quantization_config"))
            .flatten()
            .and_then(|q| {
                Some((
                    q.get("quant_method")?.clone(),
                    q.get("kv_cache_scheme")?.clone(),
                ))
            })
            .filter(|(_, scheme)| !scheme.is_null());
        let mut changes = self.fp8.edit_config(cfg);
        if let Some((method, scheme)) = kv {
            let mut q = Map::new();
            q.insert("quant_method".into(), method);
            q.insert("kv_cache_scheme".into(), scheme);
            cfg.insert("quantization_config".into(), Value::Object(q));
            changes.push(
                "config.json: quantization_config keeps only quant_method and kv_cache_scheme (--keep-kv-scales)".into(),
            );
        }
        changes
    }

    fn dropped_side_files(&self) -> &'static [&'static str] {
        &["hf_quant_config.json"]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn activation_scales_are_recognised_by_their_last_component() {
        assert!(is_activation_scale(
            "model.layers.0.mlp.down_proj.input_scale"
        ));
        assert!(is_activation_scale("a.k_scale"));
        assert!(!is_activation_scale("a.weight_scale"));
        assert!(!is_activation_scale("k_scale"));
    }
}
