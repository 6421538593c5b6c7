//! tftf's whole GPU path — cudarc's driver calls, lanes, pinned staging, kernel arguments,
//! refusal flags, downloads — run against a fake CUDA driver (tests/fake_cuda) that executes the
//! very kernels of kernels/tftf.cu compiled for the host. GPU and CPU outputs must be
//! byte-identical, in both the copy and the unified-memory mode. What this cannot check is the real device: `tftf selftest`
//! and bench/gpu-check.sh do that where a GPU exists.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::OnceLock;

use tftf::format::dtype::DType;

use common::fake_cuda::{build_fake, fake_libs, tftf_logged};
use common::{
    assert_mentions, assert_refused, assert_same_tensors, assert_starts, cmd, fixture, listing,
    load_all, s, stderr, MODELOPT_SCHEMES, SCHEMES,
};

/// A fake driver without one entry point, as an older driver would be.
fn old_fake_libs() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| build_fake("fake-cuda-old", Some("cuArrayCreate_v2")))
}

fn tftf_with(fake: bool, integrated: bool, args: &[&str]) -> Output {
    tftf_in(fake.then(fake_libs), integrated, args)
}

fn tftf_in(libs: Option<&Path>, integrated: bool, args: &[&str]) -> Output {
    tftf_logged(libs, integrated, None, args)
}

fn ok(o: &Output) -> String {
    assert!(
        o.status.success(),
        "exit {:?}\nstdout: {}\nstderr: {}",
        o.status.code(),
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
    String::from_utf8_lossy(&o.stdout).into_owned()
}

/// The demo's example checkpoints (FP8 with scales, a V4-style MXFP4/Engram model, an adapter).
fn examples() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("fake-gpu-examples");
        let _ = std::fs::remove_dir_all(&dir);
        ok(&tftf_with(false, false, &["demo", "--keep", s(&dir)]));
        dir
    })
}

/// Runs `args` with `-o OUT --device DEV` on the CPU and on the fake GPU (copying and unified
/// memory); returns the CPU and GPU outputs' tensors after checking the report's device and that
/// every kernel in `kernels` was launched.
fn cpu_vs_gpu(
    name: &str,
    args: &[&str],
    kernels: &[&str],
) -> Vec<(String, String, Vec<u8>, Vec<u8>)> {
    let work = Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("fake-gpu-{name}"));
    let _ = std::fs::remove_dir_all(&work);
    std::fs::create_dir_all(&work).unwrap();
    let run = |dev: &str, fake: bool, integrated: bool, out: &str| {
        let out = work.join(out);
        let report = work.join(format!("{dev}-{integrated}.json"));
        let mut a: Vec<&str> = args.to_vec();
        a.extend([
            "-o",
            s(&out),
            "--device",
            dev,
            "--report",
            s(&report),
            "--threads",
            "3",
        ]);
        let log = work.join(format!("{dev}-{integrated}.log"));
        ok(&tftf_logged(
            fake.then(fake_libs),
            integrated,
            Some(&log),
            &a,
        ));
        let launched = std::fs::read_to_string(&log).unwrap_or_default();
        for k in kernels.iter().filter(|_| dev == "cuda") {
            assert!(
                launched.lines().any(|l| l == *k),
                "{name}: {k} was not launched"
            );
        }
        let rep: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&report).unwrap()).unwrap();
        (load_all(&out), rep)
    };
    let (cpu, rep_cpu) = run("cpu", true, false, "cpu");
    assert_eq!(rep_cpu["device"], "cpu");
    let mut pairs = Vec::new();
    for integrated in [false, true] {
        let (gpu, rep) = run(
            "cuda",
            true,
            integrated,
            if integrated { "unified" } else { "gpu" },
        );
        let dev = rep["device"].as_str().unwrap();
        assert_starts(dev, "cuda:0 (tftf fake CUDA device, sm_90");
        assert_eq!(dev.contains("unified memory"), integrated, "{dev}");
        assert!(
            rep["gpu"]["chunks"].as_u64().unwrap() > 0,
            "{name}: nothing ran on the GPU"
        );
        assert_eq!(rep["gpu"]["ptx"], "committed");
        assert_same_tensors(name, &gpu, &cpu, |k, dt, gbytes, bytes| {
            pairs.push((
                k.to_string(),
                dt.to_string(),
                bytes.to_vec(),
                gbytes.to_vec(),
            ))
        });
        // Unified memory: the kernels used the staging directly and no file differs.
        assert_eq!(
            listing(&work.join("cpu")),
            listing(&work.join(if integrated { "unified" } else { "gpu" }))
        );
    }
    pairs
}

