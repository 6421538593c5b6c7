//! **IQ4_NL** (`block_iq4_nl`, 18 bytes per 32 elements): `d: f16`, `qs: [u8; 16]`, element
//! `j` in the low nibble of `qs[j]` and `j + 16` in the high; value `d * KVALUES[q]`.
//! **IQ4_XS** (`block_iq4_xs`, 136 bytes per 256 elements): `d: f16`, `scales_h: u16` (the top
//! two bits of sub-block `ib`'s 6-bit scale at bit `2 ib`), `scales_l: [u8; 4]` (the low
//! nibbles, sub-block `2k` low and `2k + 1` high in byte `k`), `qs: [u8; 128]` (IQ4_NL's nibble
//! order per 32 elements); value `d * (scale - 32) * KVALUES[q]`.

use super::lanes::{self, simd, transpose, LANES};
#[cfg(test)]
use super::search::GROUP_MAX_EPS;
use super::{
    f16_bytes, for_each_block, imatrix_weights, nearest_int, signed_max, sub_blocks, sum_squares,
    KQuant, QK4_NL, QK_K,
};

/// `kvalues_iq4nl`: the 16 non-uniform levels.
const KVALUES: [i8; 16] = [
    -127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113,
];

/// [`KVALUES`] as f32, as the searches compare with them.
const KV: [f32; 16] = {
    let mut kv = [0.0; 16];
    let mut i = 0;
    while i < 16 {
        kv[i] = KVALUES[i] as f32;
        i += 1;
    }
    kv
};

/// The scale nudges `quantize_iq4_nl` / `quantize_iq4_xs` try each way (`ntry`).
const NTRY: i32 = 7;

/// IQ4_NL: blocks of 32 with an f16 scale and 4-bit indices into a non-uniform grid;
/// byte-exact to ggml 0c1e570's `quantize_iq4_nl` (the path `llama-quantize` takes: the
/// search of `quantize_row_iq4_nl_impl` with `ntry = 7`, weights the imatrix when given,
/// `x²` otherwise; `quantize_row_iq4_nl_ref`, with `ntry = -1`, is not used for files).
pub fn quantize_row_iq4_nl(src: &[f32], dst: &mut [u8], quant_weights: Option<&[f32]>) {
    let scales = row_scales(src, quant_weights, QK4_NL);
    let mut block = 0;
    for_each_block(KQuant::Iq4Nl, src, dst, quant_weights, |x, _, y| {
        let mut levels = [0u8; QK4_NL];
        let d = scales[block];
        block += 1;
        y[0..2].copy_from_slice(&f16_bytes(d));
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        lanes::nearest_indices(x, id, &KV, &mut levels);
        pack_nibbles(&levels, &mut y[2..18]);
    });
}

/// IQ4_XS: 8 sub-blocks of 32 with 6-bit scales under an f16 scale, IQ4_NL's 4-bit indices;
/// byte-exact to ggml 0c1e570's `quantize_iq4_xs` (`quantize_row_iq4_nl_impl` with
/// `ntry = 7`, weights the imatrix when given, `x²` otherwise; also what
/// `quantize_row_iq4_xs_ref` does).
pub fn quantize_row_iq4_xs(src: &[f32], dst: &mut [u8], quant_weights: Option<&[f32]>) {
    let row = row_scales(src, quant_weights, QK_K);
    let mut block = 0;
    for_each_block(KQuant::Iq4Xs, src, dst, quant_weights, |x, _, y| {
        let mut levels = [0u8; QK_K];
        let scales = &row[QK_K / 32 * block..QK_K / 32 * (block + 1)];
        block += 1;
        let max_scale = signed_max(scales).1;
        let d = -max_scale / 32.0;
        y[0..2].copy_from_slice(&f16_bytes(d));
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        let mut scales_h = 0u16;
        let mut scales_l = [0u8; 4];
        for (ib, (xs, ls)) in sub_blocks(x, &mut levels[..], 32) {
            let l = nearest_int(id * scales[ib]).clamp(-32, 31);
            let dl = d * l as f32;
            let idl = if dl != 0.0 { 1.0 / dl } else { 0.0 };
            lanes::nearest_indices(xs, idl, &KV, ls);
            let l = (l + 32) as u16;
            scales_l[ib / 2] |= ((l & 0xF) as u8) << (4 * (ib % 2));
            scales_h |= (l >> 4) << (2 * ib);
        }
        y[2..4].copy_from_slice(&scales_h.to_le_bytes());
        y[4..8].copy_from_slice(&scales_l);
        pack_nibbles(&levels, &mut y[8..136]);
    });
}

