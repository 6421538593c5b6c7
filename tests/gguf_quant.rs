//! `tftf gguf --outtype <llama-quantize type>` against llama-quantize itself (llama.cpp 0c1e570):
//! goldens in tests/fixtures/gguf_quant/ (scripts/gen-gguf-quant-goldens.py), no Python here.

mod common;

use std::collections::BTreeMap;
use std::path::Path;

use common::fake_cuda::{fake_libs, tftf_logged};
use common::gguf::*;
use common::*;
use serde_json::Value as Json;
use tftf::sink::gguf::quant_mix::{
    check_imatrix, choose_types, quantize_order, Mix, MixOptions, MixTensor, ModelFacts,
};
use tftf::sink::gguf::GgmlType;

fn golden(name: &str) -> Json {
    read_json(&fixture(&format!("gguf_quant/{name}")))
}

/// The 4-layer Llama of the goldens in `dir/model`, with the GGUF tokenizer fixture.
fn llama_model(dir: &Path) -> std::path::PathBuf {
    let model = dir.join("model");
    std::fs::create_dir(&model).unwrap();
    for f in ["config.json", "model.safetensors"] {
        std::fs::copy(fixture(&format!("gguf_quant/llama/{f}")), model.join(f)).unwrap();
    }
    for f in ["tokenizer.json", "tokenizer_config.json"] {
        std::fs::copy(gguf_fixture(&format!("tokenizer/{f}")), model.join(f)).unwrap();
    }
    model
}

/// Every case of e2e.json (each legacy and k-quant mix, and the options --pure, --tensor-type,
/// --output-tensor-type, --token-embedding-type, --leave-output-tensor): the same KVs in the
/// same order, and every tensor's name, type, shape and bytes in the same order as
/// `llama-quantize` applied to the converter's F32 file.
#[test]
fn every_case_equals_llama_quantize_byte_for_byte() {
    let d = tmp();
    let model = llama_model(d.path());
    let cases = golden("e2e.json");
    assert!(cases.as_array().unwrap().len() >= 20);
    check_cases(&model, d.path(), &cases, &[]);
}

/// The 2-layer Llama of e2e_k.json in `dir/model256`: config.json from the fixtures, the
/// weights made by [`det_bf16`] as the generator makes them, the GGUF tokenizer fixture.
fn llama256_model(dir: &Path) -> std::path::PathBuf {
    let model = dir.join("model256");
    std::fs::create_dir(&model).unwrap();
    let cfg_path = fixture("gguf_quant/llama256/config.json");
    std::fs::copy(&cfg_path, model.join("config.json")).unwrap();
    for f in ["tokenizer.json", "tokenizer_config.json"] {
        std::fs::copy(gguf_fixture(&format!("tokenizer/{f}")), model.join(f)).unwrap();
    }
    let cfg = read_json(&cfg_path);
    let tensors = det_bf16_tensors(&llama_shapes(&cfg, true, &[]));
    write_file(&model.join("model.safetensors"), &tensors);
    model
}

/// The `mix` of each golden case, in order.
fn mixes_of(cases: &Json) -> Vec<&str> {
    cases
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["mix"].as_str().unwrap())
        .collect()
}

/// e2e_k.json: a model whose rows are whole 256-blocks, so every k-quant, i-quant and ternary
/// mix writes its own block types (Q2_K … Q6_K, IQ4_NL, IQ4_XS, TQ1_0, TQ2_0): byte for byte
/// `llama-quantize`'s file, at one compute thread and at three (rows spread over the
/// pipeline's workers give the same bytes).
#[test]
fn k_quant_mixes_equal_llama_quantize_byte_for_byte_at_any_thread_count() {
    let d = tmp();
    let model = llama256_model(d.path());
    let cases = golden("e2e_k.json");
    assert_eq!(
        mixes_of(&cases),
        [
            "q2_k", "q3_k_s", "q3_k_m", "q3_k_l", "q4_k_s", "q4_k_m", "q5_k_s", "q5_k_m", "q6_k",
            "iq4_nl", "iq4_xs", "tq1_0", "tq2_0"
        ]
    );
    for threads in ["1", "3"] {
        check_cases(&model, d.path(), &cases, &["--threads", threads]);
    }
}

