//! **Q4_K** (`block_q4_K`, 144 bytes per 256 elements) and **Q5_K** (`block_q5_K`, 176 bytes):
//! `d: f16`, `dmin: f16`, `scales: [u8; 12]` (eight 6-bit scales and eight 6-bit mins, one pair
//! per 32 elements, packed as `get_scale_min_k4` reads them), then Q5_K's `qh: [u8; 32]` (bit
//! `2p` / `2p + 1` of `qh[l]`: the fifth bit of element `64p + l` / `64p + 32 + l`), then
//! `qs: [u8; 128]`, byte `32p + l` holding element `64p + l` in its low and `64p + 32 + l` in
//! its high nibble. Value `d * scale[s] * q - dmin * min[s]`.

use super::search::{fit_sub_blocks, make_qp_quants, AffineSearch, SubBlockFits};
use super::{
    check_row, f16_bytes, imatrix_weights, nearest_int, read_f16, sub_blocks, sum_squares, KQuant,
    QK_K,
};

/// What differs between the two types.
struct Variant {
    ty: KQuant,
    /// Largest level: 15 (4 bits) or 31 (5 bits).
    nmax: i32,
    /// The candidate scales `quantize_row_<type>_ref` tries.
    ref_search: AffineSearch,
    /// Whether the imatrix path clamps the packed levels to 63 (Q5_K does, Q4_K does not: a
    /// wrapped negative level then spills into the neighbouring bits, as in ggml).
    clamp_imatrix_levels: bool,
}

const Q4_K: Variant = Variant {
    ty: KQuant::Q4K,
    nmax: 15,
    ref_search: AffineSearch::new(-1.0, 0.1, 20, false),
    clamp_imatrix_levels: false,
};

const Q5_K: Variant = Variant {
    ty: KQuant::Q5K,
    nmax: 31,
    ref_search: AffineSearch::new(-0.5, 0.1, 15, false),
    clamp_imatrix_levels: true,
};

/// Q4_K: 8 sub-blocks of 32 with 6-bit scales and mins, 4-bit levels; byte-exact to ggml
/// 0c1e570's `quantize_q4_K` (quant weights given: `quantize_row_q4_K_impl`; none:
/// `quantize_row_q4_K_ref`).
pub fn quantize_row_q4_k(src: &[f32], dst: &mut [u8], quant_weights: Option<&[f32]>) {
    quantize_row(&Q4_K, src, dst, quant_weights);
}

/// Q5_K: 8 sub-blocks of 32 with 6-bit scales and mins, 5-bit levels; byte-exact to ggml
/// 0c1e570's `quantize_q5_K` (quant weights given: `quantize_row_q5_K_impl`; none:
/// `quantize_row_q5_K_ref`).
pub fn quantize_row_q5_k(src: &[f32], dst: &mut [u8], quant_weights: Option<&[f32]>) {
    quantize_row(&Q5_K, src, dst, quant_weights);
}

fn quantize_row(v: &Variant, src: &[f32], dst: &mut [u8], quant_weights: Option<&[f32]>) {
    check_row(v.ty, src, dst, quant_weights);
    let block_bytes = v.ty.block().1;
    // Two super-blocks per search: their sixteen sub-blocks fill the sixteen lanes. A row's odd
    // last super-block is searched beside a copy of itself (the copy's results are dropped).
    for (p, (x, y)) in src
        .chunks(PAIR)
        .zip(dst.chunks_mut(2 * block_bytes))
        .enumerate()
    {
        let qw = quant_weights.map(|w| &w[PAIR * p..PAIR * p + x.len()]);
        let (mut x_pad, mut w_pad) = ([0.0f32; PAIR], [0.0f32; PAIR]);
        let mut levels = [0u8; PAIR];
        let fits = match qw {
            None => fit_ref(v, as_pair(x, &mut x_pad), &mut levels),
            Some(w) => {
                let w = as_pair(w, &mut w_pad);
                fit_imatrix(v, as_pair(x, &mut x_pad), w, &mut levels)
            }
        };
        for (b, (xb, yb)) in x
            .chunks_exact(QK_K)
            .zip(y.chunks_exact_mut(block_bytes))
            .enumerate()
        {
            let fits = fits.part::<8>(b);
            match qw {
                None => put_ref_scales(&fits, yb),
                Some(_) => put_imatrix_scales(v, &fits, yb),
            }
            let levels: &mut [u8; QK_K] = (&mut levels[QK_K * b..QK_K * (b + 1)])
                .try_into()
                .expect("a super-block");
            requantize(v.nmax, xb, levels, yb);
            if v.nmax == 15 {
                pack_q4(levels, &mut yb[16..]);
            } else {
                pack_q5(levels, &mut yb[16..]);
            }
        }
    }
}

