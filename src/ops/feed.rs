//! An op whose inputs are other ops' outputs: a merge reading a quantised model's weights
//! through their dequantisation, a quantiser reading merged weights. The feeding op computes
//! the rows the outer op asks for into a scratch buffer, so nothing in between is written
//! anywhere: the composition costs the inner op's output for one chunk, never a tensor.
//!
//! Each input of the outer op is either stored (read as the plan reads any tensor) or fed by
//! an op built for exactly the dtype the outer op reads, so the outer op sees the bytes the
//! two-step route (write the inner op's output, then run the outer op on it) would give it.

use std::ops::Range;
use std::sync::Arc;

use crate::format::dtype::DType;
use crate::plan::{outputs_of, units_of, Derive, Op, Outs};

/// One input of the outer op.
#[derive(Clone, Debug)]
pub enum Feed {
    /// A stored tensor, read directly.
    Stored,
    /// The output of `op` (which reads `inputs` tensors of its own).
    Computed { op: Arc<dyn Op>, inputs: usize },
}

/// `outer` with some of its inputs computed by other ops.
#[derive(Debug)]
pub struct Fed {
    outer: Arc<dyn Op>,
    feeds: Vec<Feed>,
    granularity: u64,
}

fn gcd(a: u64, b: u64) -> u64 {
    if b == 0 {
        a
    } else {
        gcd(b, a % b)
    }
}

impl Fed {
    /// `outer` reading input `k` from `feeds[k]`. Chunks are cut so that each feeding op gets
    /// whole granules of its own where the outer op's input bytes grow with its units; where
    /// they do not, a chunk is the whole tensor.
    pub fn new(outer: Arc<dyn Op>, feeds: Vec<Feed>) -> Fed {
        let units = outer.units().max(1);
        let g = outer.granularity().clamp(1, units);
        let spans = outer.input_ranges(0..g);
        let mut granularity = g;
        for (k, feed) in feeds.iter().enumerate() {
            let Feed::Computed { op, .. } = feed else {
                continue;
            };
            let per_chunk = spans.get(k).map_or(0, |r| r.end - r.start);
            let inner_bytes = op.granularity().max(1) * op.out_unit_bytes().max(1);
            // Outer granules per inner granule, when the outer input grows linearly.
            let need = if per_chunk == 0 {
                units
            } else {
                inner_bytes / gcd(inner_bytes, per_chunk) * g
            };
            granularity = (granularity / gcd(granularity, need)).saturating_mul(need);
        }
        Fed {
            outer,
            feeds,
            granularity: granularity.min(units),
        }
    }

    /// The inner units of `op` covering byte range `r` of its output, whole granules.
    fn inner_units(op: &dyn Op, r: &Range<u64>) -> Range<u64> {
        let b = op.out_unit_bytes().max(1);
        let g = op.granularity().max(1);
        let start = r.start / b / g * g;
        let end = (r.end.div_ceil(b).div_ceil(g) * g).min(op.units());
        start..end.max(start)
    }

    /// Bytes of outer input `k` per outer unit, for chunk sizing.
    fn per_unit(&self, k: usize) -> u64 {
        let g = self.granularity.max(1);
        self.outer
            .input_ranges(0..g)
            .get(k)
            .map_or(0, |r| (r.end - r.start).div_ceil(g))
    }

    /// The most survey passes any feeding op makes.
    fn inner_passes(&self) -> usize {
        (self.feeds.iter())
            .map(|f| match f {
                Feed::Stored => 0,
                Feed::Computed { op, .. } => op.survey_passes(),
            })
            .max()
            .unwrap_or(0)
    }

    /// Runs `f` on the outer op's inputs for `units`: the stored ones as read, the computed
    /// ones computed from theirs.
    fn with_outer_inputs<T>(
        &self,
        units: Range<u64>,
        inputs: &[&[u8]],
        f: impl FnOnce(&[&[u8]]) -> Result<T, String>,
    ) -> Result<T, String> {
        let ranges = self.outer.input_ranges(units);
        // Per feed: the stored input's position in `inputs`, or the computed buffer's and the
        // outer op's bytes within it.
        let mut computed: Vec<(Vec<u8>, Range<usize>)> = Vec::new();
        let mut places: Vec<Result<usize, usize>> = Vec::with_capacity(self.feeds.len());
        let mut at = 0;
        for (r, feed) in ranges.iter().zip(&self.feeds) {
            match feed {
                Feed::Stored => {
                    places.push(Ok(at));
                    at += 1;
                }
                Feed::Computed { op, inputs: n } => {
                    let inner = Self::inner_units(op.as_ref(), r);
                    let b = op.out_unit_bytes();
                    let mut buf = vec![0u8; ((inner.end - inner.start) * b) as usize];
                    op.compute(inner.clone(), &inputs[at..at + n], &mut buf)?;
                    let from = (r.start - inner.start * b) as usize;
                    places.push(Err(computed.len()));
                    computed.push((buf, from..from + (r.end - r.start) as usize));
                    at += n;
                }
            }
        }
        let views: Vec<&[u8]> = places
            .iter()
            .map(|p| match p {
                Ok(i) => inputs[*i],
                Err(c) => &computed[*c].0[computed[*c].1.clone()],
            })
            .collect();
        f(&views)
    }
}

