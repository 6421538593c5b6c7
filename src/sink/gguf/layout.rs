//! GGUF file layout: header bytes, tensor order and every tensor's absolute offset, planned
//! before a byte of tensor data moves; and the `gguf-split` convention for several files.
//!
//! Layout (v3, little-endian): `"GGUF"`, `version: u32 = 3`, `n_tensors: u64`, `n_kv: u64`, the
//! KVs, the tensor infos (`name`, `n_dims: u32`, dims innermost first `u64`s, `type: u32`,
//! `offset: u64` relative to the data section), zero padding to `general.alignment` (32 when the
//! key is absent, as gguf-py writes it), then the data. llama.cpp's loader (`gguf.cpp`) insists
//! that each offset equals the previous offset plus the previous tensor's size rounded up to the
//! alignment: no gaps, no other order. gguf-py also pads after the last tensor.
//!
//! **Reflink-friendly order.** A tensor copied unchanged from a safetensors shard can share
//! extents with it only if its output offset is congruent to its source offset modulo the
//! filesystem block (4 KiB on XFS/btrfs). Offsets are fixed by the order and by where the data
//! section starts, so the planner (1) groups copied tensors into *runs* that were contiguous in
//! their source and keep their relative offsets when packed (each size a multiple of the
//! alignment), (2) places the largest run first and moves the data start onto its phase by the
//! length of a padding string KV ([`PAD_KEY`], ignored by llama.cpp), and (3) puts in front of
//! each further run a set of other tensors whose padded sizes make up the missing phase (a
//! subset sum modulo the block, 128 residues at 32-byte alignment). Runs no subset can phase are
//! placed after, unshared. A source offset that is not a multiple of the alignment can never be
//! congruent: safetensors data starts at `8 + header length`, so only about one shard in four
//! (header padded to 8 by the reference writer) has usable offsets at 32-byte alignment.

use std::collections::HashMap;

use super::kv::{encode_str, Metadata, Value};
use super::GgmlType;
use crate::error::{Error, Result};

pub const GGUF_MAGIC: &[u8; 4] = b"GGUF";
pub const GGUF_VERSION: u32 = 3;
pub const DEFAULT_ALIGNMENT_BYTES: u64 = 32;
/// The filesystem block reflinks need (XFS, btrfs, ext4 page size).
pub const REFLINK_BLOCK_BYTES: u64 = 4096;
/// `GGML_MAX_NAME`: names must be shorter than this.
pub const MAX_NAME_BYTES: usize = 64;
/// `GGML_MAX_DIMS`.
pub const MAX_DIMS: usize = 4;
/// The string KV whose length moves the data section onto the phase copied tensors need.
pub const PAD_KEY: &str = "tftf.reflink_padding";

/// Where an unchanged tensor's bytes come from: which source file (any id the caller uses) and
/// the absolute offset in it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct SourceRange {
    pub file: u32,
    pub offset: u64,
}

/// One output tensor as the planner needs it.
#[derive(Debug, Clone, PartialEq)]
pub struct TensorSpec {
    pub name: String,
    pub ty: GgmlType,
    /// Outermost first, as PyTorch and safetensors; GGUF stores it reversed.
    pub shape: Vec<u64>,
    pub byte_len: u64,
    /// Set when the bytes are copied unchanged from a source file.
    pub source: Option<SourceRange>,
}

/// A tensor at its place in one output file.
#[derive(Debug, Clone, PartialEq)]
pub struct PlacedTensor {
    pub spec: TensorSpec,
    /// Absolute offset in the output file.
    pub offset: u64,
    /// Whether `offset ≡ source offset (mod REFLINK_BLOCK_BYTES)`.
    pub congruent: bool,
}

/// Everything a writer needs for one output file.
#[derive(Debug, Clone, PartialEq)]
pub struct FilePlan {
    /// Header, KVs, tensor infos and the padding up to the data section.
    pub header: Vec<u8>,
    /// In file order.
    pub tensors: Vec<PlacedTensor>,
    pub data_start: u64,
    /// Including the zero padding after the last tensor.
    pub file_len: u64,
    pub alignment: u64,
}

impl FilePlan {
    /// Bytes of copied tensors, and of those at a congruent offset.
    pub fn copied_and_congruent_bytes(&self) -> (u64, u64) {
        self.tensors
            .iter()
            .filter(|t| t.spec.source.is_some())
            .fold((0, 0), |(c, s), t| {
                (
                    c + t.spec.byte_len,
                    s + if t.congruent { t.spec.byte_len } else { 0 },
                )
            })
    }

