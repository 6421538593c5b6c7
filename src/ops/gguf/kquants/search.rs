//! The scale searches the k-quants share (`make_qx_quants`, `make_q3_quants`,
//! `make_qkx2_quants`/`make_qkx3_quants`, `make_qp_quants` in ggml-quants.c), each computing
//! the same f32 operations in the same order as ggml, so scales and levels come out bit-equal.
//! The level buffers keep ggml's integer types (`i8` / `u8`) because ggml reads a wrapped
//! value back in later sums.

use super::lanes::{self, simd, transpose, LANES};
use super::{c_max, nearest_int, signed_max, QK_K};

/// ggml's `GROUP_MAX_EPS`: a group whose largest magnitude is below this is all zero.
pub(super) const GROUP_MAX_EPS: f32 = 1e-15;

/// `make_qx_quants(n, nmax, x, L, rmse_type = 1, qw)`: symmetric levels `L[i] + nmax` in
/// `0..2 nmax`, the scale that least-squares fits them (weights `qw`, else `x²`), tried at 18
/// nudged inverse scales. Returns the scale.
pub(crate) fn make_qx_quants(nmax: i32, x: &[f32], levels: &mut [i8], qw: Option<&[f32]>) -> f32 {
    let n = x.len();
    let (amax, max) = signed_max(x);
    if amax < GROUP_MAX_EPS {
        levels[..n].fill(0);
        return 0.0;
    }
    let weight = |i: usize| match qw {
        Some(w) => w[i],
        None => x[i] * x[i],
    };
    let nmaxf = nmax as f32;
    let mut iscale = -nmaxf / max;
    let mut sumlx = 0.0f32;
    let mut suml2 = 0.0f32;
    for (i, &v) in x.iter().enumerate() {
        let l = nearest_int(iscale * v).clamp(-nmax, nmax - 1);
        levels[i] = (l + nmax) as i8;
        let w = weight(i);
        sumlx += w * v * l as f32;
        suml2 += w * l as f32 * l as f32;
    }
    let mut scale = if suml2 != 0.0 { sumlx / suml2 } else { 0.0 };
    let mut best = scale * sumlx;
    for is in (-9..=9).filter(|&is| is != 0) {
        iscale = -(nmaxf + 0.1 * is as f32) / max;
        sumlx = 0.0;
        suml2 = 0.0;
        for (i, &v) in x.iter().enumerate() {
            let l = nearest_int(iscale * v).clamp(-nmax, nmax - 1);
            let w = weight(i);
            sumlx += w * v * l as f32;
            suml2 += w * l as f32 * l as f32;
        }
        if suml2 > 0.0 && sumlx * sumlx > best * suml2 {
            for (i, &v) in x.iter().enumerate() {
                levels[i] = (nmax + nearest_int(iscale * v).clamp(-nmax, nmax - 1)) as i8;
            }
            scale = sumlx / suml2;
            best = scale * sumlx;
        }
    }
    scale
}

/// `make_q3_quants(n, nmax, x, L, do_rmse = true)`: symmetric levels with `x²` weights, then
/// up to five passes moving single levels while the fit improves. Returns the scale. The
/// encoder runs it in lanes ([`fit_q3_sub_blocks`]); this port is what the lanes are checked
/// against.
#[cfg(test)]
pub(super) fn make_q3_quants(nmax: i32, x: &[f32], levels: &mut [i8]) -> f32 {
    let (amax, max) = signed_max(x);
    if amax < GROUP_MAX_EPS {
        levels[..x.len()].fill(0);
        return 0.0;
    }
    let iscale = -(nmax as f32) / max;
    let mut fit = Fit::default();
    for (i, &v) in x.iter().enumerate() {
        let l = nearest_int(iscale * v).clamp(-nmax, nmax - 1);
        levels[i] = l as i8;
        fit.add(v * v, v, l);
    }
    for _ in 0..5 {
        let mut changed = false;
        for (i, &v) in x.iter().enumerate() {
            let w = v * v;
            let li = levels[i] as f32;
            let mut slx = fit.sumlx - w * v * li;
            if slx > 0.0 {
                let mut sl2 = fit.suml2 - w * li * li;
                let new_l = nearest_int(v * sl2 / slx).clamp(-nmax, nmax - 1);
                if new_l != levels[i] as i32 {
                    slx += w * v * new_l as f32;
                    sl2 += w * new_l as f32 * new_l as f32;
                    if sl2 > 0.0 && fit.take_if_better(slx, sl2) {
                        levels[i] = new_l as i8;
                        changed = true;
                    }
                }
            }
        }
        if !changed {
            break;
        }
    }
    for l in levels[..x.len()].iter_mut() {
        *l += nmax as i8;
    }
    fit.scale()
}

