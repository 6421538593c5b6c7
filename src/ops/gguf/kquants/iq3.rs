//! The 3-bit grid types. Both quantise groups of 4 to points of a grid of odd coordinates
//! `1..15`, 32-element sub-blocks with a 4-bit scale under an f16 super-block scale, and keep
//! the signs apart.
//!
//! **IQ3_XXS** (`block_iq3_xxs`, 98 bytes per 256 elements; 256-point grid): `d: f16`, then
//! `qs: [u8; 96]`: bytes `0..64` grid indices, one per 4 elements (`8 ib + k` for elements
//! `32 ib + 4k ..`), bytes `64..96` eight little-endian `u32`s, one per sub-block: four 7-bit
//! sign masks (bit `i` of mask `k` flips element `8k + i`; the eighth sign is the parity, so
//! the flips are even) in bits `0..28`, the scale `l` in bits `28..32`. Value
//! `d * (0.5 + l) / 2 * grid[q][i] * sign`.
//!
//! **IQ3_S** (`block_iq3_s`, 110 bytes per 256 elements; 512-point grid): `d: f16`, `qs: [u8;
//! 64]` (the low 8 bits of the grid indices), `qh: [u8; 8]` (bit `k` of `qh[ib]` the ninth
//! bit of group `k` of sub-block `ib`), `signs: [u8; 32]` (one bit per element), `scales:
//! [u8; 4]` (sub-block `2j` low nibble, `2j + 1` high); value `d * (1 + 2 l) * grid * sign`.
//! Quirk kept from ggml: an all-zero sub-block does not advance the `qs` and `signs` cursors, so
//! the next sub-block's bytes land in its place (`qh` is indexed by the sub-block and does not
//! move).
//!
//! Each grid is a subset of the 4096 points of `{1, 3, .., 15}^4`; every other point gets a
//! list of grid neighbours (all grid points at the `nwant` smallest squared distances, nearest
//! first, ties by index), exactly as `iq3xs_init_impl` builds them, once per process.

use std::sync::OnceLock;

use super::iq_signs::{max_magnitude, refit, split_signs, unsigned_scale, BestFit};

use super::grids::{KGRID_3BIT_256, KGRID_3BIT_512};
use super::{for_each_block, imatrix_weights, nearest_int, sum_squares, KQuant, SubScales, QK_K};

/// Levels per coordinate (`kMaxQ`).
const K_MAX_Q: i32 = 8;

/// A grid, the map from a point's 12-bit code to its grid index, and the neighbour lists.
struct Grid {
    points: Vec<[i8; 4]>,
    /// Grid index of each code, or `None` (then `spans` has its neighbours).
    map: Vec<Option<u16>>,
    /// `(start, len)` in `neighbours` of each off-grid code.
    spans: Vec<(u32, u32)>,
    neighbours: Vec<u16>,
}

fn coords(code: usize) -> [i8; 4] {
    std::array::from_fn(|i| (2 * ((code >> (3 * i)) & 7) + 1) as i8)
}

fn code_of(levels: &[i8]) -> usize {
    levels
        .iter()
        .enumerate()
        .fold(0, |u, (i, &l)| u | ((l as usize) << (3 * i)))
}

/// Pushes the indices `j` of the sorted `(d², j)` list `dist2` that lie at its `nwant`
/// smallest distances, in list order: ggml's walk in `iq2xs_init_impl` and `iq3xs_init_impl`.
pub(super) fn push_nearest(dist2: &[(i32, usize)], nwant: usize, out: &mut Vec<u16>) {
    let (mut d2, mut nhave) = (dist2[0].0, 1);
    for &(d, j) in dist2 {
        if d > d2 {
            if nhave == nwant {
                break;
            }
            d2 = d;
            nhave += 1;
        }
        out.push(j as u16);
    }
}

