//! MXFP4 → NVFP4 transcode of expert weights, keeping the packed nibbles.
//!
//! MXFP4: `weight` `I8`/`U8` `[out, in/2]` (low nibble = even element), one `F8_E8M0` scale
//! `2^k` per 32 elements, `scale` `[out, in/32]`. NVFP4 (ModelOpt): the same nibbles as `U8`,
//! one `F8_E4M3` scale per 16 elements, `weight_scale` `[out, in/16]`, and an `F32` tensor
//! scale `weight_scale_2` `[]`; value = `e2m1 · weight_scale · weight_scale_2`.
//!
//! With tensor scale `2^g` each MXFP4 scale `2^k` becomes two block scales `2^(k-g)`, exact
//! when `k - g ∈ [-9, 8]` (E4M3 holds every power of two from 2^-9 to 2^8). A block outside
//! that window is re-encoded: its nibbles are rounded to the nearest values under the closest
//! E4M3 scale (448 above the window, 2^-9 below), never left under a wrong power of two. A
//! block whose nibbles are all ±0 is exact under any scale.

use std::ops::Range;

use super::engram::{e2m1_to_f32, f64_to_e2m1};
use crate::ops::fp8::codec::e4m3_to_f32;
use crate::ops::kernel::Kernel;
use crate::ops::Op;
use crate::plan::op_name_and_kernel;

/// Powers of two an E4M3 block scale holds exactly: 2^-9 … 2^8.
pub const WINDOW_LOW: i32 = -9;
pub const WINDOW_HIGH: i32 = 8;
const E4M3_MAX_CODE: u8 = 0x7E; // 448
const E4M3_MIN_CODE: u8 = 0x01; // 2^-9

/// E4M3 code of `2^e`, `e ∈ [-9, 8]`.
pub fn e4m3_pow2(e: i32) -> u8 {
    debug_assert!((WINDOW_LOW..=WINDOW_HIGH).contains(&e));
    if e >= -6 {
        ((e + 7) << 3) as u8
    } else {
        1 << (e + 9)
    }
}

/// Block scale code for source exponent `k` under tensor exponent `g`, and whether it is exact.
pub fn block_scale_code(k: i32, g: i32) -> (u8, bool) {
    let d = k - g;
    if d > WINDOW_HIGH {
        (E4M3_MAX_CODE, false)
    } else if d < WINDOW_LOW {
        (E4M3_MIN_CODE, false)
    } else {
        (e4m3_pow2(d), true)
    }
}

/// The tensor exponent `g` that puts the most of `exponents` (of non-zero blocks) inside the
/// 18-power window `[g-9, g+8]`. Ties go to the highest window, whose top is then the largest
/// covered exponent: values above the window would be clipped, those below only lose bits.
pub fn choose_g(exponents: &[i32]) -> i32 {
    let mut hist = [0u64; 256];
    for &k in exponents {
        hist[(k + 127) as usize] += 1;
    }
    let span = (WINDOW_HIGH - WINDOW_LOW) as usize; // 17
    let mut best: Option<(u64, usize)> = None;
    for top in 0..256 {
        if hist[top] == 0 {
            continue;
        }
        let count: u64 = hist[top.saturating_sub(span)..=top].iter().sum();
        if best.is_none_or(|(c, _)| count >= c) {
            best = Some((count, top));
        }
    }
    best.map_or(0, |(_, top)| top as i32 - 127 - WINDOW_HIGH)
}

