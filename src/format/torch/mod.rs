//! PyTorch checkpoints described as [`SourceDesc`]s: torch.save files (zip, and the pre-1.6
//! legacy stream), folders of `.bin` shards, and Distributed Checkpoints (DCP).
//!
//! Nothing here executes a pickle: [`pickle`] is a restricted machine that only builds
//! containers, tensor views and DCP dataclasses. A tensor view `(storage, dtype, offset, shape,
//! stride)` becomes a plain file range when it is contiguous (so an untouched tensor can still
//! be copied with `copy_file_range`), and a strided placement otherwise. Tensors sharing a
//! storage (tied weights) simply point at the same bytes.

pub mod archive;
pub mod dcp;
pub mod globals;
pub mod legacy;
pub mod pickle;
pub mod state_dict;
pub mod value;

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

use crate::error::{Error, Result};
use crate::format::source::{source_file, SourceDesc, SourceTensor};
use state_dict::{flatten, unpickle_file, view_placement};

/// The index transformers writes next to sharded `.bin` files.
pub const BIN_INDEX_NAME: &str = "pytorch_model.bin.index.json";

/// Describes a PyTorch checkpoint: a torch.save file, a folder of `.bin`/`.pt` shards (with or
/// without `pytorch_model.bin.index.json`), a DCP folder (holding `.metadata`), one of its
/// files (`.metadata` or a `.distcp`: the whole checkpoint is described), or a folder holding
/// `pytorch_model_fsdp_0/`.
pub fn describe(path: &Path) -> Result<SourceDesc> {
    let meta = std::fs::metadata(path).map_err(|e| Error::io(path, e))?;
    if meta.is_file() {
        let dcp_part = path.file_name().is_some_and(|n| n == dcp::METADATA_NAME)
            || path.extension().is_some_and(|e| e == "distcp");
        if dcp_part {
            let dir = path.parent().unwrap_or(Path::new("."));
            return dcp::describe_dcp(dir);
        }
        return describe_file(path);
    }
    if path.join(dcp::METADATA_NAME).is_file() {
        return dcp::describe_dcp(path);
    }
    let fsdp = path.join(dcp::FSDP_MODEL_DIR);
    if fsdp.join(dcp::METADATA_NAME).is_file() {
        return dcp::describe_dcp(&fsdp);
    }
    describe_sharded(path)
}

/// Whether a `.bin`/`.pt`/`.pth` file in a model folder may hold its weights: not a trainer's
/// state (`training_args.bin`, `optimizer.pt`, `scheduler.pt`, `rng_state*.pth`), an adapter
/// (`adapter_model.bin`), or a macOS `._*` metadata file.
pub fn is_weight_file_name(name: &[u8]) -> bool {
    const NOT_WEIGHTS: [&[u8]; 6] = [
        b"._",
        b"adapter_model",
        b"training_args",
        b"optimizer",
        b"scheduler",
        b"rng_state",
    ];
    (name.ends_with(b".bin") || name.ends_with(b".pt") || name.ends_with(b".pth"))
        && !NOT_WEIGHTS.iter().any(|p| name.starts_with(p))
}

/// Describes one torch.save file (zip or legacy).
pub fn describe_file(path: &Path) -> Result<SourceDesc> {
    let mut desc = SourceDesc::default();
    add_torch_file(&mut desc, path)?;
    desc.sort_by_position();
    Ok(desc)
}

