//! Merging an adapter into a quantised base and quantising the merged weights again, in one
//! streaming pass (`merge-lora --requant`): each targeted weight is dequantised, merged and
//! rounded to the base's float dtype (`torch_dtype`, normally bf16) exactly as `dequant
//! --merge-lora --dtype W` computes it, then quantised with `quantize`'s own encoder for the
//! base's scheme and layout. Weights no adapter pair targets keep their codes and scales byte
//! for byte, and `quantization_config` stays the base's.
//!
//! Supported bases (read from `config.json`'s `quantization_config`):
//! - transformers FineGrainedFP8 / DeepSeek-V3 (`quant_method: fp8`, `weight_block_size:
//!   [128, 128]`): `weight` F8_E4M3, `weight_scale_inv` F32 per block;
//! - compressed-tensors FP8_BLOCK (`float-quantized`, block strategy 128×128): `weight`
//!   F8_E4M3, `weight_scale` W per block;
//! - compressed-tensors NVFP4A16 (`nvfp4-pack-quantized`).
//!
//! NVFP4's tensor scale (`weight_global_scale`) is the base's, kept as it is rather than
//! recomputed from the merged weight: llm-compressor makes it equal across fused projections
//! (q/k/v, gate/up) for vLLM, so recomputing it from a merged `q_proj` would force its
//! untouched `k_proj` to be requantised too (and need a plan-time pass computing every
//! targeted merge before writing). A LoRA delta seldom raises a weight's amax past the group's;
//! where a 16-block's scale would exceed E4M3's 448 under the kept tensor scale it saturates,
//! and the report counts those blocks (`saturated_blocks`).

use std::collections::{HashMap, HashSet};
use std::ops::Range;
use std::sync::{Arc, Mutex};

use serde_json::{Map, Value};

use super::encode::{amax, WeightType, E2M1_MAX, E4M3_MAX};
use super::ops::{BlockMath, QuantizeRows, FP8_BLOCK};
use super::Scheme;
use crate::error::{Error, Result};
use crate::format::checkpoint::Checkpoint;
use crate::format::dtype::DType;
use crate::ops::dequant::DequantStep;
use crate::ops::fp4::engram::e2m1_to_f32;
use crate::ops::fp8::codec::e4m3_to_f32;
use crate::ops::fp8::{DequantFp8Step, DequantOptions, ScaleMode};
use crate::ops::kernel::{Kernel, KernelStats};
use crate::ops::Op;
use crate::plan::Outs;
use crate::plan::{outputs_of, units_of};
use crate::plan::{Derive, Entry, ExtraOutput, PlanNotes, PlanStep, Planning};

/// A base layout that can be requantised.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BaseScheme {
    /// compressed-tensors FP8_BLOCK.
    Fp8BlockCt,
    /// transformers FineGrainedFP8 (`weight_scale_inv`).
    Fp8Native,
    /// compressed-tensors NVFP4A16.
    Nvfp4Ct,
}

impl BaseScheme {
    fn name(self) -> &'static str {
        match self {
            BaseScheme::Fp8BlockCt => "compressed-tensors FP8_BLOCK",
            BaseScheme::Fp8Native => "fp8 (FineGrainedFP8, weight_scale_inv)",
            BaseScheme::Nvfp4Ct => "compressed-tensors NVFP4A16",
        }
    }

    fn scheme(self) -> Scheme {
        match self {
            BaseScheme::Nvfp4Ct => Scheme::Nvfp4A16,
            _ => Scheme::Fp8Block,
        }
    }

    fn math(self) -> BlockMath {
        match self {
            BaseScheme::Fp8Native => BlockMath::Transformers,
            _ => BlockMath::CompressedTensors,
        }
    }
}

