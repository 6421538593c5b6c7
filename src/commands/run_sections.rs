//! `run`'s pipe-section grammar, as Python tftf parses it: a section flag (`--key-filter`,
//! `--merge-lora`, …) opens a section, and the options and bare values after it belong to that
//! section until the next section flag. So `--key-filter --include G --exclude H`,
//! `--key-filter G1 G2`, `--key-rename P R P R`, `--merge-lora --adapter P --scale S` and
//! `--dtype-cast --dtype bf16` all work, and two `--merge-lora` sections can carry different
//! options.
//!
//! clap cannot express sections, so the raw arguments are split here first: `run`'s global
//! options (`-i`, `-o`, `--force`, …, whatever `RunArgs` declares) go to clap wherever they
//! stand, and each section's tokens are parsed by clap against that section's own struct
//! (`cli::KeyFilterSection`, …). A section option written before the first section, or inside a
//! section of another kind, is a default for every section of its kind: that keeps the older
//! form (`--merge-lora A --dequant-fp8 --scale 2`, options global to `run`) working.

use std::collections::HashMap;
use std::ffi::{OsStr, OsString};
use std::path::{Path, PathBuf};

use clap::{Args, Command, FromArgMatches};

use super::steps::{
    cast_target, dequant_step, globs, lora_step, renames, repack_step, requant_step,
};
use crate::cli::{
    DequantSection, DtypeCastSection, GgufFormatArgs, InputArgs, KeyExcludeSection,
    KeyFilterSection, KeyRenameSection, MergeKitSection, MergeSection, QuantizeSection,
    RepackSection,
};
use crate::error::{Error, Result};
use crate::format::dtype::DType;
use crate::plan::Step;
use crate::sink::gguf::GgufSinkOptions;

/// The section flags, in the order `--help` lists them.
const KINDS: [&str; 10] = [
    "--key-filter",
    "--key-exclude",
    "--key-rename",
    "--dtype-cast",
    "--dequant-fp8",
    "--merge-lora",
    "--repack-fp4",
    "--quantize",
    "--merge",
    "--gguf",
];

/// Options that name what a section does; they are never borrowed as defaults by another
/// section's kind.
const OWN_OPTIONS: [&str; 6] = ["dtype", "include", "exclude", "rule", "adapter", "config"];

/// `run`'s sections, split from the raw arguments but not yet parsed.
#[derive(Debug, Default, Clone)]
pub struct RunSections {
    /// Each section: its flag and its tokens.
    sections: Vec<(&'static str, Vec<OsString>)>,
    /// Per section flag: option tokens given outside a section of that kind.
    defaults: HashMap<&'static str, Vec<OsString>>,
}

fn section_command(kind: &'static str) -> Command {
    let cmd = Command::new(kind)
        .no_binary_name(true)
        .args_override_self(true)
        .disable_help_flag(true)
        .disable_version_flag(true);
    let mut cmd = match kind {
        "--key-filter" => KeyFilterSection::augment_args(cmd),
        "--key-exclude" => KeyExcludeSection::augment_args(cmd),
        "--key-rename" => KeyRenameSection::augment_args(cmd),
        "--dtype-cast" => DtypeCastSection::augment_args(cmd),
        "--dequant-fp8" => DequantSection::augment_args(cmd),
        "--merge-lora" => MergeSection::augment_args(cmd),
        "--quantize" => QuantizeSection::augment_args(cmd),
        "--merge" => MergeKitSection::augment_args(cmd),
        "--gguf" => GgufFormatArgs::augment_args(cmd),
        _ => RepackSection::augment_args(cmd),
    };
    cmd.build();
    cmd
}

/// How many values option `long` (without dashes) takes in `cmd`, when `cmd` has it.
fn arity(cmd: &Command, long: &str, own_allowed: bool) -> Option<usize> {
    let arg = cmd.get_arguments().find(|a| {
        a.get_long() == Some(long) || a.get_all_aliases().is_some_and(|v| v.contains(&long))
    })?;
    if !own_allowed && OWN_OPTIONS.contains(&arg.get_id().as_str()) {
        return None;
    }
    Some(if arg.get_action().takes_values() {
        arg.get_num_args().map_or(1, |r| r.min_values())
    } else {
        0
    })
}

/// `--name=value` → (`name`, true); `--name` → (`name`, false).
fn long_name(token: &str) -> Option<(&str, bool)> {
    let rest = token.strip_prefix("--").filter(|r| !r.is_empty())?;
    Some(match rest.split_once('=') {
        Some((n, _)) => (n, true),
        None => (rest, false),
    })
}

/// Splits `run`'s raw arguments (everything after the program name) into what clap parses
/// (the program name, `run` and the global options, with the positional `MODEL` when it comes
/// before any section) and the sections. Other commands' arguments pass through untouched.
pub fn split(args: Vec<OsString>) -> (Vec<OsString>, RunSections) {
    if args.get(1).map(OsString::as_os_str) != Some(OsStr::new("run")) {
        return (args, RunSections::default());
    }
    let mut splitter = Splitter::new(&args);
    while splitter.i < args.len() {
        splitter.route_next();
    }
    (splitter.clap_args, splitter.out)
}

/// [`split`]'s walk over `run`'s arguments: where each token goes.
struct Splitter<'a> {
    args: &'a [OsString],
    /// `run`'s global options, for their arity.
    run: Command,
    /// Each section kind's options, for their arity.
    commands: Vec<(&'static str, Command)>,
    clap_args: Vec<OsString>,
    out: RunSections,
    /// The section being filled, an index into `out.sections`.
    current: Option<usize>,
    /// The next token.
    i: usize,
}

impl<'a> Splitter<'a> {
    fn new(args: &'a [OsString]) -> Self {
        let mut run = crate::cli::RunArgs::augment_args(Command::new("run"));
        run.build();
        Splitter {
            args,
            run,
            commands: KINDS.iter().map(|k| (*k, section_command(k))).collect(),
            clap_args: args[..2].to_vec(),
            out: RunSections::default(),
            current: None,
            i: 2,
        }
    }

