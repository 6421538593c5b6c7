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

/// Element `i` of a BF16 or F32 tensor's bytes as (f64 value, ordered integer for ulp
/// distances).
fn element(dtype: &str, bytes: &[u8], i: usize) -> (f64, i64) {
    let ordered = |bits: i64, sign: bool, mag: i64| if sign { -mag } else { bits.min(mag) };
    match dtype {
        "BF16" => {
            let b = u16::from_le_bytes([bytes[2 * i], bytes[2 * i + 1]]);
            let v = f32::from_bits((b as u32) << 16) as f64;
            let mag = (b & 0x7fff) as i64;
            (v, ordered(mag, b & 0x8000 != 0, mag))
        }
        "F32" => {
            let b = u32::from_le_bytes(bytes[4 * i..4 * i + 4].try_into().unwrap());
            let mag = (b & 0x7fff_ffff) as i64;
            (
                f32::from_bits(b) as f64,
                ordered(mag, b & 0x8000_0000 != 0, mag),
            )
        }
        d => panic!("unexpected dtype {d}"),
    }
}

/// `x` rounded once to `dtype` (nearest even), as the ordered integer of [`element`].
fn rounded(dtype: &str, x: f64) -> i64 {
    match dtype {
        "BF16" => {
            let b = half::bf16::from_f64(x).to_le_bytes();
            element("BF16", &b, 0).1
        }
        _ => element("F32", &(x as f32).to_le_bytes(), 0).1,
    }
}

/// The issue's accuracy bar for one merge: every element within 1 ulp of mergekit's, or no
/// farther from the float64 result than mergekit's; at least 99 % equal to mergekit's or to
/// the correctly rounded float64 result. Returns the share equal to mergekit's.
fn assert_as_right_as_mergekit(name: &str, ours: &Tensors) -> f64 {
    let theirs = load_all(&fixture(&format!("merge/mergekit/{name}")));
    let exact = load_tensors(&fixture(&format!("merge/exact/{name}.safetensors")), false);
    assert_eq!(
        ours.keys().collect::<Vec<_>>(),
        theirs.keys().collect::<Vec<_>>(),
        "tensor names"
    );
    let (mut total, mut good, mut same) = (0usize, 0usize, 0usize);
    for (k, (dtype, shape, bytes)) in ours {
        let (d2, s2, b2) = &theirs[k];
        assert_eq!((dtype, shape), (d2, s2), "{k}: dtype and shape");
        let (exact_dtype, _, e) = &exact[k];
        let n = shape.iter().product::<usize>();
        for i in 0..n {
            let (v, o) = element(dtype, bytes, i);
            let (mv, mo) = element(dtype, b2, i);
            // The newer methods' oracle is stored rounded to f32 (their outputs are bf16).
            let x = match exact_dtype.as_str() {
                "F64" => f64::from_le_bytes(e[8 * i..8 * i + 8].try_into().unwrap()),
                _ => element("F32", e, i).0,
            };
            let correct = rounded(dtype, x);
            assert!(
                o == correct || (o - mo).abs() <= 1 || (v - x).abs() <= (mv - x).abs(),
                "{k}[{i}]: ours {v}, mergekit {mv}, exact {x}"
            );
            total += 1;
            good += usize::from(o == mo || o == correct);
            same += usize::from(o == mo);
        }
    }
    assert!(
        good * 100 >= total * 99,
        "{name}: only {good} of {total} elements equal mergekit's or the exact result"
    );
    same as f64 / total as f64
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

fn check_method(name: &str) -> f64 {
    let dir = tmp();
    let out = dir.path().join("out");
    ok(&merge(&config(name), &out, &[]));
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
    let dir = tmp();
    let out = dir.path().join("out");
    ok(&merge(&config("passthrough_slices"), &out, &[]));
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
    let mut rng = Rng(3);
    let name = "model.layers.0.mlp.up_proj.weight";
    let a = Model::new()
        .rand(&mut rng, name, DType::BF16, &[4, 4])
        .config(LLAMA)
        .write(&dir.path().join("a"));
    let mut nan = vec![0u8; 32];
    nan[4..6].copy_from_slice(&0x7fc0u16.to_le_bytes());
    let b = Model::new()
        .tensor(name, DType::BF16, &[4, 4], nan)
        .config(LLAMA)
        .write(&dir.path().join("b"));
    let text = format!(
        "merge_method: ties\nbase_model: {0}\nmodels:\n  - model: {0}\n  - model: {1}\n    parameters: {{weight: 1.0, density: 0.5}}\n",
        a.display(),
        b.display()
    );
    refused(
        dir.path(),
        &text,
        &[&format!("`{}` has a non-finite value", b.display())],
    );
}
