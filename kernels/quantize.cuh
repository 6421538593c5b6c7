// The weight-only quantisers of `tftf quantize` (src/ops/quantize/{encode,ops}.rs): FP8 per row,
// packed int per 128-group, NVFP4, MXFP4 and MXFP8 per group, and FP8 per 128×128 block. Every
// step is the Rust op's, in its order: each division is an IEEE division (no reciprocal
// multiplies), each rounding to the weight dtype is `wt_round`, so the codes and scales come out
// byte for byte the same.
#pragma once
#include "fp8.cuh"

// `Scheme` of src/ops/quantize/mod.rs, numbered as `QuantParams::scheme` in
// src/ops/quantize/kernel.rs.
enum QuantScheme {
    QS_FP8_DYNAMIC = 0,
    QS_W8A16 = 1,
    QS_W4A16 = 2,
    QS_NVFP4 = 3,
    QS_MXFP4 = 4,
    QS_MXFP8 = 5,
    QS_FP8_BLOCK = 6,
};

// One chunk of whole rows (FP8 blocks: whole 128-row block rows, the last maybe shorter). Field
// order is the Rust `QuantParams` one.
struct QuantParams {
    u64 rows;        // rows in the chunk
    u64 cols;        // elements per row
    int scheme;      // QuantScheme
    int wt;          // weight dtype: DT_BF16 / DT_F16 / DT_F32
    float global;    // NVFP4's tensor scale (1 otherwise)
    int block_math;  // FP8_BLOCK: 0 compressed-tensors, 1 transformers
};

#define QUANT_E4M3_MAX 448.0f
#define QUANT_E2M1_MAX 6.0f
#define QUANT_FP8_BLOCK 128

// Element `i` of the weight, exactly.
TFTF_HD float quant_load(int wt, const u8* in, u64 i) {
    if (wt == DT_BF16) return bf16_to_f32(TFTF_LOAD(u16, in, i));
    if (wt == DT_F16) return f16_to_f32(TFTF_LOAD(u16, in, i));
    return u2f(TFTF_LOAD(u32, in, i));
}

// `WeightType::round`: an f32 result rounded to the weight dtype (nearest even).
TFTF_HD float wt_round(int wt, float x) {
    if (wt == DT_BF16) return bf16_to_f32(f32_to_bf16(x));
    if (wt == DT_F16) return f16_to_f32(f32_to_f16(x));
    return x;
}

// `WeightType::eps`: what a zero scale becomes.
TFTF_HD float wt_eps(int wt) {
    if (wt == DT_BF16) return 0.0078125f;        // 2^-7
    if (wt == DT_F16) return 0.0009765625f;      // 2^-10
    return u2f(0x34000000u);                     // 2^-23
}

TFTF_HD float abs_f32(float x) { return u2f(f2u(x) & 0x7FFFFFFFu); }

// `f32::clamp` (a NaN stays NaN).
TFTF_HD float clamp_f32(float x, float lo, float hi) {
    if (x < lo) x = lo;
    if (x > hi) x = hi;
    return x;
}

// `m.max(|x|)` of the amax fold; finite inputs only reach here unrefused, where max is exact
// and its order immaterial.
TFTF_HD float amax_step(float m, float x) {
    float a = abs_f32(x);
    return a > m ? a : m;
}

// f32 → E4M3 ("fn"), nearest even; |x| ≥ 480 and NaN give 0x7F. Port of c10's
// `fp8e4m3fn_from_fp32_value` (encode.rs `f32_to_e4m3`).
TFTF_HD u8 f32_to_e4m3(float x) {
    u32 bits = f2u(x);
    u32 sign = bits & 0x80000000u;
    bits ^= sign;
    u8 result;
    if (bits >= (1087u << 20) || is_nan_f32(x)) {
        result = 0x7F;
    } else if (bits < (121u << 23)) {
        // Subnormal: the f32 adder rounds, against 2^-6's denormal bias.
        u32 denorm_mask = 141u << 23;
        u32 sum = f2u(u2f(bits) + u2f(denorm_mask));
        result = (u8)(sum - denorm_mask);
    } else {
        u32 odd = (bits >> 20) & 1u;
        bits = bits + ((u32)(7 - 127) << 23) + 0x7FFFFu;
        bits = bits + odd;
        result = (u8)(bits >> 20);
    }
    return result | (u8)(sign >> 24);
}

