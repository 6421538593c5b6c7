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
use super::sparsify::{compensated_sum, rank_range, Survivors};
use super::{ModelTensor, Params};

/// The parameters mergekit accepts for `sce`: all global (it has no per-model ones).
pub const SCE_PARAMETERS: &[&str] = &["int8_mask", "select_topk"];

/// SCE as above. Deterministic (`seed` unused).
pub fn sce(
    base: &[f32],
    models: &[ModelTensor],
    global: &Params,
    shape: &[usize],
    _seed: u64,
    out: &mut [f32],
) -> Result<(), String> {
    check_inputs(base, models, shape, out)?;
    let select_topk = finite(global, "select_topk", 1.0)?;
    if models.is_empty() {
        out.copy_from_slice(base);
        return Ok(());
    }
    let tv = |i: usize, j: usize| f64::from(models[i].values[j]) - f64::from(base[j]);
    let selected = select(base.len(), models.len(), select_topk, &tv);
    let tv = |i: usize, j: usize| if selected.kept(j) { tv(i, j) } else { 0.0 };
    let weights = calculate(base.len(), models.len(), &tv);
    let mut terms = vec![0f64; models.len()];
    for (j, slot) in out.iter_mut().enumerate() {
        for (i, term) in terms.iter_mut().enumerate() {
            *term = tv(i, j);
        }
        let positive = terms.iter().sum::<f64>() >= 0.0;
        let (mut merged, mut divisor) = (0.0, 0.0);
        for (term, weight) in terms.iter().zip(&weights) {
            if *term != 0.0 && (*term > 0.0) == positive {
                merged += term * weight;
                divisor += weight;
            }
        }
        *slot = (f64::from(base[j]) + merged / divisor.max(1e-6)) as f32;
    }
    Ok(())
}

/// mergekit's `sce_mask`: the elements with the largest variance across models.
fn select(len: usize, count: usize, density: f64, tv: &impl Fn(usize, usize) -> f64) -> Survivors {
    if density >= 1.0 {
        return Survivors::all();
    }
    let variance = |j: usize| {
        let mean = (0..count).map(|i| tv(i, j)).sum::<f64>() / count as f64;
        (0..count).map(|i| (tv(i, j) - mean).powi(2)).sum::<f64>() / count as f64
    };
    let nonzero = if density <= 0.0 {
        0
    } else {
        (0..len).filter(|&j| variance(j) != 0.0).count()
    };
    let k = (nonzero as f64 * density).trunc() as usize;
    rank_range(len, variance, len - k, len)
}

/// mergekit's `sce_weight`: each model's mean square, normalised to sum to 1.
fn calculate(len: usize, count: usize, tv: &impl Fn(usize, usize) -> f64) -> Vec<f64> {
    let squares: Vec<f64> = (0..count)
        .map(|i| compensated_sum((0..len).map(|j| tv(i, j).powi(2))) / len as f64)
        .collect();
    let total: f64 = squares.iter().sum();
    if total.abs() < 1e-6 {
        vec![1.0 / count as f64; count]
    } else {
        squares.iter().map(|s| s / total).collect()
    }
}

#[cfg(test)]
mod tests {
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
        sce(base, &tensors, global, &[base.len()], 0, &mut out)?;
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
