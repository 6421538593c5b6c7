//! Dtype casts between F64/F32/F16/BF16 (and integers with `--cast-ints`).
//!
//! Every conversion rounds once, to nearest even, like `torch.Tensor.to`. Wider sources reach
//! the 16-bit formats through an f32 rounded *to odd*, which makes the second rounding exact
//! (24 ≥ 11 + 2 bits), so F64→BF16 equals a direct correctly rounded conversion. NaN becomes
//! the canonical quiet NaN of the target (`0x7FC0` for BF16 as in c10's `round_to_nearest_even`,
//! sign-preserving `0x7E00` for F16 as in c10's `fp16_ieee_from_fp32_value`).
//!
//! F64 outputs (`--dtype float64`) widen exactly: every F32/F16/BF16 value is an f64, and 64-bit
//! integers round once, directly, to nearest even. NaN becomes `0x7FF8000000000000`. No GPU
//! kernel writes F64 (the op runs on the CPU): it is a debugging format, not a speed path.

use std::ops::Range;
use std::sync::Arc;

use crate::error::Result;
use crate::format::checkpoint::Checkpoint;
use crate::format::dtype::DType;
use crate::ops::kernel::Kernel;
use crate::ops::Op;
use crate::plan::{Derive, Entry, Plan, Step};

#[derive(Debug)]
pub struct Cast {
    pub src: DType,
    pub dst: DType,
    pub elements: u64,
}

impl Cast {
    pub fn supports(src: DType, dst: DType) -> bool {
        (src.is_castable_float() || src.is_castable_int()) && dst.is_castable_float() && src != dst
    }

    /// The cast of a whole tensor of `elements` values, when [`Cast::supports`] the pair: the
    /// plan's [`CastOp`](crate::plan::CastOp).
    fn whole_tensor(src: DType, dst: DType, elements: u64) -> Option<Arc<dyn Op>> {
        Cast::supports(src, dst).then(|| Arc::new(Cast { src, dst, elements }) as Arc<dyn Op>)
    }
}

impl Cast {
    /// Entry `e`'s stored tensor read in `e`'s dtype, for a stored tensor a cast step retyped
    /// (no op computes it) that a later op reads through [`crate::ops::feed`].
    pub fn of_entry(ckpt: &Checkpoint, e: &Entry) -> Arc<dyn Derive> {
        let cast = Cast {
            src: ckpt.tensors[e.source].info.dtype,
            dst: e.dtype,
            elements: crate::format::dtype::element_count(&e.shape).unwrap_or(0),
        };
        Arc::new(crate::plan::FixedOp {
            inputs: vec![e.source],
            op: Arc::new(cast),
        })
    }
}

impl Plan {
    /// Applies `steps` to the checkpoint's tensors: what the output holds and how each tensor is
    /// produced ([`Plan::build_with_cast`] with [`Cast`] for the tensors a cast step retyped).
    /// Defined here so that the plan module need not name the cast op.
    pub fn build(ckpt: &Checkpoint, steps: &[Step]) -> Result<Plan> {
        Plan::build_with_cast(ckpt, steps, Cast::whole_tensor)
    }
}

impl Op for Cast {
    fn kernel(&self, _units: &Range<u64>) -> Option<Kernel> {
        (self.dst != DType::F64).then_some(Kernel::Cast {
            src: self.src,
            dst: self.dst,
        })
    }
    fn name(&self) -> &'static str {
        "cast"
    }
    fn units(&self) -> u64 {
        self.elements
    }
    fn out_unit_bytes(&self) -> u64 {
        self.dst.bits() / 8
    }
    fn in_unit_bytes(&self) -> u64 {
        self.src.bits() / 8
    }
    fn input_ranges(&self, units: Range<u64>) -> Vec<Range<u64>> {
        let s = self.in_unit_bytes();
        std::iter::once(units.start * s..units.end * s).collect()
    }
    fn compute(&self, _units: Range<u64>, inputs: &[&[u8]], out: &mut [u8]) -> Result<(), String> {
        cast_slice(self.src, self.dst, inputs[0], out);
        Ok(())
    }
}

