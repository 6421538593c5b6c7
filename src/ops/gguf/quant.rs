//! ggml block formats written by the converter.
//!
//! **Q8_0** (`block_q8_0`, 34 bytes per 32 elements): `d: f16` then `qs: [i8; 32]`, value
//! `qs[j] * d`. Quantisation is gguf-py's `Q8_0.quantize_blocks`, itself bit-exact with
//! `quantize_row_q8_0_ref`: in f32, `d = max|x| / 127`, `id = d == 0 ? 0 : 1 / d` (a reciprocal,
//! then a multiply, not a division per element), `qs = round(x * id)` with ties away from zero,
//! and `d` rounded to f16 to nearest even only when stored.
//!
//! **MXFP4** (`block_mxfp4`, 17 bytes per 32 elements): `e: u8` (E8M0, bias 127, the byte of
//! the checkpoint's scale unchanged) then `qs: [u8; 16]` where element `j` is the low nibble
//! of `qs[j]` and element `j + 16` the high nibble. The safetensors MXFP4 layout (gpt-oss
//! `*_blocks [.., 16]` with `*_scales` alongside) packs element `2k` in the low and `2k + 1`
//! in the high nibble of byte `k`: the repack is a nibble permutation, exact by construction
//! (gpt_oss.py's `transform_nibble_layout` + `repack_mxfp4`).

use crate::format::dtype::DType;
use crate::ops::cast::{decode_into, f32_to_f16};

pub const Q8_0_BLOCK_ELEMS: usize = 32;
pub const Q8_0_BLOCK_BYTES: usize = 34;
pub const MXFP4_BLOCK_ELEMS: usize = 32;
pub const MXFP4_BLOCK_BYTES: usize = 17;
/// Packed nibble bytes of one MXFP4 block in a safetensors checkpoint.
pub const MXFP4_SRC_BLOCK_BYTES: usize = 16;

/// Whether a row of `row_len` elements can be Q8_0 (gguf-py falls back to F16 otherwise).
pub fn q8_0_fits(row_len: u64) -> bool {
    row_len > 0 && row_len.is_multiple_of(Q8_0_BLOCK_ELEMS as u64)
}

/// Quantises one block of 32 values into `out` (34 bytes).
#[inline(always)]
pub fn quantize_q8_0_block(x: &[f32], out: &mut [u8]) {
    let x: &[f32; Q8_0_BLOCK_ELEMS] = x.try_into().expect("a block of 32 values");
    let out: &mut [u8; Q8_0_BLOCK_BYTES] = out.try_into().expect("a block of 34 bytes");
    // `f32::max` of the magnitudes, NaNs skipped as `max` skips them: the largest of a set,
    // whatever the order, so it is taken in 8 lanes (a compare and select each) that vectorise.
    let mut lanes = [0.0f32; 8];
    for row in x.chunks_exact(8) {
        for (m, v) in lanes.iter_mut().zip(row) {
            *m = if v.abs() > *m { v.abs() } else { *m };
        }
    }
    let amax = lanes.iter().fold(0.0f32, |m, &v| if v > m { v } else { m });
    let d = amax / 127.0;
    let id = if d == 0.0 { 0.0 } else { 1.0 / d };
    out[..2].copy_from_slice(&f32_to_f16(d).to_le_bytes());
    for (q, &v) in out[2..].iter_mut().zip(x) {
        *q = round_half_away(v * id) as u8;
    }
}

/// `x.round() as i8` (half away from zero, like gguf-py's `np_roundf`, saturating; NaN is 0)
/// without a libm call, so the block loop vectorises: a truncating conversion of the value
/// clamped to the i8 range, and its remainder, which is exact.
#[inline(always)]
fn round_half_away(x: f32) -> i8 {
    let x = x.clamp(-128.0, 127.0);
    let t = x as i32;
    let frac = x - t as f32;
    (t + (frac >= 0.5) as i32 - (frac <= -0.5) as i32) as i8
}

