//! The conversion driver shared by `passthrough` and `run`: open, plan, check, then stream into
//! temporary files and commit them atomically.

use std::path::{Path, PathBuf};
use std::time::Instant;

use serde_json::{json, Value};

use crate::cli::{GgufArgs, PolicyArgs, RunOpts, WriteArgs};
use crate::error::{Error, Result};
use crate::format::checkpoint::Checkpoint;
use crate::gpu::{Device, DeviceRequest};
use crate::output::checksum::{
    hash_bytes, hash_file, manifest_json, sums_text, TensorRange, MANIFEST_NAME, SUMS_NAME,
};
use crate::output::parts::PartSpec;
use crate::output::{
    check_report_path, resolve, side_files, write_report, Claim, InputFiles, OutputSet,
    OutputTarget, INDEX_NAME,
};
use crate::pipeline::{self, Cancel, PipelineConfig};
use crate::plan::{Plan, Recipe, Step};
use crate::progress::{Mode as ProgressMode, Progress};
use crate::sink::gguf::GgufSink;
use crate::sink::gguf::GgufSinkOptions as GgufOptions;
use crate::sink::{output_kind_for, Layout, OutputKind, Safetensors, Sink};
use crate::size::{human, parse_size};
use crate::sys;

/// Resolved common options of every writing command.
pub struct WriteOptions {
    pub output: PathBuf,
    pub format: Format,
    pub dry_run: bool,
    pub threads: usize,
    /// `--io-threads`; `None`: chosen from the storage.
    pub io_threads: Option<usize>,
    pub memory_budget: u64,
    pub quiet: bool,
    /// Print nothing at all, not even the input's and the plan's warnings (the report keeps
    /// them): runs through the library API.
    pub silent: bool,
    pub progress: ProgressMode,
    /// Progress events go to this callback, and nothing about progress to stderr.
    pub on_progress: Option<crate::progress::Callback>,
    /// Seconds between progress lines when stderr is not a terminal.
    pub progress_interval: std::time::Duration,
    /// Informational notes on stderr (`-v`).
    pub verbose: bool,
    /// Write even when filters keep nothing or an op finds nothing to do.
    pub allow_empty: bool,
    pub report: Option<PathBuf>,
    pub force: bool,
    pub kernel_copy: bool,
    pub device: DeviceRequest,
    /// `--checksums`: write `SHA256SUMS` and `tftf-manifest.json` with the output; `None`
    /// when not given (on for parts and resumable runs, off otherwise).
    pub checksums: Option<bool>,
    /// `--part K/N`.
    pub part: Option<PartSpec>,
    pub resume: bool,
    pub finalize: bool,
    /// The command and its output-relevant arguments, canonical (for the run's fingerprint).
    pub arguments: String,
}

pub const MAX_DEFAULT_BUDGET_BYTES: u64 = 4 << 30;
pub const MIN_BUDGET_BYTES: u64 = 16 << 20;

pub fn default_budget() -> u64 {
    (sys::available_memory() / 4).clamp(64 << 20, MAX_DEFAULT_BUDGET_BYTES)
}

pub fn parse_budget(arg: Option<&str>) -> Result<u64> {
    match arg {
        None => Ok(default_budget()),
        Some(s) => {
            let b = parse_size(s)?;
            if b < MIN_BUDGET_BYTES {
                return Err(Error::Usage(format!(
                    "--memory-budget {s} is below the minimum of {}",
                    human(MIN_BUDGET_BYTES)
                )));
            }
            Ok(b)
        }
    }
}

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

/// The output format of a job.
#[derive(Debug, Clone)]
pub enum Format {
    /// Shards and their index in a directory, or one `.safetensors` file.
    Safetensors { max_shard_bytes: Option<u64> },
    /// A `.gguf` file, or its split files.
    Gguf(GgufOptions),
}

impl WriteOptions {
    /// `arguments`: the command and its output-relevant arguments ([`super::arguments_text`]),
    /// which a partitioned or resumed run's fingerprint includes.
    pub fn from_args(w: &WriteArgs, arguments: &str) -> Result<WriteOptions> {
        let mut opts = Self::common(
            &w.output,
            &w.run,
            &w.policy,
            (w.force, w.no_reflink),
            &w.device,
            arguments,
        )?;
        opts.allow_empty = w.allow_empty;
        opts.format = Format::Safetensors {
            max_shard_bytes: w.max_shard_size.as_deref().map(parse_size).transpose()?,
        };
        Ok(opts)
    }

