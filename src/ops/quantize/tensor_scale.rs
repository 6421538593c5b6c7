//! NVFP4's tensor scale (compressed-tensors' `weight_global_scale`, ModelOpt's
//! `weight_scale_2`), found inside the pipeline rather than in a pass over the model before
//! anything is written.
//!
//! The scale needs the amax of whole weights (q/k/v and gate/up share one), so every weight is
//! read twice. Done at plan time, the first read was a serial pass over the model from disk
//! before the pipeline started. Here the first chunk that needs a group's scale reads the group
//! (unless that read is under way already) and starts the next group's read on a background
//! thread, so the disk reads one group ahead of the encoders while they work, and the
//! encoders' own read of each group comes from the page cache.

use std::fs::File;
use std::ops::Range;
use std::os::unix::fs::FileExt;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};

use super::encode::{modelopt_nvfp4_scale_2, nvfp4_global_scale, WeightType};
use super::lanes;
use super::ops::QuantizeRows;
use crate::ops::kernel::Kernel;
use crate::ops::Op;
use crate::plan::Outs;
use crate::plan::{outputs_of, units_of};

/// Bytes read at a time: this buffer lives outside the pool, one per compute thread at most.
const READ_BYTES: u64 = 1 << 20;

/// One byte range of a member weight in its file.
#[derive(Debug)]
pub struct Piece {
    pub file: Arc<File>,
    pub path: PathBuf,
    pub offset: u64,
    pub len: u64,
}

/// Where a member weight's values come from.
#[derive(Debug)]
pub enum Member {
    /// Its stored bytes, in order.
    Stored(Vec<Piece>),
    /// The rows an earlier step's op computes (a merge, a cast, a LoRA merge) from stored
    /// tensors, each given by its pieces: evaluated once more, chunk by chunk, for the amax.
    Computed {
        op: Arc<dyn Op>,
        inputs: Vec<Vec<Piece>>,
    },
}

/// Bytes of inputs (and, apart, of outputs) a computed member's amax pass holds per chunk:
/// outside the pool, as the read buffer is, at most twice at a time (the encoder's group and
/// the one read ahead).
const COMPUTED_CHUNK_BYTES: u64 = 8 << 20;

/// Whose tensor scale a group's amax makes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ScaleKind {
    /// `weight_global_scale` = `448 · 6 / amax` in the weight dtype.
    CompressedTensors,
    /// `weight_scale_2` = `amax / (6 · 448)` in f32; every member weight must hold a non-zero.
    Modelopt,
}

impl ScaleKind {
    /// The scale of a group whose amax is `amax`.
    pub fn scale(self, wt: WeightType, amax: f32) -> f32 {
        match self {
            ScaleKind::CompressedTensors => nvfp4_global_scale(wt, amax),
            ScaleKind::Modelopt => modelopt_nvfp4_scale_2(amax),
        }
    }

    /// Why member weight `name` with amax `amax` cannot be encoded, if it cannot.
    pub fn refuse(self, name: &str, amax: f32) -> Option<String> {
        (self == ScaleKind::Modelopt && amax == 0.0).then(|| {
            format!(
                "`{name}`, in this weight's NVFP4 weight_scale_2 group, is all zeros: ModelOpt's weight_scale_2 and block scales would be undefined; leave it unquantised with --ignore"
            )
        })
    }
}

/// The tensor scale shared by the weights of one group, computed once.
#[derive(Debug)]
pub struct TensorScale {
    wt: WeightType,
    kind: ScaleKind,
    /// Each member weight's name, dtype and where its values come from.
    members: Vec<(String, WeightType, Member)>,
    value: OnceLock<Result<f32, String>>,
    /// The next group in the output's order: the first chunk that needs this scale starts
    /// reading that one in the background, so its bytes come off the disk while this group is
    /// encoded (one group ahead of the encoders, never more).
    ahead: OnceLock<Arc<TensorScale>>,
    started_ahead: AtomicBool,
}

impl TensorScale {
    /// Sets the group read in the background once this one is needed (once; later calls are
    /// ignored).
    pub fn read_ahead(&self, next: &Arc<TensorScale>) {
        let _ = self.ahead.set(next.clone());
    }

    /// A scale read from `members` when first asked for.
    pub fn lazy(
        wt: WeightType,
        kind: ScaleKind,
        members: Vec<(String, WeightType, Member)>,
    ) -> TensorScale {
        TensorScale {
            wt,
            kind,
            members,
            value: OnceLock::new(),
            ahead: OnceLock::new(),
            started_ahead: AtomicBool::new(false),
        }
    }

