// GGUF tensor encodings (src/ops/gguf/quant.rs, src/ops/gguf/produce.rs): output elements, Q8_0
// blocks or the blocks of kquant.cuh from source elements gathered through an optional unit map
// (the row permutations and splits of llama.cpp's converter), each rounded once.
#pragma once
#include "cast.cuh"
#include "iq_encode.cuh"
#include "kquant.cuh"

// ggml type ids (GgmlType::id), the output types these kernels write.
enum GgmlTypeId {
    GGML_F32 = 0,
    GGML_F16 = 1,
    GGML_Q8_0 = 8,
    GGML_BF16 = 30,
};

// `GgufParams` of src/plan/kernel/gguf.rs.
struct GgufParams {
    int src;   // TftfDtype of the source elements: DT_F32, DT_F16 or DT_BF16
    int ty;    // GgmlTypeId of the output
    u64 unit;  // elements per mapped unit; 0: output element e is source element e
    // Block types (kquant.cuh) only:
    u64 inner;        // elements per output row
    u64 weight_rows;  // output rows per row of importance weights (an expert's); 0: none
    u64 first_row;    // the chunk's first row, counted from the start of its first weight row
};

// Source index of output element `e`: unit `e / unit` comes from source unit `map[e / unit]`.
TFTF_HD u64 gguf_source(const GgufParams& p, const u32* map, u64 e) {
    if (p.unit == 0) return e;
    u64 u = e / p.unit;
    return (u64)map[u] * p.unit + (e - u * p.unit);
}

TFTF_HD float gguf_load(const GgufParams& p, const u8* in, const u32* map, u64 e) {
    return cast_load(p.src, DT_F32, in, gguf_source(p, map, e));
}

// round(x) half away from zero, saturated to i8, NaN → 0 (quant.rs `round_half_away`).
TFTF_HD signed char gguf_round_half_away(float x) {
    if (is_nan_f32(x)) return 0;
    if (x < -128.0f) x = -128.0f;
    if (x > 127.0f) x = 127.0f;
    int t = (int)x;
    float frac = x - (float)t;
    return (signed char)(t + (frac >= 0.5f ? 1 : 0) - (frac <= -0.5f ? 1 : 0));
}

// Q8_0 block `b` (34 bytes: f16 d, 32 i8) as quant.rs `quantize_q8_0_block`: the largest
// magnitude (NaNs never win), d = amax / 127, id = 1 / d (0 when d is 0), q = round(x * id).
TFTF_HD void gguf_q8_0_block(const GgufParams& p, const u8* in, const u32* map, u8* out, u64 b) {
    float x[32];
    float amax = 0.0f;
    for (int j = 0; j < 32; j++) {
        x[j] = gguf_load(p, in, map, b * 32 + j);
        float a = u2f(f2u(x[j]) & 0x7FFFFFFFu);
        if (a > amax) amax = a;
    }
    float d = amax / 127.0f;
    float id = d == 0.0f ? 0.0f : 1.0f / d;
    u16 h = f32_to_f16(d);
    u8* o = out + 34 * b;
    o[0] = (u8)(h & 0xFF);
    o[1] = (u8)(h >> 8);
    for (int j = 0; j < 32; j++) o[2 + j] = (u8)gguf_round_half_away(x[j] * id);
}

// Block `b` of a block type: its values, its columns' importance weights (the weight row of its
// output row's expert, as llama-quantize picks it), and for the legacy types Σx²/n of its row.
TFTF_HD void gguf_quant_block(const GgufParams& p, const u8* in, const u32* map,
                              const float* weights, const u8* tables, u8* out, u64 b) {
    float x[KQ_QK_K];
    u64 be = (u64)kq_block_elems(p.ty);
    u64 e0 = b * be;
    for (u64 j = 0; j < be; j++) x[j] = gguf_load(p, in, map, e0 + j);
    const float* qw = 0;
    float row_sigma2 = 0.0f;
    if (p.weight_rows != 0) {
        u64 row = e0 / p.inner;
        qw = weights + (p.first_row + row) / p.weight_rows * p.inner + (e0 - row * p.inner);
        if (be == 32 && p.ty != KQ_IQ4_NL) {
            float s = 0.0f;
            for (u64 j = row * p.inner; j < (row + 1) * p.inner; j++) {
                float v = gguf_load(p, in, map, j);
                s += v * v;
            }
            row_sigma2 = s / (float)p.inner;
        }
    }
    u8* y = out + b * (u64)kq_block_bytes(p.ty);
    if (!iq_encode_block(p.ty, x, qw, tables, y)) kq_encode_block(p.ty, x, qw, row_sigma2, y);
}

// Work item `i` of a chunk: a Q8_0 block, or one F32/F16/BF16 element.
TFTF_HD void gguf_item(const GgufParams& p, const u8* in, const u32* map, u8* out, u64 i) {
    if (p.ty == GGML_Q8_0) {
        gguf_q8_0_block(p, in, map, out, i);
        return;
    }
    int dst = p.ty == GGML_F16 ? DT_F16 : p.ty == GGML_BF16 ? DT_BF16 : DT_F32;
    if (dst == p.src) {  // moved unchanged: every bit kept, NaN payloads included
        u64 s = gguf_source(p, map, i);
        if (dst == DT_F32) TFTF_STORE(u32, out, i, TFTF_LOAD(u32, in, s));
        else TFTF_STORE(u16, out, i, TFTF_LOAD(u16, in, s));
        return;
    }
    store_as(dst, out, i, gguf_load(p, in, map, i));
}
