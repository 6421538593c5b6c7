//! ggml's k-quant, i-quant and ternary block encoders, byte-exact to llama.cpp 0c1e570's
//! `ggml-quants.c` (what `ggml_quantize_chunk`, and so `llama-quantize`, writes).
//!
//! Each `quantize_row_<type>(src, dst, quant_weights)` encodes one row: `src` a whole number of
//! blocks, `dst` exactly the row's bytes ([`row_bytes`]), `quant_weights` the importance matrix
//! of the row's columns (`src.len()` values) or `None`. Without weights the k-quants take
//! `quantize_row_<type>_ref`; with them, the `quantize_row_<type>_impl` search `llama-quantize
//! --imatrix` takes. The i-quants and ternary types take the one path `quantize_<type>` takes.
//!
//! Why a port and not an approximation: a GGUF that differs from `llama-quantize`'s by one
//! scale byte cannot be checked against it, and the searches (a few dozen candidate scales per
//! sub-block, kept on strict improvements) turn a last-bit difference into another scale.
//! So every float operation is done in f32 in ggml's order: ggml-base is compiled for the
//! x86-64 baseline (SSE2, no FMA, no fast-math), so the C evaluates exactly as written, and
//! plain Rust f32 arithmetic in the same order gives the same bits. Rounding to int is
//! `nearest_int`, ggml's magic-number trick (ties to even, garbage past 2^22 that ggml has
//! too); f16 stores are [`f32_to_f16`], ggml's own routine. Buffers are per-block stack arrays:
//! nothing is allocated in the loops.
//!
//! The searches that dominate the k-quants' time (`make_qkx_quants` of Q2_K/Q4_K/Q5_K,
//! `make_qx_quants` of Q6_K and of Q3_K's imatrix path) run on sixteen sub-blocks at once
//! (Q4_K/Q5_K: two super-blocks), one per SIMD lane, each lane keeping its sub-block's sums in
//! ggml's serial order (`lanes.rs`): same bits, several times the speed.

mod grids;
mod iq1;
mod iq2;
mod iq2_grid;
mod iq3;
mod iq4;
mod iq_signs;
mod lanes;
mod q2_k;
mod q3_k;
mod q45_k;
mod q6_k;
mod search;
pub mod tables;
mod ternary;

pub use iq1::{quantize_row_iq1_m, quantize_row_iq1_s};
pub use iq2::{quantize_row_iq2_s, quantize_row_iq2_xs, quantize_row_iq2_xxs};
pub use iq3::{quantize_row_iq3_s, quantize_row_iq3_xxs};
pub use iq4::{quantize_row_iq4_nl, quantize_row_iq4_xs};
pub use q2_k::quantize_row_q2_k;
pub use q3_k::quantize_row_q3_k;
pub use q45_k::{quantize_row_q4_k, quantize_row_q5_k};
pub use q6_k::quantize_row_q6_k;
pub use ternary::{quantize_row_tq1_0, quantize_row_tq2_0};

// The searches and rounding the legacy encoders share (one copy, here).
pub(crate) use search::{make_qkx_quants, make_qx_quants, AffineSearch};

use crate::ops::cast::{f16_to_f32, f32_to_f16};

/// Elements in a k-quant super-block (`QK_K`).
pub const QK_K: usize = 256;
/// Elements in an IQ4_NL block (`QK4_NL`).
pub const QK4_NL: usize = 32;

/// The block types this module encodes, with ggml's `(elements, bytes)` per block.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum KQuant {
    Q2K,
    Q3K,
    Q4K,
    Q5K,
    Q6K,
    Iq4Nl,
    Iq4Xs,
    Iq3Xxs,
    Iq3S,
    Tq1_0,
    Tq2_0,
    Iq2Xxs,
    Iq2Xs,
    Iq2S,
    Iq1S,
    Iq1M,
}

