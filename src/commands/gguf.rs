//! `tftf gguf`: a Hugging Face checkpoint to a GGUF file (or `gguf-split` set) that llama.cpp
//! loads. Everything is decided from the headers and `config.json`/`tokenizer.json` before
//! any output exists (architecture, hyperparameters, tokenizer, tensor plan, file layout);
//! then each tensor is either copied (a byte-identical tensor: reflink where its offset is
//! congruent with the source's, else `copy_file_range`) or produced in row chunks bounded by
//! the memory budget, into temporary files that are committed atomically under the output
//! directory's lock.

use std::collections::HashMap;
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use serde_json::{json, Value as Json};

use crate::cli::GgufArgs;
use crate::commands::convert::{nearest_existing, open_output, same_filesystem};
use crate::error::{Error, Result};
use crate::format::checkpoint::{Checkpoint, TensorRef};
use crate::format::dtype::DType;
use crate::gpu::DeviceRequest;
use crate::ops::fp8::{config_block_size, resolve_layout, scale_candidates, DequantFp8, ScaleMode};
use crate::ops::Op;
use crate::output::{
    check_report_path, resolve, side_files, write_report, InputFiles, OutputTarget,
};
use crate::pipeline::Cancel;
use crate::progress::Progress;
use crate::sink::gguf::arch::{self, Config, InputTensor, OutputTensor, Recipe};
use crate::sink::gguf::layout::{
    self, FilePlan, LayoutOptions, SourceRange, SplitLimits, TensorSpec,
};
use crate::sink::gguf::quant::{MXFP4_BLOCK_ELEMS, MXFP4_SRC_BLOCK_BYTES};
use crate::sink::gguf::{produce, tokenizer, FileType, GgmlType};
use crate::sink::OutputKind;
use crate::size::human;
use crate::sys;

/// Upper bound on the working memory of one produced chunk.
const MAX_CHUNK_BYTES: u64 = 64 << 20;

/// Resolved options of `tftf gguf`.
pub struct GgufOptions {
    pub output: PathBuf,
    /// `None`: `--outtype auto`.
    pub file_type: Option<FileType>,
    /// 0: no split.
    pub split_max_bytes: u64,
    pub arch: Option<String>,
    pub vocab_pre: Option<String>,
    pub dry_run: bool,
    pub threads: usize,
    pub memory_budget: u64,
    pub quiet: bool,
    pub progress: crate::progress::Mode,
    pub progress_interval: Duration,
    pub verbose: bool,
    pub report: Option<PathBuf>,
    pub force: bool,
    pub kernel_copy: bool,
}

impl GgufOptions {
    pub fn from_args(a: &GgufArgs) -> Result<GgufOptions> {
        let r = &a.run;
        let threads = r.thread_count()?;
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
        // Accepted for uniformity; the GGUF transforms are CPU code.
        DeviceRequest::parse(&a.device)?;
        if a.output.file_name().is_none() {
            return Err(Error::Usage(format!(
                "-o {}: name the output file (OUT.gguf)",
                a.output.display()
            )));
        }
        Ok(GgufOptions {
            output: a.output.clone(),
            file_type: match a.outtype.as_str() {
                "auto" => None,
                t => Some(FileType::parse(t).ok_or_else(|| {
                    Error::Usage(format!("--outtype `{t}`: use auto, f32, f16, bf16 or q8_0"))
                })?),
            },
            split_max_bytes,
            arch: a.arch.clone(),
            vocab_pre: a.vocab_pre.clone(),
            dry_run: r.dry_run,
            threads,
            memory_budget: r.budget()?,
            quiet: r.quiet,
            progress: r.progress_mode()?,
            progress_interval: r.progress_interval()?,
            verbose: r.verbose,
            report: r.report.clone(),
            force: a.force,
            kernel_copy: !a.no_reflink,
        })
    }
}

/// Where the unchanged bytes of a tensor lie in the input: one contiguous range of one file.
/// `id` numbers the files for the layout planner.
pub struct SourceLoc<'a> {
    pub id: u32,
    pub file: &'a File,
    pub path: &'a Path,
    pub offset: u64,
}

/// The one place that knows how a checkpoint tensor maps onto file ranges: `None` when the
/// tensor is not one contiguous range (assembled from pieces), so it is read, not shared.
fn contiguous_source<'a>(ckpt: &'a Checkpoint, t: &TensorRef) -> Option<SourceLoc<'a>> {
    let (file, offset) = t.contiguous()?;
    let shard = ckpt.shards.get(file)?;
    Some(SourceLoc {
        id: file as u32,
        file: &shard.file,
        path: &shard.path,
        offset,
    })
}

/// Runs `tftf gguf`; on failure writes an error report when `--report` is given.
pub fn run(input: &Path, opts: &GgufOptions, cancel: &Cancel) -> Result<()> {
    let started = Instant::now();
    let mut inputs = None;
    let result = run_inner(input, opts, cancel, started, &mut inputs);
    if let (Err(e), Some(path)) = (&result, &opts.report) {
        let report = json!({
            "tftf_version": env!("CARGO_PKG_VERSION"),
            "command": "gguf",
            "status": "error",
            "error": e.to_string(),
            "wall_seconds": started.elapsed().as_secs_f64(),
        });
        if check_report_path(path, inputs.as_ref()).is_ok() {
            let _ = write_report(path, &report);
        }
    }
    result
}

