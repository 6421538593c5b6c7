//! Scalar arithmetic of the weight-only quantisers, step for step as compressed-tensors 0.20.1
//! and llm-compressor 0.14 compute it on the CPU, so the codes and scales come out byte for
//! byte the same (`tests/fixtures/quantize/arithmetic.py` is the same arithmetic in torch,
//! checked against the library's output).
//!
//! The library works in the weight's own dtype: a bf16 weight gives bf16 group maxima, a bf16
//! `amax / 448` and a bf16 `x / scale`, each an f32 operation rounded to bf16 (what torch does
//! on the CPU). [`WeightType::round`] is that rounding; every step below names where it
//! happens, since a missing or extra rounding changes about one code in a thousand.
//!
//! Layouts written:
//! - E4M3 codes: `F8_E4M3`, round to nearest even, after clamping to ±448.
//! - E2M1 codes: two per byte, low nibble = even column; bit 3 is the sign, set for negative
//!   values that round to zero too (`-0`), as the library's `sign(x) * round(|x|)` gives.
//! - int codes (`pack-quantized`): offset binary `q + 2^(b-1)`, a dense little-endian bit
//!   stream per row (element k at bits `k·b .. k·b+b`), in I32 words, zero-padded at the end.
//! - E8M0 exponents (`U8`): `2^(e-127)`.

use crate::format::dtype::DType;
use crate::ops::cast::{bf16_to_f32, f16_to_f32, f32_to_bf16, f32_to_f16};

/// Largest finite E4M3 value.
pub const E4M3_MAX: f32 = 448.0;
/// Largest E2M1 value.
pub const E2M1_MAX: f32 = 6.0;
/// compressed-tensors' replacement for a zero E4M3 scale (`_get_dtype_eps`).
pub const E4M3_ZERO_SCALE: f32 = 0.125;

/// The dtype of the weights being quantised, in which the library does its arithmetic.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum WeightType {
    BF16,
    F16,
    F32,
}

impl WeightType {
    pub fn of(d: DType) -> Option<WeightType> {
        match d {
            DType::BF16 => Some(WeightType::BF16),
            DType::F16 => Some(WeightType::F16),
            DType::F32 => Some(WeightType::F32),
            _ => None,
        }
    }

    pub fn dtype(self) -> DType {
        match self {
            WeightType::BF16 => DType::BF16,
            WeightType::F16 => DType::F16,
            WeightType::F32 => DType::F32,
        }
    }

    pub fn bytes(self) -> usize {
        match self {
            WeightType::F32 => 4,
            _ => 2,
        }
    }

    /// Rounds an f32 result to this dtype (nearest even), as a torch op in this dtype does.
    #[inline(always)]
    pub fn round(self, x: f32) -> f32 {
        match self {
            WeightType::BF16 => bf16_to_f32(f32_to_bf16(x)),
            WeightType::F16 => f16_to_f32(f32_to_f16(x)),
            WeightType::F32 => x,
        }
    }

    /// `torch.finfo(dtype).eps`: what a zero scale becomes.
    pub fn eps(self) -> f32 {
        match self {
            WeightType::BF16 => 2f32.powi(-7),
            WeightType::F16 => 2f32.powi(-10),
            WeightType::F32 => f32::EPSILON,
        }
    }

    /// `torch.finfo(dtype).tiny`: the least amax a global scale divides by.
    pub fn tiny(self) -> f32 {
        match self {
            WeightType::F16 => 2f32.powi(-14),
            _ => f32::MIN_POSITIVE,
        }
    }

