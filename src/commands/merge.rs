//! `tftf merge`: a mergekit YAML config (or the short LoRA form) turned into a job. The donor
//! model (the base, else the first model) is the job's source; the merge step attaches the
//! other models to it.

use std::path::PathBuf;
use std::sync::Arc;

use crate::cli::{AdapterOpts, MergeKitArgs, MergeOutputArgs, RequantArgs, WriteArgs};
use crate::error::{Error, Result};
use crate::job::{Format, WriteOptions};
use crate::ops::merge::{MergeConfig, MergeStep};
use crate::plan::Step;
use crate::size::parse_size;

use super::steps::{lora_step, merge_steps};

/// mergekit's default `--out-shard-size`.
const DEFAULT_SHARD_SIZE: &str = "5B";

/// What `tftf merge` runs: its source, steps and options.
pub(crate) struct MergeJob {
    pub source: PathBuf,
    pub steps: Vec<Step>,
    pub options: WriteOptions,
}

/// `tftf merge CONFIG OUT` or `tftf merge --weights BASE --lora ADAPTER --alpha A -o OUT`.
pub(crate) fn job(a: &MergeKitArgs, arguments: &str) -> Result<MergeJob> {
    let output = a.out.clone().or_else(|| a.output.clone()).ok_or_else(|| {
        Error::Usage("no output: give `tftf merge CONFIG.yml OUT` or -o OUT".into())
    })?;
    let gguf = output.extension().is_some_and(|e| e == "gguf");
    if !gguf && a.gguf.given() {
        return Err(Error::Usage(format!(
            "--outtype, --imatrix, --arch, --vocab-pre and the other GGUF options apply to a GGUF output: name it OUT.gguf (not {})",
            output.display()
        )));
    }
    if gguf && a.out_shard_size.is_some() {
        return Err(Error::Usage(
            "--out-shard-size cuts safetensors shards: a GGUF output is split with --split-max-size".into(),
        ));
    }
    let format = match gguf {
        true => Some(Format::Gguf(super::options::gguf_options(
            &a.gguf, &output,
        )?)),
        false => None,
    };
    let shard = match (&a.out_shard_size, &a.weights) {
        (Some(s), _) => Some(shard_bytes(s)?.to_string()),
        (None, Some(_)) => None,
        (None, None) => Some(shard_bytes(DEFAULT_SHARD_SIZE)?.to_string()),
    };
    let write = WriteArgs {
        output,
        max_shard_size: shard,
        sharded: false,
        allow_empty: false,
        job: a.job.clone(),
    };
    let mut job = merge_job(a, write, arguments)?;
    if let Some(format) = format {
        job.options.format = format;
    }
    Ok(job)
}

/// The merge job of `a`, written as `write` says.
fn merge_job(a: &MergeKitArgs, write: WriteArgs, arguments: &str) -> Result<MergeJob> {
    if let (Some(base), Some(adapter)) = (&a.weights, &a.lora) {
        return lora_job(base, adapter, a.alpha, write, arguments);
    }
    let path = a.config.as_ref().ok_or_else(|| {
        Error::Usage("give the mergekit config: tftf merge CONFIG.yml OUT".into())
    })?;
    let (step, source) = config_step(path, a.allow_crimes, !a.no_copy_tokenizer, a.random_seed)?;
    let arguments = with_config_text(arguments, path)?;
    Ok(MergeJob {
        source,
        steps: vec![step],
        options: WriteOptions::from_args(&write, &arguments)?,
    })
}

/// The merge step of mergekit config `path` and its donor model (the job's source): what
/// `tftf merge CONFIG` and `run --merge CONFIG` run.
pub(crate) fn config_step(
    path: &std::path::Path,
    allow_crimes: bool,
    copy_tokenizer: bool,
    seed: u64,
) -> Result<(Step, PathBuf)> {
    let config = MergeConfig::read(path)?;
    let source = config.donor().to_path_buf();
    let step = MergeStep::new(config, allow_crimes, copy_tokenizer, seed);
    Ok((Step::Op(Arc::new(step)), source))
}

/// `arguments` with the contents of config `path`: parts and resumed runs must share the
/// config's contents, not only its path.
pub(crate) fn with_config_text(arguments: &str, path: &std::path::Path) -> Result<String> {
    let text = std::fs::read_to_string(path).map_err(|e| Error::io(path, e))?;
    Ok(format!("{arguments}\nmerge_config={text:?}"))
}

/// The short form: `merge-lora BASE -a ADAPTER --scale ALPHA`.
fn lora_job(
    base: &std::path::Path,
    adapter: &std::path::Path,
    alpha: f64,
    write: WriteArgs,
    arguments: &str,
) -> Result<MergeJob> {
    let m = MergeOutputArgs {
        write,
        lora: AdapterOpts {
            scale: alpha,
            adapter_config: None,
            adapter_name: "default".into(),
            allow_unmatched: false,
            rank: None,
            lora_alpha: None,
        },
        requant_args: RequantArgs::default(),
        dtype: None,
        allow_nonfinite: false,
    };
    let steps = merge_steps(lora_step(adapter, &m.lora, false)?, &m)?;
    Ok(MergeJob {
        source: base.to_path_buf(),
        steps,
        options: WriteOptions::from_args(&m.write, arguments)?,
    })
}

/// mergekit's shard sizes (`5B`, `500M`, `100K`: powers of 1000), else tftf's (`5GB`, `5GiB`,
/// bytes).
fn shard_bytes(s: &str) -> Result<u64> {
    let t = s.trim();
    let (digits, factor) = match t.chars().last() {
        Some('K') => (&t[..t.len() - 1], 1e3),
        Some('M') => (&t[..t.len() - 1], 1e6),
        Some('B') if t[..t.len() - 1].parse::<f64>().is_ok() => (&t[..t.len() - 1], 1e9),
        _ => return Ok(parse_size(t)?),
    };
    match digits.parse::<f64>() {
        Ok(x) if x > 0.0 && (x * factor).is_finite() => Ok((x * factor) as u64),
        _ => Err(Error::Usage(format!(
            "--out-shard-size {s}: give a size such as 5B, 500M, 5GB or 5GiB"
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shard_sizes_read_as_mergekit_and_tftf_write_them() {
        assert_eq!(shard_bytes("5B").unwrap(), 5_000_000_000);
        assert_eq!(shard_bytes("500M").unwrap(), 500_000_000);
        assert_eq!(shard_bytes("1GiB").unwrap(), 1 << 30);
        assert!(shard_bytes("-1M").is_err());
    }
}
