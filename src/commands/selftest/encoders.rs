//! Selftest cases of the quantisers' kernels (`tftf quantize`): every row-local scheme on every
//! weight dtype, on rows built to reach the encoders' edges.

use std::ops::Range;
use std::sync::Arc;

use super::table::{f32_bytes_as, Case, Lcg};
use crate::format::dtype::DType;
use crate::ops::fp8::codec::e4m3_to_f32;
use crate::ops::kernel::Kernel;
use crate::ops::quantize::encode::{amax, nvfp4_global_scale, WeightType};
use crate::ops::quantize::kernel::QuantParams;
use crate::ops::quantize::ops::{fp8_block_scales, BlockMath, QuantizeRows, FP8_BLOCK};
use crate::ops::quantize::Scheme;
use crate::ops::Op;

/// Values that sit on a rounding boundary when the scale is 1: E4M3 midpoints (ties of the FP8
/// encoders), E2M1 midpoints, and half integers (ties of the int encoders). All are exact in
/// BF16 and F16.
fn ties() -> Vec<f32> {
    let mut v: Vec<f32> = (0u8..0x7E)
        .map(|c| (e4m3_to_f32(c) + e4m3_to_f32(c + 1)) / 2.0)
        .collect();
    v.extend([0.25f32, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]);
    v.extend((0..128).map(|k| k as f32 + 0.5));
    v
}

/// Group maxima that make the scale 1 (or a power of two) under each scheme: 448 (FP8), 6
/// (NVFP4 with tensor scale 1), 127.5 and 7.5 (W8, W4), 4 and 256 (MXFP4, MXFP8).
const TIE_AMAX: [f32; 6] = [448.0, 6.0, 127.5, 7.5, 4.0, 256.0];

/// A `rows` × `cols` weight stored as `wt`, a row kind per row (by row number mod 8): all zeros
/// with negative zeros; random values of one magnitude; rounding ties with every 16th element at
/// a group maximum that makes the scale 1; magnitudes whose scales are subnormal (F16: tiny
/// subnormal weights); large magnitudes; a magnitude per 16 elements; F16-subnormal weights;
/// zero groups and small negatives that round to -0 beside a maximum.
pub fn quantize_weight(wt: WeightType, rows: u64, cols: u64, rng: &mut Lcg) -> Vec<u8> {
    let ties = ties();
    let f16 = wt == WeightType::F16;
    let unit = |rng: &mut Lcg| rng.next_u32() as f32 / u32::MAX as f32 * 2.0 - 1.0;
    let mut v = Vec::with_capacity((rows * cols) as usize);
    for r in 0..rows {
        let e_row = if f16 {
            (rng.next_u32() % 24) as i32 - 12
        } else {
            (rng.next_u32() % 40) as i32 - 24
        };
        let a = TIE_AMAX[(r / 8) as usize % TIE_AMAX.len()];
        let mut e_group = 0;
        for c in 0..cols {
            if c % 16 == 0 {
                e_group = (rng.next_u32() % 36) as i32 - if f16 { 20 } else { 28 };
            }
            let x = match r % 8 {
                0 => {
                    if c % 3 == 1 {
                        -0.0
                    } else {
                        0.0
                    }
                }
                1 => unit(rng) * 2f32.powi(e_row),
                2 => {
                    let sign = if rng.next_u32() & 1 == 1 { -1.0 } else { 1.0 };
                    if c % 16 == 0 {
                        sign * a
                    } else {
                        // a tie no larger than the group maximum
                        let t = ties[rng.next_u32() as usize % ties.len()];
                        sign * if t <= a { t } else { t % a }
                    }
                }
                3 if f16 => unit(rng) * 2f32.powi(-14 - (rng.next_u32() % 10) as i32),
                3 => unit(rng) * 2f32.powi(-118 - (rng.next_u32() % 16) as i32),
                4 if f16 => unit(rng) * 2f32.powi(10 + (rng.next_u32() % 5) as i32),
                4 => unit(rng) * 2f32.powi(100 + (rng.next_u32() % 26) as i32),
                5 => unit(rng) * 2f32.powi(e_group),
                6 => unit(rng) * 2f32.powi(-24 + (rng.next_u32() % 11) as i32),
                _ => match c % 32 {
                    0 => 6.0,
                    1..=15 => -(unit(rng).abs() * 0.25),
                    _ if c / 32 % 2 == 1 => 0.0,
                    _ => unit(rng) * 3.0,
                },
            };
            v.push(x);
        }
    }
    let bytes: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
    f32_bytes_as(wt.dtype(), &bytes)
}

/// The row-local schemes with a column count each (FP8_DYNAMIC's ragged: it has no groups).
pub const QUANTIZE_SHAPES: [(Scheme, u64); 6] = [
    (Scheme::Fp8Dynamic, 300),
    (Scheme::W8A16, 256),
    (Scheme::W4A16, 384),
    (Scheme::Nvfp4A16, 80),
    (Scheme::Mxfp4A16, 96),
    (Scheme::Mxfp8A16, 160),
];

