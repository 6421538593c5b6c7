//! The op that merges one tensor: reads the same range of every model's tensor, widens it,
//! applies the method and rounds once to the output dtype.
//!
//! `linear`, `task_arithmetic` and a scaled `passthrough` are elementwise: any chunk of any
//! size computes the same bytes, so big tensors stream in chunks within the memory budget, the
//! values widened to f64 a block of [`BLOCK`] elements at a time. The other methods need the
//! whole tensor of every model (thresholds, norms, iterations): one chunk, f32 values.

use std::cell::RefCell;
use std::ops::Range;

use super::config::MergeConfig;
use super::methods::{self, ModelTensor, Params};
use super::resolve::{Inputs, Resolved};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use super::methods::survey::{observe_split, Blend, BlendKind, Chunk, Setting, Survey, SurveyFn};
use super::spec::{Arithmetic, MethodSpec, WholeTensorFn};
use crate::error::{Error, Result};
use crate::format::dtype::DType;
use crate::ops::cast::{bf16_to_f32, f16_to_f32, f32_to_bf16, f32_to_f16, f64_to_f32_odd};
use crate::ops::cast::{decode_into, store_f32, write_as};
use crate::plan::kernel::merge::{MergeLaunch, MergeMethod, MergeParams, MERGE_MAX_INPUTS};
use crate::plan::kernel::{kernel_dtype, Kernel, KERNEL_DTYPE_NONE};
use crate::plan::Op;

/// What [`MergeOp::by_pieces`] calls with each piece: its offset in the chunk, the piece, and
/// scratch for its merged values.
type PieceFn<'f> = dyn FnMut(usize, &Chunk, &mut Vec<f32>) -> Result<(), String> + 'f;

/// Elements of a chunk decoded at a time by a streamed survey's passes and merge.
const PIECE: usize = 1 << 14;

thread_local! {
    /// Each thread's decoded inputs and merged values of one piece ([`MergeOp::by_pieces`]).
    static SCRATCH: RefCell<(Vec<Vec<f32>>, Vec<f32>)> = const { RefCell::new((Vec::new(), Vec::new())) };
}

/// Threads a survey pass of one chunk may take: the compute workers wait for the survey, so
/// every core.
fn survey_threads() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

/// Elements widened to f64 at a time per input in elementwise methods.
pub const BLOCK: usize = 1024;

/// The elementwise formulas, their coefficients fixed at plan time.
#[derive(Clone, Debug)]
enum Formula {
    /// `Σ w_i x_i / denominator`.
    Linear { weights: Vec<f64>, denominator: f64 },
    /// `x_0 + scale · Σ_{i≥1} w_i (x_i − x_0)`.
    TaskArithmetic { weights: Vec<f64>, scale: f64 },
    /// A method that needs whole tensors.
    Whole(Whole),
}

/// A whole-tensor method's formula for one tensor.
#[derive(Clone, Debug)]
struct Whole {
    f: WholeTensorFn,
    global: Params,
    models: Vec<Params>,
    has_base: bool,
    shape: Vec<usize>,
    seed: u64,
    /// The models handed to `f` (the base apart), as the config names them.
    names: Vec<String>,
    /// How a tensor bigger than one chunk streams: its survey, passes and granule.
    survey: Option<(SurveyFn, usize, u64)>,
}

impl Whole {
    /// The models' parameters, the base's apart.
    fn non_base(&self) -> &[Params] {
        &self.models[usize::from(self.has_base)..]
    }

    fn setting(&self) -> Setting<'_> {
        Setting {
            global: &self.global,
            models: self.non_base(),
            shape: &self.shape,
            seed: self.seed,
        }
    }
}

/// A tensor's survey: under way (`running`), then finished and shared by the chunks' merges
/// (`done`), dropped once they have merged every element so that a run holds the statistics
/// of the tensors being merged only.
#[derive(Default)]
struct SurveyCell {
    running: Mutex<Option<Running>>,
    done: Mutex<Option<Arc<dyn Survey>>>,
    merged: AtomicU64,
}

/// A survey and the next chunk it expects.
struct Running {
    survey: Box<dyn Survey>,
    pass: usize,
    next: u64,
}

/// Each built op surveys its own tensor: a clone starts afresh.
impl Clone for SurveyCell {
    fn clone(&self) -> Self {
        SurveyCell::default()
    }
}

impl std::fmt::Debug for SurveyCell {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("SurveyCell")
    }
}

#[derive(Clone, Debug)]
pub struct MergeOp {
    method: &'static str,
    formula: Formula,
    in_dtypes: Vec<DType>,
    /// mergekit's `dtype`: inputs are rounded to it before merging, as mergekit loads them.
    compute_dtype: Option<DType>,
    elements: u64,
    pub dst: DType,
    surveyed: SurveyCell,
}

