//! `merge-lora` follows PEFT's own rules for what an adapter applies to, checked against real
//! PEFT 0.21 output in `tests/fixtures/peft/` (see its README.txt, "Semantics cases"):
//! `target_modules` as a list or a regex, `exclude_modules`, `layers_to_transform` /
//! `layers_pattern`, conv LoRA (Conv1d/2d/3d, 1×1), and several `target_parameters` on one
//! module (PEFT's nested ParamWrappers). Pairs PEFT would not apply are left out and reported;
//! patterns that match nothing are errors before any output exists.

mod common;

use std::path::{Path, PathBuf};

use common::peft::*;
use common::*;

fn case(name: &str) -> PathBuf {
    peft_case(name)
}

/// Merges `base` + `adapter` of a fixture case; returns (stderr, the merge-lora report entry).
fn merge(base: &Path, adapter: &Path, out: &Path) -> (String, serde_json::Value) {
    let rep = out.with_extension("report.json");
    let o = lora_merge(base, adapter, out, &["-q", "--report", s(&rep)]);
    ok(&o);
    (stderr(&o), merge_lora_report(&rep))
}

/// [`merge`] of the case folder `dir`'s base and the adapter [`with_config`] made in `d`, into
/// `d/out`.
fn merge_edited(dir: &Path, d: &tempfile::TempDir) -> (String, serde_json::Value) {
    merge(
        &dir.join("base"),
        &d.path().join("adapter"),
        &d.path().join("out"),
    )
}

fn run_case(name: &str) -> (Vec<String>, String, serde_json::Value) {
    let dir = case(name);
    let (_d, out) = tmp_out();
    let (err, lora) = merge(&dir.join("base"), &dir.join("adapter"), &out);
    let changed = assert_matches_peft(name, &out);
    assert_all_matched(name, &lora);
    (changed, err, lora)
}

fn strs(v: &serde_json::Value) -> Vec<String> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_str().unwrap().to_string())
        .collect()
}

#[test]
fn conv_lora_matches_peft_f32_and_bf16() {
    for name in ["conv-lora", "conv-lora-bf16"] {
        let (changed, err, lora) = run_case(name);
        assert_eq!(
            changed,
            [
                "conv1d.weight",
                "conv2d.weight",
                "conv3d.weight",
                "pointwise.weight"
            ],
            "{name}"
        );
        assert_eq!(lora["merged"], 4, "{name}: {lora}");
        assert!(err.is_empty(), "{name}: {err}");
    }
}

#[test]
fn target_modules_regex_and_exclude_modules_match_peft() {
    let (changed, err, lora) = run_case("target-regex-exclude");
    assert_eq!(
        changed,
        [
            "model.layers.0.attn.q_proj.weight",
            "model.layers.0.attn.v_proj.weight",
            "model.layers.0.mlp.up.weight",
            "model.layers.1.attn.q_proj.weight",
            "model.layers.1.mlp.up.weight",
            "model.layers.2.attn.q_proj.weight",
            "model.layers.2.attn.v_proj.weight",
        ]
    );
    // k_proj and down (not in the regex) in every layer, and the two excluded modules: 8 pairs.
    let left = strs(&lora["not_targeted"]);
    assert_eq!(left.len(), 16, "{lora}");
    assert!(left.contains(&"base_model.model.model.layers.1.attn.v_proj.lora_A.weight".into()));
    assert!(left.contains(&"base_model.model.model.layers.2.mlp.up.lora_B.weight".into()));
    assert!(
        err.starts_with("warning: ")
            && err.contains(
                "left out 8 LoRA pair(s) of the adapter file that PEFT would not put on the model"
            )
            && err.contains("`model.layers.1.attn.v_proj` (excluded)")
            && err.contains("`model.layers.0.attn.k_proj` (not targeted)"),
        "{err}"
    );
}

#[test]
fn layers_to_transform_and_layers_pattern_match_peft() {
    let (changed, err, lora) = run_case("layers-to-transform");
    assert_eq!(
        changed,
        [
            "model.layers.0.attn.q_proj.weight",
            "model.layers.0.mlp.down.weight",
            "model.layers.2.attn.q_proj.weight",
        ]
    );
    assert_eq!(strs(&lora["not_targeted"]).len(), 12, "{lora}");
    assert_mentions(
        &err,
        &[
            "layers_to_transform [0, 2]",
            "`model.layers.1.attn.q_proj` (not targeted)",
            "`model.layers.2.mlp.down` (excluded)",
        ],
    );
}

/// PEFT nests one ParamWrapper per targeted parameter in the order the module registers them:
/// `experts.base_layer.lora_*` is gate_up_proj (registered first) although target_parameters
/// lists down_proj first; the factor shapes decide it. The twin module's two parameters have
/// the same shape: the listed order stands in for registration order, with a warning.
#[test]
fn nested_target_parameters_match_peft() {
    let (changed, err, lora) = run_case("nested-target-parameters");
    assert_eq!(changed.len(), 8, "{changed:?}");
    assert_eq!(lora["merged"], 8, "{lora}");
    assert!(strs(&lora["not_targeted"]).is_empty(), "{lora}");
    assert!(
        err.contains("`layers.0.mlp.twin`: its targeted parameters have the same shapes")
            && err.contains("innermost first: layers.0.mlp.twin.w_gate, layers.0.mlp.twin.w_up")
            && !err.contains("experts"),
        "{err}"
    );
}

