//! LoRA/DoRA adapters (PEFT layout) and the planning step that binds them to base tensors.
//!
//! Adapter keys, after stripping `base_model.model.` (or `base_model.`) and the adapter-name
//! segment (`.default`): `<module>.lora_A.weight` `[r, in]`, `<module>.lora_B.weight` `[out, r]`,
//! `<module>.lora_embedding_A` `[r, num]` / `lora_embedding_B` `[dim, r]`,
//! `<module>.lora_magnitude_vector` `[out]` (DoRA), `<module>.base_layer.weight` (PEFT's copy of
//! an unchanged base tensor: ignored), and full replacement tensors for `modules_to_save`
//! (`<module>.modules_to_save.<name>.weight`, or already un-prefixed). Every adapter tensor is
//! accounted for at plan time — merged, used as a replacement, skipped as a base copy — and the
//! rest is an error listing them, before any output exists.

pub mod kernel;
pub mod merge;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use regex::Regex;
use serde_json::{Map, Value};

use crate::error::{Error, Result};
use crate::format::checkpoint::Checkpoint;
use crate::format::dtype::DType;
use crate::ops::Op;
use crate::plan::{Derive, Entry, PlanNotes, PlanStep};
use merge::{GroupedLoraMerge, LoraFactors, LoraMerge};

/// Where the adapter weights are.
#[derive(Debug, Clone)]
pub enum AdapterSource {
    /// A file, an adapter directory or a training output directory.
    Path(PathBuf),
    /// FSDP rank files, in rank order: each holds a dim-0 slice of every tensor.
    Ranks(Vec<PathBuf>),
}

#[derive(Debug, Clone)]
pub struct LoraOptions {
    pub adapter: AdapterSource,
    pub config: Option<PathBuf>,
    pub adapter_name: String,
    /// Multiplies every module's `alpha / r`.
    pub scale: f64,
    pub allow_unmatched: bool,
    /// `(r, lora_alpha)` given on the command line, used when there is no adapter_config.json.
    pub rank_alpha: Option<(u64, f64)>,
}

/// What `adapter_config.json` says, as far as merging needs it.
#[derive(Debug, Clone)]
pub struct LoraConfig {
    pub r: u64,
    pub alpha: f64,
    pub use_rslora: bool,
    pub rank_pattern: Vec<(String, u64)>,
    pub alpha_pattern: Vec<(String, f64)>,
    pub fan_in_fan_out: bool,
    pub use_dora: bool,
    pub modules_to_save: Vec<String>,
    /// Parameters targeted directly (`mlp.experts.gate_up_proj`): grouped expert weights.
    pub target_parameters: Vec<String>,
}

impl LoraConfig {
    pub fn parse(path: &Path) -> Result<LoraConfig> {
        let bad = |msg: String| Error::Adapter {
            path: path.into(),
            msg,
        };
        let text = std::fs::read_to_string(path).map_err(|e| Error::io(path, e))?;
        let v: Value =
            serde_json::from_str(&text).map_err(|e| bad(format!("invalid JSON: {e}")))?;
        Self::parse_value(path, &v)
    }

    /// The settings in `v`, the JSON of `path` (named in errors).
    pub fn parse_value(path: &Path, v: &Value) -> Result<LoraConfig> {
        let bad = |msg: String| Error::Adapter {
            path: path.into(),
            msg,
        };
        let r = v
            .get("r")
            .and_then(Value::as_u64)
            .ok_or_else(|| bad("no integer `r`".into()))?;
        let alpha = v.get("lora_alpha").and_then(Value::as_f64).unwrap_or(8.0);
        let map = |key: &str| -> Vec<(String, f64)> {
            v.get(key)
                .and_then(Value::as_object)
                .map(|m| {
                    m.iter()
                        .filter_map(|(k, x)| Some((k.clone(), x.as_f64()?)))
                        .collect()
                })
                .unwrap_or_default()
        };
        let list = |key: &str| -> Vec<String> {
            match v.get(key) {
                Some(Value::Array(a)) => a
                    .iter()
                    .filter_map(|x| x.as_str().map(String::from))
                    .collect(),
                Some(Value::String(s)) => vec![s.clone()],
                _ => Vec::new(),
            }
        };
        Ok(LoraConfig {
            r,
            alpha,
            use_rslora: v
                .get("use_rslora")
                .and_then(Value::as_bool)
                .unwrap_or(false),
            rank_pattern: map("rank_pattern")
                .into_iter()
                .map(|(k, x)| (k, x as u64))
                .collect(),
            alpha_pattern: map("alpha_pattern"),
            fan_in_fan_out: v
                .get("fan_in_fan_out")
                .and_then(Value::as_bool)
                .unwrap_or(false),
            use_dora: v.get("use_dora").and_then(Value::as_bool).unwrap_or(false),
            modules_to_save: list("modules_to_save"),
            target_parameters: list("target_parameters"),
        })
    }

