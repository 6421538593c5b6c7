//! **IQ3_XXS** (`block_iq3_xxs`, 98 bytes per 256 elements): `d: f16`, then `qs: [u8; 96]`:
//! bytes `0..64` are grid indices, one per 4 elements (`8 ib + k` for elements
//! `32 ib + 4k ..`), bytes `64..96` eight little-endian `u32`s, one per 32 elements: four 7-bit
//! sign masks (bit `i` of mask `k` flips element `8k + i`; the eighth sign is the parity, so the
//! number of flips is even) in bits `0..28`, the 4-bit scale `l` in bits `28..32`. Value
//! `d * (0.5 + l) / 2 * grid[q][i] * sign`, the grid points having odd coordinates `1..15`.
//!
//! The grid is 256 of the 4096 points of `{1, 3, .., 15}^4`; every other point gets a list of
//! grid neighbours (all grid points at the two smallest squared distances, nearest first, ties
//! by index), exactly as `iq3xs_init_impl(256)` builds them, once per process.

use std::sync::OnceLock;

use super::{check_row, f16_bytes, imatrix_weights, nearest_int, sum_squares, KQuant, QK_K};

const BLOCK_BYTES: usize = 98;
/// `GROUP_MAX_EPS_IQ3_XXS`.
const GROUP_MAX_EPS: f32 = 1e-8;
/// Levels per coordinate (`kMaxQ`).
const K_MAX_Q: i32 = 8;

/// `kgrid_256` of `iq3xs_init_impl`: grid point `k` has coordinate `i` equal to
/// `2 ((KGRID[k] >> 3i) & 7) + 1`.
#[rustfmt::skip]
const KGRID: [u16; 256] = [
    0, 2, 4, 9, 11, 15, 16, 18, 25, 34, 59, 61, 65, 67, 72, 74,
    81, 85, 88, 90, 97, 108, 120, 128, 130, 132, 137, 144, 146, 153, 155, 159,
    169, 175, 189, 193, 199, 200, 202, 213, 248, 267, 287, 292, 303, 315, 317, 321,
    327, 346, 362, 413, 436, 456, 460, 462, 483, 497, 513, 515, 520, 522, 529, 531,
    536, 538, 540, 551, 552, 576, 578, 585, 592, 594, 641, 643, 648, 650, 657, 664,
    698, 704, 706, 720, 729, 742, 758, 769, 773, 808, 848, 852, 870, 889, 901, 978,
    992, 1024, 1026, 1033, 1035, 1040, 1042, 1046, 1049, 1058, 1089, 1091, 1093, 1096, 1098, 1105,
    1112, 1139, 1143, 1144, 1152, 1154, 1161, 1167, 1168, 1170, 1183, 1184, 1197, 1217, 1224, 1228,
    1272, 1276, 1309, 1323, 1347, 1367, 1377, 1404, 1473, 1475, 1486, 1509, 1537, 1544, 1546, 1553,
    1555, 1576, 1589, 1594, 1600, 1602, 1616, 1625, 1636, 1638, 1665, 1667, 1672, 1685, 1706, 1722,
    1737, 1755, 1816, 1831, 1850, 1856, 1862, 1874, 1901, 1932, 1950, 1971, 2011, 2032, 2052, 2063,
    2077, 2079, 2091, 2095, 2172, 2192, 2207, 2208, 2224, 2230, 2247, 2277, 2308, 2345, 2356, 2389,
    2403, 2424, 2501, 2504, 2506, 2520, 2570, 2593, 2616, 2624, 2630, 2646, 2669, 2700, 2714, 2746,
    2754, 2795, 2824, 2835, 2839, 2874, 2882, 2905, 2984, 3028, 3042, 3092, 3108, 3110, 3124, 3153,
    3185, 3215, 3252, 3288, 3294, 3364, 3397, 3434, 3483, 3523, 3537, 3587, 3589, 3591, 3592, 3610,
    3626, 3670, 3680, 3722, 3749, 3754, 3776, 3789, 3803, 3824, 3857, 3873, 3904, 3906, 3924, 3992,
];

/// The grid, the map from a point's 12-bit code to its grid index, and the neighbour lists.
struct Grid {
    points: [[i8; 4]; 256],
    /// Grid index of each code, or `None` (then `spans` has its neighbours).
    map: Vec<Option<u8>>,
    /// `(start, len)` in `neighbours` of each off-grid code.
    spans: Vec<(u32, u32)>,
    neighbours: Vec<u8>,
}

fn grid() -> &'static Grid {
    static GRID: OnceLock<Grid> = OnceLock::new();
    GRID.get_or_init(build_grid)
}

