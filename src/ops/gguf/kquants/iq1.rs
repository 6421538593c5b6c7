//! The 1-bit lattice types: ternary levels `-1, 0, 1` shifted by `±δ` (`δ = 1/8`), groups of
//! 8 on a 2048-point grid ([`iq2_grid`], `kgrid_1bit_2048`), 3-bit sub-block scales.
//!
//! **IQ1_S** (`block_iq1_s`, 50 bytes per 256; sub-blocks of 32): `d: f16` (stored times
//! 1.125), `qs: [u8; 32]` (the low 8 bits of group `4 ib + k`'s index), `qh: [u16; 8]` (per
//! sub-block: bits `3k..3k + 3` group `k`'s top index bits, bits `12..15` the scale `l`, bit
//! 15 the shift's sign: set for `-δ`). Value `d (2 l + 1) (level - 1 + shift)`.
//!
//! **IQ1_M** (`block_iq1_m`, 56 bytes; sub-blocks of 16, a shift per group of 8): `qs: [u8;
//! 32]`, `qh: [u8; 16]` (per sub-block: bits `0..3` and `4..7` the two groups' top index bits,
//! bits 3 and 7 their shifts' signs), `scales: [u8; 8]` read as four little-endian `u16`s:
//! bits `3j..3j + 3` of `u16` `ib / 4` sub-block `ib`'s scale, and the top nibbles of the four
//! together the f16 super-block scale (refitted to all levels, stored times 1.1125).
//!
//! The search (`quantize_row_iq1_{s,m}_impl`): per sub-block the values are sorted (glibc's
//! `qsort`, a stable merge sort for arrays this small: ties keep their order) and every split
//! into three runs is scored exactly with prefix sums; groups off the grid move to the
//! neighbour nearest at the fitted scale. IQ1_S has no reference without an importance matrix
//! (ggml asserts one); IQ1_M weights `x²` then.

use super::iq2_grid::{grid, Grid, Lattice};
use super::{
    c_max, for_each_block, for_each_weighted_block, imatrix_weights, nearest_int, sum_squares,
    SubScales,
};
use super::{KQuant, QK_K};

/// `IQ1S_DELTA` = `IQ1M_DELTA`.
const DELTA: f32 = 0.125;
/// The three level values with the shift `+δ` (`x_p`) and `-δ` (`x_m`).
const X_P: [f32; 3] = [-1.0 + DELTA, DELTA, 1.0 + DELTA];
const X_M: [f32; 3] = [-1.0 - DELTA, -DELTA, 1.0 - DELTA];
/// `GROUP_MAX_EPS_IQ1_S`, `GROUP_MAX_EPS_IQ1_M`.
const EPS_IQ1_S: f32 = 1e-12;
const EPS_IQ1_M: f32 = 1e-7;

