//! `tftf extract-lora` (issue #27 item 7): a PEFT adapter from the truncated SVD of
//! `finetuned − base`, as mergekit-extract-lora makes it.
//!
//! The fine-tuned models are made here from the PEFT fixture `llama-lora-f32/base` plus a
//! difference `U diag(σ) Vᵀ` of known singular values (random orthonormal U, V): a large rank-8
//! part plus a small full-rank "noise" tail. The optimal rank-r error (Eckart–Young) is then
//! known without an SVD in the test: `√(Σ_{i≥r} σᵢ²)`, moved by at most the Frobenius norm of
//! the f32 rounding of the stored model (Mirsky), which the test measures.

mod common;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use common::*;
use tftf::format::dtype::DType;

const RANK: usize = 8;

fn base_dir() -> PathBuf {
    fixture("peft/llama-lora-f32/base")
}

fn f64s(bytes: &[u8]) -> Vec<f64> {
    f32s_of(bytes).into_iter().map(f64::from).collect()
}

/// `k` orthonormal vectors of length `n` (Gram–Schmidt, twice), from `rng`.
fn orthonormal(rng: &mut Rng, n: usize, k: usize) -> Vec<Vec<f64>> {
    let mut out: Vec<Vec<f64>> = Vec::new();
    for _ in 0..k {
        let mut v: Vec<f64> = (0..n)
            .map(|_| rng.next_u32() as f64 / u32::MAX as f64 - 0.5)
            .collect();
        for _ in 0..2 {
            for u in &out {
                let d: f64 = u.iter().zip(&v).map(|(a, b)| a * b).sum();
                v.iter_mut().zip(u).for_each(|(x, y)| *x -= d * y);
            }
        }
        let norm = v.iter().map(|x| x * x).sum::<f64>().sqrt();
        v.iter_mut().for_each(|x| *x /= norm);
        out.push(v);
    }
    out
}

/// The singular values of the designed difference: 8 large, then a small tail.
fn sigmas(k: usize) -> Vec<f64> {
    (0..k)
        .map(|i| {
            if i < RANK {
                2.0 / (i as f64 + 1.0)
            } else {
                0.01 + 0.02 * (k - i) as f64 / k as f64
            }
        })
        .collect()
}

/// What a designed tensor must come back as: the optimal rank-8 error of the designed
/// difference and the norm of the f32 rounding of the stored fine-tuned tensor.
struct Designed {
    optimal: f64,
    rounding: f64,
}

/// A fine-tuned copy of the fixture base in `dir`: every 2-D weight whose name `changed`
/// accepts gets a designed difference, norms get a small change, the rest stays.
fn finetuned(dir: &Path, seed: u64, changed: impl Fn(&str) -> bool) -> BTreeMap<String, Designed> {
    let base = load_all(&base_dir().join("model.safetensors"));
    let mut rng = Rng(seed);
    let mut model =
        Model::new().config(&std::fs::read_to_string(base_dir().join("config.json")).unwrap());
    let mut designed = BTreeMap::new();
    for (name, (_, shape, bytes)) in &base {
        let w = f64s(bytes);
        let new: Vec<f32> = if shape.len() == 2 && changed(name) {
            let (m, n) = (shape[0], shape[1]);
            let k = m.min(n);
            let (u, v, s) = (
                orthonormal(&mut rng, m, k),
                orthonormal(&mut rng, n, k),
                sigmas(k),
            );
            let delta: Vec<f64> = (0..m * n)
                .map(|e| (0..k).map(|t| s[t] * u[t][e / n] * v[t][e % n]).sum())
                .collect();
            let new: Vec<f32> = w.iter().zip(&delta).map(|(a, d)| (a + d) as f32).collect();
            let rounding = new
                .iter()
                .zip(&w)
                .zip(&delta)
                .map(|((x, a), d)| (*x as f64 - a - d).powi(2))
                .sum::<f64>()
                .sqrt();
            let optimal = s[RANK..].iter().map(|x| x * x).sum::<f64>().sqrt();
            designed.insert(name.clone(), Designed { optimal, rounding });
            new
        } else if shape.len() == 1 {
            w.iter().map(|a| (a * 1.25 + 0.01) as f32).collect()
        } else {
            w.iter().map(|a| *a as f32).collect()
        };
        let dims: Vec<u64> = shape.iter().map(|&d| d as u64).collect();
        model = model.tensor(name, DType::F32, &dims, f32_bytes(&new));
    }
    model.write(dir);
    designed
}

