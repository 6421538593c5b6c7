//! `tftf merge`: mergekit configs merged as mergekit 0.1.5 merges them. The oracles in
//! `tests/fixtures/merge/` (made by its `make_fixtures.py`): tiny Llama models from
//! transformers, mergekit's own outputs for each config, and each formula evaluated in float64.

mod common;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use common::*;
use tftf::format::dtype::DType;

type Tensors = BTreeMap<String, (String, Vec<usize>, Vec<u8>)>;

fn config(name: &str) -> PathBuf {
    fixture(&format!("merge/configs/{name}.yml"))
}

fn merge(cfg: &Path, out: &Path, extra: &[&str]) -> std::process::Output {
    let mut args = vec!["merge", s(cfg), s(out), "-q"];
    args.extend_from_slice(extra);
    tftf(&args)
}

/// The issue's accuracy bar against mergekit's merge `name` and its float64 result.
fn assert_as_right_as_mergekit(name: &str, ours: &Tensors) -> f64 {
    assert_as_right_as_mergekit_but_ties(name, ours, &|_, n| vec![false; n])
}

/// As [`assert_as_right_as_mergekit`], except at the elements `tied(tensor, len)` marks.
fn assert_as_right_as_mergekit_but_ties(
    name: &str,
    ours: &Tensors,
    tied: &dyn Fn(&str, usize) -> Vec<bool>,
) -> f64 {
    merge_fixtures::assert_as_right_as_but_ties(
        name,
        &fixture(&format!("merge/mergekit/{name}")),
        &fixture(&format!("merge/exact/{name}.safetensors")),
        ours,
        tied,
    )
}

/// The side files mergekit writes: config.json (as JSON: mergekit re-serialises it), the
/// tokenizer files and generation config copied from the donor byte for byte, the config
/// itself as mergekit_config.yml; never the donor's model card.
fn assert_side_files_as_mergekit(name: &str, out: &Path) {
    let theirs = fixture(&format!("merge/mergekit/{name}"));
    assert_eq!(
        read_json(&out.join("config.json")),
        read_json(&theirs.join("config.json"))
    );
    for f in [
        "tokenizer.json",
        "tokenizer_config.json",
        "generation_config.json",
        "mergekit_config.yml",
    ] {
        assert_eq!(
            std::fs::read(out.join(f)).unwrap(),
            std::fs::read(theirs.join(f)).unwrap(),
            "{f}"
        );
    }
    assert!(
        !out.join("README.md").exists(),
        "the donor's model card was copied"
    );
}

/// The fixture config `name` merged by tftf into a fresh folder: the folder (kept alive while
/// the result is read) and the output's path.
fn merged_fixture(name: &str) -> (tempfile::TempDir, PathBuf) {
    let (dir, out) = tmp_out();
    ok(&merge(&config(name), &out, &[]));
    (dir, out)
}

fn check_method(name: &str) -> f64 {
    let (_dir, out) = merged_fixture(name);
    let same = assert_as_right_as_mergekit(name, &load_all(&out));
    assert_side_files_as_mergekit(name, &out);
    same
}

#[test]
fn linear_bf16_with_gradients_and_filters_is_as_right_as_mergekit() {
    // Both round a weighted mean of bf16 values once: nearly every element agrees.
    assert!(check_method("linear_bf16") > 0.99);
}

#[test]
fn linear_f32_without_normalize_is_as_right_as_mergekit() {
    check_method("linear_f32");
}

#[test]
fn task_arithmetic_bf16_is_as_right_as_mergekit() {
    check_method("task_arithmetic_bf16");
}

#[test]
fn task_arithmetic_f32_normalized_with_a_gradient_is_as_right_as_mergekit() {
    check_method("task_arithmetic_f32");
}

#[test]
fn passthrough_slices_stack_and_renumber_layers_exactly_as_mergekit() {
    let (_dir, out) = merged_fixture("passthrough_slices");
    let ours = load_all(&out);
    let theirs = load_all(&fixture("merge/mergekit/passthrough_slices"));
    assert_eq!(ours, theirs);
    // Layers 0-2 of a, then 1-3 of b: output layer 3 is b's layer 1.
    let b = load_all(&fixture("merge/models/b_bf16"));
    let name = |l: usize| format!("model.layers.{l}.mlp.down_proj.weight");
    assert_eq!(ours[&name(3)], b[&name(1)]);
    assert_eq!(read_json(&out.join("config.json"))["num_hidden_layers"], 6);
    assert_side_files_as_mergekit("passthrough_slices", &out);
}

