//! Rows of a vocabulary tensor remapped to the merged vocabulary, per model, before the merge
//! method runs (mergekit's `PermutedVocabulary`). A model's row for a token it has is its own;
//! for a token it lacks (or every model's, for a `force`d token) the row is the token's
//! configured source, else mergekit's default: the row of the only model that has the token,
//! the base's, the average of the models that have it, or zeros when none has it. Rows past the
//! vocabulary (`pad_to_multiple_of`) are each model's mean row.
//!
//! Memory: the op reads each model's whole tensor once (one tensor per model, as the merge
//! methods that need whole tensors do) and gathers the remapped rows a block at a time for the
//! elementwise methods (all at once for the others). Averages and means are summed in f64 and
//! rounded once to the inputs' common dtype, where mergekit rounds after every addition.

use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use super::{EmbedSource, MergedVocab, TokenRef};
use crate::format::dtype::DType;
use crate::ops::cast::decode_into;
use crate::ops::merge::op::{store_f64, MergeOp};
use crate::plan::{Op, SetDst};

/// Remapped rows gathered per block for elementwise methods.
const BLOCK_BYTES: usize = 1 << 20;

/// Where one output row of one input comes from.
#[derive(Clone, Copy, Debug)]
enum Row {
    /// The input's own row.
    Own(u64),
    /// A default row, shared by the inputs that lack the token.
    Default(usize),
}

#[derive(Clone, Debug)]
enum DefaultRow {
    Zero,
    Copy { input: usize, row: u64 },
    Average(Vec<(usize, u64)>),
}

/// How one vocabulary tensor's rows are gathered from each input.
#[derive(Debug)]
pub struct RowPlan {
    /// Per input, per token of the merged vocabulary.
    rows: Vec<Vec<Row>>,
    defaults: Vec<DefaultRow>,
    /// Output rows (the vocabulary, padded).
    padded_rows: u64,
    /// Elements per row.
    row_len: usize,
    in_dtypes: Vec<DType>,
    /// The dtype rows are gathered in: the inputs' common one.
    common: DType,
}