/// A base weight that an earlier `--dtype-cast` section rounded, as a later merge reads it: the
/// stored values rounded to `via`, then widened (exactly) to the merge's working dtype. Python
/// tftf applies sections one after another, so a cast before a merge rounds the base first; this
/// keeps that order without writing the intermediate. Units are rows of `row_elems` (the merges'
/// units). No GPU kernel: a merge over such a base runs on the CPU.
#[derive(Debug)]
pub struct RoundedRows {
    pub src: DType,
    pub via: DType,
    pub dst: DType,
    pub rows: u64,
    pub row_elems: u64,
}

impl Op for RoundedRows {
    fn name(&self) -> &'static str {
        "cast"
    }
    fn units(&self) -> u64 {
        self.rows
    }
    fn out_unit_bytes(&self) -> u64 {
        self.row_elems * (self.dst.bits() / 8)
    }
    fn in_unit_bytes(&self) -> u64 {
        self.row_elems * (self.src.bits() / 8)
    }
    fn input_ranges(&self, units: Range<u64>) -> Vec<Range<u64>> {
        let s = self.in_unit_bytes();
        std::iter::once(units.start * s..units.end * s).collect()
    }
    fn compute(&self, units: Range<u64>, inputs: &[&[u8]], out: &mut [u8]) -> Result<(), String> {
        let n = ((units.end - units.start) * self.row_elems) as usize;
        let mut mid = vec![0u8; n * (self.via.bits() / 8) as usize];
        cast_slice(self.src, self.via, inputs[0], &mut mid);
        cast_slice(self.via, self.dst, &mid, out);
        Ok(())
    }
}

/// The plan-time side of [`RoundedRows`].
#[derive(Debug)]
pub struct RoundedBase {
    source: usize,
    src: DType,
    via: DType,
    rows: u64,
    row_elems: u64,
}

impl RoundedBase {
    /// For an entry that an earlier cast step gave a new float dtype (and nothing computes):
    /// the rounding a merge must read it through.
    pub fn of(e: &Entry, ckpt: &Checkpoint) -> Option<RoundedBase> {
        let src = ckpt.tensors[e.source].info.dtype;
        let row_elems = *e.shape.last()?;
        let total: u64 = e.shape.iter().product();
        (e.derive.is_none() && !e.relabel && e.dtype != src && e.dtype.is_castable_float())
            .then_some(RoundedBase {
                source: e.source,
                src,
                via: e.dtype,
                rows: total.checked_div(row_elems).unwrap_or(0),
                row_elems,
            })
    }
}

impl Derive for RoundedBase {
    fn inputs(&self) -> Vec<usize> {
        vec![self.source]
    }
    fn build(&self, dst: DType) -> Arc<dyn Op> {
        Arc::new(RoundedRows {
            src: self.src,
            via: self.via,
            dst,
            rows: self.rows,
            row_elems: self.row_elems,
        })
    }
}

/// Writes `v` converted to `dst` (BF16, F16, else F32) as element `k` of `out`.
#[inline(always)]
pub fn store_f32(dst: DType, out: &mut [u8], k: usize, v: f32) {
    match dst {
        DType::BF16 => out[2 * k..2 * k + 2].copy_from_slice(&f32_to_bf16(v).to_le_bytes()),
        DType::F16 => out[2 * k..2 * k + 2].copy_from_slice(&f32_to_f16(v).to_le_bytes()),
        _ => out[4 * k..4 * k + 4].copy_from_slice(&v.to_le_bytes()),
    }
}

/// Round to nearest even, NaN → `0x7FC0`.
#[inline(always)]
pub fn f32_to_bf16(x: f32) -> u16 {
    let b = x.to_bits();
    if x.is_nan() {
        return 0x7FC0;
    }
    let lsb = (b >> 16) & 1;
    (b.wrapping_add(0x7FFF + lsb) >> 16) as u16
}

