//! LoRA extraction (`tftf extract-lora`), as mergekit 0.1.5's `mergekit-extract-lora` does it:
//! per linear weight, the truncated SVD of the task vector `Δ = finetuned − base`,
//! `Δ ≈ U_r S_r V_rᵀ`, split as `lora_A = √S_r V_rᵀ` `[r, in]` and `lora_B = U_r √S_r`
//! `[out, r]` (`--no-distribute-scale`: `lora_A = S_r V_rᵀ`, `lora_B = U_r`). By Eckart–Young
//! that is the best rank-r approximation: its error is `√(Σ_{i>r} σᵢ²)`. Embeddings
//! (`--embed-lora`) are decomposed transposed into `lora_embedding_A` `[r, vocab]` and
//! `lora_embedding_B` `[dim, r]`, as PEFT stores them; by default they, and every weight that
//! is not 2-D (norms), are saved whole under `modules_to_save`; a decomposed module's bias
//! change is `lora_B.bias`.
//!
//! Arithmetic: the difference is taken in f64 from the inputs' exact values (mergekit
//! subtracts in the input dtype, rounding Δ once more), the SVD runs in f64 (mergekit: f32),
//! and the factors are rounded once to the output dtype. faer runs sequentially
//! (`Par::Seq`), so the bytes do not depend on the thread count.

use std::collections::BTreeMap;

use faer::linalg::svd::{self, ComputeSvdVectors};
use faer::{Mat, Par};
use regex::Regex;

use crate::error::{Error, Result};
use crate::format::checkpoint::{Checkpoint, TensorRef};
use crate::format::dtype::DType;

/// What the user asked for (mergekit's options).
#[derive(Debug, Clone)]
pub struct ExtractOptions {
    pub rank: usize,
    pub distribute_scale: bool,
    pub embed_lora: bool,
    /// `--save-module`: module names or last name components saved at full rank.
    pub save_modules: Vec<String>,
    pub modules: ModuleFilter,
    pub skip_undecomposable: bool,
    /// dtype of the factors and bias changes; `None`: the fine-tuned tensor's.
    pub dtype: Option<DType>,
}

/// `--include-regex` and `--exclude-regex`: the modules decomposed.
#[derive(Debug, Clone, Default)]
pub struct ModuleFilter {
    pub include: Vec<Regex>,
    pub exclude: Vec<Regex>,
}

impl ModuleFilter {
    /// Module `m` matches an exclusion.
    fn excludes(&self, m: &str) -> bool {
        self.exclude.iter().any(|r| r.is_match(m))
    }

    /// Module `m` matches an inclusion, or none is given.
    fn includes(&self, m: &str) -> bool {
        self.include.is_empty() || self.include.iter().any(|r| r.is_match(m))
    }
}

/// How one group of output tensors is made.
#[derive(Debug, Clone, PartialEq)]
pub enum Recipe {
    /// `lora_A`/`lora_B` (or `lora_embedding_A`/`_B` when `transpose`) from the SVD of the
    /// difference of the tensors named `tensor` (`[out, in]`).
    Decompose { tensor: String, transpose: bool },
    /// The difference of the two tensors named `tensor` (a decomposed module's bias).
    Difference { tensor: String },
    /// The fine-tuned tensor's bytes unchanged (`modules_to_save`).
    Save { tensor: String },
}

/// One output tensor.
#[derive(Debug, Clone, PartialEq)]
pub struct OutTensor {
    pub name: String,
    pub dtype: DType,
    pub shape: Vec<u64>,
}

/// A recipe and the tensors it writes (two for a decomposition: A then B).
#[derive(Debug, Clone, PartialEq)]
pub struct Item {
    pub recipe: Recipe,
    pub outputs: Vec<OutTensor>,
}

/// The whole extraction, from headers only.
#[derive(Debug, Default)]
pub struct ExtractPlan {
    pub rank: usize,
    pub items: Vec<Item>,
    /// Last name components of the decomposed modules, sorted (PEFT's `target_modules`).
    pub target_modules: Vec<String>,
    /// In the order they were added, as mergekit lists them.
    pub modules_to_save: Vec<String>,
    /// Notes for the user: tensors left out, fallbacks taken.
    pub notes: Vec<String>,
}

const PREFIX: &str = "base_model.model.";

/// Last name components of input embeddings (`nn.Embedding`).
fn is_input_embedding(leaf: &str) -> bool {
    matches!(
        leaf,
        "embed_tokens" | "wte" | "wpe" | "word_embeddings" | "tok_embeddings" | "embed_in"
    ) || (leaf.contains("embed") && !is_output_embedding(leaf))
}

/// Last name components of output embeddings (`lm_head`, a Linear).
fn is_output_embedding(leaf: &str) -> bool {
    matches!(leaf, "lm_head" | "embed_out" | "output")
}

