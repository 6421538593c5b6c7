//! Model Stock (arXiv 2403.19522) as mergekit 0.1.5 computes it: the fine-tunes' average,
//! pulled towards the base by the mean angle between their offsets from it.
//!
//! mergekit forms the offsets and their dot products in the input dtype; we take them in `f64`
//! (the offset of two `f32` values is exact there, their products too) in one pass that keeps
//! only the N×N Gram matrix of the offsets, per row when `filter_wise`.

use super::support::{model_count, same_lengths, shape_holds, split_axis, BlockSum};
use super::{ModelTensor, Params};

/// mergekit's model_stock: `base` and N ≥ 2 fine-tunes. Over the whole tensor (or each row,
/// vectors along the last axis, when `filter_wise` is 1; default 0) the offsets
/// `oᵢ = modelᵢ − base` give `cos θ`, the mean over pairs `i < j` of
/// `oᵢ·oⱼ / max(‖oᵢ‖‖oⱼ‖, 1e-6)` clamped to [-1, 1]; then `t = N cos θ / (1 + (N − 1) cos θ)`,
/// or 0 (the base) when that denominator is below 1e-6 in magnitude, and the result is
/// `t · mean(models) + (1 − t) · base`. A NaN makes its whole tensor (or row) NaN, as in
/// mergekit.
pub fn model_stock(
    base: &[f32],
    models: &[ModelTensor],
    global: &Params,
    shape: &[usize],
    out: &mut [f32],
) -> Result<(), String> {
    model_count("model_stock", models.len(), 2, usize::MAX)?;
    same_lengths(Some(base), models, out)?;
    shape_holds(shape, out.len())?;
    let row = if global.flag("filter_wise", false) {
        split_axis(shape, shape.len().saturating_sub(1)).1
    } else {
        out.len()
    };
    if row == 0 {
        return Ok(());
    }
    let n = models.len();
    let mut gram = vec![BlockSum::default(); n * n];
    let mut offsets = vec![0.0f64; n];
    for start in (0..out.len()).step_by(row) {
        let span = start..start + row;
        gram.iter_mut().for_each(|g| *g = BlockSum::default());
        for k in span.clone() {
            for (o, m) in offsets.iter_mut().zip(models) {
                *o = m.values[k] as f64 - base[k] as f64;
            }
            for i in 0..n {
                for j in i..n {
                    gram[i * n + j].add(offsets[i] * offsets[j]);
                }
            }
        }
        let t = interpolation(&gram, n);
        for k in span {
            let mean = models.iter().map(|m| m.values[k] as f64).sum::<f64>() / n as f64;
            out[k] = (t * mean + (1.0 - t) * base[k] as f64) as f32;
        }
    }
    Ok(())
}

/// `t` from the offsets' Gram matrix (upper triangle of `gram`, N×N).
fn interpolation(gram: &[BlockSum], n: usize) -> f64 {
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

#[cfg(test)]
mod tests {
    use super::super::support::run_plain;
    use super::*;

    fn run(base: &[f32], inputs: &[&[f32]], global: &Params) -> Result<Vec<f32>, String> {
        run_plain(base.len(), inputs, |models, out| {
            model_stock(base, models, global, &[base.len()], out)
        })
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