    /// Fraction of copied bytes at a congruent offset (1.0 when nothing is copied).
    pub fn shared_fraction(&self) -> f64 {
        let (copied, congruent) = self.copied_and_congruent_bytes();
        if copied == 0 {
            1.0
        } else {
            congruent as f64 / copied as f64
        }
    }
}

/// Layout choices.
#[derive(Debug, Clone, Copy)]
pub struct LayoutOptions {
    /// Data alignment; anything but 32 is written as `general.alignment`.
    pub alignment: u64,
    /// Block size for congruence; `None` keeps the given order and adds no padding KV.
    pub reflink_block: Option<u64>,
}

impl Default for LayoutOptions {
    fn default() -> Self {
        LayoutOptions {
            alignment: DEFAULT_ALIGNMENT_BYTES,
            reflink_block: Some(REFLINK_BLOCK_BYTES),
        }
    }
}

pub fn pad_to(x: u64, align: u64) -> u64 {
    x.div_ceil(align) * align
}

fn check_tensor(t: &TensorSpec) -> Result<()> {
    let bad = |msg: String| {
        Err(Error::GgufTensor {
            tensor: t.name.clone(),
            msg,
        })
    };
    if t.name.len() >= MAX_NAME_BYTES {
        return bad(format!(
            "name is {} bytes; ggml allows at most {}",
            t.name.len(),
            MAX_NAME_BYTES - 1
        ));
    }
    if t.shape.is_empty() || t.shape.len() > MAX_DIMS {
        return bad(format!(
            "{} dimensions; GGUF tensors have 1 to {MAX_DIMS}",
            t.shape.len()
        ));
    }
    match t.ty.byte_len(&t.shape) {
        Some(n) if n == t.byte_len => Ok(()),
        Some(n) => bad(format!(
            "shape {:?} of {} needs {n} bytes, not {}",
            t.shape,
            t.ty.name(),
            t.byte_len
        )),
        None => bad(format!(
            "shape {:?} is not a whole number of {} blocks",
            t.shape,
            t.ty.name()
        )),
    }
}

fn encode_tensor_info(t: &TensorSpec, rel_offset: u64, out: &mut Vec<u8>) {
    encode_str(&t.name, out);
    out.extend_from_slice(&(t.shape.len() as u32).to_le_bytes());
    for d in t.shape.iter().rev() {
        out.extend_from_slice(&d.to_le_bytes());
    }
    out.extend_from_slice(&t.ty.id().to_le_bytes());
    out.extend_from_slice(&rel_offset.to_le_bytes());
}

/// Header bytes for `metadata` and `tensors` in this order, padded to `alignment`.
fn build_header(metadata: &Metadata, tensors: &[TensorSpec], alignment: u64) -> Vec<u8> {
    let mut out = Vec::new();
    out.extend_from_slice(GGUF_MAGIC);
    out.extend_from_slice(&GGUF_VERSION.to_le_bytes());
    out.extend_from_slice(&(tensors.len() as u64).to_le_bytes());
    out.extend_from_slice(&(metadata.len() as u64).to_le_bytes());
    metadata.encode(&mut out);
    let mut rel = 0u64;
    for t in tensors {
        encode_tensor_info(t, rel, &mut out);
        rel += pad_to(t.byte_len, alignment);
    }
    out.resize(pad_to(out.len() as u64, alignment) as usize, 0);
    out
}

