//! The GGUF sink: from a checkpoint's headers, `config.json` and tokenizer to the GGUF model
//! (metadata, every output tensor and its recipe), a plan step that puts those tensors in the
//! plan (plain copies where the bytes are unchanged, a [`GgufTensorOp`] otherwise), and the
//! layout of the `.gguf` file(s). The shared pipeline then writes it like any other output.
//!
//! Planned GGUF tensors are opaque bytes to the plan (`U8`, shape `[bytes]`): their ggml type
//! and shape live in the model this sink keeps, which lays the headers out.

use std::collections::HashMap;
use std::path::Path;
use std::sync::{Arc, OnceLock};

use serde_json::{json, Map, Value as Json};

use super::arch::{self, Config, OutputTensor, Recipe};
use super::kv::{Metadata, Value};
use super::layout::{self, FilePlan, LayoutOptions, SourceRange, SplitLimits, TensorSpec};
use super::model_dir::ModelDir;
use super::quant_mix::MixOptions;
use super::quantised::{DequantView, Origin};
use super::{auto_type, quant_plan, size_label, FileType};
use crate::error::{Error, Result};
use crate::format::checkpoint::Checkpoint;
use crate::format::dtype::DType;
use crate::ops::feed::{FedDerive, FeedSource};
use crate::ops::gguf::op::{source_names, Slot};
use crate::ops::gguf::GgufTensorOp;
use crate::plan::{Before, Entry, FixedOp, Plan, PlanStep, Planning, Recipe as PlanRecipe, Step};
use crate::sink::{Layout, OutShard, OutputKind, Sink};

/// What `tftf gguf` was asked for.
#[derive(Debug, Clone)]
pub struct GgufOptions {
    /// Name of the output file (`OUT.gguf`); split files are named after it.
    pub file_name: String,
    /// `None`: `--outtype auto`.
    pub file_type: Option<FileType>,
    /// 0: no split.
    pub split_max_bytes: u64,
    pub arch: Option<String>,
    pub vocab_pre: Option<String>,
    /// llama-quantize's options for a [`FileType::Quant`] mix.
    pub mix: MixOptions,
}

/// The GGUF a checkpoint becomes: known from headers and small files only.
#[derive(Debug)]
pub struct GgufModel {
    pub cfg: Config,
    pub file_type: FileType,
    pub metadata: Metadata,
    pub outputs: Vec<OutputTensor>,
    /// The checkpoint with its quantised weights dequantised (and how).
    view: DequantView,
    /// What the user should hear even with `-q` (tensors written as F16 for their shape).
    warnings: Vec<String>,
}

impl GgufModel {
    /// Whether an earlier step of the run computes a source of `t` (a merge, a LoRA merge, a
    /// cast).
    pub fn reads_computed(&self, t: &OutputTensor) -> bool {
        (source_names(t).iter())
            .any(|n| matches!(self.view.origins.get(*n), Some(Origin::Computed(..))))
    }
}

#[derive(Debug)]
pub struct GgufSink {
    pub opts: GgufOptions,
    /// Planned by the sink's step, from the tensors the run's earlier steps leave.
    model: Arc<OnceLock<Arc<GgufModel>>>,
    /// The files as [`Sink::layout`] planned them, for the dry run and the report; their
    /// header bytes moved into the layout's shards (held once).
    files: OnceLock<Vec<FilePlan>>,
}

impl GgufSink {
    pub fn new(opts: GgufOptions) -> GgufSink {
        GgufSink {
            opts,
            model: Arc::new(OnceLock::new()),
            files: OnceLock::new(),
        }
    }

    /// The model, once the plan has been built with [`Sink::steps`].
    pub fn model(&self) -> &GgufModel {
        self.model.get().expect("the plan is built first")
    }

    /// The files, once [`Sink::layout`] has planned them (headers left out: see `files`).
    pub fn laid_out(&self) -> &[FilePlan] {
        self.files.get().expect("GgufSink::layout runs first")
    }