/// `extract-lora --base BASE --model MODEL -r RANK -o OUT`.
fn extract_args<'a>(base: &'a Path, model: &'a Path, rank: &'a str, out: &'a Path) -> Vec<&'a str> {
    vec![
        "extract-lora",
        "--base",
        s(base),
        "--model",
        s(model),
        "-r",
        rank,
        "-o",
        s(out),
    ]
}

fn extract(base: &Path, model: &Path, out: &Path, extra: &[&str]) {
    let r = RANK.to_string();
    ok(&tftf(
        &[&extract_args(base, model, &r, out)[..], &["-q"], extra].concat(),
    ));
}

/// A fine-tuned model's, its adapter's and the merged model's paths in `d`.
fn ft_lora_merged(d: &Path) -> (PathBuf, PathBuf, PathBuf) {
    (d.join("ft"), d.join("lora"), d.join("merged"))
}

/// `B·A` of `module` in the adapter (`[out, in]`; transposed back for an embedding).
fn product(adapter: &Tensors, module: &str, embedding: bool) -> Vec<f64> {
    let (a_name, b_name) = if embedding {
        ("lora_embedding_A", "lora_embedding_B")
    } else {
        ("lora_A.weight", "lora_B.weight")
    };
    let (_, ash, a) = &adapter[&format!("base_model.model.{module}.{a_name}")];
    let (_, bsh, b) = &adapter[&format!("base_model.model.{module}.{b_name}")];
    let (a, b) = (f64s(a), f64s(b));
    let (r, n, m) = (ash[0], ash[1], bsh[0]);
    assert_eq!(bsh[1], r);
    let mut p = vec![0f64; m * n];
    for i in 0..m {
        for j in 0..n {
            p[i * n + j] = (0..r).map(|t| b[i * r + t] * a[t * n + j]).sum();
        }
    }
    if !embedding {
        return p;
    }
    let mut t = vec![0f64; m * n];
    for i in 0..m {
        for j in 0..n {
            t[j * m + i] = p[i * n + j];
        }
    }
    t
}

/// `merge-lora` of `adapter` into the fixture base, written to `out` and read back.
fn merge_back(adapter: &Path, out: &Path) -> Tensors {
    let base = base_dir();
    let args = [
        "merge-lora",
        "-b",
        s(&base),
        "-a",
        s(adapter),
        "-o",
        s(out),
        "-q",
    ];
    ok(&tftf(&args));
    load_all(out)
}

fn frobenius(a: &[f64], b: &[f64]) -> f64 {
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).powi(2))
        .sum::<f64>()
        .sqrt()
}

/// Checks every designed tensor's reconstruction `base + B·A` against the fine-tuned one:
/// within 1 % of the optimal rank-8 error (plus the stored model's rounding).
fn assert_near_optimal(
    adapter: &Tensors,
    base: &Tensors,
    model: &Tensors,
    designed: &BTreeMap<String, Designed>,
    embeddings: &[&str],
) {
    for (name, d) in designed {
        let module = name.strip_suffix(".weight").unwrap();
        let p = product(adapter, module, embeddings.contains(&name.as_str()));
        let delta: Vec<f64> = f64s(&model[name].2)
            .iter()
            .zip(f64s(&base[name].2))
            .map(|(x, y)| x - y)
            .collect();
        let err = frobenius(&p, &delta);
        let bound = 1.01 * (d.optimal + d.rounding);
        assert!(err <= bound, "{name}: error {err} above {bound}");
        assert!(
            err >= d.optimal - d.rounding - 1e-9,
            "{name}: {err} beats the optimum"
        );
    }
}

