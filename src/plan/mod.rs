//! The plan: every output tensor bound to a recipe, assigned to a shard and an offset, from
//! headers alone. Everything that can be known before data moves is checked here — name
//! collisions, sizes, free space — so a bad request fails before an output file exists.
//!
//! Recipes hold ops, so the [`Op`] trait and the kernel descriptions it names live here, below
//! the op families that implement them; the plan itself names no op. The one op planning makes
//! on its own, the cast of a tensor a cast step retyped, comes in as a [`CastOp`] constructor.

pub mod kernel;
mod op;

pub(crate) use op::{op_name_and_kernel, outputs_of, units_of};
pub use op::{Op, Outs};

use std::collections::HashMap;
use std::fmt::Debug;
use std::path::PathBuf;
use std::sync::Arc;

use serde_json::{Map, Value};

use crate::error::{Error, Result, ScaleOf};
use crate::format::checkpoint::Checkpoint;
use crate::format::dtype::{element_count, DType};
use crate::transform::{Glob, Rename};

/// Bytes of one input tensor's record, its index entry and one output tensor's record, plus
/// its shard offset and position, for [`Plan::state_bytes`].
const TENSOR_REF_BYTES: u64 =
    std::mem::size_of::<crate::format::checkpoint::TensorRef>() as u64 + 4;
const PLANNED_TENSOR_BYTES: u64 = std::mem::size_of::<PlannedTensor>() as u64 + 16;

/// How an output tensor is produced.
#[derive(Clone, Debug)]
pub enum Recipe {
    /// Bytes unchanged from an input tensor (index into `Checkpoint::tensors`), perhaps under a
    /// new name.
    Copy { src: usize },
    /// Bytes computed by an op from input tensors. `extra[k]` is the planned tensor receiving
    /// the op's output `k + 1` (`None` when that output was filtered away).
    Compute {
        op: Arc<dyn Op>,
        inputs: Vec<usize>,
        extra: Vec<Option<usize>>,
    },
    /// Written by the items of planned tensor `by`, as one of its op's extra outputs.
    Produced { by: usize },
}

#[derive(Clone, Debug)]
pub struct PlannedTensor {
    pub name: String,
    /// Index in `Checkpoint::tensors` of the input it came from (the first input for computed
    /// tensors), whose name error messages give.
    pub source_index: usize,
    pub dtype: DType,
    pub shape: Vec<u64>,
    pub nbytes: u64,
    pub recipe: Recipe,
}

/// A name-level or dtype step of a conversion, applied in order.
#[derive(Clone, Debug)]
pub enum Step {
    Include(Vec<Glob>),
    Exclude(Vec<Glob>),
    Rename(Rename),
    Cast {
        dtype: DType,
        cast_ints: bool,
    },
    /// An op's own planning step (dequantisation, merging, …).
    Op(Arc<dyn PlanStep>),
}

#[derive(Debug)]
pub struct Plan {
    pub tensors: Vec<PlannedTensor>,
    /// Input tensors not in the output, by name.
    pub dropped: Vec<String>,
    pub renamed: usize,
    /// `config.json` as it will be written, when it changes.
    pub config: Option<Map<String, Value>>,
    pub config_changes: Vec<String>,
    /// Facts the steps found worth reporting (inferred layouts, per-tensor figures).
    pub notes: PlanNotes,
    /// Why the request looks like a mistake: every tensor filtered away, or an op that found
    /// nothing to do. Refused unless `--allow-empty`.
    pub nothing_to_do: Option<String>,
    /// Side files not to copy (see [`PlanStep::dropped_side_files`]).
    pub dropped_side_files: Vec<String>,
    /// Files a step writes beside the model, by name, with their exact text (ModelOpt's
    /// `hf_quant_config.json`); they replace an input side file of the same name.
    pub generated_files: Vec<(String, String)>,
}

/// An output tensor while steps are still being applied.
#[derive(Clone, Debug)]
pub struct Entry {
    /// Stable identity while names change.
    pub id: usize,
    pub name: String,
    /// The input tensor it comes from (the primary one for derived tensors).
    pub source: usize,
    pub dtype: DType,
    pub shape: Vec<u64>,
    /// Set when an op computes the tensor; `None` means the source's bytes, cast if `dtype`
    /// differs.
    pub derive: Option<Arc<dyn Derive>>,
    /// The source's bytes under another dtype label of the same width (`I8` → `U8`).
    pub relabel: bool,
}

