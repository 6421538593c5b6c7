//! The 2-bit lattice types. Each quantises groups of 8 magnitudes to a point of an
//! 8-dimensional grid of odd coordinates `1, 3, 5` ([`iq2_grid`]), keeps the signs apart, and
//! scales sub-blocks by 4-bit levels under an f16 super-block scale `d`; an element decodes
//! as `d * (0.5 + l) * 0.25 * grid[q][i] * sign` (IQ2_XXS: `d * (0.5 + l) * 0.25`, the others
//! likewise per 16 elements).
//!
//! **IQ2_XXS** (`block_iq2_xxs`, 66 bytes per 256; 256-point grid, sub-blocks of 32): `d:
//! f16`, then per sub-block `ib` two little-endian `u32`s: the first holds the 4 groups' grid
//! indices (a byte each), the second four 7-bit sign masks (bit `i` of mask `k` flips element
//! `8k + i`; the eighth sign is the parity, so flips are even) in bits `0..28` and the scale
//! `l` in bits `28..32`.
//!
//! **IQ2_XS** (`block_iq2_xs`, 74 bytes; 512-point grid, sub-blocks of 16): `d: f16`, `qs:
//! [u16; 32]` (group `2 ib + k`: grid index in bits `0..9`, 7-bit sign mask in bits `9..16`),
//! `scales: [u8; 8]` (sub-block `2j` low nibble, `2j + 1` high).
//!
//! **IQ2_S** (`block_iq2_s`, 82 bytes; 1024-point grid, sub-blocks of 16): `d: f16`, `qs: [u8;
//! 64]` (bytes `0..32` the low 8 bits of group `g`'s index, bytes `32..64` its 8 sign bits),
//! `qh: [u8; 8]` (bits `2 (g % 4)..` of `qh[g / 4]` the index's top 2 bits), `scales` as
//! IQ2_XS; `d` is stored times 0.9875.
//!
//! The search (`quantize_row_iq2_{xxs,xs,s}_impl`): per sub-block, candidate inverse scales
//! snap each group to its nearest level, off-grid groups move to their best grid neighbour,
//! and the weighted least-squares fit that improves strictly is kept; then groups are
//! re-snapped at the winning scale and the scale refitted. IQ2_XXS and IQ2_XS have no
//! reference without an importance matrix (ggml asserts one); IQ2_S weights `σ²/4 + x²` then.

use super::iq2_grid::{grid, Grid, Lattice};
use super::iq_signs::{max_magnitude, refit, split_signs, unsigned_scale, BestFit};
use super::search::{make_qp_quants, GROUP_MAX_EPS};
use super::{for_each_block, for_each_weighted_block, imatrix_weights, nearest_int, sum_squares};
use super::{KQuant, SubScales, QK_K};

/// Levels per coordinate (`kMaxQ`).
const K_MAX_Q: i32 = 3;

/// What differs between the three types' sub-block searches.
struct Variant {
    lattice: Lattice,
    /// A sub-block whose largest magnitude is below this is skipped.
    eps: f32,
    /// 7 sign bits per 8, the flips made even (IQ2_XXS, IQ2_XS); else 8 (IQ2_S).
    even_signs: bool,
    /// IQ2_XXS starts from `make_qp_quants`'s scale; the others from the largest magnitude.
    qp_start: bool,
    /// Candidates `(5 + 0.1 is) / max` for `is` in `-nscale..=nscale`.
    nscale: i32,
    /// IQ2_XXS re-snaps every group at the winning scale, the others only the off-grid ones.
    resnap_all: bool,
    /// IQ2_XXS and IQ2_XS weight by the imatrix (required) with σ² the mean square; IQ2_S by
    /// the imatrix with σ² twice that, else by `σ²/4 + x²`.
    imatrix_only: bool,
}

const IQ2_XXS: Variant = Variant {
    lattice: Lattice::Iq2Xxs,
    eps: GROUP_MAX_EPS,
    even_signs: true,
    qp_start: true,
    nscale: 6,
    resnap_all: true,
    imatrix_only: true,
};

const IQ2_XS: Variant = Variant {
    lattice: Lattice::Iq2Xs,
    eps: GROUP_MAX_EPS,
    even_signs: true,
    qp_start: false,
    nscale: 9,
    resnap_all: false,
    imatrix_only: true,
};

/// `GROUP_MAX_EPS_IQ2_S`.
const IQ2_S: Variant = Variant {
    lattice: Lattice::Iq2S,
    eps: 1e-8,
    even_signs: false,
    qp_start: false,
    nscale: 9,
    resnap_all: false,
    imatrix_only: false,
};

/// One sub-block's fit: its scale, grid indices and sign masks, one per group of 8.
struct Fit<const G: usize> {
    scale: f32,
    index: [u16; G],
    signs: [u8; G],
}

