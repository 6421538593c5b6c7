//! The base model's parameters as PEFT's `target_parameters` sees them, and which nested
//! ParamWrapper pair belongs to which parameter.
//!
//! PEFT matches `target_parameters` against the parameters of the model transformers loaded,
//! which are not always the tensors stored: transformers 5 fuses a MoE checkpoint stored per
//! expert into 3-D expert parameters ([`super::experts`]). The table lists every stored tensor
//! (numbered as the plan's entries), then every fused parameter the base would be loaded as, so
//! that one matching serves both.

use std::collections::HashMap;

use super::experts::{fused_params, FusedParam};
use super::{suffix_match, LoraConfig};
use crate::format::checkpoint::Checkpoint;
use crate::plan::Entry;

pub(super) struct ParamTable {
    names: Vec<String>,
    shapes: Vec<Vec<u64>>,
    /// Parameter numbers by the module holding them (the name up to its last dot).
    by_module: HashMap<String, Vec<usize>>,
    /// Parameters `stored..` are `fused[i - stored]`.
    stored: usize,
    fused: Vec<FusedParam>,
}

impl ParamTable {
    pub fn new(entries: &[Entry]) -> ParamTable {
        let fused = fused_params(entries);
        let names: Vec<String> = entries
            .iter()
            .map(|e| e.name.clone())
            .chain(fused.iter().map(|f| f.name.clone()))
            .collect();
        let shapes = entries
            .iter()
            .map(|e| e.shape.clone())
            .chain(fused.iter().map(|f| f.shape.to_vec()))
            .collect();
        let mut by_module: HashMap<String, Vec<usize>> = HashMap::new();
        for (i, n) in names.iter().enumerate() {
            if let Some((module, _)) = n.rsplit_once('.') {
                by_module.entry(module.to_string()).or_default().push(i);
            }
        }
        ParamTable {
            names,
            shapes,
            by_module,
            stored: entries.len(),
            fused,
        }
    }

    pub fn name(&self, i: usize) -> &str {
        &self.names[i]
    }

    pub fn shape(&self, i: usize) -> &[u64] {
        &self.shapes[i]
    }

    /// The fused expert parameter numbered `i`, if it is one (not a stored tensor).
    pub fn fused(&self, i: usize) -> Option<&FusedParam> {
        i.checked_sub(self.stored).map(|j| &self.fused[j])
    }

    /// Whether `module` holds a parameter directly.
    pub fn has_module(&self, module: &str) -> bool {
        self.by_module.contains_key(module)
    }

    /// Whether `module` holds a stored tensor directly (not only fused parameters).
    pub fn stores_module(&self, module: &str) -> bool {
        self.by_module
            .get(module)
            .is_some_and(|v| v.iter().any(|&i| i < self.stored))
    }

    /// Whether a `target_parameters` entry names some parameter (PEFT's suffix match).
    pub fn any_named(&self, target: &str) -> bool {
        self.names.iter().any(|n| suffix_match(n, target))
    }

    /// The parameters of `module` that `target_parameters` names, in the order their entries
    /// in `target_parameters` are listed (then by name).
    pub fn wrapped(&self, cfg: &LoraConfig, module: &str) -> Vec<usize> {
        let mut v: Vec<(usize, &str, usize)> = self
            .by_module
            .get(module)
            .into_iter()
            .flatten()
            .filter_map(|&i| {
                let name = self.names[i].as_str();
                let pos = cfg
                    .target_parameters
                    .iter()
                    .position(|t| suffix_match(name, t))?;
                Some((pos, name, i))
            })
            .collect();
        v.sort();
        v.into_iter().map(|(_, _, i)| i).collect()
    }
}

/// Whether the factors `a`, `b` can be merged into parameter `w` as PEFT's ParamWrapper does:
/// 2-D `[out, in]` with A `[r, in]`, B `[out, r]`; 3-D `[E, X, Y]` with A `[E·r, in]`,
/// B `[out, E·r]` and `{in, out} = {X, Y}`.
pub(super) fn wrapper_fits(w: &[u64], a: &[u64], b: &[u64]) -> bool {
    match (w, a, b) {
        ([out, inn], [ra, a_in], [b_out, rb]) => ra == rb && a_in == inn && b_out == out,
        ([e, x, y], [ra, a_in], [b_out, rb]) => {
            ra == rb
                && *e > 0
                && ra % e == 0
                && ((a_in, b_out) == (y, x) || (a_in, b_out) == (x, y))
        }
        _ => false,
    }
}

