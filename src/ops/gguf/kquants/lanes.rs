//! The k-quant scale searches on sixteen sub-blocks at once, one sub-block per SIMD lane.
//!
//! ggml's searches sum serially over a sub-block's 16 or 32 elements, and a different order
//! gives other bits (and, through the strict comparisons, other scales). So the lanes do not
//! split a sum: lane `k` runs sub-block `k`'s whole search, element after element, doing
//! exactly the f32 operations of the scalar port in `search.rs` in the same order; only the
//! branches become per-lane selects (a candidate is computed in every lane and kept where the
//! scalar code would have kept it). Each lane's results are therefore the scalar search's,
//! bit for bit, on any CPU; [`simd`] runs the searches compiled for AVX2 where the CPU has it
//! (eight f32 lanes per instruction, two instructions per operation so that two independent
//! chains of sums hide each other's latency; no FMA: ggml-base is built without it and a fused
//! multiply-add rounds once where ggml rounds twice).
//!
//! Layout: `x[i][k]` is element `i` of lane `k`'s sub-block ([`transpose`]).

// Lane loops index by lane on purpose: one fixed-length loop is one vector instruction.
#![allow(clippy::needless_range_loop)]

use super::nearest_int;
use super::search::{AffineSearch, GROUP_MAX_EPS};

/// Sub-blocks searched at once.
pub(super) const LANES: usize = 16;
/// One f32 per lane, as the callers hold sub-blocks ([`transpose`]).
pub(super) type Lanes = [f32; LANES];

/// Sixteen f32 lanes with elementwise arithmetic written as plain loops over the lanes, which
/// the compiler turns into vector instructions (two AVX2 ones in [`simd`], four SSE or NEON
/// ones otherwise). IEEE operations lane by lane, so each lane's bits are the scalar code's.
#[derive(Clone, Copy)]
#[repr(align(64))]
struct Vf([f32; LANES]);

/// A per-lane condition, all bits set where it holds.
#[derive(Clone, Copy)]
#[repr(align(64))]
struct Vm([u32; LANES]);

macro_rules! lanewise {
    ($trait:ident, $method:ident, $op:tt) => {
        impl std::ops::$trait for Vf {
            type Output = Vf;
            #[inline(always)]
            fn $method(self, o: Vf) -> Vf {
                let mut r = self.0;
                for k in 0..LANES {
                    r[k] $op o.0[k];
                }
                Vf(r)
            }
        }
    };
}
lanewise!(Add, add, +=);
lanewise!(Sub, sub, -=);
lanewise!(Mul, mul, *=);
lanewise!(Div, div, /=);

impl std::ops::Neg for Vf {
    type Output = Vf;
    #[inline(always)]
    fn neg(self) -> Vf {
        Vf(self.0.map(|v| -v))
    }
}

impl std::ops::AddAssign for Vf {
    #[inline(always)]
    fn add_assign(&mut self, o: Vf) {
        *self = *self + o;
    }
}

impl Vf {
    #[inline(always)]
    fn splat(v: f32) -> Vf {
        Vf([v; LANES])
    }

    #[inline(always)]
    fn cmp(self, o: Vf, f: impl Fn(f32, f32) -> bool) -> Vm {
        let mut m = [0u32; LANES];
        for k in 0..LANES {
            m[k] = if f(self.0[k], o.0[k]) { u32::MAX } else { 0 };
        }
        Vm(m)
    }

    #[inline(always)]
    fn lt(self, o: Vf) -> Vm {
        self.cmp(o, |a, b| a < b)
    }

    #[inline(always)]
    fn gt(self, o: Vf) -> Vm {
        self.cmp(o, |a, b| a > b)
    }

    #[inline(always)]
    fn ne(self, o: Vf) -> Vm {
        self.cmp(o, |a, b| a != b)
    }

    #[inline(always)]
    fn le(self, o: Vf) -> Vm {
        self.cmp(o, |a, b| a <= b)
    }

    #[inline(always)]
    fn ge(self, o: Vf) -> Vm {
        self.cmp(o, |a, b| a >= b)
    }

    #[inline(always)]
    fn abs(self) -> Vf {
        Vf(self.0.map(f32::abs))
    }

    /// `nearest_int(v).clamp(lo, hi)` as f32, per lane.
    #[inline(always)]
    fn round_clamped(self, lo: i32, hi: i32) -> Vf {
        let mut r = [0.0f32; LANES];
        for k in 0..LANES {
            r[k] = nearest_int(self.0[k]).clamp(lo, hi) as f32;
        }
        Vf(r)
    }
}

