//! mergekit's YAML configuration, read as mergekit 0.1.5 reads it (`mergekit/config.py`,
//! `parameter_resolver.py`), with one difference: a key mergekit would silently ignore (a typo
//! such as `base_modle`, or a parameter the method does not take) is refused, naming it, because
//! a merge that quietly ignored half its settings is a wrong merge.
//!
//! A parameter setting is a scalar, a gradient (a list interpolated across the layers of a
//! slice: `t = layer / (layers - 1)`, numbers linearly between neighbours, other values picked
//! at `floor(t * (n - 1))`), or a list of `{filter, value}` conditions, the first whose filter
//! is absent, `*` or a substring of the tensor name winning.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde_yaml::Value;

use super::spec::{MethodSpec, Scope};
use crate::error::{Error, Result};
use crate::format::dtype::DType;

/// One scalar of a setting, as YAML gave it.
#[derive(Clone, Debug, PartialEq)]
pub enum Scalar {
    Num(f64),
    Bool(bool),
    Str(String),
}

/// A parameter's setting, before it is evaluated for a tensor.
#[derive(Clone, Debug, PartialEq)]
pub enum Setting {
    Scalar(Scalar),
    /// Values across the layers of a slice.
    Gradient(Vec<Scalar>),
    /// `(filter, value)` pairs, tried in order.
    Conditional(Vec<(Option<String>, Setting)>),
}

/// Settings by parameter name.
pub type Settings = BTreeMap<String, Setting>;

/// A model as a slice source: the whole model (`layer_range: None`) or a range of its layers.
#[derive(Clone, Debug, PartialEq)]
pub struct SourceModel {
    pub model: PathBuf,
    pub layer_range: Option<(u64, u64)>,
    pub parameters: Settings,
}

/// One output slice: layers made from the same layers of each source.
#[derive(Clone, Debug, PartialEq)]
pub struct OutputSlice {
    pub sources: Vec<SourceModel>,
    pub base_model: Option<PathBuf>,
    pub parameters: Settings,
}

/// Where the output's tokenizer comes from.
#[derive(Clone, Debug, PartialEq)]
pub enum TokenizerSource {
    Base,
    Union,
    Model(PathBuf),
}

/// A parsed configuration. `models:` configs are normalised as mergekit does: one slice of
/// every model's whole layer range, the base model appended when not listed.
#[derive(Clone, Debug)]
pub struct MergeConfig {
    pub path: PathBuf,
    pub method: &'static MethodSpec,
    pub base_model: Option<PathBuf>,
    /// Whether the config used `slices:` (layer ranges given) rather than `models:`.
    pub sliced: bool,
    pub slices: Vec<OutputSlice>,
    pub parameters: Settings,
    pub dtype: Option<DType>,
    pub out_dtype: Option<DType>,
    /// `tokenizer_source`, or the `tokenizer:` section.
    pub tokenizer: Option<super::tokenizer::TokenizerConfig>,
    pub chat_template: Option<String>,
}

const TOP_KEYS: &[&str] = &[
    "merge_method",
    "models",
    "slices",
    "modules",
    "base_model",
    "parameters",
    "dtype",
    "out_dtype",
    "tokenizer_source",
    "tokenizer",
    "chat_template",
];

impl MergeConfig {
    /// Reads and checks `path`: keys, method, parameter names, dtypes, model paths.
    pub fn read(path: &Path) -> Result<MergeConfig> {
        let text = std::fs::read_to_string(path).map_err(|e| Error::io(path, e))?;
        Self::parse(path, &text)
    }

