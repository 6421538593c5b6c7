//! BitNet b1.58 to GGUF: the `bitnet` architecture, BitNet's packed ternary checkpoints, and
//! `--outtype auto`'s TQ1_0 for them, against llama.cpp 0c1e570's converter
//! (tests/fixtures/gguf_quant/bitnet.json, scripts/gen-gguf-bitnet-goldens.py; no Python here).

mod common;

use std::path::{Path, PathBuf};

use common::gguf::*;
use common::*;
use serde_json::{json, Value as Json};
use tftf::ops::gguf::kquants::quantize_row_tq1_0;

/// GGUF type ids.
const F32: u64 = 0;
const TQ1_0: u64 = 34;

/// The converter's record of `model` (`bitnet_packed` or `bitnet_latent`) at `--outtype`.
fn golden(model: &str, outtype: &str) -> Json {
    let all = read_json(&fixture("gguf_quant/bitnet.json"));
    all.as_array()
        .unwrap()
        .iter()
        .find(|c| c["model"] == model && c["outtype"] == outtype)
        .unwrap_or_else(|| panic!("no golden for {model} {outtype}"))
        .clone()
}

/// The model folder of the fixture `name` in `dir` (config, tokenizer and, for the packed
/// model, its weights).
fn fixture_model(dir: &Path, name: &str) -> PathBuf {
    let model = dir.join(name);
    std::fs::create_dir(&model).unwrap();
    let src = fixture(&format!("gguf_quant/{name}"));
    for e in std::fs::read_dir(src).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), model.join(e.file_name())).unwrap();
    }
    model
}

/// HF name and shape of every tensor of a BitNet config (the projections unpacked), sorted.
fn bitnet_shapes(cfg: &Json) -> Vec<(String, Vec<u64>)> {
    let sub_norms = [
        ("self_attn.inner_attn_ln", false),
        ("mlp.ffn_layernorm", true),
    ];
    llama_shapes(cfg, false, &sub_norms)
}

/// The latent (1bitLLM-style) model: the fixture's config and tokenizer, BF16 weights made by
/// [`det_bf16`] as the generator makes them (norms around 1).
fn latent_model(dir: &Path, edit: impl FnOnce(&mut Json)) -> PathBuf {
    let model = fixture_model(dir, "bitnet_latent");
    let mut cfg = read_json(&model.join("config.json"));
    edit(&mut cfg);
    std::fs::write(model.join("config.json"), cfg.to_string()).unwrap();
    let tensors = det_bf16_tensors(&bitnet_shapes(&cfg));
    write_file(&model.join("model.safetensors"), &tensors);
    model
}