#[test]
fn the_output_is_the_same_for_any_thread_count_and_chunking() {
    let dir = tmp();
    let mut rng = Rng(5);
    let model = |rng: &mut Rng, name: &str| {
        Model::new()
            .rand(
                rng,
                "model.layers.0.mlp.up_proj.weight",
                DType::F32,
                &[2048, 1024],
            )
            .config(LLAMA)
            .write(&dir.path().join(name))
    };
    let (a, b) = (model(&mut rng, "a"), model(&mut rng, "b"));
    let cfg = write_config(
        dir.path(),
        &format!(
            "merge_method: linear\nmodels:\n  - model: {}\n    parameters: {{weight: 0.3}}\n  - model: {}\n    parameters: {{weight: 0.6}}\n",
            a.display(),
            b.display()
        ),
    );
    let one = dir.path().join("one");
    let many = dir.path().join("many");
    ok(&merge(&cfg, &one, &["--threads", "1"]));
    ok(&merge(
        &cfg,
        &many,
        &["--threads", "2", "--memory-budget", "16MiB"],
    ));
    assert_eq!(load_all(&one), load_all(&many));
    // And each element is the weighted mean rounded once.
    let (x, y) = (load_all(&a), load_all(&b));
    let k = "model.layers.0.mlp.up_proj.weight";
    let (xs, ys, got) = (
        f32s_of(&x[k].2),
        f32s_of(&y[k].2),
        f32s_of(&load_all(&one)[k].2),
    );
    for i in (0..xs.len()).step_by(997) {
        let want = ((0.3 * xs[i] as f64 + 0.6 * ys[i] as f64) / (0.3 + 0.6)) as f32;
        assert_eq!(got[i].to_bits(), want.to_bits(), "element {i}");
    }
}

const LLAMA: &str =
    r#"{"architectures": ["LlamaForCausalLM"], "model_type": "llama", "num_hidden_layers": 2}"#;

fn write_config(dir: &Path, text: &str) -> PathBuf {
    let p = dir.join("merge.yml");
    std::fs::write(&p, text).unwrap();
    p
}

/// Two small Llama-named models in `dir` (`a`, `b`), whose `edit` can change `b`.
fn two_models(dir: &Path, edit_b: impl FnOnce(Model) -> Model) -> (PathBuf, PathBuf) {
    let mut rng = Rng(9);
    let base = |rng: &mut Rng| {
        Model::new()
            .rand(rng, "model.embed_tokens.weight", DType::BF16, &[8, 4])
            .rand(
                rng,
                "model.layers.0.mlp.up_proj.weight",
                DType::BF16,
                &[4, 4],
            )
            .rand(
                rng,
                "model.layers.1.mlp.up_proj.weight",
                DType::BF16,
                &[4, 4],
            )
            .rand(rng, "lm_head.weight", DType::BF16, &[8, 4])
            .config(LLAMA)
    };
    let a = base(&mut rng).write(&dir.join("a"));
    let b = edit_b(base(&mut rng)).write(&dir.join("b"));
    (a, b)
}

fn linear_config(a: &Path, b: &Path, extra: &str) -> String {
    format!(
        "merge_method: linear\nmodels:\n  - model: {}\n    parameters:\n      weight: 1.0\n  - model: {}\n    parameters:\n      weight: 1.0\n{extra}",
        a.display(),
        b.display()
    )
}

/// Runs the merge of `text` and expects a refusal mentioning `needles`, with no output left.
fn refused(dir: &Path, text: &str, needles: &[&str]) {
    let cfg = write_config(dir, text);
    let out = dir.join("out");
    let err = fails(&["merge", s(&cfg), s(&out), "-q"]);
    assert_refused(&err, needles, &out);
}

#[test]
fn unknown_keys_methods_and_parameters_are_refused_by_name() {
    let dir = tmp();
    let (a, b) = two_models(dir.path(), |m| m);
    let ok_text = linear_config(&a, &b, "");
    refused(
        dir.path(),
        &format!("{ok_text}base_modle: {}\n", a.display()),
        &["unknown key `base_modle`", "merge.yml"],
    );
    refused(
        dir.path(),
        &ok_text.replace("merge_method: linear", "merge_method: lienar"),
        &["unknown merge method `lienar`", "task_arithmetic"],
    );
    refused(
        dir.path(),
        &ok_text.replacen("weight: 1.0", "weigth: 1.0", 1),
        &["takes no parameter `weigth`", "it takes: weight, normalize"],
    );
    refused(
        dir.path(),
        &format!("{ok_text}parameters:\n  lambda: 2\n"),
        &["`linear` takes no parameter `lambda`"],
    );
    refused(
        dir.path(),
        &ok_text.replacen("weight: 1.0", "normalize: true", 1),
        &["`normalize` of `linear` is shared by all models"],
    );
}

