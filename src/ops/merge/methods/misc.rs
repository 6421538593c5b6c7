//! The element-wise and mask-based methods of mergekit 0.1.5: `nearswap`, `arcee_fusion`, `ram`
//! and `ramplus_tl`.
//!
//! mergekit computes their differences, masks and sums in the input dtype (so a `bf16` task
//! vector is rounded before it is compared with `epsilon`); we compute each in `f64` from the
//! exact differences and round once. NaN inputs give NaN exactly where mergekit's do.

use super::support::{
    base_model_and_t, clamp_min, model_count, optional, required, same_lengths, shape_holds,
    split_axis, torch_clamp, BlockSum,
};
use super::survey::{fork_of, merge_whole, Blend, BlendKind, Chunk, Setting, Survey};
use super::{uniform, unparameterised, Inputs, ModelTensor, Params};

/// mergekit's nearswap: `base` and one model; each element moves from the base towards the
/// model by `clamp(t / max(|base − model|, 1e-6), 0, 1)`, so values closer than `t` (required)
/// take the model's value and others move by `t`.
pub fn nearswap(t: &Inputs, out: &mut [f32]) -> Result<(), String> {
    let (base, model, t) = base_model_and_t("nearswap", t, out)?;
    for ((o, &a), &b) in out.iter_mut().zip(base).zip(model) {
        let (a, b) = (a as f64, b as f64);
        let weight = (t / clamp_min((a - b).abs(), 1e-6)).clamp(0.0, 1.0);
        *o = (weight * b + (1.0 - weight) * a) as f32;
    }
    Ok(())
}

/// Elements above which arcee_fusion estimates its quantiles from a sample (mergekit's
/// `_QUANTILE_SAMPLE_SIZE`).
pub const FUSION_SAMPLE: usize = 1_000_000;

/// mergekit's arcee_fusion: `base` and one model. Each element's importance is
/// `|model − base|` times its row's KL divergence `Σ p log(p / q)` between the softmaxes
/// (along the last axis, plus 1e-8) of the model's and the base's row; elements whose
/// importance reaches `median + 1.5 (q₃ − q₁)` take the model's value, the others keep the
/// base's. Quantile `q` is element `⌊q (m − 1)⌋` of the `m` sorted importances (NaN last);
/// above [`FUSION_SAMPLE`] elements they come from that many elements drawn with replacement
/// through [`uniform`]`(seed, 0, draw)`, as mergekit draws them with `torch.randint`.
pub fn arcee_fusion(t: &Inputs, out: &mut [f32]) -> Result<(), String> {
    model_count("arcee_fusion", t.models.len(), 1, 1)?;
    same_lengths(Some(t.base), t.models, out)?;
    shape_holds(t.shape, out.len())?;
    merge_whole(fusion_survey, t, out)
}

/// arcee_fusion a chunk at a time, chunks holding whole rows: one pass takes each row's KL
/// divergence and the importances the threshold comes from (every element's, or those of the
/// elements drawn above [`FUSION_SAMPLE`]); each element then merges on its own. Rows are
/// independent, so the pass runs on several threads, a run of rows per fork, the forks' rows
/// and importances appended in order.
#[derive(Debug)]
pub struct FusionSurvey {
    row: usize,
    /// The drawn elements, sorted, repeats kept (`None` at or below [`FUSION_SAMPLE`]), and
    /// how many a pass has seen.
    drawn: Option<std::sync::Arc<[usize]>>,
    seen: usize,
    /// Each row's divergence, in order, from row `first_row` (0 but in a fork).
    kl: Vec<f64>,
    first_row: usize,
    importances: Vec<f64>,
    threshold: f64,
}

/// The [`Survey`] of one arcee_fusion tensor.
pub fn fusion_survey(s: &Setting) -> Result<Box<dyn Survey>, String> {
    let (models, shape, seed) = (s.models, s.shape, s.seed);
    model_count("arcee_fusion", models.len(), 1, 1)?;
    let n: usize = shape.iter().product();
    let drawn = (n > FUSION_SAMPLE).then(|| {
        let mut v: Vec<usize> = (0..FUSION_SAMPLE as u64)
            .map(|d| ((uniform(seed, 0, d) * n as f64) as usize).min(n - 1))
            .collect();
        v.sort_unstable();
        v.into()
    });
    Ok(Box::new(FusionSurvey {
        row: split_axis(shape, shape.len().saturating_sub(1)).1.max(1),
        drawn,
        seen: 0,
        kl: Vec::new(),
        first_row: 0,
        importances: Vec::new(),
        threshold: 0.0,
    }))
}

