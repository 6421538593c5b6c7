//! The quantising ops: [`QuantizeRows`] turns rows of a weight into codes and (as its extra
//! output) their scales in one read, for every scheme. FP8 blocks need all 128 rows of a block
//! before their scale is known, so that scheme takes chunks of whole 128-row block rows and
//! writes one scale row per block row ([`Op::out_span`]). `Constant` writes the small tensors
//! known at plan time (`weight_shape`, NVFP4's `weight_global_scale`). Every scheme has a GPU
//! kernel (kernels/quantize.cuh, checked byte for byte against this file by tests/kernels.rs).

use std::ops::Range;

pub use super::encode::BlockMath;
use super::encode::{
    amax, e4m3_code, f32_to_e2m1, f32_to_e4m3, mx_exponent, mx_scale, mx_stored, pack_int_row,
    symmetric_scale, WeightType, E2M1_MAX, E4M3_MAX, E4M3_ZERO_SCALE,
};
use super::kernel::QuantParams;
use super::lanes::{self, Elem, LaneEncoder, RowChunk};
use super::Scheme;
use crate::ops::fp8::codec::e4m3_to_f32;
use crate::ops::Op;
use crate::plan::Outs;

/// FP8 block edge (`block_structure: [128, 128]`).
pub const FP8_BLOCK: u64 = 128;

/// Codes (output 0) and scales (output 1) of rows of a 2-D weight.
#[derive(Clone, Copy, Debug)]
pub struct QuantizeRows {
    pub scheme: Scheme,
    pub rows: u64,
    pub cols: u64,
    pub wt: WeightType,
    /// NVFP4's tensor scale (1 for other schemes).
    pub global: f32,
    /// FP8_BLOCK's scale arithmetic.
    pub block: BlockMath,
}

impl QuantizeRows {
    /// Encodes row `r` (`x`: its values) into `codes` and `scales`; refuses an MX group whose
    /// scale overflows.
    fn row(
        &self,
        r: u64,
        x: &[f32],
        codes: &mut [u8],
        scales: &mut [u8],
        q: &mut Vec<i32>,
    ) -> Result<(), String> {
        let wt = self.wt;
        let wb = wt.bytes();
        match self.scheme {
            Scheme::Fp8Dynamic => {
                let s = symmetric_scale(wt, amax(x), E4M3_MAX);
                wt.encode(s, scales);
                for (c, &v) in codes.iter_mut().zip(x) {
                    *c = e4m3_code(wt, v, s);
                }
            }
            Scheme::W8A16 | Scheme::W4A16 => {
                let bits = self.scheme.int_bits();
                let qmax = ((1i32 << (bits - 1)) - 1) as f32;
                let qmin = -(1i32 << (bits - 1)) as f32;
                // (qmax - qmin) / 2: 127.5 or 7.5, exact in every float dtype
                let half_range = (qmax - qmin) / 2.0;
                q.clear();
                for (g, xs) in x.chunks_exact(128).enumerate() {
                    let s = symmetric_scale(wt, amax(xs), half_range);
                    wt.encode(s, &mut scales[g * wb..(g + 1) * wb]);
                    q.extend(
                        xs.iter().map(|&v| {
                            round_half_even_small(wt.round(v / s).clamp(qmin, qmax)) as i32
                        }),
                    );
                }
                pack_int_row(q, bits, codes);
            }
            Scheme::Nvfp4A16 => {
                let g = self.global;
                for (k, xs) in x.chunks_exact(16).enumerate() {
                    let local = wt.round(amax(xs) / E2M1_MAX);
                    let mut sc = f32_to_e4m3((g * local).clamp(-E4M3_MAX, E4M3_MAX));
                    if e4m3_to_f32(sc) == 0.0 {
                        sc = f32_to_e4m3(E4M3_ZERO_SCALE);
                    }
                    scales[k] = sc;
                    let eff = e4m3_to_f32(sc) / g;
                    for (j, pair) in xs.chunks_exact(2).enumerate() {
                        let lo = f32_to_e2m1((pair[0] / eff).clamp(-E2M1_MAX, E2M1_MAX));
                        let hi = f32_to_e2m1((pair[1] / eff).clamp(-E2M1_MAX, E2M1_MAX));
                        codes[k * 8 + j] = lo | hi << 4;
                    }
                }
            }
            Scheme::Mxfp4A16 => {
                for (k, xs) in x.chunks_exact(32).enumerate() {
                    let s = mx_group_scale(wt, xs, 2, r, k)?;
                    scales[k] = mx_stored(s);
                    for (j, pair) in xs.chunks_exact(2).enumerate() {
                        let enc = |v: f32| f32_to_e2m1(wt.round(v / s).clamp(-E2M1_MAX, E2M1_MAX));
                        codes[k * 16 + j] = enc(pair[0]) | enc(pair[1]) << 4;
                    }
                }
            }
            Scheme::Mxfp8A16 => {
                for (k, xs) in x.chunks_exact(32).enumerate() {
                    let s = mx_group_scale(wt, xs, 8, r, k)?;
                    scales[k] = mx_stored(s);
                    for (c, &v) in codes[k * 32..(k + 1) * 32].iter_mut().zip(xs) {
                        *c = e4m3_code(wt, v, s);
                    }
                }
            }
            Scheme::Fp8Block => unreachable!("FP8 blocks are encoded a block row at a time"),
        }
        Ok(())
    }
}