/// What `quantization_config` says about requantising: `Ok(None)` for a base that is not
/// quantised, `Err(description)` for a scheme requantisation does not support.
pub fn detect(
    config: Option<&Map<String, Value>>,
) -> std::result::Result<Option<BaseScheme>, String> {
    let Some(q) = config.and_then(|c| c.get("quantization_config")) else {
        return Ok(None);
    };
    let method = q
        .get("quant_method")
        .and_then(Value::as_str)
        .unwrap_or("(no quant_method)")
        .to_ascii_lowercase();
    match method.as_str() {
        "fp8" => match q.get("weight_block_size") {
            Some(b) if *b == serde_json::json!([128, 128]) => Ok(Some(BaseScheme::Fp8Native)),
            Some(b) => Err(format!(
                "fp8 with weight_block_size {b} (only [128, 128] is requantised)"
            )),
            None => Err("fp8 without weight_block_size (per-tensor FP8)".into()),
        },
        "compressed-tensors" => {
            let groups: Vec<&Value> = q
                .get("config_groups")
                .and_then(Value::as_object)
                .map(|g| g.values().collect())
                .unwrap_or_default();
            let mut formats: Vec<String> = groups
                .iter()
                .filter_map(|g| g.get("format").and_then(Value::as_str))
                .chain(q.get("format").and_then(Value::as_str))
                .map(str::to_string)
                .collect();
            formats.sort();
            formats.dedup();
            let weights = |g: &&Value| g.get("weights").cloned().unwrap_or(Value::Null);
            let fp8_block = |w: &Value| {
                w.get("strategy").and_then(Value::as_str) == Some("block")
                    && w.get("block_structure") == Some(&serde_json::json!([128, 128]))
                    && w.get("num_bits").and_then(Value::as_u64) == Some(8)
                    && w.get("type").and_then(Value::as_str) == Some("float")
            };
            match &formats[..] {
                [f] if f == "float-quantized" && !groups.is_empty() && groups.iter().all(|g| fp8_block(&weights(g))) => {
                    Ok(Some(BaseScheme::Fp8BlockCt))
                }
                [f] if f == "nvfp4-pack-quantized" => Ok(Some(BaseScheme::Nvfp4Ct)),
                [f] if f == "float-quantized" => {
                    Err("compressed-tensors float-quantized with per-tensor or per-channel scales (FP8_DYNAMIC or similar)".into())
                }
                _ => Err(format!("compressed-tensors {}", formats.join(" + "))),
            }
        }
        other => Err(format!("quant_method `{other}`")),
    }
}

/// Whether requantisation was asked for or is the default.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RequantMode {
    /// `--requant`: a base it cannot requantise is an error.
    On,
    /// No flag: requantise FP8-block and NVFP4 bases, merge as before otherwise.
    Auto,
}

/// A merge step (`LoraMergeStep`) wrapped so that a quantised base is dequantised before it
/// and quantised again after it.
#[derive(Debug)]
pub struct RequantMergeStep {
    pub merge: Arc<dyn PlanStep>,
    pub mode: RequantMode,
}

/// The float dtype a quantised checkpoint was made from, which its merged weights are rounded
/// to before quantising (`torch_dtype`, or transformers 5's `dtype`; bf16 when absent).
fn base_float_dtype(config: Option<&Map<String, Value>>) -> Result<WeightType> {
    let name = config.and_then(|c| {
        c.get("torch_dtype")
            .or_else(|| c.get("dtype"))
            .and_then(Value::as_str)
    });
    match name {
        None | Some("bfloat16") => Ok(WeightType::BF16),
        Some("float16") => Ok(WeightType::F16),
        Some("float32") => Ok(WeightType::F32),
        Some(other) => Err(Error::Other(format!(
            "config.json's torch_dtype `{other}` is not bfloat16, float16 or float32: cannot tell which dtype to requantise the merged weights from"
        ))),
    }
}

impl PlanStep for RequantMergeStep {
    fn attach(&self, ckpt: &mut Checkpoint) -> Result<()> {
        self.merge.attach(ckpt)
    }