impl RowPlan {
    /// The plan for a tensor whose inputs come from `models` (input order), `rows[k]` rows of
    /// `row_len` elements each. Errors name the token and model.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        vocab: &MergedVocab,
        models: &[PathBuf],
        rows: &[u64],
        base: Option<&Path>,
        row_len: usize,
        in_dtypes: Vec<DType>,
        common: DType,
    ) -> Result<RowPlan, String> {
        let perm = |k: usize| &vocab.perms[&models[k]];
        let index = |m: &Path| models.iter().position(|p| p == m);
        let base = base.and_then(index);
        let mut plan = RowPlan {
            rows: vec![Vec::with_capacity(vocab.tokens.len()); models.len()],
            defaults: Vec::new(),
            padded_rows: vocab.rows,
            row_len,
            in_dtypes,
            common,
        };
        for (id, tok) in vocab.tokens.iter().enumerate() {
            let present: Vec<Option<u64>> = (0..models.len()).map(|k| perm(k)[id]).collect();
            for (k, p) in present.iter().enumerate() {
                if let Some(r) = p.filter(|&r| r >= rows[k]) {
                    return Err(format!(
                        "token {tok:?} is row {r} of model {}, whose tensor has {} rows",
                        models[k].display(),
                        rows[k]
                    ));
                }
            }
            let setting = vocab.settings.get(tok);
            let force = setting.is_some_and(|s| s.force);
            if !force && present.iter().all(Option::is_some) {
                for (k, p) in present.iter().enumerate() {
                    plan.rows[k].push(Row::Own(p.expect("present")));
                }
                continue;
            }
            let default = match setting.and_then(|s| s.source.as_ref()) {
                Some(src) => configured(vocab, src, tok, &present, rows, index)?,
                None => automatic(&present, base),
            };
            plan.defaults.push(default);
            let d = plan.defaults.len() - 1;
            for (k, p) in present.iter().enumerate() {
                plan.rows[k].push(match p {
                    Some(r) if !force => Row::Own(*r),
                    _ => Row::Default(d),
                });
            }
        }
        Ok(plan)
    }

    fn tokens(&self) -> usize {
        self.rows[0].len()
    }

    /// Row `r` of input `k` (an input's bytes as read) as f64 values.
    fn read(&self, inputs: &[&[u8]], k: usize, r: u64, out: &mut [f64]) {
        let d = self.in_dtypes[k];
        let size = d.size().expect("float dtypes have a size");
        let at = r as usize * self.row_len * size;
        let bytes = &inputs[k][at..at + self.row_len * size];
        if d == DType::F64 {
            for (o, c) in out.iter_mut().zip(bytes.chunks_exact(8)) {
                *o = f64::from_le_bytes(c.try_into().expect("8 bytes"));
            }
        } else {
            let mut f = vec![0f32; self.row_len];
            decode_into(d, bytes, &mut f);
            out.iter_mut().zip(f).for_each(|(o, v)| *o = v as f64);
        }
    }

    /// Writes row `r` of input `k`'s remapped tensor into `out` (one row in the common dtype).
    fn fill(&self, inputs: &[&[u8]], k: usize, r: usize, means: &[Vec<f64>], out: &mut [u8]) {
        let mut v = vec![0f64; self.row_len];
        if r >= self.tokens() {
            v.copy_from_slice(&means[k]);
        } else {
            match self.rows[k][r] {
                Row::Own(i) if self.in_dtypes[k] == self.common => {
                    let size = self.common.size().expect("float dtypes have a size");
                    let at = i as usize * self.row_len * size;
                    out.copy_from_slice(&inputs[k][at..at + out.len()]);
                    return;
                }
                Row::Own(i) => self.read(inputs, k, i, &mut v),
                Row::Default(d) => match &self.defaults[d] {
                    DefaultRow::Zero => {}
                    DefaultRow::Copy { input, row } => self.read(inputs, *input, *row, &mut v),
                    DefaultRow::Average(from) => {
                        let mut one = vec![0f64; self.row_len];
                        for &(input, row) in from {
                            self.read(inputs, input, row, &mut one);
                            v.iter_mut().zip(&one).for_each(|(a, b)| *a += b);
                        }
                        v.iter_mut().for_each(|a| *a /= from.len() as f64);
                    }
                },
            }
        }
        for (j, x) in v.into_iter().enumerate() {
            store_f64(self.common, out, j, x);
        }
    }

    /// Each input's mean remapped row (over the vocabulary's rows), for the padding rows.
    fn means(&self, inputs: &[&[u8]]) -> Vec<Vec<f64>> {
        let size = self.common.size().expect("float dtypes have a size");
        let mut row = vec![0u8; self.row_len * size];
        let mut vals = vec![0f32; self.row_len];
        (0..self.rows.len())
            .map(|k| {
                let mut sum = vec![0f64; self.row_len];
                if self.padded_rows as usize == self.tokens() {
                    return sum;
                }
                for r in 0..self.tokens() {
                    self.fill(inputs, k, r, &[], &mut row);
                    if self.common == DType::F64 {
                        for (s, c) in sum.iter_mut().zip(row.chunks_exact(8)) {
                            *s += f64::from_le_bytes(c.try_into().expect("8 bytes"));
                        }
                    } else {
                        decode_into(self.common, &row, &mut vals);
                        sum.iter_mut().zip(&vals).for_each(|(s, &v)| *s += v as f64);
                    }
                }
                sum.iter_mut().for_each(|s| *s /= self.tokens() as f64);
                sum
            })
            .collect()
    }
}

/// A token's row from its configured source.
fn configured(
    vocab: &MergedVocab,
    src: &EmbedSource,
    tok: &str,
    present: &[Option<u64>],
    rows: &[u64],
    index: impl Fn(&Path) -> Option<usize>,
) -> Result<DefaultRow, String> {
    let model = match src {
        EmbedSource::Zero => return Ok(DefaultRow::Zero),
        EmbedSource::Model(m) | EmbedSource::ModelToken { model: m, .. } => m,
    };
    let input = index(model).ok_or_else(|| {
        format!(
            "token {tok:?} takes its row from model {}, which this tensor is not merged from",
            model.display()
        )
    })?;
    let row = match src {
        EmbedSource::ModelToken {
            token: TokenRef::Text(t),
            ..
        } => *vocab.originals.get(model).and_then(|v| v.get(t)).ok_or_else(|| {
            format!(
                "token {tok:?} takes the row of token {t:?} of model {}, whose tokenizer has no such token",
                model.display()
            )
        })?,
        EmbedSource::ModelToken {
            token: TokenRef::Id(i),
            ..
        } => *i,
        _ => present[input].ok_or_else(|| {
            format!(
                "token {tok:?} takes its row from model {}, whose tokenizer lacks it",
                model.display()
            )
        })?,
    };
    if row >= rows[input] {
        return Err(format!(
            "token {tok:?} takes row {row} of model {}, whose tensor has {} rows",
            model.display(),
            rows[input]
        ));
    }
    Ok(DefaultRow::Copy { input, row })
}

