//! Scalar codecs of the 8-bit float formats, as lookup tables.
//!
//! Layouts (bit 7 is the sign unless noted):
//! - E4M3 (`F8_E4M3`, "fn"): 4 exponent bits, bias 7, 3 mantissa bits. No infinity; the only
//!   NaNs are `0x7F` and `0xFF`. Subnormals are `m · 2^-9`. Max finite 448.
//! - E5M2 (`F8_E5M2`): 5 exponent bits, bias 15, 2 mantissa bits, IEEE-like: exponent 31 is
//!   infinity (mantissa 0) or NaN. Subnormals `m · 2^-16`.
//! - E8M0 (`F8_E8M0`): unsigned exponent only, `2^(e-127)`; `0x00` is 2^-127 (there is no zero)
//!   and `0xFF` is NaN.
//!
//! Decoding is exact in f32, so a 256-entry table is the whole decoder; the tables are built
//! from these formulas and tested against ml_dtypes' values in `tests/fixtures/scalars`.

use std::sync::OnceLock;

pub fn e4m3_to_f32(b: u8) -> f32 {
    let sign = if b & 0x80 != 0 { -1.0 } else { 1.0 };
    let e = ((b >> 3) & 0x0F) as i32;
    let m = (b & 0x07) as f32;
    if e == 0x0F && b & 0x07 == 0x07 {
        return f32::NAN;
    }
    sign * if e == 0 {
        m * 2f32.powi(-9)
    } else {
        (1.0 + m / 8.0) * 2f32.powi(e - 7)
    }
}

pub fn e5m2_to_f32(b: u8) -> f32 {
    let sign = if b & 0x80 != 0 { -1.0 } else { 1.0 };
    let e = ((b >> 2) & 0x1F) as i32;
    let m = (b & 0x03) as f32;
    if e == 0x1F {
        return if m == 0.0 {
            sign * f32::INFINITY
        } else {
            f32::NAN
        };
    }
    sign * if e == 0 {
        m * 2f32.powi(-16)
    } else {
        (1.0 + m / 4.0) * 2f32.powi(e - 15)
    }
}

pub fn e8m0_to_f32(b: u8) -> f32 {
    if b == 0xFF {
        return f32::NAN;
    }
    // 2^-127 is an f32 subnormal (bit 22 set); everything above is a normal power of two.
    if b == 0 {
        f32::from_bits(0x0040_0000)
    } else {
        f32::from_bits((b as u32) << 23)
    }
}

pub fn e4m3_is_nan(b: u8) -> bool {
    b & 0x7F == 0x7F
}

pub fn e5m2_is_nonfinite(b: u8) -> bool {
    b & 0x7C == 0x7C
}

fn table(f: fn(u8) -> f32) -> [f32; 256] {
    std::array::from_fn(|i| f(i as u8))
}

pub fn e4m3_table() -> &'static [f32; 256] {
    static T: OnceLock<[f32; 256]> = OnceLock::new();
    T.get_or_init(|| table(e4m3_to_f32))
}

pub fn e5m2_table() -> &'static [f32; 256] {
    static T: OnceLock<[f32; 256]> = OnceLock::new();
    T.get_or_init(|| table(e5m2_to_f32))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn check_all_codes(name: &str, f: fn(u8) -> f32) {
        let fx = crate::test_fixtures::scalars();
        let want = fx["decode"][name].as_array().unwrap();
        assert_eq!(want.len(), 256);
        for (code, w) in want.iter().enumerate() {
            let w = f32::from_bits(w.as_u64().unwrap() as u32);
            let got = f(code as u8);
            if w.is_nan() {
                assert!(got.is_nan(), "{name} {code:#04x}: want NaN, got {got}");
            } else {
                assert_eq!(
                    got.to_bits(),
                    w.to_bits(),
                    "{name} {code:#04x}: want {w}, got {got}"
                );
            }
        }
    }

    #[test]
    fn all_256_codes_match_ml_dtypes() {
        check_all_codes("F8_E4M3", e4m3_to_f32);
        check_all_codes("F8_E5M2", e5m2_to_f32);
        check_all_codes("F8_E8M0", e8m0_to_f32);
    }

    #[test]
    fn nan_codes() {
        let e4m3_nans: Vec<u8> = (0..=255u8).filter(|&b| e4m3_to_f32(b).is_nan()).collect();
        assert_eq!(e4m3_nans, vec![0x7F, 0xFF]);
        assert!((0..=255u8).all(|b| e4m3_is_nan(b) == e4m3_to_f32(b).is_nan()));
        assert!((0..=255u8).all(|b| e5m2_is_nonfinite(b) != e5m2_to_f32(b).is_finite()));
        assert_eq!(e4m3_to_f32(0x7E), 448.0);
        assert_eq!(e4m3_to_f32(0x01), 2f32.powi(-9));
        assert_eq!(e5m2_to_f32(0x7B), 57344.0);
        assert_eq!(e8m0_to_f32(0x00), 2f32.powi(-127));
        assert_eq!(e8m0_to_f32(0xFE), 2f32.powi(127));
        assert_eq!(e8m0_to_f32(127), 1.0);
    }
}
