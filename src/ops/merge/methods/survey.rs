//! Whole-tensor methods that stream: a tensor too big for one chunk is merged chunk by chunk
//! from statistics gathered in passes over it (the magnitude thresholds of TIES and
//! breadcrumbs, the L1 norms of rescaling, model_stock's angles), so memory stays within the
//! budget whatever the tensor's size.
//!
//! A method's [`Survey`] must merge every chunk exactly as the whole-tensor function merges
//! the same elements: the statistics are the same sums in the same order (running sums carried
//! from chunk to chunk), the same ranks with the same tie order. The tests in each method's
//! file compare the two on tie-heavy data for several chunkings.

use std::fmt::Debug;

use super::{Inputs, Params};

/// One tensor's statistics and its merge from them. The engine calls [`Survey::observe`] for
/// every chunk of pass 0 in order, then [`Survey::end_pass`], then pass 1 …, and finally
/// [`Survey::merge`] for each chunk (in any order, from several threads).
pub trait Survey: Send + Sync + Debug {
    /// Passes over the tensor before any chunk merges (0: chunks merge on their own).
    fn passes(&self) -> usize;
    /// Chunks start and end at multiples of this many elements (rows a method ranks within).
    fn granule(&self) -> usize {
        1
    }
    /// Pass `pass` sees `chunk`.
    fn observe(&mut self, _pass: usize, _chunk: &Chunk) -> Result<(), String> {
        Ok(())
    }
    /// Every chunk of pass `pass` has been seen.
    fn end_pass(&mut self, _pass: usize) -> Result<(), String> {
        Ok(())
    }
    /// Merges `chunk` into `out`.
    fn merge(&self, chunk: &Chunk, out: &mut [f32]) -> Result<(), String>;
}

/// Elements `start..` of a tensor: of the base (empty when the tensor has none) and of each
/// model, in config order.
#[derive(Clone, Copy, Debug)]
pub struct Chunk<'a> {
    pub start: usize,
    pub base: &'a [f32],
    pub models: &'a [&'a [f32]],
}

/// What a streaming method sets a tensor's survey up from: the shared parameters, each
/// model's (base apart, config order), the shape and the tensor's random stream.
#[derive(Clone, Copy, Debug)]
pub struct Setting<'a> {
    pub global: &'a Params,
    pub models: &'a [Params],
    pub shape: &'a [usize],
    pub seed: u64,
}

/// Sets up one tensor's survey; parameters the method refuses are refused here with the
/// whole-tensor function's message.
pub type SurveyFn = fn(&Setting) -> Result<Box<dyn Survey>, String>;

/// Merges the whole tensor `t` as one chunk through the survey `make` sets up: every pass
/// over it, then the merge. The whole-tensor form of a method whose streamed form is its only
/// arithmetic: the same sums, the same bytes.
pub(crate) fn merge_whole(make: SurveyFn, t: &Inputs, out: &mut [f32]) -> Result<(), String> {
    let params: Vec<Params> = t.models.iter().map(|m| m.params.clone()).collect();
    let mut survey = make(&Setting {
        global: t.global,
        models: &params,
        shape: t.shape,
        seed: t.seed,
    })?;
    let values: Vec<&[f32]> = t.models.iter().map(|m| m.values).collect();
    let chunk = Chunk {
        start: 0,
        base: t.base,
        models: &values,
    };
    for pass in 0..survey.passes() {
        survey.observe(pass, &chunk)?;
        survey.end_pass(pass)?;
    }
    survey.merge(&chunk, out)
}

/// The first non-finite value among `base` then each model (as the whole-tensor check names
/// it, element numbers counted from the tensor's start).
pub(crate) fn check_finite(start: usize, base: &[f32], models: &[&[f32]]) -> Result<(), String> {
    finite_values("base", start, base)?;
    for (i, m) in models.iter().enumerate() {
        finite_values(&format!("models[{i}]"), start, m)?;
    }
    Ok(())
}