/// The quantiser op of `scheme` over `weight` (NVFP4's tensor scale from its amax, as a
/// weight outside a fused group gets).
pub fn quantize_op(
    scheme: Scheme,
    wt: WeightType,
    rows: u64,
    cols: u64,
    weight: &[u8],
) -> QuantizeRows {
    let global = if scheme == Scheme::Nvfp4A16 {
        let mut x = Vec::new();
        wt.decode(weight, &mut x);
        nvfp4_global_scale(wt, amax(&x))
    } else {
        1.0
    };
    QuantizeRows {
        scheme,
        rows,
        cols,
        wt,
        global,
        block: BlockMath::CompressedTensors,
    }
}

/// FP8_BLOCK as one op over whole 128-row block rows (a unit): codes (output 0) and the block
/// scales (output 1), computed with the block arithmetic of `quantize::ops`, so that the
/// selftest runs the FP8 block kernel against it. `rows` is a multiple of 128 here (a unit has
/// a fixed size); tests/kernels.rs covers a shorter last block row.
#[derive(Debug)]
pub struct Fp8BlockRows {
    pub rows: u64,
    pub cols: u64,
    pub wt: WeightType,
    pub math: BlockMath,
}

impl Fp8BlockRows {
    fn grid_cols(&self) -> u64 {
        self.cols.div_ceil(FP8_BLOCK)
    }
}

impl Op for Fp8BlockRows {
    fn name(&self) -> &'static str {
        "quantize fp8 blocks"
    }
    fn units(&self) -> u64 {
        self.rows / FP8_BLOCK
    }
    fn out_unit_bytes(&self) -> u64 {
        FP8_BLOCK * self.cols
    }
    fn in_unit_bytes(&self) -> u64 {
        FP8_BLOCK * self.cols * self.wt.bytes() as u64
    }
    fn extra_outputs(&self) -> usize {
        1
    }
    fn extra_unit_bytes(&self, _k: usize) -> u64 {
        self.grid_cols() * self.math.scale_bytes(self.wt) as u64
    }
    fn input_ranges(&self, units: Range<u64>) -> Vec<Range<u64>> {
        let b = self.in_unit_bytes();
        std::iter::once(units.start * b..units.end * b).collect()
    }
    fn compute(&self, units: Range<u64>, inputs: &[&[u8]], out: &mut [u8]) -> Result<(), String> {
        let mut scales = vec![0u8; ((units.end - units.start) * self.extra_unit_bytes(1)) as usize];
        self.compute_all(units, inputs, &mut [out, &mut scales])
    }
    fn compute_all(
        &self,
        units: Range<u64>,
        inputs: &[&[u8]],
        outs: &mut [&mut [u8]],
    ) -> Result<(), String> {
        let (wt, math, cols) = (self.wt, self.math, self.cols as usize);
        let mut x = Vec::new();
        wt.decode(inputs[0], &mut x);
        if let Some(i) = x.iter().position(|v| !v.is_finite()) {
            let r = units.start * FP8_BLOCK + (i / cols) as u64;
            return Err(format!("holds {} at [{r}, {}]", x[i], i % cols));
        }
        let b = FP8_BLOCK as usize;
        let sb = math.scale_bytes(wt);
        let [codes, scales] = outs else {
            unreachable!("codes and scales")
        };
        let mut o = 0;
        for r0 in (0..x.len() / cols).step_by(b) {
            let blocks = fp8_block_scales(math, wt, &x[r0 * cols..(r0 + b) * cols], b, cols);
            for &(s, _) in &blocks {
                math.write(wt, s, &mut scales[o..o + sb]);
                o += sb;
            }
            for r in r0..r0 + b {
                for c in 0..cols {
                    codes[r * cols + c] = math.encode(wt, x[r * cols + c], blocks[c / b].1);
                }
            }
        }
        Ok(())
    }
    fn kernel(&self, units: &Range<u64>) -> Option<Kernel> {
        let rows = (units.end - units.start) * FP8_BLOCK;
        Some(Kernel::Quantize(QuantParams::new(
            Scheme::Fp8Block,
            rows,
            self.cols,
            self.wt,
            1.0,
            self.math,
        )))
    }
}

/// Every row-local scheme × weight dtype, 48 rows (each row kind six times), and FP8 blocks in
/// both block arithmetics (ragged columns).
pub fn quantize_cases(rng: &mut Lcg, out: &mut Vec<Case>) {
    let rows = 48u64;
    for (scheme, cols) in QUANTIZE_SHAPES {
        for wt in [WeightType::BF16, WeightType::F16, WeightType::F32] {
            let weight = quantize_weight(wt, rows, cols, rng);
            out.push(Case {
                kernel: "quantize",
                what: format!("{} {}, {rows}×{cols}", scheme.name(), wt.dtype()),
                op: Arc::new(quantize_op(scheme, wt, rows, cols, &weight)),
                inputs: vec![weight],
                out_dtype: DType::U8,
            });
        }
    }
    let (rows, cols) = (256u64, 300u64);
    for math in [BlockMath::CompressedTensors, BlockMath::Transformers] {
        for wt in [WeightType::BF16, WeightType::F16, WeightType::F32] {
            out.push(Case {
                kernel: "quantize",
                what: format!(
                    "FP8_BLOCK{} {}, {rows}×{cols}",
                    if math == BlockMath::Transformers {
                        " fp8-native"
                    } else {
                        ""
                    },
                    wt.dtype()
                ),
                op: Arc::new(Fp8BlockRows {
                    rows,
                    cols,
                    wt,
                    math,
                }),
                inputs: vec![quantize_weight(wt, rows, cols, rng)],
                out_dtype: DType::U8,
            });
        }
    }
}
