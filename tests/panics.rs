//! Inputs that used to panic (exit 101) or pass a non-finite value silently: each must now end
//! with exit 0, 1 or 2 and a message naming the file and the tensor, and leave no output.

mod common;

use std::path::{Path, PathBuf};

use common::*;
use tftf::format::dtype::DType;

/// Runs tftf with extra environment variables.
fn tftf_env(args: &[&str], env: &[(&str, &str)]) -> std::process::Output {
    std::process::Command::new(env!("CARGO_BIN_EXE_tftf"))
        .args(args)
        .arg("--no-progress")
        .envs(env.iter().copied())
        .output()
        .expect("run tftf")
}

/// Expects exit 1, no output left behind, and a single `error:` line equal to `expected`.
fn refused(args: &[&str], out: &Path, expected: &str) {
    let o = tftf(&[args, &["--no-progress"]].concat());
    assert_eq!(o.status.code(), Some(1), "{}{}", stderr(&o), stdout(&o));
    assert_eq!(stderr(&o).trim_end(), format!("error: {expected}"));
    assert!(!out.exists(), "output left behind");
}

#[test]
fn info_prints_a_tensor_name_of_70_kib() {
    let d = tmp();
    let name = "x".repeat(70_000);
    let f = d.path().join("m.safetensors");
    write_file(&f, &[t(&name, DType::U8, &[2], vec![1, 2])]);
    let o = tftf_ok(&["info", s(&f)]);
    let out = stdout(&o);
    let row = out.lines().nth(1).unwrap();
    assert_eq!(
        row,
        format!("{name}  {:<11}  {:<22}  {:>12}", "U8", "[2]", 2)
    );
    assert!(out.contains(": 1 tensors in 1 shard(s), 2 elements, 2 B (2 bytes)"));
}

/// An FP8 weight `[2, 4]` with a `[2, 1]` scale grid, and `config` as config.json.
fn fp8_model(dir: &Path, config: &str) {
    std::fs::create_dir_all(dir).unwrap();
    Model::new()
        .tensor("w.weight", DType::F8_E4M3, &[2, 4], vec![0x38; 8])
        .tensor(
            "w.weight_scale_inv",
            DType::F32,
            &[2, 1],
            f32_bytes(&[1.0, 2.0]),
        )
        .write(dir);
    std::fs::write(dir.join("config.json"), config).unwrap();
}

#[test]
fn a_zero_block_side_in_config_json_is_refused_naming_the_key() {
    let (d, src) = tmp_in();
    let out = d.path().join("out");
    // Each config, and the message after `<config.json>: `.
    for (config, rest) in [
        (
            r#"{"quantization_config": {"quant_method": "fp8", "weight_block_size": [0, 128]}}"#,
            "`quantization_config.weight_block_size` is [0, 128]: a block side cannot be 0; fix config.json or pass --block-size RxC",
        ),
        (
            r#"{"quantization_config": {"config_groups": {"g": {"weights": {"block_structure": [1, 0]}}}}}"#,
            "`quantization_config.config_groups.*.weights.block_structure` is [1, 0]: a block side cannot be 0; fix config.json or pass --block-size RxC",
        ),
    ] {
        fp8_model(&src, config);
        let want = format!("{}: {rest}", src.join("config.json").display());
        refused(&cmd("dequant-fp8", &src, &out, &[]), &out, &want);
    }
    // --block-size replaces the broken value.
    convert_ok("dequant-fp8", &src, &out, &["--block-size", "1x4", "-q"]);
    let got = load_all(&out);
    let bf16 = |x: f32| half::bf16::from_f32(x).to_bits().to_le_bytes();
    let want: Vec<u8> = [1.0f32, 1.0, 1.0, 1.0, 2.0, 2.0, 2.0, 2.0]
        .iter()
        .flat_map(|&x| bf16(x))
        .collect();
    assert_eq!(got["w.weight"].2, want);
}

