// The elementwise merges (src/ops/merge/op.rs, methods/linear.rs, methods/task_arithmetic.rs):
// every model's element widened to f64 (rounded first to mergekit's `dtype` where that loses
// bits), summed in model order from 0.0 — a multiply, then an add — and rounded once to the
// output dtype. And the blend of a surveyed slerp or nuslerp tensor (methods/slerp.rs): f32
// inputs, the survey's coefficients, an f32 result then stored as the output dtype. NaN
// results are the one positive quiet NaN, on every device.
#pragma once
#include "cast.cuh"

#define MERGE_MAX_INPUTS 16

enum MergeMethod {
    MERGE_LINEAR = 0,   // Σ w_k x_k / denominator
    MERGE_TASK = 1,     // x_0 + scale · Σ_{k≥1} w_k (x_k − x_0)
    MERGE_SLERP = 2,    // ca · x_0 + cb · x_1
    MERGE_NUSLERP = 3,  // back + ca · (a − back) + cb · (b − back), back the base or 0
    MERGE_MULTISLERP = 4,  // the exponential map of the weighted tangent at the models' mean
    MERGE_MODEL_STOCK = 5,  // t · mean(models) + (1 − t) · base
    MERGE_KARCHER = 6,      // Σ c_j · model_j over the kept models
    MERGE_NEARSWAP = 7,     // w · model + (1 − w) · base, w = clamp(t / max(|base − model|, 1e-6))
    MERGE_RAM = 8,          // base + Σ each model's task vector, rescaled by how many change
    MERGE_FUSION = 9,       // the model's element where its importance reaches the threshold
    MERGE_SPARSE = 10,      // TIES, breadcrumbs, DARE, DELLA: survivors rescaled, weighted, elected
    MERGE_SCE = 11,         // the elements of largest variance, sign-elected, weighted
};

