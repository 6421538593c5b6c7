//! `task_arithmetic`: the base plus `lambda` times the weighted sum of the models' differences
//! from it, divided by the sum of the weights when `normalize` is on (a sum below 1e-8 in
//! magnitude divides by 1, as mergekit does). mergekit computes every intermediate in the input
//! dtype (a bf16 model's differences rounded to bf16, its weights too); tftf computes in f64
//! in input order and rounds once.

/// `out[j] = base[j] + lambda · Σ_i weights[i] · (models[i][j] − base[j]) / divisor` (inputs as
/// f64, or as f32 that widen exactly).
#[inline(always)]
pub fn task_arithmetic<T: Copy + Into<f64>>(
    base: &[T],
    models: &[&[T]],
    weights: &[f64],
    scale: f64,
    out: &mut [f64],
) {
    // Model by model over the block (which vectorises), each element's sum still taking its
    // terms in model order from 0.0.
    out.iter_mut().for_each(|o| *o = 0.0);
    for (x, w) in models.iter().zip(weights) {
        for ((o, &v), &b) in out.iter_mut().zip(x.iter()).zip(base) {
            *o += w * (v.into() - b.into());
        }
    }
    for (o, &b) in out.iter_mut().zip(base) {
        *o = b.into() + scale * *o;
    }
}

/// The factor the weighted sum of differences is multiplied by: `lambda`, divided by the sum
/// of the weights when normalising.
pub fn delta_scale(weights: &[f64], normalize: bool, lambda: f64) -> f64 {
    let sum: f64 = weights.iter().sum();
    let divisor = if normalize && sum.abs() >= 1e-8 {
        sum
    } else {
        1.0
    };
    lambda / divisor
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn adds_the_weighted_differences_to_the_base() {
        let base = [1.0, 1.0];
        let (m1, m2) = ([2.0, 0.0], [3.0, 1.0]);
        let mut out = [0.0; 2];
        let s = delta_scale(&[0.5, 1.0], false, 2.0);
        task_arithmetic(&base, &[&m1, &m2], &[0.5, 1.0], s, &mut out);
        assert_eq!(out, [1.0 + 2.0 * (0.5 + 2.0), 1.0 + 2.0 * (-0.5)]);
        assert_eq!(delta_scale(&[0.5, -0.5], true, 1.0), 1.0);
        assert_eq!(delta_scale(&[0.5, 1.5], true, 1.0), 0.5);
    }
}
