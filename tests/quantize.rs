//! `tftf quantize` against llm-compressor itself (tests/fixtures/quantize, made by its
//! generate.py with llm-compressor 0.14.0.1 / compressed-tensors 0.20.1): for every preset the
//! output holds the same tensors as `oneshot` + `save_pretrained(save_compressed=True)`, byte
//! for byte, and the same config.json (no field is excluded: `quantization_config.version` is
//! the compressed-tensors version whose layout tftf writes). Bad requests fail naming the
//! tensor, with nothing left behind.

mod common;

use std::path::{Path, PathBuf};

use common::*;
use tftf::format::dtype::DType;

/// The input the library quantised for `case`: int schemes need columns that 128 divides.
fn input_of(case: &str) -> PathBuf {
    let name = if case.starts_with('W') && case != "W4A16_ignore" {
        "input_even"
    } else {
        "input"
    };
    fixture(&format!("quantize/{name}"))
}

/// The arguments `quantize -i INPUT -o OUT --scheme SCHEME EXTRA...`.
fn quantize_args<'a>(
    scheme: &'a str,
    input: &'a Path,
    out: &'a Path,
    extra: &[&'a str],
) -> Vec<&'a str> {
    let args = ["quantize", "-i", s(input), "-o", s(out), "--scheme", scheme];
    [&args[..], extra].concat()
}

/// Runs `tftf quantize -i INPUT -o OUT --scheme SCHEME -q EXTRA...`, any exit.
fn quantize(scheme: &str, input: &Path, out: &Path, extra: &[&str]) -> std::process::Output {
    let quiet = [&["-q"][..], extra].concat();
    tftf(&quantize_args(scheme, input, out, &quiet))
}

/// [`quantize`], asserting success.
fn quantize_ok(scheme: &str, input: &Path, out: &Path, extra: &[&str]) {
    ok(&quantize(scheme, input, out, extra));
}

/// Runs `quantize` as [`quantize`] does, expects exit 1 and returns stderr.
fn quantize_fails(scheme: &str, input: &Path, out: &Path, extra: &[&str]) -> String {
    let o = quantize(scheme, input, out, extra);
    assert_eq!(o.status.code(), Some(1), "expected failure: {}", stderr(&o));
    stderr(&o)
}

/// [`quantize_fails`], and asserts that `out` was not made (or was removed).
fn refused(scheme: &str, input: &Path, out: &Path, extra: &[&str]) -> String {
    let err = quantize_fails(scheme, input, out, extra);
    assert!(!out.exists(), "{scheme}: output left behind: {err}");
    err
}

/// `quantize -i INPUT -o OUT --scheme SCHEME EXTRA...` into a new temporary folder: a usage
/// error (exit 2) with no `OUT`; returns stderr.
fn usage_refused(scheme: &str, input: &Path, extra: &[&str]) -> String {
    let (_dir, out) = tmp_out();
    let err = usage_error(&quantize_args(scheme, input, &out, extra));
    assert!(!out.exists(), "{scheme}: output left behind: {err}");
    err
}

/// Quantises the fixture input of `scheme` ([`input_of`]) with `EXTRA` into `out` in a new
/// temporary folder, asserting success: (folder, `out`).
fn quantized(scheme: &str, extra: &[&str]) -> (tempfile::TempDir, PathBuf) {
    let (dir, out) = tmp_out();
    quantize_ok(scheme, &input_of(scheme), &out, extra);
    (dir, out)
}

/// Panics naming `case`, `name`, how many bytes differ from `whose` and where first, unless
/// `got` and `want` are equal.
fn assert_same_bytes(case: &str, name: &str, got: &[u8], want: &[u8], whose: &str) {
    if got != want {
        let n = got.iter().zip(want).filter(|(a, b)| a != b).count();
        let first = got.iter().zip(want).position(|(a, b)| a != b).unwrap();
        panic!("{case}: `{name}`: {n} bytes differ from {whose}, first at {first}");
    }
}

