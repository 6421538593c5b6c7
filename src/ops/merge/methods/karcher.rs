//! The Karcher (Riemannian) mean of N tensors on the unit sphere, as mergekit 0.1.5's
//! `karcher` iterates it.
//!
//! mergekit holds the running mean as a full tensor in the input dtype and rounds it there at
//! every step. The mean only ever moves within the span of the inputs' unit vectors (each step
//! adds a combination of them and the mean itself), so we keep it as N coefficients and run
//! every iteration on the inputs' N×N Gram matrix in `f64`: one pass over the inputs for the
//! Gram matrix, one to write the result, and no tensor-sized scratch however many iterations
//! run — what issue #27 asks of karcher's memory.

use super::support::{count_param, optional, same_lengths, BlockSum};
use super::survey::{merge_whole, Blend, BlendKind, Chunk, Setting, Survey};
use super::Inputs;

/// mergekit's karcher: every input (the base too, when the config names one), in mergekit's
/// model order, weighted equally. Inputs with norm ≤ `tol` (default 1e-5) are left out of the
/// mean's direction; the direction starts at the normalised weighted mean of the unit vectors
/// (or the first kept one when that is shorter than `tol`) and takes up to `max_iter`
/// (default 10) steps of the exponential map along the weighted tangent mean, skipping inputs
/// within `tol` radians and stopping when the step is shorter than `tol`. The result is that
/// direction times the mean of all the norms. As in mergekit: all-zero inputs give zeros, a
/// NaN makes the whole tensor NaN (only its own element when every norm is ≤ `tol`), and two
/// exactly opposite inputs give the first (their tangents cancel).
/// karcher ignores the base policy: the engine hands every input in model order, `t.base`
/// empty.
pub fn karcher(t: &Inputs, out: &mut [f32]) -> Result<(), String> {
    same_lengths(None, t.models, out)?;
    merge_whole(karcher_survey, &Inputs { base: &[], ..*t }, out)
}

/// karcher a chunk at a time: one pass sums the inputs' Gram matrix, from which the mean's
/// coefficients follow; each element then merges on its own.
#[derive(Debug)]
pub struct KarcherSurvey {
    n: usize,
    max_iter: usize,
    tol: f64,
    /// The upper triangle's sums `x_i · x_j`, row-major N×N.
    sums: Vec<BlockSum>,
    /// The inputs in the mean's direction (norm above `tol`) and their coefficients.
    kept: Vec<usize>,
    coef: Vec<f64>,
}

/// The [`Survey`] of one karcher tensor: every input in model order (the base too).
pub fn karcher_survey(s: &Setting) -> Result<Box<dyn Survey>, String> {
    let (global, models) = (s.global, s.models);
    let max_iter = count_param(global, "max_iter", 10)?;
    let tol = optional(global, "tol", 1e-5)?;
    let n = models.len();
    if n == 0 {
        return Err("karcher needs at least one model".into());
    }
    Ok(Box::new(KarcherSurvey {
        n,
        max_iter,
        tol,
        sums: vec![BlockSum::default(); n * n],
        kept: Vec::new(),
        coef: Vec::new(),
    }))
}

impl Survey for KarcherSurvey {
    fn passes(&self) -> usize {
        usize::from(self.n > 1)
    }
    fn observe(&mut self, _: usize, chunk: &Chunk) -> Result<(), String> {
        let n = self.n;
        let mut row = vec![0.0f64; n];
        for k in 0..chunk.models[0].len() {
            for (r, m) in row.iter_mut().zip(chunk.models) {
                *r = m[k] as f64;
            }
            for i in 0..n {
                for j in i..n {
                    self.sums[i * n + j].add(row[i] * row[j]);
                }
            }
        }
        Ok(())
    }
    fn end_pass(&mut self, _: usize) -> Result<(), String> {
        let n = self.n;
        let mut gram = vec![0.0; n * n];
        for i in 0..n {
            for j in i..n {
                gram[i * n + j] = self.sums[i * n + j].value();
                gram[j * n + i] = gram[i * n + j];
            }
        }
        let norms: Vec<f64> = (0..n).map(|i| gram[i * n + i].sqrt()).collect();
        let scale = norms.iter().sum::<f64>() / n as f64;
        self.kept = (0..n).filter(|&i| norms[i] > self.tol).collect();
        if self.kept.is_empty() {
            return Ok(());
        }
        // The unit vectors' Gram matrix, over the kept inputs.
        let (kept, v) = (&self.kept, self.kept.len());
        let units: Vec<f64> = (0..v * v)
            .map(|e| {
                let (i, j) = (kept[e / v], kept[e % v]);
                gram[i * n + j] / (norms[i] * norms[j])
            })
            .collect();
        let mean = iterate(&units, v, self.max_iter, self.tol);
        self.coef = (kept.iter().zip(&mean))
            .map(|(&i, c)| scale * c / norms[i])
            .collect();
        Ok(())
    }
    /// Which models are kept is known only once surveyed.
    fn may_blend(&self) -> bool {
        self.n > 1
    }

