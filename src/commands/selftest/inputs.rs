//! What a selftest case is, and the generators its inputs come from. The case tables
//! (`table`, `decoders`, `encoders`) all build on these, so they sit here, below all three:
//! `table` gathers the other two's cases, and neither of those names `table`.

use std::sync::Arc;

use crate::format::dtype::DType;
use crate::ops::Op;

pub use crate::lcg::Lcg;

impl Lcg {
    /// `n` finite f32s (little-endian bytes) over a wide spread of exponents, with exact BF16
    /// ties and subnormals among them.
    pub fn f32s(&mut self, n: usize) -> Vec<u8> {
        (0..n)
            .flat_map(|i| {
                let v = match i % 7 {
                    0 => f32::from_bits(0x3F80_8000 + ((self.next_u32() % 4) << 16)),
                    1 => f32::from_bits(self.next_u32() & 0x007F_FFFF),
                    _ => {
                        let e = (self.next_u32() % 40) as i32 - 20;
                        (self.next_u32() as f32 / u32::MAX as f32 - 0.5) * 2f32.powi(e)
                    }
                };
                v.to_le_bytes()
            })
            .collect()
    }
}

/// One op with whole inputs; the selftest runs it on the device (or in two chunks) and
/// compares with the CPU op run whole.
pub struct Case {
    pub kernel: &'static str,
    pub what: String,
    pub op: Arc<dyn Op>,
    /// Whole inputs for units `0..op.units()`.
    pub inputs: Vec<Vec<u8>>,
    pub out_dtype: DType,
}

/// Scales across a wide range (and, when allowed, a NaN and an infinity), stored as `d`.
pub fn scale_values(d: DType, n: usize, rng: &mut Lcg, nonfinite: bool) -> Vec<u8> {
    if d == DType::F8_E8M0 {
        return (0..n)
            .map(|i| match i {
                3 if nonfinite => 0xFF,
                5 => 0,
                _ => (rng.next_u32() % 60) as u8 + 97,
            })
            .collect();
    }
    let vals: Vec<u8> = (0..n)
        .flat_map(|i| {
            let v = match i % 5 {
                _ if nonfinite && i == 2 => f32::from_bits(0xFFC0_0001),
                _ if nonfinite && i == 4 => f32::INFINITY,
                0 => 2f32.powi((rng.next_u32() % 40) as i32 - 30),
                1 => 1e-5 * (1.0 + (rng.next_u32() % 1000) as f32),
                _ => (rng.next_u32() as f32 / u32::MAX as f32) * 8.0 + 1e-3,
            };
            v.to_le_bytes()
        })
        .collect();
    f32_bytes_as(d, &vals)
}

/// Little-endian f32 values stored as `dtype` (BF16, F16 or F32; F32 keeps every bit).
pub fn f32_bytes_as(dtype: DType, f32_bytes: &[u8]) -> Vec<u8> {
    let mut out = vec![0u8; f32_bytes.len() / 4 * (dtype.bits() / 8) as usize];
    crate::ops::cast::cast_slice(DType::F32, dtype, f32_bytes, &mut out);
    out
}
