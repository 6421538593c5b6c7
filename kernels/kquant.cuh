// ggml's block encoders (src/ops/gguf/legacy.rs and src/ops/gguf/kquants/): Q4_0, Q4_1, Q5_0,
// Q5_1, Q2_K … Q6_K, IQ4_NL, IQ4_XS, TQ1_0 and TQ2_0, with and without importance weights, one
// block per call. Every float operation is the Rust encoder's, in its order (the CPU runs the
// scale searches sixteen sub-blocks at a time in SIMD lanes, each lane keeping the serial order
// written out here), so a block's bytes are the CPU's — and llama-quantize's.
#pragma once
#include "cast.cuh"

// The encoders and searches are called, not inlined, on the device: inlined into tftf_gguf they
// would multiply the PTX (and the driver's JIT time) several times over for no speed.
#if defined(__CUDACC__) || defined(__CUDACC_RTC__)
#define KQ_FN __host__ __device__ __noinline__
#else
#define KQ_FN static
#endif

#define KQ_QK_K 256
#define KQ_GROUP_MAX_EPS 1e-15f

// ggml type ids of the block types (GgmlType::id).
enum KqTypeId {
    KQ_Q4_0 = 2,
    KQ_Q4_1 = 3,
    KQ_Q5_0 = 6,
    KQ_Q5_1 = 7,
    KQ_Q2_K = 10,
    KQ_Q3_K = 11,
    KQ_Q4_K = 12,
    KQ_Q5_K = 13,
    KQ_Q6_K = 14,
    KQ_IQ2_XXS = 16,
    KQ_IQ2_XS = 17,
    KQ_IQ3_XXS = 18,
    KQ_IQ1_S = 19,
    KQ_IQ4_NL = 20,
    KQ_IQ3_S = 21,
    KQ_IQ2_S = 22,
    KQ_IQ4_XS = 23,
    KQ_IQ1_M = 29,
    KQ_TQ1_0 = 34,
    KQ_TQ2_0 = 35,
};

// (ggml type id, elements, bytes) of each block type encoded here and in the IQ1/IQ2/IQ3
// headers (iq_encode.cuh).
#define KQ_TYPES 20
TFTF_HD int kq_block(int ty, int what) {
    const int table[KQ_TYPES][3] = {
        {KQ_Q4_0, 32, 18},        {KQ_Q4_1, 32, 20},        {KQ_Q5_0, 32, 22},
        {KQ_Q5_1, 32, 24},        {KQ_IQ4_NL, 32, 18},      {KQ_Q2_K, KQ_QK_K, 84},
        {KQ_Q3_K, KQ_QK_K, 110},  {KQ_Q4_K, KQ_QK_K, 144},  {KQ_Q5_K, KQ_QK_K, 176},
        {KQ_Q6_K, KQ_QK_K, 210},  {KQ_IQ4_XS, KQ_QK_K, 136}, {KQ_TQ1_0, KQ_QK_K, 54},
        {KQ_TQ2_0, KQ_QK_K, 66},  {KQ_IQ2_XXS, KQ_QK_K, 66}, {KQ_IQ2_XS, KQ_QK_K, 74},
        {KQ_IQ2_S, KQ_QK_K, 82},  {KQ_IQ3_XXS, KQ_QK_K, 98}, {KQ_IQ3_S, KQ_QK_K, 110},
        {KQ_IQ1_S, KQ_QK_K, 50},  {KQ_IQ1_M, KQ_QK_K, 56},
    };
    for (int k = 0; k < KQ_TYPES; k++)
        if (table[k][0] == ty) return table[k][what];
    return 0;
}

// Elements of a block of `ty`; 0 for a type without an encoder here.
TFTF_HD int kq_block_elems(int ty) { return kq_block(ty, 1); }
TFTF_HD int kq_block_bytes(int ty) { return kq_block(ty, 2); }

// ggml's nearest_int: the FPU rounds x + 1.5·2^23 to an integer (ties to even) in the low
// mantissa bits; past 2^22 the same wrapped value ggml gets.
TFTF_HD int kq_nearest_int(float x) {
    float v = x + 12582912.0f;
    return (int)(f2u(v) & 0x007FFFFFu) - 0x00400000;
}

TFTF_HD float kq_abs(float x) { return u2f(f2u(x) & 0x7FFFFFFFu); }

TFTF_HD int kq_clamp(int v, int lo, int hi) { return v < lo ? lo : v > hi ? hi : v; }
TFTF_HD int kq_min(int a, int b) { return a < b ? a : b; }
// C's MAX(a, b): a NaN `b` wins, a NaN `a` loses.
TFTF_HD float kq_cmax(float a, float b) { return a > b ? a : b; }

TFTF_HD void kq_put_f16(u8* y, float v) {
    u16 h = f32_to_f16(v);
    y[0] = (u8)(h & 0xFF);
    y[1] = (u8)(h >> 8);
}

TFTF_HD float kq_get_f16(const u8* y) { return f16_to_f32((u16)(y[0] | (y[1] << 8))); }

// The value of largest magnitude, first on ties: |v| into *amax, v into *max (0s when all 0).
TFTF_HD void kq_signed_max(const float* x, int n, float* amax, float* max) {
    float a = 0.0f, m = 0.0f;
    for (int i = 0; i < n; i++) {
        float v = kq_abs(x[i]);
        if (v > a) {
            a = v;
            m = x[i];
        }
    }
    *amax = a;
    *max = m;
}

TFTF_HD float kq_sum_squares(const float* x, int n) {
    float s = 0.0f;
    for (int i = 0; i < n; i++) s += x[i] * x[i];
    return s;
}

