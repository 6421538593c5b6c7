//! safetensors header: read (validated) and write.
//!
//! Layout: little-endian `u64` N, N bytes of JSON (possibly padded with spaces), then the data
//! buffer. Tensors must tile the data buffer exactly — sorted by offset, no gap, no overlap —
//! and the file must end at the last tensor; this is what the Rust crate behind `safe_open`,
//! transformers and vLLM enforces, so anything looser here would produce files they reject.

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::Path;

use serde_json::{Map, Value};

use super::dtype::{element_count, DType};
use crate::error::{Error, Result};

/// The reference implementation refuses larger headers; so do we.
pub const MAX_HEADER_BYTES: u64 = 100_000_000;

#[derive(Clone, Debug, PartialEq)]
pub struct TensorInfo {
    pub name: String,
    pub dtype: DType,
    pub shape: Vec<u64>,
    /// Byte range within the data buffer.
    pub begin: u64,
    pub end: u64,
}

impl TensorInfo {
    pub fn nbytes(&self) -> u64 {
        self.end - self.begin
    }
    pub fn elements(&self) -> u64 {
        element_count(&self.shape).unwrap_or(0)
    }
}

#[derive(Clone, Debug)]
pub struct Header {
    pub metadata: Option<Map<String, Value>>,
    /// Sorted by offset.
    pub tensors: Vec<TensorInfo>,
    /// File offset of the data buffer (8 + N).
    pub data_start: u64,
    pub file_len: u64,
}

pub fn read_header(path: &Path, file: &File) -> Result<Header> {
    let file_len = file.metadata().map_err(|e| Error::io(path, e))?.len();
    if file_len < 8 {
        return Err(Error::FileTooShort {
            path: path.into(),
            len: file_len,
        });
    }
    let mut prefix = [0u8; 8];
    file.read_exact_at(&mut prefix, 0)
        .map_err(|e| Error::io(path, e))?;
    let n = u64::from_le_bytes(prefix);
    if n > MAX_HEADER_BYTES {
        return Err(Error::HeaderTooLarge {
            path: path.into(),
            len: n,
            max: MAX_HEADER_BYTES,
        });
    }
    if n > file_len - 8 {
        return Err(Error::HeaderTruncated {
            path: path.into(),
            needed: n,
            available: file_len - 8,
        });
    }
    let mut json = vec![0u8; n as usize];
    file.read_exact_at(&mut json, 8)
        .map_err(|e| Error::io(path, e))?;
    parse_header(path, &json, file_len)
}

pub fn parse_header(path: &Path, json: &[u8], file_len: u64) -> Result<Header> {
    let invalid = |msg: String| Error::InvalidHeader {
        path: path.into(),
        msg,
    };
    let text =
        std::str::from_utf8(json).map_err(|e| invalid(format!("the JSON is not UTF-8: {e}")))?;
    let value: Value =
        serde_json::from_str(text).map_err(|e| invalid(format!("not valid JSON: {e}")))?;
    let Value::Object(map) = value else {
        return Err(invalid(
            "the JSON must be an object of tensor entries, not a list or a value".into(),
        ));
    };
    let mut metadata = None;
    let mut tensors = Vec::with_capacity(map.len());
    for (name, entry) in map {
        if name == "__metadata__" {
            let Value::Object(meta) = entry else {
                return Err(invalid(
                    "`__metadata__` must be an object of string values".into(),
                ));
            };
            if let Some((k, v)) = meta.iter().find(|(_, v)| !v.is_string()) {
                return Err(invalid(format!(
                    "`__metadata__` values must be strings (`{k}` is {v})"
                )));
            }
            metadata = Some(meta);
            continue;
        }
        tensors.push(parse_tensor(path, name, entry)?);
    }
    tensors.sort_by_key(|t| (t.begin, t.end));
    let data_start = 8 + json.len() as u64;
    let mut expected = 0u64;
    for t in &tensors {
        if t.begin != expected {
            return Err(Error::TensorOffsetGap {
                path: path.into(),
                tensor: t.name.clone(),
                begin: t.begin,
                expected,
            });
        }
        expected = t.end;
    }
    let data_len = file_len - data_start;
    if data_len < expected {
        return Err(Error::DataTruncated {
            path: path.into(),
            expected,
            actual: data_len,
        });
    }
    if data_len > expected {
        return Err(Error::TrailingBytes {
            path: path.into(),
            extra: data_len - expected,
        });
    }
    Ok(Header {
        metadata,
        tensors,
        data_start,
        file_len,
    })
}

fn parse_tensor(path: &Path, name: String, entry: Value) -> Result<TensorInfo> {
    let bad = |msg: &str| Error::InvalidTensor {
        path: path.into(),
        tensor: name.clone(),
        msg: msg.to_string(),
    };
    let Value::Object(obj) = entry else {
        return Err(bad("entry is not an object"));
    };
    let dtype_str = obj
        .get("dtype")
        .and_then(Value::as_str)
        .ok_or_else(|| bad("missing or non-string `dtype`"))?;
    let dtype: DType = dtype_str.parse().map_err(|_| Error::UnknownDtype {
        path: path.into(),
        tensor: name.clone(),
        dtype: dtype_str.to_string(),
    })?;
    let shape: Vec<u64> = obj
        .get("shape")
        .and_then(Value::as_array)
        .ok_or_else(|| bad("missing or non-array `shape`"))?
        .iter()
        .map(Value::as_u64)
        .collect::<Option<_>>()
        .ok_or_else(|| bad("`shape` holds a value that is not a non-negative integer"))?;
    let offsets: Vec<u64> = obj
        .get("data_offsets")
        .and_then(Value::as_array)
        .ok_or_else(|| bad("missing or non-array `data_offsets`"))?
        .iter()
        .map(Value::as_u64)
        .collect::<Option<_>>()
        .ok_or_else(|| bad("`data_offsets` holds a value that is not a non-negative integer"))?;
    let [begin, end] = offsets[..] else {
        return Err(bad("`data_offsets` must hold exactly two numbers"));
    };
    if end < begin {
        return Err(bad(&format!(
            "data_offsets [{begin}, {end}] end before they begin"
        )));
    }
    let expected = element_count(&shape).and_then(|n| dtype.byte_len(n));
    if expected != Some(end - begin) {
        return Err(Error::TensorSizeMismatch {
            path: path.into(),
            tensor: name,
            layout: format!("shape {shape:?} of {dtype}"),
            expected: expected.map_or_else(|| "an impossible number of".into(), |e| e.to_string()),
            actual: end - begin,
        });
    }
    Ok(TensorInfo {
        name,
        dtype,
        shape,
        begin,
        end,
    })
}

