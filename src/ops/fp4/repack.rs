//! `repack-fp4`: MXFP4 experts → NVFP4 and E4M3 Engram tables → E2M1, as one planning step.
//!
//! The tensor scale `2^g` of each expert (shared by `w1` and `w3`, which engines fuse and give
//! the larger tensor scale) is chosen from the data, so planning reads the experts' E8M0 scales
//! (1/16 of the expert bytes). Only where a group's exponents span more than the 18 powers an
//! E4M3 block scale holds does it also read the weights, to leave all-zero blocks (exact under
//! any scale) out of the choice. Because this happens before any output exists, `--dry-run`
//! already reports every tensor's `g`, exact and re-encoded block counts, and
//! `--require-lossless` fails before writing.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use regex::Regex;
use serde_json::{json, Map, Value};

use super::engram::{EngramRequant, BLOCK};
use super::nvfp4::{block_scale_code, choose_g, NvBlockScales, NvReencode};
use crate::error::{Error, Result, ScaleOf};
use crate::format::checkpoint::Checkpoint;
use crate::format::dtype::DType;
use crate::ops::constant::Constant;
use crate::plan::{index_by_name, Entry, ExtraOutput, FixedOp, PlanNotes, PlanStep, Planning};

pub const DEFAULT_EXPERT_PATTERN: &str =
    r"^(?P<prefix>(?:.*\.)?(?:layers|mtp)\.\d+\.ffn\.experts\.\d+)\.(?P<proj>w[123])\.weight$";
pub const DEFAULT_ENGRAM_PATTERN: &str =
    r"^(?P<prefix>(?:.*\.)?layers\.\d+\.engram\.embed)\.weight$";

#[derive(Debug, Clone)]
pub enum ShardSelection {
    /// The first N input shards (in name order).
    First(usize),
    /// Input shards by file name.
    Names(Vec<String>),
}

#[derive(Debug)]
pub struct RepackOptions {
    pub experts: bool,
    pub engram: bool,
    pub require_lossless: bool,
    pub expert_pattern: Regex,
    pub engram_pattern: Regex,
    pub shards: Option<ShardSelection>,
    pub config_update: bool,
}

#[derive(Debug)]
pub struct RepackFp4Step {
    pub opts: RepackOptions,
    did_experts: AtomicBool,
    did_engram: AtomicBool,
    keep_scales_cached: AtomicBool,
}

impl RepackFp4Step {
    pub fn new(opts: RepackOptions) -> RepackFp4Step {
        RepackFp4Step {
            opts,
            did_experts: AtomicBool::new(false),
            did_engram: AtomicBool::new(false),
            keep_scales_cached: AtomicBool::new(false),
        }
    }
}

/// An MXFP4 expert weight's fused-group prefix, projection and E8M0 scale name
/// (`<prefix>.<proj>.scale`), from the expert pattern's captures.
fn expert_parts(c: &regex::Captures) -> (String, String, String) {
    let prefix = c.name("prefix").map_or("", |m| m.as_str()).to_string();
    let proj = c.name("proj").map_or("", |m| m.as_str()).to_string();
    let scale = format!("{prefix}.{proj}.scale");
    (prefix, proj, scale)
}

/// The scale an `I8`/`U8` tensor named like an MXFP4 expert weight (the default
/// `--expert-pattern`) needs, or `None` for any other tensor. `validate` checks it exists.
pub fn mxfp4_expert_scale(name: &str, dtype: DType) -> Option<String> {
    static RE: std::sync::OnceLock<Regex> = std::sync::OnceLock::new();
    let re = RE.get_or_init(|| Regex::new(DEFAULT_EXPERT_PATTERN).expect("valid regex"));
    if !matches!(dtype, DType::I8 | DType::U8) {
        return None;
    }
    re.captures(name).map(|c| expert_parts(&c).2)
}

fn read_tensor(
    ckpt: &Checkpoint,
    src: usize,
    range: std::ops::Range<u64>,
    keep_cached: bool,
) -> Result<Vec<u8>> {
    let mut buf = vec![0u8; (range.end - range.start) as usize];
    ckpt.read_tensor_at_cached(&ckpt.tensors[src], range.start, &mut buf, keep_cached)?;
    Ok(buf)
}

/// Expert scales up to this total stay in the page cache between the window choice and the
/// write, which reads them again (measured: the double cold read cost ~15 % of an expert
/// transcode); above it they are dropped, so the cache stays bounded whatever the model size.
const KEEP_SCALES_CACHED_BYTES: u64 = 256 << 20;

/// One expert projection found by the pattern.
struct Expert {
    weight: usize, // entry index
    scale: usize,  // entry index
    rows: u64,
    groups: u64,
}

/// Per-tensor outcome of the window choice.
struct Choice {
    blocks: u64,
    zero_blocks: Option<u64>,
    reencoded: u64,
}