    /// Parses `text` (read from `path`, which errors name).
    pub fn parse(path: &Path, text: &str) -> Result<MergeConfig> {
        let bad = |msg: String| Error::InvalidConfig {
            path: path.to_path_buf(),
            msg,
        };
        let root: Value =
            serde_yaml::from_str(text).map_err(|e| bad(format!("not valid YAML: {e}")))?;
        let map = mapping(&root, "the configuration").map_err(&bad)?;
        check_keys(map, TOP_KEYS, "").map_err(&bad)?;
        let method_name = match map.get("merge_method") {
            Some(Value::String(s)) => s.clone(),
            Some(_) => return Err(bad("`merge_method` must be a name".into())),
            None => return Err(bad("`merge_method` is missing".into())),
        };
        let method = MethodSpec::get(&method_name).ok_or_else(|| {
            bad(format!(
                "unknown merge method `{method_name}`; mergekit 0.1.5's methods are: {}",
                MethodSpec::names().join(", ")
            ))
        })?;
        if map.contains_key("modules") {
            return Err(bad(
                "`modules` (multi-module architectures) is not supported yet; use `models` or `slices`".into(),
            ));
        }
        let base_model = map
            .get("base_model")
            .map(|v| model_path(v, "base_model"))
            .transpose()
            .map_err(&bad)?;
        let (models, slices) = (map.get("models"), map.get("slices"));
        let (sliced, mut slices) = match (models, slices) {
            (Some(m), None) => (false, vec![models_slice(m, &base_model).map_err(&bad)?]),
            (None, Some(s)) => (true, read_slices(s).map_err(&bad)?),
            _ => {
                return Err(bad(
                    "exactly one of `models` or `slices` must be present".into()
                ))
            }
        };
        slices.retain(|s| !s.sources.is_empty());
        if slices.is_empty() {
            return Err(bad("no models to merge".into()));
        }
        let parameters = match map.get("parameters") {
            Some(v) => settings(v, "parameters").map_err(&bad)?,
            None => Settings::new(),
        };
        let config = MergeConfig {
            path: path.to_path_buf(),
            method,
            base_model,
            sliced,
            slices,
            parameters,
            dtype: dtype_key(map, "dtype").map_err(&bad)?,
            out_dtype: dtype_key(map, "out_dtype").map_err(&bad)?,
            tokenizer: super::tokenizer::parse(map).map_err(&bad)?,
            chat_template: chat_template(map).map_err(&bad)?,
        };
        config.check_parameters().map_err(&bad)?;
        config.method.check_inputs(&config).map_err(&bad)?;
        Ok(config)
    }

    /// Every parameter named anywhere must be one the method takes, at a level it can be
    /// given at (per-model parameters at model level, shared ones anywhere).
    fn check_parameters(&self) -> std::result::Result<(), String> {
        let known = |name: &str, per_model: bool, at: &str| {
            match self.method.param(name) {
            Some(p) if per_model && p.scope == Scope::Shared => Err(format!(
                "{at}: parameter `{name}` of `{}` is shared by all models; set it under the top-level `parameters`",
                self.method.name
            )),
            Some(_) => Ok(()),
            None => Err(format!(
                "{at}: `{}` takes no parameter `{name}`{}",
                self.method.name,
                self.method.parameter_list()
            )),
        }
        };
        for name in self.parameters.keys() {
            known(name, false, "parameters")?;
        }
        for (i, s) in self.slices.iter().enumerate() {
            for name in s.parameters.keys() {
                known(name, false, &format!("slices[{i}].parameters"))?;
            }
            for src in &s.sources {
                let at = format!("model {}", src.model.display());
                for name in src.parameters.keys() {
                    known(name, true, &at)?;
                }
            }
        }
        Ok(())
    }

    /// The model whose `config.json` and side files the output gets: the base model, else the
    /// first model listed (mergekit takes an arbitrary one of its set of models there).
    pub fn donor(&self) -> &Path {
        self.base_model
            .as_deref()
            .unwrap_or(&self.slices[0].sources[0].model)
    }

    /// Every distinct model, the donor first, then in the order the config names them.
    pub fn models(&self) -> Vec<PathBuf> {
        let mut v = vec![self.donor().to_path_buf()];
        let named = self.slices.iter().flat_map(|s| {
            s.sources
                .iter()
                .map(|m| m.model.clone())
                .chain(s.base_model.clone())
        });
        for m in named {
            if !v.contains(&m) {
                v.push(m);
            }
        }
        v
    }
}

