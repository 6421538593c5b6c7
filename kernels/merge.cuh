// The elementwise merges (src/ops/merge/op.rs, methods/linear.rs, methods/task_arithmetic.rs):
// every model's element widened to f64 (rounded first to mergekit's `dtype` where that loses
// bits), summed in model order from 0.0 — a multiply, then an add — and rounded once to the
// output dtype. NaN results are the one positive quiet NaN, on every device.
#pragma once
#include "cast.cuh"

#define MERGE_MAX_INPUTS 16

enum MergeMethod {
    MERGE_LINEAR = 0,  // Σ w_k x_k / denominator
    MERGE_TASK = 1,    // x_0 + scale · Σ_{k≥1} w_k (x_k − x_0)
};

// `MergeParams` of src/plan/kernel/merge.rs.
struct MergeParams {
    int method;  // MergeMethod
    int n;       // inputs (task arithmetic: the base first)
    int dst;     // TftfDtype of the output: F64, F32, F16 or BF16
    int pad;
    int dtypes[MERGE_MAX_INPUTS];    // TftfDtype of each input: F64, F32, F16 or BF16
    int round[MERGE_MAX_INPUTS];     // TftfDtype each input is rounded to first, or DT_NONE
    u64 offsets[MERGE_MAX_INPUTS];   // byte offset of each input in the joined buffer
    double weights[MERGE_MAX_INPUTS];  // linear: input k's; task arithmetic: model k's at k
    double denominator;
    double scale;
};

// x rounded to `dtype` and widened back, as a cast there and back would (op.rs `round_to`).
TFTF_HD double merge_round(int dtype, double x) {
    switch (dtype) {
        case DT_F32: return (double)f64_to_f32_rne(x);
        case DT_BF16: return (double)bf16_to_f32(f32_to_bf16(f64_to_f32_odd(x)));
        case DT_F16: return (double)f16_to_f32(f32_to_f16(f64_to_f32_odd(x)));
        default: return x;
    }
}

TFTF_HD double merge_load(const MergeParams& p, const u8* in, int k, u64 i) {
    const u8* at = in + p.offsets[k];
    double x = p.dtypes[k] == DT_F64 ? u2d(TFTF_LOAD(u64, at, i))
                                     : (double)cast_load(p.dtypes[k], DT_F32, at, i);
    return p.round[k] == DT_NONE ? x : merge_round(p.round[k], x);
}

// Element i of the merged chunk, stored as p.dst.
TFTF_HD void merge_element(const MergeParams& p, const u8* in, u8* out, u64 i) {
    double o = 0.0;
    if (p.method == MERGE_LINEAR) {
        for (int k = 0; k < p.n; k++) o += p.weights[k] * merge_load(p, in, k, i);
        o /= p.denominator;
    } else {
        double b = merge_load(p, in, 0, i);
        for (int k = 1; k < p.n; k++) o += p.weights[k] * (merge_load(p, in, k, i) - b);
        o = b + p.scale * o;
    }
    if (o != o) o = u2d(0x7FF8000000000000ull);
    switch (p.dst) {
        case DT_F64: TFTF_STORE(u64, out, i, d2u(o)); break;
        case DT_F32: TFTF_STORE(u32, out, i, f2u(f64_to_f32_rne(o))); break;
        default: store_as(p.dst, out, i, f64_to_f32_odd(o));
    }
}
