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
    };
    assert_eq!(cfg.rank_and_scale("model.layers.0.mlp.down_proj"), (4, 4.0));
    assert_eq!(cfg.rank_and_scale("model.layers.0.mlp.up_proj"), (16, 8.0));
    assert_eq!(
        cfg.rank_and_scale("model.layers.0.mlp.xdown_proj"),
        (16, 8.0)
    );
}