fn assert_identical(name: &str, pairs: &[(String, String, Vec<u8>, Vec<u8>)]) {
    for (k, _, a, b) in pairs {
        assert!(a == b, "{name}: {k} differs between CPU and GPU");
    }
}

#[test]
fn cast_dequant_and_fp4_repack_are_byte_identical_on_the_gpu_path() {
    let ex = examples();
    let pairs = cpu_vs_gpu(
        "cast",
        &[
            "passthrough",
            s(&ex.join("example")),
            "--dtype",
            "f16",
            "--memory-budget",
            "16MiB",
        ],
        &["tftf_cast"],
    );
    assert_identical("cast", &pairs);
    let pairs = cpu_vs_gpu(
        "dequant",
        &["dequant-fp8", s(&ex.join("example")), "--dtype", "f32"],
        &["tftf_dequant_fp8"],
    );
    assert_identical("dequant", &pairs);
    let pairs = cpu_vs_gpu(
        "repack",
        &["repack-fp4", "-i", s(&ex.join("v4-example"))],
        &[
            "tftf_nv_block_scales",
            "tftf_engram_blocks",
            "tftf_engram_rows",
        ],
    );
    assert_identical("repack", &pairs);
}

#[test]
fn fp4_and_int_dequant_run_their_kernels_and_equal_the_library_decompression() {
    for (case, kernel) in [
        ("ct_w3a16_asym", "tftf_dequant_int"),
        ("ct_w4a16", "tftf_dequant_int"),
        ("ct_w8a16_asym", "tftf_dequant_int"),
        ("ct_nvfp4", "tftf_dequant_fp4"),
        ("modelopt_nvfp4", "tftf_dequant_fp4"),
        ("ct_mxfp4a16", "tftf_dequant_fp4"),
        ("modelopt_mxfp4", "tftf_dequant_fp4"),
        ("gpt_oss_mxfp4", "tftf_dequant_fp4"),
        ("gptq_w4_act_order", "tftf_dequant_gptq"),
        ("gptq_w8_v2", "tftf_dequant_gptq"),
    ] {
        let model = fixture(&format!("quant/{case}/model"));
        let pairs = cpu_vs_gpu(
            &format!("dec-{case}"),
            &["dequant", "-i", s(&model)],
            &[kernel],
        );
        assert_identical(case, &pairs);
        let want = load_all(&fixture(&format!("quant/{case}/expected.safetensors")));
        for (k, _, _, gpu) in &pairs {
            assert_eq!(
                gpu, &want[k].2,
                "{case}: `{k}` is not the library's decompression"
            );
        }
    }
}

/// `merge-lora -b BASE -a ADAPTER` on the CPU and on the fake GPU ([`cpu_vs_gpu`], `kernels`
/// launched): every tensor byte-identical.
fn merge_lora_on_both(name: &str, base: &Path, adapter: &Path, kernels: &[&str]) {
    let args = ["merge-lora", "-b", s(base), "-a", s(adapter)];
    assert_identical(name, &cpu_vs_gpu(name, &args, kernels));
}

/// `tftf merge` of the mergekit fixtures' linear and task-arithmetic configs (BF16 and F32
/// models, gradients, filters, mergekit's `dtype`) on the fake GPU: `tftf_merge` computes them,
/// byte-identical to the CPU.
#[test]
fn elementwise_model_merges_are_byte_identical_on_the_gpu_path() {
    for name in [
        "linear_bf16",
        "linear_f32",
        "task_arithmetic_bf16",
        "task_arithmetic_f32",
    ] {
        let cfg = format!("tests/fixtures/merge/configs/{name}.yml");
        let pairs = cpu_vs_gpu(name, &["merge", &cfg], &["tftf_merge"]);
        assert_identical(name, &pairs);
    }
}