impl Entry {
    /// The file holding the entry's source tensor, which errors about the entry name.
    pub fn path(&self, ckpt: &Checkpoint) -> PathBuf {
        ckpt.shards[ckpt.tensors[self.source].shard()].path.clone()
    }

    /// The error for this entry as a quantised weight whose `of` scales are missing (`looked`:
    /// the names tried).
    pub fn missing_scale(&self, ckpt: &Checkpoint, of: ScaleOf, looked: &[String]) -> Error {
        Error::MissingScale {
            path: self.path(ckpt),
            of,
            tensor: self.name.clone(),
            looked: looked
                .iter()
                .map(|n| format!("`{n}`"))
                .collect::<Vec<_>>()
                .join(", "),
            more: String::new(),
        }
    }

    /// The error for this entry as the scale (or zero points) of `weight`, wrong as `msg` says.
    pub fn bad_scale(&self, ckpt: &Checkpoint, weight: &str, msg: String) -> Error {
        Error::BadScale {
            path: self.path(ckpt),
            tensor: self.name.clone(),
            weight: weight.to_string(),
            msg,
        }
    }
}

/// Every entry's position, by name: how a step finds a weight's scales and companions.
pub fn index_by_name(entries: &[Entry]) -> HashMap<String, usize> {
    entries
        .iter()
        .enumerate()
        .map(|(i, e)| (e.name.clone(), i))
        .collect()
}

/// A tensor computed by an op. The op is built only when the plan is final, because a later
/// cast step may still change the output dtype.
pub trait Derive: Send + Sync + Debug {
    /// Input tensors (indices into `Checkpoint::tensors`), in the order the op reads them.
    fn inputs(&self) -> Vec<usize>;
    fn build(&self, dst: DType) -> Arc<dyn Op>;
    /// For a tensor that another entry's op writes as its extra output: that entry's id and the
    /// output number (1-based). `build` is never called for such entries.
    fn secondary_of(&self) -> Option<(usize, usize)> {
        None
    }
}

/// A derived tensor whose op is fixed at plan time (no later cast changes it).
#[derive(Debug)]
pub struct FixedOp {
    pub inputs: Vec<usize>,
    pub op: Arc<dyn Op>,
}

impl Derive for FixedOp {
    fn inputs(&self) -> Vec<usize> {
        self.inputs.clone()
    }
    fn build(&self, _dst: DType) -> Arc<dyn Op> {
        self.op.clone()
    }
}

/// A derived tensor whose op is fixed at plan time but for its output dtype, which a later cast
/// step may still change: `op` holds every other field (its `dst` is a stand-in), and `build`
/// sets the dtype.
#[derive(Debug)]
pub struct DeferredDst<T> {
    pub inputs: Vec<usize>,
    pub op: T,
}

/// An op whose output dtype is set last ([`DeferredDst`]).
pub trait SetDst: Op + Clone + 'static {
    /// The output dtype field.
    fn dst_mut(&mut self) -> &mut DType;
}

/// `impl SetDst` for an op whose output dtype is its `dst` field.
macro_rules! set_dst_field {
    ($t:ty) => {
        impl $crate::plan::SetDst for $t {
            fn dst_mut(&mut self) -> &mut $crate::format::dtype::DType {
                &mut self.dst
            }
        }
    };
}
pub(crate) use set_dst_field;

impl<T: SetDst> Derive for DeferredDst<T> {
    fn inputs(&self) -> Vec<usize> {
        self.inputs.clone()
    }
    fn build(&self, dst: DType) -> Arc<dyn Op> {
        let mut op = self.op.clone();
        *op.dst_mut() = dst;
        Arc::new(op)
    }
}

/// A tensor that another entry's op writes as its extra output `output` (1-based): scales
/// written with their codes.
#[derive(Debug)]
pub struct ExtraOutput {
    pub primary: usize,
    pub output: usize,
}