/// Plans one file: chooses the order (when `opts.reflink_block` is set) and the header padding,
/// and returns the header bytes and each tensor's offset.
pub fn plan_file(
    metadata: &Metadata,
    tensors: Vec<TensorSpec>,
    opts: LayoutOptions,
) -> Result<FilePlan> {
    let align = opts.alignment;
    if align == 0 || !align.is_power_of_two() || align > u32::MAX as u64 {
        return Err(Error::GgufTensor {
            tensor: String::new(),
            msg: format!("alignment {align} is not a power of two that fits a u32"),
        });
    }
    let mut seen = HashMap::new();
    for t in &tensors {
        check_tensor(t)?;
        if seen.insert(t.name.as_str(), ()).is_some() {
            return Err(Error::GgufTensor {
                tensor: t.name.clone(),
                msg: "defined twice".into(),
            });
        }
    }
    let mut metadata = metadata.clone();
    metadata.remove(PAD_KEY);
    if align != DEFAULT_ALIGNMENT_BYTES {
        metadata.set("general.alignment", Value::U32(align as u32));
    }
    let (ordered, phase) = match opts.reflink_block {
        Some(block) if block % align == 0 && block > align => {
            order_for_reflink(tensors, align, block)
        }
        _ => (tensors, None),
    };
    let mut header = build_header(&metadata, &ordered, align);
    if let (Some((target, block)), true) = (phase, opts.reflink_block.is_some()) {
        // The string KV adds 8 (key length) + key + 4 (type) + 8 (length) + L bytes.
        metadata.set(PAD_KEY, Value::String(String::new()));
        let base = build_header_len(&metadata, &ordered);
        let d0 = pad_to(base, align);
        let d = d0 + (target + block - d0 % block) % block;
        metadata.set(PAD_KEY, Value::String(" ".repeat((d - base) as usize)));
        header = build_header(&metadata, &ordered, align);
        debug_assert_eq!(header.len() as u64, d);
    }
    let data_start = header.len() as u64;
    let mut offset = data_start;
    let mut placed = Vec::with_capacity(ordered.len());
    for spec in ordered {
        let congruent = match (spec.source, opts.reflink_block) {
            (Some(src), Some(block)) => offset % block == src.offset % block,
            _ => false,
        };
        let next = offset + pad_to(spec.byte_len, align);
        placed.push(PlacedTensor {
            spec,
            offset,
            congruent,
        });
        offset = next;
    }
    Ok(FilePlan {
        header,
        tensors: placed,
        data_start,
        file_len: offset,
        alignment: align,
    })
}

fn build_header_len(metadata: &Metadata, tensors: &[TensorSpec]) -> u64 {
    let infos: u64 = tensors
        .iter()
        .map(|t| 8 + t.name.len() as u64 + 4 + 8 * t.shape.len() as u64 + 4 + 8)
        .sum();
    4 + 4 + 8 + 8 + metadata.encoded_len() + infos
}

/// Orders tensors for congruence; returns the order and, when some run can be phased, the
/// residue (mod block) the data section must start at.
fn order_for_reflink(
    tensors: Vec<TensorSpec>,
    align: u64,
    block: u64,
) -> (Vec<TensorSpec>, Option<(u64, u64)>) {
    // Runs: copied tensors contiguous in one source file, each padded size equal to its size.
    let mut copied: Vec<usize> = (0..tensors.len())
        .filter(|&i| {
            tensors[i]
                .source
                .is_some_and(|s| s.offset % align == 0 && tensors[i].byte_len > 0)
        })
        .collect();
    copied.sort_by_key(|&i| {
        let s = tensors[i].source.unwrap();
        (s.file, s.offset)
    });
    let mut runs: Vec<Vec<usize>> = Vec::new();
    for i in copied {
        let s = tensors[i].source.unwrap();
        let extends = runs.last().is_some_and(|run| {
            let p = &tensors[*run.last().unwrap()];
            let ps = p.source.unwrap();
            ps.file == s.file
                && ps.offset + p.byte_len == s.offset
                && p.byte_len.is_multiple_of(align)
        });
        match runs.last_mut() {
            Some(run) if extends => run.push(i),
            _ => runs.push(vec![i]),
        }
    }
    let run_bytes = |run: &Vec<usize>| run.iter().map(|&i| tensors[i].byte_len).sum::<u64>();
    runs.sort_by_key(|r| std::cmp::Reverse(run_bytes(r)));
    let in_run: std::collections::HashSet<usize> = runs.iter().flatten().copied().collect();
    let mut free: Vec<usize> = (0..tensors.len()).filter(|i| !in_run.contains(i)).collect();

    let units = block / align;
    let mut order: Vec<usize> = Vec::with_capacity(tensors.len());
    let mut phase = None;
    let mut rel = 0u64; // bytes placed so far, relative to the data start
    let mut unplaced_runs = Vec::new();
    for run in runs {
        let src = tensors[run[0]].source.unwrap().offset % block;
        match phase {
            None => {
                phase = Some(src);
            }
            Some(d) => {
                let need = (src + block - (d + rel) % block) % block / align;
                let residues: Vec<u64> = free
                    .iter()
                    .map(|&i| pad_to(tensors[i].byte_len, align) / align % units)
                    .collect();
                match subset_with_residue(&residues, need, units) {
                    Some(picked) => {
                        let mut keep = Vec::with_capacity(free.len());
                        for (k, &i) in free.iter().enumerate() {
                            if picked.contains(&k) {
                                order.push(i);
                                rel += pad_to(tensors[i].byte_len, align);
                            } else {
                                keep.push(i);
                            }
                        }
                        free = keep;
                    }
                    None => {
                        unplaced_runs.push(run);
                        continue;
                    }
                }
            }
        }
        for &i in &run {
            order.push(i);
            rel += pad_to(tensors[i].byte_len, align);
        }
    }
    order.extend(free);
    order.extend(unplaced_runs.into_iter().flatten());
    let mut slots: Vec<Option<TensorSpec>> = tensors.into_iter().map(Some).collect();
    let ordered = order.iter().map(|&i| slots[i].take().unwrap()).collect();
    (ordered, phase.map(|p| (p, block)))
}