// `MergeParams` of src/plan/kernel/merge.rs.
struct MergeParams {
    int method;  // MergeMethod
    int n;       // inputs (task arithmetic: the base first)
    int dst;     // TftfDtype of the output: F64, F32, F16 or BF16
    int has_base;  // MERGE_NUSLERP, MERGE_MULTISLERP: input 0 is the base
    int dtypes[MERGE_MAX_INPUTS];    // TftfDtype of each input: F64, F32, F16 or BF16
    int round[MERGE_MAX_INPUTS];     // TftfDtype each input is rounded to first, or DT_NONE
    u64 offsets[MERGE_MAX_INPUTS];   // byte offset of each input in the joined buffer
    double weights[MERGE_MAX_INPUTS];  // linear: input k's; task arithmetic: model k's at k
    double denominator;
    double scale;
    u64 inner;  // MERGE_SLERP/NUSLERP: (ca, cb) pairs in `coefs`, element i taking i mod inner;
                // MERGE_KARCHER: (model, coefficient) pairs; MERGE_SPARSE, MERGE_SCE: the
                // chunk's first element
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

// Input k's element i as a surveyed merge reads it: an f32 (rounded to mergekit's `dtype`).
TFTF_HD double merge_load_f32(const MergeParams& p, const u8* in, int k, u64 i) {
    float v = cast_load(p.dtypes[k], DT_F32, in + p.offsets[k], i);
    if (p.round[k] != DT_NONE) v = f64_to_f32_rne(merge_round(p.round[k], (double)v));
    return (double)v;
}

// Stores a surveyed merge's f32 result as p.dst (a NaN as the one positive quiet NaN).
TFTF_HD void merge_store_f32(const MergeParams& p, u8* out, u64 i, float f) {
    if (f != f) f = u2f(TFTF_NAN_F32);
    if (p.dst == DT_F64) TFTF_STORE(u64, out, i, d2u((double)f));
    else store_as(p.dst, out, i, f);
}

// Element i of a surveyed slerp/nuslerp chunk, stored as p.dst.
TFTF_HD void merge_blend(const MergeParams& p, const u8* in, const double* coefs, u8* out,
                         u64 i) {
    u64 c = 2 * (i % p.inner);
    double ca = coefs[c], cb = coefs[c + 1], o;
    if (p.method == MERGE_SLERP) {
        o = ca * merge_load_f32(p, in, 0, i) + cb * merge_load_f32(p, in, 1, i);
    } else {
        int first = p.has_base ? 1 : 0;
        double back = p.has_base ? merge_load_f32(p, in, 0, i) : 0.0;
        double a = merge_load_f32(p, in, first, i) - back;
        double b = merge_load_f32(p, in, first + 1, i) - back;
        o = back + ca * a + cb * b;
    }
    merge_store_f32(p, out, i, f64_to_f32_rne(o));
}

// The surveyed multislerp of element i (methods/slerp.rs `MultislerpSurvey::merge`): `coefs`
// holds each model's mean factor, weight, norm + eps and dot product, then the mean's length,
// cos and sinc factors, and whether two models average linearly. Sums start from their first
// term, as Rust's float sums (from −0.0) do.
TFTF_HD void merge_multislerp(const MergeParams& p, const u8* in, const double* coefs, u8* out,
                              u64 i) {
    int first = p.has_base ? 1 : 0, nm = p.n - first;
    const double* scale = coefs;
    const double* w = coefs + nm;
    const double* norm_eps = coefs + 2 * nm;
    const double* dots = coefs + 3 * nm;
    double mean_norm = coefs[4 * nm], cos_f = coefs[4 * nm + 1], sinc = coefs[4 * nm + 2];
    double back = p.has_base ? merge_load_f32(p, in, 0, i) : 0.0;
    double o;
    if (coefs[4 * nm + 3] != 0.0) {
        double a = merge_load_f32(p, in, first, i) - back;
        double b = merge_load_f32(p, in, first + 1, i) - back;
        o = w[0] * a + w[1] * b + back;
    } else {
        double mean = 0.0, tangent = 0.0;
        for (int m = 0; m < nm; m++) {
            double t = scale[m] * (merge_load_f32(p, in, first + m, i) - back);
            mean = m == 0 ? t : mean + t;
        }
        double mk = mean / mean_norm;
        for (int m = 0; m < nm; m++) {
            double unit = (merge_load_f32(p, in, first + m, i) - back) / norm_eps[m];
            double t = w[m] * (unit - dots[m] * mk);
            tangent = m == 0 ? t : tangent + t;
        }
        o = mean / mean_norm * cos_f + tangent * sinc + back;
    }
    merge_store_f32(p, out, i, f64_to_f32_rne(o));
}

// model_stock (`coefs[0]` = t) and karcher (`inner` (model, c) pairs) of element i
// (methods/model_stock.rs `blend`, methods/karcher.rs): sums from their first term.
TFTF_HD void merge_stock_or_karcher(const MergeParams& p, const u8* in, const double* coefs,
                                    u8* out, u64 i) {
    int first = p.has_base ? 1 : 0;
    double o = 0.0;
    if (p.method == MERGE_MODEL_STOCK) {
        int nm = p.n - first;
        double mean = 0.0;
        for (int m = 0; m < nm; m++) {
            double v = merge_load_f32(p, in, first + m, i);
            mean = m == 0 ? v : mean + v;
        }
        mean = mean / (double)nm;
        double t = coefs[0];
        o = t * mean + (1.0 - t) * merge_load_f32(p, in, 0, i);
    } else {
        for (u64 j = 0; j < p.inner; j++) {
            double t = coefs[2 * j + 1] * merge_load_f32(p, in, first + (int)coefs[2 * j], i);
            o = j == 0 ? t : o + t;
        }
    }
    merge_store_f32(p, out, i, f64_to_f32_rne(o));
}

TFTF_HD double merge_abs(double x) { return u2d(d2u(x) & 0x7FFFFFFFFFFFFFFFull); }

// nearswap (`coefs[0]` = t; methods/misc.rs `nearswap`), ram (`coefs` = epsilon, whether the
// scales follow, the scales; misc.rs `rescaled_ram`) and arcee_fusion (misc.rs
// `FusionSurvey::merge`) of element i.
TFTF_HD void merge_nearswap_or_ram(const MergeParams& p, const u8* in, const double* coefs,
                                   u8* out, u64 i) {
    double b = merge_load_f32(p, in, 0, i), o;
    if (p.method == MERGE_FUSION) {
        // coefs: the threshold, the row length, the divergence of each of the chunk's rows.
        double m = merge_load_f32(p, in, 1, i);
        double importance = merge_abs(m - b) * coefs[2 + i / (u64)coefs[1]];
        double keep = importance >= coefs[0] ? 1.0 : 0.0;
        o = b + (m - b) * keep;
    } else if (p.method == MERGE_NEARSWAP) {
        double m = merge_load_f32(p, in, 1, i);
        double d = merge_abs(b - m);
        double w = coefs[0] / (d < 1e-6 ? 1e-6 : d);
        w = w < 0.0 ? 0.0 : w > 1.0 ? 1.0 : w;  // Rust's clamp: NaN stays NaN
        o = w * m + (1.0 - w) * b;
    } else {
        double eps = coefs[0];
        int count = 0;
        for (int k = 1; k < p.n; k++)
            if (merge_abs(merge_load_f32(p, in, k, i) - b) > eps) count++;
        double merged = 0.0;
        for (int k = 1; k < p.n; k++) {
            double tv = merge_load_f32(p, in, k, i) - b;
            double keep = merge_abs(tv) > eps ? 1.0 : 0.0;
            double scale = count == 0   ? 0.0
                           : count == 1 ? (coefs[1] != 0.0 ? coefs[1 + k] : 1.0)
                                        : 1.0 / (double)count;
            merged += tv * keep * scale;
        }
        o = b + merged;
    }
    merge_store_f32(p, out, i, f64_to_f32_rne(o));
}

// methods/mod.rs `uniform`: a draw in [0, 1) from the seed, the model and the position.
TFTF_HD double merge_uniform(u64 seed, u64 model, u64 index) {
    u64 z = seed ^ (model * 0xD1B54A32D192ED03ull) ^ (index * 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z ^= z >> 31;
    return (double)(z >> 11) * (1.0 / 9007199254740992.0);
}

// DELLA's keep probability of element i (at `pos` in the tensor) of model m, task vector `tv`
// (methods/sparsify.rs `della`): `c` = [4, epsilon, density, row length, row stride]. Its rank
// in its row (the f32 magnitude ascending, ties by position) is the count of the row's elements
// below it; chunks hold whole slabs of the first axis, so the row lies in the chunk.
TFTF_HD double merge_della(const MergeParams& p, const u8* in, const double* c, int m, u64 i,
                           u64 pos, double tv) {
    u64 row = (u64)c[3], inner = (u64)c[4];
    u64 at = pos / inner % row;
    u64 first = i - at * inner;
    u32 key = f2u(f64_to_f32_rne(merge_abs(tv)));
    u64 rank = 0;
    for (u64 l = 0; l < row; l++) {
        u64 e = first + l * inner;
        double t = merge_load_f32(p, in, 1 + m, e) - merge_load_f32(p, in, 0, e);
        u32 k = f2u(f64_to_f32_rne(merge_abs(t)));
        if (k < key || (k == key && l < at)) rank++;
    }
    double spread = row > 1 ? (double)rank / (double)(row - 1) : 0.5;
    return (c[2] - c[1]) + spread * 2.0 * c[1];
}

// The generalized task arithmetic of element i (methods/sparse_stream.rs `survivors`,
// methods/sparse.rs `Setup::combine`): `coefs` as `BlendKind::Sparse` lays them out.
TFTF_HD void merge_sparse(const MergeParams& p, const u8* in, const double* coefs, u8* out,
                          u64 i) {
    u64 pos = p.inner + i;
    u64 seed = (u64)coefs[0] | ((u64)coefs[1] << 32);
    int nm = p.n - 1;
    double base = merge_load_f32(p, in, 0, i);
    double terms[MERGE_MAX_INPUTS];
    for (int m = 0; m < nm; m++) {
        const double* c = coefs + 6 + 7 * m;
        double tv = merge_load_f32(p, in, 1 + m, i) - base;
        bool kept;
        if (c[0] == 0.0) {
            kept = true;
        } else if (c[0] == 1.0) {
            kept = false;
        } else if (c[0] == 2.0) {
            u32 key = f2u(f64_to_f32_rne(merge_abs(tv)));
            u32 low = (u32)c[1], high = (u32)c[3];
            bool below_low = key < low || (key == low && (double)pos < c[2]);
            bool below_high = key < high || (key == high && (double)pos < c[4]);
            kept = !below_low && below_high;
        } else if (c[0] == 3.0) {
            kept = merge_uniform(seed, (u64)m, pos) < c[2];
        } else {
            kept = merge_uniform(seed, (u64)m, pos) < merge_della(p, in, c, m, i, pos, tv);
        }
        terms[m] = kept ? tv * c[5] * c[6] : 0.0;
    }
    double merged = 0.0, divisor = coefs[5];
    if (coefs[2] != 0.0) {
        double total = 0.0;
        for (int m = 0; m < nm; m++) total = m == 0 ? terms[0] : total + terms[m];
        bool positive = total >= 0.0;
        divisor = 0.0;
        for (int m = 0; m < nm; m++)
            if (terms[m] != 0.0 && (terms[m] > 0.0) == positive) {
                merged += terms[m];
                divisor += coefs[6 + 7 * m + 6];
            }
        if (divisor == 0.0) divisor = 1.0;
    } else {
        for (int m = 0; m < nm; m++) merged = m == 0 ? terms[0] : merged + terms[m];
    }
    if (coefs[3] != 0.0) merged /= divisor;
    if (coefs[4] != 1.0) merged *= coefs[4];
    merge_store_f32(p, out, i, f64_to_f32_rne(base + merged));
}

// SCE of element i (methods/sce.rs `selected`, `erase`): `coefs` = whether a variance cut
// selects, the cut's key and position limit, each model's weight. Sums from their first term.
TFTF_HD void merge_sce(const MergeParams& p, const u8* in, const double* coefs, u8* out, u64 i) {
    int nm = p.n - 1;
    double b = merge_load_f32(p, in, 0, i);
    double tv[MERGE_MAX_INPUTS];
    for (int m = 0; m < nm; m++) tv[m] = merge_load_f32(p, in, 1 + m, i) - b;
    bool kept = true;
    if (coefs[0] != 0.0) {
        double mean = 0.0, var = 0.0;
        for (int m = 0; m < nm; m++) mean = m == 0 ? tv[0] : mean + tv[m];
        mean = mean / (double)nm;
        for (int m = 0; m < nm; m++) {
            double d = (tv[m] - mean) * (tv[m] - mean);
            var = m == 0 ? d : var + d;
        }
        var = var / (double)nm;
        u32 key = f2u(f64_to_f32_rne(var)), cut = (u32)coefs[1];
        kept = !(key < cut || (key == cut && (double)(p.inner + i) < coefs[2]));
    }
    double total = 0.0;
    for (int m = 0; m < nm; m++) {
        double term = kept ? tv[m] : 0.0;
        total = m == 0 ? term : total + term;
    }
    bool positive = total >= 0.0;
    double merged = 0.0, divisor = 0.0;
    for (int m = 0; m < nm; m++) {
        double term = kept ? tv[m] : 0.0;
        if (term != 0.0 && (term > 0.0) == positive) {
            merged += term * coefs[3 + m];
            divisor += coefs[3 + m];
        }
    }
    merge_store_f32(p, out, i, f64_to_f32_rne(b + merged / (divisor < 1e-6 ? 1e-6 : divisor)));
}

// Element i of the merged chunk, stored as p.dst.
TFTF_HD void merge_element(const MergeParams& p, const u8* in, const double* coefs, u8* out,
                           u64 i) {
    switch (p.method) {
        case MERGE_LINEAR: case MERGE_TASK: break;
        case MERGE_SLERP: case MERGE_NUSLERP: return merge_blend(p, in, coefs, out, i);
        case MERGE_MULTISLERP: return merge_multislerp(p, in, coefs, out, i);
        case MERGE_MODEL_STOCK: case MERGE_KARCHER:
            return merge_stock_or_karcher(p, in, coefs, out, i);
        case MERGE_SPARSE: return merge_sparse(p, in, coefs, out, i);
        case MERGE_SCE: return merge_sce(p, in, coefs, out, i);
        default: return merge_nearswap_or_ram(p, in, coefs, out, i);
    }
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