#[test]
fn extraction_is_within_one_percent_of_optimal_and_merge_lora_round_trips() {
    let d = tmp();
    let (ft, adapter, merged) = ft_lora_merged(d.path());
    let designed = finetuned(&ft, 5, |n| n.contains("layers."));
    extract(&base_dir(), &ft, &adapter, &[]);
    assert_listing(&adapter, "adapter_config.json adapter_model.safetensors");
    let c = read_json(&adapter.join("adapter_config.json"));
    assert_eq!(c["r"], 8);
    assert_eq!(c["lora_alpha"], 8);
    assert_eq!(c["peft_type"], "LORA");
    assert_eq!(c["use_rslora"], false);
    assert_eq!(c["fan_in_fan_out"], false);
    assert_eq!(c["rank_pattern"], serde_json::json!({}));
    assert_eq!(
        c["target_modules"],
        serde_json::json!([
            "down_proj",
            "gate_proj",
            "k_proj",
            "o_proj",
            "q_proj",
            "up_proj",
            "v_proj"
        ])
    );
    assert_eq!(
        c["modules_to_save"],
        serde_json::json!([
            "lm_head",
            "embed_tokens",
            "input_layernorm",
            "post_attention_layernorm",
            "norm"
        ])
    );
    let (a, base, model) = (
        load_all(&adapter.join("adapter_model.safetensors")),
        load_all(&base_dir().join("model.safetensors")),
        load_all(&ft.join("model.safetensors")),
    );
    assert_eq!(designed.len(), 14);
    assert_near_optimal(&a, &base, &model, &designed, &[]);
    // modules_to_save: the fine-tuned tensors, bit for bit.
    for name in [
        "lm_head.weight",
        "model.embed_tokens.weight",
        "model.norm.weight",
        "model.layers.1.input_layernorm.weight",
    ] {
        assert_eq!(
            a[&format!("base_model.model.{name}")],
            model[name],
            "{name}"
        );
    }
    assert_eq!(a.len(), 14 * 2 + 2 + 1 + 4);

    // merge-lora of the adapter gives the fine-tuned model back within the same bound.
    let m = merge_back(&adapter, &merged);
    assert_eq!(
        m.keys().collect::<Vec<_>>(),
        model.keys().collect::<Vec<_>>()
    );
    for (name, (_, _, bytes)) in &model {
        match designed.get(name) {
            Some(d) => {
                let err = frobenius(&f64s(&m[name].2), &f64s(bytes));
                // Merging rounds each element once more to f32 (half an ulp of ~1).
                let bound = 1.01 * (d.optimal + d.rounding) + 1e-5;
                assert!(err <= bound, "{name}: merged error {err} above {bound}");
            }
            None => assert_eq!(&m[name].2, bytes, "{name}"),
        }
    }
}

#[test]
fn layout_matches_the_adapter_peft_saved_for_the_same_modules() {
    // PEFT's own rank-8 adapter of all seven projections, and the model PEFT merged from it:
    // extracting from that model gives the same keys, shapes and dtypes, plus the
    // modules_to_save copies mergekit adds.
    let d = tmp();
    let out = d.path().join("lora");
    let case = fixture("peft/llama-lora-f32");
    extract(&case.join("base"), &case.join("merged"), &out, &[]);
    let ours = load_all(&out.join("adapter_model.safetensors"));
    let peft = load_all(&case.join("adapter/adapter_model.safetensors"));
    for (name, (dtype, shape, _)) in &peft {
        let (d2, s2, _) = ours.get(name).unwrap_or_else(|| panic!("{name} missing"));
        assert_eq!((d2, s2), (dtype, shape), "{name}");
    }
    let extra: Vec<&String> = ours.keys().filter(|k| !peft.contains_key(*k)).collect();
    assert!(
        extra.iter().all(|k| !k.contains("lora_")),
        "unexpected LoRA tensors: {extra:?}"
    );
    let theirs = read_json(&case.join("adapter/adapter_config.json"));
    let mine = read_json(&out.join("adapter_config.json"));
    for key in [
        "peft_type",
        "r",
        "use_rslora",
        "fan_in_fan_out",
        "task_type",
        "rank_pattern",
    ] {
        assert_eq!(mine[key], theirs[key], "{key}");
    }
    let mut want: Vec<String> = serde_json::from_value(theirs["target_modules"].clone()).unwrap();
    want.sort();
    assert_eq!(mine["target_modules"], serde_json::json!(want));
}

