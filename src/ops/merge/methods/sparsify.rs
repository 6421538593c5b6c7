//! Which elements of one task vector (`model - base`) survive sparsification, and the L1 rescale
//! of the survivors: mergekit 0.1.5's `mergekit/sparsify.py` (`magnitude`, `magnitude_outliers`,
//! `bernoulli`, `della_magprune`, `rescaled_masked_tensor` with `RescaleNorm.l1`).
//!
//! A task vector is never stored: `Survivors` keeps one bit per element and one scale, and
//! the methods recompute `model - base` in `f64` (exact for inputs widened from bf16, f16 and
//! nearly always for f32) when they combine. While ranking, one `u32` key per element is held
//! (the bits of the magnitude rounded to `f32`, which order like it), so a tensor of n elements
//! costs 4n bytes of scratch plus n/8 bytes per model, instead of mergekit's stacked copies.
//!
//! **Ranking and tie order.** Rankings use the magnitude rounded to `f32`, the key mergekit
//! sorts on (`w.float()`; for f32 inputs the very same values). mergekit ranks with torch's
//! unstable sort, so which of several equal keys survives a threshold is unspecified there.
//! Here every ranking is by key ascending, ties by position ascending: of equal keys the later
//! element ranks higher (so `magnitude` keeps it first, `magnitude_outliers` drops it first as
//! an outlier, and it gets the higher DELLA probability).

use super::uniform;

/// mergekit's `SparsificationMethod`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Sparsification {
    /// TIES: keep the `max(1, ⌊density·n⌋)` largest magnitudes.
    Magnitude,
    /// DARE: keep each element with probability `density`.
    Random,
    /// Breadcrumbs: drop the `⌊gamma·n⌋` largest magnitudes as outliers, then keep the next
    /// `⌊density·n⌋` (fewer outliers when that would leave too few).
    MagnitudeOutliers,
    /// DELLA: keep each element with probability `density - epsilon + 2·epsilon·r`, where `r`
    /// in [0, 1] is its magnitude rank within its row (along axis 1; 1-D tensors are one row).
    DellaMagprune,
}

/// One task vector, `model - base`, evaluated in `f64` on demand.
#[derive(Clone, Copy)]
pub(crate) struct TaskVector<'a> {
    pub model: &'a [f32],
    pub base: &'a [f32],
}

impl TaskVector<'_> {
    pub fn at(&self, index: usize) -> f64 {
        f64::from(self.model[index]) - f64::from(self.base[index])
    }
}

/// The elements of one task vector that survive, and the factor they are scaled by.
pub(crate) struct Survivors {
    /// One bit per element (bit `j % 64` of word `j / 64`); `None` keeps every element.
    keep: Option<Vec<u64>>,
    pub scale: f64,
}

impl Survivors {
    pub fn all() -> Self {
        Survivors {
            keep: None,
            scale: 1.0,
        }
    }

    pub fn kept(&self, index: usize) -> bool {
        self.keep
            .as_ref()
            .is_none_or(|bits| bits[index / 64] >> (index % 64) & 1 == 1)
    }

    /// `value` where element `index` survives, else `+0.0`, without a branch (survival is a
    /// coin toss the branch predictor would lose). `value` must not be `-0.0`-sensitive: the
    /// callers add the result to sums that a `+0.0` leaves unchanged.
    #[inline(always)]
    pub fn masked(&self, index: usize, value: f64) -> f64 {
        let bit = self
            .keep
            .as_ref()
            .map_or(1, |bits| bits[index / 64] >> (index % 64) & 1);
        f64::from_bits(value.to_bits() & 0u64.wrapping_sub(bit))
    }

    pub fn from_predicate(len: usize, mut keep: impl FnMut(usize) -> bool) -> Self {
        let mut bits = vec![0u64; len.div_ceil(64)];
        // A word at a time, without a branch on the (often random) answer.
        for (w, word) in bits.iter_mut().enumerate() {
            for index in 64 * w..(64 * w + 64).min(len) {
                *word |= u64::from(keep(index)) << (index % 64);
            }
        }
        Survivors {
            keep: Some(bits),
            scale: 1.0,
        }
    }
}

/// The per-model parameters of a sparsification, as mergekit names them.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Sparsify {
    pub method: Sparsification,
    pub density: f64,
    pub gamma: f64,
    pub epsilon: f64,
    /// Rescale the survivors so the task vector keeps its L1 norm (mergekit's `rescale`).
    pub rescale: bool,
}

