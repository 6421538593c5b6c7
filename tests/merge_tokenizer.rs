//! `tftf merge` with `tokenizer_source` / `tokenizer:` (issue 27): the merged vocabulary,
//! tokenizer files and `config.json` as mergekit 0.1.5 writes them, and each model's embedding
//! and `lm_head` rows remapped to it before the method runs. The oracles in
//! `tests/fixtures/merge/tokenizer/` (made by `make_tokenizer_fixtures.py`): tiny Llama models
//! whose tokenizers differ, mergekit's merges of them, and the same merges in float64.

mod common;

use std::path::{Path, PathBuf};

use common::*;
use serde_json::Value;
use tftf::format::dtype::DType;

fn fixture_dir(rel: &str) -> PathBuf {
    fixture(&format!("merge/tokenizer/{rel}"))
}

fn merge(cfg: &Path, out: &Path) -> std::process::Output {
    tftf(&["merge", s(cfg), s(out), "-q"])
}

/// A JSON file as mergekit's transformers writes it, without the two keys transformers 5.24
/// leaks from loading into a saved `tokenizer_config.json` (`is_local`, `local_files_only`).
fn json_without_loader_keys(path: &Path) -> Value {
    let mut v = read_json(path);
    if let Some(o) = v.as_object_mut() {
        o.remove("is_local");
        o.remove("local_files_only");
    }
    v
}

/// Merges fixture config `name` and checks it against mergekit's merge: the same tensors
/// within the issue's bar, the same tokenizer files and config.json, nothing else of the
/// donor's tokenizer.
fn check(name: &str, dir: &Path) -> PathBuf {
    let out = dir.join("out");
    ok(&merge(&fixture_dir(&format!("configs/{name}.yml")), &out));
    let theirs = fixture_dir(&format!("mergekit/{name}"));
    merge_fixtures::assert_as_right_as(
        name,
        &theirs,
        &fixture_dir(&format!("exact/{name}.safetensors")),
        &load_all(&out),
    );
    assert_eq!(
        read_json(&out.join("config.json")),
        read_json(&theirs.join("config.json")),
        "config.json"
    );
    for f in ["tokenizer.json", "tokenizer_config.json"] {
        assert_eq!(
            json_without_loader_keys(&out.join(f)),
            json_without_loader_keys(&theirs.join(f)),
            "{name}: {f}"
        );
    }
    let mut ours = listing(&out);
    ours.retain(|f| f != "mergekit_config.yml");
    let mut want = listing(&theirs);
    want.retain(|f| f != "mergekit_config.yml");
    assert_eq!(ours, want, "{name}: the files written");
    out
}

#[test]
fn union_of_three_vocabularies_is_mergekits_with_a_chat_template() {
    let dir = tmp();
    let out = check("union_linear", dir.path());
    // The union: the base's 42 tokens, then x1 (b), y1 (c), then <|im_start|> and <|im_end|>
    // with b's settings (the first model's where they differ).
    let tok = read_json(&out.join("tokenizer.json"));
    let added: Vec<(u64, &str)> = tok["added_tokens"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| (e["id"].as_u64().unwrap(), e["content"].as_str().unwrap()))
        .collect();
    assert_eq!(
        added,
        [
            (40, "<s>"),
            (41, "</s>"),
            (42, "x1"),
            (43, "y1"),
            (44, "<|im_start|>"),
            (45, "<|im_end|>")
        ]
    );
    assert_eq!(
        std::fs::read(out.join("chat_template.jinja")).unwrap(),
        std::fs::read(fixture_dir("mergekit/union_linear/chat_template.jinja")).unwrap()
    );
    assert_eq!(load_all(&out)["lm_head.weight"].1, [46, 16]);
    // The same bytes on one thread and on three with a small budget.
    let cfg = fixture_dir("configs/union_linear.yml");
    let (one, three) = (dir.path().join("one"), dir.path().join("three"));
    ok(&tftf(&["merge", s(&cfg), s(&one), "-q", "--threads", "1"]));
    ok(&tftf(&[
        "merge",
        s(&cfg),
        s(&three),
        "-q",
        "--threads",
        "3",
        "--memory-budget",
        "16MiB",
    ]));
    assert_eq!(load_all(&one), load_all(&out));
    assert_eq!(load_all(&three), load_all(&out));
}