/// slerp, nuslerp (flattened, down columns, with and without a base), multislerp, model_stock,
/// karcher, nearswap, ram, ramplus_tl, arcee_fusion, TIES, breadcrumbs, DARE, DELLA (rows of a
/// matrix, and rows strided through a 3-D tensor) and SCE of weights several chunks long under
/// `--memory-budget 16MiB`: the survey runs on the CPU, each chunk's blend as `tftf_merge`,
/// byte-identical to the CPU; a NaN in an input gives the CPU's bytes too.
#[test]
fn surveyed_blends_are_byte_identical_on_the_gpu_path() {
    let dir = tempfile::tempdir().unwrap();
    let model = |name: &str, seed: u64| {
        let mut rng = common::Rng(seed);
        let mut w = common::rand_t(&mut rng, "w.weight", DType::BF16, &[1024, 1024]);
        if name == "c" {
            w.3[2..4].copy_from_slice(&0x7FC1u16.to_le_bytes()); // element 1: a NaN
        }
        common::Model::new()
            .tensors([w])
            .rand(&mut rng, "v.weight", DType::F32, &[512, 512])
            .rand(&mut rng, "small.weight", DType::BF16, &[8, 8])
            .write(&dir.path().join(name))
    };
    // c holds a NaN, which the sparsifying methods refuse: they merge d.
    let [a, b, c, d] = [model("a", 1), model("b", 2), model("c", 3), model("d", 4)];
    let (a, b, c, d) = (s(&a), s(&b), s(&c), s(&d));
    // Quarters in [-2, 2): every task vector's magnitudes tie in large groups, so the
    // magnitude cuts fall inside a tie and the position limit decides.
    let quarters = |name: &str, seed: u64| {
        let mut rng = common::Rng(seed);
        let mut tensor = |name: &str, shape: &[u64]| {
            let values: Vec<f32> = (0..shape.iter().product())
                .map(|_| (rng.next_u32() % 16) as f32 / 4.0 - 2.0)
                .collect();
            let bytes = values.iter().flat_map(|v| v.to_le_bytes()).collect();
            common::t(name, DType::F32, shape, bytes)
        };
        let tensors = [
            tensor("w.weight", &[2048, 512]),
            tensor("v.weight", &[512, 512]),
            // DELLA ranks down axis 1: rows strided by 256.
            tensor("x.weight", &[16, 256, 256]),
        ];
        common::Model::new()
            .tensors(tensors)
            .write(&dir.path().join(name))
    };
    let [e, f, g] = [quarters("e", 5), quarters("f", 6), quarters("g", 7)];
    let (e, f, g) = (s(&e), s(&f), s(&g));
    let configs = [
        ("slerp", format!("merge_method: slerp\nbase_model: {a}\nmodels:\n  - model: {a}\n  - model: {b}\nparameters:\n  t: 0.3\n")),
        ("slerp-nan", format!("merge_method: slerp\nbase_model: {a}\nmodels:\n  - model: {a}\n  - model: {c}\nparameters:\n  t: 0.6\ndtype: float16\n")),
        ("nuslerp", format!("merge_method: nuslerp\nmodels:\n  - model: {a}\n    parameters: {{weight: 0.4}}\n  - model: {b}\n    parameters: {{weight: 0.9}}\n")),
        ("nuslerp-columns", format!("merge_method: nuslerp\nbase_model: {c}\nmodels:\n  - model: {a}\n    parameters: {{weight: 1.0}}\n  - model: {b}\n    parameters: {{weight: 0.5}}\nparameters:\n  nuslerp_flatten: false\n  nuslerp_row_wise: true\n")),
        ("multislerp", format!("merge_method: multislerp\nbase_model: {c}\nmodels:\n  - model: {a}\n    parameters: {{weight: 0.5}}\n  - model: {b}\n    parameters: {{weight: 0.2}}\n  - model: {c}\n    parameters: {{weight: 0.3}}\n")),
        ("model_stock", format!("merge_method: model_stock\nbase_model: {c}\nmodels:\n  - model: {a}\n  - model: {b}\n")),
        ("karcher", format!("merge_method: karcher\nmodels:\n  - model: {a}\n  - model: {b}\n  - model: {c}\n")),
        ("nearswap", format!("merge_method: nearswap\nbase_model: {a}\nmodels:\n  - model: {a}\n  - model: {c}\nparameters:\n  t: 0.001\n")),
        ("ram", format!("merge_method: ram\nbase_model: {a}\nmodels:\n  - model: {a}\n  - model: {b}\n  - model: {c}\nparameters:\n  epsilon: 0.01\n")),
        ("ramplus_tl", format!("merge_method: ramplus_tl\nbase_model: {c}\nmodels:\n  - model: {a}\n  - model: {b}\n  - model: {c}\nparameters:\n  epsilon: 0.001\n  r: 0.3\n")),
        ("arcee_fusion", format!("merge_method: arcee_fusion\nbase_model: {a}\nmodels:\n  - model: {a}\n  - model: {b}\n")),
        ("ties", format!("merge_method: ties\nbase_model: {a}\nmodels:\n  - model: {b}\n    parameters: {{weight: 0.6, density: 0.3}}\n  - model: {d}\n    parameters: {{weight: 0.5, density: 0.7}}\nparameters:\n  lambda: 0.9\n")),
        ("breadcrumbs_ties", format!("merge_method: breadcrumbs_ties\nbase_model: {d}\nmodels:\n  - model: {a}\n    parameters: {{weight: 1.0, density: 0.5, gamma: 0.1}}\n  - model: {b}\n    parameters: {{weight: 0.3, density: 0.8, gamma: 0.05}}\nparameters:\n  normalize: false\n")),
        ("dare_ties", format!("merge_method: dare_ties\nbase_model: {a}\nmodels:\n  - model: {b}\n    parameters: {{weight: 0.6, density: 0.4}}\n  - model: {d}\n    parameters: {{weight: 0.5, density: 0.6}}\n")),
        ("dare_linear", format!("merge_method: dare_linear\nbase_model: {a}\nmodels:\n  - model: {b}\n    parameters: {{weight: 0.6, density: 0.4}}\n  - model: {d}\n    parameters: {{weight: -0.5, density: 0.9}}\n")),
        ("ties-ties", format!("merge_method: ties\nbase_model: {g}\nmodels:\n  - model: {e}\n    parameters: {{weight: 0.6, density: 0.3}}\n  - model: {f}\n    parameters: {{weight: 0.5, density: 0.55}}\n")),
        ("breadcrumbs-ties", format!("merge_method: breadcrumbs\nbase_model: {g}\nmodels:\n  - model: {e}\n    parameters: {{weight: 1.0, density: 0.4, gamma: 0.2}}\n  - model: {f}\n    parameters: {{weight: 0.7, density: 0.5, gamma: 0.15}}\n")),
        ("della", format!("merge_method: della\nbase_model: {g}\nmodels:\n  - model: {e}\n    parameters: {{weight: 0.6, density: 0.4, epsilon: 0.1}}\n  - model: {f}\n    parameters: {{weight: 0.5, density: 0.7, epsilon: 0.2}}\n")),
        ("della_linear", format!("merge_method: della_linear\nbase_model: {a}\nmodels:\n  - model: {b}\n    parameters: {{weight: 0.6, density: 0.5, epsilon: 0.05}}\n  - model: {d}\n    parameters: {{weight: 0.4, density: 0.3, epsilon: 0.1}}\nparameters:\n  lambda: 0.8\n")),
        ("sce", format!("merge_method: sce\nbase_model: {a}\nmodels:\n  - model: {b}\n  - model: {d}\nparameters:\n  select_topk: 0.4\n")),
        ("sce-ties", format!("merge_method: sce\nbase_model: {g}\nmodels:\n  - model: {e}\n  - model: {f}\nparameters:\n  select_topk: 0.5\n")),
        ("multislerp-two", format!("merge_method: multislerp\nmodels:\n  - model: {a}\n    parameters: {{weight: 1.0}}\n  - model: {b}\n    parameters: {{weight: 3.0}}\ndtype: bfloat16\n")),
    ];
    for (name, text) in configs {
        let cfg = dir.path().join(format!("{name}.yml"));
        std::fs::write(&cfg, text).unwrap();
        let args = [
            "merge",
            s(&cfg),
            "--memory-budget",
            "16MiB",
            "--random-seed",
            "7",
        ];
        assert_identical(name, &cpu_vs_gpu(name, &args, &["tftf_merge"]));
    }
    // `--device auto` takes the GPU for a karcher merge, whose kept models only its survey
    // knows.
    let (out, report) = (dir.path().join("auto"), dir.path().join("auto.json"));
    let cfg = dir.path().join("karcher.yml");
    let args = [
        "merge",
        s(&cfg),
        s(&out),
        "-q",
        "--device",
        "auto",
        "--report",
        s(&report),
    ];
    ok(&tftf_logged(Some(fake_libs()), false, None, &args));
    let rep: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&report).unwrap()).unwrap();
    assert_starts(rep["device"].as_str().unwrap(), "cuda:0");
}