/// Round to nearest even; port of c10's `fp16_ieee_from_fp32_value`.
#[inline(always)]
pub fn f32_to_f16(f: f32) -> u16 {
    let scale_to_inf = f32::from_bits(0x7780_0000); // 2^112
    let scale_to_zero = f32::from_bits(0x0880_0000); // 2^-110
    let mut base = (f.abs() * scale_to_inf) * scale_to_zero;
    let w = f.to_bits();
    let shl1_w = w.wrapping_add(w);
    let sign = w & 0x8000_0000;
    let mut bias = shl1_w & 0xFF00_0000;
    if bias < 0x7100_0000 {
        bias = 0x7100_0000;
    }
    base += f32::from_bits((bias >> 1) + 0x0780_0000);
    let bits = base.to_bits();
    let exp_bits = (bits >> 13) & 0x0000_7C00;
    let mantissa_bits = bits & 0x0000_0FFF;
    let nonsign = exp_bits + mantissa_bits;
    ((sign >> 16)
        | if shl1_w > 0xFF00_0000 {
            0x7E00
        } else {
            nonsign
        }) as u16
}

#[inline(always)]
pub fn bf16_to_f32(b: u16) -> f32 {
    f32::from_bits((b as u32) << 16)
}

#[inline(always)]
pub fn f16_to_f32(b: u16) -> f32 {
    half::f16::from_bits(b).to_f32()
}

/// Any castable dtype as f32, rounding as `cast` does for an F32 target.
#[inline(always)]
pub fn decode_into(dtype: DType, bytes: &[u8], out: &mut [f32]) {
    let from_f32 = |bytes: &[u8], out: &mut [f32]| {
        (out.iter_mut().zip(bytes.chunks_exact(4)))
            .for_each(|(o, c)| *o = f32::from_le_bytes(c.try_into().unwrap()))
    };
    match dtype {
        DType::F32 => from_f32(bytes, out),
        DType::BF16 => out
            .iter_mut()
            .zip(bytes.chunks_exact(2))
            .for_each(|(o, c)| {
                *o = f32::from_bits((u16::from_le_bytes([c[0], c[1]]) as u32) << 16)
            }),
        DType::F16 => out
            .iter_mut()
            .zip(bytes.chunks_exact(2))
            .for_each(|(o, c)| *o = half::f16::from_le_bytes([c[0], c[1]]).to_f32()),
        _ => {
            let mut f32_bytes = vec![0u8; out.len() * 4];
            cast_slice(dtype, DType::F32, bytes, &mut f32_bytes);
            from_f32(&f32_bytes, out);
        }
    }
}

/// Any castable dtype's elements as f32 ([`decode_into`]).
pub fn to_f32(dtype: DType, bytes: &[u8]) -> Vec<f32> {
    let mut v = vec![0f32; bytes.len() / (dtype.bits() / 8) as usize];
    decode_into(dtype, bytes, &mut v);
    v
}

/// f64 → f32 rounded to odd: an inexact result gets an odd last bit, so rounding it again to a
/// format with at most 22 significant bits gives the correctly rounded value.
#[inline(always)]
pub(crate) fn f64_to_f32_odd(x: f64) -> f32 {
    // Without branches: whether an inexact result is even is a coin toss for real data, and
    // mispredicting it cost a merge writing bf16 half its time.
    let f = x as f32;
    let b = f.to_bits();
    let fix = u32::from(f.is_finite() && f as f64 != x) & !b & 1;
    // One ulp away from zero if the nearest value fell short of `x`, else towards zero.
    let step = (u32::from(x.abs() > (f as f64).abs()) << 1).wrapping_sub(1);
    f32::from_bits(b.wrapping_add(fix.wrapping_mul(step)))
}

#[inline(always)]
fn i64_to_f32_odd(x: i128) -> f32 {
    let f = x as f32;
    if f as i128 != x && f.to_bits() & 1 == 0 {
        let away = x.unsigned_abs() > (f as i128).unsigned_abs();
        let b = f.to_bits();
        return f32::from_bits(if away { b + 1 } else { b - 1 });
    }
    f
}

