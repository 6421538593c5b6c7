//! The LoRA/DoRA merge op: `W' = W + s · (B @ A)` (or `(B @ A)ᵀ` for GPT-2 Conv1D weights and
//! embeddings), and for DoRA `W' = (m / ‖W + s·B@A‖₂ per output row) · (W + s·B@A)`, computed
//! in f32 and rounded once to the output dtype — PEFT's own order of operations, so a bf16 base
//! matches PEFT's merge bit for bit and f32 within rounding of the matrix product.
//!
//! Layouts: `A` `[r, in]`, `B` `[out, r]`, `W` `[out, in]`; transposed: `W` `[in, out]`
//! (Conv1D) or `[num, dim]` with `A` `[r, num]`, `B` `[dim, r]` (embeddings). One unit is one row
//! of `W`; a chunk of rows needs its rows of `B` (or columns of `A`) and the whole other factor,
//! which is small (`r` rows). The product is summed in a fixed order ([`delta_rows`]) shared with
//! the CUDA kernel, so a merge gives the same bytes on every device.

use std::ops::Range;
use std::sync::Arc;

use super::kernel::{BaseDequant, DeltaParams, LoraLaunch};
use crate::format::dtype::DType;
use crate::ops::cast::{
    bf16_to_f32, decode_into, f16_to_f32, f32_to_bf16, f32_to_f16, to_f32, write_as,
};
use crate::ops::kernel::{kernel_dtype, Kernel};
use crate::ops::Op;

#[derive(Debug, Clone)]
pub struct LoraFactors {
    pub rank: u64,
    pub a_dtype: DType,
    pub b_dtype: DType,
    pub m_dtype: Option<DType>,
    pub scale: f32,
    pub transposed: bool,
    /// PEFT's ParamWrapper (`target_parameters`) casts `s·Δ` to the parameter's dtype before
    /// adding it: `Some(BF16 | F16)` rounds it there first, as PEFT does — two roundings where
    /// an `nn.Linear` merge has one, and results that differ by many ulps where `W + s·Δ`
    /// cancels. `ops::lora::wrapper_rounding` says when.
    pub delta_dtype: Option<DType>,
}

/// `s·Δ` as PEFT's ParamWrapper adds it: rounded to `dtype` (see [`LoraFactors::delta_dtype`]).
fn round_delta(dtype: Option<DType>, delta: f32, s: f32) -> f32 {
    let d = delta * s;
    match dtype {
        Some(DType::BF16) => bf16_to_f32(f32_to_bf16(d)),
        Some(DType::F16) => f16_to_f32(f32_to_f16(d)),
        _ => d,
    }
}

/// The block of grouped expert factors (PEFT `target_parameters`: A `[E·r, in]` expert-outer,
/// B `[out, E·r]` expert-inner, see [`GroupedLoraMerge`]) that a plain merge reads: expert
/// `index` of `experts`, output rows from `first_row` on. It merges a fused expert parameter
/// into a base stored per expert (`gate_proj` is the first rows of `gate_up_proj`'s delta,
/// `up_proj` the rest), reading A's `r` rows of the expert and B's column `k·E + index` in
/// place. [`ExpertSlice::WHOLE`] is an ordinary LoRA pair.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ExpertSlice {
    pub experts: u64,
    pub index: u64,
    pub first_row: u64,
}

impl ExpertSlice {
    pub const WHOLE: ExpertSlice = ExpertSlice {
        experts: 1,
        index: 0,
        first_row: 0,
    };
}

#[derive(Debug)]
pub struct LoraMerge {
    pub rows: u64,
    pub cols: u64,
    /// Which block of the factors to read; not [`ExpertSlice::WHOLE`] only untransposed
    /// without DoRA.
    pub expert: ExpertSlice,
    /// Produces the base rows as f32 when the base is itself computed (FP8 dequantisation);
    /// `None` reads the base tensor directly in `base_dtype`.
    pub base_op: Option<Arc<dyn Op>>,
    pub base_inputs: usize,
    pub base_dtype: DType,
    pub f: LoraFactors,
    pub dst: DType,
}

