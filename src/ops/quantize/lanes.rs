//! The quantisers' hot loops, written so the compiler turns them into SIMD lanes: the same
//! operations as the scalar reference in `ops.rs` (`QuantizeRows::compute_reference`),
//! in the same order (every division stays a division, every rounding to the weight dtype
//! stays), but with no data-dependent branch per element — E4M3 encoding computes its normal
//! and subnormal results and selects one, the group maxima are integer maxima of the magnitude
//! bits, and each weight dtype gets its own copy of every loop. The result is byte-identical to
//! the reference (tested on random and edge values for every scheme and dtype); on x86-64 the
//! loops are compiled once more for AVX2 and picked at run time.

use std::ops::Range;

use super::encode::{WeightType, E2M1_MAX, E4M3_MAX};
use crate::ops::cast::{bf16_to_f32, f32_to_bf16};
use crate::ops::simd::with_avx2;
use crate::plan::Outs;

/// A weight dtype, as a type, so that each loop is compiled for one of them.
pub trait Elem {
    const WT: WeightType;
    /// Decodes one element from its little-endian bytes (`WT.bytes()` of them).
    fn load(b: &[u8]) -> f32;
    /// Rounds an f32 result to this dtype (nearest even), as a torch op in this dtype does.
    fn round(x: f32) -> f32;
    /// The magnitude bits of one element (its bits without the sign), which order finite
    /// values as their absolute values do.
    fn mag(b: &[u8]) -> u32;
    /// The least magnitude bits of an infinity (and above: NaNs).
    const MAG_INF: u32;
    /// The value of magnitude bits `m`.
    fn from_mag(m: u32) -> f32;
}

pub struct Bf16;
pub struct F16;
pub struct F32;

/// `Elem` for a 16-bit dtype, from the decoder of its bits and its rounding: the magnitude is
/// the bits without the sign, and the value of magnitude bits their decoding.
macro_rules! half_elem {
    ($t:ident, $wt:expr, $mag_inf:expr, $decode:path, $round:path) => {
        impl Elem for $t {
            const WT: WeightType = $wt;
            #[inline(always)]
            fn load(b: &[u8]) -> f32 {
                $decode(u16::from_le_bytes([b[0], b[1]]))
            }
            #[inline(always)]
            fn round(x: f32) -> f32 {
                $round(x)
            }
            #[inline(always)]
            fn mag(b: &[u8]) -> u32 {
                u16::from_le_bytes([b[0], b[1]]) as u32 & 0x7FFF
            }
            const MAG_INF: u32 = $mag_inf;
            #[inline(always)]
            fn from_mag(m: u32) -> f32 {
                $decode(m as u16)
            }
        }
    };
}

half_elem!(Bf16, WeightType::BF16, 0x7F80, bf16_to_f32, round_to_bf16);
half_elem!(F16, WeightType::F16, 0x7C00, f16_bits_to_f32, round_to_f16);

#[inline(always)]
fn round_to_bf16(x: f32) -> f32 {
    bf16_to_f32(f32_to_bf16(x))
}

impl Elem for F32 {
    const WT: WeightType = WeightType::F32;
    #[inline(always)]
    fn load(b: &[u8]) -> f32 {
        f32::from_le_bytes([b[0], b[1], b[2], b[3]])
    }
    #[inline(always)]
    fn round(x: f32) -> f32 {
        x
    }
    #[inline(always)]
    fn mag(b: &[u8]) -> u32 {
        u32::from_le_bytes([b[0], b[1], b[2], b[3]]) & 0x7FFF_FFFF
    }
    const MAG_INF: u32 = 0x7F80_0000;
    #[inline(always)]
    fn from_mag(m: u32) -> f32 {
        f32::from_bits(m)
    }
}