/// Asserts that `out`'s config.json equals `want_dir`'s (its `quantization_config` first);
/// returns both, parsed.
fn assert_same_config(
    case: &str,
    out: &Path,
    want_dir: &Path,
) -> (serde_json::Value, serde_json::Value) {
    let got_cfg = read_json(&out.join("config.json"));
    let want_cfg = read_json(&want_dir.join("config.json"));
    assert_eq!(
        got_cfg["quantization_config"], want_cfg["quantization_config"],
        "{case}: quantization_config"
    );
    assert_eq!(got_cfg, want_cfg, "{case}: config.json");
    (got_cfg, want_cfg)
}

/// Asserts `out` holds exactly the library's tensors and config.json for `case`.
fn assert_matches_library(case: &str, out: &Path) {
    let want_dir = fixture(&format!("quantize/{case}"));
    let got = load_all(out);
    let want = load_all(&want_dir.join("model.safetensors"));
    assert_same_tensors(case, &got, &want, |name, _, gb, bytes| {
        assert_same_bytes(case, name, gb, bytes, "llm-compressor's")
    });
    assert_same_config(case, out, &want_dir);
}

#[test]
fn every_preset_equals_llm_compressor_byte_for_byte() {
    for scheme in SCHEMES {
        let (_dir, out) = quantized(scheme, &[]);
        assert_matches_library(scheme, &out);
    }
}

#[test]
fn output_does_not_depend_on_threads_chunks_or_shards() {
    // Small shards and a budget that splits weights into several chunks: FP8_BLOCK must keep
    // 128-row blocks whole, NVFP4's tensor scales come from the whole group, and ModelOpt's
    // W4A16 packs two rows a byte (row pairs kept whole). Both formats.
    for modelopt in [false, true] {
        for scheme in ["FP8_BLOCK", "NVFP4A16", "W4A16"] {
            let mut extra = vec![
                "--threads",
                "3",
                "--max-shard-size",
                "300KB",
                "--memory-budget",
                "64MiB",
                "--checksums",
            ];
            if modelopt {
                extra.extend(["--format", "modelopt"]);
            }
            let (_dir, out) = quantized(scheme, &extra);
            assert!(
                out.join("model.safetensors.index.json").exists(),
                "{scheme}: sharded"
            );
            if modelopt {
                assert_checksummed_modelopt(scheme, &out);
            } else {
                assert_matches_library(scheme, &out);
            }
        }
    }
}

#[test]
fn ignore_rules_match_llm_compressor_ignore_list() {
    // W4A16 cannot take the 320-column down_proj; ignoring it as llm-compressor spells it
    // (`re:`) quantises the rest, and the ignore list names it before lm_head, as the library.
    let (dir, out) = tmp_out();
    let input = input_of("W4A16_ignore");
    quantize_ok("W4A16", &input, &out, &["--ignore", "re:.*down_proj$"]);
    assert_matches_library("W4A16_ignore", &out);
    // A glob on the tensor name does the same.
    let out2 = dir.path().join("out2");
    quantize_ok("w4a16", &input, &out2, &["--ignore", "*.down_proj.weight"]);
    assert_eq!(load_all(&out2), load_all(&out));
}

#[test]
fn dry_run_lists_what_is_quantised_and_what_is_left_alone() {
    let (_dir, out) = tmp_out();
    let input = input_of("FP8_BLOCK");
    let o = tftf_ok(&quantize_args("FP8_BLOCK", &input, &out, &["--dry-run"]));
    let text = format!("{}{}", stdout(&o), stderr(&o));
    assert_mentions(&text, &["FP8_BLOCK: 7 Linear weight(s) quantised"]);
    assert_mentions(
        &text,
        &["left unquantised (quantization_config.ignore): lm_head"],
    );
    assert_mentions(
        &text,
        &["left unquantised (not Linear weights): model.embed_tokens.weight"],
    );
    assert!(!out.exists(), "dry run wrote {}", out.display());
}

#[test]
fn unknown_scheme_is_a_usage_error_naming_the_presets() {
    let err = usage_refused("FP8_BLOCKS", &input_of("FP8_BLOCK"), &[]);
    assert!(err.contains("unknown scheme `FP8_BLOCKS`"), "{err}");
    assert_mentions(&err, &["FP8_DYNAMIC, FP8_BLOCK, W8A16, W4A16, NVFP4A16"]);
}