    fn apply(&self, p: Planning) -> Result<bool> {
        let base = match (detect(p.config), self.mode) {
            (Ok(Some(b)), _) => b,
            (Ok(None), RequantMode::On) => {
                return Err(Error::Other(format!(
                    "{}: --requant needs a quantised base, and config.json has no quantization_config (drop --requant)",
                    crate::escape::path(&p.ckpt.input)
                )))
            }
            (Err(scheme), RequantMode::On) => {
                return Err(Error::Other(format!(
                    "{}: --requant supports FP8 128x128 blocks (compressed-tensors FP8_BLOCK, transformers fp8) and compressed-tensors NVFP4A16, not {scheme}; dequantise the base first (tftf dequant --merge-lora)",
                    crate::escape::path(&p.ckpt.input)
                )))
            }
            (_, RequantMode::Auto) => return self.merge.apply(p),
        };
        let wt = base_float_dtype(p.config)?;
        plan_requant(self, base, wt, p)
    }

    fn edit_config(&self, _cfg: &mut Map<String, Value>) -> Vec<String> {
        // The output keeps the base's scheme, so its quantization_config stays as it is.
        Vec::new()
    }

    fn nothing_done(&self) -> String {
        self.merge.nothing_done()
    }
}

fn plan_requant(
    step: &RequantMergeStep,
    base: BaseScheme,
    wt: WeightType,
    p: Planning,
) -> Result<bool> {
    let (ckpt, config, entries, notes) = (p.ckpt, p.config, p.entries, p.notes);
    let orig = entries.clone();
    let mut work = entries.clone();
    // The two-step route, `dequant --merge-lora --dtype W`, planned on a copy: its notes
    // (scales dropped, quantization_config removed) do not describe this output.
    let dequant = DequantStep {
        fp8: DequantFp8Step {
            opts: DequantOptions {
                dtype: wt.dtype(),
                block: None,
                weight_scale_mode: ScaleMode::Multiply,
                allow_unscaled: false,
                allow_nonfinite: false,
            },
        },
        // Only the decode ops of the weights matter here; the copy's scales are thrown away.
        keep_kv_scales: false,
    };
    dequant.apply(Planning {
        ckpt,
        config,
        entries: &mut work,
        notes: &mut PlanNotes::default(),
    })?;
    let before: HashMap<usize, &Entry> = orig.iter().map(|e| (e.id, e)).collect();
    // Weights the dequant step bound to a decode op, by id.
    let decoded: HashMap<usize, Arc<dyn Derive>> = work
        .iter()
        .filter(|e| before.get(&e.id).is_some_and(|o| o.derive.is_none()))
        .filter_map(|e| e.derive.clone().map(|d| (e.id, d)))
        .collect();
    let changed = step.merge.apply(Planning {
        ckpt,
        config,
        entries: &mut work,
        notes,
    })?;
    let by_name: HashMap<&str, &Entry> = orig.iter().map(|e| (e.name.as_str(), e)).collect();
    let math = base.math();
    let scheme = base.scheme();
    let mut replaced: HashMap<usize, Entry> = HashMap::new();
    let mut untouched: HashSet<usize> = HashSet::new();
    let mut requantised = Vec::new();
    for e in &work {
        let Some(dq) = decoded.get(&e.id) else {
            continue;
        };
        let o = before[&e.id];
        let bad = |msg: String| Error::TensorData {
            path: o.path(ckpt),
            tensor: o.name.clone(),
            msg,
        };
        match &e.derive {
            Some(d) if Arc::ptr_eq(d, dq) => {
                untouched.insert(e.id);
                continue;
            }
            None => {
                return Err(bad(
                    "is replaced by the adapter's full tensor (modules_to_save): requantising a replacement is not supported; dequantise the base first (tftf dequant --merge-lora)".into(),
                ))
            }
            Some(_) => {}
        }
        let merged = e.derive.clone().expect("checked");
        let [rows, cols] = e.shape[..] else {
            return Err(bad(format!(
                "is merged as a {:?} tensor: only 2-D weights are requantised",
                e.shape
            )));
        };
        let module = e.name.strip_suffix(".weight").unwrap_or(&e.name);
        let scale_name = match base {
            BaseScheme::Fp8Native => format!("{module}.weight_scale_inv"),
            _ => format!("{module}.weight_scale"),
        };
        let Some(s) = by_name.get(scale_name.as_str()) else {
            return Err(bad(format!(
                "has no `{scale_name}` in the base: it is not laid out as {}",
                base.name()
            )));
        };
        let stats = Arc::new(Mutex::new(Stats::new(rows)));
        let (code_dtype, code_shape, scale_dtype, scale_shape, global) = match base {
            BaseScheme::Nvfp4Ct => {
                let g_name = format!("{module}.weight_global_scale");
                let g = by_name
                    .get(g_name.as_str())
                    .ok_or_else(|| bad(format!("has no `{g_name}` in the base")))?;
                let mut b = [0u8; 4];
                ckpt.read_tensor_at(&ckpt.tensors[g.source], 0, &mut b)?;
                let global = f32::from_le_bytes(b);
                if !(global.is_finite() && global > 0.0) {
                    return Err(bad(format!("has a tensor scale `{g_name}` of {global}")));
                }
                if cols % 16 != 0 {
                    return Err(bad(format!(
                        "has {cols} columns, which NVFP4's 16 does not divide"
                    )));
                }
                (
                    DType::U8,
                    vec![rows, cols / 2],
                    DType::F8_E4M3,
                    vec![rows, cols / 16],
                    global,
                )
            }
            _ => (
                DType::F8_E4M3,
                vec![rows, cols],
                math.scale_dtype(wt),
                vec![rows.div_ceil(FP8_BLOCK), cols.div_ceil(FP8_BLOCK)],
                1.0,
            ),
        };
        if (o.dtype, &o.shape) != (code_dtype, &code_shape)
            || (s.dtype, &s.shape) != (scale_dtype, &scale_shape)
        {
            return Err(bad(format!(
                "is {} {:?} with `{}` {} {:?}; requantising {} from {} writes {code_dtype} {code_shape:?} and {scale_dtype} {scale_shape:?}, so the layout would change (dequantise the base first)",
                o.dtype,
                o.shape,
                s.name,
                s.dtype,
                s.shape,
                base.name(),
                wt.dtype()
            )));
        }
        let codes = QuantizeRows {
            scheme,
            rows,
            cols,
            wt,
            global,
            block: math,
        };
        replaced.insert(
            o.id,
            Entry {
                derive: Some(Arc::new(RequantDerive {
                    merged,
                    wt,
                    outer: codes,
                    base,
                    stats: Some(stats),
                })),
                ..o.clone()
            },
        );
        let scale_derive: Arc<dyn Derive> = Arc::new(ExtraOutput {
            primary: o.id,
            output: 1,
        });
        replaced.insert(
            s.id,
            Entry {
                // Computed from the weight: errors and the plan name the weight's input.
                source: o.source,
                derive: Some(scale_derive),
                relabel: false,
                ..(*s).clone()
            },
        );
        requantised.push(o.name.clone());
    }
    // The base's order, each tensor as the merge left it, requantised, or as it was.
    let now: HashMap<usize, Entry> = work.into_iter().map(|e| (e.id, e)).collect();
    let mut out = Vec::with_capacity(orig.len());
    for o in &orig {
        if let Some(r) = replaced.remove(&o.id) {
            out.push(r);
        } else if untouched.contains(&o.id) {
            out.push(o.clone());
        } else if let Some(e) = now.get(&o.id) {
            out.push(e.clone());
        } else {
            // A scale the dequant step dropped, of a weight left alone: kept.
            out.push(o.clone());
        }
    }
    *entries = out;
    if !requantised.is_empty() {
        notes.lines.push(format!(
            "requant: {} merged weight(s) quantised again as {} from {} (the base's other quantised weights copied unchanged): {}",
            requantised.len(),
            base.name(),
            wt.dtype(),
            requantised.join(", ")
        ));
    }
    Ok(changed)
}

