//! `merge-lora --requant`: merging into a quantised base and quantising the merged weights
//! again in one pass equals the two-step route — `dequant --merge-lora --dtype bf16`, then
//! `quantize` with the base's scheme and layout — byte for byte on every merged weight and its
//! scales (NVFP4 keeps the base's tensor scale, so there the second step is `quantize`'s own
//! encoder run with that scale). Weights no adapter pair targets keep their bytes, scales too,
//! and config.json is the base's.

mod common;

use std::path::{Path, PathBuf};

use common::*;
use tftf::format::dtype::DType;
use tftf::ops::quantize::encode::WeightType;
use tftf::ops::quantize::ops::{BlockMath, QuantizeRows};
use tftf::ops::quantize::Scheme;
use tftf::ops::Op;

const UNTOUCHED: [&str; 3] = ["self_attn.k_proj", "self_attn.o_proj", "mlp.up_proj"];
const TARGETS: [(&str, u64, u64); 4] = REQUANT_TARGETS;
const LAYER: &str = REQUANT_LAYER;

fn adapter(dir: &Path) -> PathBuf {
    requant_adapter(dir)
}

/// A fresh temporary folder with [`adapter`] in `adapter/`: (folder, adapter).
fn tmp_adapter() -> (tempfile::TempDir, PathBuf) {
    let dir = tmp();
    let a = adapter(&dir.path().join("adapter"));
    (dir, a)
}

/// The fp8-native (transformers FineGrainedFP8) base, made by `tftf quantize`.
fn native_base(dir: &Path) -> PathBuf {
    let out = dir.join("native");
    convert_ok(
        "quantize",
        &fixture("quantize/input"),
        &out,
        &["--scheme", "FP8_BLOCK", "--format", "fp8-native"],
    );
    out
}

fn names_of(module: &str, scale: &str, nvfp4: bool) -> Vec<String> {
    let p = format!("{LAYER}.{module}");
    if nvfp4 {
        vec![
            format!("{p}.weight_packed"),
            format!("{p}.weight_scale"),
            format!("{p}.weight_global_scale"),
        ]
    } else {
        vec![format!("{p}.weight"), format!("{p}.{scale}")]
    }
}

/// Checks what every layout shares: the same tensor set and config as the base, untouched
/// modules and unquantised tensors byte-identical to it, merged modules changed.
fn check_against_base(base: &Path, out: &Path, scale: &str, nvfp4: bool) -> (Tensors, Tensors) {
    let (b, o) = (load_all(base), load_all(out));
    assert_eq!(
        b.keys().collect::<Vec<_>>(),
        o.keys().collect::<Vec<_>>(),
        "same tensors as the base"
    );
    for (name, (dtype, shape, _)) in &b {
        assert_eq!(
            (dtype, shape),
            (&o[name].0, &o[name].1),
            "{name}: layout kept"
        );
    }
    let merged: Vec<String> = TARGETS
        .iter()
        .flat_map(|(m, _, _)| names_of(m, scale, nvfp4))
        .filter(|n| !n.ends_with("weight_global_scale"))
        .collect();
    for name in b.keys() {
        if merged.contains(name) {
            continue;
        }
        assert!(b[name].2 == o[name].2, "{name}: bytes unchanged");
    }
    for (m, _, _) in TARGETS {
        let codes = &names_of(m, scale, nvfp4)[0];
        assert!(b[codes].2 != o[codes].2, "{codes}: merged");
    }
    for m in UNTOUCHED {
        for n in names_of(m, scale, nvfp4) {
            assert!(b.contains_key(&n), "{n} in the base");
        }
    }
    assert_eq!(
        read_json(&base.join("config.json")),
        read_json(&out.join("config.json")),
        "config.json (quantization_config included) is the base's"
    );
    (b, o)
}

/// Runs `merge-lora --requant` and the two-step route for an FP8-block base and compares the
/// merged modules.
fn fp8_case(base: &Path, scale: &str, quantize_extra: &[&str]) {
    let (dir, a) = tmp_adapter();
    let out = dir.path().join("out");
    let report = dir.path().join("report.json");
    let o = lora_merge(base, &a, &out, &["--requant", "--report", s(&report)]);
    ok(&o);
    assert_mentions(&stdout(&o), &["requant: 4 tensor(s) re-quantised"]);
    let (_, got) = check_against_base(base, &out, scale, false);
    let mid = dir.path().join("mid");
    let two = dir.path().join("two");
    tftf_ok(&cmd(
        "dequant",
        base,
        &mid,
        &["--merge-lora", s(&a), "--dtype", "bf16"],
    ));
    let q = [&["--scheme", "FP8_BLOCK"][..], quantize_extra].concat();
    convert_ok("quantize", &mid, &two, &q);
    let want = load_all(&two);
    for (m, _, _) in TARGETS {
        for n in names_of(m, scale, false) {
            assert!(got[&n] == want[&n], "{n}: same bytes as dequant + quantize");
        }
    }
    check_report(&report, &out);
    // A dry run measures nothing and reports no figures.
    let dry = dir.path().join("dry.json");
    lora_merged(
        base,
        &a,
        &dir.path().join("dry"),
        &["--requant", "--dry-run", "--report", s(&dry)],
    );
    let r = read_json(&dry);
    assert!(
        !r["tensor_reports"]
            .as_array()
            .unwrap()
            .iter()
            .any(|t| t["op"] == "requant"),
        "{r:#}"
    );
}