const WEIGHT_READ_ROWS_BYTES: u64 = 8 << 20;

impl RepackFp4Step {
    fn select_shards(
        &self,
        ckpt: &Checkpoint,
        entries: &mut Vec<Entry>,
        notes: &mut PlanNotes,
    ) -> Result<()> {
        let Some(sel) = &self.opts.shards else {
            return Ok(());
        };
        let names = ckpt.shard_names();
        let keep: Vec<bool> = match sel {
            ShardSelection::First(n) => (0..names.len()).map(|i| i < *n).collect(),
            ShardSelection::Names(list) => {
                if let Some(missing) = list.iter().find(|n| !names.contains(n)) {
                    return Err(Error::Usage(format!(
                        "--shard-list names `{missing}`, which is not a shard of {}",
                        ckpt.input.display()
                    )));
                }
                names.iter().map(|n| list.contains(n)).collect()
            }
        };
        entries.retain(|e| keep[ckpt.tensors[e.source].shard()]);
        notes.lines.push(format!(
            "processing {} of {} input shards",
            keep.iter().filter(|k| **k).count(),
            names.len()
        ));
        Ok(())
    }

    fn find_experts(
        &self,
        ckpt: &Checkpoint,
        entries: &[Entry],
    ) -> Result<BTreeMap<String, Vec<(String, Expert)>>> {
        let index = index_by_name(entries);
        let mut found: BTreeMap<String, Vec<(String, Expert)>> = BTreeMap::new();
        for (wi, w) in entries.iter().enumerate() {
            let Some(c) = self.opts.expert_pattern.captures(&w.name) else {
                continue;
            };
            if w.derive.is_some() || !matches!(w.dtype, DType::I8 | DType::U8) {
                continue;
            }
            let (prefix, proj, scale_name) = expert_parts(&c);
            let Some(&si) = index.get(scale_name.as_str()) else {
                return Err(w.missing_scale(ckpt, ScaleOf::Mxfp4Expert, &[scale_name]));
            };
            let s = &entries[si];
            let bad = |msg: String| s.bad_scale(ckpt, &w.name, msg);
            let (&[rows, half], &[srows, groups]) = (w.shape.as_slice(), s.shape.as_slice()) else {
                return Err(bad(format!(
                    "expected a 2-D weight and scale, got {:?} and {:?}",
                    w.shape, s.shape
                )));
            };
            if s.dtype != DType::F8_E8M0 || srows != rows || groups * 16 != half {
                return Err(bad(format!(
                    "expected F8_E8M0 [{rows}, {}] for weight {:?}, got {} {:?}",
                    half / 16,
                    w.shape,
                    s.dtype,
                    s.shape
                )));
            }
            found.entry(prefix).or_default().push((
                proj,
                Expert {
                    weight: wi,
                    scale: si,
                    rows,
                    groups,
                },
            ));
        }
        Ok(found)
    }

    /// Chooses `g` for a fused group and counts each member's blocks.
    fn choose(
        &self,
        ckpt: &Checkpoint,
        entries: &[Entry],
        members: &[(String, Expert)],
    ) -> Result<(i32, Vec<Choice>)> {
        let mut scales = Vec::with_capacity(members.len());
        for (_, x) in members {
            let s = &entries[x.scale];
            let bytes = read_tensor(
                ckpt,
                s.source,
                0..x.rows * x.groups,
                self.keep_scales_cached.load(Ordering::Relaxed),
            )?;
            if let Some(i) = bytes.iter().position(|&b| b == 0xFF) {
                return Err(Error::TensorData {
                    path: s.path(ckpt),
                    tensor: s.name.clone(),
                    msg: format!(
                        "scale at [{}, {}] is NaN (E8M0 0xff)",
                        i as u64 / x.groups,
                        i as u64 % x.groups
                    ),
                });
            }
            scales.push(bytes);
        }
        let (lo, hi) = scales
            .iter()
            .flatten()
            .fold((255u8, 0u8), |(l, h), &b| (l.min(b), h.max(b)));
        if scales.iter().all(|s| s.is_empty()) || (hi as i32 - lo as i32) <= 17 {
            let g = if scales.iter().all(|s| s.is_empty()) {
                0
            } else {
                hi as i32 - 127 - 8
            };
            let choices = scales
                .iter()
                .map(|s| Choice {
                    blocks: s.len() as u64,
                    zero_blocks: None,
                    reencoded: 0,
                })
                .collect();
            return Ok((g, choices));
        }
        // Wide spread: find the all-zero blocks so they do not steer the window.
        let mut zero_flags = Vec::with_capacity(members.len());
        for ((_, x), _) in members.iter().zip(&scales) {
            let w = &entries[x.weight];
            let row_bytes = 16 * x.groups;
            let rows_per_read = (WEIGHT_READ_ROWS_BYTES / row_bytes.max(1)).max(1);
            let mut flags = Vec::with_capacity((x.rows * x.groups) as usize);
            let mut r = 0;
            while r < x.rows {
                let end = (r + rows_per_read).min(x.rows);
                let bytes = read_tensor(ckpt, w.source, r * row_bytes..end * row_bytes, false)?;
                flags.extend(
                    bytes
                        .chunks_exact(16)
                        .map(|b| b.iter().all(|&v| v & 0x77 == 0)),
                );
                r = end;
            }
            zero_flags.push(flags);
        }
        let exps: Vec<i32> = scales
            .iter()
            .zip(&zero_flags)
            .flat_map(|(s, z)| {
                s.iter()
                    .zip(z)
                    .filter(|(_, &zero)| !zero)
                    .map(|(&b, _)| b as i32 - 127)
            })
            .collect();
        let g = choose_g(&exps);
        let choices = scales
            .iter()
            .zip(&zero_flags)
            .map(|(s, z)| Choice {
                blocks: s.len() as u64,
                zero_blocks: Some(z.iter().filter(|&&f| f).count() as u64),
                reencoded: s
                    .iter()
                    .zip(z)
                    .filter(|(&b, &zero)| !zero && !block_scale_code(b as i32 - 127, g).1)
                    .count() as u64,
            })
            .collect();
        Ok((g, choices))
    }

