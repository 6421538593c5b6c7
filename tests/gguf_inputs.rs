//! `tftf gguf` on hostile model folders (issue #24, item 15): chat templates given as a list
//! of named templates, integer hyperparameters written as floats or strings, and models
//! llama.cpp could not load (missing embeddings, layers or tensors, shapes that contradict
//! `config.json`), refused before any output exists.

mod common;

use std::path::Path;

use common::gguf::*;
use common::*;
use serde_json::{json, Value as Json};
use tftf::format::dtype::DType;

/// A GGUF string array KV as stored: ARRAY, STRING, count, then each length-prefixed string.
fn string_array(items: &[&str]) -> Vec<u8> {
    let mut v = [9u32.to_le_bytes(), 8u32.to_le_bytes()].concat();
    v.extend((items.len() as u64).to_le_bytes());
    for s in items {
        v.extend((s.len() as u64).to_le_bytes());
        v.extend(s.as_bytes());
    }
    v
}

/// Sets `tokenizer_config.json`'s `chat_template` in `model` to `value` (`None`: removes it).
fn set_chat_template(model: &Path, value: Option<Json>) {
    let path = model.join("tokenizer_config.json");
    let mut tc: Json = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
    let m = tc.as_object_mut().unwrap();
    match value {
        Some(v) => m.insert("chat_template".into(), v),
        None => m.remove("chat_template"),
    };
    std::fs::write(&path, tc.to_string()).unwrap();
}

/// The chat-template keys of `g`, in file order.
fn template_keys(g: &Gguf) -> Vec<&str> {
    g.kvs
        .iter()
        .map(|(k, _)| k.as_str())
        .filter(|k| k.starts_with("tokenizer.chat_template"))
        .collect()
}

/// Asserts `g`'s default chat template, each named one (`tokenizer.chat_template.NAME`) and
/// the list of names, in order.
fn assert_templates(g: &Gguf, default: &str, named: &[(&str, &str)]) {
    assert_eq!(g.str("tokenizer.chat_template"), default);
    for (name, text) in named {
        assert_eq!(g.str(&format!("tokenizer.chat_template.{name}")), *text);
    }
    let names = string_array(&named.iter().map(|n| n.0).collect::<Vec<_>>());
    assert_eq!(g.kv("tokenizer.chat_templates"), Some(names.as_slice()));
}

#[test]
fn a_list_of_named_chat_templates_gives_one_kv_per_name_and_the_default() {
    let c = GgufCase::dense(31, "llama3");
    set_chat_template(
        &c.model,
        Some(json!([
            {"name": "default", "template": "D {{ messages }}"},
            {"name": "tool use", "template": "T"},
            {"name": "rag", "template": "R"},
            {"name": "", "template": "no name: skipped"},
            {"name": "no_template"},
        ])),
    );
    let g = c.convert("t.gguf", "test-pre", &[]);
    assert_templates(&g, "D {{ messages }}", &[("tool_use", "T"), ("rag", "R")]);
    // gguf-py's order: each named template, the names, then the default.
    assert_eq!(
        template_keys(&g),
        [
            "tokenizer.chat_template.tool_use",
            "tokenizer.chat_template.rag",
            "tokenizer.chat_templates",
            "tokenizer.chat_template"
        ]
    );

    // chat_template.jinja with additional_chat_templates/*.jinja, named by file (sorted).
    set_chat_template(&c.model, None);
    std::fs::write(c.model.join("chat_template.jinja"), "J").unwrap();
    let extra = c.model.join("additional_chat_templates");
    std::fs::create_dir_all(&extra).unwrap();
    std::fs::write(extra.join("b-2.jinja"), "B").unwrap();
    std::fs::write(extra.join("a.jinja"), "A").unwrap();
    let g = c.convert("j.gguf", "test-pre", &[]);
    assert_templates(&g, "J", &[("a", "A"), ("b_2", "B")]);
}

#[test]
fn chat_templates_that_cannot_be_written_are_refused_naming_the_file() {
    let c = GgufCase::dense(32, "llama3");
    let out = c.path("out");
    let gguf = out.join("x.gguf");
    for (value, want) in [
        (
            json!([{"name": "a-b", "template": "1"}, {"name": "a_b", "template": "2"}]),
            "chat_template entry 1 repeats the name `a_b`",
        ),
        (
            json!(["plain string"]),
            "chat_template entry 0 is \"plain string\"",
        ),
        (json!(7), "chat_template is 7"),
    ] {
        set_chat_template(&c.model, Some(value));
        let err = fails(&gguf_args(&c.model, &gguf, &["--vocab-pre", "test-pre"]));
        assert_refused(&err, &["tokenizer_config.json", want], &out);
    }
}

#[test]
fn integer_hyperparameters_of_another_type_are_refused_naming_the_field() {
    let d = tmp();
    let tensors = dense_layers(&mut Rng(33), DType::BF16, 64, 32, &[]);
    let out = d.path().join("out");
    for (field, value) in [
        ("num_attention_heads", json!(4.5)),
        ("num_attention_heads", json!("4")),
        ("num_key_value_heads", json!(-2)),
        ("intermediate_size", json!(128.0)),
    ] {
        let m = model_dir(d.path(), "llama3", |c| c[field] = value.clone(), &tensors);
        let err = fails(&gguf_args(&m, &out.join("x.gguf"), &["--vocab-pre", "x"]));
        assert_refused(
            &err,
            &[
                "config.json",
                &format!("`{field}` is {value}, not an unsigned integer"),
            ],
            &out,
        );
        std::fs::remove_dir_all(&m).unwrap();
    }
}

