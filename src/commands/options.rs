//! Command-line options turned once into a job's options: threads, memory budget, progress,
//! the output policy and the sink's format.

use std::path::Path;

use crate::cli::{GgufArgs, GgufFormatArgs, JobArgs, RunOpts, WriteArgs};
use crate::error::{Error, Result};
use crate::gpu::DeviceRequest;
use crate::job::{parse_budget, Format, WriteOptions};
use crate::output::parts::PartSpec;
use crate::progress::Mode as ProgressMode;
use crate::sink::gguf::imatrix;
use crate::sink::gguf::layout;
use crate::sink::gguf::quant_mix::{self, MixOptions};
use crate::sink::gguf::{FileType, GgmlType, GgufSinkOptions};
use crate::size::parse_size;

impl RunOpts {
    /// `--threads`, all cores by default.
    pub fn thread_count(&self) -> Result<usize> {
        match self.threads {
            Some(0) => Err(Error::Usage("--threads must be at least 1".into())),
            Some(n) => Ok(n),
            None => Ok(std::thread::available_parallelism().map_or(1, |n| n.get())),
        }
    }

    /// `--io-threads`: `None` for auto.
    pub fn io_thread_count(&self) -> Result<Option<usize>> {
        match self.io_threads.as_str() {
            "auto" => Ok(None),
            s => match s.parse::<usize>() {
                Ok(n) if n >= 1 => Ok(Some(n)),
                _ => Err(Error::Usage(format!(
                    "--io-threads {s}: use auto or a number of at least 1"
                ))),
            },
        }
    }

    pub fn budget(&self) -> Result<u64> {
        parse_budget(self.memory_budget.as_deref())
    }

    pub fn progress_mode(&self) -> Result<ProgressMode> {
        crate::progress::parse_mode(self.progress.as_deref(), self.no_progress, self.quiet)
    }

    pub fn progress_interval(&self) -> Result<std::time::Duration> {
        crate::progress::parse_interval(self.progress_interval.as_deref())
    }
}

impl WriteOptions {
    /// `arguments`: the command and its output-relevant arguments ([`super::arguments_text`]),
    /// which a partitioned or resumed run's fingerprint includes.
    pub fn from_args(w: &WriteArgs, arguments: &str) -> Result<WriteOptions> {
        let mut opts = WriteOptions::common(&w.output, &w.job, arguments)?;
        opts.allow_empty = w.allow_empty;
        opts.format = Format::Safetensors {
            max_shard_bytes: w.max_shard_size.as_deref().map(parse_size).transpose()?,
        };
        Ok(opts)
    }

    /// Options of `tftf gguf`: the same policy, a GGUF sink.
    pub fn from_gguf_args(a: &GgufArgs, arguments: &str) -> Result<WriteOptions> {
        let mut opts = WriteOptions::common(&a.output, &a.job, arguments)?;
        opts.format = Format::Gguf(gguf_options(&a.gguf, &a.output)?);
        Ok(opts)
    }

    /// The options every writing command shares, from its output and [`JobArgs`].
    fn common(output: &Path, job: &JobArgs, arguments: &str) -> Result<WriteOptions> {
        let (r, p) = (&job.run, &job.policy);
        if p.finalize && p.part.is_none() {
            return Err(Error::Usage(
                "--finalize goes with --part K/N (a --resume run without --part finalizes by itself)".into(),
            ));
        }
        Ok(WriteOptions {
            output: output.to_path_buf(),
            format: Format::Safetensors {
                max_shard_bytes: None,
            },
            dry_run: r.dry_run,
            threads: r.thread_count()?,
            io_threads: r.io_thread_count()?,
            memory_budget: r.budget()?,
            quiet: r.quiet,
            silent: false,
            progress: r.progress_mode()?,
            on_progress: None,
            progress_interval: r.progress_interval()?,
            verbose: r.verbose,
            allow_empty: false,
            report: r.report.clone(),
            force: job.force,
            kernel_copy: !job.no_reflink,
            device: DeviceRequest::parse(&job.device)?,
            checksums: match p.checksums.as_deref() {
                None => None,
                Some("on") => Some(true),
                Some("off") => Some(false),
                Some(other) => {
                    return Err(Error::Usage(format!(
                        "--checksums={other}: use --checksums, --checksums=on or --checksums=off"
                    )))
                }
            },
            part: p.part.as_deref().map(PartSpec::parse).transpose()?,
            resume: p.resume,
            finalize: p.finalize,
            arguments: arguments.to_string(),
        })
    }
}