    /// Options of `tftf gguf`: the same policy, a GGUF sink.
    pub fn from_gguf_args(a: &GgufArgs, arguments: &str) -> Result<WriteOptions> {
        if a.policy.part.is_some() || a.policy.resume {
            return Err(Error::Usage(
                "--part and --resume write directories of safetensors shards; a GGUF output is written in one run".into(),
            ));
        }
        let mut opts = Self::common(
            &a.output,
            &a.run,
            &a.policy,
            (a.force, a.no_reflink),
            &a.device,
            arguments,
        )?;
        opts.format = Format::Gguf(super::gguf::gguf_options(a)?);
        Ok(opts)
    }

    /// `force_no_reflink`: `--force` and `--no-reflink`.
    fn common(
        output: &Path,
        r: &RunOpts,
        p: &PolicyArgs,
        (force, no_reflink): (bool, bool),
        device: &str,
        arguments: &str,
    ) -> Result<WriteOptions> {
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
            force,
            kernel_copy: !no_reflink,
            device: DeviceRequest::parse(device)?,
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

/// Runs one writing job and returns its report (the JSON `--report` writes).
pub fn convert(
    command: &str,
    input: &Path,
    steps: &[Step],
    opts: &WriteOptions,
    cancel: &Cancel,
) -> Result<Value> {
    let started = Instant::now();
    let mut inputs = None;
    let result = convert_inner(command, input, steps, opts, cancel, started, &mut inputs);
    if let (Err(e), Some(path)) = (&result, &opts.report) {
        let report = error_report(command, e, started);
        // Never onto an input or over a file that is not an earlier report, even to say why
        // the run was refused.
        if check_report_path(path, inputs.as_ref()).is_ok() {
            let _ = write_report(path, &report);
        }
    }
    result
}

/// The report of a run that failed with `e`.
pub(crate) fn error_report(command: &str, e: &Error, started: Instant) -> Value {
    json!({
        "tftf_version": env!("CARGO_PKG_VERSION"),
        "command": command,
        "status": "error",
        "error": e.to_string(),
        "wall_seconds": started.elapsed().as_secs_f64(),
    })
}

/// The sink a job's [`Format`] names.
pub(crate) enum OutputSink {
    Safetensors(Safetensors),
    Gguf(GgufSink),
}

impl OutputSink {
    fn new(format: &Format, output: &Path) -> OutputSink {
        match format {
            Format::Safetensors { max_shard_bytes } => OutputSink::Safetensors(Safetensors {
                kind: output_kind_for(output),
                max_shard_bytes: *max_shard_bytes,
            }),
            Format::Gguf(o) => OutputSink::Gguf(GgufSink::new(o.clone())),
        }
    }

    pub fn as_sink(&self) -> &dyn Sink {
        match self {
            OutputSink::Safetensors(s) => s,
            OutputSink::Gguf(g) => g,
        }
    }

    /// Where the output goes: a `.gguf` file is always a file, in a directory.
    fn target<'a>(
        &self,
        output: &Path,
        ckpt: &Checkpoint,
        inputs: &'a InputFiles,
    ) -> Result<OutputTarget<'a>> {
        match self {
            OutputSink::Safetensors(_) => OutputTarget::resolve(output, ckpt, inputs),
            OutputSink::Gguf(_) => {
                let target = OutputTarget::resolve_as(output, OutputKind::File, ckpt, inputs)?;
                if output.is_dir() {
                    return Err(Error::Other(format!(
                        "output {} is a directory; name the .gguf file",
                        output.display()
                    )));
                }
                Ok(target)
            }
        }
    }
}