/// The candidate inverse scales `make_qkx*_quants` tries: `(rmin + rdelta * is + nmax) /
/// (max - min)` for `is` in `0..=nstep`, and whether errors are absolute (`use_mad`) or squared.
#[derive(Clone, Copy)]
pub(crate) struct AffineSearch {
    pub rmin: f32,
    pub rdelta: f32,
    pub nstep: i32,
    pub use_mad: bool,
}

impl AffineSearch {
    pub(crate) const fn new(rmin: f32, rdelta: f32, nstep: i32, use_mad: bool) -> Self {
        AffineSearch {
            rmin,
            rdelta,
            nstep,
            use_mad,
        }
    }

    /// The search of every `quantize_row_*_impl` given quant weights (`make_qkx3_quants(..,
    /// -0.9, 0.05, 36, use_mad = false)`).
    pub(crate) const WEIGHTED: AffineSearch = AffineSearch::new(-0.9, 0.05, 36, false);
}

/// The affine fits of a super-block's `N` sub-blocks: scale, min and total weight of each.
pub(super) struct SubBlockFits<const N: usize> {
    pub scales: [f32; N],
    pub mins: [f32; N],
    pub weights: [f32; N],
}

impl<const N: usize> SubBlockFits<N> {
    /// The fits of sub-blocks `M b .. M (b + 1)`.
    pub fn part<const M: usize>(&self, b: usize) -> SubBlockFits<M> {
        let take =
            |v: &[f32; N]| -> [f32; M] { v[M * b..M * (b + 1)].try_into().expect("in range") };
        SubBlockFits {
            scales: take(&self.scales),
            mins: take(&self.mins),
            weights: take(&self.weights),
        }
    }

    /// The largest scale and the largest min, as ggml tracks them (`>` from 0, in order).
    pub fn maxima(&self) -> (f32, f32) {
        let max = |v: &[f32; N]| v.iter().fold(0.0f32, |m, &s| if s > m { s } else { m });
        (max(&self.scales), max(&self.mins))
    }
}

/// Fits each `S`-element sub-block `j` of `x` by [`make_qkx_quants`]`(nmax, .., search)`, its
/// levels into `levels`, with the weights `weigh(j, xs, weights)` writes (it returns the
/// sub-block's total weight). [`LANES`] sub-blocks at a time in SIMD lanes (`N` a multiple of
/// it), each exactly as the scalar search fits it.
pub(super) fn fit_sub_blocks<const N: usize, const S: usize>(
    x: &[f32],
    levels: &mut [u8],
    nmax: i32,
    search: AffineSearch,
    weigh: impl Fn(usize, &[f32], &mut [f32; S]) -> f32,
) -> SubBlockFits<N> {
    assert_eq!(N % LANES, 0, "sub-blocks in whole groups of lanes");
    let mut fits = SubBlockFits {
        scales: [0.0; N],
        mins: [0.0; N],
        weights: [0.0; N],
    };
    for first in (0..N).step_by(LANES) {
        let xt = transpose::<S>(x, first);
        let mut wt = [[0.0f32; LANES]; S];
        let mut weights = [0.0f32; S];
        for k in 0..LANES {
            let j = first + k;
            fits.weights[j] = weigh(j, &x[S * j..S * (j + 1)], &mut weights);
            for (t, &w) in wt.iter_mut().zip(&weights) {
                t[k] = w;
            }
        }
        let mut lt = [[0.0f32; LANES]; S];
        let (scales, mins) = simd(
            #[inline(always)]
            || lanes::make_qkx_quants(nmax, &xt, &wt, &mut lt, search),
        );
        for k in 0..LANES {
            let j = first + k;
            (fits.scales[j], fits.mins[j]) = (scales[k], mins[k]);
            for (l, t) in levels[S * j..S * (j + 1)].iter_mut().zip(&lt) {
                *l = t[k] as u8;
            }
        }
    }
    fits
}

