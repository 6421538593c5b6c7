//! Spherical interpolation: `slerp` (two models, one angle per tensor), `nuslerp` (per row,
//! column or tensor, optionally of task vectors) and `multislerp` (N models through the
//! tangent space at their mean).
//!
//! mergekit 0.1.5 computes slerp in `f32` for `bf16`/`f32` inputs, its norms from 1M-element
//! chunks, and nuslerp/multislerp in the input dtype. We evaluate each formula in `f64` (norms
//! and dot products as fixed-order [`BlockSum`]s, exact for `f32` products) and round once,
//! which the golden tests in `tests/merge_methods.rs` hold against mergekit's own `f64` run.
//! A NaN in an input turns whatever mergekit's turns into NaN (the whole tensor, or vector).

use super::support::{
    base_model_and_t, clamp_min, model_count, optional, required, same_lengths, shape_holds,
    split_axis, weights, BlockSum, BLOCK_TERMS,
};
use super::survey::{fork_of, merge_whole, Blend, BlendKind, Chunk, Setting, Survey};
use super::{optional_base, Inputs, Params};

/// mergekit's slerp: `t` (required) interpolates from `base` (`t = 0`) to the one other model
/// along the great circle through the two whole tensors. Norms at or below `1e-8` count as 1;
/// when `|cos θ| > 0.9995` (near-collinear) it interpolates linearly.
pub fn slerp(t: &Inputs, out: &mut [f32]) -> Result<(), String> {
    let (base, model, t) = base_model_and_t("slerp", t, out)?;
    let mut sums = SlerpSums::default();
    sums.add(base, model);
    sums.blend(t, base, model, out);
    Ok(())
}

/// slerp's norms and dot product of the two tensors, summed element by element in order.
#[derive(Clone, Copy, Debug, Default)]
struct SlerpSums {
    aa: BlockSum,
    bb: BlockSum,
    ab: BlockSum,
}

impl SlerpSums {
    fn add(&mut self, base: &[f32], other: &[f32]) {
        for (&a, &b) in base.iter().zip(other) {
            let (a, b) = (a as f64, b as f64);
            self.aa.add(a * a);
            self.bb.add(b * b);
            self.ab.add(a * b);
        }
    }

    /// The blend's coefficients `(ca, cb)` from the sums and `t`.
    fn coefficients(&self, t: f64) -> (f64, f64) {
        let unit = |norm: f64| if norm > 1e-8 { norm } else { 1.0 };
        let (na, nb) = (unit(self.aa.value().sqrt()), unit(self.bb.value().sqrt()));
        let dot = (self.ab.value() / na / nb).clamp(-1.0, 1.0);
        if dot.abs() > 0.9995 {
            (1.0 - t, t)
        } else {
            let theta = dot.acos();
            let sin = theta.sin();
            (((1.0 - t) * theta).sin() / sin, (t * theta).sin() / sin)
        }
    }

    /// Writes `ca · base + cb · other` ([`SlerpSums::coefficients`]).
    fn blend(&self, t: f64, base: &[f32], other: &[f32], out: &mut [f32]) {
        let (ca, cb) = self.coefficients(t);
        for ((o, &a), &b) in out.iter_mut().zip(base).zip(other) {
            *o = (ca * a as f64 + cb * b as f64) as f32;
        }
    }
}

/// slerp a chunk at a time: one pass sums the norms and the dot product.
#[derive(Debug)]
pub struct SlerpSurvey {
    t: f64,
    sums: SlerpSums,
}

/// The [`Survey`] of one slerp tensor.
pub fn slerp_survey(s: &Setting) -> Result<Box<dyn Survey>, String> {
    model_count("slerp", s.models.len(), 1, 1)?;
    Ok(Box::new(SlerpSurvey {
        t: required(s.global, "t")?,
        sums: SlerpSums::default(),
    }))
}

