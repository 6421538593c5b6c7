//! One job of a partitioned (`--part K/N`) or resumable (`--resume`) run: writes the output
//! shards assigned to it, each committed on its own and recorded, then (for `--resume` alone,
//! or `--finalize` on the last part) finalizes. See [`crate::output::parts`].

use std::collections::HashSet;
use std::ffi::OsString;
use std::fs::{File, OpenOptions};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use serde_json::{json, Value};

use super::*;
use crate::error::{Error, Result};
use crate::output::checksum::{hash_file, TensorRange};
use crate::output::commit::{crash_point, is_temp_for, temp_name, temp_os_name, temporaries};
use crate::output::parts::{
    self, assign, lock_path, read_part_records, refuse_while_finalizing, shard_groups,
    staged_side_dir, Finalized, Fingerprint, LeaseLock, NotReady, PartRecord, PartSpec,
    ShardRecord,
};
use crate::pipeline::{self, Cancel, Resources, RunStats};
use crate::progress::Progress;
use crate::sink::{Layout, OutputKind};
use crate::size::human;

/// A part's shard temporaries: removed when dropped before [`Temps::keep`], and if a signal
/// ends the process.
struct Temps(Vec<PathBuf>);

impl Temps {
    fn push(&mut self, tmp: PathBuf) {
        crate::signals::remove_on_exit(&tmp);
        self.0.push(tmp);
    }

    /// The temporaries are renamed into place: nothing to remove any more.
    fn keep(&mut self) {
        for t in self.0.drain(..) {
            crate::signals::keep_on_exit(&t);
        }
    }
}

impl Drop for Temps {
    fn drop(&mut self) {
        for t in &self.0 {
            let _ = std::fs::remove_file(t);
            crate::signals::keep_on_exit(t);
        }
    }
}

pub(crate) fn run(p: &Prepared, cancel: &Cancel) -> Result<Value> {
    let opts = p.opts;
    let part = opts.part.unwrap_or(PartSpec { k: 1, n: 1 });
    let label = part.label();
    let finalize_after = opts.finalize || opts.part.is_none();
    let safetensors_file =
        p.target.file_name().is_some() || !matches!(p.target.kind, OutputKind::Dir);
    if matches!(p.sink, OutputSink::Safetensors(_)) && safetensors_file {
        return Err(Error::Usage(
            "--part and --resume write a directory of shards: give a directory as -o".into(),
        ));
    }
    let dir = p.target.dir.clone();
    let checksums = opts.checksums.unwrap_or(true);
    let layout = p.layout;
    let config_text = p.plan.config.as_ref().map(|c| {
        let mut t = serde_json::to_string_pretty(c).expect("JSON object");
        t.push('\n');
        t
    });
    let fp = Fingerprint::new(
        &opts.arguments,
        p.ckpt,
        p.sides,
        p.plan,
        layout,
        config_text.as_deref(),
    );
    let digest = fp.digest();
    let part_of = assign(p.ckpt, p.plan, layout, part.n);
    let mine: Vec<usize> = (0..layout.shards.len())
        .filter(|&s| part_of[s] == part.k - 1)
        .collect();
    // Side files: the input's (config.json as edited), then those the plan generates.
    let side_names: Vec<OsString> = p
        .sides
        .iter()
        .map(|s| s.file_name().unwrap_or_default().to_os_string())
        .chain(generated_files(p).iter().map(|(n, _)| n.into()))
        .collect();
    if let Some(report) = &opts.report {
        let mut names = output_names(p, false)?;
        names.push(parts::PARTS_DIR.into());
        p.target.check_report(report, &names)?;
    }
    let sub = |shards: &[usize]| Layout {
        kind: OutputKind::Dir,
        shards: shards.iter().map(|&s| layout.shards[s].clone()).collect(),
    };
    let my_sides: &[PathBuf] = if part.k == 1 { p.sides } else { &[] };
    let needed = p.needed_bytes(&sub(&mine), my_sides);
    let free = p.free_space();

    if opts.dry_run {
        if !opts.quiet {
            print_any_plan(p, needed, free);
            print_assignment(p, part, &part_of);
        }
        let mut r = any_report_json(p, None, true);
        r["part"] = part_json(part, &mine, layout, &[], &[]);
        if let Some(path) = &opts.report {
            crate::output::write_report(path, &r)?;
        }
        return Ok(r);
    }
    open_space_check(&dir, needed, free, cancel)?;
    // A commit a killed plain run journalled would be finished by the next plain run; the
    // parts must not write beside it.
    if dir.join(crate::output::commit::JOURNAL_NAME).exists() {
        return Err(Error::Other(format!(
            "{} holds a commit a killed run left half done: run `tftf recover {}` first",
            dir.display(),
            dir.display()
        )));
    }
    let created = p.target.create_for_parts()?;
    let result = write_part(p, cancel, part, &fp, &digest, &mine, &side_names, checksums);
    let (written, kept, stats) = match result {
        Ok(r) => r,
        Err(e) => {
            crate::output::remove_dirs_if_empty(&dir, &created);
            return Err(e);
        }
    };
    let secs = p.started.elapsed().as_secs_f64();
    if !opts.quiet {
        let bytes: u64 = written.iter().map(|&s| layout.shards[s].len).sum();
        outln!(
            "{label}: wrote {} of its {} shard(s) ({} kept from the earlier run), {} to {} in {secs:.2} s",
            written.len(),
            mine.len(),
            kept.len(),
            human(bytes),
            dir.display(),
        );
        if p.plan.computed_count() > 0 && !written.is_empty() {
            outln!("{}", device_line(p.device));
        }
    }
    let finalized = if finalize_after {
        let outcome = if opts.part.is_none() {
            Ok(parts::finalize(&dir, opts.force)?)
        } else {
            parts::try_finalize(&dir, opts.force)?
        };
        match outcome {
            Ok(f) => {
                if !opts.quiet {
                    print_finalized(&dir, &f);
                }
                Some(f)
            }
            Err(NotReady::Waiting(why)) => {
                if !opts.quiet {
                    outln!("{label}: not finalizing yet: {why}; the last part to finish with --finalize (or `tftf finalize {}`) completes the output", dir.display());
                }
                None
            }
            Err(NotReady::Elsewhere(why)) => {
                if !opts.quiet {
                    outln!("{label}: {why}");
                }
                None
            }
        }
    } else {
        if !opts.quiet {
            outln!(
                "{label}: done; when all {} parts are, run `tftf finalize {}`",
                part.n,
                dir.display()
            );
        }
        None
    };
    let mut r = any_report_json(p, Some(&stats), false);
    r["part"] = part_json(part, &mine, layout, &written, &kept);
    r["finalized"] = Value::from(finalized.is_some());
    publish_report(opts.report.as_deref(), opts.progress, p.command, &r);
    Ok(r)
}