fn convert_inner(
    command: &str,
    input: &Path,
    steps: &[Step],
    opts: &WriteOptions,
    cancel: &Cancel,
    started: Instant,
    inputs_seen: &mut Option<InputFiles>,
) -> Result<Value> {
    let mut ckpt = Checkpoint::open(input)?;
    for step in steps {
        if let Step::Op(op_step) = step {
            op_step.attach(&mut ckpt)?;
        }
    }
    if !opts.silent {
        crate::escape::print_input_notes(&ckpt, opts.quiet);
    }
    let sink = OutputSink::new(&opts.format, &opts.output);
    let all_sides = side_files(&ckpt);
    let inputs = inputs_seen.insert(InputFiles::of(&ckpt, &all_sides));
    let target = sink.target(&opts.output, &ckpt, inputs)?;
    let mut steps = steps.to_vec();
    steps.extend(sink.as_sink().steps(&ckpt)?);
    let plan = Plan::build(&ckpt, &steps)?;
    for w in plan.notes.warnings.iter().filter(|_| !opts.silent) {
        eprintln!(
            "warning: {}: {}",
            crate::escape::path(input),
            crate::escape::name(w)
        );
    }
    if let (false, Some(why)) = (opts.allow_empty, &plan.nothing_to_do) {
        return Err(Error::NothingToDo(why.clone()));
    }
    let copies_sides = sink.as_sink().copies_side_files();
    let sides: Vec<PathBuf> = all_sides
        .into_iter()
        .filter(|p| {
            let name = p.file_name().unwrap_or_default().to_string_lossy();
            copies_sides
                && !plan.dropped_side_files.iter().any(|d| *d == name)
                && !plan.generated_files.iter().any(|(g, _)| *g == name)
        })
        .collect();
    let out_dir = target.dir.clone();
    // Bytes that will share extents with the input take no new space.
    let out_fs = sys::filesystem_name(&nearest_existing(&resolve(&out_dir)));
    let sharing =
        opts.kernel_copy && sys::can_reflink(out_fs) && same_filesystem(&ckpt.dir, &out_dir);
    let layout = sink.as_sink().layout(&ckpt, &plan, sharing)?;
    let data_budget = plan.data_budget(&ckpt, layout.header_bytes(), opts.memory_budget)?;
    // A GPU is opened only when asked for by name or when some op can use one.
    let device = if opts.device == DeviceRequest::Cpu
        || (opts.device == DeviceRequest::Auto && !plan.has_gpu_ops())
    {
        Device::cpu(None)
    } else {
        Device::open(&opts.device)?
    };
    let run = Prepared {
        command,
        ckpt: &ckpt,
        plan: &plan,
        layout: &layout,
        target: &target,
        sides: &sides,
        opts,
        device: &device,
        sink: &sink,
        data_budget,
        sharing,
        started,
    };
    if opts.part.is_some() || opts.resume {
        return super::parted::run(&run, cancel);
    }
    single_run(&run, out_fs, cancel)
}

/// Names of the files a single run commits, the model files first; refuses checksums beside
/// a single `.safetensors` file.
fn output_names(run: &Prepared, checksums: bool) -> Result<Vec<String>> {
    let (target, layout) = (run.target, run.layout);
    let mut names = match run.sink {
        OutputSink::Gguf(_) => layout.shards.iter().map(|s| s.file_name.clone()).collect(),
        OutputSink::Safetensors(_) => target.names(layout, run.sides),
    };
    names.extend(generated_names(run));
    if checksums {
        if let (OutputSink::Safetensors(_), Some(_)) = (run.sink, target.file_name()) {
            return Err(Error::Usage(
                "--checksums writes SHA256SUMS and tftf-manifest.json beside the shards: give a directory as -o".into(),
            ));
        }
        names.extend([SUMS_NAME.to_string(), MANIFEST_NAME.to_string()]);
    }
    Ok(names)
}

/// What committing `names` does to the output: a safetensors directory is the job's own, GGUF
/// files are claimed one by one.
fn claim(run: &Prepared, names: &[String]) -> Result<Claim> {
    match run.sink {
        OutputSink::Gguf(_) => run.target.claim_files(names, run.opts.force),
        OutputSink::Safetensors(_) => run.target.claim(names, run.opts.force),
    }
}

/// The dry run: prints the plan and writes the report, nothing else.
fn dry_run(run: &Prepared, claim: &Claim, needed: u64, free: Option<u64>) -> Result<Value> {
    let opts = run.opts;
    if !opts.quiet {
        match run.sink {
            OutputSink::Gguf(g) => super::gguf::print_plan(run, g, needed, free),
            OutputSink::Safetensors(_) => print_plan(run, needed, free),
        }
        print_claim(claim);
        if run.plan.computed_count() > 0 {
            println!("{}", device_line(run.device));
        }
    }
    let report = any_report_json(run, None, true);
    if let Some(path) = &opts.report {
        write_report(path, &report)?;
    }
    Ok(report)
}

