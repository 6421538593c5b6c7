//! What the IQ2 and IQ3 sub-block fits share (`quantize_row_iq2_*_impl`,
//! `quantize_row_iq3_*_impl`): the signs split off in masks of 8 (with `even_signs` made even,
//! as 7 of 8 bits are stored), the least-squares fit of the odd levels `2 l + 1`, and a
//! negative scale turned positive by flipping the signs.

use super::c_max;

/// The signs of `xb` (masks of 8; with `even_signs` the flips made even by turning the
/// cheapest element, 7 bits kept) and the magnitudes they leave.
pub(super) fn split_signs<const N: usize, const G: usize>(
    even_signs: bool,
    xb: &[f32],
    weight: &[f32; N],
) -> ([u8; G], [f32; N]) {
    let mut xval = [0.0f32; N];
    let mut signs = [0u8; G];
    for (k, s) in signs.iter_mut().enumerate() {
        let mut nflip = 0;
        for i in 0..8 {
            let e = xb[8 * k + i];
            if e >= 0.0 {
                xval[8 * k + i] = e;
            } else {
                xval[8 * k + i] = -e;
                nflip += 1;
                *s |= 1 << i;
            }
        }
        if even_signs {
            if nflip % 2 == 1 {
                let cost = |i: usize| weight[8 * k + i] * xb[8 * k + i] * xb[8 * k + i];
                let (mut imin, mut min) = (0, cost(0));
                for i in 1..8 {
                    if cost(i) < min {
                        min = cost(i);
                        imin = i;
                    }
                }
                xval[8 * k + imin] = -xval[8 * k + imin];
                *s ^= 1 << imin;
            }
            *s &= 127;
        }
    }
    (signs, xval)
}

/// `(Σ w x q, Σ w q²)` with `q = 2 l + 1`.
pub(super) fn fit<const N: usize>(
    weight: &[f32; N],
    xval: &[f32; N],
    levels: &[i8; N],
) -> (f32, f32) {
    let (mut sumqx, mut sumq2) = (0.0f32, 0.0f32);
    for i in 0..N {
        let q = (2 * levels[i] as i32 + 1) as f32;
        sumqx += weight[i] * xval[i] * q;
        sumq2 += weight[i] * q * q;
    }
    (sumqx, sumq2)
}

/// The largest of the magnitudes `xval`, as ggml's `MAX` keeps it.
pub(super) fn max_magnitude(xval: &[f32]) -> f32 {
    let mut max = xval[0];
    for &e in &xval[1..] {
        max = c_max(max, e);
    }
    max
}

/// `scale` refitted to `levels`, least squares; kept where the levels carry no weight.
pub(super) fn refit<const N: usize>(
    weight: &[f32; N],
    xval: &[f32; N],
    levels: &[i8; N],
    scale: f32,
) -> f32 {
    let (sumqx, sumq2) = fit(weight, xval, levels);
    if sumq2 > 0.0 {
        sumqx / sumq2
    } else {
        scale
    }
}

/// `scale` made non-negative, every sign flipped with it when it was negative (7 bits of each
/// mask with `even_signs`).
pub(super) fn unsigned_scale<const G: usize>(
    scale: f32,
    signs: [u8; G],
    even_signs: bool,
) -> (f32, [u8; G]) {
    if scale < 0.0 {
        let mask = if even_signs { 127 } else { 255 };
        (-scale, signs.map(|s| !s & mask))
    } else {
        (scale, signs)
    }
}

/// The best fit of a candidate-scale search so far (`quantize_row_iq2_*_impl`,
/// `quantize_row_iq3_*_impl`): its scale, levels and which groups it left on the grid.
pub(super) struct BestFit<const N: usize, const G: usize> {
    pub(super) scale: f32,
    /// `scale · Σ w x q` of the best fit, what a candidate must beat.
    score: f32,
    pub(super) levels: [i8; N],
    pub(super) on_grid: [bool; G],
}

impl<const N: usize, const G: usize> BestFit<N, G> {
    /// No fit yet: `scale` and `on_grid` stand until a candidate beats a score of 0.
    pub(super) fn new(scale: f32, on_grid: [bool; G]) -> Self {
        BestFit {
            scale,
            score: 0.0,
            levels: [0; N],
            on_grid,
        }
    }

    /// Keeps the candidate `levels` (its groups' on-grid flags `on_grid`) when its
    /// least-squares fit explains more than the best so far.
    pub(super) fn consider(
        &mut self,
        weight: &[f32; N],
        xval: &[f32; N],
        levels: [i8; N],
        on_grid: [bool; G],
    ) {
        let (sumqx, sumq2) = fit(weight, xval, &levels);
        if sumq2 > 0.0 && sumqx * sumqx > self.score * sumq2 {
            self.scale = sumqx / sumq2;
            self.score = self.scale * sumqx;
            self.levels = levels;
            self.on_grid = on_grid;
        }
    }
}