    /// PEFT's rule: the first pattern key `K` with `re.match(r"(.*\.)?(K)$", module)`.
    fn pattern<T: Copy>(pattern: &[(String, T)], module: &str) -> Option<T> {
        pattern.iter().find_map(|(k, v)| {
            Regex::new(&format!(r"^(.*\.)?({k})$"))
                .ok()
                .filter(|re| re.is_match(module))
                .map(|_| *v)
        })
    }

    /// `(r, scale)` of a module.
    pub fn rank_and_scale(&self, module: &str) -> (u64, f64) {
        let r = Self::pattern(&self.rank_pattern, module).unwrap_or(self.r);
        let alpha = Self::pattern(&self.alpha_pattern, module).unwrap_or(self.alpha);
        let scale = if self.use_rslora {
            alpha / (r as f64).sqrt()
        } else {
            alpha / r as f64
        };
        (r, scale)
    }
}

/// A PyTorch Distributed Checkpoint folder (FSDP training output).
fn is_dcp_dir(dir: &Path) -> bool {
    dir.join(".metadata").is_file()
}

/// The model DCP folder inside a training checkpoint (`pytorch_model_fsdp_0/`): the first by
/// name holding `.metadata`, optimizer folders only when there is nothing else.
fn dcp_subdir(dir: &Path) -> Option<PathBuf> {
    let mut found: Vec<PathBuf> = std::fs::read_dir(dir)
        .ok()?
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.is_dir() && is_dcp_dir(p))
        .collect();
    found.sort();
    let optimizer = |p: &PathBuf| {
        p.file_name()
            .is_some_and(|n| n.to_string_lossy().to_lowercase().contains("optimizer"))
    };
    found
        .iter()
        .find(|p| !optimizer(p))
        .or(found.first())
        .cloned()
}

/// The adapter inside `dir`: `adapter_model.safetensors`, else a DCP folder in it.
fn adapter_in(dir: &Path) -> Option<(PathBuf, &'static str)> {
    let direct = dir.join("adapter_model.safetensors");
    if direct.is_file() {
        return Some((direct, "adapter_model.safetensors"));
    }
    dcp_subdir(dir).map(|d| (d, "PyTorch DCP"))
}

/// Finds the adapter weights: a `.safetensors` file, a directory with
/// `adapter_model.safetensors`, a DCP folder (or a folder holding one, such as a training
/// checkpoint with `pytorch_model_fsdp_0/`), or a training output with `checkpoint-N` folders
/// (the highest holding an adapter). The note says which checkpoint and format were used.
pub fn locate_adapter(path: &Path) -> Result<(PathBuf, Option<String>)> {
    if path.is_file() || is_dcp_dir(path) {
        return Ok((path.to_path_buf(), None));
    }
    if let Some((found, format)) = adapter_in(path) {
        let note = (format == "PyTorch DCP")
            .then(|| format!("adapter: PyTorch DCP in {}", crate::escape::path(&found)));
        return Ok((found, note));
    }
    let mut best: Option<(u64, PathBuf, &'static str)> = None;
    if let Ok(rd) = std::fs::read_dir(path) {
        for e in rd.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            let Some(n) = name
                .strip_prefix("checkpoint-")
                .and_then(|n| n.parse::<u64>().ok())
            else {
                continue;
            };
            if best.as_ref().is_some_and(|(b, _, _)| n <= *b) {
                continue;
            }
            if let Some((f, format)) = adapter_in(&e.path()) {
                best = Some((n, f, format));
            }
        }
    }
    match best {
        Some((n, f, format)) => {
            let what = if format == "PyTorch DCP" {
                format!(
                    "{format} {}",
                    f.file_name().unwrap_or_default().to_string_lossy()
                )
            } else {
                format.to_string()
            };
            Ok((
                f,
                Some(format!(
                    "using the latest training checkpoint, checkpoint-{n} ({what})"
                )),
            ))
        }
        None => Err(Error::NoModel {
            path: path.into(),
            msg: "no adapter: expected a .safetensors file, adapter_model.safetensors, a PyTorch DCP folder (.metadata), or checkpoint-N folders holding one".into(),
        }),
    }
}