/// Describes a folder of torch.save shards: those `pytorch_model.bin.index.json` names, or
/// else every `*.bin`, `*.pt`, `*.pth` file in name order.
pub fn describe_sharded(dir: &Path) -> Result<SourceDesc> {
    let index_path = dir.join(BIN_INDEX_NAME);
    let mut desc = SourceDesc::default();
    if index_path.is_file() {
        let weight_map = read_index(&index_path)?;
        let mut shards: Vec<&String> = weight_map.values().collect();
        shards.sort();
        shards.dedup();
        let mut seen: HashMap<String, PathBuf> = HashMap::new();
        for shard in shards {
            let tensor = weight_map
                .iter()
                .find(|(_, s)| *s == shard)
                .map(|(t, _)| t.clone())
                .unwrap_or_default();
            if Path::new(shard).components().count() != 1 {
                return Err(Error::InvalidIndex {
                    path: index_path.clone(),
                    msg: format!("shard `{shard}` is not a file name in this folder"),
                });
            }
            let shard_path = dir.join(shard);
            if !shard_path.is_file() {
                return Err(Error::MissingShard {
                    index: index_path.clone(),
                    shard: shard.clone(),
                    tensor,
                });
            }
            let first = desc.tensors.len();
            add_torch_file(&mut desc, &shard_path)?;
            let added: Vec<SourceTensor> = desc.tensors.drain(first..).collect();
            for t in added {
                if weight_map.get(&t.name) != Some(shard) {
                    desc.notes.push(format!(
                        "`{}` in {shard} skipped: the index does not map it to this shard",
                        t.name
                    ));
                    continue;
                }
                seen.insert(t.name.clone(), shard_path.clone());
                desc.tensors.push(t);
            }
        }
        if let Some((tensor, shard)) = weight_map.iter().find(|(t, _)| !seen.contains_key(*t)) {
            return Err(Error::TensorNotInShard {
                shard: dir.join(shard),
                tensor: tensor.clone(),
            });
        }
    } else {
        let mut shards = Vec::new();
        for entry in std::fs::read_dir(dir).map_err(|e| Error::io(dir, e))? {
            let entry = entry.map_err(|e| Error::io(dir, e))?;
            let p = entry.path();
            let ext = p.extension().and_then(|e| e.to_str()).unwrap_or("");
            if !matches!(ext, "bin" | "pt" | "pth") || !p.is_file() {
                continue;
            }
            let name = entry.file_name();
            if is_weight_file_name(name.as_encoded_bytes()) {
                shards.push(p);
            } else {
                desc.notes.push(format!(
                    "`{}` skipped: not model weights (trainer state, an adapter or macOS metadata)",
                    name.to_string_lossy()
                ));
            }
        }
        shards.sort();
        if shards.is_empty() {
            return Err(Error::NoModel {
                path: dir.into(),
                msg: "no PyTorch checkpoint here (no *.bin/*.pt/*.pth files, no DCP .metadata)"
                    .into(),
            });
        }
        let mut seen: HashMap<String, PathBuf> = HashMap::new();
        for shard in shards {
            let first = desc.tensors.len();
            add_torch_file(&mut desc, &shard)?;
            for t in &desc.tensors[first..] {
                if let Some(prev) = seen.insert(t.name.clone(), shard.clone()) {
                    return Err(Error::DuplicateTensor {
                        tensor: t.name.clone(),
                        first: prev,
                        second: shard,
                    });
                }
            }
        }
    }
    desc.sort_by_position();
    Ok(desc)
}

fn read_index(path: &Path) -> Result<BTreeMap<String, String>> {
    let invalid = |msg: String| Error::InvalidIndex {
        path: path.into(),
        msg,
    };
    let text = crate::sys::read_regular_to_string(path).map_err(|e| Error::io(path, e))?;
    let value: serde_json::Value =
        serde_json::from_str(&text).map_err(|e| invalid(e.to_string()))?;
    let Some(map) = value.get("weight_map").and_then(|m| m.as_object()) else {
        return Err(invalid("no `weight_map` object".into()));
    };
    map.iter()
        .map(|(k, v)| match v.as_str() {
            Some(s) => Ok((k.clone(), s.to_string())),
            None => Err(invalid(format!(
                "`weight_map` value of `{k}` is not a string"
            ))),
        })
        .collect()
}

/// Appends one torch.save file (zip or legacy) to `desc`.
fn add_torch_file(desc: &mut SourceDesc, path: &Path) -> Result<()> {
    let file = crate::sys::open_regular(path).map_err(|e| Error::io(path, e))?;
    let info = source_file(path)?;
    let mut magic = [0u8; 4];
    let n = std::os::unix::fs::FileExt::read_at(&file, &mut magic, 0)
        .map_err(|e| Error::io(path, e))?;
    let file_index = desc.files.len();
    let (value, storages) = if magic[..n.min(4)] == *b"PK\x03\x04" {
        let archive = archive::read_archive(path, &file, 0, info.len)?;
        (unpickle_file(path, &archive.pickle)?, archive.storages)
    } else if n >= 3 && magic[..3] == [0x80, 0x02, 0x8a] {
        legacy::read_legacy(path, &file, info.len)?
    } else {
        return Err(Error::TorchArchive {
            path: path.into(),
            msg: "neither a zip archive nor a legacy pickle stream: not a torch.save file".into(),
        });
    };
    let mut notes = Vec::new();
    let views = flatten(path, &value, &mut notes)?;
    desc.files.push(info);
    for (name, view) in views {
        let Some(range) = storages.get(&view.storage.key) else {
            return Err(Error::InvalidTensor {
                path: path.into(),
                tensor: name,
                msg: format!(
                    "its storage `{}` (member `data/{}`) is missing from the file",
                    view.storage.key, view.storage.key
                ),
            });
        };
        let placement = view_placement(path, &name, &view, file_index, *range)?;
        desc.tensors.push(SourceTensor {
            name,
            dtype: view.dtype,
            shape: view.shape.clone(),
            placement,
        });
    }
    desc.notes.extend(notes);
    Ok(())
}