impl FusionSurvey {
    fn importance(&self, k: usize, base: f32, model: f32) -> f64 {
        (model as f64 - base as f64).abs() * self.kl[k / self.row - self.first_row]
    }
}

impl Survey for FusionSurvey {
    fn passes(&self) -> usize {
        1
    }
    fn granule(&self) -> usize {
        self.row
    }
    fn fork_span(&self, _: usize) -> Option<usize> {
        // Whole rows, about 64K elements: a fork costs little beside its rows' work.
        Some((1usize << 16).div_ceil(self.row) * self.row)
    }
    fn fork(&self, _: usize, start: usize) -> Option<Box<dyn Survey>> {
        Some(Box::new(FusionSurvey {
            row: self.row,
            drawn: self.drawn.clone(),
            seen: self
                .drawn
                .as_ref()
                .map_or(0, |d| d.partition_point(|&k| k < start)),
            kl: Vec::new(),
            first_row: start / self.row,
            importances: Vec::new(),
            threshold: 0.0,
        }))
    }
    fn join(&mut self, _: usize, fork: Box<dyn Survey>) {
        let fork = fork_of::<Self>(fork);
        self.kl.extend_from_slice(&fork.kl);
        self.importances.extend_from_slice(&fork.importances);
        self.seen = fork.seen;
    }
    fn observe(&mut self, _: usize, chunk: &Chunk) -> Result<(), String> {
        let (start, base, model) = (chunk.start, chunk.base, chunk.models[0]);
        let row = self.row;
        (base.chunks(row).zip(model.chunks(row))).for_each(|(b, m)| self.kl.push(divergence(m, b)));
        let end = start + model.len();
        match &self.drawn {
            None => {
                for k in start..end {
                    let v = self.importance(k, base[k - start], model[k - start]);
                    self.importances.push(v);
                }
            }
            Some(drawn) => {
                while self.seen < drawn.len() && drawn[self.seen] < end {
                    let k = drawn[self.seen];
                    let v = self.importance(k, base[k - start], model[k - start]);
                    self.importances.push(v);
                    self.seen += 1;
                }
            }
        }
        Ok(())
    }
    fn end_pass(&mut self, _: usize) -> Result<(), String> {
        if !self.importances.is_empty() {
            self.threshold = quantile_threshold(std::mem::take(&mut self.importances));
        }
        self.drawn = None;
        Ok(())
    }
    fn blend(&self) -> Option<Blend> {
        let head = [self.threshold, self.row as f64];
        Some(Blend::of(BlendKind::Fusion, &head, &self.kl))
    }
    fn merge(&self, chunk: &Chunk, out: &mut [f32]) -> Result<(), String> {
        let (start, base, model) = (chunk.start, chunk.base, chunk.models[0]);
        for (j, o) in out.iter_mut().enumerate() {
            let (b, m) = (base[j], model[j]);
            let keep = if self.importance(start + j, b, m) >= self.threshold {
                1.0
            } else {
                0.0
            };
            *o = (b as f64 + (m as f64 - b as f64) * keep) as f32;
        }
        Ok(())
    }
}

/// `median + 1.5 (q₃ − q₁)` of `importance` over `0..n`, from `sample` draws above that many
/// elements.
#[cfg(test)]
fn fusion_threshold(importance: &dyn Fn(usize) -> f64, n: usize, seed: u64, sample: usize) -> f64 {
    let values: Vec<f64> = if n > sample {
        (0..sample as u64)
            .map(|d| importance(((uniform(seed, 0, d) * n as f64) as usize).min(n - 1)))
            .collect()
    } else {
        (0..n).map(importance).collect()
    };
    quantile_threshold(values)
}

