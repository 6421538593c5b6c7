//! mergekit 0.1.5's generalized task arithmetic with sparsification and sign consensus
//! (`mergekit/merge_methods/generalized_task_arithmetic.py`): ties, breadcrumbs,
//! breadcrumbs_ties, dare_linear, dare_ties, della and della_linear.
//!
//! For each model `i` (config order, base excluded) the task vector `δᵢ = modelᵢ - base` is
//! sparsified ([`super::sparsify`]), optionally rescaled to keep its L1 norm (`rescale`), and
//! multiplied by its `weight` `wᵢ`. With sign consensus (the `*_ties` methods, `ties`, `della`)
//! each element elects the sign of `Σ wᵢδᵢ` (`≥ 0` elects `+`) and keeps only the terms of that
//! sign (zeros never agree), dividing by the kept weights `Σ wᵢ` (1 when that sum is 0);
//! without, it sums every term and divides by `Σ wᵢ` over all models (1 when below `1e-8` in
//! magnitude). The division happens only with `normalize`; the sum is then multiplied by
//! `lambda`, and the result is `base + λ·merged`.
//!
//! mergekit computes all of this in the input dtype (bf16 deltas, bf16 weights, bf16 sums);
//! here every step is in `f64` in model order and rounded once to `f32`, so each element is
//! the formula's value correctly rounded to `f32` (up to the ranking's tie order and the
//! compensated L1 sums). A bf16 output is then a second rounding (f64 → f32 → bf16): a value
//! just off a bf16 midpoint can land one ulp from the once-rounded result (3 of the 3,664 bf16
//! elements of the mergekit fixtures; mergekit agrees with us on each). `int8_mask` only changes the dtype of mergekit's mask, never a value:
//! it is accepted and has no effect. Inputs holding NaN or infinity are refused: a magnitude
//! ranking, a sign election or an L1 norm has no meaningful answer with them (mergekit would
//! spread one NaN over the whole tensor once `rescale` sums it).

use super::sparsify::{survivors, Sparsification, Sparsify, Survivors, TaskVector};
use super::survey::finite_values;
use super::{Inputs, Params};

/// How one of mergekit's generalized task arithmetic methods is configured
/// (`mergekit/merge_methods/registry.py`).
#[derive(Clone, Copy, Debug)]
pub struct Generalized {
    pub name: &'static str,
    pub sparsification: Sparsification,
    /// Sign consensus by sum (mergekit's `ConsensusMethod.sum`).
    pub consensus: bool,
    pub default_normalize: bool,
    pub default_rescale: bool,
}

impl Generalized {
    /// The parameters mergekit accepts for this method: global, then per model.
    pub fn parameters(&self) -> (&'static [&'static str], &'static [&'static str]) {
        let global: &[&str] = &["int8_mask", "normalize", "rescale", "lambda"];
        let per_model: &[&str] = match self.sparsification {
            Sparsification::MagnitudeOutliers => &["weight", "density", "gamma"],
            Sparsification::DellaMagprune => &["weight", "density", "epsilon"],
            _ => &["weight", "density"],
        };
        (global, per_model)
    }
}

const fn method(
    name: &'static str,
    sparsification: Sparsification,
    consensus: bool,
    default_normalize: bool,
    default_rescale: bool,
) -> Generalized {
    Generalized {
        name,
        sparsification,
        consensus,
        default_normalize,
        default_rescale,
    }
}

use Sparsification::{DellaMagprune, MagnitudeOutliers, Random};

/// TIES: magnitude pruning to `density` (default 1), sign consensus by sum; `normalize`
/// defaults to true, `rescale` to false. Deterministic (the seed is unused).
pub const TIES: Generalized = method("ties", Sparsification::Magnitude, true, true, false);
/// Model breadcrumbs: drop the `gamma` (default 0.01) fraction of largest magnitudes and keep
/// the next `density` (default 1) fraction; no consensus; `normalize` and `rescale` default to
/// false. Deterministic.
pub const BREADCRUMBS: Generalized = method("breadcrumbs", MagnitudeOutliers, false, false, false);
/// Breadcrumbs' pruning with sign consensus by sum; `normalize` and `rescale` default to
/// false. Deterministic.
pub const BREADCRUMBS_TIES: Generalized =
    method("breadcrumbs_ties", MagnitudeOutliers, true, false, false);
