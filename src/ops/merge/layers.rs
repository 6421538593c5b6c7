//! Which layer a tensor belongs to, from its name alone: the number after a `layers`, `h`,
//! `blocks` or `layer` path segment (`model.layers.7.mlp.up_proj.weight` is layer 7). mergekit
//! reads this from per-architecture tables; the name rule covers the decoder families those
//! tables list without tying tftf to them.

use std::sync::OnceLock;

use regex::Regex;
use serde_json::{Map, Value};

/// A layer tensor's name, split around its layer number.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LayerName {
    pub prefix: String,
    pub index: u64,
    pub suffix: String,
}

impl LayerName {
    /// The same tensor of layer `index`.
    pub fn with_index(&self, index: u64) -> String {
        format!("{}{index}{}", self.prefix, self.suffix)
    }
}

fn pattern() -> &'static Regex {
    static RE: OnceLock<Regex> = OnceLock::new();
    RE.get_or_init(|| {
        Regex::new(r"^((?:.*?\.)?(?:layers|h|blocks|layer)\.)(\d+)(\..*)$").expect("valid regex")
    })
}

/// `name` split around its layer number, `None` for tensors outside the layers.
pub fn split_layer(name: &str) -> Option<LayerName> {
    let c = pattern().captures(name)?;
    Some(LayerName {
        prefix: c[1].to_string(),
        index: c[2].parse().ok()?,
        suffix: c[3].to_string(),
    })
}

/// A model's layer count: `config.json`'s `num_hidden_layers` (or `n_layer`, `num_layers`),
/// else one past the highest layer number among its tensor names.
pub fn layer_count<'a>(
    config: Option<&Map<String, Value>>,
    names: impl Iterator<Item = &'a str>,
) -> u64 {
    let from_config = config.and_then(|c| {
        ["num_hidden_layers", "n_layer", "num_layers"]
            .iter()
            .find_map(|k| c.get(*k).and_then(Value::as_u64))
    });
    from_config.unwrap_or_else(|| {
        names
            .filter_map(|n| split_layer(n).map(|l| l.index + 1))
            .max()
            .unwrap_or(0)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layer_numbers_are_found_after_a_layers_segment_only() {
        let l = split_layer("model.layers.12.self_attn.q_proj.weight").unwrap();
        assert_eq!(l.index, 12);
        assert_eq!(l.with_index(3), "model.layers.3.self_attn.q_proj.weight");
        assert_eq!(
            split_layer("transformer.h.0.attn.c_attn.weight")
                .unwrap()
                .index,
            0
        );
        assert_eq!(split_layer("model.embed_tokens.weight"), None);
        assert_eq!(split_layer("model.layers.x.weight"), None);
        // The expert number after the layer number is part of the suffix.
        let e = split_layer("model.layers.2.mlp.experts.5.w1.weight").unwrap();
        assert_eq!(
            (e.index, e.suffix.as_str()),
            (2, ".mlp.experts.5.w1.weight")
        );
    }

    #[test]
    fn layer_count_prefers_the_config_then_the_names() {
        let names = ["model.layers.0.a", "model.layers.4.a", "lm_head.weight"];
        assert_eq!(layer_count(None, names.iter().copied()), 5);
        let cfg: Map<String, Value> = serde_json::from_str(r#"{"num_hidden_layers": 8}"#).unwrap();
        assert_eq!(layer_count(Some(&cfg), names.iter().copied()), 8);
    }
}
