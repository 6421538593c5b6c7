//! The quantising ops: [`QuantizeRows`] turns rows of a weight into codes and (as its extra
//! output) their scales in one read, for every scheme whose scales are per row or per group;
//! FP8 blocks need all 128 rows of a block before their scale is known, so
//! [`Fp8BlockScales`] computes those scales in a pass of its own (the weight is read twice) and
//! the codes op recomputes each block's scale from the same rows, which 128-row granularity
//! keeps inside one chunk. [`Constant`] writes the small tensors known at plan time
//! (`weight_shape`, NVFP4's `weight_global_scale`). [`QuantizeRows`] has GPU kernels for the
//! row-local schemes (kernels/quantize.cuh, checked byte for byte against this file by
//! tests/kernels.rs); the FP8 block kernel there (codes and block scales of whole block rows in
//! one op) is checked against [`fp8_block_scales`] and [`BlockMath`] but not yet used.

use std::ops::Range;

use super::encode::{
    amax, e4m3_code, f32_to_e2m1, f32_to_e4m3, mx_exponent, mx_scale, mx_stored, pack_int_row,
    symmetric_scale, WeightType, E2M1_MAX, E4M3_MAX, E4M3_ZERO_SCALE,
};
use super::kernel::QuantParams;
use super::Scheme;
use crate::ops::fp8::codec::e4m3_to_f32;
use crate::ops::kernel::Kernel;
use crate::ops::Op;

/// FP8 block edge (`block_structure: [128, 128]`).
pub const FP8_BLOCK: u64 = 128;

/// Codes (output 0) and, for row-local schemes, scales (output 1) of rows of a 2-D weight.
#[derive(Debug)]
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
    fn row_code_bytes(&self) -> u64 {
        let c = self.cols;
        match self.scheme {
            Scheme::Fp8Dynamic | Scheme::Fp8Block | Scheme::Mxfp8A16 => c,
            Scheme::Nvfp4A16 | Scheme::Mxfp4A16 => c / 2,
            Scheme::W8A16 | Scheme::W4A16 => 4 * (c * self.scheme.int_bits() as u64).div_ceil(32),
        }
    }

    fn row_scale_bytes(&self) -> u64 {
        let w = self.wt.bytes() as u64;
        match self.scheme {
            Scheme::Fp8Dynamic => w,
            Scheme::Fp8Block => 0,
            Scheme::W8A16 | Scheme::W4A16 => w * self.cols / 128,
            Scheme::Nvfp4A16 => self.cols / 16,
            Scheme::Mxfp4A16 | Scheme::Mxfp8A16 => self.cols / 32,
        }
    }

    /// Encodes one row (`x`: its values) into `codes` and `scales`.
    fn row(&self, x: &[f32], codes: &mut [u8], scales: &mut [u8], q: &mut Vec<i32>) {
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
                    let s = mx_scale(wt, mx_exponent(wt, amax(xs), 2));
                    scales[k] = mx_stored(s);
                    for (j, pair) in xs.chunks_exact(2).enumerate() {
                        let enc = |v: f32| f32_to_e2m1(wt.round(v / s).clamp(-E2M1_MAX, E2M1_MAX));
                        codes[k * 16 + j] = enc(pair[0]) | enc(pair[1]) << 4;
                    }
                }
            }
            Scheme::Mxfp8A16 => {
                for (k, xs) in x.chunks_exact(32).enumerate() {
                    let s = mx_scale(wt, mx_exponent(wt, amax(xs), 8));
                    scales[k] = mx_stored(s);
                    for (c, &v) in codes[k * 32..(k + 1) * 32].iter_mut().zip(xs) {
                        *c = e4m3_code(wt, v, s);
                    }
                }
            }
            Scheme::Fp8Block => unreachable!("FP8 blocks are encoded a block row at a time"),
        }
    }
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
fn decode_rows(
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

/// How FP8 blocks are scaled: compressed-tensors divides by `W(amax / 448)` in the weight
/// dtype and stores that scale; transformers' `Fp8Quantize` (FineGrainedFP8, `--format
/// fp8-native`) multiplies by `448 / amax` in f32 (1 for an all-zero block) and stores its
/// reciprocal as `weight_scale_inv` F32 (byte-identical to transformers 5.24 on blocks it
/// quantises; it leaves a weight whose sides 128 does not divide unquantised, which tftf
/// quantises with ragged edge blocks as DeepSeek-V3 does).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BlockMath {
    CompressedTensors,
    Transformers,
}

