//! ggml's "legacy" 32-element block types, byte for byte as `llama-quantize` writes them
//! (`ggml/src/ggml-quants.c` at llama.cpp 0c1e570: `quantize_row_q4_0_ref` … without an
//! importance matrix, `quantize_row_q4_0_impl` … with one).
//!
//! Layouts (little-endian, `d`/`m` IEEE half, rounded to nearest even when stored):
//! - **Q4_0**, 18 bytes: `d`, `qs[16]`; element `j` is the low nibble of `qs[j]`, element
//!   `j + 16` the high nibble; value `(q - 8) · d`.
//! - **Q4_1**, 20 bytes: `d`, `m`, `qs[16]` as Q4_0; value `q · d + m`.
//! - **Q5_0**, 22 bytes: `d`, `qh: u32`, `qs[16]`; the low 4 bits as Q4_0, bit 4 of element
//!   `j` in bit `j` of `qh`; value `(q - 16) · d`.
//! - **Q5_1**, 24 bytes: `d`, `m`, `qh`, `qs[16]` as Q5_0; value `q · d + m`.
//!
//! Every float operation is the reference's, in its order (`x * id + 8.5` is a multiply then
//! an add: ggml-base is built without FMA contraction), and a float becomes an integer the way
//! the C casts do on x86-64 (truncation through a 32-bit conversion, whose out-of-range result
//! `0x80000000` leaves a low byte of 0). With quant weights the search is `make_qx_quants`
//! (Q4_0, Q5_0) or `make_qkx3_quants` (Q4_1, Q5_1) over weights `qw · sqrt(σ² + x²)`, σ² the
//! row's mean square.

use super::kquants::{self, signed_max};
use crate::ops::cast::f32_to_f16;

pub const QK: usize = 32;
pub const Q4_0_BLOCK_BYTES: usize = 18;
pub const Q4_1_BLOCK_BYTES: usize = 20;
pub const Q5_0_BLOCK_BYTES: usize = 22;
pub const Q5_1_BLOCK_BYTES: usize = 24;

/// `(int8_t)f` / `(uint8_t)f` as GCC compiles them on x86-64: `cvttss2si` to 32 bits (NaN and
/// out-of-range give `i32::MIN`), then the low byte.
#[inline(always)]
fn c_trunc_u8(f: f32) -> u8 {
    let i = if f.is_nan() || !(-2147483648.0..2147483648.0).contains(&f) {
        i32::MIN
    } else {
        f as i32
    };
    i as u8
}

/// `(uint8_t)MIN(top, (int8_t)f)`: the comparison is signed.
#[inline(always)]
fn c_min_trunc_i8(top: u8, f: f32) -> u8 {
    (top as i32).min(c_trunc_u8(f) as i8 as i32) as u8
}

fn put_half(out: &mut [u8], v: f32) {
    out[..2].copy_from_slice(&f32_to_f16(v).to_le_bytes());
}

/// Packs 32 codes: low nibbles into `qs`, bit 4 (for 5-bit types) into the returned `qh`.
fn pack(l: &[u8; QK], qs: &mut [u8]) -> u32 {
    let mut qh = 0u32;
    for j in 0..QK / 2 {
        let (a, b) = (l[j], l[j + QK / 2]);
        qs[j] = (a & 0x0F) | ((b & 0x0F) << 4);
        qh |= (((a & 0x10) >> 4) as u32) << j;
        qh |= (((b & 0x10) >> 4) as u32) << (j + QK / 2);
    }
    qh
}

/// Symmetric codes without weights: `d = max / -half`, `q = min(top, trunc(x·id + half + ½))`.
fn symmetric_ref(xb: &[f32], half: f32, top: u8, l: &mut [u8; QK]) -> f32 {
    let (_, max) = signed_max(xb);
    let d = max / -half;
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    for (q, &v) in l.iter_mut().zip(xb) {
        *q = c_min_trunc_i8(top, v * id + (half + 0.5));
    }
    d
}

/// Codes over `[min, max]` without weights: `q = trunc((x - min)·id + ½)` (capped at `top` for
/// 4 bits; the 5-bit reference does not cap).
fn affine_ref(xb: &[f32], levels: f32, cap: Option<u8>, l: &mut [u8; QK]) -> (f32, f32) {
    let (mut min, mut max) = (f32::MAX, -f32::MAX);
    for &v in xb {
        if v < min {
            min = v;
        }
        if v > max {
            max = v;
        }
    }
    let d = (max - min) / levels;
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    for (q, &v) in l.iter_mut().zip(xb) {
        let f = (v - min) * id + 0.5;
        *q = cap.map_or(c_trunc_u8(f), |t| c_min_trunc_i8(t, f));
    }
    (d, min)
}