pub fn print_finalized(dir: &Path, f: &Finalized) {
    if let Some(note) = &f.finished_interrupted {
        outln!("finalized {}: {note}", dir.display());
        return;
    }
    outln!(
        "finalized {}: {} part(s), {} shard(s), {}; wrote {}",
        dir.display(),
        f.parts,
        f.shards,
        human(f.bytes),
        if f.written.is_empty() {
            "nothing else".to_string()
        } else {
            f.written.join(", ")
        }
    );
    if !f.deleted.is_empty() {
        outln!(
            "removed {} model file(s) of the earlier output: {}",
            f.deleted.len(),
            f.deleted.join(", ")
        );
    }
}

fn part_json(
    part: PartSpec,
    mine: &[usize],
    layout: &Layout,
    written: &[usize],
    kept: &[usize],
) -> Value {
    let names = |v: &[usize]| -> Vec<String> {
        v.iter()
            .map(|&s| layout.shards[s].file_name.clone())
            .collect()
    };
    json!({
        "part": part.k,
        "parts": part.n,
        "shards": names(mine),
        "written": names(written),
        "kept": names(kept),
    })
}

fn print_assignment(p: &Prepared, part: PartSpec, part_of: &[usize]) {
    let layout = p.layout;
    let mut load = vec![(0usize, 0u64); part.n];
    for (s, &k) in part_of.iter().enumerate() {
        load[k].0 += 1;
        load[k].1 += parts::shard_cost(p.ckpt, p.plan, layout, s);
    }
    outln!(
        "  {}: writes {} of {} shard(s):",
        part.label(),
        load[part.k - 1].0,
        layout.shards.len()
    );
    for (s, &k) in part_of.iter().enumerate() {
        if k == part.k - 1 {
            outln!("    {}", layout.shards[s].file_name);
        }
    }
    let costs: Vec<String> = load
        .iter()
        .enumerate()
        .map(|(k, (n, c))| format!("{}: {n} ({})", k + 1, human(*c)))
        .collect();
    outln!("  parts (shards, work): {}", costs.join(", "));
    if load[part.k - 1].0 == 0 {
        outln!(
            "  note: this part has nothing to write (the output has {} shard(s)); --max-shard-size makes more",
            layout.shards.len()
        );
    }
}