/// `median + 1.5 (q₃ − q₁)` of `values` (NaNs last): the three order statistics a sort would
/// put at those places, found by selection (linear time; a full sort of a million values was
/// most of arcee_fusion's time).
fn quantile_threshold(mut values: Vec<f64>) -> f64 {
    let order = |a: &f64, b: &f64| match (a.is_nan(), b.is_nan()) {
        (false, false) => a.total_cmp(b),
        (x, y) => x.cmp(&y),
    };
    let at = |q: f64| (q * (values.len() - 1) as f64) as usize;
    let (i1, i2, i3) = (at(0.25), at(0.5), at(0.75));
    let (low, &mut median, high) = values.select_nth_unstable_by(i2, order);
    // Below the median's place lie the smaller values, above it the larger: q₁ and q₃ are
    // order statistics of those parts.
    let q1 = if i1 < i2 {
        *low.select_nth_unstable_by(i1, order).1
    } else {
        median
    };
    let q3 = if i3 > i2 {
        *high.select_nth_unstable_by(i3 - i2 - 1, order).1
    } else {
        median
    };
    median + 1.5 * (q3 - q1)
}

/// `Σ p log(p / q)` for `p = softmax(model) + 1e-8`, `q = softmax(base) + 1e-8`.
fn divergence(model: &[f32], base: &[f32]) -> f64 {
    thread_local! {
        /// Each row's `exp(x − max)` of the model and the base, computed once per element.
        static EXPS: std::cell::RefCell<(Vec<f64>, Vec<f64>)> = const { std::cell::RefCell::new((Vec::new(), Vec::new())) };
    }
    EXPS.with(|cell| {
        let (pe, qe) = &mut *cell.borrow_mut();
        let (ps, qs) = (softmax_terms(model, pe), softmax_terms(base, qe));
        let mut sum = BlockSum::default();
        for (&a, &b) in pe.iter().zip(qe.iter()) {
            let (p, q) = (a / ps + 1e-8, b / qs + 1e-8);
            sum.add(p * (p / q).ln());
        }
        sum.value()
    })
}

/// Fills `exps` with a row's `exp(x − max)` and returns their sum: the row's softmax is each
/// term over the sum.
fn softmax_terms(row: &[f32], exps: &mut Vec<f64>) -> f64 {
    let max = row.iter().fold(f64::NEG_INFINITY, |a, &x| a.max(x as f64));
    exps.clear();
    exps.extend(row.iter().map(|&x| (x as f64 - max).exp()));
    let mut sum = BlockSum::default();
    exps.iter().for_each(|&e| sum.add(e));
    sum.value()
}

/// mergekit's ram (Reinforced Agent Merging): `base` plus, per element, the task vector
/// `model − base` of the one model that changed it by more than `epsilon` (default 1e-5), or
/// the mean of those that did when several did; no change when none did.
pub fn ram(t: &Inputs, out: &mut [f32]) -> Result<(), String> {
    let epsilon = optional(t.global, "epsilon", 1e-5)?;
    rescaled_ram(t.base, t.models, epsilon, None, out)
}

/// mergekit's ramplus_tl: ram with each model's unique changes scaled by
/// `1 + r · clamp(ρ, 0, alpha)`, `ρ` being the model's count of changed elements that others
/// changed too over its count of elements only it changed (the latter at least `epsilon`), in
/// this tensor. Defaults: `r` 0.1, `alpha` 0.2, `epsilon` 1e-5; a negative `alpha` clamps every
/// `ρ` to it, as torch's `clamp` does. `ρ` and the scale are computed in f64 (the formula in
/// float64); mergekit computes them in f32 (integer counts divided by a float clamp make an
/// f32 tensor), a few ulps apart.
pub fn ramplus_tl(t: &Inputs, out: &mut [f32]) -> Result<(), String> {
    let (base, models, global) = (t.base, t.models, t.global);
    let r = optional(global, "r", 0.1)?;
    let alpha = optional(global, "alpha", 0.2)?;
    let epsilon = optional(global, "epsilon", 1e-5)?;
    same_lengths(Some(base), models, out)?;
    let values: Vec<&[f32]> = models.iter().map(|m| m.values).collect();
    let mut tally = RamTally::new(models.len());
    tally.add(base, &values, epsilon);
    rescaled_ram(
        base,
        models,
        epsilon,
        Some(&tally.lambda(r, alpha, epsilon)),
        out,
    )
}