fn check_report(report: &Path, out: &Path) {
    let r = read_json(report);
    let merge = r["tensor_reports"]
        .as_array()
        .unwrap()
        .iter()
        .find(|t| t["op"] == "merge-lora")
        .unwrap();
    assert_eq!(
        (&merge["merged"], &merge["dora"]),
        (&4.into(), &1.into()),
        "{merge}"
    );
    let reqs: Vec<&serde_json::Value> = r["tensor_reports"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|t| t["op"] == "requant")
        .collect();
    assert_eq!(reqs.len(), TARGETS.len(), "{r:#}");
    for t in reqs {
        let e = t["relative_error"].as_f64().unwrap();
        assert!(e > 0.0 && e < 0.25, "{t}: relative error {e}");
        let name = t["tensor"].as_str().unwrap();
        assert!(load_all(out).contains_key(name), "{name}");
    }
}

#[test]
fn fp8_block_compressed_tensors_equals_dequant_merge_then_quantize() {
    fp8_case(&fixture("quantize/FP8_BLOCK"), "weight_scale", &[]);
}

#[test]
fn fp8_native_equals_dequant_merge_then_quantize() {
    let dir = tmp();
    let base = native_base(dir.path());
    fp8_case(&base, "weight_scale_inv", &["--format", "fp8-native"]);
}

#[test]
fn nvfp4_keeps_the_tensor_scale_and_equals_quantize_with_it() {
    let base = fixture("quantize/NVFP4A16");
    let (dir, a) = tmp_adapter();
    let out = dir.path().join("out");
    let report = dir.path().join("report.json");
    // No flag: an NVFP4 base is requantised by default.
    let o = lora_merge(&base, &a, &out, &["--report", s(&report)]);
    ok(&o);
    let (b, got) = check_against_base(&base, &out, "weight_scale", true);
    let mid = dir.path().join("mid");
    tftf_ok(&cmd(
        "dequant",
        &base,
        &mid,
        &["--merge-lora", s(&a), "--dtype", "bf16"],
    ));
    let merged = load_all(&mid);
    for (m, rows, cols) in TARGETS {
        let p = format!("{LAYER}.{m}");
        let g_bytes = &b[&format!("{p}.weight_global_scale")].2;
        assert!(
            got[&format!("{p}.weight_global_scale")].2 == *g_bytes,
            "{p}: tensor scale kept"
        );
        let global = f32::from_le_bytes(g_bytes[..4].try_into().unwrap());
        let op = QuantizeRows {
            scheme: Scheme::Nvfp4A16,
            rows,
            cols,
            wt: WeightType::BF16,
            global,
            block: BlockMath::CompressedTensors,
        };
        let mut codes = vec![0u8; (rows * cols / 2) as usize];
        let mut scales = vec![0u8; (rows * cols / 16) as usize];
        let w = &merged[&format!("{p}.weight")].2;
        op.compute_all(0..rows, &[w], &mut [&mut codes, &mut scales])
            .unwrap();
        assert!(got[&format!("{p}.weight_packed")].2 == codes, "{p}: codes");
        assert!(
            got[&format!("{p}.weight_scale")].2 == scales,
            "{p}: block scales"
        );
    }
    check_report(&report, &out);
    let r = read_json(&report);
    for t in r["tensor_reports"].as_array().unwrap() {
        if t["op"] == "requant" {
            assert!(t["saturated_blocks"].is_u64(), "{t}");
        }
    }
}