// The *_impl paths' weights qw·sqrt(sigma2 + x²); returns their sum in order.
TFTF_HD float kq_imatrix_weights(float* w, const float* qw, const float* x, int n, float sigma2) {
    float sum = 0.0f;
    for (int i = 0; i < n; i++) {
        w[i] = qw[i] * sqrt_f32(sigma2 + x[i] * x[i]);
        sum += w[i];
    }
    return sum;
}

// The least-squares sums of a level search and its cross-multiplied comparison.
struct KqFit {
    float sumlx, suml2;
};

TFTF_HD void kq_fit_add(KqFit* f, float w, float x, int l) {
    f->sumlx += w * x * (float)l;
    f->suml2 += w * (float)l * (float)l;
}

TFTF_HD bool kq_fit_take_if_better(KqFit* f, float slx, float sl2) {
    bool better = slx * slx * f->suml2 > f->sumlx * f->sumlx * sl2;
    if (better) {
        f->sumlx = slx;
        f->suml2 = sl2;
    }
    return better;
}

TFTF_HD float kq_fit_scale(const KqFit* f) { return f->suml2 > 0.0f ? f->sumlx / f->suml2 : 0.0f; }

// make_qx_quants(n, nmax, x, L, rmse_type = 1, qw): symmetric levels L + nmax, weights qw or x².
KQ_FN float kq_make_qx_quants(int nmax, int n, const float* x, signed char* levels,
                                const float* qw) {
    float amax, max;
    kq_signed_max(x, n, &amax, &max);
    if (amax < KQ_GROUP_MAX_EPS) {
        for (int i = 0; i < n; i++) levels[i] = 0;
        return 0.0f;
    }
    float nmaxf = (float)nmax;
    float iscale = -nmaxf / max;
    float sumlx = 0.0f, suml2 = 0.0f;
    for (int i = 0; i < n; i++) {
        int l = kq_clamp(kq_nearest_int(iscale * x[i]), -nmax, nmax - 1);
        levels[i] = (signed char)(l + nmax);
        float w = qw ? qw[i] : x[i] * x[i];
        sumlx += w * x[i] * (float)l;
        suml2 += w * (float)l * (float)l;
    }
    float scale = suml2 != 0.0f ? sumlx / suml2 : 0.0f;
    float best = scale * sumlx;
    for (int is = -9; is <= 9; is++) {
        if (is == 0) continue;
        iscale = -(nmaxf + 0.1f * (float)is) / max;
        sumlx = 0.0f;
        suml2 = 0.0f;
        for (int i = 0; i < n; i++) {
            int l = kq_clamp(kq_nearest_int(iscale * x[i]), -nmax, nmax - 1);
            float w = qw ? qw[i] : x[i] * x[i];
            sumlx += w * x[i] * (float)l;
            suml2 += w * (float)l * (float)l;
        }
        if (suml2 > 0.0f && sumlx * sumlx > best * suml2) {
            for (int i = 0; i < n; i++)
                levels[i] =
                    (signed char)(nmax + kq_clamp(kq_nearest_int(iscale * x[i]), -nmax, nmax - 1));
            scale = sumlx / suml2;
            best = scale * sumlx;
        }
    }
    return scale;
}

// make_q3_quants(n, nmax, x, L, do_rmse = true): x² weights, then up to five passes moving single
// levels while the fit improves.
KQ_FN float kq_make_q3_quants(int nmax, int n, const float* x, signed char* levels) {
    float amax, max;
    kq_signed_max(x, n, &amax, &max);
    if (amax < KQ_GROUP_MAX_EPS) {
        for (int i = 0; i < n; i++) levels[i] = 0;
        return 0.0f;
    }
    float iscale = -(float)nmax / max;
    KqFit fit = {0.0f, 0.0f};
    for (int i = 0; i < n; i++) {
        int l = kq_clamp(kq_nearest_int(iscale * x[i]), -nmax, nmax - 1);
        levels[i] = (signed char)l;
        kq_fit_add(&fit, x[i] * x[i], x[i], l);
    }
    for (int pass = 0; pass < 5; pass++) {
        bool changed = false;
        for (int i = 0; i < n; i++) {
            float v = x[i];
            float w = v * v;
            float li = (float)levels[i];
            float slx = fit.sumlx - w * v * li;
            if (slx > 0.0f) {
                float sl2 = fit.suml2 - w * li * li;
                int new_l = kq_clamp(kq_nearest_int(v * sl2 / slx), -nmax, nmax - 1);
                if (new_l != (int)levels[i]) {
                    slx += w * v * (float)new_l;
                    sl2 += w * (float)new_l * (float)new_l;
                    if (sl2 > 0.0f && kq_fit_take_if_better(&fit, slx, sl2)) {
                        levels[i] = (signed char)new_l;
                        changed = true;
                    }
                }
            }
        }
        if (!changed) break;
    }
    for (int i = 0; i < n; i++) levels[i] = (signed char)(levels[i] + nmax);
    return kq_fit_scale(&fit);
}

// The candidate inverse scales of make_qkx*_quants (search.rs AffineSearch).
struct KqSearch {
    float rmin, rdelta;
    int nstep;
    bool use_mad;
};

TFTF_HD KqSearch kq_search(float rmin, float rdelta, int nstep, bool use_mad) {
    KqSearch s = {rmin, rdelta, nstep, use_mad};
    return s;
}