    /// A scale known already (from an amax computed at plan time).
    pub fn known(wt: WeightType, kind: ScaleKind, amax: f32) -> TensorScale {
        let value = OnceLock::new();
        let _ = value.set(Ok(kind.scale(wt, amax)));
        TensorScale {
            wt,
            kind,
            members: Vec::new(),
            value,
            ahead: OnceLock::new(),
            started_ahead: AtomicBool::new(false),
        }
    }

    /// The scale, reading the group's weights the first time (other threads wait for it), and
    /// starting the next group's read in the background.
    pub fn get(&self) -> Result<f32, String> {
        if let Some(next) = self.ahead.get() {
            if !self.started_ahead.swap(true, Ordering::Relaxed) {
                let next = next.clone();
                // Detached: it only reads and fills `next`'s cell, which an encoder would
                // otherwise fill itself; a failure there is met again, and reported, by it.
                std::thread::Builder::new()
                    .name("tftf-amax".into())
                    .spawn(move || {
                        let _ = next.value();
                    })
                    .ok();
            }
        }
        self.value()
    }

    /// The scale, reading the group's weights the first time.
    fn value(&self) -> Result<f32, String> {
        self.value
            .get_or_init(|| {
                // The whole group at once: the disk gets many requests in flight instead of
                // one 1 MiB read after another.
                for (_, _, source) in &self.members {
                    let pieces: Vec<&Piece> = match source {
                        Member::Stored(pieces) => pieces.iter().collect(),
                        Member::Computed { inputs, .. } => inputs.iter().flatten().collect(),
                    };
                    for p in pieces {
                        crate::sys::prefetch(&p.file, p.offset, p.len);
                    }
                }
                let mut m = 0f32;
                for (name, member_wt, source) in &self.members {
                    let nonfinite = |v: f32| {
                        format!(
                            "`{name}`, in this weight's NVFP4 tensor-scale group, holds {v}: a non-finite weight cannot be quantised"
                        )
                    };
                    let member = match source {
                        Member::Stored(pieces) => {
                            let mut member = 0f32;
                            for p in pieces {
                                let read = |at: u64, buf: &mut [u8]| read_piece(name, p, at, buf);
                                let v = lanes::amax_read(*member_wt, p.len, READ_BYTES, read, nonfinite)?;
                                member = member.max(v);
                            }
                            member
                        }
                        Member::Computed { op, inputs } => {
                            computed_amax(name, &**op, inputs, *member_wt, nonfinite)?
                        }
                    };
                    if let Some(why) = self.kind.refuse(name, member) {
                        return Err(why);
                    }
                    m = m.max(member);
                }
                Ok(self.kind.scale(self.wt, m))
            })
            .clone()
    }
}

/// Reads `buf.len()` bytes of member `name`'s piece `p` from byte `at` of the piece.
fn read_piece(name: &str, p: &Piece, at: u64, buf: &mut [u8]) -> Result<(), String> {
    p.file.read_exact_at(buf, p.offset + at).map_err(|e| {
        format!(
            "reading `{name}` for the NVFP4 tensor scale from {}: {e}",
            crate::escape::path(&p.path)
        )
    })
}

/// Bytes `range` of a tensor stored as `pieces` (in order).
fn read_range(name: &str, pieces: &[Piece], range: &Range<u64>) -> Result<Vec<u8>, String> {
    let mut out = vec![0u8; (range.end - range.start) as usize];
    let mut start = 0u64;
    for p in pieces {
        let (a, b) = (range.start.max(start), range.end.min(start + p.len));
        if a < b {
            let o = (a - range.start) as usize;
            read_piece(name, p, a - start, &mut out[o..o + (b - a) as usize])?;
        }
        start += p.len;
    }
    Ok(out)
}