impl Derive for ExtraOutput {
    fn inputs(&self) -> Vec<usize> {
        Vec::new()
    }
    fn build(&self, _dst: DType) -> Arc<dyn Op> {
        unreachable!("extra outputs are written by their primary's op")
    }
    fn secondary_of(&self) -> Option<(usize, usize)> {
        Some((self.primary, self.output))
    }
}

/// What planning found worth reporting.
#[derive(Debug, Default)]
pub struct PlanNotes {
    /// One line each: inferred layouts, skipped shards, …
    pub lines: Vec<String>,
    /// Per-tensor figures known at plan time (FP4 window choices, block counts).
    pub tensors: Vec<Value>,
    /// Things the user should know even with `-q` (adapter tensors left out on purpose, …):
    /// printed on stderr as `warning:` lines and listed in the report.
    pub warnings: Vec<String>,
}

/// Makes the op converting a whole tensor of `elements` values from `src` to `dst` (one that a
/// cast step retyped and no op computes), or `None` when no cast joins the two dtypes.
pub type CastOp = fn(src: DType, dst: DType, elements: u64) -> Option<Arc<dyn Op>>;

/// What a planning step works on, as one argument (a step that runs another hands it on).
pub struct Planning<'a> {
    pub ckpt: &'a Checkpoint,
    /// `config.json` as read, before any step edited it.
    pub config: Option<&'a Map<String, Value>>,
    /// The output tensors so far.
    pub entries: &'a mut Vec<Entry>,
    /// Collects facts worth reporting, such as inferred layouts.
    pub notes: &'a mut PlanNotes,
}

/// A step contributed by an op module: rewrites the entry list from headers alone.
pub trait PlanStep: Send + Sync + Debug {
    /// Rewrites the entries; returns whether anything changed (then `edit_config` runs).
    fn apply(&self, p: Planning) -> Result<bool>;
    /// Updates `config.json` for the new format; returns human-readable changes.
    fn edit_config(&self, cfg: &mut Map<String, Value>) -> Vec<String>;
    /// Why the step changed nothing when `apply` returned `false` ("no FP8 weight to
    /// dequantise"), for the error a run without `--allow-empty` stops with.
    fn nothing_done(&self) -> String;
    /// Side files (next to the model) that no longer describe the output once the step changed
    /// something, and are not copied (`hf_quant_config.json` after dequantising).
    fn dropped_side_files(&self) -> &'static [&'static str] {
        &[]
    }
    /// Files (name, exact text) the step writes beside the model once it changed something.
    fn generated_files(&self) -> Vec<(String, String)> {
        Vec::new()
    }
    /// Opens extra inputs (an adapter) and attaches them to the checkpoint before planning.
    fn attach(&self, _ckpt: &mut Checkpoint) -> Result<()> {
        Ok(())
    }
    /// [`apply`](PlanStep::apply) for a step that also reads what the steps before it made of
    /// the model's small files (a sink's step: GGUF reads `config.json` and the tokenizer).
    fn apply_after(&self, p: Planning, _before: &Before) -> Result<bool> {
        self.apply(p)
    }
}

/// What the steps before one step made of the model beside its tensors: the output's
/// `config.json` and side files as they stand when that step plans.
#[derive(Debug, Default, Clone)]
pub struct Before {
    /// How many steps came before (filters and renames included).
    pub steps: usize,
    /// `config.json` as the earlier steps edited it; `None` for a model without one.
    pub config: Option<Map<String, Value>>,
    /// Whether an earlier step edited `config`.
    pub config_edited: bool,
    /// Side files the earlier steps leave out (see [`PlanStep::dropped_side_files`]).
    pub dropped_side_files: Vec<String>,
    /// Files the earlier steps write (see [`PlanStep::generated_files`]).
    pub generated_files: Vec<(String, String)>,
}

