//! FP8 dequantisation: `y = f32(w) · f32(s)` (or `/ s`), rounded once to the output dtype.
//!
//! Layouts:
//! - weight `F8_E4M3` or `F8_E5M2`, `[out, in]`, `[E, out, in]` (experts) or `[n]`;
//! - scale `F32`, `BF16`, `F16` or `F8_E8M0` (`2^(e-127)`), named `X.weight_scale_inv`
//!   (multiply; DeepSeek-V3), `X.weight_scale` (multiply, compressed-tensors; `--scale-mode
//!   divide` for the old Python tool's convention) or `X.scale` (DeepSeek-V4), in any shard;
//! - scale shapes: a block grid `[ceil(out/br), ceil(in/bc)]` with ragged edge blocks,
//!   per-tensor `[]`/`[1]`, per-row `[out]`/`[out, 1]`, each optionally led by `E` for experts.
//!
//! The element for weight row `r` (rows of all experts counted together) and column `j` takes
//! scale `s[e·stride + (r mod out)/br · gc + j/bc]`, `e = r / out`. Any run of rows can be
//! computed alone, so chunking never changes a byte.

pub mod codec;
pub use crate::plan::kernel::fp8 as kernel;

use std::ops::Range;
use std::sync::Arc;

use serde_json::{Map, Value};

use crate::error::{Error, Result, ScaleOf};
use crate::format::checkpoint::Checkpoint;
use crate::format::dtype::DType;
use crate::ops::cast::{f32_to_bf16, f32_to_f16, store_f32};
use crate::ops::kernel::{kernel_dtype, Kernel, KERNEL_DTYPE_NONE};
use crate::ops::Op;
use crate::plan::{
    edit_config_dtype, index_by_name, DeferredDst, Derive, Entry, PlanStep, Planning,
};
use codec::{e4m3_is_nan, e4m3_table, e5m2_is_nonfinite, e5m2_table, e8m0_to_f32};
use kernel::DequantParams;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ScaleMode {
    Multiply,
    Divide,
}

#[derive(Clone, Debug)]
pub struct DequantOptions {
    pub dtype: DType,
    /// `--block-size`, rows × columns.
    pub block: Option<(u64, u64)>,
    /// How `X.weight_scale` applies (`weight_scale_inv` and `.scale` always multiply).
    pub weight_scale_mode: ScaleMode,
    pub allow_unscaled: bool,
    pub allow_nonfinite: bool,
}

/// Where each weight element finds its scale.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ScaleLayout {
    /// Experts (1 for a plain matrix), rows per expert (`out`), columns (`in`).
    pub experts: u64,
    pub rows: u64,
    pub cols: u64,
    /// Scale elements per expert; 0 when one scale serves the whole tensor.
    pub expert_stride: u64,
    pub grid_cols: u64,
    pub block_rows: u64,
    pub block_cols: u64,
}

impl ScaleLayout {
    fn row_start(&self, r: u64) -> u64 {
        let (e, lr) = (r / self.rows, r % self.rows);
        e * self.expert_stride + lr / self.block_rows * self.grid_cols
    }

    pub fn describe(&self) -> String {
        let all_cols = self.block_cols >= self.cols;
        if self.block_rows >= self.rows && all_cols {
            if self.expert_stride == 0 {
                "per-tensor scale".into()
            } else {
                "one scale per expert".into()
            }
        } else if self.block_rows == 1 && all_cols {
            "per-row scales".into()
        } else {
            format!("{}x{} blocks", self.block_rows, self.block_cols)
        }
    }
}

/// Parses `--block-size R[xC]`.
pub fn parse_block_size(s: &str) -> Result<(u64, u64)> {
    let bad = || {
        Error::Usage(format!(
            "invalid --block-size `{s}`: use R or RxC, e.g. 128 or 128x128"
        ))
    };
    let (r, c) = match s.split_once(['x', 'X']) {
        Some((r, c)) => (
            r.trim().parse().map_err(|_| bad())?,
            c.trim().parse().map_err(|_| bad())?,
        ),
        None => {
            let v: u64 = s.trim().parse().map_err(|_| bad())?;
            (v, v)
        }
    };
    if r == 0 || c == 0 {
        return Err(bad());
    }
    Ok((r, c))
}

