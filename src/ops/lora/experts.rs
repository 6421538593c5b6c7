//! Fused expert parameters over a base stored per expert.
//!
//! MoE checkpoints ship one tensor per expert and projection: Qwen3-MoE and the rest of the
//! Qwen2-MoE family `mlp.experts.N.{gate,up,down}_proj.weight`, Mixtral, MiniMax and PhiMoE
//! `block_sparse_moe.experts.N.{w1,w3,w2}.weight`, others `fc1/fc3/fc2`. transformers 5 loads them
//! as two fused parameters of the experts module, `gate_up_proj` `[E, 2I, H]` (each expert's gate
//! rows, then its up rows) and `down_proj` `[E, H, I]`, renaming `block_sparse_moe` to `mlp`, and
//! splits them again when it saves. A PEFT adapter trained with `target_parameters` names the
//! fused parameters, and PEFT's `merge_and_unload` + `save_pretrained` writes the merged experts
//! per expert. So does this module: each stored tensor gets its expert's block of the fused
//! delta (gate the first `I` rows of `gate_up_proj`'s, up the rest), a plain LoRA merge that
//! reads that block of the grouped factors in place ([`ExpertSlice`]) — no fused copy is built.

use std::collections::BTreeMap;
use std::sync::{Arc, OnceLock};

use regex::Regex;

use super::merge::{ExpertSlice, LoraFactors};
use super::{float_base, float_factors, merge_scale, wrapper_rounding, LoraConfig, LoraDerive};
use crate::format::checkpoint::Checkpoint;
use crate::ops::cast::RoundedBase;
use crate::plan::Entry;

/// Per-expert projection names transformers 5 fuses, one family a row: gate, up, down.
const FAMILIES: [[&str; 3]; 3] = [
    ["gate_proj", "up_proj", "down_proj"],
    ["w1", "w3", "w2"],
    ["fc1", "fc3", "fc2"],
];

/// A fused expert parameter the base would be loaded as, and the stored tensors it is made of.
#[derive(Debug)]
pub struct FusedParam {
    /// As transformers 5 names it: `model.layers.0.mlp.experts.gate_up_proj`.
    pub name: String,
    /// `[E, out, in]`: the stored tensors are `nn.Linear` weights.
    pub shape: [u64; 3],
    /// Per expert, the stored tensors whose rows make its `[out, in]` block, in order.
    experts: Vec<Vec<usize>>,
    /// Why the stored tensors do not fuse (an expert missing, shapes that differ); refused when
    /// an adapter targets the parameter.
    problem: Option<String>,
}

fn per_expert_name() -> &'static Regex {
    static RE: OnceLock<Regex> = OnceLock::new();
    RE.get_or_init(|| {
        Regex::new(r"^(?:(.*)\.)?experts\.(\d+)\.([^.]+)\.weight$").expect("a valid regex")
    })
}

/// The experts module transformers 5 loads the experts under `block` as.
fn fused_module(block: &str) -> String {
    match block.rsplit_once('.') {
        Some((pre, "block_sparse_moe")) => format!("{pre}.mlp.experts"),
        None if block == "block_sparse_moe" => "mlp.experts".into(),
        _ if block.is_empty() => "experts".into(),
        _ => format!("{block}.experts"),
    }
}

/// Every fused expert parameter of a base stored per expert.
pub fn fused_params(entries: &[Entry]) -> Vec<FusedParam> {
    // (block, family) → per projection of the family: expert → entry.
    type Slots = [BTreeMap<u64, usize>; 3];
    let mut groups: BTreeMap<(String, usize), Slots> = BTreeMap::new();
    for (i, e) in entries.iter().enumerate() {
        let Some(c) = per_expert_name().captures(&e.name) else {
            continue;
        };
        let found = FAMILIES.iter().enumerate().find_map(|(f, names)| {
            let slot = names.iter().position(|n| *n == &c[3])?;
            Some((f, slot))
        });
        let (Some((family, slot)), Ok(expert)) = (found, c[2].parse::<u64>()) else {
            continue;
        };
        let block = c.get(1).map_or("", |m| m.as_str()).to_string();
        groups.entry((block, family)).or_default()[slot].insert(expert, i);
    }
    let mut out = Vec::new();
    for ((block, family), slots) in groups {
        let module = fused_module(&block);
        for (param, parts) in [("gate_up_proj", &[0, 1][..]), ("down_proj", &[2][..])] {
            if parts.iter().any(|&s| slots[s].is_empty()) {
                continue;
            }
            let parts: Vec<(String, &BTreeMap<u64, usize>)> = parts
                .iter()
                .map(|&s| (per_expert(&block, FAMILIES[family][s]), &slots[s]))
                .collect();
            out.push(fuse(entries, format!("{module}.{param}"), &parts));
        }
    }
    out
}

/// The stored name pattern of one projection of `block`'s experts, `N` for the expert.
fn per_expert(block: &str, proj: &str) -> String {
    match block {
        "" => format!("experts.N.{proj}.weight"),
        _ => format!("{block}.experts.N.{proj}.weight"),
    }
}