#[derive(Debug)]
struct Attached {
    file: PathBuf,
    first: usize,
    /// One past this adapter's last tensor: a later `--merge-lora` section attaches its own.
    end: usize,
    config: LoraConfig,
    note: Option<String>,
    /// The adapter is a DCP folder holding the whole training state dict.
    whole_state: bool,
}

#[derive(Debug)]
pub struct LoraMergeStep {
    pub opts: LoraOptions,
    attached: Mutex<Option<Attached>>,
}

impl LoraMergeStep {
    pub fn new(opts: LoraOptions) -> LoraMergeStep {
        LoraMergeStep {
            opts,
            attached: Mutex::new(None),
        }
    }
}

/// Attaches every rank file and adds one assembled tensor per name, its dim-0 slices
/// concatenated in rank order. Returns the index of the first assembled tensor.
fn assemble_ranks(ckpt: &mut Checkpoint, files: &[PathBuf]) -> Result<usize> {
    let mut ranges = Vec::with_capacity(files.len());
    for f in files {
        let start = ckpt.tensors.len();
        ckpt.attach(Checkpoint::open(f)?);
        ranges.push(start..ckpt.tensors.len());
    }
    let first = ckpt.tensors.len();
    let names: Vec<String> = ranges[0]
        .clone()
        .map(|i| ckpt.tensors[i].info.name.clone())
        .collect();
    for k in 1..files.len() {
        if ranges[k].len() != names.len() {
            return Err(Error::Adapter {
                path: files[k].clone(),
                msg: format!(
                    "holds {} tensors but {} holds {}: mismatched rank slices",
                    ranges[k].len(),
                    files[0].display(),
                    names.len()
                ),
            });
        }
    }
    for name in names {
        let mut parts = Vec::new();
        let mut rows = 0u64;
        let mut bytes = 0u64;
        let mut template: Option<crate::format::header::TensorInfo> = None;
        for (k, range) in ranges.iter().enumerate() {
            let Some(i) = range.clone().find(|&i| ckpt.tensors[i].info.name == name) else {
                return Err(Error::Adapter {
                    path: files[k].clone(),
                    msg: format!("has no slice of `{name}`: mismatched rank slices"),
                });
            };
            let t = &ckpt.tensors[i];
            if let Some(tp) = &template {
                if tp.dtype != t.info.dtype
                    || tp.shape.get(1..) != t.info.shape.get(1..)
                    || t.info.shape.is_empty()
                {
                    return Err(Error::Adapter {
                        path: files[k].clone(),
                        msg: format!(
                            "slice of `{name}` is {} {:?}, rank 0's is {} {:?}: mismatched rank slices",
                            t.info.dtype, t.info.shape, tp.dtype, tp.shape
                        ),
                    });
                }
            } else {
                template = Some(t.info.clone());
            }
            let n = t.info.shape.first().copied().unwrap_or(1);
            let mut offsets = vec![0; t.info.shape.len()];
            if let Some(o) = offsets.first_mut() {
                *o = rows;
            }
            parts.push(crate::format::source::Region {
                offsets,
                sizes: t.info.shape.clone(),
                placement: t.placement.clone(),
            });
            rows += n;
            bytes += t.info.nbytes();
        }
        let mut info = template.expect("at least one rank");
        if let Some(d0) = info.shape.first_mut() {
            *d0 = rows;
        }
        info.begin = 0;
        info.end = bytes;
        // Dim-0 slices in rank order: [`TensorRef::pieces`] copies them as byte ranges.
        let placement = if parts.len() == 1 {
            parts.pop().expect("one part").placement
        } else {
            crate::format::source::Placement::Regions(parts)
        };
        ckpt.push_assembled(info, placement);
    }
    Ok(first)
}