// E2M1 code of y (|y| ≤ 6), nearest even; the sign bit is set for y < 0 only, so an exact -0
// gives code 0 and a negative value rounding to zero gives 8 (encode.rs `f32_to_e2m1`).
TFTF_HD u8 quant_e2m1(float y) {
    float a = abs_f32(y);
    u8 idx = (u8)((a > 0.25f) + (a >= 0.75f) + (a > 1.25f) + (a >= 1.75f) + (a > 2.5f) +
                  (a >= 3.5f) + (a > 5.0f));
    return idx | (u8)((y < 0.0f) ? 8 : 0);
}

// `symmetric_scale`: W(amax / half_range), zero → eps.
TFTF_HD float quant_symmetric_scale(int wt, float amax, float half_range) {
    float s = wt_round(wt, amax / half_range);
    return s == 0.0f ? wt_eps(wt) : s;
}

// `e4m3_code`: E4M3 of W(x / s) + 0 (a -0 becomes +0), clamped to ±448.
TFTF_HD u8 quant_e4m3_code(int wt, float x, float s) {
    float y = wt_round(wt, x / s);
    if (f2u(y) == 0x80000000u) y = 0.0f;
    return f32_to_e4m3(clamp_f32(y, -QUANT_E4M3_MAX, QUANT_E4M3_MAX));
}

// floor(log2(x)) of a positive finite f32 that is a power of two (normal or subnormal).
TFTF_HD int quant_log2_pow2(float x) {
    u32 b = f2u(x);
    u32 e = (b >> 23) & 0xFFu;
    if (e != 0) return (int)e - 127;
    int msb = 63 - clz64((u64)b);
    return msb - 149;
}

// `mx_exponent`: the E8M0 exponent of an MX group with amax `amax` (a value of wt), for elements
// whose largest power of two is 2^elem_offset: `round_to_power_2` on the weight dtype's bits
// (whose result is 0, a normal power of two or infinity), then 127 + log2 - offset in 0..=255.
TFTF_HD u8 quant_mx_exponent(int wt, float amax, int elem_offset) {
    u32 bits, add, mask;
    float p2;
    if (wt == DT_BF16) {
        bits = f32_to_bf16(amax);
        add = 1u << 5;
        mask = ((1u << 9) - 1u) << 7;
        p2 = bf16_to_f32((u16)((bits + add) & mask));
    } else if (wt == DT_F16) {
        bits = f32_to_f16(amax);
        add = 1u << 8;
        mask = ((1u << 6) - 1u) << 10;
        p2 = f16_to_f32((u16)((bits + add) & mask));
    } else {
        bits = f2u(amax);
        add = 1u << 21;
        mask = ((1u << 9) - 1u) << 23;
        p2 = u2f((bits + add) & mask);
    }
    if (p2 == 0.0f) return 0;
    if (!is_finite_f32(p2)) return 255;
    int e = 127 + quant_log2_pow2(p2) - elem_offset;
    return (u8)(e < 0 ? 0 : (e > 255 ? 255 : e));
}

// `mx_scale`: 2^(e-127) in the weight dtype; zero (F16 below 2^-24) becomes 1. e = 255 is
// 2^128, infinite in every dtype.
TFTF_HD float quant_mx_scale(int wt, u8 e) {
    float p;
    if (e == 255) p = u2f(0x7F800000u);
    else if (e == 0) p = u2f(0x00400000u);  // 2^-127, an f32 subnormal
    else p = u2f((u32)e << 23);
    float s = wt_round(wt, p);
    return s == 0.0f ? 1.0f : s;
}

// `mx_stored`: clamp(127 + floor(log2(s)), 0, 255). An infinite s gives 0, as the Rust op does
// in release builds (`i32::MAX + 127` wraps negative before the clamp).
TFTF_HD u8 quant_mx_stored(float s) {
    if (!is_finite_f32(s)) return 0;
    int e = 127 + quant_log2_pow2(s);
    return (u8)(e < 0 ? 0 : (e > 255 ? 255 : e));
}

// `round_half_even_small`: the f32 adder's nearest-even rounding to the units digit.
TFTF_HD float quant_round_small(float y) {
    const float magic = 12582912.0f;  // 1.5 · 2^23
    return (y + magic) - magic;
}

// Elements per group (scale) along a row of a grouped scheme.
TFTF_HD u64 quant_group(int scheme) {
    switch (scheme) {
        case QS_W8A16: case QS_W4A16: return 128;
        case QS_NVFP4: return 16;
        default: return 32;  // MXFP4, MXFP8
    }
}

// Code bytes per row (`row_code_bytes`).
TFTF_HD u64 quant_row_code_bytes(const QuantParams& p) {
    switch (p.scheme) {
        case QS_W8A16: return 4 * ((p.cols * 8 + 31) / 32);
        case QS_W4A16: return 4 * ((p.cols * 4 + 31) / 32);
        case QS_NVFP4: case QS_MXFP4: return p.cols / 2;
        default: return p.cols;
    }
}