/// IQ1_S: 1.56 bits per weight; byte-exact to ggml 0c1e570's `quantize_iq1_s`. Needs
/// importance weights (ggml asserts them; planning refuses the type without).
pub fn quantize_row_iq1_s(src: &[f32], dst: &mut [u8], quant_weights: Option<&[f32]>) {
    for_each_weighted_block(KQuant::Iq1S, src, dst, quant_weights, |x, qw, y| {
        const QH: usize = 34;
        y.fill(0);
        let g = grid(Lattice::Iq1);
        let sigma2 = 2.0 * sum_squares(x) / QK_K as f32;
        let mut sub = SubScales::<8>::new();
        let mut shifts = [1i8; 8];
        for (ib, xb) in x.chunks_exact(32).enumerate() {
            let mut weight = [0.0f32; 32];
            imatrix_weights(&mut weight, &qw[32 * ib..32 * ib + 32], xb, sigma2);
            let Some((levels, mut scale, shift)) = split_iq1_s(xb, &weight) else {
                continue;
            };
            let xx = if shift == 1 { &X_P } else { &X_M };
            let mut index = [0usize; 4];
            let mut all_on_grid = true;
            for (k, ix) in index.iter_mut().enumerate() {
                let r = 8 * k..8 * k + 8;
                let (i, hit) =
                    to_grid(g, &levels[r.clone()], &xb[r.clone()], &weight[r], scale, xx);
                *ix = i;
                all_on_grid &= hit;
            }
            if !all_on_grid {
                let (sumqx, sumq2) = refit(g, xb, &weight, &index, |_| xx);
                if sumqx > 0.0 && sumq2 > 0.0 {
                    scale = sumqx / sumq2;
                }
            }
            let mut h = 0u16;
            for (k, &i) in index.iter().enumerate() {
                y[2 + 4 * ib + k] = i as u8;
                h |= ((i >> 8) << (3 * k)) as u16;
            }
            y[QH + 2 * ib..QH + 2 * ib + 2].copy_from_slice(&h.to_le_bytes());
            sub.set(ib, scale);
            shifts[ib] = shift;
        }
        let Some(d) = sub.put_super_scale(15.0, 1.125, y) else {
            return;
        };
        let id = 1.0 / d;
        for ib in 0..8 {
            let mut l = scale_level(id, sub.scales[ib]);
            if shifts[ib] == -1 {
                l |= 8;
            }
            y[QH + 2 * ib + 1] |= l << 4;
        }
    });
}

/// IQ1_M: 1.75 bits per weight; byte-exact to ggml 0c1e570's `quantize_iq1_m` (weights the
/// imatrix when given, `x²` otherwise, as ggml does).
pub fn quantize_row_iq1_m(src: &[f32], dst: &mut [u8], quant_weights: Option<&[f32]>) {
    for_each_block(KQuant::Iq1M, src, dst, quant_weights, |x, qw, y| {
        const QH: usize = 32;
        const SC: usize = 48;
        y.fill(0);
        let g = grid(Lattice::Iq1);
        let sigma2 = 2.0 * sum_squares(x) / QK_K as f32;
        let weights = |ib: usize| {
            let xb = &x[16 * ib..16 * ib + 16];
            let mut weight = [0.0f32; 16];
            match qw {
                Some(qw) => {
                    imatrix_weights(&mut weight, &qw[16 * ib..16 * ib + 16], xb, sigma2);
                }
                None => {
                    for (w, &e) in weight.iter_mut().zip(xb) {
                        *w = e * e;
                    }
                }
            }
            weight
        };
        let mut scales = [0.0f32; 16];
        let mut shifts = [0usize; 16];
        let mut max_scale = 0.0f32;
        for (ib, xb) in x.chunks_exact(16).enumerate() {
            let weight = weights(ib);
            let Some((levels, mut scale, best_k)) = split_iq1_m(xb, &weight) else {
                continue;
            };
            let mut index = [0usize; 2];
            let mut all_on_grid = true;
            for (k, ix) in index.iter_mut().enumerate() {
                let r = 8 * k..8 * k + 8;
                let xx = group_shift(best_k, k);
                let (i, hit) =
                    to_grid(g, &levels[r.clone()], &xb[r.clone()], &weight[r], scale, xx);
                *ix = i;
                all_on_grid &= hit;
            }
            if !all_on_grid {
                let (sumqx, sumq2) = refit(g, xb, &weight, &index, |k| group_shift(best_k, k));
                if sumqx > 0.0 && sumq2 > 0.0 {
                    scale = sumqx / sumq2;
                }
            }
            y[2 * ib] = index[0] as u8;
            y[2 * ib + 1] = index[1] as u8;
            y[QH + ib] = ((index[0] >> 8) | ((index[1] >> 8) << 4)) as u8;
            scales[ib] = scale;
            shifts[ib] = best_k;
            max_scale = c_max(max_scale, scale);
        }
        if max_scale == 0.0 {
            return;
        }
        // The sub-block scales, then the super-block scale refitted to every element's level.
        const MASKS: [u8; 4] = [0x00, 0x80, 0x08, 0x88];
        let mut sc = [0u16; 4];
        let mut d = max_scale / 15.0;
        let id = 1.0 / d;
        let (mut sumqx, mut sumq2) = (0.0f32, 0.0f32);
        for ib in 0..16 {
            let l = scale_level(id, scales[ib]);
            sc[ib / 4] |= (l as u16) << (3 * (ib % 4));
            y[QH + ib] |= MASKS[shifts[ib]];
            let weight = weights(ib);
            let xb = &x[16 * ib..16 * ib + 16];
            let ls = (2 * l as i32 + 1) as f32;
            for k in 0..2 {
                let xx = group_shift(shifts[ib], k);
                let high = ((y[QH + ib] as usize) << (8 - 4 * k)) & 0x700;
                let p = g.point(y[2 * ib + k] as usize + high);
                for j in 0..8 {
                    let w = weight[8 * k + j];
                    let q = xx[((p[j] - 1) / 2) as usize] * ls;
                    sumqx += w * q * xb[8 * k + j];
                    sumq2 += w * q * q;
                }
            }
        }
        if sumq2 > 0.0 {
            d = sumqx / sumq2;
        }
        let s = crate::ops::cast::f32_to_f16(d * 1.1125);
        sc[0] |= (s & 0x000f) << 12;
        sc[1] |= (s & 0x00f0) << 8;
        sc[2] |= (s & 0x0f00) << 4;
        sc[3] |= s & 0xf000;
        for (b, v) in y[SC..SC + 8].chunks_exact_mut(2).zip(sc) {
            b.copy_from_slice(&v.to_le_bytes());
        }
    });
}