#[test]
fn lora_and_dora_merges_are_byte_identical_on_the_gpu_path() {
    let ex = examples();
    let merge_kernels = ["tftf_lora_delta", "tftf_lora"];
    let (base, adapter) = (ex.join("dequantized"), ex.join("adapter"));
    merge_lora_on_both("lora", &base, &adapter, &merge_kernels);
    // FP8 base: dequantised and merged in one pass, both on the GPU.
    let pairs = cpu_vs_gpu(
        "fp8-lora",
        &[
            "dequant-fp8",
            s(&ex.join("example")),
            "--merge-lora",
            s(&ex.join("adapter")),
        ],
        &["tftf_dequant_fp8", "tftf_lora_delta", "tftf_lora"],
    );
    assert_identical("fp8-lora", &pairs);
    // A LoRA on transformers 5's fused experts into a base stored per expert: each expert's
    // block of the grouped factors, read in place by the same kernels.
    let mixtral = fixture("peft/mixtral-experts");
    let (base, adapter) = (mixtral.join("base"), mixtral.join("adapter"));
    merge_lora_on_both("experts-lora", &base, &adapter, &merge_kernels);
    // An FP8-block base requantised (the default): dequantised, merged and quantised again on
    // the device, with the same error figures as the CPU's.
    let dir = tempfile::tempdir().unwrap();
    let adapter = common::requant_adapter(dir.path());
    merge_lora_on_both(
        "fp8-requant",
        &fixture("quantize/FP8_BLOCK"),
        &adapter,
        &[
            "tftf_dequant_fp8",
            "tftf_lora_delta",
            "tftf_lora",
            "tftf_quantize_fp8_amax",
            "tftf_quantize_fp8_scales",
            "tftf_quantize_fp8_codes",
        ],
    );
    let requant = |case: &str, report: &str| -> Vec<serde_json::Value> {
        let work = Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("fake-gpu-{case}"));
        let r: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(work.join(report)).unwrap()).unwrap();
        r["tensor_reports"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|t| t["op"] == "requant")
            .cloned()
            .collect()
    };
    let same_figures = |case: &str| {
        let cpu = requant(case, "cpu-false.json");
        assert_eq!(cpu.len(), 4, "{case}: every targeted weight requantised");
        assert!(cpu
            .iter()
            .all(|t| t["relative_error"].as_f64().unwrap() > 0.0));
        for gpu in ["cuda-false.json", "cuda-true.json"] {
            assert_eq!(
                requant(case, gpu),
                cpu,
                "{case} {gpu}: the same error figures"
            );
        }
    };
    same_figures("fp8-requant");
    // An NVFP4 base: FP4 dequantisation feeds the merge on the device (DoRA on gate_proj: six
    // inputs), under the base's kept tensor scale.
    let pairs = cpu_vs_gpu(
        "nvfp4-requant",
        &[
            "merge-lora",
            "-b",
            s(&fixture("quantize/NVFP4A16")),
            "-a",
            s(&adapter),
        ],
        &[
            "tftf_dequant_fp4",
            "tftf_lora_delta",
            "tftf_dora_factors",
            "tftf_lora",
            "tftf_quantize_groups",
        ],
    );
    assert_identical("nvfp4-requant", &pairs);
    same_figures("nvfp4-requant");
}