/// DARE: keep each element with probability `density` (default 1), drawn from
/// `uniform(seed, model, element)`; no consensus; `rescale` (default true) restores each task
/// vector's L1 norm, as mergekit does (not a 1/density factor); `normalize` defaults to false.
pub const DARE_LINEAR: Generalized = method("dare_linear", Random, false, false, true);
/// DARE's random pruning with sign consensus by sum; `rescale` defaults to true, `normalize`
/// to false.
pub const DARE_TIES: Generalized = method("dare_ties", Random, true, false, true);
/// DELLA: keep each element with a probability from `density - epsilon` (smallest magnitude
/// of its row) to `density + epsilon` (largest), `epsilon` defaulting to 0.15 and both ends
/// required inside (0, 1); sign consensus by sum; `normalize` and `rescale` default to true.
pub const DELLA: Generalized = method("della", DellaMagprune, true, true, true);
/// DELLA's pruning without consensus; `rescale` defaults to true, `normalize` to false.
pub const DELLA_LINEAR: Generalized = method("della_linear", DellaMagprune, false, false, true);

/// The family, each method by its index: the `K` of [`whole`] and
/// [`super::sparse_stream::survey`].
pub const FAMILY: [Generalized; 7] = [
    TIES,
    BREADCRUMBS,
    BREADCRUMBS_TIES,
    DARE_LINEAR,
    DARE_TIES,
    DELLA,
    DELLA_LINEAR,
];

/// Method `FAMILY[K]` on one whole tensor, as the engine calls every method.
pub fn whole<const K: usize>(t: &Inputs, out: &mut [f32]) -> Result<(), String> {
    generalized(&FAMILY[K], t, out)
}

/// Any of the methods above, by its configuration.
pub fn generalized(how: &Generalized, t: &Inputs, out: &mut [f32]) -> Result<(), String> {
    let (base, models, shape, seed) = (t.base, t.models, t.shape, t.seed);
    check_inputs(t, out)?;
    let setup = Setup::new(how, models.iter().map(|m| m.params), t.global)?;
    let mut kept = Vec::with_capacity(models.len());
    for (index, (model, sparsify)) in models.iter().zip(&setup.sparsify).enumerate() {
        let tv = TaskVector {
            model: model.values,
            base,
        };
        kept.push(
            survivors(tv, shape, sparsify, seed, index as u64)
                .map_err(|e| format!("models[{index}]: {e}"))?,
        );
    }
    let values: Vec<&[f32]> = models.iter().map(|m| m.values).collect();
    setup.combine(base, &values, &kept, out);
    Ok(())
}

/// A generalized method's parameters for one tensor, checked: what the per-element
/// combination needs besides the survivors.
#[derive(Clone, Debug)]
pub(crate) struct Setup {
    pub consensus: bool,
    pub normalize: bool,
    pub lambda: f64,
    pub weights: Vec<f64>,
    pub sparsify: Vec<Sparsify>,
}