/// The shifted levels of group `k` under IQ1_M's split `best_k` (bit 1: group 0 `-δ`, bit 0:
/// group 1 `-δ`).
fn group_shift(best_k: usize, k: usize) -> &'static [f32; 3] {
    let plus = if k == 0 {
        best_k < 2
    } else {
        best_k.is_multiple_of(2)
    };
    if plus {
        &X_P
    } else {
        &X_M
    }
}

/// A sub-block scale's 3-bit level.
fn scale_level(id: f32, scale: f32) -> u8 {
    nearest_int(0.5 * (id * scale - 1.0)).clamp(0, 7) as u8
}

/// Group `levels` (8 of `0..=2`, from the split) on the grid: its index, or the neighbour
/// whose shifted levels `xx` at `scale` are nearest `xb` in weighted squared distance.
fn to_grid(
    g: &Grid,
    levels: &[i8],
    xb: &[f32],
    weight: &[f32],
    scale: f32,
    xx: &[f32; 3],
) -> (usize, bool) {
    if let Some(index) = g.index_of(levels) {
        return (index, true);
    }
    let mut l = [0i8; 8];
    l.copy_from_slice(levels);
    let index = g.best_neighbour(&mut l, |p| {
        let mut d2 = 0.0f32;
        for i in 0..8 {
            let q = xx[((p[i] - 1) / 2) as usize];
            let diff = scale * q - xb[i];
            d2 += weight[i] * diff * diff;
        }
        d2
    });
    (index, false)
}

/// `(Σ w q x, Σ w q²)` over the groups' grid points, group `k`'s levels shifted by `xx(k)`.
fn refit(
    g: &Grid,
    xb: &[f32],
    weight: &[f32],
    index: &[usize],
    xx: impl Fn(usize) -> &'static [f32; 3],
) -> (f32, f32) {
    let (mut sumqx, mut sumq2) = (0.0f32, 0.0f32);
    for (k, &i) in index.iter().enumerate() {
        let p = g.point(i);
        for j in 0..8 {
            let w = weight[8 * k + j];
            let q = xx(k)[((p[j] - 1) / 2) as usize];
            sumqx += w * q * xb[8 * k + j];
            sumq2 += w * q * q;
        }
    }
    (sumqx, sumq2)
}

