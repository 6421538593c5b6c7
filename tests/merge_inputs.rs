//! `tftf merge` over any input tftf reads (issue #27, item 3): quantised models dequantised on
//! the fly give the bytes of dequantising them first (`tftf dequant`), then merging; `.bin`,
//! DCP and safetensors models mix; shards that split tensors differently do not matter.

mod common;

use std::path::{Path, PathBuf};

use common::*;
use tftf::format::dtype::DType;

fn torch_fixture(rel: &str) -> PathBuf {
    fixture(&format!("torch/{rel}"))
}

/// A copy of torch fixture `case`'s safetensors twin with its config: a plain BF16 (or F32)
/// tiny Llama.
fn twin(case: &str, dir: &Path) -> PathBuf {
    let twin = dir.join(case.replace('/', "-"));
    std::fs::create_dir_all(&twin).unwrap();
    let from = torch_fixture(&format!("{case}/expected/model.safetensors"));
    std::fs::copy(from, twin.join("model.safetensors")).unwrap();
    std::fs::copy(
        torch_fixture("bin/hf-sharded/config.json"),
        twin.join("config.json"),
    )
    .unwrap();
    twin
}

fn write_config(dir: &Path, name: &str, text: &str) -> PathBuf {
    let p = dir.join(name);
    std::fs::write(&p, text).unwrap();
    p
}

/// A config merging `models` with `method`: `linear` weighs every model; the other methods
/// take the first as `base_model` and weigh the rest (`model_stock`, `karcher` and
/// `arcee_fusion` take no weights).
fn config(method: &str, models: &[&Path], extra: &str) -> String {
    let mut text = format!("merge_method: {method}\n");
    if method != "linear" {
        text.push_str(&format!("base_model: {}\n", models[0].display()));
    }
    text.push_str("models:\n");
    for (k, m) in models.iter().enumerate() {
        text.push_str(&format!("  - model: {}\n", m.display()));
        let w = [0.5, 0.3, 0.2][k % 3];
        let unweighted = matches!(method, "model_stock" | "karcher" | "arcee_fusion");
        if method == "linear" || (k > 0 && !unweighted) {
            text.push_str(&format!("    parameters:\n      weight: {w}\n"));
        }
    }
    text + extra
}

fn merged(dir: &Path, name: &str, text: &str) -> PathBuf {
    let cfg = write_config(dir, &format!("{name}.yml"), text);
    let out = dir.join(name);
    ok(&tftf(&["merge", s(&cfg), s(&out), "-q"]));
    out
}

/// The tensors and `config.json` of two merges are the same (mergekit_config.yml names other
/// paths).
fn assert_same_merge(ours: &Path, twin: &Path) {
    assert_identical("the merges", &load_all(ours), &load_all(twin));
    assert_eq!(
        read_json(&ours.join("config.json")),
        read_json(&twin.join("config.json"))
    );
}

/// `tftf quantize --scheme scheme` of `model`, and `tftf dequant` of that (bf16, or `dtype`).
fn quantised_and_dequantised(
    model: &Path,
    scheme: &str,
    dtype: &str,
    dir: &Path,
) -> (PathBuf, PathBuf) {
    let q = dir.join(format!("q-{scheme}"));
    let d = dir.join(format!("d-{scheme}-{dtype}"));
    if !q.exists() {
        ok(&tftf(&[
            "quantize",
            "-i",
            s(model),
            "-o",
            s(&q),
            "--scheme",
            scheme,
            "-q",
        ]));
    }
    ok(&tftf(&[
        "dequant",
        s(&q),
        "-o",
        s(&d),
        "--dtype",
        dtype,
        "-q",
    ]));
    (q, d)
}