/// Indices of a subset whose residues sum to `target` modulo `m` (0/1 choice), if any.
fn subset_with_residue(residues: &[u64], target: u64, m: u64) -> Option<Vec<usize>> {
    if target == 0 {
        return Some(Vec::new());
    }
    let m = m as usize;
    // parent[r] = (item, previous residue) for the first way r was reached.
    let mut parent: Vec<Option<(usize, usize)>> = vec![None; m];
    let mut reached = vec![false; m];
    reached[0] = true;
    for (k, &r) in residues.iter().enumerate() {
        let snapshot: Vec<usize> = (0..m).filter(|&x| reached[x]).collect();
        for x in snapshot {
            let y = (x + r as usize) % m;
            if !reached[y] {
                reached[y] = true;
                parent[y] = Some((k, x));
            }
        }
        if reached[target as usize] {
            let mut picked = Vec::new();
            let mut at = target as usize;
            while at != 0 {
                let (item, prev) = parent[at].unwrap();
                picked.push(item);
                at = prev;
            }
            return Some(picked);
        }
    }
    None
}

/// Size limits for splitting, as `convert_hf_to_gguf.py --split-max-tensors/--split-max-size`
/// (0 = no limit). The size counts tensor bytes without padding, in the unit the user gave
/// (`K`/`M`/`G` are powers of 1000: [`parse_split_size`]).
#[derive(Debug, Clone, Copy, Default)]
pub struct SplitLimits {
    pub max_tensors: u64,
    pub max_bytes: u64,
}

/// `--split-max-size` as the reference parses it: a number, optionally followed by `K`, `M` or
/// `G` (decimal: 1000, 10^6, 10^9).
pub fn parse_split_size(s: &str) -> Option<u64> {
    let (digits, mul) = match s.as_bytes().last()? {
        b'K' => (&s[..s.len() - 1], 1000),
        b'M' => (&s[..s.len() - 1], 1000 * 1000),
        b'G' => (&s[..s.len() - 1], 1000 * 1000 * 1000),
        _ => (s, 1),
    };
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    digits.parse::<u64>().ok()?.checked_mul(mul)
}

/// Groups tensors (in the given order) into files the way gguf-py's writer does: a new file
/// starts when the current one is non-empty and would exceed either limit.
pub fn split_tensors(tensors: Vec<TensorSpec>, limits: SplitLimits) -> Vec<Vec<TensorSpec>> {
    let mut files: Vec<Vec<TensorSpec>> = vec![Vec::new()];
    let mut bytes = 0u64;
    for t in tensors {
        let cur = files.last().unwrap();
        if !cur.is_empty()
            && ((limits.max_tensors != 0 && cur.len() as u64 >= limits.max_tensors)
                || (limits.max_bytes != 0 && bytes + t.byte_len > limits.max_bytes))
        {
            files.push(Vec::new());
            bytes = 0;
        }
        bytes += t.byte_len;
        files.last_mut().unwrap().push(t);
    }
    files
}

/// `{stem}-00001-of-00003.gguf` (gguf-py's `SHARD_NAME_FORMAT`, llama.cpp's `llama_split_path`).
pub fn split_file_name(stem: &str, index: usize, count: usize) -> String {
    format!("{stem}-{:05}-of-{:05}.gguf", index + 1, count)
}

pub const SPLIT_NO_KEY: &str = "split.no";
pub const SPLIT_COUNT_KEY: &str = "split.count";
pub const SPLIT_TENSORS_COUNT_KEY: &str = "split.tensors.count";

