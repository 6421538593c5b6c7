//! `tftf info`: what a checkpoint holds, from headers only.

use std::collections::BTreeMap;

use regex::Regex;
use serde_json::json;

use crate::cli::InfoArgs;
use crate::error::Result;
use crate::format::checkpoint::{Checkpoint, TensorRef};
use crate::size::human;

/// The name column grows to the longest name up to this width; longer names push the other
/// columns right (a padding width must also fit in a `u16`, or formatting panics).
const NAME_COLUMN_MAX_CHARS: usize = 120;

/// The layer a tensor belongs to: `model.layers.12`, `transformer.h.3`, `mtp.0`, …
pub fn layer_of(name: &str) -> Option<String> {
    static RE: std::sync::OnceLock<Regex> = std::sync::OnceLock::new();
    let re = RE.get_or_init(|| {
        Regex::new(r"^((?:[^.]+\.)*?(?:layers|layer|h|blocks|block|mtp)\.\d+)\.")
            .expect("valid regex")
    });
    re.captures(name).map(|c| c[1].to_string())
}

pub fn run(args: &InfoArgs, input: &std::path::Path) -> Result<()> {
    let ckpt = Checkpoint::open(input)?;
    crate::escape::print_input_notes(&ckpt, false);
    let tensors: Vec<_> = ckpt
        .tensors
        .iter()
        .filter(|t| {
            args.filter
                .as_ref()
                .is_none_or(|f| t.info.name.contains(f.as_str()))
        })
        .collect();
    let summary = Summary::of(&tensors);
    if args.json {
        print_json(&ckpt, &tensors, &summary);
        return Ok(());
    }
    if !args.dtype_summary {
        print_table(&tensors);
    }
    summary.print(&ckpt, tensors.len());
    Ok(())
}

/// Totals of the listed tensors: overall, per dtype and per layer.
struct Summary {
    bytes: u64,
    elements: u64,
    /// dtype name → (tensors, bytes, elements).
    by_dtype: BTreeMap<&'static str, (usize, u64, u64)>,
    /// layer → (tensors, bytes).
    layers: BTreeMap<String, (usize, u64)>,
    /// Bytes of tensors in no layer (embeddings, final norm, head).
    outside: u64,
    /// The layer with the most bytes (the first by name among equals): name, tensors, bytes.
    widest: Option<(String, usize, u64)>,
}

impl Summary {
    fn of(tensors: &[&TensorRef]) -> Summary {
        let mut by_dtype: BTreeMap<&str, (usize, u64, u64)> = BTreeMap::new();
        let mut layers: BTreeMap<String, (usize, u64)> = BTreeMap::new();
        let mut outside = 0u64;
        for t in tensors {
            let e = by_dtype.entry(t.info.dtype.name()).or_default();
            e.0 += 1;
            e.1 += t.info.nbytes();
            e.2 += t.info.elements();
            match layer_of(&t.info.name) {
                Some(l) => {
                    let e = layers.entry(l).or_default();
                    e.0 += 1;
                    e.1 += t.info.nbytes();
                }
                None => outside += t.info.nbytes(),
            }
        }
        let widest = layers
            .iter()
            .max_by(|a, b| a.1 .1.cmp(&b.1 .1).then(b.0.cmp(a.0)))
            .map(|(name, (n, bytes))| (name.clone(), *n, *bytes));
        Summary {
            bytes: tensors.iter().map(|t| t.info.nbytes()).sum(),
            elements: tensors.iter().map(|t| t.info.elements()).sum(),
            by_dtype,
            layers,
            outside,
            widest,
        }
    }

    /// The text summary: totals, format, bytes per dtype and the layer breakdown.
    fn print(&self, ckpt: &Checkpoint, tensor_count: usize) {
        outln!(
            "{}: {} tensors in {} shard(s), {} elements, {} ({} bytes)",
            crate::escape::path(&ckpt.input),
            tensor_count,
            ckpt.shards.len(),
            self.elements,
            human(self.bytes),
            self.bytes
        );
        outln!("format: {}", ckpt.format_line());
        outln!("dtypes:");
        for (d, (n, b, _)) in &self.by_dtype {
            outln!("  {d:<11} {n:>7} tensors  {:>12}", human(*b));
        }
        match &self.widest {
            Some((name, n, bytes)) => outln!(
                "layers: {}; widest: {} ({}, {n} tensors); outside layers: {}",
                self.layers.len(),
                crate::escape::name(name),
                human(*bytes),
                human(self.outside)
            ),
            None => outln!(
                "layers: none recognised; {} outside layers",
                human(self.outside)
            ),
        }
    }
}

fn print_json(ckpt: &Checkpoint, tensors: &[&TensorRef], summary: &Summary) {
    let v = json!({
        "path": ckpt.input.to_string_lossy(),
        "format": ckpt.format.name(),
        "shards": ckpt.shards.iter().map(|s| s.path.to_string_lossy()).collect::<Vec<_>>(),
        "tensors": tensors.iter().map(|t| json!({
            "name": t.info.name,
            "dtype": t.info.dtype.name(),
            "shape": t.info.shape,
            "bytes": t.info.nbytes(),
            "shard": ckpt.shards[t.shard()].path.file_name().map(|f| f.to_string_lossy().into_owned()),
        })).collect::<Vec<_>>(),
        "total_tensors": tensors.len(),
        "total_bytes": summary.bytes,
        "total_elements": summary.elements,
        "dtypes": summary.by_dtype.iter().map(|(d, (n, b, e))| (d.to_string(), json!({"tensors": n, "bytes": b, "elements": e}))).collect::<serde_json::Map<_, _>>(),
        "layers": summary.layers.len(),
        "widest_layer": summary.widest.as_ref().map(|(n, c, b)| json!({"name": n, "tensors": c, "bytes": b})),
        "bytes_outside_layers": summary.outside,
        "warnings": ckpt.warnings,
        "notes": ckpt.notes,
    });
    outln!("{}", serde_json::to_string_pretty(&v).expect("JSON"));
}

/// One line per tensor: name, dtype, shape, bytes.
fn print_table(tensors: &[&TensorRef]) {
    let names: Vec<_> = tensors
        .iter()
        .map(|t| crate::escape::name(&t.info.name))
        .collect();
    let w = names
        .iter()
        .map(|n| n.chars().count())
        .max()
        .unwrap_or(4)
        .clamp(4, NAME_COLUMN_MAX_CHARS);
    outln!(
        "{:<w$}  {:<11}  {:<22}  {:>12}",
        "NAME",
        "DTYPE",
        "SHAPE",
        "BYTES"
    );
    for (t, name) in tensors.iter().zip(&names) {
        outln!(
            "{:<w$}  {:<11}  {:<22}  {:>12}",
            name,
            t.info.dtype.name(),
            format!("{:?}", t.info.shape),
            t.info.nbytes()
        );
    }
    outln!();
}

#[cfg(test)]
mod tests {
    use super::layer_of;

    #[test]
    fn layer_names() {
        for (name, layer) in [
            (
                "model.layers.12.mlp.up_proj.weight",
                Some("model.layers.12"),
            ),
            ("layers.3.ffn.experts.5.w1.weight", Some("layers.3")),
            (
                "transformer.h.0.attn.c_attn.weight",
                Some("transformer.h.0"),
            ),
            ("mtp.0.ffn.experts.1.w2.scale", Some("mtp.0")),
            ("model.embed_tokens.weight", None),
            ("lm_head.weight", None),
        ] {
            assert_eq!(layer_of(name).as_deref(), layer, "{name}");
        }
    }
}