/// The fixture input `quantize` takes for `scheme` (int schemes need columns that 128
/// divides) and the kernels the scheme runs.
fn quantize_case(scheme: &str) -> (PathBuf, &'static [&'static str]) {
    let input = fixture(if scheme.starts_with('W') {
        "quantize/input_even"
    } else {
        "quantize/input"
    });
    let kernels: &[&str] = if scheme.starts_with("FP8") {
        &[
            "tftf_quantize_fp8_amax",
            "tftf_quantize_fp8_scales",
            "tftf_quantize_fp8_codes",
        ]
    } else {
        &["tftf_quantize_groups"]
    };
    (input, kernels)
}

/// `tftf quantize` on the GPU path: every scheme runs its kernels and writes
/// llm-compressor's bytes, as the CPU does; a NaN weight is refused by the kernel and named by
/// the CPU op.
#[test]
fn quantize_runs_its_kernels_and_equals_llm_compressor() {
    for scheme in SCHEMES {
        let (input, kernels) = quantize_case(scheme);
        let pairs = cpu_vs_gpu(
            &format!("quantize-{scheme}"),
            &["quantize", "-i", s(&input), "--scheme", scheme],
            kernels,
        );
        assert_identical(scheme, &pairs);
        let want = load_all(&fixture(&format!("quantize/{scheme}/model.safetensors")));
        for (k, _, _, gpu) in &pairs {
            assert_eq!(gpu, &want[k].2, "{scheme}: `{k}` is not llm-compressor's");
        }
    }

    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("m.safetensors");
    let mut w: Vec<u8> = (0..64u16)
        .flat_map(|i| (0x3C00 + i).to_le_bytes())
        .collect();
    w[2 * 21..2 * 22].copy_from_slice(&0x7E00u16.to_le_bytes());
    common::write_file(
        &model,
        &[common::t(
            "w.weight",
            tftf::format::dtype::DType::F16,
            &[4, 16],
            w,
        )],
    );
    let out = dir.path().join("o");
    for (fake, dev) in [(false, "cpu"), (true, "cuda")] {
        let r = tftf_with(
            fake,
            false,
            &cmd(
                "quantize",
                &model,
                &out,
                &["--scheme", "FP8_DYNAMIC", "--device", dev],
            ),
        );
        assert_eq!(r.status.code(), Some(1), "{dev}");
        assert_refused(&stderr(&r), &["w.weight", "NaN at [1, 5]"], &out);
    }
}