impl Plan {
    /// Applies `steps` to the checkpoint's tensors: what the output holds and how each tensor is
    /// produced, `cast` making the op of each tensor a cast step retyped (`Plan::build`, beside
    /// the cast op, passes it). Where the tensors go (files, offsets, headers) is a sink's job.
    pub fn build_with_cast(ckpt: &Checkpoint, steps: &[Step], cast: CastOp) -> Result<Plan> {
        let mut entries: Vec<Entry> = ckpt.tensors[..ckpt.base_count]
            .iter()
            .enumerate()
            .map(|(i, t)| Entry {
                id: i,
                name: t.info.name.clone(),
                source: i,
                dtype: t.info.dtype,
                shape: t.info.shape.clone(),
                derive: None,
                relabel: false,
            })
            .collect();
        let original_config = ckpt.config()?;
        let mut before = Before {
            config: original_config.clone(),
            ..Before::default()
        };
        let mut config_changes = Vec::new();
        let mut notes = PlanNotes::default();
        let mut idle_op: Option<String> = None;
        for (k, step) in steps.iter().enumerate() {
            before.steps = k;
            before.config_edited = before.config != original_config;
            match step {
                Step::Include(globs) => {
                    entries.retain(|e| globs.iter().any(|g| g.matches(&e.name)));
                }
                Step::Exclude(globs) => {
                    entries.retain(|e| !globs.iter().any(|g| g.matches(&e.name)));
                }
                Step::Rename(rule) => {
                    for e in &mut entries {
                        e.name = rule.apply(&e.name);
                    }
                }
                Step::Cast { dtype, cast_ints } => {
                    let lookup = |n: &str| ckpt.get(n).map(|t| t.info.dtype);
                    let mut kept = 0;
                    for e in &mut entries {
                        let castable = e.dtype.is_castable_float()
                            || (*cast_ints && e.derive.is_none() && e.dtype.is_castable_int());
                        // Scales and codes of a quantised weight are read as they are stored
                        // (an op may already have replaced the tensor: then it is a weight).
                        let src = &ckpt.tensors[e.source];
                        if castable
                            && e.derive.is_none()
                            && e.dtype != *dtype
                            && crate::format::quant::is_metadata(
                                src.name(),
                                src.info.dtype,
                                &lookup,
                            )
                        {
                            kept += 1;
                            continue;
                        }
                        if castable {
                            e.dtype = *dtype;
                        }
                    }
                    if kept > 0 {
                        notes.lines.push(format!(
                            "--dtype {dtype}: kept {kept} quantisation tensor(s) (scales, zero points, packed codes) in their stored dtype; only weights are cast"
                        ));
                    }
                    if let Some(cfg) = &mut before.config {
                        config_changes.extend(edit_config_dtype(cfg, *dtype));
                    }
                }
                Step::Op(op_step) => {
                    let planning = Planning {
                        ckpt,
                        config: original_config.as_ref(),
                        entries: &mut entries,
                        notes: &mut notes,
                    };
                    let changed = op_step.apply_after(planning, &before)?;
                    if !changed && idle_op.is_none() {
                        idle_op = Some(op_step.nothing_done());
                    }
                    if changed {
                        let dropped = op_step.dropped_side_files().iter();
                        before
                            .dropped_side_files
                            .extend(dropped.map(|s| s.to_string()));
                        for (name, text) in op_step.generated_files() {
                            before.generated_files.retain(|(n, _)| *n != name);
                            before.generated_files.push((name, text));
                        }
                    }
                    if let (true, Some(cfg)) = (changed, &mut before.config) {
                        config_changes.extend(op_step.edit_config(cfg));
                    }
                }
            }
        }
        let filters = steps
            .iter()
            .any(|s| matches!(s, Step::Include(_) | Step::Exclude(_)));
        let nothing_to_do = match (entries.is_empty(), ckpt.base_count, idle_op) {
            (true, 0, _) => Some(format!(
                "{}: the input holds no tensors",
                crate::escape::path(&ckpt.input)
            )),
            (true, n, _) if filters => Some(format!(
                "the filters (--include/--exclude, --key-filter/--key-exclude) keep none of the {n} input tensors: nothing to write"
            )),
            (_, _, Some(why)) => Some(format!("{}: {why}", crate::escape::path(&ckpt.input))),
            _ => None,
        };
        let mut seen: HashMap<&str, usize> = HashMap::new();
        for e in &entries {
            if e.name.is_empty() || e.name == "__metadata__" {
                return Err(Error::Usage(format!(
                    "renaming `{}` gives the reserved or empty name `{}`",
                    ckpt.tensors[e.source].info.name, e.name
                )));
            }
            if let Some(&prev) = seen.get(e.name.as_str()) {
                return Err(Error::NameCollision {
                    first: ckpt.tensors[prev].info.name.clone(),
                    second: ckpt.tensors[e.source].info.name.clone(),
                    target: e.name.clone(),
                });
            }
            seen.insert(&e.name, e.source);
        }
        let mut used = vec![false; ckpt.tensors.len()];
        for e in &entries {
            match &e.derive {
                Some(d) => d.inputs().into_iter().for_each(|i| used[i] = true),
                None => used[e.source] = true,
            }
        }
        // A base tensor replaced by another source under its own name (LoRA modules_to_save)
        // is not dropped.
        let dropped = ckpt.tensors[..ckpt.base_count]
            .iter()
            .zip(&used)
            .filter(|(t, u)| !**u && !seen.contains_key(t.info.name.as_str()))
            .map(|(t, _)| t.info.name.clone())
            .collect();
        let mut renamed = 0;
        let mut tensors = Vec::with_capacity(entries.len());
        let index_of_id: HashMap<usize, usize> =
            entries.iter().enumerate().map(|(i, e)| (e.id, i)).collect();
        let mut secondaries: Vec<(usize, usize, usize)> = Vec::new(); // (tensor, primary tensor, output k)
        for e in entries {
            let src = &ckpt.tensors[e.source].info;
            // Renames by the user's rules; ops that name their outputs (`weight_scale`) don't count.
            if e.name != src.name && e.derive.is_none() && e.source < ckpt.base_count {
                renamed += 1;
            }
            let elements = element_count(&e.shape).ok_or_else(|| {
                Error::Other(format!(
                    "tensor `{}`: shape {:?} overflows",
                    src.name, e.shape
                ))
            })?;
            let nbytes = e.dtype.byte_len(elements).ok_or_else(|| {
                Error::Other(format!(
                    "tensor `{}` is too large for {}",
                    src.name, e.dtype
                ))
            })?;
            let recipe = match &e.derive {
                Some(d) if d.secondary_of().is_some() => {
                    let (primary, k) = d.secondary_of().expect("checked");
                    let by = *index_of_id.get(&primary).ok_or_else(|| {
                        Error::Usage(format!(
                            "`{}` is computed together with another tensor that a filter removed; keep both or neither",
                            e.name
                        ))
                    })?;
                    secondaries.push((tensors.len(), by, k));
                    Recipe::Produced { by }
                }
                Some(d) => {
                    let op = d.build(e.dtype);
                    let extra = vec![None; op.extra_outputs()];
                    Recipe::Compute {
                        op,
                        inputs: d.inputs(),
                        extra,
                    }
                }
                None if e.dtype == src.dtype || e.relabel => Recipe::Copy { src: e.source },
                None => Recipe::Compute {
                    op: cast(src.dtype, e.dtype, elements).ok_or_else(|| {
                        Error::Other(format!(
                            "tensor `{}` is {} and cannot be converted to {}",
                            src.name, src.dtype, e.dtype
                        ))
                    })?,
                    inputs: vec![e.source],
                    extra: Vec::new(),
                },
            };
            tensors.push(PlannedTensor {
                name: e.name,
                source_index: e.source,
                dtype: e.dtype,
                shape: e.shape,
                nbytes,
                recipe,
            });
        }
        for (t, by, k) in secondaries {
            if let Recipe::Compute { extra, .. } = &mut tensors[by].recipe {
                extra[k - 1] = Some(t);
            }
        }
        let config = if before.config != original_config {
            before.config
        } else {
            None
        };
        Ok(Plan {
            tensors,
            dropped,
            renamed,
            config,
            config_changes,
            notes,
            nothing_to_do,
            dropped_side_files: before.dropped_side_files,
            generated_files: before.generated_files,
        })
    }