/// Same-shaped nested parameters listed in the other order than registered: the listed order is
/// all the files say, so the merge follows it (and warns) — it differs from PEFT, which is why
/// the warning exists. Swapping the twin's listing swaps which parameter gets which pair.
#[test]
fn same_shaped_nested_parameters_follow_the_listed_order_and_warn() {
    let dir = case("nested-target-parameters");
    let d = with_config(&dir, |cfg| {
        cfg["target_parameters"] = serde_json::json!([
            "experts.gate_up_proj",
            "experts.down_proj",
            "twin.w_up",
            "twin.w_gate"
        ])
    });
    let adapter = d.path().join("adapter");
    let out = d.path().join("out");
    let (err, _) = merge(&dir.join("base"), &adapter, &out);
    assert_mentions(
        &err,
        &["innermost first: layers.0.mlp.twin.w_up, layers.0.mlp.twin.w_gate"],
    );
    let got = load_all(&out);
    let want = load_all(&dir.join("merged/model.safetensors"));
    // experts: decided by shapes, still PEFT's result whatever the listing.
    for t in [
        "layers.0.mlp.experts.gate_up_proj",
        "layers.1.mlp.experts.down_proj",
    ] {
        for (x, y) in floats("F32", &got[t].2)
            .iter()
            .zip(floats("F32", &want[t].2))
        {
            assert!((x - y).abs() <= 1e-6 * y.abs().max(1.0), "{t}");
        }
    }
    assert_ne!(
        got["layers.0.mlp.twin.w_up"].2,
        want["layers.0.mlp.twin.w_up"].2
    );
}

fn with_config(dir: &Path, edit: impl Fn(&mut serde_json::Value)) -> tempfile::TempDir {
    let d = tmp();
    let adapter = copy_adapter_weights(dir, &d.path().join("adapter"));
    let mut cfg = read_json(&dir.join("adapter/adapter_config.json"));
    edit(&mut cfg);
    std::fs::write(adapter.join("adapter_config.json"), cfg.to_string()).unwrap();
    d
}

/// A target pattern that matches no module (or parameter) of the base model is an error naming
/// it, before any output exists; so is a config that targets nothing at all, and a regex this
/// implementation cannot compile.
#[test]
fn patterns_matching_nothing_fail_before_output() {
    let cases: Vec<(&str, serde_json::Value, &str)> = vec![
        (
            "layers-to-transform",
            serde_json::json!({"target_modules": ["q_proj", "o_proj"]}),
            "target_modules entry `o_proj` matches no module of the base model",
        ),
        (
            "target-regex-exclude",
            serde_json::json!({"target_modules": r"model\.layers\.\d+\.attn\.qkv"}),
            r"target_modules regex `model\.layers\.\d+\.attn\.qkv` matches no module of the base model",
        ),
        (
            "layers-to-transform",
            serde_json::json!({"layers_to_transform": [7], "exclude_modules": null}),
            "targets no module of the base model: target_modules [\"q_proj\", \"down\"], layers_to_transform [7], layers_pattern [\"layers\"]",
        ),
        (
            "nested-target-parameters",
            serde_json::json!({"target_parameters": ["experts.gate_up_proj", "experts.up_proj"]}),
            "target_parameters entry `experts.up_proj` matches no parameter of the base model",
        ),
        (
            "target-regex-exclude",
            serde_json::json!({"target_modules": r"(?<=x)q_proj"}),
            "`target_modules` regex `(?<=x)q_proj` cannot be used",
        ),
    ];
    for (name, patch, want) in cases {
        let dir = case(name);
        let d = with_config(&dir, |cfg| {
            for (k, v) in patch.as_object().unwrap() {
                cfg[k] = v.clone();
            }
        });
        let out = d.path().join("out");
        let adapter = d.path().join("adapter");
        let err = fails(&merge_lora(&dir.join("base"), &adapter, &out, &[]));
        assert!(
            err.contains("adapter_config.json") && err.contains(want),
            "{name} {patch}: {err}"
        );
        assert!(!out.exists(), "{name}: output written");
    }
}

/// An `exclude_modules` that excludes nothing only warns (as in PEFT), and a config without
/// `target_modules` (older PEFT, or hand-written) takes every pair in the file.
#[test]
fn exclude_matching_nothing_warns_and_absent_targets_take_the_file() {
    let dir = case("layers-to-transform");
    let d = with_config(&dir, |cfg| {
        cfg["exclude_modules"] = serde_json::json!(["nonexistent"]);
    });
    let (err, lora) = merge_edited(&dir, &d);
    assert_mentions(
        &err,
        &["exclude_modules [\"nonexistent\"] excludes no module of the base model"],
    );
    assert_eq!(lora["merged"], 4, "{lora}");

    let d = with_config(&dir, |cfg| {
        let o = cfg.as_object_mut().unwrap();
        for k in [
            "target_modules",
            "exclude_modules",
            "layers_to_transform",
            "layers_pattern",
        ] {
            o.remove(k);
        }
    });
    let (err, lora) = merge_edited(&dir, &d);
    assert!(err.is_empty(), "{err}");
    assert_eq!(lora["merged"], 9, "{lora}");
}
