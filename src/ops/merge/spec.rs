//! mergekit 0.1.5's 20 merge methods: their parameters (name, scope, default) and what inputs
//! they accept (`merge_methods/registry.py` and each method's `spec`), and which arithmetic
//! computes each. A method whose arithmetic tftf lacks is still recognised, so its config is
//! checked, and refused by name.

use super::config::MergeConfig;
use super::methods::survey::SurveyFn;
use super::methods::Inputs;
use crate::format::dtype::DType;

/// Where a parameter is given: once for all models, per model, or per model except the base.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Scope {
    Shared,
    Input,
    NonBase,
}

/// One parameter of a method; `default: None` means required.
#[derive(Clone, Copy, Debug)]
pub struct ParamSpec {
    pub name: &'static str,
    pub scope: Scope,
    pub default: Option<f64>,
}

/// How a method treats the base model (mergekit's `BasePolicy`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Base {
    /// The base is one more input, like any other (`linear`, `karcher`).
    Ignored,
    Optional,
    Required,
}

/// A whole-tensor method, as the files under `methods/` define them: one tensor of every
/// input, and `out` to fill.
pub type WholeTensorFn = fn(&Inputs, &mut [f32]) -> Result<(), String>;

/// The arithmetic a method runs.
#[derive(Clone, Copy, Debug)]
pub enum Arithmetic {
    /// Weighted sum, chunked element by element (`methods/linear.rs`).
    Linear,
    /// Base plus weighted deltas, chunked (`methods/task_arithmetic.rs`).
    TaskArithmetic,
    /// One source's tensor, copied or scaled.
    Passthrough,
    /// Needs the whole tensor of every model (thresholds, norms, iterations).
    WholeTensor(WholeTensorFn),
}

#[derive(Debug)]
pub struct MethodSpec {
    pub name: &'static str,
    pub params: &'static [ParamSpec],
    pub base: Base,
    /// Inputs per tensor, base included: at least, at most.
    pub inputs: (usize, Option<usize>),
    pub arithmetic: Arithmetic,
    /// mergekit's result is at least f32 whatever the inputs' dtype (see
    /// [`MethodSpec::result_dtype`]).
    pub widens_to_f32: bool,
    /// How a whole-tensor method merges a tensor too big for one chunk, a chunk at a time;
    /// `None`: such a tensor is merged whole, outside the memory budget.
    pub survey: Option<SurveyFn>,
}

const fn p(name: &'static str, scope: Scope, default: Option<f64>) -> ParamSpec {
    ParamSpec {
        name,
        scope,
        default,
    }
}

use Scope::{Input, NonBase, Shared};

const LINEAR: &[ParamSpec] = &[p("weight", Input, None), p("normalize", Shared, Some(1.0))];

/// The generalized task arithmetic family's parameters, its `normalize` and `rescale` defaults
/// given per method.
macro_rules! gta {
    ($normalize:expr, $rescale:expr $(, $extra:expr)*) => {
        &[
            p("int8_mask", Shared, Some(0.0)),
            p("normalize", Shared, Some($normalize)),
            p("rescale", Shared, Some($rescale)),
            p("lambda", Shared, Some(1.0)),
            p("weight", NonBase, None),
            p("density", NonBase, Some(1.0)),
            $($extra,)*
        ]
    };
}

const fn method(
    name: &'static str,
    params: &'static [ParamSpec],
    base: Base,
    inputs: (usize, Option<usize>),
    arithmetic: Arithmetic,
) -> MethodSpec {
    MethodSpec {
        name,
        params,
        base,
        inputs,
        arithmetic,
        widens_to_f32: false,
        survey: None,
    }
}

/// `spec`, streaming big tensors through `survey`.
const fn streamed(spec: MethodSpec, survey: SurveyFn) -> MethodSpec {
    MethodSpec {
        survey: Some(survey),
        ..spec
    }
}

/// `spec`, whose mergekit result torch promotes to at least f32: arcee_fusion multiplies by a
/// `.float()` mask, ramplus_tl by a scale computed from integer counts (an f32 tensor).
const fn widening_to_f32(spec: MethodSpec) -> MethodSpec {
    MethodSpec {
        widens_to_f32: true,
        ..spec
    }
}

use super::methods::{karcher, misc, model_stock, sce, slerp, sparse, sparse_stream};
use Arithmetic::WholeTensor;
use Base::{Ignored, Optional, Required};

/// Member `K` of the generalized task arithmetic family ([`sparse::FAMILY`]), with its
/// parameters.
const fn gta<const K: usize>(params: &'static [ParamSpec]) -> MethodSpec {
    let whole = WholeTensor(sparse::whole::<K>);
    let spec = method(sparse::FAMILY[K].name, params, Required, (1, None), whole);
    streamed(spec, sparse_stream::survey::<K>)
}