/// The GGUF sink's options from the command line.
pub fn gguf_options(a: &GgufFormatArgs, output: &Path) -> Result<GgufSinkOptions> {
    let split_max_bytes = match &a.split_max_size {
        None => 0,
        Some(s) => match layout::parse_split_size(s) {
            Some(0) | None => {
                return Err(Error::Usage(format!(
                    "--split-max-size `{s}`: give a positive number of bytes, optionally with K, M or G (powers of 1000)"
                )))
            }
            Some(n) => n,
        },
    };
    let Some(file_name) = output.file_name() else {
        return Err(Error::Usage(format!(
            "-o {}: name the output file (OUT.gguf)",
            output.display()
        )));
    };
    Ok(GgufSinkOptions {
        file_name: file_name.to_string_lossy().into_owned(),
        file_type: match a.outtype.as_str() {
            "auto" => None,
            t => Some(FileType::parse(t).ok_or_else(|| {
                Error::Usage(format!(
                    "--outtype `{t}`: use auto, f32, f16, bf16, q8_0 or a llama-quantize type (q4_0, q4_k_m, q6_k, iq4_xs … see --help)"
                ))
            })?),
        },
        split_max_bytes,
        arch: a.arch.clone(),
        vocab_pre: a.vocab_pre.clone(),
        mix: mix_options(a)?,
    })
}

/// llama-quantize's options, refused unless `--outtype` is a llama-quantize type.
fn mix_options(a: &GgufFormatArgs) -> Result<MixOptions> {
    let q = &a.quantize;
    let ggml = |flag: &str, v: &Option<String>| {
        v.as_deref()
            .map(|t| {
                GgmlType::parse(t).ok_or_else(|| {
                    Error::Usage(format!("{flag} `{t}`: not a ggml type (q8_0, q6_k, f16 …)"))
                })
            })
            .transpose()
    };
    let opts = MixOptions {
        leave_output: q.leave_output_tensor,
        output_type: ggml("--output-tensor-type", &q.output_tensor_type)?,
        token_embedding_type: ggml("--token-embedding-type", &q.token_embedding_type)?,
        tensor_types: q
            .tensor_type
            .iter()
            .map(|t| quant_mix::parse_tensor_type(t).map_err(Error::Usage))
            .collect::<Result<_>>()?,
        pure: q.pure,
        has_imatrix: false,
        imatrix: None,
    };
    let any = opts.leave_output
        || opts.output_type.is_some()
        || opts.token_embedding_type.is_some()
        || !opts.tensor_types.is_empty()
        || opts.pure
        || q.imatrix.is_some();
    let is_mix = matches!(FileType::parse(&a.outtype), Some(FileType::Quant(_)));
    if any && !is_mix {
        return Err(Error::Usage(format!(
            "--outtype {}: --leave-output-tensor, --output-tensor-type, --token-embedding-type, --tensor-type, --pure and --imatrix apply to llama-quantize types (q4_0 … q6_k, iq4_xs …)",
            a.outtype
        )));
    }
    with_imatrix(opts, q)
}

/// `--imatrix FILE` read and filtered by `--include-weights`/`--exclude-weights`; an imatrix
/// they leave empty is none, as llama-quantize treats it.
fn with_imatrix(mut opts: MixOptions, q: &crate::cli::GgufQuantizeArgs) -> Result<MixOptions> {
    let Some(path) = &q.imatrix else {
        if !q.include_weights.is_empty() || !q.exclude_weights.is_empty() {
            return Err(Error::Usage(
                "--include-weights and --exclude-weights select entries of --imatrix FILE; give one".into(),
            ));
        }
        return Ok(opts);
    };
    let m = imatrix::load(path, &q.include_weights, &q.exclude_weights)?;
    opts.has_imatrix = !m.entries.is_empty();
    opts.imatrix = Some(std::sync::Arc::new(m));
    Ok(opts)
}