#[test]
fn default_no_requant_and_run_section() {
    let base = fixture("quantize/FP8_BLOCK");
    let (dir, a) = tmp_adapter();
    let explicit = dir.path().join("explicit");
    lora_merged(&base, &a, &explicit, &["--requant"]);
    // No flag on an FP8-block base: the same output, whatever threads, chunks and shards.
    let default = dir.path().join("default");
    lora_merged(
        &base,
        &a,
        &default,
        &[
            "--threads",
            "3",
            "--memory-budget",
            "64MiB",
            "--max-shard-size",
            "200KB",
        ],
    );
    assert!(load_all(&explicit) == load_all(&default));
    // The merged rows live outside the pool's buffers, a chunk per compute thread: the pool
    // gives that up, so pool and scratch together stay in the budget.
    let report = dir.path().join("r.json");
    lora_merged(
        &base,
        &a,
        &dir.path().join("budget"),
        &[
            "--threads",
            "2",
            "--memory-budget",
            "16MiB",
            "--report",
            s(&report),
        ],
    );
    let r: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&report).unwrap()).unwrap();
    let (pool, chunk, threads) = (
        r["pool_bytes"].as_u64().unwrap(),
        r["chunk_bytes"].as_u64().unwrap(),
        r["threads"].as_u64().unwrap(),
    );
    assert!(
        pool + threads * chunk <= 16 << 20,
        "pool {pool} + {threads} x chunk {chunk}"
    );
    // run --merge-lora requantises the same way.
    let run = dir.path().join("run");
    tftf_ok(&cmd(
        "run",
        &base,
        &run,
        &["--merge-lora", "--adapter", s(&a), "--requant"],
    ));
    assert!(load_all(&explicit) == load_all(&run));
    // --no-requant keeps the old refusal.
    let err = fails(&merge_lora(
        &base,
        &a,
        &dir.path().join("no"),
        &["--no-requant"],
    ));
    assert!(err.contains("dequantise it first"), "{err}");
    // --dtype asks for float output: the old behaviour too.
    let err = fails(&merge_lora(
        &base,
        &a,
        &dir.path().join("dt"),
        &["--dtype", "bf16"],
    ));
    assert!(err.contains("dequantise it first"), "{err}");
}

#[test]
fn requant_with_dtype_is_a_usage_error() {
    let base = fixture("quantize/FP8_BLOCK");
    let (dir, a) = tmp_adapter();
    let out = dir.path().join("out");
    let err = usage_error(&merge_lora(
        &base,
        &a,
        &out,
        &["--requant", "--dtype", "bf16"],
    ));
    assert!(
        err.contains("--dtype") || err.contains("--requant"),
        "{err}"
    );
    let err = usage_error(&cmd(
        "run",
        &base,
        &out,
        &[
            "--merge-lora",
            "--adapter",
            s(&a),
            "--requant",
            "--dtype-cast",
            "bf16",
        ],
    ));
    assert!(err.contains("--requant"), "{err}");
    // After --dequant-fp8 the base is not quantised any more.
    let err = usage_error(&cmd(
        "run",
        &base,
        &out,
        &[
            "--dequant-fp8",
            "--merge-lora",
            "--adapter",
            s(&a),
            "--requant",
        ],
    ));
    assert!(err.contains("not quantised any more"), "{err}");
    // While dequant then merge without the flag is the float route, as before.
    tftf_ok(&cmd(
        "run",
        &base,
        &out,
        &["--dequant-fp8", "--merge-lora", "--adapter", s(&a)],
    ));
    let got = load_all(&out);
    assert_eq!(got[&format!("{LAYER}.self_attn.q_proj.weight")].0, "BF16");
}

#[test]
fn unsupported_scheme_is_an_error_naming_it() {
    let base = fixture("quantize/FP8_DYNAMIC");
    let (dir, a) = tmp_adapter();
    let out = dir.path().join("out");
    let err = fails(&merge_lora(&base, &a, &out, &["--requant"]));
    assert_mentions(&err, &["--requant supports", "per-channel"]);
    // Without the flag such a base keeps today's behaviour (merging into codes is refused).
    let err = fails(&merge_lora(&base, &a, &out, &[]));
    assert!(err.contains("dequantise it first"), "{err}");
    // And an unquantised base cannot be requantised.
    let err = fails(&merge_lora(
        &fixture("quantize/input"),
        &a,
        &out,
        &["--requant"],
    ));
    assert_refused(&err, &["needs a quantised base"], &out);
}