impl Setup {
    /// Checks the shared parameters, then each model's in order (as mergekit would meet them).
    pub fn new<'a>(
        how: &Generalized,
        models: impl Iterator<Item = &'a Params>,
        global: &Params,
    ) -> Result<Setup, String> {
        let lambda = finite(global, "lambda", 1.0)?;
        let (mut weights, mut sparsify) = (Vec::new(), Vec::new());
        for (index, params) in models.enumerate() {
            let at = |e: String| format!("models[{index}]: {e}");
            let s = sparsify_params(how, params, global).map_err(at)?;
            weights.push(weight(params).map_err(at)?);
            s.check().map_err(at)?;
            sparsify.push(s);
        }
        Ok(Setup {
            consensus: how.consensus,
            normalize: global.flag("normalize", how.default_normalize),
            lambda,
            weights,
            sparsify,
        })
    }

    /// The per-element combination of the sparsified, weighted task vectors: `models[i][j]`
    /// against `base[j]`, element `j` of model `i` kept where `kept[i]` says (indices relative
    /// to these slices).
    ///
    /// Block by block, model by model, so each step is one loop over the block's elements that
    /// vectorises; each element still sees its terms in model order, and a term that is
    /// dropped or does not agree adds `+0.0`, which leaves a sum as it was (none of the sums
    /// below is ever `-0.0` once it has a term). The total of the terms starts from `-0.0`,
    /// as Rust's float sums do: it is the first term.
    pub fn combine(&self, base: &[f32], models: &[&[f32]], kept: &[Survivors], out: &mut [f32]) {
        crate::ops::simd::with_avx2(
            #[inline(always)]
            || self.combine_blocks(base, models, kept, out),
        )
    }

    #[inline(always)]
    fn combine_blocks(&self, base: &[f32], models: &[&[f32]], kept: &[Survivors], out: &mut [f32]) {
        const B: usize = 512;
        let total_weight: f64 = self.weights.iter().sum();
        let linear_divisor = if total_weight.abs() < 1e-8 {
            1.0
        } else {
            total_weight
        };
        let mut terms = vec![[0f64; B]; models.len()];
        let (mut total, mut merged, mut divisor) = ([0f64; B], [0f64; B], [0f64; B]);
        for at in (0..out.len()).step_by(B) {
            let n = B.min(out.len() - at);
            let base = &base[at..at + n];
            for (i, term) in terms.iter_mut().enumerate() {
                let (survivor, weight) = (&kept[i], self.weights[i]);
                for (k, (t, (&m, &b))) in term
                    .iter_mut()
                    .zip(models[i][at..].iter().zip(base))
                    .enumerate()
                {
                    let value = (f64::from(m) - f64::from(b)) * survivor.scale * weight;
                    *t = survivor.masked(at + k, value);
                }
            }
            total[..n].fill(-0.0);
            for term in &terms {
                total.iter_mut().zip(&term[..n]).for_each(|(s, &t)| *s += t);
            }
            if self.consensus {
                // mergekit's `get_mask(method="sum")`: the terms whose sign is that of their
                // total (`≥ 0` elects `+`; zero terms never agree), and their weights (1 when
                // none agrees).
                merged[..n].fill(0.0);
                divisor[..n].fill(0.0);
                for (term, &weight) in terms.iter().zip(&self.weights) {
                    let sums = merged.iter_mut().zip(divisor.iter_mut());
                    for ((m, d), (&t, &all)) in sums.zip(term[..n].iter().zip(&total[..n])) {
                        let agrees = (t != 0.0) & ((t > 0.0) == (all >= 0.0));
                        let mask = 0u64.wrapping_sub(u64::from(agrees));
                        *m += f64::from_bits(t.to_bits() & mask);
                        *d += f64::from_bits(weight.to_bits() & mask);
                    }
                }
            }
            for (k, (slot, &b)) in out[at..at + n].iter_mut().zip(base).enumerate() {
                let (mut x, d) = match self.consensus {
                    true if divisor[k] == 0.0 => (merged[k], 1.0),
                    true => (merged[k], divisor[k]),
                    false => (total[k], linear_divisor),
                };
                if self.normalize {
                    x /= d;
                }
                if self.lambda != 1.0 {
                    x *= self.lambda;
                }
                *slot = (f64::from(b) + x) as f32;
            }
        }
    }
}

fn sparsify_params(
    how: &Generalized,
    params: &Params,
    global: &Params,
) -> Result<Sparsify, String> {
    let density = finite(params, "density", 1.0)?;
    if density < 0.0 {
        return Err(format!("`density` must be at least 0, got {density}"));
    }
    let gamma = finite(params, "gamma", 0.01)?;
    if !(0.0..=1.0).contains(&gamma) {
        return Err(format!("`gamma` must be in [0, 1], got {gamma}"));
    }
    Ok(Sparsify {
        method: how.sparsification,
        density,
        gamma,
        epsilon: finite(params, "epsilon", 0.15)?,
        rescale: global.flag("rescale", how.default_rescale),
    })
}

