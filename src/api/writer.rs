//! [`Writer`]: where a pipeline's output goes, in upstream's writer names.
//!
//! A writer only chooses the output path and format ([`Format`]); the files themselves are
//! laid out and committed by the CLI's driver, so a library run writes exactly what the
//! matching command would (shards and index, side files, an atomic commit).

use std::path::{Path, PathBuf};

use crate::error::{Error, Result};
use crate::job::Format;
use crate::sink::gguf::{FileType, GgufSinkOptions};
use crate::sink::{output_kind_for, OutputKind};

/// Where and how a [`crate::Pipeline`] writes, upstream's `ShardedWriter`, `StreamingWriter`
/// and `NullWriter`, plus GGUF.
#[derive(Debug, Clone)]
pub struct Writer {
    kind: Kind,
    max_shard_bytes: Option<u64>,
    outtype: Option<FileType>,
    force: bool,
    /// GGUF only: `--arch` and `--vocab-pre`.
    arch: Option<String>,
    vocab_pre: Option<String>,
}

#[derive(Debug, Clone)]
enum Kind {
    Sharded(PathBuf),
    File(PathBuf),
    Null,
    Gguf(PathBuf),
}

impl Writer {
    /// Upstream's `ShardedWriter(dir)`: a directory of `model-0000i-of-0000n.safetensors`
    /// shards with `model.safetensors.index.json`, and the input's side files (`config.json`
    /// edited to match, the tokenizer). Shards split as the input's do unless
    /// [`Writer::max_shard_size`] says otherwise.
    pub fn sharded(dir: impl Into<PathBuf>) -> Writer {
        Writer::of(Kind::Sharded(dir.into()))
    }

    /// Upstream's `StreamingWriter(path)`: every tensor in one `.safetensors` file; `path`
    /// must end in `.safetensors`.
    pub fn file(path: impl Into<PathBuf>) -> Writer {
        Writer::of(Kind::File(path.into()))
    }

    /// Upstream's `NullWriter()`: a dry run that plans everything and writes nothing. Its
    /// [`crate::Report`] says whether the run would succeed: what stops it (an unreadable
    /// input, an op that cannot apply) is listed in [`crate::Report::problems`] instead of
    /// being returned as an error.
    pub fn null() -> Writer {
        Writer::of(Kind::Null)
    }

    /// A GGUF file for llama.cpp (as `tftf gguf -o PATH`); the tensor type follows the
    /// checkpoint unless [`Writer::outtype`] sets it.
    pub fn gguf(path: impl Into<PathBuf>) -> Writer {
        Writer::of(Kind::Gguf(path.into()))
    }

    setters! {
        /// Shards of at most `bytes` bytes (sharded output only).
        max_shard_size(bytes: u64) => max_shard_bytes = Some(bytes);
        /// The GGUF tensor type (`--outtype`; GGUF output only).
        outtype(file_type: FileType) => outtype = Some(file_type);
        /// Replace an existing output (`--force`); without it an existing output is refused.
        force(force: bool) => force = force;
    }

    /// The architecture to treat the model as (`--arch`; GGUF output only): a config.json
    /// class name or a GGUF architecture.
    pub fn arch(mut self, arch: impl Into<String>) -> Writer {
        self.arch = Some(arch.into());
        self
    }

    /// The `tokenizer.ggml.pre` to write (`--vocab-pre`; GGUF output only), for a
    /// pre-tokenizer llama.cpp does not recognise by its hash.
    pub fn vocab_pre(mut self, name: impl Into<String>) -> Writer {
        self.vocab_pre = Some(name.into());
        self
    }

    fn of(kind: Kind) -> Writer {
        Writer {
            kind,
            max_shard_bytes: None,
            outtype: None,
            force: false,
            arch: None,
            vocab_pre: None,
        }
    }

    /// Whether this is the dry-run writer.
    pub(crate) fn is_null(&self) -> bool {
        matches!(self.kind, Kind::Null)
    }

    /// Whether this is a GGUF writer.
    pub(crate) fn is_gguf(&self) -> bool {
        matches!(self.kind, Kind::Gguf(_))
    }

    /// The output path and format the driver takes; refuses options that do not apply.
    pub(crate) fn target(&self) -> Result<(PathBuf, Format)> {
        let refuse = |why: String| Err(Error::Usage(why));
        let (sharded, gguf) = (
            matches!(self.kind, Kind::Sharded(_) | Kind::Null),
            matches!(self.kind, Kind::Gguf(_)),
        );
        if self.max_shard_bytes.is_some() && !sharded {
            return refuse("max_shard_size applies to a sharded writer".into());
        }
        if (self.outtype.is_some() || self.arch.is_some() || self.vocab_pre.is_some()) && !gguf {
            return refuse("outtype, arch and vocab_pre apply to a GGUF writer".into());
        }
        let safetensors = Format::Safetensors {
            max_shard_bytes: self.max_shard_bytes,
        };
        match &self.kind {
            Kind::Sharded(dir) => match output_kind_for(dir) {
                OutputKind::Dir => Ok((dir.clone(), safetensors)),
                OutputKind::File => refuse(format!(
                    "Writer::sharded({}): name a directory (Writer::file writes one .safetensors file)",
                    dir.display()
                )),
            },
            Kind::File(path) => match output_kind_for(path) {
                OutputKind::File => Ok((path.clone(), safetensors)),
                OutputKind::Dir => refuse(format!(
                    "Writer::file({}): the file name ends in .safetensors",
                    path.display()
                )),
            },
            Kind::Null => Ok((dry_run_output(), safetensors)),
            Kind::Gguf(path) => Ok((path.clone(), Format::Gguf(self.gguf_options(path)?))),
        }
    }

    fn gguf_options(&self, path: &Path) -> Result<GgufSinkOptions> {
        let file_name = path
            .file_name()
            .ok_or_else(|| Error::Usage(format!("{}: name the .gguf file", path.display())))?;
        Ok(GgufSinkOptions {
            file_name: file_name.to_string_lossy().into_owned(),
            file_type: self.outtype,
            split_max_bytes: 0,
            arch: self.arch.clone(),
            vocab_pre: self.vocab_pre.clone(),
            mix: Default::default(),
        })
    }

    /// Whether the writer replaces an existing output.
    pub(crate) fn forces(&self) -> bool {
        self.force
    }
}

/// Where the dry run plans its sharded output: a directory that does not exist, so nothing
/// there can stop the plan (nothing is created).
fn dry_run_output() -> PathBuf {
    std::env::temp_dir().join(format!("tftf-dry-run-{}", std::process::id()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn options_that_do_not_apply_are_refused() {
        let usage = |w: Writer| matches!(w.target(), Err(Error::Usage(_)));
        assert!(usage(Writer::file("out")));
        assert!(usage(Writer::sharded("out.safetensors")));
        assert!(usage(Writer::file("m.safetensors").max_shard_size(1 << 20)));
        assert!(usage(Writer::sharded("out").outtype(FileType::MostlyF16)));
        assert!(usage(Writer::file("m.safetensors").vocab_pre("llama-bpe")));
        assert!(usage(Writer::null().arch("llama")));
        assert!(!usage(Writer::null().max_shard_size(1 << 20)));
        let (path, format) = Writer::gguf("dir/m.gguf")
            .outtype(FileType::AllF32)
            .target()
            .unwrap();
        assert_eq!(path, PathBuf::from("dir/m.gguf"));
        assert!(
            matches!(format, Format::Gguf(o) if o.file_name == "m.gguf" && o.file_type == Some(FileType::AllF32))
        );
    }
}
