// The CUDA kernels of tftf. Each is a grid-stride loop over the elements (or blocks, or rows)
// of one chunk, calling the per-element arithmetic in the .cuh headers, which the test suite
// also compiles for the host and compares bit for bit with the Rust ops. These ops are
// memory-bound, so there is no shared-memory tiling; a kernel that meets a value its op refuses
// raises `bad` and the host lets the CPU op produce the error message.
#include "fp4_dequant.cuh"
#include "gguf.cuh"
#include "int.cuh"
#include "lora.cuh"
#include "merge.cuh"
#include "quantize.cuh"

#define GRID_STRIDE(i, n)                                                             \
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < (n);                 \
         i += (u64)blockDim.x * gridDim.x)

extern "C" __global__ void tftf_cast(const u8* in, u8* out, u64 n, int src, int dst) {
    GRID_STRIDE(i, n) { cast_element(src, dst, in, out, i); }
}

// GGUF encodings: one thread per output element, or per Q8_0 block.
extern "C" __global__ void tftf_gguf(const u8* in, const u32* map, u8* out, u64 n, GgufParams p) {
    GRID_STRIDE(i, n) { gguf_item(p, in, map, out, i); }
}

// GGUF block types of kquant.cuh: one thread per block. A kernel of its own, so that the
// encoders' registers and stack do not weigh on the element kernel's occupancy.
extern "C" __global__ void tftf_gguf_blocks(const u8* in, const u32* map, const float* weights,
                                            const u8* tables, u8* out, u64 n, GgufParams p) {
    GRID_STRIDE(b, n) { gguf_quant_block(p, in, map, weights, tables, out, b); }
}

extern "C" __global__ void tftf_dequant_fp8(const u8* codes, const u8* scales, u8* out, u64 n,
                                            DequantParams p, int* bad) {
    GRID_STRIDE(i, n) {
        if (!dequant_element(p, codes, scales, out, i)) *bad = 1;
    }
}

extern "C" __global__ void tftf_dequant_fp4(const u8* codes, const u8* scales, const u8* global,
                                            u8* out, u64 n, Fp4Params p, int* bad) {
    GRID_STRIDE(i, n) {
        if (!fp4_element(p, codes, scales, global, out, i)) *bad = 1;
    }
}

extern "C" __global__ void tftf_dequant_int(const u8* packed, const u8* scales, const u8* zp,
                                            u8* out, u64 n, IntParams p) {
    GRID_STRIDE(i, n) { int_element(p, packed, scales, zp, out, i); }
}

extern "C" __global__ void tftf_dequant_gptq(const u8* qweight, const u8* qzeros,
                                             const u8* scales, const u8* g_idx, u8* out, u64 n,
                                             GptqParams p, int* bad) {
    GRID_STRIDE(i, n) {
        if (!gptq_element(p, qweight, qzeros, scales, g_idx, out, i)) *bad = 1;
    }
}

extern "C" __global__ void tftf_dequant_int4_modelopt(const u8* codes, const u8* scales, u8* out,
                                                      u64 n, Int4Params p, int* bad) {
    GRID_STRIDE(i, n) {
        if (!int4_modelopt_element(p, codes, scales, out, i)) *bad = 1;
    }
}

extern "C" __global__ void tftf_nv_block_scales(const u8* in, u8* out, u64 n, int g, int* bad) {
    GRID_STRIDE(i, n) {
        u8 c = in[i];
        if (c == 0xFF) *bad = 1;
        bool exact;
        u8 code = nv_block_scale_code((int)c - 127, g, &exact);
        out[2 * i] = code;
        out[2 * i + 1] = code;
    }
}

extern "C" __global__ void tftf_nv_reencode(const u8* packed, const u8* scales, u8* out,
                                            u64 blocks, int g) {
    GRID_STRIDE(b, blocks) { nv_reencode_block(packed + 16 * b, scales[b], g, out + 16 * b); }
}

