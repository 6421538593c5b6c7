//! `tftf dequant` on checkpoints made by the real libraries (tests/fixtures/quant, made by its
//! generate.py): every output tensor equals the library's own decompression byte for byte,
//! activation/KV-cache scales and hf_quant_config.json are gone with quantization_config, and
//! every bad input fails naming the tensor, with no output left behind.

mod common;

use std::path::Path;

use common::*;
use tftf::format::dtype::DType;

const CASES: [&str; 16] = [
    "ct_nvfp4a16",
    "ct_nvfp4",
    "ct_mxfp4a16",
    "ct_mxfp8a16",
    "ct_w4a16",
    "ct_w8a16",
    "ct_w3a16",
    "gpt_oss_mxfp4",
    "modelopt_nvfp4",
    "ct_w4a16_asym",
    "ct_w8a16_asym",
    "ct_w3a16_asym",
    "gptq_w4_act_order",
    "gptq_w8_v2",
    "modelopt_mxfp4",
    "modelopt_fp8_pb_wo",
];

/// Runs `tftf <cmd> -i <case>/model -o out` and checks the output against the library's.
fn dequant_matches(cmd: &str, case: &str, extra: &[&str]) -> tempfile::TempDir {
    let (dir, out) = tmp_out();
    let model = fixture(&format!("quant/{case}/model"));
    convert_ok(cmd, &model, &out, &[&["-q"][..], extra].concat());
    let got = load_all(&out);
    let want = load_all(&fixture(&format!("quant/{case}/expected.safetensors")));
    assert_same_tensors(case, &got, &want, |name, _, gb, bytes| {
        if gb != bytes {
            let first = gb.iter().zip(bytes).position(|(a, b)| a != b).unwrap();
            panic!("{case}: `{name}` differs from the library's decompression at byte {first}");
        }
    });
    let cfg = read_json(&out.join("config.json"));
    assert!(cfg.get("quantization_config").is_none(), "{case}: {cfg}");
    assert!(!out.join("hf_quant_config.json").exists(), "{case}");
    dir
}

#[test]
fn every_scheme_equals_the_library_decompression() {
    for case in CASES {
        dequant_matches("dequant", case, &[]);
    }
}

#[test]
fn dequant_fp8_is_an_alias_with_its_options() {
    dequant_matches("dequant-fp8", "ct_nvfp4", &["--scale-mode", "multiply"]);
    dequant_matches("dequant-fp8", "ct_mxfp8a16", &["--allow-nonfinite"]);
}

#[test]
fn chunking_and_threads_never_change_a_byte() {
    for case in [
        "gpt_oss_mxfp4",
        "ct_nvfp4a16",
        "ct_w3a16",
        "ct_w3a16_asym",
        "gptq_w4_act_order",
    ] {
        dequant_matches("dequant", case, &["--threads", "3"]);
    }
}

#[test]
fn f32_output_is_the_same_values_unrounded() {
    let (_dir, out) = tmp_out();
    let model = fixture("quant/ct_mxfp4a16/model");
    convert_ok("dequant", &model, &out, &["--dtype", "f32", "-q"]);
    let got = load_all(&out);
    let want = load_all(&fixture("quant/ct_mxfp4a16/expected.safetensors"));
    // MXFP4 values are exact in BF16, so the F32 output rounds to the library's BF16 bit for bit.
    let name = "model.layers.0.mlp.up_proj.weight";
    let (d, _, b) = &got[name];
    assert_eq!(d, "F32");
    let as_bf16: Vec<u8> = b
        .chunks_exact(4)
        .flat_map(|c| ((u32::from_le_bytes(c.try_into().unwrap()) >> 16) as u16).to_le_bytes())
        .collect();
    assert_eq!(as_bf16, want[name].2);
}

