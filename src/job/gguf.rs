//! How the dry run and the report describe a GGUF job: architecture, every file and tensor
//! with its ggml type and recipe, copied and congruent bytes.

use std::collections::HashMap;

use serde_json::{json, Value as Json};

use super::describe::print_disk_line;
use super::prepared::{nearest_existing, same_filesystem, Prepared};
use crate::output::resolve;
use crate::pipeline::RunStats;
use crate::sink::gguf::layout::FilePlan;
use crate::sink::gguf::recipe::OutputTensor;
use crate::sink::gguf::sink::{file_type_name, recipe_kind, report_fields, GgufModel, GgufSink};
use crate::size::human;
use crate::sys;

/// The files as the GGUF layout planned them, with their names and byte counts.
struct FilesInfo<'a> {
    plans: &'a [FilePlan],
    names: Vec<String>,
    /// Bytes of tensors copied unchanged, and of those at offsets congruent with the source.
    copied: u64,
    congruent: u64,
}

impl FilesInfo<'_> {
    fn of(g: &GgufSink) -> FilesInfo<'_> {
        let plans = g.laid_out();
        let names = g.file_names(plans.len());
        let (copied, congruent) = plans.iter().fold((0, 0), |(a, b), f| {
            let (c, s) = f.copied_and_congruent_bytes();
            (a + c, b + s)
        });
        FilesInfo {
            plans,
            names,
            copied,
            congruent,
        }
    }

    fn shared_fraction(&self) -> f64 {
        if self.copied == 0 {
            0.0
        } else {
            self.congruent as f64 / self.copied as f64
        }
    }

    fn tensor_bytes(&self) -> u64 {
        self.plans
            .iter()
            .flat_map(|p| &p.tensors)
            .map(|t| t.spec.byte_len)
            .sum()
    }
}

/// The dry run's plan of a GGUF job: architecture, every file and tensor, bytes, reflink.
pub(crate) fn print_plan(p: &Prepared, g: &GgufSink, needed: u64, free: Option<u64>) {
    let model = g.model();
    let info = FilesInfo::of(g);
    let n: usize = info.plans.iter().map(|f| f.tensors.len()).sum();
    outln!(
        "plan: {} input tensors -> {} GGUF tensors in {} file(s) in {} (dry run: nothing written)",
        p.ckpt.tensors.len(),
        n,
        info.plans.len(),
        p.target.dir.display()
    );
    outln!(
        "  architecture: {} ({}), outtype {}, general.file_type {}",
        model.cfg.spec.gguf_arch,
        model
            .cfg
            .map
            .get("architectures")
            .and_then(|a| a.get(0))
            .and_then(Json::as_str)
            .unwrap_or("?"),
        file_type_name(model.file_type),
        model.file_type.id()
    );
    let by_name: HashMap<&str, &OutputTensor> =
        model.outputs.iter().map(|o| (o.name.as_str(), o)).collect();
    for (plan, name) in info.plans.iter().zip(&info.names) {
        print_file(plan, name, model, &by_name);
    }
    outln!(
        "  bytes: {} copied unchanged ({} at offsets congruent with the input: shared fraction {:.3}), {} computed",
        human(info.copied),
        human(info.congruent),
        info.shared_fraction(),
        human(info.tensor_bytes() - info.copied)
    );
    print_reflink_line(p, &info);
    outln!(
        "  memory: budget {} ({} threads)",
        human(p.opts.memory_budget),
        p.opts.threads
    );
    print_disk_line(needed, free);
}