impl Survey for SlerpSurvey {
    fn passes(&self) -> usize {
        1
    }
    fn observe(&mut self, _: usize, chunk: &Chunk) -> Result<(), String> {
        let (_, base, models) = (chunk.start, chunk.base, chunk.models);
        self.sums.add(base, models[0]);
        Ok(())
    }
    fn merge(&self, chunk: &Chunk, out: &mut [f32]) -> Result<(), String> {
        let (_, base, models) = (chunk.start, chunk.base, chunk.models);
        self.sums.blend(self.t, base, models[0], out);
        Ok(())
    }
    fn blend(&self) -> Option<Blend> {
        let (ca, cb) = self.sums.coefficients(self.t);
        Some(Blend {
            kind: BlendKind::Slerp,
            coefs: vec![ca, cb],
        })
    }
}

/// mergekit's nuslerp: two models with per-model `weight` (required); `t = w₁ / (w₀ + w₁)`, or
/// 0.5 when `|w₀ + w₁| < 1e-6`. With a `base`, it interpolates the task vectors `model − base`
/// and adds the base back. `nuslerp_flatten` (default 1) takes the whole tensor as one vector;
/// otherwise each row (vectors along the last axis) or, with `nuslerp_row_wise`, each vector
/// along axis 0. Norms are clamped to ≥ 1e-7; vectors with `1 − cos² θ ≤ 1e-16` are
/// interpolated linearly.
pub fn nuslerp(inputs: &Inputs, out: &mut [f32]) -> Result<(), String> {
    let (base, models) = (inputs.optional_base(), inputs.models);
    model_count("nuslerp", models.len(), 2, 2)?;
    same_lengths(base, models, out)?;
    shape_holds(inputs.shape, out.len())?;
    let t = nuslerp_t(&weights(models.iter().map(|m| m.params))?);
    let (outer, length, inner) = nuslerp_layout(inputs.global, inputs.shape, out.len());
    debug_assert_eq!(outer * length * inner, out.len());
    let values = [models[0].values, models[1].values];
    merge_slabs(t, base, values, length * inner, inner, out);
    Ok(())
}

/// Interpolates each `slab` elements on their own, the columns of `inner` elements their
/// vectors.
fn merge_slabs(
    t: f64,
    base: Option<&[f32]>,
    models: [&[f32]; 2],
    slab: usize,
    inner: usize,
    out: &mut [f32],
) {
    if slab == 0 {
        return;
    }
    for start in (0..out.len()).step_by(slab) {
        let span = start..start + slab;
        let b = base.map(|b| &b[span.clone()]);
        let m = [&models[0][span.clone()], &models[1][span.clone()]];
        let mut sums = ColumnSums::new(inner);
        sums.add(b, &m);
        sums.blend(t, b, &m, &mut out[span]);
    }
}

/// nuslerp's `t = w₁ / (w₀ + w₁)`, or 0.5 when `|w₀ + w₁| < 1e-6`.
fn nuslerp_t(w: &[f64]) -> f64 {
    let total = w[0] + w[1];
    if total.abs() < 1e-6 {
        0.5
    } else {
        w[1] / total
    }
}

/// nuslerp's vectors as (outer, length, inner): `outer` slabs of `length` rows of `inner`
/// elements, each column of a slab one vector.
fn nuslerp_layout(global: &Params, shape: &[usize], len: usize) -> (usize, usize, usize) {
    if global.flag("nuslerp_flatten", true) {
        (1, len, 1)
    } else if global.flag("nuslerp_row_wise", false) {
        split_axis(shape, 0)
    } else {
        split_axis(shape, shape.len().saturating_sub(1))
    }
}

/// The norms and dot product of the two (task) vectors of each of `inner` columns, summed row
/// by row in order. Vectors (o, ·, i) for all i at once, so both sweeps read memory in order
/// even when the vectors run down columns.
#[derive(Clone, Debug)]
struct ColumnSums {
    stats: Vec<[BlockSum; 3]>,
}

impl ColumnSums {
    fn new(inner: usize) -> ColumnSums {
        ColumnSums {
            stats: vec![[BlockSum::default(); 3]; inner.max(1)],
        }
    }

    /// Adds whole rows: `models` (and `base`) start at a row's first element.
    fn add(&mut self, base: Option<&[f32]>, models: &[&[f32]; 2]) {
        let inner = self.stats.len();
        for (k, (&x, &y)) in models[0].iter().zip(models[1]).enumerate() {
            let back = base.map_or(0.0, |b| b[k] as f64);
            let (a, b) = (x as f64 - back, y as f64 - back);
            let [aa, bb, ab] = &mut self.stats[k % inner];
            aa.add(a * a);
            bb.add(b * b);
            ab.add(a * b);
        }
    }

