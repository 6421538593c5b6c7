//! Q8_0 blocks with explicit AVX2 + F16C instructions: the bytes of [`super::quant`]'s scalar
//! block loop, one 32-element block as four 8-lane vectors.
//!
//! Why: the auto-vectorised loop spent about 150 cycles per block (a horizontal maximum, a
//! scalar rounding per element and a byte store per element); here a block is four widening
//! loads, four `max`, a 3-step horizontal maximum, four multiply/round/clamp chains, one pack
//! and one 32-byte store.
//!
//! Every step is the scalar one exactly:
//! - `|x|` maximum: `vmaxps(|x|, m)` is `|x| > m ? |x| : m`, NaN lanes skipped as the scalar
//!   compare skips them; the lanes are then ≥ +0 and never NaN, so their order does not matter.
//! - `d = amax / 127`, `id = d == 0 ? 0 : 1 / d`: scalar, the same f32 operations.
//! - `d` to f16: `vcvtps2ph` rounding to nearest even (the immediate, not MXCSR), exact IEEE
//!   like `f32_to_f16` for every value `d` takes (≥ 0, never NaN; overflow to +inf).
//! - `round_half_away(x * id)`: NaN products set to 0, clamped to [-128, 127], truncated,
//!   then ±1 where the exact remainder is ≥ 0.5 or ≤ -0.5.
//! - BF16 is widened by a 16-bit shift, F16 by `vcvtph2ps` (exact; NaN stays NaN, which
//!   quantises to 0 either way), F32 loaded as is.

use std::arch::x86_64::*;

use super::quant::{Q8_0_BLOCK_BYTES, Q8_0_BLOCK_ELEMS};
use crate::format::dtype::DType;
use crate::ops::cast::decode_into;

/// Whether this CPU runs [`q8_0_blocks`].
pub fn available() -> bool {
    is_x86_feature_detected!("avx2") && is_x86_feature_detected!("f16c")
}

/// Quantises whole blocks of stored `dtype` elements into `out` (34 bytes per 32 elements).
///
/// # Safety
/// The CPU must have AVX2 and F16C ([`available`]).
#[target_feature(enable = "avx2,f16c")]
pub unsafe fn q8_0_blocks(elems: &[u8], dtype: DType, out: &mut [u8]) {
    match dtype {
        DType::BF16 => {
            for (src, dst) in pairs(elems, 2, out) {
                block(load_16::<true>(src), dst);
            }
        }
        DType::F16 => {
            for (src, dst) in pairs(elems, 2, out) {
                block(load_16::<false>(src), dst);
            }
        }
        DType::F32 => {
            for (src, dst) in pairs(elems, 4, out) {
                block(load_f32(src.try_into().expect("32 f32")), dst);
            }
        }
        _ => {
            let mut x = [0f32; Q8_0_BLOCK_ELEMS];
            for (src, dst) in pairs(elems, dtype.size().expect("a float dtype"), out) {
                decode_into(dtype, src, &mut x);
                block(load_f32_values(&x), dst);
            }
        }
    }
}

/// Each block's source elements (`elem_bytes` each) with its 34 output bytes.
fn pairs<'a>(
    elems: &'a [u8],
    elem_bytes: usize,
    out: &'a mut [u8],
) -> impl Iterator<Item = (&'a [u8], &'a mut [u8])> {
    elems
        .chunks_exact(Q8_0_BLOCK_ELEMS * elem_bytes)
        .zip(out.chunks_exact_mut(Q8_0_BLOCK_BYTES))
}

type Block = [__m256; 4];

/// 32 16-bit floats widened to f32: BF16 by a 16-bit shift (`BF16`), else F16 by
/// `vcvtph2ps`.
#[inline]
#[target_feature(enable = "avx2,f16c")]
fn load_16<const BF16: bool>(src: &[u8]) -> Block {
    let src: &[u8; 2 * Q8_0_BLOCK_ELEMS] = src.try_into().expect("32 16-bit floats");
    let mut x = [_mm256_setzero_ps(); 4];
    for (k, v) in x.iter_mut().enumerate() {
        // SAFETY: 16 bytes at 16k < 64, inside `src`; an unaligned load.
        let h = unsafe { _mm_loadu_si128(src.as_ptr().add(16 * k).cast()) };
        *v = if BF16 {
            _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(h)))
        } else {
            _mm256_cvtph_ps(h)
        };
    }
    x
}

#[inline]
#[target_feature(enable = "avx2")]
fn load_f32(src: &[u8; 4 * Q8_0_BLOCK_ELEMS]) -> Block {
    let mut x = [_mm256_setzero_ps(); 4];
    for (k, v) in x.iter_mut().enumerate() {
        // SAFETY: 32 bytes at 32k < 128, inside `src`; an unaligned load.
        *v = unsafe { _mm256_loadu_ps(src.as_ptr().add(32 * k).cast()) };
    }
    x
}

