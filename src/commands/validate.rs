//! `tftf validate`: every structural check of the input (all broken shards, not just the
//! first), the semantic checks of [`super::semantic`], an optional dry plan of a pipe, and with
//! `--check-values` a streamed NaN/Inf scan (with progress on stderr).

use std::path::Path;

use serde_json::json;

use crate::cli::ValidateArgs;
use crate::error::{Error, Result};
use crate::format::checkpoint::Checkpoint;
use crate::format::dtype::DType;
use crate::pipeline::Cancel;
use crate::plan::{Plan, Step};
use crate::progress::Progress;
use crate::sink::{OutputKind, Safetensors, Sink};
use crate::size::human;
use crate::transform::{Glob, Rename};

pub fn parse_pipe(specs: &[String]) -> Result<Vec<Step>> {
    specs
        .iter()
        .map(|s| {
            let (kind, arg) = s.split_once(':').ok_or_else(|| {
                Error::Usage(format!(
                    "--pipe `{s}`: expected dtype:X, filter:GLOB, exclude:GLOB or rename:REGEX=REPL"
                ))
            })?;
            Ok(match kind {
                "dtype" => Step::Cast {
                    dtype: DType::parse_cast_target(arg).ok_or_else(|| {
                        Error::Usage(format!("--pipe `{s}`: unknown dtype `{arg}`"))
                    })?,
                    cast_ints: false,
                },
                "filter" => Step::Include(vec![Glob::new(arg)?]),
                "exclude" => Step::Exclude(vec![Glob::new(arg)?]),
                // Tensor names hold no `=`, so the first one ends the pattern.
                "rename" => {
                    let (regex, repl) = arg.split_once('=').ok_or_else(|| {
                        Error::Usage(format!("--pipe `{s}`: expected rename:REGEX=REPL"))
                    })?;
                    Step::Rename(
                        Rename::new(regex, repl)
                            .map_err(|e| Error::Usage(format!("--pipe `{s}`: {e}")))?,
                    )
                }
                _ => {
                    return Err(Error::Usage(format!(
                        "--pipe `{s}`: unknown step `{kind}` (dtype, filter, exclude, rename)"
                    )))
                }
            })
        })
        .collect()
}

/// Non-finite values of one tensor: count and first element index.
#[derive(Debug, Default, Clone, Copy)]
pub struct NonFinite {
    pub count: u64,
    pub first: Option<u64>,
}

/// Counts NaN/Inf elements (and FP8 NaN codes) in `bytes` of `dtype`.
pub fn scan_nonfinite(dtype: DType, bytes: &[u8], base: u64, acc: &mut NonFinite) {
    let mut note = |i: usize| {
        acc.count += 1;
        acc.first.get_or_insert(base + i as u64);
    };
    match dtype {
        DType::F32 => bytes.chunks_exact(4).enumerate().for_each(|(i, c)| {
            if u32::from_le_bytes(c.try_into().unwrap()) & 0x7F80_0000 == 0x7F80_0000 {
                note(i)
            }
        }),
        DType::F64 => bytes.chunks_exact(8).enumerate().for_each(|(i, c)| {
            let b = u64::from_le_bytes(c.try_into().unwrap());
            if b & 0x7FF0_0000_0000_0000 == 0x7FF0_0000_0000_0000 {
                note(i)
            }
        }),
        DType::BF16 => bytes.chunks_exact(2).enumerate().for_each(|(i, c)| {
            if u16::from_le_bytes([c[0], c[1]]) & 0x7F80 == 0x7F80 {
                note(i)
            }
        }),
        DType::F16 => bytes.chunks_exact(2).enumerate().for_each(|(i, c)| {
            if u16::from_le_bytes([c[0], c[1]]) & 0x7C00 == 0x7C00 {
                note(i)
            }
        }),
        DType::F8_E4M3 => bytes.iter().enumerate().for_each(|(i, &b)| {
            if b & 0x7F == 0x7F {
                note(i)
            }
        }),
        DType::F8_E5M2 => bytes.iter().enumerate().for_each(|(i, &b)| {
            if b & 0x7C == 0x7C {
                note(i)
            }
        }),
        _ => {}
    }
}