impl Vm {
    #[inline(always)]
    fn from_bools(b: [bool; LANES]) -> Vm {
        Vm(b.map(|b| if b { u32::MAX } else { 0 }))
    }

    #[inline(always)]
    fn and(self, o: Vm) -> Vm {
        let mut r = self.0;
        for k in 0..LANES {
            r[k] &= o.0[k];
        }
        Vm(r)
    }

    #[inline(always)]
    fn or(self, o: Vm) -> Vm {
        let mut r = self.0;
        for k in 0..LANES {
            r[k] |= o.0[k];
        }
        Vm(r)
    }

    #[inline(always)]
    fn any(self) -> bool {
        self.0.iter().fold(0, |a, &m| a | m) != 0
    }

    #[inline(always)]
    fn not(self) -> Vm {
        Vm(self.0.map(|m| !m))
    }

    /// Per lane, `if self { new } else { old }`.
    #[inline(always)]
    fn select(self, new: Vf, old: Vf) -> Vf {
        let mut r = [0.0f32; LANES];
        for k in 0..LANES {
            let m = self.0[k];
            r[k] = f32::from_bits((new.0[k].to_bits() & m) | (old.0[k].to_bits() & !m));
        }
        Vf(r)
    }
}

/// Runs `f` compiled for AVX2 where the CPU has it (`f` and what it inlines: the searches
/// here are `#[inline(always)]` for that), otherwise as built. Same results either way.
pub(super) use crate::ops::simd::with_avx2 as simd;

/// Sub-blocks `first .. first + LANES` of `S` elements of `x`, lane `k` holding sub-block
/// `first + k`.
#[inline(always)]
pub(super) fn transpose<const S: usize>(x: &[f32], first: usize) -> [Lanes; S] {
    let mut t = [[0.0f32; LANES]; S];
    for k in 0..LANES {
        let sub = &x[S * (first + k)..S * (first + k + 1)];
        for i in 0..S {
            t[i][k] = sub[i];
        }
    }
    t
}

/// [`search::make_qkx_quants`](super::search::make_qkx_quants) on sixteen sub-blocks: lane `k`
/// fits `x[..][k]` with weights `weights[..][k]`, its levels (`0..=nmax`, as f32) into
/// `levels[..][k]`. Returns each lane's `(scale, -min)`. `search.nstep` must be at least 1 (as
/// every k-quant's is).
#[inline(always)]
pub(super) fn make_qkx_quants<const S: usize>(
    nmax: i32,
    x: &[Lanes; S],
    weights: &[Lanes; S],
    levels: &mut [Lanes; S],
    search: AffineSearch,
) -> (Lanes, Lanes) {
    assert!(search.nstep >= 1, "a k-quant search tries candidates");
    let x: [Vf; S] = x.map(Vf);
    let w: [Vf; S] = weights.map(Vf);
    let mut min = x[0];
    let mut max = x[0];
    let mut sum_w = w[0];
    let mut sum_x = sum_w * x[0];
    for i in 1..S {
        min = x[i].lt(min).select(x[i], min);
        max = x[i].gt(max).select(x[i], max);
        sum_w += w[i];
        sum_x += w[i] * x[i];
    }
    let zero = Vf::splat(0.0);
    min = min.gt(zero).select(zero, min);
    let flat = Vm::from_bools(std::array::from_fn(|k| max.0[k] == min.0[k]));
    let nmaxf = nmax as f32;
    let err = |d: Vf| if search.use_mad { d.abs() } else { d * d };

    let iscale = Vf::splat(nmaxf) / (max - min);
    let mut scale = Vf::splat(1.0) / iscale;
    let mut best_error = zero;
    for i in 0..S {
        let l = (iscale * (x[i] - min)).round_clamped(0, nmax);
        best_error += w[i] * err(scale * l + min - x[i]);
    }
    // The kept levels are recomputed at the end from the inverse scale and min that made them
    // (the same operations, so the same levels), rather than copied per kept candidate: a
    // masked copy of every level per candidate costs more than the search.
    let (mut level_iscale, mut level_min) = (iscale, min);

    let mut aux = [zero; S];
    for is in 0..=search.nstep {
        let top = search.rmin + search.rdelta * is as f32 + nmaxf;
        // `min` as the last kept candidate left it, as in ggml.
        let min_used = min;
        let iscale = Vf::splat(top) / (max - min);
        let (mut sum_l, mut sum_l2, mut sum_xl) = (zero, zero, zero);
        for i in 0..S {
            let l = (iscale * (x[i] - min)).round_clamped(0, nmax);
            aux[i] = l;
            sum_l += w[i] * l;
            sum_l2 += w[i] * l * l;
            sum_xl += w[i] * l * x[i];
        }
        let d = sum_w * sum_l2 - sum_l * sum_l;
        let positive_min = ((sum_l2 * sum_x - sum_l * sum_xl) / d).gt(zero);
        let this_scale = positive_min.select(sum_xl / sum_l2, (sum_w * sum_xl - sum_x * sum_l) / d);
        let this_min = positive_min.select(zero, (sum_l2 * sum_x - sum_l * sum_xl) / d);
        let mut cur_error = zero;
        for i in 0..S {
            cur_error += w[i] * err(this_scale * aux[i] + this_min - x[i]);
        }
        // A flat lane's candidates are garbage (its range is 0): never taken, as the scalar
        // search returns before trying any.
        let take = flat.not().and(d.gt(zero)).and(cur_error.lt(best_error));
        level_iscale = take.select(iscale, level_iscale);
        level_min = take.select(min_used, level_min);
        best_error = take.select(cur_error, best_error);
        scale = take.select(this_scale, scale);
        min = take.select(this_min, min);
    }
    for (out, xi) in levels.iter_mut().zip(x) {
        let l = (level_iscale * (xi - level_min)).round_clamped(0, nmax);
        *out = flat.select(zero, l).0;
    }
    (flat.select(zero, scale).0, (-min).0)
}

