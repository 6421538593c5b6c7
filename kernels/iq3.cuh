// ggml's 3-bit grid block encoders (src/ops/gguf/kquants/iq3.rs): IQ3_XXS (98 bytes per 256
// elements, the 256-point grid) and IQ3_S (110 bytes, the 512-point grid), with and without
// importance weights, one super-block per call. Groups of 4 magnitudes snap to points of a grid
// of odd coordinates 1..15 (an off-grid point to its best listed neighbour), 32-element
// sub-blocks keep the best of a range of candidate scales, and the signs are stored apart.
// Every float operation is the Rust encoder's, in its order, so a block's bytes are the CPU's —
// and llama-quantize's. `tables` is the blob of the type's grid (iq_grid.cuh): IQ3_XXS's
// kgrid_256 with neighbours at the 2 nearest distances, IQ3_S's kgrid_512 with 3.
#pragma once
#include "iq.cuh"

// Levels per coordinate (kMaxQ): coordinates 2·l + 1 for l in 0..8.
#define IQ3_KMAXQ 8

// The level (0..8) of coordinate 2·l + 1 nearest id · v.
TFTF_HD i8 iq3_snap(float id, float v) {
    return (i8)kq_clamp(kq_nearest_int(0.5f * (id * v - 1.0f)), 0, IQ3_KMAXQ - 1);
}

// A sub-block scale's 4-bit level l, the one (1 + 2 l)·d / 2 is nearest.
TFTF_HD u8 iq3_scale_level(float id, float scale) {
    return (u8)kq_clamp(kq_nearest_int(0.5f * (id * scale - 1.0f)), 0, 15);
}

// One 32-element sub-block xb with weights `weight`: the signs, then the candidate scales
// (15 + 0.2·is) / max, each snapping the 8 groups of 4 to the grid, the best least-squares fit
// kept; then groups re-snapped at the winner's scale and the scale refitted. `xxs` picks
// IQ3_XXS (skip below 1e-8, 7 even signs per 8, is in −15..=15, re-snap only the winner's
// off-grid groups) over IQ3_S (skip only an all-zero max, 8 signs, is in −9..=9, every group
// re-snapped). Returns false for a skipped sub-block; else its scale, levels[32] and signs[4].
KQ_FN bool iq3_fit_sub_block(const IqGrid& g, bool xxs, const float* xb, const float* weight,
                             float* scale_out, i8* levels_out, u8* signs) {
    float waux[32];
    for (int i = 0; i < 32; i++) waux[i] = sqrt_f32(weight[i]);
    float xval[32];
    iq_split_signs(xxs, xb, weight, 32, signs, xval);
    float max = iq_max_magnitude(xval, 32);
    if (xxs ? max < 1e-8f : max == 0.0f) return false;
    const bool resnap_all = !xxs;
    const int nscale = xxs ? 15 : 9;
    IqBest best;
    iq_best_init(&best, max / (float)(2 * IQ3_KMAXQ - 1), 32, 8, !resnap_all);
    for (int is = -nscale; is <= nscale; is++) {
        float id = ((float)(2 * IQ3_KMAXQ - 1) + (float)is * 0.2f) / max;
        float this_scale = 1.0f / id;
        i8 aux[32];
        bool aux_on_grid[8];
        for (int k = 0; k < 8; k++) {
            for (int i = 0; i < 4; i++) aux[4 * k + i] = iq3_snap(id, xval[4 * k + i]);
            iq_to_grid(g, aux + 4 * k, xval + 4 * k, waux + 4 * k, this_scale,
                         &aux_on_grid[k]);
        }
        iq_best_consider(&best, weight, xval, aux, aux_on_grid, 32, 8);
    }
    float scale = best.scale;
    bool any_off = false;
    for (int k = 0; k < 8; k++) any_off |= !best.on_grid[k];
    if (any_off && scale > 0.0f) {
        float id = 1.0f / scale;
        for (int k = 0; k < 8; k++) {
            if (best.on_grid[k] && !resnap_all) continue;
            i8 snapped[4];
            for (int i = 0; i < 4; i++) snapped[i] = iq3_snap(id, xval[4 * k + i]);
            bool hit;
            int index = iq_to_grid(g, snapped, xval + 4 * k, waux + 4 * k, scale, &hit);
            iq_set_levels(g, index, best.levels + 4 * k);
        }
        scale = iq_refit(weight, xval, best.levels, 32, scale);
    }
    *scale_out = iq_unsigned_scale(scale, signs, 4, xxs);
    for (int i = 0; i < 32; i++) levels_out[i] = best.levels[i];
    return true;
}

