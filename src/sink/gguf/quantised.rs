//! A quantised checkpoint as the GGUF planner sees it: every weight dequantised to f32, under
//! the name and shape `tftf dequant --dtype f32` gives it, its scales, zero points, shapes and
//! activation scales gone. The decoding is the dequant command's own planning step
//! ([`DequantStep`]), so one `tftf gguf` pass writes the bytes `tftf dequant --dtype f32` then
//! `tftf gguf` would, for every scheme it reads: FP8 (block, channel, tensor scales; MXFP8),
//! NVFP4 and MXFP4 (compressed-tensors, ModelOpt), packed int (compressed-tensors
//! pack-quantized, GPTQ, ModelOpt INT4), BitNet's packed ternary codes.
//!
//! gpt-oss's MXFP4 experts (`*_blocks`, `*_scales`) are left as stored: the GGUF keeps them
//! MXFP4 (a lossless repack) for f32/f16/bf16/q8_0 and `auto`, as the converter does.

use std::collections::HashMap;
use std::sync::Arc;

use serde_json::{Map, Value as Json};

use super::arch::{InputTensor, OutputTensor, Recipe};
use crate::error::Result;
use crate::format::checkpoint::Checkpoint;
use crate::format::dtype::DType;
use crate::ops::cast::Cast;
use crate::ops::dequant::DequantStep;
use crate::ops::fp8::{DequantFp8Step, DequantOptions, ScaleMode};
use crate::ops::gguf::op::Decoder;
use crate::plan::{Derive, Entry, PlanNotes, PlanStep, Planning};

/// How a source tensor was stored, for `--outtype auto`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stored {
    /// A float tensor, unquantised.
    Float(DType),
    /// FP8 codes with float (or E8M0) scales.
    Fp8,
    /// NVFP4 or MXFP4 codes with block scales.
    Fp4,
    /// Packed integers of this many bits (compressed-tensors, GPTQ, ModelOpt INT4).
    Int(u32),
    /// BitNet's packed ternary codes.
    Ternary,
}

/// A dequantised weight: its decoding op and the checkpoint tensors the op reads.
#[derive(Debug, Clone)]
pub struct Decoded {
    /// Indices into `Checkpoint::tensors`, in the order the op reads them.
    pub inputs: Vec<usize>,
    pub decoder: Decoder,
    pub stored: Stored,
}

/// Where a tensor of the view that is not a dequantised weight comes from.
#[derive(Debug, Clone)]
pub enum Origin {
    /// The checkpoint's tensor at this index, read as stored.
    Stored(usize),
    /// Computed by an earlier step of the run (a merge, a LoRA merge, a cast), in this dtype.
    Computed(Arc<dyn Derive>, DType),
}

/// The checkpoint's tensors as the converter sees them once dequantised.
#[derive(Debug, Default)]
pub struct DequantView {
    /// Every tensor, dequantised ones as F32, in the converter's order: shard by shard, each
    /// shard's tensors by name, the packed-int weights the converter builds anew (GPTQ,
    /// pack-quantized) after all others.
    pub tensors: Vec<InputTensor>,
    /// Dequantised weights by (new) name.
    pub decoded: HashMap<String, Decoded>,
    /// Every other tensor by name.
    pub origins: HashMap<String, Origin>,
}