/// Per lane, whether the values are all below `GROUP_MAX_EPS` in magnitude, and the value of
/// largest magnitude (the first on ties), as ggml's searches find them.
#[inline(always)]
fn signed_max(x: &[Vf]) -> (Vm, Vf) {
    let zero = Vf::splat(0.0);
    let (mut amax, mut max) = (zero, zero);
    for &v in x {
        let larger = v.abs().gt(amax);
        amax = larger.select(v.abs(), amax);
        max = larger.select(v, max);
    }
    (amax.lt(Vf::splat(GROUP_MAX_EPS)), max)
}

/// [`search::make_qx_quants`](super::search::make_qx_quants) on sixteen sub-blocks: lane `k`'s
/// symmetric levels `L + nmax` (as f32) into `levels[..][k]`, weights `weights[..][k]` or, with
/// none, `x²`. Returns each lane's scale.
#[inline(always)]
pub(super) fn make_qx_quants<const S: usize>(
    nmax: i32,
    x: &[Lanes; S],
    weights: Option<&[Lanes; S]>,
    levels: &mut [Lanes; S],
) -> Lanes {
    let x: [Vf; S] = x.map(Vf);
    let w: [Vf; S] = match weights {
        Some(w) => w.map(Vf),
        None => x.map(|v| v * v),
    };
    let zero = Vf::splat(0.0);
    let (empty, max) = signed_max(&x);
    let nmaxf = Vf::splat(nmax as f32);
    let (lo, hi) = (-nmax, nmax - 1);

    let iscale = -nmaxf / max;
    let (mut sumlx, mut suml2) = (zero, zero);
    for i in 0..S {
        let l = (iscale * x[i]).round_clamped(lo, hi);
        sumlx += w[i] * x[i] * l;
        suml2 += w[i] * l * l;
    }
    let mut scale = suml2.ne(zero).select(sumlx / suml2, zero);
    let mut best = scale * sumlx;
    // The kept levels are recomputed at the end from the inverse scale that made them.
    let mut level_iscale = iscale;

    for is in (-9..=9).filter(|&is| is != 0) {
        let iscale = -Vf::splat(nmax as f32 + 0.1 * is as f32) / max;
        let (mut sumlx, mut suml2) = (zero, zero);
        for i in 0..S {
            let l = (iscale * x[i]).round_clamped(lo, hi);
            sumlx += w[i] * x[i] * l;
            suml2 += w[i] * l * l;
        }
        let take = suml2.gt(zero).and((sumlx * sumlx).gt(best * suml2));
        level_iscale = take.select(iscale, level_iscale);
        scale = take.select(sumlx / suml2, scale);
        best = take.select(scale * sumlx, best);
    }
    for (out, xi) in levels.iter_mut().zip(x) {
        let l = (level_iscale * xi).round_clamped(lo, hi) + nmaxf;
        *out = empty.select(zero, l).0;
    }
    empty.select(zero, scale).0
}