/// Why MX group `k` of row `r` (amax `m`) cannot be encoded: its power-of-two scale rounds to
/// infinity in the weight dtype (2^128 in BF16 and F32, from amax ≥ 2^127·1.5; 2^16 in F16, from
/// amax ≥ 57344), where compressed-tensors would store a meaningless exponent and zero the group.
/// The power-of-two scale of MX group `k` of row `r` (`xs`), for codes of `elem_offset`
/// ([`mx_exponent`]: E2M1 2, E4M3 8); refused where it overflows the weight dtype.
fn mx_group_scale(
    wt: WeightType,
    xs: &[f32],
    elem_offset: i32,
    r: u64,
    k: usize,
) -> Result<f32, String> {
    let s = mx_scale(wt, mx_exponent(wt, amax(xs), elem_offset));
    if s.is_infinite() {
        return Err(mx_overflow(wt, r, k, amax(xs)));
    }
    Ok(s)
}

fn mx_overflow(wt: WeightType, r: u64, k: usize, m: f32) -> String {
    format!(
        "has amax {m:e} in the MX group at [{r}, {}..{}], whose power-of-two scale overflows {}: the group cannot be represented (compressed-tensors would write an infinite scale and zero it); leave the weight unquantised with --ignore",
        32 * k,
        32 * k + 32,
        wt.dtype()
    )
}

/// Why 128×128 block [`bi`, `bj`] (amax `m`) cannot be encoded with transformers' arithmetic:
/// `448 / amax` overflows f32 for 0 < amax < 1.3e-36, and every code of the block would be
/// NaN or ±448.
fn fp8_block_overflow(bi: usize, bj: usize, m: f32) -> String {
    format!(
        "has amax {m:e} in the 128×128 block [{bi}, {bj}]: transformers' 448 / amax overflows there and its codes would be NaN; leave the weight unquantised with --ignore, or write --format compressed-tensors"
    )
}

/// `torch.round` (half to even) of |y| ≤ 2^22: adding and taking away 1.5·2^23 leaves the f32
/// adder's own nearest-even rounding to the units digit; `f32::round_ties_even` is a libm call
/// on x86-64 without SSE4.1 and dominated the int encoders.
#[inline(always)]
fn round_half_even_small(y: f32) -> f32 {
    const MAGIC: f32 = 12_582_912.0;
    (y + MAGIC) - MAGIC
}