/// An adapter of zero-filled F32 `lora_A` and `lora_B` for `model.q`, and `config` as
/// adapter_config.json.
fn q_adapter(dir: &Path, a: [u64; 2], b: [u64; 2], config: &str) -> PathBuf {
    let zeros = |shape: [u64; 2]| vec![0; (shape[0] * shape[1] * 4) as usize];
    Model::adapter()
        .tensor(
            "base_model.model.model.q.lora_A.weight",
            DType::F32,
            &a,
            zeros(a),
        )
        .tensor(
            "base_model.model.model.q.lora_B.weight",
            DType::F32,
            &b,
            zeros(b),
        )
        .file("adapter_config.json", config)
        .write(dir)
}

/// `merge-lora -i SRC --adapter ADAPTER -o OUT` in `dir`, ADAPTER a [`q_adapter`] of the
/// `lora_A` and `lora_B` shapes `ab` and `config`: [`refused`] with the message
/// `<adapter file>: <rest>`.
fn q_merge_refused(dir: &Path, src: &Path, ab: [[u64; 2]; 2], config: &str, rest: &str) {
    let adapter = q_adapter(&dir.join("adapter"), ab[0], ab[1], config);
    let out = dir.join("out");
    let file = adapter.join("adapter_model.safetensors");
    refused(
        &[
            "merge-lora",
            "-i",
            s(src),
            "--adapter",
            s(&adapter),
            "-o",
            s(&out),
        ],
        &out,
        &format!("{}: {rest}", file.display()),
    );
}

#[test]
fn merge_lora_into_a_base_with_an_input_dimension_of_0_is_refused() {
    let (d, src) = tmp_in();
    Model::new()
        .tensor("model.q.weight", DType::BF16, &[4, 0], vec![])
        .write(&src);
    let adapter = [[2, 0], [4, 2]];
    q_merge_refused(
        d.path(),
        &src,
        adapter,
        r#"{"r": 2, "lora_alpha": 4}"#,
        "`model.q`: base weight `model.q.weight` is [4, 0] with rank 2: an empty matrix or a rank of 0 leaves nothing to merge; exclude the module from the adapter",
    );
}

#[test]
fn a_thread_that_cannot_start_is_an_error_not_a_panic() {
    let d = tmp();
    let f = d.path().join("m.safetensors");
    write_file(&f, &[t("w", DType::BF16, &[2], vec![0; 4])]);
    let out = d.path().join("out");
    // A stack no machine can map makes every thread start fail.
    let o = tftf_env(
        &cmd("passthrough", &f, &out, &["--threads", "1"]),
        &[("RUST_MIN_STACK", "100000000000000")],
    );
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
    let err = stderr(&o);
    assert!(
        err.starts_with("error: cannot start the reader thread: ")
            && err.trim_end().ends_with("; lower --threads or free memory"),
        "{err}"
    );
    assert!(!out.exists(), "output left behind");
}

/// An FP8 weight `[2, 2]` with one F32 scale stored as `scale_name`.
fn scaled_model(dir: &Path, codes: [u8; 4], scale_name: &str, scale: f32) {
    std::fs::create_dir_all(dir).unwrap();
    Model::new()
        .tensor("w.weight", DType::F8_E4M3, &[2, 2], codes.to_vec())
        .tensor(scale_name, DType::F32, &[], f32_bytes(&[scale]))
        .write(dir);
}

#[test]
fn scale_mode_divide_by_a_zero_scale_is_refused_unless_allowed() {
    let (d, src) = tmp_in();
    let out = d.path().join("out");
    scaled_model(&src, [0x00, 0x38, 0x38, 0x38], "w.weight_scale", 0.0);
    let args = cmd("dequant-fp8", &src, &out, &["--scale-mode", "divide"]);
    refused(
        &args,
        &out,
        &format!(
            "{}: tensor `w.weight`: result at [0, 0] is not finite: code 0x00 (0) divided by scale 0.0 is a division by zero; pass --allow-nonfinite to keep it",
            src.join("model.safetensors").display()
        ),
    );
    let mut allowed = args.to_vec();
    allowed.extend(["--allow-nonfinite", "-q", "--dtype", "f32"]);
    tftf_ok(&allowed);
    // 0/0 is the canonical NaN, 1/0 is +inf.
    let inf = f32::INFINITY.to_bits();
    let want: Vec<u8> = [0x7FC0_0000u32, inf, inf, inf]
        .iter()
        .flat_map(|b| b.to_le_bytes())
        .collect();
    assert_eq!(load_all(&out)["w.weight"].2, want);
}