/// One run: every file written under a temporary name, then committed together.
fn single_run(run: &Prepared, out_fs: &str, cancel: &Cancel) -> Result<Value> {
    let (plan, layout, target, opts) = (run.plan, run.layout, run.target, run.opts);
    let checksums = opts.checksums == Some(true);
    let names = output_names(run, checksums)?;
    if let Some(report) = &opts.report {
        target.check_report(report, &names)?;
    }
    let claim = claim(run, &names)?;
    let needed = run.needed_bytes(layout, run.sides);
    let free = run.free_space();
    if opts.dry_run {
        return dry_run(run, &claim, needed, free);
    }
    let mut out = open_output(target, needed, free, opts.quiet, cancel)?;
    // Checked again under the lock: another run may have written here since.
    let claim = self::claim(run, &names)?;
    let (files, tmp_names) = create_model_files(&mut out, layout, &names)?;
    let progress = run.progress(
        names[..layout.shards.len()].to_vec(),
        run.progress_bytes(&layout.shards.iter().collect::<Vec<_>>()),
        plan.total_tensor_bytes(),
    );
    let cfg = run.pipeline_config(cancel, progress.clone());
    let stats = pipeline::execute(run.ckpt, plan, layout, &files, &tmp_names, &cfg)?;
    if let Some(p) = &progress {
        p.finish();
    }
    drop(files);
    add_side_outputs(run, &mut out, &names, &tmp_names, checksums)?;
    if cancel.is_raised() {
        return Err(Error::Cancelled);
    }
    out.commit(&claim.deleted)?;
    if !opts.quiet {
        print_summary(run, &claim, &stats);
    }
    print_verbose_notes(opts, out_fs, &stats);
    let report = any_report_json(run, Some(&stats), false);
    publish_report(opts.report.as_deref(), opts.progress, run.command, &report);
    Ok(report)
}

/// The model files as temporaries, sized, each with its header written.
fn create_model_files(
    out: &mut OutputSet,
    layout: &Layout,
    names: &[String],
) -> Result<(Vec<std::fs::File>, Vec<PathBuf>)> {
    let mut files = Vec::with_capacity(layout.shards.len());
    let mut tmp_names = Vec::with_capacity(layout.shards.len());
    for (shard, name) in layout.shards.iter().zip(names) {
        let (file, tmp) = out.add(name)?;
        file.set_len(shard.len).map_err(|e| Error::io(&tmp, e))?;
        if shard.clone_from.is_none() {
            use std::os::unix::fs::FileExt;
            file.write_all_at(&shard.header, 0)
                .map_err(|e| Error::io(&tmp, e))?;
        }
        files.push(file);
        tmp_names.push(tmp);
    }
    Ok((files, tmp_names))
}

/// Everything beside the model files: their checksums, the index, the side files (config.json
/// as the plan edited it), generated files, and `SHA256SUMS` with the manifest.
fn add_side_outputs(
    run: &Prepared,
    out: &mut OutputSet,
    names: &[String],
    tmp_names: &[PathBuf],
    checksums: bool,
) -> Result<()> {
    let (plan, layout) = (run.plan, run.layout);
    let mut sums = Vec::new();
    if checksums {
        for ((shard, name), tmp) in layout.shards.iter().zip(names).zip(tmp_names) {
            let ranges = shard
                .tensors
                .iter()
                .zip(&shard.offsets)
                .map(|(&t, &offset)| TensorRange {
                    name: plan.tensors[t].name.clone(),
                    offset,
                    len: plan.tensors[t].nbytes,
                })
                .collect();
            sums.push(hash_file(tmp, name, ranges)?);
        }
    }
    let add = |out: &mut OutputSet, name: &str, text: &[u8], sums: &mut Vec<_>| -> Result<()> {
        if checksums {
            sums.push(hash_bytes(name, text));
        }
        out.add_bytes(name, text)
    };
    if let Some(index) = layout.index_json(plan) {
        add(out, INDEX_NAME, index.as_bytes(), &mut sums)?;
    }
    for side in run.sides {
        let name = side
            .file_name()
            .expect("listed files have names")
            .to_string_lossy();
        if let (true, Some(cfg)) = (name == "config.json", &plan.config) {
            let mut text = serde_json::to_string_pretty(cfg).expect("JSON object");
            text.push('\n');
            add(out, "config.json", text.as_bytes(), &mut sums)?;
            continue;
        }
        if checksums {
            sums.push(hash_file(side, &name, Vec::new())?);
        }
        out.add_copy(&name, side)?;
    }
    for (name, text) in generated_files(run) {
        add(out, name, text.as_bytes(), &mut sums)?;
    }
    if checksums {
        out.add_bytes(SUMS_NAME, sums_text(&sums).as_bytes())?;
        let mut manifest =
            serde_json::to_string_pretty(&manifest_json(&sums)).expect("JSON object");
        manifest.push('\n');
        out.add_bytes(MANIFEST_NAME, manifest.as_bytes())?;
    }
    Ok(())
}

