//! ModelOpt INT4 (`quant_algo: W4A16_AWQ`, what `quantize --scheme W4A16 --format modelopt` and
//! ModelOpt's `INT4_BLOCKWISE_WEIGHT_ONLY_CFG` / AWQ export write) → BF16/F16/F32.
//!
//! Layout (`pack_int4_in_uint8`): `weight` `U8 [out/2, in]`, byte `[k, c]` holding row `2k`'s
//! code in the low nibble and row `2k+1`'s in the high one, two's complement (-8..=7);
//! `weight_scale` `F32 [out, in/g]`. Decoded as `round(f32(q) · scale)` (ModelOpt has no
//! decoder of its own for it; this is the value its quantiser rounded to). A unit is one packed
//! row (two weight rows), so chunking cannot change a byte.

use std::ops::Range;

use super::kernel::Int4Params;
use crate::format::dtype::DType;
use crate::ops::cast::store_f32;
use crate::ops::kernel::{kernel_dtype, Kernel};
use crate::ops::Op;
use crate::plan::op_name_and_kernel;

#[derive(Clone, Debug)]
pub struct DequantModeloptInt4 {
    /// Weight rows (twice the packed rows) and columns.
    pub rows: u64,
    pub cols: u64,
    /// Columns per scale.
    pub group: u64,
    pub dst: DType,
}

crate::plan::set_dst_field!(DequantModeloptInt4);

impl DequantModeloptInt4 {
    fn groups(&self) -> u64 {
        self.cols / self.group
    }
    fn dst_bytes(&self) -> u64 {
        self.dst.bits() / 8
    }
}

impl Op for DequantModeloptInt4 {
    op_name_and_kernel!("dequant-int4-modelopt", |op| Kernel::DequantInt4Modelopt(
        Int4Params {
            cols: op.cols,
            group: op.group,
            groups: op.groups(),
            dst: kernel_dtype(op.dst),
            pad: 0,
        }
    ));
    fn units(&self) -> u64 {
        self.rows / 2
    }
    fn out_unit_bytes(&self) -> u64 {
        2 * self.cols * self.dst_bytes()
    }
    fn in_unit_bytes(&self) -> u64 {
        self.cols + 2 * self.groups() * 4
    }
    fn input_ranges(&self, units: Range<u64>) -> Vec<Range<u64>> {
        let s = 2 * self.groups() * 4;
        vec![
            units.start * self.cols..units.end * self.cols,
            units.start * s..units.end * s,
        ]
    }
    fn compute(&self, units: Range<u64>, inputs: &[&[u8]], out: &mut [u8]) -> Result<(), String> {
        let (cols, groups, group) = (
            self.cols as usize,
            self.groups() as usize,
            self.group as usize,
        );
        let (codes, scales) = (inputs[0], inputs[1]);
        let n = (units.end - units.start) as usize;
        let b = self.dst_bytes() as usize;
        for k in 0..n {
            for half in 0..2 {
                let r = 2 * k + half;
                let srow = &scales[r * groups * 4..(r + 1) * groups * 4];
                let orow = &mut out[r * cols * b..(r + 1) * cols * b];
                for c in 0..cols {
                    let nib = (codes[k * cols + c] >> (4 * half)) & 0x0F;
                    let q = ((nib << 4) as i8 >> 4) as f32;
                    let g = c / group;
                    let s = f32::from_le_bytes(srow[4 * g..4 * g + 4].try_into().unwrap());
                    let v = q * s;
                    if !v.is_finite() {
                        let row = units.start as usize * 2 + r;
                        return Err(format!("scale {s} of row {row}, group {g} is not finite"));
                    }
                    store_f32(self.dst, orow, c, v);
                }
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rows_pair_in_nibbles_twos_complement() {
        let op = DequantModeloptInt4 {
            rows: 2,
            cols: 2,
            group: 2,
            dst: DType::F32,
        };
        // row 0: 7, -8; row 1: -1, 1 (scales 0.5 and 2)
        let codes = [0xF7u8, 0x18];
        let mut scales = 0.5f32.to_le_bytes().to_vec();
        scales.extend(2f32.to_le_bytes());
        let mut out = vec![0u8; 16];
        op.compute(0..1, &[&codes, &scales], &mut out).unwrap();
        let v = crate::ops::cast::to_f32(DType::F32, &out);
        assert_eq!(v, [3.5, -4.0, -2.0, 2.0]);
    }
}