    /// Names of the output files, in order: the file itself, or its split files.
    pub fn file_names(&self, count: usize) -> Vec<String> {
        let name = &self.opts.file_name;
        if count == 1 {
            return vec![name.clone()];
        }
        let stem = name.strip_suffix(".gguf").unwrap_or(name);
        (0..count)
            .map(|i| layout::split_file_name(stem, i, count))
            .collect()
    }

    /// Lays the files out from `plan`'s tensors; `reflink_block` pads unchanged tensors to
    /// offsets congruent with the input's (see [`layout::LayoutOptions`]).
    fn file_plans(&self, ckpt: &Checkpoint, plan: &Plan, sharing: bool) -> Result<Vec<FilePlan>> {
        let model = self.model();
        let by_name: HashMap<&str, &OutputTensor> =
            model.outputs.iter().map(|o| (o.name.as_str(), o)).collect();
        let specs = plan
            .tensors
            .iter()
            .map(|t| {
                let o = by_name[t.name.as_str()];
                let source = match t.recipe {
                    PlanRecipe::Copy { src } => {
                        ckpt.tensors[src]
                            .contiguous()
                            .map(|(file, offset)| SourceRange {
                                file: file as u32,
                                offset,
                            })
                    }
                    _ => None,
                };
                TensorSpec {
                    name: o.name.clone(),
                    ty: o.ty,
                    shape: o.shape.clone(),
                    byte_len: o.byte_len(),
                    source,
                }
            })
            .collect();
        layout::plan(
            &model.metadata,
            specs,
            SplitLimits {
                max_tensors: 0,
                max_bytes: self.opts.split_max_bytes,
            },
            LayoutOptions {
                reflink_block: sharing.then_some(layout::REFLINK_BLOCK_BYTES),
                ..LayoutOptions::default()
            },
        )
    }
}

/// Plans the GGUF model from `entries`, the tensors the run's earlier steps leave (the
/// checkpoint's own for `tftf gguf`), and what those steps made of `config.json` and the
/// tokenizer files ([`Before`]).
fn plan_model(
    opts: &GgufOptions,
    ckpt: &Checkpoint,
    entries: &[Entry],
    before: &Before,
) -> Result<GgufModel> {
    let cfg = match (before.steps, &before.config) {
        (0, _) | (_, None) => load_config(ckpt, opts.arch.as_deref())?,
        (_, Some(map)) => config_from(
            &ckpt.dir.join("config.json"),
            map.clone(),
            opts.arch.as_deref(),
        )?,
    };
    let view = DequantView::plan(ckpt, &cfg.map, entries, before.steps == 0)?;
    let in_tensors = &view.tensors;
    let auto = opts.file_type.is_none();
    let file_type = match opts.file_type {
        Some(t) => t,
        None => auto_type::file_type(&view),
    };
    let name = match before.steps {
        0 => model_name(ckpt),
        _ => output_name(&opts.file_name),
    };
    let mut metadata = arch::model_kvs(&cfg, file_type, &name)?;
    let dir = ModelDir::for_run(ckpt, before)?;
    let vocab = super::vocab::vocab_kvs_for(&cfg, dir.path(), opts.vocab_pre.as_deref())
        .map_err(|e| dir.explain(e))?;
    for (k, v) in vocab.iter() {
        metadata.set(k, v.clone());
    }
    if cfg.spec.family == arch::Family::Glm4Moe {
        super::arch_glm::special_tokens(dir.path(), &mut metadata).map_err(|e| dir.explain(e))?;
    }
    let mut outputs = arch::plan_tensors(&cfg, in_tensors, file_type)?;
    view.keep_stored_ternary(&mut outputs);
    if auto {
        auto_type::retype(&view, &mut outputs);
    }
    let mut warnings = Vec::new();
    if let FileType::Quant(mix) = file_type {
        warnings = quant_plan::apply(mix, &opts.mix, &cfg, &mut metadata, &mut outputs)?;
    }
    if let Some(label) = size_label::size_label(&outputs) {
        metadata.insert_after("general.name", "general.size_label", Value::String(label));
    }
    refuse_unconvertible(&outputs)?;
    super::check::refuse_incomplete(&cfg, &outputs)?;
    Ok(GgufModel {
        cfg,
        file_type,
        metadata,
        outputs,
        view,
        warnings,
    })
}

