// ggml's 1-bit lattice encoders (src/ops/gguf/kquants/iq1.rs): IQ1_S (50 bytes per 256) and IQ1_M
// (56 bytes), one super-block per call. Ternary levels 0, 1, 2 (values -1, 0, 1 shifted by ±δ,
// δ = 1/8) in groups of 8 on the 2048-point grid kgrid_1bit_2048 (`tables`: its blob, iq_grid.cuh,
// neighbour lists of the 3 nearest distances). Per sub-block the values are sorted (glibc's qsort,
// a merge sort: ties and NaN keep their order), every split into three runs is scored from prefix
// sums, groups off the grid move to the neighbour nearest at the fitted scale. Every float
// operation is the Rust encoder's, in its order, so a block's bytes are the CPU's and
// llama-quantize's.
#pragma once
#include "iq.cuh"

// GROUP_MAX_EPS_IQ1_S, GROUP_MAX_EPS_IQ1_M.
#define IQ1_EPS_S 1e-12f
#define IQ1_EPS_M 1e-7f

// Level l (0..=2) of the shifted values x_p = {-1 + δ, δ, 1 + δ} or, `minus`, x_m = {-1 - δ, -δ,
// 1 - δ} (δ = 0.125: all exact).
TFTF_HD float iq1_value(bool minus, int l) {
    if (minus) return l == 0 ? -1.125f : l == 1 ? -0.125f : 0.875f;
    return l == 0 ? -0.875f : l == 1 ? 0.125f : 1.125f;
}

// Level i (0..=2) of grid point k.
TFTF_HD int iq1_level(const IqGrid& g, int k, int i) { return (iq_coord(g, k, i) - 1) / 2; }

// The largest magnitude (fabsf, C's MAX from xb[0]).
TFTF_HD float iq1_max_abs(const float* xb, int n) {
    float max = kq_abs(xb[0]);
    for (int i = 1; i < n; i++) max = kq_cmax(max, kq_abs(xb[i]));
    return max;
}

// The order of xb[0..n] (n 16 or 32, a power of two) as glibc's qsort leaves (x[j], j) under
// iq1_sort_helper: its merge sort (halves n / 2, the left run's head taken unless greater). On a
// power of two the top-down halving merges exactly the runs a bottom-up pass does.
TFTF_HD void iq1_sorted_order(const float* xb, int n, int* order) {
    float v[32], tv[32];
    int ix[32], ti[32];
    for (int j = 0; j < n; j++) {
        v[j] = xb[j];
        ix[j] = j;
    }
    for (int w = 1; w < n; w *= 2) {
        for (int lo = 0; lo < n; lo += 2 * w) {
            int mid = lo + w, hi = lo + 2 * w;
            int i = lo, j = mid, o = lo;
            while (i < mid && j < hi) {
                if (v[i] > v[j]) {
                    tv[o] = v[j];
                    ti[o] = ix[j];
                    j++;
                } else {
                    tv[o] = v[i];
                    ti[o] = ix[i];
                    i++;
                }
                o++;
            }
            while (i < mid) {
                tv[o] = v[i];
                ti[o] = ix[i];
                i++;
                o++;
            }
            while (j < hi) {
                tv[o] = v[j];
                ti[o] = ix[j];
                j++;
                o++;
            }
        }
        for (int j = 0; j < n; j++) {
            v[j] = tv[j];
            ix[j] = ti[j];
        }
    }
    for (int j = 0; j < n; j++) order[j] = ix[j];
}

// Levels 0, 1, 2 by sorted position (below i1, i1..i2, from i2); a negative *scale is made
// positive by mirroring them (2 - l). Returns whether it mirrored.
TFTF_HD bool iq1_split_levels(const int* order, int n, int i1, int i2, float* scale, i8* levels) {
    for (int j = 0; j < n; j++) levels[order[j]] = (i8)(j < i1 ? 0 : j < i2 ? 1 : 2);
    if (*scale < 0.0f) {
        for (int j = 0; j < n; j++) levels[j] = (i8)(2 - levels[j]);
        *scale = -*scale;
        return true;
    }
    return false;
}

