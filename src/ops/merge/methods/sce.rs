//! SCE (select, calculate, erase; mergekit 0.1.5's `mergekit/merge_methods/sce.py`).
//!
//! 1. **Select**: with `select_topk` (global, default 1) below 1, only the elements whose task
//!    vectors vary most across models survive: the `⌊select_topk · m⌋` largest population
//!    variances, `m` the count of non-zero ones (none when `select_topk ≤ 0`).
//! 2. **Calculate**: model `i`'s weight is the mean square of its selected task vector over the
//!    tensor, divided by the sum over models (equal weights when that sum is below `1e-6`).
//! 3. **Erase**: each element elects the sign of the sum of the task vectors (`≥ 0` elects
//!    `+`); terms of the other sign or zero are dropped, and the kept terms' weighted sum is
//!    divided by their weights' sum (at least `1e-6`). The result is `base` plus that.
//!
//! mergekit computes in the input dtype; here every step is in `f64` (compensated sums for the
//! whole-tensor statistics) and rounded once to `f32`. Variance ties at the selection
//! threshold follow [`super::sparsify`]'s order (equal variances: the later element ranks
//! higher and is kept first). `int8_mask` never changes a value and is accepted and ignored.
//! Inputs holding NaN or infinity are refused, as in [`super::sparse`].

use super::sparse::{check_inputs, finite};
use super::sparsify::{rank_key, rank_range, Compensated, CutPass, RadixCut, Survivors};
use super::survey::{check_finite, Blend, BlendKind, Chunk, Setting, Survey};
use super::Inputs;

/// The parameters mergekit accepts for `sce`: all global (it has no per-model ones).
pub const SCE_PARAMETERS: &[&str] = &["int8_mask", "select_topk"];

/// SCE as above. Deterministic (`seed` unused).
pub fn sce(t: &Inputs, out: &mut [f32]) -> Result<(), String> {
    let (base, models) = (t.base, t.models);
    check_inputs(t, out)?;
    let select_topk = finite(t.global, "select_topk", 1.0)?;
    if models.is_empty() {
        out.copy_from_slice(base);
        return Ok(());
    }
    let values: Vec<&[f32]> = models.iter().map(|m| m.values).collect();
    let tv = |i: usize, j: usize| f64::from(values[i][j]) - f64::from(base[j]);
    let selected = select(base.len(), models.len(), select_topk, &tv);
    let masked = |i: usize, j: usize| if selected.kept(j) { tv(i, j) } else { 0.0 };
    let mut squares = vec![Compensated::default(); models.len()];
    add_squares(&mut squares, base.len(), &masked);
    erase(
        base,
        &values,
        &selected,
        &weights(&squares, base.len()),
        out,
    );
    Ok(())
}

/// The elements of the task vectors `models[i] − base` that `selected` keeps, elected and
/// weighted into `out`.
fn erase(base: &[f32], models: &[&[f32]], selected: &Survivors, weights: &[f64], out: &mut [f32]) {
    let mut terms = vec![0f64; models.len()];
    for (j, slot) in out.iter_mut().enumerate() {
        for (i, term) in terms.iter_mut().enumerate() {
            *term = if selected.kept(j) {
                f64::from(models[i][j]) - f64::from(base[j])
            } else {
                0.0
            };
        }
        let positive = terms.iter().sum::<f64>() >= 0.0;
        let (mut merged, mut divisor) = (0.0, 0.0);
        for (term, weight) in terms.iter().zip(weights) {
            if *term != 0.0 && (*term > 0.0) == positive {
                merged += term * weight;
                divisor += weight;
            }
        }
        *slot = (f64::from(base[j]) + merged / divisor.max(1e-6)) as f32;
    }
}

/// The population variance across models of element `j`'s task vectors.
fn variance(count: usize, tv: &impl Fn(usize, usize) -> f64, j: usize) -> f64 {
    let mean = (0..count).map(|i| tv(i, j)).sum::<f64>() / count as f64;
    (0..count).map(|i| (tv(i, j) - mean).powi(2)).sum::<f64>() / count as f64
}

/// mergekit's `sce_mask`: the elements with the largest variance across models.
fn select(len: usize, count: usize, density: f64, tv: &impl Fn(usize, usize) -> f64) -> Survivors {
    if density >= 1.0 {
        return Survivors::all();
    }
    let nonzero = if density <= 0.0 {
        0
    } else {
        (0..len).filter(|&j| variance(count, tv, j) != 0.0).count()
    };
    let k = selected_count(nonzero, density);
    rank_range(len, |j| variance(count, tv, j), len - k, len)
}