impl BlockMath {
    /// (the stored scale, the factor the encoder applies) of a block whose amax is `m`.
    pub fn scale(self, wt: WeightType, m: f32) -> (f32, f32) {
        match self {
            BlockMath::CompressedTensors => {
                let s = symmetric_scale(wt, m, E4M3_MAX);
                (s, s)
            }
            BlockMath::Transformers => {
                // `448 / amax` on a tensor is torch's `reciprocal(amax) * 448`: two roundings.
                let mult = if m > 0.0 { (1.0 / m) * E4M3_MAX } else { 1.0 };
                (1.0 / mult, mult)
            }
        }
    }

    #[inline(always)]
    pub fn encode(self, wt: WeightType, x: f32, factor: f32) -> u8 {
        match self {
            BlockMath::CompressedTensors => e4m3_code(wt, x, factor),
            BlockMath::Transformers => f32_to_e4m3((x * factor).clamp(-E4M3_MAX, E4M3_MAX)),
        }
    }

    /// The stored scale's dtype.
    pub fn scale_dtype(self, wt: WeightType) -> crate::format::dtype::DType {
        match self {
            BlockMath::CompressedTensors => wt.dtype(),
            BlockMath::Transformers => crate::format::dtype::DType::F32,
        }
    }

    pub fn scale_bytes(self, wt: WeightType) -> usize {
        match self {
            BlockMath::CompressedTensors => wt.bytes(),
            BlockMath::Transformers => 4,
        }
    }

    pub fn write(self, wt: WeightType, s: f32, out: &mut [u8]) {
        match self {
            BlockMath::CompressedTensors => wt.encode(s, out),
            BlockMath::Transformers => out.copy_from_slice(&s.to_le_bytes()),
        }
    }
}

/// (stored scale, encoder factor) of the 128×128 blocks whose rows are `rows` (at most 128 of
/// them), in block order.
pub fn fp8_block_scales(
    math: BlockMath,
    wt: WeightType,
    x: &[f32],
    rows: usize,
    cols: usize,
) -> Vec<(f32, f32)> {
    (0..cols.div_ceil(FP8_BLOCK as usize))
        .map(|b| {
            let c0 = b * FP8_BLOCK as usize;
            let c1 = (c0 + FP8_BLOCK as usize).min(cols);
            let m = (0..rows).fold(0f32, |m, r| m.max(amax(&x[r * cols + c0..r * cols + c1])));
            math.scale(wt, m)
        })
        .collect()
}

impl Op for QuantizeRows {
    fn name(&self) -> &'static str {
        "quantize"
    }
    fn kernel(&self, units: &Range<u64>) -> Option<Kernel> {
        // FP8 blocks: the block kernel is wired with the op that writes codes and scales.
        (self.scheme != Scheme::Fp8Block).then(|| {
            Kernel::Quantize(QuantParams::new(
                self.scheme,
                units.end - units.start,
                self.cols,
                self.wt,
                self.global,
                self.block,
            ))
        })
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
    fn granularity(&self) -> u64 {
        if self.scheme == Scheme::Fp8Block {
            FP8_BLOCK
        } else {
            1
        }
    }
    fn scratch_unit_bytes(&self) -> u64 {
        // The rows decoded to f32 (the int schemes' codes take one more row, reused).
        self.cols * 4
    }
    fn extra_outputs(&self) -> usize {
        usize::from(self.scheme != Scheme::Fp8Block)
    }
    fn extra_unit_bytes(&self, _k: usize) -> u64 {
        self.row_scale_bytes()
    }
    fn input_ranges(&self, units: Range<u64>) -> Vec<Range<u64>> {
        let row = self.in_unit_bytes();
        std::iter::once(units.start * row..units.end * row).collect()
    }
    fn compute(&self, units: Range<u64>, inputs: &[&[u8]], out: &mut [u8]) -> Result<(), String> {
        self.compute_all(units, inputs, &mut [out])
    }
    fn compute_all(
        &self,
        units: Range<u64>,
        inputs: &[&[u8]],
        outs: &mut [&mut [u8]],
    ) -> Result<(), String> {
        let cols = self.cols as usize;
        let x = decode_rows(self.wt, self.cols, units.start, inputs[0])?;
        let n = (units.end - units.start) as usize;
        let cb = self.row_code_bytes() as usize;
        if self.scheme == Scheme::Fp8Block {
            let wt = self.wt;
            let codes = &mut *outs[0];
            for r0 in (0..n).step_by(FP8_BLOCK as usize) {
                let r1 = (r0 + FP8_BLOCK as usize).min(n);
                let math = self.block;
                let scales = fp8_block_scales(math, wt, &x[r0 * cols..r1 * cols], r1 - r0, cols);
                for r in r0..r1 {
                    for (c, code) in codes[r * cb..(r + 1) * cb].iter_mut().enumerate() {
                        let factor = scales[c / FP8_BLOCK as usize].1;
                        *code = math.encode(wt, x[r * cols + c], factor);
                    }
                }
            }
            return Ok(());
        }
        let sb = self.row_scale_bytes() as usize;
        let [codes, scales] = outs else {
            unreachable!("codes and scales")
        };
        let mut q = Vec::new();
        for r in 0..n {
            self.row(
                &x[r * cols..(r + 1) * cols],
                &mut codes[r * cb..(r + 1) * cb],
                &mut scales[r * sb..(r + 1) * sb],
                &mut q,
            );
        }
        Ok(())
    }
}