/// The line a finished run prints, and what it replaced or removed.
fn print_summary(run: &Prepared, claim: &Claim, stats: &pipeline::RunStats) {
    let (plan, layout) = (run.plan, run.layout);
    let secs = run.started.elapsed().as_secs_f64();
    println!(
        "wrote {} file(s), {} tensors, {} to {} in {:.2} s ({}/s): {} shared with the input (reflink), {} copied in the kernel, {} through memory, {} computed",
        layout.shards.len(),
        plan.tensors.len(),
        human(layout.total_file_bytes()),
        run.opts.output.display(),
        secs,
        human((plan.total_tensor_bytes() as f64 / secs.max(1e-9)) as u64),
        human(stats.bytes_reflinked),
        human(stats.bytes_copied_in_kernel),
        human(stats.bytes_copied_user),
        human(stats.bytes_computed),
    );
    if let (OutputSink::Gguf(_), false) = (run.sink, claim.replaced.is_empty()) {
        println!("replaced {}", claim.replaced.join(", "));
    }
    if !claim.deleted.is_empty() {
        println!(
            "removed {} model file(s) of the earlier output: {}",
            claim.deleted.len(),
            claim.deleted.join(", ")
        );
    }
    if plan.computed_count() > 0 {
        println!("{}", device_line(run.device));
    }
    if let Some(line) = crate::ops::quantize::requant::summary(&tensor_reports(plan)) {
        println!("{line}");
    }
}

/// `-v`: why untouched bytes were copied rather than shared, and why buffers were not
/// registered with the GPU.
fn print_verbose_notes(opts: &WriteOptions, out_fs: &str, stats: &pipeline::RunStats) {
    if !opts.verbose || opts.quiet {
        return;
    }
    if let Some(why) = &stats.reflink_unavailable {
        if sys::can_reflink(out_fs) {
            eprintln!("info: untouched tensors were copied, not shared with the input: {why}");
        } else {
            eprintln!("info: untouched tensors were copied; the output filesystem ({out_fs}) cannot share extents with the input");
        }
    }
    if let Some(why) = &stats.host_register_failed {
        eprintln!("info: pool buffers not registered with the GPU driver, copies go through staging buffers: {why}");
    }
}

/// The report of a run, in its format's shape.
pub(crate) fn any_report_json(
    p: &Prepared,
    stats: Option<&pipeline::RunStats>,
    dry_run: bool,
) -> Value {
    match p.sink {
        OutputSink::Gguf(g) => super::gguf::report_json(p, g, stats, dry_run),
        OutputSink::Safetensors(_) => report_json(p, stats, dry_run),
    }
}

/// After the commit: the report to `--report` and, with `--progress json`, as the last line
/// on stderr. The output is committed, so a report that cannot be written is a warning.
pub(crate) fn publish_report(
    path: Option<&Path>,
    progress: ProgressMode,
    op: &str,
    report: &Value,
) {
    let json = progress == ProgressMode::Json;
    if let Some(path) = path {
        if let Err(e) = write_report(path, report) {
            eprintln!(
                "warning: the output was written, but not the report: {}",
                crate::escape::name(&e.to_string())
            );
        }
    }
    if json {
        eprintln!("{}", crate::progress::report_line(op, report));
    }
}

/// Everything a writing run has resolved before it creates anything.
pub(crate) struct Prepared<'a> {
    pub command: &'a str,
    pub ckpt: &'a Checkpoint,
    pub plan: &'a Plan,
    pub layout: &'a Layout,
    pub target: &'a OutputTarget<'a>,
    pub sides: &'a [PathBuf],
    pub opts: &'a WriteOptions,
    pub device: &'a Device,
    pub sink: &'a OutputSink,
    /// Memory for tensor data in flight.
    pub data_budget: u64,
    /// Whether untouched tensors will probably share extents with the input.
    pub sharing: bool,
    pub started: Instant,
}