/// Scales that overflow are refused, naming the tensor and the group or block, where the
/// library would write an infinite MX scale (zeroing the group) or NaN FP8 codes.
#[test]
fn scales_that_overflow_are_refused_naming_the_group_or_block() {
    let dir = tmp();
    // F16: a group amax of 60000 rounds up to 2^16, which F16 cannot hold.
    let mut w = vec![0u8; 2 * 64 * 2];
    for i in 0..128 {
        w[2 * i..2 * i + 2].copy_from_slice(&0x3C00u16.to_le_bytes());
    }
    let at = 2 * (64 + 40);
    w[at..at + 2].copy_from_slice(&0x7B53u16.to_le_bytes()); // 60064
    let mx = dir.path().join("mx.safetensors");
    write_file(&mx, &[t("w.weight", DType::F16, &[2, 64], w)]);
    // F32 with every value 1e-37: 448 / amax overflows f32.
    let tiny: Vec<u8> = (0..128 * 128)
        .flat_map(|_| 1e-37f32.to_le_bytes())
        .collect();
    let fp8 = dir.path().join("fp8.safetensors");
    write_file(&fp8, &[t("w.weight", DType::F32, &[128, 128], tiny)]);
    for (input, scheme, extra, want) in [
        (&mx, "MXFP4A16", None, "MX group at [1, 32..64]"),
        (&mx, "MXFP8A16", None, "MX group at [1, 32..64]"),
        (
            &fp8,
            "FP8_BLOCK",
            Some("fp8-native"),
            "128×128 block [0, 0]",
        ),
    ] {
        let out = dir.path().join("out");
        let format: Vec<&str> = extra.map_or(vec![], |f| vec!["--format", f]);
        let err = fails(&quantize_args(scheme, input, &out, &format));
        assert!(
            err.contains("w.weight") && err.contains(want) && err.contains("--ignore"),
            "{scheme}: {err}"
        );
        assert!(!out.exists(), "{scheme}: output left behind");
    }
}

#[test]
fn columns_the_group_size_does_not_divide_are_refused_naming_the_tensor() {
    // llm-compressor refuses W4A16/W8A16 on 320 columns too ("not divisible by group_size").
    for scheme in ["W4A16", "W8A16"] {
        let (_dir, out) = tmp_out();
        let input = fixture("quantize/input");
        let err = refused(scheme, &input, &out, &[]);
        assert!(
            err.contains("model.layers.0.mlp.down_proj.weight")
                && err.contains("320 columns")
                && err.contains("group size 128")
                && err.contains("--ignore 'model.layers.0.mlp.down_proj'"),
            "{scheme}: {err}"
        );
    }
}

#[test]
fn quantised_input_is_refused() {
    for case in ["FP8_BLOCK", "NVFP4A16", "W4A16"] {
        let (_dir, out) = tmp_out();
        let input = fixture(&format!("quantize/{case}"));
        let err = refused("FP8_BLOCK", &input, &out, &[]);
        assert!(err.contains("quantised already"), "{case}: {err}");
    }
    // Without config.json, the tensors give it away.
    let dir = tmp();
    let model = Model::new()
        .tensor("a.weight", DType::F8_E4M3, &[2, 2], vec![0; 4])
        .tensor("a.weight_scale", DType::F32, &[1], f32_bytes(&[1.0]))
        .write(&dir.path().join("m"));
    let err = refused("W8A16", &model, &dir.path().join("out"), &[]);
    assert_mentions(&err, &["`a.weight`", "quantised already"]);
}

