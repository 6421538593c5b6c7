//! GGUF output: the container (v3, little-endian), the architecture table that maps a Hugging
//! Face checkpoint onto llama.cpp's names and hyperparameters, the tensor transforms, the ggml
//! quantisations, and the tokenizer metadata.
//!
//! The ground truth is llama.cpp's `convert_hf_to_gguf.py` and `gguf-py`: a file written from
//! this module must load in mainline llama.cpp and read back in gguf-py unchanged. Nothing
//! here reads tensor data from disk; a conversion goes:
//!
//! 1. [`arch::Config::load`] (`config.json` → architecture entry, transformers' defaults);
//!    [`quantised::DequantView`] (quantised weights seen dequantised to f32, as `tftf
//!    dequant` plans them); [`auto_type`] for `--outtype auto`.
//! 2. [`arch::model_kvs`] + [`tokenizer::vocab_kvs`] → one [`kv::Metadata`].
//! 3. [`arch::plan_tensors`] (headers only) → [`recipe::OutputTensor`]s: GGUF name, shape, ggml
//!    type, and the recipe; [`recipe::OutputTensor::copy_source`] marks byte-identical copies.
//! 4. [`layout::plan`] with a [`layout::TensorSpec`] per output (source offset set for copies)
//!    → per file: header bytes, tensor order, absolute offsets, congruence with the source.
//! 5. Per tensor and row chunk: [`produce::write_rows`] (the CPU oracle), or a copy/reflink of
//!    the source range for copies; zero padding to the alignment after each tensor.

pub mod arch;
mod arch_gemma;
mod arch_glm;
mod arch_phi;
pub mod auto_type;
mod check;
pub mod imatrix;
pub mod kv;
pub mod layout;
mod model_dir;
mod pre_hashes;
pub mod quant_mix;
mod quant_plan;
pub mod quantised;
pub mod recipe;
pub mod sentencepiece;
pub mod sink;
pub mod size_label;
pub mod tokenizer;
pub mod vocab;

pub use crate::ops::gguf::{produce, quant, transform, GgmlType};
pub use sink::{GgufOptions as GgufSinkOptions, GgufSink};

/// `general.file_type` values (`LlamaFileType` in gguf-py) for the output types we offer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FileType {
    AllF32,
    MostlyF16,
    MostlyQ8_0,
    MostlyBf16,
    /// A llama-quantize mix (`q4_k_m` …): planned as the converter's F32 file, then each
    /// tensor typed by [`quant_mix::choose_types`].
    Quant(quant_mix::Mix),
    /// `auto` on a quantised checkpoint: each weight typed by how it was stored
    /// ([`auto_type`]); the type of its first quantised weight names the file.
    Unchanged(GgmlType),
}

impl FileType {
    pub fn id(self) -> u32 {
        match self {
            FileType::AllF32 => 0,
            FileType::MostlyF16 => 1,
            FileType::MostlyQ8_0 => 7,
            FileType::MostlyBf16 => 32,
            FileType::Quant(mix) => mix.ftype(),
            FileType::Unchanged(GgmlType::Bf16) => 32,
            FileType::Unchanged(GgmlType::Q8_0) => 7,
            FileType::Unchanged(GgmlType::Q4_1) => 3,
            FileType::Unchanged(GgmlType::F16) => 1,
            FileType::Unchanged(GgmlType::TQ1_0) => 36,
            FileType::Unchanged(_) => 0,
        }
    }

    /// The ggml type a quantisable 2-D+ tensor gets under this file type.
    pub fn tensor_type(self) -> GgmlType {
        match self {
            FileType::AllF32 => GgmlType::F32,
            FileType::MostlyF16 => GgmlType::F16,
            FileType::MostlyQ8_0 => GgmlType::Q8_0,
            FileType::MostlyBf16 => GgmlType::Bf16,
            FileType::Quant(_) => GgmlType::F32,
            FileType::Unchanged(ty) => ty,
        }
    }

    /// `--outtype` spelling: `f32`, `f16`, `bf16`, `q8_0` (the converter's), or a
    /// llama-quantize mix name (any case); `auto` is resolved by
    /// [`arch::resolve_auto_file_type`].
    pub fn parse(s: &str) -> Option<FileType> {
        match s.to_ascii_lowercase().as_str() {
            "f32" => Some(FileType::AllF32),
            "f16" => Some(FileType::MostlyF16),
            "bf16" => Some(FileType::MostlyBf16),
            "q8_0" => Some(FileType::MostlyQ8_0),
            other => quant_mix::Mix::parse(other).map(FileType::Quant),
        }
    }
}