/// f16 bits → f32 without branches: normals and subnormals by one multiplication of the
/// shifted bits (2^112 moves the f16 exponent bias to f32's; subnormals come out exact as the
/// product is a normal f32), infinities and NaNs by a select.
#[inline(always)]
pub fn f16_bits_to_f32(h: u16) -> f32 {
    let h = h as u32;
    let sign = (h & 0x8000) << 16;
    let rest = h & 0x7FFF;
    let finite = f32::from_bits(rest << 13) * f32::from_bits(0x7780_0000); // · 2^112
    let special = f32::from_bits(0x7F80_0000 | ((h & 0x03FF) << 13));
    let v = if rest >= 0x7C00 { special } else { finite };
    f32::from_bits(v.to_bits() | sign)
}

/// Rounds an f32 to the nearest f16 value (ties to even), returned as f32, without branches:
/// subnormal f16s are multiples of 2^-24, which adding and taking away 0.5 (whose f32 ulp is
/// 2^-24) rounds to; normal ones keep 11 significant bits; from 65520 up the result is ∞.
#[inline(always)]
pub fn round_to_f16(x: f32) -> f32 {
    let bits = x.to_bits();
    let sign = bits & 0x8000_0000;
    let a = f32::from_bits(bits ^ sign);
    let sub = (a + 0.5) - 0.5;
    let b = a.to_bits();
    let normal = f32::from_bits((b + 0xFFF + ((b >> 13) & 1)) & 0xFFFF_E000);
    let r = if a < f32::from_bits(0x3880_0000) {
        sub // below 2^-14
    } else if a >= 65520.0 {
        f32::INFINITY
    } else {
        normal
    };
    let r = if x.is_nan() { x } else { r };
    f32::from_bits(r.to_bits() | sign)
}

/// f32 → E4M3 ("fn"), nearest even, as `encode::f32_to_e4m3` (c10's
/// `fp8e4m3fn_from_fp32_value`): both the subnormal and the normal result are computed and one
/// is selected.
#[inline(always)]
pub fn e4m3(x: f32) -> u8 {
    let bits = x.to_bits();
    let sign = bits & 0x8000_0000;
    let a = bits ^ sign;
    let denorm_mask = 141u32 << 23;
    let sub = (f32::from_bits(a) + f32::from_bits(denorm_mask))
        .to_bits()
        .wrapping_sub(denorm_mask) as u8;
    let odd = (a >> 20) & 1;
    let normal = (a
        .wrapping_add((7u32.wrapping_sub(127) << 23).wrapping_add(0x7FFFF))
        .wrapping_add(odd)
        >> 20) as u8;
    let r = if a >= 1087 << 20 {
        0x7F // |x| ≥ 480 or NaN
    } else if a < 121 << 23 {
        sub
    } else {
        normal
    };
    r | (sign >> 24) as u8
}

/// The E2M1 code of `y` (|y| ≤ 6) as `encode::f32_to_e2m1`.
#[inline(always)]
pub fn e2m1(y: f32) -> u8 {
    super::encode::f32_to_e2m1(y)
}

/// `max |x|` of a group, as an integer maximum of the magnitude bits (equal to the float one
/// for finite values, and free of the float maximum's NaN ordering, which keeps it in lanes).
#[inline(always)]
pub fn amax(xs: &[f32]) -> f32 {
    f32::from_bits(
        xs.iter()
            .fold(0u32, |m, &x| m.max(x.to_bits() & 0x7FFF_FFFF)),
    )
}

/// Decodes `bytes` into `out` (one f32 per element); true when any value is NaN or infinite.
/// Eight elements at a time, a fixed-size step the compiler keeps in lanes.
#[inline(always)]
pub fn decode<E: Elem>(bytes: &[u8], out: &mut [f32]) -> bool {
    let w = E::WT.bytes();
    let mut bad = 0u32;
    let mut step = |o: &mut [f32], b: &[u8]| {
        for (k, o) in o.iter_mut().enumerate() {
            let v = E::load(&b[k * w..]);
            bad |= u32::from(v.to_bits() & 0x7F80_0000 == 0x7F80_0000);
            *o = v;
        }
    };
    let mut outs = out.chunks_exact_mut(8);
    let mut ins = bytes.chunks_exact(8 * w);
    for (o, b) in (&mut outs).zip(&mut ins) {
        step(o, b);
    }
    step(outs.into_remainder(), ins.remainder());
    bad != 0
}