    fn transcode_experts(
        &self,
        ckpt: &Checkpoint,
        entries: &mut Vec<Entry>,
        notes: &mut PlanNotes,
    ) -> Result<bool> {
        let groups = self.find_experts(ckpt, entries)?;
        let scale_bytes: u64 = groups
            .values()
            .flatten()
            .map(|(_, x)| x.rows * x.groups)
            .sum();
        self.keep_scales_cached
            .store(scale_bytes <= KEEP_SCALES_CACHED_BYTES, Ordering::Relaxed);
        let mut next_id = entries
            .iter()
            .map(|e| e.id)
            .max()
            .map_or(0, |m| m + 1)
            .max(ckpt.tensors.len());
        let mut added = Vec::new();
        for (prefix, members) in &groups {
            // w1 and w3 (gate and up) are fused by inference engines: one tensor scale.
            let (fused, single): (Vec<_>, Vec<_>) = members.iter().partition(|(proj, _)| {
                matches!(proj.as_str(), "w1" | "w3" | "gate_proj" | "up_proj")
            });
            let mut sets: Vec<Vec<&(String, Expert)>> =
                single.into_iter().map(|m| vec![m]).collect();
            if !fused.is_empty() {
                sets.push(fused);
            }
            for set in sets {
                let owned: Vec<(String, Expert)> = set
                    .iter()
                    .map(|(p, x)| {
                        (
                            p.clone(),
                            Expert {
                                weight: x.weight,
                                scale: x.scale,
                                rows: x.rows,
                                groups: x.groups,
                            },
                        )
                    })
                    .collect();
                let (g, choices) = self.choose(ckpt, entries, &owned)?;
                let fused_names: Vec<String> =
                    owned.iter().map(|(p, _)| format!("{prefix}.{p}")).collect();
                for ((proj, x), choice) in owned.iter().zip(&choices) {
                    let w_name = entries[x.weight].name.clone();
                    if self.opts.require_lossless && choice.reencoded > 0 {
                        return Err(Error::TensorData {
                            path: entries[x.weight].path(ckpt),
                            tensor: w_name,
                            msg: format!(
                                "{} of {} blocks fall outside the 18 powers of two around 2^{g} and would be re-encoded (--require-lossless)",
                                choice.reencoded, choice.blocks
                            ),
                        });
                    }
                    notes.tensors.push(json!({
                        "tensor": w_name,
                        "op": "mxfp4-to-nvfp4",
                        "g": g,
                        "fused_with": fused_names,
                        "blocks": choice.blocks,
                        "zero_blocks": choice.zero_blocks,
                        "exact_blocks": choice.blocks - choice.reencoded,
                        "reencoded_blocks": choice.reencoded,
                    }));
                    let (wsrc, ssrc) = (entries[x.weight].source, entries[x.scale].source);
                    let w = &mut entries[x.weight];
                    w.dtype = DType::U8;
                    if choice.reencoded == 0 {
                        w.relabel = true;
                    } else {
                        w.derive = Some(Arc::new(FixedOp {
                            inputs: vec![wsrc, ssrc],
                            op: Arc::new(NvReencode {
                                rows: x.rows,
                                groups: x.groups,
                                g,
                            }),
                        }));
                    }
                    let s = &mut entries[x.scale];
                    s.name = format!("{prefix}.{proj}.weight_scale");
                    s.dtype = DType::F8_E4M3;
                    s.shape = vec![x.rows, 2 * x.groups];
                    s.derive = Some(Arc::new(FixedOp {
                        inputs: vec![ssrc],
                        op: Arc::new(NvBlockScales {
                            rows: x.rows,
                            groups: x.groups,
                            g,
                        }),
                    }));
                    added.push((
                        x.scale,
                        Entry {
                            id: next_id,
                            name: format!("{prefix}.{proj}.weight_scale_2"),
                            source: ssrc,
                            dtype: DType::F32,
                            shape: Vec::new(),
                            derive: Some(Arc::new(FixedOp {
                                inputs: Vec::new(),
                                // 2^g with g ≥ -135 is an exact f32 (subnormal below 2^-126).
                                op: Arc::new(Constant {
                                    what: "mxfp4-to-nvfp4 tensor scale",
                                    bytes: (2f64.powi(g) as f32).to_le_bytes().to_vec(),
                                }),
                            })),
                            relabel: false,
                        },
                    ));
                    next_id += 1;
                }
            }
        }
        // Each weight_scale_2 goes right after its weight_scale.
        added.sort_by_key(|(after, _)| std::cmp::Reverse(*after));
        let changed = !added.is_empty();
        for (after, e) in added {
            entries.insert(after + 1, e);
        }
        Ok(changed)
    }

