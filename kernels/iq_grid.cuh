// The lattice tables of the IQ1/IQ2/IQ3 encoders (ggml's iq2xs_init_impl / iq3xs_init_impl), as
// the host builds them (src/ops/gguf/kquants/tables.rs) and uploads them with a launch: one
// blob per lattice, little-endian:
//   u32 header[5]: dims (8 for IQ1/IQ2, 4 for IQ3), bits per level (2, 3), grid points, codes,
//                  neighbour entries;
//   u16 kgrid[points], padded to 4 bytes: point k's levels, level i in bits bits·i .. bits·i+bits
//                  (coordinate 2·level + 1);
//   i32 map[codes]: per code of levels (Σ level_i << bits·i): the grid index (>= 0), or
//                  -(1 + at) for a point off the grid, whose neighbour list is at neighbours[at]:
//                  its length n, then n grid indices, nearest first, ties by index;
//   u16 neighbours[entries].
#pragma once
#include "cast.cuh"

struct IqGrid {
    int dims;
    int bits;
    const u16* kgrid;
    const i32* map;
    const u16* neighbours;
};

TFTF_HD u32 iq_u32_at(const u8* p) {
    return (u32)p[0] | ((u32)p[1] << 8) | ((u32)p[2] << 16) | ((u32)p[3] << 24);
}

// The tables of the blob at `blob` (4-byte aligned).
TFTF_HD IqGrid iq_grid(const u8* blob) {
    IqGrid g;
    g.dims = (int)iq_u32_at(blob);
    g.bits = (int)iq_u32_at(blob + 4);
    u32 points = iq_u32_at(blob + 8);
    u32 codes = iq_u32_at(blob + 12);
    const u8* p = blob + 20;
    g.kgrid = (const u16*)p;
    p += ((u64)points * 2 + 3) / 4 * 4;
    g.map = (const i32*)p;
    p += (u64)codes * 4;
    g.neighbours = (const u16*)p;
    return g;
}

// The code of `dims` levels.
TFTF_HD int iq_code(const IqGrid& g, const i8* levels) {
    int u = 0;
    for (int i = 0; i < g.dims; i++) u |= (int)levels[i] << (g.bits * i);
    return u;
}

// Coordinate i (2·level + 1) of grid point k.
TFTF_HD int iq_coord(const IqGrid& g, int k, int i) {
    return 2 * (((int)g.kgrid[k] >> (g.bits * i)) & ((1 << g.bits) - 1)) + 1;
}

// The grid index of `levels`, or -1 off the grid.
TFTF_HD int iq_index_of(const IqGrid& g, const i8* levels) {
    i32 m = g.map[iq_code(g, levels)];
    return m >= 0 ? (int)m : -1;
}

// The neighbour list of off-grid `levels`: its first index in *list, its length returned.
TFTF_HD int iq_neighbours(const IqGrid& g, const i8* levels, const u16** list) {
    i32 m = g.map[iq_code(g, levels)];
    if (m >= 0) return 0;
    u32 at = (u32)(-(m + 1));
    *list = g.neighbours + at + 1;
    return (int)g.neighbours[at];
}

// Sets `levels` to grid point k's.
TFTF_HD void iq_set_levels(const IqGrid& g, int k, i8* levels) {
    for (int i = 0; i < g.dims; i++)
        levels[i] = (i8)(((int)g.kgrid[k] >> (g.bits * i)) & ((1 << g.bits) - 1));
}
