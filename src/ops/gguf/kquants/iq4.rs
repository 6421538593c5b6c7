//! **IQ4_NL** (`block_iq4_nl`, 18 bytes per 32 elements): `d: f16`, `qs: [u8; 16]`, element
//! `j` in the low nibble of `qs[j]` and `j + 16` in the high; value `d * KVALUES[q]`.
//! **IQ4_XS** (`block_iq4_xs`, 136 bytes per 256 elements): `d: f16`, `scales_h: u16` (the top
//! two bits of sub-block `ib`'s 6-bit scale at bit `2 ib`), `scales_l: [u8; 4]` (the low
//! nibbles, sub-block `2k` low and `2k + 1` high in byte `k`), `qs: [u8; 128]` (IQ4_NL's nibble
//! order per 32 elements); value `d * (scale - 32) * KVALUES[q]`.

use super::search::GROUP_MAX_EPS;
use super::{
    f16_bytes, for_each_block, imatrix_weights, nearest_int, signed_max, sub_blocks, sum_squares,
    KQuant, QK4_NL, QK_K,
};

/// `kvalues_iq4nl`: the 16 non-uniform levels.
const KVALUES: [i8; 16] = [
    -127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113,
];

/// The scale nudges `quantize_iq4_nl` / `quantize_iq4_xs` try each way (`ntry`).
const NTRY: i32 = 7;

/// IQ4_NL: blocks of 32 with an f16 scale and 4-bit indices into a non-uniform grid;
/// byte-exact to ggml 0c1e570's `quantize_iq4_nl` (the path `llama-quantize` takes: the
/// search of `quantize_row_iq4_nl_impl` with `ntry = 7`, weights the imatrix when given,
/// `x²` otherwise; `quantize_row_iq4_nl_ref`, with `ntry = -1`, is not used for files).
pub fn quantize_row_iq4_nl(src: &[f32], dst: &mut [u8], quant_weights: Option<&[f32]>) {
    let mut scales = [0.0f32; 1];
    for_each_block(KQuant::Iq4Nl, src, dst, quant_weights, |x, qw, y| {
        let mut levels = [0u8; QK4_NL];
        fit_sub_blocks(x, qw, &mut levels, &mut scales);
        y[0..2].copy_from_slice(&f16_bytes(scales[0]));
        let id = if scales[0] != 0.0 {
            1.0 / scales[0]
        } else {
            0.0
        };
        for (l, &e) in levels.iter_mut().zip(x) {
            *l = best_index(id * e);
        }
        pack_nibbles(&levels, &mut y[2..18]);
    });
}

/// IQ4_XS: 8 sub-blocks of 32 with 6-bit scales under an f16 scale, IQ4_NL's 4-bit indices;
/// byte-exact to ggml 0c1e570's `quantize_iq4_xs` (`quantize_row_iq4_nl_impl` with
/// `ntry = 7`, weights the imatrix when given, `x²` otherwise; also what
/// `quantize_row_iq4_xs_ref` does).
pub fn quantize_row_iq4_xs(src: &[f32], dst: &mut [u8], quant_weights: Option<&[f32]>) {
    let mut scales = [0.0f32; QK_K / 32];
    for_each_block(KQuant::Iq4Xs, src, dst, quant_weights, |x, qw, y| {
        let mut levels = [0u8; QK_K];
        let max_scale = fit_sub_blocks(x, qw, &mut levels, &mut scales);
        let d = -max_scale / 32.0;
        y[0..2].copy_from_slice(&f16_bytes(d));
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        let mut scales_h = 0u16;
        let mut scales_l = [0u8; 4];
        for (ib, (xs, ls)) in sub_blocks(x, &mut levels[..], 32) {
            let l = nearest_int(id * scales[ib]).clamp(-32, 31);
            let dl = d * l as f32;
            let idl = if dl != 0.0 { 1.0 / dl } else { 0.0 };
            for (q, &e) in ls.iter_mut().zip(xs) {
                *q = best_index(idl * e);
            }
            let l = (l + 32) as u16;
            scales_l[ib / 2] |= ((l & 0xF) as u8) << (4 * (ib % 2));
            scales_h |= (l >> 4) << (2 * ib);
        }
        y[2..4].copy_from_slice(&scales_h.to_le_bytes());
        y[4..8].copy_from_slice(&scales_l);
        pack_nibbles(&levels, &mut y[8..136]);
    });
}