#[test]
fn a_failure_while_writing_leaves_no_output() {
    // The NaN is met only when the weight's chunk is computed, after the output was opened.
    let dir = tmp();
    let mut w = vec![0.01f32; 256 * 256];
    w[256 * 200 + 7] = f32::NAN;
    let model = Model::new()
        .tensor(
            "m.a.weight",
            DType::F32,
            &[256, 256],
            f32_bytes(&vec![0.5; 256 * 256]),
        )
        .tensor("m.b.weight", DType::F32, &[256, 256], f32_bytes(&w))
        .write(&dir.path().join("m"));
    for scheme in ["FP8_DYNAMIC", "FP8_BLOCK", "MXFP4A16"] {
        let err = refused(scheme, &model, &dir.path().join("out"), &[]);
        assert!(
            err.contains("m.b.weight") && err.contains("NaN at [200, 7]"),
            "{scheme}: {err}"
        );
    }
    // NVFP4 reads a weight's tensor-scale group when its first chunk is computed: the NaN stops
    // the run there, naming the weight, and the output goes too.
    let err = refused("NVFP4A16", &model, &dir.path().join("out"), &[]);
    assert_mentions(&err, &["m.b.weight", "holds NaN"]);
}

#[test]
fn nothing_to_quantise_is_refused() {
    let dir = tmp();
    let model = Model::new()
        .tensor(
            "lm_head.weight",
            DType::F32,
            &[2, 16],
            f32_bytes(&[1.0; 32]),
        )
        .tensor("norm.weight", DType::F32, &[16], f32_bytes(&[1.0; 16]))
        .write(&dir.path().join("m"));
    let out = dir.path().join("out");
    let err = refused("FP8_DYNAMIC", &model, &out, &[]);
    assert!(err.contains("no Linear weight to quantise"), "{err}");
    // --no-default-ignore takes lm_head too.
    quantize_ok("FP8_DYNAMIC", &model, &out, &["--no-default-ignore"]);
    let got = load_all(&out);
    assert_eq!(got["lm_head.weight"].0, "F8_E4M3");
    assert_eq!(got["lm_head.weight_scale"].1, vec![2, 1]);
}

#[test]
fn fp8_native_equals_transformers_fine_grained_fp8_and_dequantises_back() {
    let (dir, out) = tmp_out();
    let input = fixture("quantize/input_even");
    quantize_ok("FP8_BLOCK", &input, &out, &["--format", "fp8-native"]);
    let got = load_all(&out);
    // transformers' Fp8Quantize output, for every weight it quantises (128 divides both sides).
    let want = load_all(&fixture("quantize/FP8_BLOCK_native/model.safetensors"));
    assert_eq!(want.len(), 10);
    for (name, w) in &want {
        assert_eq!(&got[name], w, "`{name}` differs from transformers'");
    }
    // k/v (64 rows), which transformers leaves alone, get ragged blocks as DeepSeek-V3 has.
    let (d, shape, _) = &got["model.layers.0.self_attn.k_proj.weight_scale_inv"];
    assert_eq!((d.as_str(), shape.as_slice()), ("F32", &[1usize, 2][..]));
    let q = &read_json(&out.join("config.json"))["quantization_config"];
    assert_eq!(q["quant_method"], "fp8");
    assert_eq!(q["weight_block_size"], serde_json::json!([128, 128]));
    assert_eq!(q["modules_to_not_convert"], serde_json::json!(["lm_head"]));
    // tftf dequant reads it as the FP8 block format it is.
    let back = dir.path().join("back");
    tftf_ok(&cmd("dequant", &out, &back, &["-q"]));
    let back = load_all(&back);
    assert_eq!(back["model.layers.0.self_attn.k_proj.weight"].0, "BF16");
    assert!(!back.contains_key("model.layers.0.self_attn.k_proj.weight_scale_inv"));
}

#[test]
fn fp8_native_holds_fp8_block_only() {
    let input = input_of("FP8_DYNAMIC");
    let err = usage_refused("FP8_DYNAMIC", &input, &["--format", "fp8-native"]);
    assert!(err.contains("use --scheme FP8_BLOCK"), "{err}");
}