fn scannable(d: DType) -> bool {
    matches!(
        d,
        DType::F32 | DType::F64 | DType::BF16 | DType::F16 | DType::F8_E4M3 | DType::F8_E5M2
    )
}

/// Returns whether the checkpoint is clean; a raised `cancel` (Ctrl-C) stops the value scan.
pub fn run(args: &ValidateArgs, input: &Path, budget: u64, cancel: &Cancel) -> Result<bool> {
    let steps = parse_pipe(&args.pipe)?;
    let interval = crate::progress::parse_interval(args.progress_interval.as_deref())?;
    let mut problems: Vec<String> = Vec::new();
    let ckpt = match Checkpoint::open_all_errors(input) {
        Ok(c) => Some(c),
        Err(errs) => {
            problems.extend(errs.iter().map(|e| e.to_string()));
            None
        }
    };
    let mut scan = ValueScan::default();
    let mut findings = Vec::new();
    let mut notes = Vec::new();
    if let Some(ckpt) = &ckpt {
        findings = super::semantic::check(ckpt);
        notes = super::semantic::notes(ckpt);
        problems.extend(findings.iter().map(|f| f.message.clone()));
        if !steps.is_empty() {
            problems.extend(pipe_problem(ckpt, &steps));
        }
        if args.check_values {
            scan = scan_values(ckpt, args, budget, interval, cancel)?;
            problems.append(&mut scan.problems);
        }
    }
    let report = Report {
        input,
        ckpt: ckpt.as_ref(),
        args,
        scan: &scan,
        problems: &problems,
        notes: &notes,
    };
    if args.json {
        report.print_json(&findings);
    } else {
        report.print_text();
    }
    Ok(problems.is_empty())
}

/// Why the dry plan of `--pipe` steps over the checkpoint fails or does nothing, if it does.
fn pipe_problem(ckpt: &Checkpoint, steps: &[Step]) -> Option<String> {
    let sink = Safetensors {
        kind: OutputKind::Dir,
        max_shard_bytes: None,
    };
    let planned =
        Plan::build(ckpt, steps).and_then(|plan| sink.layout(ckpt, &plan, false).map(|_| plan));
    match planned {
        Err(e) => Some(format!("pipe: {e}")),
        Ok(plan) => plan.nothing_to_do.map(|why| format!("pipe: {why}")),
    }
}

/// What the `--check-values` scan read and found.
#[derive(Default)]
struct ValueScan {
    bytes: u64,
    tensors: usize,
    /// One message per tensor holding NaN or Inf.
    problems: Vec<String>,
}

/// Streams every float tensor through [`scan_nonfinite`] in chunks of at most half the budget,
/// with progress on stderr unless turned off.
fn scan_values(
    ckpt: &Checkpoint,
    args: &ValidateArgs,
    budget: u64,
    interval: std::time::Duration,
    cancel: &Cancel,
) -> Result<ValueScan> {
    let total: u64 = ckpt
        .tensors
        .iter()
        .filter(|t| scannable(t.info.dtype))
        .map(|t| t.info.nbytes())
        .sum();
    let mode = crate::progress::parse_mode(args.progress.as_deref(), args.no_progress, false)?;
    let progress = (mode != crate::progress::Mode::Off).then(|| {
        let shards = ckpt.shard_names();
        // Nothing is written, so there are no per-file events.
        Progress::new("validate", shards, Vec::new(), total, interval, mode)
    });
    let chunk = (budget / 2).clamp(1 << 20, 64 << 20) as usize;
    let mut buf = vec![0u8; chunk];
    let mut scan = ValueScan::default();
    for t in ckpt.tensors.iter().filter(|t| scannable(t.info.dtype)) {
        let acc = scan_tensor(ckpt, t, &mut buf, progress.as_ref(), cancel)?;
        scan.bytes += t.info.nbytes();
        scan.tensors += 1;
        if acc.count > 0 {
            scan.problems.push(format!(
                "{}: tensor `{}`: {} non-finite value(s), first at element {}",
                crate::escape::path(&ckpt.shards[t.shard()].path),
                crate::escape::name(&t.info.name),
                acc.count,
                acc.first.unwrap_or(0)
            ));
        }
    }
    if let Some(p) = &progress {
        p.finish();
    }
    Ok(scan)
}

