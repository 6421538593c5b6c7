//! A job whose output is a stream of tensors instead of files: what a Python pipeline runs for
//! the built-in pipes before its first Python pipe. The plan is the same as a writing run's;
//! each output tensor (with the extra outputs its op writes alongside, such as scales) is
//! streamed by the shared pipeline into an anonymous in-memory file of its own and handed over
//! whole, in plan order. At most one such tensor waits while the next is computed, so memory
//! stays within the budget plus two tensors besides the one the consumer holds (a file given
//! back waits as the spare only until the next tensor starts, which takes it).
//!
//! The stream's buffers are mapped once for the whole run, and a consumer done with a tensor
//! gives its in-memory file back ([`StreamedTensor::recycle`]) for a later tensor to reuse: the
//! kernel then neither maps nor zeroes fresh pages per tensor, which on a large model cost
//! more than the computing (bench/RESULTS.md, issue 26).

use std::fs::File;
use std::path::PathBuf;

use crate::error::{Error, Result};
use crate::format::checkpoint::Checkpoint;
use crate::gpu::{Device, DeviceRequest};
use crossbeam_channel::{bounded, Receiver, Sender};

use crate::pipeline::{self, Cancel, PipelineConfig, Resources};
use crate::plan::{Plan, Recipe, Step};
use crate::sink::{Layout, OutShard, OutputKind};
use crate::DType;

/// One output tensor of a streamed job: its name, dtype, shape and bytes, which lie in `file`
/// (an anonymous in-memory file holding exactly these `nbytes`).
#[derive(Debug)]
pub struct StreamedTensor {
    pub name: String,
    pub dtype: DType,
    pub shape: Vec<u64>,
    pub nbytes: u64,
    pub file: File,
    /// Where `file` goes back to the stream once its bytes are no longer needed.
    pub recycler: Recycler,
}

/// Takes in-memory files back into the stream that made them, so later tensors reuse their
/// pages. At most one spare file is kept; others given back are closed.
#[derive(Clone, Debug)]
pub struct Recycler(Sender<File>);

impl Recycler {
    /// Gives `file` back. Its contents will be overwritten: nothing may still map it or read it.
    pub fn give_back(&self, file: File) {
        let _ = self.0.try_send(file);
    }
}

impl StreamedTensor {
    /// Done with this tensor: its in-memory file goes back to the stream for a later tensor.
    pub fn recycle(self) {
        self.recycler.give_back(self.file);
    }

    /// The tensor's bytes, copied out of its in-memory file. (The Python package maps the
    /// file instead, so its tensors view these bytes without a copy.)
    pub fn to_vec(&self) -> Result<Vec<u8>> {
        use std::os::unix::fs::FileExt;
        let mut buf = vec![0u8; self.nbytes as usize];
        self.file
            .read_exact_at(&mut buf, 0)
            .map_err(|e| Error::Other(format!("cannot read tensor `{}` back: {e}", self.name)))?;
        Ok(buf)
    }
}

/// What a streamed job needs: the source, its steps, and the run's resources.
pub struct StreamJob<'a> {
    pub source: &'a std::path::Path,
    pub steps: &'a [Step],
    pub memory_budget: u64,
    pub device: &'a DeviceRequest,
    pub allow_empty: bool,
}

/// The planned output of a streamed job, before any data moves.
pub struct PlannedStream {
    ckpt: Checkpoint,
    plan: Plan,
    data_budget: u64,
    device: Device,
}

impl PlannedStream {
    /// Name, dtype and shape of every output tensor, in the order [`PlannedStream::run`]
    /// delivers them.
    pub fn tensors(&self) -> Vec<(String, DType, Vec<u64>)> {
        self.plan
            .tensors
            .iter()
            .map(|t| (t.name.clone(), t.dtype, t.shape.clone()))
            .collect()
    }

    /// Computes every output tensor in plan order and hands each to `deliver`; stops at the
    /// first error (from the stream or from `deliver`) or when `cancel` is raised.
    pub fn run(
        &self,
        threads: usize,
        cancel: &Cancel,
        mut deliver: impl FnMut(StreamedTensor) -> Result<()>,
    ) -> Result<()> {
        let plan = &self.plan;
        let cfg = self.config(threads, cancel);
        // Each unit runs alone, so a tensor's chunks are all the compute threads get: the
        // largest tensors are cut into two chunks per thread.
        let largest = plan.tensors.iter().map(|t| t.nbytes).max().unwrap_or(0);
        let per_thread = largest / (2 * threads.max(1) as u64);
        let resources = Resources::new(plan, &cfg).with_chunks_at_most(per_thread);
        let (give_back, spare) = bounded::<File>(1);
        // Extra outputs (scales) come with their producer and wait here until their turn.
        let mut waiting: Vec<Option<(File, u64)>> = (0..plan.tensors.len()).map(|_| None).collect();
        for ti in 0..plan.tensors.len() {
            if cancel.is_raised() {
                return Err(Error::Cancelled);
            }
            if waiting[ti].is_none() {
                let unit = unit_of(plan, ti);
                let files = self.compute(&unit, &resources, &cfg, &spare)?;
                for (t, file) in unit.iter().zip(files) {
                    waiting[*t] = Some((file, plan.tensors[*t].nbytes));
                }
            }
            let (file, nbytes) = waiting[ti].take().expect("computed above");
            let t = &plan.tensors[ti];
            deliver(StreamedTensor {
                name: t.name.clone(),
                dtype: t.dtype,
                shape: t.shape.clone(),
                nbytes,
                file,
                recycler: Recycler(give_back.clone()),
            })?;
        }
        Ok(())
    }

