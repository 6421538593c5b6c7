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

use super::{for_each_block, imatrix_weights, nearest_int, sum_squares, KQuant, SubScales, QK_K};

/// Levels per coordinate (`kMaxQ`).
const K_MAX_Q: i32 = 8;

/// `kgrid_256` of `iq3xs_init_impl`: grid point `k` has coordinate `i` equal to
/// `2 ((KGRID_256[k] >> 3i) & 7) + 1`.
#[rustfmt::skip]
const KGRID_256: [u16; 256] = [
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

/// `kgrid_512` of `iq3xs_init_impl`, coded as [`KGRID_256`].
#[rustfmt::skip]
const KGRID_512: [u16; 512] = [
    0, 1, 2, 5, 7, 8, 9, 10, 12, 14, 16, 17, 21, 27, 32, 34,
    37, 39, 41, 43, 48, 50, 57, 60, 63, 64, 65, 66, 68, 72, 73, 77,
    80, 83, 87, 89, 93, 100, 113, 117, 122, 128, 129, 133, 135, 136, 139, 142,
    145, 149, 152, 156, 162, 165, 167, 169, 171, 184, 187, 195, 201, 205, 208, 210,
    217, 219, 222, 228, 232, 234, 247, 249, 253, 256, 267, 271, 273, 276, 282, 288,
    291, 297, 312, 322, 324, 336, 338, 342, 347, 353, 357, 359, 374, 379, 390, 393,
    395, 409, 426, 441, 448, 450, 452, 464, 466, 470, 475, 488, 492, 512, 513, 514,
    516, 520, 521, 523, 525, 527, 528, 530, 537, 540, 542, 556, 558, 561, 570, 576,
    577, 579, 582, 584, 588, 593, 600, 603, 609, 616, 618, 632, 638, 640, 650, 653,
    655, 656, 660, 666, 672, 675, 685, 688, 698, 705, 708, 711, 712, 715, 721, 727,
    728, 732, 737, 754, 760, 771, 773, 778, 780, 793, 795, 802, 806, 808, 812, 833,
    840, 843, 849, 856, 858, 873, 912, 916, 919, 932, 934, 961, 963, 968, 970, 977,
    989, 993, 1010, 1016, 1024, 1025, 1027, 1029, 1031, 1032, 1034, 1036, 1038, 1041, 1043, 1047,
    1048, 1050, 1057, 1059, 1061, 1064, 1066, 1079, 1080, 1083, 1085, 1088, 1090, 1096, 1099, 1103,
    1106, 1109, 1113, 1116, 1122, 1129, 1153, 1156, 1159, 1169, 1171, 1176, 1183, 1185, 1195, 1199,
    1209, 1212, 1216, 1218, 1221, 1225, 1234, 1236, 1241, 1243, 1250, 1256, 1270, 1281, 1287, 1296,
    1299, 1306, 1309, 1313, 1338, 1341, 1348, 1353, 1362, 1375, 1376, 1387, 1400, 1408, 1410, 1415,
    1425, 1453, 1457, 1477, 1481, 1494, 1496, 1507, 1512, 1538, 1545, 1547, 1549, 1551, 1554, 1561,
    1563, 1565, 1570, 1572, 1575, 1577, 1587, 1593, 1601, 1603, 1605, 1612, 1617, 1619, 1632, 1648,
    1658, 1662, 1664, 1674, 1680, 1690, 1692, 1704, 1729, 1736, 1740, 1745, 1747, 1751, 1752, 1761,
    1763, 1767, 1773, 1787, 1795, 1801, 1806, 1810, 1817, 1834, 1840, 1844, 1857, 1864, 1866, 1877,
    1882, 1892, 1902, 1915, 1934, 1953, 1985, 1987, 2000, 2002, 2013, 2048, 2052, 2058, 2064, 2068,
    2071, 2074, 2081, 2088, 2104, 2114, 2119, 2121, 2123, 2130, 2136, 2141, 2147, 2153, 2157, 2177,
    2179, 2184, 2189, 2193, 2203, 2208, 2223, 2226, 2232, 2244, 2249, 2251, 2256, 2258, 2265, 2269,
    2304, 2306, 2324, 2335, 2336, 2361, 2373, 2375, 2385, 2418, 2443, 2460, 2480, 2504, 2509, 2520,
    2531, 2537, 2562, 2568, 2572, 2578, 2592, 2596, 2599, 2602, 2614, 2620, 2625, 2627, 2629, 2634,
    2641, 2650, 2682, 2688, 2697, 2707, 2712, 2718, 2731, 2754, 2759, 2760, 2775, 2788, 2793, 2805,
    2811, 2817, 2820, 2832, 2842, 2854, 2890, 2902, 2921, 2923, 2978, 3010, 3012, 3026, 3081, 3083,
    3085, 3097, 3099, 3120, 3136, 3152, 3159, 3188, 3210, 3228, 3234, 3245, 3250, 3256, 3264, 3276,
    3281, 3296, 3349, 3363, 3378, 3392, 3395, 3420, 3440, 3461, 3488, 3529, 3531, 3584, 3588, 3591,
    3600, 3602, 3614, 3616, 3628, 3634, 3650, 3657, 3668, 3683, 3685, 3713, 3716, 3720, 3726, 3729,
    3736, 3753, 3778, 3802, 3805, 3819, 3841, 3845, 3851, 3856, 3880, 3922, 3938, 3970, 3993, 4032,
];

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

fn grid_256() -> &'static Grid {
    static GRID: OnceLock<Grid> = OnceLock::new();
    GRID.get_or_init(|| Grid::build(&KGRID_256, 2))
}

fn grid_512() -> &'static Grid {
    static GRID: OnceLock<Grid> = OnceLock::new();
    GRID.get_or_init(|| Grid::build(&KGRID_512, 3))
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