#[derive(Default)]
struct Module {
    a: Option<usize>,
    b: Option<usize>,
    embedding: bool,
    magnitude: Option<usize>,
}

enum Kind {
    A(String, bool),
    B(String, bool),
    Magnitude(String),
    BaseCopy,
    Replacement(String),
    Unknown,
}

fn normalise(name: &str, adapter_name: &str) -> String {
    let n = name
        .strip_prefix("base_model.model.")
        .or_else(|| name.strip_prefix("base_model."))
        .unwrap_or(name);
    let seg = format!(".{adapter_name}");
    let mut out = String::with_capacity(n.len());
    let mut rest = n;
    while let Some(i) = rest.find(&seg) {
        let after = &rest[i + seg.len()..];
        out.push_str(&rest[..i]);
        if !(after.is_empty() || after.starts_with('.')) {
            out.push_str(&seg);
        }
        rest = after;
    }
    out.push_str(rest);
    out
}

fn classify(name: &str, modules_to_save: &[String]) -> Kind {
    let strip = |suffix: &str| name.strip_suffix(suffix).map(String::from);
    if let Some(m) = strip(".lora_A.weight") {
        return Kind::A(m, false);
    }
    if let Some(m) = strip(".lora_B.weight") {
        return Kind::B(m, false);
    }
    if let Some(m) = strip(".lora_embedding_A") {
        return Kind::A(m, true);
    }
    if let Some(m) = strip(".lora_embedding_B") {
        return Kind::B(m, true);
    }
    if let Some(m) =
        strip(".lora_magnitude_vector").or_else(|| strip(".lora_magnitude_vector.weight"))
    {
        return Kind::Magnitude(m);
    }
    if name.contains(".base_layer.") {
        return Kind::BaseCopy;
    }
    if let Some(i) = name.find(".modules_to_save.") {
        let after = &name[i + ".modules_to_save.".len()..];
        let param = after.split_once('.').map_or("", |(_, p)| p);
        return Kind::Replacement(format!("{}.{param}", &name[..i]));
    }
    let module = name.rsplit_once('.').map_or(name, |(m, _)| m);
    if modules_to_save
        .iter()
        .any(|k| module == k || module.ends_with(&format!(".{k}")))
    {
        return Kind::Replacement(name.to_string());
    }
    Kind::Unknown
}

/// Binds PEFT's grouped expert factors to a 3-D base `[E, X, Y]`, the orientation read from
/// both operand shapes.
fn grouped_derive(
    w: &Entry,
    ckpt: &Checkpoint,
    module: &str,
    cfg: &LoraConfig,
    a: usize,
    b: usize,
    user_scale: f64,
) -> std::result::Result<GroupedDerive, String> {
    let (ai, bi) = (&ckpt.tensors[a].info, &ckpt.tensors[b].info);
    let [experts, x, y] = w.shape[..] else {
        unreachable!("3-D checked")
    };
    let ([ar, a_in], [b_out, br]) = (
        ai.shape[..]
            .try_into()
            .map_err(|_| format!("`{}` is not 2-D", ai.name))?,
        bi.shape[..]
            .try_into()
            .map_err(|_| format!("`{}` is not 2-D", bi.name))?,
    );
    let (r, scale) = cfg.rank_and_scale(module);
    if w.shape.contains(&0) || r == 0 {
        return Err(format!(
            "`{module}`: base weight `{}` is {:?} with rank {r}: an empty matrix or a rank of 0 leaves nothing to merge; exclude the module from the adapter",
            w.name, w.shape
        ));
    }
    let scale = merge_scale(module, scale, user_scale)?;
    if ar != experts * r || br != experts * r {
        return Err(format!(
            "`{module}`: grouped factors {:?} and {:?} do not hold {experts} experts of rank {r}",
            ai.shape, bi.shape
        ));
    }
    let in_out = if (x, y) == (a_in, b_out) {
        true
    } else if (x, y) == (b_out, a_in) {
        false
    } else {
        return Err(format!(
            "`{module}`: factors for in={a_in}, out={b_out} do not fit base `{}` {:?}",
            w.name, w.shape
        ));
    };
    let base_dtype = ckpt.tensors[w.source].info.dtype;
    if w.derive.is_none()
        && !matches!(
            base_dtype,
            DType::F32 | DType::BF16 | DType::F16 | DType::F64
        )
    {
        return Err(format!(
            "`{module}`: base `{}` is {base_dtype}; dequantise it first",
            w.name
        ));
    }
    Ok(GroupedDerive {
        prev: w.derive.clone(),
        base: w.source,
        base_dtype,
        experts,
        x,
        y,
        in_out,
        a,
        b,
        f: LoraFactors {
            rank: r,
            a_dtype: ai.dtype,
            b_dtype: bi.dtype,
            m_dtype: None,
            scale,
            transposed: false,
        },
    })
}