/// Quantises whole rows: `x.len()` must be a multiple of 32, `out` 34 bytes per 32 values.
pub fn quantize_q8_0(x: &[f32], out: &mut [u8]) {
    assert_eq!(x.len() % Q8_0_BLOCK_ELEMS, 0, "Q8_0 needs whole 32-blocks");
    assert_eq!(
        out.len(),
        x.len() / Q8_0_BLOCK_ELEMS * Q8_0_BLOCK_BYTES,
        "Q8_0 output size"
    );
    for (xb, ob) in x
        .chunks_exact(Q8_0_BLOCK_ELEMS)
        .zip(out.chunks_exact_mut(Q8_0_BLOCK_BYTES))
    {
        quantize_q8_0_block(xb, ob);
    }
}

/// Quantises whole rows of stored elements (`BF16`, `F16` or `F32` bytes, a multiple of 32
/// elements) a block at a time: the same bytes as widening everything to f32 first and calling
/// [`quantize_q8_0`], without the f32 copy of the chunk.
pub fn quantize_q8_0_from(elems: &[u8], dtype: DType, out: &mut [u8]) {
    let es = dtype.size().expect("a float dtype");
    assert_eq!(
        out.len(),
        elems.len() / es / Q8_0_BLOCK_ELEMS * Q8_0_BLOCK_BYTES,
        "Q8_0 output size"
    );
    #[cfg(target_arch = "x86_64")]
    if super::q8_0_avx2::available() {
        // SAFETY: the CPU has AVX2 and F16C, checked just above.
        return unsafe { super::q8_0_avx2::q8_0_blocks(elems, dtype, out) };
    }
    q8_0_blocks(elems, dtype, out)
}

/// The portable block loop of [`quantize_q8_0_from`] (`q8_0_avx2` where the CPU has AVX2),
/// the dtype chosen once, outside it (each arm's constant dtype lets the widening inline into
/// the loop).
pub(super) fn q8_0_blocks(elems: &[u8], dtype: DType, out: &mut [u8]) {
    match dtype {
        DType::BF16 => blocks_from(elems, 2, out, |src, x| decode_into(DType::BF16, src, x)),
        DType::F32 => blocks_from(elems, 4, out, |src, x| decode_into(DType::F32, src, x)),
        _ => {
            let es = dtype.size().expect("a float dtype");
            blocks_from(elems, es, out, |src, x| decode_into(dtype, src, x))
        }
    }
}

#[inline(always)]
fn blocks_from(
    elems: &[u8],
    elem_bytes: usize,
    out: &mut [u8],
    decode: impl Fn(&[u8], &mut [f32; Q8_0_BLOCK_ELEMS]),
) {
    let mut x = [0f32; Q8_0_BLOCK_ELEMS];
    for (src, dst) in elems
        .chunks_exact(Q8_0_BLOCK_ELEMS * elem_bytes)
        .zip(out.chunks_exact_mut(Q8_0_BLOCK_BYTES))
    {
        decode(src, &mut x);
        quantize_q8_0_block(&x, dst);
    }
}

