//! The integer family: compressed-tensors `pack-quantized` weights → BF16/F16/F32.
//!
//! Layout (`PackedQuantizationCompressor`): `weight_packed` `I32 [out, ceil(in·b/32)]`, each row
//! one little-endian bitstream holding element `i` at bits `i·b … i·b+b-1` (a code may straddle
//! two words), stored as `q + 2^(b-1)`; `weight_scale` (the model's float dtype) `[out, in/g]`
//! per group or `[out, 1]` per channel; `weight_shape` `[out, in]`. Asymmetric schemes add
//! `weight_zero_point` `I32 [ceil(out·b/32), in/g]`, packed the same way but along dim 0
//! (`pack_to_int32(zp, b, packed_dim=0)`): column `g` is one bitstream holding row `r`'s zero
//! point at bits `r·b …`. The library decodes `y = (q - zp) · scale` in the scale's dtype; the
//! difference of two b-bit integers is exact in BF16/F16 (|q - zp| ≤ 255), and its product with
//! a BF16/F16 scale is exact in f32, so `round(f32(q - zp) · f32(s))` is bit-exact.
//!
//! A unit is one row; with zero points chunks start at multiples of 32 rows, where the packed
//! zero-point rows (b words per 32 weight rows) start too, so a chunk reads whole words.

pub mod bitnet;
pub mod gptq;
pub use crate::plan::kernel::int as kernel;
pub mod modelopt;

use std::ops::Range;

use crate::format::dtype::DType;
use crate::ops::cast::{bf16_to_f32, f16_to_f32, store_f32};
use crate::ops::kernel::{kernel_dtype, Kernel};
use crate::ops::Op;
use crate::plan::op_name_and_kernel;
use kernel::IntParams;

#[derive(Clone, Debug)]
pub struct DequantPackedInt {
    pub rows: u64,
    pub cols: u64,
    pub bits: u32,
    /// I32 words per row.
    pub words: u64,
    /// Elements per scale (`cols` for per-channel scales).
    pub group: u64,
    pub scale_dtype: DType,
    /// Whether a packed `weight_zero_point` is the third input.
    pub zero_point: bool,
    pub dst: DType,
}

crate::plan::set_dst_field!(DequantPackedInt);

/// Weight rows whose zero points fill whole packed words: 32 rows of `b` bits are `b` words.
const ZP_ROWS: u64 = 32;

impl DequantPackedInt {
    fn groups(&self) -> u64 {
        self.cols.div_ceil(self.group)
    }
    fn scale_bytes(&self) -> u64 {
        self.scale_dtype.bits() / 8
    }
    /// Packed zero-point word rows covering weight rows `rows`.
    fn zp_word_rows(&self, rows: &Range<u64>) -> Range<u64> {
        let b = self.bits as u64;
        rows.start * b / 32..(rows.end * b).div_ceil(32)
    }
}

/// Element `i` of a row's little-endian bitstream of `bits`-bit codes.
#[inline(always)]
pub fn unpack_code(words: &[u8], i: usize, bits: u32) -> u32 {
    let bit = i * bits as usize;
    let (byte, off) = (bit / 8, bit % 8);
    // Up to 8 bits starting at `off` fit in two bytes.
    let lo = words[byte] as u32;
    let hi = words.get(byte + 1).copied().unwrap_or(0) as u32;
    ((lo | (hi << 8)) >> off) & ((1 << bits) - 1)
}

