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

pub use crate::plan::kernel::lora as kernel;
mod bias;
mod experts;
pub mod extract;
mod finite;
pub mod merge;
mod params;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use regex::Regex;
use serde_json::{Map, Value};

use crate::error::{Error, Result};
use crate::format::checkpoint::Checkpoint;
use crate::format::dtype::DType;
use crate::ops::Op;
use crate::plan::{index_by_name, Derive, Entry, PlanNotes, PlanStep, Planning};
use merge::{ExpertSlice, GroupedLoraMerge, LoraFactors, LoraMerge};
use params::{assign_wrapped, ParamTable};

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
    /// Merge adapter tensors holding NaN or infinity instead of refusing them.
    pub allow_nonfinite: bool,
}

/// `target_modules` / `exclude_modules` of adapter_config.json: a list of names (PEFT's suffix
/// match: the module is named exactly, or ends with `.NAME`) or one regex (PEFT's
/// `re.fullmatch` against the whole module name).
#[derive(Debug, Clone)]
pub enum ModulePattern {
    List(Vec<String>),
    Regex(String, Regex),
    /// `"all-linear"`: every linear layer but the output head, which PEFT resolves from the
    /// module classes; a safetensors file has no classes, so every pair in the file counts.
    AllLinear,
}

impl ModulePattern {
    /// A JSON value (list or string) as a pattern; `None` for an absent or null key.
    fn parse(key: &str, v: Option<&Value>) -> std::result::Result<Option<ModulePattern>, String> {
        match v {
            None | Some(Value::Null) => Ok(None),
            Some(Value::String(s)) if key == "target_modules" && s.eq_ignore_ascii_case("all-linear") => {
                Ok(Some(ModulePattern::AllLinear))
            }
            Some(Value::String(s)) => Regex::new(&format!("^(?:{s})$"))
                .map(|re| Some(ModulePattern::Regex(s.clone(), re)))
                .map_err(|e| format!("`{key}` regex `{s}` cannot be used (Rust regex syntax, no look-around or back-references): {e}")),
            Some(Value::Array(a)) => a
                .iter()
                .map(|x| {
                    x.as_str()
                        .map(String::from)
                        .ok_or_else(|| format!("`{key}` holds {x}, not a module name"))
                })
                .collect::<std::result::Result<Vec<_>, _>>()
                .map(|l| Some(ModulePattern::List(l))),
            Some(x) => Err(format!("`{key}` is {x}, neither a list of names nor a regex")),
        }
    }

    /// PEFT's match of one module name: `key in list or key.endswith("." + name)`, or
    /// `re.fullmatch(regex, key)`.
    fn matches(&self, key: &str) -> bool {
        match self {
            ModulePattern::List(l) => l.iter().any(|t| suffix_match(key, t)),
            ModulePattern::Regex(_, re) => re.is_match(key),
            ModulePattern::AllLinear => true,
        }
    }

    fn describe(&self) -> String {
        match self {
            ModulePattern::List(l) => format!("{l:?}"),
            ModulePattern::Regex(s, _) => format!("regex `{s}`"),
            ModulePattern::AllLinear => "all-linear".into(),
        }
    }
}

/// PEFT's list match: `key == name or key.endswith("." + name)`.
fn suffix_match(key: &str, name: &str) -> bool {
    key.strip_suffix(name)
        .is_some_and(|rest| rest.is_empty() || rest.ends_with('.'))
}

/// Whether PEFT puts an adapter on a module (`check_target_module_exists`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Targeted {
    Yes,
    No,
    /// By `exclude_modules`, or because `modules_to_save` names it.
    Excluded,
}

