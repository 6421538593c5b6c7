//! E2M1 (FP4) and the Engram requantisation E4M3 → E2M1.
//!
//! E2M1 code = `sign << 3 | idx`, idx 0..7 ↦ {0, 0.5, 1, 1.5, 2, 3, 4, 6}; packed two per byte,
//! element `2k` in the **low** nibble of byte `k`, `2k+1` in the high one (as MXFP4/NVFP4
//! checkpoints store them). Rounding is to nearest with ties to the even code, saturating at
//! ±6, as FP4 hardware and ml_dtypes do.
//!
//! Engram layout: `X.weight` `F8_E4M3` `[rows, cols]` with `X.scale` `F8_E8M0` `[rows, cols/32]`
//! becomes `X.weight` `U8` `[rows, cols/2]` (packed E2M1) and `X.scale` `F8_E8M0`
//! `[rows, cols/32]`. Per 32-element block: `v = e4m3 · 2^(e-127)`; the new scale is the smallest
//! power of two `s` with `6·s ≥ max|v|` (exact in f64: every `v` is a small integer times a power
//! of two); an all-zero block gets `2^-127`. One unit is one row, so any run of rows is
//! independent and the table streams through the budget.

use std::ops::Range;
use std::sync::{Mutex, OnceLock};

use super::kernel::RowSums;
use crate::ops::fp8::codec::{e4m3_is_nan, e4m3_table};
use crate::ops::kernel::{Kernel, KernelStats};
use crate::ops::Op;
use crate::plan::{op_name_and_kernel, Outs};

pub const E2M1_VALUES: [f32; 8] = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0];
pub const BLOCK: usize = 32;

pub fn e2m1_to_f32(code: u8) -> f32 {
    let v = E2M1_VALUES[(code & 7) as usize];
    if code & 8 != 0 {
        -v
    } else {
        v
    }
}

/// Nearest E2M1 code, ties to even, saturating at ±6; `x` must not be NaN.
pub fn f64_to_e2m1(x: f64) -> u8 {
    let sign = if x.is_sign_negative() { 8 } else { 0 };
    let a = x.abs();
    let idx = if a <= 0.25 {
        0
    } else if a < 0.75 {
        1
    } else if a <= 1.25 {
        2
    } else if a < 1.75 {
        3
    } else if a <= 2.5 {
        4
    } else if a < 3.5 {
        5
    } else if a <= 5.0 {
        6
    } else {
        7
    };
    sign | idx
}

/// Nearest E2M1 code of a value already known to be finite, as a sum of comparisons (no
/// branches, so the block loop vectorises); the thresholds put ties on the even code. Same
/// results as [`f64_to_e2m1`].
#[inline(always)]
pub fn f32_to_e2m1(x: f32) -> u8 {
    let a = x.abs();
    let idx = (a > 0.25) as u8
        + (a >= 0.75) as u8
        + (a > 1.25) as u8
        + (a >= 1.75) as u8
        + (a > 2.5) as u8
        + (a >= 3.5) as u8
        + (a > 5.0) as u8;
    idx | ((x.to_bits() >> 28) as u8 & 8)
}

/// `2^n` built from its exponent bits (exact; `n` within f64's normal range). `powi` is a
/// libm call per use, which made up a tenth of the requant's time.
#[inline(always)]
fn pow2(n: i32) -> f64 {
    f64::from_bits(((n + 1023) as u64) << 52)
}

/// Smallest `p` with `6 · 2^p ≥ amax` (`amax > 0`, finite, normal), from amax's exponent bits:
/// `amax ∈ [2^q, 2^(q+1))` puts `p` at `q - 2` or `q - 1`.
pub fn fp4_scale_exponent(amax: f64) -> i32 {
    let q = ((amax.to_bits() >> 52) & 0x7FF) as i32 - 1023;
    let mut p = q - 2;
    while 6.0 * pow2(p) < amax {
        p += 1;
    }
    while 6.0 * pow2(p - 1) >= amax {
        p -= 1;
    }
    p
}

#[derive(Debug, Default, Clone)]
pub struct QualityStats {
    pub rows: u64,
    pub sum_cosine: f64,
    pub min_cosine: f64,
    pub sum_sq_err: f64,
    pub sum_sq_ref: f64,
    pub blocks: u64,
    /// Blocks whose exponent was raised to the smallest E8M0 scale (2^-127).
    pub clamped_low: u64,
}