crate::plan::set_dst_field!(MergeOp);

/// The random stream of tensor `name` under `--random-seed seed` (FNV-1a of the name, mixed
/// with the seed): the same for any thread count, chunking or device.
pub fn tensor_seed(seed: u64, name: &str) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in name.bytes() {
        h = (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3);
    }
    h ^ seed.wrapping_mul(0x9E37_79B9_7F4A_7C15)
}

impl MergeOp {
    /// The op merging `inputs` with `method` under parameters `p`. Non-float inputs and
    /// parameters the formula cannot use (weights summing to 0 under `normalize`) are refused.
    pub fn new(config: &MergeConfig, inputs: &Inputs, p: Resolved, seed: u64) -> Result<MergeOp> {
        let method: &'static MethodSpec = config.method;
        let mut in_dtypes = Vec::new();
        for (k, &d) in inputs.dtypes.iter().enumerate() {
            if !matches!(d, DType::F32 | DType::F16 | DType::BF16 | DType::F64) {
                return Err(Error::InvalidTensor {
                    path: inputs.models[k].clone(),
                    tensor: inputs.names[k].clone(),
                    msg: format!(
                        "is {d}; `{}` merges float tensors (bf16, f16, f32, f64) and the quantised weights `tftf dequant` decodes, and this tensor is neither",
                        method.name
                    ),
                });
            }
            in_dtypes.push(d);
        }
        let weights = |from: usize| -> Vec<f64> {
            p.models[from..]
                .iter()
                .map(|m| m.get("weight", 0.0))
                .collect()
        };
        let formula = match method.arithmetic {
            Arithmetic::Passthrough => Formula::Linear {
                weights: vec![p.models[0].get("scale", 1.0)],
                denominator: 1.0,
            },
            Arithmetic::Linear => {
                let w = weights(0);
                let sum: f64 = w.iter().sum();
                let normalize = p.global.flag("normalize", true);
                if normalize && sum == 0.0 {
                    return Err(Error::InvalidConfig {
                        path: config.path.clone(),
                        msg: format!(
                            "tensor `{}`: the models' weights sum to 0, and `normalize` divides by that sum; set `normalize: false` or change the weights",
                            inputs.names[0]
                        ),
                    });
                }
                Formula::Linear {
                    weights: w,
                    denominator: if normalize { sum } else { 1.0 },
                }
            }
            Arithmetic::TaskArithmetic => {
                let w = weights(1);
                let scale = methods::task_arithmetic::delta_scale(
                    &w,
                    p.global.flag("normalize", false),
                    p.global.get("lambda", 1.0),
                );
                Formula::TaskArithmetic { weights: w, scale }
            }
            Arithmetic::WholeTensor(f) => {
                let shape: Vec<usize> = inputs.shapes[0].iter().map(|&d| d as usize).collect();
                let first = usize::from(inputs.has_base);
                // Parameters the survey refuses leave the tensor whole: the whole-tensor
                // function then refuses them with its own message.
                let mut whole = Whole {
                    f,
                    global: p.global,
                    models: p.models,
                    has_base: inputs.has_base,
                    shape,
                    seed,
                    names: inputs.models[first..]
                        .iter()
                        .map(|m| m.display().to_string())
                        .collect(),
                    survey: None,
                };
                whole.survey = method.survey.and_then(|make| {
                    let s = make(&whole.setting()).ok()?;
                    Some((make, s.passes(), s.granule().max(1) as u64))
                });
                Formula::Whole(whole)
            }
        };
        let elements = crate::format::dtype::element_count(&inputs.shapes[0]).unwrap_or(0);
        Ok(MergeOp {
            method: method.name,
            formula,
            in_dtypes,
            compute_dtype: config.dtype,
            elements,
            dst: DType::F32,
            surveyed: SurveyCell::default(),
        })
    }

    /// An elementwise merge built directly (the selftest's GPU cases): `Σ w_k x_k / coef`, or
    /// with `task` `x_0 + coef · Σ_{k≥1} w_k (x_k − x_0)` (`weights` then the models' after
    /// the base), over `elements` elements of `in_dtypes`, rounded first to `compute_dtype`.
    pub fn elementwise(
        task: bool,
        weights: Vec<f64>,
        coef: f64,
        in_dtypes: Vec<DType>,
        compute_dtype: Option<DType>,
        elements: u64,
        dst: DType,
    ) -> MergeOp {
        let formula = if task {
            Formula::TaskArithmetic {
                weights,
                scale: coef,
            }
        } else {
            Formula::Linear {
                weights,
                denominator: coef,
            }
        };
        MergeOp {
            method: if task { "task_arithmetic" } else { "linear" },
            formula,
            in_dtypes,
            compute_dtype,
            elements,
            dst,
            surveyed: SurveyCell::default(),
        }
    }