pub(super) fn mapping<'a>(
    v: &'a Value,
    what: &str,
) -> std::result::Result<&'a serde_yaml::Mapping, String> {
    v.as_mapping()
        .ok_or_else(|| format!("{what} must be a mapping of keys to values"))
}

/// Refuses keys not in `allowed`, naming the first (`at`: where, for the message).
pub(super) fn check_keys(
    map: &serde_yaml::Mapping,
    allowed: &[&str],
    at: &str,
) -> std::result::Result<(), String> {
    for k in map.keys() {
        let name = k.as_str().unwrap_or("");
        if !allowed.contains(&name) {
            let name = serde_yaml::to_string(k).unwrap_or_default();
            return Err(format!(
                "unknown key `{}`{at}; expected one of: {}",
                name.trim(),
                allowed.join(", ")
            ));
        }
    }
    Ok(())
}

/// A model reference: a local path that exists. mergekit's `repo@revision` and `model+lora`
/// forms name Hugging Face repositories or adapters, which tftf does not download or merge.
pub(super) fn model_path(v: &Value, at: &str) -> std::result::Result<PathBuf, String> {
    let s = match v {
        Value::String(s) => s.as_str(),
        _ => return Err(format!("`{at}` must be a model path")),
    };
    let p = PathBuf::from(s);
    if !p.exists() {
        return Err(format!(
            "`{at}`: model `{s}` is not an existing local path (tftf reads local checkpoints only: download the model first, merge a LoRA with `tftf merge-lora`)"
        ));
    }
    Ok(p)
}

fn models_slice(v: &Value, base: &Option<PathBuf>) -> std::result::Result<OutputSlice, String> {
    let list = v
        .as_sequence()
        .ok_or("`models` must be a list of `- model: PATH` entries")?;
    let mut sources = Vec::new();
    for (i, m) in list.iter().enumerate() {
        let at = format!("models[{i}]");
        sources.push(source(m, &at, false)?);
    }
    if let Some(b) = base {
        if !sources.iter().any(|s| s.model == *b) {
            sources.push(SourceModel {
                model: b.clone(),
                layer_range: None,
                parameters: Settings::new(),
            });
        }
    }
    Ok(OutputSlice {
        sources,
        base_model: None,
        parameters: Settings::new(),
    })
}

fn source(v: &Value, at: &str, sliced: bool) -> std::result::Result<SourceModel, String> {
    let map = mapping(v, at)?;
    let keys: &[&str] = if sliced {
        &["model", "layer_range", "parameters"]
    } else {
        &["model", "parameters"]
    };
    check_keys(map, keys, &format!(" in {at}"))?;
    let model = model_path(
        map.get("model")
            .ok_or_else(|| format!("{at}: `model` is missing"))?,
        &format!("{at}.model"),
    )?;
    let layer_range = match map.get("layer_range") {
        None if sliced => return Err(format!("{at}: `layer_range` is missing")),
        None => None,
        Some(r) => {
            let pair: Vec<u64> = r
                .as_sequence()
                .map(|s| s.iter().filter_map(Value::as_u64).collect())
                .unwrap_or_default();
            match pair[..] {
                [a, b] if a < b => Some((a, b)),
                _ => {
                    return Err(format!(
                        "{at}: `layer_range` must be [FIRST, END) with FIRST < END"
                    ))
                }
            }
        }
    };
    let parameters = match map.get("parameters") {
        Some(p) => settings(p, &format!("{at}.parameters"))?,
        None => Settings::new(),
    };
    Ok(SourceModel {
        model,
        layer_range,
        parameters,
    })
}

