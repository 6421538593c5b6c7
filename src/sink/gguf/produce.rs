//! The CPU oracle for [`OutputTensor`] recipes: output rows `[first, first + count)` from the
//! source tensors' bytes, in the output's ggml type.
//!
//! A *row* is the innermost dimension (`shape.last()` elements; for Q8_0 and MXFP4 a row of
//! blocks), so any row range is independent and a chunked writer can call this per chunk.
//! Sources are whole tensors (an mmap slice each); only the rows a chunk needs are touched.

use super::quant::{self, MXFP4_BLOCK_BYTES, MXFP4_BLOCK_ELEMS, MXFP4_SRC_BLOCK_BYTES};
use super::recipe::{OutputTensor, Recipe};
use super::GgmlType;
use crate::error::{Error, Result};
use crate::format::dtype::DType;
use crate::ops::cast::{bf16_to_f32, f16_to_f32, write_as};

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

/// Writes output rows `[first, first + count)` of `t` into `out` (exactly that many rows'
/// bytes). `source(name)` returns a source tensor's whole byte range.
pub fn write_rows<'a>(
    t: &OutputTensor,
    source: &dyn Fn(&str) -> Option<&'a [u8]>,
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
    let get = |name: &str| {
        source(name).ok_or_else(|| src_err(t, format!("source `{name}` is not available")))
    };
    if let Recipe::Mxfp4 {
        blocks,
        scales,
        map,
    } = &t.recipe
    {
        let groups = (inner / MXFP4_BLOCK_ELEMS as u64) as usize;
        let (b, s) = (get(blocks)?, get(scales)?);
        for (k, dst) in out.chunks_exact_mut(groups * MXFP4_BLOCK_BYTES).enumerate() {
            let r = first + k as u64;
            let src_row = map.map_or(r, |m| m.source_row(r)) as usize;
            let bs =
                &b[src_row * groups * MXFP4_SRC_BLOCK_BYTES..][..groups * MXFP4_SRC_BLOCK_BYTES];
            let ss = &s[src_row * groups..][..groups];
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
    let mut elems = vec![0u8; n * esize];
    let row_src = (inner as usize) * esize;
    match &t.recipe {
        Recipe::Direct { src } => {
            let s = get(src)?;
            elems.copy_from_slice(&s[first as usize * row_src..][..n * esize]);
        }
        Recipe::Values(v) => {
            for (o, x) in elems
                .chunks_exact_mut(4)
                .zip(&v[(first * inner) as usize..])
            {
                o.copy_from_slice(&x.to_le_bytes());
            }
        }
        Recipe::Rows {
            src,
            map,
            row_elems,
        } => {
            let s = get(src)?;
            let unit = *row_elems as usize * esize;
            let per_row = inner / row_elems;
            for (k, dst) in elems.chunks_exact_mut(unit).enumerate() {
                let j = map.source_row(first * per_row + k as u64) as usize;
                dst.copy_from_slice(&s[j * unit..][..unit]);
            }
        }
        Recipe::Stack { srcs } => {
            let per_expert = rows / srcs.len() as u64;
            for (k, dst) in elems.chunks_exact_mut(row_src).enumerate() {
                let r = first + k as u64;
                let s = get(&srcs[(r / per_expert) as usize])?;
                dst.copy_from_slice(&s[(r % per_expert) as usize * row_src..][..row_src]);
            }
        }
        Recipe::KvBK {
            src, nope, v, lora, ..
        } => {
            // Output row (h, l) holds kv_b[h * (nope + v) + n][l] for n in 0..nope.
            let s = get(src)?;
            for (k, dst) in elems.chunks_exact_mut(row_src).enumerate() {
                let r = first + k as u64;
                let (h, l) = (r / lora, r % lora);
                for n in 0..*nope {
                    let at = (((h * (nope + v) + n) * lora + l) as usize) * esize;
                    dst[n as usize * esize..][..esize].copy_from_slice(&s[at..at + esize]);
                }
            }
        }
        Recipe::Mxfp4 { .. } => unreachable!("handled above"),
    }
    convert(&elems, dtype, t.ty, out);
    Ok(())
}

fn to_f32(bytes: &[u8], dtype: DType) -> Vec<f32> {
    match dtype {
        DType::BF16 => bytes
            .chunks_exact(2)
            .map(|c| bf16_to_f32(u16::from_le_bytes([c[0], c[1]])))
            .collect(),
        DType::F16 => bytes
            .chunks_exact(2)
            .map(|c| f16_to_f32(u16::from_le_bytes([c[0], c[1]])))
            .collect(),
        _ => bytes
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
            .collect(),
    }
}

/// Source elements → output type, rounding once (the reference widens to f32 first, exactly).
fn convert(elems: &[u8], dtype: DType, ty: GgmlType, out: &mut [u8]) {
    let same = matches!(
        (dtype, ty),
        (DType::F32, GgmlType::F32) | (DType::F16, GgmlType::F16) | (DType::BF16, GgmlType::Bf16)
    );
    if same {
        out.copy_from_slice(elems);
        return;
    }
    let f = to_f32(elems, dtype);
    match ty {
        GgmlType::F32 => write_as(DType::F32, f.into_iter(), out),
        GgmlType::F16 => write_as(DType::F16, f.into_iter(), out),
        GgmlType::Bf16 => write_as(DType::BF16, f.into_iter(), out),
        GgmlType::Q8_0 => quant::quantize_q8_0(&f, out),
        GgmlType::Mxfp4 => unreachable!("MXFP4 is only repacked"),
    }
}
