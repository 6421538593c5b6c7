//! The CPU oracle for [`OutputTensor`] recipes: output rows `[first, first + count)` from the
//! source tensors' bytes, in the output's ggml type.
//!
//! A *row* is the innermost dimension (`shape.last()` elements; for Q8_0 and MXFP4 a row of
//! blocks), so any row range is independent and a chunked writer can call this per chunk.
//! Sources are whole tensors (an mmap slice each); only the rows a chunk needs are touched.

use super::encode;
use super::quant::{self, MXFP4_BLOCK_BYTES, MXFP4_BLOCK_ELEMS, MXFP4_SRC_BLOCK_BYTES};
use super::tensor::{OutputTensor, Recipe};
use super::transform;
use super::GgmlType;
use crate::error::{Error, Result};
use crate::format::dtype::DType;
use crate::ops::cast::{decode_into, to_f32, write_as};

/// Elements per row, rows, and bytes per output row of `t`.
pub fn row_geometry(t: &OutputTensor) -> (u64, u64, u64) {
    let inner = *t.shape.last().unwrap_or(&1);
    let rows = t.shape[..t.shape.len().saturating_sub(1)].iter().product();
    let (be, bb) = t.ty.block();
    (inner, rows, inner / be * bb)
}

fn src_err(t: &OutputTensor, msg: String) -> Error {
    Error::GgufTensor {
        tensor: t.name.clone(),
        msg,
    }
}

/// A piece of a source tensor: `bytes` are its bytes from offset `base` on. The pipeline reads
/// only the span a chunk of rows needs; whole tensors are windows at base 0.
#[derive(Clone, Copy)]
pub struct Window<'a> {
    pub base: u64,
    pub bytes: &'a [u8],
}

impl<'a> Window<'a> {
    /// A whole tensor's bytes.
    pub fn whole(bytes: &'a [u8]) -> Self {
        Window { base: 0, bytes }
    }

    /// Bytes `at..at + len` of the tensor, which must lie inside the window.
    fn at(&self, at: u64, len: usize) -> std::result::Result<&'a [u8], String> {
        at.checked_sub(self.base)
            .and_then(|o| usize::try_from(o).ok())
            .and_then(|o| self.bytes.get(o..o.checked_add(len)?))
            .ok_or_else(|| {
                format!(
                    "bytes {at}..{} are outside the {} bytes read from {}",
                    at + len as u64,
                    self.bytes.len(),
                    self.base
                )
            })
    }
}

/// The source tensors of one output tensor, as a chunk of its rows reads them.
struct Sources<'a, 's> {
    t: &'s OutputTensor,
    source: &'s dyn Fn(&str) -> Option<Window<'a>>,
}

impl<'a, 's> Sources<'a, 's> {
    /// Source `name`, looked up once for a chunk, or an error naming the output tensor.
    fn get(&self, name: &str) -> Result<Source<'a, 's>> {
        let t = self.t;
        let window = (self.source)(name)
            .ok_or_else(|| src_err(t, format!("source `{name}` is not available")))?;
        Ok(Source { t, window })
    }
}

/// One source's window, its reads' errors naming the output tensor.
struct Source<'a, 's> {
    t: &'s OutputTensor,
    window: Window<'a>,
}

impl<'a> Source<'a, '_> {
    /// Bytes `at..at + len` of the source tensor.
    fn at(&self, at: u64, len: usize) -> Result<&'a [u8]> {
        self.window.at(at, len).map_err(|m| src_err(self.t, m))
    }
}

