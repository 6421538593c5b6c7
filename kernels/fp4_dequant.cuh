// Packed FP4 (E2M1) dequantisation: NVFP4 and MXFP4 weights of compressed-tensors, ModelOpt and
// gpt-oss (src/ops/fp4/dequant.rs).
#pragma once
#include "fp4.cuh"

// One chunk of whole rows (or whole experts when transposing). Field order is the Rust
// `Fp4Params` one.
struct Fp4Params {
    u64 cols;             // elements per row (even)
    u64 rows;             // rows per expert
    u64 group;            // elements per block scale
    u64 groups;           // block scales per row
    int e8m0;             // block scales are E8M0 exponents (else E4M3)
    int global;           // 0: none, 1: divide by the tensor scale, 2: multiply
    int transpose;        // write each expert [in, out]
    int negative_zero;    // code 8 is -0 (else +0, ModelOpt's table)
    int dst;              // DT_BF16 / DT_F16 / DT_F32
    int allow_nonfinite;
};

// 2^(u-127) as torch computes `2.0 ** (u - 127)`: 255 is +inf (not NaN), 0 is 2^-127.
TFTF_HD float e8m0_pow2(u8 u) {
    if (u == 255) return u2f(0x7F800000u);
    return u == 0 ? u2f(0x00400000u) : u2f((u32)u << 23);
}

// Element `i` of the chunk, in input order: writes it and returns false when the op refuses it
// without --allow-nonfinite (a non-finite tensor scale or product); the caller then lets the
// CPU op name it.
TFTF_HD bool fp4_element(const Fp4Params& p, const u8* codes, const u8* scales,
                         const u8* global, u8* out, u64 i) {
    u64 k = i / p.cols, j = i - k * p.cols;
    u8 code = (codes[i / 2] >> (4 * (i % 2))) & 0x0F;
    float w = (code == 8 && !p.negative_zero) ? 0.0f : e2m1_to_f32(code);
    u8 b = scales[k * p.groups + j / p.group];
    float s = p.e8m0 ? e8m0_pow2(b) : e4m3_to_f32(b);
    if (p.global) {
        float g = u2f(TFTF_LOAD(u32, global, 0));
        if (!p.allow_nonfinite && !is_finite_f32(g)) return false;
        s = p.global == 1 ? s / g : s * g;
    }
    float v = w * s;
    if (!p.allow_nonfinite && !is_finite_f32(v)) return false;
    if (is_nan_f32(v)) v = u2f(TFTF_NAN_F32);
    u64 at = i;
    if (p.transpose) {
        u64 e = k / p.rows, lr = k - e * p.rows;
        at = e * p.cols * p.rows + j * p.rows + lr;
    }
    store_as(p.dst, out, at, v);
    return true;
}