/// `make_qx_quants(32, nmax, x, L, rmse_type = 1, qw)` with weights (the k-quants' search):
/// codes `L = l + nmax`. Returns the scale.
fn make_qx_quants(nmax: i32, x: &[f32], qw: &[f32], l_out: &mut [u8; QK]) -> f32 {
    let mut levels = [0i8; QK];
    let d = kquants::make_qx_quants(nmax, x, &mut levels, Some(qw));
    for (o, &l) in l_out.iter_mut().zip(&levels) {
        *o = l as u8;
    }
    d
}

/// `make_qkx3_quants(32, nmax, x, w, L, &the_min, Laux, -0.9, 0.05, 36, use_mad = false)` (the
/// k-quants' search). Returns `(scale, offset)` with the offset as stored (`m = -the_min`).
fn make_qkx3_quants(nmax: i32, x: &[f32], w: &[f32], l_out: &mut [u8; QK]) -> (f32, f32) {
    let mut aux = [0u8; QK];
    let search = kquants::AffineSearch::WEIGHTED;
    let (d, the_min) = kquants::make_qkx_quants(nmax, x, w, l_out, &mut aux, search);
    (d, -the_min)
}

/// Per-block weights of `quantize_row_*_impl`: `qw · sqrt(σ² + x²)`, σ² the row's mean square.
fn row_sigma2(row: &[f32]) -> f32 {
    let mut sum_x2 = 0.0f32;
    for &v in row {
        sum_x2 += v * v;
    }
    sum_x2 / row.len() as f32
}

fn block_weights(xb: &[f32], qw: &[f32], sigma2: f32) -> [f32; QK] {
    let mut w = [0.0f32; QK];
    for j in 0..QK {
        w[j] = qw[j] * (sigma2 + xb[j] * xb[j]).sqrt();
    }
    w
}

/// Calls `block(xb, weights, out)` per 32 values, the weights `None` without quant weights.
fn each_block(
    src: &[f32],
    dst: &mut [u8],
    block_bytes: usize,
    qw: Option<&[f32]>,
    mut block: impl FnMut(&[f32], Option<&[f32; QK]>, &mut [u8]),
) {
    assert_eq!(src.len() % QK, 0, "whole 32-blocks");
    assert_eq!(dst.len(), src.len() / QK * block_bytes, "output size");
    if let Some(qw) = qw {
        assert_eq!(qw.len(), src.len(), "one quant weight per column");
    }
    let sigma2 = qw.map(|_| row_sigma2(src));
    for (k, (xb, ob)) in src
        .chunks_exact(QK)
        .zip(dst.chunks_exact_mut(block_bytes))
        .enumerate()
    {
        let w = qw.map(|qw| block_weights(xb, &qw[k * QK..(k + 1) * QK], sigma2.unwrap()));
        block(xb, w.as_ref(), ob);
    }
}

/// A block's symmetric codes `0..2·half` and scale: the reference rounding without weights,
/// the k-quants' search (`nmax = half`) with them.
fn symmetric(xb: &[f32], w: Option<&[f32; QK]>, half: u8) -> ([u8; QK], f32) {
    let mut l = [0u8; QK];
    let d = match w {
        None => symmetric_ref(xb, half.into(), 2 * half - 1, &mut l),
        Some(w) => make_qx_quants(half.into(), xb, w, &mut l),
    };
    (l, d)
}

/// A block's codes `0..=nmax` over `[min, max]`, scale and offset: the reference rounding
/// without weights (capped at `nmax` where `cap`), the k-quants' search with them.
fn affine(xb: &[f32], w: Option<&[f32; QK]>, nmax: u8, cap: bool) -> ([u8; QK], f32, f32) {
    let mut l = [0u8; QK];
    let (d, m) = match w {
        None => affine_ref(xb, nmax.into(), cap.then_some(nmax), &mut l),
        Some(w) => make_qkx3_quants(nmax.into(), xb, w, &mut l),
    };
    (l, d, m)
}

/// One row to Q4_0 (`quantize_q4_0`): `dst` 18 bytes per 32 values.
pub fn quantize_row_q4_0(src: &[f32], dst: &mut [u8], qw: Option<&[f32]>) {
    each_block(src, dst, Q4_0_BLOCK_BYTES, qw, |xb, w, ob| {
        let (l, d) = symmetric(xb, w, 8);
        put_half(ob, d);
        pack(&l, &mut ob[2..18]);
    });
}

/// One row to Q4_1 (`quantize_q4_1`): `dst` 20 bytes per 32 values.
pub fn quantize_row_q4_1(src: &[f32], dst: &mut [u8], qw: Option<&[f32]>) {
    each_block(src, dst, Q4_1_BLOCK_BYTES, qw, |xb, w, ob| {
        let (l, d, m) = affine(xb, w, 15, true);
        put_half(ob, d);
        put_half(&mut ob[2..], m);
        pack(&l, &mut ob[4..20]);
    });
}