    /// Memory the open checkpoint and this plan hold for the whole run: per-tensor records,
    /// names and shapes (allocator overhead aside; the output headers are the layout's). Planning also holds
    /// short-lived copies: on a header of a million tiny tensors the peak RSS of `--dry-run` is
    /// ~1.5x this figure (615 MB for 409 MB).
    pub fn state_bytes(&self, ckpt: &Checkpoint) -> u64 {
        let shape = |s: &[u64]| 8 * s.len() as u64;
        let inputs: u64 = ckpt
            .tensors
            .iter()
            .map(|t| {
                let parts = placement_bytes(&t.placement);
                TENSOR_REF_BYTES + t.info.name.len() as u64 + shape(&t.info.shape) + parts
            })
            .sum();
        let outputs: u64 = self
            .tensors
            .iter()
            .map(|t| PLANNED_TENSOR_BYTES + t.name.len() as u64 + shape(&t.shape))
            .sum();
        inputs + outputs
    }

    /// The part of `budget` (`--memory-budget`) left for data in flight once the plan's own
    /// state ([`Plan::state_bytes`]) and `held` (the layout's headers) are counted. The plan may take at most half: a header of
    /// millions of tiny tensors is refused with the figure to raise the budget to, rather than
    /// running far past it.
    pub fn data_budget(&self, ckpt: &Checkpoint, held: u64, budget: u64) -> Result<u64> {
        let needed = self.state_bytes(ckpt) + held;
        if needed > budget / 2 {
            return Err(Error::PlanOverBudget {
                tensors: self.tensors.len().max(ckpt.tensors.len()),
                needed,
                budget,
            });
        }
        Ok(budget - needed)
    }