/// [`search::make_q3_quants`](super::search::make_q3_quants) on sixteen sub-blocks: lane `k`'s
/// levels `L + nmax` (as f32) into `levels[..][k]`. Each lane moves its levels one at a time in
/// element order, as the scalar search does; a lane whose pass changed nothing runs the later
/// passes unchanged (the same sums give the same decisions), so it ends where the scalar search
/// stopped. Returns each lane's scale.
#[inline(always)]
pub(super) fn make_q3_quants<const S: usize>(
    nmax: i32,
    x: &[Lanes; S],
    levels: &mut [Lanes; S],
) -> Lanes {
    let x: [Vf; S] = x.map(Vf);
    let zero = Vf::splat(0.0);
    let (empty, max) = signed_max(&x);
    let (lo, hi) = (-nmax, nmax - 1);
    let iscale = -Vf::splat(nmax as f32) / max;
    let mut l = [zero; S];
    let (mut sumlx, mut suml2) = (zero, zero);
    for i in 0..S {
        l[i] = (iscale * x[i]).round_clamped(lo, hi);
        let w = x[i] * x[i];
        sumlx += w * x[i] * l[i];
        suml2 += w * l[i] * l[i];
    }
    for _ in 0..5 {
        let mut changed = zero.ne(zero);
        for i in 0..S {
            let (v, li) = (x[i], l[i]);
            let w = v * v;
            let slx0 = sumlx - w * v * li;
            let sl20 = suml2 - w * li * li;
            let new_l = (v * sl20 / slx0).round_clamped(lo, hi);
            let slx = slx0 + w * v * new_l;
            let sl2 = sl20 + w * new_l * new_l;
            let better = (slx * slx * suml2).gt(sumlx * sumlx * sl2);
            let take = (slx0.gt(zero))
                .and(new_l.ne(li))
                .and(sl2.gt(zero))
                .and(better);
            sumlx = take.select(slx, sumlx);
            suml2 = take.select(sl2, suml2);
            l[i] = take.select(new_l, li);
            changed = changed.or(take);
        }
        if !changed.any() {
            break;
        }
    }
    let nmaxf = Vf::splat(nmax as f32);
    for (out, li) in levels.iter_mut().zip(l) {
        *out = empty.select(zero, li + nmaxf).0;
    }
    let scale = suml2.gt(zero).select(sumlx / suml2, zero);
    empty.select(zero, scale).0
}

/// `kv[best_index_int8(16, kv, v)]` per lane: the nearest of the 16 ascending levels `kv`, the
/// lower one unless the upper is strictly nearer, as ggml's bisection picks it (a NaN takes the
/// last level, where the bisection ends).
#[inline(always)]
fn nearest_level(v: Vf, kv: &[f32; 16]) -> Vf {
    nearest(v, kv).0
}

/// [`nearest_level`] and the level's index (as f32).
#[inline(always)]
fn nearest(v: Vf, kv: &[f32; 16]) -> (Vf, Vf) {
    let (mut lo, mut hi) = (Vf::splat(kv[0]), Vf::splat(kv[1]));
    let mut at = Vf::splat(0.0);
    for j in 1..15 {
        let above = v.ge(Vf::splat(kv[j]));
        lo = above.select(Vf::splat(kv[j]), lo);
        hi = above.select(Vf::splat(kv[j + 1]), hi);
        at = above.select(Vf::splat(j as f32), at);
    }
    let (first, last) = (Vf::splat(kv[0]), Vf::splat(kv[15]));
    let lower = (v - lo).lt(hi - v);
    let level = lower.select(lo, hi);
    let index = lower.select(at, at + Vf::splat(1.0));
    let low_end = v.le(first);
    let high_end = v.ge(last).or(v.ne(v));
    (
        high_end.select(last, low_end.select(first, level)),
        high_end.select(Vf::splat(15.0), low_end.select(Vf::splat(0.0), index)),
    )
}

/// `best_index_int8(16, kv, id * x[i])` for 32 values `x` (two lane groups), into `out`.
pub(super) fn nearest_indices(x: &[f32], id: f32, kv: &[f32; 16], out: &mut [u8]) {
    assert!(x.len() == 2 * LANES && out.len() == 2 * LANES);
    simd(
        #[inline(always)]
        || {
            for (xs, os) in x.chunks_exact(LANES).zip(out.chunks_exact_mut(LANES)) {
                let v = Vf(std::array::from_fn(|k| xs[k])) * Vf::splat(id);
                let (_, index) = nearest(v, kv);
                for k in 0..LANES {
                    os[k] = index.0[k] as u8;
                }
            }
        },
    )
}