#[derive(Debug)]
struct RequantDerive {
    merged: Arc<dyn Derive>,
    wt: WeightType,
    /// The quantiser of the merged rows: codes, and block scales as its extra output.
    outer: QuantizeRows,
    base: BaseScheme,
    stats: Option<Arc<Mutex<Stats>>>,
}

impl Derive for RequantDerive {
    fn inputs(&self) -> Vec<usize> {
        self.merged.inputs()
    }
    fn build(&self, _dst: DType) -> Arc<dyn Op> {
        // The merged weight is rounded to the base's float dtype first, as the two-step route
        // (`dequant --merge-lora --dtype W`, then `quantize`) stores it.
        let inner = self.merged.build(self.wt.dtype());
        let q = self.outer;
        Arc::new(Requant {
            inner,
            outer: q,
            cols: q.cols,
            wt: self.wt,
            base: self.base,
            global: q.global,
            stats: self.stats.clone(),
        })
    }
}

/// Sums for `||q - m|| / ||m||`, per 128-row block so that the total is summed in one order
/// however the tensor was cut into chunks.
#[derive(Debug)]
struct Stats {
    /// (Σ(q-m)², Σm²) per block of 128 rows.
    blocks: Vec<(f64, f64)>,
    saturated: u64,
    /// Rows measured so far (none in a dry run, which then reports nothing).
    rows: u64,
}