#[test]
fn quantisers_keep_the_whole_pool_as_their_scratch_is_one_row() {
    // The encoders decode one row at a time into a reused buffer, never a chunk: the pool is
    // not shrunk for them, and chunks stay as large as a plain copy's.
    let budget = "16MiB";
    let pool_of = |args: &[&str], dir: &Path| {
        let report = dir.join("r.json");
        let mut a = args.to_vec();
        a.extend([
            "--threads",
            "2",
            "--memory-budget",
            budget,
            "--report",
            s(&report),
        ]);
        tftf_ok(&a);
        let r = read_json(&report);
        (
            r["pool_bytes"].as_u64().unwrap(),
            r["chunk_bytes"].as_u64().unwrap(),
        )
    };
    for scheme in ["FP8_BLOCK", "NVFP4A16"] {
        let dir = tmp();
        let input = input_of(scheme);
        let out = dir.path().join("out");
        let plain = dir.path().join("plain");
        let copy = pool_of(&cmd("passthrough", &input, &plain, &[]), dir.path());
        let q = pool_of(&quantize_args(scheme, &input, &out, &[]), dir.path());
        // (The plan's own metadata takes a few KB of the budget; a reserve for chunk-sized
        // scratch would take 2 chunks, a quarter of it.)
        assert!(
            q.0 * 100 >= copy.0 * 99 && q.1 * 100 >= copy.1 * 99,
            "{scheme}: (pool, chunk) {q:?} of quantize vs {copy:?} of passthrough"
        );
        assert_matches_library(scheme, &out);
    }
}

#[test]
fn parts_with_another_scheme_are_refused_naming_it() {
    // quantize's arguments are in a partitioned run's fingerprint like every command's.
    let (_dir, out) = quantized("FP8_BLOCK", &["--part", "1/2"]);
    let e = quantize_fails(
        "FP8_DYNAMIC",
        &input_of("FP8_BLOCK"),
        &out,
        &["--part", "2/2"],
    );
    assert!(e.contains("the arguments differ (scheme)"), "{e}");
}

// ---- --format modelopt: NVIDIA ModelOpt 0.47's export_hf_checkpoint (tests/fixtures/quantize/
// modelopt, made by its generate.py: tensors.json holds every tensor's dtype, shape and SHA-256,
// scales.safetensors the scale tensors themselves, dequant.json the SHA-256 of each weight
// dequantised in f32 and rounded once to bf16).