#[test]
fn quantised_inputs_merge_as_their_dequantised_twins() {
    let dir = tmp();
    let plain = twin("bin/hf-sharded", dir.path());
    let other = twin("dcp/full-2rank", dir.path());
    for scheme in ["FP8_BLOCK", "FP8_DYNAMIC", "NVFP4A16", "MXFP4A16"] {
        let (q, d) = quantised_and_dequantised(&plain, scheme, "bf16", dir.path());
        let header = std::fs::read_to_string(q.join("config.json")).unwrap();
        assert!(header.contains("quantization_config"), "{scheme}");
        // The quantised model as the base (donor) and as another model; an elementwise method
        // and whole-tensor ones.
        for (method, order) in [
            ("linear", vec![&q, &other]),
            ("task_arithmetic", vec![&q, &other]),
            ("task_arithmetic", vec![&other, &q]),
            ("model_stock", vec![&q, &other, &plain]),
        ] {
            let models: Vec<&Path> = order.iter().map(|p| p.as_path()).collect();
            let twins: Vec<&Path> = models
                .iter()
                .map(|m| if *m == q.as_path() { d.as_path() } else { m })
                .collect();
            let tag = format!("{scheme}-{method}-{}", usize::from(models[0] != q));
            let ours = merged(dir.path(), &tag, &config(method, &models, ""));
            let theirs = merged(
                dir.path(),
                &format!("{tag}-twin"),
                &config(method, &twins, ""),
            );
            assert_same_merge(&ours, &theirs);
            let cfg = read_json(&ours.join("config.json"));
            assert!(cfg.get("quantization_config").is_none(), "{tag}: {cfg}");
            assert!(!ours.join("hf_quant_config.json").exists(), "{tag}");
        }
    }
}

#[test]
fn a_config_dtype_dequantises_to_it_as_dequant_dtype_does() {
    let dir = tmp();
    let plain = twin("bin/hf-sharded", dir.path());
    let other = twin("dcp/full-2rank", dir.path());
    let (q, d) = quantised_and_dequantised(&plain, "FP8_BLOCK", "f32", dir.path());
    let text = |a: &Path| config("linear", &[a, &other], "dtype: float32\n");
    let ours = merged(dir.path(), "ours", &text(&q));
    assert_same_merge(&ours, &merged(dir.path(), "theirs", &text(&d)));
    // bf16 first would have lost the f32 digits the merge keeps.
    let (_, d16) = quantised_and_dequantised(&plain, "FP8_BLOCK", "bf16", dir.path());
    let rounded = merged(dir.path(), "rounded", &text(&d16));
    assert_ne!(load_all(&ours), load_all(&rounded));
}

#[test]
fn mixed_source_formats_merge_as_their_safetensors_twins() {
    let dir = tmp();
    // The same tiny Llama as three torch.save shards (tensors in another order) and as two DCP
    // rank files, beside a safetensors model quantised to FP8 blocks.
    let bin = torch_fixture("bin/hf-sharded");
    let dcp = dir.path().join("dcp");
    copy_dir(&torch_fixture("dcp/full-2rank"), &dcp);
    std::fs::copy(bin.join("config.json"), dcp.join("config.json")).unwrap();
    let plain = twin("bin/hf-sharded", dir.path());
    let (q, d) = quantised_and_dequantised(&plain, "FP8_BLOCK", "bf16", dir.path());
    let (bin_twin, dcp_twin) = (plain.clone(), twin("dcp/full-2rank", dir.path()));
    for method in ["linear", "task_arithmetic"] {
        let ours = merged(
            dir.path(),
            &format!("{method}-mixed"),
            &config(method, &[&bin, &dcp, &q], ""),
        );
        let theirs = merged(
            dir.path(),
            &format!("{method}-twins"),
            &config(method, &[&bin_twin, &dcp_twin, &d], ""),
        );
        assert_same_merge(&ours, &theirs);
    }
}

#[test]
fn models_whose_shards_split_tensors_differently_merge_as_single_files() {
    let dir = tmp();
    let plain = twin("bin/hf-sharded", dir.path());
    let other = twin("dcp/full-2rank", dir.path());
    let resharded = |m: &Path, size: &str| {
        let out = dir.path().join(format!(
            "{}-{size}",
            m.file_name().unwrap().to_string_lossy()
        ));
        ok(&passthrough(m, &out, &["--max-shard-size", size, "-q"]));
        out
    };
    let (a, b) = (resharded(&plain, "5000"), resharded(&other, "20000"));
    assert!(std::fs::read_dir(&a).unwrap().count() > 4, "a is sharded");
    let ours = merged(dir.path(), "split", &config("linear", &[&a, &b], ""));
    let theirs = merged(
        dir.path(),
        "whole",
        &config("linear", &[&plain, &other], ""),
    );
    assert_same_merge(&ours, &theirs);
}