/// The canonical NaN of F64 outputs, positive and quiet like the 16-bit ones.
pub const F64_CANONICAL_NAN: u64 = 0x7FF8_0000_0000_0000;

/// f64 bits of `x`, NaN made canonical.
#[inline(always)]
fn f64_bits(x: f64) -> u64 {
    if x.is_nan() {
        F64_CANONICAL_NAN
    } else {
        x.to_bits()
    }
}

/// Writes f32 values as `dst` (BF16, F16 or F32, rounding once to nearest even; or F64, exact).
pub fn write_as(dst: DType, vals: impl Iterator<Item = f32>, out: &mut [u8]) {
    match dst {
        DType::F64 => {
            for (o, v) in out.chunks_exact_mut(8).zip(vals) {
                o.copy_from_slice(&f64_bits(v as f64).to_le_bytes());
            }
        }
        DType::BF16 => {
            for (o, v) in out.chunks_exact_mut(2).zip(vals) {
                o.copy_from_slice(&f32_to_bf16(v).to_le_bytes());
            }
        }
        DType::F16 => {
            for (o, v) in out.chunks_exact_mut(2).zip(vals) {
                o.copy_from_slice(&f32_to_f16(v).to_le_bytes());
            }
        }
        DType::F32 => {
            for (o, v) in out.chunks_exact_mut(4).zip(vals) {
                o.copy_from_slice(&v.to_le_bytes());
            }
        }
        _ => unreachable!("cast target {dst} is not a float"),
    }
}

/// Converts little-endian `src`-typed elements into `dst`-typed ones.
pub fn cast_slice(src: DType, dst: DType, input: &[u8], out: &mut [u8]) {
    macro_rules! le {
        ($t:ty, $n:expr) => {
            input
                .chunks_exact($n)
                .map(|c| <$t>::from_le_bytes(c.try_into().unwrap()))
        };
    }
    if dst == DType::F64 {
        return cast_to_f64(src, input, out);
    }
    // The destination decides whether the f32 step must be rounded to odd: only a 16-bit
    // target rounds a second time.
    let narrow = dst != DType::F32;
    match src {
        DType::F32 => write_as(dst, le!(f32, 4), out),
        DType::BF16 => write_as(dst, le!(u16, 2).map(bf16_to_f32), out),
        DType::F16 => write_as(dst, le!(u16, 2).map(f16_to_f32), out),
        DType::F64 if narrow => write_as(dst, le!(f64, 8).map(f64_to_f32_odd), out),
        DType::F64 => write_as(dst, le!(f64, 8).map(|v| v as f32), out),
        DType::BOOL | DType::U8 => write_as(dst, input.iter().map(|&v| v as f32), out),
        DType::I8 => write_as(dst, input.iter().map(|&v| v as i8 as f32), out),
        DType::I16 => write_as(dst, le!(i16, 2).map(|v| v as f32), out),
        DType::U16 => write_as(dst, le!(u16, 2).map(|v| v as f32), out),
        DType::I32 if narrow => write_as(dst, le!(i32, 4).map(|v| i64_to_f32_odd(v as i128)), out),
        DType::I32 => write_as(dst, le!(i32, 4).map(|v| v as f32), out),
        DType::U32 if narrow => write_as(dst, le!(u32, 4).map(|v| i64_to_f32_odd(v as i128)), out),
        DType::U32 => write_as(dst, le!(u32, 4).map(|v| v as f32), out),
        DType::I64 if narrow => write_as(dst, le!(i64, 8).map(|v| i64_to_f32_odd(v as i128)), out),
        DType::I64 => write_as(dst, le!(i64, 8).map(|v| v as f32), out),
        DType::U64 if narrow => write_as(dst, le!(u64, 8).map(|v| i64_to_f32_odd(v as i128)), out),
        DType::U64 => write_as(dst, le!(u64, 8).map(|v| v as f32), out),
        _ => unreachable!("cast source {src} is not castable"),
    }
}