/// Writes output rows `[first, first + count)` of `t` into `out` (exactly that many rows'
/// bytes). `source(name)` returns a window of a source tensor holding what those rows read
/// (a whole tensor is a window at base 0: [`Window::whole`]).
pub fn write_rows<'a>(
    t: &OutputTensor,
    source: &dyn Fn(&str) -> Option<Window<'a>>,
    first: u64,
    count: u64,
    out: &mut [u8],
) -> Result<()> {
    let (inner, rows, row_bytes) = row_geometry(t);
    if first + count > rows || out.len() as u64 != count * row_bytes {
        return Err(src_err(
            t,
            format!(
                "rows {first}..{} of {rows} into {} bytes",
                first + count,
                out.len()
            ),
        ));
    }
    let src = Sources { t, source };
    if let Recipe::Mxfp4 {
        blocks,
        scales,
        map,
    } = &t.recipe
    {
        let groups = (inner / MXFP4_BLOCK_ELEMS as u64) as usize;
        let (b, s) = (src.get(blocks)?, src.get(scales)?);
        for (k, dst) in out.chunks_exact_mut(groups * MXFP4_BLOCK_BYTES).enumerate() {
            let r = first + k as u64;
            let src_row = map.map_or(r, |m| m.source_row(r)) as usize;
            let block_row = groups * MXFP4_SRC_BLOCK_BYTES;
            let bs = b.at((src_row * block_row) as u64, block_row)?;
            let ss = s.at((src_row * groups) as u64, groups)?;
            quant::repack_mxfp4(bs, ss, dst);
        }
        return Ok(());
    }
    // Gather the source-typed elements of these rows, then convert them.
    let (dtype, esize) = match (&t.recipe, t.src_dtype) {
        (Recipe::Values(_), _) => (DType::F32, 4),
        (_, Some(d @ (DType::F32 | DType::F16 | DType::BF16))) => (d, d.size().unwrap()),
        (_, d) => {
            return Err(src_err(
                t,
                format!("source dtype {d:?} cannot become {}", t.ty.name()),
            ))
        }
    };
    let n = (count * inner) as usize;
    let row_src = (inner as usize) * esize;
    // Source elements of the rows from `first` into their output bytes.
    let convert_rows = |elems: &[u8], dtype: DType, first: u64, out: &mut [u8]| {
        let weights = RowWeights::of(t, first);
        convert(elems, dtype, t.ty, inner as usize, &weights, out);
    };
    match &t.recipe {
        // Rows stored in order: converted straight from the window, with no copy.
        Recipe::Direct { src: name } => {
            let elems = src.get(name)?.at(first * row_src as u64, n * esize)?;
            convert_rows(elems, dtype, first, out);
        }
        Recipe::Stack { srcs } => {
            // Each expert's rows are one contiguous run of its source.
            let per_expert = rows / srcs.len() as u64;
            let row_out = row_bytes as usize;
            let (mut r, end) = (first, first + count);
            while r < end {
                let run = (per_expert - r % per_expert).min(end - r);
                let name = &srcs[(r / per_expert) as usize];
                let at = (r % per_expert) * row_src as u64;
                let elems = src.get(name)?.at(at, run as usize * row_src)?;
                let o = (r - first) as usize * row_out;
                let piece = &mut out[o..o + run as usize * row_out];
                convert_rows(elems, dtype, r, piece);
                r += run;
            }
        }
        _ => GATHER.with(|g| -> Result<()> {
            // Reordered rows are gathered into a buffer each compute thread keeps: at most one
            // chunk's elements (the op's scratch, inside the memory budget).
            let mut elems = g.borrow_mut();
            elems.clear();
            elems.resize(n * esize, 0);
            gather(&src, first, esize, &mut elems)?;
            let widened;
            let (elems, dtype) = match &t.recipe {
                Recipe::Shifted { add, .. } => {
                    widened = shifted(&elems, dtype, *add);
                    (widened.as_slice(), DType::F32)
                }
                _ => (elems.as_slice(), dtype),
            };
            convert_rows(elems, dtype, first, out);
            Ok(())
        })?,
    }
    Ok(())
}