#[test]
fn a_quantised_weight_without_its_scale_is_refused_naming_model_and_tensor() {
    let dir = tmp();
    let plain = twin("bin/hf-sharded", dir.path());
    let (q, _) = quantised_and_dequantised(&plain, "FP8_BLOCK", "bf16", dir.path());
    let broken = dir.path().join("broken");
    ok(&passthrough(
        &q,
        &broken,
        &["--exclude", "model.layers.1.mlp.up_proj.weight_scale", "-q"],
    ));
    let cfg = write_config(
        dir.path(),
        "m.yml",
        &config("linear", &[&plain, &broken], ""),
    );
    let out = dir.path().join("out");
    let err = fails(&["merge", s(&cfg), s(&out), "-q"]);
    assert_refused(
        &err,
        &["broken", "model.layers.1.mlp.up_proj.weight", "scale"],
        &out,
    );
}

/// llm-compressor's own int `pack-quantized` outputs (W4A16, W8A16 of the quantize fixtures'
/// model, groups of 128) merged with that model give the bytes of merging `tftf dequant` of
/// them.
#[test]
fn int_pack_quantized_inputs_merge_as_their_dequantised_twins() {
    let dir = tmp();
    let plain = fixture("quantize/input_even");
    for scheme in ["W4A16", "W8A16"] {
        let q = fixture(&format!("quantize/{scheme}"));
        let cfg = read_json(&q.join("config.json"));
        assert_eq!(
            cfg["quantization_config"]["config_groups"]["group_0"]["format"],
            "pack-quantized"
        );
        let d = dir.path().join(format!("d-{scheme}"));
        ok(&tftf(&["dequant", s(&q), "-o", s(&d), "-q"]));
        for method in ["linear", "task_arithmetic"] {
            let tag = format!("{scheme}-{method}");
            let ours = merged(dir.path(), &tag, &config(method, &[&q, &plain], ""));
            let theirs = merged(
                dir.path(),
                &format!("{tag}-twin"),
                &config(method, &[&d, &plain], ""),
            );
            assert_same_merge(&ours, &theirs);
            // The quantised weights took part: the merge is not the plain model's.
            let a = load_all(&ours);
            let w = "model.layers.0.mlp.up_proj.weight";
            assert_eq!(a[w].0, "BF16", "{tag}");
            assert_ne!(a[w], load_all(&plain)[w], "{tag}");
        }
    }
}

/// `run --merge CONFIG` then `--quantize`: one pass, the bytes of `tftf merge` followed by
/// `tftf quantize` of its output (tensors, `config.json`, side files).
fn assert_run_equals_merge_then_quantize(dir: &Path, tag: &str, text: &str, quantize: &[&str]) {
    let cfg = write_config(dir, &format!("{tag}.yml"), text);
    let m = dir.join(format!("{tag}-merged"));
    ok(&tftf(&["merge", s(&cfg), s(&m), "-q"]));
    let two = dir.join(format!("{tag}-two-steps"));
    let mut args = vec!["quantize", "-i", s(&m), "-o", s(&two), "-q"];
    args.extend(quantize);
    ok(&tftf(&args));
    let one = dir.join(format!("{tag}-one-pass"));
    let mut args = vec!["run", "-o", s(&one), "-q", "--merge", s(&cfg), "--quantize"];
    args.extend(quantize);
    ok(&tftf(&args));
    assert_identical(tag, &load_all(&one), &load_all(&two));
    assert_eq!(listing(&one), listing(&two), "{tag}: files");
    for f in listing(&one) {
        if f.ends_with(".json") {
            assert_eq!(
                read_json(&one.join(&f)),
                read_json(&two.join(&f)),
                "{tag}: {f}"
            );
        }
    }
    let q = read_json(&one.join("config.json"));
    assert!(q.get("quantization_config").is_some(), "{tag}: {q}");
}

