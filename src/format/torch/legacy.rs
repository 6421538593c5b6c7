//! The pre-1.6 torch.save stream (`_use_new_zipfile_serialization=False`).
//!
//! Layout, all back to back: a pickled magic number `0x1950a86a20f9469cfc6c`, the pickled
//! protocol version `1001`, a pickled sys-info dict (`little_endian`, type sizes), the main
//! pickle (storages as persistent ids `('storage', FloatStorage, key, 'cpu', numel, None)`),
//! a pickled list of storage keys, then for each key in that order an 8-byte little-endian
//! element count followed by the storage's raw bytes. Storage sizes depend on their dtype, so
//! the storages are located by walking the headers, reading 8 bytes each.

use std::collections::HashMap;
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::Path;

use super::archive::MemberRange;
use super::pickle::{self, MAX_PICKLE_BYTES};
use super::state_dict::{flatten, pickle_error};
use super::value::{PickleError, Value};
use crate::error::{Error, Result};
use crate::format::dtype::DType;

pub const LEGACY_MAGIC: i128 = 0x1950a86a20f9469cfc6c;
pub const LEGACY_PROTOCOL: u64 = 1001;
/// The pickles are read from a prefix of the file this long, doubled up to
/// [`MAX_PICKLE_BYTES`] while they turn out longer.
const FIRST_READ_BYTES: u64 = 1 << 20;

/// The main pickle's value and each storage key's bytes.
pub fn read_legacy(
    path: &Path,
    file: &File,
    file_len: u64,
) -> Result<(Value, HashMap<String, MemberRange>)> {
    let bad = |msg: String| Error::TorchArchive {
        path: path.into(),
        msg: format!("legacy torch.save file: {msg}"),
    };
    let mut want = FIRST_READ_BYTES.min(file_len);
    let (values, used) = loop {
        let mut head = vec![0u8; want as usize];
        file.read_exact_at(&mut head, 0)
            .map_err(|e| Error::io(path, e))?;
        match read_pickles(&head) {
            Ok(r) => break r,
            Err(PickleError::Invalid(msg))
                if msg.starts_with("truncated") && want < file_len.min(MAX_PICKLE_BYTES) =>
            {
                want = (want * 2).min(file_len).min(MAX_PICKLE_BYTES);
            }
            Err(e) => return Err(pickle_error(path, e)),
        }
    };
    let [magic, protocol, sys_info, main, keys] = values;
    if !matches!(magic, Value::Int(LEGACY_MAGIC)) {
        return Err(bad("wrong magic number".into()));
    }
    if protocol.as_u64() != Some(LEGACY_PROTOCOL) {
        return Err(bad(format!("protocol version is not {LEGACY_PROTOCOL}")));
    }
    let little = match &sys_info {
        Value::Dict(d) => d
            .borrow()
            .iter()
            .find(|(k, _)| k.as_str() == Some("little_endian"))
            .map(|(_, v)| matches!(v, Value::Bool(true))),
        _ => None,
    };
    if little != Some(true) {
        return Err(bad("not written little-endian".into()));
    }
    let Some(keys) = keys.items() else {
        return Err(bad("storage key list is not a list".into()));
    };
    // Each storage's dtype comes from the tensors using it.
    let mut dtypes: HashMap<String, DType> = HashMap::new();
    let mut notes = Vec::new();
    for (_, view) in flatten(path, &main, &mut notes)? {
        // A storage counts torch elements: one byte each for packed FP4 (float4_e2m1fn_x2).
        let dtype = match view.storage.dtype.unwrap_or(view.dtype) {
            DType::F4 => DType::U8,
            d => d,
        };
        dtypes.insert(view.storage.key.clone(), dtype);
    }
    let mut storages = HashMap::with_capacity(keys.len());
    let mut pos = used as u64;
    for key in keys {
        let Some(key) = key.as_str() else {
            return Err(bad("storage key is not a string".into()));
        };
        let Some(dtype) = dtypes.get(key) else {
            return Err(bad(format!(
                "storage `{key}` is used by no tensor, so its size is unknown"
            )));
        };
        let mut count = [0u8; 8];
        if pos.checked_add(8).is_none_or(|e| e > file_len) {
            return Err(bad(format!(
                "storage `{key}` starts at byte {pos}, past the end of the {file_len}-byte file \
                 (file truncated?)"
            )));
        }
        file.read_exact_at(&mut count, pos)
            .map_err(|e| Error::io(path, e))?;
        let len = dtype
            .byte_len(u64::from_le_bytes(count))
            .filter(|&n| n <= file_len - pos - 8)
            .ok_or_else(|| {
                bad(format!(
                    "storage `{key}` claims {} elements of {dtype}, more than the file holds \
                     (file truncated?)",
                    u64::from_le_bytes(count)
                ))
            })?;
        storages.insert(
            key.to_string(),
            MemberRange {
                offset: pos + 8,
                len,
            },
        );
        pos += 8 + len;
    }
    Ok((main, storages))
}

/// The five pickles at the start of the stream and the bytes they take.
fn read_pickles(head: &[u8]) -> std::result::Result<([Value; 5], usize), PickleError> {
    let mut pos = 0;
    let mut next = || -> std::result::Result<Value, PickleError> {
        let (v, used) = pickle::unpickle(&head[pos..])?;
        pos += used;
        Ok(v)
    };
    let values = [next()?, next()?, next()?, next()?, next()?];
    Ok((values, pos))
}
