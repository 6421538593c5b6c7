// ggml's 2-bit lattice encoders IQ2_XXS, IQ2_XS and IQ2_S (src/ops/gguf/kquants/iq2.rs), one
// 256-element super-block per call, every float operation in the Rust encoders' order: groups
// of 8 magnitudes snap to a point of an 8-dimensional grid of odd coordinates (the lattice
// tables of iq_grid.cuh, uploaded with the launch), candidate sub-block scales are tried and the
// best weighted least-squares fit is kept, re-snapped and refitted.
#pragma once
#include "iq.cuh"

#define IQ2_K_MAX_Q 3

// What differs between the three types' sub-block searches (iq2.rs `Variant`).
struct Iq2Variant {
    float eps;
    bool even_signs;
    bool qp_start;
    int nscale;
    bool resnap_all;
    bool imatrix_only;
};

// The level (0..=2) of coordinate 2 l + 1 nearest id · v.
TFTF_HD i8 iq2_snap(float id, float v) {
    return (i8)kq_clamp(kq_nearest_int(0.5f * (id * v - 1.0f)), 0, IQ2_K_MAX_Q - 1);
}

// A sub-block scale's 4-bit level l, the one (1 + 2 l) d / 2 is nearest.
TFTF_HD u8 iq2_scale_level(float id, float scale) {
    return (u8)kq_clamp(kq_nearest_int(0.5f * (id * scale - 1.0f)), 0, 15);
}

// One sub-block of n values (n / 8 groups) with weights `weight`: false when skipped (all
// below eps, or IQ2_XXS's first fit not positive); else its scale, grid indices and signs.
KQ_FN bool iq2_fit_sub_block(const Iq2Variant& v, const IqGrid& g, const float* xb,
                             const float* weight, int n, float* scale_out, u16* index,
                             u8* signs) {
    int groups = n / 8;
    float waux[IQ_MAX_N], xval[IQ_MAX_N];
    for (int i = 0; i < n; i++) waux[i] = sqrt_f32(weight[i]);
    iq_split_signs(v.even_signs, xb, weight, n, signs, xval);
    float max = iq_max_magnitude(xval, n);
    if (max < v.eps) return false;
    float scale, eff_max;
    if (v.qp_start) {
        u8 unused[IQ_MAX_N];
        scale = kq_make_qp_quants(IQ2_K_MAX_Q + 1, n, xval, unused, weight);
        eff_max = scale * (float)IQ2_K_MAX_Q;
        if (eff_max <= 0.0f) return false;
    } else {
        scale = max / (float)(2 * IQ2_K_MAX_Q - 1);
        eff_max = max;
    }
    IqBest best;
    iq_best_init(&best, scale, n, groups, true);
    for (int is = -v.nscale; is <= v.nscale; is++) {
        float id = ((float)(2 * IQ2_K_MAX_Q - 1) + (float)is * 0.1f) / eff_max;
        float this_scale = 1.0f / id;
        i8 aux[IQ_MAX_N];
        bool aux_on_grid[IQ_MAX_G];
        for (int k = 0; k < groups; k++) {
            for (int i = 0; i < 8; i++) aux[8 * k + i] = iq2_snap(id, xval[8 * k + i]);
            iq_to_grid(g, aux + 8 * k, xval + 8 * k, waux + 8 * k, this_scale, &aux_on_grid[k]);
        }
        iq_best_consider(&best, weight, xval, aux, aux_on_grid, n, groups);
    }
    scale = best.scale;
    bool off_grid = false;
    for (int k = 0; k < groups; k++) off_grid |= !best.on_grid[k];
    bool resnap = v.resnap_all ? scale > 0.0f : off_grid && scale > 0.0f;
    if (resnap) {
        float id = 1.0f / scale;
        for (int k = 0; k < groups; k++) {
            if (best.on_grid[k] && !v.resnap_all) continue;
            i8* group = best.levels + 8 * k;
            for (int i = 0; i < 8; i++) group[i] = iq2_snap(id, xval[8 * k + i]);
            bool unused;
            iq_to_grid(g, group, xval + 8 * k, waux + 8 * k, scale, &unused);
        }
        scale = iq_refit(weight, xval, best.levels, n, scale);
    }
    *scale_out = iq_unsigned_scale(scale, signs, groups, v.even_signs);
    // Every group ends on the grid; only NaN input does not, and then takes grid point 0.
    for (int k = 0; k < groups; k++) {
        int index_k = iq_index_of(g, best.levels + 8 * k);
        index[k] = (u16)(index_k >= 0 ? index_k : 0);
    }
    return true;
}

// The weights of sub-block ib (n values from xb): the imatrix's qw·sqrt(sigma2 + x²), else
// floor + x².
TFTF_HD void iq2_weights(const float* xb, const float* qw, int n, float sigma2, float floor,
                         float* weight) {
    if (qw) {
        kq_imatrix_weights(weight, qw, xb, n, sigma2);
    } else {
        for (int i = 0; i < n; i++) weight[i] = floor + xb[i] * xb[i];
    }
}

// iq2.rs `fit_sub_blocks`' (sigma2, floor) of the super-block x: the imatrix's σ² (the mean
// square; twice it where the type also weights without an imatrix), and the no-imatrix floor.
TFTF_HD void iq2_sigma2(const Iq2Variant& v, const float* x, float* sigma2, float* floor) {
    float ss = kq_sum_squares(x, KQ_QK_K);
    if (v.imatrix_only) {
        *sigma2 = ss / (float)KQ_QK_K;
        *floor = 0.0f;
    } else {
        *sigma2 = 2.0f * ss / (float)KQ_QK_K;
        *floor = 0.25f * *sigma2;
    }
}