type PartOutcome = (Vec<usize>, Vec<usize>, RunStats);

#[allow(clippy::too_many_arguments)]
fn write_part(
    p: &Prepared,
    cancel: &Cancel,
    part: PartSpec,
    fp: &Fingerprint,
    digest: &str,
    mine: &[usize],
    side_names: &[OsString],
    checksums: bool,
) -> Result<PartOutcome> {
    let opts = p.opts;
    let layout = p.layout;
    let dir = p.target.dir.as_path();
    let label = part.label();
    let lock = LeaseLock::acquire(&lock_path(dir, part), &label)?;
    if let (Some(n), false) = (&lock.note, opts.quiet) {
        errln!("note: {}: {n}", dir.display());
    }
    refuse_while_finalizing(dir)?;
    if crate::output::lock::is_held(dir) {
        return Err(Error::Other(format!(
            "{}: another tftf run (not a part) is writing here",
            dir.display()
        )));
    }
    // Other parts' records must come from the same command on the same inputs.
    let mut own_prev = None;
    let mut ok: HashSet<String> = HashSet::new();
    for (path, r) in read_part_records(dir)? {
        if r.part.n == part.n && r.fingerprint == *fp {
            ok.extend(r.assigned.iter().map(|(_, n)| n.clone()));
            if r.part == part {
                own_prev = Some(r);
            }
            continue;
        }
        let why = if r.part.n != part.n {
            format!("it is part of a run in {} parts", r.part.n)
        } else {
            fp.differences(&r.fingerprint)
        };
        if r.part == part && opts.resume {
            return Err(Error::Other(format!(
                "cannot resume {label} in {}: {why}; rerun without --resume and with --force to start over",
                dir.display()
            )));
        }
        if let Some(h) = parts::live_holder(&lock_path(dir, r.part)) {
            return Err(Error::Other(format!(
                "{}: {} is running with different arguments or inputs ({why}; {h})",
                dir.display(),
                r.part.label()
            )));
        }
        if !opts.force {
            return Err(Error::Other(format!(
                "{}: {} (in {}) was run with different arguments or inputs than this {label}: {why}; run every part with one command line, or pass --force to discard the other run's records",
                dir.display(),
                r.part.label(),
                path.display()
            )));
        }
        std::fs::remove_file(&path).map_err(|e| Error::io(&path, e))?;
    }
    if own_prev.is_none() && opts.resume && !opts.quiet {
        errln!(
            "note: {}: nothing to resume for {label} (no record of an earlier run); writing all its shards",
            dir.display()
        );
    }
    // This part's own shards may be replaced once its record exists: only it writes them.
    let my_names: HashSet<String> = mine
        .iter()
        .map(|&s| layout.shards[s].file_name.clone())
        .collect();
    if own_prev.is_some() {
        ok.extend(my_names.iter().cloned());
    }
    let deleted = match p.sink {
        OutputSink::Safetensors(_) => p.target.claim_for_part(&ok, opts.force)?,
        // GGUF files sit among other files: as in a single GGUF run, only this part's own
        // files are claimed (an existing one replaced only with --force), nothing is deleted.
        OutputSink::Gguf(_) => {
            let mut claimed: Vec<String> = my_names
                .iter()
                .filter(|n| !ok.contains(*n))
                .cloned()
                .collect();
            claimed.sort();
            p.target.claim_files(&claimed, opts.force)?;
            Vec::new()
        }
    };
    if !deleted.is_empty() && !opts.quiet {
        outln!(
            "removed {} model file(s) of the earlier output: {}",
            deleted.len(),
            deleted.join(", ")
        );
    }
    for t in temporaries(dir) {
        if my_names.iter().any(|n| is_temp_for(&t, n)) {
            let path = dir.join(&t);
            std::fs::remove_file(&path).map_err(|e| Error::io(&path, e))?;
        }
    }
    let mut record = PartRecord {
        part,
        fingerprint: fp.clone(),
        checksums,
        shards_total: layout.shards.len(),
        safetensors: matches!(p.sink, OutputSink::Safetensors(_)),
        assigned: mine
            .iter()
            .map(|&s| (s, layout.shards[s].file_name.clone()))
            .collect(),
        side_files: side_names.to_vec(),
        complete: false,
    };
    record.write(dir)?;

    // Shards kept from the earlier run: recorded by this run and unchanged since.
    let mut kept = Vec::new();
    if opts.resume {
        for &s in mine {
            if keep_shard(dir, s, &layout.shards[s].file_name, digest, checksums)? {
                kept.push(s);
            }
        }
    }
    let groups: Vec<Vec<usize>> = shard_groups(p.plan, layout)
        .into_iter()
        .filter(|g| g.iter().all(|s| mine.contains(s)))
        .filter(|g| !g.iter().all(|s| kept.contains(s)))
        .collect();
    kept.retain(|s| !groups.iter().any(|g| g.contains(s)));
    let todo: Vec<usize> = groups.iter().flatten().copied().collect();
    let progress = if todo.is_empty() {
        None
    } else {
        let shards: Vec<&crate::sink::OutShard> = todo.iter().map(|&s| &layout.shards[s]).collect();
        let bytes = p.progress_bytes(&shards);
        let total = bytes.iter().sum();
        p.progress(
            shards.iter().map(|s| s.file_name.clone()).collect(),
            bytes,
            total,
        )
    };
    let mut stats = RunStats::default();
    let mut first = 0;
    for group in &groups {
        if cancel.is_raised() {
            return Err(Error::Cancelled);
        }
        let s = write_group(
            p,
            cancel,
            group,
            digest,
            checksums,
            progress.as_ref().map(|pr| pr.from_file(first)),
        )?;
        first += group.len();
        add_stats(&mut stats, &s);
    }
    if let Some(pr) = &progress {
        pr.finish();
    }
    if part.k == 1 {
        stage_sides(p, dir, side_names)?;
    }
    record.complete = true;
    record.write(dir)?;
    crash_point("part-complete");
    drop(lock);
    Ok((todo, kept, stats))
}

