//! The merge as a planning step: the donor model (the base, else the first model) is the job's
//! checkpoint; every other model is opened and attached to it, so the one pipeline reads all of
//! them within the one memory budget. Planning then binds each output tensor to its inputs
//! (one per model, by name and layer) and to the op that merges them, and checks from headers
//! alone — names, shapes, dtypes, architectures, layer ranges, parameters — so a bad merge
//! fails before any output exists.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use serde_json::{Map, Value};

use super::config::{MergeConfig, OutputSlice};
use super::layers::{layer_count, split_layer, LayerName};
use super::op::MergeOp;
use super::resolve::{resolve_tensor, Inputs};
use super::spec::{Arithmetic, Base};
use super::tokenizer::{set_vocab_size, MergedVocab, RemapOp, RowPlan, VOCAB_TENSORS};
use crate::error::{Error, Result};
use crate::format::checkpoint::Checkpoint;
use crate::plan::{DeferredDst, Entry, PlanStep, Planning};

/// A model of the merge, once opened.
#[derive(Debug)]
pub(super) struct Model {
    pub path: PathBuf,
    /// Tensor name → index in `entries`.
    pub names: HashMap<String, usize>,
    /// The model's tensors as the merge reads them, quantised weights dequantised
    /// ([`super::quantised`]).
    pub entries: Vec<Entry>,
    pub config: Option<Map<String, Value>>,
    pub layers: u64,
    /// What dequantising its weights found, for the plan's notes.
    pub dequant_notes: Vec<String>,
    /// Whether any of its weights was quantised.
    pub dequantised: bool,
}

#[derive(Debug)]
pub struct MergeStep {
    pub config: MergeConfig,
    /// mergekit's `--allow-crimes`: merge models of different architectures.
    pub allow_crimes: bool,
    /// Copy the donor's tokenizer files (mergekit's `--copy-tokenizer`, on by default).
    pub copy_tokenizer: bool,
    /// `--random-seed`: the stream of the stochastic methods.
    pub seed: u64,
    models: Mutex<Vec<Model>>,
    /// The merged vocabulary, once built (`tokenizer_source` / `tokenizer`).
    vocab: Mutex<Option<Arc<MergedVocab>>>,
}

impl MergeStep {
    pub fn new(config: MergeConfig, allow_crimes: bool, copy_tokenizer: bool, seed: u64) -> Self {
        MergeStep {
            config,
            allow_crimes,
            copy_tokenizer,
            seed,
            models: Mutex::new(Vec::new()),
            vocab: Mutex::new(None),
        }
    }

    /// The output's layer count: the slices' lengths added up.
    fn output_layers(&self, models: &[Model]) -> u64 {
        self.config
            .slices
            .iter()
            .map(|s| {
                let (a, b) = range_of(s, 0, models);
                b - a
            })
            .sum()
    }

    /// Different architectures (`config.json` `architectures`, `model_type`) are refused
    /// unless `--allow-crimes`, as mergekit does.
    fn check_architectures(&self, models: &[Model]) -> Result<()> {
        if self.allow_crimes {
            return Ok(());
        }
        let arch = |m: &Model| {
            m.config.as_ref().map(|c| {
                (
                    c.get("architectures").cloned().unwrap_or(Value::Null),
                    c.get("model_type").cloned().unwrap_or(Value::Null),
                )
            })
        };
        let donor = arch(&models[0]);
        for m in &models[1..] {
            if arch(m) != donor {
                let show = |a: &Option<(Value, Value)>| match a {
                    Some((arch, ty)) => format!("{arch} ({ty})"),
                    None => "unknown (no config.json)".into(),
                };
                return Err(Error::InvalidConfig {
                    path: self.config.path.clone(),
                    msg: format!(
                        "model {} is a {} but {} is a {}; pass --allow-crimes to merge different architectures",
                        m.path.display(),
                        show(&arch(m)),
                        models[0].path.display(),
                        show(&donor)
                    ),
                });
            }
        }
        Ok(())
    }

    /// Builds the merged vocabulary (`tokenizer_source` / `tokenizer`) from every model's
    /// tokenizer, before any output exists (`tokenizer/`).
    fn build_vocab(&self, models: &[Model]) -> Result<()> {
        let Some(cfg) = &self.config.tokenizer else {
            return Ok(());
        };
        let bad = |msg: String| Error::InvalidConfig {
            path: self.config.path.clone(),
            msg,
        };
        for (tok, m) in cfg.source_models() {
            if !models.iter().any(|x| x.path == *m) {
                return Err(bad(format!(
                    "`tokenizer.tokens.{tok}`: model {} is not one of the merged models",
                    m.display()
                )));
            }
        }
        let list: Vec<_> = models
            .iter()
            .map(|m| (m.path.clone(), m.config.as_ref()))
            .collect();
        let vocab = MergedVocab::build(cfg, &list, self.config.chat_template.as_deref())
            .map_err(|e| bad(format!("tokenizer: {e}")))?;
        *self.vocab.lock().unwrap() = Some(Arc::new(vocab));
        Ok(())
    }