// Fits each of the 256 / n sub-blocks of x as v says (iq2.rs `fit_sub_blocks`), hands each fit
// to store(ib, index, signs) and sets its scale in *sub (a skipped sub-block keeps 0).
template <class Store>
TFTF_HD void iq2_fit_sub_blocks(const Iq2Variant& v, const IqGrid& g, const float* x,
                                const float* qw, int n, IqSubScales* sub, Store store) {
    float sigma2, floor;
    iq2_sigma2(v, x, &sigma2, &floor);
    iq_sub_init(sub);
    for (int ib = 0; ib < KQ_QK_K / n; ib++) {
        float weight[IQ_MAX_N];
        iq2_weights(x + n * ib, qw ? qw + n * ib : 0, n, sigma2, floor, weight);
        float scale;
        u16 index[IQ_MAX_G];
        u8 signs[IQ_MAX_G];
        if (!iq2_fit_sub_block(v, g, x + n * ib, weight, n, &scale, index, signs)) continue;
        store(ib, index, signs);
        iq_sub_set(sub, ib, scale);
    }
}

// 16 sub-block scales as 4-bit levels, two a byte (even sub-block in the low nibble).
TFTF_HD void iq2_pack_scales(float id, const float* scales, u8* out) {
    for (int j = 0; j < 8; j++)
        out[j] = (u8)(iq2_scale_level(id, scales[2 * j]) | (iq2_scale_level(id, scales[2 * j + 1]) << 4));
}

// IQ2_XXS (66 bytes): d, then per 32-element sub-block two u32s (4 grid indices; 4 7-bit sign
// masks and the 4-bit scale).
KQ_FN void kq_iq2_xxs(const float* x, const float* qw, const u8* tables, u8* y) {
    const Iq2Variant v = {KQ_GROUP_MAX_EPS, true, true, 6, true, true};
    IqGrid g = iq_grid(tables);
    u32 q2[16];
    for (int i = 0; i < 16; i++) q2[i] = 0;
    IqSubScales sub;
    iq2_fit_sub_blocks(v, g, x, qw, 32, &sub, [&](int ib, const u16* index, const u8* signs) {
        for (int k = 0; k < 4; k++) {
            q2[2 * ib] |= (u32)index[k] << (8 * k);
            q2[2 * ib + 1] |= (u32)signs[k] << (7 * k);
        }
    });
    for (int i = 0; i < 66; i++) y[i] = 0;
    float d;
    if (!iq_sub_put_super_scale(&sub, 31.0f, 1.0f, y, &d)) return;
    float id = 1.0f / d;
    for (int ib = 0; ib < 8; ib++) q2[2 * ib + 1] |= (u32)iq2_scale_level(id, sub.scales[ib]) << 28;
    for (int i = 0; i < 16; i++) iq_put_u32(y + 2 + 4 * i, q2[i]);
}

// IQ2_XS (74 bytes): d, 32 u16s (9-bit grid index, 7-bit sign mask), 8 bytes of scales.
KQ_FN void kq_iq2_xs(const float* x, const float* qw, const u8* tables, u8* y) {
    const Iq2Variant v = {KQ_GROUP_MAX_EPS, true, false, 9, false, true};
    IqGrid g = iq_grid(tables);
    u16 q2[32];
    for (int i = 0; i < 32; i++) q2[i] = 0;
    IqSubScales sub;
    iq2_fit_sub_blocks(v, g, x, qw, 16, &sub, [&](int ib, const u16* index, const u8* signs) {
        for (int k = 0; k < 2; k++) q2[2 * ib + k] = (u16)(index[k] | ((u16)signs[k] << 9));
    });
    for (int i = 0; i < 74; i++) y[i] = 0;
    float d;
    if (!iq_sub_put_super_scale(&sub, 31.0f, 1.0f, y, &d)) return;
    for (int i = 0; i < 32; i++) {
        y[2 + 2 * i] = (u8)q2[i];
        y[3 + 2 * i] = (u8)(q2[i] >> 8);
    }
    iq2_pack_scales(1.0f / d, sub.scales, y + 66);
}

// IQ2_S (82 bytes): d (times 0.9875), the indices' low bytes, the sign bytes, the indices' top
// 2 bits, 8 bytes of scales.
KQ_FN void kq_iq2_s(const float* x, const float* qw, const u8* tables, u8* y) {
    const Iq2Variant v = {1e-8f, false, false, 9, false, false};
    IqGrid g = iq_grid(tables);
    for (int i = 0; i < 82; i++) y[i] = 0;
    IqSubScales sub;
    iq2_fit_sub_blocks(v, g, x, qw, 16, &sub, [&](int ib, const u16* index, const u8* signs) {
        for (int k = 0; k < 2; k++) {
            int gi = 2 * ib + k;
            y[2 + gi] = (u8)index[k];
            y[66 + gi / 4] |= (u8)((index[k] >> 8) << (2 * (gi % 4)));
            y[2 + 32 + gi] = signs[k];
        }
    });
    float d;
    if (!iq_sub_put_super_scale(&sub, 31.0f, 0.9875f, y, &d)) return;
    iq2_pack_scales(1.0f / d, sub.scales, y + 74);
}
