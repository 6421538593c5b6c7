//! Model Stock (arXiv 2403.19522) as mergekit 0.1.5 computes it: the fine-tunes' average,
//! pulled towards the base by the mean angle between their offsets from it.
//!
//! mergekit forms the offsets and their dot products in the input dtype; we take them in `f64`
//! (the offset of two `f32` values is exact there, their products too) in one pass that keeps
//! only the N×N Gram matrix of the offsets, per row when `filter_wise`.

use std::ops::Range;

use super::support::{model_count, same_lengths, shape_holds, split_axis, BlockSum};
use super::survey::{Blend, BlendKind, Chunk, Setting, Survey};
use super::{Inputs, Params};

/// mergekit's model_stock: `base` and N ≥ 2 fine-tunes. Over the whole tensor (or each row,
/// vectors along the last axis, when `filter_wise` is 1; default 0) the offsets
/// `oᵢ = modelᵢ − base` give `cos θ`, the mean over pairs `i < j` of
/// `oᵢ·oⱼ / max(‖oᵢ‖‖oⱼ‖, 1e-6)` clamped to [-1, 1]; then `t = N cos θ / (1 + (N − 1) cos θ)`,
/// or 0 (the base) when that denominator is below 1e-6 in magnitude, and the result is
/// `t · mean(models) + (1 − t) · base`. A NaN makes its whole tensor (or row) NaN, as in
/// mergekit.
pub fn model_stock(t: &Inputs, out: &mut [f32]) -> Result<(), String> {
    model_count("model_stock", t.models.len(), 2, usize::MAX)?;
    same_lengths(Some(t.base), t.models, out)?;
    shape_holds(t.shape, out.len())?;
    let values: Vec<&[f32]> = t.models.iter().map(|m| m.values).collect();
    rows(
        t.base,
        &values,
        row_length(t.global, t.shape, out.len()),
        out,
    );
    Ok(())
}

/// The elements one `t` covers: a row along the last axis with `filter_wise`, else all `len`.
fn row_length(global: &Params, shape: &[usize], len: usize) -> usize {
    if global.flag("filter_wise", false) {
        split_axis(shape, shape.len().saturating_sub(1)).1
    } else {
        len
    }
}

/// Merges `out.len()` elements, each `row` of them with their own `t`.
fn rows(base: &[f32], models: &[&[f32]], row: usize, out: &mut [f32]) {
    if row == 0 {
        return;
    }
    for start in (0..out.len()).step_by(row) {
        let span = start..start + row;
        let mut gram = Gram::new(models.len());
        gram.add(base, models, span.clone());
        blend(gram.interpolation(), base, models, span, out);
    }
}

/// `t · mean(models) + (1 − t) · base` over `span`.
fn blend(t: f64, base: &[f32], models: &[&[f32]], span: Range<usize>, out: &mut [f32]) {
    let n = models.len();
    for k in span {
        let mean = models.iter().map(|m| m[k] as f64).sum::<f64>() / n as f64;
        out[k] = (t * mean + (1.0 - t) * base[k] as f64) as f32;
    }
}

/// The offsets' Gram matrix (upper triangle of N×N), summed element by element in order.
#[derive(Clone, Debug)]
struct Gram {
    n: usize,
    sums: Vec<BlockSum>,
    offsets: Vec<f64>,
}

impl Gram {
    fn new(n: usize) -> Gram {
        Gram {
            n,
            sums: vec![BlockSum::default(); n * n],
            offsets: vec![0.0; n],
        }
    }

    /// Adds the products of elements `span`'s offsets, element by element. The upper
    /// triangle's sums take their terms in step, so a run up to the end of their block sums in
    /// registers (the same additions in the same order as one [`BlockSum::add`] a term).
    fn add(&mut self, base: &[f32], models: &[&[f32]], span: Range<usize>) {
        // The usual model counts with their pairs' sums in fixed-size arrays, which the
        // compiler keeps in registers; the additions are the general loop's.
        match self.n {
            2 => self.add_fixed::<2, 3>(base, models, span),
            3 => self.add_fixed::<3, 6>(base, models, span),
            4 => self.add_fixed::<4, 10>(base, models, span),
            _ => self.add_any(base, models, span),
        }
    }

