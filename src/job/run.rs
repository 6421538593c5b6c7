//! One run of a job: open and plan, choose the sink, then write every file under a temporary
//! name and commit them together (or hand over to `parts` for `--part`/`--resume`).

use std::path::{Path, PathBuf};
use std::time::Instant;

use serde_json::Value;

use super::*;
use crate::error::{Error, Result};
use crate::format::checkpoint::Checkpoint;
use crate::gpu::{Device, DeviceRequest};
use crate::output::checksum::{
    hash_bytes, hash_file, manifest_json, sums_text, TensorRange, MANIFEST_NAME, SUMS_NAME,
};
use crate::output::{
    resolve, side_files, write_report, Claim, InputFiles, OutputSet, OutputTarget, INDEX_NAME,
};
use crate::pipeline::{self, Cancel, Resources};
use crate::plan::{Plan, Step};
use crate::sink::gguf::GgufSink;
use crate::sink::{output_kind_for, Layout, OutputKind, Safetensors, Sink};
use crate::size::human;
use crate::sys;

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

    /// Where the output goes: a `.gguf` file is always a file (an existing directory there is
    /// refused by `resolve_as`), in a directory.
    fn target<'a>(
        &self,
        output: &Path,
        ckpt: &Checkpoint,
        inputs: &'a InputFiles,
    ) -> Result<OutputTarget<'a>> {
        match self {
            OutputSink::Safetensors(_) => OutputTarget::resolve(output, ckpt, inputs),
            OutputSink::Gguf(_) => OutputTarget::resolve_as(output, OutputKind::File, ckpt, inputs),
        }
    }
}

/// Opens and plans `job`, then runs it once or as a part.
pub(super) fn run(
    job: &Job,
    cancel: &Cancel,
    started: Instant,
    inputs_seen: &mut Option<InputFiles>,
) -> Result<Value> {
    let (command, input, steps, opts) = (job.command, job.source, job.steps, job.options);
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
    let all_sides = side_files(&ckpt)?;
    let inputs = inputs_seen.insert(InputFiles::of(&ckpt, &all_sides));
    let target = sink.target(&opts.output, &ckpt, inputs)?;
    let mut steps = steps.to_vec();
    steps.extend(sink.as_sink().steps(&ckpt)?);
    let plan = Plan::build(&ckpt, &steps)?;
    for w in plan.notes.warnings.iter().filter(|_| !opts.silent) {
        errln!(
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
        return super::parts::run(&run, cancel);
    }
    single_run(&run, out_fs, cancel)
}

/// Names of the files a single run commits, the model files first; refuses checksums beside
/// a single `.safetensors` file.
pub(crate) fn output_names(run: &Prepared, checksums: bool) -> Result<Vec<String>> {
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
        print_any_plan(run, needed, free);
        print_claim(claim);
        if run.plan.computed_count() > 0 {
            outln!("{}", device_line(run.device));
        }
    }
    let report = any_report_json(run, None, true);
    if let Some(path) = &opts.report {
        write_report(path, &report)?;
    }
    Ok(report)
}

/// The dry run's plan, in its format's shape.
pub(crate) fn print_any_plan(run: &Prepared, needed: u64, free: Option<u64>) {
    match run.sink {
        OutputSink::Gguf(g) => super::gguf::print_plan(run, g, needed, free),
        OutputSink::Safetensors(_) => print_plan(run, needed, free),
    }
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
    let stats = pipeline::execute(
        &Resources::new(plan, &cfg),
        run.ckpt,
        plan,
        layout,
        &files,
        &tmp_names,
        &cfg,
    )?;
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
        // The name byte for byte: a side file named in another encoding keeps its name.
        let name = side.file_name().expect("listed files have names");
        if let (true, Some(cfg)) = (name == "config.json", &plan.config) {
            let mut text = serde_json::to_string_pretty(cfg).expect("JSON object");
            text.push('\n');
            add(out, "config.json", text.as_bytes(), &mut sums)?;
            continue;
        }
        if checksums {
            sums.push(hash_file(side, name, Vec::new())?);
        }
        out.add_copy(name, side)?;
    }
    for (name, text) in generated_files(run) {
        add(out, name, text.as_bytes(), &mut sums)?;
    }
    if checksums {
        out.add_bytes(SUMS_NAME, &sums_text(&sums))?;
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
    outln!(
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
        outln!("replaced {}", claim.replaced.join(", "));
    }
    if !claim.deleted.is_empty() {
        outln!(
            "removed {} model file(s) of the earlier output: {}",
            claim.deleted.len(),
            claim.deleted.join(", ")
        );
    }
    if plan.computed_count() > 0 {
        outln!("{}", device_line(run.device));
    }
    if let Some(line) = crate::ops::quantize::requant::summary(&tensor_reports(plan)) {
        outln!("{line}");
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
            errln!("info: untouched tensors were copied, not shared with the input: {why}");
        } else {
            errln!("info: untouched tensors were copied; the output filesystem ({out_fs}) cannot share extents with the input");
        }
    }
    if let Some(why) = &stats.host_register_failed {
        errln!("info: pool buffers not registered with the GPU driver, copies go through staging buffers: {why}");
    }
}
