//! Everything a writing run has resolved before it creates anything, and the checks of the
//! output place (free space, filesystem, lock) shared by single and partitioned runs.

use std::path::{Path, PathBuf};
use std::time::Instant;

use super::*;
use crate::error::{Error, Result};
use crate::format::checkpoint::Checkpoint;
use crate::gpu::Device;
use crate::output::{resolve, OutputSet, OutputTarget};
use crate::pipeline::{Cancel, PipelineConfig};
use crate::plan::Plan;
use crate::progress::{Mode as ProgressMode, Progress};
use crate::sink::Layout;
use crate::sys;

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
            errln!("note: {}: {n}", target.dir.display());
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

/// Side files the plan generates (`hf_quant_config.json`), written beside a directory output.
pub(crate) fn generated_files<'a>(p: &Prepared<'a>) -> &'a [(String, String)] {
    if p.sink.as_sink().copies_side_files() {
        &p.plan.generated_files
    } else {
        &[]
    }
}

pub(crate) fn generated_names(p: &Prepared) -> Vec<String> {
    generated_files(p).iter().map(|(n, _)| n.clone()).collect()
}