#[test]
fn run_merge_then_quantize_equals_merge_then_quantize() {
    let dir = tmp();
    let plain = twin("bin/hf-sharded", dir.path());
    let other = twin("dcp/full-2rank", dir.path());
    // A third model, F32 (mixed dtypes promote to F32): the plain one through FP8 and back.
    let (_, third) = quantised_and_dequantised(&plain, "FP8_DYNAMIC", "f32", dir.path());
    for (method, models) in [
        ("linear", vec![&plain, &other]),
        ("task_arithmetic", vec![&plain, &other, &third]),
        ("model_stock", vec![&plain, &other, &third]),
    ] {
        let models: Vec<&Path> = models.iter().map(|p| p.as_path()).collect();
        for scheme in ["FP8_BLOCK", "FP8_DYNAMIC", "MXFP4A16", "NVFP4A16"] {
            let tag = format!("{method}-{scheme}");
            let text = config(method, &models, "");
            assert_run_equals_merge_then_quantize(dir.path(), &tag, &text, &["--scheme", scheme]);
        }
    }
    // ModelOpt's layout, and a config `out_dtype` the quantiser reads the merge in.
    let text = config("linear", &[&plain, &other], "out_dtype: float16\n");
    assert_run_equals_merge_then_quantize(
        dir.path(),
        "modelopt",
        &text,
        &["--scheme", "FP8_BLOCK", "--format", "modelopt"],
    );
    let text = config("linear", &[&plain, &other], "out_dtype: float16\n");
    assert_run_equals_merge_then_quantize(dir.path(), "f16", &text, &["--scheme", "FP8_BLOCK"]);
    // NVFP4's tensor scale from the merged weights' amax, ModelOpt's too.
    let text = config("task_arithmetic", &[&plain, &other], "");
    assert_run_equals_merge_then_quantize(
        dir.path(),
        "modelopt-nvfp4",
        &text,
        &["--scheme", "NVFP4A16", "--format", "modelopt"],
    );
}

/// A quantised input, merged, quantised again: three ops in one pass, the bytes of the three
/// commands; int groups of 128 on the quantize fixtures' model.
#[test]
fn run_merge_of_quantised_inputs_then_quantize_equals_the_commands() {
    let dir = tmp();
    let plain = fixture("quantize/input_even");
    let q = fixture("quantize/W4A16");
    for scheme in ["W4A16", "W8A16", "FP8_BLOCK"] {
        let text = config("task_arithmetic", &[&plain, &q], "");
        let tag = format!("int-{scheme}");
        assert_run_equals_merge_then_quantize(dir.path(), &tag, &text, &["--scheme", scheme]);
    }
}

/// `method` over the `.bin` and DCP twins of the same model, written in `dir`.
fn twins_config(dir: &Path, method: &str) -> PathBuf {
    let plain = twin("bin/hf-sharded", dir);
    let other = twin("dcp/full-2rank", dir);
    write_config(dir, "m.yml", &config(method, &[&plain, &other], ""))
}

#[test]
fn run_merge_alone_writes_what_merge_writes() {
    let dir = tmp();
    let cfg = twins_config(dir.path(), "task_arithmetic");
    let (a, b) = (dir.path().join("a"), dir.path().join("b"));
    ok(&tftf(&["merge", s(&cfg), s(&a), "-q"]));
    ok(&tftf(&[
        "run",
        "-o",
        s(&b),
        "-q",
        "--merge",
        "--config",
        s(&cfg),
    ]));
    assert_eq!(listing(&a), listing(&b));
    for f in listing(&a) {
        assert_eq!(
            std::fs::read(a.join(&f)).unwrap(),
            std::fs::read(b.join(&f)).unwrap(),
            "{f}"
        );
    }
}

#[test]
fn run_merge_is_refused_where_it_cannot_stand() {
    let dir = tmp();
    let cfg = twins_config(dir.path(), "linear");
    let out = dir.path().join("out");
    // After another section, twice, beside -i, without a config.
    let err = usage_error(&[
        "run",
        "-o",
        s(&out),
        "--dtype-cast",
        "f32",
        "--merge",
        s(&cfg),
    ]);
    assert_refused(&err, &["--merge", "first section"], &out);
    let err = usage_error(&["run", "-o", s(&out), "--merge", s(&cfg), "--merge", s(&cfg)]);
    assert_refused(&err, &["--merge", "only one"], &out);
    let err = usage_error(&[
        "run",
        "-i",
        s(dir.path()),
        "-o",
        s(&out),
        "--merge",
        s(&cfg),
    ]);
    assert_refused(&err, &["--merge", "drop -i"], &out);
    let err = usage_error(&["run", "-o", s(&out), "--merge"]);
    assert_refused(&err, &["--merge", "CONFIG"], &out);
}

