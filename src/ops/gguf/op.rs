//! [`GgufTensorOp`]: one GGUF output tensor as an op of the shared pipeline. A unit is one
//! output row (for Q8_0 and MXFP4 a row of blocks); a chunk of rows reads only the span of each
//! source tensor that its rows come from, so a permuted, stacked or requantised tensor streams
//! through the same reader, compute workers and writer as every other op, within the memory
//! budget and on as many threads as the run has.
//!
//! Inputs, in order: for each source tensor the recipe names ([`source_names`]), the tensor
//! itself, or, for a quantised weight (FP8, NVFP4, MXFP4, packed int), the inputs of its
//! decoding op: the weight is dequantised to f32 first, exactly as `tftf dequant --dtype f32`
//! writes it (and as llama.cpp's converter does before it converts), a chunk at a time.

use std::ops::Range;
use std::sync::{Arc, Mutex};

use super::produce::{self, Window};
use super::quant::{MXFP4_BLOCK_ELEMS, MXFP4_SRC_BLOCK_BYTES};
use super::tensor::{OutputTensor, Recipe, RowMap};
use super::transform;
use super::{encode, GgmlType};
use crate::format::dtype::DType;
use crate::ops::kernel::gguf::{GgufLaunch, GgufParams};
use crate::ops::kernel::{kernel_dtype, Kernel};
use crate::ops::Op;

/// One source tensor of a recipe, and how its stored bytes become the elements it moves.
#[derive(Debug)]
pub struct Slot {
    pub name: String,
    /// Set for a quantised weight: the op that decodes it to f32 (the dequantised tensor,
    /// row-major, in its units), reading `inputs` tensors.
    pub decode: Option<Decoder>,
}

/// The dequantisation of a quantised source, as `tftf dequant` plans it with `--dtype f32`.
#[derive(Debug, Clone)]
pub struct Decoder {
    pub op: Arc<dyn Op>,
    /// How many input tensors the op reads (codes, scales, …).
    pub inputs: usize,
}

impl Slot {
    /// A source read as stored.
    pub fn plain(name: &str) -> Slot {
        Slot {
            name: name.to_string(),
            decode: None,
        }
    }

    fn inputs(&self) -> usize {
        self.decode.as_ref().map_or(1, |d| d.inputs)
    }
}

/// Source tensors a recipe reads, in the order their inputs follow each other.
pub fn source_names(t: &OutputTensor) -> Vec<&str> {
    match &t.recipe {
        Recipe::Direct { src }
        | Recipe::Rows { src, .. }
        | Recipe::KvBK { src, .. }
        | Recipe::ExpertColumns { src, .. }
        | Recipe::Shifted { src, .. }
        | Recipe::Ternary { src } => {
            vec![src.as_str()]
        }
        Recipe::Stack { srcs } => srcs.iter().map(String::as_str).collect(),
        Recipe::Mxfp4 { blocks, scales, .. } => vec![blocks.as_str(), scales.as_str()],
        Recipe::Values(_) => Vec::new(),
    }
}

/// A slot's decoded elements ([`GgufTensorOp::decode`]): the byte offset of the first decoded
/// unit and the f32 bytes; `None` for a source read as stored.
type DecodedSlot = Option<(u64, Vec<u8>)>;

#[derive(Debug)]
pub struct GgufTensorOp {
    tensor: OutputTensor,
    slots: Vec<Slot>,
    /// [`Recipe::Ternary`]'s survey: the magnitudes summed so far (f64, in element order) and
    /// the units they cover.
    ternary: Mutex<(f64, u64)>,
}

