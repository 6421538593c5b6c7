//! PyTorch Distributed Checkpoints (`torch.distributed.checkpoint`, as FSDP and accelerate
//! save them).
//!
//! A DCP folder holds `.metadata`, a pickle of
//! `Metadata{state_dict_metadata: {fqn: TensorStorageMetadata{properties, size,
//! chunks: [ChunkStorageMetadata{offsets, sizes}]} | BytesStorageMetadata},
//! storage_data: {MetadataIndex{fqn, offset, index}: _StorageInfo{relative_path, offset,
//! length}}}`, and `.distcp` files, each a run of torch.save zip archives, one per chunk, at
//! the `[offset, offset + length)` that `storage_data` records. A tensor becomes the regions
//! of its chunks (dim-0 shards for FSDP, any N-d grid in general), each placed at the storage
//! bytes inside its embedded archive; a tensor saved as one chunk becomes a plain range.
//!
//! Entries are told apart by where they sat in the saved state dict, which DefaultSavePlanner
//! records in `planner_data` (flattened name → path): accelerate's `{"model": state_dict}`
//! wrapper (every model entry under a top-level `model`, `model.model.…`) is dropped from the
//! names, and optimizer state (the `state` and `param_groups` of a top-level `optim` or
//! `optimizer` entry) is skipped with a note, as are non-tensor entries. A name alone never
//! decides: a plain save of a model whose own names start with `model.` keeps them, and
//! `optimus_head.weight` is a tensor. Without `planner_data` (a custom planner) the dotted name
//! stands for the path of optimizer state, and no wrapper is assumed.

use std::collections::HashMap;
use std::fs::File;
use std::path::{Component, Path};

use super::archive::read_archive;
use super::pickle::MAX_PICKLE_BYTES;
use super::state_dict::{unpickle_file, unsupported_dtype, view_placement};
use super::value::{Global, Value};
use crate::error::{Error, Result};
use crate::format::dtype::DType;
use crate::format::source::{
    check_regions_tile, source_file, Placement, Region, SourceDesc, SourceTensor,
};

pub const METADATA_NAME: &str = ".metadata";
/// The folder accelerate saves an FSDP model's DCP into.
pub const FSDP_MODEL_DIR: &str = "pytorch_model_fsdp_0";
/// Chunks of one tensor beyond this are refused.
pub const MAX_CHUNKS_PER_TENSOR: usize = 1 << 18;

struct StorageInfo {
    relative_path: String,
    offset: u64,
    length: u64,
}