/// A Llama layer whose MLP weights (1M elements each, 2 MiB in BF16) take several chunks under
/// `--memory-budget 16MiB`: random BF16 values from `seed`.
fn wide_model(dir: &Path, name: &str, seed: u64) -> PathBuf {
    let mut cfg = read_json(&fixture("quantize/input_even/config.json"));
    cfg["intermediate_size"] = 4096.into();
    let mut rng = Rng(seed);
    let mut m = Model::new();
    for (n, shape) in [
        ("model.embed_tokens.weight", vec![128, 256]),
        ("model.layers.0.input_layernorm.weight", vec![256]),
        ("model.layers.0.mlp.down_proj.weight", vec![256, 4096]),
        ("model.layers.0.mlp.gate_proj.weight", vec![4096, 256]),
        ("model.layers.0.mlp.up_proj.weight", vec![4096, 256]),
        ("model.layers.0.post_attention_layernorm.weight", vec![256]),
        ("model.layers.0.self_attn.k_proj.weight", vec![64, 256]),
        ("model.layers.0.self_attn.o_proj.weight", vec![256, 128]),
        ("model.layers.0.self_attn.q_proj.weight", vec![128, 256]),
        ("model.layers.0.self_attn.v_proj.weight", vec![64, 256]),
        ("model.norm.weight", vec![256]),
        ("lm_head.weight", vec![128, 256]),
    ] {
        m = m.rand(&mut rng, n, DType::BF16, &shape);
    }
    m.config(&cfg.to_string()).write(&dir.join(name))
}

/// Three wide models `a`, `b` and `c`, drawn from `seeds`.
fn wide_models(dir: &Path, seeds: [u64; 3]) -> [PathBuf; 3] {
    let names = ["a", "b", "c"];
    std::array::from_fn(|i| wide_model(dir, names[i], seeds[i]))
}

/// One thread under a 16 MiB budget: several chunks a wide weight.
const SMALL: [&str; 4] = ["--memory-budget", "16MiB", "--threads", "1"];

/// `tftf ARGS` into `DIR/TAG-K` once for each option set `K` of `runs`, each output loaded.
fn outputs(dir: &Path, tag: &str, args: &[&str], runs: [&[&str]; 2]) -> Vec<Tensors> {
    (runs.into_iter().enumerate())
        .map(|(k, opts)| {
            let out = dir.join(format!("{tag}-{k}"));
            let mut all = vec![args[0], "-o", s(&out), "-q"];
            all.extend(opts);
            all.extend(&args[1..]);
            ok(&tftf(&all));
            load_all(&out)
        })
        .collect()
}

/// `run` arguments merging by `cfg` and quantising to FP8 blocks in the same pass.
fn merged_to_fp8(cfg: &Path) -> [&str; 6] {
    [
        "run",
        "--merge",
        s(cfg),
        "--quantize",
        "--scheme",
        "FP8_BLOCK",
    ]
}

