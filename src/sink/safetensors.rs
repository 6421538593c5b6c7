//! The safetensors sink: shard assignment and byte layout of the output, planned so untouched
//! tensors can share extents with the input.
//!
//! A filesystem can clone (reflink) a range only between offsets that are congruent modulo its
//! block size, and safetensors allows no holes between tensors. So: output shards follow the
//! input's shard boundaries unless `--max-shard-size` asks for repacking; within a shard the
//! untouched tensors come first, in input order, and the header is padded with spaces so the
//! first one starts at the same offset modulo [`CLONE_ALIGN_BYTES`] as in its input file; a
//! computed tensor whose size restores the congruence is slotted in where a gap in the input
//! would break it, the rest follow the untouched ones. A shard identical to an input shard
//! (same tensors, names, order and metadata) reuses the input header verbatim and is cloned
//! whole. The layout depends only on the inputs and arguments, never on the filesystem.

use std::os::unix::fs::FileExt;

use serde_json::{Map, Value};

use super::{Layout, OutShard, OutputKind, Sink, CLONE_ALIGN_BYTES, DEFAULT_MAX_SHARD_BYTES};
use crate::error::{Error, Result};
use crate::format::checkpoint::Checkpoint;
use crate::format::header::serialize_entries;
use crate::plan::{Plan, PlannedTensor, Recipe};

/// Safetensors output: one file, or a directory of shards with their index.
#[derive(Debug)]
pub struct Safetensors {
    pub kind: OutputKind,
    /// `--max-shard-size`; `None` keeps the input's shard boundaries.
    pub max_shard_bytes: Option<u64>,
}

impl Sink for Safetensors {
    fn copies_side_files(&self) -> bool {
        matches!(self.kind, OutputKind::Dir)
    }

    fn layout(&self, ckpt: &Checkpoint, plan: &Plan, _sharing: bool) -> Result<Layout> {
        let mut metadata = ckpt.metadata().cloned().unwrap_or_default();
        metadata.remove("total_size");
        metadata.insert("format".into(), Value::from("pt"));
        let shards = assign_shards(
            ckpt,
            &plan.tensors,
            &self.kind,
            self.max_shard_bytes,
            &metadata,
        )?;
        Ok(Layout {
            kind: self.kind.clone(),
            shards,
        })
    }
}
/// Reference writers start the data buffer at a multiple of 8.
pub const HEADER_ALIGN_BYTES: u64 = 8;

/// Absolute input offset of a copied tensor, `None` for computed ones.
fn copy_source(ckpt: &Checkpoint, t: &PlannedTensor) -> Option<(usize, u64)> {
    match t.recipe {
        Recipe::Copy { src } => ckpt.tensors[src].contiguous(),
        Recipe::Compute { .. } | Recipe::Produced { .. } => None,
    }
}

fn primary_shard(ckpt: &Checkpoint, tensors: &[PlannedTensor], i: usize) -> usize {
    match &tensors[i].recipe {
        Recipe::Copy { src } => ckpt.tensors[*src].shard(),
        Recipe::Compute { .. } => ckpt.tensors[tensors[i].source_index].shard(),
        Recipe::Produced { by } => primary_shard(ckpt, tensors, *by),
    }
}

fn group_tensors(
    ckpt: &Checkpoint,
    tensors: &[PlannedTensor],
    kind: &OutputKind,
    max_shard_bytes: Option<u64>,
) -> Vec<Vec<usize>> {
    if matches!(kind, OutputKind::File) {
        return vec![(0..tensors.len()).collect()];
    }
    let limit = max_shard_bytes.unwrap_or(DEFAULT_MAX_SHARD_BYTES);
    let keep_boundaries = max_shard_bytes.is_none();
    let mut groups: Vec<Vec<usize>> = vec![Vec::new()];
    let mut current = 0u64;
    let mut last_shard = None;
    for (i, t) in tensors.iter().enumerate() {
        let shard = primary_shard(ckpt, tensors, i);
        let group = groups.last_mut().expect("never empty");
        let full = current + t.nbytes > limit;
        let boundary = keep_boundaries && last_shard.is_some_and(|s| s != shard);
        if !group.is_empty() && (full || boundary) {
            groups.push(vec![i]);
            current = t.nbytes;
        } else {
            group.push(i);
            current += t.nbytes;
        }
        last_shard = Some(shard);
    }
    groups
}

/// A misaligned untouched tensor at least this large starts a shard of its own (directory
/// output only), whose header padding aligns it again: one more shard is cheap, copying it is not.
pub const REALIGN_MIN_BYTES: u64 = 1 << 20;