    /// Routes the token at `i`, with the values it takes, and moves past them.
    fn route_next(&mut self) {
        let args = self.args;
        let Some(token) = args[self.i].to_str() else {
            // Not UTF-8: a value (a path), never an option.
            self.push_value();
            return;
        };
        if self.open_section(token) {
            return;
        }
        if matches!(token, "-h" | "--help" | "-V" | "--version") {
            self.clap_args.push(args[self.i].clone());
            self.i += 1;
            return;
        }
        let routed = match long_name(token) {
            Some((name, inline)) => self.long_option(name, inline),
            None => self.short_option(token),
        };
        if !routed {
            // A bare value, or an option no one knows: the section's parser names it, or
            // before any section clap does (the input `MODEL`, or Python tftf's "Unexpected
            // token").
            self.push_value();
        }
    }

    /// The token at `i` goes to the current section, or to clap before any section.
    fn push_value(&mut self) {
        let token = self.args[self.i].clone();
        match self.current {
            Some(c) => self.out.sections[c].1.push(token),
            None => self.clap_args.push(token),
        }
        self.i += 1;
    }

    /// `--dtype-cast bf16`, or clap's `--dtype-cast=bf16` of the older grammar: a section
    /// flag opens a section.
    fn open_section(&mut self, token: &str) -> bool {
        let (flag, inline_value) = token.split_once('=').unwrap_or((token, ""));
        let Some(kind) = KINDS.iter().find(|k| **k == flag) else {
            return false;
        };
        let values = if flag == token {
            Vec::new()
        } else {
            vec![OsString::from(inline_value)]
        };
        self.out.sections.push((*kind, values));
        self.current = Some(self.out.sections.len() - 1);
        self.i += 1;
        true
    }