/// Models llama.cpp cannot load: each refused naming the tensor (and the config field for a
/// shape), before any output exists.
#[test]
fn models_llama_cpp_cannot_load_are_refused_naming_tensor_and_field() {
    let d = tmp();
    let tensors = dense_layers(&mut Rng(34), DType::BF16, 64, 32, &[]);
    let out = d.path().join("out");
    let refused = |edit: &dyn Fn(&mut Json), keep: &dyn Fn(&str) -> bool, want: &[&str]| {
        let kept: Vec<T> = tensors.iter().filter(|t| keep(&t.0)).cloned().collect();
        let m = model_dir(d.path(), "llama3", edit, &kept);
        let err = fails(&gguf_args(&m, &out.join("x.gguf"), &["--vocab-pre", "x"]));
        assert_refused(&err, want, &out);
        std::fs::remove_dir_all(&m).unwrap();
    };
    let all = |_: &str| true;
    let same = |_: &mut Json| {};
    refused(
        &same,
        &|n| n != "model.embed_tokens.weight",
        &[
            "tensor `token_embd.weight`: missing",
            "`model.embed_tokens.weight`",
        ],
    );
    refused(
        &same,
        &|n| n != "model.norm.weight",
        &["tensor `output_norm.weight`: missing"],
    );
    refused(
        &same,
        &|n| !n.starts_with("model.layers.1."),
        &[
            "`blk.1`",
            "block 1 of num_hidden_layers = 2",
            "`model.layers.1.*`",
        ],
    );
    refused(
        &same,
        &|n| n != "model.layers.1.self_attn.v_proj.weight",
        &["tensor `blk.1.attn_v.weight`: missing", "block 1 does not"],
    );
    refused(
        &|c| c["num_key_value_heads"] = 1.into(),
        &all,
        &[
            "tensor `blk.0.attn_k.weight` (from `model.layers.0.self_attn.k_proj.weight`) is [32, 64]",
            "num_key_value_heads = 1, head_dim = 16 make it [16, 64]",
        ],
    );
    refused(
        &|c| c["vocab_size"] = 500.into(),
        &all,
        &[
            "tensor `output.weight` (from `lm_head.weight`) is [410, 64]",
            "vocab_size = 500, hidden_size = 64 make it [500, 64]",
        ],
    );
    refused(
        &|c| c["intermediate_size"] = 96.into(),
        &all,
        &[
            "tensor `blk.0.ffn_down.weight` (from `model.layers.0.mlp.down_proj.weight`) is [64, 128]",
            "intermediate_size = 96, hidden_size = 64 make it [64, 96]",
        ],
    );
}

/// Llama 4 experts that are not `[experts, rows, columns]`, a fused `gate_up_proj` of an odd
/// width, an expert tensor the converter does not know, and `no_rope_layers` of another type:
/// each refused naming the tensor or the field, before any output exists.
#[test]
fn llama4_experts_and_layer_settings_of_the_wrong_shape_are_refused_by_name() {
    let d = tmp();
    let out = d.path().join("out");
    let seeded = || Rng(35);
    let experts = "model.layers.0.feed_forward.experts.";
    let refused = |edit: &dyn Fn(&mut Json), name: &str, shape: &[u64], want: &[&str]| {
        let mut tensors = head(&mut seeded(), DType::BF16);
        tensors.push(rand_t(&mut seeded(), name, DType::BF16, shape));
        let m = model_dir(d.path(), "llama4text", edit, &tensors);
        let err = fails(&gguf_args(&m, &out.join("x.gguf"), &["--vocab-pre", "x"]));
        assert_refused(&err, want, &out);
        std::fs::remove_dir_all(&m).unwrap();
    };
    let same = |_: &mut Json| {};
    let gate_up = format!("{experts}gate_up_proj");
    refused(
        &same,
        &gate_up,
        &[64, 128],
        &[
            &format!("`{gate_up}`"),
            "expected [experts, rows, columns], got [64, 128]",
        ],
    );
    refused(
        &same,
        &gate_up,
        &[2, 64, 63],
        &[
            &format!("`{gate_up}`"),
            "gate_up_proj has an odd column count 63",
        ],
    );
    let gate = format!("{experts}gate_proj");
    refused(
        &same,
        &gate,
        &[2, 64, 64],
        &[
            &format!("`{gate}`"),
            "unknown Llama 4 expert tensor `gate_proj`",
        ],
    );
    refused(
        &|c| {
            let m = c.as_object_mut().unwrap();
            m.remove("layer_types");
            m.insert("no_rope_layers".into(), json!("all"));
        },
        &format!("{experts}down_proj"),
        &[2, 64, 64],
        &[
            "config.json",
            "`no_rope_layers` is \"all\", not a list of integers",
        ],
    );
}
