// Packed-integer dequantisation: compressed-tensors pack-quantized, symmetric or with packed
// zero points (src/ops/int/mod.rs); GPTQ (src/ops/int/gptq.rs); ModelOpt INT4
// (src/ops/int/modelopt.rs).
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

// GPTQ, the whole tensor. Field order is the Rust `GptqParams` one.
struct GptqParams {
    u64 rows;        // outputs (rows of the result)
    u64 cols;        // inputs (columns of the result)
    u64 groups;      // scale/zero groups
    u64 group_size;  // inputs per group, 0 when `g_idx` gives each input's group
    int bits;        // 2, 4 or 8
    int scale_dtype; // DT_F16 / DT_BF16 / DT_F32
    int dst;         // DT_BF16 / DT_F16 / DT_F32
    int zero_offset; // 1 when zeros are stored minus one (v1 format)
};

// Element `i` of the result, `W[o][c] = scales[g][o] · (q(c, o) - zero(g, o))`: codes packed along
// the input dimension of `qweight [in/p, out]`, zeros along the output one of `qzeros [G, out/p]`.
// Returns false for a `g_idx` entry outside the groups (the CPU op names it).
TFTF_HD bool gptq_element(const GptqParams& p, const u8* qweight, const u8* qzeros,
                          const u8* scales, const u8* g_idx, u8* out, u64 i) {
    u64 o = i / p.cols, c = i - o * p.cols;
    u64 per_word = 32 / (u64)p.bits;
    u32 mask = (1u << p.bits) - 1u;
    u64 g;
    if (p.group_size != 0) {
        g = c / p.group_size;
    } else {
        int gi = (int)TFTF_LOAD(u32, g_idx, c);
        if (gi < 0 || (u64)gi >= p.groups) return false;
        g = (u64)gi;
    }
    u32 q = TFTF_LOAD(u32, qweight, (c / per_word) * p.rows + o) >> ((c % per_word) * p.bits) & mask;
    u32 z = TFTF_LOAD(u32, qzeros, g * (p.rows / per_word) + o / per_word) >>
                ((o % per_word) * p.bits) & mask;
    float s = scale_load(p.scale_dtype, scales, g * p.rows + o);
    store_as(p.dst, out, i, s * (float)((int)q - ((int)z + p.zero_offset)));
    return true;
}

// ModelOpt INT4, a chunk of whole packed rows. Field order is the Rust `Int4Params` one.
struct Int4Params {
    u64 cols;   // elements per weight row (bytes per packed row)
    u64 group;  // elements per F32 scale
    u64 groups; // scales per weight row
    int dst;    // DT_BF16 / DT_F16 / DT_F32
    int pad;
};

// Element `i` of the chunk's weight rows: row 2k's code is the low nibble of packed row k, row
// 2k+1's the high one, two's complement; times its group's F32 scale. Returns false when the
// product is not finite (the CPU op names the scale).
TFTF_HD bool int4_modelopt_element(const Int4Params& p, const u8* codes, const u8* scales,
                                   u8* out, u64 i) {
    u64 r = i / p.cols, c = i - r * p.cols;
    u32 nib = (u32)(codes[(r / 2) * p.cols + c] >> (4 * (r % 2))) & 0x0Fu;
    int q = nib >= 8 ? (int)nib - 16 : (int)nib;
    float v = (float)q * u2f(TFTF_LOAD(u32, scales, r * p.groups + c / p.group));
    store_as(p.dst, out, i, v);
    return is_finite_f32(v);
}