// The sub-block weights: the imatrix's qw·sqrt(sigma2 + x²), else x².
TFTF_HD void iq3_weights(const float* xb, const float* qw, float sigma2, float* weight) {
    if (qw) kq_imatrix_weights(weight, qw, xb, 32, sigma2);
    else
        for (int i = 0; i < 32; i++) weight[i] = xb[i] * xb[i];
}

// The grid index of 4 levels the fit left on the grid (every group it returns is).
TFTF_HD int iq3_grid_index(const IqGrid& g, const i8* levels) {
    int k = iq_index_of(g, levels);
    return k >= 0 ? k : 0;
}

// Fits each 32-element sub-block of x (iq3.rs), hands each fit to store(ib, levels, signs) and
// sets its scale in *sub (a skipped sub-block keeps 0).
template <class Store>
TFTF_HD void iq3_fit_sub_blocks(const IqGrid& g, bool xxs, const float* x, const float* qw,
                                IqSubScales* sub, Store store) {
    iq_sub_init(sub);
    float sigma2 = 2.0f * kq_sum_squares(x, KQ_QK_K) / (float)KQ_QK_K;
    for (int ib = 0; ib < 8; ib++) {
        const float* xb = x + 32 * ib;
        float weight[32];
        iq3_weights(xb, qw ? qw + 32 * ib : 0, sigma2, weight);
        float scale;
        i8 levels[32];
        u8 signs[4];
        if (!iq3_fit_sub_block(g, xxs, xb, weight, &scale, levels, signs)) continue;
        store(ib, levels, signs);
        iq_sub_set(sub, ib, scale);
    }
}

// ---- IQ3_XXS: d | qs[64] grid indices | 8 × u32 (four 7-bit sign masks, scale in bits 28..32) ----

KQ_FN void kq_iq3_xxs(const float* x, const float* qw, const u8* tables, u8* y) {
    IqGrid g = iq_grid(tables);
    for (int i = 0; i < 98; i++) y[i] = 0;
    u32 scales_and_signs[8];
    for (int ib = 0; ib < 8; ib++) scales_and_signs[ib] = 0;
    IqSubScales sub;
    iq3_fit_sub_blocks(g, true, x, qw, &sub, [&](int ib, const i8* levels, const u8* signs) {
        for (int k = 0; k < 8; k++) y[2 + 8 * ib + k] = (u8)iq3_grid_index(g, levels + 4 * k);
        scales_and_signs[ib] = (u32)signs[0] | ((u32)signs[1] << 7) | ((u32)signs[2] << 14) |
                               ((u32)signs[3] << 21);
    });
    float d;
    if (!iq_sub_put_super_scale(&sub, 31.0f, 1.0125f, y, &d)) {
        for (int i = 0; i < 98; i++) y[i] = 0;
        return;
    }
    float id = 1.0f / d;
    for (int ib = 0; ib < 8; ib++) {
        u32 s = scales_and_signs[ib] | ((u32)iq3_scale_level(id, sub.scales[ib]) << 28);
        iq_put_u32(y + 66 + 4 * ib, s);
    }
}

// ---- IQ3_S: d | qs[64] | qh[8] | signs[32] | scales[4] ----
// ggml's quirk kept: an all-zero sub-block does not advance the qs and signs cursors (the next
// sub-block's bytes take its place); qh is indexed by the sub-block. With every scale 0 the
// block keeps d = 0 and whatever grid indices were written.

KQ_FN void kq_iq3_s(const float* x, const float* qw, const u8* tables, u8* y) {
    const int QH = 66, SCALES = 106;
    IqGrid g = iq_grid(tables);
    for (int i = 0; i < 110; i++) y[i] = 0;
    int qs = 2, sg = 74;
    IqSubScales sub;
    iq3_fit_sub_blocks(g, false, x, qw, &sub, [&](int ib, const i8* levels, const u8* signs) {
        for (int k = 0; k < 8; k++) {
            int index = iq3_grid_index(g, levels + 4 * k);
            y[qs + k] = (u8)index;
            y[QH + ib] |= (u8)((index >> 8) << k);
        }
        qs += 8;
        for (int k = 0; k < 4; k++) y[sg + k] = signs[k];
        sg += 4;
    });
    float d;
    if (!iq_sub_put_super_scale(&sub, 31.0f, 1.033f, y, &d)) return;
    float id = 1.0f / d;
    for (int j = 0; j < 4; j++)
        y[SCALES + j] = (u8)(iq3_scale_level(id, sub.scales[2 * j]) |
                             (iq3_scale_level(id, sub.scales[2 * j + 1]) << 4));
}
