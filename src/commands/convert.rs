//! `tftf convert MODEL --format gguf|safetensors --outdir DIR`: the announced short form. It
//! builds exactly the job `tftf gguf` or `tftf passthrough` builds, so the bytes are theirs;
//! only the output is named differently (a directory, and for GGUF a file named after the
//! input inside it).

use std::path::{Path, PathBuf};

use super::{input_path, passthrough_steps, JobParts};
use crate::cli::{ConvertArgs, GgufArgs, GgufFormatArgs, InputArgs, PassthroughArgs, WriteArgs};
use crate::error::{Error, Result};
use crate::job::WriteOptions;

/// The job `convert` runs: `gguf`'s or `passthrough`'s, into `--outdir`.
pub(super) fn job(a: &ConvertArgs, arguments: &str) -> Result<JobParts> {
    refuse_other_formats_options(a)?;
    let source = input_path(&a.input)?;
    if a.outdir
        .extension()
        .is_some_and(|e| e == "safetensors" || e == "gguf")
    {
        return Err(Error::Usage(format!(
            "--outdir {}: name a directory (the file names are chosen inside it)",
            a.outdir.display()
        )));
    }
    let input = || InputArgs {
        input: Some(source.clone()),
        model: None,
    };
    if a.format == "gguf" {
        let g = GgufArgs {
            input: input(),
            output: a.outdir.join(gguf_file_name(&source)),
            gguf: GgufFormatArgs {
                quantize: Default::default(),
                outtype: a.outtype.clone().unwrap_or_else(|| "auto".into()),
                split_max_size: a.split_max_size.clone(),
                arch: a.arch.clone(),
                vocab_pre: a.vocab_pre.clone(),
            },
            job: a.job.clone(),
        };
        let options = WriteOptions::from_gguf_args(&g, arguments)?;
        return Ok(JobParts {
            command: "convert",
            source,
            steps: Vec::new(),
            options,
        });
    }
    let p = PassthroughArgs {
        input: input(),
        write: WriteArgs {
            output: a.outdir.clone(),
            max_shard_size: a.max_shard_size.clone(),
            sharded: false,
            allow_empty: false,
            job: a.job.clone(),
        },
        dtype: a.dtype.clone(),
        include: Vec::new(),
        exclude: Vec::new(),
        rename: Vec::new(),
        cast_ints: false,
    };
    Ok(JobParts {
        command: "convert",
        steps: passthrough_steps(&p)?,
        options: WriteOptions::from_args(&p.write, arguments)?,
        source,
    })
}

/// Options of one format given with the other: refused, not ignored.
fn refuse_other_formats_options(a: &ConvertArgs) -> Result<()> {
    let (other, given) = if a.format == "gguf" {
        let given = vec![
            ("--dtype", a.dtype.is_some()),
            ("--max-shard-size", a.max_shard_size.is_some()),
        ];
        ("safetensors", given)
    } else {
        let given = vec![
            ("--outtype", a.outtype.is_some()),
            ("--split-max-size", a.split_max_size.is_some()),
            ("--arch", a.arch.is_some()),
            ("--vocab-pre", a.vocab_pre.is_some()),
        ];
        ("gguf", given)
    };
    match given.iter().find(|(_, g)| *g) {
        Some((flag, _)) => Err(Error::Usage(format!(
            "{flag} applies to --format {other}, not --format {}",
            a.format
        ))),
        None => Ok(()),
    }
}

/// The GGUF file's name: a single-file input's stem (`model.pt` gives `model.gguf`), a folder's
/// (or an index file's folder's) name.
fn gguf_file_name(source: &Path) -> String {
    let name = source.file_name().unwrap_or_default().to_string_lossy();
    // Files that stand for a whole folder: an index, a DCP's metadata or one of its parts.
    let is_index = name.ends_with(".json") || name.ends_with(".distcp") || name == ".metadata";
    let named: PathBuf = if source.is_dir() || is_index {
        let dir = if source.is_dir() {
            source
        } else {
            source.parent().unwrap_or(Path::new("."))
        };
        let dir = if dir.as_os_str().is_empty() {
            Path::new(".")
        } else {
            dir
        };
        dir.canonicalize().unwrap_or_else(|_| dir.to_path_buf())
    } else {
        PathBuf::from(source.file_stem().unwrap_or_default())
    };
    let stem = named
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .filter(|n| !n.is_empty())
        .unwrap_or_else(|| "model".into());
    format!("{stem}.gguf")
}