#[test]
fn activation_and_kv_scales_are_dropped_and_reported() {
    let (dir, out) = tmp_out();
    let report = dir.path().join("report.json");
    let model = fixture("quant/modelopt_nvfp4/model");
    convert_ok("dequant", &model, &out, &["--report", s(&report), "-q"]);
    let r = read_json(&report);
    let notes = r["notes"].to_string();
    for dropped in [
        "model.layers.0.self_attn.k_scale",
        "model.layers.0.self_attn.v_scale",
        "model.layers.0.mlp.down_proj.input_scale",
    ] {
        assert!(notes.contains(dropped), "{dropped} not in {notes}");
    }
    assert_mentions(&notes, &["ModelOpt NVFP4: 2 weights decoded"]);
}

/// Runs `dequant -i MODEL -o OUT`, expects exit 1 and no `OUT`; returns stderr.
fn refused(model: &Path, out: &Path) -> String {
    let err = fails(&cmd("dequant", model, out, &[]));
    assert!(!out.exists(), "output left behind: {err}");
    err
}

/// Writes `config.json` saying `{"quantization_config": CONFIG}` into `model`, then
/// [`refused`] into `dir/out`; asserts the message names every one of `needles`.
fn refused_under_config(model: &Path, dir: &Path, config: &str, needles: &[&str]) {
    let cfg = format!(r#"{{"quantization_config": {config}}}"#);
    std::fs::write(model.join("config.json"), cfg).unwrap();
    assert_mentions(&refused(model, &dir.join("out")), needles);
}

/// [`refused`] on `case` with the tensor `name` edited by `edit`, in a new temporary folder.
fn edited_refused(case: &str, name: &str, edit: impl Fn(&mut T)) -> String {
    let dir = tmp();
    let model = edited_tensor(case, dir.path(), name, edit);
    refused(&model, &dir.path().join("out"))
}

/// [`edited_model`] with `edit` applied to the tensor `name` only.
fn edited_tensor(case: &str, dir: &Path, name: &str, edit: impl Fn(&mut T)) -> std::path::PathBuf {
    edited_model(case, dir, |ts| {
        edit(ts.iter_mut().find(|t| t.0 == name).unwrap())
    })
}

/// Copies a fixture's model into `dir`, rewriting its tensors through `edit`.
fn edited_model(case: &str, dir: &Path, edit: impl Fn(&mut Vec<T>)) -> std::path::PathBuf {
    let src = fixture(&format!("quant/{case}/model"));
    let dst = dir.join("model");
    std::fs::create_dir_all(&dst).unwrap();
    for f in ["config.json", "hf_quant_config.json"] {
        if src.join(f).exists() {
            std::fs::copy(src.join(f), dst.join(f)).unwrap();
        }
    }
    let mut tensors: Vec<T> = load_all(&src.join("model.safetensors"))
        .into_iter()
        .map(|(name, (dtype, shape, bytes))| {
            let shape: Vec<u64> = shape.iter().map(|&d| d as u64).collect();
            t(&name, dtype.parse::<DType>().unwrap(), &shape, bytes)
        })
        .collect();
    edit(&mut tensors);
    write_file(&dst.join("model.safetensors"), &tensors);
    dst
}

#[test]
fn a_missing_scale_names_the_weight_and_the_scale() {
    let dir = tmp();
    for (case, gone, weight) in [
        (
            "ct_nvfp4a16",
            "model.layers.0.mlp.down_proj.weight_global_scale",
            "model.layers.0.mlp.down_proj.weight_packed",
        ),
        (
            "gpt_oss_mxfp4",
            "model.layers.0.mlp.experts.down_proj_scales",
            "model.layers.0.mlp.experts.down_proj_blocks",
        ),
        (
            "ct_w4a16",
            "model.layers.0.mlp.down_proj.weight_shape",
            "model.layers.0.mlp.down_proj.weight_packed",
        ),
        (
            "modelopt_nvfp4",
            "model.layers.0.self_attn.k_proj.weight_scale_2",
            "model.layers.0.self_attn.k_proj.weight",
        ),
        (
            "modelopt_mxfp4",
            "model.layers.0.mlp.down_proj.weight_scale",
            "model.layers.0.mlp.down_proj.weight",
        ),
        (
            "ct_mxfp8a16",
            "model.layers.0.mlp.up_proj.weight_scale",
            "model.layers.0.mlp.up_proj.weight",
        ),
        (
            "gptq_w4_act_order",
            "model.layers.0.mlp.down_proj.qzeros",
            "model.layers.0.mlp.down_proj.qweight",
        ),
    ] {
        let case_dir = dir.path().join(case);
        let model = edited_model(case, &case_dir, |ts| ts.retain(|t| t.0 != gone));
        let err = refused(&model, &case_dir.join("out"));
        assert!(
            err.contains(&format!("quantised weight `{weight}` has no scale"))
                && err.contains(&format!("`{gone}`")),
            "{case}: {err}"
        );
        assert!(!err.contains("--allow-unscaled-fp8"), "{case}: {err}");
    }
}

#[test]
fn a_layout_the_config_does_not_name_is_an_error_naming_the_tensor() {
    let dir = tmp();
    let model = edited_model("ct_nvfp4a16", dir.path(), |_| {});
    refused_under_config(
        &model,
        dir.path(),
        r#"{"quant_method": "fp8", "weight_block_size": [128, 128]}"#,
        &[
            "model.layers.0.mlp.down_proj.weight_packed",
            "compressed-tensors NVFP4",
            "quant_method `fp8`",
        ],
    );
}

/// Issue #24 item 5: FP8 block weights in a checkpoint whose config says NVFP4, MXFP4 or GPTQ
/// are refused (naming the FP8 tensor and the config), not decoded as if the config said `fp8`.
#[test]
fn fp8_weights_the_config_does_not_name_are_refused() {
    let dir = tmp();
    let fp8 = "model.layers.0.mlp.extra_proj.weight";
    // An FP8 weight [4, 8] of `dtype` (finite codes 0..32) with a DeepSeek-V3 scale of 1.
    let with_fp8 = |case: &str, dtype: DType| {
        edited_model(case, &dir.path().join(case), |ts| {
            ts.push(t(fp8, dtype, &[4, 8], (0..32).collect()));
            let one = 1f32.to_le_bytes().to_vec();
            ts.push(t(&format!("{fp8}_scale_inv"), DType::F32, &[1, 1], one));
        })
    };
    for (case, method) in [
        (
            "ct_nvfp4a16",
            "quant_method `compressed-tensors` with nvfp4-pack-quantized",
        ),
        ("gptq_w4_act_order", "quant_method `gptq`"),
        ("modelopt_nvfp4", "quant_method `modelopt` with nvfp4"),
        ("gpt_oss_mxfp4", "quant_method `mxfp4`"),
    ] {
        let model = with_fp8(case, DType::F8_E4M3);
        let err = refused(&model, &dir.path().join(case).join("out"));
        assert_mentions(
            &err,
            &[&format!("`{fp8}`"), "an FP8 (F8_E4M3) weight", method],
        );
    }
    // Where the config names FP8 (ModelOpt's FP8 blocks), the same kind of weight decodes.
    let model = with_fp8("modelopt_fp8_pb_wo", DType::F8_E5M2);
    let out = dir.path().join("out");
    convert_ok("dequant", &model, &out, &["-q"]);
    assert_eq!(load_all(&out)[fp8].0, "BF16");
}

/// Issue #24: FP8 weights with float scales are not decoded when the config says the
/// checkpoint is something else (GPTQ, ModelOpt NVFP4, compressed-tensors NVFP4): the README
/// promises an error naming the tensor when config and tensors disagree.
#[test]
fn fp8_weights_under_a_non_fp8_config_are_an_error_naming_the_tensor() {
    for (config, says) in [
        (
            r#"{"quant_method": "gptq", "bits": 4, "group_size": 128}"#,
            "quant_method `gptq`",
        ),
        (
            r#"{"quant_method": "modelopt", "quant_algo": "NVFP4"}"#,
            "quant_method `modelopt` with nvfp4",
        ),
        (
            r#"{"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized"}"#,
            "with nvfp4-pack-quantized",
        ),
    ] {
        let dir = tmp();
        let model = edited_model("modelopt_fp8_pb_wo", dir.path(), |_| {});
        std::fs::remove_file(model.join("hf_quant_config.json")).unwrap();
        refused_under_config(
            &model,
            dir.path(),
            config,
            &[
                "model.layers.0.mlp.down_proj.weight",
                "an FP8 (F8_E4M3) weight",
                says,
            ],
        );
    }
}

#[test]
fn a_model_with_nothing_to_decode_is_an_error() {
    let dir = tmp();
    let mut rng = Rng(3);
    let model = Model::new()
        .rand(&mut rng, "model.norm.weight", DType::BF16, &[64])
        .rand(&mut rng, "lm_head.weight", DType::BF16, &[8, 64])
        .write(&dir.path().join("model"));
    let out = dir.path().join("out");
    let err = refused(&model, &out);
    assert_mentions(&err, &["nothing to dequantise", "--allow-empty"]);
    convert_ok("dequant", &model, &out, &["--allow-empty", "-q"]);
}

#[test]
fn a_scale_of_the_wrong_shape_is_refused() {
    let scale = "model.layers.0.mlp.up_proj.weight_scale";
    let err = edited_refused("ct_mxfp4a16", scale, |t| t.2 = vec![32, 2]);
    assert_mentions(&err, &[&format!("scale `{scale}`"), "[16, 4]"]);
}

#[test]
fn a_zero_point_of_the_wrong_shape_is_refused_naming_it() {
    let zp = "model.layers.0.mlp.down_proj.weight_zero_point";
    let err = edited_refused("ct_w4a16_asym", zp, |t| t.2 = vec![2, 5]);
    assert!(err.contains(zp) && err.contains("I32 [5, 2]"), "{err}");
}

#[test]
fn a_gptq_group_index_outside_the_scales_is_an_error_naming_the_weight() {
    let g_idx = "model.layers.0.self_attn.o_proj.g_idx";
    let err = edited_refused("gptq_w4_act_order", g_idx, |t| {
        t.3[..4].copy_from_slice(&9i32.to_le_bytes())
    });
    assert_mentions(&err, &["model.layers.0.self_attn.o_proj", "g_idx[0] is 9"]);
}

#[test]
fn gptq_bits_that_disagree_with_the_packing_are_refused() {
    let dir = tmp();
    let model = edited_model("gptq_w8_v2", dir.path(), |_| {});
    let cfg = model.join("config.json");
    let text = std::fs::read_to_string(&cfg).unwrap();
    std::fs::write(&cfg, text.replace("\"bits\": 8", "\"bits\": 4")).unwrap();
    let err = fails(&cmd("dequant", &model, &dir.path().join("out"), &[]));
    assert_mentions(
        &err,
        &["qweight", "8-bit codes but config.json says bits 4"],
    );
    assert!(!err.contains("--allow-unscaled-fp8"), "{err}");
}

#[test]
fn keep_kv_scales_keeps_k_and_v_scales_and_the_kv_cache_scheme() {
    let (dir, out) = tmp_out();
    let model = fixture("quant/modelopt_nvfp4/model");
    let report = dir.path().join("report.json");
    let extra = ["--keep-kv-scales", "--report", s(&report), "-q"];
    convert_ok("dequant", &model, &out, &extra);
    let report = std::fs::read_to_string(&report).unwrap();
    assert_mentions(
        &report,
        &[
            "kept 2 KV-cache scales (--keep-kv-scales)",
            "model.layers.0.mlp.down_proj.input_scale",
        ],
    );
    let got = load_all(&out);
    let input = load_all(&model.join("model.safetensors"));
    for kv in [
        "model.layers.0.self_attn.k_scale",
        "model.layers.0.self_attn.v_scale",
    ] {
        assert_eq!(got.get(kv), input.get(kv), "{kv}");
    }
    assert!(!got.contains_key("model.layers.0.mlp.down_proj.input_scale"));
    let cfg = read_json(&out.join("config.json"));
    assert_eq!(
        cfg["quantization_config"],
        serde_json::json!({
            "quant_method": "modelopt",
            "kv_cache_scheme": {"dynamic": false, "num_bits": 8, "type": "float"}
        })
    );
    assert!(!out.join("hf_quant_config.json").exists());
}