/// `weight_scale` (`weight_scale_inv` in fp8-native) of FP8_BLOCK: one scale per 128×128 block.
#[derive(Debug)]
pub struct Fp8BlockScales {
    pub rows: u64,
    pub cols: u64,
    pub wt: WeightType,
    pub math: BlockMath,
}

impl Op for Fp8BlockScales {
    fn name(&self) -> &'static str {
        "quantize fp8 block scales"
    }
    fn units(&self) -> u64 {
        self.rows.div_ceil(FP8_BLOCK)
    }
    fn out_unit_bytes(&self) -> u64 {
        self.cols.div_ceil(FP8_BLOCK) * self.math.scale_bytes(self.wt) as u64
    }
    fn in_unit_bytes(&self) -> u64 {
        FP8_BLOCK * self.cols * self.wt.bytes() as u64
    }
    fn scratch_unit_bytes(&self) -> u64 {
        // The block rows decoded to f32.
        FP8_BLOCK * self.cols * 4
    }
    fn input_ranges(&self, units: Range<u64>) -> Vec<Range<u64>> {
        let row = self.cols * self.wt.bytes() as u64;
        let end = (units.end * FP8_BLOCK).min(self.rows);
        std::iter::once(units.start * FP8_BLOCK * row..end * row).collect()
    }
    fn compute(&self, units: Range<u64>, inputs: &[&[u8]], out: &mut [u8]) -> Result<(), String> {
        let cols = self.cols as usize;
        let first = units.start * FP8_BLOCK;
        let x = decode_rows(self.wt, self.cols, first, inputs[0])?;
        let rows = x.len() / cols;
        let wb = self.math.scale_bytes(self.wt);
        let mut o = 0;
        for r0 in (0..rows).step_by(FP8_BLOCK as usize) {
            let r1 = (r0 + FP8_BLOCK as usize).min(rows);
            let block = &x[r0 * cols..r1 * cols];
            for (s, _) in fp8_block_scales(self.math, self.wt, block, r1 - r0, cols) {
                self.math.write(self.wt, s, &mut out[o..o + wb]);
                o += wb;
            }
        }
        Ok(())
    }
}

/// A small tensor whose bytes are fixed at plan time.
#[derive(Debug)]
pub struct Constant {
    pub what: &'static str,
    pub bytes: Vec<u8>,
}

impl Op for Constant {
    fn name(&self) -> &'static str {
        self.what
    }
    fn units(&self) -> u64 {
        1
    }
    fn out_unit_bytes(&self) -> u64 {
        self.bytes.len() as u64
    }
    fn in_unit_bytes(&self) -> u64 {
        0
    }
    fn input_ranges(&self, _units: Range<u64>) -> Vec<Range<u64>> {
        Vec::new()
    }
    fn compute(&self, _units: Range<u64>, _inputs: &[&[u8]], out: &mut [u8]) -> Result<(), String> {
        out.copy_from_slice(&self.bytes);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::round_half_even_small;

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