    /// Each column's coefficients `(ca, cb)` at `t`.
    fn coefficients(&self, t: f64) -> Vec<(f64, f64)> {
        (self.stats.iter())
            .map(|[aa, bb, ab]| {
                let na = clamp_min(aa.value().sqrt(), 1e-7);
                let nb = clamp_min(bb.value().sqrt(), 1e-7);
                coefficients((ab.value() / na / nb).clamp(-1.0, 1.0), t)
            })
            .collect()
    }

    /// Interpolates whole rows by each column's coefficients.
    fn blend(&self, t: f64, base: Option<&[f32]>, models: &[&[f32]; 2], out: &mut [f32]) {
        let coefs = self.coefficients(t);
        for (k, o) in out.iter_mut().enumerate() {
            let back = base.map_or(0.0, |b| b[k] as f64);
            let (a, b) = (models[0][k] as f64 - back, models[1][k] as f64 - back);
            let (ca, cb) = coefs[k % coefs.len()];
            *o = (back + ca * a + cb * b) as f32;
        }
    }
}

/// nuslerp a chunk at a time: a tensor whose vectors span it (flattened, or down columns)
/// sums them in one pass; one of several slabs (rows along the last axis) needs none, its
/// chunks holding whole slabs.
#[derive(Debug)]
pub struct NuslerpSurvey {
    t: f64,
    /// Elements of one slab when there are several; 0 when one slab holds the whole tensor.
    slab: usize,
    sums: ColumnSums,
}

/// The [`Survey`] of one nuslerp tensor.
pub fn nuslerp_survey(s: &Setting) -> Result<Box<dyn Survey>, String> {
    model_count("nuslerp", s.models.len(), 2, 2)?;
    let t = nuslerp_t(&weights(s.models)?);
    let (outer, length, inner) = nuslerp_layout(s.global, s.shape, s.shape.iter().product());
    Ok(Box::new(NuslerpSurvey {
        t,
        slab: if outer > 1 { length * inner } else { 0 },
        sums: ColumnSums::new(inner),
    }))
}

impl Survey for NuslerpSurvey {
    fn passes(&self) -> usize {
        usize::from(self.slab == 0)
    }
    fn granule(&self) -> usize {
        if self.slab == 0 {
            self.sums.stats.len()
        } else {
            self.slab
        }
    }
    fn observe(&mut self, _: usize, chunk: &Chunk) -> Result<(), String> {
        let (_, base, models) = (chunk.start, chunk.base, chunk.models);
        self.sums.add(optional_base(base), &[models[0], models[1]]);
        Ok(())
    }
    fn merge(&self, chunk: &Chunk, out: &mut [f32]) -> Result<(), String> {
        let (_, base, models) = (chunk.start, chunk.base, chunk.models);
        let (base, models) = (optional_base(base), [models[0], models[1]]);
        if self.slab == 0 {
            self.sums.blend(self.t, base, &models, out);
        } else {
            let inner = self.sums.stats.len();
            merge_slabs(self.t, base, models, self.slab, inner, out);
        }
        Ok(())
    }
    /// Vectors spanning the tensor blend by the survey's coefficients; slabs (rows along the
    /// last axis) find theirs chunk by chunk, on the CPU.
    fn blend(&self) -> Option<Blend> {
        (self.slab == 0).then(|| Blend {
            kind: BlendKind::Nuslerp,
            coefs: (self.sums.coefficients(self.t).into_iter())
                .flat_map(|(ca, cb)| [ca, cb])
                .collect(),
        })
    }
}

