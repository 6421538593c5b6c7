//! Quantised models as merge inputs: each model's tensors are planned through the `dequant`
//! step that `tftf dequant` runs (one path for every scheme it decodes: FP8 block, channel
//! and tensor scales, MXFP8, NVFP4, MXFP4, compressed-tensors and ModelOpt int, GPTQ), so a
//! quantised weight reaches the merge as the bytes `tftf dequant --dtype D` would have written,
//! D being the config's `dtype` (bf16, f16, f32; f32 for float64) or dequant's default, bf16.
//! The dequantised rows are computed per chunk inside the merge op ([`crate::ops::feed`]);
//! scales, zero points and activation scales are consumed by the decode and never merged.

use std::ops::Range;

use serde_json::{Map, Value};

use crate::error::Result;
use crate::format::checkpoint::Checkpoint;
use crate::format::dtype::DType;
use crate::ops::dequant::DequantStep;
use crate::ops::fp8::{DequantFp8Step, DequantOptions, ScaleMode};
use crate::plan::{Entry, PlanNotes, PlanStep, Planning};

/// A model's tensors as the merge reads them.
pub(super) struct ModelTensors {
    /// Stored tensors as they are; quantised weights as derived entries under their float
    /// name (`X.weight`), their scales gone.
    pub entries: Vec<Entry>,
    /// What the decode found, one line per scheme.
    pub notes: Vec<String>,
    /// Whether any weight was quantised.
    pub dequantised: bool,
}

/// The dtype quantised weights are dequantised to: the config's `dtype` (what mergekit
/// computes in), else `tftf dequant`'s default.
pub(super) fn dequant_dtype(compute: Option<DType>) -> DType {
    match compute {
        Some(DType::F64) => DType::F32,
        Some(d @ (DType::BF16 | DType::F16 | DType::F32)) => d,
        _ => DType::BF16,
    }
}

/// The step `tftf dequant --dtype dtype` runs, with its defaults.
pub(super) fn dequant_step(dtype: DType) -> DequantStep {
    DequantStep {
        fp8: DequantFp8Step {
            opts: DequantOptions {
                dtype,
                block: None,
                weight_scale_mode: ScaleMode::Multiply,
                allow_unscaled: false,
                allow_nonfinite: false,
            },
        },
        keep_kv_scales: false,
    }
}

/// Plans the model whose tensors are `ckpt.tensors[range]` (its `config.json` `config`)
/// through the dequant step. Errors name the model's file and tensor.
pub(super) fn model_tensors(
    ckpt: &Checkpoint,
    range: Range<usize>,
    config: Option<&Map<String, Value>>,
    dtype: DType,
) -> Result<ModelTensors> {
    let mut entries: Vec<Entry> = range
        .map(|i| {
            let t = &ckpt.tensors[i].info;
            Entry {
                id: i,
                name: t.name.clone(),
                source: i,
                dtype: t.dtype,
                shape: t.shape.clone(),
                derive: None,
                relabel: false,
            }
        })
        .collect();
    let mut notes = PlanNotes::default();
    let dequantised = dequant_step(dtype).apply(Planning {
        ckpt,
        config,
        entries: &mut entries,
        notes: &mut notes,
    })?;
    Ok(ModelTensors {
        entries,
        notes: notes.lines,
        dequantised,
    })
}