/// Values of two super-blocks searched together.
const PAIR: usize = 2 * QK_K;

/// `x` (one or two super-blocks) as two: itself, or a single one doubled into `pad`.
fn as_pair<'a>(x: &'a [f32], pad: &'a mut [f32; PAIR]) -> &'a [f32; PAIR] {
    if let Ok(pair) = x.try_into() {
        return pair;
    }
    for half in pad.chunks_exact_mut(x.len()) {
        half.copy_from_slice(x);
    }
    pad
}

/// `quantize_row_q{4,5}_K_ref`'s fits of two super-blocks: each sub-block fitted with weights
/// `av_x + |x|`.
fn fit_ref(v: &Variant, x: &[f32; PAIR], levels: &mut [u8; PAIR]) -> SubBlockFits<16> {
    let weigh = |_, xs: &[f32], w: &mut [f32; 32]| {
        let av_x = (sum_squares(xs) / 32.0).sqrt();
        for (w, &e) in w.iter_mut().zip(xs) {
            *w = av_x + e.abs();
        }
        0.0
    };
    fit_sub_blocks(x, levels, v.nmax, v.ref_search, weigh)
}

/// `quantize_row_q{4,5}_K_ref`'s scales of one super-block: its fits' scales and mins scaled
/// to 6 bits by their maxima. Writes `d`, `dmin`, `scales`.
fn put_ref_scales(fits: &SubBlockFits<8>, y: &mut [u8]) {
    let (scales, mins) = (fits.scales, fits.mins);
    let (max_scale, max_min) = fits.maxima();
    let inv_scale = if max_scale > 0.0 {
        63.0 / max_scale
    } else {
        0.0
    };
    let inv_min = if max_min > 0.0 { 63.0 / max_min } else { 0.0 };
    let mut ls = [0u8; 8];
    let mut lm = [0u8; 8];
    for j in 0..8 {
        ls[j] = (nearest_int(inv_scale * scales[j]) as u8).min(63);
        lm[j] = (nearest_int(inv_min * mins[j]) as u8).min(63);
    }
    y[0..2].copy_from_slice(&f16_bytes(max_scale / 63.0));
    y[2..4].copy_from_slice(&f16_bytes(max_min / 63.0));
    pack_scales(&ls, &lm, &mut y[4..16]);
}

/// `quantize_row_q{4,5}_K_impl`'s fits of two super-blocks: weights `qw * sqrt(sigma2 + x²)`
/// (`sigma2` per super-block), the finer search.
fn fit_imatrix(
    v: &Variant,
    x: &[f32; PAIR],
    qw: &[f32; PAIR],
    levels: &mut [u8; PAIR],
) -> SubBlockFits<16> {
    let sigma2: [f32; 2] =
        std::array::from_fn(|b| 2.0 * sum_squares(&x[QK_K * b..QK_K * (b + 1)]) / QK_K as f32);
    let weigh = |j: usize, xs: &[f32], w: &mut [f32; 32]| {
        imatrix_weights(w, &qw[32 * j..32 * (j + 1)], xs, sigma2[j / 8])
    };
    fit_sub_blocks(x, levels, v.nmax, AffineSearch::WEIGHTED, weigh)
}

/// `quantize_row_q{4,5}_K_impl`'s scales of one super-block: its fits' scales and mins
/// quantised by `make_qp_quants` weighted by each sub-block's total weight. Writes `d`, `dmin`,
/// `scales`.
fn put_imatrix_scales(v: &Variant, fits: &SubBlockFits<8>, y: &mut [u8]) {
    let mut ls = [0u8; 8];
    let mut lm = [0u8; 8];
    let d_block = make_qp_quants(63, &fits.scales, &mut ls, &fits.weights);
    let m_block = make_qp_quants(63, &fits.mins, &mut lm, &fits.weights);
    if v.clamp_imatrix_levels {
        ls = ls.map(|l| l.min(63));
        lm = lm.map(|l| l.min(63));
    }
    y[0..2].copy_from_slice(&f16_bytes(d_block));
    y[2..4].copy_from_slice(&f16_bytes(m_block));
    pack_scales(&ls, &lm, &mut y[4..16]);
}