    /// The same merge over inputs all of `dtype` and of the output's `shape` (a vocabulary
    /// tensor's rows remapped to the merged vocabulary, `tokenizer/remap.rs`).
    pub(crate) fn over_rows(mut self, shape: &[u64], dtype: DType) -> MergeOp {
        self.in_dtypes.iter_mut().for_each(|d| *d = dtype);
        self.elements = crate::format::dtype::element_count(shape).unwrap_or(0);
        if let Formula::Whole(whole) = &mut self.formula {
            whole.shape = shape.iter().map(|&d| d as usize).collect();
            // The remapping op hands over whole tensors.
            whole.survey = None;
        }
        self
    }

    /// The compute dtype an input of dtype `d` must be rounded to, unless it holds every `d`
    /// value exactly (a bf16 model merged with `dtype: bfloat16` or `float32`).
    fn rounding(&self, d: DType) -> Option<DType> {
        self.compute_dtype.filter(|&c| {
            let exact = c == d
                || c == DType::F64
                || (c == DType::F32 && matches!(d, DType::BF16 | DType::F16));
            !exact
        })
    }

    /// Every input decoded to f32 (and rounded to the compute dtype).
    fn decode(&self, inputs: &[&[u8]], n: usize) -> Vec<Vec<f32>> {
        (inputs.iter().zip(&self.in_dtypes))
            .map(|(bytes, &d)| {
                let mut v = vec![0f32; n];
                decode_into(d, bytes, &mut v);
                if let Some(c) = self.rounding(d) {
                    v.iter_mut()
                        .for_each(|x| *x = round_to(c, *x as f64) as f32);
                }
                v
            })
            .collect()
    }

