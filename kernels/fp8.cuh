// FP8 codecs and block dequantisation (src/ops/codec.rs, src/ops/dequant_fp8).
#pragma once
#include "cast.cuh"

TFTF_HD float e4m3_to_f32(u8 c) {
    u32 sign = (u32)(c & 0x80) << 24;
    u32 e = (c >> 3) & 0xF, m = c & 7;
    if (e == 0xF && m == 7) return u2f(TFTF_NAN_F32);
    if (e == 0) return u2f(f2u((float)m * 0.001953125f) | sign);  // m · 2^-9
    return u2f(sign | ((e + 120) << 23) | (m << 20));
}

TFTF_HD float e5m2_to_f32(u8 c) {
    u32 sign = (u32)(c & 0x80) << 24;
    u32 e = (c >> 2) & 0x1F, m = c & 3;
    if (e == 0x1F) return m ? u2f(TFTF_NAN_F32) : u2f(sign | 0x7F800000u);
    if (e == 0) return u2f(f2u((float)m * 1.52587890625e-05f) | sign);  // m · 2^-16
    return u2f(sign | ((e + 112) << 23) | (m << 21));
}

// 2^(c-127); 0x00 is 2^-127 (an f32 subnormal), 0xFF is NaN.
TFTF_HD float e8m0_to_f32(u8 c) {
    if (c == 0xFF) return u2f(TFTF_NAN_F32);
    return c == 0 ? u2f(0x00400000u) : u2f((u32)c << 23);
}

TFTF_HD bool e4m3_is_nan(u8 c) { return (c & 0x7F) == 0x7F; }
TFTF_HD bool e5m2_is_nonfinite(u8 c) { return (c & 0x7C) == 0x7C; }

// Scale element `i` of a scale tensor as f32.
TFTF_HD float scale_load(int dtype, const u8* s, u64 i) {
    switch (dtype) {
        case DT_F32: return u2f(TFTF_LOAD(u32, s, i));
        case DT_BF16: return bf16_to_f32(TFTF_LOAD(u16, s, i));
        case DT_F16: return f16_to_f32(TFTF_LOAD(u16, s, i));
        case DT_E8M0: return e8m0_to_f32(s[i]);
        default: return 1.0f;
    }
}

// Where each weight element finds its scale, for one chunk of whole rows (ScaleLayout in
// src/ops/dequant_fp8). Field order is the Rust `DequantParams` one.
struct DequantParams {
    u64 cols;           // elements per row
    u64 rows;           // rows per expert
    u64 block_rows, block_cols, grid_cols;
    u64 expert_stride;  // scale elements per expert, 0 for one scale overall
    u64 first_row;      // global row of the chunk's first row
    u64 scale_base;     // index of the chunk's first scale element in the scale tensor
    int scale_dtype;    // DT_F32 / DT_BF16 / DT_F16 / DT_E8M0 / DT_NONE
    int dst;            // DT_BF16 / DT_F16 / DT_F32
    int e5m2;
    int divide;
    int allow_nonfinite;
    int pad_;
};

// Whether element `i` of `out`, stored as `dst`, is finite (an overflow to infinity in the
// output dtype, a division by zero or 0/0 is not).
TFTF_HD bool stored_finite(int dst, const u8* out, u64 i) {
    if (dst == DT_F32) return is_finite_f32(u2f(TFTF_LOAD(u32, out, i)));
    u16 h = TFTF_LOAD(u16, out, i);
    return dst == DT_F16 ? (h & 0x7C00) != 0x7C00 : (h & 0x7F80) != 0x7F80;
}

// Element `i` of the chunk: writes it and returns false when it meets a value the op refuses
// without --allow-nonfinite (non-finite code or scale, or a result the output dtype cannot hold);
// the caller then lets the CPU op name it.
TFTF_HD bool dequant_element(const DequantParams& p, const u8* codes, const u8* scales, u8* out,
                             u64 i) {
    u64 k = i / p.cols, j = i - k * p.cols;
    u64 r = p.first_row + k;
    u64 e = r / p.rows, lr = r - e * p.rows;
    float s = 1.0f;
    if (p.scale_dtype != DT_NONE) {
        u64 at = e * p.expert_stride + lr / p.block_rows * p.grid_cols - p.scale_base +
                 j / p.block_cols;
        s = scale_load(p.scale_dtype, scales, at);
    }
    u8 c = codes[i];
    bool special = p.e5m2 ? e5m2_is_nonfinite(c) : e4m3_is_nan(c);
    if (!p.allow_nonfinite && (special || !is_finite_f32(s))) return false;
    float w = p.e5m2 ? e5m2_to_f32(c) : e4m3_to_f32(c);
    float v = p.divide ? w / s : w * s;
    if (is_nan_f32(v)) v = u2f(TFTF_NAN_F32);
    store_as(p.dst, out, i, v);
    return p.allow_nonfinite || stored_finite(p.dst, out, i);
}
