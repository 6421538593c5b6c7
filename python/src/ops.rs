//! Single-tensor ops on in-memory buffers: what a built-in pipe's `process` runs on the
//! records it is handed (upstream's unit tests, scripts that feed pipes by hand, and pipelines
//! that mix built-in pipes with Python ones). The arithmetic is the main crate's, so a record
//! converted here holds the bytes a `tftf` run writes for the same tensor.

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::{PyByteArray, PyBytes};
use tftf::ops::cast::{cast_slice, store_f32, Cast};
use tftf::ops::fp8::codec::{e4m3_table, e5m2_table};
use tftf::DType;

fn dtype(name: &str) -> PyResult<DType> {
    name.parse::<DType>()
        .map_err(|_| PyValueError::new_err(format!("unknown dtype `{name}`")))
}

fn size_of(d: DType) -> PyResult<usize> {
    d.size()
        .ok_or_else(|| PyValueError::new_err(format!("{} has no whole-byte element", d.name())))
}

/// Casts little-endian `src` elements to `dst` (BF16, F16, F32, F64), rounding to nearest even
/// as `tftf run --dtype-cast` does. Returns a new `bytearray`.
#[pyfunction]
pub fn cast<'py>(
    py: Python<'py>,
    data: &Bound<'py, PyBytes>,
    src: &str,
    dst: &str,
) -> PyResult<Bound<'py, PyByteArray>> {
    let (src, dst) = (dtype(src)?, dtype(dst)?);
    if !Cast::supports(src, dst) {
        return Err(PyValueError::new_err(format!(
            "cannot cast {} to {}",
            src.name(),
            dst.name()
        )));
    }
    let input = data.as_bytes();
    let (s, d) = (size_of(src)?, size_of(dst)?);
    if input.len() % s != 0 {
        return Err(PyValueError::new_err(format!(
            "{} bytes are not whole {} elements",
            input.len(),
            src.name()
        )));
    }
    PyByteArray::new_with(py, input.len() / s * d, |out| {
        cast_slice(src, dst, input, out);
        Ok(())
    })
}

/// Dequantises an FP8 (`F8_E4M3` or `F8_E5M2`) matrix of `rows`×`cols` with one f32 scale per
/// `block` (rows, cols) tile (`scale` row-major, `scale_cols` per row) into `dst` (BF16, F16 or
/// F32): `w * scale`, computed in f32 and rounded once, as `tftf dequant` does.
#[pyfunction]
#[allow(clippy::too_many_arguments)]
pub fn dequant_fp8<'py>(
    py: Python<'py>,
    weight: &Bound<'py, PyBytes>,
    fmt: &str,
    rows: usize,
    cols: usize,
    scale: Vec<f32>,
    scale_cols: usize,
    block: (usize, usize),
    dst: &str,
) -> PyResult<Bound<'py, PyByteArray>> {
    let table = match fmt {
        "F8_E4M3" => e4m3_table(),
        "F8_E5M2" => e5m2_table(),
        _ => {
            return Err(PyValueError::new_err(format!(
                "`{fmt}` is not an FP8 dtype"
            )))
        }
    };
    let dst = dtype(dst)?;
    if !matches!(dst, DType::BF16 | DType::F16 | DType::F32) {
        return Err(PyValueError::new_err(format!(
            "cannot dequantise to {}",
            dst.name()
        )));
    }
    let w = weight.as_bytes();
    let (br, bc) = block;
    let scale_rows = if br == 0 { 0 } else { rows.div_ceil(br) };
    if w.len() != rows * cols
        || br == 0
        || bc == 0
        || scale_cols < cols.div_ceil(bc)
        || scale.len() < scale_rows * scale_cols
    {
        return Err(PyValueError::new_err(format!(
            "an FP8 weight of {rows}x{cols} with {block:?} blocks needs {rows}x{cols} bytes and a {scale_rows}x{} scale; got {} bytes and {} scales",
            cols.div_ceil(bc.max(1)),
            w.len(),
            scale.len()
        )));
    }
    PyByteArray::new_with(py, rows * cols * size_of(dst)?, |out| {
        for (r, row) in w.chunks_exact(cols.max(1)).enumerate().take(rows) {
            let scales = &scale[(r / br) * scale_cols..];
            for (c, &b) in row.iter().enumerate() {
                store_f32(dst, out, r * cols + c, table[b as usize] * scales[c / bc]);
            }
        }
        Ok(())
    })
}
