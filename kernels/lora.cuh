// LoRA/DoRA merge epilogue (src/ops/lora_merge.rs): W' = W + s·Δ with Δ = B@A from the matrix
// product, and for DoRA W'' = (m / ‖W'‖₂ per row) · W', rounded once to the output dtype.
#pragma once
#include "cast.cuh"

TFTF_HD double sqrt_f64(double x) {
#ifdef __CUDA_ARCH__
    return __dsqrt_rn(x);
#else
    return __builtin_sqrt(x);
#endif
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