#[test]
fn embed_lora_decomposes_embeddings_the_way_peft_stores_them() {
    let d = tmp();
    let (ft, adapter, merged) = ft_lora_merged(d.path());
    let designed = finetuned(&ft, 9, |n| {
        n.contains("embed") || n.starts_with("lm_head") || n.contains("q_proj")
    });
    extract(
        &base_dir(),
        &ft,
        &adapter,
        &["--embed-lora", "--skip-undecomposable"],
    );
    let a = load_all(&adapter.join("adapter_model.safetensors"));
    assert_eq!(
        a["base_model.model.model.embed_tokens.lora_embedding_A"].1,
        vec![8, 256]
    );
    assert_eq!(
        a["base_model.model.model.embed_tokens.lora_embedding_B"].1,
        vec![64, 8]
    );
    assert_eq!(a["base_model.model.lm_head.lora_A.weight"].1, vec![8, 64]);
    let c = read_json(&adapter.join("adapter_config.json"));
    assert_eq!(c["modules_to_save"], serde_json::json!([]));
    assert!(!a.keys().any(|k| k.contains("norm")), "{:?}", a.keys());
    let (base, model) = (
        load_all(&base_dir().join("model.safetensors")),
        load_all(&ft.join("model.safetensors")),
    );
    assert_near_optimal(&a, &base, &model, &designed, &["model.embed_tokens.weight"]);
    let m = merge_back(&adapter, &merged);
    for (name, dsg) in &designed {
        let err = frobenius(&f64s(&m[name].2), &f64s(&model[name].2));
        assert!(
            err <= 1.01 * (dsg.optimal + dsg.rounding) + 1e-5,
            "{name}: {err}"
        );
    }
}

#[test]
fn the_same_bytes_for_any_thread_count_and_save_module_and_regexes_choose_modules() {
    let d = tmp();
    let ft = d.path().join("ft");
    finetuned(&ft, 11, |n| n.contains("layers."));
    let (one, two) = (d.path().join("one"), d.path().join("two"));
    let flags = [
        "--save-module",
        "q_proj",
        "-e",
        "layers\\.1\\.",
        "--skip-undecomposable",
    ];
    extract(&base_dir(), &ft, &one, &flags);
    ok(&tftf(&[
        "extract-lora",
        "--base-model",
        s(&base_dir()),
        "--model",
        s(&ft),
        "--max-rank",
        "8",
        "--out-path",
        s(&two),
        "-q",
        "--save-module",
        "q_proj",
        "--exclude-regex",
        "layers\\.1\\.",
        "--skip-undecomposable",
        "--threads",
        "3",
    ]));
    for f in ["adapter_model.safetensors", "adapter_config.json"] {
        assert_eq!(
            std::fs::read(one.join(f)).unwrap(),
            std::fs::read(two.join(f)).unwrap(),
            "{f}"
        );
    }
    let a = load_all(&one.join("adapter_model.safetensors"));
    let model = load_all(&ft.join("model.safetensors"));
    // q_proj saved whole (both layers: --save-module wins over the exclusion, as in mergekit).
    for l in 0..2 {
        let name = format!("model.layers.{l}.self_attn.q_proj.weight");
        assert_eq!(a[&format!("base_model.model.{name}")], model[&name]);
    }
    assert!(!a
        .keys()
        .any(|k| k.contains("layers.1.") && k.contains("lora_")));
    assert!(a.contains_key("base_model.model.model.layers.0.self_attn.k_proj.lora_A.weight"));
    let c = read_json(&one.join("adapter_config.json"));
    assert_eq!(
        c["modules_to_save"],
        serde_json::json!(["q_proj", "lm_head", "embed_tokens"])
    );
}

/// A tensor to make: name, dtype, shape.
type Spec<'a> = (&'a str, DType, &'a [u64]);

/// A model of random tensors as `tensors` describe them.
fn tiny(dir: &Path, tensors: &[Spec]) -> PathBuf {
    let mut rng = Rng(3);
    let mut m = Model::new();
    for (name, dtype, shape) in tensors {
        m = m.rand(&mut rng, name, *dtype, shape);
    }
    m.write(dir)
}