    /// Every slice source's layer range within its model.
    fn check_ranges(&self, models: &[Model]) -> Result<()> {
        for (i, s) in self.config.slices.iter().enumerate() {
            for (j, src) in s.sources.iter().enumerate() {
                let m = model_of(models, &src.model);
                if let Some((_, end)) = src.layer_range.filter(|&(_, e)| e > m.layers) {
                    return Err(Error::InvalidConfig {
                        path: self.config.path.clone(),
                        msg: format!(
                            "slices[{i}].sources[{j}]: layer_range ends at {end} but model {} has {} layers",
                            m.path.display(),
                            m.layers
                        ),
                    });
                }
            }
        }
        Ok(())
    }
}

/// The model at `path` (every configured model was opened by `attach`).
pub(super) fn model_of<'a>(models: &'a [Model], path: &Path) -> &'a Model {
    models
        .iter()
        .find(|m| m.path == path)
        .expect("every configured model is attached")
}

/// Source `k`'s layer range in `slice` (the whole model when the config gave none).
fn range_of(slice: &OutputSlice, k: usize, models: &[Model]) -> (u64, u64) {
    let src = &slice.sources[k];
    src.layer_range
        .unwrap_or((0, model_of(models, &src.model).layers))
}

impl PlanStep for MergeStep {
    fn attach(&self, ckpt: &mut Checkpoint) -> Result<()> {
        let mut models = Vec::new();
        let dtype = super::quantised::dequant_dtype(self.config.dtype);
        for (k, path) in self.config.models().into_iter().enumerate() {
            let (range, config) = if k == 0 {
                (0..ckpt.base_count, ckpt.config()?)
            } else {
                let other = Checkpoint::open(&path)?;
                let config = other.config()?;
                let count = other.base_count;
                let first = ckpt.attach(other);
                (first..first + count, config)
            };
            let t = super::quantised::model_tensors(ckpt, range, config.as_ref(), dtype)?;
            let names: HashMap<String, usize> = (t.entries.iter().enumerate())
                .map(|(i, e)| (e.name.clone(), i))
                .collect();
            let layers = layer_count(config.as_ref(), names.keys().map(String::as_str));
            models.push(Model {
                path,
                names,
                entries: t.entries,
                config,
                layers,
                dequant_notes: t.notes,
                dequantised: t.dequantised,
            });
        }
        *self.models.lock().unwrap() = models;
        Ok(())
    }

    fn apply(&self, p: Planning) -> Result<bool> {
        let models = self.models.lock().unwrap();
        self.check_architectures(&models)?;
        self.check_ranges(&models)?;
        self.build_vocab(&models)?;
        let donor = &models[0];
        // Tensors outside the layers, in the donor's order: the embeddings before the layers,
        // the rest (final norm, lm_head) after them.
        let mut pre = Vec::new();
        let mut post = Vec::new();
        for m in models.iter() {
            for n in &m.dequant_notes {
                p.notes.lines.push(format!("{}: {n}", m.path.display()));
            }
        }
        for e in &donor.entries {
            let name = &e.name;
            if split_layer(name).is_none() {
                if is_embedding(name) {
                    pre.push(name.clone());
                } else {
                    post.push(name.clone());
                }
            }
        }
        let mut out: Vec<Entry> = Vec::new();
        let first = &self.config.slices[0];
        let last = self.config.slices.last().expect("at least one slice");
        for name in &pre {
            self.push(&mut out, &models, first, name, &|_| name.clone(), 0.0)?;
        }
        let mut layer_out = 0u64;
        for slice in &self.config.slices {
            let (a, b) = range_of(slice, 0, &models);
            let first_model = model_of(&models, &slice.sources[0].model);
            for idx in 0..b - a {
                let t = if b - a > 1 {
                    idx as f64 / (b - a - 1) as f64
                } else {
                    1.0
                };
                let mut names: Vec<(&String, LayerName)> = first_model
                    .names
                    .keys()
                    .filter_map(|n| split_layer(n).map(|l| (n, l)))
                    .filter(|(_, l)| l.index == a + idx)
                    .collect();
                names.sort_by_key(|(n, _)| first_model.names[*n]);
                for (_, l) in names {
                    let out_name = l.with_index(layer_out);
                    let input_name = |k: usize| l.with_index(range_of(slice, k, &models).0 + idx);
                    self.push(&mut out, &models, slice, &out_name, &input_name, t)?;
                }
                layer_out += 1;
            }
        }
        for name in &post {
            self.push(&mut out, &models, last, name, &|_| name.clone(), 0.0)?;
        }
        let unused = donor.names.len() - out.len().min(donor.names.len());
        if !self.config.sliced && unused > 0 {
            p.notes.lines.push(format!(
                "{unused} tensor(s) of {} are not part of the merge",
                donor.path.display()
            ));
        }
        *p.entries = out;
        Ok(true)
    }