/// `name` from the stored tensors `parts` (per projection: its name pattern and expert →
/// entry), each expert's rows in the order of `parts`.
fn fuse(entries: &[Entry], name: String, parts: &[(String, &BTreeMap<u64, usize>)]) -> FusedParam {
    let count = parts
        .iter()
        .filter_map(|(_, m)| m.keys().max())
        .max()
        .map_or(0, |&e| e + 1);
    let mut problem = None;
    let mut experts = Vec::new();
    // Expert 0's shape of each projection, which every expert must have.
    let first: Vec<Option<&Entry>> = parts
        .iter()
        .map(|(_, m)| m.values().next().map(|&i| &entries[i]))
        .collect();
    for e in 0..count {
        let mut ids = Vec::new();
        for ((pattern, m), want) in parts.iter().zip(&first) {
            let stored = pattern.replace(".N.", &format!(".{e}."));
            let why = match (m.get(&e), want) {
                (None, _) => Some(format!("the base has no `{stored}`")),
                (Some(&i), _) if entries[i].shape.len() != 2 => Some(format!(
                    "`{stored}` is {:?}, not a matrix",
                    entries[i].shape
                )),
                (Some(&i), Some(w)) if entries[i].shape != w.shape => Some(format!(
                    "`{stored}` is {:?} but `{}` is {:?}",
                    entries[i].shape, w.name, w.shape
                )),
                (Some(&i), _) => {
                    ids.push(i);
                    None
                }
            };
            if problem.is_none() {
                problem = why;
            }
        }
        experts.push(ids);
    }
    // [out, in] of each projection; gate and up must be as wide.
    let dims: Vec<(u64, u64)> = first
        .iter()
        .map(|w| match w.map(|w| &w.shape[..]) {
            Some(&[rows, cols]) => (rows, cols),
            _ => (0, 0),
        })
        .collect();
    let (out, inn) = (dims.iter().map(|d| d.0).sum(), dims[0].1);
    if problem.is_none() && dims.iter().any(|d| d.1 != inn) {
        problem = Some(format!(
            "its parts differ in width: {}",
            first
                .iter()
                .flatten()
                .map(|w| format!("`{}` {:?}", w.name, w.shape))
                .collect::<Vec<_>>()
                .join(", ")
        ));
    }
    FusedParam {
        name,
        shape: [count, out, inn],
        experts,
        problem,
    }
}

