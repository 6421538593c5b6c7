//! GGUF tensor transforms as ops: the ggml block encodings (Q8_0, the MXFP4 repack), the
//! row permutations and expert stacking llama.cpp's converter applies, and casts, each output
//! tensor computed in row chunks by [`GgufTensorOp`] on the shared pipeline. Which tensors a GGUF
//! holds and where they lie in the file is `sink::gguf`'s business; this module only makes bytes.

pub mod kquants;
pub mod op;
pub mod produce;
pub mod quant;
pub mod tensor;
pub mod transform;

pub use op::GgufTensorOp;

/// ggml tensor types this converter writes (`GGMLQuantizationType` in gguf-py).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum GgmlType {
    F32,
    F16,
    Q8_0,
    Bf16,
    Mxfp4,
}

impl GgmlType {
    /// The type id stored in a tensor info.
    pub fn id(self) -> u32 {
        match self {
            GgmlType::F32 => 0,
            GgmlType::F16 => 1,
            GgmlType::Q8_0 => 8,
            GgmlType::Bf16 => 30,
            GgmlType::Mxfp4 => 39,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            GgmlType::F32 => "F32",
            GgmlType::F16 => "F16",
            GgmlType::Q8_0 => "Q8_0",
            GgmlType::Bf16 => "BF16",
            GgmlType::Mxfp4 => "MXFP4",
        }
    }

    /// `(elements per block, bytes per block)`, as `GGML_QUANT_SIZES`.
    pub fn block(self) -> (u64, u64) {
        match self {
            GgmlType::F32 => (1, 4),
            GgmlType::F16 | GgmlType::Bf16 => (1, 2),
            GgmlType::Q8_0 => (
                quant::Q8_0_BLOCK_ELEMS as u64,
                quant::Q8_0_BLOCK_BYTES as u64,
            ),
            GgmlType::Mxfp4 => (
                quant::MXFP4_BLOCK_ELEMS as u64,
                quant::MXFP4_BLOCK_BYTES as u64,
            ),
        }
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
