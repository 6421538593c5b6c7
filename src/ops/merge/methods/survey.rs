//! Whole-tensor methods that stream: a tensor too big for one chunk is merged chunk by chunk
//! from statistics gathered in passes over it (the magnitude thresholds of TIES and
//! breadcrumbs, the L1 norms of rescaling, model_stock's angles), so memory stays within the
//! budget whatever the tensor's size.
//!
//! A method's [`Survey`] must merge every chunk exactly as the whole-tensor function merges
//! the same elements: the statistics are the same sums in the same order (running sums carried
//! from chunk to chunk), the same ranks with the same tie order. The tests in each method's
//! file compare the two on tie-heavy data for several chunkings.

use std::any::Any;
use std::fmt::Debug;
use std::ops::Range;

use super::{Inputs, Params};

/// Lets [`Survey::join`] take a fork back as its own type.
pub trait AsAny: Any + Send {
    fn into_any(self: Box<Self>) -> Box<dyn Any + Send>;
}

impl<T: Any + Send> AsAny for T {
    fn into_any(self: Box<Self>) -> Box<dyn Any + Send> {
        self
    }
}

/// One tensor's statistics and its merge from them. The engine calls [`Survey::observe`] for
/// every chunk of pass 0 in order, then [`Survey::end_pass`], then pass 1 …, and finally
/// [`Survey::merge`] for each chunk (in any order, from several threads).
///
/// A pass whose statistics are sums of per-element terms (or per-row values kept in order) can
/// also be observed on several threads at once: [`Survey::fork_span`] says how it may be cut,
/// [`Survey::fork`] makes an empty survey for one piece, and [`Survey::join`] takes the pieces
/// back in order. The result must be the one a single thread observing in order gets, bit for
/// bit ([`observe_split`] does the cutting; the methods' tests compare both).
pub trait Survey: AsAny + Sync + Debug {
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
    /// `Some(span)` when pass `pass` may be observed in pieces of `span` elements (a multiple
    /// of the granule) that start at multiples of `span` from the tensor's start, each by its
    /// own [`Survey::fork`].
    fn fork_span(&self, _pass: usize) -> Option<usize> {
        None
    }
    /// An empty survey that observes, in pass `pass`, the piece starting at element `start`.
    fn fork(&self, _pass: usize, _start: usize) -> Option<Box<dyn Survey>> {
        None
    }
    /// Takes in a fork of this survey that observed the piece right after everything this
    /// survey has seen of the pass.
    fn join(&mut self, _pass: usize, _fork: Box<dyn Survey>) {}
    /// Merges `chunk` into `out`.
    fn merge(&self, chunk: &Chunk, out: &mut [f32]) -> Result<(), String>;
    /// The merge as a [`Blend`] the GPU computes, when it is one.
    fn blend(&self) -> Option<Blend> {
        None
    }
    /// Whether this tensor's chunks can be blends once surveyed, asked of a fresh survey
    /// (whether a run has GPU work at all).
    fn may_blend(&self) -> bool {
        self.blend().is_some()
    }
}

/// A surveyed merge whose chunks merge element by element from what its survey fixed, as
/// `tftf_merge` computes it (kernels/merge.cuh) and [`Survey::merge`] does: each input an f32,
/// the formula in f64, rounded to f32.
#[derive(Clone, Debug, PartialEq)]
pub struct Blend {
    pub kind: BlendKind,
    /// What the survey fixed, laid out as [`BlendKind`] says for each formula.
    pub coefs: Vec<f64>,
}

impl Blend {
    /// A blend of `kind` whose coefficients are `head` then `tail`.
    pub fn of(kind: BlendKind, head: &[f64], tail: &[f64]) -> Blend {
        Blend {
            kind,
            coefs: [head, tail].concat(),
        }
    }
}

/// The formula of a [`Blend`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BlendKind {
    /// slerp's `ca · base + cb · model`, `coefs` = `[ca, cb]`.
    Slerp,
    /// nuslerp's `back + ca (a − back) + cb (b − back)` (`back` the base, or 0), `coefs` =
    /// `(ca, cb)` of each column, flattened: element `i` takes pair `i mod (len / 2)`.
    Nuslerp,
    /// multislerp's exponential map of the weighted tangent at the models' mean, `coefs` =
    /// each model's mean factor, weight, norm + eps and dot product with the mean, then the
    /// mean's length, the map's two factors, and 1 when two models average linearly (else 0).
    Multislerp,
    /// model_stock's `t · mean(models) + (1 − t) · base`, `coefs` = `[t]`.
    ModelStock,
    /// karcher's `Σ c_i · model_i` over the kept models, `coefs` = `[i, c_i]` pairs.
    Karcher,
    /// nearswap's per-element interpolation, `coefs` = `[t]`.
    Nearswap,
    /// ram's (and ramplus_tl's) rescaled task vectors, `coefs` = `[epsilon, 1 when each
    /// model's unique changes are scaled (ramplus_tl) else 0, the scales…]`.
    Ram,
    /// arcee_fusion's choice between the model's and the base's element by importance,
    /// `coefs` = `[threshold, row length, each row's divergence…]`.
    Fusion,
    /// The generalized task arithmetic (TIES, breadcrumbs, DARE, DELLA): each model's survivors,
    /// rescaled, weighted, sign-elected or summed. `coefs` = `[seed's low 32 bits, high 32
    /// bits, consensus, normalize, lambda, linear divisor]`, then per model `[keep (0 all,
    /// 1 nothing, 2 ranked, 3 drawn, 4 DELLA), low key or epsilon, low limit or density, high
    /// key or row length, high limit or row stride, scale, weight]`.
    Sparse,
    /// SCE's erase over the selected elements, `coefs` = `[1 when a variance cut selects (else
    /// 0), the cut's key, its position limit, each model's weight…]`.
    Sce,
}