/// What a sparsification keeps of a task vector of `len` elements, before any draw or rank.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Selection {
    All,
    Nothing,
    /// The ranks in `[low, high)` of the magnitude order (see [`rank_range`]).
    Ranks(usize, usize),
    Random,
    Della,
}

impl Sparsify {
    /// What this sparsification keeps of `len` elements.
    pub fn selection(&self, len: usize) -> Selection {
        let count = |fraction: f64| (fraction * len as f64).trunc() as usize;
        if self.density >= 1.0 {
            return Selection::All;
        }
        match self.method {
            Sparsification::Magnitude | Sparsification::DellaMagprune if self.density <= 0.0 => {
                Selection::Nothing
            }
            Sparsification::Magnitude => {
                let k = count(self.density).max(1).min(len);
                Selection::Ranks(len - k, len)
            }
            Sparsification::MagnitudeOutliers => {
                let target = count(self.density);
                let bottom = len.saturating_sub(target + count(self.gamma));
                Selection::Ranks(bottom, (bottom + target).min(len))
            }
            Sparsification::Random => Selection::Random,
            Sparsification::DellaMagprune => Selection::Della,
        }
    }

    /// Refuses parameters the sparsification cannot use (DELLA's `epsilon` pushing a keep
    /// probability out of (0, 1)); only where they matter, as mergekit meets them.
    pub fn check(&self) -> Result<(), String> {
        let (density, epsilon) = (self.density, self.epsilon);
        let matters =
            self.method == Sparsification::DellaMagprune && density > 0.0 && density < 1.0;
        if matters && (density + epsilon >= 1.0 || density - epsilon <= 0.0) {
            return Err(format!(
                "`epsilon` must leave `density` ± `epsilon` inside (0, 1); got density {density}, \
                 epsilon {epsilon}"
            ));
        }
        Ok(())
    }

    /// Elements a chunk of a streamed tensor must hold a whole number of: DELLA ranks within
    /// rows along axis 1, so a chunk holds whole slabs of the first axis.
    pub fn granule(&self, shape: &[usize]) -> usize {
        match (self.method, shape) {
            (Sparsification::DellaMagprune, [_, rest @ ..]) if !rest.is_empty() => {
                rest.iter().product()
            }
            (Sparsification::DellaMagprune, _) => shape.iter().product(),
            _ => 1,
        }
    }
}

/// Which elements of `tv` (row-major `shape`) survive `how`; stochastic draws come from
/// `uniform(seed, model, element)`.
pub(crate) fn survivors(
    tv: TaskVector,
    shape: &[usize],
    how: &Sparsify,
    seed: u64,
    model: u64,
) -> Result<Survivors, String> {
    let len = tv.base.len();
    let mut kept = match how.selection(len) {
        Selection::All => return Ok(Survivors::all()),
        Selection::Nothing => Survivors::from_predicate(len, |_| false),
        Selection::Ranks(low, high) => rank_range(len, |j| tv.at(j).abs(), low, high),
        Selection::Random => {
            Survivors::from_predicate(len, |j| uniform(seed, model, j as u64) < how.density)
        }
        Selection::Della => della(tv, shape, how, seed, model, 0)?,
    };
    if how.rescale {
        kept.scale = l1_rescale(tv, &kept);
    }
    Ok(kept)
}

/// mergekit's `rescaled_masked_tensor(norm=l1)`: `‖tv‖₁ / ‖kept‖₁`, or 1 when either norm is
/// below `1e-7`.
fn l1_rescale(tv: TaskVector, kept: &Survivors) -> f64 {
    let mut norms = L1Norms::default();
    norms.add(tv, kept);
    norms.scale()
}

/// The L1 norms of a task vector before and after sparsification, summed a span at a time in
/// position order.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct L1Norms {
    before: Compensated,
    after: Compensated,
}

impl L1Norms {
    /// Adds the elements of `tv`, `kept` saying which survive (indices relative to `tv`).
    pub fn add(&mut self, tv: TaskVector, kept: &Survivors) {
        for j in 0..tv.base.len() {
            let magnitude = tv.at(j).abs();
            self.before.add(magnitude);
            self.after.add(kept.masked(j, magnitude));
        }
    }

    /// `‖tv‖₁ / ‖kept‖₁`, or 1 when either norm is below `1e-7`.
    pub fn scale(&self) -> f64 {
        let (before, after) = (self.before.value(), self.after.value());
        if before < 1e-7 || after < 1e-7 {
            1.0
        } else {
            before / after
        }
    }
}