/// Repacks safetensors MXFP4 into ggml blocks: `blocks` holds 16 bytes per block and `scales`
/// one E8M0 byte per block (same block order), `out` 17 bytes per block.
pub fn repack_mxfp4(blocks: &[u8], scales: &[u8], out: &mut [u8]) {
    assert_eq!(
        blocks.len(),
        scales.len() * MXFP4_SRC_BLOCK_BYTES,
        "MXFP4 blocks/scales"
    );
    assert_eq!(
        out.len(),
        scales.len() * MXFP4_BLOCK_BYTES,
        "MXFP4 output size"
    );
    for ((src, &e), dst) in blocks
        .chunks_exact(MXFP4_SRC_BLOCK_BYTES)
        .zip(scales)
        .zip(out.chunks_exact_mut(MXFP4_BLOCK_BYTES))
    {
        dst[0] = e;
        let code = |i: usize| (src[i / 2] >> (4 * (i % 2))) & 0x0F;
        for j in 0..16 {
            dst[1 + j] = code(j) | (code(j + 16) << 4);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn q8_0_rounds_half_away_from_zero_and_zero_blocks_stay_zero() {
        let mut x = [0.0f32; 32];
        x[0] = 127.0;
        x[1] = 0.5;
        x[2] = -0.5;
        x[3] = 1.5;
        let mut out = [0u8; 34];
        quantize_q8_0_block(&x, &mut out);
        assert_eq!(u16::from_le_bytes([out[0], out[1]]), 0x3C00); // d = 1.0
        assert_eq!(&out[2..6], &[127, 1, 0xFF, 2]);
        let mut z = [0xAAu8; 34];
        quantize_q8_0_block(&[0.0; 32], &mut z);
        assert!(z.iter().all(|&b| b == 0));
    }

    #[test]
    fn q8_0_from_stored_elements_is_q8_0_of_their_f32_values() {
        let mut seed = 7u32;
        let mut next = || {
            seed = seed.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
            seed
        };
        for dtype in [DType::BF16, DType::F16, DType::F32] {
            let n = 4 * Q8_0_BLOCK_ELEMS;
            let elems: Vec<u8> = match dtype {
                DType::F32 => (0..n)
                    .flat_map(|_| ((next() >> 8) as f32 / 1e4 - 800.0).to_le_bytes())
                    .collect(),
                _ => (0..n)
                    .flat_map(|_| ((next() >> 16) as u16 & 0x7BFF).to_le_bytes())
                    .collect(),
            };
            let mut f = vec![0f32; n];
            decode_into(dtype, &elems, &mut f);
            let mut want = vec![0u8; 4 * Q8_0_BLOCK_BYTES];
            quantize_q8_0(&f, &mut want);
            let mut got = vec![0u8; 4 * Q8_0_BLOCK_BYTES];
            quantize_q8_0_from(&elems, dtype, &mut got);
            assert_eq!(got, want, "{dtype}");
        }
    }

    #[test]
    fn the_block_maximum_skips_nans_as_f32_max_does() {
        let mut x = [0.25f32; 32];
        x[3] = f32::NAN;
        x[7] = -3.0;
        let (mut a, mut b) = ([0u8; 34], [0u8; 34]);
        quantize_q8_0_block(&x, &mut a);
        let amax = x.iter().fold(0.0f32, |m, v| m.max(v.abs()));
        assert_eq!(amax, 3.0);
        b[..2].copy_from_slice(&f32_to_f16(amax / 127.0).to_le_bytes());
        assert_eq!(a[..2], b[..2]);
        assert_eq!(a[2 + 7] as i8, -127);
        assert_eq!(a[2 + 3], 0);
    }

    #[test]
    fn round_half_away_is_f32_round_on_every_value_q8_0_meets() {
        // Every 97th f32 up to 300, every half up to 300 with its neighbours, the extremes.
        let mut bits = (0..=300f32.to_bits()).step_by(97).collect::<Vec<u32>>();
        bits.extend((0..=600u32).map(|k| (k as f32 * 0.5).to_bits()));
        bits.extend(
            bits.clone()
                .iter()
                .flat_map(|&b| [b.wrapping_sub(1), b + 1]),
        );
        bits.extend([f32::INFINITY, f32::MAX, f32::NAN, 1e30].map(f32::to_bits));
        for b in bits {
            for x in [f32::from_bits(b), -f32::from_bits(b)] {
                assert_eq!(round_half_away(x), x.round() as i8, "{x:e}");
            }
        }
    }

    #[test]
    fn mxfp4_repack_puts_element_j_low_and_j_plus_16_high() {
        // Codes 0..32 mod 16 in safetensors order: byte k = code(2k) | code(2k+1) << 4.
        let codes: Vec<u8> = (0..32u8).map(|i| (i * 7) % 16).collect();
        let src: Vec<u8> = (0..16)
            .map(|k| codes[2 * k] | (codes[2 * k + 1] << 4))
            .collect();
        let mut out = [0u8; 17];
        repack_mxfp4(&src, &[0x7F], &mut out);
        assert_eq!(out[0], 0x7F);
        for j in 0..16 {
            assert_eq!(out[1 + j] & 0x0F, codes[j]);
            assert_eq!(out[1 + j] >> 4, codes[j + 16]);
        }
    }
}
