//! Atomic output: files are written under hidden temporary names beside their final ones and
//! renamed into place only after the whole run succeeded (and was flushed to disk). Dropping an
//! uncommitted `OutputSet` — an error, a panic unwinding, Ctrl-C — removes every temporary file
//! and the output directory if this run created it.

use std::fs::{File, OpenOptions};
use std::path::{Path, PathBuf};

use crate::error::{Error, Result};
use crate::format::checkpoint::Checkpoint;

pub struct OutputSet {
    dir: PathBuf,
    created_dir: bool,
    files: Vec<(PathBuf, PathBuf)>,
    committed: bool,
}

impl OutputSet {
    /// Creates the output directory if needed. Call only after every check has passed.
    pub fn create(dir: &Path) -> Result<OutputSet> {
        let created_dir = !dir.exists();
        if created_dir {
            std::fs::create_dir_all(dir).map_err(|e| Error::io(dir, e))?;
        }
        Ok(OutputSet {
            dir: dir.to_path_buf(),
            created_dir,
            files: Vec::new(),
            committed: false,
        })
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    fn temp_path(&self, name: &str) -> PathBuf {
        self.dir
            .join(format!(".{name}.tftf-{}.tmp", std::process::id()))
    }

    /// Opens a new temporary file that becomes `name` on commit.
    pub fn add(&mut self, name: &str) -> Result<(File, PathBuf)> {
        let tmp = self.temp_path(name);
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .open(&tmp)
            .map_err(|e| Error::io(&tmp, e))?;
        self.files.push((tmp.clone(), self.dir.join(name)));
        Ok((file, tmp))
    }

    /// Writes a whole small file (index, config).
    pub fn add_bytes(&mut self, name: &str, bytes: &[u8]) -> Result<()> {
        let (file, tmp) = self.add(name)?;
        use std::io::Write;
        let mut w = std::io::BufWriter::new(file);
        w.write_all(bytes).map_err(|e| Error::io(&tmp, e))?;
        w.into_inner()
            .map_err(|e| Error::io(&tmp, e.into_error()))?
            .sync_all()
            .map_err(|e| Error::io(&tmp, e))
    }

    /// Copies a side file: shared with the input where the filesystem can, else copied in the
    /// kernel.
    pub fn add_copy(&mut self, name: &str, src: &Path) -> Result<()> {
        let (dst, tmp) = self.add(name)?;
        let from = File::open(src).map_err(|e| Error::io(src, e))?;
        if crate::sys::clone_file(&from, &dst).is_err() {
            drop(dst);
            std::fs::copy(src, &tmp).map_err(|e| Error::io(src, e))?;
        }
        Ok(())
    }

    /// Flushes everything, renames temporaries into place and, with `replace_stale`, removes
    /// model files of an earlier run that this output does not include.
    pub fn commit(mut self, replace_stale: bool) -> Result<Vec<PathBuf>> {
        for (tmp, _) in &self.files {
            let f = File::open(tmp).map_err(|e| Error::io(tmp, e))?;
            f.sync_all().map_err(|e| Error::io(tmp, e))?;
        }
        for (tmp, fin) in &self.files {
            std::fs::rename(tmp, fin).map_err(|e| Error::io(fin, e))?;
        }
        self.committed = true;
        let finals: Vec<PathBuf> = self.files.iter().map(|(_, f)| f.clone()).collect();
        if replace_stale {
            if let Ok(rd) = std::fs::read_dir(&self.dir) {
                for entry in rd.flatten() {
                    let p = entry.path();
                    let name = entry.file_name().to_string_lossy().into_owned();
                    let model_file =
                        name.ends_with(".safetensors") || name.ends_with(".safetensors.index.json");
                    if model_file && p.is_file() && !finals.contains(&p) {
                        let _ = std::fs::remove_file(&p);
                    }
                }
            }
        }
        if let Ok(d) = File::open(&self.dir) {
            let _ = d.sync_all();
        }
        Ok(finals)
    }
}

impl Drop for OutputSet {
    fn drop(&mut self) {
        if self.committed {
            return;
        }
        for (tmp, _) in &self.files {
            let _ = std::fs::remove_file(tmp);
        }
        if self.created_dir {
            let _ = std::fs::remove_dir(&self.dir);
        }
    }
}

/// Files next to the weights that belong in the output: configs, tokenizer, chat templates,
/// remote code, README. Weights of any format, indexes and adapter files are left out, as are
/// hidden files and subdirectories.
pub fn side_files(ckpt: &Checkpoint) -> Vec<PathBuf> {
    if !ckpt.has_model_dir() {
        return Vec::new();
    }
    let Ok(rd) = std::fs::read_dir(&ckpt.dir) else {
        return Vec::new();
    };
    let mut out: Vec<PathBuf> = rd
        .flatten()
        .filter(|e| e.path().is_file())
        .filter(|e| is_side_file(&e.file_name().to_string_lossy()))
        .map(|e| e.path())
        .collect();
    out.sort();
    out
}

pub fn is_side_file(name: &str) -> bool {
    const WEIGHT_SUFFIXES: [&str; 12] = [
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

/// Absolute form of a path that may not exist yet: its deepest existing ancestor resolved,
/// the rest appended.
pub fn resolve(path: &Path) -> PathBuf {
    let abs = if path.is_absolute() {
        path.to_path_buf()
    } else {
        std::env::current_dir().unwrap_or_default().join(path)
    };
    let mut existing = abs.as_path();
    let mut rest = Vec::new();
    loop {
        if let Ok(c) = existing.canonicalize() {
            let mut out = c;
            for part in rest.iter().rev() {
                out.push(part);
            }
            return out;
        }
        match (existing.parent(), existing.file_name()) {
            (Some(p), Some(name)) => {
                rest.push(name.to_os_string());
                existing = p;
            }
            _ => return abs,
        }
    }
}

/// Refuses an output that would overwrite or land inside the input, and a non-empty output
/// directory (or existing output file) without `force`.
pub fn check_output(ckpt: &Checkpoint, out: &Path, is_file: bool, force: bool) -> Result<()> {
    let out_abs = resolve(out);
    let inside = |dir: &Path| out_abs.starts_with(resolve(dir));
    let clash = if ckpt.has_model_dir() {
        inside(&ckpt.dir)
    } else {
        ckpt.shards.iter().any(|s| resolve(&s.path) == out_abs)
    };
    if clash {
        return Err(Error::OutputInsideInput {
            output: out.into(),
            input: if ckpt.has_model_dir() {
                ckpt.dir.clone()
            } else {
                ckpt.input.clone()
            },
        });
    }
    if is_file {
        if out.exists() && !force {
            return Err(Error::Other(format!(
                "output file {} exists; pass --force to replace it",
                out.display()
            )));
        }
        if out.is_dir() {
            return Err(Error::Other(format!(
                "output {} is a directory; name a .safetensors file or drop the extension",
                out.display()
            )));
        }
    } else if out.exists() {
        if !out.is_dir() {
            return Err(Error::Other(format!(
                "output {} exists and is not a directory",
                out.display()
            )));
        }
        let non_empty = std::fs::read_dir(out)
            .map_err(|e| Error::io(out, e))?
            .next()
            .is_some();
        if non_empty && !force {
            return Err(Error::OutputNotEmpty(out.into()));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn side_file_rules() {
        for keep in [
            "config.json",
            "tokenizer.json",
            "tokenizer.model",
            "generation_config.json",
            "chat_template.jinja",
            "modeling_deepseek.py",
            "README.md",
            "merges.txt",
        ] {
            assert!(is_side_file(keep), "{keep}");
        }
        for skip in [
            "model-00001-of-00002.safetensors",
            "model.safetensors.index.json",
            "pytorch_model.bin",
            "model.gguf",
            "adapter_config.json",
            "adapter_model.safetensors",
            "consolidated.00.pth",
            ".gitattributes",
        ] {
            assert!(!is_side_file(skip), "{skip}");
        }
    }
}