fn read_slices(v: &Value) -> std::result::Result<Vec<OutputSlice>, String> {
    let list = v.as_sequence().ok_or("`slices` must be a list")?;
    let mut out = Vec::new();
    for (i, s) in list.iter().enumerate() {
        let at = format!("slices[{i}]");
        let map = mapping(s, &at)?;
        check_keys(
            map,
            &["sources", "base_model", "parameters", "residual_weight"],
            &format!(" in {at}"),
        )?;
        if map.contains_key("residual_weight") {
            return Err(format!("{at}: `residual_weight` is not supported"));
        }
        let sources = map
            .get("sources")
            .and_then(Value::as_sequence)
            .ok_or_else(|| format!("{at}: `sources` must be a list"))?
            .iter()
            .enumerate()
            .map(|(j, m)| source(m, &format!("{at}.sources[{j}]"), true))
            .collect::<std::result::Result<Vec<_>, _>>()?;
        let lengths: Vec<u64> = sources
            .iter()
            .filter_map(|s| s.layer_range.map(|(a, b)| b - a))
            .collect();
        if lengths.windows(2).any(|w| w[0] != w[1]) {
            return Err(format!(
                "{at}: all sources of a slice must span the same number of layers"
            ));
        }
        out.push(OutputSlice {
            sources,
            base_model: map
                .get("base_model")
                .map(|b| model_path(b, &format!("{at}.base_model")))
                .transpose()?,
            parameters: match map.get("parameters") {
                Some(p) => settings(p, &format!("{at}.parameters"))?,
                None => Settings::new(),
            },
        });
    }
    Ok(out)
}

fn settings(v: &Value, at: &str) -> std::result::Result<Settings, String> {
    let map = mapping(v, &format!("`{at}`"))?;
    let mut out = Settings::new();
    for (k, v) in map {
        let name = k
            .as_str()
            .ok_or_else(|| format!("`{at}`: parameter names must be text"))?;
        out.insert(name.to_string(), setting(v, &format!("{at}.{name}"))?);
    }
    Ok(out)
}

fn scalar(v: &Value) -> Option<Scalar> {
    match v {
        Value::Bool(b) => Some(Scalar::Bool(*b)),
        Value::Number(n) => n.as_f64().map(Scalar::Num),
        Value::String(s) => Some(Scalar::Str(s.clone())),
        _ => None,
    }
}

fn setting(v: &Value, at: &str) -> std::result::Result<Setting, String> {
    if let Some(s) = scalar(v) {
        return Ok(Setting::Scalar(s));
    }
    let err = || {
        format!("`{at}`: expected a value, a list of values (a gradient) or a list of {{filter, value}}")
    };
    let conditional = |c: &Value| -> std::result::Result<(Option<String>, Setting), String> {
        let map = c.as_mapping().ok_or_else(err)?;
        check_keys(map, &["filter", "value"], &format!(" in `{at}`"))?;
        let filter = match map.get("filter") {
            None | Some(Value::Null) => None,
            Some(Value::String(f)) => Some(f.clone()),
            Some(_) => return Err(format!("`{at}`: `filter` must be text")),
        };
        let value = map
            .get("value")
            .ok_or_else(|| format!("`{at}`: a condition needs a `value`"))?;
        let value = match setting(value, at)? {
            Setting::Conditional(_) => return Err(err()),
            s => s,
        };
        Ok((filter, value))
    };
    match v {
        Value::Mapping(_) => Ok(Setting::Conditional(vec![conditional(v)?])),
        Value::Sequence(list) if list.iter().all(|e| scalar(e).is_some()) => {
            Ok(Setting::Gradient(list.iter().filter_map(scalar).collect()))
        }
        Value::Sequence(list) => Ok(Setting::Conditional(
            list.iter()
                .map(conditional)
                .collect::<std::result::Result<_, _>>()?,
        )),
        _ => Err(err()),
    }
}

/// `dtype` / `out_dtype`: torch's names (`bfloat16`, `float16`, `float32`, …) or tftf's.
fn dtype_key(map: &serde_yaml::Mapping, key: &str) -> std::result::Result<Option<DType>, String> {
    match map.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => {
            let name = s.strip_prefix("torch.").unwrap_or(s);
            DType::parse_cast_target(name)
                .map(Some)
                .ok_or_else(|| format!("`{key}: {s}`: use bfloat16, float16, float32 or float64"))
        }
        Some(_) => Err(format!("`{key}` must be a dtype name")),
    }
}