#[derive(Debug)]
pub struct EngramRequant {
    pub rows: u64,
    pub cols: u64,
    pub stats: Mutex<QualityStats>,
}

impl EngramRequant {
    pub fn new(rows: u64, cols: u64) -> EngramRequant {
        EngramRequant {
            rows,
            cols,
            stats: Mutex::new(QualityStats {
                min_cosine: f64::INFINITY,
                ..Default::default()
            }),
        }
    }
}

impl EngramRequant {
    /// Folds the sums of a run of rows (from the CPU or a GPU kernel) into the statistics.
    pub fn add_rows(&self, rows: &[RowSums], clamped_low: u64) {
        let mut local = QualityStats {
            min_cosine: f64::INFINITY,
            ..Default::default()
        };
        for r in rows {
            let cos = match (r.xx == 0.0, r.yy == 0.0) {
                (true, true) => 1.0,
                (true, false) | (false, true) => 0.0,
                _ => r.dot / (r.xx.sqrt() * r.yy.sqrt()),
            };
            local.rows += 1;
            local.sum_cosine += cos;
            local.min_cosine = local.min_cosine.min(cos);
            local.sum_sq_ref += r.xx;
            local.sum_sq_err += r.sq_err;
        }
        let mut st = self.stats.lock().unwrap();
        st.rows += local.rows;
        st.blocks += local.rows * (self.cols / BLOCK as u64);
        st.clamped_low += clamped_low;
        st.sum_cosine += local.sum_cosine;
        st.min_cosine = st.min_cosine.min(local.min_cosine);
        st.sum_sq_err += local.sum_sq_err;
        st.sum_sq_ref += local.sum_sq_ref;
    }
}

/// One row's requantisation: row `r`'s E4M3 `codes` and E8M0 `scales` in, packed E2M1 `out`
/// and `new_scales` out.
struct Row<'a> {
    r: u64,
    codes: &'a [u8],
    scales: &'a [u8],
    out: &'a mut [u8],
    new_scales: &'a mut [u8],
}