/// Input ranges of the base rows: the computing op's (FP8 dequantisation), or the stored rows.
fn base_input_ranges(
    op: &Option<Arc<dyn Op>>,
    dtype: DType,
    row_elems: u64,
    units: &Range<u64>,
) -> Vec<Range<u64>> {
    match op {
        Some(op) => op.input_ranges(units.clone()),
        None => {
            let rb = row_elems * size(dtype);
            std::iter::once(units.start * rb..units.end * rb).collect()
        }
    }
}

/// Base rows produced by a computing op (built for F32 output).
fn computed_rows(
    op: &dyn Op,
    units: &Range<u64>,
    inputs: &[&[u8]],
    elems: usize,
) -> Result<Vec<f32>, String> {
    let mut bytes = vec![0u8; elems * 4];
    op.compute(units.clone(), inputs, &mut bytes)?;
    Ok(bytes
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
        .collect())
}

fn size(d: DType) -> u64 {
    d.bits() / 8
}

/// Whether a computed base can be produced on the GPU too (FP8 or FP4 dequantisation to f32).
fn base_on_gpu(base_op: &Option<Arc<dyn Op>>) -> bool {
    let f32 = kernel_dtype(DType::F32);
    match base_op.as_ref().map(|op| op.kernel(&(0..0))) {
        None => true,
        Some(Some(Kernel::DequantFp8(p))) => p.dst == f32,
        Some(Some(Kernel::DequantFp4(p))) => p.dst == f32,
        Some(_) => false,
    }
}

/// The kernel launch shared by both merges for chunk `units`; `delta` holds Δ's operand
/// layout.
#[allow(clippy::too_many_arguments)]
fn lora_launch(
    units: &Range<u64>,
    base_op: &Option<Arc<dyn Op>>,
    base_inputs: usize,
    base_dtype: DType,
    f: &LoraFactors,
    dst: DType,
    delta: DeltaParams,
    coef_is_a: bool,
) -> LoraLaunch {
    // The GPU runs a merge only over a stored, FP8 or FP4 base (`base_on_gpu`); the CPU reads only
    // the operand layout of this launch, so another computed base (a cast step's rounding)
    // leaves `base_dequant` empty rather than failing.
    let base_dequant = base_op.as_ref().and_then(|op| match op.kernel(units) {
        Some(Kernel::DequantFp8(p)) => Some(BaseDequant::Fp8(p)),
        Some(Kernel::DequantFp4(p)) => Some(BaseDequant::Fp4(p)),
        _ => None,
    });
    LoraLaunch {
        base_inputs,
        base_dequant,
        base_dtype,
        a_dtype: f.a_dtype,
        b_dtype: f.b_dtype,
        m_dtype: f.m_dtype,
        scale: f.scale,
        dst,
        delta,
        coef_is_a,
    }
}

/// [`LoraLaunchOf::parts`] of a merge whose fields carry the names both merges give them.
macro_rules! lora_launch_parts {
    () => {
        fn parts(&self) -> (&Option<Arc<dyn Op>>, usize, DType, &LoraFactors, DType) {
            (
                &self.base_op,
                self.base_inputs,
                self.base_dtype,
                &self.f,
                self.dst,
            )
        }
    };
}

/// The [`Op`] methods the two merges share: the kernel ([`LoraLaunchOf::lora_kernel`]) and
/// the base op's granularity.
macro_rules! lora_op_shared {
    () => {
        fn kernel(&self, units: &Range<u64>) -> Option<Kernel> {
            self.lora_kernel(units)
        }
        fn granularity(&self) -> u64 {
            self.base_op.as_ref().map_or(1, |op| op.granularity())
        }
    };
}

/// What the two merges share around their kernel launch: the base, the factors and the output
/// dtype; each gives Δ's operand layout for a chunk.
trait LoraLaunchOf {
    /// The base op, its input count and dtype, the factors and the output dtype.
    fn parts(&self) -> (&Option<Arc<dyn Op>>, usize, DType, &LoraFactors, DType);

    /// Δ's operand layout for chunk `units`, and whether the coefficients are A's.
    fn delta(&self, units: &Range<u64>) -> (DeltaParams, bool);