/// Block size from `config.json`: `quantization_config.weight_block_size`, or the
/// compressed-tensors `config_groups.*.weights.block_structure`. A block with a zero side is an
/// error naming the key.
pub fn config_block_size(cfg: &Map<String, Value>) -> Result<Option<(u64, u64)>, String> {
    let Some(q) = cfg.get("quantization_config") else {
        return Ok(None);
    };
    let pair = |v: &Value| -> Option<(u64, u64)> {
        let a = v.as_array()?;
        Some((a.first()?.as_u64()?, a.get(1)?.as_u64()?))
    };
    let found = match q.get("weight_block_size").and_then(pair) {
        Some(b) => Some(("quantization_config.weight_block_size", b)),
        None => q
            .get("config_groups")
            .and_then(Value::as_object)
            .and_then(|groups| {
                groups
                    .values()
                    .find_map(|g| g.get("weights")?.get("block_structure").and_then(pair))
            })
            .map(|b| {
                (
                    "quantization_config.config_groups.*.weights.block_structure",
                    b,
                )
            }),
    };
    match found {
        Some((key, (r, c))) if r == 0 || c == 0 => Err(format!(
            "`{key}` is [{r}, {c}]: a block side cannot be 0; fix config.json or pass --block-size RxC"
        )),
        Some((_, b)) => Ok(Some(b)),
        None => Ok(None),
    }
}

fn smallest_pow2_block(dim: u64, grid: u64) -> Option<u64> {
    (0..48)
        .map(|k| 1u64 << k)
        .find(|&p| dim.div_ceil(p) == grid)
}

/// Binds a scale tensor's shape to a weight's. Returns the layout and whether the block size
/// was inferred from the shapes.
pub fn resolve_layout(
    weight: &[u64],
    scale: &[u64],
    block: Option<(u64, u64)>,
) -> Result<(ScaleLayout, bool), String> {
    let (experts, rows, cols) = match *weight {
        [n] => (1, 1, n),
        [o, i] => (1, o, i),
        [e, o, i] => (e, o, i),
        _ => {
            return Err(format!(
                "FP8 weights of rank {} are not supported",
                weight.len()
            ))
        }
    };
    let numel: u64 = scale.iter().product();
    let whole = ScaleLayout {
        experts,
        rows,
        cols,
        expert_stride: 0,
        grid_cols: 1,
        block_rows: rows.max(1),
        block_cols: cols.max(1),
    };
    if numel == 1 {
        return Ok((whole, false));
    }
    let (grid_rows, grid_cols) = match (weight.len(), scale) {
        (3, [e]) | (3, [e, 1]) | (3, [e, 1, 1]) if *e == experts => {
            return Ok((
                ScaleLayout {
                    expert_stride: 1,
                    ..whole
                },
                false,
            ))
        }
        (3, [e, a]) if *e == experts => (*a, 1),
        (3, [e, a, b]) if *e == experts => (*a, *b),
        (1 | 2, [a]) => (*a, 1),
        (1 | 2, [a, b]) => (*a, *b),
        // ModelOpt's 2-D block scales keep the reduced axes: [R, 1, C, 1], the same bytes.
        (2, [a, 1, b, 1]) => (*a, *b),
        _ => {
            return Err(format!(
                "shape {scale:?} does not fit weight {weight:?} (expected a block grid, [], [1] or per-row scales{})",
                if weight.len() == 3 { ", each led by the expert count" } else { "" }
            ))
        }
    };
    let stride = if weight.len() == 3 {
        grid_rows * grid_cols
    } else {
        0
    };
    let fits = |br: u64, bc: u64| rows.div_ceil(br) == grid_rows && cols.div_ceil(bc) == grid_cols;
    let layout = |br: u64, bc: u64| ScaleLayout {
        experts,
        rows,
        cols,
        expert_stride: stride,
        grid_cols,
        block_rows: br,
        block_cols: bc,
    };
    if let Some((br, bc)) = block {
        if fits(br, bc) {
            return Ok((layout(br, bc), false));
        }
        if grid_rows == rows && grid_cols == 1 {
            return Ok((layout(1, cols.max(1)), false));
        }
        return Err(format!(
            "shape {scale:?} does not fit weight {weight:?} with {br}x{bc} blocks (expected [{}, {}])",
            rows.div_ceil(br),
            cols.div_ceil(bc)
        ));
    }
    match (smallest_pow2_block(rows, grid_rows), smallest_pow2_block(cols, grid_cols)) {
        (Some(br), Some(bc)) => Ok((layout(br, bc), true)),
        _ => Err(format!(
            "cannot infer the block size from weight {weight:?} and scale {scale:?}; pass --block-size RxC"
        )),
    }
}