/// One chunk of whole weight rows to encode, with its two outputs split: built once by
/// [`encode`] (or [`RowChunk::new`]) so that every encoder starts from the same counts.
pub struct RowChunk<'a> {
    /// The chunk's rows, as units of the op.
    pub units: Range<u64>,
    /// The rows' weights (`inputs[0]`).
    pub input: &'a [u8],
    /// Rows in the chunk.
    pub n: usize,
    /// Weights per row.
    pub cols: usize,
    /// Input bytes per row.
    pub ib: usize,
    /// Code bytes per row ([`LaneEncoder::row_code_bytes`]).
    pub cb: usize,
    /// Scale bytes per row ([`LaneEncoder::row_scale_bytes`]).
    pub sb: usize,
    /// Output 0.
    pub codes: &'a mut [u8],
    /// Output 1.
    pub scales: &'a mut [u8],
}

impl<'a> RowChunk<'a> {
    /// The chunk `units` of `enc`: `inputs[0]` its rows, `outs` its codes and scales.
    pub fn new<'b, T: LaneEncoder + ?Sized>(
        enc: &T,
        units: Range<u64>,
        inputs: &[&'a [u8]],
        outs: &'a mut [&'b mut [u8]],
    ) -> Self {
        let [codes, scales] = outs else {
            unreachable!("codes and scales")
        };
        let cols = enc.cols() as usize;
        RowChunk {
            n: (units.end - units.start) as usize,
            units,
            input: inputs[0],
            cols,
            ib: cols * enc.weight_type().bytes(),
            cb: enc.row_code_bytes() as usize,
            sb: enc.row_scale_bytes() as usize,
            codes,
            scales,
        }
    }
}

/// An encoder of weight rows written once over the lane primitives, built per weight dtype
/// and, where the CPU has it, for AVX2 by [`encode`].
pub trait LaneEncoder {
    fn weight_type(&self) -> WeightType;
    /// Weights per row.
    fn cols(&self) -> u64;
    /// Code bytes per row.
    fn row_code_bytes(&self) -> u64;
    /// Scale bytes per row (FP8 blocks: per 128-row block row).
    fn row_scale_bytes(&self) -> u64;
    /// Encodes chunk `c` (its rows) into its codes and scales.
    fn encode_lanes<E: Elem>(&self, c: RowChunk) -> Result<(), String>;
}

/// Runs `enc`'s encoder built for its weight dtype, in its AVX2 build where the CPU has it.
pub fn encode<T: LaneEncoder>(
    enc: &T,
    units: Range<u64>,
    inputs: &[&[u8]],
    outs: Outs,
) -> Result<(), String> {
    fn dispatch<T: LaneEncoder, E: Elem>(enc: &T, c: RowChunk) -> Result<(), String> {
        with_avx2(
            #[inline(always)]
            || enc.encode_lanes::<E>(c),
        )
    }
    let c = RowChunk::new(enc, units, inputs, outs);
    match enc.weight_type() {
        WeightType::BF16 => dispatch::<T, Bf16>(enc, c),
        WeightType::F16 => dispatch::<T, F16>(enc, c),
        WeightType::F32 => dispatch::<T, F32>(enc, c),
    }
}