/// Serialises a header for tensors already laid out back to back (`tensors` in offset order).
/// The JSON is padded with spaces so that the data buffer starts at a multiple of `align`.
pub fn serialize_header(
    metadata: &Map<String, Value>,
    tensors: &[TensorInfo],
    align: u64,
) -> Vec<u8> {
    let mut map = Map::new();
    if !metadata.is_empty() {
        map.insert("__metadata__".into(), Value::Object(metadata.clone()));
    }
    for t in tensors {
        let mut entry = Map::new();
        entry.insert("dtype".into(), Value::from(t.dtype.name()));
        entry.insert("shape".into(), Value::from(t.shape.clone()));
        entry.insert("data_offsets".into(), Value::from(vec![t.begin, t.end]));
        map.insert(t.name.clone(), Value::Object(entry));
    }
    let mut json = serde_json::to_vec(&Value::Object(map)).expect("JSON of strings and numbers");
    let total = 8 + json.len() as u64;
    let padded = total.div_ceil(align) * align;
    json.resize(json.len() + (padded - total) as usize, b' ');
    let mut out = Vec::with_capacity(padded as usize);
    out.extend_from_slice(&(json.len() as u64).to_le_bytes());
    out.extend_from_slice(&json);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(json: &str, data_len: u64) -> Result<Header> {
        parse_header(
            Path::new("m.safetensors"),
            json.as_bytes(),
            8 + json.len() as u64 + data_len,
        )
    }

    #[test]
    fn accepts_unaligned_and_padded_headers() {
        let h = parse(
            r#"{"b":{"dtype":"F16","shape":[2],"data_offsets":[4,8]},"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]}}   "#,
            8,
        )
        .unwrap();
        assert_eq!(h.tensors[0].name, "a");
        assert_eq!(h.tensors[1].name, "b");
    }

    #[test]
    fn rejects_each_layout_fault() {
        let gap = parse(
            r#"{"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]},"b":{"dtype":"U8","shape":[4],"data_offsets":[5,9]}}"#,
            9,
        );
        assert!(
            matches!(gap, Err(Error::TensorOffsetGap { ref tensor, begin: 5, expected: 4, .. }) if tensor == "b")
        );
        let size = parse(
            r#"{"a":{"dtype":"F32","shape":[4],"data_offsets":[0,4]}}"#,
            4,
        );
        assert!(matches!(size, Err(Error::TensorSizeMismatch { ref tensor, .. }) if tensor == "a"));
        let trunc = parse(
            r#"{"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]}}"#,
            3,
        );
        assert!(matches!(
            trunc,
            Err(Error::DataTruncated {
                expected: 4,
                actual: 3,
                ..
            })
        ));
        let pad = parse(
            r#"{"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]}}"#,
            6,
        );
        assert!(matches!(pad, Err(Error::TrailingBytes { extra: 2, .. })));
        let dtype = parse(
            r#"{"a":{"dtype":"Q4","shape":[4],"data_offsets":[0,4]}}"#,
            4,
        );
        assert!(matches!(dtype, Err(Error::UnknownDtype { ref dtype, .. }) if dtype == "Q4"));
        let odd_f4 = parse(
            r#"{"a":{"dtype":"F4","shape":[3],"data_offsets":[0,2]}}"#,
            2,
        );
        assert!(matches!(odd_f4, Err(Error::TensorSizeMismatch { .. })));
        let meta = parse(r#"{"__metadata__":{"x":1}}"#, 0);
        assert!(matches!(meta, Err(Error::InvalidHeader { .. })));
        let json = parse(r#"{"a":"#, 0);
        assert!(matches!(json, Err(Error::InvalidHeader { .. })));
    }

    #[test]
    fn serialized_header_is_aligned_and_parses_back() {
        let tensors = vec![
            TensorInfo {
                name: "w".into(),
                dtype: DType::BF16,
                shape: vec![2, 3],
                begin: 0,
                end: 12,
            },
            TensorInfo {
                name: "q".into(),
                dtype: DType::F4,
                shape: vec![2, 4],
                begin: 12,
                end: 16,
            },
        ];
        let mut meta = Map::new();
        meta.insert("format".into(), "pt".into());
        let bytes = serialize_header(&meta, &tensors, 8);
        assert_eq!(bytes.len() % 8, 0);
        let h = parse_header(Path::new("x"), &bytes[8..], bytes.len() as u64 + 16).unwrap();
        assert_eq!(h.tensors, tensors);
        assert_eq!(h.metadata.unwrap()["format"], "pt");
    }
}