fn sha256_hex(bytes: &[u8]) -> String {
    use sha2::{Digest, Sha256};
    Sha256::digest(bytes)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// `quantize --format modelopt` runs the quantiser kernels in ModelOpt's arithmetic and writes
/// ModelOpt's bytes; its W4A16 output dequantises on the GPU to ModelOpt's values.
#[test]
fn modelopt_quantize_and_int4_dequant_run_their_kernels_and_equal_modelopt() {
    for scheme in MODELOPT_SCHEMES {
        let (input, kernels) = quantize_case(scheme);
        let name = format!("quantize-modelopt-{scheme}");
        let pairs = cpu_vs_gpu(
            &name,
            &[
                "quantize",
                "-i",
                s(&input),
                "--scheme",
                scheme,
                "--format",
                "modelopt",
            ],
            kernels,
        );
        assert_identical(scheme, &pairs);
        let listing = common::read_json(&fixture(&format!(
            "quantize/modelopt/{scheme}/tensors.json"
        )));
        let want: std::collections::HashMap<&str, &str> = listing
            .as_array()
            .unwrap()
            .iter()
            .map(|t| (t["name"].as_str().unwrap(), t["sha256"].as_str().unwrap()))
            .collect();
        assert_eq!(want.len() * 2, pairs.len(), "{scheme}: every tensor, twice");
        for (k, _, _, gpu) in &pairs {
            assert_eq!(
                sha256_hex(gpu),
                want[k.as_str()],
                "{scheme}: `{k}` is not ModelOpt's"
            );
        }
    }

    let quantized =
        Path::new(env!("CARGO_TARGET_TMPDIR")).join("fake-gpu-quantize-modelopt-W4A16/gpu");
    let pairs = cpu_vs_gpu(
        "dequant-modelopt-W4A16",
        &["dequant", "-i", s(&quantized)],
        &["tftf_dequant_int4_modelopt"],
    );
    assert_identical("ModelOpt INT4 dequant", &pairs);
    let want = common::read_json(&fixture("quantize/modelopt/W4A16/dequant.json"));
    for (name, digest) in want.as_object().unwrap() {
        let (_, _, _, gpu) = pairs.iter().find(|p| &p.0 == name).unwrap();
        assert_eq!(
            sha256_hex(gpu),
            digest.as_str().unwrap(),
            "`{name}` dequantised on the GPU differs from ModelOpt's values"
        );
    }
}

#[test]
fn selftest_passes_on_the_fake_device_and_refused_values_are_named() {
    let out = ok(&tftf_with(true, false, &["selftest", "--device", "cuda"]));
    assert_mentions(
        &out,
        &["selftest: cuda:0 (tftf fake CUDA device, sm_90) against the CPU ops"],
    );
    assert!(out.contains("copy bandwidth (pinned, 256 MiB)"), "{out}");
    assert!(out.contains(" 0 failed (cuda:0"), "{out}");
    let out = ok(&tftf_with(true, true, &["selftest", "-q"]));
    assert!(out.contains(" 0 failed (cuda:0"), "{out}");

    // A device that computes one wrong bit fails the selftest.
    let mut c = Command::new(env!("CARGO_BIN_EXE_tftf"));
    let r = c
        .args(["selftest", "-q"])
        .env("LD_LIBRARY_PATH", fake_libs())
        .env("TFTF_FAKE_CUDA_CORRUPT", "1")
        .output()
        .unwrap();
    assert_eq!(r.status.code(), Some(1));
    let out = String::from_utf8_lossy(&r.stdout);
    assert!(
        out.lines()
            .any(|l| l.starts_with("cast ") && l.contains("MISMATCH")),
        "{out}"
    );
    // Every cast case, and the merges whose factors pass through the cast kernel.
    assert!(out.contains(" 38 failed (cuda:0"), "{out}");

    // An FP8 NaN code: the kernel raises its flag, the CPU op names the element, no output.
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("m.safetensors");
    let mut codes = vec![0x38u8; 64];
    codes[37] = 0x7F;
    common::write_file(
        &model,
        &[
            common::t(
                "w.weight",
                tftf::format::dtype::DType::F8_E4M3,
                &[8, 8],
                codes,
            ),
            common::t(
                "w.weight_scale_inv",
                tftf::format::dtype::DType::F32,
                &[1, 1],
                1f32.to_le_bytes().to_vec(),
            ),
        ],
    );
    let out = dir.path().join("o");
    for (fake, dev) in [(false, "cpu"), (true, "cuda")] {
        let r = tftf_with(
            fake,
            false,
            &["dequant-fp8", s(&model), "-o", s(&out), "--device", dev],
        );
        assert_eq!(r.status.code(), Some(1), "{dev}");
        assert_refused(
            &stderr(&r),
            &["w.weight", "non-finite F8_E4M3 code 0x7f at [4, 5]"],
            &out,
        );
    }
}

#[test]
fn a_driver_older_than_cuda_12_2_is_refused_without_a_panic() {
    let example = examples().join("example");
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("o");
    let args = ["passthrough", s(&example), "-o", s(&out), "--dtype", "f32"];
    let r = tftf_in(Some(old_fake_libs()), false, &args);
    let stdout = ok(&r);
    assert!(
        stdout.contains("computed on the CPU (--device auto: the CUDA driver lacks functions of CUDA 12.2; update it to R535 or newer)"),
        "{stdout}"
    );
    let err = String::from_utf8_lossy(&r.stderr);
    assert!(
        !err.contains("panicked") && !err.contains("Expected symbol"),
        "{err}"
    );
    let out2 = dir.path().join("o2");
    let mut args2 = args.to_vec();
    args2[3] = s(&out2);
    args2.extend(["--device", "cuda"]);
    let r = tftf_in(Some(old_fake_libs()), false, &args2);
    assert_eq!(r.status.code(), Some(1));
    let err = String::from_utf8_lossy(&r.stderr);
    assert_starts(
        &err,
        "error: --device cuda:0: the CUDA driver lacks functions",
    );
    assert!(!out2.exists());
}

#[test]
fn pool_buffers_are_registered_for_direct_dma_and_a_refusal_falls_back_to_staging() {
    let example = examples().join("example");
    let work = Path::new(env!("CARGO_TARGET_TMPDIR")).join("fake-gpu-register");
    let _ = std::fs::remove_dir_all(&work);
    std::fs::create_dir_all(&work).unwrap();
    // (name, device, extra environment): the CPU reference, registration on, refused by the
    // driver, turned off by the user.
    type Env = Option<(&'static str, &'static str)>;
    let runs: [(&str, &str, Env); 4] = [
        ("cpu", "cpu", None),
        ("registered", "cuda", None),
        ("refused", "cuda", Some(("TFTF_FAKE_CUDA_NO_REGISTER", "1"))),
        ("off", "cuda", Some(("TFTF_NO_HOST_REGISTER", "1"))),
    ];
    let mut outputs = Vec::new();
    for (name, dev, env) in runs {
        for (cmd, extra) in [
            ("cast", ["--dtype", "f16"]),
            ("dequant", ["--dtype", "bf16"]),
        ] {
            let out = work.join(format!("{name}-{cmd}"));
            let report = work.join(format!("{name}-{cmd}.json"));
            let log = work.join(format!("{name}-{cmd}.log"));
            let command = if cmd == "cast" {
                "passthrough"
            } else {
                "dequant-fp8"
            };
            let mut c = Command::new(env!("CARGO_BIN_EXE_tftf"));
            c.args([command, s(&example), "-o", s(&out), "--device", dev, "-v"])
                .args(extra)
                .args(["--report", s(&report), "--memory-budget", "16MiB"])
                .args(["--threads", "3", "--no-progress"])
                .env("LD_LIBRARY_PATH", fake_libs())
                .env("TFTF_FAKE_CUDA_LOG", &log);
            if let Some((k, v)) = env {
                c.env(k, v);
            }
            let o = c.output().unwrap();
            ok(&o);
            let err = String::from_utf8_lossy(&o.stderr).into_owned();
            assert!(!err.contains("fake CUDA:"), "{name} {cmd}: {err}");
            let rep: serde_json::Value =
                serde_json::from_str(&std::fs::read_to_string(&report).unwrap()).unwrap();
            let log = std::fs::read_to_string(&log).unwrap_or_default();
            let registers = log.lines().filter(|l| l.starts_with("register ")).count();
            let unregisters = log.lines().filter(|l| *l == "unregister").count();
            assert_eq!(
                registers, unregisters,
                "{name} {cmd}: every buffer unregistered"
            );
            let direct = rep["gpu"]["direct_dma_bytes"].as_u64();
            let note = "info: pool buffers not registered with the GPU driver";
            match name {
                "cpu" => assert_eq!(rep["device"], "cpu"),
                "registered" => {
                    assert!(registers > 0, "{name} {cmd}: nothing registered");
                    assert!(
                        rep["gpu"]["host_registered_bytes"].as_u64().unwrap() > 0
                            && direct.unwrap() > 0,
                        "{name} {cmd}: {}",
                        rep["gpu"]
                    );
                    assert!(!err.contains(note), "{err}");
                }
                "refused" => {
                    assert_eq!((registers, direct), (0, Some(0)), "{name} {cmd}");
                    assert_mentions(&err, &[note, "cuMemHostRegister"]);
                    assert!(rep["gpu"]["chunks"].as_u64().unwrap() > 0);
                }
                _ => {
                    assert_eq!((registers, direct), (0, Some(0)), "{name} {cmd}");
                    assert!(!err.contains(note), "turned off is not a failure: {err}");
                    assert!(rep["gpu"]["chunks"].as_u64().unwrap() > 0);
                }
            }
            outputs.push((format!("{name} {cmd}"), cmd, load_all(&out)));
        }
    }
    for (what, cmd, got) in &outputs[2..] {
        let want = &outputs[if *cmd == "cast" { 0 } else { 1 }].2;
        assert!(want == got, "{what}: bytes differ from the CPU's");
    }
}

/// `tftf gguf` on the fake GPU: the Q8_0 blocks and casts (`tftf_gguf`) and the Q4_K_M and Q4_1
/// mixes' blocks (`tftf_gguf_blocks`) of a Llama's permuted Q/K rows and of a Qwen3-MoE's
/// stacked experts give the CPU's file byte for byte, with copies and with unified memory.
#[test]
fn gguf_encodes_on_the_gpu_with_the_cpus_bytes() {
    use common::gguf::{gguf_args, GgufCase};
    let cases = [
        ("llama", GgufCase::dense(3, "llama3")),
        ("moe", GgufCase::qwen3_moe(9)),
    ];
    for (name, c) in &cases {
        for outtype in ["q8_0", "f16", "f32", "q4_k_m", "q4_1"] {
            let run = |dev: &str, integrated: bool| {
                let tag = format!("{name}-{outtype}-{dev}-{integrated}");
                let (out, log, report) = (
                    c.path(&format!("{tag}.gguf")),
                    c.path(&format!("{tag}.log")),
                    c.path(&format!("{tag}.json")),
                );
                let extra = [
                    "--outtype",
                    outtype,
                    "--vocab-pre",
                    "test-pre",
                    "--device",
                    dev,
                    "--report",
                    s(&report),
                    "-q",
                ];
                ok(&tftf_logged(
                    Some(fake_libs()),
                    integrated,
                    Some(&log),
                    &gguf_args(&c.model, &out, &extra),
                ));
                let rep: serde_json::Value =
                    serde_json::from_str(&std::fs::read_to_string(&report).unwrap()).unwrap();
                let launched = std::fs::read_to_string(&log).unwrap_or_default();
                (std::fs::read(&out).unwrap(), rep, launched)
            };
            let (cpu, rep, launched) = run("cpu", false);
            assert_eq!(rep["device"], "cpu");
            assert!(launched.is_empty(), "{launched}");
            for integrated in [false, true] {
                let (gpu, rep, launched) = run("cuda", integrated);
                let kernel = match outtype {
                    "q4_k_m" | "q4_1" => "tftf_gguf_blocks",
                    _ => "tftf_gguf",
                };
                assert!(
                    launched.lines().any(|l| l == kernel),
                    "{name} {outtype}: {kernel} was not launched"
                );
                assert!(rep["gpu"]["chunks"].as_u64().unwrap() > 0, "{rep}");
                assert!(gpu == cpu, "{name} {outtype}: the GPU's GGUF differs");
            }
        }
    }
}