/// Refuses the first non-finite value of input `name`'s elements from `start`.
pub(crate) fn finite_values(name: &str, start: usize, values: &[f32]) -> Result<(), String> {
    match values.iter().position(|v| !v.is_finite()) {
        Some(j) => Err(format!(
            "{name} has a non-finite value ({}) at element {}",
            values[j],
            start + j
        )),
        None => Ok(()),
    }
}

#[cfg(test)]
pub(crate) mod testing {
    use super::*;
    use crate::ops::merge::methods::ModelTensor;
    use crate::ops::merge::spec::WholeTensorFn;

    /// Runs `survey` over `chunk`-element chunks (rounded up to its granule) and merges each.
    pub fn chunked(
        mut survey: Box<dyn Survey>,
        base: &[f32],
        models: &[&[f32]],
        chunk: usize,
    ) -> Result<Vec<f32>, String> {
        let len = models[0].len();
        let g = survey.granule().max(1);
        let step = chunk.div_ceil(g).max(1) * g;
        // Each chunk's slices of the inputs (the base stays empty when there is none).
        let parts: Vec<_> = (0..len)
            .step_by(step)
            .map(|s| {
                let e = (s + step).min(len);
                let b = if base.is_empty() { base } else { &base[s..e] };
                (s, b, models.iter().map(|v| &v[s..e]).collect::<Vec<_>>())
            })
            .collect();
        let chunks: Vec<Chunk> = (parts.iter())
            .map(|(start, base, models)| Chunk {
                start: *start,
                base,
                models,
            })
            .collect();
        for pass in 0..survey.passes() {
            for chunk in &chunks {
                survey.observe(pass, chunk)?;
            }
            survey.end_pass(pass)?;
        }
        let mut out = vec![0f32; len];
        // Merged last chunk first: chunks must not depend on the order they are merged in.
        for chunk in chunks.iter().rev() {
            let span = chunk.start..chunk.start + chunk.models[0].len();
            survey.merge(chunk, &mut out[span])?;
        }
        Ok(out)
    }

    /// `models` as the whole-tensor functions take them.
    pub fn tensors<'a>(models: &'a [Vec<f32>], params: &'a [Params]) -> Vec<ModelTensor<'a>> {
        models
            .iter()
            .zip(params)
            .map(|(v, p)| ModelTensor {
                values: v,
                params: p,
            })
            .collect()
    }

    /// One tensor merged by a streamed method, whole and chunked.
    pub struct Case<'a> {
        pub whole: WholeTensorFn,
        pub make: SurveyFn,
        pub base: &'a [f32],
        pub models: &'a [Vec<f32>],
        pub params: &'a [Params],
        pub global: &'a Params,
        pub shape: &'a [usize],
        pub seed: u64,
    }

    impl Case<'_> {
        /// Asserts that every chunking merges the whole-tensor function's bytes, or that the
        /// survey refuses what the function refuses, with its message; `true` when compared.
        pub fn compare(&self, label: &str) -> bool {
            let len = self.models[0].len();
            let mut want = vec![0f32; len];
            let tensors = tensors(self.models, self.params);
            let (global, shape, seed) = (self.global, self.shape, self.seed);
            let inputs = Inputs {
                base: self.base,
                models: &tensors,
                global,
                shape,
                seed,
            };
            let whole = (self.whole)(&inputs, &mut want);
            let setting = Setting {
                global,
                models: self.params,
                shape,
                seed,
            };
            let make = || (self.make)(&setting);
            if let Err(e) = whole {
                assert_eq!(
                    make().unwrap_err(),
                    e,
                    "{label}: the survey must refuse alike"
                );
                return false;
            }
            let views: Vec<&[f32]> = self.models.iter().map(Vec::as_slice).collect();
            let cols = shape.last().copied().unwrap_or(1);
            for chunk in [1, 2, 3, 5, cols, len.saturating_sub(1).max(1), len] {
                let got = chunked(make().unwrap(), self.base, &views, chunk).unwrap();
                let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(&got), bits(&want), "{label}, chunk {chunk}");
            }
            true
        }
    }
}