/// mergekit's `assign_embedding_sources`: the only model that has the token, else the base
/// when it has it, else the average of those that have it; zeros when none has it.
fn automatic(present: &[Option<u64>], base: Option<usize>) -> DefaultRow {
    let have: Vec<(usize, u64)> = present
        .iter()
        .enumerate()
        .filter_map(|(k, p)| p.map(|r| (k, r)))
        .collect();
    match (have.len(), base.and_then(|b| present[b].map(|r| (b, r)))) {
        (0, _) => DefaultRow::Zero,
        (1, _) => DefaultRow::Copy {
            input: have[0].0,
            row: have[0].1,
        },
        (_, Some((input, row))) => DefaultRow::Copy { input, row },
        _ => DefaultRow::Average(have),
    }
}

/// The merge of one vocabulary tensor: each input's rows remapped, then the method.
#[derive(Clone, Debug)]
pub struct RemapOp {
    /// The method, over remapped inputs (all in the common dtype, the output's shape).
    inner: MergeOp,
    plan: Arc<RowPlan>,
    /// Each input's bytes.
    in_bytes: Vec<u64>,
}

impl RemapOp {
    pub fn new(inner: MergeOp, plan: RowPlan, in_bytes: Vec<u64>) -> RemapOp {
        RemapOp {
            inner,
            plan: Arc::new(plan),
            in_bytes,
        }
    }

    fn common_size(&self) -> usize {
        self.plan.common.size().expect("float dtypes have a size")
    }
}

impl SetDst for RemapOp {
    fn dst_mut(&mut self) -> &mut DType {
        &mut self.inner.dst
    }
}

impl Op for RemapOp {
    fn name(&self) -> &'static str {
        self.inner.name()
    }
    fn units(&self) -> u64 {
        self.plan.padded_rows * self.plan.row_len as u64
    }
    fn out_unit_bytes(&self) -> u64 {
        self.inner.out_unit_bytes()
    }
    fn in_unit_bytes(&self) -> u64 {
        self.in_bytes
            .iter()
            .sum::<u64>()
            .div_ceil(self.units().max(1))
    }
    fn granularity(&self) -> u64 {
        self.units().max(1)
    }
    fn scratch_unit_bytes(&self) -> u64 {
        self.inner.scratch_unit_bytes() + (self.in_bytes.len() * self.common_size()) as u64
    }
    fn input_ranges(&self, _units: Range<u64>) -> Vec<Range<u64>> {
        self.in_bytes.iter().map(|&b| 0..b).collect()
    }
    fn compute(&self, units: Range<u64>, inputs: &[&[u8]], out: &mut [u8]) -> Result<(), String> {
        let p = &*self.plan;
        let means = p.means(inputs);
        let row_bytes = p.row_len * self.common_size();
        let rows = p.padded_rows as usize;
        let block = if self.inner.granularity() > 1 {
            rows
        } else {
            (BLOCK_BYTES / row_bytes.max(1)).clamp(1, rows.max(1))
        };
        let out_row = p.row_len * self.inner.out_unit_bytes() as usize;
        let mut bufs = vec![Vec::new(); inputs.len()];
        let mut r0 = 0;
        while r0 < rows {
            let r1 = (r0 + block).min(rows);
            for (k, buf) in bufs.iter_mut().enumerate() {
                buf.resize((r1 - r0) * row_bytes, 0);
                for r in r0..r1 {
                    let at = (r - r0) * row_bytes;
                    p.fill(inputs, k, r, &means, &mut buf[at..at + row_bytes]);
                }
            }
            let views: Vec<&[u8]> = bufs.iter().map(Vec::as_slice).collect();
            let span = (r0 * p.row_len) as u64..(r1 * p.row_len) as u64;
            self.inner
                .compute(span, &views, &mut out[r0 * out_row..r1 * out_row])?;
            r0 = r1;
        }
        debug_assert_eq!(units.end - units.start, self.units());
        Ok(())
    }
}
