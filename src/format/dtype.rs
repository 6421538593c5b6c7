//! safetensors dtypes and their storage sizes.
//!
//! Sizes are counted in bits because the sub-byte types (`F4`, `F6_*`) store shapes in elements,
//! not bytes: a `[4096, 4096]` `F4` tensor holds 8 MiB. A tensor whose element count does not
//! fill whole bytes is rejected, as the reference crate does.

use std::fmt;
use std::str::FromStr;

#[allow(non_camel_case_types)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum DType {
    BOOL,
    U8,
    I8,
    I16,
    U16,
    I32,
    U32,
    I64,
    U64,
    F16,
    BF16,
    F32,
    F64,
    C64,
    F8_E4M3,
    F8_E5M2,
    F8_E8M0,
    F8_E4M3FNUZ,
    F8_E5M2FNUZ,
    F4,
    F6_E2M3,
    F6_E3M2,
}

const ALL: [DType; 22] = [
    DType::BOOL,
    DType::U8,
    DType::I8,
    DType::I16,
    DType::U16,
    DType::I32,
    DType::U32,
    DType::I64,
    DType::U64,
    DType::F16,
    DType::BF16,
    DType::F32,
    DType::F64,
    DType::C64,
    DType::F8_E4M3,
    DType::F8_E5M2,
    DType::F8_E8M0,
    DType::F8_E4M3FNUZ,
    DType::F8_E5M2FNUZ,
    DType::F4,
    DType::F6_E2M3,
    DType::F6_E3M2,
];

impl DType {
    pub fn name(self) -> &'static str {
        match self {
            DType::BOOL => "BOOL",
            DType::U8 => "U8",
            DType::I8 => "I8",
            DType::I16 => "I16",
            DType::U16 => "U16",
            DType::I32 => "I32",
            DType::U32 => "U32",
            DType::I64 => "I64",
            DType::U64 => "U64",
            DType::F16 => "F16",
            DType::BF16 => "BF16",
            DType::F32 => "F32",
            DType::F64 => "F64",
            DType::C64 => "C64",
            DType::F8_E4M3 => "F8_E4M3",
            DType::F8_E5M2 => "F8_E5M2",
            DType::F8_E8M0 => "F8_E8M0",
            DType::F8_E4M3FNUZ => "F8_E4M3FNUZ",
            DType::F8_E5M2FNUZ => "F8_E5M2FNUZ",
            DType::F4 => "F4",
            DType::F6_E2M3 => "F6_E2M3",
            DType::F6_E3M2 => "F6_E3M2",
        }
    }

    pub fn bits(self) -> u64 {
        match self {
            DType::F4 => 4,
            DType::F6_E2M3 | DType::F6_E3M2 => 6,
            DType::BOOL
            | DType::U8
            | DType::I8
            | DType::F8_E4M3
            | DType::F8_E5M2
            | DType::F8_E8M0
            | DType::F8_E4M3FNUZ
            | DType::F8_E5M2FNUZ => 8,
            DType::I16 | DType::U16 | DType::F16 | DType::BF16 => 16,
            DType::I32 | DType::U32 | DType::F32 => 32,
            DType::I64 | DType::U64 | DType::F64 | DType::C64 => 64,
        }
    }

    /// Bytes per element for whole-byte types; `None` for `F4` and `F6_*`.
    pub fn size(self) -> Option<usize> {
        let bits = self.bits();
        bits.is_multiple_of(8).then_some((bits / 8) as usize)
    }

    /// Plain IEEE-style floats that `--dtype` casts convert (FP8/FP4 codes need their scales).
    pub fn is_castable_float(self) -> bool {
        matches!(self, DType::F16 | DType::BF16 | DType::F32 | DType::F64)
    }

    /// Integers that `--cast-ints` converts.
    pub fn is_castable_int(self) -> bool {
        matches!(
            self,
            DType::BOOL
                | DType::U8
                | DType::I8
                | DType::I16
                | DType::U16
                | DType::I32
                | DType::U32
                | DType::I64
                | DType::U64
        )
    }

    /// Bytes needed by `elements` values, or `None` when the count overflows or does not fill
    /// whole bytes.
    pub fn byte_len(self, elements: u64) -> Option<u64> {
        let bits = elements.checked_mul(self.bits())?;
        (bits % 8 == 0).then_some(bits / 8)
    }

    /// Parses a `--dtype` argument: safetensors names and the PyTorch spellings.
    pub fn parse_cast_target(s: &str) -> Option<DType> {
        match s.to_ascii_lowercase().as_str() {
            "bf16" | "bfloat16" | "torch.bfloat16" => Some(DType::BF16),
            "f16" | "fp16" | "float16" | "half" | "torch.float16" => Some(DType::F16),
            "f32" | "fp32" | "float32" | "float" | "torch.float32" => Some(DType::F32),
            "f64" | "fp64" | "float64" | "double" | "torch.float64" => Some(DType::F64),
            _ => None,
        }
    }

    /// The `torch_dtype` spelling used in `config.json`.
    pub fn torch_name(self) -> &'static str {
        match self {
            DType::BF16 => "bfloat16",
            DType::F16 => "float16",
            DType::F32 => "float32",
            DType::F64 => "float64",
            _ => self.name(),
        }
    }
}

impl DType {
    /// Every dtype safetensors defines.
    pub fn all() -> impl Iterator<Item = DType> {
        ALL.into_iter()
    }
}

impl FromStr for DType {
    type Err = ();
    fn from_str(s: &str) -> Result<Self, ()> {
        ALL.iter().copied().find(|d| d.name() == s).ok_or(())
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

pub fn element_count(shape: &[u64]) -> Option<u64> {
    shape.iter().try_fold(1u64, |acc, &d| acc.checked_mul(d))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip() {
        for d in ALL {
            assert_eq!(d.name().parse::<DType>(), Ok(d));
        }
        assert!("F8_E4M3FN".parse::<DType>().is_err());
    }

    #[test]
    fn sub_byte_sizes() {
        assert_eq!(DType::F4.byte_len(4096 * 4096), Some(8 << 20));
        assert_eq!(DType::F4.byte_len(3), None);
        assert_eq!(DType::F6_E2M3.byte_len(4), Some(3));
        assert_eq!(DType::F8_E4M3.byte_len(10), Some(10));
        assert_eq!(DType::BF16.byte_len(u64::MAX), None);
    }

    #[test]
    fn cast_spellings() {
        assert_eq!(DType::parse_cast_target("bfloat16"), Some(DType::BF16));
        assert_eq!(DType::parse_cast_target("FP16"), Some(DType::F16));
        assert_eq!(DType::parse_cast_target("float32"), Some(DType::F32));
        assert_eq!(DType::parse_cast_target("float64"), Some(DType::F64));
        assert_eq!(DType::parse_cast_target("int8"), None);
    }
}
