//! The folder the GGUF planner reads `config.json` and the tokenizer from. For `tftf gguf` it
//! is the model's own folder. After steps that change those files (a merge writes its
//! `config.json`, a merged tokenizer, or leaves the tokenizer out), it is a private folder
//! holding the files as those steps would write them beside a saved checkpoint, so one pass
//! reads exactly what converting the written checkpoint would read.

use std::path::{Path, PathBuf};

use crate::error::{Error, Result};
use crate::format::checkpoint::Checkpoint;
use crate::format::side_files::side_files;
use crate::plan::Before;

pub(super) enum ModelDir {
    Input(PathBuf),
    /// Removed when dropped.
    Staged(tempfile::TempDir),
}

impl ModelDir {
    /// The checkpoint's folder when the earlier steps leave its small files as they are,
    /// else the files as those steps write them, staged.
    pub fn for_run(ckpt: &Checkpoint, before: &Before) -> Result<ModelDir> {
        let changed = before.config_edited
            || !before.generated_files.is_empty()
            || !before.dropped_side_files.is_empty();
        if !changed {
            return Ok(ModelDir::Input(ckpt.dir.clone()));
        }
        let staged = tempfile::Builder::new()
            .prefix("tftf-gguf-model-")
            .tempdir()
            .map_err(|e| Error::io(std::env::temp_dir(), e))?;
        let dir = staged.path();
        let replaced = |name: &str| {
            name == "config.json"
                || before.dropped_side_files.iter().any(|d| d == name)
                || before.generated_files.iter().any(|(g, _)| g == name)
        };
        for src in side_files(ckpt)? {
            let name = src.file_name().unwrap_or_default();
            if replaced(&name.to_string_lossy()) {
                continue;
            }
            let dst = dir.join(name);
            // A link where the file system allows one (tokenizers can be tens of MB), to the
            // file's absolute path.
            let target = std::fs::canonicalize(&src).map_err(|e| Error::io(&src, e))?;
            if std::os::unix::fs::symlink(&target, &dst).is_err() {
                std::fs::copy(&src, &dst).map_err(|e| Error::io(&src, e))?;
            }
        }
        let config = before.config.as_ref().map(|c| {
            let text = serde_json::to_string_pretty(c).unwrap_or_default();
            ("config.json".to_string(), text)
        });
        for (name, text) in before.generated_files.iter().chain(&config) {
            let path = dir.join(name);
            std::fs::write(&path, text).map_err(|e| Error::io(&path, e))?;
        }
        Ok(ModelDir::Staged(staged))
    }

    /// `e` naming the file it is about as the user knows it: a staged link by the model file
    /// it links to, a staged file by its name as the earlier steps write it.
    pub fn explain(&self, mut e: Error) -> Error {
        let ModelDir::Staged(dir) = self else {
            return e;
        };
        let real = |path: PathBuf| -> PathBuf {
            let Ok(rel) = path.strip_prefix(dir.path()) else {
                return path;
            };
            match std::fs::read_link(&path) {
                Ok(target) => target,
                Err(_) => {
                    PathBuf::from(format!("{} (as the earlier steps write it)", rel.display()))
                }
            }
        };
        if let Error::GgufTokenizer { path, .. }
        | Error::GgufConfig { path, .. }
        | Error::GgufUnknownPreTokenizer { path, .. }
        | Error::Io { path, .. } = &mut e
        {
            *path = real(std::mem::take(path));
        }
        e
    }

    pub fn path(&self) -> &Path {
        match self {
            ModelDir::Input(p) => p,
            ModelDir::Staged(t) => t.path(),
        }
    }
}