/// Decodes rows `units` of a weight, refusing NaN and infinity (their scales would be
/// meaningless), and returns the values.
pub(super) fn decode_rows(
    wt: WeightType,
    cols: u64,
    first_row: u64,
    input: &[u8],
) -> Result<Vec<f32>, String> {
    let mut x = Vec::with_capacity(input.len() / wt.bytes());
    wt.decode(input, &mut x);
    if let Some(i) = x.iter().position(|v| !v.is_finite()) {
        let (r, c) = (first_row + i as u64 / cols, i as u64 % cols);
        return Err(format!(
            "holds {} at [{r}, {c}]: a non-finite weight cannot be quantised",
            x[i]
        ));
    }
    Ok(x)
}

/// (stored scale, encoder factor) of the 128×128 blocks of block row `bi`, whose rows are
/// `rows` (at most 128 of them), in block order.
pub fn fp8_block_scales(
    math: BlockMath,
    wt: WeightType,
    x: &[f32],
    bi: usize,
    rows: usize,
    cols: usize,
) -> Result<Vec<(f32, f32)>, String> {
    (0..cols.div_ceil(FP8_BLOCK as usize))
        .map(|b| {
            let c0 = b * FP8_BLOCK as usize;
            let c1 = (c0 + FP8_BLOCK as usize).min(cols);
            let m = (0..rows).fold(0f32, |m, r| m.max(amax(&x[r * cols + c0..r * cols + c1])));
            if math.overflows(m) {
                return Err(fp8_block_overflow(bi, b, m));
            }
            Ok(math.scale(wt, m))
        })
        .collect()
}

/// The `Op` methods the two row quantisers (this file's [`QuantizeRows`], ModelOpt's
/// `ModeloptRows`) share, in their `impl Op`: whole rows of `cols` weights in (`rows` units);
/// codes out, and scales as the extra output ([`rows_out_span`]), encoded by [`lanes::encode`].
/// The type supplies `rows`, `cols`, `wt`, `scheme`, `row_code_bytes`, `row_scale_bytes` and
/// `quant_params` (its kernel's parameters for a chunk of `rows` rows).
macro_rules! row_quantiser_op {
    () => {
        fn name(&self) -> &'static str {
            "quantize"
        }
        fn kernel(&self, units: &::std::ops::Range<u64>) -> Option<$crate::ops::kernel::Kernel> {
            let params = self.quant_params(units.end - units.start);
            Some($crate::ops::kernel::Kernel::Quantize(params))
        }
        fn units(&self) -> u64 {
            self.rows
        }
        fn out_unit_bytes(&self) -> u64 {
            self.row_code_bytes()
        }
        fn in_unit_bytes(&self) -> u64 {
            self.cols * self.wt.bytes() as u64
        }
        fn scratch_unit_bytes(&self) -> u64 {
            // None that grows with the chunk: one row decoded to f32 (and the int schemes'
            // codes of one row), reused row after row.
            0
        }
        fn extra_outputs(&self) -> usize {
            1
        }
        fn extra_unit_bytes(&self, _k: usize) -> u64 {
            $crate::ops::quantize::ops::scale_unit_bytes(self.scheme, self.row_scale_bytes())
        }
        fn out_span(&self, k: usize, units: ::std::ops::Range<u64>) -> ::std::ops::Range<u64> {
            let (code, scale) = (self.out_unit_bytes(), self.row_scale_bytes());
            $crate::ops::quantize::ops::rows_out_span(self.scheme, k, units, code, scale)
        }
        fn input_ranges(&self, units: ::std::ops::Range<u64>) -> Vec<::std::ops::Range<u64>> {
            let row = self.in_unit_bytes();
            std::iter::once(units.start * row..units.end * row).collect()
        }
        fn compute(
            &self,
            units: ::std::ops::Range<u64>,
            inputs: &[&[u8]],
            out: &mut [u8],
        ) -> Result<(), String> {
            self.compute_all(units, inputs, &mut [out])
        }
        fn compute_all(
            &self,
            units: ::std::ops::Range<u64>,
            inputs: &[&[u8]],
            outs: $crate::plan::Outs,
        ) -> Result<(), String> {
            $crate::ops::quantize::lanes::encode(self, units, inputs, outs)
        }
    };
}
pub(super) use row_quantiser_op;