// The group of 8 `levels` on the grid: its index, or (*hit false) the neighbour whose shifted
// values at `scale` are strictly nearest xb in weighted squared distance, the first on ties (the
// first neighbour when none is finite and below f32::MAX).
TFTF_HD int iq1_to_grid(const IqGrid& g, const i8* levels, const float* xb, const float* weight,
                        float scale, bool minus, bool* hit) {
    int index = iq_index_of(g, levels);
    if (index >= 0) {
        *hit = true;
        return index;
    }
    *hit = false;
    const u16* list = 0;
    int n = iq_neighbours(g, levels, &list);
    float best_d2 = u2f(0x7F7FFFFFu);
    int best = (int)list[0];
    for (int c = 0; c < n; c++) {
        int k = (int)list[c];
        float d2 = 0.0f;
        for (int i = 0; i < 8; i++) {
            float q = iq1_value(minus, iq1_level(g, k, i));
            float diff = scale * q - xb[i];
            d2 += weight[i] * diff * diff;
        }
        if (d2 < best_d2) {
            best_d2 = d2;
            best = k;
        }
    }
    return best;
}

// (Σ w q x, Σ w q²) over the ng groups' grid points, group k's levels shifted by minus[k].
TFTF_HD void iq1_refit(const IqGrid& g, const float* xb, const float* weight, const int* index,
                       const bool* minus, int ng, float* sumqx, float* sumq2) {
    float a = 0.0f, b = 0.0f;
    for (int k = 0; k < ng; k++)
        for (int j = 0; j < 8; j++) {
            float w = weight[8 * k + j];
            float q = iq1_value(minus[k], iq1_level(g, index[k], j));
            a += w * q * xb[8 * k + j];
            b += w * q * q;
        }
    *sumqx = a;
    *sumq2 = b;
}

// A sub-block scale's 3-bit level.
TFTF_HD int iq1_scale_level(float id, float scale) {
    return kq_clamp(kq_nearest_int(0.5f * (id * scale - 1.0f)), 0, 7);
}

// IQ1_M's shift of group k under split best_k (bit 1: group 0 -δ, bit 0: group 1 -δ).
TFTF_HD bool iq1_m_minus(int best_k, int k) { return k == 0 ? best_k >= 2 : best_k % 2 == 1; }

// IQ1_S's exhaustive split of a sub-block of 32: levels, scale >= 0, shift ±1; false for a
// skipped one (all below GROUP_MAX_EPS_IQ1_S, or no split scored).
TFTF_HD bool iq1_s_split(const float* xb, const float* weight, i8* levels, float* scale_out,
                         int* shift_out) {
    float max = iq1_max_abs(xb, 32);
    if (max < IQ1_EPS_S) return false;
    int order[32];
    iq1_sorted_order(xb, 32, order);
    float sumx[33], sumw[33];
    sumx[0] = 0.0f;
    sumw[0] = 0.0f;
    for (int j = 0; j < 32; j++) {
        int i = order[j];
        sumx[j + 1] = sumx[j] + weight[i] * xb[i];
        sumw[j + 1] = sumw[j] + weight[i];
    }
    float best_score = -u2f(0x7F7FFFFFu), scale = max;
    int b1 = -1, b2 = -1, bshift = 0;
    for (int i1 = 0; i1 <= 32; i1++)
        for (int i2 = i1; i2 <= 32; i2++)
            for (int s = 0; s < 2; s++) {
                bool minus = s == 1;
                float x0 = iq1_value(minus, 0), x1 = iq1_value(minus, 1), x2 = iq1_value(minus, 2);
                float sumqx = (sumx[i1] - sumx[0]) * x0 + (sumx[i2] - sumx[i1]) * x1 +
                              (sumx[32] - sumx[i2]) * x2;
                float sumq2 = (sumw[i1] - sumw[0]) * x0 * x0 + (sumw[i2] - sumw[i1]) * x1 * x1 +
                              (sumw[32] - sumw[i2]) * x2 * x2;
                if (sumq2 > 0.0f && sumqx * sumqx > best_score * sumq2) {
                    scale = sumqx / sumq2;
                    best_score = scale * sumqx;
                    b1 = i1;
                    b2 = i2;
                    bshift = minus ? -1 : 1;
                }
            }
    if (b1 < 0) return false;
    if (iq1_split_levels(order, 32, b1, b2, &scale, levels)) bshift = -bshift;
    *scale_out = scale;
    *shift_out = bshift;
    return true;
}