/// Converts `model` per case of `cases` (a list of e2e records) with `extra` options and
/// checks every KV but the naming ones and every tensor's name, type, shape, bytes and order.
fn check_cases(model: &Path, dir: &Path, cases: &Json, extra: &[&str]) {
    for case in cases.as_array().unwrap() {
        let mix = case["mix"].as_str().unwrap();
        let args = json_strs(&case["args"]);
        let what = format!("{mix} {args:?} {extra:?}");
        let out = dir.join("out.gguf");
        let opts = [&["--outtype", mix, "--force"][..], &args, extra].concat();
        let g = convert_golden(model, &out, &opts, case);
        assert_equals_golden(&g, case, &what, &[]);
    }
}

/// Converts as [`to_gguf`] does; with `--device cuda` among `opts`, against the fake CUDA
/// driver, requiring that the block encoders ran there (`tftf_gguf_blocks`) when the golden
/// `case` has tensors of a type they encode.
fn convert_golden(model: &Path, out: &Path, opts: &[&str], case: &Json) -> Gguf {
    if !opts.contains(&"cuda") {
        return to_gguf(model, out, "test-pre", opts);
    }
    let log = out.with_extension("log");
    let _ = std::fs::remove_file(&log);
    let args = [&["--vocab-pre", "test-pre"][..], opts, &["-q"]].concat();
    ok(&tftf_logged(
        Some(fake_libs()),
        false,
        Some(&log),
        &gguf_args(model, out, &args),
    ));
    let launched = std::fs::read_to_string(&log).unwrap_or_default();
    // Every type but F32, F16, Q8_0 and BF16 is a block-kernel type.
    let kernel_types = [
        2, 3, 6, 7, 10, 11, 12, 13, 14, 16, 17, 18, 19, 20, 21, 22, 23, 29, 34, 35,
    ];
    let blocks = case["tensors"]
        .as_array()
        .unwrap()
        .iter()
        .any(|t| kernel_types.contains(&t[1].as_u64().unwrap()));
    assert_eq!(
        launched.lines().any(|l| l == "tftf_gguf_blocks"),
        blocks,
        "{opts:?}: blocks encoded on the GPU"
    );
    parse(out)
}

/// The k-quant, i-quant and ternary goldens, the legacy types' and the imatrix ones (IQ2 and
/// IQ1 mixes included), with the blocks encoded by the GPU kernels (kernels/kquant.cuh,
/// kernels/iq_encode.cuh) on the fake CUDA driver: still llama-quantize's files, byte for
/// byte.
#[test]
fn block_types_encoded_on_the_gpu_equal_llama_quantize_byte_for_byte() {
    let d = tmp();
    let gpu = ["--device", "cuda"];
    let model256 = llama256_model(d.path());
    check_cases(&model256, d.path(), &golden("e2e_k.json"), &gpu);
    // The IQ2 and IQ1 mixes, their lattice tables uploaded with each launch.
    check_imatrix_cases(
        &model256,
        d.path(),
        &golden("imatrix_iq.json")["cases"],
        &gpu,
    );
    let model = llama_model(d.path());
    check_cases(&model, d.path(), &golden("e2e.json"), &gpu);
    check_imatrix_cases(&model, d.path(), &golden("imatrix.json"), &gpu);
}

/// imatrix.json: `llama-quantize --imatrix` for each legacy type, with the GGUF imatrix and the
/// legacy `.dat` (synthesised, scripts/gen-gguf-imatrix-goldens.py; one entry with a zero
/// count), and with --include-weights / --exclude-weights: the same KVs (the
/// `quantize.imatrix.*` ones included; the file KV is the path given) and the same bytes.
#[test]
fn imatrix_cases_equal_llama_quantize_byte_for_byte() {
    let d = tmp();
    let model = llama_model(d.path());
    check_imatrix_cases(&model, d.path(), &golden("imatrix.json"), &[]);
}