/// glibc's `qsort` of `(x[j], j)` by value as `iq1_sort_helper` compares: its merge sort
/// (`msort_with_tmp`: halves of `n / 2` and the rest, the left run taken unless its head is
/// greater), so equal values, and NaN, keep their order exactly as in ggml.
fn sorted_order<const N: usize>(x: &[f32]) -> [usize; N] {
    fn msort(a: &mut [(f32, usize)], tmp: &mut [(f32, usize)]) {
        let n = a.len();
        if n <= 1 {
            return;
        }
        let n1 = n / 2;
        msort(&mut a[..n1], tmp);
        msort(&mut a[n1..], tmp);
        let (mut i, mut j, mut o) = (0, n1, 0);
        while i < n1 && j < n {
            if a[i].0 > a[j].0 {
                tmp[o] = a[j];
                j += 1;
            } else {
                tmp[o] = a[i];
                i += 1;
            }
            o += 1;
        }
        while i < n1 {
            tmp[o] = a[i];
            i += 1;
            o += 1;
        }
        a[..o].copy_from_slice(&tmp[..o]);
    }
    let mut pairs: [(f32, usize); N] = std::array::from_fn(|j| (x[j], j));
    let mut tmp = [(0.0f32, 0usize); N];
    msort(&mut pairs, &mut tmp);
    pairs.map(|p| p.1)
}

/// Levels `0, 1, 2` by sorted position: below `i1`, from `i1` to `i2`, from `i2` on.
fn levels_of_split<const N: usize>(order: &[usize; N], i1: usize, i2: usize) -> [i8; N] {
    let mut levels = [0i8; N];
    for (j, &i) in order.iter().enumerate() {
        levels[i] = if j < i1 {
            0
        } else if j < i2 {
            1
        } else {
            2
        };
    }
    levels
}

/// The levels of the best split `(i1, i2)` under `scale`; a negative scale is made positive
/// by mirroring the levels (`2 - l`), and then `true` tells the caller to mirror its shift.
fn split_with_positive_scale<const N: usize>(
    order: &[usize; N],
    (i1, i2): (usize, usize),
    scale: f32,
) -> ([i8; N], f32, bool) {
    let levels = levels_of_split(order, i1, i2);
    if scale < 0.0 {
        (levels.map(|l| 2 - l), -scale, true)
    } else {
        (levels, scale, false)
    }
}

/// The largest magnitude (`fabsf`, C's `MAX`).
fn max_abs(xb: &[f32]) -> f32 {
    let mut max = xb[0].abs();
    for &e in &xb[1..] {
        max = c_max(max, e.abs());
    }
    max
}

/// IQ1_S's exhaustive split of a sub-block of 32: `(levels, scale ≥ 0, shift ±1)`, or `None`
/// for a skipped one (all below `GROUP_MAX_EPS_IQ1_S`, or no split scored).
fn split_iq1_s(xb: &[f32], weight: &[f32; 32]) -> Option<([i8; 32], f32, i8)> {
    let max = max_abs(xb);
    if max < EPS_IQ1_S {
        return None;
    }
    let order = sorted_order::<32>(xb);
    let (mut sumx, mut sumw) = ([0.0f32; 33], [0.0f32; 33]);
    for (j, &i) in order.iter().enumerate() {
        sumx[j + 1] = sumx[j] + weight[i] * xb[i];
        sumw[j + 1] = sumw[j] + weight[i];
    }
    let (mut best_score, mut scale) = (-f32::MAX, max);
    let mut best: Option<(usize, usize, i8)> = None;
    for i1 in 0..=32 {
        for i2 in i1..=32 {
            for (xs, shift) in [(&X_P, 1i8), (&X_M, -1)] {
                let sumqx = (sumx[i1] - sumx[0]) * xs[0]
                    + (sumx[i2] - sumx[i1]) * xs[1]
                    + (sumx[32] - sumx[i2]) * xs[2];
                let sumq2 = (sumw[i1] - sumw[0]) * xs[0] * xs[0]
                    + (sumw[i2] - sumw[i1]) * xs[1] * xs[1]
                    + (sumw[32] - sumw[i2]) * xs[2] * xs[2];
                if sumq2 > 0.0 && sumqx * sumqx > best_score * sumq2 {
                    scale = sumqx / sumq2;
                    best_score = scale * sumqx;
                    best = Some((i1, i2, shift));
                }
            }
        }
    }
    let (i1, i2, shift) = best?;
    let (levels, scale, mirrored) = split_with_positive_scale(&order, (i1, i2), scale);
    Some((levels, scale, if mirrored { -shift } else { shift }))
}