/// IQ2_XXS: 2.06 bits per weight; byte-exact to ggml 0c1e570's `quantize_iq2_xxs`. Needs
/// importance weights (ggml asserts them; planning refuses the type without).
pub fn quantize_row_iq2_xxs(src: &[f32], dst: &mut [u8], quant_weights: Option<&[f32]>) {
    for_each_weighted_block(KQuant::Iq2Xxs, src, dst, quant_weights, |x, qw, y| {
        let mut q2 = [0u32; 16];
        let sub = fit_sub_blocks::<32, 4, 8>(&IQ2_XXS, x, Some(qw), |ib, fit| {
            for k in 0..4 {
                q2[2 * ib] |= (fit.index[k] as u32) << (8 * k);
                q2[2 * ib + 1] |= (fit.signs[k] as u32) << (7 * k);
            }
        });
        y.fill(0);
        let Some(d) = sub.put_super_scale(31.0, 1.0, y) else {
            return;
        };
        let id = 1.0 / d;
        for (ib, &s) in sub.scales.iter().enumerate() {
            q2[2 * ib + 1] |= (scale_level(id, s) as u32) << 28;
        }
        for (b, q) in y[2..].chunks_exact_mut(4).zip(q2) {
            b.copy_from_slice(&q.to_le_bytes());
        }
    });
}

/// IQ2_XS: 2.31 bits per weight; byte-exact to ggml 0c1e570's `quantize_iq2_xs`. Needs
/// importance weights (as IQ2_XXS).
pub fn quantize_row_iq2_xs(src: &[f32], dst: &mut [u8], quant_weights: Option<&[f32]>) {
    for_each_weighted_block(KQuant::Iq2Xs, src, dst, quant_weights, |x, qw, y| {
        let mut q2 = [0u16; 32];
        let sub = fit_sub_blocks::<16, 2, 16>(&IQ2_XS, x, Some(qw), |ib, fit| {
            for k in 0..2 {
                q2[2 * ib + k] = fit.index[k] | ((fit.signs[k] as u16) << 9);
            }
        });
        y.fill(0);
        let Some(d) = sub.put_super_scale(31.0, 1.0, y) else {
            return;
        };
        for (b, q) in y[2..66].chunks_exact_mut(2).zip(q2) {
            b.copy_from_slice(&q.to_le_bytes());
        }
        pack_scales(1.0 / d, &sub.scales, &mut y[66..74]);
    });
}

/// IQ2_S: 2.56 bits per weight; byte-exact to ggml 0c1e570's `quantize_iq2_s` (weights the
/// imatrix when given, `σ²/4 + x²` otherwise, as `quantize_row_iq2_s_ref` does).
pub fn quantize_row_iq2_s(src: &[f32], dst: &mut [u8], quant_weights: Option<&[f32]>) {
    const QH: usize = 66;
    for_each_block(KQuant::Iq2S, src, dst, quant_weights, |x, qw, y| {
        y.fill(0);
        let sub = fit_sub_blocks::<16, 2, 16>(&IQ2_S, x, qw, |ib, fit| {
            for k in 0..2 {
                let g = 2 * ib + k;
                y[2 + g] = fit.index[k] as u8;
                y[QH + g / 4] |= ((fit.index[k] >> 8) << (2 * (g % 4))) as u8;
                y[2 + 32 + g] = fit.signs[k];
            }
        });
        let Some(d) = sub.put_super_scale(31.0, 0.9875, y) else {
            return;
        };
        pack_scales(1.0 / d, &sub.scales, &mut y[74..82]);
    });
}

/// Fits each sub-block of `N` values (`G` groups of 8) of the super-block `x` as `v` says, its
/// weights from `qw` ([`weights`]), and hands every fit to `store` with the sub-block's index;
/// returns the `B` sub-block scales.
fn fit_sub_blocks<const N: usize, const G: usize, const B: usize>(
    v: &Variant,
    x: &[f32],
    qw: Option<&[f32]>,
    mut store: impl FnMut(usize, &Fit<G>),
) -> SubScales<B> {
    let (sigma2, floor) = if v.imatrix_only {
        (sum_squares(x) / QK_K as f32, 0.0)
    } else {
        let sigma2 = 2.0 * sum_squares(x) / QK_K as f32;
        (sigma2, 0.25 * sigma2)
    };
    let mut sub = SubScales::new();
    for (ib, xb) in x.chunks_exact(N).enumerate() {
        let weight = weights::<N>(xb, qw.map(|w| &w[N * ib..]), sigma2, floor);
        let Some(fit) = fit_sub_block::<N, G>(v, xb, &weight) else {
            continue;
        };
        store(ib, &fit);
        sub.set(ib, fit.scale);
    }
    sub
}

/// The sub-block weights: the imatrix's `qw * sqrt(sigma2 + x²)`, else `floor + x²`.
fn weights<const N: usize>(xb: &[f32], qw: Option<&[f32]>, sigma2: f32, floor: f32) -> [f32; N] {
    let mut weight = [0.0f32; N];
    match qw {
        Some(qw) => {
            imatrix_weights(&mut weight, &qw[..N], xb, sigma2);
        }
        None => {
            for (w, &e) in weight.iter_mut().zip(xb) {
                *w = floor + e * e;
            }
        }
    }
    weight
}