impl Prepared<'_> {
    /// Free space that `layout`'s files and `sides` need; bytes that will share extents with
    /// the input take none.
    pub fn needed_bytes(&self, layout: &Layout, sides: &[PathBuf]) -> u64 {
        let side_bytes: u64 = sides
            .iter()
            .filter_map(|p| std::fs::metadata(p).ok())
            .map(|m| m.len())
            .sum();
        let shared = if self.sharing {
            layout.shareable_bytes(self.ckpt, self.plan)
        } else {
            0
        };
        layout.total_file_bytes() + side_bytes - shared
    }

    /// Free space where the output goes (its nearest existing directory).
    pub fn free_space(&self) -> Option<u64> {
        sys::free_space(&nearest_existing(&resolve(&self.target.dir))).ok()
    }

    pub fn pipeline_config(&self, cancel: &Cancel, progress: Option<Progress>) -> PipelineConfig {
        PipelineConfig {
            threads: self.opts.threads,
            memory_budget: self.data_budget,
            cancel: cancel.clone(),
            progress,
            kernel_copy: self.opts.kernel_copy,
            expect_reflink: self.sharing,
            gpu: self.device.gpu.clone(),
            io_threads: self.opts.io_threads,
        }
    }

    /// Progress over `files` receiving `file_bytes` each (`total` in all): to the caller's
    /// callback when there is one, else on stderr unless it is off.
    pub fn progress(
        &self,
        files: Vec<String>,
        file_bytes: Vec<u64>,
        total: u64,
    ) -> Option<Progress> {
        let opts = self.opts;
        if let Some(callback) = &opts.on_progress {
            let p =
                Progress::with_callback(self.command, files, file_bytes, total, callback.clone());
            return Some(p);
        }
        (opts.progress != ProgressMode::Off).then(|| {
            Progress::new(
                self.command,
                files,
                file_bytes,
                total,
                opts.progress_interval,
                opts.progress,
            )
        })
    }

    /// Bytes each file of `shards` receives through the writer, for progress.
    pub fn progress_bytes(&self, shards: &[&crate::sink::OutShard]) -> Vec<u64> {
        shards
            .iter()
            .map(|s| match s.clone_from {
                Some(_) => s.len,
                None => s.tensors.iter().map(|&t| self.plan.tensors[t].nbytes).sum(),
            })
            .collect()
    }
}

/// What `--force` will do to the existing output, for `--dry-run`.
pub(crate) fn print_claim(claim: &Claim) {
    if claim.interrupted_commit {
        println!("  first finishes the commit a killed run left half done in the output");
    }
    if !claim.orphans.is_empty() {
        println!(
            "  first removes {} temporary file(s) of killed runs: {}",
            claim.orphans.len(),
            claim.orphans.join(", ")
        );
    }
    if !claim.replaced.is_empty() {
        println!("  replaces: {}", claim.replaced.join(", "));
    }
    if !claim.deleted.is_empty() {
        println!(
            "  deletes (model files of the earlier output): {}",
            claim.deleted.join(", ")
        );
    }
}

/// Past the dry run: refuses an output the free space cannot hold, or a cancelled run, then
/// opens the output (lock, an interrupted commit finished, orphans removed) and says what that
/// cleaned up.
pub(crate) fn open_output(
    target: &OutputTarget,
    needed: u64,
    free: Option<u64>,
    quiet: bool,
    cancel: &Cancel,
) -> Result<OutputSet> {
    open_space_check(&target.dir, needed, free, cancel)?;
    let (out, notes) = target.begin()?;
    if !quiet {
        for n in &notes {
            eprintln!("note: {}: {n}", target.dir.display());
        }
    }
    Ok(out)
}

/// Refuses an output the free space cannot hold, or a cancelled run.
pub(crate) fn open_space_check(
    dir: &Path,
    needed: u64,
    free: Option<u64>,
    cancel: &Cancel,
) -> Result<()> {
    if let Some(free) = free {
        if free < needed {
            return Err(Error::NoSpace {
                path: dir.to_path_buf(),
                needed,
                available: free,
            });
        }
    }
    if cancel.is_raised() {
        return Err(Error::Cancelled);
    }
    Ok(())
}

pub(crate) fn same_filesystem(a: &Path, b: &Path) -> bool {
    use std::os::unix::fs::MetadataExt;
    let dev = |p: &Path| {
        std::fs::metadata(nearest_existing(&resolve(p)))
            .map(|m| m.dev())
            .ok()
    };
    dev(a).is_some() && dev(a) == dev(b)
}

/// Per-tensor figures: those known at plan time, then those the ops gathered while running.
fn tensor_reports(plan: &Plan) -> Vec<Value> {
    let mut v = plan.notes.tensors.clone();
    for t in &plan.tensors {
        if let Recipe::Compute { op, .. } = &t.recipe {
            if let Some(mut r) = op.report() {
                if let Value::Object(m) = &mut r {
                    m.insert("tensor".into(), Value::from(t.name.clone()));
                }
                v.push(r);
            }
        }
    }
    v
}

pub(crate) fn nearest_existing(p: &Path) -> PathBuf {
    let mut cur = p;
    loop {
        if cur.exists() {
            return cur.to_path_buf();
        }
        match cur.parent() {
            Some(parent) => cur = parent,
            None => return PathBuf::from("/"),
        }
    }
}