/// ramplus_tl's counts per model: the changed elements some other model changed too, and
/// those only it changed.
#[derive(Clone, Debug)]
struct RamTally {
    shared: Vec<usize>,
    unique: Vec<usize>,
}

impl RamTally {
    fn new(models: usize) -> RamTally {
        RamTally {
            shared: vec![0; models],
            unique: vec![0; models],
        }
    }

    fn add(&mut self, base: &[f32], models: &[&[f32]], epsilon: f64) {
        let changed = |m: &[f32], k: usize| (m[k] as f64 - base[k] as f64).abs() > epsilon;
        for k in 0..base.len() {
            let count = models.iter().filter(|m| changed(m, k)).count();
            let tally = if count == 1 {
                &mut self.unique
            } else {
                &mut self.shared
            };
            for (i, m) in models.iter().enumerate() {
                if changed(m, k) {
                    tally[i] += 1;
                }
            }
        }
    }

    /// Each model's scale of its unique changes.
    fn lambda(&self, r: f64, alpha: f64, epsilon: f64) -> Vec<f64> {
        (self.shared.iter().zip(&self.unique))
            .map(|(&shared, &unique)| {
                let rho = shared as f64 / clamp_min(unique as f64, epsilon);
                1.0 + r * torch_clamp(rho, 0.0, alpha)
            })
            .collect()
    }
}

/// ram and ramplus_tl a chunk at a time: ram's elements are independent; ramplus_tl counts its
/// changes in one pass first.
#[derive(Debug)]
pub struct RamSurvey {
    epsilon: f64,
    /// ramplus_tl's `r` and `alpha`, its tally and the scales from it.
    plus: Option<(f64, f64)>,
    tally: RamTally,
    lambda: Vec<f64>,
}

/// The [`Survey`] of one ram tensor.
pub fn ram_survey(s: &Setting) -> Result<Box<dyn Survey>, String> {
    RamSurvey::boxed(s, None)
}

/// The [`Survey`] of one ramplus_tl tensor.
pub fn ramplus_tl_survey(s: &Setting) -> Result<Box<dyn Survey>, String> {
    let r = optional(s.global, "r", 0.1)?;
    let alpha = optional(s.global, "alpha", 0.2)?;
    RamSurvey::boxed(s, Some((r, alpha)))
}

impl RamSurvey {
    fn boxed(s: &Setting, plus: Option<(f64, f64)>) -> Result<Box<dyn Survey>, String> {
        Ok(Box::new(RamSurvey {
            epsilon: optional(s.global, "epsilon", 1e-5)?,
            plus,
            tally: RamTally::new(s.models.len()),
            lambda: vec![],
        }))
    }
}

impl Survey for RamSurvey {
    fn passes(&self) -> usize {
        usize::from(self.plus.is_some())
    }
    fn observe(&mut self, _: usize, chunk: &Chunk) -> Result<(), String> {
        let (_, base, models) = (chunk.start, chunk.base, chunk.models);
        self.tally.add(base, models, self.epsilon);
        Ok(())
    }
    fn end_pass(&mut self, _: usize) -> Result<(), String> {
        if let Some((r, alpha)) = self.plus {
            self.lambda = self.tally.lambda(r, alpha, self.epsilon);
        }
        Ok(())
    }
    fn blend(&self) -> Option<Blend> {
        let plus = f64::from(u8::from(self.plus.is_some()));
        Some(Blend::of(
            BlendKind::Ram,
            &[self.epsilon, plus],
            &self.lambda,
        ))
    }
    fn merge(&self, chunk: &Chunk, out: &mut [f32]) -> Result<(), String> {
        let (_, base, models) = (chunk.start, chunk.base, chunk.models);
        let none = Params::default();
        let lambda = self.plus.map(|_| &self.lambda[..]);
        rescaled_ram(
            base,
            &unparameterised(models, &none),
            self.epsilon,
            lambda,
            out,
        )
    }
}

/// nearswap a chunk at a time: its elements are independent.
#[derive(Debug)]
pub struct NearswapSurvey {
    global: Params,
}

/// The [`Survey`] of one nearswap tensor.
pub fn nearswap_survey(s: &Setting) -> Result<Box<dyn Survey>, String> {
    model_count("nearswap", s.models.len(), 1, 1)?;
    required(s.global, "t")?;
    Ok(Box::new(NearswapSurvey {
        global: s.global.clone(),
    }))
}