thread_local! {
    /// The gather buffer of [`write_rows`], reused from chunk to chunk.
    static GATHER: std::cell::RefCell<Vec<u8>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// The source elements of the output rows from `first` of a recipe that reorders them, into
/// `elems` (as many rows as it holds).
fn gather(src: &Sources, first: u64, esize: usize, elems: &mut [u8]) -> Result<()> {
    let t = src.t;
    let (inner, _, _) = row_geometry(t);
    let row_src = (inner as usize) * esize;
    match &t.recipe {
        Recipe::Values(v) => {
            for (o, x) in elems
                .chunks_exact_mut(4)
                .zip(&v[(first * inner) as usize..])
            {
                o.copy_from_slice(&x.to_le_bytes());
            }
        }
        Recipe::Rows {
            src: name,
            map,
            row_elems,
        } => {
            let s = src.get(name)?;
            let unit = *row_elems as usize * esize;
            let per_row = inner / row_elems;
            for (k, dst) in elems.chunks_exact_mut(unit).enumerate() {
                let j = map.source_row(first * per_row + k as u64) as usize;
                dst.copy_from_slice(s.at((j * unit) as u64, unit)?);
            }
        }
        Recipe::KvBK {
            src: name,
            nope,
            v,
            lora,
            ..
        } => {
            // Output row (h, l) holds kv_b[h * (nope + v) + n][l] for n in 0..nope.
            let s = src.get(name)?;
            for (k, dst) in elems.chunks_exact_mut(row_src).enumerate() {
                let r = first + k as u64;
                let (h, l) = (r / lora, r % lora);
                for n in 0..*nope {
                    let at = ((h * (nope + v) + n) * lora + l) * esize as u64;
                    dst[n as usize * esize..][..esize].copy_from_slice(s.at(at, esize)?);
                }
            }
        }
        Recipe::ExpertColumns {
            src: name,
            rows,
            cols,
            first_col,
            width,
        } => {
            let n_rows = (elems.len() / row_src) as u64;
            let span = transform::expert_column_span(
                first..first + n_rows,
                *rows,
                *cols,
                *first_col,
                *width,
            );
            let s = src.get(name)?;
            let read = s.at(
                span.start * esize as u64,
                ((span.end - span.start) * esize as u64) as usize,
            )?;
            for (k, dst) in elems.chunks_exact_mut(row_src).enumerate() {
                let r = first + k as u64;
                for (j, d) in dst.chunks_exact_mut(esize).enumerate() {
                    let at = transform::expert_column_source(
                        r, j as u64, *rows, *cols, *first_col, *width,
                    ) - span.start;
                    d.copy_from_slice(&read[at as usize * esize..][..esize]);
                }
            }
        }
        Recipe::Shifted { src: name, .. } => {
            let at = first * row_src as u64;
            elems.copy_from_slice(src.get(name)?.at(at, elems.len())?);
        }
        Recipe::Direct { .. } | Recipe::Stack { .. } | Recipe::Mxfp4 { .. } => {
            unreachable!("converted without a gather")
        }
        Recipe::Ternary { .. } => {
            return Err(src_err(
                t,
                "ternarised by its op, which knows the tensor's mean magnitude".into(),
            ))
        }
    }
    Ok(())
}

/// `elems` (of `dtype`) plus `add`, as f32 bytes: in f32 after widening BF16, rounded to F16
/// first for F16 sources (torch adds in the tensor's type; the reference widens only BF16).
fn shifted(elems: &[u8], dtype: DType, add: f32) -> Vec<u8> {
    let f = to_f32(dtype, elems);
    f.iter()
        .map(|&x| match dtype {
            DType::F16 => half::f16::from_f32(x + add).to_f32(),
            _ => x + add,
        })
        .flat_map(f32::to_le_bytes)
        .collect()
}

/// The importance weights of each output row, as llama-quantize picks them
/// (`imatrix + (row / nrows_per_expert) * n_per_row`): expert `e`'s slice for its rows.
struct RowWeights<'a> {
    weights: Option<&'a [f32]>,
    first: u64,
    rows_per_expert: u64,
}

impl<'a> RowWeights<'a> {
    fn of(t: &'a OutputTensor, first: u64) -> Self {
        RowWeights {
            weights: t.quant_weights.as_deref(),
            first,
            rows_per_expert: rows_per_weight_row(t),
        }
    }