    fn requant_engram(&self, ckpt: &Checkpoint, entries: &mut [Entry]) -> Result<bool> {
        let index = index_by_name(entries);
        let mut changed = false;
        for wi in 0..entries.len() {
            let w = &entries[wi];
            let Some(c) = self.opts.engram_pattern.captures(&w.name) else {
                continue;
            };
            if w.derive.is_some() || w.dtype != DType::F8_E4M3 {
                continue;
            }
            let prefix = c.name("prefix").map_or("", |m| m.as_str()).to_string();
            let path = w.path(ckpt);
            let scale_name = format!("{prefix}.scale");
            let Some(&si) = index.get(&scale_name) else {
                return Err(w.missing_scale(ckpt, ScaleOf::EngramTable, &[scale_name]));
            };
            let s = &entries[si];
            let &[rows, cols] = w.shape.as_slice() else {
                return Err(Error::TensorData {
                    path,
                    tensor: w.name.clone(),
                    msg: format!("expected a 2-D table, got {:?}", w.shape),
                });
            };
            if cols % BLOCK as u64 != 0 || s.dtype != DType::F8_E8M0 || s.shape != [rows, cols / 32]
            {
                return Err(s.bad_scale(
                    ckpt,
                    &w.name,
                    format!(
                        "expected F8_E8M0 [{rows}, {}] for a table of {cols} columns, got {} {:?}",
                        cols / 32,
                        s.dtype,
                        s.shape
                    ),
                ));
            }
            let (wsrc, ssrc, wid) = (w.source, s.source, w.id);
            let w = &mut entries[wi];
            w.dtype = DType::U8;
            w.shape = vec![rows, cols / 2];
            w.derive = Some(Arc::new(FixedOp {
                inputs: vec![wsrc, ssrc],
                op: Arc::new(EngramRequant::new(rows, cols)),
            }));
            entries[si].derive = Some(Arc::new(ExtraOutput {
                primary: wid,
                output: 1,
            }));
            changed = true;
        }
        Ok(changed)
    }
}

impl PlanStep for RepackFp4Step {
    fn apply(&self, p: Planning) -> Result<bool> {
        let (ckpt, entries, notes) = (p.ckpt, p.entries, p.notes);
        self.select_shards(ckpt, entries, notes)?;
        let experts = self.opts.experts && self.transcode_experts(ckpt, entries, notes)?;
        let engram = self.opts.engram && self.requant_engram(ckpt, entries)?;
        self.did_experts.store(experts, Ordering::Relaxed);
        self.did_engram.store(engram, Ordering::Relaxed);
        Ok(experts || engram)
    }

    fn nothing_done(&self) -> String {
        "repack-fp4 found no MXFP4 expert weight (--expert-pattern) or E4M3 Engram table (--engram-pattern) to convert".into()
    }

    fn edit_config(&self, cfg: &mut Map<String, Value>) -> Vec<String> {
        let mut changes = Vec::new();
        if !self.opts.config_update {
            return changes;
        }
        for (did, key, value) in [
            (&self.did_experts, "expert_dtype", "nvfp4"),
            (&self.did_engram, "engram_dtype", "fp4"),
        ] {
            if did.load(Ordering::Relaxed) && cfg.get(key) != Some(&Value::from(value)) {
                changes.push(format!(
                    "config.json: {key} {} -> \"{value}\"",
                    cfg.get(key).map_or("(unset)".into(), |v| v.to_string())
                ));
                cfg.insert(key.into(), Value::from(value));
            }
        }
        changes
    }
}
