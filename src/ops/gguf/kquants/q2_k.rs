//! **Q2_K** (`block_q2_K`, 84 bytes per 256 elements): `scales: [u8; 16]` (per 16 elements,
//! low nibble the scale, high nibble the min), `qs: [u8; 64]` (2-bit levels, planes as
//! [`pack_2bit`]), `d: f16`, `dmin: f16`; value `d * (sc & 15) * q - dmin * (sc >> 4)`.

use super::search::{fit_sub_blocks, make_qp_quants, AffineSearch, SubBlockFits};
use super::{
    f16_bytes, for_each_block, imatrix_weights, nearest_int, pack_2bit, read_f16, sub_blocks,
    sum_squares, KQuant, QK_K,
};

const SCALES: usize = 0;
const QS: usize = 16;
const D: usize = 80;

/// Q2_K: 16 sub-blocks of 16 with 4-bit scales and mins, 2-bit levels; byte-exact to ggml
/// 0c1e570's `quantize_q2_K` (quant weights given: `quantize_row_q2_K_impl`; none:
/// `quantize_row_q2_K_ref`).
pub fn quantize_row_q2_k(src: &[f32], dst: &mut [u8], quant_weights: Option<&[f32]>) {
    for_each_block(KQuant::Q2K, src, dst, quant_weights, |x, qw, y| {
        let mut levels = [0u8; QK_K];
        match qw {
            None => fit_ref(x, &mut levels, y),
            Some(w) => fit_imatrix(x, w, &mut levels, y),
        }
        requantize(x, &mut levels, y);
        pack_2bit(&levels, &mut y[QS..QS + 64]);
    });
}

/// `quantize_row_q2_K_ref`'s scales: each sub-block fitted with weights `|x|` by absolute
/// error, scales and mins then scaled to 4 bits by their maxima.
fn fit_ref(x: &[f32], levels: &mut [u8; QK_K], y: &mut [u8]) {
    const SEARCH: AffineSearch = AffineSearch::new(-0.5, 0.1, 15, true);
    let weigh = |_, xs: &[f32], w: &mut [f32; 16]| {
        for (w, &e) in w.iter_mut().zip(xs) {
            *w = e.abs();
        }
        0.0
    };
    let fits: SubBlockFits<16> = fit_sub_blocks(x, levels, 3, SEARCH, weigh);
    let (scales, mins) = (fits.scales, fits.mins);
    let (max_scale, max_min) = fits.maxima();
    let sc = &mut y[SCALES..SCALES + 16];
    if max_scale > 0.0 {
        let iscale = 15.0 / max_scale;
        for (s, &scale) in sc.iter_mut().zip(&scales) {
            *s = nearest_int(iscale * scale) as u8;
        }
    } else {
        sc.fill(0);
    }
    if max_min > 0.0 {
        let iscale = 15.0 / max_min;
        for (s, &min) in sc.iter_mut().zip(&mins) {
            *s |= (nearest_int(iscale * min) << 4) as u8;
        }
    }
    let d = if max_scale > 0.0 {
        max_scale / 15.0
    } else {
        0.0
    };
    let dmin = if max_min > 0.0 { max_min / 15.0 } else { 0.0 };
    y[D..D + 2].copy_from_slice(&f16_bytes(d));
    y[D + 2..D + 4].copy_from_slice(&f16_bytes(dmin));
}

/// `quantize_row_q2_K_impl`'s scales: weights `qw * sqrt(sigma2 + x²)`, squared error, then
/// scales and mins quantised by `make_qp_quants` weighted by each sub-block's total weight.
fn fit_imatrix(x: &[f32], qw: &[f32], levels: &mut [u8; QK_K], y: &mut [u8]) {
    let sigma2 = sum_squares(x) / QK_K as f32;
    let weigh = |j: usize, xs: &[f32], w: &mut [f32; 16]| {
        imatrix_weights(w, &qw[16 * j..16 * (j + 1)], xs, sigma2)
    };
    let fits: SubBlockFits<16> = fit_sub_blocks(x, levels, 3, AffineSearch::WEIGHTED, weigh);
    let mut ls = [0u8; 16];
    let mut lm = [0u8; 16];
    let dm = make_qp_quants(15, &fits.scales, &mut ls, &fits.weights);
    let mm = make_qp_quants(15, &fits.mins, &mut lm, &fits.weights);
    y[D..D + 2].copy_from_slice(&f16_bytes(dm));
    y[D + 2..D + 4].copy_from_slice(&f16_bytes(mm));
    for (s, (&l, &m)) in y[SCALES..SCALES + 16].iter_mut().zip(ls.iter().zip(&lm)) {
        *s = l | (m << 4);
    }
}

/// Recomputes the levels from the stored scales and mins, as both paths do; a sub-block whose
/// scale decodes to zero keeps the levels of its fit.
fn requantize(x: &[f32], levels: &mut [u8; QK_K], y: &[u8]) {
    let d_all = read_f16(&y[D..D + 2]);
    let dmin_all = read_f16(&y[D + 2..D + 4]);
    for (j, (xs, ls)) in sub_blocks(x, &mut levels[..], 16) {
        let sc = y[SCALES + j];
        let d = d_all * (sc & 0xF) as f32;
        if d == 0.0 {
            continue;
        }
        let m = dmin_all * (sc >> 4) as f32;
        for (l, &e) in ls.iter_mut().zip(xs) {
            *l = nearest_int((e + m) / d).clamp(0, 3) as u8;
        }
    }
}