#[test]
fn same_bytes_and_figures_whatever_threads_and_chunks() {
    // Weights large enough that a 16 MiB budget cuts them into several chunks.
    let dir = tmp();
    let mut rng = Rng(42);
    let q = format!("{LAYER}.self_attn.q_proj.weight");
    let k = format!("{LAYER}.self_attn.k_proj.weight");
    let input = Model::new()
        .rand(&mut rng, &q, DType::BF16, &[1536, 512])
        .rand(&mut rng, &k, DType::BF16, &[384, 512])
        .config(r#"{"model_type": "llama", "torch_dtype": "bfloat16"}"#)
        .write(&dir.path().join("input"));
    let mut small = |n: u64| -> Vec<u8> {
        let v: Vec<f32> = (0..n)
            .map(|_| (rng.next_u32() as f32 / u32::MAX as f32 - 0.5) * 0.02)
            .collect();
        f32_bytes(&v)
    };
    let p = format!("base_model.model.{LAYER}.self_attn.q_proj");
    let a = Model::adapter()
        .tensor(
            &format!("{p}.lora_A.weight"),
            DType::F32,
            &[8, 512],
            small(8 * 512),
        )
        .tensor(
            &format!("{p}.lora_B.weight"),
            DType::F32,
            &[1536, 8],
            small(1536 * 8),
        )
        .file(
            "adapter_config.json",
            r#"{"peft_type": "LORA", "r": 8, "lora_alpha": 16, "target_modules": ["q_proj"]}"#,
        )
        .write(&dir.path().join("adapter"));
    for (scheme, format) in [
        ("FP8_BLOCK", "compressed-tensors"),
        ("FP8_BLOCK", "fp8-native"),
        ("NVFP4A16", "compressed-tensors"),
    ] {
        let base = dir.path().join(format!("{scheme}-{format}"));
        convert_ok(
            "quantize",
            &input,
            &base,
            &["--scheme", scheme, "--format", format],
        );
        let run = |name: &str, extra: &[&str]| {
            let out = dir.path().join(format!("{scheme}-{format}-{name}"));
            let report = dir.path().join(format!("{scheme}-{format}-{name}.json"));
            lora_merged(
                &base,
                &a,
                &out,
                &[&["--report", s(&report)][..], extra].concat(),
            );
            let r = read_json(&report);
            assert!(r["chunk_bytes"].as_u64().unwrap() > 0);
            let figures: Vec<serde_json::Value> = r["tensor_reports"]
                .as_array()
                .unwrap()
                .iter()
                .filter(|t| t["op"] == "requant")
                .cloned()
                .collect();
            (load_all(&out), figures)
        };
        let one = run("one", &["--threads", "1"]);
        let many = run("many", &["--threads", "3", "--memory-budget", "16MiB"]);
        assert!(one.0 == many.0, "{scheme} {format}: same bytes");
        assert_eq!(one.1, many.1, "{scheme} {format}: same figures");
        assert_eq!(one.1.len(), 1, "{scheme} {format}: q_proj only");
        let b = load_all(&base);
        let untouched: Vec<&String> = b.keys().filter(|n| n.contains("k_proj")).collect();
        for n in untouched {
            assert!(b[n] == one.0[n], "{n}: copied");
        }
        if scheme == "NVFP4A16" {
            // The delta outgrows the tiny weights, so blocks saturate under the kept scale.
            assert!(
                one.1[0]["saturated_blocks"].as_u64().unwrap() > 0,
                "{:?}",
                one.1
            );
        }
    }
}

#[test]
fn merge_dcp_lora_requantises_an_f32_base_like_the_two_step_route() {
    // A real FSDP LoRA checkpoint on an F32 model (config `dtype: float32`): the merged weights
    // are rounded to F32 and quantised in F32, scales F32, as `quantize` does for F32 weights.
    let case = fixture("torch/dcp/lora-2rank");
    let dcp = case.join("pytorch_model_fsdp_0");
    let cfg = case.join("adapter_config.json");
    let dir = tmp();
    let base = dir.path().join("base");
    convert_ok(
        "quantize",
        &case.join("base"),
        &base,
        &["--scheme", "FP8_BLOCK"],
    );
    let out = dir.path().join("out");
    tftf_ok(&[
        "merge-dcp-lora",
        "-b",
        s(&base),
        "-c",
        s(&dcp),
        "--adapter-config",
        s(&cfg),
        "-o",
        s(&out),
        "--requant",
    ]);
    let mid = dir.path().join("mid");
    tftf_ok(&cmd(
        "dequant",
        &base,
        &mid,
        &[
            "--merge-lora",
            s(&dcp),
            "--lora-config",
            s(&cfg),
            "--dtype",
            "f32",
        ],
    ));
    let two = dir.path().join("two");
    convert_ok("quantize", &mid, &two, &["--scheme", "FP8_BLOCK"]);
    let (b, got, want) = (load_all(&base), load_all(&out), load_all(&two));
    assert_eq!(got.keys().collect::<Vec<_>>(), b.keys().collect::<Vec<_>>());
    let mut merged = 0;
    for name in b.keys() {
        if got[name] != b[name] {
            merged += 1;
            assert!(
                got[name] == want[name],
                "{name}: same as dequant + quantize"
            );
            assert_eq!(got[name].0, b[name].0, "{name}: dtype kept");
        }
    }
    assert!(merged >= 4, "{merged} tensors changed");
    assert_eq!(
        read_json(&base.join("config.json")),
        read_json(&out.join("config.json"))
    );
}