impl GgufTensorOp {
    /// `slots` follow [`source_names`]`(&tensor)`.
    pub fn new(tensor: OutputTensor, slots: Vec<Slot>) -> GgufTensorOp {
        debug_assert_eq!(
            source_names(&tensor),
            slots.iter().map(|s| s.name.as_str()).collect::<Vec<_>>()
        );
        GgufTensorOp {
            tensor,
            slots,
            ternary: Mutex::new((0.0, 0)),
        }
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
            Recipe::Direct { .. } | Recipe::Shifted { .. } | Recipe::Ternary { .. } => {
                vec![rows.start * row..rows.end * row]
            }
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
            Recipe::ExpertColumns {
                rows: r,
                cols,
                first_col,
                width,
                ..
            } => {
                let span =
                    transform::expert_column_span(rows.clone(), *r, *cols, *first_col, *width);
                vec![span.start * es..span.end * es]
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

    /// Each slot's decoded elements for the byte spans `spans` (where its source is quantised):
    /// the byte offset of the first decoded unit and the f32 bytes.
    fn decode(&self, spans: &[Range<u64>], inputs: &[&[u8]]) -> Result<Vec<DecodedSlot>, String> {
        let mut decoded = Vec::with_capacity(self.slots.len());
        let mut k = 0;
        for (span, slot) in spans.iter().zip(&self.slots) {
            decoded.push(match &slot.decode {
                Some(d) => {
                    let units = Self::decoded_units(d, span);
                    let unit = d.op.out_unit_bytes();
                    let mut f32s = vec![0u8; ((units.end - units.start) * unit) as usize];
                    d.op.compute(units.clone(), &inputs[k..k + d.inputs], &mut f32s)?;
                    Some((units.start * unit, f32s))
                }
                None => None,
            });
            k += slot.inputs();
        }
        Ok(decoded)
    }

    /// The one source's elements of rows `units` (a recipe that reads its rows in order), as
    /// f32, decoded first where it is quantised.
    fn row_elements(&self, units: &Range<u64>, inputs: &[&[u8]]) -> Result<Vec<f32>, String> {
        let spans = self.spans(units);
        let decoded = self.decode(&spans, inputs)?;
        let bytes = match &decoded[0] {
            Some((base, f32s)) => {
                let at = (spans[0].start - base) as usize;
                &f32s[at..at + (spans[0].end - spans[0].start) as usize]
            }
            None => inputs[0],
        };
        let dtype = self.tensor.src_dtype.unwrap_or(DType::F32);
        Ok(crate::ops::cast::to_f32(dtype, bytes))
    }

    /// The sum of the magnitudes of `x`, the elements of rows from `first`, in f64 in element
    /// order; a non-finite element is an error (the mean it would poison decides every
    /// element's value).
    fn magnitudes(&self, first: u64, x: &[f32]) -> Result<f64, String> {
        let inner = produce::row_geometry(&self.tensor).0.max(1) as usize;
        let mut sum = 0f64;
        for (k, v) in x.iter().enumerate() {
            if !v.is_finite() {
                let (r, c) = (first + (k / inner) as u64, k % inner);
                return Err(format!(
                    "{v} at row {r}, column {c}: BitNet's ternarisation scales by the mean magnitude of the whole tensor, which needs finite values"
                ));
            }
            sum += v.abs() as f64;
        }
        Ok(sum)
    }

    /// [`Recipe::Ternary`]: rows `units` ternarised with the tensor's mean magnitude (surveyed,
    /// or summed here when the chunk is the whole tensor), then converted as a direct f32
    /// source.
    fn ternarise(&self, units: Range<u64>, inputs: &[&[u8]], out: &mut [u8]) -> Result<(), String> {
        let total = self.units();
        let x = self.row_elements(&units, inputs)?;
        let sum = if units.start == 0 && units.end == total {
            self.magnitudes(units.start, &x)?
        } else {
            let s = *self.ternary.lock().unwrap_or_else(|e| e.into_inner());
            if s.1 != total {
                return Err(format!(
                    "rows {}..{} of a ternarised tensor computed before its survey",
                    units.start, units.end
                ));
            }
            s.0
        };
        let elems: u64 = self.tensor.shape.iter().product();
        let iscale = transform::bitnet_iscale(sum, elems);
        let y: Vec<u8> = (x.into_iter())
            .flat_map(|x| transform::bitnet_ternarise(x, iscale).to_le_bytes())
            .collect();
        let Recipe::Ternary { src } = &self.tensor.recipe else {
            unreachable!("ternarise is Ternary's")
        };
        let mut direct = self.tensor.clone();
        direct.recipe = Recipe::Direct { src: src.clone() };
        direct.src_dtype = Some(DType::F32);
        let row = produce::row_geometry(&direct).0 * 4;
        let window = Window {
            base: units.start * row,
            bytes: &y,
        };
        let lookup = |name: &str| (name == src).then_some(window);
        produce::write_rows(&direct, &lookup, units.start, units.end - units.start, out)
            .map_err(op_message)
    }

    /// Units of `d`'s op (rows, row pairs, experts …, widened to its granularity) whose f32
    /// output covers the decoded byte span `span`.
    fn decoded_units(d: &Decoder, span: &Range<u64>) -> Range<u64> {
        if span.is_empty() {
            return 0..0;
        }
        let (unit, g, n) = (
            d.op.out_unit_bytes(),
            d.op.granularity().max(1),
            d.op.units(),
        );
        let start = span.start / unit / g * g;
        let end = (span.end.div_ceil(unit).div_ceil(g) * g).min(n);
        start..end
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
            _ => "gguf-quant",
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
            .map(|(s, slot)| match &slot.decode {
                // The stored bytes the decoded units read (codes, scales).
                Some(d) => {
                    d.op.input_ranges(Self::decoded_units(d, s))
                        .iter()
                        .map(|r| r.end - r.start)
                        .sum()
                }
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
            // Any row of an expert reads (nearly) all of its source: a granule is an expert.
            Recipe::ExpertColumns { width, .. } => *width,
            _ => 1,
        }
    }

    fn scratch_unit_bytes(&self) -> u64 {
        // The source elements of reordered rows, gathered (produce's gather buffer), and the
        // f32 rows of a dequantised weight. Rows in order are converted where they were read.
        let (inner, _, _) = produce::row_geometry(&self.tensor);
        let decoded = self.slots.iter().any(|s| s.decode.is_some()) as u64;
        let gathered = match self.tensor.recipe {
            Recipe::Direct { .. } | Recipe::Stack { .. } | Recipe::Mxfp4 { .. } => 0,
            Recipe::Values(_) => 4,
            // The elements widened to f32 and their ternarised f32 bytes.
            Recipe::Ternary { .. } => 8,
            _ => self.elem_bytes(),
        };
        // Block types other than Q8_0 widen the chunk to f32 rows for their row encoder.
        let widened = !matches!(
            self.tensor.ty,
            GgmlType::F32 | GgmlType::F16 | GgmlType::Bf16 | GgmlType::Q8_0 | GgmlType::Mxfp4
        ) as u64;
        inner * (gathered + 4 * decoded + 4 * widened)
    }

    fn kernel(&self, units: &Range<u64>) -> Option<Kernel> {
        let t = &self.tensor;
        let src = t.src_dtype?;
        if self.slots.iter().any(|s| s.decode.is_some())
            || !matches!(src, DType::F32 | DType::F16 | DType::BF16)
            || !(matches!(
                t.ty,
                GgmlType::F32 | GgmlType::F16 | GgmlType::Bf16 | GgmlType::Q8_0
            ) || encode::has_kernel(t.ty))
        {
            return None;
        }
        let (inner, _, _) = produce::row_geometry(t);
        let (unit, map) = match &t.recipe {
            // Unchanged elements in order are a copy, cheaper on the CPU.
            Recipe::Direct { .. } | Recipe::Stack { .. } if produce::same_type(src, t.ty) => {
                return None
            }
            Recipe::Direct { .. } | Recipe::Stack { .. } => (0, Vec::new()),
            Recipe::Rows { map, row_elems, .. } => {
                let per_row = inner / row_elems;
                let unit_bytes = row_elems * self.elem_bytes();
                let first = self.spans(units)[0].start / unit_bytes;
                let map = (units.start * per_row..units.end * per_row)
                    .map(|k| u32::try_from(map.source_row(k) - first).ok())
                    .collect::<Option<Vec<u32>>>()?;
                (*row_elems, map)
            }
            _ => return None,
        };
        let (block, _) = t.ty.block();
        // The weight rows of the experts rows `units` belong to (llama-quantize's choice).
        let (weight_rows, first_row, weights) = match &t.quant_weights {
            Some(w) if !units.is_empty() => {
                let per = produce::rows_per_weight_row(t);
                let (first, last) = (units.start / per, (units.end - 1) / per);
                let rows = &w[(first * inner) as usize..((last + 1) * inner) as usize];
                (per, units.start - first * per, rows.to_vec())
            }
            _ => (0, 0, Vec::new()),
        };
        Some(Kernel::Gguf(GgufLaunch {
            params: GgufParams {
                src: kernel_dtype(src),
                ty: t.ty.id() as i32,
                unit,
                inner,
                weight_rows,
                first_row,
            },
            map,
            weights,
            tables: super::kquants::tables::device_tables(t.ty),
            items: (units.end - units.start) * inner / block,
            blocks: encode::has_kernel(t.ty),
        }))
    }

    fn input_ranges(&self, units: Range<u64>) -> Vec<Range<u64>> {
        let mut out = Vec::new();
        for (span, slot) in self.spans(&units).into_iter().zip(&self.slots) {
            match &slot.decode {
                Some(d) => out.extend(d.op.input_ranges(Self::decoded_units(d, &span))),
                None => out.push(span),
            }
        }
        out
    }

    fn survey_passes(&self) -> usize {
        matches!(self.tensor.recipe, Recipe::Ternary { .. }) as usize
    }

    fn survey(&self, _pass: usize, units: Range<u64>, inputs: &[&[u8]]) -> Result<(), String> {
        let sum = self.magnitudes(units.start, &self.row_elements(&units, inputs)?)?;
        let mut s = self.ternary.lock().unwrap_or_else(|e| e.into_inner());
        if units.start == 0 {
            *s = (0.0, 0);
        }
        if s.1 != units.start {
            return Err(format!(
                "surveyed rows {}..{} after rows 0..{}",
                units.start, units.end, s.1
            ));
        }
        *s = (s.0 + sum, units.end);
        Ok(())
    }

    fn compute(&self, units: Range<u64>, inputs: &[&[u8]], out: &mut [u8]) -> Result<(), String> {
        if let Recipe::Ternary { .. } = self.tensor.recipe {
            return self.ternarise(units, inputs, out);
        }
        let spans = self.spans(&units);
        let decoded = self.decode(&spans, inputs)?;
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
        produce::write_rows(
            &self.tensor,
            &lookup,
            units.start,
            units.end - units.start,
            out,
        )
        .map_err(op_message)
    }
}

/// An op's error message: the pipeline names the file and tensor itself.
fn op_message(e: crate::error::Error) -> String {
    match e {
        crate::error::Error::GgufTensor { msg, .. } => msg,
        e => e.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::format::dtype::DType;
    use crate::ops::fp8::{resolve_layout, DequantFp8, ScaleMode};

    /// Deterministic bytes: BF16/F16 values kept finite and small.
    fn bytes(n: usize, seed: u32) -> Vec<u8> {
        let mut s = seed;
        (0..n)
            .map(|k| {
                s = s.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
                let b = (s >> 24) as u8;
                if k % 2 == 1 {
                    b & 0x3B
                } else {
                    b
                }
            })
            .collect()
    }

    fn tensor(shape: &[u64], ty: GgmlType, recipe: Recipe, src: Option<DType>) -> OutputTensor {
        OutputTensor::new("t", shape.to_vec(), ty, recipe, src)
    }

    /// Runs `op` over every chunking into runs of `g` granules (as the reader cuts), each chunk
    /// fed only the input ranges it asks for, its survey passes first over the chunks in order
    /// when there are several (as the pipeline does), and checks the bytes equal `want`.
    fn check_chunkings(op: &GgufTensorOp, inputs: &[Vec<u8>], want: &[u8]) {
        let units = op.units();
        let g = op.granularity();
        let row = op.out_unit_bytes() as usize;
        let pieces = |chunk: &Range<u64>| -> Vec<&[u8]> {
            let ranges = op.input_ranges(chunk.clone());
            assert_eq!(ranges.len(), inputs.len());
            (ranges.iter().zip(inputs))
                .map(|(r, b)| &b[r.start as usize..r.end as usize])
                .collect()
        };
        for per in 1..=units.div_ceil(g) {
            let chunks: Vec<Range<u64>> = (0..units.div_ceil(per * g))
                .map(|k| k * per * g..((k + 1) * per * g).min(units))
                .collect();
            if chunks.len() > 1 {
                for pass in 0..op.survey_passes() {
                    for c in &chunks {
                        op.survey(pass, c.clone(), &pieces(c)).unwrap();
                    }
                }
            }
            let mut got = vec![0u8; want.len()];
            for c in &chunks {
                let out = &mut got[c.start as usize * row..c.end as usize * row];
                op.compute(c.clone(), &pieces(c), out).unwrap();
            }
            assert_eq!(got, want, "chunks of {per} granules of {g}");
        }
    }

    #[test]
    fn bitnet_weights_are_ternarised_by_the_whole_tensors_mean_in_any_chunks() {
        use crate::ops::int::bitnet::DequantBitnet;
        // A latent BF16 weight: 8 rows of 256, written as F32 and TQ1_0.
        let (rows, cols) = (8u64, 256u64);
        let w = bytes((rows * cols * 2) as usize, 11);
        let x = crate::ops::cast::to_f32(DType::BF16, &w);
        let sum: f64 = x.iter().map(|v| v.abs() as f64).sum();
        let iscale = transform::bitnet_iscale(sum, rows * cols);
        let tern: Vec<f32> = (x.iter())
            .map(|&v| transform::bitnet_ternarise(v, iscale))
            .collect();
        // Every value is 0 or ± the mean magnitude.
        let m = 1.0 / iscale;
        assert!(tern.iter().all(|v| v.abs() == 0.0 || v.abs() == m));
        assert!(tern.iter().any(|v| v.abs() == 0.0) && tern.iter().any(|v| v.abs() == m));
        let tern_bytes: Vec<u8> = tern.iter().flat_map(|v| v.to_le_bytes()).collect();
        for ty in [GgmlType::F32, GgmlType::TQ1_0] {
            let direct = tensor(
                &[rows, cols],
                ty,
                Recipe::Direct { src: "w".into() },
                Some(DType::F32),
            );
            let want = whole(&direct, &[("w", &tern_bytes)]);
            let t = tensor(
                &[rows, cols],
                ty,
                Recipe::Ternary { src: "w".into() },
                Some(DType::BF16),
            );
            let op = GgufTensorOp::new(t, vec![Slot::plain("w")]);
            assert_eq!(op.survey_passes(), 1);
            check_chunkings(&op, std::slice::from_ref(&w), &want);
        }
        // Packed codes decoded first (2 packed rows: 8 weight rows), to TQ1_0.
        let codes: Vec<u8> = bytes((2 * cols) as usize, 12)
            .into_iter()
            .map(|b| b & 0b1001_0110) // every 2-bit field 0, 1 or 2
            .collect();
        let bitnet = DequantBitnet {
            packed_rows: 2,
            cols,
            scale: 1.75,
            dst: DType::F32,
        };
        let ranges = bitnet.input_ranges(0..8);
        let whole_in: Vec<&[u8]> = ranges
            .iter()
            .map(|r| &codes[r.start as usize..r.end as usize])
            .collect();
        let mut f32s = vec![0u8; (rows * cols * 4) as usize];
        bitnet.compute(0..8, &whole_in, &mut f32s).unwrap();
        let x = crate::ops::cast::to_f32(DType::F32, &f32s);
        let sum: f64 = x.iter().map(|v| v.abs() as f64).sum();
        let iscale = transform::bitnet_iscale(sum, rows * cols);
        let tern_bytes: Vec<u8> = (x.iter())
            .flat_map(|&v| transform::bitnet_ternarise(v, iscale).to_le_bytes())
            .collect();
        let direct = tensor(
            &[rows, cols],
            GgmlType::TQ1_0,
            Recipe::Direct { src: "w".into() },
            Some(DType::F32),
        );
        let want = whole(&direct, &[("w", &tern_bytes)]);
        let t = tensor(
            &[rows, cols],
            GgmlType::TQ1_0,
            Recipe::Ternary { src: "w".into() },
            Some(DType::F32),
        );
        let decode = Some(Decoder {
            op: Arc::new(bitnet),
            inputs: 4,
        });
        let op = GgufTensorOp::new(
            t,
            vec![Slot {
                name: "w".into(),
                decode,
            }],
        );
        check_chunkings(&op, &vec![codes; 4], &want);
    }

    /// The oracle: every row at once from whole sources.
    fn whole(t: &OutputTensor, sources: &[(&str, &[u8])]) -> Vec<u8> {
        let (_, rows, row) = produce::row_geometry(t);
        let mut out = vec![0u8; (rows * row) as usize];
        let lookup = |n: &str| {
            sources
                .iter()
                .find(|(k, _)| *k == n)
                .map(|(_, b)| Window::whole(b))
        };
        produce::write_rows(t, &lookup, 0, rows, &mut out).unwrap();
        out
    }

    /// Llama 4 experts `[E, width, rows]` from the first `width` of each expert's `cols` columns.
    fn columns(shape: &[u64; 3], ty: GgmlType, cols: u64) -> OutputTensor {
        let recipe = Recipe::ExpertColumns {
            src: "w".into(),
            rows: shape[2],
            cols,
            first_col: 0,
            width: shape[1],
        };
        tensor(shape, ty, recipe, Some(DType::BF16))
    }

    #[test]
    fn every_recipe_gives_the_same_bytes_however_its_rows_are_cut() {
        let w = bytes(24 * 64 * 2, 1);
        let cases: Vec<(OutputTensor, Vec<&str>)> = vec![
            (
                tensor(
                    &[24, 64],
                    GgmlType::Q8_0,
                    Recipe::Direct { src: "w".into() },
                    Some(DType::BF16),
                ),
                vec!["w"],
            ),
            (
                tensor(
                    &[24, 64],
                    GgmlType::F16,
                    Recipe::Rows {
                        src: "w".into(),
                        map: RowMap::QkPermute {
                            rows: 24,
                            n_head: 3,
                        },
                        row_elems: 64,
                    },
                    Some(DType::BF16),
                ),
                vec!["w"],
            ),
            (
                tensor(
                    &[12, 64],
                    GgmlType::Q8_0,
                    Recipe::Rows {
                        src: "w".into(),
                        map: RowMap::Interleaved {
                            rows_out_per_expert: 4,
                            half: 1,
                        },
                        row_elems: 64,
                    },
                    Some(DType::BF16),
                ),
                vec!["w"],
            ),
            (
                tensor(
                    &[3, 8, 64],
                    GgmlType::Bf16,
                    Recipe::Stack {
                        srcs: vec!["a".into(), "b".into(), "c".into()],
                    },
                    Some(DType::BF16),
                ),
                vec!["a", "b", "c"],
            ),
            (
                // kv_b_proj [2 heads × (nope 4 + v 8), lora 64]: attn_k_b is [2, 64, 4].
                tensor(
                    &[2, 64, 4],
                    GgmlType::F32,
                    Recipe::KvBK {
                        src: "w".into(),
                        n_head: 2,
                        nope: 4,
                        v: 8,
                        lora: 64,
                    },
                    Some(DType::BF16),
                ),
                vec!["w"],
            ),
            // Llama 4 gate_up [2 experts, 32, 2 × 12]: its gate half transposed, [2, 12, 32].
            (columns(&[2, 12, 32], GgmlType::Q8_0, 24), vec!["w"]),
            // Llama 4 down_proj [2 experts, 12, 64] transposed, [2, 64, 12].
            (columns(&[2, 64, 12], GgmlType::F16, 64), vec!["w"]),
        ];
        for (t, names) in cases {
            let srcs: Vec<Vec<u8>> = names
                .iter()
                .enumerate()
                .map(|(k, _)| {
                    if names.len() == 1 {
                        w.clone()
                    } else {
                        bytes(8 * 64 * 2, 10 + k as u32)
                    }
                })
                .collect();
            let named: Vec<(&str, &[u8])> = names
                .iter()
                .zip(&srcs)
                .map(|(n, b)| (*n, b.as_slice()))
                .collect();
            let want = whole(&t, &named);
            let slots = names.iter().map(|n| Slot::plain(n)).collect();
            check_chunkings(&GgufTensorOp::new(t, slots), &srcs, &want);
        }
    }

    #[test]
    fn mxfp4_experts_split_from_interleaved_rows_in_any_chunks() {
        // 2 experts × 6 interleaved rows of 2 blocks: the up half is 6 rows.
        let blocks = bytes(12 * 2 * 16, 3);
        let scales = bytes(12 * 2, 4);
        let up_half = RowMap::Interleaved {
            rows_out_per_expert: 3,
            half: 1,
        };
        let recipe = Recipe::Mxfp4 {
            blocks: "b".into(),
            scales: "s".into(),
            map: Some(up_half),
        };
        let t = tensor(&[2, 3, 64], GgmlType::Mxfp4, recipe, None);
        let want = whole(&t, &[("b", &blocks), ("s", &scales)]);
        let op = GgufTensorOp::new(t, vec![Slot::plain("b"), Slot::plain("s")]);
        check_chunkings(&op, &[blocks, scales], &want);
    }

    #[test]
    fn fp8_sources_are_dequantised_per_chunk_as_the_whole_tensor_is() {
        // A 256×64 E4M3 weight in 128×128 blocks (two block rows), to Q8_0.
        let (rows, cols) = (256u64, 64u64);
        let w: Vec<u8> = bytes((rows * cols) as usize, 5)
            .into_iter()
            .map(|b| b & 0x77)
            .collect();
        let scale: Vec<u8> = [0.5f32, 0.03125]
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect();
        let (layout, _) = resolve_layout(&[rows, cols], &[2, 1], Some((128, 128))).unwrap();
        let fp8 = DequantFp8 {
            weight_dtype: DType::F8_E4M3,
            scale_dtype: Some(DType::F32),
            layout,
            mode: ScaleMode::Multiply,
            dst: DType::F32,
            allow_nonfinite: false,
        };
        let mut f32s = vec![0u8; (rows * cols * 4) as usize];
        fp8.compute(0..rows, &[&w, &scale], &mut f32s).unwrap();
        let t = tensor(
            &[rows, cols],
            GgmlType::Q8_0,
            Recipe::Direct { src: "w".into() },
            Some(DType::F32),
        );
        let want = whole(&t, &[("w", &f32s)]);
        let op = GgufTensorOp::new(
            t,
            vec![Slot {
                name: "w".into(),
                decode: Some(Decoder {
                    op: Arc::new(fp8),
                    inputs: 2,
                }),
            }],
        );
        check_chunkings(&op, &[w, scale], &want);
    }

    #[test]
    fn packed_int_sources_decode_whole_zero_point_granules_per_chunk() {
        // 80 rows of 4-bit codes with packed zero points (whole 32-row granules, the last
        // one short), permuted as a query is, to Q8_0.
        let (rows, cols) = (80u64, 64u64);
        let int = crate::ops::int::DequantPackedInt {
            rows,
            cols,
            bits: 4,
            words: 8,
            group: 32,
            scale_dtype: DType::BF16,
            zero_point: true,
            dst: DType::F32,
        };
        let codes = bytes((rows * 8 * 4) as usize, 7);
        let scales = bytes((rows * 2 * 2) as usize, 8);
        let zeros = bytes((rows.div_ceil(8) * 2 * 4) as usize, 9);
        let inputs = vec![codes, scales, zeros];
        let mut f32s = vec![0u8; (rows * cols * 4) as usize];
        let whole_in: Vec<&[u8]> = inputs.iter().map(Vec::as_slice).collect();
        int.compute(0..rows, &whole_in, &mut f32s).unwrap();
        let t = tensor(
            &[rows, cols],
            GgmlType::Q8_0,
            Recipe::Rows {
                src: "w".into(),
                map: RowMap::QkPermute { rows, n_head: 5 },
                row_elems: cols,
            },
            Some(DType::F32),
        );
        let want = whole(&t, &[("w", &f32s)]);
        let decode = Some(Decoder {
            op: Arc::new(int),
            inputs: 3,
        });
        let op = GgufTensorOp::new(
            t,
            vec![Slot {
                name: "w".into(),
                decode,
            }],
        );
        check_chunkings(&op, &inputs, &want);
    }
}
