//! The safetensors format: dtypes, headers, multi-shard checkpoints.

pub mod checkpoint;
pub mod dtype;
pub mod header;
pub mod quant;
pub mod side_files;
pub mod source;
pub mod tiling;
pub mod torch;

use std::io::Write;
use std::path::Path;

use serde_json::{Map, Value};

use crate::error::{Error, Result};
use dtype::DType;
use header::{serialize_header, TensorInfo};

/// Writes a small safetensors file from in-memory tensors (demo and tests; conversions stream
/// through the pipeline instead).
pub fn write_small(path: &Path, tensors: &[(String, DType, Vec<u64>, Vec<u8>)]) -> Result<()> {
    let mut infos = Vec::with_capacity(tensors.len());
    let mut begin = 0u64;
    for (name, dtype, shape, data) in tensors {
        infos.push(TensorInfo {
            name: name.clone(),
            dtype: *dtype,
            shape: shape.clone(),
            begin,
            end: begin + data.len() as u64,
        });
        begin += data.len() as u64;
    }
    let mut meta = Map::new();
    meta.insert("format".into(), Value::from("pt"));
    let header = serialize_header(&meta, &infos, 8);
    let mut f =
        std::io::BufWriter::new(std::fs::File::create(path).map_err(|e| Error::io(path, e))?);
    f.write_all(&header).map_err(|e| Error::io(path, e))?;
    for (_, _, _, data) in tensors {
        f.write_all(data).map_err(|e| Error::io(path, e))?;
    }
    f.flush().map_err(|e| Error::io(path, e))
}