impl Sink for GgufSink {
    fn steps(&self, _ckpt: &Checkpoint) -> Result<Vec<Step>> {
        Ok(vec![Step::Op(Arc::new(GgufStep {
            opts: self.opts.clone(),
            model: self.model.clone(),
        }))])
    }

    fn layout(&self, ckpt: &Checkpoint, plan: &Plan, sharing: bool) -> Result<Layout> {
        let plans = self.file_plans(ckpt, plan, sharing)?;
        let index: HashMap<&str, usize> = plan
            .tensors
            .iter()
            .enumerate()
            .map(|(i, t)| (t.name.as_str(), i))
            .collect();
        let names = self.file_names(plans.len());
        let mut files = plans;
        let shards = files
            .iter_mut()
            .zip(names)
            .map(|(p, file_name)| OutShard {
                file_name,
                tensors: p
                    .tensors
                    .iter()
                    .map(|t| index[t.spec.name.as_str()])
                    .collect(),
                offsets: p.tensors.iter().map(|t| t.offset).collect(),
                len: p.file_len,
                header: std::mem::take(&mut p.header),
                clone_from: None,
            })
            .collect();
        let _ = self.files.set(files);
        Ok(Layout {
            kind: OutputKind::File,
            shards,
        })
    }

    fn copies_side_files(&self) -> bool {
        false
    }
}

/// Plans the GGUF model from the tensors reaching it and puts the model's tensors in the plan,
/// in the file's order.
#[derive(Debug)]
struct GgufStep {
    opts: GgufOptions,
    /// Shared with the sink, which lays the files out from it.
    model: Arc<OnceLock<Arc<GgufModel>>>,
}

impl PlanStep for GgufStep {
    fn apply(&self, p: Planning) -> Result<bool> {
        let before = Before {
            config: p.config.cloned(),
            ..Before::default()
        };
        self.apply_after(p, &before)
    }

    fn apply_after(&self, p: Planning, before: &Before) -> Result<bool> {
        let model = Arc::new(plan_model(&self.opts, p.ckpt, p.entries, before)?);
        let _ = self.model.set(model.clone());
        p.notes.warnings.extend(model.warnings.iter().cloned());
        let view = &model.view;
        let origin = |t: &OutputTensor, name: &str| {
            view.origins.get(name).ok_or_else(|| Error::GgufTensor {
                tensor: t.name.clone(),
                msg: format!("source `{name}` is not in the checkpoint"),
            })
        };
        let mut out = Vec::with_capacity(model.outputs.len());
        for (id, o) in model.outputs.iter().enumerate() {
            let copy = o.copy_source().and_then(|n| match view.origins.get(n) {
                Some(Origin::Stored(i)) => Some(*i),
                _ => None,
            });
            let copy = copy.filter(|&i| {
                let src = &p.ckpt.tensors[i].info;
                src.nbytes() == o.byte_len() && Some(src.dtype) == o.src_dtype
            });
            let mut entry = Entry {
                id,
                name: o.name.clone(),
                source: 0,
                dtype: DType::U8,
                shape: vec![o.byte_len()],
                derive: None,
                relabel: true,
            };
            if let Some(i) = copy {
                entry.source = i;
                out.push(entry);
                continue;
            }
            let mut feeds = Vec::new();
            let mut slots = Vec::new();
            for name in source_names(o) {
                match view.decoded.get(name) {
                    Some(d) => {
                        feeds.extend(d.inputs.iter().map(|&i| FeedSource::Stored(i)));
                        slots.push(Slot {
                            name: name.to_string(),
                            decode: Some(d.decoder.clone()),
                        });
                    }
                    None => {
                        feeds.push(match origin(o, name)? {
                            Origin::Stored(i) => FeedSource::Stored(*i),
                            Origin::Computed(d, dtype) => FeedSource::Derived(d.clone(), *dtype),
                        });
                        slots.push(Slot::plain(name));
                    }
                }
            }
            let inputs: Vec<usize> = (feeds.iter())
                .flat_map(|f| match f {
                    FeedSource::Stored(i) => vec![*i],
                    FeedSource::Derived(d, _) => d.inputs(),
                })
                .collect();
            entry.source = inputs.first().copied().unwrap_or(0);
            entry.relabel = false;
            let fixed = Arc::new(FixedOp {
                inputs,
                op: Arc::new(GgufTensorOp::new(o.clone(), slots)),
            });
            let fed = feeds.iter().any(|f| matches!(f, FeedSource::Derived(..)));
            entry.derive = Some(match fed {
                // A weight an earlier step computes, computed a chunk at a time as the GGUF
                // encoder reads it.
                true => Arc::new(FedDerive {
                    outer: fixed,
                    feeds,
                }),
                false => fixed,
            });
            out.push(entry);
        }
        *p.entries = out;
        Ok(true)
    }