#[derive(Debug)]
pub struct DequantFp8Step {
    pub opts: DequantOptions,
}

/// Scale names tried for weight `w`, with how each applies (also what `validate` looks for).
pub fn scale_candidates(w: &str, weight_scale_mode: ScaleMode) -> Vec<(String, ScaleMode)> {
    let mut v = vec![
        (format!("{w}_scale_inv"), ScaleMode::Multiply),
        (format!("{w}_scale"), weight_scale_mode),
    ];
    if let Some(base) = w.strip_suffix(".weight") {
        v.push((format!("{base}.scale"), ScaleMode::Multiply));
    }
    v
}

fn is_scale_dtype(d: DType) -> bool {
    matches!(d, DType::F32 | DType::BF16 | DType::F16 | DType::F8_E8M0)
}

impl PlanStep for DequantFp8Step {
    fn apply(&self, p: Planning) -> Result<bool> {
        let (ckpt, config, entries, notes) = (p.ckpt, p.config, p.entries, p.notes);
        // A broken config value is an error unless --block-size replaces it.
        let from_config = match config.map(config_block_size).transpose() {
            Ok(b) => b.flatten(),
            Err(_) if self.opts.block.is_some() => None,
            Err(msg) => {
                return Err(Error::InvalidConfig {
                    path: ckpt.dir.join("config.json"),
                    msg,
                })
            }
        };
        let block = match (from_config, self.opts.block) {
            (Some(c), Some(b)) if c != b => {
                return Err(Error::Usage(format!(
                    "--block-size {}x{} disagrees with config.json's weight_block_size {}x{}",
                    b.0, b.1, c.0, c.1
                )))
            }
            (c, b) => c.or(b),
        };
        let index = index_by_name(entries);
        let mut consumed = vec![false; entries.len()];
        let mut derived: Vec<(usize, Arc<dyn Derive>)> = Vec::new();
        let mut missing: Vec<(usize, String)> = Vec::new();
        for (wi, w) in entries.iter().enumerate() {
            if w.derive.is_some() || !matches!(w.dtype, DType::F8_E4M3 | DType::F8_E5M2) {
                continue;
            }
            let candidates = scale_candidates(&w.name, self.opts.weight_scale_mode);
            let found = candidates.iter().find_map(|(name, mode)| {
                index
                    .get(name)
                    .filter(|&&si| entries[si].derive.is_none())
                    .map(|&si| (si, *mode))
            });
            let Some((si, mode)) = found else {
                if self.opts.allow_unscaled {
                    derived.push((wi, unscaled_derive(w, ckpt, &self.opts)));
                } else {
                    let looked: Vec<String> =
                        candidates.iter().map(|(n, _)| format!("`{n}`")).collect();
                    missing.push((wi, looked.join(", ")));
                }
                continue;
            };
            let s = &entries[si];
            let bad = |msg: String| s.bad_scale(ckpt, &w.name, msg);
            if !is_scale_dtype(s.dtype) {
                return Err(bad(format!(
                    "dtype {} is not a scale dtype (F32, BF16, F16, F8_E8M0)",
                    s.dtype
                )));
            }
            let (layout, inferred) = resolve_layout(&w.shape, &s.shape, block).map_err(bad)?;
            if inferred {
                notes.lines.push(format!(
                    "`{}`: inferred {} from weight {:?} and scale {:?}",
                    w.name,
                    layout.describe(),
                    w.shape,
                    s.shape
                ));
            }
            consumed[si] = true;
            derived.push((
                wi,
                dequant_derive(
                    w,
                    ckpt,
                    Some((s.source, s.dtype)),
                    layout,
                    mode,
                    self.opts.allow_nonfinite,
                ),
            ));
        }
        if let Some((wi, looked)) = missing.first() {
            let more = match missing.len() {
                1 => String::new(),
                n => format!(" (and {} more weights)", n - 1),
            };
            return Err(Error::MissingScale {
                path: entries[*wi].path(ckpt),
                of: ScaleOf::Fp8Weight,
                tensor: entries[*wi].name.clone(),
                looked: looked.clone(),
                more,
            });
        }
        for (i, e) in entries.iter().enumerate() {
            if consumed[i] || e.derive.is_some() {
                continue;
            }
            let weight = if let Some(w) = e.name.strip_suffix("_scale_inv") {
                Some(w.to_string())
            } else if let Some(w) = e
                .name
                .strip_suffix("_scale")
                .filter(|w| w.ends_with(".weight"))
            {
                Some(w.to_string()).filter(|w| !index.contains_key(w))
            } else if let Some(b) = e
                .name
                .strip_suffix(".scale")
                .filter(|_| e.dtype == DType::F8_E8M0)
            {
                Some(format!("{b}.weight")).filter(|w| !index.contains_key(w))
            } else {
                None
            };
            if let Some(weight) = weight {
                return Err(Error::OrphanScale {
                    path: e.path(ckpt),
                    tensor: e.name.clone(),
                    weight,
                });
            }
        }
        let changed = !derived.is_empty();
        for (wi, d) in derived {
            entries[wi].dtype = self.opts.dtype;
            entries[wi].derive = Some(d);
        }
        let mut i = 0;
        entries.retain(|_| {
            i += 1;
            !consumed[i - 1]
        });
        Ok(changed)
    }