impl Stats {
    fn new(rows: u64) -> Stats {
        Stats {
            blocks: vec![(0.0, 0.0); rows.div_ceil(STAT_ROWS) as usize],
            saturated: 0,
            rows: 0,
        }
    }
}

/// Rows per partial sum of the error (chunks start at multiples of it).
const STAT_ROWS: u64 = 128;

fn gcd(a: u64, b: u64) -> u64 {
    if b == 0 {
        a
    } else {
        gcd(b, a % b)
    }
}

fn lcm(a: u64, b: u64) -> u64 {
    a / gcd(a, b) * b
}

/// A merge (`inner`, rows of the merged weight in the base's float dtype) feeding a quantiser
/// (`outer`) in one chunk: the merged rows live only in a scratch buffer.
#[derive(Debug)]
struct Requant {
    inner: Arc<dyn Op>,
    outer: QuantizeRows,
    cols: u64,
    wt: WeightType,
    base: BaseScheme,
    global: f32,
    /// Error figures, gathered by the codes op only.
    stats: Option<Arc<Mutex<Stats>>>,
}

impl Requant {
    /// Folds the error of quantised rows `rows` (codes `outs[0]`, NVFP4 scales `outs[1]`)
    /// against the merged values `m` into the stats.
    fn measure(&self, rows: &Range<u64>, m: &[f32], outs: &[&[u8]]) -> Result<(), String> {
        let Some(stats) = &self.stats else {
            return Ok(());
        };
        let cols = self.cols as usize;
        let n = (rows.end - rows.start) as usize;
        let mut q = vec![0f32; m.len()];
        let mut saturated = 0u64;
        match self.base {
            BaseScheme::Nvfp4Ct => {
                let (codes, scales) = (&outs[0], &outs[1]);
                for (k, block) in m.chunks_exact(16).enumerate() {
                    let local = self.wt.round(amax(block) / E2M1_MAX);
                    saturated += u64::from(self.global * local > E4M3_MAX);
                    let eff = e4m3_to_f32(scales[k]) / self.global;
                    for j in 0..16 {
                        let byte = codes[k * 8 + j / 2];
                        let code = if j % 2 == 0 { byte & 15 } else { byte >> 4 };
                        q[k * 16 + j] = e2m1_to_f32(code) * eff;
                    }
                }
            }
            BaseScheme::Fp8BlockCt | BaseScheme::Fp8Native => {
                let math = self.base.math();
                let nb = cols.div_ceil(FP8_BLOCK as usize);
                let scale_bytes = &outs[1];
                let mut scale = Vec::new();
                match math {
                    BlockMath::CompressedTensors => self.wt.decode(scale_bytes, &mut scale),
                    BlockMath::Transformers => scale.extend(
                        scale_bytes
                            .chunks_exact(4)
                            .map(|c| f32::from_le_bytes(c.try_into().expect("4 bytes"))),
                    ),
                }
                for r in 0..n {
                    for c in 0..cols {
                        let s = scale[(r / FP8_BLOCK as usize) * nb + c / FP8_BLOCK as usize];
                        q[r * cols + c] = e4m3_to_f32(outs[0][r * cols + c]) * s;
                    }
                }
            }
        }
        let mut st = stats.lock().unwrap();
        st.saturated += saturated;
        st.rows += n as u64;
        let first = rows.start as usize;
        for r in 0..n {
            let (mut err, mut norm) = (0f64, 0f64);
            for c in 0..cols {
                let (mv, qv) = (m[r * cols + c] as f64, q[r * cols + c] as f64);
                err += (qv - mv) * (qv - mv);
                norm += mv * mv;
            }
            // Rows of one block arrive in one chunk (granularity), in row order.
            let b = &mut st.blocks[(first + r) / STAT_ROWS as usize];
            b.0 += err;
            b.1 += norm;
        }
        Ok(())
    }
}