    /// [`Gram::add`] for `N` models and their `P` pairs.
    fn add_fixed<const N: usize, const P: usize>(
        &mut self,
        base: &[f32],
        models: &[&[f32]],
        span: Range<usize>,
    ) {
        let mut pairs = [(0usize, 0usize); P];
        let mut p = 0;
        for i in 0..N {
            for j in i..N {
                pairs[p] = (i, j);
                p += 1;
            }
        }
        let mut k = span.start;
        while k < span.end {
            let end = span.end.min(k + self.sums[0].room());
            let mut acc = [0f64; P];
            for (a, &(i, j)) in acc.iter_mut().zip(&pairs) {
                *a = self.sums[i * N + j].open();
            }
            let b = &base[k..end];
            let ms: [&[f32]; N] = std::array::from_fn(|i| &models[i][k..end]);
            for (e, &be) in b.iter().enumerate() {
                let o: [f64; N] = std::array::from_fn(|i| ms[i][e] as f64 - be as f64);
                for (a, &(i, j)) in acc.iter_mut().zip(&pairs) {
                    *a += o[i] * o[j];
                }
            }
            for (a, &(i, j)) in acc.iter().zip(&pairs) {
                self.sums[i * N + j].close(*a, end - k);
            }
            k = end;
        }
    }

    /// [`Gram::add`] for any number of models.
    fn add_any(&mut self, base: &[f32], models: &[&[f32]], span: Range<usize>) {
        let n = self.n;
        let pairs: Vec<(usize, usize)> = (0..n).flat_map(|i| (i..n).map(move |j| (i, j))).collect();
        let mut acc = vec![0f64; pairs.len()];
        let mut k = span.start;
        while k < span.end {
            let end = span.end.min(k + self.sums[0].room());
            for (a, &(i, j)) in acc.iter_mut().zip(&pairs) {
                *a = self.sums[i * n + j].open();
            }
            for e in k..end {
                for (o, m) in self.offsets.iter_mut().zip(models) {
                    *o = m[e] as f64 - base[e] as f64;
                }
                for (a, &(i, j)) in acc.iter_mut().zip(&pairs) {
                    *a += self.offsets[i] * self.offsets[j];
                }
            }
            for (a, &(i, j)) in acc.iter().zip(&pairs) {
                self.sums[i * n + j].close(*a, end - k);
            }
            k = end;
        }
    }

    /// `t` from the Gram matrix.
    fn interpolation(&self) -> f64 {
        let (gram, n) = (&self.sums, self.n);
        let norm = |i: usize| gram[i * n + i].value().sqrt();
        let mut cos = BlockSum::default();
        for i in 0..n {
            for j in i + 1..n {
                let product = norm(i) * norm(j);
                let floor = if product < 1e-6 { 1e-6 } else { product };
                cos.add((gram[i * n + j].value() / floor).clamp(-1.0, 1.0));
            }
        }
        let cos = cos.value() / (n * (n - 1) / 2) as f64;
        let denominator = 1.0 + (n as f64 - 1.0) * cos;
        if denominator.abs() < 1e-6 {
            0.0
        } else {
            n as f64 * cos / denominator
        }
    }
}

/// model_stock a chunk at a time: one pass sums the Gram matrix of the whole tensor; with
/// `filter_wise` chunks hold whole rows and need no pass.
#[derive(Debug)]
pub struct ModelStockSurvey {
    row: usize,
    filter_wise: bool,
    gram: Gram,
    t: f64,
}

/// The [`Survey`] of one tensor.
pub fn survey(s: &Setting) -> Result<Box<dyn Survey>, String> {
    model_count("model_stock", s.models.len(), 2, usize::MAX)?;
    let len = s.shape.iter().product();
    Ok(Box::new(ModelStockSurvey {
        row: row_length(s.global, s.shape, len),
        filter_wise: s.global.flag("filter_wise", false),
        gram: Gram::new(s.models.len()),
        t: 0.0,
    }))
}

impl Survey for ModelStockSurvey {
    fn passes(&self) -> usize {
        usize::from(!self.filter_wise)
    }

    fn granule(&self) -> usize {
        if self.filter_wise {
            self.row
        } else {
            1
        }
    }

    fn observe(&mut self, _pass: usize, chunk: &Chunk) -> Result<(), String> {
        let (_, base, models) = (chunk.start, chunk.base, chunk.models);
        self.gram.add(base, models, 0..base.len());
        Ok(())
    }

    fn end_pass(&mut self, _pass: usize) -> Result<(), String> {
        self.t = self.gram.interpolation();
        Ok(())
    }