/// Defines op `$name` over `rows` rows of `groups` MXFP4 blocks under the tensor scale `2^g`,
/// each block `$out` bytes out and `$in` bytes in, with the rest of its [`Op`] (`input_ranges`
/// and `compute`) given as `$method`s.
macro_rules! block_rows_op {
    ($(#[$doc:meta])* $name:ident, $label:literal, out: $out:literal, in: $in:literal,
     $($method:item)*) => {
        $(#[$doc])*
        #[derive(Debug)]
        pub struct $name {
            pub rows: u64,
            /// MXFP4 blocks (scales) per row (`in/32`).
            pub groups: u64,
            pub g: i32,
        }

        impl Op for $name {
            op_name_and_kernel!($label, |op| Kernel::$name { g: op.g });
            fn units(&self) -> u64 {
                self.rows
            }
            fn out_unit_bytes(&self) -> u64 {
                $out * self.groups
            }
            fn in_unit_bytes(&self) -> u64 {
                $in * self.groups
            }
            $($method)*
        }
    };
}

block_rows_op!(
    /// `weight_scale` from the MXFP4 scales: each E8M0 code becomes two E4M3 codes.
    NvBlockScales, "mxfp4-to-nvfp4 scales", out: 2, in: 1,
    fn input_ranges(&self, units: Range<u64>) -> Vec<Range<u64>> {
        std::iter::once(units.start * self.groups..units.end * self.groups).collect()
    }

    fn compute(&self, units: Range<u64>, inputs: &[&[u8]], out: &mut [u8]) -> Result<(), String> {
        // The new code depends only on the source code, so the 255 possible ones are mapped —
        // and checked — once, and the loop is a table lookup.
        let tensor_scale = 2f64.powi(self.g);
        let mut table = [0u8; 256];
        for c in 0..=254u8 {
            let k = c as i32 - 127;
            let (code, exact) = block_scale_code(k, self.g);
            // Checked, not assumed: an exact block must decode to the very same scale.
            if exact && e4m3_to_f32(code) as f64 * tensor_scale != 2f64.powi(k) {
                return Err(format!(
                    "internal error: block scale 2^{k} not reproduced under 2^{}",
                    self.g
                ));
            }
            table[c as usize] = code;
        }
        if let Some(i) = inputs[0].iter().position(|&c| c == 0xFF) {
            let row = units.start + i as u64 / self.groups;
            return Err(format!(
                "scale at [{row}, {}] is NaN (E8M0 0xff)",
                i as u64 % self.groups
            ));
        }
        for (o, &c) in out.chunks_exact_mut(2).zip(inputs[0]) {
            let code = table[c as usize];
            o[0] = code;
            o[1] = code;
        }
        Ok(())
    }
);

block_rows_op!(
    /// Packed nibbles with the blocks outside the window re-encoded (tensors that have any).
    NvReencode, "mxfp4-to-nvfp4 re-encode", out: 16, in: 17,
    fn input_ranges(&self, units: Range<u64>) -> Vec<Range<u64>> {
        vec![
            units.start * 16 * self.groups..units.end * 16 * self.groups,
            units.start * self.groups..units.end * self.groups,
        ]
    }
    fn compute(&self, _units: Range<u64>, inputs: &[&[u8]], out: &mut [u8]) -> Result<(), String> {
        for (b, (&c, packed)) in inputs[1].iter().zip(inputs[0].chunks_exact(16)).enumerate() {
            let dst = &mut out[16 * b..16 * (b + 1)];
            let k = c as i32 - 127;
            let (code, exact) = block_scale_code(k, self.g);
            if exact || packed.iter().all(|&x| x & 0x77 == 0) {
                dst.copy_from_slice(packed);
                continue;
            }
            // Values relative to 2^g, requantised under the block scale actually stored.
            let rel = 2f64.powi(k - self.g) / e4m3_to_f32(code) as f64;
            for (o, &x) in dst.iter_mut().zip(packed) {
                let lo = f64_to_e2m1(e2m1_to_f32(x & 0x0F) as f64 * rel);
                let hi = f64_to_e2m1(e2m1_to_f32(x >> 4) as f64 * rel);
                *o = lo | (hi << 4);
            }
        }
        Ok(())
    }
);

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::fp8::codec::e8m0_to_f32;

    #[test]
    fn every_power_in_the_window_is_exact_and_all_256_scales_are_handled() {
        for e in WINDOW_LOW..=WINDOW_HIGH {
            assert_eq!(e4m3_to_f32(e4m3_pow2(e)), 2f32.powi(e), "2^{e}");
        }
        // All 256 E8M0 codes under a few tensor scales: exact ones decode identically.
        for g in [-130, -20, 0, 7, 119] {
            for c in 0..=254u8 {
                let (code, exact) = block_scale_code(c as i32 - 127, g);
                let decoded = e4m3_to_f32(code) as f64 * 2f64.powi(g);
                assert_eq!(exact, decoded == e8m0_to_f32(c) as f64, "code {c:#x} g {g}");
            }
        }
    }

    #[test]
    fn window_choice() {
        // Spread of 18 powers: one window covers all, its top at the largest exponent.
        let spread: Vec<i32> = (-10..=7).collect();
        assert_eq!(choose_g(&spread), 7 - 8);
        // 19 powers: one block must fall out; the tie goes to the higher window.
        let wide: Vec<i32> = (-10..=8).collect();
        assert_eq!(choose_g(&wide), 0);
        // Outliers: many blocks around 0, a few far above; the dense cluster wins.
        let mut v = vec![0; 100];
        v.extend([1, 2, -3, 40, 41]);
        let g = choose_g(&v);
        assert!(g - 9 <= -3 && g + 8 >= 2, "g = {g}");
        assert_eq!(choose_g(&[]), 0);
        // Extremes of E8M0.
        assert_eq!(choose_g(&[-127, -127]), -135);
        assert_eq!(choose_g(&[127]), 119);
    }

    #[test]
    fn reencode_keeps_exact_blocks_and_rescales_the_others() {
        let op = NvReencode {
            rows: 1,
            groups: 3,
            g: 0,
        };
        let packed: Vec<u8> = (0..48u8)
            .map(|i| i.wrapping_mul(37) & 0x77 | 0x10)
            .collect();
        // Block 0 exact (2^1), block 1 above the window (2^10), block 2 below (2^-12).
        let scales = [128u8, 137, 115];
        let mut out = vec![0u8; 48];
        op.compute(0..1, &[&packed, &scales], &mut out).unwrap();
        assert_eq!(&out[..16], &packed[..16]);
        // Above: values e·2^10 under 448 → e·1024/448 ≈ 2.29e, saturating at 6.
        for (o, &x) in out[16..32].iter().zip(&packed[16..32]) {
            for (on, xn) in [(o & 0xF, x & 0xF), (o >> 4, x >> 4)] {
                let want = f64_to_e2m1(e2m1_to_f32(xn) as f64 * 1024.0 / 448.0);
                assert_eq!(on, want);
            }
        }
        // Below: e·2^-12 under 2^-9 → e/8, so everything but ±6 (→ 0.75 → 1) flushes to 0 or 0.5.
        for (o, &x) in out[32..48].iter().zip(&packed[32..48]) {
            assert_eq!(o & 0xF, f64_to_e2m1(e2m1_to_f32(x & 0xF) as f64 / 8.0));
        }
    }
}