impl Op for Requant {
    fn name(&self) -> &'static str {
        "requant"
    }
    /// On a GPU the merged rows stay on the device between the merge and the encoder.
    fn kernel(&self, units: &Range<u64>) -> Option<Kernel> {
        let Some(Kernel::Lora(merge)) = self.inner.kernel(units) else {
            return None;
        };
        let Some(Kernel::Quantize(quant)) = self.outer.kernel(units) else {
            return None;
        };
        Some(Kernel::Requant {
            merge,
            quant,
            measure: self.stats.is_some(),
        })
    }
    fn absorb(&self, stats: KernelStats) {
        let KernelStats::Requant {
            rows,
            merged,
            codes,
            scales,
        } = stats
        else {
            unreachable!("the requant kernels' figures")
        };
        let mut m = Vec::new();
        self.wt.decode(&merged, &mut m);
        // The same figures as the CPU op's: the kernels' bytes are the CPU's.
        let _ = self.measure(&rows, &m, &[&codes, &scales]);
    }
    units_of!(outer);
    fn in_unit_bytes(&self) -> u64 {
        // The inner op's inputs plus the merged rows it leaves in scratch.
        self.inner.in_unit_bytes() + self.inner.out_unit_bytes()
    }
    fn scratch_unit_bytes(&self) -> u64 {
        // The merged rows and, with figures, the merged and requantised values as f32 beside
        // them.
        let figures = if self.stats.is_some() {
            2 * self.cols * 4
        } else {
            0
        };
        self.inner.out_unit_bytes()
            + figures
            + self.outer.scratch_unit_bytes()
            + self.inner.scratch_unit_bytes()
    }
    fn granularity(&self) -> u64 {
        let mut gran = lcm(self.outer.granularity(), self.inner.granularity());
        if self.stats.is_some() {
            gran = lcm(gran, STAT_ROWS);
        }
        gran
    }
    outputs_of!(outer);
    fn input_ranges(&self, units: Range<u64>) -> Vec<Range<u64>> {
        self.inner.input_ranges(units)
    }
    fn compute(&self, units: Range<u64>, inputs: &[&[u8]], out: &mut [u8]) -> Result<(), String> {
        self.compute_all(units, inputs, &mut [out])
    }
    fn compute_all(&self, units: Range<u64>, inputs: &[&[u8]], outs: Outs) -> Result<(), String> {
        let rows = units.clone();
        let mut merged =
            vec![0u8; ((rows.end - rows.start) * self.inner.out_unit_bytes()) as usize];
        self.inner.compute(rows.clone(), inputs, &mut merged)?;
        self.outer.compute_all(units, &[&merged], outs)?;
        if self.stats.is_some() {
            let mut m = Vec::new();
            self.wt.decode(&merged, &mut m);
            self.measure(&rows, &m, &[&*outs[0], &*outs[1]])?;
        }
        Ok(())
    }
    fn report(&self) -> Option<Value> {
        let st = self.stats.as_ref()?.lock().unwrap();
        if st.rows == 0 {
            return None;
        }
        let (err, norm) = st
            .blocks
            .iter()
            .fold((0f64, 0f64), |(e, n), b| (e + b.0, n + b.1));
        let rel = if norm > 0.0 {
            (err / norm).sqrt()
        } else {
            err.sqrt()
        };
        let mut r = serde_json::json!({
            "op": "requant",
            "scheme": self.base.name(),
            "relative_error": rel,
        });
        if self.base == BaseScheme::Nvfp4Ct {
            r["saturated_blocks"] = Value::from(st.saturated);
            r["global_scale"] = Value::from(self.global);
        }
        Some(r)
    }
}

