//! `--dtype` casts weights only: scales, global scales, zero points and packed codes of a
//! quantised weight keep their dtype and bytes.

mod common;
use common::*;
use tftf::format::dtype::DType;

fn f32s(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

/// An FP8 block-scaled layer (F32 `weight_scale_inv` whose values BF16 cannot hold), a
/// ModelOpt NVFP4 layer, a DeepSeek-V4 `X.scale`, a KV-cache scale, transformers' fused
/// FineGrainedFP8 experts (`experts.down_proj` with `experts.down_proj_scale_inv`: issue #24
/// item 17), and plain F32 weights.
fn quantised_model(dir: &std::path::Path) -> Vec<T> {
    let scale = f32s(&[1.0 + f32::EPSILON, 3.000_001, 0.123_456_79, 7.777_777]);
    let mut tensors = vec![
        t("fp8.weight", DType::F8_E4M3, &[4, 4], vec![0x38; 16]),
        t("fp8.weight_scale_inv", DType::F32, &[2, 2], scale.clone()),
        t("nv.weight", DType::U8, &[2, 8], vec![0x21; 16]),
        t("nv.weight_scale", DType::F8_E4M3, &[2, 1], vec![0x38, 0x40]),
        t(
            "nv.weight_scale_2",
            DType::F32,
            &[],
            f32s(&[0.000_123_456_7]),
        ),
        t("nv.input_scale", DType::F32, &[], f32s(&[1.000_000_1])),
        t("v4.weight", DType::F8_E4M3, &[2, 32], vec![0x30; 64]),
        t("v4.scale", DType::F8_E8M0, &[2, 1], vec![127, 128]),
        t("attn.k_scale", DType::F32, &[], f32s(&[0.333_333_34])),
        t("norm.weight", DType::F32, &[4], scale),
        t("norm.scale", DType::F32, &[1], f32s(&[1.000_000_1])),
    ];
    for (p, fused, code) in [
        ("down_proj", [2, 2, 4], 0x38),
        ("gate_up_proj", [2, 4, 2], 0x40),
    ] {
        let name = format!("mlp.experts.{p}");
        let scale = f32s(&[0.001_234_567_8 * code as f32, 3.000_001]);
        tensors.push(t(&name, DType::F8_E4M3, &fused, vec![code; 16]));
        tensors.push(t(
            &format!("{name}_scale_inv"),
            DType::F32,
            &[2, 1, 1],
            scale,
        ));
    }
    std::fs::create_dir_all(dir).unwrap();
    write_file(&dir.join("model.safetensors"), &tensors);
    tensors
}

#[test]
fn dtype_casts_weights_and_keeps_every_scale_and_code_as_stored() {
    let (d, src) = tmp_in();
    let tensors = quantised_model(&src);
    let out = d.path().join("out");
    for extra in [&[][..], &["--cast-ints"][..]] {
        let mut args = vec![
            "passthrough",
            "-i",
            s(&src),
            "-o",
            s(&out),
            "--dtype",
            "bf16",
        ];
        args.extend_from_slice(extra);
        args.extend_from_slice(&["--force", "-q"]);
        tftf_ok(&args);
        let got = load_all(&out);
        for (name, dtype, _, data) in &tensors {
            let (got_dtype, _, got_data) = &got[name];
            if name.starts_with("norm.") {
                assert_eq!(got_dtype, "BF16", "{name} is a weight and is cast");
                continue;
            }
            assert_eq!(
                got_dtype,
                dtype.name(),
                "{name} keeps its dtype ({extra:?})"
            );
            assert_eq!(got_data, data, "{name} keeps its bytes ({extra:?})");
        }
    }
}

#[test]
fn dry_run_says_how_many_quantisation_tensors_are_kept() {
    let (d, src) = tmp_in();
    quantised_model(&src);
    let out = d.path().join("out");
    let o = tftf_ok(&cmd(
        "passthrough",
        &src,
        &out,
        &["--dtype", "bf16", "--dry-run"],
    ));
    assert_mentions(&stdout(&o), &["kept 6 quantisation tensor(s) (scales, zero points, packed codes) in their stored dtype; only weights are cast"]);
    assert!(!out.exists());
}