/// The case's `--imatrix` (a fixture file name, or null for none) and llama-quantize options.
fn imatrix_case_args(case: &Json) -> (Option<String>, Vec<&str>) {
    let file = case["imatrix"].as_str().map(|f| {
        fixture(&format!("gguf_quant/{f}"))
            .to_str()
            .unwrap()
            .to_string()
    });
    (file, json_strs(&case["args"]))
}

/// Converts `model` per imatrix golden case with `extra` options and checks it as
/// [`assert_equals_golden`] does, the `quantize.imatrix.file` KV being the path given.
fn check_imatrix_cases(model: &Path, dir: &Path, cases: &Json, extra: &[&str]) {
    for case in cases.as_array().unwrap() {
        let mix = case["mix"].as_str().unwrap();
        let (file, args) = imatrix_case_args(case);
        let what = format!("{mix} {file:?} {args:?} {extra:?}");
        let out = dir.join("out.gguf");
        let mut opts = [&["--outtype", mix, "--force"][..], &args, extra].concat();
        let mut kv_values = Vec::new();
        if let Some(f) = &file {
            opts.extend(["--imatrix", f.as_str()]);
            let kv = [
                &8u32.to_le_bytes()[..],
                &(f.len() as u64).to_le_bytes(),
                f.as_bytes(),
            ]
            .concat();
            kv_values.push(("quantize.imatrix.file", kv));
        }
        let g = convert_golden(model, &out, &opts, case);
        assert_equals_golden(&g, case, &what, &kv_values);
    }
}

/// imatrix_iq.json: the IQ2 and IQ1 mixes (IQ2_XXS, IQ2_XS, IQ2_S, IQ2_M, IQ1_S, IQ1_M) with an
/// importance matrix, an IQ2_XXS output tensor, and IQ2_S / IQ1_M output and token_embd
/// without one (llama-quantize exempts those two), on the 256-wide llama: byte for byte
/// `llama-quantize`'s file, at one compute thread and at three.
#[test]
fn iq2_and_iq1_mixes_equal_llama_quantize_byte_for_byte_at_any_thread_count() {
    let d = tmp();
    let model = llama256_model(d.path());
    let golden = golden("imatrix_iq.json");
    let cases = &golden["cases"];
    assert_eq!(
        mixes_of(cases),
        ["iq2_xxs", "iq2_xs", "iq2_s", "iq2_m", "iq1_s", "iq1_m", "q4_k_m", "q4_k_m"]
    );
    for threads in ["1", "3"] {
        check_imatrix_cases(&model, d.path(), cases, &["--threads", threads]);
    }
}

/// imatrix_iq.json's `refusals`: each IQ mix without an imatrix, an imatrix without the entry
/// of a tensor that needs one, and an IQ2_XXS token_embd without weights (where llama-quantize
/// aborts in ggml's assert): refused naming the tensor llama-quantize names, before any output.
#[test]
fn what_llama_quantize_refuses_for_iq_types_is_refused_by_name_before_any_output() {
    let d = tmp();
    let model = llama256_model(d.path());
    let golden = golden("imatrix_iq.json");
    let refusals = golden["refusals"].as_array().unwrap();
    assert_eq!(refusals.len(), 8);
    for case in refusals {
        let mix = case["mix"].as_str().unwrap();
        let (file, args) = imatrix_case_args(case);
        let out = d.path().join("out/x.gguf");
        let mut opts = [
            &["--outtype", mix, "--vocab-pre", "test-pre", "-q"][..],
            &args,
        ]
        .concat();
        if let Some(f) = &file {
            opts.extend(["--imatrix", f.as_str()]);
        }
        let o = tftf(&gguf_args(&model, &out, &opts));
        let err = stderr(&o);
        assert!(!o.status.success(), "{mix} {args:?}: {err}");
        let want = match case["tensor"].as_str() {
            Some(t) if file.is_some() => format!("no entry for `{t}`"),
            Some(t) => format!("`{t}` would be"),
            None => {
                "tensor `token_embd.weight`: IQ2_XXS cannot be encoded without importance weights"
                    .into()
            }
        };
        assert!(err.contains(&want), "{mix} {args:?}: {err}");
        assert!(
            !d.path().join("out").exists() || listing(&d.path().join("out")).is_empty(),
            "{mix} {args:?}"
        );
    }
}