/// [`nearest_level`] of sixteen values, for the tests against ggml's bisection.
#[cfg(test)]
pub(super) fn nearest_levels(v: Lanes, kv: &[f32; 16]) -> Lanes {
    nearest_level(Vf(v), kv).0
}

/// `Σ w·q·x` and `Σ w·q²` over the nearest levels `q` of `id · x`, in element order.
#[inline(always)]
fn iq4_sums(id: Vf, x: &[Vf; 32], w: &[Vf; 32], kv: &[f32; 16]) -> (Vf, Vf) {
    let zero = Vf::splat(0.0);
    let (mut sumqx, mut sumq2) = (zero, zero);
    for i in 0..32 {
        let q = nearest_level(id * x[i], kv);
        sumqx += w[i] * q * x[i];
        sumq2 += w[i] * q * q;
    }
    (sumqx, sumq2)
}

/// The scale search of `quantize_row_iq4_nl_impl` on sixteen 32-element sub-blocks: lane `k`
/// fits `x[..][k]` with weights `w[..][k]` to the nearest levels of `kv` at the first inverse
/// scale and `2 ntry + 1` nudged ones, in ggml's operations and order. Returns each lane's
/// scale (0 for a sub-block below `GROUP_MAX_EPS`).
#[inline(always)]
pub(super) fn iq4_fit(x: &[Lanes; 32], w: &[Lanes; 32], kv: &[f32; 16], ntry: i32) -> Lanes {
    let x: [Vf; 32] = x.map(Vf);
    let w: [Vf; 32] = w.map(Vf);
    let zero = Vf::splat(0.0);
    let (empty, max) = signed_max(&x);
    let id = Vf::splat(1.0) / (-max / Vf::splat(kv[0]));
    let (sumqx, sumq2) = iq4_sums(id, &x, &w, kv);
    let mut d = sumq2.gt(zero).select(sumqx / sumq2, zero);
    let mut best = d * sumqx;
    for itry in -ntry..=ntry {
        let id = Vf::splat((itry + kv[0] as i32) as f32) / max;
        let (sumqx, sumq2) = iq4_sums(id, &x, &w, kv);
        let take = sumq2.gt(zero).and((sumqx * sumqx).gt(best * sumq2));
        d = take.select(sumqx / sumq2, d);
        best = take.select(d * sumqx, best);
    }
    empty.select(zero, d).0
}

#[cfg(test)]
mod tests {
    use super::super::search;
    use super::*;

    /// Sub-blocks that take each branch of the searches: ordinary values, all equal, all zero,
    /// all positive or negative, below ggml's group epsilon, exact rounding ties, a lone
    /// outlier, zero weights, and non-finite values.
    fn cases<const S: usize>(seed: u64) -> Vec<([f32; S], [f32; S])> {
        let mut s = seed | 1;
        let mut next = move || {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            (s >> 40) as f32 / (1u64 << 24) as f32 - 0.5
        };
        let mut out = Vec::new();
        for case in 0..96 {
            let mut x: [f32; S] = std::array::from_fn(|_| next() * 0.1);
            let mut w: [f32; S] = std::array::from_fn(|_| next() + 0.5);
            match case % 12 {
                1 => x = [0.037; S],
                2 => x = [0.0; S],
                3 => x = x.map(f32::abs),
                4 => x = x.map(|v| -v.abs()),
                5 => x = x.map(|v| v * 1e-16),
                6 => x = std::array::from_fn(|i| (i as f32 - 8.0) * 0.125),
                7 => x[S / 2] = 3.0,
                8 => w = std::array::from_fn(|i| if i % 3 == 0 { 0.0 } else { w[i] }),
                9 => x[1] = f32::NAN,
                10 => x[0] = f32::INFINITY,
                11 => w[2] = -w[2],
                _ => {}
            }
            out.push((x, w));
        }
        out
    }

    /// Groups of [`LANES`] cases, in lanes.
    fn groups<const S: usize>(cases: &[([f32; S], [f32; S])]) -> Vec<([Lanes; S], [Lanes; S])> {
        cases
            .chunks_exact(LANES)
            .map(|g| {
                let x = std::array::from_fn(|i| std::array::from_fn(|k| g[k].0[i]));
                let w = std::array::from_fn(|i| std::array::from_fn(|k| g[k].1[i]));
                (x, w)
            })
            .collect()
    }