    fn nothing_done(&self) -> String {
        "dequant-fp8 found no F8_E4M3 or F8_E5M2 tensor, so there is nothing to dequantise".into()
    }

    fn edit_config(&self, cfg: &mut Map<String, Value>) -> Vec<String> {
        let mut changes = Vec::new();
        if cfg.shift_remove("quantization_config").is_some() {
            changes.push("config.json: quantization_config removed".to_string());
        }
        changes.extend(edit_config_dtype(cfg, self.opts.dtype));
        changes
    }
}

/// The FP8 op reading `weight`, scaled by `scale` (the tensor and the dtype its bytes are read
/// as) when there is one.
fn dequant_derive(
    weight: &Entry,
    ckpt: &Checkpoint,
    scale: Option<(usize, DType)>,
    layout: ScaleLayout,
    mode: ScaleMode,
    allow_nonfinite: bool,
) -> Arc<dyn Derive> {
    Arc::new(DeferredDst {
        inputs: std::iter::once(weight.source)
            .chain(scale.map(|(s, _)| s))
            .collect(),
        op: DequantFp8 {
            weight_dtype: ckpt.tensors[weight.source].info.dtype,
            scale_dtype: scale.map(|(_, d)| d),
            layout,
            mode,
            // set by `build`
            dst: DType::F32,
            allow_nonfinite,
        },
    })
}

/// The FP8 op for a weight without a scale (`--allow-unscaled`): its values as they are.
fn unscaled_derive(w: &Entry, ckpt: &Checkpoint, opts: &DequantOptions) -> Arc<dyn Derive> {
    let (layout, _) = resolve_layout(&w.shape, &[], None)
        .or_else(|_| resolve_layout(&[w.shape.iter().product()], &[], None))
        .expect("a single scale fits any weight");
    dequant_derive(
        w,
        ckpt,
        None,
        layout,
        ScaleMode::Multiply,
        opts.allow_nonfinite,
    )
}

/// MXFP8 (compressed-tensors `mxfp8-quantized`): an FP8 weight `[out, in]` with E8M0 exponents
/// stored as `U8` `[out, in/group]`. The library decodes `e4m3 · 2^(u-127)`, rounded once: the
/// FP8 op with the scale bytes read as `F8_E8M0`.
pub fn mxfp8_derive(
    weight: &Entry,
    ckpt: &Checkpoint,
    scale: &Entry,
    group: u64,
    allow_nonfinite: bool,
) -> std::result::Result<Arc<dyn Derive>, String> {
    let (layout, _) = resolve_layout(&weight.shape, &scale.shape, Some((1, group)))?;
    let scale = Some((scale.source, DType::F8_E8M0));
    Ok(dequant_derive(
        weight,
        ckpt,
        scale,
        layout,
        ScaleMode::Multiply,
        allow_nonfinite,
    ))
}

/// The op: one unit is one weight row (rows of all experts counted together).
#[derive(Clone, Debug)]
pub struct DequantFp8 {
    pub weight_dtype: DType,
    pub scale_dtype: Option<DType>,
    pub layout: ScaleLayout,
    pub mode: ScaleMode,
    pub dst: DType,
    pub allow_nonfinite: bool,
}