// The search every *_impl path takes given quant weights (make_qkx3_quants(-0.9, 0.05, 36)).
TFTF_HD KqSearch kq_weighted_search() { return kq_search(-0.9f, 0.05f, 36, false); }

TFTF_HD float kq_err(bool use_mad, float d) { return use_mad ? kq_abs(d) : d * d; }

// make_qkx2_quants / make_qkx3_quants with weights: affine levels 0..=nmax, x ≈ scale·L − min.
// Returns the scale; *the_min gets −min. `aux` holds n scratch levels.
KQ_FN float kq_make_qkx_quants(int nmax, int n, const float* x, const float* weights,
                                 u8* levels, u8* aux, KqSearch s, float* the_min) {
    float min = x[0], max = x[0];
    float sum_w = weights[0];
    float sum_x = sum_w * x[0];
    for (int i = 1; i < n; i++) {
        if (x[i] < min) min = x[i];
        if (x[i] > max) max = x[i];
        float w = weights[i];
        sum_w += w;
        sum_x += w * x[i];
    }
    if (min > 0.0f) min = 0.0f;
    if (max == min) {
        for (int i = 0; i < n; i++) levels[i] = 0;
        *the_min = -min;
        return 0.0f;
    }
    float nmaxf = (float)nmax;
    float iscale = nmaxf / (max - min);
    float scale = 1.0f / iscale;
    float best_error = 0.0f;
    for (int i = 0; i < n; i++) {
        int l = kq_clamp(kq_nearest_int(iscale * (x[i] - min)), 0, nmax);
        levels[i] = (u8)l;
        float diff = scale * (float)l + min - x[i];
        best_error += weights[i] * kq_err(s.use_mad, diff);
    }
    if (s.nstep < 1) {
        *the_min = -min;
        return scale;
    }
    for (int is = 0; is <= s.nstep; is++) {
        iscale = (s.rmin + s.rdelta * (float)is + nmaxf) / (max - min);
        float sum_l = 0.0f, sum_l2 = 0.0f, sum_xl = 0.0f;
        for (int i = 0; i < n; i++) {
            int l = kq_clamp(kq_nearest_int(iscale * (x[i] - min)), 0, nmax);
            aux[i] = (u8)l;
            float w = weights[i];
            float lf = (float)l;
            sum_l += w * lf;
            sum_l2 += w * lf * lf;
            sum_xl += w * lf * x[i];
        }
        float d = sum_w * sum_l2 - sum_l * sum_l;
        if (d > 0.0f) {
            float this_scale = (sum_w * sum_xl - sum_x * sum_l) / d;
            float this_min = (sum_l2 * sum_x - sum_l * sum_xl) / d;
            if (this_min > 0.0f) {
                this_min = 0.0f;
                this_scale = sum_xl / sum_l2;
            }
            float cur_error = 0.0f;
            for (int i = 0; i < n; i++) {
                float diff = this_scale * (float)aux[i] + this_min - x[i];
                cur_error += weights[i] * kq_err(s.use_mad, diff);
            }
            if (cur_error < best_error) {
                for (int i = 0; i < n; i++) levels[i] = aux[i];
                best_error = cur_error;
                scale = this_scale;
                min = this_min;
            }
        }
    }
    *the_min = -min;
    return scale;
}

// make_qp_quants(n, nmax, x, L, quant_weights): levels of non-negative values, stored in a u8 as
// ggml stores them (a wrapped level is what later sums read).
KQ_FN float kq_make_qp_quants(int nmax, int n, const float* x, u8* levels, const float* qw) {
    float max = 0.0f;
    for (int i = 0; i < n; i++) max = kq_cmax(max, x[i]);
    if (max < KQ_GROUP_MAX_EPS) {
        for (int i = 0; i < n; i++) levels[i] = 0;
        return 0.0f;
    }
    float nmaxf = (float)nmax;
    float iscale = nmaxf / max;
    for (int i = 0; i < n; i++) levels[i] = (u8)kq_nearest_int(iscale * x[i]);
    float scale = 1.0f / iscale;
    float best_mse = 0.0f;
    for (int i = 0; i < n; i++) {
        float diff = x[i] - scale * (float)levels[i];
        best_mse += qw[i] * diff * diff;
    }
    for (int is = -4; is <= 4; is++) {
        if (is == 0) continue;
        float iscale_is = (0.1f * (float)is + nmaxf) / max;
        float scale_is = 1.0f / iscale_is;
        float mse = 0.0f;
        for (int i = 0; i < n; i++) {
            int l = kq_min(kq_nearest_int(iscale_is * x[i]), nmax);
            float diff = x[i] - scale_is * (float)l;
            mse += qw[i] * diff * diff;
        }
        if (mse < best_mse) {
            best_mse = mse;
            iscale = iscale_is;
        }
    }
    KqFit fit = {0.0f, 0.0f};
    for (int i = 0; i < n; i++) {
        int l = kq_min(kq_nearest_int(iscale * x[i]), nmax);
        levels[i] = (u8)l;
        kq_fit_add(&fit, qw[i], x[i], l);
    }
    for (int pass = 0; pass < 5; pass++) {
        bool changed = false;
        for (int i = 0; i < n; i++) {
            float w = qw[i], v = x[i];
            float li = (float)levels[i];
            float slx = fit.sumlx - w * v * li;
            float sl2 = fit.suml2 - w * li * li;
            if (slx > 0.0f && sl2 > 0.0f) {
                int new_l = kq_min(kq_nearest_int(v * sl2 / slx), nmax);
                if (new_l != (int)levels[i]) {
                    slx += w * v * (float)new_l;
                    sl2 += w * (float)new_l * (float)new_l;
                    if (kq_fit_take_if_better(&fit, slx, sl2)) {
                        levels[i] = (u8)new_l;
                        changed = true;
                    }
                }
            }
        }
        if (!changed) break;
    }
    return kq_fit_scale(&fit);
}