/// [`make_qx_quants`]`(nmax, ..)` on each of the sixteen 16-element sub-blocks of the
/// super-block `x`, with the weights `weights` (laid out as `x`) or, without, `x²`: the levels
/// into `levels`, the scales returned. All sixteen at once in SIMD lanes, each exactly as the
/// scalar search fits it.
pub(super) fn fit_symmetric_sub_blocks(
    nmax: i32,
    x: &[f32],
    weights: Option<&[f32]>,
    levels: &mut [i8; QK_K],
) -> [f32; QK_K / 16] {
    let mut scales = [0.0f32; QK_K / 16];
    for first in (0..QK_K / 16).step_by(LANES) {
        let xt = transpose::<16>(x, first);
        let wt = weights.map(|w| transpose::<16>(w, first));
        let mut lt = [[0.0f32; LANES]; 16];
        let s = simd(
            #[inline(always)]
            || lanes::make_qx_quants(nmax, &xt, wt.as_ref(), &mut lt),
        );
        for k in 0..LANES {
            let ib = first + k;
            scales[ib] = s[k];
            for (l, t) in levels[16 * ib..16 * (ib + 1)].iter_mut().zip(&lt) {
                *l = t[k] as i8;
            }
        }
    }
    scales
}

/// [`make_q3_quants`]`(4, ..)` on each of the sixteen 16-element sub-blocks of the super-block
/// `x` (Q3_K's reference path): the levels into `levels`, the scales returned, all sixteen at
/// once in SIMD lanes.
pub(super) fn fit_q3_sub_blocks(x: &[f32], levels: &mut [i8; QK_K]) -> [f32; QK_K / 16] {
    let xt = transpose::<16>(x, 0);
    let mut lt = [[0.0f32; LANES]; 16];
    let scales = simd(
        #[inline(always)]
        || lanes::make_q3_quants(4, &xt, &mut lt),
    );
    for (ib, ls) in levels.chunks_exact_mut(16).enumerate() {
        for (l, t) in ls.iter_mut().zip(&lt) {
            *l = t[ib] as i8;
        }
    }
    scales
}

/// `make_qkx2_quants` / `make_qkx3_quants` (the same computation once weights are given, as
/// every k-quant caller gives them): affine levels `0..=nmax` with `x ≈ scale * L - the_min`,
/// `the_min >= 0`, the weighted least-squares fit at each candidate kept when its weighted
/// error is strictly lower. Returns `(scale, the_min)`.
pub(crate) fn make_qkx_quants(
    nmax: i32,
    x: &[f32],
    weights: &[f32],
    levels: &mut [u8],
    aux: &mut [u8],
    search: AffineSearch,
) -> (f32, f32) {
    let n = x.len();
    let mut min = x[0];
    let mut max = x[0];
    let mut sum_w = weights[0];
    let mut sum_x = sum_w * x[0];
    for i in 1..n {
        if x[i] < min {
            min = x[i];
        }
        if x[i] > max {
            max = x[i];
        }
        let w = weights[i];
        sum_w += w;
        sum_x += w * x[i];
    }
    if min > 0.0 {
        min = 0.0;
    }
    if max == min {
        levels[..n].fill(0);
        return (0.0, -min);
    }
    let nmaxf = nmax as f32;
    let mut iscale = nmaxf / (max - min);
    let mut scale = 1.0 / iscale;
    let err = |d: f32| if search.use_mad { d.abs() } else { d * d };
    let mut best_error = 0.0f32;
    for i in 0..n {
        let l = nearest_int(iscale * (x[i] - min)).clamp(0, nmax);
        levels[i] = l as u8;
        let diff = scale * l as f32 + min - x[i];
        best_error += weights[i] * err(diff);
    }
    if search.nstep < 1 {
        return (scale, -min);
    }
    for is in 0..=search.nstep {
        iscale = (search.rmin + search.rdelta * is as f32 + nmaxf) / (max - min);
        let (mut sum_l, mut sum_l2, mut sum_xl) = (0.0f32, 0.0f32, 0.0f32);
        for i in 0..n {
            let l = nearest_int(iscale * (x[i] - min)).clamp(0, nmax);
            aux[i] = l as u8;
            let w = weights[i];
            let lf = l as f32;
            sum_l += w * lf;
            sum_l2 += w * lf * lf;
            sum_xl += w * lf * x[i];
        }
        let d = sum_w * sum_l2 - sum_l * sum_l;
        if d > 0.0 {
            let mut this_scale = (sum_w * sum_xl - sum_x * sum_l) / d;
            let mut this_min = (sum_l2 * sum_x - sum_l * sum_xl) / d;
            if this_min > 0.0 {
                this_min = 0.0;
                this_scale = sum_xl / sum_l2;
            }
            let mut cur_error = 0.0f32;
            for i in 0..n {
                let diff = this_scale * aux[i] as f32 + this_min - x[i];
                cur_error += weights[i] * err(diff);
            }
            if cur_error < best_error {
                levels[..n].copy_from_slice(&aux[..n]);
                best_error = cur_error;
                scale = this_scale;
                min = this_min;
            }
        }
    }
    (scale, -min)
}

