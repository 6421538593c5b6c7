//! [`GgufTensorOp`]: one GGUF output tensor as an op of the shared pipeline. A unit is one
//! output row (for Q8_0 and MXFP4 a row of blocks); a chunk of rows reads only the span of each
//! source tensor that its rows come from, so a permuted, stacked or requantised tensor streams
//! through the same reader, compute workers and writer as every other op, within the memory
//! budget and on as many threads as the run has.
//!
//! Inputs, in order: for each source tensor the recipe names ([`source_names`]), the tensor
//! itself, followed by its scale when it is an FP8 weight (dequantised to f32 rows first, as
//! llama.cpp's converter does before it converts).

use std::ops::Range;

use super::produce::{self, Window};
use super::quant::{MXFP4_BLOCK_ELEMS, MXFP4_SRC_BLOCK_BYTES};
use super::tensor::{OutputTensor, Recipe, RowMap};
use super::GgmlType;
use crate::ops::fp8::DequantFp8;
use crate::ops::Op;

/// One source tensor of a recipe, and how its stored bytes become the elements it moves.
#[derive(Debug)]
pub struct Slot {
    pub name: String,
    /// Set for an FP8 weight: decoded to f32 rows with its scale (the next input).
    pub fp8: Option<DequantFp8>,
    /// Elements per row of the source as stored (its innermost dimension).
    pub cols: u64,
}

impl Slot {
    fn inputs(&self) -> usize {
        1 + self.fp8.is_some() as usize
    }
}

/// Source tensors a recipe reads, in the order their inputs follow each other.
pub fn source_names(t: &OutputTensor) -> Vec<&str> {
    match &t.recipe {
        Recipe::Direct { src } | Recipe::Rows { src, .. } | Recipe::KvBK { src, .. } => {
            vec![src.as_str()]
        }
        Recipe::Stack { srcs } => srcs.iter().map(String::as_str).collect(),
        Recipe::Mxfp4 { blocks, scales, .. } => vec![blocks.as_str(), scales.as_str()],
        Recipe::Values(_) => Vec::new(),
    }
}

#[derive(Debug)]
pub struct GgufTensorOp {
    tensor: OutputTensor,
    slots: Vec<Slot>,
}

impl GgufTensorOp {
    /// `slots` follow [`source_names`]`(&tensor)`.
    pub fn new(tensor: OutputTensor, slots: Vec<Slot>) -> GgufTensorOp {
        debug_assert_eq!(
            source_names(&tensor),
            slots.iter().map(|s| s.name.as_str()).collect::<Vec<_>>()
        );
        GgufTensorOp { tensor, slots }
    }

    pub fn tensor(&self) -> &OutputTensor {
        &self.tensor
    }

    /// Bytes per source element as the recipe moves it (f32 for a dequantised FP8 weight).
    fn elem_bytes(&self) -> u64 {
        self.tensor.src_dtype.and_then(|d| d.size()).unwrap_or(1) as u64
    }

    /// The byte span of each source (of its elements as the recipe moves them) that output
    /// rows `rows` read; empty where a source is not read.
    // One span per source: a recipe of one source gives a `Vec` of one range, on purpose.
    #[allow(clippy::single_range_in_vec_init)]
    fn spans(&self, rows: &Range<u64>) -> Vec<Range<u64>> {
        if rows.is_empty() {
            return vec![0..0; self.slots.len()];
        }
        let t = &self.tensor;
        let (inner, total, _) = produce::row_geometry(t);
        let es = self.elem_bytes();
        let row = inner * es;
        let mapped = |map: &dyn Fn(u64) -> u64, units: Range<u64>, unit: u64| {
            let (lo, hi) = units
                .map(map)
                .fold((u64::MAX, 0), |(lo, hi), j| (lo.min(j), hi.max(j + 1)));
            lo * unit..hi * unit
        };
        match &t.recipe {
            Recipe::Direct { .. } => vec![rows.start * row..rows.end * row],
            Recipe::Rows { map, row_elems, .. } => {
                let per_row = inner / row_elems;
                let units = rows.start * per_row..rows.end * per_row;
                vec![mapped(&|k| map.source_row(k), units, row_elems * es)]
            }
            Recipe::Stack { srcs } => {
                let per_expert = total / srcs.len() as u64;
                (0..srcs.len() as u64)
                    .map(|e| {
                        let (first, end) = (e * per_expert, (e + 1) * per_expert);
                        let (a, b) = (rows.start.max(first), rows.end.min(end));
                        if a >= b {
                            0..0
                        } else {
                            (a - first) * row..(b - first) * row
                        }
                    })
                    .collect()
            }
            Recipe::KvBK { nope, v, lora, .. } => {
                let (h0, h1) = (rows.start / lora, (rows.end - 1) / lora);
                let head = nope + v;
                vec![h0 * head * lora * es..(h1 * head + nope) * lora * es]
            }
            Recipe::Mxfp4 { map, .. } => {
                let groups = inner / MXFP4_BLOCK_ELEMS as u64;
                let src_row = |r: u64| map.map_or(r, |m| m.source_row(r));
                vec![
                    mapped(
                        &src_row,
                        rows.clone(),
                        groups * MXFP4_SRC_BLOCK_BYTES as u64,
                    ),
                    mapped(&src_row, rows.clone(), groups),
                ]
            }
            Recipe::Values(_) => Vec::new(),
        }
    }