const GAMMA: ParamSpec = p("gamma", NonBase, Some(0.01));
const EPSILON: ParamSpec = p("epsilon", NonBase, Some(0.15));

/// mergekit 0.1.5's registry, in its order: one method a row.
#[rustfmt::skip]
pub static METHODS: &[MethodSpec] = &[
    streamed(method("multislerp", &[p("weight", NonBase, None), p("normalize_weights", Shared, Some(1.0)), p("eps", Shared, Some(1e-8))], Optional, (1, None), WholeTensor(slerp::multislerp)), slerp::multislerp_survey),
    streamed(method("nearswap", &[p("t", Shared, None)], Required, (2, None), WholeTensor(misc::nearswap)), misc::nearswap_survey),
    streamed(method("ram", &[p("epsilon", Shared, Some(1e-5))], Required, (1, None), WholeTensor(misc::ram)), misc::ram_survey),
    streamed(widening_to_f32(method("ramplus_tl", &[p("r", Shared, Some(0.1)), p("alpha", Shared, Some(0.2)), p("epsilon", Shared, Some(1e-5))], Required, (1, None), WholeTensor(misc::ramplus_tl))), misc::ramplus_tl_survey),
    streamed(method("sce", &[p("int8_mask", Shared, Some(0.0)), p("select_topk", Shared, Some(1.0))], Required, (1, None), WholeTensor(sce::sce)), sce::survey),
    method("linear", LINEAR, Ignored, (1, None), Arithmetic::Linear),
    streamed(method("slerp", &[p("t", Shared, None)], Required, (2, Some(2)), WholeTensor(slerp::slerp)), slerp::slerp_survey),
    streamed(method("nuslerp", &[p("weight", NonBase, None), p("nuslerp_row_wise", Shared, Some(0.0)), p("nuslerp_flatten", Shared, Some(1.0))], Optional, (2, Some(3)), WholeTensor(slerp::nuslerp)), slerp::nuslerp_survey),
    method("passthrough", &[p("scale", Input, Some(f64::NAN))], Ignored, (1, Some(1)), Arithmetic::Passthrough),
    streamed(method("model_stock", &[p("filter_wise", Shared, Some(0.0))], Required, (3, None), WholeTensor(model_stock::model_stock)), model_stock::survey),
    streamed(widening_to_f32(method("arcee_fusion", &[], Required, (2, Some(2)), WholeTensor(misc::arcee_fusion))), misc::fusion_survey),
    streamed(method("karcher", &[p("max_iter", Shared, Some(10.0)), p("tol", Shared, Some(1e-5))], Ignored, (1, None), WholeTensor(karcher::karcher)), karcher::karcher_survey),
    method("task_arithmetic", gta!(0.0, 0.0), Required, (1, None), Arithmetic::TaskArithmetic),
    gta::<0>(gta!(1.0, 0.0)),
    gta::<4>(gta!(0.0, 1.0)),
    gta::<3>(gta!(0.0, 1.0)),
    gta::<1>(gta!(0.0, 0.0, GAMMA)),
    gta::<2>(gta!(0.0, 0.0, GAMMA)),
    gta::<5>(gta!(1.0, 1.0, EPSILON)),
    gta::<6>(gta!(0.0, 1.0, EPSILON)),
];
impl MethodSpec {
    pub fn get(name: &str) -> Option<&'static MethodSpec> {
        METHODS.iter().find(|m| m.name == name)
    }

    pub fn names() -> Vec<&'static str> {
        METHODS.iter().map(|m| m.name).collect()
    }

    pub fn param(&self, name: &str) -> Option<&'static ParamSpec> {
        self.params.iter().find(|p| p.name == name)
    }

    /// `; it takes: a, b` (or `; it takes none`), for messages.
    pub fn parameter_list(&self) -> String {
        if self.params.is_empty() {
            return "; it takes none".into();
        }
        let names: Vec<&str> = self.params.iter().map(|p| p.name).collect();
        format!("; it takes: {}", names.join(", "))
    }

    /// The dtype mergekit's method returns, so writes without `out_dtype`, for inputs computed
    /// in `compute` and `non_base` models besides the base: `compute`, except that
    /// [`MethodSpec::widens_to_f32`] methods return f32 for narrower floats (mergekit 0.1.5
    /// writes F32 tensors for them even under `dtype: bfloat16`), but the base unchanged when
    /// there is nothing to merge into it.
    pub fn result_dtype(&self, compute: DType, non_base: usize) -> DType {
        match compute {
            DType::BF16 | DType::F16 if self.widens_to_f32 && non_base > 0 => DType::F32,
            d => d,
        }
    }

    /// Checks each slice's inputs against the method's contract (mergekit's
    /// `validate_inputs`, done before any tensor is planned).
    pub fn check_inputs(&self, config: &MergeConfig) -> Result<(), String> {
        for (i, s) in config.slices.iter().enumerate() {
            let base = s.base_model.as_ref().or(config.base_model.as_ref());
            let at = if config.sliced {
                format!("slices[{i}]")
            } else {
                "models".into()
            };
            if self.base == Required
                && !base.is_some_and(|b| s.sources.iter().any(|m| m.model == *b))
            {
                return Err(format!(
                    "{at}: `{}` needs a `base_model` among the models it merges",
                    self.name
                ));
            }
            let n = s.sources.len();
            let (lo, hi) = self.inputs;
            if n < lo || hi.is_some_and(|h| n > h) {
                let range = match hi {
                    Some(h) if h == lo => format!("exactly {lo}"),
                    Some(h) => format!("{lo} to {h}"),
                    None => format!("at least {lo}"),
                };
                return Err(format!(
                    "{at}: `{}` merges {range} model(s) per tensor, not {n}",
                    self.name
                ));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::merge::methods::survey::testing::Case;
    use crate::ops::merge::methods::{uniform, Params};
    use std::ops::Range;

    /// A parameter's value for the comparison: its default, else a usable one; `density` below
    /// 1 so the magnitude cuts cut.
    fn value(spec: &ParamSpec, trial: u64) -> f64 {
        match spec.name {
            "density" => [0.3, 0.5, 0.8][trial as usize % 3],
            "rescale" => (trial % 2) as f64,
            "epsilon" if spec.scope == NonBase => 0.1,
            "weight" => 0.25 + (trial % 4) as f64 * 0.25,
            "t" => 0.3,
            "nuslerp_flatten" => (trial % 2) as f64,
            "nuslerp_row_wise" => (trial / 2 % 2) as f64,
            "select_topk" => [0.0, 0.4, 0.7, 1.0][trial as usize % 4],
            _ => spec.default.filter(|d| !d.is_nan()).unwrap_or(0.5),
        }
    }

    /// Every streamed method merges a tensor chunk by chunk into the bytes its whole-tensor
    /// function gives, for any chunking, on tie-heavy data.
    #[test]
    fn streamed_methods_merge_every_chunking_as_the_whole_tensor() {
        compare_streamed(
            0..12,
            |trial| (2 + trial as usize % 3, 5 + trial as usize % 4),
            4,
        );
    }

    /// The same on tensors of several fork spans (surveys observed on one and on three
    /// threads), rows cut across the span boundaries.
    #[test]
    fn streamed_methods_merge_alike_on_several_threads() {
        compare_streamed(0..3, |trial| (5, 3001 + trial as usize), 1);
    }

    /// [`Case::compare`] of every streamed method on `trials`, each a `shape(trial)` tensor;
    /// at least `least` of them compared (the others refused alike).
    fn compare_streamed(trials: Range<u64>, shape: impl Fn(u64) -> (usize, usize), least: usize) {
        for spec in METHODS.iter().filter(|m| m.survey.is_some()) {
            let Arithmetic::WholeTensor(whole) = spec.arithmetic else {
                panic!("{} streams but is not a whole-tensor method", spec.name)
            };
            let make = spec.survey.unwrap();
            let mut compared = 0;
            for trial in trials.clone() {
                let non_base = 1 + trial as usize % 3;
                let (rows, cols) = shape(trial);
                let len = rows * cols;
                let draw = |m: u64| -> Vec<f32> {
                    (0..len)
                        .map(|j| ((uniform(trial, m, j as u64) * 16.0).floor() - 8.0) as f32 / 4.0)
                        .collect()
                };
                let base = draw(99);
                let models: Vec<Vec<f32>> = (0..non_base as u64).map(draw).collect();
                let mut global = Params::default();
                let mut one = Params::default();
                for p in spec.params {
                    match p.scope {
                        Shared => global = global.with(p.name, value(p, trial)),
                        _ => one = one.with(p.name, value(p, trial)),
                    }
                }
                let case = Case {
                    whole,
                    make,
                    base: &base,
                    models: &models,
                    params: &vec![one; non_base],
                    global: &global,
                    shape: &[rows, cols],
                    seed: trial,
                };
                compared += usize::from(case.compare(&format!("{} trial {trial}", spec.name)));
            }
            assert!(
                compared >= least,
                "{}: compared only {compared} cases",
                spec.name
            );
        }
    }
}