#[test]
fn base_vocabulary_drops_the_other_models_tokens_and_fills_the_rows_they_lack() {
    let dir = tmp();
    check("base_task_arithmetic", dir.path());
}

#[test]
fn another_models_vocabulary_with_slerp_is_mergekits() {
    let dir = tmp();
    let out = check("model_slerp", dir.path());
    // b's tokenizer, bytes and all; its padding rows past the 45 tokens are gone.
    assert_eq!(
        std::fs::read(out.join("tokenizer.json")).unwrap(),
        std::fs::read(fixture_dir("models/b/tokenizer.json")).unwrap()
    );
    assert_eq!(load_all(&out)["model.embed_tokens.weight"].1, [45, 16]);
}

#[test]
fn token_sources_forced_tokens_and_padding_are_mergekits() {
    let dir = tmp();
    let out = check("tokens_linear", dir.path());
    assert_eq!(read_json(&out.join("config.json"))["vocab_size"], 48);
}

/// A model of `rows` embedding rows, row `i` of its embedding and `lm_head` being
/// `[base + i, -(base + i)]` (f32), with `tokenizer` as its tokenizer.json.
fn toy(dir: &Path, name: &str, base: f32, rows: u64, tokenizer: &str) -> PathBuf {
    let embed: Vec<f32> = (0..rows)
        .flat_map(|i| [base + i as f32, -(base + i as f32)])
        .collect();
    let config = format!(
        r#"{{"architectures": ["LlamaForCausalLM"], "model_type": "llama", "num_hidden_layers": 1, "vocab_size": {rows}}}"#
    );
    Model::new()
        .tensor(
            "model.embed_tokens.weight",
            DType::F32,
            &[rows, 2],
            f32_bytes(&embed),
        )
        .tensor(
            "model.layers.0.mlp.up_proj.weight",
            DType::F32,
            &[2, 2],
            f32_bytes(&[base, 1.0, 2.0, 3.0]),
        )
        .tensor("lm_head.weight", DType::F32, &[rows, 2], f32_bytes(&embed))
        .config(&config)
        .file("tokenizer.json", tokenizer)
        .file(
            "tokenizer_config.json",
            r#"{"tokenizer_class": "PreTrainedTokenizerFast"}"#,
        )
        .write(&dir.join(name))
}

fn word_level(vocab: &str, added: &[(u64, &str)]) -> String {
    let added: Vec<String> = added
        .iter()
        .map(|(id, c)| {
            format!(
                r#"{{"id": {id}, "content": "{c}", "single_word": false, "lstrip": false, "rstrip": false, "normalized": false, "special": true}}"#
            )
        })
        .collect();
    format!(
        r#"{{"version": "1.0", "added_tokens": [{}], "model": {{"type": "WordLevel", "vocab": {{{vocab}}}, "unk_token": "p"}}}}"#,
        added.join(", ")
    )
}

