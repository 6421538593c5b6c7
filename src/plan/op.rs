//! The op trait: what the plan binds a computed tensor to, and what the reader, the compute
//! stage and the GPU backend drive. It sits below the op families (which implement it and
//! re-export it) so that a plan's recipes can hold ops without the plan naming any of them.

use std::fmt::Debug;
use std::ops::Range;

use super::kernel::{Kernel, KernelStats};

/// The output buffers of one chunk, the main output first ([`Op::compute_all`]).
pub type Outs<'a, 'b> = &'a mut [&'b mut [u8]];

pub trait Op: Send + Sync + Debug {
    /// Short name for plans and reports (`cast`, `dequant-fp8`, …).
    fn name(&self) -> &'static str;
    /// Number of output units.
    fn units(&self) -> u64;
    /// Output bytes per unit.
    fn out_unit_bytes(&self) -> u64;
    /// Upper bound on input bytes read per unit, summed over inputs (for chunk sizing).
    fn in_unit_bytes(&self) -> u64;
    /// Chunks start at multiples of this many units.
    fn granularity(&self) -> u64 {
        1
    }
    /// Working memory per unit that lives outside the pool's buffers while a chunk computes
    /// (rows decoded to f32, say). Chunks shrink to hold it, and the pool leaves room for one
    /// chunk's worth per compute thread, so the budget holds.
    fn scratch_unit_bytes(&self) -> u64 {
        0
    }
    /// Byte ranges of each input tensor (relative to its first byte) needed for `units`.
    fn input_ranges(&self, units: Range<u64>) -> Vec<Range<u64>>;
    /// Fills `out` (exactly `units.len() * out_unit_bytes()` bytes) from `inputs`, laid out as
    /// `input_ranges` asked. Errors describe the bad value; the caller adds file and tensor.
    fn compute(&self, units: Range<u64>, inputs: &[&[u8]], out: &mut [u8]) -> Result<(), String>;

    /// Further output tensors written by the same pass (a requantised table and its new scales,
    /// say), so an input is read once however many tensors it yields.
    fn extra_outputs(&self) -> usize {
        0
    }
    /// Bytes per unit of extra output `k` (1-based: output 0 is the main one); where
    /// [`Op::out_span`] is overridden, an upper bound for chunk sizing.
    fn extra_unit_bytes(&self, _k: usize) -> u64 {
        unreachable!("op has no extra outputs")
    }
    /// Bytes per unit of every output, the main one first.
    fn all_unit_bytes(&self) -> Vec<u64> {
        std::iter::once(self.out_unit_bytes())
            .chain((1..=self.extra_outputs()).map(|k| self.extra_unit_bytes(k)))
            .collect()
    }
    /// Bytes of output `k` (0: the main one) that `units` fill, relative to its first byte.
    /// Uniform units by default; an op whose extra output has a row per granule (FP8 block
    /// scales: one row per 128 weight rows) maps a granule-aligned range onto those rows.
    fn out_span(&self, k: usize, units: Range<u64>) -> Range<u64> {
        let b = if k == 0 {
            self.out_unit_bytes()
        } else {
            self.extra_unit_bytes(k)
        };
        units.start * b..units.end * b
    }
    /// Fills every output; ops with extra outputs override this.
    fn compute_all(&self, units: Range<u64>, inputs: &[&[u8]], outs: Outs) -> Result<(), String> {
        self.compute(units, inputs, outs[0])
    }
    /// The GPU kernel that computes chunk `units`, as a description; `None`: the op runs on
    /// the CPU only.
    fn kernel(&self, _units: &Range<u64>) -> Option<Kernel> {
        None
    }
    /// Whether chunks can run on a GPU at all.
    fn has_kernel(&self) -> bool {
        self.kernel(&(0..0)).is_some()
    }
    /// Folds in what a kernel gathered for a chunk beside its outputs.
    fn absorb(&self, _stats: KernelStats) {}
    /// Per-tensor figures for the report, gathered while computing.
    fn report(&self) -> Option<serde_json::Value> {
        None
    }

    /// Passes over the inputs this op makes, a chunk at a time, before computing any chunk of
    /// a tensor that does not fit one chunk: whole-tensor statistics (a merge's magnitude
    /// thresholds, norms) gathered in bounded memory. A chunk that is the whole tensor is
    /// computed without them.
    fn survey_passes(&self) -> usize {
        0
    }
    /// Pass `pass` (of [`Op::survey_passes`]) sees chunk `units` of the inputs, laid out as
    /// [`Op::input_ranges`] asks; each pass sees every chunk once, in order, the passes in
    /// order, all before the first [`Op::compute`] of a partial chunk.
    fn survey(&self, _pass: usize, _units: Range<u64>, _inputs: &[&[u8]]) -> Result<(), String> {
        Err(format!("op `{}` gathers no statistics", self.name()))
    }
}

/// [`Op::name`] and [`Op::kernel`] for an op whose kernel describes every chunk alike, in its
/// `impl Op`: `op_name_and_kernel!("dequant-int", |op| Kernel::DequantInt(..))`, `op` being
/// `self` in the description.
macro_rules! op_name_and_kernel {
    ($name:literal, |$op:ident| $kernel:expr) => {
        fn name(&self) -> &'static str {
            $name
        }
        fn kernel(&self, _units: &::std::ops::Range<u64>) -> Option<$crate::plan::kernel::Kernel> {
            let $op = self;
            Some($kernel)
        }
    };
}
pub(crate) use op_name_and_kernel;

/// [`Op::units`] and [`Op::out_unit_bytes`] of an op that writes, unit for unit, what the op in
/// its field `$op` writes (a wrapper that feeds or scales that op's inputs), in its `impl Op`.
macro_rules! units_of {
    ($op:ident) => {
        fn units(&self) -> u64 {
            self.$op.units()
        }
        fn out_unit_bytes(&self) -> u64 {
            self.$op.out_unit_bytes()
        }
    };
}
pub(crate) use units_of;

/// The `Op` methods of an op whose outputs (codes and their extra outputs) are those of the op
/// in its field `$op`.
macro_rules! outputs_of {
    ($op:ident) => {
        fn extra_outputs(&self) -> usize {
            self.$op.extra_outputs()
        }
        fn extra_unit_bytes(&self, k: usize) -> u64 {
            self.$op.extra_unit_bytes(k)
        }
        fn out_span(&self, k: usize, units: ::std::ops::Range<u64>) -> ::std::ops::Range<u64> {
            self.$op.out_span(k, units)
        }
    };
}
pub(crate) use outputs_of;