/// DELLA's magnitude-ranked keep probabilities, drawn per element: `tv` holds whole slabs
/// ([`Sparsify::granule`]) of a tensor of `shape` from element `start`, and the survivors'
/// indices are relative to `tv`.
pub(crate) fn della(
    tv: TaskVector,
    shape: &[usize],
    how: &Sparsify,
    seed: u64,
    model: u64,
    start: usize,
) -> Result<Survivors, String> {
    how.check()?;
    let (density, epsilon) = (how.density, how.epsilon);
    let len = tv.base.len();
    let (row, inner) = della_rows(shape);
    if u32::try_from(row).is_err() {
        return Err(format!(
            "DELLA cannot rank rows of {row} elements (at most 2^32)"
        ));
    }
    let mut bits = vec![0u64; len.div_ceil(64)];
    // The keep probability of each rank, the same in every row.
    let probability: Vec<f64> = (0..row)
        .map(|rank| {
            // A row of one element has no rank spread (mergekit divides 0 by 0 and fails in
            // `torch.bernoulli`); it is kept with the mean probability, `density`.
            let spread = if row > 1 {
                rank as f64 / (row - 1) as f64
            } else {
                0.5
            };
            (density - epsilon) + spread * 2.0 * epsilon
        })
        .collect();
    // Each element as its key above its place in the row: one u64 sort orders by key, then
    // position.
    let mut line: Vec<u64> = Vec::with_capacity(row);
    let outer = len.checked_div(row * inner).unwrap_or(0);
    for a in 0..outer {
        for b in 0..inner {
            let at = |l: usize| (a * row + l) * inner + b;
            line.clear();
            line.extend((0..row).map(|l| u64::from(rank_key(tv.at(at(l)).abs())) << 32 | l as u64));
            line.sort_unstable();
            for (&packed, &p) in line.iter().zip(&probability) {
                let j = at((packed & 0xFFFF_FFFF) as usize);
                let kept = uniform(seed, model, (start + j) as u64) < p;
                bits[j / 64] |= u64::from(kept) << (j % 64);
            }
        }
    }
    Ok(Survivors {
        keep: Some(bits),
        scale: 1.0,
    })
}

/// The rows DELLA ranks within, as (elements in a row, the stride between them): mergekit
/// ranks along dim 1 of the tensor; a tensor of fewer dimensions is unsqueezed to one row.
pub(crate) fn della_rows(shape: &[usize]) -> (usize, usize) {
    match shape {
        [_, row, rest @ ..] => (*row, rest.iter().product()),
        _ => (shape.iter().product(), 1),
    }
}

/// The ranking key of a non-negative value: its `f32` rounding's bits, which order like it.
pub(crate) fn rank_key(value: f64) -> u32 {
    (value as f32).to_bits()
}

/// The elements whose rank, in the order (`key` rounded to `f32` ascending, position
/// ascending), lies in `[low, high)`. `key` must be non-negative and not NaN.
pub(crate) fn rank_range(
    len: usize,
    key: impl Fn(usize) -> f64,
    low: usize,
    high: usize,
) -> Survivors {
    let mut keys: Vec<u32> = (0..len).map(|j| rank_key(key(j))).collect();
    let mut low = Cut::at(&mut keys, low);
    let mut high = Cut::at(&mut keys, high);
    drop(keys);
    Survivors::from_predicate(len, |j| {
        let bits = rank_key(key(j));
        // Both cuts must see every element, to count their ties.
        let (below_low, below_high) = (low.below(bits), high.below(bits));
        !below_low && below_high
    })
}

/// Splits elements, visited in position order, into those of rank below `rank` and the rest.
struct Cut {
    key: u32,
    /// How many elements with `key` equal to the cut's rank below it (the earliest ones).
    ties: usize,
}

impl Cut {
    fn at(keys: &mut [u32], rank: usize) -> Cut {
        if rank >= keys.len() {
            return Cut {
                key: u32::MAX,
                ties: usize::MAX,
            };
        }
        let key = *keys.select_nth_unstable(rank).1;
        let less = keys.iter().filter(|&&k| k < key).count();
        Cut {
            key,
            ties: rank - less,
        }
    }

    /// Whether the next element in position order, with `key`, ranks below the cut.
    fn below(&mut self, key: u32) -> bool {
        if key != self.key {
            return key < self.key;
        }
        if self.ties == 0 {
            return false;
        }
        self.ties -= 1;
        true
    }
}

