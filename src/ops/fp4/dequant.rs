//! Packed FP4 (E2M1) → BF16/F16/F32, as the producing libraries decompress it.
//!
//! Codes are two per byte, the low nibble first (element `2i` in bits 0–3 of byte `i`), one
//! block scale per `group` elements along a row:
//! - NVFP4, compressed-tensors `nvfp4-pack-quantized`: `weight_packed` `U8 [out, in/2]`,
//!   `weight_scale` `F8_E4M3 [out, in/16]`, `weight_global_scale` `F32 [1]`. The library
//!   (`NVFP4PackedCompressor.decompress` → `_dequantize`) divides: `y = e2m1 · (f32(s) / g)`,
//!   the quotient rounded to f32 first, then the product, then the cast to the output dtype.
//! - NVFP4, ModelOpt: `weight` `U8 [out, in/2]`, `weight_scale` `F8_E4M3 [out, in/16]`,
//!   `weight_scale_2` `F32 []`: `y = e2m1 · (f32(s) · s2)` ([`GlobalScale::Multiply`]); its
//!   E2M1 table maps code 8 to +0 where the others give -0 ([`DequantFp4::negative_zero`]).
//! - MXFP4, compressed-tensors `mxfp4-pack-quantized`: `weight_scale` `U8 [out, in/32]` holding
//!   E8M0 exponents: `y = e2m1 · 2^(u-127)`.
//! - MXFP4, gpt-oss: `X_blocks` `U8 [E, out, G, 16]`, `X_scales` `U8 [E, out, G]`, decoded by
//!   transformers' `convert_moe_packed_tensors` with the same formula, then transposed to
//!   `X` `[E, in, out]` ([`DequantFp4::transpose`]).
//!
//! Every product of an E2M1 value (≤ 3 significant bits) and a power of two is exact in f32, so
//! for MXFP4 the only rounding is the final cast; `2^128` (`u = 255`) is infinite, as in torch.
//! A unit is one row, or one whole expert when transposing; units never share a computation,
//! so chunking cannot change a byte.

use std::ops::Range;

use super::engram::e2m1_to_f32;
use crate::format::dtype::DType;
use crate::ops::cast::store_f32;
use crate::ops::fp8::codec::e4m3_to_f32;
use crate::ops::kernel::{kernel_dtype, Kernel};
use crate::ops::Op;
use crate::plan::op_name_and_kernel;

use super::kernel::Fp4Params;

/// How a block scale is stored.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BlockScale {
    /// `F8_E4M3` (NVFP4).
    E4M3,
    /// `U8`/`F8_E8M0` exponents, `2^(u-127)` (MXFP4).
    E8M0,
}

/// How the per-tensor `F32` scale (the op's third input) combines with each block scale.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GlobalScale {
    None,
    /// compressed-tensors: `s / weight_global_scale`.
    Divide,
    /// ModelOpt: `s · weight_scale_2`.
    Multiply,
}

#[derive(Clone, Debug)]
pub struct DequantFp4 {
    /// Experts (1 for a plain matrix), rows per expert (`out`), elements per row (`in`).
    pub experts: u64,
    pub rows: u64,
    pub cols: u64,
    /// Elements per block scale.
    pub group: u64,
    pub scale: BlockScale,
    pub global: GlobalScale,
    /// Write each expert transposed, `[in, out]` (gpt-oss).
    pub transpose: bool,
    /// Whether code 8 is -0 (compressed-tensors, gpt-oss) or +0 (ModelOpt's table).
    pub negative_zero: bool,
    pub dst: DType,
    pub allow_nonfinite: bool,
}

/// The 2^(u-127) of an E8M0 exponent as torch computes `2.0 ** (u - 127)`: 2^128 is infinite.
pub fn e8m0_pow2(u: u8) -> f32 {
    match u {
        255 => f32::INFINITY,
        0 => f32::from_bits(0x0040_0000),
        _ => f32::from_bits((u as u32) << 23),
    }
}

