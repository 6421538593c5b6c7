// Packed-integer dequantisation: compressed-tensors pack-quantized, symmetric or with packed
// zero points (src/ops/int/mod.rs).
#pragma once
#include "fp8.cuh"

// One chunk of whole rows. Field order is the Rust `IntParams` one.
struct IntParams {
    u64 cols;         // elements per row
    u64 words;        // I32 words per row of codes
    u64 group;        // elements per scale
    u64 groups;       // scales (and zero points) per row
    int bits;         // 1..8
    int scale_dtype;  // DT_F32 / DT_BF16 / DT_F16
    int dst;          // DT_BF16 / DT_F16 / DT_F32
    int zero_point;   // whether `zp` holds the chunk's packed zero-point word rows
};

// Element `i` of a little-endian bitstream of `bits`-bit codes. A code spans at most two bytes;
// the second is read only when it does, so the stream's last byte is never overrun.
TFTF_HD u32 int_code(const u8* stream, u64 i, int bits) {
    u64 bit = i * (u64)bits;
    u64 byte = bit / 8;
    u32 off = (u32)(bit % 8);
    u32 v = stream[byte];
    if (off + (u32)bits > 8) v |= (u32)stream[byte + 1] << 8;
    return (v >> off) & ((1u << bits) - 1u);
}

// Zero point of chunk row `k`, group `g`: column `g` of the word rows is one bitstream.
TFTF_HD u32 int_zero_point(const IntParams& p, const u8* zp, u64 k, u64 g) {
    u64 bit = k * (u64)p.bits;
    u64 w = bit / 32;
    u32 off = (u32)(bit % 32);
    u64 v = TFTF_LOAD(u32, zp, w * p.groups + g);
    if (off + (u32)p.bits > 32) v |= (u64)TFTF_LOAD(u32, zp, (w + 1) * p.groups + g) << 32;
    return (u32)(v >> off) & ((1u << p.bits) - 1u);
}

// Element `i` of the chunk: `(q - zp) · scale`, rounded once to `dst` (zp = 2^(b-1) when
// symmetric: the stored offset).
TFTF_HD void int_element(const IntParams& p, const u8* packed, const u8* scales, const u8* zp,
                         u8* out, u64 i) {
    u64 k = i / p.cols, j = i - k * p.cols;
    u64 g = j / p.group;
    int q = (int)int_code(packed + k * p.words * 4, j, p.bits);
    int z = p.zero_point ? (int)int_zero_point(p, zp, k, g) : 1 << (p.bits - 1);
    float s = scale_load(p.scale_dtype, scales, k * p.groups + g);
    store_as(p.dst, out, i, (float)(q - z) * s);
}