/// `chat_template`: a Jinja template, written as the output's `chat_template.jinja`.
/// mergekit's named templates (`chatml`, …) and `auto` (the most common template of the
/// models) are refused: tftf does not ship mergekit's template files.
fn chat_template(map: &serde_yaml::Mapping) -> std::result::Result<Option<String>, String> {
    match map.get("chat_template") {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) if s.contains('{') && s.len() >= 20 => Ok(Some(s.clone())),
        Some(Value::String(s)) => Err(format!(
            "`chat_template: {s}`: give the template itself (Jinja text); mergekit's named templates and `auto` are not supported"
        )),
        Some(_) => Err("`chat_template` must be text".into()),
    }
}

/// A setting's value for `tensor` at gradient position `t`, numbers and booleans as `f64`
/// (mergekit's arithmetic in Python floats), `None` when no condition matched.
pub fn evaluate(
    setting: &Setting,
    tensor: &str,
    t: f64,
    name: &str,
) -> std::result::Result<Option<f64>, String> {
    match setting {
        Setting::Scalar(s) => number(s, name).map(Some),
        Setting::Gradient(list) if list.is_empty() => Ok(None),
        Setting::Gradient(list) => {
            let values = list
                .iter()
                .map(|s| number(s, name))
                .collect::<std::result::Result<Vec<_>, _>>()?;
            if list.iter().any(|s| matches!(s, Scalar::Bool(_))) {
                return Ok(Some(values[(t * (values.len() - 1) as f64) as usize]));
            }
            let scaled = t * (values.len() - 1) as f64;
            let i0 = scaled as usize;
            let i1 = (i0 + 1).min(values.len() - 1);
            let frac = scaled - i0 as f64;
            Ok(Some((1.0 - frac) * values[i0] + frac * values[i1]))
        }
        Setting::Conditional(conds) => {
            for (filter, value) in conds {
                let hit = match filter.as_deref() {
                    None | Some("*") => true,
                    Some(f) => !tensor.is_empty() && tensor.contains(f),
                };
                if hit {
                    return evaluate(value, tensor, t, name);
                }
            }
            Ok(None)
        }
    }
}

/// A scalar as a number: YAML numbers, booleans (1 or 0), and text that reads as either
/// (PyYAML leaves `1e-3` as text; mergekit parses it).
fn number(s: &Scalar, name: &str) -> std::result::Result<f64, String> {
    match s {
        Scalar::Num(x) => Ok(*x),
        Scalar::Bool(b) => Ok(f64::from(u8::from(*b))),
        Scalar::Str(t) => match t.trim().to_ascii_lowercase().as_str() {
            "true" | "yes" | "on" => Ok(1.0),
            "false" | "no" | "off" => Ok(0.0),
            x => x
                .parse::<f64>()
                .map_err(|_| format!("parameter `{name}`: `{t}` is not a number")),
        },
    }
}

/// The levels a parameter's settings are looked up at, highest precedence first (mergekit's
/// `parameter_sources`): the model's own, the slice's, the global ones.
pub fn levels<'a>(
    config: &'a MergeConfig,
    slice: &'a OutputSlice,
    model: Option<&Path>,
) -> Vec<&'a Settings> {
    let own = model.and_then(|m| slice.sources.iter().find(|s| s.model == m));
    own.map(|s| &s.parameters)
        .into_iter()
        .chain([&slice.parameters, &config.parameters])
        .collect()
}

/// The first level's value for `name` that is not `None` (a condition none of whose filters
/// matched falls through to the next level).
pub fn resolve(
    levels: &[&Settings],
    name: &str,
    tensor: &str,
    t: f64,
) -> std::result::Result<Option<f64>, String> {
    for level in levels {
        if let Some(s) = level.get(name) {
            if let Some(v) = evaluate(s, tensor, t, name)? {
                return Ok(Some(v));
            }
        }
    }
    Ok(None)
}

#[cfg(test)]
#[path = "config_tests.rs"]
mod tests;
