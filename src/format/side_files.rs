//! The small files beside a checkpoint's weights (configs, tokenizer, chat templates): what a
//! writing command copies into its output, and what the GGUF planner reads.

use std::path::PathBuf;

use crate::error::{Error, Result};
use crate::format::checkpoint::Checkpoint;

/// Files next to the weights that belong in the output: configs, tokenizer, chat templates,
/// remote code, README. Weights of any format, indexes and adapter files are left out, as are
/// hidden files and subdirectories. A side file that is a FIFO, a device or a socket (or a
/// symlink to one) is refused, before any output exists: copying it would block forever or
/// never end, and leaving it out would drop the file without a word.
pub fn side_files(ckpt: &Checkpoint) -> Result<Vec<PathBuf>> {
    if !ckpt.has_model_dir() {
        return Ok(Vec::new());
    }
    let Ok(rd) = std::fs::read_dir(&ckpt.dir) else {
        return Ok(Vec::new());
    };
    let mut out = Vec::new();
    for e in rd.flatten() {
        let path = e.path();
        // Dangling symlinks and subdirectories are not side files.
        let Ok(meta) = std::fs::metadata(&path) else {
            continue;
        };
        if meta.is_dir() || !is_side_file(&e.file_name().to_string_lossy()) {
            continue;
        }
        crate::sys::refuse_special(&path, &meta).map_err(|err| Error::io(&path, err))?;
        out.push(path);
    }
    out.sort();
    Ok(out)
}

pub fn is_side_file(name: &str) -> bool {
    const WEIGHT_SUFFIXES: [&str; 13] = [
        ".distcp",
        ".safetensors",
        ".index.json",
        ".gguf",
        ".bin",
        ".pt",
        ".pth",
        ".ckpt",
        ".h5",
        ".msgpack",
        ".onnx",
        ".npz",
        ".tmp",
    ];
    !(name.starts_with('.')
        || name.starts_with("adapter_")
        || WEIGHT_SUFFIXES.iter().any(|s| name.ends_with(s)))
}