impl Op for Fed {
    fn name(&self) -> &'static str {
        self.outer.name()
    }
    units_of!(outer);
    fn in_unit_bytes(&self) -> u64 {
        let mut total = 0;
        for (k, feed) in self.feeds.iter().enumerate() {
            let b = self.per_unit(k);
            total += match feed {
                Feed::Stored => b,
                Feed::Computed { op, .. } => {
                    b.div_ceil(op.out_unit_bytes().max(1)) * op.in_unit_bytes()
                }
            };
        }
        total
    }
    fn granularity(&self) -> u64 {
        self.granularity
    }
    fn scratch_unit_bytes(&self) -> u64 {
        let mut total = self.outer.scratch_unit_bytes();
        for (k, feed) in self.feeds.iter().enumerate() {
            if let Feed::Computed { op, .. } = feed {
                let b = self.per_unit(k);
                total += b + b.div_ceil(op.out_unit_bytes().max(1)) * op.scratch_unit_bytes();
            }
        }
        total
    }
    fn input_ranges(&self, units: Range<u64>) -> Vec<Range<u64>> {
        let outer = self.outer.input_ranges(units);
        let mut out = Vec::new();
        for (r, feed) in outer.into_iter().zip(&self.feeds) {
            match feed {
                Feed::Stored => out.push(r),
                Feed::Computed { op, .. } => {
                    out.extend(op.input_ranges(Self::inner_units(op.as_ref(), &r)))
                }
            }
        }
        out
    }
    fn compute(&self, units: Range<u64>, inputs: &[&[u8]], out: &mut [u8]) -> Result<(), String> {
        self.compute_all(units, inputs, &mut [out])
    }
    outputs_of!(outer);
    fn compute_all(&self, units: Range<u64>, inputs: &[&[u8]], outs: Outs) -> Result<(), String> {
        self.with_outer_inputs(units.clone(), inputs, |views| {
            self.outer.compute_all(units, views, outs)
        })
    }
    /// The feeding ops' passes come first (the outer op's survey reads their results), then
    /// the outer op's.
    fn survey_passes(&self) -> usize {
        self.inner_passes() + self.outer.survey_passes()
    }
    fn survey(&self, pass: usize, units: Range<u64>, inputs: &[&[u8]]) -> Result<(), String> {
        let inner = self.inner_passes();
        if pass >= inner {
            return self.with_outer_inputs(units.clone(), inputs, |views| {
                self.outer.survey(pass - inner, units, views)
            });
        }
        let ranges = self.outer.input_ranges(units);
        let mut at = 0;
        for (r, feed) in ranges.iter().zip(&self.feeds) {
            match feed {
                Feed::Stored => at += 1,
                Feed::Computed { op, inputs: n } => {
                    if pass < op.survey_passes() {
                        let units = Self::inner_units(op.as_ref(), r);
                        op.survey(pass, units, &inputs[at..at + n])?;
                    }
                    at += n;
                }
            }
        }
        Ok(())
    }
    fn report(&self) -> Option<serde_json::Value> {
        self.outer.report()
    }
}

/// A derived tensor whose op reads some inputs through other derived tensors: `outer` built
/// for the output dtype, each feeding tensor built for the dtype the outer op reads it in.
#[derive(Debug)]
pub struct FedDerive {
    pub outer: Arc<dyn Derive>,
    /// Per input of `outer`: the stored tensor's index, or the derived tensor and its dtype.
    pub feeds: Vec<FeedSource>,
}

/// Where one input of a [`FedDerive`] comes from.
#[derive(Debug, Clone)]
pub enum FeedSource {
    Stored(usize),
    Derived(Arc<dyn Derive>, DType),
}

impl Derive for FedDerive {
    fn inputs(&self) -> Vec<usize> {
        self.feeds
            .iter()
            .flat_map(|f| match f {
                FeedSource::Stored(i) => vec![*i],
                FeedSource::Derived(d, _) => d.inputs(),
            })
            .collect()
    }
    fn build(&self, dst: DType) -> Arc<dyn Op> {
        let feeds = self
            .feeds
            .iter()
            .map(|f| match f {
                FeedSource::Stored(_) => Feed::Stored,
                FeedSource::Derived(d, dtype) => Feed::Computed {
                    op: d.build(*dtype),
                    inputs: d.inputs().len(),
                },
            })
            .collect();
        Arc::new(Fed::new(self.outer.build(dst), feeds))
    }
}