    /// A long option goes to the current section when it is one of that section's own, else
    /// to clap when `run` has it, else it is a default for every section kind that has it.
    fn long_option(&mut self, name: &str, inline: bool) -> bool {
        let values = |n: usize| if inline { 0 } else { n };
        // The current section's own options first: `--dtype` inside `--dtype-cast`.
        if let Some(c) = self.current {
            let kind = self.out.sections[c].0;
            let cmd = &self
                .commands
                .iter()
                .find(|(k, _)| *k == kind)
                .expect("known")
                .1;
            if let Some(n) = arity(cmd, name, true) {
                let tokens = self.take(values(n));
                self.out.sections[c].1.extend(tokens);
                return true;
            }
        }
        if let Some(n) = arity(&self.run, name, true) {
            let tokens = self.take(values(n));
            self.clap_args.extend(tokens);
            return true;
        }
        let lenders: Vec<(&'static str, usize)> = self
            .commands
            .iter()
            .filter_map(|(k, cmd)| Some((*k, arity(cmd, name, false)?)))
            .collect();
        let Some(&(_, n)) = lenders.first() else {
            return false;
        };
        let tokens = self.take(values(n));
        for (k, _) in lenders {
            self.out
                .defaults
                .entry(k)
                .or_default()
                .extend(tokens.clone());
        }
        true
    }

    /// A short option of `run` (`-i`, `-o`, or `-iPATH` with its value attached) goes to clap.
    fn short_option(&mut self, token: &str) -> bool {
        let Some(c) = token
            .strip_prefix('-')
            .and_then(|r| r.chars().next())
            .filter(|c| *c != '-')
        else {
            return false;
        };
        let Some(n) = self
            .run
            .get_arguments()
            .find(|a| {
                a.get_short() == Some(c)
                    || a.get_all_short_aliases().is_some_and(|v| v.contains(&c))
            })
            .map(|a| usize::from(a.get_action().takes_values()))
        else {
            return false;
        };
        let tokens = self.take(if token.len() > 2 { 0 } else { n });
        self.clap_args.extend(tokens);
        true
    }

    /// The option at `i` and up to `n` values after it; as in Python tftf, a token starting
    /// with `--` is never a value (so `--dtype --key-filter` leaves `--dtype` without one).
    fn take(&mut self, n: usize) -> Vec<OsString> {
        let mut tokens = vec![self.args[self.i].clone()];
        self.i += 1;
        for _ in 0..n {
            match self.args.get(self.i) {
                Some(v) if !v.to_str().is_some_and(|t| t.starts_with("--")) => {
                    tokens.push(v.clone());
                    self.i += 1;
                }
                _ => break,
            }
        }
        tokens
    }
}

impl RunSections {
    /// Appends section `kind` (a section flag, `--merge-lora`) with its `tokens` as a command
    /// line would give them: how the library's `Pipe` (the library API) builds `run`'s chain.
    pub(crate) fn push(&mut self, kind: &'static str, tokens: Vec<OsString>) {
        debug_assert!(KINDS.contains(&kind), "{kind} is a section flag");
        self.sections.push((kind, tokens));
    }

    /// How many sections there are.
    pub(crate) fn len(&self) -> usize {
        self.sections.len()
    }

    /// Appends `other`'s sections after these.
    pub(crate) fn append(&mut self, other: RunSections) {
        self.sections.extend(other.sections);
    }

    /// The steps, in the order the sections were written.
    pub fn steps(&self) -> Result<Vec<Step>> {
        let mut steps = Vec::new();
        // The FP8 and FP4 ops write BF16, F16 or F32 only: a later float64 cast of their
        // outputs is refused up front.
        let mut fp_op_before = false;
        // A merge requantises a quantised base by default only when nothing else changes
        // the weights' form: no dequant or repack before it, no cast anywhere.
        let any_cast = self.sections.iter().any(|(k, _)| *k == "--dtype-cast");
        if self.sections.iter().any(|(k, _)| *k == "--gguf") {
            self.refuse_quantised_for_gguf()?;
        }
        for (kind, tokens) in &self.sections {
            let m = self.parse(kind, tokens)?;
            match *kind {
                "--key-filter" => steps.extend(key_filter_steps(kind, &m)?),
                "--key-exclude" => steps.push(key_exclude_step(kind, &m)?),
                "--key-rename" => steps.extend(key_rename_steps(kind, &m)?),
                "--dtype-cast" => steps.push(dtype_cast_step(kind, &m, fp_op_before)?),
                "--dequant-fp8" => {
                    let s = DequantSection::from_arg_matches(&m).map_err(clap_usage(kind))?;
                    let d = s.dtype.or(s.value).unwrap_or_else(|| "bf16".into());
                    steps.push(dequant_step(&d, &s.fp8).map_err(|e| usage(kind, e))?);
                    fp_op_before = true;
                }
                "--merge-lora" => steps.push(merge_step(kind, &m, fp_op_before, any_cast)?),
                "--quantize" => steps.extend(self.quantize_steps(kind, &m)?),
                "--merge" => steps.push(self.merge_step(kind, &m)?),
                "--gguf" => {
                    self.gguf_section(kind, &m)?;
                }
                _ => {
                    let s = RepackSection::from_arg_matches(&m).map_err(clap_usage(kind))?;
                    steps.push(repack_step(&s.fp4).map_err(|e| usage(kind, e))?);
                    fp_op_before = true;
                }
            }
        }
        Ok(steps)
    }