    fn launch(&self, units: &Range<u64>) -> LoraLaunch {
        let (b, n, bd, f, dst) = self.parts();
        let (delta, coef_is_a) = self.delta(units);
        lora_launch(units, b, n, bd, f, dst, delta, coef_is_a)
    }

    /// The GPU also dequantises an FP8 or FP4 base (to f32, as `base_op` is built) before
    /// merging; PEFT's rounding of a ParamWrapper's delta is done on the CPU only.
    fn lora_kernel(&self, units: &Range<u64>) -> Option<Kernel> {
        let (base_op, _, _, f, dst) = self.parts();
        (base_on_gpu(base_op) && dst != DType::F64 && f.delta_dtype.is_none())
            .then(|| Kernel::Lora(self.launch(units)))
    }
}

/// Plain: Δ = B's rows (tr × r) times A (r × cols); of an expert's block, B's row i has the
/// coefficients at `i·E·r + k·E` from the expert's first (the input starts there). Transposed
/// (Conv1D, embeddings): row g's coefficients are A's column g (stride `rows`), the vectors Bᵀ
/// (B is cols × r) — the operands `compute` gathers, read in place.
impl LoraLaunchOf for LoraMerge {
    lora_launch_parts!();

    fn delta(&self, units: &Range<u64>) -> (DeltaParams, bool) {
        let (r, cols) = (self.f.rank, self.cols);
        let one_group = DeltaParams {
            rank: r,
            cols,
            group_rows: u64::MAX,
            ..Default::default()
        };
        if self.f.transposed {
            let d = DeltaParams {
                ci: 1,
                ck: self.rows,
                vk: 1,
                vj: r,
                first_row: units.start,
                ..one_group
            };
            (d, true)
        } else {
            let e_n = self.expert.experts;
            let d = DeltaParams {
                ci: e_n * r,
                ck: e_n,
                vk: cols,
                vj: 1,
                ..one_group
            };
            (d, false)
        }
    }
}