/// 16 sub-block scales as 4-bit levels, two a byte (even sub-block in the low nibble).
fn pack_scales(id: f32, scales: &[f32; 16], out: &mut [u8]) {
    for (b, pair) in out.iter_mut().zip(scales.chunks_exact(2)) {
        *b = scale_level(id, pair[0]) | (scale_level(id, pair[1]) << 4);
    }
}

/// A sub-block scale's 4-bit level `l`, the one `(1 + 2 l) d / 2` is nearest.
fn scale_level(id: f32, scale: f32) -> u8 {
    nearest_int(0.5 * (id * scale - 1.0)).clamp(0, 15) as u8
}

/// The level (`0..=2`) of coordinate `2 l + 1` nearest `id * v`.
#[inline]
fn snap(id: f32, v: f32) -> i8 {
    nearest_int(0.5 * (id * v - 1.0)).clamp(0, K_MAX_Q - 1) as i8
}

/// Snaps group `k` (8 levels already rounded) onto the grid at `scale`: its index if on it,
/// else its best neighbour's (whose levels replace the group's). Returns `(index, on grid)`.
fn to_grid(g: &Grid, levels: &mut [i8], xval: &[f32], waux: &[f32], scale: f32) -> (usize, bool) {
    if let Some(index) = g.index_of(levels) {
        return (index, true);
    }
    let index = g.best_neighbour(levels, |p| {
        let mut d2 = 0.0f32;
        for i in 0..8 {
            let diff = scale * p[i] as f32 - xval[i];
            d2 += waux[i] * diff * diff;
        }
        d2
    });
    (index, false)
}

/// One sub-block of `N` (`G` groups of 8): the signs, the candidate scales, the re-snap and
/// refit. `None` for a skipped sub-block (all below `eps`, or IQ2_XXS's first fit not
/// positive).
fn fit_sub_block<const N: usize, const G: usize>(
    v: &Variant,
    xb: &[f32],
    weight: &[f32; N],
) -> Option<Fit<G>> {
    let g = grid(v.lattice);
    let waux = weight.map(f32::sqrt);
    let (signs, xval) = split_signs::<N, G>(v.even_signs, xb, weight);
    let max = max_magnitude(&xval);
    if max < v.eps {
        return None;
    }
    let (scale, eff_max) = if v.qp_start {
        let mut unused = [0u8; N];
        let s = make_qp_quants(K_MAX_Q + 1, &xval, &mut unused, weight);
        let eff_max = s * K_MAX_Q as f32;
        if eff_max <= 0.0 {
            return None;
        }
        (s, eff_max)
    } else {
        (max / (2 * K_MAX_Q - 1) as f32, max)
    };
    let mut best = BestFit::<N, G>::new(scale, [true; G]);
    for is in -v.nscale..=v.nscale {
        let id = ((2 * K_MAX_Q - 1) as f32 + is as f32 * 0.1) / eff_max;
        let this_scale = 1.0 / id;
        let mut aux = [0i8; N];
        let mut aux_on_grid = [true; G];
        for (k, hit) in aux_on_grid.iter_mut().enumerate() {
            let group = &mut aux[8 * k..8 * k + 8];
            for (l, &e) in group.iter_mut().zip(&xval[8 * k..]) {
                *l = snap(id, e);
            }
            let (xv, wa) = (&xval[8 * k..8 * k + 8], &waux[8 * k..8 * k + 8]);
            *hit = to_grid(g, group, xv, wa, this_scale).1;
        }
        best.consider(weight, &xval, aux, aux_on_grid);
    }
    let (mut scale, mut levels, on_grid) = (best.scale, best.levels, best.on_grid);
    let resnap = if v.resnap_all {
        scale > 0.0
    } else {
        on_grid.contains(&false) && scale > 0.0
    };
    if resnap {
        let id = 1.0 / scale;
        for (k, &hit) in on_grid.iter().enumerate() {
            if hit && !v.resnap_all {
                continue;
            }
            let group = &mut levels[8 * k..8 * k + 8];
            for (l, &e) in group.iter_mut().zip(&xval[8 * k..]) {
                *l = snap(id, e);
            }
            to_grid(
                g,
                group,
                &xval[8 * k..8 * k + 8],
                &waux[8 * k..8 * k + 8],
                scale,
            );
        }
        scale = refit(weight, &xval, &levels, scale);
    }
    let (scale, signs) = unsigned_scale(scale, signs, v.even_signs);
    // Every group ends on the grid; ggml aborts otherwise (only NaN input gets here, and then
    // takes grid point 0).
    let index = std::array::from_fn(|k| g.index_of(&levels[8 * k..8 * k + 8]).unwrap_or(0) as u16);
    Some(Fit {
        scale,
        index,
        signs,
    })
}