/// The `LaneEncoder` methods the two row quantisers read straight from their `wt` and `cols`.
macro_rules! row_lane_fields {
    () => {
        fn weight_type(&self) -> WeightType {
            self.wt
        }
        fn cols(&self) -> u64 {
            self.cols
        }
    };
}
pub(super) use row_lane_fields;

impl Op for QuantizeRows {
    fn granularity(&self) -> u64 {
        if self.scheme == Scheme::Fp8Block {
            FP8_BLOCK
        } else {
            1
        }
    }
    row_quantiser_op!();
}

/// Scale bytes per unit (row) of a row quantiser whose scales take `scale_row` bytes a row, or
/// for FP8 blocks a row of that many per 128 rows (an upper bound per unit).
pub(super) fn scale_unit_bytes(scheme: Scheme, scale_row: u64) -> u64 {
    if scheme == Scheme::Fp8Block {
        scale_row.div_ceil(FP8_BLOCK)
    } else {
        scale_row
    }
}

/// `Op::out_span` of a row quantiser: codes (output 0) `code_row` bytes a row; scales
/// `scale_row` bytes a row, or for FP8 blocks a scale row per granule of 128 rows.
pub(super) fn rows_out_span(
    scheme: Scheme,
    k: usize,
    units: Range<u64>,
    code_row: u64,
    scale_row: u64,
) -> Range<u64> {
    match (k, scheme) {
        (0, _) => units.start * code_row..units.end * code_row,
        (_, Scheme::Fp8Block) => {
            units.start.div_ceil(FP8_BLOCK) * scale_row..units.end.div_ceil(FP8_BLOCK) * scale_row
        }
        _ => units.start * scale_row..units.end * scale_row,
    }
}

/// The error for rows `input` (from row `first`) in which a lane decoder saw a NaN or an
/// infinity: the scalar decoder's, which names the non-finite element. Rare.
pub(super) fn nonfinite_rows(
    wt: WeightType,
    cols: u64,
    first: u64,
    input: &[u8],
) -> Result<(), String> {
    match decode_rows(wt, cols, first, input) {
        Err(e) => Err(e),
        Ok(_) => unreachable!("a non-finite element was seen"),
    }
}

impl QuantizeRows {
    /// The kernel's parameters for a chunk of `rows` rows (FP8 blocks: chunks hold whole
    /// 128-row block rows, the kernel's unit too).
    fn quant_params(&self, rows: u64) -> QuantParams {
        QuantParams::new(
            self.scheme,
            rows,
            self.cols,
            self.wt,
            self.global,
            self.block,
        )
    }

    /// The scalar encoder, element by element as the library's arithmetic reads: the
    /// reference the lane-parallel encoder ([`super::lanes`]) is tested against.
    pub fn compute_reference(
        &self,
        units: Range<u64>,
        inputs: &[&[u8]],
        outs: Outs,
    ) -> Result<(), String> {
        self.reference(RowChunk::new(self, units, inputs, outs))
    }

    /// [`Self::compute_reference`] of one chunk.
    fn reference(&self, c: RowChunk) -> Result<(), String> {
        let (units, n, cols, cb, sb) = (c.units, c.n, c.cols, c.cb, c.sb);
        let (codes, scales) = (c.codes, c.scales);
        let x = decode_rows(self.wt, self.cols, units.start, c.input)?;
        if self.scheme == Scheme::Fp8Block {
            let (wt, math) = (self.wt, self.block);
            let wb = math.scale_bytes(wt);
            let first = (units.start / FP8_BLOCK) as usize;
            for (b, r0) in (0..n).step_by(FP8_BLOCK as usize).enumerate() {
                let r1 = (r0 + FP8_BLOCK as usize).min(n);
                let rows = &x[r0 * cols..r1 * cols];
                let block_scales = fp8_block_scales(math, wt, rows, first + b, r1 - r0, cols)?;
                for (j, &(s, _)) in block_scales.iter().enumerate() {
                    let at = b * sb + j * wb;
                    math.write(wt, s, &mut scales[at..at + wb]);
                }
                for r in r0..r1 {
                    for (c, code) in codes[r * cb..(r + 1) * cb].iter_mut().enumerate() {
                        let factor = block_scales[c / FP8_BLOCK as usize].1;
                        *code = math.encode(wt, x[r * cols + c], factor);
                    }
                }
            }
            return Ok(());
        }
        let mut q = Vec::new();
        for r in 0..n {
            self.row(
                units.start + r as u64,
                &x[r * cols..(r + 1) * cols],
                &mut codes[r * cb..(r + 1) * cb],
                &mut scales[r * sb..(r + 1) * sb],
                &mut q,
            )?;
        }
        Ok(())
    }
}