#[inline]
#[target_feature(enable = "avx2")]
fn load_f32_values(x: &[f32; Q8_0_BLOCK_ELEMS]) -> Block {
    let mut v = [_mm256_setzero_ps(); 4];
    for (k, v) in v.iter_mut().enumerate() {
        // SAFETY: 8 values at 8k < 32, inside `x`; an unaligned load.
        *v = unsafe { _mm256_loadu_ps(x.as_ptr().add(8 * k)) };
    }
    v
}

/// One block: `x` holds elements 0..8, 8..16, 16..24, 24..32; `out` gets 34 bytes.
#[inline]
#[target_feature(enable = "avx2,f16c")]
fn block(x: Block, out: &mut [u8]) {
    let out: &mut [u8; Q8_0_BLOCK_BYTES] = out.try_into().expect("a block of 34 bytes");
    let sign = _mm256_set1_ps(-0.0);
    let mut m = _mm256_setzero_ps();
    for v in x {
        m = _mm256_max_ps(_mm256_andnot_ps(sign, v), m);
    }
    let m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps::<1>(m));
    let m2 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    let amax = _mm_cvtss_f32(_mm_max_ss(m2, _mm_shuffle_ps::<1>(m2, m2)));
    let d = amax / 127.0;
    let id = if d == 0.0 { 0.0 } else { 1.0 / d };
    let d16 = _mm_extract_epi16::<0>(_mm_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(_mm_set_ss(d)));
    out[..2].copy_from_slice(&(d16 as u16).to_le_bytes());
    let idv = _mm256_set1_ps(id);
    let mut q = [_mm256_setzero_si256(); 4];
    for (q, v) in q.iter_mut().zip(x) {
        *q = round_half_away(_mm256_mul_ps(v, idv));
    }
    let q = _mm256_packs_epi16(
        _mm256_packs_epi32(q[0], q[1]),
        _mm256_packs_epi32(q[2], q[3]),
    );
    // The packs work per 128-bit half: dword k of the halves holds elements 4k.. of vector
    // k % 4 (first half) or of its upper four; this puts them back in element order.
    let q = _mm256_permutevar8x32_epi32(q, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    // SAFETY: 32 bytes at offset 2 of the 34-byte block; unaligned store.
    unsafe { _mm256_storeu_si256(out[2..].as_mut_ptr().cast(), q) };
}