/// mergekit's multislerp: barycentric interpolation of N ≥ 1 models (task vectors when there
/// is a `base`) on the unit sphere. Per-model `weight` (required), divided by their sum unless
/// `normalize_weights` is 0; `eps` (default 1e-8). Each vector is scaled to unit length
/// (`v / (‖v‖ + eps)`), their weighted mean `m` normalised, the tangent vectors
/// `u − (u·m) m` averaged with the weights and mapped back with the exponential map, then
/// scaled by the weighted mean of the norms. One model is returned unchanged. When the mean is
/// shorter than `eps`, two models are averaged linearly; more are refused (as mergekit does).
/// Weights summing to zero are refused (mergekit divides by zero).
pub fn multislerp(t: &Inputs, out: &mut [f32]) -> Result<(), String> {
    model_count("multislerp", t.models.len(), 1, usize::MAX)?;
    same_lengths(t.optional_base(), t.models, out)?;
    merge_whole(multislerp_survey, t, out)
}

/// multislerp a chunk at a time: pass 0 sums each model's squared norm, pass 1 each unit
/// vector's dot product with the weighted mean and the mean's squared length, pass 2 the
/// tangent's squared length; then each element merges on its own. Every pass only sums one
/// term per element into each sum, so it is observed on several threads a block of
/// [`BLOCK_TERMS`] elements per fork, the blocks' sums appended in order.
#[derive(Clone, Debug)]
pub struct MultislerpSurvey {
    w: Vec<f64>,
    eps: f64,
    /// Each model's norm (pass 0).
    norms: Vec<f64>,
    /// Each model's factor in the mean: `w / (‖v‖ + eps)`.
    scale: Vec<f64>,
    /// Each unit vector's dot product with the normalised mean, and the mean's length (pass 1).
    dots: Vec<f64>,
    mean_norm: f64,
    /// Two models whose mean is shorter than `eps`: averaged linearly.
    linear: bool,
    /// The exponential map's factors of the mean and the tangent (pass 2).
    cos: f64,
    sinc: f64,
    sums: Vec<BlockSum>,
}

/// The [`Survey`] of one multislerp tensor.
pub fn multislerp_survey(s: &Setting) -> Result<Box<dyn Survey>, String> {
    let (global, models) = (s.global, s.models);
    model_count("multislerp", models.len(), 1, usize::MAX)?;
    let mut w = weights(models)?;
    let eps = optional(global, "eps", 1e-8)?;
    // One model is returned as it is: its weights are not normalised.
    if models.len() > 1 && global.flag("normalize_weights", true) {
        let sum: f64 = w.iter().sum();
        if sum == 0.0 {
            return Err("the models' `weight`s sum to zero".into());
        }
        w.iter_mut().for_each(|x| *x /= sum);
    }
    let n = models.len();
    Ok(Box::new(MultislerpSurvey {
        w,
        eps,
        norms: vec![0.0; n],
        scale: vec![0.0; n],
        dots: vec![0.0; n],
        mean_norm: 0.0,
        linear: false,
        cos: 0.0,
        sinc: 0.0,
        sums: vec![BlockSum::default(); n],
    }))
}

impl MultislerpSurvey {
    /// Element `k` of model `m`'s vector (its task vector when there is a base).
    fn value(chunk: &Chunk, m: usize, k: usize) -> f64 {
        let back = chunk.base.get(k).map_or(0.0, |&b| b as f64);
        chunk.models[m][k] as f64 - back
    }

    /// Element `k` of the weighted mean of the unit vectors, not yet normalised.
    fn mean(&self, chunk: &Chunk, k: usize) -> f64 {
        (0..self.w.len())
            .map(|m| self.scale[m] * Self::value(chunk, m, k))
            .sum::<f64>()
    }

    /// Element `k` of the weighted mean of the tangent vectors at the normalised mean, `mean`
    /// being element `k` of [`Self::mean`].
    fn tangent(&self, chunk: &Chunk, k: usize, mean: f64) -> f64 {
        let mk = mean / self.mean_norm;
        (0..self.w.len())
            .map(|m| {
                let unit = Self::value(chunk, m, k) / (self.norms[m] + self.eps);
                self.w[m] * (unit - self.dots[m] * mk)
            })
            .sum::<f64>()
    }
}