fn add_stats(total: &mut RunStats, s: &RunStats) {
    total.bytes_computed += s.bytes_computed;
    total.bytes_reflinked += s.bytes_reflinked;
    total.bytes_copied_in_kernel += s.bytes_copied_in_kernel;
    total.bytes_copied_user += s.bytes_copied_user;
    total.chunks += s.chunks;
    total.chunk_bytes = total.chunk_bytes.max(s.chunk_bytes);
    total.pool_bytes = total.pool_bytes.max(s.pool_bytes);
    total.pool_peak_bytes = total.pool_peak_bytes.max(s.pool_peak_bytes);
    total.gpu_staging_bytes = total.gpu_staging_bytes.max(s.gpu_staging_bytes);
    total.io_threads = total.io_threads.max(s.io_threads);
    total.host_registered_bytes = total.host_registered_bytes.max(s.host_registered_bytes);
    if total.reflink_unavailable.is_none() {
        total.reflink_unavailable = s.reflink_unavailable.clone();
    }
    if total.host_register_failed.is_none() {
        total.host_register_failed = s.host_register_failed.clone();
    }
}

/// Whether shard `s`, committed by an earlier attempt of this run, can be kept: its record is
/// this run's and the file still matches it (re-hashed when checksums are on).
fn keep_shard(dir: &Path, s: usize, name: &str, digest: &str, checksums: bool) -> Result<bool> {
    let Some(rec) = ShardRecord::read(dir, s)? else {
        return Ok(false);
    };
    if rec.digest != digest || rec.name != name {
        return Ok(false);
    }
    let path = dir.join(name);
    if std::fs::metadata(&path).map(|m| m.len()).ok() != Some(rec.size) {
        return Ok(false);
    }
    if !checksums {
        return Ok(true);
    }
    let Some(want) = rec.file_sum() else {
        return Ok(false);
    };
    let ranges = want.tensors.iter().map(|(t, _)| t.clone()).collect();
    Ok(hash_file(&path, name, ranges)? == want)
}

