//! The conversion driver shared by `passthrough` and `run`: open, plan, check, then stream into
//! temporary files and commit them atomically.

use std::path::{Path, PathBuf};
use std::time::Instant;

use serde_json::{json, Value};

use crate::cli::WriteArgs;
use crate::error::{Error, Result};
use crate::format::checkpoint::Checkpoint;
use crate::gpu::{Device, DeviceRequest};
use crate::output::{check_output, resolve, side_files, OutputSet};
use crate::pipeline::{self, Cancel, PipelineConfig};
use crate::plan::{output_dir, output_kind_for, OutputKind, Plan, Recipe, Step};
use crate::size::{human, parse_size};
use crate::sys;

/// Resolved common options of every writing command.
pub struct WriteOptions {
    pub output: PathBuf,
    pub max_shard_bytes: Option<u64>,
    pub dry_run: bool,
    pub threads: usize,
    pub memory_budget: u64,
    pub quiet: bool,
    pub progress: bool,
    pub report: Option<PathBuf>,
    pub force: bool,
    pub kernel_copy: bool,
    pub device: DeviceRequest,
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

impl WriteOptions {
    pub fn from_args(w: &WriteArgs) -> Result<WriteOptions> {
        let threads = match w.threads {
            Some(0) => return Err(Error::Usage("--threads must be at least 1".into())),
            Some(n) => n,
            None => std::thread::available_parallelism().map_or(1, |n| n.get()),
        };
        Ok(WriteOptions {
            output: w.output.clone(),
            max_shard_bytes: w.max_shard_size.as_deref().map(parse_size).transpose()?,
            dry_run: w.dry_run,
            threads,
            memory_budget: parse_budget(w.memory_budget.as_deref())?,
            quiet: w.quiet,
            progress: !w.quiet && !w.no_progress,
            report: w.report.clone(),
            force: w.force,
            kernel_copy: !w.no_reflink,
            device: DeviceRequest::parse(&w.device)?,
        })
    }
}

pub fn convert(
    command: &str,
    input: &Path,
    steps: &[Step],
    opts: &WriteOptions,
    cancel: &Cancel,
) -> Result<()> {
    let started = Instant::now();
    let result = convert_inner(command, input, steps, opts, cancel, started);
    if let (Err(e), Some(path)) = (&result, &opts.report) {
        let report = json!({
            "tftf_version": env!("CARGO_PKG_VERSION"),
            "command": command,
            "status": "error",
            "error": e.to_string(),
            "wall_seconds": started.elapsed().as_secs_f64(),
        });
        let _ = write_report(path, &report);
    }
    result
}

fn convert_inner(
    command: &str,
    input: &Path,
    steps: &[Step],
    opts: &WriteOptions,
    cancel: &Cancel,
    started: Instant,
) -> Result<()> {
    let mut ckpt = Checkpoint::open(input)?;
    for step in steps {
        if let Step::Op(op_step) = step {
            op_step.attach(&mut ckpt)?;
        }
    }
    for w in &ckpt.warnings {
        eprintln!("warning: {}: {w}", input.display());
    }
    let kind = output_kind_for(&opts.output);
    let is_file = matches!(kind, OutputKind::File);
    check_output(&ckpt, &opts.output, is_file, opts.force)?;
    let plan = Plan::build(&ckpt, steps, kind.clone(), opts.max_shard_bytes)?;
    let data_budget = plan.data_budget(&ckpt, opts.memory_budget)?;
    let sides = if is_file {
        Vec::new()
    } else {
        side_files(&ckpt)
    };
    let side_bytes: u64 = sides
        .iter()
        .filter_map(|p| std::fs::metadata(p).ok())
        .map(|m| m.len())
        .sum();
    let out_dir = output_dir(&opts.output, &kind);
    // Bytes that will share extents with the input take no new space.
    let out_fs = sys::filesystem_name(&nearest_existing(&resolve(&out_dir)));
    let sharing =
        opts.kernel_copy && sys::can_reflink(out_fs) && same_filesystem(&ckpt.dir, &out_dir);
    let needed = plan.total_file_bytes() + side_bytes
        - if sharing {
            plan.shareable_bytes(&ckpt)
        } else {
            0
        };
    let free = sys::free_space(&nearest_existing(&resolve(&out_dir))).ok();
    // A GPU is opened only when asked for by name or when some op can use one.
    let device = if opts.device == DeviceRequest::Cpu
        || (opts.device == DeviceRequest::Auto && !plan.has_gpu_ops())
    {
        Device::cpu(None)
    } else {
        Device::open(&opts.device)?
    };

    if opts.dry_run {
        if !opts.quiet {
            print_plan(&ckpt, &plan, &out_dir, &sides, opts, needed, free);
            if plan.computed_count() > 0 {
                println!("{}", device_line(&device));
            }
        }
        if let Some(path) = &opts.report {
            let report = report_json(
                command, &ckpt, &plan, &sides, opts, &device, None, started, true,
            );
            write_report(path, &report)?;
        }
        return Ok(());
    }
    if let Some(free) = free {
        if free < needed {
            return Err(Error::NoSpace {
                path: out_dir,
                needed,
                available: free,
            });
        }
    }
    if cancel.is_raised() {
        return Err(Error::Cancelled);
    }

    let mut out = OutputSet::create(&out_dir)?;
    let mut files = Vec::with_capacity(plan.shards.len());
    let mut names = Vec::with_capacity(plan.shards.len());
    for shard in &plan.shards {
        let name = if is_file {
            opts.output
                .file_name()
                .expect("a .safetensors path has a file name")
                .to_string_lossy()
                .into_owned()
        } else {
            shard.file_name.clone()
        };
        let (file, tmp) = out.add(&name)?;
        file.set_len(shard.len).map_err(|e| Error::io(&tmp, e))?;
        if shard.clone_from.is_none() {
            use std::os::unix::fs::FileExt;
            file.write_all_at(&shard.header, 0)
                .map_err(|e| Error::io(&tmp, e))?;
        }
        files.push(file);
        names.push(tmp);
    }
    let progress = opts
        .progress
        .then(|| progress_bar(plan.total_tensor_bytes()));
    let cfg = PipelineConfig {
        threads: opts.threads,
        memory_budget: data_budget,
        cancel: cancel.clone(),
        progress: progress.clone(),
        kernel_copy: opts.kernel_copy,
        expect_reflink: sharing,
        gpu: device.gpu.clone(),
    };
    let stats = pipeline::execute(&ckpt, &plan, &files, &names, &cfg)?;
    if let Some(p) = &progress {
        p.finish_and_clear();
    }
    drop(files);
    if let Some(index) = plan.index_json() {
        out.add_bytes("model.safetensors.index.json", index.as_bytes())?;
    }
    for side in &sides {
        let name = side
            .file_name()
            .expect("listed files have names")
            .to_string_lossy();
        if name == "config.json" {
            if let Some(cfg) = &plan.config {
                let mut text = serde_json::to_string_pretty(cfg).expect("JSON object");
                text.push('\n');
                out.add_bytes("config.json", text.as_bytes())?;
                continue;
            }
        }
        out.add_copy(&name, side)?;
    }
    if cancel.is_raised() {
        return Err(Error::Cancelled);
    }
    out.commit(opts.force)?;
    if !opts.quiet {
        let secs = started.elapsed().as_secs_f64();
        println!(
            "wrote {} file(s), {} tensors, {} to {} in {:.2} s ({}/s): {} shared with the input (reflink), {} copied in the kernel, {} through memory, {} computed",
            plan.shards.len(),
            plan.tensors.len(),
            human(plan.total_file_bytes()),
            opts.output.display(),
            secs,
            human((plan.total_tensor_bytes() as f64 / secs.max(1e-9)) as u64),
            human(stats.bytes_reflinked),
            human(stats.bytes_copied_in_kernel),
            human(stats.bytes_copied_user),
            human(stats.bytes_computed),
        );
        if plan.computed_count() > 0 {
            println!("{}", device_line(&device));
        }
    }
    if let (false, Some(why)) = (opts.quiet, &stats.reflink_unavailable) {
        eprintln!("note: untouched tensors were copied, not shared: {why}");
    }
    if let Some(path) = &opts.report {
        let report = report_json(
            command,
            &ckpt,
            &plan,
            &sides,
            opts,
            &device,
            Some(&stats),
            started,
            false,
        );
        write_report(path, &report)?;
    }
    Ok(())
}

fn same_filesystem(a: &Path, b: &Path) -> bool {
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

fn nearest_existing(p: &Path) -> PathBuf {
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

fn progress_bar(total: u64) -> indicatif::ProgressBar {
    let pb = indicatif::ProgressBar::with_draw_target(
        Some(total),
        indicatif::ProgressDrawTarget::stderr(),
    );
    pb.set_style(
        indicatif::ProgressStyle::with_template(
            "{bar:40} {bytes}/{total_bytes} {binary_bytes_per_sec} ETA {eta}",
        )
        .expect("valid template"),
    );
    pb
}

fn write_report(path: &Path, report: &Value) -> Result<()> {
    let mut text = serde_json::to_string_pretty(report).expect("JSON value");
    text.push('\n');
    std::fs::write(path, text).map_err(|e| Error::io(path, e))
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

fn print_plan(
    ckpt: &Checkpoint,
    plan: &Plan,
    out_dir: &Path,
    sides: &[PathBuf],
    opts: &WriteOptions,
    needed: u64,
    free: Option<u64>,
) {
    println!(
        "plan: {} of {} input tensors -> {} file(s) in {} (dry run: nothing written)",
        plan.tensors.len(),
        ckpt.base_count,
        plan.shards.len(),
        out_dir.display()
    );
    for s in &plan.shards {
        println!(
            "  {:<40} {:>12}  {} tensors",
            if matches!(plan.kind, OutputKind::File) {
                opts.output
                    .file_name()
                    .unwrap_or_default()
                    .to_string_lossy()
                    .into_owned()
            } else {
                s.file_name.clone()
            },
            human(s.len),
            s.tensors.len()
        );
    }
    if plan.index_json().is_some() {
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
    let fs = sys::filesystem_name(&nearest_existing(&resolve(out_dir)));
    let shareable = plan.shareable_bytes(ckpt);
    if !opts.kernel_copy {
        println!("  reflink: off (--no-reflink): untouched bytes are copied through memory");
    } else if !sys::can_reflink(fs) {
        println!(
            "  reflink: the output filesystem ({fs}) cannot share extents; {} will be copied in the kernel",
            human(plan.copied_bytes())
        );
    } else if !same_filesystem(&ckpt.dir, out_dir) {
        println!("  reflink: input and output are on different filesystems; untouched bytes will be copied");
    } else {
        println!(
            "  reflink: {} of {} untouched bytes can share extents ({fs})",
            human(shareable),
            human(plan.copied_bytes())
        );
    }
    if !sides.is_empty() {
        let names: Vec<String> = sides
            .iter()
            .map(|p| {
                p.file_name()
                    .unwrap_or_default()
                    .to_string_lossy()
                    .into_owned()
            })
            .collect();
        println!("  side files: {}", names.join(", "));
    }
    for c in &plan.config_changes {
        println!("  {c}");
    }
    for n in &plan.notes.lines {
        println!("  note: {n}");
    }
    println!(
        "  memory: budget {} ({} threads); peak stays near the budget",
        human(opts.memory_budget),
        opts.threads
    );
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
fn device_line(device: &Device) -> String {
    match (&device.gpu, &device.note) {
        (Some(_), _) => format!("computed on {}", device.name),
        (None, Some(why)) => format!("computed on the CPU (--device auto: {why})"),
        (None, None) => "computed on the CPU".into(),
    }
}

#[allow(clippy::too_many_arguments)]
fn report_json(
    command: &str,
    ckpt: &Checkpoint,
    plan: &Plan,
    sides: &[PathBuf],
    opts: &WriteOptions,
    device: &Device,
    stats: Option<&pipeline::RunStats>,
    started: Instant,
    dry_run: bool,
) -> Value {
    let gpu = device.gpu.as_ref().map(|g| {
        let c = &g.counters;
        let busy = c.busy_ns.load(std::sync::atomic::Ordering::Relaxed) as f64 / 1e9;
        json!({
            "chunks": c.chunks.load(std::sync::atomic::Ordering::Relaxed),
            "bytes_in": c.bytes_in.load(std::sync::atomic::Ordering::Relaxed),
            "bytes_out": c.bytes_out.load(std::sync::atomic::Ordering::Relaxed),
            "lane_busy_seconds": busy,
            "staging_bytes": stats.map(|s| s.gpu_staging_bytes),
            "unified_memory": g.integrated,
            "ptx": g.ptx,
        })
    });
    let ops: Vec<Value> = dtype_changes(ckpt, plan)
        .into_iter()
        .map(|(k, n, a, b)| json!({"op": k, "tensors": n, "bytes_in": a, "bytes_out": b}))
        .collect();
    let files: Vec<Value> = plan
        .shards
        .iter()
        .map(|s| {
            json!({
                "name": if matches!(plan.kind, OutputKind::File) {
                    opts.output.file_name().unwrap_or_default().to_string_lossy().into_owned()
                } else {
                    s.file_name.clone()
                },
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
            "path": ckpt.input,
            "shards": ckpt.shards.iter().map(|s| s.path.clone()).collect::<Vec<_>>(),
            "tensors": ckpt.base_count,
            "tensor_bytes": ckpt.total_bytes(),
        },
        "output": {
            "path": opts.output,
            "files": files,
            "index": plan.index_json().is_some(),
            "side_files": sides.iter().map(|p| p.file_name().unwrap_or_default().to_string_lossy().into_owned()).collect::<Vec<_>>(),
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
            "files": plan.total_file_bytes(),
            "tensors": plan.total_tensor_bytes(),
            "computed": stats.map(|s| s.bytes_computed),
            "reflinked": stats.map(|s| s.bytes_reflinked),
            "shareable_by_layout": plan.shareable_bytes(ckpt),
            "copied_in_kernel": stats.map(|s| s.bytes_copied_in_kernel),
            "copied_through_memory": stats.map(|s| s.bytes_copied_user),
        },
        "reflink_unavailable": stats.and_then(|s| s.reflink_unavailable.clone()),
        "device": device.name,
        "device_note": device.note,
        "gpu": gpu,
        "threads": opts.threads,
        "memory_budget_bytes": opts.memory_budget,
        "chunk_bytes": stats.map(|s| s.chunk_bytes),
        "pool_peak_bytes": stats.map(|s| s.pool_peak_bytes),
        "wall_seconds": started.elapsed().as_secs_f64(),
        "peak_rss_bytes": sys::peak_rss(),
        "warnings": ckpt.warnings,
    })
}