/// `make_qp_quants(n, nmax, x, L, quant_weights)`: levels `0..=nmax` of non-negative values
/// (sub-block scales or mins), weights `quant_weights`, 8 nudged scales then up to five passes
/// moving single levels. Levels are stored as ggml stores them, in a `u8` (a negative `x`
/// wraps, and the wrapped level is what later sums read). Returns the scale.
pub(super) fn make_qp_quants(
    nmax: i32,
    x: &[f32],
    levels: &mut [u8],
    quant_weights: &[f32],
) -> f32 {
    let mut max = 0.0f32;
    for &v in x {
        max = c_max(max, v);
    }
    if max < GROUP_MAX_EPS {
        levels[..x.len()].fill(0);
        return 0.0;
    }
    let nmaxf = nmax as f32;
    let mut iscale = nmaxf / max;
    for (l, &v) in levels.iter_mut().zip(x) {
        *l = nearest_int(iscale * v) as u8;
    }
    let scale = 1.0 / iscale;
    let mut best_mse = 0.0f32;
    for (i, &v) in x.iter().enumerate() {
        let diff = v - scale * levels[i] as f32;
        best_mse += quant_weights[i] * diff * diff;
    }
    for is in (-4..=4).filter(|&is| is != 0) {
        let iscale_is = (0.1 * is as f32 + nmaxf) / max;
        let scale_is = 1.0 / iscale_is;
        let mut mse = 0.0f32;
        for (i, &v) in x.iter().enumerate() {
            let l = nearest_int(iscale_is * v).min(nmax);
            let diff = v - scale_is * l as f32;
            mse += quant_weights[i] * diff * diff;
        }
        if mse < best_mse {
            best_mse = mse;
            iscale = iscale_is;
        }
    }
    let mut fit = Fit::default();
    for (i, &v) in x.iter().enumerate() {
        let l = nearest_int(iscale * v).min(nmax);
        levels[i] = l as u8;
        fit.add(quant_weights[i], v, l);
    }
    for _ in 0..5 {
        let mut changed = false;
        for (i, &v) in x.iter().enumerate() {
            let w = quant_weights[i];
            let li = levels[i] as f32;
            let mut slx = fit.sumlx - w * v * li;
            let mut sl2 = fit.suml2 - w * li * li;
            if slx > 0.0 && sl2 > 0.0 {
                let new_l = nearest_int(v * sl2 / slx).min(nmax);
                if new_l != levels[i] as i32 {
                    slx += w * v * new_l as f32;
                    sl2 += w * new_l as f32 * new_l as f32;
                    if fit.take_if_better(slx, sl2) {
                        levels[i] = new_l as u8;
                        changed = true;
                    }
                }
            }
        }
        if !changed {
            break;
        }
    }
    fit.scale()
}

/// The weighted sums `Σ w·x·l` and `Σ w·l²` of a least-squares scale fit, as ggml's level
/// searches keep them (in f32, in element order).
#[derive(Clone, Copy, Debug, Default)]
struct Fit {
    sumlx: f32,
    suml2: f32,
}

impl Fit {
    fn add(&mut self, w: f32, x: f32, l: i32) {
        self.sumlx += w * x * l as f32;
        self.suml2 += w * l as f32 * l as f32;
    }

    /// Takes the sums of a moved level, `slx` and `sl2`, when they fit better
    /// (`slx² / sl2 > sumlx² / suml2`, cross-multiplied as ggml compares them).
    fn take_if_better(&mut self, slx: f32, sl2: f32) -> bool {
        let better = slx * slx * self.suml2 > self.sumlx * self.sumlx * sl2;
        if better {
            (self.sumlx, self.suml2) = (slx, sl2);
        }
        better
    }

    /// The fitted scale `sumlx / suml2`, 0 without levels.
    fn scale(&self) -> f32 {
        if self.suml2 > 0.0 {
            self.sumlx / self.suml2
        } else {
            0.0
        }
    }
}