/// Tests that `op`'s lane encoder, in each weight dtype's baseline build and as dispatched,
/// writes the bytes of its scalar `reference` for `rows` rows of `input`.
#[cfg(test)]
pub(super) fn assert_lanes_agree<T: LaneEncoder + crate::ops::Op>(
    op: &T,
    rows: u64,
    input: &[u8],
    reference: impl Fn(RowChunk) -> Result<(), String>,
    what: &str,
) {
    let len = |k| op.out_span(k, 0..rows).end as usize;
    let run = |f: &dyn Fn(Outs) -> Result<(), String>| {
        let (mut c, mut s) = (vec![0u8; len(0)], vec![0u8; len(1)]);
        f(&mut [&mut c, &mut s]).unwrap();
        (c, s)
    };
    let want = run(&|o| reference(RowChunk::new(op, 0..rows, &[input], o)));
    let lanes = run(&|o| {
        let c = RowChunk::new(op, 0..rows, &[input], o);
        match op.weight_type() {
            WeightType::BF16 => op.encode_lanes::<Bf16>(c),
            WeightType::F16 => op.encode_lanes::<F16>(c),
            WeightType::F32 => op.encode_lanes::<F32>(c),
        }
    });
    let dispatched = run(&|o| op.compute_all(0..rows, &[input], o));
    assert!(want == lanes, "{what}: baseline lanes");
    assert!(want == dispatched, "{what}: dispatched");
}

/// The largest magnitude bits of each 128-column block of the rows `rows` (whole rows of
/// `cols` elements) into `m` (one per block); true when a block holds NaN or infinity.
#[inline(always)]
pub fn block_mags<E: Elem>(rows: &[u8], cols: usize, block: usize, m: &mut [u32]) -> bool {
    let w = E::WT.bytes();
    m.fill(0);
    for row in rows.chunks_exact(cols * w) {
        for (mj, seg) in m.iter_mut().zip(row.chunks(block * w)) {
            *mj = (*mj).max(max_mag::<E>(seg));
        }
    }
    m.iter().any(|&mj| mj >= E::MAG_INF)
}

/// The largest magnitude bits ([`Elem::mag`]) of the encoded elements `bytes`.
#[inline(always)]
pub fn max_mag<E: Elem>(bytes: &[u8]) -> u32 {
    let w = E::WT.bytes();
    let mut m = [0u32; 8];
    let mut ins = bytes.chunks_exact(8 * w);
    for b in &mut ins {
        for (k, mk) in m.iter_mut().enumerate() {
            *mk = (*mk).max(E::mag(&b[k * w..]));
        }
    }
    let tail = ins
        .remainder()
        .chunks_exact(w)
        .fold(0, |a, b| a.max(E::mag(b)));
    m.iter().fold(tail, |a, &b| a.max(b))
}

/// The largest magnitude of the `wt` elements `bytes`, as a value (NaN or infinity when one is
/// there, which a finite maximum would hide): the tensor-wide amax NVFP4's tensor scale needs
/// before any block is encoded, read straight from the stored bits.
pub fn tensor_amax(wt: WeightType, bytes: &[u8]) -> f32 {
    fn value<E: Elem>(bytes: &[u8]) -> f32 {
        E::from_mag(with_avx2(
            #[inline(always)]
            || max_mag::<E>(bytes),
        ))
    }
    match wt {
        WeightType::BF16 => value::<Bf16>(bytes),
        WeightType::F16 => value::<F16>(bytes),
        WeightType::F32 => value::<F32>(bytes),
    }
}

/// The amax of `len` bytes of `wt` elements read `piece` bytes at a time by `read(offset, buf)`
/// (a whole number of elements each); `nonfinite(value)` is the error for a NaN or infinity.
pub fn amax_read<E>(
    wt: WeightType,
    len: u64,
    piece: u64,
    mut read: impl FnMut(u64, &mut [u8]) -> Result<(), E>,
    nonfinite: impl Fn(f32) -> E,
) -> Result<f32, E> {
    let (mut at, mut m) = (0, 0f32);
    let mut buf = Vec::new();
    while at < len {
        let n = piece.min(len - at);
        buf.resize(n as usize, 0);
        read(at, &mut buf)?;
        let v = tensor_amax(wt, &buf);
        if !v.is_finite() {
            return Err(nonfinite(v));
        }
        m = m.max(v);
        at += n;
    }
    Ok(m)
}