impl Op for DequantPackedInt {
    op_name_and_kernel!("dequant-int", |op| Kernel::DequantInt(IntParams {
        cols: op.cols,
        words: op.words,
        group: op.group,
        groups: op.groups(),
        bits: op.bits as i32,
        scale_dtype: kernel_dtype(op.scale_dtype),
        dst: kernel_dtype(op.dst),
        zero_point: op.zero_point as i32,
    }));
    fn units(&self) -> u64 {
        self.rows
    }
    fn out_unit_bytes(&self) -> u64 {
        self.cols * (self.dst.bits() / 8)
    }
    fn in_unit_bytes(&self) -> u64 {
        // A zero point costs b bits per group per row; count a whole word to stay an upper bound.
        4 * self.words + self.groups() * (self.scale_bytes() + 4 * self.zero_point as u64)
    }
    fn granularity(&self) -> u64 {
        if self.zero_point {
            ZP_ROWS
        } else {
            1
        }
    }
    fn input_ranges(&self, units: Range<u64>) -> Vec<Range<u64>> {
        let (w, s) = (4 * self.words, self.groups() * self.scale_bytes());
        let mut v = vec![
            units.start * w..units.end * w,
            units.start * s..units.end * s,
        ];
        if self.zero_point {
            let zw = self.zp_word_rows(&units);
            let row = 4 * self.groups();
            v.push(zw.start * row..zw.end * row);
        }
        v
    }
    fn compute(&self, units: Range<u64>, inputs: &[&[u8]], out: &mut [u8]) -> Result<(), String> {
        let (wb, groups) = (4 * self.words as usize, self.groups() as usize);
        let sb = self.scale_bytes() as usize;
        let (cols, group, size) = (
            self.cols as usize,
            self.group as usize,
            (self.dst.bits() / 8) as usize,
        );
        let offset = 1i32 << (self.bits - 1);
        // Zero points of one group column, rows of this chunk, as a little-endian bitstream.
        let zp_rows = self.zp_word_rows(&units);
        let zp_words = (zp_rows.end - zp_rows.start) as usize;
        let zp_column = |g: usize| -> Vec<u8> {
            (0..zp_words)
                .flat_map(|w| {
                    let at = 4 * (w * groups + g);
                    [
                        inputs[2][at],
                        inputs[2][at + 1],
                        inputs[2][at + 2],
                        inputs[2][at + 3],
                    ]
                })
                .collect()
        };
        let zp_columns: Vec<Vec<u8>> = if self.zero_point {
            (0..groups).map(zp_column).collect()
        } else {
            Vec::new()
        };
        for k in 0..(units.end - units.start) as usize {
            let words = &inputs[0][k * wb..(k + 1) * wb];
            let raw = &inputs[1][k * groups * sb..(k + 1) * groups * sb];
            let scales: Vec<f32> = raw
                .chunks_exact(sb)
                .map(|c| match self.scale_dtype {
                    DType::BF16 => bf16_to_f32(u16::from_le_bytes([c[0], c[1]])),
                    DType::F16 => f16_to_f32(u16::from_le_bytes([c[0], c[1]])),
                    _ => f32::from_le_bytes(c.try_into().unwrap()),
                })
                .collect();
            let zeros: Vec<i32> = if self.zero_point {
                zp_columns
                    .iter()
                    .map(|c| unpack_code(c, k, self.bits) as i32)
                    .collect()
            } else {
                vec![offset; groups]
            };
            let o = &mut out[k * cols * size..(k + 1) * cols * size];
            for j in 0..cols {
                let q = unpack_code(words, j, self.bits) as i32 - zeros[j / group];
                let v = q as f32 * scales[j / group];
                store_f32(self.dst, o, j, v);
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_straddling_words_unpack_in_order() {
        // 3-bit codes 0..=7 repeated, packed LSB first into a bitstream.
        let codes: Vec<u32> = (0..40).map(|i| i % 8).collect();
        let mut bytes = vec![0u8; 16];
        for (i, &c) in codes.iter().enumerate() {
            for b in 0..3 {
                if c >> b & 1 == 1 {
                    let bit = i * 3 + b;
                    bytes[bit / 8] |= 1 << (bit % 8);
                }
            }
        }
        for (i, &c) in codes.iter().enumerate() {
            assert_eq!(unpack_code(&bytes, i, 3), c, "element {i}");
        }
    }

    /// Runs `op` over `units` with the inputs sliced as its `input_ranges` ask.
    fn run(op: &DequantPackedInt, all: &[&[u8]], units: Range<u64>) -> Vec<u8> {
        let ranges = op.input_ranges(units.clone());
        let ins: Vec<&[u8]> = all
            .iter()
            .zip(&ranges)
            .map(|(a, r)| &a[r.start as usize..r.end as usize])
            .collect();
        let mut out = vec![0u8; (units.end - units.start) as usize * op.out_unit_bytes() as usize];
        op.compute(units, &ins, &mut out).unwrap();
        out
    }

    /// 3-bit zero points straddle words both ways: a chunk of 32 rows reads 3 word rows.
    #[test]
    fn zero_points_packed_down_columns_decode_the_same_in_chunks_of_32_rows() {
        let (rows, cols, bits, group) = (72u64, 64u64, 3u32, 32u64);
        let words = (cols * bits as u64).div_ceil(32);
        let groups = cols / group;
        let packed: Vec<u8> = (0..rows * words * 4)
            .map(|i| (i * 89 % 251) as u8)
            .collect();
        let scales: Vec<u8> = (0..rows * groups)
            .flat_map(|i| (0.5f32 + i as f32 / 64.0).to_le_bytes())
            .collect();
        let zp_words = (rows * bits as u64).div_ceil(32);
        let zp: Vec<u8> = (0..zp_words * groups * 4)
            .map(|i| (i * 53 % 247) as u8)
            .collect();
        let op = DequantPackedInt {
            rows,
            cols,
            bits,
            words,
            group,
            scale_dtype: DType::F32,
            zero_point: true,
            dst: DType::F32,
        };
        assert_eq!(op.granularity(), 32);
        let all: [&[u8]; 3] = [&packed, &scales, &zp];
        let whole = run(&op, &all, 0..rows);
        let mut parts = run(&op, &all, 0..32);
        parts.extend(run(&op, &all, 32..64));
        parts.extend(run(&op, &all, 64..rows));
        assert_eq!(whole, parts);
        // element [70, 40]: zero point of row 70 in group column 1, bits 210..213
        let column: Vec<u8> = (0..zp_words as usize)
            .flat_map(|w| zp[4 * (w * 2 + 1)..4 * (w * 2 + 1) + 4].to_vec())
            .collect();
        let z = unpack_code(&column, 70, 3) as i32;
        let q = unpack_code(&packed[70 * 4 * words as usize..], 40, 3) as i32;
        let s = 0.5f32 + (70 * 2 + 1) as f32 / 64.0;
        let at = 4 * (70 * cols as usize + 40);
        let got = f32::from_le_bytes(whole[at..at + 4].try_into().unwrap());
        assert_eq!(got, (q - z) as f32 * s);
    }
}