fn sha256_hex(bytes: &[u8]) -> String {
    use sha2::{Digest, Sha256};
    Sha256::digest(bytes)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// Asserts `out` holds exactly ModelOpt's tensors, config.json and hf_quant_config.json.
fn assert_matches_modelopt(case: &str, out: &Path) {
    let want_dir = fixture(&format!("quantize/modelopt/{case}"));
    let got = load_all(out);
    let listing = read_json(&want_dir.join("tensors.json"));
    let want: Vec<&serde_json::Value> = listing.as_array().unwrap().iter().collect();
    let names: Vec<&str> = want.iter().map(|t| t["name"].as_str().unwrap()).collect();
    assert_eq!(
        got.keys().map(String::as_str).collect::<Vec<_>>(),
        names,
        "{case}: tensor names"
    );
    let scales = load_all(&want_dir.join("scales.safetensors"));
    for t in want {
        let name = t["name"].as_str().unwrap();
        let (gd, gs, gb) = &got[name];
        let shape: Vec<usize> = t["shape"]
            .as_array()
            .unwrap()
            .iter()
            .map(|d| d.as_u64().unwrap() as usize)
            .collect();
        assert_eq!(
            (gd.as_str(), gs),
            (t["dtype"].as_str().unwrap(), &shape),
            "{case}: `{name}` dtype and shape"
        );
        if let Some((_, _, bytes)) = scales.get(name) {
            assert_same_bytes(case, name, gb, bytes, "ModelOpt's");
        }
        assert_eq!(
            sha256_hex(gb),
            t["sha256"].as_str().unwrap(),
            "{case}: `{name}` differs from ModelOpt's"
        );
    }
    let (got_cfg, want_cfg) = assert_same_config(case, out, &want_dir);
    let keys = |v: &serde_json::Value| -> Vec<String> {
        v["quantization_config"]
            .as_object()
            .unwrap()
            .keys()
            .cloned()
            .collect()
    };
    assert_eq!(keys(&got_cfg), keys(&want_cfg), "{case}: key order");
    assert_eq!(
        std::fs::read_to_string(out.join("hf_quant_config.json")).unwrap(),
        std::fs::read_to_string(want_dir.join("hf_quant_config.json")).unwrap(),
        "{case}: hf_quant_config.json, byte for byte"
    );
}

/// [`assert_matches_modelopt`], and SHA256SUMS lists the generated hf_quant_config.json.
fn assert_checksummed_modelopt(scheme: &str, out: &Path) {
    assert!(
        std::fs::read_to_string(out.join("SHA256SUMS"))
            .unwrap()
            .contains("hf_quant_config.json"),
        "{scheme}: the generated file is in the checksums"
    );
    assert_matches_modelopt(scheme, out);
}

#[test]
fn modelopt_format_equals_modelopt_export_byte_for_byte() {
    for scheme in MODELOPT_SCHEMES {
        let (_dir, out) = quantized(scheme, &["--format", "modelopt"]);
        assert_matches_modelopt(scheme, &out);
    }
}

#[test]
fn modelopt_exclude_modules_summarise_an_ignored_subtree_as_modelopt_does() {
    // ModelOpt with '*mlp*' disabled lists `model.layers.0.mlp*`, not the three projections.
    let (_dir, out) = quantized(
        "FP8_BLOCK",
        &["--format", "modelopt", "--ignore", "*.mlp.*"],
    );
    assert_matches_modelopt("FP8_BLOCK_ignore_mlp", &out);
}

#[test]
fn modelopt_output_dequantises_to_modelopts_own_values() {
    for scheme in MODELOPT_SCHEMES {
        let (dir, out) = quantized(scheme, &["--format", "modelopt"]);
        let back = dir.path().join("back");
        tftf_ok(&cmd("dequant", &out, &back, &["-q"]));
        let got = load_all(&back);
        let want = read_json(&fixture(&format!(
            "quantize/modelopt/{scheme}/dequant.json"
        )));
        let want = want.as_object().unwrap();
        assert_eq!(want.len(), 7, "{scheme}");
        for (name, digest) in want {
            let (d, _, bytes) = &got[name];
            assert_eq!(d, "BF16", "{scheme}: `{name}`");
            assert_eq!(
                sha256_hex(bytes),
                digest.as_str().unwrap(),
                "{scheme}: `{name}` dequantised differs from ModelOpt's values"
            );
        }
        assert!(
            !got.keys().any(|n| n.contains("weight_scale")),
            "{scheme}: scales left behind"
        );
        assert!(read_json(&back.join("config.json"))
            .get("quantization_config")
            .is_none());
        assert!(
            !back.join("hf_quant_config.json").exists(),
            "{scheme}: dequant keeps hf_quant_config.json"
        );
    }
}

/// ModelOpt's NVFP4 `weight_scale_2` of an all-zero weight is undefined: refused, naming that
/// weight (found while the group is read inside the pipeline), with nothing left behind.
#[test]
fn modelopt_nvfp4_refuses_an_all_zero_weight_naming_it() {
    let dir = tmp();
    let input = dir.path().join("m.safetensors");
    let ones: Vec<u8> = (0..16 * 32).flat_map(|_| 0x3F80u16.to_le_bytes()).collect();
    write_file(
        &input,
        &[
            t(
                "model.layers.0.self_attn.k_proj.weight",
                DType::BF16,
                &[16, 32],
                vec![0; 1024],
            ),
            t(
                "model.layers.0.self_attn.q_proj.weight",
                DType::BF16,
                &[16, 32],
                ones,
            ),
        ],
    );
    let err = refused(
        "NVFP4A16",
        &input,
        &dir.path().join("out"),
        &["--format", "modelopt"],
    );
    assert_mentions(
        &err,
        &["`model.layers.0.self_attn.k_proj.weight`", "all zeros"],
    );
}

#[test]
fn modelopt_format_refuses_w8a16_naming_the_formats_that_hold_it() {
    let err = usage_refused("W8A16", &input_of("W8A16"), &["--format", "modelopt"]);
    assert!(err.contains("--format modelopt cannot hold W8A16"), "{err}");
    assert!(err.contains("--format compressed-tensors"), "{err}");
}

#[test]
fn modelopt_format_in_parts_stages_hf_quant_config_and_finalizes_the_same_output() {
    for scheme in ["FP8_BLOCK", "NVFP4A16"] {
        let (_dir, out) = tmp_out();
        let extra = ["--format", "modelopt", "--max-shard-size", "300KB"];
        for k in ["2/2", "1/2"] {
            let mut args = extra.to_vec();
            args.extend(["--part", k, "--finalize"]);
            quantize_ok(scheme, &input_of(scheme), &out, &args);
        }
        assert!(!out.join(".tftf-parts").exists(), "{scheme}: finalized");
        assert_checksummed_modelopt(scheme, &out);
    }
}

#[test]
fn modelopt_w4a16_refuses_partial_groups_naming_the_tensor() {
    // ModelOpt's pack_int4_in_uint8 refuses partial 128-blocks ("partial blocks are not
    // supported"): the 320-column down_proj.
    let (_dir, out) = tmp_out();
    let input = fixture("quantize/input");
    let err = refused("W4A16", &input, &out, &["--format", "modelopt"]);
    assert!(err.contains("model.layers.0.mlp.down_proj.weight"), "{err}");
    assert!(err.contains("ModelOpt refuses"), "{err}");
    assert_mentions(&err, &["--ignore 'model.layers.0.mlp.down_proj'"]);
}

#[test]
fn modelopt_dry_run_lists_exclude_modules_and_hf_quant_config() {
    let (_dir, out) = tmp_out();
    let input = input_of("NVFP4A16");
    let o = tftf_ok(&quantize_args(
        "NVFP4A16",
        &input,
        &out,
        &["--format", "modelopt", "--dry-run"],
    ));
    let text = stdout(&o);
    assert_mentions(
        &text,
        &["NVFP4A16: 7 Linear weight(s) quantised (ModelOpt W4A16_NVFP4 format)"],
    );
    assert_mentions(
        &text,
        &["(exclude_modules, embeddings included): lm_head, model.embed_tokens"],
    );
    assert_mentions(&text, &["side files: config.json, hf_quant_config.json"]);
    assert!(!out.exists());
}

/// Every file of `dir` (config.json, shards, index, tokenizer) by name, with its bytes.
fn files_of(dir: &Path) -> Vec<(String, Vec<u8>)> {
    listing(dir)
        .into_iter()
        .map(|n| (n.clone(), std::fs::read(dir.join(&n)).unwrap()))
        .collect()
}

#[test]
fn run_quantize_section_and_api_pipe_equal_the_quantize_command() {
    let input = input_of("W4A16");
    let (_want_dir, want) = quantized("W4A16", &["--format", "compressed-tensors"]);
    let (_dir, run_out) = tmp_out();
    let run = [
        "run",
        "-i",
        s(&input),
        "-o",
        s(&run_out),
        "-q",
        "--quantize",
    ];
    ok(&tftf(&[&run[..], &["--scheme", "W4A16"]].concat()));
    assert_eq!(files_of(&run_out), files_of(&want), "run --quantize");
    let (_dir, api_out) = tmp_out();
    let report = tftf::Pipeline::new(
        tftf::Reader::from_path(&input),
        tftf::Pipe::quantize("W4A16", "compressed-tensors"),
        tftf::Writer::sharded(&api_out),
    )
    .run()
    .unwrap();
    assert!(report.ok());
    assert_eq!(files_of(&api_out), files_of(&want), "Pipe::quantize");
}

#[test]
fn run_quantize_must_be_the_last_and_only_quantize_section() {
    let input = input_of("W4A16");
    let (_dir, out) = tmp_out();
    let (i, o) = (s(&input), s(&out));
    let q = ["--quantize", "--scheme", "W4A16"];
    for after in [&["--dtype-cast", "bf16"][..], &q[..]] {
        let args = [&["run", "-i", i, "-o", o][..], &q[..], after].concat();
        let err = usage_error(&args);
        assert_mentions(
            &err,
            &["--quantize must be the last section, and the only one"],
        );
        assert!(!out.exists(), "output left behind: {err}");
    }
    let err = usage_error(&["run", "-i", i, "-o", o, "--quantize", "--scheme", "W9"]);
    assert_mentions(&err, &["--quantize: ", "W9"]);
    assert!(!out.exists());
}