/// IQ1_M's exhaustive split of a sub-block of 16, each half with its own shift: `(levels,
/// scale ≥ 0, best_k)` (`best_k` as [`group_shift`] reads it), or `None` for a skipped one.
/// The scores come from per-half prefix sums in ggml's closed form.
fn split_iq1_m(xb: &[f32], weight: &[f32; 16]) -> Option<([i8; 16], f32, usize)> {
    let max = max_abs(xb);
    if max < EPS_IQ1_M {
        return None;
    }
    let order = sorted_order::<16>(xb);
    let (mut px, mut pw) = ([[0.0f32; 17]; 2], [[0.0f32; 17]; 2]);
    for (j, &i) in order.iter().enumerate() {
        let h = usize::from(i >= 8);
        px[h][j + 1] = px[h][j] + weight[i] * xb[i];
        px[1 - h][j + 1] = px[1 - h][j];
        pw[h][j + 1] = pw[h][j] + weight[i];
        pw[1 - h][j + 1] = pw[1 - h][j];
    }
    let (txs, tws) = ([px[0][16], px[1][16]], [pw[0][16], pw[1][16]]);
    let (p2, m2) = (X_P[2], X_M[2]);
    let cp1 = X_P[0] * X_P[0] - X_P[1] * X_P[1];
    let cp2 = X_P[1] * X_P[1] - X_P[2] * X_P[2];
    let cm1 = X_M[0] * X_M[0] - X_M[1] * X_M[1];
    let cm2 = X_M[1] * X_M[1] - X_M[2] * X_M[2];
    let (mut best_score, mut scale) = (-f32::MAX, max);
    let mut best: Option<(usize, usize, usize)> = None;
    for i1 in 0..=16 {
        for i2 in i1..=16 {
            let (mut qx_p, mut qx_m, mut q2_p, mut q2_m) =
                ([0.0f32; 2], [0.0f32; 2], [0.0f32; 2], [0.0f32; 2]);
            for h in 0..2 {
                let sx = px[h][i1] + px[h][i2];
                qx_p[h] = txs[h] * p2 - sx;
                qx_m[h] = txs[h] * m2 - sx;
                q2_p[h] = tws[h] * p2 * p2 + pw[h][i1] * cp1 + pw[h][i2] * cp2;
                q2_m[h] = tws[h] * m2 * m2 + pw[h][i1] * cm1 + pw[h][i2] * cm2;
            }
            let sumqx = [
                qx_p[0] + qx_p[1],
                qx_p[0] + qx_m[1],
                qx_m[0] + qx_p[1],
                qx_m[0] + qx_m[1],
            ];
            let sumq2 = [
                q2_p[0] + q2_p[1],
                q2_p[0] + q2_m[1],
                q2_m[0] + q2_p[1],
                q2_m[0] + q2_m[1],
            ];
            for k in 0..4 {
                if sumq2[k] > 0.0 && sumqx[k] * sumqx[k] > best_score * sumq2[k] {
                    scale = sumqx[k] / sumq2[k];
                    best_score = scale * sumqx[k];
                    best = Some((i1, i2, k));
                }
            }
        }
    }
    let (i1, i2, best_k) = best?;
    let (levels, scale, mirrored) = split_with_positive_scale(&order, (i1, i2), scale);
    Some((levels, scale, if mirrored { 3 - best_k } else { best_k }))
}