/// `alpha / r` (or `/ sqrt(r)`) times `--scale`, as the f32 the merge multiplies by; one that
/// is not finite would turn every merged element into infinity or NaN.
fn merge_scale(module: &str, scale: f64, user_scale: f64) -> std::result::Result<f32, String> {
    let s = (scale * user_scale) as f32;
    if !s.is_finite() {
        return Err(format!(
            "`{module}`: the merge scale (lora_alpha / r, times --scale) is {scale:?} x {user_scale:?}, which is not a finite f32; fix adapter_config.json"
        ));
    }
    Ok(s)
}

#[derive(Debug)]
struct GroupedDerive {
    prev: Option<Arc<dyn Derive>>,
    base: usize,
    base_dtype: DType,
    experts: u64,
    x: u64,
    y: u64,
    in_out: bool,
    a: usize,
    b: usize,
    f: LoraFactors,
}

impl Derive for GroupedDerive {
    fn inputs(&self) -> Vec<usize> {
        let mut v = self
            .prev
            .as_ref()
            .map_or_else(|| vec![self.base], |p| p.inputs());
        v.push(self.a);
        v.push(self.b);
        v
    }
    fn build(&self, dst: DType) -> Arc<dyn Op> {
        Arc::new(GroupedLoraMerge {
            experts: self.experts,
            x: self.x,
            y: self.y,
            in_out: self.in_out,
            base_inputs: self.prev.as_ref().map_or(1, |p| p.inputs().len()),
            base_op: self.prev.as_ref().map(|p| p.build(DType::F32)),
            base_dtype: self.base_dtype,
            f: self.f.clone(),
            dst,
        })
    }
}

#[derive(Debug)]
struct LoraDerive {
    prev: Option<Arc<dyn Derive>>,
    base: usize,
    base_dtype: DType,
    rows: u64,
    cols: u64,
    a: usize,
    b: usize,
    m: Option<usize>,
    f: LoraFactors,
}

impl Derive for LoraDerive {
    fn inputs(&self) -> Vec<usize> {
        let mut v = self
            .prev
            .as_ref()
            .map_or_else(|| vec![self.base], |p| p.inputs());
        v.push(self.a);
        v.push(self.b);
        v.extend(self.m);
        v
    }
    fn build(&self, dst: DType) -> Arc<dyn Op> {
        let base_op = self.prev.as_ref().map(|p| p.build(DType::F32));
        Arc::new(LoraMerge {
            rows: self.rows,
            cols: self.cols,
            base_inputs: self.prev.as_ref().map_or(1, |p| p.inputs().len()),
            base_op,
            base_dtype: self.base_dtype,
            f: self.f.clone(),
            dst,
        })
    }
}