/// The 6-bit scale/min packing `get_scale_min_k4` reads: sub-blocks 0..4 in the low 6 bits of
/// bytes 0..4 (scales) and 4..8 (mins); sub-blocks 4..8 in the nibbles of bytes 8..12 with
/// their top two bits in the high bits of bytes 0..8.
fn pack_scales(ls: &[u8; 8], lm: &[u8; 8], out: &mut [u8]) {
    out[..4].copy_from_slice(&ls[..4]);
    out[4..8].copy_from_slice(&lm[..4]);
    for j in 4..8 {
        out[j + 4] = (ls[j] & 0xF) | ((lm[j] & 0xF) << 4);
        out[j - 4] |= (ls[j] >> 4) << 6;
        out[j] |= (lm[j] >> 4) << 6;
    }
}

/// `get_scale_min_k4`: sub-block `j`'s 6-bit scale and min.
fn scale_min(j: usize, q: &[u8]) -> (u8, u8) {
    if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        (
            (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4),
            (q[j + 4] >> 4) | ((q[j] >> 6) << 4),
        )
    }
}

/// Recomputes the levels from the stored (f16, 6-bit) scales and mins, as both paths do;
/// a sub-block whose scale decodes to zero keeps the levels of its fit.
fn requantize(nmax: i32, x: &[f32], levels: &mut [u8; QK_K], y: &[u8]) {
    let d_all = read_f16(&y[0..2]);
    let dmin_all = read_f16(&y[2..4]);
    for (j, (xs, ls)) in sub_blocks(x, &mut levels[..], 32) {
        let (sc, m) = scale_min(j, &y[4..16]);
        let d = d_all * sc as f32;
        if d == 0.0 {
            continue;
        }
        let dm = dmin_all * m as f32;
        for (l, &e) in ls.iter_mut().zip(xs) {
            *l = nearest_int((e + dm) / d).clamp(0, nmax) as u8;
        }
    }
}

/// Q4_K's `qs` (128 bytes).
fn pack_q4(levels: &[u8; QK_K], qs: &mut [u8]) {
    for (chunk, q) in levels.chunks_exact(64).zip(qs.chunks_exact_mut(32)) {
        for l in 0..32 {
            q[l] = chunk[l] | (chunk[l + 32] << 4);
        }
    }
}

/// Q5_K's `qh` (32 bytes) then `qs` (128 bytes).
fn pack_q5(levels: &[u8; QK_K], out: &mut [u8]) {
    let (qh, ql) = out.split_at_mut(32);
    qh.fill(0);
    for (p, (chunk, q)) in levels
        .chunks_exact(64)
        .zip(ql.chunks_exact_mut(32))
        .enumerate()
    {
        let (m1, m2) = (1u8 << (2 * p), 2u8 << (2 * p));
        for j in 0..32 {
            let mut l1 = chunk[j];
            if l1 > 15 {
                l1 -= 16;
                qh[j] |= m1;
            }
            let mut l2 = chunk[j + 32];
            if l2 > 15 {
                l2 -= 16;
                qh[j] |= m2;
            }
            q[j] = l1 | (l2 << 4);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A row of three super-blocks is searched as a pair and a doubled single; its bytes must be
    /// those of the pair's row and the single's row (both pinned to ggml by the goldens of
    /// tests/gguf_kquants.rs), with and without weights.
    #[test]
    fn an_odd_number_of_super_blocks_encodes_as_each_block_alone() {
        let x: Vec<f32> = (0..3 * QK_K)
            .map(|i| ((i * 7919 % 1013) as f32 - 506.0) * 1e-4 * (1.0 + (i / 97) as f32))
            .collect();
        let qw: Vec<f32> = (0..3 * QK_K).map(|i| 0.5 + (i % 13) as f32).collect();
        for (ty, bytes) in [(KQuant::Q4K, 144), (KQuant::Q5K, 176)] {
            for w in [None, Some(&qw[..])] {
                let mut row = vec![0u8; 3 * bytes];
                ty.quantize_row(&x, &mut row, w);
                let mut pair = vec![0u8; 2 * bytes];
                ty.quantize_row(&x[..2 * QK_K], &mut pair, w.map(|w| &w[..2 * QK_K]));
                let mut single = vec![0u8; bytes];
                ty.quantize_row(&x[2 * QK_K..], &mut single, w.map(|w| &w[2 * QK_K..]));
                assert_eq!(&row[..2 * bytes], &pair[..], "{ty:?} {}", w.is_some());
                assert_eq!(&row[2 * bytes..], &single[..], "{ty:?} {}", w.is_some());
                let mut first = vec![0u8; bytes];
                ty.quantize_row(&x[..QK_K], &mut first, w.map(|w| &w[..QK_K]));
                assert_eq!(&row[..bytes], &first[..], "{ty:?} {}", w.is_some());
            }
        }
    }
}