// Four 2-bit planes as q2_K and q3_K store them: byte 32h + l holds elements 128h + l, +32, +64,
// +96 from the low bits up.
TFTF_HD void kq_pack_2bit(const u8* levels, u8* qs) {
    for (int h = 0; h < 2; h++)
        for (int l = 0; l < 32; l++) {
            const u8* half = levels + 128 * h;
            qs[32 * h + l] =
                (u8)(half[l] | (half[l + 32] << 2) | (half[l + 64] << 4) | (half[l + 96] << 6));
        }
}

// The largest of n values as ggml tracks a maximum scale (`>` from 0, in order).
TFTF_HD float kq_max_from_zero(const float* v, int n) {
    float m = 0.0f;
    for (int i = 0; i < n; i++)
        if (v[i] > m) m = v[i];
    return m;
}

// ---- Q2_K (q2_k.rs): 84 bytes, scales[16] | qs[64] | d | dmin ----

KQ_FN void kq_q2_k(const float* x, const float* qw, u8* y) {
    u8 levels[KQ_QK_K], aux[16];
    float scales[16], mins[16], sw[16], w[16];
    if (!qw) {
        KqSearch s = kq_search(-0.5f, 0.1f, 15, true);
        for (int j = 0; j < 16; j++) {
            for (int i = 0; i < 16; i++) w[i] = kq_abs(x[16 * j + i]);
            scales[j] = kq_make_qkx_quants(3, 16, x + 16 * j, w, levels + 16 * j, aux, s, &mins[j]);
        }
        float max_scale = kq_max_from_zero(scales, 16), max_min = kq_max_from_zero(mins, 16);
        if (max_scale > 0.0f) {
            float iscale = 15.0f / max_scale;
            for (int j = 0; j < 16; j++) y[j] = (u8)kq_nearest_int(iscale * scales[j]);
        } else {
            for (int j = 0; j < 16; j++) y[j] = 0;
        }
        if (max_min > 0.0f) {
            float iscale = 15.0f / max_min;
            for (int j = 0; j < 16; j++) y[j] |= (u8)((u32)kq_nearest_int(iscale * mins[j]) << 4);
        }
        kq_put_f16(y + 80, max_scale > 0.0f ? max_scale / 15.0f : 0.0f);
        kq_put_f16(y + 82, max_min > 0.0f ? max_min / 15.0f : 0.0f);
    } else {
        float sigma2 = kq_sum_squares(x, KQ_QK_K) / (float)KQ_QK_K;
        for (int j = 0; j < 16; j++) {
            sw[j] = kq_imatrix_weights(w, qw + 16 * j, x + 16 * j, 16, sigma2);
            scales[j] = kq_make_qkx_quants(3, 16, x + 16 * j, w, levels + 16 * j, aux,
                                           kq_weighted_search(), &mins[j]);
        }
        u8 ls[16], lm[16];
        float dm = kq_make_qp_quants(15, 16, scales, ls, sw);
        float mm = kq_make_qp_quants(15, 16, mins, lm, sw);
        kq_put_f16(y + 80, dm);
        kq_put_f16(y + 82, mm);
        for (int j = 0; j < 16; j++) y[j] = (u8)(ls[j] | (lm[j] << 4));
    }
    float d_all = kq_get_f16(y + 80), dmin_all = kq_get_f16(y + 82);
    for (int j = 0; j < 16; j++) {
        float d = d_all * (float)(y[j] & 0xF);
        if (d == 0.0f) continue;
        float m = dmin_all * (float)(y[j] >> 4);
        for (int i = 0; i < 16; i++)
            levels[16 * j + i] = (u8)kq_clamp(kq_nearest_int((x[16 * j + i] + m) / d), 0, 3);
    }
    kq_pack_2bit(levels, y + 16);
}

// ---- Q3_K (q3_k.rs): 110 bytes, hmask[32] | qs[64] | scales[12] | d ----

TFTF_HD void kq_q3_set_scale(u8* sc, int j, u8 l) {
    if (j < 8) sc[j] = l & 0xF;
    else sc[j - 8] |= (u8)((l & 0xF) << 4);
    sc[j % 4 + 8] |= (u8)((l >> 4) << (2 * (j / 4)));
}

TFTF_HD int kq_q3_get_scale(const u8* sc, int j) {
    u8 low = j < 8 ? (u8)(sc[j] & 0xF) : (u8)(sc[j - 8] >> 4);
    return (int)(signed char)(u8)(low | (((sc[8 + j % 4] >> (2 * (j / 4))) & 3) << 4)) - 32;
}

