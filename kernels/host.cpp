// Host build of the kernels' arithmetic for the test suite (tests/kernels.rs): the same .cuh
// functions the CUDA kernels call, looped over the same indices, behind a C ABI.
#include "fp4_dequant.cuh"
#include "gguf.cuh"
#include "int.cuh"
#include "lora.cuh"
#include "merge.cuh"
#include "quantize.cuh"

extern "C" {

void tftf_host_cast(const u8* in, u8* out, u64 n, int src, int dst) {
    for (u64 i = 0; i < n; i++) cast_element(src, dst, in, out, i);
}

void tftf_host_gguf(const u8* in, const u32* map, const float* weights, const u8* tables, u8* out,
                    u64 n, const GgufParams* p) {
    for (u64 i = 0; i < n; i++) {
        if (kq_block_elems(p->ty) != 0) gguf_quant_block(*p, in, map, weights, tables, out, i);
        else gguf_item(*p, in, map, out, i);
    }
}

int tftf_host_dequant_fp8(const u8* codes, const u8* scales, u8* out, u64 n,
                          const DequantParams* p) {
    int ok = 1;
    for (u64 i = 0; i < n; i++) ok &= dequant_element(*p, codes, scales, out, i) ? 1 : 0;
    return ok;
}

int tftf_host_dequant_fp4(const u8* codes, const u8* scales, const u8* global, u8* out, u64 n,
                          const Fp4Params* p) {
    int ok = 1;
    for (u64 i = 0; i < n; i++) ok &= fp4_element(*p, codes, scales, global, out, i) ? 1 : 0;
    return ok;
}

void tftf_host_dequant_int(const u8* packed, const u8* scales, const u8* zp, u8* out, u64 n,
                           const IntParams* p) {
    for (u64 i = 0; i < n; i++) int_element(*p, packed, scales, zp, out, i);
}

int tftf_host_dequant_gptq(const u8* qweight, const u8* qzeros, const u8* scales,
                           const u8* g_idx, u8* out, u64 n, const GptqParams* p) {
    int ok = 1;
    for (u64 i = 0; i < n; i++)
        ok &= gptq_element(*p, qweight, qzeros, scales, g_idx, out, i) ? 1 : 0;
    return ok;
}

int tftf_host_dequant_int4_modelopt(const u8* codes, const u8* scales, u8* out, u64 n,
                                    const Int4Params* p) {
    int ok = 1;
    for (u64 i = 0; i < n; i++) ok &= int4_modelopt_element(*p, codes, scales, out, i) ? 1 : 0;
    return ok;
}

int tftf_host_nv_block_scales(const u8* in, u8* out, u64 n, int g) {
    int ok = 1;
    for (u64 i = 0; i < n; i++) {
        if (in[i] == 0xFF) ok = 0;
        bool exact;
        u8 code = nv_block_scale_code((int)in[i] - 127, g, &exact);
        out[2 * i] = code;
        out[2 * i + 1] = code;
    }
    return ok;
}

void tftf_host_nv_reencode(const u8* packed, const u8* scales, u8* out, u64 blocks, int g) {
    for (u64 b = 0; b < blocks; b++)
        nv_reencode_block(packed + 16 * b, scales[b], g, out + 16 * b);
}

// Returns 0 on a refused value; fills per-row sums and the count of clamped blocks.
int tftf_host_engram(const u8* codes, const u8* scales, u8* packed, u8* new_scales, u64 rows,
                     u64 cols, RowSums* row_sums, u64* clamped) {
    u64 per_row = cols / 32;
    *clamped = 0;
    for (u64 r = 0; r < rows; r++) {
        RowSums acc = {0.0, 0.0, 0.0, 0.0};
        for (u64 b = r * per_row; b < (r + 1) * per_row; b++) {
            BlockSums s;
            int status =
                engram_block(codes + 32 * b, scales[b], packed + 16 * b, new_scales + b, &s);
            if (status == ENGRAM_ERROR) return 0;
            if (status == ENGRAM_CLAMPED) *clamped += 1;
            engram_row_add(&acc, s);
        }
        row_sums[r] = acc;
    }
    return 1;
}

void tftf_host_lora_delta(const float* coef, const float* vecs, float* delta, u64 rows,
                          const DeltaParams* d) {
    for (u64 e = 0; e < rows * d->cols; e++)
        delta[e] = lora_delta_element(*d, coef, vecs, e / d->cols, e % d->cols);
}

void tftf_host_lora(const u8* base, const float* delta, const float* magnitude, u8* out, u64 rows,
                    const LoraParams* p) {
    float* factors = new float[rows];
    for (u64 r = 0; r < rows && p->dora; r++)
        factors[r] = dora_row_factor(*p, base, delta, magnitude, r);
    for (u64 i = 0; i < rows * p->cols; i++) lora_element(*p, base, delta, factors, out, i);
    delete[] factors;
}

void tftf_host_merge(const u8* in, const double* coefs, u8* out, u64 n, const MergeParams* p) {
    for (u64 i = 0; i < n; i++) merge_element(*p, in, coefs, out, i);
}

int tftf_host_modelopt_mx_exponent(float amax, float elem_max) {
    return quant_modelopt_mx_exponent(amax, elem_max);
}

// The quantisers over a chunk (`p->rows` rows): codes and scales as the CUDA kernels write them,
// groups, segments, targets and elements taken in turn. Returns 0 when the weight holds a
// non-finite value.
int tftf_host_quantize(const u8* in, u8* codes, u8* scales, const QuantParams* p) {
    int ok = 1;
    if (p->scheme == QS_FP8_DYNAMIC || p->scheme == QS_FP8_BLOCK) {
        u64 targets = quant_fp8_targets(*p);
        u32* amax = new u32[targets];
        for (u64 t = 0; t < targets; t++) amax[t] = 0;
        for (u64 seg = 0; seg < quant_fp8_segments(*p); seg++) {
            u64 t;
            u32 m;
            if (!quant_fp8_segment(*p, in, seg, &t, &m)) ok = 0;
            amax[t] = m > amax[t] ? m : amax[t];
        }
        for (u64 t = 0; t < targets; t++) {
            if (quant_block_overflows(*p, u2f(amax[t]))) ok = 0;
            amax[t] = f2u(quant_fp8_scale(*p, u2f(amax[t]), scales, t));
        }
        for (u64 i = 0; i < p->rows * p->cols; i++) codes[i] = quant_fp8_code(*p, in, amax, i);
        delete[] amax;
    } else {
        u64 n = quant_group_threads(*p);
        for (u64 g = 0; g < n; g++) ok &= quant_group_encode(*p, in, codes, scales, g) ? 1 : 0;
    }
    return ok;
}
}