#[test]
fn missing_models_tensors_and_parameters_are_named() {
    let dir = tmp();
    let (a, b) = two_models(dir.path(), |m| m);
    let missing = dir.path().join("no-such-model");
    refused(
        dir.path(),
        &linear_config(&a, &missing, ""),
        &["no-such-model", "not an existing local path"],
    );
    refused(
        dir.path(),
        &linear_config(&a, &b, "").replacen("    parameters:\n      weight: 1.0\n", "", 1),
        &[
            "missing required parameter `weight`",
            s(&a),
            "model.embed_tokens.weight",
        ],
    );
    let dir2 = tmp();
    let (a, b) = two_models(dir2.path(), |m| {
        let kept: Vec<T> = m
            .all()
            .into_iter()
            .filter(|t| t.0 != "lm_head.weight")
            .collect();
        Model::new().tensors(kept).config(LLAMA)
    });
    refused(
        dir2.path(),
        &linear_config(&a, &b, ""),
        &["lm_head.weight", s(&b), "missing from this model"],
    );
}

#[test]
fn mismatched_shapes_and_architectures_are_refused_before_any_output() {
    let dir = tmp();
    let (a, b) = two_models(dir.path(), |m| {
        let mut rng = Rng(3);
        let mut v: Vec<T> = m
            .all()
            .into_iter()
            .filter(|t| t.0 != "lm_head.weight")
            .collect();
        v.push(rand_t(&mut rng, "lm_head.weight", DType::BF16, &[9, 4]));
        Model::new().tensors(v).config(LLAMA)
    });
    refused(
        dir.path(),
        &linear_config(&a, &b, ""),
        &["lm_head.weight", "[9, 4]", "[8, 4]", "same shape"],
    );
    let dir = tmp();
    let mistral = LLAMA
        .replace("LlamaForCausalLM", "MistralForCausalLM")
        .replace("\"llama\"", "\"mistral\"");
    let (a, b) = two_models(dir.path(), |m| m.config(&mistral));
    let text = linear_config(&a, &b, "");
    refused(dir.path(), &text, &["--allow-crimes", "MistralForCausalLM"]);
    let out = dir.path().join("crimes");
    ok(&merge(
        &write_config(dir.path(), &text),
        &out,
        &["--allow-crimes"],
    ));
    assert!(out.join("model.safetensors").exists());
}

#[test]
fn a_layer_range_beyond_the_model_is_refused_naming_the_model() {
    let dir = tmp();
    let (a, b) = two_models(dir.path(), |m| m);
    let text = format!(
        "merge_method: passthrough\nslices:\n  - sources:\n      - model: {}\n        layer_range: [0, 2]\n  - sources:\n      - model: {}\n        layer_range: [1, 3]\n",
        a.display(),
        b.display()
    );
    refused(
        dir.path(),
        &text,
        &[
            "layer_range ends at 3",
            s(&b),
            "has 2 layers",
            "slices[1].sources[0]",
        ],
    );
}

#[test]
fn weights_summing_to_zero_under_normalize_are_refused() {
    let dir = tmp();
    let (a, b) = two_models(dir.path(), |m| m);
    let text = linear_config(&a, &b, "").replacen("weight: 1.0", "weight: -1.0", 1);
    refused(dir.path(), &text, &["sum to 0", "normalize: false"]);
}

#[test]
fn a_dry_run_prints_the_plan_and_writes_nothing() {
    let dir = tmp();
    let (a, b) = two_models(dir.path(), |m| m);
    let cfg = write_config(dir.path(), &linear_config(&a, &b, ""));
    let out = dir.path().join("out");
    let o = tftf(&["merge", s(&cfg), "-o", s(&out), "--dry-run"]);
    ok(&o);
    assert!(!out.exists());
    assert_mentions(
        &stdout(&o),
        &["linear BF16 -> BF16: 4 tensors", "mergekit_config.yml"],
    );
}