impl Op for LoraMerge {
    lora_op_shared!();
    fn name(&self) -> &'static str {
        if self.f.m_dtype.is_some() {
            "merge-dora"
        } else {
            "merge-lora"
        }
    }
    fn units(&self) -> u64 {
        self.rows
    }
    fn out_unit_bytes(&self) -> u64 {
        self.cols * size(self.dst)
    }
    fn in_unit_bytes(&self) -> u64 {
        // Base row plus room for the f32 working copy and the delta.
        self.cols * (size(self.base_dtype) + 8)
    }
    fn input_ranges(&self, units: Range<u64>) -> Vec<Range<u64>> {
        let mut v = base_input_ranges(&self.base_op, self.base_dtype, self.cols, &units);
        let r = self.f.rank;
        let (a, b) = (size(self.f.a_dtype), size(self.f.b_dtype));
        if self.f.transposed {
            // A [r, rows]: whole (a chunk needs a column band); B [cols, r]: whole.
            v.push(0..r * self.rows * a);
            v.push(0..self.cols * r * b);
        } else {
            // A [r, cols]: whole (an expert's r rows); B [rows, r]: the chunk's rows (of an
            // expert block, from the expert's first coefficient).
            let ExpertSlice {
                experts: e_n,
                index: e,
                first_row: x0,
            } = self.expert;
            v.push(e * r * self.cols * a..(e + 1) * r * self.cols * a);
            let er = e_n * r;
            v.push(((x0 + units.start) * er + e) * b..(x0 + units.end) * er * b);
        }
        if let Some(m) = self.f.m_dtype {
            v.push(units.start * size(m)..units.end * size(m));
        }
        v
    }
    fn compute(&self, units: Range<u64>, inputs: &[&[u8]], out: &mut [u8]) -> Result<(), String> {
        let rows = (units.end - units.start) as usize;
        let cols = self.cols as usize;
        let r = self.f.rank as usize;
        let n = self.base_inputs;
        // A computed base (FP8) is produced for the whole chunk; a stored one is decoded per tile.
        let computed_base = match &self.base_op {
            Some(op) => Some(computed_rows(
                op.as_ref(),
                &units,
                &inputs[..n],
                rows * cols,
            )?),
            None => None,
        };
        let a = to_f32(self.f.a_dtype, inputs[n]);
        let b = to_f32(self.f.b_dtype, inputs[n + 1]);
        let m = self.f.m_dtype.map(|md| to_f32(md, inputs[n + 2]));
        // Δ rows = coefficient rows (tr × r) times vectors (r × cols), laid out contiguously
        // from the operand description the GPU kernel reads in place (`plan`).
        let (coefs, vecs) = gather_operands(&self.launch(&units), &a, &b, rows);
        // Row tiles keep the f32 working set in cache and out of the memory budget.
        let tile = (TILE_ELEMENTS / cols.max(1)).clamp(1, rows.max(1));
        let mut w = vec![0f32; tile * cols];
        let mut delta = vec![0f32; tile * cols];
        let (base_size, dst_size) = (size(self.base_dtype) as usize, size(self.dst) as usize);
        // The common BF16 → BF16 LoRA case adds straight from the input bytes to the output
        // bytes in one pass (same arithmetic as the general path: f32(W) + s·Δ, rounded once).
        let fused = computed_base.is_none()
            && m.is_none()
            && self.base_dtype == DType::BF16
            && self.dst == DType::BF16;
        for t0 in (0..rows).step_by(tile) {
            let tr = tile.min(rows - t0);
            let (w, delta) = (&mut w[..tr * cols], &mut delta[..tr * cols]);
            match &computed_base {
                _ if fused => {}
                Some(all) => w.copy_from_slice(&all[t0 * cols..(t0 + tr) * cols]),
                None => decode_into(
                    self.base_dtype,
                    &inputs[0][t0 * cols * base_size..(t0 + tr) * cols * base_size],
                    w,
                ),
            }
            let coef = &coefs[t0 * r..(t0 + tr) * r];
            delta_rows(coef, &vecs, r, cols, delta);
            let mut s = self.f.scale;
            if self.f.delta_dtype.is_some() {
                // PEFT's ParamWrapper: s·Δ rounded to the parameter's dtype, then added.
                delta
                    .iter_mut()
                    .for_each(|d| *d = round_delta(self.f.delta_dtype, *d, s));
                s = 1.0;
            }
            if fused {
                let base = &inputs[0][t0 * cols * 2..(t0 + tr) * cols * 2];
                let o = &mut out[t0 * cols * 2..(t0 + tr) * cols * 2];
                for ((o, b), &d) in o
                    .chunks_exact_mut(2)
                    .zip(base.chunks_exact(2))
                    .zip(delta.iter())
                {
                    let x = f32::from_bits((u16::from_le_bytes([b[0], b[1]]) as u32) << 16) + d * s;
                    o.copy_from_slice(&f32_to_bf16(x).to_le_bytes());
                }
                continue;
            }
            merge_epilogue(
                w,
                delta,
                s,
                m.as_ref().map(|m| &m[t0..t0 + tr]),
                self.dst,
                &mut out[t0 * cols * dst_size..(t0 + tr) * cols * dst_size],
            );
        }
        Ok(())
    }
}

/// The merge after the matrix product, for whole rows: `w` (the base rows as f32) becomes
/// `w + s·delta`, DoRA rows are scaled by `magnitude / ‖row‖₂` (norm summed in f64 in column
/// order), and the result is rounded once into `out` as `dst`. The CUDA epilogue
/// (kernels/lora.cuh) is checked against this function bit for bit.
pub fn merge_epilogue(
    w: &mut [f32],
    delta: &[f32],
    s: f32,
    magnitude: Option<&[f32]>,
    dst: DType,
    out: &mut [u8],
) {
    for (x, d) in w.iter_mut().zip(delta.iter()) {
        *x += d * s;
    }
    if let Some(m) = magnitude {
        let cols = w.len() / m.len().max(1);
        for (row, &mag) in w.chunks_exact_mut(cols).zip(m) {
            let norm = row.iter().map(|&x| x as f64 * x as f64).sum::<f64>().sqrt() as f32;
            let k = mag / norm;
            row.iter_mut().for_each(|x| *x *= k);
        }
    }
    write_as(dst, w.iter().copied(), out);
}