fn dtype_changes(ckpt: &Checkpoint, plan: &Plan) -> Vec<(String, usize, u64, u64)> {
    let mut map: std::collections::BTreeMap<String, (usize, u64, u64)> = Default::default();
    for t in &plan.tensors {
        if let Recipe::Produced { by } = &t.recipe {
            if let Recipe::Compute { op, .. } = &plan.tensors[*by].recipe {
                let e = map
                    .entry(format!("{} (extra output) -> {}", op.name(), t.dtype))
                    .or_default();
                e.0 += 1;
                e.2 += t.nbytes;
            }
        }
        if let Recipe::Compute { op, inputs, .. } = &t.recipe {
            let src = &ckpt.tensors[t.source_index].info;
            let key = format!("{} {} -> {}", op.name(), src.dtype, t.dtype);
            let e = map.entry(key).or_default();
            e.0 += 1;
            e.1 += if inputs.is_empty() { 0 } else { src.nbytes() };
            e.2 += t.nbytes;
        }
    }
    map.into_iter().map(|(k, (n, a, b))| (k, n, a, b)).collect()
}

/// Side files the plan generates (`hf_quant_config.json`), written beside a directory output.
fn generated_files<'a>(p: &Prepared<'a>) -> &'a [(String, String)] {
    if p.sink.as_sink().copies_side_files() {
        &p.plan.generated_files
    } else {
        &[]
    }
}

fn generated_names(p: &Prepared) -> Vec<String> {
    generated_files(p).iter().map(|(n, _)| n.clone()).collect()
}

pub(crate) fn print_plan(p: &Prepared, needed: u64, free: Option<u64>) {
    let (ckpt, plan, layout, target, sides, opts) =
        (p.ckpt, p.plan, p.layout, p.target, p.sides, p.opts);
    println!(
        "plan: {} of {} input tensors -> {} file(s) in {} (dry run: nothing written)",
        plan.tensors.len(),
        ckpt.base_count,
        layout.shards.len(),
        target.dir.display()
    );
    let out_dir = target.dir.as_path();
    for s in &layout.shards {
        println!(
            "  {:<40} {:>12}  {} tensors",
            target.file_name().unwrap_or_else(|| s.file_name.clone()),
            human(s.len),
            s.tensors.len()
        );
    }
    if layout.has_index() {
        println!("  model.safetensors.index.json");
    }
    for (k, n, a, b) in dtype_changes(ckpt, plan) {
        println!("  {k}: {n} tensors, {} -> {}", human(a), human(b));
    }
    println!("  renamed {}, dropped {}", plan.renamed, plan.dropped.len());
    println!(
        "  bytes: {} copied unchanged, {} computed",
        human(plan.copied_bytes()),
        human(plan.total_tensor_bytes() - plan.copied_bytes())
    );
    let gathered = plan.gathered_bytes(ckpt);
    if gathered > 0 {
        println!(
            "  gathered: {} of the unchanged bytes are strided views or chunk grids, read through memory",
            human(gathered)
        );
    }
    let fs = sys::filesystem_name(&nearest_existing(&resolve(out_dir)));
    let shareable = layout.shareable_bytes(ckpt, plan);
    if !opts.kernel_copy {
        println!("  reflink: off (--no-reflink): untouched bytes are copied through memory");
    } else if !sys::can_reflink(fs) {
        println!(
            "  reflink: the output filesystem ({fs}) cannot share extents; {} will be copied in the kernel",
            human(plan.copied_bytes() - gathered)
        );
    } else if !same_filesystem(&ckpt.dir, out_dir) {
        println!("  reflink: input and output are on different filesystems; untouched bytes will be copied");
    } else {
        println!(
            "  reflink: {} of {} untouched bytes can share extents ({fs})",
            human(shareable),
            human(plan.copied_bytes() - gathered)
        );
    }
    let names: Vec<String> = sides
        .iter()
        .map(|p| {
            p.file_name()
                .unwrap_or_default()
                .to_string_lossy()
                .into_owned()
        })
        .chain(generated_names(p))
        .collect();
    if !names.is_empty() {
        println!("  side files: {}", names.join(", "));
    }
    for c in &plan.config_changes {
        println!("  {c}");
    }
    for n in &plan.notes.lines {
        println!("  note: {}", crate::escape::name(n));
    }
    println!(
        "  memory: budget {} ({} threads); peak stays near the budget",
        human(opts.memory_budget),
        opts.threads
    );
    print_disk_line(needed, free);
}

/// The dry run's free-space line.
pub(crate) fn print_disk_line(needed: u64, free: Option<u64>) {
    match free {
        Some(f) => println!(
            "  disk: needs {}, {} free: {}",
            human(needed),
            human(f),
            if f >= needed { "ok" } else { "NOT ENOUGH" }
        ),
        None => println!("  disk: needs {}, free space unknown", human(needed)),
    }
}

