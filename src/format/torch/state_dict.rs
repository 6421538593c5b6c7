//! From unpickled values to tensors: a state dict flattened to named tensor views, each view
//! placed in its file, and pickle errors named with their file. The torch.save readers
//! (zip, legacy) and the DCP reader all use these, so they sit in a file of their own below
//! `torch/mod.rs`, which dispatches to those readers.

use std::path::Path;
use std::rc::Rc;

use super::archive::MemberRange;
use super::pickle;
use super::value::{PickleError, TensorView, Value};
use crate::error::{Error, Result};
use crate::format::dtype::element_count;
use crate::format::header::MAX_HEADER_BYTES;
use crate::format::source::{contiguous_strides, Placement};

/// State dicts nested deeper than this are refused.
pub const MAX_NESTING_DEPTH: usize = 64;
/// Entries visited while flattening a state dict (tensors plus skipped values).
pub const MAX_STATE_DICT_ENTRIES: usize = 1 << 24;
/// The names a state dict flattens to, in bytes all together: what a safetensors header may
/// hold ([`MAX_HEADER_BYTES`]). A pickle can share one dict through its memo under many keys,
/// and each level of sharing doubles the names, so a few KiB of pickle would otherwise expand
/// to gigabytes of names; this bound makes it cost what a safetensors header of those names
/// would.
pub const MAX_STATE_DICT_NAME_BYTES: u64 = MAX_HEADER_BYTES;

/// Runs the restricted unpickler, naming `path` in its errors.
pub(crate) fn unpickle_file(path: &Path, bytes: &[u8]) -> Result<Value> {
    pickle::unpickle(bytes)
        .map(|(v, _)| v)
        .map_err(|e| pickle_error(path, e))
}

pub(crate) fn pickle_error(path: &Path, e: PickleError) -> Error {
    match e {
        PickleError::Forbidden(global) => Error::UnsafePickle {
            path: path.into(),
            global,
        },
        PickleError::Invalid(msg) => Error::BadPickle {
            path: path.into(),
            msg,
        },
    }
}

/// Where a view's elements lie, given its storage's bytes in file `file`.
pub(crate) fn view_placement(
    path: &Path,
    name: &str,
    view: &TensorView,
    file: usize,
    storage: MemberRange,
) -> Result<Placement> {
    let bad = |msg: String| Error::InvalidTensor {
        path: path.into(),
        tensor: name.into(),
        msg,
    };
    // Bits, not bytes: packed FP4 (`F4`, from float4_e2m1fn_x2) has two elements a byte.
    let bits = view.dtype.bits();
    let bytes_of = |n: u64| n.checked_mul(bits).map(|b| b.div_ceil(8));
    let elements = element_count(&view.shape)
        .ok_or_else(|| bad(format!("shape {:?} overflows", view.shape)))?;
    if elements == 0 {
        return Ok(Placement::Contiguous {
            file,
            offset: storage.offset,
            len: 0,
        });
    }
    // The last element the view touches, then the bytes up to and including it.
    let mut last = view.storage_offset;
    for (d, s) in view.shape.iter().zip(&view.strides) {
        last = (d - 1)
            .checked_mul(*s)
            .and_then(|x| x.checked_add(last))
            .ok_or_else(|| bad("view offsets overflow".into()))?;
    }
    let reach = last
        .checked_add(1)
        .and_then(bytes_of)
        .ok_or_else(|| bad("view offsets overflow".into()))?;
    if reach > storage.len {
        return Err(bad(format!(
            "view (storage offset {}, shape {:?}, stride {:?}, {}) reaches byte {reach} of its \
             {}-byte storage `{}`",
            view.storage_offset,
            view.shape,
            view.strides,
            view.dtype,
            storage.len,
            view.storage.key
        )));
    }
    let row_major = contiguous_strides(&view.shape);
    let contiguous = view
        .shape
        .iter()
        .zip(view.strides.iter().zip(&row_major))
        .all(|(d, (s, r))| *d == 1 || s == r);
    if contiguous {
        Ok(Placement::Contiguous {
            file,
            offset: storage.offset + view.storage_offset * bits / 8,
            len: elements * bits / 8,
        })
    } else if !bits.is_multiple_of(8) {
        Err(bad(format!(
            "a non-contiguous view (stride {:?}) of packed {}: save it with .contiguous()",
            view.strides, view.dtype
        )))
    } else {
        Ok(Placement::Strided {
            file,
            storage_start: storage.offset,
            storage_len: storage.len,
            storage_offset: view.storage_offset,
            strides: view.strides.clone(),
        })
    }
}