impl KQuant {
    pub const ALL: [KQuant; 16] = [
        KQuant::Q2K,
        KQuant::Q3K,
        KQuant::Q4K,
        KQuant::Q5K,
        KQuant::Q6K,
        KQuant::Iq4Nl,
        KQuant::Iq4Xs,
        KQuant::Iq3Xxs,
        KQuant::Iq3S,
        KQuant::Tq1_0,
        KQuant::Tq2_0,
        KQuant::Iq2Xxs,
        KQuant::Iq2Xs,
        KQuant::Iq2S,
        KQuant::Iq1S,
        KQuant::Iq1M,
    ];

    /// ggml's name (`ggml_type_name`).
    pub fn name(self) -> &'static str {
        match self {
            KQuant::Q2K => "Q2_K",
            KQuant::Q3K => "Q3_K",
            KQuant::Q4K => "Q4_K",
            KQuant::Q5K => "Q5_K",
            KQuant::Q6K => "Q6_K",
            KQuant::Iq4Nl => "IQ4_NL",
            KQuant::Iq4Xs => "IQ4_XS",
            KQuant::Iq3Xxs => "IQ3_XXS",
            KQuant::Iq3S => "IQ3_S",
            KQuant::Tq1_0 => "TQ1_0",
            KQuant::Tq2_0 => "TQ2_0",
            KQuant::Iq2Xxs => "IQ2_XXS",
            KQuant::Iq2Xs => "IQ2_XS",
            KQuant::Iq2S => "IQ2_S",
            KQuant::Iq1S => "IQ1_S",
            KQuant::Iq1M => "IQ1_M",
        }
    }

    /// The `ggml_type` id stored in a GGUF tensor info.
    pub fn id(self) -> u32 {
        match self {
            KQuant::Q2K => 10,
            KQuant::Q3K => 11,
            KQuant::Q4K => 12,
            KQuant::Q5K => 13,
            KQuant::Q6K => 14,
            KQuant::Iq4Nl => 20,
            KQuant::Iq4Xs => 23,
            KQuant::Iq3Xxs => 18,
            KQuant::Iq3S => 21,
            KQuant::Tq1_0 => 34,
            KQuant::Tq2_0 => 35,
            KQuant::Iq2Xxs => 16,
            KQuant::Iq2Xs => 17,
            KQuant::Iq2S => 22,
            KQuant::Iq1S => 19,
            KQuant::Iq1M => 29,
        }
    }

    /// `(elements per block, bytes per block)`, as `GGML_QUANT_SIZES`.
    pub fn block(self) -> (usize, usize) {
        match self {
            KQuant::Q2K => (QK_K, 84),
            KQuant::Q3K => (QK_K, 110),
            KQuant::Q4K => (QK_K, 144),
            KQuant::Q5K => (QK_K, 176),
            KQuant::Q6K => (QK_K, 210),
            KQuant::Iq4Nl => (QK4_NL, 18),
            KQuant::Iq4Xs => (QK_K, 136),
            KQuant::Iq3Xxs => (QK_K, 98),
            KQuant::Iq3S => (QK_K, 110),
            KQuant::Tq1_0 => (QK_K, 54),
            KQuant::Tq2_0 => (QK_K, 66),
            KQuant::Iq2Xxs => (QK_K, 66),
            KQuant::Iq2Xs => (QK_K, 74),
            KQuant::Iq2S => (QK_K, 82),
            KQuant::Iq1S => (QK_K, 50),
            KQuant::Iq1M => (QK_K, 56),
        }
    }

    /// Encodes one row (see the module docs for the contract).
    pub fn quantize_row(self, src: &[f32], dst: &mut [u8], quant_weights: Option<&[f32]>) {
        let f = match self {
            KQuant::Q2K => quantize_row_q2_k,
            KQuant::Q3K => quantize_row_q3_k,
            KQuant::Q4K => quantize_row_q4_k,
            KQuant::Q5K => quantize_row_q5_k,
            KQuant::Q6K => quantize_row_q6_k,
            KQuant::Iq4Nl => quantize_row_iq4_nl,
            KQuant::Iq4Xs => quantize_row_iq4_xs,
            KQuant::Iq3Xxs => quantize_row_iq3_xxs,
            KQuant::Iq3S => quantize_row_iq3_s,
            KQuant::Tq1_0 => quantize_row_tq1_0,
            KQuant::Tq2_0 => quantize_row_tq2_0,
            KQuant::Iq2Xxs => quantize_row_iq2_xxs,
            KQuant::Iq2Xs => quantize_row_iq2_xs,
            KQuant::Iq2S => quantize_row_iq2_s,
            KQuant::Iq1S => quantize_row_iq1_s,
            KQuant::Iq1M => quantize_row_iq1_m,
        };
        f(src, dst, quant_weights)
    }
}