impl Survey for MultislerpSurvey {
    fn passes(&self) -> usize {
        if self.w.len() == 1 {
            0
        } else {
            3
        }
    }
    fn observe(&mut self, pass: usize, chunk: &Chunk) -> Result<(), String> {
        let n = self.w.len();
        for k in 0..chunk.models[0].len() {
            match pass {
                0 => (0..n).for_each(|m| {
                    let v = Self::value(chunk, m, k);
                    self.sums[m].add(v * v)
                }),
                1 => {
                    let mk = self.mean(chunk, k);
                    for m in 0..n {
                        let unit = Self::value(chunk, m, k) / (self.norms[m] + self.eps);
                        self.sums[m].add(unit * mk);
                    }
                    self.sums[n].add(mk * mk);
                }
                _ if self.linear => return Ok(()),
                _ => {
                    let t = self.tangent(chunk, k, self.mean(chunk, k));
                    self.sums[0].add(t * t);
                }
            }
        }
        Ok(())
    }
    fn fork_span(&self, _: usize) -> Option<usize> {
        Some(BLOCK_TERMS)
    }
    fn fork(&self, _: usize, _: usize) -> Option<Box<dyn Survey>> {
        let mut fork = self.clone();
        fork.sums.fill(BlockSum::default());
        Some(Box::new(fork))
    }
    fn join(&mut self, _: usize, fork: Box<dyn Survey>) {
        let fork = fork_of::<Self>(fork);
        (self.sums.iter_mut().zip(&fork.sums)).for_each(|(sum, block)| sum.append(block));
    }
    fn end_pass(&mut self, pass: usize) -> Result<(), String> {
        let n = self.w.len();
        match pass {
            0 => {
                for m in 0..n {
                    self.norms[m] = self.sums[m].value().sqrt();
                    self.scale[m] = self.w[m] / (self.norms[m] + self.eps);
                }
                self.sums = vec![BlockSum::default(); n + 1];
            }
            1 => {
                self.mean_norm = self.sums[n].value().sqrt();
                if self.mean_norm < self.eps {
                    if n != 2 {
                        return Err("the weighted mean of the models is zero (antipodal models \
                             whose weights cancel); use other weights"
                            .into());
                    }
                    self.linear = true;
                }
                for m in 0..n {
                    self.dots[m] = self.sums[m].value() / self.mean_norm;
                }
                self.sums = vec![BlockSum::default(); 1];
            }
            _ if self.linear => {}
            _ => {
                let tn = self.sums[0].value().sqrt() + self.eps;
                let avg_norm: f64 = self.norms.iter().zip(&self.w).map(|(n, w)| n * w).sum();
                (self.cos, self.sinc) = (tn.cos() * avg_norm, tn.sin() / tn * avg_norm);
            }
        }
        Ok(())
    }
    fn blend(&self) -> Option<Blend> {
        if self.w.len() == 1 {
            return None;
        }
        let mut coefs = Vec::with_capacity(4 * self.w.len() + 4);
        coefs.extend(&self.scale);
        coefs.extend(&self.w);
        coefs.extend(self.norms.iter().map(|n| n + self.eps));
        coefs.extend(&self.dots);
        coefs.extend([
            self.mean_norm,
            self.cos,
            self.sinc,
            f64::from(u8::from(self.linear)),
        ]);
        Some(Blend {
            kind: BlendKind::Multislerp,
            coefs,
        })
    }
    fn merge(&self, chunk: &Chunk, out: &mut [f32]) -> Result<(), String> {
        if self.w.len() == 1 {
            out.copy_from_slice(chunk.models[0]);
            return Ok(());
        }
        for (k, o) in out.iter_mut().enumerate() {
            let back = chunk.base.get(k).map_or(0.0, |&b| b as f64);
            *o = if self.linear {
                let (a, b) = (Self::value(chunk, 0, k), Self::value(chunk, 1, k));
                (self.w[0] * a + self.w[1] * b + back) as f32
            } else {
                let mean = self.mean(chunk, k);
                let tangent = self.tangent(chunk, k, mean);
                (mean / self.mean_norm * self.cos + tangent * self.sinc + back) as f32
            };
        }
        Ok(())
    }
}

