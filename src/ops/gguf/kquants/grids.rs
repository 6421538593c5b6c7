//! The lattice grids of ggml's IQ1/IQ2/IQ3 encoders, data from llama.cpp 0c1e570's
//! `iq2xs_init_impl` and `iq3xs_init_impl` (ggml/src/ggml-quants.c), kept as the text files in
//! `grids/` (written by `scripts/gen-iq-grid-tables.py`; do not edit) and parsed when the
//! crate compiles, so a missing, extra or out-of-range entry fails the build.
//!
//! IQ1/IQ2 entry `k` packs grid point `k`'s 8 levels, level `l` in bits `2i..2i + 2`
//! (coordinate `2 l + 1`); IQ3 entry `k` packs 4 levels of 3 bits (coordinate `i` is
//! `2 ((entry >> 3i) & 7) + 1`).

/// `kgrid_2bit_256` (IQ2_XXS).
pub(super) const KGRID_2BIT_256: [u16; 256] = parse(include_str!("grids/kgrid_2bit_256.txt"));
/// `kgrid_2bit_512` (IQ2_XS).
pub(super) const KGRID_2BIT_512: [u16; 512] = parse(include_str!("grids/kgrid_2bit_512.txt"));
/// `kgrid_2bit_1024` (IQ2_S).
pub(super) const KGRID_2BIT_1024: [u16; 1024] = parse(include_str!("grids/kgrid_2bit_1024.txt"));
/// `kgrid_1bit_2048` (IQ1_S and IQ1_M).
pub(super) const KGRID_1BIT_2048: [u16; 2048] = parse(include_str!("grids/kgrid_1bit_2048.txt"));
/// `kgrid_256` of `iq3xs_init_impl` (IQ3_XXS).
pub(super) const KGRID_3BIT_256: [u16; 256] = parse(include_str!("grids/kgrid_256.txt"));
/// `kgrid_512` of `iq3xs_init_impl` (IQ3_S).
pub(super) const KGRID_3BIT_512: [u16; 512] = parse(include_str!("grids/kgrid_512.txt"));

/// Reads exactly `N` comma- or space-separated decimal `u16`s, at compile time.
const fn parse<const N: usize>(text: &str) -> [u16; N] {
    let bytes = text.as_bytes();
    let mut out = [0u16; N];
    let (mut at, mut count) = (0, 0);
    while at < bytes.len() {
        if !bytes[at].is_ascii_digit() {
            assert!(
                bytes[at] == b',' || bytes[at].is_ascii_whitespace(),
                "grid: not a number"
            );
            at += 1;
            continue;
        }
        let mut value: u32 = 0;
        while at < bytes.len() && bytes[at].is_ascii_digit() {
            value = value * 10 + (bytes[at] - b'0') as u32;
            assert!(value <= u16::MAX as u32, "grid: entry over u16");
            at += 1;
        }
        assert!(count < N, "grid: more entries than the table holds");
        out[count] = value as u16;
        count += 1;
    }
    assert!(count == N, "grid: fewer entries than the table holds");
    out
}