impl DequantView {
    /// The view of `entries`, the tensors as the run's earlier steps leave them (the
    /// checkpoint's own when there are none): quantised weights among them are dequantised,
    /// planned from headers (and `weight_shape` tensors) alone; a quantised weight missing a
    /// scale, or laid out otherwise than `config` says, is refused here, naming its file and
    /// tensor. `by_shard`: ordered shard by shard, as the checkpoint's files hold them; else as
    /// one file would (the tensors an earlier step made have no shard yet).
    pub fn plan(
        ckpt: &Checkpoint,
        config: &Map<String, Json>,
        entries: &[Entry],
        by_shard: bool,
    ) -> Result<DequantView> {
        let (kept, mut entries): (Vec<Entry>, Vec<Entry>) =
            entries.iter().cloned().partition(|e| {
                e.derive.is_none()
                    && e.dtype == DType::U8
                    && (e.name.ends_with("_blocks") || e.name.ends_with("_scales"))
            });
        // Tensors an earlier step computes, told apart from the dequantisation's own.
        let computed: Vec<*const ()> = (entries.iter())
            .filter_map(|e| e.derive.as_ref().map(|d| Arc::as_ptr(d) as *const ()))
            .collect();
        let step = DequantStep {
            fp8: DequantFp8Step {
                opts: DequantOptions {
                    dtype: DType::F32,
                    block: None,
                    weight_scale_mode: ScaleMode::Multiply,
                    allow_unscaled: false,
                    allow_nonfinite: false,
                },
            },
            keep_kv_scales: false,
        };
        step.apply(Planning {
            ckpt,
            config: Some(config),
            entries: &mut entries,
            notes: &mut PlanNotes::default(),
        })?;
        let mut view = DequantView::default();
        // (appended last, shard, name, tensor)
        let mut order: Vec<(bool, usize, InputTensor)> = Vec::new();
        for e in entries.into_iter().chain(kept) {
            let shard = match by_shard {
                true => ckpt.tensors[e.source].shard(),
                false => 0,
            };
            let mut appended = false;
            let stored = ckpt.tensors[e.source].info.dtype;
            match &e.derive {
                Some(d) if computed.contains(&(Arc::as_ptr(d) as *const ())) => {
                    let origin = Origin::Computed(d.clone(), e.dtype);
                    view.origins.insert(e.name.clone(), origin);
                }
                Some(derive) => {
                    let inputs = derive.inputs();
                    let op = derive.build(DType::F32);
                    let stored = stored_as(ckpt, op.name(), &inputs, &e.shape);
                    appended = matches!(op.name(), "dequant-int" | "dequant-gptq");
                    let decoder = Decoder {
                        op,
                        inputs: inputs.len(),
                    };
                    let d = Decoded {
                        inputs,
                        decoder,
                        stored,
                    };
                    view.decoded.insert(e.name.clone(), d);
                }
                None if e.dtype == stored || e.relabel => {
                    view.origins
                        .insert(e.name.clone(), Origin::Stored(e.source));
                }
                None => {
                    let origin = Origin::Computed(Cast::of_entry(ckpt, &e), e.dtype);
                    view.origins.insert(e.name.clone(), origin);
                }
            }
            order.push((
                appended,
                shard,
                InputTensor {
                    name: e.name,
                    dtype: e.dtype,
                    shape: e.shape,
                },
            ));
        }
        order.sort_by(|a, b| (a.0, a.1, &a.2.name).cmp(&(b.0, b.1, &b.2.name)));
        view.tensors = order.into_iter().map(|(_, _, t)| t).collect();
        Ok(view)
    }

    /// How `name` (a tensor of the view) was stored in the checkpoint.
    pub fn stored(&self, name: &str) -> Option<Stored> {
        if let Some(d) = self.decoded.get(name) {
            return Some(d.stored);
        }
        let t = self.tensors.iter().find(|t| t.name == name)?;
        Some(Stored::Float(t.dtype))
    }

    /// Writes BitNet weights stored as packed ternary codes as they decode, where the
    /// architecture's plan re-ternarises them ([`Recipe::Ternary`]): they are ternary already,
    /// with their exact scale. llama.cpp 0c1e570's converter re-ternarises them by their mean
    /// magnitude, which multiplies each by its share of non-zero codes (later converters skip
    /// packed weights); a latent (unpacked) checkpoint's weights are still ternarised.
    pub fn keep_stored_ternary(&self, outputs: &mut [OutputTensor]) {
        for o in outputs.iter_mut() {
            if let Recipe::Ternary { src } = &o.recipe {
                if self.decoded.get(src).map(|d| d.stored) == Some(Stored::Ternary) {
                    o.recipe = Recipe::Direct { src: src.clone() };
                }
            }
        }
    }

    /// Whether any weight is dequantised.
    pub fn is_quantised(&self) -> bool {
        !self.decoded.is_empty()
    }
}

/// The storage a decoding op `op` reads from its codes (`inputs[0]`), for a weight whose
/// dequantised shape is `shape` (`[out, in]`).
fn stored_as(ckpt: &Checkpoint, op: &str, inputs: &[usize], shape: &[u64]) -> Stored {
    let codes = &ckpt.tensors[inputs[0]].info.shape;
    let cols = shape.last().copied().unwrap_or(1).max(1);
    match op {
        "dequant-fp4" => Stored::Fp4,
        "dequant-bitnet" => Stored::Ternary,
        "dequant-int4-modelopt" => Stored::Int(4),
        // `[out, words]` of 32-bit words: the one width whose rows fill exactly those words.
        "dequant-int" => {
            let words = codes.last().copied().unwrap_or(0);
            let bits = (1..=8u64).find(|b| (cols * b).div_ceil(32) == words);
            Stored::Int(bits.unwrap_or(8) as u32)
        }
        // `qweight` is `[in · bits / 32, out]`.
        "dequant-gptq" => {
            let packed_rows = codes.first().copied().unwrap_or(0);
            Stored::Int((packed_rows * 32 / cols).clamp(1, 8) as u32)
        }
        _ => Stored::Fp8,
    }
}