/// A rank cut like [`Cut`], found without holding the keys: over three passes that see every
/// key in position order, a histogram of the keys' high 16 bits finds the cut key's high half,
/// one of the low 16 bits within it finds the key and how many of its ties rank below the cut,
/// and the third finds where those ties end.
#[derive(Clone, Debug)]
pub(crate) struct RadixCut {
    rank: usize,
    /// Elements known to rank below the keys still in question.
    less: usize,
    high: u32,
    key: u32,
    /// Ties of `key` ranking below the cut, and those seen so far in the third pass.
    ties: usize,
    seen: usize,
    /// Elements with `key` before this position rank below the cut.
    limit: usize,
    /// Whether the passes have anything to find (a cut past the last rank has not).
    searching: bool,
    /// The histogram of the pass under way: allocated by its first key and freed once the key
    /// is found, so a finished cut (kept while the tensor's chunks merge) holds none.
    counts: Vec<u64>,
}

/// The passes of a [`RadixCut`] search.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum CutPass {
    High,
    Low,
    Ties,
}

impl RadixCut {
    /// The cut below rank `rank` of `len` keys.
    pub fn new(rank: usize, len: usize) -> RadixCut {
        let everything = rank >= len;
        RadixCut {
            rank,
            less: 0,
            high: 0,
            key: if everything { u32::MAX } else { 0 },
            ties: 0,
            seen: 0,
            limit: if everything { usize::MAX } else { 0 },
            searching: !everything,
            counts: Vec::new(),
        }
    }

    /// Moves the cut to rank `rank` of `len` before the first pass ends (a rank known only
    /// once the keys are counted).
    pub fn set_rank(&mut self, rank: usize, len: usize) {
        if rank >= len {
            *self = RadixCut::new(rank, len);
        } else {
            self.rank = rank;
        }
    }

    /// Whether the passes have anything to find (a cut past the last rank has not).
    pub fn searching(&self) -> bool {
        self.searching
    }

    /// Pass `pass` sees the element at `position` with `key`.
    pub fn see(&mut self, pass: CutPass, key: u32, position: usize) {
        if !self.searching {
            return;
        }
        let half = match pass {
            CutPass::High => key >> 16,
            CutPass::Low if key >> 16 == self.high => key & 0xffff,
            CutPass::Low => return,
            CutPass::Ties => {
                if key == self.key && self.seen < self.ties {
                    self.seen += 1;
                    if self.seen == self.ties {
                        self.limit = position + 1;
                    }
                }
                return;
            }
        };
        if self.counts.is_empty() {
            self.counts = vec![0; 1 << 16];
        }
        self.counts[half as usize] += 1;
    }

    /// Ends pass `pass`: the high half, then the key, are read off the histogram.
    pub fn end(&mut self, pass: CutPass) {
        if !self.searching || pass == CutPass::Ties {
            return;
        }
        let mut below = self.less;
        for (half, &count) in self.counts.iter().enumerate() {
            if below + count as usize > self.rank {
                match pass {
                    CutPass::High => self.high = half as u32,
                    _ => {
                        self.key = self.high << 16 | half as u32;
                        self.ties = self.rank - below;
                    }
                }
                break;
            }
            below += count as usize;
        }
        self.less = below;
        match pass {
            CutPass::High => self.counts.iter_mut().for_each(|c| *c = 0),
            _ => self.counts = Vec::new(),
        }
    }

    /// The cut's key and position limit, as [`RadixCut::below`] compares with them.
    pub fn cut(&self) -> (u32, usize) {
        (self.key, self.limit)
    }

    /// Whether the element at `position` with `key` ranks below the cut.
    pub fn below(&self, key: u32, position: usize) -> bool {
        key < self.key || (key == self.key && position < self.limit)
    }
}

/// A sum with Neumaier's compensation: within a few ulps of the exact sum of `f64` terms
/// whatever their count, in a fixed order, the terms added one at a time (a chunk at a time).
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct Compensated {
    sum: f64,
    carry: f64,
}

impl Compensated {
    pub fn add(&mut self, term: f64) {
        let next = self.sum + term;
        self.carry += if self.sum.abs() >= term.abs() {
            (self.sum - next) + term
        } else {
            (term - next) + self.sum
        };
        self.sum = next;
    }

