//! **Q6_K** (`block_q6_K`, 210 bytes per 256 elements): `ql: [u8; 128]` (low 4 bits), `qh:
//! [u8; 64]` (high 2 bits), `scales: [i8; 16]` (one per 16 elements), `d: f16`; value
//! `d * scales[s] * (q - 32)` with `q` in `0..64`. In each 128-element half `h`, element
//! `128h + l + 32k` (`k` in 0..4, `l` in 0..32) has its low nibble in `ql[64h + l + 32(k & 1)]`
//! (`k >= 2` in the high nibble) and its high bits at `2k` of `qh[32h + l]`.

use super::search::{fit_symmetric_sub_blocks, GROUP_MAX_EPS};
use super::{
    f16_bytes, f16_round, for_each_block, nearest_int, signed_max, sub_blocks, KQuant, QK_K,
};

const BLOCK_BYTES: usize = 210;

/// Q6_K: 16 sub-blocks of 16 with 8-bit scales, 6-bit symmetric levels; byte-exact to ggml
/// 0c1e570's `quantize_q6_K` (quant weights given: `quantize_row_q6_K_impl`, which fits each
/// sub-block with the imatrix as weights; none: `quantize_row_q6_K_ref`, with `x²`).
pub fn quantize_row_q6_k(src: &[f32], dst: &mut [u8], quant_weights: Option<&[f32]>) {
    for_each_block(KQuant::Q6K, src, dst, quant_weights, |x, qw, y| {
        quantize_block(x, y.try_into().expect("a Q6_K block"), qw)
    });
}

fn quantize_block(x: &[f32], y: &mut [u8; BLOCK_BYTES], qw: Option<&[f32]>) {
    let mut levels = [0i8; QK_K];
    let scales = fit_symmetric_sub_blocks(32, x, qw, &mut levels);
    let (max_abs_scale, max_scale) = signed_max(&scales);
    if max_abs_scale < GROUP_MAX_EPS {
        y.fill(0);
        return;
    }
    let (ql, rest) = y.split_at_mut(128);
    let (qh, rest) = rest.split_at_mut(64);
    let (sc, d_out) = rest.split_at_mut(16);
    let iscale = -128.0 / max_scale;
    d_out.copy_from_slice(&f16_bytes(1.0 / iscale));
    let d_all = f16_round(1.0 / iscale);
    for (s, &scale) in sc.iter_mut().zip(&scales) {
        *s = nearest_int(iscale * scale).min(127) as i8 as u8;
    }
    for (j, (xs, ls)) in sub_blocks(x, &mut levels[..], 16) {
        let d = d_all * sc[j] as i8 as f32;
        if d == 0.0 {
            continue;
        }
        for (l, &v) in ls.iter_mut().zip(xs) {
            *l = (nearest_int(v / d).clamp(-32, 31) + 32) as i8;
        }
    }
    for (h, half) in levels.chunks_exact(128).enumerate() {
        let ql = &mut ql[64 * h..64 * (h + 1)];
        let qh = &mut qh[32 * h..32 * (h + 1)];
        for l in 0..32 {
            let q = [half[l], half[l + 32], half[l + 64], half[l + 96]].map(|v| v as u8);
            ql[l] = (q[0] & 0xF) | ((q[2] & 0xF) << 4);
            ql[l + 32] = (q[1] & 0xF) | ((q[3] & 0xF) << 4);
            qh[l] = (q[0] >> 4) | ((q[1] >> 4) << 2) | ((q[2] >> 4) << 4) | ((q[3] >> 4) << 6);
        }
    }
}