/// How many of the `nonzero` non-zero variances `select_topk` selects.
fn selected_count(nonzero: usize, density: f64) -> usize {
    (nonzero as f64 * density).trunc() as usize
}

/// Adds each model's squares of `tv` over `0..len` to its running sum.
fn add_squares(squares: &mut [Compensated], len: usize, tv: &impl Fn(usize, usize) -> f64) {
    for (i, sum) in squares.iter_mut().enumerate() {
        (0..len).for_each(|j| sum.add(tv(i, j).powi(2)));
    }
}

/// mergekit's `sce_weight`: each model's mean square over the tensor's `len` elements,
/// normalised to sum to 1.
fn weights(squares: &[Compensated], len: usize) -> Vec<f64> {
    let count = squares.len();
    let squares: Vec<f64> = squares.iter().map(|s| s.value() / len as f64).collect();
    let total: f64 = squares.iter().sum();
    if total.abs() < 1e-6 {
        vec![1.0 / count as f64; count]
    } else {
        squares.iter().map(|s| s / total).collect()
    }
}

/// SCE a chunk at a time: a pass counts the non-zero variances while a `RadixCut` ranks them,
/// two more find the selection's cut, one sums each model's squares; chunks then erase.
#[derive(Debug)]
pub struct SceSurvey {
    len: usize,
    models: usize,
    density: f64,
    nonzero: usize,
    /// The selection: every element ranking at or above the cut (`None`: all elements).
    cut: Option<RadixCut>,
    squares: Vec<Compensated>,
    weights: Vec<f64>,
    stages: Vec<Option<CutPass>>,
}

/// The [`Survey`] of one sce tensor.
pub fn survey(s: &Setting) -> Result<Box<dyn Survey>, String> {
    let density = finite(s.global, "select_topk", 1.0)?;
    let len: usize = s.shape.iter().product();
    // Below 0 nothing is selected: a cut past the last rank keeps nothing.
    let cut = (density < 1.0).then(|| RadixCut::new(if density <= 0.0 { len } else { 0 }, len));
    let mut stages = Vec::new();
    if cut.as_ref().is_some_and(RadixCut::searching) {
        stages.extend([CutPass::High, CutPass::Low, CutPass::Ties].map(Some));
    }
    stages.push(None);
    Ok(Box::new(SceSurvey {
        len,
        models: s.models.len(),
        density,
        nonzero: 0,
        cut,
        squares: vec![Compensated::default(); s.models.len()],
        weights: vec![],
        stages,
    }))
}

impl SceSurvey {
    /// Which elements of a chunk from `start` are selected.
    fn selected(&self, start: usize, base: &[f32], models: &[&[f32]]) -> Survivors {
        let Some(cut) = &self.cut else {
            return Survivors::all();
        };
        let tv = |i: usize, j: usize| f64::from(models[i][j]) - f64::from(base[j]);
        Survivors::from_predicate(base.len(), |j| {
            !cut.below(rank_key(variance(models.len(), &tv, j)), start + j)
        })
    }
}

impl Survey for SceSurvey {
    fn passes(&self) -> usize {
        if self.models == 0 {
            0
        } else {
            self.stages.len()
        }
    }

    fn observe(&mut self, pass: usize, chunk: &Chunk) -> Result<(), String> {
        let (start, base, models) = (chunk.start, chunk.base, chunk.models);
        if pass == 0 {
            check_finite(start, base, models)?;
        }
        let tv = |i: usize, j: usize| f64::from(models[i][j]) - f64::from(base[j]);
        match (self.stages[pass], &mut self.cut) {
            (Some(stage), Some(cut)) => {
                for j in 0..base.len() {
                    let v = variance(models.len(), &tv, j);
                    if stage == CutPass::High && v != 0.0 {
                        self.nonzero += 1;
                    }
                    cut.see(stage, rank_key(v), start + j);
                }
            }
            _ => {
                let selected = self.selected(start, base, models);
                let masked = |i: usize, j: usize| if selected.kept(j) { tv(i, j) } else { 0.0 };
                add_squares(&mut self.squares, base.len(), &masked);
            }
        }
        Ok(())
    }