impl LaneEncoder for QuantizeRows {
    row_lane_fields!();
    fn row_code_bytes(&self) -> u64 {
        let c = self.cols;
        match self.scheme {
            Scheme::Fp8Dynamic | Scheme::Fp8Block | Scheme::Mxfp8A16 => c,
            Scheme::Nvfp4A16 | Scheme::Mxfp4A16 => c / 2,
            Scheme::W8A16 | Scheme::W4A16 => 4 * (c * self.scheme.int_bits() as u64).div_ceil(32),
        }
    }

    /// Scale bytes per row; for FP8 blocks, per block row of 128 weight rows.
    fn row_scale_bytes(&self) -> u64 {
        let w = self.wt.bytes() as u64;
        match self.scheme {
            Scheme::Fp8Dynamic => w,
            Scheme::Fp8Block => {
                self.cols.div_ceil(FP8_BLOCK) * self.block.scale_bytes(self.wt) as u64
            }
            Scheme::W8A16 | Scheme::W4A16 => w * self.cols / 128,
            Scheme::Nvfp4A16 => self.cols / 16,
            Scheme::Mxfp4A16 | Scheme::Mxfp8A16 => self.cols / 32,
        }
    }

    /// The lane-parallel encoder: [`Self::compute_reference`]'s arithmetic, group by group,
    /// a row at a time (each row decoded into a buffer that stays in cache).
    #[inline(always)]
    fn encode_lanes<E: Elem>(&self, c: RowChunk) -> Result<(), String> {
        let (wt, wb, n, cols, ib) = (E::WT, E::WT.bytes(), c.n, c.cols, c.ib);
        let (input, cb, sb, codes, scales) = (c.input, c.cb, c.sb, c.codes, c.scales);
        let refuse = || nonfinite_rows(wt, self.cols, c.units.start, input);
        let mut x = vec![0f32; cols];
        let (mut q, mut eff) = (Vec::new(), Vec::new());
        if self.scheme == Scheme::Fp8Block {
            let math = self.block;
            let (bs, blocks) = (FP8_BLOCK as usize, cols.div_ceil(FP8_BLOCK as usize));
            let swb = math.scale_bytes(wt);
            let mut m = vec![0u32; blocks];
            let mut factors = vec![0f32; blocks];
            for (b, r0) in (0..n).step_by(bs).enumerate() {
                let r1 = (r0 + bs).min(n);
                if lanes::block_mags::<E>(&input[r0 * ib..r1 * ib], cols, bs, &mut m) {
                    return refuse();
                }
                for (j, (&mj, f)) in m.iter().zip(factors.iter_mut()).enumerate() {
                    let mj = E::from_mag(mj);
                    if math.overflows(mj) {
                        let bi = (c.units.start / FP8_BLOCK) as usize + b;
                        return Err(fp8_block_overflow(bi, j, mj));
                    }
                    let (s, factor) = math.scale(wt, mj);
                    let at = b * sb + j * swb;
                    math.write(wt, s, &mut scales[at..at + swb]);
                    *f = factor;
                }
                for r in r0..r1 {
                    lanes::decode::<E>(&input[r * ib..(r + 1) * ib], &mut x);
                    let out = &mut codes[r * cb..(r + 1) * cb];
                    for ((seg, o), &f) in x.chunks(bs).zip(out.chunks_mut(bs)).zip(&factors) {
                        match math {
                            BlockMath::CompressedTensors => lanes::e4m3_div::<E>(seg, f, o),
                            BlockMath::Transformers => lanes::e4m3_mul(seg, f, o),
                        }
                    }
                }
            }
            return Ok(());
        }
        let mx =
            matches!(self.scheme, Scheme::Mxfp4A16 | Scheme::Mxfp8A16).then(|| MxTable::new(wt));
        for r in 0..n {
            if lanes::decode::<E>(&input[r * ib..(r + 1) * ib], &mut x) {
                return refuse();
            }
            let codes = &mut codes[r * cb..(r + 1) * cb];
            let scales = &mut scales[r * sb..(r + 1) * sb];
            match self.scheme {
                Scheme::Fp8Dynamic => {
                    let s = symmetric_scale(wt, lanes::amax(&x), E4M3_MAX);
                    wt.encode(s, scales);
                    lanes::e4m3_div::<E>(&x, s, codes);
                }
                Scheme::W8A16 | Scheme::W4A16 => {
                    let bits = self.scheme.int_bits();
                    let qmax = ((1i32 << (bits - 1)) - 1) as f32;
                    let qmin = -(1i32 << (bits - 1)) as f32;
                    let half_range = (qmax - qmin) / 2.0;
                    q.resize(cols, 0);
                    for (g, (gx, gq)) in
                        x.chunks_exact(128).zip(q.chunks_exact_mut(128)).enumerate()
                    {
                        let s = symmetric_scale(wt, lanes::amax(gx), half_range);
                        wt.encode(s, &mut scales[g * wb..(g + 1) * wb]);
                        lanes::int_div::<E>(gx, s, qmin, qmax, gq);
                    }
                    pack_int_row(&q, bits, codes);
                }
                // Group scales first, codes after: each group's chain (maximum, scale, a
                // division, the codes) is long, and separate passes let the CPU overlap the
                // chains of neighbouring groups.
                Scheme::Nvfp4A16 => {
                    let g = self.global;
                    let sc_zero = f32_to_e4m3(E4M3_ZERO_SCALE);
                    eff.clear();
                    for (xs, sc) in x.chunks_exact(16).zip(scales.iter_mut()) {
                        let local = E::round(lanes::amax(xs) / E2M1_MAX);
                        let c = lanes::e4m3((g * local).clamp(-E4M3_MAX, E4M3_MAX));
                        *sc = if c & 0x7F == 0 { sc_zero } else { c };
                        eff.push(lanes::E4M3_VALUES[*sc as usize] / g);
                    }
                    for ((xs, o), &e) in x.chunks_exact(16).zip(codes.chunks_exact_mut(8)).zip(&eff)
                    {
                        let (xs, o) = (xs.try_into().expect("16"), o.try_into().expect("8"));
                        lanes::e2m1_div::<E, false, 16, 8>(xs, e, o);
                    }
                }
                Scheme::Mxfp4A16 | Scheme::Mxfp8A16 => {
                    let table = mx.as_ref().expect("MX table");
                    let fp4 = self.scheme == Scheme::Mxfp4A16;
                    eff.clear();
                    for (k, (xs, sc)) in x.chunks_exact(32).zip(scales.iter_mut()).enumerate() {
                        let m = lanes::amax(xs);
                        let e = mx_exponent(wt, m, if fp4 { 2 } else { 8 });
                        let (s, stored) = table.0[e as usize];
                        if s.is_infinite() {
                            return Err(mx_overflow(wt, c.units.start + r as u64, k, m));
                        }
                        *sc = stored;
                        eff.push(s);
                    }
                    if fp4 {
                        for ((xs, o), &s) in
                            x.chunks_exact(32).zip(codes.chunks_exact_mut(16)).zip(&eff)
                        {
                            let (xs, o) = (xs.try_into().expect("32"), o.try_into().expect("16"));
                            lanes::e2m1_div::<E, true, 32, 16>(xs, s, o);
                        }
                    } else {
                        for ((xs, o), &s) in
                            x.chunks_exact(32).zip(codes.chunks_exact_mut(32)).zip(&eff)
                        {
                            lanes::e4m3_div::<E>(xs, s, o);
                        }
                    }
                }
                Scheme::Fp8Block => unreachable!("encoded by block rows above"),
            }
        }
        Ok(())
    }
}