/// Merges the grouped factors `(a, b)` targeting the fused `param` into its stored per-expert
/// tensors, as PEFT does before transformers splits the merged parameter again.
pub fn merge_per_expert(
    param: &FusedParam,
    entries: &mut [Entry],
    ckpt: &Checkpoint,
    cfg: &LoraConfig,
    (a, b): (usize, usize),
    user_scale: f64,
) -> Result<(), String> {
    let module = param.name.as_str();
    let stored = || format!("`{module}`, which the base stores per expert");
    if let Some(p) = &param.problem {
        return Err(format!(
            "{}: {p}, so it cannot be fused and merged",
            stored()
        ));
    }
    let (ai, bi) = (&ckpt.tensors[a].info, &ckpt.tensors[b].info);
    let [experts, out, inn] = param.shape;
    let (r, scale) = cfg.rank_and_scale(module);
    let (&[ar, a_in], &[b_out, br]) = (&ai.shape[..], &bi.shape[..]) else {
        return Err(format!(
            "`{module}`: grouped factors {:?} and {:?} should be 2-D",
            ai.shape, bi.shape
        ));
    };
    if out == 0 || inn == 0 || r == 0 {
        return Err(format!(
            "`{module}`: {} is {:?} with rank {r}: an empty matrix or a rank of 0 leaves nothing to merge; exclude the module from the adapter",
            stored(),
            param.shape
        ));
    }
    if ar != experts * r || br != experts * r {
        return Err(format!(
            "`{module}`: grouped factors {:?} and {:?} do not hold {experts} experts of rank {r}",
            ai.shape, bi.shape
        ));
    }
    if (a_in, b_out) != (inn, out) {
        return Err(format!(
            "`{module}`: factors for in={a_in}, out={b_out} do not fit {} as [experts, out, in] {:?}",
            stored(),
            param.shape
        ));
    }
    float_factors(module, [ai.dtype, bi.dtype])?;
    let f = LoraFactors {
        rank: r,
        a_dtype: ai.dtype,
        b_dtype: bi.dtype,
        m_dtype: None,
        scale: merge_scale(module, scale, user_scale)?,
        transposed: false,
        delta_dtype: None,
    };
    for (index, ids) in (0..).zip(&param.experts) {
        let mut first_row = 0;
        for &wi in ids {
            let delta_dtype = wrapper_rounding(&entries[wi]);
            // A base an earlier cast step rounded is merged rounded, as elsewhere.
            if let Some(rounded) = RoundedBase::of(&entries[wi], ckpt) {
                entries[wi].derive = Some(Arc::new(rounded));
            }
            let w = &entries[wi];
            let derive = LoraDerive {
                prev: w.derive.clone(),
                base: w.source,
                base_dtype: float_base(w, ckpt, module)?,
                rows: w.shape[0],
                cols: w.shape[1],
                expert: ExpertSlice {
                    experts,
                    index,
                    first_row,
                },
                a,
                b,
                m: None,
                f: LoraFactors {
                    delta_dtype,
                    ..f.clone()
                },
            };
            first_row += w.shape[0];
            entries[wi].derive = Some(Arc::new(derive));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::format::dtype::DType;

    fn entries(tensors: &[(&str, &[u64])]) -> Vec<Entry> {
        (0..)
            .zip(tensors)
            .map(|(i, &(name, shape))| Entry {
                id: i,
                name: name.into(),
                source: i,
                dtype: DType::BF16,
                shape: shape.to_vec(),
                derive: None,
                relabel: false,
            })
            .collect()
    }

    /// A fused parameter as (name, shape, stored tensors per expert, problem).
    type Fused = (String, [u64; 3], Vec<Vec<usize>>, Option<String>);

    fn fused(tensors: &[(&str, &[u64])]) -> Vec<Fused> {
        fused_params(&entries(tensors))
            .into_iter()
            .map(|f| (f.name, f.shape, f.experts, f.problem))
            .collect()
    }

    /// Qwen-style and Mixtral-style experts fuse under transformers 5's names, gate rows then up
    /// rows; a dense MLP's projections and other tensors are no experts.
    #[test]
    fn per_expert_tensors_fuse_as_transformers_loads_them() {
        let got = fused(&[
            ("model.layers.0.mlp.experts.1.up_proj.weight", &[8, 24]),
            ("model.layers.0.mlp.experts.0.gate_proj.weight", &[8, 24]),
            ("model.layers.0.mlp.experts.0.up_proj.weight", &[8, 24]),
            ("model.layers.0.mlp.experts.1.gate_proj.weight", &[8, 24]),
            ("model.layers.0.mlp.experts.0.down_proj.weight", &[24, 8]),
            ("model.layers.0.mlp.experts.1.down_proj.weight", &[24, 8]),
            ("model.layers.1.mlp.gate_proj.weight", &[20, 24]),
            (
                "model.layers.1.block_sparse_moe.experts.0.w1.weight",
                &[10, 24],
            ),
            (
                "model.layers.1.block_sparse_moe.experts.0.w3.weight",
                &[10, 24],
            ),
            (
                "model.layers.1.block_sparse_moe.experts.0.w2.weight",
                &[24, 10],
            ),
            ("model.layers.1.block_sparse_moe.gate.weight", &[1, 24]),
        ]);
        let want = vec![
            (
                "model.layers.0.mlp.experts.gate_up_proj".to_string(),
                [2, 16, 24],
                vec![vec![1, 2], vec![3, 0]],
                None,
            ),
            (
                "model.layers.0.mlp.experts.down_proj".to_string(),
                [2, 24, 8],
                vec![vec![4], vec![5]],
                None,
            ),
            (
                "model.layers.1.mlp.experts.gate_up_proj".to_string(),
                [1, 20, 24],
                vec![vec![7, 8]],
                None,
            ),
            (
                "model.layers.1.mlp.experts.down_proj".to_string(),
                [1, 24, 10],
                vec![vec![9]],
                None,
            ),
        ];
        assert_eq!(got, want);
    }

    /// A missing expert or projection, or shapes that differ, make a fused parameter that is
    /// refused (naming the tensor) only when an adapter targets it.
    #[test]
    fn experts_that_do_not_fuse_say_why() {
        let problems = |t: &[(&str, &[u64])]| -> Vec<Option<String>> {
            fused(t).into_iter().map(|f| f.3).collect()
        };
        // w1 and w3 of experts 0 and 2: expert 1 is missing.
        let names: Vec<String> = [0, 2]
            .iter()
            .flat_map(|e| ["w1", "w3"].map(|p| format!("experts.{e}.{p}.weight")))
            .collect();
        let gapped: Vec<(&str, &[u64])> = names.iter().map(|n| (n.as_str(), &[4, 6][..])).collect();
        assert_eq!(
            problems(&gapped),
            [Some("the base has no `experts.1.w1.weight`".to_string())]
        );
        assert_eq!(
            problems(&[
                ("m.experts.0.gate_proj.weight", &[4, 6]),
                ("m.experts.0.up_proj.weight", &[4, 6]),
                ("m.experts.1.gate_proj.weight", &[4, 6]),
                ("m.experts.1.up_proj.weight", &[4, 7]),
            ]),
            [Some(
                "`m.experts.1.up_proj.weight` is [4, 7] but `m.experts.0.up_proj.weight` is [4, 6]"
                    .to_string()
            )]
        );
        assert_eq!(
            problems(&[
                ("m.experts.0.gate_proj.weight", &[4, 6]),
                ("m.experts.0.up_proj.weight", &[4, 5]),
            ]),
            [Some("its parts differ in width: `m.experts.0.gate_proj.weight` [4, 6], `m.experts.0.up_proj.weight` [4, 5]".to_string())]
        );
        assert_eq!(
            problems(&[("m.experts.0.down_proj.weight", &[4])]),
            [Some(
                "`m.experts.0.down_proj.weight` is [4], not a matrix".to_string()
            )]
        );
    }
}