/// Where computed tensors were (or will be) computed, for the summary line.
pub(crate) fn device_line(device: &Device) -> String {
    match (&device.gpu, &device.note) {
        (Some(_), _) => format!("computed on {}", device.name),
        (None, Some(why)) => format!("computed on the CPU (--device auto: {why})"),
        (None, None) => "computed on the CPU".into(),
    }
}

pub(crate) fn report_json(
    p: &Prepared,
    stats: Option<&pipeline::RunStats>,
    dry_run: bool,
) -> Value {
    let (command, ckpt, plan, layout, target, sides, opts, device, started) = (
        p.command, p.ckpt, p.plan, p.layout, p.target, p.sides, p.opts, p.device, p.started,
    );
    let gpu = device.gpu.as_ref().map(|g| {
        let c = &g.counters;
        let busy = c.busy_ns.load(std::sync::atomic::Ordering::Relaxed) as f64 / 1e9;
        json!({
            "chunks": c.chunks.load(std::sync::atomic::Ordering::Relaxed),
            "bytes_in": c.bytes_in.load(std::sync::atomic::Ordering::Relaxed),
            "bytes_out": c.bytes_out.load(std::sync::atomic::Ordering::Relaxed),
            "lane_busy_seconds": busy,
            "staging_bytes": stats.map(|s| s.gpu_staging_bytes),
            "host_registered_bytes": stats.map(|s| s.host_registered_bytes),
            "host_register_failed": stats.and_then(|s| s.host_register_failed.clone()),
            "direct_dma_bytes": c.bytes_direct.load(std::sync::atomic::Ordering::Relaxed),
            "unified_memory": g.integrated,
            "ptx": g.ptx,
        })
    });
    let ops: Vec<Value> = dtype_changes(ckpt, plan)
        .into_iter()
        .map(|(k, n, a, b)| json!({"op": k, "tensors": n, "bytes_in": a, "bytes_out": b}))
        .collect();
    let files: Vec<Value> = layout
        .shards
        .iter()
        .map(|s| {
            json!({
                "name": target.file_name().unwrap_or_else(|| s.file_name.clone()),
                "tensors": s.tensors.len(),
                "bytes": s.len,
            })
        })
        .collect();
    json!({
        "tftf_version": env!("CARGO_PKG_VERSION"),
        "command": command,
        "status": "ok",
        "dry_run": dry_run,
        "input": {
            "path": ckpt.input.to_string_lossy(),
            "format": ckpt.format.name(),
            "shards": ckpt.shards.iter().map(|s| s.path.to_string_lossy()).collect::<Vec<_>>(),
            "tensors": ckpt.base_count,
            "tensor_bytes": ckpt.total_bytes(),
        },
        "output": {
            "path": opts.output.to_string_lossy(),
            "files": files,
            "index": layout.has_index(),
            "side_files": sides.iter().map(|p| p.file_name().unwrap_or_default().to_string_lossy().into_owned()).chain(generated_names(p)).collect::<Vec<_>>(),
            "config_changes": plan.config_changes,
        },
        "tensors": {
            "written": plan.tensors.len(),
            "copied": plan.tensors.len() - plan.computed_count(),
            "computed": plan.computed_count(),
            "renamed": plan.renamed,
            "dropped": plan.dropped.len(),
        },
        "ops": ops,
        "notes": plan.notes.lines,
        "tensor_reports": tensor_reports(plan),
        "bytes": {
            "files": layout.total_file_bytes(),
            "tensors": plan.total_tensor_bytes(),
            "computed": stats.map(|s| s.bytes_computed),
            "reflinked": stats.map(|s| s.bytes_reflinked),
            "shareable_by_layout": layout.shareable_bytes(ckpt, plan),
            "copied_in_kernel": stats.map(|s| s.bytes_copied_in_kernel),
            "copied_through_memory": stats.map(|s| s.bytes_copied_user),
        },
        "reflink_unavailable": stats.and_then(|s| s.reflink_unavailable.clone()),
        "device": device.name,
        "device_note": device.note,
        "gpu": gpu,
        "threads": opts.threads,
        "io_threads": stats.map(|s| s.io_threads),
        "memory_budget_bytes": opts.memory_budget,
        "chunk_bytes": stats.map(|s| s.chunk_bytes),
        "pool_bytes": stats.map(|s| s.pool_bytes),
        "pool_peak_bytes": stats.map(|s| s.pool_peak_bytes),
        "wall_seconds": started.elapsed().as_secs_f64(),
        "peak_rss_bytes": sys::peak_rss(),
        "warnings": ckpt.warnings.iter().chain(&plan.notes.warnings).collect::<Vec<_>>(),
    })
}