#[test]
fn bad_inputs_are_refused_before_any_output_exists() {
    let d = tmp();
    let out = d.path().join("lora");
    let base = tiny(
        &d.path().join("base"),
        &[("m.q_proj.weight", DType::F32, &[4, 8])],
    );
    let cases: [(&str, Vec<Spec>, &str, &[&str]); 4] = [
        (
            "shape",
            vec![("m.q_proj.weight", DType::F32, &[8, 8])],
            "4",
            &["`m.q_proj.weight`", "shape [4, 8] in the base but [8, 8]"],
        ),
        (
            "missing",
            vec![
                ("m.q_proj.weight", DType::F32, &[4, 8]),
                ("m.k_proj.weight", DType::F32, &[4, 8]),
            ],
            "4",
            &["`m.k_proj.weight`", "missing from the base model"],
        ),
        (
            "rank",
            vec![("m.q_proj.weight", DType::F32, &[4, 8])],
            "5",
            &["`m.q_proj.weight`", "rank 5 is larger", "at most 4"],
        ),
        (
            "dtype",
            vec![("m.q_proj.weight", DType::I8, &[4, 8])],
            "4",
            &["`m.q_proj.weight`", "dtype I8 cannot be decomposed"],
        ),
    ];
    for (case, tensors, rank, needles) in cases {
        let ft = tiny(&d.path().join(case), &tensors);
        let msg = fails(&extract_args(&base, &ft, rank, &out));
        assert_refused(&msg, needles, &out);
    }
}

#[test]
fn an_existing_adapter_is_replaced_only_with_force() {
    let d = tmp();
    let base = tiny(
        &d.path().join("base"),
        &[("m.q_proj.weight", DType::F32, &[4, 8])],
    );
    let ft = tiny(
        &d.path().join("ft"),
        &[("m.q_proj.weight", DType::BF16, &[4, 8])],
    );
    let out = d.path().join("lora");
    std::fs::create_dir_all(&out).unwrap();
    std::fs::write(out.join("adapter_config.json"), "{}").unwrap();
    let args = extract_args(&base, &ft, "2", &out);
    let msg = fails(&args);
    assert_mentions(&msg, &["adapter_config.json", "--force"]);
    assert_listing(&out, "adapter_config.json");
    ok(&tftf(&[&args[..], &["--force", "-q"]].concat()));
    assert_listing(&out, "adapter_config.json adapter_model.safetensors");
    // The factors take the fine-tuned weight's dtype, as mergekit's do.
    let a = load_all(&out.join("adapter_model.safetensors"));
    assert_eq!(a["base_model.model.m.q_proj.lora_A.weight"].0, "BF16");
}

#[test]
fn peft_loads_the_extracted_adapter_when_python_has_peft() {
    let with_peft = |python: &&str| {
        std::process::Command::new(python)
            .args(["-c", "import peft, transformers"])
            .output()
            .is_ok_and(|o| o.status.success())
    };
    let Some(python) = ["/tmp/ggufvenv/bin/python", "/tmp/mkvenv/bin/python"]
        .into_iter()
        .find(with_peft)
    else {
        eprintln!("SKIPPED: no Python with peft and transformers");
        return;
    };
    let d = tmp();
    let (ft, adapter) = (d.path().join("ft"), d.path().join("lora"));
    finetuned(&ft, 13, |n| n.contains("layers.") || n.contains("embed"));
    extract(&base_dir(), &ft, &adapter, &["--embed-lora"]);
    let o = std::process::Command::new(python)
        .arg(fixture("extract_lora/peft_check.py"))
        .args([s(&base_dir()), s(&adapter), s(&ft)])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}\n{}", stdout(&o), stderr(&o));
}

/// A base with `m.q_proj` weight and bias, and a fine-tuned model changing both at random.
fn bias_models(d: &Path) -> (PathBuf, PathBuf) {
    let specs: [Spec; 2] = [
        ("m.q_proj.weight", DType::F32, &[4, 8]),
        ("m.q_proj.bias", DType::F32, &[4]),
    ];
    let base = tiny(&d.join("base"), &specs);
    let mut rng = Rng(77);
    let ft =
        Model::new()
            .tensors(load_all(&base.join("model.safetensors")).into_iter().map(
                |(n, (_, sh, _))| {
                    let dims: Vec<u64> = sh.iter().map(|&x| x as u64).collect();
                    rand_t(&mut rng, &n, DType::F32, &dims)
                },
            ))
            .write(&d.join("ft"));
    (base, ft)
}