/// `config.json` as the converter reads it, with `--arch` replacing `architectures`.
fn load_config(ckpt: &Checkpoint, arch_override: Option<&str>) -> Result<Config> {
    let path = ckpt.dir.join("config.json");
    let map = ckpt.config()?.ok_or_else(|| Error::GgufConfig {
        path: path.clone(),
        msg:
            "missing: the GGUF's architecture and hyperparameters come from the model's config.json"
                .into(),
    })?;
    let mut json = Json::Object(map);
    if let Some(a) = arch_override {
        let spec = arch::ARCHS
            .iter()
            .find(|s| s.hf_classes.contains(&a))
            .or_else(|| arch::ARCHS.iter().find(|s| s.gguf_arch == a));
        let class = match spec {
            Some(s) => s.hf_classes[0],
            None => {
                return Err(arch::lookup(a)
                    .err()
                    .unwrap_or_else(|| Error::Usage(format!("--arch {a}"))))
            }
        };
        json["architectures"] = json!([class]);
    }
    Config::from_json(&path, json)
}

/// `general.name`: the model directory's name (the reference derives a display name from it).
fn model_name(ckpt: &Checkpoint) -> String {
    resolve(&ckpt.dir)
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| "model".into())
}

fn recipe_kind(t: &OutputTensor) -> &'static str {
    match &t.recipe {
        Recipe::Direct { .. } if t.copy_source().is_some() => "copy",
        Recipe::Direct { .. } => "cast",
        Recipe::Rows { .. } => "rows",
        Recipe::Stack { .. } => "stack",
        Recipe::KvBK { .. } => "kv_b split",
        Recipe::Mxfp4 { .. } => "mxfp4 repack",
        Recipe::Values(_) => "computed",
    }
}

fn file_type_name(ft: FileType) -> &'static str {
    match ft {
        FileType::AllF32 => "f32",
        FileType::MostlyF16 => "f16",
        FileType::MostlyBf16 => "bf16",
        FileType::MostlyQ8_0 => "q8_0",
    }
}

#[derive(Default)]
struct Stats {
    reflinked: u64,
    copied_kernel: u64,
    copied_user: u64,
    computed: u64,
    reflink_refused: Option<String>,
}