#[test]
fn the_short_form_merges_a_lora_adapter_as_merge_lora_scale_does() {
    let case = peft::peft_case("llama-lora-bf16");
    let dir = tmp();
    let short = dir.path().join("short");
    let long = dir.path().join("long");
    ok(&tftf(&[
        "merge",
        "--weights",
        s(&case.join("base")),
        "--lora",
        s(&case.join("adapter")),
        "--alpha",
        "0.5",
        "--output",
        s(&short),
        "-q",
    ]));
    ok(&tftf(&[
        "merge-lora",
        s(&case.join("base")),
        "-a",
        s(&case.join("adapter")),
        "--scale",
        "0.5",
        "-o",
        s(&long),
        "-q",
    ]));
    assert_eq!(load_all(&short), load_all(&long));
    // The adapter changed something: a scale of 0.5 is not a copy of the base.
    assert_ne!(load_all(&short), load_all(&case.join("base")));
}

#[test]
fn a_chat_template_is_written_and_a_template_name_is_refused() {
    let dir = tmp();
    let (a, b) = two_models(dir.path(), |m| m);
    let template = "{% for m in messages %}{{ m.content }}{% endfor %}";
    let text = linear_config(&a, &b, &format!("chat_template: \"{template}\"\n"));
    let out = dir.path().join("written");
    ok(&merge(&write_config(dir.path(), &text), &out, &[]));
    assert_eq!(
        std::fs::read_to_string(out.join("chat_template.jinja")).unwrap(),
        template
    );
    refused(
        dir.path(),
        &linear_config(&a, &b, "chat_template: chatml\n"),
        &["`chat_template: chatml`", "named templates"],
    );
}

#[test]
fn no_copy_tokenizer_leaves_the_tokenizer_files_out() {
    let dir = tmp();
    let (a, b) = two_models(dir.path(), |m| m);
    std::fs::write(a.join("tokenizer.json"), "{}").unwrap();
    let cfg = write_config(dir.path(), &linear_config(&a, &b, ""));
    let (with, without) = (dir.path().join("with"), dir.path().join("without"));
    ok(&merge(&cfg, &with, &[]));
    ok(&merge(&cfg, &without, &["--no-copy-tokenizer"]));
    assert!(with.join("tokenizer.json").exists());
    assert!(!without.join("tokenizer.json").exists());
    assert!(without.join("config.json").exists());
}

/// Bytes that change a YAML document's structure.
const YAML_BYTES: &[u8] = b"[]{}:-, \n\"'0.9e-x#&*!|>";

/// mergekit configs are a new kind of input: the fixture configs (and one with every kind of
/// setting), mutated byte by byte with a fixed seed, must parse or be refused with a message,
/// never panic; a sample of them also runs through the binary (exit 1 or 0, never a crash).
#[test]
fn mutated_configs_never_panic() {
    use tftf::ops::merge::MergeConfig;
    let mut texts: Vec<String> = [
        "linear_bf16",
        "linear_f32",
        "task_arithmetic_bf16",
        "task_arithmetic_f32",
        "passthrough_slices",
    ]
    .iter()
    .map(|n| std::fs::read_to_string(config(n)).unwrap())
    .collect();
    texts.push(
        "merge_method: task_arithmetic\nbase_model: tests/fixtures/merge/models/a_bf16\nslices:\n  - sources:\n      - model: tests/fixtures/merge/models/a_bf16\n        layer_range: [0, 4]\n      - model: tests/fixtures/merge/models/b_bf16\n        layer_range: [0, 4]\n        parameters: {weight: [1e-3, \"2\", yes], lambda: {filter: mlp, value: 2}}\n    parameters: {normalize: [true, false]}\ntokenizer: {source: base}\nchat_template: \"{{ x }}{{ y }}{{ z }}{{ w }}\"\n".into(),
    );
    let mut rng = Rng(0x6d65_7267);
    let dir = tmp();
    for it in 0..600u32 {
        let mut bytes = texts[it as usize % texts.len()].clone().into_bytes();
        for _ in 0..1 + rng.next_u32() % 3 {
            let at = rng.next_u32() as usize % bytes.len();
            match rng.next_u32() % 4 {
                0 => bytes[at] ^= 1 << (rng.next_u32() % 8),
                1 => bytes[at] = YAML_BYTES[rng.next_u32() as usize % YAML_BYTES.len()],
                2 => bytes.insert(at, YAML_BYTES[rng.next_u32() as usize % YAML_BYTES.len()]),
                _ => {
                    bytes.remove(at);
                }
            }
        }
        let text = String::from_utf8_lossy(&bytes).into_owned();
        let parsed = std::panic::catch_unwind(|| MergeConfig::parse(Path::new("m.yml"), &text));
        let Ok(result) = parsed else {
            panic!("iteration {it}: parsing panicked on:\n{text}");
        };
        if it % 50 == 0 || result.is_ok() && it % 5 == 0 {
            let cfg = write_config(dir.path(), &text);
            let out = dir.path().join(format!("out{it}"));
            let code = merge(&cfg, &out, &[]).status.code();
            assert!(
                matches!(code, Some(0 | 1)),
                "iteration {it}: exit {code:?} on:\n{text}"
            );
        }
    }
}