    /// Decodes little-endian elements to f32 (exact).
    pub fn decode(self, bytes: &[u8], out: &mut Vec<f32>) {
        out.clear();
        match self {
            WeightType::BF16 => out.extend(
                bytes
                    .chunks_exact(2)
                    .map(|c| bf16_to_f32(u16::from_le_bytes([c[0], c[1]]))),
            ),
            WeightType::F16 => out.extend(
                bytes
                    .chunks_exact(2)
                    .map(|c| f16_to_f32(u16::from_le_bytes([c[0], c[1]]))),
            ),
            WeightType::F32 => out.extend(
                bytes
                    .chunks_exact(4)
                    .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])),
            ),
        }
    }

    /// Writes `x` (already a value of this dtype) as little-endian bytes.
    pub fn encode(self, x: f32, out: &mut [u8]) {
        match self {
            WeightType::BF16 => out.copy_from_slice(&f32_to_bf16(x).to_le_bytes()),
            WeightType::F16 => out.copy_from_slice(&f32_to_f16(x).to_le_bytes()),
            WeightType::F32 => out.copy_from_slice(&x.to_le_bytes()),
        }
    }

    /// The mantissa and exponent widths `round_to_power_2` masks with.
    fn bit_layout(self) -> (u32, u32) {
        match self {
            WeightType::BF16 => (7, 8),
            WeightType::F16 => (10, 5),
            WeightType::F32 => (23, 8),
        }
    }

    fn bits_of(self, x: f32) -> u32 {
        match self {
            WeightType::BF16 => f32_to_bf16(x) as u32,
            WeightType::F16 => f32_to_f16(x) as u32,
            WeightType::F32 => x.to_bits(),
        }
    }

    fn value_of(self, b: u32) -> f32 {
        match self {
            WeightType::BF16 => bf16_to_f32(b as u16),
            WeightType::F16 => f16_to_f32(b as u16),
            WeightType::F32 => f32::from_bits(b),
        }
    }
}

/// `max(|min(x, 0)|, max(x, 0))` of a group: the min/max observer's symmetric range.
#[inline]
pub fn amax(xs: &[f32]) -> f32 {
    xs.iter().fold(0f32, |m, &x| m.max(x.abs()))
}

/// f32 → E4M3 ("fn", no infinity), nearest even; |x| ≥ 480 gives NaN (callers clamp first).
/// Port of c10's `fp8e4m3fn_from_fp32_value`.
#[inline(always)]
pub fn f32_to_e4m3(x: f32) -> u8 {
    let mut bits = x.to_bits();
    let sign = bits & 0x8000_0000;
    bits ^= sign;
    let result = if bits >= 1087 << 20 || x.is_nan() {
        0x7F
    } else if bits < 121 << 23 {
        // Subnormal: let the f32 adder round, against 2^-6's denormal bias.
        let denorm_mask = 141u32 << 23;
        let sum = (f32::from_bits(bits) + f32::from_bits(denorm_mask)).to_bits();
        (sum - denorm_mask) as u8
    } else {
        let odd = (bits >> 20) & 1;
        bits = bits.wrapping_add(((7u32.wrapping_sub(127)) << 23).wrapping_add(0x7FFFF));
        bits = bits.wrapping_add(odd);
        (bits >> 20) as u8
    };
    result | (sign >> 24) as u8
}

/// E2M1 code of `y` (|y| ≤ 6), nearest even; see the module doc for the sign of zero. The
/// code is the number of rounding boundaries below |y| (ties alternate `<`/`≤` so they go to
/// the even code), which compiles without branches.
#[inline(always)]
pub fn f32_to_e2m1(y: f32) -> u8 {
    let a = y.abs();
    let idx = u8::from(a > 0.25)
        + u8::from(a >= 0.75)
        + u8::from(a > 1.25)
        + u8::from(a >= 1.75)
        + u8::from(a > 2.5)
        + u8::from(a >= 3.5)
        + u8::from(a > 5.0);
    idx | (u8::from(y < 0.0) << 3)
}

/// The E8M0 exponent of an MX group whose amax is `amax` (a value of `wt`), for elements whose
/// largest power of two is `2^elem_offset` (2 for E2M1, 8 for E4M3): `round_to_power_2` on the
/// weight dtype's bits, then `127 + floor(log2(.)) - offset`, clamped to 0..=255.
pub fn mx_exponent(wt: WeightType, amax: f32, elem_offset: i32) -> u8 {
    let (mantissa, exponent) = wt.bit_layout();
    let add = 1u32 << (mantissa - 1 - 1); // E2M1's one mantissa bit, as the library uses for all
    let mask = ((1u32 << (exponent + 1)) - 1) << mantissa;
    let p2 = wt.value_of((wt.bits_of(amax) + add) & mask);
    if p2 == 0.0 {
        return 0; // log2(0) = -inf, clamped to 0
    }
    if p2.is_infinite() {
        return 255;
    }
    let e = 127 + p2.log2().floor() as i32 - elem_offset;
    e.clamp(0, 255) as u8
}