/// One row to Q5_0 (`quantize_q5_0`): `dst` 22 bytes per 32 values.
pub fn quantize_row_q5_0(src: &[f32], dst: &mut [u8], qw: Option<&[f32]>) {
    each_block(src, dst, Q5_0_BLOCK_BYTES, qw, |xb, w, ob| {
        let (l, d) = symmetric(xb, w, 16);
        put_half(ob, d);
        let qh = pack(&l, &mut ob[6..22]);
        ob[2..6].copy_from_slice(&qh.to_le_bytes());
    });
}

/// One row to Q5_1 (`quantize_q5_1`): `dst` 24 bytes per 32 values.
pub fn quantize_row_q5_1(src: &[f32], dst: &mut [u8], qw: Option<&[f32]>) {
    each_block(src, dst, Q5_1_BLOCK_BYTES, qw, |xb, w, ob| {
        let (l, d, m) = affine(xb, w, 31, false);
        put_half(ob, d);
        put_half(&mut ob[2..], m);
        let qh = pack(&l, &mut ob[8..24]);
        ob[4..8].copy_from_slice(&qh.to_le_bytes());
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    const COLS: usize = 128;
    type RowFn = fn(&[f32], &mut [u8], Option<&[f32]>);

    fn f32s(bytes: &[u8]) -> Vec<f32> {
        bytes
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
            .collect()
    }

    /// tests/fixtures/gguf_quant/legacy_*: ggml's `ggml_quantize_chunk` on 12 rows of 128
    /// (zero, constant, all-positive, tied, sub-epsilon and f16-max blocks among them), with and
    /// without an importance matrix (some of its weights zero).
    #[test]
    fn every_legacy_type_equals_ggml_with_and_without_quant_weights() {
        let x = f32s(include_bytes!(
            "../../../tests/fixtures/gguf_quant/legacy_input.f32"
        ));
        let qw = f32s(include_bytes!(
            "../../../tests/fixtures/gguf_quant/legacy_imatrix.f32"
        ));
        type Case = (&'static str, RowFn, usize, &'static [u8], &'static [u8]);
        let cases: [Case; 4] = [
            (
                "q4_0",
                quantize_row_q4_0,
                Q4_0_BLOCK_BYTES,
                include_bytes!("../../../tests/fixtures/gguf_quant/legacy_q4_0.bin"),
                include_bytes!("../../../tests/fixtures/gguf_quant/legacy_q4_0_imatrix.bin"),
            ),
            (
                "q4_1",
                quantize_row_q4_1,
                Q4_1_BLOCK_BYTES,
                include_bytes!("../../../tests/fixtures/gguf_quant/legacy_q4_1.bin"),
                include_bytes!("../../../tests/fixtures/gguf_quant/legacy_q4_1_imatrix.bin"),
            ),
            (
                "q5_0",
                quantize_row_q5_0,
                Q5_0_BLOCK_BYTES,
                include_bytes!("../../../tests/fixtures/gguf_quant/legacy_q5_0.bin"),
                include_bytes!("../../../tests/fixtures/gguf_quant/legacy_q5_0_imatrix.bin"),
            ),
            (
                "q5_1",
                quantize_row_q5_1,
                Q5_1_BLOCK_BYTES,
                include_bytes!("../../../tests/fixtures/gguf_quant/legacy_q5_1.bin"),
                include_bytes!("../../../tests/fixtures/gguf_quant/legacy_q5_1_imatrix.bin"),
            ),
        ];
        for (name, row, bb, plain, weighted) in cases {
            let row_bytes = COLS / QK * bb;
            for (w, want) in [(None, plain), (Some(qw.as_slice()), weighted)] {
                for (r, (src, want)) in x.chunks(COLS).zip(want.chunks(row_bytes)).enumerate() {
                    let mut got = vec![0xA5u8; row_bytes];
                    row(src, &mut got, w);
                    assert_eq!(got, want, "{name} row {r} quant weights {}", w.is_some());
                }
            }
        }
    }

    #[test]
    fn float_to_byte_casts_behave_as_x86_c() {
        assert_eq!(c_trunc_u8(16.9), 16);
        assert_eq!(c_trunc_u8(f32::NAN), 0);
        assert_eq!(c_trunc_u8(3e9), 0);
        assert_eq!(c_min_trunc_i8(15, 200.0), 200); // (int8_t)200 is -56, below 15
        assert_eq!(c_min_trunc_i8(15, 16.5), 15);
    }
}