impl DequantFp8 {
    fn scale_range(&self, rows: &Range<u64>) -> Range<u64> {
        if rows.is_empty() {
            return 0..0;
        }
        let lo = self.layout.row_start(rows.start);
        let hi = self.layout.row_start(rows.end - 1) + self.layout.grid_cols;
        lo..hi
    }

    /// The CUDA kernel's description of a chunk of rows (kernels/fp8.cuh).
    pub fn kernel_params(&self, units: &Range<u64>) -> DequantParams {
        let l = &self.layout;
        DequantParams {
            cols: l.cols,
            rows: l.rows,
            block_rows: l.block_rows,
            block_cols: l.block_cols,
            grid_cols: l.grid_cols,
            expert_stride: l.expert_stride,
            first_row: units.start,
            scale_base: if self.scale_dtype.is_some() {
                self.scale_range(units).start
            } else {
                0
            },
            scale_dtype: self.scale_dtype.map_or(KERNEL_DTYPE_NONE, kernel_dtype),
            dst: kernel_dtype(self.dst),
            e5m2: (self.weight_dtype == DType::F8_E5M2) as i32,
            divide: (self.mode == ScaleMode::Divide) as i32,
            allow_nonfinite: self.allow_nonfinite as i32,
            pad: 0,
        }
    }

    /// Element `j` of global row `r`, as the user indexes the weight.
    fn position(&self, r: u64, j: usize) -> String {
        let (e, lr) = (r / self.layout.rows, r % self.layout.rows);
        if self.layout.experts > 1 {
            format!("[{e}, {lr}, {j}]")
        } else {
            format!("[{lr}, {j}]")
        }
    }

    /// Whether finite codes under these scales can give a value the output dtype cannot hold
    /// (the exact check, [`first_nonfinite`], then runs on the row). Half the limit leaves room
    /// for rounding; a zero or subnormal divisor always qualifies (scales are finite here).
    fn may_overflow(&self, scales: &[f32]) -> bool {
        let largest_code = if self.weight_dtype == DType::F8_E5M2 {
            57344.0
        } else {
            448.0
        };
        let limit = if self.dst == DType::F16 {
            65504.0
        } else {
            f32::MAX
        };
        scales.iter().any(|&s| {
            let factor = match self.mode {
                ScaleMode::Multiply => s.abs(),
                ScaleMode::Divide => 1.0 / s.abs(),
            };
            factor >= limit / 2.0 / largest_code
        })
    }

    fn decode_scales(&self, bytes: &[u8]) -> Vec<f32> {
        match self.scale_dtype {
            None => vec![1.0],
            Some(DType::F32) => bytes
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
                .collect(),
            Some(DType::BF16) => bytes
                .chunks_exact(2)
                .map(|c| crate::ops::cast::bf16_to_f32(u16::from_le_bytes([c[0], c[1]])))
                .collect(),
            Some(DType::F16) => bytes
                .chunks_exact(2)
                .map(|c| crate::ops::cast::f16_to_f32(u16::from_le_bytes([c[0], c[1]])))
                .collect(),
            Some(DType::F8_E8M0) => bytes.iter().map(|&b| e8m0_to_f32(b)).collect(),
            Some(d) => unreachable!("{d} is not a scale dtype"),
        }
    }
}

/// E4M3/E5M2 → f32 without a table, so the loop vectorises. A normal code's exponent and
/// mantissa bits, moved into an f32's fields, need only the exponent bias added (an integer
/// add); a subnormal code is `m · 2^-9` (E4M3) or `m · 2^-16` (E5M2), an exact int→float
/// conversion and power-of-two multiply. Going through f32 subnormals instead would be just as
/// exact but triggers microcode assists on x86 (measured 2× slower). NaN/Inf codes are patched
/// afterwards by the caller.
#[inline(always)]
fn decode_fp8<const E5M2: bool>(c: u8) -> f32 {
    let c = c as u32;
    let m7 = c & 0x7F;
    let (shift, bias, sub_limit, sub_scale) = if E5M2 {
        (21, 112u32, 4u32, f32::from_bits((127 - 16) << 23))
    } else {
        (20, 120u32, 8u32, f32::from_bits((127 - 9) << 23))
    };
    let normal = f32::from_bits((m7 << shift) + (bias << 23));
    let subnormal = m7 as f32 * sub_scale;
    let magnitude = if m7 < sub_limit { subnormal } else { normal };
    f32::from_bits(magnitude.to_bits() | ((c & 0x80) << 24))
}