#[test]
fn parts_of_one_merge_must_share_the_config_contents_not_only_its_path() {
    let dir = tmp();
    let (a, b) = two_models(dir.path(), |m| m);
    let text = linear_config(&a, &b, "");
    let cfg = write_config(dir.path(), &text);
    let out = dir.path().join("out");
    ok(&merge(&cfg, &out, &["--part", "1/2"]));
    std::fs::write(&cfg, text.replacen("weight: 1.0", "weight: 2.0", 1)).unwrap();
    let err = fails(&[
        "merge",
        s(&cfg),
        s(&out),
        "-q",
        "--part",
        "2/2",
        "--finalize",
    ]);
    assert_mentions(&err, &["the arguments differ (merge_config)"]);
}

/// mergekit 0.1.5's other deterministic methods on the bf16 models: names, shapes, dtypes
/// and config.json as mergekit's, values within the issue's bar of mergekit's output and of
/// mergekit's own code run in float64. arcee_fusion writes F32 under `dtype: bfloat16`, as
/// mergekit does. (ramplus_tl: its fixture's float64 run kept mergekit's f32 scale, which
/// computes in f32 even then; tests/merge_geometric.rs checks it against the formula in
/// float64.)
macro_rules! as_right_as_mergekit {
    ($($method:ident),*) => {
        mod methods_as_right_as_mergekit {
            use super::*;
            $(
                #[test]
                fn $method() {
                    let name = stringify!($method);
                    let (_dir, out) = merged_fixture(name);
                    assert_as_right_as_mergekit(name, &load_all(&out));
                    assert_eq!(
                        read_json(&out.join("config.json")),
                        read_json(&fixture(&format!("merge/mergekit/{name}/config.json")))
                    );
                }
            )*
        }
    };
}

/// ramplus_tl on the bf16 models: mergekit's names, shapes, dtypes (F32: its scale promotes
/// the result) and config.json; its values are checked in tests/merge_geometric.rs.
#[test]
fn ramplus_tl_writes_mergekits_tensors_and_dtypes() {
    let (_dir, out) = merged_fixture("ramplus_tl");
    let ours = load_all(&out);
    let theirs = load_all(&fixture("merge/mergekit/ramplus_tl"));
    let layout = |t: &Tensors| -> Vec<_> {
        t.iter()
            .map(|(k, (d, s, _))| (k.clone(), d.clone(), s.clone()))
            .collect()
    };
    assert_eq!(layout(&ours), layout(&theirs));
    assert!(ours.values().all(|(d, _, _)| d == "F32"));
    assert_eq!(
        read_json(&out.join("config.json")),
        read_json(&fixture("merge/mergekit/ramplus_tl/config.json"))
    );
}

as_right_as_mergekit!(
    slerp,
    nuslerp,
    multislerp,
    karcher,
    model_stock,
    nearswap,
    ram,
    arcee_fusion
);

/// How a sparse method ranks the elements of a tensor of the bf16 fixture models (base `a`,
/// models `b` and `c`), as mergekit's configs in tests/fixtures/merge/configs/ set it.
enum Ranking {
    /// `magnitude` (ties): per model, its `density` for the tensor; keeps the
    /// `max(1, ⌊density·n⌋)` largest `|δ|` rounded to f32.
    Magnitude(fn(&str) -> [f64; 2]),
    /// `magnitude_outliers` (breadcrumbs): per model `(density, gamma)`; drops the
    /// `⌊gamma·n⌋` largest, keeps the next `⌊density·n⌋`.
    Outliers([(f64, f64); 2]),
    /// SCE's `select_topk`: keeps the `⌊topk·m⌋` largest variances (`m` the non-zero ones).
    Variance(f64),
}