/// Converts `src` elements to F64: exact for every float and 32-bit integer, one rounding to
/// nearest even for 64-bit integers.
fn cast_to_f64(src: DType, input: &[u8], out: &mut [u8]) {
    macro_rules! le {
        ($t:ty, $n:expr) => {
            input
                .chunks_exact($n)
                .map(|c| <$t>::from_le_bytes(c.try_into().unwrap()))
        };
    }
    let mut put = |vals: &mut dyn Iterator<Item = f64>| {
        for (o, v) in out.chunks_exact_mut(8).zip(vals) {
            o.copy_from_slice(&f64_bits(v).to_le_bytes());
        }
    };
    match src {
        DType::F32 => put(&mut le!(f32, 4).map(f64::from)),
        DType::BF16 => put(&mut le!(u16, 2).map(|v| bf16_to_f32(v) as f64)),
        DType::F16 => put(&mut le!(u16, 2).map(|v| f16_to_f32(v) as f64)),
        DType::BOOL | DType::U8 => put(&mut input.iter().map(|&v| v as f64)),
        DType::I8 => put(&mut input.iter().map(|&v| v as i8 as f64)),
        DType::I16 => put(&mut le!(i16, 2).map(f64::from)),
        DType::U16 => put(&mut le!(u16, 2).map(f64::from)),
        DType::I32 => put(&mut le!(i32, 4).map(f64::from)),
        DType::U32 => put(&mut le!(u32, 4).map(f64::from)),
        DType::I64 => put(&mut le!(i64, 8).map(|v| v as f64)),
        DType::U64 => put(&mut le!(u64, 8).map(|v| v as f64)),
        _ => unreachable!("cast source {src} is not castable to F64"),
    }
}

#[cfg(test)]
mod tests {
    /// The rounding to odd as first written, with branches.
    fn f64_to_f32_odd_branching(x: f64) -> f32 {
        let f = x as f32;
        if f.is_finite() && f as f64 != x && f.to_bits() & 1 == 0 {
            let away = x.abs() > (f as f64).abs();
            let b = f.to_bits();
            return f32::from_bits(if away { b + 1 } else { b - 1 });
        }
        f
    }