impl DequantFp4 {
    fn groups(&self) -> u64 {
        self.cols.div_ceil(self.group)
    }
    /// Weight rows (all experts counted together) that units `units` cover.
    fn row_range(&self, units: &Range<u64>) -> Range<u64> {
        if self.transpose {
            units.start * self.rows..units.end * self.rows
        } else {
            units.clone()
        }
    }
    fn dst_bytes(&self) -> usize {
        (self.dst.bits() / 8) as usize
    }
    fn position(&self, r: u64, j: u64) -> String {
        let (e, lr) = (r / self.rows, r % self.rows);
        if self.experts > 1 || self.transpose {
            format!("[{e}, {lr}, {j}]")
        } else {
            format!("[{lr}, {j}]")
        }
    }
}

/// A positive quiet NaN per dtype, whatever NaN the arithmetic produced.
fn canonical(v: f32) -> f32 {
    if v.is_nan() {
        f32::from_bits(0x7FC0_0000)
    } else {
        v
    }
}

impl Op for DequantFp4 {
    op_name_and_kernel!("dequant-fp4", |op| Kernel::DequantFp4(Fp4Params {
        cols: op.cols,
        rows: op.rows,
        group: op.group,
        groups: op.groups(),
        e8m0: (op.scale == BlockScale::E8M0) as i32,
        global: match op.global {
            GlobalScale::None => 0,
            GlobalScale::Divide => 1,
            GlobalScale::Multiply => 2,
        },
        transpose: op.transpose as i32,
        negative_zero: op.negative_zero as i32,
        dst: kernel_dtype(op.dst),
        allow_nonfinite: op.allow_nonfinite as i32,
    }));
    fn units(&self) -> u64 {
        if self.transpose {
            self.experts
        } else {
            self.experts * self.rows
        }
    }
    fn out_unit_bytes(&self) -> u64 {
        let per_row = self.cols * (self.dst.bits() / 8);
        if self.transpose {
            per_row * self.rows
        } else {
            per_row
        }
    }
    fn in_unit_bytes(&self) -> u64 {
        let per_row = self.cols / 2 + self.groups();
        4 + if self.transpose {
            per_row * self.rows
        } else {
            per_row
        }
    }
    fn input_ranges(&self, units: Range<u64>) -> Vec<Range<u64>> {
        let rows = self.row_range(&units);
        let mut v = vec![
            rows.start * self.cols / 2..rows.end * self.cols / 2,
            rows.start * self.groups()..rows.end * self.groups(),
        ];
        if self.global != GlobalScale::None {
            v.push(0..4);
        }
        v
    }
    fn compute(&self, units: Range<u64>, inputs: &[&[u8]], out: &mut [u8]) -> Result<(), String> {
        let rows = self.row_range(&units);
        let cols = self.cols as usize;
        let groups = self.groups() as usize;
        let group = self.group as usize;
        let global = match self.global {
            GlobalScale::None => None,
            _ => Some(f32::from_le_bytes(inputs[2][..4].try_into().unwrap())),
        };
        if let Some(g) = global.filter(|g| !g.is_finite() && !self.allow_nonfinite) {
            return Err(format!(
                "the tensor scale is not finite ({g}); pass --allow-nonfinite to keep the result"
            ));
        }
        let mut lut: [f32; 16] = std::array::from_fn(|c| e2m1_to_f32(c as u8));
        if !self.negative_zero {
            lut[8] = 0.0;
        }
        let size = self.dst_bytes();
        let mut row_vals = vec![0f32; cols];
        let mut scales = vec![0f32; groups];
        for (k, r) in rows.clone().enumerate() {
            let codes = &inputs[0][k * cols / 2..(k + 1) * cols / 2];
            let raw = &inputs[1][k * groups..(k + 1) * groups];
            for (s, &b) in scales.iter_mut().zip(raw) {
                let block = match self.scale {
                    BlockScale::E4M3 => e4m3_to_f32(b),
                    BlockScale::E8M0 => e8m0_pow2(b),
                };
                *s = match (self.global, global) {
                    (GlobalScale::Divide, Some(g)) => block / g,
                    (GlobalScale::Multiply, Some(g)) => block * g,
                    _ => block,
                };
            }
            for (i, &b) in codes.iter().enumerate() {
                let j = 2 * i;
                row_vals[j] = lut[(b & 0x0F) as usize] * scales[j / group];
                if j + 1 < cols {
                    row_vals[j + 1] = lut[(b >> 4) as usize] * scales[(j + 1) / group];
                }
            }
            if !self.allow_nonfinite {
                if let Some(j) = row_vals.iter().position(|v| !v.is_finite()) {
                    let code = (codes[j / 2] >> (4 * (j % 2))) & 0x0F;
                    return Err(format!(
                        "result at {} is not finite: E2M1 code {code:#x} ({}) times block scale {:?}; pass --allow-nonfinite to keep it",
                        self.position(r, j as u64),
                        lut[code as usize],
                        scales[j / group]
                    ));
                }
            }
            if self.transpose {
                // Expert e's row lr becomes column lr of the expert's [in, out] output.
                let (e, lr) = ((k as u64 / self.rows) as usize, (r % self.rows) as usize);
                let base = e * cols * self.rows as usize;
                let o = &mut out[base * size..];
                for (j, &v) in row_vals.iter().enumerate() {
                    store_f32(self.dst, o, j * self.rows as usize + lr, canonical(v));
                }
            } else {
                let o = &mut out[k * cols * size..(k + 1) * cols * size];
                for (j, &v) in row_vals.iter().enumerate() {
                    store_f32(self.dst, o, j, canonical(v));
                }
            }
        }
        Ok(())
    }
}