/// Plans every output file: one file with all metadata when the limits allow it (or when there
/// is only one tensor, as the reference does), otherwise the first file carries all metadata
/// and each file gets `split.no` (u16), `split.count` (u16), `split.tensors.count` (i32).
pub fn plan(
    metadata: &Metadata,
    tensors: Vec<TensorSpec>,
    limits: SplitLimits,
    opts: LayoutOptions,
) -> Result<Vec<FilePlan>> {
    let total = tensors.len();
    let groups = if total <= 1 {
        vec![tensors]
    } else {
        split_tensors(tensors, limits)
    };
    let count = groups.len();
    if count == 1 {
        let only = groups.into_iter().next().unwrap();
        return Ok(vec![plan_file(metadata, only, opts)?]);
    }
    if count > u16::MAX as usize || total > i32::MAX as usize {
        return Err(Error::GgufTensor {
            tensor: String::new(),
            msg: format!("{count} split files / {total} tensors exceed the split keys' range"),
        });
    }
    groups
        .into_iter()
        .enumerate()
        .map(|(i, group)| {
            let mut m = if i == 0 {
                metadata.clone()
            } else {
                Metadata::new()
            };
            m.set(SPLIT_NO_KEY, Value::U16(i as u16));
            m.set(SPLIT_COUNT_KEY, Value::U16(count as u16));
            m.set(SPLIT_TENSORS_COUNT_KEY, Value::I32(total as i32));
            plan_file(&m, group, opts)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(name: &str, len: u64, src: Option<u64>) -> TensorSpec {
        TensorSpec {
            name: name.into(),
            ty: GgmlType::F16,
            shape: vec![len / 2],
            byte_len: len,
            source: src.map(|offset| SourceRange { file: 0, offset }),
        }
    }

    #[test]
    fn subset_sum_finds_the_missing_phase() {
        let r = [3, 5, 7];
        let picked = subset_with_residue(&r, 12, 16).unwrap();
        assert_eq!(picked.iter().map(|&k| r[k]).sum::<u64>() % 16, 12);
        assert_eq!(subset_with_residue(&[2, 4], 3, 16), None);
        assert_eq!(subset_with_residue(&[], 0, 16), Some(vec![]));
    }

    #[test]
    fn split_size_units_are_decimal() {
        assert_eq!(parse_split_size("5G"), Some(5_000_000_000));
        assert_eq!(parse_split_size("300M"), Some(300_000_000));
        assert_eq!(parse_split_size("7K"), Some(7000));
        assert_eq!(parse_split_size("123"), Some(123));
        assert_eq!(parse_split_size("5GB"), None);
        assert_eq!(parse_split_size("G"), None);
    }

    #[test]
    fn two_runs_are_phased_with_a_spacer() {
        // Run A at source 8192 (phase 0), run B in another file at phase 1024; a computed
        // tensor of 1024 bytes can make up B's phase after A (A is 4096 bytes).
        let mut b = spec("b", 2048, None);
        b.source = Some(SourceRange {
            file: 1,
            offset: 4096 * 3 + 1024,
        });
        let tensors = vec![
            spec("free_small", 1024, None),
            b,
            spec("a", 4096, Some(8192)),
            spec("free_other", 96, None),
        ];
        let p = plan_file(&Metadata::new(), tensors, LayoutOptions::default()).unwrap();
        assert_eq!(p.shared_fraction(), 1.0);
        let names: Vec<_> = p.tensors.iter().map(|t| t.spec.name.as_str()).collect();
        assert_eq!(names, ["a", "free_small", "b", "free_other"]);
        assert_eq!(p.data_start % 4096, 0);
        assert_eq!(p.header.len() as u64, p.data_start);
    }

    #[test]
    fn misaligned_sources_are_reported_unshared() {
        let p = plan_file(
            &Metadata::new(),
            vec![spec("a", 64, Some(8))],
            LayoutOptions::default(),
        )
        .unwrap();
        assert_eq!(p.shared_fraction(), 0.0);
        assert!(!p
            .header
            .windows(PAD_KEY.len())
            .any(|w| w == PAD_KEY.as_bytes()));
    }

    #[test]
    fn bad_tensors_are_rejected() {
        let long = "x".repeat(64);
        for t in [
            spec(&long, 64, None),
            TensorSpec {
                shape: vec![1, 1, 1, 1, 32],
                ..spec("five_dims", 64, None)
            },
            TensorSpec {
                byte_len: 66,
                ..spec("wrong_len", 64, None)
            },
        ] {
            let err = plan_file(&Metadata::new(), vec![t], LayoutOptions::default());
            assert!(matches!(err, Err(Error::GgufTensor { .. })), "{err:?}");
        }
        let dup = plan_file(
            &Metadata::new(),
            vec![spec("d", 64, None), spec("d", 64, None)],
            LayoutOptions::default(),
        );
        assert!(matches!(dup, Err(Error::GgufTensor { .. })));
    }
}
