//! What a dry run prints: the plan, what `--force` will do, the disk and device lines.

use super::*;
use crate::gpu::Device;
use crate::output::{resolve, Claim};
use crate::size::human;
use crate::sys;

/// What `--force` will do to the existing output, for `--dry-run`.
pub(crate) fn print_claim(claim: &Claim) {
    if claim.interrupted_commit {
        outln!("  first finishes the commit a killed run left half done in the output");
    }
    if !claim.orphans.is_empty() {
        outln!(
            "  first removes {} temporary file(s) of killed runs: {}",
            claim.orphans.len(),
            claim.orphans.join(", ")
        );
    }
    if !claim.replaced.is_empty() {
        outln!("  replaces: {}", claim.replaced.join(", "));
    }
    if !claim.deleted.is_empty() {
        outln!(
            "  deletes (model files of the earlier output): {}",
            claim.deleted.join(", ")
        );
    }
}

pub(crate) fn print_plan(p: &Prepared, needed: u64, free: Option<u64>) {
    let (ckpt, plan, layout, target, sides, opts) =
        (p.ckpt, p.plan, p.layout, p.target, p.sides, p.opts);
    outln!(
        "plan: {} of {} input tensors -> {} file(s) in {} (dry run: nothing written)",
        plan.tensors.len(),
        ckpt.base_count,
        layout.shards.len(),
        target.dir.display()
    );
    let out_dir = target.dir.as_path();
    for s in &layout.shards {
        outln!(
            "  {:<40} {:>12}  {} tensors",
            target.file_name().unwrap_or_else(|| s.file_name.clone()),
            human(s.len),
            s.tensors.len()
        );
    }
    if layout.has_index() {
        outln!("  model.safetensors.index.json");
    }
    for (k, n, a, b) in dtype_changes(ckpt, plan) {
        outln!("  {k}: {n} tensors, {} -> {}", human(a), human(b));
    }
    outln!("  renamed {}, dropped {}", plan.renamed, plan.dropped.len());
    outln!(
        "  bytes: {} copied unchanged, {} computed",
        human(plan.copied_bytes()),
        human(plan.total_tensor_bytes() - plan.copied_bytes())
    );
    let gathered = plan.gathered_bytes(ckpt);
    if gathered > 0 {
        outln!(
            "  gathered: {} of the unchanged bytes are strided views or chunk grids, read through memory",
            human(gathered)
        );
    }
    let fs = sys::filesystem_name(&nearest_existing(&resolve(out_dir)));
    let shareable = layout.shareable_bytes(ckpt, plan);
    if !opts.kernel_copy {
        outln!("  reflink: off (--no-reflink): untouched bytes are copied through memory");
    } else if !sys::can_reflink(fs) {
        outln!(
            "  reflink: the output filesystem ({fs}) cannot share extents; {} will be copied in the kernel",
            human(plan.copied_bytes() - gathered)
        );
    } else if !same_filesystem(&ckpt.dir, out_dir) {
        outln!("  reflink: input and output are on different filesystems; untouched bytes will be copied");
    } else {
        outln!(
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
        outln!("  side files: {}", names.join(", "));
    }
    for c in &plan.config_changes {
        outln!("  {c}");
    }
    for n in &plan.notes.lines {
        outln!("  note: {}", crate::escape::name(n));
    }
    outln!(
        "  memory: budget {} ({} threads); peak stays near the budget",
        human(opts.memory_budget),
        opts.threads
    );
    print_disk_line(needed, free);
}

/// The dry run's free-space line.
pub(crate) fn print_disk_line(needed: u64, free: Option<u64>) {
    match free {
        Some(f) => outln!(
            "  disk: needs {}, {} free: {}",
            human(needed),
            human(f),
            if f >= needed { "ok" } else { "NOT ENOUGH" }
        ),
        None => outln!("  disk: needs {}, free space unknown", human(needed)),
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
