//! `merge-lora` follows PEFT's own rules for what an adapter applies to, checked against real
//! PEFT 0.21 output in `tests/fixtures/peft/` (see its README.txt, "Semantics cases"):
//! `target_modules` as a list or a regex, `exclude_modules`, `layers_to_transform` /
//! `layers_pattern`, conv LoRA (Conv1d/2d/3d, 1×1), and several `target_parameters` on one
//! module (PEFT's nested ParamWrappers), also on transformers 5's fused MoE experts over a base
//! stored per expert ("Fused-experts cases"). Pairs PEFT would not apply are left out and
//! reported; patterns that match nothing are errors before any output exists.

mod common;

use std::path::{Path, PathBuf};

use common::peft::*;
use common::*;
use tftf::format::dtype::DType;

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

/// Issue #24 item 16: Qwen3-MoE and Mixtral checkpoints ship one tensor per expert, transformers 5
/// fuses them into `mlp.experts.gate_up_proj` / `down_proj` when it loads them, and a PEFT
/// adapter trained with `target_parameters` names the fused parameters. PEFT's merge +
/// save_pretrained writes the experts per expert again, and so does merge-lora: every expert's
/// gate, up and down (Mixtral's w1, w3, w2 under `block_sparse_moe`) as PEFT has them, the
/// dense MLP and the router untouched.
#[test]
fn fused_expert_adapters_merge_per_expert_like_peft() {
    for (name, changed, merged) in [
        ("qwen3-moe-experts", 16, 6),
        ("mixtral-experts", 20, 6),
        ("qwen3-moe-experts-bf16", 8, 1),
    ] {
        let (got, err, lora) = run_case(name);
        assert_eq!(got.len(), changed, "{name}: {got:?}");
        assert_eq!(lora["merged"], merged, "{name}: {lora}");
        assert!(strs(&lora["not_targeted"]).is_empty(), "{name}: {lora}");
        assert!(err.is_empty(), "{name}: {err}");
    }
    let (got, _, _) = run_case("mixtral-experts");
    for e in 0..3 {
        for w in ["w1", "w2", "w3"] {
            let t = format!("model.layers.1.block_sparse_moe.experts.{e}.{w}.weight");
            assert!(got.contains(&t), "{t} not merged: {got:?}");
        }
    }
}

/// On a bfloat16 base PEFT's ParamWrapper casts s·Δ to bfloat16 before adding it (an nn.Linear
/// adds it in float32): merge-lora does the same and writes PEFT's bytes, per expert or fused,
/// where rounding once would miss 321 of 1536 and 176 of 2304 merged elements, some by many
/// ulps where W + s·Δ cancels.
#[test]
fn bf16_parameter_merges_write_peft_bytes() {
    for name in ["qwen3-moe-experts-bf16", "nested-target-parameters-bf16"] {
        let dir = case(name);
        let (_d, out) = tmp_out();
        lora_merged(&dir.join("base"), &dir.join("adapter"), &out, &["-q"]);
        let got = load_all(&out);
        assert!(got.values().all(|t| t.0 == "BF16"), "{name}");
        assert_eq!(
            got,
            load_all(&dir.join("merged/model.safetensors")),
            "{name}"
        );
    }
}

/// `case`'s base with `edit` applied to its tensors, written to `d/base`.
fn edited_base(case: &Path, d: &tempfile::TempDir, edit: impl Fn(&mut Tensors)) -> PathBuf {
    let mut tensors = load_all(&case.join("base/model.safetensors"));
    edit(&mut tensors);
    let mut model = Model::new();
    for (name, (dtype, shape, bytes)) in tensors {
        let shape: Vec<u64> = shape.iter().map(|&x| x as u64).collect();
        model = model.tensor(&name, dtype.parse::<DType>().unwrap(), &shape, bytes);
    }
    let config = std::fs::read_to_string(case.join("base/config.json")).unwrap();
    model.config(&config).write(&d.path().join("base"))
}

/// Per-expert tensors that transformers could not fuse (an expert missing, one of another
/// shape) and grouped factors that do not fit the fused shape are refused, naming the adapter
/// file and the tensors, before any output exists.
#[test]
fn per_expert_bases_that_do_not_fit_fail_before_output() {
    let experts = "model.layers.0.mlp.experts";
    type Edit = Box<dyn Fn(&mut Tensors)>;
    let cases: Vec<(&str, Edit, String)> = vec![
        (
            "qwen3-moe-experts",
            Box::new(|t| {
                t.remove("model.layers.0.mlp.experts.2.up_proj.weight");
            }),
            format!("`{experts}.gate_up_proj`, which the base stores per expert: the base has no `{experts}.2.up_proj.weight`, so it cannot be fused and merged"),
        ),
        (
            "qwen3-moe-experts",
            Box::new(|t| {
                let down = t.get_mut("model.layers.0.mlp.experts.3.down_proj.weight").unwrap();
                down.1 = vec![24, 6];
                down.2.truncate(24 * 6 * 4);
            }),
            format!("`{experts}.3.down_proj.weight` is [24, 6] but `{experts}.0.down_proj.weight` is [24, 8]"),
        ),
        (
            "qwen3-moe-experts-bf16",
            Box::new(|t| {
                for e in 0..4 {
                    let gate = t.get_mut(&format!("model.layers.0.mlp.experts.{e}.gate_proj.weight")).unwrap();
                    gate.1 = vec![6, 24];
                    gate.2.truncate(6 * 24 * 2);
                }
            }),
            format!("`{experts}.gate_up_proj`: factors for in=24, out=16 do not fit `{experts}.gate_up_proj`, which the base stores per expert as [experts, out, in] [4, 14, 24]"),
        ),
    ];
    for (name, edit, want) in cases {
        let dir = case(name);
        let d = tmp();
        let base = edited_base(&dir, &d, edit);
        let out = d.path().join("out");
        let err = fails(&merge_lora(&base, &dir.join("adapter"), &out, &[]));
        assert_refused(&err, &["adapter_model.safetensors", &want], &out);
    }
}

/// Without adapter_config.json (`--rank/--lora-alpha`) nothing names the fused parameters the
/// grouped pairs are for: they are unmatched, an error listing them before any output exists,
/// not a merge that leaves the experts out.
#[test]
fn fused_expert_pairs_without_a_config_are_unmatched() {
    let dir = case("qwen3-moe-experts");
    let d = tmp();
    let adapter = copy_adapter_weights(&dir, &d.path().join("adapter"));
    let out = d.path().join("out");
    let args = ["--rank", "2", "--lora-alpha", "4"];
    let err = fails(&merge_lora(&dir.join("base"), &adapter, &out, &args));
    assert_refused(
        &err,
        &[
            "4 adapter tensor(s) match nothing in the base model",
            "`base_model.model.model.layers.0.mlp.experts.base_layer.lora_B.weight`",
        ],
        &out,
    );
}