/// `2^(e-127)` in the weight dtype, the float scale MX codes are divided by. A zero (F16 cannot
/// hold 2^-25 and below) becomes 1: `calculate_qparams` replaces zero scales by the eps of the
/// scale dtype, and U8's "eps" is 1.
pub fn mx_scale(wt: WeightType, e: u8) -> f32 {
    let s = wt.round(2f64.powi(e as i32 - 127) as f32);
    if s == 0.0 {
        1.0
    } else {
        s
    }
}

/// The E8M0 byte stored for a finite MX scale `s` (`compress_mx_scale`:
/// `127 + floor(log2(s))`). An infinite scale is refused before it is stored; it gives 255 here.
pub fn mx_stored(s: f32) -> u8 {
    if !s.is_finite() {
        return 255;
    }
    (127 + s.log2().floor() as i32).clamp(0, 255) as u8
}

/// NVFP4's tensor scale for a (fused) amax: `448 · 6 / amax`, which torch evaluates as
/// `reciprocal(amax) * 2688` in the weight dtype; non-finite becomes 1.
pub fn nvfp4_global_scale(wt: WeightType, amax: f32) -> f32 {
    let a = amax.max(wt.tiny());
    let g = wt.round(wt.round(1.0 / a) * (E4M3_MAX * E2M1_MAX));
    if g.is_finite() {
        g
    } else {
        1.0
    }
}

/// Symmetric scale `amax / (range / 2)` in the weight dtype, zero → eps.
#[inline]
pub fn symmetric_scale(wt: WeightType, amax: f32, half_range: f32) -> f32 {
    let s = wt.round(amax / half_range);
    if s == 0.0 {
        wt.eps()
    } else {
        s
    }
}

/// E4M3 code of `x / s` in the weight dtype, with the library's `+ zero_point` (turns -0 into
/// +0) and clamp.
#[inline(always)]
pub fn e4m3_code(wt: WeightType, x: f32, s: f32) -> u8 {
    let y = wt.round(x / s) + 0.0;
    f32_to_e4m3(y.clamp(-E4M3_MAX, E4M3_MAX))
}

/// Packs `codes` (signed, in `-2^(b-1) .. 2^(b-1)`) of one row into `out` (little-endian I32
/// words), offset binary, dense.
pub fn pack_int_row(codes: &[i32], bits: u32, out: &mut [u8]) {
    out.fill(0);
    // The byte-aligned widths directly: the bitstream of 8-bit codes is one byte each, of 4-bit
    // codes a byte per pair, low nibble first.
    if bits == 8 {
        for (o, &q) in out.iter_mut().zip(codes) {
            *o = (q + 128) as u8;
        }
        return;
    }
    if bits == 4 {
        for (o, pair) in out.iter_mut().zip(codes.chunks(2)) {
            let hi = pair.get(1).map_or(0, |&q| (q + 8) as u8);
            *o = (pair[0] + 8) as u8 | hi << 4;
        }
        return;
    }
    let offset = 1i64 << (bits - 1);
    for (k, &q) in codes.iter().enumerate() {
        let v = (q as i64 + offset) as u64;
        let bit = k as u64 * bits as u64;
        let (byte, shift) = ((bit / 8) as usize, bit % 8);
        let v = v << shift;
        for (j, o) in out[byte..].iter_mut().take(2).enumerate() {
            *o |= (v >> (8 * j)) as u8;
        }
    }
}

// ModelOpt 0.47 (`export_hf_checkpoint`), which computes in f32 after upcasting the weight:
// every scale is an f32 division of an f32 amax, every code an f32 division (or, for MXFP8,
// a multiplication by a power of two) of the upcast weight.