// IQ1_M's exhaustive split of a sub-block of 16, each half with its own shift: levels, scale >= 0,
// best_k (as iq1_m_minus reads it); false for a skipped one. Scores from per-half prefix sums in
// ggml's closed form.
TFTF_HD bool iq1_m_split(const float* xb, const float* weight, i8* levels, float* scale_out,
                         int* best_k_out) {
    float max = iq1_max_abs(xb, 16);
    if (max < IQ1_EPS_M) return false;
    int order[16];
    iq1_sorted_order(xb, 16, order);
    float px[2][17], pw[2][17];
    for (int h = 0; h < 2; h++)
        for (int j = 0; j < 17; j++) {
            px[h][j] = 0.0f;
            pw[h][j] = 0.0f;
        }
    for (int j = 0; j < 16; j++) {
        int i = order[j];
        int h = i >= 8 ? 1 : 0;
        px[h][j + 1] = px[h][j] + weight[i] * xb[i];
        px[1 - h][j + 1] = px[1 - h][j];
        pw[h][j + 1] = pw[h][j] + weight[i];
        pw[1 - h][j + 1] = pw[1 - h][j];
    }
    float txs[2] = {px[0][16], px[1][16]}, tws[2] = {pw[0][16], pw[1][16]};
    float xp0 = iq1_value(false, 0), xp1 = iq1_value(false, 1), xp2 = iq1_value(false, 2);
    float xm0 = iq1_value(true, 0), xm1 = iq1_value(true, 1), xm2 = iq1_value(true, 2);
    float p2 = xp2, m2 = xm2;
    float cp1 = xp0 * xp0 - xp1 * xp1;
    float cp2 = xp1 * xp1 - xp2 * xp2;
    float cm1 = xm0 * xm0 - xm1 * xm1;
    float cm2 = xm1 * xm1 - xm2 * xm2;
    float best_score = -u2f(0x7F7FFFFFu), scale = max;
    int b1 = -1, b2 = -1, bk = -1;
    for (int i1 = 0; i1 <= 16; i1++)
        for (int i2 = i1; i2 <= 16; i2++) {
            float qx_p[2], qx_m[2], q2_p[2], q2_m[2];
            for (int h = 0; h < 2; h++) {
                float sx = px[h][i1] + px[h][i2];
                qx_p[h] = txs[h] * p2 - sx;
                qx_m[h] = txs[h] * m2 - sx;
                q2_p[h] = tws[h] * p2 * p2 + pw[h][i1] * cp1 + pw[h][i2] * cp2;
                q2_m[h] = tws[h] * m2 * m2 + pw[h][i1] * cm1 + pw[h][i2] * cm2;
            }
            float sumqx[4] = {qx_p[0] + qx_p[1], qx_p[0] + qx_m[1], qx_m[0] + qx_p[1],
                              qx_m[0] + qx_m[1]};
            float sumq2[4] = {q2_p[0] + q2_p[1], q2_p[0] + q2_m[1], q2_m[0] + q2_p[1],
                              q2_m[0] + q2_m[1]};
            for (int k = 0; k < 4; k++)
                if (sumq2[k] > 0.0f && sumqx[k] * sumqx[k] > best_score * sumq2[k]) {
                    scale = sumqx[k] / sumq2[k];
                    best_score = scale * sumqx[k];
                    b1 = i1;
                    b2 = i2;
                    bk = k;
                }
        }
    if (b1 < 0) return false;
    if (iq1_split_levels(order, 16, b1, b2, &scale, levels)) bk = 3 - bk;
    *scale_out = scale;
    *best_k_out = bk;
    return true;
}