/// The elements of an F32 tensor.
fn f32s(data: &[u8]) -> Vec<f32> {
    data.chunks_exact(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
        .collect()
}

/// The sign pattern of a ternary F32 tensor (as the generator hashes it) and its one non-zero
/// magnitude.
fn signs_and_magnitude(data: &[u8]) -> (String, f32) {
    let x = f32s(data);
    let signs: Vec<u8> = x
        .iter()
        .map(|v| v.signum() as i8 as u8 * (*v != 0.0) as u8)
        .collect();
    let mags: std::collections::BTreeSet<u32> = (x.iter())
        .filter(|v| **v != 0.0)
        .map(|v| v.abs().to_bits())
        .collect();
    assert_eq!(mags.len(), 1, "one magnitude, not {mags:?}");
    (sha256_hex(&signs), f32::from_bits(*mags.first().unwrap()))
}

/// `case` with tensor `name`'s expected type and bytes replaced.
fn expect_tensor(case: &mut Json, name: &str, ty: u64, data: &[u8]) {
    let t = (case["tensors"].as_array_mut().unwrap().iter_mut())
        .find(|t| t[0] == name)
        .unwrap_or_else(|| panic!("{name} not in the golden"));
    t[1] = json!(ty);
    t[3] = json!(sha256_hex(data));
}

/// `1 / (1 / mean)` in f32, as `weight_quant` makes a ternarised tensor's magnitude.
fn magnitude_of(mean: f32) -> f32 {
    1.0 / (1.0 / mean)
}

/// A latent BitNet checkpoint (BF16 weights that the converter ternarises by their mean
/// magnitude) at `--outtype f32`, `bf16` and `auto`: the converter's file, KVs and tensors,
/// except that a ternarised tensor's magnitude, `1 / (1 / mean|w|)`, comes from the exact mean
/// (summed in f64, rounded once) where the converter takes torch's f32 sum, whose last bits
/// change with its thread count: there the signs must equal the converter's, and its magnitude
/// be the one a mean one unit in the last place from the exact one gives. The 16-bit outputs
/// round those differences away.
#[test]
fn latent_bitnet_equals_the_converter_up_to_the_last_bit_of_its_mean() {
    let d = tmp();
    let model = latent_model(d.path(), |_| {});
    let cfg = read_json(&model.join("config.json"));
    let out = d.path().join("out.gguf");
    let mut last_bit = 0;
    for outtype in ["f32", "bf16", "auto"] {
        let g = to_gguf(&model, &out, "test-pre", &["--outtype", outtype, "--force"]);
        let mut case = golden("bitnet_latent", outtype);
        if outtype == "f32" {
            for (hf, shape) in bitnet_shapes(&cfg)
                .iter()
                .filter(|(n, _)| n.ends_with("_proj.weight"))
            {
                let name = gguf_name(hf);
                let want = &case["ternary"][&name].clone();
                let (_, ty, data) = g.tensor(&name);
                assert_eq!(*ty as u64, F32, "{name}");
                let (signs, mag) = signs_and_magnitude(data);
                assert_eq!(signs, want["signs"].as_str().unwrap(), "{name}: signs");
                let w = det_bf16(hf, shape.iter().product(), 0.0);
                let x: Vec<f32> = (w.chunks_exact(2))
                    .map(|c| half::bf16::from_le_bytes([c[0], c[1]]).to_f32())
                    .collect();
                let sum: f64 = x.iter().map(|v| v.abs() as f64).sum();
                let mean = (sum / x.len() as f64) as f32;
                assert_eq!(
                    mag,
                    magnitude_of(mean),
                    "{name}: the exact mean's magnitude"
                );
                let theirs = u32::from_str_radix(want["magnitude"].as_str().unwrap(), 16);
                let theirs = f32::from_bits(theirs.unwrap());
                if theirs != mag {
                    let near = [mean.to_bits() - 1, mean.to_bits() + 1].map(f32::from_bits);
                    assert!(
                        near.iter().any(|m| magnitude_of(*m) == theirs),
                        "{name}: the converter's magnitude {theirs} is no mean's next to {mean}"
                    );
                    last_bit += 1;
                    expect_tensor(&mut case, &name, F32, data);
                }
            }
        }
        assert_equals_golden(&g, &case, outtype, &[]);
    }
    // The fixture has both kinds: equal means and last-bit differences.
    assert!((1..14).contains(&last_bit), "{last_bit} of 14 differ");

    // llama-quantize's TQ1_0 and TQ2_0 (of the converter's F32 file) encode the ternarised
    // weights as the converter's own `--outtype tq1_0`/`tq2_0` does: the same blocks.
    for outtype in ["tq1_0", "tq2_0"] {
        let g = to_gguf(&model, &out, "test-pre", &["--outtype", outtype, "--force"]);
        let case = golden("bitnet_latent", outtype);
        let mut blocks = 0;
        for t in case["tensors"].as_array().unwrap() {
            let name = t[0].as_str().unwrap();
            if name.ends_with("norm.weight") || name == "token_embd.weight" {
                continue;
            }
            let (_, ty, data) = g.tensor(name);
            assert_eq!(*ty as u64, t[1].as_u64().unwrap(), "{outtype}: {name}");
            assert_eq!(
                sha256_hex(data),
                t[3].as_str().unwrap(),
                "{outtype}: {name}"
            );
            blocks += 1;
        }
        assert_eq!(blocks, 14, "{outtype}");
    }
}

/// A latent tensor ternarised in several chunks (after a survey of its magnitudes) gives the
/// bytes of one chunk: a model whose feed-forward weights exceed a chunk of the smallest memory
/// budget.
#[test]
fn a_latent_tensor_is_ternarised_alike_in_one_chunk_and_in_many() {
    let d = tmp();
    let model = latent_model(d.path(), |c| {
        c["hidden_size"] = json!(1024);
        c["intermediate_size"] = json!(4096);
        c["num_hidden_layers"] = json!(1);
        c["num_attention_heads"] = json!(8);
        c["num_key_value_heads"] = json!(8);
    });
    let (whole, chunked) = (d.path().join("whole.gguf"), d.path().join("chunked.gguf"));
    let opts = ["--outtype", "bf16", "--memory-budget"];
    let a = to_gguf(&model, &whole, "test-pre", &[&opts[..], &["4GiB"]].concat());
    let b = to_gguf(
        &model,
        &chunked,
        "test-pre",
        &[&opts[..], &["16MiB"]].concat(),
    );
    assert_eq!(a.order, b.order);
    for name in &a.order {
        assert!(a.tensor(name) == b.tensor(name), "{name}");
    }
    let up = f32s(
        &a.tensor("blk.0.ffn_up.weight")
            .2
            .chunks_exact(2)
            .flat_map(|c| {
                half::bf16::from_le_bytes([c[0], c[1]])
                    .to_f32()
                    .to_le_bytes()
            })
            .collect::<Vec<u8>>(),
    );
    // Ternary: zero or ± one magnitude.
    assert!(up.iter().any(|v| *v > 0.0) && up.iter().any(|v| *v < 0.0));
    let m = up.iter().fold(0f32, |m, v| m.max(v.abs()));
    assert!(up.iter().all(|v| v.abs() == m || *v == 0.0));
}

/// A packed weight decoded: its values, row length and scale.
struct Decoded {
    x: Vec<f32>,
    cols: u64,
    scale: f32,
}

/// The weights of the packed fixture decoded as BitNet defines them: code `c` of row `r` is
/// field `r / (rows / 4)` of packed row `r mod rows / 4`, worth `(c - 1) / weight_scale`.
fn decode_packed(tensors: &Tensors, hf_weight: &str) -> Decoded {
    let (_, shape, codes) = &tensors[hf_weight];
    let (_, _, scale) = &tensors[&format!("{hf_weight}_scale")];
    let scale = half::bf16::from_le_bytes([scale[0], scale[1]]).to_f32();
    let (p, cols) = (shape[0], shape[1]);
    let mut x = Vec::with_capacity(4 * p * cols);
    for r in 0..4 * p {
        for c in 0..cols {
            let code = (codes[(r % p) * cols + c] >> (2 * (r / p))) & 3;
            assert!(code < 3);
            x.push((code as f32 - 1.0) / scale);
        }
    }
    Decoded {
        x,
        cols: cols as u64,
        scale,
    }
}

/// The GGUF name of a BitNet projection's HF weight.
fn gguf_name(hf: &str) -> String {
    let rest = hf.strip_prefix("model.layers.").unwrap();
    let (l, rest) = rest.split_once('.').unwrap();
    let base = match rest.trim_end_matches(".weight") {
        "self_attn.q_proj" => "attn_q",
        "self_attn.k_proj" => "attn_k",
        "self_attn.v_proj" => "attn_v",
        "self_attn.o_proj" => "attn_output",
        "mlp.gate_proj" => "ffn_gate",
        "mlp.up_proj" => "ffn_up",
        "mlp.down_proj" => "ffn_down",
        other => panic!("{other}"),
    };
    format!("blk.{l}.{base}.weight")
}

/// The packed fixture's projections, decoded, by HF name.
fn packed_projections(model: &Path) -> Vec<(String, Decoded)> {
    let tensors = load_all(&model.join("model.safetensors"));
    (tensors.keys())
        .filter(|n| n.ends_with("_proj.weight"))
        .map(|n| (n.clone(), decode_packed(&tensors, n)))
        .collect()
}

/// A packed BitNet checkpoint (`quant_method: bitnet`, four 2-bit codes a byte and one scale
/// per weight) under `--outtype auto` keeps its ternary weights ternary: TQ1_0 of the decoded
/// weights, `(code - 1) / weight_scale`; the embeddings stay BF16 and the norms F32, as the
/// converter writes them; the KVs are those of the converter's TQ1_0 file (file type 36).
/// At `--outtype f32` every weight has the converter's signs (the unpacking agrees with its
/// `dequant_bitnet`) and its stored magnitude `1 / weight_scale`, where 0c1e570's converter
/// re-ternarises it by its mean magnitude and so multiplies it by its share of non-zero codes.
#[test]
fn packed_bitnet_is_tq1_0_of_its_codes_under_auto_and_keeps_its_scale() {
    let d = tmp();
    let model = fixture_model(d.path(), "bitnet_packed");
    let projections = packed_projections(&model);
    assert_eq!(projections.len(), 14);
    let out = d.path().join("out.gguf");

    let g = to_gguf(&model, &out, "test-pre", &["--outtype", "auto"]);
    let mut case = golden("bitnet_packed", "auto");
    case["kvs"] = golden("bitnet_packed", "tq1_0")["kvs"].clone();
    for (hf, Decoded { x, cols, .. }) in &projections {
        let mut tq = vec![0u8; x.len() / 256 * 54];
        for (row, dst) in x
            .chunks_exact(*cols as usize)
            .zip(tq.chunks_exact_mut(*cols as usize / 256 * 54))
        {
            quantize_row_tq1_0(row, dst, None);
        }
        expect_tensor(&mut case, &gguf_name(hf), TQ1_0, &tq);
    }
    assert_equals_golden(&g, &case, "auto", &[]);

    let g = to_gguf(&model, &out, "test-pre", &["--outtype", "f32", "--force"]);
    let mut case = golden("bitnet_packed", "f32");
    for (hf, Decoded { x, scale, .. }) in &projections {
        let name = gguf_name(hf);
        let (_, _, data) = g.tensor(&name);
        assert_eq!(f32s(data), *x, "{name}: decoded values");
        let (signs, mag) = signs_and_magnitude(data);
        let want = &case["ternary"][&name];
        assert_eq!(signs, want["signs"].as_str().unwrap(), "{name}: signs");
        assert_eq!(mag, 1.0 / scale, "{name}");
        let theirs =
            f32::from_bits(u32::from_str_radix(want["magnitude"].as_str().unwrap(), 16).unwrap());
        let share = x.iter().filter(|v| **v != 0.0).count() as f32 / x.len() as f32;
        assert!(
            ((theirs / mag) - share).abs() < 1e-5,
            "{name}: the converter's magnitude {theirs} is {share} of {mag}"
        );
        let bytes: Vec<u8> = data.to_vec();
        expect_tensor(&mut case, &name, F32, &bytes);
    }
    assert_equals_golden(&g, &case, "f32", &[]);
}

/// `llama-quantize` TQ1_0, TQ2_0 and Q4_K_M of the packed model's converter F32 file: the same
/// KVs, tensor order, per-tensor types (the `bitnet` architecture through llama-quantize's
/// rules: Q6_K embeddings, promoted `attn_v`/`ffn_down`) and, but for the projections, whose
/// magnitudes the converter changed (above), the same bytes.
#[test]
fn packed_bitnet_takes_llama_quantizes_types_for_every_tensor() {
    let d = tmp();
    let model = fixture_model(d.path(), "bitnet_packed");
    let out = d.path().join("out.gguf");
    let all = read_json(&fixture("gguf_quant/bitnet.json"));
    let mixes: Vec<&Json> = (all.as_array().unwrap().iter())
        .filter(|c| c.get("mix").is_some())
        .collect();
    assert_eq!(mixes.len(), 3);
    for case in mixes {
        let mix = case["mix"].as_str().unwrap();
        let g = to_gguf(&model, &out, "test-pre", &["--outtype", mix, "--force"]);
        let mut case = case.clone();
        let names: Vec<String> = (case["tensors"].as_array().unwrap().iter())
            .map(|t| t[0].as_str().unwrap().to_string())
            .filter(|n| n.starts_with("blk.") && !n.ends_with("norm.weight"))
            .collect();
        assert_eq!(names.len(), 14, "{mix}");
        for name in names {
            let (_, _, data) = g.tensor(&name);
            let ty = (case["tensors"].as_array().unwrap().iter())
                .find(|t| t[0] == name.as_str())
                .unwrap()[1]
                .as_u64()
                .unwrap();
            expect_tensor(&mut case, &name, ty, data);
        }
        assert_equals_golden(&g, &case, mix, &[]);
    }
}

/// The packed fixture with `edit` applied to its tensors.
fn edited_packed(dir: &Path, edit: impl FnOnce(&mut Vec<T>)) -> PathBuf {
    let model = fixture_model(dir, "bitnet_packed");
    let file = model.join("model.safetensors");
    let mut tensors = load_ts(&file);
    edit(&mut tensors);
    write_file(&file, &tensors);
    model
}

/// Code 3 (no ternary value) in a packed weight is refused, naming the file, the tensor, the
/// row and the column, and no output is left; a missing, zero or non-finite scale is refused
/// from the headers, before any output exists.
#[test]
fn packed_bitnet_with_a_bad_code_or_scale_is_refused_by_name() {
    let d = tmp();
    let weight = "model.layers.1.mlp.up_proj.weight";
    let model = edited_packed(d.path(), |ts| {
        let w = ts.iter_mut().find(|t| t.0 == weight).unwrap();
        // Byte [3, 7]: field 2 (row 2 · 128 + 3 = 259) becomes 3.
        w.3[3 * 256 + 7] |= 0b11 << 4;
    });
    let out = d.path().join("out.gguf");
    let err = fails(&gguf_args(&model, &out, &["--outtype", "auto"]));
    assert_mentions(
        &err,
        &[
            "model.safetensors",
            weight,
            "code 3 at row 259, column 7 is not a ternary value",
        ],
    );
    assert!(!out.exists());
    assert_eq!(listing(d.path()), ["bitnet_packed"]);

    let scale = "model.layers.0.self_attn.k_proj.weight_scale";
    for (what, edit) in [
        ("missing", None),
        ("zero", Some(0u16)),
        ("infinite", Some(0x7F80)),
    ] {
        let d = tmp();
        let model = edited_packed(d.path(), |ts| match edit {
            None => ts.retain(|t| t.0 != scale),
            Some(bits) => {
                let s = ts.iter_mut().find(|t| t.0 == scale).unwrap();
                s.3 = bits.to_le_bytes().to_vec();
            }
        });
        let out = d.path().join("out.gguf");
        let err = fails(&gguf_args(&model, &out, &["--outtype", "f32"]));
        let needle = match edit {
            None => "model.layers.0.self_attn.k_proj.weight_scale",
            Some(_) => "it divides the codes, so it must be finite and not zero",
        };
        assert_mentions(&err, &["model.safetensors", needle]);
        assert!(!out.exists(), "{what}");
    }
}

/// A latent weight holding a NaN: its mean magnitude, which scales every element, is undefined,
/// so the conversion is refused naming the file, the tensor, the row and the column, and no
/// output is left.
#[test]
fn a_latent_weight_with_a_nan_is_refused_by_name() {
    let d = tmp();
    let model = latent_model(d.path(), |_| {});
    let file = model.join("model.safetensors");
    let weight = "model.layers.1.mlp.gate_proj.weight";
    let mut tensors = load_ts(&file);
    let w = tensors.iter_mut().find(|t| t.0 == weight).unwrap();
    // Row 3, column 17 of [512, 256] BF16.
    let at = 2 * (3 * 256 + 17);
    w.3[at..at + 2].copy_from_slice(&0x7FC0u16.to_le_bytes());
    write_file(&file, &tensors);
    let out = d.path().join("out.gguf");
    let err = fails(&gguf_args(&model, &out, &["--outtype", "bf16"]));
    assert_mentions(
        &err,
        &[
            "model.safetensors",
            weight,
            "NaN at row 3, column 17",
            "needs finite values",
        ],
    );
    assert!(!out.exists());
    assert_eq!(listing(d.path()), ["bitnet_latent"]);
}
