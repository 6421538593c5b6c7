//! Command implementations; `dispatch` turns parsed flags into validated requests once.

pub mod convert;
pub mod demo;
pub mod extract_lora;
pub mod info;
pub mod merge;
pub mod options;
pub mod run_sections;
pub mod selftest;
pub mod semantic;
pub mod steps;
pub mod validate;

use std::path::PathBuf;

use clap::{ArgMatches, FromArgMatches};

pub use run_sections::RunSections;

use std::sync::Arc;

use crate::cli::{Cli, Command, InputArgs};
use crate::error::{Error, Result};
use crate::job::{Job, WriteOptions};
use crate::ops::lora::AdapterSource;
use crate::pipeline::Cancel;
use crate::plan::Step;
pub use steps::passthrough_steps;
use steps::{dequant_step, lora_step, lora_step_from, merge_steps, renames, repack_step};

fn input_path(a: &InputArgs) -> Result<PathBuf> {
    flag_or_positional(&a.input, &a.model)
}

/// The input given as a flag (`-i`, `-b`, `--src`) or as the positional `MODEL`.
fn flag_or_positional(flag: &Option<PathBuf>, positional: &Option<PathBuf>) -> Result<PathBuf> {
    flag.clone()
        .or_else(|| positional.clone())
        .ok_or_else(|| Error::Usage("no input: give -i MODEL or MODEL".into()))
}

/// Arguments that do not change a run's output: where it reads and writes, how fast, what it
/// prints, and the part/resume flags themselves.
const ARGUMENTS_NOT_FINGERPRINTED: &[&str] = &[
    "input",
    "model",
    "src",
    "output",
    "outdir",
    "threads",
    "io_threads",
    "memory_budget",
    "quiet",
    "no_progress",
    "progress",
    "progress_interval",
    "verbose",
    "report",
    "force",
    "no_reflink",
    "device",
    "dry_run",
    "part",
    "resume",
    "finalize",
];

/// The subcommand and every argument that can change its output, one `id=values` per line in a
/// fixed order, as clap parsed them (defaults included): what parts and resumed runs must share.
pub fn arguments_text(matches: &ArgMatches, sections: &RunSections) -> String {
    let Some((name, sub)) = matches.subcommand() else {
        return String::new();
    };
    let mut ids: Vec<&str> = sub.ids().map(|i| i.as_str()).collect();
    ids.sort();
    let mut out = name.to_string();
    for id in ids {
        // Argument groups (named after the structs clap flattens, `RunOpts`) repeat their
        // members' values.
        if ARGUMENTS_NOT_FINGERPRINTED.contains(&id) || id.starts_with(char::is_uppercase) {
            continue;
        }
        if let Ok(Some(values)) = sub.try_get_raw(id) {
            let values: Vec<String> = values.map(|v| v.to_string_lossy().into_owned()).collect();
            out.push_str(&format!("\n{id}={values:?}"));
        }
    }
    out.push_str(&format!("\nsections={sections:?}"));
    out
}

/// Runs the command; returns the process exit code.
/// `sections` are `run`'s pipe sections, split off the raw arguments by
/// [`run_sections::split`] before clap parsed the rest into `matches`.
pub fn dispatch(matches: &ArgMatches, sections: &RunSections, cancel: &Cancel) -> Result<i32> {
    let cli = Cli::from_arg_matches(matches).map_err(|e| Error::Usage(e.to_string()))?;
    let arguments = arguments_text(matches, sections);
    match writing_job(&cli.command, sections, &arguments)? {
        Some(job) => {
            Job {
                command: job.command,
                source: &job.source,
                steps: &job.steps,
                options: &job.options,
            }
            .execute(cancel)?;
            // A dry run's plan is its result; a conversion's result is its output, which
            // lines that could not be printed do not change (the report notes them).
            if job.options.dry_run {
                crate::console::require_stdout()?;
            }
            Ok(0)
        }
        None => {
            let code = run_other(&cli.command, cancel)?;
            // `recover` and `finalize` change the output, which a lost line does not undo.
            if !matches!(cli.command, Command::Recover(_) | Command::Finalize(_)) {
                crate::console::require_stdout()?;
            }
            Ok(code)
        }
    }
}

