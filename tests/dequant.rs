//! `dequant-fp8` end to end: layouts found from names, shapes and config; exact bytes; config
//! rewriting; every bad-input case fails before output exists.

mod common;

use common::*;
use tftf::format::dtype::DType;
use tftf::ops::fp8::codec::{e4m3_to_f32, e5m2_to_f32};

/// Finite E4M3 codes.
fn e4m3_codes(rng: &mut Rng, n: usize) -> Vec<u8> {
    (0..n)
        .map(|_| loop {
            let c = rng.next_u32() as u8;
            if c & 0x7F != 0x7F {
                break c;
            }
        })
        .collect()
}

/// `bf16(f32(w) * s[i/128][j/128])` written directly from the formula.
fn expected_bf16(
    codes: &[u8],
    rows: usize,
    cols: usize,
    scales: &[f32],
    gc: usize,
    br: usize,
    bc: usize,
) -> Vec<u8> {
    let mut out = Vec::with_capacity(rows * cols * 2);
    for i in 0..rows {
        for j in 0..cols {
            let y = e4m3_to_f32(codes[i * cols + j]) * scales[(i / br) * gc + j / bc];
            out.extend(half::bf16::from_f32(y).to_bits().to_le_bytes());
        }
    }
    out
}

const CONFIG: &str = r#"{
  "architectures": ["DeepseekV3ForCausalLM"],
  "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]},
  "torch_dtype": "bfloat16",
  "vocab_size": 100
}
"#;

/// A DeepSeek-V3-style model: ragged 128x128 blocks, the scale in another shard than its weight.
fn v3_model(dir: &std::path::Path) -> (Vec<u8>, Vec<f32>, Vec<u8>) {
    let mut rng = Rng(21);
    let codes = e4m3_codes(&mut rng, 300 * 260);
    let scales: Vec<f32> = (0..9).map(|i| 0.5 + i as f32 * 0.37).collect();
    let norm = rng.f32s(260);
    Model::new()
        .tensor(
            "model.layers.0.mlp.down_proj.weight",
            DType::F8_E4M3,
            &[300, 260],
            codes.clone(),
        )
        .tensor(
            "model.layers.0.input_layernorm.weight",
            DType::F32,
            &[260],
            norm.clone(),
        )
        .shard()
        .tensor(
            "model.layers.0.mlp.down_proj.weight_scale_inv",
            DType::F32,
            &[3, 3],
            f32_bytes(&scales),
        )
        .write(dir);
    std::fs::write(dir.join("config.json"), CONFIG).unwrap();
    (codes, scales, norm)
}

#[test]
fn deepseek_v3_blocks_across_shards_are_bit_exact_and_config_is_rewritten() {
    let (d, src) = tmp_in();
    let (codes, scales, norm) = v3_model(&src);
    let out = d.path().join("out");
    let report = d.path().join("r.json");
    convert_ok("dequant-fp8", &src, &out, &["-q", "--report", s(&report)]);
    let got = load_all(&out);
    assert_eq!(got.len(), 2, "the scale is dropped");
    let w = &got["model.layers.0.mlp.down_proj.weight"];
    assert_eq!(w.0, "BF16");
    assert_eq!(w.1, vec![300, 260]);
    assert_eq!(w.2, expected_bf16(&codes, 300, 260, &scales, 3, 128, 128));
    assert_eq!(
        got["model.layers.0.input_layernorm.weight"].2, norm,
        "untouched tensors are copied"
    );
    let cfg = std::fs::read_to_string(out.join("config.json")).unwrap();
    let v: serde_json::Value = serde_json::from_str(&cfg).unwrap();
    assert!(v.get("quantization_config").is_none(), "{cfg}");
    assert_eq!(v["torch_dtype"], "bfloat16");
    let keys: Vec<&String> = v.as_object().unwrap().keys().collect();
    assert_eq!(keys, ["architectures", "torch_dtype", "vocab_size"]);
    let r: serde_json::Value = read_json(&report);
    assert_eq!(r["ops"][0]["op"], "dequant-fp8 F8_E4M3 -> BF16");
    assert_eq!(r["ops"][0]["tensors"], 1);
    assert_eq!(r["ops"][0]["bytes_in"], 300 * 260);
    assert_eq!(r["ops"][0]["bytes_out"], 300 * 260 * 2);

    // f32 output; dry-run shows the config edit.
    let o = convert_ok(
        "dequant-fp8",
        &src,
        &d.path().join("f32"),
        &["--dtype", "f32", "--dry-run"],
    );
    assert_mentions(&stdout(&o), &["quantization_config removed"]);
    assert_mentions(&stdout(&o), &["torch_dtype \"bfloat16\" -> \"float32\""]);
}