    fn end_pass(&mut self, pass: usize) -> Result<(), String> {
        match (self.stages[pass], &mut self.cut) {
            (Some(stage), Some(cut)) => {
                if stage == CutPass::High {
                    let k = selected_count(self.nonzero, self.density);
                    cut.set_rank(self.len - k, self.len);
                }
                cut.end(stage);
            }
            _ => self.weights = weights(&self.squares, self.len),
        }
        Ok(())
    }

    /// Without models the base is copied (and checked), on the CPU.
    fn blend(&self) -> Option<Blend> {
        if self.models == 0 {
            return None;
        }
        let (key, limit) = self.cut.as_ref().map_or((0, 0), RadixCut::cut);
        let selects = f64::from(u8::from(self.cut.is_some()));
        let cut = [selects, f64::from(key), limit.min(1 << 53) as f64];
        Some(Blend::of(BlendKind::Sce, &cut, &self.weights))
    }

    fn merge(&self, chunk: &Chunk, out: &mut [f32]) -> Result<(), String> {
        let (start, base, models) = (chunk.start, chunk.base, chunk.models);
        if models.is_empty() {
            out.copy_from_slice(base);
            return check_finite(start, base, models);
        }
        let selected = self.selected(start, base, models);
        erase(base, models, &selected, &self.weights, out);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::super::{ModelTensor, Params};
    use super::*;

    fn merge(base: &[f32], models: &[&[f32]], global: &Params) -> Result<Vec<f32>, String> {
        let none = Params::default();
        let tensors: Vec<ModelTensor> = models
            .iter()
            .map(|values| ModelTensor {
                values,
                params: &none,
            })
            .collect();
        let mut out = vec![f32::NAN; base.len()];
        sce(
            &Inputs::new(base, &tensors, global, &[base.len()]),
            &mut out,
        )?;
        Ok(out)
    }

    #[test]
    fn weights_are_mean_squares_and_the_erased_sign_drops_out() {
        // Task vectors (1, -1) and (3, 1): mean squares 1 and 5, weights 1/6 and 5/6.
        // Element 0 agrees: (1/6 + 15/6) / 1; element 1 ties at 0, elects +: only model 1.
        let out = merge(
            &[0.0, 0.0],
            &[&[1.0, -1.0], &[3.0, 1.0]],
            &Params::default(),
        );
        assert_eq!(out.unwrap(), [(16.0f64 / 6.0) as f32, 1.0]);
    }

    #[test]
    fn select_topk_keeps_the_largest_nonzero_variances() {
        // Variances 1, 0, 1/16, 0: two non-zero, ⌊2 · 0.5⌋ = 1 kept (element 0).
        let models: [&[f32]; 2] = [&[1.0, 0.0, 0.0, 2.0], &[-1.0, 0.0, 0.5, 2.0]];
        let half = Params::default().with("select_topk", 0.5);
        assert_eq!(
            merge(&[0.0; 4], &models, &half).unwrap(),
            [1.0, 0.0, 0.0, 0.0]
        );
        let zero = Params::default().with("select_topk", 0.0);
        assert_eq!(merge(&[0.5; 4], &models, &zero).unwrap(), [0.5; 4]);
    }

    #[test]
    fn tiny_task_vectors_get_equal_weights_as_in_mergekit() {
        // Mean squares 1e-8 and 4e-8 sum below 1e-6: weights 1/2 each, not 1/5 and 4/5.
        let out = merge(&[0.0], &[&[1e-4], &[2e-4]], &Params::default()).unwrap();
        assert_eq!(out, [((1e-4f32 as f64 + 2e-4f32 as f64) / 2.0) as f32]);
    }

    #[test]
    fn no_models_or_unchanged_models_give_the_base_and_nan_is_refused() {
        assert_eq!(
            merge(&[1.0, 2.0], &[], &Params::default()).unwrap(),
            [1.0, 2.0]
        );
        assert_eq!(
            merge(&[1.0, 2.0], &[&[1.0, 2.0]], &Params::default()).unwrap(),
            [1.0, 2.0]
        );
        let err = merge(&[1.0, f32::INFINITY], &[&[1.0, 2.0]], &Params::default()).unwrap_err();
        assert_eq!(err, "base has a non-finite value (inf) at element 1");
    }
}
