//! A job whose output is a stream of tensors instead of files: what a Python pipeline runs for
//! the built-in pipes before its first Python pipe. The plan is the same as a writing run's;
//! each output tensor (with the extra outputs its op writes alongside, such as scales) is
//! streamed by the shared pipeline into an anonymous in-memory file of its own and handed over
//! whole, in plan order. At most one such tensor waits while the next is computed, so memory
//! stays within the budget plus two tensors.

use std::fs::File;
use std::path::PathBuf;

use crate::error::{Error, Result};
use crate::format::checkpoint::Checkpoint;
use crate::gpu::{Device, DeviceRequest};
use crate::pipeline::{self, Cancel, PipelineConfig};
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
}

impl StreamedTensor {
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
        // Extra outputs (scales) come with their producer and wait here until their turn.
        let mut waiting: Vec<Option<(File, u64)>> = (0..plan.tensors.len()).map(|_| None).collect();
        for ti in 0..plan.tensors.len() {
            if cancel.is_raised() {
                return Err(Error::Cancelled);
            }
            if waiting[ti].is_none() {
                let unit = unit_of(plan, ti);
                for (t, file) in unit.iter().zip(self.compute(&unit, threads, cancel)?) {
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
            })?;
        }
        Ok(())
    }

    /// Streams the planned tensors `unit` (a producer and its extra outputs) into one
    /// in-memory file each.
    fn compute(&self, unit: &[usize], threads: usize, cancel: &Cancel) -> Result<Vec<File>> {
        let mut files = Vec::with_capacity(unit.len());
        let mut shards = Vec::with_capacity(unit.len());
        for &t in unit {
            let pt = &self.plan.tensors[t];
            let file = anonymous_file(&pt.name)?;
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
        let cfg = PipelineConfig {
            threads,
            memory_budget: self.data_budget,
            cancel: cancel.clone(),
            progress: None,
            // In-memory files: no extents to share, no copy offload across filesystems.
            kernel_copy: false,
            expect_reflink: false,
            gpu: self.device.gpu.clone(),
            io_threads: Some(1),
        };
        pipeline::execute(&self.ckpt, &self.plan, &layout, &files, &names, &cfg)?;
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