/// An imatrix that would change nothing must not pass for one that does: without it the
/// legacy types' bytes differ from the imatrix goldens.
#[test]
fn the_imatrix_changes_the_bytes() {
    let d = tmp();
    let model = llama_model(d.path());
    let case = &golden("imatrix.json")[0];
    let out = d.path().join("out.gguf");
    let mix = case["mix"].as_str().unwrap();
    let g = to_gguf(&model, &out, "test-pre", &["--outtype", mix, "--force"]);
    let (_, _, data) = g.tensor("blk.0.attn_q.weight");
    let want = case["tensors"]
        .as_array()
        .unwrap()
        .iter()
        .find(|t| t[0] == "blk.0.attn_q.weight")
        .unwrap();
    assert_ne!(sha256_hex(data), want[3].as_str().unwrap());
}

/// A file that is not an imatrix, one made for another model (no name of this model, or a
/// tensor's size that differs), and misplaced options: refused by name, no output left.
#[test]
fn a_bad_imatrix_is_refused_before_any_output() {
    let d = tmp();
    let model = llama_model(d.path());
    let out = d.path().join("out.gguf");
    let dat = std::fs::read(fixture("gguf_quant/imatrix.dat")).unwrap();
    let entry = |name: &str, n: usize| {
        let mut b = 1i32.to_le_bytes().to_vec();
        b.extend((name.len() as i32).to_le_bytes());
        b.extend(name.as_bytes());
        b.extend(1i32.to_le_bytes());
        b.extend((n as i32).to_le_bytes());
        b.extend(vec![0u8; n * 4]);
        b
    };
    let cases: [(&str, Vec<u8>, &str); 4] = [
        (
            "text.dat",
            b"not an imatrix at all".to_vec(),
            "importance matrix: not an importance matrix",
        ),
        (
            "cut.dat",
            dat[..dat.len() / 2].to_vec(),
            "not an importance matrix (neither llama-imatrix's GGUF nor a legacy .dat): truncated",
        ),
        (
            "other.dat",
            entry("blk.0.attn_qkv.weight", 64),
            "it was made for another model",
        ),
        (
            "size.dat",
            entry("blk.0.attn_q.weight", 128),
            "`blk.0.attn_q.weight` has 128 weights, but the tensor has 64 columns × 1 experts",
        ),
    ];
    for (name, bytes, want) in cases {
        let p = d.path().join(name);
        std::fs::write(&p, bytes).unwrap();
        let o = tftf(&gguf_args(
            &model,
            &out,
            &[
                "--vocab-pre",
                "test-pre",
                "--outtype",
                "q4_0",
                "--imatrix",
                s(&p),
            ],
        ));
        let e = stderr(&o);
        assert!(
            !o.status.success() && e.contains(name) && e.contains(want),
            "{name}: {e}"
        );
        assert!(!out.exists(), "{name}: output left behind");
    }
    let f = fixture("gguf_quant/imatrix.dat");
    for (args, want) in [
        (
            vec!["--outtype", "bf16", "--imatrix", s(&f)],
            "--imatrix apply to llama-quantize types",
        ),
        (
            vec!["--outtype", "q4_0", "--exclude-weights", "attn"],
            "select entries of --imatrix FILE",
        ),
    ] {
        let o = tftf(&gguf_args(&model, &out, &args));
        assert!(
            !o.status.success() && stderr(&o).contains(want),
            "{args:?}: {}",
            stderr(&o)
        );
        assert!(!out.exists());
    }
}