/// What `adapter_config.json` says, as far as merging needs it.
#[derive(Debug, Clone, Default)]
pub struct LoraConfig {
    pub r: u64,
    pub alpha: f64,
    pub use_rslora: bool,
    pub rank_pattern: Vec<(String, u64)>,
    pub alpha_pattern: Vec<(String, f64)>,
    pub fan_in_fan_out: bool,
    pub use_dora: bool,
    /// PEFT's `lora_bias`: `lora_B` has a bias, added to the layer's bias on merge.
    pub lora_bias: bool,
    pub modules_to_save: Vec<String>,
    /// Parameters targeted directly (`mlp.experts.gate_up_proj`): grouped expert weights.
    pub target_parameters: Vec<String>,
    /// `None`: the config does not say (an old config, or `--rank/--alpha` without one), so
    /// every pair in the adapter file is taken as targeted.
    pub target_modules: Option<ModulePattern>,
    pub exclude_modules: Option<ModulePattern>,
    /// Layer indices (`layers_to_transform`, an int or a list; empty = all layers).
    pub layers_to_transform: Vec<u64>,
    /// Names of the layer list (`layers_pattern`); empty: the first numbered segment.
    pub layers_pattern: Vec<String>,
    /// Compiled once: PEFT's layer-index regexes (from `layers_pattern`, or its default) and
    /// its `modules_to_save` exclusion regexes.
    layer_res: Vec<Regex>,
    saved_res: Vec<Regex>,
}

