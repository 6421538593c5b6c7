// Float conversions: every cast rounds once, to nearest even (src/ops/cast.rs).
#pragma once
#include "common.cuh"

// Element types, numbered as `DType::kernel_code` in src/gpu/plan.rs.
enum TftfDtype {
    DT_F64 = 0,
    DT_F32 = 1,
    DT_F16 = 2,
    DT_BF16 = 3,
    DT_BOOL = 4,
    DT_U8 = 5,
    DT_I8 = 6,
    DT_I16 = 7,
    DT_U16 = 8,
    DT_I32 = 9,
    DT_U32 = 10,
    DT_I64 = 11,
    DT_U64 = 12,
    DT_E8M0 = 13,
    DT_E4M3 = 14,
    DT_E5M2 = 15,
    DT_NONE = 255,
};

TFTF_HD int dtype_size(int dt) {
    switch (dt) {
        case DT_F64: case DT_I64: case DT_U64: return 8;
        case DT_F32: case DT_I32: case DT_U32: return 4;
        case DT_F16: case DT_BF16: case DT_I16: case DT_U16: return 2;
        default: return 1;
    }
}

// Round to nearest even; NaN becomes 0x7FC0 (c10's round_to_nearest_even).
TFTF_HD u16 f32_to_bf16(float x) {
    u32 b = f2u(x);
    if (is_nan_f32(x)) return 0x7FC0;
    u32 lsb = (b >> 16) & 1;
    return (u16)((b + 0x7FFFu + lsb) >> 16);
}

// c10's fp16_ieee_from_fp32_value: round to nearest even, NaN → sign | 0x7E00.
TFTF_HD u16 f32_to_f16(float f) {
    const float scale_to_inf = u2f(0x77800000u);   // 2^112
    const float scale_to_zero = u2f(0x08800000u);  // 2^-110
    float base = (u2f(f2u(f) & 0x7FFFFFFFu) * scale_to_inf) * scale_to_zero;
    u32 w = f2u(f);
    u32 shl1_w = w + w;
    u32 sign = w & 0x80000000u;
    u32 bias = shl1_w & 0xFF000000u;
    if (bias < 0x71000000u) bias = 0x71000000u;
    base = base + u2f((bias >> 1) + 0x07800000u);
    u32 bits = f2u(base);
    u32 exp_bits = (bits >> 13) & 0x00007C00u;
    u32 mantissa_bits = bits & 0x00000FFFu;
    u32 nonsign = exp_bits + mantissa_bits;
    return (u16)((sign >> 16) | (shl1_w > 0xFF000000u ? 0x7E00u : nonsign));
}

TFTF_HD float bf16_to_f32(u16 b) { return u2f((u32)b << 16); }

// Exact; a NaN keeps its payload with the quiet bit set (as F16C and the `half` crate do).
TFTF_HD float f16_to_f32(u16 h) {
    u32 sign = (u32)(h & 0x8000u) << 16;
    u32 e = (h >> 10) & 0x1Fu;
    u32 m = h & 0x3FFu;
    if (e == 0x1F) return u2f(sign | 0x7F800000u | (m ? 0x400000u : 0u) | (m << 13));
    if (e == 0) return u2f(f2u((float)m * 5.9604644775390625e-8f) | sign);  // m · 2^-24
    return u2f(sign | ((e + 112) << 23) | (m << 13));
}

// f64 → f32 to nearest even; a NaN keeps its sign and top payload bits and is quieted (what
// x86's cvtsd2ss and Arm's fcvt give the Rust `as` cast).
TFTF_HD float f64_to_f32_rne(double x) {
    u64 b = d2u(x);
    if ((b & 0x7FFFFFFFFFFFFFFFull) > 0x7FF0000000000000ull)
        return u2f((u32)(b >> 32 & 0x80000000u) | 0x7FC00000u | (u32)((b >> 29) & 0x7FFFFFu));
    return (float)x;
}

// f64 → f32 rounded to odd: an inexact result gets an odd last bit, so rounding it again to a
// 16-bit float gives the correctly rounded value.
TFTF_HD float f64_to_f32_odd(double x) {
    float f = f64_to_f32_rne(x);
    if (is_finite_f32(f) && (double)f != x && (f2u(f) & 1) == 0) {
        bool away = x > 0 ? x > (double)f : x < (double)f;
        return u2f(away ? f2u(f) + 1 : f2u(f) - 1);
    }
    return f;
}

// |v| · sign rounded to odd, from the integer bits (truncate to 24 significant bits, then make
// the last one sticky).
TFTF_HD float u64_to_f32_odd(u64 mag, bool negative) {
    u32 sign = negative ? 0x80000000u : 0u;
    if (mag == 0) return u2f(sign);
    int msb = 63 - clz64(mag);
    if (msb <= 23) return u2f(f2u((float)(u32)mag) | sign);
    int sh = msb - 23;
    u32 top = (u32)(mag >> sh);
    u32 sticky = (mag & ((1ull << sh) - 1)) != 0 ? 1u : 0u;
    return u2f(sign | ((u32)(msb + 127) << 23) | ((top | sticky) & 0x7FFFFFu));
}

TFTF_HD float i64_to_f32_odd(i64 v) {
    return v < 0 ? u64_to_f32_odd(0ull - (u64)v, true) : u64_to_f32_odd((u64)v, false);
}

// Element `i` of a `src` buffer as the f32 that is then rounded to `dst` (rounded to odd when
// `dst` is a 16-bit float, so that rounding happens exactly once overall).
TFTF_HD float cast_load(int src, int dst, const u8* in, u64 i) {
    bool narrow = dst != DT_F32;
    switch (src) {
        case DT_F32: return u2f(TFTF_LOAD(u32, in, i));
        case DT_BF16: return bf16_to_f32(TFTF_LOAD(u16, in, i));
        case DT_F16: return f16_to_f32(TFTF_LOAD(u16, in, i));
        case DT_F64: {
            double x = u2d(TFTF_LOAD(u64, in, i));
            return narrow ? f64_to_f32_odd(x) : f64_to_f32_rne(x);
        }
        case DT_BOOL: case DT_U8: return (float)in[i];
        case DT_I8: return (float)(signed char)in[i];
        case DT_I16: return (float)(short)TFTF_LOAD(u16, in, i);
        case DT_U16: return (float)TFTF_LOAD(u16, in, i);
        case DT_I32: {
            int v = (int)TFTF_LOAD(u32, in, i);
            return narrow ? i64_to_f32_odd(v) : (float)v;
        }
        case DT_U32: {
            u32 v = TFTF_LOAD(u32, in, i);
            return narrow ? u64_to_f32_odd(v, false) : (float)v;
        }
        case DT_I64: {
            i64 v = (i64)TFTF_LOAD(u64, in, i);
            return narrow ? i64_to_f32_odd(v) : (float)v;
        }
        default: {
            u64 v = TFTF_LOAD(u64, in, i);
            return narrow ? u64_to_f32_odd(v, false) : (float)v;
        }
    }
}

// Stores f32 `v` as element `i` of a BF16, F16 or F32 buffer.
TFTF_HD void store_as(int dst, u8* out, u64 i, float v) {
    if (dst == DT_BF16) TFTF_STORE(u16, out, i, f32_to_bf16(v));
    else if (dst == DT_F16) TFTF_STORE(u16, out, i, f32_to_f16(v));
    else TFTF_STORE(u32, out, i, f2u(v));
}

// One element of the cast op.
TFTF_HD void cast_element(int src, int dst, const u8* in, u8* out, u64 i) {
    store_as(dst, out, i, cast_load(src, dst, in, i));
}