    /// `--quantize`'s step, which must come last: a later section would see quantised
    /// tensors and their scales.
    fn quantize_steps(&self, kind: &'static str, m: &clap::ArgMatches) -> Result<Vec<Step>> {
        let count = self.sections.iter().filter(|s| s.0 == kind).count();
        if count > 1 || self.sections.last().map(|s| s.0) != Some(kind) {
            return Err(Error::Usage(format!(
                "{kind} must be the last section, and the only one (a later section would see quantised tensors)"
            )));
        }
        let s = QuantizeSection::from_arg_matches(m).map_err(clap_usage(kind))?;
        super::quantize_steps(&s.quantize).map_err(|e| usage(kind, e))
    }

    /// `--gguf`'s options, checked: the section comes last, once. ([`RunSections::steps`]
    /// refuses the quantising sections before it first, ahead of their own checks.)
    fn gguf_section(&self, kind: &'static str, m: &clap::ArgMatches) -> Result<GgufFormatArgs> {
        let count = self.sections.iter().filter(|s| s.0 == kind).count();
        if count > 1 || self.sections.last().map(|s| s.0) != Some(kind) {
            return Err(usage(
                kind,
                "must be the last section, and the only one (it names the output's format)",
            ));
        }
        GgufFormatArgs::from_arg_matches(m).map_err(clap_usage(kind))
    }

    /// Refuses sections whose quantised tensors a GGUF output cannot take (its own types
    /// quantise the weights they are given).
    pub(crate) fn refuse_quantised_for_gguf(&self) -> Result<()> {
        match (self.sections.iter()).find(|s| matches!(s.0, "--quantize" | "--repack-fp4")) {
            Some((kind, _)) => Err(usage(
                kind,
                "writes quantised tensors, which GGUF output does not take: give the GGUF type instead (--outtype q8_0, q4_k_m …)",
            )),
            None => Ok(()),
        }
    }

    /// The GGUF output the `--gguf` section asks for, written to `output` (after
    /// [`RunSections::steps`] has checked the sections).
    pub(crate) fn gguf(&self, output: &Path) -> Result<Option<GgufSinkOptions>> {
        let Some((kind, tokens)) = self.sections.iter().find(|s| s.0 == "--gguf") else {
            return Ok(None);
        };
        let m = self.parse(kind, tokens)?;
        let a = self.gguf_section(kind, &m)?;
        let opts = super::options::gguf_options(&a, output).map_err(|e| match e {
            Error::Usage(msg) => usage(kind, msg),
            e => e,
        })?;
        Ok(Some(opts))
    }

    /// `--merge`'s config file; the section must come first, as the config's donor model is
    /// the run's input.
    fn merge_path(&self, kind: &'static str, m: &clap::ArgMatches) -> Result<PathBuf> {
        if self.sections.iter().position(|s| s.0 == kind) != Some(0)
            || self.sections.iter().filter(|s| s.0 == kind).count() > 1
        {
            return Err(usage(
                kind,
                "must be the first section, and the only one (the merge's models are the run's input)",
            ));
        }
        let s = MergeKitSection::from_arg_matches(m).map_err(clap_usage(kind))?;
        s.config
            .or(s.value)
            .ok_or_else(|| usage(kind, "requires CONFIG (or --config CONFIG)"))
    }

    /// `--merge`'s step.
    fn merge_step(&self, kind: &'static str, m: &clap::ArgMatches) -> Result<Step> {
        let path = self.merge_path(kind, m)?;
        let s = MergeKitSection::from_arg_matches(m).map_err(clap_usage(kind))?;
        let copy_tokenizer = !s.no_copy_tokenizer;
        let (step, _) =
            super::merge::config_step(&path, s.allow_crimes, copy_tokenizer, s.random_seed)?;
        Ok(step)
    }

    /// The `--merge` section's config file, when there is one.
    fn merge_config(&self) -> Result<Option<PathBuf>> {
        let Some((kind, tokens)) = self.sections.iter().find(|s| s.0 == "--merge") else {
            return Ok(None);
        };
        let m = self.parse(kind, tokens)?;
        self.merge_path(kind, &m).map(Some)
    }

    /// `arguments` with `--merge`'s config contents, which parts and resumed runs must share.
    pub(crate) fn fingerprint(&self, arguments: &str) -> Result<String> {
        match self.merge_config()? {
            Some(path) => super::merge::with_config_text(arguments, &path),
            None => Ok(arguments.to_string()),
        }
    }