/// E4M3 codes of `xs / s` rounded to the weight dtype, with compressed-tensors' `+ 0`
/// (−0 becomes +0) and clamp.
#[inline(always)]
pub fn e4m3_div<E: Elem>(xs: &[f32], s: f32, out: &mut [u8]) {
    for (o, &x) in out.iter_mut().zip(xs) {
        let y = E::round(x / s) + 0.0;
        *o = e4m3(y.clamp(-E4M3_MAX, E4M3_MAX));
    }
}

/// E4M3 codes of `xs / s` in f32, clamped, −0 kept (ModelOpt's `modelopt_e4m3_code`).
#[inline(always)]
pub fn e4m3_div_f32(xs: &[f32], s: f32, out: &mut [u8]) {
    for (o, &x) in out.iter_mut().zip(xs) {
        *o = e4m3((x / s).clamp(-E4M3_MAX, E4M3_MAX));
    }
}

/// Packed ModelOpt MXFP4 codes (`modelopt_mxfp4_code`, two per byte, even element low) of the
/// group `xs / p`.
#[inline(always)]
pub fn mxfp4_modelopt_div<const N: usize, const H: usize>(
    xs: &[f32; N],
    p: f32,
    out: &mut [u8; H],
) {
    let mut c = [0u16; N];
    for (c, &v) in c.iter_mut().zip(xs) {
        *c = super::encode::modelopt_mxfp4_code(v / p) as u16;
    }
    for (j, o) in out.iter_mut().enumerate() {
        let v = c[2 * j] | c[2 * j + 1] << 8;
        *o = (v | v >> 4) as u8;
    }
}

/// E4M3 codes of `xs · m` in f32 (transformers' FineGrainedFP8), clamped.
#[inline(always)]
pub fn e4m3_mul(xs: &[f32], m: f32, out: &mut [u8]) {
    for (o, &x) in out.iter_mut().zip(xs) {
        *o = e4m3((x * m).clamp(-E4M3_MAX, E4M3_MAX));
    }
}

/// Packed E2M1 codes (two per byte, even element low) of the group `xs / s` (`N` elements into
/// `H = N/2` bytes), each quotient rounded to the weight dtype when `ROUND` (MXFP4) or kept in
/// f32 (NVFP4), clamped to ±6. Fixed sizes keep both loops in lanes; each pair is packed as the
/// little-endian u16 `lo | hi << 8`, folded to `lo | hi << 4`.
#[inline(always)]
pub fn e2m1_div<E: Elem, const ROUND: bool, const N: usize, const H: usize>(
    xs: &[f32; N],
    s: f32,
    out: &mut [u8; H],
) {
    let mut c = [0u16; N];
    for (c, &v) in c.iter_mut().zip(xs) {
        let y = if ROUND { E::round(v / s) } else { v / s };
        *c = e2m1(y.clamp(-E2M1_MAX, E2M1_MAX)) as u16;
    }
    for (j, o) in out.iter_mut().enumerate() {
        let v = c[2 * j] | c[2 * j + 1] << 8;
        *o = (v | v >> 4) as u8;
    }
}

/// Every E4M3 code's value (NaN for 0x7F and 0xFF), for scales looked up per group.
pub static E4M3_VALUES: [f32; 256] = e4m3_values();

const fn e4m3_values() -> [f32; 256] {
    let mut t = [0f32; 256];
    let mut b = 0;
    while b < 256 {
        let (e, m) = ((b >> 3) & 0x0F, (b & 0x07) as u32);
        let v = if e == 0x0F && m == 7 {
            f32::NAN
        } else if e == 0 {
            m as f32 * (1.0 / 512.0) // m · 2^-9, exact
        } else {
            f32::from_bits(((e as u32 + 120) << 23) | (m << 20))
        };
        t[b] = if b & 0x80 != 0 { -v } else { v };
        b += 1;
    }
    t
}