// ---- IQ1_S (iq1.rs quantize_row_iq1_s): 50 bytes, d | qs[32] | qh[8] (u16) ----
// `qw` must be given (ggml asserts it; the Rust encoder panics without).

KQ_FN void kq_iq1_s(const float* x, const float* qw, const u8* tables, u8* y) {
    const int QH = 34;
    for (int i = 0; i < 50; i++) y[i] = 0;
    IqGrid g = iq_grid(tables);
    float sigma2 = 2.0f * kq_sum_squares(x, KQ_QK_K) / (float)KQ_QK_K;
    IqSubScales sub;
    iq_sub_init(&sub);
    int shifts[8];
    for (int ib = 0; ib < 8; ib++) shifts[ib] = 1;
    for (int ib = 0; ib < 8; ib++) {
        const float* xb = x + 32 * ib;
        float weight[32];
        kq_imatrix_weights(weight, qw + 32 * ib, xb, 32, sigma2);
        i8 levels[32];
        float scale;
        int shift;
        if (!iq1_s_split(xb, weight, levels, &scale, &shift)) continue;
        bool minus = shift != 1;
        int index[4];
        bool minus4[4];
        bool all_on_grid = true;
        for (int k = 0; k < 4; k++) {
            bool hit;
            index[k] = iq1_to_grid(g, levels + 8 * k, xb + 8 * k, weight + 8 * k, scale, minus, &hit);
            minus4[k] = minus;
            all_on_grid = all_on_grid && hit;
        }
        if (!all_on_grid) {
            float sumqx, sumq2;
            iq1_refit(g, xb, weight, index, minus4, 4, &sumqx, &sumq2);
            if (sumqx > 0.0f && sumq2 > 0.0f) scale = sumqx / sumq2;
        }
        u32 h = 0;
        for (int k = 0; k < 4; k++) {
            y[2 + 4 * ib + k] = (u8)index[k];
            h |= ((u32)index[k] >> 8) << (3 * k);
        }
        y[QH + 2 * ib] = (u8)(h & 0xFF);
        y[QH + 2 * ib + 1] = (u8)((h >> 8) & 0xFF);
        iq_sub_set(&sub, ib, scale);
        shifts[ib] = shift;
    }
    float d;
    if (!iq_sub_put_super_scale(&sub, 15.0f, 1.125f, y, &d)) return;
    float id = 1.0f / d;
    for (int ib = 0; ib < 8; ib++) {
        int l = iq1_scale_level(id, sub.scales[ib]);
        if (shifts[ib] == -1) l |= 8;
        y[QH + 2 * ib + 1] = (u8)(y[QH + 2 * ib + 1] | (l << 4));
    }
}

// ---- IQ1_M (iq1.rs quantize_row_iq1_m): 56 bytes, qs[32] | qh[16] | scales[8] ----
// Weights qw·sqrt(sigma2 + x²) with `qw`, x² without (as ggml).

// Sub-block ib's 16 weights.
TFTF_HD void iq1_m_weights(const float* x, const float* qw, int ib, float sigma2, float* weight) {
    const float* xb = x + 16 * ib;
    if (qw) {
        kq_imatrix_weights(weight, qw + 16 * ib, xb, 16, sigma2);
    } else {
        for (int i = 0; i < 16; i++) weight[i] = xb[i] * xb[i];
    }
}