impl PlanStep for LoraMergeStep {
    fn attach(&self, ckpt: &mut Checkpoint) -> Result<()> {
        let (file, note) = match &self.opts.adapter {
            AdapterSource::Path(p) => locate_adapter(p)?,
            AdapterSource::Ranks(files) => match files.first() {
                Some(f) => (
                    f.clone(),
                    Some(format!(
                        "{} FSDP rank files concatenated in rank order",
                        files.len()
                    )),
                ),
                None => return Err(Error::Usage("no rank files given".into())),
            },
        };
        // Beside the weights (for a DCP folder: in the checkpoint holding it), else in the
        // training directory above a `checkpoint-N`, else in the directory given.
        let config_path = match (&self.opts.config, &self.opts.adapter) {
            (Some(p), _) => p.clone(),
            (None, AdapterSource::Path(given)) => {
                let beside = file.with_file_name("adapter_config.json");
                let training = file
                    .ancestors()
                    .skip(1)
                    .find(|d| {
                        d.file_name()
                            .is_some_and(|n| n.to_string_lossy().starts_with("checkpoint-"))
                    })
                    .and_then(Path::parent)
                    .map(|d| d.join("adapter_config.json"));
                [
                    Some(beside.clone()),
                    training,
                    Some(given.join("adapter_config.json")),
                ]
                .into_iter()
                .flatten()
                .find(|p| p.is_file())
                .unwrap_or(beside)
            }
            _ => file.with_file_name("adapter_config.json"),
        };
        let config = match self.opts.rank_alpha {
            Some((r, alpha)) if self.opts.config.is_none() && !config_path.is_file() => {
                LoraConfig::parse_value(
                    &config_path,
                    &serde_json::json!({"r": r, "lora_alpha": alpha}),
                )?
            }
            _ if !config_path.is_file() => {
                return Err(Error::Adapter {
                    path: config_path,
                    msg: "adapter_config.json not found (it gives r, lora_alpha and the other settings); pass --adapter-config FILE, or --rank R --lora-alpha A".into(),
                });
            }
            _ => {
                ckpt.extra_inputs.push(config_path.clone());
                LoraConfig::parse(&config_path)?
            }
        };
        let first = match &self.opts.adapter {
            AdapterSource::Path(_) => ckpt.attach(Checkpoint::open(&file)?),
            AdapterSource::Ranks(files) => assemble_ranks(ckpt, files)?,
        };
        // An adapter without a single tensor merges nothing: almost surely the wrong file.
        if first == ckpt.tensors.len() {
            return Err(Error::Adapter {
                path: file,
                msg: "holds no tensors, so there is nothing to merge".into(),
            });
        }
        if let Some(n) = &note {
            ckpt.notes
                .push(format!("adapter {}: {n}", crate::escape::path(&file)));
        }
        let whole_state = file.is_dir();
        *self.attached.lock().unwrap() = Some(Attached {
            file,
            first,
            end: ckpt.tensors.len(),
            config,
            note,
            whole_state,
        });
        Ok(())
    }