/// Methods that need whole-tensor statistics (TIES' and breadcrumbs' magnitude cuts, the L1
/// rescale of DARE and DELLA, model_stock's angles) stream a weight bigger than a chunk,
/// gathering the statistics in passes a chunk at a time: under a 16 MiB budget (several chunks
/// a weight) they write the bytes of a 1 GiB budget (each weight one chunk, merged whole), also
/// with quantised inputs and a quantised output in the same pass.
#[test]
fn surveyed_merges_give_the_same_bytes_whatever_the_budget() {
    let dir = tmp();
    let [a, b, c] = wide_models(dir.path(), [4, 5, 6]);
    let whole = ["--memory-budget", "1GiB", "--threads", "2"];
    let density = "parameters:\n  density: 0.4\n";
    let cases = [
        ("ties", density.to_string()),
        ("breadcrumbs_ties", format!("{density}  gamma: 0.05\n")),
        ("dare_ties", density.to_string()),
        ("della", format!("{density}  epsilon: 0.1\n")),
        ("model_stock", String::new()),
        ("multislerp", String::new()),
        ("karcher", String::new()),
        ("arcee_fusion", String::new()),
    ];
    let run = |cfg: &Path, tag: &str, opts: &[&str]| {
        let out = dir.path().join(tag);
        let mut args = vec!["merge", s(cfg), s(&out), "-q", "--random-seed", "3"];
        args.extend(opts);
        ok(&tftf(&args));
        load_all(&out)
    };
    for (method, extra) in &cases {
        // arcee_fusion merges one model into the base.
        let models: &[&Path] = match *method {
            "arcee_fusion" => &[&a, &b],
            _ => &[&a, &b, &c],
        };
        let cfg = write_config(
            dir.path(),
            &format!("{method}.yml"),
            &config(method, models, extra),
        );
        let want = run(&cfg, &format!("{method}-whole"), &whole);
        let got = run(&cfg, &format!("{method}-chunked"), &SMALL);
        assert!(got == want, "{method}");
        if *method == "ties" {
            // And not the base: the cuts kept something of every model.
            let base = load_all(&a);
            let k = "model.layers.0.mlp.up_proj.weight";
            assert!(got[k] != base[k]);
        }
    }
    // An FP8 model fed into TIES, merged and quantised in one pass, chunk by chunk.
    let (q, _) = quantised_and_dequantised(&b, "FP8_BLOCK", "bf16", dir.path());
    let cfg = write_config(dir.path(), "q.yml", &config("ties", &[&a, &q, &c], density));
    let outs = outputs(dir.path(), "q-run", &merged_to_fp8(&cfg), [&SMALL, &whole]);
    assert!(outs[0] == outs[1], "ties of an FP8 model, quantised");
}

/// A non-finite value in a weight that streams is refused by the survey's first pass, naming
/// the model, tensor and element as the whole-tensor merge does, and nothing is left behind.
#[test]
fn a_non_finite_value_in_a_streamed_weight_is_refused_before_any_output() {
    let dir = tmp();
    let (a, b) = (
        wide_model(dir.path(), "a", 7),
        wide_model(dir.path(), "b", 8),
    );
    // bf16 +inf at element 300_000 of b's up_proj (1M elements, several 16 MiB chunks).
    let file = b.join("model.safetensors");
    let mut bytes = std::fs::read(&file).unwrap();
    let header_len = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header: serde_json::Value = serde_json::from_slice(&bytes[8..8 + header_len]).unwrap();
    let tensor = "model.layers.0.mlp.up_proj.weight";
    let start = header[tensor]["data_offsets"][0].as_u64().unwrap() as usize;
    let at = 8 + header_len + start + 2 * 300_000;
    bytes[at..at + 2].copy_from_slice(&0x7F80u16.to_le_bytes());
    std::fs::write(&file, bytes).unwrap();
    let cfg = write_config(
        dir.path(),
        "ties.yml",
        &config("ties", &[&a, &b], "parameters:\n  density: 0.4\n"),
    );
    for (k, budget) in ["16MiB", "1GiB"].into_iter().enumerate() {
        let out = dir.path().join(format!("out-{k}"));
        let o = tftf(&["merge", s(&cfg), s(&out), "-q", "--memory-budget", budget]);
        assert_eq!(o.status.code(), Some(1), "{budget}: {}", stderr(&o));
        let model = format!(
            "`{}` has a non-finite value (inf) at element 300000",
            b.display()
        );
        let needles = [tensor, model.as_str()];
        assert_refused(&stderr(&o), &needles, &out);
    }
}

/// NVFP4 after a merge whose weights take several chunks and survey passes (TIES' magnitude
/// cuts): the tensor scale comes from the merged weights as the pipeline computes them, so one
/// pass under a 16 MiB budget, or the default one, equals `merge` then `quantize`.
#[test]
fn nvfp4_after_a_surveyed_merge_equals_the_two_commands() {
    let dir = tmp();
    let [a, b, c] = wide_models(dir.path(), [4, 5, 6]);
    let text = config("ties", &[&a, &b, &c], "parameters:\n  density: 0.4\n");
    let cfg = write_config(dir.path(), "ties.yml", &text);
    let m = dir.path().join("merged");
    ok(&tftf(&["merge", s(&cfg), s(&m), "-q"]));
    let two = dir.path().join("two");
    let scheme = ["--scheme", "NVFP4A16"];
    ok(&tftf(
        &[&["quantize", "-i", s(&m), "-o", s(&two), "-q"][..], &scheme].concat(),
    ));
    let want = load_all(&two);
    assert!(want.contains_key("model.layers.0.mlp.up_proj.weight_global_scale"));
    let args = [&["run", "--merge", s(&cfg), "--quantize"][..], &scheme].concat();
    for got in outputs(
        dir.path(),
        "ties-nvfp4",
        &args,
        [&SMALL, &["--threads", "3"]],
    ) {
        assert!(got == want, "run ties then NVFP4");
    }
}

