// E2M1 (FP4): the Engram requantisation E4M3 → E2M1 (src/ops/fp4.rs) and the MXFP4 → NVFP4
// block-scale transcode (src/ops/nvfp4.rs).
#pragma once
#include "fp8.cuh"

TFTF_HD float e2m1_to_f32(u8 code) {
    const float v[8] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};
    float a = v[code & 7];
    return (code & 8) ? -a : a;
}

// Nearest code of a finite f32, ties to the even code, saturating at ±6.
TFTF_HD u8 f32_to_e2m1(float x) {
    float a = u2f(f2u(x) & 0x7FFFFFFFu);
    u8 idx = (u8)((a > 0.25f) + (a >= 0.75f) + (a > 1.25f) + (a >= 1.75f) + (a > 2.5f) +
                  (a >= 3.5f) + (a > 5.0f));
    return idx | (u8)((f2u(x) >> 28) & 8);
}

// The same rounding for an f64 (re-encoding under a changed block scale).
TFTF_HD u8 f64_to_e2m1(double x) {
    u8 sign = (d2u(x) >> 63) ? 8 : 0;
    double a = u2d(d2u(x) & 0x7FFFFFFFFFFFFFFFull);
    u8 idx = (u8)((a > 0.25) + (a >= 0.75) + (a > 1.25) + (a >= 1.75) + (a > 2.5) + (a >= 3.5) +
                  (a > 5.0));
    return sign | idx;
}

// Smallest p with 6 · 2^p ≥ amax (amax > 0, finite, normal).
TFTF_HD int fp4_scale_exponent(double amax) {
    int q = (int)((d2u(amax) >> 52) & 0x7FF) - 1023;
    int p = q - 2;
    while (6.0 * pow2_f64(p) < amax) p += 1;
    while (6.0 * pow2_f64(p - 1) >= amax) p -= 1;
    return p;
}

// Per-block sums of the requantisation quality, in f32 as the CPU op adds them.
struct BlockSums {
    float dot, xx, yy;
    int p;  // new scale exponent
};

enum EngramStatus { ENGRAM_OK = 0, ENGRAM_CLAMPED = 1, ENGRAM_ERROR = 2 };

// One 32-element block: `codes` (32 E4M3) under E8M0 scale `e` → 16 packed E2M1 bytes and the
// new E8M0 scale. Returns ENGRAM_ERROR for a NaN code or scale or a scale beyond 2^127 (the CPU
// op then names it), ENGRAM_CLAMPED when the scale was raised to 2^-127.
TFTF_HD int engram_block(const u8* codes, u8 e, u8* packed, u8* new_scale, BlockSums* sums) {
    if (e == 0xFF) return ENGRAM_ERROR;
    // E4M3 magnitudes order like their codes and 0x7F is the only NaN magnitude: one byte max
    // gives the NaN check and max|v| (as the CPU op does).
    u8 top = 0;
    for (int i = 0; i < 32; i++) {
        u8 a = codes[i] & 0x7F;
        top = a > top ? a : top;
    }
    if (top == 0x7F) return ENGRAM_ERROR;
    float m = e4m3_to_f32(top);
    double amax = (double)m * pow2_f64((int)e - 127);
    int p = amax == 0.0 ? -127 : fp4_scale_exponent(amax);
    if (p > 127) return ENGRAM_ERROR;
    int status = ENGRAM_OK;
    if (p < -127) {
        p = -127;
        status = ENGRAM_CLAMPED;
    }
    *new_scale = (u8)(p + 127);
    // An all-zero block keeps its signed zeros; 2^(e-127-p) would overflow f32 for e >= 128
    // (0 · ∞ = NaN).
    float rel = m == 0.0f ? 1.0f : (float)pow2_f64((int)e - 127 - p);
    float bdot = 0.0f, bxx = 0.0f, byy = 0.0f;
    for (int i = 0; i < 16; i++) {
        float x0 = e4m3_to_f32(codes[2 * i]) * rel;
        float x1 = e4m3_to_f32(codes[2 * i + 1]) * rel;
        u8 q0 = f32_to_e2m1(x0), q1 = f32_to_e2m1(x1);
        packed[i] = (u8)(q0 | (q1 << 4));
        float y0 = e2m1_to_f32(q0), y1 = e2m1_to_f32(q1);
        bdot = bdot + (x0 * y0 + x1 * y1);
        bxx = bxx + (x0 * x0 + x1 * x1);
        byy = byy + (y0 * y0 + y1 * y1);
    }
    sums->dot = bdot;
    sums->xx = bxx;
    sums->yy = byy;
    sums->p = p;
    return status;
}

// Per-row sums in f64, blocks taken in order (EngramRequant's row loop).
struct RowSums {
    double dot, xx, yy, sq_err;
};

TFTF_HD void engram_row_add(RowSums* row, const BlockSums& b) {
    double s2 = pow2_f64(2 * b.p);
    row->dot = row->dot + (double)b.dot * s2;
    row->xx = row->xx + (double)b.xx * s2;
    row->yy = row->yy + (double)b.yy * s2;
    double err = (double)b.xx - 2.0 * (double)b.dot + (double)b.yy;
    row->sq_err = row->sq_err + (err > 0.0 ? err : 0.0) * s2;
}

// NVFP4 block scale for MXFP4 exponent k under tensor exponent g: the E4M3 code of 2^(k-g) when
// it lies in [2^-9, 2^8] (exact), else the nearest end of that window (not exact).
TFTF_HD u8 nv_block_scale_code(int k, int g, bool* exact) {
    int d = k - g;
    *exact = d >= -9 && d <= 8;
    if (d > 8) return 0x7E;
    if (d < -9) return 0x01;
    return d >= -6 ? (u8)((d + 7) << 3) : (u8)(1 << (d + 9));
}

// One MXFP4 block (16 packed bytes, E8M0 scale `c`) re-encoded under its NVFP4 block scale.
TFTF_HD void nv_reencode_block(const u8* packed, u8 c, int g, u8* out) {
    int k = (int)c - 127;
    bool exact;
    u8 code = nv_block_scale_code(k, g, &exact);
    bool zero = true;
    for (int i = 0; i < 16; i++) zero = zero && (packed[i] & 0x77) == 0;
    if (exact || zero) {
        for (int i = 0; i < 16; i++) out[i] = packed[i];
        return;
    }
    double rel = pow2_f64(k - g) / (double)e4m3_to_f32(code);
    for (int i = 0; i < 16; i++) {
        u8 lo = f64_to_e2m1((double)e2m1_to_f32(packed[i] & 0x0F) * rel);
        u8 hi = f64_to_e2m1((double)e2m1_to_f32(packed[i] >> 4) * rel);
        out[i] = (u8)(lo | (hi << 4));
    }
}