/// The elements of tensor `k` whose key equals the key at one of `cuts` in ascending order
/// while equal keys lie on both sides of it: the tie order decides whether they survive.
fn tied_at(keys: &[f64], cuts: &[usize], tied: &mut [bool]) {
    let mut sorted = keys.to_vec();
    sorted.sort_by(f64::total_cmp);
    for &c in cuts {
        if c > 0 && c < sorted.len() && sorted[c - 1] == sorted[c] {
            for (t, key) in tied.iter_mut().zip(keys) {
                *t |= *key == sorted[c];
            }
        }
    }
}

/// The tie-ambiguous elements of tensor `k` of a merge of the fixture models under `ranking`.
fn tied_elements(ranking: &Ranking, k: &str, n: usize) -> Vec<bool> {
    let models: Vec<Tensors> = ["a_bf16", "b_bf16", "c_bf16"]
        .iter()
        .map(|m| load_all(&fixture(&format!("merge/models/{m}"))))
        .collect();
    let values = |m: usize| -> Vec<f64> {
        let bytes = &models[m][k].2;
        (0..n)
            .map(|i| merge_fixtures::element("BF16", bytes, i).0)
            .collect()
    };
    let base = values(0);
    let deltas: Vec<Vec<f64>> = (1..3)
        .map(|m| values(m).iter().zip(&base).map(|(x, b)| x - b).collect())
        .collect();
    let mut tied = vec![false; n];
    let magnitudes =
        |d: &Vec<f64>| -> Vec<f64> { d.iter().map(|x| x.abs() as f32 as f64).collect() };
    match ranking {
        Ranking::Magnitude(densities) => {
            for (d, density) in deltas.iter().zip(densities(k)) {
                let keep = ((density * n as f64) as usize).max(1);
                tied_at(&magnitudes(d), &[n - keep.min(n)], &mut tied);
            }
        }
        Ranking::Outliers(params) => {
            for (d, (density, gamma)) in deltas.iter().zip(params) {
                let target = (density * n as f64) as usize;
                let bottom = n.saturating_sub(target + (gamma * n as f64) as usize);
                tied_at(&magnitudes(d), &[bottom, bottom + target], &mut tied);
            }
        }
        Ranking::Variance(topk) => {
            let variance: Vec<f64> = (0..n)
                .map(|j| {
                    let mean = (deltas[0][j] + deltas[1][j]) / 2.0;
                    ((deltas[0][j] - mean).powi(2) + (deltas[1][j] - mean).powi(2)) / 2.0
                })
                .collect();
            let keep = (variance.iter().filter(|v| **v != 0.0).count() as f64 * topk) as usize;
            tied_at(&variance, &[n - keep], &mut tied);
            // Which of the tied elements survives changes every model's mean square, so
            // every element's weights.
            if tied.contains(&true) {
                tied.fill(true);
            }
        }
    }
    tied
}

/// A sparse method's merge of the fixture models meets the bar everywhere but at ties at its
/// thresholds; those are at most `1/max_tied_share` of the elements (so the bar is not met
/// vacuously), and ours there follow the documented order, which the per-tensor tests pin.
fn check_sparse_method(name: &str, ranking: Ranking, max_tied_share: usize) {
    let (_dir, out) = merged_fixture(name);
    let ours = load_all(&out);
    let count = std::cell::Cell::new((0usize, 0usize));
    let tied = |k: &str, n: usize| {
        let t = tied_elements(&ranking, k, n);
        let (ties, total) = count.get();
        count.set((ties + t.iter().filter(|x| **x).count(), total + n));
        t
    };
    assert_as_right_as_mergekit_but_ties(name, &ours, &tied);
    let (ties, total) = count.get();
    assert!(
        ties * max_tied_share < total,
        "{name}: {ties} of {total} elements tied"
    );
    assert_eq!(
        read_json(&out.join("config.json")),
        read_json(&fixture(&format!("merge/mergekit/{name}/config.json")))
    );
}

#[test]
fn ties_is_as_right_as_mergekit_up_to_tie_order() {
    check_sparse_method("ties", Ranking::Magnitude(|_| [0.5, 0.7]), 200);
}

