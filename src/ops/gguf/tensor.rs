//! A GGUF output tensor and the recipe that makes its bytes from source tensors: the unit of
//! work [`super::GgufTensorOp`] computes, planned by `sink::gguf::recipe` from headers alone.

use super::transform;
use super::GgmlType;
use crate::format::dtype::DType;

/// Which source row an output row comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RowMap {
    /// Llama Q/K rotary permutation over `rows` rows in `n_head` heads.
    QkPermute { rows: u64, n_head: u64 },
    /// gpt-oss gate (`half` 0, even rows) / up (1, odd rows), per expert.
    Interleaved { rows_out_per_expert: u64, half: u64 },
    /// Packed `gate_up_proj` halves (gate first), per expert.
    Halves { rows_out_per_expert: u64, half: u64 },
    /// DeepSeek `attn_v_b` rows out of `kv_b_proj`.
    KvBV { nope: u64, v: u64 },
}

impl RowMap {
    pub fn source_row(&self, out_row: u64) -> u64 {
        match *self {
            RowMap::QkPermute { rows, n_head } => {
                transform::qk_permute_source_row(out_row, rows, n_head)
            }
            RowMap::Interleaved {
                rows_out_per_expert,
                half,
            } => transform::interleaved_source_row(out_row, rows_out_per_expert, half),
            RowMap::Halves {
                rows_out_per_expert,
                half,
            } => transform::halves_source_row(out_row, rows_out_per_expert, half),
            RowMap::KvBV { nope, v } => transform::kv_b_v_source_row(out_row, nope, v),
        }
    }
}

/// How an output tensor's bytes are made. Every recipe moves source elements, then converts
/// each element (or 32-block, for Q8_0) to the output type; when source dtype and output type
/// agree and the recipe is [`Recipe::Direct`], the bytes are a plain copy.
#[derive(Debug, Clone, PartialEq)]
pub enum Recipe {
    /// One source tensor, elements in order.
    Direct { src: String },
    /// Output row `r` (of `row_elems` elements) is source row `map.source_row(r)`.
    Rows {
        src: String,
        map: RowMap,
        row_elems: u64,
    },
    /// Sources concatenated in order (MoE experts `0..E` stacked on a new first axis).
    Stack { srcs: Vec<String> },
    /// DeepSeek `attn_k_b`: per head, the first `nope` rows of the head's `nope + v` rows of
    /// `kv_b_proj`, transposed to `[lora, nope]` ([`transform::kv_b_k_transpose_head`]).
    KvBK {
        src: String,
        n_head: u64,
        nope: u64,
        v: u64,
        lora: u64,
    },
    /// Llama 4's fused, transposed experts: the source is `[E, rows, cols]` and output row
    /// `e · width + i` is column `first_col + i` of expert `e` (`rows` elements), so the output
    /// is `[E, width, rows]` ([`transform::expert_column_source`]).
    ExpertColumns {
        src: String,
        rows: u64,
        cols: u64,
        first_col: u64,
        width: u64,
    },
    /// Safetensors MXFP4 `*_blocks` + `*_scales` → ggml MXFP4 ([`super::quant::repack_mxfp4`]);
    /// with a map, output row `r` (one output channel of one expert) is source row
    /// `map.source_row(r)` of both.
    Mxfp4 {
        blocks: String,
        scales: String,
        map: Option<RowMap>,
    },
    /// Values computed from the config (Llama-3 `rope_freqs`), written as F32.
    Values(Vec<f32>),
    /// One source tensor's elements plus `add`, computed in f32 as the reference does after
    /// widening BF16 (an F16 source's sum is rounded to F16 first, as torch adds in F16):
    /// Gemma's norm weights, stored as `w` for `x · (1 + w)`.
    Shifted { src: String, add: f32 },
    /// BitNet's `weight_quant`: the source's elements rounded to `-1, 0, 1` times the mean of
    /// their magnitudes (over the whole tensor, gathered before any row is written), in f32
    /// ([`transform::bitnet_ternarise`]).
    Ternary { src: String },
}

/// One GGUF tensor to write.
#[derive(Debug, Clone, PartialEq)]
pub struct OutputTensor {
    pub name: String,
    /// Outermost first.
    pub shape: Vec<u64>,
    pub ty: GgmlType,
    pub recipe: Recipe,
    /// Source element type (`None` for MXFP4 and computed values).
    pub src_dtype: Option<DType>,
    /// Importance weights for a block type (`--imatrix`): `cols` per expert, expert-major.
    pub quant_weights: Option<std::sync::Arc<[f32]>>,
}

impl OutputTensor {
    /// A tensor without importance weights.
    pub fn new(
        name: impl Into<String>,
        shape: Vec<u64>,
        ty: GgmlType,
        recipe: Recipe,
        src_dtype: Option<DType>,
    ) -> OutputTensor {
        OutputTensor {
            name: name.into(),
            shape,
            ty,
            recipe,
            src_dtype,
            quant_weights: None,
        }
    }

    pub fn byte_len(&self) -> u64 {
        self.ty.byte_len(&self.shape).unwrap_or(0)
    }

    /// The source tensor whose bytes this tensor is, unchanged (a copy/reflink candidate).
    pub fn copy_source(&self) -> Option<&str> {
        let same = matches!(
            (self.src_dtype, self.ty),
            (Some(DType::F32), GgmlType::F32)
                | (Some(DType::F16), GgmlType::F16)
                | (Some(DType::BF16), GgmlType::Bf16)
        );
        match &self.recipe {
            Recipe::Direct { src } if same => Some(src),
            _ => None,
        }
    }
}