    /// Weights of chunk row `k` (`inner` wide); planning checked their count.
    fn row(&self, k: usize, inner: usize) -> Option<&'a [f32]> {
        let expert = ((self.first + k as u64) / self.rows_per_expert) as usize;
        self.weights.map(|w| &w[expert * inner..][..inner])
    }
}

/// Output rows that share one row of `t`'s importance weights: an expert's rows (every row of a
/// matrix).
pub fn rows_per_weight_row(t: &OutputTensor) -> u64 {
    let n = t.shape.len();
    if n >= 2 {
        t.shape[n - 2].max(1)
    } else {
        1
    }
}

/// Whether elements of `dtype` are stored unchanged as `ty`.
pub fn same_type(dtype: DType, ty: GgmlType) -> bool {
    matches!(
        (dtype, ty),
        (DType::F32, GgmlType::F32) | (DType::F16, GgmlType::F16) | (DType::BF16, GgmlType::Bf16)
    )
}

/// Source elements (rows of `inner`) → output type, rounding once (the reference widens to f32
/// first, exactly); block types through their row encoder ([`encode::row_encoder`]).
fn convert(
    elems: &[u8],
    dtype: DType,
    ty: GgmlType,
    inner: usize,
    weights: &RowWeights,
    out: &mut [u8],
) {
    if same_type(dtype, ty) {
        out.copy_from_slice(elems);
        return;
    }
    if ty == GgmlType::Q8_0 {
        return quant::quantize_q8_0_from(elems, dtype, out);
    }
    let dst = match ty {
        GgmlType::F32 => DType::F32,
        GgmlType::F16 => DType::F16,
        GgmlType::Bf16 => DType::BF16,
        GgmlType::Mxfp4 => unreachable!("MXFP4 is only repacked"),
        _ => {
            let f = to_f32(dtype, elems);
            let encode = encode::row_encoder(ty).expect("planning refuses types without encoder");
            let (be, bb) = ty.block();
            let row_bytes = inner / be as usize * bb as usize;
            let rows = f.chunks_exact(inner).zip(out.chunks_exact_mut(row_bytes));
            for (k, (src, dst)) in rows.enumerate() {
                encode(src, dst, weights.row(k, inner));
            }
            return;
        }
    };
    // Element by element through a small f32 buffer on the stack, not one the size of the chunk.
    const PIECE: usize = 4096;
    let (es, os) = (
        dtype.size().expect("a float dtype"),
        dst.size().expect("a float dtype"),
    );
    let mut f = [0f32; PIECE];
    for (src, o) in elems.chunks(PIECE * es).zip(out.chunks_mut(PIECE * os)) {
        let f = &mut f[..src.len() / es];
        decode_into(dtype, src, f);
        write_as(dst, f.iter().copied(), o);
    }
}

#[cfg(test)]
mod shifted_tests {
    use super::*;

    /// `w + 1` for Gemma's norms: exact in f32 from BF16, rounded to F16 first from F16 (torch
    /// adds in the tensor's type): 2⁻¹¹ + 1 is a tie that F16 rounds to even, 1.0.
    #[test]
    fn norm_plus_one_is_f32_from_bf16_and_rounded_to_f16_from_f16() {
        let x = 2f32.powi(-11);
        let bf = half::bf16::from_f32(x).to_le_bytes();
        let f16 = half::f16::from_f32(x).to_le_bytes();
        let f32_of = |b: Vec<u8>| f32::from_le_bytes(b[..4].try_into().unwrap());
        assert_eq!(f32_of(shifted(&bf, DType::BF16, 1.0)), 1.0 + x);
        assert_eq!(f32_of(shifted(&f16, DType::F16, 1.0)), 1.0);
        let two = [x, -0.5].map(|v| v.to_le_bytes()).concat();
        let got = shifted(&two, DType::F32, 1.0);
        assert_eq!(got, [1.0 + x, 0.5].map(|v| v.to_le_bytes()).concat());
    }
}