/// Writes one group of shards (an op's outputs can span shards) through the pipeline, then
/// commits each shard and records it.
fn write_group(
    p: &Prepared,
    cancel: &Cancel,
    group: &[usize],
    digest: &str,
    checksums: bool,
    progress: Option<Progress>,
) -> Result<RunStats> {
    let dir = p.target.dir.as_path();
    let layout = Layout {
        kind: OutputKind::Dir,
        shards: group.iter().map(|&s| p.layout.shards[s].clone()).collect(),
    };
    // A record describes the file it was made for: gone before the file is replaced.
    for &s in group {
        ShardRecord::remove(dir, s)?;
    }
    let mut temps = Temps(Vec::new());
    let mut files = Vec::with_capacity(group.len());
    for shard in &layout.shards {
        let tmp = dir.join(temp_name(&shard.file_name));
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(&tmp)
            .map_err(|e| Error::io(&tmp, e))?;
        temps.push(tmp.clone());
        file.set_len(shard.len).map_err(|e| Error::io(&tmp, e))?;
        if shard.clone_from.is_none() {
            file.write_all_at(&shard.header, 0)
                .map_err(|e| Error::io(&tmp, e))?;
        }
        files.push(file);
    }
    crash_point("tmp");
    let cfg = p.pipeline_config(cancel, progress);
    let stats = pipeline::execute(
        &Resources::new(p.plan, &cfg),
        p.ckpt,
        p.plan,
        &layout,
        &files,
        &temps.0,
        &cfg,
    )?;
    drop(files);
    for (k, (&s, shard)) in group.iter().zip(&layout.shards).enumerate() {
        let tmp = &temps.0[k];
        File::open(tmp)
            .and_then(|f| f.sync_all())
            .map_err(|e| Error::io(tmp, e))?;
        let ranges: Vec<TensorRange> = shard
            .tensors
            .iter()
            .zip(&shard.offsets)
            .map(|(&t, &offset)| TensorRange {
                name: p.plan.tensors[t].name.clone(),
                offset,
                len: p.plan.tensors[t].nbytes,
            })
            .collect();
        let (sha, tensors) = if checksums {
            let sum = hash_file(tmp, &shard.file_name, ranges)?;
            (
                Some(sum.sha256),
                sum.tensors.into_iter().map(|(t, h)| (t, Some(h))).collect(),
            )
        } else {
            let mut r = ranges;
            r.sort_by_key(|t| t.offset);
            (None, r.into_iter().map(|t| (t, None)).collect())
        };
        if cancel.is_raised() {
            return Err(Error::Cancelled);
        }
        let fin = dir.join(&shard.file_name);
        std::fs::rename(tmp, &fin).map_err(|e| Error::io(&fin, e))?;
        File::open(dir)
            .and_then(|d| d.sync_all())
            .map_err(|e| Error::io(dir, e))?;
        crash_point("part-shard");
        ShardRecord {
            index: s,
            digest: digest.to_string(),
            size: shard.len,
            sha256: sha,
            name: shard.file_name.clone(),
            tensors,
        }
        .write(dir)?;
    }
    temps.keep();
    Ok(stats)
}

/// Part 1 stages the side files (the edited config as written, the others copied) for
/// finalize, which may run without the input.
fn stage_sides(p: &Prepared, dir: &Path, names: &[OsString]) -> Result<()> {
    let side_dir = staged_side_dir(dir);
    match std::fs::create_dir(&side_dir) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
        Err(e) => return Err(Error::io(&side_dir, e)),
    }
    let sources = p
        .sides
        .iter()
        .map(Some)
        .chain(generated_files(p).iter().map(|_| None));
    for (src, name) in sources.zip(names) {
        let dst = side_dir.join(name);
        let tmp = side_dir.join(temp_os_name(name));
        let generated = generated_files(p)
            .iter()
            .find(|(n, _)| name.as_os_str() == n.as_str());
        let written = match (src, name.to_str().unwrap_or_default(), &p.plan.config) {
            (None, _, _) => std::fs::write(&tmp, &generated.expect("a generated file").1),
            (Some(_), "config.json", Some(cfg)) => {
                let mut t = serde_json::to_string_pretty(cfg).expect("JSON object");
                t.push('\n');
                std::fs::write(&tmp, t)
            }
            (Some(src), _, _) => std::fs::copy(src, &tmp).map(|_| ()),
        };
        written
            .and_then(|_| File::open(&tmp)?.sync_all())
            .and_then(|_| std::fs::rename(&tmp, &dst))
            .map_err(|e| {
                let _ = std::fs::remove_file(&tmp);
                Error::io(&dst, e)
            })?;
    }
    File::open(&side_dir)
        .and_then(|d| d.sync_all())
        .map_err(|e| Error::io(&side_dir, e))
}