#[inline(always)]
fn fp8_special<const E5M2: bool>(c: u8) -> bool {
    if E5M2 {
        e5m2_is_nonfinite(c)
    } else {
        e4m3_is_nan(c)
    }
}

fn dequant_row<const DIVIDE: bool, const E5M2: bool>(
    dst: DType,
    codes: &[u8],
    scales: &[f32],
    block_cols: usize,
    specials: bool,
    out: &mut [u8],
) {
    let value = |c: u8, s: f32| {
        let w = decode_fp8::<E5M2>(c);
        if DIVIDE {
            w / s
        } else {
            w * s
        }
    };
    for (cb, block) in codes.chunks(block_cols).enumerate() {
        let s = scales[cb];
        let base = cb * block_cols;
        match dst {
            DType::BF16 => {
                let o = &mut out[2 * base..2 * (base + block.len())];
                for (o, &c) in o.chunks_exact_mut(2).zip(block) {
                    o.copy_from_slice(&f32_to_bf16(value(c, s)).to_le_bytes());
                }
            }
            DType::F16 => {
                let o = &mut out[2 * base..2 * (base + block.len())];
                for (o, &c) in o.chunks_exact_mut(2).zip(block) {
                    let b = f32_to_f16(value(c, s));
                    o[0] = b as u8;
                    o[1] = (b >> 8) as u8;
                }
            }
            _ => {
                let o = &mut out[4 * base..4 * (base + block.len())];
                for (o, &c) in o.chunks_exact_mut(4).zip(block) {
                    o.copy_from_slice(&value(c, s).to_le_bytes());
                }
            }
        }
        if specials {
            // Only reached with --allow-nonfinite: redo the special codes with the exact
            // decoder so NaN and Inf keep their meaning.
            let lut = if E5M2 { e5m2_table() } else { e4m3_table() };
            for (k, &c) in block
                .iter()
                .enumerate()
                .filter(|(_, &c)| fp8_special::<E5M2>(c))
            {
                let w = lut[c as usize];
                store_f32(dst, out, base + k, if DIVIDE { w / s } else { w * s });
            }
        }
    }
}

/// The first element of `out` (encoded as `dst`) that is infinite or NaN.
fn first_nonfinite(dst: DType, out: &[u8]) -> Option<usize> {
    match dst {
        DType::F32 => out
            .chunks_exact(4)
            .position(|o| !f32::from_le_bytes(o.try_into().unwrap()).is_finite()),
        DType::F16 => out
            .chunks_exact(2)
            .position(|o| u16::from_le_bytes([o[0], o[1]]) & 0x7C00 == 0x7C00),
        _ => out
            .chunks_exact(2)
            .position(|o| u16::from_le_bytes([o[0], o[1]]) & 0x7F80 == 0x7F80),
    }
}

/// NaN results (kept with --allow-nonfinite) as one positive quiet NaN per dtype, whatever NaN
/// the hardware produced (x86, Arm and GPUs differ in sign and payload), so output bytes do not
/// depend on the device.
fn canonical_nans(dst: DType, out: &mut [u8]) {
    match dst {
        DType::F32 => out.chunks_exact_mut(4).for_each(|o| {
            if f32::from_le_bytes(o.try_into().unwrap()).is_nan() {
                o.copy_from_slice(&0x7FC0_0000u32.to_le_bytes());
            }
        }),
        DType::F16 => out.chunks_exact_mut(2).for_each(|o| {
            if u16::from_le_bytes([o[0], o[1]]) & 0x7FFF > 0x7C00 {
                o.copy_from_slice(&0x7E00u16.to_le_bytes());
            }
        }),
        _ => {} // BF16 rounding already gives 0x7FC0
    }
}