    /// The run's input: `-i MODEL`, or with `--merge CONFIG` the config's donor model (the
    /// base, else the first model), refused beside `-i`.
    pub(crate) fn source(&self, input: &InputArgs) -> Result<PathBuf> {
        let Some(path) = self.merge_config()? else {
            return super::input_path(input);
        };
        if input.input.is_some() || input.model.is_some() {
            return Err(usage(
                "--merge",
                "the merge reads its models from CONFIG: drop -i MODEL",
            ));
        }
        Ok(crate::ops::merge::MergeConfig::read(&path)?
            .donor()
            .to_path_buf())
    }

    fn parse(&self, kind: &'static str, tokens: &[OsString]) -> Result<clap::ArgMatches> {
        let cmd = section_command(kind);
        let all: Vec<OsString> = self
            .defaults
            .get(kind)
            .into_iter()
            .flatten()
            .chain(tokens)
            .cloned()
            .collect();
        cmd.clone().try_get_matches_from(all).map_err(|e| {
            let first = e
                .render()
                .to_string()
                .lines()
                .next()
                .unwrap_or_default()
                .trim_start_matches("error: ")
                .to_string();
            let valid: Vec<String> = cmd
                .get_arguments()
                .filter_map(|a| a.get_long().map(|l| format!("--{l}")))
                .collect();
            Error::Usage(format!(
                "{kind}: {first}; valid options: {}",
                if valid.is_empty() {
                    "(none)".into()
                } else {
                    valid.join(", ")
                }
            ))
        })
    }
}

fn clap_usage(kind: &'static str) -> impl Fn(clap::Error) -> Error {
    move |e| usage(kind, e)
}

/// A usage error in a section: `--merge-lora: requires …`.
fn usage(kind: &str, msg: impl std::fmt::Display) -> Error {
    Error::Usage(format!("{kind}: {msg}"))
}

fn key_filter_steps(kind: &'static str, m: &clap::ArgMatches) -> Result<Vec<Step>> {
    let s = KeyFilterSection::from_arg_matches(m).map_err(clap_usage(kind))?;
    let include: Vec<String> = s.include.into_iter().chain(s.value).collect();
    if include.is_empty() && s.exclude.is_empty() {
        return Err(usage(
            kind,
            "give a glob (or --include GLOB / --exclude GLOB)",
        ));
    }
    let mut steps = Vec::new();
    if !include.is_empty() {
        steps.push(Step::Include(globs(&include)?));
    }
    if !s.exclude.is_empty() {
        steps.push(Step::Exclude(globs(&s.exclude)?));
    }
    Ok(steps)
}

fn key_exclude_step(kind: &'static str, m: &clap::ArgMatches) -> Result<Step> {
    let s = KeyExcludeSection::from_arg_matches(m).map_err(clap_usage(kind))?;
    let list: Vec<String> = s.exclude.into_iter().chain(s.value).collect();
    if list.is_empty() {
        return Err(usage(kind, "give a glob"));
    }
    Ok(Step::Exclude(globs(&list)?))
}

fn key_rename_steps(kind: &'static str, m: &clap::ArgMatches) -> Result<Vec<Step>> {
    let s = KeyRenameSection::from_arg_matches(m).map_err(clap_usage(kind))?;
    if s.value.len() % 2 == 1 {
        return Err(usage(
            kind,
            format!(
                "rules are REGEX REPL pairs; `{}` has no replacement",
                s.value[s.value.len() - 1]
            ),
        ));
    }
    let rules: Vec<String> = s.rule.into_iter().chain(s.value).collect();
    if rules.is_empty() {
        return Err(usage(
            kind,
            "give a rule: REGEX REPL (or --rule REGEX REPL)",
        ));
    }
    Ok(renames(&rules)?.into_iter().map(Step::Rename).collect())
}

/// `fp_op_before`: a dequant or repack section comes earlier (its outputs are never F64).
fn dtype_cast_step(kind: &'static str, m: &clap::ArgMatches, fp_op_before: bool) -> Result<Step> {
    let s = DtypeCastSection::from_arg_matches(m).map_err(clap_usage(kind))?;
    let d = s
        .dtype
        .or(s.value)
        .ok_or_else(|| usage(kind, "requires --dtype DTYPE (or a bare DTYPE)"))?;
    let dtype = cast_target(&d).map_err(|e| usage(kind, e))?;
    if dtype == DType::F64 && fp_op_before {
        return Err(usage(
            kind,
            "float64 after --dequant-fp8 or --repack-fp4 is not supported: those ops write bf16, f16 or f32 (dequantise to f32)",
        ));
    }
    Ok(Step::Cast {
        dtype,
        cast_ints: s.cast_ints,
    })
}

/// `fp_op_before`: a dequant or repack section comes earlier, so the base is no longer
/// quantised; `any_cast`: some section casts.
fn merge_step(
    kind: &'static str,
    m: &clap::ArgMatches,
    fp_op_before: bool,
    any_cast: bool,
) -> Result<Step> {
    let s = MergeSection::from_arg_matches(m).map_err(clap_usage(kind))?;
    let adapter = s
        .adapter
        .or(s.value)
        .ok_or_else(|| usage(kind, "requires --adapter PATH (or a bare PATH)"))?;
    if s.requant_args.requant && fp_op_before {
        return Err(usage(
            kind,
            "--requant merges into the quantised base; after --dequant-fp8 or --repack-fp4 it is not quantised any more (drop --requant)",
        ));
    }
    let step = lora_step(&adapter, &s.lora, s.allow_nonfinite).map_err(|e| usage(kind, e))?;
    if fp_op_before && !s.requant_args.requant {
        Ok(step)
    } else {
        requant_step(step, &s.requant_args, any_cast).map_err(|e| usage(kind, e))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn os(v: &[&str]) -> Vec<OsString> {
        v.iter().map(OsString::from).collect()
    }

    fn kinds(r: &RunSections) -> Vec<(&str, Vec<String>)> {
        r.sections
            .iter()
            .map(|(k, t)| {
                (
                    *k,
                    t.iter().map(|x| x.to_string_lossy().into_owned()).collect(),
                )
            })
            .collect()
    }

    #[test]
    fn globals_anywhere_sections_keep_their_tokens() {
        let (clap_args, r) = split(os(&[
            "tftf",
            "run",
            "-i",
            "in",
            "--key-rename",
            "^model\\.",
            "",
            "--dry-run",
            "--key-filter",
            "--include",
            "a*",
            "b*",
            "-o",
            "out",
            "--merge-lora",
            "--adapter",
            "x",
            "--scale",
            "2",
            "--device",
            "cpu",
        ]));
        assert_eq!(
            clap_args,
            os(&[
                "tftf",
                "run",
                "-i",
                "in",
                "--dry-run",
                "-o",
                "out",
                "--device",
                "cpu"
            ])
        );
        assert_eq!(
            kinds(&r),
            vec![
                ("--key-rename", vec!["^model\\.".into(), String::new()]),
                (
                    "--key-filter",
                    vec!["--include".into(), "a*".into(), "b*".into()]
                ),
                (
                    "--merge-lora",
                    vec!["--adapter".into(), "x".into(), "--scale".into(), "2".into()]
                ),
            ]
        );
    }

    #[test]
    fn section_options_elsewhere_are_defaults_of_their_kind() {
        let (_, r) = split(os(&[
            "tftf",
            "run",
            "--scale",
            "0.5",
            "--merge-lora",
            "a",
            "--dequant-fp8",
            "--allow-unmatched",
            "--block-size=128",
        ]));
        assert_eq!(
            r.defaults["--merge-lora"],
            os(&["--scale", "0.5", "--allow-unmatched"])
        );
        assert_eq!(
            kinds(&r)[1],
            ("--dequant-fp8", vec!["--block-size=128".into()])
        );
        assert_eq!(r.steps().unwrap().len(), 2);
        let (_, r) = split(os(&["tftf", "run", "--merge-lora=a b", "--dtype-cast=f16"]));
        assert_eq!(
            kinds(&r),
            vec![
                ("--merge-lora", vec!["a b".into()]),
                ("--dtype-cast", vec!["f16".into()])
            ]
        );
    }

    #[test]
    fn bad_sections_are_usage_errors_naming_section_and_token() {
        for (args, want) in [
            (&["--dtype-cast", "--typo", "bfloat16"][..], "--typo"),
            (&["--dtype-cast", "bf16", "extra"], "extra"),
            (&["--dtype-cast", "not_a_dtype"], "not_a_dtype"),
            (&["--dtype-cast", "--dtype"], "--dtype"),
            (&["--merge-lora"], "--adapter"),
            (&["--key-rename", "^a", "b", "^c"], "`^c`"),
        ] {
            let (_, r) = split(os(&[&["tftf", "run"][..], args].concat()));
            let e = r.steps().unwrap_err();
            assert_eq!(e.exit_code(), 2, "{args:?}");
            let text = e.to_string();
            assert!(
                text.starts_with(args[0]) && text.contains(want),
                "{args:?}: {text}"
            );
        }
    }
}