    fn edit_config(&self, cfg: &mut Map<String, Value>) -> Vec<String> {
        let models = self.models.lock().unwrap();
        // A quantised donor's `quantization_config` does not describe the merged weights.
        let mut changes = if models[0].dequantised {
            super::quantised::dequant_step(super::quantised::dequant_dtype(self.config.dtype))
                .edit_config(cfg)
        } else {
            Vec::new()
        };
        let layers = self.output_layers(&models);
        for key in ["num_hidden_layers", "n_layer", "num_layers"] {
            if let Some(old) = cfg
                .get(key)
                .and_then(Value::as_u64)
                .filter(|&n| n != layers)
            {
                cfg.insert(key.into(), Value::from(layers));
                changes.push(format!("config.json: {key} {old} -> {layers}"));
            }
        }
        if let Some(v) = self.vocab.lock().unwrap().as_ref() {
            changes.extend(set_vocab_size(cfg, v.rows));
        }
        // transformers 5 writes `dtype` alone, older versions `torch_dtype`: keep to the key
        // the donor has, as mergekit's re-serialised config does.
        match self.config.out_dtype.or(self.config.dtype) {
            Some(d) if !cfg.contains_key("torch_dtype") && cfg.contains_key("dtype") => {
                let name = Value::from(d.torch_name());
                if let Some(old) = cfg
                    .insert("dtype".into(), name.clone())
                    .filter(|o| *o != name)
                {
                    changes.push(format!("config.json: dtype {old} -> {name}"));
                }
            }
            Some(d) => changes.extend(crate::plan::edit_config_dtype(cfg, d)),
            None => {}
        }
        changes
    }

    fn nothing_done(&self) -> String {
        "the merge produces no tensor".into()
    }

    fn dropped_side_files(&self) -> &'static [&'static str] {
        match self.vocab.lock().unwrap().as_ref() {
            // Token ids changed: the donor's generation config may name the wrong ones.
            Some(v) if !v.donor_ids_kept => TOKENIZER_AND_GENERATION_FILES,
            Some(_) => TOKENIZER_FILES,
            // The donor's model card does not describe the merge, nor does a quantised
            // donor's ModelOpt file.
            None if self.copy_tokenizer => &["README.md", "hf_quant_config.json"],
            None => TOKENIZER_FILES,
        }
    }

    fn generated_files(&self) -> Vec<(String, String)> {
        let mut files = Vec::new();
        if let Ok(text) = std::fs::read_to_string(&self.config.path) {
            files.push(("mergekit_config.yml".to_string(), text));
        }
        match self.vocab.lock().unwrap().as_ref() {
            Some(v) => files.extend(v.files.iter().cloned()),
            None => {
                if let Some(t) = &self.config.chat_template {
                    files.push(("chat_template.jinja".to_string(), t.clone()));
                }
            }
        }
        files
    }
}

/// The model card and mergekit's tokenizer files (`merge.py`, `_copy_tokenizer`), and
/// `vocab.json`: left out without `--copy-tokenizer`, or replaced by a merged vocabulary's.
const TOKENIZER_FILES: &[&str] = TOKENIZER_AND_GENERATION_FILES
    .split_last()
    .expect("the list is not empty")
    .1;

/// [`TOKENIZER_FILES`] and (last) the generation config, whose token ids another model's
/// vocabulary may change.
const TOKENIZER_AND_GENERATION_FILES: &[&str] = &[
    "README.md",
    "hf_quant_config.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.json",
    "tokenizer.model",
    "added_tokens.json",
    "merges.txt",
    "vocab.json",
    "chat_template.jinja",
    "chat_template.json",
    "generation_config.json",
];