    fn apply(
        &self,
        ckpt: &Checkpoint,
        _config: Option<&Map<String, Value>>,
        entries: &mut Vec<Entry>,
        notes: &mut PlanNotes,
    ) -> Result<bool> {
        let guard = self.attached.lock().unwrap();
        let att = guard.as_ref().expect("attach runs before apply");
        let cfg = &att.config;
        let path = &att.file;
        let bad = |msg: String| Error::Adapter {
            path: path.clone(),
            msg,
        };
        if let Some(n) = &att.note {
            notes.lines.push(format!("adapter {}: {n}", path.display()));
        }
        let mut modules: BTreeMap<String, Module> = BTreeMap::new();
        let mut replacements: Vec<(String, usize)> = Vec::new();
        let mut unmatched: Vec<String> = Vec::new();
        let mut skipped = 0;
        let mut not_in_base: Vec<String> = Vec::new();
        for i in att.first..att.end {
            let raw = &ckpt.tensors[i].info.name;
            let name = normalise(raw, &self.opts.adapter_name);
            match classify(&name, &cfg.modules_to_save) {
                Kind::A(m, emb) => {
                    let e = modules.entry(m).or_default();
                    e.a = Some(i);
                    e.embedding |= emb;
                }
                Kind::B(m, emb) => {
                    let e = modules.entry(m).or_default();
                    e.b = Some(i);
                    e.embedding |= emb;
                }
                Kind::Magnitude(m) => modules.entry(m).or_default().magnitude = Some(i),
                Kind::BaseCopy => skipped += 1,
                Kind::Replacement(target) => replacements.push((target, i)),
                // A DCP adapter is a training run's whole state dict: the base weights come
                // along (tied ones too, which the base may not store), never merge material.
                Kind::Unknown if att.whole_state => {
                    skipped += 1;
                    if ckpt.get(&name).is_none() {
                        not_in_base.push(name);
                    }
                }
                Kind::Unknown => unmatched.push(raw.clone()),
            }
        }
        if !not_in_base.is_empty() {
            notes.lines.push(format!(
                "adapter {}: {} base weight(s) of the training state are not in the base model and are left out (tied weights, say): {}",
                path.display(),
                not_in_base.len(),
                not_in_base.join(", ")
            ));
        }
        let index: std::collections::HashMap<String, usize> = entries
            .iter()
            .enumerate()
            .map(|(i, e)| (e.name.clone(), i))
            .collect();
        let info = |i: usize| &ckpt.tensors[i].info;
        let (mut merged, mut dora) = (0, 0);
        for (module, m) in &modules {
            let (Some(a), Some(b)) = (m.a, m.b) else {
                unmatched.extend(
                    [m.a, m.b, m.magnitude]
                        .into_iter()
                        .flatten()
                        .map(|i| info(i).name.clone()),
                );
                continue;
            };
            let target = index.get(&format!("{module}.weight")).copied().or_else(|| {
                cfg.target_parameters.iter().find_map(|t| {
                    let (suffix, param) = t.rsplit_once('.').unwrap_or(("", t));
                    let fits = suffix.is_empty()
                        || module == suffix
                        || module.ends_with(&format!(".{suffix}"));
                    fits.then(|| index.get(&format!("{module}.{param}")).copied())
                        .flatten()
                })
            });
            let Some(wi) = target else {
                unmatched.extend(
                    [Some(a), Some(b), m.magnitude]
                        .into_iter()
                        .flatten()
                        .map(|i| info(i).name.clone()),
                );
                continue;
            };
            // A base an earlier cast step rounded is merged rounded, as Python tftf does.
            if let Some(r) = crate::ops::cast::RoundedBase::of(&entries[wi], ckpt) {
                entries[wi].derive = Some(Arc::new(r));
            }
            if entries[wi].shape.len() == 3 {
                let derive = grouped_derive(&entries[wi], ckpt, module, cfg, a, b, self.opts.scale)
                    .map_err(bad)?;
                entries[wi].derive = Some(Arc::new(derive));
                merged += 1;
                continue;
            }
            let w = &entries[wi];
            let (ai, bi) = (info(a), info(b));
            let [ra, a_cols] = ai.shape[..] else {
                return Err(bad(format!(
                    "`{}` should be 2-D, is {:?}",
                    ai.name, ai.shape
                )));
            };
            let [b_rows, rb] = bi.shape[..] else {
                return Err(bad(format!(
                    "`{}` should be 2-D, is {:?}",
                    bi.name, bi.shape
                )));
            };
            let (r, scale) = cfg.rank_and_scale(module);
            if ra != rb || ra != r {
                return Err(bad(format!(
                    "`{module}`: lora_A has rank {ra}, lora_B {rb}, adapter_config.json says {r}"
                )));
            }
            let [w_rows, w_cols] = w.shape[..] else {
                return Err(bad(format!(
                    "`{module}`: base weight `{}` is {:?}, not a matrix",
                    w.name, w.shape
                )));
            };
            if w_rows == 0 || w_cols == 0 || r == 0 {
                return Err(bad(format!(
                    "`{module}`: base weight `{}` is {:?} with rank {r}: an empty matrix or a rank of 0 leaves nothing to merge; exclude the module from the adapter",
                    w.name, w.shape
                )));
            }
            let scale = merge_scale(module, scale, self.opts.scale).map_err(bad)?;
            let transposed = m.embedding || cfg.fan_in_fan_out;
            let expected = if transposed {
                (a_cols, b_rows)
            } else {
                (b_rows, a_cols)
            };
            if (w_rows, w_cols) != expected {
                return Err(bad(format!(
                    "`{module}`: lora_A {:?} and lora_B {:?} give a {}x{} delta but base `{}` is {:?}",
                    ai.shape, bi.shape, expected.0, expected.1, w.name, w.shape
                )));
            }
            let m_dtype = match m.magnitude {
                Some(mi) if transposed => {
                    return Err(bad(format!(
                        "`{}`: DoRA on transposed (Conv1D or embedding) weights is not supported",
                        info(mi).name
                    )))
                }
                Some(mi) if info(mi).shape != [w_rows] => {
                    return Err(bad(format!(
                        "`{}` is {:?}, expected [{w_rows}]",
                        info(mi).name,
                        info(mi).shape
                    )))
                }
                Some(mi) => Some(info(mi).dtype),
                None => None,
            };
            let base_dtype = ckpt.tensors[w.source].info.dtype;
            let float_base = w.derive.is_some()
                || matches!(
                    base_dtype,
                    DType::F32 | DType::BF16 | DType::F16 | DType::F64
                );
            if !float_base {
                return Err(bad(format!(
                    "`{module}`: base `{}` is {base_dtype}; dequantise it first (dequant-fp8 --merge-lora)",
                    w.name
                )));
            }
            for d in [ai.dtype, bi.dtype].into_iter().chain(m_dtype) {
                if !matches!(d, DType::F32 | DType::BF16 | DType::F16) {
                    return Err(bad(format!("`{module}`: adapter dtype {d} is not a float")));
                }
            }
            let derive = LoraDerive {
                prev: w.derive.clone(),
                base: w.source,
                base_dtype,
                rows: w_rows,
                cols: w_cols,
                a,
                b,
                m: m.magnitude,
                f: LoraFactors {
                    rank: r,
                    a_dtype: ai.dtype,
                    b_dtype: bi.dtype,
                    m_dtype,
                    scale,
                    transposed,
                },
            };
            entries[wi].derive = Some(Arc::new(derive));
            merged += 1;
            dora += m.magnitude.is_some() as usize;
        }
        let mut replaced = 0;
        for (target, i) in replacements {
            let Some(&wi) = index.get(&target) else {
                unmatched.push(info(i).name.clone());
                continue;
            };
            if entries[wi].shape != info(i).shape {
                return Err(bad(format!(
                    "`{}` {:?} cannot replace `{target}` {:?}",
                    info(i).name,
                    info(i).shape,
                    entries[wi].shape
                )));
            }
            // A float replacement takes the base's float dtype (PEFT saves F32 copies of BF16
            // modules); any other keeps its own.
            let floats = info(i).dtype.is_castable_float() && entries[wi].dtype.is_castable_float();
            if !floats {
                entries[wi].dtype = info(i).dtype;
            }
            entries[wi].source = i;
            entries[wi].derive = None;
            replaced += 1;
        }
        // An adapter that matches nothing at all is refused as a whole (the wrong base model,
        // most likely), by the plan's `nothing_done` check rather than per tensor.
        let nothing_matched = merged + replaced == 0;
        if !unmatched.is_empty() {
            if !self.opts.allow_unmatched && !nothing_matched {
                let list: Vec<String> = unmatched
                    .iter()
                    .take(10)
                    .map(|n| format!("`{n}`"))
                    .collect();
                return Err(Error::UnmatchedAdapter {
                    path: path.clone(),
                    count: unmatched.len(),
                    list: list.join(", ") + if unmatched.len() > 10 { ", …" } else { "" },
                });
            }
            notes.lines.push(format!(
                "{} unmatched adapter tensor(s) left out ({})",
                unmatched.len(),
                if nothing_matched {
                    "nothing matched"
                } else {
                    "--allow-unmatched"
                }
            ));
        }
        notes.lines.push(format!(
            "adapter {}: {merged} module(s) merged ({dora} DoRA), {replaced} replaced (modules_to_save), {skipped} base copies skipped, {} unmatched",
            path.display(),
            unmatched.len()
        ));
        notes.tensors.push(serde_json::json!({
            "op": "merge-lora",
            "adapter": path.to_string_lossy(),
            "merged": merged,
            "dora": dora,
            "replaced": replaced,
            "skipped": skipped,
            "unmatched": unmatched,
        }));
        Ok(merged + replaced > 0)
    }

    fn nothing_done(&self) -> String {
        let guard = self.attached.lock().unwrap();
        let adapter = guard.as_ref().map_or_else(String::new, |a| {
            format!(" {}", crate::escape::path(&a.file))
        });
        format!(
            "merge-lora: the adapter{adapter} matches no tensor of this base model (is -b the model it was trained on? is --adapter-name right?)"
        )
    }

    fn edit_config(&self, _cfg: &mut Map<String, Value>) -> Vec<String> {
        Vec::new()
    }
}

#[cfg(test)]
mod tests;