/// The amax of the rows `op` computes from `inputs` (elements of `wt`), chunk by chunk as the
/// pipeline would cut them, its survey passes first when there is more than one chunk: the
/// rows the quantiser will encode, bit for bit.
fn computed_amax(
    name: &str,
    op: &dyn Op,
    inputs: &[Vec<Piece>],
    wt: WeightType,
    nonfinite: impl Fn(f32) -> String,
) -> Result<f32, String> {
    let units = op.units();
    let g = op.granularity().max(1);
    let per_unit = op.out_unit_bytes().max(op.in_unit_bytes()).max(1);
    let per = ((COMPUTED_CHUNK_BYTES / per_unit).max(1).div_ceil(g) * g).min(units.max(1));
    let chunks: Vec<Range<u64>> = (0..units.div_ceil(per))
        .map(|k| k * per..((k + 1) * per).min(units))
        .collect();
    let read = |units: &Range<u64>| -> Result<Vec<Vec<u8>>, String> {
        (op.input_ranges(units.clone()).iter().zip(inputs))
            .map(|(r, pieces)| read_range(name, pieces, r))
            .collect()
    };
    let fail = |e: String| format!("computing `{name}` for the NVFP4 tensor scale: {e}");
    if chunks.len() > 1 {
        for pass in 0..op.survey_passes() {
            for c in &chunks {
                let bufs = read(c)?;
                let views: Vec<&[u8]> = bufs.iter().map(Vec::as_slice).collect();
                op.survey(pass, c.clone(), &views).map_err(fail)?;
            }
        }
    }
    let mut m = 0f32;
    for c in &chunks {
        let bufs = read(c)?;
        let views: Vec<&[u8]> = bufs.iter().map(Vec::as_slice).collect();
        let mut out = vec![0u8; ((c.end - c.start) * op.out_unit_bytes()) as usize];
        op.compute(c.clone(), &views, &mut out).map_err(fail)?;
        let v = lanes::tensor_amax(wt, &out);
        if !v.is_finite() {
            return Err(nonfinite(v));
        }
        m = m.max(v);
    }
    Ok(m)
}

/// An NVFP4 encoder whose tensor scale is set per chunk.
pub trait ScaledRows: Op + Copy + 'static {
    /// This encoder with tensor scale `s`.
    fn scaled(self, s: f32) -> Self;
}

impl ScaledRows for QuantizeRows {
    fn scaled(self, s: f32) -> Self {
        QuantizeRows { global: s, ..self }
    }
}

/// An NVFP4 encoder ([`QuantizeRows`], ModelOpt's `ModeloptRows`), its tensor scale taken from a
/// [`TensorScale`] when a chunk is computed.
#[derive(Debug)]
pub struct Nvfp4Rows<R> {
    /// The encoder; its tensor scale is replaced by the group's.
    pub rows: R,
    pub scale: Arc<TensorScale>,
}

impl<R: ScaledRows> Nvfp4Rows<R> {
    fn with_scale(&self) -> Result<R, String> {
        Ok(self.rows.scaled(self.scale.get()?))
    }
}

impl<R: ScaledRows> Op for Nvfp4Rows<R> {
    fn name(&self) -> &'static str {
        self.rows.name()
    }
    units_of!(rows);
    fn in_unit_bytes(&self) -> u64 {
        self.rows.in_unit_bytes()
    }
    fn granularity(&self) -> u64 {
        self.rows.granularity()
    }
    fn scratch_unit_bytes(&self) -> u64 {
        self.rows.scratch_unit_bytes()
    }
    fn input_ranges(&self, units: Range<u64>) -> Vec<Range<u64>> {
        self.rows.input_ranges(units)
    }
    fn compute(&self, units: Range<u64>, inputs: &[&[u8]], out: &mut [u8]) -> Result<(), String> {
        self.with_scale()?.compute(units, inputs, out)
    }
    outputs_of!(rows);
    fn compute_all(&self, units: Range<u64>, inputs: &[&[u8]], outs: Outs) -> Result<(), String> {
        self.with_scale()?.compute_all(units, inputs, outs)
    }
    fn kernel(&self, units: &Range<u64>) -> Option<Kernel> {
        // A scale that cannot be read leaves the chunk to the CPU op, which says why.
        self.with_scale().ok()?.kernel(units)
    }
    fn has_kernel(&self) -> bool {
        // Without reading the group: the encoder has a kernel whatever its scale.
        self.rows.has_kernel()
    }
}

/// `weight_global_scale` (`weight_scale_2`): the group's scale as one F32.
#[derive(Debug)]
pub struct GlobalScaleTensor(pub Arc<TensorScale>);

impl Op for GlobalScaleTensor {
    fn name(&self) -> &'static str {
        "quantize weight_global_scale"
    }
    fn units(&self) -> u64 {
        1
    }
    fn out_unit_bytes(&self) -> u64 {
        4
    }
    fn in_unit_bytes(&self) -> u64 {
        0
    }
    fn input_ranges(&self, _units: Range<u64>) -> Vec<Range<u64>> {
        Vec::new()
    }
    fn compute(&self, _units: Range<u64>, _inputs: &[&[u8]], out: &mut [u8]) -> Result<(), String> {
        out.copy_from_slice(&self.0.get()?.to_le_bytes());
        Ok(())
    }
}