/// The search of `quantize_row_iq4_nl_impl` on every 32-element sub-block of a row of blocks of
/// `block` elements (32 for IQ4_NL, 256 for IQ4_XS, whose sum of squares sets the imatrix
/// weights' `sigma2`): each sub-block's scale, sixteen sub-blocks at a time in SIMD lanes
/// ([`lanes::iq4_fit`]), each exactly as [`fit_sub_blocks`] finds it. The first fit's levels
/// are not kept: both encoders recompute every level from the stored scales.
fn row_scales(src: &[f32], quant_weights: Option<&[f32]>, block: usize) -> Vec<f32> {
    let mut weights = vec![0.0f32; src.len()];
    for (b, (xb, wb)) in src
        .chunks_exact(block)
        .zip(weights.chunks_exact_mut(block))
        .enumerate()
    {
        match quant_weights {
            Some(qw) => {
                let sigma2 = sum_squares(xb) * (2.0 / xb.len() as f32);
                let qb = &qw[block * b..block * (b + 1)];
                for ((w, q), x) in wb
                    .chunks_exact_mut(32)
                    .zip(qb.chunks_exact(32))
                    .zip(xb.chunks_exact(32))
                {
                    imatrix_weights(w, q, x, sigma2);
                }
            }
            None => {
                for (w, &e) in wb.iter_mut().zip(xb) {
                    *w = e * e;
                }
            }
        }
    }
    let n = src.len() / 32;
    let mut scales = vec![0.0f32; n];
    let (mut xpad, mut wpad) = (Vec::new(), Vec::new());
    for first in (0..n).step_by(LANES) {
        let count = (n - first).min(LANES);
        let (xs, ws, at) = if count == LANES {
            (src, &weights[..], first)
        } else {
            // The row's last sub-blocks, beside all-zero ones (scale 0, dropped).
            xpad.resize(32 * LANES, 0.0);
            wpad.resize(32 * LANES, 0.0);
            xpad[..32 * count].copy_from_slice(&src[32 * first..]);
            wpad[..32 * count].copy_from_slice(&weights[32 * first..]);
            (&xpad[..], &wpad[..], 0)
        };
        let (xt, wt) = (transpose::<32>(xs, at), transpose::<32>(ws, at));
        let s = simd(
            #[inline(always)]
            || lanes::iq4_fit(&xt, &wt, &KV, NTRY),
        );
        scales[first..first + count].copy_from_slice(&s[..count]);
    }
    scales
}

/// The per-sub-block search of `quantize_row_iq4_nl_impl` as ggml writes it, one sub-block at a
/// time: for each 32 elements the scale that best fits their nearest grid levels, tried at
/// `2 NTRY + 1` nudged inverse scales (a sub-block below `GROUP_MAX_EPS` gets scale 0). Fills
/// `scales` and the first fit's levels; returns the scale of largest magnitude. The encoders
/// run it in lanes ([`row_scales`]); this is what the lanes are checked against.
#[cfg(test)]
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
#[cfg(test)]
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

#[cfg(test)]
mod tests {
    use super::*;

    /// Rows of blocks that take each branch: ordinary values, an all-zero and a tiny sub-block,
    /// exact ties, outliers, NaN and infinity, and an odd number of sub-blocks left for the
    /// last lane group.
    fn row(n: usize, seed: u64) -> Vec<f32> {
        let mut s = seed | 1;
        let mut x: Vec<f32> = (0..n)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                ((s >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 0.1
            })
            .collect();
        x[32..64].fill(0.0);
        x[64..96].iter_mut().for_each(|v| *v *= 1e-16);
        x[96..128]
            .iter_mut()
            .enumerate()
            .for_each(|(i, v)| *v = (i as f32 - 16.0) * 0.125);
        x[130] = 3.0;
        x[170] = f32::NAN;
        x[200] = f32::INFINITY;
        x
    }

    #[test]
    fn nearest_levels_in_lanes_are_the_bisections_ties_included() {
        // Every half step from below the first level to past the last (each midpoint between
        // two levels is a tie), the levels' neighbours in f32, infinities and NaN.
        let mut v: Vec<f32> = (-270..=250).map(|h| h as f32 * 0.5).collect();
        for k in KVALUES {
            let k = f32::from(k);
            v.extend([k, k.next_up(), k.next_down()]);
        }
        v.extend([f32::INFINITY, f32::NEG_INFINITY, f32::NAN, -0.0]);
        for chunk in v.chunks(LANES) {
            let mut lane = [0.0f32; LANES];
            lane[..chunk.len()].copy_from_slice(chunk);
            let got = lanes::nearest_levels(lane, &KV);
            let mut doubled = [0.0f32; 2 * LANES];
            doubled[..LANES].copy_from_slice(&lane);
            doubled[LANES..].copy_from_slice(&lane);
            let mut index = [0u8; 2 * LANES];
            lanes::nearest_indices(&doubled, 1.0, &KV, &mut index);
            for (k, &x) in chunk.iter().enumerate() {
                let want = best_index(x);
                assert_eq!(got[k], f32::from(KVALUES[want as usize]), "{x}");
                assert_eq!((index[k], index[LANES + k]), (want, want), "{x}");
            }
        }
    }

    #[test]
    fn row_scales_in_lanes_equal_the_scalar_search_bit_for_bit() {
        // 9 blocks of 256 (72 sub-blocks: four full lane groups and 8 left), both block sizes.
        let x = row(9 * QK_K, 0x1A4);
        let qw: Vec<f32> = row(9 * QK_K, 0x2B5)
            .iter()
            .map(|v| v * v * 100.0 + 0.01)
            .collect();
        for block in [QK4_NL, QK_K] {
            for weights in [None, Some(&qw[..])] {
                let lanes = row_scales(&x, weights, block);
                let mut want = Vec::new();
                for (b, xb) in x.chunks_exact(block).enumerate() {
                    let mut levels = vec![0u8; block];
                    let mut scales = vec![0.0f32; block / 32];
                    let qb = weights.map(|w| &w[block * b..block * (b + 1)]);
                    fit_sub_blocks(xb, qb, &mut levels, &mut scales);
                    want.extend(scales);
                }
                let bits = |v: &[f32]| v.iter().map(|s| s.to_bits()).collect::<Vec<_>>();
                assert_eq!(
                    bits(&lanes),
                    bits(&want),
                    "block {block}, weights {}",
                    weights.is_some()
                );
            }
        }
    }
}