KQ_FN void kq_q3_k(const float* x, const float* qw, u8* y) {
    signed char levels[KQ_QK_K];
    float scales[16];
    u8* sc = y + 96;
    for (int j = 0; j < 12; j++) sc[j] = 0;
    if (!qw) {
        for (int j = 0; j < 16; j++)
            scales[j] = kq_make_q3_quants(4, 16, x + 16 * j, levels + 16 * j);
        float amax, max_scale;
        kq_signed_max(scales, 16, &amax, &max_scale);
        float d = 0.0f;
        if (max_scale != 0.0f) {
            float iscale = -32.0f / max_scale;
            for (int j = 0; j < 16; j++) {
                int l = kq_clamp((int)(signed char)kq_nearest_int(iscale * scales[j]), -32, 31) + 32;
                kq_q3_set_scale(sc, j, (u8)l);
            }
            d = 1.0f / iscale;
        }
        kq_put_f16(y + 108, d);
    } else {
        float sw[16], weights[KQ_QK_K];
        float sigma2 = 2.0f * kq_sum_squares(x, KQ_QK_K) / (float)KQ_QK_K;
        for (int j = 0; j < 16; j++)
            sw[j] = kq_imatrix_weights(weights + 16 * j, qw + 16 * j, x + 16 * j, 16, sigma2);
        for (int j = 0; j < 16; j++)
            scales[j] = kq_make_qx_quants(4, 16, x + 16 * j, levels + 16 * j, weights + 16 * j);
        signed char ls[16];
        float d_block = kq_make_qx_quants(32, 16, scales, ls, sw);
        for (int j = 0; j < 16; j++) kq_q3_set_scale(sc, j, (u8)ls[j]);
        kq_put_f16(y + 108, d_block);
    }
    float d_all = kq_get_f16(y + 108);
    for (int j = 0; j < 16; j++) {
        float d = d_all * (float)kq_q3_get_scale(sc, j);
        if (d == 0.0f) continue;
        for (int i = 0; i < 16; i++)
            levels[16 * j + i] =
                (signed char)(kq_clamp(kq_nearest_int(x[16 * j + i] / d), -4, 3) + 4);
    }
    u8* hmask = y;
    for (int j = 0; j < 32; j++) hmask[j] = 0;
    u8 low[KQ_QK_K];
    for (int j = 0; j < KQ_QK_K; j++) {
        u8 l = (u8)levels[j];
        if (l > 3) {
            hmask[j % 32] |= (u8)(1 << (j / 32));
            l -= 4;
        }
        low[j] = l;
    }
    kq_pack_2bit(low, y + 32);
}

// ---- Q4_K / Q5_K (q45_k.rs): d | dmin | scales[12] | (Q5_K: qh[32]) | qs[128] ----

TFTF_HD void kq_pack_scales(const u8* ls, const u8* lm, u8* out) {
    for (int j = 0; j < 4; j++) {
        out[j] = ls[j];
        out[j + 4] = lm[j];
    }
    for (int j = 4; j < 8; j++) {
        out[j + 4] = (u8)((ls[j] & 0xF) | ((lm[j] & 0xF) << 4));
        out[j - 4] |= (u8)((ls[j] >> 4) << 6);
        out[j] |= (u8)((lm[j] >> 4) << 6);
    }
}

TFTF_HD void kq_scale_min(int j, const u8* q, u8* sc, u8* m) {
    if (j < 4) {
        *sc = q[j] & 63;
        *m = q[j + 4] & 63;
    } else {
        *sc = (u8)((q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4));
        *m = (u8)((q[j + 4] >> 4) | ((q[j] >> 6) << 4));
    }
}

KQ_FN void kq_q45_k(int nmax, const float* x, const float* qw, u8* y) {
    u8 levels[KQ_QK_K], aux[32];
    float scales[8], mins[8], sw[8], w[32];
    u8 ls[8], lm[8];
    if (!qw) {
        KqSearch s = nmax == 15 ? kq_search(-1.0f, 0.1f, 20, false)
                                : kq_search(-0.5f, 0.1f, 15, false);
        for (int j = 0; j < 8; j++) {
            const float* xs = x + 32 * j;
            float av_x = sqrt_f32(kq_sum_squares(xs, 32) / 32.0f);
            for (int i = 0; i < 32; i++) w[i] = av_x + kq_abs(xs[i]);
            scales[j] = kq_make_qkx_quants(nmax, 32, xs, w, levels + 32 * j, aux, s, &mins[j]);
        }
        float max_scale = kq_max_from_zero(scales, 8), max_min = kq_max_from_zero(mins, 8);
        float inv_scale = max_scale > 0.0f ? 63.0f / max_scale : 0.0f;
        float inv_min = max_min > 0.0f ? 63.0f / max_min : 0.0f;
        for (int j = 0; j < 8; j++) {
            u8 a = (u8)kq_nearest_int(inv_scale * scales[j]);
            u8 b = (u8)kq_nearest_int(inv_min * mins[j]);
            ls[j] = a < 63 ? a : 63;
            lm[j] = b < 63 ? b : 63;
        }
        kq_put_f16(y, max_scale / 63.0f);
        kq_put_f16(y + 2, max_min / 63.0f);
    } else {
        float sigma2 = 2.0f * kq_sum_squares(x, KQ_QK_K) / (float)KQ_QK_K;
        for (int j = 0; j < 8; j++) {
            sw[j] = kq_imatrix_weights(w, qw + 32 * j, x + 32 * j, 32, sigma2);
            scales[j] = kq_make_qkx_quants(nmax, 32, x + 32 * j, w, levels + 32 * j, aux,
                                           kq_weighted_search(), &mins[j]);
        }
        float d_block = kq_make_qp_quants(63, 8, scales, ls, sw);
        float m_block = kq_make_qp_quants(63, 8, mins, lm, sw);
        if (nmax == 31)  // Q5_K clamps its packed levels, Q4_K lets a wrapped one spill
            for (int j = 0; j < 8; j++) {
                ls[j] = ls[j] < 63 ? ls[j] : 63;
                lm[j] = lm[j] < 63 ? lm[j] : 63;
            }
        kq_put_f16(y, d_block);
        kq_put_f16(y + 2, m_block);
    }
    kq_pack_scales(ls, lm, y + 4);
    float d_all = kq_get_f16(y), dmin_all = kq_get_f16(y + 2);
    for (int j = 0; j < 8; j++) {
        u8 sc, m;
        kq_scale_min(j, y + 4, &sc, &m);
        float d = d_all * (float)sc;
        if (d == 0.0f) continue;
        float dm = dmin_all * (float)m;
        for (int i = 0; i < 32; i++)
            levels[32 * j + i] = (u8)kq_clamp(kq_nearest_int((x[32 * j + i] + dm) / d), 0, nmax);
    }
    if (nmax == 15) {
        u8* qs = y + 16;
        for (int c = 0; c < 4; c++)
            for (int l = 0; l < 32; l++)
                qs[32 * c + l] = (u8)(levels[64 * c + l] | (levels[64 * c + l + 32] << 4));
    } else {
        u8* qh = y + 16;
        u8* ql = y + 48;
        for (int l = 0; l < 32; l++) qh[l] = 0;
        for (int p = 0; p < 4; p++) {
            u8 m1 = (u8)(1 << (2 * p)), m2 = (u8)(2 << (2 * p));
            for (int j = 0; j < 32; j++) {
                u8 l1 = levels[64 * p + j];
                if (l1 > 15) {
                    l1 -= 16;
                    qh[j] |= m1;
                }
                u8 l2 = levels[64 * p + j + 32];
                if (l2 > 15) {
                    l2 -= 16;
                    qh[j] |= m2;
                }
                ql[32 * p + j] = (u8)(l1 | (l2 << 4));
            }
        }
    }
}