    /// The base (empty when the tensor has none) and the models, as `f` and surveys take them.
    fn split<'v>(&self, values: &'v [Vec<f32>]) -> (&'v [f32], Vec<&'v [f32]>) {
        let has_base = matches!(&self.formula, Formula::Whole(w) if w.has_base);
        let first = usize::from(has_base);
        let models = values[first..].iter().map(Vec::as_slice).collect();
        (if has_base { &values[0] } else { &[] }, models)
    }

    /// Calls `f` with each piece of chunk `units` (a whole number of `granule`s, about
    /// [`PIECE`] elements) decoded into this thread's scratch, and the piece's offset in the
    /// chunk: a chunk of any size then costs a few hundred KiB of decoded values, no fresh
    /// pages, and stays in cache from decoding to use. A survey's statistics and merge do not
    /// depend on where chunks are cut at granules (`survey.rs`), so pieces give a chunk's
    /// bytes.
    fn by_pieces(
        &self,
        units: &Range<u64>,
        inputs: &[&[u8]],
        granule: usize,
        f: &mut PieceFn,
    ) -> Result<(), String> {
        let n = (units.end - units.start) as usize;
        let step = PIECE.div_ceil(granule.max(1)) * granule.max(1);
        SCRATCH.with(|cell| {
            let mut scratch = cell.borrow_mut();
            let (values, out) = &mut *scratch;
            values.resize_with(inputs.len(), Vec::new);
            let mut at = 0;
            while at < n {
                let len = step.min(n - at);
                for ((v, bytes), &d) in values.iter_mut().zip(inputs).zip(&self.in_dtypes) {
                    let size = d.size().expect("float dtypes have a size");
                    v.resize(len, 0.0);
                    decode_into(d, &bytes[at * size..(at + len) * size], v);
                    if let Some(c) = self.rounding(d) {
                        v.iter_mut()
                            .for_each(|x| *x = round_to(c, *x as f64) as f32);
                    }
                }
                let (base, models) = self.split(values);
                let chunk = Chunk {
                    start: units.start as usize + at,
                    base,
                    models: &models,
                };
                f(at, &chunk, out)?;
                at += len;
            }
            Ok(())
        })
    }

    /// A new survey of this tensor.
    fn start_survey(&self) -> Result<Box<dyn Survey>, String> {
        match &self.formula {
            Formula::Whole(
                w @ Whole {
                    survey: Some((make, ..)),
                    ..
                },
            ) => make(&w.setting()).map_err(|e| self.named(e)),
            _ => Err(format!("`{}` merges this tensor whole", self.method)),
        }
    }

    /// The model names errors from a method's arithmetic are told with.
    fn names(&self) -> &[String] {
        match &self.formula {
            Formula::Whole(w) => &w.names,
            _ => &[],
        }
    }

    /// A method's message with the models named as the config names them.
    fn named(&self, msg: String) -> String {
        super::adapt::name_models(&msg, self.names())
    }

    /// The kernel's parameters every formula shares (inputs, their rounding, the output), or
    /// `None` when the merge has no kernel: more than [`MERGE_MAX_INPUTS`] inputs, or a
    /// dtype the kernel does not read or write.
    fn kernel_params(&self) -> Option<MergeParams> {
        let float = |d: DType| matches!(d, DType::F64 | DType::F32 | DType::BF16 | DType::F16);
        let n = self.in_dtypes.len();
        if n > MERGE_MAX_INPUTS || !float(self.dst) || !self.in_dtypes.iter().all(|&d| float(d)) {
            return None;
        }
        let mut p = MergeParams {
            n: n as i32,
            dst: kernel_dtype(self.dst),
            ..MergeParams::default()
        };
        for (k, &d) in self.in_dtypes.iter().enumerate() {
            p.dtypes[k] = kernel_dtype(d);
            p.round[k] = self.rounding(d).map_or(KERNEL_DTYPE_NONE, kernel_dtype);
        }
        Some(p)
    }

    /// The [`Blend`] chunk `units` of a surveyed tensor merges by on the GPU (counted as
    /// merged, as [`Self::compute_surveyed`] counts its chunks); `None` for a tensor merged
    /// whole, for no units and for a method that is no blend.
    fn surveyed_blend(&self, units: &Range<u64>) -> Option<Blend> {
        if units.is_empty() || *units == (0..self.elements) {
            return None;
        }
        let blend = self.finished_survey().ok()??.blend()?;
        let n = units.end - units.start;
        if self.surveyed.merged.fetch_add(n, Ordering::Relaxed) + n >= self.elements {
            *self.surveyed.done.lock().unwrap() = None;
        }
        Some(blend)
    }

    /// The tensor's finished survey (one without passes is started here); `None` while its
    /// passes are under way.
    fn finished_survey(&self) -> Result<Option<Arc<dyn Survey>>, String> {
        let mut done = self.surveyed.done.lock().unwrap();
        if done.is_none() && self.survey_passes() == 0 {
            *done = Some(Arc::from(self.start_survey()?));
        }
        Ok(done.clone())
    }

    /// Merges chunk `units` from the finished survey.
    fn compute_surveyed(
        &self,
        units: Range<u64>,
        inputs: &[&[u8]],
        out: &mut [u8],
    ) -> Result<(), String> {
        let Some(survey) = self.finished_survey()? else {
            return Err(format!(
                "internal error: a chunk of `{}` was merged before the tensor's survey ended",
                self.method
            ));
        };
        let n = (units.end - units.start) as usize;
        let size = self.dst.size().expect("float dtypes have a size");
        self.by_pieces(
            &units,
            inputs,
            survey.granule(),
            &mut |at, chunk, merged| {
                let len = chunk.models[0].len();
                merged.resize(len, 0.0);
                survey.merge(chunk, merged)?;
                write_as(self.dst, canonical_nans(merged), &mut out[at * size..]);
                Ok(())
            },
        )
        .map_err(|e| self.named(e))?;
        if self.surveyed.merged.fetch_add(n as u64, Ordering::Relaxed) + n as u64 >= self.elements {
            *self.surveyed.done.lock().unwrap() = None;
        }
        Ok(())
    }

    /// Element range `units` of every input, widened to f64 (and rounded to the compute
    /// dtype), `BLOCK` elements from `at`.
    #[inline(always)]
    fn widen(&self, inputs: &[&[u8]], at: usize, n: usize, bufs: &mut [Vec<f64>]) {
        let mut f32s = [0f32; BLOCK];
        for ((bytes, &d), buf) in inputs.iter().zip(&self.in_dtypes).zip(bufs.iter_mut()) {
            let size = d.size().expect("float dtypes have a size");
            let bytes = &bytes[at * size..(at + n) * size];
            buf.clear();
            if d == DType::F64 {
                buf.extend(
                    bytes
                        .chunks_exact(8)
                        .map(|c| f64::from_le_bytes(c.try_into().expect("8 bytes"))),
                );
            } else {
                decode_into(d, bytes, &mut f32s[..n]);
                buf.extend(f32s[..n].iter().map(|&x| x as f64));
            }
            if let Some(c) = self.rounding(d) {
                buf.iter_mut().for_each(|x| *x = round_to(c, *x));
            }
        }
    }

    /// The elementwise formulas over a chunk, in 4-wide f64 vectors where the CPU has AVX2.
    fn compute_elementwise(&self, units: Range<u64>, inputs: &[&[u8]], out: &mut [u8]) {
        crate::ops::simd::with_avx2(
            #[inline(always)]
            || self.elementwise_blocks(units, inputs, out),
        )
    }

    #[inline(always)]
    fn elementwise_blocks(&self, units: Range<u64>, inputs: &[&[u8]], out: &mut [u8]) {
        let total = (units.end - units.start) as usize;
        // Inputs whose f32 decoding widens to the merge's values exactly (no f64 input, no
        // rounding to a compute dtype) are summed from f32 blocks: half the bytes moved.
        let exact = self.in_dtypes.iter().all(|&d| {
            matches!(d, DType::BF16 | DType::F16 | DType::F32) && self.rounding(d).is_none()
        });
        let mut wide = vec![Vec::with_capacity(BLOCK); if exact { 0 } else { inputs.len() }];
        let mut narrow = vec![vec![0f32; BLOCK]; if exact { inputs.len() } else { 0 }];
        let mut res = vec![0f64; BLOCK];
        let size = self.dst.size().expect("float dtypes have a size");
        let mut at = 0;
        while at < total {
            let n = BLOCK.min(total - at);
            if exact {
                for ((bytes, &d), buf) in inputs.iter().zip(&self.in_dtypes).zip(&mut narrow) {
                    let s = d.size().expect("float dtypes have a size");
                    decode_into(d, &bytes[at * s..(at + n) * s], &mut buf[..n]);
                }
                let views: Vec<&[f32]> = narrow.iter().map(|b| &b[..n]).collect();
                self.formula_block(&views, &mut res[..n]);
            } else {
                self.widen(inputs, at, n, &mut wide);
                let views: Vec<&[f64]> = wide.iter().map(Vec::as_slice).collect();
                self.formula_block(&views, &mut res[..n]);
            }
            store_f64_block(
                self.dst,
                &mut res[..n],
                &mut out[at * size..(at + n) * size],
            );
            at += n;
        }
    }

    /// The elementwise formula over one block of every input.
    #[inline(always)]
    fn formula_block<T: Copy + Into<f64>>(&self, views: &[&[T]], res: &mut [f64]) {
        match &self.formula {
            Formula::Linear {
                weights,
                denominator,
            } => methods::linear::linear(views, weights, *denominator, res),
            Formula::TaskArithmetic { weights, scale } => {
                methods::task_arithmetic::task_arithmetic(
                    views[0],
                    &views[1..],
                    weights,
                    *scale,
                    res,
                )
            }
            Formula::Whole(_) => unreachable!("whole-tensor methods compute elsewhere"),
        }
    }
}