    #[test]
    fn rounding_to_odd_without_branches_gives_the_same_bits() {
        let mut z = 0x9E37_79B9_7F4A_7C15u64;
        let specials = [
            0.0,
            -0.0,
            f64::MIN_POSITIVE,
            1e-45,
            -1e-45,
            1e-300,
            f32::MAX as f64,
            f32::MAX as f64 * (1.0 + 1e-9),
            -(f32::MAX as f64) * 1.5,
            f64::INFINITY,
            f64::NEG_INFINITY,
            f64::NAN,
            1.0 + f64::EPSILON,
            -1.0 - f64::EPSILON,
        ];
        // Any bit pattern, and values spread over f32's range (subnormals included).
        let randoms = (0..400_000).map(|k| {
            z = z
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            if k % 2 == 0 {
                f64::from_bits(z)
            } else {
                let unit = (z >> 11) as f64 / (1u64 << 53) as f64 - 0.5;
                unit * 2f64.powi((z % 280) as i32 - 150)
            }
        });
        for x in specials.into_iter().chain(randoms) {
            let (a, b) = (f64_to_f32_odd(x), f64_to_f32_odd_branching(x));
            assert!(
                a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan()),
                "{x:e}"
            );
        }
    }

    use super::*;
    use half::{bf16, f16};

    fn lcg(seed: &mut u64) -> u32 {
        *seed = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (*seed >> 32) as u32
    }

    #[test]
    fn f32_to_16_bit_matches_half_on_random_and_edge_bits() {
        let mut seed = 7;
        let edges = [
            0u32,
            0x8000_0000,
            0x7F80_0000,
            0xFF80_0000,
            0x7F7F_FFFF,
            0x0000_0001,
            0x3F80_8000,
            0x3F81_8000,
            0x477F_F000,
            0x477F_EFFF,
            0x3380_0000,
            0x3300_0001,
            0x3300_0000,
        ];
        for bits in edges
            .into_iter()
            .chain((0..2_000_000).map(|_| lcg(&mut seed)))
        {
            let x = f32::from_bits(bits);
            if x.is_nan() {
                assert_eq!(f32_to_bf16(x), 0x7FC0);
                assert_eq!(f32_to_f16(x) & 0x7FFF, 0x7E00);
                continue;
            }
            assert_eq!(
                f32_to_bf16(x),
                bf16::from_f32(x).to_bits(),
                "bf16 {bits:#x}"
            );
            assert_eq!(f32_to_f16(x), f16::from_f32(x).to_bits(), "f16 {bits:#x}");
        }
    }

    /// Independent oracle: the nearest of all finite values of a 16-bit format (ties to the
    /// even code), with values past the largest finite one plus half an ulp becoming infinity.
    fn nearest_16(x: f64, table: &[f64], inf_code: u16) -> u16 {
        let sign = if x.is_sign_negative() { 0x8000 } else { 0 };
        let a = x.abs();
        let max_code = table.len() - 1;
        let next_after_max = 2.0 * table[max_code] - table[max_code - 1];
        let i = table.partition_point(|&v| v <= a);
        let (lo, hi) = if i == 0 { (0, 0) } else { (i - 1, i) };
        let code = if hi > max_code {
            let d_lo = a - table[lo];
            let d_hi = next_after_max - a;
            if d_hi < d_lo || (d_hi == d_lo && lo % 2 == 1) {
                inf_code as usize
            } else {
                lo
            }
        } else if table[lo] == a {
            lo
        } else {
            let (d_lo, d_hi) = (a - table[lo], table[hi] - a);
            if d_lo < d_hi || (d_lo == d_hi && lo % 2 == 0) {
                lo
            } else {
                hi
            }
        };
        code as u16 | sign
    }

    #[test]
    fn f64_to_16_bit_rounds_once() {
        // 1 + 2^-8 + 2^-40: just above the bf16 tie. Rounding through a plain f32 loses the
        // 2^-40, makes an exact tie and rounds down to 1.0; the right answer is 1 + 2^-7
        // (`half::bf16::from_f64` gets this wrong, so it is not used as the oracle).
        let x = 1.0 + 2f64.powi(-8) + 2f64.powi(-40);
        let mut out = [0u8; 2];
        cast_slice(DType::F64, DType::BF16, &x.to_le_bytes(), &mut out);
        assert_eq!(u16::from_le_bytes(out), 0x3F81);
        let bf16_table: Vec<f64> = (0..=0x7F7F).map(|c| bf16_to_f32(c) as f64).collect();
        let f16_table: Vec<f64> = (0..=0x7BFF).map(|c| f16_to_f32(c) as f64).collect();
        let mut seed = 11;
        for k in 0..100_000 {
            let mant = ((lcg(&mut seed) as u64) << 20) ^ lcg(&mut seed) as u64;
            let exp = (lcg(&mut seed) % 60) as i32 - 40 + if k % 4 == 0 { 100 } else { 0 };
            let mut x = (1.0 + (mant & ((1 << 52) - 1)) as f64 / 2f64.powi(52)) * 2f64.powi(exp);
            if k % 2 == 1 {
                x = -x;
            }
            let mut o = [0u8; 2];
            cast_slice(DType::F64, DType::BF16, &x.to_le_bytes(), &mut o);
            assert_eq!(
                u16::from_le_bytes(o),
                nearest_16(x, &bf16_table, 0x7F80),
                "bf16 {x:e}"
            );
            cast_slice(DType::F64, DType::F16, &x.to_le_bytes(), &mut o);
            assert_eq!(
                u16::from_le_bytes(o),
                nearest_16(x, &f16_table, 0x7C00),
                "f16 {x:e}"
            );
        }
    }

    #[test]
    fn large_ints_round_once() {
        // 2^60 + 2^36 + 1 is just above a bf16 tie; via f32 (or f64) it would become a tie.
        let x: i64 = (1 << 60) + (1 << 52) + 1;
        let mut out = [0u8; 2];
        cast_slice(DType::I64, DType::BF16, &x.to_le_bytes(), &mut out);
        let got = bf16_to_f32(u16::from_le_bytes(out)) as f64;
        assert_eq!(got, 2f64.powi(60) + 2f64.powi(53));
        let mut out4 = [0u8; 4];
        cast_slice(DType::I64, DType::F32, &x.to_le_bytes(), &mut out4);
        assert_eq!(f32::from_le_bytes(out4), x as f32);
    }

    #[test]
    fn f64_outputs_are_exact_widenings() {
        let cases: [(DType, Vec<u8>, Vec<f64>); 4] = [
            (
                DType::BF16,
                [0x3F80u16, 0x0001, 0x8000, 0xFF80, 0xC2F7]
                    .iter()
                    .flat_map(|v| v.to_le_bytes())
                    .collect(),
                vec![1.0, 2f64.powi(-133), -0.0, f64::NEG_INFINITY, -123.5],
            ),
            (
                DType::F16,
                [0x0001u16, 0x7BFF]
                    .iter()
                    .flat_map(|v| v.to_le_bytes())
                    .collect(),
                vec![2f64.powi(-24), 65504.0],
            ),
            (
                DType::F32,
                [f32::from_bits(1), 0.1f32, f32::MAX]
                    .iter()
                    .flat_map(|v| v.to_le_bytes())
                    .collect(),
                vec![2f64.powi(-149), 0.1f32 as f64, f32::MAX as f64],
            ),
            (
                DType::I64,
                [(1i64 << 60) + 1, -3]
                    .iter()
                    .flat_map(|v| v.to_le_bytes())
                    .collect(),
                vec![2f64.powi(60), -3.0],
            ),
        ];
        for (src, input, want) in cases {
            let mut out = vec![0u8; want.len() * 8];
            cast_slice(src, DType::F64, &input, &mut out);
            let got: Vec<u64> = out
                .chunks_exact(8)
                .map(|c| u64::from_le_bytes(c.try_into().unwrap()))
                .collect();
            let want: Vec<u64> = want.iter().map(|v| v.to_bits()).collect();
            assert_eq!(got, want, "{src}");
        }
        let mut out = [0u8; 8];
        cast_slice(DType::BF16, DType::F64, &0xFFC1u16.to_le_bytes(), &mut out);
        assert_eq!(u64::from_le_bytes(out), F64_CANONICAL_NAN);
        assert!(!Cast {
            src: DType::F32,
            dst: DType::F64,
            elements: 1
        }
        .has_kernel());
    }

    #[test]
    fn widening_is_exact() {
        let vals: Vec<u8> = [0x3F80u16, 0x0001, 0x8000, 0x7F80, 0xC2F7]
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect();
        let mut out = vec![0u8; 20];
        cast_slice(DType::BF16, DType::F32, &vals, &mut out);
        let back: Vec<u16> = out
            .chunks_exact(4)
            .map(|c| f32_to_bf16(f32::from_le_bytes(c.try_into().unwrap())))
            .collect();
        assert_eq!(back, vec![0x3F80, 0x0001, 0x8000, 0x7F80, 0xC2F7]);
    }

    #[test]
    fn bf16_and_f16_match_ml_dtypes_fixture() {
        let fx = crate::test_fixtures::scalars();
        let inputs = fx["inputs_f32_bits"].as_array().unwrap();
        let bf = fx["encode_BF16_bits"].as_array().unwrap();
        let hf = fx["encode_F16_bits"].as_array().unwrap();
        for ((x, b), h) in inputs.iter().zip(bf).zip(hf) {
            let x = f32::from_bits(x.as_u64().unwrap() as u32);
            assert_eq!(f32_to_bf16(x) as u64, b.as_u64().unwrap(), "bf16 of {x:e}");
            assert_eq!(f32_to_f16(x) as u64, h.as_u64().unwrap(), "f16 of {x:e}");
        }
    }
}