fn leaf(module: &str) -> &str {
    module.rsplit('.').next().unwrap_or(module)
}

/// The fine-tuned model's modules: module name → (weight, bias), sorted by name.
fn modules(model: &Checkpoint, notes: &mut Vec<String>) -> BTreeMap<String, [Option<usize>; 2]> {
    let mut out: BTreeMap<String, [Option<usize>; 2]> = BTreeMap::new();
    for (i, t) in model.tensors[..model.base_count].iter().enumerate() {
        let name = t.name();
        if let Some(m) = name.strip_suffix(".weight") {
            out.entry(m.to_string()).or_default()[0] = Some(i);
        } else if let Some(m) = name.strip_suffix(".bias") {
            out.entry(m.to_string()).or_default()[1] = Some(i);
        } else {
            notes.push(format!(
                "`{name}` is not a module's weight or bias: left out (as mergekit does)"
            ));
        }
    }
    out.retain(|m, [w, _]| {
        if w.is_none() {
            notes.push(format!("`{m}.bias` has no weight beside it: left out"));
        }
        w.is_some()
    });
    out
}

/// The base tensor matching fine-tuned `t`, with the same shape, or an error naming it.
fn base_match<'a>(
    base: &'a Checkpoint,
    model: &Checkpoint,
    t: &TensorRef,
) -> Result<&'a TensorRef> {
    let name = t.name();
    let b = base.get(name).ok_or_else(|| Error::InvalidTensor {
        path: base.input.clone(),
        tensor: name.into(),
        msg: "missing from the base model (the fine-tuned model has it)".into(),
    })?;
    if b.info.shape != t.info.shape {
        return Err(Error::InvalidTensor {
            path: base.input.clone(),
            tensor: name.into(),
            msg: format!(
                "shape {:?} in the base but {:?} in the fine-tuned model",
                b.info.shape, t.info.shape
            ),
        });
    }
    for (ckpt, r) in [(base, b), (model, t)] {
        if !is_float(r.info.dtype) {
            return Err(Error::InvalidTensor {
                path: ckpt.input.clone(),
                tensor: name.into(),
                msg: format!(
                    "dtype {} cannot be decomposed: extract-lora reads F16, BF16, F32 and F64 (dequantise first)",
                    r.info.dtype
                ),
            });
        }
    }
    Ok(b)
}

fn is_float(d: DType) -> bool {
    matches!(d, DType::F16 | DType::BF16 | DType::F32 | DType::F64)
}

impl ExtractPlan {
    /// Plans the extraction from the two checkpoints' headers; every refusal (missing tensor,
    /// shape mismatch, rank above a weight's smaller side, non-float dtype) happens here.
    pub fn build(base: &Checkpoint, model: &Checkpoint, o: &ExtractOptions) -> Result<Self> {
        if o.rank == 0 {
            return Err(Error::Usage("-r/--rank must be at least 1".into()));
        }
        let mut plan = ExtractPlan {
            rank: o.rank,
            modules_to_save: Vec::new(),
            ..Default::default()
        };
        let mods = modules(model, &mut plan.notes);
        let embed_lora = o.embed_lora && plan.vocab_matches(base, model, &mods);
        for s in &o.save_modules {
            if !plan.modules_to_save.contains(s) {
                plan.modules_to_save.push(s.clone());
            }
        }
        let mut targets = Vec::new();
        for (m, [w, bias]) in &mods {
            let w = &model.tensors[w.expect("kept modules have weights")];
            let bias = bias.map(|b| &model.tensors[b]);
            let key = leaf(m);
            let excluded = o.modules.excludes(m);
            let embedding = is_input_embedding(key) || is_output_embedding(key);
            if !embed_lora && embedding && !excluded {
                plan.save_key(key);
            }
            let included = o.modules.includes(m);
            if plan.modules_to_save.iter().any(|s| s == m || s == key) {
                plan.save(w, bias);
            } else if included && !excluded {
                if w.info.shape.len() == 2 {
                    let transpose = is_input_embedding(key);
                    plan.decompose((base, model), w, bias, transpose, o)?;
                    targets.push(key.to_string());
                } else if !o.skip_undecomposable {
                    plan.save_key(key);
                    plan.save(w, bias);
                } else {
                    plan.notes.push(format!(
                        "`{m}` ({}-D) cannot be decomposed: skipped (--skip-undecomposable)",
                        w.info.shape.len()
                    ));
                }
            }
        }
        if plan.items.is_empty() {
            return Err(Error::NoModel {
                path: model.input.clone(),
                msg: "no tensor to extract: every module was excluded".into(),
            });
        }
        targets.sort();
        targets.dedup();
        plan.target_modules = targets;
        Ok(plan)
    }