KQ_FN void kq_iq1_m(const float* x, const float* qw, const u8* tables, u8* y) {
    const int QH = 32, SC = 48;
    for (int i = 0; i < 56; i++) y[i] = 0;
    IqGrid g = iq_grid(tables);
    float sigma2 = 2.0f * kq_sum_squares(x, KQ_QK_K) / (float)KQ_QK_K;
    float scales[16];
    int shifts[16];
    for (int ib = 0; ib < 16; ib++) {
        scales[ib] = 0.0f;
        shifts[ib] = 0;
    }
    float max_scale = 0.0f;
    for (int ib = 0; ib < 16; ib++) {
        const float* xb = x + 16 * ib;
        float weight[16];
        iq1_m_weights(x, qw, ib, sigma2, weight);
        i8 levels[16];
        float scale;
        int best_k;
        if (!iq1_m_split(xb, weight, levels, &scale, &best_k)) continue;
        int index[2];
        bool minus[2];
        bool all_on_grid = true;
        for (int k = 0; k < 2; k++) {
            bool hit;
            minus[k] = iq1_m_minus(best_k, k);
            index[k] =
                iq1_to_grid(g, levels + 8 * k, xb + 8 * k, weight + 8 * k, scale, minus[k], &hit);
            all_on_grid = all_on_grid && hit;
        }
        if (!all_on_grid) {
            float sumqx, sumq2;
            iq1_refit(g, xb, weight, index, minus, 2, &sumqx, &sumq2);
            if (sumqx > 0.0f && sumq2 > 0.0f) scale = sumqx / sumq2;
        }
        y[2 * ib] = (u8)index[0];
        y[2 * ib + 1] = (u8)index[1];
        y[QH + ib] = (u8)((index[0] >> 8) | ((index[1] >> 8) << 4));
        scales[ib] = scale;
        shifts[ib] = best_k;
        max_scale = kq_cmax(max_scale, scale);
    }
    if (max_scale == 0.0f) return;
    // The sub-block scales, then the super-block scale refitted to every element's level.
    u32 sc[4] = {0, 0, 0, 0};
    float d = max_scale / 15.0f;
    float id = 1.0f / d;
    float sumqx = 0.0f, sumq2 = 0.0f;
    for (int ib = 0; ib < 16; ib++) {
        int l = iq1_scale_level(id, scales[ib]);
        sc[ib / 4] |= (u32)l << (3 * (ib % 4));
        int s = shifts[ib];
        u8 mask = (u8)(s == 0 ? 0x00 : s == 1 ? 0x80 : s == 2 ? 0x08 : 0x88);
        y[QH + ib] = (u8)(y[QH + ib] | mask);
        float weight[16];
        iq1_m_weights(x, qw, ib, sigma2, weight);
        const float* xb = x + 16 * ib;
        float ls = (float)(2 * l + 1);
        for (int k = 0; k < 2; k++) {
            bool minus = iq1_m_minus(s, k);
            int high = ((int)y[QH + ib] << (8 - 4 * k)) & 0x700;
            int p = (int)y[2 * ib + k] + high;
            for (int j = 0; j < 8; j++) {
                float w = weight[8 * k + j];
                float q = iq1_value(minus, iq1_level(g, p, j)) * ls;
                sumqx += w * q * xb[8 * k + j];
                sumq2 += w * q * q;
            }
        }
    }
    if (sumq2 > 0.0f) d = sumqx / sumq2;
    u32 s = f32_to_f16(d * 1.1125f);
    sc[0] |= (s & 0x000Fu) << 12;
    sc[1] |= (s & 0x00F0u) << 8;
    sc[2] |= (s & 0x0F00u) << 4;
    sc[3] |= s & 0xF000u;
    for (int j = 0; j < 4; j++) {
        y[SC + 2 * j] = (u8)(sc[j] & 0xFF);
        y[SC + 2 * j + 1] = (u8)((sc[j] >> 8) & 0xFF);
    }
}