/// Which parameter each nested pair of `module` belongs to. PEFT wraps a module's targeted
/// parameters in the order the module registers them, each wrapper around the previous one,
/// so the outermost pair (depth 0) belongs to the last registered parameter. A safetensors
/// file does not keep registration order, so the factor shapes decide; when several
/// parameters have the same shape, the order `target_parameters` lists them stands in for
/// registration order, with a warning.
#[allow(clippy::type_complexity)]
pub(super) fn assign_wrapped(
    module: &str,
    pairs: &[(usize, usize, usize)],
    wrapped: &[usize],
    table: &ParamTable,
    ckpt: &Checkpoint,
) -> std::result::Result<(Vec<(usize, usize)>, Option<String>), String> {
    let n = wrapped.len();
    if let Some(&(depth, a, _)) = pairs.iter().find(|p| p.0 >= n) {
        return Err(format!(
            "`{}` is nested {depth} wrapper(s) deep but target_parameters names only {n} parameter(s) of `{module}`",
            ckpt.tensors[a].info.name
        ));
    }
    // One parameter: nothing to choose (the merge itself checks the shapes, naming them).
    if n == 1 {
        return Ok((pairs.iter().map(|p| (p.0, wrapped[0])).collect(), None));
    }
    let shape = |i: usize| ckpt.tensors[i].info.shape.clone();
    let fits = |order: &[usize]| {
        pairs.iter().all(|&(depth, a, b)| {
            wrapper_fits(table.shape(order[n - 1 - depth]), &shape(a), &shape(b))
        })
    };
    // Every registration order (a module has a handful of parameters at most).
    let mut orders = Vec::new();
    permutations(&mut wrapped.to_vec(), 0, &mut orders);
    let assignment = |order: &[usize]| -> Vec<(usize, usize)> {
        let mut v: Vec<(usize, usize)> = pairs.iter().map(|p| (p.0, order[n - 1 - p.0])).collect();
        v.sort();
        v
    };
    let mut fitting: Vec<Vec<(usize, usize)>> = orders
        .iter()
        .filter(|o| fits(o))
        .map(|o| assignment(o))
        .collect();
    fitting.sort();
    fitting.dedup();
    let listed = assignment(wrapped);
    match fitting.len() {
        0 => Err(format!(
            "`{module}`: the nested LoRA factors {} fit none of its targeted parameters {} in any nesting order",
            pairs
                .iter()
                .map(|&(d, a, b)| format!("(depth {d}: lora_A {:?}, lora_B {:?})", shape(a), shape(b)))
                .collect::<Vec<_>>()
                .join(" "),
            wrapped
                .iter()
                .map(|&i| format!("`{}` {:?}", table.name(i), table.shape(i)))
                .collect::<Vec<_>>()
                .join(", ")
        )),
        1 => Ok((fitting.pop().expect("one"), None)),
        _ => {
            let chosen = if fitting.contains(&listed) {
                listed
            } else {
                fitting.swap_remove(0)
            };
            let order: Vec<&str> = chosen
                .iter()
                .rev()
                .map(|&(_, i)| table.name(i))
                .collect();
            let warning = format!(
                "merge-lora: `{module}`: its targeted parameters have the same shapes, so which nested LoRA pair belongs to which cannot be read from the files (PEFT nests them in the order the module registers its parameters); assumed the order target_parameters lists them, innermost first: {}",
                order.join(", ")
            );
            Ok((chosen, Some(warning)))
        }
    }
}

/// All orderings of `v[k..]` (with `v[..k]` fixed), appended to `out`.
fn permutations(v: &mut Vec<usize>, k: usize, out: &mut Vec<Vec<usize>>) {
    if k >= v.len() || out.len() >= 5040 {
        out.push(v.clone());
        return;
    }
    for i in k..v.len() {
        v.swap(k, i);
        permutations(v, k + 1, out);
        v.swap(k, i);
    }
}