/// Embeddings come before the layers (mergekit's `pre_weights`); other tensors outside the
/// layers (final norm, `lm_head`) after them.
fn is_embedding(name: &str) -> bool {
    name.contains("embed") || name.contains(".wte.") || name.contains(".wpe.")
}

impl MergeStep {
    /// Adds output tensor `name`, made from `slice`'s sources (source `k`'s tensor named
    /// `input_name(k)`) at gradient position `t`.
    #[allow(clippy::too_many_arguments)]
    fn push(
        &self,
        out: &mut Vec<Entry>,
        models: &[Model],
        slice: &OutputSlice,
        name: &str,
        input_name: &dyn Fn(usize) -> String,
        t: f64,
    ) -> Result<()> {
        let vocab = (self.vocab.lock().unwrap().clone()).filter(|_| VOCAB_TENSORS.contains(&name));
        let inputs = Inputs::gather(&self.config, slice, models, input_name, vocab.is_some())?;
        let resolved = resolve_tensor(&self.config, slice, &inputs, name, t)?;
        let first = inputs.tensors[0];
        let compute = self.config.dtype.unwrap_or_else(|| inputs.promoted_dtype());
        let non_base = inputs.models.len() - usize::from(inputs.has_base);
        let dst = self
            .config
            .out_dtype
            .unwrap_or_else(|| self.config.method.result_dtype(compute, non_base));
        let id = out.len();
        // A dequantised input is computed even where a stored one would be copied.
        let copy = matches!(self.config.method.arithmetic, Arithmetic::Passthrough)
            && resolved.models[0].get("scale", f64::NAN).is_nan()
            && inputs.stored()
            && vocab.is_none();
        let mut shape = inputs.shapes[0].clone();
        let derive = if copy {
            None
        } else {
            let seed = super::op::tensor_seed(self.seed, name);
            let op = MergeOp::new(&self.config, &inputs, resolved, seed)?;
            Some(match &vocab {
                Some(v) => self.remap(v, &inputs, slice, op, name, &mut shape)?,
                None => inputs.fed(Arc::new(DeferredDst {
                    inputs: inputs.tensors.clone(),
                    op,
                })),
            })
        };
        out.push(Entry {
            id,
            name: name.to_string(),
            source: first,
            dtype: if copy && self.config.out_dtype.or(self.config.dtype).is_none() {
                inputs.dtypes[0]
            } else {
                dst
            },
            shape,
            derive,
            relabel: false,
        });
        Ok(())
    }
}

impl MergeStep {
    /// The op of a vocabulary tensor: each input's rows remapped to the merged vocabulary
    /// (`shape` becomes the output's), then `op`.
    #[allow(clippy::too_many_arguments)]
    fn remap(
        &self,
        vocab: &MergedVocab,
        inputs: &Inputs,
        slice: &OutputSlice,
        op: MergeOp,
        name: &str,
        shape: &mut [u64],
    ) -> Result<Arc<dyn crate::plan::Derive>> {
        if let Some(k) = inputs.derived.iter().position(Option::is_some) {
            return Err(Error::InvalidTensor {
                path: inputs.models[k].clone(),
                tensor: inputs.names[k].clone(),
                msg: "is quantised; a vocabulary tensor whose rows the merged tokenizer remaps must be stored as floats (`tftf dequant` the model first)".into(),
            });
        }
        let common = inputs.promoted_dtype();
        let row_len: u64 = shape[1..].iter().product();
        shape[0] = vocab.rows;
        let base = slice
            .base_model
            .as_ref()
            .or(self.config.base_model.as_ref());
        let plan = RowPlan::new(
            vocab,
            &inputs.models,
            &inputs.shapes.iter().map(|s| s[0]).collect::<Vec<_>>(),
            base.map(PathBuf::as_path),
            row_len as usize,
            inputs.dtypes.clone(),
            common,
        )
        .map_err(|msg| Error::InvalidTensor {
            path: self.config.path.clone(),
            tensor: name.to_string(),
            msg,
        })?;
        let bytes = (inputs.shapes.iter().zip(&inputs.dtypes))
            .map(|(s, d)| s.iter().product::<u64>() * d.size().map_or(4, |s| s as u64))
            .collect();
        Ok(Arc::new(DeferredDst {
            inputs: inputs.tensors.clone(),
            op: RemapOp::new(op.over_rows(shape, common), plan, bytes),
        }))
    }
}

/// Whether `base` policy puts the base first among a tensor's inputs.
pub(super) fn base_first(base: Base) -> bool {
    base != Base::Ignored
}