    fn qkx_agrees<const S: usize>(nmax: i32, search: AffineSearch, through_simd: bool) {
        let cases = cases::<S>(0x5EED + nmax as u64);
        for (g, (x, w)) in groups(&cases).iter().enumerate() {
            let mut lt = [[0.0f32; LANES]; S];
            let (scales, mins) = if through_simd {
                simd(|| make_qkx_quants(nmax, x, w, &mut lt, search))
            } else {
                make_qkx_quants(nmax, x, w, &mut lt, search)
            };
            for k in 0..LANES {
                let (xs, ws) = &cases[g * LANES + k];
                let (mut levels, mut aux) = ([0u8; S], [0u8; S]);
                let (scale, min) =
                    search::make_qkx_quants(nmax, xs, ws, &mut levels, &mut aux, search);
                let case = g * LANES + k;
                assert_eq!(scales[k].to_bits(), scale.to_bits(), "case {case}: scale");
                assert_eq!(mins[k].to_bits(), min.to_bits(), "case {case}: min");
                let lane: [u8; S] = std::array::from_fn(|i| lt[i][k] as u8);
                assert_eq!(lane, levels, "case {case}: levels");
            }
        }
    }

    fn qx_agrees<const S: usize>(nmax: i32, weighted: bool, through_simd: bool) {
        let cases = cases::<S>(0xFACE + nmax as u64);
        for (g, (x, w)) in groups(&cases).iter().enumerate() {
            let mut lt = [[0.0f32; LANES]; S];
            let weights = weighted.then_some(w);
            let scales = if through_simd {
                simd(|| make_qx_quants(nmax, x, weights, &mut lt))
            } else {
                make_qx_quants(nmax, x, weights, &mut lt)
            };
            for k in 0..LANES {
                let (xs, ws) = &cases[g * LANES + k];
                let mut levels = [0i8; S];
                let scale =
                    search::make_qx_quants(nmax, xs, &mut levels, weighted.then_some(&ws[..]));
                let case = g * LANES + k;
                assert_eq!(scales[k].to_bits(), scale.to_bits(), "case {case}: scale");
                let lane: [i8; S] = std::array::from_fn(|i| lt[i][k] as i8);
                assert_eq!(lane, levels, "case {case}: levels");
            }
        }
    }

    #[test]
    fn affine_searches_in_lanes_equal_the_scalar_search_bit_for_bit() {
        for through_simd in [false, true] {
            // Q4_K's and Q5_K's reference searches, every k-quant's weighted one, Q2_K's.
            qkx_agrees::<32>(15, AffineSearch::new(-1.0, 0.1, 20, false), through_simd);
            qkx_agrees::<32>(31, AffineSearch::new(-0.5, 0.1, 15, false), through_simd);
            qkx_agrees::<32>(15, AffineSearch::WEIGHTED, through_simd);
            qkx_agrees::<16>(3, AffineSearch::new(-0.5, 0.1, 15, true), through_simd);
        }
    }

    #[test]
    fn q3_level_moves_in_lanes_equal_the_scalar_search_bit_for_bit() {
        for through_simd in [false, true] {
            let cases = cases::<16>(0xB3B3);
            for (g, (x, _)) in groups(&cases).iter().enumerate() {
                let mut lt = [[0.0f32; LANES]; 16];
                let scales = if through_simd {
                    simd(|| make_q3_quants(4, x, &mut lt))
                } else {
                    make_q3_quants(4, x, &mut lt)
                };
                for k in 0..LANES {
                    let case = g * LANES + k;
                    let mut levels = [0i8; 16];
                    let scale = search::make_q3_quants(4, &cases[case].0, &mut levels);
                    assert_eq!(scales[k].to_bits(), scale.to_bits(), "case {case}: scale");
                    let lane: [i8; 16] = std::array::from_fn(|i| lt[i][k] as i8);
                    assert_eq!(lane, levels, "case {case}: levels");
                }
            }
        }
    }

    #[test]
    fn symmetric_searches_in_lanes_equal_the_scalar_search_bit_for_bit() {
        for through_simd in [false, true] {
            qx_agrees::<16>(32, false, through_simd);
            qx_agrees::<16>(32, true, through_simd);
            qx_agrees::<16>(4, true, through_simd);
        }
    }
}