fn run_inner(
    input: &Path,
    opts: &GgufOptions,
    cancel: &Cancel,
    started: Instant,
    inputs_seen: &mut Option<InputFiles>,
) -> Result<()> {
    let ckpt = Checkpoint::open(input)?;
    crate::escape::print_input_notes(&ckpt, opts.quiet);
    let sides = side_files(&ckpt);
    let inputs = inputs_seen.insert(InputFiles::of(&ckpt, &sides));

    // 1. Architecture, hyperparameters, tokenizer: all from small files.
    let cfg = load_config(&ckpt, opts.arch.as_deref())?;
    let fp8 = fp8_weights(&ckpt, &cfg)?;
    let scales: std::collections::HashSet<&str> = fp8.values().map(|f| f.scale.as_str()).collect();
    // The reference reads shard by shard, each shard's tensors in name order (safetensors'
    // `keys()`), and emits them in that order (also what `auto` looks at first).
    let mut in_order: Vec<&crate::format::checkpoint::TensorRef> = ckpt.tensors.iter().collect();
    in_order.sort_by(|a, b| {
        (shard_of(&a.placement), a.name()).cmp(&(shard_of(&b.placement), b.name()))
    });
    let in_tensors: Vec<InputTensor> = in_order
        .into_iter()
        .filter(|t| !scales.contains(t.name()))
        .map(|t| InputTensor {
            name: t.name().to_string(),
            // FP8 weights are dequantised in f32, as the reference does, then converted.
            dtype: if fp8.contains_key(t.name()) {
                DType::F32
            } else {
                t.info.dtype
            },
            shape: t.info.shape.clone(),
        })
        .collect();
    let file_type = opts
        .file_type
        .unwrap_or_else(|| arch::resolve_auto_file_type(&in_tensors));
    let mut metadata = arch::model_kvs(&cfg, file_type, &model_name(&ckpt))?;
    let tok_json = ckpt.dir.join("tokenizer.json");
    if !tok_json.is_file() {
        return Err(Error::GgufTokenizer {
            path: tok_json,
            msg: "missing: the GGUF needs the model's tokenizer.json (a BPE tokenizer)".into(),
        });
    }
    let vocab = tokenizer::vocab_kvs(
        &ckpt.dir,
        cfg.u64(&["vocab_size"]),
        opts.vocab_pre.as_deref(),
    )?;
    for (k, v) in vocab.iter() {
        metadata.set(k, v.clone());
    }

    // 2. Tensors: names, shapes, types, recipes; which are plain copies and where they lie.
    let outputs = arch::plan_tensors(&cfg, &in_tensors, file_type)?;
    for o in &outputs {
        let ok = match &o.recipe {
            Recipe::Mxfp4 { .. } | Recipe::Values(_) => true,
            _ => matches!(o.src_dtype, Some(DType::F32 | DType::F16 | DType::BF16)),
        };
        if !ok {
            return Err(Error::GgufTensor {
                tensor: o.name.clone(),
                msg: format!(
                    "source dtype {} cannot be written as {} (F32, F16 and BF16 sources only)",
                    o.src_dtype.map_or("?".into(), |d| d.to_string()),
                    o.ty.name()
                ),
            });
        }
    }
    let copy_loc = |o: &OutputTensor| {
        let src = ckpt.get(o.copy_source()?)?;
        if src.info.nbytes() != o.byte_len() || Some(src.info.dtype) != o.src_dtype {
            return None;
        }
        contiguous_source(&ckpt, src)
    };
    let specs: Vec<TensorSpec> = outputs
        .iter()
        .map(|o| TensorSpec {
            name: o.name.clone(),
            ty: o.ty,
            shape: o.shape.clone(),
            byte_len: o.byte_len(),
            source: copy_loc(o).map(|l| SourceRange {
                file: l.id,
                offset: l.offset,
            }),
        })
        .collect();

    // 3. The output: where, whether extents can be shared, the layout of every file.
    let target = OutputTarget::resolve_as(&opts.output, OutputKind::File, &ckpt, inputs)?;
    if opts.output.is_dir() {
        return Err(Error::Other(format!(
            "output {} is a directory; name the .gguf file",
            opts.output.display()
        )));
    }
    let out_dir = target.dir.clone();
    let out_fs = sys::filesystem_name(&nearest_existing(&resolve(&out_dir)));
    let same_fs = same_filesystem(&ckpt.dir, &out_dir);
    let sharing = opts.kernel_copy && sys::can_reflink(out_fs) && same_fs;
    let layout_opts = LayoutOptions {
        reflink_block: sharing.then_some(layout::REFLINK_BLOCK_BYTES),
        ..LayoutOptions::default()
    };
    let plans = layout::plan(
        &metadata,
        specs,
        SplitLimits {
            max_tensors: 0,
            max_bytes: opts.split_max_bytes,
        },
        layout_opts,
    )?;
    let file_name = opts
        .output
        .file_name()
        .expect("checked in from_args")
        .to_string_lossy()
        .into_owned();
    let names: Vec<String> = if plans.len() == 1 {
        vec![file_name]
    } else {
        let stem = file_name.strip_suffix(".gguf").unwrap_or(&file_name);
        (0..plans.len())
            .map(|i| layout::split_file_name(stem, i, plans.len()))
            .collect()
    };
    if let Some(report) = &opts.report {
        target.check_report(report, &names)?;
    }
    let claim = target.claim_files(&names, opts.force)?;
    let total_file: u64 = plans.iter().map(|p| p.file_len).sum();
    let total_tensor: u64 = plans
        .iter()
        .flat_map(|p| &p.tensors)
        .map(|t| t.spec.byte_len)
        .sum();
    let (copied, congruent) = plans.iter().fold((0, 0), |(a, b), p| {
        let (c, s) = p.copied_and_congruent_bytes();
        (a + c, b + s)
    });
    let needed = total_file - if sharing { congruent } else { 0 };
    let free = sys::free_space(&nearest_existing(&resolve(&out_dir))).ok();
    let by_name: HashMap<&str, &OutputTensor> =
        outputs.iter().map(|o| (o.name.as_str(), o)).collect();
    let info = PlanInfo {
        cfg: &cfg,
        file_type,
        plans: &plans,
        names: &names,
        by_name: &by_name,
        copied,
        congruent,
        sharing,
        out_fs,
        same_fs,
    };

    if opts.dry_run {
        if !opts.quiet {
            print_plan(&ckpt, &info, opts, &target, needed, free);
            for n in &claim.replaced {
                println!("  replaces: {n}");
            }
        }
        if let Some(path) = &opts.report {
            write_report(path, &report_json(&ckpt, &info, opts, None, started, true))?;
        }
        return Ok(());
    }
    // 4. Write: temporaries under the lock, then one commit.
    let mut out = open_output(&target, needed, free, opts.quiet, cancel)?;
    let claim = target.claim_files(&names, opts.force)?;
    let mut files = Vec::with_capacity(plans.len());
    let mut tmp_names = Vec::with_capacity(plans.len());
    for (plan, name) in plans.iter().zip(&names) {
        let (file, tmp) = out.add(name)?;
        file.set_len(plan.file_len)
            .map_err(|e| Error::io(&tmp, e))?;
        file.write_all_at(&plan.header, 0)
            .map_err(|e| Error::io(&tmp, e))?;
        files.push(file);
        tmp_names.push(tmp);
    }
    let progress = (opts.progress != crate::progress::Mode::Off).then(|| {
        Progress::new(
            "gguf",
            names.clone(),
            plans
                .iter()
                .map(|p| p.tensors.iter().map(|t| t.spec.byte_len).sum())
                .collect(),
            total_tensor,
            opts.progress_interval,
            opts.progress,
        )
    });
    let mut stats = Stats::default();
    let mut copy = CopyState {
        kernel_copy: opts.kernel_copy,
        reflink: sharing,
        scratch: Vec::new(),
    };
    // Working memory of one chunk: half the budget, and no more than 64 MiB, past which larger
    // chunks only cost page faults and cache misses.
    let chunk_budget = (opts.memory_budget / 2).clamp(1 << 20, MAX_CHUNK_BYTES);
    for (fi, plan) in plans.iter().enumerate() {
        for pt in &plan.tensors {
            if cancel.is_raised() {
                return Err(Error::Cancelled);
            }
            let o = by_name[pt.spec.name.as_str()];
            let len = pt.spec.byte_len;
            match copy_loc(o) {
                Some(loc) => copy_range(
                    &loc,
                    &files[fi],
                    &tmp_names[fi],
                    pt.offset,
                    len,
                    &mut copy,
                    &mut stats,
                )?,
                None => {
                    produce_tensor(
                        &Sources {
                            ckpt: &ckpt,
                            fp8: &fp8,
                        },
                        o,
                        &files[fi],
                        &tmp_names[fi],
                        pt.offset,
                        chunk_budget,
                        opts.threads,
                        cancel,
                    )?;
                    stats.computed += len;
                }
            }
            if let Some(p) = &progress {
                p.advance(fi, len);
            }
        }
    }
    if let Some(p) = &progress {
        p.finish();
    }
    drop(files);
    if cancel.is_raised() {
        return Err(Error::Cancelled);
    }
    out.commit(&[])?;
    if !opts.quiet {
        let secs = started.elapsed().as_secs_f64();
        println!(
            "wrote {} file(s), {} tensors, {} to {} in {:.2} s ({}/s): {} shared with the input (reflink), {} copied in the kernel, {} through memory, {} computed",
            plans.len(),
            outputs.len(),
            human(total_file),
            opts.output.display(),
            secs,
            human((total_tensor as f64 / secs.max(1e-9)) as u64),
            human(stats.reflinked),
            human(stats.copied_kernel),
            human(stats.copied_user),
            human(stats.computed),
        );
        if !claim.replaced.is_empty() {
            println!("replaced {}", claim.replaced.join(", "));
        }
    }
    if let (true, false, Some(why)) = (opts.verbose, opts.quiet, &stats.reflink_refused) {
        eprintln!("info: unchanged tensors were copied, not shared with the input: {why}");
    }
    crate::commands::convert::publish_report(opts.report.as_deref(), opts.progress, "gguf", || {
        report_json(&ckpt, &info, opts, Some(&stats), started, false)
    });
    Ok(())
}