    fn edit_config(&self, _cfg: &mut Map<String, Json>) -> Vec<String> {
        Vec::new()
    }

    fn nothing_done(&self) -> String {
        "no tensor to write".into()
    }
}

/// Refuses a tensor whose source dtype the GGUF types cannot take.
fn refuse_unconvertible(outputs: &[OutputTensor]) -> Result<()> {
    for o in outputs {
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
    Ok(())
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
    config_from(&path, map, arch_override)
}

/// The configuration `map` (read from, or edited from, `path`), with `--arch` replacing
/// `architectures`.
fn config_from(path: &Path, map: Map<String, Json>, arch_override: Option<&str>) -> Result<Config> {
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
    Config::from_json(path, json)
}

/// `general.name` of a model the run's earlier steps made (a merge): the output file's name
/// without `.gguf`, as converting that model from a folder of that name would give.
fn output_name(file_name: &str) -> String {
    file_name
        .strip_suffix(".gguf")
        .unwrap_or(file_name)
        .to_string()
}

/// `general.name`: the model directory's name (the reference derives a display name from it).
fn model_name(ckpt: &Checkpoint) -> String {
    // The input directory exists: its canonical form names it even when given as `.`.
    std::fs::canonicalize(&ckpt.dir)
        .unwrap_or_else(|_| ckpt.dir.clone())
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| "model".into())
}

/// The GGUF-specific part of a run's report and dry-run plan: per file, per ggml type.
pub fn report_fields(model: &GgufModel, plans: &[FilePlan], names: &[String]) -> Json {
    let files: Vec<Json> = plans
        .iter()
        .zip(names)
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
    for t in plans.iter().flat_map(|p| &p.tensors) {
        let e = types.entry(t.spec.ty.name()).or_default();
        e.0 += 1;
        e.1 += t.spec.byte_len;
    }
    json!({
        "architecture": model.cfg.spec.gguf_arch,
        "outtype": file_type_name(model.file_type),
        "file_type": model.file_type.id(),
        "files": files,
        "tensor_types": types.iter().map(|(k, (n, b))| json!({"type": k, "tensors": n, "bytes": b})).collect::<Vec<_>>(),
    })
}

pub fn file_type_name(ft: FileType) -> &'static str {
    match ft {
        FileType::AllF32 => "f32",
        FileType::MostlyF16 => "f16",
        FileType::MostlyBf16 => "bf16",
        FileType::MostlyQ8_0 => "q8_0",
        FileType::Quant(mix) => mix.name(),
        FileType::Unchanged(_) => "auto",
    }
}

/// How the dry run describes a tensor's recipe.
pub fn recipe_kind(t: &OutputTensor) -> &'static str {
    match &t.recipe {
        Recipe::Direct { .. } if t.copy_source().is_some() => "copy",
        Recipe::Direct { .. } => "cast",
        Recipe::Rows { .. } => "rows",
        Recipe::Stack { .. } => "stack",
        Recipe::KvBK { .. } => "kv_b split",
        Recipe::ExpertColumns { .. } => "expert transpose",
        Recipe::Mxfp4 { .. } => "mxfp4 repack",
        Recipe::Values(_) => "computed",
        Recipe::Shifted { .. } => "norm + 1",
        Recipe::Ternary { .. } => "ternarise",
    }
}