#[test]
fn output_is_identical_across_threads_and_budgets() {
    let (d, src) = tmp_in();
    let mut rng = Rng(4);
    // 8 MiB of FP8 with 128x128 blocks: many chunks under a 16 MiB budget.
    let (rows, cols) = (2048usize, 4096usize);
    let codes = e4m3_codes(&mut rng, rows * cols);
    let scales: Vec<f32> = (0..16 * 32).map(|i| 2f32.powi(i % 9 - 4) * 1.1).collect();
    Model::new()
        .tensor(
            "w.weight",
            DType::F8_E4M3,
            &[rows as u64, cols as u64],
            codes.clone(),
        )
        .tensor(
            "w.weight_scale_inv",
            DType::F32,
            &[16, 32],
            f32_bytes(&scales),
        )
        .indexed()
        .write(&src);
    let mut outs = Vec::new();
    for (i, extra) in [
        ["--threads", "1", "--memory-budget", "16MiB"],
        ["--threads", "2", "--memory-budget", "2GiB"],
    ]
    .iter()
    .enumerate()
    {
        let out = d.path().join(format!("o{i}"));
        let mut args = cmd("dequant-fp8", &src, &out, &["-q", "--block-size", "128"]);
        args.extend(extra.iter());
        tftf_ok(&args);
        outs.push(std::fs::read(out.join("model.safetensors")).unwrap());
    }
    assert_eq!(outs[0], outs[1]);
    assert_eq!(
        load_all(&d.path().join("o0"))["w.weight"].2,
        expected_bf16(&codes, rows, cols, &scales, 32, 128, 128)
    );
}

#[test]
fn missing_and_orphan_scales_fail_before_output() {
    let d = tmp();
    let mut rng = Rng(6);
    let out = d.path().join("out");
    let src = d.path().join("missing");
    Model::new()
        .tensor(
            "a.weight",
            DType::F8_E4M3,
            &[4, 4],
            e4m3_codes(&mut rng, 16),
        )
        .tensor(
            "b.weight",
            DType::F8_E4M3,
            &[4, 4],
            e4m3_codes(&mut rng, 16),
        )
        .write(&src);
    let err = fails(&cmd("dequant-fp8", &src, &out, &[]));
    assert_mentions(
        &err,
        &["model.safetensors: FP8 weight `a.weight` has no scale"],
    );
    assert_mentions(&err, &["`a.weight_scale_inv`", "`a.scale`"]);
    assert_mentions(&err, &["(and 1 more weights)", "--allow-unscaled-fp8"]);
    assert!(!out.exists());
    convert_ok("dequant-fp8", &src, &out, &["-q", "--allow-unscaled-fp8"]);
    let got = load_all(&out);
    assert_eq!(got["a.weight"].0, "BF16");

    let src2 = d.path().join("orphan");
    Model::new()
        .tensor("a.weight", DType::BF16, &[2], vec![0, 0, 0, 0])
        .tensor("a.weight_scale_inv", DType::F32, &[1], f32_bytes(&[1.0]))
        .write(&src2);
    let out2 = d.path().join("out2");
    let err = fails(&cmd("dequant-fp8", &src2, &out2, &[]));
    assert_mentions(
        &err,
        &["scale `a.weight_scale_inv` has no FP8 weight to apply to (expected `a.weight`)"],
    );
    assert!(!out2.exists());
}