struct PlanInfo<'a> {
    cfg: &'a Config,
    file_type: FileType,
    plans: &'a [FilePlan],
    names: &'a [String],
    by_name: &'a HashMap<&'a str, &'a OutputTensor>,
    /// Bytes of tensors copied unchanged, and of those at offsets congruent with the source.
    copied: u64,
    congruent: u64,
    sharing: bool,
    out_fs: &'static str,
    same_fs: bool,
}

impl PlanInfo<'_> {
    fn shared_fraction(&self) -> f64 {
        if self.copied == 0 {
            0.0
        } else {
            self.congruent as f64 / self.copied as f64
        }
    }
}

fn print_plan(
    ckpt: &Checkpoint,
    info: &PlanInfo,
    opts: &GgufOptions,
    target: &OutputTarget,
    needed: u64,
    free: Option<u64>,
) {
    let n: usize = info.plans.iter().map(|p| p.tensors.len()).sum();
    println!(
        "plan: {} input tensors -> {} GGUF tensors in {} file(s) in {} (dry run: nothing written)",
        ckpt.tensors.len(),
        n,
        info.plans.len(),
        target.dir.display()
    );
    println!(
        "  architecture: {} ({}), outtype {}, general.file_type {}",
        info.cfg.spec.gguf_arch,
        info.cfg
            .map
            .get("architectures")
            .and_then(|a| a.get(0))
            .and_then(Json::as_str)
            .unwrap_or("?"),
        file_type_name(info.file_type),
        info.file_type.id()
    );
    for (plan, name) in info.plans.iter().zip(info.names) {
        println!(
            "  {:<40} {:>12}  {} tensors, header {}",
            name,
            human(plan.file_len),
            plan.tensors.len(),
            human(plan.data_start)
        );
        for t in &plan.tensors {
            let o = info.by_name[t.spec.name.as_str()];
            let how = match (t.spec.source, t.congruent) {
                (Some(_), true) => "copy, shareable",
                (Some(_), false) => "copy",
                (None, _) => recipe_kind(o),
            };
            println!(
                "    {:<36} {:<6} {:<20} {:>10}  {}",
                t.spec.name,
                t.spec.ty.name(),
                format!("{:?}", t.spec.shape),
                human(t.spec.byte_len),
                how
            );
        }
    }
    let total: u64 = info
        .plans
        .iter()
        .flat_map(|p| &p.tensors)
        .map(|t| t.spec.byte_len)
        .sum();
    println!(
        "  bytes: {} copied unchanged ({} at offsets congruent with the input: shared fraction {:.3}), {} computed",
        human(info.copied),
        human(info.congruent),
        info.shared_fraction(),
        human(total - info.copied)
    );
    if !opts.kernel_copy {
        println!("  reflink: off (--no-reflink): unchanged bytes are copied through memory");
    } else if !sys::can_reflink(info.out_fs) {
        println!(
            "  reflink: the output filesystem ({}) cannot share extents; unchanged bytes are copied in the kernel",
            info.out_fs
        );
    } else if !info.same_fs {
        println!("  reflink: input and output are on different filesystems; unchanged bytes will be copied");
    } else {
        println!(
            "  reflink: {} of {} unchanged bytes can share extents ({})",
            human(info.congruent),
            human(info.copied),
            info.out_fs
        );
    }
    println!(
        "  memory: budget {} ({} threads)",
        human(opts.memory_budget),
        opts.threads
    );
    crate::commands::convert::print_disk_line(needed, free);
}