#[test]
fn a_bias_change_is_lora_b_bias_as_mergekit_writes_it() {
    let d = tmp();
    let (base, ft) = bias_models(d.path());
    let out = d.path().join("lora");
    let args = extract_args(&base, &ft, "2", &out);
    ok(&tftf(&args));
    let a = load_all(&out.join("adapter_model.safetensors"));
    let (b, f) = (
        load_all(&base.join("model.safetensors")),
        load_all(&ft.join("model.safetensors")),
    );
    let want: Vec<f32> = f32s_of(&f["m.q_proj.bias"].2)
        .iter()
        .zip(f32s_of(&b["m.q_proj.bias"].2))
        .map(|(x, y)| (*x as f64 - y as f64) as f32)
        .collect();
    assert_eq!(
        a["base_model.model.m.q_proj.lora_B.bias"].2,
        f32_bytes(&want)
    );
    assert_eq!(
        read_json(&out.join("adapter_config.json"))["lora_bias"],
        true
    );
}

#[test]
fn merge_lora_adds_the_extracted_bias_change_back() {
    let d = tmp();
    let (base, ft) = bias_models(d.path());
    let adapter = d.path().join("lora");
    let r = "2";
    let args = ["extract-lora", "--base", s(&base), "--model", s(&ft)];
    ok(&tftf(&[&args[..], &["-r", r, "-o", s(&adapter)]].concat()));
    let merged = d.path().join("merged");
    lora_merged(&base, &adapter, &merged, &["-q"]);
    let out = load_all(&merged);
    let (a, b, f) = (
        load_all(&adapter.join("adapter_model.safetensors")),
        load_all(&base.join("model.safetensors")),
        load_all(&ft.join("model.safetensors")),
    );
    let c = read_json(&adapter.join("adapter_config.json"));
    let scale = (c["lora_alpha"].as_f64().unwrap() / c["r"].as_f64().unwrap()) as f32;
    // PEFT: (bias + lora_B.bias * scaling), the product and the sum each rounded to f32.
    let lb = f32s_of(&a["base_model.model.m.q_proj.lora_B.bias"].2);
    let want: Vec<f32> = f32s_of(&b["m.q_proj.bias"].2)
        .iter()
        .zip(&lb)
        .map(|(w, l)| w + l * scale)
        .collect();
    assert_eq!(out["m.q_proj.bias"].2, f32_bytes(&want));
    // The round trip: the fine-tuned bias, to the f32 rounding of the stored difference.
    for (got, ft) in want.iter().zip(f32s_of(&f["m.q_proj.bias"].2)) {
        assert!(
            (got - ft).abs() <= 2.0 * f32::EPSILON * ft.abs().max(1.0),
            "{got} vs {ft}"
        );
    }
}

/// bf16 of `x`, round to nearest even (no NaN here).
fn bf16(x: f32) -> [u8; 2] {
    let b = x.to_bits();
    (((b + 0x7FFF + ((b >> 16) & 1)) >> 16) as u16).to_le_bytes()
}

/// A BF16 base `m.q_proj` (weight [4, 8], bias `bias` of [4] unless `None`) and an f32 LoRA
/// adapter of rank 2 for it with `lora_B.bias` of shape `[n]`, `config` its adapter_config.json.
fn bias_adapter(d: &Path, bias: Option<&[f32]>, n: u64, config: &str) -> (PathBuf, PathBuf) {
    let mut rng = Rng(5);
    let mut base = Model::new().rand(&mut rng, "m.q_proj.weight", DType::BF16, &[4, 8]);
    if let Some(v) = bias {
        let bytes: Vec<u8> = v.iter().flat_map(|&x| bf16(x)).collect();
        base = base.tensor("m.q_proj.bias", DType::BF16, &[4], bytes);
    }
    let lb: Vec<f32> = (0..n).map(|i| 0.3 - 0.17 * i as f32).collect();
    let p = "base_model.model.m.q_proj";
    let adapter = Model::adapter()
        .rand(&mut rng, &format!("{p}.lora_A.weight"), DType::F32, &[2, 8])
        .rand(&mut rng, &format!("{p}.lora_B.weight"), DType::F32, &[4, 2])
        .tensor(
            &format!("{p}.lora_B.bias"),
            DType::F32,
            &[n],
            f32_bytes(&lb),
        )
        .file("adapter_config.json", config)
        .write(&d.join("adapter"));
    (base.write(&d.join("base")), adapter)
}