/// `values`, a NaN among them as the one positive quiet NaN (as the GPU kernel writes it: the
/// sign and payload of a NaN the arithmetic makes differ between devices).
fn canonical_nans(values: &[f32]) -> impl Iterator<Item = f32> + '_ {
    values
        .iter()
        .map(|&v| if v.is_nan() { f32::NAN } else { v })
}

/// Rounds `x` to `dtype` (nearest even), as a cast to it and back would.
fn round_to(dtype: DType, x: f64) -> f64 {
    match dtype {
        DType::F32 => x as f32 as f64,
        DType::BF16 => bf16_to_f32(f32_to_bf16(f64_to_f32_odd(x))) as f64,
        DType::F16 => f16_to_f32(f32_to_f16(f64_to_f32_odd(x))) as f64,
        _ => x,
    }
}

/// Writes `v` rounded once to `dst` as element `k` of `out`.
pub(crate) fn store_f64(dst: DType, out: &mut [u8], k: usize, v: f64) {
    match dst {
        DType::F64 => out[8 * k..8 * k + 8].copy_from_slice(&v.to_le_bytes()),
        DType::F32 => store_f32(dst, out, k, v as f32),
        _ => store_f32(dst, out, k, f64_to_f32_odd(v)),
    }
}

/// [`store_f64`] of every value of `values` into `out`, the dtype matched once. A NaN is
/// stored as the one positive quiet NaN of `dst` (as the GPU kernel stores it: the payload and
/// sign of a NaN the arithmetic makes differ between devices).
#[inline(always)]
fn store_f64_block(dst: DType, values: &mut [f64], out: &mut [u8]) {
    values
        .iter_mut()
        .for_each(|v| *v = if v.is_nan() { f64::NAN } else { *v });
    let values = &*values;
    match dst {
        DType::F64 => (out.chunks_exact_mut(8).zip(values))
            .for_each(|(o, v)| o.copy_from_slice(&v.to_le_bytes())),
        DType::F32 => (out.chunks_exact_mut(4).zip(values))
            .for_each(|(o, &v)| o.copy_from_slice(&(v as f32).to_le_bytes())),
        DType::BF16 => (out.chunks_exact_mut(2).zip(values))
            .for_each(|(o, &v)| o.copy_from_slice(&f32_to_bf16(f64_to_f32_odd(v)).to_le_bytes())),
        DType::F16 => (out.chunks_exact_mut(2).zip(values))
            .for_each(|(o, &v)| o.copy_from_slice(&f32_to_f16(f64_to_f32_odd(v)).to_le_bytes())),
        _ => (values.iter().enumerate()).for_each(|(k, &v)| store_f64(dst, out, k, v)),
    }
}