fn report_json(
    ckpt: &Checkpoint,
    info: &PlanInfo,
    opts: &GgufOptions,
    stats: Option<&Stats>,
    started: Instant,
    dry_run: bool,
) -> Json {
    let files: Vec<Json> = info
        .plans
        .iter()
        .zip(info.names)
        .map(|(p, n)| {
            let (c, s) = p.copied_and_congruent_bytes();
            json!({
                "name": n,
                "tensors": p.tensors.len(),
                "bytes": p.file_len,
                "header_bytes": p.data_start,
                "copied_bytes": c,
                "congruent_bytes": s,
            })
        })
        .collect();
    let mut types: std::collections::BTreeMap<&str, (u64, u64)> = Default::default();
    for t in info.plans.iter().flat_map(|p| &p.tensors) {
        let e = types.entry(t.spec.ty.name()).or_default();
        e.0 += 1;
        e.1 += t.spec.byte_len;
    }
    let total: u64 = types.values().map(|v| v.1).sum();
    json!({
        "tftf_version": env!("CARGO_PKG_VERSION"),
        "command": "gguf",
        "status": "ok",
        "dry_run": dry_run,
        "input": {
            "path": ckpt.input.to_string_lossy(),
            "tensors": ckpt.tensors.len(),
            "tensor_bytes": ckpt.tensors.iter().map(|t| t.info.nbytes()).sum::<u64>(),
        },
        "architecture": info.cfg.spec.gguf_arch,
        "outtype": file_type_name(info.file_type),
        "file_type": info.file_type.id(),
        "output": {
            "path": opts.output.to_string_lossy(),
            "files": files,
        },
        "tensor_types": types.iter().map(|(k, (n, b))| json!({"type": k, "tensors": n, "bytes": b})).collect::<Vec<_>>(),
        "bytes": {
            "files": info.plans.iter().map(|p| p.file_len).sum::<u64>(),
            "tensors": total,
            "copied_unchanged": info.copied,
            "congruent": info.congruent,
            "reflinked": stats.map(|s| s.reflinked),
            "copied_in_kernel": stats.map(|s| s.copied_kernel),
            "copied_through_memory": stats.map(|s| s.copied_user),
            "computed": stats.map(|s| s.computed),
        },
        "shared_fraction": info.shared_fraction(),
        "reflink_layout": info.sharing,
        "reflink_unavailable": stats.and_then(|s| s.reflink_refused.clone()),
        "threads": opts.threads,
        "memory_budget_bytes": opts.memory_budget,
        "wall_seconds": started.elapsed().as_secs_f64(),
        "peak_rss_bytes": sys::peak_rss(),
        "warnings": ckpt.warnings,
    })
}

/// How unchanged bytes move; each method is dropped for the rest of the run at its first
/// "not supported here" error.
struct CopyState {
    kernel_copy: bool,
    reflink: bool,
    scratch: Vec<u8>,
}

/// Copies `len` bytes from the input range `src` to `dst` at `offset`: the block-aligned middle
/// is cloned (`FICLONERANGE`) when the offsets are congruent, the rest goes through
/// `copy_file_range`, or through a bounded buffer where that is unavailable.
fn copy_range(
    src: &SourceLoc,
    dst: &File,
    dst_path: &Path,
    offset: u64,
    len: u64,
    st: &mut CopyState,
    stats: &mut Stats,
) -> Result<()> {
    let block = sys::block_size(dst);
    let mut done = 0u64;
    if st.reflink && src.offset % block == offset % block {
        let head = (block - src.offset % block) % block;
        let middle = len.saturating_sub(head) / block * block;
        if middle > 0 {
            copy_plain(
                src,
                src.offset,
                dst,
                dst_path,
                offset,
                head.min(len),
                st,
                stats,
            )?;
            match sys::clone_range(src.file, src.offset + head, dst, offset + head, middle) {
                Ok(()) => {
                    stats.reflinked += middle;
                    done = head + middle;
                }
                Err(e) if sys::is_unsupported(&e) => {
                    st.reflink = false;
                    stats.reflink_refused = Some(format!(
                        "{e} ({} on {})",
                        sys::filesystem_name(dst_path),
                        dst_path
                            .parent()
                            .map_or("?".into(), |p| p.display().to_string())
                    ));
                    done = head.min(len);
                }
                Err(e) => return Err(Error::io(dst_path, e)),
            }
        }
    }
    copy_plain(
        src,
        src.offset + done,
        dst,
        dst_path,
        offset + done,
        len - done,
        st,
        stats,
    )?;
    sys::drop_cache(src.file, src.offset, len);
    Ok(())
}

