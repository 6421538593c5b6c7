use super::*;

fn num(x: f64) -> Setting {
    Setting::Scalar(Scalar::Num(x))
}

#[test]
fn gradients_interpolate_between_neighbours_as_mergekit() {
    let g = Setting::Gradient(vec![Scalar::Num(0.0), Scalar::Num(0.5), Scalar::Num(1.0)]);
    let at = |t| evaluate(&g, "x", t, "w").unwrap().unwrap();
    assert_eq!(at(0.0), 0.0);
    assert_eq!(at(0.25), 0.25);
    assert_eq!(at(1.0), 1.0);
    // Booleans pick a value instead of interpolating.
    let b = Setting::Gradient(vec![Scalar::Bool(false), Scalar::Bool(true)]);
    assert_eq!(evaluate(&b, "x", 0.9, "n").unwrap(), Some(0.0));
    assert_eq!(evaluate(&b, "x", 1.0, "n").unwrap(), Some(1.0));
}

#[test]
fn the_first_matching_filter_wins_and_no_match_falls_through() {
    let c = Setting::Conditional(vec![
        (Some("self_attn".into()), num(0.2)),
        (Some("mlp".into()), num(0.7)),
    ]);
    let at = |name| evaluate(&c, name, 0.0, "w").unwrap();
    assert_eq!(at("model.layers.0.self_attn.q_proj.weight"), Some(0.2));
    assert_eq!(at("model.layers.0.mlp.up_proj.weight"), Some(0.7));
    assert_eq!(at("lm_head.weight"), None);
    let global: Settings = [("w".to_string(), num(0.5))].into_iter().collect();
    let own: Settings = [("w".to_string(), c)].into_iter().collect();
    assert_eq!(
        resolve(&[&own, &global], "w", "lm_head.weight", 0.0).unwrap(),
        Some(0.5)
    );
}

#[test]
fn text_values_read_as_numbers_or_booleans_and_others_are_named() {
    assert_eq!(number(&Scalar::Str("1e-3".into()), "w").unwrap(), 1e-3);
    assert_eq!(number(&Scalar::Str("yes".into()), "w").unwrap(), 1.0);
    let e = number(&Scalar::Str("heavy".into()), "weight").unwrap_err();
    assert!(e.contains("parameter `weight`: `heavy`"), "{e}");
}

#[test]
fn configs_without_models_or_with_both_forms_are_refused() {
    let p = Path::new("m.yml");
    let e = MergeConfig::parse(p, "merge_method: linear\n").unwrap_err();
    assert!(
        e.to_string()
            .contains("exactly one of `models` or `slices`"),
        "{e}"
    );
    let e = MergeConfig::parse(p, "merge_method: linear\nmodels: []\nslices: []\n").unwrap_err();
    assert!(e.to_string().contains("exactly one of"), "{e}");
    let e = MergeConfig::parse(p, "- a\n- b\n").unwrap_err();
    assert!(e.to_string().contains("must be a mapping"), "{e}");
}
