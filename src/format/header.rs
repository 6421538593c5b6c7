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
    if !text.trim_start().starts_with('{') {
        serde_json::from_str::<Value>(text).map_err(|e| invalid(format!("not valid JSON: {e}")))?;
        return Err(invalid(
            "the JSON must be an object of tensor entries, not a list or a value".into(),
        ));
    }
    // Entries are read one at a time and turned into `TensorInfo` at once: a header of a million
    // tensors held as one JSON value tree took ~700 bytes a tensor; this keeps ~100.
    let mut de = serde_json::Deserializer::from_str(text);
    let entries = serde::Deserializer::deserialize_map(&mut de, EntriesVisitor { path })
        .and_then(|v| de.end().map(|()| v))
        .map_err(|e| invalid(format!("not valid JSON: {e}")))?;
    let (metadata, mut tensors) = entries?;
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

/// Reads the top-level object entry by entry. The first bad entry is kept while the rest of the
/// JSON is still read, so invalid JSON anywhere is reported as such, as a full parse would.
struct EntriesVisitor<'a> {
    path: &'a Path,
}

type Entries = Result<(Option<Map<String, Value>>, Vec<TensorInfo>)>;

impl<'de> serde::de::Visitor<'de> for EntriesVisitor<'_> {
    type Value = Entries;

    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("a JSON object")
    }

    fn visit_map<A: serde::de::MapAccess<'de>>(self, mut map: A) -> Result<Entries, A::Error> {
        let path = self.path;
        let mut metadata = None;
        let mut tensors = Vec::with_capacity(map.size_hint().unwrap_or(0));
        let mut first_error = None;
        while let Some(name) = map.next_key::<String>()? {
            if first_error.is_some() {
                map.next_value::<serde::de::IgnoredAny>()?;
                continue;
            }
            let entry: Value = map.next_value()?;
            if name == "__metadata__" {
                match parse_metadata(path, entry) {
                    Ok(m) => metadata = Some(m),
                    Err(e) => first_error = Some(e),
                }
                continue;
            }
            match parse_tensor(path, name, entry) {
                Ok(t) => tensors.push(t),
                Err(e) => first_error = Some(e),
            }
        }
        Ok(match first_error {
            Some(e) => Err(e),
            None => Ok((metadata, tensors)),
        })
    }
}

fn parse_metadata(path: &Path, entry: Value) -> Result<Map<String, Value>> {
    let invalid = |msg: String| Error::InvalidHeader {
        path: path.into(),
        msg,
    };
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
    Ok(meta)
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
    // The non-negative integers of array `key`.
    let u64s = |key: &str| -> Result<Vec<u64>> {
        obj.get(key)
            .and_then(Value::as_array)
            .ok_or_else(|| bad(&format!("missing or non-array `{key}`")))?
            .iter()
            .map(Value::as_u64)
            .collect::<Option<_>>()
            .ok_or_else(|| {
                bad(&format!(
                    "`{key}` holds a value that is not a non-negative integer"
                ))
            })
    };
    let shape = u64s("shape")?;
    let offsets = u64s("data_offsets")?;
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
/// Written straight into bytes (the same bytes `serde_json` makes of the equivalent object): a
/// value tree of a million entries would cost ~700 MB.
pub fn serialize_header(
    metadata: &Map<String, Value>,
    tensors: &[TensorInfo],
    align: u64,
) -> Vec<u8> {
    serialize_entries(
        metadata,
        tensors
            .iter()
            .map(|t| (t.name.as_str(), t.dtype, t.shape.as_slice(), t.begin, t.end)),
        align,
    )
}

/// [`serialize_header`] of `(name, dtype, shape, begin, end)` entries borrowed from elsewhere
/// (the plan), so no per-tensor copy is made for the header.
pub fn serialize_entries<'a>(
    metadata: &Map<String, Value>,
    entries: impl Iterator<Item = (&'a str, DType, &'a [u64], u64, u64)>,
    align: u64,
) -> Vec<u8> {
    use std::io::Write;
    let mut json = Vec::with_capacity(64 + entries.size_hint().0 * 80);
    json.push(b'{');
    if !metadata.is_empty() {
        json.extend_from_slice(b"\"__metadata__\":");
        serde_json::to_writer(&mut json, metadata).expect("JSON of strings");
    }
    for (i, (name, dtype, shape, begin, end)) in entries.enumerate() {
        if i > 0 || !metadata.is_empty() {
            json.push(b',');
        }
        serde_json::to_writer(&mut json, name).expect("a string");
        write!(json, ":{{\"dtype\":\"{}\",\"shape\":[", dtype.name()).expect("in memory");
        for (k, d) in shape.iter().enumerate() {
            write!(json, "{}{d}", if k > 0 { "," } else { "" }).expect("in memory");
        }
        write!(json, "],\"data_offsets\":[{begin},{end}]}}").expect("in memory");
    }
    json.push(b'}');
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
    fn serialized_header_is_what_serde_json_makes_of_the_object() {
        let tensors = vec![
            TensorInfo {
                name: "a \"quoted\" \\ name\u{1}é".into(),
                dtype: DType::F8_E4M3,
                shape: vec![],
                begin: 0,
                end: 1,
            },
            TensorInfo {
                name: "b".into(),
                dtype: DType::BF16,
                shape: vec![2, 3],
                begin: 1,
                end: 13,
            },
        ];
        for meta in [Map::new(), {
            let mut m = Map::new();
            m.insert("format".into(), "pt".into());
            m.insert("x\ny".into(), "\"".into());
            m
        }] {
            let mut map = Map::new();
            if !meta.is_empty() {
                map.insert("__metadata__".into(), Value::Object(meta.clone()));
            }
            for t in &tensors {
                map.insert(
                    t.name.clone(),
                    serde_json::json!({"dtype": t.dtype.name(), "shape": t.shape, "data_offsets": [t.begin, t.end]}),
                );
            }
            let want = serde_json::to_vec(&Value::Object(map)).unwrap();
            let got = serialize_header(&meta, &tensors, 1);
            assert_eq!(&got[8..], &want[..]);
        }
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