#[test]
fn a_product_that_overflows_f32_or_the_output_dtype_is_refused() {
    let (d, src) = tmp_in();
    let out = d.path().join("out");
    let file = src.join("model.safetensors");
    // 448 × 1e38 overflows f32 itself.
    scaled_model(&src, [0x38, 0x38, 0x7E, 0x38], "w.weight_scale_inv", 1e38);
    refused(
        &cmd("dequant-fp8", &src, &out, &[]),
        &out,
        &format!(
            "{}: tensor `w.weight`: result at [1, 0] is not finite: code 0x7e (448) times scale 1e38 overflows BF16; pass --allow-nonfinite to keep it",
            file.display()
        ),
    );
    // 448 × 1000 fits f32 and BF16 but not F16 (max 65504).
    scaled_model(&src, [0x38, 0x7E, 0x38, 0x38], "w.weight_scale_inv", 1000.0);
    refused(
        &cmd("dequant-fp8", &src, &out, &["--dtype", "f16"]),
        &out,
        &format!(
            "{}: tensor `w.weight`: result at [0, 1] is not finite: code 0x7e (448) times scale 1000.0 overflows F16; pass --allow-nonfinite to keep it",
            file.display()
        ),
    );
    convert_ok("dequant-fp8", &src, &out, &["-q"]);
    std::fs::remove_dir_all(&out).unwrap();
    // 65504 × 2 with a multiply by 65520 that rounds up to infinity in F16 (the largest finite
    // F16 is 65504; 65520 is the tie that rounds to infinity).
    scaled_model(
        &src,
        [0x38, 0x38, 0x38, 0x38],
        "w.weight_scale_inv",
        65520.0,
    );
    refused(
        &cmd("dequant-fp8", &src, &out, &["--dtype", "f16"]),
        &out,
        &format!(
            "{}: tensor `w.weight`: result at [0, 0] is not finite: code 0x38 (1) times scale 65520.0 overflows F16; pass --allow-nonfinite to keep it",
            file.display()
        ),
    );
    convert_ok(
        "dequant-fp8",
        &src,
        &out,
        &["--dtype", "f16", "--allow-nonfinite", "-q"],
    );
    assert_eq!(load_all(&out)["w.weight"].2, [0x00, 0x7C].repeat(4));
}

#[test]
fn modules_to_save_replacing_an_fp8_base_tensor_is_copied_not_cast() {
    let (d, src) =
        tmp_model(Model::new().tensor("lm_head.weight", DType::F8_E4M3, &[2, 2], vec![0x38; 4]));
    let adapter = d.path().join("adapter");
    std::fs::create_dir_all(&adapter).unwrap();
    let replacement = vec![1, 2, 3, 4, 5, 6, 7, 8];
    Model::adapter()
        .tensor(
            "base_model.model.lm_head.weight",
            DType::BF16,
            &[2, 2],
            replacement.clone(),
        )
        .file(
            "adapter_config.json",
            r#"{"r": 2, "lora_alpha": 4, "modules_to_save": ["lm_head"]}"#,
        )
        .write(&adapter);
    let out = d.path().join("out");
    tftf_ok(&[
        "merge-lora",
        "-i",
        s(&src),
        "--adapter",
        s(&adapter),
        "-o",
        s(&out),
        "-q",
    ]);
    let got = load_all(&out);
    assert_eq!(got["lm_head.weight"].0, "BF16");
    assert_eq!(got["lm_head.weight"].2, replacement);
}