fn print_file(
    plan: &FilePlan,
    name: &str,
    model: &GgufModel,
    by_name: &HashMap<&str, &OutputTensor>,
) {
    outln!(
        "  {:<40} {:>12}  {} tensors, header {}",
        name,
        human(plan.file_len),
        plan.tensors.len(),
        human(plan.data_start)
    );
    for t in &plan.tensors {
        let how = match (t.spec.source, t.congruent) {
            (None, _) => {
                let o = by_name[t.spec.name.as_str()];
                match model.reads_computed(o) {
                    // Of a weight an earlier step (a merge) computes as the encoder reads it.
                    true => format!("computed + {}", recipe_kind(o)),
                    false => recipe_kind(o).to_string(),
                }
            }
            (Some(_), true) => "copy, shareable".to_string(),
            (Some(_), false) => "copy".to_string(),
        };
        outln!(
            "    {:<36} {:<6} {:<20} {:>10}  {}",
            t.spec.name,
            t.spec.ty.name(),
            format!("{:?}", t.spec.shape),
            human(t.spec.byte_len),
            how
        );
    }
}

fn print_reflink_line(p: &Prepared, info: &FilesInfo) {
    let out_fs = sys::filesystem_name(&nearest_existing(&resolve(&p.target.dir)));
    if !p.opts.kernel_copy {
        outln!("  reflink: off (--no-reflink): unchanged bytes are copied through memory");
    } else if !sys::can_reflink(out_fs) {
        outln!(
            "  reflink: the output filesystem ({out_fs}) cannot share extents; unchanged bytes are copied in the kernel"
        );
    } else if !same_filesystem(&p.ckpt.dir, &p.target.dir) {
        outln!("  reflink: input and output are on different filesystems; unchanged bytes will be copied");
    } else {
        outln!(
            "  reflink: {} of {} unchanged bytes can share extents ({out_fs})",
            human(info.congruent),
            human(info.copied),
        );
    }
}

/// The report of a GGUF job.
pub(crate) fn report_json(
    p: &Prepared,
    g: &GgufSink,
    stats: Option<&RunStats>,
    dry_run: bool,
) -> Json {
    let (ckpt, opts) = (p.ckpt, p.opts);
    let info = FilesInfo::of(g);
    let mut gguf = report_fields(g.model(), info.plans, &info.names);
    let files = gguf["files"].take();
    let mut report = json!({
        "tftf_version": env!("CARGO_PKG_VERSION"),
        "command": "gguf",
        "status": "ok",
        "dry_run": dry_run,
        "input": {
            "path": ckpt.input.to_string_lossy(),
            "format": ckpt.format.name(),
            "tensors": ckpt.tensors.len(),
            "tensor_bytes": ckpt.tensors.iter().map(|t| t.info.nbytes()).sum::<u64>(),
        },
        "output": {
            "path": opts.output.to_string_lossy(),
            "files": files,
        },
        "bytes": {
            "files": info.plans.iter().map(|f| f.file_len).sum::<u64>(),
            "tensors": info.tensor_bytes(),
            "copied_unchanged": info.copied,
            "congruent": info.congruent,
            "reflinked": stats.map(|s| s.bytes_reflinked),
            "copied_in_kernel": stats.map(|s| s.bytes_copied_in_kernel),
            "copied_through_memory": stats.map(|s| s.bytes_copied_user),
            "computed": stats.map(|s| s.bytes_computed),
        },
        "shared_fraction": info.shared_fraction(),
        "reflink_layout": p.sharing,
        "reflink_unavailable": stats.and_then(|s| s.reflink_unavailable.clone()),
        "device": p.device.name,
        "device_note": p.device.note,
        "gpu": super::report::gpu_json(p.device, stats),
        "threads": opts.threads,
        "io_threads": stats.map(|s| s.io_threads),
        "memory_budget_bytes": opts.memory_budget,
        "chunk_bytes": stats.map(|s| s.chunk_bytes),
        "pool_peak_bytes": stats.map(|s| s.pool_peak_bytes),
        "wall_seconds": p.started.elapsed().as_secs_f64(),
        "peak_rss_bytes": sys::peak_rss(),
        "warnings": ckpt.warnings,
    });
    if let (Json::Object(r), Json::Object(extra)) = (&mut report, gguf) {
        r.extend(extra);
    }
    report
}