// Group `g` of the chunk (row g / groups): its codes and scale, as `QuantizeRows::row` writes
// them. Returns false when the group holds a non-finite value (the CPU op names it). The int
// schemes' last group of a row also zeroes the row's padding bytes.
TFTF_HD bool quant_group_encode(const QuantParams& p, const u8* in, u8* codes, u8* scales,
                                u64 g) {
    const int wt = p.wt;
    const u64 group = quant_group(p.scheme);
    const u64 groups = p.cols / group;
    const u64 r = g / groups, k = g - r * groups;
    const u64 first = r * p.cols + k * group;
    float m = 0.0f;
    bool finite = true;
    for (u64 j = 0; j < group; j++) {
        float x = quant_load(wt, in, first + j);
        finite = finite && is_finite_f32(x);
        m = amax_step(m, x);
    }
    if (!finite) return false;
    const u64 cb = quant_row_code_bytes(p);
    u8* row_codes = codes + r * cb;
    switch (p.scheme) {
        case QS_W8A16:
        case QS_W4A16: {
            int bits = p.scheme == QS_W8A16 ? 8 : 4;
            float qmax = (float)((1 << (bits - 1)) - 1);
            float qmin = -(float)(1 << (bits - 1));
            float half_range = (qmax - qmin) / 2.0f;
            float s = quant_symmetric_scale(wt, m, half_range);
            store_as(wt, scales, g, s);
            for (u64 j = 0; j < group; j++) {
                float x = quant_load(wt, in, first + j);
                int q = (int)quant_round_small(clamp_f32(wt_round(wt, x / s), qmin, qmax));
                u64 e = k * group + j;
                if (bits == 8) {
                    row_codes[e] = (u8)(q + 128);
                } else if (e % 2 == 0) {
                    row_codes[e / 2] = (u8)(q + 8);
                } else {
                    row_codes[e / 2] = (u8)(row_codes[e / 2] | ((q + 8) << 4));
                }
            }
            if (k + 1 == groups) {
                for (u64 b = p.cols * (u64)bits / 8; b < cb; b++) row_codes[b] = 0;
            }
            return true;
        }
        case QS_NVFP4: {
            float gs = p.global;
            float local = wt_round(wt, m / QUANT_E2M1_MAX);
            u8 sc = f32_to_e4m3(clamp_f32(gs * local, -QUANT_E4M3_MAX, QUANT_E4M3_MAX));
            if (e4m3_to_f32(sc) == 0.0f) sc = f32_to_e4m3(0.125f);
            scales[g] = sc;
            float eff = e4m3_to_f32(sc) / gs;
            for (u64 j = 0; j < group; j += 2) {
                float x0 = quant_load(wt, in, first + j);
                float x1 = quant_load(wt, in, first + j + 1);
                u8 lo = quant_e2m1(clamp_f32(x0 / eff, -QUANT_E2M1_MAX, QUANT_E2M1_MAX));
                u8 hi = quant_e2m1(clamp_f32(x1 / eff, -QUANT_E2M1_MAX, QUANT_E2M1_MAX));
                row_codes[(k * group + j) / 2] = (u8)(lo | (hi << 4));
            }
            return true;
        }
        case QS_MXFP4: {
            float s = quant_mx_scale(wt, quant_mx_exponent(wt, m, 2));
            scales[g] = quant_mx_stored(s);
            for (u64 j = 0; j < group; j += 2) {
                float x0 = quant_load(wt, in, first + j);
                float x1 = quant_load(wt, in, first + j + 1);
                u8 lo = quant_e2m1(
                    clamp_f32(wt_round(wt, x0 / s), -QUANT_E2M1_MAX, QUANT_E2M1_MAX));
                u8 hi = quant_e2m1(
                    clamp_f32(wt_round(wt, x1 / s), -QUANT_E2M1_MAX, QUANT_E2M1_MAX));
                row_codes[(k * group + j) / 2] = (u8)(lo | (hi << 4));
            }
            return true;
        }
        default: {  // QS_MXFP8
            float s = quant_mx_scale(wt, quant_mx_exponent(wt, m, 8));
            scales[g] = quant_mx_stored(s);
            for (u64 j = 0; j < group; j++)
                row_codes[k * group + j] = quant_e4m3_code(wt, quant_load(wt, in, first + j), s);
            return true;
        }
    }
}