    /// mergekit turns `--embed-lora` off when the vocabularies differ (the embeddings are then
    /// saved whole): whether they match.
    fn vocab_matches(
        &mut self,
        base: &Checkpoint,
        model: &Checkpoint,
        mods: &BTreeMap<String, [Option<usize>; 2]>,
    ) -> bool {
        for (m, [w, _]) in mods {
            let t = &model.tensors[w.expect("kept modules have weights")];
            let key = leaf(m);
            if !(is_input_embedding(key) || is_output_embedding(key)) {
                continue;
            }
            let differs = base
                .get(t.name())
                .is_some_and(|b| b.info.shape != t.info.shape);
            if differs {
                self.notes.push(format!(
                    "`{}`: the vocabularies differ, so embeddings are saved whole in modules_to_save (--embed-lora off, as mergekit does)",
                    t.name()
                ));
                return false;
            }
        }
        true
    }

    fn save_key(&mut self, key: &str) {
        if !self.modules_to_save.iter().any(|s| s == key) {
            self.modules_to_save.push(key.to_string());
        }
    }

    fn save(&mut self, w: &TensorRef, bias: Option<&TensorRef>) {
        for t in std::iter::once(w).chain(bias) {
            self.items.push(Item {
                recipe: Recipe::Save {
                    tensor: t.name().into(),
                },
                outputs: vec![OutTensor {
                    name: format!("{PREFIX}{}", t.name()),
                    dtype: t.info.dtype,
                    shape: t.info.shape.clone(),
                }],
            });
        }
    }

    fn decompose(
        &mut self,
        (base, model): (&Checkpoint, &Checkpoint),
        w: &TensorRef,
        bias: Option<&TensorRef>,
        transpose: bool,
        o: &ExtractOptions,
    ) -> Result<()> {
        base_match(base, model, w)?;
        let (mut rows, mut cols) = (w.info.shape[0], w.info.shape[1]);
        if transpose {
            std::mem::swap(&mut rows, &mut cols);
        }
        let r = o.rank as u64;
        if r > rows.min(cols) {
            return Err(Error::InvalidTensor {
                path: model.input.clone(),
                tensor: w.name().into(),
                msg: format!(
                    "rank {r} is larger than this weight allows: its shape {:?} has rank at most {}; pass -r {} or less, or leave it out with --exclude-regex",
                    w.info.shape,
                    rows.min(cols),
                    rows.min(cols)
                ),
            });
        }
        let dtype = o.dtype.unwrap_or(w.info.dtype);
        let m = w.name().strip_suffix(".weight").unwrap_or(w.name());
        let (a, b) = if transpose {
            ("lora_embedding_A", "lora_embedding_B")
        } else {
            ("lora_A.weight", "lora_B.weight")
        };
        let out = |name: &str, shape: Vec<u64>| OutTensor {
            name: format!("{PREFIX}{m}.{name}"),
            dtype,
            shape,
        };
        self.items.push(Item {
            recipe: Recipe::Decompose {
                tensor: w.name().into(),
                transpose,
            },
            outputs: vec![out(a, vec![r, cols]), out(b, vec![rows, r])],
        });
        if let Some(bias) = bias {
            base_match(base, model, bias)?;
            self.items.push(Item {
                recipe: Recipe::Difference {
                    tensor: bias.name().into(),
                },
                outputs: vec![out("lora_B.bias", bias.info.shape.clone())],
            });
        }
        Ok(())
    }

    /// Whether any decomposed module has a bias change (PEFT's `lora_bias`).
    pub fn has_lora_bias(&self) -> bool {
        self.items
            .iter()
            .any(|i| matches!(i.recipe, Recipe::Difference { .. }))
    }
}

/// Reads a float tensor whole as f64 (exact for F16/BF16/F32/F64).
pub fn read_f64(ckpt: &Checkpoint, t: &TensorRef) -> Result<Vec<f64>> {
    let n = t.info.nbytes() as usize;
    let mut bytes = vec![0u8; n];
    ckpt.read_tensor_at(t, 0, &mut bytes)?;
    let size = (t.info.dtype.bits() / 8) as usize;
    let mut out = Vec::with_capacity(n / size);
    // Widened a block at a time: no second whole-tensor copy.
    let mut wide = vec![0u8; WIDEN_BLOCK_ELEMENTS * 8];
    for block in bytes.chunks(WIDEN_BLOCK_ELEMENTS * size) {
        let wide = &mut wide[..block.len() / size * 8];
        crate::ops::cast::cast_slice(t.info.dtype, DType::F64, block, wide);
        out.extend(
            wide.chunks_exact(8)
                .map(|c| f64::from_le_bytes(c.try_into().expect("8 bytes"))),
        );
    }
    Ok(out)
}

/// Elements widened to f64 at a time by [`read_f64`].
const WIDEN_BLOCK_ELEMENTS: usize = 1 << 16;