    /// Source rows (of `slot`, dequantised to f32) that decoded byte span `span` covers.
    fn fp8_rows(slot: &Slot, span: &Range<u64>) -> Range<u64> {
        let row = slot.cols * 4;
        if span.is_empty() {
            return 0..0;
        }
        span.start / row..span.end.div_ceil(row)
    }
}

impl Op for GgufTensorOp {
    fn name(&self) -> &'static str {
        match self.tensor.ty {
            GgmlType::F32 => "gguf-f32",
            GgmlType::F16 => "gguf-f16",
            GgmlType::Bf16 => "gguf-bf16",
            GgmlType::Q8_0 => "gguf-q8_0",
            GgmlType::Mxfp4 => "gguf-mxfp4",
        }
    }

    fn units(&self) -> u64 {
        produce::row_geometry(&self.tensor).1
    }

    fn out_unit_bytes(&self) -> u64 {
        produce::row_geometry(&self.tensor).2
    }

    fn in_unit_bytes(&self) -> u64 {
        // The widest span one granule of rows reads, per row, as stored: a bound for chunk
        // sizing (interleaved halves read twice their rows, a DeepSeek head its whole rows).
        let g = self.granularity();
        let probe = 0..g.min(self.units()).max(1);
        let decoded: u64 = self
            .spans(&probe)
            .iter()
            .zip(&self.slots)
            .map(|(s, slot)| match &slot.fp8 {
                // One byte per element stored, plus at most a scale row.
                Some(_) => (s.end - s.start) / 4 + slot.cols * 4,
                None => s.end - s.start,
            })
            .sum();
        decoded.div_ceil(probe.end - probe.start).max(1)
    }

    fn granularity(&self) -> u64 {
        let (inner, _, _) = produce::row_geometry(&self.tensor);
        match &self.tensor.recipe {
            Recipe::Rows { map, row_elems, .. } => {
                let per_row = (inner / row_elems).max(1);
                match *map {
                    RowMap::QkPermute { rows, n_head } => (rows / n_head.max(1) / per_row).max(1),
                    _ => 1,
                }
            }
            Recipe::KvBK { lora, .. } => *lora,
            _ => 1,
        }
    }

    fn scratch_unit_bytes(&self) -> u64 {
        // The gathered source elements and their f32 values (produce's convert), and the f32
        // rows of a dequantised FP8 weight.
        let (inner, _, _) = produce::row_geometry(&self.tensor);
        let fp8 = self.slots.iter().any(|s| s.fp8.is_some()) as u64;
        inner * (self.elem_bytes() + 4 + 4 * fp8)
    }

    fn input_ranges(&self, units: Range<u64>) -> Vec<Range<u64>> {
        let mut out = Vec::new();
        for (span, slot) in self.spans(&units).into_iter().zip(&self.slots) {
            match &slot.fp8 {
                Some(op) => out.extend(op.input_ranges(Self::fp8_rows(slot, &span))),
                None => out.push(span),
            }
        }
        out
    }

    fn compute(&self, units: Range<u64>, inputs: &[&[u8]], out: &mut [u8]) -> Result<(), String> {
        let spans = self.spans(&units);
        let mut decoded: Vec<Option<(u64, Vec<u8>)>> = Vec::with_capacity(self.slots.len());
        let mut k = 0;
        for (span, slot) in spans.iter().zip(&self.slots) {
            decoded.push(match &slot.fp8 {
                Some(op) => {
                    let rows = Self::fp8_rows(slot, span);
                    let mut f32s = vec![0u8; ((rows.end - rows.start) * slot.cols * 4) as usize];
                    op.compute(rows.clone(), &inputs[k..k + 2], &mut f32s)?;
                    Some((rows.start * slot.cols * 4, f32s))
                }
                None => None,
            });
            k += slot.inputs();
        }
        let mut windows: Vec<(&str, Window)> = Vec::with_capacity(self.slots.len());
        let mut k = 0;
        for ((span, slot), dec) in spans.iter().zip(&self.slots).zip(&decoded) {
            let w = match dec {
                Some((base, bytes)) => Window { base: *base, bytes },
                None => Window {
                    base: span.start,
                    bytes: inputs[k],
                },
            };
            windows.push((slot.name.as_str(), w));
            k += slot.inputs();
        }
        let lookup = |name: &str| windows.iter().find(|(n, _)| *n == name).map(|(_, w)| *w);
        produce::write_rows_from(
            &self.tensor,
            &lookup,
            units.start,
            units.end - units.start,
            out,
        )
        .map_err(|e| match e {
            crate::error::Error::GgufTensor { msg, .. } => msg,
            e => e.to_string(),
        })
    }
}