    pub fn value(&self) -> f64 {
        self.sum + self.carry
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn kept(s: &Survivors, len: usize) -> Vec<usize> {
        (0..len).filter(|&j| s.kept(j)).collect()
    }

    fn sparsify(method: Sparsification, density: f64, gamma: f64, epsilon: f64) -> Sparsify {
        Sparsify {
            method,
            density,
            gamma,
            epsilon,
            rescale: false,
        }
    }

    #[test]
    fn rank_ranges_order_ties_by_position() {
        let keys = [2.0, 1.0, 1.0, 1.0, 0.5, 1.0];
        let key = |j: usize| keys[j];
        // Ascending: 4 (0.5), 1, 2, 3, 5 (the ones, by position), 0 (2.0).
        assert_eq!(kept(&rank_range(6, key, 0, 2), 6), [1, 4]);
        assert_eq!(kept(&rank_range(6, key, 2, 4), 6), [2, 3]);
        assert_eq!(kept(&rank_range(6, key, 4, 6), 6), [0, 5]);
        assert_eq!(kept(&rank_range(6, key, 0, 6), 6), [0, 1, 2, 3, 4, 5]);
        assert!(kept(&rank_range(6, key, 3, 3), 6).is_empty());
        assert!(kept(&rank_range(0, key, 0, 0), 0).is_empty());
    }

    #[test]
    fn rank_ranges_match_a_full_sort_on_tie_heavy_keys() {
        for trial in 0..200u64 {
            let len = (uniform(trial, 0, 0) * 40.0) as usize;
            let keys: Vec<f64> = (0..len)
                .map(|j| (uniform(trial, 1, j as u64) * 4.0).floor())
                .collect();
            let mut order: Vec<usize> = (0..len).collect();
            order.sort_by(|&a, &b| keys[a].total_cmp(&keys[b]).then(a.cmp(&b)));
            let low = (uniform(trial, 2, 0) * (len + 1) as f64) as usize;
            let high = low + (uniform(trial, 3, 0) * (len - low + 1) as f64) as usize;
            let mut expected = order[low..high].to_vec();
            expected.sort_unstable();
            assert_eq!(
                kept(&rank_range(len, |j| keys[j], low, high), len),
                expected,
                "{keys:?} [{low}, {high})"
            );
        }
    }

    #[test]
    fn magnitude_keeps_at_least_one_and_breadcrumbs_drops_outliers_first() {
        let base = [0f32; 10];
        let model: Vec<f32> = (1..=10)
            .map(|v| if v % 2 == 0 { -v as f32 } else { v as f32 })
            .collect();
        let tv = TaskVector {
            model: &model,
            base: &base,
        };
        let run = |how: Sparsify| kept(&survivors(tv, &[10], &how, 0, 0).unwrap(), 10);
        // ⌊0.01 · 10⌋ = 0, raised to 1: the largest magnitude (10, at position 9).
        assert_eq!(
            run(sparsify(Sparsification::Magnitude, 0.01, 0.0, 0.0)),
            [9]
        );
        assert_eq!(
            run(sparsify(Sparsification::Magnitude, 0.35, 0.0, 0.0)),
            [7, 8, 9]
        );
        assert!(run(sparsify(Sparsification::Magnitude, 0.0, 0.0, 0.0)).is_empty());
        // target 5, outliers 2, so ranks 3..8: magnitudes 4 to 8.
        let outliers = Sparsification::MagnitudeOutliers;
        assert_eq!(run(sparsify(outliers, 0.5, 0.2, 0.0)), [3, 4, 5, 6, 7]);
        // target 9 + outliers 3 > 10: mergekit keeps the 9 smallest (fewer outliers).
        assert_eq!(
            run(sparsify(outliers, 0.9, 0.3, 0.0)),
            (0..9).collect::<Vec<_>>()
        );
        assert!(run(sparsify(outliers, 0.0, 0.1, 0.0)).is_empty());
        assert_eq!(
            run(sparsify(outliers, 1.0, 0.5, 0.0)).len(),
            10,
            "density 1 keeps all"
        );
    }

    #[test]
    fn l1_rescale_restores_the_norm_unless_either_side_is_tiny() {
        let base = [0f32; 4];
        let model = [1.0f32, -3.0, 0.5, 0.5];
        let tv = TaskVector {
            model: &model,
            base: &base,
        };
        let mut how = sparsify(Sparsification::Magnitude, 0.25, 0.0, 0.0);
        how.rescale = true;
        let s = survivors(tv, &[4], &how, 0, 0).unwrap();
        assert_eq!((kept(&s, 4), s.scale), (vec![1], 5.0 / 3.0));
        let tiny = [1e-8f32, 0.0, 0.0, 0.0];
        let tv = TaskVector {
            model: &tiny,
            base: &base,
        };
        assert_eq!(survivors(tv, &[4], &how, 0, 0).unwrap().scale, 1.0);
    }

    #[test]
    fn random_keeps_density_of_a_large_tensor_and_depends_only_on_the_seed() {
        let len = 1 << 20;
        let base = vec![0f32; len];
        let model = vec![1f32; len];
        let tv = TaskVector {
            model: &model,
            base: &base,
        };
        let mut how = sparsify(Sparsification::Random, 0.3, 0.0, 0.0);
        how.rescale = true;
        let a = survivors(tv, &[len], &how, 9, 2).unwrap();
        let count = kept(&a, len).len();
        let sigma = (0.3f64 * 0.7 * len as f64).sqrt();
        assert!(
            (count as f64 - 0.3 * len as f64).abs() < 5.0 * sigma,
            "{count}"
        );
        assert_eq!(a.scale, len as f64 / count as f64);
        let again = survivors(tv, &[len], &how, 9, 2).unwrap();
        assert_eq!(a.keep, again.keep);
        assert_ne!(a.keep, survivors(tv, &[len], &how, 9, 3).unwrap().keep);
    }

    #[test]
    fn della_keep_probability_rises_with_magnitude_rank_along_axis_1() {
        // 4 × 1000 × 3: ranks run along the middle axis, as mergekit's `argsort(dim=1)`.
        let (rows, row, inner) = (4, 1000, 3);
        let base = vec![0f32; rows * row * inner];
        let model: Vec<f32> = (0..base.len())
            .map(|j| ((j / inner) % row) as f32 + 1.0)
            .collect();
        let tv = TaskVector {
            model: &model,
            base: &base,
        };
        let how = sparsify(Sparsification::DellaMagprune, 0.5, 0.0, 0.4);
        let s = survivors(tv, &[rows, row, inner], &how, 1, 0).unwrap();
        for (third, expected) in [(0, 0.1 + 0.8 / 6.0), (1, 0.5), (2, 0.9 - 0.8 / 6.0)] {
            let group: Vec<usize> = (0..base.len())
                .filter(|j| (j / inner) % row * 3 / row == third)
                .collect();
            let fraction = group.iter().filter(|&&j| s.kept(j)).count() as f64 / group.len() as f64;
            let sigma = (expected * (1.0 - expected) / group.len() as f64).sqrt();
            assert!(
                (fraction - expected).abs() < 5.0 * sigma,
                "third {third}: {fraction}"
            );
        }
        let total = kept(&s, base.len()).len() as f64 / base.len() as f64;
        assert!((total - 0.5).abs() < 0.015, "{total}");
    }

    #[test]
    fn della_refuses_an_epsilon_that_leaves_0_1_and_keeps_single_rows_at_density() {
        let base = [0f32; 3];
        let model = [1f32, 2.0, 3.0];
        let tv = TaskVector {
            model: &model,
            base: &base,
        };
        let err = survivors(
            tv,
            &[3],
            &sparsify(Sparsification::DellaMagprune, 0.9, 0.0, 0.15),
            0,
            0,
        );
        assert_eq!(
            err.err().unwrap(),
            "`epsilon` must leave `density` ± `epsilon` inside (0, 1); got density 0.9, epsilon 0.15"
        );
        let none = survivors(
            tv,
            &[3],
            &sparsify(Sparsification::DellaMagprune, 0.0, 0.0, 0.15),
            0,
            0,
        );
        assert!(kept(&none.unwrap(), 3).is_empty());
        // Rows of one element ([n, 1]): each kept with probability `density`.
        let len = 100_000;
        let (base, model) = (vec![0f32; len], vec![1f32; len]);
        let tv = TaskVector {
            model: &model,
            base: &base,
        };
        let how = sparsify(Sparsification::DellaMagprune, 0.3, 0.0, 0.2);
        let fraction =
            kept(&survivors(tv, &[len, 1], &how, 4, 0).unwrap(), len).len() as f64 / len as f64;
        assert!((fraction - 0.3).abs() < 0.01, "{fraction}");
    }

    #[test]
    fn compensated_sums_lose_nothing_to_cancellation() {
        let sum = |terms: &[f64]| {
            let mut s = Compensated::default();
            terms.iter().for_each(|&t| s.add(t));
            s.value()
        };
        assert_eq!(sum(&[1e16, 1.0, -1e16]), 1.0);
        assert_eq!(sum(&[0.1; 10]), 1.0);
    }
}