#[test]
fn ties_with_gradients_filters_rescale_and_lambda_is_as_right_as_mergekit() {
    let densities = |k: &str| [if k.contains("mlp") { 0.4 } else { 0.6 }, 0.9];
    check_sparse_method("ties_params", Ranking::Magnitude(densities), 200);
}

#[test]
fn breadcrumbs_is_as_right_as_mergekit_up_to_tie_order() {
    check_sparse_method(
        "breadcrumbs",
        Ranking::Outliers([(0.8, 0.05), (0.6, 0.01)]),
        200,
    );
}

#[test]
fn breadcrumbs_ties_is_as_right_as_mergekit_up_to_tie_order() {
    check_sparse_method(
        "breadcrumbs_ties",
        Ranking::Outliers([(0.8, 0.05), (0.6, 0.01)]),
        200,
    );
}

#[test]
fn sce_is_as_right_as_mergekit_up_to_tie_order() {
    // Two of the 40 tensors have a variance tie at the threshold.
    check_sparse_method("sce", Ranking::Variance(0.5), 10);
}

/// A base of zeros and a model of seeded non-zero f32 values (`f` of uniform ones in
/// (-1, 1)), the same in two layers (`shape` each): an output element of a one-model merge
/// was kept iff it is not zero.
fn zero_base_and_model(
    dir: &Path,
    shape: &[u64],
    f: fn(f32) -> f32,
) -> (PathBuf, PathBuf, Vec<f32>) {
    let mut rng = Rng(27);
    let n = shape.iter().product::<u64>() as usize;
    let values: Vec<f32> = (0..n)
        .map(|_| (rng.next_u32() >> 8) as f32 / (1 << 24) as f32 * 2.0 - 1.0)
        .map(|v| if v == 0.0 { 0.5 } else { f(v) })
        .collect();
    let bytes = |v: &[f32]| v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
    let write = |name: &str, v: &[f32]| {
        Model::new()
            .tensor(LAYER0, DType::F32, shape, bytes(v))
            .tensor(LAYER1, DType::F32, shape, bytes(v))
            .config(LLAMA)
            .write(&dir.join(name))
    };
    (
        write("base", &vec![0.0; n]),
        write("model", &values),
        values,
    )
}

const LAYER0: &str = "model.layers.0.mlp.up_proj.weight";
const LAYER1: &str = "model.layers.1.mlp.up_proj.weight";

/// Merges `text` with `--random-seed seed`: with one thread and the default budget, and with
/// two threads and a budget of `budget` (other scheduling); both must give the same bytes.
fn seeded_merge(dir: &Path, text: &str, seed: u64, budget: &str) -> Tensors {
    let cfg = write_config(dir, text);
    let seed = seed.to_string();
    let (one, two) = (
        dir.join(format!("one{seed}")),
        dir.join(format!("two{seed}")),
    );
    ok(&merge(
        &cfg,
        &one,
        &["--random-seed", &seed, "--threads", "1"],
    ));
    let args = [
        "--random-seed",
        &seed,
        "--threads",
        "2",
        "--memory-budget",
        budget,
    ];
    ok(&merge(&cfg, &two, &args));
    let (a, b) = (load_all(&one), load_all(&two));
    assert_eq!(
        a, b,
        "seed {seed}: threads 1 and 2 (budget {budget}) differ"
    );
    a
}

/// `kept` of `n` lies within 5σ of a binomial draw with probability `p`.
fn assert_kept_fraction(label: &str, kept: usize, n: usize, p: f64) {
    let fraction = kept as f64 / n as f64;
    let sigma = (p * (1.0 - p) / n as f64).sqrt();
    assert!(
        (fraction - p).abs() < 5.0 * sigma,
        "{label}: kept {fraction}, expected {p} ± {}",
        5.0 * sigma
    );
}