/// Δ's operands for `rows` chunk rows as contiguous matrices: coefficients (rows × r) and
/// vectors (r × cols), read through `plan`'s strides (one group: plain or transposed LoRA).
/// Plain LoRA's vectors are A itself and are borrowed.
fn gather_operands<'a>(
    plan: &LoraLaunch,
    a: &'a [f32],
    b: &'a [f32],
    rows: usize,
) -> (Vec<f32>, std::borrow::Cow<'a, [f32]>) {
    let d = &plan.delta;
    let (r, cols) = (d.rank as usize, d.cols as usize);
    debug_assert_eq!(d.group_rows, u64::MAX, "one group");
    let (csrc, vsrc) = if plan.coef_is_a { (a, b) } else { (b, a) };
    let at = |i: usize, k: usize| (d.first_row as usize + i) * d.ci as usize + k * d.ck as usize;
    let coefs = (0..rows)
        .flat_map(|i| (0..r).map(move |k| (i, k)))
        .map(|(i, k)| csrc[at(i, k)])
        .collect();
    let vecs = if d.vj == 1 && d.vk == d.cols {
        std::borrow::Cow::Borrowed(&vsrc[..r * cols])
    } else {
        (0..r)
            .flat_map(|k| (0..cols).map(move |j| (k, j)))
            .map(|(k, j)| vsrc[k * d.vk as usize + j * d.vj as usize])
            .collect()
    };
    (coefs, vecs)
}

/// Δ for whole rows: `delta[i][j] = Σ_k coef[i][k] · vecs[k][j]` (`coef` rows × r, `vecs`
/// r × cols, row-major), each sum taken in k order in f32 as a multiply then an add — exactly
/// the order of kernels/lora.cuh, so the CPU and the GPU give the same bytes (a library GEMM
/// would sum in its own order). Columns go in blocks of 128 kept in registers while k runs (measured: as fast as
/// the `gemm` crate on r=16, 49 GFLOP/s on 2 threads; 64 gave 40).
///
/// With 8-lane vectors where the CPU has AVX2 (the arithmetic unchanged: see `ops::simd`).
pub fn delta_rows(coef: &[f32], vecs: &[f32], r: usize, cols: usize, delta: &mut [f32]) {
    crate::ops::simd::with_avx2(
        #[inline(always)]
        || delta_rows_body(coef, vecs, r, cols, delta),
    )
}

#[inline(always)]
fn delta_rows_body(coef: &[f32], vecs: &[f32], r: usize, cols: usize, delta: &mut [f32]) {
    const W: usize = 128;
    for (c, drow) in coef
        .chunks_exact(r.max(1))
        .zip(delta.chunks_exact_mut(cols))
    {
        let full = cols / W * W;
        for (jb, blk) in drow[..full].chunks_exact_mut(W).enumerate() {
            let mut acc = [0f32; W];
            for (k, &ck) in c.iter().enumerate() {
                let v: &[f32; W] = vecs[k * cols + jb * W..][..W].try_into().unwrap();
                for t in 0..W {
                    acc[t] += ck * v[t];
                }
            }
            blk.copy_from_slice(&acc);
        }
        for (j, d) in drow.iter_mut().enumerate().skip(full) {
            let mut acc = 0f32;
            for (k, &ck) in c.iter().enumerate() {
                acc += ck * vecs[k * cols + j];
            }
            *d = acc;
        }
    }
}

/// f32 elements per row tile: 256 KiB of working set per buffer.
const TILE_ELEMENTS: usize = 64 << 10;

#[cfg(test)]
mod tests {
    use super::*;

    fn f32s(v: &[f32]) -> Vec<u8> {
        v.iter().flat_map(|x| x.to_le_bytes()).collect()
    }

    fn op(rows: u64, cols: u64, rank: u64, transposed: bool, dora: bool) -> LoraMerge {
        LoraMerge {
            rows,
            cols,
            expert: ExpertSlice::WHOLE,
            base_op: None,
            base_inputs: 1,
            base_dtype: DType::F32,
            f: LoraFactors {
                rank,
                a_dtype: DType::F32,
                b_dtype: DType::F32,
                m_dtype: dora.then_some(DType::F32),
                scale: 2.0,
                transposed,
                delta_dtype: None,
            },
            dst: DType::F32,
        }
    }