fn build_grid() -> Grid {
    let coords = |code: usize| -> [i8; 4] {
        std::array::from_fn(|i| (2 * ((code >> (3 * i)) & 7) + 1) as i8)
    };
    let points: [[i8; 4]; 256] = std::array::from_fn(|k| coords(KGRID[k] as usize));
    let mut map = vec![None; 4096];
    for (k, &code) in KGRID.iter().enumerate() {
        map[code as usize] = Some(k as u8);
    }
    let mut spans = vec![(0u32, 0u32); 4096];
    let mut neighbours = Vec::new();
    let mut dist2: Vec<(i32, usize)> = Vec::with_capacity(256);
    for code in 0..4096 {
        if map[code].is_some() {
            continue;
        }
        let pos = coords(code);
        dist2.clear();
        dist2.extend(points.iter().enumerate().map(|(j, p)| {
            let d: i32 = (0..4).map(|i| (p[i] as i32 - pos[i] as i32).pow(2)).sum();
            (d, j)
        }));
        dist2.sort_unstable();
        let start = neighbours.len();
        let (mut d2, mut nhave) = (dist2[0].0, 1);
        for &(d, j) in &dist2 {
            if d > d2 {
                if nhave == 2 {
                    break;
                }
                d2 = d;
                nhave += 1;
            }
            neighbours.push(j as u8);
        }
        spans[code] = (start as u32, (neighbours.len() - start) as u32);
    }
    Grid {
        points,
        map,
        spans,
        neighbours,
    }
}

impl Grid {
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
        let mut best_d2 = f32::MAX;
        let mut best = None;
        for &j in &self.neighbours[start as usize..(start + len) as usize] {
            let pg = &self.points[j as usize];
            let mut d2 = 0.0f32;
            for i in 0..4 {
                let diff = scale * pg[i] as f32 - xval[i];
                d2 += weight[i] * diff * diff;
            }
            if d2 < best_d2 {
                best_d2 = d2;
                best = Some(j as usize);
            }
        }
        // ggml asserts a neighbour was found; only NaN distances can leave none, and then the
        // first neighbour is as good as any.
        let j = best.unwrap_or(self.neighbours[start as usize] as usize);
        for (l, &p) in levels.iter_mut().zip(&self.points[j]) {
            *l = (p - 1) / 2;
        }
        j
    }

    /// The grid index for 4 levels, or the best neighbour's (levels then updated).
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

fn code_of(levels: &[i8]) -> usize {
    levels
        .iter()
        .enumerate()
        .fold(0, |u, (i, &l)| u | ((l as usize) << (3 * i)))
}

/// IQ3_XXS: 3.06 bits per weight, groups of 4 on a 256-point grid with shared signs and 4-bit
/// sub-block scales; byte-exact to ggml 0c1e570's `quantize_iq3_xxs` (`quantize_row_iq3_xxs_impl`
/// with grid size 256; weights the imatrix, `qw * sqrt(sigma2 + x²)`, when given, `x²`
/// otherwise — the path `quantize_row_iq3_xxs_ref` takes too).
pub fn quantize_row_iq3_xxs(src: &[f32], dst: &mut [u8], quant_weights: Option<&[f32]>) {
    check_row(KQuant::Iq3Xxs, src, dst, quant_weights);
    let g = grid();
    for (ibl, (x, y)) in src
        .chunks_exact(QK_K)
        .zip(dst.chunks_exact_mut(BLOCK_BYTES))
        .enumerate()
    {
        let qw = quant_weights.map(|w| &w[QK_K * ibl..QK_K * (ibl + 1)]);
        quantize_block(g, x, qw, y);
    }
}

fn quantize_block(g: &Grid, x: &[f32], qw: Option<&[f32]>, y: &mut [u8]) {
    y.fill(0);
    let mut scales = [0.0f32; 8];
    let mut scales_and_signs = [0u32; 8];
    let sigma2 = 2.0 * sum_squares(x) / QK_K as f32;
    let mut max_scale = 0.0f32;
    for (ib, xb) in x.chunks_exact(32).enumerate() {
        let mut weight = [0.0f32; 32];
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
        let Some((scale, levels, signs)) = fit_sub_block(g, xb, &weight) else {
            continue;
        };
        for k in 0..8 {
            let index = g.map[code_of(&levels[4 * k..4 * k + 4])]
                .expect("the fit leaves every group on the grid");
            y[2 + 8 * ib + k] = index;
        }
        scales_and_signs[ib] = signs[0] | (signs[1] << 7) | (signs[2] << 14) | (signs[3] << 21);
        scales[ib] = scale;
        max_scale = if max_scale > scale { max_scale } else { scale };
    }
    if max_scale == 0.0 {
        y.fill(0);
        return;
    }
    let d = max_scale / 31.0;
    y[0..2].copy_from_slice(&f16_bytes(d * 1.0125));
    let id = 1.0 / d;
    for (ib, s) in scales_and_signs.iter_mut().enumerate() {
        let l = nearest_int(0.5 * (id * scales[ib] - 1.0)).clamp(0, 15);
        *s |= (l as u32) << 28;
        y[66 + 4 * ib..70 + 4 * ib].copy_from_slice(&s.to_le_bytes());
    }
}