/// Bytes of a row of `n` elements of `ty`, or `None` when `n` is not a whole number of blocks.
pub fn row_bytes(ty: KQuant, n: usize) -> Option<usize> {
    let (elems, bytes) = ty.block();
    n.is_multiple_of(elems).then_some(n / elems * bytes)
}

/// The row contract every encoder asserts: whole blocks, the row's bytes, one weight a column.
fn check_row(ty: KQuant, src: &[f32], dst: &[u8], quant_weights: Option<&[f32]>) {
    assert_eq!(
        row_bytes(ty, src.len()),
        Some(dst.len()),
        "{}: a row of {} values needs whole blocks and their bytes",
        ty.name(),
        src.len()
    );
    if let Some(w) = quant_weights {
        assert_eq!(w.len(), src.len(), "{}: one weight per column", ty.name());
    }
}

/// Checks the row contract, then calls `block(x, qw, y)` per block with its values, its
/// columns' weights (when given) and its bytes.
fn for_each_block(
    ty: KQuant,
    src: &[f32],
    dst: &mut [u8],
    quant_weights: Option<&[f32]>,
    mut block: impl FnMut(&[f32], Option<&[f32]>, &mut [u8]),
) {
    check_row(ty, src, dst, quant_weights);
    let (elems, bytes) = ty.block();
    for (i, (x, y)) in src
        .chunks_exact(elems)
        .zip(dst.chunks_exact_mut(bytes))
        .enumerate()
    {
        block(x, quant_weights.map(|w| &w[elems * i..elems * (i + 1)]), y);
    }
}

/// [`for_each_block`] for a type that cannot do without importance weights: without them, the
/// contract's panic, before any block (planning refuses such a tensor without weights before
/// any output exists: `encode::needs_quant_weights`).
fn for_each_weighted_block(
    ty: KQuant,
    src: &[f32],
    dst: &mut [u8],
    quant_weights: Option<&[f32]>,
    mut block: impl FnMut(&[f32], &[f32], &mut [u8]),
) {
    let qw = quant_weights.unwrap_or_else(|| panic!("{} needs importance weights", ty.name()));
    for_each_block(ty, src, dst, Some(qw), |x, qw, y| {
        block(x, qw.expect("given"), y)
    });
}

/// ggml's `nearest_int`: adds 1.5 * 2^23 so the FPU rounds to an integer (ties to even) in the
/// low mantissa bits. Exact for |x| < 2^22; beyond, the same wrapped value ggml gets.
#[inline(always)]
pub(crate) fn nearest_int(x: f32) -> i32 {
    let v = x + 12_582_912.0;
    (v.to_bits() & 0x007f_ffff) as i32 - 0x0040_0000
}

/// `GGML_FP32_TO_FP16` as little-endian bytes.
#[inline(always)]
fn f16_bytes(x: f32) -> [u8; 2] {
    f32_to_f16(x).to_le_bytes()
}

/// `GGML_FP16_TO_FP32(GGML_FP32_TO_FP16(x))`: the value a stored scale decodes to.
#[inline(always)]
fn f16_round(x: f32) -> f32 {
    f16_to_f32(f32_to_f16(x))
}

/// `Σ x²` in order, as ggml's `sumx2` loops.
#[inline]
fn sum_squares(x: &[f32]) -> f32 {
    let mut s = 0.0f32;
    for &e in x {
        s += e * e;
    }
    s
}

/// The imatrix weights of ggml's `*_impl` paths, `qw[i] * sqrt(sigma2 + x[i]²)`, into
/// `weights`; returns their sum in order (the sub-block's weight in the scale fits).
#[inline]
fn imatrix_weights(weights: &mut [f32], qw: &[f32], x: &[f32], sigma2: f32) -> f32 {
    let mut sum = 0.0f32;
    for ((w, &q), &e) in weights.iter_mut().zip(qw).zip(x) {
        *w = q * (sigma2 + e * e).sqrt();
        sum += *w;
    }
    sum
}