/// types.json: models with 256-wide rows (a dense Llama with GQA 4 and 8 layers, a Mixtral with
/// 8 experts), every mix llama-quantize offers: the type of each tensor equals `llama-quantize
/// --dry-run`'s, and the mixes it would refuse without an importance matrix are refused.
#[test]
fn every_mix_picks_llama_quantizes_type_for_every_tensor() {
    let models = golden("types.json");
    for (model, e) in models.as_object().unwrap() {
        let n = |k: &str| e[k].as_u64().unwrap();
        let facts = ModelFacts {
            n_layer: n("n_layer"),
            n_gqa: n("n_head") / n("n_head_kv"),
            n_expert: if n("n_expert") <= 1 { 0 } else { n("n_expert") },
            is_70b: false,
        };
        let raw: Vec<(String, Vec<u64>, GgmlType)> = e["tensors"]
            .as_array()
            .unwrap()
            .iter()
            .map(|t| {
                let shape: Vec<u64> = serde_json::from_value(t[1].clone()).unwrap();
                let ty = GgmlType::parse(t[2].as_str().unwrap()).unwrap();
                (t[0].as_str().unwrap().to_string(), shape, ty)
            })
            .collect();
        let names: Vec<&str> = raw.iter().map(|t| t.0.as_str()).collect();
        let tensors: Vec<MixTensor> = quantize_order(&names)
            .into_iter()
            .map(|i| MixTensor {
                name: &raw[i].0,
                shape: &raw[i].1,
                ty: raw[i].2,
            })
            .collect();
        let mixes = e["mixes"].as_object().unwrap();
        assert_eq!(mixes.len(), 28, "{model}");
        for (mix_name, want) in mixes {
            let mix = Mix::parse(mix_name).unwrap();
            let opts = MixOptions::default();
            let types = choose_types(mix, &facts, &opts, &tensors).unwrap();
            let got: BTreeMap<&str, &str> = tensors
                .iter()
                .zip(&types)
                .map(|(t, ty)| (t.name, ty.name()))
                .collect();
            let want_types: BTreeMap<&str, &str> = want["types"]
                .as_object()
                .unwrap()
                .iter()
                .map(|(k, v)| (k.as_str(), v.as_str().unwrap()))
                .collect();
            assert_eq!(got, want_types, "{model} {mix_name}");
            let refused = check_imatrix(mix, &opts, &tensors, &types);
            assert_eq!(
                refused.is_err(),
                want["needs_imatrix"].as_bool().unwrap(),
                "{model} {mix_name}: {refused:?}"
            );
        }
    }
}

#[test]
fn unknown_types_and_misplaced_options_are_usage_errors() {
    let d = tmp();
    let model = llama_model(d.path());
    let out = d.path().join("x.gguf");
    for (extra, want) in [
        (vec!["--outtype", "q4_k_x"], "--outtype `q4_k_x`"),
        (
            vec!["--outtype", "bf16", "--pure"],
            "apply to llama-quantize types",
        ),
        (
            vec!["--outtype", "q4_0", "--output-tensor-type", "q9"],
            "--output-tensor-type `q9`: not a ggml type",
        ),
        (
            vec!["--outtype", "q4_0", "--tensor-type", "attn_v"],
            "give PATTERN=TYPE",
        ),
        (
            vec!["--outtype", "q4_0", "--tensor-type", "attn_v=q7_0"],
            "unknown type `q7_0`",
        ),
    ] {
        let args = [&extra[..], &["--vocab-pre", "test-pre", "-q"]].concat();
        let o = tftf(&gguf_args(&model, &out, &args));
        assert!(!o.status.success(), "{extra:?}");
        assert!(stderr(&o).contains(want), "{extra:?}: {}", stderr(&o));
        assert!(!out.exists());
    }
}