/// The tensors of a state dict, nested dicts joined with dots, in pickle order; everything
/// else is noted and skipped.
pub(crate) fn flatten(
    path: &Path,
    value: &Value,
    notes: &mut Vec<String>,
) -> Result<Vec<(String, Rc<TensorView>)>> {
    let Value::Dict(_) = value else {
        return Err(Error::TorchArchive {
            path: path.into(),
            msg: format!(
                "holds a {}, not a state dict (a dict of tensors)",
                value.kind()
            ),
        });
    };
    let mut out: Vec<(String, Rc<TensorView>)> = Vec::new();
    let mut names = std::collections::HashSet::new();
    let mut visited = 0usize;
    let mut name_bytes = 0u64;
    let mut work = vec![(String::new(), value.clone(), 0usize)];
    while let Some((prefix, v, depth)) = work.pop() {
        visited += 1;
        if visited > MAX_STATE_DICT_ENTRIES {
            return Err(Error::TorchArchive {
                path: path.into(),
                msg: format!("state dict has more than {MAX_STATE_DICT_ENTRIES} entries"),
            });
        }
        match v {
            Value::Tensor(t) => {
                if !names.insert(prefix.clone()) {
                    return Err(Error::InvalidTensor {
                        path: path.into(),
                        tensor: prefix,
                        msg: "defined twice in the state dict".into(),
                    });
                }
                out.push((prefix, t))
            }
            Value::Dict(d) => {
                if depth >= MAX_NESTING_DEPTH {
                    return Err(Error::TorchArchive {
                        path: path.into(),
                        msg: format!("`{prefix}` is nested deeper than {MAX_NESTING_DEPTH} dicts"),
                    });
                }
                // Pushed in reverse so the work stack pops them in pickle order.
                for (k, item) in d.borrow().iter().rev() {
                    let key = match k {
                        Value::Str(s) => s.to_string(),
                        Value::Int(i) => i.to_string(),
                        other => {
                            notes.push(format!(
                                "entry of `{prefix}` with a {} key skipped",
                                other.kind()
                            ));
                            continue;
                        }
                    };
                    name_bytes += (prefix.len() + 1 + key.len()) as u64;
                    if name_bytes > MAX_STATE_DICT_NAME_BYTES {
                        let escaped = crate::escape::name(&prefix);
                        let mut shown: String = escaped.chars().take(120).collect();
                        if shown.len() < escaped.len() {
                            shown.push('…');
                        }
                        return Err(Error::TorchArchive {
                            path: path.into(),
                            msg: format!(
                                "the state dict's names add up to more than \
                                 {MAX_STATE_DICT_NAME_BYTES} bytes (the safetensors header \
                                 limit), reached under `{}`; a pickle sharing dicts \
                                 through its memo multiplies them",
                                shown
                            ),
                        });
                    }
                    let name = if prefix.is_empty() {
                        key
                    } else {
                        format!("{prefix}.{key}")
                    };
                    work.push((name, item.clone(), depth + 1));
                }
            }
            Value::UnsupportedTensor(dtype) => return Err(unsupported_dtype(path, prefix, dtype)),
            other => notes.push(format!(
                "`{prefix}` ({}) skipped: not a tensor",
                other.kind()
            )),
        }
    }
    Ok(out)
}

/// The error for a tensor of a torch dtype safetensors cannot hold.
pub(crate) fn unsupported_dtype(path: &Path, tensor: String, dtype: &str) -> Error {
    Error::InvalidTensor {
        path: path.into(),
        tensor,
        msg: format!(
            "unsupported dtype {dtype}: safetensors has no such type; convert the tensor in \
             torch (e.g. to a supported dtype, or with torch.view_as_real) and save again"
        ),
    }
}