/// Describes the DCP checkpoint in `dir` (the folder holding `.metadata`).
pub fn describe_dcp(dir: &Path) -> Result<SourceDesc> {
    let meta_path = dir.join(METADATA_NAME);
    let bad = |msg: String| Error::Dcp {
        path: meta_path.clone(),
        msg,
    };
    let len = source_file(&meta_path)?.len;
    if len > MAX_PICKLE_BYTES {
        return Err(bad(format!(
            "{len} bytes, more than the limit of {MAX_PICKLE_BYTES}"
        )));
    }
    let bytes = crate::sys::read_regular(&meta_path).map_err(|e| Error::io(&meta_path, e))?;
    let root = unpickle_file(&meta_path, &bytes)?;
    if root.class() != Some("Metadata") {
        return Err(bad(format!(
            "holds a {}, not a DCP Metadata object",
            root.class().unwrap_or(root.kind())
        )));
    }
    let (Some(Value::Dict(tensors)), Some(Value::Dict(storage_data))) =
        (root.attr("state_dict_metadata"), root.attr("storage_data"))
    else {
        return Err(bad(
            "no `state_dict_metadata` and `storage_data` dicts".into()
        ));
    };

    let mut storage: HashMap<(String, Vec<u64>), StorageInfo> = HashMap::new();
    for (k, v) in storage_data.borrow().iter() {
        // A bytes entry (`BytesStorageMetadata`: optimizer settings, any pickled object) is
        // indexed without an offset (None, which newer torch leaves out); only tensors are read.
        if matches!(k.attr("offset"), None | Some(Value::None)) {
            continue;
        }
        let (Some(fqn), Some(offset)) = (
            k.attr("fqn").and_then(|f| f.as_str().map(String::from)),
            k.attr("offset").and_then(|o| o.as_u64s()),
        ) else {
            return Err(bad(
                "a `storage_data` key is not a MetadataIndex{fqn, offset}".into(),
            ));
        };
        let (Some(relative_path), Some(off), Some(length)) = (
            v.attr("relative_path")
                .and_then(|p| p.as_str().map(String::from)),
            v.attr("offset").and_then(|o| o.as_u64()),
            v.attr("length").and_then(|o| o.as_u64()),
        ) else {
            return Err(bad(format!(
                "storage of `{fqn}` is not a _StorageInfo{{relative_path, offset, length}}"
            )));
        };
        // Newer torch can pass chunks through extensions (e.g. zstd): such bytes are no
        // longer an addressable torch.save archive.
        if let Some(transforms) = v.attr("transform_descriptors").and_then(|t| t.items()) {
            if !transforms.is_empty() {
                let names: Vec<&str> = transforms.iter().filter_map(|t| t.as_str()).collect();
                return Err(bad(format!(
                    "`{fqn}` is stored through transforms {names:?}; only plain DCP chunks are \
                     supported (save without storage extensions)"
                )));
            }
        }
        storage.insert(
            (fqn, offset),
            StorageInfo {
                relative_path,
                offset: off,
                length,
            },
        );
    }

    let entries: Vec<(String, Value)> = tensors
        .borrow()
        .iter()
        .filter_map(|(k, v)| k.as_str().map(|k| (k.to_string(), v.clone())))
        .collect();
    let paths = saved_paths(&root);
    let path_of = |fqn: &str| -> Vec<String> {
        match (paths.is_empty(), paths.get(fqn)) {
            (true, _) => fqn.split('.').map(String::from).collect(),
            (false, Some(p)) => p.clone(),
            (false, None) => vec![fqn.to_string()],
        }
    };
    let is_optimizer = |fqn: &str| is_optimizer_path(&path_of(fqn));
    // Only tensors count: a `{"model": …, "step": 5}` save still wraps its model.
    let wrapped = !paths.is_empty()
        && entries
            .iter()
            .filter(|(fqn, md)| !is_optimizer(fqn) && md.class() == Some("TensorStorageMetadata"))
            .all(|(fqn, _)| path_of(fqn).len() >= 2 && path_of(fqn)[0] == "model");

    let mut seen = std::collections::HashSet::new();
    if let Some((fqn, _)) = entries.iter().find(|(fqn, _)| !seen.insert(fqn.as_str())) {
        return Err(bad(format!("`{fqn}` is listed twice")));
    }
    let mut desc = SourceDesc::default();
    let mut files: HashMap<String, (usize, File)> = HashMap::new();
    for (fqn, md) in entries {
        if is_optimizer(&fqn) {
            desc.notes.push(format!("`{fqn}` skipped: optimizer state"));
            continue;
        }
        match md.class() {
            Some("TensorStorageMetadata") => {}
            Some("BytesStorageMetadata") => {
                desc.notes
                    .push(format!("`{fqn}` (bytes) skipped: not a tensor"));
                continue;
            }
            other => {
                desc.notes.push(format!(
                    "`{fqn}` ({}) skipped: not a tensor",
                    other.unwrap_or(md.kind())
                ));
                continue;
            }
        }
        let name = if wrapped {
            path_of(&fqn)[1..].join(".")
        } else {
            fqn.clone()
        };
        let tensor_bad = |msg: String| Error::InvalidTensor {
            path: meta_path.clone(),
            tensor: fqn.clone(),
            msg,
        };
        let dtype = match properties_dtype(&md) {
            Some(Value::Global(Global::Dtype(d))) => d,
            Some(Value::Global(Global::Unsupported(d))) => {
                return Err(unsupported_dtype(&meta_path, fqn.clone(), d))
            }
            _ => return Err(tensor_bad("no dtype in its properties".into())),
        };
        let mut shape = md
            .attr("size")
            .and_then(|s| s.as_u64s())
            .ok_or_else(|| tensor_bad("size is not a torch.Size".into()))?;
        // float4_e2m1fn_x2 counts byte pairs; F4 counts elements (see `globals`).
        let fp4_pairs = |v: &mut Vec<u64>| -> Result<()> {
            if dtype == DType::F4 {
                let last = v.last_mut().ok_or_else(|| {
                    tensor_bad("a 0-d float4_e2m1fn_x2 tensor has no F4 shape".into())
                })?;
                *last = last
                    .checked_mul(2)
                    .ok_or_else(|| tensor_bad("size overflows".into()))?;
            }
            Ok(())
        };
        fp4_pairs(&mut shape)?;
        let chunks = md
            .attr("chunks")
            .and_then(|c| c.items())
            .ok_or_else(|| tensor_bad("chunks is not a list".into()))?;
        if chunks.len() > MAX_CHUNKS_PER_TENSOR {
            return Err(tensor_bad(format!(
                "{} chunks, more than the limit of {MAX_CHUNKS_PER_TENSOR}",
                chunks.len()
            )));
        }
        let mut regions = Vec::with_capacity(chunks.len());
        for chunk in &chunks {
            let (Some(offsets), Some(sizes)) = (
                chunk.attr("offsets").and_then(|o| o.as_u64s()),
                chunk.attr("sizes").and_then(|o| o.as_u64s()),
            ) else {
                return Err(tensor_bad("a chunk lacks offsets/sizes".into()));
            };
            let Some(info) = storage.get(&(fqn.clone(), offsets.clone())) else {
                return Err(tensor_bad(format!(
                    "chunk at offsets {offsets:?} has no entry in `storage_data`"
                )));
            };
            let (mut offsets, mut sizes) = (offsets, sizes);
            fp4_pairs(&mut offsets)?;
            fp4_pairs(&mut sizes)?;
            let placement = chunk_placement(dir, &fqn, dtype, &sizes, info, &mut desc, &mut files)?;
            regions.push(Region {
                offsets,
                sizes,
                placement,
            });
        }
        check_regions_tile(&shape, &regions).map_err(tensor_bad)?;
        let whole = regions.len() == 1
            && regions[0].offsets.iter().all(|&o| o == 0)
            && regions[0].sizes == shape;
        let placement = if whole {
            regions.pop().expect("one region").placement
        } else {
            Placement::Regions(regions)
        };
        desc.tensors.push(SourceTensor {
            name,
            dtype,
            shape,
            placement,
        });
    }
    desc.sort_by_position();
    Ok(desc)
}