impl Grid {
    /// `iq3xs_init_impl(kgrid.len())`, with `nwant` distances of neighbours.
    fn build(kgrid: &[u16], nwant: usize) -> Grid {
        let points: Vec<[i8; 4]> = kgrid.iter().map(|&c| coords(c as usize)).collect();
        let mut map = vec![None; 4096];
        for (k, &code) in kgrid.iter().enumerate() {
            map[code as usize] = Some(k as u16);
        }
        let mut spans = vec![(0u32, 0u32); 4096];
        let mut neighbours = Vec::new();
        let mut dist2: Vec<(i32, usize)> = Vec::with_capacity(points.len());
        for code in (0..4096).filter(|&c| map[c].is_none()) {
            let pos = coords(code);
            dist2.clear();
            dist2.extend(points.iter().enumerate().map(|(j, p)| {
                let d: i32 = (0..4).map(|i| (p[i] as i32 - pos[i] as i32).pow(2)).sum();
                (d, j)
            }));
            dist2.sort_unstable();
            let start = neighbours.len();
            push_nearest(&dist2, nwant, &mut neighbours);
            spans[code] = (start as u32, (neighbours.len() - start) as u32);
        }
        Grid {
            points,
            map,
            spans,
            neighbours,
        }
    }

    /// `iq3_find_best_neighbour`: of the off-grid `code`'s neighbours, the one nearest `xval`
    /// at `scale` in `weight`ed squared distance (the first on ties); its levels go to `levels`.
    fn best_neighbour(
        &self,
        code: usize,
        xval: &[f32],
        weight: &[f32],
        scale: f32,
        levels: &mut [i8],
    ) -> usize {
        let (start, len) = self.spans[code];
        let candidates = &self.neighbours[start as usize..(start + len) as usize];
        let mut best_d2 = f32::MAX;
        // ggml asserts a neighbour wins; only NaN distances can leave none, and then the first
        // is as good as any.
        let mut best = candidates[0] as usize;
        for &j in candidates {
            let pg = &self.points[j as usize];
            let mut d2 = 0.0f32;
            for i in 0..4 {
                let diff = scale * pg[i] as f32 - xval[i];
                d2 += weight[i] * diff * diff;
            }
            if d2 < best_d2 {
                best_d2 = d2;
                best = j as usize;
            }
        }
        self.levels_of(best, levels);
        best
    }

    /// The levels (`0..8`) of grid point `index`.
    fn levels_of(&self, index: usize, levels: &mut [i8]) {
        for (l, &p) in levels.iter_mut().zip(&self.points[index]) {
            *l = (p - 1) / 2;
        }
    }

    /// The grid index of 4 levels and whether they were on the grid; off it, the best
    /// neighbour's (and `levels` become its levels).
    fn index_of(
        &self,
        xval: &[f32],
        weight: &[f32],
        scale: f32,
        levels: &mut [i8],
    ) -> (usize, bool) {
        let code = code_of(levels);
        match self.map[code] {
            Some(k) => (k as usize, true),
            None => (
                self.best_neighbour(code, xval, weight, scale, levels),
                false,
            ),
        }
    }
}

/// What differs between the two types' sub-block searches.
struct Variant {
    grid: fn() -> &'static Grid,
    /// A sub-block whose largest magnitude is below this is skipped (IQ3_XXS's
    /// `GROUP_MAX_EPS_IQ3_XXS`); `None`: only an all-zero one (IQ3_S).
    eps: Option<f32>,
    /// IQ3_XXS stores 7 signs per 8 and makes the flips even.
    even_signs: bool,
    /// Candidate scales `(15 + 0.2 is) / max` for `is` in `-nscale..=nscale`.
    nscale: i32,
    /// IQ3_S starts with every group "off grid" and re-snaps all of them at the winning scale;
    /// IQ3_XXS only those its winner had off the grid.
    resnap_all: bool,
}

const IQ3_XXS: Variant = Variant {
    grid: grid_256,
    eps: Some(1e-8),
    even_signs: true,
    nscale: 15,
    resnap_all: false,
};

const IQ3_S: Variant = Variant {
    grid: grid_512,
    eps: None,
    even_signs: false,
    nscale: 9,
    resnap_all: true,
};

/// Per code of IQ3_XXS's (`large` false) or IQ3_S's grid: the grid index, or the neighbour
/// list (as kernels/iq_grid.cuh's blob lays the map out); and the grid.
pub(super) fn lists(large: bool) -> (Vec<Result<u16, &'static [u16]>>, &'static [u16]) {
    let (g, kgrid): (&'static Grid, &'static [u16]) = match large {
        false => (grid_256(), &KGRID_3BIT_256),
        true => (grid_512(), &KGRID_3BIT_512),
    };
    let lists = (g.map.iter().zip(&g.spans))
        .map(|(m, &(start, len))| match m {
            Some(k) => Ok(*k),
            None => Err(&g.neighbours[start as usize..(start + len) as usize]),
        })
        .collect();
    (lists, kgrid)
}