const BIAS_CONFIG: &str =
    r#"{"r": 2, "lora_alpha": 3, "target_modules": ["q_proj"], "lora_bias": true}"#;

#[test]
fn a_lora_bias_merges_into_a_bf16_bias_as_peft_computes_it() {
    let d = tmp();
    let bias = [1.0f32, -0.5, 3.25, 0.0078125];
    let (base, adapter) = bias_adapter(d.path(), Some(&bias), 4, BIAS_CONFIG);
    let out = d.path().join("out");
    lora_merged(&base, &adapter, &out, &["--scale", "0.5", "-q"]);
    let got = load_all(&out);
    // s = 3 / 2 · 0.5; bf16(f32(bias) + f32(lora_B.bias · s)).
    let s = 0.75f32;
    let want: Vec<u8> = (0..4)
        .flat_map(|i| bf16(bias[i] + (0.3 - 0.17 * i as f32) * s))
        .collect();
    assert_eq!(got["m.q_proj.bias"].0, "BF16");
    assert_eq!(got["m.q_proj.bias"].2, want);
    assert_ne!(
        got["m.q_proj.bias"].2,
        bias.iter().flat_map(|&x| bf16(x)).collect::<Vec<_>>()
    );
}

/// A refusal case: name, base bias, lora_B.bias length, adapter_config.json, message parts.
type BiasCase<'a> = (&'a str, Option<&'a [f32]>, u64, &'a str, &'a [&'a str]);

#[test]
fn a_lora_bias_is_refused_where_peft_would_not_merge_it() {
    let d = tmp();
    let bias = [1.0f32; 4];
    let name = "`base_model.model.m.q_proj.lora_B.bias`";
    let no_flag = r#"{"r": 2, "lora_alpha": 3, "target_modules": ["q_proj"]}"#;
    let dora = r#"{"r": 2, "lora_alpha": 3, "lora_bias": true, "use_dora": true}"#;
    let cases: [BiasCase; 4] = [
        (
            "flag",
            Some(&bias),
            4,
            no_flag,
            &[name, "does not set `lora_bias: true`"],
        ),
        (
            "no-bias",
            None,
            4,
            BIAS_CONFIG,
            &[name, "the base has no `m.q_proj.bias`"],
        ),
        (
            "shape",
            Some(&bias),
            3,
            BIAS_CONFIG,
            &[name, "[3] cannot be added to `m.q_proj.bias` [4]"],
        ),
        (
            "dora",
            Some(&bias),
            4,
            dora,
            &["adapter_config.json", "a LoRA bias with DoRA"],
        ),
    ];
    for (case, bias, n, config, needles) in cases {
        let (base, adapter) = bias_adapter(&d.path().join(case), bias, n, config);
        let out = d.path().join(case).join("out");
        let msg = fails(&merge_lora(&base, &adapter, &out, &[]));
        assert_refused(&msg, needles, &out);
    }
}

#[test]
fn a_non_finite_difference_is_refused_and_nothing_is_left() {
    let d = tmp();
    let w = |x: f32| f32_bytes(&[1.0, 2.0, x, 4.0, 5.0, 6.0]);
    let base = Model::new()
        .tensor("m.q_proj.weight", DType::F32, &[2, 3], w(3.0))
        .write(&d.path().join("base"));
    let ft = Model::new()
        .tensor("m.q_proj.weight", DType::F32, &[2, 3], w(f32::INFINITY))
        .write(&d.path().join("ft"));
    let out = d.path().join("lora");
    let msg = fails(&extract_args(&base, &ft, "1", &out));
    assert_refused(&msg, &["`m.q_proj.weight`", "NaN or infinity"], &out);
}