#[allow(clippy::too_many_arguments)]
fn copy_plain(
    src: &SourceLoc,
    src_offset: u64,
    dst: &File,
    dst_path: &Path,
    offset: u64,
    len: u64,
    st: &mut CopyState,
    stats: &mut Stats,
) -> Result<()> {
    let mut done = 0u64;
    while done < len && st.kernel_copy {
        match sys::copy_file_range(src.file, src_offset + done, dst, offset + done, len - done) {
            Ok(0) => {
                return Err(Error::io(
                    src.path,
                    std::io::Error::new(
                        std::io::ErrorKind::UnexpectedEof,
                        "file shrank while being read",
                    ),
                ))
            }
            Ok(n) => {
                done += n;
                stats.copied_kernel += n;
            }
            Err(e) if sys::is_unsupported(&e) => st.kernel_copy = false,
            Err(e) => return Err(Error::io(dst_path, e)),
        }
    }
    if done < len {
        let piece = (len - done).min(8 << 20) as usize;
        st.scratch.resize(piece, 0);
        while done < len {
            let n = ((len - done) as usize).min(piece);
            src.file
                .read_exact_at(&mut st.scratch[..n], src_offset + done)
                .map_err(|e| Error::io(src.path, e))?;
            dst.write_all_at(&st.scratch[..n], offset + done)
                .map_err(|e| Error::io(dst_path, e))?;
            done += n as u64;
            stats.copied_user += n as u64;
        }
    }
    Ok(())
}

/// The shard a tensor's bytes (its first ones) lie in.
fn shard_of(p: &crate::format::source::Placement) -> usize {
    use crate::format::source::Placement;
    match p {
        Placement::Contiguous { file, .. } | Placement::Strided { file, .. } => *file,
        Placement::Regions(r) => r.first().map_or(0, |r| shard_of(&r.placement)),
    }
}

/// Source bytes of one output chunk, in output order.
enum Gathered {
    /// `count * inner` source elements.
    Elems(Vec<u8>),
    /// MXFP4 source blocks (16 bytes per 32 elements) and scales (1 byte), per output row.
    Mxfp4 { blocks: Vec<u8>, scales: Vec<u8> },
}

/// An FP8 weight and how it is dequantised (to f32, as the reference does before converting).
struct Fp8Weight {
    scale: String,
    op: DequantFp8,
}

/// FP8 (E4M3/E5M2) weights with their scales (`X_scale_inv`, `X_scale`, `.scale`; blocks from
/// `quantization_config.weight_block_size` or inferred from the shapes).
fn fp8_weights(ckpt: &Checkpoint, cfg: &Config) -> Result<HashMap<String, Fp8Weight>> {
    let block = config_block_size(&cfg.map).map_err(|msg| Error::GgufConfig {
        path: cfg.path.clone(),
        msg,
    })?;
    let mut out = HashMap::new();
    for t in &ckpt.tensors {
        if !matches!(t.info.dtype, DType::F8_E4M3 | DType::F8_E5M2) {
            continue;
        }
        let bad = |msg: String| Error::GgufTensor {
            tensor: t.name().to_string(),
            msg,
        };
        let found = scale_candidates(t.name(), ScaleMode::Multiply)
            .into_iter()
            .find_map(|(n, mode)| {
                let s = ckpt.get(&n)?;
                matches!(
                    s.info.dtype,
                    DType::F32 | DType::BF16 | DType::F16 | DType::F8_E8M0
                )
                .then_some((n, mode, s))
            });
        let Some((scale, mode, s)) = found else {
            return Err(bad(format!(
                "{} weight without a scale (`{}_scale_inv`)",
                t.info.dtype,
                t.name()
            )));
        };
        let (layout, _) = resolve_layout(&t.info.shape, &s.info.shape, block).map_err(bad)?;
        out.insert(
            t.name().to_string(),
            Fp8Weight {
                scale,
                op: DequantFp8 {
                    weight_dtype: t.info.dtype,
                    scale_dtype: Some(s.info.dtype),
                    layout,
                    mode,
                    dst: DType::F32,
                    allow_nonfinite: false,
                },
            },
        );
    }
    Ok(out)
}

/// The checkpoint as the planner sees it: FP8 weights read as f32 rows, dequantised on the fly.
struct Sources<'a> {
    ckpt: &'a Checkpoint,
    fp8: &'a HashMap<String, Fp8Weight>,
}

impl Sources<'_> {
    fn get(&self, t: &OutputTensor, name: &str) -> Result<&TensorRef> {
        self.ckpt.get(name).ok_or_else(|| Error::GgufTensor {
            tensor: t.name.clone(),
            msg: format!("source `{name}` is not in the checkpoint"),
        })
    }

    /// Reads `buf.len()` bytes from byte `at` of `src` (of its f32 form for an FP8 weight).
    fn read(&self, src: &TensorRef, at: u64, buf: &mut [u8]) -> Result<()> {
        let Some(f) = self.fp8.get(src.name()) else {
            return self.ckpt.read_tensor_at(src, at, buf);
        };
        let row = f.op.layout.cols * 4;
        let (r0, r1) = (at / row, (at + buf.len() as u64).div_ceil(row));
        let ranges = f.op.input_ranges(r0..r1);
        let mut inputs: Vec<Vec<u8>> = Vec::with_capacity(2);
        for (k, r) in ranges.iter().enumerate() {
            let t = if k == 0 {
                src
            } else {
                self.ckpt.get(&f.scale).expect("found when planning")
            };
            let mut b = vec![0u8; (r.end - r.start) as usize];
            self.ckpt.read_tensor_at(t, r.start, &mut b)?;
            inputs.push(b);
        }
        let refs: Vec<&[u8]> = inputs.iter().map(Vec::as_slice).collect();
        let mut rows = vec![0u8; ((r1 - r0) * row) as usize];
        f.op.compute(r0..r1, &refs, &mut rows)
            .map_err(|msg| Error::GgufTensor {
                tensor: src.name().to_string(),
                msg,
            })?;
        let off = (at - r0 * row) as usize;
        buf.copy_from_slice(&rows[off..off + buf.len()]);
        Ok(())
    }
}