/// Elements `start..` of a tensor: of the base (empty when the tensor has none) and of each
/// model, in config order.
#[derive(Clone, Copy, Debug)]
pub struct Chunk<'a> {
    pub start: usize,
    pub base: &'a [f32],
    pub models: &'a [&'a [f32]],
}

/// What [`observe_split`] calls: a survey sees the tensor's elements in a range.
pub type ObserveFn<'a> = dyn Fn(&mut dyn Survey, Range<usize>) -> Result<(), String> + Sync + 'a;

/// Observes pass `pass` of `survey` over the tensor's elements `range`, calling `observe` with
/// a survey and the elements it is to see (a whole number of granules). With `threads > 1` and
/// a survey that forks, the range after its first `span` boundary is cut into spans, each
/// observed by its own fork, a contiguous run of spans per thread, and the forks are joined in
/// order: the statistics do not depend on the thread count.
pub fn observe_split(
    survey: &mut Box<dyn Survey>,
    pass: usize,
    range: Range<usize>,
    threads: usize,
    observe: &ObserveFn,
) -> Result<(), String> {
    let span = match survey.fork_span(pass) {
        Some(span) if threads > 1 && span > 0 => span,
        _ => return observe(survey.as_mut(), range),
    };
    let first = range.start.next_multiple_of(span).min(range.end);
    if first > range.start {
        observe(survey.as_mut(), range.start..first)?;
    }
    let spans: Vec<Range<usize>> = (first..range.end)
        .step_by(span)
        .map(|s| s..(s + span).min(range.end))
        .collect();
    let forks: Option<Vec<Box<dyn Survey>>> =
        spans.iter().map(|r| survey.fork(pass, r.start)).collect();
    let Some(mut forks) = forks else {
        return observe(survey.as_mut(), first..range.end);
    };
    let per = spans.len().div_ceil(threads).max(1);
    std::thread::scope(|scope| {
        let running: Vec<_> = (forks.chunks_mut(per).zip(spans.chunks(per)))
            .map(|(forks, spans)| {
                scope.spawn(move || {
                    (forks.iter_mut().zip(spans))
                        .try_for_each(|(fork, r)| observe(fork.as_mut(), r.clone()))
                })
            })
            .collect();
        running.into_iter().try_for_each(|t| {
            t.join()
                .unwrap_or_else(|_| Err("internal error: a survey thread panicked".into()))
        })
    })?;
    for fork in forks {
        survey.join(pass, fork);
    }
    Ok(())
}

/// `fork` (made by [`Survey::fork`] of a survey of type `T`) as that type.
pub fn fork_of<T: Survey>(fork: Box<dyn Survey>) -> Box<T> {
    fork.into_any()
        .downcast::<T>()
        .unwrap_or_else(|_| panic!("joined a fork of another survey type"))
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

    /// Runs `survey` over `chunk`-element chunks (rounded up to its granule) and merges each;
    /// each chunk's passes observed on `threads` threads where the survey forks.
    pub fn chunked(
        mut survey: Box<dyn Survey>,
        base: &[f32],
        models: &[&[f32]],
        chunk: usize,
        threads: usize,
    ) -> Result<Vec<f32>, String> {
        let len = models[0].len();
        let g = survey.granule().max(1);
        let step = chunk.div_ceil(g).max(1) * g;
        let slices = |r: &Range<usize>| {
            let b = if base.is_empty() {
                base
            } else {
                &base[r.clone()]
            };
            (b, models.iter().map(|v| &v[r.clone()]).collect::<Vec<_>>())
        };
        let observe_range = |pass: usize| {
            move |s: &mut dyn Survey, r: Range<usize>| {
                let (base, models) = slices(&r);
                let chunk = Chunk {
                    start: r.start,
                    base,
                    models: &models,
                };
                s.observe(pass, &chunk)
            }
        };
        let ranges: Vec<Range<usize>> = (0..len)
            .step_by(step)
            .map(|s| s..(s + step).min(len))
            .collect();
        for pass in 0..survey.passes() {
            for r in &ranges {
                observe_split(&mut survey, pass, r.clone(), threads, &observe_range(pass))?;
            }
            survey.end_pass(pass)?;
        }
        let mut out = vec![0f32; len];
        // Merged last chunk first: chunks must not depend on the order they are merged in.
        for r in ranges.iter().rev() {
            let (base, models) = slices(r);
            let chunk = Chunk {
                start: r.start,
                base,
                models: &models,
            };
            survey.merge(&chunk, &mut out[r.clone()])?;
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
                for threads in [1, 3] {
                    let got = chunked(make().unwrap(), self.base, &views, chunk, threads).unwrap();
                    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                    assert_eq!(
                        bits(&got),
                        bits(&want),
                        "{label}, chunk {chunk}, {threads} threads"
                    );
                }
            }
            true
        }
    }
}
