//! **Q3_K** (`block_q3_K`, 110 bytes per 256 elements): `hmask: [u8; 32]` (bit `k` of
//! `hmask[l]` set when element `32k + l` has level `>= 4`), `qs: [u8; 64]` (the low 2 bits,
//! planes as [`pack_2bit`]), `scales: [u8; 12]` (sixteen 6-bit scales biased by 32: low nibbles
//! of sub-blocks 0..8 and 8..16 in the low and high nibbles of bytes 0..8, the top two bits of
//! sub-block `j` at bit `2 (j / 4)` of byte `8 + j % 4`), `d: f16`; value
//! `d * (scale - 32) * (q - 4)`.

use super::search::{fit_q3_sub_blocks, fit_symmetric_sub_blocks, make_qx_quants};
use super::{
    f16_bytes, for_each_block, imatrix_weights, nearest_int, pack_2bit, read_f16, signed_max,
    sub_blocks, sum_squares, KQuant, QK_K,
};

const HMASK: usize = 0;
const QS: usize = 32;
const SCALES: usize = 96;
const D: usize = 108;

/// Q3_K: 16 sub-blocks of 16 with 6-bit scales, 3-bit symmetric levels; byte-exact to ggml
/// 0c1e570's `quantize_q3_K` (quant weights given: `quantize_row_q3_K_impl`; none:
/// `quantize_row_q3_K_ref`).
pub fn quantize_row_q3_k(src: &[f32], dst: &mut [u8], quant_weights: Option<&[f32]>) {
    for_each_block(KQuant::Q3K, src, dst, quant_weights, |x, qw, y| {
        let mut levels = [0i8; QK_K];
        match qw {
            None => fit_ref(x, &mut levels, y),
            Some(w) => fit_imatrix(x, w, &mut levels, y),
        }
        requantize(x, &mut levels, y);
        let hmask = &mut y[HMASK..HMASK + 32];
        hmask.fill(0);
        let mut low = [0u8; QK_K];
        for (j, (lo, &l)) in low.iter_mut().zip(&levels).enumerate() {
            let mut l = l as u8;
            if l > 3 {
                hmask[j % 32] |= 1 << (j / 32);
                l -= 4;
            }
            *lo = l;
        }
        pack_2bit(&low, &mut y[QS..QS + 64]);
    });
}

/// Sets sub-block `j`'s 6-bit biased scale `l` (in `0..64`) in the 12 scale bytes.
fn set_scale(scales: &mut [u8], j: usize, l: u8) {
    if j < 8 {
        scales[j] = l & 0xF;
    } else {
        scales[j - 8] |= (l & 0xF) << 4;
    }
    scales[j % 4 + 8] |= (l >> 4) << (2 * (j / 4));
}

/// Sub-block `j`'s scale, unbiased (`-32..32`).
fn get_scale(scales: &[u8], j: usize) -> i8 {
    let low = if j < 8 {
        scales[j] & 0xF
    } else {
        scales[j - 8] >> 4
    };
    (low | (((scales[8 + j % 4] >> (2 * (j / 4))) & 3) << 4)) as i8 - 32
}

/// `quantize_row_q3_K_ref`'s scales: `make_q3_quants` per sub-block (in lanes), the scales
/// then scaled to 6 bits by the one of largest magnitude.
fn fit_ref(x: &[f32], levels: &mut [i8; QK_K], y: &mut [u8]) {
    let scales = fit_q3_sub_blocks(x, levels);
    let (_, max_scale) = signed_max(&scales);
    let sc = &mut y[SCALES..SCALES + 12];
    sc.fill(0);
    let d = if max_scale != 0.0 {
        let iscale = -32.0 / max_scale;
        for (j, &scale) in scales.iter().enumerate() {
            let l = (nearest_int(iscale * scale) as i8).clamp(-32, 31) + 32;
            set_scale(sc, j, l as u8);
        }
        1.0 / iscale
    } else {
        0.0
    };
    y[D..D + 2].copy_from_slice(&f16_bytes(d));
}

/// `quantize_row_q3_K_impl`'s scales: weights `qw * sqrt(sigma2 + x²)` per sub-block, the
/// scales then fitted by `make_qx_quants` weighted by each sub-block's total weight.
fn fit_imatrix(x: &[f32], qw: &[f32], levels: &mut [i8; QK_K], y: &mut [u8]) {
    let mut sw = [0.0f32; 16];
    let mut weights = [0.0f32; QK_K];
    let sigma2 = 2.0 * sum_squares(x) / QK_K as f32;
    for (j, (xs, w)) in x
        .chunks_exact(16)
        .zip(weights.chunks_exact_mut(16))
        .enumerate()
    {
        sw[j] = imatrix_weights(w, &qw[16 * j..16 * (j + 1)], xs, sigma2);
    }
    let scales = fit_symmetric_sub_blocks(4, x, Some(&weights), levels);
    let mut ls = [0i8; 16];
    let d_block = make_qx_quants(32, &scales, &mut ls, Some(&sw));
    let sc = &mut y[SCALES..SCALES + 12];
    sc.fill(0);
    for (j, &l) in ls.iter().enumerate() {
        set_scale(sc, j, l as u8);
    }
    y[D..D + 2].copy_from_slice(&f16_bytes(d_block));
}

/// Recomputes the levels (`0..8`) from the stored scales, as both paths do; a sub-block whose
/// scale decodes to zero keeps the levels of its fit.
fn requantize(x: &[f32], levels: &mut [i8; QK_K], y: &[u8]) {
    let d_all = read_f16(&y[D..D + 2]);
    let scales = &y[SCALES..SCALES + 12];
    for (j, (xs, ls)) in sub_blocks(x, &mut levels[..], 16) {
        let d = d_all * get_scale(scales, j) as f32;
        if d == 0.0 {
            continue;
        }
        for (l, &e) in ls.iter_mut().zip(xs) {
            *l = (nearest_int(e / d).clamp(-4, 3) + 4) as i8;
        }
    }
}