impl Op for DequantFp8 {
    fn kernel(&self, units: &Range<u64>) -> Option<Kernel> {
        Some(Kernel::DequantFp8(self.kernel_params(units)))
    }
    fn name(&self) -> &'static str {
        "dequant-fp8"
    }
    fn units(&self) -> u64 {
        self.layout.experts * self.layout.rows
    }
    fn out_unit_bytes(&self) -> u64 {
        self.layout.cols * (self.dst.bits() / 8)
    }
    fn in_unit_bytes(&self) -> u64 {
        self.layout.cols + 4 * self.layout.grid_cols
    }
    fn granularity(&self) -> u64 {
        if self.layout.block_rows <= 1024 {
            self.layout.block_rows
        } else {
            1
        }
    }
    fn input_ranges(&self, units: Range<u64>) -> Vec<Range<u64>> {
        let mut v = Vec::with_capacity(2);
        v.push(units.start * self.layout.cols..units.end * self.layout.cols);
        if let Some(d) = self.scale_dtype {
            let size = d.bits() / 8;
            let r = self.scale_range(&units);
            v.push(r.start * size..r.end * size);
        }
        v
    }
    fn compute(&self, units: Range<u64>, inputs: &[&[u8]], out: &mut [u8]) -> Result<(), String> {
        let cols = self.layout.cols as usize;
        let scales = self.decode_scales(inputs.get(1).copied().unwrap_or(&[]));
        if !self.allow_nonfinite {
            if let Some(k) = scales.iter().position(|s| !s.is_finite()) {
                let at = self.scale_range(&units).start + k as u64;
                return Err(format!("scale element {at} is not finite ({})", scales[k]));
            }
        }
        let e5m2 = self.weight_dtype == DType::F8_E5M2;
        let scale_base = if self.scale_dtype.is_some() {
            self.scale_range(&units).start
        } else {
            0
        };
        let out_row = cols * (self.dst.bits() / 8) as usize;
        let bc = self.layout.block_cols as usize;
        for (k, r) in units.clone().enumerate() {
            let codes = &inputs[0][k * cols..(k + 1) * cols];
            let specials = if e5m2 {
                codes
                    .iter()
                    .fold(false, |acc, &c| acc | e5m2_is_nonfinite(c))
            } else {
                codes.iter().fold(false, |acc, &c| acc | e4m3_is_nan(c))
            };
            if specials && !self.allow_nonfinite {
                let bad = codes.iter().position(|&c| {
                    if e5m2 {
                        e5m2_is_nonfinite(c)
                    } else {
                        e4m3_is_nan(c)
                    }
                });
                if let Some(j) = bad {
                    let pos = self.position(r, j);
                    return Err(format!(
                        "non-finite {} code {:#04x} at {pos}; pass --allow-nonfinite to keep it as NaN",
                        self.weight_dtype, codes[j]
                    ));
                }
            }
            let srow = if self.scale_dtype.is_some() {
                (self.layout.row_start(r) - scale_base) as usize
            } else {
                0
            };
            let row_scales = &scales[srow..srow + self.layout.grid_cols as usize];
            let o = &mut out[k * out_row..(k + 1) * out_row];
            match (self.mode, e5m2) {
                (ScaleMode::Multiply, false) => {
                    dequant_row::<false, false>(self.dst, codes, row_scales, bc, specials, o)
                }
                (ScaleMode::Multiply, true) => {
                    dequant_row::<false, true>(self.dst, codes, row_scales, bc, specials, o)
                }
                (ScaleMode::Divide, false) => {
                    dequant_row::<true, false>(self.dst, codes, row_scales, bc, specials, o)
                }
                (ScaleMode::Divide, true) => {
                    dequant_row::<true, true>(self.dst, codes, row_scales, bc, specials, o)
                }
            }
            if !self.allow_nonfinite && self.may_overflow(row_scales) {
                if let Some(j) = first_nonfinite(self.dst, o) {
                    let s = row_scales[j / bc];
                    let w = if e5m2 { e5m2_table() } else { e4m3_table() }[codes[j] as usize];
                    let (verb, why) = match self.mode {
                        ScaleMode::Divide if s == 0.0 => ("divided by", "is a division by zero"),
                        ScaleMode::Divide => ("divided by", "overflows"),
                        ScaleMode::Multiply => ("times", "overflows"),
                    };
                    let into = if why == "overflows" {
                        format!(" {}", self.dst)
                    } else {
                        String::new()
                    };
                    return Err(format!(
                        "result at {} is not finite: code {:#04x} ({w}) {verb} scale {s:?} {why}{into}; pass --allow-nonfinite to keep it",
                        self.position(r, j),
                        codes[j]
                    ));
                }
            }
            // Only these can make NaN: a kept non-finite value, or 0/0 when dividing.
            if self.allow_nonfinite || self.mode == ScaleMode::Divide {
                canonical_nans(self.dst, o);
            }
        }
        Ok(())
    }
}

crate::plan::set_dst_field!(DequantFp8);

#[cfg(test)]
mod tests;