    fn run(op: &LoraMerge, w: &[u8], a: &[u8], b: &[u8], m: &[u8], cuts: &[u64]) -> Vec<u8> {
        let mut out = vec![0u8; (op.rows * op.cols * 4) as usize];
        let mut bounds = vec![0];
        bounds.extend_from_slice(cuts);
        bounds.push(op.rows);
        let all = [w, a, b, m];
        for win in bounds.windows(2) {
            let u = win[0]..win[1];
            let ranges = op.input_ranges(u.clone());
            let inputs: Vec<&[u8]> = ranges
                .iter()
                .zip(all)
                .map(|(r, src)| &src[r.start as usize..r.end as usize])
                .collect();
            let ob = op.out_unit_bytes() as usize;
            op.compute(
                u.clone(),
                &inputs,
                &mut out[u.start as usize * ob..u.end as usize * ob],
            )
            .unwrap();
        }
        out
    }

    #[test]
    fn merges_in_both_orientations_and_dora_independently_of_chunking() {
        let (rows, cols, r) = (5u64, 7u64, 3u64);
        let w: Vec<f32> = (0..rows * cols).map(|i| (i as f32 * 0.37).sin()).collect();
        // Normal: A [r, cols], B [rows, r].
        let a: Vec<f32> = (0..r * cols)
            .map(|i| (i as f32 * 0.11).cos() * 0.1)
            .collect();
        let b: Vec<f32> = (0..rows * r)
            .map(|i| (i as f32 * 0.23).sin() * 0.1)
            .collect();
        let m: Vec<f32> = (0..rows).map(|i| 1.0 + i as f32 * 0.1).collect();
        for dora in [false, true] {
            let o = op(rows, cols, r, false, dora);
            let whole = run(&o, &f32s(&w), &f32s(&a), &f32s(&b), &f32s(&m), &[]);
            assert_eq!(
                run(&o, &f32s(&w), &f32s(&a), &f32s(&b), &f32s(&m), &[1, 3]),
                whole
            );
            for i in 0..rows as usize {
                let row: Vec<f64> = (0..cols as usize)
                    .map(|j| {
                        let d: f64 = (0..r as usize)
                            .map(|k| b[i * 3 + k] as f64 * a[k * cols as usize + j] as f64)
                            .sum();
                        w[i * cols as usize + j] as f64 + 2.0 * d
                    })
                    .collect();
                let norm = row.iter().map(|x| x * x).sum::<f64>().sqrt();
                for j in 0..cols as usize {
                    let want = if dora {
                        row[j] * m[i] as f64 / norm
                    } else {
                        row[j]
                    };
                    let got = f32::from_le_bytes(
                        whole[(i * cols as usize + j) * 4..][..4]
                            .try_into()
                            .unwrap(),
                    ) as f64;
                    assert!((got - want).abs() < 1e-6, "[{i},{j}] {got} vs {want}");
                }
            }
        }
        // Transposed: W [rows, cols] gets (B@A)ᵀ with A [r, rows], B [cols, r].
        let at: Vec<f32> = (0..r * rows)
            .map(|i| (i as f32 * 0.13).cos() * 0.1)
            .collect();
        let bt: Vec<f32> = (0..cols * r)
            .map(|i| (i as f32 * 0.29).sin() * 0.1)
            .collect();
        let o = op(rows, cols, r, true, false);
        let got = run(&o, &f32s(&w), &f32s(&at), &f32s(&bt), &[], &[2]);
        for i in 0..rows as usize {
            for j in 0..cols as usize {
                let d: f64 = (0..r as usize)
                    .map(|k| bt[j * 3 + k] as f64 * at[k * rows as usize + i] as f64)
                    .sum();
                let want = w[i * cols as usize + j] as f64 + 2.0 * d;
                let g =
                    f32::from_le_bytes(got[(i * cols as usize + j) * 4..][..4].try_into().unwrap())
                        as f64;
                assert!((g - want).abs() < 1e-6, "T[{i},{j}] {g} vs {want}");
            }
        }
    }