/// The model's `weight`, which mergekit requires for these methods.
fn weight(params: &Params) -> Result<f64, String> {
    if !params.0.contains_key("weight") {
        return Err("missing `weight`".to_string());
    }
    finite(params, "weight", 0.0)
}

/// The parameter `name` (or `default`), refused when NaN or infinite.
pub(crate) fn finite(params: &Params, name: &str, default: f64) -> Result<f64, String> {
    let value = params.get(name, default);
    if value.is_finite() {
        Ok(value)
    } else {
        Err(format!("`{name}` must be a finite number, got {value}"))
    }
}

/// Lengths agree with `shape`, and no input holds NaN or infinity.
pub(crate) fn check_inputs(t: &Inputs, out: &[f32]) -> Result<(), String> {
    let shape = t.shape;
    let len = shape
        .iter()
        .try_fold(1usize, |n, &d| n.checked_mul(d))
        .ok_or_else(|| format!("shape {shape:?} overflows"))?;
    let inputs = std::iter::once(("base".to_string(), t.base)).chain(
        (t.models)
            .iter()
            .enumerate()
            .map(|(i, m)| (format!("models[{i}]"), m.values)),
    );
    for (name, values) in inputs {
        if values.len() != len {
            return Err(format!(
                "{name} has {} elements, shape {shape:?} needs {len}",
                values.len()
            ));
        }
        finite_values(&name, 0, values)?;
    }
    if out.len() != len {
        return Err(format!(
            "output has {} elements, shape {shape:?} needs {len}",
            out.len()
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::super::{uniform, ModelTensor};
    use super::*;

    fn merge(
        how: &Generalized,
        base: &[f32],
        models: &[(&[f32], Params)],
        global: &Params,
    ) -> Result<Vec<f32>, String> {
        let tensors: Vec<ModelTensor> = models
            .iter()
            .map(|(values, params)| ModelTensor { values, params })
            .collect();
        let mut out = vec![f32::NAN; base.len()];
        let shape = [base.len()];
        let t = Inputs {
            seed: 7,
            ..Inputs::new(base, &tensors, global, &shape)
        };
        generalized(how, &t, &mut out)?;
        Ok(out)
    }

    fn weighted(weight: f64, density: f64) -> Params {
        Params::default()
            .with("weight", weight)
            .with("density", density)
    }

    #[test]
    fn ties_elects_the_sign_of_the_weighted_sum_and_divides_by_the_agreeing_weights() {
        let base = [0.5f32, 0.5, 0.5];
        let a = [1.5f32, 2.5, -2.5];
        let b = [-1.5f32, 1.5, 1.5];
        let out = merge(
            &TIES,
            &base,
            &[(&a, weighted(1.0, 1.0)), (&b, weighted(1.0, 1.0))],
            &Params::default(),
        );
        // Deltas (1, 2, -3) and (-2, 1, 1): sums -1, 3, -2 elect -, +, -.
        assert_eq!(out.unwrap(), [0.5 - 2.0, 0.5 + 1.5, 0.5 - 3.0]);
        let unnormalized = Params::default().with("normalize", 0.0).with("lambda", 0.5);
        let out = merge(
            &TIES,
            &base,
            &[(&a, weighted(1.0, 1.0)), (&b, weighted(1.0, 1.0))],
            &unnormalized,
        );
        assert_eq!(out.unwrap(), [0.5 - 1.0, 0.5 + 1.5, 0.5 - 1.5]);
    }

    #[test]
    fn zero_weight_sums_divide_by_one() {
        let base = [1f32, 1.0];
        let a = [2f32, 3.0];
        let b = [0f32, 0.0];
        let opposite = [(&a[..], weighted(1.0, 1.0)), (&b[..], weighted(-1.0, 1.0))];
        let normalize = Params::default().with("normalize", 1.0);
        // Linear: Σw = 0 < 1e-8, so divisor 1: base + 1·(1, 2) - 1·(-1, -1).
        assert_eq!(
            merge(&BREADCRUMBS, &base, &opposite, &normalize).unwrap(),
            [3.0, 4.0]
        );
        // Consensus: both weighted terms are positive, their weights sum to 0, divisor 1.
        assert_eq!(
            merge(&BREADCRUMBS_TIES, &base, &opposite, &normalize).unwrap(),
            [3.0, 4.0]
        );
    }

    #[test]
    fn unchanged_models_and_density_zero_give_the_base() {
        let base: Vec<f32> = (0..50).map(|i| i as f32 * 0.25 - 3.0).collect();
        let model: Vec<f32> = base.iter().map(|v| v * 2.0 + 1.0).collect();
        for method in &FAMILY {
            // One model of `density`, merged into the base.
            let alone = |model: &[f32], density| {
                let models = [(model, weighted(0.7, density))];
                merge(method, &base, &models, &Params::default()).unwrap()
            };
            assert_eq!(alone(&base, 0.5), base, "unchanged");
            assert_eq!(alone(&model, 0.0), base, "nothing kept");
            assert_eq!(merge(method, &base, &[], &Params::default()).unwrap(), base);
        }
    }

    #[test]
    fn density_one_is_plain_weighted_task_arithmetic() {
        let base = [0.25f32, -1.0, 2.0];
        let model = [1.0f32, 1.0, 1.0];
        let models = [(&model[..], weighted(0.5, 1.0))];
        let expected = [0.25 + 0.375, -1.0 + 1.0, 2.0 - 0.5];
        for method in [&BREADCRUMBS, &DARE_LINEAR, &DELLA_LINEAR] {
            assert_eq!(
                merge(method, &base, &models, &Params::default()).unwrap(),
                expected
            );
        }
        // With normalize (ties' default), one model's weight divides itself out.
        assert_eq!(
            merge(&TIES, &base, &models, &Params::default()).unwrap(),
            [1.0; 3]
        );
    }

    #[test]
    fn dare_draws_depend_on_the_seed_only() {
        let base = vec![0f32; 4096];
        let model: Vec<f32> = (0..4096).map(|i| (i % 7) as f32 - 3.0).collect();
        let models = [(&model[..], weighted(1.0, 0.5))];
        let tensors: Vec<ModelTensor> = models
            .iter()
            .map(|(values, params)| ModelTensor { values, params })
            .collect();
        let run = |seed| {
            let mut out = vec![0f32; 4096];
            let none = Params::default();
            let t = Inputs {
                seed,
                ..Inputs::new(&base, &tensors, &none, &[64, 64])
            };
            generalized(&DARE_TIES, &t, &mut out).unwrap();
            out
        };
        assert_eq!(run(1), run(1));
        assert_ne!(run(1), run(2));
    }

    #[test]
    fn bad_inputs_and_parameters_are_refused_with_their_name() {
        let base = [0f32, 0.0, 0.0];
        let good = [1f32, 2.0, 3.0];
        let nan = [1f32, 2.0, f32::NAN];
        let none = Params::default();
        let err = |models: &[(&[f32], Params)], global: &Params| {
            merge(&TIES, &base, models, global).unwrap_err()
        };
        assert_eq!(
            err(
                &[(&good, weighted(1.0, 1.0)), (&nan, weighted(1.0, 1.0))],
                &none
            ),
            "models[1] has a non-finite value (NaN) at element 2"
        );
        assert_eq!(
            err(&[(&good, Params::default())], &none),
            "models[0]: missing `weight`"
        );
        assert_eq!(
            err(&[(&good, weighted(1.0, -0.5))], &none),
            "models[0]: `density` must be at least 0, got -0.5"
        );
        assert_eq!(
            err(&[(&good, weighted(1.0, 0.5).with("gamma", 1.5))], &none),
            "models[0]: `gamma` must be in [0, 1], got 1.5"
        );
        assert_eq!(
            err(&[(&good, weighted(f64::INFINITY, 0.5))], &none),
            "models[0]: `weight` must be a finite number, got inf"
        );
        assert_eq!(
            err(&[(&good[..2], weighted(1.0, 0.5))], &none),
            "models[0] has 2 elements, shape [3] needs 3"
        );
        let lambda = Params::default().with("lambda", f64::NAN);
        assert_eq!(
            err(&[(&good, weighted(1.0, 0.5))], &lambda),
            "`lambda` must be a finite number, got NaN"
        );
        let della_err = merge(&DELLA, &base, &[(&good, weighted(1.0, 0.1))], &none).unwrap_err();
        assert!(
            della_err.starts_with("models[0]: `epsilon` must leave"),
            "{della_err}"
        );
    }

    /// The combination element by element, as mergekit's formula reads: the reference the
    /// block-wise, branch-free [`Setup::combine`] must equal bit for bit.
    fn combine_one_by_one(
        setup: &Setup,
        base: &[f32],
        models: &[&[f32]],
        kept: &[Survivors],
    ) -> Vec<f32> {
        let total: f64 = setup.weights.iter().sum();
        let linear_divisor = if total.abs() < 1e-8 { 1.0 } else { total };
        (0..base.len())
            .map(|j| {
                let b = f64::from(base[j]);
                let terms: Vec<f64> = (0..models.len())
                    .map(|i| match kept[i].kept(j) {
                        true => (f64::from(models[i][j]) - b) * kept[i].scale * setup.weights[i],
                        false => 0.0,
                    })
                    .collect();
                let (mut merged, divisor) = if setup.consensus {
                    let positive = terms.iter().sum::<f64>() >= 0.0;
                    let (mut merged, mut divisor) = (0.0, 0.0);
                    for (t, w) in terms.iter().zip(&setup.weights) {
                        if *t != 0.0 && (*t > 0.0) == positive {
                            merged += t;
                            divisor += w;
                        }
                    }
                    (merged, if divisor == 0.0 { 1.0 } else { divisor })
                } else {
                    (terms.iter().sum(), linear_divisor)
                };
                if setup.normalize {
                    merged /= divisor;
                }
                if setup.lambda != 1.0 {
                    merged *= setup.lambda;
                }
                (b + merged) as f32
            })
            .collect()
    }

    #[test]
    fn the_block_wise_combination_is_the_element_wise_one_bit_for_bit() {
        // Signed zeros, equal values (zero task vectors), ties in sign, negative and zero
        // weights, across block boundaries (1,300 elements), every flag.
        let pick = [0.0f32, -0.0, 1.0, -1.0, 0.5, -0.25, 3.0e-8, -7.5];
        let value = |trial: u64, model: u64, j: usize| {
            pick[(uniform(trial, model, j as u64) * pick.len() as f64) as usize]
        };
        for trial in 0..48u64 {
            let len = 1300;
            let count = 1 + trial as usize % 3;
            let base: Vec<f32> = (0..len).map(|j| value(trial, 99, j)).collect();
            let models: Vec<Vec<f32>> = (0..count)
                .map(|m| (0..len).map(|j| value(trial, m as u64, j)).collect())
                .collect();
            let views: Vec<&[f32]> = models.iter().map(Vec::as_slice).collect();
            let kept: Vec<Survivors> = (0..count)
                .map(|m| {
                    let mut s = match trial % 4 {
                        0 => Survivors::all(),
                        _ => Survivors::from_predicate(len, |j| {
                            uniform(trial, 50 + m as u64, j as u64) < 0.6
                        }),
                    };
                    s.scale = [1.0, 1.5, 0.75][m % 3];
                    s
                })
                .collect();
            let setup = Setup {
                consensus: trial % 2 == 0,
                normalize: trial / 2 % 2 == 0,
                lambda: if trial % 3 == 0 { 0.9 } else { 1.0 },
                weights: (0..count)
                    .map(|m| [0.5, -0.3, 0.0, 1.0][(m + trial as usize) % 4])
                    .collect(),
                sparsify: Vec::new(),
            };
            let mut got = vec![f32::NAN; len];
            setup.combine(&base, &views, &kept, &mut got);
            let want = combine_one_by_one(&setup, &base, &views, &kept);
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&got), bits(&want), "trial {trial}");
        }
    }
}