/// What a writing command's job is made of.
struct JobParts {
    command: &'static str,
    source: PathBuf,
    steps: Vec<Step>,
    options: WriteOptions,
}

/// The job of a writing command (`None` for the others): its steps, then its options, then its
/// input, each refused in that order.
fn writing_job(
    command: &Command,
    sections: &RunSections,
    arguments: &str,
) -> Result<Option<JobParts>> {
    let job = |command, steps, options, source: &dyn Fn() -> Result<PathBuf>| {
        Ok(Some(JobParts {
            command,
            steps,
            options,
            source: source()?,
        }))
    };
    let opts = |w| WriteOptions::from_args(w, arguments);
    match command {
        Command::Passthrough(a) => job(
            "passthrough",
            passthrough_steps(a)?,
            opts(&a.write)?,
            &|| input_path(&a.input),
        ),
        Command::Run(a) => {
            let steps = sections.steps()?;
            let mut options = WriteOptions::from_args(&a.write, &sections.fingerprint(arguments)?)?;
            if let Some(gguf) = sections.gguf(&a.write.output)? {
                options.format = crate::job::Format::Gguf(gguf);
            }
            job("run", steps, options, &|| sections.source(&a.input))
        }
        Command::DequantFp8(a) => {
            let mut steps = vec![dequant_step(&a.dtype, &a.fp8)?];
            if let Some(adapter) = &a.merge_lora {
                steps.push(lora_step(adapter, &a.lora, a.fp8.allow_nonfinite)?);
            }
            job("dequant", steps, opts(&a.write)?, &|| input_path(&a.input))
        }
        Command::Quantize(a) => job(
            "quantize",
            quantize_steps(&a.quantize)?,
            opts(&a.write)?,
            &|| input_path(&a.input),
        ),
        Command::Merge(a) => {
            let m = merge::job(a, arguments)?;
            job("merge", m.steps, m.options, &|| Ok(m.source.clone()))
        }
        Command::MergeLora(a) => {
            let steps = renamed_merge(&a.rename, &a.adapter, &a.merge)?;
            job("merge-lora", steps, opts(&a.merge.write)?, &|| {
                input_path(&a.input)
            })
        }
        Command::MergeDcpLora(a) => {
            let steps = renamed_merge(&a.rename, &a.checkpoint_dir, &a.merge)?;
            job("merge-dcp-lora", steps, opts(&a.merge.write)?, &|| {
                input_path(&a.input)
            })
        }
        Command::MergeFsdpLora(a) => job(
            "merge-fsdp-lora",
            fsdp_merge_steps(a)?,
            opts(&a.merge.write)?,
            &|| input_path(&a.input),
        ),
        Command::RepackFp4(a) => job(
            "repack-fp4",
            vec![repack_step(&a.fp4)?],
            opts(&a.write)?,
            &|| flag_or_positional(&a.src, &a.model),
        ),
        Command::Convert(a) => Ok(Some(convert::job(a, arguments)?)),
        Command::Gguf(a) => job(
            "gguf",
            Vec::new(),
            WriteOptions::from_gguf_args(a, arguments)?,
            &|| input_path(&a.input),
        ),
        _ => Ok(None),
    }
}

/// A merge command's steps: its renames first (as in Python tftf, the adapter is matched
/// against the new names), then the merge of `adapter`.
fn renamed_merge(
    rename: &[String],
    adapter: &std::path::Path,
    merge: &crate::cli::MergeOutputArgs,
) -> Result<Vec<Step>> {
    let mut steps: Vec<Step> = renames(rename)?.into_iter().map(Step::Rename).collect();
    let step = lora_step(adapter, &merge.lora, merge.allow_nonfinite)?;
    steps.extend(merge_steps(step, merge)?);
    Ok(steps)
}