/// Appends units `units` (each `unit` bytes, indices into `src`) to `out`: reading the span
/// they cover at once when it is dense enough, else each run of consecutive units.
fn gather_units(
    srcs: &Sources,
    src: &TensorRef,
    units: &[u64],
    unit: u64,
    out: &mut Vec<u8>,
) -> Result<()> {
    let (Some(&lo), Some(&hi)) = (units.iter().min(), units.iter().max()) else {
        return Ok(());
    };
    let span = (hi - lo + 1) * unit;
    if span <= 4 * units.len() as u64 * unit {
        let mut buf = vec![0u8; span as usize];
        srcs.read(src, lo * unit, &mut buf)?;
        for &j in units {
            let at = ((j - lo) * unit) as usize;
            out.extend_from_slice(&buf[at..at + unit as usize]);
        }
        return Ok(());
    }
    let mut k = 0;
    while k < units.len() {
        let mut n = 1;
        while k + n < units.len() && units[k + n] == units[k] + n as u64 {
            n += 1;
        }
        let start = out.len();
        out.resize(start + n * unit as usize, 0);
        srcs.read(src, units[k] * unit, &mut out[start..])?;
        k += n;
    }
    Ok(())
}

/// Reads what output rows `[first, first + count)` of `t` need.
fn gather(srcs: &Sources, t: &OutputTensor, first: u64, count: u64) -> Result<Gathered> {
    let (inner, rows, _) = produce::row_geometry(t);
    let es = t.src_dtype.and_then(DType::size).unwrap_or(1) as u64;
    let mut out = Vec::new();
    match &t.recipe {
        Recipe::Direct { src } => {
            let s = srcs.get(t, src)?;
            out.resize((count * inner * es) as usize, 0);
            srcs.read(s, first * inner * es, &mut out)?;
        }
        Recipe::Rows {
            src,
            map,
            row_elems,
        } => {
            let s = srcs.get(t, src)?;
            let per_row = inner / row_elems;
            let units: Vec<u64> = (first * per_row..(first + count) * per_row)
                .map(|k| map.source_row(k))
                .collect();
            gather_units(srcs, s, &units, row_elems * es, &mut out)?;
        }
        Recipe::Stack { srcs: names } => {
            let per_expert = rows / names.len() as u64;
            let row = inner * es;
            let mut r = first;
            while r < first + count {
                let x = r / per_expert;
                let end = ((x + 1) * per_expert).min(first + count);
                let s = srcs.get(t, &names[x as usize])?;
                let start = out.len();
                out.resize(start + ((end - r) * row) as usize, 0);
                srcs.read(s, (r % per_expert) * row, &mut out[start..])?;
                r = end;
            }
        }
        Recipe::KvBK {
            src, nope, v, lora, ..
        } => {
            // Output row (h, l) holds kv_b[h * (nope + v) + n][l] for n in 0..nope.
            let s = srcs.get(t, src)?;
            let (h0, h1) = (first / lora, (first + count - 1) / lora);
            let head_rows = nope + v;
            let begin = h0 * head_rows * lora * es;
            let end = (h1 * head_rows + nope) * lora * es;
            let mut buf = vec![0u8; (end - begin) as usize];
            srcs.read(s, begin, &mut buf)?;
            out.reserve((count * inner * es) as usize);
            for r in first..first + count {
                let (h, l) = (r / lora, r % lora);
                for n in 0..*nope {
                    let at = (((h - h0) * head_rows + n) * lora + l) * es;
                    out.extend_from_slice(&buf[at as usize..(at + es) as usize]);
                }
            }
        }
        Recipe::Mxfp4 {
            blocks,
            scales,
            map,
        } => {
            let groups = inner / MXFP4_BLOCK_ELEMS as u64;
            let units: Vec<u64> = (first..first + count)
                .map(|r| map.map_or(r, |m| m.source_row(r)))
                .collect();
            let mut b = Vec::new();
            let mut sc = Vec::new();
            gather_units(
                srcs,
                srcs.get(t, blocks)?,
                &units,
                groups * MXFP4_SRC_BLOCK_BYTES as u64,
                &mut b,
            )?;
            gather_units(srcs, srcs.get(t, scales)?, &units, groups, &mut sc)?;
            return Ok(Gathered::Mxfp4 {
                blocks: b,
                scales: sc,
            });
        }
        Recipe::Values(_) => unreachable!("computed tensors are produced whole"),
    }
    Ok(Gathered::Elems(out))
}

