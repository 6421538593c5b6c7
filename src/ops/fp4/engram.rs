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
use std::sync::Mutex;

use super::kernel::RowSums;
use crate::ops::fp8::codec::{e4m3_is_nan, e4m3_table};
use crate::ops::kernel::{Kernel, KernelStats};
use crate::ops::Op;

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

/// Requantises row `r` (`codes`: E4M3, `scales`: E8M0 per 32) into packed E2M1 and new scales;
/// returns its sums and the number of blocks raised to the smallest scale.
pub fn requant_row(
    r: u64,
    codes: &[u8],
    scales: &[u8],
    out: &mut [u8],
    new_scales: &mut [u8],
) -> Result<(RowSums, u64), String> {
    let lut = e4m3_table();
    let mut row = RowSums::default();
    let mut clamped = 0;
    for (b, &e) in scales.iter().enumerate() {
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
        // product is at most 6 and at least 2^-9 · 2^-7.
        let rel = pow2(e as i32 - 127 - p) as f32;
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
        let s2 = pow2(2 * p);
        row.dot += bdot as f64 * s2;
        row.xx += bxx as f64 * s2;
        row.yy += byy as f64 * s2;
        row.sq_err += (bxx as f64 - 2.0 * bdot as f64 + byy as f64).max(0.0) * s2;
    }
    Ok((row, clamped))
}

impl Op for EngramRequant {
    fn kernel(&self, _units: &Range<u64>) -> Option<Kernel> {
        Some(Kernel::Engram { cols: self.cols })
    }
    fn absorb(&self, stats: KernelStats) {
        let KernelStats::Engram { rows, clamped } = stats;
        self.add_rows(&rows, clamped);
    }
    fn name(&self) -> &'static str {
        "requant-e2m1"
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
    fn compute(
        &self,
        _units: Range<u64>,
        _inputs: &[&[u8]],
        _out: &mut [u8],
    ) -> Result<(), String> {
        unreachable!("requant-e2m1 always writes its scale output too")
    }
    fn compute_all(
        &self,
        units: Range<u64>,
        inputs: &[&[u8]],
        outs: &mut [&mut [u8]],
    ) -> Result<(), String> {
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
        for (x, idx) in [
            (0.25, 0),
            (0.75, 2),
            (1.25, 2),
            (1.75, 4),
            (2.5, 4),
            (3.5, 6),
            (5.0, 6),
            (7.0, 7),
            (1e9, 7),
        ] {
            assert_eq!(f64_to_e2m1(x), idx, "{x}");
            assert_eq!(f64_to_e2m1(-x), idx | 8, "-{x}");
        }
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
