//! One output tensor's inputs (a tensor of each source model, checked against each other) and
//! its parameters, resolved as mergekit's `resolve_parameters` does: per model from the
//! model's own settings, then the slice's, then the global ones, filters matched against the
//! model's tensor name; shared ones against the output tensor's name.

use std::path::PathBuf;
use std::sync::Arc;

use super::config::{levels, resolve, MergeConfig, OutputSlice};
use super::methods::Params;
use super::spec::{Base, Scope};
use super::step::{base_first, model_of, Model};
use crate::error::{Error, Result};
use crate::format::dtype::DType;
use crate::ops::feed::{FedDerive, FeedSource};
use crate::plan::Derive;

/// A tensor's inputs, in the order the method sees them: the base first for methods that
/// treat it apart, the other sources in config order.
#[derive(Debug)]
pub struct Inputs {
    /// Indices into `Checkpoint::tensors`.
    pub tensors: Vec<usize>,
    /// The model each comes from.
    pub models: Vec<PathBuf>,
    /// Each input's tensor name in its model.
    pub names: Vec<String>,
    /// Whether input 0 is the base model (for methods that treat it apart).
    pub has_base: bool,
    /// Each input's dtype and shape as the merge reads it (a quantised weight's once
    /// dequantised).
    pub dtypes: Vec<DType>,
    pub shapes: Vec<Vec<u64>>,
    /// Each input's dequantisation, for quantised weights.
    pub derived: Vec<Option<Arc<dyn Derive>>>,
}

impl Inputs {
    /// Finds source `k`'s tensor `input_name(k)` in each of `slice`'s models and checks that
    /// every one exists and has the first one's shape (but for the first axis when `vocab_rows`:
    /// a vocabulary tensor's rows are remapped to the merged vocabulary).
    pub(super) fn gather(
        config: &MergeConfig,
        slice: &OutputSlice,
        models: &[Model],
        input_name: &dyn Fn(usize) -> String,
        vocab_rows: bool,
    ) -> Result<Inputs> {
        let base = slice.base_model.as_ref().or(config.base_model.as_ref());
        let mut order: Vec<usize> = (0..slice.sources.len()).collect();
        let mut has_base = false;
        if base_first(config.method.base) {
            if let Some(pos) = base.and_then(|b| slice.sources.iter().position(|s| s.model == *b)) {
                order.remove(pos);
                order.insert(0, pos);
                has_base = true;
            }
        }
        let mut inputs = Inputs {
            tensors: Vec::new(),
            models: Vec::new(),
            names: Vec::new(),
            has_base,
            dtypes: Vec::new(),
            shapes: Vec::new(),
            derived: Vec::new(),
        };
        for k in order {
            let path = &slice.sources[k].model;
            let model = model_of(models, path);
            let name = input_name(k);
            let Some(e) = model.names.get(&name).map(|&i| &model.entries[i]) else {
                return Err(Error::InvalidTensor {
                    path: path.clone(),
                    tensor: name,
                    msg: "missing from this model, which the merge needs it from".into(),
                });
            };
            if let Some(a) = inputs.shapes.first() {
                let b = &e.shape;
                let skip = usize::from(vocab_rows);
                if a.get(skip..) != b.get(skip..) || a.len() != b.len() {
                    return Err(Error::InvalidTensor {
                        path: path.clone(),
                        tensor: name,
                        msg: format!(
                            "shape {b:?}, but `{}` of {} has shape {a:?}: tensors merged together must have the same shape",
                            inputs.names[0],
                            inputs.models[0].display()
                        ),
                    });
                }
            }
            inputs.tensors.push(e.source);
            inputs.dtypes.push(e.dtype);
            inputs.shapes.push(e.shape.clone());
            inputs.derived.push(e.derive.clone());
            inputs.models.push(path.clone());
            inputs.names.push(name);
        }
        Ok(inputs)
    }

    /// The dtype the inputs compute in when the config sets none: torch's promotion of theirs
    /// (equal dtypes stay; BF16 with F16 gives F32; the widest float otherwise).
    pub fn promoted_dtype(&self) -> DType {
        let mut d = self.dtypes[0];
        for &e in &self.dtypes[1..] {
            d = match (d, e) {
                (a, b) if a == b => a,
                (DType::F64, _) | (_, DType::F64) => DType::F64,
                (DType::F32, _) | (_, DType::F32) => DType::F32,
                (DType::BF16, DType::F16) | (DType::F16, DType::BF16) => DType::F32,
                (a, _) => a,
            };
        }
        d
    }
}

impl Inputs {
    /// Whether every input is stored (none is dequantised).
    pub fn stored(&self) -> bool {
        self.derived.iter().all(Option::is_none)
    }

    /// The merge `op` (which reads one tensor per input), reading the dequantised inputs
    /// through their decode ops.
    pub fn fed(&self, op: Arc<dyn Derive>) -> Arc<dyn Derive> {
        if self.stored() {
            return op;
        }
        let feeds = (self.derived.iter().zip(&self.tensors).zip(&self.dtypes))
            .map(|((d, &t), &dtype)| match d {
                Some(d) => FeedSource::Derived(d.clone(), dtype),
                None => FeedSource::Stored(t),
            })
            .collect();
        Arc::new(FedDerive { outer: op, feeds })
    }
}

/// A tensor's parameters: the shared ones, and each input's (in input order).
#[derive(Debug)]
pub struct Resolved {
    pub global: Params,
    pub models: Vec<Params>,
}

/// Resolves every parameter of the method for output tensor `name` at gradient position `t`.
/// A required parameter without a value is an error naming the model and tensor.
pub(super) fn resolve_tensor(
    config: &MergeConfig,
    slice: &OutputSlice,
    inputs: &Inputs,
    name: &str,
    t: f64,
) -> Result<Resolved> {
    let bad = |msg: String| Error::InvalidConfig {
        path: config.path.clone(),
        msg,
    };
    let missing = |p: &str, at: String| {
        bad(format!(
            "missing required parameter `{p}` of `{}` for {at}",
            config.method.name
        ))
    };
    let mut global = Params::default();
    for p in config
        .method
        .params
        .iter()
        .filter(|p| p.scope == Scope::Shared)
    {
        let v = resolve(&levels(config, slice, None), p.name, name, t).map_err(&bad)?;
        match v.or(p.default) {
            Some(v) => global = global.with(p.name, v),
            None => return Err(missing(p.name, format!("tensor `{name}`"))),
        }
    }
    let mut models = Vec::new();
    for (k, model) in inputs.models.iter().enumerate() {
        let is_base = k == 0 && inputs.has_base;
        let mut params = Params::default();
        for p in config
            .method
            .params
            .iter()
            .filter(|p| p.scope != Scope::Shared)
        {
            if p.scope == Scope::NonBase && is_base {
                continue;
            }
            let lv = levels(config, slice, Some(model));
            let v = resolve(&lv, p.name, &inputs.names[k], t).map_err(&bad)?;
            match v.or(p.default) {
                Some(v) => params = params.with(p.name, v),
                None => {
                    let base_note = if config.method.base == Base::Ignored
                        && config.base_model.as_ref() == Some(model)
                    {
                        " (the base model is an input of this method like any other)"
                    } else {
                        ""
                    };
                    return Err(missing(
                        p.name,
                        format!(
                            "model {}{base_note}, tensor `{}`",
                            model.display(),
                            inputs.names[k]
                        ),
                    ));
                }
            }
        }
        models.push(params);
    }
    Ok(Resolved { global, models })
}