/// A public row function with the five-argument signature tests and benchmarks call, over the
/// private function `$body` of one [`Row`].
macro_rules! row_fn {
    ($(#[$doc:meta])* fn $name:ident => $body:ident) => {
        $(#[$doc])*
        pub fn $name(
            r: u64,
            codes: &[u8],
            scales: &[u8],
            out: &mut [u8],
            new_scales: &mut [u8],
        ) -> Result<(RowSums, u64), String> {
            $body(Row { r, codes, scales, out, new_scales })
        }
    };
}

row_fn! {
    /// Requantises row `r` (`codes`: E4M3, `scales`: E8M0 per 32) into packed E2M1 and new
    /// scales; returns its sums and the number of blocks raised to the smallest scale.
    ///
    /// Runs [`LANES`] blocks at a time through the lane-parallel path (AVX2 where the CPU has
    /// it, chosen at run time; the same portable code, auto-vectorised for the baseline target,
    /// elsewhere). Bytes, sums and errors are those of [`requant_row_scalar`], bit for bit.
    fn requant_row => requant_row_dispatch
}

fn requant_row_dispatch(row: Row) -> Result<(RowSums, u64), String> {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU has AVX2, checked just above.
        return unsafe { requant_row_avx2(row) };
    }
    requant_row_lanes(row)
}

row_fn! {
    /// [`requant_row`]'s lane-parallel path compiled for the baseline target (SSE2 on x86_64,
    /// NEON on aarch64), whatever the CPU has; public so tests and benchmarks can pin it.
    fn requant_row_portable => requant_row_lanes
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
fn requant_row_avx2(row: Row) -> Result<(RowSums, u64), String> {
    requant_row_lanes(row)
}

row_fn! {
    /// The reference twin of [`requant_row`]: one block and one element at a time, through the
    /// E4M3 table and [`f32_to_e2m1`] (the arithmetic of `engram_block` in kernels/fp4.cuh).
    /// Kept for the tests and `examples/kernel_speed.rs`; the lane path falls back to it for the
    /// blocks it does not take itself.
    fn requant_row_scalar => requant_row_scalar_of
}

fn requant_row_scalar_of(mut row: Row) -> Result<(RowSums, u64), String> {
    let (mut acc, blocks) = ((RowSums::default(), 0), 0..row.scales.len());
    requant_blocks_scalar(&mut row, blocks, &mut acc)?;
    Ok(acc)
}

/// Blocks `blocks` of `row`, one at a time, added in order to `acc` (row sums, clamped
/// blocks).
fn requant_blocks_scalar(
    row: &mut Row,
    blocks: Range<usize>,
    acc: &mut (RowSums, u64),
) -> Result<(), String> {
    let (r, codes, scales) = (row.r, row.codes, row.scales);
    let (out, new_scales) = (&mut *row.out, &mut *row.new_scales);
    let lut = e4m3_table();
    // Locals, as in the loop this twin keeps, so its speed stays the old kernel's.
    let (mut row, mut clamped) = *acc;
    for b in blocks {
        let e = scales[b];
        if e == 0xFF {
            return Err(format!("scale at [{r}, {b}] is NaN (E8M0 0xff)"));
        }
        let block = &codes[b * BLOCK..(b + 1) * BLOCK];
        // E4M3 is sign-magnitude with magnitudes ordered like their codes, and 0x7F is the
        // only NaN magnitude: one byte-wise max gives both the NaN check and max|v|.
        let top = block.iter().fold(0u8, |m, &c| m.max(c & 0x7F));
        if top == 0x7F {
            let j = block.iter().position(|&c| e4m3_is_nan(c)).expect("a NaN");
            return Err(format!(
                "non-finite F8_E4M3 code {:#04x} at [{r}, {}]",
                block[j],
                b * BLOCK + j
            ));
        }
        let m = lut[top as usize];
        let amax = m as f64 * pow2(e as i32 - 127);
        let p = if amax == 0.0 {
            -127
        } else {
            fp4_scale_exponent(amax)
        };
        if p > 127 {
            return Err(format!(
                "block [{r}, {b}] needs scale 2^{p}, beyond F8_E8M0's 2^127"
            ));
        }
        let p = if p < -127 {
            clamped += 1;
            -127
        } else {
            p
        };
        new_scales[b] = (p + 127) as u8;
        // Values relative to the new scale: e4m3 · 2^(e-127-p), exact in f32 because the
        // product is at most 6 and at least 2^-9 · 2^-7. An all-zero block keeps its signed
        // zeros: its factor 2^(e-127+127) would overflow f32 for e >= 128 (0 · ∞ = NaN).
        let rel = if m == 0.0 {
            1.0
        } else {
            pow2(e as i32 - 127 - p) as f32
        };
        let (mut bdot, mut bxx, mut byy) = (0f32, 0f32, 0f32);
        for (o, pair) in out[b * BLOCK / 2..(b + 1) * BLOCK / 2]
            .iter_mut()
            .zip(block.chunks_exact(2))
        {
            let x0 = lut[pair[0] as usize] * rel;
            let x1 = lut[pair[1] as usize] * rel;
            let (q0, q1) = (f32_to_e2m1(x0), f32_to_e2m1(x1));
            *o = q0 | (q1 << 4);
            let (y0, y1) = (e2m1_to_f32(q0), e2m1_to_f32(q1));
            bdot += x0 * y0 + x1 * y1;
            bxx += x0 * x0 + x1 * x1;
            byy += y0 * y0 + y1 * y1;
        }
        add_block(&mut row, bdot, bxx, byy, p);
    }
    *acc = (row, clamped);
    Ok(())
}

/// Adds one block's f32 sums, scaled by `2^(2p)`, to its row's f64 sums (`engram_row_add` in
/// kernels/fp4.cuh).
#[inline(always)]
fn add_block(row: &mut RowSums, bdot: f32, bxx: f32, byy: f32, p: i32) {
    let s2 = pow2(2 * p);
    row.dot += bdot as f64 * s2;
    row.xx += bxx as f64 * s2;
    row.yy += byy as f64 * s2;
    row.sq_err += (bxx as f64 - 2.0 * bdot as f64 + byy as f64).max(0.0) * s2;
}

/// Blocks requantised together by the lane-parallel path, one per lane (8 f32 = one AVX2
/// register; two NEON or SSE2 ones).
pub const LANES: usize = 8;

/// `fp4_scale_exponent(|v|)` of each E4M3 magnitude code 1..=0x7E. The exponent moves with
/// powers of two (every comparison in it is exact), so a block's is `table[top] + e - 127`.
fn scale_exponents() -> &'static [i32; 128] {
    static T: OnceLock<[i32; 128]> = OnceLock::new();
    T.get_or_init(|| {
        let lut = e4m3_table();
        std::array::from_fn(|t| {
            if t == 0 || t == 0x7F {
                0
            } else {
                fp4_scale_exponent(lut[t] as f64)
            }
        })
    })
}

/// Per-lane constants of a group, from each block's rescale exponent `k = e - 127 - p`:
/// adding `norm` to `mag << 20` (a normal E4M3 magnitude's exponent and mantissa moved into
/// f32's fields) gives the f32 bits of `|v| · 2^k`; `sub` is `2^(k-9)`, the value of a
/// subnormal's mantissa unit.
struct Lanes {
    norm: [u32; LANES],
    sub: [f32; LANES],
}

/// One element of a lane: its magnitude relative to the new scale (`|x|`, exact as in the
/// scalar loop), the magnitude of its E2M1 value (`|y|`) and its E2M1 code. `|x| ≤ 6` (the new
/// scale covers the block's max), so rounding to the E2M1 grid is adding and subtracting a
/// power of two whose ulp is the grid's step there (0.5 below 2, 1 below 4, 2 above), which
/// rounds ties to the even code exactly as [`f32_to_e2m1`]'s thresholds do.
#[inline(always)]
fn lane_encode(c: u32, norm: u32, sub: f32) -> (f32, f32, u32) {
    let mag = c & 0x7F;
    let normal = f32::from_bits((mag << 20).wrapping_add(norm));
    let subnormal = (mag as i32) as f32 * sub;
    let a = if mag >= 8 { normal } else { subnormal };
    let step = f32::from_bits((a.to_bits() & 0x7F80_0000).max(127 << 23) + (22 << 23));
    let y = (a + step) - step;
    // |y| ∈ {0, 0.5, 1, 1.5, 2, 3, 4, 6}: its bits >> 22 are 0, 252, 254, 255, …, 259.
    let yb = y.to_bits() >> 22;
    let idx = yb.max(252) - 252 + (yb == 252) as u32;
    (a, y, idx | ((c >> 4) & 8))
}

/// Requantises `LANES` consecutive blocks, lane `j` taking block `j` through the f32
/// operations of the scalar loop in the same order (the products are exact and equal to the
/// signed ones, so magnitudes serve), leaving each block's `[dot, xx, yy]` in `sums`.
#[inline(always)]
fn group_body(
    codes: &[u8; LANES * BLOCK],
    lanes: &Lanes,
    out: &mut [u8; LANES * BLOCK / 2],
    sums: &mut [[f32; LANES]; 3],
) {
    // words[q][j]: bytes 4q..4q+4 of block j, so that lanes are blocks.
    let mut words = [[0u32; LANES]; BLOCK / 4];
    for j in 0..LANES {
        for (q, w) in words.iter_mut().enumerate() {
            let at = j * BLOCK + 4 * q;
            w[j] = u32::from_le_bytes([codes[at], codes[at + 1], codes[at + 2], codes[at + 3]]);
        }
    }
    let (mut dot, mut xx, mut yy) = ([0f32; LANES], [0f32; LANES], [0f32; LANES]);
    let mut packed = [[0u32; LANES]; BLOCK / 8];
    for (q, w) in words.iter().enumerate() {
        for h in 0..2 {
            // Pair 2q + h: bytes 2h and 2h + 1 of word q, packed into byte (2q + h) % 4 of
            // output word q / 2.
            let shift = 8 * (2 * (q % 2) + h);
            for j in 0..LANES {
                let w = w[j] >> (16 * h);
                let (x0, y0, q0) = lane_encode(w & 0xFF, lanes.norm[j], lanes.sub[j]);
                let (x1, y1, q1) = lane_encode((w >> 8) & 0xFF, lanes.norm[j], lanes.sub[j]);
                packed[q / 2][j] |= (q0 | (q1 << 4)) << shift;
                dot[j] += x0 * y0 + x1 * y1;
                xx[j] += x0 * x0 + x1 * x1;
                yy[j] += y0 * y0 + y1 * y1;
            }
        }
    }
    for j in 0..LANES {
        for (t, p) in packed.iter().enumerate() {
            let at = j * BLOCK / 2 + 4 * t;
            out[at..at + 4].copy_from_slice(&p[j].to_le_bytes());
        }
    }
    *sums = [dot, xx, yy];
}

#[inline(always)]
fn requant_row_lanes(mut row: Row) -> Result<(RowSums, u64), String> {
    let (codes, scales) = (row.codes, row.scales);
    let exps = scale_exponents();
    let mut acc = (RowSums::default(), 0);
    let groups = scales.len() / LANES;
    for b0 in (0..groups).map(|g| g * LANES) {
        let gcodes: &[u8; LANES * BLOCK] = codes[b0 * BLOCK..(b0 + LANES) * BLOCK]
            .try_into()
            .expect("whole blocks");
        let mut lanes = Lanes {
            norm: [0; LANES],
            sub: [0.0; LANES],
        };
        let mut ps = [0i32; LANES];
        let mut clamped = 0;
        let mut regular = true;
        for (j, block) in gcodes.chunks_exact(BLOCK).enumerate() {
            let e = scales[b0 + j];
            let top = block.iter().fold(0u8, |m, &c| m.max(c & 0x7F));
            // NaNs and scales beyond E8M0 are the scalar loop's to report; an all-zero block
            // under a scale ≥ 2 would overflow this path's f32 rescale factor, and the scalar
            // loop keeps its signed zeros instead.
            if e == 0xFF || top == 0x7F || (top == 0 && e >= 128) {
                regular = false;
                break;
            }
            let p = if top == 0 {
                -127
            } else {
                exps[top as usize] + e as i32 - 127
            };
            if p > 127 {
                regular = false;
                break;
            }
            let p = if p < -127 {
                clamped += 1;
                -127
            } else {
                p
            };
            let k = e as i32 - 127 - p;
            ps[j] = p;
            lanes.norm[j] = ((120 + k) as u32) << 23;
            lanes.sub[j] = pow2(k - 9) as f32;
        }
        if !regular {
            let blocks = b0..b0 + LANES;
            requant_blocks_scalar(&mut row, blocks, &mut acc)?;
            continue;
        }
        acc.1 += clamped;
        let mut sums = [[0f32; LANES]; 3];
        let gout = (&mut row.out[b0 * BLOCK / 2..(b0 + LANES) * BLOCK / 2])
            .try_into()
            .expect("whole blocks");
        group_body(gcodes, &lanes, gout, &mut sums);
        for (j, &p) in ps.iter().enumerate() {
            row.new_scales[b0 + j] = (p + 127) as u8;
            add_block(&mut acc.0, sums[0][j], sums[1][j], sums[2][j], p);
        }
    }
    let tail = groups * LANES..scales.len();
    requant_blocks_scalar(&mut row, tail, &mut acc)?;
    Ok(acc)
}

impl Op for EngramRequant {
    op_name_and_kernel!("requant-e2m1", |op| Kernel::Engram { cols: op.cols });
    fn absorb(&self, stats: KernelStats) {
        let KernelStats::Engram { rows, clamped } = stats else {
            unreachable!("the Engram kernel's figures")
        };
        self.add_rows(&rows, clamped);
    }
    fn units(&self) -> u64 {
        self.rows
    }
    fn out_unit_bytes(&self) -> u64 {
        self.cols / 2
    }
    fn in_unit_bytes(&self) -> u64 {
        self.cols + self.cols / 32
    }
    fn extra_outputs(&self) -> usize {
        1
    }
    fn extra_unit_bytes(&self, _k: usize) -> u64 {
        self.cols / 32
    }
    fn input_ranges(&self, units: Range<u64>) -> Vec<Range<u64>> {
        let (c, s) = (self.cols, self.cols / 32);
        vec![
            units.start * c..units.end * c,
            units.start * s..units.end * s,
        ]
    }
    fn compute(&self, _: Range<u64>, _: &[&[u8]], _: &mut [u8]) -> Result<(), String> {
        unreachable!("requant-e2m1 always writes its scale output too")
    }
    fn compute_all(&self, units: Range<u64>, inputs: &[&[u8]], outs: Outs) -> Result<(), String> {
        let cols = self.cols as usize;
        let nblocks = cols / BLOCK;
        let (codes_out, scales_out) = match outs {
            [a, b] => (a, b),
            _ => unreachable!("two outputs"),
        };
        let mut rows = Vec::with_capacity((units.end - units.start) as usize);
        let mut clamped = 0;
        for (k, r) in units.enumerate() {
            let (sums, c) = requant_row(
                r,
                &inputs[0][k * cols..(k + 1) * cols],
                &inputs[1][k * nblocks..(k + 1) * nblocks],
                &mut codes_out[k * cols / 2..(k + 1) * cols / 2],
                &mut scales_out[k * nblocks..(k + 1) * nblocks],
            )?;
            rows.push(sums);
            clamped += c;
        }
        self.add_rows(&rows, clamped);
        Ok(())
    }
    fn report(&self) -> Option<serde_json::Value> {
        let st = self.stats.lock().unwrap();
        Some(serde_json::json!({
            "op": "requant-e2m1",
            "rows": st.rows,
            "blocks": st.blocks,
            "mean_row_cosine": if st.rows > 0 { st.sum_cosine / st.rows as f64 } else { 1.0 },
            "min_row_cosine": if st.rows > 0 { st.min_cosine } else { 1.0 },
            "relative_mse": if st.sum_sq_ref > 0.0 { st.sum_sq_err / st.sum_sq_ref } else { 0.0 },
            "blocks_at_min_scale": st.clamped_low,
        }))
    }
}

/// The midpoints between neighbouring E2M1 magnitudes and the code each rounds to (the even
/// one), for the tests of every E2M1 encoder.
#[cfg(test)]
pub(crate) const E2M1_TIES: [(f32, u8); 7] = [
    (0.25, 0),
    (0.75, 2),
    (1.25, 2),
    (1.75, 4),
    (2.5, 4),
    (3.5, 6),
    (5.0, 6),
];

/// Asserts that `code(y)` is `c` and `code(-y)` is `c` with the sign bit (8), for each case.
#[cfg(test)]
pub(crate) fn assert_signed_codes<T>(
    code: impl Fn(T) -> u8,
    cases: impl IntoIterator<Item = (T, u8)>,
) where
    T: Copy + std::ops::Neg<Output = T> + std::fmt::Display,
{
    for (y, c) in cases {
        assert_eq!(code(y), c, "{y}");
        assert_eq!(code(-y), c | 8, "-{y}");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn e2m1_encoding_matches_ml_dtypes() {
        let fx = crate::test_fixtures::scalars();
        let inputs = fx["inputs_f32_bits"].as_array().unwrap();
        let want = fx["encode_E2M1"].as_array().unwrap();
        let mut checked = 0;
        for (x, w) in inputs.iter().zip(want) {
            let x = f32::from_bits(x.as_u64().unwrap() as u32);
            if !x.is_finite() {
                continue;
            }
            assert_eq!(
                f64_to_e2m1(x as f64) as u64,
                w.as_u64().unwrap(),
                "E2M1 of {x:e}"
            );
            checked += 1;
        }
        assert!(checked > 3000);
        let decode: Vec<u32> = (0..16u8).map(|c| e2m1_to_f32(c).to_bits()).collect();
        let want: Vec<u32> = fx["decode"]["E2M1"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_u64().unwrap() as u32)
            .collect();
        assert_eq!(decode, want);
    }

    #[test]
    fn branchless_encoder_agrees_with_the_reference_one() {
        let mut x = 1e-3f32;
        while x < 20.0 {
            for v in [x, -x, x.next_up(), -x.next_down()] {
                assert_eq!(f32_to_e2m1(v), f64_to_e2m1(v as f64), "{v}");
            }
            x *= 1.0009;
        }
        for v in [
            0.0f32, -0.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, 1e30,
        ] {
            assert_eq!(f32_to_e2m1(v), f64_to_e2m1(v as f64), "{v}");
            assert_eq!(f32_to_e2m1(-v), f64_to_e2m1(-v as f64), "-{v}");
        }
    }

    #[test]
    fn all_16_codes_round_trip_and_ties_go_to_even() {
        for c in 0..16u8 {
            let back = f64_to_e2m1(e2m1_to_f32(c) as f64);
            assert_eq!(back, c, "code {c}");
        }
        let ties = E2M1_TIES.map(|(x, c)| (x as f64, c));
        assert_signed_codes(f64_to_e2m1, ties.into_iter().chain([(7.0, 7), (1e9, 7)]));
    }

    #[test]
    fn scale_exponent_is_the_smallest_that_covers_amax() {
        for (amax, p) in [
            (6.0, 0),
            (6.000001, 1),
            (3.0, -1),
            (448.0, 7),
            (0.75, -3),
            (2f64.powi(-136), -138),
        ] {
            assert_eq!(fp4_scale_exponent(amax), p, "{amax}");
        }
    }

    fn run(op: &EngramRequant, codes: &[u8], scales: &[u8]) -> Result<(Vec<u8>, Vec<u8>), String> {
        let (r, c) = (op.rows as usize, op.cols as usize);
        let mut a = vec![0u8; r * c / 2];
        let mut b = vec![0u8; r * c / 32];
        op.compute_all(0..op.rows, &[codes, scales], &mut [&mut a, &mut b])?;
        Ok((a, b))
    }

    #[test]
    fn requant_blocks_exactly() {
        let op = EngramRequant::new(2, 64);
        let mut codes = vec![0u8; 128];
        // Row 0, block 0: 1.0 (0x38) everywhere with scale 2^0 → amax 1 → p = -2 (6/4 ≥ 1).
        codes[..32].fill(0x38);
        // Row 0, block 1: zeros → scale 2^-127, codes 0.
        // Row 1, block 0: 448 (0x7E) and -448 with scale 2^-3 → amax 56 → p = 4 (96 ≥ 56).
        codes[64] = 0x7E;
        codes[65] = 0xFE;
        let scales = [127, 127, 124, 127];
        let (q, s) = run(&op, &codes, &scales).unwrap();
        assert_eq!(s, vec![125, 0, 131, 0]);
        // 1.0 / 2^-2 = 4 → idx 6, packed low and high.
        assert!(q[..16].iter().all(|&b| b == 0x66));
        assert!(q[16..32].iter().all(|&b| b == 0));
        // 56 / 16 = 3.5 → tie between 3 and 4 → 4 (idx 6); -3.5 → idx 14.
        assert_eq!(q[32], 0xE6);
        let st = op.stats.lock().unwrap();
        assert_eq!(st.rows, 2);
        assert!(st.min_cosine > 0.9 && st.min_cosine <= 1.0);
    }

    type RowFn = fn(u64, &[u8], &[u8], &mut [u8], &mut [u8]) -> Result<(RowSums, u64), String>;

    /// The lane paths (as dispatched, and the baseline build) against the scalar twin: same
    /// packed bytes, scales, clamped count, f64 sums to the bit (NaN included), same errors.
    fn assert_paths_agree(codes: &[u8], scales: &[u8]) {
        let (n, nb) = (codes.len(), scales.len());
        let mut want = (vec![0u8; n / 2], vec![0u8; nb]);
        let w = requant_row_scalar(3, codes, scales, &mut want.0, &mut want.1);
        for (name, f) in [
            ("dispatched", requant_row as RowFn),
            ("portable", requant_row_portable as RowFn),
        ] {
            let mut got = (vec![0xAAu8; n / 2], vec![0xAAu8; nb]);
            let g = f(3, codes, scales, &mut got.0, &mut got.1);
            match (&w, &g) {
                (Ok((ws, wc)), Ok((gs, gc))) => {
                    assert_eq!(got, want, "{name}: bytes, {codes:?} {scales:?}");
                    assert_eq!(gc, wc, "{name}: clamped");
                    let bits =
                        |s: &RowSums| [s.dot, s.xx, s.yy, s.sq_err].map(|v: f64| v.to_bits());
                    assert_eq!(bits(gs), bits(ws), "{name}: sums {gs:?} vs {ws:?}");
                }
                _ => assert_eq!(g, w, "{name}: result"),
            }
        }
    }

    struct XorShift(u64);
    impl XorShift {
        fn next(&mut self) -> u64 {
            self.0 ^= self.0 << 13;
            self.0 ^= self.0 >> 7;
            self.0 ^= self.0 << 17;
            self.0
        }
    }

    #[test]
    fn lane_path_matches_the_scalar_twin_on_random_rows() {
        let mut rng = XorShift(0x9E37_79B9_7F4A_7C15);
        for it in 0..3000 {
            let nb = 1 + (rng.next() % 27) as usize;
            let mut codes: Vec<u8> = (0..nb * BLOCK).map(|_| rng.next() as u8).collect();
            let mut scales: Vec<u8> = (0..nb).map(|_| rng.next() as u8).collect();
            for (b, s) in scales.iter_mut().enumerate() {
                let block = &mut codes[b * BLOCK..(b + 1) * BLOCK];
                match rng.next() % 8 {
                    // Typical weight scales.
                    0..=3 => *s = (100 + rng.next() % 40) as u8,
                    // Zero blocks, some with -0.
                    4 => {
                        block.fill(0);
                        if rng.next().is_multiple_of(2) {
                            block[(rng.next() % 32) as usize] = 0x80;
                        }
                    }
                    // Only E4M3 subnormals.
                    5 => block.iter_mut().for_each(|c| *c &= 0x87),
                    // Tiny scales: the new one clamps at 2^-127.
                    6 => *s = (rng.next() % 12) as u8,
                    _ => {}
                }
            }
            // NaN codes stay rare, so most rows get past them.
            for c in codes.iter_mut() {
                if *c & 0x7F == 0x7F && !rng.next().is_multiple_of(64) {
                    *c ^= 1;
                }
            }
            if it % 50 == 0 && nb > 1 {
                scales[1] = 0xFF;
            }
            assert_paths_agree(&codes, &scales);
        }
    }

    #[test]
    fn lane_path_matches_the_scalar_twin_for_every_scale_and_block_max() {
        // Every E8M0 scale and every block max `top`; the row's 8 blocks (one lane group)
        // hold every code whose magnitude is at most `top`, with both signs.
        for e in 0..=254u8 {
            for top in 0..0x7Fu8 {
                let mut codes: Vec<u8> = (0..=255u8)
                    .map(|v| if v & 0x7F > top { v & 0x80 | top } else { v })
                    .collect();
                for b in 0..LANES {
                    codes[b * BLOCK] = top;
                }
                assert_paths_agree(&codes, &[e; LANES]);
            }
        }
    }

    #[test]
    fn lane_path_refuses_what_the_scalar_twin_refuses() {
        let mut codes = vec![0x38u8; 3 * LANES * BLOCK];
        let scales = vec![127u8; 3 * LANES];
        for at in [0, 5, 31, 32, 255, 256, 300, 767] {
            for nan in [0x7F, 0xFF] {
                let keep = codes[at];
                codes[at] = nan;
                assert_paths_agree(&codes, &scales);
                let mut o = vec![0u8; codes.len() / 2];
                let mut s = vec![0u8; scales.len()];
                let err = requant_row(0, &codes, &scales, &mut o, &mut s).unwrap_err();
                assert!(err.contains(&format!("{nan:#04x} at [0, {at}]")), "{err}");
                codes[at] = keep;
            }
        }
        for b in [0, 7, 8, 23] {
            let mut bad = scales.clone();
            bad[b] = 0xFF;
            assert_paths_agree(&codes, &bad);
            // Beyond E8M0: 448 under 2^127 needs 2^128.
            let (mut big_c, mut big_s) = (codes.clone(), scales.clone());
            big_c[b * BLOCK + 3] = 0xFE;
            big_s[b] = 254;
            assert_paths_agree(&big_c, &big_s);
        }
        // An all-zero block under a large scale (the scalar loop's 0 · ∞) next to regular ones,
        // and one group whose every block is zero.
        let mut z = codes.clone();
        z[BLOCK..2 * BLOCK].fill(0);
        z[2 * LANES * BLOCK..].fill(0);
        for e in [127u8, 128, 200, 254] {
            let mut s = scales.clone();
            s[1] = e;
            s[2 * LANES..].fill(e);
            assert_paths_agree(&z, &s);
        }
    }

    #[test]
    fn an_all_zero_block_keeps_its_signed_zeros_under_any_scale() {
        let op = EngramRequant::new(1, 64);
        let mut codes = vec![0u8; 64];
        codes[33] = 0x80; // -0 in the second block
        for e in [0u8, 127, 128, 200, 254] {
            let scales = [e, e];
            let (mut out, mut new_scales) = (vec![0xAAu8; 32], vec![0u8; 2]);
            op.compute_all(0..1, &[&codes, &scales], &mut [&mut out, &mut new_scales])
                .unwrap();
            let mut want = vec![0u8; 32];
            want[16] = 0x80; // element 33: the high nibble of byte 16, E2M1 -0
            assert_eq!(out, want, "scale code {e}");
            assert_eq!(new_scales, [0, 0], "all-zero blocks get 2^-127");
        }
        let st = op.stats.lock().unwrap();
        assert!(st.sum_cosine.is_finite() && st.sum_sq_err == 0.0);
    }

    #[test]
    fn nan_inputs_are_errors() {
        let op = EngramRequant::new(1, 32);
        let mut codes = vec![0u8; 32];
        codes[5] = 0x7F;
        assert!(run(&op, &codes, &[127])
            .unwrap_err()
            .contains("0x7f at [0, 5]"));
        assert!(run(&op, &[0u8; 32], &[0xFF]).unwrap_err().contains("NaN"));
    }
}