/// ModelOpt's FP8 scale (per channel or per 128×128 block): `amax / 448` in f32, a zero amax
/// replaced by 448 first (`_sanitize_export_amax`: scale 1) and the amax clamped to f32's least
/// normal (`export_amax`).
pub fn modelopt_fp8_scale(amax: f32) -> f32 {
    let a = if amax == 0.0 {
        E4M3_MAX
    } else {
        amax.max(f32::MIN_POSITIVE)
    };
    a / E4M3_MAX
}

/// ModelOpt's E4M3 code of `x / s` (f32): no `+ 0`, so -0 stays `0x80`.
#[inline(always)]
pub fn modelopt_e4m3_code(x: f32, s: f32) -> u8 {
    f32_to_e4m3((x / s).clamp(-E4M3_MAX, E4M3_MAX))
}

/// `torch.log2` of an f32 on the CPU: the f64 logarithm rounded to f32 (what decides `ceil` is
/// whether the rounding lands on an integer, where both agree).
#[inline]
fn log2_f32(d: f32) -> f32 {
    (d as f64).log2() as f32
}

/// ModelOpt's unbiased E8M0 exponent of an MX group: `ceil(log2(amax / elem_max))` in f32
/// (`elem_max` 448 for MXFP8, 6 for MXFP4), -127 for a zero group, clamped to -127..=127.
pub fn modelopt_mx_exponent(amax: f32, elem_max: f32) -> i32 {
    let d = amax / elem_max;
    if d > 0.0 {
        (log2_f32(d).ceil() as i32).clamp(-127, 127)
    } else {
        -127
    }
}

/// [`modelopt_mx_exponent`] from the bits of `amax / elem_max`, without a logarithm (the
/// encoders' and kernels/quantize.cuh's way). For `d = 2^k·(1 + m·2^-23)`, `m > 0`, log2(d) lies
/// in (k, k + 1) and its ceiling is k + 1 unless the f32 rounding of the logarithm lands on k
/// itself: when log2(1 + m·2^-23) is below half the f32 spacing next to k on the side of k + 1
/// (never for k = 0). With that half spacing `2^-n` (n = 17..=25), the least `m` that rounds up
/// is `⌊2^23·(2^(2^-n) - 1)⌋ + 1`; none of those bounds is within 0.09 of an integer, so the f64
/// logarithm decides each the same way. Tested against [`modelopt_mx_exponent`] on every binade.
#[inline]
pub fn modelopt_mx_exponent_bits(amax: f32, elem_max: f32) -> i32 {
    /// The least `m` by `n - 17`.
    const ROUND_UP_FROM: [u32; 9] = [45, 23, 12, 6, 3, 2, 1, 1, 1];
    let d = amax / elem_max;
    if d.is_nan() || d <= 0.0 {
        return -127;
    }
    let b = d.to_bits();
    let (e, mut m) = ((b >> 23) & 0xFF, b & 0x7F_FFFF);
    let k = if e != 0 {
        e as i32 - 127
    } else {
        let msb = 31 - m.leading_zeros() as i32;
        m = (m << (23 - msb)) & 0x7F_FFFF;
        msb - 149
    };
    let mut r = k;
    if m != 0 {
        r = k + 1;
        if k != 0 {
            let ak = k.unsigned_abs();
            let fl = 31 - ak.leading_zeros() as i32;
            // Below |k| in magnitude the spacing halves when |k| is a power of two.
            let n = if k < 0 && ak.is_power_of_two() {
                25 - fl
            } else {
                24 - fl
            };
            if m < ROUND_UP_FROM[(n - 17) as usize] {
                r = k;
            }
        }
    }
    r.clamp(-127, 127)
}

/// `2^e` as an f32 (exact for -149..=127).
pub fn pow2_f32(e: i32) -> f32 {
    2f64.powi(e) as f32
}

/// ModelOpt's MXFP4 code of `y` (the weight divided by its group's power of two): the
/// magnitude is the number of bounds 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5 strictly below |y|
/// (ties round down, not to even), and the sign bit is `(2 - sign(y)) // 2`, set for zeros too.
#[inline(always)]
pub fn modelopt_mxfp4_code(y: f32) -> u8 {
    let a = y.abs();
    let idx = u8::from(a > 0.25)
        + u8::from(a > 0.75)
        + u8::from(a > 1.25)
        + u8::from(a > 1.75)
        + u8::from(a > 2.5)
        + u8::from(a > 3.5)
        + u8::from(a > 5.0);
    idx | (u8::from(y <= 0.0) << 3)
}

