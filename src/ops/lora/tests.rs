use super::params::wrapper_fits;
use super::*;

#[test]
fn key_normalisation_and_classes() {
    assert_eq!(
        normalise(
            "base_model.model.model.layers.0.q_proj.lora_A.default.weight",
            "default"
        ),
        "model.layers.0.q_proj.lora_A.weight"
    );
    assert_eq!(
        normalise("base_model.model.x.lora_embedding_A.default", "default"),
        "x.lora_embedding_A"
    );
    assert_eq!(
        normalise("base_model.model.default_head.weight", "default"),
        "default_head.weight"
    );
    assert!(matches!(classify("m.q.lora_A.weight", &[]), Kind::A(ref m, false) if m == "m.q"));
    assert!(matches!(classify("e.lora_embedding_B", &[]), Kind::B(ref m, true) if m == "e"));
    assert!(matches!(
        classify("m.q.lora_magnitude_vector", &[]),
        Kind::Magnitude(_)
    ));
    assert!(matches!(
        classify("lm_head.base_layer.weight", &[]),
        Kind::BaseCopy
    ));
    assert!(
        matches!(classify("lm_head.modules_to_save.default.weight", &[]), Kind::Replacement(ref t) if t == "lm_head.weight")
    );
    assert!(matches!(
        classify("lm_head.weight", &["lm_head".into()]),
        Kind::Replacement(_)
    ));
    assert!(matches!(classify("lm_head.weight", &[]), Kind::Unknown));
}

#[test]
fn rank_and_alpha_patterns_follow_peft() {
    let cfg = LoraConfig {
        r: 16,
        alpha: 32.0,
        use_rslora: true,
        rank_pattern: vec![("down_proj".into(), 4)],
        alpha_pattern: vec![("down_proj".into(), 8.0)],
        fan_in_fan_out: false,
        use_dora: false,
        modules_to_save: vec![],
        target_parameters: vec![],
        ..Default::default()
    };
    assert_eq!(cfg.rank_and_scale("model.layers.0.mlp.down_proj"), (4, 4.0));
    assert_eq!(cfg.rank_and_scale("model.layers.0.mlp.up_proj"), (16, 8.0));
    assert_eq!(
        cfg.rank_and_scale("model.layers.0.mlp.xdown_proj"),
        (16, 8.0)
    );
}

fn cfg(json: serde_json::Value) -> LoraConfig {
    LoraConfig::parse_value(Path::new("adapter_config.json"), &json).unwrap()
}

#[test]
fn targeting_follows_peft_check_target_module_exists() {
    // A list: exact name or `.NAME` suffix, never a bare substring.
    let c = cfg(serde_json::json!({"r": 4, "target_modules": ["q_proj", "mlp.up"]}));
    assert_eq!(c.targets("model.layers.0.self_attn.q_proj"), Targeted::Yes);
    assert_eq!(c.targets("q_proj"), Targeted::Yes);
    assert_eq!(c.targets("model.layers.0.mlp.up"), Targeted::Yes);
    assert_eq!(c.targets("model.layers.0.xq_proj"), Targeted::No);
    assert_eq!(c.targets("model.layers.0.q_proj.inner"), Targeted::No);
    // A string: re.fullmatch.
    let c = cfg(serde_json::json!({"r": 4, "target_modules": r".*\.(q|v)_proj"}));
    assert_eq!(c.targets("model.layers.0.q_proj"), Targeted::Yes);
    assert_eq!(c.targets("model.layers.0.q_proj.x"), Targeted::No);
    assert_eq!(c.targets("q_proj"), Targeted::No);
    // exclude_modules (both forms) and modules_to_save win over targets.
    let c = cfg(
        serde_json::json!({"r": 4, "target_modules": ["q_proj", "lm_head"],
        "exclude_modules": r".*\.1\.q_proj", "modules_to_save": ["lm_head"]}),
    );
    assert_eq!(c.targets("model.layers.1.q_proj"), Targeted::Excluded);
    assert_eq!(c.targets("model.layers.11.q_proj"), Targeted::Yes);
    assert_eq!(c.targets("lm_head"), Targeted::Excluded);
    let c = cfg(serde_json::json!({"r": 4, "target_modules": ["q_proj"],
        "exclude_modules": ["layers.1.q_proj"]}));
    assert_eq!(c.targets("model.layers.1.q_proj"), Targeted::Excluded);
    assert_eq!(c.targets("model.layers.11.q_proj"), Targeted::Yes);
    // No target_modules: the file decides, unless target_parameters is given.
    assert_eq!(
        cfg(serde_json::json!({"r": 4})).targets("x.q"),
        Targeted::Yes
    );
    let c = cfg(serde_json::json!({"r": 4, "target_parameters": ["experts.w"]}));
    assert_eq!(c.targets("x.q"), Targeted::No);
    assert!(c.targets_parameter("model.experts.w"));
    assert!(!c.targets_parameter("model.experts.w2"));
}

#[test]
fn layers_to_transform_takes_the_first_numbered_segment() {
    let c = cfg(serde_json::json!({"r": 4, "target_modules": ["w1"], "layers_to_transform": 1}));
    assert_eq!(c.targets("model.layers.1.experts.0.w1"), Targeted::Yes);
    // The expert index is not the layer index.
    assert_eq!(c.targets("model.layers.0.experts.1.w1"), Targeted::No);
    // No numbered segment after at least one other: not targeted. A module named exactly in
    // the list is targeted whatever its layer (PEFT checks layers only for suffix matches).
    assert_eq!(c.targets("layers.1.w1"), Targeted::No);
    assert_eq!(c.targets("w1"), Targeted::Yes);
    let c = cfg(serde_json::json!({"r": 4, "target_modules": ["w1"],
        "layers_to_transform": [0, 2], "layers_pattern": ["blocks", "h"]}));
    assert_eq!(c.targets("enc.layers.1.h.2.w1"), Targeted::Yes);
    assert_eq!(c.targets("enc.blocks.0.experts.1.w1"), Targeted::Yes);
    assert_eq!(c.targets("enc.layers.0.w1"), Targeted::No);
    // A regex target ignores layers_to_transform, as in PEFT.
    let c = cfg(serde_json::json!({"r": 4, "target_modules": r".*w1", "layers_to_transform": [5]}));
    assert_eq!(c.targets("model.layers.0.w1"), Targeted::Yes);
}

#[test]
fn nested_wrappers_unwrap_to_module_and_depth() {
    assert_eq!(unwrap_base_layers("m.experts"), ("m.experts", 0));
    assert_eq!(
        unwrap_base_layers("m.experts.base_layer.base_layer"),
        ("m.experts", 2)
    );
    assert!(wrapper_fits(&[4, 16, 12], &[8, 12], &[16, 8]));
    assert!(wrapper_fits(&[4, 16, 12], &[8, 16], &[12, 8]));
    assert!(!wrapper_fits(&[4, 16, 12], &[8, 12], &[12, 8]));
    assert!(wrapper_fits(&[6, 5], &[2, 5], &[6, 2]));
    let bad = LoraConfig::parse_value(
        Path::new("adapter_config.json"),
        &serde_json::json!({"r": 4, "target_modules": "(?=x)q"}),
    )
    .unwrap_err()
    .to_string();
    assert!(
        bad.contains("`target_modules` regex `(?=x)q` cannot be used"),
        "{bad}"
    );
}