    /// A fused expert parameter merged into a base stored per expert gives, tensor by tensor,
    /// the rows of the fused merge (`[E, out, in]`) bit for bit, however it is chunked: expert
    /// `e`'s block split at row 5 as gate and up are. PEFT's ParamWrapper rounding of `s·Δ`
    /// changes the bytes (checked), the same way in both.
    #[test]
    fn expert_slices_equal_the_fused_merge_split_per_expert() {
        let (e_n, out, inn, r) = (3u64, 9u64, 7u64, 2u64);
        let vals = |n: u64, k: f32| -> Vec<f32> {
            (0..n)
                .map(|i| ((i as f32 + k) * 0.37).sin() * 0.2)
                .collect()
        };
        let (w, a, b) = (
            vals(e_n * out * inn, 1.0),
            vals(e_n * r * inn, 2.0),
            vals(out * e_n * r, 3.0),
        );
        // Also with PEFT's ParamWrapper rounding of s·Δ (to bf16 here).
        let mut wants = Vec::new();
        for delta_dtype in [None, Some(DType::BF16)] {
            let f = LoraFactors {
                delta_dtype,
                ..op(1, 1, r, false, false).f
            };
            let fused = GroupedLoraMerge {
                experts: e_n,
                x: out,
                y: inn,
                in_out: false,
                base_op: None,
                base_inputs: 1,
                base_dtype: DType::F32,
                f: f.clone(),
                dst: DType::F32,
            };
            let all = [f32s(&w), f32s(&a), f32s(&b)];
            let ins: Vec<&[u8]> = fused
                .input_ranges(0..e_n * out)
                .iter()
                .zip(&all)
                .map(|(rg, src)| &src[rg.start as usize..rg.end as usize])
                .collect();
            let mut want = vec![0u8; (e_n * out * inn * 4) as usize];
            fused.compute(0..e_n * out, &ins, &mut want).unwrap();
            let row_bytes = (inn * 4) as usize;
            for e in 0..e_n {
                for (first_row, rows) in [(0, 5), (5, out - 5)] {
                    let slice = LoraMerge {
                        rows,
                        cols: inn,
                        expert: ExpertSlice {
                            experts: e_n,
                            index: e,
                            first_row,
                        },
                        f: f.clone(),
                        ..op(rows, inn, r, false, false)
                    };
                    let at = ((e * out + first_row) as usize) * row_bytes;
                    let base = &all[0][at..at + rows as usize * row_bytes];
                    for cuts in [&[][..], &[1, 3]] {
                        let got = run(&slice, base, &all[1], &all[2], &[], cuts);
                        assert_eq!(
                            got,
                            want[at..at + got.len()],
                            "expert {e} rows {first_row}+{rows}"
                        );
                    }
                }
            }
            wants.push(want);
        }
        assert_ne!(wants[0], wants[1], "rounding s·Δ to bf16 changes nothing");
    }
}

/// Grouped expert weights targeted through PEFT's `target_parameters`: base `[E, X, Y]`,
/// `A` `[E·r, in]` expert-outer (expert `e` owns rows `e·r..(e+1)·r`), `B` `[out, E·r]`
/// expert-inner (column `k·E + e`). PEFT's own layout is `[E, in, out]`
/// (`delta[e, i, o] = s Σ_k A[e·r+k, i] B[o, k·E+e]`); `[E, out, in]` gets the transpose.
/// One unit is one `Y`-long row of the flattened `[E·X, Y]` base.
#[derive(Debug)]
pub struct GroupedLoraMerge {
    pub experts: u64,
    pub x: u64,
    pub y: u64,
    /// `true`: base is `[E, in, out]` (PEFT's); `false`: `[E, out, in]`.
    pub in_out: bool,
    pub base_op: Option<Arc<dyn Op>>,
    pub base_inputs: usize,
    pub base_dtype: DType,
    pub f: LoraFactors,
    pub dst: DType,
}