/// Orders a group: untouched tensors first in input order, computed tensors slotted in where
/// they restore the congruence, the rest at the end. Returns the order and the positions in it
/// where a large untouched tensor is still misaligned.
fn arrange(
    ckpt: &Checkpoint,
    tensors: &[PlannedTensor],
    group: &[usize],
) -> (Vec<usize>, Vec<usize>) {
    let a = CLONE_ALIGN_BYTES;
    let copies: Vec<usize> = group
        .iter()
        .copied()
        .filter(|&i| copy_source(ckpt, &tensors[i]).is_some())
        .collect();
    let mut computed: Vec<usize> = group
        .iter()
        .copied()
        .filter(|&i| copy_source(ckpt, &tensors[i]).is_none())
        .collect();
    let Some(&first) = copies.first() else {
        return (computed, Vec::new());
    };
    let mut breaks = Vec::new();
    let residue = copy_source(ckpt, &tensors[first]).expect("a copy").1 % a;
    let mut order = Vec::with_capacity(group.len());
    // Position of the next byte, modulo the clone alignment, with the header included.
    let mut phase = residue;
    for &c in &copies {
        let want = copy_source(ckpt, &tensors[c]).expect("a copy").1 % a;
        if phase != want {
            let gap = (want + a - phase) % a;
            if let Some(k) = computed.iter().position(|&i| tensors[i].nbytes % a == gap) {
                let filler = computed.remove(k);
                phase = (phase + tensors[filler].nbytes) % a;
                order.push(filler);
            }
            if phase != want && tensors[c].nbytes >= REALIGN_MIN_BYTES {
                breaks.push(order.len());
                phase = want;
            }
        }
        order.push(c);
        phase = (phase + tensors[c].nbytes) % a;
    }
    order.extend(computed);
    (order, breaks)
}

/// Header length residue that aligns the first untouched tensor of a shard, if it has one.
fn header_residue(ckpt: &Checkpoint, tensors: &[PlannedTensor], order: &[usize]) -> Option<u64> {
    order
        .iter()
        .find_map(|&i| copy_source(ckpt, &tensors[i]))
        .map(|(_, off)| off % CLONE_ALIGN_BYTES)
}

/// The input shard this group reproduces exactly, if any, with its header bytes.
fn identical_input_shard(
    ckpt: &Checkpoint,
    tensors: &[PlannedTensor],
    order: &[usize],
    metadata: &Map<String, Value>,
) -> Result<Option<(usize, Vec<u8>)>> {
    let Some(&first) = order.first() else {
        return Ok(None);
    };
    let Some((shard, _)) = copy_source(ckpt, &tensors[first]) else {
        return Ok(None);
    };
    let src = &ckpt.shards[shard];
    let Some(span) = src.span.clone() else {
        return Ok(None);
    };
    if span.len() != order.len() || src.header.metadata.as_ref() != Some(metadata) {
        return Ok(None);
    }
    for (&i, k) in order.iter().zip(span) {
        let t = &tensors[i];
        let info = &ckpt.tensors[k].info;
        let same = matches!(t.recipe, Recipe::Copy { src: s } if s == k)
            && t.name == info.name
            && t.dtype == info.dtype;
        if !same {
            return Ok(None);
        }
    }
    let mut header = vec![0u8; src.header.data_start as usize];
    src.file
        .read_exact_at(&mut header, 0)
        .map_err(|e| Error::io(&src.path, e))?;
    Ok(Some((shard, header)))
}

pub fn assign_shards(
    ckpt: &Checkpoint,
    tensors: &[PlannedTensor],
    kind: &OutputKind,
    max_shard_bytes: Option<u64>,
    metadata: &Map<String, Value>,
) -> Result<Vec<OutShard>> {
    let mut orders = Vec::new();
    for group in group_tensors(ckpt, tensors, kind, max_shard_bytes) {
        let (order, breaks) = arrange(ckpt, tensors, &group);
        if matches!(kind, OutputKind::File) {
            orders.push(order);
            continue;
        }
        let mut start = 0;
        for b in breaks.into_iter().chain([order.len()]) {
            if b > start {
                orders.push(order[start..b].to_vec());
            }
            start = b;
        }
    }
    // An empty output (`--allow-empty`) is still a loadable checkpoint: one shard, no tensors.
    if orders.is_empty() {
        orders.push(Vec::new());
    }
    let n = orders.len();
    let mut shards = Vec::with_capacity(n);
    for (k, order) in orders.into_iter().enumerate() {
        let residue = header_residue(ckpt, tensors, &order);
        // Data offsets relative to the data buffer; the header borrows names and shapes.
        let mut begins = Vec::with_capacity(order.len() + 1);
        let mut begin = 0;
        for &i in &order {
            begins.push(begin);
            begin += tensors[i].nbytes;
        }
        let entries = || {
            order.iter().zip(&begins).map(|(&i, &b)| {
                let t = &tensors[i];
                (
                    t.name.as_str(),
                    t.dtype,
                    t.shape.as_slice(),
                    b,
                    b + t.nbytes,
                )
            })
        };
        let (header, clone_from) = match identical_input_shard(ckpt, tensors, &order, metadata)? {
            Some((s, bytes)) => (bytes, Some(s)),
            None => {
                let minimal = serialize_entries(metadata, entries(), 1).len() as u64;
                let len = match residue {
                    Some(r) => {
                        minimal
                            + (r + CLONE_ALIGN_BYTES - minimal % CLONE_ALIGN_BYTES)
                                % CLONE_ALIGN_BYTES
                    }
                    None => minimal.div_ceil(HEADER_ALIGN_BYTES) * HEADER_ALIGN_BYTES,
                };
                (serialize_entries(metadata, entries(), len), None)
            }
        };
        let data_start = header.len() as u64;
        shards.push(OutShard {
            file_name: if n == 1 {
                "model.safetensors".into()
            } else {
                format!("model-{:05}-of-{:05}.safetensors", k + 1, n)
            },
            offsets: begins.iter().map(|b| data_start + b).collect(),
            len: data_start + begin,
            header,
            tensors: order,
            clone_from,
        });
    }
    Ok(shards)
}
