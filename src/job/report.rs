//! The JSON report of a run (`--report`, the last `--progress json` line, the library's
//! `Report`), in its format's shape.

use std::path::Path;

use serde_json::{json, Value};

use super::*;
use crate::format::checkpoint::Checkpoint;
use crate::gpu::Device;
use crate::output::write_report;
use crate::pipeline::{self};
use crate::plan::{Plan, Recipe};
use crate::progress::Mode as ProgressMode;
use crate::sys;

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

/// Per-tensor figures: those known at plan time, then those the ops gathered while running.
pub(crate) fn tensor_reports(plan: &Plan) -> Vec<Value> {
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

pub(crate) fn dtype_changes(ckpt: &Checkpoint, plan: &Plan) -> Vec<(String, usize, u64, u64)> {
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

/// The report's `gpu` section: what the device's lanes did (`null` on the CPU).
pub(crate) fn gpu_json(device: &Device, stats: Option<&pipeline::RunStats>) -> Option<Value> {
    device.gpu.as_ref().map(|g| {
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
    })
}

pub(crate) fn report_json(
    p: &Prepared,
    stats: Option<&pipeline::RunStats>,
    dry_run: bool,
) -> Value {
    let (command, ckpt, plan, layout, target, sides, opts, device, started) = (
        p.command, p.ckpt, p.plan, p.layout, p.target, p.sides, p.opts, p.device, p.started,
    );
    let gpu = gpu_json(device, stats);
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