/// The one-line summary of the requantised tensors' errors in `reports` (the JSON report's
/// `tensor_reports`), or `None` when nothing was requantised.
pub fn summary(reports: &[Value]) -> Option<String> {
    let errs: Vec<(f64, &str)> = reports
        .iter()
        .filter(|r| r.get("op").and_then(Value::as_str) == Some("requant"))
        .map(|r| {
            (
                r.get("relative_error")
                    .and_then(Value::as_f64)
                    .unwrap_or(0.0),
                r.get("tensor").and_then(Value::as_str).unwrap_or("?"),
            )
        })
        .collect();
    let (max, worst) =
        errs.iter().copied().fold(
            (f64::NEG_INFINITY, "?"),
            |a, b| if b.0 > a.0 { b } else { a },
        );
    if errs.is_empty() {
        return None;
    }
    let mean = errs.iter().map(|e| e.0).sum::<f64>() / errs.len() as f64;
    let saturated: u64 = reports
        .iter()
        .filter_map(|r| r.get("saturated_blocks").and_then(Value::as_u64))
        .sum();
    Some(format!(
        "requant: {} tensor(s) re-quantised, relative error ||q - m|| / ||m|| against the merged weights: max {max:.3e} ({worst}), mean {mean:.3e}{}",
        errs.len(),
        if saturated > 0 {
            format!("; {saturated} NVFP4 block scale(s) saturated under the kept tensor scale")
        } else {
            String::new()
        }
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(q: Value) -> Map<String, Value> {
        let mut m = Map::new();
        m.insert("quantization_config".into(), q);
        m
    }

    #[test]
    fn detects_the_supported_layouts_and_names_the_others() {
        let d = |q: Value| detect(Some(&cfg(q)));
        assert_eq!(detect(None), Ok(None));
        assert_eq!(detect(Some(&Map::new())), Ok(None));
        assert_eq!(
            d(serde_json::json!({"quant_method": "fp8", "weight_block_size": [128, 128]})),
            Ok(Some(BaseScheme::Fp8Native))
        );
        assert!(
            d(serde_json::json!({"quant_method": "fp8", "weight_block_size": [64, 64]}))
                .unwrap_err()
                .contains("[64,64]")
        );
        assert!(d(serde_json::json!({"quant_method": "fp8"}))
            .unwrap_err()
            .contains("per-tensor"));
        for scheme in [Scheme::Fp8Block, Scheme::Nvfp4A16] {
            let want = if scheme == Scheme::Fp8Block {
                BaseScheme::Fp8BlockCt
            } else {
                BaseScheme::Nvfp4Ct
            };
            assert_eq!(d(scheme.quantization_config(&[])), Ok(Some(want)));
        }
        assert!(d(Scheme::Fp8Dynamic.quantization_config(&[]))
            .unwrap_err()
            .contains("per-channel"));
        assert!(d(Scheme::W4A16.quantization_config(&[]))
            .unwrap_err()
            .contains("pack-quantized"));
        assert!(d(Scheme::Mxfp4A16.quantization_config(&[]))
            .unwrap_err()
            .contains("mxfp4-pack-quantized"));
        assert!(d(serde_json::json!({"quant_method": "modelopt"}))
            .unwrap_err()
            .contains("modelopt"));
    }
}