/// a (the base): p q r <s>; b: q p s <s> <x> and a padding row; c: p s t.
fn three_toys(dir: &Path) -> [PathBuf; 3] {
    [
        toy(
            dir,
            "a",
            10.0,
            4,
            &word_level(r#""p": 0, "q": 1, "r": 2"#, &[(3, "<s>")]),
        ),
        toy(
            dir,
            "b",
            20.0,
            6,
            &word_level(r#""q": 0, "p": 1, "s": 2"#, &[(3, "<s>"), (4, "<x>")]),
        ),
        toy(
            dir,
            "c",
            30.0,
            3,
            &word_level(r#""p": 0, "s": 1, "t": 2"#, &[]),
        ),
    ]
}

/// One model's remapped rows: a linear merge giving it weight 1 and the others 0.
fn remapped_rows(dir: &Path, models: &[PathBuf], pick: usize, tokenizer: &str) -> Vec<f32> {
    let list: String = models
        .iter()
        .enumerate()
        .map(|(k, m)| {
            format!(
                "  - model: {}\n    parameters:\n      weight: {}\n",
                m.display(),
                u8::from(k == pick)
            )
        })
        .collect();
    let text = format!(
        "merge_method: linear\nbase_model: {}\nmodels:\n{list}parameters:\n  normalize: false\n{tokenizer}",
        models[0].display()
    );
    let cfg = dir.join("rows.yml");
    std::fs::write(&cfg, text).unwrap();
    let out = dir.join(format!("rows{pick}"));
    ok(&merge(&cfg, &out));
    let tensors = load_all(&out);
    let (embed, head) = (
        &tensors["model.embed_tokens.weight"],
        &tensors["lm_head.weight"],
    );
    assert_eq!(embed, head, "embedding and lm_head are remapped alike");
    f32s_of(&embed.2).chunks(2).map(|r| r[0]).collect()
}

#[test]
fn missing_rows_come_from_the_only_model_the_base_or_the_average() {
    let dir = tmp();
    let models = three_toys(dir.path());
    // Union: p q r <s> (a's ids), then s (b), t (c), then <x> (b's added token).
    // a lacks s, t, <x>; b lacks r, t; c lacks q, r, <s>, <x>.
    let rows = |k| remapped_rows(dir.path(), &models, k, "tokenizer_source: union\n");
    // s: b and c have it, the base does not: their average (22 + 31) / 2.
    assert_eq!(rows(0), [10.0, 11.0, 12.0, 13.0, 26.5, 32.0, 24.0]);
    // r: only a has it; t: only c; <s>: a and b have it but c does not: b keeps its own.
    assert_eq!(rows(1), [21.0, 20.0, 12.0, 23.0, 22.0, 32.0, 24.0]);
    // q and <s>: the base's rows where c lacks them.
    assert_eq!(rows(2), [30.0, 11.0, 12.0, 13.0, 31.0, 32.0, 24.0]);
    let cfg = read_json(&dir.path().join("rows0/config.json"));
    assert_eq!(cfg["vocab_size"], 7);
    let tok = std::fs::read_to_string(dir.path().join("rows0/tokenizer.json")).unwrap();
    for t in [
        r#""content": "s""#,
        r#""content": "t""#,
        r#""content": "<x>""#,
    ] {
        assert!(tok.contains(t), "{t} missing from {tok}");
    }
}

#[test]
fn forced_and_zero_tokens_and_padding_rows_follow_the_tokens_section() {
    let dir = tmp();
    let models = three_toys(dir.path());
    let section = format!(
        "tokenizer:\n  source: base\n  tokens:\n    p:\n      source:\n        kind: model_token\n        model: {}\n        token: <x>\n      force: true\n    <new>:\n      source:\n        kind: zero\n    r:\n      source: {}\n  pad_to_multiple_of: 4\n",
        models[1].display(),
        models[0].display()
    );
    let rows = |k| remapped_rows(dir.path(), &models, k, &section);
    // p forced to b's <x> (24) everywhere; <new> (id 4) zero; row 5..7 pads: the mean of the
    // model's five rows. r comes from a where missing.
    let mean = |v: &[f32]| v.iter().sum::<f32>() / v.len() as f32;
    let a = [24.0, 11.0, 12.0, 13.0, 0.0];
    let b = [24.0, 20.0, 12.0, 23.0, 0.0];
    let c = [24.0, 11.0, 12.0, 13.0, 0.0];
    for (k, want) in [a, b, c].iter().enumerate() {
        let mut want = want.to_vec();
        want.extend([mean(&want); 3]);
        assert_eq!(rows(k), want, "model {k}");
    }
    assert_eq!(
        read_json(&dir.path().join("rows0/config.json"))["vocab_size"],
        8
    );
}

/// Runs the merge and expects a refusal naming `needles`, with no output left.
fn refused(dir: &Path, text: &str, needles: &[&str]) {
    let cfg = dir.join("bad.yml");
    std::fs::write(&cfg, text).unwrap();
    let out = dir.join("out");
    let err = fails(&["merge", s(&cfg), s(&out), "-q"]);
    assert_refused(&err, needles, &out);
}

fn union_of(models: &[PathBuf], extra: &str) -> String {
    let list: String = models
        .iter()
        .map(|m| {
            format!(
                "  - model: {}\n    parameters:\n      weight: 1\n",
                m.display()
            )
        })
        .collect();
    format!("merge_method: linear\nmodels:\n{list}{extra}")
}

#[test]
fn bad_tokenizer_settings_are_refused_by_name_before_any_output() {
    let dir = tmp();
    let models = three_toys(dir.path());
    let d = dir.path();
    let (a, b) = (s(&models[0]), s(&models[1]));
    refused(
        d,
        &union_of(&models[..2], "tokenizer_source: no/such/model\n"),
        &[
            "`tokenizer_source`",
            "no/such/model",
            "not an existing local path",
        ],
    );
    refused(
        d,
        &union_of(
            &models[..2],
            &format!(
                "tokenizer:\n  tokens:\n    q:\n      source: {}\n",
                s(&models[2])
            ),
        ),
        &[
            "`tokenizer.tokens.q`",
            s(&models[2]),
            "not one of the merged models",
        ],
    );
    refused(
        d,
        &union_of(
            &models[..2],
            "tokenizer:\n  tokens:\n    q:\n      force: true\n",
        ),
        &["`tokenizer.tokens.q`", "`force: true` needs a `source`"],
    );
    refused(
        d,
        &union_of(
            &models[..2],
            &format!("tokenizer:\n  tokens:\n    r:\n      source:\n        kind: model_token\n        model: {a}\n        token: zz\n"),
        ),
        &["model.embed_tokens.weight", "\"r\"", "\"zz\"", a, "no such token"],
    );
    refused(
        d,
        &union_of(
            &models[..2],
            &format!("tokenizer:\n  tokens:\n    s:\n      source: {a}\n      force: true\n"),
        ),
        &["model.embed_tokens.weight", "\"s\"", a, "lacks it"],
    );
    refused(
        d,
        &union_of(
            &models[..2],
            &format!("tokenizer:\n  tokens:\n    s:\n      source:\n        kind: model_token\n        model: {b}\n        token_id: 6\n"),
        ),
        &["model.embed_tokens.weight", "row 6", b, "6 rows"],
    );
    refused(
        d,
        &union_of(
            &models[..2],
            "tokenizer: {source: union, pad_to_multiple_of: 0}\n",
        ),
        &["pad_to_multiple_of", "positive"],
    );
    // A model whose tokenizer is missing or unreadable.
    std::fs::remove_file(models[1].join("tokenizer.json")).unwrap();
    refused(
        d,
        &union_of(&models[..2], "tokenizer_source: union\n"),
        &["tokenizer of model", b, "tokenizer.json"],
    );
    std::fs::write(
        models[1].join("tokenizer.json"),
        r#"{"model": {"type": "BPE2", "vocab": {}}}"#,
    )
    .unwrap();
    refused(
        d,
        &union_of(&models[..2], "tokenizer_source: union\n"),
        &["tokenizer.json", "not one tftf reads"],
    );
}

#[test]
fn base_tokens_past_the_embedding_rows_are_refused() {
    let dir = tmp();
    let models = three_toys(dir.path());
    // a's tokenizer has 4 tokens; claim 3 rows.
    let cfg = std::fs::read_to_string(models[0].join("config.json"))
        .unwrap()
        .replace("\"vocab_size\": 4", "\"vocab_size\": 3");
    std::fs::write(models[0].join("config.json"), cfg).unwrap();
    refused(
        dir.path(),
        &union_of(&models[..2], "tokenizer_source: base\n"),
        &[s(&models[0]), "\"<s>\" at id 3", "3 embedding rows"],
    );
}

/// Bytes that change a tokenizer.json's structure.
const JSON_BYTES: &[u8] = b"{}[]:,\"0123456789-e. \\n";

/// Tokenizer files are a new kind of input: a model's tokenizer.json mutated byte by byte must
/// give a merge or a refusal, never a panic.
#[test]
fn mutated_tokenizers_never_panic() {
    let dir = tmp();
    let models = three_toys(dir.path());
    let original = std::fs::read(models[1].join("tokenizer.json")).unwrap();
    let cfg = dir.path().join("fuzz.yml");
    std::fs::write(&cfg, union_of(&models, "tokenizer_source: union\n")).unwrap();
    let mut rng = Rng(0x746f_6b73);
    for it in 0..60u32 {
        let mut bytes = original.clone();
        for _ in 0..1 + rng.next_u32() % 3 {
            let at = rng.next_u32() as usize % bytes.len();
            match rng.next_u32() % 3 {
                0 => bytes[at] = JSON_BYTES[rng.next_u32() as usize % JSON_BYTES.len()],
                1 => bytes.insert(at, JSON_BYTES[rng.next_u32() as usize % JSON_BYTES.len()]),
                _ => {
                    bytes.remove(at);
                }
            }
        }
        std::fs::write(models[1].join("tokenizer.json"), &bytes).unwrap();
        let out = dir.path().join(format!("out{it}"));
        let code = merge(&cfg, &out).status.code();
        assert!(
            matches!(code, Some(0 | 1)),
            "iteration {it}: exit {code:?} on:\n{}",
            String::from_utf8_lossy(&bytes)
        );
    }
}

/// A vocabulary tensor the merged tokenizer remaps must be stored as floats: an FP8 embedding
/// is refused naming the model and the tensor, before any output.
#[test]
fn a_quantised_vocabulary_tensor_is_refused_where_rows_are_remapped() {
    let dir = tmp();
    let models = three_toys(dir.path());
    // b's embedding as FP8 (E4M3 1.0 everywhere) with a unit block scale.
    let b = &models[1];
    let config = std::fs::read_to_string(b.join("config.json")).unwrap();
    let tokenizer = std::fs::read_to_string(b.join("tokenizer.json")).unwrap();
    std::fs::remove_dir_all(b).unwrap();
    Model::new()
        .tensor(
            "model.embed_tokens.weight",
            DType::F8_E4M3,
            &[6, 2],
            vec![0x38; 12],
        )
        .tensor(
            "model.embed_tokens.weight_scale_inv",
            DType::F32,
            &[1, 1],
            f32_bytes(&[1.0]),
        )
        .tensor(
            "model.layers.0.mlp.up_proj.weight",
            DType::F32,
            &[2, 2],
            f32_bytes(&[20.0, 1.0, 2.0, 3.0]),
        )
        .tensor("lm_head.weight", DType::F32, &[6, 2], f32_bytes(&[1.0; 12]))
        .config(&config)
        .file("tokenizer.json", &tokenizer)
        .file(
            "tokenizer_config.json",
            r#"{"tokenizer_class": "PreTrainedTokenizerFast"}"#,
        )
        .write(b);
    refused(
        dir.path(),
        &union_of(&models[..2], "tokenizer_source: union\n"),
        &[
            s(b),
            "model.embed_tokens.weight",
            "is quantised",
            "tftf dequant",
        ],
    );
}
