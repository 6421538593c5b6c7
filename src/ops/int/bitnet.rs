//! BitNet b1.58's packed ternary weights (`quant_method: bitnet`, as
//! `microsoft/bitnet-b1.58-2B-4T` ships them and transformers' `pack_weights` writes them) →
//! BF16/F16/F32.
//!
//! Layout: `weight` `U8 [out/4, in]`, four weight rows a byte: bits `2k..2k+1` of byte `[r, c]`
//! hold the code of row `k · out/4 + r` (the four quarters of the rows are stacked, not
//! interleaved), coded `value + 1` (0, 1, 2 for -1, 0, 1); `weight_scale` one float, the
//! divisor of the ternary values (`BitLinear` computes `W·x / weight_scale`). Decoded as
//! `f32(code - 1) / scale`, as llama.cpp's converter (`dequant_bitnet`) does. Code 3 stands for
//! no ternary value (the converter would read it as 2, later releases as 0): refused, naming
//! the row and column.
//!
//! A unit is one weight row; its bytes sit in the packed row `unit mod out/4`, so a chunk reads,
//! per quarter it touches, one contiguous run of packed rows: four inputs over the same codes
//! tensor, one per quarter, empty where the chunk has no row of it.

use std::ops::Range;

use crate::format::dtype::DType;
use crate::ops::cast::store_f32;
use crate::ops::Op;

/// Weight rows per packed byte.
pub const ROWS_PER_BYTE: u64 = 4;

#[derive(Clone, Debug)]
pub struct DequantBitnet {
    /// Packed rows (a quarter of the weight's rows) and columns.
    pub packed_rows: u64,
    pub cols: u64,
    /// `weight_scale`, read at plan time (one value), checked finite and non-zero.
    pub scale: f32,
    pub dst: DType,
}

crate::plan::set_dst_field!(DequantBitnet);

impl DequantBitnet {
    /// The packed rows quarter `q` of the weight rows `units` read.
    fn packed_span(&self, q: u64, units: &Range<u64>) -> Range<u64> {
        let p = self.packed_rows;
        let (a, b) = (units.start.max(q * p), units.end.min((q + 1) * p));
        if a >= b {
            0..0
        } else {
            a - q * p..b - q * p
        }
    }
}

impl Op for DequantBitnet {
    fn name(&self) -> &'static str {
        "dequant-bitnet"
    }
    fn units(&self) -> u64 {
        ROWS_PER_BYTE * self.packed_rows
    }
    fn out_unit_bytes(&self) -> u64 {
        self.cols * (self.dst.bits() / 8)
    }
    fn in_unit_bytes(&self) -> u64 {
        self.cols
    }
    fn input_ranges(&self, units: Range<u64>) -> Vec<Range<u64>> {
        (0..ROWS_PER_BYTE)
            .map(|q| {
                let s = self.packed_span(q, &units);
                s.start * self.cols..s.end * self.cols
            })
            .collect()
    }
    fn compute(&self, units: Range<u64>, inputs: &[&[u8]], out: &mut [u8]) -> Result<(), String> {
        let cols = self.cols as usize;
        let row_out = self.out_unit_bytes() as usize;
        for (k, r) in units.clone().enumerate() {
            let q = r / self.packed_rows;
            let first = self.packed_span(q, &units).start;
            let at = (r % self.packed_rows - first) as usize * cols;
            let packed = &inputs[q as usize][at..at + cols];
            let orow = &mut out[k * row_out..(k + 1) * row_out];
            let shift = 2 * q as u32;
            for (c, &byte) in packed.iter().enumerate() {
                let code = (byte >> shift) & 3;
                if code == 3 {
                    return Err(format!(
                        "code 3 at row {r}, column {c} is not a ternary value (BitNet packs -1, 0, 1 as 0, 1, 2)"
                    ));
                }
                store_f32(self.dst, orow, c, (code as f32 - 1.0) / self.scale);
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::cast::to_f32;

    /// Packs rows of ternary values as transformers' `pack_weights` does.
    fn pack(rows: &[Vec<i8>]) -> Vec<u8> {
        let p = rows.len() / 4;
        let cols = rows[0].len();
        let mut out = vec![0u8; p * cols];
        for (r, row) in rows.iter().enumerate() {
            let (q, pr) = (r / p, r % p);
            for (c, &v) in row.iter().enumerate() {
                out[pr * cols + c] |= ((v + 1) as u8) << (2 * q);
            }
        }
        out
    }

    #[test]
    fn quarters_of_rows_share_a_byte_and_every_chunking_decodes_alike() {
        let (p, cols) = (3u64, 5usize);
        let rows: Vec<Vec<i8>> = (0..4 * p as usize)
            .map(|r| (0..cols).map(|c| ((r * 7 + c * 3) % 3) as i8 - 1).collect())
            .collect();
        let codes = pack(&rows);
        let op = DequantBitnet {
            packed_rows: p,
            cols: cols as u64,
            scale: 2.5,
            dst: DType::F32,
        };
        let want: Vec<f32> = rows.iter().flatten().map(|&v| v as f32 / 2.5).collect();
        for per in 1..=op.units() {
            let mut got = Vec::new();
            let mut u = 0;
            while u < op.units() {
                let end = (u + per).min(op.units());
                let pieces: Vec<&[u8]> = op
                    .input_ranges(u..end)
                    .into_iter()
                    .map(|r| &codes[r.start as usize..r.end as usize])
                    .collect();
                let mut out = vec![0u8; (end - u) as usize * cols * 4];
                op.compute(u..end, &pieces, &mut out).unwrap();
                got.extend(to_f32(DType::F32, &out));
                u = end;
            }
            assert_eq!(got, want, "chunks of {per} rows");
        }
    }

    #[test]
    fn code_three_is_refused_with_its_row_and_column() {
        let op = DequantBitnet {
            packed_rows: 1,
            cols: 2,
            scale: 1.0,
            dst: DType::BF16,
        };
        // Row 2 (bits 4..5) of column 1 holds 3.
        let codes = [0b0101_0101u8, 0b0111_0101];
        let pieces: Vec<&[u8]> = op
            .input_ranges(0..4)
            .into_iter()
            .map(|r| &codes[r.start as usize..r.end as usize])
            .collect();
        let mut out = vec![0u8; 16];
        let err = op.compute(0..4, &pieces, &mut out).unwrap_err();
        assert_eq!(
            err,
            "code 3 at row 2, column 1 is not a ternary value (BitNet packs -1, 0, 1 as 0, 1, 2)"
        );
    }
}