impl Survey for NearswapSurvey {
    fn passes(&self) -> usize {
        0
    }
    fn merge(&self, chunk: &Chunk, out: &mut [f32]) -> Result<(), String> {
        let (_, base, models) = (chunk.start, chunk.base, chunk.models);
        let none = Params::default();
        let models = unparameterised(models, &none);
        nearswap(&Inputs::new(base, &models, &self.global, &[]), out)
    }
    fn blend(&self) -> Option<Blend> {
        Some(Blend {
            kind: BlendKind::Nearswap,
            coefs: vec![required(&self.global, "t").ok()?],
        })
    }
}

/// ram's sum, with each model's unique changes times `lambda` (ramplus_tl) when given. A NaN
/// task vector makes its element NaN (mergekit multiplies it by its zero mask).
fn rescaled_ram(
    base: &[f32],
    models: &[ModelTensor],
    epsilon: f64,
    lambda: Option<&[f64]>,
    out: &mut [f32],
) -> Result<(), String> {
    same_lengths(Some(base), models, out)?;
    for (k, o) in out.iter_mut().enumerate() {
        let b = base[k] as f64;
        let tv = |m: &ModelTensor| m.values[k] as f64 - b;
        let count = models.iter().filter(|m| tv(m).abs() > epsilon).count();
        let mut merged = 0.0;
        for (i, m) in models.iter().enumerate() {
            let keep = if tv(m).abs() > epsilon { 1.0 } else { 0.0 };
            let scale = match count {
                0 => 0.0,
                1 => lambda.map_or(1.0, |l| l[i]),
                c => 1.0 / c as f64,
            };
            merged += tv(m) * keep * scale;
        }
        *o = (b + merged) as f32;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    use super::super::support::run_plain as run;

    #[test]
    fn nearswap_takes_close_values_and_moves_others_by_t() {
        let t = Params::default().with("t", 0.5);
        let out = run(
            nearswap,
            &[0.0, 0.0, 0.0, 1.0],
            &[&[0.25, 2.0, -1.0, 1.0]],
            &t,
        )
        .unwrap();
        assert_eq!(out, [0.25, 0.5, -0.5, 1.0]);
        let out = run(nearswap, &[0.0, f32::NAN], &[&[0.25, 1.0]], &t).unwrap();
        assert_eq!(out[0], 0.25);
        assert!(out[1].is_nan());
        let err = run(nearswap, &[0.0], &[&[1.0]], &Params::default()).unwrap_err();
        assert_eq!(err, "missing parameter `t`");
    }

    #[test]
    fn ram_keeps_unique_changes_and_averages_shared_ones() {
        let none = Params::default();
        let base = [0.0, 0.0, 0.0, 0.0];
        let (a, b) = ([1.0, 1e-6, 1.0, f32::NAN], [0.0, 0.0, 3.0, 0.0]);
        let out = run(ram, &base, &[&a, &b], &none).unwrap();
        assert_eq!(out[..3], [1.0, 0.0, 2.0]);
        assert!(out[3].is_nan());
        // Model a changed one element alone and one with b: ρ = 1, λ = 1 + 0.1 · min(1, 0.2).
        let out = run(ramplus_tl, &base, &[&a, &b], &none).unwrap();
        assert_eq!(out[..3], [1.02, 0.0, 2.0]);
        let wide = none.clone().with("r", 1.0).with("alpha", 5.0);
        assert_eq!(run(ramplus_tl, &base, &[&a, &b], &wide).unwrap()[0], 2.0);
        // alpha < 0: torch's clamp(0, alpha) gives alpha, so λ = 1 + r · alpha.
        let crossed = none.clone().with("r", 1.0).with("alpha", -0.5);
        assert_eq!(run(ramplus_tl, &base, &[&a, &b], &crossed).unwrap()[0], 0.5);
        assert_eq!(run(ram, &base, &[], &none).unwrap(), base);
    }

    #[test]
    fn arcee_fusion_threshold_from_a_sample_keeps_the_same_fraction() {
        // Exponential importances: the exact threshold keeps e^-(ln 2 + 1.5 ln 3) ≈ 9.6 %.
        let n = 1_200_000;
        let importance = |k: usize| -(1.0 - uniform(99, 1, k as u64)).ln();
        let kept = |threshold: f64| {
            (0..n).filter(|&k| importance(k) >= threshold).count() as f64 / n as f64
        };
        let exact = kept(fusion_threshold(&importance, n, 0, n));
        assert!((exact - 0.0962).abs() < 0.002, "{exact}");
        let a = fusion_threshold(&importance, n, 7, FUSION_SAMPLE);
        assert_eq!(
            a.to_bits(),
            fusion_threshold(&importance, n, 7, FUSION_SAMPLE).to_bits()
        );
        let b = fusion_threshold(&importance, n, 8, FUSION_SAMPLE);
        assert_ne!(a, b);
        for sampled in [a, b] {
            // The sampled quantiles' error is ~1e-3 in kept fraction; allow 5 standard errors.
            assert!(
                (kept(sampled) - exact).abs() < 0.004,
                "{} vs {exact}",
                kept(sampled)
            );
        }
    }

    #[test]
    fn quantiles_by_selection_are_the_sorted_values_at_their_places() {
        for n in 1..60u64 {
            // Ties, signed zeros and NaNs, which sort last.
            let values: Vec<f64> = (0..n)
                .map(|k| match (uniform(n, 1, k) * 10.0) as u32 {
                    0 => f64::NAN,
                    1 => -0.0,
                    2 => 0.0,
                    v => (v % 4) as f64 - 1.5,
                })
                .collect();
            let mut sorted = values.clone();
            sorted.sort_by(|a, b| match (a.is_nan(), b.is_nan()) {
                (false, false) => a.total_cmp(b),
                (x, y) => x.cmp(&y),
            });
            let q = |p: f64| sorted[(p * (sorted.len() - 1) as f64) as usize];
            let want = q(0.5) + 1.5 * (q(0.75) - q(0.25));
            let got = quantile_threshold(values);
            assert!(
                got.to_bits() == want.to_bits() || (got.is_nan() && want.is_nan()),
                "{n}: {got} vs {want}"
            );
        }
    }

    #[test]
    fn arcee_fusion_above_the_sample_size_is_reproducible_and_picks_base_or_model() {
        let (rows, cols) = (1_100, 1_000);
        let base: Vec<f32> = (0..rows * cols)
            .map(|k| (uniform(1, 0, k as u64) - 0.5) as f32)
            .collect();
        let model: Vec<f32> = base
            .iter()
            .enumerate()
            .map(|(k, b)| {
                // Exponentially distributed changes, so the threshold keeps some (~10 %).
                let size = -0.01 * (1.0 - uniform(2, 0, k as u64)).ln();
                b + if k % 2 == 0 { size } else { -size } as f32
            })
            .collect();
        let none = Params::default();
        let fuse = |seed| {
            let mut out = vec![0.0; base.len()];
            let models = [ModelTensor {
                values: &model,
                params: &none,
            }];
            let shape = [rows, cols];
            let t = Inputs {
                seed,
                ..Inputs::new(&base, &models, &none, &shape)
            };
            arcee_fusion(&t, &mut out).unwrap();
            out
        };
        let first = fuse(3);
        assert_eq!(first, fuse(3));
        assert!(first
            .iter()
            .zip(&base)
            .zip(&model)
            .all(|((o, b), m)| o == b || o == m));
        let taken = first.iter().zip(&model).filter(|(o, m)| o == m).count();
        assert!(taken > base.len() / 20 && taken < base.len() / 5, "{taken}");
        // Streamed, its pass split over threads (forks start mid-chunk and part-way through
        // the drawn elements): the same bytes.
        let params = [none.clone()];
        let setting = Setting {
            global: &none,
            models: &params,
            shape: &[rows, cols],
            seed: 3,
        };
        for (chunk, threads) in [(250_000, 3), (rows * cols, 2)] {
            let survey = fusion_survey(&setting).unwrap();
            let got =
                super::super::survey::testing::chunked(survey, &base, &[&model], chunk, threads);
            assert!(
                got.unwrap() == first,
                "chunks of {chunk} on {threads} threads"
            );
        }
    }
}