/// `quant::round_half_away` on 8 lanes, as i32 in [-128, 127].
#[inline]
#[target_feature(enable = "avx2")]
fn round_half_away(x: __m256) -> __m256i {
    let x = _mm256_and_ps(x, _mm256_cmp_ps::<_CMP_ORD_Q>(x, x));
    let x = _mm256_min_ps(
        _mm256_max_ps(x, _mm256_set1_ps(-128.0)),
        _mm256_set1_ps(127.0),
    );
    let t = _mm256_cvttps_epi32(x);
    let frac = _mm256_sub_ps(x, _mm256_cvtepi32_ps(t));
    let up = _mm256_cmp_ps::<_CMP_GE_OQ>(frac, _mm256_set1_ps(0.5));
    let down = _mm256_cmp_ps::<_CMP_LE_OQ>(frac, _mm256_set1_ps(-0.5));
    // A true compare is all ones, -1 as an integer.
    _mm256_add_epi32(
        _mm256_sub_epi32(t, _mm256_castps_si256(up)),
        _mm256_castps_si256(down),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::gguf::quant;

    /// Both encoders on the same elements; `None` where the CPU lacks AVX2 or F16C.
    fn both(elems: &[u8], dtype: DType) -> Option<(Vec<u8>, Vec<u8>)> {
        if !available() {
            return None;
        }
        let blocks = elems.len() / dtype.size().unwrap() / Q8_0_BLOCK_ELEMS;
        let (mut simd, mut scalar) = (vec![0u8; blocks * 34], vec![0u8; blocks * 34]);
        // SAFETY: `available` checked the CPU above.
        unsafe { q8_0_blocks(elems, dtype, &mut simd) };
        quant::q8_0_blocks(elems, dtype, &mut scalar);
        Some((simd, scalar))
    }

    fn f32_bytes(x: &[f32]) -> Vec<u8> {
        x.iter().flat_map(|v| v.to_le_bytes()).collect()
    }

    fn assert_same(elems: &[u8], dtype: DType) {
        if let Some((simd, scalar)) = both(elems, dtype) {
            for (b, (s, r)) in simd.chunks(34).zip(scalar.chunks(34)).enumerate() {
                assert_eq!(s, r, "{dtype} block {b}");
            }
        }
    }

    /// Blocks the rounding and the scale meet at their edges: ties (k + 0.5 at d = 1), their
    /// f32 neighbours, zeros of both signs, NaN, ±inf, subnormals (whose `1 / d` is +inf), a
    /// maximum that overflows f16, and a lone NaN or inf among ordinary values.
    fn edge_blocks() -> Vec<[f32; 32]> {
        let ties: [f32; 32] = std::array::from_fn(|j| j as f32 * 4.0 - 63.5);
        let mut edges = vec![
            ties,
            [0.0; 32],
            [-0.0; 32],
            [f32::NAN; 32],
            [f32::INFINITY; 32],
        ];
        let up = |v: f32| f32::from_bits(v.to_bits() + 1);
        let mut near = ties.map(up);
        near[0] = 127.0;
        edges.push(near);
        let mut near = ties.map(|v| f32::from_bits(v.to_bits() - 1));
        near[31] = -127.0;
        edges.push(near);
        edges.push(std::array::from_fn(|j| f32::from_bits(j as u32 * 3 + 1)));
        edges.push(std::array::from_fn(|j| {
            -f32::from_bits(0x007F_FFFF - j as u32)
        }));
        edges.push(std::array::from_fn(|j| f32::MAX / (j + 1) as f32));
        for special in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY, -0.0] {
            let mut b: [f32; 32] = std::array::from_fn(|j| (j as f32 - 16.0) * 0.37);
            b[5] = special;
            edges.push(b);
        }
        edges
    }

    #[test]
    fn simd_and_scalar_agree_on_edge_blocks_in_every_dtype() {
        for b in edge_blocks() {
            let f32s = f32_bytes(&b);
            assert_same(&f32s, DType::F32);
            let mut narrow = vec![0u8; 64];
            for dtype in [DType::BF16, DType::F16] {
                crate::ops::cast::cast_slice(DType::F32, dtype, &f32s, &mut narrow);
                assert_same(&narrow, dtype);
            }
        }
    }

    #[test]
    fn simd_and_scalar_agree_on_every_scale() {
        // A block whose maximum walks the f32 range (every 1021st pattern and every exponent's
        // edges): each `d`, its reciprocal and its f16 rounding, as both encoders make them.
        let mut maxima: Vec<u32> = (0..0x7F80_0000).step_by(1021).collect();
        maxima.extend((0..=0xFF).flat_map(|e| [e << 23, (e << 23) | 0x1000, (e << 23) | 0xFFF]));
        let blocks: Vec<f32> = maxima
            .iter()
            .flat_map(|&m| {
                let m = f32::from_bits(m.min(0x7F80_0000));
                (0..32).map(move |j| if j == 7 { -m } else { m * (j as f32 / 37.0) })
            })
            .collect();
        assert_same(&f32_bytes(&blocks), DType::F32);
    }

    #[test]
    fn the_dispatch_takes_the_simd_encoder_on_this_cpu_and_its_bytes_are_the_scalar_ones() {
        let x: Vec<f32> = (0..4 * 32).map(|j| (j as f32 * 0.7).sin() * 3.0).collect();
        let mut got = vec![0u8; 4 * 34];
        quant::quantize_q8_0_from(&f32_bytes(&x), DType::F32, &mut got);
        let mut want = vec![0u8; 4 * 34];
        quant::quantize_q8_0(&x, &mut want);
        assert_eq!(got, want);
        assert_same(&f32_bytes(&x), DType::F32);
    }

    proptest::proptest! {
        /// Any bit patterns at all, as BF16, F16 and F32 blocks.
        #[test]
        fn simd_and_scalar_agree_on_any_bits(bits in proptest::collection::vec(
            proptest::prelude::any::<u32>(), 32 * 4)) {
            let as_u16: Vec<u8> = bits.iter().flat_map(|b| (*b as u16).to_le_bytes()).collect();
            assert_same(&as_u16, DType::BF16);
            assert_same(&as_u16, DType::F16);
            let as_u32: Vec<u8> = bits.iter().flat_map(|b| b.to_le_bytes()).collect();
            assert_same(&as_u32, DType::F32);
        }

        /// Values on the half-integer grid of their block's scale, where rounding ties are.
        #[test]
        fn simd_and_scalar_agree_on_ties(halves in proptest::collection::vec(-254i32..=254, 32),
                                         scale_exp in -140i32..=120) {
            let scale = 2f32.powi(scale_exp);
            let x: Vec<f32> = halves.iter().map(|&h| h as f32 * 0.5 * scale).collect();
            assert_same(&f32_bytes(&x), DType::F32);
        }
    }
}