// ---- Q6_K (q6_k.rs): ql[128] | qh[64] | scales[16] (i8) | d ----

KQ_FN void kq_q6_k(const float* x, const float* qw, u8* y) {
    signed char levels[KQ_QK_K];
    float scales[16];
    for (int j = 0; j < 16; j++)
        scales[j] = kq_make_qx_quants(32, 16, x + 16 * j, levels + 16 * j, qw ? qw + 16 * j : 0);
    float max_abs, max_scale;
    kq_signed_max(scales, 16, &max_abs, &max_scale);
    if (max_abs < KQ_GROUP_MAX_EPS) {
        for (int i = 0; i < 210; i++) y[i] = 0;
        return;
    }
    u8* ql = y;
    u8* qh = y + 128;
    u8* sc = y + 192;
    float iscale = -128.0f / max_scale;
    kq_put_f16(y + 208, 1.0f / iscale);
    float d_all = f16_to_f32(f32_to_f16(1.0f / iscale));
    for (int j = 0; j < 16; j++) sc[j] = (u8)(signed char)kq_min(kq_nearest_int(iscale * scales[j]), 127);
    for (int j = 0; j < 16; j++) {
        float d = d_all * (float)(signed char)sc[j];
        if (d == 0.0f) continue;
        for (int i = 0; i < 16; i++)
            levels[16 * j + i] =
                (signed char)(kq_clamp(kq_nearest_int(x[16 * j + i] / d), -32, 31) + 32);
    }
    for (int h = 0; h < 2; h++) {
        const signed char* half = levels + 128 * h;
        for (int l = 0; l < 32; l++) {
            u8 q0 = (u8)half[l], q1 = (u8)half[l + 32], q2 = (u8)half[l + 64], q3 = (u8)half[l + 96];
            ql[64 * h + l] = (u8)((q0 & 0xF) | ((q2 & 0xF) << 4));
            ql[64 * h + l + 32] = (u8)((q1 & 0xF) | ((q3 & 0xF) << 4));
            qh[32 * h + l] = (u8)((q0 >> 4) | ((q1 >> 4) << 2) | ((q2 >> 4) << 4) | ((q3 >> 4) << 6));
        }
    }
}

// ---- Q4_0, Q4_1, Q5_0, Q5_1 (legacy.rs): blocks of 32 ----

// C's (int)f then (u8): out-of-range and NaN give INT_MIN's low byte, as x86's cvttss2si.
TFTF_HD u8 kq_c_trunc_u8(float f) {
    int i = (is_nan_f32(f) || !(f >= -2147483648.0f && f < 2147483648.0f)) ? (int)0x80000000u
                                                                            : (int)f;
    return (u8)i;
}

TFTF_HD u8 kq_c_min_trunc_i8(u8 top, float f) {
    int t = (int)(signed char)kq_c_trunc_u8(f);
    return (u8)((int)top < t ? (int)top : t);
}

// Packs 32 levels: nibbles into qs[16], fifth bits returned (bit j: element j).
TFTF_HD u32 kq_legacy_pack(const u8* l, u8* qs) {
    u32 qh = 0;
    for (int j = 0; j < 16; j++) {
        u8 a = l[j], b = l[j + 16];
        qs[j] = (u8)((a & 0x0F) | ((b & 0x0F) << 4));
        qh |= (u32)((a & 0x10) >> 4) << j;
        qh |= (u32)((b & 0x10) >> 4) << (j + 16);
    }
    return qh;
}

TFTF_HD void kq_put_u32(u8* y, u32 v) {
    for (int k = 0; k < 4; k++) y[k] = (u8)(v >> (8 * k));
}