/// One sub-block of 32: the signs (an even number of flips per 8, the cheapest element taking
/// the parity), then 31 candidate scales, each snapping groups of 4 to the grid, the best
/// least-squares fit kept; off-grid groups of the winner re-snapped at its scale. `None` for
/// an all-zero sub-block (its bytes stay 0).
fn fit_sub_block(g: &Grid, xb: &[f32], weight: &[f32; 32]) -> Option<(f32, [i8; 32], [u32; 4])> {
    let mut waux = [0.0f32; 32];
    for (a, &w) in waux.iter_mut().zip(weight) {
        *a = w.sqrt();
    }
    let mut xval = [0.0f32; 32];
    let mut signs = [0u32; 4];
    for k in 0..4 {
        let mut nflip = 0;
        let mut s = 0u8;
        for i in 0..8 {
            let e = xb[8 * k + i];
            if e >= 0.0 {
                xval[8 * k + i] = e;
            } else {
                xval[8 * k + i] = -e;
                nflip += 1;
                s |= 1 << i;
            }
        }
        if nflip % 2 == 1 {
            let cost = |i: usize| weight[8 * k + i] * xb[8 * k + i] * xb[8 * k + i];
            let mut imin = 0;
            let mut min = cost(0);
            for i in 1..8 {
                if cost(i) < min {
                    min = cost(i);
                    imin = i;
                }
            }
            xval[8 * k + imin] = -xval[8 * k + imin];
            s ^= 1 << imin;
        }
        signs[k] = (s & 127) as u32;
    }
    let mut max = xval[0];
    for &v in &xval[1..] {
        max = if max > v { max } else { v };
    }
    if max < GROUP_MAX_EPS {
        return None;
    }
    let mut levels = [0i8; 32];
    let mut on_grid = [true; 8];
    let mut best = 0.0f32;
    let mut scale = max / (2 * K_MAX_Q - 1) as f32;
    for is in -15..=15 {
        let id = ((2 * K_MAX_Q - 1) as f32 + is as f32 * 0.2) / max;
        let this_scale = 1.0 / id;
        let mut aux = [0i8; 32];
        let mut aux_on_grid = [true; 8];
        let groups = aux
            .chunks_exact_mut(4)
            .zip(xval.chunks_exact(4))
            .zip(waux.chunks_exact(4));
        for (hit, ((a, xv), wa)) in aux_on_grid.iter_mut().zip(groups) {
            for (l, &v) in a.iter_mut().zip(xv) {
                *l = snap(id, v);
            }
            *hit = g.index_of(xv, wa, this_scale, a).1;
        }
        let (sumqx, sumq2) = fit(weight, &xval, &aux);
        if sumq2 > 0.0 && sumqx * sumqx > best * sumq2 {
            scale = sumqx / sumq2;
            best = scale * sumqx;
            levels = aux;
            on_grid = aux_on_grid;
        }
    }
    if on_grid.contains(&false) && scale > 0.0 {
        let id = 1.0 / scale;
        for k in (0..8).filter(|&k| !on_grid[k]) {
            let group = 4 * k..4 * k + 4;
            let mut snapped = [0i8; 4];
            for (l, &v) in snapped.iter_mut().zip(&xval[group.clone()]) {
                *l = snap(id, v);
            }
            let (index, _) = g.index_of(
                &xval[group.clone()],
                &waux[group.clone()],
                scale,
                &mut snapped,
            );
            for (l, &p) in levels[group].iter_mut().zip(&g.points[index]) {
                *l = (p - 1) / 2;
            }
        }
        let (sumqx, sumq2) = fit(weight, &xval, &levels);
        if sumq2 > 0.0 {
            scale = sumqx / sumq2;
        }
    }
    if scale < 0.0 {
        scale = -scale;
        signs = signs.map(|s| !s & 127);
    }
    Some((scale, levels, signs))
}

/// The level (`0..8`) of coordinate `2 l + 1` nearest `id * v`.
#[inline]
fn snap(id: f32, v: f32) -> i8 {
    nearest_int(0.5 * (id * v - 1.0)).clamp(0, K_MAX_Q - 1) as i8
}

/// `(Σ w x q, Σ w q²)` with `q = 2 l + 1`.
fn fit(weight: &[f32; 32], xval: &[f32; 32], levels: &[i8; 32]) -> (f32, f32) {
    let (mut sumqx, mut sumq2) = (0.0f32, 0.0f32);
    for i in 0..32 {
        let q = (2 * levels[i] as i32 + 1) as f32;
        sumqx += weight[i] * xval[i] * q;
        sumq2 += weight[i] * q * q;
    }
    (sumqx, sumq2)
}