fn grid_256() -> &'static Grid {
    static GRID: OnceLock<Grid> = OnceLock::new();
    GRID.get_or_init(|| Grid::build(&KGRID_3BIT_256, 2))
}

fn grid_512() -> &'static Grid {
    static GRID: OnceLock<Grid> = OnceLock::new();
    GRID.get_or_init(|| Grid::build(&KGRID_3BIT_512, 3))
}

/// One sub-block's fit: its scale, levels and sign bytes (`even_signs`: 7 bits each).
struct SubBlock {
    scale: f32,
    levels: [i8; 32],
    signs: [u8; 4],
}

/// The sub-block weights: the imatrix's `qw * sqrt(sigma2 + x²)`, else `x²`.
fn sub_block_weights(xb: &[f32], qw: Option<&[f32]>, sigma2: f32) -> [f32; 32] {
    let mut weight = [0.0f32; 32];
    match qw {
        Some(qw) => {
            imatrix_weights(&mut weight, qw, xb, sigma2);
        }
        None => {
            for (w, &e) in weight.iter_mut().zip(xb) {
                *w = e * e;
            }
        }
    }
    weight
}

/// IQ3_XXS: 3.06 bits per weight; byte-exact to ggml 0c1e570's `quantize_iq3_xxs`
/// (`quantize_row_iq3_xxs_impl` with the 256-point grid, weights the imatrix when given, `x²`
/// otherwise, as `quantize_row_iq3_xxs_ref` does too).
pub fn quantize_row_iq3_xxs(src: &[f32], dst: &mut [u8], quant_weights: Option<&[f32]>) {
    for_each_block(KQuant::Iq3Xxs, src, dst, quant_weights, quantize_block_xxs);
}

fn quantize_block_xxs(x: &[f32], qw: Option<&[f32]>, y: &mut [u8]) {
    let g = grid_256();
    y.fill(0);
    let mut sub = SubScales::<8>::new();
    let mut scales_and_signs = [0u32; 8];
    let sigma2 = 2.0 * sum_squares(x) / QK_K as f32;
    for (ib, xb) in x.chunks_exact(32).enumerate() {
        let weight = sub_block_weights(xb, qw.map(|w| &w[32 * ib..32 * (ib + 1)]), sigma2);
        let Some(fit) = fit_sub_block(&IQ3_XXS, xb, &weight) else {
            continue;
        };
        for k in 0..8 {
            y[2 + 8 * ib + k] = grid_index(g, &fit.levels[4 * k..4 * k + 4]) as u8;
        }
        let s = fit.signs.map(u32::from);
        scales_and_signs[ib] = s[0] | (s[1] << 7) | (s[2] << 14) | (s[3] << 21);
        sub.set(ib, fit.scale);
    }
    let Some(d) = sub.put_super_scale(31.0, 1.0125, y) else {
        y.fill(0);
        return;
    };
    let id = 1.0 / d;
    for (ib, s) in scales_and_signs.iter_mut().enumerate() {
        *s |= (scale_level(id, sub.scales[ib]) as u32) << 28;
        y[66 + 4 * ib..70 + 4 * ib].copy_from_slice(&s.to_le_bytes());
    }
}

/// IQ3_S: 3.44 bits per weight; byte-exact to ggml 0c1e570's `quantize_iq3_s`
/// (`quantize_row_iq3_s_impl` with sub-blocks of 32 and the 512-point grid, weights the
/// imatrix when given, `x²` otherwise, as `quantize_row_iq3_s_ref` does too).
pub fn quantize_row_iq3_s(src: &[f32], dst: &mut [u8], quant_weights: Option<&[f32]>) {
    for_each_block(KQuant::Iq3S, src, dst, quant_weights, quantize_block_s);
}

