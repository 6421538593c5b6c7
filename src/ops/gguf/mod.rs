//! GGUF tensor transforms as ops: the ggml block encodings (Q8_0, the MXFP4 repack), the
//! row permutations and expert stacking llama.cpp's converter applies, and casts, each output
//! tensor computed in row chunks by [`GgufTensorOp`] on the shared pipeline. Which tensors a GGUF
//! holds and where they lie in the file is `sink::gguf`'s business; this module only makes bytes.

pub mod encode;
pub mod kquants;
pub mod legacy;
pub mod op;
pub mod produce;
#[cfg(target_arch = "x86_64")]
pub mod q8_0_avx2;
pub mod quant;
pub mod tensor;
pub mod transform;

pub use op::GgufTensorOp;

/// ggml tensor types this converter writes (`GGMLQuantizationType` in gguf-py).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[allow(non_camel_case_types)]
pub enum GgmlType {
    F32,
    F16,
    Q8_0,
    Bf16,
    Mxfp4,
    Q4_0,
    Q4_1,
    Q5_0,
    Q5_1,
    Q2_K,
    Q3_K,
    Q4_K,
    Q5_K,
    Q6_K,
    IQ2_XXS,
    IQ2_XS,
    IQ3_XXS,
    IQ1_S,
    IQ4_NL,
    IQ3_S,
    IQ2_S,
    IQ4_XS,
    IQ1_M,
    TQ1_0,
    TQ2_0,
}

/// Every type: `(type, id, name, elements per block, bytes per block)` as gguf-py's
/// `GGMLQuantizationType` and `GGML_QUANT_SIZES`.
const TYPES: [(GgmlType, u32, &str, u64, u64); 25] = [
    (GgmlType::F32, 0, "F32", 1, 4),
    (GgmlType::F16, 1, "F16", 1, 2),
    (GgmlType::Q4_0, 2, "Q4_0", 32, 18),
    (GgmlType::Q4_1, 3, "Q4_1", 32, 20),
    (GgmlType::Q5_0, 6, "Q5_0", 32, 22),
    (GgmlType::Q5_1, 7, "Q5_1", 32, 24),
    (GgmlType::Q8_0, 8, "Q8_0", 32, 34),
    (GgmlType::Q2_K, 10, "Q2_K", 256, 84),
    (GgmlType::Q3_K, 11, "Q3_K", 256, 110),
    (GgmlType::Q4_K, 12, "Q4_K", 256, 144),
    (GgmlType::Q5_K, 13, "Q5_K", 256, 176),
    (GgmlType::Q6_K, 14, "Q6_K", 256, 210),
    (GgmlType::IQ2_XXS, 16, "IQ2_XXS", 256, 66),
    (GgmlType::IQ2_XS, 17, "IQ2_XS", 256, 74),
    (GgmlType::IQ3_XXS, 18, "IQ3_XXS", 256, 98),
    (GgmlType::IQ1_S, 19, "IQ1_S", 256, 50),
    (GgmlType::IQ4_NL, 20, "IQ4_NL", 32, 18),
    (GgmlType::IQ3_S, 21, "IQ3_S", 256, 110),
    (GgmlType::IQ2_S, 22, "IQ2_S", 256, 82),
    (GgmlType::IQ4_XS, 23, "IQ4_XS", 256, 136),
    (GgmlType::IQ1_M, 29, "IQ1_M", 256, 56),
    (GgmlType::Bf16, 30, "BF16", 1, 2),
    (GgmlType::TQ1_0, 34, "TQ1_0", 256, 54),
    (GgmlType::TQ2_0, 35, "TQ2_0", 256, 66),
    (GgmlType::Mxfp4, 39, "MXFP4", 32, 17),
];

// The encoders' block sizes are the table's.
const _: () = assert!(quant::Q8_0_BLOCK_ELEMS == 32 && quant::Q8_0_BLOCK_BYTES == 34);
const _: () = assert!(quant::MXFP4_BLOCK_ELEMS == 32 && quant::MXFP4_BLOCK_BYTES == 17);

/// The row of `table` that `is` picks. The tables list every value of the enum they
/// describe, so a miss is a bug: the panic says `every {what} is listed`.
pub(crate) fn listed<R>(table: &'static [R], is: impl Fn(&R) -> bool, what: &str) -> &'static R {
    table
        .iter()
        .find(|r| is(r))
        .unwrap_or_else(|| panic!("every {what} is listed"))
}

impl GgmlType {
    fn row(self) -> &'static (GgmlType, u32, &'static str, u64, u64) {
        listed(&TYPES, |t| t.0 == self, "type")
    }

    /// The type id stored in a tensor info.
    pub fn id(self) -> u32 {
        self.row().1
    }

    /// ggml's name (`ggml_type_name`): `Q4_K`, `BF16`.
    pub fn name(self) -> &'static str {
        self.row().2
    }

    /// The type named `name` (any case), as llama-quantize's `parse_ggml_type` reads it.
    pub fn parse(name: &str) -> Option<GgmlType> {
        TYPES
            .iter()
            .find(|t| t.2.eq_ignore_ascii_case(name))
            .map(|t| t.0)
    }

    /// A block-quantised type (ggml's `ggml_is_quantized`).
    pub fn is_quantized(self) -> bool {
        !matches!(self, GgmlType::F32 | GgmlType::F16 | GgmlType::Bf16)
    }

    /// `(elements per block, bytes per block)`, as `GGML_QUANT_SIZES`.
    pub fn block(self) -> (u64, u64) {
        let r = self.row();
        (r.3, r.4)
    }

    /// Bytes of a tensor of this type with `shape` (outermost first, as PyTorch), or `None` when
    /// the innermost dimension is not a whole number of blocks or the size overflows.
    pub fn byte_len(self, shape: &[u64]) -> Option<u64> {
        let (elems, bytes) = self.block();
        let inner = shape.last().copied().unwrap_or(1);
        if inner % elems != 0 {
            return None;
        }
        let rows = shape[..shape.len().saturating_sub(1)]
            .iter()
            .try_fold(1u64, |acc, &d| acc.checked_mul(d))?;
        rows.checked_mul(inner / elems)?.checked_mul(bytes)
    }
}