/// The per-sub-block search of `quantize_row_iq4_nl_impl`: for each 32 elements the scale that
/// best fits their nearest grid levels, tried at `2 NTRY + 1` nudged inverse scales (a
/// sub-block below `GROUP_MAX_EPS` gets scale 0). Fills `scales` and the first fit's levels;
/// returns the scale of largest magnitude.
fn fit_sub_blocks(x: &[f32], qw: Option<&[f32]>, levels: &mut [u8], scales: &mut [f32]) -> f32 {
    let sigma2 = sum_squares(x) * (2.0 / x.len() as f32);
    let mut weight = [0.0f32; 32];
    for (ib, (xb, lb)) in sub_blocks(x, &mut levels[..], 32) {
        match qw {
            Some(qw) => {
                imatrix_weights(&mut weight, &qw[32 * ib..32 * (ib + 1)], xb, sigma2);
            }
            None => {
                for (w, &e) in weight.iter_mut().zip(xb) {
                    *w = e * e;
                }
            }
        }
        let (amax, max) = signed_max(xb);
        if amax < GROUP_MAX_EPS {
            scales[ib] = 0.0;
            continue;
        }
        let mut d = -max / KVALUES[0] as f32;
        let id = 1.0 / d;
        let (mut sumqx, mut sumq2) = (0.0f32, 0.0f32);
        for ((l, &e), &w) in lb.iter_mut().zip(xb).zip(&weight) {
            *l = best_index(id * e);
            let q = KVALUES[*l as usize] as f32;
            sumqx += w * q * e;
            sumq2 += w * q * q;
        }
        d = if sumq2 > 0.0 { sumqx / sumq2 } else { 0.0 };
        let mut best = d * sumqx;
        for itry in -NTRY..=NTRY {
            let id = (itry + KVALUES[0] as i32) as f32 / max;
            let (mut sumqx, mut sumq2) = (0.0f32, 0.0f32);
            for (&e, &w) in xb.iter().zip(&weight) {
                let q = KVALUES[best_index(id * e) as usize] as f32;
                sumqx += w * q * e;
                sumq2 += w * q * q;
            }
            if sumq2 > 0.0 && sumqx * sumqx > best * sumq2 {
                d = sumqx / sumq2;
                best = d * sumqx;
            }
        }
        scales[ib] = d;
    }
    signed_max(scales).1
}

/// `best_index_int8(16, kvalues_iq4nl, x)`: the nearest grid level by bisection, the lower one
/// unless the upper is strictly nearer.
#[inline]
fn best_index(x: f32) -> u8 {
    if x <= KVALUES[0] as f32 {
        return 0;
    }
    if x >= KVALUES[15] as f32 {
        return 15;
    }
    let (mut ml, mut mu) = (0usize, 15usize);
    while mu - ml > 1 {
        let mav = (ml + mu) / 2;
        if x < KVALUES[mav] as f32 {
            mu = mav;
        } else {
            ml = mav;
        }
    }
    if x - (KVALUES[mu - 1] as f32) < KVALUES[mu] as f32 - x {
        (mu - 1) as u8
    } else {
        mu as u8
    }
}

/// Per 32 levels, 16 bytes: element `j` low nibble, `j + 16` high nibble.
fn pack_nibbles(levels: &[u8], qs: &mut [u8]) {
    for (l, q) in levels.chunks_exact(32).zip(qs.chunks_exact_mut(16)) {
        for j in 0..16 {
            q[j] = l[j] | (l[16 + j] << 4);
        }
    }
}