impl LoraConfig {
    pub fn parse(path: &Path) -> Result<LoraConfig> {
        let bad = |msg: String| Error::Adapter {
            path: path.into(),
            msg,
        };
        let text = crate::sys::read_regular_to_string(path).map_err(|e| Error::io(path, e))?;
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
        let target_modules =
            ModulePattern::parse("target_modules", v.get("target_modules")).map_err(bad)?;
        let exclude_modules =
            ModulePattern::parse("exclude_modules", v.get("exclude_modules")).map_err(bad)?;
        let layers_to_transform = match v.get("layers_to_transform") {
            None | Some(Value::Null) => Vec::new(),
            Some(Value::Number(n)) => vec![n
                .as_u64()
                .ok_or_else(|| bad(format!("`layers_to_transform` {n} is not a layer index")))?],
            Some(Value::Array(a)) => a
                .iter()
                .map(|x| {
                    x.as_u64().ok_or_else(|| {
                        bad(format!(
                            "`layers_to_transform` holds {x}, not a layer index"
                        ))
                    })
                })
                .collect::<Result<Vec<_>>>()?,
            Some(x) => {
                return Err(bad(format!(
                    "`layers_to_transform` is {x}, not an index or a list"
                )))
            }
        };
        let layers_pattern = list("layers_pattern");
        let layer_res = if layers_pattern.is_empty() {
            vec![Regex::new(r"^.*?\.[^.]*\.(?P<idx>\d+)\.").expect("valid")]
        } else {
            layers_pattern
                .iter()
                .map(|p| {
                    Regex::new(&format!(r"^(?:^|.*?\.){p}\.(?P<idx>\d+)\.")).map_err(|e| {
                        bad(format!(
                            "`layers_pattern` `{p}` cannot be used as a regex: {e}"
                        ))
                    })
                })
                .collect::<Result<Vec<_>>>()?
        };
        let use_dora = v.get("use_dora").and_then(Value::as_bool).unwrap_or(false);
        let lora_bias = v.get("lora_bias").and_then(Value::as_bool).unwrap_or(false);
        if lora_bias && use_dora {
            return Err(bad(
                "`lora_bias: true` with `use_dora: true`: PEFT does not support a LoRA bias with DoRA"
                    .into(),
            ));
        }
        let modules_to_save = list("modules_to_save");
        let saved_res = modules_to_save
            .iter()
            .map(|m| {
                Regex::new(&format!(r"^(^|.*\.){m}($|\..*)")).map_err(|e| {
                    bad(format!(
                        "`modules_to_save` `{m}` cannot be used as a regex: {e}"
                    ))
                })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(LoraConfig {
            target_modules,
            exclude_modules,
            layers_to_transform,
            layers_pattern,
            layer_res,
            saved_res,
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
            use_dora,
            lora_bias,
            modules_to_save,
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

    /// PEFT's `check_target_module_exists` for the module named `key` (as in the base model):
    /// `exclude_modules` and `modules_to_save` first, then `target_modules` (a list also
    /// filtered by `layers_to_transform` / `layers_pattern`).
    pub fn targets(&self, key: &str) -> Targeted {
        if self
            .exclude_modules
            .as_ref()
            .is_some_and(|p| p.matches(key))
        {
            return Targeted::Excluded;
        }
        if self.saved_res.iter().any(|re| re.is_match(key)) {
            return Targeted::Excluded;
        }
        let found = match &self.target_modules {
            // An old config or none at all: the file says what is targeted.
            None if self.target_parameters.is_empty() => true,
            None => false,
            Some(ModulePattern::List(l)) if l.iter().any(|t| t == key) => true,
            Some(p @ ModulePattern::List(_)) => p.matches(key) && self.in_layers(key),
            Some(p) => p.matches(key),
        };
        if found {
            Targeted::Yes
        } else {
            Targeted::No
        }
    }

    /// `layers_to_transform`: the module's layer index (PEFT: the first numbered segment, or
    /// the one after a `layers_pattern` name) is listed; a module without one is not targeted.
    fn in_layers(&self, key: &str) -> bool {
        if self.layers_to_transform.is_empty() {
            return true;
        }
        // PEFT tries each pattern in turn and takes the first that matches.
        let index = self
            .layer_res
            .iter()
            .find_map(|re| re.captures(key))
            .and_then(|c| c.name("idx")?.as_str().parse::<u64>().ok());
        index.is_some_and(|i| self.layers_to_transform.contains(&i))
    }

    /// Whether a parameter (`module.param`, as in the base model) is named by
    /// `target_parameters` (PEFT: the same suffix match as a `target_modules` list).
    pub fn targets_parameter(&self, key: &str) -> bool {
        self.target_parameters.iter().any(|t| suffix_match(key, t))
    }

    /// The settings that decide what is targeted, for messages.
    pub fn describe_targets(&self) -> String {
        let mut v = vec![format!(
            "target_modules {}",
            self.target_modules
                .as_ref()
                .map_or_else(|| "not given".into(), ModulePattern::describe)
        )];
        if let Some(ex) = &self.exclude_modules {
            v.push(format!("exclude_modules {}", ex.describe()));
        }
        if !self.layers_to_transform.is_empty() {
            v.push(format!(
                "layers_to_transform {:?}",
                self.layers_to_transform
            ));
        }
        if !self.layers_pattern.is_empty() {
            v.push(format!("layers_pattern {:?}", self.layers_pattern));
        }
        if !self.modules_to_save.is_empty() {
            v.push(format!("modules_to_save {:?}", self.modules_to_save));
        }
        v.join(", ")
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

/// `key` without its trailing `.base_layer` segments, and how many there were: PEFT nests one
/// ParamWrapper per targeted parameter of a module, so the pair of the k-th wrapper from the
/// outside is saved as `module` + k × `.base_layer` + `.lora_A.weight`.
fn unwrap_base_layers(key: &str) -> (&str, usize) {
    let mut module = key;
    let mut depth = 0;
    while let Some(m) = module.strip_suffix(".base_layer") {
        module = m;
        depth += 1;
    }
    (module, depth)
}

/// Checks adapter_config.json's patterns against the base before anything is merged: every
/// `target_modules` entry (or its regex) and every `target_parameters` entry must name
/// something in the base model, and the whole must target at least one module. An
/// `exclude_modules` that excludes nothing is only a warning (as in PEFT).
fn check_patterns(
    cfg: &LoraConfig,
    entries: &[Entry],
    params: &ParamTable,
    config_file: &Path,
    notes: &mut PlanNotes,
) -> Result<()> {
    let bad = |msg: String| Error::Adapter {
        path: config_file.into(),
        msg,
    };
    // Every module of the base model: each dotted prefix of a tensor name.
    let mut modules: std::collections::BTreeSet<&str> = std::collections::BTreeSet::new();
    for e in entries {
        let mut rest = e.name.as_str();
        while let Some((m, _)) = rest.rsplit_once('.') {
            modules.insert(m);
            rest = m;
        }
    }
    match &cfg.target_modules {
        Some(ModulePattern::List(list)) => {
            for t in list {
                if !modules.iter().any(|m| suffix_match(m, t)) {
                    return Err(bad(format!(
                        "target_modules entry `{t}` matches no module of the base model"
                    )));
                }
            }
        }
        Some(ModulePattern::Regex(s, re)) if !modules.iter().any(|m| re.is_match(m)) => {
            return Err(bad(format!(
                "target_modules regex `{s}` matches no module of the base model"
            )));
        }
        Some(ModulePattern::AllLinear) => notes.lines.push(
            "target_modules is \"all-linear\": every LoRA pair in the adapter file is taken as targeted (module classes are not in the files)".into(),
        ),
        _ => {}
    }
    for t in &cfg.target_parameters {
        if !params.any_named(t) {
            return Err(bad(format!(
                "target_parameters entry `{t}` matches no parameter of the base model"
            )));
        }
    }
    if let Some(ex) = &cfg.exclude_modules {
        if !modules.iter().any(|m| ex.matches(m)) {
            notes.warnings.push(format!(
                "merge-lora: exclude_modules {} excludes no module of the base model",
                ex.describe()
            ));
        }
    }
    let some_target = matches!(cfg.target_modules, Some(ModulePattern::List(ref l)) if !l.is_empty())
        || matches!(cfg.target_modules, Some(ModulePattern::Regex(..)));
    if some_target
        && cfg.target_parameters.is_empty()
        && !modules
            .iter()
            .any(|m| params.has_module(m) && cfg.targets(m) == Targeted::Yes)
    {
        return Err(bad(format!(
            "targets no module of the base model: {}",
            cfg.describe_targets()
        )));
    }
    Ok(())
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
    /// adapter_config.json (or where it would be, for `--rank/--alpha`), named in errors.
    config_file: PathBuf,
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
    /// `lora_B.bias` (PEFT's `lora_bias`).
    bias: Option<usize>,
}

enum Kind {
    A(String, bool),
    B(String, bool),
    Magnitude(String),
    Bias(String),
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
    if let Some(m) = strip(".lora_B.bias") {
        return Kind::Bias(m);
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
#[allow(clippy::too_many_arguments)]
fn grouped_derive(
    w: &Entry,
    ckpt: &Checkpoint,
    module: &str,
    cfg: &LoraConfig,
    a: usize,
    b: usize,
    user_scale: f64,
    model_type: Option<&str>,
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
    // Both layouts fit a square stack: PEFT reads [E, out, in] unless the experts module says
    // `is_transposed` (transformers' gpt-oss, Aria and openai-privacy-filter experts).
    let transposed_model = matches!(
        model_type,
        Some("gpt_oss" | "aria" | "aria_text" | "openai_privacy_filter")
    );
    let in_out = if (x, y) == (a_in, b_out) && (x != y || transposed_model) {
        true
    } else if (x, y) == (b_out, a_in) {
        false
    } else {
        return Err(format!(
            "`{module}`: factors for in={a_in}, out={b_out} do not fit base `{}` {:?}",
            w.name, w.shape
        ));
    };
    let base_dtype = float_base(w, ckpt, module)?;
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
            delta_dtype: None,
        },
    })
}

/// The dtype PEFT's ParamWrapper rounds `s·Δ` to before adding it to the wrapped parameter `w`
/// ([`LoraFactors::delta_dtype`]): the dtype `w` is held in (stored, or as an earlier cast step
/// rounds it) when narrower than f32. A computed base (dequantised FP8), which PEFT adds to in
/// high precision, is not rounded. Read before the merge puts a rounding derive on `w`.
fn wrapper_rounding(w: &Entry) -> Option<DType> {
    (w.derive.is_none() && matches!(w.dtype, DType::BF16 | DType::F16)).then_some(w.dtype)
}

/// The stored dtype of the base `w` that a merge into `module` reads: a float, or anything an
/// earlier step computes (FP8 dequantisation).
fn float_base(w: &Entry, ckpt: &Checkpoint, module: &str) -> std::result::Result<DType, String> {
    let base_dtype = ckpt.tensors[w.source].info.dtype;
    let float = matches!(
        base_dtype,
        DType::F32 | DType::BF16 | DType::F16 | DType::F64
    );
    if w.derive.is_none() && !float {
        return Err(format!(
            "`{module}`: base `{}` is {base_dtype}; dequantise it first (dequant-fp8 --merge-lora)",
            w.name
        ));
    }
    Ok(base_dtype)
}

/// Refuses LoRA factors (or a DoRA magnitude) of `module` stored in anything but a float.
fn float_factors(
    module: &str,
    dtypes: impl IntoIterator<Item = DType>,
) -> std::result::Result<(), String> {
    match dtypes
        .into_iter()
        .find(|d| !matches!(d, DType::F32 | DType::BF16 | DType::F16))
    {
        Some(d) => Err(format!("`{module}`: adapter dtype {d} is not a float")),
        None => Ok(()),
    }
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

/// A merge's inputs: the base's (the tensor, or the inputs of the op computing it), then A and B.
fn merge_inputs(prev: &Option<Arc<dyn Derive>>, base: usize, a: usize, b: usize) -> Vec<usize> {
    let mut v = prev.as_ref().map_or_else(|| vec![base], |p| p.inputs());
    v.push(a);
    v.push(b);
    v
}

impl Derive for GroupedDerive {
    fn inputs(&self) -> Vec<usize> {
        merge_inputs(&self.prev, self.base, self.a, self.b)
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
    expert: ExpertSlice,
    a: usize,
    b: usize,
    m: Option<usize>,
    f: LoraFactors,
}

impl Derive for LoraDerive {
    fn inputs(&self) -> Vec<usize> {
        let mut v = merge_inputs(&self.prev, self.base, self.a, self.b);
        v.extend(self.m);
        v
    }
    fn build(&self, dst: DType) -> Arc<dyn Op> {
        let base_op = self.prev.as_ref().map(|p| p.build(DType::F32));
        Arc::new(LoraMerge {
            rows: self.rows,
            cols: self.cols,
            expert: self.expert,
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
            config_file: config_path,
            note,
            whole_state,
        });
        Ok(())
    }

    fn apply(&self, p: Planning) -> Result<bool> {
        let (ckpt, config, entries, notes) = (p.ckpt, p.config, p.entries, p.notes);
        let model_type = config
            .and_then(|c| c.get("model_type"))
            .and_then(Value::as_str);
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
                Kind::Bias(m) => modules.entry(m).or_default().bias = Some(i),
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
        let index = index_by_name(entries);
        let info = |i: usize| &ckpt.tensors[i].info;
        let params = ParamTable::new(entries);
        check_patterns(cfg, entries, &params, &att.config_file, notes)?;
        // Parameters targeted through target_parameters, per (module, nesting depth).
        let mut by_module: BTreeMap<&str, Vec<(usize, usize, usize)>> = BTreeMap::new();
        for (key, m) in &modules {
            if let (Some(a), Some(b)) = (m.a, m.b) {
                let (module, depth) = unwrap_base_layers(key);
                by_module.entry(module).or_default().push((depth, a, b));
            }
        }
        let mut wrapped_at: std::collections::HashMap<(String, usize), usize> =
            std::collections::HashMap::new();
        for (module, pairs) in by_module {
            let wrapped = params.wrapped(cfg, module);
            let weight_pair = pairs.iter().any(|p| p.0 == 0)
                && index.contains_key(&format!("{module}.weight"))
                && cfg.targets(module) == Targeted::Yes;
            if wrapped.is_empty() || weight_pair {
                continue;
            }
            let (assigned, warning) =
                assign_wrapped(module, &pairs, &wrapped, &params, ckpt).map_err(&bad)?;
            notes.warnings.extend(warning);
            for (depth, wi) in assigned {
                wrapped_at.insert((module.to_string(), depth), wi);
            }
        }
        let (mut merged, mut dora, mut biases) = (0, 0, 0);
        // Adapter tensors that reach the output: scanned for NaN and infinity below.
        let mut merged_from: Vec<usize> = Vec::new();
        // Pairs PEFT would not have put on the model: (tensor names, why).
        let mut not_targeted: Vec<(Vec<String>, String)> = Vec::new();
        for (key, m) in &modules {
            let names = || -> Vec<String> {
                [m.a, m.b, m.magnitude, m.bias]
                    .into_iter()
                    .flatten()
                    .map(|i| info(i).name.clone())
                    .collect()
            };
            let (Some(a), Some(b)) = (m.a, m.b) else {
                unmatched.extend(names());
                continue;
            };
            // PEFT nests one ParamWrapper per targeted parameter of a module: the pair under
            // `k` `.base_layer` segments belongs to the parameter wrapped k-th from the outside.
            let (module, depth) = unwrap_base_layers(key);
            let weight = index
                .get(&format!("{module}.weight"))
                .copied()
                .filter(|_| depth == 0);
            let wrapped = params.wrapped(cfg, module);
            let target = match (weight, cfg.targets(module)) {
                (Some(wi), Targeted::Yes) => Ok(wi),
                _ if !wrapped.is_empty() => match wrapped_at.get(&(module.to_string(), depth)) {
                    Some(&wi) => Ok(wi),
                    None => Err(None),
                },
                (Some(_), Targeted::Excluded) => Err(Some(format!("`{module}` (excluded)"))),
                (Some(_), _) => Err(Some(format!("`{module}` (not targeted)"))),
                // Fused experts without target_parameters (no adapter_config.json): nothing says
                // which parameter a pair is for, so the pair stays unmatched.
                (None, _)
                    if params.stores_module(module)
                        || (params.has_module(module) && !cfg.target_parameters.is_empty()) =>
                {
                    Err(Some(format!(
                        "`{module}` (no parameter of it in target_parameters)"
                    )))
                }
                (None, _) => Err(None),
            };
            let wi = match target {
                Ok(wi) => wi,
                Err(Some(why)) => {
                    not_targeted.push((names(), why));
                    continue;
                }
                Err(None) => {
                    unmatched.extend(names());
                    continue;
                }
            };
            // A parameter PEFT wraps in a ParamWrapper (target_parameters), not a layer.
            let wrapper = wrapped.contains(&wi);
            let module = if wrapper { params.name(wi) } else { module };
            if wrapped.contains(&wi) {
                if let Some(mi) = m.magnitude {
                    return Err(bad(format!(
                        "`{}`: DoRA on a parameter targeted through target_parameters is not supported (PEFT refuses it too)",
                        info(mi).name
                    )));
                }
            }
            // PEFT's lora_bias exists on Linear and Conv layers only (not embeddings, nor
            // parameters wrapped through target_parameters).
            let grouped = params.fused(wi).is_some()
                || (entries[wi].shape.len() == 3 && info(a).shape.len() != 3);
            if let (Some(bi), true) = (m.bias, wrapper || grouped || m.embedding) {
                return Err(bad(format!(
                    "`{}`: a LoRA bias on {} is not supported (PEFT has none there)",
                    info(bi).name,
                    if m.embedding {
                        "an embedding"
                    } else {
                        "grouped or targeted parameters"
                    }
                )));
            }
            // A fused expert parameter of a base stored per expert: merged into each expert.
            if let Some(fused) = params.fused(wi) {
                let scale = self.opts.scale;
                experts::merge_per_expert(fused, entries, ckpt, cfg, (a, b), scale)
                    .map_err(&bad)?;
                merged += 1;
                merged_from.extend([a, b]);
                continue;
            }
            let module = module.to_string();
            let module = module.as_str();
            let delta_dtype = wrapper.then(|| wrapper_rounding(&entries[wi])).flatten();
            // A base an earlier cast step rounded is merged rounded, as Python tftf does.
            if let Some(r) = crate::ops::cast::RoundedBase::of(&entries[wi], ckpt) {
                entries[wi].derive = Some(Arc::new(r));
            }
            let (ai, bi) = (info(a), info(b));
            // Conv LoRA: lora_A [r, in, k…] (the base's kernel), lora_B [out, r, 1…]; Δ is
            // B·A over the flattened kernel, the plain LoRA merge of [out, in·k…].
            let conv = entries[wi].shape.len() >= 3 && ai.shape.len() == entries[wi].shape.len();
            if entries[wi].shape.len() == 3 && !conv {
                let mut derive = grouped_derive(
                    &entries[wi],
                    ckpt,
                    module,
                    cfg,
                    a,
                    b,
                    self.opts.scale,
                    model_type,
                )
                .map_err(bad)?;
                derive.f.delta_dtype = delta_dtype;
                entries[wi].derive = Some(Arc::new(derive));
                merged += 1;
                merged_from.extend([a, b]);
                continue;
            }
            let w = &entries[wi];
            let (ra, a_cols, b_rows, rb) = if conv {
                let fits = ai.shape[1..] == w.shape[1..]
                    && bi.shape.len() == w.shape.len()
                    && bi.shape[2..].iter().all(|&d| d == 1);
                if !fits {
                    return Err(bad(format!(
                        "`{module}`: convolution factors lora_A {:?} and lora_B {:?} do not fit base `{}` {:?} (PEFT's conv LoRA has lora_A [r, in, kernel…] and lora_B [out, r, 1…]; grouped convolutions cannot be merged)",
                        ai.shape, bi.shape, w.name, w.shape
                    )));
                }
                (
                    ai.shape[0],
                    ai.shape[1..].iter().product(),
                    bi.shape[0],
                    bi.shape[1],
                )
            } else {
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
                (ra, a_cols, b_rows, rb)
            };
            let (r, scale) = cfg.rank_and_scale(module);
            if ra != rb || ra != r {
                return Err(bad(format!(
                    "`{module}`: lora_A has rank {ra}, lora_B {rb}, adapter_config.json says {r}"
                )));
            }
            let (w_rows, w_cols) = match w.shape[..] {
                [rows, cols] => (rows, cols),
                [rows, _, ..] if conv => (rows, w.shape[1..].iter().product()),
                _ => {
                    return Err(bad(format!(
                        "`{module}`: base weight `{}` is {:?}, not a matrix",
                        w.name, w.shape
                    )))
                }
            };
            if w_rows == 0 || w_cols == 0 || r == 0 {
                return Err(bad(format!(
                    "`{module}`: base weight `{}` is {:?} with rank {r}: an empty matrix or a rank of 0 leaves nothing to merge; exclude the module from the adapter",
                    w.name, w.shape
                )));
            }
            let scale = merge_scale(module, scale, self.opts.scale).map_err(bad)?;
            let transposed = !conv && (m.embedding || cfg.fan_in_fan_out);
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
                Some(mi) if conv => {
                    return Err(bad(format!(
                        "`{}`: DoRA on convolution weights is not supported",
                        info(mi).name
                    )))
                }
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
            let base_dtype = float_base(w, ckpt, module).map_err(&bad)?;
            float_factors(module, [ai.dtype, bi.dtype].into_iter().chain(m_dtype)).map_err(&bad)?;
            let derive = LoraDerive {
                prev: w.derive.clone(),
                base: w.source,
                base_dtype,
                rows: w_rows,
                cols: w_cols,
                expert: ExpertSlice::WHOLE,
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
                    delta_dtype,
                },
            };
            entries[wi].derive = Some(Arc::new(derive));
            if let Some(bi) = m.bias {
                bias::bind(
                    module,
                    bi,
                    b_rows,
                    scale,
                    cfg.lora_bias,
                    &index,
                    entries,
                    ckpt,
                )
                .map_err(&bad)?;
                biases += 1;
            }
            merged += 1;
            dora += m.magnitude.is_some() as usize;
            merged_from.extend([a, b].into_iter().chain(m.magnitude).chain(m.bias));
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
            merged_from.push(i);
        }
        if !self.opts.allow_nonfinite {
            for &i in merged_from
                .iter()
                .filter(|&&i| info(i).dtype.is_castable_float())
            {
                finite::refuse_nonfinite(ckpt, i)?;
            }
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
        if !not_targeted.is_empty() {
            let shown: Vec<&str> = not_targeted
                .iter()
                .take(10)
                .map(|(_, why)| why.as_str())
                .collect();
            notes.warnings.push(format!(
                "merge-lora: left out {} LoRA pair(s) of the adapter file that PEFT would not put on the model ({}): {}{}",
                not_targeted.len(),
                cfg.describe_targets(),
                shown.join(", "),
                if not_targeted.len() > 10 { ", …" } else { "" }
            ));
        }
        let not_targeted: Vec<&String> = not_targeted.iter().flat_map(|(n, _)| n).collect();
        notes.lines.push(format!(
            "adapter {}: {merged} module(s) merged ({dora} DoRA, {biases} with a LoRA bias), {replaced} replaced (modules_to_save), {skipped} base copies skipped, {} not targeted by adapter_config.json, {} unmatched",
            path.display(),
            not_targeted.len(),
            unmatched.len()
        ));
        notes.tensors.push(serde_json::json!({
            "op": "merge-lora",
            "adapter": path.to_string_lossy(),
            "merged": merged,
            "dora": dora,
            "lora_bias": biases,
            "replaced": replaced,
            "skipped": skipped,
            "not_targeted": not_targeted,
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