/// Feeding decoded rows into the merge, and merged rows into the quantiser, chunk by chunk:
/// the bytes do not depend on where the chunks fall (one thread and a 16 MiB budget, several
/// chunks a weight; or the default budget) and equal the commands' one after another.
#[test]
fn fed_chunks_give_the_same_bytes_whatever_the_budget() {
    let dir = tmp();
    let [a, b, c] = wide_models(dir.path(), [1, 2, 3]);
    let wide = ["--threads", "3"];
    for scheme in ["FP8_BLOCK", "W4A16", "NVFP4A16"] {
        let (q, d) = quantised_and_dequantised(&b, scheme, "bf16", dir.path());
        for method in ["task_arithmetic", "model_stock"] {
            let tag = format!("{scheme}-{method}");
            let ours = config(method, &[&a, &q, &c], "");
            let cfg = write_config(dir.path(), &format!("{tag}.yml"), &ours);
            let twin = merged(
                dir.path(),
                &format!("{tag}-twin"),
                &config(method, &[&a, &d, &c], ""),
            );
            let want = load_all(&twin);
            for got in outputs(dir.path(), &tag, &["merge", s(&cfg)], [&SMALL, &wide]) {
                assert!(got == want, "{tag}");
            }
            // Merged, then quantised in the same pass.
            let two = dir.path().join(format!("{tag}-fp8"));
            ok(&tftf(&[
                "quantize",
                "-i",
                s(&twin),
                "-o",
                s(&two),
                "--scheme",
                "FP8_BLOCK",
                "-q",
            ]));
            let want = load_all(&two);
            let args = merged_to_fp8(&cfg);
            for got in outputs(dir.path(), &format!("{tag}-run"), &args, [&SMALL, &wide]) {
                assert!(got == want, "run {tag}");
            }
        }
    }
}

/// `--quantize` after another computing section takes that section's weights as it takes a
/// merge's: a cast, then quantised, equals `passthrough --dtype` then `quantize`.
#[test]
fn run_quantize_takes_the_weights_an_earlier_section_computes() {
    let dir = tmp();
    let plain = twin("bin/hf-sharded", dir.path());
    let cast = dir.path().join("cast");
    ok(&passthrough(&plain, &cast, &["--dtype", "f16", "-q"]));
    let two = dir.path().join("two");
    ok(&tftf(&[
        "quantize",
        "-i",
        s(&cast),
        "-o",
        s(&two),
        "--scheme",
        "FP8_BLOCK",
        "-q",
    ]));
    let one = dir.path().join("one");
    ok(&tftf(&[
        "run",
        "-i",
        s(&plain),
        "-o",
        s(&one),
        "-q",
        "--dtype-cast",
        "f16",
        "--quantize",
        "--scheme",
        "FP8_BLOCK",
    ]));
    let got = load_all(&one);
    assert!(got == load_all(&two));
    assert_eq!(got["model.layers.0.mlp.up_proj.weight"].0, "F8_E4M3");
    // NVFP4, whose tensor scale is the amax of the cast weights (q/k/v and gate/up shared).
    let (two, one) = (dir.path().join("two-nvfp4"), dir.path().join("one-nvfp4"));
    let nvfp4 = ["--quantize", "--scheme", "NVFP4A16"];
    ok(&tftf(
        &[
            &["quantize", "-i", s(&cast), "-o", s(&two), "-q"][..],
            &nvfp4[1..],
        ]
        .concat(),
    ));
    let run = [
        "run",
        "-i",
        s(&plain),
        "-o",
        s(&one),
        "-q",
        "--dtype-cast",
        "f16",
    ];
    ok(&tftf(&[&run[..], &nvfp4].concat()));
    let got = load_all(&one);
    assert!(got == load_all(&two));
    assert_eq!(got["model.layers.0.mlp.up_proj.weight_packed"].0, "U8");
}