/// Converts gathered rows `[a, a + n)` of a chunk into `out`.
fn convert_rows(
    t: &OutputTensor,
    g: &Gathered,
    a: u64,
    n: u64,
    inner: u64,
    out: &mut [u8],
) -> Result<()> {
    let shape = vec![n, inner];
    match g {
        Gathered::Elems(b) => {
            let es = t.src_dtype.and_then(DType::size).unwrap_or(1) as u64;
            let src = &b[(a * inner * es) as usize..((a + n) * inner * es) as usize];
            let syn = OutputTensor {
                name: t.name.clone(),
                shape,
                ty: t.ty,
                recipe: Recipe::Direct { src: String::new() },
                src_dtype: t.src_dtype,
            };
            produce::write_rows(&syn, &|_| Some(src), 0, n, out)
        }
        Gathered::Mxfp4 { blocks, scales } => {
            let groups = inner / MXFP4_BLOCK_ELEMS as u64;
            let bb = groups * MXFP4_SRC_BLOCK_BYTES as u64;
            let b = &blocks[(a * bb) as usize..((a + n) * bb) as usize];
            let s = &scales[(a * groups) as usize..((a + n) * groups) as usize];
            let syn = OutputTensor {
                name: t.name.clone(),
                shape,
                ty: GgmlType::Mxfp4,
                recipe: Recipe::Mxfp4 {
                    blocks: "b".into(),
                    scales: "s".into(),
                    map: None,
                },
                src_dtype: None,
            };
            produce::write_rows(&syn, &|k| Some(if k == "b" { b } else { s }), 0, n, out)
        }
    }
}

/// Produces tensor `t` into `dst` at `offset`, in row chunks of about `budget` bytes of
/// working memory, converting each chunk on up to `threads` threads.
#[allow(clippy::too_many_arguments)]
fn produce_tensor(
    srcs: &Sources,
    t: &OutputTensor,
    dst: &File,
    dst_path: &Path,
    offset: u64,
    budget: u64,
    threads: usize,
    cancel: &Cancel,
) -> Result<()> {
    let (inner, rows, row_bytes) = produce::row_geometry(t);
    if let Recipe::Values(_) = t.recipe {
        let mut buf = vec![0u8; (rows * row_bytes) as usize];
        produce::write_rows(t, &|_| None, 0, rows, &mut buf)?;
        return dst
            .write_all_at(&buf, offset)
            .map_err(|e| Error::io(dst_path, e));
    }
    let src_row = match t.recipe {
        Recipe::Mxfp4 { .. } => {
            inner / MXFP4_BLOCK_ELEMS as u64 * (MXFP4_SRC_BLOCK_BYTES as u64 + 1)
        }
        _ => inner * t.src_dtype.and_then(DType::size).unwrap_or(4) as u64,
    };
    // Gathered rows, a span read up to 4× as large, the converter's copy and f32 values, and
    // the output rows.
    let per_row = 6 * src_row + 4 * inner + row_bytes;
    // Two chunks in flight (one read ahead while the other converts): half the budget each.
    let chunk_rows = (budget / 2 / per_row.max(1)).clamp(1, rows.max(1));
    if rows <= chunk_rows {
        let g = gather(srcs, t, 0, rows)?;
        return convert_and_write(t, &g, 0, rows, threads, dst, dst_path, offset);
    }
    std::thread::scope(|s| {
        let (tx, rx) = std::sync::mpsc::sync_channel::<Result<(u64, u64, Gathered)>>(1);
        s.spawn(move || {
            let mut first = 0;
            while first < rows && !cancel.is_raised() {
                let count = chunk_rows.min(rows - first);
                let g = gather(srcs, t, first, count);
                let failed = g.is_err();
                if tx.send(g.map(|g| (first, count, g))).is_err() || failed {
                    return;
                }
                first += count;
            }
        });
        let mut done = 0;
        for msg in rx {
            let (first, count, g) = msg?;
            convert_and_write(t, &g, first, count, threads, dst, dst_path, offset)?;
            done += count;
        }
        if done < rows {
            return Err(Error::Cancelled);
        }
        Ok(())
    })
}

/// Converts gathered rows `[first, first + count)` (on up to `threads` threads) and writes
/// them at their place.
#[allow(clippy::too_many_arguments)]
fn convert_and_write(
    t: &OutputTensor,
    g: &Gathered,
    first: u64,
    count: u64,
    threads: usize,
    dst: &File,
    dst_path: &Path,
    offset: u64,
) -> Result<()> {
    let (inner, _, row_bytes) = produce::row_geometry(t);
    let mut out = vec![0u8; (count * row_bytes) as usize];
    let per_thread = if count * inner < (1 << 16) || threads <= 1 {
        count
    } else {
        count.div_ceil(threads as u64)
    };
    if per_thread >= count {
        convert_rows(t, g, 0, count, inner, &mut out)?;
    } else {
        std::thread::scope(|s| {
            let handles: Vec<_> = out
                .chunks_mut((per_thread * row_bytes) as usize)
                .enumerate()
                .map(|(i, o)| {
                    let a = i as u64 * per_thread;
                    let n = o.len() as u64 / row_bytes;
                    s.spawn(move || convert_rows(t, g, a, n, inner, o))
                })
                .collect();
            handles
                .into_iter()
                .try_for_each(|h| h.join().expect("converter thread panicked"))
        })?;
    }
    dst.write_all_at(&out, offset + first * row_bytes)
        .map_err(|e| Error::io(dst_path, e))
}