/// f64 values as `dtype` bytes, rounded once.
pub fn encode(values: &[f64], dtype: DType) -> Vec<u8> {
    let wide: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
    let mut out = vec![0u8; values.len() * (dtype.bits() / 8) as usize];
    crate::ops::cast::cast_slice(DType::F64, dtype, &wide, &mut out);
    out
}

/// The two factors of one decomposition, row-major f64: `a` `[r, cols]`, `b` `[rows, r]`,
/// and the Eckart–Young error `√(Σ_{i>r} σᵢ²)` of the rank-r truncation.
#[derive(Debug)]
pub struct Factors {
    pub a: Vec<f64>,
    pub b: Vec<f64>,
    pub optimal_error: f64,
}

/// Truncated SVD of the row-major `[rows, cols]` matrix `delta` (transposed first when
/// `transpose`), split into LoRA factors. `name` is for the error message.
pub fn decompose(
    delta: Vec<f64>,
    (rows, cols): (usize, usize),
    transpose: bool,
    rank: usize,
    distribute_scale: bool,
    name: &str,
) -> Result<Factors> {
    let d = if transpose {
        Mat::from_fn(cols, rows, |i, j| delta[j * cols + i])
    } else {
        Mat::from_fn(rows, cols, |i, j| delta[i * cols + j])
    };
    drop(delta);
    let (m, n) = (d.nrows(), d.ncols());
    let k = m.min(n);
    let mut u = Mat::<f64>::zeros(m, k);
    let mut v = Mat::<f64>::zeros(n, k);
    let mut s = faer::diag::Diag::<f64>::zeros(k);
    let par = Par::Seq;
    let scratch = svd::svd_scratch::<f64>(
        m,
        n,
        ComputeSvdVectors::Thin,
        ComputeSvdVectors::Thin,
        par,
        Default::default(),
    );
    let mut mem = faer::dyn_stack::MemBuffer::new(scratch);
    svd::svd(
        d.as_ref(),
        s.as_mut(),
        Some(u.as_mut()),
        Some(v.as_mut()),
        par,
        faer::dyn_stack::MemStack::new(&mut mem),
        Default::default(),
    )
    .map_err(|e| Error::Other(format!("tensor `{name}`: the SVD did not converge ({e:?})")))?;
    let sv: Vec<f64> = (0..k).map(|i| s.column_vector()[i]).collect();
    let optimal_error = sv[rank..].iter().map(|x| x * x).sum::<f64>().sqrt();
    let (scale_a, scale_b): (Vec<f64>, Vec<f64>) = sv[..rank]
        .iter()
        .map(|&x| {
            let x = x.max(0.0);
            if distribute_scale {
                (x.sqrt(), x.sqrt())
            } else {
                (x, 1.0)
            }
        })
        .unzip();
    let mut a = vec![0f64; rank * n];
    for (i, row) in a.chunks_exact_mut(n).enumerate() {
        for (j, x) in row.iter_mut().enumerate() {
            *x = scale_a[i] * v[(j, i)];
        }
    }
    let mut b = vec![0f64; m * rank];
    for (i, row) in b.chunks_exact_mut(rank).enumerate() {
        for (j, x) in row.iter_mut().enumerate() {
            *x = u[(i, j)] * scale_b[j];
        }
    }
    Ok(Factors {
        a,
        b,
        optimal_error,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A rank-2 matrix plus a small diagonal: the truncation error is exactly the discarded
    /// singular values', and B·A gives back the rank-2 part.
    #[test]
    fn factors_reconstruct_the_best_rank_r_approximation() {
        let (rows, cols) = (5usize, 4usize);
        let mut delta = vec![0f64; rows * cols];
        for i in 0..rows {
            for j in 0..cols {
                delta[i * cols + j] =
                    (i as f64 + 1.0) * (j as f64 - 1.5) + 0.5 * ((i * j) % 3) as f64;
            }
        }
        for transpose in [false, true] {
            for distribute in [true, false] {
                let f =
                    decompose(delta.clone(), (rows, cols), transpose, 2, distribute, "t").unwrap();
                let (m, n) = if transpose {
                    (cols, rows)
                } else {
                    (rows, cols)
                };
                let mut err = 0f64;
                for i in 0..m {
                    for j in 0..n {
                        let approx: f64 = (0..2).map(|k| f.b[i * 2 + k] * f.a[k * n + j]).sum();
                        let exact = if transpose {
                            delta[j * cols + i]
                        } else {
                            delta[i * cols + j]
                        };
                        err += (approx - exact).powi(2);
                    }
                }
                let err = err.sqrt();
                assert!(
                    (err - f.optimal_error).abs() <= 1e-12 * (1.0 + f.optimal_error),
                    "{err} vs {}",
                    f.optimal_error
                );
            }
        }
    }
}
