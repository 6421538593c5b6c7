//! The arithmetic of each merge method on one tensor, as mergekit 0.1.5 defines it.
//!
//! Every method sees one tensor of each model, widened to `f32` and laid out row-major with
//! the same `shape`, plus the parameters mergekit resolved for that tensor (per model and
//! global, after gradients and filters). It writes the merged values to `out` (as `f32`; the
//! caller rounds once to the output dtype). Accumulations run in `f64` in a fixed order, so the
//! result never depends on thread count or chunking.

pub mod linear;
pub mod sce;
pub mod sparse;
pub mod sparse_stream;
pub mod sparsify;
pub mod task_arithmetic;

use std::collections::BTreeMap;

pub mod karcher;
pub mod misc;
pub mod model_stock;
pub mod slerp;
pub mod support;
pub mod survey;

/// Parameters resolved for one tensor: mergekit's names (`weight`, `density`, `epsilon`,
/// `lambda`, `t`, …) to values; booleans (`normalize`, `rescale`, `int8_mask`) are 0 or 1.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Params(pub BTreeMap<String, f64>);

impl Params {
    /// The value of `name`, or `default` when the config does not set it.
    pub fn get(&self, name: &str, default: f64) -> f64 {
        self.0.get(name).copied().unwrap_or(default)
    }

    /// Whether the boolean `name` is set (non-zero), or `default` when absent.
    pub fn flag(&self, name: &str, default: bool) -> bool {
        self.0.get(name).map_or(default, |v| *v != 0.0)
    }

    pub fn with(mut self, name: &str, value: f64) -> Self {
        self.0.insert(name.to_string(), value);
        self
    }
}

/// One model's tensor and its parameters, in the config's model order.
#[derive(Clone, Copy, Debug)]
pub struct ModelTensor<'a> {
    pub values: &'a [f32],
    pub params: &'a Params,
}

/// One tensor of every input, as the whole-tensor methods take it: the base (empty when the
/// tensor is merged without one), each model's tensor and parameters in config order, the
/// shared parameters, the shape (row-major) and the tensor's random stream.
#[derive(Clone, Copy, Debug)]
pub struct Inputs<'a> {
    pub base: &'a [f32],
    pub models: &'a [ModelTensor<'a>],
    pub global: &'a Params,
    pub shape: &'a [usize],
    pub seed: u64,
}

impl<'a> Inputs<'a> {
    /// The inputs of a tensor of `shape` with random stream 0.
    pub fn new(
        base: &'a [f32],
        models: &'a [ModelTensor<'a>],
        global: &'a Params,
        shape: &'a [usize],
    ) -> Self {
        let seed = 0;
        Inputs {
            base,
            models,
            global,
            shape,
            seed,
        }
    }

    /// The base, or `None` when the tensor is merged without one.
    pub fn optional_base(&self) -> Option<&'a [f32]> {
        optional_base(self.base)
    }
}

/// `Some(base)`, or `None` for a tensor merged without one (handed over empty).
pub(crate) fn optional_base(base: &[f32]) -> Option<&[f32]> {
    (!base.is_empty()).then_some(base)
}

/// `models` as the whole-tensor functions take them, each with the parameters `none`.
pub fn unparameterised<'a>(models: &[&'a [f32]], none: &'a Params) -> Vec<ModelTensor<'a>> {
    (models.iter())
        .map(|values| ModelTensor {
            values,
            params: none,
        })
        .collect()
}

/// The uniform draw in [0, 1) for element `index` of model `model` of a tensor whose stream
/// is `seed` (the caller derives `seed` from `--random-seed` and the tensor's name). A counter
/// (SplitMix64 of the three) instead of a sequential generator, so any chunk, thread or GPU
/// block computes the same draw for the same element.
pub fn uniform(seed: u64, model: u64, index: u64) -> f64 {
    let mut z = seed
        ^ model.wrapping_mul(0xD1B5_4A32_D192_ED03)
        ^ index.wrapping_mul(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^= z >> 31;
    (z >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uniform_draws_are_in_range_and_depend_on_every_coordinate() {
        let a = uniform(1, 0, 0);
        assert!((0.0..1.0).contains(&a));
        assert_ne!(a, uniform(2, 0, 0));
        assert_ne!(a, uniform(1, 1, 0));
        assert_ne!(a, uniform(1, 0, 1));
        let mean = (0..100_000).map(|i| uniform(7, 0, i)).sum::<f64>() / 100_000.0;
        assert!((mean - 0.5).abs() < 0.01, "{mean}");
    }
}