/// Top-level entries whose `state` and `param_groups` hold optimizer state.
const OPTIMIZER_ENTRIES: [&str; 2] = ["optim", "optimizer"];
const OPTIMIZER_PARTS: [&str; 2] = ["state", "param_groups"];

/// Whether an entry at `path` in the saved state dict is optimizer state.
fn is_optimizer_path(path: &[String]) -> bool {
    path.len() >= 3
        && OPTIMIZER_ENTRIES.contains(&path[0].as_str())
        && OPTIMIZER_PARTS.contains(&path[1].as_str())
}

/// `planner_data`: each flattened name's path in the saved state dict (`("model",
/// "model.embed_tokens.weight")`), as DefaultSavePlanner records it; empty when it is absent or
/// not such a mapping (a custom planner's data).
fn saved_paths(root: &Value) -> HashMap<String, Vec<String>> {
    let Some(Value::Dict(map)) = root.attr("planner_data") else {
        return HashMap::new();
    };
    let path = |v: &Value| -> Option<Vec<String>> {
        v.items()?
            .iter()
            .map(|p| match p {
                Value::Str(s) => Some(s.to_string()),
                Value::Int(i) => Some(i.to_string()),
                _ => None,
            })
            .collect()
    };
    let map = map.borrow();
    let paths: Option<HashMap<String, Vec<String>>> = map
        .iter()
        .map(|(k, v)| Some((k.as_str()?.to_string(), path(v).filter(|p| !p.is_empty())?)))
        .collect();
    paths.unwrap_or_default()
}

/// The dtype global of a `TensorProperties`, which pickles its state as the tuple `(dtype,
/// layout, requires_grad, memory_format, pin_memory)`; older versions as a dict with a `dtype`
/// key.
fn properties_dtype(md: &Value) -> Option<Value> {
    let props = md.attr("properties")?;
    if let Some(d) = props.attr("dtype") {
        return Some(d);
    }
    let Value::Object(o) = &props else {
        return None;
    };
    let state = o.borrow().state.clone()?;
    state.items()?.first().cloned()
}

/// Reads the embedded archive of one chunk and returns where its elements lie.
fn chunk_placement(
    dir: &Path,
    fqn: &str,
    dtype: DType,
    sizes: &[u64],
    info: &StorageInfo,
    desc: &mut SourceDesc,
    files: &mut HashMap<String, (usize, File)>,
) -> Result<Placement> {
    let rel = Path::new(&info.relative_path);
    let plain = !info.relative_path.is_empty()
        && rel.components().all(|c| matches!(c, Component::Normal(_)));
    let path = dir.join(rel);
    let bad = |msg: String| Error::InvalidTensor {
        path: path.clone(),
        tensor: fqn.into(),
        msg,
    };
    if !plain {
        return Err(Error::Dcp {
            path: dir.join(METADATA_NAME),
            msg: format!(
                "`{fqn}` is stored in `{}`, which is not a path inside the checkpoint folder",
                info.relative_path
            ),
        });
    }
    if !files.contains_key(&info.relative_path) {
        let f = crate::sys::open_regular(&path).map_err(|e| Error::io(&path, e))?;
        desc.files.push(source_file(&path)?);
        files.insert(info.relative_path.clone(), (desc.files.len() - 1, f));
    }
    let (index, file) = &files[&info.relative_path];
    let file_len = desc.files[*index].len;
    if info
        .offset
        .checked_add(info.length)
        .is_none_or(|e| e > file_len)
    {
        return Err(bad(format!(
            "chunk at bytes {}..{} lies past the end of the {file_len}-byte file (file \
             truncated, or .metadata from another save?)",
            info.offset,
            info.offset.saturating_add(info.length)
        )));
    }
    let archive = read_archive(&path, file, info.offset, info.length)?;
    let value = unpickle_file(&path, &archive.pickle)?;
    if let Value::UnsupportedTensor(d) = value {
        return Err(unsupported_dtype(&path, fqn.into(), d));
    }
    let Value::Tensor(view) = value else {
        return Err(bad(format!(
            "chunk archive at byte {} holds a {}, not a tensor",
            info.offset,
            value.kind()
        )));
    };
    if view.dtype != dtype || view.shape != sizes {
        return Err(bad(format!(
            "chunk archive at byte {} holds {} {:?}, but .metadata says {dtype} {sizes:?}",
            info.offset, view.dtype, view.shape
        )));
    }
    let Some(range) = archive.storages.get(&view.storage.key) else {
        return Err(bad(format!(
            "chunk archive at byte {} lacks its storage member `data/{}`",
            info.offset, view.storage.key
        )));
    };
    view_placement(&path, fqn, &view, *index, *range)
}