/// The value of largest magnitude, first one on ties, as `(|v|, v)` (0s when all are 0).
#[inline]
pub(crate) fn signed_max(x: &[f32]) -> (f32, f32) {
    let (mut amax, mut max) = (0.0f32, 0.0f32);
    for &v in x {
        if v.abs() > amax {
            amax = v.abs();
            max = v;
        }
    }
    (amax, max)
}

/// A stored little-endian f16 as f32 (`GGML_FP16_TO_FP32`).
#[inline(always)]
fn read_f16(b: &[u8]) -> f32 {
    f16_to_f32(u16::from_le_bytes([b[0], b[1]]))
}

/// The sub-block scales of an IQ super-block and their maximum, as the IQ quantisers gather
/// them (a skipped sub-block keeps scale 0).
struct SubScales<const B: usize> {
    scales: [f32; B],
    max: f32,
}

impl<const B: usize> SubScales<B> {
    fn new() -> Self {
        SubScales {
            scales: [0.0; B],
            max: 0.0,
        }
    }

    /// Sets sub-block `ib`'s scale.
    fn set(&mut self, ib: usize, scale: f32) {
        self.scales[ib] = scale;
        self.max = c_max(self.max, scale);
    }

    /// The super-block scale `d = max / top`, with the f16 of `d · fudge` (the type's factor
    /// in ggml) written to `y[0..2]`; `None`, nothing written, when every scale is 0.
    fn put_super_scale(&self, top: f32, fudge: f32, y: &mut [u8]) -> Option<f32> {
        if self.max == 0.0 {
            return None;
        }
        let d = self.max / top;
        y[0..2].copy_from_slice(&f16_bytes(d * fudge));
        Some(d)
    }
}

/// The sub-blocks of `n` values of the super-block `x`, each with its levels and index:
/// `(j, (xs, ls))`.
fn sub_blocks<'a, L>(
    x: &'a [f32],
    levels: &'a mut [L],
    n: usize,
) -> impl Iterator<Item = (usize, (&'a [f32], &'a mut [L]))> {
    x.chunks_exact(n)
        .zip(levels.chunks_exact_mut(n))
        .enumerate()
}

/// C's `MAX(a, b)` macro on floats, `a > b ? a : b` (so a NaN `b` wins, a NaN `a` loses).
#[inline(always)]
fn c_max(a: f32, b: f32) -> f32 {
    if a > b {
        a
    } else {
        b
    }
}

/// Packs four 2-bit planes as q2_K and q3_K store them: byte `32 * h + l` of `qs` (`h` the
/// 128-element half) holds elements `128h + l`, `+32`, `+64`, `+96` from the low bits up.
fn pack_2bit(levels: &[u8; QK_K], qs: &mut [u8]) {
    for (half, out) in levels.chunks_exact(128).zip(qs.chunks_exact_mut(32)) {
        for (l, q) in out.iter_mut().enumerate() {
            *q = half[l] | (half[l + 32] << 2) | (half[l + 64] << 4) | (half[l + 96] << 6);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nearest_int_rounds_ties_to_even_like_ggml() {
        assert_eq!(nearest_int(0.5), 0);
        assert_eq!(nearest_int(1.5), 2);
        assert_eq!(nearest_int(2.5), 2);
        assert_eq!(nearest_int(-0.5), 0);
        assert_eq!(nearest_int(-1.5), -2);
        assert_eq!(nearest_int(-3.49), -3);
        assert_eq!(nearest_int(4_194_303.0), 4_194_303);
    }

    #[test]
    fn row_bytes_are_ggml_row_sizes() {
        assert_eq!(row_bytes(KQuant::Q4K, 4096), Some(16 * 144));
        assert_eq!(row_bytes(KQuant::Iq4Nl, 96), Some(3 * 18));
        assert_eq!(row_bytes(KQuant::Q6K, 4000), None);
    }
}