    /// One model is copied, and no kept model sums zeros, on the CPU.
    fn blend(&self) -> Option<Blend> {
        (self.n > 1 && !self.kept.is_empty()).then(|| Blend {
            kind: BlendKind::Karcher,
            coefs: (self.kept.iter().zip(&self.coef))
                .flat_map(|(&i, &c)| [i as f64, c])
                .collect(),
        })
    }

    fn merge(&self, chunk: &Chunk, out: &mut [f32]) -> Result<(), String> {
        let models = chunk.models;
        if self.n == 1 {
            out.copy_from_slice(models[0]);
        } else if self.kept.is_empty() {
            for (k, o) in out.iter_mut().enumerate() {
                *o = models.iter().map(|m| m[k] * 0.0).sum();
            }
        } else {
            for (k, o) in out.iter_mut().enumerate() {
                let x: f64 = (self.kept.iter().zip(&self.coef))
                    .map(|(&i, c)| c * models[i][k] as f64)
                    .sum();
                *o = x as f32;
            }
        }
        Ok(())
    }
}

/// `c^T G d` for the unit Gram matrix `g` of size `v`.
fn inner(g: &[f64], v: usize, c: &[f64], d: &[f64]) -> f64 {
    (0..v)
        .map(|i| c[i] * (0..v).map(|j| g[i * v + j] * d[j]).sum::<f64>())
        .sum()
}

/// mergekit's iteration on the mean's coefficients over the `v` kept unit vectors.
fn iterate(g: &[f64], v: usize, max_iter: usize, tol: f64) -> Vec<f64> {
    let alpha = 1.0 / v as f64;
    let mut mean = vec![alpha; v];
    let norm = inner(g, v, &mean, &mean).sqrt();
    if norm < tol {
        mean = (0..v).map(|i| if i == 0 { 1.0 } else { 0.0 }).collect();
    } else {
        mean.iter_mut().for_each(|c| *c /= norm);
    }
    for _ in 0..max_iter {
        let mut tangent = vec![0.0; v];
        for k in 0..v {
            let dot = (0..v)
                .map(|i| mean[i] * g[i * v + k])
                .sum::<f64>()
                .clamp(-1.0, 1.0);
            let theta = dot.acos();
            if theta < tol {
                continue;
            }
            let step = alpha * theta / theta.sin();
            tangent[k] += step;
            for (t, m) in tangent.iter_mut().zip(&mean) {
                *t -= step * dot * m;
            }
        }
        let tn = inner(g, v, &tangent, &tangent).max(0.0).sqrt();
        if tn < tol {
            break;
        }
        let (c, s) = (tn.cos(), tn.sin() / tn);
        for (m, t) in mean.iter_mut().zip(&tangent) {
            *m = c * *m + s * t;
        }
        let un = inner(g, v, &mean, &mean).sqrt();
        if un > tol {
            mean.iter_mut().for_each(|c| *c /= un);
        }
    }
    mean
}

#[cfg(test)]
mod tests {
    use super::super::support::run_plain;
    use super::super::Params;
    use super::*;

    fn run(inputs: &[&[f32]], global: &Params) -> Result<Vec<f32>, String> {
        run_plain(karcher, &[], inputs, global)
    }

    #[test]
    fn karcher_of_two_orthogonal_vectors_is_their_bisector_at_the_mean_norm() {
        let out = run(&[&[2.0, 0.0], &[0.0, 4.0]], &Params::default()).unwrap();
        let x = (3.0 * std::f64::consts::FRAC_1_SQRT_2) as f32;
        assert_eq!(out, [x, x]);
    }

    #[test]
    fn karcher_edge_cases_match_mergekit_zero_nan_opposite_and_bad_parameters() {
        let none = Params::default();
        assert_eq!(run(&[&[0.0, 0.0], &[0.0, 0.0]], &none).unwrap(), [0.0, 0.0]);
        // A zero model is left out of the direction but counts in the mean norm.
        let out = run(&[&[0.0, 0.0], &[0.0, 4.0]], &none).unwrap();
        assert_eq!(out, [0.0, 2.0]);
        let out = run(&[&[1.0, f32::NAN], &[0.0, 4.0]], &none).unwrap();
        assert!(out.iter().all(|x| x.is_nan()), "{out:?}");
        assert!(run(&[&[0.0, 0.0], &[f32::NAN, 0.0]], &none).unwrap()[0].is_nan());
        assert_eq!(
            run(&[&[0.0, 0.0], &[f32::NAN, 0.0]], &none).unwrap()[1],
            0.0
        );
        assert_eq!(
            run(&[&[1.0, 0.0], &[-1.0, 0.0]], &none).unwrap(),
            [1.0, 0.0]
        );
        let err = run(
            &[&[1.0, 0.0], &[0.0, 1.0]],
            &none.clone().with("max_iter", -1.0),
        )
        .unwrap_err();
        assert_eq!(
            err,
            "parameter `max_iter` must be a whole number ≥ 0, not -1"
        );
    }
}
