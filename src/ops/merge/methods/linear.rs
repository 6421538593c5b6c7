//! `linear` (and `passthrough`'s `scale`): the weighted sum of the models' values, divided by
//! the sum of the weights when `normalize` is on. mergekit computes it in f32 with fused
//! multiply-adds in input order and rounds each weight to f32; tftf accumulates in f64 in input
//! order from the weights as written and rounds once to the output dtype.

/// `out[j] = Σ_i weights[i] · inputs[i][j] / denominator`, each term in f64, in input order
/// (inputs as f64, or as f32 that widen exactly).
#[inline(always)]
pub fn linear<T: Copy + Into<f64>>(
    inputs: &[&[T]],
    weights: &[f64],
    denominator: f64,
    out: &mut [f64],
) {
    // Input by input over the block (which vectorises), each element's sum still taking its
    // terms in input order from 0.0.
    out.iter_mut().for_each(|o| *o = 0.0);
    for (x, w) in inputs.iter().zip(weights) {
        for (o, &v) in out.iter_mut().zip(x.iter()) {
            *o += w * v.into();
        }
    }
    out.iter_mut().for_each(|o| *o /= denominator);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn weighted_average_divides_by_the_weight_sum() {
        let (a, b) = ([1.0, 2.0], [3.0, -2.0]);
        let mut out = [0.0; 2];
        linear::<f64>(&[&a, &b], &[1.0, 3.0], 4.0, &mut out);
        assert_eq!(out, [2.5, -1.0]);
    }
}