impl Op for GroupedLoraMerge {
    lora_op_shared!();
    fn name(&self) -> &'static str {
        "merge-lora-experts"
    }
    fn units(&self) -> u64 {
        self.experts * self.x
    }
    fn out_unit_bytes(&self) -> u64 {
        self.y * size(self.dst)
    }
    fn in_unit_bytes(&self) -> u64 {
        self.y * (size(self.base_dtype) + 8)
    }
    fn input_ranges(&self, units: Range<u64>) -> Vec<Range<u64>> {
        let mut v = base_input_ranges(&self.base_op, self.base_dtype, self.y, &units);
        let er = self.experts * self.f.rank;
        let (inn, out) = if self.in_out {
            (self.x, self.y)
        } else {
            (self.y, self.x)
        };
        v.push(0..er * inn * size(self.f.a_dtype));
        v.push(0..out * er * size(self.f.b_dtype));
        v
    }
    fn compute(&self, units: Range<u64>, inputs: &[&[u8]], out: &mut [u8]) -> Result<(), String> {
        let rows = (units.end - units.start) as usize;
        let (y, r, e_n) = (self.y as usize, self.f.rank as usize, self.experts as usize);
        let n = self.base_inputs;
        let mut w: Vec<f32> = match &self.base_op {
            Some(op) => computed_rows(op.as_ref(), &units, &inputs[..n], rows * y)?,
            None => to_f32(self.base_dtype, inputs[0]),
        };
        let a = to_f32(self.f.a_dtype, inputs[n]);
        let b = to_f32(self.f.b_dtype, inputs[n + 1]);
        let in_dim = if self.in_out { self.x as usize } else { y };
        let mut acc = vec![0f32; y];
        let mut cached: Option<(usize, Vec<f32>)> = None;
        for (k_row, g) in units.enumerate() {
            let (e, xi) = ((g / self.x) as usize, (g % self.x) as usize);
            acc.iter_mut().for_each(|v| *v = 0.0);
            if self.in_out {
                // Row i of expert e: Σ_k A[e·r+k, i] · B[:, k·E+e].
                if cached.as_ref().is_none_or(|(ce, _)| *ce != e) {
                    let mut bt = vec![0f32; r * y];
                    for k in 0..r {
                        for o in 0..y {
                            bt[k * y + o] = b[o * e_n * r + k * e_n + e];
                        }
                    }
                    cached = Some((e, bt));
                }
                let bt = &cached.as_ref().expect("just set").1;
                for k in 0..r {
                    let coef = a[(e * r + k) * in_dim + xi];
                    for (v, &bv) in acc.iter_mut().zip(&bt[k * y..(k + 1) * y]) {
                        *v += coef * bv;
                    }
                }
            } else {
                // Row o of expert e: Σ_k B[o, k·E+e] · A[e·r+k, :].
                for k in 0..r {
                    let coef = b[xi * e_n * r + k * e_n + e];
                    for (v, &av) in acc
                        .iter_mut()
                        .zip(&a[(e * r + k) * in_dim..(e * r + k + 1) * in_dim])
                    {
                        *v += coef * av;
                    }
                }
            }
            let (s, dd) = (self.f.scale, self.f.delta_dtype);
            for (wv, &d) in w[k_row * y..(k_row + 1) * y].iter_mut().zip(&acc) {
                *wv += round_delta(dd, d, s);
            }
        }
        write_as(self.dst, w.iter().copied(), out);
        Ok(())
    }
}

/// Row g = (expert e, x) of the output. `[E, in, out]` bases (x indexes `in`): coefficients
/// A[e·r+k, x], vectors B[o, k·E+e]. `[E, out, in]` (x indexes `out`): coefficients
/// B[x, k·E+e], vectors A[e·r+k, :] — the order `compute` sums in.
impl LoraLaunchOf for GroupedLoraMerge {
    lora_launch_parts!();

    fn delta(&self, units: &Range<u64>) -> (DeltaParams, bool) {
        let (r, e_n) = (self.f.rank, self.experts);
        let in_dim = if self.in_out { self.x } else { self.y };
        let common = DeltaParams {
            rank: r,
            cols: self.y,
            first_row: units.start,
            group_rows: self.x,
            ..Default::default()
        };
        if self.in_out {
            let d = DeltaParams {
                ci: 1,
                ck: in_dim,
                cg: r * in_dim,
                vk: e_n,
                vj: e_n * r,
                vg: 1,
                ..common
            };
            (d, true)
        } else {
            let d = DeltaParams {
                ci: e_n * r,
                ck: e_n,
                cg: 1,
                vk: in_dim,
                vj: 1,
                vg: r * in_dim,
                ..common
            };
            (d, false)
        }
    }
}
