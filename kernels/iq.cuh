// What the IQ2 and IQ3 sub-block fits share (src/ops/gguf/kquants/iq_signs.rs, ggml's
// quantize_row_iq2_*_impl / quantize_row_iq3_*_impl): the signs split off in masks of 8 (made
// even where 7 of 8 bits are stored), the least-squares fit of the odd levels 2·l + 1, a
// negative scale turned positive by flipping the signs, and the super-block scale over the
// sub-blocks'. Sub-blocks hold at most IQ_MAX_N values (G = n / 8 groups).
#pragma once
#include "iq_grid.cuh"
#include "kquant.cuh"

#define IQ_MAX_N 32
#define IQ_MAX_G 4
// Grid groups a sub-block holds at most: IQ2's of 8 (IQ_MAX_G), IQ3's 8 of 4.
#define IQ_MAX_GROUPS 8

// The signs of xb[0..n] (masks of 8; with even_signs the flips made even by turning the
// cheapest element, 7 bits kept) into signs[0..n/8], the magnitudes they leave into xval.
TFTF_HD void iq_split_signs(bool even_signs, const float* xb, const float* weight, int n,
                            u8* signs, float* xval) {
    for (int k = 0; k < n / 8; k++) {
        u8 s = 0;
        int nflip = 0;
        for (int i = 0; i < 8; i++) {
            float e = xb[8 * k + i];
            if (e >= 0.0f) {
                xval[8 * k + i] = e;
            } else {
                xval[8 * k + i] = -e;
                nflip++;
                s |= (u8)(1 << i);
            }
        }
        if (even_signs) {
            if (nflip % 2 == 1) {
                int imin = 0;
                float min = weight[8 * k] * xb[8 * k] * xb[8 * k];
                for (int i = 1; i < 8; i++) {
                    float c = weight[8 * k + i] * xb[8 * k + i] * xb[8 * k + i];
                    if (c < min) {
                        min = c;
                        imin = i;
                    }
                }
                xval[8 * k + imin] = -xval[8 * k + imin];
                s ^= (u8)(1 << imin);
            }
            s &= 127;
        }
        signs[k] = s;
    }
}

// (Σ w x q, Σ w q²) with q = 2 l + 1, in element order.
TFTF_HD void iq_fit(const float* weight, const float* xval, const i8* levels, int n, float* sumqx,
                    float* sumq2) {
    float a = 0.0f, b = 0.0f;
    for (int i = 0; i < n; i++) {
        float q = (float)(2 * (int)levels[i] + 1);
        a += weight[i] * xval[i] * q;
        b += weight[i] * q * q;
    }
    *sumqx = a;
    *sumq2 = b;
}

// The largest magnitude, as ggml's MAX keeps it.
TFTF_HD float iq_max_magnitude(const float* xval, int n) {
    float max = xval[0];
    for (int i = 1; i < n; i++) max = kq_cmax(max, xval[i]);
    return max;
}

// `scale` refitted to `levels` by least squares; kept where the levels carry no weight.
TFTF_HD float iq_refit(const float* weight, const float* xval, const i8* levels, int n,
                       float scale) {
    float sumqx, sumq2;
    iq_fit(weight, xval, levels, n, &sumqx, &sumq2);
    return sumq2 > 0.0f ? sumqx / sumq2 : scale;
}

// `scale` made non-negative, each of the g sign masks flipped with it when it was negative
// (7 bits with even_signs).
TFTF_HD float iq_unsigned_scale(float scale, u8* signs, int g, bool even_signs) {
    if (scale < 0.0f) {
        u8 mask = even_signs ? 127 : 255;
        for (int k = 0; k < g; k++) signs[k] = (u8)(~signs[k] & mask);
        return -scale;
    }
    return scale;
}

// The best fit of a candidate-scale search so far: its scale, levels, the groups it left on
// the grid, and scale · Σ w x q, what a candidate must beat.
struct IqBest {
    float scale;
    float score;
    i8 levels[IQ_MAX_N];
    bool on_grid[IQ_MAX_GROUPS];
};

// No fit yet: `scale` and each of the g groups' `on_grid` stand until a candidate beats a
// score of 0.
TFTF_HD void iq_best_init(IqBest* b, float scale, int n, int g, bool on_grid) {
    b->scale = scale;
    b->score = 0.0f;
    for (int i = 0; i < n; i++) b->levels[i] = 0;
    for (int k = 0; k < g; k++) b->on_grid[k] = on_grid;
}

// Keeps the candidate (levels, on_grid) when its fit explains more than the best so far.
TFTF_HD void iq_best_consider(IqBest* b, const float* weight, const float* xval, const i8* levels,
                              const bool* on_grid, int n, int g) {
    float sumqx, sumq2;
    iq_fit(weight, xval, levels, n, &sumqx, &sumq2);
    if (sumq2 > 0.0f && sumqx * sumqx > b->score * sumq2) {
        b->scale = sumqx / sumq2;
        b->score = b->scale * sumqx;
        for (int i = 0; i < n; i++) b->levels[i] = levels[i];
        for (int k = 0; k < g; k++) b->on_grid[k] = on_grid[k];
    }
}

// Sub-block scales and their MAX (mod.rs SubScales).
struct IqSubScales {
    float scales[16];
    float max;
};

TFTF_HD void iq_sub_init(IqSubScales* s) {
    for (int i = 0; i < 16; i++) s->scales[i] = 0.0f;
    s->max = 0.0f;
}

TFTF_HD void iq_sub_set(IqSubScales* s, int ib, float scale) {
    s->scales[ib] = scale;
    s->max = kq_cmax(s->max, scale);
}

// The super-block scale *d = max / top, the f16 of d · fudge written to y[0..2]; false
// (nothing written) when every scale is 0.
TFTF_HD bool iq_sub_put_super_scale(const IqSubScales* s, float top, float fudge, u8* y,
                                    float* d) {
    if (s->max == 0.0f) return false;
    *d = s->max / top;
    kq_put_f16(y, *d * fudge);
    return true;
}

// The grid index of `levels` (*on_grid true); off the grid (*on_grid false), that of the
// neighbour nearest xval at `scale` in w-weighted squared distance, Σ w (scale·coord - x)² in
// coordinate order, strictly lowest, the first on ties (the first listed when every distance is
// NaN), whose levels replace `levels` (ggml's iq2_find_best_neighbour, iq3_find_best_neighbour).
TFTF_HD int iq_to_grid(const IqGrid& g, i8* levels, const float* xval, const float* w,
                       float scale, bool* on_grid) {
    int index = iq_index_of(g, levels);
    *on_grid = index >= 0;
    if (index >= 0) return index;
    const u16* list = 0;
    int n = iq_neighbours(g, levels, &list);
    float best_d2 = 3.40282347e+38f;  // f32::MAX
    int best = list[0];
    for (int c = 0; c < n; c++) {
        int j = list[c];
        float d2 = 0.0f;
        for (int i = 0; i < g.dims; i++) {
            float diff = scale * (float)iq_coord(g, j, i) - xval[i];
            d2 += w[i] * diff * diff;
        }
        if (d2 < best_d2) {
            best_d2 = d2;
            best = j;
        }
    }
    iq_set_levels(g, best, levels);
    return best;
}

TFTF_HD void iq_put_u32(u8* y, u32 v) {
    y[0] = (u8)v;
    y[1] = (u8)(v >> 8);
    y[2] = (u8)(v >> 16);
    y[3] = (u8)(v >> 24);
}