    pub fn total_tensor_bytes(&self) -> u64 {
        self.tensors.iter().map(|t| t.nbytes).sum()
    }

    pub fn copied_bytes(&self) -> u64 {
        self.tensors
            .iter()
            .filter(|t| matches!(t.recipe, Recipe::Copy { .. }))
            .map(|t| t.nbytes)
            .sum()
    }

    /// Untouched bytes of tensors that are not byte ranges of the input (strided views, chunk
    /// grids of a PyTorch input): gathered through memory, never moved by the kernel.
    pub fn gathered_bytes(&self, ckpt: &Checkpoint) -> u64 {
        self.tensors
            .iter()
            .filter(|t| {
                matches!(t.recipe, Recipe::Copy { src } if ckpt.tensors[src].pieces().is_none())
            })
            .map(|t| t.nbytes)
            .sum()
    }

    pub fn computed_count(&self) -> usize {
        self.tensors
            .iter()
            .filter(|t| !matches!(t.recipe, Recipe::Copy { .. }))
            .count()
    }

    /// Whether any computed tensor has a GPU kernel (so a device is worth opening).
    pub fn has_gpu_ops(&self) -> bool {
        self.tensors
            .iter()
            .any(|t| matches!(&t.recipe, Recipe::Compute { op, .. } if op.has_kernel()))
    }
}

/// Sets `torch_dtype` (and `dtype`, when present) to `dtype`, keeping key order.
pub fn edit_config_dtype(cfg: &mut Map<String, Value>, dtype: DType) -> Vec<String> {
    let mut changes = Vec::new();
    let target = Value::from(dtype.torch_name());
    for key in ["torch_dtype", "dtype"] {
        let present = cfg.contains_key(key);
        if (present || key == "torch_dtype") && cfg.get(key) != Some(&target) {
            changes.push(format!(
                "config.json: {key} {} -> {}",
                cfg.get(key).map_or("(unset)".into(), |v| v.to_string()),
                target
            ));
            cfg.insert(key.into(), target.clone());
        }
    }
    changes
}

/// Heap bytes of a placement beyond the record itself (strides, chunk boxes).
fn placement_bytes(p: &crate::format::source::Placement) -> u64 {
    use crate::format::source::Placement;
    match p {
        Placement::Contiguous { .. } => 0,
        Placement::Strided { strides, .. } => 8 * strides.len() as u64,
        Placement::Regions(regions) => regions
            .iter()
            .map(|r| 96 + 16 * r.offsets.len() as u64 + placement_bytes(&r.placement))
            .sum(),
    }
}