/// ModelOpt's INT4 block scale: `amax / 7` in f32, a zero amax replaced by 7 (scale 1).
pub fn modelopt_int4_scale(amax: f32) -> f32 {
    let a = if amax == 0.0 {
        7.0
    } else {
        amax.max(f32::MIN_POSITIVE)
    };
    a / 7.0
}

/// ModelOpt's INT4 code of `x / s` (f32): `round` (half to even), clamped to -8..=7, as the
/// two's-complement nibble it packs.
#[inline(always)]
pub fn modelopt_int4_code(x: f32, s: f32) -> u8 {
    ((x / s).round_ties_even().clamp(-8.0, 7.0) as i8 as u8) & 0x0F
}

/// ModelOpt's NVFP4 `weight_scale_2` of a (fused) amax: `amax / (6 · 448)` in f32.
pub fn modelopt_nvfp4_scale_2(amax: f32) -> f32 {
    amax / (E2M1_MAX * E4M3_MAX)
}

/// ModelOpt's NVFP4 block scale code: `amax / (6 · scale_2)` in f32, zero → 1, clamped to
/// `[2^-9, 448]`, cast to E4M3.
pub fn modelopt_nvfp4_block_scale(amax: f32, scale_2: f32) -> u8 {
    let mut s = amax / (E2M1_MAX * scale_2);
    if s == 0.0 {
        s = 1.0;
    }
    f32_to_e4m3(s.clamp(2f32.powi(-9), E4M3_MAX))
}

/// How FP8 blocks are scaled: compressed-tensors divides by `W(amax / 448)` in the weight
/// dtype and stores that scale; transformers' `Fp8Quantize` (FineGrainedFP8, `--format
/// fp8-native`) multiplies by `448 / amax` in f32 (1 for an all-zero block) and stores its
/// reciprocal as `weight_scale_inv` F32 (byte-identical to transformers 5.24 on blocks it
/// quantises; it leaves a weight whose sides 128 does not divide unquantised, which tftf
/// quantises with ragged edge blocks as DeepSeek-V3 does).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BlockMath {
    CompressedTensors,
    Transformers,
}

impl BlockMath {
    /// (the stored scale, the factor the encoder applies) of a block whose amax is `m`.
    pub fn scale(self, wt: WeightType, m: f32) -> (f32, f32) {
        debug_assert!(!self.overflows(m), "refused by the callers");
        match self {
            BlockMath::CompressedTensors => {
                let s = symmetric_scale(wt, m, E4M3_MAX);
                (s, s)
            }
            BlockMath::Transformers => {
                // `448 / amax` on a tensor is torch's `reciprocal(amax) * 448`: two roundings.
                let mult = if m > 0.0 { (1.0 / m) * E4M3_MAX } else { 1.0 };
                (1.0 / mult, mult)
            }
        }
    }

    /// Whether a block with amax `m` has no finite factor (transformers: 448 / amax overflows).
    pub fn overflows(self, m: f32) -> bool {
        self == BlockMath::Transformers && m > 0.0 && ((1.0 / m) * E4M3_MAX).is_infinite()
    }

    #[inline(always)]
    pub fn encode(self, wt: WeightType, x: f32, factor: f32) -> u8 {
        match self {
            BlockMath::CompressedTensors => e4m3_code(wt, x, factor),
            BlockMath::Transformers => f32_to_e4m3((x * factor).clamp(-E4M3_MAX, E4M3_MAX)),
        }
    }

    /// The stored scale's dtype.
    pub fn scale_dtype(self, wt: WeightType) -> DType {
        match self {
            BlockMath::CompressedTensors => wt.dtype(),
            BlockMath::Transformers => DType::F32,
        }
    }