/// Signed integer codes `round_half_even(clamp(W(x / s), qmin, qmax))` into `out`.
#[inline(always)]
pub fn int_div<E: Elem>(xs: &[f32], s: f32, qmin: f32, qmax: f32, out: &mut [i32]) {
    const MAGIC: f32 = 12_582_912.0; // 1.5 · 2^23: the f32 adder rounds to the units digit
    for (o, &x) in out.iter_mut().zip(xs) {
        let y = E::round(x / s).clamp(qmin, qmax);
        *o = ((y + MAGIC) - MAGIC) as i32;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::cast::{f16_to_f32, f32_to_f16};
    use crate::ops::quantize::encode::f32_to_e4m3;

    /// Every 97th f32 bit pattern plus the neighbourhoods of the interesting boundaries.
    fn samples() -> impl Iterator<Item = f32> {
        let strided = (0..=u32::MAX / 97).map(|k| f32::from_bits(k * 97));
        let edges = [
            0.0f32,
            65504.0,
            65520.0,
            2f32.powi(-14),
            2f32.powi(-24),
            2f32.powi(-25),
            448.0,
            464.0,
            480.0,
            2f32.powi(-6),
            2f32.powi(-9),
            2f32.powi(-10),
        ]
        .into_iter()
        .flat_map(|e| {
            (-300i32..=300).map(move |d| f32::from_bits((e.to_bits() as i32 + d).max(0) as u32))
        });
        strided.chain(edges).flat_map(|v| [v, -v])
    }

    #[test]
    fn f16_rounding_and_decoding_equal_the_scalar_conversions() {
        for x in samples() {
            let want = f16_to_f32(f32_to_f16(x));
            let got = round_to_f16(x);
            assert!(
                got.to_bits() == want.to_bits() || (got.is_nan() && want.is_nan()),
                "{x:e} ({:#010x}): {got:e} vs {want:e}",
                x.to_bits()
            );
        }
        for h in 0..=u16::MAX {
            let (got, want) = (f16_bits_to_f32(h), f16_to_f32(h));
            assert!(
                got.to_bits() == want.to_bits() || (got.is_nan() && want.is_nan()),
                "{h:#06x}"
            );
        }
    }

    #[test]
    fn e4m3_selects_as_the_scalar_encoder_branches() {
        for x in samples() {
            assert_eq!(e4m3(x), f32_to_e4m3(x), "{x:e} ({:#010x})", x.to_bits());
        }
    }

    #[test]
    fn tensor_amax_reads_the_stored_bits() {
        let vals = [0.5f32, -3.25, 1e-3, -0.0, 3.0, 2.0, -1.0, 0.25, 7.5e-5];
        for wt in [WeightType::BF16, WeightType::F16, WeightType::F32] {
            let mut bytes = vec![0u8; vals.len() * wt.bytes()];
            for (v, b) in vals.iter().zip(bytes.chunks_exact_mut(wt.bytes())) {
                wt.encode(wt.round(*v), b);
            }
            assert_eq!(tensor_amax(wt, &bytes), 3.25, "{wt:?}");
            let at = 3 * wt.bytes();
            wt.encode(f32::NEG_INFINITY, &mut bytes[at..at + wt.bytes()]);
            assert_eq!(tensor_amax(wt, &bytes), f32::INFINITY, "{wt:?}");
            wt.encode(f32::NAN, &mut bytes[at..at + wt.bytes()]);
            assert!(tensor_amax(wt, &bytes).is_nan(), "{wt:?}");
        }
    }

    #[test]
    fn e4m3_table_holds_every_code_value() {
        for b in 0..=255u8 {
            let (t, v) = (
                E4M3_VALUES[b as usize],
                crate::ops::fp8::codec::e4m3_to_f32(b),
            );
            assert!(
                t.to_bits() == v.to_bits() || (t.is_nan() && v.is_nan()),
                "{b:#04x}"
            );
        }
    }

    #[test]
    fn integer_amax_is_the_float_amax() {
        let xs = [0.5f32, -3.25, 1e-40, -0.0, 3.0, -1e-45];
        assert_eq!(amax(&xs), 3.25);
        assert_eq!(amax(&[-0.0, 0.0]).to_bits(), 0);
        assert_eq!(amax(&[]), 0.0);
    }
}
