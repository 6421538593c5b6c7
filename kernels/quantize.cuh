// The weight-only quantisers of `tftf quantize` (src/ops/quantize/{encode,ops,modelopt}.rs): FP8
// per row, packed int per 128-group, NVFP4, MXFP4 and MXFP8 per group, and FP8 per 128×128
// block, as compressed-tensors, transformers (FP8 blocks) and ModelOpt compute them. Every step
// is the Rust op's, in its order: each division is an IEEE division (no reciprocal multiplies),
// each rounding to the weight dtype is `wt_round`, so the codes and scales come out byte for
// byte the same.
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

// Whose arithmetic and layout (`QuantParams::flavour`).
enum QuantFlavour {
    QF_COMPRESSED_TENSORS = 0,
    QF_TRANSFORMERS = 1,  // FP8_BLOCK only (`--format fp8-native`)
    QF_MODELOPT = 2,
};

// One chunk of whole rows (FP8 blocks: whole 128-row block rows, the last maybe shorter;
// ModelOpt W4A16: whole row pairs). Field order is the Rust `QuantParams` one.
struct QuantParams {
    u64 rows;     // rows in the chunk
    u64 cols;     // elements per row
    int scheme;   // QuantScheme
    int wt;       // weight dtype: DT_BF16 / DT_F16 / DT_F32
    float global; // NVFP4's tensor scale (compressed-tensors) or weight_scale_2 (ModelOpt)
    int flavour;  // QuantFlavour
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

// The amax of the `n` weight elements from `first` into `amax`; false when one is not finite.
TFTF_HD bool quant_amax(int wt, const u8* in, u64 first, u64 n, float* amax) {
    float m = 0.0f;
    bool finite = true;
    for (u64 j = 0; j < n; j++) {
        float x = quant_load(wt, in, first + j);
        finite = finite && is_finite_f32(x);
        m = amax_step(m, x);
    }
    *amax = m;
    return finite;
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

// `mx_stored`: clamp(127 + floor(log2(s)), 0, 255) of a finite s (an infinite one is refused
// before; 255 here, as in the Rust op).
TFTF_HD u8 quant_mx_stored(float s) {
    if (!is_finite_f32(s)) return 255;
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

TFTF_HD bool quant_modelopt(const QuantParams& p) { return p.flavour == QF_MODELOPT; }

// Threads of `tftf_quantize_groups` for a chunk: one per group of a row, or per group of a row
// pair for ModelOpt W4A16, whose two rows share the bytes of a packed row.
TFTF_HD u64 quant_group_threads(const QuantParams& p) {
    u64 per_row = p.cols / quant_group(p.scheme);
    if (quant_modelopt(p) && p.scheme == QS_W4A16) return p.rows / 2 * per_row;
    return p.rows * per_row;
}

// Code bytes per row (`row_code_bytes`).
TFTF_HD u64 quant_row_code_bytes(const QuantParams& p) {
    if (quant_modelopt(p) && p.scheme == QS_W4A16) return p.cols / 2;
    switch (p.scheme) {
        case QS_W8A16: return 4 * ((p.cols * 8 + 31) / 32);
        case QS_W4A16: return 4 * ((p.cols * 4 + 31) / 32);
        case QS_NVFP4: case QS_MXFP4: return p.cols / 2;
        default: return p.cols;
    }
}

// ModelOpt (encode.rs `modelopt_*`): f32 arithmetic on the upcast weight, no rounding to the
// weight dtype, F32 scales.

// `modelopt_fp8_scale`: amax / 448, a zero amax giving 1 and a subnormal one the least normal.
TFTF_HD float quant_modelopt_fp8_scale(float amax) {
    float a = amax == 0.0f ? QUANT_E4M3_MAX : (amax < u2f(0x00800000u) ? u2f(0x00800000u) : amax);
    return a / QUANT_E4M3_MAX;
}

// `modelopt_e4m3_code`: E4M3 of x / s clamped to ±448 (a -0 stays 0x80).
TFTF_HD u8 quant_modelopt_e4m3_code(float x, float s) {
    return f32_to_e4m3(clamp_f32(x / s, -QUANT_E4M3_MAX, QUANT_E4M3_MAX));
}

// `pow2_f32`: 2^e for -149..=127 (subnormal below -126).
TFTF_HD float quant_pow2(int e) {
    if (e >= -126) return u2f((u32)(e + 127) << 23);
    return u2f(1u << (e + 149));
}

// Least m (mantissa bits of d = 2^k·(1 + m·2^-23), m ≥ 1) for which log2(d) = k + log2(1 + m·2^-23)
// rounds above k in f32, by n where 2^-n is half the f32 spacing from k towards k + 1:
// m ≥ ⌊2^23·(2^(2^-n) - 1)⌋ + 1. None of the bounds is within 0.09 of an integer, so the f64
// logarithm the CPU rounds from decides each the same way.
TFTF_HD u32 quant_log2_round_up_from(int n) {
    switch (n) {
        case 17: return 45;
        case 18: return 23;
        case 19: return 12;
        case 20: return 6;
        case 21: return 3;
        case 22: return 2;
        default: return 1;  // 23..=25
    }
}

// `modelopt_mx_exponent`: ceil(log2(amax / elem_max)) with the logarithm rounded to f32 (as
// torch computes it on the CPU), -127 for a zero group, clamped to -127..=127. Computed from
// the bits: for d = 2^k·(1 + f), f > 0, log2(d) lies in (k, k + 1) and its ceiling is k + 1
// unless the f32 rounding lands on k itself, which happens when log2(1 + f) is below half the
// spacing of f32 values next to k (on the side of k + 1) and never when k = 0.
TFTF_HD int quant_modelopt_mx_exponent(float amax, float elem_max) {
    float d = amax / elem_max;
    if (!(d > 0.0f)) return -127;
    u32 b = f2u(d);
    u32 e = (b >> 23) & 0xFFu;
    u32 m = b & 0x7FFFFFu;
    int k;
    if (e != 0) {
        k = (int)e - 127;
    } else {
        int msb = 63 - clz64((u64)m);
        k = msb - 149;
        m = (m << (23 - msb)) & 0x7FFFFFu;
    }
    int r = k;
    if (m != 0) {
        r = k + 1;
        if (k != 0) {
            u32 ak = (u32)(k > 0 ? k : -k);
            int fl = 63 - clz64((u64)ak);
            // Below |k| in magnitude the spacing halves when |k| is a power of two.
            int n = (k < 0 && (ak & (ak - 1u)) == 0) ? 25 - fl : 24 - fl;
            if (m < quant_log2_round_up_from(n)) r = k;
        }
    }
    return r < -127 ? -127 : (r > 127 ? 127 : r);
}

// `modelopt_mxfp4_code`: the number of bounds strictly below |y| (ties round down), the sign
// bit set for y ≤ 0.
TFTF_HD u8 quant_modelopt_mxfp4_code(float y) {
    float a = abs_f32(y);
    u8 idx = (u8)((a > 0.25f) + (a > 0.75f) + (a > 1.25f) + (a > 1.75f) + (a > 2.5f) +
                  (a > 3.5f) + (a > 5.0f));
    return idx | (u8)((y <= 0.0f) ? 8 : 0);
}

// `modelopt_int4_scale`: amax / 7, a zero amax giving 1 and a subnormal one the least normal.
TFTF_HD float quant_modelopt_int4_scale(float amax) {
    float a = amax == 0.0f ? 7.0f : (amax < u2f(0x00800000u) ? u2f(0x00800000u) : amax);
    return a / 7.0f;
}

// `modelopt_int4_code`: x / s rounded half to even, clamped to -8..=7, as a two's-complement
// nibble.
TFTF_HD u8 quant_modelopt_int4_code(float x, float s) {
    float y = clamp_f32(quant_round_small(clamp_f32(x / s, -16.0f, 16.0f)), -8.0f, 7.0f);
    return (u8)((int)y) & 0x0Fu;
}

// Where group `g` of a chunk lies: its size, groups per row, its row and index in the row, and
// its first element.
struct QuantGroupAt {
    u64 group, groups, r, k, first;
};

TFTF_HD QuantGroupAt quant_group_at(const QuantParams& p, u64 g) {
    QuantGroupAt at;
    at.group = quant_group(p.scheme);
    at.groups = p.cols / at.group;
    at.r = g / at.groups;
    at.k = g - at.r * at.groups;
    at.first = at.r * p.cols + at.k * at.group;
    return at;
}

// Group `g` of a ModelOpt chunk: its codes and scale as `ModeloptRows` writes them (W4A16: group
// g of a row pair, both rows). Returns false when the group holds a non-finite value.
TFTF_HD bool quant_modelopt_group(const QuantParams& p, const u8* in, u8* codes, u8* scales,
                                  u64 g) {
    const int wt = p.wt;
    const QuantGroupAt at = quant_group_at(p, g);
    const u64 group = at.group, groups = at.groups, r = at.r, k = at.k;
    if (p.scheme == QS_W4A16) {
        // r is the pair: rows 2r (low nibbles) and 2r + 1 (high nibbles) of packed row r.
        u8* packed = codes + r * p.cols + k * group;
        for (u64 h = 0; h < 2; h++) {
            const u64 first = (2 * r + h) * p.cols + k * group;
            float m;
            if (!quant_amax(wt, in, first, group, &m)) return false;
            float s = quant_modelopt_int4_scale(m);
            TFTF_STORE(u32, scales, (2 * r + h) * groups + k, f2u(s));
            for (u64 j = 0; j < group; j++) {
                u8 q = quant_modelopt_int4_code(quant_load(wt, in, first + j), s);
                packed[j] = h == 0 ? q : (u8)(packed[j] | (q << 4));
            }
        }
        return true;
    }
    const u64 first = at.first;
    float m;
    if (!quant_amax(wt, in, first, group, &m)) return false;
    u8* row_codes = codes + r * quant_row_code_bytes(p);
    switch (p.scheme) {
        case QS_NVFP4: {
            float s2 = p.global;
            float bs = m / (QUANT_E2M1_MAX * s2);
            if (bs == 0.0f) bs = 1.0f;
            u8 sc = f32_to_e4m3(clamp_f32(bs, u2f(0x3B000000u), QUANT_E4M3_MAX));  // 2^-9
            scales[g] = sc;
            float eff = e4m3_to_f32(sc) * s2;
            for (u64 j = 0; j < group; j += 2) {
                u8 lo = quant_e2m1(quant_load(wt, in, first + j) / eff);
                u8 hi = quant_e2m1(quant_load(wt, in, first + j + 1) / eff);
                row_codes[(k * group + j) / 2] = (u8)(lo | (hi << 4));
            }
            return true;
        }
        case QS_MXFP4: {
            int e = quant_modelopt_mx_exponent(m, QUANT_E2M1_MAX);
            scales[g] = (u8)(e + 127);
            float pw = quant_pow2(e);
            for (u64 j = 0; j < group; j += 2) {
                u8 lo = quant_modelopt_mxfp4_code(quant_load(wt, in, first + j) / pw);
                u8 hi = quant_modelopt_mxfp4_code(quant_load(wt, in, first + j + 1) / pw);
                row_codes[(k * group + j) / 2] = (u8)(lo | (hi << 4));
            }
            return true;
        }
        default: {  // QS_MXFP8
            int e = quant_modelopt_mx_exponent(m, QUANT_E4M3_MAX);
            scales[g] = (u8)(e + 127);
            float f = quant_pow2(-e);
            for (u64 j = 0; j < group; j++) {
                float y = quant_load(wt, in, first + j) * f;
                row_codes[k * group + j] =
                    f32_to_e4m3(clamp_f32(y, -QUANT_E4M3_MAX, QUANT_E4M3_MAX));
            }
            return true;
        }
    }
}

// Group `g` of the chunk (row g / groups): its codes and scale, as `QuantizeRows::row` writes
// them. Returns false when the group holds a non-finite value (the CPU op names it). The int
// schemes' last group of a row also zeroes the row's padding bytes.
TFTF_HD bool quant_group_encode(const QuantParams& p, const u8* in, u8* codes, u8* scales,
                                u64 g) {
    if (quant_modelopt(p)) return quant_modelopt_group(p, in, codes, scales, g);
    const int wt = p.wt;
    const QuantGroupAt at = quant_group_at(p, g);
    const u64 group = at.group, groups = at.groups, r = at.r, k = at.k, first = at.first;
    float m;
    if (!quant_amax(wt, in, first, group, &m)) return false;
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
            if (!is_finite_f32(s)) return false;  // `mx_overflow`: the CPU op names the group
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
            if (!is_finite_f32(s)) return false;
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
    float m;
    bool finite = quant_amax(p.wt, in, r * p.cols + c0, c1 - c0, &m);
    *target = quant_fp8_target(p, r, k);
    *amax_bits = f2u(m);
    return finite;
}

TFTF_HD bool quant_transformers(const QuantParams& p) {
    return p.scheme == QS_FP8_BLOCK && p.flavour == QF_TRANSFORMERS;
}

// FP8_BLOCK (`BlockMath::scale`): the encoder's factor of a block whose amax is m, and in
// `stored` the scale written (compressed-tensors, and FP8_DYNAMIC's rows: W(m / 448), both;
// transformers: the factor 448 / m as reciprocal(m) · 448 in f32, 1 for an all-zero block,
// stored as its reciprocal; ModelOpt: `modelopt_fp8_scale`, both).
TFTF_HD float quant_block_factor(const QuantParams& p, float m, float* stored) {
    if (quant_modelopt(p)) {
        float s = quant_modelopt_fp8_scale(m);
        *stored = s;
        return s;
    }
    if (!quant_transformers(p)) {
        float s = quant_symmetric_scale(p.wt, m, QUANT_E4M3_MAX);
        *stored = s;
        return s;
    }
    float mult = m > 0.0f ? (1.0f / m) * QUANT_E4M3_MAX : 1.0f;
    *stored = 1.0f / mult;
    return mult;
}

// `BlockMath::overflows`: transformers' factor 448 / m is infinite (0 < m < 1.3e-36); the
// block is refused (the CPU op names it).
TFTF_HD bool quant_block_overflows(const QuantParams& p, float m) {
    return quant_transformers(p) && m > 0.0f && !is_finite_f32((1.0f / m) * QUANT_E4M3_MAX);
}

// Target t with amax m: writes its scale (`BlockMath::write`: the weight dtype, F32 for
// transformers and ModelOpt) and returns the encoder's factor.
TFTF_HD float quant_fp8_scale(const QuantParams& p, float m, u8* scales, u64 t) {
    float stored;
    float factor = quant_block_factor(p, m, &stored);
    bool f32 = quant_transformers(p) || quant_modelopt(p);
    store_as(f32 ? (int)DT_F32 : p.wt, scales, t, stored);
    return factor;
}

// FP8_BLOCK (`BlockMath::encode`), FP8_DYNAMIC: the code of x under its target's factor.
TFTF_HD u8 quant_block_code(const QuantParams& p, float x, float factor) {
    if (quant_modelopt(p)) return quant_modelopt_e4m3_code(x, factor);
    if (!quant_transformers(p)) return quant_e4m3_code(p.wt, x, factor);
    return f32_to_e4m3(clamp_f32(x * factor, -QUANT_E4M3_MAX, QUANT_E4M3_MAX));
}

// Element i of the chunk, `factors` holding each target's factor bits.
TFTF_HD u8 quant_fp8_code(const QuantParams& p, const u8* in, const u32* factors, u64 i) {
    u64 r = i / p.cols, c = i - r * p.cols;
    float factor = u2f(factors[quant_fp8_target(p, r, c / QUANT_FP8_BLOCK)]);
    return quant_block_code(p, quant_load(p.wt, in, i), factor);
}