/// `(2^(e-127)` in the weight dtype, its stored E8M0 byte`) for every exponent `e`: MX groups
/// look their scale up instead of taking powers and logarithms per group.
struct MxTable([(f32, u8); 256]);

impl MxTable {
    fn new(wt: WeightType) -> MxTable {
        let mut t = [(0f32, 0u8); 256];
        for (e, slot) in t.iter_mut().enumerate() {
            let s = mx_scale(wt, e as u8);
            *slot = (s, mx_stored(s));
        }
        MxTable(t)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Runs `op` over `cuts` (consecutive unit ranges) into whole-tensor outputs placed by
    /// `out_span`.
    fn run_in_chunks(op: &QuantizeRows, input: &[u8], cuts: &[Range<u64>]) -> Vec<Vec<u8>> {
        let whole = |k| op.out_span(k, 0..op.units()).end as usize;
        let mut outs = vec![vec![0u8; whole(0)], vec![0u8; whole(1)]];
        for u in cuts {
            let r = &op.input_ranges(u.clone())[0];
            let (s0, s1) = (op.out_span(0, u.clone()), op.out_span(1, u.clone()));
            let (a, b) = outs.split_at_mut(1);
            let mut views = [
                &mut a[0][s0.start as usize..s0.end as usize],
                &mut b[0][s1.start as usize..s1.end as usize],
            ];
            op.compute_all(
                u.clone(),
                &[&input[r.start as usize..r.end as usize]],
                &mut views,
            )
            .unwrap();
        }
        outs
    }

    /// Random weights of every magnitude, with the cases encoders get wrong: all-zero and
    /// negative-zero groups, subnormals, values on E4M3/E2M1 rounding boundaries once scaled.
    fn awkward_weights(wt: WeightType, rows: u64, cols: u64, seed: u64) -> Vec<u8> {
        let mut state = seed;
        let mut next = || {
            state = state
                .wrapping_mul(6_364_136_223_846_793_005)
                .wrapping_add(1_442_695_040_888_963_407);
            (state >> 33) as u32
        };
        let mut bytes = Vec::new();
        for r in 0..rows {
            for c in 0..cols {
                let group = (r * cols + c) / 16;
                let v = match group % 11 {
                    0 => 0.0,
                    1 => -0.0,
                    2 => [0.5f32, 1.5, 2.5, -0.75, 5.0, -3.5, 448.0, 6.0][next() as usize % 8],
                    3 => {
                        f32::from_bits(next() % 0x0080_0000)
                            * if next() % 2 == 0 { 1.0 } else { -1.0 }
                    }
                    4 => ((next() % 4096) as f32 - 2048.0) * 2f32.powi(-30),
                    _ => {
                        let mag = 2f32.powi((next() % 34) as i32 - 20);
                        ((next() % 65536) as f32 / 32768.0 - 1.0) * mag
                    }
                };
                let mut b = vec![0u8; wt.bytes()];
                wt.encode(wt.round(v), &mut b);
                bytes.extend(b);
            }
        }
        bytes
    }

    #[test]
    fn lane_encoders_equal_the_scalar_reference_for_every_scheme_and_dtype() {
        for wt in [WeightType::BF16, WeightType::F16, WeightType::F32] {
            for scheme in Scheme::ALL {
                let cols = match scheme {
                    Scheme::W8A16 | Scheme::W4A16 => 384,
                    Scheme::Fp8Block | Scheme::Fp8Dynamic => 328,
                    _ => 352,
                };
                let rows = 260;
                let input = awkward_weights(wt, rows, cols, cols + rows);
                let maths: &[BlockMath] = if scheme == Scheme::Fp8Block {
                    &[BlockMath::CompressedTensors, BlockMath::Transformers]
                } else {
                    &[BlockMath::CompressedTensors]
                };
                for &block in maths {
                    let op = QuantizeRows {
                        scheme,
                        rows,
                        cols,
                        wt,
                        global: if scheme == Scheme::Nvfp4A16 {
                            37.25
                        } else {
                            1.0
                        },
                        block,
                    };
                    let what = format!("{} {wt:?} {block:?}", scheme.name());
                    lanes::assert_lanes_agree(&op, rows, &input, |c| op.reference(c), &what);
                }
            }
        }
    }

    #[test]
    fn lane_encoders_refuse_non_finite_weights_by_position() {
        let (rows, cols) = (4u64, 32u64);
        let mut input = awkward_weights(WeightType::BF16, rows, cols, 1);
        let at = 2 * cols as usize + 5;
        input[2 * at..2 * at + 2].copy_from_slice(&0x7F80u16.to_le_bytes());
        let op = QuantizeRows {
            scheme: Scheme::Mxfp8A16,
            rows,
            cols,
            wt: WeightType::BF16,
            global: 1.0,
            block: BlockMath::CompressedTensors,
        };
        let (mut c, mut s) = (vec![0u8; 128], vec![0u8; 4]);
        let err = op
            .compute_all(10..14, &[&input], &mut [&mut c, &mut s])
            .unwrap_err();
        assert_eq!(
            err,
            "holds inf at [12, 5]: a non-finite weight cannot be quantised"
        );
    }

    #[test]
    fn fp8_block_scales_land_in_their_block_row_however_the_rows_are_cut() {
        let (rows, cols) = (300u64, 200u64);
        let mut seed = 0x2545_f491_u32;
        let input: Vec<u8> = (0..rows * cols)
            .flat_map(|i| {
                seed = seed.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
                let mag = 2f32.powi((i / 128 % 9) as i32 - 4);
                let v = ((seed >> 8) as f32 / (1u32 << 24) as f32 - 0.5) * mag;
                crate::ops::cast::f32_to_bf16(v).to_le_bytes()
            })
            .collect();
        for block in [BlockMath::CompressedTensors, BlockMath::Transformers] {
            let op = QuantizeRows {
                scheme: Scheme::Fp8Block,
                rows,
                cols,
                wt: WeightType::BF16,
                global: 1.0,
                block,
            };
            assert_eq!(
                op.out_span(1, 0..rows).end,
                3 * 2 * op.block.scale_bytes(op.wt) as u64
            );
            let whole = run_in_chunks(&op, &input, std::slice::from_ref(&(0..rows)));
            let cut = run_in_chunks(&op, &input, &[0..128, 128..256, 256..rows]);
            assert_eq!(whole, cut, "{block:?}");
            // Block (2, 1): rows 256.., columns 128..200, scaled by its own amax.
            let x: Vec<f32> = (256..rows)
                .flat_map(|r| (128..cols).map(move |c| (r * cols + c) as usize))
                .map(|i| {
                    crate::ops::cast::bf16_to_f32(u16::from_le_bytes([
                        input[2 * i],
                        input[2 * i + 1],
                    ]))
                })
                .collect();
            let (s, _) = block.scale(op.wt, amax(&x));
            let sb = block.scale_bytes(op.wt);
            let mut want = vec![0u8; sb];
            block.write(op.wt, s, &mut want);
            assert_eq!(
                whole[1][(2 * 2 + 1) * sb..(2 * 2 + 2) * sb],
                want[..],
                "{block:?}"
            );
        }
    }

    #[test]
    fn small_rounding_is_torch_round() {
        for k in -2560..=2560 {
            let y = k as f32 / 20.0;
            assert_eq!(round_half_even_small(y), y.round_ties_even(), "{y}");
        }
        for y in [0.5f32, 1.5, 2.5, -0.5, -1.5, 127.5, -128.5, 0.49999997] {
            assert_eq!(round_half_even_small(y), y.round_ties_even(), "{y}");
        }
    }
}