// `w`: the block's weights qw·sqrt(sigma2 + x²) (sigma2 over the whole row), or null.
KQ_FN void kq_legacy(int ty, const float* x, const float* w, u8* y) {
    u8 l[32];
    bool symmetric = ty == KQ_Q4_0 || ty == KQ_Q5_0;
    if (symmetric) {
        int half = ty == KQ_Q4_0 ? 8 : 16;
        float d;
        if (!w) {
            float amax, max;
            kq_signed_max(x, 32, &amax, &max);
            d = max / -(float)half;
            float id = d != 0.0f ? 1.0f / d : 0.0f;
            for (int i = 0; i < 32; i++)
                l[i] = kq_c_min_trunc_i8((u8)(2 * half - 1), x[i] * id + ((float)half + 0.5f));
        } else {
            signed char levels[32];
            d = kq_make_qx_quants(half, 32, x, levels, w);
            for (int i = 0; i < 32; i++) l[i] = (u8)levels[i];
        }
        kq_put_f16(y, d);
        if (ty == KQ_Q4_0) {
            kq_legacy_pack(l, y + 2);
        } else {
            u32 qh = kq_legacy_pack(l, y + 6);
            kq_put_u32(y + 2, qh);
        }
        return;
    }
    int nmax = ty == KQ_Q4_1 ? 15 : 31;
    float d, m;
    if (!w) {
        float min = u2f(0x7F7FFFFFu), max = -u2f(0x7F7FFFFFu);
        for (int i = 0; i < 32; i++) {
            if (x[i] < min) min = x[i];
            if (x[i] > max) max = x[i];
        }
        d = (max - min) / (float)nmax;
        float id = d != 0.0f ? 1.0f / d : 0.0f;
        for (int i = 0; i < 32; i++) {
            float f = (x[i] - min) * id + 0.5f;
            l[i] = ty == KQ_Q4_1 ? kq_c_min_trunc_i8((u8)nmax, f) : kq_c_trunc_u8(f);
        }
        m = min;
    } else {
        u8 aux[32];
        float the_min;
        d = kq_make_qkx_quants(nmax, 32, x, w, l, aux, kq_weighted_search(), &the_min);
        m = -the_min;
    }
    kq_put_f16(y, d);
    kq_put_f16(y + 2, m);
    if (ty == KQ_Q4_1) {
        kq_legacy_pack(l, y + 4);
    } else {
        u32 qh = kq_legacy_pack(l, y + 8);
        kq_put_u32(y + 4, qh);
    }
}

// ---- IQ4_NL / IQ4_XS (iq4.rs) ----

TFTF_HD float kq_iq4_value(int i) {
    const signed char kv[16] = {-127, -104, -83, -65, -49, -35, -22, -10,
                                1,    13,   25,  38,  53,  69,  89,  113};
    return (float)kv[i];
}

// best_index_int8(16, kvalues, x): the nearest level (the upper on a tie; NaN: the last).
TFTF_HD int kq_iq4_index(float x) {
    if (x <= kq_iq4_value(0)) return 0;
    if (x >= kq_iq4_value(15)) return 15;
    int ml = 0, mu = 15;
    while (mu - ml > 1) {
        int mav = (ml + mu) / 2;
        if (x < kq_iq4_value(mav)) mu = mav;
        else ml = mav;
    }
    return x - kq_iq4_value(mu - 1) < kq_iq4_value(mu) - x ? mu - 1 : mu;
}

// The scale of one 32-element sub-block, weights `w`: the fit at −max/−127, then 15 nudged
// inverse scales kept on a strictly better fit.
KQ_FN float kq_iq4_fit(const float* x, const float* w) {
    float amax, max;
    kq_signed_max(x, 32, &amax, &max);
    if (amax < KQ_GROUP_MAX_EPS) return 0.0f;
    float d = -max / kq_iq4_value(0);
    float id = 1.0f / d;
    float sumqx = 0.0f, sumq2 = 0.0f;
    for (int i = 0; i < 32; i++) {
        float q = kq_iq4_value(kq_iq4_index(id * x[i]));
        sumqx += w[i] * q * x[i];
        sumq2 += w[i] * q * q;
    }
    d = sumq2 > 0.0f ? sumqx / sumq2 : 0.0f;
    float best = d * sumqx;
    for (int itry = -7; itry <= 7; itry++) {
        float idt = (float)(itry + -127) / max;
        float sx = 0.0f, s2 = 0.0f;
        for (int i = 0; i < 32; i++) {
            float q = kq_iq4_value(kq_iq4_index(idt * x[i]));
            sx += w[i] * q * x[i];
            s2 += w[i] * q * q;
        }
        if (s2 > 0.0f && sx * sx > best * s2) {
            d = sx / s2;
            best = d * sx;
        }
    }
    return d;
}

// Scales of the 32-element sub-blocks of block x (n values; weights' sigma2 over the block).
TFTF_HD void kq_iq4_scales(const float* x, const float* qw, int n, float* scales) {
    float w[32];
    float sigma2 = qw ? kq_sum_squares(x, n) * (2.0f / (float)n) : 0.0f;
    for (int ib = 0; ib < n / 32; ib++) {
        const float* xb = x + 32 * ib;
        if (qw) kq_imatrix_weights(w, qw + 32 * ib, xb, 32, sigma2);
        else
            for (int i = 0; i < 32; i++) w[i] = xb[i] * xb[i];
        scales[ib] = kq_iq4_fit(xb, w);
    }
}

// Levels of 32 values at inverse scale id, as nibbles into qs[16].
TFTF_HD void kq_iq4_pack(const float* x, float id, u8* qs) {
    u8 l[32];
    for (int i = 0; i < 32; i++) l[i] = (u8)kq_iq4_index(id * x[i]);
    for (int j = 0; j < 16; j++) qs[j] = (u8)(l[j] | (l[16 + j] << 4));
}