/// nuslerp's weights of the two vectors at cosine `cos`: linear when they are collinear
/// (`1 − cos² ≤ 1e-16`), else `sin((1 − t) θ) / sin θ` and `sin(t θ) / sin θ`.
fn coefficients(cos: f64, t: f64) -> (f64, f64) {
    if 1.0 - cos * cos <= 1e-16 {
        return (1.0 - t, t);
    }
    let theta = cos.acos();
    let sin = theta.sin();
    (((1.0 - t) * theta).sin() / sin, (t * theta).sin() / sin)
}

#[cfg(test)]
mod tests {
    use super::super::ModelTensor;
    use super::*;

    fn model<'a>(values: &'a [f32], params: &'a Params) -> ModelTensor<'a> {
        ModelTensor { values, params }
    }

    #[test]
    fn slerp_of_orthogonal_unit_vectors_follows_the_circle() {
        let (a, b) = ([1.0f32, 0.0], [0.0f32, 1.0]);
        let none = Params::default();
        let mut out = [0.0f32; 2];
        let models = [model(&b, &none)];
        let half = none.clone().with("t", 0.5);
        slerp(&Inputs::new(&a, &models, &half, &[2]), &mut out).unwrap();
        let h = std::f32::consts::FRAC_1_SQRT_2;
        assert_eq!(out, [h, h]);
        let err = slerp(&Inputs::new(&a, &models, &none, &[2]), &mut out).unwrap_err();
        assert_eq!(err, "missing parameter `t`");
    }

    #[test]
    fn slerp_of_zero_tensors_is_zero_and_nan_spreads_to_the_whole_tensor() {
        let none = Params::default();
        let t = none.clone().with("t", 0.3);
        let mut out = [1.0f32; 3];
        let zeros = [model(&[0.0; 3], &none)];
        slerp(&Inputs::new(&[0.0; 3], &zeros, &t, &[3]), &mut out).unwrap();
        assert_eq!(out, [0.0; 3]);
        let other = [model(&[1.0, 2.0, 3.0], &none)];
        slerp(
            &Inputs::new(&[1.0, f32::NAN, 2.0], &other, &t, &[3]),
            &mut out,
        )
        .unwrap();
        assert!(out.iter().all(|x| x.is_nan()), "{out:?}");
    }

    #[test]
    fn nuslerp_needs_a_weight_per_model_and_zero_total_means_halfway() {
        let w = Params::default().with("weight", 1.0);
        let none = Params::default();
        let mut out = [0.0f32; 2];
        let unweighted = [model(&[1.0, 0.0], &w), model(&[0.0, 1.0], &none)];
        let err = nuslerp(&Inputs::new(&[], &unweighted, &none, &[2]), &mut out).unwrap_err();
        assert_eq!(err, "missing parameter `weight` for model 1");
        let neg = Params::default().with("weight", -1.0);
        let cancelling = [model(&[2.0, 0.0], &w), model(&[0.0, 2.0], &neg)];
        nuslerp(&Inputs::new(&[], &cancelling, &none, &[2]), &mut out).unwrap();
        let h = std::f32::consts::SQRT_2;
        assert_eq!(out, [h, h]);
    }

    #[test]
    fn multislerp_refuses_weights_summing_to_zero_and_cancelling_models() {
        let (p, n) = (
            Params::default().with("weight", 1.0),
            Params::default().with("weight", -1.0),
        );
        let none = Params::default();
        let mut out = [0.0f32; 2];
        let opposed = [model(&[1.0, 0.0], &p), model(&[0.0, 1.0], &n)];
        let err = multislerp(&Inputs::new(&[], &opposed, &none, &[2]), &mut out).unwrap_err();
        assert_eq!(err, "the models' `weight`s sum to zero");
        let three = [
            model(&[1.0, 0.0], &p),
            model(&[-1.0, 0.0], &p),
            model(&[0.0, 0.0], &p),
        ];
        let err = multislerp(&Inputs::new(&[], &three, &none, &[2]), &mut out).unwrap_err();
        assert!(
            err.starts_with("the weighted mean of the models is zero"),
            "{err}"
        );
        // Two antipodal models fall back to the linear average, as in mergekit.
        multislerp(&Inputs::new(&[], &three[..2], &none, &[2]), &mut out).unwrap();
        assert_eq!(out, [0.0, 0.0]);
    }
}