impl Op for MergeOp {
    fn name(&self) -> &'static str {
        self.method
    }
    fn kernel(&self, units: &Range<u64>) -> Option<Kernel> {
        let mut p = self.kernel_params()?;
        let n = self.in_dtypes.len();
        let mut coefs = Vec::new();
        match &self.formula {
            Formula::Linear {
                weights,
                denominator,
            } => {
                p.method = MergeMethod::Linear as i32;
                p.weights[..n].copy_from_slice(weights);
                p.denominator = *denominator;
            }
            Formula::TaskArithmetic { weights, scale } => {
                p.method = MergeMethod::Task as i32;
                p.weights[1..n].copy_from_slice(weights);
                p.scale = *scale;
            }
            Formula::Whole(w) => {
                let blend = self.surveyed_blend(units)?;
                let by_position = matches!(blend.kind, BlendKind::Sparse | BlendKind::Sce);
                if by_position && !w.has_base {
                    return None;
                }
                p.method = match blend.kind {
                    BlendKind::Slerp => MergeMethod::Slerp,
                    BlendKind::Nuslerp => MergeMethod::Nuslerp,
                    BlendKind::Multislerp => MergeMethod::Multislerp,
                    BlendKind::ModelStock => MergeMethod::ModelStock,
                    BlendKind::Karcher => MergeMethod::Karcher,
                    BlendKind::Nearswap => MergeMethod::Nearswap,
                    BlendKind::Ram => MergeMethod::Ram,
                    BlendKind::Fusion => MergeMethod::Fusion,
                    BlendKind::Sparse => MergeMethod::Sparse,
                    BlendKind::Sce => MergeMethod::Sce,
                } as i32;
                p.has_base = i32::from(w.has_base);
                p.inner = (blend.coefs.len() / 2) as u64;
                coefs = blend.coefs;
                if by_position {
                    p.inner = units.start;
                }
                if blend.kind == BlendKind::Fusion {
                    // The divergences of the chunk's rows only (chunks hold whole rows).
                    let row = (coefs[1] as u64).max(1);
                    let rows = units.start / row..units.end.div_ceil(row);
                    let kl = coefs[2 + rows.start as usize..2 + rows.end as usize].to_vec();
                    coefs.truncate(2);
                    coefs.extend(kl);
                }
            }
        }
        Some(Kernel::Merge(Box::new(MergeLaunch { params: p, coefs })))
    }
    /// A whole-tensor method has GPU work when a fresh survey says its chunks can be blends.
    fn has_kernel(&self) -> bool {
        self.kernel_params().is_some()
            && match &self.formula {
                Formula::Whole(w) => (w.survey)
                    .and_then(|(make, ..)| make(&w.setting()).ok())
                    .is_some_and(|fresh| fresh.may_blend()),
                _ => true,
            }
    }
    fn units(&self) -> u64 {
        self.elements
    }
    fn out_unit_bytes(&self) -> u64 {
        self.dst.size().map_or(4, |s| s as u64)
    }
    fn in_unit_bytes(&self) -> u64 {
        self.in_dtypes
            .iter()
            .map(|d| d.size().map_or(4, |s| s as u64))
            .sum()
    }
    fn granularity(&self) -> u64 {
        match &self.formula {
            Formula::Whole(w) => match w.survey {
                Some((_, _, granule)) => granule.min(self.elements.max(1)),
                None => self.elements.max(1),
            },
            _ => 1,
        }
    }
    fn survey_passes(&self) -> usize {
        match &self.formula {
            Formula::Whole(w) => w.survey.map_or(0, |(_, passes, _)| passes),
            _ => 0,
        }
    }
    fn survey(&self, pass: usize, units: Range<u64>, inputs: &[&[u8]]) -> Result<(), String> {
        let mut running = self.surveyed.running.lock().unwrap();
        if pass == 0 && units.start == 0 {
            *running = Some(Running {
                survey: self.start_survey()?,
                pass: 0,
                next: 0,
            });
        }
        let r = match running.as_mut() {
            Some(r) if r.pass == pass && r.next == units.start => r,
            _ => {
                return Err(format!(
                    "internal error: `{}` surveyed units {units:?} of pass {pass} out of order",
                    self.method
                ))
            }
        };
        let granule = r.survey.granule();
        let first = units.start as usize;
        // Elements `range` of the chunk, piece by piece, seen by `survey`.
        let observe = |survey: &mut dyn Survey, range: Range<usize>| {
            let inputs: Vec<&[u8]> = (inputs.iter().zip(&self.in_dtypes))
                .map(|(bytes, d)| {
                    let size = d.size().expect("float dtypes have a size");
                    &bytes[(range.start - first) * size..(range.end - first) * size]
                })
                .collect();
            let range = range.start as u64..range.end as u64;
            self.by_pieces(&range, &inputs, granule, &mut |_, chunk, _| {
                survey.observe(pass, chunk)
            })
        };
        let (threads, range) = (survey_threads(), first..units.end as usize);
        observe_split(&mut r.survey, pass, range, threads, &observe).map_err(|e| self.named(e))?;
        r.next = units.end;
        if units.end == self.elements {
            (r.survey.end_pass(pass)).map_err(|e| self.named(e))?;
            r.pass += 1;
            r.next = 0;
            if r.pass == self.survey_passes() {
                let done = running.take().expect("a running survey").survey;
                *self.surveyed.done.lock().unwrap() = Some(Arc::from(done));
                self.surveyed.merged.store(0, Ordering::Relaxed);
            }
        }
        Ok(())
    }
    fn scratch_unit_bytes(&self) -> u64 {
        match self.formula {
            // Every input and the result as f32.
            Formula::Whole(_) => 4 * (self.in_dtypes.len() as u64 + 1),
            _ => 0,
        }
    }
    fn input_ranges(&self, units: Range<u64>) -> Vec<Range<u64>> {
        self.in_dtypes
            .iter()
            .map(|d| {
                let s = d.size().map_or(4, |s| s as u64);
                units.start * s..units.end * s
            })
            .collect()
    }
    fn compute(&self, units: Range<u64>, inputs: &[&[u8]], out: &mut [u8]) -> Result<(), String> {
        let Formula::Whole(w) = &self.formula else {
            self.compute_elementwise(units, inputs, out);
            return Ok(());
        };
        if units != (0..self.elements) {
            return self.compute_surveyed(units, inputs, out);
        }
        let n = (units.end - units.start) as usize;
        let values = self.decode(inputs, n);
        let (base, values) = self.split(&values);
        let tensors: Vec<ModelTensor> = values
            .iter()
            .zip(w.non_base())
            .map(|(v, params)| ModelTensor { values: v, params })
            .collect();
        let t = methods::Inputs {
            base,
            models: &tensors,
            global: &w.global,
            shape: &w.shape,
            seed: w.seed,
        };
        let mut merged = vec![0f32; n];
        (w.f)(&t, &mut merged).map_err(|e| self.named(e))?;
        write_as(self.dst, canonical_nans(&merged), out);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_rounding_from_f64_to_bf16_is_the_nearest() {
        // Halfway between two bf16 values plus a hair: f32 first would round to the tie and
        // then to even; once from f64 gives the upper neighbour.
        let lo = 1.0f64;
        let ulp = 2f64.powi(-7);
        let x = lo + ulp / 2.0 + 2f64.powi(-40);
        let mut out = [0u8; 2];
        store_f64(DType::BF16, &mut out, 0, x);
        assert_eq!(u16::from_le_bytes(out), f32_to_bf16((lo + ulp) as f32));
        assert_eq!(round_to(DType::BF16, x), lo + ulp);
    }

    /// A stand-in whole-tensor method: base plus the first model's values times its weight,
    /// plus the seed's parity, checking what the engine hands over.
    fn toy(t: &methods::Inputs, out: &mut [f32]) -> Result<(), String> {
        assert_eq!(t.shape, [2, 2]);
        assert_eq!(t.global.get("lambda", 0.0), 2.0);
        let w = t.models[0].params.get("weight", 0.0) as f32;
        for (i, o) in out.iter_mut().enumerate() {
            *o = t.base[i] + w * t.models[0].values[i] + (t.seed % 2) as f32;
        }
        Ok(())
    }

    #[test]
    fn whole_tensor_methods_get_the_base_apart_and_round_once_to_the_output() {
        let op = MergeOp {
            method: "toy",
            formula: Formula::Whole(Whole {
                f: toy,
                global: Params::default().with("lambda", 2.0),
                models: vec![Params::default(), Params::default().with("weight", 0.5)],
                has_base: true,
                shape: vec![2, 2],
                seed: 3,
                names: vec!["b".into()],
                survey: None,
            }),
            in_dtypes: vec![DType::F32, DType::BF16],
            compute_dtype: None,
            elements: 4,
            dst: DType::BF16,
            surveyed: SurveyCell::default(),
        };
        assert_eq!(op.granularity(), 4);
        let base: Vec<u8> = [1.0f32, 2.0, 3.0, 1.0 + 2f32.powi(-10)]
            .iter()
            .flat_map(|x| x.to_le_bytes())
            .collect();
        let model: Vec<u8> = [2.0f32, 4.0, -2.0, 0.0]
            .iter()
            .flat_map(|x| f32_to_bf16(*x).to_le_bytes())
            .collect();
        let mut out = [0u8; 8];
        op.compute(0..4, &[&base, &model], &mut out).unwrap();
        let got: Vec<f32> = out
            .chunks_exact(2)
            .map(|c| bf16_to_f32(u16::from_le_bytes([c[0], c[1]])))
            .collect();
        assert_eq!(got, [3.0, 5.0, 3.0, 2.0]);
    }

    /// A TIES merge of 8 f32 elements whose tensor streams, surveyed in 4-element chunks.
    fn streamed_ties() -> MergeOp {
        use super::super::methods::{sparse, sparse_stream};
        let weighted = Params::default().with("weight", 1.0).with("density", 0.5);
        let (models, global) = (vec![Params::default(), weighted], Params::default());
        let make: SurveyFn = sparse_stream::survey::<0>;
        let mut whole = Whole {
            f: sparse::whole::<0>,
            global,
            models,
            has_base: true,
            shape: vec![8],
            seed: 0,
            names: vec!["m".into()],
            survey: None,
        };
        let passes = make(&whole.setting()).unwrap().passes();
        whole.survey = Some((make, passes, 1));
        MergeOp {
            method: "ties",
            formula: Formula::Whole(whole),
            in_dtypes: vec![DType::F32, DType::F32],
            compute_dtype: None,
            elements: 8,
            dst: DType::F32,
            surveyed: SurveyCell::default(),
        }
    }

    #[test]
    fn chunks_merge_from_their_survey_and_the_survey_is_dropped_after_the_last() {
        let bytes = |v: &[f32]| v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
        let base = bytes(&[0.0; 8]);
        let model = bytes(&[1.0, -5.0, 2.0, 7.0, -3.0, 0.5, 6.0, -4.0]);
        let op = streamed_ties();
        let mut whole = [0u8; 32];
        op.compute(0..8, &[&base, &model], &mut whole).unwrap();
        for pass in 0..op.survey_passes() {
            for at in [0usize, 16] {
                let (b, m) = (&base[at..at + 16], &model[at..at + 16]);
                op.survey(pass, at as u64 / 4..at as u64 / 4 + 4, &[b, m])
                    .unwrap();
            }
        }
        let mut chunked = [0u8; 32];
        for at in [16usize, 0] {
            let (b, m) = (&base[at..at + 16], &model[at..at + 16]);
            op.compute(
                at as u64 / 4..at as u64 / 4 + 4,
                &[b, m],
                &mut chunked[at..at + 16],
            )
            .unwrap();
        }
        assert_eq!(chunked, whole);
        assert!(op.surveyed.done.lock().unwrap().is_none());
    }

    #[test]
    fn a_chunk_before_its_survey_or_a_survey_out_of_order_is_an_internal_error() {
        let op = streamed_ties();
        let zeros = [0u8; 16];
        let mut out = [0u8; 16];
        assert_eq!(
            op.compute(0..4, &[&zeros, &zeros], &mut out).unwrap_err(),
            "internal error: a chunk of `ties` was merged before the tensor's survey ended"
        );
        assert_eq!(
            op.survey(0, 4..8, &[&zeros, &zeros]).unwrap_err(),
            "internal error: `ties` surveyed units 4..8 of pass 0 out of order"
        );
    }

    #[test]
    fn inputs_are_rounded_to_the_compute_dtype_only_where_it_changes_them() {
        let mut op = MergeOp {
            method: "linear",
            formula: Formula::Linear {
                weights: vec![1.0],
                denominator: 1.0,
            },
            in_dtypes: vec![DType::F32],
            compute_dtype: Some(DType::BF16),
            elements: 1,
            dst: DType::F32,
            surveyed: SurveyCell::default(),
        };
        assert_eq!(op.rounding(DType::F32), Some(DType::BF16));
        assert_eq!(op.rounding(DType::F16), Some(DType::BF16));
        assert_eq!(op.rounding(DType::BF16), None);
        op.compute_dtype = Some(DType::F32);
        assert_eq!(op.rounding(DType::BF16), None);
        assert_eq!(op.rounding(DType::F64), Some(DType::F32));
        op.compute_dtype = Some(DType::F16);
        assert_eq!(op.rounding(DType::BF16), Some(DType::F16));
        // Rounding where it is needed: 1 + 2^-10 is no bf16.
        let x = (1.0f32 + 2f32.powi(-10)).to_le_bytes();
        op.compute_dtype = Some(DType::BF16);
        let mut out = [0u8; 4];
        op.compute(0..1, &[&x], &mut out).unwrap();
        assert_eq!(f32::from_le_bytes(out), 1.0);
    }

    #[test]
    fn seeds_differ_per_tensor_and_per_seed() {
        assert_ne!(tensor_seed(0, "a"), tensor_seed(0, "b"));
        assert_ne!(tensor_seed(0, "a"), tensor_seed(1, "a"));
        assert_eq!(tensor_seed(7, "a"), tensor_seed(7, "a"));
    }
}