#[test]
fn bad_scales_fail_with_the_tensor_named() {
    let d = tmp();
    let mut rng = Rng(7);
    let out = d.path().join("out");
    for (i, (sdtype, sshape, sbytes, needle)) in [
        (
            DType::I32,
            vec![1u64],
            vec![0u8; 4],
            "dtype I32 is not a scale dtype",
        ),
        (DType::F32, vec![7, 3], vec![0u8; 84], "pass --block-size"),
    ]
    .into_iter()
    .enumerate()
    {
        let src = d.path().join(format!("in{i}"));
        Model::new()
            .tensor(
                "w.weight",
                DType::F8_E4M3,
                &[300, 260],
                e4m3_codes(&mut rng, 300 * 260),
            )
            .tensor("w.weight_scale_inv", sdtype, &sshape, sbytes)
            .write(&src);
        let err = fails(&cmd("dequant-fp8", &src, &out, &[]));
        assert_mentions(&err, &["scale `w.weight_scale_inv` of `w.weight`", needle]);
        assert!(!out.exists());
    }
    // A block size that contradicts config.json is a usage error.
    let src = d.path().join("cfg");
    v3_model(&src);
    let o = convert("dequant-fp8", &src, &out, &["--block-size", "64"]);
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    assert!(stderr(&o).contains("disagrees with config.json"));
}

#[test]
fn nan_codes_fail_naming_tensor_and_position_and_leave_nothing() {
    let (d, src) = tmp_in();
    let mut codes = vec![0x38u8; 2048 * 64];
    codes[1500 * 64 + 17] = 0x7F;
    Model::new()
        .tensor("w.weight", DType::F8_E4M3, &[2048, 64], codes)
        .tensor(
            "w.weight_scale_inv",
            DType::F32,
            &[16, 1],
            f32_bytes(&[1.0; 16]),
        )
        .write(&src);
    let out = d.path().join("out");
    let err = fails(&cmd(
        "dequant-fp8",
        &src,
        &out,
        &["--memory-budget", "16MiB"],
    ));
    assert_mentions(
        &err,
        &["model.safetensors: tensor `w.weight`: non-finite F8_E4M3 code 0x7f at [1500, 17]"],
    );
    assert!(!out.exists(), "left behind: {:?}", listing(&out));
    convert_ok("dequant-fp8", &src, &out, &["-q", "--allow-nonfinite"]);
    let w = &load_all(&out)["w.weight"].2;
    let at = (1500 * 64 + 17) * 2;
    assert_eq!(&w[at..at + 2], &0x7FC0u16.to_le_bytes());
}

#[test]
fn compressed_tensors_weight_scale_multiplies_or_divides() {
    let (d, src) = tmp_in();
    let codes: Vec<u8> = (0..=255u8).filter(|c| c & 0x7F != 0x7F).collect();
    let n = codes.len() as u64; // 254 codes, one row each
    let scales: Vec<f32> = (0..n).map(|i| 0.01 * (i + 1) as f32).collect();
    Model::new()
        .tensor("x.weight", DType::F8_E4M3, &[n, 1], codes.clone())
        .tensor("x.weight_scale", DType::F32, &[n, 1], f32_bytes(&scales))
        .write(&src);
    for (mode, divide) in [("multiply", false), ("divide", true)] {
        let out = d.path().join(mode);
        convert_ok(
            "dequant-fp8",
            &src,
            &out,
            &["-q", "--dtype", "f32", "--scale-mode", mode],
        );
        let got = &load_all(&out)["x.weight"].2;
        let want: Vec<u8> = codes
            .iter()
            .zip(&scales)
            .flat_map(|(&c, &s)| {
                (if divide {
                    e4m3_to_f32(c) / s
                } else {
                    e4m3_to_f32(c) * s
                })
                .to_le_bytes()
            })
            .collect();
        assert_eq!(got, &want, "{mode}");
    }
}