    pub fn scale_bytes(self, wt: WeightType) -> usize {
        match self {
            BlockMath::CompressedTensors => wt.bytes(),
            BlockMath::Transformers => 4,
        }
    }

    pub fn write(self, wt: WeightType, s: f32, out: &mut [u8]) {
        match self {
            BlockMath::CompressedTensors => wt.encode(s, out),
            BlockMath::Transformers => out.copy_from_slice(&s.to_le_bytes()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::fp4::engram::{assert_signed_codes, E2M1_TIES};
    use crate::ops::fp8::codec::e4m3_to_f32;

    #[test]
    fn e4m3_encoding_rounds_to_nearest_even_over_every_code() {
        for c in 0u8..=255 {
            let v = e4m3_to_f32(c);
            if v.is_nan() {
                continue;
            }
            // exact values encode to themselves (±0 keep their sign)
            assert_eq!(f32_to_e4m3(v), c, "{c:#04x} = {v}");
        }
        for c in 0u8..0x7E {
            let (lo, hi) = (e4m3_to_f32(c), e4m3_to_f32(c + 1));
            let mid = (lo + hi) / 2.0;
            let even = if c & 1 == 0 { c } else { c + 1 };
            assert_eq!(f32_to_e4m3(mid), even, "midpoint of {c:#04x}");
            assert_eq!(f32_to_e4m3(mid.next_down()), c);
            assert_eq!(f32_to_e4m3(mid.next_up()), c + 1);
        }
        assert_eq!(f32_to_e4m3(464.0), 0x7E, "464 rounds to 448");
        assert_eq!(f32_to_e4m3(-448.0), 0xFE);
    }

    #[test]
    fn e2m1_ties_go_to_even_and_negative_zero_keeps_its_sign() {
        let beside_ties = [(0.2500001, 1), (5.01, 7), (6.0, 7)];
        assert_signed_codes(f32_to_e2m1, E2M1_TIES.into_iter().chain(beside_ties));
        assert_eq!(f32_to_e2m1(0.0), 0);
        assert_eq!(f32_to_e2m1(-0.0), 0, "an exact -0 has sign(x) = 0");
        assert_eq!(f32_to_e2m1(-0.1), 8);
    }

    #[test]
    fn mx_exponents_round_the_amax_up_from_seven_eighths_of_a_binade() {
        let wt = WeightType::BF16;
        // 1.75 (bf16 mantissa 0x60) carries into 2^1: 127 + 1 - 2
        assert_eq!(mx_exponent(wt, 1.75, 2), 126);
        assert_eq!(mx_exponent(wt, 1.7421875, 2), 125);
        assert_eq!(mx_exponent(wt, 1.0, 2), 125);
        assert_eq!(mx_exponent(wt, 0.0, 2), 0);
        assert_eq!(mx_exponent(wt, 448.0, 8), 128);
        assert_eq!(mx_exponent(wt, 2f32.powi(-130), 2), 0, "clamped at 0");
        assert_eq!(mx_scale(wt, 0), 2f32.powi(-127));
        assert_eq!(mx_stored(mx_scale(wt, 0)), 0);
        // F16 flushes 2^-127 to zero; the library then stores scale 1
        assert_eq!(mx_stored(mx_scale(WeightType::F16, 0)), 127);
        assert_eq!(
            mx_stored(mx_scale(WeightType::F16, 103)),
            103,
            "2^-24, an f16 subnormal"
        );
    }

    #[test]
    fn int_rows_pack_offset_binary_little_endian() {
        let mut out = [0u8; 4];
        pack_int_row(&[-8, 7, 0, -1, 1, 2, 3, 4], 4, &mut out);
        assert_eq!(u32::from_le_bytes(out), 0xCBA9_78F0);
        let mut out = [0u8; 8];
        pack_int_row(&[-128, 127, 0, 1, 5], 8, &mut out);
        assert_eq!(out, [0x00, 0xFF, 0x80, 0x81, 0x85, 0, 0, 0]);
        // the general bitstream agrees with the byte-aligned shortcuts, odd lengths included
        let codes: Vec<i32> = (0..37).map(|k| (k * 5 % 16) - 8).collect();
        let mut fast = [0u8; 20];
        pack_int_row(&codes, 4, &mut fast);
        let mut slow = [0u8; 20];
        for (k, &q) in codes.iter().enumerate() {
            slow[k / 2] |= ((q + 8) as u8) << (4 * (k % 2));
        }
        assert_eq!(fast, slow);
        let mut three = [0u8; 4];
        pack_int_row(&[-4, 3, 0, 1], 3, &mut three);
        assert_eq!(u32::from_le_bytes(three), 0b101_100_111_000);
    }

    /// Every binade of `amax / elem_max` (subnormal ones included): its 2048 least and greatest
    /// mantissas, where the f32 rounding of the logarithm decides, and others spread between.
    #[test]
    fn modelopt_mx_exponent_from_bits_equals_the_logarithm() {
        for elem_max in [6.0f32, 448.0] {
            for binade in 0u32..255 {
                let ms = (0u32..2048)
                    .chain(0x7F_F800..0x80_0000)
                    .chain((0..2048).map(|i| i * 4093 + 2048));
                for m in ms {
                    let d = f32::from_bits(binade << 23 | m);
                    for amax in [d * elem_max, (d * elem_max).next_up()] {
                        if amax.is_finite() {
                            assert_eq!(
                                modelopt_mx_exponent_bits(amax, elem_max),
                                modelopt_mx_exponent(amax, elem_max),
                                "{amax:e} / {elem_max}"
                            );
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn modelopt_scales_and_codes() {
        assert_eq!(modelopt_fp8_scale(0.0), 1.0, "zero amax: maxbound");
        assert_eq!(modelopt_fp8_scale(448.0), 1.0);
        assert_eq!(modelopt_fp8_scale(1.0), 1.0 / 448.0);
        assert_eq!(modelopt_e4m3_code(-0.0, 1.0), 0x80, "-0 keeps its sign");
        assert_eq!(modelopt_e4m3_code(1.0, 0.5), f32_to_e4m3(2.0));
        assert_eq!(modelopt_mx_exponent(0.0, 6.0), -127);
        assert_eq!(modelopt_mx_exponent(6.0, 6.0), 0);
        assert_eq!(modelopt_mx_exponent(6.1, 6.0), 1);
        assert_eq!(modelopt_mx_exponent(448.0, 448.0), 0);
        assert_eq!(modelopt_mx_exponent(224.0, 448.0), -1);
        assert_eq!(modelopt_mx_exponent(1e-40, 448.0), -127);
        assert_eq!(pow2_f32(-127), f32::from_bits(1 << 22));
        // ties go down; zeros and negatives have the sign bit
        let cases = [
            (0.25, 0),
            (0.26, 1),
            (0.75, 1),
            (1.75, 3),
            (2.5, 4),
            (5.0, 6),
            (6.0, 7),
        ];
        assert_signed_codes(modelopt_mxfp4_code, cases);
        assert_eq!(modelopt_mxfp4_code(0.0), 8);
        assert_eq!(modelopt_mxfp4_code(-0.0), 8);
        assert_eq!(modelopt_int4_scale(0.0), 1.0);
        assert_eq!(modelopt_int4_scale(14.0), 2.0);
        assert_eq!(modelopt_int4_code(2.5, 1.0), 2, "half to even");
        assert_eq!(modelopt_int4_code(-3.5, 1.0), 0x0C, "-4, two's complement");
        assert_eq!(modelopt_int4_code(-9.0, 1.0), 0x08, "clamped to -8");
        assert_eq!(modelopt_int4_code(-0.0, 1.0), 0);
        assert_eq!(modelopt_nvfp4_scale_2(2688.0), 1.0);
        assert_eq!(modelopt_nvfp4_block_scale(0.0, 1.0), f32_to_e4m3(1.0));
        assert_eq!(
            modelopt_nvfp4_block_scale(6.0 * 1000.0, 1.0),
            0x7E,
            "clamped to 448"
        );
        assert_eq!(
            modelopt_nvfp4_block_scale(1e-6, 1.0),
            f32_to_e4m3(2f32.powi(-9)),
            "clamped to 2^-9"
        );
    }
}
