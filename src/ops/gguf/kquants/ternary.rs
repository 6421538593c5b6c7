//! Ternary types (values `{-1, 0, 1} * d`, `d` the block's largest magnitude):
//! **TQ1_0** (`block_tq1_0`, 54 bytes per 256 elements): `qs: [u8; 48]`, `qh: [u8; 4]`,
//! `d: f16`. Trits are packed five to a byte as `ceil(t * 256 / 243)` of the base-3 number
//! `t` (first trit most significant): `qs[m]` (m < 32) holds elements `m + 32n`, n in 0..5;
//! `qs[32 + m]` (m < 16) elements `160 + m + 16n`; `qh[j]` holds elements `240 + j + 4n`, n in
//! 0..4, shifted up one trit.
//! **TQ2_0** (`block_tq2_0`, 66 bytes per 256 elements): `qs: [u8; 64]`, `d: f16`; trit + 1 in
//! two bits, byte `32h + m` holding elements `128h + m + 32n` at bits `2n`.

use super::{c_max, check_row, f16_bytes, KQuant, QK_K};

/// TQ1_0: 1.6875 bits per weight; byte-exact to ggml 0c1e570's `quantize_tq1_0`
/// (`quantize_row_tq1_0_ref`; ggml ignores quant weights for this type, and so does this).
pub fn quantize_row_tq1_0(src: &[f32], dst: &mut [u8], quant_weights: Option<&[f32]>) {
    check_row(KQuant::Tq1_0, src, dst, quant_weights);
    for (x, y) in src.chunks_exact(QK_K).zip(dst.chunks_exact_mut(54)) {
        let id = inverse_amax(x, &mut y[52..54]);
        let (qs, qh) = y.split_at_mut(48);
        for m in 0..32 {
            qs[m] = trits_to_byte((0..5).map(|n| trit(x[m + 32 * n], id)));
        }
        for m in 0..16 {
            qs[32 + m] = trits_to_byte((0..5).map(|n| trit(x[160 + m + 16 * n], id)));
        }
        for j in 0..4 {
            // Four trits then a zero one, so the first sits in the top trit.
            let trits = (0..4).map(|n| trit(x[240 + j + 4 * n], id)).chain([0]);
            qh[j] = trits_to_byte(trits);
        }
    }
}

/// TQ2_0: 2.0625 bits per weight; byte-exact to ggml 0c1e570's `quantize_tq2_0`
/// (`quantize_row_tq2_0_ref`; quant weights ignored as ggml ignores them).
pub fn quantize_row_tq2_0(src: &[f32], dst: &mut [u8], quant_weights: Option<&[f32]>) {
    check_row(KQuant::Tq2_0, src, dst, quant_weights);
    for (x, y) in src.chunks_exact(QK_K).zip(dst.chunks_exact_mut(66)) {
        let id = inverse_amax(x, &mut y[64..66]);
        for (h, half) in x.chunks_exact(128).enumerate() {
            for m in 0..32 {
                let mut q = 0u8;
                for n in 0..4 {
                    q = q.wrapping_add(((trit(half[m + 32 * n], id) & 3) << (2 * n)) as u8);
                }
                y[32 * h + m] = q;
            }
        }
    }
}

/// Writes `d = max |x|` as f16 and returns `1 / d` (0 for an all-zero block).
fn inverse_amax(x: &[f32], d_out: &mut [u8]) -> f32 {
    let mut amax = 0.0f32;
    for &v in x {
        amax = c_max(amax, v.abs());
    }
    d_out.copy_from_slice(&f16_bytes(amax));
    if amax != 0.0 {
        1.0 / amax
    } else {
        0.0
    }
}

/// 2^63: `lroundf`'s `long` holds every smaller magnitude.
const TWO_POW_63: f32 = 9_223_372_036_854_775_808.0;

/// `lroundf(x * id) + 1`, the trit plus one, as ggml computes it into an `int`: `lroundf`
/// rounds half away from zero and gives `LONG_MIN` (low 32 bits 0) for NaN and out-of-range.
#[inline]
fn trit(x: f32, id: f32) -> i32 {
    let v = x * id;
    let r = if v.abs() < TWO_POW_63 {
        v.round() as i64
    } else {
        i64::MIN
    };
    (r as i32).wrapping_add(1)
}

/// Five base-3 digits (first most significant, each added in `u8` arithmetic as ggml does),
/// then `ceil(q * 256 / 243)` truncated to a byte.
fn trits_to_byte(trits: impl Iterator<Item = i32>) -> u8 {
    let mut q = 0u8;
    for t in trits {
        q = q.wrapping_mul(3).wrapping_add(t as u8);
    }
    (q as u32 * 256).div_ceil(243) as u8
}