#[test]
fn deepseek_v4_e8m0_scales_on_expert_and_dense_weights() {
    let (d, src) = tmp_in();
    let mut rng = Rng(11);
    // Dense E5M2 weight with 32x32 E8M0 blocks, and a 3-D expert stack with per-expert grids.
    let dense: Vec<u8> = (0..64 * 96)
        .map(|_| loop {
            let c = rng.next_u32() as u8;
            if c & 0x7C != 0x7C {
                break c;
            }
        })
        .collect();
    let dense_scale: Vec<u8> = (0..6).map(|i| 120 + i as u8).collect();
    let experts = e4m3_codes(&mut rng, 3 * 40 * 70);
    let expert_scale: Vec<u8> = (0..3 * 2 * 3).map(|i| 118 + (i % 13) as u8).collect();
    Model::new()
        .tensor(
            "layers.0.attn.wq.weight",
            DType::F8_E5M2,
            &[64, 96],
            dense.clone(),
        )
        .tensor(
            "layers.0.attn.wq.scale",
            DType::F8_E8M0,
            &[2, 3],
            dense_scale.clone(),
        )
        .tensor(
            "layers.0.ffn.experts.w1.weight",
            DType::F8_E4M3,
            &[3, 40, 70],
            experts.clone(),
        )
        .tensor(
            "layers.0.ffn.experts.w1.scale",
            DType::F8_E8M0,
            &[3, 2, 3],
            expert_scale.clone(),
        )
        .tensors([
            // MXFP4 experts (I8 codes with E8M0 scales) are not FP8: both pass through.
            t(
                "layers.0.ffn.experts.0.w2.weight",
                DType::I8,
                &[4, 16],
                vec![0x21; 64],
            ),
        ])
        .tensor(
            "layers.0.ffn.experts.0.w2.scale",
            DType::F8_E8M0,
            &[4, 1],
            vec![127; 4],
        )
        .write(&src);
    let out = d.path().join("out");
    convert_ok(
        "dequant-fp8",
        &src,
        &out,
        &["--report", s(&d.path().join("r.json"))],
    );
    let got = load_all(&out);
    let e8m0 = |b: u8| 2f32.powi(b as i32 - 127);
    let want_dense: Vec<u8> = (0..64 * 96)
        .flat_map(|k| {
            let (i, j) = (k / 96, k % 96);
            let y = e5m2_to_f32(dense[k]) * e8m0(dense_scale[(i / 32) * 3 + j / 32]);
            half::bf16::from_f32(y).to_bits().to_le_bytes()
        })
        .collect();
    assert_eq!(got["layers.0.attn.wq.weight"].2, want_dense);
    let want_exp: Vec<u8> = (0..3 * 40 * 70)
        .flat_map(|k| {
            let (e, i, j) = (k / 2800, (k % 2800) / 70, k % 70);
            let y = e4m3_to_f32(experts[k]) * e8m0(expert_scale[e * 6 + (i / 32) * 3 + j / 32]);
            half::bf16::from_f32(y).to_bits().to_le_bytes()
        })
        .collect();
    assert_eq!(got["layers.0.ffn.experts.w1.weight"].1, vec![3, 40, 70]);
    assert_eq!(got["layers.0.ffn.experts.w1.weight"].2, want_exp);
    assert_eq!(got["layers.0.ffn.experts.0.w2.weight"].0, "I8");
    assert_eq!(got["layers.0.ffn.experts.0.w2.scale"].0, "F8_E8M0");
    let r = std::fs::read_to_string(d.path().join("r.json")).unwrap();
    assert!(r.contains("inferred 32x32 blocks"), "{r}");
}

#[test]
fn run_section_order_dequant_then_cast() {
    let (d, src) = tmp_in();
    let (codes, scales, norm) = v3_model(&src);
    let out = d.path().join("out.safetensors");
    convert_ok(
        "run",
        &src,
        &out,
        &[
            "-q",
            "--dequant-fp8",
            "--dtype-cast",
            "f32",
            "--key-rename",
            r"^model\.",
            "",
        ],
    );
    let got = load_all(&out);
    let w = &got["layers.0.mlp.down_proj.weight"];
    assert_eq!(w.0, "F32");
    let want: Vec<u8> = (0..300 * 260)
        .flat_map(|k| {
            (e4m3_to_f32(codes[k]) * scales[(k / 260 / 128) * 3 + (k % 260) / 128]).to_le_bytes()
        })
        .collect();
    assert_eq!(w.2, want);
    assert_eq!(got["layers.0.input_layernorm.weight"].2, norm);
}