    /// Row by row (`filter_wise`) each row finds its own `t`, on the CPU.
    fn blend(&self) -> Option<Blend> {
        (!self.filter_wise).then(|| Blend {
            kind: BlendKind::ModelStock,
            coefs: vec![self.t],
        })
    }

    fn merge(&self, chunk: &Chunk, out: &mut [f32]) -> Result<(), String> {
        let (_, base, models) = (chunk.start, chunk.base, chunk.models);
        if self.filter_wise {
            rows(base, models, self.row, out);
        } else {
            blend(self.t, base, models, 0..out.len(), out);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::super::support::run_plain;
    use super::*;

    fn run(base: &[f32], inputs: &[&[f32]], global: &Params) -> Result<Vec<f32>, String> {
        run_plain(model_stock, base, inputs, global)
    }

    /// The fixed-size Gram sums add what the general loop adds, in its order, over spans that
    /// start and end mid-block.
    #[test]
    fn fixed_size_gram_sums_are_the_general_ones() {
        use super::super::uniform;
        let len = 3 * BlockSum::default().room() + 17;
        for n in 1..=6usize {
            let draw = |m: u64| -> Vec<f32> {
                (0..len)
                    .map(|j| (uniform(n as u64, m, j as u64) * 2.0 - 1.0) as f32)
                    .collect()
            };
            let base = draw(99);
            let models: Vec<Vec<f32>> = (0..n as u64).map(draw).collect();
            let models: Vec<&[f32]> = models.iter().map(Vec::as_slice).collect();
            let (mut fixed, mut any) = (Gram::new(n), Gram::new(n));
            for span in [0..5, 5..len / 2, len / 2..len / 2, len / 2..len] {
                fixed.add(&base, &models, span.clone());
                any.add_any(&base, &models, span);
            }
            let bits = |g: &Gram| {
                g.sums
                    .iter()
                    .map(|s| s.value().to_bits())
                    .collect::<Vec<_>>()
            };
            assert_eq!(bits(&fixed), bits(&any), "{n} models");
        }
    }

    #[test]
    fn every_chunking_merges_the_bytes_the_whole_tensor_does() {
        use super::super::survey::testing::Case;
        use super::super::uniform;
        for trial in 0..12u64 {
            let (rows, cols) = (2 + trial as usize % 5, 3 + trial as usize % 7);
            let len = rows * cols;
            let draw = |m: u64| -> Vec<f32> {
                (0..len)
                    .map(|j| (uniform(trial, m, j as u64) * 8.0 - 4.0) as f32)
                    .collect()
            };
            let base = draw(9);
            let models: Vec<Vec<f32>> = (0..2 + trial % 3).map(draw).collect();
            let params = vec![Params::default(); models.len()];
            let global = Params::default().with("filter_wise", (trial % 2) as f64);
            let case = Case {
                whole: model_stock,
                make: survey,
                base: &base,
                models: &models,
                params: &params,
                global: &global,
                shape: &[rows, cols],
                seed: 0,
            };
            assert!(case.compare(&format!("trial {trial}")));
        }
    }

    #[test]
    fn orthogonal_offsets_keep_the_base_and_equal_ones_take_the_average() {
        let none = Params::default();
        // cos θ = 0 → t = 0.
        assert_eq!(
            run(&[1.0, 1.0], &[&[2.0, 1.0], &[1.0, 2.0]], &none).unwrap(),
            [1.0, 1.0]
        );
        // cos θ = 1 → t = 1.
        assert_eq!(
            run(&[1.0, 1.0], &[&[2.0, 3.0], &[2.0, 3.0]], &none).unwrap(),
            [2.0, 3.0]
        );
        // Opposite offsets: 1 + (N − 1) cos θ = 0, the base is kept.
        assert_eq!(
            run(&[1.0, 1.0], &[&[2.0, 3.0], &[0.0, -1.0]], &none).unwrap(),
            [1.0, 1.0]
        );
        // No offsets at all: cos θ = 0.
        assert_eq!(
            run(&[1.0, 2.0], &[&[1.0, 2.0], &[1.0, 2.0]], &none).unwrap(),
            [1.0, 2.0]
        );
        let out = run(&[1.0, 1.0], &[&[2.0, f32::NAN], &[1.0, 2.0]], &none).unwrap();
        assert!(out.iter().all(|x| x.is_nan()), "{out:?}");
        let err = run(&[1.0], &[&[2.0]], &none).unwrap_err();
        assert_eq!(
            err,
            "model_stock needs at least 2 models besides the base, got 1"
        );
    }
}