/// Counts one tensor's non-finite values, reading it through `buf` in whole elements.
fn scan_tensor(
    ckpt: &Checkpoint,
    t: &crate::format::checkpoint::TensorRef,
    buf: &mut [u8],
    progress: Option<&Progress>,
    cancel: &Cancel,
) -> Result<NonFinite> {
    let size = t
        .info
        .dtype
        .size()
        .expect("scannable dtypes are whole bytes");
    let step = buf.len() / size * size;
    let mut acc = NonFinite::default();
    let mut done = 0u64;
    while done < t.info.nbytes() {
        if cancel.is_raised() {
            return Err(Error::Cancelled);
        }
        let n = (t.info.nbytes() - done).min(step as u64) as usize;
        ckpt.read_tensor_at(t, done, &mut buf[..n])?;
        scan_nonfinite(t.info.dtype, &buf[..n], done / size as u64, &mut acc);
        done += n as u64;
        if let Some(p) = progress {
            p.advance(t.shard(), n as u64);
        }
    }
    Ok(acc)
}

/// What `validate` prints: the checkpoint (when it opened), the scan and every problem found.
struct Report<'a> {
    input: &'a Path,
    ckpt: Option<&'a Checkpoint>,
    args: &'a ValidateArgs,
    scan: &'a ValueScan,
    problems: &'a [String],
    /// `validate`'s own notes (a stale index `total_size`), after the checkpoint's.
    notes: &'a [String],
}

impl Report<'_> {
    fn print_json(&self, findings: &[super::semantic::Finding]) {
        let ckpt = self.ckpt;
        let v = json!({
            "path": self.input.to_string_lossy(),
            "ok": self.problems.is_empty(),
            "format": ckpt.map(|c| c.format.name()),
            "tensors": ckpt.map(|c| c.tensors.len()),
            "shards": ckpt.map(|c| c.shards.len()),
            "bytes": ckpt.map(|c| c.total_bytes()),
            "values_checked": self.args.check_values,
            "tensors_scanned": self.scan.tensors,
            "bytes_scanned": self.scan.bytes,
            "problems": self.problems,
            "findings": findings,
            "warnings": ckpt.map(|c| c.warnings.clone()).unwrap_or_default(),
            "notes": ckpt
                .map(|c| c.notes.clone())
                .unwrap_or_default()
                .into_iter()
                .chain(self.notes.iter().cloned())
                .collect::<Vec<_>>(),
        });
        println!("{}", serde_json::to_string_pretty(&v).expect("JSON"));
    }

    fn print_text(&self) {
        if let Some(c) = self.ckpt {
            for w in &c.warnings {
                println!("warning: {}", crate::escape::name(w));
            }
            for n in c.notes.iter().chain(self.notes) {
                println!("note: {}", crate::escape::name(n));
            }
        }
        for p in self.problems {
            println!("problem: {}", crate::escape::name(p));
        }
        if let Some(c) = self.ckpt.filter(|c| c.format.name() != "safetensors") {
            println!("format: {}", c.format_line());
        }
        match (self.ckpt, self.problems.is_empty()) {
            (Some(c), true) => println!(
                "ok: {} — {} tensors in {} shard(s), {}{}",
                crate::escape::path(self.input),
                c.tensors.len(),
                c.shards.len(),
                human(c.total_bytes()),
                if self.args.check_values {
                    format!(
                        "; {} float tensors ({}) scanned, all finite",
                        self.scan.tensors,
                        human(self.scan.bytes)
                    )
                } else {
                    String::new()
                }
            ),
            _ => println!(
                "invalid: {} — {} problem(s)",
                crate::escape::path(self.input),
                self.problems.len()
            ),
        }
    }
}
