//! The quantising ops: [`QuantizeRows`] turns rows of a weight into codes and (as its extra
//! output) their scales in one read, for every scheme. FP8 blocks need all 128 rows of a block
//! before their scale is known, so that scheme takes chunks of whole 128-row block rows and
//! writes one scale row per block row ([`Op::out_span`]). [`Constant`] writes the small tensors
//! known at plan time (`weight_shape`, NVFP4's `weight_global_scale`). None has a GPU kernel
//! yet.

use std::ops::Range;

use super::encode::{
    amax, e4m3_code, f32_to_e2m1, f32_to_e4m3, mx_exponent, mx_scale, mx_stored, pack_int_row,
    symmetric_scale, WeightType, E2M1_MAX, E4M3_MAX, E4M3_ZERO_SCALE,
};
use super::Scheme;
use crate::ops::fp8::codec::e4m3_to_f32;
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
    fn scale(self, wt: WeightType, m: f32) -> (f32, f32) {
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
    fn encode(self, wt: WeightType, x: f32, factor: f32) -> u8 {
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

    fn scale_bytes(self, wt: WeightType) -> usize {
        match self {
            BlockMath::CompressedTensors => wt.bytes(),
            BlockMath::Transformers => 4,
        }
    }

    fn write(self, wt: WeightType, s: f32, out: &mut [u8]) {
        match self {
            BlockMath::CompressedTensors => wt.encode(s, out),
            BlockMath::Transformers => out.copy_from_slice(&s.to_le_bytes()),
        }
    }
}

/// (stored scale, encoder factor) of the 128×128 blocks whose rows are `rows` (at most 128 of
/// them), in block order.
fn fp8_block_scales(
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
        1
    }
    fn extra_unit_bytes(&self, _k: usize) -> u64 {
        if self.scheme == Scheme::Fp8Block {
            self.row_scale_bytes().div_ceil(FP8_BLOCK)
        } else {
            self.row_scale_bytes()
        }
    }
    fn out_span(&self, k: usize, units: Range<u64>) -> Range<u64> {
        match (k, self.scheme) {
            (0, _) => units.start * self.out_unit_bytes()..units.end * self.out_unit_bytes(),
            (_, Scheme::Fp8Block) => {
                let b = self.row_scale_bytes();
                units.start.div_ceil(FP8_BLOCK) * b..units.end.div_ceil(FP8_BLOCK) * b
            }
            _ => units.start * self.row_scale_bytes()..units.end * self.row_scale_bytes(),
        }
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
        let sb = self.row_scale_bytes() as usize;
        let [codes, scales] = outs else {
            unreachable!("codes and scales")
        };
        if self.scheme == Scheme::Fp8Block {
            let (wt, math) = (self.wt, self.block);
            let wb = math.scale_bytes(wt);
            for (b, r0) in (0..n).step_by(FP8_BLOCK as usize).enumerate() {
                let r1 = (r0 + FP8_BLOCK as usize).min(n);
                let block_scales =
                    fp8_block_scales(math, wt, &x[r0 * cols..r1 * cols], r1 - r0, cols);
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
                &x[r * cols..(r + 1) * cols],
                &mut codes[r * cb..(r + 1) * cb],
                &mut scales[r * sb..(r + 1) * sb],
                &mut q,
            );
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
            let whole = run_in_chunks(&op, &input, &[0..rows]);
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