// FP8_DYNAMIC and FP8_BLOCK take three passes, without shared memory: each segment (up to 128
// columns of one row) folds its amax into its target's (the row, or the 128×128 block) with an
// atomic max on the f32 bits (non-negative floats order as their bits, and max is exact, so the
// order is immaterial); one thread per target turns the amax into the stored scale and the
// encoder's factor; one thread per element encodes.

TFTF_HD u64 quant_fp8_grid_cols(const QuantParams& p) {
    return (p.cols + QUANT_FP8_BLOCK - 1) / QUANT_FP8_BLOCK;
}

TFTF_HD u64 quant_fp8_segments(const QuantParams& p) { return p.rows * quant_fp8_grid_cols(p); }

// Rows (FP8_DYNAMIC) or 128×128 blocks (FP8_BLOCK) of the chunk, in scale order.
TFTF_HD u64 quant_fp8_targets(const QuantParams& p) {
    if (p.scheme != QS_FP8_BLOCK) return p.rows;
    return (p.rows + QUANT_FP8_BLOCK - 1) / QUANT_FP8_BLOCK * quant_fp8_grid_cols(p);
}

// The target of chunk row r, column block k.
TFTF_HD u64 quant_fp8_target(const QuantParams& p, u64 r, u64 k) {
    if (p.scheme != QS_FP8_BLOCK) return r;
    return r / QUANT_FP8_BLOCK * quant_fp8_grid_cols(p) + k;
}

// Segment `seg`: its target and amax bits; false when it holds a non-finite value.
TFTF_HD bool quant_fp8_segment(const QuantParams& p, const u8* in, u64 seg, u64* target,
                               u32* amax_bits) {
    u64 gc = quant_fp8_grid_cols(p);
    u64 r = seg / gc, k = seg - r * gc;
    u64 c0 = k * QUANT_FP8_BLOCK;
    u64 c1 = c0 + QUANT_FP8_BLOCK < p.cols ? c0 + QUANT_FP8_BLOCK : p.cols;
    float m = 0.0f;
    bool finite = true;
    for (u64 c = c0; c < c1; c++) {
        float x = quant_load(p.wt, in, r * p.cols + c);
        finite = finite && is_finite_f32(x);
        m = amax_step(m, x);
    }
    *target = quant_fp8_target(p, r, k);
    *amax_bits = f2u(m);
    return finite;
}

TFTF_HD bool quant_transformers(const QuantParams& p) {
    return p.scheme == QS_FP8_BLOCK && p.block_math == 1;
}

// FP8_BLOCK (`BlockMath::scale`): the encoder's factor of a block whose amax is m, and in
// `stored` the scale written (compressed-tensors, and FP8_DYNAMIC's rows: W(m / 448), both;
// transformers: the factor 448 / m as reciprocal(m) · 448 in f32, 1 for an all-zero block,
// stored as its reciprocal).
TFTF_HD float quant_block_factor(const QuantParams& p, float m, float* stored) {
    if (!quant_transformers(p)) {
        float s = quant_symmetric_scale(p.wt, m, QUANT_E4M3_MAX);
        *stored = s;
        return s;
    }
    float mult = m > 0.0f ? (1.0f / m) * QUANT_E4M3_MAX : 1.0f;
    *stored = 1.0f / mult;
    return mult;
}

// Target t with amax m: writes its scale (`BlockMath::write`: the weight dtype, F32 for
// transformers) and returns the encoder's factor.
TFTF_HD float quant_fp8_scale(const QuantParams& p, float m, u8* scales, u64 t) {
    float stored;
    float factor = quant_block_factor(p, m, &stored);
    store_as(quant_transformers(p) ? (int)DT_F32 : p.wt, scales, t, stored);
    return factor;
}

// FP8_BLOCK (`BlockMath::encode`), FP8_DYNAMIC: the code of x under its target's factor.
TFTF_HD u8 quant_block_code(const QuantParams& p, float x, float factor) {
    if (!quant_transformers(p)) return quant_e4m3_code(p.wt, x, factor);
    return f32_to_e4m3(clamp_f32(x * factor, -QUANT_E4M3_MAX, QUANT_E4M3_MAX));
}

// Element i of the chunk, `factors` holding each target's factor bits.
TFTF_HD u8 quant_fp8_code(const QuantParams& p, const u8* in, const u32* factors, u64 i) {
    u64 r = i / p.cols, c = i - r * p.cols;
    float factor = u2f(factors[quant_fp8_target(p, r, c / QUANT_FP8_BLOCK)]);
    return quant_block_code(p, quant_load(p.wt, in, i), factor);
}