extern "C" __global__ void tftf_engram_blocks(const u8* codes, const u8* scales, u8* packed,
                                              u8* new_scales, BlockSums* sums, u64 blocks,
                                              int* bad, unsigned long long* clamped) {
    GRID_STRIDE(b, blocks) {
        int status = engram_block(codes + 32 * b, scales[b], packed + 16 * b, new_scales + b,
                                  sums + b);
        if (status == ENGRAM_ERROR) *bad = 1;
        if (status == ENGRAM_CLAMPED) atomicAdd(clamped, 1ull);
    }
}

extern "C" __global__ void tftf_engram_rows(const BlockSums* sums, RowSums* rows, u64 n,
                                            u64 blocks_per_row) {
    GRID_STRIDE(r, n) {
        RowSums acc = {0.0, 0.0, 0.0, 0.0};
        for (u64 b = r * blocks_per_row; b < (r + 1) * blocks_per_row; b++)
            engram_row_add(&acc, sums[b]);
        rows[r] = acc;
    }
}

extern "C" __global__ void tftf_lora_delta(const float* coef, const float* vecs, float* delta,
                                           u64 n, DeltaParams d) {
    GRID_STRIDE(e, n) {
        u64 i = e / d.cols, j = e - i * d.cols;
        delta[e] = lora_delta_element(d, coef, vecs, i, j);
    }
}

extern "C" __global__ void tftf_dora_factors(const u8* base, const float* delta,
                                             const float* magnitude, float* factors, u64 rows,
                                             LoraParams p) {
    GRID_STRIDE(r, rows) { factors[r] = dora_row_factor(p, base, delta, magnitude, r); }
}

extern "C" __global__ void tftf_lora(const u8* base, const float* delta, const float* factors,
                                     u8* out, u64 n, LoraParams p) {
    GRID_STRIDE(i, n) { lora_element(p, base, delta, factors, out, i); }
}

// Grouped quantisers (W8A16, W4A16, NVFP4, MXFP4, MXFP8): one thread per group of a row.
extern "C" __global__ void tftf_quantize_groups(const u8* in, u8* codes, u8* scales, u64 n,
                                                QuantParams p, int* bad) {
    GRID_STRIDE(g, n) {
        if (!quant_group_encode(p, in, codes, scales, g)) *bad = 1;
    }
}

// FP8_DYNAMIC, FP8_BLOCK, pass 1: each segment's amax into its target's (`amax` zeroed).
extern "C" __global__ void tftf_quantize_fp8_amax(const u8* in, u32* amax, u64 n, QuantParams p,
                                                  int* bad) {
    GRID_STRIDE(seg, n) {
        u64 t;
        u32 m;
        if (!quant_fp8_segment(p, in, seg, &t, &m)) *bad = 1;
        atomicMax(amax + t, m);
    }
}

// Pass 2: each target's scale, its amax replaced by the encoder's factor.
extern "C" __global__ void tftf_quantize_fp8_scales(u32* amax, u8* scales, u64 n,
                                                    QuantParams p, int* bad) {
    GRID_STRIDE(t, n) {
        float m = u2f(amax[t]);
        if (quant_block_overflows(p, m)) *bad = 1;
        amax[t] = f2u(quant_fp8_scale(p, m, scales, t));
    }
}

// Pass 3: the codes.
extern "C" __global__ void tftf_quantize_fp8_codes(const u8* in, const u32* factors, u8* codes,
                                                   u64 n, QuantParams p) {
    GRID_STRIDE(i, n) { codes[i] = quant_fp8_code(p, in, factors, i); }
}

// Elementwise merges (linear, task arithmetic) and surveyed slerp/nuslerp blends: one thread
// per element.
extern "C" __global__ void tftf_merge(const u8* in, const double* coefs, u8* out, u64 n,
                                      MergeParams p) {
    GRID_STRIDE(i, n) { merge_element(p, in, coefs, out, i); }
}