/// DARE and DELLA through `tftf merge`: `--random-seed` gives the same bytes for any thread
/// count and memory budget, another seed and another tensor other draws; the kept fraction is
/// `density` (DELLA: higher for larger magnitudes, `density ± epsilon/2` by half) and the kept
/// elements are scaled by mergekit's L1 rescale, ‖δ‖₁ / ‖kept δ‖₁ (none with `rescale: false`).
#[test]
fn stochastic_methods_are_reproducible_keep_density_and_rescale_the_l1_norm() {
    let dir = tmp();
    let (rows, cols) = (128usize, 256usize);
    let (base, model, values) = zero_base_and_model(dir.path(), &[rows as u64, cols as u64], |v| v);
    let n = values.len();
    let cases = [
        ("dare_linear", 0.3, 0.0, ""),
        ("dare_ties", 0.6, 0.0, ""),
        ("della", 0.4, 0.2, ", epsilon: 0.2"),
        ("della_linear", 0.5, 0.1, ", epsilon: 0.1"),
        ("dare_linear", 0.5, 0.0, "no rescale"),
    ];
    for (i, (method, density, epsilon, extra)) in cases.into_iter().enumerate() {
        let case = dir.path().join(i.to_string());
        std::fs::create_dir(&case).unwrap();
        let rescale = extra != "no rescale";
        let params = if rescale { extra } else { "" };
        let text = format!(
            "merge_method: {method}\nbase_model: {}\nmodels:\n  - model: {}\n    parameters: {{weight: 1.0, density: {density}{params}}}\n{}",
            base.display(),
            model.display(),
            if rescale { "" } else { "parameters:\n  rescale: false\n" }
        );
        let label = format!("{method} {extra}");
        let out = seeded_merge(&case, &text, 7, "16MiB");
        assert_ne!(
            out,
            seeded_merge(&case, &text, 8, "16MiB"),
            "{label}: the seed matters"
        );
        let (got, other) = (f32s_of(&out[LAYER0].2), f32s_of(&out[LAYER1].2));
        assert_ne!(got, other, "{label}: each tensor has its own draws");
        let kept: Vec<bool> = got.iter().map(|v| *v != 0.0).collect();
        let count = kept.iter().filter(|k| **k).count();
        assert_kept_fraction(&label, count, n, density);
        if epsilon > 0.0 {
            // Per row, the half with the larger magnitudes keeps density + ε/2 on average.
            let (mut upper, mut lower) = (0, 0);
            for r in 0..rows {
                let mut row: Vec<usize> = (r * cols..(r + 1) * cols).collect();
                row.sort_by(|&a, &b| values[a].abs().total_cmp(&values[b].abs()));
                lower += row[..cols / 2].iter().filter(|&&j| kept[j]).count();
                upper += row[cols / 2..].iter().filter(|&&j| kept[j]).count();
            }
            assert_kept_fraction(&label, upper, n / 2, density + epsilon / 2.0);
            assert_kept_fraction(&label, lower, n / 2, density - epsilon / 2.0);
        }
        let l1 = |keep: &dyn Fn(usize) -> bool| -> f64 {
            (0..n)
                .filter(|&j| keep(j))
                .map(|j| f64::from(values[j]).abs())
                .sum()
        };
        let scale = if rescale {
            l1(&|_| true) / l1(&|j| kept[j])
        } else {
            1.0
        };
        assert!(!rescale || scale > 1.5, "{label}: scale {scale}");
        for j in (0..n).filter(|&j| kept[j]) {
            let want = f64::from(values[j]) * scale;
            assert!(
                (f64::from(got[j]) - want).abs() <= want.abs() * 2f64.powi(-24),
                "{label}: element {j} is {}, want {want} ({} × {scale})",
                got[j],
                values[j]
            );
        }
    }
}

/// arcee_fusion above mergekit's 1M-element quantile sample draws its sample from
/// `--random-seed`: the same bytes for any thread count and budget, other draws for another
/// seed, and every element still the base's or the model's.
#[test]
fn arcee_fusion_above_the_sample_size_is_reproducible_by_seed() {
    let dir = tmp();
    // Heavy-tailed: about 10 % of the elements reach median + 1.5 IQR and take the model's.
    let (base, model, values) = zero_base_and_model(dir.path(), &[1000, 1001], |v| v.powi(3));
    let text = format!(
        "merge_method: arcee_fusion\nbase_model: {}\nmodels:\n  - model: {}\n  - model: {}\n",
        base.display(),
        base.display(),
        model.display()
    );
    let out = seeded_merge(dir.path(), &text, 7, "64MiB");
    assert_ne!(out, seeded_merge(dir.path(), &text, 8, "64MiB"));
    let got = f32s_of(&out[LAYER0].2);
    let fused = got.iter().filter(|v| **v != 0.0).count();
    assert!(fused > 0 && fused < values.len(), "{fused} fused");
    for (j, (g, v)) in got.iter().zip(&values).enumerate() {
        assert!(*g == 0.0 || g == v, "element {j}: {g} is neither 0 nor {v}");
    }
}