/// The quantisation step of `quantize` and of `run --quantize`.
pub(crate) fn quantize_steps(a: &crate::cli::QuantizeOptions) -> Result<Vec<Step>> {
    use crate::ops::quantize::{Format, IgnoreRule, QuantizeStep, Scheme};
    let scheme = Scheme::parse(&a.scheme)?;
    let ignore = a
        .ignore
        .iter()
        .map(|p| IgnoreRule::new(p))
        .collect::<Result<Vec<_>>>()?;
    let format = Format::parse(&a.format)?;
    let step = QuantizeStep::new(scheme, format, ignore, !a.no_default_ignore)?;
    Ok(vec![Step::Op(Arc::new(step))])
}

/// `merge-fsdp-lora`'s rank files: `--shard-dir`'s `*.safetensors` in name order, or the
/// files given.
/// `merge-fsdp-lora`'s steps: the merge of the adapter gathered from the rank files.
fn fsdp_merge_steps(a: &crate::cli::MergeFsdpArgs) -> Result<Vec<Step>> {
    let merge = lora_step_from(
        AdapterSource::Ranks(rank_files(a)?),
        &a.merge.lora,
        a.merge.allow_nonfinite,
    )?;
    merge_steps(merge, &a.merge)
}

fn rank_files(a: &crate::cli::MergeFsdpArgs) -> Result<Vec<PathBuf>> {
    let Some(dir) = &a.shard_dir else {
        return Ok(a.shards.clone());
    };
    let mut v: Vec<PathBuf> = std::fs::read_dir(dir)
        .map_err(|e| Error::io(dir, e))?
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
        .collect();
    v.sort();
    if v.is_empty() {
        return Err(Error::NoModel {
            path: dir.clone(),
            msg: "no *.safetensors rank files".into(),
        });
    }
    Ok(v)
}

/// The commands that write no model: inspection, checks, the part and commit helpers, demo.
fn run_other(command: &Command, cancel: &Cancel) -> Result<i32> {
    match command {
        Command::Info(a) => info::run(a, &input_path(&a.input)?).map(|_| 0),
        Command::Validate(a) => {
            let budget = crate::job::parse_budget(a.memory_budget.as_deref())?;
            let ok = validate::run(a, &input_path(&a.input)?, budget, cancel)?;
            Ok(if ok { 0 } else { 1 })
        }
        Command::Selftest(a) => selftest::run(a),
        Command::Recover(a) => {
            let notes = crate::output::recover(&a.dir)?;
            if notes.is_empty() {
                outln!("{}: nothing to recover", a.dir.display());
            }
            for n in notes {
                outln!("{}: {n}", a.dir.display());
            }
            Ok(0)
        }
        Command::Finalize(a) => {
            let f = crate::output::parts::finalize(&a.dir, a.force)?;
            if !a.quiet {
                crate::job::print_finalized(&a.dir, &f);
            }
            Ok(0)
        }
        Command::Verify(a) => verify(&a.dir),
        Command::Demo(a) => demo::run(a.keep.as_deref(), cancel).map(|_| 0),
        Command::ExtractLora(a) => extract_lora::run(a, cancel).map(|_| 0),
        _ => unreachable!("writing commands are jobs"),
    }
}

/// `tftf verify DIR`: 0 when every file matches the manifest.
fn verify(dir: &std::path::Path) -> Result<i32> {
    let v = crate::output::checksum::verify(dir)?;
    for p in &v.problems {
        outln!("{}: {p}", dir.display());
    }
    if !v.problems.is_empty() {
        return Ok(1);
    }
    outln!(
        "{}: {} file(s), {} match tftf-manifest.json",
        dir.display(),
        v.files,
        crate::size::human(v.bytes)
    );
    Ok(0)
}