crate::plan::set_dst_field!(DequantFp4);

#[cfg(test)]
mod tests {
    use super::*;

    fn op(transpose: bool, global: GlobalScale) -> DequantFp4 {
        DequantFp4 {
            experts: 2,
            rows: 3,
            cols: 64,
            group: 16,
            scale: BlockScale::E4M3,
            global,
            transpose,
            negative_zero: true,
            dst: DType::F32,
            allow_nonfinite: false,
        }
    }

    fn run(o: &DequantFp4, codes: &[u8], scales: &[u8], units: Range<u64>) -> Vec<u8> {
        let ranges = o.input_ranges(units.clone());
        let g = 3.0f32.to_le_bytes();
        let ins = [
            &codes[ranges[0].start as usize..ranges[0].end as usize],
            &scales[ranges[1].start as usize..ranges[1].end as usize],
            &g[..],
        ];
        let mut out = vec![0u8; (units.end - units.start) as usize * o.out_unit_bytes() as usize];
        o.compute(units, &ins, &mut out).unwrap();
        out
    }

    #[test]
    fn chunking_never_changes_bytes_and_transpose_moves_rows_to_columns() {
        let codes: Vec<u8> = (0..6 * 32).map(|i| (i * 37 % 256) as u8).collect();
        let scales: Vec<u8> = (0..6 * 4).map(|i| 0x30 + i as u8).collect();
        let plain = op(false, GlobalScale::Divide);
        let whole = run(&plain, &codes, &scales, 0..6);
        let mut parts = run(&plain, &codes, &scales, 0..2);
        parts.extend(run(&plain, &codes, &scales, 2..6));
        assert_eq!(whole, parts);
        // element [1, 2, 5] of the plain output
        let at = |v: &[u8], k: usize| f32::from_le_bytes(v[4 * k..4 * k + 4].try_into().unwrap());
        let code = codes[(3 + 2) * 32 + 2] & 0x0F;
        let expect = e2m1_to_f32(code) * (e4m3_to_f32(scales[5 * 4]) / 3.0);
        assert_eq!(at(&whole, 5 * 64 + 4).to_bits(), expect.to_bits());
        let t = op(true, GlobalScale::Divide);
        let tw = run(&t, &codes, &scales, 0..2);
        let mut tp = run(&t, &codes, &scales, 0..1);
        tp.extend(run(&t, &codes, &scales, 1..2));
        assert_eq!(tw, tp);
        for e in 0..2 {
            for r in 0..3 {
                for j in 0..64 {
                    assert_eq!(
                        at(&tw, e * 192 + j * 3 + r),
                        at(&whole, (e * 3 + r) * 64 + j)
                    );
                }
            }
        }
    }

    #[test]
    fn e8m0_is_a_power_of_two_and_255_is_infinite() {
        assert_eq!(e8m0_pow2(127), 1.0);
        assert_eq!(e8m0_pow2(0), 2f32.powi(-127));
        assert_eq!(e8m0_pow2(254), 2f32.powi(127));
        assert!(e8m0_pow2(255).is_infinite());
    }
}