KQ_FN void kq_iq4_nl(const float* x, const float* qw, u8* y) {
    float d;
    kq_iq4_scales(x, qw, 32, &d);
    kq_put_f16(y, d);
    kq_iq4_pack(x, d != 0.0f ? 1.0f / d : 0.0f, y + 2);
}

KQ_FN void kq_iq4_xs(const float* x, const float* qw, u8* y) {
    float scales[8];
    kq_iq4_scales(x, qw, KQ_QK_K, scales);
    float amax, max_scale;
    kq_signed_max(scales, 8, &amax, &max_scale);
    float d = -max_scale / 32.0f;
    kq_put_f16(y, d);
    float id = d != 0.0f ? 1.0f / d : 0.0f;
    u16 scales_h = 0;
    u8* scales_l = y + 4;
    for (int k = 0; k < 4; k++) scales_l[k] = 0;
    for (int ib = 0; ib < 8; ib++) {
        int l = kq_clamp(kq_nearest_int(id * scales[ib]), -32, 31);
        float dl = d * (float)l;
        float idl = dl != 0.0f ? 1.0f / dl : 0.0f;
        kq_iq4_pack(x + 32 * ib, idl, y + 8 + 16 * ib);
        u16 lu = (u16)(l + 32);
        scales_l[ib / 2] |= (u8)((lu & 0xF) << (4 * (ib % 2)));
        scales_h |= (u16)((lu >> 4) << (2 * ib));
    }
    y[2] = (u8)(scales_h & 0xFF);
    y[3] = (u8)(scales_h >> 8);
}

// ---- TQ1_0 / TQ2_0 (ternary.rs) ----

// 1/amax of the block (0 when amax is 0), amax's f16 into d.
TFTF_HD float kq_inverse_amax(const float* x, u8* d) {
    float amax = 0.0f;
    for (int i = 0; i < KQ_QK_K; i++) amax = kq_cmax(amax, kq_abs(x[i]));
    kq_put_f16(d, amax);
    return amax != 0.0f ? 1.0f / amax : 0.0f;
}

// lroundf(x·id) + 1 as C computes it (half away from zero; out of range: INT64_MIN's low bits).
TFTF_HD int kq_trit(float x, float id) {
    float v = x * id;
    i64 r;
    if (kq_abs(v) < 9223372036854775808.0f) {
        r = (i64)v;
        float frac = v - (float)r;
        if (frac >= 0.5f) r += 1;
        if (frac <= -0.5f) r -= 1;
    } else {
        r = (i64)0x8000000000000000ull;
    }
    return (int)(u32)(u64)r + 1;
}

// Five (or four and a zero) trits base 3, scaled into a byte as ggml packs them.
TFTF_HD u8 kq_trits_byte(const int* t, int n) {
    u8 q = 0;
    for (int k = 0; k < n; k++) q = (u8)(q * 3 + (u8)t[k]);
    return (u8)(((u32)q * 256 + 242) / 243);
}

KQ_FN void kq_tq1_0(const float* x, u8* y) {
    float id = kq_inverse_amax(x, y + 52);
    int t[5];
    for (int m = 0; m < 32; m++) {
        for (int n = 0; n < 5; n++) t[n] = kq_trit(x[m + 32 * n], id);
        y[m] = kq_trits_byte(t, 5);
    }
    for (int m = 0; m < 16; m++) {
        for (int n = 0; n < 5; n++) t[n] = kq_trit(x[160 + m + 16 * n], id);
        y[32 + m] = kq_trits_byte(t, 5);
    }
    for (int j = 0; j < 4; j++) {
        for (int n = 0; n < 4; n++) t[n] = kq_trit(x[240 + j + 4 * n], id);
        t[4] = 0;
        y[48 + j] = kq_trits_byte(t, 5);
    }
}

KQ_FN void kq_tq2_0(const float* x, u8* y) {
    float id = kq_inverse_amax(x, y + 64);
    for (int h = 0; h < 2; h++)
        for (int m = 0; m < 32; m++) {
            u8 q = 0;
            for (int n = 0; n < 4; n++)
                q = (u8)(q + (u8)((kq_trit(x[128 * h + m + 32 * n], id) & 3) << (2 * n)));
            y[32 * h + m] = q;
        }
}

// One block of `ty` from its values `x` and its columns' importance weights `qw` (or null).
// `row_sigma2`: Σx²/n over the block's whole row, which only the legacy types' weights read.
KQ_FN void kq_encode_block(int ty, const float* x, const float* qw, float row_sigma2, u8* y) {
    switch (ty) {
        case KQ_Q4_0: case KQ_Q4_1: case KQ_Q5_0: case KQ_Q5_1: {
            float w[32];
            if (qw)
                for (int j = 0; j < 32; j++) w[j] = qw[j] * sqrt_f32(row_sigma2 + x[j] * x[j]);
            kq_legacy(ty, x, qw ? w : 0, y);
            return;
        }
        case KQ_Q2_K: kq_q2_k(x, qw, y); return;
        case KQ_Q3_K: kq_q3_k(x, qw, y); return;
        case KQ_Q4_K: kq_q45_k(15, x, qw, y); return;
        case KQ_Q5_K: kq_q45_k(31, x, qw, y); return;
        case KQ_Q6_K: kq_q6_k(x, qw, y); return;
        case KQ_IQ4_NL: kq_iq4_nl(x, qw, y); return;
        case KQ_IQ4_XS: kq_iq4_xs(x, qw, y); return;
        case KQ_TQ1_0: kq_tq1_0(x, y); return;
        case KQ_TQ2_0: kq_tq2_0(x, y); return;
    }
}