fn quantize_block_s(x: &[f32], qw: Option<&[f32]>, y: &mut [u8]) {
    const QS: usize = 2;
    const QH: usize = 66;
    const SIGNS: usize = 74;
    const SCALES: usize = 106;
    let g = grid_512();
    y.fill(0);
    let mut sub = SubScales::<8>::new();
    let sigma2 = 2.0 * sum_squares(x) / QK_K as f32;
    // ggml's cursors into `qs` and `signs`, advanced per fitted (not per skipped) sub-block.
    let (mut qs, mut signs) = (QS, SIGNS);
    for (ib, xb) in x.chunks_exact(32).enumerate() {
        let weight = sub_block_weights(xb, qw.map(|w| &w[32 * ib..32 * (ib + 1)]), sigma2);
        let Some(fit) = fit_sub_block(&IQ3_S, xb, &weight) else {
            continue;
        };
        for k in 0..8 {
            let index = grid_index(g, &fit.levels[4 * k..4 * k + 4]);
            y[qs + k] = index as u8;
            y[QH + ib] |= ((index >> 8) << k) as u8;
        }
        qs += 8;
        y[signs..signs + 4].copy_from_slice(&fit.signs);
        signs += 4;
        sub.set(ib, fit.scale);
    }
    let Some(d) = sub.put_super_scale(31.0, 1.033, y) else {
        return;
    };
    let id = 1.0 / d;
    for (j, pair) in sub.scales.chunks_exact(2).enumerate() {
        y[SCALES + j] = scale_level(id, pair[0]) | (scale_level(id, pair[1]) << 4);
    }
}

/// A sub-block scale's 4-bit level `l`, the one `(1 + 2 l) d / 2` is nearest.
fn scale_level(id: f32, scale: f32) -> u8 {
    nearest_int(0.5 * (id * scale - 1.0)).clamp(0, 15) as u8
}

/// The grid index of 4 levels the fit left on the grid.
fn grid_index(g: &Grid, levels: &[i8]) -> usize {
    g.map[code_of(levels)].expect("the fit leaves every group on the grid") as usize
}

/// One sub-block of 32: the signs, then candidate scales, each snapping groups of 4 to the
/// grid, the best least-squares fit kept; then groups re-snapped at the winner's scale and the
/// scale refitted. `None` for a skipped (all-zero) sub-block.
fn fit_sub_block(v: &Variant, xb: &[f32], weight: &[f32; 32]) -> Option<SubBlock> {
    let g = (v.grid)();
    let mut waux = [0.0f32; 32];
    for (a, &w) in waux.iter_mut().zip(weight) {
        *a = w.sqrt();
    }
    let (signs, xval) = split_signs::<32, 4>(v.even_signs, xb, weight);
    let max = max_magnitude(&xval);
    let skip = match v.eps {
        Some(eps) => max < eps,
        None => max == 0.0,
    };
    if skip {
        return None;
    }
    let mut best = BestFit::<32, 8>::new(max / (2 * K_MAX_Q - 1) as f32, [!v.resnap_all; 8]);
    for is in -v.nscale..=v.nscale {
        let id = ((2 * K_MAX_Q - 1) as f32 + is as f32 * 0.2) / max;
        let this_scale = 1.0 / id;
        let mut aux = [0i8; 32];
        let mut aux_on_grid = [true; 8];
        let groups = aux
            .chunks_exact_mut(4)
            .zip(xval.chunks_exact(4))
            .zip(waux.chunks_exact(4));
        for (hit, ((a, xv), wa)) in aux_on_grid.iter_mut().zip(groups) {
            for (l, &e) in a.iter_mut().zip(xv) {
                *l = snap(id, e);
            }
            *hit = g.index_of(xv, wa, this_scale, a).1;
        }
        best.consider(weight, &xval, aux, aux_on_grid);
    }
    let (mut scale, mut levels, on_grid) = (best.scale, best.levels, best.on_grid);
    if on_grid.contains(&false) && scale > 0.0 {
        let id = 1.0 / scale;
        let groups = levels
            .chunks_exact_mut(4)
            .zip(xval.chunks_exact(4))
            .zip(waux.chunks_exact(4));
        for (&hit, ((l, xv), wa)) in on_grid.iter().zip(groups) {
            if hit && !v.resnap_all {
                continue;
            }
            let mut snapped = [0i8; 4];
            for (s, &e) in snapped.iter_mut().zip(xv) {
                *s = snap(id, e);
            }
            let (index, _) = g.index_of(xv, wa, scale, &mut snapped);
            g.levels_of(index, l);
        }
        scale = refit(weight, &xval, &levels, scale);
    }
    let (scale, signs) = unsigned_scale(scale, signs, v.even_signs);
    Some(SubBlock {
        scale,
        levels,
        signs,
    })
}

/// The level (`0..8`) of coordinate `2 l + 1` nearest `id * v`.
#[inline]
fn snap(id: f32, v: f32) -> i8 {
    nearest_int(0.5 * (id * v - 1.0)).clamp(0, K_MAX_Q - 1) as i8
}