/// One shard holding `n` one-byte tensors; returns its path and header length.
fn many_tiny_tensors(dir: &Path, n: usize) -> (std::path::PathBuf, u64) {
    let mut json = String::from(r#"{"__metadata__":{"format":"pt"}"#);
    for i in 0..n {
        json.push_str(&format!(
            r#","model.layers.{}.experts.{}.w":{{"dtype":"U8","shape":[1],"data_offsets":[{i},{}]}}"#,
            i / 10_000,
            i % 10_000,
            i + 1
        ));
    }
    json.push('}');
    let bytes = raw_safetensors(&json, &vec![0; n]);
    let path = dir.join("model.safetensors");
    std::fs::write(&path, bytes).unwrap();
    (path, json.len() as u64)
}

#[test]
fn a_plan_over_half_the_memory_budget_is_refused_naming_both() {
    let d = tmp();
    let (src, _) = many_tiny_tensors(d.path(), 30_000);
    let ckpt = tftf::Checkpoint::open(&src).unwrap();
    let plan = tftf::Plan::build(&ckpt, &[]).unwrap();
    let sink = tftf::sink::Safetensors {
        kind: tftf::sink::OutputKind::Dir,
        max_shard_bytes: None,
    };
    let layout = tftf::sink::Sink::layout(&sink, &ckpt, &plan, false).unwrap();
    let needed = plan.state_bytes(&ckpt) + layout.header_bytes();
    assert!(needed > 8 << 20 && needed < 16 << 20, "{needed}");
    let out = d.path().join("out");
    let human = tftf::size::human;
    refused(
        &cmd("passthrough", &src, &out, &["--memory-budget", "16MiB"]),
        &out,
        &format!(
            "the plan of 30000 tensors holds about {} in memory (names, shapes, headers), more than half of --memory-budget 16.00 MiB; raise --memory-budget to at least {}",
            human(needed),
            human(2 * needed)
        ),
    );
    let budget = format!("{}", 2 * needed);
    passthrough_ok(&src, &out, &["--memory-budget", &budget, "-q"]);
    assert_eq!(load_all(&out).len(), 30_000);
}

#[test]
fn planning_a_header_of_200k_tiny_tensors_stays_within_10x_its_size() {
    let d = tmp();
    let (src, header) = many_tiny_tensors(d.path(), 200_000);
    let report = d.path().join("report.json");
    let out = d.path().join("out");
    passthrough_ok(
        &src,
        &out,
        &[
            "--dry-run",
            "-q",
            "--memory-budget",
            "1GiB",
            "--report",
            s(&report),
        ],
    );
    let r: serde_json::Value = serde_json::from_slice(&std::fs::read(&report).unwrap()).unwrap();
    let peak = r["peak_rss_bytes"].as_u64().unwrap();
    // A JSON value tree of the header, two copies of every name and a per-tensor map took
    // 20x the header (1.84 GB for a 91 MB header of a million tensors).
    assert!(
        peak < 10 * header,
        "peak RSS {peak} for a header of {header} bytes"
    );
}

#[test]
fn a_lora_scale_that_is_not_a_finite_f32_is_refused() {
    let (d, src) =
        tmp_model(Model::new().tensor("model.q.weight", DType::F32, &[2, 2], vec![0; 16]));
    let config = r#"{"r": 1, "lora_alpha": 1e300}"#;
    q_merge_refused(d.path(), &src, [[1, 2], [2, 1]], config, "`model.q`: the merge scale (lora_alpha / r, times --scale) is 1e300 x 1.0, which is not a finite f32; fix adapter_config.json");
}

#[test]
fn dequantising_an_empty_weight_of_2_pow_40_rows_finishes_at_once() {
    let (d, src) = tmp_in();
    Model::new()
        .tensor("w.weight", DType::F8_E4M3, &[1 << 40, 0], vec![])
        .tensor("w.weight_scale_inv", DType::F32, &[], f32_bytes(&[1.0]))
        .write(&src);
    let out = d.path().join("out");
    // It used to walk 2^40 empty rows chunk by chunk: stop it rather than hang the suite.
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_tftf"))
        .args(cmd("dequant-fp8", &src, &out, &["-q"]))
        .spawn()
        .unwrap();
    let started = std::time::Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if started.elapsed().as_secs() >= 20 {
            child.kill().unwrap();
            panic!("still running after {:?}", started.elapsed());
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    };
    assert!(status.success());
    let got = load_all(&out);
    assert_eq!(got["w.weight"], ("BF16".into(), vec![1 << 40, 0], vec![]));
}
