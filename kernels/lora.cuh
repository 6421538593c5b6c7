// LoRA/DoRA merge (src/ops/lora_merge.rs): Δ = B@A, W' = W + s·Δ, and for DoRA
// W'' = (m / ‖W'‖₂ per row) · W', rounded once to the output dtype.
//
// Δ is summed in a fixed order, rank index k = 0, 1, …, in f32, a multiply then an add per term
// (no fused multiply-add), on the CPU and the GPU alike: a library GEMM sums in an order of its
// own, and the same inputs would then give different bytes on different devices.
#pragma once
#include "cast.cuh"

// Δ[i][j] = Σ_k coef(g, k) · vec(g, k, j) for chunk row i, global row g = first_row + i, in
// group e = g / group_rows (an expert of a grouped merge; one group otherwise) at x = g mod
// group_rows: coef(g, k) = coef[x·ci + k·ck + e·cg], vec(g, k, j) = vecs[k·vk + j·vj + e·vg].
// Plain: B's rows times A. Conv1D / embeddings: A's columns times Bᵀ. Grouped experts: the
// expert's slices of A and B.
struct DeltaParams {
    u64 rank, cols;
    u64 ci, ck, cg;
    u64 vk, vj, vg;
    u64 first_row, group_rows;
};

TFTF_HD float lora_delta_element(const DeltaParams& d, const float* coef, const float* vecs,
                                 u64 i, u64 j) {
    u64 g = d.first_row + i;
    u64 e = g / d.group_rows, x = g - e * d.group_rows;
    const float* c = coef + x * d.ci + e * d.cg;
    const float* v = vecs + j * d.vj + e * d.vg;
    float acc = 0.0f;
    for (u64 k = 0; k < d.rank; k++) acc = acc + c[k * d.ck] * v[k * d.vk];
    return acc;
}

struct LoraParams {
    u64 cols;
    float scale;
    int base_dtype;  // any castable dtype, read as f32
    int dst;         // DT_BF16 / DT_F16 / DT_F32
    int dora;        // 1: multiply by the row factor
    int pad_;
};

TFTF_HD float lora_value(const LoraParams& p, const u8* base, const float* delta, u64 i) {
    return cast_load(p.base_dtype, DT_F32, base, i) + delta[i] * p.scale;
}

// DoRA: the factor m / ‖W + s·Δ‖₂ of row `row`, the norm summed in f64 in column order.
TFTF_HD float dora_row_factor(const LoraParams& p, const u8* base, const float* delta,
                              const float* magnitude, u64 row) {
    double sum = 0.0;
    for (u64 j = row * p.cols; j < (row + 1) * p.cols; j++) {
        double x = (double)lora_value(p, base, delta, j);
        sum = sum + x * x;
    }
    return magnitude[row] / (float)sqrt_f64(sum);
}

// Element `i` of the merged chunk; `factors` holds the DoRA row factors (unused for LoRA).
TFTF_HD void lora_element(const LoraParams& p, const u8* base, const float* delta,
                          const float* factors, u8* out, u64 i) {
    float x = lora_value(p, base, delta, i);
    if (p.dora) x = x * factors[i / p.cols];
    store_as(p.dst, out, i, x);
}