    /// The pipeline settings of every unit of the stream.
    fn config(&self, threads: usize, cancel: &Cancel) -> PipelineConfig {
        PipelineConfig {
            threads,
            memory_budget: self.data_budget,
            cancel: cancel.clone(),
            progress: None,
            // In-memory files: no extents to share, no copy offload across filesystems.
            kernel_copy: false,
            expect_reflink: false,
            gpu: self.device.gpu.clone(),
            io_threads: Some(1),
        }
    }

    /// Streams the planned tensors `unit` (a producer and its extra outputs) into one
    /// in-memory file each: a file given back by the consumer when there is one, else a new
    /// one. Every byte of a planned tensor is written by the pipeline, so a reused file's old
    /// contents never show.
    fn compute(
        &self,
        unit: &[usize],
        resources: &Resources,
        cfg: &PipelineConfig,
        spare: &Receiver<File>,
    ) -> Result<Vec<File>> {
        let mut files = Vec::with_capacity(unit.len());
        let mut shards = Vec::with_capacity(unit.len());
        for &t in unit {
            let pt = &self.plan.tensors[t];
            let file = match spare.try_recv() {
                Ok(file) => file,
                Err(_) => anonymous_file(&pt.name)?,
            };
            file.set_len(pt.nbytes)
                .map_err(|e| Error::Other(format!("no memory for tensor `{}`: {e}", pt.name)))?;
            files.push(file);
            shards.push(OutShard {
                file_name: pt.name.clone(),
                header: Vec::new(),
                tensors: vec![t],
                offsets: vec![0],
                len: pt.nbytes,
                clone_from: None,
            });
        }
        let layout = Layout {
            kind: OutputKind::Dir,
            shards,
        };
        let names: Vec<PathBuf> = unit
            .iter()
            .map(|&t| PathBuf::from(&self.plan.tensors[t].name))
            .collect();
        pipeline::execute(
            resources, &self.ckpt, &self.plan, &layout, &files, &names, cfg,
        )?;
        Ok(files)
    }
}

/// Planned tensor `ti` and the extra outputs its op writes with it.
fn unit_of(plan: &Plan, ti: usize) -> Vec<usize> {
    let mut unit = vec![ti];
    if let Recipe::Compute { extra, .. } = &plan.tensors[ti].recipe {
        unit.extend(extra.iter().flatten().copied());
    }
    unit
}

/// An unnamed file in memory (`memfd_create`), removed when the last handle closes.
fn anonymous_file(name: &str) -> Result<File> {
    use std::os::fd::FromRawFd;
    let label = std::ffi::CString::new("tftf-tensor").expect("no NUL");
    // SAFETY: a valid C string; the returned descriptor is owned by the File from here on.
    let fd = unsafe { libc::memfd_create(label.as_ptr(), libc::MFD_CLOEXEC) };
    if fd < 0 {
        return Err(Error::Other(format!(
            "cannot create an in-memory file for tensor `{name}`: {}",
            std::io::Error::last_os_error()
        )));
    }
    // SAFETY: `fd` was just created and nothing else owns it.
    Ok(unsafe { File::from_raw_fd(fd) })
}

impl StreamJob<'_> {
    /// Opens the source and plans the job from headers (every refusal a writing run would
    /// make about the plan happens here, before any data moves).
    pub fn plan(&self) -> Result<PlannedStream> {
        let mut ckpt = Checkpoint::open(self.source)?;
        for step in self.steps {
            if let Step::Op(op_step) = step {
                op_step.attach(&mut ckpt)?;
            }
        }
        let plan = Plan::build(&ckpt, self.steps)?;
        if let (false, Some(why)) = (self.allow_empty, &plan.nothing_to_do) {
            return Err(Error::NothingToDo(why.clone()));
        }
        // Two tensors wait outside the pool (the one handed over and the next); the rest is
        // the pipeline's, as in a writing run.
        let data_budget = plan.data_budget(&ckpt, 0, self.memory_budget)?;
        let device = if *self.device == DeviceRequest::Cpu
            || (*self.device == DeviceRequest::Auto && !plan.has_gpu_ops())
        {
            Device::cpu(None)
        } else {
            Device::open(self.device)?
        };
        Ok(PlannedStream {
            ckpt,
            plan,
            data_budget,
            device,
        })
    }
}
